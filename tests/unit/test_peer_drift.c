/* Consensus drift: the CPU count-sketch against a plain loop, and the
 * sketch estimate of Ξ = sqrt((1/n) Σ‖θᵢ − θ̄‖²) against the exact value on
 * random replicas (P = 10⁶, n = 8, within 10 %), as `rumor top` computes
 * them (gossip/drift.h). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/drift.h"
#include "tensor/tensor.h"

enum { K = 1024 };

static tensor_backend_t be;
static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  tensor_backend_set_threads(be, 2);
}
static void teardown(void) { tensor_backend_close(be); }
TestSuite(drift, .init = setup, .fini = teardown, .timeout = 120);

static double gauss(struct rng *r) {
  double u = rng_uniform(r), v = rng_uniform(r);
  return sqrt(-2 * log(u > 1e-300 ? u : 1e-300)) * cos(2 * M_PI * v);
}

/* The sketch of host floats made by the CPU backend. */
static void sketch_of(const float *x, int64_t p, uint64_t seed, int k, double *out) {
  struct tensor t;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&t, be, TENSOR_F32, 1, &p, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&t, 0, x, (size_t)p * sizeof *x);
  tensor_count_sketch(&t, seed, k, out);
  tensor_free(&t);
}

Test(drift, cpu_count_sketch_matches_a_plain_loop) {
  struct rng r;
  rng_seed(&r, 3, 0);
  /* Not a multiple of any vector width; an index above 2^32 is covered by
   * the hash tests, here the plain definition. */
  const int64_t p = 1000003; /* large enough for the threaded path */
  float *x = xmalloc((size_t)p * sizeof *x);
  for (int64_t i = 0; i < p; i++) x[i] = (float)gauss(&r);
  for (int k = 1; k <= 1 << 16; k *= 4) {
    double *got = xcalloc((size_t)k, sizeof *got), *want = xcalloc((size_t)k, sizeof *want);
    for (int j = 0; j < k; j++) got[j] = NAN; /* overwritten, not accumulated */
    const uint64_t seed = 0x9e3779b97f4a7c15ull + (uint64_t)k;
    sketch_of(x, p, seed, k, got);
    /* the definition in tensor.h, written out */
    for (int64_t i = 0; i < p; i++) {
      uint32_t h = tensor_sketch_hash(seed, (uint64_t)i >> 3), lane = (uint32_t)i & 7;
      uint32_t b = (((h >> 8) << 3) | lane) & (uint32_t)(k - 1);
      want[b] += ((h >> lane) & 1) ? -(double)x[i] : (double)x[i];
    }
    for (int j = 0; j < k; j++)
      cr_assert(fabs(got[j] - want[j]) <= 1e-6 * (1 + fabs(want[j])), "k=%d bucket %d: %.9g, plain loop %.9g", k, j,
                got[j], want[j]);
    free(got);
    free(want);
  }
  free(x);
}

/* n replicas θᵢ = base + σ·(independent noise) + shared·(a common direction
 * scaled per replica): the sketch Ξ is within 10 % of the exact Ξ. */
static void check_estimate(uint64_t seed, double sigma, double shared) {
  enum { N = 8 };
  const int64_t p = 1000000;
  struct rng r;
  rng_seed(&r, seed, 1);
  float *base = xmalloc((size_t)p * sizeof *base), *dir = xmalloc((size_t)p * sizeof *dir);
  for (int64_t i = 0; i < p; i++) {
    base[i] = (float)(0.05 * gauss(&r));
    dir[i] = (float)gauss(&r);
  }
  float *theta[N];
  double *sk[N], norms[N];
  for (int n = 0; n < N; n++) {
    theta[n] = xmalloc((size_t)p * sizeof *theta[n]);
    double coef = shared * gauss(&r);
    for (int64_t i = 0; i < p; i++) theta[n][i] = base[i] + (float)(sigma * gauss(&r) + coef * dir[i]);
    sk[n] = xmalloc(K * sizeof *sk[n]);
    sketch_of(theta[n], p, seed * 7919 + 1, K, sk[n]);
    double s = 0;
    for (int64_t i = 0; i < p; i++) s += (double)theta[n][i] * theta[n][i];
    norms[n] = sqrt(s);
  }
  double exact = drift_exact((const float *const *)theta, N, (uint64_t)p);
  double est = drift_from_sketches((const double *const *)sk, N, K);
  cr_assert(exact > 0);
  cr_assert(fabs(est / exact - 1) <= 0.10, "seed %llu σ=%g shared=%g: sketch Ξ %.6g, exact Ξ %.6g (%.1f%% off)",
            (unsigned long long)seed, sigma, shared, est, exact, 100 * (est / exact - 1));

  /* ‖θ̄‖ from the norms and Ξ equals the norm of the mean. */
  double mean_sq = 0;
  for (int64_t i = 0; i < p; i++) {
    double m = 0;
    for (int n = 0; n < N; n++) m += theta[n][i];
    m /= N;
    mean_sq += m * m;
  }
  double mn = drift_mean_norm(norms, N, exact);
  cr_assert(fabs(mn - sqrt(mean_sq)) <= 1e-6 * sqrt(mean_sq), "‖θ̄‖ %.9g, direct %.9g", mn, sqrt(mean_sq));
  for (int n = 0; n < N; n++) {
    free(theta[n]);
    free(sk[n]);
  }
  free(base);
  free(dir);
}

Test(drift, sketch_estimate_within_10_percent_of_exact_independent_noise) {
  check_estimate(1, 1e-3, 0);
  check_estimate(2, 1e-2, 0);
}

/* Replicas that differ mostly along one direction: the estimate then rests
 * on one vector's sketch, its worst case (relative error about sqrt(1/k)). */
Test(drift, sketch_estimate_within_10_percent_of_exact_low_rank_drift) {
  check_estimate(3, 1e-4, 1e-2);
  check_estimate(4, 0, 1e-3);
}

Test(drift, identical_replicas_have_zero_drift_and_one_replica_none) {
  double a[K], b[K];
  for (int j = 0; j < K; j++) a[j] = b[j] = sin(j);
  const double *two[] = {a, b};
  cr_assert_eq(drift_from_sketches(two, 2, K), 0.0);
  cr_assert(isnan(drift_from_sketches(two, 0, K)));
  float x[3] = {1, 2, 3};
  const float *one[] = {x};
  cr_assert_eq(drift_exact(one, 1, 3), 0.0);
  cr_assert(isnan(drift_exact(one, 0, 3)));
}
