/* Tensor parallelism of the models (peer/model/tp.c, gpt.c, mlp.c):
 * T ranks run as T threads, each with its own CPU backend (one thread) and
 * a test-local all-reduce (a barrier and a sum in rank order, so every rank
 * gets the same bits), and their loss, every gradient (gathered with
 * model_tp_gather) and their score equal one whole model's; replicated
 * gradients are identical across the ranks; scatter and gather round-trip;
 * one rank is the whole model bit for bit; a pipeline stage's subset of
 * units works the same; bad splits are refused by name.
 *
 * Tolerances: the ranks sum each product over a split dimension in parts
 * and add the parts in the all-reduce, so they differ from the whole model
 * in float rounding only: the loss within 1e-5 relative, gradients within
 * |got − ref| <= 1e-5·max|ref of the entry| + 1e-4·|ref| (the worst element
 * printed). */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/model.h"

#define GPT_SPEC "gpt:L2-H4-C32-T16-V101" /* odd vocabulary: uneven vocabulary shards */
#define MLP_SPEC "mlp:784-33-17-10"       /* 33 and 17 split unevenly */
#define ROWS 3
#define MAX_T 8 /* ranks of the largest group the tests run */
#define SEED 7
#define LOSS_RTOL 1e-5
#define GRAD_ATOL_OF_MAX 1e-5
#define GRAD_RTOL 1e-4

static struct model_spec parse(const char *s) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &spec, &e), 0, "%s: %s", s, e.msg);
  return spec;
}

/* ---- the test's group: an all-reduce among threads ---- */

struct group {
  int size;
  pthread_barrier_t bar;
  float *buf[MODEL_TP_MAX]; /* each rank's contribution during a call */
};

struct member {
  struct group *g;
  int rank;
};

/* Every rank publishes its values, sums all of them in rank order (the
 * same bits on every rank), and waits until all have read before freeing. */
static int group_all_reduce(void *arg, struct tensor *t, int64_t n, struct rumor_err *e) {
  (void)e;
  struct member *me = arg;
  struct group *g = me->g;
  float *mine = xmalloc((size_t)n * sizeof(float)), *sum = xmalloc((size_t)n * sizeof(float));
  tensor_copy_to_host(t, 0, mine, (size_t)n * sizeof(float));
  g->buf[me->rank] = mine;
  pthread_barrier_wait(&g->bar);
  for (int64_t i = 0; i < n; i++) {
    float s = g->buf[0][i];
    for (int r = 1; r < g->size; r++) s += g->buf[r][i];
    sum[i] = s;
  }
  pthread_barrier_wait(&g->bar);
  tensor_copy_from_host(t, 0, sum, (size_t)n * sizeof(float));
  free(mine);
  free(sum);
  return 0;
}

static int failing_all_reduce(void *arg, struct tensor *t, int64_t n, struct rumor_err *e) {
  (void)t, (void)n;
  int *calls = arg;
  (*calls)++;
  return rumor_err_set(e, RUMOR_ECANCELED, "member 1 is gone");
}

/* ---- one rank's work, on its own thread ---- */

struct job {
  const struct model_spec *spec;
  int u0, u1; /* the units; all of them: a training step and an evaluation */
  int64_t positions; /* model_set_positions' t, or 0 */
  const void *input;
  size_t input_bytes;
  const int32_t *labels;
  const float *dout;           /* a stage: dL/d its output, (ROWS, out_width) */
  int64_t in_width, out_width; /* a stage: the whole model's widths of its input and output */
  struct model_tp tp;
  struct member me;
  /* Results (asserted on the main thread). */
  int rc;
  char msg[512];
  float loss;
  float *params, *grads, *din; /* host copies: the rank's flat buffers; a stage's input gradient */
  int64_t din_width;           /* the rank's columns of din */
  int64_t nparams, param_base;
  int64_t correct;
  double loss_sum;
};

/* Rank `rank`'s columns of a (ROWS, whole) matrix when it holds `local` of
 * them (model_tp_chunk's cut), else a copy. */
static float *cut_columns(const float *x, int64_t whole, int64_t local, int T, int rank) {
  int64_t lo = 0, hi = whole;
  if (local != whole) model_tp_chunk(whole, T, rank, &lo, &hi);
  RUMOR_ASSERT(hi - lo == local);
  float *out = xmalloc((size_t)(ROWS * local) * sizeof(float));
  for (int64_t r = 0; r < ROWS; r++) memcpy(out + r * local, x + r * whole + lo, (size_t)local * sizeof(float));
  return out;
}

