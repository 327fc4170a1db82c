/* `--sync gossip`: averaging exchanges with random partners (sync.h,
 * "Applying"), the drift bound's holds and the finish wait. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

/* After an exchange we asked for applied nothing (no partner free, refused,
 * failed), the next is asked for no sooner than this, doubling up to the
 * maximum, whatever the schedule: a peer that steps a thousand times a
 * second, or holds and polls every 200 µs, must not flood its partners with
 * requests (they would rate-limit an honest peer). */
#define RETRY_MIN_S 0.002
#define RETRY_MAX_S 0.02

/* Follows the exchange we asked for to its end, and paces the next. */
static void pace(struct sync *s, double now) {
  struct sync_avg *a = &s->avg;
  if (!a->asked || gossip_xch_in_flight(s->g)) return;
  a->asked = false;
  if (s->x.applied > a->applied_at_ask) {
    a->failed_asks = 0;
    return;
  }
  a->failed_asks++;
  double wait = RETRY_MIN_S * (double)(1u << (a->failed_asks < 7 ? a->failed_asks - 1 : 6));
  a->next_ask_s = now + (wait < RETRY_MAX_S ? wait : RETRY_MAX_S);
}

/* θ + w·(θ'_s − θ_s) (sync.h, "Applying"): the difference is in the
 * partner's buffer already (gossip_xch_theirs). */
static void apply(struct sync *s, const struct gossip_xch_turn *turn) {
  struct trainer *t = s->t;
  char why[200];
  float w;
  int rc = sync_xch_judge(s, turn, turn->alpha, &w, why, sizeof why);
  if (rc == 0) {
    struct tensor params = trainer_shard_params(t);
    tensor_axpby(w, sync_xch_delta_dev(s), 1.0f, &params);
    s->changes++;
    int64_t run = t->st.step - s->avg.mix_step;
    if (run > s->avg.longest_local) s->avg.longest_local = run;
    s->avg.mix_step = t->st.step;
  }
  sync_xch_done(s, rc, why);
  /* The slot is idle again: a snapshot for the next request. */
  struct gossip_xch_turn again;
  bool started;
  sync_xch_turn(s, false, &again, &started);
}

static void exchange(struct sync *s) {
  struct trainer *t = s->t;
  struct sync_avg *a = &s->avg;
  double now = clock_now_s();
  pace(s, now);
  bool want = a->holding || (s->cfg.every_steps > 0 && t->st.step % s->cfg.every_steps == 0) ||
              (s->cfg.every_s > 0 && now - s->x.last_start_s >= s->cfg.every_s);
  want = want && !a->asked && now >= a->next_ask_s;
  struct gossip_xch_turn turn;
  bool copy_started;
  sync_xch_turn(s, want, &turn, &copy_started);
  if (turn.started) {
    a->asked = true;
    a->applied_at_ask = s->x.applied;
  }
  if (copy_started) s->x.last_start_s = now;
  if (turn.work == GOSSIP_XCH_APPLY) apply(s, &turn);
}

/* With max_local_steps > 0: when that many steps have passed since the
 * last applied exchange and some partner is alive, keeps exchanging (and
 * serving donations) without training until an exchange applies, a stop,
 * or max_hold_s passes (then training goes on: a cluster whose exchanges
 * all fail must not stop, and after such a timeout the next hold waits
 * N·2^k steps, k the timeouts in a row). */
static void hold(struct sync *s) {
  struct sync_avg *a = &s->avg;
  int64_t step = s->t->st.step;
  if (s->cfg.max_local_steps <= 0 || step - a->mix_step < s->cfg.max_local_steps || step < a->hold_resume_step)
    return;
  if (gossip_live_partners(s->g) == 0) return; /* alone: nobody to mix with */
  double t0 = clock_now_s();
  uint64_t applied = s->x.applied;
  unsigned polls = 0;
  a->holding = true;
  a->holds++;
  while (s->x.applied == applied && !sync_stopped(s)) {
    if (clock_now_s() - t0 >= s->cfg.max_hold_s) {
      /* Exchanges keep failing (partners backed off, busy or gone): train
       * on, and hold again only after N·2^k more steps (k: holds in a row
       * that gave up, at most 10), so a cluster that cannot mix is slowed
       * by a vanishing fraction, not stopped. */
      a->hold_timeouts++;
      a->hold_failures_in_row++;
      int k = a->hold_failures_in_row < 10 ? a->hold_failures_in_row : 10;
      a->hold_resume_step = step + (s->cfg.max_local_steps << k);
      log_info("no exchange applied after %lld steps and %.2f s of holding: training on; next hold after step %lld",
               (long long)(step - a->mix_step), s->cfg.max_hold_s, (long long)a->hold_resume_step);
      break;
    }
    const struct timespec tick = {0, 200 * 1000};
    nanosleep(&tick, NULL);
    exchange(s); /* asks for exchanges, paced (above) */
    sync_idle(s);
    if (++polls % 25 == 0 && gossip_live_partners(s->g) == 0) break; /* the others left */
  }
  a->holding = false;
  if (s->x.applied != applied) a->hold_failures_in_row = 0;
  a->hold_s += clock_now_s() - t0;
}

