/*
 * The CUDA backend against the plain reference ops (tensor_ref_* and host
 * loops), op by op, on fresh random inputs of several sizes.
 *
 * - Sizes include 1, sizes that are not multiples of any block size, and
 *   sizes past the kernels' grid caps, so grid-stride loops take a second
 *   lap (kernels/kernels.cu: 8192 blocks of 256 threads for element-wise
 *   kernels, 8192·8 rows for softmax, 8192·32 columns for bias_grad,
 *   1024·256 for reductions, 512·256 for the shared-memory sketch).
 * - Every device tensor is a view with GUARD sentinel elements on each
 *   side (checked after each op: nothing written out of bounds) and starts
 *   filled with NaN (an output element the op forgot to write fails).
 * - Comparisons are element-wise, |got − ref| <= atol + rtol·|ref|, with
 *   NaN/Inf in `got` allowed only where `ref` has the same; a failure names
 *   the worst element (index, got, ref) and the random seed.
 * - Each numeric op also runs on small integers, where FP32 results are
 *   exact: any element missed or counted twice shows as a wrong value.
 *
 * Every GPU test skips with "no CUDA GPU: ..." when
 * tensor_cuda_device_count() is 0. The tests of backend selection and of
 * the device sketch hash (compiled for the host) run everywhere.
 *
 * RUMOR_TEST_SEED=<n> in the environment repeats a run's random inputs.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kernels/kernels.h" /* kern_sketch_hash_host: the device hash, host build */
#include "tensor/tensor_ref.h"

/* Present only in CUDA builds; weak so that the CPU-only build links. */
#pragma weak kern_sketch_hash_host

#include "../support/cuda_check.h"

/* [rows, cols] shapes for row-wise ops: tiny, odd, a row count past the
 * softmax and bias_add grid caps (65536 rows), and a column count past the
 * bias_grad and bias_add caps (262144 columns), and GPT-2's 8192 rows of
 * 768. */
static const int64_t kMatShapes[][2] = {{1, 1},      {3, 5},     {37, 33},    {1000, 10},
                                        {129, 1025}, {70001, 3}, {3, 300007}, {8192, 768}};
#define NMATSHAPES ((int)(sizeof kMatShapes / sizeof kMatShapes[0]))

/* ==== tests that run everywhere ==================================================== */

Test(cuda_select, auto_opens_cuda_when_a_gpu_is_usable_else_the_cpu) {
  tensor_backend_t be = NULL;
  struct rumor_err e = {0};
  int rc = tensor_backend_open("auto", &be, &e);
  cr_assert_eq(rc, 0, "tensor_backend_open(\"auto\") failed: %s", e.msg);
  if (tensor_cuda_device_count() > 0) {
    cr_assert_eq(tensor_backend_device(be), TENSOR_DEVICE_CUDA);
    cr_assert_str_eq(tensor_backend_name(be), "cuda:0");
  } else {
    cr_assert_eq(tensor_backend_device(be), TENSOR_DEVICE_CPU, "auto without a GPU must fall back to the CPU");
    cr_assert_str_eq(tensor_backend_name(be), "cpu");
  }
  tensor_backend_close(be);
}

Test(cuda_select, cuda_without_a_usable_gpu_is_an_error_naming_the_spec) {
  int count = tensor_cuda_device_count();
  if (!tensor_cuda_compiled()) cr_assert_eq(count, 0, "built without CUDA, yet %d devices counted", count);

  /* One past the last device is never usable, with or without a GPU. */
  char spec[32];
  snprintf(spec, sizeof spec, "cuda:%d", count);
  const char *specs[] = {spec, count == 0 ? "cuda" : spec};
  for (int i = 0; i < 2; i++) {
    tensor_backend_t be = (tensor_backend_t)1;
    struct rumor_err e = {0};
    int rc = tensor_backend_open(specs[i], &be, &e);
    cr_assert_eq(rc, RUMOR_EDEVICE, "tensor_backend_open(\"%s\") returned %d, want RUMOR_EDEVICE (%s)", specs[i],
                 rc, e.msg);
    cr_assert_null(be, "a failed open must leave *out NULL");
    cr_assert_eq(e.code, RUMOR_EDEVICE);
    cr_assert(strstr(e.msg, specs[i]) != NULL, "the message must name the device spec '%s': %s", specs[i], e.msg);
    cr_assert(strstr(e.msg, "usable") || strstr(e.msg, "without CUDA"),
              "the message must say why (no usable device / built without CUDA): %s", e.msg);
  }

  tensor_backend_t be = NULL;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_backend_open("cuda:x", &be, &e), RUMOR_EFORMAT, "%s", e.msg);
  cr_assert_eq(tensor_backend_open("cudax", &be, &e), RUMOR_EFORMAT, "%s", e.msg);
}

/* tensor_cuda_device_count() as a fresh process sees it (the count is
 * asked once per process) with CUDA_VISIBLE_DEVICES set to `visible`, or
 * as inherited when NULL. The caller must not have touched CUDA yet: a
 * forked child cannot use a CUDA context made before the fork. */
static int device_count_in_child(const char *visible) {
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    if (visible) setenv("CUDA_VISIBLE_DEVICES", visible, 1);
    int n = tensor_cuda_device_count();
    _exit(n < 0 ? 255 : n > 254 ? 254 : n);
  }
  int status;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 255, "the counting child failed (status %d)", status);
  return WEXITSTATUS(status);
}

/* The count against references that do not come from it: the CUDA
 * runtime's own device filter (none visible: 0; one named: 1 when there is
 * a GPU), and opening each device number it claims (no over-count; one
 * past the end failing is checked above). */
Test(cuda_select, device_count_follows_cuda_visible_devices_and_each_counted_device_opens) {
  cr_assert_eq(device_count_in_child(""), 0, "CUDA_VISIBLE_DEVICES=\"\" hides every device, yet some were counted");
  int all = device_count_in_child(NULL);
  if (!tensor_cuda_compiled()) cr_assert_eq(all, 0, "built without CUDA, yet %d devices counted", all);
  if (all > 0) {
    /* The first device of the inherited list ("0" when there is none). */
    char first[128] = "0";
    const char *inherited = getenv("CUDA_VISIBLE_DEVICES");
    if (inherited && *inherited) snprintf(first, sizeof first, "%.*s", (int)strcspn(inherited, ","), inherited);
    int one = device_count_in_child(first);
    cr_assert_eq(one, 1, "CUDA_VISIBLE_DEVICES=%s names one device; %d counted", first, one);
  }
  int here = tensor_cuda_device_count();
  cr_assert_eq(here, all, "this process counts %d devices, a fresh one with the same environment %d", here, all);
  for (int i = 0; i < all; i++) {
    char spec[32];
    snprintf(spec, sizeof spec, "cuda:%d", i);
    tensor_backend_t be = NULL;
    struct rumor_err e = {0};
    cr_assert_eq(tensor_backend_open(spec, &be, &e), 0, "%d devices counted, but %s does not open: %s", all, spec,
                 e.msg);
    cr_assert_eq(tensor_backend_device(be), TENSOR_DEVICE_CUDA);
    cr_assert_str_eq(tensor_backend_name(be), spec);
    tensor_backend_close(be);
  }
}

