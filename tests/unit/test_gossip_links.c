/* Links (gossip/links.c) on 127.0.0.1, without a gossip runtime: a hand-made
 * struct gossip whose net dials a plain listening net ("the member").
 *   - a full link queue refuses a message with -ENOBUFS (it used to drop
 *     it and report success), and the queued ones still arrive;
 *   - a dial that completes after the link adopted a connection the member
 *     opened leaves the link on the adopted one, delivers what was queued
 *     once, and takes nothing for lost;
 *   - two members that dial each other at once end on one connection, the
 *     same at both ends: the other is retired and closed once idle, every
 *     message arrives once, and no close is taken for a link's;
 *   - a link that came through a relay from a member with a direct
 *     address dials it, goes direct and retires the relayed connection;
 *   - neighbour choice puts a member whose link waits out a dial backoff
 *     last, and picks it when no one else qualifies.
 *   - a state request that waited in the link's queue for a dial that was
 *     refused is asked again at once, not at the donor's deadline; a lost
 *     dial to another member leaves the pull alone.
 *   - after our loop stalled, a link's new connection tells its member at
 *     once that we are alive; in normal times it tells nothing more.
 * Everything polls with deadlines; nothing sleeps. */
#include <criterion/criterion.h>
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "gossip/gossip_impl.h"

#define DEADLINE_S 5.0
#define MSG_TYPE 200 /* any type: the member's net only counts messages */
#define PICKS 64     /* draws of a uniform choice between two: one side is missed with probability 2^-63 */

static struct gossip *g;
static uv_timer_t tick;  /* bounds each uv_run(UV_RUN_ONCE) */
static uint8_t cluster[NET_CLUSTER_KEY_BYTES];

/* What the two nets saw. */
static struct {
  net_t *member;
  struct net_identity member_id;
  int member_port;
  int member_msgs;       /* control messages the member received */
  int member_closes;     /* its connections closed (from either side) */
  int our_closes;        /* our connections closed */
  int forgot_link;       /* of those, closes that gossip_link_forget took for the link's own */
  int our_msgs;          /* control messages we received */
  net_conn_t *direct;    /* our direct dial to the member (not through the link) */
  int direct_status;
  bool direct_done;
  int nets_closed;
} T;

static void on_tick(uv_timer_t *t) { (void)t; }

#define RUN_UNTIL(cond)                                                                  \
  do {                                                                                   \
    double end_ = clock_now_s() + DEADLINE_S;                                            \
    while (!(cond) && clock_now_s() < end_) uv_run(&g->loop, UV_RUN_ONCE);               \
  } while (0)

static void member_on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  (void)c, (void)m, (void)ud;
  T.member_msgs++;
}

static void member_on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  (void)c, (void)status, (void)detail, (void)ud;
  T.member_closes++;
}

/* Our side's closes go through gossip_link_forget as the runtime's on_close
 * does: only the link's own connection names a member there. */
static void our_on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  (void)status, (void)detail, (void)ud;
  T.our_closes++;
  if (gossip_link_forget(g, c)) T.forgot_link++;
}

static void our_on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  (void)c, (void)m, (void)ud;
  T.our_msgs++;
}

/* As the runtime's on_accept: an inbound connection offered to the link. */
static void our_on_accept(net_conn_t *c, void *ud) {
  (void)ud;
  gossip_link_adopt(g, net_conn_peer_key(c), c);
}

static void config(struct net_config *c, const struct net_identity *id) {
  net_config_defaults(c);
  c->identity = id;
  c->cluster_key = cluster;
  c->handshake_timeout_ms = 2000;
  c->close_linger_ms = 1000;
}

