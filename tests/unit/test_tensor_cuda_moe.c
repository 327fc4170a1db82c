/*
 * The CUDA backend's mixture-of-experts ops (tensor.h, tensor_moe_*)
 * against the CPU backend's, which test_tensor_moe checks against the
 * plain reference.
 *
 * - Shapes: N a multiple of nothing, E = 1, 2, 8, 64, K = 1, 2, 8 (K = E),
 *   capacities that drop choices, that drop none and cap = 1, logits with
 *   ties, and once GPT-2 small's batch (N = 8192, C = 768, E = 8, K = 2,
 *   cap = ceil(1.25·N·K/E) = 2560).
 * - Routing: experts, slots, assigned and kept exactly equal (both rank on
 *   the logits with the same rule); floats within the tolerances stated at
 *   each check. The ops after routing take the CPU's routing as input on
 *   both backends, so they see the same choices and gates.
 * - Every device output starts as NaN (I32: −7) between sentinel guard
 *   bands, checked after the ops; every op runs twice and must give the
 *   same bits.
 *
 * Every test needs a GPU and skips with "no CUDA GPU: ..." when
 * tensor_cuda_device_count() is 0. RUMOR_TEST_SEED=<n> repeats a run.
 */
#include <criterion/criterion.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_ref.h"

#include "../support/cuda_check.h"

struct moe_case {
  int64_t n, e;
  int k;
  int64_t c, cap;
  bool ties;
};

static const struct moe_case kCases[] = {
    {8192, 8, 2, 768, 2560, false}, /* GPT-2 small's batch, capacity factor 1.25 */
    {37, 1, 1, 5, 10, false},       {53, 2, 2, 7, 30, true},   {53, 2, 2, 7, 53, false},
    {101, 8, 8, 13, 1, true},       {101, 8, 2, 13, 32, true}, {301, 64, 8, 9, 48, false},
    {301, 64, 2, 33, 1, false},     {301, 64, 1, 40, 6, true},
};
#define NCASES ((int)(sizeof kCases / sizeof kCases[0]))

/* A host-side tensor on the CPU backend `cpu`, from host data. */
static struct tensor cpu_from(tensor_backend_t cpu, enum tensor_dtype dt, int ndim, const int64_t *shape,
                              const void *h) {
  struct tensor t;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_alloc(&t, cpu, dt, ndim, shape, &e), 0, "%s", e.msg);
  if (h) tensor_copy_from_host(&t, 0, h, tensor_nbytes(&t));
  return t;
}

/* A guarded device tensor of dt holding host data (or poison when NULL:
 * NaN, or −7 for I32, which is no expert, no slot and not −1). */
static struct dev gpu_from(enum tensor_dtype dt, int ndim, const int64_t *shape, const void *h) {
  struct dev d = dev_new_dt(dt, ndim, shape);
  if (h) {
    dev_upload(&d, h);
  } else if (dt == TENSOR_I32) {
    int32_t *p = hbuf_i32(d.n);
    for (int64_t i = 0; i < d.n; i++) p[i] = -7;
    dev_upload(&d, p);
  }
  return d;
}

static void case_name(char *buf, size_t len, const char *op, const struct moe_case *k) {
  snprintf(buf, len, "%s N=%" PRId64 " E=%" PRId64 " K=%d C=%" PRId64 " cap=%" PRId64 "%s", op, k->n, k->e, k->k,
           k->c, k->cap, k->ties ? " ties" : "");
}

static bool same_i32(const char *what, const int32_t *got, const int32_t *want, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (got[i] != want[i])
      return fail_why("%s: element %" PRId64 " of %" PRId64 " is %d, the CPU's %d (seed %" PRIu64 ")", what, i, n,
                      got[i], want[i], g_seed);
  return true;
}

/* Routing on both backends. Returns the CPU's results in the host
 * buffers r[0..8) (probs, lse, gate, psum as float; expert, slot, assigned,
 * kept as I32). */
struct route_host {
  float *probs, *lse, *gate, *psum;
  int32_t *expert, *slot, *assigned, *kept;
};

