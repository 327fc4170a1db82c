/*
 * train_impl.h — what the trainer's files share (private to peer/train/):
 * the data a trainer reads (source.c), as one interface over images with a
 * label each and token corpora.
 */
#ifndef RUMOR_PEER_TRAIN_IMPL_H
#define RUMOR_PEER_TRAIN_IMPL_H

#include "peer/train/train.h"

/* Loads cfg->data_dir (or the default for the model's input: Fashion-MNIST
 * for images, TOKEN_DEFAULT_CORPUS for tokens), checks that the model fits
 * it, and sets up this shard's batches. Image normalisation comes from
 * `resumed` when not NULL (the checkpoint's), else from the training set. */
int train_data_load(struct train_data *d, const struct train_config *cfg, const struct model_spec *spec,
                    const struct ckpt_info *resumed, struct rumor_err *e) RUMOR_MUST_CHECK;
void train_data_free(struct train_data *d);
/* Rows (samples or windows) in this process's shard. */
int64_t train_data_shard_rows(const struct train_data *d);
int64_t train_data_steps_per_epoch(const struct train_data *d, int64_t bs);
void train_data_start_epoch(struct train_data *d, int64_t epoch);
/* Batch `step` of the current epoch into x (rows × x_bytes_per_row) and y
 * (rows × y_per_row); returns the rows (<= bs). */
int64_t train_data_fill(const struct train_data *d, int64_t step, int64_t bs, void *x, int32_t *y);
/* Rows of the evaluation set (test images, or validation windows), at most
 * `cap` when cap > 0. */
int64_t train_data_eval_rows(const struct train_data *d, int64_t cap);
/* Rows of the training set in file order (trainer_check_loss). */
int64_t train_data_check_rows(const struct train_data *d);
/* Rows [first, first + rows) of the evaluation set (eval) or of the
 * training set, in file order, into x and y. */
void train_data_gather(const struct train_data *d, bool eval, int64_t first, int64_t rows, void *x, int32_t *y);

/* ---- a data-parallel member (zero.c; train.h's struct train_dp) ---- */

/* After the model holds its parameters: the pieces, the buffers, and (ZeRO
 * 2/3) the memory of what this member does not keep given back. The
 * optimizer is already a range optimizer over this member's piece for
 * ZeRO >= 1 (trainer_init: zero_piece). */
