/*
 * cuda_check.h — what the CUDA backend's tests share: one test's state (the
 * backend, the random seed), an arena that frees what a test allocated,
 * device tensors between sentinel guard bands that start as NaN, and
 * element-wise comparisons that name the worst element and the seed.
 *
 * Header-only (static inline functions); one test per process, as Criterion
 * runs them. Include after criterion.h and tensor/tensor_ref.h.
 */
#ifndef RUMOR_TESTS_CUDA_CHECK_H
#define RUMOR_TESTS_CUDA_CHECK_H

#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* AddressSanitizer's shadow gap sits where CUDA maps device memory; with it
 * protected, CUDA initialisation fails and the tests would skip. Read only
 * by ASan builds. */
const char *__asan_default_options(void);
const char *__asan_default_options(void) { return "protect_shadow_gap=0"; }

/* ---- test state (one test per process) -------------------------------------------- */

static tensor_backend_t g_be;
static uint64_t g_seed;
static struct rng g_rng;

static inline void seed_rng(void) {
  const char *s = getenv("RUMOR_TEST_SEED");
  g_seed = (s && *s) ? strtoull(s, NULL, 0) : clock_now_ns();
  rng_seed(&g_rng, g_seed, 0);
}

/* Skips the test unless a GPU is usable; opens cuda:0 into g_be. */
static inline void open_gpu(void) {
  if (tensor_cuda_device_count() == 0)
    cr_skip_test("no CUDA GPU: tensor_cuda_device_count() is 0 (%s); GPU test skipped",
                 tensor_cuda_compiled() ? "built with CUDA, but no usable device or driver"
                                        : "built without CUDA");
  struct rumor_err e = {0};
  int rc = tensor_backend_open("cuda:0", &g_be, &e);
  cr_assert_eq(rc, 0, "tensor_backend_open(\"cuda:0\") failed: %s", e.msg);
  cr_assert_eq(tensor_backend_device(g_be), TENSOR_DEVICE_CUDA);
  seed_rng();
}

/* Everything a test allocates goes into this arena; arena_release(mark)
 * frees what came after `mark`. */
#define ARENA_MAX 128
struct arena_item {
  struct tensor t; /* owning device tensor, or unused */
  void *host;      /* malloc'ed host buffer, or NULL */
};
static struct arena_item g_arena[ARENA_MAX];
static int g_arena_n;

static inline int arena_mark(void) { return g_arena_n; }

static inline void arena_release(int mark) {
  while (g_arena_n > mark) {
    struct arena_item *it = &g_arena[--g_arena_n];
    tensor_free(&it->t);
    free(it->host);
    it->host = NULL;
  }
}

static inline struct arena_item *arena_push(void) {
  cr_assert(g_arena_n < ARENA_MAX, "test arena full");
  struct arena_item *it = &g_arena[g_arena_n++];
  memset(it, 0, sizeof *it);
  return it;
}

static inline void close_gpu(void) {
  arena_release(0);
  tensor_backend_close(g_be);
  g_be = NULL;
}

/* ---- host buffers and random data ---------------------------------------------------- */

static inline void *hbuf_bytes(size_t bytes) {
  struct arena_item *it = arena_push();
  it->host = xmalloc(bytes ? bytes : 1);
  return it->host;
}
static inline float *hbuf(int64_t n) { return hbuf_bytes((size_t)n * sizeof(float)); }
static inline int32_t *hbuf_i32(int64_t n) { return hbuf_bytes((size_t)n * sizeof(int32_t)); }

static inline void fill_normal(float *p, int64_t n, float mean, float scale) {
  for (int64_t i = 0; i < n; i++) p[i] = mean + scale * rng_normal(&g_rng);
}

/* Integers in [−lim, lim]: their sums and products stay exact in FP32. */
static inline void fill_ints(float *p, int64_t n, int lim) {
  for (int64_t i = 0; i < n; i++) p[i] = (float)((int64_t)rng_below(&g_rng, (uint64_t)(2 * lim + 1)) - lim);
}

static inline void fill_value(float *p, int64_t n, float v) {
  for (int64_t i = 0; i < n; i++) p[i] = v;
}

/* ---- guarded device tensors ------------------------------------------------------------ */

#define GUARD 37                  /* sentinel elements each side; odd, so views are not 16-byte aligned */
#define GUARD_ALIGNED 64          /* 256 bytes: keeps views as aligned as cudaMalloc's */
#define SENTINEL_BITS 0xc640e6b7u /* −12345.678f */
#define POISON_BITS 0x7fc00000u   /* quiet NaN */

struct dev {
  struct tensor *whole; /* [guard + n + guard], owned by the arena */
  struct tensor t;      /* the view an op sees */
  int64_t n, guard;
};

