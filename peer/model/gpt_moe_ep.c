/*
 * Expert parallelism for the mixture-of-experts MLP (model.h's "expert
 * parallelism"): rank r of P runs experts [lo, hi) of every block on the
 * rows all ranks route to them.
 *
 * A pass, on every rank at once:
 *   1. route the rank's own n tokens (nothing dropped yet) and count its
 *      choices per (k, expert);
 *   2. all-gather the counts: the plan. From it every rank derives the
 *      same global picture: the capacity of the total tokens, and for each
 *      (rank i, choice k, expert x) the run of slots its choices take,
 *      [base, base + keep), in (k, rank, token) order as one process would
 *      fill them;
 *   3. pack the rank's kept choices' rows by (expert, k, slot) (the
 *      dispatch op with one "expert", all zeros, and each choice's packed
 *      row, prow) and all-to-all them: experts [lo_j, hi_j) of rank j are
 *      one contiguous run of the packed rows;
 *   4. an expert's rank places what it received at the slots (the
 *      dispatch op again, one choice per row), runs its experts and
 *      gathers their outputs back in received order (the combine op with
 *      gates of 1), and the reverse all-to-all brings each rank its rows;
 *   5. the gated combination over the packed rows.
 * Backward runs 4 and 3 backwards with the gradients.
 *
 * W = 2 + K·E + E floats per rank in the plan: n, Σ lse², the choices
 * c[k][x] at 2 + k·E + x, then Σ_n probs[n, x] at 2 + K·E + x.
 *
 * Failure: a collective that fails, or a plan that cannot be (counts that
 * do not add up, more tokens than a rank holds), is recorded in m->ep
 * (the first one); from then on the rank skips the collectives, uses only
 * its own part of the plan and computes garbage within its buffers, and
 * its caller stops the group after the step.
 */
#include "peer/model/gpt_impl.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

/* The pass's global picture (step 2 of the head). */
struct ep_plan {
  int64_t ntot, cap;
  double lse_sq;
  int32_t assigned[GPT_MAX_EXPERTS], kept[GPT_MAX_EXPERTS];
  float psum[GPT_MAX_EXPERTS];
  int64_t *base, *keep; /* (P, K, E), the scratch's */
};

static int64_t plan_width(const struct model_spec *s) {
  return 2 + (int64_t)GP(s)->topk * GP(s)->experts + GP(s)->experts;
}

static bool ep_ok(const struct model *m) { return !m->ep->failed; }

static void ep_fail(struct model *m, int rc) {
  if (!m->ep->failed) m->ep->failed = rc;
}

void model_ep_experts(const struct model_spec *s, int size, int rank, int *lo, int *hi) {
  int64_t a, b;
  model_tp_chunk(s->family == MODEL_GPT ? GP(s)->experts : 0, size, rank, &a, &b);
  *lo = (int)a;
  *hi = (int)b;
}

bool model_ep_expert_span(const struct model *m, int u, int64_t *first, int64_t *per) {
  const struct model_spec *s = &m->spec;
  if (s->family != MODEL_GPT || u < 1 || u > GP(s)->layers || u < m->u0 || u >= m->u1 || !gpt_block_is_moe(s, u - 1))
    return false;
  const struct model_param *p = &model_own_table(m)->p[gpt_block_first(s, u - 1) + B_ROUTER + 1];
  *first = p->offset - m->param_base;
  *per = 0;
  for (int j = 0; j < X_NPARAMS; j++) *per += p[j].numel;
  return true;
}

int model_ep_check(const struct model_spec *spec, int size, struct rumor_err *e) {
  char name[MODEL_SPEC_MAX];
  model_spec_format(spec, name, sizeof name);
  if (spec->family != MODEL_GPT || !GP(spec)->experts)
    return rumor_err_set(e, RUMOR_EFORMAT, "model '%s' has no experts to split over %d expert-parallel ranks: expert "
                         "parallelism needs a mixture-of-experts GPT (a spec with -E<n>, e.g. gpt:L4-H4-C128-T128-"
                         "V256-E8-K1)", name, size);
  if (size < 1 || size > GP(spec)->experts)
    return rumor_err_set(e, RUMOR_EFORMAT, "model '%s' cannot be split over %d expert-parallel ranks: it has %d "
                         "experts per block, and each rank needs at least one", name, size, GP(spec)->experts);
  return 0;
}

/* ---- the plan ---- */

/* Checks rank i's part of the plan: whole non-negative counts that add up
 * to its tokens times K, tokens no more than a rank holds. */
