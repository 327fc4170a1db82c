/*
 * The CPU backend's transformer ops (contracts in tensor.h): embedding,
 * LayerNorm, causal attention, GELU (tanh form) and add. Entries are called
 * from tensor.c through the ops table in tensor_cpu.c, on the backend's
 * caller thread; each forks at most `threads` OpenMP workers and joins them
 * before returning.
 *
 * Determinism: every op gives the same bits on every run. embedding_bwd
 * and layernorm_bwd (tested) and the row- or element-local ops also give
 * the same bits for every thread count: their sums have a fixed order that
 * does not depend on how the work is split. Attention does too as long as
 * there are at least as many (sequence, head) pairs as threads (each pair
 * runs whole on one worker with a single-threaded GEMM); with fewer, its
 * GEMMs are threaded and oneDNN's split may change the last bits.
 *
 * This file is built with -ffp-contract=fast and -fno-trapping-math
 * (tensor/CMakeLists.txt): the AVX2 and AVX-512 clones fuse multiply-adds,
 * so their last bits differ from the baseline clone's.
 */
#include <limits.h>
#include <math.h>
#include <string.h>

#include "tensor/tensor_cpu.h"

/* ---- vectorisable exp ----
 * e^x in float without calls or branches, so that loops around it
 * vectorise (glibc's vector expf needs -ffast-math, which we do not use):
 * Cody-Waite reduction x = n·ln2 + r with |r| <= ln2/2, Cephes' degree-6
 * polynomial for e^r, and 2^n built in the exponent bits. Relative error
 * below 1e-7 (1.5 ulp; 8.5e-8 measured on every 7th float of [-87, 88], with
 * and without FMA) for x in [-87, 88]; 0 for x < -87 (the true
 * value is below 1.7e-38); inputs above 88 are treated as 88 (e^88 ≈
 * 1.65e38, finite). NaN in gives garbage out (no UB). */
#define NN_EXP_LO -87.0f
#define NN_EXP_HI 88.0f

static inline float nn_expf(float x) {
  float xc = x > NN_EXP_HI ? NN_EXP_HI : x;
  xc = xc < NN_EXP_LO ? NN_EXP_LO : xc;
  /* 1.5·2^23 added: the float's low mantissa bits hold round(x·log2 e). */
  union {
    float f;
    int32_t i;
  } t = {.f = xc * 1.44269504088896341f + 12582912.0f}, scale;
  float n = t.f - 12582912.0f;
  float r = xc - n * 0.693359375f; /* ln 2, split: hi part exact in float */
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  float y = p * (r * r) + r + 1.0f;
  scale.i = (int32_t)((uint32_t)(t.i - 0x4B400000 + 127) << 23); /* 2^n, n in [-126, 127] */
  float res = y * scale.f; /* computed unconditionally, so the select below needs no branch */
  return x < NN_EXP_LO ? 0.0f : res;
}

/* ---- add ---- */

/* out may alias x or y exactly (no restrict; GCC versions the loop). */
CPU_KERNEL_WIDE static void k_add(const float *x, const float *y, float *out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = x[i] + y[i];
}

void cpu_add(tensor_backend_t be, const float *x, const float *y, float *out, int64_t n) {
  CPU_FOR(be, n, lo, hi, k_add(x + lo, y + lo, out + lo, hi - lo));
}

/* ---- GELU, tanh form ----
 * 0.5·(1 + tanh(u)) = sigmoid(2u), so y = x / (1 + e^(−2u)) with
 * u = √(2/π)·(x + 0.044715·x³): no cancellation near u = 0, and the limits
 * come out right (e^(−2u) is capped at e^88, so y → −0 for x → −∞ and
 * y = x for large x). Error: that of nn_expf plus a few roundings, a few
 * 1e-7 relative (1e-37 absolute where the cap applies, x < −10.3).
 * Derivative: with s = sigmoid(2u) and 1 − s = e·s,
 * d/dx = s + 2·x·s·(1 − s)·u' = s·(1 + 2·x·e·s·u'). */
#define GELU_K 0.79788456080286535588f /* √(2/π) */
#define GELU_A 0.044715f

CPU_KERNEL_WIDE static void k_gelu_tanh_fwd(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    float u = GELU_K * (v + GELU_A * v * v * v);
    y[i] = v / (1.0f + nn_expf(-2.0f * u));
  }
}

CPU_KERNEL_WIDE static void k_gelu_tanh_bwd(const float *x, const float *dy, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    float u = GELU_K * (v + GELU_A * v * v * v);
    float du = GELU_K * (1.0f + 3.0f * GELU_A * v * v);
    float e = nn_expf(-2.0f * u), s = 1.0f / (1.0f + e);
    float es = e * s; /* 1 − s, <= 1: formed first, as e alone may be 1.65e38 */
    dx[i] = dy[i] * (s * (1.0f + 2.0f * v * es * du));
  }
}

