/*
 * bench_apply — the training thread's share of one applied gossip exchange
 * on the CPU, before and after the difference of the snapshots moved to a
 * network worker (gossip_delta), in the same run:
 *
 *   before: the statistics pass (tensor_diff_stats of ours and theirs), the
 *           difference (axpby into the partner's buffer), the add (axpby
 *           into the parameters): all on the training thread;
 *   after:  the add alone on the training thread; gossip_delta (the
 *           difference and its statistics in one pass) on a network worker,
 *           printed beside it.
 *
 *   bench_apply [P ...] [--reps N]
 *
 * P defaults to 535818, 10844160 and 124439808 (the README job's MLP,
 * gpt:L6-H6-C384-T256-V256 and gpt2); N (repetitions) to 7.
 *
 * One thread (a peer's training thread; the CPU backend at 1 thread), best
 * of reps. Each rep first restores the partner's buffer (both paths
 * rewrite it), as a transfer would have just written it.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"
#include "tensor/tensor.h"

static double best(double a, double b) { return a < b ? a : b; }

static int bench(tensor_backend_t be, int64_t p, int reps) {
  struct rumor_err e;
  struct tensor params, sent, staging;
  if (tensor_alloc(&params, be, TENSOR_F32, 1, &p, &e) || tensor_alloc(&sent, be, TENSOR_F32, 1, &p, &e) ||
      tensor_alloc(&staging, be, TENSOR_F32, 1, &p, &e)) {
    fprintf(stderr, "bench_apply: %s\n", e.msg);
    return 1;
  }
  size_t bytes = (size_t)p * sizeof(float);
  float *theirs0 = malloc(bytes), *mine = sent.data, *theirs = staging.data, *x = params.data;
  if (!theirs0) {
    fprintf(stderr, "bench_apply: cannot allocate %zu bytes\n", bytes);
    return 1;
  }
  struct rng r;
  rng_seed(&r, 7, 0);
  for (int64_t i = 0; i < p; i++) {
    mine[i] = (float)(rng_uniform(&r) - 0.5);
    x[i] = mine[i] + 1e-3f;
    theirs0[i] = mine[i] + 1e-2f * (float)(rng_uniform(&r) - 0.5);
  }
  double t_before = 1e30, t_after = 1e30, t_delta = 1e30, sink = 0;
  for (int k = 0; k < reps; k++) {
    memcpy(theirs, theirs0, bytes);
    double t0 = clock_now_s();
    struct tensor_diff_stats ds;
    tensor_diff_stats(&sent, &staging, &ds);
    tensor_axpby(-1.0f, &sent, 1.0f, &staging);
    tensor_axpby(0.5f, &staging, 1.0f, &params);
    double t1 = clock_now_s();
    memcpy(theirs, theirs0, bytes);
    double t2 = clock_now_s();
    struct gossip_xch_delta d;
    gossip_delta(theirs, mine, (uint64_t)p, &d);
    double t3 = clock_now_s();
    tensor_axpby(0.5f, &staging, 1.0f, &params);
    double t4 = clock_now_s();
    t_before = best(t_before, t1 - t0);
    t_delta = best(t_delta, t3 - t2);
    t_after = best(t_after, t4 - t3);
    sink += ds.sq_dist - d.sq_dist + x[k];
  }
  printf("%12lld %10.0f %16.2f %15.2f %9.2f %20.2f\n", (long long)p, bytes / 1e6, t_before * 1e3, t_after * 1e3,
         t_before / t_after, t_delta * 1e3);
  if (sink == 12345.678) printf(" "); /* keeps the work observable */
  free(theirs0);
  tensor_free(&params), tensor_free(&sent), tensor_free(&staging);
  return 0;
}

int main(int argc, char **argv) {
  int64_t sizes[16];
  int n = 0, reps = 7;
  for (int i = 1; i < argc; i++) {
    if (strcmp(argv[i], "--reps") == 0 && i + 1 < argc) reps = atoi(argv[++i]);
    else if (n < 16 && atoll(argv[i]) > 0) sizes[n++] = atoll(argv[i]);
    else {
      fprintf(stderr, "usage: bench_apply [P>0 ...] [--reps N>0]\n");
      return 2;
    }
  }
  if (reps <= 0) {
    fprintf(stderr, "bench_apply: --reps must be positive\n");
    return 2;
  }
  if (n == 0) sizes[n++] = 535818, sizes[n++] = 10844160, sizes[n++] = 124439808;
  tensor_backend_t be;
  struct rumor_err e;
  if (tensor_backend_open("cpu", &be, &e)) {
    fprintf(stderr, "bench_apply: %s\n", e.msg);
    return 1;
  }
  tensor_backend_set_threads(be, 1);
  printf("training thread's share of one applied exchange, 1 thread, best of %d\n", reps);
  printf("%12s %10s %16s %15s %9s %20s\n", "parameters", "MB", "before (ms)", "after (ms)", "ratio",
         "worker's delta (ms)");
  for (int i = 0; i < n; i++)
    if (bench(be, sizes[i], reps)) return 1;
  tensor_backend_close(be);
  return 0;
}
