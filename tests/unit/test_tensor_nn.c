/* The transformer ops (tensor.h: add, embedding, LayerNorm, causal
 * attention, GELU tanh) on the CPU backend against the plain reference ops
 * (tensor_ref.h), at 1 and 2 threads, on shapes that are not multiples of
 * any vector width or of the attention's query block (64); their
 * accumulate/overwrite contracts; bitwise determinism where promised; the
 * padded-row forms of the tied head's products and of the cross-entropies;
 * and the reference backward ops against central finite differences of the
 * reference forward ops.
 *
 * Comparisons are |got − ref| <= atol + rtol·|ref| per element, with the
 * worst element reported; every output is also checked to be finite. The
 * tolerances are stated next to each check with the reason for them. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_ref.h"
#include "../support/tensor_check.h"

static const int thread_counts[] = {1, 2};
#define NTHREADS (sizeof thread_counts / sizeof thread_counts[0])

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  rng_seed_suite(4242);
}
static void teardown(void) { tensor_backend_close(be); }

TestSuite(tensor_nn, .init = setup, .fini = teardown, .timeout = 120);

/* ---- helpers ---- */

static float *dup_host(const float *h, int64_t n) {
  float *p = xmalloc((size_t)n * sizeof *p);
  memcpy(p, h, (size_t)n * sizeof *p);
  return p;
}

static struct tensor dev_tokens(const int32_t *h, int64_t r, int64_t t) {
  struct tensor d;
  struct rumor_err e;
  int64_t shape[2] = {r, t};
  cr_assert_eq(tensor_alloc(&d, be, TENSOR_I32, 2, shape, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&d, 0, h, tensor_nbytes(&d));
  return d;
}

/* Asserts a and b hold the same bits. */
static void expect_same_bits(const char *what, const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    cr_assert(memcmp(&a[i], &b[i], sizeof *a) == 0, "%s: element %lld differs: %.9g vs %.9g", what, (long long)i,
              a[i], b[i]);
}

/* ---- add and GELU tanh ---- */

Test(tensor_nn, add_matches_reference_exactly_in_and_out_of_place) {
  const int64_t sizes[] = {1, 5, 1000, 65537, 200003};
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
      int64_t n = sizes[s];
      float *xh = rand_host(n, 3), *yh = rand_host(n, 3), *ref = xmalloc((size_t)n * sizeof *ref);
      tensor_ref_add(xh, yh, ref, n);
      struct tensor x = dev_from(xh, 1, &n), y = dev_from(yh, 1, &n), out = dev_nan(1, &n);
      tensor_add(&x, &y, &out); /* one float add per element: exact agreement */
      float *got = to_host(&out);
      expect_close("add", got, ref, n, 0, 0);
      tensor_add(&x, &y, &x); /* out aliasing x */
      float *gx = to_host(&x);
      expect_close("add (out = x)", gx, ref, n, 0, 0);
      tensor_copy_from_host(&x, 0, xh, (size_t)n * sizeof *xh);
      tensor_add(&x, &y, &y); /* out aliasing y */
      float *gy = to_host(&y);
      expect_close("add (out = y)", gy, ref, n, 0, 0);
      free(xh), free(yh), free(ref), free(got), free(gx), free(gy);
      tensor_free(&x), tensor_free(&y), tensor_free(&out);
    }
  }
}

/* GELU tanh, forward and backward, at input scale 4 and 12 (the latter
 * reaches the exp cap at x < −10.3 and the saturated tail). The CPU op
 * computes x/(1 + e^(−2u)) in float with a polynomial exp good to 1.5 ulp,
 * the reference in double. For x < 0 the result is about x·e^(2u), which
 * turns the float rounding of the argument 2u (absolute, |2u|·2⁻²⁴ per
 * operation) into a relative error of that size: the forward's rtol is
 * 3e-6 for |x| <= 4 (|2u| <= 11) and 3e-5 for |x| <= 12 (|2u| <= 88 before
 * the cap), with 1e-30 absolute where the result underflows. The backward
 * s·(1 + 2·x·e·s·u') cancels to 0 near x ≈ −0.75 where its terms are O(1):
 * 2e-7 absolute (a few ulp of those terms) on top of the same rtol. */
Test(tensor_nn, gelu_tanh_matches_reference_in_and_out_of_place) {
  const int64_t sizes[] = {1, 7, 1000, 65537, 100003};
  const float scales[] = {4.0f, 12.0f};
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++)
      for (size_t k = 0; k < 2; k++) {
        int64_t n = sizes[s];
        float *xh = rand_host(n, scales[k]), *dyh = rand_host(n, 1.0f);
        float *yref = xmalloc((size_t)n * sizeof *yref), *dxref = xmalloc((size_t)n * sizeof *dxref);
        tensor_ref_gelu_tanh_fwd(xh, yref, n);
        tensor_ref_gelu_tanh_bwd(xh, dyh, dxref, n);
        struct tensor x = dev_from(xh, 1, &n), dy = dev_from(dyh, 1, &n), y = dev_nan(1, &n), dx = dev_nan(1, &n);
        tensor_gelu_tanh_fwd(&x, &y);
        tensor_gelu_tanh_bwd(&x, &dy, &dx);
        float *yg = to_host(&y), *dxg = to_host(&dx);
        const double rtol = k ? 3e-5 : 3e-6;
        expect_close("gelu_tanh_fwd", yg, yref, n, 1e-30, rtol);
        expect_close("gelu_tanh_bwd", dxg, dxref, n, 2e-7, rtol);
        tensor_gelu_tanh_bwd(&x, &dy, &dy); /* dx aliasing dy */
        float *dxa = to_host(&dy);
        expect_close("gelu_tanh_bwd (dx = dy)", dxa, dxref, n, 2e-7, rtol);
        tensor_gelu_tanh_fwd(&x, &x); /* y aliasing x */
        float *ya = to_host(&x);
        expect_close("gelu_tanh_fwd (y = x)", ya, yref, n, 1e-30, rtol);
        free(xh), free(dyh), free(yref), free(dxref), free(yg), free(dxg), free(dxa), free(ya);
        tensor_free(&x), tensor_free(&dy), tensor_free(&y), tensor_free(&dx);
      }
  }
}

/* The reference evaluates 0.5·(1 + tanh(u)) as sigmoid(2u) (exact in
 * double where the tanh form cancels); where the tanh form is well
 * conditioned (|x| <= 3) the two agree to float rounding, which pins the
 * constants and the derivative to the tanh definition. */
Test(tensor_nn, reference_gelu_tanh_equals_the_tanh_formula) {
  const int64_t n = 1000;
  float *x = rand_host(n, 3), *dy = rand_host(n, 1), *y = xmalloc(n * 4), *dx = xmalloc(n * 4);
  tensor_ref_gelu_tanh_fwd(x, y, n);
  tensor_ref_gelu_tanh_bwd(x, dy, dx, n);
  const double k = sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < n; i++) {
    double v = x[i], u = k * (v + 0.044715 * v * v * v), th = tanh(u);
    double want = 0.5 * v * (1.0 + th);
    double dwant = dy[i] * (0.5 * (1.0 + th) + 0.5 * v * (1.0 - th * th) * k * (1.0 + 3.0 * 0.044715 * v * v));
    cr_assert(fabs(y[i] - want) <= 1e-7 * fabs(want) + 1e-12, "x %.9g: y %.9g, want %.9g", v, y[i], want);
    cr_assert(fabs(dx[i] - dwant) <= 1e-7 * fabs(dwant) + 1e-12, "x %.9g: dx %.9g, want %.9g", v, dx[i], dwant);
  }
  free(x), free(dy), free(y), free(dx);
}

