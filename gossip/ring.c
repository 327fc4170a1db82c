/*
 * All-reduce and all-gather over a ring of the ready peers (gossip.h,
 * "all-reduce").
 *
 * A reduce round: member i of a ring of n splits the vector into n
 * segments and each segment into `pieces` pieces. Phase p < n−1
 * (reduce-scatter): it sends its partial sum of segment (i − p) mod n to
 * its successor and receives segment (i − 1 − p) from its predecessor into
 * `out`, adding it into `acc`; after phase n−2 segment (i + 1) holds the
 * full sum. Phases n−1 to 2n−3 (all-gather): it sends the full segments on
 * from `out` (its own first, copied from `acc` through the wire encoding so
 * that every member ends with the same values) and receives the others
 * into `out`.
 *
 * A gather round: the segments are the members' blocks (ag_words words
 * each) in `ag_out`, block i our own, copied in at the start. Phase q <
 * n−1: member i sends block (i − q) mod n to its successor and receives
 * block (i − 1 − q) from its predecessor; nothing is added, and the words
 * travel as f32 whatever --wire is, so they arrive bit-exact.
 *
 * In both, piece j of phase p is sent as soon as piece j of phase p − 1
 * arrived (phase 0 at once), so the pieces stream around the ring.
 *
 *   member: start ─▶ RING_READY{step, hash} to the predecessor
 *   successor's RING_READY for the same round ─▶ pieces may go to it
 *   every piece received and every piece sent confirmed ─▶ DONE
 *
 * A round is named by its step and its hash: the ring's keys and, for a
 * gather round, its kind and block size (ring_hash). READYs, pieces and
 * ABORTs carry the hash, so rounds of another kind never match ours. Both
 * kinds share the position (`pos`, RING_AHEAD): steps count rounds of
 * either kind.
 *
 * Buffers: `acc` is read by sends of reduce-scatter phases and written by
 * the additions of received pieces, `out` written by receives and read by
 * all-gather sends; a region is never written while a transfer reads it
 * (each segment is received once per half, after the sends that read it).
 * A gather round writes each block of `ag_out` once (a receive) before the
 * sends that read it. A failed round cancels every transfer and reports
 * FAILED only once their callbacks have all run, so the caller may rewrite
 * `acc` (or its block) at once.
 *
 * Quorum: a round waits before its first READY while its ring holds no
 * majority of the last ring this member completed a round with (members
 * that left since, gracefully, not counted), at most quorum_wait_ms in
 * all, then goes on with the ring it has. A member cut off from the
 * cluster would otherwise complete rounds alone, at its own speed, and the
 * cluster, once the cut heals, would take its state for the furthest
 * ahead (measured: a peer cut off for 10 s in bench-chaos took 4,850
 * steps alone; the seven others then dropped theirs for its state). While
 * it waits, a member ahead still fails the round, so the cut member
 * catches up with the majority as soon as it hears from it.
 *
 * Sitting out: every piece passes every link, so a round goes at the pace
 * of the ring's slowest link. A member whose link to its successor loses
 * packets (the kernel retransmitted at least cfg.sit_out_loss of the
 * segments it sent there over GOSSIP_PATH_WINDOW_MS of rounds) is advised
 * to leave the ring for a while (gossip_ar_sit_out), when enough members
 * remain for the quorum without it: the cluster loses its samples, not
 * half its speed (measured in bench-chaos: rounds at 45 % of their speed
 * while one member of eight had 5 % loss). Retransmissions, not timing:
 * a successor slow to read (a busy CPU) slows our sends as much, but the
 * fault is not on our link, and its predecessor leaving would not help.
 *
 * Loop thread, except the functions marked "training thread".
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "gossip/gossip_impl.h"

static bool same_id(const uint8_t *a, const uint8_t *b) { return memcmp(a, b, NET_PUBKEY_BYTES) == 0; }

static int cmp_id(const void *a, const void *b) { return memcmp(a, b, NET_PUBKEY_BYTES); }

int gossip_ring_init(struct gossip *g, struct rumor_err *e) {
  struct gossip_ring *r = &g->ring;
  memset(r, 0, sizeof *r);
  r->acc = g->cfg.xch_mine;
  r->out = g->cfg.xch_theirs;
  r->count = g->cfg.nparams + 1;
  r->readies = xcalloc(RING_READY_MAX, sizeof *r->readies);
  uint64_t words = g->cfg.gather_floats;
  if (words == 0) return 0;
  if (g->cfg.role != GOSSIP_ROLE_PEER || g->cfg.sync != GOSSIP_SYNC_ALLREDUCE)
    return rumor_err_set(e, -EINVAL, "all-gather rounds need a peer with sync=allreduce");
  if (words > GOSSIP_GATHER_MAX_FLOATS)
    return rumor_err_set(e, RUMOR_ETOOBIG, "an all-gather block of %llu words is more than %llu",
                         (unsigned long long)words, (unsigned long long)GOSSIP_GATHER_MAX_FLOATS);
  r->ag_mine = calloc(words, sizeof(float));
  if (!r->ag_mine)
    return rumor_err_set(e, -ENOMEM, "cannot allocate an all-gather block of %.1f MiB",
                         (double)words * sizeof(float) / (1 << 20));
  r->ag_words = words;
  return 0;
}

void gossip_ring_free(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  free(r->ids);
  free(r->sorted);
  free(r->done_ids);
  free(r->recv);
  free(r->send);
  free(r->readies);
  free(r->ag_mine);
  free(r->ag_out);
  memset(r, 0, sizeof *r);
}

/* ---- the training thread's side ---- */

float *gossip_ar_buf(gossip_t *g) { return g->ring.acc; }
const float *gossip_ar_result(gossip_t *g) { return g->ring.out; }
float *gossip_ag_buf(gossip_t *g) { return g->ring.ag_mine; }

const float *gossip_ag_result(gossip_t *g, size_t *members, size_t *self) {
  pthread_mutex_lock(&g->lock);
  const float *res = g->ring.ag_result;
  *members = res ? g->ring.ag_members : 0;
  *self = res ? g->ring.ag_self : 0;
  pthread_mutex_unlock(&g->lock);
  return res;
}

