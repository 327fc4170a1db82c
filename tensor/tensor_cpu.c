/*
 * The CPU backend: oneDNN's sgemm for matrix products, plain C loops (which
 * GCC vectorises) for everything else, OpenMP across `threads` cores for
 * loops big enough to pay for it. Ops run synchronously in the caller's
 * thread, so events are complete as soon as they are recorded.
 */
#include <dnnl.h>
#include <math.h>
#include <omp.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "tensor/tensor_cpu.h"

static void cpu_close(tensor_backend_t be) {
  free(((struct cpu_backend *)be)->scratch);
  free(be);
}

static void cpu_set_threads(tensor_backend_t be, int threads) { ((struct cpu_backend *)be)->threads = threads; }

static void cpu_sync(tensor_backend_t be) {}

static void *cpu_alloc(tensor_backend_t be, size_t bytes) {
  size_t n = (bytes + CPU_ALIGN - 1) & ~(size_t)(CPU_ALIGN - 1);
  return aligned_alloc(CPU_ALIGN, n ? n : CPU_ALIGN);
}

static void cpu_free(tensor_backend_t be, void *p) { free(p); }

/* The whole pages inside [p, p + bytes): the pages at either end may hold
 * live bytes outside the range (or the allocator's own) and stay. */
static void cpu_discard(tensor_backend_t be, void *p, size_t bytes) {
  (void)be;
  uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
  uintptr_t a = ((uintptr_t)p + page - 1) & ~(page - 1), b = ((uintptr_t)p + bytes) & ~(page - 1);
  if (b > a) (void)madvise((void *)a, b - a, MADV_DONTNEED); /* a failure only keeps the memory */
}

static void cpu_copy(tensor_backend_t be, void *dst, const void *src, size_t bytes, bool async) {
  if (dst != src) memmove(dst, src, bytes);
}

static void cpu_copy_d2d(tensor_backend_t be, void *dst, const void *src, size_t bytes) {
  if (dst != src) memmove(dst, src, bytes);
}

static void cpu_copy_beside(tensor_backend_t be, void *dst, const void *src, size_t bytes, void *ev) {
  if (dst != src) memmove(dst, src, bytes);
}

/* Events: the CPU runs ops synchronously, so an event is a placeholder. */
static void *cpu_ev_create(tensor_backend_t be) { return xmalloc(1); }
static void cpu_ev_destroy(tensor_backend_t be, void *ev) { free(ev); }
static void cpu_ev_record(tensor_backend_t be, void *ev) {}
static bool cpu_ev_query(tensor_backend_t be, void *ev) { return true; }
static void cpu_ev_wait(tensor_backend_t be, void *ev) {}

void cpu_sgemm(int threads, bool ta, bool tb, int m, int n, int k, float alpha, const float *a, int lda,
               const float *b, int ldb, float beta, float *c, int ldc) {
  int prev = omp_get_max_threads();
  if (prev != threads) omp_set_num_threads(threads);
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (prev != threads) omp_set_num_threads(prev);
  if (st != dnnl_success)
    rumor_panic(__FILE__, __LINE__, "dnnl_sgemm(%c,%c,%d,%d,%d) failed with status %d", ta ? 'T' : 'N',
                tb ? 'T' : 'N', m, n, k, (int)st);
}

static void cpu_gemm(tensor_backend_t be, bool ta, bool tb, int m, int n, int k, float alpha, const float *a, int lda,
                     const float *b, int ldb, float beta, float *c, int ldc) {
  cpu_sgemm(nthreads(be), ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
}

float *cpu_scratch(tensor_backend_t be, size_t floats) {
  struct cpu_backend *b = (struct cpu_backend *)be;
  if (floats <= b->scratch_floats) return b->scratch;
  free(b->scratch);
  size_t bytes = (floats * sizeof(float) + CPU_ALIGN - 1) & ~(size_t)(CPU_ALIGN - 1);
  b->scratch = aligned_alloc(CPU_ALIGN, bytes);
  if (!b->scratch) rumor_panic(__FILE__, __LINE__, "aligned_alloc(%zu) for CPU scratch failed", bytes);
  b->scratch_floats = bytes / sizeof(float);
  return b->scratch;
}

/* ---- element-wise ops ----
 * Each op is a plain loop over a range (a "kernel", compiled for AVX2 and
 * for baseline x86-64 and picked at load time) and a dispatcher that splits
 * [0, n) into one contiguous chunk per thread when n is large enough
 * (CPU_KERNEL and CPU_FOR in tensor_cpu.h). */
CPU_KERNEL static void k_bias_add(float *restrict y, const float *restrict bias, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    float *restrict yr = y + r * cols;
    for (int64_t c = 0; c < cols; c++) yr[c] += bias[c];
  }
}

