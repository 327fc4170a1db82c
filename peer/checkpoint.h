/*
 * checkpoint — a peer's training state as one safetensors file.
 *
 * Tensors: "layers.<l>.weight" (out, in) and "layers.<l>.bias" (out) for the
 * model, in flat-buffer order (so torch.nn.Linear layers load them directly),
 * then the optimizer state: "optimizer.momentum" (P) for SGD, or
 * "optimizer.exp_avg" and "optimizer.exp_avg_sq" (P each) for AdamW.
 * Metadata (strings): rumor.format, rumor.model, rumor.step, rumor.epoch,
 * rumor.step_in_epoch, rumor.samples, rumor.seed, rumor.data_seed,
 * rumor.shard, rumor.batch, rumor.optimizer, rumor.norm_mean,
 * rumor.norm_std, rumor.peer_id, plus the whole-file digest.
 */
#ifndef RUMOR_PEER_CHECKPOINT_H
#define RUMOR_PEER_CHECKPOINT_H

#include "peer/dataset.h"
#include "peer/model.h"
#include "peer/optim.h"
#include "peer/safetensors.h"

#define CHECKPOINT_FORMAT "1"

/* Where a run stands; saved with the weights so a resumed run continues the
 * same sequence of batches and learning rates. */
struct train_state {
  int64_t step;          /* optimizer updates applied */
  int64_t epoch;         /* current epoch, from 0 */
  int64_t step_in_epoch; /* batches of the current epoch already done */
  int64_t samples;       /* samples trained on by this peer */
};

struct ckpt_info {
  struct model_spec spec;
  struct train_state st;
  enum optim_kind optim_kind;
  uint64_t seed, data_seed;
  struct shard shard;
  int64_t batch;
  double norm_mean, norm_std;
  char peer_id[96]; /* free text; empty when unknown */
};

/* Writes model parameters, optimizer state (when `o` is not NULL) and `info`
 * atomically to `path`. Returns 0 or a negative code with a message; on
 * failure the previous file at `path` is intact. */
int checkpoint_save(const char *path, const struct model *m, const struct optim *o,
                    const struct ckpt_info *info, struct rumor_err *e) RUMOR_MUST_CHECK;

struct checkpoint {
  struct st_file file;
  struct ckpt_info info;
  bool has_optim;
};

/* Reads and validates a checkpoint (digest, tensors present with the shapes
 * the recorded model implies, metadata parseable). */
int checkpoint_open(const char *path, struct checkpoint *ck, struct rumor_err *e) RUMOR_MUST_CHECK;
void checkpoint_close(struct checkpoint *ck);
/* Copies the parameters into `m` (same spec) and, when `o` is not NULL and
 * the file has optimizer state of the same kind, the state into `o` (whose
 * step is set from the file). */
int checkpoint_restore(const struct checkpoint *ck, struct model *m, struct optim *o,
                       struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_CHECKPOINT_H */
