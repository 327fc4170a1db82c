/*
 * ckpt_params.h — a checkpoint's parameters as one flat host array, in the
 * model's buffer order (layer by layer, weight then bias), for tests that
 * compare replicas. Header-only; include after peer/checkpoint.h and
 * criterion.
 */
#ifndef RUMOR_TESTS_CKPT_PARAMS_H
#define RUMOR_TESTS_CKPT_PARAMS_H

#include <stdio.h>
#include <string.h>

#include "peer/checkpoint.h"

/* Copies the parameters of an open checkpoint into a new array (the caller
 * frees it); *n gets their count. */
static inline float *ckpt_params_copy(const struct checkpoint *ck, int64_t *n) {
  *n = model_spec_param_count(&ck->info.spec);
  float *p = xmalloc((size_t)*n * sizeof(float));
  int64_t off = 0;
  for (int l = 0; l < ck->info.spec.nlayers; l++)
    for (int wb = 0; wb < 2; wb++) {
      char name[64];
      snprintf(name, sizeof name, "layers.%d.%s", l, wb ? "bias" : "weight");
      const struct st_tensor *t = safetensors_find(&ck->file, name);
      cr_assert_not_null(t, "checkpoint lacks %s", name);
      cr_assert_leq(off + (int64_t)(t->nbytes / sizeof(float)), *n, "%s overruns the model's size", name);
      memcpy(p + off, t->data, t->nbytes);
      off += (int64_t)(t->nbytes / sizeof(float));
    }
  return p;
}

#endif /* RUMOR_TESTS_CKPT_PARAMS_H */
