/*
 * train — one peer's training loop: data, model, optimizer, evaluation,
 * progress lines and checkpoints. The loop is driven one step at a time
 * (trainer_step), so a caller can act between steps: the gossip peer hands
 * snapshots to the network and applies received averages exactly there.
 *
 * Threads: a trainer belongs to the thread that created it.
 */
#ifndef RUMOR_PEER_TRAIN_H
#define RUMOR_PEER_TRAIN_H

#include "peer/train/checkpoint.h"
#include "peer/data/dataset.h"
#include "peer/model/model.h"
#include "peer/model/optim.h"

struct train_config {
  const char *model;       /* spec string; NULL → from the resumed checkpoint */
  const char *data_dir;    /* directory with <split>-images-idx3-ubyte[.gz] ... */
  const char *device;      /* "auto", "cpu", "cuda", "cuda:N" */
  int threads;             /* CPU threads (0: all cores) */
  struct shard shard;
  uint64_t seed;           /* model initialisation and per-epoch shuffles */
  uint64_t data_seed;      /* the shard split; the same on every peer */
  int64_t epochs;
  int64_t batch;
  int64_t max_steps;       /* stop after this many updates (0: no limit) */
  struct optim_config optim;
  const char *checkpoint;  /* path to save to, or NULL */
  int64_t checkpoint_every;/* steps between saves (0: at epoch ends only) */
  const char *resume;      /* checkpoint to resume from, or NULL */
  double log_every_s;      /* seconds between progress lines (0: none) */
  bool eval_each_epoch;
  const char *peer_id;     /* written into checkpoints; may be NULL */
};

void train_config_default(struct train_config *c);

struct trainer {
  struct train_config cfg;
  tensor_backend_t be;
  struct model model;
  struct optim optim;
  struct dataset train, test;
  bool have_test;
  struct batcher batcher;
  double norm_mean, norm_std;
  float lut[256];
  int64_t steps_per_epoch;
  int64_t total_steps; /* epochs × steps_per_epoch: the schedule's length */
  int64_t stop_step;   /* total_steps, or max_steps when that is smaller */
  struct train_state st;

  /* Double-buffered host batches (pinned on CUDA): the next batch is
   * gathered while the device works on the current one. */
  float *xh[2];
  int32_t *yh[2];
  int64_t rows[2];
  int cur;
  bool staged; /* xh[cur] holds the batch for st's position */

  double loss_avg;       /* exponential moving average of the training loss */
  double last_loss;
  double t_start, t_last_log;
  bool started; /* the first step ran */
  char resumed_from[1024]; /* the checkpoint actually loaded (cfg.resume or its .prev) */
  int64_t samples_at_start;
};

/* Loads data, opens the device, builds the model (fresh from the seed or
 * from cfg->resume) and the optimizer. Logs what it set up. Returns 0 or a
 * negative code with a message naming the bad input. */
int trainer_init(struct trainer *t, const struct train_config *cfg, struct rumor_err *e) RUMOR_MUST_CHECK;
void trainer_free(struct trainer *t);

/* True once the configured epochs (or max_steps) are done. */
bool trainer_done(const struct trainer *t);
/* Runs one optimisation step on the next batch; returns its mean loss.
 * Advances epoch and batch position; prints progress lines; at an epoch end
 * evaluates (if configured) and checkpoints (if configured). Returns a
 * negative code only when a checkpoint could not be written. */
int trainer_step(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Accuracy and mean loss of the current parameters on the test set. */
void trainer_evaluate(struct trainer *t, const struct dataset *ds, double *accuracy, double *loss);
/* Mean loss of the current parameters on the first `n` samples of the
 * training set in file order: the same data on every peer, so a donor and
 * the newcomer that received its state must report the same figure. */
double trainer_check_loss(struct trainer *t, int64_t n);

/* Floats in the full state: parameters, then optimizer state. */
int64_t trainer_state_floats(const struct trainer *t);
/* Copies parameters and optimizer state to host memory (state_floats). */
void trainer_copy_state(struct trainer *t, float *out);
/* Replaces parameters and optimizer state with `state` (state_floats) and
 * continues from optimizer step `step` in epoch `epoch`, at the start of
 * this shard's epoch (a newcomer taking a live peer's state). */
void trainer_load_state(struct trainer *t, const float *state, int64_t step, int64_t epoch);

/* Saves a checkpoint of the current state to `path`. */
int trainer_save(struct trainer *t, const char *path, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_TRAIN_H */
