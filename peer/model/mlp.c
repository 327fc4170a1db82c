/*
 * The multi-layer perceptron, with hand-written backpropagation.
 *
 * Spec: "mlp:784-512-256-10" (ReLU between layers) or "...:gelu". One unit
 * per linear layer. Layout: [W0 (out0, in0), b0 (out0), W1, b1, ...], each
 * weight stored [out, in] like torch.nn.Linear, named "layers.<l>.weight"
 * and "layers.<l>.bias", so a checkpoint maps one-to-one onto PyTorch's
 * state_dict. Weight decay applies to the weights only.
 *
 * Tensor parallelism (model.h's "tensor parallelism"; model_mlp_tp): layer
 * l is column-parallel when l is even (the rank holds output units [lo, hi)
 * of model_tp_chunk(widths[l+1]): those rows of W and of b) and
 * row-parallel when l is odd (input units [lo, hi): those columns of W, b
 * replicated), except that a last layer that would be column-parallel is
 * replicated (held whole), so the logits are whole on every rank and the
 * loss is the whole model's. A column layer reads the whole input and
 * writes its output units only; the row layer after it reads those and
 * writes a partial product that an all-reduce sums before the bias.
 * Backward, a column layer's input gradient is a partial sum that an
 * all-reduce completes (none for layer 0, whose input needs no gradient);
 * a row layer's is the rank's columns and needs none.
 *
 * One set of passes serves both: they read each layer's widths from the
 * workspace (the whole model's, or the rank's), and model_tp_all_reduce
 * does nothing in a whole model, so a whole model runs exactly the ops it
 * would without tensor parallelism, and a rank of one runs the same ops.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/tp_impl.h"

#define ML(s) (&(s)->u.mlp)

/* How a tensor-parallel rank holds layer l (the header comment). */
enum mlp_tp_kind { MLP_TP_COLUMN, MLP_TP_ROW, MLP_TP_WHOLE };

static enum mlp_tp_kind kind_of(const struct model_spec *s, int l) {
  if (l % 2) return MLP_TP_ROW;
  return l == ML(s)->nlayers - 1 ? MLP_TP_WHOLE : MLP_TP_COLUMN;
}

struct mlp_ws {
  struct tensor w[MLP_MAX_LAYERS], b[MLP_MAX_LAYERS];   /* views into params: w (out, in), b (out) */
  struct tensor dw[MLP_MAX_LAYERS], db[MLP_MAX_LAYERS]; /* the same views into grads */
  /* Layer l's input and output widths as the model holds the layer: the
   * spec's widths[l] and widths[l+1], or a rank's share of them. */
  int64_t in[MLP_MAX_LAYERS], out[MLP_MAX_LAYERS];
  /* acts[l]: the input of layer l, (max_rows, in[l]); acts[l+1] is layer
   * l's output after its activation (the logits for the last layer).
   * pre[l]: layer l's pre-activation when GELU's backward needs it. */
  struct tensor acts[MLP_MAX_LAYERS + 1];
  struct tensor pre[MLP_MAX_LAYERS];
  struct tensor dbuf[2]; /* gradient ping-pong, (max_rows, max width) each */
};

/* ---- spec ---- */

static int mlp_parse(const char *s, const char *p, struct model_spec *out, struct rumor_err *e) {
  int nwidths = 0;
  for (;;) {
    char *end;
    errno = 0;
    long long w = strtoll(p, &end, 10);
    if (end == p || errno || w < 1 || w > MLP_MAX_WIDTH)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': layer widths must be integers in [1, %d]", s,
                           MLP_MAX_WIDTH);
    if (nwidths == MLP_MAX_LAYERS + 1)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': at most %d layers", s, MLP_MAX_LAYERS);
    ML(out)->widths[nwidths++] = w;
    p = end;
    if (*p != '-') break;
    p++;
  }
  if (nwidths < 2)
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': need at least an input and an output width", s);
  ML(out)->nlayers = nwidths - 1;
  ML(out)->act = MLP_ACT_RELU;
  if (*p == ':') {
    p++;
    if (strcmp(p, "relu") == 0) ML(out)->act = MLP_ACT_RELU;
    else if (strcmp(p, "gelu") == 0) ML(out)->act = MLP_ACT_GELU;
    else return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': unknown activation '%s' (relu or gelu)", s, p);
  } else if (*p) {
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': unexpected '%s'", s, p);
  }
  /* Keep the parameter count well inside what one flat buffer indexes. */
  int64_t n = 0;
  for (int l = 0; l < ML(out)->nlayers; l++) n += ML(out)->widths[l + 1] * (ML(out)->widths[l] + 1);
  if (n > ((int64_t)1 << 40)) return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': too many parameters", s);
  return 0;
}

static void mlp_format(const struct model_spec *s, char *buf, size_t len) {
  size_t n = (size_t)snprintf(buf, len, "mlp:");
  for (int i = 0; i <= ML(s)->nlayers && n < len; i++)
    n += (size_t)snprintf(buf + n, len - n, i ? "-%lld" : "%lld", (long long)ML(s)->widths[i]);
  if (ML(s)->act == MLP_ACT_GELU && n < len) snprintf(buf + n, len - n, ":gelu");
}

