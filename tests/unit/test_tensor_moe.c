/* The mixture-of-experts ops (tensor.h: tensor_moe_route, _route_bwd,
 * _dispatch, _dispatch_bwd, _combine, _combine_bwd) on the CPU backend:
 *
 * - against the plain reference ops (tensor_ref.h) at 1 and 2 threads, on
 *   shapes where N is a multiple of nothing, E = 1, 2, 8 and 64, K = 1, 2
 *   and 8 (K = E included), with capacities that drop choices, that drop
 *   none, and cap = 1, on logits with and without ties: the indices, slots
 *   and counts exactly, the floats within stated tolerances;
 * - hand-worked routings that pin the contract's order (first choices of
 *   every token before second choices), the tie rule (−0 = +0 included)
 *   and what a dropped choice gets;
 * - the gradient of a scalar loss through route → dispatch → one linear
 *   map per expert (tensor_gemm on views of the [E·cap, C] buffer) →
 *   combine → Σ w⊙out plus the load-balancing and z-loss terms, against
 *   central finite differences, for x, the logits and the expert weights,
 *   with capacities that drop choices and that drop none; dropped choices
 *   get exactly zero gradient;
 * - determinism: two runs give the same bits, and 1 and 2 threads too.
 *
 * Every output starts as NaN, so an element an op fails to write fails
 * the comparison. Comparisons are |got − ref| <= atol + rtol·|ref| with the
 * worst element reported; the tolerances are stated next to each check. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_ref.h"
#include "../support/tensor_check.h"

static const int thread_counts[] = {1, 2};
#define NTHREADS (sizeof thread_counts / sizeof thread_counts[0])

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  rng_seed_suite(3232);
}
static void teardown(void) { tensor_backend_close(be); }

TestSuite(tensor_moe, .init = setup, .fini = teardown, .timeout = 240);

/* ---- helpers ---- */

static struct tensor dev_i32(int ndim, const int64_t *shape, const int32_t *h) {
  struct tensor d;
  struct rumor_err e;
  cr_assert_eq(tensor_alloc(&d, be, TENSOR_I32, ndim, shape, &e), 0, "%s", e.msg);
  if (h) {
    tensor_copy_from_host(&d, 0, h, tensor_nbytes(&d));
  } else { /* poison: −7 is neither an expert nor a slot nor −1 */
    int32_t *p = xmalloc(tensor_nbytes(&d) + 4);
    for (int64_t i = 0; i < tensor_numel(&d); i++) p[i] = -7;
    tensor_copy_from_host(&d, 0, p, tensor_nbytes(&d));
    free(p);
  }
  return d;
}

static int32_t *to_host_i32(const struct tensor *t) {
  int32_t *h = xmalloc(tensor_nbytes(t) + 4);
  tensor_copy_to_host(t, 0, h, tensor_nbytes(t));
  return h;
}

static void expect_same_i32(const char *what, const int32_t *got, const int32_t *ref, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(got[i], ref[i], "%s: element %lld is %d, the reference %d", what, (long long)i, got[i], ref[i]);
}

static void expect_same_bits(const char *what, const void *a, const void *b, int64_t n) {
  const uint32_t *x = a, *y = b;
  for (int64_t i = 0; i < n; i++)
    cr_assert_eq(x[i], y[i], "%s: element %lld differs: 0x%08x vs 0x%08x", what, (long long)i, x[i], y[i]);
}

static float *host_copy(const float *h, int64_t n) {
  float *p = xmalloc((size_t)n * sizeof *p);
  memcpy(p, h, (size_t)n * sizeof *p);
  return p;
}

/* One routing problem: N tokens of width C, E experts of cap rows, K
 * choices; `ties` draws logits from {−1, −0.5, 0, 0.5, 1}, so that most
 * rows hold equal logits (a row's max among them too). */
struct moe_case {
  int64_t n, e;
  int k;
  int64_t c, cap;
  bool ties;
};

/* Capacities: the caller's ceil(factor·N·K/E) at factor 1.25 and 1.0, all
 * of N (nothing dropped: a token's K experts are distinct) and 1. */
static const struct moe_case moe_cases[] = {
    {37, 1, 1, 5, 37, false},   {37, 1, 1, 5, 10, true},     {53, 2, 1, 7, 27, false},  {53, 2, 2, 7, 53, true},
    {53, 2, 2, 7, 30, false},   {101, 8, 2, 13, 32, false},  {101, 8, 2, 13, 26, true}, {101, 8, 8, 13, 101, false},
    {101, 8, 8, 13, 1, true},   {301, 64, 8, 9, 48, false},  {301, 64, 1, 9, 6, true},  {301, 64, 2, 9, 1, false},
    {3001, 64, 2, 96, 94, false}, /* large enough that 2 threads split every op */
};
#define NCASES (sizeof moe_cases / sizeof moe_cases[0])

static float *moe_logits(const struct moe_case *k) {
  float *l = xmalloc((size_t)(k->n * k->e) * sizeof *l);
  for (int64_t i = 0; i < k->n * k->e; i++)
    l[i] = k->ties ? 0.5f * (float)((int)rng_below(&rng, 5) - 2) : 2.0f * rng_normal(&rng);
  return l;
}

/* Routing results on the host. */
struct route_out {
  float *probs, *lse, *gate, *psum;
  int32_t *expert, *slot, *assigned, *kept;
};

