/*
 * Testing only: a member that misbehaves on purpose (gossip_config's
 * test_attack), so that the reliability tests can check what honest peers
 * do about it. Nothing here runs unless a test asks for it.
 *
 * GOSSIP_TEST_ATTACK_FLOOD: every tick (20 ms), each live peer gets
 * ATTACK_FLOOD_REQS exchange requests (for exchanges that never follow) and
 * one new connection, which is closed as soon as it is up: about 1000
 * requests and 50 connections a second per peer, far above the rate limits.
 * (GOSSIP_TEST_ATTACK_SHORT acts in exchange.c's start_send.)
 *
 * Loop thread.
 */
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

#define ATTACK_FLOOD_REQS 20

static void on_flood_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  if (status == 0 && c) net_conn_close(c);
}

void gossip_attack_tick(struct gossip *g, uint64_t now) {
  if (!(g->cfg.test_attack & GOSSIP_TEST_ATTACK_FLOOD) || !atomic_load(&g->ready)) return;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || m->info.state != SWIM_ALIVE || !m->info.addr[0]) continue;
    for (int k = 0; k < ATTACK_FLOOD_REQS; k++) {
      struct net_msgbuf b;
      net_msgbuf_init(&b, GMSG_XCH_REQ, GOSSIP_PROTO_VERSION);
      net_msgbuf_put_uint(&b, "x", rng_next_u64(&g->rng));
      net_msgbuf_put_uint(&b, "n", g->cfg.nparams);
      net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
      net_msgbuf_put_uint(&b, "step", 0);
      (void)gossip_send(g, m->info.id, &b);
      net_msgbuf_free(&b);
    }
    if (net_dial(g->net, m->info.addr, on_flood_dial, NULL)) log_debug("flood: cannot dial %s", m->info.addr);
  }
}
