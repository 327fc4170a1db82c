/*
 * The averaging exchange, state donations and the newcomer's state pull.
 *
 * Exchange (A initiates, B responds), on one connection:
 *   A: XCH_REQ{x, model, n} ─▶ B            B: slot IDLE → WANT, or XCH_REJECT
 *   B's training thread snapshots at its next step boundary
 *   B: XCH_ACCEPT{x} + bulk(B's params) ─▶ A; A: bulk(A's params) ─▶ B
 *   each side: when its own send is confirmed by the receiver AND the
 *   partner's buffer arrived digest-checked, the slot goes to APPLY.
 * Anything else (a reject, a cut, a timeout, the partner failing or
 * leaving) abandons the exchange: nothing is applied on that side.
 *
 * Donation: a newcomer sends STATE_REQ to a random live peer; the donor
 * (one newcomer at a time) answers with its whole state as a bulk transfer
 * or STATE_BUSY, and the newcomer tries another donor after a backoff.
 *
 * Loop thread, except the functions marked "training thread".
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

static bool same_id(const uint8_t *a, const uint8_t *b) { return memcmp(a, b, NET_PUBKEY_BYTES) == 0; }

/* ---- the exchange slot's word: round << 3 | state ---- */
static int ws_state(uint64_t w) { return (int)(w & 7); }
static uint64_t ws_round(uint64_t w) { return w >> 3; }
static uint64_t ws_make(uint64_t round, int state) { return round << 3 | (uint64_t)state; }
static bool ws_wanting(uint64_t w) { return ws_state(w) == SLOT_WANT || ws_state(w) == SLOT_WANT_RESP; }

/* Moves the slot from `from_state` (any round) to `to_state` in the same
 * round. Returns false (and changes nothing) when it is not in from_state. */
static bool slot_move(struct gossip *g, int from_state, int to_state) {
  uint64_t w = atomic_load(&g->xch_word);
  while (ws_state(w) == from_state)
    if (atomic_compare_exchange_weak(&g->xch_word, &w, ws_make(ws_round(w), to_state))) return true;
  return false;
}

