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

#include "peer/data/dataset.h"
#include "peer/model/model.h"
#include "peer/model/optim.h"
#include "peer/train/safetensors.h"

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
 * failure the previous file at `path` is intact.
 *
 * Durability: the new file is written to a temporary name and fsynced; then
 * the file at `path` is hard-linked to `path`.prev (so the previous
 * checkpoint survives a later corruption of the current one) and the new file
 * is renamed over `path`, and the directory fsynced. At every instant `path`
 * is a complete checkpoint (the old one or the new one), and a failed write
 * (a full disk) changes neither `path` nor `path`.prev. Temporary files left
 * by processes that died mid-write (`path`.tmp.PID, PID no longer running)
 * are removed. */
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

/* The previous checkpoint's path: `path` with ".prev" appended. */
void checkpoint_prev_path(const char *path, char *out, size_t n);

/* Opens `path` like checkpoint_open; when it is missing, truncated or
 * damaged, logs why (naming the file and the fault) and opens `path`.prev
 * instead. *used (may be NULL) gets the path opened. Fails with both reasons
 * when neither is usable. */
int checkpoint_open_latest(const char *path, struct checkpoint *ck, char *used, size_t used_len,
                           struct rumor_err *e) RUMOR_MUST_CHECK;
/* Copies the parameters into `m` (same spec) and, when `o` is not NULL and
 * the file has optimizer state of the same kind, the state into `o` (whose
 * step is set from the file). */
int checkpoint_restore(const struct checkpoint *ck, struct model *m, struct optim *o,
                       struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_CHECKPOINT_H */
