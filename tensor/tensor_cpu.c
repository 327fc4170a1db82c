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

#include "tensor/tensor_impl.h"

/* Below this many elements a loop runs on one thread: an OpenMP fork costs
 * a few microseconds, about what 64 K simple float ops cost. */
#define CPU_PAR_MIN 65536
#define CPU_ALIGN 64

struct cpu_backend {
  struct tensor_backend base;
  int threads;
};

static int nthreads(tensor_backend_t be) { return ((struct cpu_backend *)be)->threads; }

static void cpu_close(tensor_backend_t be) { free(be); }

static void cpu_set_threads(tensor_backend_t be, int threads) { ((struct cpu_backend *)be)->threads = threads; }

static void cpu_sync(tensor_backend_t be) {}

static void *cpu_alloc(tensor_backend_t be, size_t bytes) {
  size_t n = (bytes + CPU_ALIGN - 1) & ~(size_t)(CPU_ALIGN - 1);
  return aligned_alloc(CPU_ALIGN, n ? n : CPU_ALIGN);
}

static void cpu_free(tensor_backend_t be, void *p) { free(p); }

static void cpu_copy(tensor_backend_t be, void *dst, const void *src, size_t bytes, bool async) {
  if (dst != src) memmove(dst, src, bytes);
}

static void cpu_copy_d2d(tensor_backend_t be, void *dst, const void *src, size_t bytes) {
  if (dst != src) memmove(dst, src, bytes);
}

/* Events: the CPU runs ops synchronously, so an event is a placeholder. */
static void *cpu_ev_create(tensor_backend_t be) { return xmalloc(1); }
static void cpu_ev_destroy(tensor_backend_t be, void *ev) { free(ev); }
static void cpu_ev_record(tensor_backend_t be, void *ev) {}
static bool cpu_ev_query(tensor_backend_t be, void *ev) { return true; }
static void cpu_ev_wait(tensor_backend_t be, void *ev) {}

static void cpu_gemm(tensor_backend_t be, bool ta, bool tb, int m, int n, int k, float alpha,
                     const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  int t = nthreads(be);
  if (omp_get_max_threads() != t) omp_set_num_threads(t);
  dnnl_status_t st = dnnl_sgemm(ta ? 'T' : 'N', tb ? 'T' : 'N', m, n, k, alpha, a, lda, b, ldb, beta, c, ldc);
  if (st != dnnl_success)
    rumor_panic(__FILE__, __LINE__, "dnnl_sgemm(%c,%c,%d,%d,%d) failed with status %d", ta ? 'T' : 'N',
                tb ? 'T' : 'N', m, n, k, (int)st);
}

static void cpu_bias_add(tensor_backend_t be, float *y, const float *bias, int64_t rows, int64_t cols) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    float *yr = y + r * cols;
#pragma omp simd
    for (int64_t c = 0; c < cols; c++) yr[c] += bias[c];
  }
}

static void cpu_bias_grad(tensor_backend_t be, const float *dy, float *db, int64_t rows, int64_t cols,
                          float beta) {
  /* Column sums: walk rows in order (unit stride) accumulating into a
   * per-thread column block. */
  int t = nthreads(be);
  const int64_t block = 256;
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN)
  for (int64_t c0 = 0; c0 < cols; c0 += block) {
    int64_t c1 = c0 + block < cols ? c0 + block : cols;
    float acc[256];
    for (int64_t c = c0; c < c1; c++) acc[c - c0] = 0.0f;
    for (int64_t r = 0; r < rows; r++) {
      const float *dr = dy + r * cols;
#pragma omp simd
      for (int64_t c = c0; c < c1; c++) acc[c - c0] += dr[c];
    }
    for (int64_t c = c0; c < c1; c++) db[c] = acc[c - c0] + (beta == 0.0f ? 0.0f : beta * db[c]);
  }
}

static void cpu_relu_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