int zero_init(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
void zero_free(struct trainer *t);
/* ZeRO 0-2: every member's piece of the parameters to every member (after
 * the pieces changed outside a step, or a lazy step left them partial:
 * trainer_group_resync, trainer_evaluate). Collective. */
int zero_gather_params(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* ZeRO 0, whose members each hold the whole optimizer state: every
 * member's piece of each moment to every member (after each loaded its
 * piece's state pulled from another group). Collective. */
int zero_gather_state(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* This member's piece [*lo, *hi) of a flat buffer of n floats. */
void zero_piece(const struct train_dp *dp, int64_t n, int64_t *lo, int64_t *hi);
/* One step on the staged batch (x, y: all `rows` rows of it; this member
 * trains on its slice): forward, backward, the group's gradient, the
 * update. *loss gets the whole batch's mean loss. */
int zero_step(struct trainer *t, double lr, int64_t rows, const void *x, const int32_t *y, double *loss,
              struct rumor_err *e) RUMOR_MUST_CHECK;
/* The group's update after this member's gradient is in model.grads (ZeRO
 * 0 and 1: all of it; ZeRO 2: its piece already reduce-scattered): ZeRO 0
 * all-reduces the gradient and every member updates everything; ZeRO 1
 * reduce-scatters it, updates its piece and all-gathers the parameters;
 * ZeRO 2 and 3 update the piece (ZeRO 2 all-gathers after). --grad-clip
 * clips by the norm over what the members hold together. zero_step ends
 * with it; a pipeline stage's members call it after their pipelined step
 * (each member's gradient scaled by the whole batch's targets, so the sum
 * is the batch's mean). With a reducer (--sync allreduce between groups),
 * each member's piece of the batch's (`rows`) gradient is then averaged
 * with the same piece of other groups (group_reduce_between). Collective
 * over the members. Returns 0, 1 when the group dropped the step, or a
 * negative code. */
int zero_update(struct trainer *t, double lr, int64_t rows, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Adds the whole batch's correct predictions and summed loss (every member
 * gets the group's figures) for an evaluation batch of `rows`. */
int zero_evaluate(struct trainer *t, int64_t rows, const void *x, const int32_t *y, int64_t *correct, double *loss,
                  struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- what the members of a group that splits one replica share
 * (group_state.c: tensor-parallel ranks, data-parallel members) ---- */

/* Fills t->tp (cfg.tp's rank, size and collectives) for model_init_tp. */
void group_tp_setup(struct trainer *t);
/* Makes the model an expert-parallel rank over cfg.dp->experts
 * (model_use_ep with t->ep). Returns 0 or model_use_ep's error. */
int group_ep_setup(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* A tensor- or expert-parallel rank's collective failed during the last
 * passes (the model records it, model.h): returns its code with its
 * message, else 0. */
int group_pass_failed(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* --sync allreduce between groups (train_reducer): this process's shard
 * of the group's gradient of the batch's `rows` (complete where it holds
 * it; a pipeline stage's slice, or a piece of it) becomes the mean with
 * the same shard of the other groups, each process over its own ring. The
 * processes (a pipelined group's: in each stage, then across the stages
 * over the links, pipeline_agree) then agree whether any dropped
 * the step (it caught up with a donor's shard, or its ring's sum was not
 * finite): then all drop it, as ZeRO 0 members, which update everything,
 * must, and go on from one step: the latest any took, those whose shards
 * are older taking theirs again from their rings (train_reducer.catch_up)
 * until all hold shards of that step. Meanwhile waiting processes serve
 * the states other groups' processes pull (comm_set_idle). Tensor-parallel
 * ranks average their replicated parameters' gradients after it (their
 * rings may have summed over different groups while membership changed);
 * ZeRO 1-2 ranks, which hold only their piece of them, their replicated
 * parameters after every step (trainer_group_resync). Returns 0, 1
 * (dropped) or a negative code. Collective over the group. */
int group_reduce_between(struct trainer *t, int64_t rows, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The gradient's global norm squared, from model.grads' elements [lo, hi)
 * of the buffer this process holds (a ZeRO piece, or all of it), summed
 * over `over` (NULL: this process alone); a tensor-parallel rank counts a
 * replicated parameter only on rank 0. */
int group_grad_sq_norm(struct trainer *t, int64_t lo, int64_t hi, comm_t *over, double *out,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
/* Clips model.grads[lo, hi) by that norm (--grad-clip), as
 * trainer_clip_gradients does for one process. */
int group_clip(struct trainer *t, int64_t lo, int64_t hi, comm_t *over, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The whole model's state (parameters, then each optimizer part: the
 * single process's layout, and the sync scheme's state, train_config.extra,
 * its per-parameter segments put together in that layout too) gathered to
 * the group's first process, which writes it to `path`; every member
 * learns whether it was written. `info->extra` is ignored (trainer_save
 * leaves it empty for a group); restore_extra (train.c) reads it back. */
int group_save(struct trainer *t, const char *path, const struct ckpt_info *info, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The refusal to save `bad` (> 0) non-finite parameters over `path`
 * (trainer_save, group_save): sets *e and returns RUMOR_EDIVERGED. */
int trainer_refuse_nonfinite(const struct trainer *t, int64_t bad, const char *path, struct rumor_err *e);
/* The buffer this process holds, from the whole model's parameters (and
 * optimizer state, when `state` is not NULL: each part P floats) in host
 * memory: a tensor-parallel rank takes its slices, a ZeRO member its piece
 * of the optimizer state. */
void group_load(struct trainer *t, const float *params, const float *const *state);

/* ZeRO: the members' pieces (zero.c), for group_state.c: the local state
 * (parameters, then each optimizer part, all of the buffer this process
 * holds) gathered to data-parallel member 0, into `local` there (NULL on
 * the others). */
int zero_gather_local(struct trainer *t, float *local, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Every member's piece (`mine`: host memory, this member's piece's floats)
 * to member 0, into dst[0..model.nparams) in piece order (dst NULL
 * elsewhere). Collective over the data-parallel members. */
int zero_gather_host(struct trainer *t, const float *mine, float *dst, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_TRAIN_IMPL_H */