static void set_status(struct gossip *g, int status) {
  pthread_mutex_lock(&g->lock);
  g->ring.status = status;
  if (status == GOSSIP_AR_RUNNING) g->ring.ag_result = NULL; /* the loop may reallocate it now */
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

struct ring_start {
  struct gossip *g;
  uint64_t step;
  enum ring_kind kind;
};
static void start_on_loop(net_t *n, void *arg, int status);

static int round_start(gossip_t *g, uint64_t step, enum ring_kind kind) {
  set_status(g, GOSSIP_AR_RUNNING);
  struct ring_start *s = xmalloc(sizeof *s);
  *s = (struct ring_start){g, step, kind};
  if (net_call(g->net, start_on_loop, s) != 0) {
    free(s);
    set_status(g, GOSSIP_AR_FAILED);
    return RUMOR_ECANCELED;
  }
  return 0;
}

int gossip_ar_start(gossip_t *g, uint64_t step) {
  RUMOR_ASSERT(g->cfg.sync == GOSSIP_SYNC_ALLREDUCE);
  return round_start(g, step, RING_REDUCE);
}

int gossip_ag_start(gossip_t *g, uint64_t step) {
  RUMOR_ASSERT(g->cfg.sync == GOSSIP_SYNC_ALLREDUCE && g->ring.ag_words > 0);
  return round_start(g, step, RING_GATHER);
}

static void forget_on_loop(net_t *n, void *arg, int status) {
  (void)n, (void)status;
  struct gossip *g = arg;
  g->ring.ahead_step = 0;
}

void gossip_ar_forget_ahead(gossip_t *g) {
  /* Calls run in the order queued: the next start sees it done. */
  if (net_call(g->net, forget_on_loop, g) != 0) log_debug("the runtime is stopping: nothing to forget");
}

enum gossip_ar_status gossip_ar_wait(gossip_t *g, uint32_t ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += ms / 1000;
  ts.tv_nsec += (long)(ms % 1000) * 1000000;
  if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
  pthread_mutex_lock(&g->lock);
  while (g->ring.status == GOSSIP_AR_RUNNING)
    if (pthread_cond_timedwait(&g->cond, &g->lock, &ts) != 0) break;
  int st = g->ring.status;
  pthread_mutex_unlock(&g->lock);
  return (enum gossip_ar_status)st;
}

void gossip_ar_info(gossip_t *g, struct gossip_ar_info *out) {
  pthread_mutex_lock(&g->lock);
  *out = g->ring.info;
  pthread_mutex_unlock(&g->lock);
}

/* ---- geometry ---- */

static bool gathering(const struct gossip_ring *r) { return r->kind == RING_GATHER; }
static uint32_t phases(const struct gossip_ring *r) {
  return (uint32_t)(gathering(r) ? r->n - 1 : 2 * (r->n - 1));
}
static size_t wrap(const struct gossip_ring *r, long long k) {
  long long n = (long long)r->n;
  return (size_t)(((k % n) + n) % n);
}
/* Where segment s (0 .. n) begins: a reduce round's segments differ by at
 * most one float in length; a gather round's are the blocks. */
static uint64_t segment_start(const struct gossip_ring *r, size_t s) {
  return gathering(r) ? r->ag_words * s : r->count * s / r->n;
}
/* Segment s's piece j: [*lo, *hi). Pieces of one segment differ by at most
 * one float in length. */
static void piece_range(const struct gossip_ring *r, size_t s, uint32_t j, uint64_t *lo, uint64_t *hi) {
  uint64_t s0 = segment_start(r, s), len = segment_start(r, s + 1) - s0;
  *lo = s0 + len * j / r->pieces;
  *hi = s0 + len * (j + 1) / r->pieces;
}
/* The segment sent (received) in phase p. A gather round is the
 * reduce-scatter's pattern throughout. */
static size_t send_segment(const struct gossip_ring *r, uint32_t p) {
  long long i = (long long)r->me, n = (long long)r->n;
  return gathering(r) || p < n - 1 ? wrap(r, i - p) : wrap(r, i + 1 - (p - (n - 1)));
}
static size_t recv_segment(const struct gossip_ring *r, uint32_t p) {
  long long i = (long long)r->me, n = (long long)r->n;
  return gathering(r) || p < n - 1 ? wrap(r, i - 1 - p) : wrap(r, i - (p - (n - 1)));
}
static const uint8_t *pred(const struct gossip_ring *r) { return r->ids[wrap(r, (long long)r->me - 1)]; }
static const uint8_t *succ(const struct gossip_ring *r) { return r->ids[wrap(r, (long long)r->me + 1)]; }

/* ---- membership ---- */

/* True for a member that cannot accept connections: it advertises a relay,
 * "@HOST:PORT", or "@" alone until a relay takes it (relay.c). */
static bool behind_relay(const char *addr) { return addr[0] == NET_RELAY_ADDR_PREFIX; }

/* Ready peers that are alive, ourselves included, in ring order: a new
 * array (*n entries; the caller frees it). A suspect is left out: it may
 * be dead (its heartbeat stopped, its connection was cut: runtime.c), and
 * a ring with a dead member waits for its deadline; one that is alive
 * refutes within a round trip (swim.c) and the ring re-forms with it.
 *
 * The order: members that accept connections ("direct") sorted by key, each
 * followed by one member reached through a relay, also sorted by key,
 * while both last; then the rest of the longer list. So no two members
 * behind relays are neighbours, whose hop would have to cross the relay
 * (a hop between a direct member and one behind a relay goes direct:
 * links.c, go_direct), unless more than half the ring is behind relays;
 * then only as many hops as there are more of them than direct members. With
 * no member behind a relay it is the keys' order. Every member of one view
 * computes the same order: the addresses come with the membership, and an
 * address change (a member moving to a relay) re-forms the ring like a
 * join, since the order goes into the round's hash. */
static uint8_t (*view_ring(struct gossip *g, size_t *n))[NET_PUBKEY_BYTES] {
  size_t cap = g->swim.nmembers + 1, ndirect = 0, nrelayed = 0;
  uint8_t(*direct)[NET_PUBKEY_BYTES] = xmalloc(cap * NET_PUBKEY_BYTES);
  uint8_t(*relayed)[NET_PUBKEY_BYTES] = xmalloc(cap * NET_PUBKEY_BYTES);
  memcpy(behind_relay(g->swim.self.addr) ? relayed[nrelayed++] : direct[ndirect++], g->identity.pk, NET_PUBKEY_BYTES);
  for (size_t i = 0; i < g->swim.nmembers && ndirect + nrelayed < RING_MAX_MEMBERS; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || !m->info.ready || m->info.state != SWIM_ALIVE) continue;
    memcpy(behind_relay(m->info.addr) ? relayed[nrelayed++] : direct[ndirect++], m->info.id, NET_PUBKEY_BYTES);
  }
  qsort(direct, ndirect, NET_PUBKEY_BYTES, cmp_id);
  qsort(relayed, nrelayed, NET_PUBKEY_BYTES, cmp_id);
  uint8_t(*ids)[NET_PUBKEY_BYTES] = xmalloc(cap * NET_PUBKEY_BYTES);
  size_t k = 0;
  for (size_t i = 0; i < ndirect || i < nrelayed; i++) {
    if (i < ndirect) memcpy(ids[k++], direct[i], NET_PUBKEY_BYTES);
    if (i < nrelayed) memcpy(ids[k++], relayed[i], NET_PUBKEY_BYTES);
  }
  free(direct);
  free(relayed);
  *n = k;
  return ids;
}

/* The round's name besides its step: a hash of the ring's keys, followed
 * for a gather round by a tag and its block size, so that a reduce round, a
 * gather round and a gather round of another size never take one another's
 * READYs, pieces or ABORTs. A reduce round's hash is that of the keys
 * alone, as before gather rounds existed. */
