/*
 * The mixture-of-experts MLP of a GPT block (Switch Transformer, GShard):
 * a router (C, E) without bias, top-K routing with a capacity per expert,
 * E GPT-2 MLPs run on fixed-size buffers of `cap` rows each (one matrix
 * product per expert on views of [E·cap, C] buffers), and the gated sum of
 * the chosen experts' outputs. Tokens an expert has no room for skip it;
 * their residual carries them (the block adds its input to this output).
 *
 * Auxiliary losses, both in the gradient and in m->moe_stats:
 *   load balancing  α·E·Σ_e f_e·P_e   f_e: the fraction of the pass's
 *                   choices that went to e (held constant, as in Switch);
 *                   P_e: the mean router probability of e;
 *   router z-loss   β·mean_n lse_n²   (ST-MoE), lse_n the router logits'
 *                   log-sum-exp.
 * Each is a mean over the pass's N tokens; its gradient is weighted by
 * N·m->loss_scale, so that over the micro-batches of a step they add up to
 * a token-weighted mean as the main loss does.
 *
 * The passes only enqueue work but for the statistics: a forward reads E
 * counts and sums and one norm back to the host (a device sync per
 * mixture-of-experts block).
 */
#include "peer/model/gpt_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int64_t gpt_moe_capacity(const struct model_spec *s, int64_t n) {
  int64_t num = (int64_t)GP(s)->capacity_pct * n * GP(s)->topk, den = 100 * (int64_t)GP(s)->experts;
  int64_t cap = (num + den - 1) / den;
  return cap > 0 ? cap : 1;
}

int gpt_moe_alloc_acts(struct model *m, struct gpt_moe_acts *a, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int64_t N = m->max_rows * GP(s)->context, E = GP(s)->experts, K = GP(s)->topk, C = GP(s)->width;
  int64_t rows = E * gpt_moe_capacity(s, N);
  const int64_t ne[2] = {N, E}, nk[2] = {N, K}, h[2] = {rows, 4 * C}, y[2] = {rows, C};
  int rc;
  if ((rc = gpt_stashed(m, &a->probs, TENSOR_F32, 2, ne, e)) || (rc = gpt_stashed(m, &a->lse, TENSOR_F32, 1, &N, e)) ||
      (rc = gpt_stashed(m, &a->expert, TENSOR_I32, 2, nk, e)) || (rc = gpt_stashed(m, &a->slot, TENSOR_I32, 2, nk, e)) ||
      (rc = gpt_stashed(m, &a->gate, TENSOR_F32, 2, nk, e)) || (rc = gpt_stashed(m, &a->assigned, TENSOR_I32, 1, &E, e)) ||
      (rc = gpt_stashed(m, &a->kept, TENSOR_I32, 1, &E, e)) || (rc = gpt_stashed(m, &a->psum, TENSOR_F32, 1, &E, e)) ||
      (rc = gpt_stashed(m, &a->daux, TENSOR_F32, 1, &E, e)) || (rc = gpt_stashed(m, &a->hpre, TENSOR_F32, 2, h, e)) ||
      (rc = gpt_stashed(m, &a->ye, TENSOR_F32, 2, y, e)))
    return rc;
  return 0;
}

int gpt_moe_alloc_scratch(struct model *m, struct gpt_moe_scratch *sc, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int64_t N = m->max_rows * GP(s)->context, E = GP(s)->experts, K = GP(s)->topk, C = GP(s)->width;
  sc->cap = gpt_moe_capacity(s, N);
  int64_t rows = E * sc->cap;
  const int64_t ne[2] = {N, E}, nk[2] = {N, K}, rc2[2] = {rows, C}, rh[2] = {rows, 4 * C};
  int rc;
  if ((rc = tensor_alloc(&sc->logits, m->be, TENSOR_F32, 2, ne, e)) ||
      (rc = tensor_alloc(&sc->xe, m->be, TENSOR_F32, 2, rc2, e)) ||
      (rc = tensor_alloc(&sc->dxe, m->be, TENSOR_F32, 2, rc2, e)) ||
      (rc = tensor_alloc(&sc->dye, m->be, TENSOR_F32, 2, rc2, e)) ||
      (rc = tensor_alloc(&sc->h, m->be, TENSOR_F32, 2, rh, e)) ||
      (rc = tensor_alloc(&sc->dgate, m->be, TENSOR_F32, 2, nk, e)) ||
      (rc = tensor_alloc(&sc->daux, m->be, TENSOR_F32, 1, &E, e)))
    return rc;
  sc->host = xcalloc((size_t)(2 * E), sizeof(float));
  return 0;
}