static void run_step(struct job *j, struct model *m) {
  int L = model_spec_units(j->spec);
  if (j->u0 == 0 && j->u1 == L) {
    if (j->positions) RUMOR_ASSERT(model_set_positions(m, j->positions));
    tensor_copy_from_host(model_act(m, j->u0), 0, j->input, j->input_bytes);
    tensor_copy_from_host(&m->labels, 0, j->labels, (size_t)model_targets(m, ROWS) * sizeof(int32_t));
    model_forward_backward(m, ROWS);
    j->loss = model_mean_loss(m, ROWS);
    tensor_copy_to_host(&m->grads, 0, j->grads, (size_t)m->nparams * sizeof(float));
    model_evaluate(m, ROWS, j->labels, &j->correct, &j->loss_sum);
    return;
  }
  /* A stage: forward, then backward from the given dout, into din. Input
   * and dout are the whole model's; a split boundary takes the rank's
   * columns of them. */
  int64_t win = model_act_width(m, j->u0), wout = model_act_width(m, j->u1);
  float *x = cut_columns(j->input, j->in_width, win, j->tp.size, j->tp.rank);
  float *dy = cut_columns(j->dout, j->out_width, wout, j->tp.size, j->tp.rank);
  int64_t sin[2] = {ROWS, win}, sout[2] = {ROWS, wout};
  struct tensor dout, din;
  struct rumor_err e;
  RUMOR_ASSERT(tensor_alloc(&dout, m->be, TENSOR_F32, 2, sout, &e) == 0 &&
               tensor_alloc(&din, m->be, TENSOR_F32, 2, sin, &e) == 0);
  tensor_copy_from_host(model_act(m, j->u0), 0, x, (size_t)(ROWS * win) * sizeof(float));
  tensor_copy_from_host(&dout, 0, dy, (size_t)(ROWS * wout) * sizeof(float));
  model_forward(m, j->u0, j->u1, ROWS);
  model_backward(m, j->u0, j->u1, ROWS, &dout, &din, false);
  tensor_copy_to_host(&m->grads, 0, j->grads, (size_t)m->nparams * sizeof(float));
  j->din = xmalloc((size_t)(ROWS * win) * sizeof(float));
  j->din_width = win;
  tensor_copy_to_host(&din, 0, j->din, (size_t)(ROWS * win) * sizeof(float));
  tensor_free(&dout);
  tensor_free(&din);
  free(x);
  free(dy);
}

static void *rank_main(void *arg) {
  struct job *j = arg;
  tensor_backend_t be;
  struct rumor_err e = {0};
  if ((j->rc = tensor_backend_open("cpu", &be, &e))) goto out;
  tensor_backend_set_threads(be, 1);
  struct model m;
  if ((j->rc = model_init_tp(&m, j->spec, j->u0, j->u1, be, ROWS, &j->tp, &e))) {
    tensor_backend_close(be);
    goto out;
  }
  model_init_params(&m, SEED);
  j->nparams = m.nparams;
  j->param_base = m.param_base;
  j->params = xmalloc((size_t)m.nparams * sizeof(float));
  j->grads = xmalloc((size_t)m.nparams * sizeof(float));
  tensor_copy_to_host(&m.params, 0, j->params, (size_t)m.nparams * sizeof(float));
  run_step(j, &m);
  if (j->tp.failed) {
    j->rc = j->tp.failed;
    e = j->tp.err;
  }
  model_free(&m);
  tensor_backend_close(be);
out:
  snprintf(j->msg, sizeof j->msg, "%s", e.msg);
  return NULL;
}

/* Runs T ranks of `proto` (its spec, units and inputs) on T threads. */
static void run_ranks(struct group *g, int T, const struct job *proto, struct job *jobs) {
  g->size = T;
  pthread_barrier_init(&g->bar, NULL, (unsigned)T);
  pthread_t th[MAX_T];
  cr_assert(T <= MAX_T);
  for (int r = 0; r < T; r++) {
    jobs[r] = *proto;
    jobs[r].me = (struct member){.g = g, .rank = r};
    jobs[r].tp = (struct model_tp){.rank = r, .size = T, .all_reduce = group_all_reduce, .arg = &jobs[r].me};
    cr_assert_eq(pthread_create(&th[r], NULL, rank_main, &jobs[r]), 0);
  }
  for (int r = 0; r < T; r++) pthread_join(th[r], NULL);
  pthread_barrier_destroy(&g->bar);
  for (int r = 0; r < T; r++) cr_assert_eq(jobs[r].rc, 0, "rank %d of %d: %s", r, T, jobs[r].msg);
}