static bool plan_part_ok(const struct model *m, const float *part) {
  const struct model_spec *s = &m->spec;
  int E = GP(s)->experts, K = GP(s)->topk;
  double n = part[0], sum = 0;
  if (!(n >= 0 && n <= (double)m->max_rows * GP(s)->context && n == floor(n))) return false;
  for (int j = 0; j < K * E; j++) {
    double c = part[2 + j];
    if (!(c >= 0 && c <= n && c == floor(c))) return false;
    sum += c;
  }
  return sum == n * K;
}

/* The global picture from the gathered plan (every rank computes the same). */
static void plan_build(struct model *m, float *hplan, struct ep_plan *pl) {
  const struct model_spec *s = &m->spec;
  struct gpt_moe_scratch *sc = &((struct gpt_ws *)m->impl)->moe;
  int E = GP(s)->experts, K = GP(s)->topk, P = m->ep->size;
  int64_t W = plan_width(s);
  for (int i = 0; i < P; i++)
    if (!plan_part_ok(m, hplan + i * W)) {
      if (ep_ok(m)) {
        rumor_err_set(&m->ep->err, RUMOR_EPROTO, "expert-parallel rank %d sent an impossible routing plan "
                      "(token or choice counts that do not add up, or more tokens than a rank holds)", i);
        ep_fail(m, RUMOR_EPROTO);
        m->ep->abort(m->ep->arg, m->ep->err.msg);
      }
    }
  if (!ep_ok(m)) /* only this rank's own part is to be trusted */
    for (int i = 0; i < P; i++)
      if (i != m->ep->rank) memset(hplan + i * W, 0, (size_t)W * sizeof(float));
  memset(pl, 0, sizeof *pl);
  pl->base = sc->hbase;
  pl->keep = sc->hkeep;
  double psum[GPT_MAX_EXPERTS] = {0};
  for (int i = 0; i < P; i++) {
    pl->ntot += (int64_t)hplan[i * W];
    pl->lse_sq += hplan[i * W + 1];
    for (int x = 0; x < E; x++) psum[x] += hplan[i * W + 2 + K * E + x];
  }
  for (int x = 0; x < E; x++) pl->psum[x] = (float)psum[x];
  pl->cap = gpt_moe_capacity(s, pl->ntot);
  for (int x = 0; x < E; x++) {
    int64_t used = 0;
    for (int k = 0; k < K; k++)
      for (int i = 0; i < P; i++) {
        int64_t c = (int64_t)hplan[i * W + 2 + k * E + x], at = ((int64_t)i * K + k) * E + x;
        int64_t room = pl->cap - used;
        pl->base[at] = used;
        pl->keep[at] = room <= 0 ? 0 : room < c ? room : c;
        used += c;
      }
    pl->assigned[x] = (int32_t)used;
    pl->kept[x] = (int32_t)(used < pl->cap ? used : pl->cap);
  }
}

/* Rows rank i sends expert x: its kept choices of x, every k. */
static int64_t rank_rows(const struct model *m, const struct ep_plan *pl, int i, int x) {
  int E = GP(&m->spec)->experts, K = GP(&m->spec)->topk;
  int64_t r = 0;
  for (int k = 0; k < K; k++) r += pl->keep[((int64_t)i * K + k) * E + x];
  return r;
}

/* ---- the exchanges ---- */

/* Moves rows between every rank's packed buffer and the experts' ranks:
 * to_owners, this rank's packed rows src[0..nsend) go to the ranks of
 * their experts, and the rows for this rank's experts arrive in dst in
 * (source rank, expert, k, slot) order; otherwise the reverse (src holds
 * the rows of this rank's experts in that order, dst gets this rank's
 * packed rows). Returns the rows received. */