static void key_prefix(const uint8_t *id, char out[16]) {
  char k[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(k, id);
  snprintf(out, 16, "%.8s", k);
}

static void partner_label(struct gossip *g, const uint8_t *id, char *buf, size_t n) {
  char k[16];
  key_prefix(id, k);
  struct swim_member *m = swim_find(&g->swim, id);
  snprintf(buf, n, "%s (%s)", m ? m->info.addr : "?", k);
}

/* Lock-protected flags that the training thread waits on. */
static void set_pull_result(struct gossip *g, bool first) {
  pthread_mutex_lock(&g->lock);
  g->first_peer = first;
  g->pull_done = true;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

/* ==== the exchange slot: training thread ==== */

enum gossip_xch_work gossip_xch_poll(gossip_t *g, bool want) {
  uint64_t w = atomic_load(&g->xch_word);
  /* Only active peers start exchanges (see gossip_impl.h). */
  if (ws_state(w) == SLOT_IDLE && want && atomic_load(&g->ready) && atomic_load(&g->active)) {
    if (atomic_compare_exchange_strong(&g->xch_word, &w, ws_make(ws_round(w) + 1, SLOT_WANT)))
      return GOSSIP_XCH_SNAPSHOT;
  }
  if (ws_wanting(w)) return GOSSIP_XCH_SNAPSHOT;
  if (ws_state(w) == SLOT_APPLY) return GOSSIP_XCH_APPLY;
  return GOSSIP_XCH_NONE;
}

float *gossip_xch_mine(gossip_t *g) { return g->mine; }
float *gossip_xch_theirs(gossip_t *g) { return g->theirs; }
float gossip_xch_alpha(const gossip_t *g) { return g->alpha; }
const uint8_t *gossip_xch_partner(const gossip_t *g) { return g->xch.partner; /* stable while APPLY */ }

/* What the training thread tells the loop when a snapshot is ready. */
struct snap_ready {
  struct gossip *g;
  uint64_t round, step;
  bool initiator;
};

void gossip_xch_snapshot_done(gossip_t *g, uint64_t step) {
  uint64_t w = atomic_load(&g->xch_word);
  if (!ws_wanting(w)) return; /* abandoned meanwhile */
  if (!atomic_compare_exchange_strong(&g->xch_word, &w, ws_make(ws_round(w), SLOT_BUSY))) return;
  struct snap_ready *r = xmalloc(sizeof *r);
  *r = (struct snap_ready){g, ws_round(w), step, ws_state(w) == SLOT_WANT};
  if (net_call(g->net, gossip_xch_on_snapshot_ready, r) != 0) {
    free(r);
    slot_move(g, SLOT_BUSY, SLOT_IDLE);
  }
}

struct applied {
  struct gossip *g;
  int status;
  uint8_t partner[NET_PUBKEY_BYTES];
  char why[128];
};

void gossip_xch_apply_done(gossip_t *g, int status, const char *why) {
  struct applied *a = xcalloc(1, sizeof *a);
  a->g = g;
  a->status = status;
  memcpy(a->partner, g->xch.partner, NET_PUBKEY_BYTES); /* stable while the slot is APPLY */
  snprintf(a->why, sizeof a->why, "%s", why ? why : "");
  pthread_mutex_lock(&g->lock);
  if (status == 0) {
    g->stats.exchanges_ok++;
    g->last_exchange_ms = clock_now_ns() / 1000000;
  } else {
    g->stats.exchanges_rejected++;
    snprintf(g->stats.last_failure, sizeof g->stats.last_failure, "rejected: %.100s", a->why);
  }
  pthread_mutex_unlock(&g->lock);
  slot_move(g, SLOT_APPLY, SLOT_IDLE);
  if (net_call(g->net, gossip_xch_on_applied, a) != 0) free(a);
}

static void ready_on_loop(net_t *n, void *arg, int status) {
  struct gossip *g = arg;
  if (status) return;
  swim_set_ready(&g->swim);
  gossip_publish(g);
}

void gossip_ready(gossip_t *g) {
  atomic_store(&g->ready, true);
  if (net_call(g->net, ready_on_loop, g) != 0) log_warn("cannot announce that we are ready");
}

/* ==== the donation slot: training thread ==== */

bool gossip_donor_poll(gossip_t *g) { return atomic_load(&g->donor_state) == SLOT_WANT; }
float *gossip_donor_buf(gossip_t *g) { return g->donor_buf; }

bool gossip_donor_params_only(gossip_t *g) { return atomic_load(&g->donor_params_only); }

void gossip_donor_done(gossip_t *g, const struct gossip_train_pos *pos) {
  g->donor_pos = *pos;
  if (atomic_load(&g->donor_params_only)) {
    /* A monitor's pull: the figures just published describe these parameters. */
    pthread_mutex_lock(&g->lock);
    g->donor_have_sketch = g->have_sketch;
    g->donor_norm = g->pstats.param_norm;
    if (g->have_sketch) memcpy(g->donor_sketch, g->psketch, (size_t)g->sketch_k * sizeof(double));
    pthread_mutex_unlock(&g->lock);
  }
  int expected = SLOT_WANT;
  if (!atomic_compare_exchange_strong(&g->donor_state, &expected, SLOT_BUSY)) return;
  if (net_call(g->net, gossip_donor_on_ready, g) != 0) atomic_store(&g->donor_state, SLOT_IDLE);
}

/* ==== the exchange: loop thread ==== */

static void send_reject(struct gossip *g, net_conn_t *c, uint64_t xid, const char *why) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_XCH_REJECT, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "x", xid);
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  if (net_conn_send_msg(c, &b)) log_debug("cannot send an exchange reject to %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

/* Returns the slot to IDLE from whatever the loop may own (WANT or BUSY);
 * never from APPLY, which the training thread owns. */
static void slot_release(struct gossip *g) {
  uint64_t w = atomic_load(&g->xch_word);
  while (ws_wanting(w) || ws_state(w) == SLOT_BUSY)
    if (atomic_compare_exchange_weak(&g->xch_word, &w, ws_make(ws_round(w), SLOT_IDLE))) return;
}

/* Ends the exchange without applying anything. `why` NULL: a quiet end (no
 * partner was free) that is not a failure. */
static void xch_end(struct gossip *g, const char *why, bool tell_partner) {
  struct gossip_xch *x = &g->xch;
  if (!x->active) return;
  x->active = false;
  if (x->sending) {
    x->sending = false;
    (void)net_conn_cancel_send(x->conn, x->send_id);
  }
  if (x->receiving) {
    x->receiving = false;
    if (x->recv_conn) (void)net_conn_cancel_recv(x->recv_conn, x->recv_id);
  }
  if (tell_partner && x->conn) send_reject(g, x->conn, x->xid, why ? why : "abandoned");
  slot_release(g);
  if (why) {
    char who[200];
    partner_label(g, x->partner, who, sizeof who);
    log_info("exchange with %s abandoned: %s (nothing applied)", who, why);
    char msg[128];
    snprintf(msg, sizeof msg, "%s", why);
    gossip_fail_stat(g, msg);
  }
}

void gossip_xch_abandon(struct gossip *g, const char *why) { xch_end(g, why, true); }

void gossip_xch_refuse(struct gossip *g, const char *why) {
  uint8_t partner[NET_PUBKEY_BYTES];
  memcpy(partner, g->xch.partner, sizeof partner);
  pthread_mutex_lock(&g->lock);
  g->stats.exchanges_rejected++;
  snprintf(g->stats.last_failure, sizeof g->stats.last_failure, "rejected: %.100s", why);
  pthread_mutex_unlock(&g->lock);
  if (g->xch.conn) send_reject(g, g->xch.conn, g->xch.xid, "refused");
  xch_end(g, NULL, false); /* counted as rejected above, not as failed */
  gossip_strike(g, partner, why);
}

static void on_xch_sent(net_conn_t *c, uint64_t id, int status, void *arg);

static void start_send(struct gossip *g) {
  struct gossip_xch *x = &g->xch;
  struct net_msgbuf meta;
  net_msgbuf_init(&meta, 0, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&meta, "k", GBULK_EXCHANGE);
  net_msgbuf_put_uint(&meta, "x", x->xid);
  net_msgbuf_put_uint(&meta, "step", x->snapshot_step);
  size_t mlen;
  const uint8_t *mdata = net_msgbuf_data(&meta, &mlen);
  /* No end-to-end digest: every chunk is already an authenticated frame of
   * one session, in order (net.md), and hashing each exchange twice costs
   * more CPU than the AEAD itself. State donations keep the digest. */
  uint64_t count = g->cfg.nparams;
#ifdef RUMOR_TESTING
  count = gossip_testing_send_count(g, count);
#endif
  struct net_bulk_send s = {.src = g->mine, .count = count, .wire = g->cfg.wire, .no_digest = true,
                            .meta = mdata, .meta_len = mlen, .done = on_xch_sent, .arg = g};
  int rc = net_conn_send_bulk(x->conn, &s, &x->send_id);
  net_msgbuf_free(&meta);
  if (rc) {
    char why[96];
    snprintf(why, sizeof why, "cannot send our parameters: %s", rumor_strerror(rc));
    xch_end(g, why, true);
    return;
  }
  x->sending = true;
}

static void maybe_complete(struct gossip *g) {
  struct gossip_xch *x = &g->xch;
  if (!x->active || !x->sent_ok || !x->recv_ok) return;
  x->active = false;
  log_debug("exchange %s after %llu ms (%s)", "transferred", (unsigned long long)(gossip_now_ms(g) - x->started_ms),
            x->initiator ? "we asked" : "we were asked");
  /* x->partner stays put until the slot is IDLE again: apply_done reads it. */
  slot_move(g, SLOT_BUSY, SLOT_APPLY);
}

static void on_xch_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct gossip *g = arg;
  struct gossip_xch *x = &g->xch;
  if (!x->active || !x->sending || c != x->conn || id != x->send_id) return;
  x->sending = false;
  if (status) {
    char why[96];
    snprintf(why, sizeof why, "sending our parameters failed: %s", rumor_strerror(status));
    xch_end(g, why, true);
    return;
  }
  x->sent_ok = true;
  maybe_complete(g);
}

static void ask_partner(struct gossip *g) {
  struct gossip_xch *x = &g->xch;
  uint8_t prev[NET_PUBKEY_BYTES];
  bool had = x->attempts > 0;
  memcpy(prev, x->partner, sizeof prev);
  if (x->attempts >= 3 || !gossip_pick_partner(g, x->partner, had ? prev : NULL)) {
    pthread_mutex_lock(&g->lock);
    g->stats.exchange_idle++;
    pthread_mutex_unlock(&g->lock);
    xch_end(g, NULL, false); /* nobody free: try again at the next scheduled exchange */
    return;
  }
  x->attempts++;
  x->xid = rng_next_u64(&g->rng);
  x->accepted = false;
  x->conn = NULL;
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_XCH_REQ, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "x", x->xid);
  net_msgbuf_put_uint(&b, "n", g->cfg.nparams);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  net_msgbuf_put_uint(&b, "step", x->snapshot_step);
  int rc = gossip_send(g, x->partner, &b);
  net_msgbuf_free(&b);
  if (rc) {
    ask_partner(g); /* cannot even queue it: try someone else */
    return;
  }
  pthread_mutex_lock(&g->lock);
  g->stats.exchange_requests++;
  pthread_mutex_unlock(&g->lock);
}

