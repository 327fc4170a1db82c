/* The MLP: spec parsing, flat-buffer layout, forward and backward passes. */
#include "peer/model/model.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- spec ---- */

int model_spec_parse(const char *s, struct model_spec *out, struct rumor_err *e) {
  struct model_spec spec;
  memset(&spec, 0, sizeof spec);
  if (!s || strncmp(s, "mlp:", 4) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': expected mlp:IN-H1-...-OUT[:relu|:gelu]", s ? s : "");
  const char *p = s + 4;
  int nwidths = 0;
  for (;;) {
    char *end;
    errno = 0;
    long long w = strtoll(p, &end, 10);
    if (end == p || errno || w < 1 || w > MODEL_MAX_WIDTH)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': layer widths must be integers in [1, %d]", s,
                           MODEL_MAX_WIDTH);
    if (nwidths == MODEL_MAX_LAYERS + 1)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': at most %d layers", s, MODEL_MAX_LAYERS);
    spec.widths[nwidths++] = w;
    p = end;
    if (*p == '-') {
      p++;
      continue;
    }
    break;
  }
  if (nwidths < 2)
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': need at least an input and an output width", s);
  spec.nlayers = nwidths - 1;
  spec.act = MODEL_ACT_RELU;
  if (*p == ':') {
    p++;
    if (strcmp(p, "relu") == 0) spec.act = MODEL_ACT_RELU;
    else if (strcmp(p, "gelu") == 0) spec.act = MODEL_ACT_GELU;
    else return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': unknown activation '%s' (relu or gelu)", s, p);
  } else if (*p) {
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': unexpected '%s'", s, p);
  }
  /* Keep the parameter count well inside what one flat buffer indexes. */
  if (model_spec_param_count(&spec) > ((int64_t)1 << 40))
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': too many parameters", s);
  *out = spec;
  return 0;
}

void model_spec_format(const struct model_spec *s, char *buf, size_t len) {
  size_t n = (size_t)snprintf(buf, len, "mlp:");
  for (int i = 0; i <= s->nlayers && n < len; i++)
    n += (size_t)snprintf(buf + n, len - n, i ? "-%lld" : "%lld", (long long)s->widths[i]);
  if (s->act == MODEL_ACT_GELU && n < len) snprintf(buf + n, len - n, ":gelu");
}

int64_t model_spec_layer_offset(const struct model_spec *s, int layer) {
  int64_t off = 0;
  for (int l = 0; l < layer; l++) off += s->widths[l + 1] * s->widths[l] + s->widths[l + 1];
  return off;
}

int64_t model_spec_param_count(const struct model_spec *s) { return model_spec_layer_offset(s, s->nlayers); }

int64_t model_spec_flops(const struct model_spec *s, int l0, int l1) {
  int64_t f = 0;
  for (int l = l0; l < l1; l++) f += s->widths[l] * s->widths[l + 1];
  return f;
}

/* ---- allocation ---- */

static int64_t max_width(const struct model_spec *s, int l0, int l1) {
  int64_t w = 0;
  for (int i = l0; i <= l1; i++) w = s->widths[i] > w ? s->widths[i] : w;
  return w;
}

int model_init(struct model *m, const struct model_spec *spec, tensor_backend_t be, int64_t max_batch,
               struct rumor_err *e) {
  return model_init_layers(m, spec, 0, spec->nlayers, be, max_batch, e);
}