static struct route_out route_alloc(const struct moe_case *k) {
  struct route_out r;
  r.probs = xmalloc((size_t)(k->n * k->e) * 4);
  r.lse = xmalloc((size_t)k->n * 4 + 4);
  r.gate = xmalloc((size_t)(k->n * k->k) * 4 + 4);
  r.psum = xmalloc((size_t)k->e * 4);
  r.expert = xmalloc((size_t)(k->n * k->k) * 4 + 4);
  r.slot = xmalloc((size_t)(k->n * k->k) * 4 + 4);
  r.assigned = xmalloc((size_t)k->e * 4);
  r.kept = xmalloc((size_t)k->e * 4);
  return r;
}

static void route_free(struct route_out *r) {
  free(r->probs), free(r->lse), free(r->gate), free(r->psum);
  free(r->expert), free(r->slot), free(r->assigned), free(r->kept);
}

static void route_ref(const struct moe_case *k, const float *logits, struct route_out *r) {
  tensor_ref_moe_route(logits, r->probs, r->lse, r->expert, r->gate, r->slot, r->assigned, r->kept, r->psum, k->n,
                       k->e, k->k, k->cap);
}

/* tensor_moe_route on the suite's backend, outputs poisoned first. */
static struct route_out route_cpu(const struct moe_case *k, const float *logits) {
  int64_t ne[2] = {k->n, k->e}, nk[2] = {k->n, k->k}, n1 = k->n, e1 = k->e;
  struct tensor l = dev_from(logits, 2, ne), probs = dev_nan(2, ne), lse = dev_nan(1, &n1), gate = dev_nan(2, nk);
  struct tensor psum = dev_nan(1, &e1), expert = dev_i32(2, nk, NULL), slot = dev_i32(2, nk, NULL);
  struct tensor assigned = dev_i32(1, &e1, NULL), kept = dev_i32(1, &e1, NULL);
  tensor_moe_route(&l, k->k, k->cap, &probs, &lse, &expert, &gate, &slot, &assigned, &kept, &psum);
  struct route_out r = {to_host(&probs), to_host(&lse), to_host(&gate), to_host(&psum),
                        to_host_i32(&expert), to_host_i32(&slot), to_host_i32(&assigned), to_host_i32(&kept)};
  tensor_free(&l), tensor_free(&probs), tensor_free(&lse), tensor_free(&gate), tensor_free(&psum);
  tensor_free(&expert), tensor_free(&slot), tensor_free(&assigned), tensor_free(&kept);
  return r;
}

static void case_name(char *buf, size_t len, const char *op, const struct moe_case *k, int threads) {
  snprintf(buf, len, "%s N=%lld E=%lld K=%d C=%lld cap=%lld%s threads=%d", op, (long long)k->n, (long long)k->e, k->k,
           (long long)k->c, (long long)k->cap, k->ties ? " ties" : "", threads);
}

/* ---- routing against the reference ---- */

/* The experts, slots and counts must equal the reference's exactly: both
 * rank on the logits with the same tie rule, and slots follow from the
 * experts alone. Floats: the CPU's softmax is float (nn_expf, 1.5 ulp; a
 * sum of up to 64 terms), the reference's double: rtol 1e-5 on probs and
 * gates (the rounding of l − max, up to 12 here, becomes 12·6e-8 relative
 * in the exp, plus 64 ulp for the sum), 1e-5 absolute on lse (|lse| < 12),
 * and on psum 1e-5 relative plus 1e-6 absolute (sums of up to 3001 probs
 * that each carry the probs' error). */
static void route_check(const struct moe_case *k, const float *logits, int threads, const struct route_out *ref) {
  char what[160];
  struct route_out got = route_cpu(k, logits);
  int64_t nk = k->n * k->k;
  case_name(what, sizeof what, "route expert", k, threads);
  expect_same_i32(what, got.expert, ref->expert, nk);
  case_name(what, sizeof what, "route slot", k, threads);
  expect_same_i32(what, got.slot, ref->slot, nk);
  case_name(what, sizeof what, "route assigned", k, threads);
  expect_same_i32(what, got.assigned, ref->assigned, k->e);
  case_name(what, sizeof what, "route kept", k, threads);
  expect_same_i32(what, got.kept, ref->kept, k->e);
  case_name(what, sizeof what, "route probs", k, threads);
  expect_close(what, got.probs, ref->probs, k->n * k->e, 1e-12, 1e-5);
  case_name(what, sizeof what, "route lse", k, threads);
  expect_close(what, got.lse, ref->lse, k->n, 1e-5, 0);
  case_name(what, sizeof what, "route gate", k, threads);
  expect_close(what, got.gate, ref->gate, nk, 1e-12, 1e-5);
  case_name(what, sizeof what, "route psum", k, threads);
  expect_close(what, got.psum, ref->psum, k->e, 1e-6, 1e-5);
  if (k->k == 1) { /* K = 1: the gate is the stored probability itself */
    for (int64_t i = 0; i < k->n; i++)
      cr_assert_eq(got.gate[i], got.probs[i * k->e + got.expert[i]], "%s: gate %lld is not its prob", what,
                   (long long)i);
  }
  route_free(&got);
}

/* The reference itself, on invariants that do not need a second
 * implementation: K distinct experts in rank order, gates summing to 1
 * (K > 1), slots 0, 1, ... per expert in the contract's order, counts. */
