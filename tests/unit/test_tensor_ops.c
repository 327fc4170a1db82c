/* Every CPU-backend op against the plain reference ops, on fresh random
 * inputs of several shapes (including ones that are not multiples of any
 * vector width), with |got − ref| ≤ atol + rtol·|ref| and a NaN/Inf check. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_ref.h"
#include "../support/tensor_check.h"

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  tensor_backend_set_threads(be, 2);
  rng_seed_suite(12345);
}
static void teardown(void) { tensor_backend_close(be); }

TestSuite(tensor_cpu, .init = setup, .fini = teardown);

Test(tensor_cpu, gemm_all_transposes_and_odd_shapes) {
  const int shapes[][3] = {{1, 1, 1}, {7, 5, 3}, {33, 17, 65}, {128, 10, 256}, {64, 129, 31}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    int m = shapes[s][0], n = shapes[s][1], k = shapes[s][2];
    for (int ta = 0; ta < 2; ta++)
      for (int tb = 0; tb < 2; tb++)
        for (int bz = 0; bz < 2; bz++) {
          float beta = bz ? 0.5f : 0.0f, alpha = 1.25f;
          int64_t as[2] = {ta ? k : m, ta ? m : k}, bs[2] = {tb ? n : k, tb ? k : n}, cs[2] = {m, n};
          float *ah = rand_host(m * k, 1), *bh = rand_host(k * n, 1), *ch = rand_host(m * n, 1);
          float *ref = xmalloc((size_t)(m * n) * sizeof *ref);
          memcpy(ref, ch, (size_t)(m * n) * sizeof *ref);
          tensor_ref_gemm(ta, tb, m, n, k, alpha, ah, bh, beta, ref);
          struct tensor a = dev_from(ah, 2, as), b = dev_from(bh, 2, bs), c = dev_from(ch, 2, cs);
          if (!bz) tensor_fill(&c, NAN); /* beta = 0 must ignore C's old contents, NaN included */
          tensor_gemm(ta, tb, alpha, &a, &b, beta, &c);
          float *got = to_host(&c);
          char what[96];
          snprintf(what, sizeof what, "gemm %dx%dx%d ta=%d tb=%d beta=%g", m, n, k, ta, tb, beta);
          expect_close(what, got, ref, m * n, 1e-5, 1e-4);
          free(ah), free(bh), free(ch), free(ref), free(got);
          tensor_free(&a), tensor_free(&b), tensor_free(&c);
        }
  }
}

/* A matrix view with no columns: nothing to do, and rows_of must not divide
 * by its zero extent (it did: SIGFPE). */
Test(tensor_cpu, bias_ops_on_a_view_without_columns_do_nothing) {
  const int64_t full_shape[2] = {4, 3}, empty[2] = {4, 0}, none = 0;
  float *h = rand_host(12, 2);
  struct tensor full = dev_from(h, 2, full_shape);
  struct tensor y = tensor_view(&full, 0, 2, empty), b = tensor_view(&full, 0, 1, &none);
  tensor_bias_add(&y, &b);
  tensor_bias_grad(&y, &b, 0.0f);
  float *got = to_host(&full);
  cr_assert_eq(memcmp(got, h, 12 * sizeof *h), 0, "an op on an empty view changed the buffer");
  free(got), free(h);
  tensor_free(&full);
}

