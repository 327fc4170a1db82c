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
/* This member's piece [*lo, *hi) of a flat buffer of n floats. */
void zero_piece(const struct train_dp *dp, int64_t n, int64_t *lo, int64_t *hi);
/* One step on the staged batch (x, y: all `rows` rows of it; this member
 * trains on its slice): forward, backward, the group's gradient, the
 * update. *loss gets the whole batch's mean loss. */
int zero_step(struct trainer *t, double lr, int64_t rows, const void *x, const int32_t *y, double *loss,
              struct rumor_err *e) RUMOR_MUST_CHECK;
/* Adds the whole batch's correct predictions and summed loss (every member
 * gets the group's figures) for an evaluation batch of `rows`. */
int zero_evaluate(struct trainer *t, int64_t rows, const void *x, const int32_t *y, int64_t *correct, double *loss,
                  struct rumor_err *e) RUMOR_MUST_CHECK;
/* Gathers the whole state; member 0 writes it to `path` (the single
 * process's layout: any layout loads it). */
int zero_save(struct trainer *t, const char *path, const struct ckpt_info *info, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_TRAIN_IMPL_H */
