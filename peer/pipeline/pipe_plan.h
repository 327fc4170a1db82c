/*
 * pipe_plan — the pure planning half of model-parallel training: how a
 * model's layers split into pipeline stages, and in which order each stage
 * runs the forward (F) and backward (B) passes of a step's micro-batches.
 * Nothing here touches devices or the network, so every stage process (and
 * the `rumor group` launcher) computes the same plan from the same flags.
 *
 * Split: S contiguous runs of layers, at least one layer each, chosen to
 * minimise the largest stage's cost, where a layer's cost is its share of
 * the model's parameters plus its share of the multiply-adds of training one
 * sample (forward, weight gradient and input gradient; the first layer has
 * no input gradient), so that both memory and time are balanced.
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
#ifndef RUMOR_PEER_PIPE_PLAN_H
#define RUMOR_PEER_PIPE_PLAN_H

#include <stdint.h>

#include "peer/model/model.h"

#define PIPE_MAX_STAGES MODEL_MAX_LAYERS /* a stage holds at least one layer */
#define PIPE_MAX_MICRO 4096              /* micro-batches per step */

/* Stage s holds layers [first[s], first[s+1]); first[0] = 0 and
 * first[stages] = nlayers. */
struct pipe_split {
  int stages;
  int first[PIPE_MAX_STAGES + 1];
};

/* Splits spec's layers into `stages` balanced stages. Returns 0, or
 * RUMOR_EFORMAT with a message when stages is out of [1, nlayers]. */
int pipe_split_balance(const struct model_spec *spec, int stages, struct pipe_split *out,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
/* Parameters, and training multiply-adds per sample, of stage s. */
int64_t pipe_split_params(const struct model_spec *spec, const struct pipe_split *sp, int s);
int64_t pipe_split_flops(const struct model_spec *spec, const struct pipe_split *sp, int s);
/* One line describing stage s, e.g. "stage 0/2: layers 0-1 (784-512-256),
 * 533504 parameters (79.8%), 1327104 training multiply-adds per sample
 * (74.9%)"
 * (layer ranges inclusive). */
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

#endif /* RUMOR_PEER_PIPE_PLAN_H */