static void cpu_relu_bwd(tensor_backend_t be, const float *y, const float *dy, float *dx, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

#define INV_SQRT2 0.70710678118654752440f
#define INV_SQRT_2PI 0.39894228040143267794f

static void cpu_gelu_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (n >= CPU_PAR_MIN / 8)
  for (int64_t i = 0; i < n; i++) y[i] = 0.5f * x[i] * (1.0f + erff(x[i] * INV_SQRT2));
}

static void cpu_gelu_bwd(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (n >= CPU_PAR_MIN / 8)
  for (int64_t i = 0; i < n; i++) {
    float v = x[i];
    float cdf = 0.5f * (1.0f + erff(v * INV_SQRT2));
    float pdf = expf(-0.5f * v * v) * INV_SQRT_2PI;
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}

static void cpu_softmax_xent(tensor_backend_t be, const float *logits, const int32_t *labels,
                             float *dlogits, float *losses, int64_t rows, int64_t cols, float grad_scale) {
  int t = nthreads(be);
#pragma omp parallel for num_threads(t) if (rows * cols >= CPU_PAR_MIN)
  for (int64_t r = 0; r < rows; r++) {
    const float *x = logits + r * cols;
    float *d = dlogits + r * cols;
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

static void cpu_sgd_step(tensor_backend_t be, float *p, const float *g, float *m, int64_t n,
                         const struct tensor_sgd *hp) {
  int t = nthreads(be);
  const float lr = hp->lr, mu = hp->momentum, wd = hp->weight_decay;
  if (mu == 0.0f) {
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) p[i] -= lr * (g[i] + wd * p[i]);
  } else if (hp->nesterov) {
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
      float grad = g[i] + wd * p[i];
      m[i] = mu * m[i] + grad;
      p[i] -= lr * (grad + mu * m[i]);
    }
  } else {
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
    for (int64_t i = 0; i < n; i++) {
      float grad = g[i] + wd * p[i];
      m[i] = mu * m[i] + grad;
      p[i] -= lr * m[i];
    }
  }
}

static void cpu_adamw_step(tensor_backend_t be, float *p, const float *g, float *m, float *v, int64_t n,
                           const struct tensor_adamw *hp) {
  int t = nthreads(be);
  const float b1 = hp->beta1, b2 = hp->beta2, eps = hp->eps;
  const float decay = 1.0f - hp->lr * hp->weight_decay;
  const float step_size = (float)(hp->lr / (1.0 - pow(b1, (double)hp->step)));
  const float inv_sqrt_bc2 = (float)(1.0 / sqrt(1.0 - pow(b2, (double)hp->step)));
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) {
    float gi = g[i];
    float mi = b1 * m[i] + (1.0f - b1) * gi;
    float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
  }
}

static void cpu_axpby(tensor_backend_t be, float a, const float *x, float b, float *y, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) y[i] = a * x[i] + b * y[i];
}

static void cpu_lerp(tensor_backend_t be, float *x, const float *y, float alpha, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) x[i] += alpha * (y[i] - x[i]);
}

static void cpu_scale(tensor_backend_t be, float *x, float a, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) x[i] *= a;
}

static void cpu_fill(tensor_backend_t be, float *x, float v, int64_t n) {
  int t = nthreads(be);
#pragma omp parallel for simd num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) x[i] = v;
}

/* Reductions: float partial sums over blocks of 1024 (vectorised, and short
 * enough that float rounding stays small), blocks summed in double. */
#define RED_BLOCK 1024

static double cpu_sum(tensor_backend_t be, const float *x, int64_t n) {
  int t = nthreads(be);
  double total = 0.0;
#pragma omp parallel for reduction(+ : total) num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t b = 0; b < n; b += RED_BLOCK) {
    int64_t e = b + RED_BLOCK < n ? b + RED_BLOCK : n;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b; i < e; i++) acc += x[i];
    total += acc;
  }
  return total;
}

