/* Finite-difference gradient checks of every layer (weights, biases, inputs)
 * and of the loss, for ReLU and GELU networks, and the equivalence of a
 * backward pass split into layer ranges (as pipeline stages run it) with the
 * whole one. Seeds are fixed so that no pre-activation sits on a ReLU kink.
 * The layer checks run on CUDA too, where the same networks' gradients must
 * also equal the CPU's; those skip with a message where no GPU is usable. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/model.h"
#include "tensor/tensor_ref.h"

#define BATCH 4
#define EPS 1e-3f

static tensor_backend_t be;

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
}
static void teardown(void) { tensor_backend_close(be); }
TestSuite(gradcheck, .init = setup, .fini = teardown);

static void make_model(struct model *m, const char *spec_str, uint64_t seed, float *x, int32_t *y) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(spec_str, &spec, &e), 0, "%s", e.msg);
  cr_assert_eq(model_init_full(m, &spec, be, BATCH, &e), 0, "%s", e.msg);
  model_init_params(m, seed);
  struct rng r;
  rng_seed(&r, seed, 99);
  int64_t in = m->io.input_per_row, C = m->io.classes;
  for (int64_t i = 0; i < BATCH * in; i++) x[i] = rng_normal(&r);
  for (int64_t b = 0; b < BATCH; b++) y[b] = (int32_t)rng_below(&r, (uint64_t)C);
  tensor_copy_from_host(model_act(m, 0), 0, x, (size_t)(BATCH * in) * sizeof(float));
  tensor_copy_from_host(&m->labels, 0, y, BATCH * sizeof(int32_t));
}

static float loss_now(struct model *m, const float *x) {
  tensor_copy_from_host(model_act(m, 0), 0, x, (size_t)(BATCH * m->io.input_per_row) * sizeof(float));
  int L = m->table.nunits;
  model_forward(m, 0, L, BATCH);
  model_loss(m, BATCH, model_act(m, L), 1.0f / BATCH);
  return model_mean_loss(m, BATCH);
}

static void check_close(const char *what, int64_t i, double ana, double num) {
  cr_assert(fabs(ana - num) <= 2e-3 + 2e-2 * fabs(num), "%s[%lld]: analytic %.6g vs numeric %.6g", what,
            (long long)i, ana, num);
}

static void gradcheck_spec(const char *spec_str, uint64_t seed) {
  struct model m;
  float x[BATCH * 16];
  int32_t y[BATCH];
  make_model(&m, spec_str, seed, x, y);
  int64_t P = m.nparams, in = m.io.input_per_row;
  int L = m.table.nunits;

  /* Analytic gradients, including dL/dx through din. */
  struct tensor din;
  struct rumor_err e;
  int64_t ds[2] = {BATCH, in};
  cr_assert_eq(tensor_alloc(&din, be, TENSOR_F32, 2, ds, &e), 0);
  model_forward(&m, 0, L, BATCH);
  model_loss(&m, BATCH, model_act(&m, L), 1.0f / BATCH);
  model_backward(&m, 0, L, BATCH, model_act(&m, L), &din, false);
  float *grad = xmalloc((size_t)P * sizeof(float)), *params = xmalloc((size_t)P * sizeof(float));
  float dx[BATCH * 16];
  tensor_copy_to_host(&m.grads, 0, grad, (size_t)P * sizeof(float));
  tensor_copy_to_host(&m.params, 0, params, (size_t)P * sizeof(float));
  tensor_copy_to_host(&din, 0, dx, (size_t)(BATCH * in) * sizeof(float));

  /* Every entry of the parameter table. */
  for (size_t k = 0; k < m.table.n; k++) {
    const struct model_param *mp = &m.table.p[k];
    int64_t off = mp->offset, n = mp->numel;
    for (int64_t i = off; i < off + n; i++) {
      float saved = params[i];
      params[i] = saved + EPS;
      tensor_copy_from_host(&m.params, i, &params[i], sizeof(float));
      float lp = loss_now(&m, x);
      params[i] = saved - EPS;
      tensor_copy_from_host(&m.params, i, &params[i], sizeof(float));
      float lm = loss_now(&m, x);
      params[i] = saved;
      tensor_copy_from_host(&m.params, i, &params[i], sizeof(float));
      char what[160];
      snprintf(what, sizeof what, "%s %s", spec_str, mp->name);
      check_close(what, i - off, grad[i], ((double)lp - lm) / (2.0 * EPS));
    }
  }
  /* The input gradient. */
  for (int64_t i = 0; i < BATCH * in; i++) {
    float saved = x[i];
    x[i] = saved + EPS;
    float lp = loss_now(&m, x);
    x[i] = saved - EPS;
    float lm = loss_now(&m, x);
    x[i] = saved;
    check_close("input", i, dx[i], ((double)lp - lm) / (2.0 * EPS));
  }
  free(grad);
  free(params);
  tensor_free(&din);
  model_free(&m);
}

