/* The group communicator's collectives over the in-process transport, with
 * 1 to 5 members as threads: all-reduce equals a double-precision reference
 * within a stated tolerance and is bit-identical on every member, at every
 * size class (empty, tiny, fewer floats than members, just under and over
 * the direct/ring threshold, above 1 Mi floats); reduce-scatter and
 * all-gather with uneven and zero counts; all-to-all with random counts;
 * broadcast (direct and chained); barrier; sub-communicators running beside
 * their parent on other threads; a collective mismatch fails every member
 * with RUMOR_EPROTO naming both sides; an abort or a member that leaves
 * fails the others naming it; a waiting member runs its idle function
 * (comm_set_idle). */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "peer/group/comm.h"

#include "../support/comm_check.h"

#define DIRECT_FLOATS (COMM_DIRECT_MAX_BYTES / (int64_t)sizeof(float)) /* largest direct all-reduce */

static void local_run(int size, member_fn fn, void *ctx, struct member *ms) {
  comm_t *comms[COMM_TEST_MAX];
  comm_local_create(size, comms);
  members_run(comms, size, fn, ctx, ms);
  for (int r = 0; r < size; r++) comm_free(comms[r], 0);
}

static void note(struct member *m, int rc) {
  if (rc && !m->rc) m->rc = rc;
}

/* ---- all-reduce ---- */

static void all_reduce_member(struct member *m) {
  int64_t n = *(const int64_t *)m->ctx;
  m->out = xmalloc((size_t)(n ? n : 1) * sizeof(float));
  m->out_n = n;
  comm_fill(m->out, m->rank, 0, n);
  note(m, comm_all_reduce(m->c, m->out, n, &m->e));
}

/* Every member's result matches the reference and member 0's, bit for bit. */
static void check_all_reduce(int size, int64_t n) {
  struct member ms[COMM_TEST_MAX];
  local_run(size, all_reduce_member, &n, ms);
  for (int r = 0; r < size; r++) {
    cr_assert_eq(ms[r].rc, 0, "size %d n %lld member %d: %s", size, (long long)n, r, ms[r].e.msg);
    comm_check_sum(ms[r].out, size, 0, n, ms[r].bad, sizeof ms[r].bad);
    cr_assert(!ms[r].bad[0], "size %d n %lld member %d: %s", size, (long long)n, r, ms[r].bad);
    cr_assert(memcmp(ms[r].out, ms[0].out, (size_t)n * sizeof(float)) == 0,
              "size %d n %lld: member %d's result differs from member 0's", size, (long long)n, r);
  }
  for (int r = 0; r < size; r++) free(ms[r].out);
}

Test(comm_all_reduce, matches_reference_and_is_identical_at_every_size_class) {
  for (int size = 1; size <= 5; size++) {
    int64_t ns[] = {0, 1, 7, 1000, size - 1, DIRECT_FLOATS - 1, DIRECT_FLOATS, DIRECT_FLOATS + 1, (1 << 20) + 3};
    for (size_t k = 0; k < sizeof ns / sizeof ns[0]; k++) check_all_reduce(size, ns[k]);
  }
}

/* Sum in member order: the direct result is exactly ((x0 + x1) + x2) + ...
 * computed in float, whichever member computes it. */
static void sum_order_member(struct member *m) {
  m->out = xmalloc(3 * sizeof(float));
  const float v[4][3] = {{1e8f, 1.0f, -1.0f}, {-1e8f, 1e-8f, 3.0f}, {1.0f, 0.5f, 1e8f}, {0.25f, 2.0f, -1e8f}};
  memcpy(m->out, v[m->rank], sizeof v[0]);
  note(m, comm_all_reduce(m->c, m->out, 3, &m->e));
}