/* Our snapshot is in `mine` and the slot is BUSY: start asking (initiator)
 * or accept and send (responder). */
static void snapshot_ready(struct gossip *g, bool initiator, uint64_t step) {
  struct gossip_xch *x = &g->xch;
  if (g->stopping) {
    x->active = false;
    slot_release(g);
    return;
  }
  if (initiator) {
    memset(x, 0, sizeof *x);
    x->active = true;
    x->initiator = true;
    x->snapshot_step = step;
    x->started_ms = gossip_now_ms(g);
    x->deadline_ms = x->started_ms + g->cfg.exchange_timeout_ms;
    ask_partner(g);
    return;
  }
  /* Responder: our snapshot is ready; accept and send. */
  x->snapshot_step = step;
  if (!x->active || !x->conn) {
    slot_release(g); /* the initiator went away while we were snapshotting */
    return;
  }
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_XCH_ACCEPT, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "x", x->xid);
  int rc = net_conn_send_msg(x->conn, &b); /* the same connection as the bulk: it arrives first */
  net_msgbuf_free(&b);
  if (rc) {
    xch_end(g, "cannot accept", false);
    return;
  }
  x->accepted = true;
  start_send(g);
}

void gossip_xch_on_snapshot_ready(net_t *n, void *arg, int status) {
  struct snap_ready *r = arg;
  struct gossip *g = r->g;
  bool current = status == 0 && atomic_load(&g->xch_word) == ws_make(r->round, SLOT_BUSY);
  bool initiator = r->initiator;
  uint64_t step = r->step;
  free(r);
  if (!current) return; /* a stale round: ignore it */
#ifdef RUMOR_TESTING
  gossip_testing_snapshot(g, &step);
#endif
  snapshot_ready(g, initiator, step);
}