/* A device tensor of `shape` in an arena buffer with `guard` sentinel
 * elements on each side; the elements themselves start as NaN. */
static inline struct dev dev_new_g(enum tensor_dtype dt, int ndim, const int64_t *shape, int64_t guard) {
  RUMOR_ASSERT(tensor_dtype_size(dt) == 4);
  struct dev d;
  d.n = 1;
  for (int i = 0; i < ndim; i++) d.n *= shape[i];
  d.guard = guard;
  int64_t total = d.n + 2 * guard;
  struct arena_item *it = arena_push();
  struct rumor_err e = {0};
  int rc = tensor_alloc(&it->t, g_be, dt, 1, &total, &e);
  cr_assert_eq(rc, 0, "tensor_alloc(%" PRId64 " elements) failed: %s", total, e.msg);
  d.whole = &it->t;
  uint32_t *init = xmalloc((size_t)total * 4);
  for (int64_t i = 0; i < total; i++) init[i] = (i < guard || i >= guard + d.n) ? SENTINEL_BITS : POISON_BITS;
  tensor_copy_from_host(d.whole, 0, init, (size_t)total * 4);
  free(init);
  d.t = tensor_view(d.whole, guard, ndim, shape);
  return d;
}

static inline struct dev dev_new_dt(enum tensor_dtype dt, int ndim, const int64_t *shape) {
  return dev_new_g(dt, ndim, shape, GUARD);
}

static inline struct dev dev_new(int ndim, const int64_t *shape) { return dev_new_dt(TENSOR_F32, ndim, shape); }

static inline struct dev dev_vec(int64_t n) { return dev_new(1, &n); }

static inline void dev_upload(struct dev *d, const void *host) {
  if (d->n) tensor_copy_from_host(&d->t, 0, host, (size_t)d->n * 4);
}

static inline void dev_download(const struct dev *d, void *host) {
  if (d->n) tensor_copy_to_host(&d->t, 0, host, (size_t)d->n * 4);
}

static inline struct dev dev_from(int ndim, const int64_t *shape, const void *host) {
  struct dev d = dev_new(ndim, shape);
  dev_upload(&d, host);
  return d;
}

/* ---- verdicts ---------------------------------------------------------------------------
 *
 * Each check returns true when it holds, else false with the failure in
 * g_why (the element, the values and the seed), for the test's own
 * assertion: cr_assert(matches(...), "%s", g_why). */

static char g_why[512];

static inline bool __attribute__((format(printf, 1, 2))) fail_why(const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(g_why, sizeof g_why, fmt, ap);
  va_end(ap);
  return false;
}

/* Nothing was written into the guard bands of `d`. */
static inline bool guards_intact(const struct dev *d, const char *what) {
  int64_t total = d->n + 2 * d->guard;
  uint32_t *all = xmalloc((size_t)total * 4);
  tensor_copy_to_host(d->whole, 0, all, (size_t)total * 4);
  bool ok = true;
  for (int64_t i = 0; i < total && ok; i++) {
    if ((i >= d->guard && i < d->guard + d->n) || all[i] == SENTINEL_BITS) continue;
    ok = fail_why("%s: out-of-bounds write: guard element %" PRId64 " %s the tensor (n=%" PRId64
                  ") holds 0x%08x (seed %" PRIu64 ")",
                  what, i < d->guard ? i - d->guard : i - d->guard - d->n, i < d->guard ? "before" : "after", d->n,
                  all[i], g_seed);
  }
  free(all);
  return ok;
}

/* |got[i] − ref[i]| <= atol_i + rtol·|ref[i]| for every i, and NaN or ±Inf
 * in got exactly where ref has the same, with atol_i = atol, plus
 * atol_rows[i / cols] when atol_rows is not NULL (a per-row allowance for
 * ill-conditioned rows). A failure names the worst element. atol = rtol = 0
 * and no atol_rows demand equal values. */
static inline bool matches_rows(const char *what, const float *got, const float *ref, int64_t n, double atol,
                                double rtol, const double *atol_rows, int64_t cols) {
  int64_t worst = -1;
  double worst_ratio = 0.0, worst_tol = 0.0;
  for (int64_t i = 0; i < n; i++) {
    double g = got[i], r = ref[i];
    if (!isfinite(r) || !isfinite(g)) {
      if (!(isnan(r) ? isnan(g) : g == r))
        return fail_why("%s: element %" PRId64 " of %" PRId64 " is %.9g where the reference is %.9g "
                        "(NaN/Inf mismatch; seed %" PRIu64 ")",
                        what, i, n, g, r, g_seed);
      continue;
    }
    double tol = atol + rtol * fabs(r) + (atol_rows ? atol_rows[i / cols] : 0.0), diff = fabs(g - r);
    double ratio = tol > 0.0 ? diff / tol : (diff > 0.0 ? INFINITY : 0.0);
    if (ratio > worst_ratio) {
      worst_ratio = ratio;
      worst = i;
      worst_tol = tol;
    }
  }
  if (worst < 0 || worst_ratio <= 1.0) return true;
  return fail_why("%s: worst element %" PRId64 " of %" PRId64 ": got %.9g, ref %.9g, |diff| %.3g > %.3g (%.3g + "
                  "%.3g·|ref|%s; seed %" PRIu64 ")",
                  what, worst, n, (double)got[worst], (double)ref[worst], fabs((double)got[worst] - ref[worst]),
                  worst_tol, atol, rtol, atol_rows ? " + the row's allowance" : "", g_seed);
}