static void cpu_bias_add(tensor_backend_t be, float *y, const float *bias, int64_t rows, int64_t cols) {
  int t = nthreads(be);
  if (t <= 1 || rows * cols < CPU_PAR_MIN || rows < 2) {
    k_bias_add(y, bias, rows, cols);
    return;
  }
#pragma omp parallel num_threads(t)
  {
    int nt = omp_get_num_threads();
    int64_t chunk = (rows + nt - 1) / nt;
    int64_t r0 = (int64_t)omp_get_thread_num() * chunk, r1 = r0 + chunk < rows ? r0 + chunk : rows;
    if (r0 < r1) k_bias_add(y + r0 * cols, bias, r1 - r0, cols);
  }
}

/* Column sums of dy[rows, c0..c1) into acc. */
CPU_KERNEL static void k_colsum(const float *restrict dy, float *restrict acc, int64_t rows, int64_t cols,
                                int64_t c0, int64_t c1) {
  for (int64_t c = c0; c < c1; c++) acc[c - c0] = 0.0f;
  for (int64_t r = 0; r < rows; r++) {
    const float *restrict dr = dy + r * cols;
    for (int64_t c = c0; c < c1; c++) acc[c - c0] += dr[c];
  }
}

static void cpu_bias_grad(tensor_backend_t be, const float *dy, float *db, int64_t rows, int64_t cols,
                          float beta) {
  /* Blocks of 256 columns walked row by row (unit stride); blocks in parallel. */
  int t = nthreads(be);
  const int64_t block = 256;
  int64_t nblocks = (cols + block - 1) / block;
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN && nblocks > 1)
  for (int64_t bi = 0; bi < nblocks; bi++) {
    int64_t c0 = bi * block, c1 = c0 + block < cols ? c0 + block : cols;
    float acc[256];
    k_colsum(dy, acc, rows, cols, c0, c1);
    for (int64_t c = c0; c < c1; c++) db[c] = acc[c - c0] + (beta == 0.0f ? 0.0f : beta * db[c]);
  }
}

/* In the kernels below, inputs and outputs may alias exactly (in-place ops)
 * as the public contract allows, so no restrict; GCC versions the loops for
 * overlap at run time. */
CPU_KERNEL static void k_relu_fwd(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    y[i] = v > 0.0f ? v : 0.0f;
  }
}

static void cpu_relu_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  CPU_FOR(be, n, lo, hi, k_relu_fwd(x + lo, y + lo, hi - lo));
}

CPU_KERNEL static void k_relu_bwd(const float *y, const float *dy, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float g = dy[i]; /* loaded unconditionally so the select vectorises */
    dx[i] = y[i] > 0.0f ? g : 0.0f;
  }
}

static void cpu_relu_bwd(tensor_backend_t be, const float *y, const float *dy, float *dx, int64_t n) {
  CPU_FOR(be, n, lo, hi, k_relu_bwd(y + lo, dy + lo, dx + lo, hi - lo));
}

#define INV_SQRT2 0.70710678118654752440f
#define INV_SQRT_2PI 0.39894228040143267794f

static void k_gelu_fwd(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * INV_SQRT2));
}

static void cpu_gelu_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  CPU_FOR(be, n * 8, lo, hi, k_gelu_fwd(x + lo / 8, y + lo / 8, hi / 8 - lo / 8));
}

static void k_gelu_bwd(const float *x, const float *dy, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    float cdf = 0.5f * (1.0f + erff(v * INV_SQRT2));
    float pdf = expf(-0.5f * v * v) * INV_SQRT_2PI;
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}