static void route_invariants(const struct moe_case *k, const float *logits, const struct route_out *r) {
  int32_t *fill = xcalloc((size_t)k->e, sizeof *fill);
  for (int c = 0; c < k->k; c++)
    for (int64_t i = 0; i < k->n; i++) {
      int32_t x = r->expert[i * k->k + c], s = r->slot[i * k->k + c];
      cr_assert(x >= 0 && x < k->e, "expert out of range");
      if (c > 0) {
        int32_t y = r->expert[i * k->k + c - 1];
        float lx = logits[i * k->e + x], ly = logits[i * k->e + y];
        cr_assert(ly > lx || (ly == lx && y < x), "token %lld: choice %d does not rank after choice %d",
                  (long long)i, c, c - 1);
      }
      cr_assert_eq(s, fill[x] < k->cap ? fill[x] : -1, "token %lld choice %d: slot %d", (long long)i, c, s);
      fill[x]++;
    }
  for (int64_t j = 0; j < k->e; j++) {
    cr_assert_eq(r->assigned[j], fill[j]);
    cr_assert_eq(r->kept[j], fill[j] < k->cap ? fill[j] : k->cap);
  }
  if (k->k > 1)
    for (int64_t i = 0; i < k->n; i++) {
      double s = 0;
      for (int c = 0; c < k->k; c++) s += r->gate[i * k->k + c];
      cr_assert(fabs(s - 1.0) <= 1e-6 * k->k, "token %lld: gates sum to %.9g", (long long)i, s);
    }
  free(fill);
}

Test(tensor_moe, route_matches_reference_exactly_on_indices_slots_and_counts) {
  for (size_t ci = 0; ci < NCASES; ci++) {
    const struct moe_case *k = &moe_cases[ci];
    float *logits = moe_logits(k);
    struct route_out ref = route_alloc(k);
    route_ref(k, logits, &ref);
    route_invariants(k, logits, &ref);
    for (size_t th = 0; th < NTHREADS; th++) {
      tensor_backend_set_threads(be, thread_counts[th]);
      route_check(k, logits, thread_counts[th], &ref);
    }
    route_free(&ref);
    free(logits);
  }
}

/* ---- hand-worked routings ---- */

/* Three tokens, two experts, K = 2, cap 2. First choices: tokens 0 and 1
 * take expert 0 (slots 0, 1), token 2 expert 1 (slot 0). Second choices,
 * in token order: token 0 → expert 1 slot 1; token 1 → expert 1, full,
 * dropped; token 2 → expert 0, full, dropped. A token-major order would
 * instead have given token 0's second choice slot 0 of expert 1 and
 * dropped token 2's first. */
Test(tensor_moe, route_fills_first_choices_of_all_tokens_before_second_choices) {
  const struct moe_case k = {3, 2, 2, 1, 2, false};
  const float logits[] = {1, 0, 2, 0, 0, 1};
  const int32_t want_expert[] = {0, 1, 0, 1, 1, 0}, want_slot[] = {0, 1, 1, -1, 0, -1};
  const int32_t want_assigned[] = {3, 3}, want_kept[] = {2, 2};
  struct route_out r = route_cpu(&k, logits);
  expect_same_i32("expert", r.expert, want_expert, 6);
  expect_same_i32("slot", r.slot, want_slot, 6);
  expect_same_i32("assigned", r.assigned, want_assigned, 2);
  expect_same_i32("kept", r.kept, want_kept, 2);
  for (int64_t i = 0; i < 3; i++) /* K = E: the renormalised gates are the probabilities */
    for (int c = 0; c < 2; c++)
      cr_assert(fabsf(r.gate[i * 2 + c] - r.probs[i * 2 + r.expert[i * 2 + c]]) <= 1e-7f, "gate (%lld, %d)",
                (long long)i, c);
  double p0 = 1.0 / (1.0 + exp(-1.0)); /* token 0: softmax(1, 0) */
  cr_assert(fabs(r.probs[0] - p0) <= 1e-7 && fabs(r.lse[0] - log(1.0 + exp(1.0))) <= 1e-6);
  cr_assert(fabs(r.psum[0] - (p0 + 1.0 / (1.0 + exp(-2.0)) + 1.0 / (1.0 + exp(1.0)))) <= 1e-6);
  route_free(&r);
}

/* All logits equal: every token picks experts 0..K−1 in index order, with
 * gates 1/K; expert c receives exactly the choices c of the tokens, which
 * fill its slots in token order until cap. One row mixes −0 and +0 (equal
 * floats) with smaller logits: the tie goes to the lower index either way
 * round. */
Test(tensor_moe, route_breaks_ties_by_the_lower_expert_index) {
  const struct moe_case k = {5, 4, 2, 1, 3, true};
  float logits[20];
  for (int i = 0; i < 20; i++) logits[i] = 0.5f;
  struct route_out r = route_cpu(&k, logits);
  for (int64_t i = 0; i < 5; i++)
    for (int c = 0; c < 2; c++) {
      cr_assert_eq(r.expert[i * 2 + c], c, "token %lld choice %d: expert %d", (long long)i, c, r.expert[i * 2 + c]);
      cr_assert_eq(r.slot[i * 2 + c], i < 3 ? (int32_t)i : -1);
      cr_assert_eq(r.gate[i * 2 + c], 0.5f);
    }
  const int32_t want_assigned[] = {5, 5, 0, 0}, want_kept[] = {3, 3, 0, 0};
  expect_same_i32("assigned", r.assigned, want_assigned, 4);
  expect_same_i32("kept", r.kept, want_kept, 4);
  cr_assert(fabsf(r.probs[0] - 0.25f) <= 1e-7f && fabsf(r.lse[0] - (0.5f + logf(4.0f))) <= 1e-6f);
  route_free(&r);

  const struct moe_case z = {2, 3, 1, 1, 2, true};
  const float zl[] = {-0.0f, 0.0f, -1.0f, 0.0f, -0.0f, -1.0f};
  r = route_cpu(&z, zl);
  cr_assert(r.expert[0] == 0 && r.expert[1] == 0, "−0 and +0 must tie: experts %d, %d", r.expert[0], r.expert[1]);
  route_free(&r);
}

