/* What every tensor-parallel family shares (model.h's "tensor
 * parallelism"): the cut of each table entry, the rank's own table,
 * scatter and gather between the whole model's flat buffer and a rank's,
 * a rank's allocation and initial values, and the collectives' wrapper. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/tp_impl.h"

/* The registry, in model.c's family order (enum model_family). */
static const struct {
  const struct model_family_ops *whole;
  const struct model_tp_family *tp;
} TP_FAMILIES[] = {{&model_mlp_ops, &model_mlp_tp}, {&model_gpt_ops, &model_gpt_tp}};

static const struct model_tp_family *tp_family_of(const struct model_spec *s, const struct model_family_ops **whole) {
  size_t i = (size_t)s->family - 1;
  RUMOR_ASSERT(i < sizeof TP_FAMILIES / sizeof TP_FAMILIES[0]);
  if (whole) *whole = TP_FAMILIES[i].whole;
  return TP_FAMILIES[i].tp;
}

void model_tp_chunk(int64_t n, int size, int r, int64_t *lo, int64_t *hi) {
  RUMOR_ASSERT(n >= 0 && size >= 1 && 0 <= r && r < size);
  int64_t q = n / size, rem = n % size;
  *lo = r * q + (r < rem ? r : rem);
  *hi = *lo + q + (r < rem ? 1 : 0);
}

int model_tp_check(const struct model_spec *spec, int size, struct rumor_err *e) {
  char s[MODEL_SPEC_MAX];
  model_spec_format(spec, s, sizeof s);
  if (size < 1 || size > MODEL_TP_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "model '%s' cannot be split over %d tensor-parallel ranks: the ranks must "
                         "be in [1, %d]", s, size, MODEL_TP_MAX);
  return tp_family_of(spec, NULL)->check(spec, s, size, e);
}

/* ---- the layout ---- */

int model_tp_layout_build(const struct model_spec *spec, int size, int rank, struct model_tp_layout *out,
                          struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  int rc = model_tp_check(spec, size, e);
  if (rc) return rc;
  RUMOR_ASSERT(0 <= rank && rank < size);
  const struct model_tp_family *f = tp_family_of(spec, NULL);
  struct model_table *t = &out->local;
  model_table_build(spec, t); /* the whole table, made local below */
  out->size = size;
  out->rank = rank;
  out->slice = xcalloc(t->n ? t->n : 1, sizeof *out->slice);
  int64_t off = 0;
  int u = 0;
  for (size_t i = 0; i < t->n; i++) {
    struct model_param *p = &t->p[i];
    struct model_tp_slice *sl = &out->slice[i];
    f->split(spec, i, p, &sl->dim, &sl->groups);
    if (sl->dim >= 0) {
      RUMOR_ASSERT(sl->dim < p->ndim && sl->groups >= 1 && p->shape[sl->dim] % sl->groups == 0);
      model_tp_chunk(p->shape[sl->dim] / sl->groups, size, rank, &sl->lo, &sl->hi);
      RUMOR_ASSERT(sl->hi > sl->lo); /* model_tp_check: nothing is cut finer than the ranks */
      p->numel = p->numel / p->shape[sl->dim] * sl->groups * (sl->hi - sl->lo);
      p->shape[sl->dim] = sl->groups * (sl->hi - sl->lo);
    }
    p->offset = off;
    while (u < p->unit) t->unit_offset[++u] = off;
    off += p->numel;
  }
  while (u < t->nunits) t->unit_offset[++u] = off;
  t->nparams = off;
  return 0;
}

void model_tp_layout_free(struct model_tp_layout *l) {
  model_table_free(&l->local);
  free(l->slice);
  memset(l, 0, sizeof *l);
}

static void layout_of(const struct model_spec *spec, int size, int rank, struct model_tp_layout *l) {
  struct rumor_err e;
  int rc = model_tp_layout_build(spec, size, rank, l, &e);
  RUMOR_ASSERT(rc == 0 && "model_tp_check must pass");
}

int64_t model_tp_local_params(const struct model_spec *spec, int size, int rank) {
  struct model_tp_layout l;
  layout_of(spec, size, rank, &l);
  int64_t n = l.local.nparams;
  model_tp_layout_free(&l);
  return n;
}

/* Copies whole entry `w`'s rank slice between `full` (at w's offset) and
 * `local` (at the local entry's offset): to the local buffer when
 * `to_local`, else back. */
