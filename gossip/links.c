/*
 * Links: one connection per member identity (dialed on demand, with
 * messages queued while the dial runs and a backoff after failures), and
 * neighbour choice among the members. Loop thread.
 *
 * A queued message goes out on the link's connection as soon as it has
 * one: the link's next dial succeeds, or the member connects to us first.
 * It is dropped with the whole queue when that dial fails (refused,
 * unreachable, a failed handshake, another identity) or cannot start; the
 * runtime is then told (gossip_on_link_lost), so that a part waiting for an
 * answer to it need not wait for its own timeout. A queue left during a
 * backoff is dialed for when the backoff ends (gossip_links_tick). A full
 * queue refuses the next message (gossip_send: -ENOBUFS).
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

static void drop_queue(struct gossip_link *l) {
  for (size_t i = 0; i < l->nqueue; i++) free(l->queue[i]);
  l->nqueue = 0;
}

void gossip_links_free(struct gossip *g) {
  for (size_t i = 0; i < g->links.n; i++) drop_queue(&g->links.v[i]);
  free(g->links.v);
  memset(&g->links, 0, sizeof g->links);
}

struct gossip_link *gossip_link_get(struct gossip *g, const uint8_t *id, bool create) {
  struct gossip_links *ls = &g->links;
  for (size_t i = 0; i < ls->n; i++)
    if (memcmp(ls->v[i].id, id, NET_PUBKEY_BYTES) == 0) return &ls->v[i];
  if (!create) return NULL;
  if (ls->n == ls->cap) {
    ls->cap = ls->cap ? 2 * ls->cap : 16;
    ls->v = xrealloc(ls->v, ls->cap * sizeof *ls->v);
  }
  struct gossip_link *l = &ls->v[ls->n++];
  memset(l, 0, sizeof *l);
  memcpy(l->id, id, NET_PUBKEY_BYTES);
  return l;
}

/* Sends `l`'s queue on the link's connection, the one whose close the parts
 * hear of as this link's (gossip_link_forget), and empties it. */
static void flush_queue(struct gossip_link *l) {
  for (size_t i = 0; i < l->nqueue; i++) {
    int rc = net_conn_send_raw_msg(l->conn, l->queue[i], l->queue_len[i]);
    if (rc) log_debug("queued message to %s dropped: %s", l->addr, rumor_strerror(rc));
  }
  drop_queue(l);
}

/* Which of two open connections to one member both ends keep when each
 * dialed the other at once: a direct one before one over a relay, then the
 * one dialed by the smaller key. Both ends compute the same answer from
 * what both know (who dialed, relayed or not). Returns the one to keep, or
 * NULL when the rule cannot tell them apart (the same side dialed both, as
 * a relay's carrier beside a dial of ours): then the link keeps its own. */
static net_conn_t *agreed_conn(const struct gossip *g, net_conn_t *a, net_conn_t *b) {
  bool ra = net_conn_relayed(a), rb = net_conn_relayed(b);
  if (ra != rb) return ra ? b : a;
  bool ia = net_conn_inbound(a), ib = net_conn_inbound(b);
  if (ia == ib) return NULL;
  /* Ours wins when our key is the smaller. */
  bool ours_wins = memcmp(g->identity.pk, net_conn_peer_key(a), NET_PUBKEY_BYTES) < 0;
  net_conn_t *ours = ia ? b : a;
  return ours_wins ? ours : (ours == a ? b : a);
}

static int dial_link(struct gossip *g, struct gossip_link *l);
static struct gossip_link *addressed_link(struct gossip *g, const uint8_t *id);

