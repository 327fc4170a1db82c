/*
 * The averaging exchange and its slot.
 *
 * Exchange (A initiates, B responds), on one connection:
 *   A: XCH_REQ{x, model, n} ─▶ B            B: slot IDLE → WANT, or XCH_REJECT
 *   B's training thread snapshots at its next step boundary
 *   B: XCH_ACCEPT{x} + bulk(B's params) ─▶ A; A: bulk(A's params) ─▶ B
 *   each side: when its own send is confirmed by the receiver AND the
 *   partner's buffer arrived whole (every chunk an authenticated frame of
 *   the session, in order), the slot goes to APPLY.
 * Anything else (a reject, a cut, a timeout, the partner failing or
 * leaving) abandons the exchange: nothing is applied on that side. Before
 * a transfer is taken, the guard (guard.c) gives its verdict on its length
 * and step; a refused transfer ends the exchange and strikes the partner.
 *
 * Loop thread, except the functions marked "training thread".
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

/* The reason of the XCH_REJECT that withdraws a request (the initiator took
 * another partner's request instead): not a failure on either side. */
#define XCH_WITHDRAWN "withdrawn"

static bool same_id(const uint8_t *a, const uint8_t *b) { return memcmp(a, b, NET_PUBKEY_BYTES) == 0; }

/* ---- the exchange slot's word: round << 3 | state ---- */
static int ws_state(uint64_t w) { return (int)(w & 7); }
static uint64_t ws_round(uint64_t w) { return w >> 3; }
static uint64_t ws_make(uint64_t round, int state) { return round << 3 | (uint64_t)state; }
static bool ws_wanting(uint64_t w) { return ws_state(w) == SLOT_WANT || ws_state(w) == SLOT_WANT_RESP; }

/* Moves the slot from `from_state` (any round) to `to_state` in the same
 * round. Returns false (and changes nothing) when it is not in from_state. */
static bool slot_move(struct gossip *g, int from_state, int to_state) {
  uint64_t w = atomic_load(&g->xch.word);
  while (ws_state(w) == from_state)
    if (atomic_compare_exchange_weak(&g->xch.word, &w, ws_make(ws_round(w), to_state))) return true;
  return false;
}

static void on_snapshot_ready(net_t *n, void *arg, int status);
static void on_applied(net_t *n, void *arg, int status);

/* ==== the exchange slot: training thread ==== */

void gossip_xch_begin(gossip_t *g, bool want, bool refresh, struct gossip_xch_turn *out) {
  *out = (struct gossip_xch_turn){.work = GOSSIP_XCH_NONE};
  uint64_t w = atomic_load(&g->xch.word);
  /* Only active peers start exchanges (see gossip_impl.h). */
  bool open = ws_state(w) == SLOT_IDLE || ws_state(w) == SLOT_READY;
  if (open && want && atomic_load(&g->ready) && atomic_load(&g->active) &&
      atomic_compare_exchange_strong(&g->xch.word, &w, ws_make(ws_round(w) + 1, SLOT_WANT))) {
    out->work = GOSSIP_XCH_SNAPSHOT;
    out->started = true;
  } else if (ws_wanting(w)) {
    out->work = GOSSIP_XCH_SNAPSHOT;
    out->partner_asked = ws_state(w) == SLOT_WANT_RESP;
  } else if (ws_state(w) == SLOT_APPLY) {
    /* x (the partner) and the delta are stable while the slot is APPLY. */
    out->work = GOSSIP_XCH_APPLY;
    out->delta = &g->xch.delta;
    out->partner = g->xch.x.partner;
    out->alpha = g->xch.alpha;
  } else if (refresh && atomic_load(&g->ready)) {
    out->refresh = slot_move(g, SLOT_READY, SLOT_WRITING) || slot_move(g, SLOT_IDLE, SLOT_WRITING);
  }
  out->in_flight = gossip_xch_in_flight(g);
}

bool gossip_xch_in_flight(gossip_t *g) {
  int st = ws_state(atomic_load(&g->xch.word));
  return st != SLOT_IDLE && st != SLOT_READY && st != SLOT_WRITING;
}

float *gossip_xch_mine(gossip_t *g) { return g->xch.mine; }
float *gossip_xch_theirs(gossip_t *g) { return g->xch.theirs; }