Test(comm_all_reduce, direct_sums_in_member_order) {
  struct member ms[4];
  local_run(4, sum_order_member, NULL, ms);
  const float v[4][3] = {{1e8f, 1.0f, -1.0f}, {-1e8f, 1e-8f, 3.0f}, {1.0f, 0.5f, 1e8f}, {0.25f, 2.0f, -1e8f}};
  for (int i = 0; i < 3; i++) {
    volatile float want = v[0][i];
    for (int r = 1; r < 4; r++) want += v[r][i];
    for (int r = 0; r < 4; r++) {
      cr_assert_eq(ms[r].rc, 0, "%s", ms[r].e.msg);
      cr_assert(memcmp(&ms[r].out[i], (const float *)&want, sizeof(float)) == 0,
                "element %d on member %d: %.9g, want %.9g", i, r, (double)ms[r].out[i], (double)want);
    }
  }
  for (int r = 0; r < 4; r++) free(ms[r].out);
}

/* ---- reduce-scatter and all-gather with explicit counts ---- */

struct counts_ctx {
  int64_t counts[COMM_TEST_MAX];
  int64_t total;
};

static void rs_ag_member(struct member *m) {
  const struct counts_ctx *k = m->ctx;
  int64_t off = 0;
  for (int i = 0; i < m->rank; i++) off += k->counts[i];
  float *buf = xmalloc((size_t)(k->total + 1) * sizeof(float));
  comm_fill(buf, m->rank, 0, k->total);
  int rc = comm_reduce_scatter_v(m->c, buf, k->counts, &m->e);
  if (!rc) comm_check_sum(buf + off, m->size, off, k->counts[m->rank], m->bad, sizeof m->bad);
  /* Own chunk kept, the rest poisoned: the gather must fill it all. */
  for (int64_t i = 0; i < k->total; i++)
    if (i < off || i >= off + k->counts[m->rank]) buf[i] = NAN;
  if (!rc) rc = comm_all_gather_v(m->c, buf, k->counts, &m->e);
  note(m, rc);
  m->out = buf;
  m->out_n = k->total;
}

static void check_rs_ag(int size, const int64_t *counts) {
  struct counts_ctx k = {.total = 0};
  for (int i = 0; i < size; i++) k.total += k.counts[i] = counts[i];
  struct member ms[COMM_TEST_MAX];
  local_run(size, rs_ag_member, &k, ms);
  for (int r = 0; r < size; r++) {
    cr_assert_eq(ms[r].rc, 0, "size %d member %d: %s", size, r, ms[r].e.msg);
    cr_assert(!ms[r].bad[0], "size %d member %d reduce_scatter: %s", size, r, ms[r].bad);
    comm_check_sum(ms[r].out, size, 0, k.total, ms[r].bad, sizeof ms[r].bad);
    cr_assert(!ms[r].bad[0], "size %d member %d all_gather: %s", size, r, ms[r].bad);
    cr_assert(memcmp(ms[r].out, ms[0].out, (size_t)k.total * sizeof(float)) == 0, "size %d: member %d differs", size, r);
  }
  for (int r = 0; r < size; r++) free(ms[r].out);
}

Test(comm_reduce_scatter, uneven_and_zero_counts_direct_and_ring) {
  for (int size = 1; size <= 5; size++) {
    int64_t small[COMM_TEST_MAX], large[COMM_TEST_MAX], zeros[COMM_TEST_MAX] = {0};
    for (int i = 0; i < size; i++) {
      small[i] = (i * 7 + 3) % 5;                         /* 3, 0, 2, 4, 1: a zero in the middle */
      large[i] = i == 1 ? 0 : DIRECT_FLOATS + 1000 * i + 1; /* above the threshold: the ring */
    }
    check_rs_ag(size, small);
    check_rs_ag(size, large);
    check_rs_ag(size, zeros);
  }
}

struct even_ctx {
  int64_t n;
};

static void even_member(struct member *m) {
  int64_t n = ((const struct even_ctx *)m->ctx)->n, lo, hi;
  comm_chunk(n, m->size, m->rank, &lo, &hi);
  float *buf = xmalloc((size_t)(n + 1) * sizeof(float));
  comm_fill(buf, m->rank, 0, n);
  int rc = comm_reduce_scatter(m->c, buf, n, &m->e);
  if (!rc) comm_check_sum(buf + lo, m->size, lo, hi - lo, m->bad, sizeof m->bad);
  if (!rc) rc = comm_all_gather(m->c, buf, n, &m->e);
  note(m, rc);
  m->out = buf;
}