/* Several times the cost of an add per element: worth forking for a
 * quarter of CPU_PAR_MIN elements (the ×4 below). */
void cpu_gelu_tanh_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  CPU_FOR(be, n * 4, lo, hi, k_gelu_tanh_fwd(x + lo / 4, y + lo / 4, hi / 4 - lo / 4));
}

void cpu_gelu_tanh_bwd(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n) {
  CPU_FOR(be, n * 4, lo, hi, k_gelu_tanh_bwd(x + lo / 4, dy + lo / 4, dx + lo / 4, hi / 4 - lo / 4));
}

/* ---- embedding ---- */

/* Rows [i0, i1) of the shard [lo, lo + v) of the vocabulary (tensor_impl.h);
 * wpe may be NULL. A row of a token in the shard with wpe is the plain op's
 * e[j] + p[j]. */
CPU_KERNEL_WIDE static void k_embed_fwd(const int32_t *restrict tokens, const float *restrict wte,
                                        const float *restrict wpe, float *restrict out, int64_t i0, int64_t i1,
                                        int64_t t, int64_t c, int64_t lo, int64_t v) {
  for (int64_t i = i0; i < i1; i++) {
    int64_t tok = (int64_t)tokens[i] - lo;
    const float *e = tok >= 0 && tok < v ? wte + tok * c : NULL, *p = wpe ? wpe + (i % t) * c : NULL;
    float *o = out + i * c;
    if (e && p)
      for (int64_t j = 0; j < c; j++) o[j] = e[j] + p[j];
    else if (e || p)
      memcpy(o, e ? e : p, (size_t)c * sizeof *o);
    else
      memset(o, 0, (size_t)c * sizeof *o);
  }
}

void cpu_embedding_fwd(tensor_backend_t be, const int32_t *tokens, const float *wte, const float *wpe, float *out,
                       int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v) {
  CPU_FOR_ROWS(be, r * t, c, i0, i1, k_embed_fwd(tokens, wte, wpe, out, i0, i1, t, c, lo, v));
}

/* Columns [c0, c1) of every position, walked in token order: each element
 * of dwte and dwpe receives its terms in the order of the positions, the
 * reference's order, whatever the thread count. Tokens outside the shard
 * [lo, lo + v) add nothing to dwte; dwpe may be NULL. dwte and dwpe must
 * not overlap each other or dout. */
CPU_KERNEL_WIDE static void k_embed_bwd_cols(const int32_t *restrict tokens, const float *restrict dout,
                                             float *restrict dwte, float *restrict dwpe, int64_t rows, int64_t t,
                                             int64_t c, int64_t c0, int64_t c1, int64_t lo, int64_t v) {
  for (int64_t i = 0; i < rows; i++) {
    int64_t tok = (int64_t)tokens[i] - lo;
    const float *g = dout + i * c;
    if (tok >= 0 && tok < v) {
      float *e = dwte + tok * c;
      for (int64_t j = c0; j < c1; j++) e[j] += g[j];
    }
    if (dwpe) {
      float *p = dwpe + (i % t) * c;
      for (int64_t j = c0; j < c1; j++) p[j] += g[j];
    }
  }
}

/* Deterministic by construction: the columns are split among the workers
 * (multiples of 16 floats, so no two workers share a cache line), never the
 * positions, so no element has two writers and no partial sums exist. */
void cpu_embedding_bwd(tensor_backend_t be, const int32_t *tokens, const float *dout, float *dwte, float *dwpe,
                       int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v) {
  int64_t rows = r * t;
  int th = nthreads(be);
  if (th <= 1 || c < 32 || rows * c < CPU_PAR_MIN) {
    k_embed_bwd_cols(tokens, dout, dwte, dwpe, rows, t, c, 0, c, lo, v);
    return;
  }
#pragma omp parallel num_threads(th)
  {
    int nt = omp_get_num_threads();
    int64_t chunk = ((c + nt - 1) / nt + 15) & ~(int64_t)15;
    int64_t c0 = (int64_t)omp_get_thread_num() * chunk, c1 = c0 + chunk < c ? c0 + chunk : c;
    if (c0 < c1) k_embed_bwd_cols(tokens, dout, dwte, dwpe, rows, t, c, c0, c1, lo, v);
  }
}

/* ---- LayerNorm ----
 * Each row is read from memory once: the mean, the variance about it and
 * the output are three passes over a row that stays in L1. The two sums
 * accumulate in double (vector lanes of doubles): the op is bound by memory
 * traffic, so this costs nothing measurable, and the mean stays exact to
 * float rounding even when the row has a large common offset. */
