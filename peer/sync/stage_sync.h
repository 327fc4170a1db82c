/*
 * stage_sync — gossip averaging for one stage of a peer group. Each stage
 * runs its own gossip runtime whose model label names the model, the split
 * and the stage (stage_gossip_label), so it meets only the same stage of
 * other groups with the same split: stage s averages its slice of the
 * parameters with stage s elsewhere, and the gossip protocol is unchanged.
 *
 * Like peer_sync for a whole replica: at each step boundary it starts
 * exchanges on schedule, snapshots the slice, validates a partner's slice
 * (finite, within max_distance × ‖ours‖) and averages it in; it serves state
 * donations to newcomer stages and publishes monitoring figures. Between
 * step boundaries (while the pipeline waits for a neighbour) stage_sync_idle
 * serves donations only: parameters and optimizer state do not change
 * during a step, so a donation there is the state at the step's start.
 *
 * Threads: the stage's training thread only.
 */
#ifndef RUMOR_PEER_STAGE_SYNC_H
#define RUMOR_PEER_STAGE_SYNC_H

#include "gossip/gossip.h"
#include "peer/pipeline/stage_train.h"

struct stage_sync_config {
  int64_t every_steps; /* start an exchange every N steps (0: off) */
  double every_s;      /* ... or every T seconds (0: off) */
  double max_distance; /* R, relative to our slice's norm */
};

struct stage_sync {
  struct stage_sync_config cfg;
  gossip_t *g;
  struct stage_trainer *t;
  struct tensor staging; /* (P) the partner's slice on our device (tensor_mirror_host of
                          * the receive buffer) */
  double last_start_s;
  uint64_t applied, rejected;
  double *sketch;
  double stats_s, rate_s, samples_per_s, param_norm;
  int64_t rate_samples;
};

int stage_sync_init(struct stage_sync *ss, gossip_t *g, struct stage_trainer *t, const struct stage_sync_config *cfg,
                    struct rumor_err *e) RUMOR_MUST_CHECK;
/* Everything gossip needs at a step boundary; never waits on the network. */
void stage_sync_boundary(struct stage_sync *ss);
/* Donations and figures only (mid-step); `arg` is the stage_sync. Suits
 * stage_link_set_idle. */
void stage_sync_idle(void *arg);
void stage_sync_free(struct stage_sync *ss);

#endif /* RUMOR_PEER_STAGE_SYNC_H */