/* What the training thread tells the loop when a snapshot is ready. */
struct snap_ready {
  struct gossip *g;
  uint64_t round, step;
  bool initiator;
};

/* The snapshot asked for by SNAPSHOT is in `mine`: to the loop. */
static void snapshot_done(gossip_t *g, uint64_t step) {
  uint64_t w = atomic_load(&g->xch.word);
  if (!ws_wanting(w)) return; /* abandoned meanwhile */
  if (!atomic_compare_exchange_strong(&g->xch.word, &w, ws_make(ws_round(w), SLOT_BUSY))) return;
  struct snap_ready *r = xmalloc(sizeof *r);
  *r = (struct snap_ready){g, ws_round(w), step, ws_state(w) == SLOT_WANT};
  if (net_call(g->net, on_snapshot_ready, r) != 0) {
    free(r);
    slot_move(g, SLOT_BUSY, SLOT_IDLE);
  }
}

bool gossip_xch_unready(gossip_t *g) {
  if (slot_move(g, SLOT_READY, SLOT_IDLE)) return true;
  return ws_state(atomic_load(&g->xch.word)) != SLOT_BUSY;
}

struct decline {
  struct gossip *g;
  uint64_t round;
  char why[96];
};
static void on_decline(net_t *n, void *arg, int status);

void gossip_xch_decline(gossip_t *g, const char *why) {
  uint64_t w = atomic_load(&g->xch.word);
  if (ws_state(w) != SLOT_WANT_RESP) return;
  struct decline *d = xmalloc(sizeof *d);
  *d = (struct decline){.g = g, .round = ws_round(w)};
  snprintf(d->why, sizeof d->why, "%s", why);
  if (net_call(g->net, on_decline, d) != 0) free(d);
}

void gossip_xch_copied(gossip_t *g, uint64_t step) {
  atomic_store(&g->xch.ready_step, step);
  if (slot_move(g, SLOT_WRITING, SLOT_READY)) return; /* a refresh: ready for partners */
  /* An exchange's snapshot, or a refresh that a partner's request took
   * during the copy (WRITING → WANT_RESP): answer with it. */
  snapshot_done(g, step);
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
  memcpy(a->partner, g->xch.x.partner, NET_PUBKEY_BYTES); /* stable while the slot is APPLY */
  snprintf(a->why, sizeof a->why, "%s", why ? why : "");
  if (status == 0) gossip_count_applied(g, g->xch.x.recv_bytes); /* x too is stable while APPLY */
  else gossip_count(g, GOSSIP_EV_XCH_REJECTED, a->why);
  slot_move(g, SLOT_APPLY, SLOT_IDLE);
  if (net_call(g->net, on_applied, a) != 0) free(a);
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
  uint64_t w = atomic_load(&g->xch.word);
  while (ws_wanting(w) || ws_state(w) == SLOT_BUSY)
    if (atomic_compare_exchange_weak(&g->xch.word, &w, ws_make(ws_round(w), SLOT_IDLE))) return;
}

/* Ends the exchange without applying anything. `why` NULL: a quiet end (no
 * partner was free) that is not a failure. */
static void xch_end(struct gossip *g, const char *why, bool tell_partner) {
  struct gossip_xch *x = &g->xch.x;
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
    gossip_member_label(g, x->partner, who, sizeof who);
    log_info("exchange with %s abandoned: %s (nothing applied)", who, why);
    gossip_count(g, GOSSIP_EV_XCH_FAILED, why);
  }
}

void gossip_xch_abandon(struct gossip *g, const char *why) { xch_end(g, why, true); }

/* Ends the exchange in progress because the partner's transfer is refused
 * (`why`): nothing applied, the partner told, counted as rejected, and the
 * partner struck. */
static void refuse(struct gossip *g, const char *why) {
  uint8_t partner[NET_PUBKEY_BYTES];
  memcpy(partner, g->xch.x.partner, sizeof partner);
  gossip_count(g, GOSSIP_EV_XCH_REJECTED, why);
  if (g->xch.x.conn) send_reject(g, g->xch.x.conn, g->xch.x.xid, "refused");
  xch_end(g, NULL, false); /* counted as rejected above, not as failed */
  gossip_strike(g, partner, why, gossip_now_ms(g));
}