/* ---- embedding ---- */

struct emb_case {
  int64_t r, t, c, v, tmax;
};
/* Awkward shapes; v = 1 and v = 3 put many positions on the same wte row. */
static const struct emb_case emb_cases[] = {
    {1, 1, 1, 1, 1}, {3, 5, 7, 11, 8}, {2, 64, 100, 3, 70}, {4, 33, 384, 50, 40}, {3, 100, 250, 1, 100},
};

static int32_t *rand_tokens(int64_t n, int64_t v) {
  int32_t *p = xmalloc((size_t)n * sizeof *p);
  for (int64_t i = 0; i < n; i++) p[i] = (int32_t)rng_below(&rng, (uint64_t)v);
  return p;
}

/* Forward: one float add per element, as the reference: exact. Backward:
 * the CPU op adds each position's gradient in position order, the
 * reference's order, so the sums agree to the bit with the reference and
 * across thread counts; dwte and dwpe start random (they accumulate). */
Test(tensor_nn, embedding_matches_reference_bitwise_and_accumulates) {
  for (size_t ci = 0; ci < sizeof emb_cases / sizeof emb_cases[0]; ci++) {
    const struct emb_case k = emb_cases[ci];
    int64_t n = k.r * k.t * k.c, te[2] = {k.v, k.c}, pe[2] = {k.tmax, k.c}, os[3] = {k.r, k.t, k.c};
    int32_t *tok = rand_tokens(k.r * k.t, k.v);
    float *wte = rand_host(k.v * k.c, 1), *wpe = rand_host(k.tmax * k.c, 1), *dout = rand_host(n, 1);
    float *dwte0 = rand_host(k.v * k.c, 1), *dwpe0 = rand_host(k.tmax * k.c, 1);
    float *out_ref = xmalloc((size_t)n * sizeof *out_ref);
    float *dwte_ref = dup_host(dwte0, k.v * k.c), *dwpe_ref = dup_host(dwpe0, k.tmax * k.c);
    tensor_ref_embedding_fwd(tok, wte, wpe, out_ref, k.r, k.t, k.c);
    tensor_ref_embedding_bwd(tok, dout, dwte_ref, dwpe_ref, k.r, k.t, k.c);
    struct tensor tt = dev_tokens(tok, k.r, k.t), wt = dev_from(wte, 2, te), wp = dev_from(wpe, 2, pe);
    struct tensor d = dev_from(dout, 3, os), out = dev_nan(3, os);
    for (size_t th = 0; th < NTHREADS; th++) {
      tensor_backend_set_threads(be, thread_counts[th]);
      char what[96];
      tensor_embedding_fwd(&tt, &wt, &wp, &out);
      float *og = to_host(&out);
      snprintf(what, sizeof what, "embedding_fwd case %zu threads %d", ci, thread_counts[th]);
      expect_close(what, og, out_ref, n, 0, 0);
      for (int rep = 0; rep < 2; rep++) { /* and the same bits on a second run */
        struct tensor dwt = dev_from(dwte0, 2, te), dwp = dev_from(dwpe0, 2, pe);
        tensor_embedding_bwd(&tt, &d, &dwt, &dwp);
        float *gt = to_host(&dwt), *gp = to_host(&dwp);
        snprintf(what, sizeof what, "embedding_bwd dwte case %zu threads %d run %d", ci, thread_counts[th], rep);
        expect_same_bits(what, gt, dwte_ref, k.v * k.c);
        snprintf(what, sizeof what, "embedding_bwd dwpe case %zu threads %d run %d", ci, thread_counts[th], rep);
        expect_same_bits(what, gp, dwpe_ref, k.tmax * k.c);
        free(gt), free(gp);
        tensor_free(&dwt), tensor_free(&dwp);
      }
      free(og);
    }
    free(tok), free(wte), free(wpe), free(dout), free(dwte0), free(dwpe0), free(out_ref), free(dwte_ref),
        free(dwpe_ref);
    tensor_free(&tt), tensor_free(&wt), tensor_free(&wp), tensor_free(&d), tensor_free(&out);
  }
}

/* Every position on one token: row 0 of dwte receives r·t gradients (the
 * accumulate contract, hammered), the other rows none. Checked against a
 * sum in double: float accumulation of r·t terms of magnitude <= 1. */
Test(tensor_nn, embedding_bwd_repeated_token_sums_all_positions) {
  const int64_t r = 3, t = 200, c = 130, v = 4;
  int64_t n = r * t * c, te[2] = {v, c}, pe[2] = {t, c}, os[3] = {r, t, c};
  int32_t *tok = xcalloc((size_t)(r * t), sizeof *tok); /* all token 0 */
  float *dout = rand_host(n, 1), *zero = xcalloc((size_t)((v > t ? v : t) * c), sizeof *zero);
  struct tensor tt = dev_tokens(tok, r, t), d = dev_from(dout, 3, os);
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    struct tensor dwt = dev_from(zero, 2, te), dwp = dev_from(zero, 2, pe);
    tensor_embedding_bwd(&tt, &d, &dwt, &dwp);
    float *gt = to_host(&dwt);
    for (int64_t j = 0; j < c; j++) {
      double sum = 0, mag = 0;
      for (int64_t i = 0; i < r * t; i++) sum += dout[i * c + j], mag += fabs(dout[i * c + j]);
      cr_assert(fabs(gt[j] - sum) <= 1e-6 * mag, "dwte[0][%lld] = %.9g, want %.9g", (long long)j, gt[j], sum);
      for (int64_t row = 1; row < v; row++) cr_assert_eq(gt[row * c + j], 0.0f, "a row with no token changed");
    }
    free(gt);
    tensor_free(&dwt), tensor_free(&dwp);
  }
  free(tok), free(dout), free(zero);
  tensor_free(&tt), tensor_free(&d);
}

/* ---- vocabulary-parallel embedding and cross-entropy ---- */

/* The vocabulary cut into `shards` contiguous parts as a tensor-parallel
 * group cuts it (the first v mod shards get one more row). */
static void shard_range(int64_t v, int shards, int s, int64_t *lo, int64_t *hi) {
  int64_t q = v / shards, rem = v % shards;
  *lo = s * q + (s < rem ? s : rem);
  *hi = *lo + q + (s < rem ? 1 : 0);
}

/* Each shard's forward (wpe on shard 0 only) and backward equal the
 * reference's bit for bit; the shards' outputs sum (in shard order) to the
 * whole op's exactly, and their dwte rows are the whole op's rows; every
 * shard's dwpe is the whole op's. dwte and dwpe start random (accumulate). */