static void free_jobs(struct job *jobs, int T) {
  for (int r = 0; r < T; r++) free(jobs[r].params), free(jobs[r].grads), free(jobs[r].din);
}

/* ---- the whole model ---- */

struct whole {
  struct model m;
  tensor_backend_t be;
  float *params, *grads;
};

static void whole_init(struct whole *w, const struct model_spec *spec, int u0, int u1) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &w->be, &e), 0, "%s", e.msg);
  tensor_backend_set_threads(w->be, 1);
  cr_assert_eq(model_init(&w->m, spec, u0, u1, w->be, ROWS, &e), 0, "%s", e.msg);
  model_init_params(&w->m, SEED);
  int64_t P = model_spec_param_count(spec);
  w->params = xcalloc((size_t)P, sizeof(float));
  w->grads = xcalloc((size_t)P, sizeof(float));
  tensor_copy_to_host(&w->m.params, 0, w->params + w->m.param_base, (size_t)w->m.nparams * sizeof(float));
}

static void whole_free(struct whole *w) {
  model_free(&w->m);
  tensor_backend_close(w->be);
  free(w->params);
  free(w->grads);
}

/* ---- inputs and checks ---- */

/* The inputs of unit 0 (tokens or features) and labels for ROWS rows. */
static void make_inputs(const struct model_spec *s, void **input, size_t *bytes, int32_t **labels) {
  struct model_io io;
  model_spec_io(s, &io);
  struct rng r;
  rng_seed(&r, 99, 1);
  int64_t n = ROWS * io.input_per_row, nl = ROWS * io.labels_per_row;
  *bytes = (size_t)n * 4;
  *input = xmalloc(*bytes);
  for (int64_t i = 0; i < n; i++) {
    if (io.input_dtype == TENSOR_I32) ((int32_t *)*input)[i] = (int32_t)rng_below(&r, (uint64_t)io.classes);
    else ((float *)*input)[i] = rng_uniform(&r);
  }
  *labels = xmalloc((size_t)nl * sizeof(int32_t));
  for (int64_t i = 0; i < nl; i++) (*labels)[i] = (int32_t)rng_below(&r, (uint64_t)io.classes);
}

/* Asserts the entries of units [u0, u1) of `got` ≈ `ref` (whole layouts). */
static void expect_entries_close(const char *what, const struct model_spec *s, int u0, int u1, const float *got,
                                 const float *ref) {
  struct model_table t;
  model_table_build(s, &t);
  double used = 0;
  const char *used_by = "-";
  for (size_t i = 0; i < t.n; i++) {
    const struct model_param *p = &t.p[i];
    if (p->unit < u0 || p->unit >= u1) continue;
    double max = 0, worst = 0;
    int64_t at = -1;
    for (int64_t k = 0; k < p->numel; k++) max = fmax(max, fabs(ref[p->offset + k]));
    for (int64_t k = 0; k < p->numel; k++) {
      double r = ref[p->offset + k], g = got[p->offset + k];
      cr_assert(isfinite(g), "%s %s[%lld] is %g", what, p->name, (long long)k, g);
      double excess = fabs(g - r) / (GRAD_ATOL_OF_MAX * max + GRAD_RTOL * fabs(r) + 1e-30);
      if (excess > worst) worst = excess, at = k;
    }
    cr_assert(worst <= 1.0, "%s %s: element %lld is %.9g, the whole model's %.9g (max |ref| %g, %.2f× the tolerance)",
              what, p->name, (long long)at, got[p->offset + at], ref[p->offset + at], max, worst);
    if (worst > used) used = worst, used_by = p->name;
  }
  cr_log_info("%s: gradients within %.3f of the tolerance (worst: %s)", what, used, used_by);
  model_table_free(&t);
}

/* Asserts every replicated entry of the ranks' local gradients is the same
 * bits on every rank. */