Test(tensor_cpu, bias_add_and_bias_grad) {
  const int64_t shapes[][2] = {{1, 1}, {3, 7}, {128, 512}, {300, 257}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    int64_t R = shapes[s][0], C = shapes[s][1];
    float *yh = rand_host(R * C, 2), *bh = rand_host(C, 1), *dbh = rand_host(C, 1);
    float *ref = xmalloc((size_t)(R * C) * sizeof *ref), *dbref = xmalloc((size_t)C * sizeof *dbref);
    memcpy(ref, yh, (size_t)(R * C) * sizeof *ref);
    tensor_ref_bias_add(ref, bh, R, C);
    struct tensor y = dev_from(yh, 2, shapes[s]), b = dev_from(bh, 1, &C);
    tensor_bias_add(&y, &b);
    float *got = to_host(&y);
    expect_close("bias_add", got, ref, R * C, 1e-6, 1e-6);
    for (int beta_i = 0; beta_i < 2; beta_i++) {
      float beta = beta_i ? 0.75f : 0.0f;
      memcpy(dbref, dbh, (size_t)C * sizeof *dbref);
      tensor_ref_bias_grad(yh, dbref, R, C, beta);
      struct tensor dy = dev_from(yh, 2, shapes[s]), db = dev_from(dbh, 1, &C);
      if (!beta_i) tensor_fill(&db, NAN);
      tensor_bias_grad(&dy, &db, beta);
      float *dbg = to_host(&db);
      /* float column sums of R values up to 2 in magnitude */
      expect_close("bias_grad", dbg, dbref, C, 2.5e-7 * (double)R, 1e-5);
      free(dbg);
      tensor_free(&dy), tensor_free(&db);
    }
    free(yh), free(bh), free(dbh), free(ref), free(dbref), free(got);
    tensor_free(&y), tensor_free(&b);
  }
}

typedef void (*unary_fn)(const struct tensor *, struct tensor *);
typedef void (*unary_ref)(const float *, float *, int64_t);
typedef void (*binary_fn)(const struct tensor *, const struct tensor *, struct tensor *);
typedef void (*binary_ref)(const float *, const float *, float *, int64_t);

static void check_unary(const char *name, unary_fn fn, unary_ref ref_fn, double atol, double rtol) {
  const int64_t sizes[] = {1, 5, 1000, 65537, 200003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    int64_t n = sizes[s];
    float *xh = rand_host(n, 4), *ref = xmalloc((size_t)n * sizeof *ref);
    ref_fn(xh, ref, n);
    struct tensor x = dev_from(xh, 1, &n), y = dev_nan(1, &n);
    fn(&x, &y);
    float *got = to_host(&y);
    expect_close(name, got, ref, n, atol, rtol);
    fn(&x, &x); /* in place */
    float *got2 = to_host(&x);
    expect_close(name, got2, ref, n, atol, rtol);
    free(xh), free(ref), free(got), free(got2);
    tensor_free(&x), tensor_free(&y);
  }
}

static void check_binary(const char *name, binary_fn fn, binary_ref ref_fn, double atol, double rtol) {
  const int64_t sizes[] = {1, 5, 1000, 65537, 200003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    int64_t n = sizes[s];
    float *xh = rand_host(n, 4), *dyh = rand_host(n, 1), *ref = xmalloc((size_t)n * sizeof *ref);
    ref_fn(xh, dyh, ref, n);
    struct tensor x = dev_from(xh, 1, &n), dy = dev_from(dyh, 1, &n), dx = dev_nan(1, &n);
    fn(&x, &dy, &dx);
    float *got = to_host(&dx);
    expect_close(name, got, ref, n, atol, rtol);
    fn(&x, &dy, &dy); /* dx aliasing dy */
    float *got2 = to_host(&dy);
    expect_close(name, got2, ref, n, atol, rtol);
    free(xh), free(dyh), free(ref), free(got), free(got2);
    tensor_free(&x), tensor_free(&dy), tensor_free(&dx);
  }
}

Test(tensor_cpu, relu_forward_backward) {
  check_unary("relu_fwd", tensor_relu_fwd, tensor_ref_relu_fwd, 0, 0);
  check_binary("relu_bwd", tensor_relu_bwd, tensor_ref_relu_bwd, 0, 0);
}

Test(tensor_cpu, gelu_forward_backward) {
  check_unary("gelu_fwd", tensor_gelu_fwd, tensor_ref_gelu_fwd, 1e-6, 1e-5);
  check_binary("gelu_bwd", tensor_gelu_bwd, tensor_ref_gelu_bwd, 1e-6, 1e-5);
}

