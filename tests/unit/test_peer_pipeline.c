/* Model-parallel planning and math, in one process: the stage split is the
 * cost-optimal contiguous split (checked against brute force); GPipe and
 * 1F1B action lists are complete, respect the pipeline's dependencies, never
 * deadlock, store the activations they promise, and have the bubble
 * (S−1)/(M+S−1); micro-batch rows partition a batch; a model built for a
 * layer range holds exactly the whole model's initial values; and chained
 * stages summing micro-batch gradients give the whole-batch gradient. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/pipeline/pipeline.h"

static struct model_spec spec_of(const char *s) {
  struct model_spec sp;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &sp, &e), 0, "%s", e.msg);
  return sp;
}

/* ---- split ---- */

/* The MLP's layer widths, from what the spec says at its boundaries. */
static int64_t width(const struct model_spec *s, int l) {
  struct model_io io;
  model_spec_io(s, &io);
  int L = model_spec_units(s);
  return l == 0 ? io.input_per_row : l == L ? io.classes : model_spec_boundary(s, l);
}

/* A layer's share of the parameters plus its share of the training
 * multiply-adds (3 per weight and sample; 2 for the first layer, whose input
 * needs no gradient). */
static double layer_cost(const struct model_spec *s, int l) {
  double P = (double)model_spec_param_count(s), F = 0;
  for (int k = 0; k < model_spec_units(s); k++) F += (k ? 3.0 : 2.0) * (double)(width(s, k) * width(s, k + 1));
  double p = (double)(width(s, l + 1) * width(s, l) + width(s, l + 1));
  return p / P + (l ? 3.0 : 2.0) * (double)(width(s, l) * width(s, l + 1)) / F;
}

static double max_stage_cost(const struct model_spec *s, const int *first, int stages) {
  double worst = 0;
  for (int k = 0; k < stages; k++) {
    double c = 0;
    for (int l = first[k]; l < first[k + 1]; l++) c += layer_cost(s, l);
    worst = fmax(worst, c);
  }
  return worst;
}

/* The best largest-stage cost over every contiguous split, by brute force. */
static double brute_best(const struct model_spec *s, int stages, int *first, int k, double best) {
  int L = model_spec_units(s);
  if (k == stages) {
    first[stages] = L;
    return fmin(best, max_stage_cost(s, first, stages));
  }
  for (int start = first[k - 1] + 1; start <= L - (stages - k); start++) {
    first[k] = start;
    best = brute_best(s, stages, first, k + 1, best);
  }
  return best;
}

Test(pipe_split, equal_layers_split_evenly) {
  struct model_spec s = spec_of("mlp:784-784-784-784-784-10");
  struct pipe_split sp;
  struct rumor_err e;
  cr_assert_eq(pipe_split_balance(&s, 2, &sp, &e), 0);
  cr_assert(sp.first[0] == 0 && sp.first[1] == 2 && sp.first[2] == 5, "split %d,%d,%d", sp.first[0], sp.first[1],
            sp.first[2]);
  cr_assert_eq(pipe_split_balance(&s, 4, &sp, &e), 0);
  int want[] = {0, 1, 2, 3, 5};
  for (int i = 0; i <= 4; i++) cr_assert_eq(sp.first[i], want[i], "cut %d is %d, want %d", i, sp.first[i], want[i]);
  char buf[256];
  pipe_split_format(&sp, buf, sizeof buf);
  cr_assert_str_eq(buf, "0,1,2,3,5");
  pipe_split_describe(&s, &sp, 3, buf, sizeof buf);
  cr_assert(strncmp(buf, "stage 3/4: layers 3-4 (784-784-10)", 34) == 0, "%s", buf);
}