Test(cuda_hash, device_sketch_hash_agrees_with_tensor_sketch_hash) {
  if (!kern_sketch_hash_host) cr_skip_test("no CUDA kernels in this build (built without CUDA)");
  /* Edge values of both 64-bit inputs (each 32-bit half matters), then
   * random pairs. */
  static const uint64_t edges[] = {0,           1,           2,           0x7fffffffu,        0x80000000u,
                                   0xffffffffu, 1ull << 32,  (1ull << 32) + 1, 0x123456789abcdef0ull,
                                   ~0ull - 1,   ~0ull,       0xdeadbeefcafebabeull};
  const int ne = (int)(sizeof edges / sizeof edges[0]);
  for (int a = 0; a < ne; a++)
    for (int b = 0; b < ne; b++)
      cr_assert_eq(kern_sketch_hash_host(edges[a], edges[b]), tensor_sketch_hash(edges[a], edges[b]),
                   "hash(seed=0x%" PRIx64 ", i=0x%" PRIx64 ")", edges[a], edges[b]);
  seed_rng();
  for (int t = 0; t < 200000; t++) {
    uint64_t seed = rng_next_u64(&g_rng), i = rng_next_u64(&g_rng);
    if (t & 1) i >>= 20; /* indices of realistic size too */
    cr_assert_eq(kern_sketch_hash_host(seed, i), tensor_sketch_hash(seed, i),
                 "hash(seed=0x%" PRIx64 ", i=0x%" PRIx64 ")", seed, i);
  }
}

/* ==== GPU tests ========================================================================= */

Test(cuda, backend_is_named_cuda_n_and_supports_every_entry) {
  open_gpu();
  cr_assert_str_eq(tensor_backend_name(g_be), "cuda:0");
  tensor_backend_set_threads(g_be, 4); /* ignored by CUDA; must not crash */
  tensor_backend_sync(g_be);
  close_gpu();
}

Test(cuda, failed_allocation_is_an_error_and_leaves_the_backend_usable) {
  open_gpu();
  struct tensor huge;
  struct rumor_err e = {0};
  int64_t n = (int64_t)1 << 50; /* 4 PiB */
  int rc = tensor_alloc(&huge, g_be, TENSOR_F32, 1, &n, &e);
  cr_assert_eq(rc, RUMOR_EDEVICE, "allocating 4 PiB returned %d (%s)", rc, e.msg);
  cr_assert_null(huge.data);
  cr_assert(strstr(e.msg, "cuda:0") != NULL, "message should name the backend: %s", e.msg);
  cr_assert_null(tensor_host_alloc(g_be, (size_t)1 << 52), "pinned 4 PiB must fail with NULL");

  /* The failure must not leak into later launch checks. */
  struct dev x = dev_vec(1000);
  tensor_fill(&x.t, 2.0f);
  cr_assert_eq(tensor_sum(&x.t), 2000.0);
  close_gpu();
}

Test(cuda, zero_sized_tensors_are_valid_and_ops_on_them_do_nothing) {
  open_gpu();
  struct dev z = dev_vec(0), z2 = dev_vec(0);
  cr_assert_not_null(z.whole->data);
  tensor_fill(&z.t, 1.0f);
  tensor_relu_fwd(&z.t, &z2.t);
  tensor_axpby(1.0f, &z.t, 1.0f, &z2.t);
  cr_assert_eq(tensor_sum(&z.t), 0.0);
  cr_assert_eq(tensor_sq_norm(&z.t), 0.0);
  cr_assert_eq(tensor_sq_dist(&z.t, &z2.t), 0.0);
  cr_assert_eq(tensor_count_nonfinite(&z.t), 0);
  double sk[4] = {1, 1, 1, 1};
  tensor_count_sketch(&z.t, 7, 4, sk);
  for (int j = 0; j < 4; j++) cr_assert_eq(sk[j], 0.0, "bucket %d of an empty sketch is %g", j, sk[j]);

  int64_t s0[2] = {0, 5}, s1[1] = {0};
  struct dev logits = dev_new(2, s0), dl = dev_new(2, s0), losses = dev_new(1, s1);
  struct dev labels = dev_new_g(TENSOR_I32, 1, s1, GUARD);
  tensor_softmax_xent(&logits.t, &labels.t, &dl.t, &losses.t, 1.0f);
  tensor_backend_sync(g_be);
  cr_assert(guards_intact(&z, "ops on empty tensors"), "%s", g_why);
  cr_assert(guards_intact(&z2, "ops on empty tensors"), "%s", g_why);
  cr_assert(guards_intact(&dl, "softmax_xent with 0 rows"), "%s", g_why);
  cr_assert(guards_intact(&losses, "softmax_xent with 0 rows"), "%s", g_why);
  close_gpu();
}

/* ---- GEMM ---- */

struct gemm_case {
  int m, n, k;
};
static const struct gemm_case kGemmCases[] = {{1, 1, 1},     {7, 5, 3},       {5, 7, 1},     {33, 17, 65},
                                              {64, 64, 64},  {130, 67, 257},  {257, 129, 63}, {1, 300, 2},
                                              {300, 1, 17},  {512, 384, 256}, {3, 4, 0}};
#define NGEMM ((int)(sizeof kGemmCases / sizeof kGemmCases[0]))

/* One GEMM on the GPU against tensor_ref_gemm. With beta = 0, C starts as
 * NaN (BLAS must not read it). `ints`: small-integer inputs, exact result. */
static void run_gemm(bool ta, bool tb, struct gemm_case gc, float alpha, float beta, bool ints, int64_t guard) {
  const int m = gc.m, n = gc.n, k = gc.k;
  int mark = arena_mark();
  int64_t sa[2] = {ta ? k : m, ta ? m : k};
  int64_t sb[2] = {tb ? n : k, tb ? k : n};
  int64_t sc[2] = {m, n};
  int64_t na = (int64_t)m * k, nb = (int64_t)k * n, nc = (int64_t)m * n;
  float *ha = hbuf(na), *hb = hbuf(nb), *ref = hbuf(nc), *got = hbuf(nc);
  if (ints) {
    fill_ints(ha, na, 3);
    fill_ints(hb, nb, 3);
  } else {
    fill_normal(ha, na, 0.0f, 1.0f);
    fill_normal(hb, nb, 0.0f, 1.0f);
  }
  struct dev a = dev_new_g(TENSOR_F32, 2, sa, guard), b = dev_new_g(TENSOR_F32, 2, sb, guard),
             c = dev_new_g(TENSOR_F32, 2, sc, guard);
  dev_upload(&a, ha);
  dev_upload(&b, hb);
  if (beta == 0.0f) {
    fill_value(ref, nc, NAN); /* c stays poisoned on the device as well */
  } else {
    if (ints)
      fill_ints(ref, nc, 5);
    else
      fill_normal(ref, nc, 0.0f, 1.0f);
    dev_upload(&c, ref);
  }
  tensor_ref_gemm(ta, tb, m, n, k, alpha, ha, hb, beta, ref);
  tensor_gemm(ta, tb, alpha, &a.t, &b.t, beta, &c.t);
  dev_download(&c, got);

  char what[160];
  snprintf(what, sizeof what, "gemm(%c%c, m=%d n=%d k=%d, alpha=%g beta=%g, %s, guard %" PRId64 ")", ta ? 'T' : 'N',
           tb ? 'T' : 'N', m, n, k, alpha, beta, ints ? "integers" : "normal", guard);
  if (ints)
    cr_assert(matches_exactly(what, got, ref, nc), "%s", g_why);
  else /* FP32 accumulation over k terms of size ~1; TF32 would be ~10x over */
    cr_assert(matches(what, got, ref, nc, 2e-6 * (k + 1), 1e-5), "%s", g_why);
  cr_assert(guards_intact(&c, what), "%s", g_why);
  arena_release(mark);
}