int model_init_layers(struct model *m, const struct model_spec *spec, int l0, int l1, tensor_backend_t be,
                      int64_t max_batch, struct rumor_err *e) {
  RUMOR_ASSERT(0 <= l0 && l0 < l1 && l1 <= spec->nlayers && max_batch >= 1);
  memset(m, 0, sizeof *m);
  m->spec = *spec;
  m->be = be;
  m->l0 = l0;
  m->l1 = l1;
  m->max_batch = max_batch;
  m->param_base = model_spec_layer_offset(spec, l0);
  m->nparams = model_spec_layer_offset(spec, l1) - m->param_base;
  int rc;
  int64_t P = m->nparams;
  if ((rc = tensor_alloc(&m->params, be, TENSOR_F32, 1, &P, e))) goto fail;
  if ((rc = tensor_alloc(&m->grads, be, TENSOR_F32, 1, &P, e))) goto fail;
  for (int l = l0; l < l1; l++) {
    int64_t off = model_spec_layer_offset(spec, l) - m->param_base;
    int64_t wshape[2] = {spec->widths[l + 1], spec->widths[l]};
    int64_t bshape[1] = {spec->widths[l + 1]};
    struct model_layer *L = &m->layers[l];
    L->w = tensor_view(&m->params, off, 2, wshape);
    L->b = tensor_view(&m->params, off + wshape[0] * wshape[1], 1, bshape);
    L->dw = tensor_view(&m->grads, off, 2, wshape);
    L->db = tensor_view(&m->grads, off + wshape[0] * wshape[1], 1, bshape);
  }
  for (int l = l0; l <= l1; l++) {
    int64_t shape[2] = {max_batch, spec->widths[l]};
    if ((rc = tensor_alloc(&m->acts[l], be, TENSOR_F32, 2, shape, e))) goto fail;
    if (l < l1 && l < spec->nlayers - 1 && spec->act == MODEL_ACT_GELU) {
      int64_t ps[2] = {max_batch, spec->widths[l + 1]};
      if ((rc = tensor_alloc(&m->pre[l], be, TENSOR_F32, 2, ps, e))) goto fail;
    }
  }
  int64_t dshape[2] = {max_batch, max_width(spec, l0, l1)};
  for (int i = 0; i < 2; i++)
    if ((rc = tensor_alloc(&m->dbuf[i], be, TENSOR_F32, 2, dshape, e))) goto fail;
  if ((rc = tensor_alloc(&m->labels, be, TENSOR_I32, 1, &max_batch, e))) goto fail;
  if ((rc = tensor_alloc(&m->losses, be, TENSOR_F32, 1, &max_batch, e))) goto fail;
  return 0;
fail:
  model_free(m);
  return rc;
}

void model_free(struct model *m) {
  tensor_free(&m->params);
  tensor_free(&m->grads);
  for (int l = 0; l <= MODEL_MAX_LAYERS; l++) tensor_free(&m->acts[l]);
  for (int l = 0; l < MODEL_MAX_LAYERS; l++) tensor_free(&m->pre[l]);
  tensor_free(&m->dbuf[0]);
  tensor_free(&m->dbuf[1]);
  tensor_free(&m->labels);
  tensor_free(&m->losses);
  memset(m, 0, sizeof *m);
}

void model_init_params(struct model *m, uint64_t seed) {
  float *host = xmalloc((size_t)m->nparams * sizeof(float));
  struct rng r;
  for (int l = m->l0; l < m->l1; l++) {
    /* One stream per layer: a layer's initial values do not depend on the
     * widths of the layers before it. */
    rng_seed(&r, seed, (uint64_t)l + 1);
    int64_t off = model_spec_layer_offset(&m->spec, l) - m->param_base;
    int64_t fan_in = m->spec.widths[l], fan_out = m->spec.widths[l + 1];
    float bound = 1.0f / sqrtf((float)fan_in);
    int64_t n = fan_out * fan_in + fan_out;
    for (int64_t i = 0; i < n; i++) host[off + i] = (2.0f * rng_uniform(&r) - 1.0f) * bound;
  }
  tensor_copy_from_host(&m->params, 0, host, (size_t)m->nparams * sizeof(float));
  free(host);
}

/* ---- passes ---- */

static struct tensor rows_view(const struct tensor *t, int64_t batch, int64_t width) {
  int64_t shape[2] = {batch, width};
  return tensor_view(t, 0, 2, shape);
}

struct tensor model_act_view(const struct model *m, int l, int64_t batch) {
  return rows_view(&m->acts[l], batch, m->spec.widths[l]);
}

void model_forward_range(struct model *m, int l0, int l1, int64_t batch) {
  RUMOR_ASSERT(batch >= 1 && batch <= m->max_batch && m->l0 <= l0 && l0 < l1 && l1 <= m->l1);
  for (int l = l0; l < l1; l++) {
    struct tensor x = model_act_view(m, l, batch);
    struct tensor y = model_act_view(m, l + 1, batch);
    bool hidden = l < m->spec.nlayers - 1;
    bool gelu = hidden && m->spec.act == MODEL_ACT_GELU;
    struct tensor z = gelu ? rows_view(&m->pre[l], batch, m->spec.widths[l + 1]) : y;
    /* z = x · Wᵀ + b */
    tensor_gemm(false, true, 1.0f, &x, &m->layers[l].w, 0.0f, &z);
    tensor_bias_add(&z, &m->layers[l].b);
    if (!hidden) continue;
    if (gelu) tensor_gelu_fwd(&z, &y);
    else tensor_relu_fwd(&y, &y);
  }
}

