/* What every sync scheme shares: the table and its choice, the monitoring
 * figures, state donations, and the calls members make. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

const struct sync_scheme *sync_scheme_of(const struct sync_config *c) {
  bool outer = c->outer.kind != OUTER_NONE;
  switch (c->kind) {
  case SYNC_GOSSIP: return outer ? &sync_scheme_noloco : &sync_scheme_gossip;
  case SYNC_ALLREDUCE: return outer ? &sync_scheme_diloco : &sync_scheme_allreduce;
  case SYNC_PS: return &sync_scheme_ps;
  }
  RUMOR_ASSERT(!"an unknown --sync");
  return NULL;
}

const char *outer_kind_name(enum outer_kind k) {
  switch (k) {
  case OUTER_NONE: return "none";
  case OUTER_SGD: return "sgd";
  case OUTER_NESTEROV: return "nesterov";
  }
  return "unknown";
}

bool sync_stopped(const struct sync *s) { return s->cfg.stop && atomic_load(s->cfg.stop); }

void sync_idle_for(struct sync *s, double secs) {
  double end = clock_now_s() + secs;
  while (clock_now_s() < end && !sync_stopped(s)) {
    const struct timespec tick = {0, 2 * 1000000};
    nanosleep(&tick, NULL);
    sync_idle(s);
  }
}

int sync_init(struct sync *s, gossip_t *g, struct trainer *t, const struct sync_config *cfg, struct rumor_err *e) {
  memset(s, 0, sizeof *s);
  s->cfg = *cfg;
  s->scheme = sync_scheme_of(cfg);
  s->g = g;
  s->t = t;
  s->donate_state_ok = true;
  s->sketch = xcalloc(g ? (size_t)gossip_sketch_k(g) : 1, sizeof(double));
  s->stats_s = s->rate_s = clock_now_s();
  s->rate_samples = t->st.samples;
  int rc = s->scheme->init ? s->scheme->init(s, e) : 0;
  if (rc) {
    free(s->sketch);
    memset(s, 0, sizeof *s);
    return rc;
  }
  if (s->scheme->reduce) t->reducer = (struct train_reducer){s->scheme->reduce, s->scheme->catch_up, sync_idle, s};
  return 0;
}

void sync_free(struct sync *s) {
  if (!s->scheme) return;
  if (s->t && s->t->reducer.arg == s) s->t->reducer = (struct train_reducer){0};
  if (s->scheme->free) s->scheme->free(s);
  free(s->sketch);
  memset(s, 0, sizeof *s);
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
    struct tensor params = trainer_shard_params(t);
    s->param_norm = sqrt(tensor_sq_norm(&params));
    tensor_count_sketch(&params, gossip_sketch_seed(s->g), gossip_sketch_k(s->g), s->sketch);
  }
  struct gossip_peer_stats ps = {.step = t->st.step,
                                 .epoch = t->st.epoch,
                                 .samples = t->st.samples,
                                 .loss = t->loss_avg, /* NaN before the first step and on stages without the loss */
                                 .samples_per_s = s->samples_per_s,
                                 .param_norm = s->param_norm,
                                 .sketch = with_sketch ? s->sketch : NULL,
                                 .outer_round = -1,
                                 .outer_norm = NAN,
                                 .peak_rss_bytes = trainer_peak_rss_bytes()};
  if (t->moe.experts) { /* a mixture of experts' last step */
    ps.moe_experts = t->moe.experts < GOSSIP_MAX_EXPERTS ? t->moe.experts : GOSSIP_MAX_EXPERTS;
    ps.moe_aux_loss = t->moe.aux_loss;
    ps.moe_z_loss = t->moe.z_loss;
    ps.moe_dropped = t->moe.dropped_fraction;
    memcpy(ps.moe_load, t->moe.load, (size_t)ps.moe_experts * sizeof(double));
  }
  if (s->cfg.outer.kind != OUTER_NONE) {
    ps.outer_round = (int64_t)s->outer.rounds;
    ps.outer_norm = s->outer.last_norm;
    ps.outer_bytes = s->outer.last_bytes;
    ps.outer_wait_s = s->outer.wait_s;
  }
  gossip_stats_publish(s->g, &ps);
  s->stats_s = now;
}

/* Whether a state may go to the pending request while donate_state_ok is
 * false (an overlapped DiLoCo round in flight, which is nearly always): a
 * ring member left behind or rejoining (its pull names a step: a catch-up,
 * sync_ring_rejoin) may take a state with the round in flight, whose donor
 * waits in that round for it.
 * A group process takes the outer state alone, which a round in flight
 * leaves whole (the anchor and momentum after the rounds applied, the
 * round marked in flight), and runs the round at once (sync_outer_take);
 * a whole replica takes all of it, the round's pseudo-gradient included
 * (outer.prev), and runs the round again from what its donor sent
 * (diloco.c, land_flight), landing it as the donor does. A newcomer's
 * join is served between rounds only: it would come in without a ring. */
