/*
 * pipeline — model-parallel training: a peer group of S processes splits one
 * replica's units (the model's layers or blocks) into S contiguous stages.
 *
 * Three parts, one header:
 *   plan      which units each stage holds, and in which order a stage runs
 *             the forward and backward passes of a step's micro-batches
 *             (pure functions: every stage computes the same plan);
 *   link      the authenticated connections between neighbouring stages,
 *             carrying activations forward and their gradients backward;
 *   runner    one stage's share of a pipelined step over the link.
 * The stage's training loop (data, optimiser, checkpoints) is the trainer's
 * (peer/train/train.h); its gossip is the sync path's (peer/sync/sync.h).
 */
#ifndef RUMOR_PEER_PIPELINE_H
#define RUMOR_PEER_PIPELINE_H

#include <stdatomic.h>
#include <stdint.h>

#include "gossip/gossip.h"
#include "net/net.h"
#include "peer/data/data.h"
#include "peer/model/model.h"

/* ============================================================================
 * Plan
 * ========================================================================== */

/*
 * The pure planning half of model-parallel training: how a model's units
 * split into pipeline stages, and in which order each stage runs the
 * forward (F) and backward (B) passes of a step's micro-batches. Nothing
 * here touches devices or the network, so every stage process (and the
 * `rumor group` launcher) computes the same plan from the same flags.
 *
 * Split: S contiguous runs of units, at least one unit each, chosen to
 * minimise the largest stage's cost, where a unit's cost is its share of
 * the model's parameters (from the parameter table) plus its share of the
 * multiply-adds of training one row (model_spec_unit_macs), so that both
 * memory and time are balanced.
 *
 * Schedules for M micro-batches on S stages:
 *   GPipe: every stage runs F0 .. F(M−1), then B(M−1) .. B0. A stage keeps
 *          the activations of all M micro-batches until their backward.
 *   1F1B:  (PipeDream-Flush) stage s runs min(S−s−1, M) warm-up forwards,
 *          then alternates one forward and one backward, then drains the
 *          remaining backwards. It keeps at most min(S−s, M) micro-batches'
 *          activations: the bound that does not grow with M.
 * Both have the same bubble: with equal stage times, each stage idles
 * (S−1)/(M+S−1) of a step.
 *
 * Threads: any; no state.
 */

#define PIPE_MAX_STAGES 64   /* stages of one group (each holds at least one unit) */
#define PIPE_MAX_MICRO 4096  /* micro-batches per step */

/* Stage s holds units [first[s], first[s+1]); first[0] = 0 and
 * first[stages] = the model's unit count. */
struct pipe_split {
  int stages;
  int first[PIPE_MAX_STAGES + 1];
};

/* Splits spec's units into `stages` balanced stages. Returns 0, or
 * RUMOR_EFORMAT with a message when stages is out of [1, units] or above
 * PIPE_MAX_STAGES. */
