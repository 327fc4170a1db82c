/* Expert parallelism (peer/model/gpt_moe_ep.c, issue #32): P ranks, each
 * a thread with its own CPU backend and model over its slice of the rows,
 * joined by an in-process communicator, against one model over all the
 * rows: the per-token losses, the experts' loads and drops, and the sum of
 * the ranks' gradients (what the data-parallel all-reduce forms) equal the
 * single model's within float rounding; the slots, and so the dropped
 * choices, exactly. Also: a rank with no rows (a padding pass), a rank
 * that stops, and the refusals. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/group/comm.h"
#include "peer/model/model.h"

#define ROWS 6
#define MAXP 4

static struct model_spec parse(const char *s) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &spec, &e), 0, "%s: %s", s, e.msg);
  return spec;
}

static int ep_gather(void *arg, float *buf, int64_t each, struct rumor_err *e) {
  comm_t *c = arg;
  return comm_all_gather(c, buf, each * comm_size(c), e);
}

static void ep_abort(void *arg, const char *why) { comm_abort(arg, why); }

static int ep_a2a(void *arg, const float *send, const int64_t *sc, float *recv, const int64_t *rc,
                  struct rumor_err *e) {
  return comm_all_to_all(arg, send, sc, recv, rc, e);
}

/* What one run (a rank, or the single model: rank −1) computes. */
struct run {
  struct model_spec spec;
  int rank, size;     /* size 1, rank −1: the single model over every row */
  comm_t *comm;
  bool ghost;         /* this rank's pass is padding (it has no rows) */
  bool backward;
  bool abort_first;   /* this rank stops before its pass */
  bool own_only;      /* model_ep.own_experts_only: the gradients start as NaN, other ranks' experts' must stay so */
  int32_t x[ROWS * 16], y[ROWS * 16];
  int64_t lo, n;      /* its rows of the batch */
  int64_t max_rows;   /* its model's (every rank's the same) */
  const char *device; /* its backend: "cpu" (NULL), or "cuda:0" */
  float *grads, *losses;
  int64_t load[GPT_MAX_EXPERTS], dropped;
  double aux;
  int failed;
  char why[sizeof(struct rumor_err)];
};

static void *run_main(void *arg) {
  struct run *r = arg;
  tensor_backend_t be;
  struct rumor_err e = {0};
  RUMOR_ASSERT(tensor_backend_open(r->device ? r->device : "cpu", &be, &e) == 0);
  tensor_backend_set_threads(be, 1);
  struct model m;
  int64_t rows = r->ghost ? 1 : r->n, T = r->spec.u.gpt.context, L = r->spec.u.gpt.layers + 2;
  RUMOR_ASSERT(model_init(&m, &r->spec, 0, (int)L, be, r->max_rows, &e) == 0);
  model_init_params(&m, 21);
  model_set_moe_losses(&m, 0.3, 0.02);
  struct model_ep ep = {.rank = r->rank, .size = r->size, .all_gather = ep_gather, .all_to_all = ep_a2a,
                        .abort = ep_abort,
                        .arg = r->comm, .ghost = r->ghost, .own_experts_only = r->own_only};
  if (r->rank >= 0) RUMOR_ASSERT(model_use_ep(&m, &ep, &e) == 0);
  if (r->abort_first) comm_abort(r->comm, "rank stopped by the test");
  tensor_copy_from_host(model_act(&m, 0), 0, r->x + r->lo * T, (size_t)(rows * T) * sizeof(int32_t));
  tensor_copy_from_host(&m.labels, 0, r->y + r->lo * T, (size_t)(rows * T) * sizeof(int32_t));
  model_forward(&m, 0, (int)L, rows);
  model_loss(&m, rows, model_act(&m, (int)L), 1.0f / (float)(ROWS * T));
  r->losses = xmalloc((size_t)(rows * T) * sizeof(float));
  tensor_copy_to_host(&m.losses, 0, r->losses, (size_t)(rows * T) * sizeof(float));
  if (r->backward) {
    if (r->own_only) tensor_fill(&m.grads, NAN);
    model_backward(&m, 0, (int)L, rows, model_act(&m, (int)L), NULL, false);
    r->grads = xmalloc((size_t)m.nparams * sizeof(float));
    tensor_copy_to_host(&m.grads, 0, r->grads, (size_t)m.nparams * sizeof(float));
  }
  memcpy(r->load, m.moe_stats.load, sizeof r->load);
  r->dropped = m.moe_stats.dropped;
  r->aux = m.moe_stats.aux_loss;
  r->failed = ep.failed;
  snprintf(r->why, sizeof r->why, "%s", ep.err.msg);
  model_free(&m);
  tensor_backend_close(be);
  return NULL;
}