static void cpu_gelu_bwd(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n) {
  CPU_FOR(be, n * 8, lo, hi, k_gelu_bwd(x + lo / 8, dy + lo / 8, dx + lo / 8, hi / 8 - lo / 8));
}

static void cpu_softmax_xent(tensor_backend_t be, const float *logits, const int32_t *labels,
                             float *dlogits, float *losses, int64_t rows, int64_t cols, int64_t ld,
                             float grad_scale) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const float *x = logits + r * ld;
    float *d = dlogits + r * ld;
    float mx = x[0];
    for (int64_t c = 1; c < cols; c++) mx = x[c] > mx ? x[c] : mx;
    int32_t label = labels[r];
    float xl = x[label]; /* read before d (which may alias x) is written */
    double sum = 0.0;
    for (int64_t c = 0; c < cols; c++) {
      float ex = expf(x[c] - mx);
      d[c] = ex;
      sum += ex;
    }
    losses[r] = (float)(log(sum) + (double)mx - (double)xl);
    float inv = (float)(1.0 / sum) * grad_scale;
    for (int64_t c = 0; c < cols; c++) d[c] *= inv;
    d[label] -= grad_scale;
  }
}

/* The vocabulary-parallel cross-entropy (tensor.h), in the plain op's
 * arithmetic: expf per logit, sums in double. */
static void cpu_xent_shard_stats(tensor_backend_t be, const float *logits, const int32_t *labels, float *lse,
                                 float *target, int64_t rows, int64_t cols, int64_t ld, int64_t lo) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const float *x = logits + r * ld;
    float mx = x[0];
    for (int64_t c = 1; c < cols; c++) mx = x[c] > mx ? x[c] : mx;
    double sum = 0.0;
    for (int64_t c = 0; c < cols; c++) sum += expf(x[c] - mx);
    lse[r] = (float)(log(sum) + (double)mx);
    int64_t k = (int64_t)labels[r] - lo;
    target[r] = k >= 0 && k < cols ? x[k] : 0.0f;
  }
}

static void cpu_xent_shard_grad(tensor_backend_t be, const float *logits, const int32_t *labels, const float *parts,
                                int64_t nparts, const float *target, float *dlogits, float *losses, int64_t rows,
                                int64_t cols, int64_t ld, int64_t lo, float grad_scale) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    double mx = parts[r], sum = 0.0;
    for (int64_t s = 1; s < nparts; s++) mx = parts[s * rows + r] > mx ? parts[s * rows + r] : mx;
    for (int64_t s = 0; s < nparts; s++) sum += exp((double)parts[s * rows + r] - mx);
    double whole = mx + log(sum); /* the whole row's log-sum-exp */
    if (losses) losses[r] = (float)(whole - (double)target[r]);
    const float *x = logits + r * ld;
    float *d = dlogits + r * ld, l = (float)whole;
    for (int64_t c = 0; c < cols; c++) d[c] = expf(x[c] - l) * grad_scale;
    int64_t k = (int64_t)labels[r] - lo;
    if (k >= 0 && k < cols) d[k] -= grad_scale;
  }
}

CPU_KERNEL static void k_sgd_plain(float *restrict p, const float *restrict g, int64_t n, float lr, float wd) {
  for (int64_t i = 0; i < n; i++) p[i] -= lr * (g[i] + wd * p[i]);
}

CPU_KERNEL static void k_sgd_momentum(float *restrict p, const float *restrict g, float *restrict m, int64_t n,
                                      float lr, float mu, float wd, float nesterov) {
  for (int64_t i = 0; i < n; i++) {
    float grad = g[i] + wd * p[i];
    float mi = mu * m[i] + grad;
    m[i] = mi;
    p[i] -= lr * (nesterov * grad + (1.0f + nesterov * (mu - 1.0f)) * mi);
  }
}

static void cpu_sgd_step(tensor_backend_t be, float *p, const float *g, float *m, int64_t n,
                         const struct tensor_sgd *hp) {
  const float lr = hp->lr, mu = hp->momentum, wd = hp->weight_decay;
  if (mu == 0.0f) {
    CPU_FOR(be, n, lo, hi, k_sgd_plain(p + lo, g + lo, hi - lo, lr, wd));
  } else {
    /* step = m (plain) or grad + μ·m (Nesterov), written as one expression
     * with nesterov ∈ {0, 1} so both share a vectorised loop. */
    float nest = hp->nesterov ? 1.0f : 0.0f;
    CPU_FOR(be, n, lo, hi, k_sgd_momentum(p + lo, g + lo, m + lo, hi - lo, lr, mu, wd, nest));
  }
}