static uint64_t ring_hash(const struct gossip_ring *r, uint8_t (*ids)[NET_PUBKEY_BYTES], size_t n) {
  static const char tag[] = "rumor ring all-gather";
  uint8_t h[8], words[8];
  crypto_generichash_state st;
  crypto_generichash_init(&st, NULL, 0, sizeof h);
  crypto_generichash_update(&st, (const uint8_t *)ids, n * NET_PUBKEY_BYTES);
  if (gathering(r)) {
    for (int k = 0; k < 8; k++) words[k] = (uint8_t)(r->ag_words >> (8 * k));
    crypto_generichash_update(&st, (const uint8_t *)tag, sizeof tag - 1);
    crypto_generichash_update(&st, words, sizeof words);
  }
  crypto_generichash_final(&st, h, sizeof h);
  uint64_t v = 0;
  for (int k = 0; k < 8; k++) v = v << 8 | h[k];
  return v;
}

static bool in_ring(const struct gossip_ring *r, const uint8_t *id) {
  return bsearch(id, r->sorted, r->n, NET_PUBKEY_BYTES, cmp_id) != NULL;
}

/* True when a member is out of the ring in our view: suspect, failed,
 * left, or no longer ready (it sits out: "Sitting out" above). */
static bool member_out(const struct swim_member *m) { return m->info.state != SWIM_ALIVE || !m->info.ready; }

/* True when member `id` of the ring is no longer in our view of it:
 * out (member_out) or forgotten. */
static bool out_of_view(struct gossip *g, const uint8_t *id) {
  if (same_id(id, g->identity.pk)) return false;
  const struct swim_member *m = swim_find(&g->swim, id);
  return !m || member_out(m);
}

/* A member of the round's ring that is no longer in our view, or NULL. */
static const uint8_t *ring_member_out(struct gossip *g) {
  const struct gossip_ring *r = &g->ring;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (member_out(m) && in_ring(r, m->info.id)) return m->info.id;
  }
  return NULL;
}

static struct ring_ready *find_ready(struct gossip_ring *r, const uint8_t *id) {
  for (size_t i = 0; i < r->nreadies; i++)
    if (same_id(r->readies[i].id, id)) return &r->readies[i];
  return NULL;
}

static struct ring_ready *ready_of(struct gossip *g, const uint8_t *id, bool create) {
  struct gossip_ring *r = &g->ring;
  struct ring_ready *found = find_ready(r, id);
  if (found || !create) return found;
  if (r->nreadies == RING_READY_MAX) r->nreadies = 0; /* a cluster this large starts over: rounds retry */
  struct ring_ready *e = &r->readies[r->nreadies++];
  memset(e, 0, sizeof *e); /* a slot reused after a start-over keeps nothing of its last member */
  memcpy(e->id, id, NET_PUBKEY_BYTES);
  return e;
}

/* Whether another member may hold the round's whole result already: a
 * piece that only we held went out (our fully reduced segment, phase n − 1,
 * the all-gather's first; a gather's phase 0, our own block). Until then
 * nobody else can complete the round, and failing it on purpose (to take a
 * newcomer in) leaves every member at this step. After, it could leave us
 * a round behind members that completed it, and a member a round behind
 * must pull a whole state from one of them, trusting that member: the
 * newcomer waits for the next round instead (catching up itself if the
 * cluster moved on). */
static bool others_may_complete(const struct gossip_ring *r) {
  if (r->n < 2 || !r->send) return false;
  uint32_t p = gathering(r) ? 0 : (uint32_t)r->n - 1;
  for (uint32_t j = 0; j < r->pieces; j++)
    if (r->send[p * r->pieces + j].state != RING_IO_NONE) return true;
  return false;
}

/* ---- ending a round ---- */

static void finish(struct gossip *g, int status) {
  struct gossip_ring *r = &g->ring;
  r->active = false;
  pthread_mutex_lock(&g->lock);
  r->info.step = r->step;
  r->info.members = r->n;
  if (status == GOSSIP_AR_DONE) {
    r->info.rounds_done++;
    r->info.why[0] = '\0';
    if (gathering(r)) r->ag_result = r->ag_out, r->ag_members = r->n, r->ag_self = r->me;
  } else {
    r->info.rounds_failed++;
    snprintf(r->info.why, sizeof r->info.why, "%s", r->why);
  }
  memcpy(r->info.ahead, r->ahead_id, NET_PUBKEY_BYTES);
  r->info.ahead_step = r->ahead_step;
  r->status = status;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

/* A failing round ends once no transfer callback is pending. */
static void maybe_failed(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  if (!r->active || !r->failing || r->cancelling || r->inflight) return;
  finish(g, r->ahead_step > r->step ? GOSSIP_AR_BEHIND : GOSSIP_AR_FAILED);
}

static void send_abort_to(struct gossip *g, const uint8_t *id) {
  struct gossip_ring *r = &g->ring;
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_RING_ABORT, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "step", r->step);
  net_msgbuf_put_uint(&b, "ring", r->hash);
  (void)gossip_send(g, id, &b); /* best effort: the others time out otherwise */
  net_msgbuf_free(&b);
}

static void send_abort(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  for (size_t i = 0; i < r->n; i++)
    if (i != r->me) send_abort_to(g, r->ids[i]);
}

/* Whether a piece of this attempt went to the successor (whatever became
 * of it since). */
static bool sent_any(const struct gossip_ring *r) {
  for (uint32_t k = 0; r->send && k < phases(r) * r->pieces; k++)
    if (r->send[k].state != RING_IO_NONE) return true;
  return false;
}

void gossip_ring_spend_ready(struct gossip_ring *r) {
  if (r->n < 2 || !r->succ_ready) return;
  struct ring_ready *e = find_ready(r, succ(r));
  if (e && e->nonce == r->succ_nonce) {
    e->step = e->hash = 0;
    e->spent = true;    /* the same READY arriving late is not taken again (on_ready) */
    e->answered = true; /* and wants no RING_AHEAD */
  }
  r->succ_ready = false;
}

bool gossip_ring_piece_refused(struct gossip_ring *r, uint32_t k, uint64_t nonce, uint64_t now_ms) {
  r->send[k].state = RING_IO_NONE;
  if (r->delivered) return true;
  if (!r->succ_ready || r->succ_nonce != nonce) return false; /* a newer READY came since: the piece goes again */
  if (++r->stale_readies > RING_STALE_READY_MAX) return true;
  gossip_ring_spend_ready(r);
  r->refused_ms = now_ms;
  return false;
}

/* Fails the round in progress: every transfer canceled, the other members
 * told (`tell`), the successor's READY spent, nothing delivered. */