static int64_t exchange(struct model *m, const struct ep_plan *pl, bool to_owners, const struct tensor *src,
                        int64_t nsend, struct tensor *dst) {
  struct gpt_moe_scratch *sc = &((struct gpt_ws *)m->impl)->moe;
  struct model_ep *ep = m->ep;
  int P = ep->size, lo, hi;
  int64_t C = GP(&m->spec)->width, mine[MODEL_EP_MAX], theirs[MODEL_EP_MAX], nrecv = 0;
  model_ep_experts(&m->spec, P, ep->rank, &lo, &hi);
  for (int j = 0; j < P; j++) {
    int jlo, jhi;
    model_ep_experts(&m->spec, P, j, &jlo, &jhi);
    mine[j] = theirs[j] = 0;
    for (int x = jlo; x < jhi; x++) mine[j] += rank_rows(m, pl, ep->rank, x); /* this rank's rows for j's experts */
    for (int x = lo; x < hi; x++) theirs[j] += rank_rows(m, pl, j, x);         /* j's rows for this rank's */
  }
  int64_t *send = to_owners ? mine : theirs, *recv = to_owners ? theirs : mine;
  for (int j = 0; j < P; j++) {
    nrecv += recv[j];
    send[j] *= C;
    recv[j] *= C;
  }
  if (nsend > 0) tensor_copy_to_host(src, 0, sc->hsend, (size_t)(nsend * C) * sizeof(float));
  if (ep_ok(m)) {
    int rc = ep->all_to_all(ep->arg, sc->hsend, send, sc->hrecv, recv, &ep->err);
    if (rc) ep_fail(m, rc);
  }
  if (nrecv > 0) tensor_copy_from_host(dst, 0, sc->hrecv, (size_t)(nrecv * C) * sizeof(float));
  return nrecv;
}

/* The received rows' (local expert, slot) into a->oex and a->osl, in
 * exchange's (source rank, expert, k, slot) order. Returns their count. */
static int64_t owner_index(struct model *m, const struct ep_plan *pl, struct gpt_moe_acts *a) {
  struct gpt_moe_scratch *sc = &((struct gpt_ws *)m->impl)->moe;
  int E = GP(&m->spec)->experts, K = GP(&m->spec)->topk, lo, hi;
  model_ep_experts(&m->spec, m->ep->size, m->ep->rank, &lo, &hi);
  int64_t r = 0;
  for (int i = 0; i < m->ep->size; i++)
    for (int x = lo; x < hi; x++)
      for (int k = 0; k < K; k++) {
        int64_t at = ((int64_t)i * K + k) * E + x;
        for (int64_t j = 0; j < pl->keep[at]; j++, r++) {
          sc->hidx[r] = x - lo;
          sc->hidx2[r] = (int32_t)(pl->base[at] + j);
        }
      }
  if (r > 0) {
    tensor_copy_from_host(&a->oex, 0, sc->hidx, (size_t)r * sizeof(int32_t));
    tensor_copy_from_host(&a->osl, 0, sc->hidx2, (size_t)r * sizeof(int32_t));
  }
  return r;
}

/* This rank's choices' packed rows (−1: dropped) into a->prow, from their
 * experts in sc->hidx (nr routed tokens of n). Returns the packed rows. */
static int64_t packed_rows(struct model *m, const struct ep_plan *pl, struct gpt_moe_acts *a, int64_t n,
                           int64_t nr) {
  struct gpt_moe_scratch *sc = &((struct gpt_ws *)m->impl)->moe;
  int E = GP(&m->spec)->experts, K = GP(&m->spec)->topk, me = m->ep->rank;
  int64_t first[GPT_MAX_EXPERTS * GPT_MAX_EXPERTS], used[GPT_MAX_EXPERTS * GPT_MAX_EXPERTS], off = 0;
  for (int x = 0; x < E; x++)
    for (int k = 0; k < K; k++) { /* expert x's rows, k by k */
      first[k * E + x] = off;
      used[k * E + x] = 0;
      off += pl->keep[((int64_t)me * K + k) * E + x];
    }
  for (int64_t t = 0; t < n * K; t++) sc->hidx2[t] = -1;
  for (int k = 0; k < K; k++)
    for (int64_t t = 0; t < nr; t++) {
      int x = sc->hidx[t * K + k];
      int64_t j = used[k * E + x]++;
      if (j < pl->keep[((int64_t)me * K + k) * E + x]) sc->hidx2[t * K + k] = (int32_t)(first[k * E + x] + j);
    }
  tensor_copy_from_host(&a->prow, 0, sc->hidx2, (size_t)(n * K) * sizeof(int32_t));
  return off;
}

/* Steps 1 and 2 of the head: routes n tokens (nr of them for real),
 * gathers the plan (kept in a->plan for the backward) and builds it. */