static struct route_host route_on_cpu(tensor_backend_t cpu, const struct moe_case *k, const float *logits) {
  const int64_t ne[2] = {k->n, k->e}, nk[2] = {k->n, k->k}, n1 = k->n, e1 = k->e;
  struct tensor t[9] = {cpu_from(cpu, TENSOR_F32, 2, ne, logits), cpu_from(cpu, TENSOR_F32, 2, ne, NULL),
                        cpu_from(cpu, TENSOR_F32, 1, &n1, NULL),  cpu_from(cpu, TENSOR_F32, 2, nk, NULL),
                        cpu_from(cpu, TENSOR_F32, 1, &e1, NULL),  cpu_from(cpu, TENSOR_I32, 2, nk, NULL),
                        cpu_from(cpu, TENSOR_I32, 2, nk, NULL),   cpu_from(cpu, TENSOR_I32, 1, &e1, NULL),
                        cpu_from(cpu, TENSOR_I32, 1, &e1, NULL)};
  tensor_moe_route(&t[0], k->k, k->cap, &t[1], &t[2], &t[5], &t[3], &t[6], &t[7], &t[8], &t[4]);
  struct route_host r = {hbuf(k->n * k->e), hbuf(k->n),       hbuf(k->n * k->k),     hbuf(k->e),
                         hbuf_i32(k->n * k->k), hbuf_i32(k->n * k->k), hbuf_i32(k->e), hbuf_i32(k->e)};
  void *dst[8] = {r.probs, r.lse, r.gate, r.psum, r.expert, r.slot, r.assigned, r.kept};
  for (int i = 0; i < 8; i++) tensor_copy_to_host(&t[i + 1], 0, dst[i], tensor_nbytes(&t[i + 1]));
  for (int i = 0; i < 9; i++) tensor_free(&t[i]);
  return r;
}

/* Tolerances: the GPU's softmax uses expf (2 ulp) and IEEE division, the
 * CPU's a 1.5-ulp polynomial: probs and gates within 1e-5 relative (the
 * rounding of l − max, |l − max| < 16 here, times 6e-8, plus the sums);
 * lse within 1e-5 absolute; psum (float partials on the GPU, double on the
 * CPU, up to 8192 terms of the probs' error) 1e-5 absolute and relative.
 * Indices and counts exactly. The whole routing twice: the same bits. */
static bool route_matches(const struct moe_case *k, const float *logits, const struct route_host *want) {
  const int64_t ne[2] = {k->n, k->e}, nk[2] = {k->n, k->k}, n1 = k->n, e1 = k->e;
  char what[160];
  void *first[8];
  for (int o = 0; o < 8; o++) first[o] = hbuf_bytes((size_t)(o == 0 ? k->n * k->e : k->n * k->k + k->n + k->e) * 4);
  for (int run = 0; run < 2; run++) {
    int mark = arena_mark();
    struct dev l = gpu_from(TENSOR_F32, 2, ne, logits), probs = gpu_from(TENSOR_F32, 2, ne, NULL);
    struct dev lse = gpu_from(TENSOR_F32, 1, &n1, NULL), gate = gpu_from(TENSOR_F32, 2, nk, NULL);
    struct dev psum = gpu_from(TENSOR_F32, 1, &e1, NULL), expert = gpu_from(TENSOR_I32, 2, nk, NULL);
    struct dev slot = gpu_from(TENSOR_I32, 2, nk, NULL), assigned = gpu_from(TENSOR_I32, 1, &e1, NULL);
    struct dev kept = gpu_from(TENSOR_I32, 1, &e1, NULL);
    tensor_moe_route(&l.t, k->k, k->cap, &probs.t, &lse.t, &expert.t, &gate.t, &slot.t, &assigned.t, &kept.t,
                     &psum.t);
    struct dev *outs[8] = {&probs, &lse, &gate, &psum, &expert, &slot, &assigned, &kept};
    const void *wants[8] = {want->probs, want->lse, want->gate, want->psum,
                            want->expert, want->slot, want->assigned, want->kept};
    static const char *const names[8] = {"probs", "lse", "gate", "psum", "expert", "slot", "assigned", "kept"};
    const double atol[4] = {1e-12, 1e-5, 1e-12, 1e-5}, rtol[4] = {1e-5, 0, 1e-5, 1e-5};
    for (int o = 0; o < 8; o++) {
      case_name(what, sizeof what, names[o], k);
      void *got = hbuf_bytes((size_t)outs[o]->n * 4);
      dev_download(outs[o], got);
      bool ok = o < 4 ? matches(what, got, wants[o], outs[o]->n, atol[o], rtol[o])
                      : same_i32(what, got, wants[o], outs[o]->n);
      if (!ok || !guards_intact(outs[o], what)) return false;
      if (run == 0) memcpy(first[o], got, (size_t)outs[o]->n * 4);
      else if (!same_bits(what, got, first[o], outs[o]->n)) return false;
    }
    arena_release(mark);
  }
  return true;
}

