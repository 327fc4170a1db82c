/*
 * pipeline — one stage's share of a pipelined training step: it splits the
 * step's batch into micro-batches, runs the forward and backward passes of
 * its layers in the order of the schedule (pipe_plan.h), receives its
 * inputs and output gradients from the neighbouring stages and sends its
 * outputs and input gradients to them (stage_link.h).
 *
 * Exactness: micro-batch i holds rows [off_i, off_i + r_i) of the batch in
 * order; the loss gradient of every micro-batch is scaled by 1/rows of the
 * whole batch, and the layers' gradients are summed over the micro-batches.
 * The gradient after a step is therefore the single-process batch gradient,
 * up to the order of floating-point additions.
 *
 * Memory: the activations a backward pass needs (every acts[l] of the
 * stage's layers, and GELU's pre-activations) are kept per micro-batch in
 * "slots", allocated on demand and reused, so the slots allocated are the
 * most micro-batches held at once: M under GPipe, min(S−s, M) under 1F1B.
 * The model's own workspace is slot 0.
 *
 * Threads: the stage's training thread (the one that owns the model).
 */
#ifndef RUMOR_PEER_PIPELINE_H
#define RUMOR_PEER_PIPELINE_H

#include "peer/data/dataset.h"
#include "peer/model/model.h"
#include "peer/pipeline/pipe_plan.h"
#include "peer/pipeline/stage_link.h"

struct pipe_slot {
  struct tensor acts[MODEL_MAX_LAYERS + 1]; /* acts[l0..l1], (mb_rows, widths[l]) each; owners */
  struct tensor pre[MODEL_MAX_LAYERS];      /* GELU pre-activations of hidden layers in [l0, l1) */
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
  struct model *m;      /* the stage's layers [l0, l1); not owned */
  stage_link_t *link;   /* not owned */
  int stage, stages, micro;
  enum pipe_schedule sched;
  int64_t mb_rows;      /* rows of the largest micro-batch: m->max_batch */
  int l0, l1;
  struct pipe_action *actions; /* 2·micro */
  int *slot_of;                /* micro-batch → slot, −1 when none */
  struct pipe_slot *slots;
  int nslots;
  struct tensor din;  /* (mb_rows, widths[l0]): gradient for the previous stage */
  struct tensor dout; /* (mb_rows, widths[l1]): gradient from the next stage */
  float *host;        /* (mb_rows × max(widths[l0], widths[l1])) staging */
  int32_t *labels;    /* (mb_rows) staging for evaluation labels */
  int64_t evals;      /* evaluations run (tags their transfers) */
  int64_t steps_run;  /* steps run, timed or not */
  double cur_wait;    /* seconds blocked in the current step */
  struct pipe_stats st;
};

/* Builds the pipeline for model `m` (built by model_init_layers with
 * max_batch = the micro-batch rows) and `link`. The pipeline takes over the
 * model's activation workspace as slot 0. Returns 0 or a negative code with
 * a message. */
int pipeline_init(struct pipeline *p, struct model *m, stage_link_t *link, int stage, int stages, int micro,
                  enum pipe_schedule sched, struct rumor_err *e) RUMOR_MUST_CHECK;
void pipeline_free(struct pipeline *p);

/* Rows of micro-batch i when `rows` rows split into n = min(M, rows) parts:
 * the first rows % n parts get one more row. */
void pipeline_micro_rows(int64_t rows, int micro, int i, int64_t *offset, int64_t *count);
int pipeline_micro_count(int64_t rows, int micro);

/* Runs this stage's part of step `step` on a batch of `rows` rows: x_host
 * (rows × widths[0], stage 0 only, else NULL) and y_host (rows labels, last
 * stage only, else NULL). Afterwards m->grads holds this stage's share of
 * the batch gradient, and on the last stage *loss_sum the summed per-sample
 * loss. Returns 0, or a negative code with a message when a neighbour
 * failed (the link's failure) or a stop was requested. */
int pipeline_step(struct pipeline *p, int64_t step, int64_t rows, const float *x_host, const int32_t *y_host,
                  double *loss_sum, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Forward passes over all of `ds` in micro-batch-sized chunks (file order,
 * normalised with `lut`), pipelined through the stages. On the last stage,
 * *correct and *loss_sum get the correct predictions and the summed loss.
 * Every stage of the group must call it at the same point. */
int pipeline_eval(struct pipeline *p, const struct dataset *ds, const float lut[256], int64_t *correct,
                  double *loss_sum, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_PIPELINE_H */