Test(tensor_cpu, softmax_cross_entropy) {
  const int64_t shapes[][2] = {{1, 2}, {7, 10}, {128, 10}, {33, 1000}};
  for (size_t s = 0; s < sizeof shapes / sizeof shapes[0]; s++) {
    int64_t R = shapes[s][0], C = shapes[s][1];
    float *lh = rand_host(R * C, 8);
    int32_t *yh = xmalloc((size_t)R * sizeof *yh);
    for (int64_t r = 0; r < R; r++) yh[r] = (int32_t)rng_below(&rng, (uint64_t)C);
    float *dref = xmalloc((size_t)(R * C) * sizeof *dref), *lref = xmalloc((size_t)R * sizeof *lref);
    float scale = 1.0f / (float)R;
    tensor_ref_softmax_xent(lh, yh, dref, lref, R, C, scale);
    struct tensor logits = dev_from(lh, 2, shapes[s]), d = dev_nan(2, shapes[s]), losses = dev_nan(1, &R), labels;
    struct rumor_err e;
    cr_assert_eq(tensor_alloc(&labels, be, TENSOR_I32, 1, &R, &e), 0);
    tensor_copy_from_host(&labels, 0, yh, (size_t)R * sizeof *yh);
    tensor_softmax_xent(&logits, &labels, &d, &losses, scale);
    float *dg = to_host(&d), *lg = to_host(&losses);
    expect_close("softmax_xent dlogits", dg, dref, R * C, 1e-7, 1e-5);
    expect_close("softmax_xent losses", lg, lref, R, 1e-6, 1e-5);
    tensor_softmax_xent(&logits, &labels, &logits, &losses, scale); /* dlogits aliasing logits */
    float *dg2 = to_host(&logits);
    expect_close("softmax_xent in place", dg2, dref, R * C, 1e-7, 1e-5);
    free(lh), free(yh), free(dref), free(lref), free(dg), free(lg), free(dg2);
    tensor_free(&logits), tensor_free(&d), tensor_free(&losses), tensor_free(&labels);
  }
}

Test(tensor_cpu, sgd_momentum_nesterov_and_plain) {
  int64_t n = 100003;
  const struct tensor_sgd cases[] = {
      {.lr = 0.1f, .momentum = 0.9f, .weight_decay = 1e-4f, .nesterov = false},
      {.lr = 0.05f, .momentum = 0.9f, .weight_decay = 0.0f, .nesterov = true},
      {.lr = 0.5f, .momentum = 0.0f, .weight_decay = 1e-3f, .nesterov = false},
  };
  for (size_t c = 0; c < sizeof cases / sizeof cases[0]; c++) {
    float *ph = rand_host(n, 1), *gh = rand_host(n, 1), *mh = rand_host(n, 1);
    float *pref = xmalloc((size_t)n * 4), *mref = xmalloc((size_t)n * 4);
    memcpy(pref, ph, (size_t)n * 4);
    memcpy(mref, mh, (size_t)n * 4);
    struct tensor p = dev_from(ph, 1, &n), g = dev_from(gh, 1, &n), m = dev_from(mh, 1, &n);
    for (int step = 0; step < 3; step++) {
      tensor_ref_sgd_step(pref, gh, mref, n, &cases[c]);
      tensor_sgd_step(&p, &g, cases[c].momentum != 0.0f ? &m : NULL, &cases[c]);
    }
    float *pg = to_host(&p), *mg = to_host(&m);
    expect_close("sgd params", pg, pref, n, 1e-6, 1e-5);
    expect_close("sgd momentum", mg, mref, n, 1e-6, 1e-5);
    free(ph), free(gh), free(mh), free(pref), free(mref), free(pg), free(mg);
    tensor_free(&p), tensor_free(&g), tensor_free(&m);
  }
}

