/*
 * sync — the training thread's side of gossip, one implementation for whole
 * replicas and for pipeline stages: at each step boundary it starts
 * exchanges on schedule, takes snapshots (asynchronously on a GPU),
 * validates, clips and applies a partner's parameters, fills state
 * donations, publishes monitoring figures, and (bounded drift) holds
 * training until an exchange applies.
 *
 * A stage of a peer group runs the same path over its slice of the
 * parameters: its gossip runtime's model label names the model, the split
 * and the stage (train_stage_label), so it meets only the same stage of
 * other groups, and stage s averages its slice with stage s elsewhere.
 * Between step boundaries (while a pipeline waits for a neighbour)
 * sync_idle serves donations and figures only: parameters and optimizer
 * state do not change during a step, so a donation there is the state at
 * the step's start.
 *
 * Applying: both sides took their snapshots (θ_s ours, θ'_s the partner's)
 * at step boundaries before the transfer and apply at a later one, after
 * steps of their own. The partner's must be finite and within
 * `max_distance` × ‖θ_s‖ of ours (‖θ'_s − θ_s‖ ≤ R·‖θ_s‖), else it is
 * rejected with a log line and the sender is backed off; an accepted one
 * moves us by the snapshots' difference: θ ← θ + α·(θ'_s − θ_s), or with
 * clipping (below) θ ← θ + α·clip(θ'_s − θ_s, τ). The steps taken since our
 * snapshot are kept, and when both sides apply with the same weight (no
 * clipping scale, skip or rejection on either side) the pair's sum of
 * parameters does not change (the partner adds the opposite). Averaging
 * with the current parameters instead, θ ← θ + α·(θ'_s − θ), pulls each
 * side back by α of the steps it took since the partner's snapshot:
 * measured on the README job (4 peers) 0.8914 → 0.8936 mean accuracy (two
 * rounds each), and on 4 GPT peers with AdamW +0.058 → +0.051 and +0.054
 * from one process (docs/benchmarks.md). The difference θ'_s − θ_s and its
 * statistics are computed on the host in one pass, off the training thread
 * (gossip_xch_theirs, gossip_xch_delta), so the training thread only adds
 * it: one axpby, after a copy to the device on a GPU.
 *
 * Monitoring: cheap figures (step, loss, throughput) are published about
 * once a second; the O(P) ones (parameter norm, count-sketch, on the
 * training device) only when a monitor asked for them.
 *
 * Threads: the training thread only.
 */
#ifndef RUMOR_PEER_SYNC_H
#define RUMOR_PEER_SYNC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "gossip/gossip.h"
#include "peer/train/train.h"

/* ============================================================================
 * Clipping
 * ========================================================================== */

/*
 * Clipped gossip averaging (self-centred clipping, He, Karimireddy
 * and Jaggi 2022): instead of x ← x + α·(x_j − x), a peer applies
 *
 *   x ← x + α·clip(x_j − x, τ),   clip(d, τ) = d·min(1, τ/‖d‖),
 *
 * (x and x_j here are the two snapshots exchanged, "Applying" above),
 *
 * so one exchange moves it by at most α·τ whatever the partner sent. A
 * Byzantine partner (a valid key, poisoned parameters that pass the other
 * checks, such as a sign-flipped model) then shifts an honest replica by a
 * bounded amount per exchange, while honest partners, whose distances are
 * about τ or below, are averaged with as before.
 *
 * τ is fixed (--clip-tau) or adaptive (the default): CLIP_TAU_MEDIANS times
 * the median, over the partners met in the last CLIP_RECENT exchanges, of
 * each one's latest non-zero distance (the median taken as at least
 * CLIP_FLOOR_REL times our norm). Each partner counts once however often it
 * exchanges, so while fewer than half of a peer's partners are Byzantine the
 * median is an honest distance (a median over exchanges would not be: a fast
 * attacker can be most of one peer's exchanges for a while, and then sets τ
 * itself). Distances of 0 (partners equal to us while the cluster
 * assembles) are not recorded: they would pin τ to its floor when training
 * starts. While fewer than CLIP_WARMUP partners are known, τ is also at most
 * CLIP_WARMUP_REL times our own parameter norm, so the first exchanges
 * cannot be hijacked either. Once CLIP_WARMUP partners have been met, the
 * median always counts at least CLIP_WARMUP of them: while fewer were met
 * in the last CLIP_RECENT exchanges, the most recently met of the others
 * fill up the count. Otherwise a single partner that exchanges with us
 * hundreds of times (an attacker asking as fast as the rate limit allows,
 * or the last partner left at the end of a run) ages every other partner
 * out, puts us back in the warm-up, where nothing is an outlier, and pulls
 * us by α·τ each time: seen in the replay test, where the last peer still
 * training was dragged from a loss of 0.31 back to 0.74 in its last epoch.
 *
 * Past the warm-up, a distance above CLIP_OUTLIER times the median marks an
 * outlier, which the caller skips: honest partners are mostly under 3
 * medians (about 1 % of honest updates skipped), a sign-flipped model 2.5
 * to 2000, mostly above 3. Clipping alone
 * lets an attacker push a victim by α·τ every time, and once the victim has
 * drifted its own τ grows with it (its partners are all far): a run-away
 * seen in tests as the learning rate decays. Skipping outliers stops that,
 * and cannot lock an honest peer out: one that drifted sees every partner
 * far, so its τ is large and it applies their updates and catches up, while
 * they skip its updates meanwhile. τ at twice the median leaves most honest
 * updates whole (at one median, half were clipped, which slowed peers that
 * had run ahead: accuracy 0.81 to 0.87 in a benign 8-peer run, against
 * 0.86 to 0.875 now and 0.871 to 0.873 without clipping); outliers at 3
 * medians rather than 4 kept honest peers at 0.869 instead of 0.857 with a
 * sign-flipping attacker.
 *
 * Pure bookkeeping on scalars; the caller does the averaging in one op
 * (an axpby of the difference with weight α·scale). Training thread.
 */