static void fail(struct gossip *g, bool tell, const char *fmt, ...) RUMOR_PRINTF(3, 4);
static void fail(struct gossip *g, bool tell, const char *fmt, ...) {
  struct gossip_ring *r = &g->ring;
  if (!r->active || r->failing) return;
  r->failing = true;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(r->why, sizeof r->why, fmt, ap);
  va_end(ap);
  log_info("%s of step %llu over %zu members failed: %s (nothing applied)", gathering(r) ? "all-gather" : "all-reduce",
           (unsigned long long)r->step, r->n, r->why);
  bool sent = r->succ_ready && sent_any(r); /* before the cancels below reset them */
  r->cancelling = true;
  uint32_t total = phases(r) * r->pieces;
  for (uint32_t k = 0; k < total; k++) {
    if (r->send[k].state == RING_IO_BUSY) (void)net_conn_cancel_send(r->send[k].conn, r->send[k].id);
    if (r->recv[k].state == RING_IO_BUSY) (void)net_conn_cancel_recv(r->recv[k].conn, r->recv[k].id);
  }
  r->cancelling = false;
  gossip_ring_spend_ready(r);
  /* Told by another, we tell nobody; but a successor that took pieces of
   * ours on the READY just spent waits for more of them, and sends no
   * fresh READY while it has heard from us: it must fail too. */
  if (tell) send_abort(g);
  else if (sent) send_abort_to(g, succ(r));
  maybe_failed(g);
}

void gossip_ring_abandon(struct gossip *g, const char *why) { fail(g, false, "%s", why); }

#ifdef RUMOR_TESTING
static void release_held(struct gossip *g, uint64_t now);
#endif
static void watch_path(struct gossip *g, uint64_t now);

void gossip_ring_on_close(struct gossip *g, net_conn_t *c) {
  struct gossip_ring *r = &g->ring;
#ifdef RUMOR_TESTING
  release_held(g, UINT64_MAX); /* their confirmations came before the close */
#endif
  /* The next piece goes out on whatever link to the successor is open then
   * (pump asks for one again): a link replaced between pieces costs the
   * round nothing. */
  if (r->send_conn == c) r->send_conn = NULL;
  if (r->path_conn == c) r->path_conn = NULL; /* its address may be reused */
  if (!r->active) return;
  /* Transfers on it have normally ended (with an error) before it closes;
   * one still marked busy could never end, and its connection is about to
   * be freed: the round fails without touching it. */
  bool lost = false;
  for (uint32_t k = 0; k < phases(r) * r->pieces; k++) {
    if (r->send[k].state == RING_IO_BUSY && r->send[k].conn == c)
      r->send[k].state = RING_IO_NONE, r->send[k].conn = NULL, r->inflight--, lost = true;
    if (r->recv[k].state == RING_IO_BUSY && r->recv[k].conn == c)
      r->recv[k].state = RING_IO_NONE, r->recv[k].conn = NULL, r->inflight--, lost = true;
  }
  if (lost) {
    fail(g, true, "the connection to %s closed mid-transfer", net_conn_peer_name(c));
    maybe_failed(g);
  }
}

/* The ring in view becomes the one the quorum is counted against ("Quorum"
 * above): a round done over it, or a wait for more that ran out (the
 * members out of view are then taken for gone). */
static void quorum_rebase(struct gossip_ring *r) {
  r->done_members = r->n;
  r->done_ids = xrealloc(r->done_ids, r->n * NET_PUBKEY_BYTES);
  memcpy(r->done_ids, r->ids, r->n * NET_PUBKEY_BYTES);
}

static void maybe_done(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  if (!r->active || r->failing || r->recv_left || r->send_left) return;
  r->pos = r->step + 1;
  if (r->n != r->done_members)
    log_info("%s of step %llu done over %zu members (the last before it: over %zu)",
             gathering(r) ? "all-gather" : "all-reduce", (unsigned long long)r->step, r->n, r->done_members);
  quorum_rebase(r);
  watch_path(g, gossip_now_ms(g));
  log_debug("%s of step %llu over %zu members done in %llu ms", gathering(r) ? "all-gather" : "all-reduce",
            (unsigned long long)r->step, r->n, (unsigned long long)(gossip_now_ms(g) - r->started_ms));
  finish(g, GOSSIP_AR_DONE);
}

/* ---- sending ---- */

static void pump(struct gossip *g);

struct send_ctx {
  struct gossip *g;
  uint64_t gen;
  uint32_t k;
  uint64_t nonce; /* the successor's attempt it was sent to */
};

/* Piece k of ours was delivered. */
static void piece_delivered(struct gossip *g, uint32_t k) {
  struct gossip_ring *r = &g->ring;
  r->inflight--;
  r->send[k].state = RING_IO_DONE;
  r->send_left--;
  r->delivered++;
  maybe_done(g);
  maybe_failed(g); /* a failing round ends with its last callback */
}

#ifdef RUMOR_TESTING
/* slowconfirm: holds the delivery of a last-phase piece (true), to be
 * taken by release_held once due. */
static bool hold_delivery(struct gossip *g, uint32_t k, uint64_t id) {
  struct gossip_ring *r = &g->ring;
  uint64_t delay = gossip_testing_confirm_delay_ms(g);
  if (!delay || k / r->pieces != phases(r) - 1 || r->nheld == RING_HELD_MAX) return false;
  r->held[r->nheld++] = (struct ring_held){r->gen, id, gossip_now_ms(g) + delay, k};
  log_info("TESTING ONLY: the delivery of our last piece of step %llu is taken %llu ms late",
           (unsigned long long)r->step, (unsigned long long)delay);
  return true;
}

static void release_held(struct gossip *g, uint64_t now) {
  struct gossip_ring *r = &g->ring;
  size_t kept = 0;
  for (size_t i = 0; i < r->nheld; i++) {
    struct ring_held h = r->held[i];
    if (now < h.due_ms) {
      r->held[kept++] = h;
      continue;
    }
    if (r->active && h.gen == r->gen && r->send[h.k].state == RING_IO_BUSY && r->send[h.k].id == h.id)
      piece_delivered(g, h.k);
  }
  r->nheld = kept;
}
#endif

static void on_piece_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct send_ctx *sc = arg;
  struct gossip *g = sc->g;
  struct gossip_ring *r = &g->ring;
  uint32_t k = sc->k;
  uint64_t nonce = sc->nonce;
  bool current = r->active && sc->gen == r->gen && r->send[k].state == RING_IO_BUSY && r->send[k].id == id;
  free(sc);
  if (!current) return;
  if (!status) {
#ifdef RUMOR_TESTING
    if (hold_delivery(g, k, id)) return;
#endif
    piece_delivered(g, k);
    return;
  }
  r->inflight--;
  r->send[k].state = RING_IO_NONE;
  if (status == -ECONNREFUSED && !r->failing && !gossip_ring_piece_refused(r, k, nonce, gossip_now_ms(g))) {
    log_debug("all-reduce of step %llu: %s refused a piece sent on a READY of an attempt it has left; waiting "
              "for its current one",
              (unsigned long long)r->step, net_conn_peer_name(c));
    pump(g); /* a READY newer than the refused one may be here already */
    return;
  }
  fail(g, true, "sending to %s failed: %s", net_conn_peer_name(c), rumor_strerror(status));
  maybe_failed(g); /* a failing round ends with its last callback */
}

/* True when piece j of phase p may be sent: its data is final here. */
static bool sendable(const struct gossip_ring *r, uint32_t p, uint32_t j) {
  return p == 0 || r->recv[(p - 1) * r->pieces + j].state == RING_IO_DONE;
}