CPU_KERNEL_WIDE static void k_ln_fwd(const float *restrict x, const float *restrict w, const float *restrict b,
                                     float *restrict y, float *restrict mean, float *restrict rstd, int64_t r0,
                                     int64_t r1, int64_t c) {
  for (int64_t i = r0; i < r1; i++) {
    const float *xi = x + i * c;
    float *yi = y + i * c;
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int64_t j = 0; j < c; j++) s += xi[j];
    const float mu = (float)(s / (double)c);
    double var = 0.0;
#pragma omp simd reduction(+ : var)
    for (int64_t j = 0; j < c; j++) {
      float d = xi[j] - mu;
      var += d * d;
    }
    const float rs = (float)(1.0 / sqrt(var / (double)c + TENSOR_LAYERNORM_EPS));
    for (int64_t j = 0; j < c; j++) yi[j] = (xi[j] - mu) * rs * w[j] + b[j];
    mean[i] = mu;
    rstd[i] = rs;
  }
}

void cpu_layernorm_fwd(tensor_backend_t be, const float *x, const float *w, const float *b, float *y, float *mean,
                       float *rstd, int64_t rows, int64_t c) {
  CPU_FOR_ROWS(be, rows, c, lo, hi, k_ln_fwd(x, w, b, y, mean, rstd, lo, hi, c));
}

/* Rows per partial sum of dw and db. Fixed, so the chunks (and hence the
 * sums) are the same on any number of threads. */
#define LN_CHUNK 32

/* Rows [r0, r1): dx += rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w, and
 * the chunk's partial sums pw ← Σ dy·x̂, pb ← Σ dy (overwritten). */
CPU_KERNEL_WIDE static void k_ln_bwd_rows(const float *restrict x, const float *restrict w,
                                          const float *restrict mean, const float *restrict rstd,
                                          const float *restrict dy, float *restrict dx, float *restrict pw,
                                          float *restrict pb, int64_t r0, int64_t r1, int64_t c) {
  const float inv_c = 1.0f / (float)c;
  for (int64_t j = 0; j < c; j++) pw[j] = pb[j] = 0.0f;
  for (int64_t i = r0; i < r1; i++) {
    const float *xi = x + i * c, *dyi = dy + i * c;
    float *dxi = dx + i * c;
    const float mu = mean[i], rs = rstd[i];
    float sg = 0.0f, sgx = 0.0f;
#pragma omp simd reduction(+ : sg, sgx)
    for (int64_t j = 0; j < c; j++) {
      float xh = (xi[j] - mu) * rs, g = dyi[j] * w[j];
      sg += g;
      sgx += g * xh;
      pw[j] += dyi[j] * xh;
      pb[j] += dyi[j];
    }
    sg *= inv_c;
    sgx *= inv_c;
    for (int64_t j = 0; j < c; j++) {
      float xh = (xi[j] - mu) * rs;
      dxi[j] += rs * (dyi[j] * w[j] - sg - xh * sgx);
    }
  }
}

/* dw ← beta·dw + Σ partials, db likewise, partials added in chunk order in
 * double (acc: 2c doubles of scratch). beta = 0 ignores the old contents. */
CPU_KERNEL_WIDE static void k_ln_combine(const float *restrict parts, int64_t nchunks, int64_t c,
                                         double *restrict acc, float *restrict dw, float *restrict db, float beta) {
  for (int64_t j = 0; j < 2 * c; j++) acc[j] = 0.0;
  for (int64_t k = 0; k < nchunks; k++) {
    const float *p = parts + k * 2 * c;
    for (int64_t j = 0; j < 2 * c; j++) acc[j] += p[j];
  }
  for (int64_t j = 0; j < c; j++) {
    dw[j] = (float)(acc[j] + (beta == 0.0f ? 0.0 : (double)beta * dw[j]));
    db[j] = (float)(acc[c + j] + (beta == 0.0f ? 0.0 : (double)beta * db[j]));
  }
}

void cpu_layernorm_bwd(tensor_backend_t be, const float *x, const float *w, const float *mean, const float *rstd,
                       const float *dy, float *dx, float *dw, float *db, int64_t rows, int64_t c, float beta) {
  int64_t nchunks = (rows + LN_CHUNK - 1) / LN_CHUNK;
  int64_t part_floats = (nchunks * 2 * c + 15) & ~(int64_t)15;
  float *parts = cpu_scratch(be, (size_t)(part_floats + 4 * c)); /* partials, then 2c doubles */
  double *acc = (double *)(parts + part_floats);
  int th = nthreads(be);
#pragma omp parallel for num_threads(th) schedule(static) if (th > 1 && nchunks > 1 && rows * c >= CPU_PAR_MIN)
  for (int64_t k = 0; k < nchunks; k++) {
    int64_t r0 = k * LN_CHUNK, r1 = r0 + LN_CHUNK < rows ? r0 + LN_CHUNK : rows;
    float *pw = parts + k * 2 * c;
    k_ln_bwd_rows(x, w, mean, rstd, dy, dx, pw, pw + c, r0, r1, c);
  }
  k_ln_combine(parts, nchunks, c, acc, dw, db, beta);
}