static void route_and_plan(struct model *m, int l, int64_t n, int64_t nr, const struct tensor *ln,
                           struct ep_plan *pl) {
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_scratch *sc = &ws->moe;
  struct gpt_moe_acts *a = &ws->blk[l].moe;
  const struct model_spec *s = &m->spec;
  int E = GP(s)->experts, K = GP(s)->topk, P = m->ep->size;
  int64_t W = plan_width(s);
  struct tensor logits = gpt_rows(&sc->logits, n, E), router = gpt_moe_entry(m, &m->params, l, -1, 0);
  tensor_gemm(false, false, 1.0f, ln, &router, 0.0f, &logits);
  struct tensor probs = gpt_rows(&a->probs, n, E), lse = gpt_first(&a->lse, n), expert = gpt_rows(&a->expert, n, K),
                gate = gpt_rows(&a->gate, n, K), slot = gpt_rows(&a->slot, n, K);
  tensor_moe_route(&logits, K, n * K, &probs, &lse, &expert, &gate, &slot, &a->assigned, &a->kept, &a->psum);
  float *part = sc->hplan + (int64_t)m->ep->rank * W;
  memset(part, 0, (size_t)W * sizeof(float));
  part[0] = (float)nr;
  if (nr > 0) {
    struct tensor routed = gpt_first(&a->lse, nr);
    part[1] = (float)tensor_sq_norm(&routed);
    tensor_copy_to_host(&a->psum, 0, part + 2 + K * E, (size_t)E * sizeof(float));
    tensor_copy_to_host(&a->expert, 0, sc->hidx, (size_t)(nr * K) * sizeof(int32_t));
  }
  for (int64_t t = 0; t < nr * K; t++) part[2 + (t % K) * E + sc->hidx[t]] += 1.0f;
  if (ep_ok(m)) {
    int rc = m->ep->all_gather(m->ep->arg, sc->hplan, W, &m->ep->err);
    if (rc) ep_fail(m, rc);
  }
  tensor_copy_from_host(&a->plan, 0, sc->hplan, (size_t)(P * W) * sizeof(float));
  plan_build(m, sc->hplan, pl);
}

/* ---- the passes ---- */

void gpt_moe_ep_forward(struct model *m, int l, int64_t n, const struct tensor *ln, struct tensor *out) {
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_scratch *sc = &ws->moe;
  struct gpt_moe_acts *a = &ws->blk[l].moe;
  int K = GP(&m->spec)->topk, lo, hi;
  int64_t C = GP(&m->spec)->width, nr = m->ep->ghost ? 0 : n;
  model_ep_experts(&m->spec, m->ep->size, m->ep->rank, &lo, &hi);
  struct ep_plan pl;
  route_and_plan(m, l, n, nr, ln, &pl);
  int64_t tk = packed_rows(m, &pl, a, n, nr), cap = pl.cap;
  struct tensor zeros = gpt_rows(&sc->zeros, n, K), prow = gpt_rows(&a->prow, n, K), gate = gpt_rows(&a->gate, n, K);
  struct tensor xp = gpt_rows(&sc->xe, tk, C), yp = gpt_rows(&a->ye, tk, C);
  tensor_moe_dispatch(ln, &zeros, &prow, tk, &xp);
  int64_t r = exchange(m, &pl, true, &xp, tk, &sc->ob), placed = owner_index(m, &pl, a);
  RUMOR_ASSERT(placed == r);
  struct tensor ob = gpt_rows(&sc->ob, r, C), oex = gpt_rows(&a->oex, r, 1), osl = gpt_rows(&a->osl, r, 1),
                ones = gpt_rows(&sc->ones, r, 1), xo = gpt_rows(&a->xo, (hi - lo) * cap, C),
                oy = gpt_rows(&sc->oy, (hi - lo) * cap, C);
  tensor_moe_dispatch(&ob, &oex, &osl, cap, &xo);
  const struct gpt_moe_bufs bf = {.x = &a->xo, .hpre = &a->hpre, .h = &sc->h, .y = &sc->oy, .cap = cap};
  for (int x = lo; x < hi; x++) gpt_moe_expert_forward(m, l, x, x - lo, pl.kept[x], &bf);
  tensor_moe_combine(&oy, &oex, &osl, &ones, cap, &ob); /* the outputs, in received order */
  exchange(m, &pl, false, &ob, r, &a->ye);
  tensor_moe_combine(&yp, &zeros, &prow, &gate, tk, out);
  gpt_moe_add_stats(m, a, pl.assigned, pl.kept, pl.psum, pl.ntot, pl.lse_sq);
}

