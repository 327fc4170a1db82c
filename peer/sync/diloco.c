/* `--sync allreduce --outer K`: DiLoCo (sync.h, "Outer optimizers"). Every
 * H steps the members sum their pseudo-gradients, weighted by the rows each
 * trained in the round, over the ring (an all-gather of top-k encodings
 * with --outer-compress topk), and apply the same outer step to the same
 * anchor. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

/* The rows a member may claim for one round: more than any run trains
 * (TRAIN_STEPS_MAX × TRAIN_BATCH_MAX is beyond a float's exact range; this
 * bounds a hostile claim's weight, not an honest one). */
#define DILOCO_MAX_ROUND_ROWS 1e15

static bool topk(const struct sync *s) { return s->cfg.outer.compress.kind == CODEC_TOPK; }

/* An all-gather block: the rows (one float) and the encoding, in words. */
static uint64_t block_words(const struct sync_config *c, int64_t P) {
  return 1 + (codec_bytes(&c->outer.compress, (uint64_t)P) + 3) / 4;
}

/* The round's contribution, made once per round (error feedback must see
 * each round once however often the ring retries): dense, the
 * pseudo-gradient times the rows on the host (outer.host, P + 1 floats);
 * top-k, the block in outer.host. `work` holds the pseudo-gradient. */
static void encode(struct sync *s, int64_t rows) {
  struct sync_outer *o = &s->outer;
  int64_t P = s->t->model.nparams;
  float *h = o->host;
  if (!topk(s)) {
    tensor_copy_to_host(&o->work, 0, h, (size_t)P * sizeof(float));
    for (int64_t i = 0; i < P; i++) h[i] *= (float)rows;
    h[P] = (float)rows;
    return;
  }
  /* Top-k with error feedback: the residual is host-side for the encoder
   * and goes back to the device state after. */
  float *x = xmalloc((size_t)P * sizeof(float)), *r = xmalloc((size_t)P * sizeof(float));
  tensor_copy_to_host(&o->work, 0, x, (size_t)P * sizeof(float));
  tensor_copy_to_host(&o->residual, 0, r, (size_t)P * sizeof(float));
  uint64_t words = block_words(&s->cfg, P);
  memset(h, 0, (size_t)words * sizeof(float));
  h[0] = (float)rows;
  codec_encode(&s->cfg.outer.compress, x, r, (uint64_t)P, (uint8_t *)(h + 1));
  tensor_copy_from_host(&o->residual, 0, r, (size_t)P * sizeof(float));
  free(x);
  free(r);
}

static void fill(struct sync *s, void *arg) {
  (void)arg;
  int64_t P = s->t->model.nparams;
  if (topk(s)) memcpy(gossip_ag_buf(s->g), s->outer.host, (size_t)block_words(&s->cfg, P) * sizeof(float));
  else memcpy(gossip_ar_buf(s->g), s->outer.host, ((size_t)P + 1) * sizeof(float));
}

/* The dense sum: its mean into outer.work. False when it is not finite
 * (every member sees the same sum). */
static bool take_sum(struct sync *s) {
  int64_t P = s->t->model.nparams;
  const float *sum = gossip_ar_result(s->g);
  double rows = sum[P];
  bool finite = isfinite(rows) && rows > 0;
  for (int64_t i = 0; finite && i < P; i++) finite = isfinite(sum[i]);
  if (!finite) return false;
  tensor_copy_from_host(&s->outer.work, 0, sum, (size_t)P * sizeof(float));
  tensor_scale(&s->outer.work, (float)(1.0 / rows));
  return true;
}

/* The gathered blocks: their weighted mean into outer.work. A block that
 * does not decode (a broken or hostile member) is left out, by every member
 * alike, since every member holds the same blocks. False when no rows are
 * left. */
