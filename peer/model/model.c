/* What every model family shares: spec dispatch, the parameter table, the
 * loss and scoring, initialisation streams. */
#include "peer/model/model_impl.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/json_text.h"

/* The registry: one entry per family, by spec prefix. */
static const struct model_family_ops *const FAMILIES[] = {&model_mlp_ops, &model_gpt_ops};

/* Named specs. */
static const struct {
  const char *name, *spec;
} PRESETS[] = {
    {"gpt2", "gpt:L12-H12-C768-T1024-V50257"},
    {"gpt2-medium", "gpt:L24-H16-C1024-T1024-V50257"},
    {"gpt2-large", "gpt:L36-H20-C1280-T1024-V50257"},
    {"gpt2-xl", "gpt:L48-H25-C1600-T1024-V50257"},
};
#define NFAMILIES (sizeof FAMILIES / sizeof FAMILIES[0])

static const struct model_family_ops *family_of(const struct model_spec *s) {
  for (size_t i = 0; i < NFAMILIES; i++)
    if ((int)s->family == (int)(i + 1)) return FAMILIES[i];
  RUMOR_ASSERT(!"a model spec of an unknown family");
  return NULL;
}

/* ---- specs ---- */

int model_spec_parse(const char *s, struct model_spec *out, struct rumor_err *e) {
  for (size_t i = 0; s && i < sizeof PRESETS / sizeof PRESETS[0]; i++)
    if (strcmp(s, PRESETS[i].name) == 0) return model_spec_parse(PRESETS[i].spec, out, e);
  const char *colon = s ? strchr(s, ':') : NULL;
  if (!s || !colon)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "bad model spec '%s': expected FAMILY:ARGS (e.g. mlp:784-512-256-10, "
                         "gpt:L6-H6-C384-T256-V256) or a preset (gpt2, gpt2-medium, gpt2-large, gpt2-xl)",
                         s ? s : "");
  if (strlen(s) >= MODEL_SPEC_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%.40s...': longer than %d characters", s,
                         MODEL_SPEC_MAX - 1);
  for (size_t i = 0; i < NFAMILIES; i++) {
    const struct model_family_ops *f = FAMILIES[i];
    if (strlen(f->name) != (size_t)(colon - s) || strncmp(s, f->name, (size_t)(colon - s)) != 0) continue;
    struct model_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.family = (enum model_family)(i + 1);
    int rc = f->parse(s, colon + 1, &spec, e);
    if (rc) return rc;
    *out = spec;
    return 0;
  }
  return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': unknown model family '%.*s' (known: mlp, gpt)", s,
                       (int)(colon - s), s);
}

void model_spec_format(const struct model_spec *s, char *buf, size_t len) { family_of(s)->format(s, buf, len); }

bool model_spec_equal(const struct model_spec *a, const struct model_spec *b) {
  char x[MODEL_SPEC_MAX], y[MODEL_SPEC_MAX];
  model_spec_format(a, x, sizeof x);
  model_spec_format(b, y, sizeof y);
  return strcmp(x, y) == 0;
}

void model_spec_io(const struct model_spec *s, struct model_io *out) { family_of(s)->io(s, out); }
int model_spec_units(const struct model_spec *s) { return family_of(s)->units(s); }
const char *model_spec_unit_noun(const struct model_spec *s) { return family_of(s)->unit_noun; }

int64_t model_spec_boundary(const struct model_spec *s, int u) {
  RUMOR_ASSERT(0 < u && u < model_spec_units(s));
  return family_of(s)->boundary(s, u);
}

int64_t model_spec_unit_macs(const struct model_spec *s, int u) {
  RUMOR_ASSERT(0 <= u && u < model_spec_units(s));
  return family_of(s)->unit_macs(s, u);
}

void model_spec_describe_units(const struct model_spec *s, int u0, int u1, char *buf, size_t n) {
  family_of(s)->describe_units(s, u0, u1, buf, n);
}

/* ---- Hugging Face configs and names ---- */

json_t *model_hf_config(const struct model_spec *s) {
  const struct model_family_ops *f = family_of(s);
  return f->hf_config ? f->hf_config(s) : NULL;
}