Test(pipe_split, balance_is_optimal_against_brute_force) {
  struct rng r;
  rng_seed(&r, 42, 0);
  for (int trial = 0; trial < 300; trial++) {
    int L = 1 + (int)rng_below(&r, 9);
    char text[256];
    int n = snprintf(text, sizeof text, "mlp:%d", 1 + (int)rng_below(&r, 2000));
    for (int l = 0; l < L; l++) n += snprintf(text + n, sizeof text - (size_t)n, "-%d", 1 + (int)rng_below(&r, 2000));
    struct model_spec s = spec_of(text);
    for (int S = 1; S <= L; S++) {
      struct pipe_split sp;
      struct rumor_err e;
      cr_assert_eq(pipe_split_balance(&s, S, &sp, &e), 0, "%s", e.msg);
      cr_assert(sp.stages == S && sp.first[0] == 0 && sp.first[S] == L);
      for (int k = 0; k < S; k++) cr_assert_lt(sp.first[k], sp.first[k + 1], "%s S=%d: stage %d is empty", text, S, k);
      int first[PIPE_MAX_STAGES + 1] = {0};
      double best = brute_best(&s, S, first, 1, INFINITY);
      double got = max_stage_cost(&s, sp.first, S);
      cr_assert(got <= best * (1 + 1e-12), "%s S=%d: largest stage costs %.6f, the best split %.6f", text, S, got, best);
      int64_t p = 0;
      for (int k = 0; k < S; k++) p += pipe_split_params(&s, &sp, k);
      cr_assert_eq(p, model_spec_param_count(&s));
    }
  }
}

Test(pipe_split, too_many_stages_is_a_clear_error) {
  struct model_spec s = spec_of("mlp:784-64-10");
  struct pipe_split sp;
  struct rumor_err e;
  cr_assert_eq(pipe_split_balance(&s, 3, &sp, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "3 stages cannot split mlp:784-64-10: it has 2 layers"), "%s", e.msg);
  cr_assert_eq(pipe_split_balance(&s, 0, &sp, &e), RUMOR_EFORMAT);
}

/* ---- schedules ---- */

static void check_actions(enum pipe_schedule sched, int S, int M) {
  for (int s = 0; s < S; s++) {
    struct pipe_action a[2 * 64];
    pipe_schedule_actions(sched, S, s, M, a);
    bool seen[2][64] = {{false}};
    int held = 0, peak = 0;
    for (int i = 0; i < 2 * M; i++) {
      cr_assert(a[i].mb >= 0 && a[i].mb < M);
      cr_assert(!seen[a[i].op][a[i].mb], "%s S=%d M=%d stage %d runs %c%d twice", pipe_schedule_name(sched), S, M, s,
                a[i].op == PIPE_F ? 'F' : 'B', a[i].mb);
      seen[a[i].op][a[i].mb] = true;
      if (a[i].op == PIPE_B) cr_assert(seen[PIPE_F][a[i].mb], "B%d before F%d", a[i].mb, a[i].mb);
      held += a[i].op == PIPE_F ? 1 : -1;
      peak = held > peak ? held : peak;
    }
    cr_assert_eq(peak, pipe_schedule_peak_stash(sched, S, s, M), "%s S=%d M=%d stage %d holds %d, promised %d",
                 pipe_schedule_name(sched), S, M, s, peak, pipe_schedule_peak_stash(sched, S, s, M));
    int bound = sched == PIPE_GPIPE ? M : (S - s < M ? S - s : M);
    cr_assert_eq(peak, bound);
  }
}

Test(pipe_schedule, actions_are_complete_ordered_and_bound_their_stash) {
  for (int S = 1; S <= 8; S++)
    for (int M = 1; M <= 24; M++) {
      check_actions(PIPE_GPIPE, S, M);
      check_actions(PIPE_1F1B, S, M);
    }
}

Test(pipe_schedule, simulated_bubble_is_the_theoretical_one_and_nothing_deadlocks) {
  for (int S = 1; S <= 8; S++)
    for (int M = 1; M <= 32; M++)
      for (int sc = 0; sc < 2; sc++) {
        enum pipe_schedule sched = sc ? PIPE_1F1B : PIPE_GPIPE;
        double idle[PIPE_MAX_STAGES];
        /* Backward twice the forward, as for a linear layer. */
        double span = pipe_schedule_simulate(sched, S, M, 1.0, 2.0, idle);
        cr_assert_gt(span, 0, "%s S=%d M=%d deadlocks", pipe_schedule_name(sched), S, M);
        cr_assert(fabs(span - (M + S - 1) * 3.0) < 1e-9, "%s S=%d M=%d: step takes %g, want %g",
                  pipe_schedule_name(sched), S, M, span, (M + S - 1) * 3.0);
        for (int s = 0; s < S; s++)
          cr_assert(fabs(idle[s] - pipe_bubble_theory(S, M)) < 1e-12, "%s S=%d M=%d stage %d idles %g, theory %g",
                    pipe_schedule_name(sched), S, M, s, idle[s], pipe_bubble_theory(S, M));
      }
}