static bool take_blocks(struct sync *s) {
  int64_t P = s->t->model.nparams;
  size_t n, self;
  const float *b = gossip_ag_result(s->g, &n, &self);
  uint64_t words = block_words(&s->cfg, P), len = codec_bytes(&s->cfg.outer.compress, (uint64_t)P);
  double total = 0;
  bool *ok = xcalloc(n, sizeof *ok);
  for (size_t i = 0; i < n; i++) {
    double rows = b[i * words];
    ok[i] = isfinite(rows) && rows >= 0 && rows <= DILOCO_MAX_ROUND_ROWS;
    if (ok[i]) total += rows;
    else log_warn("DiLoCo: member %zu of the ring claims %g rows: its block is left out", i, rows);
  }
  float *acc = s->outer.host;
  memset(acc, 0, (size_t)P * sizeof(float));
  for (size_t i = 0; i < n && total > 0; i++) {
    if (!ok[i] || b[i * words] == 0) continue;
    struct rumor_err e = {0};
    float w = (float)(b[i * words] / total);
    if (codec_decode_add(&s->cfg.outer.compress, (const uint8_t *)(b + i * words + 1), len, (uint64_t)P, w, acc, &e))
      log_warn("DiLoCo: the block of member %zu of the ring is left out: %s", i, e.msg); /* acc unchanged */
  }
  free(ok);
  if (!(total > 0)) return false;
  tensor_copy_from_host(&s->outer.work, 0, acc, (size_t)P * sizeof(float));
  return true;
}

static bool take_result(struct sync *s) { return topk(s) ? take_blocks(s) : take_sum(s); }

/* The payload bytes this member sent and received in a round over a ring
 * of n: a ring all-reduce sends and receives 2(n − 1)/n of the vector in
 * the ring's encoding, an all-gather (n − 1) blocks each way. */
static double round_bytes(const struct sync *s, size_t n) {
  int64_t P = s->t->model.nparams;
  if (n < 2) return 0;
  if (topk(s)) return 2.0 * (double)(n - 1) * (double)block_words(&s->cfg, P) * 4;
  struct sync_gossip_plan plan;
  s->scheme->plan(&s->cfg, P, &plan);
  return 2.0 * 2.0 * (double)(n - 1) / (double)n * (double)net_dtype_bytes(plan.wire, (uint64_t)P + 1);
}

/* After a round's communication: the outer step, or (a result not finite)
 * the round dropped on every member alike: the parameters go back to the
 * anchor. */
static void apply(struct sync *s) {
  struct sync_outer *o = &s->outer;
  o->last_bytes = round_bytes(s, s->ring.members);
  if (take_result(s)) {
    sync_outer_step(s);
    return;
  }
  log_warn("DiLoCo: the averaged pseudo-gradient of round %llu is not finite: round dropped on every member",
           (unsigned long long)o->rounds);
  s->ring.skipped++;
  struct tensor params = tensor_flat(&s->t->model.params);
  tensor_copy(&params, &o->anchor);
  o->in_flight = false;
  o->rounds++;
  s->changes++;
  sync_outer_store(s);
}

static enum sync_round_kind round_kind(const struct sync *s) { return topk(s) ? SYNC_ROUND_GATHER : SYNC_ROUND_REDUCE; }

/* The catch-up's state: one that completed our round, in the middle of
 * the next (a later step), or with --outer-overlap at the same boundary
 * (full states are donated only there). */
static uint64_t catch_up_step(const struct sync *s) {
  return (uint64_t)s->t->st.step + (s->cfg.outer.overlap ? 0 : 1);
}

/* One whole round now: work = this member's pseudo-gradient, `rows` its
 * weight. Returns 0 (applied), 1 (left behind: a state was taken), or a
 * negative code. */
static int round_now(struct sync *s, int64_t rows, struct rumor_err *e) {
  encode(s, rows);
  uint64_t id = s->outer.rounds;
  double t0 = clock_now_s();
  int rc = sync_ring_round(s, round_kind(s), id, fill, NULL, catch_up_step(s), e);
  s->outer.wait_s += clock_now_s() - t0;
  if (rc == 0) apply(s);
  return rc;
}

/* --outer-overlap: the round started at the last boundary. Waits for it
 * (counted in outer_wait_s), or runs it again when it failed. */
static int land_flight(struct sync *s, struct rumor_err *e) {
  struct sync_outer *o = &s->outer;
  double t0 = clock_now_s();
  enum gossip_ar_status st;
  while ((st = gossip_ar_wait(s->g, 5)) == GOSSIP_AR_RUNNING && !sync_stopped(s)) sync_idle(s);
  o->wait_s += clock_now_s() - t0;
  if (st == GOSSIP_AR_DONE) {
    struct gossip_ar_info info;
    gossip_ar_info(s->g, &info);
    s->ring.rounds++;
    s->ring.members = info.members;
    apply(s);
    return 0;
  }
  if (sync_stopped(s)) return rumor_err_set(e, RUMOR_ECANCELED, "stopped during an outer round");
  /* Failed or left behind: again, synchronously, from what was sent. */
  tensor_copy(&o->work, &o->anchor);
  tensor_axpby(-1.0f, &o->prev, 1.0f, &o->work);
  return round_now(s, o->flight_rows, e);
}

