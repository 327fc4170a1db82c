/* The outer optimizer's state and update (sync.h, "Outer optimizers"),
 * shared by DiLoCo (diloco.c) and NoLoCo (noloco.c). */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

/* The segments of the state kept with the model (train_config.extra), in
 * this order; "outer.round" holds the counters as floats of at most 24
 * bits each, so they are exact: [rounds mod 2^24, rounds / 2^24, a round
 * in flight (0 or 1), 1 once the state was set up]. */
enum { SEG_ANCHOR, SEG_MOMENTUM, SEG_ROUND, SEG_OPTIONAL };
enum { META_ROUNDS_LO, META_ROUNDS_HI, META_IN_FLIGHT, META_VALID, META_FLOATS };
#define META_UNIT 16777216.0 /* 2^24 */

static bool has_residual(const struct sync_config *c) {
  return c->kind == SYNC_ALLREDUCE && c->outer.compress.kind == CODEC_TOPK;
}

void sync_outer_extra(const struct sync_config *c, struct train_extra_spec *out) {
  memset(out, 0, sizeof *out);
  const struct train_extra_seg segs[] = {{"outer.anchor", 1, 0}, {"outer.momentum", 1, 0}, {"outer.round", 0, META_FLOATS}};
  for (size_t i = 0; i < sizeof segs / sizeof segs[0]; i++) out->seg[out->n++] = segs[i];
  if (has_residual(c)) out->seg[out->n++] = (struct train_extra_seg){"outer.residual", 1, 0};
  if (c->outer.overlap) out->seg[out->n++] = (struct train_extra_seg){"outer.prev", 1, 0};
}

void sync_outer_store(struct sync *s) {
  struct sync_outer *o = &s->outer;
  float meta[META_FLOATS] = {
      [META_ROUNDS_LO] = (float)fmod((double)o->rounds, META_UNIT),
      [META_ROUNDS_HI] = (float)floor((double)o->rounds / META_UNIT),
      [META_IN_FLIGHT] = o->in_flight ? 1.0f : 0.0f,
      [META_VALID] = 1.0f,
  };
  tensor_copy_from_host(&o->round_meta, 0, meta, sizeof meta);
}

/* The rounds in a counters segment; false when it was never set up (all
 * zero) or holds what sync_outer_store never writes (a state from a broken
 * or hostile member: its halves must be whole numbers below 2^24). */
static bool meta_rounds(const float *meta, uint64_t *rounds) {
  for (int i = META_ROUNDS_LO; i <= META_ROUNDS_HI; i++)
    if (!(meta[i] >= 0 && meta[i] < META_UNIT && meta[i] == floorf(meta[i]))) return false;
  if (meta[META_VALID] != 1.0f) return false;
  *rounds = (uint64_t)meta[META_ROUNDS_LO] + (uint64_t)meta[META_ROUNDS_HI] * (uint64_t)META_UNIT;
  return true;
}

/* Reads the counters; false when the state was never set up (all zero),
 * or its counters are not ones sync_outer_store writes. */
static bool load_meta(struct sync *s) {
  struct sync_outer *o = &s->outer;
  float meta[META_FLOATS];
  tensor_copy_to_host(&o->round_meta, 0, meta, sizeof meta);
  if (!meta_rounds(meta, &o->rounds)) return false;
  o->in_flight = meta[META_IN_FLIGHT] != 0.0f;
  return true;
}

/* A fresh outer state: the anchor is the parameters, no momentum, and the
 * rounds the step implies (a run resumed from a checkpoint without an
 * outer state goes on at the next boundary). */
static void start_fresh(struct sync *s) {
  struct sync_outer *o = &s->outer;
  struct tensor params = trainer_shard_params(s->t);
  tensor_copy(&o->anchor, &params);
  tensor_fill(&o->momentum, 0.0f);
  if (o->residual.data) tensor_fill(&o->residual, 0.0f);
  o->rounds = (uint64_t)(s->t->st.step / s->cfg.outer.local_steps);
  o->in_flight = false;
  sync_outer_store(s);
}

