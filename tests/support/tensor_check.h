/*
 * tensor_check.h — what the CPU backend's op tests share: the backend and
 * random generator of the suite (opened by the test file's .init), host
 * buffers of random values, device tensors from host data or poisoned with
 * NaN, and the element-wise comparison that names the worst element.
 *
 * Header-only (static inline functions). Include after criterion.h and
 * tensor/tensor_ref.h.
 */
#ifndef RUMOR_TESTS_TENSOR_CHECK_H
#define RUMOR_TESTS_TENSOR_CHECK_H

#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static tensor_backend_t be; /* the suite's backend */
static struct rng rng;      /* the suite's random inputs */

/* Seeds the suite's inputs: new ones every run (from the clock), or those
 * of RUMOR_TEST_STREAM=N, and says which, so that a failure on one draw
 * can be run again. */
static inline void rng_seed_suite(uint64_t seed) {
  const char *given = getenv("RUMOR_TEST_STREAM");
  uint64_t stream = given && *given ? strtoull(given, NULL, 10) : (uint64_t)clock_now_ns();
  rng_seed(&rng, seed, stream);
  /* On stderr, which ctest --output-on-failure shows when a test fails. */
  fprintf(stderr, "random inputs: RUMOR_TEST_STREAM=%llu draws them again\n", (unsigned long long)stream);
}

static inline float *rand_host(int64_t n, float scale) {
  float *p = xmalloc((size_t)n * sizeof *p);
  for (int64_t i = 0; i < n; i++) p[i] = (2.0f * rng_uniform(&rng) - 1.0f) * scale;
  return p;
}

static inline struct tensor dev_from(const float *h, int ndim, const int64_t *shape) {
  struct tensor t;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&t, be, TENSOR_F32, ndim, shape, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&t, 0, h, tensor_nbytes(&t));
  return t;
}

/* A tensor filled with NaN: an output element the op fails to write fails
 * the finiteness check. */
static inline struct tensor dev_nan(int ndim, const int64_t *shape) {
  struct tensor t;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&t, be, TENSOR_F32, ndim, shape, &e), 0, "%s", e.msg);
  tensor_fill(&t, NAN);
  return t;
}

static inline float *to_host(const struct tensor *t) {
  float *h = xmalloc(tensor_nbytes(t));
  tensor_copy_to_host(t, 0, h, tensor_nbytes(t));
  return h;
}

/* Asserts got ≈ ref element-wise and got finite; reports the worst element.
 * With --verbose, also logs the largest |got − ref| / (atol + rtol·|ref|)
 * (how much of the tolerance was used). */
static inline void expect_close(const char *what, const float *got, const float *ref, int64_t n, double atol, double rtol) {
  int64_t worst = -1;
  double worst_excess = 0, used = 0;
  for (int64_t i = 0; i < n; i++) {
    cr_assert(isfinite(got[i]), "%s: element %lld is %g (not finite; ref %g)", what, (long long)i, got[i], ref[i]);
    double err = fabs((double)got[i] - ref[i]), allowed = atol + rtol * fabs(ref[i]);
    double excess = err - allowed;
    if (allowed > 0 && err / allowed > used) used = err / allowed;
    if (excess > worst_excess) {
      worst_excess = excess;
      worst = i;
    }
  }
  cr_log_info("%s: %.3f of the tolerance used", what, used);
  cr_assert(worst < 0, "%s: worst element %lld of %lld: got %.9g ref %.9g (|diff| %.3g > atol %.1g + rtol %.1g·|ref|)",
            what, (long long)worst, (long long)n, worst >= 0 ? got[worst] : 0, worst >= 0 ? ref[worst] : 0,
            worst >= 0 ? fabs((double)got[worst] - ref[worst]) : 0, atol, rtol);
}

#endif