Test(comm_reduce_scatter, even_cut_follows_comm_chunk) {
  int64_t lo, hi, sum = 0;
  for (int r = 0; r < 5; r++) {
    comm_chunk(13, 5, r, &lo, &hi);
    cr_assert_eq(lo, sum);
    cr_assert_eq(hi - lo, r < 3 ? 3 : 2, "chunk %d of 13 floats in 5: %lld", r, (long long)(hi - lo));
    sum = hi;
  }
  cr_assert_eq(sum, 13);
  struct even_ctx k = {.n = 1001};
  struct member ms[3];
  local_run(3, even_member, &k, ms);
  for (int r = 0; r < 3; r++) {
    cr_assert_eq(ms[r].rc, 0, "%s", ms[r].e.msg);
    cr_assert(!ms[r].bad[0], "member %d: %s", r, ms[r].bad);
    comm_check_sum(ms[r].out, 3, 0, k.n, ms[r].bad, sizeof ms[r].bad);
    cr_assert(!ms[r].bad[0], "member %d gather: %s", r, ms[r].bad);
    free(ms[r].out);
  }
}

/* ---- all-to-all ---- */

struct a2a_ctx {
  int64_t cnt[COMM_TEST_MAX][COMM_TEST_MAX]; /* cnt[i][j]: floats member i sends member j */
};

static float a2a_value(int from, int to, int64_t k) { return (float)(from * 1000000 + to * 10000) + (float)k; }

static void a2a_member(struct member *m) {
  const struct a2a_ctx *k = m->ctx;
  int r = m->rank, P = m->size;
  int64_t sc[COMM_TEST_MAX], rc_[COMM_TEST_MAX], st = 0, rt = 0;
  for (int j = 0; j < P; j++) st += sc[j] = k->cnt[r][j], rt += rc_[j] = k->cnt[j][r];
  float *send = xmalloc((size_t)(st + 1) * sizeof(float)), *recv = xmalloc((size_t)(rt + 1) * sizeof(float));
  for (int j = 0, o = 0; j < P; j++)
    for (int64_t q = 0; q < sc[j]; q++) send[o++] = a2a_value(r, j, q);
  note(m, comm_all_to_all(m->c, send, sc, recv, rc_, &m->e));
  for (int j = 0, o = 0; j < P && !m->rc; j++)
    for (int64_t q = 0; q < rc_[j]; q++, o++)
      if (recv[o] != a2a_value(j, r, q) && !m->bad[0])
        snprintf(m->bad, sizeof m->bad, "run from %d, element %lld: %g", j, (long long)q, (double)recv[o]);
  free(send);
  free(recv);
}

Test(comm_all_to_all, random_counts_arrive_in_order) {
  struct rng g;
  rng_seed(&g, 31, 1);
  for (int size = 1; size <= 5; size++)
    for (int round = 0; round < 3; round++) {
      struct a2a_ctx k;
      for (int i = 0; i < size; i++)
        for (int j = 0; j < size; j++)
          k.cnt[i][j] = rng_below(&g, 4) == 0 ? 0 : (int64_t)rng_below(&g, round == 2 ? 40000 : 50);
      struct member ms[COMM_TEST_MAX];
      local_run(size, a2a_member, &k, ms);
      for (int r = 0; r < size; r++) {
        cr_assert_eq(ms[r].rc, 0, "size %d member %d: %s", size, r, ms[r].e.msg);
        cr_assert(!ms[r].bad[0], "size %d member %d: %s", size, r, ms[r].bad);
      }
    }
}

/* comm_gather_v: member r sends r + 3 floats (member 2 none), only the
 * root receives, in member order. */
static int64_t gather_count(int r) { return r == 2 ? 0 : r + 3; }

static void gather_member(struct member *m) {
  int root = *(const int *)m->ctx, r = m->rank;
  int64_t counts[COMM_TEST_MAX], total = 0, n = gather_count(r);
  for (int j = 0; j < m->size; j++) total += counts[j] = gather_count(j);
  float send[8] = {0}, *recv = r == root ? xmalloc((size_t)(total + 1) * sizeof(float)) : NULL;
  for (int64_t q = 0; q < n; q++) send[q] = a2a_value(r, root, q);
  note(m, comm_gather_v(m->c, root, send, n, recv, r == root ? counts : NULL, &m->e));
  for (int j = 0, o = 0; recv && j < m->size && !m->rc; j++)
    for (int64_t q = 0; q < counts[j]; q++, o++)
      if (recv[o] != a2a_value(j, root, q) && !m->bad[0])
        snprintf(m->bad, sizeof m->bad, "from %d, element %lld: %g", j, (long long)q, (double)recv[o]);
  free(recv);
}

