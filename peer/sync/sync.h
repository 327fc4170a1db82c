/*
 * sync — how a member keeps its replica together with the others: one
 * interface (struct sync_scheme), one implementation per scheme, chosen in
 * one place (sync_scheme_of) from `--sync` and `--outer`:
 *
 *   gossip     averaging exchanges with random partners   average.c
 *   allreduce  ring all-reduce of every step's gradient    allreduce.c
 *   diloco     --sync allreduce --outer K: outer rounds    diloco.c
 *   noloco     --sync gossip --outer K: pairwise rounds    noloco.c
 *
 *   ps         a worker of parameter servers            peer/ps/ps_scheme.c
 *
 * (A whole replica's `--sync ps` worker joins no gossip cluster and runs
 * the scheme without a gossip runtime, g NULL: cmd_ps.c.) The same path
 * serves a whole replica
 * and a pipeline stage: a stage's gossip label names the model, the split
 * and the stage (train_stage_label), so it meets only the same stage of
 * other groups, over its own slice of the parameters.
 *
 * What every scheme shares lives in sync.c: the scheme table, the
 * monitoring figures it publishes, state donations (checked by the one
 * pull policy, sync_pull_take) and sync_idle, which serves both in the
 * middle of a step (while a pipeline waits for a neighbour) or while a
 * scheme waits on the network. The training side of the exchange slot
 * (snapshots, validation, clipping) is exchange.c, shared by gossip
 * averaging and NoLoCo; a ring round with its retries and catch-up is
 * allreduce.c's, shared by the gradient all-reduce and DiLoCo; the outer
 * optimizer's state and update are outer.c's.
 *
 * Applying an exchange (average.c): both sides took their snapshots (θ_s
 * ours, θ'_s the partner's) at step boundaries before the transfer and
 * apply at a later one, after steps of their own. The partner's must be
 * finite and within `max_distance` × ‖θ_s‖ of ours (‖θ'_s − θ_s‖ ≤
 * R·‖θ_s‖), else it is rejected with a log line and the sender is backed
 * off; an accepted one moves us by the snapshots' difference: θ ← θ +
 * α·(θ'_s − θ_s), or with clipping (below) θ ← θ + α·clip(θ'_s − θ_s, τ).
 * The steps taken since our snapshot are kept, and when both sides apply
 * with the same weight the pair's sum of parameters does not change.
 * Averaging with the current parameters instead, θ ← θ + α·(θ'_s − θ),
 * pulls each side back by α of the steps it took since the partner's
 * snapshot: measured on the README job (4 peers) 0.8914 → 0.8936 mean
 * accuracy, and on 4 GPT peers with AdamW +0.058 → +0.051 and +0.054 from
 * one process (docs/benchmarks.md). The difference θ'_s − θ_s and its
 * statistics are computed on the host in one pass, off the training thread
 * (gossip_xch_theirs, gossip_xch_delta), so the training thread only adds
 * it: one axpby, after a copy to the device on a GPU.
 *
 * Monitoring: cheap figures (step, loss, throughput, the outer round) are
 * published about once a second; the O(P) ones (parameter norm,
 * count-sketch, on the training device) only when a monitor asked for them.
 *
 * Threads: the training thread only.
 */
#ifndef RUMOR_PEER_SYNC_H
#define RUMOR_PEER_SYNC_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "gossip/gossip.h"
#include "peer/sync/codec.h"
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
 * Outer optimizers (DiLoCo over the ring, NoLoCo over gossip)
 * ========================================================================== */