static void expect_replicated_identical(const struct model_spec *s, int T, const struct job *jobs) {
  struct model_tp_layout l0;
  struct rumor_err e;
  cr_assert_eq(model_tp_layout_build(s, T, 0, &l0, &e), 0, "%s", e.msg);
  for (size_t i = 0; i < l0.local.n; i++) {
    const struct model_param *p = &l0.local.p[i];
    if (l0.slice[i].dim >= 0 || p->unit < jobs[0].u0 || p->unit >= jobs[0].u1) continue;
    for (int r = 1; r < T; r++) {
      struct model_tp_layout lr;
      cr_assert_eq(model_tp_layout_build(s, T, r, &lr, &e), 0, "%s", e.msg);
      const float *a = jobs[0].grads + (p->offset - jobs[0].param_base);
      const float *b = jobs[r].grads + (lr.local.p[i].offset - jobs[r].param_base);
      cr_assert(memcmp(a, b, (size_t)p->numel * sizeof(float)) == 0, "T=%d: replicated %s's gradient differs on rank %d",
                T, p->name, r);
      model_tp_layout_free(&lr);
    }
  }
  model_tp_layout_free(&l0);
}

/* The ranks' local buffers (of units [u0, u1), at param_base) gathered
 * into the whole layout. */
static float *gather_all(const struct model_spec *s, int T, const struct job *jobs, bool grads) {
  float *full = xcalloc((size_t)model_spec_param_count(s), sizeof(float));
  for (int r = 0; r < T; r++) {
    int64_t n = model_tp_local_params(s, T, r);
    float *local = xcalloc((size_t)n, sizeof(float));
    memcpy(local + jobs[r].param_base, grads ? jobs[r].grads : jobs[r].params, (size_t)jobs[r].nparams * sizeof(float));
    model_tp_gather(s, T, r, local, full);
    free(local);
  }
  return full;
}

/* ---- tests ---- */

/* One step of T ranks against the whole model: initial values, loss,
 * gradients, replicated gradients, evaluation. */
static void check_step_at(const char *spec_s, int T, int64_t positions) {
  struct model_spec s = parse(spec_s);
  int L = model_spec_units(&s);
  void *input;
  size_t bytes;
  int32_t *labels;
  make_inputs(&s, &input, &bytes, &labels);
  struct whole w;
  whole_init(&w, &s, 0, L);
  if (positions) { /* ROWS sequences of `positions` tokens, packed */
    cr_assert(model_set_positions(&w.m, positions));
    bytes = (size_t)(ROWS * positions) * sizeof(int32_t);
  }
  tensor_copy_from_host(model_act(&w.m, 0), 0, input, bytes);
  tensor_copy_from_host(&w.m.labels, 0, labels, (size_t)model_targets(&w.m, ROWS) * sizeof(int32_t));
  model_forward_backward(&w.m, ROWS);
  float ref_loss = model_mean_loss(&w.m, ROWS);
  tensor_copy_to_host(&w.m.grads, 0, w.grads, (size_t)w.m.nparams * sizeof(float));
  int64_t ref_correct = 0;
  double ref_loss_sum = 0;
  model_evaluate(&w.m, ROWS, labels, &ref_correct, &ref_loss_sum);

  struct group g;
  struct job proto = {
      .spec = &s, .u0 = 0, .u1 = L, .positions = positions, .input = input, .input_bytes = bytes, .labels = labels};
  struct job jobs[MAX_T];
  run_ranks(&g, T, &proto, jobs);
  float *params = gather_all(&s, T, jobs, false), *grads = gather_all(&s, T, jobs, true);
  cr_assert(memcmp(params, w.params, (size_t)model_spec_param_count(&s) * sizeof(float)) == 0,
            "%s T=%d: the ranks' initial values are not the whole model's", spec_s, T);
  for (int r = 0; r < T; r++) {
    cr_assert(fabs(jobs[r].loss - ref_loss) <= LOSS_RTOL * fabs(ref_loss), "%s T=%d rank %d: loss %.9g, whole %.9g",
              spec_s, T, r, jobs[r].loss, ref_loss);
    cr_assert_eq(jobs[r].correct, ref_correct, "%s T=%d rank %d: %lld correct, whole %lld", spec_s, T, r,
                 (long long)jobs[r].correct, (long long)ref_correct);
    cr_assert(fabs(jobs[r].loss_sum - ref_loss_sum) <= LOSS_RTOL * fabs(ref_loss_sum),
              "%s T=%d rank %d: evaluated loss sum %.9g, whole %.9g", spec_s, T, r, jobs[r].loss_sum, ref_loss_sum);
  }
  char what[64];
  snprintf(what, sizeof what, "T=%d", T);
  expect_entries_close(what, &s, 0, L, grads, w.grads);
  expect_replicated_identical(&s, T, jobs);
  free(params), free(grads), free_jobs(jobs, T);
  whole_free(&w);
  free(input), free(labels);
}

