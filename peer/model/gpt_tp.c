/*
 * A tensor-parallel rank of GPT-2 (model.h's "tensor parallelism",
 * Megatron-LM's layout): the passes of gpt.c over the rank's slices.
 *
 * Rank r of T holds heads [r·H/T, (r+1)·H/T) of the attention (those
 * columns of c_attn's q, k and v blocks and of its bias, those input rows
 * of attn.c_proj), columns [lo, hi) of c_fc (model_tp_chunk of 4C) and the
 * same input rows of mlp.c_proj, and vocabulary rows [vlo, vlo + vl) of wte
 * (model_tp_chunk of V); LayerNorms, wpe and the two projections' biases
 * are replicated. Per block:
 *
 *   forward   ln_1 → c_attn (local heads) → attention → c_proj partial
 *             → ALL-REDUCE → + bias + residual → ln_2 → c_fc (local
 *             columns) → GELU → mlp.c_proj partial → ALL-REDUCE → + bias
 *             + residual
 *   backward  the same in reverse; the gradients of ln_2's and ln_1's
 *             outputs (partial sums over the local columns and heads) are
 *             ALL-REDUCEd before the LayerNorms' backward.
 *
 * The embedding looks up the rank's vocabulary rows (zeros for the other
 * tokens; rank 0 adds wpe) and all-reduces; the tied head multiplies by
 * the rank's rows of wte, so the rank holds logits [vlo, vlo + vl) only, and
 * its backward all-reduces the gradient of ln_f's output. The loss is the
 * vocabulary-parallel cross-entropy (tensor_xent_shard_*): one all-reduce
 * gathers every rank's log-sum-exp and the target logits.
 *
 * Everything replicated is computed identically on every rank, so its
 * gradients are identical too. With T = 1 every pass is gpt.c's op for op
 * (bit for bit, the loss included).
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/tp_impl.h"

#define GP(s) (&(s)->u.gpt)

/* Table entries per block, in gpt.c's flat-buffer order (checked by name
 * at init). */
enum {
  B_LN1_W, B_LN1_B, B_ATTN_W, B_ATTN_B, B_PROJ_W, B_PROJ_B,
  B_LN2_W, B_LN2_B, B_FC_W, B_FC_B, B_MPROJ_W, B_MPROJ_B, B_NPARAMS
};
static const char *const BLOCK_NAMES[B_NPARAMS] = {
    "ln_1.weight",   "ln_1.bias",   "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight",   "ln_2.bias",   "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};

/* A block's activations for one micro-batch (the pipeline's stash). */
struct gpt_tp_block_acts {
  struct tensor qkv; /* (max_rows, T, 3·cl): the local heads' q | k | v */
  struct tensor att; /* (max_rows, T, cl) */
  struct tensor lse; /* (max_rows, hl, T) */
  struct tensor mid; /* (max_rows, T, C): the residual after attention */
  struct tensor fc;  /* (max_rows, T, fl) */
  struct tensor ln1_mean, ln1_rstd, ln2_mean, ln2_rstd; /* (max_rows·T) */
};

struct gpt_tp_ws {
  int hl;             /* local heads */
  int64_t cl, fl;     /* local attention width (hl·hs) and MLP width */
  int64_t vlo, vl;    /* the vocabulary rows [vlo, vlo + vl) */
  struct tensor p[GPT_MAX_LAYERS][B_NPARAMS]; /* views into params (local shapes) */
  struct tensor g[GPT_MAX_LAYERS][B_NPARAMS]; /* views into grads */
  struct tensor wte, wpe, lnf_w, lnf_b;       /* wte (vl, C): into params or the tied copy */
  struct tensor dwte, dwpe, dlnf_w, dlnf_b;
  struct tensor wte_copy, dwte_copy; /* the tied copy of the rank's rows, on a head stage without unit 0 */
  bool dwte_written; /* set by the head, consumed by unit 0 (gpt.c's) */
  int64_t positions;                     /* of the passes; 0: the context */
  struct tensor acts[GPT_MAX_LAYERS + 3]; /* acts[u]: the input of unit u; acts[L+2] the rank's logits */
  struct gpt_tp_block_acts blk[GPT_MAX_LAYERS];
  struct tensor lnf_mean, lnf_rstd;
  /* Scratch shared by all units (never live across two passes). */
  struct tensor ln_out, dres, dtmp; /* (max_rows·T, C) */
  struct tensor big;                /* (max_rows·T, max(fl, 3·cl)) */
  struct tensor xent;               /* (max(T + 1, 2T)·max_rows·T): the loss's and the score's exchange */
};

/* ---- the cut ---- */

static bool ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), k = strlen(tail);
  return n >= k && strcmp(s + n - k, tail) == 0;
}