Test(cuda, gemm_matches_reference_for_every_transpose_and_shape) {
  open_gpu();
  for (int i = 0; i < NGEMM; i++)
    for (int t = 0; t < 4; t++) {
      bool ta = t & 1, tb = t & 2;
      int64_t guard = ((i + t) & 1) ? GUARD : GUARD_ALIGNED;
      run_gemm(ta, tb, kGemmCases[i], 1.0f, 0.0f, false, guard);
      run_gemm(ta, tb, kGemmCases[i], -1.25f, 0.5f, false, guard);
    }
  close_gpu();
}

Test(cuda, gemm_is_exact_on_small_integers) {
  open_gpu();
  for (int i = 0; i < NGEMM; i++)
    for (int t = 0; t < 4; t++) {
      bool ta = t & 1, tb = t & 2;
      run_gemm(ta, tb, kGemmCases[i], 2.0f, 0.0f, true, GUARD);
      run_gemm(ta, tb, kGemmCases[i], 1.0f, 0.5f, true, GUARD_ALIGNED);
    }
  close_gpu();
}

/* ---- bias ---- */

Test(cuda, bias_add_matches_reference) {
  open_gpu();
  for (int s = 0; s <= NMATSHAPES; s++) {
    /* The last round is a 1-D y (one row). */
    int64_t rows = s < NMATSHAPES ? kMatShapes[s][0] : 1, cols = s < NMATSHAPES ? kMatShapes[s][1] : 4097;
    int ndim = s < NMATSHAPES ? 2 : 1;
    int64_t shape[2] = {rows, cols}, n = rows * cols;
    const int64_t *yshape = ndim == 2 ? shape : &shape[1];
    int mark = arena_mark();
    float *y = hbuf(n), *bias = hbuf(cols), *got = hbuf(n);
    fill_normal(y, n, 0.0f, 1.0f);
    fill_normal(bias, cols, 0.0f, 1.0f);
    struct dev dy = dev_from(ndim, yshape, y), db = dev_from(1, &cols, bias);
    tensor_bias_add(&dy.t, &db.t);
    tensor_ref_bias_add(y, bias, rows, cols);
    dev_download(&dy, got);
    char what[96];
    snprintf(what, sizeof what, "bias_add [%" PRId64 ", %" PRId64 "] (ndim %d)", rows, cols, ndim);
    cr_assert(matches_exactly(what, got, y, n), "%s", g_why); /* one float add per element */
    cr_assert(guards_intact(&dy, what), "%s", g_why);
    arena_release(mark);
  }
  close_gpu();
}

Test(cuda, bias_grad_matches_reference_with_and_without_beta) {
  open_gpu();
  /* One chunk of rows (<= 256), several, GPT-2's 8192 rows at C = 768 and
   * 4·C, and more rows than 1024 chunks hold (longer chunks). The cap on
   * the partials (KERN_BIAS_PART_MAX) bites only past 2^30 elements, too
   * large for a unit test. */
  static const int64_t shapes[][2] = {{1, 1},     {0, 7},     {5, 3},      {33, 65},     {1000, 10},
                                      {4099, 33}, {3, 300007}, {8192, 768}, {8192, 3072}, {262145, 5}};
  for (int s = 0; s < (int)(sizeof shapes / sizeof shapes[0]); s++)
    for (int v = 0; v < 4; v++) {
      bool ints = v & 1;
      float beta = (v & 2) ? 0.5f : 0.0f;
      int64_t rows = shapes[s][0], cols = shapes[s][1], n = rows * cols, shape[2] = {rows, cols};
      int mark = arena_mark();
      float *dy = hbuf(n), *db = hbuf(cols), *got = hbuf(cols);
      if (ints)
        fill_ints(dy, n, 3);
      else
        fill_normal(dy, n, 0.0f, 1.0f);
      struct dev ddy = dev_from(2, shape, dy), ddb = dev_vec(cols);
      if (beta == 0.0f) {
        fill_value(db, cols, NAN); /* must not be read */
      } else {
        if (ints)
          fill_ints(db, cols, 5);
        else
          fill_normal(db, cols, 0.0f, 1.0f);
        dev_upload(&ddb, db);
      }
      tensor_bias_grad(&ddy.t, &ddb.t, beta);
      tensor_ref_bias_grad(dy, db, rows, cols, beta);
      dev_download(&ddb, got);
      char what[128];
      snprintf(what, sizeof what, "bias_grad [%" PRId64 ", %" PRId64 "] beta=%g %s", rows, cols, beta,
               ints ? "integers" : "normal");
      if (ints)
        cr_assert(matches_exactly(what, got, db, cols), "%s", g_why);
      else /* float column sums of `rows` N(0,1) terms, plus beta·db */
        cr_assert(matches(what, got, db, cols, 2e-6 + 2e-8 * (double)rows, 1e-6), "%s", g_why);
      cr_assert(guards_intact(&ddb, what), "%s", g_why);
      if (beta == 0.0f) { /* deterministic: the chunks depend on the shape only */
        float *again = hbuf(cols);
        tensor_bias_grad(&ddy.t, &ddb.t, 0.0f);
        dev_download(&ddb, again);
        cr_assert(same_bits(what, got, again, cols), "%s (a second run)", g_why);
      }
      arena_release(mark);
    }
  close_gpu();
}

/* ---- activations ---- */

Test(cuda, relu_fwd_and_bwd_match_reference_in_and_out_of_place) {
  open_gpu();
  for (int s = 0; s < NSIZES; s++) {
    int64_t n = kSizes[s];
    int mark = arena_mark();
    float *x = hbuf(n), *y = hbuf(n), *dy = hbuf(n), *dx = hbuf(n), *got = hbuf(n);
    fill_normal(x, n, 0.0f, 1.0f);
    add_specials(x, n);
    fill_normal(dy, n, 0.0f, 1.0f);
    tensor_ref_relu_fwd(x, y, n);
    tensor_ref_relu_bwd(y, dy, dx, n);
    char what[64];

    struct dev dxs = dev_from(1, &n, x), dys = dev_vec(n);
    tensor_relu_fwd(&dxs.t, &dys.t);
    dev_download(&dys, got);
    snprintf(what, sizeof what, "relu_fwd n=%" PRId64, n);
    cr_assert(matches_exactly(what, got, y, n), "%s", g_why);
    cr_assert(guards_intact(&dys, what), "%s", g_why);

    tensor_relu_fwd(&dxs.t, &dxs.t); /* in place */
    dev_download(&dxs, got);
    snprintf(what, sizeof what, "relu_fwd in place n=%" PRId64, n);
    cr_assert(matches_exactly(what, got, y, n), "%s", g_why);
    cr_assert(guards_intact(&dxs, what), "%s", g_why);

    struct dev ddy = dev_from(1, &n, dy), ddx = dev_vec(n);
    tensor_relu_bwd(&dys.t, &ddy.t, &ddx.t);
    dev_download(&ddx, got);
    snprintf(what, sizeof what, "relu_bwd n=%" PRId64, n);
    cr_assert(matches_exactly(what, got, dx, n), "%s", g_why);
    cr_assert(guards_intact(&ddx, what), "%s", g_why);

    tensor_relu_bwd(&dys.t, &ddy.t, &ddy.t); /* dx aliases dy */
    dev_download(&ddy, got);
    snprintf(what, sizeof what, "relu_bwd in place n=%" PRId64, n);
    cr_assert(matches_exactly(what, got, dx, n), "%s", g_why);
    cr_assert(guards_intact(&ddy, what), "%s", g_why);
    arena_release(mark);
  }
  close_gpu();
}