static void check_step(const char *spec_s, int T) { check_step_at(spec_s, T, 0); }

Test(tp, gpt_ranks_give_the_whole_models_loss_gradients_and_score_t2) { check_step(GPT_SPEC, 2); }
/* Fewer positions than the context (sampling): 5 of 16. */
Test(tp, gpt_ranks_on_fewer_positions_give_the_whole_models_t2) { check_step_at(GPT_SPEC, 2, 5); }
Test(tp, gpt_ranks_give_the_whole_models_loss_gradients_and_score_t4) { check_step(GPT_SPEC, 4); }
Test(tp, mlp_ranks_give_the_whole_models_loss_gradients_and_score_t2) { check_step(MLP_SPEC, 2); }
Test(tp, mlp_ranks_give_the_whole_models_loss_gradients_and_score_t4) { check_step(MLP_SPEC, 4); }
/* Two layers: the last is row-parallel (its logits all-reduced). */
Test(tp, a_two_layer_mlp_ends_row_parallel_t3) { check_step("mlp:20-7-5:gelu", 3); }
/* Five layers: column, row, column (an input gradient to all-reduce), row,
 * replicated. */
Test(tp, a_five_layer_mlp_alternates_column_and_row_t2) { check_step("mlp:12-9-7-6-5-4", 2); }

/* A pipeline stage's units: blocks 0 and 1 of the GPT (units [1, 3)), and
 * the MLP's last two layers, whose input is a split boundary. */
static void check_stage(const char *spec_s, int T, int u0, int u1) {
  struct model_spec s = parse(spec_s);
  struct whole w;
  whole_init(&w, &s, u0, u1);
  int64_t win = model_act_width(&w.m, u0), wout = model_act_width(&w.m, u1);
  struct rng r;
  rng_seed(&r, 5, 5);
  float *x = xmalloc((size_t)(ROWS * win) * sizeof(float)), *dy = xmalloc((size_t)(ROWS * wout) * sizeof(float));
  for (int64_t i = 0; i < ROWS * win; i++) x[i] = rng_uniform(&r);
  for (int64_t i = 0; i < ROWS * wout; i++) dy[i] = rng_uniform(&r) - 0.5f;
  tensor_copy_from_host(model_act(&w.m, u0), 0, x, (size_t)(ROWS * win) * sizeof(float));
  int64_t sin[2] = {ROWS, win}, sout[2] = {ROWS, wout};
  struct tensor dout, din;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&dout, w.be, TENSOR_F32, 2, sout, &e), 0);
  cr_assert_eq(tensor_alloc(&din, w.be, TENSOR_F32, 2, sin, &e), 0);
  tensor_copy_from_host(&dout, 0, dy, (size_t)(ROWS * wout) * sizeof(float));
  model_forward(&w.m, u0, u1, ROWS);
  model_backward(&w.m, u0, u1, ROWS, &dout, &din, false);
  tensor_copy_to_host(&w.m.grads, 0, w.grads + w.m.param_base, (size_t)w.m.nparams * sizeof(float));
  float *ref_din = xmalloc((size_t)(ROWS * win) * sizeof(float));
  tensor_copy_to_host(&din, 0, ref_din, (size_t)(ROWS * win) * sizeof(float));

  struct group g;
  struct job jobs[MAX_T];
  struct job proto = {.spec = &s, .u0 = u0, .u1 = u1, .input = x, .dout = dy, .in_width = win, .out_width = wout};
  run_ranks(&g, T, &proto, jobs);
  float *grads = gather_all(&s, T, jobs, true);
  char what[64];
  snprintf(what, sizeof what, "%s stage [%d, %d) T=%d", spec_s, u0, u1, T);
  expect_entries_close(what, &s, u0, u1, grads, w.grads);
  expect_replicated_identical(&s, T, jobs);
  for (int rk = 0; rk < T; rk++) {
    float *want = cut_columns(ref_din, win, jobs[rk].din_width, T, rk);
    for (int64_t i = 0; i < ROWS * jobs[rk].din_width; i++)
      cr_assert(fabs(jobs[rk].din[i] - want[i]) <= 1e-5 + 1e-4 * fabs(want[i]), "%s rank %d: din[%lld] %.9g, whole %.9g",
                what, rk, (long long)i, jobs[rk].din[i], want[i]);
    free(want);
  }
  free(grads), free(ref_din), free(x), free(dy), free_jobs(jobs, T);
  tensor_free(&dout), tensor_free(&din);
  whole_free(&w);
}