#define CLIP_PARTNERS 64     /* partners remembered (the least recent is replaced) */
#define CLIP_RECENT 200      /* a partner counts while met within this many exchanges */
#define CLIP_WARMUP 3
#define CLIP_WARMUP_REL 0.1
#define CLIP_FLOOR_REL 1e-2  /* the median is taken as at least this times our norm */
#define CLIP_TAU_MEDIANS 2.0 /* adaptive τ: this many times the median distance */
#define CLIP_OUTLIER 3.0     /* distance > CLIP_OUTLIER·median (adaptive τ, after warm-up): skipped */
#define CLIP_ID_BYTES 32

struct clip_state {
  double tau_fixed; /* > 0: fixed τ; 0: adaptive */
  struct clip_partner {
    uint8_t id[CLIP_ID_BYTES];
    double dist;   /* its latest distance */
    uint64_t seen; /* exchange number when it was met last */
  } p[CLIP_PARTNERS];
  int n;
  double last_tau;  /* the τ of the last call */
  bool last_outlier; /* the last distance was an outlier (the caller skips it) */
  uint64_t seen, clipped;
};

void clip_init(struct clip_state *c, double tau_fixed);
/* Records the distance ‖x_j − x‖ to partner `id` (CLIP_ID_BYTES) and returns
 * the factor s = min(1, τ/dist) ∈ [0, 1] by which to scale the averaging
 * weight. `norm` is ‖x‖ (for the warm-up bound). A NaN or infinite distance
 * gives 0 and marks an outlier. */
double clip_scale(struct clip_state *c, const uint8_t *id, double dist, double norm);

/* ============================================================================
 * The sync path
 * ========================================================================== */

/* Targets (samples of an MLP, tokens of a language model) used to check a
 * donated or received state's loss (whole replicas): SYNC_CHECK_TARGETS,
 * or fewer for a large model so that the check costs about
 * SYNC_CHECK_MACS multiply-adds (a newcomer waits for the donor's check
 * and then runs its own: 8192 samples of a 54 M-parameter MLP took 20 s on
 * one core each). Donor and newcomer call it with the same model, so they
 * check the same targets. */
#define SYNC_CHECK_TARGETS 8192
#define SYNC_CHECK_MACS (1ll << 33)
int64_t sync_check_targets(int64_t nparams);

/* A state pulled from another member (a newcomer's donation, an all-reduce
 * member's catch-up) is taken only when its loss on the check rows is
 * finite and at most sync_pull_max_loss(ours), ours being that of the
 * state we would keep (a newcomer's own initialisation, a member's own
 * trained state): twice it, or SYNC_PULL_LOSS_SLACK above it when that is
 * more (a trained loss near zero doubles on noise). A broken or hostile
 * member (a valid key, a state of garbage) must not replace ours. After
 * SYNC_PULL_ASKS refused states the puller stops asking. */
#define SYNC_PULL_MAX_LOSS_RATIO 2.0
#define SYNC_PULL_LOSS_SLACK 0.5 /* nats per target */
#define SYNC_PULL_ASKS 2
double sync_pull_max_loss(double own_loss);

struct sync_config {
  int64_t every_steps;  /* start an exchange every N steps (0: off) */
  double every_s;       /* ... or every T seconds (0: off) */
  double max_distance;  /* R, relative to our parameter norm */
  bool clip;            /* clipped averaging (above) */
  double clip_tau;      /* its fixed τ (0: adaptive) */
  /* Bounded drift: after this many steps without an applied exchange,
   * sync_hold holds training until one applies, at most max_hold_s at a
   * time (0: never hold; training never waits for the network). */
  int64_t max_local_steps;
  double max_hold_s;
  /* --sync allreduce: no exchanges; every step's gradient is summed over
   * the ring (sync_allreduce) instead. */
  bool allreduce;
  const atomic_int *stop; /* polled while a round waits; may be NULL */
};

