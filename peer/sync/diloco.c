/* `--sync allreduce --outer K`: DiLoCo (sync.h, "Outer optimizers"). Every
 * H steps the members average their pseudo-gradients over the ring (an
 * all-gather of top-k encodings with --outer-compress topk) and apply the
 * same outer step to the same anchor. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

static bool topk(const struct sync *s) { return s->cfg.outer.compress.kind == CODEC_TOPK; }

/* An all-gather block: a version word (DILOCO_BLOCK_V1) and the encoding,
 * in words. */
#define DILOCO_BLOCK_V1 1.0f
static uint64_t block_words(const struct sync_config *c, int64_t P) {
  return 1 + (codec_bytes(&c->outer.compress, (uint64_t)P) + 3) / 4;
}

/* The round's contribution, made once per round (error feedback must see
 * each round once however often the ring retries): dense, the
 * pseudo-gradient and a 1 that counts the members (outer.host, P + 1
 * floats); top-k, the block in outer.host. Every member weighs the same:
 * members run the same steps on the same batch, and a newcomer's first
 * round counts the donor's progress again, which does no harm. `work`
 * holds the pseudo-gradient. */
static void encode(struct sync *s) {
  struct sync_outer *o = &s->outer;
  int64_t P = trainer_shard_floats(s->t);
  float *h = o->host;
  if (!topk(s)) {
    tensor_copy_to_host(&o->work, 0, h, (size_t)P * sizeof(float));
    h[P] = 1.0f;
    return;
  }
  /* Top-k with error feedback: the residual is host-side for the encoder
   * and goes back to the device state after. */
  float *x = o->enc, *r = o->enc + P; /* sync_outer_init's */
  tensor_copy_to_host(&o->work, 0, x, (size_t)P * sizeof(float));
  tensor_copy_to_host(&o->residual, 0, r, (size_t)P * sizeof(float));
  /* SparseLoCo: the accumulator decays by the outer momentum, e ← μ·e + Δ,
   * and stands for it (sync_outer_step then has none). */
  float mu = (float)s->cfg.outer.momentum;
  for (int64_t i = 0; i < P; i++) r[i] *= mu;
  uint64_t words = block_words(&s->cfg, P);
  RUMOR_ASSERT(words <= (uint64_t)P + 8); /* outer.host's size (outer.c) */
  memset(h, 0, (size_t)words * sizeof(float));
  h[0] = DILOCO_BLOCK_V1;
  codec_encode(&s->cfg.outer.compress, x, r, (uint64_t)P, (uint8_t *)(h + 1));
  tensor_copy_from_host(&o->residual, 0, r, (size_t)P * sizeof(float));
}

static void fill(struct sync *s, void *arg) {
  (void)arg;
  int64_t P = trainer_shard_floats(s->t);
  if (topk(s)) memcpy(gossip_ag_buf(s->g), s->outer.host, (size_t)block_words(&s->cfg, P) * sizeof(float));
  else memcpy(gossip_ar_buf(s->g), s->outer.host, ((size_t)P + 1) * sizeof(float));
}

/* The gathered blocks: their mean into outer.work. A block that does not
 * decode (a broken or hostile member) is left out, by every member alike,
 * since every member holds the same blocks. False when none is left. */