/* ---- route backward against the reference ---- */

/* Inputs are the reference routing's outputs, so both sides see the same
 * probabilities and choices; dgate is 0 on dropped choices (as combine_bwd
 * gives it), daux and zscale random. The CPU forms Σ_e p·dprob in double
 * and the rest in float: rtol 1e-5, and 1e-6 absolute for the cancellation
 * in p·(dprob − Σ p·dprob) (terms up to |dprob| <= 1/Σ p_chosen·2 here). */
Test(tensor_moe, route_bwd_matches_reference) {
  for (size_t ci = 0; ci < NCASES; ci++) {
    const struct moe_case *k = &moe_cases[ci];
    float *logits = moe_logits(k);
    struct route_out r = route_alloc(k);
    route_ref(k, logits, &r);
    int64_t nk = k->n * k->k, ne[2] = {k->n, k->e}, nks[2] = {k->n, k->k}, n1 = k->n, e1 = k->e;
    float *dgate = rand_host(nk, 1), *daux = rand_host(k->e, 0.1f), *ref = xmalloc((size_t)(k->n * k->e) * 4);
    for (int64_t i = 0; i < nk; i++)
      if (r.slot[i] < 0) dgate[i] = 0.0f;
    const float zscale = 0.01f;
    tensor_ref_moe_route_bwd(r.probs, r.lse, r.expert, r.gate, dgate, daux, zscale, ref, k->n, k->e, k->k);
    struct tensor probs = dev_from(r.probs, 2, ne), lse = dev_from(r.lse, 1, &n1), gate = dev_from(r.gate, 2, nks);
    struct tensor dg = dev_from(dgate, 2, nks), da = dev_from(daux, 1, &e1), expert = dev_i32(2, nks, r.expert);
    for (size_t th = 0; th < NTHREADS; th++) {
      tensor_backend_set_threads(be, thread_counts[th]);
      struct tensor dl = dev_nan(2, ne);
      tensor_moe_route_bwd(&probs, &lse, &expert, &gate, &dg, &da, zscale, &dl);
      float *got = to_host(&dl);
      char what[160];
      case_name(what, sizeof what, "route_bwd dlogits", k, thread_counts[th]);
      expect_close(what, got, ref, k->n * k->e, 1e-6, 1e-5);
      free(got);
      tensor_free(&dl);
    }
    tensor_free(&probs), tensor_free(&lse), tensor_free(&gate), tensor_free(&dg), tensor_free(&da);
    tensor_free(&expert);
    free(dgate), free(daux), free(ref), free(logits);
    route_free(&r);
  }
}

/* ---- dispatch, combine and their backwards against the reference ---- */

/* Device copies of a routing's choices. */
struct moe_dev {
  struct tensor expert, slot, gate;
};

static struct moe_dev moe_dev_from(const struct moe_case *k, const struct route_out *r) {
  int64_t nk[2] = {k->n, k->k};
  return (struct moe_dev){dev_i32(2, nk, r->expert), dev_i32(2, nk, r->slot), dev_from(r->gate, 2, nk)};
}

static void moe_dev_free(struct moe_dev *d) { tensor_free(&d->expert), tensor_free(&d->slot), tensor_free(&d->gate); }

/* Dispatch copies and dye is one float product per element, as in the
 * reference: exact. dispatch_bwd adds a token's rows onto dx in k order,
 * the reference's order: exact. combine sums K products in float (the
 * reference in double): 2e-6 absolute (K·|gate·ye| <= 1 here, a few ulp)
 * and 1e-5 relative. dgate: both dot products in double: 1e-6 absolute
 * and relative. */