void sync_outer_reload(struct sync *s) {
  if (!load_meta(s)) start_fresh(s);
}

int sync_outer_init(struct sync *s, struct rumor_err *e) {
  struct sync_outer *o = &s->outer;
  struct trainer *t = s->t;
  RUMOR_ASSERT(t->cfg.extra.n >= SEG_OPTIONAL && s->cfg.outer.local_steps > 0);
  o->anchor = trainer_extra(t, SEG_ANCHOR);
  o->momentum = trainer_extra(t, SEG_MOMENTUM);
  o->round_meta = trainer_extra(t, SEG_ROUND);
  int next = SEG_OPTIONAL;
  if (has_residual(&s->cfg)) o->residual = trainer_extra(t, next++);
  if (s->cfg.outer.overlap) o->prev = trainer_extra(t, next++);
  int64_t P = trainer_shard_floats(t);
  int rc = tensor_alloc(&o->work, t->be, TENSOR_F32, 1, &P, e);
  if (rc) return rumor_err_prefix(e, "the outer optimizer's scratch");
  /* P + 1 floats (a dense contribution), or a top-k block, which is
   * shorter but for its header and a chunk's padding. */
  o->host = malloc(((size_t)P + 8) * sizeof(float));
  /* Top-k's encoder works on the host every round: its two vectors are
   * kept, not allocated each time (a GPT's would be mapped and faulted in
   * afresh every round). */
  bool topk = has_residual(&s->cfg);
  o->enc = topk ? malloc(2 * (size_t)P * sizeof(float)) : NULL;
  if (!o->host || (topk && !o->enc)) {
    tensor_free(&o->work);
    free(o->host);
    free(o->enc);
    o->host = o->enc = NULL;
    return rumor_err_set(e, -ENOMEM, "cannot allocate %.1f MiB for the outer optimizer",
                         (double)P * (topk ? 12 : 4) / (1 << 20));
  }
  o->last_norm = NAN;
  sync_outer_reload(s);
  char comp[CODEC_TEXT_MAX];
  codec_format(&s->cfg.outer.compress, comp, sizeof comp);
  log_info("outer %s every %lld steps (lr %g, momentum %g, compress %s%s): %llu rounds done",
           outer_kind_name(s->cfg.outer.kind), (long long)s->cfg.outer.local_steps, s->cfg.outer.lr,
           s->cfg.outer.momentum, comp, s->cfg.outer.overlap ? ", overlapped" : "", (unsigned long long)o->rounds);
  return 0;
}

void sync_outer_free(struct sync *s) {
  tensor_free(&s->outer.work);
  free(s->outer.host);
  free(s->outer.enc);
  s->outer.host = s->outer.enc = NULL;
}

int64_t sync_outer_landing_steps(const struct outer_config *c) {
  return c->overlap_steps > 0 ? c->overlap_steps : c->local_steps;
}

bool sync_outer_land_due(const struct sync *s) {
  const struct sync_outer *o = &s->outer;
  const struct outer_config *c = &s->cfg.outer;
  if (!o->in_flight || sync_outer_landing_steps(c) >= c->local_steps) return false;
  /* Round `rounds` (counted from 0) started at the boundary of step
   * (rounds + 1)·H. */
  int64_t started = ((int64_t)o->rounds + 1) * c->local_steps;
  return s->t->st.step >= started + sync_outer_landing_steps(c);
}

bool sync_outer_due(const struct sync *s) {
  if (s->outer.join_flight) return true;
  int64_t step = s->t->st.step, H = s->cfg.outer.local_steps;
  if (step <= 0) return false;
  bool boundary = step % H == 0 || trainer_done(s->t);
  uint64_t target = (uint64_t)((step + H - 1) / H); /* rounds that end at or before this step */
  return boundary && target > s->outer.rounds + (s->outer.in_flight ? 1 : 0);
}