CPU_KERNEL static void k_adamw(float *restrict p, const float *restrict g, float *restrict m, float *restrict v,
                               int64_t n, float b1, float b2, float eps, float decay, float step_size,
                               float inv_sqrt_bc2) {
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    float mi = b1 * m[i] + (1.0f - b1) * gi;
    float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
  }
}

static void cpu_adamw_step(tensor_backend_t be, float *p, const float *g, float *m, float *v, int64_t n,
                           const struct tensor_adamw *hp) {
  const float decay = 1.0f - hp->lr * hp->weight_decay;
  const float step_size = (float)(hp->lr / (1.0 - pow(hp->beta1, (double)hp->step)));
  const float inv_sqrt_bc2 = (float)(1.0 / sqrt(1.0 - pow(hp->beta2, (double)hp->step)));
  CPU_FOR(be, n, lo, hi,
          k_adamw(p + lo, g + lo, m + lo, v + lo, hi - lo, hp->beta1, hp->beta2, hp->eps, decay, step_size,
                  inv_sqrt_bc2));
}

CPU_KERNEL static void k_axpby(float a, const float *x, float b, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = a * x[i] + b * y[i];
}
static void cpu_axpby(tensor_backend_t be, float a, const float *x, float b, float *y, int64_t n) {
  CPU_FOR(be, n, lo, hi, k_axpby(a, x + lo, b, y + lo, hi - lo));
}

CPU_KERNEL static void k_scale(float *x, float a, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] *= a;
}
static void cpu_scale(tensor_backend_t be, float *x, float a, int64_t n) {
  CPU_FOR(be, n, lo, hi, k_scale(x + lo, a, hi - lo));
}

CPU_KERNEL static void k_fill(float *x, float v, int64_t n) {
  for (int64_t i = 0; i < n; i++) x[i] = v;
}
static void cpu_fill(tensor_backend_t be, float *x, float v, int64_t n) {
  CPU_FOR(be, n, lo, hi, k_fill(x + lo, v, hi - lo));
}

/* Reductions: float partial sums over blocks of 1024 (vectorised, and short
 * enough that float rounding stays small), blocks summed in double. */
#define RED_BLOCK 1024

enum red_kind { RED_SUM, RED_SQ, RED_DIST };

CPU_KERNEL static double k_reduce(enum red_kind kind, const float *x, const float *y, int64_t n) {
  double total = 0.0;
  for (int64_t b = 0; b < n; b += RED_BLOCK) {
    int64_t e = b + RED_BLOCK < n ? b + RED_BLOCK : n;
    float acc = 0.0f;
    if (kind == RED_SUM) {
#pragma omp simd reduction(+ : acc)
      for (int64_t i = b; i < e; i++) acc += x[i];
    } else if (kind == RED_SQ) {
#pragma omp simd reduction(+ : acc)
      for (int64_t i = b; i < e; i++) acc += x[i] * x[i];
    } else {
#pragma omp simd reduction(+ : acc)
      for (int64_t i = b; i < e; i++) {
        float d = x[i] - y[i];
        acc += d * d;
      }
    }
    total += acc;
  }
  return total;
}

static double reduce(tensor_backend_t be, enum red_kind kind, const float *x, const float *y, int64_t n) {
  double total = 0.0;
  int t = nthreads(be);
  if (t <= 1 || n < CPU_PAR_MIN) return k_reduce(kind, x, y, n);
#pragma omp parallel num_threads(t) reduction(+ : total)
  {
    int nt = omp_get_num_threads();
    int64_t chunk = (((n + nt - 1) / nt) + RED_BLOCK - 1) / RED_BLOCK * RED_BLOCK;
    int64_t lo = (int64_t)omp_get_thread_num() * chunk, hi = lo + chunk < n ? lo + chunk : n;
    if (lo < hi) total += k_reduce(kind, x + lo, y ? y + lo : NULL, hi - lo);
  }
  return total;
}