static int avg_boundary(struct sync *s, struct rumor_err *e) {
  (void)e;
  exchange(s);
  hold(s);
  return 0;
}

/* The exchange schedule while finishing: every_steps of our own mean
 * step time (`step_s`), or the interval, whichever comes first; at least
 * FINISH_MIN_INTERVAL_S apart. */
#define FINISH_MIN_INTERVAL_S 1e-3
/* Once no partner trains: leave when the latest exchanges in a row came
 * from FINISH_QUIET_CLOSE different partners (or every live one, when
 * fewer) each close to our parameters (finish_close_rel), or after
 * FINISH_QUIET_MAX exchanges. Different partners: two peers that meet
 * twice are equal after the first, however far the rest are; and with 2,
 * three of four peers that met each other close left the fourth 0.048
 * apart (test_peer_gossip under the full suite's load): with 4, a cluster
 * of up to five peers leaves only once each met every other close. */
#define FINISH_QUIET_CLOSE 4
#define FINISH_QUIET_MAX 16

/* "Close", relative to our norm: 1e-3, or where the wire rounds the
 * snapshots coarser, about twice what its rounding leaves between two
 * equal replicas (bf16's 2^-8 per value; i8's scale per 128 values, about
 * 0.7 % of the values' spread), so that a lossy wire can end early too. */
static double finish_close_rel(enum net_dtype wire) {
  switch (wire) {
  case NET_DTYPE_BF16: return 1e-2;
  case NET_DTYPE_I8: return 3e-2;
  default: return 1e-3; /* f32, and f16 (2^-11) */
  }
}
static double finish_interval(const struct sync_config *c, double step_s) {
  double by_steps = c->every_steps > 0 ? step_s * (double)c->every_steps : 0;
  double every = c->every_s > 0 && (by_steps == 0 || c->every_s < by_steps) ? c->every_s : by_steps;
  return every > FINISH_MIN_INTERVAL_S ? every : FINISH_MIN_INTERVAL_S;
}

/* The finish's count once no partner trains: exchanges applied since, and
 * the different partners of the latest ones in a row that were close. */
struct finish_quiet {
  bool quiet;
  uint64_t seen, applied;
  int close;
  uint8_t close_ids[FINISH_QUIET_CLOSE][CLIP_ID_BYTES];
};

/* Notes the latest applied exchange (when several applied since the last
 * look only the latest is known, and it counts once). */
static void finish_note(struct finish_quiet *q, const struct sync_xch *x, double close_rel) {
  if (!(x->applied_rel_dist <= close_rel)) {
    q->close = 0;
    return;
  }
  for (int i = 0; i < q->close; i++)
    if (memcmp(q->close_ids[i], x->applied_partner, CLIP_ID_BYTES) == 0) return;
  if (q->close < FINISH_QUIET_CLOSE) memcpy(q->close_ids[q->close++], x->applied_partner, CLIP_ID_BYTES);
}

/* Follows the exchanges applied since the last call; true when we may
 * leave: nobody trains and the replicas we meet are close, or enough
 * exchanges went by, or nobody is left at all. A partner seen training
 * again (back from suspect) starts the count over. */
static bool finish_settled(struct sync *s, struct finish_quiet *q) {
  bool nobody = gossip_training_partners(s->g) == 0;
  if (nobody && !q->quiet) q->applied = 0, q->close = 0;
  q->quiet = nobody;
  uint64_t now = s->x.applied;
  if (q->quiet && now > q->seen) {
    q->applied += now - q->seen;
    finish_note(q, &s->x, finish_close_rel(s->cfg.wire));
  }
  q->seen = now;
  if (!q->quiet) return false;
  int live = (int)gossip_live_partners(s->g);
  int want = live < FINISH_QUIET_CLOSE ? live : FINISH_QUIET_CLOSE;
  return live == 0 || q->close >= want || q->applied >= FINISH_QUIET_MAX;
}