static void setup(void) {
  memset(&T, 0, sizeof T);
  cr_assert_eq(net_crypto_init(), 0);
  cr_assert_eq(net_cluster_key_generate(cluster), 0);
  g = xcalloc(1, sizeof *g);
  pthread_mutex_init(&g->lock, NULL);
  cr_assert_eq(uv_loop_init(&g->loop), 0);
  uv_timer_init(&g->loop, &tick);
  uv_timer_start(&tick, on_tick, 10, 10);
  rng_seed(&g->rng, 42, 1);
  g->cfg.role = GOSSIP_ROLE_PEER;
  cr_assert_eq(net_identity_generate(&g->identity), 0);
  cr_assert_eq(net_identity_generate(&T.member_id), 0);
  struct net_config c;
  struct rumor_err e = {0};
  config(&c, &g->identity);
  static const struct net_callbacks ours = {
      .on_accept = our_on_accept, .on_message = our_on_message, .on_close = our_on_close};
  cr_assert_eq(net_init(&g->net, &g->loop, &c, &ours, NULL, &e), 0, "our net: %s", e.msg);
  config(&c, &T.member_id);
  static const struct net_callbacks member = {.on_message = member_on_message, .on_close = member_on_close};
  cr_assert_eq(net_init(&T.member, &g->loop, &c, &member, NULL, &e), 0, "the member's net: %s", e.msg);
  cr_assert_eq(net_listen(T.member, "127.0.0.1:0", &e), 0, "listen: %s", e.msg);
  T.member_port = net_listen_port(T.member);
}

static void net_closed(void *arg) {
  (void)arg;
  T.nets_closed++;
}

static void on_tick_closed(uv_handle_t *h) { (void)h; }

static void second_member_free(void);
static void relay_free(void);

/* Closes both nets (and the second member's, when a test made one), then
 * checks that the loop closes clean. */
static void teardown(void) {
  second_member_free();
  relay_free();
  net_close(g->net, net_closed, NULL);
  net_close(T.member, net_closed, NULL);
  RUN_UNTIL(T.nets_closed == 2);
  uv_close((uv_handle_t *)&tick, on_tick_closed);
  uv_run(&g->loop, UV_RUN_DEFAULT);
  cr_assert_eq(uv_loop_close(&g->loop), 0, "the loop has handles left");
  free(g->swim.members);
  gossip_links_free(g);
  pthread_mutex_destroy(&g->lock);
  free(g);
}

TestSuite(links, .init = setup, .fini = teardown);

/* The link to the member, with its address (as SWIM would have told it). */
static struct gossip_link *member_link(void) {
  struct gossip_link *l = gossip_link_get(g, T.member_id.pk, true);
  snprintf(l->addr, sizeof l->addr, "127.0.0.1:%d", T.member_port);
  return l;
}

static int send_one(uint64_t seq) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, MSG_TYPE, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "seq", seq);
  int rc = gossip_send(g, T.member_id.pk, &b);
  net_msgbuf_free(&b);
  return rc;
}

Test(links, a_full_queue_refuses_a_message_with_enobufs_and_the_queued_ones_arrive) {
  struct gossip_link *l = member_link();
  /* No loop turn in between: the first send starts the dial, and all wait for it. */
  for (int i = 0; i < GOSSIP_LINK_QUEUE; i++) cr_assert_eq(send_one((uint64_t)i), 0, "message %d not queued", i);
  cr_assert(l->dialing && l->nqueue == GOSSIP_LINK_QUEUE);
  int rc = send_one(GOSSIP_LINK_QUEUE);
  cr_assert_eq(rc, -ENOBUFS, "a message past a full queue: %d (%s), want -ENOBUFS", rc, rumor_strerror(rc));
  cr_assert_eq(l->nqueue, GOSSIP_LINK_QUEUE, "the refused message must not be queued");
  RUN_UNTIL(T.member_msgs == GOSSIP_LINK_QUEUE);
  cr_assert_eq(T.member_msgs, GOSSIP_LINK_QUEUE, "the member received %d of the %d queued messages", T.member_msgs,
               GOSSIP_LINK_QUEUE);
  l = gossip_link_get(g, T.member_id.pk, false);
  cr_assert(l->conn && l->nqueue == 0);
  cr_assert_eq(send_one(99), 0, "with the connection open a message goes out again");
}

static void on_direct(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n, (void)detail, (void)arg;
  T.direct = c;
  T.direct_status = status;
  T.direct_done = true;
}

