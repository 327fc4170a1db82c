/*
 * model_impl.h — what a model family implements (private to peer/model/).
 *
 * model.c holds what every family shares (spec dispatch, the table, the
 * loss, scoring, initialisation streams) and calls a family through this
 * table of functions; mlp.c is one family. A new family adds a file with
 * its own `const struct model_family_ops` and a line in model.c's registry.
 */
#ifndef RUMOR_PEER_MODEL_IMPL_H
#define RUMOR_PEER_MODEL_IMPL_H

#include "peer/model/model.h"

struct model_family_ops {
  const char *name;      /* the spec's prefix before ':' */
  const char *unit_noun; /* "layer" */
  /* Parses the part of `spec` after "name:" (`args`); quotes `spec` in errors. */
  int (*parse)(const char *spec, const char *args, struct model_spec *out, struct rumor_err *e);
  void (*format)(const struct model_spec *s, char *buf, size_t len);
  /* Writes the table's entries into out (NULL: only counts them); returns
   * how many there are. Offsets and units ascending, without gaps. */
  size_t (*table)(const struct model_spec *s, struct model_param *out);
  int (*units)(const struct model_spec *s);
  void (*io)(const struct model_spec *s, struct model_io *out);
  int64_t (*boundary)(const struct model_spec *s, int u);
  int64_t (*unit_macs)(const struct model_spec *s, int u);
  void (*describe_units)(const struct model_spec *s, int u0, int u1, char *buf, size_t n);
  /* The initial values of unit u's parameters (its table entries in order,
   * `out` at the unit's first element), drawn from `r`. */
  void (*init_unit)(const struct model_spec *s, int u, struct rng *r, float *out);

  /* Workspace for m->u0..u1 and m->max_rows (params, grads, labels and
   * losses exist): sets m->impl and m->stash. Returns 0 or an allocation
   * error; on error model_free cleans up. */
  int (*init)(struct model *m, struct rumor_err *e);
  void (*free)(struct model *m); /* frees m->impl's tensors and m->impl; NULL impl is a no-op */
  struct tensor *(*act)(struct model *m, int u);
  void (*forward)(struct model *m, int a, int b, int64_t rows);
  void (*backward)(struct model *m, int a, int b, int64_t rows, struct tensor *dout, struct tensor *din,
                   bool accumulate);
  /* Optional (model_tied): the entry of unit 0 that the last unit uses too,
   * and the copy of it that a model holding the last unit but not unit 0
   * keeps (returns false when it keeps none). */
  int tied_entry; /* -1: none (a family without `tied`) */
  bool (*tied)(struct model *m, struct tensor **param, struct tensor **grad);
  /* Optional (model_set_positions). */
  void (*set_positions)(struct model *m, int64_t t);
  /* Optional (model_hf_config and friends): Hugging Face's config for a
   * spec, the spec from a config's parsed object (`name` for messages), and
   * whether a checkpoint name the table lacks is one to ignore. */
  struct json_t *(*hf_config)(const struct model_spec *s);
  const char *hf_model_type; /* config.json's model_type */
  int (*hf_parse)(const struct json_t *cfg, const char *name, struct model_spec *out, struct rumor_err *e);
  bool (*hf_ignored)(const char *name);
  const char *hf_prefix; /* a prefix the table's names carry and a checkpoint's may lack */

  /* Optional: what a tensor-parallel rank (peer/model/tp.c) does its own
   * way; NULL runs model.c's whole-model code. The width of model_act(m, u)
   * per row (also a whole model's, where it pads its logits:
   * model_logits_stride), the initial parameters, model_loss and
   * model_score. */
  int64_t (*act_width)(const struct model *m, int u);
  void (*init_params)(struct model *m, uint64_t seed);
  void (*loss)(struct model *m, int64_t rows, struct tensor *dlogits, float grad_scale);
  void (*score)(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct, double *loss_sum);
};

/* model_init and model_init_tp's common part: with m zeroed and, for a
 * rank, m->tp and m->tp_layout set, fills in the rest for units [u0, u1)
 * of `spec` with `ops` and allocates the buffers and the workspace (in the
 * buffer model_own_table describes). Frees what it made on failure. */
int model_setup(struct model *m, const struct model_spec *spec, const struct model_family_ops *ops, int u0, int u1,
                tensor_backend_t be, int64_t max_rows, struct rumor_err *e) RUMOR_MUST_CHECK;

extern const struct model_family_ops model_mlp_ops;
extern const struct model_family_ops model_gpt_ops;

#endif /* RUMOR_PEER_MODEL_IMPL_H */
