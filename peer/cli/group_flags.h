/*
 * group_flags — the command-line options of model-parallel training, shared
 * by `rumor group` (the launcher) and `rumor peer --group G --stage s/S`
 * (one stage process): the training options (as `rumor train`'s), the
 * cluster options, the gossip options of `rumor peer`, and the pipeline's
 * own (--micro-batches, --pipeline gpipe|1f1b, the stage links).
 */
#ifndef RUMOR_PEER_GROUP_FLAGS_H
#define RUMOR_PEER_GROUP_FLAGS_H

#include "peer/cli/args.h"
#include "peer/cli/net_flags.h"
#include "peer/pipeline/stage_train.h"
#include "peer/cli/train_flags.h"

#define GROUP_FLAGS_MAX_SPECS 100

struct group_flags {
  struct train_flags train;
  struct net_flags net;
  /* gossip, as `rumor peer` */
  int64_t every, exchange_timeout_ms, linger_ms, wait_peers, wait_peers_ms, sketch_k;
  double interval, alpha, max_distance;
  const char *wire, *name;
  bool no_state_pull;
  /* pipeline */
  const char *group, *schedule;
  int64_t micro, link_wait_ms, link_timeout_ms;
  /* one stage process */
  const char *stage, *link_listen, *link_prev;
  /* the launcher */
  int64_t stages;
  const char *devices;
};

enum group_flags_for { GROUP_FLAGS_LAUNCHER, GROUP_FLAGS_STAGE };

void group_flags_default(struct group_flags *f);
/* Fills specs (NULL-terminated, at most GROUP_FLAGS_MAX_SPECS entries) with
 * the options of the launcher or of one stage process. */
void group_flags_specs(struct group_flags *f, enum group_flags_for who, struct arg_spec *specs);

/* Parses "s/S" (0 <= s < S <= PIPE_MAX_STAGES). */
int group_stage_parse(const char *s, int *stage, int *stages, struct rumor_err *e) RUMOR_MUST_CHECK;

/* The stage configuration from parsed flags (`specs` is what was parsed).
 * Returns 0 or RUMOR_EFORMAT with a message naming the option. */
int group_flags_stage_config(const struct group_flags *f, const struct arg_spec *specs, int stage, int stages,
                             struct stage_config *out, struct rumor_err *e) RUMOR_MUST_CHECK;

/* The --wire value. */
int group_flags_wire(const struct group_flags *f, enum net_dtype *out, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_GROUP_FLAGS_H */