static void fill_batch(struct run *r, uint64_t seed) {
  struct rng g;
  rng_seed(&g, seed, 3);
  int64_t n = ROWS * r->spec.u.gpt.context;
  RUMOR_ASSERT(n <= ROWS * 16);
  for (int64_t i = 0; i < n; i++) r->x[i] = (int32_t)rng_below(&g, (uint64_t)r->spec.u.gpt.vocab);
  for (int64_t i = 0; i < n; i++) r->y[i] = (int32_t)rng_below(&g, (uint64_t)r->spec.u.gpt.vocab);
}

/* Runs the single model (on the CPU) and P ranks (on `device`) on the same
 * batch (rank `empty`, if any, with no rows: a padding pass, forward only)
 * and compares, within the tolerances times `slack`. */
/* The expert an entry belongs to (its "mlp.experts.<x>." name), or −1. */
static int expert_of(const char *name) {
  const char *at = strstr(name, "mlp.experts.");
  return at ? atoi(at + strlen("mlp.experts.")) : -1;
}

/* The rank of P that runs expert x. */
static int runner_of(const struct model_spec *s, int P, int x) {
  for (int i = 0; i < P; i++) {
    int lo, hi;
    model_ep_experts(s, P, i, &lo, &hi);
    if (x >= lo && x < hi) return i;
  }
  return -1;
}

/* The single model's gradient against the P ranks' sum (own_only: for an
 * expert's entries the rank that runs it alone, the others' left NaN). */
static void grads_match(const struct run *one, const struct run *rk, int P, bool own_only, double slack,
                        double *gworst, const char **at) {
  struct model_table tab;
  model_table_build(&one->spec, &tab);
  *gworst = 0;
  *at = "";
  for (size_t k = 0; k < tab.n; k++) {
    int x = expert_of(tab.p[k].name), owner = x >= 0 ? runner_of(&one->spec, P, x) : -1;
    for (int64_t j = tab.p[k].offset; j < tab.p[k].offset + tab.p[k].numel; j++) {
      double sum = 0;
      for (int i = 0; i < P; i++) {
        if (own_only && x >= 0 && i != owner) {
          cr_assert(isnan(rk[i].grads[j]), "rank %d wrote expert %d's gradient (%s), which rank %d runs", i, x,
                    tab.p[k].name, owner);
          continue;
        }
        sum += rk[i].grads[j];
      }
      double d = fabs(sum - one->grads[j]) / (1e-4 + 1e-3 * fabs(one->grads[j]));
      if (isnan(d)) d = INFINITY; /* a gradient nobody wrote */
      if (d > *gworst) *gworst = d, *at = tab.p[k].name;
    }
  }
  static char name[MODEL_NAME_MAX];
  snprintf(name, sizeof name, "%s", *at);
  *at = name;
  model_table_free(&tab);
  cr_assert_leq(*gworst, slack, "the ranks' summed gradient is %.3g of the tolerance off at %s", *gworst, *at);
}