void gpt_moe_ep_backward(struct model *m, int l, int64_t n, const struct tensor *ln, const struct tensor *dout,
                         struct tensor *dln, float beta) {
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_scratch *sc = &ws->moe;
  struct gpt_moe_acts *a = &ws->blk[l].moe;
  const struct model_spec *s = &m->spec;
  int E = GP(s)->experts, K = GP(s)->topk, lo, hi;
  int64_t C = GP(s)->width;
  RUMOR_ASSERT(!m->ep->ghost);
  model_ep_experts(s, m->ep->size, m->ep->rank, &lo, &hi);
  struct ep_plan pl;
  tensor_copy_to_host(&a->plan, 0, sc->hplan, (size_t)(m->ep->size * plan_width(s)) * sizeof(float));
  plan_build(m, sc->hplan, &pl);
  int64_t tk = 0, cap = pl.cap, r = 0;
  for (int x = 0; x < E; x++) tk += rank_rows(m, &pl, m->ep->rank, x);
  for (int i = 0; i < m->ep->size; i++)
    for (int x = lo; x < hi; x++) r += rank_rows(m, &pl, i, x);
  struct tensor zeros = gpt_rows(&sc->zeros, n, K), prow = gpt_rows(&a->prow, n, K), gate = gpt_rows(&a->gate, n, K),
                dgate = gpt_rows(&sc->dgate, n, K);
  struct tensor yp = gpt_rows(&a->ye, tk, C), dyp = gpt_rows(&sc->dye, tk, C), dxp = gpt_rows(&sc->dxe, tk, C);
  tensor_moe_combine_bwd(dout, &yp, &zeros, &prow, &gate, tk, &dyp, &dgate);
  int64_t got = exchange(m, &pl, true, &dyp, tk, &sc->ob);
  RUMOR_ASSERT(got == r);
  struct tensor ob = gpt_rows(&sc->ob, r, C), oex = gpt_rows(&a->oex, r, 1), osl = gpt_rows(&a->osl, r, 1),
                ones = gpt_rows(&sc->ones, r, 1), dyo = gpt_rows(&sc->oy, (hi - lo) * cap, C),
                dxo = gpt_rows(&sc->odx, (hi - lo) * cap, C);
  tensor_moe_dispatch(&ob, &oex, &osl, cap, &dyo);
  const struct gpt_moe_bufs bf = {
      .x = &a->xo, .hpre = &a->hpre, .h = &sc->h, .dy = &sc->oy, .dx = &sc->odx, .cap = cap};
  /* Another rank's experts: zero gradients here (r = 0 writes them), or
   * nothing when the caller moves only the owners' gradients. */
  for (int x = 0; x < E; x++)
    if ((x >= lo && x < hi) || !m->ep->own_experts_only)
      gpt_moe_expert_backward(m, l, x, x - lo, x >= lo && x < hi ? pl.kept[x] : 0, beta, &bf);
  tensor_moe_combine(&dxo, &oex, &osl, &ones, cap, &ob);
  exchange(m, &pl, false, &ob, r, &sc->dxe);
  tensor_fill(dln, 0.0f);
  tensor_moe_dispatch_bwd(&dxp, &zeros, &prow, tk, dln);
  gpt_moe_router_backward(m, l, n, ln, &dgate, dln, beta);
}

/* ---- set-up ---- */

static int realloc_tensor(struct tensor *t, tensor_backend_t be, enum tensor_dtype dt, int64_t rows, int64_t w,
                          struct rumor_err *e) {
  tensor_free(t); /* a stashed one keeps its place in m->stash */
  const int64_t shape[2] = {rows, w};
  return tensor_alloc(t, be, dt, 2, shape, e);
}

