/* All-gather rounds on the all-reduce ring (gossip.h, "all-reduce"), with
 * three gossip runtimes in one process on 127.0.0.1: every member receives
 * every member's block bit-exact (NaN payloads, signalling NaNs, denormals,
 * −0), although the cluster's --wire is lossy (bf16), in the ring's key
 * order and with its own index right; blocks longer than one piece stream
 * in several; a reduce round and a gather round of one step never mix; and
 * reduce rounds still sum right in the same runtimes between gather rounds.
 *
 * Each member's "training thread" is a thread of the test; what it finds
 * wrong it writes into its runner's `err`, which the main thread asserts
 * on (Criterion's asserts belong to the main thread). */
#include <criterion/criterion.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gossip/gossip_impl.h" /* RING_PIECE_FLOATS */

#define MEMBERS 3
#define NPARAMS 11       /* a reduce round sums NPARAMS + 1 floats: three segments of 4 */
#define LABEL "test-gather sync=allreduce"
#define JOIN_MS 20000    /* joining and every member seeing all three ready */
#define ROUND_MS 30000   /* a round, retries included, ends within this */
#define SMALL_WORDS 1000 /* a block of one piece */
#define MAX_ROUNDS 8     /* rounds in one member's plan */

struct member {
  gossip_t *g;
  struct net_identity id;
  float *mine, *theirs, *donor;
};

static struct member M[MEMBERS];
static uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
static uint64_t words;      /* gather_floats of the running cluster */
static enum net_dtype wire; /* and its --wire */

/* ---- the cluster ---- */

static void member_start(int i, uint32_t timeout_ms, const char *bootstrap) {
  static const char *const names[MEMBERS] = {"m0", "m1", "m2"};
  struct member *m = &M[i];
  cr_assert_eq(net_identity_generate(&m->id), 0);
  m->mine = xcalloc(NPARAMS + 1, sizeof(float));
  m->theirs = xcalloc(NPARAMS + 1, sizeof(float));
  m->donor = xcalloc(NPARAMS, sizeof(float));
  struct gossip_config c;
  gossip_config_default(&c);
  c.identity = &m->id;
  c.cluster_key = cluster_key;
  c.listen = "127.0.0.1:0";
  c.bootstrap = bootstrap;
  c.role = GOSSIP_ROLE_PEER;
  c.name = names[i];
  c.period_ms = 250; /* the ready flags spread in a few periods */
  c.ping_timeout_ms = 200;
  c.join_timeout_ms = JOIN_MS;
  c.model = LABEL;
  c.nparams = NPARAMS;
  c.state_floats = NPARAMS;
  c.optimizer = "sgd";
  c.wire = wire;
  c.sync = GOSSIP_SYNC_ALLREDUCE;
  c.gather_floats = words;
  c.xch_mine = m->mine;
  c.xch_theirs = m->theirs;
  c.donor_buf = m->donor;
  c.exchange_timeout_ms = timeout_ms;
  c.seed = (uint64_t)i + 1;
  struct rumor_err e = {0};
  cr_assert_eq(gossip_start(&m->g, &c, &e), 0, "member %d does not start: %s", i, e.msg);
  struct gossip_train_pos pos;
  int rc = gossip_join_wait(m->g, NULL, &pos, NULL, &e);
  cr_assert_eq(rc, 1, "member %d did not join (%d): %s", i, rc, e.msg);
  gossip_ready(m->g);
}

/* Three members with blocks of `w` words, parameters on the wire as
 * `dtype` and rounds timing out after `timeout_ms`; returns once each sees
 * all three ready. */
static void cluster_start(uint64_t w, enum net_dtype dtype, uint32_t timeout_ms) {
  words = w;
  wire = dtype;
  cr_assert_eq(net_cluster_key_generate(cluster_key), 0);
  member_start(0, timeout_ms, NULL);
  char first[128];
  snprintf(first, sizeof first, "%s", gossip_advertised(M[0].g));
  for (int i = 1; i < MEMBERS; i++) member_start(i, timeout_ms, first);
  double deadline = clock_now_s() + JOIN_MS / 1e3;
  for (int i = 0; i < MEMBERS; i++) {
    while (gossip_ready_peers(M[i].g) < MEMBERS) {
      cr_assert(clock_now_s() < deadline, "member %d sees %zu ready peers after %d ms, want %d", i,
                gossip_ready_peers(M[i].g), JOIN_MS, MEMBERS);
      const struct timespec tick = {0, 10 * 1000000};
      nanosleep(&tick, NULL);
    }
  }
}

static void cluster_stop(void) {
  for (int i = 0; i < MEMBERS; i++) {
    struct member *m = &M[i];
    if (m->g) gossip_stop(m->g, 200);
    free(m->mine);
    free(m->theirs);
    free(m->donor);
    net_identity_wipe(&m->id);
    memset(m, 0, sizeof *m);
  }
}

TestSuite(gather, .fini = cluster_stop, .timeout = 120);