static int gpt_tp_check(const struct model_spec *s, const char *spec, int size, struct rumor_err *e) {
  if (GP(s)->heads % size != 0)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "model '%s' cannot be split over %d tensor-parallel ranks: its %d heads are not a multiple "
                         "of %d",
                         spec, size, GP(s)->heads, size);
  if (GP(s)->vocab < size)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "model '%s' cannot be split over %d tensor-parallel ranks: its vocabulary of %lld is "
                         "smaller than the ranks",
                         spec, size, (long long)GP(s)->vocab);
  return 0;
}

static void gpt_tp_split(const struct model_spec *s, size_t i, const struct model_param *p, int *dim, int *groups) {
  (void)s;
  (void)i;
  static const struct {
    const char *tail;
    int dim, groups;
  } CUTS[] = {
      {".wte.weight", 0, 1},         /* vocabulary rows */
      {"attn.c_attn.weight", 1, 3},  /* (C, 3C): the heads' columns of q, k and v */
      {"attn.c_attn.bias", 0, 3},
      {"attn.c_proj.weight", 0, 1},  /* (C, C): the heads' input rows */
      {"mlp.c_fc.weight", 1, 1},     /* (C, 4C): output columns */
      {"mlp.c_fc.bias", 0, 1},
      {"mlp.c_proj.weight", 0, 1},   /* (4C, C): the same as input rows */
  };
  *dim = -1;
  *groups = 1;
  for (size_t k = 0; k < sizeof CUTS / sizeof CUTS[0]; k++)
    if (ends_with(p->name, CUTS[k].tail)) {
      *dim = CUTS[k].dim;
      *groups = CUTS[k].groups;
    }
}

static int64_t gpt_tp_act_width(const struct model *m, int u) {
  const struct model_spec *s = &m->spec;
  if (u == 0) return GP(s)->context;
  if (u < GP(s)->layers + 2) return GP(s)->context * GP(s)->width;
  return GP(s)->context * model_tp_local(m, 0)->shape[0]; /* the rank's vocabulary rows */
}

/* ---- workspace ---- */

static size_t block_entry(int l, int k) { return 2 + (size_t)l * B_NPARAMS + (size_t)k; }

static struct tensor view_of(struct tensor *flat, const struct model *m, size_t i) {
  const struct model_param *p = model_tp_local(m, i);
  return tensor_view(flat, p->offset - m->param_base, p->ndim, p->shape);
}

static void bind_params(struct model *m, struct gpt_tp_ws *ws) {
  int L = GP(&m->spec)->layers;
  if (m->u0 == 0) {
    ws->wte = view_of(&m->params, m, 0);
    ws->dwte = view_of(&m->grads, m, 0);
    ws->wpe = view_of(&m->params, m, 1);
    ws->dwpe = view_of(&m->grads, m, 1);
  }
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= L; u++)
    for (int k = 0; k < B_NPARAMS; k++) {
      size_t i = block_entry(u - 1, k);
      RUMOR_ASSERT(ends_with(m->table.p[i].name, BLOCK_NAMES[k]));
      ws->p[u - 1][k] = view_of(&m->params, m, i);
      ws->g[u - 1][k] = view_of(&m->grads, m, i);
    }
  if (m->u1 == L + 2) {
    ws->lnf_w = view_of(&m->params, m, block_entry(L, 0));
    ws->lnf_b = view_of(&m->params, m, block_entry(L, 1));
    ws->dlnf_w = view_of(&m->grads, m, block_entry(L, 0));
    ws->dlnf_b = view_of(&m->grads, m, block_entry(L, 1));
  }
}

static int stashed(struct model *m, struct tensor *t, enum tensor_dtype dt, int ndim, const int64_t *shape,
                   struct rumor_err *e) {
  int rc = tensor_alloc(t, m->be, dt, ndim, shape, e);
  if (rc == 0) m->stash[m->nstash++] = t;
  return rc;
}