bool sync_outer_take(struct sync *s, const float *state, uint64_t step, uint64_t min_round, char *why, size_t n) {
  struct sync_outer *o = &s->outer;
  struct trainer *t = s->t;
  int64_t P = trainer_shard_floats(t), at = trainer_state_extra_at(t, SEG_ANCHOR);
  int64_t mom = trainer_state_extra_at(t, SEG_MOMENTUM), meta_at = trainer_state_extra_at(t, SEG_ROUND);
  /* The anchor, the momentum and the counters are consecutive segments. */
  RUMOR_ASSERT(mom == at + P && meta_at == mom + P);
  for (int64_t i = at; i < meta_at + META_FLOATS; i++)
    if (!isfinite(state[i])) {
      snprintf(why, n, "its outer state's value %lld of %lld is not finite", (long long)(i - at),
               (long long)(2 * P + META_FLOATS));
      return false;
    }
  const float *meta = state + meta_at;
  uint64_t rounds = 0;
  /* With --outer-overlap its round `rounds` may be in flight (its donor
   * waits for it to land, and for us in it). */
  bool flight = meta[META_IN_FLIGHT] == 1.0f && s->cfg.outer.overlap;
  if (!meta_rounds(meta, &rounds) || rounds < min_round || !(meta[META_IN_FLIGHT] == 0.0f || flight)) {
    snprintf(why, n, "its outer state is not one after %llu rounds with none in flight%s (rounds %g + %g x 2^24, in "
             "flight %g, valid %g)", (unsigned long long)min_round, s->cfg.outer.overlap ? " or one" : "",
             (double)meta[META_ROUNDS_LO], (double)meta[META_ROUNDS_HI], (double)meta[META_IN_FLIGHT],
             (double)meta[META_VALID]);
    return false;
  }
  /* Its step goes with its rounds: a round ends every H steps (and at a
   * run's last step, which may come before a multiple of H); one in flight
   * started at the last boundary and lands by the next. */
  uint64_t H = (uint64_t)s->cfg.outer.local_steps;
  if (step > (rounds + 1 + flight) * H || step + H < rounds * H) {
    snprintf(why, n, "its step %llu does not go with its %llu rounds of %llu steps", (unsigned long long)step,
             (unsigned long long)rounds, (unsigned long long)H);
    return false;
  }
  tensor_copy_from_host(&o->anchor, 0, state + at, (size_t)P * sizeof(float));
  tensor_copy_from_host(&o->momentum, 0, state + mom, (size_t)P * sizeof(float));
  struct tensor params = trainer_shard_params(t);
  tensor_copy(&params, &o->anchor);
  o->rounds = rounds;
  o->in_flight = false;
  o->join_flight = flight;
  s->changes++;
  sync_outer_store(s);
  return true;
}

void sync_outer_pseudo_gradient(struct sync *s) {
  struct sync_outer *o = &s->outer;
  struct tensor params = trainer_shard_params(s->t);
  tensor_copy(&o->work, &o->anchor);
  tensor_axpby(-1.0f, &params, 1.0f, &o->work);
}

/* A progress line for the round just applied, and with --eval-every at
 * this step an evaluation of the parameters after it (the trainer's own of
 * this step came before the round: a DiLoCo member's model is the one
 * after). Whole replicas only (a stage or a shard evaluates with its group). */
static void after_round(struct sync *s) {
  struct sync_outer *o = &s->outer;
  struct trainer *t = s->t;
  log_info("outer round %llu at step %lld: pseudo-gradient norm %.4g, %.2f MB sent and received, %.2f s waited in all%s",
           (unsigned long long)o->rounds, (long long)t->st.step, o->last_norm, o->last_bytes / 1e6, o->wait_s,
           o->alone_last ? " (no partner: our own)" : "");
  if (trainer_holds_part(t) || t->cfg.eval_every <= 0 || t->st.step % t->cfg.eval_every != 0) return;
  struct rumor_err e = {0};
  if (trainer_evaluate(t, &e)) {
    log_warn("evaluation after outer round %llu: %s", (unsigned long long)o->rounds, e.msg);
    return;
  }
  if (t->data.tokens)
    log_info("step %lld: val loss %.4f after outer round %llu (evaluated in %.3f s)", (long long)t->st.step,
             t->test_loss, (unsigned long long)o->rounds, t->eval_seconds);
  else
    log_info("step %lld: test accuracy %.4f, test loss %.4f after outer round %llu (evaluated in %.3f s)",
             (long long)t->st.step, t->accuracy, t->test_loss, (unsigned long long)o->rounds, t->eval_seconds);
}

