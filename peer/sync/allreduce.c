/* Ring rounds on the training thread: `--sync allreduce`'s gradient
 * reducer, and the round driver it shares with DiLoCo (sync_ring_round:
 * retries, and the catch-up of a member left behind). */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

/* A data- or tensor-parallel group member (DiLoCo between groups) takes
 * only the round's outer state (sync_outer_take), which every member of
 * the ring holds alike after the round, and the donor's step: its
 * parameters and inner optimizer state are one piece of the group's, whose
 * other members' rings may not have left them behind; the group then goes
 * on from the largest step any member took (trainer_group_agree_steps,
 * diloco_init). */
static bool outer_state_only(const struct sync *s) {
  return trainer_in_group_comm(s->t) && s->cfg.outer.kind != OUTER_NONE;
}

/* How a ring scheme's lines name it. */
static const char *ring_label(const struct sync *s) {
  return s->cfg.outer.kind != OUTER_NONE ? "DiLoCo" : "all-reduce";
}

/* Whether the state pulled (at *pos) is taken: a group member's outer
 * state after round min_round − 1, or a whole state at min_step or later
 * that passes the pull policy. */
static bool take_pulled(struct sync *s, struct sync_own_state *own, float *buf,
                        const struct gossip_train_pos *pos, uint64_t min_round, uint64_t min_step, char *why,
                        size_t n) {
  if (outer_state_only(s)) return sync_outer_take(s, buf, pos->step, min_round, why, n);
  if (pos->step < min_step) { /* asked for a later one: a donor that ignores it misbehaves */
    snprintf(why, n, "it is at step %llu, before step %llu", (unsigned long long)pos->step,
             (unsigned long long)min_step);
    return false;
  }
  return sync_pull_take(s->t, own, buf, why, n);
}

/* Pulls states, from `from` first (NULL: any member), until one is taken
 * (take_pulled; *pos its position): 1, 0 when nobody is left to take one
 * from (a member that is before min_round says so; `optional`: or none
 * gives one soon, gossip_state_pull's GOSSIP_PULL_OPTIONAL_MS), or a
 * negative code (stopped, or every state asked for was refused). */
static int pull_state(struct sync *s, const uint8_t *from, uint64_t min_round, uint64_t min_step, bool optional,
                      struct gossip_train_pos *pos, struct rumor_err *e) {
  /* The pull lands in the donation buffer: a donation filled from it while
   * we waited in the ring may still be on its way out; wait for it to end
   * (no new one is filled until we serve donations again). */
  while (gossip_donor_sending(s->g)) {
    if (sync_stopped(s)) return rumor_err_set(e, RUMOR_ECANCELED, "stopped while catching up");
    const struct timespec tick = {0, 2 * 1000000};
    nanosleep(&tick, NULL);
  }
  float *buf = gossip_donor_buf(s->g);
  struct sync_own_state own;
  sync_own_keep(&own, s->t);
  char why[200];
  for (int asked = 1;; asked++) {
    int rc = optional ? gossip_state_pull_ahead(s->g, min_round, buf, pos, s->cfg.stop, e)
                      : gossip_state_pull(s->g, asked == 1 ? from : NULL, min_round, buf, pos, s->cfg.stop, e);
    if (rc) return rc < 0 ? rc : 0; /* 1: nobody left to take it from, go on with ours */
    if (take_pulled(s, &own, buf, pos, min_round, min_step, why, sizeof why)) break;
    log_warn("%s: refused the state pulled at step %llu: %s (a broken or hostile member)", ring_label(s),
             (unsigned long long)pos->step, why);
    gossip_refuse_donation(s->g, "it gave a state we refused");
    if (asked == SYNC_PULL_ASKS)
      return rumor_err_set(e, RUMOR_ECORRUPT,
                           "%s: behind the ring at step %lld, and the %d states pulled to catch up were refused "
                           "(the last: %s)",
                           ring_label(s), (long long)s->t->st.step, SYNC_PULL_ASKS, why);
  }
  s->ring.catchups++;
  return 1;
}

