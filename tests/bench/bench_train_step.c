/* Times rumor's training step (forward, loss, backward, SGD-momentum update)
 * on random data and prints one JSON line with samples/s. Run by
 * bench-train-step.sh next to the PyTorch version of the same step. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/cli/cli_impl.h"
#include "peer/model/model.h"

int main(int argc, char **argv) {
  const char *spec_s = "mlp:784-512-256-10", *device = "cpu";
  int64_t batch = 128, threads = 1, steps = 200, warmup = 20;
  const struct arg_spec specs[] = {
      {"model", ARG_STR, &spec_s, "SPEC", "model spec"},
      {"device", ARG_STR, &device, "DEV", "cpu, cuda, cuda:N"},
      {"batch", ARG_INT, &batch, "N", "batch size", 1, 1 << 20},
      {"threads", ARG_INT, &threads, "N", "CPU threads", 1, 1024},
      {"steps", ARG_INT, &steps, "N", "timed steps", 1, 1e9},
      {"warmup", ARG_INT, &warmup, "N", "untimed steps first", 0, 1e9},
      {0},
  };
  if (args_parse(specs, argc, argv, "bench_train_step [options]", "Times rumor's training step.") != ARGS_OK) return 2;
  struct rumor_err e;
  struct model_spec spec;
  tensor_backend_t be;
  if (model_spec_parse(spec_s, &spec, &e) || tensor_backend_open(device, &be, &e)) {
    fprintf(stderr, "%s\n", e.msg);
    return 1;
  }
  tensor_backend_set_threads(be, (int)threads);
  struct model m;
  struct optim o;
  struct optim_config oc;
  optim_config_default(&oc);
  if (model_init_full(&m, &spec, be, batch, &e) || optim_init(&o, &oc, &m, &e)) {
    fprintf(stderr, "%s\n", e.msg);
    return 1;
  }
  model_init_params(&m, 1);
  int64_t in = m.io.input_per_row, classes = m.io.classes;
  float *x = tensor_host_alloc(be, (size_t)(batch * in) * sizeof(float));
  int32_t *y = tensor_host_alloc(be, (size_t)batch * sizeof(int32_t));
  struct rng r;
  rng_seed(&r, 3, 0);
  for (int64_t i = 0; i < batch * in; i++) x[i] = rng_normal(&r);
  for (int64_t i = 0; i < batch; i++) y[i] = (int32_t)rng_below(&r, (uint64_t)classes);

  double t0 = 0;
  float loss = 0;
  for (int64_t s = 0; s < warmup + steps; s++) {
    if (s == warmup) {
      tensor_backend_sync(be);
      t0 = clock_now_s();
    }
    /* The same per-step work as the trainer: upload the batch, step, read the loss. */
    tensor_copy_from_host_async(model_act(&m, 0), 0, x, (size_t)(batch * in) * sizeof(float));
    tensor_copy_from_host_async(&m.labels, 0, y, (size_t)batch * sizeof(int32_t));
    model_forward_backward(&m, batch);
    optim_apply(&o, &m.params, &m.grads, 0.01);
    loss = model_mean_loss(&m, batch);
  }
  double dt = clock_now_s() - t0;
  printf("{\"impl\":\"rumor\",\"model\":\"%s\",\"device\":\"%s\",\"batch\":%lld,\"threads\":%lld,"
         "\"ms_per_step\":%.4f,\"samples_per_s\":%.1f,\"loss\":%.4f}\n",
         spec_s, tensor_backend_name(be), (long long)batch, (long long)threads, dt / (double)steps * 1e3,
         (double)(steps * batch) / dt, loss);
  tensor_host_free(be, x);
  tensor_host_free(be, y);
  optim_free(&o);
  model_free(&m);
  tensor_backend_close(be);
  return 0;
}