/* --outer-overlap: starts round `rounds` on this boundary's pseudo-gradient
 * and goes back to training. */
static void launch(struct sync *s, int64_t rows) {
  struct sync_outer *o = &s->outer;
  struct tensor params = tensor_flat(&s->t->model.params);
  sync_outer_pseudo_gradient(s);
  tensor_copy(&o->prev, &params);
  o->in_flight = true;
  o->flight_rows = rows;
  s->donate_state_ok = false; /* a state now would lack the round in flight's update */
  sync_outer_store(s);
  encode(s, rows);
  fill(s, NULL);
  uint64_t id = o->rounds;
  int rc = topk(s) ? gossip_ag_start(s->g, id) : gossip_ar_start(s->g, id);
  if (rc) log_warn("DiLoCo: cannot start round %llu (the runtime is stopping)", (unsigned long long)id);
}

static int diloco_boundary(struct sync *s, struct rumor_err *e) {
  struct sync_outer *o = &s->outer;
  if (!sync_outer_due(s)) return 0;
  int64_t rows = sync_outer_round_rows(s);
  int rc = o->in_flight ? land_flight(s, e) : 0;
  if (rc < 0) return rc;
  if (rc == 1) sync_outer_reload(s); /* a state taken from a member ahead: none of our rows in it */
  /* Nothing in flight: a full state may be donated (now, before the next
   * round starts, if a newcomer waits). */
  s->donate_state_ok = true;
  sync_idle(s);
  if (!sync_outer_due(s)) return 0; /* the state taken is past this boundary */
  o->round_rows0 = s->t->st.samples;
  if (s->cfg.outer.overlap && !trainer_done(s->t)) {
    launch(s, rc == 1 ? 0 : rows);
    return 0;
  }
  sync_outer_pseudo_gradient(s);
  rc = round_now(s, rc == 1 ? 0 : rows, e);
  if (rc == 1) sync_outer_reload(s);
  return rc < 0 ? rc : 0;
}

static void diloco_extra(const struct sync_config *c, struct train_extra_spec *out) { sync_outer_extra(c, out); }

static void diloco_plan(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out) {
  const struct outer_config *o = &c->outer;
  enum net_dtype wire = o->compress.kind == CODEC_F16 ? NET_DTYPE_F16 : o->compress.kind == CODEC_I8 ? NET_DTYPE_I8 : c->wire;
  *out = (struct sync_gossip_plan){.protocol = GOSSIP_SYNC_ALLREDUCE, .buf_floats = (uint64_t)nparams + 1,
                                   .gather_floats = o->compress.kind == CODEC_TOPK ? block_words(c, nparams) : 0,
                                   .wire = wire};
  char comp[CODEC_TEXT_MAX];
  codec_format(&o->compress, comp, sizeof comp);
  /* Members must share every setting that decides their rounds. */
  snprintf(out->label, sizeof out->label, " sync=diloco outer=%s H=%lld lr=%g mu=%g compress=%s%s",
           outer_kind_name(o->kind), (long long)o->local_steps, o->lr, o->momentum, comp,
           o->overlap ? " overlap" : "");
}

static int diloco_init(struct sync *s, struct rumor_err *e) {
  int rc = sync_outer_init(s, e);
  if (rc) return rc;
  s->donate_state_ok = !s->outer.in_flight;
  return 0;
}

static int diloco_finish(struct sync *s, const struct sync_finish_args *f, struct rumor_err *e) {
  (void)s, (void)f, (void)e;
  return 0; /* the last step's boundary ran the last round */
}

static void diloco_free(struct sync *s) { sync_outer_free(s); }

static void diloco_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  sync_scheme_allreduce.result(s, gs, o);
  sync_outer_result(s, o);
}

const struct sync_scheme sync_scheme_diloco = {
    .name = "diloco",
    .extra = diloco_extra,
    .plan = diloco_plan,
    .init = diloco_init,
    .boundary = diloco_boundary,
    .reduce = NULL,
    .finish = diloco_finish,
    .result = diloco_result,
    .free = diloco_free,
};
