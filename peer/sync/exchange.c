/* The training thread's side of the exchange slot (gossip.h): snapshots
 * kept ready for partners, the copy asked for by an exchange, and the
 * validation and clipping of what a partner sent. Shared by gossip
 * averaging (average.c) and NoLoCo (noloco.c). */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "peer/sync/sync_impl.h"

/* The device copy of the snapshot (sync.h, snap_dev), when the device has
 * room for it beside SNAP_DEV_MARGIN of its memory: buffers that grow on
 * first use (attention, LayerNorm backward) must still find theirs, since
 * their allocation failing ends the process. */
#define SNAP_DEV_MARGIN 8 /* keep 1/8 of the device free */
static void alloc_snap_dev(struct sync *s) {
  struct trainer *t = s->t;
  size_t need = (size_t)trainer_shard_floats(t) * sizeof(float), free_b = 0, total_b = 0;
  bool known = tensor_backend_mem_info(t->be, &free_b, &total_b);
  struct rumor_err ignored = {0};
  struct tensor flat = trainer_shard_params(t);
  if ((known && free_b < need + total_b / SNAP_DEV_MARGIN) ||
      tensor_alloc(&s->x.snap_dev, t->be, TENSOR_F32, 1, &flat.shape[0], &ignored) != 0)
    log_warn("%s has no room for a second copy of the parameters (%.0f MB beside an eighth of its memory): the "
             "snapshots kept ready for partners are copied to the host on the training stream (peer/sync/sync.h)",
             tensor_backend_name(t->be), (double)need * 1e-6);
}

int sync_xch_init(struct sync *s, bool dev_copy, struct rumor_err *e) {
  struct sync_xch *x = &s->x;
  struct trainer *t = s->t;
  struct tensor flat = trainer_shard_params(t);
  int rc = tensor_mirror_host(&x->staging, &flat, gossip_xch_theirs(s->g), e);
  if (rc) return rumor_err_prefix(e, "gossip staging buffer");
  x->snap_ev = tensor_event_create(t->be);
  if (!x->snap_ev) {
    tensor_free(&x->staging);
    return rumor_err_set(e, RUMOR_EDEVICE, "cannot create a device event");
  }
  if (dev_copy && tensor_backend_device(t->be) != TENSOR_DEVICE_CPU) alloc_snap_dev(s);
  x->last_start_s = clock_now_s();
  x->refreshed_step = -1;
  clip_init(&x->clip, s->cfg.clip_tau);
  return 0;
}

void sync_xch_free(struct sync *s) {
  struct sync_xch *x = &s->x;
  if (x->snap_ev) {
    tensor_event_wait(x->snap_ev); /* a copy beside the stream may still read snap_dev */
    tensor_event_destroy(x->snap_ev);
  }
  tensor_free(&x->snap_dev);
  tensor_free(&x->staging);
}

/* Copies the parameters into gossip_xch_mine(): asynchronous on a GPU
 * (pinned host buffer, snap_ev says when), done at once on the CPU. On a
 * GPU with snap_dev, the training stream only copies device to device; the
 * transfer to the host runs beside it, and snap_dev is not written again
 * before snap_ev (the callers start a copy only when none is pending). */
static void start_copy(struct sync *s) {
  struct sync_xch *x = &s->x;
  struct trainer *t = s->t;
  size_t bytes = (size_t)trainer_shard_floats(t) * sizeof(float);
  if (x->snap_dev.data) {
    struct tensor flat = trainer_shard_params(t);
    tensor_copy(&x->snap_dev, &flat);
    tensor_copy_to_host_beside(&x->snap_dev, 0, gossip_xch_mine(s->g), bytes, x->snap_ev);
  } else {
    tensor_copy_to_host_async(&t->model.params, t->shard_lo, gossip_xch_mine(s->g), bytes);
    tensor_event_record(x->snap_ev);
  }
  x->snap_pending = true;
  x->snap_step = t->st.step;
}

/* A copy in flight that landed goes to the slot. A refresh's copy that an
 * exchange took over (SNAPSHOT during it) serves that exchange as well;
 * the copy of an exchange abandoned meanwhile is dropped by the slot. */
