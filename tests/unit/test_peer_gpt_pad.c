/* GPT's padded logits (peer/model/gpt.c, "padded logits"): with a
 * vocabulary V that is not a multiple of 64 (65 here, padded to 128) the
 * parameters, the counts and the files keep exactly V rows; the padding
 * of the logits is never read (NaN there changes no bit of a training run
 * of AdamW steps with weight decay); the loss and the head's gradients are
 * the unpadded computation's (the reference ops on packed matrices); and a
 * directory checkpoint holds V rows, reads back through Hugging Face's
 * import and resumes bit for bit. CPU backend. (The finite-difference
 * check of test_peer_gpt runs at V = 11, padded to 64, and test_peer_tp's
 * ranks at V = 101 pad their shares.) */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/train/train.h"
#include "tensor/tensor_ref.h"
#include "util/json_text.h"

#define SPEC "gpt:L1-H2-C8-T5-V65"
#define ROWS 3
#define T 5
#define C 8
#define V 65

static tensor_backend_t be;
static char dir[64];

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  snprintf(dir, sizeof dir, "/tmp/rumor-test-pad-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}
static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
  tensor_backend_close(be);
}
TestSuite(gpt_pad, .init = setup, .fini = teardown, .timeout = 60);

static struct model_spec parse(const char *s) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &spec, &e), 0, "%s: %s", s, e.msg);
  return spec;
}

static void make(struct model *m, uint64_t seed) {
  struct model_spec s = parse(SPEC);
  struct rumor_err e;
  cr_assert_eq(model_init_full(m, &s, be, ROWS, &e), 0, "%s", e.msg);
  model_init_params(m, seed);
}

static void batch(int32_t *x, int32_t *y) {
  struct rng r;
  rng_seed(&r, 31, 2);
  for (int i = 0; i < ROWS * T; i++) x[i] = (int32_t)rng_below(&r, V), y[i] = (int32_t)rng_below(&r, V);
  y[0] = V - 1; /* the last class, next to the padding */
}

static void load(struct model *m, const int32_t *x, const int32_t *y) {
  tensor_copy_from_host(model_act(m, 0), 0, x, ROWS * T * sizeof(int32_t));
  tensor_copy_from_host(&m->labels, 0, y, ROWS * T * sizeof(int32_t));
}

static float *download(const struct tensor *t, int64_t off, int64_t n) {
  float *h = xmalloc((size_t)n * sizeof(float));
  tensor_copy_to_host(t, off, h, (size_t)n * sizeof(float));
  return h;
}

static void adamw(struct optim *o, const struct model *m) {
  struct optim_config oc;
  optim_config_default(&oc);
  oc.kind = OPTIM_ADAMW, oc.lr = 1e-2, oc.weight_decay = 0.1;
  struct rumor_err e;
  cr_assert_eq(optim_init(o, &oc, m, &e), 0, "%s", e.msg);
}

Test(gpt_pad, the_parameters_and_counts_keep_V_rows_only_the_logits_rows_are_padded) {
  struct model m;
  make(&m, 1);
  const struct model_param *wte = model_table_find(&m.table, "transformer.wte.weight");
  cr_assert(wte && wte->shape[0] == V && wte->shape[1] == C, "wte is not (%d, %d)", V, C);
  cr_assert_eq(model_logits_stride(&m), 128);
  cr_assert_eq(model_act_width(&m, m.table.nunits), T * 128);
  /* One more class is one more row of C parameters, padding or not. */
  struct model_spec s64 = parse("gpt:L1-H2-C8-T5-V64"), s65 = parse(SPEC);
  cr_assert_eq(model_spec_param_count(&s65) - model_spec_param_count(&s64), C);
  cr_assert_eq(m.nparams, model_spec_param_count(&s65));
  struct model_spec g = parse("gpt2");
  cr_assert_eq(model_spec_param_count(&g), 124439808, "GPT-2's own count");
  model_free(&m);
  struct model m64;
  struct rumor_err e;
  cr_assert_eq(model_init_full(&m64, &s64, be, 1, &e), 0, "%s", e.msg);
  cr_assert_eq(model_logits_stride(&m64), 64, "a multiple of 64 is not padded");
  model_free(&m64);
}

/* Two models of one seed take the same AdamW steps (weight decay 0.1); one
 * has its whole logits buffer, padding included, set to NaN before every
 * forward pass. A pass that read the padding would turn its loss and
 * parameters to NaN; none does, so every bit agrees. */
