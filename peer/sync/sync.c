/* The training thread's side of gossip, for whole replicas and stages. */
#include "peer/sync/sync.h"

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* The device copy of the snapshot (sync.h, snap_dev), when the device has
 * room for it beside SNAP_DEV_MARGIN of its memory: buffers that grow on
 * first use (attention, LayerNorm backward) must still find theirs, since
 * their allocation failing ends the process. */
#define SNAP_DEV_MARGIN 8 /* keep 1/8 of the device free */
static void alloc_snap_dev(struct sync *s) {
  struct trainer *t = s->t;
  size_t need = (size_t)t->model.nparams * sizeof(float), free_b = 0, total_b = 0;
  bool known = tensor_backend_mem_info(t->be, &free_b, &total_b);
  struct rumor_err ignored = {0};
  struct tensor flat = tensor_flat(&t->model.params);
  if ((known && free_b < need + total_b / SNAP_DEV_MARGIN) ||
      tensor_alloc(&s->snap_dev, t->be, TENSOR_F32, 1, &flat.shape[0], &ignored) != 0)
    log_warn("%s has no room for a second copy of the parameters (%.0f MB beside an eighth of its memory): the "
             "snapshots kept ready for partners are copied to the host on the training stream (peer/sync/sync.h)",
             tensor_backend_name(t->be), (double)need * 1e-6);
}

int sync_init(struct sync *s, gossip_t *g, struct trainer *t, const struct sync_config *cfg, struct rumor_err *e) {
  memset(s, 0, sizeof *s);
  s->cfg = *cfg;
  s->g = g;
  s->t = t;
  struct tensor flat = tensor_flat(&t->model.params);
  int rc = tensor_mirror_host(&s->staging, &flat, gossip_xch_theirs(g), e);
  if (rc) return rumor_err_prefix(e, "gossip staging buffer");
  s->snap_ev = tensor_event_create(t->be);
  if (!s->snap_ev) {
    tensor_free(&s->staging);
    return rumor_err_set(e, RUMOR_EDEVICE, "cannot create a device event");
  }
  if (tensor_backend_device(t->be) != TENSOR_DEVICE_CPU && !cfg->allreduce) alloc_snap_dev(s);
  s->last_start_s = clock_now_s();
  s->mix_step = t->st.step;
  s->refreshed_step = -1;
  clip_init(&s->clip, cfg->clip_tau);
  s->sketch = xcalloc((size_t)gossip_sketch_k(g), sizeof(double));
  s->stats_s = s->rate_s = s->last_start_s;
  s->rate_samples = t->st.samples;
  return 0;
}

void sync_free(struct sync *s) {
  if (s->snap_ev) {
    tensor_event_wait(s->snap_ev); /* a copy beside the stream may still read snap_dev */
    tensor_event_destroy(s->snap_ev);
  }
  tensor_free(&s->snap_dev);
  tensor_free(&s->staging);
  free(s->sketch);
  memset(s, 0, sizeof *s);
}

/* Validates the partner's snapshot by the statistics of its difference
 * from ours (gossip_xch_delta). Returns 0 or a negative code with the
 * reason in `why`. */
static int validate(struct sync *s, const struct gossip_xch_delta *d, char *why, size_t n) {
  if (d->nonfinite) {
    snprintf(why, n, "%lld of %lld values are NaN or infinite", (long long)d->nonfinite,
             (long long)s->t->model.nparams);
    return RUMOR_ECORRUPT;
  }
  double dist = sqrt(d->sq_dist);
  double norm = sqrt(d->sq_norm_mine);
  s->last_dist = dist;
  s->last_norm = norm;
  double limit = s->cfg.max_distance * (norm > 1e-12 ? norm : 1e-12);
  if (!(dist <= limit)) {
    snprintf(why, n, "distance %.4g from our parameters is %.3g times our norm %.4g (limit %g)", dist,
             dist / (norm > 1e-12 ? norm : 1e-12), norm, s->cfg.max_distance);
    return RUMOR_ECORRUPT;
  }
  return 0;
}

/* After an exchange we asked for applied nothing (no partner free, refused,
 * failed), the next is asked for no sooner than this, doubling up to the
 * maximum, whatever the schedule: a peer that steps a thousand times a
 * second, or holds and polls every 200 µs, must not flood its partners with
 * requests (they would rate-limit an honest peer). */
#define RETRY_MIN_S 0.002
#define RETRY_MAX_S 0.02