/* ---- what members contribute ---- */

/* Word k of member m's block at `step`: a quarter NaNs (quiet and
 * signalling, either sign, with payloads), a quarter denormals, a quarter
 * ordinary bits and a quarter ±0 and ±Inf, all depending on m and step, so
 * that a block in the wrong slot or of another round shows. */
static uint32_t word_of(int m, uint64_t step, uint64_t k) {
  static const uint32_t zero_inf[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u};
  uint32_t tag = ((uint32_t)(m + 1) << 8 | (uint32_t)step) * 0x9E3779B9u;
  uint32_t x = (uint32_t)k * 2654435761u ^ tag;
  uint32_t sign = (uint32_t)(k / 4 + (uint64_t)m) % 2 << 31;
  switch (k % 4) {
  case 0: return sign | 0x7f800000u | (x & 0x7fffffu) | 1u; /* NaN: quiet when bit 22 is set, else signalling */
  case 1: return sign | (x & 0x7fffffu) | 1u;               /* denormal */
  case 2: return x;
  default: return zero_inf[(k / 4 + (uint64_t)m + step) % 4];
  }
}

static void fill_block(int m, uint64_t step) {
  float *b = gossip_ag_buf(M[m].g);
  for (uint64_t k = 0; k < words; k++) {
    uint32_t w = word_of(m, step, k);
    memcpy(&b[k], &w, sizeof w);
  }
}

/* Member m's reduce contribution: integers small enough that they and
 * every partial sum are exact in bf16, so the sum is exact too. */
static float contribution(int m, int x) { return (float)((m + 1) * (x % 8 + 1)); }

/* ---- one member's rounds (its "training thread") ---- */

enum round_kind { GATHER, REDUCE };
struct round {
  uint64_t step;
  enum round_kind kind;
};
struct runner {
  int m;
  const struct round *plan;
  size_t nplan;
  bool retry; /* start a FAILED round again (as the reducer does), until ROUND_MS */
  pthread_t thread;
  enum gossip_ar_status status[MAX_ROUNDS];
  char err[512];
};

/* Member m's index in the ring: its rank among the keys. */
static size_t rank_of(int m) {
  size_t r = 0;
  for (int i = 0; i < MEMBERS; i++) r += memcmp(M[i].id.pk, M[m].id.pk, NET_PUBKEY_BYTES) < 0;
  return r;
}

static void check_gather(struct runner *u, uint64_t step) {
  size_t n, self;
  const float *res = gossip_ag_result(M[u->m].g, &n, &self);
  if (!res || n != MEMBERS || self != rank_of(u->m)) {
    snprintf(u->err, sizeof u->err, "member %d, step %llu: result %p of %zu members with self %zu, want %d and %zu",
             u->m, (unsigned long long)step, (const void *)res, n, self, MEMBERS, rank_of(u->m));
    return;
  }
  for (int owner = 0; owner < MEMBERS; owner++) {
    const float *b = res + rank_of(owner) * words;
    for (uint64_t k = 0; k < words; k++) {
      uint32_t got, want = word_of(owner, step, k);
      memcpy(&got, &b[k], sizeof got);
      if (got == want) continue;
      snprintf(u->err, sizeof u->err,
               "member %d, step %llu: word %llu of member %d's block (slot %zu) is 0x%08x, want 0x%08x", u->m,
               (unsigned long long)step, (unsigned long long)k, owner, rank_of(owner), got, want);
      return;
    }
  }
}

static void check_reduce(struct runner *u, uint64_t step) {
  const float *sum = gossip_ar_result(M[u->m].g);
  for (int x = 0; x <= NPARAMS; x++) {
    float want = 0;
    for (int m = 0; m < MEMBERS; m++) want += contribution(m, x);
    if (sum[x] == want) continue; /* exact: see contribution() */
    snprintf(u->err, sizeof u->err, "member %d, step %llu: sum[%d] = %g, want %g", u->m, (unsigned long long)step, x,
             (double)sum[x], (double)want);
    return;
  }
}

/* Runs one round to its end (retrying a FAILED one when u->retry); returns
 * its status, RUNNING when it did not end within ROUND_MS. */
static enum gossip_ar_status run_round(struct runner *u, const struct round *rd) {
  gossip_t *g = M[u->m].g;
  double deadline = clock_now_s() + ROUND_MS / 1e3;
  for (;;) {
    if (rd->kind == GATHER) fill_block(u->m, rd->step);
    else
      for (int x = 0; x <= NPARAMS; x++) gossip_ar_buf(g)[x] = contribution(u->m, x);
    int rc = rd->kind == GATHER ? gossip_ag_start(g, rd->step) : gossip_ar_start(g, rd->step);
    if (rc) {
      snprintf(u->err, sizeof u->err, "member %d: round %llu not started: %s", u->m, (unsigned long long)rd->step,
               rumor_strerror(rc));
      return GOSSIP_AR_FAILED;
    }
    enum gossip_ar_status st;
    while ((st = gossip_ar_wait(g, 100)) == GOSSIP_AR_RUNNING && clock_now_s() < deadline) {}
    if (st != GOSSIP_AR_FAILED || !u->retry || clock_now_s() >= deadline) return st;
  }
}