static double cpu_sq_norm(tensor_backend_t be, const float *x, int64_t n) {
  int t = nthreads(be);
  double total = 0.0;
#pragma omp parallel for reduction(+ : total) num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t b = 0; b < n; b += RED_BLOCK) {
    int64_t e = b + RED_BLOCK < n ? b + RED_BLOCK : n;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b; i < e; i++) acc += x[i] * x[i];
    total += acc;
  }
  return total;
}

static double cpu_sq_dist(tensor_backend_t be, const float *x, const float *y, int64_t n) {
  int t = nthreads(be);
  double total = 0.0;
#pragma omp parallel for reduction(+ : total) num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t b = 0; b < n; b += RED_BLOCK) {
    int64_t e = b + RED_BLOCK < n ? b + RED_BLOCK : n;
    float acc = 0.0f;
#pragma omp simd reduction(+ : acc)
    for (int64_t i = b; i < e; i++) {
      float d = x[i] - y[i];
      acc += d * d;
    }
    total += acc;
  }
  return total;
}

static int64_t cpu_count_nonfinite(tensor_backend_t be, const float *x, int64_t n) {
  int t = nthreads(be);
  int64_t bad = 0;
  /* Exponent bits all ones ⇔ NaN or Inf; integer test so it vectorises and
   * is immune to -ffinite-math style optimisations. */
  const uint32_t *u = (const uint32_t *)x;
#pragma omp parallel for simd reduction(+ : bad) num_threads(t) if (n >= CPU_PAR_MIN)
  for (int64_t i = 0; i < n; i++) bad += (u[i] & 0x7f800000u) == 0x7f800000u;
  return bad;
}

/* Count-sketch: hashes for a block of indices are computed in a vectorisable
 * loop, then scattered into the buckets. Each thread sketches a contiguous
 * range into its own buckets; the per-thread sketches are summed at the end. */
#define SKETCH_BLOCK 512

static void sketch_range(const float *x, int64_t lo, int64_t hi, uint64_t seed, uint32_t mask,
                         double *out) {
  uint32_t hash[SKETCH_BLOCK];
  for (int64_t b = lo; b < hi; b += SKETCH_BLOCK) {
    int64_t e = b + SKETCH_BLOCK < hi ? b + SKETCH_BLOCK : hi;
    int cnt = (int)(e - b);
    for (int j = 0; j < cnt; j++) hash[j] = tensor_sketch_hash(seed, (uint64_t)(b + j));
    for (int j = 0; j < cnt; j++) {
      uint32_t h = hash[j];
      float v = x[b + j];
      out[(h >> 1) & mask] += (h & 1) ? -(double)v : (double)v;
    }
  }
}

static void cpu_count_sketch(tensor_backend_t be, const float *x, int64_t n, uint64_t seed, int k,
                             double *out_host) {
  int t = nthreads(be);
  if (n < CPU_PAR_MIN * 4) t = 1;
  double *parts = xcalloc((size_t)t * (size_t)k, sizeof(double));
#pragma omp parallel num_threads(t)
  {
    int id = omp_get_thread_num(), nt = omp_get_num_threads();
    int64_t chunk = (n + nt - 1) / nt;
    int64_t lo = (int64_t)id * chunk, hi = lo + chunk < n ? lo + chunk : n;
    if (lo < hi) sketch_range(x, lo, hi, seed, (uint32_t)(k - 1), parts + (size_t)id * (size_t)k);
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
    .copy_h2d = cpu_copy,
    .copy_d2h = cpu_copy,
    .copy_d2d = cpu_copy_d2d,
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
    .sgd_step = cpu_sgd_step,
    .adamw_step = cpu_adamw_step,
    .axpby = cpu_axpby,
    .lerp = cpu_lerp,
    .scale = cpu_scale,
    .fill = cpu_fill,
    .sum = cpu_sum,
    .sq_norm = cpu_sq_norm,
    .sq_dist = cpu_sq_dist,
    .count_nonfinite = cpu_count_nonfinite,
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