static void finish_copy(struct sync *s) {
  struct sync_xch *x = &s->x;
  if (!x->snap_pending || !tensor_event_query(x->snap_ev)) return;
  x->snap_pending = false;
  x->snap_refresh = false;
  gossip_xch_copied(s->g, (uint64_t)x->snap_step);
}

void sync_xch_turn(struct sync *s, bool want, struct gossip_xch_turn *turn, bool *copy_started) {
  struct sync_xch *x = &s->x;
  /* Holding polls every 200 µs: one refresh per state of the parameters. */
  bool refresh = !x->snap_pending && x->refreshed_step != s->t->st.step;
  gossip_xch_begin(s->g, want, refresh, turn);
  *copy_started = false;
  if (turn->work == GOSSIP_XCH_SNAPSHOT && !x->snap_pending) {
    start_copy(s);
    *copy_started = true;
  } else if (turn->refresh) {
    x->refreshed_step = s->t->st.step;
    start_copy(s);
    x->snap_refresh = true;
  }
  finish_copy(s);
}

/* Validates the partner's snapshot by the statistics of its difference
 * from ours (gossip_xch_delta). Returns 0 or a negative code with the
 * reason in `why`. */
static int validate(struct sync *s, const struct gossip_xch_delta *d, char *why, size_t n) {
  if (d->nonfinite) {
    snprintf(why, n, "%lld of %lld values are NaN or infinite", (long long)d->nonfinite,
             (long long)trainer_shard_floats(s->t));
    return RUMOR_ECORRUPT;
  }
  double dist = sqrt(d->sq_dist);
  double norm = sqrt(d->sq_norm_mine);
  s->x.last_dist = dist;
  s->x.last_norm = norm;
  double limit = s->cfg.max_distance * (norm > 1e-12 ? norm : 1e-12);
  if (!(dist <= limit)) {
    snprintf(why, n, "distance %.4g from our parameters is %.3g times our norm %.4g (limit %g)", dist,
             dist / (norm > 1e-12 ? norm : 1e-12), norm, s->cfg.max_distance);
    return RUMOR_ECORRUPT;
  }
  return 0;
}

int sync_xch_judge(struct sync *s, const struct gossip_xch_turn *turn, float alpha, float *weight, char *why,
                   size_t n) {
  struct sync_xch *x = &s->x;
  why[0] = '\0';
  memcpy(x->judged_partner, turn->partner, sizeof x->judged_partner);
  int rc = validate(s, turn->delta, why, n);
  *weight = alpha;
  if (rc || !s->cfg.clip) return rc;
  /* Clipped: α·min(1, τ/‖d‖)·d, d = x'_s − x_s (sync.h, "Clipping"); far
   * outliers are skipped. */
  double scale = clip_scale(&x->clip, turn->partner, x->last_dist, x->last_norm);
  *weight = alpha * (float)scale;
  log_debug("clip: distance %.4g, tau %.4g (%.3g tau), scale %.3g", x->last_dist, x->clip.last_tau,
            x->last_dist / x->clip.last_tau, scale);
  if (!x->clip.last_outlier) return 0;
  snprintf(why, n, "distance %.4g is %.3g times the clipping threshold %.4g (an outlier)", x->last_dist,
           x->last_dist / x->clip.last_tau, x->clip.last_tau);
  return 1;
}

const struct tensor *sync_xch_delta_dev(struct sync *s) {
  tensor_mirror_refresh(&s->x.staging, gossip_xch_theirs(s->g));
  return &s->x.staging;
}

void sync_xch_done(struct sync *s, int rc, const char *why) {
  struct sync_xch *x = &s->x;
  if (rc == 0) {
    x->applied++;
    x->applied_rel_dist = x->last_dist / (x->last_norm > 1e-12 ? x->last_norm : 1e-12);
    memcpy(x->applied_partner, x->judged_partner, sizeof x->applied_partner);
    x->refreshed_step = -1; /* the parameters changed within the step */
  } else {
    x->rejected++;
    if (rc > 0) x->skipped++;
  }
  gossip_xch_apply_done(s->g, rc, rc ? why : NULL);
}