/* The scratch of an expert-parallel rank (the head's sizes). */
static int alloc_ep_scratch(struct model *m, struct gpt_moe_scratch *sc, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int E = GP(s)->experts, K = GP(s)->topk, P = m->ep->size, lo, hi;
  int64_t C = GP(s)->width, N = m->max_rows * GP(s)->context;
  model_ep_experts(s, P, 0, &lo, &hi); /* rank 0 has the most experts */
  sc->nk = N * K;
  sc->capg = gpt_moe_capacity(s, P * N);
  sc->orows = (hi - lo) * sc->capg;
  int64_t most = sc->nk > sc->orows ? sc->nk : sc->orows;
  int rc;
  if ((rc = realloc_tensor(&sc->xe, m->be, TENSOR_F32, sc->nk, C, e)) ||
      (rc = realloc_tensor(&sc->dxe, m->be, TENSOR_F32, sc->nk, C, e)) ||
      (rc = realloc_tensor(&sc->dye, m->be, TENSOR_F32, sc->nk, C, e)) ||
      (rc = realloc_tensor(&sc->h, m->be, TENSOR_F32, sc->orows, 4 * C, e)) ||
      (rc = realloc_tensor(&sc->zeros, m->be, TENSOR_I32, sc->nk, 1, e)) ||
      (rc = realloc_tensor(&sc->ones, m->be, TENSOR_F32, sc->orows, 1, e)) ||
      (rc = realloc_tensor(&sc->ob, m->be, TENSOR_F32, sc->orows, C, e)) ||
      (rc = realloc_tensor(&sc->oy, m->be, TENSOR_F32, sc->orows, C, e)) ||
      (rc = realloc_tensor(&sc->odx, m->be, TENSOR_F32, sc->orows, C, e)))
    return rc;
  sc->hidx = xcalloc((size_t)most, sizeof(int32_t));
  sc->hidx2 = xcalloc((size_t)most, sizeof(int32_t));
  tensor_copy_from_host(&sc->zeros, 0, sc->hidx, (size_t)sc->nk * sizeof(int32_t));
  tensor_fill(&sc->ones, 1.0f);
  sc->hplan = xcalloc((size_t)(P * plan_width(s)), sizeof(float));
  sc->hbase = xcalloc((size_t)P * K * E, sizeof(int64_t));
  sc->hkeep = xcalloc((size_t)P * K * E, sizeof(int64_t));
  sc->hsend = tensor_host_alloc(m->be, (size_t)(most * C) * sizeof(float));
  sc->hrecv = tensor_host_alloc(m->be, (size_t)(most * C) * sizeof(float));
  if (!sc->hsend || !sc->hrecv)
    return rumor_err_set(e, -ENOMEM, "cannot allocate 2 x %lld floats of host staging for the experts' exchanges",
                         (long long)(most * C));
  return 0;
}

void gpt_moe_ep_free(struct gpt_moe_scratch *sc, tensor_backend_t be) {
  struct tensor *own[] = {&sc->zeros, &sc->ones, &sc->ob, &sc->oy, &sc->odx};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) tensor_free(own[i]);
  if (sc->hsend) tensor_host_free(be, sc->hsend);
  if (sc->hrecv) tensor_host_free(be, sc->hrecv);
  free(sc->hidx);
  free(sc->hidx2);
  free(sc->hplan);
  free(sc->hbase);
  free(sc->hkeep);
  sc->hsend = sc->hrecv = sc->hplan = NULL;
  sc->hidx = sc->hidx2 = NULL;
  sc->hbase = sc->hkeep = NULL;
}

int model_use_ep(struct model *m, struct model_ep *ep, struct rumor_err *e) {
  int rc = model_ep_check(&m->spec, ep->size, e);
  if (rc) return rc;
  RUMOR_ASSERT(!m->tp && !m->ep && ep->rank >= 0 && ep->rank < ep->size && ep->size <= MODEL_EP_MAX &&
               ep->all_gather && ep->all_to_all && ep->abort);
  m->ep = ep;
  if (!m->moe_blocks) return 0; /* a pipeline stage without mixture-of-experts blocks */
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_scratch *sc = &ws->moe;
  if ((rc = alloc_ep_scratch(m, sc, e))) return rc;
  const struct model_spec *s = &m->spec;
  int64_t N = m->max_rows * GP(s)->context, K = GP(s)->topk, C = GP(s)->width,
          W = ep->size * plan_width(s);
  const int64_t nk[2] = {N, K}, orow[2] = {sc->orows, C}, oidx[2] = {sc->orows, 1};
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= GP(s)->layers; u++) {
    if (!gpt_block_is_moe(s, u - 1)) continue;
    struct gpt_moe_acts *a = &ws->blk[u - 1].moe;
    if ((rc = realloc_tensor(&a->hpre, m->be, TENSOR_F32, sc->orows, 4 * C, e)) ||
        (rc = realloc_tensor(&a->ye, m->be, TENSOR_F32, sc->nk, C, e)) ||
        (rc = gpt_stashed(m, &a->prow, TENSOR_I32, 2, nk, e)) || (rc = gpt_stashed(m, &a->plan, TENSOR_F32, 1, &W, e)) ||
        (rc = gpt_stashed(m, &a->xo, TENSOR_F32, 2, orow, e)) ||
        (rc = gpt_stashed(m, &a->oex, TENSOR_I32, 2, oidx, e)) || (rc = gpt_stashed(m, &a->osl, TENSOR_I32, 2, oidx, e)))
      return rc;
  }
  return 0;
}
