/*
 * train_flags — the command-line options that describe one replica's
 * training, shared by `rumor train` and `rumor peer`.
 */
#ifndef RUMOR_PEER_TRAIN_FLAGS_H
#define RUMOR_PEER_TRAIN_FLAGS_H

#include <stddef.h>

#include "peer/cli/args.h"
#include "peer/train/train.h"

struct train_flags {
  const char *model, *data, *device, *shard, *optimizer, *schedule, *checkpoint, *resume;
  int64_t threads, seed, data_seed, epochs, batch, max_steps, checkpoint_every, warmup;
  double lr, momentum, weight_decay, log_every;
  bool nesterov, no_eval, log_json;
};

/* Fills `f` with the defaults shown in --help. */
void train_flags_default(struct train_flags *f);
/* Appends the training options' specs to out[*n..max) (not terminated). */
void train_flags_specs(struct train_flags *f, struct arg_spec *out, size_t *n, size_t max);
/* Turns parsed flags into a configuration (`specs` is the array that was
 * parsed, to tell given options from defaults). Returns 0 or RUMOR_EFORMAT
 * with a message naming the option. */
int train_flags_config(const struct train_flags *f, const struct arg_spec *specs, struct train_config *cfg,
                       struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_TRAIN_FLAGS_H */