void gpt_moe_free_scratch(struct gpt_moe_scratch *sc, tensor_backend_t be) {
  gpt_moe_ep_free(sc, be);
  struct tensor *own[] = {&sc->logits, &sc->xe, &sc->dxe, &sc->dye, &sc->h, &sc->dgate, &sc->daux};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) tensor_free(own[i]);
  free(sc->host);
  sc->host = NULL;
}

/* ---- views ---- */

/* The first `rows` of expert x's rows [x·cap, (x + 1)·cap) of a (E·cap, w)
 * buffer. */
static struct tensor expert_rows(const struct tensor *t, int x, int64_t cap, int64_t rows, int64_t w) {
  int64_t shape[2] = {rows, w};
  return tensor_view(t, (int64_t)x * cap * w, 2, shape);
}

/* The rows each expert kept in a pass (a->kept, read back to the host):
 * the experts' products run over those only, the rest of each buffer being
 * rows no choice filled (combine reads none of them; their gradients are 0). */
static void kept_rows(const struct gpt_moe_acts *a, int E, int32_t *kept) {
  tensor_copy_to_host(&a->kept, 0, kept, (size_t)E * sizeof(int32_t));
}


/* Table entry i of block l's mixture (B_ROUTER, or an expert's X_* entry
 * `j` of expert x) as a view of `flat` (params or grads). */
struct tensor gpt_moe_entry(struct model *m, struct tensor *flat, int l, int x, int j) {
  size_t i = gpt_block_first(&m->spec, l) + B_ROUTER + (x < 0 ? 0 : 1 + (size_t)x * X_NPARAMS + (size_t)j);
  const struct model_param *p = &model_own_table(m)->p[i];
  return tensor_view(flat, p->offset - m->param_base, p->ndim, p->shape);
}

/* ---- forward ---- */

void gpt_moe_add_stats(struct model *m, struct gpt_moe_acts *a, const int32_t *assigned, const int32_t *kept,
                       const float *psum, int64_t n, double lse_sq) {
  struct gpt_ws *ws = m->impl;
  const struct model_spec *s = &m->spec;
  int E = GP(s)->experts, K = GP(s)->topk;
  float *daux = ws->moe.host + E;
  double choices = (double)n * K, balance = 0;
  struct model_moe_stats *st = &m->moe_stats;
  for (int e = 0; e < E; e++) {
    double f = n > 0 ? (double)assigned[e] / choices : 0.0;
    balance += n > 0 ? f * (double)psum[e] / (double)n : 0.0;
    daux[e] = (float)(m->moe_aux_weight * E * f);
    st->load[e] += assigned[e];
    st->dropped += assigned[e] - kept[e];
  }
  tensor_copy_from_host(&a->daux, 0, daux, (size_t)E * sizeof(float));
  double aux = m->moe_aux_weight * E * balance, z = n > 0 ? m->moe_z_weight * lse_sq / (double)n : 0.0;
  /* Summed over block passes; the trainer divides by the micro-batches
   * (passes / moe_blocks) for a step's figure. */
  st->aux_loss += aux;
  st->z_loss += z;
  st->passes++;
  st->choices += n * K;
}

/* The pass's figures: the auxiliary losses into m->moe_stats and the
 * load-balancing loss's unit gradient into a->daux (host round trip). */