static int alloc_block_acts(struct model *m, const struct gpt_tp_ws *ws, struct gpt_tp_block_acts *b,
                            struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int64_t R = m->max_rows, T = GP(s)->context, C = GP(s)->width, N = R * T;
  const int64_t qkv[3] = {R, T, 3 * ws->cl}, att[3] = {R, T, ws->cl}, lse[3] = {R, ws->hl, T}, rtc[3] = {R, T, C},
                fc[3] = {R, T, ws->fl};
  int rc;
  if ((rc = stashed(m, &b->qkv, TENSOR_F32, 3, qkv, e)) || (rc = stashed(m, &b->att, TENSOR_F32, 3, att, e)) ||
      (rc = stashed(m, &b->lse, TENSOR_F32, 3, lse, e)) || (rc = stashed(m, &b->mid, TENSOR_F32, 3, rtc, e)) ||
      (rc = stashed(m, &b->fc, TENSOR_F32, 3, fc, e)) || (rc = stashed(m, &b->ln1_mean, TENSOR_F32, 1, &N, e)) ||
      (rc = stashed(m, &b->ln1_rstd, TENSOR_F32, 1, &N, e)) || (rc = stashed(m, &b->ln2_mean, TENSOR_F32, 1, &N, e)) ||
      (rc = stashed(m, &b->ln2_rstd, TENSOR_F32, 1, &N, e)))
    return rc;
  return 0;
}

static int alloc_scratch(struct model *m, struct gpt_tp_ws *ws, bool blocks, struct rumor_err *e) {
  int64_t C = GP(&m->spec)->width, N = m->max_rows * GP(&m->spec)->context, S = m->tp->size;
  int64_t bigw = ws->fl > 3 * ws->cl ? ws->fl : 3 * ws->cl, xn = (S + 1 > 2 * S ? S + 1 : 2 * S) * N;
  const int64_t nc[2] = {N, C}, nb[2] = {N, bigw};
  int rc;
  if ((rc = tensor_alloc(&ws->ln_out, m->be, TENSOR_F32, 2, nc, e)) ||
      (rc = tensor_alloc(&ws->dres, m->be, TENSOR_F32, 2, nc, e)) ||
      (rc = tensor_alloc(&ws->dtmp, m->be, TENSOR_F32, 2, nc, e)) ||
      (blocks && (rc = tensor_alloc(&ws->big, m->be, TENSOR_F32, 2, nb, e))))
    return rc;
  return m->u1 == GP(&m->spec)->layers + 2 ? tensor_alloc(&ws->xent, m->be, TENSOR_F32, 1, &xn, e) : 0;
}

static int gpt_tp_init(struct model *m, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int L = GP(s)->layers;
  int64_t R = m->max_rows, N = R * GP(s)->context;
  struct gpt_tp_ws *ws = xcalloc(1, sizeof *ws);
  m->impl = ws;
  ws->hl = GP(s)->heads / m->tp->size;
  ws->cl = GP(s)->width / m->tp->size;
  ws->fl = model_tp_local(m, block_entry(0, B_FC_B))->shape[0];
  ws->vlo = m->tp_layout.slice[0].lo;
  ws->vl = model_tp_local(m, 0)->shape[0];
  bind_params(m, ws);
  int rc;
  if (m->u1 == L + 2 && m->u0 > 0) { /* the head without unit 0: its own copy of the rank's wte rows */
    const int64_t vc[2] = {ws->vl, GP(s)->width};
    if ((rc = tensor_alloc(&ws->wte_copy, m->be, TENSOR_F32, 2, vc, e)) ||
        (rc = tensor_alloc(&ws->dwte_copy, m->be, TENSOR_F32, 2, vc, e)))
      return rc;
    ws->wte = ws->wte_copy;
    ws->dwte = ws->dwte_copy;
  }
  for (int u = m->u0; u <= m->u1; u++) {
    int64_t shape[2] = {R, gpt_tp_act_width(m, u)};
    if ((rc = stashed(m, &ws->acts[u], model_act_dtype(m, u), 2, shape, e))) return rc;
  }
  bool blocks = false;
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= L; u++) {
    if ((rc = alloc_block_acts(m, ws, &ws->blk[u - 1], e))) return rc;
    blocks = true;
  }
  if (m->u1 == L + 2 &&
      ((rc = stashed(m, &ws->lnf_mean, TENSOR_F32, 1, &N, e)) || (rc = stashed(m, &ws->lnf_rstd, TENSOR_F32, 1, &N, e))))
    return rc;
  return alloc_scratch(m, ws, blocks, e);
}