static void ep_matches_on(const char *spec, int P, int empty, const char *device, double slack, bool own_only) {
  struct run *one = xcalloc(1, sizeof *one), *rk = xcalloc(MAXP, sizeof *rk);
  one->spec = parse(spec);
  one->rank = -1;
  one->size = 1;
  one->n = one->max_rows = ROWS;
  one->backward = empty < 0;
  fill_batch(one, 77);
  comm_t *comms[MAXP];
  comm_local_create(P, comms);
  int live = P - (empty >= 0); /* the rows go to the ranks with rows, in order */
  pthread_t th[MAXP];
  for (int i = 0, k = 0; i < P; i++) {
    struct run *r = &rk[i];
    *r = *one;
    r->rank = i;
    r->size = P;
    r->comm = comms[i];
    r->device = device;
    r->ghost = i == empty;
    r->own_only = own_only;
    r->max_rows = (ROWS + live - 1) / live;
    int64_t hi;
    if (!r->ghost) comm_chunk(ROWS, live, k++, &r->lo, &hi), r->n = hi - r->lo;
    else r->lo = 0, r->n = 0;
    cr_assert_eq(pthread_create(&th[i], NULL, run_main, r), 0);
  }
  run_main(one);
  for (int i = 0; i < P; i++) pthread_join(th[i], NULL);
  int64_t T = one->spec.u.gpt.context;
  double worst = 0;
  for (int i = 0; i < P; i++) {
    cr_assert_eq(rk[i].failed, 0, "rank %d failed: %s", i, rk[i].why);
    cr_assert_eq(memcmp(rk[i].load, one->load, sizeof one->load), 0, "%s P=%d: rank %d's expert loads differ", spec,
                 P, i);
    cr_assert_eq(rk[i].dropped, one->dropped, "%s P=%d: rank %d dropped %lld, one process %lld", spec, P, i,
                 (long long)rk[i].dropped, (long long)one->dropped);
    cr_assert_float_eq(rk[i].aux, one->aux, 1e-5 + 1e-4 * fabs(one->aux), "aux %g vs %g", rk[i].aux, one->aux);
    for (int64_t t = 0; t < rk[i].n * T; t++) {
      double d = fabs(rk[i].losses[t] - one->losses[rk[i].lo * T + t]);
      worst = d > worst ? d : worst;
    }
  }
  cr_assert_leq(worst, 1e-4 * slack, "%s P=%d: a token's loss differs by %g", spec, P, worst);
  if (empty < 0) {
    double gworst;
    const char *at;
    grads_match(one, rk, P, own_only, slack, &gworst, &at);
    fprintf(stderr, "expert parallel %s P=%d%s: worst loss %.2g, gradient %.3g of the tolerance (%s), %lld dropped\n",
            spec, P, own_only ? " (own experts only)" : "", worst, gworst, at, (long long)one->dropped);
  }
  for (int i = 0; i < P; i++) {
    free(rk[i].grads);
    free(rk[i].losses);
    comm_free(comms[i], 0);
  }
  free(one->grads);
  free(one->losses);
  free(one);
  free(rk);
}

static void ep_matches(const char *spec, int P, int empty) { ep_matches_on(spec, P, empty, NULL, 1.0, false); }

Test(moe_ep, top1_over_2_ranks_equals_one_process_drops_included) { ep_matches("gpt:L2-H2-C8-T5-V11-E4-F50", 2, -1); }

Test(moe_ep, top2_over_3_ranks_uneven_experts_equals_one_process) {
  ep_matches("gpt:L2-H2-C8-T5-V11-E5-K2-M2-F75", 3, -1);
}

Test(moe_ep, top2_over_4_ranks_one_expert_each_equals_one_process) {
  ep_matches("gpt:L3-H2-C8-T5-V11-E4-K2-F125", 4, -1);
}

/* What ZeRO 1-3 ask of the model (model_ep.own_experts_only): a rank
 * writes the gradients of the experts it runs, which alone are the
 * batch's, and does not touch the others'. */