Test(gpt_pad, nan_in_the_logits_padding_changes_no_bit_of_adamw_steps_with_weight_decay) {
  struct model a, b;
  struct optim oa, ob;
  make(&a, 5);
  make(&b, 5);
  adamw(&oa, &a);
  adamw(&ob, &b);
  int32_t x[ROWS * T], y[ROWS * T];
  batch(x, y);
  int L = a.table.nunits;
  for (int s = 0; s < 4; s++) {
    load(&a, x, y);
    load(&b, x, y);
    tensor_fill(model_act(&b, L), NAN);
    model_forward_backward(&a, ROWS);
    model_forward_backward(&b, ROWS);
    float la = model_mean_loss(&a, ROWS), lb = model_mean_loss(&b, ROWS);
    cr_assert(isfinite(lb) && memcmp(&la, &lb, sizeof la) == 0, "step %d: loss %.9g vs %.9g with NaN padding", s, la,
              lb);
    optim_apply(&oa, &a.params, &a.grads, 1e-2);
    optim_apply(&ob, &b.params, &b.grads, 1e-2);
  }
  cr_assert_eq(memcmp(a.params.data, b.params.data, tensor_nbytes(&a.params)), 0, "parameters differ");
  cr_assert_eq(memcmp(oa.state.data, ob.state.data, tensor_nbytes(&oa.state)), 0, "AdamW's moments differ");
  cr_assert_eq(tensor_count_nonfinite(&b.params), 0);
  /* Scoring and evaluation read only the classes too. */
  int64_t ca = 0, cb = 0;
  double sa = 0, sb = 0;
  load(&a, x, y);
  load(&b, x, y);
  tensor_fill(model_act(&b, L), NAN);
  model_evaluate(&a, ROWS, y, &ca, &sa);
  model_evaluate(&b, ROWS, y, &cb, &sb);
  cr_assert(ca == cb && sa == sb && isfinite(sb), "score %lld %.9g vs %lld %.9g with NaN padding", (long long)ca, sa,
            (long long)cb, sb);
  optim_free(&oa), optim_free(&ob);
  model_free(&a), model_free(&b);
}

/* |got − ref| <= atol + rtol·|ref| for n values, finite. */
static void expect_close(const char *what, const float *got, const float *ref, int64_t n, double atol, double rtol) {
  for (int64_t i = 0; i < n; i++)
    cr_assert(isfinite(got[i]) && fabs((double)got[i] - ref[i]) <= atol + rtol * fabs(ref[i]),
              "%s[%lld]: %.9g vs reference %.9g", what, (long long)i, got[i], ref[i]);
}

/* The head on its own: the model's loss and its gradients of wte (the
 * head's part), ln_f and the head's input, against the reference ops
 * (double sums) on the packed (N, V) logits, the computation without any
 * padding. Tolerances: float against double over sums of 8 or 15 terms,
 * 1e-6 + 1e-5·|ref|. */
Test(gpt_pad, the_loss_and_the_heads_gradients_equal_the_unpadded_reference) {
  struct model m;
  make(&m, 7);
  /* Larger weights than GPT-2's 0.02, so that the logits spread. */
  float *p = download(&m.params, 0, m.nparams);
  struct rng r;
  rng_seed(&r, 8, 1);
  for (int64_t i = 0; i < m.nparams; i++) p[i] += 0.5f * rng_normal(&r);
  tensor_copy_from_host(&m.params, 0, p, (size_t)m.nparams * sizeof(float));
  int32_t x[ROWS * T], y[ROWS * T];
  batch(x, y);
  load(&m, x, y);
  const int L = m.table.nunits, N = ROWS * T;
  model_forward(&m, 0, L, ROWS);
  const struct model_param *wte = model_table_find(&m.table, "transformer.wte.weight"),
                           *lw = model_table_find(&m.table, "transformer.ln_f.weight");
  float *xin = download(model_act(&m, L - 1), 0, N * C);
  const float *w = p + wte->offset, *g = p + lw->offset, *bias = p + lw->offset + C;
  float ln[N * C], mean[N], rstd[N], logits[N * V], dl[N * V], losses[N];
  tensor_ref_layernorm_fwd(xin, g, bias, ln, mean, rstd, N, C);
  tensor_ref_gemm(false, true, N, V, C, 1.0f, ln, w, 0.0f, logits);
  tensor_ref_softmax_xent(logits, y, dl, losses, N, V, 1.0f / N);
  double want = 0;
  for (int i = 0; i < N; i++) want += losses[i] / N;
  model_loss(&m, ROWS, model_act(&m, L), 1.0f / N);
  double got = model_mean_loss(&m, ROWS);
  cr_assert(fabs(got - want) <= 1e-6 * fabs(want), "loss %.9g vs reference %.9g", got, want);

  struct tensor din;
  struct rumor_err e;
  int64_t ds[2] = {ROWS, T * C};
  cr_assert_eq(tensor_alloc(&din, be, TENSOR_F32, 2, ds, &e), 0, "%s", e.msg);
  model_backward(&m, L - 1, L, ROWS, model_act(&m, L), &din, false); /* the head alone: dwte is its part */
  float dwte[V * C], dln[N * C], dx[N * C], dg[C], db[C];
  tensor_ref_gemm(true, false, V, C, N, 1.0f, dl, ln, 0.0f, dwte);
  tensor_ref_gemm(false, false, N, C, V, 1.0f, dl, w, 0.0f, dln);
  memset(dx, 0, sizeof dx);
  tensor_ref_layernorm_bwd(xin, g, mean, rstd, dln, dx, dg, db, N, C, 0.0f);
  float *gw = download(&m.grads, wte->offset, V * C), *gl = download(&m.grads, lw->offset, 2 * C);
  float *gx = download(&din, 0, N * C);
  expect_close("dwte (the head's part)", gw, dwte, V * C, 1e-6, 1e-5);
  expect_close("d ln_f.weight", gl, dg, C, 1e-6, 1e-5);
  expect_close("d ln_f.bias", gl + C, db, C, 1e-6, 1e-5);
  expect_close("d (the head's input)", gx, dx, N * C, 1e-6, 1e-5);
  tensor_free(&din);
  free(p), free(xin), free(gw), free(gl), free(gx);
  model_free(&m);
}

