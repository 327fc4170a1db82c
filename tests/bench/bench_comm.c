/* The group communicator's all-reduce over the net transport (members as
 * threads of this process, each with its own loop, on 127.0.0.1: every
 * byte encrypted and authenticated), for 2 and 4 members at 1 MiB and
 * 64 MiB, beside this machine's memcpy bandwidth as the reference.
 *
 *   bench_comm [--quick]
 *
 * Prints one line per case: algorithm bandwidth (buffer bytes / time), bus
 * bandwidth (what each member moves: 2(P − 1)/P of that, as NCCL counts it)
 * and the bus bandwidth's ratio to memcpy. --quick runs one iteration per
 * case (a smoke test). Figures and how to read them: docs/benchmarks.md. */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/group/comm.h"

#define MAX_P 4

struct run {
  comm_t *c;
  int64_t n;
  int iters;
  double seconds; /* member 0's: from a barrier to the last all-reduce's end */
  int rc;
  struct rumor_err e;
};

static void *member_main(void *arg) {
  struct run *r = arg;
  float *buf = xmalloc((size_t)r->n * sizeof(float));
  for (int64_t i = 0; i < r->n; i++) buf[i] = (float)(i % 1000) * 1e-3f;
  int rc = comm_wait_ready(r->c, &r->e);
  if (!rc) rc = comm_all_reduce(r->c, buf, r->n, &r->e); /* warm-up: buffers, connections */
  if (!rc) rc = comm_barrier(r->c, &r->e);
  double t0 = clock_now_s();
  for (int k = 0; k < r->iters && !rc; k++) rc = comm_all_reduce(r->c, buf, r->n, &r->e);
  if (!rc) rc = comm_barrier(r->c, &r->e);
  r->seconds = clock_now_s() - t0;
  r->rc = rc;
  free(buf);
  return NULL;
}

/* Seconds per all-reduce of n floats among p members, or a negative value. */
static double time_all_reduce(int p, int64_t n, int iters, const struct net_identity *id, const uint8_t *key) {
  comm_t *c[MAX_P];
  char addrs[MAX_P][64];
  const char *a[MAX_P];
  for (int r = 0; r < p; r++) {
    struct comm_net_config cfg = {.identity = id, .cluster_key = key, .group = "bench", .agreement = "bench",
                                  .rank = r, .size = p, .listen = "127.0.0.1:0", .peers = a,
                                  .connect_timeout_ms = 10000};
    struct rumor_err e;
    if (comm_net_start(&c[r], &cfg, &e)) {
      fprintf(stderr, "bench_comm: member %d: %s\n", r, e.msg);
      exit(1);
    }
    snprintf(addrs[r], sizeof addrs[r], "%s", comm_net_address(c[r]));
    a[r] = addrs[r];
  }
  struct run runs[MAX_P] = {0};
  pthread_t th[MAX_P];
  for (int r = 0; r < p; r++) {
    runs[r] = (struct run){.c = c[r], .n = n, .iters = iters};
    pthread_create(&th[r], NULL, member_main, &runs[r]);
  }
  for (int r = 0; r < p; r++) pthread_join(th[r], NULL);
  double s = runs[0].seconds / iters;
  for (int r = 0; r < p; r++) {
    if (runs[r].rc) {
      fprintf(stderr, "bench_comm: member %d: %s\n", r, runs[r].e.msg);
      s = -1;
    }
  }
  for (int r = 0; r < p; r++) comm_free(c[r], 2000);
  return s;
}

/* memcpy bandwidth (bytes copied per second) over a 64 MiB buffer. */
static double memcpy_bandwidth(void) {
  size_t bytes = 64u << 20;
  char *a = xmalloc(bytes), *b = xmalloc(bytes);
  memset(a, 1, bytes);
  memset(b, 2, bytes);
  memcpy(b, a, bytes); /* warm-up */
  int iters = 10;
  double t0 = clock_now_s();
  for (int k = 0; k < iters; k++) {
    a[k] = (char)k;
    memcpy(b, a, bytes);
  }
  double s = clock_now_s() - t0;
  volatile char sink = b[iters / 2];
  (void)sink;
  free(a);
  free(b);
  return (double)bytes * iters / s;
}

int main(int argc, char **argv) {
  bool quick = argc > 1 && strcmp(argv[1], "--quick") == 0;
  log_set_level(LOG_WARN);
  struct net_identity id;
  uint8_t key[NET_CLUSTER_KEY_BYTES];
  if (net_identity_generate(&id) || net_cluster_key_generate(key)) {
    fprintf(stderr, "bench_comm: cannot make keys\n");
    return 1;
  }
  double mc = memcpy_bandwidth();
  printf("memcpy: %.2f GB/s (64 MiB buffers)\n", mc / 1e9);
  const int ps[] = {2, 4};
  const int64_t mib[] = {1, 64};
  for (size_t i = 0; i < sizeof ps / sizeof ps[0]; i++)
    for (size_t k = 0; k < sizeof mib / sizeof mib[0]; k++) {
      int64_t n = mib[k] << 20 >> 2;
      int iters = quick ? 1 : mib[k] == 1 ? 20 : 3;
      double s = time_all_reduce(ps[i], n, iters, &id, key);
      if (s < 0) return 1;
      double alg = (double)n * sizeof(float) / s, bus = alg * 2.0 * (ps[i] - 1) / ps[i];
      printf("all_reduce net P=%d %3lld MiB: %8.2f ms  alg %.3f GB/s  bus %.3f GB/s  bus/memcpy %.3f\n", ps[i],
             (long long)mib[k], s * 1e3, alg / 1e9, bus / 1e9, bus / mc);
    }
  net_identity_wipe(&id);
  return 0;
}