Test(moe_ep, a_rank_told_so_writes_only_its_own_experts_gradients_which_are_the_whole_batchs) {
  ep_matches_on("gpt:L3-H2-C8-T5-V11-E5-K2-M2-F75", 2, -1, NULL, 1.0, true);
}

Test(moe_ep, a_rank_without_rows_takes_part_and_routes_nothing) { ep_matches("gpt:L2-H2-C8-T5-V11-E4-F50", 3, 1); }

/* The same on CUDA (the ranks' device; each thread its own backend on
 * cuda:0) against the CPU's single model: the same choices and drops, the
 * values within 10 times the CPU's tolerances. Skips without a GPU. */
Test(moe_ep, on_cuda_two_ranks_equal_one_cpu_process) {
  if (tensor_cuda_device_count() == 0)
    cr_skip_test("no CUDA GPU: tensor_cuda_device_count() is 0 (%s); CUDA variant skipped",
                 tensor_cuda_compiled() ? "built with CUDA, but no usable device or driver" : "built without CUDA");
  ep_matches_on("gpt:L2-H2-C8-T5-V11-E4-K2-F75", 2, -1, "cuda:0", 10.0, false);
}

/* Two ranks, one stopping before its pass (stop) or one built for fewer
 * rows than the other sends (an impossible plan): neither hangs, both
 * record a failure, `says` in rank `who`'s. */
static void ranks_fail(bool stop, int who, const char *says) {
  struct run *rk = xcalloc(2, sizeof *rk);
  comm_t *comms[2];
  comm_local_create(2, comms);
  pthread_t th[2];
  for (int i = 0; i < 2; i++) {
    rk[i].spec = parse("gpt:L2-H2-C8-T5-V11-E4");
    fill_batch(&rk[i], 5);
    rk[i].rank = i;
    rk[i].size = 2;
    rk[i].comm = comms[i];
    rk[i].lo = i * 4;
    rk[i].n = rk[i].max_rows = stop || i == 0 ? 2 + 2 * (i == 0 && !stop) : 2;
    rk[i].backward = true;
    rk[i].abort_first = stop && i == 1;
    cr_assert_eq(pthread_create(&th[i], NULL, run_main, &rk[i]), 0);
  }
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) cr_assert_neq(rk[i].failed, 0, "rank %d recorded no failure", i);
  cr_assert(strstr(rk[who].why, says), "rank %d's failure: %s", who, rk[who].why);
  for (int i = 0; i < 2; i++) {
    free(rk[i].grads);
    free(rk[i].losses);
    comm_free(comms[i], 0);
  }
  free(rk);
}

Test(moe_ep, a_rank_that_stops_fails_the_others_passes_without_a_hang) {
  ranks_fail(true, 0, "rank stopped by the test");
}

Test(moe_ep, a_rank_sent_more_tokens_than_it_can_hold_is_named_and_nobody_hangs) {
  ranks_fail(false, 1, "expert-parallel rank 0 sent an impossible routing plan");
}

Test(moe_ep, models_without_enough_experts_are_refused_by_name) {
  struct rumor_err e = {0};
  struct model_spec dense = parse("gpt:L2-H2-C8-T5-V11"), few = parse("gpt:L2-H2-C8-T5-V11-E2");
  cr_assert_eq(model_ep_check(&dense, 2, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "gpt:L2-H2-C8-T5-V11") && strstr(e.msg, "no experts"), "%s", e.msg);
  cr_assert_eq(model_ep_check(&few, 3, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "2 experts per block"), "%s", e.msg);
  cr_assert_eq(model_ep_check(&few, 2, &e), 0);
  int lo, hi;
  struct model_spec five = parse("gpt:L2-H2-C8-T5-V11-E5");
  model_ep_experts(&five, 3, 0, &lo, &hi);
  cr_assert(lo == 0 && hi == 2);
  model_ep_experts(&five, 3, 2, &lo, &hi);
  cr_assert(lo == 4 && hi == 5);
}