/* The gradient of `spec_str` (seed `seed`) on the suite's backend, and its
 * input gradient: P + BATCH·in floats into out (malloc'd). */
static float *analytic_grads(const char *spec_str, uint64_t seed, int64_t *count) {
  struct model m;
  float x[BATCH * 16];
  int32_t y[BATCH];
  make_model(&m, spec_str, seed, x, y);
  const int64_t P = m.nparams, in = m.io.input_per_row;
  const int L = m.table.nunits;
  struct tensor din;
  struct rumor_err e;
  int64_t ds[2] = {BATCH, in};
  cr_assert_eq(tensor_alloc(&din, be, TENSOR_F32, 2, ds, &e), 0);
  model_forward(&m, 0, L, BATCH);
  model_loss(&m, BATCH, model_act(&m, L), 1.0f / BATCH);
  model_backward(&m, 0, L, BATCH, model_act(&m, L), &din, false);
  float *out = xmalloc((size_t)(P + BATCH * in) * sizeof(float));
  tensor_copy_to_host(&m.grads, 0, out, (size_t)P * sizeof(float));
  tensor_copy_to_host(&din, 0, out + P, (size_t)(BATCH * in) * sizeof(float));
  *count = P + BATCH * in;
  tensor_free(&din);
  model_free(&m);
  return out;
}

Test(gradcheck, relu_mlp_every_layer_and_input) { gradcheck_spec("mlp:6-5-4-3", 3); }

/* The same networks on CUDA: finite differences on the GPU (float32 loss
 * there too, same tolerance), and the analytic gradients equal to the
 * CPU's within 1e-6 + 1e-4·|cpu| (FP32 both; cuBLAS's and the kernels'
 * summation orders differ from the CPU's, by ~1e-7 at these sizes). */
Test(gradcheck, on_cuda_every_layer_and_input_and_the_cpus_gradients) {
  if (tensor_cuda_device_count() == 0)
    cr_skip_test("no CUDA GPU: tensor_cuda_device_count() is 0 (%s); CUDA variant skipped",
                 tensor_cuda_compiled() ? "built with CUDA, but no usable device or driver" : "built without CUDA");
  tensor_backend_t cpu = be, gpu;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_backend_open("cuda:0", &gpu, &e), 0, "%s", e.msg);
  const struct {
    const char *spec;
    uint64_t seed;
  } nets[] = {{"mlp:6-5-4-3", 3}, {"mlp:6-5-4-3:gelu", 5}, {"mlp:7-4", 11}};
  for (size_t i = 0; i < sizeof nets / sizeof nets[0]; i++) {
    be = gpu;
    gradcheck_spec(nets[i].spec, nets[i].seed);
    int64_t ng = 0, nc = 0;
    float *g = analytic_grads(nets[i].spec, nets[i].seed, &ng);
    be = cpu;
    float *c = analytic_grads(nets[i].spec, nets[i].seed, &nc);
    cr_assert_eq(ng, nc);
    for (int64_t k = 0; k < ng; k++)
      cr_assert(fabs(g[k] - c[k]) <= 1e-6 + 1e-4 * fabs(c[k]), "%s: gradient %lld: cuda %.9g vs cpu %.9g",
                nets[i].spec, (long long)k, g[k], c[k]);
    free(g), free(c);
  }
  be = cpu;
  tensor_backend_close(gpu);
}
Test(gradcheck, gelu_mlp_every_layer_and_input) { gradcheck_spec("mlp:6-5-4-3:gelu", 5); }
Test(gradcheck, single_layer_softmax_regression) { gradcheck_spec("mlp:7-4", 11); }