static bool take_blocks(struct sync *s) {
  int64_t P = trainer_shard_floats(s->t);
  size_t n, self;
  const float *b = gossip_ag_result(s->g, &n, &self);
  uint64_t words = block_words(&s->cfg, P), len = codec_bytes(&s->cfg.outer.compress, (uint64_t)P);
  float *acc = s->outer.host;
  memset(acc, 0, (size_t)P * sizeof(float));
  size_t good = 0;
  for (size_t i = 0; b && i < n; i++) {
    /* A refused block adds nothing (codec_decode_add validates first). */
    struct rumor_err e = {0};
    int rc = b[i * words] != DILOCO_BLOCK_V1
                 ? rumor_err_set(&e, RUMOR_ECORRUPT, "its block's version word is %g", (double)b[i * words])
                 : codec_decode_add(&s->cfg.outer.compress, (const uint8_t *)(b + i * words + 1), len, (uint64_t)P,
                                    1.0f, acc, &e);
    if (rc) log_warn("DiLoCo: the block of member %zu of the ring is left out: %s", i, e.msg);
    else good++;
  }
  if (!good) return false;
  tensor_copy_from_host(&s->outer.work, 0, acc, (size_t)P * sizeof(float));
  tensor_scale(&s->outer.work, (float)(1.0 / (double)good));
  return true;
}

static bool take_result(struct sync *s) { return topk(s) ? take_blocks(s) : sync_ring_mean(s, &s->outer.work); }

/* The payload bytes this member sent and received in a round over a ring
 * of n: a ring all-reduce sends and receives 2(n − 1)/n of the vector in
 * the ring's encoding, an all-gather (n − 1) blocks each way. */