void model_backward_range(struct model *m, int l0, int l1, int64_t batch, struct tensor *dout,
                          struct tensor *din, bool accumulate) {
  RUMOR_ASSERT(batch >= 1 && batch <= m->max_batch && m->l0 <= l0 && l0 < l1 && l1 <= m->l1);
  RUMOR_ASSERT(!din || (din->data != dout->data && din->data != m->dbuf[0].data &&
                        din->data != m->dbuf[1].data));
  float beta = accumulate ? 1.0f : 0.0f;
  /* dy holds dL/d(layer l's output) while layer l is processed; for hidden
   * layers that is after the activation, so its backward comes first. */
  struct tensor dy = rows_view(dout, batch, m->spec.widths[l1]);
  for (int l = l1 - 1; l >= l0; l--) {
    if (l < m->spec.nlayers - 1) {
      if (m->spec.act == MODEL_ACT_GELU) {
        struct tensor z = rows_view(&m->pre[l], batch, m->spec.widths[l + 1]);
        tensor_gelu_bwd(&z, &dy, &dy);
      } else {
        struct tensor y = model_act_view(m, l + 1, batch);
        tensor_relu_bwd(&y, &dy, &dy);
      }
    }
    struct tensor x = model_act_view(m, l, batch);
    /* dW = dyᵀ · x ; db = Σ_rows dy */
    tensor_gemm(true, false, 1.0f, &dy, &x, beta, &m->layers[l].dw);
    tensor_bias_grad(&dy, &m->layers[l].db, beta);
    /* dx = dy · W: into din at the first layer of the range (if wanted),
     * else into whichever ping-pong buffer dy is not in. */
    struct tensor *target;
    if (l == l0) {
      if (!din) break;
      target = din;
    } else {
      target = dy.data == m->dbuf[0].data ? &m->dbuf[1] : &m->dbuf[0];
    }
    struct tensor dx = rows_view(target, batch, m->spec.widths[l]);
    tensor_gemm(false, false, 1.0f, &dy, &m->layers[l].w, 0.0f, &dx);
    dy = dx;
  }
}

void model_loss(struct model *m, int64_t batch, struct tensor *dlogits, float grad_scale) {
  int L = m->spec.nlayers;
  RUMOR_ASSERT(m->l1 == L);
  struct tensor logits = model_act_view(m, L, batch);
  struct tensor dl = rows_view(dlogits, batch, m->spec.widths[L]);
  int64_t b = batch;
  struct tensor labels = tensor_view(&m->labels, 0, 1, &b);
  struct tensor losses = tensor_view(&m->losses, 0, 1, &b);
  tensor_softmax_xent(&logits, &labels, &dl, &losses, grad_scale);
}

void model_forward_backward(struct model *m, int64_t batch) {
  int L = m->spec.nlayers;
  model_forward_range(m, 0, L, batch);
  model_loss(m, batch, &m->dbuf[0], 1.0f / (float)batch);
  model_backward_range(m, 0, L, batch, &m->dbuf[0], NULL, false);
}

float model_mean_loss(const struct model *m, int64_t batch) {
  int64_t b = batch;
  struct tensor losses = tensor_view(&m->losses, 0, 1, &b);
  return (float)(tensor_sum(&losses) / (double)batch);
}

void model_evaluate_batch(struct model *m, int64_t batch, const int32_t *labels_host, int64_t *correct,
                          double *loss_sum) {
  model_forward_range(m, 0, m->spec.nlayers, batch);
  model_score_batch(m, batch, labels_host, correct, loss_sum);
}

void model_score_batch(struct model *m, int64_t batch, const int32_t *labels_host, int64_t *correct,
                       double *loss_sum) {
  int L = m->spec.nlayers;
  RUMOR_ASSERT(m->l1 == L);
  int64_t C = m->spec.widths[L];
  float *logits = xmalloc((size_t)(batch * C) * sizeof(float));
  struct tensor lv = model_act_view(m, L, batch);
  tensor_copy_to_host(&lv, 0, logits, (size_t)(batch * C) * sizeof(float));
  model_loss(m, batch, &m->dbuf[0], 0.0f);
  int64_t b = batch;
  struct tensor losses = tensor_view(&m->losses, 0, 1, &b);
  *loss_sum += tensor_sum(&losses);
  for (int64_t r = 0; r < batch; r++) {
    const float *row = logits + r * C;
    int64_t best = 0;
    for (int64_t c = 1; c < C; c++)
      if (row[c] > row[best]) best = c;
    *correct += best == labels_host[r];
  }
  free(logits);
}