static size_t mlp_table(const struct model_spec *s, struct model_param *out) {
  int64_t off = 0;
  size_t n = 0;
  for (int l = 0; l < ML(s)->nlayers; l++) {
    int64_t o = ML(s)->widths[l + 1], i = ML(s)->widths[l];
    if (out) {
      struct model_param *w = &out[n], *b = &out[n + 1];
      *w = (struct model_param){.ndim = 2, .shape = {o, i}, .offset = off, .numel = o * i, .decay = true, .unit = l};
      snprintf(w->name, sizeof w->name, "layers.%d.weight", l);
      *b = (struct model_param){.ndim = 1, .shape = {o}, .offset = off + o * i, .numel = o, .decay = false, .unit = l};
      snprintf(b->name, sizeof b->name, "layers.%d.bias", l);
    }
    off += o * i + o;
    n += 2;
  }
  return n;
}

static int mlp_units(const struct model_spec *s) { return ML(s)->nlayers; }

static void mlp_io(const struct model_spec *s, struct model_io *out) {
  *out = (struct model_io){.input_dtype = TENSOR_F32,
                           .input_per_row = ML(s)->widths[0],
                           .labels_per_row = 1,
                           .classes = ML(s)->widths[ML(s)->nlayers]};
}

static int64_t mlp_boundary(const struct model_spec *s, int u) { return ML(s)->widths[u]; }

/* Forward, weight gradient and input gradient, except that the first
 * layer's input needs no gradient. */
static int64_t mlp_unit_macs(const struct model_spec *s, int u) {
  return (u == 0 ? 2 : 3) * ML(s)->widths[u] * ML(s)->widths[u + 1];
}

static void mlp_describe_units(const struct model_spec *s, int u0, int u1, char *buf, size_t n) {
  size_t w = 0;
  buf[0] = '\0';
  for (int i = u0; i <= u1 && w < n; i++)
    w += (size_t)snprintf(buf + w, n - w, i > u0 ? "-%lld" : "%lld", (long long)ML(s)->widths[i]);
}

/* PyTorch's default nn.Linear initialisation: W and b uniform in
 * ±1/sqrt(fan_in). */
static void mlp_init_unit(const struct model_spec *s, int u, struct rng *r, float *out) {
  int64_t fan_in = ML(s)->widths[u], fan_out = ML(s)->widths[u + 1];
  float bound = 1.0f / sqrtf((float)fan_in);
  for (int64_t i = 0; i < fan_out * fan_in + fan_out; i++) out[i] = (2.0f * rng_uniform(r) - 1.0f) * bound;
}

/* ---- workspace ---- */

static bool hidden(const struct model_spec *s, int l) { return l < ML(s)->nlayers - 1; }
static bool keeps_pre(const struct model_spec *s, int l) { return hidden(s, l) && ML(s)->act == MLP_ACT_GELU; }

/* Per row of model_act(m, u): the input, or layer u − 1's output as the
 * model holds it (a column layer's on a rank: the rank's output units). */
static int64_t mlp_act_width(const struct model *m, int u) {
  const struct model_spec *s = &m->spec;
  if (!m->tp || u == 0 || kind_of(s, u - 1) != MLP_TP_COLUMN) return ML(s)->widths[u];
  int64_t lo, hi;
  model_tp_chunk(ML(s)->widths[u], m->tp->size, m->tp->rank, &lo, &hi);
  return hi - lo;
}

static int mlp_init(struct model *m, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  const struct model_table *t = model_own_table(m);
  struct mlp_ws *ws = xcalloc(1, sizeof *ws);
  m->impl = ws;
  for (int l = m->u0; l < m->u1; l++) {
    const struct model_param *w = &t->p[2 * l], *b = &t->p[2 * l + 1];
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
    int64_t shape[2] = {m->max_rows, mlp_act_width(m, l)};
    maxw = shape[1] > maxw ? shape[1] : maxw;
    if ((rc = tensor_alloc(&ws->acts[l], m->be, TENSOR_F32, 2, shape, e))) return rc;
    m->stash[m->nstash++] = &ws->acts[l];
    if (l < m->u1 && keeps_pre(s, l)) {
      int64_t ps[2] = {m->max_rows, ws->out[l]};
      if ((rc = tensor_alloc(&ws->pre[l], m->be, TENSOR_F32, 2, ps, e))) return rc;
      m->stash[m->nstash++] = &ws->pre[l];
    }
  }
  /* A rank's column layer takes a whole input but gives a share: its dx is
   * wider than any activation the rank holds. */
  for (int l = m->u0; l < m->u1; l++) maxw = ws->in[l] > maxw ? ws->in[l] : maxw;
  int64_t dshape[2] = {m->max_rows, maxw};
  for (int i = 0; i < 2; i++)
    if ((rc = tensor_alloc(&ws->dbuf[i], m->be, TENSOR_F32, 2, dshape, e))) return rc;
  return 0;
}