Test(links, a_dial_that_completes_after_the_link_adopted_a_connection_keeps_the_adopted_one) {
  /* The connection "the member opened to us": any connection authenticated
   * as the member will do for gossip_link_adopt. */
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", T.member_port);
  cr_assert_eq(net_dial_peer(g->net, addr, T.member_id.pk, on_direct, NULL), 0);
  RUN_UNTIL(T.direct_done);
  cr_assert_eq(T.direct_status, 0, "the direct dial failed: %s", rumor_strerror(T.direct_status));
  /* A message queued for the link's dial, then the member's connection
   * adopted while that dial runs. */
  struct gossip_link *l = member_link();
  cr_assert_eq(send_one(1), 0);
  cr_assert(l->dialing && !l->conn);
  gossip_link_adopt(g, T.member_id.pk, T.direct);
  cr_assert_eq(l->conn, T.direct);
  cr_assert_eq(l->nqueue, 0, "adopting a connection sends the queue");
  RUN_UNTIL(!gossip_link_get(g, T.member_id.pk, false)->dialing);
  l = gossip_link_get(g, T.member_id.pk, false);
  cr_assert(!l->dialing, "the link's dial did not complete");
  /* The dialed connection stays open beside it (links.c, on_link_dial:
   * closing it could cut a member's link when both dialed at once). */
  cr_assert_eq(T.our_closes, 0, "a connection closed (%d)", T.our_closes);
  cr_assert_eq(T.forgot_link, 0, "a close was taken for the link's");
  l = gossip_link_get(g, T.member_id.pk, false);
  cr_assert_eq(l->conn, T.direct, "the link keeps the adopted connection");
  RUN_UNTIL(T.member_msgs == 1);
  cr_assert_eq(T.member_msgs, 1, "the queued message arrived %d times, want once", T.member_msgs);
  cr_assert_eq(send_one(2), 0);
  RUN_UNTIL(T.member_msgs == 2);
  cr_assert_eq(T.member_msgs, 2, "the link's connection still carries messages");
}

/* ---- simultaneous dials: a second member with links of its own ---- */

static struct {
  struct gossip *g;
  int msgs, closes, forgot_link;
} M2;

static void m2_on_accept(net_conn_t *c, void *ud) {
  (void)ud;
  gossip_link_adopt(M2.g, net_conn_peer_key(c), c);
}
static void m2_on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  (void)c, (void)m, (void)ud;
  M2.msgs++;
}
static void m2_on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  (void)status, (void)detail, (void)ud;
  M2.closes++;
  if (gossip_link_forget(M2.g, c)) M2.forgot_link++;
}

static void m2_net_closed(void *arg) { *(bool *)arg = true; }

/* Also on a failed assertion's way out (teardown). */
static void second_member_free(void) {
  if (!M2.g) return;
  bool closed = !M2.g->net;
  if (M2.g->net) net_close(M2.g->net, m2_net_closed, &closed);
  RUN_UNTIL(closed);
  gossip_links_free(M2.g);
  pthread_mutex_destroy(&M2.g->lock);
  free(M2.g);
  M2.g = NULL;
}

static int send_seq(struct gossip *from, const uint8_t *to, uint64_t seq) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, MSG_TYPE, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "seq", seq);
  int rc = gossip_send(from, to, &b);
  net_msgbuf_free(&b);
  return rc;
}

static uint64_t open_conns(net_t *n) {
  struct net_stats st;
  net_stats_get(n, &st);
  return st.conns_open;
}