Test(tensor_cpu, adamw_steps) {
  int64_t n = 70001;
  float *ph = rand_host(n, 1), *gh = rand_host(n, 1);
  float *pref = xmalloc((size_t)n * 4), *mref = xcalloc((size_t)n, 4), *vref = xcalloc((size_t)n, 4);
  memcpy(pref, ph, (size_t)n * 4);
  struct tensor p = dev_from(ph, 1, &n), g = dev_from(gh, 1, &n), m = dev_nan(1, &n), v = dev_nan(1, &n);
  tensor_fill(&m, 0);
  tensor_fill(&v, 0);
  for (int step = 1; step <= 5; step++) {
    struct tensor_adamw hp = {.lr = 1e-3f, .beta1 = 0.9f, .beta2 = 0.999f, .eps = 1e-8f, .weight_decay = 0.01f, .step = step};
    tensor_ref_adamw_step(pref, gh, mref, vref, n, &hp);
    tensor_adamw_step(&p, &g, &m, &v, &hp);
  }
  float *pg = to_host(&p), *mg = to_host(&m), *vg = to_host(&v);
  expect_close("adamw params", pg, pref, n, 1e-6, 1e-5);
  expect_close("adamw m", mg, mref, n, 1e-7, 1e-5);
  expect_close("adamw v", vg, vref, n, 1e-8, 1e-5);
  free(ph), free(gh), free(pref), free(mref), free(vref), free(pg), free(mg), free(vg);
  tensor_free(&p), tensor_free(&g), tensor_free(&m), tensor_free(&v);
}

Test(tensor_cpu, axpby_scale_fill) {
  const int64_t sizes[] = {1, 17, 100003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    int64_t n = sizes[s];
    float *xh = rand_host(n, 3), *yh = rand_host(n, 3), *ref = xmalloc((size_t)n * 4);
    struct tensor x = dev_from(xh, 1, &n), y = dev_from(yh, 1, &n);
    for (int64_t i = 0; i < n; i++) ref[i] = (float)(0.3 * xh[i] + -1.7 * yh[i]);
    tensor_axpby(0.3f, &x, -1.7f, &y);
    float *got = to_host(&y);
    expect_close("axpby", got, ref, n, 1e-6, 1e-6);
    free(got);
    tensor_copy_from_host(&y, 0, yh, (size_t)n * 4);
    tensor_scale(&y, -2.5f);
    for (int64_t i = 0; i < n; i++) ref[i] = -2.5f * yh[i];
    got = to_host(&y);
    expect_close("scale", got, ref, n, 0, 1e-7);
    free(got);
    tensor_fill(&y, 3.5f);
    for (int64_t i = 0; i < n; i++) ref[i] = 3.5f;
    got = to_host(&y);
    expect_close("fill", got, ref, n, 0, 0);
    free(got), free(xh), free(yh), free(ref);
    tensor_free(&x), tensor_free(&y);
  }
}

Test(tensor_cpu, reductions_and_nonfinite_count) {
  const int64_t sizes[] = {1, 1023, 1025, 1000003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    int64_t n = sizes[s];
    float *xh = rand_host(n, 2), *yh = rand_host(n, 2);
    double sum = 0, abs_sum = 0, sq = 0, dist = 0;
    for (int64_t i = 0; i < n; i++) {
      sum += xh[i];
      abs_sum += fabs(xh[i]);
      sq += (double)xh[i] * xh[i];
      dist += ((double)xh[i] - yh[i]) * ((double)xh[i] - yh[i]);
    }
    struct tensor x = dev_from(xh, 1, &n), y = dev_from(yh, 1, &n);
    /* Float partial sums over blocks: error bounded by ~1e-6 of Σ|x|. */
    cr_assert(fabs(tensor_sum(&x) - sum) <= 1e-6 * abs_sum + 1e-6, "sum %.9g vs %.9g", tensor_sum(&x), sum);
    cr_assert(fabs(tensor_sq_norm(&x) - sq) <= 1e-5 * sq + 1e-6, "sq_norm %.9g vs %.9g", tensor_sq_norm(&x), sq);
    cr_assert(fabs(tensor_sq_dist(&x, &y) - dist) <= 1e-5 * dist + 1e-6, "sq_dist %.9g vs %.9g",
              tensor_sq_dist(&x, &y), dist);
    cr_assert_eq(tensor_count_nonfinite(&x), 0);
    float bad[3] = {NAN, INFINITY, -INFINITY};
    for (int b = 0; b < 3 && b < n; b++) tensor_copy_from_host(&x, (n - 1) * b / 2, &bad[b], sizeof(float));
    int64_t want = n >= 3 ? 3 : 1;
    cr_assert_eq(tensor_count_nonfinite(&x), want, "count_nonfinite %lld, want %lld",
                 (long long)tensor_count_nonfinite(&x), (long long)want);
    free(xh), free(yh);
    tensor_free(&x), tensor_free(&y);
  }
}