Test(tp, a_gpt_stage_of_blocks_gives_the_whole_stages_gradients_t2) { check_stage(GPT_SPEC, 2, 1, 3); }
/* Its input is layer 0's split output: each rank takes its columns. */
Test(tp, an_mlp_stage_starting_at_a_split_boundary_gives_the_whole_stages_gradients_t2) {
  check_stage(MLP_SPEC, 2, 1, 3);
}
Test(tp, an_mlp_stage_ending_at_a_split_boundary_gives_the_whole_stages_gradients_t3) {
  check_stage(MLP_SPEC, 3, 0, 1);
}

/* One rank is the whole model: the same bits everywhere. */
static void check_one_rank_is_the_whole_model(const char *spec_s) {
  struct model_spec s = parse(spec_s);
  int L = model_spec_units(&s);
  void *input;
  size_t bytes;
  int32_t *labels;
  make_inputs(&s, &input, &bytes, &labels);
  struct whole w;
  whole_init(&w, &s, 0, L);
  tensor_copy_from_host(model_act(&w.m, 0), 0, input, bytes);
  tensor_copy_from_host(&w.m.labels, 0, labels, (size_t)model_targets(&w.m, ROWS) * sizeof(int32_t));
  model_forward_backward(&w.m, ROWS);
  float ref_loss = model_mean_loss(&w.m, ROWS);
  tensor_copy_to_host(&w.m.grads, 0, w.grads, (size_t)w.m.nparams * sizeof(float));
  int64_t ref_correct = 0;
  double ref_loss_sum = 0;
  model_evaluate(&w.m, ROWS, labels, &ref_correct, &ref_loss_sum);
  struct group g;
  struct job jobs[1], proto = {.spec = &s, .u0 = 0, .u1 = L, .input = input, .input_bytes = bytes, .labels = labels};
  run_ranks(&g, 1, &proto, jobs);
  size_t P = (size_t)model_spec_param_count(&s);
  cr_assert_eq(jobs[0].nparams, (int64_t)P);
  cr_assert(memcmp(jobs[0].params, w.params, P * sizeof(float)) == 0, "%s: initial values differ", spec_s);
  cr_assert(memcmp(&jobs[0].loss, &ref_loss, sizeof ref_loss) == 0, "%s: loss %.9g, whole %.9g", spec_s, jobs[0].loss,
            ref_loss);
  for (size_t i = 0; i < P; i++)
    cr_assert(memcmp(&jobs[0].grads[i], &w.grads[i], sizeof(float)) == 0, "%s: gradient %zu is %.9g, whole %.9g",
              spec_s, i, jobs[0].grads[i], w.grads[i]);
  cr_assert_eq(jobs[0].correct, ref_correct);
  cr_assert(memcmp(&jobs[0].loss_sum, &ref_loss_sum, sizeof ref_loss_sum) == 0, "%s: evaluated loss sum differs",
            spec_s);
  free_jobs(jobs, 1);
  whole_free(&w);
  free(input), free(labels);
}

Test(tp, one_gpt_rank_is_the_whole_model_bit_for_bit) { check_one_rank_is_the_whole_model(GPT_SPEC); }
Test(tp, one_mlp_rank_is_the_whole_model_bit_for_bit) { check_one_rank_is_the_whole_model(MLP_SPEC); }

/* Scatter then gather over every rank rebuilds the whole buffer exactly;
 * gather then scatter gives a rank's buffer back; each rank's slices of
 * the cut entries are disjoint (a NaN poison left nowhere, no element
 * written by two ranks with different values). */