Test(links, members_that_dial_each_other_at_once_agree_on_one_connection) {
  /* We listen too; the second member is a hand-made gossip like ours, on
   * the same loop, whose net adopts what it accepts as the runtime does. */
  struct rumor_err e = {0};
  cr_assert_eq(net_listen(g->net, "127.0.0.1:0", &e), 0, "listen: %s", e.msg);
  memset(&M2, 0, sizeof M2);
  M2.g = xcalloc(1, sizeof *M2.g);
  pthread_mutex_init(&M2.g->lock, NULL);
  cr_assert_eq(net_identity_generate(&M2.g->identity), 0);
  struct net_config c;
  config(&c, &M2.g->identity);
  static const struct net_callbacks m2 = {.on_accept = m2_on_accept, .on_message = m2_on_message,
                                          .on_close = m2_on_close};
  cr_assert_eq(net_init(&M2.g->net, &g->loop, &c, &m2, NULL, &e), 0, "the member's net: %s", e.msg);
  cr_assert_eq(net_listen(M2.g->net, "127.0.0.1:0", &e), 0, "listen: %s", e.msg);
  g->link_retire_ms = M2.g->link_retire_ms = 300;
  struct gossip_link *ours = gossip_link_get(g, M2.g->identity.pk, true);
  snprintf(ours->addr, sizeof ours->addr, "127.0.0.1:%d", net_listen_port(M2.g->net));
  struct gossip_link *theirs = gossip_link_get(M2.g, g->identity.pk, true);
  snprintf(theirs->addr, sizeof theirs->addr, "127.0.0.1:%d", net_listen_port(g->net));

  /* In one loop turn each sends 3 messages to the other: both dial. */
  for (uint64_t i = 0; i < 3; i++) {
    cr_assert_eq(send_seq(g, M2.g->identity.pk, i), 0);
    cr_assert_eq(send_seq(M2.g, g->identity.pk, i), 0);
  }
  cr_assert(ours->dialing && theirs->dialing, "both ends must be dialing");
  RUN_UNTIL(!gossip_link_get(g, M2.g->identity.pk, false)->dialing &&
            !gossip_link_get(M2.g, g->identity.pk, false)->dialing && open_conns(g->net) == 2 &&
            open_conns(M2.g->net) == 2);
  ours = gossip_link_get(g, M2.g->identity.pk, false);
  theirs = gossip_link_get(M2.g, g->identity.pk, false);
  cr_assert_eq(open_conns(g->net), 2, "both dials must have opened (%llu open)",
               (unsigned long long)open_conns(g->net));
  cr_assert(ours->conn && theirs->conn);
  /* The same connection at both ends: ours is outbound exactly when theirs
   * is inbound, and it is the one the smaller key dialed. */
  cr_assert_neq(net_conn_inbound(ours->conn), net_conn_inbound(theirs->conn),
                "the two ends keep different connections");
  bool we_smaller = memcmp(g->identity.pk, M2.g->identity.pk, NET_PUBKEY_BYTES) < 0;
  cr_assert_eq(!net_conn_inbound(ours->conn), we_smaller, "the kept connection is not the smaller key's dial");
  RUN_UNTIL(T.our_msgs == 3 && M2.msgs == 3);
  cr_assert_eq(T.our_msgs, 3, "we received %d of 3", T.our_msgs);
  cr_assert_eq(M2.msgs, 3, "the member received %d of 3", M2.msgs);

  /* The other connection is idle: closed at both ends, neither taken for a link's. */
  RUN_UNTIL(open_conns(g->net) == 1 && open_conns(M2.g->net) == 1);
  cr_assert_eq(open_conns(g->net), 1, "the retired connection did not close (%llu open)",
               (unsigned long long)open_conns(g->net));
  cr_assert_eq(open_conns(M2.g->net), 1);
  cr_assert_eq(T.our_closes, 1);
  cr_assert_eq(M2.closes, 1);
  cr_assert_eq(T.forgot_link + M2.forgot_link, 0, "the retired connection's close was taken for a link's");
  ours = gossip_link_get(g, M2.g->identity.pk, false);
  theirs = gossip_link_get(M2.g, g->identity.pk, false);
  cr_assert(ours->conn && theirs->conn, "the links lost their connection");

  /* The kept one carries on, both ways. */
  cr_assert_eq(send_seq(g, M2.g->identity.pk, 10), 0);
  cr_assert_eq(send_seq(M2.g, g->identity.pk, 10), 0);
  RUN_UNTIL(T.our_msgs == 4 && M2.msgs == 4);
  cr_assert_eq(T.our_msgs + M2.msgs, 8, "after the close: %d and %d of 4", T.our_msgs, M2.msgs);
}

/* ---- a link through a relay: a relay net, and we register with it ---- */

