/*
 * monitor — the client side of cluster monitoring (`rumor top`).
 *
 * A monitor is not a member: it holds the cluster key and an identity, dials
 * a bootstrap address for the member table (MEMBERS_REQ), then asks every
 * member for its figures (STATS_REQ) and, with `exact`, a peer's parameters
 * (PARAMS_REQ, a bulk transfer made at one step boundary together with the
 * sketch of the same parameters). Connections are kept between polls.
 *
 * A member that does not answer within the poll's timeout is reported as
 * unreachable with the reason (refused, handshake failed, no answer), never
 * dropped from the report. Members the table marks *left* are not listed.
 *
 * Threads: a monitor runs its own libuv loop on the caller's thread, only
 * inside gossip_monitor_poll and gossip_monitor_sleep; one thread per
 * monitor.
 */
#ifndef RUMOR_GOSSIP_MONITOR_H
#define RUMOR_GOSSIP_MONITOR_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "gossip/gossip.h" /* GOSSIP_MAX_EXPERTS */
#include "net/net.h"
#include "util/util.h"

typedef struct gossip_monitor gossip_monitor_t;

struct gossip_monitor_config {
  const struct net_identity *identity; /* required; copied */
  const uint8_t *cluster_key;          /* required; copied */
  const struct net_allowlist *allow;   /* optional */
  const char *bootstrap;               /* comma-separated addresses; the first that answers is used */
  uint32_t timeout_ms;                 /* per poll (default 3000) */
  uint32_t handshake_timeout_ms;       /* default 3000 */
  uint32_t heartbeat_ms, dead_after_ms; /* net_config's (defaults: net_config_defaults') */
  bool exact;                          /* also pull every peer's parameters */
  uint64_t exact_max_bytes;            /* refuse `exact` above this in total (default 4 GiB) */
  const atomic_int *stop;              /* optional: nonzero ends poll and sleep early */
};
void gossip_monitor_config_default(struct gossip_monitor_config *c);

/* One member as the monitor saw it. Strings are NUL-terminated. */
struct gossip_node_report {
  char id[NET_PUBKEY_STR_LEN + 1];
  char addr[128];
  char role[12];   /* "peer" or "bootstrap" */
  char state[8];   /* in the member table: "alive", "suspect" or "failed" */
  bool reachable;  /* it answered STATS in time */
  char error[200]; /* why not, when !reachable */
  double rtt_ms;   /* request to answer */

  /* From its STATS answer. */
  bool ready;
  bool finished; /* took its last step and lingers (--finish-wait-ms); false from older peers */
  char model[256];
  uint64_t nparams;
  uint64_t exchanges_ok, exchanges_failed, exchanges_rejected, donations;
  char last_failure[160];
  double last_exchange_age_s; /* < 0: none yet */
  uint64_t bytes_in, bytes_out;
  /* Encoded parameter bytes of its last applied exchange, each way
   * (gossip_stats; 0 before the first, or from a node too old to say). */
  uint64_t exchange_bytes_out, exchange_bytes_in;
  /* Relays (0 and "" from nodes that do not report them): its open
   * connections over a relay and their bytes, what it forwarded as a
   * relay, and the relay it is reached through. */
  uint64_t relayed_links, relayed_bytes, relay_bytes;
  char via[128];
  uint64_t members;
  /* How it keeps its replica together: "gossip" or "allreduce" (empty for
   * a bootstrap node or one too old to say); for all-reduce, the steps it
   * has completed through the ring, its last ring's size and the rounds
   * that failed. */
  char sync[16];
  uint64_t round, ring_members, rounds_failed;
  /* An outer optimizer's (DiLoCo, NoLoCo): rounds applied (-1: none or not
   * said), the last round's ‖pseudo-gradient‖ and payload bytes, and the
   * training's total wait for rounds in seconds. */
  int64_t outer_round;
  double outer_norm, outer_bytes, outer_wait_s;
  bool have_train; /* the training figures below are set */
  int64_t step, epoch, samples;
  double loss, samples_per_s, param_norm;
  int64_t peak_rss_bytes; /* the member's peak resident memory (0: not said) */
  int moe_experts;        /* a mixture of experts' figures (0: none said) */
  double moe_aux_loss, moe_z_loss, moe_dropped, moe_load[GOSSIP_MAX_EXPERTS];
  double stats_age_s; /* how old the figures were when sent */
  int sketch_k;       /* 0: no sketch */
  double *sketch;     /* sketch_k doubles, owned by the report */

  /* With `exact`: the parameters, or why they are missing. */
  float *params;      /* nparams floats, owned by the report */
  int64_t params_step;
  char params_error[160];
};

struct gossip_cluster_report {
  double time_s;           /* wall clock (Unix seconds) when the poll began */
  char via[128];           /* the bootstrap address that gave the member table */
  size_t n;
  struct gossip_node_report *nodes;
  size_t peers, reachable_peers;
  /* Consensus distance over the reachable peers with sketches (NaN when
   * fewer than 2): Ξ estimated from sketches, ‖θ̄‖, and Ξ/‖θ̄‖. With
   * `exact`, the sketches are those sent with the parameters (made at the
   * same step boundary), and xi_exact is computed from the parameters. */
  size_t drift_n;
  double xi, mean_norm, rel_drift;
  size_t exact_n;
  double xi_exact;
  char drift_note[200];    /* why drift is missing or partial ("" when complete) */
};
void gossip_cluster_report_free(struct gossip_cluster_report *r);

int gossip_monitor_open(gossip_monitor_t **out, const struct gossip_monitor_config *cfg,
                        struct rumor_err *e) RUMOR_MUST_CHECK;
/* Asks the cluster once. Returns 0 and fills *r (free it), or a negative
 * code when no bootstrap address answered (the message names each address
 * tried and why) or the stop flag was raised (RUMOR_ECANCELED). */
int gossip_monitor_poll(gossip_monitor_t *m, struct gossip_cluster_report *r, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Services connections for `ms` (or until the stop flag). */
void gossip_monitor_sleep(gossip_monitor_t *m, uint32_t ms);
void gossip_monitor_close(gossip_monitor_t *m);

/* A page handler for gossip_monitor_serve: for a GET of `path` (the query
 * cut off) it fills *body (malloc'd; the server frees it; NULL for none),
 * *len and *type (a static Content-Type; text/plain unless set) and returns
 * the HTTP status. Called on the monitor's thread, inside
 * gossip_monitor_poll and gossip_monitor_sleep. */
typedef int (*gossip_monitor_http_handler)(void *ctx, const char *path, char **body, size_t *len, const char **type);

/* Serves read-only HTTP on `addr` ("host:port" or "[v6]:port"; port 0 picks
 * a free one) from the monitor's own loop, with the metrics endpoint's
 * server and limits: GET only (any other method: 405), requests up to 8 KiB,
 * 5 s per client, 32 clients at once. Requests are answered while the
 * caller is inside gossip_monitor_poll or gossip_monitor_sleep; a slow or
 * silent client never holds the caller. `what` names the option in error
 * messages ("--web"). Returns 0 and the bound port in *port, or a negative
 * code with a message naming `addr`, and then serves nothing. One server per
 * monitor; gossip_monitor_close stops it, so `ctx` must outlive the monitor. */
int gossip_monitor_serve(gossip_monitor_t *m, const char *what, const char *addr, gossip_monitor_http_handler h,
                         void *ctx, int *port, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_GOSSIP_MONITOR_H */