static void check_round_trip(const char *spec_s, int T) {
  struct model_spec s = parse(spec_s);
  int64_t P = model_spec_param_count(&s), local_sum = 0;
  float *full = xmalloc((size_t)P * sizeof(float)), *back = xmalloc((size_t)P * sizeof(float));
  for (int64_t i = 0; i < P; i++) full[i] = (float)i; /* every element distinct */
  for (int64_t i = 0; i < P; i++) back[i] = NAN;
  for (int r = 0; r < T; r++) {
    int64_t n = model_tp_local_params(&s, T, r);
    local_sum += n;
    float *local = xmalloc((size_t)n * sizeof(float)), *again = xmalloc((size_t)n * sizeof(float));
    model_tp_scatter(&s, T, r, full, local);
    float *scratch = xmalloc((size_t)P * sizeof(float));
    for (int64_t i = 0; i < P; i++) scratch[i] = NAN;
    model_tp_gather(&s, T, r, local, scratch);
    model_tp_scatter(&s, T, r, scratch, again);
    cr_assert(memcmp(local, again, (size_t)n * sizeof(float)) == 0, "%s T=%d rank %d: gather∘scatter is not the "
              "identity", spec_s, T, r);
    model_tp_gather(&s, T, r, local, back);
    free(local), free(again), free(scratch);
  }
  for (int64_t i = 0; i < P; i++)
    cr_assert(back[i] == full[i], "%s T=%d: element %lld gathered as %g, not %g", spec_s, T, (long long)i, back[i],
              full[i]);
  cr_assert(local_sum >= P, "%s T=%d: the ranks hold %lld elements of %lld", spec_s, T, (long long)local_sum,
            (long long)P);
  free(full), free(back);
}

Test(tp, scatter_and_gather_round_trip_exactly) {
  const int sizes[] = {1, 2, 3, 4};
  for (size_t i = 0; i < sizeof sizes / sizeof sizes[0]; i++) {
    check_round_trip(MLP_SPEC, sizes[i]);
    if (sizes[i] != 3) check_round_trip(GPT_SPEC, sizes[i]);
  }
}

Test(tp, the_layout_cuts_heads_columns_rows_and_the_vocabulary) {
  struct model_spec s = parse(GPT_SPEC);
  struct model_tp_layout l;
  struct rumor_err e;
  cr_assert_eq(model_tp_layout_build(&s, 4, 1, &l, &e), 0, "%s", e.msg);
  struct model_table t;
  model_table_build(&s, &t);
  const struct {
    const char *name;
    int dim, groups;
    int64_t lo, hi, d0, d1;
  } want[] = {
      {"transformer.wte.weight", 0, 1, 26, 51, 25, 32}, /* 101 = 26 + 25 + 25 + 25 */
      {"transformer.wpe.weight", -1, 1, 0, 0, 16, 32},
      {"transformer.h.0.attn.c_attn.weight", 1, 3, 8, 16, 32, 24},
      {"transformer.h.0.attn.c_attn.bias", 0, 3, 8, 16, 24, 0},
      {"transformer.h.0.attn.c_proj.weight", 0, 1, 8, 16, 8, 32},
      {"transformer.h.0.attn.c_proj.bias", -1, 1, 0, 0, 32, 0},
      {"transformer.h.1.mlp.c_fc.weight", 1, 1, 32, 64, 32, 32},
      {"transformer.h.1.mlp.c_fc.bias", 0, 1, 32, 64, 32, 0},
      {"transformer.h.1.mlp.c_proj.weight", 0, 1, 32, 64, 32, 32},
      {"transformer.h.1.ln_2.weight", -1, 1, 0, 0, 32, 0},
      {"transformer.ln_f.bias", -1, 1, 0, 0, 32, 0},
  };
  for (size_t k = 0; k < sizeof want / sizeof want[0]; k++) {
    const struct model_param *p = model_table_find(&t, want[k].name);
    cr_assert(p, "%s", want[k].name);
    size_t i = (size_t)(p - t.p);
    const struct model_tp_slice *sl = &l.slice[i];
    const struct model_param *q = &l.local.p[i];
    cr_assert_eq(sl->dim, want[k].dim, "%s: dim", want[k].name);
    if (sl->dim >= 0) {
      cr_assert_eq(sl->groups, want[k].groups, "%s: groups", want[k].name);
      cr_assert(sl->lo == want[k].lo && sl->hi == want[k].hi, "%s: [%lld, %lld)", want[k].name, (long long)sl->lo,
                (long long)sl->hi);
    }
    cr_assert(q->shape[0] == want[k].d0 && (!want[k].d1 || q->shape[1] == want[k].d1), "%s: local shape %lld×%lld",
              want[k].name, (long long)q->shape[0], (long long)q->shape[1]);
    cr_assert_str_eq(q->name, p->name);
  }
  model_table_free(&t);
  model_tp_layout_free(&l);
}