/* Where piece j of phase p is sent from, in which encoding. */
static const float *send_source(struct gossip *g, uint32_t p, uint64_t lo, uint64_t hi, enum net_dtype *wire) {
  struct gossip_ring *r = &g->ring;
  if (gathering(r)) {
    *wire = NET_DTYPE_F32; /* opaque words: bit-exact, never converted */
    return r->ag_out;
  }
  *wire = g->cfg.wire;
  if (p == r->n - 1) {
    /* Our own fully reduced piece: into `out` as the others will receive
     * it, through the wire encoding. */
    memcpy(r->out + lo, r->acc + lo, (hi - lo) * sizeof(float));
    net_dtype_roundtrip(g->cfg.wire, r->out + lo, hi - lo);
  }
  return p >= r->n - 1 ? r->out : r->acc;
}

static int send_piece(struct gossip *g, uint32_t p, uint32_t j) {
  struct gossip_ring *r = &g->ring;
  uint64_t lo, hi;
  piece_range(r, send_segment(r, p), j, &lo, &hi);
  enum net_dtype wire;
  const float *src = send_source(g, p, lo, hi, &wire);
  struct net_msgbuf meta;
  net_msgbuf_init(&meta, 0, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&meta, "k", GBULK_RING);
  net_msgbuf_put_uint(&meta, "x", r->hash);
  net_msgbuf_put_uint(&meta, "step", r->step);
  net_msgbuf_put_uint(&meta, "p", p);
  net_msgbuf_put_uint(&meta, "j", j);
  net_msgbuf_put_uint(&meta, "a", r->succ_nonce);
  size_t mlen;
  const uint8_t *mdata = net_msgbuf_data(&meta, &mlen);
  struct send_ctx *sc = xmalloc(sizeof *sc);
  uint32_t k = p * r->pieces + j;
  *sc = (struct send_ctx){g, r->gen, k, r->succ_nonce};
  struct net_bulk_send s = {.src = src + lo, .count = hi - lo, .wire = wire,
                            .no_digest = true, .meta = mdata, .meta_len = mlen, .done = on_piece_sent, .arg = sc};
  int rc = net_conn_send_bulk(r->send_conn, &s, &r->send[k].id);
  net_msgbuf_free(&meta);
  if (rc) {
    free(sc);
    return rc;
  }
  r->send[k].state = RING_IO_BUSY;
  r->send[k].conn = r->send_conn;
  r->inflight++;
  return 0;
}

/* Sends every piece whose data is ready, once the successor is ready and
 * connected. */
static void pump(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  if (!r->active || r->failing || !r->succ_ready) return;
  if (!r->send_conn) {
    r->send_conn = gossip_link_conn(g, succ(r));
    if (!r->send_conn) return; /* dialing: the tick tries again */
  }
  for (uint32_t p = 0; p < phases(r); p++)
    for (uint32_t j = 0; j < r->pieces; j++) {
      if (r->send[p * r->pieces + j].state != RING_IO_NONE || !sendable(r, p, j)) continue;
      int rc = send_piece(g, p, j);
      if (rc) {
        fail(g, true, "cannot send to the next member: %s", rumor_strerror(rc));
        return;
      }
    }
}

/* ---- receiving ---- */

static void send_ready(struct gossip *g);
static const char STALE_ATTEMPT[] = "an earlier attempt";

/* Why piece j of phase p (`count` floats in `wire`) from `from` is
 * refused, or NULL with its index and range in *k, *lo, *hi. Only the
 * predecessor's pieces of the current attempt at the current round (the
 * nonce of our RING_READY; the hash names the kind) are taken, each once,
 * of exactly the piece's length; a gather round's only as f32. */
static const char *piece_refusal(const struct gossip_ring *r, const uint8_t *from, uint64_t step, uint64_t hash,
                                 uint64_t nonce, uint64_t p, uint64_t j, uint64_t count, enum net_dtype wire,
                                 uint32_t *k, uint64_t *lo, uint64_t *hi) {
  if (!r->active || r->failing) return "no round in progress";
  if (r->awaiting_quorum) return "waiting for a quorum (no READY sent)";
  if (step != r->step) return "another step";
  if (hash != r->hash) return "another ring";
  if (nonce != r->nonce) return STALE_ATTEMPT;
  if (!same_id(from, pred(r))) return "not from the previous member";
  if (p >= phases(r) || j >= r->pieces) return "no such piece";
  *k = (uint32_t)p * r->pieces + (uint32_t)j;
  piece_range(r, recv_segment(r, (uint32_t)p), (uint32_t)j, lo, hi);
  if (r->recv[*k].state != RING_IO_NONE) return "that piece again";
  if (count != *hi - *lo) return "a wrong length";
  if (gathering(r) && wire != NET_DTYPE_F32) return "all-gather words in a lossy encoding";
  return NULL;
}

int gossip_ring_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                              const struct net_msg *meta, float **dst, void **dst_arg) {
  struct gossip_ring *r = &g->ring;
  uint64_t hash, step, p, j, nonce;
  if (net_msg_get_uint(meta, "x", &hash) || net_msg_get_uint(meta, "step", &step) || net_msg_get_uint(meta, "p", &p) ||
      net_msg_get_uint(meta, "j", &j) || net_msg_get_uint(meta, "a", &nonce))
    return RUMOR_EPROTO;
  uint32_t k;
  uint64_t lo, hi;
  const char *why =
      piece_refusal(r, net_conn_peer_key(c), step, hash, nonce, p, j, info->count, info->wire, &k, &lo, &hi);
  if (why) {
    log_debug("ring piece (step %llu, phase %llu, piece %llu) from %s refused: %s", (unsigned long long)step,
              (unsigned long long)p, (unsigned long long)j, net_conn_peer_name(c), why);
    /* The predecessor sent on a READY of ours from an attempt that failed
     * (gossip_ring_piece_refused): our current one goes to it at once,
     * once per stale nonce, rather than at the next repetition. */
    if (why == STALE_ATTEMPT && nonce != r->stale_told && same_id(net_conn_peer_key(c), pred(r))) {
      r->stale_told = nonce;
      send_ready(g);
    }
    return -ECONNREFUSED;
  }
  r->recv[k] = (struct ring_io){RING_IO_BUSY, info->id, c};
  r->inflight++;
  r->heard_pred = true;
  *dst = (gathering(r) ? r->ag_out : r->out) + lo;
  *dst_arg = (void *)(uintptr_t)(k + 1);
  return 0;
}

