/*
 * bench_sketch — the cost of a peer's drift figures: the count-sketch (and
 * the squared norm) of P parameters on the CPU, against memcpy of the same
 * buffer in the same run. Target (issue #5): a sketch costs at most about
 * two passes over memory. Two references are printed: memcpy (one read and
 * one write of every byte) and the squared norm (one read pass); the target
 * is met when sketch/memcpy is about 1 or less, i.e. sketch/sq_norm ≤ 2.
 *
 *   bench_sketch [P (default 100000000)] [K (default 1024)] [reps (default 5)]
 *
 * Each figure is the best of `reps` runs, with 1 thread and with every core
 * (memcpy split across threads by hand).
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensor/tensor.h"

struct part {
  char *dst;
  const char *src;
  size_t n;
};

static void *copy_part(void *arg) {
  struct part *p = arg;
  memcpy(p->dst, p->src, p->n);
  return NULL;
}

static void par_memcpy(void *dst, const void *src, size_t n, int t) {
  pthread_t th[64];
  struct part parts[64];
  size_t chunk = (n + (size_t)t - 1) / (size_t)t;
  for (int i = 0; i < t; i++) {
    size_t lo = (size_t)i * chunk, hi = lo + chunk < n ? lo + chunk : n;
    parts[i] = (struct part){(char *)dst + lo, (const char *)src + lo, hi > lo ? hi - lo : 0};
    if (i) pthread_create(&th[i], NULL, copy_part, &parts[i]);
  }
  copy_part(&parts[0]);
  for (int i = 1; i < t; i++) pthread_join(th[i], NULL);
}

int main(int argc, char **argv) {
  int64_t p = argc > 1 ? atoll(argv[1]) : 100000000;
  int k = argc > 2 ? atoi(argv[2]) : 1024;
  int reps = argc > 3 ? atoi(argv[3]) : 5;
  if (p <= 0 || k <= 0 || (k & (k - 1)) || reps <= 0) {
    fprintf(stderr, "usage: bench_sketch [P>0] [K, a power of two] [reps>0]\n");
    return 2;
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int tmax = cores > 64 ? 64 : cores < 1 ? 1 : (int)cores;
  tensor_backend_t be;
  struct rumor_err e;
  if (tensor_backend_open("cpu", &be, &e)) {
    fprintf(stderr, "bench_sketch: %s\n", e.msg);
    return 1;
  }
  struct tensor x;
  if (tensor_alloc(&x, be, TENSOR_F32, 1, &p, &e)) {
    fprintf(stderr, "bench_sketch: %s\n", e.msg);
    return 1;
  }
  size_t bytes = (size_t)p * sizeof(float);
  float *host = x.data; /* the CPU backend's data is host memory */
  struct rng r;
  rng_seed(&r, 1, 0);
  for (int64_t i = 0; i < p; i++) host[i] = (float)(rng_uniform(&r) - 0.5);
  float *dst = malloc(bytes);
  if (!dst) {
    fprintf(stderr, "bench_sketch: cannot allocate %zu bytes\n", bytes);
    return 1;
  }
  memset(dst, 0, bytes); /* fault the pages in before timing */
  double *sk = calloc((size_t)k, sizeof *sk);

  printf("count-sketch of %lld float32 parameters (%.0f MB), k=%d, best of %d\n", (long long)p, bytes / 1e6, k, reps);
  printf("%-8s %12s %12s %12s %14s %15s %12s\n", "threads", "memcpy ms", "sketch ms", "sq_norm ms", "sketch/memcpy",
         "sketch/sq_norm", "sketch GB/s");
  int counts[2] = {1, tmax};
  for (int c = 0; c < (tmax > 1 ? 2 : 1); c++) {
    int t = counts[c];
    tensor_backend_set_threads(be, t);
    double best_cp = 1e30, best_sk = 1e30, best_sq = 1e30, sink = 0;
    for (int i = 0; i < reps; i++) {
      double t0 = clock_now_s();
      par_memcpy(dst, host, bytes, t);
      double t1 = clock_now_s();
      tensor_count_sketch(&x, 0x1234567890abcdefull, k, sk);
      double t2 = clock_now_s();
      sink += tensor_sq_norm(&x);
      double t3 = clock_now_s();
      best_cp = t1 - t0 < best_cp ? t1 - t0 : best_cp;
      best_sk = t2 - t1 < best_sk ? t2 - t1 : best_sk;
      best_sq = t3 - t2 < best_sq ? t3 - t2 : best_sq;
      sink += sk[0] + dst[i];
    }
    printf("%-8d %12.1f %12.1f %12.1f %14.2f %15.2f %12.2f\n", t, best_cp * 1e3, best_sk * 1e3, best_sq * 1e3,
           best_sk / best_cp, best_sk / best_sq, bytes / best_sk / 1e9);
    if (sink == 12345.678) printf(" "); /* keeps the work observable */
  }
  printf("target: at most about two passes over memory: sketch/memcpy <= ~1 (memcpy reads and writes every byte),\n"
         "        sketch/sq_norm <= 2 (sq_norm reads every byte once)\n");
  free(sk);
  free(dst);
  tensor_free(&x);
  tensor_backend_close(be);
  return 0;
}