/* A link that runs through a relay to a member that advertises a direct
 * address is dialed directly. A member reaches us through a relay only
 * when we cannot accept connections, but we can usually dial out: without
 * this, a link stayed on the relay for the run whenever the member dialed
 * first (every ring hop, exchange and heartbeat with it then crossed the
 * relay, at its rate cap, where a direct link was to be had). The direct
 * connection replaces the relayed one at both ends (agreed_conn prefers it;
 * the relayed one is retired and closes once idle). A dial that fails backs
 * off as any does (on_link_dial) and the link stays on the relay; after
 * GOSSIP_DIRECT_TRIES failures (the member is out of our reach: a refusal,
 * no route, another identity, a dial that cannot start) no more are made
 * until the link takes another relayed connection or the member's address
 * changes. */
#define GOSSIP_DIRECT_TRIES 3
static void go_direct(struct gossip *g, struct gossip_link *l) {
  if (!g->net || g->stopping || !l->conn || !net_conn_relayed(l->conn) || l->dialing ||
      l->direct_failures >= GOSSIP_DIRECT_TRIES)
    return;
  /* The link exists: addressed_link only fills in its address from SWIM. */
  if (!addressed_link(g, l->id) || l->addr[0] == NET_RELAY_ADDR_PREFIX) return;
  if (dial_link(g, l) != 0) {
    l->direct_failures++; /* could not start: counted as a failure */
    return;
  }
  if (!l->dialing) return; /* its backoff holds: the next take or member update tries again */
  l->direct_dial = true;
  log_debug("the link to %s runs through a relay: dialing %s directly", net_conn_peer_name(l->conn), l->addr);
}

/* `c`, open to `l`'s member, becomes the link's connection unless it has
 * one; when it has, both ends agree on one of the two (agreed_conn) and
 * retire the other (net_conn_retire): nothing new starts on it, exchanges
 * under way on it finish, and the net closes it once it has been idle for
 * g->link_retire_ms. Without this, each end of a simultaneous dial may keep
 * a different one, and both stay open for the run. */
static void link_take(struct gossip *g, struct gossip_link *l, net_conn_t *c) {
  if (l->conn == c) return;
  if (net_conn_relayed(c)) l->direct_failures = 0; /* a new relayed connection: try to leave it again */
  if (!l->conn) {
    l->conn = c;
    /* Messages queued for a dial (under way, or waiting out its backoff)
     * go out now: once the link has a connection no dial is made for them. */
    flush_queue(l);
    /* Our loop just stalled (check_stall): the news that we are alive went
     * out on the connections we held, which the members had closed under
     * us by their heartbeat verdicts; it reached them only as SWIM's
     * piggybacking went round, ~1 s for the last of eight in bench-chaos,
     * and the ring re-formed as each one took us back. The new connection
     * carries it at once. */
    if (gossip_now_ms(g) < g->stalled_until_ms) swim_tell_self(&g->swim, l->id);
    go_direct(g, l);
    return;
  }
  net_conn_t *keep = agreed_conn(g, l->conn, c);
  if (!keep) return; /* c stays open, untracked, as it came (the net's own, or idle in time) */
  net_conn_t *retire = keep == c ? l->conn : c;
  if (retire == l->conn && net_conn_relayed(retire) && !net_conn_relayed(keep))
    log_info("the link to %s is direct now; the one through the relay is retired", net_conn_peer_name(keep));
  else
    log_debug("two connections to %s (both ends dialed): keeping %s, retiring %s", net_conn_peer_name(c),
              net_conn_inbound(keep) ? "theirs" : "ours", net_conn_inbound(retire) ? "theirs" : "ours");
  l->conn = keep;
  flush_queue(l);
  net_conn_retire(retire, g->link_retire_ms);
  go_direct(g, l);
}

void gossip_link_adopt(struct gossip *g, const uint8_t *id, net_conn_t *c) {
  link_take(g, gossip_link_get(g, id, true), c);
}

const uint8_t *gossip_link_forget(struct gossip *g, net_conn_t *c) {
  const uint8_t *id = NULL;
  for (size_t i = 0; i < g->links.n; i++)
    if (g->links.v[i].conn == c) {
      g->links.v[i].conn = NULL;
      id = g->links.v[i].id;
    }
  return id;
}