void sync_outer_step(struct sync *s) {
  struct sync_outer *o = &s->outer;
  const struct outer_config *c = &s->cfg.outer;
  float lr = (float)c->lr, mu = (float)c->momentum;
  o->last_norm = sqrt(tensor_sq_norm(&o->work));
  if (o->residual.data) {
    /* Top-k (SparseLoCo): the error-feedback accumulator carried the
     * momentum; the step is plain. */
    tensor_axpby(-lr, &o->work, 1.0f, &o->anchor);
  } else if (c->kind == OUTER_NESTEROV) {
    tensor_axpby(1.0f, &o->work, mu, &o->momentum); /* b ← μ·b + g */
    tensor_axpby(-lr, &o->work, 1.0f, &o->anchor);
    tensor_axpby(-lr * mu, &o->momentum, 1.0f, &o->anchor);
  } else {
    tensor_axpby(1.0f, &o->work, mu, &o->momentum);
    tensor_axpby(-lr, &o->momentum, 1.0f, &o->anchor);
  }
  struct tensor params = trainer_shard_params(s->t);
  if (o->prev.data && o->in_flight) {
    /* Delayed: keep the inner progress made since the round's boundary. */
    tensor_axpby(-1.0f, &o->prev, 1.0f, &params);
    tensor_axpby(1.0f, &o->anchor, 1.0f, &params);
    o->in_flight = false;
  } else {
    tensor_copy(&params, &o->anchor);
  }
  o->rounds++;
  s->changes++;
  sync_outer_store(s);
  after_round(s);
}

void sync_outer_plan(const struct sync_config *c, const char *scheme, struct sync_gossip_plan *out) {
  const struct outer_config *o = &c->outer;
  memset(out, 0, sizeof *out);
  out->wire = o->compress.kind == CODEC_F16 ? NET_DTYPE_F16 : o->compress.kind == CODEC_I8 ? NET_DTYPE_I8 : c->wire;
  char comp[CODEC_TEXT_MAX];
  codec_format(&o->compress, comp, sizeof comp);
  /* Members must share every setting that decides their rounds. */
  char overlap[40] = "";
  if (o->overlap) snprintf(overlap, sizeof overlap, " overlap=%lld", (long long)sync_outer_landing_steps(o));
  snprintf(out->label, sizeof out->label, " sync=%s outer=%s H=%lld lr=%g mu=%g compress=%s%s", scheme,
           outer_kind_name(o->kind), (long long)o->local_steps, o->lr, o->momentum, comp, overlap);
}

void sync_outer_result(const struct sync *s, json_t *o) {
  const struct sync_outer *so = &s->outer;
  const struct outer_config *c = &s->cfg.outer;
  char comp[CODEC_TEXT_MAX];
  codec_format(&c->compress, comp, sizeof comp);
  json_text_set(o, "outer", json_string(outer_kind_name(c->kind)));
  json_text_set(o, "local_steps", json_integer(c->local_steps));
  json_text_set(o, "outer_compress", json_string(comp));
  json_text_set(o, "outer_overlap", json_boolean(c->overlap));
  if (c->overlap) json_text_set(o, "outer_overlap_steps", json_integer(sync_outer_landing_steps(c)));
  json_text_set(o, "outer_rounds", json_integer((json_int_t)so->rounds));
  json_text_set(o, "outer_norm", json_text_real(so->last_norm));
  json_text_set(o, "outer_bytes_round", json_text_real(so->last_bytes));
  json_text_set(o, "outer_wait_s", json_text_real(so->wait_s));
}