/* Host inputs and the CPU's outputs of the ops after routing. */
struct data_host {
  float *x, *ye, *dout, *dx0, *dgate_in, *daux;
  float *xe, *dx, *out, *dye, *dgate, *dlogits; /* the CPU's */
};

static struct data_host data_on_cpu(tensor_backend_t cpu, const struct moe_case *k, const struct route_host *r) {
  const int64_t rows = k->e * k->cap, nc = k->n * k->c, ns[2] = {k->n, k->c}, bs[2] = {rows, k->c};
  const int64_t nk[2] = {k->n, k->k}, ne[2] = {k->n, k->e}, n1 = k->n, e1 = k->e;
  struct data_host d = {hbuf(nc), hbuf(rows * k->c), hbuf(nc), hbuf(nc), hbuf(k->n * k->k), hbuf(k->e),
                        hbuf(rows * k->c), hbuf(nc), hbuf(nc), hbuf(rows * k->c), hbuf(k->n * k->k),
                        hbuf(k->n * k->e)};
  fill_normal(d.x, nc, 0, 1), fill_normal(d.ye, rows * k->c, 0, 1), fill_normal(d.dout, nc, 0, 1);
  fill_normal(d.dx0, nc, 0, 1), fill_normal(d.dgate_in, k->n * k->k, 0, 1), fill_normal(d.daux, k->e, 0, 0.1f);
  for (int64_t i = 0; i < k->n * k->k; i++)
    if (r->slot[i] < 0) d.dgate_in[i] = 0.0f; /* as combine_bwd gives it */
  struct tensor ex = cpu_from(cpu, TENSOR_I32, 2, nk, r->expert), sl = cpu_from(cpu, TENSOR_I32, 2, nk, r->slot);
  struct tensor g = cpu_from(cpu, TENSOR_F32, 2, nk, r->gate), x = cpu_from(cpu, TENSOR_F32, 2, ns, d.x);
  struct tensor ye = cpu_from(cpu, TENSOR_F32, 2, bs, d.ye), dout = cpu_from(cpu, TENSOR_F32, 2, ns, d.dout);
  struct tensor xe = cpu_from(cpu, TENSOR_F32, 2, bs, NULL), dx = cpu_from(cpu, TENSOR_F32, 2, ns, d.dx0);
  struct tensor out = cpu_from(cpu, TENSOR_F32, 2, ns, NULL), dye = cpu_from(cpu, TENSOR_F32, 2, bs, NULL);
  struct tensor dg = cpu_from(cpu, TENSOR_F32, 2, nk, NULL), dgi = cpu_from(cpu, TENSOR_F32, 2, nk, d.dgate_in);
  struct tensor probs = cpu_from(cpu, TENSOR_F32, 2, ne, r->probs), lse = cpu_from(cpu, TENSOR_F32, 1, &n1, r->lse);
  struct tensor da = cpu_from(cpu, TENSOR_F32, 1, &e1, d.daux), dl = cpu_from(cpu, TENSOR_F32, 2, ne, NULL);
  tensor_moe_dispatch(&x, &ex, &sl, k->cap, &xe);
  tensor_moe_dispatch_bwd(&ye, &ex, &sl, k->cap, &dx); /* ye serves as dxe */
  tensor_moe_combine(&ye, &ex, &sl, &g, k->cap, &out);
  tensor_moe_combine_bwd(&dout, &ye, &ex, &sl, &g, k->cap, &dye, &dg);
  tensor_moe_route_bwd(&probs, &lse, &ex, &g, &dgi, &da, 0.01f, &dl);
  struct tensor *src[6] = {&xe, &dx, &out, &dye, &dg, &dl};
  float *dst[6] = {d.xe, d.dx, d.out, d.dye, d.dgate, d.dlogits};
  for (int i = 0; i < 6; i++) tensor_copy_to_host(src[i], 0, dst[i], tensor_nbytes(src[i]));
  struct tensor *all[] = {&ex, &sl, &g, &x, &ye, &dout, &xe, &dx, &out, &dye, &dg, &dgi, &probs, &lse, &da, &dl};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
  return d;
}