void gossip_link_on_member(struct gossip *g, const struct swim_update *m, bool gone) {
  struct gossip_link *l = gossip_link_get(g, m->id, true);
  if (m->addr[0] && strcmp(l->addr, m->addr) != 0) {
    snprintf(l->addr, sizeof l->addr, "%s", m->addr);
    l->next_dial_ms = 0;
    l->dial_failures = l->direct_failures = 0;
  }
  if (gone && l->conn) net_conn_close(l->conn);
  else go_direct(g, l); /* its address may have come after its connection through a relay */
}

/* Drops `l`'s queue, lost because its dial failed (`why`), and tells the
 * runtime when it held anything. `l` may be invalid afterwards (the parts
 * told may create links). */
static void lose_queue(struct gossip *g, struct gossip_link *l, const char *why) {
  if (!l->nqueue) return;
  uint8_t id[NET_PUBKEY_BYTES];
  memcpy(id, l->id, sizeof id);
  drop_queue(l);
  gossip_on_link_lost(g, id, why);
}

struct dial_ctx {
  struct gossip *g;
  uint8_t id[NET_PUBKEY_BYTES];
};

static void on_link_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct dial_ctx *d = arg;
  struct gossip *g = d->g;
  struct gossip_link *l = gossip_link_get(g, d->id, true);
  l->dialing = false;
  free(d);
  bool direct = l->direct_dial;
  l->direct_dial = false;
  if (direct && (status < 0 || memcmp(net_conn_peer_key(c), l->id, NET_PUBKEY_BYTES) != 0)) l->direct_failures++;
  char why[160];
  if (status < 0) {
    l->dial_failures++;
    uint64_t backoff = 100ull << (l->dial_failures < 6 ? l->dial_failures : 6);
    l->next_dial_ms = gossip_now_ms(g) + (backoff > 5000 ? 5000 : backoff);
    snprintf(why, sizeof why, "dial %s failed: %s", l->addr, detail && *detail ? detail : rumor_strerror(status));
    log_debug("%s", why);
    lose_queue(g, l, why);
    return;
  }
  if (memcmp(net_conn_peer_key(c), l->id, NET_PUBKEY_BYTES) != 0) {
    /* Someone else answers at that address now (a restarted node with a new
     * identity, a reused port): not the member we wanted. */
    log_info("%s answered with another identity than expected; closing", net_conn_peer_name(c));
    net_conn_close(c);
    snprintf(why, sizeof why, "%s answered with another identity", l->addr);
    lose_queue(g, l, why);
    return;
  }
  l->dial_failures = 0;
  /* The member may have connected to us while we dialed, and
   * gossip_link_adopt took that connection (and sent the queue on it): the
   * two ends then agree on one (link_take). */
  link_take(g, l, c);
  flush_queue(l); /* on the link's connection */
}

/* Starts a dial to `l` unless one is under way or its backoff holds. */
static int dial_link(struct gossip *g, struct gossip_link *l) {
  if (l->dialing || gossip_now_ms(g) < l->next_dial_ms) return 0;
  struct dial_ctx *d = xmalloc(sizeof *d);
  d->g = g;
  memcpy(d->id, l->id, NET_PUBKEY_BYTES);
  int rc = net_dial_peer(g->net, l->addr, l->id, on_link_dial, d);
  if (rc) {
    free(d);
    l->next_dial_ms = gossip_now_ms(g) + 1000;
    char why[160];
    snprintf(why, sizeof why, "cannot dial %s: %s", l->addr, rumor_strerror(rc));
    lose_queue(g, l, why);
    return rc;
  }
  l->dialing = true;
  return 0;
}

void gossip_links_tick(struct gossip *g, uint64_t now) {
  if (!g->net) return;
  /* By index: a dial that cannot start tells the parts, which may add links. */
  for (size_t i = 0; i < g->links.n; i++) {
    struct gossip_link *l = &g->links.v[i];
    if (l->nqueue && !l->conn && !l->dialing && now >= l->next_dial_ms && l->addr[0]) (void)dial_link(g, l);
  }
}