bool gossip_ring_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status, void *dst_arg) {
  struct gossip_ring *r = &g->ring;
  if (!dst_arg) return false;
  uint32_t k = (uint32_t)((uintptr_t)dst_arg - 1);
  if (!r->active || k >= phases(r) * r->pieces || r->recv[k].state != RING_IO_BUSY || r->recv[k].id != id ||
      r->recv[k].conn != c)
    return true; /* a ring piece of a round already ended */
  r->inflight--;
  if (status) {
    r->recv[k].state = RING_IO_NONE;
    fail(g, true, "receiving from %s failed: %s", net_conn_peer_name(c), rumor_strerror(status));
    maybe_failed(g);
    return true;
  }
  if (r->failing) {
    maybe_failed(g);
    return true;
  }
  uint32_t p = k / r->pieces, j = k % r->pieces;
  if (!gathering(r) && p < r->n - 1) {
    /* Reduce-scatter: add the predecessor's partial sum into ours. */
    uint64_t lo, hi;
    piece_range(r, recv_segment(r, p), j, &lo, &hi);
    for (uint64_t x = lo; x < hi; x++) r->acc[x] += r->out[x];
  }
  r->recv[k].state = RING_IO_DONE;
  r->recv_left--;
  pump(g);
  maybe_done(g);
  return true;
}

/* ---- starting a round ---- */

static void send_ahead(struct gossip *g, const uint8_t *to, net_conn_t *c) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_RING_AHEAD, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "step", g->ring.pos);
  int rc = c ? net_conn_send_msg(c, &b) : gossip_send(g, to, &b);
  if (rc) log_debug("cannot tell a member that we are at step %llu", (unsigned long long)g->ring.pos);
  net_msgbuf_free(&b);
}

/* Members whose last READY is for a step we have completed wait for a round
 * that will not come: tell them (once per READY). Our position moved on
 * since they asked, or they asked while we were behind too. */
static void answer_stale_readies(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  for (size_t i = 0; i < r->nreadies; i++) {
    struct ring_ready *e = &r->readies[i];
    if (e->answered || e->step >= r->pos) continue;
    e->answered = true;
    send_ahead(g, e->id, NULL);
  }
}

static void send_ready(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_RING_READY, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "step", r->step);
  net_msgbuf_put_uint(&b, "ring", r->hash);
  net_msgbuf_put_uint(&b, "n", r->n);
  uint64_t nonce = r->nonce;
#ifdef RUMOR_TESTING
  if (gossip_testing_stale_ready(g, r->ready_sends == 0)) {
    nonce = ~r->nonce;
    log_info("TESTING ONLY: this all-reduce READY names an attempt that is not ours");
  }
#endif
  net_msgbuf_put_uint(&b, "a", nonce);
  r->ready_sent_ms = gossip_now_ms(g);
  r->ready_sends++;
#ifdef RUMOR_TESTING
  if (gossip_testing_lose_ready(g, r->ready_sends == 1)) {
    log_info("TESTING ONLY: this all-reduce READY is lost on purpose");
    net_msgbuf_free(&b);
    return;
  }
#endif
  int rc = gossip_send(g, pred(r), &b);
  net_msgbuf_free(&b);
  if (rc == -ENOBUFS) {
    /* The link's queue is full while its dial runs (or its connection's
     * outbound queue is): this READY is lost as one lost on the way would
     * be, and goes again after
     * RING_READY_RESEND_MS (gossip_ring_tick) unless the predecessor is
     * heard from first; the round's deadline still bounds the wait. Any
     * other error means the predecessor cannot be reached at all. */
    log_debug("all-reduce of step %llu: no room for our READY; it goes again", (unsigned long long)r->step);
    return;
  }
  if (rc) fail(g, false, "cannot reach the previous member: %s", rumor_strerror(rc));
}

/* A gather round's result: room for the ring's n blocks (kept across
 * rounds, grown when the ring is larger), with our own block copied into
 * its slot. False when there is no room (the round fails, and says so to
 * the others). */
static bool gather_prepare(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  uint64_t words = r->ag_words;
  if (r->n > GOSSIP_GATHER_MAX_FLOATS / words) {
    fail(g, true, "%zu blocks of %llu words are more than the %llu words an all-gather may hold", r->n,
         (unsigned long long)words, (unsigned long long)GOSSIP_GATHER_MAX_FLOATS);
    return false;
  }
  uint64_t need = words * r->n;
  if (need > r->ag_cap) {
    /* No transfer of an earlier round is pending: it ended DONE, or FAILED
     * once every callback ran. */
    free(r->ag_out);
    r->ag_out = malloc(need * sizeof(float));
    r->ag_cap = r->ag_out ? need : 0;
    if (!r->ag_out) {
      fail(g, true, "no memory for %zu blocks of the all-gather (%.1f MiB)", r->n,
           (double)need * sizeof(float) / (1 << 20));
      return false;
    }
  }
  memcpy(r->ag_out + words * r->me, r->ag_mine, words * sizeof(float));
  return true;
}

/* The round's transfers, none begun: `pieces` per segment, 2(n−1) or n−1
 * phases; empty pieces (a reduce ring with more members than floats)
 * count as done. */
static void transfers_init(struct gossip_ring *r) {
  uint64_t seg = gathering(r) ? r->ag_words : (r->count + r->n - 1) / r->n;
  r->pieces = (uint32_t)((seg + RING_PIECE_FLOATS - 1) / RING_PIECE_FLOATS);
  uint32_t total = phases(r) * r->pieces;
  free(r->recv);
  free(r->send);
  r->recv = xcalloc(total, sizeof *r->recv);
  r->send = xcalloc(total, sizeof *r->send);
  r->recv_left = r->send_left = total;
  for (uint32_t k = 0; k < total; k++) {
    uint64_t lo, hi;
    piece_range(r, recv_segment(r, k / r->pieces), k % r->pieces, &lo, &hi);
    if (lo == hi) r->recv[k].state = RING_IO_DONE, r->recv_left--;
    piece_range(r, send_segment(r, k / r->pieces), k % r->pieces, &lo, &hi);
    if (lo == hi) r->send[k].state = RING_IO_DONE, r->send_left--;
  }
  r->inflight = 0;
  r->delivered = r->stale_readies = 0;
  r->refused_ms = 0;
  r->send_conn = NULL;
}

/* The ring in our view now, our place in it, and its hash. */
static void take_view(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  free(r->ids);
  r->ids = view_ring(g, &r->n);
  r->sorted = xrealloc(r->sorted, r->n * NET_PUBKEY_BYTES);
  memcpy(r->sorted, r->ids, r->n * NET_PUBKEY_BYTES);
  qsort(r->sorted, r->n, NET_PUBKEY_BYTES, cmp_id);
  r->me = 0;
  while (!same_id(r->ids[r->me], g->identity.pk)) r->me++; /* view_ring puts us in */
  r->hash = ring_hash(r, r->ids, r->n);
}

/* Members of the last ring we completed a round with that have not left
 * (we count, and so do suspect and failed ones: a cut may hide them; one
 * SWIM forgot, long after it left, does not). */
static size_t quorum_base(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  size_t base = 0;
  for (size_t i = 0; i < r->done_members; i++) {
    if (same_id(r->done_ids[i], g->identity.pk)) {
      base++;
      continue;
    }
    const struct swim_member *m = swim_find(&g->swim, r->done_ids[i]);
    if (m && m->info.state != SWIM_LEFT) base++;
  }
  return base;
}

/* A peer alive in our view but not ready: away, or joining. */
static bool someone_away(const struct gossip *g) {
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role == SWIM_ROLE_PEER && m->info.state == SWIM_ALIVE && !m->info.ready) return true;
  }
  return false;
}