void gossip_xch_on_applied(net_t *n, void *arg, int status) {
  struct applied *a = arg;
  struct gossip *g = a->g;
  if (status == 0) {
    char who[200];
    partner_label(g, a->partner, who, sizeof who);
    if (a->status == 0) {
      log_debug("exchange with %s applied", who);
      gossip_forgive(g, a->partner);
    } else if (a->status > 0) {
      /* An outlier of clipped averaging: not applied, but the sender may be
       * an honest peer that drifted (it catches up by applying ours), so it
       * is not backed off. */
      log_info("skipped parameters from %s: %s", who, a->why);
    } else {
      /* Poisoned or broken parameters: back the sender off, longer each time. */
      gossip_strike(g, a->partner, a->why);
    }
  }
  free(a);
}

static void handle_req(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  uint64_t xid, n;
  const char *model;
  size_t mlen;
  if (net_msg_get_uint(m, "x", &xid) || net_msg_get_uint(m, "n", &n) || net_msg_get_str(m, "model", &model, &mlen)) {
    log_warn("malformed exchange request from %s; dropping the connection", net_conn_peer_name(c));
    net_conn_close(c);
    return;
  }
  const uint8_t *from = net_conn_peer_key(c);
  if (!gossip_guard_allow_xch(g, from)) {
    send_reject(g, c, xid, "rate limited");
    return;
  }
  if (g->cfg.role != GOSSIP_ROLE_PEER || !atomic_load(&g->ready) || g->stopping) {
    send_reject(g, c, xid, "not ready");
    return;
  }
  if (n != g->cfg.nparams || mlen != strlen(g->model) || memcmp(model, g->model, mlen) != 0) {
    log_warn("exchange request from %s for another model (%.*s, %llu parameters); refused", net_conn_peer_name(c),
             (int)mlen, model, (unsigned long long)n);
    send_reject(g, c, xid, "model mismatch");
    return;
  }
  struct gossip_link *l = gossip_link_get(g, from, true);
  if (l->backoff_until_ms > gossip_now_ms(g)) {
    send_reject(g, c, xid, "backed off");
    return;
  }
  struct gossip_xch *x = &g->xch;
  uint64_t w = atomic_load(&g->xch_word);
  if (ws_state(w) != SLOT_IDLE ||
      !atomic_compare_exchange_strong(&g->xch_word, &w, ws_make(ws_round(w) + 1, SLOT_WANT_RESP))) {
    /* Busy. But if we are an initiator whose request nobody has accepted
     * yet, our snapshot is ready: answer this request with it instead of
     * both sides waiting for someone free. When two peers ask each other
     * at once, the one with the smaller key stays the initiator. */
    bool pending = ws_state(w) == SLOT_BUSY && x->active && x->initiator && !x->accepted;
    bool collision = pending && same_id(from, x->partner);
    if (!pending || (collision && memcmp(g->identity.pk, from, NET_PUBKEY_BYTES) < 0)) {
      send_reject(g, c, xid, "busy");
      return;
    }
    if (!collision) {
      struct net_msgbuf b;
      net_msgbuf_init(&b, GMSG_XCH_REJECT, GOSSIP_PROTO_VERSION);
      net_msgbuf_put_uint(&b, "x", x->xid);
      net_msgbuf_put_str(&b, "why", "withdrawn", 9);
      (void)gossip_send(g, x->partner, &b); /* best effort: it times out otherwise */
      net_msgbuf_free(&b);
    }
    uint64_t step = x->snapshot_step;
    memset(x, 0, sizeof *x);
    x->active = true;
    x->initiator = false;
    x->snapshot_step = step;
    x->xid = xid;
    memcpy(x->partner, from, NET_PUBKEY_BYTES);
    x->conn = c;
    x->started_ms = gossip_now_ms(g);
    x->deadline_ms = x->started_ms + g->cfg.exchange_timeout_ms;
    snapshot_ready(g, false, step); /* the slot is BUSY with our snapshot: accept and send now */
    return;
  }
  memset(x, 0, sizeof *x);
  x->active = true;
  x->initiator = false;
  x->xid = xid;
  memcpy(x->partner, from, NET_PUBKEY_BYTES);
  x->conn = c;
  x->started_ms = gossip_now_ms(g);
  x->deadline_ms = x->started_ms + g->cfg.exchange_timeout_ms;
}