static double round_bytes(const struct sync *s, size_t n) {
  int64_t P = trainer_shard_floats(s->t);
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
  struct tensor params = trainer_shard_params(s->t);
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

/* One whole round now: work = this member's pseudo-gradient. Returns 0
 * (applied), 1 (left behind: a state was taken), or a negative code. */
static int round_now(struct sync *s, struct rumor_err *e) {
  encode(s);
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
  return round_now(s, e);
}

/* --outer-overlap: starts round `rounds` on this boundary's pseudo-gradient
 * and goes back to training. */
static void launch(struct sync *s) {
  struct sync_outer *o = &s->outer;
  struct tensor params = trainer_shard_params(s->t);
  sync_outer_pseudo_gradient(s);
  tensor_copy(&o->prev, &params);
  o->in_flight = true;
  s->donate_state_ok = false; /* a state now would lack the round in flight's update */
  sync_outer_store(s);
  encode(s);
  fill(s, NULL);
  uint64_t id = o->rounds;
  int rc = topk(s) ? gossip_ag_start(s->g, id) : gossip_ar_start(s->g, id);
  if (rc) log_warn("DiLoCo: cannot start round %llu (the runtime is stopping)", (unsigned long long)id);
}

/* Advised to sit out (our link loses packets): away for a while, then a
 * member's state when the ring went on meanwhile (sync_ring_sit_out).
 * Returns its result, the state reloaded when one was taken. */
static int sit_out(struct sync *s, struct rumor_err *e) {
  int rc = sync_ring_sit_out(s, s->outer.rounds, catch_up_step(s), e);
  if (rc == 1) {
    sync_outer_reload(s);
    s->donate_state_ok = !s->outer.in_flight;
  }
  return rc;
}

/* A round ends here: the one in flight lands (overlapping), a state may be
 * donated, and the next starts (overlapping) or runs now. A member left
 * behind takes a state from one ahead: when that state is at a round
 * boundary still due (its donor was in the round), the round runs again
 * with the state taken. */
static int rounds_at_boundary(struct sync *s, struct rumor_err *e) {
  struct sync_outer *o = &s->outer;
  if (sync_outer_land_due(s)) {
    /* --outer-overlap-steps: the round in flight lands τ steps into the
     * next; the next starts at its boundary as usual. */
    int rc = land_flight(s, e);
    if (rc < 0) return rc;
    if (rc == 1) sync_outer_reload(s);
    s->donate_state_ok = !o->in_flight;
  }
  /* Each pass applies a round or takes a state past the round we were at
   * (a donor that completed it): the rounds done only grow. */
  while (sync_outer_due(s)) {
    int rc = o->in_flight ? land_flight(s, e) : 0;
    if (rc < 0) return rc;
    if (rc == 1) {
      sync_outer_reload(s); /* a state taken from a member ahead */
      continue;
    }
    /* Nothing in flight: a full state may be donated (now, before the next
     * round starts, if a newcomer waits). */
    s->donate_state_ok = true;
    sync_idle(s);
    /* Advised to sit out (our link loses packets): away for a while, then a
     * member's state when the ring went on meanwhile. */
    rc = sit_out(s, e);
    if (rc < 0) return rc;
    if (rc == 1) continue;
    /* An outer state taken from a member whose round was in flight: that
     * member waits for us in the round, which runs now (our pseudo-gradient
     * is nothing: the parameters are the anchor), so that we land it where
     * the member does and go on in step with it. */
    bool join = o->join_flight;
    o->join_flight = false;
    if (s->cfg.outer.overlap && !trainer_done(s->t) && !join) {
      launch(s);
      return 0;
    }
    sync_outer_pseudo_gradient(s);
    rc = round_now(s, e);
    if (rc < 0) return rc;
    if (rc == 1) sync_outer_reload(s);
    /* Advice taken as the round ends, while its figures are fresh. */
    if (rc == 0 && (rc = sit_out(s, e)) < 0) return rc;
  }
  return 0;
}

/* Whether this step may run or land a round, by the step alone (so every
 * process of a pipelined group, all at one step, says the same): a
 * boundary, the run's last step, or --outer-overlap-steps' landing. */
static bool round_step(const struct sync *s) {
  int64_t step = s->t->st.step, H = s->cfg.outer.local_steps, tau = sync_outer_landing_steps(&s->cfg.outer);
  if (step <= 0) return false;
  return step % H == 0 || trainer_done(s->t) || (s->cfg.outer.overlap && tau < H && step % H == tau);
}

/* The boundary's rounds; in a pipelined group every process then goes on
 * from the latest step any took from its ring (each catch-up takes its
 * donor's, and donors serve steps apart while a round is in flight), or
 * its stages would run different steps and wait for each other's
 * transfers for ever. */
static int diloco_boundary(struct sync *s, struct rumor_err *e) {
  bool agree = round_step(s);
  int rc = rounds_at_boundary(s, e);
  if (rc == 0 && agree) rc = trainer_stages_agree_step(s->t, sync_idle, s, e);
  return rc;
}

static void diloco_plan(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out) {
  sync_outer_plan(c, "diloco", out);
  out->protocol = GOSSIP_SYNC_ALLREDUCE;
  out->buf_floats = (uint64_t)nparams + 1;
  out->gather_floats = c->outer.compress.kind == CODEC_TOPK ? block_words(c, nparams) : 0;
}

static int diloco_init(struct sync *s, struct rumor_err *e) {
  int rc = sync_outer_init(s, e);
  if (rc) return rc;
  /* Behind the ring (restarted, or it went on while we pulled): a member's
   * state before we are ready (sync_ring_rejoin). */
  rc = s->cfg.own_start ? 0 : sync_ring_rejoin(s, s->outer.rounds, catch_up_step(s), "starting", e);
  if (rc < 0) {
    sync_outer_free(s);
    return rc;
  }
  if (rc == 1) sync_outer_reload(s);
  s->donate_state_ok = !s->outer.in_flight;
  /* Between groups: a member left behind takes a donor's step (allreduce.c,
   * outer_state_only); its group follows. */
  if (trainer_in_group_comm(s->t)) trainer_group_agree_steps(s->t);
  return 0;
}

static void diloco_free(struct sync *s) { sync_outer_free(s); }

static void diloco_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  sync_scheme_allreduce.result(s, gs, o);
  sync_outer_result(s, o);
}

const struct sync_scheme sync_scheme_diloco = {
    .name = "diloco",
    .extra = sync_outer_extra, /* a run ends with the last step's round: no finish */
    .plan = diloco_plan,
    .init = diloco_init,
    .boundary = diloco_boundary,
    .result = diloco_result,
    .free = diloco_free,
};