Test(pipe_schedule, names_parse_and_bad_ones_are_refused) {
  enum pipe_schedule s;
  cr_assert_eq(pipe_schedule_parse("gpipe", &s), 0);
  cr_assert_eq(s, PIPE_GPIPE);
  cr_assert_eq(pipe_schedule_parse("1f1b", &s), 0);
  cr_assert_eq(s, PIPE_1F1B);
  cr_assert_eq(pipe_schedule_parse("1F1B", &s), RUMOR_EFORMAT);
  cr_assert_str_eq(pipe_schedule_name(PIPE_1F1B), "1f1b");
}

Test(pipe_micro, rows_partition_the_batch_in_order) {
  for (int64_t rows = 1; rows <= 70; rows++)
    for (int M = 1; M <= 16; M++) {
      int n = pipeline_micro_count(rows, M);
      cr_assert_eq(n, rows < M ? rows : M);
      int64_t next = 0, lo = rows, hi = 0;
      for (int i = 0; i < n; i++) {
        int64_t off, cnt;
        pipeline_micro_rows(rows, M, i, &off, &cnt);
        cr_assert_eq(off, next, "rows %lld M %d: micro-batch %d starts at %lld", (long long)rows, M, i, (long long)off);
        cr_assert_geq(cnt, 1);
        next += cnt;
        lo = cnt < lo ? cnt : lo, hi = cnt > hi ? cnt : hi;
      }
      cr_assert_eq(next, rows);
      cr_assert_leq(hi - lo, 1);
      cr_assert_leq(hi, (rows + M - 1) / M);
    }
}

/* ---- the math of stages ---- */

static tensor_backend_t cpu(void) {
  tensor_backend_t be;
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  tensor_backend_set_threads(be, 1);
  return be;
}

Test(pipe_math, layer_range_models_hold_the_whole_models_initial_values) {
  tensor_backend_t be = cpu();
  struct model_spec s = spec_of("mlp:20-16-12-8-4:gelu");
  struct model full, part;
  struct rumor_err e;
  cr_assert_eq(model_init_full(&full, &s, be, 4, &e), 0);
  model_init_params(&full, 9);
  int L = model_spec_units(&s);
  for (int l0 = 0; l0 < L; l0++)
    for (int l1 = l0 + 1; l1 <= L; l1++) {
      cr_assert_eq(model_init(&part, &s, l0, l1, be, 4, &e), 0, "%s", e.msg);
      model_init_params(&part, 9);
      int64_t want = 0;
      for (int l = l0; l < l1; l++) want += width(&s, l + 1) * (width(&s, l) + 1);
      cr_assert_eq(part.nparams, want);
      cr_assert_eq(memcmp(part.params.data, (float *)full.params.data + part.param_base,
                          (size_t)part.nparams * sizeof(float)),
                   0, "layers [%d, %d) differ from the whole model's", l0, l1);
      model_free(&part);
    }
  model_free(&full);
  tensor_backend_close(be);
}

/* Two stages [0, k) and [k, L) run micro-batch by micro-batch by hand
 * (what the pipeline does, without the network): their summed gradients
 * equal the whole model's batch gradient. */