/* ---- causal attention ----
 * Per (sequence, head) pair, queries in blocks of `blk` rows. A block
 * [i0, i0 + nb) attends keys [0, n) with n = i0 + nb only (the later keys
 * are masked for every row of it, so causality halves the GEMM work); in
 * its last nb keys the entries past each row's diagonal are zeroed after
 * the GEMM. The scores of one block (nb × n, row stride lds) live in
 * per-worker scratch: O(blk·T) floats, never T×T.
 *
 * Forward:  S = scale·Q·Kᵀ; P = exp(S − rowmax), lse = rowmax + log Σ;
 *           O = (P·V) / Σ.
 * Backward: P = exp(S − lse) recomputed; dP = dO·Vᵀ; dV += Pᵀ·dO;
 *           D = rowsum(dO ⊙ O); dS = P ⊙ (dP − D)·scale; dQ = dS·K;
 *           dK += dSᵀ·Q.
 * q, k and v of one head are columns of qkv with row stride 3C: the GEMMs
 * read them in place through their leading dimensions.
 *
 * Threads: the pairs are split among the workers (dynamic, one at a time)
 * with a single-threaded GEMM each when there are at least as many pairs as
 * threads; otherwise the pairs run in turn with a threaded GEMM; problems
 * too small to share run on the caller's thread alone. Each pair is
 * computed whole by one worker, so the result does not depend on which
 * worker took it.
 *
 * Block size, measured on one AVX-512 core (bench_tensor_nn): 64 rows are
 * fastest at T = 256 (larger blocks waste more of the masked diagonal
 * block: the waste is blk/T of the work); at T = 1024, 128 rows are about
 * 2 % faster than 64 or 256 (fewer passes over dK and dV in the backward),
 * with scores and dP of 0.5 MiB each. */
#define ATT_BLOCK 64
#define ATT_BLOCK_LONG 128 /* from T >= 512 on */

struct att {
  const float *qkv, *out_in, *lse_in, *dout;
  float *out, *lse, *dqkv;
  int64_t t, c, hs, lds; /* lds: the score rows' stride (T rounded up to 16) */
  int64_t blk;           /* query rows per block */
  int nh;
  float scale;
};

/* Per-worker scratch: scores and dP (blk × lds each) and two vectors. */
static size_t att_worker_floats(const struct att *a) {
  size_t n = 2 * (size_t)a->blk * (size_t)a->lds + 2 * (size_t)a->blk;
  return (n + 15) & ~(size_t)15;
}

/* The maximum of row[0, len), len >= 1, not NaN. Computed on integer keys
 * that order like the floats (the sign bit set: the other bits flipped), as
 * an integer max reduction vectorises with GCC and clang alike, where a
 * float one needs fast-math (NaN semantics of the select). */
static inline int32_t float_key(float f) {
  union {
    float f;
    int32_t i;
  } u = {.f = f};
  return u.i ^ (int32_t)((uint32_t)(u.i >> 31) >> 1); /* negative: flip all but the sign */
}

static inline float row_max(const float *row, int64_t len) {
  int32_t m = float_key(row[0]);
#pragma omp simd reduction(max : m)
  for (int64_t j = 0; j < len; j++) {
    int32_t k = float_key(row[j]);
    m = k > m ? k : m;
  }
  union {
    int32_t i;
    float f;
  } u = {.i = m ^ (int32_t)((uint32_t)(m >> 31) >> 1)}; /* the mapping is its own inverse */
  return u.f;
}

/* Softmax of rows [0, nb) of s, row r over keys [0, i0 + r]: s ← e^(s − max)
 * there and 0 in [i0 + r + 1, n); lse[r] and inv[r] = 1/Σ. */
CPU_KERNEL_WIDE static void att_softmax_rows(float *s, int64_t lds, int64_t nb, int64_t i0, int64_t n, float *lse,
                                             float *inv) {
  for (int64_t r = 0; r < nb; r++) {
    float *row = s + r * lds;
    int64_t len = i0 + r + 1;
    const float m = row_max(row, len);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < len; j++) {
      float e = nn_expf(row[j] - m);
      row[j] = e;
      sum += e; /* >= 1: the maximum contributes e^0 = 1 */
    }
    for (int64_t j = len; j < n; j++) row[j] = 0.0f;
    lse[r] = m + logf(sum);
    inv[r] = 1.0f / sum;
  }
}

/* Rows [0, nb) of o (stride ldo, hs columns) scaled by inv[r]. */
CPU_KERNEL_WIDE static void att_scale_rows(float *o, int64_t ldo, int64_t nb, int64_t hs, const float *inv) {
  for (int64_t r = 0; r < nb; r++)
    for (int64_t d = 0; d < hs; d++) o[r * ldo + d] *= inv[r];
}