static void pass_stats(struct model *m, struct gpt_moe_acts *a, int64_t n) {
  struct gpt_ws *ws = m->impl;
  int E = GP(&m->spec)->experts;
  int32_t counts[2 * GPT_MAX_EXPERTS];
  float *psum = ws->moe.host;
  tensor_copy_to_host(&a->assigned, 0, counts, (size_t)E * sizeof(int32_t));
  tensor_copy_to_host(&a->kept, 0, counts + E, (size_t)E * sizeof(int32_t));
  tensor_copy_to_host(&a->psum, 0, psum, (size_t)E * sizeof(float));
  struct tensor lse = gpt_first(&a->lse, n);
  gpt_moe_add_stats(m, a, counts, counts + E, psum, n, tensor_sq_norm(&lse));
}

void gpt_moe_forward(struct model *m, int l, int64_t n, const struct tensor *ln, struct tensor *out) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_acts *a = &ws->blk[l].moe;
  int E = GP(s)->experts, K = GP(s)->topk;
  int64_t C = GP(s)->width, cap = gpt_moe_capacity(s, n);
  if (m->ep) {
    gpt_moe_ep_forward(m, l, n, ln, out);
    return;
  }
  struct tensor logits = gpt_rows(&ws->moe.logits, n, E), router = gpt_moe_entry(m, &m->params, l, -1, 0);
  tensor_gemm(false, false, 1.0f, ln, &router, 0.0f, &logits);
  struct tensor probs = gpt_rows(&a->probs, n, E), lse = gpt_first(&a->lse, n), expert = gpt_rows(&a->expert, n, K),
                gate = gpt_rows(&a->gate, n, K), slot = gpt_rows(&a->slot, n, K);
  tensor_moe_route(&logits, K, cap, &probs, &lse, &expert, &gate, &slot, &a->assigned, &a->kept, &a->psum);
  struct tensor xe = gpt_rows(&ws->moe.xe, E * cap, C);
  tensor_moe_dispatch(ln, &expert, &slot, cap, &xe);
  int32_t kept[GPT_MAX_EXPERTS];
  kept_rows(a, E, kept);
  const struct gpt_moe_bufs bf = {.x = &ws->moe.xe, .hpre = &a->hpre, .h = &ws->moe.h, .y = &a->ye, .cap = cap};
  for (int x = 0; x < E; x++) gpt_moe_expert_forward(m, l, x, x, kept[x], &bf);
  struct tensor ye = gpt_rows(&a->ye, E * cap, C);
  tensor_moe_combine(&ye, &expert, &slot, &gate, cap, out);
  pass_stats(m, a, n);
}

/* ---- backward ---- */

/* ---- one expert's MLP ---- */

void gpt_moe_expert_forward(struct model *m, int l, int x, int b, int64_t r, const struct gpt_moe_bufs *bf) {
  if (r == 0) return;
  int64_t C = GP(&m->spec)->width;
  struct tensor xin = expert_rows(bf->x, b, bf->cap, r, C), hpre = expert_rows(bf->hpre, b, bf->cap, r, 4 * C),
                h = expert_rows(bf->h, b, bf->cap, r, 4 * C), y = expert_rows(bf->y, b, bf->cap, r, C);
  struct tensor w1 = gpt_moe_entry(m, &m->params, l, x, X_FC_W), b1 = gpt_moe_entry(m, &m->params, l, x, X_FC_B),
                w2 = gpt_moe_entry(m, &m->params, l, x, X_PROJ_W), b2 = gpt_moe_entry(m, &m->params, l, x, X_PROJ_B);
  tensor_gemm(false, false, 1.0f, &xin, &w1, 0.0f, &hpre);
  tensor_bias_add(&hpre, &b1);
  tensor_gelu_tanh_fwd(&hpre, &h);
  tensor_gemm(false, false, 1.0f, &h, &w2, 0.0f, &y);
  tensor_bias_add(&y, &b2);
}