/* Left behind: takes the state of a member that completed our round (asked
 * first), or of another when that one's state is refused (sync_pull_take);
 * after SYNC_PULL_ASKS refusals the member gives up (it cannot rejoin the
 * round without one). A group member takes the outer state and the step
 * only (outer_state_only). Returns 1 when taken, 0 when nobody is left
 * to take it from (we go on with ours), or a negative code (stopped, or
 * every state asked for was refused). `info` NULL: a group process asked
 * to take its shard again at min_step or later (ar_catch_up), from any
 * member of the ring. */
static int catch_up(struct sync *s, const struct gossip_ar_info *info, uint64_t min_round, uint64_t min_step,
                    struct rumor_err *e) {
  struct trainer *t = s->t;
  char ahead[NET_PUBKEY_STR_LEN + 1] = "any";
  if (info) net_pubkey_format(ahead, info->ahead);
  if (!info)
    log_info("all-reduce: our group goes on from step %llu and our shard is of step %lld: taking it again from the "
             "ring", (unsigned long long)min_step, (long long)t->st.step);
  else if (s->cfg.outer.kind != OUTER_NONE)
    log_info("all-reduce: the cluster completed round %llu and we are at round %llu (step %lld): taking the %sstate "
             "of %.8s",
             (unsigned long long)info->ahead_step, (unsigned long long)info->step, (long long)t->st.step,
             outer_state_only(s) ? "outer " : "", ahead);
  else
    log_info("all-reduce: the cluster is at step %llu and we at %lld: taking the state of %.8s",
             (unsigned long long)info->ahead_step, (long long)t->st.step, ahead);
  int64_t step = t->st.step;
  struct gossip_train_pos pos;
  int rc = pull_state(s, info ? info->ahead : NULL, min_round, min_step, false, &pos, e);
  if (rc != 1) return rc;
  if (outer_state_only(s)) {
    log_info("all-reduce: took the outer state after outer round %llu from a member at step %llu (we were at step "
             "%lld); our round is dropped",
             (unsigned long long)s->outer.rounds, (unsigned long long)pos.step, (long long)step);
    if ((int64_t)pos.step > step) trainer_take_step(t, (int64_t)pos.step);
    return 1;
  }
  trainer_take_step(t, (int64_t)pos.step);
  log_info("all-reduce: now at step %llu; our round is dropped", (unsigned long long)pos.step);
  return 1;
}

int sync_ring_rejoin(struct sync *s, uint64_t round, uint64_t min_step, const char *when, struct rumor_err *e) {
  struct trainer *t = s->t;
  /* Outer rounds only: a gradient ring runs a round every step and moves
   * on while we pull, so we would be behind again once ready and catch up
   * in the ring all the same, having cost a donor a second donation. */
  if (!s->g || s->cfg.outer.kind == OUTER_NONE || trainer_holds_part(t) || trainer_done(t)) return 0;
  int64_t step = t->st.step;
  struct gossip_train_pos pos;
  int rc = pull_state(s, NULL, round + 1, min_step, true, &pos, e);
  if (rc != 1) return rc;
  trainer_take_step(t, (int64_t)pos.step);
  log_info("DiLoCo: %s: the ring went on past outer round %llu; took a member's state at step %llu (we were at step "
           "%lld) before joining it",
           when, (unsigned long long)round, (unsigned long long)pos.step, (long long)step);
  return 1;
}