Test(cuda, gelu_fwd_and_bwd_match_reference_in_and_out_of_place) {
  open_gpu();
  /* erff and expf are within 2 ulp on the GPU; near x = −10 the ½x(1+erf)
   * form loses a few 1e-7 absolute to cancellation, as the CPU does. */
  const double atol = 3e-6, rtol = 2e-6;
  for (int s = 0; s < NSIZES; s++) {
    int64_t n = kSizes[s];
    int mark = arena_mark();
    float *x = hbuf(n), *y = hbuf(n), *dy = hbuf(n), *dx = hbuf(n), *got = hbuf(n);
    fill_normal(x, n, 0.0f, 2.0f);
    fill_normal(dy, n, 0.0f, 1.0f);
    tensor_ref_gelu_fwd(x, y, n);
    tensor_ref_gelu_bwd(x, dy, dx, n);
    cr_assert(activation_matches("gelu", tensor_gelu_fwd, tensor_gelu_bwd, x, y, dy, dx, n, got, atol, rtol),
              "%s", g_why);
    arena_release(mark);
  }
  close_gpu();
}

/* ---- softmax cross-entropy ---- */

Test(cuda, softmax_xent_matches_reference_with_and_without_aliasing) {
  open_gpu();
  static const int64_t shapes[][2] = {{1, 1}, {4, 10}, {33, 97}, {128, 1000}, {7, 5000}, {70001, 3}, {2, 31}};
  for (int s = 0; s < (int)(sizeof shapes / sizeof shapes[0]); s++)
    for (int alias = 0; alias < 2; alias++) {
      int64_t rows = shapes[s][0], cols = shapes[s][1], n = rows * cols, shape[2] = {rows, cols};
      float gs = s % 2 ? 1.0f : 1.0f / (float)rows;
      int mark = arena_mark();
      float *x = hbuf(n), *d = hbuf(n), *loss = hbuf(rows), *got_d = hbuf(n), *got_l = hbuf(rows);
      int32_t *lab = hbuf_bytes((size_t)rows * sizeof(int32_t));
      fill_normal(x, n, 0.0f, 4.0f);
      for (int64_t r = 0; r < rows; r++) lab[r] = (int32_t)rng_below(&g_rng, (uint64_t)cols);
      if (rows > 1) lab[rows - 1] = (int32_t)(cols - 1); /* the last column as a label too */
      struct dev dx = dev_from(2, shape, x), dl = dev_vec(rows);
      struct dev dlab = dev_new_g(TENSOR_I32, 1, &rows, GUARD);
      dev_upload(&dlab, lab);
      struct dev dd = alias ? dx : dev_new(2, shape);
      tensor_softmax_xent(&dx.t, &dlab.t, &dd.t, &dl.t, gs);
      tensor_ref_softmax_xent(x, lab, d, loss, rows, cols, gs);
      dev_download(&dd, got_d);
      dev_download(&dl, got_l);
      char what[128];
      snprintf(what, sizeof what, "softmax_xent [%" PRId64 ", %" PRId64 "] grad_scale=%g%s: losses", rows, cols, gs,
               alias ? " (dlogits aliases logits)" : "");
      cr_assert(matches(what, got_l, loss, rows, 1e-5, 1e-5), "%s", g_why);
      cr_assert(guards_intact(&dl, what), "%s", g_why);
      snprintf(what, sizeof what, "softmax_xent [%" PRId64 ", %" PRId64 "] grad_scale=%g%s: dlogits", rows, cols, gs,
               alias ? " (dlogits aliases logits)" : "");
      cr_assert(matches(what, got_d, d, n, 2e-6 * gs, 1e-5), "%s", g_why);
      cr_assert(guards_intact(&dd, what), "%s", g_why);
      arena_release(mark);
    }
  close_gpu();
}

/* ---- optimisers ---- */

Test(cuda, sgd_step_matches_reference_for_each_variant) {
  open_gpu();
  struct {
    struct tensor_sgd hp;
    bool pass_mom; /* with μ = 0: a buffer is passed but must stay untouched */
  } cases[] = {
      {{0.1f, 0.0f, 0.0f, false}, false},  {{0.1f, 0.0f, 1e-2f, false}, false},
      {{0.05f, 0.9f, 0.0f, false}, true},  {{0.05f, 0.9f, 5e-4f, true}, true},
      {{0.1f, 0.0f, 1e-2f, false}, true},  {{0.05f, 0.9f, 1e-2f, false}, true},
  };
  for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++)
    for (int s = 0; s < NSIZES; s++) {
      const struct tensor_sgd *hp = &cases[c].hp;
      int64_t n = kSizes[s];
      int mark = arena_mark();
      float *p = hbuf(n), *g = hbuf(n), *m = hbuf(n), *m0 = hbuf(n), *got = hbuf(n);
      fill_normal(p, n, 0.0f, 1.0f);
      fill_normal(m, n, 0.0f, 0.5f);
      memcpy(m0, m, (size_t)n * sizeof *m);
      struct dev dp = dev_from(1, &n, p), dg = dev_vec(n), dm = dev_from(1, &n, m);
      bool use_mom = cases[c].pass_mom;
      for (int step = 0; step < 2; step++) {
        fill_normal(g, n, 0.0f, 1.0f);
        dev_upload(&dg, g);
        tensor_sgd_step(&dp.t, &dg.t, use_mom ? &dm.t : NULL, hp);
        tensor_ref_sgd_step(p, g, use_mom ? m : NULL, n, hp);
      }
      char what[128];
      snprintf(what, sizeof what, "sgd lr=%g mu=%g wd=%g nesterov=%d mom=%s n=%" PRId64 ": params", hp->lr,
               hp->momentum, hp->weight_decay, hp->nesterov, use_mom ? "yes" : "NULL", n);
      dev_download(&dp, got);
      cr_assert(matches(what, got, p, n, 1e-6, 1e-6), "%s", g_why);
      cr_assert(guards_intact(&dp, what), "%s", g_why);
      if (use_mom) {
        snprintf(what, sizeof what, "sgd lr=%g mu=%g wd=%g nesterov=%d n=%" PRId64 ": momentum", hp->lr,
                 hp->momentum, hp->weight_decay, hp->nesterov, n);
        dev_download(&dm, got);
        if (hp->momentum == 0.0f)
          cr_assert(matches_exactly(what, got, m0, n), "%s", g_why); /* untouched */
        else
          cr_assert(matches(what, got, m, n, 1e-6, 1e-6), "%s", g_why);
        cr_assert(guards_intact(&dm, what), "%s", g_why);
      }
      arena_release(mark);
    }
  close_gpu();
}