/* Tolerances: dispatch copies, dye is one product and dispatch_bwd the
 * CPU's adds in the CPU's order: exact. combine: K products summed in
 * float on both sides, maybe fused differently: 1e-5 absolute and
 * relative (terms of a few units). dgate: a float dot product of C terms
 * on the GPU (strided lanes and a butterfly) against the CPU's in double:
 * 32·2⁻²⁴·Σ|dout·ye| per choice. dlogits: the CPU's tolerance against the
 * reference, 1e-6 absolute and 1e-5 relative. Every op twice: the same
 * bits. */
static bool data_matches(const struct moe_case *k, const struct route_host *r, const struct data_host *d) {
  const int64_t rows = k->e * k->cap, ns[2] = {k->n, k->c}, bs[2] = {rows, k->c}, nk[2] = {k->n, k->k};
  const int64_t ne[2] = {k->n, k->e}, n1 = k->n, e1 = k->e;
  double *dg_tol = hbuf_bytes((size_t)(k->n * k->k) * sizeof(double));
  for (int64_t o = 0; o < k->n * k->k; o++) {
    int64_t i = o / k->k, x = r->expert[o], s = r->slot[o];
    double a = 0;
    if (s >= 0)
      for (int64_t j = 0; j < k->c; j++) a += fabs((double)d->dout[i * k->c + j] * d->ye[(x * k->cap + s) * k->c + j]);
    dg_tol[o] = 32.0 * 0x1p-24 * a;
  }
  float *first[6] = {0};
  char what[160];
  for (int run = 0; run < 2; run++) {
    struct dev ex = gpu_from(TENSOR_I32, 2, nk, r->expert), sl = gpu_from(TENSOR_I32, 2, nk, r->slot);
    struct dev g = gpu_from(TENSOR_F32, 2, nk, r->gate), x = gpu_from(TENSOR_F32, 2, ns, d->x);
    struct dev ye = gpu_from(TENSOR_F32, 2, bs, d->ye), dout = gpu_from(TENSOR_F32, 2, ns, d->dout);
    struct dev xe = gpu_from(TENSOR_F32, 2, bs, NULL), dx = gpu_from(TENSOR_F32, 2, ns, d->dx0);
    struct dev out = gpu_from(TENSOR_F32, 2, ns, NULL), dye = gpu_from(TENSOR_F32, 2, bs, NULL);
    struct dev dg = gpu_from(TENSOR_F32, 2, nk, NULL), dgi = gpu_from(TENSOR_F32, 2, nk, d->dgate_in);
    struct dev probs = gpu_from(TENSOR_F32, 2, ne, r->probs), lse = gpu_from(TENSOR_F32, 1, &n1, r->lse);
    struct dev da = gpu_from(TENSOR_F32, 1, &e1, d->daux), dl = gpu_from(TENSOR_F32, 2, ne, NULL);
    tensor_moe_dispatch(&x.t, &ex.t, &sl.t, k->cap, &xe.t);
    tensor_moe_dispatch_bwd(&ye.t, &ex.t, &sl.t, k->cap, &dx.t);
    tensor_moe_combine(&ye.t, &ex.t, &sl.t, &g.t, k->cap, &out.t);
    tensor_moe_combine_bwd(&dout.t, &ye.t, &ex.t, &sl.t, &g.t, k->cap, &dye.t, &dg.t);
    tensor_moe_route_bwd(&probs.t, &lse.t, &ex.t, &g.t, &dgi.t, &da.t, 0.01f, &dl.t);
    struct dev *outs[6] = {&xe, &dx, &out, &dye, &dg, &dl};
    const float *wants[6] = {d->xe, d->dx, d->out, d->dye, d->dgate, d->dlogits};
    static const char *const names[6] = {"dispatch xe", "dispatch_bwd dx", "combine out",
                                         "combine_bwd dye", "combine_bwd dgate", "route_bwd dlogits"};
    for (int o = 0; o < 6; o++) {
      case_name(what, sizeof what, names[o], k);
      float *got = hbuf(outs[o]->n);
      dev_download(outs[o], got);
      bool ok = o == 2   ? matches(what, got, wants[o], outs[o]->n, 1e-5, 1e-5)
                : o == 4 ? matches_rows(what, got, wants[o], outs[o]->n, 0, 1e-6, dg_tol, 1)
                : o == 5 ? matches(what, got, wants[o], outs[o]->n, 1e-6, 1e-5)
                         : matches_exactly(what, got, wants[o], outs[o]->n);
      if (!ok || !guards_intact(outs[o], what)) return false;
      if (run == 0) first[o] = got;
      else if (!same_bits(what, got, first[o], outs[o]->n)) return false;
    }
  }
  return true;
}