Test(tp, splits_that_do_not_fit_are_refused_by_name) {
  struct model_spec s = parse(GPT_SPEC);
  struct rumor_err e = {0};
  cr_assert_eq(model_tp_check(&s, 3, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, GPT_SPEC) && strstr(e.msg, "4 heads are not a multiple of 3"), "%s", e.msg);
  tensor_backend_t be;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0);
  struct model m;
  struct model_tp tp = {.rank = 0, .size = 3, .all_reduce = failing_all_reduce};
  e.msg[0] = '\0';
  cr_assert_eq(model_init_tp(&m, &s, 0, model_spec_units(&s), be, ROWS, &tp, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "cannot be split over 3 tensor-parallel ranks"), "%s", e.msg);
  struct model_spec narrow = parse("mlp:10-3-4");
  cr_assert_eq(model_tp_check(&narrow, 4, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "mlp:10-3-4") && strstr(e.msg, "layer 0's 3 outputs"), "%s", e.msg);
  cr_assert_eq(model_tp_check(&s, 0, &e), RUMOR_EFORMAT);
  cr_assert_eq(model_tp_check(&s, MODEL_TP_MAX + 1, &e), RUMOR_EFORMAT);
  tensor_backend_close(be);
}

/* The passes' failure contract: the first failure is recorded, later
 * all-reduces are not attempted, the step still returns. */
Test(tp, a_failing_all_reduce_is_recorded_once_and_the_rest_skipped) {
  struct model_spec s = parse(GPT_SPEC);
  tensor_backend_t be;
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0);
  int calls = 0;
  struct model_tp tp = {.rank = 1, .size = 2, .all_reduce = failing_all_reduce, .arg = &calls};
  struct model m;
  int L = model_spec_units(&s);
  cr_assert_eq(model_init_tp(&m, &s, 0, L, be, ROWS, &tp, &e), 0, "%s", e.msg);
  model_init_params(&m, SEED);
  void *input;
  size_t bytes;
  int32_t *labels;
  make_inputs(&s, &input, &bytes, &labels);
  tensor_copy_from_host(model_act(&m, 0), 0, input, bytes);
  tensor_copy_from_host(&m.labels, 0, labels, (size_t)model_targets(&m, ROWS) * sizeof(int32_t));
  model_forward_backward(&m, ROWS);
  cr_assert_eq(tp.failed, RUMOR_ECANCELED);
  cr_assert(strstr(tp.err.msg, "member 1 is gone"), "%s", tp.err.msg);
  cr_assert_eq(calls, 1, "%d all-reduces attempted after the first failed", calls - 1);
  model_free(&m);
  tensor_backend_close(be);
  free(input), free(labels);
}

/* An optimiser of a rank covers the rank's buffer with its own table's
 * decay mask (matrices decay, biases and gains do not). */
Test(tp, an_optimiser_of_a_rank_follows_the_ranks_layout) {
  struct model_spec s = parse(GPT_SPEC);
  tensor_backend_t be;
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0);
  int calls = 0;
  struct model_tp tp = {.rank = 1, .size = 4, .all_reduce = failing_all_reduce, .arg = &calls};
  struct model m;
  cr_assert_eq(model_init_tp(&m, &s, 1, 3, be, ROWS, &tp, &e), 0, "%s", e.msg);
  struct optim_config cfg;
  optim_config_default(&cfg);
  cfg.kind = OPTIM_ADAMW;
  cfg.weight_decay = 0.1;
  struct optim o;
  cr_assert_eq(optim_init(&o, &cfg, &m, &e), 0, "%s", e.msg);
  cr_assert_eq(o.nparams, m.nparams);
  int64_t covered = 0;
  for (size_t k = 0; k < o.nspans; k++) {
    covered += o.spans[k].count;
    for (size_t i = 0; i < m.tp_layout.local.n; i++) {
      const struct model_param *p = &m.tp_layout.local.p[i];
      int64_t a = p->offset - m.param_base;
      if (a >= o.spans[k].offset && a < o.spans[k].offset + o.spans[k].count)
        cr_assert_eq(p->decay, o.spans[k].decay, "%s", p->name);
    }
  }
  cr_assert_eq(covered, m.nparams);
  cr_assert_eq(calls, 0);
  optim_free(&o);
  model_free(&m);
  tensor_backend_close(be);
}