static void on_xch_sent(net_conn_t *c, uint64_t id, int status, void *arg);

/* ---- finished members (gossip_finished) ----
 *
 * An exchange transfer's metadata may say who finished training: "done"
 * (true: the sender itself) and "fin" (other members it knows finished,
 * at most GOSSIP_FIN_MAX keys). Both are optional, and older peers ignore
 * them. Peers exchange along a bipartite graph (links.c), so two peers of
 * one side never meet: they learn of each other through the other side.
 * A false claim can only make a lingering peer leave sooner. */
#define GOSSIP_FIN_MAX 256

static bool listable(struct gossip *g, const struct gossip_guard_entry *en) {
  const struct swim_member *m = en->finished ? swim_find(&g->swim, en->id) : NULL;
  return m && m->info.state == SWIM_ALIVE;
}

static void put_finished(struct gossip *g, struct net_msgbuf *meta) {
  if (atomic_load(&g->finished)) net_msgbuf_put_bool(meta, "done", true);
#ifdef RUMOR_TESTING
  if (gossip_testing_bad_fin(g)) {
    msgpack_packer *pk = net_msgbuf_put_key(meta, "fin");
    msgpack_pack_array(pk, 1);
    msgpack_pack_bin(pk, STR_LEN("badkey!"));
    msgpack_pack_bin_body(pk, STR_LIT("badkey!"));
    return;
  }
#endif
  uint32_t n = 0;
  for (size_t i = 0; i < g->guard.n && n < GOSSIP_FIN_MAX; i++) n += listable(g, &g->guard.v[i]);
  if (n == 0) return;
  msgpack_packer *pk = net_msgbuf_put_key(meta, "fin");
  msgpack_pack_array(pk, n);
  for (size_t i = 0, k = 0; i < g->guard.n && k < n; i++) {
    if (!listable(g, &g->guard.v[i])) continue;
    msgpack_pack_bin(pk, NET_PUBKEY_BYTES);
    msgpack_pack_bin_body(pk, g->guard.v[i].id, NET_PUBKEY_BYTES);
    k++;
  }
}

/* Takes what `partner`'s transfer metadata says of finished members.
 * Returns false, noting nothing, when that part is malformed. */
static bool note_finished(struct gossip *g, const uint8_t *partner, const struct net_msg *meta) {
  bool done = false;
  int rc = net_msg_get_bool(meta, "done", &done);
  if (rc && rc != RUMOR_ENOTFOUND) return false;
  const msgpack_object *items = NULL;
  uint32_t n = 0;
  rc = net_msg_get_array(meta, "fin", &items, &n);
  if ((rc && rc != RUMOR_ENOTFOUND) || n > GOSSIP_FIN_MAX) return false;
  const uint8_t *id;
  size_t len;
  for (uint32_t i = 0; i < n; i++)
    if (net_obj_bin(&items[i], &id, &len) || len != NET_PUBKEY_BYTES) return false;
  bool changed = gossip_guard_note_finished(g, partner, done);
  for (uint32_t i = 0; i < n; i++) {
    id = (const uint8_t *)items[i].via.bin.ptr; /* checked above */
    /* Its own state only from itself; ours we know; strangers are not noted. */
    if (same_id(id, partner) || same_id(id, g->identity.pk) || !swim_find(&g->swim, id)) continue;
    changed |= gossip_guard_note_finished(g, id, true);
  }
  if (changed) gossip_publish(g);
  return true;
}