Test(tensor_cpu, count_sketch_matches_reference_and_preserves_distance) {
  int64_t n = 300001;
  int k = 1024;
  float *xh = rand_host(n, 1), *yh = rand_host(n, 1);
  double *ref = xmalloc((size_t)k * sizeof *ref), *got = xmalloc((size_t)k * sizeof *got);
  double *gy = xmalloc((size_t)k * sizeof *gy);
  tensor_ref_count_sketch(xh, n, 77, k, ref);
  struct tensor x = dev_from(xh, 1, &n), y = dev_from(yh, 1, &n);
  tensor_count_sketch(&x, 77, k, got);
  for (int j = 0; j < k; j++)
    cr_assert(fabs(got[j] - ref[j]) <= 1e-9 + 1e-9 * fabs(ref[j]), "bucket %d: %.12g vs %.12g", j, got[j], ref[j]);
  /* Distances: the sketch estimate of ‖x−y‖² is unbiased with relative
   * standard deviation about sqrt(2/k) ≈ 4.4 %; allow 25 %. */
  tensor_count_sketch(&y, 77, k, gy);
  double est = 0;
  for (int j = 0; j < k; j++) est += (got[j] - gy[j]) * (got[j] - gy[j]);
  double exact = tensor_sq_dist(&x, &y);
  cr_assert(fabs(est - exact) < 0.25 * exact, "sketch distance %.6g vs exact %.6g", est, exact);
  free(xh), free(yh), free(ref), free(got), free(gy);
  tensor_free(&x), tensor_free(&y);
}

Test(tensor_cpu, views_and_copies_address_the_right_elements) {
  int64_t n = 1000;
  float *h = rand_host(n, 1);
  struct tensor t = dev_from(h, 1, &n);
  int64_t vs[2] = {10, 20};
  struct tensor v = tensor_view(&t, 100, 2, vs);
  cr_assert_eq(tensor_numel(&v), 200);
  float out[200];
  tensor_copy_to_host(&v, 0, out, sizeof out);
  cr_assert_eq(memcmp(out, h + 100, sizeof out), 0);
  free(h);
  tensor_free(&t);
}

/* Index of the first element where a and b differ, or -1. */
static int64_t first_difference(const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (memcmp(&a[i], &b[i], sizeof *a) != 0) return i;
  return -1;
}

/* tensor.h: CPU events are complete as soon as they are recorded (ops and
 * copies have run by then), and a query never blocks. So on the CPU, with
 * no tensor_event_wait anywhere: an event never recorded is complete; after
 * an async copy and a record, the query is true at once and the copy's data
 * is already in the host buffer. */
Test(tensor_cpu, events_are_complete_at_record_and_async_copies_have_landed) {
  const int64_t n = 1000;
  float *h = rand_host(n, 1); /* in (−1, 1) */
  struct tensor t = dev_from(h, 1, &n);
  float *pinned = tensor_host_alloc(be, (size_t)n * sizeof(float));
  cr_assert_not_null(pinned);
  for (int64_t i = 0; i < n; i++) pinned[i] = 7.0f; /* no element of h */

  tensor_event_t ev = tensor_event_create(be);
  cr_assert_not_null(ev);
  cr_assert(tensor_event_query(ev), "an event never recorded must count as complete");

  tensor_copy_to_host_async(&t, 0, pinned, (size_t)n * sizeof(float));
  tensor_event_record(ev);
  cr_assert(tensor_event_query(ev), "a CPU event must be complete as soon as it is recorded");
  int64_t bad = first_difference(pinned, h, n);
  cr_assert_eq(bad, -1, "the event says complete but element %lld of the async copy is %g, want %g", (long long)bad,
               bad >= 0 ? pinned[bad] : 0.0, bad >= 0 ? h[bad] : 0.0);

  /* An op, then a copy of its result, then a second record on the same
   * event: complete at once again, with the new values (×2 is exact). */
  tensor_scale(&t, 2.0f);
  tensor_copy_to_host_async(&t, 0, pinned, (size_t)n * sizeof(float));
  tensor_event_record(ev);
  cr_assert(tensor_event_query(ev), "a re-recorded CPU event must be complete at once");
  float *twice = xmalloc((size_t)n * sizeof *twice);
  for (int64_t i = 0; i < n; i++) twice[i] = 2.0f * h[i];
  bad = first_difference(pinned, twice, n);
  cr_assert_eq(bad, -1, "after scale and copy, element %lld is %g, want %g", (long long)bad,
               bad >= 0 ? pinned[bad] : 0.0, bad >= 0 ? twice[bad] : 0.0);
  tensor_event_wait(ev); /* complete: returns at once (the suite's timeout catches a hang) */

  tensor_event_destroy(ev);
  tensor_host_free(be, pinned);
  free(twice);
  free(h);
  tensor_free(&t);
}

