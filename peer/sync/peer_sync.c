/* The training thread's side of gossip averaging. */
#include "peer/sync/peer_sync.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

int peer_sync_init(struct peer_sync *ps, gossip_t *g, struct trainer *t, const struct peer_sync_config *cfg,
                   struct rumor_err *e) {
  memset(ps, 0, sizeof *ps);
  ps->cfg = *cfg;
  ps->g = g;
  ps->t = t;
  struct tensor flat = tensor_flat(&t->model.params);
  int rc = tensor_mirror_host(&ps->staging, &flat, gossip_xch_theirs(g), e);
  if (rc) return rumor_err_prefix(e, "gossip staging buffer");
  ps->snap_ev = tensor_event_create(t->be);
  if (!ps->snap_ev) {
    tensor_free(&ps->staging);
    return rumor_err_set(e, RUMOR_EDEVICE, "cannot create a device event");
  }
  ps->last_start_s = clock_now_s();
  ps->mix_step = t->st.step;
  clip_init(&ps->clip, cfg->clip_tau);
  ps->sketch = xcalloc((size_t)gossip_sketch_k(g), sizeof(double));
  ps->stats_s = ps->rate_s = ps->last_start_s;
  ps->rate_samples = t->st.samples;
  return 0;
}

void peer_sync_free(struct peer_sync *ps) {
  if (ps->snap_ev) tensor_event_destroy(ps->snap_ev);
  tensor_free(&ps->staging);
  free(ps->sketch);
  memset(ps, 0, sizeof *ps);
}

/* Validates the partner's parameters (in staging) against ours. Returns 0
 * or a negative code with the reason in `why`. */
static int validate(struct peer_sync *ps, char *why, size_t n) {
  struct tensor_diff_stats st;
  tensor_diff_stats(&ps->t->model.params, &ps->staging, &st); /* one pass on the CPU */
  if (st.nonfinite_y) {
    snprintf(why, n, "%lld of %lld values are NaN or infinite", (long long)st.nonfinite_y,
             (long long)tensor_numel(&ps->staging));
    return RUMOR_ECORRUPT;
  }
  double dist = sqrt(st.sq_dist);
  double norm = sqrt(st.sq_norm_x);
  ps->last_dist = dist;
  ps->last_norm = norm;
  double limit = ps->cfg.max_distance * (norm > 1e-12 ? norm : 1e-12);
  if (!(dist <= limit)) {
    snprintf(why, n, "distance %.4g from our parameters is %.3g times our norm %.4g (limit %g)", dist,
             dist / (norm > 1e-12 ? norm : 1e-12), norm, ps->cfg.max_distance);
    return RUMOR_ECORRUPT;
  }
  return 0;
}

static void exchange(struct peer_sync *ps) {
  struct trainer *t = ps->t;
  double now = clock_now_s();
  bool want = ps->holding || (ps->cfg.every_steps > 0 && t->st.step % ps->cfg.every_steps == 0) ||
              (ps->cfg.every_s > 0 && now - ps->last_start_s >= ps->cfg.every_s);
  switch (gossip_xch_poll(ps->g, want)) {
  case GOSSIP_XCH_NONE: return;
  case GOSSIP_XCH_SNAPSHOT:
    if (!ps->snap_pending) {
      /* Asynchronous on a GPU (pinned host buffer); done at once on the CPU. */
      tensor_copy_to_host_async(&t->model.params, 0, gossip_xch_mine(ps->g),
                                (size_t)t->model.nparams * sizeof(float));
      tensor_event_record(ps->snap_ev);
      ps->snap_pending = true;
      ps->snap_step = t->st.step;
      ps->last_start_s = now;
    }
    if (tensor_event_query(ps->snap_ev)) {
      ps->snap_pending = false;
      if (ps->cfg.attack) attack_snapshot(ps->cfg.attack, gossip_xch_mine(ps->g), t->model.nparams, &ps->snap_step);
      gossip_xch_snapshot_done(ps->g, (uint64_t)ps->snap_step);
    }
    return;
  case GOSSIP_XCH_APPLY: {
    tensor_mirror_refresh(&ps->staging, gossip_xch_theirs(ps->g));
    char why[200] = "";
    int rc = validate(ps, why, sizeof why);
    /* Clipped: x + α·min(1, τ/‖d‖)·d, d = x_partner − x (clip.h); far
     * outliers are skipped. */
    float w = gossip_xch_alpha(ps->g);
    if (rc == 0 && ps->cfg.clip) {
      double scale = clip_scale(&ps->clip, gossip_xch_partner(ps->g), ps->last_dist, ps->last_norm);
      w *= (float)scale;
      log_debug("clip: distance %.4g, tau %.4g (%.3g tau), scale %.3g", ps->last_dist, ps->clip.last_tau,
                ps->last_dist / ps->clip.last_tau, scale);
      if (ps->clip.last_outlier) {
        snprintf(why, sizeof why, "distance %.4g is %.3g times the clipping threshold %.4g (an outlier)",
                 ps->last_dist, ps->last_dist / ps->clip.last_tau, ps->clip.last_tau);
        rc = 1;
      }
    }
    if (rc == 0) {
      tensor_lerp(&t->model.params, &ps->staging, w);
      ps->applied++;
      int64_t run = t->st.step - ps->mix_step;
      if (run > ps->longest_local) ps->longest_local = run;
      ps->mix_step = t->st.step;
    } else {
      ps->rejected++;
    }
    gossip_xch_apply_done(ps->g, rc, rc ? why : NULL);
    return;
  }
  }
}

