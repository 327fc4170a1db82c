/*
 * The CUDA backend at GPT-2 small's real shapes (batch 8 × 1024 positions,
 * C = 768, V = 50257), against the plain CPU reference, and the TF32
 * switch.
 *
 * - GEMMs: the three products of a block's QKV projection (8192 × 2304 ×
 *   768: forward, dx, dW with beta = 1) and of the tied head (8192 × 50257
 *   × 768 with the unaligned row stride 50257: logits, dx over k = 50257,
 *   and dwte accumulated with beta = 1). Each runs once; the reference
 *   (double sums on the host) is computed for 32 rows of the output spread
 *   over it, first and last included, since the whole head product takes
 *   minutes in a plain loop. Every output element is checked finite and
 *   the guard bands intact.
 * - Softmax cross-entropy at V = 50257 over 8192 rows, and over 42794 rows
 *   (rows·V = 2 150 698 058 > 2^31: every index past 2^31 must be 64-bit),
 *   in place, with the reference (tensor_ref_softmax_xent, row by row) for
 *   sampled rows that include the last ones.
 * - TF32: tensor_backend_set_tf32 changes a GEMM's result (within TF32's
 *   tolerance) and switching back gives FP32's bits again.
 *
 * Memory: about 2.5 GiB of device memory for the head, 8.1 GiB for the
 * > 2^31 cross-entropy (checked against the free memory first; skipped
 * with a message where it does not fit). Every test skips with "no CUDA
 * GPU: ..." when tensor_cuda_device_count() is 0.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_ref.h"

#include "../support/cuda_check.h"

#define NSAMPLE 32 /* output rows checked against the reference per GEMM */

/* Values in [-1, 1) from a xorshift stream: the big operands (up to 1.6 G
 * floats) would take half a minute as normals. */
static void fill_fast(float *p, int64_t n, uint64_t seed) {
  uint64_t x = seed * 0x9E3779B97F4A7C15ull + 1;
  for (int64_t i = 0; i < n; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    p[i] = (float)((double)(x >> 40) / (double)(1ull << 23) - 1.0);
  }
}

/* NSAMPLE row indices in [0, m): 0, m − 1 and evenly between. */
static void sample_rows(int64_t m, int64_t *rows) {
  for (int i = 0; i < NSAMPLE; i++) rows[i] = (int64_t)((double)i * (double)(m - 1) / (NSAMPLE - 1));
}

/* out[s, j] ← alpha·Σ_p op(A)[rows[s], p]·op(B)[p, j] + beta·c0[rows[s], j]
 * in double, for row-major A, B, C0 with row strides lda, ldb, ldc (c0 not
 * read when beta is 0). */
static void ref_rows(bool ta, bool tb, int64_t n, int64_t k, float alpha, const float *a, int64_t lda, const float *b,
                     int64_t ldb, float beta, const float *c0, int64_t ldc, const int64_t *rows, float *out) {
  double *acc = xmalloc((size_t)n * sizeof *acc);
  for (int s = 0; s < NSAMPLE; s++) {
    const int64_t i = rows[s];
    for (int64_t j = 0; j < n; j++) acc[j] = 0.0;
    if (tb) { /* op(B)[p, j] = b[j, p]: walk B's rows */
      for (int64_t j = 0; j < n; j++) {
        double d = 0.0;
        for (int64_t p = 0; p < k; p++) d += (double)(ta ? a[p * lda + i] : a[i * lda + p]) * (double)b[j * ldb + p];
        acc[j] = d;
      }
    } else {
      for (int64_t p = 0; p < k; p++) {
        const double aip = ta ? a[p * lda + i] : a[i * lda + p];
        const float *bp = b + p * ldb;
        for (int64_t j = 0; j < n; j++) acc[j] += aip * (double)bp[j];
      }
    }
    for (int64_t j = 0; j < n; j++)
      out[(int64_t)s * n + j] = (float)(alpha * acc[j] + (beta != 0.0f ? (double)beta * c0[i * ldc + j] : 0.0));
  }
  free(acc);
}