int sync_ring_round(struct sync *s, enum sync_round_kind kind, uint64_t id, sync_fill_fn fill, void *arg,
                    uint64_t min_step, struct rumor_err *e) {
  double t0 = clock_now_s();
  for (unsigned attempt = 0;; attempt++) {
    if (sync_stopped(s))
      return rumor_err_set(e, RUMOR_ECANCELED, "stopped during the all-reduce of round %llu", (unsigned long long)id);
    fill(s, arg); /* again on every attempt: a failed round leaves partial sums */
    int rc = kind == SYNC_ROUND_GATHER ? gossip_ag_start(s->g, id) : gossip_ar_start(s->g, id);
    if (rc) return rumor_err_set(e, rc, "the gossip runtime stopped during an all-reduce");
    enum gossip_ar_status st;
    while ((st = gossip_ar_wait(s->g, 5)) == GOSSIP_AR_RUNNING) sync_idle(s);
    struct gossip_ar_info info;
    gossip_ar_info(s->g, &info);
    if (st == GOSSIP_AR_DONE) {
      s->ring.rounds++;
      s->ring.members = info.members;
      s->ring.wait_s += clock_now_s() - t0;
      return 0;
    }
    if (st == GOSSIP_AR_BEHIND) {
      rc = catch_up(s, &info, id + 1, min_step, e);
      if (rc) {
        s->ring.wait_s += clock_now_s() - t0;
        return rc;
      }
      gossip_ar_forget_ahead(s->g); /* nobody left who is ahead: go on with ours */
    }
    /* Failed (a member failed, joined or left; views differ): try again
     * once the membership has had time to settle, backing off a little. */
    s->ring.retries++;
    sync_idle_for(s, 0.01 * (attempt < 10 ? attempt + 1 : 10));
  }
}

/* ---- --sync allreduce: every step's gradient ---- */

/* Our contribution: the gradient times our rows, and the rows. */
static void fill_gradient(struct sync *s, void *arg) {
  struct trainer *t = s->t;
  int64_t P = trainer_shard_floats(t), rows = *(const int64_t *)arg;
  float *buf = gossip_ar_buf(s->g);
  tensor_copy_to_host(&t->model.grads, t->shard_lo, buf, (size_t)P * sizeof(float));
  float w = (float)rows;
  for (int64_t i = 0; i < P; i++) buf[i] *= w;
  buf[P] = w;
}

bool sync_ring_mean(struct sync *s, struct tensor *dst) {
  int64_t P = trainer_shard_floats(s->t);
  const float *sum = gossip_ar_result(s->g);
  double weight = sum[P];
  bool finite = isfinite(weight) && weight >= 1;
  for (int64_t i = 0; finite && i < P; i++) finite = isfinite(sum[i]);
  if (!finite) return false;
  tensor_copy_from_host(dst, 0, sum, (size_t)P * sizeof(float));
  tensor_scale(dst, (float)(1.0 / weight));
  return true;
}

/* The sum arrived: the mean gradient into model.grads. Returns 0, or 1 when
 * it is not finite (every member sees the same sum and drops the step).
 * After SYNC_NONFINITE_MAX such sums in a row the run has diverged (huge
 * but finite parameters whose gradients overflow; each member's own loss
 * may still be finite): every member, seeing the same sums, stops at the
 * same step with RUMOR_EDIVERGED rather than drop every step to the end. */
static int take_sum(struct sync *s, struct rumor_err *e) {
  struct trainer *t = s->t;
  struct tensor grads = trainer_shard_grads(t);
  if (sync_ring_mean(s, &grads)) {
    s->ring.nonfinite_run = 0;
    return 0;
  }
  long long step = (long long)t->st.step;
  if (++s->ring.nonfinite_run >= SYNC_NONFINITE_MAX)
    return rumor_err_set(e, RUMOR_EDIVERGED,
                         "training diverged: the ring's summed gradient was not finite at steps %lld to %lld; stopped "
                         "before saving the parameters: lower --lr or add --grad-clip",
                         step - SYNC_NONFINITE_MAX + 1, step);
  log_warn("the summed gradient of step %lld is not finite (or counts %g rows): step dropped on every member", step,
           (double)gossip_ar_result(s->g)[trainer_shard_floats(t)]);
  s->ring.skipped++;
  trainer_take_step(t, t->st.step + 1);
  return 1;
}