Test(comm_gather, only_the_root_receives_every_members_run_in_order) {
  for (int size = 1; size <= 5; size++)
    for (int root = 0; root < size; root += size > 2 ? 2 : 1) {
      struct member ms[COMM_TEST_MAX];
      local_run(size, gather_member, &root, ms);
      for (int r = 0; r < size; r++) {
        cr_assert_eq(ms[r].rc, 0, "size %d root %d member %d: %s", size, root, r, ms[r].e.msg);
        cr_assert(!ms[r].bad[0], "size %d root %d member %d: %s", size, root, r, ms[r].bad);
      }
    }
}

/* ---- broadcast and barrier ---- */

/* ---- idle work while waiting ---- */

static void count_idle(void *arg) { (*(int *)arg)++; }

/* Member 0 waits in an all-reduce for member 1, which comes 100 ms late:
 * its idle function runs meanwhile, on its own thread; once unset, a
 * second wait runs none. */
static void idle_member(struct member *m) {
  int *calls = (int *)m->ctx + m->rank, second;
  float v = 1.0f;
  if (m->rank == 0) comm_set_idle(m->c, count_idle, calls);
  else usleep(100 * 1000);
  note(m, comm_all_reduce(m->c, &v, 1, &m->e));
  if (v != 2.0f) snprintf(m->bad, sizeof m->bad, "the sum is %g", v);
  if (m->rank == 0) comm_set_idle(m->c, NULL, NULL);
  second = *calls;
  if (m->rank == 1) usleep(50 * 1000);
  note(m, comm_barrier(m->c, &m->e));
  if (m->rank == 0 && *calls != second) snprintf(m->bad, sizeof m->bad, "idle ran %d times once unset", *calls - second);
}

Test(comm_idle, runs_while_a_member_waits_and_not_once_unset) {
  int calls[2] = {0, 0};
  struct member ms[COMM_TEST_MAX];
  local_run(2, idle_member, calls, ms);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(ms[r].rc, 0, "member %d: %s", r, ms[r].e.msg);
    cr_assert(!ms[r].bad[0], "member %d: %s", r, ms[r].bad);
  }
  cr_assert_gt(calls[0], 5, "member 0 waited 100 ms and ran its idle function %d times", calls[0]);
  cr_assert_eq(calls[1], 0);
}

static void broadcast_member(struct member *m) {
  int64_t len = *(const int64_t *)m->ctx;
  int root = m->size - 1;
  uint8_t *b = xmalloc((size_t)len + 1);
  for (int64_t i = 0; i < len; i++) b[i] = m->rank == root ? (uint8_t)(i * 131 + 7) : 0xee;
  int rc = comm_broadcast(m->c, root, b, len, &m->e);
  if (!rc) rc = comm_barrier(m->c, &m->e);
  note(m, rc);
  for (int64_t i = 0; i < len && !rc; i++)
    if (b[i] != (uint8_t)(i * 131 + 7)) {
      snprintf(m->bad, sizeof m->bad, "byte %lld is %u", (long long)i, b[i]);
      break;
    }
  free(b);
}

Test(comm_broadcast, direct_and_chained_reach_every_member) {
  for (int size = 1; size <= 5; size++) {
    int64_t lens[] = {0, 5, COMM_DIRECT_MAX_BYTES, COMM_DIRECT_MAX_BYTES + 1, (3 << 20) + 7};
    for (size_t k = 0; k < sizeof lens / sizeof lens[0]; k++) {
      struct member ms[COMM_TEST_MAX];
      local_run(size, broadcast_member, &lens[k], ms);
      for (int r = 0; r < size; r++) {
        cr_assert_eq(ms[r].rc, 0, "size %d len %lld member %d: %s", size, (long long)lens[k], r, ms[r].e.msg);
        cr_assert(!ms[r].bad[0], "size %d len %lld member %d: %s", size, (long long)lens[k], r, ms[r].bad);
      }
    }
  }
}