void gpt_moe_expert_backward(struct model *m, int l, int x, int b, int64_t r, float beta,
                             const struct gpt_moe_bufs *bf) {
  int64_t C = GP(&m->spec)->width, cap = bf->cap;
  struct tensor dw1 = gpt_moe_entry(m, &m->grads, l, x, X_FC_W), db1 = gpt_moe_entry(m, &m->grads, l, x, X_FC_B),
                dw2 = gpt_moe_entry(m, &m->grads, l, x, X_PROJ_W), db2 = gpt_moe_entry(m, &m->grads, l, x, X_PROJ_B);
  if (r == 0) {
    if (beta == 0.0f) {
      struct tensor *g[4] = {&dw1, &db1, &dw2, &db2};
      for (int i = 0; i < 4; i++) tensor_fill(g[i], 0.0f);
    }
    return;
  }
  struct tensor xin = expert_rows(bf->x, b, cap, r, C), hpre = expert_rows(bf->hpre, b, cap, r, 4 * C),
                h = expert_rows(bf->h, b, cap, r, 4 * C), dy = expert_rows(bf->dy, b, cap, r, C),
                dx = expert_rows(bf->dx, b, cap, r, C);
  struct tensor w1 = gpt_moe_entry(m, &m->params, l, x, X_FC_W), w2 = gpt_moe_entry(m, &m->params, l, x, X_PROJ_W);
  tensor_gelu_tanh_fwd(&hpre, &h); /* recomputed */
  tensor_gemm(true, false, 1.0f, &h, &dy, beta, &dw2);
  tensor_bias_grad(&dy, &db2, beta);
  tensor_gemm(false, true, 1.0f, &dy, &w2, 0.0f, &h); /* h's last read was the line above */
  tensor_gelu_tanh_bwd(&hpre, &h, &h);
  tensor_gemm(true, false, 1.0f, &xin, &h, beta, &dw1);
  tensor_bias_grad(&h, &db1, beta);
  tensor_gemm(false, true, 1.0f, &h, &w1, 0.0f, &dx);
}

void gpt_moe_backward(struct model *m, int l, int64_t n, const struct tensor *ln, const struct tensor *dout,
                      struct tensor *dln, float beta) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_acts *a = &ws->blk[l].moe;
  int E = GP(s)->experts, K = GP(s)->topk;
  int64_t C = GP(s)->width, cap = gpt_moe_capacity(s, n);
  if (m->ep) {
    gpt_moe_ep_backward(m, l, n, ln, dout, dln, beta);
    return;
  }
  struct tensor expert = gpt_rows(&a->expert, n, K), gate = gpt_rows(&a->gate, n, K), slot = gpt_rows(&a->slot, n, K);
  struct tensor xe = gpt_rows(&ws->moe.xe, E * cap, C), ye = gpt_rows(&a->ye, E * cap, C),
                dye = gpt_rows(&ws->moe.dye, E * cap, C), dxe = gpt_rows(&ws->moe.dxe, E * cap, C),
                dgate = gpt_rows(&ws->moe.dgate, n, K);
  tensor_moe_dispatch(ln, &expert, &slot, cap, &xe); /* the experts' inputs, recomputed */
  tensor_moe_combine_bwd(dout, &ye, &expert, &slot, &gate, cap, &dye, &dgate);
  int32_t kept[GPT_MAX_EXPERTS];
  kept_rows(a, E, kept);
  const struct gpt_moe_bufs bf = {
      .x = &ws->moe.xe, .hpre = &a->hpre, .h = &ws->moe.h, .dy = &ws->moe.dye, .dx = &ws->moe.dxe, .cap = cap};
  for (int x = 0; x < E; x++) gpt_moe_expert_backward(m, l, x, x, kept[x], beta, &bf);
  tensor_fill(dln, 0.0f);
  tensor_moe_dispatch_bwd(&dxe, &expert, &slot, cap, dln);
  gpt_moe_router_backward(m, l, n, ln, &dgate, dln, beta);
}