/* Skips unless the device has `bytes` free (and a little more). */
static void need_device_memory(size_t bytes, const char *what) {
  size_t free_b = 0, total = 0;
  if (tensor_backend_mem_info(g_be, &free_b, &total) && free_b < bytes + ((size_t)512 << 20))
    cr_skip_test("%s needs %.1f GiB of device memory, %.1f GiB free: skipped", what,
                 (double)bytes / (double)(1ull << 30), (double)free_b / (double)(1ull << 30));
}

/* One GEMM C[m,n] = alpha·op(A)·op(B) + beta·C on the device, checked on
 * sampled rows. Tolerance against the double reference: FP32 products
 * summed over k terms of size <= 1 (inputs in [-1, 1)): atol 5e-7·k,
 * rtol 1e-5 (a wrong transpose, stride or beta gives errors of order 1). */
static void run_big_gemm(const char *name, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float beta) {
  int mark = arena_mark();
  int64_t sa[2] = {ta ? k : m, ta ? m : k}, sb[2] = {tb ? n : k, tb ? k : n}, sc[2] = {m, n};
  float *ha = hbuf(m * k), *hb = hbuf(k * n), *hc = beta != 0.0f ? hbuf(m * n) : NULL;
  fill_fast(ha, m * k, 1);
  fill_fast(hb, k * n, 2);
  struct dev a = dev_from(2, sa, ha), b = dev_from(2, sb, hb), c = dev_new_g(TENSOR_F32, 2, sc, GUARD);
  if (hc) {
    fill_fast(hc, m * n, 3);
    dev_upload(&c, hc);
  }
  tensor_gemm(ta, tb, 0.75f, &a.t, &b.t, beta, &c.t);
  char what[160];
  snprintf(what, sizeof what, "%s: gemm(%c%c, m=%" PRId64 " n=%" PRId64 " k=%" PRId64 ", beta=%g)", name,
           ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, beta);
  cr_assert_eq(tensor_count_nonfinite(&c.t), 0, "%s: non-finite outputs", what);
  cr_assert(guards_intact(&c, what), "%s", g_why);
  int64_t rows[NSAMPLE];
  sample_rows(m, rows);
  float *ref = hbuf(NSAMPLE * n), *got = hbuf(NSAMPLE * n);
  ref_rows(ta, tb, n, k, 0.75f, ha, ta ? m : k, hb, tb ? k : n, beta, hc, n, rows, ref);
  for (int s = 0; s < NSAMPLE; s++) tensor_copy_to_host(&c.t, rows[s] * n, got + (int64_t)s * n, (size_t)n * 4);
  cr_assert(matches(what, got, ref, NSAMPLE * n, 5e-7 * (double)k, 1e-5), "%s", g_why);
  arena_release(mark);
}

Test(cuda_shapes, gemms_of_a_blocks_qkv_projection_at_8192_x_2304_x_768) {
  open_gpu();
  run_big_gemm("qkv forward", false, true, 8192, 2304, 768, 0.0f); /* x·Wᵀ, W (2304, 768) */
  run_big_gemm("qkv dx", false, false, 8192, 768, 2304, 0.0f);     /* dy·W */
  run_big_gemm("qkv dW", true, false, 2304, 768, 8192, 1.0f);      /* dW += dyᵀ·x */
  close_gpu();
}

Test(cuda_shapes, gemms_of_the_tied_head_at_8192_x_50257_x_768_with_row_stride_50257) {
  open_gpu();
  need_device_memory((size_t)3 * 8192 * 50257 * 4 / 2, "the head's GEMMs");
  run_big_gemm("head logits", false, true, 8192, 50257, 768, 0.0f); /* x·wteᵀ, ldc = 50257 */
  run_big_gemm("head dx", false, false, 8192, 768, 50257, 0.0f);    /* dlogits·wte, lda = 50257, k = 50257 */
  run_big_gemm("head dwte", true, false, 50257, 768, 8192, 1.0f);   /* dwte += dlogitsᵀ·x, lda = 50257 */
  close_gpu();
}