static bool flight_state_ok(const struct sync *s) {
  return s->cfg.outer.kind != OUTER_NONE && gossip_donor_catch_up(s->g);
}

/* Serves a pending donation: a monitor's request for the parameters, or a
 * newcomer's for the whole state (held back while donate_state_ok is
 * false, but for flight_state_ok). */
static void donate(struct sync *s, double now) {
  if (!gossip_donor_poll(s->g)) return;
  struct trainer *t = s->t;
  if (gossip_donor_params_only(s->g)) {
    /* A monitor measures drift exactly: parameters and their sketch. */
    tensor_copy_to_host(&t->model.params, t->shard_lo, gossip_donor_buf(s->g), (size_t)trainer_shard_floats(t) * sizeof(float));
    publish_stats(s, now, true);
  } else {
    /* Asked again at the next round boundary, or after the hold. */
    if ((!s->donate_state_ok && !flight_state_ok(s)) || s->hold_state) return;
    if (trainer_holds_part(t))
      log_info("donating this %s's state at step %lld", trainer_is_stage(t) ? "stage" : "shard", (long long)t->st.step);
    else {
      int64_t rows;
      double loss = trainer_check_loss(t, sync_check_targets(trainer_shard_floats(t)), &rows);
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
  if (!s->g) return; /* no gossip member: nothing to publish or donate */
  double now = clock_now_s();
  if (gossip_stats_wanted(s->g)) publish_stats(s, now, true);
  else if (now - s->stats_s >= 1.0) publish_stats(s, now, false);
  donate(s, now);
}

void sync_hold_state(struct sync *s, bool on) { s->hold_state = on; }

int sync_boundary(struct sync *s, struct rumor_err *e) {
  int rc = s->scheme->boundary ? s->scheme->boundary(s, e) : 0;
  sync_idle(s);
  return rc;
}

int sync_join(struct sync *s, struct rumor_err *e) { return s->scheme->join ? s->scheme->join(s, e) : 0; }

int sync_start(struct sync *s, struct rumor_err *e) {
  /* Only an outer scheme's boundary can be due before a step: the others
   * act on a schedule of steps taken from now on. */
  if (s->cfg.outer.kind == OUTER_NONE || !s->scheme->boundary) return 0;
  return s->scheme->boundary(s, e);
}

int sync_finish(struct sync *s, const struct sync_finish_args *f, struct rumor_err *e) {
  return s->scheme->finish ? s->scheme->finish(s, f, e) : 0;
}

void sync_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  s->scheme->result(s, gs, o);
  json_text_set(o, "sync", json_string(s->scheme->name));
  uint64_t in = gs->bytes_in, out = gs->bytes_out;
  if (s->scheme->own_bytes) s->scheme->own_bytes(s, &in, &out);
  json_text_set(o, "bytes_out", json_integer((json_int_t)out));
  json_text_set(o, "bytes_in", json_integer((json_int_t)in));
  /* Of those, what ran over relays (in + out), and the relay we were reached through. */
  json_text_set(o, "relayed_bytes", json_integer((json_int_t)gs->relayed_bytes));
  json_text_set(o, "relay_via", json_text_str(gs->via));
}

void sync_figures(const struct sync *s, struct sync_figures *out) {
  *out = (struct sync_figures){.applied = s->x.applied,
                               .rejected = s->x.rejected,
                               .clipped = s->x.clip.clipped,
                               .skipped = s->x.skipped,
                               .holds = s->avg.holds,
                               .hold_timeouts = s->avg.hold_timeouts,
                               .ring_rounds = s->ring.rounds,
                               .ring_retries = s->ring.retries,
                               .ring_catchups = s->ring.catchups,
                               .outer_rounds = s->outer.rounds,
                               .outer_alone = s->outer.alone,
                               .outer_norm = s->outer.last_norm,
                               .outer_bytes = s->outer.last_bytes,
                               .outer_wait_s = s->outer.wait_s};
}

int sync_config_check(const struct sync_config *c, struct rumor_err *e) {
  const struct outer_config *o = &c->outer;
  if (o->kind == OUTER_NONE) return 0;
  if (c->kind == SYNC_PS)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--outer is for --sync allreduce (DiLoCo) or --sync gossip (NoLoCo), not --sync ps");
  if (o->overlap_steps && (!o->overlap || c->kind != SYNC_ALLREDUCE || o->overlap_steps > o->local_steps))
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--outer-overlap-steps %lld: it sets when an overlapped DiLoCo round lands, so it needs "
                         "--outer-overlap and --sync allreduce, and at most --local-steps (%lld)",
                         (long long)o->overlap_steps, (long long)o->local_steps);
  if (c->kind == SYNC_GOSSIP && o->compress.kind == CODEC_TOPK)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--outer-compress topk compresses DiLoCo's pseudo-gradients (--sync allreduce); NoLoCo "
                         "(--sync gossip) sends parameters, which take f16 or i8");
  return 0;
}