void gpt_moe_router_backward(struct model *m, int l, int64_t n, const struct tensor *ln, const struct tensor *dgate,
                             struct tensor *dln, float beta) {
  struct gpt_ws *ws = m->impl;
  struct gpt_moe_acts *a = &ws->blk[l].moe;
  int E = GP(&m->spec)->experts, K = GP(&m->spec)->topk;
  struct tensor probs = gpt_rows(&a->probs, n, E), lse = gpt_first(&a->lse, n), expert = gpt_rows(&a->expert, n, K),
                gate = gpt_rows(&a->gate, n, K);
  /* The gates', the load-balancing and the z-losses' gradients through the
   * softmax, weighted by N · the loss scale (the file's head): per token
   * α·E·f_e·scale and 2β·lse·scale, whatever N. */
  tensor_copy(&ws->moe.daux, &a->daux);
  tensor_scale(&ws->moe.daux, m->loss_scale);
  struct tensor dlogits = gpt_rows(&ws->moe.logits, n, E);
  tensor_moe_route_bwd(&probs, &lse, &expert, &gate, dgate, &ws->moe.daux, (float)(2.0 * m->moe_z_weight) * m->loss_scale,
                       &dlogits);
  struct tensor router = gpt_moe_entry(m, &m->params, l, -1, 0), drouter = gpt_moe_entry(m, &m->grads, l, -1, 0);
  tensor_gemm(true, false, 1.0f, ln, &dlogits, beta, &drouter);
  tensor_gemm(false, true, 1.0f, &dlogits, &router, 1.0f, dln);
}

/* ---- upcycling a dense GPT ---- */

int model_upcycle(const struct model_spec *dense, const float *params, const struct model_spec *moe, uint64_t seed,
                  float *out, struct rumor_err *e) {
  struct model_spec plain = *moe;
  if (moe->family == MODEL_GPT) {
    plain.u.gpt.experts = plain.u.gpt.topk = plain.u.gpt.capacity_pct = 0;
    plain.u.gpt.moe_every = 1;
  }
  char a[MODEL_SPEC_MAX], b[MODEL_SPEC_MAX];
  model_spec_format(dense, a, sizeof a);
  model_spec_format(moe, b, sizeof b);
  if (moe->family != MODEL_GPT || !GP(moe)->experts || dense->family != MODEL_GPT || GP(dense)->experts ||
      !model_spec_equal(&plain, dense))
    return rumor_err_set(e, RUMOR_ESHAPE, "%s cannot be upcycled into %s: a mixture of experts starts from the dense "
                         "GPT of its own shape", a, b);
  struct model_table td, tm;
  model_table_build(dense, &td);
  model_table_build(moe, &tm);
  struct rng r;
  rng_seed(&r, seed, 0x6d6f65); /* the routers' own stream */
  for (size_t i = 0; i < tm.n; i++) {
    const struct model_param *p = &tm.p[i];
    char name[MODEL_NAME_MAX];
    snprintf(name, sizeof name, "%s", p->name);
    /* transformer.h.<l>.mlp.experts.<x>.<rest> comes from transformer.h.<l>.mlp.<rest> */
    char *x = strstr(name, ".mlp.experts.");
    if (x) {
      const char *rest = strchr(x + strlen(".mlp.experts."), '.');
      memmove(x + strlen(".mlp"), rest, strlen(rest) + 1);
    }
    const struct model_param *src = model_table_find(&td, name);
    if (src) {
      RUMOR_ASSERT(src->numel == p->numel);
      memcpy(out + p->offset, params + src->offset, (size_t)p->numel * sizeof(float));
    } else { /* a router */
      for (int64_t k = 0; k < p->numel; k++) out[p->offset + k] = 0.02f * rng_normal(&r);
    }
  }
  model_table_free(&td);
  model_table_free(&tm);
  return 0;
}