/* --finish-wait-ms, after the last step: tells partners we finished
 * (gossip_finished) and keeps exchanging without training, about as often
 * as while training, until no live partner is still training (each has
 * told us it finished, or left) and the replicas we meet are close
 * (finish_settled), a stop, or max_s passes. Partners that train on are
 * then not left without anyone to average with for their last steps, and
 * the replicas end close together. */
static int avg_finish(struct sync *s, const struct sync_finish_args *f, struct rumor_err *e) {
  if (f->max_s <= 0) return 0;
  log_info("averaging with partners that still train, for at most %.1f s (--finish-wait-ms)", f->max_s);
  gossip_finished(s->g);
  struct sync_config saved = s->cfg;
  double t0 = clock_now_s();
  uint64_t applied = s->x.applied;
  /* Exchanges on the time schedule only: the step does not move. */
  double every = finish_interval(&saved, f->step_s);
  s->cfg.every_steps = 0;
  const char *why = "stopped";
  int rc = 0;
  struct finish_quiet q = {.seen = s->x.applied};
  while (!(f->stop && atomic_load(f->stop))) {
    /* Once settled no new exchange of ours, and the one under way ends
     * before we leave (a partner may still take our ready snapshot
     * meanwhile: it moves towards our final state, we do not move). */
    bool done = finish_settled(s, &q);
    s->cfg.every_s = done ? 0 : every;
    if (done) {
      why = "no partner is still training";
      if (!gossip_xch_in_flight(s->g)) break;
    }
    if (clock_now_s() - t0 >= f->max_s) {
      why = "--finish-wait-ms passed";
      break;
    }
    if (f->failed && f->failed(f->arg, e)) {
      why = e->msg;
      rc = RUMOR_ECANCELED;
      break;
    }
    const struct timespec tick = {0, 1000 * 1000};
    nanosleep(&tick, NULL);
    exchange(s);
    sync_idle(s);
  }
  s->cfg = saved;
  s->avg.finish_s = clock_now_s() - t0;
  s->avg.finish_applied = s->x.applied - applied;
  char last[64] = "";
  if (s->avg.finish_applied > 0)
    snprintf(last, sizeof last, ", the last from a partner %.3g apart (relative)", s->x.applied_rel_dist);
  log_info("finished waiting after %.2f s (%s): %llu exchanges applied meanwhile%s", s->avg.finish_s, why,
           (unsigned long long)s->avg.finish_applied, last);
  return rc;
}

static void avg_plan(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out) {
  *out = (struct sync_gossip_plan){.protocol = GOSSIP_SYNC_GOSSIP, .buf_floats = (uint64_t)nparams, .wire = c->wire};
}

static int avg_init(struct sync *s, struct rumor_err *e) {
  s->avg.mix_step = s->t->st.step;
  return sync_xch_init(s, true, e);
}

static void avg_free(struct sync *s) { sync_xch_free(s); }

/* The exchange figures: exchanges (applied), _failed, _rejected, _clipped,
 * _skipped, requests, refusals, idle, rate limits, holds. */
static void avg_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  const struct {
    const char *key;
    uint64_t v;
  } counts[] = {
      {"exchanges", gs->exchanges_ok},
      {"exchanges_failed", gs->exchanges_failed},
      {"exchanges_rejected", gs->exchanges_rejected},
      {"exchange_requests", gs->exchange_requests},
      {"exchange_refusals", gs->exchange_refusals},
      {"exchange_idle", gs->exchange_idle},
      {"exchanges_clipped", s->x.clip.clipped},
      {"exchanges_skipped", s->x.skipped},
      {"exchange_rate_limited", gs->exchange_rate_limited},
      {"conn_rate_limited", gs->conn_rate_limited},
      {"holds", s->avg.holds},
      {"hold_timeouts", s->avg.hold_timeouts},
  };
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++)
    json_text_set(o, counts[i].key, json_integer((json_int_t)counts[i].v));
  json_text_set(o, "longest_local_steps", json_integer(s->avg.longest_local));
  json_text_set(o, "hold_s", json_text_real(s->avg.hold_s));
  json_text_set(o, "finish_wait_s", json_text_real(s->avg.finish_s));
  json_text_set(o, "finish_exchanges", json_integer((json_int_t)s->avg.finish_applied));
}

const struct sync_scheme sync_scheme_gossip = {
    .name = "gossip",
    .plan = avg_plan,
    .init = avg_init,
    .boundary = avg_boundary,
    .finish = avg_finish,
    .result = avg_result,
    .free = avg_free,
};
