/*
 * stage_train — the training loop of one stage of a peer group: its layers
 * of the model (model_init_layers), their optimizer state, the data (every
 * stage loads it, so each knows the batch sizes and positions; stage 0 uses
 * the images, the last stage the labels), the pipeline (pipeline.h) and the
 * step's bookkeeping: learning rate, epochs, evaluation at epoch ends,
 * progress lines and the stage's checkpoint file.
 *
 * Every stage of a group runs the same steps in the same order: they agree
 * on the configuration (stage_agreement) and on the starting position
 * (stage 0's, passed down the pipeline), and each step is one pipelined pass
 * over one batch followed by each stage's own optimizer update of its own
 * layers, which is the single-process update restricted to those layers.
 *
 * Threads: the thread that created the trainer.
 */
#ifndef RUMOR_PEER_STAGE_TRAIN_H
#define RUMOR_PEER_STAGE_TRAIN_H

#include "peer/pipeline/pipe_plan.h"
#include "peer/pipeline/pipeline.h"
#include "peer/train/train.h"

struct stage_config {
  struct train_config train; /* model (required), data, device, batch, optimizer, ...; no resume */
  const char *group;         /* the group's name */
  int stage, stages;
  int micro;                 /* micro-batches per step */
  enum pipe_schedule sched;
};

/* What follows from the configuration alone, the same in every stage:
 * the model, the split, this stage's layers and the micro-batch rows. */
struct stage_plan {
  struct model_spec spec;
  struct pipe_split split;
  int l0, l1;
  int64_t mb_rows; /* ceil(batch / micro) */
};
/* Returns 0 or RUMOR_EFORMAT with a message naming the bad flag. */
int stage_plan_make(const struct stage_config *cfg, struct stage_plan *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The text every stage of a group must hold identical (compared when
 * neighbours connect): model, split, schedule, micro-batches and every
 * setting that decides the batches, the learning rates and the updates. */
void stage_agreement(const struct stage_config *cfg, const struct stage_plan *plan, char *buf, size_t n);
/* The gossip label of this stage: stage s of every group averages only with
 * peers that carry exactly the same label, e.g. "mlp:784-256-10 stage 0/2
 * layers 0-0 of 0,1,2". Returns 0 or RUMOR_ETOOBIG (over `n` characters). */
int stage_gossip_label(const struct stage_config *cfg, const struct stage_plan *plan, char *buf, size_t n,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
/* The checkpoint file of stage s for the group's --checkpoint PATH:
 * "run.safetensors" → "run-stage0.safetensors"; other names get
 * "-stage0" appended. */
void stage_checkpoint_path(const char *path, int stage, char *buf, size_t n);

struct stage_trainer {
  struct stage_config cfg;
  struct stage_plan plan;
  tensor_backend_t be;
  struct model model; /* layers [l0, l1) */
  struct optim optim;
  struct dataset train, test;
  bool have_test;
  struct batcher batcher;
  double norm_mean, norm_std;
  float lut[256];
  int64_t steps_per_epoch, total_steps, stop_step;
  struct train_state st;
  float *xh;   /* (batch × features) host batch: stage 0 */
  int32_t *yh; /* (batch) labels: last stage */
  stage_link_t *link; /* not owned */
  struct pipeline pipe;

  double loss_avg, last_loss; /* last stage only (NaN elsewhere) */
  double accuracy, test_loss; /* last evaluation, last stage only (NaN elsewhere) */
  double t_start, t_last_log;
  bool started;
  int64_t samples_at_start;
};

/* Loads the data, opens the device, builds the stage's layers (initialised
 * from the seed exactly as the whole model's would be), the optimizer and the
 * pipeline over `link`. Logs the stage's layers. Returns 0 or a negative code
 * with a message. */
int stage_trainer_init(struct stage_trainer *t, const struct stage_config *cfg, stage_link_t *link,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
void stage_trainer_free(struct stage_trainer *t);

bool stage_trainer_done(const struct stage_trainer *t);
/* One pipelined step and this stage's update; at an epoch end the
 * evaluation (when configured) and, when configured, the checkpoint.
 * Returns 0, or a negative code with a message (a neighbour failed, a stop
 * was requested, a checkpoint could not be written). */
int stage_trainer_step(struct stage_trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Pipelined evaluation on the test set; every stage calls it at the same
 * point. On the last stage, t->accuracy and t->test_loss are updated. */
int stage_trainer_evaluate(struct stage_trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Floats in this stage's state: its parameters, then their optimizer state. */
int64_t stage_trainer_state_floats(const struct stage_trainer *t);
void stage_trainer_copy_state(struct stage_trainer *t, float *out);
void stage_trainer_load_state(struct stage_trainer *t, const float *state);
/* Continues from optimizer step `step` at the start of epoch `epoch`. */
void stage_trainer_set_position(struct stage_trainer *t, int64_t step, int64_t epoch, int64_t samples);

/* Writes this stage's layers ("layers.<l>.weight" / ".bias" under their
 * whole-model numbers) and their optimizer state to a safetensors file,
 * atomically, with the group, stage and split in the metadata. */
int stage_trainer_save(struct stage_trainer *t, const char *path, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_STAGE_TRAIN_H */