static void expect_stage_gradients_equal_full(const char *spec_text, int k, int64_t rows, int M) {
  tensor_backend_t be = cpu();
  struct model_spec s = spec_of(spec_text);
  int L = model_spec_units(&s);
  struct rumor_err e;
  struct model full, a, b;
  cr_assert_eq(model_init_full(&full, &s, be, rows, &e), 0);
  int64_t mb = (rows + M - 1) / M;
  cr_assert_eq(model_init(&a, &s, 0, k, be, mb, &e), 0);
  cr_assert_eq(model_init(&b, &s, k, L, be, mb, &e), 0);
  model_init_params(&full, 3), model_init_params(&a, 3), model_init_params(&b, 3);
  int64_t in = width(&s, 0), mid = width(&s, k);
  float *x = xmalloc((size_t)(rows * in) * sizeof(float));
  int32_t *y = xmalloc((size_t)rows * sizeof(int32_t));
  struct rng r;
  rng_seed(&r, 5, 0);
  for (int64_t i = 0; i < rows * in; i++) x[i] = rng_normal(&r);
  for (int64_t i = 0; i < rows; i++) y[i] = (int32_t)rng_below(&r, (uint64_t)width(&s, L));
  tensor_copy_from_host(model_act(&full, 0), 0, x, (size_t)(rows * in) * sizeof(float));
  tensor_copy_from_host(&full.labels, 0, y, (size_t)rows * sizeof(int32_t));
  model_forward_backward(&full, rows);

  struct tensor din, g;
  int64_t dshape[2] = {mb, mid};
  cr_assert_eq(tensor_alloc(&din, be, TENSOR_F32, 2, dshape, &e), 0);
  cr_assert_eq(tensor_alloc(&g, be, TENSOR_F32, 2, dshape, &e), 0);
  float *h = xmalloc((size_t)(mb * mid) * sizeof(float));
  for (int i = 0; i < pipeline_micro_count(rows, M); i++) {
    int64_t off, cnt;
    pipeline_micro_rows(rows, M, i, &off, &cnt);
    tensor_copy_from_host(model_act(&a, 0), 0, x + off * in, (size_t)(cnt * in) * sizeof(float));
    model_forward(&a, 0, k, cnt);
    tensor_copy_to_host(model_act(&a, k), 0, h, (size_t)(cnt * mid) * sizeof(float));
    tensor_copy_from_host(model_act(&b, k), 0, h, (size_t)(cnt * mid) * sizeof(float));
    model_forward(&b, k, L, cnt);
    tensor_copy_from_host(&b.labels, 0, y + off, (size_t)cnt * sizeof(int32_t));
    model_loss(&b, cnt, model_act(&b, L), 1.0f / (float)rows);
    model_backward(&b, k, L, cnt, model_act(&b, L), &din, i > 0);
    /* Over the "wire" into stage a's output gradient buffer (its own
     * output acts[k] stays: ReLU's backward reads it). */
    tensor_copy_to_host(&din, 0, h, (size_t)(cnt * mid) * sizeof(float));
    tensor_copy_from_host(&g, 0, h, (size_t)(cnt * mid) * sizeof(float));
    model_backward(&a, 0, k, cnt, &g, NULL, i > 0);
  }
  tensor_free(&g);
  const float *fg = full.grads.data;
  const float *parts[2] = {a.grads.data, b.grads.data};
  int64_t counts[2] = {a.nparams, b.nparams}, base = 0;
  double worst = 0, gmax = 0;
  for (int64_t j = 0; j < full.nparams; j++) gmax = fmax(gmax, fabs(fg[j]));
  for (int p = 0; p < 2; p++) {
    for (int64_t j = 0; j < counts[p]; j++) {
      double d = fabs((double)parts[p][j] - fg[base + j]);
      double norm = d / (1e-6 * gmax + 1e-5 * fabs(fg[base + j]));
      cr_assert(isfinite(parts[p][j]));
      worst = fmax(worst, norm);
      cr_assert(norm <= 1, "%s split at %d, %lld rows in %d: gradient %lld is %.9g, the whole model's %.9g", spec_text, k,
                (long long)rows, M, (long long)(base + j), parts[p][j], fg[base + j]);
    }
    base += counts[p];
  }
  cr_assert_eq(base, full.nparams);
  fprintf(stderr, "%s split at %d, %lld rows in %d micro-batches: worst normalised gradient error %.3g\n", spec_text, k,
          (long long)rows, M, worst);
  free(x), free(y), free(h);
  tensor_free(&din);
  model_free(&full), model_free(&a), model_free(&b);
  tensor_backend_close(be);
}

Test(pipe_math, summed_micro_batch_gradients_of_two_stages_equal_the_batch_gradient) {
  expect_stage_gradients_equal_full("mlp:30-24-16-10", 1, 32, 4);
  expect_stage_gradients_equal_full("mlp:30-24-16-10", 2, 29, 5);
  expect_stage_gradients_equal_full("mlp:30-24-16-10:gelu", 2, 17, 3);
  expect_stage_gradients_equal_full("mlp:30-24-16-12-10:gelu", 1, 8, 8);
}