static void copy_entry(const struct model_param *w, const struct model_param *loc, const struct model_tp_slice *sl,
                       const float *src, float *dst, bool to_local) {
  float *full = (float *)(to_local ? src : dst) + w->offset, *local = (float *)(to_local ? dst : src) + loc->offset;
  int64_t d0 = w->shape[0], d1 = w->ndim > 1 ? w->numel / d0 : 1, width = sl->hi - sl->lo;
#define COPY(f, l, n) (to_local ? memcpy((l), (f), (size_t)(n) * sizeof(float)) : memcpy((f), (l), (size_t)(n) * sizeof(float)))
  if (sl->dim < 0) {
    COPY(full, local, w->numel);
  } else if (sl->dim == 0) { /* rows [g·B + lo, g·B + hi) of each block g */
    int64_t B = d0 / sl->groups;
    for (int g = 0; g < sl->groups; g++) COPY(full + (g * B + sl->lo) * d1, local + g * width * d1, width * d1);
  } else { /* the same columns of every row */
    RUMOR_ASSERT(sl->dim == 1 && w->ndim == 2);
    int64_t B = d1 / sl->groups;
    for (int64_t i = 0; i < d0; i++)
      for (int g = 0; g < sl->groups; g++)
        COPY(full + i * d1 + g * B + sl->lo, local + (i * sl->groups + g) * width, width);
  }
#undef COPY
}

/* Entries of units [u0, u1); `full` and `local` are the whole buffers. */
static void copy_units(const struct model_spec *spec, const struct model_tp_layout *l, int u0, int u1,
                       const float *src, float *dst, bool to_local) {
  struct model_table whole;
  model_table_build(spec, &whole);
  for (size_t i = 0; i < whole.n; i++)
    if (whole.p[i].unit >= u0 && whole.p[i].unit < u1)
      copy_entry(&whole.p[i], &l->local.p[i], &l->slice[i], src, dst, to_local);
  model_table_free(&whole);
}

void model_tp_scatter(const struct model_spec *spec, int size, int rank, const float *full, float *local) {
  struct model_tp_layout l;
  layout_of(spec, size, rank, &l);
  copy_units(spec, &l, 0, l.local.nunits, full, local, true);
  model_tp_layout_free(&l);
}

void model_tp_gather(const struct model_spec *spec, int size, int rank, const float *local, float *full) {
  struct model_tp_layout l;
  layout_of(spec, size, rank, &l);
  copy_units(spec, &l, 0, l.local.nunits, local, full, false);
  model_tp_layout_free(&l);
}

/* ---- a rank ---- */

int model_init_tp(struct model *m, const struct model_spec *spec, int u0, int u1, tensor_backend_t be,
                  int64_t max_rows, struct model_tp *tp, struct rumor_err *e) {
  RUMOR_ASSERT(tp && 0 <= tp->rank && tp->rank < tp->size && (tp->size == 1 || tp->all_reduce));
  memset(m, 0, sizeof *m);
  int rc = model_tp_layout_build(spec, tp->size, tp->rank, &m->tp_layout, e);
  if (rc) return rc;
  m->tp = tp;
  return model_setup(m, spec, tp_family_of(spec, NULL)->ops, u0, u1, be, max_rows, e);
}

void model_tp_init_params(struct model *m, uint64_t seed) {
  const struct model_family_ops *whole;
  tp_family_of(&m->spec, &whole);
  const struct model_table *t = &m->table;
  /* The whole model's buffer, only units [u0, u1) drawn (zeros elsewhere). */
  float *full = xcalloc((size_t)t->nparams ? (size_t)t->nparams : 1, sizeof(float));
  float *local = xcalloc((size_t)m->tp_layout.local.nparams + 1, sizeof(float));
  struct rng r;
  for (int u = m->u0; u < m->u1; u++) {
    rng_seed(&r, seed, (uint64_t)u + 1); /* model_init_params' stream of unit u */
    whole->init_unit(&m->spec, u, &r, full + t->unit_offset[u]);
  }
  copy_units(&m->spec, &m->tp_layout, m->u0, m->u1, full, local, true);
  tensor_copy_from_host(&m->params, 0, local + m->param_base, (size_t)m->nparams * sizeof(float));
  free(full);
  free(local);
}

void model_tp_all_reduce(struct model *m, struct tensor *t, int64_t n) {
  struct model_tp *tp = m->tp;
  if (!tp || tp->size == 1 || tp->failed) return;
  struct rumor_err e = {0};
  int rc = tp->all_reduce(tp->arg, t, n, &e);
  if (rc) {
    tp->err = e;
    tp->failed = rc;
  }
}