/* tensor_copy_to_host_beside on the CPU: the copy has happened when the call
 * returns, at the element offset asked, no further, and the event is
 * complete. */
Test(tensor_cpu, a_copy_beside_the_stream_lands_at_once_and_only_its_bytes) {
  const int64_t n = 1000, off = 123, cnt = 456;
  float *h = rand_host(n, 2);
  struct tensor t = dev_from(h, 1, &n);
  float *pinned = tensor_host_alloc(be, (size_t)n * sizeof(float));
  cr_assert_not_null(pinned);
  for (int64_t i = 0; i < n; i++) pinned[i] = 7.0f;
  tensor_event_t ev = tensor_event_create(be);
  cr_assert_not_null(ev);
  tensor_copy_to_host_beside(&t, off, pinned, (size_t)cnt * sizeof(float), ev);
  cr_assert(tensor_event_query(ev), "a CPU event must be complete when the copy returns");
  int64_t bad = first_difference(pinned, h + off, cnt);
  cr_assert_eq(bad, -1, "element %lld of the copy is %g, want %g", (long long)bad, bad >= 0 ? pinned[bad] : 0.0,
               bad >= 0 ? h[off + bad] : 0.0);
  cr_assert_eq(pinned[cnt], 7.0f, "the copy wrote past its byte count");
  tensor_event_destroy(ev);
  tensor_host_free(be, pinned);
  free(h);
  tensor_free(&t);
}

Test(tensor_cpu, the_cpu_has_no_device_memory_figures) {
  size_t f = 1, t = 1;
  cr_assert_not(tensor_backend_mem_info(be, &f, &t), "the CPU backend reports device memory");
}

Test(tensor_cpu, device_specs) {
  tensor_backend_t b2;
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("tpu", &b2, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "tpu") != NULL, "message should name the spec: %s", e.msg);
  cr_assert_eq(tensor_backend_open("cuda:x", &b2, &e), RUMOR_EFORMAT);
  if (tensor_cuda_device_count() == 0) {
    cr_assert_eq(tensor_backend_open("cuda:0", &b2, &e), RUMOR_EDEVICE);
    cr_assert(strstr(e.msg, "cuda:0") != NULL, "%s", e.msg);
    cr_assert_eq(tensor_backend_open("auto", &b2, &e), 0);
    cr_assert_eq(tensor_backend_device(b2), TENSOR_DEVICE_CPU);
    tensor_backend_close(b2);
  }
}