static void att_fwd_pair(const struct att *a, int64_t pair, float *scratch, int threads) {
  const int64_t s = pair / a->nh, h = pair % a->nh, t = a->t, c = a->c, hs = a->hs;
  const int ld3 = (int)(3 * c), ldc = (int)c, lds = (int)a->lds;
  const float *q = a->qkv + s * t * 3 * c + h * hs, *k = q + c, *v = q + 2 * c;
  float *o = a->out + s * t * c + h * hs, *lse = a->lse + pair * t;
  float *sc = scratch, *inv = scratch + 2 * (size_t)a->blk * a->lds;
  for (int64_t i0 = 0; i0 < t; i0 += a->blk) {
    int nb = (int)(t - i0 < a->blk ? t - i0 : a->blk), n = (int)i0 + nb;
    cpu_sgemm(threads, false, true, nb, n, (int)hs, a->scale, q + i0 * ld3, ld3, k, ld3, 0.0f, sc, lds);
    att_softmax_rows(sc, lds, nb, i0, n, lse + i0, inv);
    cpu_sgemm(threads, false, false, nb, (int)hs, n, 1.0f, sc, lds, v, ld3, 0.0f, o + i0 * ldc, ldc);
    att_scale_rows(o + i0 * ldc, ldc, nb, hs, inv);
  }
}

/* Backward row work of one block, before the dQ/dK GEMMs: p holds S on
 * entry; on return p = P ⊙ (dP − D)·scale (0 past the diagonal), having
 * been P = e^(S − lse) in between, which `dv_update` consumed. Split in two
 * so the dV GEMM runs between them. */
CPU_KERNEL_WIDE static void att_probs_rows(float *p, int64_t lds, int64_t nb, int64_t i0, int64_t n,
                                           const float *lse) {
  for (int64_t r = 0; r < nb; r++) {
    float *row = p + r * lds;
    const float l = lse[r];
    int64_t len = i0 + r + 1;
    for (int64_t j = 0; j < len; j++) row[j] = nn_expf(row[j] - l);
    for (int64_t j = len; j < n; j++) row[j] = 0.0f;
  }
}

/* D[r] = dO_r·O_r over hs columns, then p ← p ⊙ (dp − D[r])·scale on the
 * row's keys [0, i0 + r] (p is already 0 past them). */
CPU_KERNEL_WIDE static void att_dscores_rows(float *p, const float *dp, int64_t lds, int64_t nb, int64_t i0,
                                             const float *dout, const float *out, int64_t ldc, int64_t hs,
                                             float scale) {
  for (int64_t r = 0; r < nb; r++) {
    const float *gr = dout + r * ldc, *orow = out + r * ldc;
    float dsum = 0.0f;
#pragma omp simd reduction(+ : dsum)
    for (int64_t d = 0; d < hs; d++) dsum += gr[d] * orow[d];
    float *row = p + r * lds;
    const float *dprow = dp + r * lds;
    int64_t len = i0 + r + 1;
    for (int64_t j = 0; j < len; j++) row[j] = row[j] * (dprow[j] - dsum) * scale;
  }
}

static void att_bwd_pair(const struct att *a, int64_t pair, float *scratch, int threads) {
  const int64_t s = pair / a->nh, h = pair % a->nh, t = a->t, c = a->c, hs = a->hs;
  const int ld3 = (int)(3 * c), ldc = (int)c, lds = (int)a->lds, ihs = (int)hs;
  const int64_t off3 = s * t * 3 * c + h * hs, offc = s * t * c + h * hs;
  const float *q = a->qkv + off3, *k = q + c, *v = q + 2 * c;
  const float *o = a->out_in + offc, *g = a->dout + offc, *lse = a->lse_in + pair * t;
  float *dq = a->dqkv + off3, *dk = dq + c, *dv = dq + 2 * c;
  float *sc = scratch, *dp = scratch + (size_t)a->blk * a->lds;
  for (int64_t i = 0; i < t; i++) { /* dK and dV accumulate over the blocks */
    memset(dk + i * ld3, 0, (size_t)hs * sizeof(float));
    memset(dv + i * ld3, 0, (size_t)hs * sizeof(float));
  }
  for (int64_t i0 = 0; i0 < t; i0 += a->blk) {
    int nb = (int)(t - i0 < a->blk ? t - i0 : a->blk), n = (int)i0 + nb;
    const float *qb = q + i0 * ld3, *gb = g + i0 * ldc;
    cpu_sgemm(threads, false, true, nb, n, ihs, a->scale, qb, ld3, k, ld3, 0.0f, sc, lds);
    att_probs_rows(sc, lds, nb, i0, n, lse + i0);
    cpu_sgemm(threads, false, true, nb, n, ihs, 1.0f, gb, ldc, v, ld3, 0.0f, dp, lds);
    cpu_sgemm(threads, true, false, n, ihs, nb, 1.0f, sc, lds, gb, ldc, 1.0f, dv, ld3);
    att_dscores_rows(sc, dp, lds, nb, i0, gb, o + i0 * ldc, ldc, hs, a->scale);
    cpu_sgemm(threads, false, false, nb, ihs, n, 1.0f, sc, lds, k, ld3, 0.0f, dq + i0 * ld3, ld3);
    cpu_sgemm(threads, true, false, n, ihs, nb, 1.0f, sc, lds, qb, ld3, 1.0f, dk, ld3);
  }
}

