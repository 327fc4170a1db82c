/* --sync allreduce: the training thread's side of the ring (gossip.h,
 * "all-reduce"), as a train_reducer. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync.h"

static bool stopped(const struct sync *s) { return s->cfg.stop && atomic_load(s->cfg.stop); }

/* Sleeps about `secs` while serving donations and figures. */
static void idle_for(struct sync *s, double secs) {
  double end = clock_now_s() + secs;
  while (clock_now_s() < end && !stopped(s)) {
    const struct timespec tick = {0, 2 * 1000000};
    nanosleep(&tick, NULL);
    sync_idle(s);
  }
}

/* Our contribution: the gradient times our rows, and the rows. */
static void fill_contribution(struct sync *s, int64_t rows) {
  struct trainer *t = s->t;
  int64_t P = t->model.nparams;
  float *buf = gossip_ar_buf(s->g);
  tensor_copy_to_host(&t->model.grads, 0, buf, (size_t)P * sizeof(float));
  float w = (float)rows;
  for (int64_t i = 0; i < P; i++) buf[i] *= w;
  buf[P] = w;
}

/* The sum arrived: the mean gradient into model.grads. Returns 0, or 1 when
 * it is not finite (every member sees the same sum and drops the step). */
static int take_sum(struct sync *s) {
  struct trainer *t = s->t;
  int64_t P = t->model.nparams;
  const float *sum = gossip_ar_result(s->g);
  double rows = sum[P];
  bool finite = isfinite(rows) && rows >= 1;
  for (int64_t i = 0; finite && i < P; i++) finite = isfinite(sum[i]);
  if (!finite) {
    log_warn("the summed gradient of step %lld is not finite (or counts %g rows): step dropped on every member",
             (long long)t->st.step, rows);
    s->ar_skipped++;
    trainer_take_step(t, t->st.step + 1);
    return 1;
  }
  tensor_copy_from_host(&t->model.grads, 0, sum, (size_t)P * sizeof(float));
  tensor_scale(&t->model.grads, (float)(1.0 / rows));
  return 0;
}

/* Loads `pulled` (state_floats floats) unless it fails the checks of
 * sync.h's sync_pull_max_loss, against our own current state: we were a
 * few steps behind with a trained state of our own. `own` (state_floats
 * floats, or NULL: a stage, which has no loss to compare, or no memory;
 * then only finiteness is checked, before loading) holds our state to go
 * back to. Returns true when taken; on false our state is back and *why
 * says what was wrong. */
static bool take_pulled(struct sync *s, const float *pulled, float *own, char *why, size_t whylen) {
  struct trainer *t = s->t;
  int64_t S = trainer_state_floats(t);
  for (int64_t i = 0; i < S; i++)
    if (!isfinite(pulled[i])) {
      snprintf(why, whylen, "value %lld of %lld is not finite", (long long)i, (long long)S);
      return false;
    }
  if (!own) {
    trainer_load_state(t, pulled);
    return true;
  }
  int64_t rows, targets = sync_check_targets(t->model.nparams);
  trainer_copy_state(t, own);
  double own_loss = trainer_check_loss(t, targets, &rows);
  trainer_load_state(t, pulled);
  double loss = trainer_check_loss(t, targets, &rows);
  double most = sync_pull_max_loss(own_loss);
  if (!isfinite(own_loss) || loss <= most) return true;
  snprintf(why, whylen, "its loss %.4g on %lld training %s is above %.4f, the most we take beside ours (%.4f)", loss,
           (long long)rows, trainer_row_noun(t), most, own_loss);
  trainer_load_state(t, own);
  return false;
}

/* Left behind: takes the state of a member that completed our step (asked
 * first), or of another when that one's state is refused; after
 * SYNC_PULL_ASKS refusals the member gives up (it cannot rejoin the round
 * without one). Returns 1 when taken, 0 when nobody is left to take it
 * from (we go on with ours), or a negative code (stopped, or every state
 * asked for was refused). */