/* After a round done: the window of our link to the successor, and the
 * advice to sit out when it lost too much ("Sitting out" above). */
static void watch_path(struct gossip *g, uint64_t now) {
  struct gossip_ring *r = &g->ring;
  struct net_tcp_path p;
  if (g->cfg.sit_out_loss <= 0 || r->n < 2 || !r->send_conn || net_conn_tcp_path(r->send_conn, &p)) {
    r->path_conn = NULL;
    return;
  }
  if (r->send_conn != r->path_conn || p.data_segs_out < r->path_at.data_segs_out ||
      p.retrans_segs < r->path_at.retrans_segs) { /* another link: a new window */
    r->path_conn = r->send_conn;
    r->path_at = p;
    r->path_since_ms = now;
    return;
  }
  if (now - r->path_since_ms < GOSSIP_PATH_WINDOW_MS) return;
  uint64_t sent = p.data_segs_out - r->path_at.data_segs_out, again = p.retrans_segs - r->path_at.retrans_segs;
  double secs = (double)(now - r->path_since_ms) / 1000;
  r->path_at = p;
  r->path_since_ms = now;
  if (sent < RING_PATH_MIN_SEGS) return;
  double lost = (double)again / (double)sent;
  log_debug("all-reduce: our link to the next member retransmitted %llu of %llu segments (%.2f %%) in %.1f s",
            (unsigned long long)again, (unsigned long long)sent, 100 * lost, secs);
  if (lost < g->cfg.sit_out_loss) return;
  /* Without us the ring must still hold a majority of its last round's,
   * and one member is away at a time: loss on a member's incoming side
   * shows as its predecessor's retransmissions, and the next predecessor's,
   * and so on around the ring (a newcomer still joining delays us too). */
  if (2 * (r->n - 1) <= quorum_base(g) || someone_away(g)) return;
  pthread_mutex_lock(&g->lock);
  r->sit_out = true;
  snprintf(r->sit_out_why, sizeof r->sit_out_why,
           "our link to the next member (%s) retransmitted %.1f %% of the %llu segments we sent in the last %.1f s",
           net_conn_peer_name(r->send_conn), 100 * lost, (unsigned long long)sent, secs);
  pthread_mutex_unlock(&g->lock);
}

bool gossip_ar_sit_out(gossip_t *g, char *why, size_t n) {
  struct gossip_ring *r = &g->ring;
  pthread_mutex_lock(&g->lock);
  bool advised = r->sit_out;
  r->sit_out = false;
  if (advised) snprintf(why, n, "%s", r->sit_out_why);
  pthread_mutex_unlock(&g->lock);
  return advised;
}

/* Whether the ring in view may run the round now ("Quorum" above); logs
 * when a wait starts and when it ends. */
static bool quorum_ok(struct gossip *g, uint64_t now) {
  struct gossip_ring *r = &g->ring;
  size_t base = quorum_base(g);
  const char *what = gathering(r) ? "all-gather" : "all-reduce";
  if (g->cfg.quorum_wait_ms == 0 || 2 * r->n > base) {
    if (r->quorum_since_ms)
      log_info("%s of step %llu: %zu of the %zu members of our last round in view after %.1f s: going on", what,
               (unsigned long long)r->step, r->n, base, (double)(now - r->quorum_since_ms) / 1000);
    r->quorum_since_ms = 0;
    return true;
  }
  if (!r->quorum_since_ms) {
    r->quorum_since_ms = now;
    log_warn("%s of step %llu: only %zu of the %zu members of our last round in view (cut off?): waiting up to "
             "%.1f s for more before going on without them",
             what, (unsigned long long)r->step, r->n, base, (double)g->cfg.quorum_wait_ms / 1000);
  } else if (now - r->quorum_since_ms >= g->cfg.quorum_wait_ms) {
    log_warn("%s of step %llu: going on with %zu of the %zu members of our last round after waiting %.1f s for "
             "the others",
             what, (unsigned long long)r->step, r->n, base, (double)(now - r->quorum_since_ms) / 1000);
    quorum_rebase(r); /* a failed attempt now does not wait again; a further shrink does */
    r->quorum_since_ms = 0;
    return true;
  }
  return false;
}

/* Someone already completed the round's step: its round will never come,
 * and it fails as BEHIND (true). */
static bool failed_behind(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  if (r->ahead_step <= r->step) return false;
  fail(g, false, "%llu steps behind the cluster", (unsigned long long)(r->ahead_step - r->step));
  return true;
}

/* The attempt proper, once the ring in view may run it: its READY goes
 * out, and its pieces as the successor is ready. */
static void begin_attempt(struct gossip *g) {
  struct gossip_ring *r = &g->ring;
  r->awaiting_quorum = false;
  r->nonce = rng_next_u64(&g->rng);
  r->started_ms = gossip_now_ms(g);
  r->deadline_ms = r->started_ms + g->cfg.exchange_timeout_ms;
  if (gathering(r) && !gather_prepare(g)) return;
  if (r->n == 1) {
    if (!gathering(r)) memcpy(r->out, r->acc, r->count * sizeof(float));
    r->recv_left = r->send_left = 0;
    maybe_done(g);
    return;
  }
  transfers_init(r);
  const struct ring_ready *sr = ready_of(g, succ(r), false);
  r->succ_ready = sr && sr->step == r->step && sr->hash == r->hash;
  if (r->succ_ready) r->succ_nonce = sr->nonce;
  send_ready(g);
  pump(g);
}

static void start_round(struct gossip *g, uint64_t step, enum ring_kind kind) {
  struct gossip_ring *r = &g->ring;
  RUMOR_ASSERT(!r->active);
  r->gen++;
  r->step = step;
  r->kind = (uint8_t)kind;
  if (step > r->pos) r->pos = step;
  answer_stale_readies(g);
  take_view(g);
  r->active = true;
  r->failing = false;
  r->why[0] = '\0';
  r->started_ms = gossip_now_ms(g); /* begin_attempt sets it again, and the deadline */
  r->pieces = 0; /* no transfers yet: the last round's arrays are for another ring */
  r->recv_left = r->send_left = 0;
  r->awaiting_quorum = false;
  r->heard_pred = false;
  r->ready_sends = 0;
  if (failed_behind(g)) return;
  r->awaiting_quorum = !quorum_ok(g, r->started_ms);
  if (!r->awaiting_quorum) begin_attempt(g);
}

/* A round waiting for its quorum, every tick: behind a member that told
 * us of a later step meanwhile (a RING_AHEAD, which fails no round while
 * we wait: we sent no READY and receive nothing), or the view again. */
static void quorum_tick(struct gossip *g, uint64_t now) {
  if (failed_behind(g)) return;
  take_view(g);
  if (quorum_ok(g, now)) begin_attempt(g);
}

static void start_on_loop(net_t *n, void *arg, int status) {
  struct ring_start *s = arg;
  struct gossip *g = s->g;
  uint64_t step = s->step;
  enum ring_kind kind = s->kind;
  free(s);
  if (status || g->stopping) {
    if (!status) set_status(g, GOSSIP_AR_FAILED);
    return;
  }
#ifdef RUMOR_TESTING
  gossip_testing_ring_start(g, step, kind == RING_REDUCE);
#endif
  start_round(g, step, kind);
}