static inline bool matches(const char *what, const float *got, const float *ref, int64_t n, double atol, double rtol) {
  return matches_rows(what, got, ref, n, atol, rtol, NULL, 1);
}

static inline bool matches_exactly(const char *what, const float *got, const float *ref, int64_t n) {
  return matches(what, got, ref, n, 0.0, 0.0);
}

/* a and b hold the same bits (run-to-run determinism); a failure names the
 * first element that differs. */
static inline bool same_bits(const char *what, const float *a, const float *b, int64_t n) {
  if (memcmp(a, b, (size_t)n * sizeof *a) == 0) return true;
  for (int64_t i = 0;; i++) {
    uint32_t x, y;
    memcpy(&x, &a[i], 4);
    memcpy(&y, &b[i], 4);
    if (x != y)
      return fail_why("%s: element %" PRId64 " of %" PRId64 " differs between two runs: 0x%08x vs 0x%08x (seed %" PRIu64
                      ")",
                      what, i, n, x, y, g_seed);
  }
}

/* An element-wise activation on the device matches its reference results
 * (y = fwd(x), dx = bwd(x, dy), computed by the caller on the host) out of
 * place, then backward with dx aliasing dy, then forward in place (last: x
 * is consumed), writing nothing outside its outputs. `got` is host scratch
 * of n floats. */
typedef void (*act_fwd_fn)(const struct tensor *x, struct tensor *y);
typedef void (*act_bwd_fn)(const struct tensor *x, const struct tensor *dy, struct tensor *dx);
static inline bool activation_matches(const char *name, act_fwd_fn fwd, act_bwd_fn bwd, const float *x,
                                      const float *y, const float *dy, const float *dx, int64_t n, float *got,
                                      double atol, double rtol) {
  char what[4][64];
  snprintf(what[0], sizeof what[0], "%s_fwd n=%" PRId64, name, n);
  snprintf(what[1], sizeof what[1], "%s_bwd n=%" PRId64, name, n);
  snprintf(what[2], sizeof what[2], "%s_bwd in place n=%" PRId64, name, n);
  snprintf(what[3], sizeof what[3], "%s_fwd in place n=%" PRId64, name, n);
  struct dev dxs = dev_from(1, &n, x), dys = dev_new(1, &n);
  fwd(&dxs.t, &dys.t);
  dev_download(&dys, got);
  if (!matches(what[0], got, y, n, atol, rtol) || !guards_intact(&dys, what[0])) return false;

  struct dev ddy = dev_from(1, &n, dy), ddx = dev_new(1, &n);
  bwd(&dxs.t, &ddy.t, &ddx.t);
  dev_download(&ddx, got);
  if (!matches(what[1], got, dx, n, atol, rtol) || !guards_intact(&ddx, what[1])) return false;

  bwd(&dxs.t, &ddy.t, &ddy.t); /* dx aliases dy */
  dev_download(&ddy, got);
  if (!matches(what[2], got, dx, n, atol, rtol) || !guards_intact(&ddy, what[2])) return false;

  fwd(&dxs.t, &dxs.t); /* in place, last: x is consumed */
  dev_download(&dxs, got);
  return matches(what[3], got, y, n, atol, rtol) && guards_intact(&dxs, what[3]);
}

/* Puts NaN, ±Inf, zeros and extremes at fixed places of x (n > 12). */
static inline void add_specials(float *x, int64_t n) {
  if (n <= 12) return;
  x[1] = NAN;
  x[3] = INFINITY;
  x[5] = -INFINITY;
  x[7] = 0.0f;
  x[9] = -0.0f;
  x[11] = FLT_MAX;
  x[n - 1] = -FLT_MAX;
}

/* Element counts for element-wise ops: 1, odd sizes, one block exactly, and
 * one past 8192·256 (a second grid-stride lap). */
static const int64_t kSizes[] = {1, 31, 256, 1000, 65537, (1 << 21) + 3};
#define NSIZES ((int)(sizeof kSizes / sizeof kSizes[0]))

#endif