void peer_sync_hold(struct peer_sync *ps, const atomic_int *stop) {
  int64_t step = ps->t->st.step;
  if (ps->cfg.max_local_steps <= 0 || step - ps->mix_step < ps->cfg.max_local_steps || step < ps->hold_resume_step)
    return;
  if (gossip_live_partners(ps->g) == 0) return; /* alone: nobody to mix with */
  double t0 = clock_now_s();
  uint64_t applied = ps->applied;
  unsigned polls = 0;
  ps->holding = true;
  ps->holds++;
  while (ps->applied == applied && !(stop && atomic_load(stop))) {
    if (clock_now_s() - t0 >= ps->cfg.max_hold_s) {
      /* Exchanges keep failing (partners backed off, busy or gone): train
       * on, and hold again only after N·2^k more steps (k: holds in a row
       * that gave up, at most 10), so a cluster that cannot mix is slowed
       * by a vanishing fraction, not stopped. */
      ps->hold_timeouts++;
      ps->hold_failures_in_row++;
      int k = ps->hold_failures_in_row < 10 ? ps->hold_failures_in_row : 10;
      ps->hold_resume_step = step + (ps->cfg.max_local_steps << k);
      log_info("no exchange applied after %lld steps and %.2f s of holding: training on; next hold after step %lld",
               (long long)(step - ps->mix_step), ps->cfg.max_hold_s, (long long)ps->hold_resume_step);
      break;
    }
    const struct timespec tick = {0, 200 * 1000};
    nanosleep(&tick, NULL);
    peer_sync_boundary(ps);
    if (++polls % 25 == 0 && gossip_live_partners(ps->g) == 0) break; /* the others left */
  }
  ps->holding = false;
  if (ps->applied != applied) ps->hold_failures_in_row = 0;
  ps->hold_s += clock_now_s() - t0;
}

/* Publishes the training figures; with_sketch adds the O(P) ones. */
static void publish_stats(struct peer_sync *ps, double now, bool with_sketch) {
  struct trainer *t = ps->t;
  if (now - ps->rate_s >= 1.0) {
    ps->samples_per_s = (double)(t->st.samples - ps->rate_samples) / (now - ps->rate_s);
    ps->rate_s = now;
    ps->rate_samples = t->st.samples;
  }
  if (with_sketch) {
    ps->param_norm = sqrt(tensor_sq_norm(&t->model.params));
    tensor_count_sketch(&t->model.params, gossip_sketch_seed(ps->g), gossip_sketch_k(ps->g), ps->sketch);
  }
  struct gossip_peer_stats s = {.step = t->st.step,
                                .epoch = t->st.epoch,
                                .samples = t->st.samples,
                                .loss = t->loss_avg, /* NaN before the first step */
                                .samples_per_s = ps->samples_per_s,
                                .param_norm = ps->param_norm,
                                .sketch = with_sketch ? ps->sketch : NULL};
  gossip_stats_publish(ps->g, &s);
  ps->stats_s = now;
}

void peer_sync_boundary(struct peer_sync *ps) {
  exchange(ps);
  double now = clock_now_s();
  if (gossip_stats_wanted(ps->g)) publish_stats(ps, now, true);
  else if (now - ps->stats_s >= 1.0) publish_stats(ps, now, false);
  if (gossip_donor_poll(ps->g)) {
    struct trainer *t = ps->t;
    if (gossip_donor_params_only(ps->g)) {
      /* A monitor measures drift exactly: parameters and their sketch. */
      tensor_copy_to_host(&t->model.params, 0, gossip_donor_buf(ps->g), (size_t)t->model.nparams * sizeof(float));
      publish_stats(ps, now, true);
      struct gossip_train_pos pos = {(uint64_t)t->st.step, (uint64_t)t->st.epoch, (uint64_t)t->st.samples};
      gossip_donor_done(ps->g, &pos);
      return;
    }
    log_info("donating our state at step %lld: loss %.4f on %d training samples", (long long)t->st.step,
             trainer_check_loss(t, PEER_SYNC_CHECK_SAMPLES), PEER_SYNC_CHECK_SAMPLES);
    trainer_copy_state(t, gossip_donor_buf(ps->g));
    struct gossip_train_pos pos = {(uint64_t)t->st.step, (uint64_t)t->st.epoch, (uint64_t)t->st.samples};
    gossip_donor_done(ps->g, &pos);
  }
}