int model_spec_from_hf_config(const char *text, size_t len, const char *name, struct model_spec *out,
                              struct rumor_err *e) {
  json_t *doc;
  struct rumor_err je;
  if (json_text_parse(text, len, &doc, &je))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: not a JSON config: %s", name, je.msg);
  if (!json_is_object(doc)) {
    json_decref(doc);
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: not a JSON config: the top level is not an object", name);
  }
  const char *type = json_string_value(json_object_get(doc, "model_type")); /* NULL unless a string */
  int rc = RUMOR_EFORMAT;
  for (size_t i = 0; i < NFAMILIES; i++) {
    const struct model_family_ops *f = FAMILIES[i];
    if (!f->hf_parse || !type || strcmp(type, f->hf_model_type) != 0) continue;
    struct model_spec spec;
    memset(&spec, 0, sizeof spec);
    spec.family = (enum model_family)(i + 1);
    rc = f->hf_parse(doc, name, &spec, e);
    if (rc == 0) *out = spec;
    json_decref(doc);
    return rc;
  }
  rumor_err_set(e, rc, "%s: model_type %s%s%s is not one rumor trains (gpt2)", name, type ? "'" : "",
                type ? type : "missing", type ? "'" : "");
  json_decref(doc);
  return rc;
}

enum model_hf_name model_hf_lookup(const struct model_table *t, const char *name, const struct model_param **entry) {
  *entry = model_table_find(t, name);
  if (*entry) return MODEL_HF_ENTRY;
  const struct model_family_ops *f = NULL;
  for (size_t i = 0; i < NFAMILIES && t->n; i++)
    if (FAMILIES[i]->hf_prefix && strncmp(t->p[0].name, FAMILIES[i]->hf_prefix, strlen(FAMILIES[i]->hf_prefix)) == 0)
      f = FAMILIES[i];
  if (!f) return MODEL_HF_UNKNOWN;
  char prefixed[MODEL_NAME_MAX + 32];
  snprintf(prefixed, sizeof prefixed, "%s%s", f->hf_prefix, name);
  *entry = model_table_find(t, prefixed);
  if (*entry) return MODEL_HF_ENTRY;
  return f->hf_ignored && f->hf_ignored(name) ? MODEL_HF_IGNORE : MODEL_HF_UNKNOWN;
}

/* ---- the table ---- */

void model_table_build(const struct model_spec *s, struct model_table *t) {
  const struct model_family_ops *f = family_of(s);
  memset(t, 0, sizeof *t);
  t->n = f->table(s, NULL);
  t->p = xcalloc(t->n, sizeof *t->p);
  f->table(s, t->p);
  t->nunits = f->units(s);
  t->tied_entry = f->tied ? f->tied_entry : -1;
  RUMOR_ASSERT(t->nunits >= 1 && t->nunits <= MODEL_MAX_UNITS);
  int64_t off = 0;
  int u = 0;
  for (size_t i = 0; i < t->n; i++) {
    const struct model_param *p = &t->p[i];
    RUMOR_ASSERT(p->offset == off && p->unit >= u && p->unit < t->nunits && p->numel >= 1);
    while (u < p->unit) t->unit_offset[++u] = off; /* units without parameters are empty ranges */
    off += p->numel;
  }
  while (u < t->nunits) t->unit_offset[++u] = off;
  t->nparams = off;
}

void model_table_free(struct model_table *t) {
  free(t->p);
  memset(t, 0, sizeof *t);
}

const struct model_param *model_table_find(const struct model_table *t, const char *name) {
  for (size_t i = 0; i < t->n; i++)
    if (strcmp(t->p[i].name, name) == 0) return &t->p[i];
  return NULL;
}

int64_t model_spec_param_count(const struct model_spec *s) {
  struct model_table t;
  model_table_build(s, &t);
  int64_t n = t.nparams;
  model_table_free(&t);
  return n;
}

/* ---- allocation ---- */