static net_t *relay_net;
static int relay_status = 1, member_dial_status = 1;

static void relay_closed(void *arg) { *(bool *)arg = true; }

/* Also on a failed assertion's way out (teardown). */
static void relay_free(void) {
  if (!relay_net) return;
  bool closed = false;
  net_close(relay_net, relay_closed, &closed);
  RUN_UNTIL(closed);
  relay_net = NULL;
}

static void on_registered(net_t *n, int status, const char *detail, void *arg) {
  (void)n, (void)detail, (void)arg;
  if (relay_status == 1) relay_status = status;
}

static void on_member_dialed(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n, (void)c, (void)detail, (void)arg;
  member_dial_status = status;
}

/* We cannot be dialed (we do not listen: setup) and register with a relay;
 * the member, which listens, reaches us through it first. The link takes
 * that relayed connection, then dials the member's own address: the direct
 * connection becomes the link's, and the relayed one is retired and closes
 * once idle. Before, the link stayed on the relay for good. */
Test(links, a_link_that_came_through_a_relay_goes_direct) {
  struct rumor_err e = {0};
  struct net_identity relay_id;
  cr_assert_eq(net_identity_generate(&relay_id), 0);
  struct net_config c;
  config(&c, &relay_id);
  c.relay = true;
  static const struct net_callbacks none = {0};
  cr_assert_eq(net_init(&relay_net, &g->loop, &c, &none, NULL, &e), 0, "the relay's net: %s", e.msg);
  cr_assert_eq(net_listen(relay_net, "127.0.0.1:0", &e), 0, "listen: %s", e.msg);
  char ra[64], via[80];
  snprintf(ra, sizeof ra, "127.0.0.1:%d", net_listen_port(relay_net));
  relay_status = member_dial_status = 1;
  cr_assert_eq(net_relay_listen(g->net, ra, on_registered, NULL), 0);
  RUN_UNTIL(relay_status != 1);
  cr_assert_eq(relay_status, 0, "the relay did not take us: %s", rumor_strerror(relay_status));
  g->link_retire_ms = 300;
  struct gossip_link *l = member_link();
  snprintf(via, sizeof via, "%c%s", NET_RELAY_ADDR_PREFIX, ra);
  cr_assert_eq(net_dial_peer(T.member, via, g->identity.pk, on_member_dialed, NULL), 0);
  RUN_UNTIL(member_dial_status != 1);
  cr_assert_eq(member_dial_status, 0, "the member's dial through the relay: %s", rumor_strerror(member_dial_status));
  RUN_UNTIL(({
    l = gossip_link_get(g, T.member_id.pk, false);
    l->conn && !net_conn_relayed(l->conn) && !l->dialing;
  }));
  l = gossip_link_get(g, T.member_id.pk, false);
  cr_assert(l->conn, "the link has no connection");
  cr_assert(!net_conn_relayed(l->conn), "the link stayed on the relay");
  cr_assert(!net_conn_inbound(l->conn), "the direct connection is our dial");
  cr_assert_eq(l->direct_failures, 0, "a direct dial failed");
  /* The relayed one closes once idle (the carrier to the relay and the
   * direct one stay); its close is not the link's. */
  RUN_UNTIL(T.our_closes >= 1 && open_conns(g->net) == 2);
  cr_assert_geq(T.our_closes, 1, "the relayed connection was not retired");
  cr_assert_eq(open_conns(g->net), 2, "%llu connections open, want the relay's carrier and the direct one",
               (unsigned long long)open_conns(g->net));
  cr_assert_eq(T.forgot_link, 0, "the retired connection's close was taken for the link's");
  cr_assert_eq(send_one(1), 0);
  RUN_UNTIL(T.member_msgs == 1);
  cr_assert_eq(T.member_msgs, 1, "the direct link carries messages");
  relay_free();
}

/* ---- neighbour choice: no network needed, only the member table ---- */