/*
 * `--outer sgd|nesterov` with `--local-steps H`: every H inner steps (the
 * inner optimizer and its schedule as given: AdamW or SGD) a member ends an
 * outer round. Its pseudo-gradient is Δ = θ − φ, θ the anchor (the
 * parameters every member started the round from) and φ its parameters
 * now. The outer step turns an averaged pseudo-gradient g into
 *
 *   sgd:       b ← μ·b + g;  θ ← θ − η·b           (heavy ball; μ 0: plain
 *                                                    periodic averaging at η 1)
 *   nesterov:  b ← μ·b + g;  θ ← θ − η·(g + μ·b)   (torch.optim.SGD's Nesterov)
 *
 * (η --outer-lr, μ --outer-momentum), and the parameters restart from the
 * new anchor, φ ← θ. The inner optimizer's state carries on.
 *
 * DiLoCo (Douillard et al. 2023), `--sync allreduce`: g is the mean of
 * every member's Δ, summed over the elastic ring (the members of a round's
 * ring, each weighing the same); every member holds the same anchor and applies the
 * same g, so they stay identical at round ends, and a run ends with an
 * outer round (members finish with identical parameters). Between data-
 * or tensor-parallel groups each process runs its shard's rounds with the
 * same shard of the other groups; one that a ring leaves behind takes only
 * the round's outer state and a donor's step (allreduce.c), and its group
 * goes on from the largest step any of its processes took.
 *
 * NoLoCo (Kolehmainen et al. 2025, arXiv:2506.10911; the rule of the
 * authors' code, github.com/jkolehm/noloco, src/noloco/sparse_optimizer_c.py,
 * groups of two): after H inner steps a member exchanges with one random
 * partner j and its momentum takes the pair's mean pseudo-gradient plus the
 * pull towards the pair's mean anchor, both at the outer rate:
 *
 *   g_i = (Δ_i + Δ_j)/2 − ((θ_i + θ_j)/2 − θ_i)
 *
 * which simplifies to g_i = θ_i − (φ_i + φ_j)/2: the anchors cancel, so a
 * member sends only its parameters φ, exactly what a gossip exchange
 * sends (the partner's arrives as φ_j − φ_i). No collective: nobody waits
 * for more than one partner. Without a partner within --max-hold-ms, or
 * when the partner's parameters are rejected, the round's update is its
 * own: g_i = Δ_i. Anchors differ between members; the pull keeps them
 * together.
 *
 * --outer-overlap (one-round-delayed outer step, as Streaming DiLoCo's
 * and Psyche's): the communication of round k runs beside round k+1's inner
 * steps, and its update is applied at the next boundary, keeping the inner
 * progress made meanwhile: φ ← θ' + (φ − φ_k). Training waits for the
 * network only when a round is still in flight when the next is due
 * (outer_wait_s). With --outer-overlap-steps τ < H (DiLoCo) the round lands
 * τ steps after its boundary instead, by the same rule: the network has τ
 * steps of compute to hide behind, and the members drift apart for τ
 * steps rather than a whole round (measured: docs/benchmarks.md).
 *
 * --outer-compress (DiLoCo): f16 and i8 change the ring's encoding (each
 * hop re-encodes its partial sum: INTELLECT-1's int8 all-reduce);
 * topk:F:BITS makes the round an all-gather of every member's top-k
 * encoding (peer/sync/codec.h) with error feedback, as SparseLoCo (Sarfi et
 * al. 2025, arXiv:2508.15706): a member accumulates e ← μ·e + Δ, sends the
 * top-k of e and keeps the rest, e ← e − sent, and the outer step is a
 * plain θ ← θ − η·mean(sent): the decaying accumulator stands for the
 * outer momentum (--outer sgd and nesterov alike). NoLoCo sends parameters, not
 * pseudo-gradients: f16 and i8 set the exchange's encoding; top-k does not
 * apply and is refused.
 *
 * The outer state (anchor, momentum, rounds, and the residual and the round
 * in flight where they exist) is kept with the model (train_config.extra):
 * in checkpoints (resumed bit for bit), and in donated states, checked
 * like the rest. With --outer-overlap a full state is donated only at a
 * round boundary, after the round in flight was applied: a state taken in
 * the middle of a round would lack that round's update.
 */

/* Defaults of --local-steps, --outer-lr and --outer-momentum, chosen by
 * measurement (docs/benchmarks.md, "Low-communication training"). */
#define OUTER_DEFAULT_LOCAL_STEPS 50
#define OUTER_DEFAULT_LR 1.0
#define OUTER_DEFAULT_MOMENTUM 0.5

enum sync_kind { SYNC_GOSSIP = 0, SYNC_ALLREDUCE = 1, SYNC_PS = 2 };
enum outer_kind { OUTER_NONE = 0, OUTER_SGD = 1, OUTER_NESTEROV = 2 };