Test(tensor_nn, embedding_shards_match_reference_and_sum_to_the_whole_op_bitwise) {
  const struct emb_case k = {3, 33, 40, 23, 36};
  const int shards = 3;
  int64_t n = k.r * k.t * k.c, pe[2] = {k.tmax, k.c}, os[3] = {k.r, k.t, k.c}, te[2] = {k.v, k.c};
  int32_t *tok = rand_tokens(k.r * k.t, k.v);
  float *wte = rand_host(k.v * k.c, 1), *wpe = rand_host(k.tmax * k.c, 1), *dout = rand_host(n, 1);
  float *dwte0 = rand_host(k.v * k.c, 1), *dwpe0 = rand_host(k.tmax * k.c, 1);
  float *whole = xmalloc((size_t)n * sizeof *whole), *sum = xcalloc((size_t)n, sizeof *sum);
  float *dwte_whole = dup_host(dwte0, k.v * k.c), *dwpe_whole = dup_host(dwpe0, k.tmax * k.c);
  tensor_ref_embedding_fwd(tok, wte, wpe, whole, k.r, k.t, k.c);
  tensor_ref_embedding_bwd(tok, dout, dwte_whole, dwpe_whole, k.r, k.t, k.c);
  struct tensor tt = dev_tokens(tok, k.r, k.t), wp = dev_from(wpe, 2, pe), d = dev_from(dout, 3, os);
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    memset(sum, 0, (size_t)n * sizeof *sum);
    for (int sh = 0; sh < shards; sh++) {
      int64_t lo, hi;
      shard_range(k.v, shards, sh, &lo, &hi);
      int64_t vs = hi - lo, ts[2] = {vs, k.c};
      char what[96];
      const float *wpe_or_null = sh == 0 ? wpe : NULL;
      float *ref = xmalloc((size_t)n * sizeof *ref);
      tensor_ref_embedding_shard_fwd(tok, wte + lo * k.c, lo, vs, wpe_or_null, ref, k.r, k.t, k.c);
      struct tensor ws = dev_from(wte + lo * k.c, 2, ts), out = dev_nan(3, os);
      tensor_embedding_shard_fwd(&tt, &ws, lo, sh == 0 ? &wp : NULL, &out);
      float *got = to_host(&out);
      snprintf(what, sizeof what, "embedding_shard_fwd shard %d threads %d", sh, thread_counts[th]);
      expect_same_bits(what, got, ref, n);
      for (int64_t i = 0; i < n; i++) sum[i] += got[i];
      /* Backward: the shard's rows of the whole op's dwte, and its dwpe. */
      struct tensor dwt = dev_from(dwte0 + lo * k.c, 2, ts), dwp = dev_from(dwpe0, 2, pe);
      tensor_embedding_shard_bwd(&tt, &d, lo, &dwt, &dwp);
      float *gt = to_host(&dwt), *gp = to_host(&dwp);
      snprintf(what, sizeof what, "embedding_shard_bwd dwte shard %d threads %d", sh, thread_counts[th]);
      expect_same_bits(what, gt, dwte_whole + lo * k.c, vs * k.c);
      snprintf(what, sizeof what, "embedding_shard_bwd dwpe shard %d threads %d", sh, thread_counts[th]);
      expect_same_bits(what, gp, dwpe_whole, k.tmax * k.c);
      free(ref), free(got), free(gt), free(gp);
      tensor_free(&ws), tensor_free(&out), tensor_free(&dwt), tensor_free(&dwp);
    }
    expect_same_bits("embedding shards summed", sum, whole, n);
  }
  /* dwpe NULL: only dwte moves. */
  struct tensor dwt = dev_from(dwte0, 2, te);
  tensor_embedding_shard_bwd(&tt, &d, 0, &dwt, NULL);
  float *gt = to_host(&dwt);
  expect_same_bits("embedding_shard_bwd without dwpe", gt, dwte_whole, k.v * k.c);
  free(gt), tensor_free(&dwt);
  free(tok), free(wte), free(wpe), free(dout), free(dwte0), free(dwpe0), free(whole), free(sum), free(dwte_whole),
      free(dwpe_whole);
  tensor_free(&tt), tensor_free(&wp), tensor_free(&d);
}

/* The cross-entropy's shard passes against the reference's, and their
 * combination against the whole softmax cross-entropy: the shards' losses
 * and (concatenated) gradients equal tensor_ref_softmax_xent's. Logits of
 * scale 30 make the softmax sharp, so a shard whose max is far below the
 * row's contributes underflowing terms. Tolerances: lse and the combined
 * loss are float roundings of double sums of expf terms (rtol 1e-6); the
 * gradient's exp(x − L) in float, 2e-6 relative plus 1e-9 absolute for
 * the underflowing tail. Targets are copied exactly. */
Test(tensor_nn, xent_shards_match_reference_and_combine_to_the_whole_softmax_xent) {
  const int64_t rows = 37, v = 103;
  const int shards = 4;
  const float gs = 0.25f;
  float *x = rand_host(rows * v, 30), *dref = xmalloc((size_t)(rows * v) * sizeof(float));
  float *lref = xmalloc((size_t)rows * sizeof(float)), *parts = xmalloc((size_t)(shards * rows) * sizeof(float));
  float *target = xcalloc((size_t)rows, sizeof(float));
  int32_t *lab = rand_tokens(rows, v);
  lab[0] = 0, lab[1] = (int32_t)(v - 1);
  tensor_ref_softmax_xent(x, lab, dref, lref, rows, v, gs);
  int64_t sl[1] = {rows};
  struct tensor labels;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&labels, be, TENSOR_I32, 1, sl, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&labels, 0, lab, (size_t)rows * sizeof(int32_t));
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    memset(target, 0, (size_t)rows * sizeof(float));
    float *cut[8];
    int64_t los[8], his[8];
    for (int sh = 0; sh < shards; sh++) { /* pass 1 per shard */
      shard_range(v, shards, sh, &los[sh], &his[sh]);
      int64_t vs = his[sh] - los[sh], shp[2] = {rows, vs};
      cut[sh] = xmalloc((size_t)(rows * vs) * sizeof(float));
      for (int64_t r = 0; r < rows; r++) memcpy(cut[sh] + r * vs, x + r * v + los[sh], (size_t)vs * sizeof(float));
      float *lse_ref = xmalloc((size_t)rows * sizeof(float)), *tg_ref = xmalloc((size_t)rows * sizeof(float));
      tensor_ref_xent_shard_stats(cut[sh], lab, los[sh], lse_ref, tg_ref, rows, vs);
      struct tensor lg = dev_from(cut[sh], 2, shp), lse = dev_nan(1, sl), tg = dev_nan(1, sl);
      tensor_xent_shard_stats(&lg, vs, &labels, los[sh], &lse, &tg);
      float *gl = to_host(&lse), *gt = to_host(&tg);
      expect_close("xent_shard_stats lse", gl, lse_ref, rows, 0, 1e-5);
      expect_same_bits("xent_shard_stats target", gt, tg_ref, rows);
      memcpy(parts + sh * rows, gl, (size_t)rows * sizeof(float));
      for (int64_t r = 0; r < rows; r++) target[r] += gt[r];
      free(lse_ref), free(tg_ref), free(gl), free(gt);
      tensor_free(&lg), tensor_free(&lse), tensor_free(&tg);
    }
    int64_t ps[2] = {shards, rows};
    struct tensor dp = dev_from(parts, 2, ps), dt = dev_from(target, 1, sl);
    for (int sh = 0; sh < shards; sh++) { /* pass 2 per shard, in place on odd shards */
      int64_t vs = his[sh] - los[sh], shp[2] = {rows, vs};
      float *want = xmalloc((size_t)(rows * vs) * sizeof(float)), *lwant = xmalloc((size_t)rows * sizeof(float));
      tensor_ref_xent_shard_grad(cut[sh], lab, los[sh], parts, shards, target, want, lwant, rows, vs, gs);
      struct tensor lg = dev_from(cut[sh], 2, shp), dl = dev_nan(2, shp), ls = dev_nan(1, sl);
      struct tensor *out = sh % 2 ? &lg : &dl;
      tensor_xent_shard_grad(&lg, vs, &labels, los[sh], &dp, &dt, out, &ls, gs);
      float *gd = to_host(out), *gls = to_host(&ls);
      expect_close("xent_shard_grad dlogits vs its reference", gd, want, rows * vs, 1e-8, 1e-5);
      /* Float exps and logs in another order (four shards' log-sum-exps
       * against one over the whole row): a few ulps apart, more on some
       * draws of the inputs, which change every run (2.3e-6 and 2.8e-6
       * relative seen, one in CI); a wrong index or combination is off by
       * far more. */
      expect_close("xent_shard_grad losses vs the whole softmax_xent", gls, lref, rows, 0, 1e-5);
      float *whole_cols = xmalloc((size_t)(rows * vs) * sizeof(float));
      for (int64_t r = 0; r < rows; r++)
        memcpy(whole_cols + r * vs, dref + r * v + los[sh], (size_t)vs * sizeof(float));
      expect_close("xent_shard_grad dlogits vs the whole softmax_xent", gd, whole_cols, rows * vs, 1e-8, 1e-5);
      free(want), free(lwant), free(gd), free(gls), free(whole_cols);
      tensor_free(&lg), tensor_free(&dl), tensor_free(&ls);
    }
    for (int sh = 0; sh < shards; sh++) free(cut[sh]);
    tensor_free(&dp), tensor_free(&dt);
  }
  free(x), free(dref), free(lref), free(parts), free(target), free(lab);
  tensor_free(&labels);
}