Test(tensor_cpu, diff_stats_is_the_three_reductions_in_one_pass) {
  /* Sizes below and above the parallel threshold, and off the block size. */
  const int64_t sizes[] = {1, 1023, 1025, 1000003};
  for (size_t s = 0; s < sizeof sizes / sizeof sizes[0]; s++) {
    int64_t n = sizes[s];
    float *xh = rand_host(n, 2), *yh = rand_host(n, 2);
    struct tensor x = dev_from(xh, 1, &n), y = dev_from(yh, 1, &n);
    struct tensor_diff_stats st;
    tensor_diff_stats(&x, &y, &st);
    double dist = tensor_sq_dist(&y, &x), norm = tensor_sq_norm(&x);
    cr_assert_eq(st.nonfinite_y, 0, "n=%lld: %lld non-finite in finite data", (long long)n, (long long)st.nonfinite_y);
    cr_assert(fabs(st.sq_dist - dist) <= 1e-6 * dist + 1e-9, "n=%lld: distance %.9g vs %.9g", (long long)n, st.sq_dist,
              dist);
    cr_assert(fabs(st.sq_norm_x - norm) <= 1e-6 * norm + 1e-9, "n=%lld: norm %.9g vs %.9g", (long long)n,
              st.sq_norm_x, norm);
    /* Non-finite values in y are counted (wherever they are), none in x. */
    yh[0] = NAN;
    yh[n - 1] = INFINITY;
    if (n > 2) yh[n / 2] = -INFINITY;
    xh[0] = NAN; /* x's own values are not y's problem */
    tensor_copy_from_host(&y, 0, yh, (size_t)n * 4);
    tensor_copy_from_host(&x, 0, xh, (size_t)n * 4);
    tensor_diff_stats(&x, &y, &st);
    int64_t want = n > 2 ? 3 : n;
    cr_assert_eq(st.nonfinite_y, want, "n=%lld: counted %lld non-finite, want %lld", (long long)n,
                 (long long)st.nonfinite_y, (long long)want);
    free(xh), free(yh);
    tensor_free(&x), tensor_free(&y);
  }
}

Test(tensor_cpu, a_host_mirror_is_the_buffer_itself_on_the_cpu) {
  int64_t n = 1000;
  float *h = tensor_host_alloc(be, (size_t)n * 4), *xh = rand_host(n, 1);
  struct tensor x = dev_from(xh, 1, &n), m;
  struct rumor_err e;
  cr_assert_eq(tensor_mirror_host(&m, &x, h, &e), 0, "%s", e.msg);
  cr_assert(m.data == (void *)h && !m.owner, "the CPU mirror should be a view of the host buffer");
  for (int64_t i = 0; i < n; i++) h[i] = (float)i;
  tensor_mirror_refresh(&m, h); /* nothing to copy */
  tensor_copy(&x, &m);          /* reads the host buffer as it is now */
  float *got = to_host(&x);
  for (int64_t i = 0; i < n; i++) cr_assert_eq(got[i], (float)i, "element %lld", (long long)i);
  tensor_free(&m); /* a view: frees nothing */
  h[0] = 7;        /* still ours */
  free(got), free(xh);
  tensor_free(&x);
  tensor_host_free(be, h);
}

/* The CPU's side of ZeRO's giving back: tensor_discard returns whole pages
 * (they read as zeros after), what lies outside them is kept, the
 * discardable switch changes nothing, tensor_recommit has nothing to do,
 * and the backend does not count device memory (-1). */
Test(tensor_cpu, discard_returns_whole_pages_and_recommit_needs_nothing) {
  struct rumor_err e = {0};
  const int64_t n = 1 << 20; /* 4 MiB of floats */
  struct tensor x;
  tensor_backend_set_discardable(be, true);
  cr_assert_eq(tensor_alloc(&x, be, TENSOR_F32, 1, &n, &e), 0, "%s", e.msg);
  tensor_backend_set_discardable(be, false);
  tensor_fill(&x, 1.0f);
  const int64_t a = 1000, b = n - 1000;
  tensor_discard(&x, a, b - a);
  const float *v = x.data;
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; i++) {
    if (i < a || i >= b) cr_assert_eq(v[i], 1.0f, "element %lld outside the range changed", (long long)i);
    else zeros += v[i] == 0.0f;
  }
  cr_assert_geq(zeros, b - a - 2 * 4096, "only %lld of the discarded elements read as zero", (long long)zeros);
  cr_assert_eq(tensor_recommit(&x, a, b - a, &e), 0);
  struct tensor mid = tensor_view(&x, a, 1, (int64_t[]){b - a});
  tensor_fill(&mid, 2.0f);
  for (int64_t i = 0; i < n; i++) cr_assert_eq(v[i], i < a || i >= b ? 1.0f : 2.0f);
  cr_assert_eq(tensor_backend_live_bytes(be), -1);
  cr_assert_eq(tensor_backend_peak_bytes(be, true), -1);
  tensor_free(&x);
}