static void add_member(int k) {
  g->swim.members = xrealloc(g->swim.members, (g->swim.nmembers + 1) * sizeof *g->swim.members);
  struct swim_member *m = &g->swim.members[g->swim.nmembers++];
  memset(m, 0, sizeof *m);
  m->info.id[0] = (uint8_t)k;
  m->info.id[31] = 0x5A;
  snprintf(m->info.addr, sizeof m->info.addr, "127.0.0.1:%d", 1000 + k); /* never dialed */
  m->info.role = SWIM_ROLE_PEER;
  m->info.state = SWIM_ALIVE;
  m->info.ready = true;
}

/* Counts, over PICKS draws, how often `pick` chose member 0 and member 1. */
static void count_picks(bool partner, const uint8_t *exclude, int *got) {
  got[0] = got[1] = 0;
  for (int i = 0; i < PICKS; i++) {
    uint8_t out[NET_PUBKEY_BYTES];
    bool ok = partner ? gossip_pick_partner(g, out, exclude) : gossip_pick_peer(g, out, exclude, true);
    cr_assert(ok, "nobody picked");
    for (int k = 0; k < 2; k++)
      if (memcmp(out, g->swim.members[k].info.id, NET_PUBKEY_BYTES) == 0) got[k]++;
  }
}

Test(links, partners_and_donors_in_a_dial_backoff_come_last) {
  add_member(1);
  add_member(2);
  uint64_t now = gossip_now_ms(g);
  /* Member 0's last dial failed; its backoff runs 5 s more. */
  struct gossip_link *l = gossip_link_get(g, g->swim.members[0].info.id, true);
  snprintf(l->addr, sizeof l->addr, "%s", g->swim.members[0].info.addr);
  l->dial_failures = 1;
  l->next_dial_ms = now + 5000;
  cr_assert(gossip_link_dial_backed_off(g, g->swim.members[0].info.id, now));
  cr_assert(!gossip_link_dial_backed_off(g, g->swim.members[1].info.id, now));
  int got[2];
  for (int partner = 0; partner < 2; partner++) {
    count_picks(partner, NULL, got);
    cr_assert_eq(got[0], 0, "%s: the member in a dial backoff was picked %d of %d times",
                 partner ? "partner" : "donor", got[0], PICKS);
    cr_assert_eq(got[1], PICKS);
    /* With the other one excluded, it is the only choice: still picked. */
    count_picks(partner, g->swim.members[1].info.id, got);
    cr_assert_eq(got[0], PICKS, "%s: a member in a dial backoff must be the fallback",
                 partner ? "partner" : "donor");
  }
  /* The backoff over, it is an equal choice again (among donors: partners
   * also go by rank). */
  l->next_dial_ms = now;
  count_picks(false, NULL, got);
  cr_assert(got[0] > 0 && got[1] > 0, "after the backoff: %d and %d of %d", got[0], got[1], PICKS);
}

/* A port on 127.0.0.1 where nothing listens: bound, then let go. */
static int closed_port(void) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t len = sizeof a;
  cr_assert_eq(bind(fd, (struct sockaddr *)&a, sizeof a), 0);
  cr_assert_eq(getsockname(fd, (struct sockaddr *)&a, &len), 0);
  close(fd);
  return ntohs(a.sin_port);
}

/* A message queued on the member's link, whose address no longer answers:
 * the dial that is to carry it will be refused. */
static void queue_for_a_refused_dial(void) {
  struct gossip_link *l = gossip_link_get(g, T.member_id.pk, true);
  snprintf(l->addr, sizeof l->addr, "127.0.0.1:%d", closed_port());
  cr_assert_eq(send_one(1), 0, "the message is queued for the dial");
}

/* A newcomer's pull whose state request waits in the donor's link queue
 * (join.c, pull_tick): the donor deadline is a minute away, as the
 * exchange timeout would set it. */
static void pull_waiting_on(const uint8_t *donor) {
  struct gossip_join *j = &g->join;
  j->pulling = true;
  j->req_queued = true;
  j->pull_conn = NULL;
  memcpy(j->donor, donor, NET_PUBKEY_BYTES);
  j->pull_retry_ms = gossip_now_ms(g) + 60000;
}

/* The donor's address no longer answers (it moved behind a relay, say): the
 * dial that was to carry our request is refused and the request is lost
 * with the link's queue (gossip_on_link_lost). The pull used to wait for
 * the donor deadline, a minute without a state. */