static double cpu_sum(tensor_backend_t be, const float *x, int64_t n) { return reduce(be, RED_SUM, x, NULL, n); }
static double cpu_sq_norm(tensor_backend_t be, const float *x, int64_t n) { return reduce(be, RED_SQ, x, NULL, n); }
static double cpu_sq_dist(tensor_backend_t be, const float *x, const float *y, int64_t n) {
  return reduce(be, RED_DIST, x, y, n);
}

/* Exponent bits all ones ⇔ NaN or Inf: an integer test, so it vectorises and
 * is immune to any finite-math assumptions. */
CPU_KERNEL static int64_t k_nonfinite(const uint32_t *u, int64_t n) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad += (u[i] & 0x7f800000u) == 0x7f800000u;
  return bad;
}

static int64_t cpu_count_nonfinite(tensor_backend_t be, const float *x, int64_t n) {
  const uint32_t *u = (const uint32_t *)x;
  int64_t bad = 0;
  int t = nthreads(be);
  if (t <= 1 || n < CPU_PAR_MIN) return k_nonfinite(u, n);
#pragma omp parallel num_threads(t) reduction(+ : bad)
  {
    int nt = omp_get_num_threads();
    int64_t chunk = (n + nt - 1) / nt;
    int64_t lo = (int64_t)omp_get_thread_num() * chunk, hi = lo + chunk < n ? lo + chunk : n;
    if (lo < hi) bad += k_nonfinite(u + lo, hi - lo);
  }
  return bad;
}

/* Gossip's checks in one pass: non-finite values of y (the integer test
 * above), ‖y − x‖² and ‖x‖², float partials per block as in k_reduce. */
CPU_KERNEL static void k_diff_stats(const float *x, const float *y, int64_t n, struct tensor_diff_stats *s) {
  const uint32_t *u = (const uint32_t *)y;
  for (int64_t b = 0; b < n; b += RED_BLOCK) {
    int64_t e = b + RED_BLOCK < n ? b + RED_BLOCK : n;
    float dist = 0.0f, norm = 0.0f;
    int64_t bad = 0;
#pragma omp simd reduction(+ : dist, norm, bad)
    for (int64_t i = b; i < e; i++) {
      bad += (u[i] & 0x7f800000u) == 0x7f800000u;
      float d = y[i] - x[i];
      dist += d * d;
      norm += x[i] * x[i];
    }
    s->nonfinite_y += bad;
    s->sq_dist += dist;
    s->sq_norm_x += norm;
  }
}

static void cpu_diff_stats(tensor_backend_t be, const float *x, const float *y, int64_t n,
                           struct tensor_diff_stats *out) {
  int64_t bad = 0;
  double dist = 0.0, norm = 0.0;
  int t = nthreads(be);
  if (t <= 1 || n < CPU_PAR_MIN) {
    *out = (struct tensor_diff_stats){0};
    k_diff_stats(x, y, n, out);
    return;
  }
#pragma omp parallel num_threads(t) reduction(+ : bad, dist, norm)
  {
    int nt = omp_get_num_threads();
    int64_t chunk = (((n + nt - 1) / nt) + RED_BLOCK - 1) / RED_BLOCK * RED_BLOCK;
    int64_t lo = (int64_t)omp_get_thread_num() * chunk, hi = lo + chunk < n ? lo + chunk : n;
    struct tensor_diff_stats part = {0};
    if (lo < hi) k_diff_stats(x + lo, y + lo, hi - lo, &part);
    bad += part.nonfinite_y;
    dist += part.sq_dist;
    norm += part.sq_norm_x;
  }
  *out = (struct tensor_diff_stats){bad, dist, norm};
}

/* Count-sketch (the blocked layout of tensor_sketch_bucket): the hashes of
 * a block of groups are computed in a vectorised loop, then each group of 8
 * elements is added to its 8 adjacent buckets with its signs, a loop GCC
 * turns into a few AVX2 instructions. Each thread sketches a contiguous
 * range of whole groups into its own buckets; the per-thread sketches are
 * summed at the end. */
