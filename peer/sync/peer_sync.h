/*
 * peer_sync — the training thread's side of gossip: at each step boundary it
 * starts exchanges on schedule, takes snapshots (asynchronously on a GPU),
 * validates and applies a partner's parameters, and fills state donations.
 *
 * Applying: the partner's parameters must be finite and within
 * `max_distance` × ‖ours‖ of ours (‖θ_partner − θ‖ ≤ R·‖θ‖), else they are
 * rejected with a log line and the sender is backed off; accepted ones are
 * averaged in one op: θ ← (1−α)·θ + α·θ_partner.
 *
 * Monitoring: cheap figures (step, loss, throughput) are published about
 * once a second; the O(P) ones (parameter norm, count-sketch, on the
 * training device) only when a monitor asked for them.
 *
 * Threads: the training thread only.
 */
#ifndef RUMOR_PEER_SYNC_H
#define RUMOR_PEER_SYNC_H

#include "gossip/gossip.h"
#include "peer/sync/attack.h"
#include "peer/sync/clip.h"
#include "peer/train/train.h"

/* Samples used to check a donated or received state's loss. */
#define PEER_SYNC_CHECK_SAMPLES 8192

struct peer_sync_config {
  int64_t every_steps;  /* start an exchange every N steps (0: off) */
  double every_s;       /* ... or every T seconds (0: off) */
  double max_distance;  /* R, relative to our parameter norm */
  bool clip;            /* clipped averaging (clip.h) */
  double clip_tau;      /* its fixed τ (0: adaptive) */
  struct attack *attack; /* testing only: poison our snapshots (attack.h); NULL in real use */
  /* Bounded drift: after this many steps without an applied exchange,
   * peer_sync_hold holds training until one applies, at most max_hold_s at
   * a time (0: never hold; training never waits for the network). */
  int64_t max_local_steps;
  double max_hold_s;
};

struct peer_sync {
  struct peer_sync_config cfg;
  gossip_t *g;
  struct trainer *t;
  struct tensor staging; /* (P): the partner's parameters on our device (tensor_mirror_host
                          * of the receive buffer: the buffer itself on the CPU) */
  tensor_event_t snap_ev;
  bool snap_pending;
  int64_t snap_step;
  double last_start_s;
  uint64_t applied, rejected;
  int64_t mix_step;         /* step of the last applied exchange (or of the start) */
  int64_t longest_local;    /* most steps between applied exchanges seen */
  bool holding;             /* in peer_sync_hold: exchange whatever the schedule */
  uint64_t holds, hold_timeouts;
  int hold_failures_in_row;
  int64_t hold_resume_step; /* no hold before this step (after holds that gave up) */
  double hold_s;            /* total time held */
  struct clip_state clip;
  double last_dist, last_norm; /* of the partner's parameters being validated */

  /* Monitoring figures (gossip_stats_publish). */
  double *sketch;          /* gossip_sketch_k doubles */
  double stats_s;          /* when cheap figures were last published */
  double rate_s;           /* start of the current throughput window */
  int64_t rate_samples;
  double samples_per_s;
  double param_norm;       /* at the last sketch */
};

int peer_sync_init(struct peer_sync *ps, gossip_t *g, struct trainer *t, const struct peer_sync_config *cfg,
                   struct rumor_err *e) RUMOR_MUST_CHECK;
/* Does whatever gossip needs at this step boundary (exchanges, donations,
 * monitoring figures); never waits on the network. */
void peer_sync_boundary(struct peer_sync *ps);
/* With cfg.max_local_steps > 0: when that many steps have passed since the
 * last applied exchange and some partner is alive, keeps exchanging (and
 * serving donations) without training until an exchange applies, `*stop`
 * becomes non-zero, or cfg.max_hold_s passes (then training goes on: a
 * cluster whose exchanges all fail must not stop, and after such a timeout
 * the next hold waits N·2^k steps, k the timeouts in a row). Call after
 * peer_sync_boundary. */
void peer_sync_hold(struct peer_sync *ps, const atomic_int *stop);
void peer_sync_free(struct peer_sync *ps);

#endif /* RUMOR_PEER_SYNC_H */