/* Follows the exchange we asked for to its end, and paces the next. */
static void pace(struct sync *s, double now) {
  if (!s->asked || gossip_xch_in_flight(s->g)) return;
  s->asked = false;
  if (s->applied > s->applied_at_ask) {
    s->failed_asks = 0;
    return;
  }
  s->failed_asks++;
  double wait = RETRY_MIN_S * (double)(1u << (s->failed_asks < 7 ? s->failed_asks - 1 : 6));
  s->next_ask_s = now + (wait < RETRY_MAX_S ? wait : RETRY_MAX_S);
}

/* Copies the parameters into gossip_xch_mine(): asynchronous on a GPU
 * (pinned host buffer, snap_ev says when), done at once on the CPU. On a
 * GPU with snap_dev, the training stream only copies device to device; the
 * transfer to the host runs beside it, and snap_dev is not written again
 * before snap_ev (the callers start a copy only when none is pending). */
static void start_copy(struct sync *s) {
  struct trainer *t = s->t;
  size_t bytes = (size_t)t->model.nparams * sizeof(float);
  if (s->snap_dev.data) {
    struct tensor flat = tensor_flat(&t->model.params);
    tensor_copy(&s->snap_dev, &flat);
    tensor_copy_to_host_beside(&s->snap_dev, 0, gossip_xch_mine(s->g), bytes, s->snap_ev);
  } else {
    tensor_copy_to_host_async(&t->model.params, 0, gossip_xch_mine(s->g), bytes);
    tensor_event_record(s->snap_ev);
  }
  s->snap_pending = true;
  s->snap_step = t->st.step;
}

/* Keeps the snapshot of this boundary ready in gossip_xch_mine(), so that a
 * partner's request is answered without waiting for our next boundary
 * (gossip_impl.h, slot states). One copy of the parameters per step: on the
 * CPU a memcpy of 4·P bytes against a step's 6·P·batch FLOPs at least. */
static void keep_ready(struct sync *s) {
  if (!s->snap_pending) {
    /* Holding polls every 200 µs: one copy per state of the parameters. */
    if (s->refreshed_step == s->t->st.step) return;
    if (!gossip_xch_refresh_begin(s->g)) return;
    s->refreshed_step = s->t->st.step;
    start_copy(s);
    s->snap_refresh = true;
  }
  if (!tensor_event_query(s->snap_ev)) return;
  s->snap_pending = false;
  if (s->snap_refresh) gossip_xch_refresh_done(s->g, (uint64_t)s->snap_step);
  /* else the copy of an exchange abandoned meanwhile: dropped */
  s->snap_refresh = false;
}

static void exchange(struct sync *s) {
  struct trainer *t = s->t;
  double now = clock_now_s();
  pace(s, now);
  bool want = s->holding || (s->cfg.every_steps > 0 && t->st.step % s->cfg.every_steps == 0) ||
              (s->cfg.every_s > 0 && now - s->last_start_s >= s->cfg.every_s);
  want = want && !s->asked && now >= s->next_ask_s;
  bool idle = want && !gossip_xch_in_flight(s->g);
  enum gossip_xch_work work = gossip_xch_poll(s->g, want);
  if (idle && work == GOSSIP_XCH_SNAPSHOT) {
    s->asked = true; /* ours (or a partner's request that came first: followed all the same) */
    s->applied_at_ask = s->applied;
  }
  switch (work) {
  case GOSSIP_XCH_NONE: keep_ready(s); return;
  case GOSSIP_XCH_SNAPSHOT:
    /* A refresh in flight (a partner asked during it) serves as well. */
    s->snap_refresh = false;
    if (!s->snap_pending) {
      start_copy(s);
      s->last_start_s = now;
    }
    if (tensor_event_query(s->snap_ev)) {
      s->snap_pending = false;
      gossip_xch_snapshot_done(s->g, (uint64_t)s->snap_step);
    }
    return;
  case GOSSIP_XCH_APPLY: {
    char why[200] = "";
    int rc = validate(s, gossip_xch_delta(s->g), why, sizeof why);
    /* Clipped: x + α·min(1, τ/‖d‖)·d, d = x'_s − x_s (sync.h, "Clipping"); far
     * outliers are skipped. */
    float w = gossip_xch_alpha(s->g);
    if (rc == 0 && s->cfg.clip) {
      double scale = clip_scale(&s->clip, gossip_xch_partner(s->g), s->last_dist, s->last_norm);
      w *= (float)scale;
      log_debug("clip: distance %.4g, tau %.4g (%.3g tau), scale %.3g", s->last_dist, s->clip.last_tau,
                s->last_dist / s->clip.last_tau, scale);
      if (s->clip.last_outlier) {
        snprintf(why, sizeof why, "distance %.4g is %.3g times the clipping threshold %.4g (an outlier)",
                 s->last_dist, s->last_dist / s->clip.last_tau, s->clip.last_tau);
        rc = 1;
      }
    }
    if (rc == 0) {
      /* θ + w·(θ'_s − θ_s) (sync.h, "Applying"): the difference is in the
       * partner's buffer already (gossip_xch_theirs). */
      struct tensor params = tensor_flat(&t->model.params);
      tensor_mirror_refresh(&s->staging, gossip_xch_theirs(s->g));
      tensor_axpby(w, &s->staging, 1.0f, &params);
      s->refreshed_step = -1; /* the parameters changed within the step */
      s->applied++;
      int64_t run = t->st.step - s->mix_step;
      if (run > s->longest_local) s->longest_local = run;
      s->mix_step = t->st.step;
    } else {
      s->rejected++;
      if (rc > 0) s->skipped++;
    }
    gossip_xch_apply_done(s->g, rc, rc ? why : NULL);
    keep_ready(s); /* the slot is idle again: a snapshot for the next request */
    return;
  }
  }
}

