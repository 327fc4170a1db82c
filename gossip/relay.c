/*
 * Relays, the membership's side (the transport's is net/relay.c).
 *
 * A member that cannot accept connections — started with --no-inbound, or
 * told by a bootstrap node that dialing it back failed (GMSG_REACH) —
 * registers with a relay and advertises "@RELAY" as its address: SWIM
 * spreads it like any address change, and whoever dials it goes through
 * that relay (net_dial_peer). Relays are the bootstrap nodes and the
 * members that announce one (--relay: the `relay` flag of their SWIM
 * entry), tried in turn; a lost registration is replaced at once.
 *
 * Loop thread only.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

#define RELAY_RETRY_MS 250     /* after a refusal or a loss, before the next candidate */
#define RELAY_REFUSED_MS 30000 /* a candidate that refused is skipped this long */

/* Whether `addr` refused to relay for us lately (and is skipped). */
static bool refused_lately(const struct gossip *g, const char *addr, uint64_t now) {
  const struct gossip_relay *r = &g->relay;
  for (size_t i = 0; i < GOSSIP_RELAY_REFUSED; i++)
    if (r->refused_until[i] > now && strcmp(r->refused[i], addr) == 0) return true;
  return false;
}

/* Remembers that `addr` refused; true the first time in a while. */
static bool note_refusal(struct gossip *g, const char *addr, uint64_t now) {
  struct gossip_relay *r = &g->relay;
  if (refused_lately(g, addr, now)) return false;
  size_t k = r->refused_next++ % GOSSIP_RELAY_REFUSED;
  snprintf(r->refused[k], sizeof r->refused[k], "%s", addr);
  r->refused_until[k] = now + RELAY_REFUSED_MS;
  return true;
}

/* Candidate relays: the bootstrap list, then members that relay (reachable
 * directly, alive, not us), less those that refused lately. Writes at most
 * `max` addresses. */
static size_t candidates(struct gossip *g, const char **out, size_t max, uint64_t now) {
  size_t n = 0;
  for (size_t i = 0; i < g->join.nboot && n < max; i++)
    if (!refused_lately(g, g->join.boot[i], now)) out[n++] = g->join.boot[i];
  for (size_t i = 0; i < g->swim.nmembers && n < max; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.relay && m->info.state == SWIM_ALIVE && m->info.addr[0] &&
        m->info.addr[0] != NET_RELAY_ADDR_PREFIX && !refused_lately(g, m->info.addr, now))
      out[n++] = m->info.addr;
  }
  return n;
}

/* Our address changed: SWIM spreads it (a new incarnation). */
static void set_address(struct gossip *g, const char *addr) {
  swim_set_addr(&g->swim, addr);
  gossip_publish(g);
}

static void on_registered(net_t *n, int status, const char *detail, void *arg) {
  struct gossip *g = arg;
  struct gossip_relay *r = &g->relay;
  (void)n;
  if (g->stopping) return;
  r->pending = false;
  if (status == 0) {
    r->registered = true;
    snprintf(r->via, sizeof r->via, "%s", r->trying);
    char addr[SWIM_ADDR_MAX];
    snprintf(addr, sizeof addr, "%c%.*s", NET_RELAY_ADDR_PREFIX, SWIM_ADDR_MAX - 2, r->via);
    log_info("reachable through the relay %s (advertised as %s)", r->via, addr);
    set_address(g, addr);
    return;
  }
  uint64_t now = gossip_now_ms(g);
  if (r->registered) log_warn("the relay %s is lost (%s); looking for another", r->via, detail);
  else if (status != -EPERM || note_refusal(g, r->trying, now))
    log_warn("relay %s: %s", r->trying, detail && *detail ? detail : rumor_strerror(status));
  r->registered = false;
  r->retry_ms = now + RELAY_RETRY_MS;
}

void gossip_relay_tick(struct gossip *g, uint64_t now) {
  struct gossip_relay *r = &g->relay;
  if (!r->needed || r->registered || r->pending || now < r->retry_ms || g->stopping) return;
  const char *cand[GOSSIP_MAX_BOOTSTRAP + 64];
  size_t n = candidates(g, cand, sizeof cand / sizeof cand[0], now);
  if (n == 0) {
    if (!r->none_logged) log_warn("no relay can take us yet (no bootstrap node or member with --relay accepts)");
    r->none_logged = true;
    r->retry_ms = now + 1000;
    return;
  }
  r->none_logged = false;
  snprintf(r->trying, sizeof r->trying, "%s", cand[r->next++ % n]);
  int rc = net_relay_listen(g->net, r->trying, on_registered, g);
  if (rc) {
    log_debug("relay %s: %s", r->trying, rumor_strerror(rc));
    r->retry_ms = now + RELAY_RETRY_MS;
    return;
  }
  r->pending = true;
}

/* ---- the dial-back: a bootstrap node checks that a joiner can be dialed ---- */

struct dial_back {
  struct gossip *g;
  uint8_t id[NET_PUBKEY_BYTES];
  char addr[SWIM_ADDR_MAX];
};

static void send_reach(struct gossip *g, const uint8_t *id, bool ok, const char *addr, const char *why) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_REACH, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_bool(&b, "ok", ok);
  net_msgbuf_put_str(&b, "addr", addr, strlen(addr));
  net_msgbuf_put_str(&b, "why", why, strnlen(why, 200));
  int rc = gossip_send(g, id, &b);
  if (rc) log_debug("cannot send REACH: %s", rumor_strerror(rc));
  net_msgbuf_free(&b);
}

static void on_dial_back(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct dial_back *d = arg;
  (void)n;
  if (status == 0) {
    bool same = memcmp(net_conn_peer_key(c), d->id, NET_PUBKEY_BYTES) == 0;
    net_conn_close(c);
    if (!d->g->stopping)
      send_reach(d->g, d->id, same, d->addr, same ? "" : "another identity answers at that address");
  } else if (!d->g->stopping) {
    log_info("could not dial the joiner back at %s (%s): it will go through a relay", d->addr, detail);
    send_reach(d->g, d->id, false, d->addr, detail ? detail : rumor_strerror(status));
  }
  free(d);
}

void gossip_relay_dial_back(struct gossip *g, const uint8_t *id, const char *addr) {
  if (g->cfg.role != GOSSIP_ROLE_BOOTSTRAP || addr[0] == NET_RELAY_ADDR_PREFIX) return;
  struct dial_back *d = xmalloc(sizeof *d);
  d->g = g;
  memcpy(d->id, id, NET_PUBKEY_BYTES);
  snprintf(d->addr, sizeof d->addr, "%s", addr);
  if (net_dial(g->net, addr, on_dial_back, d) != 0) free(d);
}

/* A bootstrap node's verdict on our address. */
void gossip_relay_on_reach(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  bool ok;
  const char *addr, *why;
  size_t alen, wlen;
  if (net_msg_get_bool(m, "ok", &ok) || net_msg_get_str(m, "addr", &addr, &alen) ||
      net_msg_get_str(m, "why", &why, &wlen)) {
    log_warn("malformed REACH from %s", net_conn_peer_name(c));
    return;
  }
  struct gossip_relay *r = &g->relay;
  /* Only a verdict on the address we advertise now counts. */
  if (ok || r->needed || alen != strlen(g->swim.self.addr) || memcmp(addr, g->swim.self.addr, alen) != 0) return;
  log_warn("%s could not dial us back at %.*s (%.*s): we are reached through a relay from now on",
           net_conn_peer_name(c), (int)alen, addr, (int)wlen, why);
  r->needed = true;
}