static int catch_up(struct sync *s, const struct gossip_ar_info *info, struct rumor_err *e) {
  struct trainer *t = s->t;
  char ahead[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(ahead, info->ahead);
  log_info("all-reduce: the cluster is at step %llu and we at %lld: taking the state of %.8s",
           (unsigned long long)info->ahead_step, (long long)t->st.step, ahead);
  struct gossip_train_pos pos;
  /* The pull lands in the donation buffer: a donation filled from it while
   * we waited in the ring may still be on its way out; wait for it to end
   * (no new one is filled until we serve donations again). */
  while (gossip_donor_sending(s->g)) {
    if (stopped(s)) return rumor_err_set(e, RUMOR_ECANCELED, "stopped while catching up");
    const struct timespec tick = {0, 2 * 1000000};
    nanosleep(&tick, NULL);
  }
  float *buf = gossip_donor_buf(s->g);
  float *own = NULL;
  if (!trainer_is_stage(t) && !(own = malloc((size_t)trainer_state_floats(t) * sizeof(float))))
    log_warn("all-reduce: no memory to keep our state: a pulled state is checked for finite values only");
  int rc = 0;
  bool taken = false;
  char why[160];
  for (int asked = 1; !taken; asked++) {
    rc = gossip_state_pull(s->g, asked == 1 ? info->ahead : NULL, (uint64_t)t->st.step + 1, buf, &pos, s->cfg.stop, e);
    if (rc) break; /* 1: nobody left to take it from, go on with ours */
    if (pos.step <= (uint64_t)t->st.step) /* asked for a later one: a donor that ignores it misbehaves */
      snprintf(why, sizeof why, "it is no further than our step %lld", (long long)t->st.step);
    else
      taken = take_pulled(s, buf, own, why, sizeof why);
    if (taken) break;
    log_warn("all-reduce: refused the state pulled at step %llu: %s (a broken or hostile member)",
             (unsigned long long)pos.step, why);
    gossip_refuse_donation(s->g, "it gave a state we refused");
    if (asked == SYNC_PULL_ASKS) {
      rc = rumor_err_set(e, RUMOR_ECORRUPT,
                         "all-reduce: left behind at step %lld, and the %d states pulled to catch up were refused "
                         "(the last: %s)",
                         (long long)t->st.step, SYNC_PULL_ASKS, why);
      break;
    }
  }
  free(own);
  if (!taken) return rc < 0 ? rc : 0;
  trainer_take_step(t, (int64_t)pos.step);
  s->ar_catchups++;
  log_info("all-reduce: now at step %llu; our step's gradient is dropped", (unsigned long long)pos.step);
  return 1;
}

int sync_allreduce(void *arg, int64_t rows, struct rumor_err *e) {
  struct sync *s = arg;
  struct trainer *t = s->t;
  double t0 = clock_now_s();
  for (unsigned attempt = 0;; attempt++) {
    if (stopped(s)) return rumor_err_set(e, RUMOR_ECANCELED, "stopped during the all-reduce of step %lld",
                                         (long long)t->st.step);
    fill_contribution(s, rows); /* again on every attempt: a failed round leaves partial sums */
    int rc = gossip_ar_start(s->g, (uint64_t)t->st.step);
    if (rc) return rumor_err_set(e, rc, "the gossip runtime stopped during an all-reduce");
    enum gossip_ar_status st;
    while ((st = gossip_ar_wait(s->g, 5)) == GOSSIP_AR_RUNNING) sync_idle(s);
    struct gossip_ar_info info;
    gossip_ar_info(s->g, &info);
    if (st == GOSSIP_AR_DONE) {
      s->ar_rounds++;
      s->ar_members = info.members;
      s->ar_wait_s += clock_now_s() - t0;
      return take_sum(s);
    }
    if (st == GOSSIP_AR_BEHIND) {
      rc = catch_up(s, &info, e);
      if (rc) {
        s->ar_wait_s += clock_now_s() - t0;
        return rc;
      }
    }
    /* Failed (a member failed, joined or left; views differ): try again
     * once the membership has had time to settle, backing off a little. */
    s->ar_retries++;
    idle_for(s, 0.01 * (attempt < 10 ? attempt + 1 : 10));
  }
}