Test(gradcheck, loss_gradient_wrt_logits) {
  /* d(mean loss)/d logits by finite differences against the op's output. */
  int64_t R = 5, C = 7;
  float logits[35], dl[35], losses[5];
  int32_t labels[5];
  struct rng r;
  rng_seed(&r, 21, 0);
  for (int i = 0; i < R * C; i++) logits[i] = 3.0f * rng_normal(&r);
  for (int i = 0; i < R; i++) labels[i] = (int32_t)rng_below(&r, (uint64_t)C);
  tensor_ref_softmax_xent(logits, labels, dl, losses, R, C, 1.0f / (float)R);
  for (int i = 0; i < R * C; i++) {
    double lp = 0, lm = 0;
    float scratch[35], ls[5];
    float saved = logits[i];
    logits[i] = saved + 1e-2f;
    tensor_ref_softmax_xent(logits, labels, scratch, ls, R, C, 1.0f);
    for (int k = 0; k < R; k++) lp += ls[k];
    logits[i] = saved - 1e-2f;
    tensor_ref_softmax_xent(logits, labels, scratch, ls, R, C, 1.0f);
    for (int k = 0; k < R; k++) lm += ls[k];
    logits[i] = saved;
    check_close("dlogits", i, dl[i], (lp - lm) / (2e-2 * (double)R));
  }
}

Test(gradcheck, backward_split_into_ranges_equals_whole) {
  /* What a 2-stage pipeline does: stage 1 runs layers [1, 3) and hands
   * dL/d acts[1] to stage 0, which runs [0, 1). */
  struct model m;
  float x[BATCH * 16];
  int32_t y[BATCH];
  make_model(&m, "mlp:6-5-4-3", 8, x, y);
  int64_t P = m.nparams;
  model_forward_backward(&m, BATCH);
  float *whole = xmalloc((size_t)P * 4), *split = xmalloc((size_t)P * 4);
  tensor_copy_to_host(&m.grads, 0, whole, (size_t)P * 4);

  struct tensor dmid, dout;
  struct rumor_err e;
  int64_t ms[2] = {BATCH, 5}, os[2] = {BATCH, 3};
  cr_assert_eq(tensor_alloc(&dmid, be, TENSOR_F32, 2, ms, &e), 0);
  cr_assert_eq(tensor_alloc(&dout, be, TENSOR_F32, 2, os, &e), 0);
  tensor_fill(&m.grads, NAN);
  model_forward(&m, 0, 1, BATCH);
  model_forward(&m, 1, 3, BATCH);
  model_loss(&m, BATCH, &dout, 1.0f / BATCH);
  model_backward(&m, 1, 3, BATCH, &dout, &dmid, false);
  model_backward(&m, 0, 1, BATCH, &dmid, NULL, false);
  tensor_copy_to_host(&m.grads, 0, split, (size_t)P * 4);
  for (int64_t i = 0; i < P; i++)
    cr_assert(fabs(whole[i] - split[i]) <= 1e-6f * (1 + fabsf(whole[i])), "grad %lld: whole %g split %g",
              (long long)i, whole[i], split[i]);

  /* accumulate=true adds: two micro-batch passes of the same rows give 2×. */
  model_forward_backward(&m, BATCH);
  model_forward(&m, 0, 3, BATCH);
  model_loss(&m, BATCH, &dout, 1.0f / BATCH);
  model_backward(&m, 0, 3, BATCH, &dout, NULL, true);
  tensor_copy_to_host(&m.grads, 0, split, (size_t)P * 4);
  for (int64_t i = 0; i < P; i++)
    cr_assert(fabs(2 * whole[i] - split[i]) <= 1e-6f * (1 + fabsf(whole[i])), "accumulated grad %lld", (long long)i);
  free(whole);
  free(split);
  tensor_free(&dmid);
  tensor_free(&dout);
  model_free(&m);
}

Test(gradcheck, spec_parse_format_and_errors) {
  struct model_spec s;
  struct rumor_err e;
  char buf[MODEL_SPEC_MAX];
  cr_assert_eq(model_spec_parse("mlp:784-512-256-10", &s, &e), 0);
  cr_assert_eq(model_spec_units(&s), 3);
  cr_assert_eq(model_spec_param_count(&s), 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
  model_spec_format(&s, buf, sizeof buf);
  cr_assert_str_eq(buf, "mlp:784-512-256-10");
  cr_assert_eq(model_spec_parse("mlp:10-3:gelu", &s, &e), 0);
  model_spec_format(&s, buf, sizeof buf);
  cr_assert_str_eq(buf, "mlp:10-3:gelu");
  const char *bad[] = {"", "cnn:1-2", "mlp:", "mlp:10", "mlp:10-0", "mlp:10--3", "mlp:10-3:tanh", "mlp:10-3x",
                       "mlp:-5-3", "mlp:1-2-3-4-5-6-7-8-9-10-11-12-13-14-15-16-17-18", "mlp", "784-10"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_eq(model_spec_parse(bad[i], &s, &e), RUMOR_EFORMAT, "'%s' should be rejected", bad[i]);
    cr_assert(strstr(e.msg, bad[i]) != NULL, "message should quote the spec: %s", e.msg);
  }
}