static void *runner_main(void *arg) {
  struct runner *u = arg;
  for (size_t i = 0; i < u->nplan && !u->err[0]; i++) {
    const struct round *rd = &u->plan[i];
    u->status[i] = run_round(u, rd);
    if (u->status[i] != GOSSIP_AR_DONE) {
      if (u->retry && !u->err[0]) {
        struct gossip_ar_info info;
        gossip_ar_info(M[u->m].g, &info);
        snprintf(u->err, sizeof u->err, "member %d: the %s round of step %llu ended with status %d: %s", u->m,
                 rd->kind == GATHER ? "gather" : "reduce", (unsigned long long)rd->step, (int)u->status[i], info.why);
      }
      continue;
    }
    if (rd->kind == GATHER) check_gather(u, rd->step);
    else check_reduce(u, rd->step);
  }
  return NULL;
}

/* Every member runs its plan (plans[m]) at once, each on its own thread. */
static void run_plans(struct runner *u, const struct round *const *plans, const size_t *nplans, bool retry) {
  for (int m = 0; m < MEMBERS; m++) {
    cr_assert(nplans[m] <= MAX_ROUNDS);
    u[m] = (struct runner){.m = m, .plan = plans[m], .nplan = nplans[m], .retry = retry};
    cr_assert_eq(pthread_create(&u[m].thread, NULL, runner_main, &u[m]), 0);
  }
  for (int m = 0; m < MEMBERS; m++) pthread_join(u[m].thread, NULL);
}

static void run_plan_everywhere(const struct round *plan, size_t n) {
  const struct round *plans[MEMBERS] = {plan, plan, plan};
  const size_t nplans[MEMBERS] = {n, n, n};
  struct runner u[MEMBERS];
  run_plans(u, plans, nplans, true);
  for (int m = 0; m < MEMBERS; m++) cr_assert(!u[m].err[0], "%s", u[m].err);
}

/* ---- tests ---- */

Test(gather, every_member_gets_every_block_bit_exact_in_key_order_though_the_wire_is_lossy) {
  cluster_start(SMALL_WORDS, NET_DTYPE_BF16, 20000); /* lossy: gather blocks must not go through it */
  static const struct round plan[] = {{0, GATHER}, {1, GATHER}, {2, GATHER}};
  run_plan_everywhere(plan, sizeof plan / sizeof plan[0]);
  struct gossip_ar_info info;
  gossip_ar_info(M[0].g, &info);
  cr_assert_eq(info.members, MEMBERS);
  cr_assert_eq(info.step, 2);
}

Test(gather, blocks_longer_than_one_piece_arrive_whole) {
  cluster_start(RING_PIECE_FLOATS + 5, NET_DTYPE_BF16, 20000);
  static const struct round plan[] = {{0, GATHER}, {1, GATHER}};
  run_plan_everywhere(plan, sizeof plan / sizeof plan[0]);
}

Test(gather, reduce_rounds_still_sum_between_gather_rounds) {
  cluster_start(SMALL_WORDS, NET_DTYPE_BF16, 20000);
  static const struct round plan[] = {{0, GATHER}, {1, REDUCE}, {2, GATHER}, {3, REDUCE}};
  run_plan_everywhere(plan, sizeof plan / sizeof plan[0]);
  size_t n, self;
  cr_assert_null(gossip_ag_result(M[0].g, &n, &self), "after a reduce round there is no gather result");
  cr_assert_eq(n, 0);
}

/* Blocks as long as the reduce round's segments (4 floats) and both in
 * f32, so that only the round's name tells a gather piece from a reduce
 * piece: mixed up, the two gather members would end DONE with the reduce
 * member's partial sums for its block. */
Test(gather, a_reduce_round_and_a_gather_round_of_one_step_never_mix) {
  cluster_start((NPARAMS + 1) / MEMBERS, NET_DTYPE_F32, 1500); /* the mixed round can only time out */
  static const struct round gather0[] = {{0, GATHER}}, reduce0[] = {{0, REDUCE}};
  const struct round *plans[MEMBERS] = {gather0, gather0, reduce0};
  const size_t nplans[MEMBERS] = {1, 1, 1};
  struct runner u[MEMBERS];
  run_plans(u, plans, nplans, false);
  for (int m = 0; m < MEMBERS; m++) {
    cr_assert(!u[m].err[0], "%s", u[m].err);
    cr_assert_eq(u[m].status[0], GOSSIP_AR_FAILED, "member %d's round of step 0 ended with status %d, want FAILED",
                 m, (int)u[m].status[0]);
  }
  /* Nothing was taken: the same step, one kind everywhere, completes. */
  run_plan_everywhere(gather0, 1);
}