struct sync {
  struct sync_config cfg;
  gossip_t *g;
  struct trainer *t;
  struct tensor staging; /* (P): the partner's snapshot minus ours, on our device
                          * (tensor_mirror_host of the receive buffer: the buffer
                          * itself on the CPU) */
  /* The copy of our parameters into gossip_xch_mine() in flight (finished
   * at a later boundary on a GPU): for an exchange (GOSSIP_XCH_SNAPSHOT) or
   * to keep a snapshot ready for partners' requests (refresh). */
  tensor_event_t snap_ev;
  /* On a GPU, the snapshot's copy on the device: the boundary copies the
   * parameters here (device to device, fast, on the training stream) and
   * this to gossip_xch_mine() beside the stream (tensor_copy_to_host_beside),
   * so that the next steps do not wait for the transfer to the host.
   * Unallocated (data NULL) on the CPU, or when the device had no room. */
  struct tensor snap_dev;
  bool snap_pending, snap_refresh;
  int64_t snap_step;
  int64_t refreshed_step; /* of the last refresh begun; -1 after an apply */
  double last_start_s;
  uint64_t applied, rejected;
  uint64_t skipped;         /* of the rejected: far outliers skipped by clipping */
  int64_t mix_step;         /* step of the last applied exchange (or of the start) */
  int64_t longest_local;    /* most steps between applied exchanges seen */
  bool holding;             /* in sync_hold: ask for an exchange whatever the schedule */
  /* Pacing (sync.c): the exchange we asked for, followed to its end; after
   * one that applied nothing, no new one before next_ask_s. */
  bool asked;
  uint64_t applied_at_ask;
  unsigned failed_asks;
  double next_ask_s;
  uint64_t holds, hold_timeouts;
  int hold_failures_in_row;
  int64_t hold_resume_step; /* no hold before this step (after holds that gave up) */
  double hold_s;            /* total time held */
  double finish_s;          /* sync_finish: time spent after the last step */
  uint64_t finish_applied;  /* ... and exchanges applied meanwhile */
  struct clip_state clip;
  double last_dist, last_norm; /* of the partner's parameters being validated */

  /* Monitoring figures (gossip_stats_publish). */
  double *sketch;          /* gossip_sketch_k doubles */
  double stats_s;          /* when cheap figures were last published */
  double rate_s;           /* start of the current throughput window */
  int64_t rate_samples;
  double samples_per_s;
  double param_norm;       /* at the last sketch */

  /* All-reduce (cfg.allreduce). */
  uint64_t ar_rounds, ar_retries, ar_catchups, ar_skipped;
  double ar_wait_s;        /* time in rounds, from the start of the first attempt to the sum */
  size_t ar_members;       /* in the last round's ring */
};

int sync_init(struct sync *s, gossip_t *g, struct trainer *t, const struct sync_config *cfg,
              struct rumor_err *e) RUMOR_MUST_CHECK;
/* Does whatever gossip needs at this step boundary (exchanges, donations,
 * monitoring figures); never waits on the network. */
void sync_boundary(struct sync *s);
/* Donations and figures only, for the middle of a step; `arg` is the sync.
 * Suits stage_link_set_idle. */
void sync_idle(void *arg);
/* With cfg.max_local_steps > 0: when that many steps have passed since the
 * last applied exchange and some partner is alive, keeps exchanging (and
 * serving donations) without training until an exchange applies, `*stop`
 * becomes non-zero, or cfg.max_hold_s passes (then training goes on: a
 * cluster whose exchanges all fail must not stop, and after such a timeout
 * the next hold waits N·2^k steps, k the timeouts in a row). Call after
 * sync_boundary. */
void sync_hold(struct sync *s, const atomic_int *stop);
/* The end of a run (rumor peer --finish-wait-ms), after the last step:
 * tells partners we finished (gossip_finished) and keeps exchanging without
 * training, about as often as while training (every_steps of `step_s`, our
 * mean step time in seconds, or the interval), until no live partner is
 * still training (each has told us it finished, or left) and two more
 * exchanges applied after that (sync.c), `*stop` becomes non-zero, or
 * `max_s` passes. Partners that train on are then not left without anyone
 * to average with for their last steps, and the replicas end close
 * together. finish_s and finish_applied say what it took. `failed` (may be
 * NULL) is polled too: when it returns true (with its message in `e`; a
 * stage's pipeline neighbour failed, say), the wait ends at once and
 * sync_finish returns RUMOR_ECANCELED; otherwise 0. */
int sync_finish(struct sync *s, double step_s, double max_s, const atomic_int *stop,
                bool (*failed)(void *arg, struct rumor_err *e), void *arg, struct rumor_err *e);
void sync_free(struct sync *s);

/* The train_reducer of --sync allreduce (`arg` is the sync): sums the
 * step's gradient, weighted by rows, over the ring and leaves the mean over
 * every member's rows in model.grads (returns 0). While a round is under
 * way it serves donations and figures; a failed round is tried again with
 * the ring re-formed from the membership; a member left behind takes the
 * state of one ahead and drops its step (returns 1); a sum that is not
 * finite is dropped on every member alike (returns 1, the step counted).
 * Whole replicas only. */
int sync_allreduce(void *arg, int64_t rows, struct rumor_err *e);

#endif /* RUMOR_PEER_SYNC_H */