#define SKETCH_BLOCK 256 /* groups per hash batch */

CPU_KERNEL static void sketch_hashes(uint32_t *restrict hash, uint64_t g0, int cnt, uint64_t seed) {
  for (int j = 0; j < cnt; j++) hash[j] = tensor_sketch_hash(seed, g0 + (uint64_t)j);
}

/* Adds groups [0, cnt) of x into out, group j at slot (hash[j] >> 8) & mask. */
static void sketch_add_plain(const float *restrict x, const uint32_t *hash, int cnt, uint32_t slot_mask,
                             double *restrict out) {
  for (int j = 0; j < cnt; j++) {
    uint32_t h = hash[j];
    double *o = out + (((h >> 8) & slot_mask) << 3);
    for (int l = 0; l < 8; l++) o[l] += ((h >> l) & 1u) ? -(double)x[8 * j + l] : (double)x[8 * j + l];
  }
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
/* The same with AVX2 (GCC does not vectorise the 8-lane add by itself): the
 * signs flip the float sign bits, then two 4-double adds. */
__attribute__((target("avx2"))) static void sketch_add_avx2(const float *restrict x, const uint32_t *hash, int cnt,
                                                             uint32_t slot_mask, double *restrict out) {
  const __m256i lane_bit = _mm256_setr_epi32(1, 2, 4, 8, 16, 32, 64, 128);
  for (int j = 0; j < cnt; j++) {
    uint32_t h = hash[j];
    double *o = out + (((h >> 8) & slot_mask) << 3);
    __m256i set = _mm256_cmpeq_epi32(_mm256_and_si256(_mm256_set1_epi32((int)h), lane_bit), lane_bit);
    __m256 v = _mm256_xor_ps(_mm256_loadu_ps(x + 8 * j), _mm256_castsi256_ps(_mm256_slli_epi32(set, 31)));
    __m256d lo = _mm256_cvtps_pd(_mm256_castps256_ps128(v)), hi = _mm256_cvtps_pd(_mm256_extractf128_ps(v, 1));
    _mm256_storeu_pd(o, _mm256_add_pd(_mm256_loadu_pd(o), lo));
    _mm256_storeu_pd(o + 4, _mm256_add_pd(_mm256_loadu_pd(o + 4), hi));
  }
}
static bool have_avx2(void) { return __builtin_cpu_supports("avx2"); }
#else
#define sketch_add_avx2 sketch_add_plain
static bool have_avx2(void) { return false; }
#endif

static void sketch_groups(const float *x, uint64_t g0, int64_t ngroups, uint64_t seed, uint32_t slot_mask,
                          double *out) {
  uint32_t hash[SKETCH_BLOCK];
  bool avx2 = have_avx2();
  for (int64_t b = 0; b < ngroups; b += SKETCH_BLOCK) {
    int cnt = (int)(ngroups - b < SKETCH_BLOCK ? ngroups - b : SKETCH_BLOCK);
    sketch_hashes(hash, g0 + (uint64_t)b, cnt, seed);
    if (avx2)
      sketch_add_avx2(x + b * 8, hash, cnt, slot_mask, out);
    else
      sketch_add_plain(x + b * 8, hash, cnt, slot_mask, out);
  }
}

/* Elements [lo, hi) one at a time (ranges not made of whole groups, k < 8). */
static void sketch_scalar(const float *x, int64_t lo, int64_t hi, uint64_t seed, int k, double *out) {
  for (int64_t i = lo; i < hi; i++) {
    bool neg;
    uint32_t b = tensor_sketch_bucket(seed, (uint64_t)i, k, &neg);
    out[b] += neg ? -(double)x[i] : (double)x[i];
  }
}

static void sketch_range(const float *x, int64_t lo, int64_t hi, uint64_t seed, int k, double *out) {
  if (k < 8) {
    sketch_scalar(x, lo, hi, seed, k, out);
    return;
  }
  int64_t glo = (lo + 7) / 8, ghi = hi / 8; /* whole groups inside [lo, hi) */
  if (glo >= ghi) {
    sketch_scalar(x, lo, hi, seed, k, out);
    return;
  }
  sketch_scalar(x, lo, glo * 8, seed, k, out);
  sketch_groups(x + glo * 8, (uint64_t)glo, ghi - glo, seed, (uint32_t)(k / 8 - 1), out);
  sketch_scalar(x, ghi * 8, hi, seed, k, out);
}

static void cpu_count_sketch(tensor_backend_t be, const float *x, int64_t n, uint64_t seed, int k,
                             double *out_host) {
  int t = nthreads(be);
  if (n < CPU_PAR_MIN * 4) t = 1;
  double *parts = xcalloc((size_t)t * (size_t)k, sizeof(double));
#pragma omp parallel num_threads(t)
  {
    int id = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t chunk = ((n + nt - 1) / nt + 7) / 8 * 8; /* whole groups per thread */
    int64_t lo = (int64_t)id * chunk < n ? (int64_t)id * chunk : n, hi = lo + chunk < n ? lo + chunk : n;
    if (lo < hi) sketch_range(x, lo, hi, seed, k, parts + (size_t)id * (size_t)k);
  }
  for (int j = 0; j < k; j++) {
    double s = 0.0;
    for (int i = 0; i < t; i++) s += parts[(size_t)i * (size_t)k + (size_t)j];
    out_host[j] = s;
  }
  free(parts);
}

static const struct tensor_backend_ops cpu_ops = {
    .close = cpu_close,
    .set_threads = cpu_set_threads,
    .sync = cpu_sync,
    .mem_alloc = cpu_alloc,
    .mem_free = cpu_free,
    .host_alloc = cpu_alloc,
    .host_free = cpu_free,
    .mem_discard = cpu_discard,
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy_d2d,
    .copy_d2h_beside = cpu_copy_beside,
    .ev_create = cpu_ev_create,
    .ev_destroy = cpu_ev_destroy,
    .ev_record = cpu_ev_record,
    .ev_query = cpu_ev_query,
    .ev_wait = cpu_ev_wait,
    .gemm = cpu_gemm,
    .bias_add = cpu_bias_add,
    .bias_grad = cpu_bias_grad,
    .relu_fwd = cpu_relu_fwd,
    .relu_bwd = cpu_relu_bwd,
    .gelu_fwd = cpu_gelu_fwd,
    .gelu_bwd = cpu_gelu_bwd,
    .softmax_xent = cpu_softmax_xent,
    .add = cpu_add,
    .embedding_fwd = cpu_embedding_fwd,
    .embedding_bwd = cpu_embedding_bwd,
    .xent_shard_stats = cpu_xent_shard_stats,
    .xent_shard_grad = cpu_xent_shard_grad,
    .layernorm_fwd = cpu_layernorm_fwd,
    .layernorm_bwd = cpu_layernorm_bwd,
    .attention_fwd = cpu_attention_fwd,
    .attention_bwd = cpu_attention_bwd,
    .gelu_tanh_fwd = cpu_gelu_tanh_fwd,
    .gelu_tanh_bwd = cpu_gelu_tanh_bwd,
    .moe_route = cpu_moe_route,
    .moe_route_bwd = cpu_moe_route_bwd,
    .moe_dispatch = cpu_moe_dispatch,
    .moe_dispatch_bwd = cpu_moe_dispatch_bwd,
    .moe_combine = cpu_moe_combine,
    .moe_combine_bwd = cpu_moe_combine_bwd,
    .sgd_step = cpu_sgd_step,
    .adamw_step = cpu_adamw_step,
    .axpby = cpu_axpby,
    .scale = cpu_scale,
    .fill = cpu_fill,
    .sum = cpu_sum,
    .sq_norm = cpu_sq_norm,
    .sq_dist = cpu_sq_dist,
    .count_nonfinite = cpu_count_nonfinite,
    .diff_stats = cpu_diff_stats,
    .count_sketch = cpu_count_sketch,
};

int tensor_cpu_open(tensor_backend_t *out, struct rumor_err *e) {
  struct cpu_backend *b = xcalloc(1, sizeof *b);
  b->base.ops = &cpu_ops;
  b->base.device = TENSOR_DEVICE_CPU;
  snprintf(b->base.name, sizeof b->base.name, "cpu");
  b->threads = omp_get_max_threads();
  *out = &b->base;
  return 0;
}