/* ---- sub-communicators ---- */

struct parent_job {
  struct member *m;
  comm_t *c;
  int rc;
  struct rumor_err e;
  char bad[256];
};

/* The parent's collectives, on a second thread of the member. */
static void *parent_thread(void *arg) {
  struct parent_job *j = arg;
  for (int it = 0; it < 20 && !j->rc; it++) {
    int64_t n = it % 2 ? 3000 : DIRECT_FLOATS + 17;
    float *b = xmalloc((size_t)n * sizeof(float));
    comm_fill(b, j->m->rank, it, n);
    j->rc = comm_all_reduce(j->c, b, n, &j->e);
    if (!j->rc) {
      double worst = 0;
      for (int64_t i = 0; i < n; i++) {
        double ref = 0;
        for (int r = 0; r < 4; r++) ref += comm_input(r, it + i);
        worst = fmax(worst, fabs(b[i] - ref) / (COMM_ATOL + COMM_RTOL * fabs(ref)));
      }
      if (worst > 1) snprintf(j->bad, sizeof j->bad, "parent round %d: %.2f x the tolerance", it, worst);
    }
    free(b);
  }
  return NULL;
}

/* Pairs {0, 2} and {3, 1} (listed backwards: member 3 is rank 0), a
 * nested communicator below each, and the parent, all at once. */
static void sub_member(struct member *m) {
  static const int pairs[2][2] = {{0, 2}, {3, 1}};
  int pair = m->rank % 2;
  comm_t *sub = comm_sub(m->c, pairs[pair], 2, (uint32_t)(pair + 1));
  comm_t *nested = comm_sub(sub, (const int[]){0, 1}, 2, 1);
  int want_rank = pairs[pair][0] == m->rank ? 0 : 1;
  if (comm_rank(sub) != want_rank || comm_size(sub) != 2 || comm_rank(nested) != want_rank)
    snprintf(m->bad, sizeof m->bad, "sub rank %d size %d, want rank %d", comm_rank(sub), comm_size(sub), want_rank);
  struct parent_job job = {.m = m, .c = m->c};
  pthread_t th;
  pthread_create(&th, NULL, parent_thread, &job);
  int rc = 0;
  for (int it = 0; it < 20 && !rc; it++) {
    comm_t *c = it % 3 == 2 ? nested : sub;
    int64_t n = it % 2 ? 5 : DIRECT_FLOATS * 2 + 3, off = (int64_t)pairs[pair][0] * 7 + it;
    float *b = xmalloc((size_t)n * sizeof(float)), g[2];
    /* sub rank q contributes comm_input(q, off + i): the sum is over 2 */
    comm_fill(b, comm_rank(c), off, n);
    rc = comm_all_reduce(c, b, n, &m->e);
    if (!rc) comm_check_sum(b, 2, off, n, m->bad, sizeof m->bad);
    /* all-gather in sub-rank order: rank q's value at position q */
    g[0] = g[1] = NAN;
    g[comm_rank(c)] = (float)m->rank;
    if (!rc) rc = comm_all_gather(c, g, 2, &m->e);
    if (!rc && (g[0] != (float)pairs[pair][0] || g[1] != (float)pairs[pair][1]) && !m->bad[0])
      snprintf(m->bad, sizeof m->bad, "gather in sub-rank order gave %g %g", (double)g[0], (double)g[1]);
    free(b);
  }
  pthread_join(th, NULL);
  note(m, rc ? rc : job.rc);
  if (job.rc) m->e = job.e;
  if (job.bad[0] && !m->bad[0]) snprintf(m->bad, sizeof m->bad, "%s", job.bad);
  uint64_t ss, sr, ps, pr;
  comm_bytes(sub, &ss, &sr);
  comm_bytes(m->c, &ps, &pr);
  if (!(ss > 0 && sr == ss && ps > ss) && !m->bad[0])
    snprintf(m->bad, sizeof m->bad, "bytes: sub %llu/%llu, group %llu/%llu", (unsigned long long)ss,
             (unsigned long long)sr, (unsigned long long)ps, (unsigned long long)pr);
  comm_free(nested, 0);
  comm_free(sub, 0);
}