static void start_send(struct gossip *g) {
  struct gossip_xch *x = &g->xch.x;
  struct net_msgbuf meta;
  net_msgbuf_init(&meta, 0, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&meta, "k", GBULK_EXCHANGE);
  net_msgbuf_put_uint(&meta, "x", x->xid);
  net_msgbuf_put_uint(&meta, "step", x->snapshot_step);
  put_finished(g, &meta);
  size_t mlen;
  const uint8_t *mdata = net_msgbuf_data(&meta, &mlen);
  /* No end-to-end digest: every chunk is already an authenticated frame of
   * one session, in order (net.md), and hashing each exchange twice costs
   * more CPU than the AEAD itself. State donations keep the digest. */
  uint64_t count = g->cfg.nparams;
  const float *src = g->xch.mine;
#ifdef RUMOR_TESTING
  count = gossip_testing_send_count(g, count);
  src = gossip_testing_send_src(g);
#endif
  struct net_bulk_send s = {.src = src, .count = count, .wire = g->cfg.wire, .no_digest = true,
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

/* The difference of the partner's snapshot and ours, on a worker thread
 * (libuv's pool), so that the training thread only adds it (sync.c): the
 * slot stays BUSY meanwhile, with x inactive, so nothing else touches
 * `mine`, `theirs` or x. */
struct delta_job {
  uv_work_t work;
  struct gossip *g;
};

static void compute_delta(struct gossip *g) {
  gossip_delta(g->xch.theirs, g->xch.mine, g->cfg.nparams, &g->xch.delta);
}

static void delta_work(uv_work_t *w) { compute_delta(((struct delta_job *)w->data)->g); }

/* status non-zero: the job did not run (it could not be queued; nothing
 * here cancels queued work), so the pass runs here, on the loop thread. */
static void delta_done(uv_work_t *w, int status) {
  struct gossip *g = ((struct delta_job *)w->data)->g;
  free(w->data);
  if (status) compute_delta(g);
  /* x->partner stays put until the slot is IDLE again: apply_done reads it. */
  slot_move(g, SLOT_BUSY, SLOT_APPLY);
}

static void maybe_complete(struct gossip *g) {
  struct gossip_xch *x = &g->xch.x;
  if (!x->active || !x->sent_ok || !x->recv_ok) return;
  x->active = false;
  log_debug("exchange %s after %llu ms (%s)", "transferred", (unsigned long long)(gossip_now_ms(g) - x->started_ms),
            x->initiator ? "we asked" : x->from_ready ? "we were asked; our snapshot was ready" : "we were asked");
  struct delta_job *j = xmalloc(sizeof *j);
  j->g = g;
  j->work.data = j;
  if (uv_queue_work(&g->loop, &j->work, delta_work, delta_done) != 0) delta_done(&j->work, UV_ECANCELED);
}

static void on_xch_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct gossip *g = arg;
  struct gossip_xch *x = &g->xch.x;
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
  struct gossip_xch *x = &g->xch.x;
  uint8_t prev[NET_PUBKEY_BYTES];
  bool had = x->attempts > 0;
  memcpy(prev, x->partner, sizeof prev);
  if (x->attempts >= 3 || !gossip_pick_partner(g, x->partner, had ? prev : NULL)) {
    gossip_count(g, GOSSIP_EV_XCH_IDLE, NULL);
    xch_end(g, NULL, false); /* nobody free: try again at the next scheduled exchange */
    return;
  }
  x->attempts++;
  x->xid = rng_next_u64(&g->rng);
  x->accepted = false;
  x->conn = NULL;
  x->queued = false;
  bool queued = !gossip_link_open(g, x->partner);
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
  x->queued = queued; /* its loss with the queue: gossip_xch_on_link_lost */
  gossip_count(g, GOSSIP_EV_XCH_REQUESTED, NULL);
}

/* Our snapshot is in `mine` and the slot is BUSY: start asking (initiator)
 * or accept and send (responder). */
static void snapshot_ready(struct gossip *g, bool initiator, uint64_t step) {
  struct gossip_xch *x = &g->xch.x;
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

static void on_snapshot_ready(net_t *n, void *arg, int status) {
  struct snap_ready *r = arg;
  struct gossip *g = r->g;
  bool current = status == 0 && atomic_load(&g->xch.word) == ws_make(r->round, SLOT_BUSY);
  bool initiator = r->initiator;
  uint64_t step = r->step;
  free(r);
  if (!current) return; /* a stale round: ignore it */
#ifdef RUMOR_TESTING
  gossip_testing_snapshot(g, &step);
#endif
  snapshot_ready(g, initiator, step);
}

/* The training thread declined the request waiting for its snapshot: if
 * the slot still waits for that round, the partner is told and the slot
 * is free again. */
static void on_decline(net_t *n, void *arg, int status) {
  (void)n;
  struct decline *d = arg;
  struct gossip *g = d->g;
  struct gossip_xch *x = &g->xch.x;
  uint64_t w = ws_make(d->round, SLOT_WANT_RESP);
  if (status == 0 && x->active && !x->initiator &&
      atomic_compare_exchange_strong(&g->xch.word, &w, ws_make(d->round, SLOT_IDLE))) {
    if (x->conn) send_reject(g, x->conn, x->xid, d->why);
    x->active = false;
  }
  free(d);
}

static void on_applied(net_t *n, void *arg, int status) {
  struct applied *a = arg;
  struct gossip *g = a->g;
  if (status == 0) {
    char who[200];
    gossip_member_label(g, a->partner, who, sizeof who);
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
      gossip_strike(g, a->partner, a->why, gossip_now_ms(g));
    }
  }
  free(a);
}

/* Starts answering request `xid` of `from` on `c` (the slot is ours). */
static void respond(struct gossip *g, net_conn_t *c, const uint8_t *from, uint64_t xid) {
  struct gossip_xch *x = &g->xch.x;
  memset(x, 0, sizeof *x);
  x->active = true;
  x->initiator = false;
  x->xid = xid;
  memcpy(x->partner, from, NET_PUBKEY_BYTES);
  x->conn = c;
  x->started_ms = gossip_now_ms(g);
  x->deadline_ms = x->started_ms + g->cfg.exchange_timeout_ms;
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
  if (!gossip_guard_allow_xch(g, from, gossip_now_ms(g))) {
    send_reject(g, c, xid, "rate limited");
    return;
  }
  if (g->cfg.role != GOSSIP_ROLE_PEER || !atomic_load(&g->ready) || g->stopping) {
    send_reject(g, c, xid, "not ready");
    return;
  }
  if (g->cfg.sync != GOSSIP_SYNC_GOSSIP) {
    send_reject(g, c, xid, "exchanges are off (all-reduce)"); /* our buffers serve the ring */
    return;
  }
  if (n != g->cfg.nparams || mlen != strlen(g->model) || memcmp(model, g->model, mlen) != 0) {
    log_warn("exchange request from %s for another model (%.*s, %llu parameters); refused", net_conn_peer_name(c),
             (int)mlen, model, (unsigned long long)n);
    send_reject(g, c, xid, "model mismatch");
    return;
  }
  if (gossip_backed_off(g, from, gossip_now_ms(g))) {
    send_reject(g, c, xid, "backed off");
    return;
  }
  struct gossip_xch *x = &g->xch.x;
  uint64_t w = atomic_load(&g->xch.word);
  if (ws_state(w) == SLOT_READY &&
      atomic_compare_exchange_strong(&g->xch.word, &w, ws_make(ws_round(w) + 1, SLOT_BUSY))) {
    /* The snapshot of our last step boundary is ready: answer now. */
    respond(g, c, from, xid);
    x->from_ready = true;
    uint64_t step = atomic_load(&g->xch.ready_step);
#ifdef RUMOR_TESTING
    gossip_testing_snapshot(g, &step); /* as every snapshot that leaves (on_snapshot_ready) */
#endif
    snapshot_ready(g, false, step);
    return;
  }
  /* Idle, or copying a snapshot (WRITING): the training thread's next
   * boundary, or the end of the copy, hands us one (WANT_RESP). */
  bool waiting = (ws_state(w) == SLOT_IDLE || ws_state(w) == SLOT_WRITING) &&
                 atomic_compare_exchange_strong(&g->xch.word, &w, ws_make(ws_round(w) + 1, SLOT_WANT_RESP));
  if (!waiting) {
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
      net_msgbuf_put_str(&b, "why", STR_LIT(XCH_WITHDRAWN));
      (void)gossip_send(g, x->partner, &b); /* best effort: it times out otherwise */
      net_msgbuf_free(&b);
    }
    uint64_t step = x->snapshot_step;
    respond(g, c, from, xid);
    snapshot_ready(g, false, step); /* the slot is BUSY with our snapshot: accept and send now */
    return;
  }
  respond(g, c, from, xid);
}

