/*
 * ckpt_params.h — a checkpoint's parameters as one flat host array, in the
 * model's buffer order (its parameter table's), for tests that compare
 * replicas. Header-only.
 */
#ifndef RUMOR_TESTS_CKPT_PARAMS_H
#define RUMOR_TESTS_CKPT_PARAMS_H

#include <stdio.h>
#include <string.h>

#include "peer/train/train.h"

/* Copies the parameters of an open checkpoint into a new array (the caller
 * frees it); *n gets their count. */
static inline float *ckpt_params_copy(const struct checkpoint *ck, int64_t *n) {
  *n = ck->table.nparams;
  float *p = xmalloc((size_t)*n * sizeof(float));
  checkpoint_params(ck, p);
  return p;
}

/* Opens the checkpoint at `path` (a failed open fails the test) and copies
 * its parameters as ckpt_params_copy does. Needs criterion. */
static inline float *ckpt_params_load(const char *path, int64_t *n) {
  struct checkpoint ck;
  struct rumor_err e;
  cr_assert_eq(checkpoint_open(path, &ck, &e), 0, "%s", e.msg);
  float *p = ckpt_params_copy(&ck, n);
  checkpoint_close(&ck);
  return p;
}

#endif /* RUMOR_TESTS_CKPT_PARAMS_H */