Test(cuda, adamw_step_matches_reference) {
  open_gpu();
  static const int64_t steps[] = {1, 10, 1000};
  for (int t = 0; t < 3; t++)
    for (int s = 0; s < NSIZES; s++) {
      struct tensor_adamw hp = {1e-3f, 0.9f, 0.999f, 1e-8f, 0.01f, steps[t]};
      int64_t n = kSizes[s];
      int mark = arena_mark();
      float *p = hbuf(n), *g = hbuf(n), *m = hbuf(n), *v = hbuf(n), *got = hbuf(n);
      fill_normal(p, n, 0.0f, 1.0f);
      fill_normal(m, n, 0.0f, 0.1f);
      fill_normal(v, n, 0.0f, 0.1f);
      for (int64_t i = 0; i < n; i++) v[i] *= v[i];
      struct dev dp = dev_from(1, &n, p), dg = dev_vec(n), dm = dev_from(1, &n, m), dv = dev_from(1, &n, v);
      for (int k = 0; k < 2; k++, hp.step++) {
        fill_normal(g, n, 0.0f, 1.0f);
        dev_upload(&dg, g);
        tensor_adamw_step(&dp.t, &dg.t, &dm.t, &dv.t, &hp);
        tensor_ref_adamw_step(p, g, m, v, n, &hp);
      }
      char what[96];
      const struct dev *outs[3] = {&dp, &dm, &dv};
      const float *refs[3] = {p, m, v};
      const char *names[3] = {"params", "m", "v"};
      for (int o = 0; o < 3; o++) {
        snprintf(what, sizeof what, "adamw steps %" PRId64 "-%" PRId64 " n=%" PRId64 ": %s", steps[t], steps[t] + 1, n,
                 names[o]);
        dev_download(outs[o], got);
        cr_assert(matches(what, got, refs[o], n, 1e-6, 1e-5), "%s", g_why);
        cr_assert(guards_intact(outs[o], what), "%s", g_why);
      }
      arena_release(mark);
    }
  close_gpu();
}

/* ---- axpby, scale, fill ---- */

Test(cuda, axpby_scale_fill_match_host_loops) {
  open_gpu();
  for (int s = 0; s < NSIZES; s++) {
    int64_t n = kSizes[s];
    int mark = arena_mark();
    float *x = hbuf(n), *y = hbuf(n), *ref = hbuf(n), *got = hbuf(n);
    fill_normal(x, n, 0.0f, 1.0f);
    fill_normal(y, n, 0.0f, 1.0f);
    char what[64];

    const float a = 0.7f, b = -1.3f;
    struct dev dx = dev_from(1, &n, x), dy = dev_from(1, &n, y);
    tensor_axpby(a, &dx.t, b, &dy.t);
    for (int64_t i = 0; i < n; i++) ref[i] = a * x[i] + b * y[i];
    dev_download(&dy, got);
    snprintf(what, sizeof what, "axpby n=%" PRId64, n);
    cr_assert(matches(what, got, ref, n, 1e-6, 1e-6), "%s", g_why);
    cr_assert(guards_intact(&dy, what), "%s", g_why);

    tensor_axpby(a, &dx.t, b, &dx.t); /* y aliases x */
    for (int64_t i = 0; i < n; i++) ref[i] = a * x[i] + b * x[i];
    dev_download(&dx, got);
    snprintf(what, sizeof what, "axpby in place n=%" PRId64, n);
    cr_assert(matches(what, got, ref, n, 1e-6, 1e-6), "%s", g_why);
    cr_assert(guards_intact(&dx, what), "%s", g_why);

    {
      /* Gossip's checks (three reductions on this backend), and no host
       * views: device memory is not host memory. */
      struct dev gx = dev_from(1, &n, x), gy = dev_from(1, &n, y);
      struct tensor_diff_stats st;
      tensor_diff_stats(&gx.t, &gy.t, &st);
      double dist = 0, norm = 0;
      for (int64_t i = 0; i < n; i++) {
        dist += ((double)y[i] - x[i]) * ((double)y[i] - x[i]);
        norm += (double)x[i] * x[i];
      }
      cr_assert_eq(st.nonfinite_y, 0, "diff_stats n=%" PRId64 ": non-finite counted in finite data", n);
      cr_assert(fabs(st.sq_dist - dist) <= 1e-5 * dist + 1e-9, "diff_stats n=%" PRId64 ": distance %.9g vs %.9g", n,
                st.sq_dist, dist);
      cr_assert(fabs(st.sq_norm_x - norm) <= 1e-5 * norm + 1e-9, "diff_stats n=%" PRId64 ": norm %.9g vs %.9g", n,
                st.sq_norm_x, norm);
      /* A mirror of a host buffer is device memory, filled by refresh. */
      struct tensor m;
      struct rumor_err e;
      cr_assert_eq(tensor_mirror_host(&m, &gx.t, y, &e), 0, "%s", e.msg);
      cr_assert(m.data != (void *)y && m.owner, "a CUDA mirror must be its own device buffer");
      tensor_mirror_refresh(&m, y);
      tensor_copy_to_host(&m, 0, got, (size_t)n * sizeof(float));
      snprintf(what, sizeof what, "mirror n=%" PRId64, n);
      cr_assert(matches_exactly(what, got, y, n), "%s", g_why);
      tensor_free(&m);
    }

    struct dev sx = dev_from(1, &n, x);
    tensor_scale(&sx.t, -2.5f);
    for (int64_t i = 0; i < n; i++) ref[i] = x[i] * -2.5f;
    dev_download(&sx, got);
    snprintf(what, sizeof what, "scale n=%" PRId64, n);
    cr_assert(matches_exactly(what, got, ref, n), "%s", g_why);
    cr_assert(guards_intact(&sx, what), "%s", g_why);

    struct dev fx = dev_vec(n);
    tensor_fill(&fx.t, 3.25f);
    fill_value(ref, n, 3.25f);
    dev_download(&fx, got);
    snprintf(what, sizeof what, "fill n=%" PRId64, n);
    cr_assert(matches_exactly(what, got, ref, n), "%s", g_why);
    cr_assert(guards_intact(&fx, what), "%s", g_why);
    arena_release(mark);
  }
  close_gpu();
}

/* ---- reductions ---- */

/* Sizes around one block (256) and past 1024 blocks of 256 (a second lap). */
static const int64_t kRedSizes[] = {1, 255, 256, 257, 100003, (1 << 20) + 17};
#define NREDSIZES ((int)(sizeof kRedSizes / sizeof kRedSizes[0]))

static void check_scalar(const char *what, int64_t n, double got, double ref, double tol) {
  cr_assert(fabs(got - ref) <= tol, "%s n=%" PRId64 ": got %.17g, ref %.17g, |diff| %.3g > %.3g (seed %" PRIu64 ")",
            what, n, got, ref, fabs(got - ref), tol, g_seed);
}

Test(cuda, sum_sq_norm_sq_dist_match_double_reference) {
  open_gpu();
  for (int ints = 0; ints < 2; ints++)
    for (int s = 0; s < NREDSIZES; s++) {
      int64_t n = kRedSizes[s];
      int mark = arena_mark();
      float *x = hbuf(n), *y = hbuf(n);
      if (ints) {
        fill_ints(x, n, 3);
        fill_ints(y, n, 3);
      } else {
        fill_normal(x, n, 0.25f, 1.0f);
        fill_normal(y, n, 0.0f, 1.0f);
      }
      double sum = 0, abs_sum = 0, sq = 0, dist = 0;
      for (int64_t i = 0; i < n; i++) {
        double d = (double)x[i] - (double)y[i];
        sum += x[i];
        abs_sum += fabs((double)x[i]);
        sq += (double)x[i] * x[i];
        dist += d * d;
      }
      struct dev dx = dev_from(1, &n, x), dy = dev_from(1, &n, y);
      /* Integers: every float partial is an exact integer below 2^24. Normal
       * data: float partials, a relative error of a few 1e-7 at most. */
      check_scalar(ints ? "sum (integers)" : "sum", n, tensor_sum(&dx.t), sum, ints ? 0.0 : 1e-6 * abs_sum);
      check_scalar(ints ? "sq_norm (integers)" : "sq_norm", n, tensor_sq_norm(&dx.t), sq, ints ? 0.0 : 2e-6 * sq);
      check_scalar(ints ? "sq_dist (integers)" : "sq_dist", n, tensor_sq_dist(&dx.t, &dy.t), dist,
                   ints ? 0.0 : 2e-6 * dist);
      check_scalar("sq_dist(x, x)", n, tensor_sq_dist(&dx.t, &dx.t), 0.0, 0.0);
      arena_release(mark);
    }
  close_gpu();
}

