/*
 * one_step.h — the reference for the bulk-synchronous schemes' tests: the
 * first step of a single process on the rows of every member's first batch
 * together (shards 0/n .. n−1/n, batch b each, concatenated in shard
 * order), with the same model, seed and defaults as the members. One step
 * of n all-reduce members or parameter-server workers must equal it.
 *
 * Header-only; include after criterion and peer/train/train_impl.h.
 */
#ifndef RUMOR_TESTS_ONE_STEP_H
#define RUMOR_TESTS_ONE_STEP_H

#include <stdlib.h>

#include "peer/train/train.h"
#include "peer/train/train_impl.h"

/* Returns the parameters after that step (the caller frees them); *P gets
 * their count. */
static inline float *one_step_on_all_batches(const char *model, uint64_t seed, int n, int64_t b, int64_t *P) {
  struct train_config cfg;
  train_config_default(&cfg);
  cfg.model = model;
  cfg.max_steps = 1;
  cfg.seed = seed;
  cfg.threads = 1;
  cfg.eval_each_epoch = false;
  cfg.log_every_s = 0;
  struct rumor_err e;
  struct trainer one;
  cfg.shard = (struct shard){0, 1};
  cfg.batch = n * b;
  cr_assert_eq(trainer_init(&one, &cfg, &e), 0, "%s", e.msg);
  size_t xrow = one.data.x_bytes_per_row;
  for (int i = 0; i < n; i++) {
    struct trainer m;
    cfg.shard = (struct shard){i, n};
    cfg.batch = b;
    cr_assert_eq(trainer_init(&m, &cfg, &e), 0, "%s", e.msg);
    int64_t got = train_data_fill(&m.data, 0, b, (char *)one.xh[one.cur] + (size_t)(i * b) * xrow,
                                  one.yh[one.cur] + i * b * one.data.y_per_row);
    cr_assert_eq(got, b);
    trainer_free(&m);
  }
  one.rows[one.cur] = n * b;
  one.staged = true;
  cr_assert_eq(trainer_step(&one, &e), 0, "%s", e.msg);
  *P = one.model.nparams;
  float *out = malloc((size_t)*P * sizeof(float));
  tensor_copy_to_host(&one.model.params, 0, out, (size_t)*P * sizeof(float));
  trainer_free(&one);
  return out;
}

#endif /* RUMOR_TESTS_ONE_STEP_H */