Test(links, a_state_request_lost_with_its_links_dial_is_asked_again_at_once) {
  queue_for_a_refused_dial();
  pull_waiting_on(T.member_id.pk);
  uint64_t sent = gossip_now_ms(g);
  RUN_UNTIL(!g->join.pulling);
  cr_assert(!g->join.pulling, "the pull still waits for its donor after the dial was refused");
  cr_assert_leq(g->join.pull_retry_ms, gossip_now_ms(g) + 200, "the next donor is asked %llu ms after the request",
                (unsigned long long)(g->join.pull_retry_ms - sent));
  const struct gossip_link *l = gossip_link_get(g, T.member_id.pk, false);
  cr_assert_eq(l->nqueue, 0, "the queue went with the dial");
  cr_assert_gt(l->dial_failures, 0);
}

/* A dial to someone else than the donor fails: the pull goes on waiting for
 * its donor, whose answer can still come. */
Test(links, a_lost_dial_to_another_member_leaves_the_pull_alone) {
  queue_for_a_refused_dial();
  struct net_identity other;
  cr_assert_eq(net_identity_generate(&other), 0);
  pull_waiting_on(other.pk);
  uint64_t deadline = g->join.pull_retry_ms;
  RUN_UNTIL(gossip_link_get(g, T.member_id.pk, false)->dial_failures > 0);
  cr_assert_gt(gossip_link_get(g, T.member_id.pk, false)->dial_failures, 0, "the dial was refused");
  cr_assert(g->join.pulling, "a lost dial to another member ended the pull");
  cr_assert_eq(g->join.pull_retry_ms, deadline, "the donor deadline moved");
}

/* ---- after our loop stalled: new connections carry our news ----
 * A stopped process resumes and tells every member that it is alive on the
 * connections it holds; those the members closed under it by their
 * heartbeat verdicts lose that news (bench-chaos: SWIM's piggybacking then
 * took 0.9 s to bring it to the last of eight, and the ring re-formed once
 * per member meanwhile). For the stall window (stalled_until_ms) a link's
 * new connection tells its member at once (link_take, swim_tell_self). */
static int told_self; /* SWIM pings to the member carrying our own update alone */

static void record_ping(void *ctx, const struct swim_member *to, uint64_t seq, const struct swim_update *u, size_t n) {
  (void)ctx, (void)seq;
  if (memcmp(to->info.id, T.member_id.pk, NET_PUBKEY_BYTES) == 0 && n == 1 &&
      memcmp(u->id, g->identity.pk, NET_PUBKEY_BYTES) == 0 && u->state == SWIM_ALIVE)
    told_self++;
}

/* The member, alive in our SWIM view, and our own entry. */
static void member_in_view(void) {
  told_self = 0;
  memcpy(g->swim.self.id, g->identity.pk, NET_PUBKEY_BYTES);
  g->swim.io.send_ping = record_ping;
  add_member(0);
  memcpy(g->swim.members[g->swim.nmembers - 1].info.id, T.member_id.pk, NET_PUBKEY_BYTES);
}

Test(links, after_our_loop_stalled_a_new_connection_tells_its_member_that_we_are_alive) {
  member_link();
  member_in_view();
  g->stalled_until_ms = gossip_now_ms(g) + 60000;
  cr_assert_eq(send_one(1), 0);
  RUN_UNTIL(T.member_msgs == 1 && told_self > 0);
  cr_assert_eq(T.member_msgs, 1, "the queued message did not arrive");
  cr_assert_eq(told_self, 1, "the new connection carried our news %d times (once expected)", told_self);
}

Test(links, a_new_connection_outside_a_stall_tells_nothing_more) {
  member_link();
  member_in_view();
  g->stalled_until_ms = 0;
  cr_assert_eq(send_one(1), 0);
  RUN_UNTIL(T.member_msgs == 1);
  cr_assert_eq(T.member_msgs, 1);
  cr_assert_eq(told_self, 0, "a connection opened in normal times sent an extra SWIM ping");
}