/* The link to `id` with its address known, or NULL. */
static struct gossip_link *addressed_link(struct gossip *g, const uint8_t *id) {
  struct gossip_link *l = gossip_link_get(g, id, true);
  if (!l->addr[0]) {
    struct swim_member *m = swim_find(&g->swim, id);
    if (!m || !m->info.addr[0]) return NULL;
    snprintf(l->addr, sizeof l->addr, "%s", m->info.addr);
  }
  return l;
}

int gossip_send(struct gossip *g, const uint8_t *id, struct net_msgbuf *b) {
  if (!g->net) return -ENOTCONN;
  struct gossip_link *l = gossip_link_get(g, id, true);
  if (l->conn) return net_conn_send_msg(l->conn, b);
  if (!(l = addressed_link(g, id))) return -EHOSTUNREACH;
  if (l->nqueue == GOSSIP_LINK_QUEUE) {
    /* The dial it waits for (or its backoff) is still on: no room. */
    char label[200];
    gossip_member_label(g, id, label, sizeof label);
    log_debug("message to %s dropped: %d messages already wait for a connection", label, GOSSIP_LINK_QUEUE);
    return -ENOBUFS;
  }
  size_t len;
  const uint8_t *data = net_msgbuf_data(b, &len);
  if (!data) return -ENOMEM;
  l->queue[l->nqueue] = xmalloc(len);
  memcpy(l->queue[l->nqueue], data, len);
  l->queue_len[l->nqueue++] = len;
  return dial_link(g, l);
}

bool gossip_link_open(struct gossip *g, const uint8_t *id) {
  const struct gossip_link *l = gossip_link_get(g, id, false);
  return l && l->conn;
}

net_conn_t *gossip_link_conn(struct gossip *g, const uint8_t *id) {
  if (!g->net) return NULL;
  struct gossip_link *l = gossip_link_get(g, id, true);
  if (l->conn) return l->conn;
  if ((l = addressed_link(g, id))) (void)dial_link(g, l);
  return NULL;
}

/* ---- neighbour choice ---- */

/* Rank of `id` among the alive peers and ourselves (when we are a peer),
 * ordered by key. */
static size_t peer_rank(struct gossip *g, const uint8_t *id) {
  size_t r = 0;
  if (g->cfg.role == GOSSIP_ROLE_PEER && memcmp(g->identity.pk, id, NET_PUBKEY_BYTES) < 0) r++;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role == SWIM_ROLE_PEER && m->info.state == SWIM_ALIVE &&
        memcmp(m->info.id, id, NET_PUBKEY_BYTES) < 0)
      r++;
  }
  return r;
}

void gossip_update_role(struct gossip *g) {
  atomic_store(&g->active, peer_rank(g, g->identity.pk) % 2 == 0);
}

/* False for a member that advertises "@" alone (it cannot accept connections
 * and has no relay yet: relay.c) and to which no connection is open: no one
 * can reach it until its relay's address arrives. */
static bool reachable(struct gossip *g, const struct swim_member *m) {
  if (m->info.addr[0] != NET_RELAY_ADDR_PREFIX || m->info.addr[1]) return true;
  const struct gossip_link *l = gossip_link_get(g, m->info.id, false);
  return l && l->conn;
}

/* True while a message to `id` would wait out a dial backoff: no connection
 * is open, and the last dial failed or could not start less than its
 * backoff ago (on_link_dial, dial_link). `now` in loop milliseconds. */
bool gossip_link_dial_backed_off(struct gossip *g, const uint8_t *id, uint64_t now) {
  const struct gossip_link *l = gossip_link_get(g, id, false);
  return l && !l->conn && now < l->next_dial_ms;
}

/* What pick_member asks of a candidate, besides being an alive, reachable
 * peer, other than `exclude`, and not backed off by the guard. */
