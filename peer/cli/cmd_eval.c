/* `rumor eval`: accuracy of a checkpoint on a test set. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/cli/cli_impl.h"

int cmd_eval(int argc, char **argv) {
  const char *ckpt = NULL, *data = "/usr/share/datasets/fashion-mnist", *device = "auto", *split = "t10k";
  int64_t batch = 1000, threads = 0;
  const struct arg_spec specs[] = {
      {"checkpoint", ARG_STR, &ckpt, "FILE", "checkpoint to evaluate (required)"},
      {"data", ARG_STR, &data, "DIR", "directory with the IDX files"},
      {"split", ARG_STR, &split, "NAME", "which files: t10k (test) or train"},
      {"device", ARG_STR, &device, "DEV", "auto, cpu, cuda or cuda:N"},
      {"threads", ARG_INT, &threads, "N", "CPU threads (0: all cores)", 0, 4096},
      {"batch", ARG_INT, &batch, "N", "evaluation batch size", 1, 1048576},
      {0},
  };
  int ar = args_parse(specs, argc, argv, "rumor eval --checkpoint FILE [options]",
                      "Evaluates a checkpoint and prints accuracy and loss as JSON on stdout.");
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
  struct dataset ds;
  tensor_backend_t be = NULL;
  struct model m;
  memset(&m, 0, sizeof m);
  memset(&ds, 0, sizeof ds);
  int status = 1;
  if (checkpoint_open(ckpt, &ck, &e)) {
    fprintf(stderr, "rumor eval: %s\n", e.msg);
    return 1;
  }
  if (dataset_load_split(data, split, &ds, &e)) goto fail;
  struct model_io io;
  model_spec_io(&ck.info.spec, &io);
  if (io.input_dtype != TENSOR_F32 || io.labels_per_row != 1 || ds.features != io.input_per_row) {
    rumor_err_set(&e, RUMOR_ESHAPE, "the checkpoint's model takes %lld inputs but the images have %lld pixels",
                  (long long)io.input_per_row, (long long)ds.features);
    goto fail;
  }
  if (ds.num_classes > io.classes) {
    rumor_err_set(&e, RUMOR_ESHAPE, "the checkpoint's model has %lld outputs but the labels go up to %d",
                  (long long)io.classes, ds.num_classes - 1);
    goto fail;
  }
  if (tensor_backend_open(device, &be, &e)) goto fail;
  if (threads > 0) tensor_backend_set_threads(be, (int)threads);
  if (model_init_full(&m, &ck.info.spec, be, batch, &e) || checkpoint_restore(&ck, &m, NULL, &e)) goto fail;

  float lut[256];
  dataset_norm_lut(ck.info.norm_mean, ck.info.norm_std, lut);
  float *x = xmalloc((size_t)(batch * ds.features) * sizeof(float));
  int32_t *y = xmalloc((size_t)batch * sizeof(int32_t));
  int64_t correct = 0;
  double loss = 0;
  for (int64_t first = 0; first < ds.count; first += batch) {
    int64_t rows = ds.count - first < batch ? ds.count - first : batch;
    dataset_gather_range(&ds, lut, first, rows, x, y);
    tensor_copy_from_host(model_act(&m, 0), 0, x, (size_t)(rows * ds.features) * sizeof(float));
    tensor_copy_from_host(&m.labels, 0, y, (size_t)rows * sizeof(int32_t));
    model_evaluate(&m, rows, y, &correct, &loss);
  }
  free(x);
  free(y);
  printf("{\"checkpoint\":\"%s\",\"split\":\"%s\",\"samples\":%lld,\"accuracy\":%.6f,\"loss\":%.6f,\"step\":%lld}\n",
         ckpt, split, (long long)ds.count, (double)correct / (double)ds.count, loss / (double)ds.count,
         (long long)ck.info.st.step);
  status = 0;
fail:
  if (status) fprintf(stderr, "rumor eval: %s\n", e.msg);
  model_free(&m);
  tensor_backend_close(be);
  dataset_free(&ds);
  checkpoint_close(&ck);
  return status;
}
