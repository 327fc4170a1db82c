/* Gossip averaging of one stage's slice of the parameters. */
#include "peer/sync/stage_sync.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int stage_sync_init(struct stage_sync *ss, gossip_t *g, struct stage_trainer *t, const struct stage_sync_config *cfg,
                    struct rumor_err *e) {
  memset(ss, 0, sizeof *ss);
  ss->cfg = *cfg;
  ss->g = g;
  ss->t = t;
  struct tensor flat = tensor_flat(&t->model.params);
  int rc = tensor_mirror_host(&ss->staging, &flat, gossip_xch_theirs(g), e);
  if (rc) return rumor_err_prefix(e, "gossip staging buffer");
  ss->sketch = xcalloc((size_t)gossip_sketch_k(g), sizeof(double));
  ss->last_start_s = ss->stats_s = ss->rate_s = clock_now_s();
  ss->rate_samples = t->st.samples;
  return 0;
}

void stage_sync_free(struct stage_sync *ss) {
  tensor_free(&ss->staging);
  free(ss->sketch);
  memset(ss, 0, sizeof *ss);
}

static int validate(struct stage_sync *ss, char *why, size_t n) {
  struct tensor_diff_stats st;
  tensor_diff_stats(&ss->t->model.params, &ss->staging, &st);
  if (st.nonfinite_y) {
    snprintf(why, n, "%lld of %lld values are NaN or infinite", (long long)st.nonfinite_y,
             (long long)tensor_numel(&ss->staging));
    return RUMOR_ECORRUPT;
  }
  double dist = sqrt(st.sq_dist);
  double norm = sqrt(st.sq_norm_x);
  double floor = norm > 1e-12 ? norm : 1e-12;
  if (!(dist <= ss->cfg.max_distance * floor)) {
    snprintf(why, n, "distance %.4g from our slice is %.3g times its norm %.4g (limit %g)", dist, dist / floor, norm,
             ss->cfg.max_distance);
    return RUMOR_ECORRUPT;
  }
  return 0;
}

static void exchange(struct stage_sync *ss) {
  struct stage_trainer *t = ss->t;
  double now = clock_now_s();
  bool want = (ss->cfg.every_steps > 0 && t->st.step % ss->cfg.every_steps == 0) ||
              (ss->cfg.every_s > 0 && now - ss->last_start_s >= ss->cfg.every_s);
  switch (gossip_xch_poll(ss->g, want)) {
  case GOSSIP_XCH_NONE: return;
  case GOSSIP_XCH_SNAPSHOT:
    /* Synchronous: the slice is small next to a step, and a GPU stage would
     * wait here for its last update anyway. */
    tensor_copy_to_host(&t->model.params, 0, gossip_xch_mine(ss->g), (size_t)t->model.nparams * sizeof(float));
    ss->last_start_s = now;
    gossip_xch_snapshot_done(ss->g, (uint64_t)t->st.step);
    return;
  case GOSSIP_XCH_APPLY: {
    tensor_mirror_refresh(&ss->staging, gossip_xch_theirs(ss->g));
    char why[200] = "";
    int rc = validate(ss, why, sizeof why);
    if (rc == 0) {
      tensor_lerp(&t->model.params, &ss->staging, gossip_xch_alpha(ss->g));
      ss->applied++;
    } else {
      ss->rejected++;
    }
    gossip_xch_apply_done(ss->g, rc, rc ? why : NULL);
    return;
  }
  }
}

static void publish_stats(struct stage_sync *ss, double now, bool with_sketch) {
  struct stage_trainer *t = ss->t;
  if (now - ss->rate_s >= 1.0) {
    ss->samples_per_s = (double)(t->st.samples - ss->rate_samples) / (now - ss->rate_s);
    ss->rate_s = now;
    ss->rate_samples = t->st.samples;
  }
  if (with_sketch) {
    ss->param_norm = sqrt(tensor_sq_norm(&t->model.params));
    tensor_count_sketch(&t->model.params, gossip_sketch_seed(ss->g), gossip_sketch_k(ss->g), ss->sketch);
  }
  struct gossip_peer_stats s = {.step = t->st.step,
                                .epoch = t->st.epoch,
                                .samples = t->st.samples,
                                .loss = t->loss_avg, /* the last stage's; NaN on the others */
                                .samples_per_s = ss->samples_per_s,
                                .param_norm = ss->param_norm,
                                .sketch = with_sketch ? ss->sketch : NULL};
  gossip_stats_publish(ss->g, &s);
  ss->stats_s = now;
}

static void donate(struct stage_sync *ss, double now) {
  if (!gossip_donor_poll(ss->g)) return;
  struct stage_trainer *t = ss->t;
  if (gossip_donor_params_only(ss->g)) {
    tensor_copy_to_host(&t->model.params, 0, gossip_donor_buf(ss->g), (size_t)t->model.nparams * sizeof(float));
    publish_stats(ss, now, true);
  } else {
    log_info("donating this stage's state at step %lld", (long long)t->st.step);
    stage_trainer_copy_state(t, gossip_donor_buf(ss->g));
  }
  struct gossip_train_pos pos = {(uint64_t)t->st.step, (uint64_t)t->st.epoch, (uint64_t)t->st.samples};
  gossip_donor_done(ss->g, &pos);
}

void stage_sync_boundary(struct stage_sync *ss) {
  exchange(ss);
  stage_sync_idle(ss);
}

void stage_sync_idle(void *arg) {
  struct stage_sync *ss = arg;
  double now = clock_now_s();
  if (gossip_stats_wanted(ss->g)) publish_stats(ss, now, true);
  else if (now - ss->stats_s >= 1.0) publish_stats(ss, now, false);
  donate(ss, now);
}