static void data_ops_check(const struct moe_case *k, const struct route_out *r, int threads) {
  const int64_t rows = k->e * k->cap, nc = k->n * k->c, bs[2] = {rows, k->c}, ns[2] = {k->n, k->c};
  float *x = rand_host(nc, 1), *ye = rand_host(rows * k->c, 1), *dout = rand_host(nc, 1), *dx0 = rand_host(nc, 1);
  float *xe_ref = xmalloc((size_t)(rows * k->c) * 4 + 4), *dx_ref = host_copy(dx0, nc);
  float *out_ref = xmalloc((size_t)nc * 4), *dye_ref = xmalloc((size_t)(rows * k->c) * 4 + 4);
  float *dg_ref = xmalloc((size_t)(k->n * k->k) * 4);
  tensor_ref_moe_dispatch(x, r->expert, r->slot, xe_ref, k->n, k->c, k->k, k->e, k->cap);
  tensor_ref_moe_dispatch_bwd(ye, r->expert, r->slot, dx_ref, k->n, k->c, k->k, k->e, k->cap);
  tensor_ref_moe_combine(ye, r->expert, r->slot, r->gate, out_ref, k->n, k->c, k->k, k->e, k->cap);
  tensor_ref_moe_combine_bwd(dout, ye, r->expert, r->slot, r->gate, dye_ref, dg_ref, k->n, k->c, k->k, k->e, k->cap);
  struct moe_dev d = moe_dev_from(k, r);
  int64_t nks[2] = {k->n, k->k};
  struct tensor xt = dev_from(x, 2, ns), yet = dev_from(ye, 2, bs), dot = dev_from(dout, 2, ns);
  struct tensor xe = dev_nan(2, bs), dx = dev_from(dx0, 2, ns), out = dev_nan(2, ns), dye = dev_nan(2, bs);
  struct tensor dg = dev_nan(2, nks);
  tensor_moe_dispatch(&xt, &d.expert, &d.slot, k->cap, &xe);
  tensor_moe_dispatch_bwd(&yet, &d.expert, &d.slot, k->cap, &dx); /* ye serves as dxe */
  tensor_moe_combine(&yet, &d.expert, &d.slot, &d.gate, k->cap, &out);
  tensor_moe_combine_bwd(&dot, &yet, &d.expert, &d.slot, &d.gate, k->cap, &dye, &dg);
  float *g_xe = to_host(&xe), *g_dx = to_host(&dx), *g_out = to_host(&out);
  float *g_dye = to_host(&dye), *g_dg = to_host(&dg);
  char what[160];
  case_name(what, sizeof what, "dispatch xe", k, threads);
  expect_close(what, g_xe, xe_ref, rows * k->c, 0, 0);
  case_name(what, sizeof what, "dispatch_bwd dx", k, threads);
  expect_close(what, g_dx, dx_ref, nc, 0, 0);
  case_name(what, sizeof what, "combine out", k, threads);
  expect_close(what, g_out, out_ref, nc, 2e-6, 1e-5);
  case_name(what, sizeof what, "combine_bwd dye", k, threads);
  expect_close(what, g_dye, dye_ref, rows * k->c, 0, 0);
  case_name(what, sizeof what, "combine_bwd dgate", k, threads);
  expect_close(what, g_dg, dg_ref, k->n * k->k, 1e-6, 1e-6);
  for (int64_t i = 0; i < k->n * k->k; i++)
    cr_assert(r->slot[i] >= 0 || g_dg[i] == 0.0f, "%s: dropped choice %lld has dgate %g", what, (long long)i, g_dg[i]);
  free(g_xe), free(g_dx), free(g_out), free(g_dye), free(g_dg);
  tensor_free(&xt), tensor_free(&yet), tensor_free(&dot), tensor_free(&xe), tensor_free(&dx), tensor_free(&out);
  tensor_free(&dye), tensor_free(&dg);
  moe_dev_free(&d);
  free(x), free(ye), free(dout), free(dx0), free(xe_ref), free(dx_ref), free(out_ref), free(dye_ref), free(dg_ref);
}

Test(tensor_moe, dispatch_combine_and_backwards_match_reference) {
  for (size_t ci = 0; ci < NCASES; ci++) {
    const struct moe_case *k = &moe_cases[ci];
    float *logits = moe_logits(k);
    struct route_out r = route_alloc(k);
    route_ref(k, logits, &r);
    for (size_t th = 0; th < NTHREADS; th++) {
      tensor_backend_set_threads(be, thread_counts[th]);
      data_ops_check(k, &r, thread_counts[th]);
    }
    route_free(&r);
    free(logits);
  }
}

/* Choices whose indices fall outside the buffers count as dropped: nothing
 * is read or written for them (the NaN-free guard rows after xe stay). */
Test(tensor_moe, out_of_range_choices_are_treated_as_dropped) {
  const int64_t n = 3, c = 4, e = 2, cap = 2, bs[2] = {e * cap + 1, c}, ns[2] = {n, c}, nk[2] = {n, 2};
  const int32_t expert[] = {0, 2, -1, 1, 1, 0}, slot[] = {0, 0, 0, 5, 1, -3};
  float *x = rand_host(n * c, 1), guard[4] = {7, 7, 7, 7};
  struct tensor et = dev_i32(2, nk, expert), st = dev_i32(2, nk, slot), xt = dev_from(x, 2, ns);
  struct tensor whole = dev_nan(2, bs), xe = tensor_view(&whole, 0, 2, (int64_t[]){e * cap, c});
  tensor_copy_from_host(&whole, e * cap * c, guard, sizeof guard);
  tensor_moe_dispatch(&xt, &et, &st, cap, &xe);
  float *got = to_host(&whole);
  for (int64_t j = 0; j < c; j++) {
    cr_assert_eq(got[j], x[j], "row 0 of expert 0 is token 0");
    cr_assert_eq(got[3 * c + j], x[2 * c + j], "row 1 of expert 1 is token 2");
    cr_assert(got[c + j] == 0.0f && got[2 * c + j] == 0.0f, "unfilled rows are zero");
    cr_assert_eq(got[4 * c + j], 7.0f, "nothing written past xe");
  }
  free(got), free(x);
  tensor_free(&et), tensor_free(&st), tensor_free(&xt), tensor_free(&whole);
}

/* ---- gradient through the whole block, by finite differences ---- */

/* N = 8 tokens of width C = 4 and E = 3 experts, each a linear map
 * ye_e = xe_e·W_e (W_e [C, C]) by tensor_gemm on views of the buffers.
 * L = Σ w⊙out + α·E·Σ_e f_e·P_e + β·mean_n lse², P_e = psum_e / N, f_e a
 * constant. Token preferences (first, second, third) are fixed with
 * margins of at least 0.4 between a row's logits (0.5 apart, ±0.05 of
 * noise), so steps of h = 1e-2 never change a choice: with cap 3 token 7
 * loses both choices and several second choices drop; with cap 8 none. */
#define FD_N 8
#define FD_C 4
#define FD_E 3
static const int fd_prefs[FD_N][FD_E] = {{0, 1, 2}, {0, 2, 1}, {1, 0, 2}, {1, 2, 0},
                                         {2, 0, 1}, {2, 1, 0}, {0, 1, 2}, {0, 1, 2}};

struct fd_net {
  int k;
  int64_t cap;
  float x[FD_N * FD_C], logits[FD_N * FD_E], w[FD_E * FD_C * FD_C], lw[FD_N * FD_C], f[FD_E];
  float alpha, beta;
};