void sync_hold(struct sync *s, const atomic_int *stop) {
  int64_t step = s->t->st.step;
  if (s->cfg.max_local_steps <= 0 || step - s->mix_step < s->cfg.max_local_steps || step < s->hold_resume_step)
    return;
  if (gossip_live_partners(s->g) == 0) return; /* alone: nobody to mix with */
  double t0 = clock_now_s();
  uint64_t applied = s->applied;
  unsigned polls = 0;
  s->holding = true;
  s->holds++;
  while (s->applied == applied && !(stop && atomic_load(stop))) {
    if (clock_now_s() - t0 >= s->cfg.max_hold_s) {
      /* Exchanges keep failing (partners backed off, busy or gone): train
       * on, and hold again only after N·2^k more steps (k: holds in a row
       * that gave up, at most 10), so a cluster that cannot mix is slowed
       * by a vanishing fraction, not stopped. */
      s->hold_timeouts++;
      s->hold_failures_in_row++;
      int k = s->hold_failures_in_row < 10 ? s->hold_failures_in_row : 10;
      s->hold_resume_step = step + (s->cfg.max_local_steps << k);
      log_info("no exchange applied after %lld steps and %.2f s of holding: training on; next hold after step %lld",
               (long long)(step - s->mix_step), s->cfg.max_hold_s, (long long)s->hold_resume_step);
      break;
    }
    const struct timespec tick = {0, 200 * 1000};
    nanosleep(&tick, NULL);
    sync_boundary(s); /* asks for exchanges, paced (above) */
    if (++polls % 25 == 0 && gossip_live_partners(s->g) == 0) break; /* the others left */
  }
  s->holding = false;
  if (s->applied != applied) s->hold_failures_in_row = 0;
  s->hold_s += clock_now_s() - t0;
}

/* The exchange schedule while finishing: every_steps of our own mean
 * step time (`step_s`), or the interval, whichever comes first; at least
 * FINISH_MIN_INTERVAL_S apart. */
#define FINISH_MIN_INTERVAL_S 1e-3
#define FINISH_QUIET_EXCHANGES 2 /* applied once no partner trains, before leaving */
static double finish_interval(const struct sync_config *c, double step_s) {
  double by_steps = c->every_steps > 0 ? step_s * (double)c->every_steps : 0;
  double every = c->every_s > 0 && (by_steps == 0 || c->every_s < by_steps) ? c->every_s : by_steps;
  return every > FINISH_MIN_INTERVAL_S ? every : FINISH_MIN_INTERVAL_S;
}