int model_setup(struct model *m, const struct model_spec *spec, const struct model_family_ops *ops, int u0, int u1,
                tensor_backend_t be, int64_t max_rows, struct rumor_err *e) {
  m->spec = *spec;
  m->ops = ops;
  model_table_build(spec, &m->table);
  RUMOR_ASSERT(0 <= u0 && u0 < u1 && u1 <= m->table.nunits && max_rows >= 1);
  model_spec_io(spec, &m->io);
  m->be = be;
  m->u0 = u0;
  m->u1 = u1;
  m->max_rows = max_rows;
  m->moe_aux_weight = MODEL_MOE_AUX_WEIGHT;
  m->moe_z_weight = MODEL_MOE_Z_WEIGHT;
  const struct model_table *own = model_own_table(m);
  m->param_base = own->unit_offset[u0];
  m->nparams = own->unit_offset[u1] - m->param_base;
  int64_t P = m->nparams > 0 ? m->nparams : 1, targets = max_rows * m->io.labels_per_row;
  int rc;
  if ((rc = tensor_alloc(&m->params, be, TENSOR_F32, 1, &P, e)) || (rc = tensor_alloc(&m->grads, be, TENSOR_F32, 1, &P, e)) ||
      (rc = tensor_alloc(&m->labels, be, TENSOR_I32, 1, &targets, e)) ||
      (rc = tensor_alloc(&m->losses, be, TENSOR_F32, 1, &targets, e)) || (rc = m->ops->init(m, e))) {
    model_free(m);
    return rc;
  }
  return 0;
}

int model_init(struct model *m, const struct model_spec *spec, int u0, int u1, tensor_backend_t be, int64_t max_rows,
               struct rumor_err *e) {
  memset(m, 0, sizeof *m);
  return model_setup(m, spec, family_of(spec), u0, u1, be, max_rows, e);
}

int model_init_full(struct model *m, const struct model_spec *spec, tensor_backend_t be, int64_t max_rows,
                    struct rumor_err *e) {
  return model_init(m, spec, 0, model_spec_units(spec), be, max_rows, e);
}

void model_free(struct model *m) {
  if (m->ops) m->ops->free(m);
  model_tp_layout_free(&m->tp_layout);
  tensor_free(&m->params);
  tensor_free(&m->grads);
  tensor_free(&m->labels);
  tensor_free(&m->losses);
  model_table_free(&m->table);
  memset(m, 0, sizeof *m);
}

void model_init_params(struct model *m, uint64_t seed) {
  if (m->ops->init_params) {
    m->ops->init_params(m, seed);
    return;
  }
  float *host = xmalloc((size_t)m->nparams * sizeof(float));
  struct rng r;
  for (int u = m->u0; u < m->u1; u++) {
    /* One stream per unit: a unit's initial values do not depend on the
     * sizes of the units before it. */
    rng_seed(&r, seed, (uint64_t)u + 1);
    m->ops->init_unit(&m->spec, u, &r, host + (m->table.unit_offset[u] - m->param_base));
  }
  tensor_copy_from_host(&m->params, 0, host, (size_t)m->nparams * sizeof(float));
  free(host);
}

const struct model_param *model_tied(struct model *m, struct tensor **param, struct tensor **grad) {
  if (!m->ops->tied || !m->ops->tied(m, param, grad)) return NULL;
  return &m->table.p[m->table.tied_entry];
}

bool model_set_positions(struct model *m, int64_t t) {
  if (!m->ops->set_positions) return false;
  m->ops->set_positions(m, t);
  m->positions = t == m->io.labels_per_row ? 0 : t;
  return true;
}

/* ---- passes ---- */

struct tensor *model_act(struct model *m, int u) {
  RUMOR_ASSERT(m->u0 <= u && u <= m->u1);
  return m->ops->act(m, u);
}

int64_t model_act_width(const struct model *m, int u) {
  if (m->ops->act_width) return m->ops->act_width(m, u);
  if (u == 0) return m->io.input_per_row;
  if (u == m->table.nunits) return m->io.labels_per_row * m->io.classes;
  return model_spec_boundary(&m->spec, u);
}

enum tensor_dtype model_act_dtype(const struct model *m, int u) { return u == 0 ? m->io.input_dtype : TENSOR_F32; }

int64_t model_logits_stride(const struct model *m) {
  return model_act_width(m, m->table.nunits) / m->io.labels_per_row;
}