void gossip_xch_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  struct gossip_xch *x = &g->xch.x;
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
      gossip_count(g, GOSSIP_EV_XCH_REFUSED, NULL);
      ask_partner(g); /* busy or not ready: ask someone else */
    } else {
      const char *why;
      size_t n;
      char msg[100];
      if (net_msg_get_str(m, "why", &why, &n)) why = "?", n = 1;
      snprintf(msg, sizeof msg, "partner gave up: %.*s", (int)(n < 60 ? n : 60), why);
      /* A request withdrawn (the initiator took another partner's request
       * instead) or given up before any transfer is not a failure. */
      bool quiet = STR_EQ_LIT(why, n, XCH_WITHDRAWN) ||
                   (!x->sending && !x->receiving && !x->sent_ok && !x->recv_ok);
      xch_end(g, quiet ? NULL : msg, false);
    }
    return;
  default: return;
  }
  log_warn("malformed exchange message from %s; dropping the connection", net_conn_peer_name(c));
  net_conn_close(c);
}

int gossip_xch_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                             const struct net_msg *meta, uint64_t xid, uint64_t step, float **dst) {
  struct gossip_xch *x = &g->xch.x;
  /* Not the partner's transfer for this exchange: refused without blaming
   * anyone (a late transfer of an abandoned exchange). */
  if (!x->active || xid != x->xid || !same_id(net_conn_peer_key(c), x->partner) || x->receiving || x->recv_ok ||
      ws_state(atomic_load(&g->xch.word)) != SLOT_BUSY)
    return -ECONNREFUSED;
  char why[160];
  if (!gossip_guard_check_transfer(g, x->partner, info->count, step, why, sizeof why)) {
    refuse(g, why);
    return -ECONNREFUSED;
  }
  if (!note_finished(g, x->partner, meta)) {
    refuse(g, "its list of finished members is malformed");
    return -ECONNREFUSED;
  }
  x->receiving = true;
  x->recv_id = info->id;
  x->recv_bytes = net_dtype_bytes(info->wire, info->count);
  x->recv_conn = c;
  *dst = g->xch.theirs;
#ifdef RUMOR_TESTING
  gossip_testing_xch_receiving(g);
#endif
  return 0;
}

