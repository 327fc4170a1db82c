/* The GPT family (peer/model/gpt.c): specs and presets, the Hugging Face
 * table and config, the whole model's gradient by finite differences on a
 * tiny configuration, causality (fewer positions give the same logits), and
 * a model split into two stages (the tied embedding's copy on the head's
 * side) giving the whole model's gradient. CPU backend; the finite
 * differences run on CUDA too, and a CUDA model is held to the CPU model of
 * the same spec and seed (loss, every gradient, AdamW steps). The CUDA
 * tests skip with a message where no GPU is usable. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/model.h"
#include "util/json_text.h"

#define TINY "gpt:L2-H2-C8-T5-V11"
#define ROWS 3

static tensor_backend_t be;

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
}
static void teardown(void) { tensor_backend_close(be); }
TestSuite(gpt, .init = setup, .fini = teardown);

static struct model_spec parse(const char *s) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &spec, &e), 0, "%s: %s", s, e.msg);
  return spec;
}

/* ---- specs, table, config ---- */

Test(gpt, specs_parse_in_any_order_and_format_canonically) {
  struct model_spec a = parse("gpt:V256-T256-C384-H6-L6"), b = parse("gpt:L6-H6-C384-T256-V256");
  cr_assert(model_spec_equal(&a, &b));
  char buf[MODEL_SPEC_MAX];
  model_spec_format(&a, buf, sizeof buf);
  cr_assert_str_eq(buf, "gpt:L6-H6-C384-T256-V256");
  struct model_spec g = parse("gpt2");
  model_spec_format(&g, buf, sizeof buf);
  cr_assert_str_eq(buf, "gpt:L12-H12-C768-T1024-V50257");
  /* GPT-2 small: 124,439,808 parameters with the head tied (Hugging Face's count). */
  cr_assert_eq(model_spec_param_count(&g), 124439808LL);
  cr_assert_eq(model_spec_units(&g), 14);
}