/* ---- messages ---- */

bool gossip_ring_heard_ahead(struct gossip_ring *r, const uint8_t *from, uint64_t step, bool ready) {
  /* A READY for pos + 1 is only a member a little quicker than us. */
  if (step <= r->pos + (ready ? 1 : 0)) return false;
  if (step > r->ahead_step) {
    r->ahead_step = step;
    memcpy(r->ahead_id, from, NET_PUBKEY_BYTES);
  }
  if (!r->active || r->failing || step <= r->step) return false;
  /* A READY that far: the cluster went on without us. A RING_AHEAD only
   * answers a READY of ours: from the predecessor, what we still wait for
   * from it never comes; from another member it may answer a READY of an
   * earlier attempt (in a ring where that one was our predecessor), no
   * reason to fail this round, and the predecessor's own must still fail
   * it when it follows. */
  return ready || (same_id(from, pred(r)) && r->recv_left);
}

/* `from`, not in our round or in another view of it, said RING_READY. */
static void on_ready(struct gossip *g, net_conn_t *c, const uint8_t *from, uint64_t step, uint64_t hash,
                     uint64_t nonce) {
  struct gossip_ring *r = &g->ring;
  if (gossip_ring_heard_ahead(r, from, step, true))
    fail(g, false, "%s is at step %llu already", net_conn_peer_name(c), (unsigned long long)step);
  struct ring_ready *e = ready_of(g, from, true);
  if (e->spent && e->nonce == nonce) return; /* an attempt that failed, said again: resent, or late */
  e->step = step;
  e->hash = hash;
  e->nonce = nonce;
  e->spent = false;
  e->answered = step < r->pos;
  if (e->answered) {
    /* We completed that step: it waits for a round that will not come. */
    send_ahead(g, from, c);
    return;
  }
  /* Waiting for a quorum, we sent no READY and have no transfers: the
   * successor's READY is kept (ready_of, above) for begin_attempt. */
  if (!r->active || r->failing || r->awaiting_quorum || step != r->step) return;
  if (hash == r->hash) {
    if (same_id(from, succ(r))) {
      r->succ_ready = true;
      r->succ_nonce = nonce; /* a new attempt: pieces already sent to the old one fail, and we start over */
      r->refused_ms = 0;
      pump(g);
    }
    return;
  }
  /* Another ring for the same step: when our own view now agrees with it,
   * the membership changed since our round began, and ours is the stale one
   * (but a newcomer's, once others may have completed ours: it comes in at
   * the next round). */
  if (!in_ring(r, from) && others_may_complete(r)) return;
  size_t n;
  uint8_t(*ids)[NET_PUBKEY_BYTES] = view_ring(g, &n);
  uint64_t now_hash = ring_hash(r, ids, n);
  free(ids);
  if (now_hash == hash) fail(g, true, "the membership changed: the ring re-forms with %zu members", n);
}

void gossip_ring_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  struct gossip_ring *r = &g->ring;
  const uint8_t *from = net_conn_peer_key(c);
  uint64_t step, hash = 0, nonce = 0;
  if (net_msg_get_uint(m, "step", &step) || (m->type != GMSG_RING_AHEAD && net_msg_get_uint(m, "ring", &hash)) ||
      (m->type == GMSG_RING_READY && net_msg_get_uint(m, "a", &nonce))) {
    log_warn("malformed all-reduce message from %s; dropping the connection", net_conn_peer_name(c));
    net_conn_close(c);
    return;
  }
  if (g->cfg.sync != GOSSIP_SYNC_ALLREDUCE || !atomic_load(&g->ready)) return;
  switch (m->type) {
  case GMSG_RING_READY: on_ready(g, c, from, step, hash, nonce); return;
  case GMSG_RING_AHEAD:
    if (gossip_ring_heard_ahead(r, from, step, false))
      fail(g, true, "%s is at step %llu already", net_conn_peer_name(c), (unsigned long long)step);
    return;
  default: /* GMSG_RING_ABORT */
    if (r->active && !r->failing && step == r->step && hash == r->hash && in_ring(r, from))
      fail(g, false, "%s gave the round up", net_conn_peer_name(c));
    return;
  }
}

/* ---- the tick ---- */

void gossip_ring_tick(struct gossip *g, uint64_t now) {
  struct gossip_ring *r = &g->ring;
#ifdef RUMOR_TESTING
  release_held(g, now);
#endif
  if (!r->active || r->failing) return;
  if (r->awaiting_quorum) { /* no deadline while it waits: quorum_wait_ms bounds it */
    quorum_tick(g, now);
    return;
  }
  if (now >= r->deadline_ms) {
    fail(g, true, "timed out after %u ms", g->cfg.exchange_timeout_ms);
    return;
  }
  if (r->refused_ms && !r->succ_ready && now >= r->refused_ms + RING_REFUSED_WAIT_MS) {
    fail(g, true, "the next member refused our pieces and sent no READY for this attempt in %d ms",
         RING_REFUSED_WAIT_MS);
    return;
  }
  /* A member out of our view (suspect, failed, left): what we still wait
   * for passes through it (every piece does, while we receive), or it is
   * the next member we still send to. The ring re-forms without it. */
  char who[200];
  const uint8_t *out = r->recv_left ? ring_member_out(g) : NULL;
  if (!out && (r->send_left || !r->succ_ready) && out_of_view(g, succ(r))) out = succ(r);
  if (out) {
    const struct swim_member *m = swim_find(&g->swim, out);
    gossip_member_label(g, out, who, sizeof who);
    const char *state = !m ? "gone" : m->info.state == SWIM_ALIVE ? "away" : swim_state_name(m->info.state);
    fail(g, true, "%s is %s: the ring re-forms without it", who, state);
    return;
  }
  /* Nothing from the predecessor yet: perhaps our READY never reached it
   * (RING_READY_RESEND_MS). The same attempt's READY again is harmless: a
   * predecessor that had it already changes nothing. */
  if (r->n > 1 && !r->heard_pred && r->recv_left && now >= r->ready_sent_ms + RING_READY_RESEND_MS) {
    log_debug("all-reduce of step %llu: nothing from the previous member yet; telling it again that we are ready",
              (unsigned long long)r->step);
    send_ready(g);
    if (!r->active || r->failing) return;
  }
  /* A ready peer outside the ring (a newcomer, or a member back from a
   * failure verdict): the ring re-forms with it, unless others may have
   * completed this round (it comes in at the next). */
  bool may_take_newcomer = !others_may_complete(r);
  for (size_t i = 0; may_take_newcomer && i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || !m->info.ready || m->info.state != SWIM_ALIVE || in_ring(r, m->info.id))
      continue;
    gossip_member_label(g, m->info.id, who, sizeof who);
    fail(g, true, "%s is ready: the ring re-forms with it", who);
    return;
  }
  pump(g);
}