struct outer_config {
  enum outer_kind kind;
  int64_t local_steps;  /* H: inner steps per outer round */
  double lr, momentum;  /* η, μ */
  struct codec compress;
  bool overlap;
  /* --outer-overlap-steps τ (DiLoCo): a round lands τ inner steps after
   * the boundary that started it, 1 ≤ τ ≤ H; 0 means H (the next boundary). */
  int64_t overlap_steps;
};

/* "none", "sgd", "nesterov". */
const char *outer_kind_name(enum outer_kind k);

/* ============================================================================
 * The sync path
 * ========================================================================== */

/* Targets (samples of an MLP, tokens of a language model) used to check a
 * donated or received state's loss (whole replicas): SYNC_CHECK_TARGETS,
 * or fewer for a large model so that the check costs about
 * SYNC_CHECK_MACS multiply-adds (a newcomer waits for the donor's check
 * and then runs its own: 8192 samples of a 54 M-parameter MLP took 20 s on
 * one core each; and an all-reduce ring waits while a member that fell
 * behind checks its own state and the one it pulled: 8192 samples of the
 * 535 k-parameter MLP, 0.25 to 0.48 s a catch-up). A few thousand targets
 * measure a loss to a few hundredths of a nat, the two states on the same
 * rows, well inside the policy's slack below. Donor and newcomer call it
 * with the same model, so they check the same targets. */
#define SYNC_CHECK_TARGETS 2048
#define SYNC_CHECK_MACS (1ll << 32)
int64_t sync_check_targets(int64_t nparams);

/* The one policy for a state pulled from another member (a newcomer's
 * donation, an all-reduce member's catch-up): it is taken only when every
 * value is finite and (a whole replica) its loss on the check rows is at
 * most sync_pull_max_loss(ours), ours being that of the state we would
 * keep (a newcomer's own initialisation, a member's own trained state):
 * twice it, or SYNC_PULL_LOSS_SLACK above it when that is more (a trained
 * loss near zero doubles on noise). A broken or hostile member (a valid
 * key, a state of garbage) must not replace ours. After SYNC_PULL_ASKS
 * refused states the puller stops asking. */
#define SYNC_PULL_MAX_LOSS_RATIO 2.0
#define SYNC_PULL_LOSS_SLACK 0.5 /* nats per target */
#define SYNC_PULL_ASKS 2

/* A gradient ring's non-finite sums in a row before its run stops as
 * diverged (allreduce.c, take_sum). */
#define SYNC_NONFINITE_MAX 8

/* An all-reduce or DiLoCo member whose link drops packets leaves the ring
 * this long (allreduce.c, sync_ring_sit_out), twice as long when advised
 * again within SYNC_SIT_OUT_CALM_S of its return, at most
 * SYNC_SIT_OUT_MAX_S. */
#define SYNC_SIT_OUT_S 10.0
#define SYNC_SIT_OUT_MAX_S 80.0
#define SYNC_SIT_OUT_CALM_S 60.0
double sync_pull_max_loss(double own_loss);

/* What a pulled state is compared with: the loss on the check rows of
 * the state we would keep (NaN until first needed), and of the last one
 * checked. The state itself is kept in the pulled state's buffer while
 * that one is tried (sync_pull_take): no copy of it is made. */
struct sync_own_state {
  bool check_loss; /* false for a part of a replica (a stage, a group's shard): finiteness only */
  double loss;
  /* The last state sync_pull_take checked: its loss on `rows` check rows
   * (NaN when only finiteness was checked). */
  double pulled_loss;
  int64_t rows;
};
/* Starts the comparison with the trainer's current state. */
void sync_own_keep(struct sync_own_state *own, const struct trainer *t);
/* Loads `pulled` (trainer_state_floats floats) into the trainer unless it
 * fails the policy above against the state the trainer had when `own` was
 * kept (a part of a replica checks finiteness only). Returns true when
 * taken: `pulled` then holds the trainer's state before (a swap). On false
 * the trainer holds its own state again, `pulled` the refused one, and
 * why[0..n) says what was wrong. The trainer's position is left to the
 * caller. */