/* Losses and dlogits of sampled rows against tensor_ref_softmax_xent run on
 * those rows alone (the op is row by row). Tolerances as the op test's
 * (test_tensor_cuda.c): losses 1e-5 + 1e-5 relative, dlogits 2e-6·gs
 * absolute + 1e-5 relative. */
static void check_xent_rows(const struct tensor *d, const struct tensor *losses, const float *block, int64_t block_rows,
                            const int32_t *lab, int64_t rows, int64_t v, float gs, const char *name) {
  int64_t pick[NSAMPLE];
  sample_rows(rows, pick);
  pick[NSAMPLE - 2] = rows - 2;
  float *ref_d = hbuf(v), *got_d = hbuf(v), ref_l, got_l;
  char what[160];
  for (int s = 0; s < NSAMPLE; s++) {
    const int64_t r = pick[s];
    tensor_ref_softmax_xent(block + (r % block_rows) * v, lab + r, ref_d, &ref_l, 1, v, gs);
    tensor_copy_to_host(d, r * v, got_d, (size_t)v * 4);
    tensor_copy_to_host(losses, r, &got_l, 4);
    snprintf(what, sizeof what, "%s: row %" PRId64 " (elements from %" PRId64 ") dlogits", name, r, r * v);
    cr_assert(matches(what, got_d, ref_d, v, 2e-6 * gs, 1e-5), "%s", g_why);
    snprintf(what, sizeof what, "%s: row %" PRId64 " loss", name, r);
    cr_assert(matches(what, &got_l, &ref_l, 1, 1e-5, 1e-5), "%s", g_why);
  }
}

/* The logits of `rows` rows: a block of block_rows random rows repeated
 * (copied on the device), so that the host holds only the block. */
static struct tensor xent_logits(int64_t rows, int64_t v, const float *block, int64_t block_rows, struct tensor *whole,
                                 int64_t guard) {
  int64_t total = rows * v + 2 * guard;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_alloc(whole, g_be, TENSOR_F32, 1, &total, &e), 0, "%s", e.msg);
  float sentinel;
  const uint32_t bits = SENTINEL_BITS;
  memcpy(&sentinel, &bits, 4);
  tensor_fill(whole, sentinel);
  int64_t sx[2] = {rows, v}, sblock[2] = {block_rows, v};
  struct tensor x = tensor_view(whole, guard, 2, sx);
  tensor_copy_from_host(&x, 0, block, (size_t)(block_rows * v) * 4);
  struct tensor first = tensor_view(whole, guard, 2, sblock);
  for (int64_t r0 = block_rows; r0 < rows; r0 += block_rows) {
    int64_t nr = rows - r0 < block_rows ? rows - r0 : block_rows, sn[2] = {nr, v};
    struct tensor src = tensor_view(&first, 0, 2, sn), dst = tensor_view(whole, guard + r0 * v, 2, sn);
    tensor_copy(&dst, &src);
  }
  return x;
}

/* The guard bands of `whole` (guard elements each side of n) still hold
 * the sentinel: read without copying the body. */
static bool big_guards_intact(const struct tensor *whole, int64_t n, int64_t guard, const char *what) {
  uint32_t *g = xmalloc((size_t)guard * 4);
  bool ok = true;
  for (int side = 0; side < 2 && ok; side++) {
    tensor_copy_to_host(whole, side ? guard + n : 0, g, (size_t)guard * 4);
    for (int64_t i = 0; i < guard && ok; i++)
      if (g[i] != SENTINEL_BITS)
        ok = fail_why("%s: guard element %" PRId64 " %s the tensor was written (0x%08x)", what, i,
                      side ? "after" : "before", g[i]);
  }
  free(g);
  return ok;
}

