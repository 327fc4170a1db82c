/* `rumor eval`: a checkpoint's accuracy on a test set, or a language
 * model's validation loss. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

/* A stop signal ended the evaluation after `done` of `total` rows: the
 * command prints no result and exits as an interrupted `rumor train`. */
static int interrupted(int64_t done, int64_t total, const char *rows, struct rumor_err *e) {
  return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d after %lld of %lld %s", signals_stop_requested(),
                       (long long)done, (long long)total, rows);
}

/* A language model's loss per token and next-token accuracy on the
 * validation windows of `data` (as training splits it), in batches. */
static int eval_tokens(const char *ckpt, struct checkpoint *ck, const char *data, double val_fraction, int64_t batch,
                       int64_t max_batches, tensor_backend_t be, struct rumor_err *e) {
  struct model_io io;
  model_spec_io(&ck->info.spec, &io);
  struct token_corpus c;
  if (!data) data = TOKEN_DEFAULT_CORPUS;
  int rc = token_corpus_load(&c, data, io.classes, io.input_per_row, val_fraction, e);
  if (rc) return rc;
  struct model m;
  memset(&m, 0, sizeof m);
  int64_t T = io.input_per_row, n = token_split_windows(&c.val, T);
  if (max_batches > 0 && n > max_batches * batch) n = max_batches * batch;
  if (n == 0) rc = rumor_err_set(e, RUMOR_EFORMAT, "%s has no validation windows (--val-fraction 0?)", data);
  int64_t correct = 0, first = 0;
  double loss = 0;
  if (rc == 0 && (rc = model_init_full(&m, &ck->info.spec, be, batch, e)) == 0 &&
      (rc = checkpoint_restore(ck, &m, NULL, e)) == 0) {
    int32_t *x = xmalloc((size_t)(batch * T) * sizeof(int32_t)), *y = xmalloc((size_t)(batch * T) * sizeof(int32_t));
    for (; first < n && !signals_stop_requested(); first += batch) {
      int64_t rows = n - first < batch ? n - first : batch;
      token_split_gather(&c.val, T, first, rows, x, y);
      tensor_copy_from_host(model_act(&m, 0), 0, x, (size_t)(rows * T) * sizeof(int32_t));
      tensor_copy_from_host(&m.labels, 0, y, (size_t)(rows * T) * sizeof(int32_t));
      model_evaluate(&m, rows, y, &correct, &loss);
    }
    free(x);
    free(y);
    if (first < n) rc = interrupted(first, n, "windows", e);
  }
  if (rc == 0) {
    double targets = (double)(n * T);
    json_t *o = result_open();
    json_text_set(o, "checkpoint", json_text_str(ckpt));
    json_text_set(o, "windows", json_integer(n));
    json_text_set(o, "tokens", json_integer(n * T));
    json_text_set(o, "val_loss", json_text_real(loss / targets));
    json_text_set(o, "val_token_accuracy", json_text_real((double)correct / targets));
    json_text_set(o, "step", json_integer(ck->info.st.step));
    result_print(o);
  }
  model_free(&m);
  token_corpus_free(&c);
  return rc;
}

/* An MLP's accuracy and mean loss on the `split` images of `data`, in
 * batches. Opens the backend into *be (the caller closes it) once the data
 * fits the model, so that a bad data directory is reported first. */
