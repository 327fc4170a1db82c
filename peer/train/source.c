/* What a trainer reads: images with a label each, or a token corpus. */
#include "peer/train/train_impl.h"

#include <string.h>

static int load_images(struct train_data *d, const struct train_config *cfg, const struct model_spec *spec,
                       struct rumor_err *e) {
  const char *dir = cfg->data_dir ? cfg->data_dir : TRAIN_DEFAULT_IMAGES;
  int rc = dataset_load_split(dir, "train", &d->train, e);
  if (rc) return rumor_err_prefix(e, "training data");
  rc = dataset_load_split(dir, "t10k", &d->test, e);
  if (rc) return rumor_err_prefix(e, "test data");
  d->have_eval = true;
  if (d->test.features != d->train.features)
    return rumor_err_set(e, RUMOR_ECORRUPT, "test images are %lldx%lld but training images are %lldx%lld",
                         (long long)d->test.rows, (long long)d->test.cols, (long long)d->train.rows,
                         (long long)d->train.cols);
  char s[MODEL_SPEC_MAX];
  model_spec_format(spec, s, sizeof s);
  struct model_io io;
  model_spec_io(spec, &io);
  if (io.input_dtype != TENSOR_F32 || io.labels_per_row != 1)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s does not take images with one label each", s);
  if (io.input_per_row != d->train.features)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s takes %lld inputs but the images have %lldx%lld = %lld pixels", s,
                         (long long)io.input_per_row, (long long)d->train.rows, (long long)d->train.cols,
                         (long long)d->train.features);
  int classes = d->train.num_classes > d->test.num_classes ? d->train.num_classes : d->test.num_classes;
  if (io.classes < classes)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s has %lld outputs but the labels go up to %d", s,
                         (long long)io.classes, classes - 1);
  d->x_bytes_per_row = (size_t)d->train.features * sizeof(float);
  d->y_per_row = 1;
  return 0;
}

static int load_tokens(struct train_data *d, const struct train_config *cfg, const struct model_io *io,
                       struct rumor_err *e) {
  const char *spec = cfg->data_dir ? cfg->data_dir : TOKEN_DEFAULT_CORPUS;
  int rc = token_corpus_load(&d->corpus, spec, io->classes, io->input_per_row, cfg->val_fraction, e);
  if (rc) return rc;
  d->tokens = true;
  d->context = io->input_per_row;
  d->have_eval = d->corpus.val.nsegs > 0;
  d->x_bytes_per_row = (size_t)d->context * sizeof(int32_t);
  d->y_per_row = d->context;
  return 0;
}

int train_data_load(struct train_data *d, const struct train_config *cfg, const struct model_spec *spec,
                    const struct ckpt_info *resumed, struct rumor_err *e) {
  memset(d, 0, sizeof *d);
  struct model_io io;
  model_spec_io(spec, &io);
  int rc = io.input_dtype == TENSOR_I32 ? load_tokens(d, cfg, &io, e) : load_images(d, cfg, spec, e);
  if (rc) return rc;
  if (d->tokens) {
    d->norm_mean = 0.0; /* unused for tokens; checkpoints carry them for images */
    d->norm_std = 1.0;
    return token_batcher_init(&d->tb, &d->corpus.train, d->context, cfg->shard, cfg->data_seed, cfg->seed, e);
  }
  if (resumed) {
    d->norm_mean = resumed->norm_mean;
    d->norm_std = resumed->norm_std;
  } else {
    dataset_pixel_stats(&d->train, &d->norm_mean, &d->norm_std);
  }
  dataset_norm_lut(d->norm_mean, d->norm_std, d->lut);
  return batcher_init(&d->batcher, &d->train, cfg->shard, cfg->data_seed, cfg->seed, d->norm_mean, d->norm_std, e);
}

void train_data_free(struct train_data *d) {
  batcher_free(&d->batcher);
  dataset_free(&d->train);
  dataset_free(&d->test);
  token_batcher_free(&d->tb);
  token_corpus_free(&d->corpus);
  memset(d, 0, sizeof *d);
}

int64_t train_data_shard_rows(const struct train_data *d) { return d->tokens ? d->tb.rows.n : d->batcher.rows.n; }

int64_t train_data_steps_per_epoch(const struct train_data *d, int64_t bs) {
  return shard_order_steps(d->tokens ? &d->tb.rows : &d->batcher.rows, bs);
}

void train_data_start_epoch(struct train_data *d, int64_t epoch) {
  shard_order_start_epoch(d->tokens ? &d->tb.rows : &d->batcher.rows, epoch);
}

int64_t train_data_fill(const struct train_data *d, int64_t step, int64_t bs, void *x, int32_t *y) {
  return d->tokens ? token_batcher_fill(&d->tb, step, bs, x, y) : batcher_fill(&d->batcher, step, bs, x, y);
}

int64_t train_data_eval_rows(const struct train_data *d, int64_t cap) {
  int64_t n = !d->have_eval ? 0 : d->tokens ? token_split_windows(&d->corpus.val, d->context) : d->test.count;
  return cap > 0 && n > cap ? cap : n;
}

int64_t train_data_check_rows(const struct train_data *d) {
  return d->tokens ? token_split_windows(&d->corpus.train, d->context) : d->train.count;
}

void train_data_gather(const struct train_data *d, bool eval, int64_t first, int64_t rows, void *x, int32_t *y) {
  if (d->tokens)
    token_split_gather(eval ? &d->corpus.val : &d->corpus.train, d->context, first, rows, x, y);
  else
    dataset_gather_range(eval ? &d->test : &d->train, d->lut, first, rows, x, y);
}