Test(comm_sub, pairs_and_parent_run_at_once_without_mixing) {
  struct member ms[4];
  local_run(4, sub_member, NULL, ms);
  for (int r = 0; r < 4; r++) {
    cr_assert_eq(ms[r].rc, 0, "member %d: %s", r, ms[r].e.msg);
    cr_assert(!ms[r].bad[0], "member %d: %s", r, ms[r].bad);
  }
}

/* ---- bytes ---- */

static void bytes_member(struct member *m) {
  float b[100] = {0};
  note(m, comm_all_reduce(m->c, b, 100, &m->e));
  uint64_t s, r;
  comm_bytes(m->c, &s, &r);
  if (s != 2 * sizeof b || r != 2 * sizeof b)
    snprintf(m->bad, sizeof m->bad, "sent %llu received %llu, want %zu each", (unsigned long long)s,
             (unsigned long long)r, 2 * sizeof b);
}

Test(comm_bytes, direct_all_reduce_counts_payload_bytes) {
  struct member ms[3];
  local_run(3, bytes_member, NULL, ms);
  for (int r = 0; r < 3; r++) {
    cr_assert_eq(ms[r].rc, 0, "%s", ms[r].e.msg);
    cr_assert(!ms[r].bad[0], "member %d: %s", r, ms[r].bad);
  }
}

/* ---- mismatches ---- */

enum mismatch_case { MIS_COUNT_DIRECT, MIS_COUNT_RING, MIS_KIND, MIS_A2A, MIS_RS_COUNTS };

static void mismatch_member(struct member *m) {
  enum mismatch_case k = *(const enum mismatch_case *)m->ctx;
  bool odd = m->rank == 1;
  int64_t n = k == MIS_COUNT_RING ? (odd ? 300000 : 300001) : (odd ? 8 : 7);
  float *b = xcalloc((size_t)n + 16, sizeof(float));
  int rc = 0;
  for (int it = 0; it < 3 && !rc; it++) { /* one good collective first */
    if (it == 0) rc = comm_barrier(m->c, &m->e);
    else if (k == MIS_KIND && odd) rc = comm_all_gather(m->c, b, n, &m->e);
    else if (k == MIS_A2A) {
      int64_t sc[3] = {1, 1, 1}, rcv[3] = {odd ? 2 : 1, 1, 1};
      float out[8];
      rc = comm_all_to_all(m->c, b, sc, out, rcv, &m->e);
    } else if (k == MIS_RS_COUNTS) {
      int64_t c[3] = {3, odd ? 2 : 3, odd ? 3 : 2}; /* same total, another cut */
      rc = comm_reduce_scatter_v(m->c, b, c, &m->e);
    } else rc = comm_all_reduce(m->c, b, n, &m->e);
  }
  m->rc = rc;
  free(b);
}

Test(comm_mismatch, every_member_fails_with_eproto_naming_both_sides) {
  enum mismatch_case cases[] = {MIS_COUNT_DIRECT, MIS_COUNT_RING, MIS_KIND, MIS_A2A, MIS_RS_COUNTS};
  const char *want[][2] = {{"of 7 floats", "of 8 floats"},
                           {"of 300000 floats", "of 300001 floats"},
                           {"all_gather", "all_reduce"},
                           {"which expects", "all_to_all"},
                           {"counts digest", "reduce_scatter"}};
  for (size_t k = 0; k < sizeof cases / sizeof cases[0]; k++) {
    struct member ms[3];
    comm_t *comms[3];
    comm_local_create(3, comms);
    members_run(comms, 3, mismatch_member, &cases[k], ms);
    for (int r = 0; r < 3; r++) {
      cr_assert_eq(ms[r].rc, RUMOR_EPROTO, "case %zu member %d: %d %s", k, r, ms[r].rc, ms[r].e.msg);
      cr_assert(strstr(ms[r].e.msg, want[k][0]) && strstr(ms[r].e.msg, want[k][1]), "case %zu member %d: %s", k, r,
                ms[r].e.msg);
      int who = -1;
      char why[512];
      cr_assert(comm_failed(comms[r], &who, why, sizeof why));
      cr_assert(who >= 0 && who < 3, "culprit %d", who);
      cr_assert_str_eq(why, ms[r].e.msg);
      /* Failed for good: the next call returns at once. */
      struct rumor_err e;
      cr_assert_eq(comm_barrier(comms[r], &e), RUMOR_EPROTO);
    }
    for (int r = 0; r < 3; r++) comm_free(comms[r], 0);
  }
}