static struct att att_setup(int64_t r, int64_t t, int64_t c, int nh) {
  RUMOR_ASSERT(t <= INT_MAX / 2 && 3 * c <= INT_MAX && c % nh == 0);
  struct att a = {.t = t, .c = c, .hs = c / nh, .lds = (t + 15) & ~(int64_t)15, .nh = nh};
  a.blk = t >= 512 ? ATT_BLOCK_LONG : ATT_BLOCK;
  a.scale = (float)(1.0 / sqrt((double)a.hs));
  return a;
}

/* Runs fn on every pair as the block comment above describes. */
static void att_run(tensor_backend_t be, const struct att *a, int64_t pairs,
                    void (*fn)(const struct att *, int64_t, float *, int)) {
  size_t per = att_worker_floats(a);
  int th = nthreads(be);
  if ((double)pairs * (double)a->t * (double)a->t * (double)a->hs < CPU_PAR_MIN) th = 1; /* too small to share */
  if (th <= 1 || pairs < th) {
    float *scratch = cpu_scratch(be, per);
    for (int64_t p = 0; p < pairs; p++) fn(a, p, scratch, th);
    return;
  }
  float *base = cpu_scratch(be, per * (size_t)th);
#pragma omp parallel num_threads(th)
  {
    float *scratch = base + per * (size_t)omp_get_thread_num();
#pragma omp for schedule(dynamic, 1)
    for (int64_t p = 0; p < pairs; p++) fn(a, p, scratch, 1);
  }
}

void cpu_attention_fwd(tensor_backend_t be, const float *qkv, float *out, float *lse, int64_t r, int64_t t, int64_t c,
                       int nh) {
  struct att a = att_setup(r, t, c, nh);
  a.qkv = qkv;
  a.out = out;
  a.lse = lse;
  att_run(be, &a, r * nh, att_fwd_pair);
}

void cpu_attention_bwd(tensor_backend_t be, const float *qkv, const float *out, const float *lse, const float *dout,
                       float *dqkv, int64_t r, int64_t t, int64_t c, int nh) {
  struct att a = att_setup(r, t, c, nh);
  a.qkv = qkv;
  a.out_in = out;
  a.lse_in = lse;
  a.dout = dout;
  a.dqkv = dqkv;
  att_run(be, &a, r * nh, att_bwd_pair);
}

/* ---- mixture of experts ----
 * Routing has a row-local part (softmax, log-sum-exp, top-K, gates: rows
 * split among the workers) and a sequential part (slots in the contract's
 * order, counts, and psum summed in double in token order), so its results
 * do not depend on the thread count. The data ops split the tokens among
 * the workers: each token's rows are its own (route gives every kept
 * choice a distinct row), and each output element is formed by one worker
 * in the contract's k order. */

/* An integer that orders like the float (larger float: larger key), with
 * −0 taken as +0 so that the two tie; NaN sorts above +Inf (positive) or
 * below −Inf (negative). The same mapping as the CUDA kernels', so both
 * backends rank equal logits, and NaNs, alike. */
static inline uint32_t moe_order_key(float f) {
  union {
    float f;
    uint32_t u;
  } v = {.f = f == 0.0f ? 0.0f : f};
  return (v.u & 0x80000000u) ? ~v.u : v.u | 0x80000000u;
}

/* A total order on the experts of a row: the larger logit first, then the
 * lower index (at most INT32_MAX experts, so the low word never wraps). */
static inline uint64_t moe_rank(const float *l, int64_t j) {
  return ((uint64_t)moe_order_key(l[j]) << 32) | (uint32_t)(INT32_MAX - j);
}

/* Rows [r0, r1): softmax (nn_expf, summed in float), lse, the K best
 * experts by K passes (each takes the best rank below the previous pick),
 * and the gates. */
CPU_KERNEL_WIDE static void k_moe_route_rows(const float *restrict logits, float *restrict probs, float *restrict lse,
                                             int32_t *restrict expert, float *restrict gate, int64_t r0, int64_t r1,
                                             int64_t e, int k) {
  for (int64_t i = r0; i < r1; i++) {
    const float *l = logits + i * e;
    float *p = probs + i * e;
    const float m = row_max(l, e);
    float sum = 0.0f;
#pragma omp simd reduction(+ : sum)
    for (int64_t j = 0; j < e; j++) {
      float x = nn_expf(l[j] - m);
      p[j] = x;
      sum += x; /* >= 1: the maximum contributes e^0 */
    }
    for (int64_t j = 0; j < e; j++) p[j] = p[j] / sum;
    lse[i] = m + logf(sum);
    uint64_t prev = UINT64_MAX;
    float psel = 0.0f;
    for (int c = 0; c < k; c++) {
      int64_t best = 0;
      uint64_t rb = 0;
      for (int64_t j = 0; j < e; j++) {
        uint64_t rj = moe_rank(l, j);
        if (rj < prev && rj > rb) { /* every rank is > 0 (its low word is) */
          rb = rj;
          best = j;
        }
      }
      prev = rb;
      expert[i * k + c] = (int32_t)best;
      psel += p[best];
    }
    for (int c = 0; c < k; c++) gate[i * k + c] = k == 1 ? p[expert[i * k + c]] : p[expert[i * k + c]] / psel;
  }
}