static void gpt_tp_free(struct model *m) {
  struct gpt_tp_ws *ws = m->impl;
  if (!ws) return;
  for (int i = 0; i < m->nstash; i++) tensor_free(m->stash[i]);
  m->nstash = 0;
  struct tensor *own[] = {&ws->wte_copy, &ws->dwte_copy, &ws->ln_out, &ws->dres, &ws->dtmp, &ws->big, &ws->xent};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) tensor_free(own[i]);
  free(ws);
  m->impl = NULL;
}

static struct tensor *gpt_tp_act(struct model *m, int u) { return &((struct gpt_tp_ws *)m->impl)->acts[u]; }

static bool gpt_tp_tied(struct model *m, struct tensor **param, struct tensor **grad) {
  struct gpt_tp_ws *ws = m->impl;
  if (!ws->wte_copy.data) return false;
  *param = &ws->wte_copy;
  *grad = &ws->dwte_copy;
  return true;
}

static int64_t positions(const struct model *m) {
  const struct gpt_tp_ws *ws = m->impl;
  return ws->positions ? ws->positions : GP(&m->spec)->context;
}

static void gpt_tp_set_positions(struct model *m, int64_t t) {
  RUMOR_ASSERT(t >= 1 && t <= GP(&m->spec)->context);
  ((struct gpt_tp_ws *)m->impl)->positions = t;
}

/* ---- passes ---- */

static struct tensor v2(const struct tensor *t, int64_t d0, int64_t d1) {
  int64_t shape[2] = {d0, d1};
  return tensor_view(t, 0, 2, shape);
}
static struct tensor v3(const struct tensor *t, int64_t d0, int64_t d1, int64_t d2) {
  int64_t shape[3] = {d0, d1, d2};
  return tensor_view(t, 0, 3, shape);
}
static struct tensor v1(const struct tensor *t, int64_t off, int64_t n) { return tensor_view(t, off, 1, &n); }

/* y ← x·W (+ b when b is not NULL) for x (N, in), W (in, out). */
static void linear(const struct tensor *x, const struct tensor *w, const struct tensor *b, struct tensor *y) {
  tensor_gemm(false, false, 1.0f, x, w, 0.0f, y);
  if (b) tensor_bias_add(y, b);
}

/* dW ← beta·dW + xᵀ·dy, db ← beta·db + Σ dy, dx ← dy·Wᵀ (when not NULL). */
static void linear_bwd(const struct tensor *x, const struct tensor *w, const struct tensor *dy, struct tensor *dw,
                       struct tensor *db, struct tensor *dx, float beta) {
  tensor_gemm(true, false, 1.0f, x, dy, beta, dw);
  tensor_bias_grad(dy, db, beta);
  if (dx) tensor_gemm(false, true, 1.0f, dy, w, 0.0f, dx);
}

static void embed_forward(struct model *m, int64_t rows) {
  struct gpt_tp_ws *ws = m->impl;
  int64_t T = positions(m), C = GP(&m->spec)->width;
  struct tensor tok = v2(&ws->acts[0], rows, T), out = v3(&ws->acts[1], rows, T, C);
  /* Rank 0 adds the positions: the sum over ranks is then gpt.c's exactly. */
  tensor_embedding_shard_fwd(&tok, &ws->wte, ws->vlo, m->tp->rank == 0 ? &ws->wpe : NULL, &out);
  model_tp_all_reduce(m, &out, rows * T * C);
}

/* A row-parallel product's partial sum → the sum, its bias, the residual. */
static void row_parallel_out(struct model *m, struct tensor *y, const struct tensor *b, const struct tensor *res) {
  model_tp_all_reduce(m, y, tensor_numel(y));
  tensor_bias_add(y, b);
  tensor_add(y, res, y);
}