/* ---- padded rows (GPT's logits) ---- */

/* The first `cols` columns of each of `rows` rows `ld` apart, packed. */
static float *packed(const float *h, int64_t rows, int64_t cols, int64_t ld) {
  float *p = xmalloc((size_t)(rows * cols) * sizeof *p);
  for (int64_t r = 0; r < rows; r++) memcpy(p + r * cols, h + r * ld, (size_t)cols * sizeof *p);
  return p;
}

/* Asserts every padding column of t ([rows, ld], data in the first cols) is
 * still NaN: the op neither wrote nor (for the NaN to stay out of the data)
 * used it. */
static void expect_padding_nan(const char *what, const struct tensor *t, int64_t cols) {
  int64_t rows = t->shape[0], ld = t->shape[1];
  float *h = to_host(t);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = cols; c < ld; c++)
      cr_assert(isnan(h[r * ld + c]), "%s: padding [%lld, %lld] was written (%g)", what, (long long)r, (long long)c,
                h[r * ld + c]);
  free(h);
}

/* The tied head's three products and the cross-entropies on rows padded
 * as GPT pads its logits (V = 65 in rows of 128, the padding NaN): each
 * equals the reference on the packed matrix, and the padding is neither
 * written nor read (a NaN read would reach the results, which must be
 * finite). The padded cross-entropy is the packed one's bit for bit (the
 * same loops at another stride). Tolerances: the GEMMs' as test_tensor_ops
 * (1e-5 + 1e-4·|ref|, sums of 24 to 37 products), the cross-entropies' as
 * the shard test above. */
Test(tensor_nn, padded_rows_match_the_packed_matrices_and_leave_the_padding_alone) {
  const int64_t N = 37, C = 24, V = 65, LD = 128;
  const float gs = 0.125f;
  int64_t s_nc[2] = {N, C}, s_vc[2] = {V, C}, s_pad[2] = {N, LD}, s_nv[2] = {N, V}, s_n[1] = {N};
  float *ln = rand_host(N * C, 1), *wte = rand_host(V * C, 1), *dw0 = rand_host(V * C, 1);
  int32_t *lab = rand_tokens(N, V);
  lab[0] = 0, lab[1] = (int32_t)(V - 1);
  struct tensor dln = dev_from(ln, 2, s_nc), dwte = dev_from(wte, 2, s_vc), logits = dev_nan(2, s_pad), labels;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&labels, be, TENSOR_I32, 1, s_n, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&labels, 0, lab, (size_t)N * sizeof *lab);
  /* Forward: logits = ln·wteᵀ into the first V columns. */
  float *ref = xmalloc((size_t)(N * V) * sizeof *ref);
  tensor_ref_gemm(false, true, (int)N, (int)V, (int)C, 1.0f, ln, wte, 0.0f, ref);
  tensor_gemm_cols(false, true, 1.0f, &dln, C, &dwte, C, 0.0f, &logits, V);
  expect_padding_nan("gemm_cols forward", &logits, V);
  float *lh = to_host(&logits), *lp = packed(lh, N, V, LD);
  expect_close("gemm_cols forward", lp, ref, N * V, 1e-5, 1e-4);
  /* The cross-entropy, out of place and in place, against the packed op. */
  struct tensor pk = dev_from(lp, 2, s_nv), dpk = dev_nan(2, s_nv), lpk = dev_nan(1, s_n);
  struct tensor dl = dev_nan(2, s_pad), ls = dev_nan(1, s_n);
  tensor_softmax_xent(&pk, &labels, &dpk, &lpk, gs);
  tensor_softmax_xent_cols(&logits, V, &labels, &dl, &ls, gs);
  expect_padding_nan("softmax_xent_cols", &dl, V);
  float *want_d = to_host(&dpk), *want_l = to_host(&lpk), *gd = to_host(&dl), *gdp = packed(gd, N, V, LD);
  float *gl = to_host(&ls);
  expect_same_bits("softmax_xent_cols dlogits", gdp, want_d, N * V);
  expect_same_bits("softmax_xent_cols losses", gl, want_l, N);
  tensor_softmax_xent_cols(&logits, V, &labels, &logits, &ls, gs); /* in place, as the model runs it */
  expect_padding_nan("softmax_xent_cols in place", &logits, V);
  float *gi = to_host(&logits), *gip = packed(gi, N, V, LD);
  expect_same_bits("softmax_xent_cols in place", gip, want_d, N * V);
  /* Backward: dwte += dlᵀ·ln (accumulating, as the tied head does) and
   * dln = dl·wte, reading the first V columns of dl. */
  float *dwref = dup_host(dw0, V * C), *dxref = xmalloc((size_t)(N * C) * sizeof *dxref);
  tensor_ref_gemm(true, false, (int)V, (int)C, (int)N, 1.0f, want_d, ln, 1.0f, dwref);
  tensor_ref_gemm(false, false, (int)N, (int)C, (int)V, 1.0f, want_d, wte, 0.0f, dxref);
  struct tensor gw = dev_from(dw0, 2, s_vc), gx = dev_nan(2, s_nc);
  tensor_gemm_cols(true, false, 1.0f, &dl, V, &dln, C, 1.0f, &gw, C);
  tensor_gemm_cols(false, false, 1.0f, &dl, V, &dwte, C, 0.0f, &gx, C);
  float *gwh = to_host(&gw), *gxh = to_host(&gx);
  expect_close("gemm_cols dwte", gwh, dwref, V * C, 1e-5, 1e-4);
  expect_close("gemm_cols dx", gxh, dxref, N * C, 1e-5, 1e-4);
  /* The vocabulary-parallel passes on one shard holding the whole row. */
  float *lse_ref = xmalloc((size_t)N * sizeof *lse_ref), *tg_ref = xmalloc((size_t)N * sizeof *tg_ref);
  float *sd_ref = xmalloc((size_t)(N * V) * sizeof *sd_ref), *sl_ref = xmalloc((size_t)N * sizeof *sl_ref);
  tensor_ref_xent_shard_stats(lp, lab, 0, lse_ref, tg_ref, N, V);
  tensor_ref_xent_shard_grad(lp, lab, 0, lse_ref, 1, tg_ref, sd_ref, sl_ref, N, V, gs);
  struct tensor sx = dev_nan(2, s_pad), lse = dev_nan(1, s_n), tg = dev_nan(1, s_n), sdl = dev_nan(2, s_pad);
  for (int64_t r = 0; r < N; r++) tensor_copy_from_host(&sx, r * LD, lp + r * V, (size_t)V * sizeof(float));
  tensor_xent_shard_stats(&sx, V, &labels, 0, &lse, &tg);
  float *glse = to_host(&lse), *gtg = to_host(&tg);
  expect_close("xent_shard_stats padded lse", glse, lse_ref, N, 0, 1e-6);
  expect_same_bits("xent_shard_stats padded target", gtg, tg_ref, N);
  int64_t s_1n[2] = {1, N};
  struct tensor parts = dev_from(glse, 2, s_1n);
  tensor_xent_shard_grad(&sx, V, &labels, 0, &parts, &tg, &sdl, &ls, gs);
  expect_padding_nan("xent_shard_grad padded", &sdl, V);
  float *gsd = to_host(&sdl), *gsdp = packed(gsd, N, V, LD), *gsl = to_host(&ls);
  expect_close("xent_shard_grad padded dlogits", gsdp, sd_ref, N * V, 1e-9, 2e-6);
  expect_close("xent_shard_grad padded losses", gsl, sl_ref, N, 0, 1e-6);
  free(ln), free(wte), free(dw0), free(lab), free(ref), free(lh), free(lp), free(want_d), free(want_l), free(gd);
  free(gdp), free(gl), free(gi), free(gip), free(dwref), free(dxref), free(gwh), free(gxh), free(lse_ref), free(tg_ref);
  free(sd_ref), free(sl_ref), free(glse), free(gtg), free(gsd), free(gsdp), free(gsl);
  struct tensor *all[] = {&dln, &dwte, &logits, &labels, &pk, &dpk, &lpk, &dl, &ls, &gw, &gx, &sx, &lse, &tg, &sdl,
                          &parts};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