/* A directory checkpoint of a trained V = 65 model: model.safetensors's
 * wte has 65 rows and config.json says vocab_size 65; hf_import gives the
 * parameters bit for bit; checkpoint_restore gives them and AdamW's state
 * bit for bit, and the restored model's next step is the original's. */
Test(gpt_pad, a_checkpoint_holds_V_rows_and_resumes_bit_for_bit) {
  struct model m, r;
  struct optim o, ro;
  make(&m, 9);
  adamw(&o, &m);
  int32_t x[ROWS * T], y[ROWS * T];
  batch(x, y);
  for (int s = 0; s < 2; s++) {
    load(&m, x, y);
    model_forward_backward(&m, ROWS);
    optim_apply(&o, &m.params, &m.grads, 1e-2);
  }
  struct ckpt_info in;
  memset(&in, 0, sizeof in);
  in.spec = m.spec;
  in.st = (struct train_state){.step = 2};
  in.shard = (struct shard){0, 1};
  in.batch = ROWS;
  in.norm_std = 1.0; /* what a token model records */
  char ck[128], file[192];
  snprintf(ck, sizeof ck, "%s/ck/", dir);
  struct rumor_err e;
  cr_assert_eq(checkpoint_save(ck, &m, &o, &in, &e), 0, "%s", e.msg);

  checkpoint_dir_file(ck, "model.safetensors", file, sizeof file);
  struct st_file f;
  cr_assert_eq(safetensors_read(file, false, &f, &e), 0, "%s", e.msg);
  const struct st_tensor *t = safetensors_find(&f, "transformer.wte.weight");
  cr_assert(t && t->ndim == 2 && t->shape[0] == V && t->shape[1] == C, "%s: wte is not (%d, %d)", file, V, C);
  safetensors_free(&f);
  checkpoint_dir_file(ck, "config.json", file, sizeof file);
  char cmd[320];
  snprintf(cmd, sizeof cmd, "grep -q '\"vocab_size\": *%d[,}]' %s", V, file);
  cr_assert_eq(system(cmd), 0, "%s does not say vocab_size %d", file, V);

  struct model_spec spec;
  float *hf;
  cr_assert_eq(hf_import(ck, &spec, &hf, &e), 0, "%s", e.msg);
  cr_assert(model_spec_equal(&spec, &m.spec));
  cr_assert_eq(memcmp(hf, m.params.data, tensor_nbytes(&m.params)), 0, "hf_import changed the parameters");
  free(hf);

  struct checkpoint c;
  cr_assert_eq(checkpoint_open(ck, &c, &e), 0, "%s", e.msg);
  make(&r, 1);
  adamw(&ro, &r);
  cr_assert_eq(checkpoint_restore(&c, &r, &ro, &e), 0, "%s", e.msg);
  checkpoint_close(&c);
  cr_assert_eq(memcmp(r.params.data, m.params.data, tensor_nbytes(&m.params)), 0, "restored parameters differ");
  cr_assert_eq(memcmp(ro.state.data, o.state.data, tensor_nbytes(&o.state)), 0, "restored AdamW state differs");
  load(&m, x, y);
  load(&r, x, y);
  model_forward_backward(&m, ROWS);
  model_forward_backward(&r, ROWS);
  optim_apply(&o, &m.params, &m.grads, 1e-2);
  optim_apply(&ro, &r.params, &r.grads, 1e-2);
  cr_assert_eq(memcmp(r.params.data, m.params.data, tensor_nbytes(&m.params)), 0, "the resumed step differs");
  optim_free(&o), optim_free(&ro);
  model_free(&m), model_free(&r);
}