bool gossip_xch_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status) {
  struct gossip_xch *x = &g->xch.x;
  if (!x->active || !x->receiving || id != x->recv_id || c != x->recv_conn) return false;
  x->receiving = false;
  if (status) {
    char why[96];
    snprintf(why, sizeof why, "receiving the partner's parameters failed: %s", rumor_strerror(status));
    xch_end(g, why, true);
    return true;
  }
  x->recv_ok = true;
  maybe_complete(g);
  return true;
}

void gossip_xch_tick(struct gossip *g, uint64_t now) {
  struct gossip_xch *x = &g->xch.x;
  if (x->active && now >= x->deadline_ms) {
    char why[64];
    snprintf(why, sizeof why, "timed out after %u ms", g->cfg.exchange_timeout_ms);
    xch_end(g, why, true);
  }
}

void gossip_xch_on_close(struct gossip *g, net_conn_t *c, const uint8_t *link_id) {
  struct gossip_xch *x = &g->xch.x;
  if (x->active && (x->conn == c || x->recv_conn == c)) {
    /* Closed: nothing left to cancel or tell on it. */
    if (x->conn == c) x->conn = NULL, x->sending = false;
    if (x->recv_conn == c) x->recv_conn = NULL, x->receiving = false;
    xch_end(g, "connection to the partner lost", false);
  } else if (x->active && x->initiator && !x->accepted && link_id && same_id(link_id, x->partner)) {
    /* Our request went out on that link (or waited in its queue): it, or
     * the partner's answer, is gone with it, even when the partner closed
     * cleanly (it declared us failed while we were paused, say). Waiting
     * for the exchange's timeout would leave us out of the mixing for a
     * minute; ask someone else now. */
    log_debug("exchange request lost with the connection to %s; asking another partner", net_conn_peer_name(c));
    ask_partner(g);
  }
}

void gossip_xch_on_link_lost(struct gossip *g, const uint8_t *id, const char *why) {
  struct gossip_xch *x = &g->xch.x;
  if (!x->active || !x->initiator || x->accepted || !x->queued || !same_id(id, x->partner)) return;
  /* The dial that was to carry our request failed: no answer can come, as
   * in gossip_xch_on_close. */
  char who[200];
  gossip_member_label(g, x->partner, who, sizeof who);
  log_debug("exchange request to %s lost: %s; asking another partner", who, why);
  ask_partner(g);
}

void gossip_xch_on_member_lost(struct gossip *g, const uint8_t *id, const char *why) {
  if (g->xch.x.active && same_id(g->xch.x.partner, id)) xch_end(g, why, true);
}