static int eval_images(const char *ckpt, struct checkpoint *ck, const char *data, const char *split, int64_t batch,
                       const char *device, int threads, tensor_backend_t *be, struct rumor_err *e) {
  struct model_io io;
  model_spec_io(&ck->info.spec, &io);
  struct dataset ds;
  memset(&ds, 0, sizeof ds);
  struct model m;
  memset(&m, 0, sizeof m);
  int rc = dataset_load_split(data, split, &ds, e);
  if (rc) return rc;
  if (io.input_dtype != TENSOR_F32 || io.labels_per_row != 1 || ds.features != io.input_per_row)
    rc = rumor_err_set(e, RUMOR_ESHAPE, "the checkpoint's model takes %lld inputs but the images have %lld pixels",
                       (long long)io.input_per_row, (long long)ds.features);
  else if (ds.num_classes > io.classes)
    rc = rumor_err_set(e, RUMOR_ESHAPE, "the checkpoint's model has %lld outputs but the labels go up to %d",
                       (long long)io.classes, ds.num_classes - 1);
  else if ((rc = tensor_backend_open(device, be, e)) == 0) {
    if (threads > 0) tensor_backend_set_threads(*be, threads);
    if ((rc = model_init_full(&m, &ck->info.spec, *be, batch, e)) == 0) rc = checkpoint_restore(ck, &m, NULL, e);
  }
  int64_t correct = 0, first = 0;
  double loss = 0;
  if (rc == 0) {
    float lut[256];
    dataset_norm_lut(ck->info.norm_mean, ck->info.norm_std, lut);
    float *x = xmalloc((size_t)(batch * ds.features) * sizeof(float));
    int32_t *y = xmalloc((size_t)batch * sizeof(int32_t));
    for (; first < ds.count && !signals_stop_requested(); first += batch) {
      int64_t rows = ds.count - first < batch ? ds.count - first : batch;
      dataset_gather_range(&ds, lut, first, rows, x, y);
      tensor_copy_from_host(model_act(&m, 0), 0, x, (size_t)(rows * ds.features) * sizeof(float));
      tensor_copy_from_host(&m.labels, 0, y, (size_t)rows * sizeof(int32_t));
      model_evaluate(&m, rows, y, &correct, &loss);
    }
    free(x);
    free(y);
    if (first < ds.count) rc = interrupted(first, ds.count, "samples", e);
  }
  if (rc == 0) {
    json_t *o = result_open();
    json_text_set(o, "checkpoint", json_text_str(ckpt));
    json_text_set(o, "split", json_text_str(split));
    json_text_set(o, "samples", json_integer(ds.count));
    json_text_set(o, "accuracy", json_text_real((double)correct / (double)ds.count));
    json_text_set(o, "loss", json_text_real(loss / (double)ds.count));
    json_text_set(o, "step", json_integer(ck->info.st.step));
    result_print(o);
  }
  model_free(&m);
  dataset_free(&ds);
  return rc;
}

int cmd_eval(int argc, char **argv) {
  const char *ckpt = NULL, *data = NULL, *device = "auto", *split = "t10k";
  int64_t batch = 0, threads = 0, max_batches = 0;
  double val_fraction = 0.1;
  const struct arg_spec specs[] = {
      {"checkpoint", ARG_STR, &ckpt, "PATH", "checkpoint to evaluate, a file or a directory (required)"},
      {"data", ARG_STR, &data, "PATH",
       "an MLP's directory of IDX files (default " TRAIN_DEFAULT_IMAGES "); a language model's text or token "
       "shards (default " TOKEN_DEFAULT_CORPUS ")"},
      {"split", ARG_STR, &split, "NAME", "images: which files, t10k (test) or train"},
      {"val-fraction", ARG_FLOAT, &val_fraction, "X", "tokens: the end of the stream that is validation", 0, 0.9},
      {"eval-batches", ARG_INT, &max_batches, "N", "tokens: at most N batches of validation windows (0: all)", 0,
       1e15},
      {"device", ARG_STR, &device, "DEV", "auto, cpu, cuda or cuda:N"},
      {"threads", ARG_INT, &threads, "N", "CPU threads (0: all cores)", 0, 4096},
      {"batch", ARG_INT, &batch, "N", "evaluation batch size (default 1000 images, 8 sequences)", 0, 1048576},
      {0},
  };
  int ar = args_parse(specs, argc, argv, "rumor eval --checkpoint PATH [options]",
                      "Evaluates a checkpoint and prints accuracy and loss as JSON on stdout: an MLP's on a test "
                      "set, a language model's loss per token on the validation windows of its text. "
                      "SIGINT/SIGTERM stop it between batches: no result, exit status 130.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  if (!ckpt) {
    fprintf(stderr, "rumor eval: --checkpoint FILE is required\n");
    return 2;
  }
  if (strcmp(split, "t10k") != 0 && strcmp(split, "train") != 0) {
    fprintf(stderr, "rumor eval: --split must be t10k or train, not '%s'\n", split);
    return 2;
  }
  struct rumor_err e = {0};
  struct checkpoint ck;
  if (checkpoint_open(ckpt, &ck, &e)) {
    fprintf(stderr, "rumor eval: %s\n", e.msg);
    return 1;
  }
  struct model_io io;
  model_spec_io(&ck.info.spec, &io);
  tensor_backend_t be = NULL;
  int rc;
  if (io.input_dtype == TENSOR_I32) {
    if ((rc = tensor_backend_open(device, &be, &e)) == 0) {
      if (threads > 0) tensor_backend_set_threads(be, (int)threads);
      rc = eval_tokens(ckpt, &ck, data, val_fraction, batch ? batch : 8, max_batches, be, &e);
    }
  } else {
    rc = eval_images(ckpt, &ck, data ? data : TRAIN_DEFAULT_IMAGES, split, batch ? batch : 1000, device, (int)threads,
                     &be, &e);
  }
  int status = rc == 0 ? 0 : rc == RUMOR_ECANCELED && signals_stop_requested() ? CLI_EXIT_INTERRUPTED : 1;
  if (rc) fprintf(stderr, "rumor eval: %s\n", e.msg);
  tensor_backend_close(be);
  checkpoint_close(&ck);
  return status;
}