void model_forward(struct model *m, int a, int b, int64_t rows) {
  RUMOR_ASSERT(rows >= 1 && rows <= m->max_rows && m->u0 <= a && a < b && b <= m->u1);
  m->ops->forward(m, a, b, rows);
}

void model_backward(struct model *m, int a, int b, int64_t rows, struct tensor *dout, struct tensor *din,
                    bool accumulate) {
  RUMOR_ASSERT(rows >= 1 && rows <= m->max_rows && m->u0 <= a && a < b && b <= m->u1);
  RUMOR_ASSERT(!din || din->data != dout->data);
  RUMOR_ASSERT(!din || model_act_dtype(m, a) == TENSOR_F32);
  m->ops->backward(m, a, b, rows, dout, din, accumulate);
}

int64_t model_targets(const struct model *m, int64_t rows) {
  return rows * (m->positions ? m->positions : m->io.labels_per_row);
}

void model_set_loss_scale(struct model *m, float scale) { m->loss_scale = scale; }

void model_set_moe_losses(struct model *m, double aux_weight, double z_weight) {
  m->moe_aux_weight = aux_weight;
  m->moe_z_weight = z_weight;
}

void model_moe_stats_reset(struct model *m) { memset(&m->moe_stats, 0, sizeof m->moe_stats); }

void model_loss(struct model *m, int64_t rows, struct tensor *dlogits, float grad_scale) {
  RUMOR_ASSERT(m->u1 == m->table.nunits);
  if (grad_scale != 0.0f) m->loss_scale = grad_scale; /* 0: scoring, no backward follows */
  if (m->ops->loss) {
    m->ops->loss(m, rows, dlogits, grad_scale);
    return;
  }
  int64_t n = model_targets(m, rows), shape[2] = {n, model_logits_stride(m)};
  struct tensor logits = tensor_view(model_act(m, m->u1), 0, 2, shape);
  struct tensor dl = tensor_view(dlogits, 0, 2, shape);
  struct tensor labels = tensor_view(&m->labels, 0, 1, &n);
  struct tensor losses = tensor_view(&m->losses, 0, 1, &n);
  tensor_softmax_xent_cols(&logits, m->io.classes, &labels, &dl, &losses, grad_scale);
}

void model_forward_backward(struct model *m, int64_t rows) {
  int L = m->table.nunits;
  RUMOR_ASSERT(m->u0 == 0 && m->u1 == L);
  model_forward(m, 0, L, rows);
  /* The loss gradient replaces the logits: nothing reads them again. */
  struct tensor *logits = model_act(m, L);
  model_loss(m, rows, logits, 1.0f / (float)model_targets(m, rows));
  model_backward(m, 0, L, rows, logits, NULL, false);
}

float model_mean_loss(const struct model *m, int64_t rows) {
  int64_t n = model_targets(m, rows);
  struct tensor losses = tensor_view(&m->losses, 0, 1, &n);
  return (float)(tensor_sum(&losses) / (double)n);
}

void model_score(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct, double *loss_sum) {
  if (m->ops->score) {
    m->ops->score(m, rows, labels_host, correct, loss_sum);
    return;
  }
  int64_t n = model_targets(m, rows), C = m->io.classes, ld = model_logits_stride(m);
  float *logits = xmalloc((size_t)(n * ld) * sizeof(float));
  struct tensor *out = model_act(m, m->u1);
  tensor_copy_to_host(out, 0, logits, (size_t)(n * ld) * sizeof(float));
  model_loss(m, rows, out, 0.0f); /* the logits are on the host now */
  struct tensor losses = tensor_view(&m->losses, 0, 1, &n);
  *loss_sum += tensor_sum(&losses);
  for (int64_t r = 0; r < n; r++) {
    const float *row = logits + r * ld;
    int64_t best = 0;
    for (int64_t c = 1; c < C; c++)
      if (row[c] > row[best]) best = c;
    *correct += best == labels_host[r];
  }
  free(logits);
}

void model_evaluate(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct, double *loss_sum) {
  model_forward(m, 0, m->table.nunits, rows);
  model_score(m, rows, labels_host, correct, loss_sum);
}