bool sync_pull_take(struct trainer *t, struct sync_own_state *own, float *pulled, char *why, size_t n);

struct sync_config {
  enum sync_kind kind;  /* --sync */
  struct outer_config outer; /* --outer ... (kind OUTER_NONE: none) */
  int64_t every_steps;  /* gossip: start an exchange every N steps (0: off) */
  double every_s;       /* ... or every T seconds (0: off) */
  double max_distance;  /* R, relative to our parameter norm */
  bool clip;            /* clipped averaging (above) */
  double clip_tau;      /* its fixed τ (0: adaptive) */
  /* Bounded drift: after this many steps without an applied exchange,
   * training holds until one applies, at most max_hold_s at a time (0:
   * never hold; training never waits for the network). NoLoCo waits at most
   * max_hold_s at a round boundary for a partner. */
  int64_t max_local_steps;
  double max_hold_s;
  enum net_dtype wire;  /* --wire: exchanges and ring pieces */
  /* --no-state-pull: a ring member starts from its own state, even behind
   * the ring (which then catches it up in its first round), rather than
   * take a member's before it is ready (sync_ring_rejoin). */
  bool own_start;
  const atomic_int *stop; /* polled while a round waits; may be NULL */
  /* For a scheme that opens connections of its own (--sync ps: its
   * servers), set by the member before sync_init; borrowed. */
  struct sync_net {
    const struct net_identity *identity;
    const uint8_t *cluster_key;
    const struct net_allowlist *allow; /* may be NULL */
    const char *servers;               /* --servers */
    uint32_t handshake_timeout_ms;
    uint32_t heartbeat_ms, dead_after_ms; /* net_config's (0 heartbeat: none) */
  } net;
};

struct sync;

/* What a scheme gives the gossip runtime (member.c sizes its buffers by it). */
struct sync_gossip_plan {
  enum gossip_sync protocol;
  uint64_t buf_floats;    /* xch_mine and xch_theirs, each */
  uint64_t gather_floats; /* one member's all-gather block (0: none) */
  enum net_dtype wire;    /* of exchanges and ring pieces */
  char label[160];        /* appended to the model label peers must share */
};

/* The end of a run (member_finish): --finish-wait-ms's bound, our mean
 * step time, and a check of the pipeline's neighbours. */
struct sync_finish_args {
  double max_s, step_s;
  const atomic_int *stop;
  bool (*failed)(void *arg, struct rumor_err *e); /* may be NULL */
  void *arg;
};

/* One scheme. `name`, `plan` and `result` are required; any other entry may
 * be NULL: the scheme has nothing to do there. */
struct sync_scheme {
  const char *name; /* the result line's "sync" */
  /* From the configuration alone, before anything exists: the state the
   * scheme keeps with the model (checkpoints, donations). */
  void (*extra)(const struct sync_config *c, struct train_extra_spec *out);
  /* The gossip runtime's protocol, buffers, encoding and label suffix for
   * a replica (or slice) of `nparams` floats. */
  void (*plan)(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out);
  /* After the trainer holds its state (a donation, a checkpoint or its own
   * initialisation): the scheme's own set-up. */
  int (*init)(struct sync *s, struct rumor_err *e);
  /* After every step (and while --wait-peers waits): exchanges, rounds,
   * holds. Returns 0, or a negative code with a message when the member
   * must stop (a stop signal during a round, or every state pulled to
   * catch up refused). */
  int (*boundary)(struct sync *s, struct rumor_err *e);
  /* The trainer's reducer (train_reducer), or NULL. */
  int (*reduce)(void *arg, int64_t rows, struct rumor_err *e);
  /* The train_reducer's catch_up (NULL: none). */
  int (*catch_up)(void *arg, int64_t step, struct rumor_err *e);
  /* After init, for a scheme whose members take their starting state from
   * elsewhere than a gossip donor (parameter servers): takes it into the
   * trainer (parameters and step). NULL: nothing to take. */
  int (*join)(struct sync *s, struct rumor_err *e);
  /* After the last step: what the scheme does before the member leaves. */
  int (*finish)(struct sync *s, const struct sync_finish_args *f, struct rumor_err *e);
  /* The scheme's fields of the result line; `gs`: the runtime's figures,
   * taken before the member left. */
  void (*result)(const struct sync *s, const struct gossip_stats *gs, struct json_t *o);
  /* Adds the bytes of connections the scheme opened itself (--sync ps: its
   * servers') to *in and *out, for the result line's bytes_in and
   * bytes_out. */
  void (*own_bytes)(const struct sync *s, uint64_t *in, uint64_t *out);
  void (*free)(struct sync *s);
};