static void mlp_free(struct model *m) {
  struct mlp_ws *ws = m->impl;
  if (!ws) return;
  for (int l = 0; l <= MLP_MAX_LAYERS; l++) tensor_free(&ws->acts[l]);
  for (int l = 0; l < MLP_MAX_LAYERS; l++) tensor_free(&ws->pre[l]);
  tensor_free(&ws->dbuf[0]);
  tensor_free(&ws->dbuf[1]);
  free(ws);
  m->impl = NULL;
}

static struct tensor *mlp_act(struct model *m, int u) { return &((struct mlp_ws *)m->impl)->acts[u]; }

/* ---- passes ---- */

static struct tensor rows_of(const struct tensor *t, int64_t rows, int64_t width) {
  int64_t shape[2] = {rows, width};
  return tensor_view(t, 0, 2, shape);
}

static void mlp_forward(struct model *m, int l0, int l1, int64_t rows) {
  const struct model_spec *s = &m->spec;
  struct mlp_ws *ws = m->impl;
  for (int l = l0; l < l1; l++) {
    struct tensor x = rows_of(&ws->acts[l], rows, ws->in[l]);
    struct tensor y = rows_of(&ws->acts[l + 1], rows, ws->out[l]);
    struct tensor z = keeps_pre(s, l) ? rows_of(&ws->pre[l], rows, ws->out[l]) : y;
    /* z = x · Wᵀ (+ the other ranks' parts, for a rank's row layer) + b */
    tensor_gemm(false, true, 1.0f, &x, &ws->w[l], 0.0f, &z);
    if (kind_of(s, l) == MLP_TP_ROW) model_tp_all_reduce(m, &z, rows * ws->out[l]);
    tensor_bias_add(&z, &ws->b[l]);
    if (!hidden(s, l)) continue;
    if (keeps_pre(s, l)) tensor_gelu_fwd(&z, &y);
    else tensor_relu_fwd(&y, &y);
  }
}

static void mlp_backward(struct model *m, int l0, int l1, int64_t rows, struct tensor *dout, struct tensor *din,
                         bool accumulate) {
  const struct model_spec *s = &m->spec;
  struct mlp_ws *ws = m->impl;
  RUMOR_ASSERT(!din || (din->data != ws->dbuf[0].data && din->data != ws->dbuf[1].data));
  float beta = accumulate ? 1.0f : 0.0f;
  /* dy holds dL/d(layer l's output) while layer l is processed; for hidden
   * layers that is after the activation, so its backward comes first. */
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
    /* dW = dyᵀ · x ; db = Σ_rows dy */
    tensor_gemm(true, false, 1.0f, &dy, &x, beta, &ws->dw[l]);
    tensor_bias_grad(&dy, &ws->db[l], beta);
    /* dx = dy · W: into din at the first layer of the range (if wanted),
     * else into whichever ping-pong buffer dy is not in. */
    struct tensor *target;
    if (l == l0) {
      if (!din) break;
      target = din;
    } else {
      target = dy.data == ws->dbuf[0].data ? &ws->dbuf[1] : &ws->dbuf[0];
    }
    struct tensor dx = rows_of(target, rows, ws->in[l]);
    tensor_gemm(false, false, 1.0f, &dy, &ws->w[l], 0.0f, &dx);
    /* A rank's column layer: the other ranks' output units' part. */
    if (kind_of(s, l) == MLP_TP_COLUMN) model_tp_all_reduce(m, &dx, rows * ws->in[l]);
    dy = dx;
  }
}

const struct model_family_ops model_mlp_ops = {
    .name = "mlp",
    .unit_noun = "layer",
    .parse = mlp_parse,
    .format = mlp_format,
    .table = mlp_table,
    .units = mlp_units,
    .io = mlp_io,
    .boundary = mlp_boundary,
    .unit_macs = mlp_unit_macs,
    .describe_units = mlp_describe_units,
    .init_unit = mlp_init_unit,
    .init = mlp_init,
    .free = mlp_free,
    .act = mlp_act,
    .forward = mlp_forward,
    .backward = mlp_backward,
};

/* ---- tensor parallelism: the cut and the rank's table of operations ---- */

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
  case MLP_TP_COLUMN: *dim = 0; break;            /* W's rows, b's entries: the output units */
  case MLP_TP_ROW: *dim = weight ? 1 : -1; break; /* W's columns: the input units; b replicated */
  default: *dim = -1; break;
  }
}

/* A rank runs the passes above; it differs from a whole model in its
 * activations' widths and its initial values. */
static const struct model_family_ops mlp_tp_ops = {
    .name = "mlp",
    .unit_noun = "layer",
    .init = mlp_init,
    .free = mlp_free,
    .act = mlp_act,
    .forward = mlp_forward,
    .backward = mlp_backward,
    .tied_entry = -1,
    .act_width = mlp_act_width,
    .init_params = model_tp_init_params,
};

const struct model_tp_family model_mlp_tp = {
    .ops = &mlp_tp_ops,
    .check = mlp_tp_check,
    .split = mlp_tp_split,
};