/* NaN, +Inf and −Inf placed at chosen, distinct indices of finite normal
 * data, so the expected count is known without looking at the data:
 *   sparse: x[0], x[n−1] and 10 interior elements 6 + j·⌊(n−7)/10⌋
 *           (n ≥ 17), 12 in all; all there is for n = 1 and 2;
 *   dense:  every index ≡ 0 (mod 3), ⌈n/3⌉, and x[n−1] when n − 1 ≢ 0;
 * with FLT_MAX, −FLT_MAX, a denormal and −0 (finite: not counted) at 1, 2,
 * 4 and 5 when n > 8. The counts are written out per size. */
Test(cuda, count_nonfinite_counts_exactly_the_nan_and_inf_elements) {
  open_gpu();
  static const struct {
    int64_t n, sparse, dense;
  } cases[] = {
      {1, 1, 1},                       /* x[0] */
      {2, 2, 1},                       /* x[0], x[1]; dense: x[0] only (n ≤ 8: no x[n−1] extra) */
      {1000, 12, 334},                 /* 0, 3, ..., 999 */
      {65537, 12, 21846 + 1},          /* 0, ..., 65535; 65536 ≡ 1 */
      {(1 << 21) + 3, 12, 699052 + 1}, /* 0, ..., 2097153; 2097154 ≡ 1 */
  };
  static const float specials[] = {NAN, INFINITY, -INFINITY};
  for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++)
    for (int density = 0; density < 3; density++) {
      int64_t n = cases[c].n;
      int64_t want = density == 0 ? 0 : density == 1 ? cases[c].sparse : cases[c].dense;
      int mark = arena_mark();
      float *x = hbuf(n);
      fill_normal(x, n, 0.0f, 1.0f); /* finite: rng_normal never returns Inf or NaN */
      if (n > 8) {
        x[1] = FLT_MAX;
        x[2] = -FLT_MAX;
        x[4] = 1e-40f; /* denormal */
        x[5] = -0.0f;
      }
      int k = 0;
      if (density == 1) {
        x[0] = specials[k++ % 3];
        if (n >= 2) x[n - 1] = specials[k++ % 3];
        if (n >= 17)
          for (int64_t j = 0; j < 10; j++) x[6 + j * ((n - 7) / 10)] = specials[k++ % 3];
      } else if (density == 2) {
        for (int64_t i = 0; i < n; i += 3) x[i] = specials[k++ % 3];
        if (n > 8 && (n - 1) % 3 != 0) x[n - 1] = specials[k++ % 3];
      }
      struct dev dx = dev_from(1, &n, x);
      int64_t got = tensor_count_nonfinite(&dx.t);
      cr_assert_eq(got, want, "count_nonfinite n=%" PRId64 " density %d: got %" PRId64 ", want %" PRId64 " (seed %" PRIu64 ")",
                   n, density, got, want, g_seed);
      cr_assert(guards_intact(&dx, "count_nonfinite"), "%s", g_why);
      arena_release(mark);
    }
  close_gpu();
}

/* ---- count-sketch ---- */

Test(cuda, count_sketch_equals_cpu_reference_sketch) {
  open_gpu();
  tensor_backend_t cpu = NULL;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_backend_open("cpu", &cpu, &e), 0, "%s", e.msg);
  /* (n, k): k = 1 and 2 (all contention on one or two buckets), the shared
   * path at its limit (8192), the global-atomics path beyond it, and sizes
   * past both grid caps. */
  static const struct {
    int64_t n;
    int k;
  } cases[] = {{1, 1},         {1000, 2},          {100003, 1024}, {100003, 8192},
               {100003, 16384}, {(1 << 21) + 5, 1024}, {(1 << 21) + 5, 1 << 20}, {5, 1 << 20}};
  const uint64_t seeds[] = {0, 0x123456789abcdef0ull, rng_next_u64(&g_rng)};
  for (int c = 0; c < (int)(sizeof cases / sizeof cases[0]); c++)
    for (int sd = 0; sd < 3; sd++)
      for (int ints = 0; ints < 2; ints++) {
        int64_t n = cases[c].n;
        int k = cases[c].k;
        uint64_t seed = seeds[sd];
        int mark = arena_mark();
        float *x = hbuf(n);
        double *ref = hbuf_bytes((size_t)k * sizeof(double)), *got = hbuf_bytes((size_t)k * sizeof(double));
        double *cpu_got = hbuf_bytes((size_t)k * sizeof(double)), *mag = hbuf_bytes((size_t)k * sizeof(double));
        if (ints)
          fill_ints(x, n, 3);
        else
          fill_normal(x, n, 0.0f, 1.0f);
        tensor_ref_count_sketch(x, n, seed, k, ref);
        /* Per-bucket Σ|x|: the scale of float rounding in that bucket. */
        for (int j = 0; j < k; j++) mag[j] = 0.0;
        for (int64_t i = 0; i < n; i++) {
          bool neg;
          mag[tensor_sketch_bucket(seed, (uint64_t)i, k, &neg)] += fabs(x[i]);
        }

        struct dev dx = dev_from(1, &n, x);
        for (int j = 0; j < k; j++) got[j] = NAN;
        tensor_count_sketch(&dx.t, seed, k, got);

        struct tensor cx;
        cr_assert_eq(tensor_alloc(&cx, cpu, TENSOR_F32, 1, &n, &e), 0, "%s", e.msg);
        tensor_copy_from_host(&cx, 0, x, (size_t)n * sizeof(float));
        tensor_count_sketch(&cx, seed, k, cpu_got);
        tensor_free(&cx);

        for (int j = 0; j < k; j++) {
          double tol = ints ? 0.0 : 1e-6 * mag[j] + 1e-12;
          cr_assert(fabs(got[j] - ref[j]) <= tol,
                    "count_sketch n=%" PRId64 " k=%d seed=0x%" PRIx64 " %s: bucket %d: got %.17g, ref %.17g, "
                    "|diff| %.3g > %.3g (seed %" PRIu64 ")",
                    n, k, seed, ints ? "integers" : "normal", j, got[j], ref[j], fabs(got[j] - ref[j]), tol, g_seed);
          cr_assert(fabs(cpu_got[j] - ref[j]) <= 1e-6 * mag[j] + 1e-12,
                    "CPU count_sketch n=%" PRId64 " k=%d: bucket %d: got %.17g, ref %.17g", n, k, j, cpu_got[j], ref[j]);
        }
        arena_release(mark);
      }
  tensor_backend_close(cpu);
  close_gpu();
}

/* ---- copies and events ---- */

/* Polls ev until complete; fails after 30 s. */
static void poll_event(tensor_event_t ev, const char *what) {
  uint64_t deadline = clock_now_ns() + 30ull * 1000000000ull;
  while (!tensor_event_query(ev))
    cr_assert(clock_now_ns() < deadline, "%s: event not complete after 30 s", what);
}

/* The device's memory figures (peer/sync sizes its snapshot copy by them):
 * known, total above free, and free falling by our allocation's size and
 * rising again when it is freed. The figures are device-wide, and other
 * test processes (ctest -j) allocate and free beside us, so one reading
 * can be off by whatever they did in between: each try allows 1/4 of the
 * 1 GiB as slack both ways, and the test passes when any of 5 tries sees
 * both the fall and the rise. Figures that ignore allocations fail all 5. */
