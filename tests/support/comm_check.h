/*
 * comm_check.h — what the communicator's tests share: members as threads
 * (one per communicator, whatever its transport), each member's inputs as a
 * function of (member, index), the double-precision references, and the
 * checks that name the worst element.
 *
 * Header-only (static inline functions). Include after criterion.h and
 * peer/group/comm.h. Assertions run on the test's main thread only: member
 * threads record what they saw and the main thread checks it.
 */
#ifndef RUMOR_TESTS_COMM_CHECK_H
#define RUMOR_TESTS_COMM_CHECK_H

#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Tolerance of a float sum of at most 5 members' values in [-1, 1] against
 * the double reference: |got − ref| ≤ COMM_ATOL + COMM_RTOL·|ref|. */
#define COMM_ATOL 1e-5
#define COMM_RTOL 1e-5
#define COMM_TEST_MAX 8

struct member {
  comm_t *c;
  int rank, size;
  void *ctx;          /* the test's */
  int rc;             /* what the member's collectives returned (first failure) */
  struct rumor_err e;
  float *out;         /* a result the main thread checks; freed by member_run's caller */
  int64_t out_n;
  char bad[512];      /* a check that failed on the member's thread */
};

typedef void (*member_fn)(struct member *m);

struct member_thread {
  struct member *m;
  member_fn fn;
};

static void *member_main(void *arg) {
  struct member_thread *t = arg;
  t->fn(t->m);
  return NULL;
}

/* Runs fn once per communicator, each on its own thread, and waits for all. */
static inline void members_run(comm_t **comms, int size, member_fn fn, void *ctx, struct member *ms) {
  pthread_t th[COMM_TEST_MAX];
  struct member_thread mt[COMM_TEST_MAX];
  for (int r = 0; r < size; r++) {
    ms[r] = (struct member){.c = comms[r], .rank = r, .size = size, .ctx = ctx};
    mt[r] = (struct member_thread){.m = &ms[r], .fn = fn};
    cr_assert_eq(pthread_create(&th[r], NULL, member_main, &mt[r]), 0);
  }
  for (int r = 0; r < size; r++) pthread_join(th[r], NULL);
}

/* Member r's input value i: in [-1, 1), different for every (r, i). */
static inline float comm_input(int r, int64_t i) {
  uint64_t x = (uint64_t)i * 0x9e3779b97f4a7c15ull + (uint64_t)(r + 1) * 0xbf58476d1ce4e5b9ull;
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return (float)((double)(x >> 40) / (double)(1ull << 23) - 1.0);
}

static inline void comm_fill(float *buf, int r, int64_t off, int64_t n) {
  for (int64_t i = 0; i < n; i++) buf[i] = comm_input(r, off + i);
}

/* Σ over members of comm_input(member, i), in double. */
static inline double comm_ref(int size, int64_t i) {
  double s = 0;
  for (int r = 0; r < size; r++) s += comm_input(r, i);
  return s;
}

/* Checks got[0..n) against the reference sum of elements off.. within the
 * tolerance; writes the worst element into `bad` (empty when all pass). */
static inline void comm_check_sum(const float *got, int size, int64_t off, int64_t n, char *bad, size_t cap) {
  double worst = -1;
  int64_t at = -1;
  for (int64_t i = 0; i < n; i++) {
    double ref = comm_ref(size, off + i), err = fabs((double)got[i] - ref);
    double ratio = err / (COMM_ATOL + COMM_RTOL * fabs(ref));
    if (!isfinite(got[i])) ratio = INFINITY;
    if (ratio > worst) worst = ratio, at = i;
  }
  if (worst > 1.0 && !bad[0])
    snprintf(bad, cap, "element %lld: %.9g, reference %.9g (%.2f x the tolerance)", (long long)(off + at),
             (double)got[at], comm_ref(size, off + at), worst);
}

#endif /* RUMOR_TESTS_COMM_CHECK_H */