static void block_forward(struct model *m, int u, int64_t rows) {
  struct gpt_tp_ws *ws = m->impl;
  struct gpt_tp_block_acts *a = &ws->blk[u - 1];
  struct tensor *P = ws->p[u - 1];
  int64_t T = positions(m), C = GP(&m->spec)->width, N = rows * T;
  struct tensor x = v2(&ws->acts[u], N, C), y = v2(&ws->acts[u + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor qkv = v2(&a->qkv, N, 3 * ws->cl), att = v2(&a->att, N, ws->cl), mid = v2(&a->mid, N, C);
  struct tensor fc = v2(&a->fc, N, ws->fl), g = v2(&ws->big, N, ws->fl);
  struct tensor m1 = v1(&a->ln1_mean, 0, N), r1 = v1(&a->ln1_rstd, 0, N), m2 = v1(&a->ln2_mean, 0, N),
                r2 = v1(&a->ln2_rstd, 0, N);
  tensor_layernorm_fwd(&x, &P[B_LN1_W], &P[B_LN1_B], &ln, &m1, &r1);
  linear(&ln, &P[B_ATTN_W], &P[B_ATTN_B], &qkv);
  struct tensor qkv3 = v3(&a->qkv, rows, T, 3 * ws->cl), att3 = v3(&a->att, rows, T, ws->cl);
  struct tensor lse = v3(&a->lse, rows, ws->hl, T);
  tensor_attention_fwd(&qkv3, ws->hl, &att3, &lse);
  linear(&att, &P[B_PROJ_W], NULL, &mid);
  row_parallel_out(m, &mid, &P[B_PROJ_B], &x);
  tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2);
  linear(&ln, &P[B_FC_W], &P[B_FC_B], &fc);
  tensor_gelu_tanh_fwd(&fc, &g);
  linear(&g, &P[B_MPROJ_W], NULL, &y);
  row_parallel_out(m, &y, &P[B_MPROJ_B], &mid);
}

static void head_forward(struct model *m, int64_t rows) {
  const struct model_spec *s = &m->spec;
  struct gpt_tp_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  struct tensor x = v2(&ws->acts[L + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor mf = v1(&ws->lnf_mean, 0, N), rf = v1(&ws->lnf_rstd, 0, N), logits = v2(&ws->acts[L + 2], N, ws->vl);
  tensor_layernorm_fwd(&x, &ws->lnf_w, &ws->lnf_b, &ln, &mf, &rf);
  tensor_gemm(false, true, 1.0f, &ln, &ws->wte, 0.0f, &logits); /* ln_f(x)·wte[vlo, vlo + vl)ᵀ */
}

static void gpt_tp_forward(struct model *m, int a, int b, int64_t rows) {
  int L = GP(&m->spec)->layers;
  for (int u = a; u < b; u++) {
    if (u == 0) embed_forward(m, rows);
    else if (u <= L) block_forward(m, u, rows);
    else head_forward(m, rows);
  }
}

/* dlogits (N, vl) → ws->dres = dL/d(ln_f's input). */
static void head_backward(struct model *m, int64_t rows, const struct tensor *dout, float beta) {
  const struct model_spec *s = &m->spec;
  struct gpt_tp_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  struct tensor dl = v2(dout, N, ws->vl), x = v2(&ws->acts[L + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor mf = v1(&ws->lnf_mean, 0, N), rf = v1(&ws->lnf_rstd, 0, N);
  struct tensor dres = v2(&ws->dres, N, C), dln = v2(&ws->dtmp, N, C);
  tensor_layernorm_fwd(&x, &ws->lnf_w, &ws->lnf_b, &ln, &mf, &rf);
  tensor_gemm(true, false, 1.0f, &dl, &ln, beta, &ws->dwte);
  ws->dwte_written = true;
  tensor_gemm(false, false, 1.0f, &dl, &ws->wte, 0.0f, &dln);
  model_tp_all_reduce(m, &dln, N * C); /* the other vocabulary rows' part */
  tensor_fill(&dres, 0.0f);
  tensor_layernorm_bwd(&x, &ws->lnf_w, &mf, &rf, &dln, &dres, &ws->dlnf_w, &ws->dlnf_b, beta);
}

/* ws->dres holds dL/d(block output) on entry and dL/d(block input) on return. */
static void block_backward(struct model *m, int u, int64_t rows, float beta) {
  struct gpt_tp_ws *ws = m->impl;
  struct gpt_tp_block_acts *a = &ws->blk[u - 1];
  struct tensor *P = ws->p[u - 1], *G = ws->g[u - 1];
  int64_t T = positions(m), C = GP(&m->spec)->width, N = rows * T;
  struct tensor x = v2(&ws->acts[u], N, C), ln = v2(&ws->ln_out, N, C), dres = v2(&ws->dres, N, C);
  struct tensor dtmp = v2(&ws->dtmp, N, C), big = v2(&ws->big, N, ws->fl);
  struct tensor att = v2(&a->att, N, ws->cl), mid = v2(&a->mid, N, C), fc = v2(&a->fc, N, ws->fl);
  struct tensor m1 = v1(&a->ln1_mean, 0, N), r1 = v1(&a->ln1_rstd, 0, N), m2 = v1(&a->ln2_mean, 0, N),
                r2 = v1(&a->ln2_rstd, 0, N);
  /* The MLP: the rank's columns, then the other ranks' part of dL/d ln_2. */
  tensor_gelu_tanh_fwd(&fc, &big);
  linear_bwd(&big, &P[B_MPROJ_W], &dres, &G[B_MPROJ_W], &G[B_MPROJ_B], &big, beta);
  tensor_gelu_tanh_bwd(&fc, &big, &big);
  tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2);
  linear_bwd(&ln, &P[B_FC_W], &big, &G[B_FC_W], &G[B_FC_B], &dtmp, beta);
  model_tp_all_reduce(m, &dtmp, N * C);
  tensor_layernorm_bwd(&mid, &P[B_LN2_W], &m2, &r2, &dtmp, &dres, &G[B_LN2_W], &G[B_LN2_B], beta);
  /* Attention: dres now holds dL/d mid. */
  struct tensor datt = v2(&ws->dtmp, N, ws->cl);
  linear_bwd(&att, &P[B_PROJ_W], &dres, &G[B_PROJ_W], &G[B_PROJ_B], &datt, beta);
  struct tensor qkv3 = v3(&a->qkv, rows, T, 3 * ws->cl), att3 = v3(&a->att, rows, T, ws->cl);
  struct tensor lse = v3(&a->lse, rows, ws->hl, T), datt3 = v3(&ws->dtmp, rows, T, ws->cl);
  struct tensor dqkv3 = v3(&ws->big, rows, T, 3 * ws->cl), dqkv = v2(&ws->big, N, 3 * ws->cl);
  tensor_attention_bwd(&qkv3, &att3, &lse, &datt3, ws->hl, &dqkv3);
  tensor_layernorm_fwd(&x, &P[B_LN1_W], &P[B_LN1_B], &ln, &m1, &r1);
  linear_bwd(&ln, &P[B_ATTN_W], &dqkv, &G[B_ATTN_W], &G[B_ATTN_B], &dtmp, beta);
  model_tp_all_reduce(m, &dtmp, N * C);
  tensor_layernorm_bwd(&x, &P[B_LN1_W], &m1, &r1, &dtmp, &dres, &G[B_LN1_W], &G[B_LN1_B], beta);
}

static void embed_backward(struct model *m, int64_t rows, bool accumulate) {
  struct gpt_tp_ws *ws = m->impl;
  int64_t T = positions(m), C = GP(&m->spec)->width;
  if (!accumulate) {
    if (!ws->dwte_written) tensor_fill(&ws->dwte, 0.0f);
    tensor_fill(&ws->dwpe, 0.0f);
  }
  /* Every rank adds the whole dL/d out to dwpe: the replicated gradient. */
  struct tensor tok = v2(&ws->acts[0], rows, T), dres = v3(&ws->dres, rows, T, C);
  tensor_embedding_shard_bwd(&tok, &dres, ws->vlo, &ws->dwte, &ws->dwpe);
  ws->dwte_written = false; /* consumed: see gpt.c's dwte_written */
}

static void gpt_tp_backward(struct model *m, int a, int b, int64_t rows, struct tensor *dout, struct tensor *din,
                            bool accumulate) {
  struct gpt_tp_ws *ws = m->impl;
  int L = GP(&m->spec)->layers;
  int64_t N = rows * positions(m), C = GP(&m->spec)->width;
  float beta = accumulate ? 1.0f : 0.0f;
  struct tensor dres = v2(&ws->dres, N, C);
  if (b == L + 2) {
    head_backward(m, rows, dout, beta);
  } else {
    struct tensor d = v2(dout, N, C);
    tensor_copy(&dres, &d);
  }
  for (int u = (b < L + 1 ? b : L + 1) - 1; u >= (a > 1 ? a : 1); u--) block_backward(m, u, rows, beta);
  if (a == 0) {
    embed_backward(m, rows, accumulate);
  } else if (din) {
    struct tensor d = v2(din, N, C);
    tensor_copy(&d, &dres);
  }
}

/* ---- the vocabulary-parallel loss and score ---- */

static void gpt_tp_loss(struct model *m, int64_t rows, struct tensor *dlogits, float grad_scale) {
  struct gpt_tp_ws *ws = m->impl;
  int64_t n = model_targets(m, rows), S = m->tp->size, shape[2] = {n, ws->vl};
  struct tensor logits = tensor_view(model_act(m, m->u1), 0, 2, shape), dl = tensor_view(dlogits, 0, 2, shape);
  struct tensor labels = v1(&m->labels, 0, n), losses = v1(&m->losses, 0, n);
  if (S == 1) { /* the whole row: gpt.c's loss, bit for bit */
    tensor_softmax_xent(&logits, &labels, &dl, &losses, grad_scale);
    return;
  }
  /* xent: S rows of n log-sum-exps (the rank's in row `rank`, zeros
   * elsewhere), then n target logits; one all-reduce gathers them all. */
  int64_t pshape[2] = {S, n};
  struct tensor all = v1(&ws->xent, 0, (S + 1) * n), parts = tensor_view(&ws->xent, 0, 2, pshape);
  struct tensor mine = v1(&ws->xent, m->tp->rank * n, n), target = v1(&ws->xent, S * n, n);
  tensor_fill(&all, 0.0f);
  tensor_xent_shard_stats(&logits, &labels, ws->vlo, &mine, &target);
  model_tp_all_reduce(m, &all, (S + 1) * n);
  tensor_xent_shard_grad(&logits, &labels, ws->vlo, &parts, &target, &dl, &losses, grad_scale);
}

/* The rank's best logit and its class per target into slots [rank·n, ...)
 * and [(S + rank)·n, ...) of `slots` (2·S·n floats, zeros elsewhere);
 * classes are below 2^24, exact in a float. */
static void local_best(const struct gpt_tp_ws *ws, const float *logits, int64_t n, int rank, int64_t S, float *slots) {
  for (int64_t r = 0; r < n; r++) {
    const float *row = logits + r * ws->vl;
    int64_t best = 0;
    for (int64_t c = 1; c < ws->vl; c++)
      if (row[c] > row[best]) best = c;
    slots[rank * n + r] = row[best];
    slots[(S + rank) * n + r] = (float)(ws->vlo + best);
  }
}

/* model_score: the argmax over every rank's logits (the first maximal
 * class, as model.c's, since ranks hold ascending classes), and the loss. */
static void gpt_tp_score(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct,
                         double *loss_sum) {
  struct gpt_tp_ws *ws = m->impl;
  int64_t n = model_targets(m, rows), S = m->tp->size;
  float *logits = xmalloc((size_t)(n * ws->vl) * sizeof(float)), *slots = xcalloc((size_t)(2 * S * n), sizeof(float));
  struct tensor *out = model_act(m, m->u1);
  tensor_copy_to_host(out, 0, logits, (size_t)(n * ws->vl) * sizeof(float));
  local_best(ws, logits, n, m->tp->rank, S, slots);
  if (S > 1) {
    struct tensor x = v1(&ws->xent, 0, 2 * S * n);
    tensor_copy_from_host(&x, 0, slots, (size_t)(2 * S * n) * sizeof(float));
    model_tp_all_reduce(m, &x, 2 * S * n);
    tensor_copy_to_host(&x, 0, slots, (size_t)(2 * S * n) * sizeof(float));
  }
  for (int64_t r = 0; r < n; r++) {
    int64_t best = 0;
    for (int64_t s = 1; s < S; s++)
      if (slots[s * n + r] > slots[best * n + r]) best = s;
    *correct += (int64_t)slots[(S + best) * n + r] == labels_host[r];
  }
  model_loss(m, rows, out, 0.0f); /* the logits are on the host now */
  struct tensor losses = v1(&m->losses, 0, n);
  *loss_sum += tensor_sum(&losses);
  free(logits);
  free(slots);
}

static const struct model_family_ops gpt_tp_ops = {
    .name = "gpt",
    .unit_noun = "block",
    .init = gpt_tp_init,
    .free = gpt_tp_free,
    .act = gpt_tp_act,
    .forward = gpt_tp_forward,
    .backward = gpt_tp_backward,
    .tied = gpt_tp_tied,
    .tied_entry = 0,
    .set_positions = gpt_tp_set_positions,
    .act_width = gpt_tp_act_width,
    .init_params = model_tp_init_params,
    .loss = gpt_tp_loss,
    .score = gpt_tp_score,
};

const struct model_tp_family model_gpt_tp = {
    .ops = &gpt_tp_ops,
    .check = gpt_tp_check,
    .split = gpt_tp_split,
};