void gossip_xch_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  struct gossip_xch *x = &g->xch;
  const uint8_t *from = net_conn_peer_key(c);
  uint64_t xid;
  switch (m->type) {
  case GMSG_XCH_REQ: handle_req(g, c, m); return;
  case GMSG_XCH_ACCEPT:
    if (net_msg_get_uint(m, "x", &xid)) break;
    if (x->active && x->initiator && !x->accepted && xid == x->xid && same_id(from, x->partner)) {
      x->accepted = true;
      x->conn = c;
      start_send(g);
    }
    return;
  case GMSG_XCH_REJECT:
    if (net_msg_get_uint(m, "x", &xid)) break;
    if (!x->active || xid != x->xid || !same_id(from, x->partner)) return;
    if (x->initiator && !x->accepted) {
      pthread_mutex_lock(&g->lock);
      g->stats.exchange_refusals++;
      pthread_mutex_unlock(&g->lock);
      ask_partner(g); /* busy or not ready: ask someone else */
    } else {
      const char *why;
      size_t n;
      char msg[100];
      if (net_msg_get_str(m, "why", &why, &n)) why = "?", n = 1;
      snprintf(msg, sizeof msg, "partner gave up: %.*s", (int)(n < 60 ? n : 60), why);
      /* A request withdrawn (the initiator took another partner's request
       * instead) or given up before any transfer is not a failure. */
      bool quiet = (n == 9 && memcmp(why, "withdrawn", 9) == 0) ||
                   (!x->sending && !x->receiving && !x->sent_ok && !x->recv_ok);
      xch_end(g, quiet ? NULL : msg, false);
    }
    return;
  default: return;
  }
  log_warn("malformed exchange message from %s; dropping the connection", net_conn_peer_name(c));
  net_conn_close(c);
}