/* ---- LayerNorm ---- */

struct ln_case {
  int64_t rows, c;
  float offset; /* added to every x: a residual stream far from zero mean */
};
static const struct ln_case ln_cases[] = {{1, 1, 0}, {3, 7, 0},   {5, 13, 1},    {64, 384, 0},
                                          {257, 771, 0}, {100, 768, 50}, {1, 2048, -3}};

/* The reference normalises in double; the CPU op sums in double but
 * stores μ and σ⁻¹ in float and normalises in float: μ is off by up to half
 * an ulp (|offset|·6e-8), so x̂ agrees to about (1 + |offset|)·1e-7 and y
 * (|w| <= 1, |b| <= 1) within 5e-7 + 2e-7·|offset| absolute and 2e-6
 * relative; μ to its float rounding (1e-7 relative, 1e-9 absolute); σ⁻¹
 * to 2e-6 relative. A check independent of the reference: with w = 1, b = 0
 * each row of y has mean 0 and variance var/(var + eps). */
static void ln_fwd_case(const struct ln_case *k, int threads) {
  int64_t n = k->rows * k->c, xs[2] = {k->rows, k->c};
  float *xh = rand_host(n, 2), *w = rand_host(k->c, 1), *b = rand_host(k->c, 1);
  for (int64_t i = 0; i < n; i++) xh[i] += k->offset;
  float *yref = xmalloc((size_t)n * 4), *mref = xmalloc((size_t)k->rows * 4), *sref = xmalloc((size_t)k->rows * 4);
  tensor_ref_layernorm_fwd(xh, w, b, yref, mref, sref, k->rows, k->c);
  struct tensor x = dev_from(xh, 2, xs), wt = dev_from(w, 1, &k->c), bt = dev_from(b, 1, &k->c);
  struct tensor y = dev_nan(2, xs), mean = dev_nan(1, &k->rows), rstd = dev_nan(1, &k->rows);
  tensor_layernorm_fwd(&x, &wt, &bt, &y, &mean, &rstd);
  float *yg = to_host(&y), *mg = to_host(&mean), *sg = to_host(&rstd);
  char what[96];
  snprintf(what, sizeof what, "layernorm_fwd y %lldx%lld threads %d", (long long)k->rows, (long long)k->c, threads);
  expect_close(what, yg, yref, n, 5e-7 + 2e-7 * fabs(k->offset), 2e-6);
  expect_close("layernorm_fwd mean", mg, mref, k->rows, 1e-9, 1e-7);
  expect_close("layernorm_fwd rstd", sg, sref, k->rows, 0, 2e-6);
  /* w = 1, b = 0: each row standardised (rows with c = 1 have var 0: y = 0). */
  for (int64_t j = 0; j < k->c; j++) w[j] = 1, b[j] = 0;
  tensor_copy_from_host(&wt, 0, w, (size_t)k->c * 4);
  tensor_copy_from_host(&bt, 0, b, (size_t)k->c * 4);
  tensor_layernorm_fwd(&x, &wt, &bt, &y, &mean, &rstd);
  float *ys = to_host(&y);
  tensor_ref_layernorm_fwd(xh, w, b, yref, mref, sref, k->rows, k->c);
  for (int64_t i = 0; i < k->rows; i++) {
    for (int pass = 0; pass < 2; pass++) { /* the CPU op, then the reference */
      const float *yy = (pass ? yref : ys) + i * k->c;
      double m = 0, v = 0, var = 1.0 / ((double)sref[i] * sref[i]) - TENSOR_LAYERNORM_EPS;
      for (int64_t j = 0; j < k->c; j++) m += yy[j];
      m /= (double)k->c;
      for (int64_t j = 0; j < k->c; j++) v += (yy[j] - m) * (yy[j] - m);
      v /= (double)k->c;
      cr_assert(fabs(m) < 1e-5 && fabs(v - var / (var + TENSOR_LAYERNORM_EPS)) < 1e-4,
                "%s row %lld: mean %g variance %g", pass ? "reference" : "cpu", (long long)i, m, v);
    }
  }
  free(xh), free(w), free(b), free(yref), free(mref), free(sref), free(yg), free(mg), free(sg), free(ys);
  tensor_free(&x), tensor_free(&wt), tensor_free(&bt), tensor_free(&y), tensor_free(&mean), tensor_free(&rstd);
}

Test(tensor_nn, layernorm_fwd_matches_reference_and_standardises_rows) {
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    for (size_t ci = 0; ci < sizeof ln_cases / sizeof ln_cases[0]; ci++) ln_fwd_case(&ln_cases[ci], thread_counts[th]);
  }
}

/* Backward from the reference forward's mean and rstd. dx starts random
 * (it accumulates), dw and db start NaN for beta = 0 (overwritten) and
 * random for beta = 0.75. Tolerances: dx is rstd·(g − mean g − x̂·mean gx̂)
 * with O(1) terms in float: 4e-7·rstd absolute (a few ulp of the terms),
 * 2e-6 relative; dw, db are column sums over `rows` float terms of
 * magnitude <= ~3 (chunk partials in float, chunks in double): 2e-7·rows
 * absolute, 2e-6 relative. All three must be the same bits at 1 and at 2
 * threads. */
