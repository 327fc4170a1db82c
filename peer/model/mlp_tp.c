/*
 * A tensor-parallel rank of the MLP (model.h's "tensor parallelism"):
 * layer l is column-parallel when l is even (the rank holds output units
 * [lo, hi) of model_tp_chunk(widths[l+1]): those rows of W and of b) and
 * row-parallel when l is odd (input units [lo, hi): those columns of W, b
 * replicated), except that a last layer that would be column-parallel is
 * replicated (held whole), so the logits are whole on every rank and the
 * loss is the whole model's.
 *
 * A column layer reads the whole input and writes its output units only;
 * the row layer after it reads those and writes a partial product that an
 * all-reduce sums before the bias. Backward, a column layer's input
 * gradient is a partial sum that an all-reduce completes (none for layer 0,
 * whose input needs no gradient); a row layer's is the rank's columns and
 * needs none. With one rank every pass is mlp.c's op for op.
 */
#include <stdio.h>
#include <stdlib.h>

#include "peer/model/tp_impl.h"

#define ML(s) (&(s)->u.mlp)

enum mlp_tp_kind { MLP_TP_COLUMN, MLP_TP_ROW, MLP_TP_WHOLE };

static enum mlp_tp_kind kind_of(const struct model_spec *s, int l) {
  if (l % 2) return MLP_TP_ROW;
  return l == ML(s)->nlayers - 1 ? MLP_TP_WHOLE : MLP_TP_COLUMN;
}

struct mlp_tp_ws {
  struct tensor w[MLP_MAX_LAYERS], b[MLP_MAX_LAYERS];   /* views into params: the rank's parts of W (out, in), b */
  struct tensor dw[MLP_MAX_LAYERS], db[MLP_MAX_LAYERS]; /* the same views into grads */
  int64_t in[MLP_MAX_LAYERS], out[MLP_MAX_LAYERS];      /* layer l's local input and output widths */
  struct tensor acts[MLP_MAX_LAYERS + 1];               /* acts[l]: (max_rows, in[l]); acts[l+1] (max_rows, out[l]) */
  struct tensor pre[MLP_MAX_LAYERS];                    /* GELU's input where its backward needs it */
  struct tensor dbuf[2];                                /* gradient ping-pong, (max_rows, max width) each */
};

/* ---- the cut ---- */

static int mlp_tp_check(const struct model_spec *s, const char *spec, int size, struct rumor_err *e) {
  for (int l = 0; l < ML(s)->nlayers; l++)
    if (kind_of(s, l) == MLP_TP_COLUMN && ML(s)->widths[l + 1] < size)
      return rumor_err_set(e, RUMOR_EFORMAT,
                           "model '%s' cannot be split over %d tensor-parallel ranks: layer %d's %lld outputs are "
                           "fewer than the ranks",
                           spec, size, l, (long long)ML(s)->widths[l + 1]);
  return 0;
}

static void mlp_tp_split(const struct model_spec *s, size_t i, const struct model_param *p, int *dim, int *groups) {
  (void)p;
  bool weight = i % 2 == 0;
  *groups = 1;
  switch (kind_of(s, (int)(i / 2))) {
  case MLP_TP_COLUMN: *dim = 0; break;           /* W's rows, b's entries: the output units */
  case MLP_TP_ROW: *dim = weight ? 1 : -1; break; /* W's columns: the input units; b replicated */
  default: *dim = -1; break;
  }
}

/* Per row: layer u − 1's local output, or the input. */
static int64_t mlp_tp_act_width(const struct model *m, int u) {
  const struct model_spec *s = &m->spec;
  if (u == 0 || kind_of(s, u - 1) != MLP_TP_COLUMN) return ML(s)->widths[u];
  int64_t lo, hi;
  model_tp_chunk(ML(s)->widths[u], m->tp->size, m->tp->rank, &lo, &hi);
  return hi - lo;
}

/* ---- workspace ---- */

static bool hidden(const struct model_spec *s, int l) { return l < ML(s)->nlayers - 1; }
static bool keeps_pre(const struct model_spec *s, int l) { return hidden(s, l) && ML(s)->act == MLP_ACT_GELU; }

static int mlp_tp_init(struct model *m, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  struct mlp_tp_ws *ws = xcalloc(1, sizeof *ws);
  m->impl = ws;
  for (int l = m->u0; l < m->u1; l++) {
    const struct model_param *w = model_tp_local(m, 2 * (size_t)l), *b = model_tp_local(m, 2 * (size_t)l + 1);
    int64_t off = w->offset - m->param_base;
    ws->w[l] = tensor_view(&m->params, off, 2, w->shape);
    ws->b[l] = tensor_view(&m->params, off + w->numel, 1, b->shape);
    ws->dw[l] = tensor_view(&m->grads, off, 2, w->shape);
    ws->db[l] = tensor_view(&m->grads, off + w->numel, 1, b->shape);
    ws->out[l] = w->shape[0];
    ws->in[l] = w->shape[1];
  }
  int64_t maxw = 0;
  int rc;
  for (int l = m->u0; l <= m->u1; l++) {
    int64_t shape[2] = {m->max_rows, mlp_tp_act_width(m, l)};
    maxw = shape[1] > maxw ? shape[1] : maxw;
    if ((rc = tensor_alloc(&ws->acts[l], m->be, TENSOR_F32, 2, shape, e))) return rc;
    m->stash[m->nstash++] = &ws->acts[l];
    if (l < m->u1 && keeps_pre(s, l)) {
      int64_t ps[2] = {m->max_rows, mlp_tp_act_width(m, l + 1)};
      if ((rc = tensor_alloc(&ws->pre[l], m->be, TENSOR_F32, 2, ps, e))) return rc;
      m->stash[m->nstash++] = &ws->pre[l];
    }
  }
  for (int l = m->u0; l < m->u1; l++) maxw = ws->in[l] > maxw ? ws->in[l] : maxw; /* a column layer's dx */
  int64_t dshape[2] = {m->max_rows, maxw};
  for (int i = 0; i < 2; i++)
    if ((rc = tensor_alloc(&ws->dbuf[i], m->be, TENSOR_F32, 2, dshape, e))) return rc;
  return 0;
}