Test(cuda_moe, every_op_matches_the_cpu_backend_exactly_on_routing_and_is_deterministic, .timeout = 300) {
  open_gpu();
  tensor_backend_t cpu;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_backend_open("cpu", &cpu, &e), 0, "%s", e.msg);
  tensor_backend_set_threads(cpu, 2);
  for (int ci = 0; ci < NCASES; ci++) {
    const struct moe_case *k = &kCases[ci];
    int mark = arena_mark();
    float *logits = hbuf(k->n * k->e);
    if (k->ties)
      for (int64_t i = 0; i < k->n * k->e; i++) logits[i] = 0.5f * (float)((int)rng_below(&g_rng, 5) - 2);
    else
      fill_normal(logits, k->n * k->e, 0.0f, 2.0f);
    struct route_host r = route_on_cpu(cpu, k, logits);
    cr_assert(route_matches(k, logits, &r), "%s", g_why);
    struct data_host d = data_on_cpu(cpu, k, &r);
    cr_assert(data_matches(k, &r, &d), "%s", g_why);
    arena_release(mark);
  }
  tensor_backend_close(cpu);
  close_gpu();
}

/* Expert parallelism's packed form (gpt_moe_ep.c): a rank's kept choices
 * in one buffer, every choice to "expert" 0 with its row of that buffer as
 * the slot (−1: not kept), so K > E = 1 there. The four data ops take it
 * on the GPU as on the CPU: copies and the CPU's adds exact, combine within
 * 1e-5, dgate within its dot product's bound (as above). Once for K = 2
 * and once for K = 8 (N = 97, C = 33, a choice in five not kept). */