/* ---- abort and departure ---- */

static void abort_member(struct member *m) {
  float b[4] = {0};
  if (m->rank == 1) {
    usleep(50 * 1000);
    comm_abort(m->c, "out of memory for the activations");
    m->rc = comm_all_reduce(m->c, b, 4, &m->e);
    return;
  }
  m->rc = comm_all_reduce(m->c, b, 4, &m->e);
}

Test(comm_abort, others_fail_naming_the_culprit) {
  struct member ms[3];
  comm_t *comms[3];
  comm_local_create(3, comms);
  members_run(comms, 3, abort_member, NULL, ms);
  for (int r = 0; r < 3; r++) {
    cr_assert_eq(ms[r].rc, RUMOR_ECANCELED, "member %d: %d %s", r, ms[r].rc, ms[r].e.msg);
    cr_assert(strstr(ms[r].e.msg, "group member 1") && strstr(ms[r].e.msg, "out of memory for the activations"),
              "member %d: %s", r, ms[r].e.msg);
    int who = -1;
    cr_assert(comm_failed(comms[r], &who, NULL, 0));
    cr_assert_eq(who, 1);
  }
  for (int r = 0; r < 3; r++) comm_free(comms[r], 0);
}

static void leave_member(struct member *m) {
  float b[4] = {0};
  if (m->rank == 2) {
    m->rc = comm_barrier(m->c, &m->e);
    comm_free(m->c, 0); /* leaves; the test does not free it again */
    return;
  }
  m->rc = comm_barrier(m->c, &m->e);
  if (!m->rc) m->rc = comm_all_reduce(m->c, b, 4, &m->e);
}

Test(comm_abort, a_member_that_leaves_fails_the_others_naming_it) {
  struct member ms[3];
  comm_t *comms[3];
  comm_local_create(3, comms);
  members_run(comms, 3, leave_member, NULL, ms);
  cr_assert_eq(ms[2].rc, 0, "%s", ms[2].e.msg);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(ms[r].rc, -ECONNRESET, "member %d: %d %s", r, ms[r].rc, ms[r].e.msg);
    cr_assert(strstr(ms[r].e.msg, "group member 2 left"), "member %d: %s", r, ms[r].e.msg);
    int who = -1;
    cr_assert(comm_failed(comms[r], &who, NULL, 0));
    cr_assert_eq(who, 2);
  }
  for (int r = 0; r < 2; r++) comm_free(comms[r], 0);
}

Test(comm_args, bad_arguments_are_refused_without_communicating) {
  comm_t *c[1];
  comm_local_create(1, c);
  struct rumor_err e;
  float b[2];
  cr_assert_eq(comm_all_reduce(c[0], b, -1, &e), -EINVAL);
  cr_assert_eq(comm_all_reduce(c[0], NULL, 3, &e), -EINVAL);
  cr_assert_eq(comm_broadcast(c[0], 1, b, 4, &e), -EINVAL);
  cr_assert(strstr(e.msg, "root 1"), "%s", e.msg);
  int64_t bad[1] = {-2};
  cr_assert_eq(comm_reduce_scatter_v(c[0], b, bad, &e), -EINVAL);
  cr_assert(strstr(e.msg, "counts[0]"), "%s", e.msg);
  int64_t s1[1] = {1}, s2[1] = {2};
  cr_assert_eq(comm_all_to_all(c[0], b, s1, b, s2, &e), -EINVAL);
  cr_assert_eq(comm_all_reduce(c[0], b, 2, &e), 0);
  cr_assert(!comm_failed(c[0], NULL, NULL, 0));
  comm_free(c[0], 0);
}