int gossip_xch_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info, uint64_t kind,
                             uint64_t xid, float **dst) {
  const uint8_t *from = net_conn_peer_key(c);
  if (kind == GBULK_EXCHANGE) {
    struct gossip_xch *x = &g->xch;
    if (!x->active || xid != x->xid || !same_id(from, x->partner) || x->receiving || x->recv_ok ||
        info->count != g->cfg.nparams || ws_state(atomic_load(&g->xch_word)) != SLOT_BUSY)
      return -ECONNREFUSED;
    x->receiving = true;
    x->recv_id = info->id;
    x->recv_conn = c;
    *dst = g->theirs;
    return 0;
  }
  if (kind == GBULK_STATE) {
    if (!g->pulling || !same_id(from, g->donor) || info->count != g->cfg.state_floats || !g->pull_buf)
      return -ECONNREFUSED;
    g->pull_recv_id = info->id;
    g->pull_conn = c;
    *dst = g->pull_buf;
    return 0;
  }
  return RUMOR_EPROTO;
}

void gossip_xch_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status) {
  struct gossip_xch *x = &g->xch;
  if (g->pulling && c == g->pull_conn && id == g->pull_recv_id) {
    g->pulling = false;
    g->pull_conn = NULL;
    char who[200];
    partner_label(g, g->donor, who, sizeof who);
    if (status == 0) {
      log_info("received the state of %s (step %llu, epoch %llu)", who, (unsigned long long)g->pull_pos.step,
               (unsigned long long)g->pull_pos.epoch);
      set_pull_result(g, false);
    } else {
      log_warn("state transfer from %s failed: %s; trying another peer", who, rumor_strerror(status));
      g->pull_retry_ms = gossip_now_ms(g) + 200;
    }
    return;
  }
  if (!x->active || !x->receiving || id != x->recv_id || c != x->recv_conn) return;
  x->receiving = false;
  if (status) {
    char why[96];
    snprintf(why, sizeof why, "receiving the partner's parameters failed: %s", rumor_strerror(status));
    xch_end(g, why, true);
    return;
  }
  x->recv_ok = true;
  maybe_complete(g);
}

void gossip_xch_tick(struct gossip *g, uint64_t now) {
  struct gossip_xch *x = &g->xch;
  if (x->active && now >= x->deadline_ms) {
    char why[64];
    snprintf(why, sizeof why, "timed out after %u ms", g->cfg.exchange_timeout_ms);
    xch_end(g, why, true);
  }
}

void gossip_xch_on_close(struct gossip *g, net_conn_t *c) {
  struct gossip_xch *x = &g->xch;
  if (x->active && (x->conn == c || x->recv_conn == c)) {
    /* Closed: nothing left to cancel or tell on it. */
    if (x->conn == c) x->conn = NULL, x->sending = false;
    if (x->recv_conn == c) x->recv_conn = NULL, x->receiving = false;
    xch_end(g, "connection to the partner lost", false);
  }
  if (g->pulling && g->pull_conn == c) {
    g->pulling = false;
    g->pull_conn = NULL;
    g->pull_retry_ms = gossip_now_ms(g) + 200;
  }
  if (g->donor_conn == c) {
    g->donor_conn = NULL;
    int expected = SLOT_WANT;
    if (atomic_compare_exchange_strong(&g->donor_state, &expected, SLOT_IDLE))
      atomic_store(&g->donor_params_only, false);
  }
}

/* ==== donations: loop thread ==== */

static void send_busy(net_conn_t *c, const char *why, bool fatal) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_STATE_BUSY, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  net_msgbuf_put_bool(&b, "fatal", fatal);
  if (net_conn_send_msg(c, &b)) log_debug("cannot answer a state request from %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

static void on_donor_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct gossip *g = arg;
  if (status == 0) {
    pthread_mutex_lock(&g->lock);
    g->stats.donations++;
    pthread_mutex_unlock(&g->lock);
    log_info("donated our state to %s", net_conn_peer_name(c));
  } else {
    log_warn("state donation to %s failed: %s", net_conn_peer_name(c), rumor_strerror(status));
  }
  g->donor_conn = NULL;
  atomic_store(&g->donor_state, SLOT_IDLE);
}

