/*
 * tp_impl.h — what a model family implements for tensor parallelism
 * (private to peer/model/). tp.c holds what every family shares (the
 * layout, scatter and gather, allocation, the collectives' wrapper) and
 * calls a family through this table. A family's rank runs the family's
 * own passes (gpt.c, mlp.c: one set for whole models and ranks), which
 * follow model.h's "tensor parallelism".
 */
#ifndef RUMOR_PEER_MODEL_TP_IMPL_H
#define RUMOR_PEER_MODEL_TP_IMPL_H

#include "peer/model/model_impl.h"

struct model_tp_family {
  /* The rank's passes: init, free, act, forward, backward and the
   * optional act_width, init_params (model_tp_init_params), loss, score,
   * tied and set_positions of model_impl.h. */
  const struct model_family_ops *ops;
  /* model_tp_check's family part (size is already in [1, MODEL_TP_MAX]):
   * RUMOR_EFORMAT quoting `spec` (the canonical string) and size. */
  int (*check)(const struct model_spec *s, const char *spec, int size, struct rumor_err *e);
  /* How table entry i (p) is cut: *dim (-1: replicated) and *groups. The
   * range within each block is model_tp_chunk's of the block's length. */
  void (*split)(const struct model_spec *s, size_t i, const struct model_param *p, int *dim, int *groups);
};

extern const struct model_tp_family model_mlp_tp;
extern const struct model_tp_family model_gpt_tp;

/* Sums the first n floats of t across the rank's group through
 * m->tp->all_reduce: nothing in a whole model (m->tp NULL), when the group
 * is one rank or when an earlier call failed; a failure is recorded in
 * m->tp (model.h's contract). */
void model_tp_all_reduce(struct model *m, struct tensor *t, int64_t n);
/* model_init_params of a rank: the whole model's values for units
 * [u0, u1) drawn on the host as model_init_params draws them, then the
 * rank's slices of them. */
void model_tp_init_params(struct model *m, uint64_t seed);
/* The rank's slice of table entry i: the local entry (shape, offset in the
 * rank's flat buffer) and the cut. */
static inline const struct model_param *model_tp_local(const struct model *m, size_t i) {
  return &m->tp_layout.local.p[i];
}

#endif /* RUMOR_PEER_MODEL_TP_IMPL_H */