int sync_ring_sit_out(struct sync *s, uint64_t round, uint64_t min_step, struct rumor_err *e) {
  struct sync_ring *ring = &s->ring;
  char why[200];
  /* A process that holds part of a replica would stall its group: it stays
   * (the advice is taken all the same). So does one at its last step. */
  if (!s->g || !gossip_ar_sit_out(s->g, why, sizeof why) || trainer_holds_part(s->t) || trainer_done(s->t)) return 0;
  double now = clock_now_s();
  if (ring->next_out_s <= 0 || now - ring->back_s > SYNC_SIT_OUT_CALM_S) ring->next_out_s = SYNC_SIT_OUT_S;
  double secs = ring->next_out_s;
  log_warn("%s: %s: leaving the ring for %.0f s, so that it goes on at the others' pace", ring_label(s), why, secs);
  gossip_ring_away(s->g, true);
  sync_idle_for(s, secs);
  /* Leaving: not back in the ring first. */
  if (sync_stopped(s)) return rumor_err_set(e, RUMOR_ECANCELED, "stopped while out of the %s ring", ring_label(s));
  int rc = sync_ring_rejoin(s, round, min_step, "back from sitting out", e);
  if (rc < 0) return rc;
  gossip_ring_away(s->g, false);
  ring->back_s = clock_now_s();
  ring->out_s += ring->back_s - now;
  ring->sat_out++;
  ring->next_out_s = secs * 2 < SYNC_SIT_OUT_MAX_S ? secs * 2 : SYNC_SIT_OUT_MAX_S;
  log_info("%s: back in the ring after %.1f s out", ring_label(s), ring->back_s - now);
  return rc;
}

/* The train_reducer: sums the step's gradient, weighted by rows, over the
 * ring and leaves the mean over every member's rows in model.grads (returns
 * 0). A member left behind takes the state of one ahead and drops its step
 * (returns 1); a sum that is not finite is dropped on every member alike
 * (returns 1, the step counted). A replica's shard: a stage's slice, or a
 * group process's shard (its ZeRO piece, its tensor-parallel slices), with
 * the same shard of other groups (group_reduce_between). */
static int ar_reduce(void *arg, int64_t rows, struct rumor_err *e) {
  struct sync *s = arg;
  uint64_t step = (uint64_t)s->t->st.step;
  int rc = sync_ring_sit_out(s, step, step + 1, e); /* a gradient ring's member comes back with its own state */
  if (rc == 0) rc = sync_ring_round(s, SYNC_ROUND_REDUCE, step, fill_gradient, &rows, step + 1, e);
  return rc ? rc : take_sum(s, e);
}

/* The train_reducer's catch_up: this group process's shard again, from the
 * ring, at `step` or later (0), or nobody left to give one (1). */
static int ar_catch_up(void *arg, int64_t step, struct rumor_err *e) {
  int rc = catch_up(arg, NULL, (uint64_t)step, (uint64_t)step, e);
  return rc < 0 ? rc : rc == 1 ? 0 : 1;
}

/* Between groups: a process left behind takes a donor's shard and step
 * (catch_up); its group follows the largest step any process took. */
static int ar_init(struct sync *s, struct rumor_err *e) {
  (void)e;
  if (trainer_in_group_comm(s->t)) trainer_group_agree_steps(s->t);
  return 0;
}

static void ar_plan(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out) {
  /* The gradient and the rows it is the mean over. */
  *out = (struct sync_gossip_plan){.protocol = GOSSIP_SYNC_ALLREDUCE, .buf_floats = (uint64_t)nparams + 1,
                                   .wire = c->wire};
  snprintf(out->label, sizeof out->label, " sync=allreduce");
}

static void ar_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  (void)gs;
  const struct {
    const char *key;
    uint64_t v;
  } ar[] = {{"allreduce_rounds", s->ring.rounds},     {"allreduce_retries", s->ring.retries},
            {"allreduce_catchups", s->ring.catchups}, {"allreduce_skipped", s->ring.skipped},
            {"allreduce_members", s->ring.members},   {"allreduce_sat_out", s->ring.sat_out}};
  for (size_t i = 0; i < sizeof ar / sizeof ar[0]; i++) json_text_set(o, ar[i].key, json_integer((json_int_t)ar[i].v));
  json_text_set(o, "allreduce_s", json_text_real(s->ring.wait_s));
  json_text_set(o, "allreduce_out_s", json_text_real(s->ring.out_s));
}

const struct sync_scheme sync_scheme_allreduce = {
    .name = "allreduce",
    .plan = ar_plan,
    .init = ar_init,
    .reduce = ar_reduce,
    .catch_up = ar_catch_up,
    .result = ar_result,
};