/* Everything one pass keeps on the backend. */
struct fd_state {
  struct tensor x, logits, w, probs, lse, expert, gate, slot, assigned, kept, psum, xe, ye, out;
};

static void fd_state_init(struct fd_state *s, const struct fd_net *p) {
  int64_t nc[2] = {FD_N, FD_C}, ne[2] = {FD_N, FD_E}, nk[2] = {FD_N, p->k}, wsh[2] = {FD_E * FD_C, FD_C};
  int64_t bs[2] = {FD_E * p->cap, FD_C}, n1 = FD_N, e1 = FD_E;
  s->x = dev_from(p->x, 2, nc), s->logits = dev_from(p->logits, 2, ne), s->w = dev_from(p->w, 2, wsh);
  s->probs = dev_nan(2, ne), s->lse = dev_nan(1, &n1), s->gate = dev_nan(2, nk), s->psum = dev_nan(1, &e1);
  s->expert = dev_i32(2, nk, NULL), s->slot = dev_i32(2, nk, NULL), s->assigned = dev_i32(1, &e1, NULL);
  s->kept = dev_i32(1, &e1, NULL), s->xe = dev_nan(2, bs), s->ye = dev_nan(2, bs), s->out = dev_nan(2, nc);
}

static void fd_state_free(struct fd_state *s) {
  struct tensor *all[] = {&s->x,    &s->logits,   &s->w,    &s->probs, &s->lse, &s->expert, &s->gate,
                          &s->slot, &s->assigned, &s->kept, &s->psum,  &s->xe,  &s->ye,     &s->out};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

/* Expert e's rows of a [E·cap, C] buffer, and its [C, C] weight. */
static struct tensor fd_rows(const struct tensor *buf, int64_t cap, int64_t e) {
  return tensor_view(buf, e * cap * FD_C, 2, (int64_t[]){cap, FD_C});
}
static struct tensor fd_weight(const struct tensor *w, int64_t e) {
  return tensor_view(w, e * FD_C * FD_C, 2, (int64_t[]){FD_C, FD_C});
}

/* The forward pass on the current inputs of p; returns L (in double). */
static double fd_forward(const struct fd_net *p, struct fd_state *s) {
  tensor_copy_from_host(&s->x, 0, p->x, sizeof p->x);
  tensor_copy_from_host(&s->logits, 0, p->logits, sizeof p->logits);
  tensor_copy_from_host(&s->w, 0, p->w, sizeof p->w);
  tensor_moe_route(&s->logits, p->k, p->cap, &s->probs, &s->lse, &s->expert, &s->gate, &s->slot, &s->assigned,
                   &s->kept, &s->psum);
  tensor_moe_dispatch(&s->x, &s->expert, &s->slot, p->cap, &s->xe);
  for (int64_t e = 0; e < FD_E; e++) {
    struct tensor xv = fd_rows(&s->xe, p->cap, e), yv = fd_rows(&s->ye, p->cap, e), wv = fd_weight(&s->w, e);
    tensor_gemm(false, false, 1.0f, &xv, &wv, 0.0f, &yv);
  }
  tensor_moe_combine(&s->ye, &s->expert, &s->slot, &s->gate, p->cap, &s->out);
  float out[FD_N * FD_C], lse[FD_N], psum[FD_E];
  tensor_copy_to_host(&s->out, 0, out, sizeof out);
  tensor_copy_to_host(&s->lse, 0, lse, sizeof lse);
  tensor_copy_to_host(&s->psum, 0, psum, sizeof psum);
  double l = 0;
  for (int i = 0; i < FD_N * FD_C; i++) l += (double)p->lw[i] * out[i];
  for (int e = 0; e < FD_E; e++) l += p->alpha * FD_E * (double)p->f[e] * psum[e] / FD_N;
  for (int i = 0; i < FD_N; i++) l += p->beta * (double)lse[i] * lse[i] / FD_N;
  return l;
}

/* The backward pass after fd_forward: dx, dlogits, dw (host), dgate and
 * the slots (host) for the dropped-choice checks. zscale_on 0 leaves out
 * the z-loss term (the negative control). */
struct fd_grads {
  float dx[FD_N * FD_C], dlogits[FD_N * FD_E], dw[FD_E * FD_C * FD_C], dgate[FD_N * FD_E];
  int32_t slot[FD_N * FD_E];
};

static void fd_backward(const struct fd_net *p, struct fd_state *s, bool zscale_on, struct fd_grads *g) {
  int64_t nc[2] = {FD_N, FD_C}, ne[2] = {FD_N, FD_E}, nk[2] = {FD_N, p->k}, wsh[2] = {FD_E * FD_C, FD_C};
  int64_t bs[2] = {FD_E * p->cap, FD_C}, e1 = FD_E;
  float daux_h[FD_E], zero[FD_N * FD_C] = {0};
  for (int e = 0; e < FD_E; e++) daux_h[e] = p->alpha * FD_E * p->f[e] / FD_N;
  struct tensor dout = dev_from(p->lw, 2, nc), dye = dev_nan(2, bs), dxe = dev_nan(2, bs), dx = dev_from(zero, 2, nc);
  struct tensor dgate = dev_nan(2, nk), dw = dev_nan(2, wsh), daux = dev_from(daux_h, 1, &e1), dl = dev_nan(2, ne);
  tensor_moe_combine_bwd(&dout, &s->ye, &s->expert, &s->slot, &s->gate, p->cap, &dye, &dgate);
  for (int64_t e = 0; e < FD_E; e++) {
    struct tensor dyv = fd_rows(&dye, p->cap, e), dxv = fd_rows(&dxe, p->cap, e), xv = fd_rows(&s->xe, p->cap, e);
    struct tensor wv = fd_weight(&s->w, e), dwv = fd_weight(&dw, e);
    tensor_gemm(false, true, 1.0f, &dyv, &wv, 0.0f, &dxv);
    tensor_gemm(true, false, 1.0f, &xv, &dyv, 0.0f, &dwv);
  }
  tensor_moe_dispatch_bwd(&dxe, &s->expert, &s->slot, p->cap, &dx);
  tensor_moe_route_bwd(&s->probs, &s->lse, &s->expert, &s->gate, &dgate, &daux,
                       zscale_on ? 2.0f * p->beta / FD_N : 0.0f, &dl);
  tensor_copy_to_host(&dx, 0, g->dx, sizeof g->dx);
  tensor_copy_to_host(&dl, 0, g->dlogits, sizeof g->dlogits);
  tensor_copy_to_host(&dw, 0, g->dw, sizeof g->dw);
  tensor_copy_to_host(&dgate, 0, g->dgate, (size_t)(FD_N * p->k) * 4);
  tensor_copy_to_host(&s->slot, 0, g->slot, (size_t)(FD_N * p->k) * 4);
  tensor_free(&dout), tensor_free(&dye), tensor_free(&dxe), tensor_free(&dx), tensor_free(&dgate);
  tensor_free(&dw), tensor_free(&daux), tensor_free(&dl);
}

static void fd_net_init(struct fd_net *p, int k, int64_t cap) {
  p->k = k, p->cap = cap, p->alpha = 0.3f, p->beta = 0.2f;
  for (int i = 0; i < FD_N * FD_C; i++) p->x[i] = 2.0f * rng_uniform(&rng) - 1.0f;
  for (int i = 0; i < FD_N * FD_C; i++) p->lw[i] = 2.0f * rng_uniform(&rng) - 1.0f;
  for (int i = 0; i < FD_E * FD_C * FD_C; i++) p->w[i] = 2.0f * rng_uniform(&rng) - 1.0f;
  for (int e = 0; e < FD_E; e++) p->f[e] = 0.2f + 0.3f * (float)e;
  for (int i = 0; i < FD_N; i++)
    for (int r = 0; r < FD_E; r++)
      p->logits[i * FD_E + fd_prefs[i][r]] = 0.5f * (float)(FD_E - r) + 0.1f * (rng_uniform(&rng) - 0.5f);
}

/* Central differences with h = 1e-2 against `grad`. L is linear in x and
 * W for fixed choices, so there only the forward's float rounding enters:
 * L sums about 40 terms of size <= 2, each rounded at 6e-8 relative, so
 * its noise is a few 1e-7, over 2h = 0.02: about 1e-5. In the logits the
 * softmax adds the O(h²) truncation, h²/6·|L'''|, a few 1e-6 for |L'''| of
 * order 0.1 (the gates' and the z-loss's third derivatives at these
 * scales). Allowed: 1e-4 + 1e-4·|grad| (5 % of it used, measured), while
 * leaving out the z-loss term moves the gradient by 0.05 (the negative
 * control below). Returns the largest |fd − grad| / allowed. */
static double fd_compare(const char *what, struct fd_net *p, struct fd_state *s, float *v, int n, const float *grad,
                         bool must_pass) {
  double worst = 0;
  for (int i = 0; i < n; i++) {
    const float v0 = v[i];
    v[i] = v0 + 1e-2f;
    const float vp = v[i];
    double lp = fd_forward(p, s);
    v[i] = v0 - 1e-2f;
    const float vm = v[i];
    double lm = fd_forward(p, s);
    v[i] = v0;
    double fd = (lp - lm) / ((double)vp - vm), tol = 1e-4 + 1e-4 * fabs(grad[i]);
    double ratio = fabs(fd - grad[i]) / tol;
    worst = ratio > worst ? ratio : worst;
    if (must_pass)
      cr_assert(ratio <= 1.0, "%s: element %d: finite difference %.9g, backward %.9g (tol %.3g)", what, i, fd, grad[i],
                tol);
  }
  cr_log_info("%s: %.3f of the tolerance used", what, worst);
  return worst;
}

Test(tensor_moe, block_gradient_matches_finite_differences_with_and_without_drops) {
  const struct {
    int k;
    int64_t cap;
  } cases[] = {{2, 8}, {2, 3}, {1, 8}, {1, 3}};
  for (size_t ci = 0; ci < sizeof cases / sizeof cases[0]; ci++) {
    struct fd_net p;
    fd_net_init(&p, cases[ci].k, cases[ci].cap);
    struct fd_state s;
    fd_state_init(&s, &p);
    struct fd_grads g, g_noz;
    fd_forward(&p, &s);
    fd_backward(&p, &s, true, &g);
    fd_backward(&p, &s, false, &g_noz);
    char what[96];
    snprintf(what, sizeof what, "K=%d cap=%lld dx", p.k, (long long)p.cap);
    fd_compare(what, &p, &s, p.x, FD_N * FD_C, g.dx, true);
    snprintf(what, sizeof what, "K=%d cap=%lld dW", p.k, (long long)p.cap);
    fd_compare(what, &p, &s, p.w, FD_E * FD_C * FD_C, g.dw, true);
    snprintf(what, sizeof what, "K=%d cap=%lld dlogits", p.k, (long long)p.cap);
    fd_compare(what, &p, &s, p.logits, FD_N * FD_E, g.dlogits, true);
    snprintf(what, sizeof what, "K=%d cap=%lld dlogits without the z-loss term", p.k, (long long)p.cap);
    cr_assert(fd_compare(what, &p, &s, p.logits, FD_N * FD_E, g_noz.dlogits, false) > 2.0,
              "%s: leaving out the z-loss gradient went unnoticed", what);

    /* Dropped choices: dgate exactly 0; with cap 3, token 7 lost both (K = 2)
     * or its only (K = 1) choice: its dx is exactly 0, and so is its
     * finite difference (its x is read by nothing). */
    int dropped = 0;
    for (int i = 0; i < FD_N * p.k; i++)
      if (g.slot[i] < 0) {
        dropped++;
        cr_assert_eq(g.dgate[i], 0.0f, "dropped choice %d has dgate %g", i, g.dgate[i]);
      }
    cr_assert_eq(dropped > 0, p.cap == 3, "K=%d cap=%lld: %d dropped choices", p.k, (long long)p.cap, dropped);
    if (p.cap == 3)
      for (int j = 0; j < FD_C; j++) {
        cr_assert_eq(g.dx[7 * FD_C + j], 0.0f, "token 7 lost every choice but has dx %g", g.dx[7 * FD_C + j]);
        float *xv = &p.x[7 * FD_C + j], x0 = *xv;
        *xv = x0 + 0.5f;
        double lp = fd_forward(&p, &s);
        *xv = x0;
        cr_assert_eq(lp, fd_forward(&p, &s), "the loss moved with a fully dropped token's input");
      }
    fd_state_free(&s);
  }
}

/* ---- determinism ---- */

/* The large case, whose every op is split between 2 threads: each output
 * has the same bits on a second run and at 1 and 2 threads. */
Test(tensor_moe, every_op_gives_the_same_bits_run_to_run_and_at_1_and_2_threads) {
  const struct moe_case *k = &moe_cases[NCASES - 1];
  float *logits = moe_logits(k);
  const int64_t rows = k->e * k->cap, nc = k->n * k->c, ne = k->n * k->e, nk = k->n * k->k;
  const int64_t bs[2] = {rows, k->c}, ns[2] = {k->n, k->c}, nks[2] = {k->n, k->k}, e1 = k->e;
  float *x = rand_host(nc, 1), *ye = rand_host(rows * k->c, 1), *dout = rand_host(nc, 1), *daux = rand_host(k->e, 1);
  float *keep[7] = {0}; /* run 0's probs, gate, xe, dx, out, dye, dlogits */
  int32_t *keep_i[2] = {0}; /* and its experts and slots */
  for (int run = 0; run < 3; run++) { /* runs 0 and 1 at 1 thread, run 2 at 2 */
    tensor_backend_set_threads(be, run < 2 ? 1 : 2);
    struct route_out r = route_cpu(k, logits);
    struct moe_dev d = moe_dev_from(k, &r);
    struct tensor xt = dev_from(x, 2, ns), yet = dev_from(ye, 2, bs), dot = dev_from(dout, 2, ns);
    struct tensor xe = dev_nan(2, bs), dx = dev_from(dout, 2, ns), out = dev_nan(2, ns), dye = dev_nan(2, bs);
    struct tensor dg = dev_nan(2, nks), da = dev_from(daux, 1, &e1);
    struct tensor probs = dev_from(r.probs, 2, (int64_t[]){k->n, k->e}), lse = dev_from(r.lse, 1, &k->n);
    struct tensor dl = dev_nan(2, (int64_t[]){k->n, k->e});
    tensor_moe_dispatch(&xt, &d.expert, &d.slot, k->cap, &xe);
    tensor_moe_dispatch_bwd(&yet, &d.expert, &d.slot, k->cap, &dx);
    tensor_moe_combine(&yet, &d.expert, &d.slot, &d.gate, k->cap, &out);
    tensor_moe_combine_bwd(&dot, &yet, &d.expert, &d.slot, &d.gate, k->cap, &dye, &dg);
    tensor_moe_route_bwd(&probs, &lse, &d.expert, &d.gate, &dg, &da, 0.01f, &dl);
    float *now[7] = {host_copy(r.probs, ne), host_copy(r.gate, nk), to_host(&xe), to_host(&dx),
                     to_host(&out),          to_host(&dye),         to_host(&dl)};
    const int64_t sizes[7] = {ne, nk, rows * k->c, nc, nc, rows * k->c, ne};
    static const char *const names[7] = {"probs", "gate", "xe", "dx", "out", "dye", "dlogits"};
    if (run == 0) {
      memcpy(keep, now, sizeof now);
      keep_i[0] = r.expert, keep_i[1] = r.slot;
      r.expert = r.slot = NULL; /* kept: route_free below leaves them */
    } else {
      for (int o = 0; o < 7; o++) {
        char what[64];
        snprintf(what, sizeof what, "%s, %s", names[o], run == 1 ? "second run" : "2 threads");
        expect_same_bits(what, now[o], keep[o], sizes[o]);
        free(now[o]);
      }
      expect_same_i32("expert", r.expert, keep_i[0], nk);
      expect_same_i32("slot", r.slot, keep_i[1], nk);
    }
    route_free(&r);
    moe_dev_free(&d);
    tensor_free(&xt), tensor_free(&yet), tensor_free(&dot), tensor_free(&xe), tensor_free(&dx), tensor_free(&out);
    tensor_free(&dye), tensor_free(&dg), tensor_free(&da), tensor_free(&probs), tensor_free(&lse), tensor_free(&dl);
  }
  for (int o = 0; o < 7; o++) free(keep[o]);
  free(keep_i[0]), free(keep_i[1]);
  free(logits), free(x), free(ye), free(dout), free(daux);
}