static bool packed_matches(tensor_backend_t cpu, int K) {
  const int64_t n = 97, c = 33, nk[2] = {n, K}, ns[2] = {n, c};
  int32_t *zeros = hbuf_i32(n * K), *slot = hbuf_i32(n * K);
  int64_t tk = 0;
  for (int64_t o = 0; o < n * K; o++) zeros[o] = 0, slot[o] = o % 5 == 3 ? -1 : (int32_t)tk++;
  for (int64_t o = n * K - 1; o > 0; o--) { /* the kept rows in a shuffled order */
    int64_t j = (int64_t)rng_below(&g_rng, (uint64_t)o + 1);
    int32_t t = slot[o];
    slot[o] = slot[j], slot[j] = t;
  }
  const int64_t ts[2] = {tk, c};
  float *x = hbuf(n * c), *ye = hbuf(tk * c), *dout = hbuf(n * c), *dx0 = hbuf(n * c), *gate = hbuf(n * K);
  fill_normal(x, n * c, 0, 1), fill_normal(ye, tk * c, 0, 1), fill_normal(dout, n * c, 0, 1);
  fill_normal(dx0, n * c, 0, 1), fill_normal(gate, n * K, 0, 1);
  double *dg_tol = hbuf_bytes((size_t)(n * K) * sizeof(double));
  for (int64_t o = 0; o < n * K; o++) {
    double a = 0;
    for (int64_t j = 0; slot[o] >= 0 && j < c; j++) a += fabs((double)dout[(o / K) * c + j] * ye[slot[o] * c + j]);
    dg_tol[o] = 32.0 * 0x1p-24 * a;
  }
  const int64_t lens[5] = {tk * c, n * c, n * c, tk * c, n * K};
  float *want[5], *got[5];
  for (int side = 0; side < 2; side++) {
    struct tensor t[10];
    struct dev d[10];
    const int64_t *shp[10] = {nk, nk, nk, ns, ts, ns, ts, ns, ns, ts};
    const void *src[10] = {zeros, slot, gate, x, ye, dout, NULL, dx0, NULL, NULL};
    enum tensor_dtype dt[10] = {TENSOR_I32, TENSOR_I32, TENSOR_F32, TENSOR_F32, TENSOR_F32,
                                TENSOR_F32, TENSOR_F32, TENSOR_F32, TENSOR_F32, TENSOR_F32};
    for (int i = 0; i < 10; i++) {
      if (side == 0) t[i] = cpu_from(cpu, dt[i], 2, shp[i], src[i]);
      else d[i] = gpu_from(dt[i], 2, shp[i], src[i]), t[i] = d[i].t;
    }
    const int64_t dgs[2] = {n, K};
    struct tensor dg;
    struct dev ddg;
    if (side == 0) dg = cpu_from(cpu, TENSOR_F32, 2, dgs, NULL);
    else ddg = gpu_from(TENSOR_F32, 2, dgs, NULL), dg = ddg.t;
    /* t: 0 expert, 1 slot, 2 gate, 3 x, 4 ye, 5 dout, 6 xe, 7 dx, 8 out, 9 dye */
    tensor_moe_dispatch(&t[3], &t[0], &t[1], tk, &t[6]);
    tensor_moe_dispatch_bwd(&t[4], &t[0], &t[1], tk, &t[7]); /* ye serves as dxe */
    tensor_moe_combine(&t[4], &t[0], &t[1], &t[2], tk, &t[8]);
    tensor_moe_combine_bwd(&t[5], &t[4], &t[0], &t[1], &t[2], tk, &t[9], &dg);
    struct tensor *outs[5] = {&t[6], &t[7], &t[8], &t[9], &dg};
    float **dst = side == 0 ? want : got;
    for (int o = 0; o < 5; o++) {
      dst[o] = hbuf(lens[o]);
      if (side == 0) tensor_copy_to_host(outs[o], 0, dst[o], tensor_nbytes(outs[o]));
      else if (dev_download(o == 4 ? &ddg : &d[6 + o], dst[o]), !guards_intact(o == 4 ? &ddg : &d[6 + o], "packed"))
        return false;
    }
    if (side == 0)
      for (int i = 0; i < 10; i++) tensor_free(&t[i]);
    if (side == 0) tensor_free(&dg);
  }
  static const char *const names[5] = {"packed dispatch xe", "packed dispatch_bwd dx", "packed combine out",
                                       "packed combine_bwd dye", "packed combine_bwd dgate"};
  for (int o = 0; o < 5; o++) {
    char what[80];
    snprintf(what, sizeof what, "%s K=%d", names[o], K);
    bool ok = o == 2   ? matches(what, got[o], want[o], lens[o], 1e-5, 1e-5)
              : o == 4 ? matches_rows(what, got[o], want[o], lens[o], 0, 1e-6, dg_tol, 1)
                       : matches_exactly(what, got[o], want[o], lens[o]);
    if (!ok) return false;
  }
  return true;
}

Test(cuda_moe, the_packed_form_of_expert_parallelism_matches_the_cpu_with_more_choices_than_experts) {
  open_gpu();
  tensor_backend_t cpu;
  struct rumor_err e = {0};
  cr_assert_eq(tensor_backend_open("cpu", &cpu, &e), 0, "%s", e.msg);
  for (int K = 2; K <= 8; K *= 4) {
    int mark = arena_mark();
    cr_assert(packed_matches(cpu, K), "%s", g_why);
    arena_release(mark);
  }
  tensor_backend_close(cpu);
  close_gpu();
}