void gossip_donor_on_ready(net_t *n, void *arg, int status) {
  struct gossip *g = arg;
  if (status) return;
  bool params_only = atomic_exchange(&g->donor_params_only, false);
  if (!g->donor_conn || g->stopping) {
    g->donor_conn = NULL;
    atomic_store(&g->donor_state, SLOT_IDLE);
    return;
  }
  struct net_msgbuf meta;
  net_msgbuf_init(&meta, 0, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&meta, "k", params_only ? GBULK_PARAMS : GBULK_STATE);
  net_msgbuf_put_uint(&meta, "x", 0);
  net_msgbuf_put_uint(&meta, "step", g->donor_pos.step);
  net_msgbuf_put_uint(&meta, "epoch", g->donor_pos.epoch);
  net_msgbuf_put_uint(&meta, "samples", g->donor_pos.samples);
  /* The sketch rides in the metadata when it fits (k up to about 8000). */
  if (params_only && g->donor_have_sketch && (size_t)g->sketch_k * sizeof(double) + 1024 <= NET_BULK_META_MAX) {
    net_msgbuf_put_double(&meta, "norm", g->donor_norm);
    net_msgbuf_put_uint(&meta, "sk_seed", g->sketch_seed);
    net_msgbuf_put_bin(&meta, "sketch", g->donor_sketch, (size_t)g->sketch_k * sizeof(double));
  }
  size_t mlen;
  const uint8_t *mdata = net_msgbuf_data(&meta, &mlen);
  /* A state travels exactly (f32): it seeds a replica. */
  struct net_bulk_send s = {.src = g->donor_buf, .count = params_only ? g->cfg.nparams : g->cfg.state_floats,
                            .wire = NET_DTYPE_F32,
                            .meta = mdata, .meta_len = mlen, .done = on_donor_sent, .arg = g};
  int rc = net_conn_send_bulk(g->donor_conn, &s, &g->donor_send_id);
  net_msgbuf_free(&meta);
  if (rc) {
    log_warn("cannot donate our state to %s: %s", net_conn_peer_name(g->donor_conn), rumor_strerror(rc));
    g->donor_conn = NULL;
    atomic_store(&g->donor_state, SLOT_IDLE);
  }
}

static void handle_state_req(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const char *model, *opt;
  size_t mlen, olen;
  uint64_t n, sf;
  if (net_msg_get_str(m, "model", &model, &mlen) || net_msg_get_uint(m, "n", &n) || net_msg_get_uint(m, "sf", &sf) ||
      net_msg_get_str(m, "opt", &opt, &olen)) {
    log_warn("malformed state request from %s; dropping the connection", net_conn_peer_name(c));
    net_conn_close(c);
    return;
  }
  if (g->cfg.role != GOSSIP_ROLE_PEER || !atomic_load(&g->ready) || g->stopping) {
    send_busy(c, g->cfg.role == GOSSIP_ROLE_PEER && !g->stopping ? "joining" : "not ready", false);
    return;
  }
  if (mlen != strlen(g->model) || memcmp(model, g->model, mlen) != 0 || n != g->cfg.nparams ||
      sf != g->cfg.state_floats || olen != strlen(g->optimizer) || memcmp(opt, g->optimizer, olen) != 0) {
    char why[600];
    snprintf(why, sizeof why, "state mismatch: this peer trains %s with %s, the newcomer %.*s with %.*s", g->model,
             g->optimizer, (int)mlen, model, (int)olen, opt);
    send_busy(c, why, true);
    return;
  }
  int expected = SLOT_IDLE;
  if (!atomic_compare_exchange_strong(&g->donor_state, &expected, SLOT_WANT)) {
    send_busy(c, "already donating", false);
    return;
  }
  g->donor_conn = c;
  memcpy(g->donor_to, net_conn_peer_key(c), NET_PUBKEY_BYTES);
}

/* ==== the newcomer's state pull: loop thread ==== */