/* The scheme of a configuration: gossip, allreduce, diloco or noloco. */
const struct sync_scheme *sync_scheme_of(const struct sync_config *c);
/* Checks the combination of --sync and --outer options (f16 or i8 with
 * NoLoCo, top-k with DiLoCo, ...). Returns 0 or RUMOR_EFORMAT naming the
 * options. */
int sync_config_check(const struct sync_config *c, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Figures every scheme reports (TensorBoard, results, metrics); zero where
 * a scheme has none. */
struct sync_figures {
  uint64_t applied, rejected, clipped, skipped; /* exchanges */
  uint64_t holds, hold_timeouts;
  uint64_t ring_rounds, ring_retries, ring_catchups;
  /* Outer rounds (DiLoCo, NoLoCo). */
  uint64_t outer_rounds, outer_alone; /* rounds applied; of them, NoLoCo's without a partner */
  double outer_norm;        /* ‖g‖ of the last round's averaged pseudo-gradient */
  double outer_bytes;       /* payload bytes this member sent and received in the last round */
  double outer_wait_s;      /* training's total wait for rounds (the boundary's communication) */
};

/* The training side of the exchange slot (exchange.c): gossip averaging
 * and NoLoCo. */
struct sync_xch {
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
  struct clip_state clip;
  double last_dist, last_norm; /* of the partner's parameters being validated */
  /* The last applied exchange: its partner's key and ‖θ' − θ‖ / ‖θ‖
   * before it applied (judged_partner: of the one being judged). */
  double applied_rel_dist;
  uint8_t judged_partner[CLIP_ID_BYTES], applied_partner[CLIP_ID_BYTES];
};

/* Gossip averaging's schedule, holds and finish (average.c). */
struct sync_avg {
  int64_t mix_step;         /* step of the last applied exchange (or of the start) */
  int64_t longest_local;    /* most steps between applied exchanges seen */
  bool holding;             /* in a hold: ask for an exchange whatever the schedule */
  /* Pacing: the exchange we asked for, followed to its end; after one that
   * applied nothing, no new one before next_ask_s. */
  bool asked;
  uint64_t applied_at_ask;
  unsigned failed_asks;
  double next_ask_s;
  uint64_t holds, hold_timeouts;
  int hold_failures_in_row;
  int64_t hold_resume_step; /* no hold before this step (after holds that gave up) */
  double hold_s;            /* total time held */
  double finish_s;          /* finish: time spent after the last step */
  uint64_t finish_applied;  /* ... and exchanges applied meanwhile */
};

/* Ring rounds (allreduce.c): the gradient all-reduce's and DiLoCo's. */
struct sync_ring {
  uint64_t rounds, retries, catchups, skipped;
  unsigned nonfinite_run; /* gradient sums in a row that were not finite (allreduce.c, take_sum) */
  double wait_s;  /* time in rounds, from the start of the first attempt to the result */
  size_t members; /* in the last round's ring */
  /* Sitting out (gossip_ar_sit_out): times, seconds out in all, the next
   * time's length (doubling while the link stays lossy) and when we were
   * last back (clock_now_s). */
  uint64_t sat_out;
  double out_s, next_out_s, back_s;
};

/* An outer optimizer's state and figures (outer.c). The device tensors are
 * views of the trainer's extra state (train_config.extra). */
struct sync_outer {
  struct tensor anchor, momentum; /* θ, b: (P) */
  struct tensor residual;         /* top-k's error feedback (P), or unallocated */
  struct tensor prev;             /* --outer-overlap: φ at the round in flight's boundary (P), or unallocated */
  struct tensor round_meta;       /* the round counters below as floats, for the state kept with the model */
  struct tensor work;             /* (P) scratch on the device: a pseudo-gradient */
  float *host;                    /* (P + 1) scratch on the host (top-k encoding) */
  float *enc;                     /* top-k: (2P) the pseudo-gradient and the residual on the host, or NULL */
  uint64_t rounds;                /* rounds applied (kept with the model) */
  bool in_flight;                 /* overlap: the round `rounds` was started and is not applied yet */
  bool join_flight;               /* a group process took an outer state whose round `rounds` was in flight at
                                     its donor (sync_outer_take): it runs that round at once (sync_outer_due) */
  uint64_t alone;                 /* NoLoCo rounds applied without a partner */
  bool alone_last;                /* ... the last one was */
  double next_ask_s;              /* NoLoCo overlapping: no request of ours before this (pacing) */
  double last_norm, last_bytes, wait_s;
};

struct sync {
  struct sync_config cfg;
  const struct sync_scheme *scheme;
  gossip_t *g;
  struct trainer *t;
  struct sync_xch x;
  struct sync_avg avg;
  struct sync_ring ring;
  struct sync_outer outer;
  void *scheme_state; /* a scheme's own (ps: its client); owned by the scheme */
  /* Times the scheme changed the parameters outside the trainer's update
   * (an applied exchange, an outer round): a checkpoint saved before such a
   * change is stale (member_finish). */
  uint64_t changes;
  /* Full-state donations are held back while false (--outer-overlap
   * between round boundaries); a monitor's request for the parameters is
   * served anyway. */
  bool donate_state_ok;
  /* Full-state donations are also held back while set (sync_hold_state). */
  bool hold_state;

  /* Monitoring figures (gossip_stats_publish). */
  double *sketch;          /* gossip_sketch_k doubles */
  double stats_s;          /* when cheap figures were last published */
  double rate_s;           /* start of the current throughput window */
  int64_t rate_samples;
  double samples_per_s;
  double param_norm;       /* at the last sketch */
};

/* Starts the scheme for trainer `t` on runtime `g` (ready to exchange:
 * the caller then calls gossip_ready) and installs its reducer, if any. `g`
 * is NULL only for --sync ps (a whole replica's worker, no gossip member):
 * then nothing is published or donated. */
int sync_init(struct sync *s, gossip_t *g, struct trainer *t, const struct sync_config *cfg,
              struct rumor_err *e) RUMOR_MUST_CHECK;
/* The scheme's join, if it has one (sync_scheme.join); 0 otherwise. */
int sync_join(struct sync *s, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Once the member is ready (gossip_ready), before its first step: a round
 * that the state it holds left due (a checkpoint saved at a round boundary
 * before the round ran, a state donated while a round was under way) runs
 * now, with the others. Returns 0 or the scheme's error. */
int sync_start(struct sync *s, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Whatever the scheme does at this step boundary, then sync_idle.
 * Returns 0 or the scheme's error (the member stops). */
int sync_boundary(struct sync *s, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Holds full-state donations back (on) or lets them go again: a group
 * process's state is whole only once its group has resynced after a step
 * (the pieces gathered, tensor-parallel ranks' replicated parameters
 * averaged); one that sums every step's gradient holds them from its
 * update to then. */
void sync_hold_state(struct sync *s, bool on);
/* Donations and figures only, for the middle of a step or a wait; `arg` is
 * the sync. Suits stage_link_set_idle. */
void sync_idle(void *arg);
/* The end of a run, after the last step (the scheme's finish). */
int sync_finish(struct sync *s, const struct sync_finish_args *f, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The scheme's result fields: "sync" (its name), its counters, and every
 * scheme's bytes_out and bytes_in (all bytes of this process's transports:
 * the runtime's and the scheme's own). */
void sync_result(const struct sync *s, const struct gossip_stats *gs, struct json_t *o);
void sync_figures(const struct sync *s, struct sync_figures *out);
void sync_free(struct sync *s);

#endif /* RUMOR_PEER_SYNC_H */