Test(cuda, memory_figures_are_known_and_follow_an_allocation) {
  open_gpu();
  size_t free0 = 0, total = 0, free1 = 0, free2 = 0;
  cr_assert(tensor_backend_mem_info(g_be, &free0, &total), "no memory figures on a GPU");
  cr_assert(total > 0 && free0 <= total, "free %zu of %zu", free0, total);
  const int64_t n = (int64_t)256 << 20; /* floats: 1 GiB */
  const size_t bytes = (size_t)n * sizeof(float), want = bytes - bytes / 4;
  bool seen = false;
  for (int attempt = 0; attempt < 5 && !seen; attempt++) {
    struct tensor big;
    struct rumor_err e = {0};
    cr_assert(tensor_backend_mem_info(g_be, &free0, &total));
    cr_assert_eq(tensor_alloc(&big, g_be, TENSOR_F32, 1, &n, &e), 0, "%s", e.msg);
    cr_assert(tensor_backend_mem_info(g_be, &free1, &total));
    tensor_free(&big);
    cr_assert(tensor_backend_mem_info(g_be, &free2, &total));
    seen = free1 + want <= free0 && free1 + want <= free2;
    if (!seen)
      cr_log_info("try %d: free %zu before, %zu with 1 GiB allocated, %zu after freeing it (others' allocations "
                  "beside us?)", attempt, free0, free1, free2);
  }
  cr_assert(seen, "in 5 tries the free figure never fell and rose by 3/4 of a 1 GiB allocation: last %zu, %zu, %zu",
            free0, free1, free2);
  close_gpu();
}