void cpu_moe_route(tensor_backend_t be, const float *logits, float *probs, float *lse, int32_t *expert, float *gate,
                   int32_t *slot, int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e, int k,
                   int64_t cap) {
  CPU_FOR_ROWS(be, n, e * k, lo, hi, k_moe_route_rows(logits, probs, lse, expert, gate, lo, hi, e, k));
  for (int64_t j = 0; j < e; j++) assigned[j] = 0;
  for (int c = 0; c < k; c++) /* first choices of every token, then second choices, ... */
    for (int64_t i = 0; i < n; i++) {
      int32_t x = expert[i * k + c];
      slot[i * k + c] = assigned[x] < cap ? assigned[x] : -1;
      assigned[x]++;
    }
  for (int64_t j = 0; j < e; j++) kept[j] = assigned[j] < cap ? assigned[j] : (int32_t)cap;
  double *acc = (double *)cpu_scratch(be, (size_t)(2 * e));
  for (int64_t j = 0; j < e; j++) acc[j] = 0.0;
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < e; j++) acc[j] += probs[i * e + j];
  for (int64_t j = 0; j < e; j++) psum[j] = (float)acc[j];
}

/* Rows [r0, r1) of the routing backward (tensor.h). With gp_k the gates'
 * part at e_k (dgate_k for K = 1, (dgate_k − Σ_j dgate_j·gate_j) / Σ_j
 * p[e_j] for K > 1), dprob = daux + Σ_k gp_k·[e = e_k], so
 * pd = Σ_e p·dprob = Σ_e p·daux + Σ_k p[e_k]·gp_k (in double) and
 * dlogits = p·(daux − pd) + zscale·lse·p, plus p[e_k]·gp_k at each e_k. */
CPU_KERNEL_WIDE static void k_moe_route_bwd_rows(const float *restrict probs, const float *restrict lse,
                                                 const int32_t *restrict expert, const float *restrict gate,
                                                 const float *restrict dgate, const float *restrict daux, float zscale,
                                                 float *restrict dlogits, int64_t r0, int64_t r1, int64_t e, int k) {
  for (int64_t i = r0; i < r1; i++) {
    const float *p = probs + i * e;
    const int32_t *ex = expert + i * k;
    const float *g = gate + i * k, *dg = dgate + i * k;
    float *dl = dlogits + i * e;
    double dot = 0.0, psel = 0.0, pd = 0.0;
    for (int c = 0; c < k; c++)
      if (ex[c] >= 0 && ex[c] < e) {
        dot += (double)dg[c] * g[c];
        psel += p[ex[c]];
      }
    const double inv = k == 1 ? 1.0 : 1.0 / psel, shift = k == 1 ? 0.0 : dot; /* gp_k = (dg_k − shift)·inv */
#pragma omp simd reduction(+ : pd)
    for (int64_t j = 0; j < e; j++) pd += (double)p[j] * daux[j];
    for (int c = 0; c < k; c++)
      if (ex[c] >= 0 && ex[c] < e) pd += (double)p[ex[c]] * ((dg[c] - shift) * inv);
    const float pdf = (float)pd, zl = zscale * lse[i];
    for (int64_t j = 0; j < e; j++) dl[j] = p[j] * (daux[j] - pdf) + zl * p[j];
    for (int c = 0; c < k; c++)
      if (ex[c] >= 0 && ex[c] < e) dl[ex[c]] += (float)((double)p[ex[c]] * ((dg[c] - shift) * inv));
  }
}

void cpu_moe_route_bwd(tensor_backend_t be, const float *probs, const float *lse, const int32_t *expert,
                       const float *gate, const float *dgate, const float *daux, float zscale, float *dlogits,
                       int64_t n, int64_t e, int k) {
  CPU_FOR_ROWS(be, n, e * k, lo, hi,
               k_moe_route_bwd_rows(probs, lse, expert, gate, dgate, daux, zscale, dlogits, lo, hi, e, k));
}

/* The row of choice c of token i in the expert buffers, or −1 when the
 * choice is dropped (or its indices are outside the buffers). */
static inline int64_t moe_row(const int32_t *expert, const int32_t *slot, int64_t i, int k, int c, int64_t e,
                              int64_t cap) {
  int64_t x = expert[i * k + c], s = slot[i * k + c];
  return x >= 0 && x < e && s >= 0 && s < cap ? x * cap + s : -1;
}

/* Zeroes buf[0, n) on the workers. */
static void moe_zero(tensor_backend_t be, float *buf, int64_t n) {
  CPU_FOR(be, n, lo, hi, memset(buf + lo, 0, (size_t)(hi - lo) * sizeof *buf));
}