void gossip_pull_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  if (m->type == GMSG_STATE_REQ) {
    handle_state_req(g, c, m);
    return;
  }
  /* STATE_BUSY */
  if (!g->pulling || !same_id(net_conn_peer_key(c), g->donor)) return;
  const char *why;
  size_t n;
  bool fatal = false;
  if (net_msg_get_str(m, "why", &why, &n)) why = "?", n = 1;
  if (net_msg_get_bool(m, "fatal", &fatal)) fatal = false;
  g->pulling = false;
  if (fatal) {
    pthread_mutex_lock(&g->lock);
    snprintf(g->join_error, sizeof g->join_error, "%s: %.*s", net_conn_peer_addr(c), (int)n, why);
    g->join_failed = true;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    log_error("cannot take a state from this cluster: %s", g->join_error);
    return;
  }
  g->pull_attempts++;
  uint64_t now = gossip_now_ms(g);
  uint64_t backoff = 50ull << (g->pull_attempts < 5 ? g->pull_attempts : 5);
  g->pull_retry_ms = now + backoff + rng_below(&g->rng, 100);
  gossip_link_get(g, g->donor, true)->backoff_until_ms = now + 500; /* prefer another donor next */
  log_debug("donor %s busy (%.*s); retrying", net_conn_peer_name(c), (int)n, why);
}

void gossip_pull_tick(struct gossip *g, uint64_t now) {
  pthread_mutex_lock(&g->lock);
  bool wanted = g->pull_wanted && !g->pull_done && !g->join_failed;
  pthread_mutex_unlock(&g->lock);
  if (!wanted || !g->joined) return;
  if (g->pulling) {
    if (now < g->pull_retry_ms) return;
    log_warn("the donor did not deliver its state in time; trying another peer");
    gossip_link_get(g, g->donor, true)->backoff_until_ms = now + 5000;
    if (g->pull_conn) (void)net_conn_cancel_recv(g->pull_conn, g->pull_recv_id);
    g->pulling = false;
    g->pull_conn = NULL;
    g->pull_retry_ms = now;
  }
  if (now < g->pull_retry_ms) return;
  if (swim_count_live(&g->swim, SWIM_ROLE_PEER) == 0) {
    log_info("no other peer in the cluster: starting from our own initialisation");
    set_pull_result(g, true);
    return;
  }
  if (!g->pull_attempts) g->pull_retry_ms = now; /* first try */
  if (now - g->join_started_ms > (uint64_t)g->cfg.join_timeout_ms * 2) {
    pthread_mutex_lock(&g->lock);
    snprintf(g->join_error, sizeof g->join_error, "joined, but no peer donated its state within %u ms",
             g->cfg.join_timeout_ms * 2);
    g->join_failed = true;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    log_error("%s", g->join_error);
    return;
  }
  uint8_t donor[NET_PUBKEY_BYTES];
  if (!gossip_pick_peer(g, donor, NULL, true)) {
    /* No peer holds a state yet: the cluster is forming. The smallest key
     * among the live peers starts from its own initialisation (the same seed
     * gives the same weights anyway); the others pull from it once it is
     * ready. */
    bool any_ready = false, smallest = true;
    for (size_t i = 0; i < g->swim.nmembers; i++) {
      const struct swim_member *m = &g->swim.members[i];
      if (m->info.role != SWIM_ROLE_PEER || m->info.state != SWIM_ALIVE) continue;
      any_ready |= m->info.ready;
      if (memcmp(m->info.id, g->identity.pk, NET_PUBKEY_BYTES) < 0) smallest = false;
    }
    if (!any_ready && smallest) {
      log_info("no peer holds a state yet and ours is the smallest key: starting from our own initialisation");
      set_pull_result(g, true);
      return;
    }
    g->pull_retry_ms = now + 100; /* a donor is backed off, or the first peer is not ready yet */
    return;
  }
  memcpy(g->donor, donor, sizeof donor);
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_STATE_REQ, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  net_msgbuf_put_uint(&b, "n", g->cfg.nparams);
  net_msgbuf_put_uint(&b, "sf", g->cfg.state_floats);
  net_msgbuf_put_str(&b, "opt", g->optimizer, strlen(g->optimizer));
  int rc = gossip_send(g, donor, &b);
  net_msgbuf_free(&b);
  if (rc) {
    g->pull_retry_ms = now + 200;
    return;
  }
  g->pulling = true;
  g->pull_retry_ms = now + g->cfg.exchange_timeout_ms; /* deadline for this donor */
}