int sync_finish(struct sync *s, double step_s, double max_s, const atomic_int *stop,
                bool (*failed)(void *arg, struct rumor_err *e), void *arg, struct rumor_err *e) {
  gossip_finished(s->g);
  struct sync_config saved = s->cfg;
  double t0 = clock_now_s();
  uint64_t applied = s->applied;
  /* Exchanges on the time schedule only: the step does not move. */
  double every = finish_interval(&saved, step_s);
  s->cfg.every_steps = 0;
  const char *why = "stopped";
  int rc = 0;
  bool quiet = false;          /* no partner trains */
  uint64_t applied_quiet = 0;  /* exchanges applied when that was seen */
  while (!(stop && atomic_load(stop))) {
    /* Once nobody trains, FINISH_QUIET_EXCHANGES more exchanges (unless
     * nobody is left at all): the last to finish shares its last steps, and
     * the others average the finished replicas further (two peers end
     * equal; four measured 0-0.01 apart, relative). Then no new exchange of
     * ours, and the one under way ends before we leave (a partner may still
     * take our ready snapshot meanwhile: it moves towards our final state,
     * we do not move). A partner seen training again (back from suspect)
     * starts the count over. */
    bool nobody = gossip_training_partners(s->g) == 0;
    if (nobody && !quiet) applied_quiet = s->applied;
    quiet = nobody;
    bool done = quiet && (s->applied >= applied_quiet + FINISH_QUIET_EXCHANGES || gossip_live_partners(s->g) == 0);
    s->cfg.every_s = done ? 0 : every;
    if (done) {
      why = "no partner is still training";
      if (!gossip_xch_in_flight(s->g)) break;
    }
    if (clock_now_s() - t0 >= max_s) {
      why = "--finish-wait-ms passed";
      break;
    }
    if (failed && failed(arg, e)) {
      why = e->msg;
      rc = RUMOR_ECANCELED;
      break;
    }
    const struct timespec tick = {0, 1000 * 1000};
    nanosleep(&tick, NULL);
    sync_boundary(s);
  }
  s->cfg = saved;
  s->finish_s = clock_now_s() - t0;
  s->finish_applied = s->applied - applied;
  log_info("finished waiting after %.2f s (%s): %llu exchanges applied meanwhile", s->finish_s, why,
           (unsigned long long)s->finish_applied);
  return rc;
}

/* Publishes the training figures; with_sketch adds the O(P) ones. */
static void publish_stats(struct sync *s, double now, bool with_sketch) {
  struct trainer *t = s->t;
  if (now - s->rate_s >= 1.0) {
    s->samples_per_s = (double)(t->st.samples - s->rate_samples) / (now - s->rate_s);
    s->rate_s = now;
    s->rate_samples = t->st.samples;
  }
  if (with_sketch) {
    s->param_norm = sqrt(tensor_sq_norm(&t->model.params));
    tensor_count_sketch(&t->model.params, gossip_sketch_seed(s->g), gossip_sketch_k(s->g), s->sketch);
  }
  struct gossip_peer_stats ps = {.step = t->st.step,
                                .epoch = t->st.epoch,
                                .samples = t->st.samples,
                                .loss = t->loss_avg, /* NaN before the first step and on stages without the loss */
                                .samples_per_s = s->samples_per_s,
                                .param_norm = s->param_norm,
                                .sketch = with_sketch ? s->sketch : NULL};
  gossip_stats_publish(s->g, &ps);
  s->stats_s = now;
}

int64_t sync_check_targets(int64_t nparams) {
  int64_t n = nparams > 0 ? SYNC_CHECK_MACS / nparams : SYNC_CHECK_TARGETS;
  return n < 1 ? 1 : n > SYNC_CHECK_TARGETS ? SYNC_CHECK_TARGETS : n;
}

double sync_pull_max_loss(double own_loss) {
  return fmax(SYNC_PULL_MAX_LOSS_RATIO * own_loss, own_loss + SYNC_PULL_LOSS_SLACK);
}

/* Serves a pending donation: a monitor's request for the parameters, or a
 * newcomer's for the whole state. */
static void donate(struct sync *s, double now) {
  if (!gossip_donor_poll(s->g)) return;
  struct trainer *t = s->t;
  if (gossip_donor_params_only(s->g)) {
    /* A monitor measures drift exactly: parameters and their sketch. */
    tensor_copy_to_host(&t->model.params, 0, gossip_donor_buf(s->g), (size_t)t->model.nparams * sizeof(float));
    publish_stats(s, now, true);
  } else {
    if (trainer_is_stage(t))
      log_info("donating this stage's state at step %lld", (long long)t->st.step);
    else {
      int64_t rows;
      double loss = trainer_check_loss(t, sync_check_targets(t->model.nparams), &rows);
      log_info("donating our state at step %lld: loss %.4f on %lld training %s", (long long)t->st.step, loss,
               (long long)rows, trainer_row_noun(t));
    }
    trainer_copy_state(t, gossip_donor_buf(s->g));
  }
  struct gossip_train_pos pos = {(uint64_t)t->st.step, (uint64_t)t->st.epoch, (uint64_t)t->st.samples};
  gossip_donor_done(s->g, &pos);
}

void sync_idle(void *arg) {
  struct sync *s = arg;
  double now = clock_now_s();
  if (gossip_stats_wanted(s->g)) publish_stats(s, now, true);
  else if (now - s->stats_s >= 1.0) publish_stats(s, now, false);
  donate(s, now);
}

void sync_boundary(struct sync *s) {
  if (!s->cfg.allreduce) exchange(s);
  sync_idle(s);
}