/* Seconds of CPU time the calling thread has used. */
static double thread_cpu_s(void) {
  struct timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Host waits sleep (cudaDeviceScheduleBlockingSync, cudaEventBlockingSync):
 * while the GPU works for a few hundred milliseconds on queued GEMMs, a
 * stream wait (tensor_backend_sync) and an event wait (tensor_event_wait)
 * each cost the waiting thread less than a quarter of the wait in CPU time.
 * A spinning wait costs about all of it. A wait under 50 ms (a GPU far
 * faster than expected) proves nothing and fails with its figures, so the
 * work below can be scaled. */
Test(cuda, host_waits_for_the_gpu_sleep_instead_of_spinning) {
  open_gpu();
  const int64_t n = 4096, s[2] = {n, n};
  struct dev a = dev_new(2, s), c = dev_new(2, s);
  tensor_fill(&a.t, 0.001f);
  tensor_backend_sync(g_be);
  tensor_event_t ev = tensor_event_create(g_be);
  cr_assert_not_null(ev);
  for (int kind = 0; kind < 2; kind++) {
    for (int i = 0; i < 200; i++) tensor_gemm(false, false, 1.0f, &a.t, &a.t, 0.0f, &c.t); /* 27 TFLOP in all */
    if (kind == 1) tensor_event_record(ev);
    const double w0 = (double)clock_now_ns() * 1e-9, c0 = thread_cpu_s();
    if (kind == 0) tensor_backend_sync(g_be);
    else tensor_event_wait(ev);
    const double wall = (double)clock_now_ns() * 1e-9 - w0, cpu = thread_cpu_s() - c0;
    const char *what = kind == 0 ? "stream wait (tensor_backend_sync)" : "event wait (tensor_event_wait)";
    cr_log_info("%s: %.3f s of waiting took %.3f s of CPU", what, wall, cpu);
    cr_assert(wall >= 0.05, "%s: the GPU finished in %.3f s, too soon to tell sleeping from spinning", what, wall);
    cr_assert(cpu < 0.25 * wall, "%s spins: %.3f s of CPU in %.3f s of waiting", what, cpu, wall);
  }
  tensor_event_destroy(ev);
  close_gpu();
}

/* The ready snapshot of a GPU peer (peer/sync): parameters copied device to
 * device on the stream, then that copy to pinned memory beside the stream.
 * The copy beside must see everything enqueued before it (the device copy
 * and an op on the snapshot), while the stream goes on at once with the
 * next step's work on the parameters (negated, then overwritten). Repeated
 * with the same event, as a peer does at every step, so that a copy
 * ordered after the wrong point or an event recorded too early shows. */
Test(cuda, a_copy_beside_the_stream_sees_the_work_before_it_and_not_after) {
  open_gpu();
  const int64_t n = (1 << 22) + 5;
  const size_t bytes = (size_t)n * sizeof(float);
  float *src = tensor_host_alloc(g_be, bytes), *dst = tensor_host_alloc(g_be, bytes);
  cr_assert_not_null(src);
  cr_assert_not_null(dst);
  for (int64_t i = 0; i < n; i++) src[i] = (float)(i % 65521) - 30000.0f;
  struct dev params = dev_vec(n), snap = dev_vec(n);
  tensor_event_t ev = tensor_event_create(g_be);
  cr_assert_not_null(ev);
  tensor_copy_from_host(&params.t, 0, src, bytes);
  for (int round = 0; round < 3; round++) {
    fill_value(dst, n, NAN);
    float k = (float)(round + 2);
    tensor_copy(&snap.t, &params.t);
    tensor_scale(&snap.t, k); /* exact: a power of two or a small integer on these values */
    tensor_copy_to_host_beside(&snap.t, 0, dst, bytes, ev);
    for (int j = 0; j < 8; j++) tensor_scale(&params.t, -1.0f); /* later work on the stream */
    tensor_fill(&params.t, 3.0f);
    poll_event(ev, "copy beside the stream");
    for (int64_t i = 0; i < n; i++)
      cr_assert_eq(dst[i], k * src[i], "round %d, element %" PRId64 ": got %g, want %g", round, i, dst[i],
                   k * src[i]);
    tensor_copy_from_host(&params.t, 0, src, bytes);
  }
  /* At an element offset, only its bytes. */
  fill_value(dst, n, NAN);
  tensor_copy(&snap.t, &params.t);
  tensor_copy_to_host_beside(&snap.t, 1000, dst, 77 * sizeof(float), ev);
  tensor_event_wait(ev);
  for (int64_t i = 0; i < 77; i++) cr_assert_eq(dst[i], src[1000 + i], "offset copy, element %" PRId64, i);
  cr_assert(isnan(dst[77]), "the copy wrote past its byte count");
  cr_assert(guards_intact(&snap, "copy beside"), "%s", g_why);
  tensor_event_destroy(ev);
  tensor_host_free(g_be, src);
  tensor_host_free(g_be, dst);
  close_gpu();
}

Test(cuda, async_copies_and_events_round_trip_through_pinned_memory) {
  open_gpu();
  const int64_t n = (1 << 22) + 3;
  const size_t bytes = (size_t)n * sizeof(float);
  float *src = tensor_host_alloc(g_be, bytes), *dst = tensor_host_alloc(g_be, bytes);
  cr_assert_not_null(src);
  cr_assert_not_null(dst);
  for (int64_t i = 0; i < n; i++) src[i] = (float)(i % 100003) - 50000.0f;
  fill_value(dst, n, NAN);

  tensor_event_t ev = tensor_event_create(g_be);
  cr_assert_not_null(ev);
  cr_assert(tensor_event_query(ev), "an event never recorded counts as complete");

  /* Host → device → op → host, all enqueued, then polled. */
  struct dev t = dev_vec(n);
  tensor_copy_from_host_async(&t.t, 0, src, bytes);
  tensor_scale(&t.t, 2.0f);
  tensor_copy_to_host_async(&t.t, 0, dst, bytes);
  tensor_event_record(ev);
  poll_event(ev, "async round trip");
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(dst[i], 2.0f * src[i], "async round trip: element %" PRId64 ": got %g, want %g", i, dst[i],
                 2.0f * src[i]);

  /* The same with a blocking wait, at an element offset. */
  const int64_t off = 12345, cnt = 1000;
  fill_value(dst, n, NAN);
  tensor_scale(&t.t, 0.5f);
  tensor_copy_to_host_async(&t.t, off, dst, (size_t)cnt * sizeof(float));
  tensor_event_record(ev);
  tensor_event_wait(ev);
  cr_assert(tensor_event_query(ev), "query after wait must be true");
  for (int64_t i = 0; i < cnt; i++)
    cr_assert_eq(dst[i], src[off + i], "offset copy: element %" PRId64 ": got %g, want %g", i, dst[i], src[off + i]);
  cr_assert(isnan(dst[cnt]), "the copy wrote past its byte count");

  /* Synchronous copies at an offset. */
  float small[7] = {1, 2, 3, 4, 5, 6, 7}, back[7] = {0};
  tensor_copy_from_host(&t.t, n - 7, small, sizeof small);
  tensor_copy_to_host(&t.t, n - 7, back, sizeof back);
  cr_assert_arr_eq(back, small, sizeof small, "synchronous copy at the end of the tensor");
  cr_assert(guards_intact(&t, "copies"), "%s", g_why);

  tensor_event_destroy(ev);
  tensor_host_free(g_be, src);
  tensor_host_free(g_be, dst);
  close_gpu();
}

Test(cuda, device_copy_handles_disjoint_and_overlapping_views) {
  open_gpu();
  const int64_t n = 100003;
  float *x = hbuf(n), *want = hbuf(n), *got = hbuf(n);
  fill_normal(x, n, 0.0f, 1.0f);
  struct dev a = dev_from(1, &n, x), b = dev_vec(n);
  tensor_copy(&b.t, &a.t);
  dev_download(&b, got);
  cr_assert(matches_exactly("tensor_copy", got, x, n), "%s", g_why);
  cr_assert(guards_intact(&b, "tensor_copy"), "%s", g_why);

  /* Overlapping views of one buffer, shifted both ways (memmove semantics). */
  static const int64_t shifts[] = {1, -1, 4097, -4097};
  for (int s = 0; s < 4; s++) {
    int64_t sh = shifts[s], len = n - (sh > 0 ? sh : -sh);
    int64_t src_off = sh > 0 ? 0 : -sh, dst_off = sh > 0 ? sh : 0;
    dev_upload(&a, x);
    struct tensor vs = tensor_view(&a.t, src_off, 1, &len), vd = tensor_view(&a.t, dst_off, 1, &len);
    tensor_copy(&vd, &vs);
    memcpy(want, x, (size_t)n * sizeof *x);
    memmove(want + dst_off, want + src_off, (size_t)len * sizeof *x);
    dev_download(&a, got);
    char what[64];
    snprintf(what, sizeof what, "overlapping tensor_copy shift %" PRId64, sh);
    cr_assert(matches_exactly(what, got, want, n), "%s", g_why);
    cr_assert(guards_intact(&a, what), "%s", g_why);
  }
  close_gpu();
}

/* tensor_discard on a buffer allocated while discardable gives the whole
 * chunks inside the range back to the device (the backend's live bytes
 * fall by them, its peak stays), they read as zeros, and what lies outside
 * them is kept; tensor_recommit takes back only the chunks it touches,
 * zero-filled, and they hold what is written next. Counted by the backend
 * itself, so other processes on the GPU cannot disturb it. */
Test(cuda, discarded_chunks_go_back_to_the_device_and_come_back_zeroed) {
  open_gpu();
  const int64_t n = (int64_t)16 << 20, MiB = 1 << 20; /* 64 MiB of floats */
  int64_t live0 = tensor_backend_live_bytes(g_be);
  cr_assert_geq(live0, 0, "the CUDA backend counts its buffers");
  struct tensor x;
  struct rumor_err e = {0};
  tensor_backend_set_discardable(g_be, true);
  cr_assert_eq(tensor_alloc(&x, g_be, TENSOR_F32, 1, &n, &e), 0, "%s", e.msg);
  tensor_backend_set_discardable(g_be, false);
  int64_t live1 = tensor_backend_live_bytes(g_be);
  cr_assert_geq(live1 - live0, n * 4, "live %lld -> %lld for a 64 MiB buffer", (long long)live0, (long long)live1);
  tensor_fill(&x, 1.0f);
  const int64_t a = (1 << 20) + 3, b = (15 << 20) - 5; /* floats; not on chunk bounds */
  tensor_discard(&x, a, b - a);
  int64_t live2 = tensor_backend_live_bytes(g_be);
  cr_assert_leq(live2, live1 - (b - a) * 4 + 2 * 2 * MiB,
                "discarding %lld bytes gave back only %lld (is the driver's virtual memory management there? "
                "\"memory cannot be given back\" in the log says why not)",
                (long long)((b - a) * 4), (long long)(live1 - live2));
  cr_assert_geq(tensor_backend_peak_bytes(g_be, true), live1);
  cr_assert_eq(tensor_backend_peak_bytes(g_be, false), live2, "the count of the most restarts from what is held");
  float *h = xmalloc((size_t)n * sizeof(float));
  tensor_copy_to_host(&x, 0, h, (size_t)n * sizeof(float));
  int64_t zeros = 0;
  for (int64_t i = 0; i < n; i++) {
    if (i < a || i >= b) cr_assert_eq(h[i], 1.0f, "element %lld outside the discarded range changed", (long long)i);
    else if (h[i] == 0.0f) zeros++;
    else cr_assert_eq(h[i], 1.0f, "element %lld inside reads %g: neither kept nor zero", (long long)i, h[i]);
  }
  cr_assert_geq(zeros * 4, (b - a) * 4 - 4 * MiB, "only %lld discarded elements read as zero", (long long)zeros);
  /* A few elements inside: their chunk alone comes back, zeroed. */
  const int64_t c = (8 << 20) + 7;
  cr_assert_eq(tensor_recommit(&x, c, 100, &e), 0, "%s", e.msg);
  int64_t live3 = tensor_backend_live_bytes(g_be);
  cr_assert(live3 > live2 && live3 <= live2 + 2 * 2 * MiB, "recommitting 400 bytes: live %lld -> %lld",
            (long long)live2, (long long)live3);
  for (int64_t i = 0; i < 100; i++) h[i] = (float)(i + 1);
  tensor_copy_from_host(&x, c, h, 100 * sizeof(float));
  float back[100];
  tensor_copy_to_host(&x, c, back, sizeof back);
  for (int i = 0; i < 100; i++) cr_assert_eq(back[i], (float)(i + 1));
  /* The whole range back, written: every element as written. */
  cr_assert_eq(tensor_recommit(&x, a, b - a, &e), 0, "%s", e.msg);
  struct tensor mid = tensor_view(&x, a, 1, (int64_t[]){b - a});
  tensor_fill(&mid, 2.0f);
  tensor_copy_to_host(&x, 0, h, (size_t)n * sizeof(float));
  for (int64_t i = 0; i < n; i++) cr_assert_eq(h[i], i < a || i >= b ? 1.0f : 2.0f, "element %lld", (long long)i);
  cr_assert_eq(tensor_backend_live_bytes(g_be), live1, "every chunk live again");
  free(h);
  tensor_free(&x);
  cr_assert_eq(tensor_backend_live_bytes(g_be), live0, "freed");
  close_gpu();
}