static void run_big_xent(int64_t rows, int64_t v, const char *name) {
  const int64_t block_rows = 512, guard = GUARD;
  float *block = hbuf(block_rows * v);
  fill_fast(block, block_rows * v, 4);
  for (int64_t i = 0; i < block_rows * v; i++) block[i] *= 8.0f; /* logits in [-8, 8) */
  int32_t *lab = hbuf_i32(rows);
  for (int64_t r = 0; r < rows; r++) lab[r] = (int32_t)rng_below(&g_rng, (uint64_t)v);
  lab[rows - 1] = (int32_t)(v - 1);
  struct tensor whole;
  struct tensor x = xent_logits(rows, v, block, block_rows, &whole, guard);
  struct dev dlab = dev_new_dt(TENSOR_I32, 1, &rows), dl = dev_vec(rows);
  dev_upload(&dlab, lab);
  const float gs = 1.0f / (float)rows;
  tensor_softmax_xent(&x, &dlab.t, &x, &dl.t, gs); /* in place, as the model runs it */
  cr_assert(big_guards_intact(&whole, rows * v, guard, name), "%s", g_why);
  cr_assert(guards_intact(&dl, name), "%s", g_why);
  cr_assert_eq(tensor_count_nonfinite(&x), 0, "%s: non-finite dlogits", name);
  check_xent_rows(&x, &dl.t, block, block_rows, lab, rows, v, gs, name);
  tensor_free(&whole);
}

Test(cuda_shapes, softmax_xent_at_gpt2_vocabulary_over_8192_rows) {
  open_gpu();
  run_big_xent(8192, 50257, "softmax_xent [8192, 50257]");
  close_gpu();
}

Test(cuda_shapes, softmax_xent_past_2_to_the_31_elements) {
  open_gpu();
  const int64_t v = 50257, rows = (((int64_t)1 << 31) / v) + 64;
  cr_assert_gt(rows * v, (int64_t)1 << 31);
  need_device_memory((size_t)(rows * v) * 4, "softmax_xent past 2^31 elements");
  run_big_xent(rows, v, "softmax_xent past 2^31 elements");
  close_gpu();
}

/* TF32 on: the same GEMM (k = 1024, inputs in [-1, 1)) moves by more than
 * FP32 rounding could (TF32 keeps 10 mantissa bits: errors ~1e-3·√k) and
 * stays within TF32's tolerance (atol 3e-3·√k); off again: FP32's bits. */
Test(cuda_shapes, tf32_switch_changes_gemm_rounding_and_switches_back) {
  open_gpu();
  const int64_t m = 512, n = 512, k = 1024, s[2] = {m, k}, sbt[2] = {n, k}, sc[2] = {m, n};
  float *ha = hbuf(m * k), *hb = hbuf(n * k), *fp32 = hbuf(m * n), *tf32 = hbuf(m * n), *again = hbuf(m * n);
  fill_fast(ha, m * k, 5);
  fill_fast(hb, n * k, 6);
  struct dev a = dev_from(2, s, ha), b = dev_from(2, sbt, hb), c = dev_new(2, sc);
  tensor_gemm(false, true, 1.0f, &a.t, &b.t, 0.0f, &c.t);
  dev_download(&c, fp32);
  tensor_backend_set_tf32(g_be, true);
  tensor_gemm(false, true, 1.0f, &a.t, &b.t, 0.0f, &c.t);
  dev_download(&c, tf32);
  tensor_backend_set_tf32(g_be, false);
  tensor_gemm(false, true, 1.0f, &a.t, &b.t, 0.0f, &c.t);
  dev_download(&c, again);
  cr_assert(same_bits("FP32 GEMM before and after a TF32 one", fp32, again, m * n), "%s", g_why);
  double most = 0.0;
  for (int64_t i = 0; i < m * n; i++) most = fmax(most, fabs((double)tf32[i] - fp32[i]));
  cr_assert_gt(most, 1e-4, "TF32 on changed no result by more than %.3g: is the switch applied?", most);
  cr_assert(matches("TF32 GEMM against FP32", tf32, fp32, m * n, 3e-3 * sqrt((double)k), 0.0), "%s", g_why);
  close_gpu();
}
