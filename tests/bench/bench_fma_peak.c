/* One core's measured FP32 fused multiply-add peak, in GFLOP/s: the
 * denominator of "fraction of peak" in bench-gpt.sh. Runs 16 independent
 * FMA chains (enough to cover the FMA latency times the FMA units of current
 * x86 cores) in the widest vector the CPU has (AVX-512, else AVX2+FMA), in
 * registers only, and prints one JSON line: {"isa":..., "gflops":...}.
 *
 *   bench_fma_peak [seconds]   (default 1; the best of 5 tries) */
#include <immintrin.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

static double now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

#define CHAINS 16

/* The 16 chains as separate variables (an array would live in memory and
 * chain each FMA through a store and a load). */
#define FMA16(fma, x, a, b)                                                                                  \
  x##0 = fma(x##0, a, b), x##1 = fma(x##1, a, b), x##2 = fma(x##2, a, b), x##3 = fma(x##3, a, b),             \
  x##4 = fma(x##4, a, b), x##5 = fma(x##5, a, b), x##6 = fma(x##6, a, b), x##7 = fma(x##7, a, b),             \
  x##8 = fma(x##8, a, b), x##9 = fma(x##9, a, b), x##10 = fma(x##10, a, b), x##11 = fma(x##11, a, b),         \
  x##12 = fma(x##12, a, b), x##13 = fma(x##13, a, b), x##14 = fma(x##14, a, b), x##15 = fma(x##15, a, b)
#define SUM16(add, x)                                                                                        \
  add(add(add(add(x##0, x##1), add(x##2, x##3)), add(add(x##4, x##5), add(x##6, x##7))),                    \
      add(add(add(x##8, x##9), add(x##10, x##11)), add(add(x##12, x##13), add(x##14, x##15))))

/* FMA flops of `iters` rounds over CHAINS vectors; the sum is returned so
 * the compiler keeps the work. */
__attribute__((target("avx512f"))) static float run512(long iters) {
  __m512 a = _mm512_set1_ps(0.999999f), b = _mm512_set1_ps(1e-7f);
  /* Distinct starting values: equal chains would be merged into one. */
#define S(k) _mm512_set1_ps((float)(k))
  __m512 v0 = S(0), v1 = S(1), v2 = S(2), v3 = S(3), v4 = S(4), v5 = S(5), v6 = S(6), v7 = S(7), v8 = S(8), v9 = S(9),
         v10 = S(10), v11 = S(11), v12 = S(12), v13 = S(13), v14 = S(14), v15 = S(15);
#undef S
  for (long i = 0; i < iters; i++) FMA16(_mm512_fmadd_ps, v, a, b);
  return _mm512_reduce_add_ps(SUM16(_mm512_add_ps, v));
}

__attribute__((target("avx2,fma"))) static float run256(long iters) {
  __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
#define S(k) _mm256_set1_ps((float)(k))
  __m256 v0 = S(0), v1 = S(1), v2 = S(2), v3 = S(3), v4 = S(4), v5 = S(5), v6 = S(6), v7 = S(7), v8 = S(8), v9 = S(9),
         v10 = S(10), v11 = S(11), v12 = S(12), v13 = S(13), v14 = S(14), v15 = S(15);
#undef S
  for (long i = 0; i < iters; i++) FMA16(_mm256_fmadd_ps, v, a, b);
  float out[8], s = 0;
  _mm256_storeu_ps(out, SUM16(_mm256_add_ps, v));
  for (int k = 0; k < 8; k++) s += out[k];
  return s;
}

int main(int argc, char **argv) {
  double secs = argc > 1 ? atof(argv[1]) : 1.0;
  __builtin_cpu_init();
  int wide = __builtin_cpu_supports("avx512f");
  if (!wide && !(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))) {
    fprintf(stderr, "bench_fma_peak: the CPU has neither AVX-512 nor AVX2+FMA\n");
    return 1;
  }
  int lanes = wide ? 16 : 8;
  long iters = 1000000;
  double best = 0, sink = 0;
  for (int t = 0; t < 5; t++) {
    double t0 = now(), el;
    do {
      sink += wide ? run512(iters) : run256(iters);
      el = now() - t0;
      if (el < secs / 10) iters *= 2;
    } while (el < secs / 10);
    t0 = now();
    sink += wide ? run512(iters) : run256(iters);
    el = now() - t0;
    double gflops = 2.0 * CHAINS * lanes * (double)iters / el / 1e9;
    if (gflops > best) best = gflops;
  }
  printf("{\"isa\":\"%s\",\"gflops\":%.1f,\"sink\":%g}\n", wide ? "avx512" : "avx2", best, sink > 0 ? 1.0 : 0.0);
  return 0;
}