static void mlp_tp_free(struct model *m) {
  struct mlp_tp_ws *ws = m->impl;
  if (!ws) return;
  for (int l = 0; l <= MLP_MAX_LAYERS; l++) tensor_free(&ws->acts[l]);
  for (int l = 0; l < MLP_MAX_LAYERS; l++) tensor_free(&ws->pre[l]);
  tensor_free(&ws->dbuf[0]);
  tensor_free(&ws->dbuf[1]);
  free(ws);
  m->impl = NULL;
}

static struct tensor *mlp_tp_act(struct model *m, int u) { return &((struct mlp_tp_ws *)m->impl)->acts[u]; }

/* ---- passes ---- */

static struct tensor rows_of(const struct tensor *t, int64_t rows, int64_t width) {
  int64_t shape[2] = {rows, width};
  return tensor_view(t, 0, 2, shape);
}

static void mlp_tp_forward(struct model *m, int l0, int l1, int64_t rows) {
  const struct model_spec *s = &m->spec;
  struct mlp_tp_ws *ws = m->impl;
  for (int l = l0; l < l1; l++) {
    struct tensor x = rows_of(&ws->acts[l], rows, ws->in[l]);
    struct tensor y = rows_of(&ws->acts[l + 1], rows, ws->out[l]);
    struct tensor z = keeps_pre(s, l) ? rows_of(&ws->pre[l], rows, ws->out[l]) : y;
    /* z = x · Wᵀ (+ the other ranks' parts, for a row layer) + b */
    tensor_gemm(false, true, 1.0f, &x, &ws->w[l], 0.0f, &z);
    if (kind_of(s, l) == MLP_TP_ROW) model_tp_all_reduce(m, &z, rows * ws->out[l]);
    tensor_bias_add(&z, &ws->b[l]);
    if (!hidden(s, l)) continue;
    if (keeps_pre(s, l)) tensor_gelu_fwd(&z, &y);
    else tensor_relu_fwd(&y, &y);
  }
}

/* mlp.c's backward with the local widths; a column layer's dx is summed
 * across the ranks. */
static void mlp_tp_backward(struct model *m, int l0, int l1, int64_t rows, struct tensor *dout, struct tensor *din,
                            bool accumulate) {
  const struct model_spec *s = &m->spec;
  struct mlp_tp_ws *ws = m->impl;
  RUMOR_ASSERT(!din || (din->data != ws->dbuf[0].data && din->data != ws->dbuf[1].data));
  float beta = accumulate ? 1.0f : 0.0f;
  struct tensor dy = rows_of(dout, rows, ws->out[l1 - 1]);
  for (int l = l1 - 1; l >= l0; l--) {
    if (hidden(s, l)) {
      if (keeps_pre(s, l)) {
        struct tensor z = rows_of(&ws->pre[l], rows, ws->out[l]);
        tensor_gelu_bwd(&z, &dy, &dy);
      } else {
        struct tensor y = rows_of(&ws->acts[l + 1], rows, ws->out[l]);
        tensor_relu_bwd(&y, &dy, &dy);
      }
    }
    struct tensor x = rows_of(&ws->acts[l], rows, ws->in[l]);
    tensor_gemm(true, false, 1.0f, &dy, &x, beta, &ws->dw[l]);
    tensor_bias_grad(&dy, &ws->db[l], beta);
    struct tensor *target;
    if (l == l0) {
      if (!din) break;
      target = din;
    } else {
      target = dy.data == ws->dbuf[0].data ? &ws->dbuf[1] : &ws->dbuf[0];
    }
    struct tensor dx = rows_of(target, rows, ws->in[l]);
    tensor_gemm(false, false, 1.0f, &dy, &ws->w[l], 0.0f, &dx);
    if (kind_of(s, l) == MLP_TP_COLUMN) model_tp_all_reduce(m, &dx, rows * ws->in[l]);
    dy = dx;
  }
}

static const struct model_family_ops mlp_tp_ops = {
    .name = "mlp",
    .unit_noun = "layer",
    .init = mlp_tp_init,
    .free = mlp_tp_free,
    .act = mlp_tp_act,
    .forward = mlp_tp_forward,
    .backward = mlp_tp_backward,
    .tied_entry = -1,
    .act_width = mlp_tp_act_width,
    .init_params = model_tp_init_params,
};

const struct model_tp_family model_mlp_tp = {
    .ops = &mlp_tp_ops,
    .check = mlp_tp_check,
    .split = mlp_tp_split,
};