static void ln_bwd_case(const struct ln_case *k, float beta, float *bits[NTHREADS][3], int ti) {
  int64_t n = k->rows * k->c, xs[2] = {k->rows, k->c};
  struct rng keep = rng; /* the same inputs for every thread count */
  float *xh = rand_host(n, 2), *w = rand_host(k->c, 1), *dyh = rand_host(n, 1), *dx0 = rand_host(n, 1);
  float *dw0 = rand_host(k->c, 1), *db0 = rand_host(k->c, 1);
  rng = keep;
  for (int64_t i = 0; i < n; i++) xh[i] += k->offset;
  float *b = xcalloc((size_t)k->c, 4), *y = xmalloc((size_t)n * 4);
  float *mh = xmalloc((size_t)k->rows * 4), *sh = xmalloc((size_t)k->rows * 4);
  tensor_ref_layernorm_fwd(xh, w, b, y, mh, sh, k->rows, k->c);
  float *dxref = dup_host(dx0, n), *dwref = dup_host(dw0, k->c), *dbref = dup_host(db0, k->c);
  tensor_ref_layernorm_bwd(xh, w, mh, sh, dyh, dxref, dwref, dbref, k->rows, k->c, beta);
  struct tensor x = dev_from(xh, 2, xs), wt = dev_from(w, 1, &k->c), mean = dev_from(mh, 1, &k->rows);
  struct tensor rstd = dev_from(sh, 1, &k->rows), dy = dev_from(dyh, 2, xs), dx = dev_from(dx0, 2, xs);
  struct tensor dw = dev_from(dw0, 1, &k->c), db = dev_from(db0, 1, &k->c);
  if (beta == 0.0f) tensor_fill(&dw, NAN), tensor_fill(&db, NAN);
  tensor_layernorm_bwd(&x, &wt, &mean, &rstd, &dy, &dx, &dw, &db, beta);
  float *dxg = to_host(&dx), *dwg = to_host(&dw), *dbg = to_host(&db);
  float smax = 0;
  for (int64_t i = 0; i < k->rows; i++) smax = sh[i] > smax ? sh[i] : smax;
  char what[96];
  snprintf(what, sizeof what, "layernorm_bwd dx %lldx%lld beta %g", (long long)k->rows, (long long)k->c, beta);
  expect_close(what, dxg, dxref, n, 4e-7 * smax, 2e-6);
  expect_close("layernorm_bwd dw", dwg, dwref, k->c, 2e-7 * (double)k->rows, 2e-6);
  expect_close("layernorm_bwd db", dbg, dbref, k->c, 2e-7 * (double)k->rows, 2e-6);
  bits[ti][0] = dxg, bits[ti][1] = dwg, bits[ti][2] = dbg;
  free(xh), free(w), free(dyh), free(dx0), free(dw0), free(db0), free(b), free(y), free(mh), free(sh), free(dxref),
      free(dwref), free(dbref);
  tensor_free(&x), tensor_free(&wt), tensor_free(&mean), tensor_free(&rstd), tensor_free(&dy), tensor_free(&dx),
      tensor_free(&dw), tensor_free(&db);
}

Test(tensor_nn, layernorm_bwd_matches_reference_accumulates_and_is_thread_count_independent) {
  for (size_t ci = 0; ci < sizeof ln_cases / sizeof ln_cases[0]; ci++)
    for (int bi = 0; bi < 2; bi++) {
      float beta = bi ? 0.75f : 0.0f, *bits[NTHREADS][3];
      for (size_t th = 0; th < NTHREADS; th++) {
        tensor_backend_set_threads(be, thread_counts[th]);
        ln_bwd_case(&ln_cases[ci], beta, bits, (int)th);
      }
      const struct ln_case *k = &ln_cases[ci];
      const int64_t len[3] = {k->rows * k->c, k->c, k->c};
      const char *names[3] = {"dx", "dw", "db"};
      for (int o = 0; o < 3; o++) {
        char what[96];
        snprintf(what, sizeof what, "layernorm_bwd %s 1 vs 2 threads (%lldx%lld)", names[o], (long long)k->rows,
                 (long long)k->c);
        expect_same_bits(what, bits[0][o], bits[1][o], len[o]);
        for (size_t th = 0; th < NTHREADS; th++) free(bits[th][o]);
      }
    }
}

/* ---- attention ---- */

struct att_case {
  int64_t r, t, c;
  int nh;
  float bias; /* common component of q and k: scaled scores of about this size */
};
static const struct att_case att_cases[] = {
    {1, 1, 8, 2, 0},    {3, 1, 6, 6, 0},    {3, 5, 12, 3, 0},   {2, 64, 32, 2, 0},  {2, 65, 24, 3, 0},
    {1, 130, 16, 1, 0}, {2, 17, 6, 6, 0},   {1, 200, 64, 4, 0}, {3, 100, 96, 2, 0}, {2, 128, 128, 4, 0},
    {2, 70, 64, 4, 30}, {1, 129, 16, 1, 40}, {1, 600, 32, 2, 0},  {1, 513, 8, 1, 20},
};
/* (T >= 512 takes 128-row query blocks: 600 and 513 are not multiples.) */

/* qkv (r, t, 3c) uniform in ±1; with a bias B, q and k get a common
 * component u = sqrt(B/√hs) per column, so every scaled score is about B
 * (plus or minus several units): the softmax must subtract its maximum. */
static float *att_inputs(const struct att_case *k) {
  int64_t hs = k->c / k->nh, rows = k->r * k->t;
  float *qkv = rand_host(rows * 3 * k->c, 1);
  if (k->bias > 0) {
    float u = sqrtf(k->bias / sqrtf((float)hs));
    for (int64_t i = 0; i < rows; i++)
      for (int64_t j = 0; j < 2 * k->c; j++) qkv[i * 3 * k->c + j] += u;
  }
  return qkv;
}

/* Tolerances: the CPU op computes scores in float GEMMs (error ~ hs·1e-7
 * relative to Σ|q·k|) and exp in 1.5 ulp, the reference everything in
 * double. An error δ in a score moves its probability by δ relatively, so
 * errors grow with the scores' magnitude m = 3 + |bias|: out (a convex
 * combination of |v| <= 1) within m·4e-7 absolute and 2e-6 relative; lse
 * within m·4e-7 + 2e-7·|lse|; the gradients (O(1) here) within m·2e-6
 * absolute, 2e-5 relative. The largest errors seen over many random runs
 * used less than half of these (run with --verbose to see). */
static void att_case_check(const struct att_case *k, int threads, float *keep[2]) {
  int64_t n3 = k->r * k->t * 3 * k->c, n = k->r * k->t * k->c, nl = k->r * k->nh * k->t;
  int64_t s3[3] = {k->r, k->t, 3 * k->c}, so[3] = {k->r, k->t, k->c}, sl[3] = {k->r, k->nh, k->t};
  struct rng saved = rng; /* the same inputs for every thread count */
  float *qkv = att_inputs(k), *dout = rand_host(n, 1);
  rng = saved;
  float *oref = xmalloc((size_t)n * 4), *lref = xmalloc((size_t)nl * 4), *dref = xmalloc((size_t)n3 * 4);
  tensor_ref_attention_fwd(qkv, oref, lref, k->r, k->t, k->c, k->nh);
  tensor_ref_attention_bwd(qkv, oref, lref, dout, dref, k->r, k->t, k->c, k->nh);
  struct tensor q = dev_from(qkv, 3, s3), o = dev_nan(3, so), l = dev_nan(3, sl), d = dev_from(dout, 3, so);
  struct tensor dq = dev_nan(3, s3);
  tensor_attention_fwd(&q, k->nh, &o, &l);
  tensor_attention_bwd(&q, &o, &l, &d, k->nh, &dq); /* from the CPU op's own out and lse, as in training */
  float *og = to_host(&o), *lg = to_host(&l), *dg = to_host(&dq);
  double m = 3 + fabs(k->bias);
  char what[128];
  snprintf(what, sizeof what, "attention r%lld t%lld c%lld nh%d bias %g threads %d", (long long)k->r,
           (long long)k->t, (long long)k->c, k->nh, k->bias, threads);
  char w2[160];
  snprintf(w2, sizeof w2, "%s: out", what);
  expect_close(w2, og, oref, n, m * 4e-7, 2e-6);
  snprintf(w2, sizeof w2, "%s: lse", what);
  expect_close(w2, lg, lref, nl, m * 4e-7, 2e-7);
  snprintf(w2, sizeof w2, "%s: dqkv", what);
  expect_close(w2, dg, dref, n3, m * 2e-6, 2e-5);
  /* Run to run: the same bits at a given thread count. */
  tensor_attention_fwd(&q, k->nh, &o, &l);
  tensor_fill(&dq, NAN);
  tensor_attention_bwd(&q, &o, &l, &d, k->nh, &dq);
  float *og2 = to_host(&o), *dg2 = to_host(&dq);
  expect_same_bits("attention out, second run", og2, og, n);
  expect_same_bits("attention dqkv, second run", dg2, dg, n3);
  keep[0] = og2, keep[1] = dg2; /* the caller's */
  free(qkv), free(dout), free(oref), free(lref), free(dref), free(og), free(lg), free(dg);
  tensor_free(&q), tensor_free(&o), tensor_free(&l), tensor_free(&d), tensor_free(&dq);
}