CPU_KERNEL_WIDE static void k_moe_dispatch_rows(const float *restrict x, const int32_t *restrict expert,
                                                const int32_t *restrict slot, float *restrict xe, int64_t r0,
                                                int64_t r1, int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = r0; i < r1; i++)
    for (int c = 0; c < k; c++) {
      int64_t r = moe_row(expert, slot, i, k, c, e, cap);
      if (r >= 0) memcpy(xe + r * ch, x + i * ch, (size_t)ch * sizeof *xe);
    }
}

void cpu_moe_dispatch(tensor_backend_t be, const float *x, const int32_t *expert, const int32_t *slot, float *xe,
                      int64_t n, int64_t ch, int k, int64_t e, int64_t cap) {
  moe_zero(be, xe, e * cap * ch);
  CPU_FOR_ROWS(be, n, ch * k, lo, hi, k_moe_dispatch_rows(x, expert, slot, xe, lo, hi, ch, k, e, cap));
}

CPU_KERNEL_WIDE static void k_moe_dispatch_bwd_rows(const float *restrict dxe, const int32_t *restrict expert,
                                                    const int32_t *restrict slot, float *restrict dx, int64_t r0,
                                                    int64_t r1, int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = r0; i < r1; i++)
    for (int c = 0; c < k; c++) {
      int64_t r = moe_row(expert, slot, i, k, c, e, cap);
      if (r < 0) continue;
      const float *g = dxe + r * ch;
      float *d = dx + i * ch;
      for (int64_t j = 0; j < ch; j++) d[j] += g[j];
    }
}

void cpu_moe_dispatch_bwd(tensor_backend_t be, const float *dxe, const int32_t *expert, const int32_t *slot, float *dx,
                          int64_t n, int64_t ch, int k, int64_t e, int64_t cap) {
  CPU_FOR_ROWS(be, n, ch * k, lo, hi, k_moe_dispatch_bwd_rows(dxe, expert, slot, dx, lo, hi, ch, k, e, cap));
}

CPU_KERNEL_WIDE static void k_moe_combine_rows(const float *restrict ye, const int32_t *restrict expert,
                                               const int32_t *restrict slot, const float *restrict gate,
                                               float *restrict out, int64_t r0, int64_t r1, int64_t ch, int k,
                                               int64_t e, int64_t cap) {
  for (int64_t i = r0; i < r1; i++) {
    float *o = out + i * ch;
    memset(o, 0, (size_t)ch * sizeof *o);
    for (int c = 0; c < k; c++) {
      int64_t r = moe_row(expert, slot, i, k, c, e, cap);
      if (r < 0) continue;
      const float g = gate[i * k + c], *y = ye + r * ch;
      for (int64_t j = 0; j < ch; j++) o[j] += g * y[j];
    }
  }
}

void cpu_moe_combine(tensor_backend_t be, const float *ye, const int32_t *expert, const int32_t *slot,
                     const float *gate, float *out, int64_t n, int64_t ch, int k, int64_t e, int64_t cap) {
  CPU_FOR_ROWS(be, n, ch * k, lo, hi, k_moe_combine_rows(ye, expert, slot, gate, out, lo, hi, ch, k, e, cap));
}

/* dye rows of tokens [r0, r1) ← gate·dout; dgate ← dout·ye (double lanes),
 * 0 for a dropped choice. */
CPU_KERNEL_WIDE static void k_moe_combine_bwd_rows(const float *restrict dout, const float *restrict ye,
                                                   const int32_t *restrict expert, const int32_t *restrict slot,
                                                   const float *restrict gate, float *restrict dye,
                                                   float *restrict dgate, int64_t r0, int64_t r1, int64_t ch, int k,
                                                   int64_t e, int64_t cap) {
  for (int64_t i = r0; i < r1; i++)
    for (int c = 0; c < k; c++) {
      int64_t r = moe_row(expert, slot, i, k, c, e, cap);
      double dot = 0.0;
      if (r >= 0) {
        const float g = gate[i * k + c], *d = dout + i * ch, *y = ye + r * ch;
        float *dy = dye + r * ch;
#pragma omp simd reduction(+ : dot)
        for (int64_t j = 0; j < ch; j++) {
          dy[j] = g * d[j];
          dot += (double)d[j] * y[j];
        }
      }
      dgate[i * k + c] = (float)dot;
    }
}

void cpu_moe_combine_bwd(tensor_backend_t be, const float *dout, const float *ye, const int32_t *expert,
                         const int32_t *slot, const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k,
                         int64_t e, int64_t cap) {
  moe_zero(be, dye, e * cap * ch);
  CPU_FOR_ROWS(be, n, ch * k, lo, hi,
               k_moe_combine_bwd_rows(dout, ye, expert, slot, gate, dye, dgate, lo, hi, ch, k, e, cap));
}