Test(gpt, bad_specs_quote_the_spec_and_name_the_part) {
  const struct {
    const char *spec, *says;
  } bad[] = {
      {"gpt:L6-H6-C384-T256", "missing V"},
      {"gpt:L6-H6-C384-T256-V256-L2", "L given twice"},
      {"gpt:L6-H5-C384-T256-V256", "not a multiple of the heads"},
      {"gpt:L0-H6-C384-T256-V256", "L0"},
      {"gpt:L6-H6-C384x-T256-V256", "unexpected"},
      {"gpt:L6-Q6-C384-T256-V256", "unknown part 'Q6'"},
      {"gpt:L6-H6-C-T256-V256", "'C' is not a letter and a number"},
      {"gpt:L999-H6-C384-T256-V256", "the number of layers"},
      {"gpt:L6-H6-C384-T256-V1", "V1"},
      {"gpt3", "expected FAMILY:ARGS"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct model_spec s;
    struct rumor_err e = {0};
    cr_assert_eq(model_spec_parse(bad[i].spec, &s, &e), RUMOR_EFORMAT, "%s accepted", bad[i].spec);
    cr_assert(strstr(e.msg, bad[i].spec) != NULL, "%s: message does not quote the spec: %s", bad[i].spec, e.msg);
    cr_assert(strstr(e.msg, bad[i].says) != NULL, "%s: message does not say '%s': %s", bad[i].spec, bad[i].says,
              e.msg);
  }
}

Test(gpt, the_table_has_hugging_face_names_layouts_and_decay_on_matrices) {
  struct model_spec s = parse("gpt:L2-H2-C8-T5-V11");
  struct model_table t;
  model_table_build(&s, &t);
  const struct {
    const char *name;
    int64_t d0, d1;
    bool decay;
    int unit;
  } want[] = {
      {"transformer.wte.weight", 11, 8, true, 0},          {"transformer.wpe.weight", 5, 8, true, 0},
      {"transformer.h.0.ln_1.weight", 8, 0, false, 1},     {"transformer.h.0.attn.c_attn.weight", 8, 24, true, 1},
      {"transformer.h.0.attn.c_attn.bias", 24, 0, false, 1}, {"transformer.h.1.attn.c_proj.weight", 8, 8, true, 2},
      {"transformer.h.1.mlp.c_fc.weight", 8, 32, true, 2}, {"transformer.h.1.mlp.c_proj.weight", 32, 8, true, 2},
      {"transformer.ln_f.bias", 8, 0, false, 3},
  };
  for (size_t i = 0; i < sizeof want / sizeof want[0]; i++) {
    const struct model_param *p = model_table_find(&t, want[i].name);
    cr_assert(p, "no %s", want[i].name);
    cr_assert_eq(p->ndim, want[i].d1 ? 2 : 1, "%s", want[i].name);
    cr_assert(p->shape[0] == want[i].d0 && (!want[i].d1 || p->shape[1] == want[i].d1), "%s: shape", want[i].name);
    cr_assert_eq(p->decay, want[i].decay, "%s: decay", want[i].name);
    cr_assert_eq(p->unit, want[i].unit, "%s: unit", want[i].name);
  }
  cr_assert_null(model_table_find(&t, "lm_head.weight"), "the tied head is not stored");
  /* Hugging Face names without the prefix, and the buffers to ignore. */
  const struct model_param *p;
  cr_assert_eq(model_hf_lookup(&t, "h.1.mlp.c_fc.bias", &p), MODEL_HF_ENTRY);
  cr_assert_str_eq(p->name, "transformer.h.1.mlp.c_fc.bias");
  cr_assert_eq(model_hf_lookup(&t, "transformer.h.0.attn.bias", &p), MODEL_HF_IGNORE);
  cr_assert_eq(model_hf_lookup(&t, "h.0.attn.masked_bias", &p), MODEL_HF_IGNORE);
  cr_assert_eq(model_hf_lookup(&t, "lm_head.weight", &p), MODEL_HF_IGNORE);
  cr_assert_eq(model_hf_lookup(&t, "h.7.mlp.c_fc.bias", &p), MODEL_HF_UNKNOWN);
  model_table_free(&t);
}

Test(gpt, config_json_round_trips_and_bad_configs_are_named) {
  struct model_spec s = parse("gpt:L3-H4-C32-T64-V300"), back;
  json_t *cfg = model_hf_config(&s);
  cr_assert_not_null(cfg);
  size_t len;
  char *text = json_text_dump(cfg, &len);
  json_decref(cfg);
  struct rumor_err e = {0};
  cr_assert_eq(model_spec_from_hf_config(text, len, "config.json", &back, &e), 0, "%s", e.msg);
  cr_assert(model_spec_equal(&s, &back));
  cr_assert(strstr(text, "\"model_type\":\"gpt2\"") && strstr(text, "\"n_embd\":32") &&
                strstr(text, "\"layer_norm_epsilon\":1e-5") && strstr(text, "\"n_inner\":null"),
            "%s", text);
  free(text);
  const struct {
    const char *json, *says;
  } bad[] = {
      {"{\"model_type\":\"llama\"}", "model_type 'llama'"},
      {"{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":3,\"n_embd\":8,\"n_positions\":4,\"vocab_size\":9}",
       "not a multiple"},
      {"{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":2,\"n_embd\":8,\"vocab_size\":9}", "n_positions"},
      {"{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":2,\"n_embd\":8,\"n_positions\":4,\"vocab_size\":9,"
       "\"activation_function\":\"relu\"}",
       "activation_function"},
      {"{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":2,\"n_embd\":8,\"n_positions\":4,\"vocab_size\":9,"
       "\"layer_norm_epsilon\":0.5}",
       "layer_norm_epsilon is 0.5"},
      {"{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":2,\"n_embd\":8,\"n_positions\":4,\"vocab_size\":9,"
       "\"layer_norm_epsilon\":1e-6}",
       "layer_norm_epsilon is 1e-06"},
      {"{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":2,\"n_embd\":8,\"n_positions\":4,\"vocab_size\":9,"
       "\"layer_norm_epsilon\":\"1e-5\"}",
       "layer_norm_epsilon is not a number"},
      {"not json", "not a JSON config"},
      {"[1,2]", "not an object"},
      {"{\"model_type\":\"gpt2\",\"model_type\":\"llama\"}", "duplicate"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct model_spec x;
    cr_assert_neq(model_spec_from_hf_config(bad[i].json, strlen(bad[i].json), "cfg.json", &x, &e), 0, "%s",
                  bad[i].json);
    cr_assert(strstr(e.msg, "cfg.json") && strstr(e.msg, bad[i].says), "%s: %s", bad[i].json, e.msg);
  }
  /* GPT-2's epsilon, however written (PyTorch's float32 1e-5 widened to a
   * double included), or none at all, is ours. */
  const char *same_eps[] = {"1e-5", "1.0e-05", "0.00001", "9.999999747378752e-06"};
  const size_t n_eps = sizeof same_eps / sizeof same_eps[0];
  for (size_t i = 0; i <= n_eps; i++) { /* the last without the field */
    char json[256];
    snprintf(json, sizeof json,
             "{\"model_type\":\"gpt2\",\"n_layer\":2,\"n_head\":2,\"n_embd\":8,\"n_positions\":4,"
             "\"vocab_size\":9%s%s}",
             i < n_eps ? ",\"layer_norm_epsilon\":" : "", i < n_eps ? same_eps[i] : "");
    struct model_spec x;
    cr_assert_eq(model_spec_from_hf_config(json, strlen(json), "cfg.json", &x, &e), 0, "%s: %s", json, e.msg);
  }
}

/* ---- a tiny model on the CPU ---- */

static void make(struct model *m, const char *spec, int u0, int u1, int64_t rows) {
  struct model_spec s = parse(spec);
  struct rumor_err e;
  cr_assert_eq(model_init(m, &s, u0, u1, be, rows, &e), 0, "%s", e.msg);
}

static void random_batch(const struct model *m, uint64_t seed, int32_t *x, int32_t *y) {
  struct rng r;
  rng_seed(&r, seed, 7);
  int64_t n = ROWS * m->io.input_per_row;
  for (int64_t i = 0; i < n; i++) x[i] = (int32_t)rng_below(&r, (uint64_t)m->io.classes);
  for (int64_t i = 0; i < n; i++) y[i] = (int32_t)rng_below(&r, (uint64_t)m->io.classes);
}

/* Mean loss over the batch at the model's current parameters. */
static double loss_of(struct model *m, const int32_t *x, const int32_t *y) {
  int64_t n = ROWS * m->io.input_per_row;
  tensor_copy_from_host(model_act(m, 0), 0, x, (size_t)n * sizeof(int32_t));
  tensor_copy_from_host(&m->labels, 0, y, (size_t)n * sizeof(int32_t));
  int L = m->table.nunits;
  model_forward(m, 0, L, ROWS);
  model_loss(m, ROWS, model_act(m, L), 1.0f / (float)n);
  return model_mean_loss(m, ROWS);
}

/* Opens cuda:0, or skips the test with the reason. */
static tensor_backend_t open_gpu_or_skip(void) {
  if (tensor_cuda_device_count() == 0)
    cr_skip_test("no CUDA GPU: tensor_cuda_device_count() is 0 (%s); CUDA variant skipped",
                 tensor_cuda_compiled() ? "built with CUDA, but no usable device or driver" : "built without CUDA");
  tensor_backend_t gpu;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_backend_open("cuda:0", &gpu, &e), 0, "%s", e.msg);
  return gpu;
}

/* Every parameter of a 2-block model (1,918 of them), central differences
 * in float32 with a step of 1e-2, on the suite's backend `be`: the loss is
 * smooth there (no ReLU), and the difference quotient's error, O(h²) plus
 * float rounding of the loss (~1e-7/h), stays well under the tolerance. */
static void gradient_matches_finite_differences(void) {
  struct model m;
  make(&m, TINY, 0, 4, ROWS);
  model_init_params(&m, 3);
  /* Larger weights than GPT-2's 0.02, so that every path carries gradient. */
  int64_t P = m.nparams;
  float *p = xmalloc((size_t)P * sizeof(float)), *g = xmalloc((size_t)P * sizeof(float));
  struct rng r;
  rng_seed(&r, 5, 1);
  tensor_copy_to_host(&m.params, 0, p, (size_t)P * sizeof(float));
  for (int64_t i = 0; i < P; i++) p[i] += 0.3f * rng_normal(&r);
  tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
  int32_t x[ROWS * 5], y[ROWS * 5];
  random_batch(&m, 11, x, y);
  (void)loss_of(&m, x, y);
  model_backward(&m, 0, 4, ROWS, model_act(&m, 4), NULL, false);
  tensor_copy_to_host(&m.grads, 0, g, (size_t)P * sizeof(float));
  const float h = 1e-2f;
  int worst = -1;
  double worst_err = 0, worst_num = 0, worst_ana = 0;
  for (int64_t i = 0; i < P; i++) {
    float keep = p[i];
    p[i] = keep + h;
    tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
    double up = loss_of(&m, x, y);
    p[i] = keep - h;
    tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
    double down = loss_of(&m, x, y);
    p[i] = keep;
    /* |analytic − numeric| ≤ 2e-4 + 2e-2·|numeric|: the absolute part covers
     * the quotient's float noise (loss rounding ~3e-7 / 2h ≈ 2e-5) and its
     * O(h²) truncation with these larger weights. */
    double num = (up - down) / (2.0 * h), err = fabs(num - g[i]) / (2e-4 + 2e-2 * fabs(num));
    if (err > worst_err) worst_err = err, worst = (int)i, worst_num = num, worst_ana = g[i];
  }
  tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
  const char *name = "?";
  for (size_t k = 0; k < m.table.n; k++)
    if (worst >= m.table.p[k].offset && worst < m.table.p[k].offset + m.table.p[k].numel) name = m.table.p[k].name;
  cr_assert(worst_err <= 1.0, "parameter %d (%s): analytic %.6g vs numeric %.6g (%.3g of the tolerance)", worst,
            name, worst_ana, worst_num, worst_err);
  fprintf(stderr, "gpt gradient check (%s): worst %.3g of the tolerance at parameter %d (%s: %.6g vs %.6g)\n",
          tensor_backend_name(be), worst_err, worst, name, worst_ana, worst_num);
  free(p);
  free(g);
  model_free(&m);
}

Test(gpt, the_whole_models_gradient_matches_finite_differences) { gradient_matches_finite_differences(); }

/* The same check with the model on the GPU: every kernel of the forward and
 * backward passes, the tied head's accumulating GEMM and scatter, and the
 * scratch reused by the two blocks. */
Test(gpt, on_cuda_the_whole_models_gradient_matches_finite_differences) {
  tensor_backend_t cpu = be;
  be = open_gpu_or_skip();
  gradient_matches_finite_differences();
  tensor_backend_close(be);
  be = cpu;
}

/* ---- the same model on CUDA and on the CPU ---- */

#define XR 4                        /* rows of the CUDA comparison */
#define XSPEC "gpt:L2-H4-C64-T32-V300" /* 4 heads of 16, 2 blocks, T 32 */

/* Loads `x`, `y` (XR·32 tokens each) and runs forward, loss and backward;
 * returns the mean loss. */
static double step_grads(struct model *m, const int32_t *x, const int32_t *y) {
  const size_t bytes = (size_t)(XR * m->io.input_per_row) * sizeof(int32_t);
  tensor_copy_from_host(model_act(m, 0), 0, x, bytes);
  tensor_copy_from_host(&m->labels, 0, y, bytes);
  model_forward_backward(m, XR);
  return model_mean_loss(m, XR);
}

static float *download(const struct tensor *t, int64_t n) {
  float *h = xmalloc((size_t)n * sizeof(float));
  tensor_copy_to_host(t, 0, h, (size_t)n * sizeof(float));
  return h;
}

/* Every entry of the table: |gpu − cpu| <= 1e-4·max|cpu entry| + 1e-3·|cpu|.
 * Both run FP32; they differ by summation orders (cuBLAS's GEMMs, the
 * kernels' reductions), ~1e-6 of an entry's scale. A wrong index, transpose,
 * alias or missed accumulation is off by the entry's scale. */
static void grads_agree(const struct model *mc, const float *gc, const float *gg) {
  for (size_t k = 0; k < mc->table.n; k++) {
    const struct model_param *p = &mc->table.p[k];
    double big = 0.0;
    for (int64_t i = 0; i < p->numel; i++) big = fmax(big, fabs(gc[p->offset + i]));
    for (int64_t i = 0; i < p->numel; i++) {
      double c = gc[p->offset + i], g = gg[p->offset + i];
      cr_assert(isfinite(g) && fabs(g - c) <= 1e-4 * big + 1e-3 * fabs(c),
                "%s[%lld]: cuda %.9g vs cpu %.9g (entry's largest |gradient| %.3g)", p->name, (long long)i, g, c, big);
    }
  }
}

Test(gpt, on_cuda_the_same_model_and_seed_give_the_cpus_loss_gradients_and_adamw_steps) {
  tensor_backend_t gpu = open_gpu_or_skip();
  struct model_spec spec = parse(XSPEC);
  struct model mc, mg;
  struct rumor_err e;
  cr_assert_eq(model_init_full(&mc, &spec, be, XR, &e), 0, "%s", e.msg);
  cr_assert_eq(model_init_full(&mg, &spec, gpu, XR, &e), 0, "%s", e.msg);
  model_init_params(&mc, 17);
  model_init_params(&mg, 17);
  const int64_t P = mc.nparams, n = XR * mc.io.input_per_row;
  float *pc = download(&mc.params, P), *pg = download(&mg.params, P);
  cr_assert_eq(memcmp(pc, pg, (size_t)P * sizeof(float)), 0, "the same seed gave other parameters on the GPU");
  int32_t *x = xmalloc((size_t)n * sizeof(int32_t)), *y = xmalloc((size_t)n * sizeof(int32_t));
  struct rng r;
  rng_seed(&r, 23, 0);
  for (int64_t i = 0; i < n; i++) x[i] = (int32_t)rng_below(&r, 300), y[i] = (int32_t)rng_below(&r, 300);
  x[0] = x[1] = x[2] = 7; /* a repeated token: the embedding backward's runs */

  /* Loss and every gradient. Loss: a mean of XR·32 logs of softmaxes over
   * 300 logits, equal to 2e-5. */
  double lc = step_grads(&mc, x, y), lg = step_grads(&mg, x, y);
  cr_assert(fabs(lg - lc) <= 2e-5, "loss: cuda %.9g vs cpu %.9g", lg, lc);
  float *gc = download(&mc.grads, P), *gg = download(&mg.grads, P);
  grads_agree(&mc, gc, gg);

  /* One AdamW step on the same gradient (the CPU's, given to both): the
   * update over the flat buffer, its decay mask and bias correction agree
   * to float rounding (1e-7 + 1e-6·|p|). */
  struct optim_config oc;
  optim_config_default(&oc);
  oc.kind = OPTIM_ADAMW, oc.lr = 1e-3, oc.weight_decay = 0.1, oc.beta2 = 0.95;
  struct optim oc_cpu, oc_gpu;
  cr_assert_eq(optim_init(&oc_cpu, &oc, &mc, &e), 0, "%s", e.msg);
  cr_assert_eq(optim_init(&oc_gpu, &oc, &mg, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&mg.grads, 0, gc, (size_t)P * sizeof(float));
  optim_apply(&oc_cpu, &mc.params, &mc.grads, oc.lr);
  optim_apply(&oc_gpu, &mg.params, &mg.grads, oc.lr);
  free(pc), free(pg);
  pc = download(&mc.params, P), pg = download(&mg.params, P);
  for (int64_t i = 0; i < P; i++)
    cr_assert(fabs(pg[i] - pc[i]) <= 1e-7 + 1e-6 * fabs(pc[i]), "AdamW step, parameter %lld: cuda %.9g vs cpu %.9g",
              (long long)i, pg[i], pc[i]);

  /* Three more steps, each on its own device's gradients. AdamW turns a
   * gradient's sign into a step of ±lr however small the gradient, and some
   * are analytically zero (the key bias: softmax ignores a shift), so a
   * few parameters may part by up to 2·lr a step: at most 1% of them may
   * differ by more than 1e-5, and the loss after the steps (blind to the
   * key bias) agrees to 1e-4. */
  for (int s = 0; s < 3; s++) {
    (void)step_grads(&mc, x, y);
    (void)step_grads(&mg, x, y);
    optim_apply(&oc_cpu, &mc.params, &mc.grads, oc.lr);
    optim_apply(&oc_gpu, &mg.params, &mg.grads, oc.lr);
  }
  free(pc), free(pg);
  pc = download(&mc.params, P), pg = download(&mg.params, P);
  int64_t apart = 0;
  for (int64_t i = 0; i < P; i++) apart += !(fabs(pg[i] - pc[i]) <= 1e-5);
  cr_assert(apart <= P / 100, "after 4 AdamW steps %lld of %lld parameters differ by more than 1e-5", (long long)apart,
            (long long)P);
  lc = step_grads(&mc, x, y), lg = step_grads(&mg, x, y);
  cr_assert(fabs(lg - lc) <= 1e-4, "loss after 4 AdamW steps: cuda %.9g vs cpu %.9g", lg, lc);
  fprintf(stderr, "gpt on cuda: loss %.7g (cpu %.7g) after 4 AdamW steps, %lld of %lld parameters apart by > 1e-5\n",
          lg, lc, (long long)apart, (long long)P);
  free(pc), free(pg), free(gc), free(gg), free(x), free(y);
  optim_free(&oc_cpu), optim_free(&oc_gpu);
  model_free(&mc), model_free(&mg);
  tensor_backend_close(gpu);
}

Test(gpt, fewer_positions_give_the_same_logits_causality) {
  /* Position t's logits depend on tokens 0..t only: a pass over the first
   * t positions gives exactly the first t positions' logits of the full pass. */
  struct model m;
  make(&m, TINY, 0, 4, 1);
  model_init_params(&m, 9);
  int32_t x[5] = {1, 7, 3, 10, 0};
  const int64_t ld = model_logits_stride(&m); /* 11 classes, padded to 64 */
  cr_assert_eq(ld, 64);
  float full[5 * 64], part[5 * 64];
  tensor_copy_from_host(model_act(&m, 0), 0, x, sizeof x);
  model_forward(&m, 0, 4, 1);
  tensor_copy_to_host(model_act(&m, 4), 0, full, sizeof full);
  for (int64_t t = 1; t <= 5; t++) {
    cr_assert(model_set_positions(&m, t));
    tensor_copy_from_host(model_act(&m, 0), 0, x, (size_t)t * sizeof(int32_t));
    model_forward(&m, 0, 4, 1);
    tensor_copy_to_host(model_act(&m, 4), 0, part, (size_t)(t * ld) * sizeof(float));
    for (int64_t p = 0; p < t; p++)
      for (int64_t c = 0; c < 11; c++) {
        int64_t i = p * ld + c;
        cr_assert(fabsf(part[i] - full[i]) <= 1e-5f + 1e-5f * fabsf(full[i]), "t=%lld: position %lld, logit %lld: %g "
                  "vs %g", (long long)t, (long long)p, (long long)c, part[i], full[i]);
      }
  }
  model_free(&m);
}

Test(gpt, two_stages_with_the_tied_copy_give_the_whole_models_gradient) {
  /* Stage A: embeddings and block 0 (units 0-1); stage B: block 1 and the
   * head (units 2-3), with its own copy of wte. B's copy gradient added to
   * A's wte gradient is the whole model's. */
  struct model w, a, b;
  make(&w, TINY, 0, 4, ROWS);
  make(&a, TINY, 0, 2, ROWS);
  make(&b, TINY, 2, 4, ROWS);
  model_init_params(&w, 4);
  model_init_params(&a, 4);
  model_init_params(&b, 4);
  struct tensor *copy, *dcopy;
  const struct model_param *tied = model_tied(&b, &copy, &dcopy);
  cr_assert(tied && strcmp(tied->name, "transformer.wte.weight") == 0, "stage B has no copy of wte");
  cr_assert_null(model_tied(&a, &copy, &dcopy), "stage A holds wte itself");
  cr_assert_null(model_tied(&w, &copy, &dcopy), "the whole model holds wte itself");
  (void)model_tied(&b, &copy, &dcopy);
  /* The copy is kept equal to unit 0's value by whoever splits the model. */
  int64_t wte = tied->numel, P = w.nparams;
  float *buf = xmalloc((size_t)P * sizeof(float));
  tensor_copy_to_host(&w.params, 0, buf, (size_t)P * sizeof(float));
  tensor_copy_from_host(copy, 0, buf + tied->offset, (size_t)wte * sizeof(float));

  int32_t x[ROWS * 5], y[ROWS * 5];
  random_batch(&w, 2, x, y);
  double lw = loss_of(&w, x, y);
  model_backward(&w, 0, 4, ROWS, model_act(&w, 4), NULL, false);

  int64_t n = ROWS * 5, T = 5;
  tensor_copy_from_host(model_act(&a, 0), 0, x, (size_t)n * sizeof(int32_t));
  model_forward(&a, 0, 2, ROWS);
  tensor_copy(model_act(&b, 2), model_act(&a, 2));
  tensor_copy_from_host(&b.labels, 0, y, (size_t)n * sizeof(int32_t));
  model_forward(&b, 2, 4, ROWS);
  model_loss(&b, ROWS, model_act(&b, 4), 1.0f / (float)n);
  double ls = model_mean_loss(&b, ROWS);
  cr_assert(fabs(ls - lw) < 1e-6, "split loss %.8g vs whole %.8g", ls, lw);
  struct tensor din;
  struct rumor_err e;
  int64_t ds[2] = {ROWS, T * 8};
  cr_assert_eq(tensor_alloc(&din, be, TENSOR_F32, 2, ds, &e), 0);
  model_backward(&b, 2, 4, ROWS, model_act(&b, 4), &din, false);
  model_backward(&a, 0, 2, ROWS, &din, NULL, false);

  float *gw = xmalloc((size_t)P * sizeof(float)), *gs = xmalloc((size_t)P * sizeof(float));
  float *gc = xmalloc((size_t)wte * sizeof(float));
  tensor_copy_to_host(&w.grads, 0, gw, (size_t)P * sizeof(float));
  tensor_copy_to_host(&a.grads, 0, gs, (size_t)a.nparams * sizeof(float));
  tensor_copy_to_host(&b.grads, 0, gs + a.nparams, (size_t)b.nparams * sizeof(float));
  tensor_copy_to_host(dcopy, 0, gc, (size_t)wte * sizeof(float));
  for (int64_t i = 0; i < wte; i++) gs[tied->offset + i] += gc[i];
  for (int64_t i = 0; i < P; i++)
    cr_assert(fabsf(gs[i] - gw[i]) <= 1e-6f + 1e-4f * fabsf(gw[i]), "gradient %lld: split %g vs whole %g",
              (long long)i, gs[i], gw[i]);
  tensor_free(&din);
  free(buf);
  free(gw);
  free(gs);
  free(gc);
  model_free(&w);
  model_free(&a);
  model_free(&b);
}