int pipe_split_balance(const struct model_spec *spec, int stages, struct pipe_split *out,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
/* Parameters, and training multiply-adds per row, of stage s. */
int64_t pipe_split_params(const struct model_spec *spec, const struct pipe_split *sp, int s);
int64_t pipe_split_flops(const struct model_spec *spec, const struct pipe_split *sp, int s);
/* One line describing stage s, e.g. "stage 0/2: layers 0-1 (784-512-256),
 * 533504 parameters (79.8%), 1327104 training multiply-adds per row
 * (74.9%)" (unit ranges inclusive). */
void pipe_split_describe(const struct model_spec *spec, const struct pipe_split *sp, int s, char *buf, size_t n);
/* A compact text form of the split: the cut points first[0..stages], e.g.
 * "0,2,3", for messages that both sides compare. */
void pipe_split_format(const struct pipe_split *sp, char *buf, size_t n);

enum pipe_schedule { PIPE_GPIPE = 0, PIPE_1F1B = 1 };
/* Parses "gpipe" or "1f1b". Returns 0 or RUMOR_EFORMAT. */
int pipe_schedule_parse(const char *s, enum pipe_schedule *out) RUMOR_MUST_CHECK;
const char *pipe_schedule_name(enum pipe_schedule s);

enum pipe_op { PIPE_F = 0, PIPE_B = 1 };
struct pipe_action {
  enum pipe_op op;
  int mb; /* micro-batch index, 0 <= mb < M */
};

/* Writes stage s's 2·M actions for one step into out (2·micro entries) in
 * the order the stage runs them. */
void pipe_schedule_actions(enum pipe_schedule sched, int stages, int stage, int micro, struct pipe_action *out);
/* The most micro-batches whose activations stage s holds at once. */
int pipe_schedule_peak_stash(enum pipe_schedule sched, int stages, int stage, int micro);
/* The ideal bubble (S−1)/(M+S−1): the idle fraction of every stage when
 * all stages take the same time and communication is free. */
double pipe_bubble_theory(int stages, int micro);

/* Runs every stage's action list against the pipeline's dependencies
 * (F(s,i) after F(s−1,i); B(s,i) after B(s+1,i), and on the last stage after
 * F(S−1,i)), with each F taking f and each B taking b time units, and
 * stores each stage's idle fraction of the makespan in idle[s]. Returns the
 * makespan, or −1 when the lists deadlock (a stage waits for an action that
 * can never run). For tests and the benchmark's reference figures. */
double pipe_schedule_simulate(enum pipe_schedule sched, int stages, int micro, double f, double b, double *idle);

/* ============================================================================
 * Link
 * ========================================================================== */

/*
 * the connections between neighbouring stages of one peer
 * group: activations travel forward (stage s → s+1), their gradients
 * backward (s+1 → s), over net/'s authenticated, encrypted transport.
 *
 * Admission: the same cluster key as the gossip cluster, and identities
 * derived from the group's identity (BLAKE2b keyed with its secret seed, one
 * Ed25519 key per stage index). Each side admits exactly the neighbours'
 * derived keys (an allow-list of one or two), so only processes holding the
 * group's identity file can take part in its pipeline. After the handshake
 * the dialer (stage s+1) sends HELLO with the group name, its stage, the
 * stage count and an agreement text (model, split, schedule, batch, seeds,
 * ...); stage s answers OK only when all of them match its own, else both
 * fail with the difference in the message.
 *
 * Liveness: PINGs every quarter of idle_timeout_ms (at most every second);
 * a neighbour silent for idle_timeout_ms, a connection lost, or a neighbour's ABORT fails the link. A failed link
 * records which stage failed and why (the first failure wins), and every
 * wait below returns at once with that message, so a dead stage stops its
 * whole group.
 *
 * Threads: the link keeps its connections and its timer on the event loop
 * of the process's gossip runtime (gossip_on_loop): one event loop and one
 * network thread per process. Every stage_link_* function is for one other
 * thread (the stage's training thread). Waits block that thread; while they
 * wait, the idle callback (if set) runs on it every STAGE_LINK_IDLE_MS, so
 * gossip donations are still served. stage_link_close must come before
 * gossip_stop.
 */

typedef struct stage_link stage_link_t;

#define STAGE_LINK_GROUP_MAX 64    /* characters in a group name */
#define STAGE_LINK_AGREE_MAX 1024  /* characters in the agreement text */
#define STAGE_LINK_IDLE_MS 10      /* the idle callback's period while waiting */

enum stage_link_dir { STAGE_LINK_PREV = 0, STAGE_LINK_NEXT = 1 };

/* What a transfer carries (pinned: they travel in the transfer metadata). */
enum stage_link_kind {
  STAGE_LINK_ACT = 1,  /* training activations, forward */
  STAGE_LINK_GRAD = 2, /* gradients of those activations, backward */
  STAGE_LINK_EVAL = 3, /* evaluation activations, forward */
  STAGE_LINK_TIED_PARAM = 4, /* a tied parameter's value, forward (stage 0 to the last, relayed) */
  STAGE_LINK_TIED_GRAD = 5,  /* the last stage's gradient of it, backward (relayed to stage 0) */
  STAGE_LINK_AGREE = 6,      /* a few values the stages agree on (pipeline_agree), either way; tagged with the
                                agreement's number instead of a step */
};
#define STAGE_LINK_AGREE_FLOATS 8 /* what one STAGE_LINK_AGREE transfer carries (one row) */

struct stage_link_config {
  gossip_t *host;                      /* whose event loop the link runs on (unused for a group of one) */
  const struct net_identity *identity; /* the group's identity; copied */
  const uint8_t *cluster_key;          /* copied */
  const char *group;                   /* the group's name (printable, at most STAGE_LINK_GROUP_MAX) */
  int stage, stages;
  const char *listen;    /* "host:port" the next stage dials (port 0: any); unused by the last stage */
  const char *prev;      /* the previous stage's address; required unless stage 0 */
  const char *agreement; /* what both neighbours must hold identical */
  int64_t in_width;      /* floats per row arriving from the previous stage (and sent back to it) */
  int64_t out_width;     /* floats per row sent to the next stage (and arriving back from it) */
  int64_t max_rows;      /* the most rows one transfer may carry */
  int64_t tied_floats;   /* floats of the model's tied parameter (model_tied) when the group splits one, else 0 */
  enum net_dtype wire;   /* activations, their gradients and evaluation activations on the wire (0: f32);
                            tied parameters and their gradients always travel in f32. Part of the
                            agreement: both neighbours must use the same. */
  uint32_t connect_timeout_ms; /* neighbours must connect and agree within this */
  uint32_t idle_timeout_ms;    /* a connected neighbour silent this long is lost */
  uint32_t heartbeat_ms, dead_after_ms; /* the transport's heartbeat (net_config's; 0 heartbeat: none):
                                           a neighbour whose loop stops is lost after dead_after_ms */
  const atomic_int *stop;      /* polled by waits: non-zero ends them (a stop signal); may be NULL */
};

/* Where training starts, sent from stage 0 down the pipeline so that every
 * stage runs the same steps (stages may pull their states from different
 * groups when they join). */
struct stage_link_pos {
  int64_t step, epoch, samples;
};

/* Returns 0 when `group` can name a group (1 to STAGE_LINK_GROUP_MAX
 * printable characters, no spaces or quotes), else RUMOR_EFORMAT with a
 * message quoting it. */
int stage_link_check_group(const char *group, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Listens (unless the last stage), starts dialing the previous stage
 * (unless the first) and returns at once. Returns 0, or a negative code
 * with a message (bad address, cannot listen). */
int stage_link_start(stage_link_t **out, const struct stage_link_config *cfg, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The address the next stage dials ("127.0.0.1:40123"); "" for the last. */
const char *stage_link_address(const stage_link_t *l);
/* Sets the callback run every STAGE_LINK_IDLE_MS while a wait blocks. */
void stage_link_set_idle(stage_link_t *l, void (*idle)(void *arg), void *arg);

/* Waits until every neighbour is connected and has agreed. Returns 0, or a
 * negative code with the failure (or the stop) in `e`. */
int stage_link_wait_ready(stage_link_t *l, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Sends rows × width floats from `data` (copied before this returns) to
 * the neighbour in `dir`, tagged with kind, step and micro-batch. Never
 * blocks. Returns 0, or a negative code with a message when the link has
 * failed (nothing is sent then). */
int stage_link_send(stage_link_t *l, enum stage_link_dir dir, enum stage_link_kind kind, int64_t step, int32_t mb,
                    int64_t rows, const float *data, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Waits for the transfer (kind, step, mb) from the neighbour in `dir` and
 * hands it over: *data (malloc'd, rows × width floats; the caller frees it)
 * and *rows. *waited_s (may be NULL) gets the seconds spent blocked.
 * Returns 0, or a negative code with the failure in `e`. */
int stage_link_recv(stage_link_t *l, enum stage_link_dir dir, enum stage_link_kind kind, int64_t step, int32_t mb,
                    float **data, int64_t *rows, double *waited_s, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Stage 0 sends the starting position to stage 1; every other stage
 * receives it from its previous stage and passes it on. */
int stage_link_send_start(stage_link_t *l, const struct stage_link_pos *pos, struct rumor_err *e) RUMOR_MUST_CHECK;
int stage_link_recv_start(stage_link_t *l, struct stage_link_pos *pos, struct rumor_err *e) RUMOR_MUST_CHECK;

/* True once the link has failed; *stage and why[0..n) say which stage and
 * what happened (the stage may be this one, after stage_link_abort). A
 * neighbour that closed the link while a call here still needed it has
 * failed too: it left the group, and it is the stage named. */
bool stage_link_failed(stage_link_t *l, int *stage, char *why, size_t n);
/* Tells every connected neighbour that the group stops because `stage`
 * failed (or stopped) for `why`, and fails the link here too, unless it had
 * already failed. Best effort; never blocks. */
void stage_link_abort(stage_link_t *l, int stage, const char *why);

/* Waits (at most flush_ms) until every transfer sent has been confirmed by
 * its receiver, then closes the connections gracefully, stops the loop
 * thread and frees everything. NULL is a no-op. */
void stage_link_close(stage_link_t *l, uint32_t flush_ms);

/* ============================================================================
 * Runner
 * ========================================================================== */

/*
 * One stage's share of a pipelined training step: it splits the step's
 * batch into micro-batches, runs the forward and backward passes of its
 * units in the order of the schedule (Plan), receives its inputs and output
 * gradients from the neighbouring stages and sends its outputs and input
 * gradients to them (Link).
 *
 * Exactness: micro-batch i holds rows [off_i, off_i + r_i) of the batch in
 * order; the loss gradient of every micro-batch is scaled by 1/targets of
 * the whole batch, and the units' gradients are summed over the
 * micro-batches. The gradient after a step is therefore the single-process
 * batch gradient, up to the order of floating-point additions.
 *
 * Memory: the activations a backward pass needs (the model's stash: every
 * tensor its forward pass writes for its backward) are kept per micro-batch
 * in "slots", allocated on demand and reused, so the slots allocated are the
 * most micro-batches held at once: M under GPipe, min(S−s, M) under 1F1B.
 * The model's own workspace is slot 0.
 *
 * Threads: the stage's training thread (the one that owns the model).
 */

struct pipe_slot {
  struct tensor t[MODEL_MAX_STASH]; /* one tensor per m->stash entry; owners (slot 0: the model's) */
  bool busy;
};

/* Timing of the steps run so far (after the first, which warms up). */
struct pipe_stats {
  int64_t steps;    /* steps timed */
  double step_s;    /* wall time inside pipeline_step */
  double wait_s;    /* of which blocked waiting for a neighbour */
  int slots;        /* activation slots allocated: the peak held at once */
  size_t slot_bytes;/* bytes of one slot */
};

struct pipeline {
  struct model *m;      /* the stage's units [u0, u1); not owned */
  stage_link_t *link;   /* not owned */
  int stage, stages, micro;
  enum pipe_schedule sched;
  int64_t mb_rows;      /* rows of the largest micro-batch: m->max_rows */
  int u0, u1;
  int64_t in_width, out_width; /* values per row entering unit u0 and leaving unit u1 − 1 */
  struct pipe_action *actions; /* 2·micro */
  int *slot_of;                /* micro-batch → slot, −1 when none */
  struct pipe_slot *slots;
  int nslots;
  struct tensor din;  /* (mb_rows, in_width): gradient for the previous stage */
  struct tensor dout; /* (mb_rows, out_width): gradient from the next stage */
  float *host;        /* (mb_rows × max(in_width, out_width)) staging */
  void *eval_x;       /* (mb_rows) rows of evaluation input: stage 0 */
  int32_t *labels;    /* (mb_rows · labels_per_row) staging for evaluation labels */
  int64_t evals;      /* evaluations run (tags their transfers) */
  int64_t tied_floats;  /* pipeline_tied_floats */
  float *tied_host;     /* (tied_floats) staging: stage 0 and the last stage */
  struct tensor tied_dev; /* (tied_floats) the received gradient: stage 0 */
  int64_t steps_run;  /* steps run, timed or not */
  double cur_wait;    /* seconds blocked in the current step */
  struct pipe_stats st;
};

/* Builds the pipeline for model `m` (built by model_init for the stage's
 * units, with max_rows = the micro-batch rows) and `link`. The pipeline
 * takes over the model's stash as slot 0. Returns 0 or a negative code with
 * a message. */
int pipeline_init(struct pipeline *p, struct model *m, stage_link_t *link, int stage, int stages, int micro,
                  enum pipe_schedule sched, struct rumor_err *e) RUMOR_MUST_CHECK;
void pipeline_free(struct pipeline *p);

/* Floats of the model's tied parameter that a group of `stages` stages
 * moves each step (model_tied; pipeline.c, "the tied parameter"): its
 * element count (a tensor-parallel rank's slice of it), or 0 when the
 * model has none or the group is one stage. The same on every stage (rank
 * t of every stage: the same slice): the link's tied_floats. */
int64_t pipeline_tied_floats(const struct model *m, int stages);

/* Rows of micro-batch i when `rows` rows split into n = min(M, rows) parts:
 * the first rows % n parts get one more row. */
void pipeline_micro_rows(int64_t rows, int micro, int i, int64_t *offset, int64_t *count);
int pipeline_micro_count(int64_t rows, int micro);

/* Runs this stage's part of step `step` on a batch of `rows` rows: x_host
 * (rows × the model's input values, of its input dtype; stage 0 only, else
 * NULL) and y_host (rows × labels_per_row labels; last stage only, else
 * NULL). The loss gradient is scaled by 1 / the targets of `loss_rows`
 * rows (>= rows): the batch's own rows, or, for a data-parallel member
 * that runs its slice of a larger batch, that whole batch's, so that the
 * members' summed gradients are the batch's mean. Afterwards m->grads
 * holds this stage's share of that gradient, and on the last stage
 * *loss_sum the summed per-target loss of these rows.
 * Returns 0, or a negative code with a message when a neighbour failed (the
 * link's failure) or a stop was requested. */
int pipeline_step(struct pipeline *p, int64_t step, int64_t rows, int64_t loss_rows, const void *x_host,
                  const int32_t *y_host, double *loss_sum, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Fills x (rows × input values) and y (rows × labels_per_row) with rows
 * [first, first + rows) of an evaluation set. */
typedef void (*pipe_gather_fn)(void *arg, int64_t first, int64_t rows, void *x, int32_t *y);

/* Forward passes over `count` evaluation rows (from `gather`, on the first
 * and last stage) in micro-batch-sized chunks, pipelined through the
 * stages. On the last stage, *correct and *loss_sum get the correct
 * predictions and the summed loss. Every stage of the group must call it at
 * the same point with the same count. `chunks` (0: none) asks for at least
 * that many chunks: those past the rows are padding passes (one row,
 * model.h's ep->ghost set, not scored), so that expert-parallel members
 * whose slices need fewer chunks still take part in every chunk's
 * exchanges; only a model with model_use_ep may ask for them. */
int pipeline_eval(struct pipeline *p, int64_t count, int64_t chunks, pipe_gather_fn gather, void *arg,
                  int64_t *correct,
                  double *loss_sum, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Folds `mine` (this stage's values) into `acc` (those of the stages
 * before it), n values each. */
typedef void (*pipe_combine_fn)(float *acc, const float *mine, int n);

/* One agreement of the stages on n (1 .. STAGE_LINK_AGREE_FLOATS) values:
 * stage 0's v travels up the links, each stage folding its own in with
 * `combine`, and the last stage's result travels back down; every stage
 * gets it in v. Every stage must call it at the same point with the same
 * `seq` (the caller's count of its agreements, the same on every stage:
 * it tags the transfers, as a step number tags a step's, so steps that
 * differ between stages do not matter). A group of one stage returns at
 * once. Waits block as the link's do (its idle callback runs). Returns 0,
 * or a negative code with the link's failure. */
int pipeline_agree(struct pipeline *p, int64_t seq, float *v, int n, pipe_combine_fn combine,
                   struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_PIPELINE_H */