enum pick_filter {
  PICK_READY = 1 << 0,    /* it has its state (a donor, a partner) */
  PICK_PASSIVE = 1 << 1,  /* it ranks odd (gossip_update_role) */
  PICK_TRAINING = 1 << 2, /* not known to have finished (gossip_guard_finished) */
  PICK_DIALABLE = 1 << 3, /* its link is not in a dial backoff (gossip_link_dial_backed_off) */
};

/* An alive peer we can reach: what every pick and count below asks first. */
static bool live_reachable_peer(struct gossip *g, const struct swim_member *m) {
  return m->info.role == SWIM_ROLE_PEER && m->info.state == SWIM_ALIVE && reachable(g, m);
}

/* A uniformly random alive peer other than `exclude` (may be NULL) that is
 * not backed off, can be reached, and passes `filters` (enum pick_filter). */
static bool pick_member(struct gossip *g, uint8_t *out, const uint8_t *exclude, unsigned filters) {
  uint64_t now = gossip_now_ms(g);
  size_t n = 0;
  size_t *cand = xmalloc((g->swim.nmembers + 1) * sizeof *cand);
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (!live_reachable_peer(g, m)) continue;
    if (exclude && memcmp(m->info.id, exclude, NET_PUBKEY_BYTES) == 0) continue;
    if (gossip_backed_off(g, m->info.id, now)) continue;
    if ((filters & PICK_READY) && !m->info.ready) continue;
    if ((filters & PICK_PASSIVE) && peer_rank(g, m->info.id) % 2 == 0) continue;
    if ((filters & PICK_TRAINING) && gossip_guard_finished(g, m->info.id)) continue;
    if ((filters & PICK_DIALABLE) && gossip_link_dial_backed_off(g, m->info.id, now)) continue;
    cand[n++] = i;
  }
  bool ok = n > 0;
  if (ok) memcpy(out, g->swim.members[cand[rng_below(&g->rng, n)]].info.id, NET_PUBKEY_BYTES);
  free(cand);
  return ok;
}

/* A member whose link waits out a dial backoff comes last: a message to it
 * would wait up to that backoff (5 s at most) in the link's queue before
 * its loss could send us to someone else. */
bool gossip_pick_peer(struct gossip *g, uint8_t *out, const uint8_t *exclude, bool donors_only) {
  unsigned f = donors_only ? PICK_READY : 0;
  return pick_member(g, out, exclude, f | PICK_DIALABLE) || pick_member(g, out, exclude, f);
}

size_t gossip_count_donors(struct gossip *g, const uint8_t (*skip)[NET_PUBKEY_BYTES], size_t nskip) {
  size_t n = 0;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (!live_reachable_peer(g, m) || !m->info.ready) continue;
    bool skipped = false;
    for (size_t k = 0; k < nskip && !skipped; k++) skipped = memcmp(skip[k], m->info.id, NET_PUBKEY_BYTES) == 0;
    n += !skipped;
  }
  return n;
}

/* Partners in order of preference, each among members that pass `also`. */
static bool pick_partner_among(struct gossip *g, uint8_t *out, const uint8_t *exclude, unsigned also) {
  /* Finished (gossip_finished): partners that still train first (they are
   * who we wait for); then the finished ones, which pass on what they took
   * from those we cannot reach (the bipartite graph keeps one side apart). */
  unsigned f = PICK_READY | also;
  if (atomic_load(&g->finished) && (pick_member(g, out, exclude, f | PICK_PASSIVE | PICK_TRAINING) ||
                                    pick_member(g, out, exclude, f | PICK_TRAINING)))
    return true;
  return pick_member(g, out, exclude, f | PICK_PASSIVE) || pick_member(g, out, exclude, f);
}

bool gossip_pick_partner(struct gossip *g, uint8_t *out, const uint8_t *exclude) {
  /* Members in a dial backoff come last, as in gossip_pick_peer. */
  return pick_partner_among(g, out, exclude, PICK_DIALABLE) || pick_partner_among(g, out, exclude, 0);
}