/* And between thread counts: with at least as many (sequence, head) pairs
 * as threads each pair runs whole on one worker with a single-threaded
 * GEMM, so 1 and 2 threads give the same bits (tensor_cpu_nn.c). */
Test(tensor_nn, attention_matches_reference_on_awkward_shapes_and_large_scores) {
  for (size_t ci = 0; ci < sizeof att_cases / sizeof att_cases[0]; ci++) {
    const struct att_case *k = &att_cases[ci];
    float *keep[NTHREADS][2];
    for (size_t th = 0; th < NTHREADS; th++) {
      tensor_backend_set_threads(be, thread_counts[th]);
      att_case_check(k, thread_counts[th], keep[th]);
    }
    if (k->r * k->nh >= 2) {
      expect_same_bits("attention out, 1 vs 2 threads", keep[0][0], keep[1][0], k->r * k->t * k->c);
      expect_same_bits("attention dqkv, 1 vs 2 threads", keep[0][1], keep[1][1], k->r * k->t * 3 * k->c);
    }
    for (size_t th = 0; th < NTHREADS; th++) free(keep[th][0]), free(keep[th][1]);
  }
}

/* T = 1: each query sees only its own key, so P = 1 exactly: out = v bit
 * for bit, lse = q·k/√hs (to float rounding of a short dot product), and
 * the backward gives dv = dout exactly and dq = dk = 0 (dP − D = 0 up to
 * rounding). For the CPU op and the reference alike. */
Test(tensor_nn, attention_single_position_copies_v_and_lse_is_the_score) {
  const int64_t r = 3, t = 1, c = 12;
  const int nh = 3;
  int64_t hs = c / nh, s3[3] = {r, t, 3 * c}, so[3] = {r, t, c}, sl[3] = {r, nh, t};
  float *qkv = rand_host(r * 3 * c, 2), *dout = rand_host(r * c, 1);
  struct tensor q = dev_from(qkv, 3, s3), o = dev_nan(3, so), l = dev_nan(3, sl), d = dev_from(dout, 3, so);
  struct tensor dq = dev_nan(3, s3);
  float *oref = xmalloc((size_t)(r * c) * 4), *lref = xmalloc((size_t)(r * nh) * 4);
  float *dref = xmalloc((size_t)(r * 3 * c) * 4);
  for (size_t th = 0; th < NTHREADS; th++) {
    tensor_backend_set_threads(be, thread_counts[th]);
    tensor_attention_fwd(&q, nh, &o, &l);
    tensor_attention_bwd(&q, &o, &l, &d, nh, &dq);
    float *og = to_host(&o), *lg = to_host(&l), *dg = to_host(&dq);
    tensor_ref_attention_fwd(qkv, oref, lref, r, t, c, nh);
    tensor_ref_attention_bwd(qkv, oref, lref, dout, dref, r, t, c, nh);
    for (int pass = 0; pass < 2; pass++) {
      const float *oo = pass ? oref : og, *ll = pass ? lref : lg, *dd = pass ? dref : dg;
      const char *who = pass ? "reference" : "cpu";
      for (int64_t s = 0; s < r; s++)
        for (int h = 0; h < nh; h++) {
          const float *qs = qkv + s * 3 * c + h * hs, *ks = qs + c, *vs = qs + 2 * c;
          double dot = 0;
          for (int64_t j = 0; j < hs; j++) {
            dot += (double)qs[j] * ks[j];
            cr_assert_eq(oo[s * c + h * hs + j], vs[j], "%s: out != v at seq %lld head %d", who, (long long)s, h);
            cr_assert_eq(dd[s * 3 * c + 2 * c + h * hs + j], dout[s * c + h * hs + j], "%s: dv != dout", who);
            cr_assert(fabs(dd[s * 3 * c + h * hs + j]) < 1e-6 && fabs(dd[s * 3 * c + c + h * hs + j]) < 1e-6,
                      "%s: dq or dk not 0", who);
          }
          double want = dot / sqrt((double)hs);
          cr_assert(fabs(ll[s * nh + h] - want) <= 1e-6 * (1 + fabs(want)), "%s: lse %.9g, want %.9g", who,
                    ll[s * nh + h], want);
        }
    }
    free(og), free(lg), free(dg);
  }
  free(qkv), free(dout), free(oref), free(lref), free(dref);
  tensor_free(&q), tensor_free(&o), tensor_free(&l), tensor_free(&d), tensor_free(&dq);
}

/* Keys all zero: every score is 0, so each query averages the values of
 * positions 0..t (the causal mask, checked without the reference), and
 * lse = log(t + 1). */
Test(tensor_nn, attention_with_equal_scores_averages_the_causal_prefix) {
  const int64_t r = 2, t = 150, c = 16;
  const int nh = 2;
  int64_t s3[3] = {r, t, 3 * c}, so[3] = {r, t, c}, sl[3] = {r, nh, t};
  float *qkv = rand_host(r * t * 3 * c, 1);
  for (int64_t i = 0; i < r * t; i++) memset(qkv + i * 3 * c + c, 0, (size_t)c * 4);
  float *oref = xmalloc((size_t)(r * t * c) * 4), *lref = xmalloc((size_t)(r * nh * t) * 4);
  tensor_ref_attention_fwd(qkv, oref, lref, r, t, c, nh);
  struct tensor q = dev_from(qkv, 3, s3), o = dev_nan(3, so), l = dev_nan(3, sl);
  tensor_backend_set_threads(be, 2);
  tensor_attention_fwd(&q, nh, &o, &l);
  float *og = to_host(&o), *lg = to_host(&l);
  for (int pass = 0; pass < 2; pass++) {
    const float *oo = pass ? oref : og, *ll = pass ? lref : lg;
    for (int64_t s = 0; s < r; s++)
      for (int64_t i = 0; i < t; i++) {
        for (int h = 0; h < nh; h++)
          cr_assert(fabs(ll[(s * nh + h) * t + i] - log((double)(i + 1))) < 2e-6, "%s: lse", pass ? "ref" : "cpu");
        for (int64_t j = 0; j < c; j++) {
          double mean = 0;
          for (int64_t p = 0; p <= i; p++) mean += qkv[(s * t + p) * 3 * c + 2 * c + j];
          mean /= (double)(i + 1);
          cr_assert(fabs(oo[(s * t + i) * c + j] - mean) < 1e-6, "%s: seq %lld pos %lld col %lld: %.9g, want %.9g",
                    pass ? "ref" : "cpu", (long long)s, (long long)i, (long long)j, oo[(s * t + i) * c + j], mean);
        }
      }
  }
  free(qkv), free(oref), free(lref), free(og), free(lg);
  tensor_free(&q), tensor_free(&o), tensor_free(&l);
}

/* ---- finite differences of the reference ops ----
 * For L = Σ g⊙y (g random, y an op's output, summed in double), the
 * reference backward's gradient of each input element is compared with
 * (L(x + h) − L(x − h)) / (x₊ − x₋), h = 1e-3, x₊ and x₋ the floats
 * actually stored. The reference computes in double but stores y in float,
 * so each output that changes carries up to half an ulp of rounding into
 * each L; that noise, Σ_changed |g|·(|y₊| + |y₋|)·2⁻²⁴ / (x₊ − x₋), is part
 * of the allowed error, plus 1e-4 absolute for the O(h²) truncation (third
 * derivatives up to 600) and 1e-4 relative. */
struct fd_ctx {
  void (*fwd)(struct fd_ctx *); /* recomputes y from the inputs */
  float *y;
  const float *g;
  int64_t ny;
  const void *p[4]; /* the op's inputs and sizes, for fwd */
  int64_t d[4];
};

static void fd_check(const char *what, struct fd_ctx *f, float *x, int64_t n, const float *grad) {
  float *yp = xmalloc((size_t)f->ny * sizeof *yp);
  double used = 0;
  for (int64_t i = 0; i < n; i++) {
    const float x0 = x[i];
    x[i] = x0 + 1e-3f;
    const float xp = x[i];
    f->fwd(f);
    memcpy(yp, f->y, (size_t)f->ny * sizeof *yp);
    x[i] = x0 - 1e-3f;
    const float xm = x[i];
    f->fwd(f);
    x[i] = x0;
    double lp = 0, lm = 0, noise = 0;
    for (int64_t k = 0; k < f->ny; k++) {
      lp += (double)f->g[k] * yp[k];
      lm += (double)f->g[k] * f->y[k];
      if (yp[k] != f->y[k]) noise += fabs(f->g[k]) * (fabs(yp[k]) + fabs(f->y[k])) * 0x1p-24;
    }
    double step = (double)xp - xm, fd = (lp - lm) / step;
    double tol = noise / step + 1e-4 + 1e-4 * fabs(grad[i]);
    used = fabs(fd - grad[i]) / tol > used ? fabs(fd - grad[i]) / tol : used;
    cr_assert(fabs(fd - grad[i]) <= tol, "%s: element %lld: finite difference %.9g, backward %.9g (tol %.3g)", what,
              (long long)i, fd, grad[i], tol);
  }
  cr_log_info("%s: %.3f of the tolerance used", what, used);
  f->fwd(f);
  free(yp);
}

static void fd_gelu(struct fd_ctx *f) { tensor_ref_gelu_tanh_fwd(f->p[0], f->y, f->ny); }

Test(tensor_nn, reference_gelu_tanh_backward_matches_finite_differences) {
  const int64_t n = 200;
  float *x = rand_host(n, 5), *g = rand_host(n, 1), *y = xmalloc(n * 4), *dx = xmalloc(n * 4);
  tensor_ref_gelu_tanh_bwd(x, g, dx, n);
  struct fd_ctx f = {.fwd = fd_gelu, .y = y, .g = g, .ny = n, .p = {x}};
  fd_gelu(&f);
  fd_check("gelu_tanh dx", &f, x, n, dx);
  free(x), free(g), free(y), free(dx);
}

static void fd_emb(struct fd_ctx *f) {
  tensor_ref_embedding_fwd(f->p[0], f->p[1], f->p[2], f->y, f->d[0], f->d[1], f->d[2]);
}

Test(tensor_nn, reference_embedding_backward_matches_finite_differences) {
  const int64_t r = 3, t = 6, c = 5, v = 4, tmax = 7; /* 18 positions on 4 tokens: repeats */
  int32_t *tok = rand_tokens(r * t, v);
  float *wte = rand_host(v * c, 1), *wpe = rand_host(tmax * c, 1), *g = rand_host(r * t * c, 1);
  float *y = xmalloc((size_t)(r * t * c) * 4), *dwte = xcalloc((size_t)(v * c), 4);
  float *dwpe = xcalloc((size_t)(tmax * c), 4);
  tensor_ref_embedding_bwd(tok, g, dwte, dwpe, r, t, c);
  struct fd_ctx f = {.fwd = fd_emb, .y = y, .g = g, .ny = r * t * c, .p = {tok, wte, wpe}, .d = {r, t, c}};
  fd_emb(&f);
  fd_check("embedding dwte", &f, wte, v * c, dwte);
  fd_check("embedding dwpe", &f, wpe, tmax * c, dwpe); /* rows t..tmax−1 unused: gradient 0 */
  free(tok), free(wte), free(wpe), free(g), free(y), free(dwte), free(dwpe);
}

static void fd_ln(struct fd_ctx *f) {
  float mean[16], rstd[16];
  tensor_ref_layernorm_fwd(f->p[0], f->p[1], f->p[2], f->y, mean, rstd, f->d[0], f->d[1]);
}

Test(tensor_nn, reference_layernorm_backward_matches_finite_differences) {
  const int64_t rows = 4, c = 9;
  float *x = rand_host(rows * c, 2), *w = rand_host(c, 1), *b = rand_host(c, 1), *g = rand_host(rows * c, 1);
  float *y = xmalloc((size_t)(rows * c) * 4), mean[4], rstd[4];
  float *dx = xcalloc((size_t)(rows * c), 4), *dw = xmalloc((size_t)c * 4), *db = xmalloc((size_t)c * 4);
  tensor_ref_layernorm_fwd(x, w, b, y, mean, rstd, rows, c);
  tensor_ref_layernorm_bwd(x, w, mean, rstd, g, dx, dw, db, rows, c, 0.0f);
  struct fd_ctx f = {.fwd = fd_ln, .y = y, .g = g, .ny = rows * c, .p = {x, w, b}, .d = {rows, c}};
  fd_check("layernorm dx", &f, x, rows * c, dx);
  fd_check("layernorm dw", &f, w, c, dw);
  fd_check("layernorm db", &f, b, c, db);
  free(x), free(w), free(b), free(g), free(y), free(dx), free(dw), free(db);
}

static void fd_att(struct fd_ctx *f) {
  float lse[64];
  tensor_ref_attention_fwd(f->p[0], f->y, lse, f->d[0], f->d[1], f->d[2], (int)f->d[3]);
}

Test(tensor_nn, reference_attention_backward_matches_finite_differences) {
  const int64_t r = 2, t = 5, c = 8;
  const int nh = 2;
  for (int big = 0; big < 2; big++) { /* moderate scores, then scores near 8 */
    const struct att_case k = {r, t, c, nh, big ? 8.0f : 0.0f};
    float *qkv = att_inputs(&k), *g = rand_host(r * t * c, 1), *y = xmalloc((size_t)(r * t * c) * 4);
    float lse[64], *dqkv = xmalloc((size_t)(r * t * 3 * c) * 4);
    tensor_ref_attention_fwd(qkv, y, lse, r, t, c, nh);
    tensor_ref_attention_bwd(qkv, y, lse, g, dqkv, r, t, c, nh);
    struct fd_ctx f = {.fwd = fd_att, .y = y, .g = g, .ny = r * t * c, .p = {qkv}, .d = {r, t, c, nh}};
    fd_check(big ? "attention dqkv (scores near 8)" : "attention dqkv", &f, qkv, r * t * 3 * c, dqkv);
    free(qkv), free(g), free(y), free(dqkv);
  }
}
