/*
 * ps — the parameter-server scheme: `rumor ps` (a server) and
 * `rumor peer --sync ps` (a worker).
 *
 * The flat parameter vector of P floats is cut into S contiguous ranges;
 * server I of S holds range I, [P·I/S, P·(I+1)/S), and the optimizer state
 * of that range, and applies the updates to it. For the stages of peer
 * groups (`rumor group --sync ps`), a server is for one stage s of G: the
 * vector it cuts is that stage's slice of the model (the units of the
 * group's balanced split, pipe_split_balance), and its workers are stage s
 * of every group; offsets on the wire are within that slice. A worker holds no state of
 * its own that matters: before each step it pulls the parameters from every
 * server, computes its gradient (the trainer's reducer hook), and pushes each
 * server its slice of it.
 *
 * Clocks: a worker's clock is the number of gradients it has pushed. A
 * worker at clock c (about to compute its gradient number c) is released
 * (its pull answered) when
 *   - staleness 0 (BSP): the server has applied round c-1, i.e. every live
 *     worker's gradient number c-1, as ONE update with their mean (weighted
 *     by rows), so a round equals one step of a single process on all the
 *     batches together;
 *   - staleness S > 0 (SSP): the server has this worker's gradients up to
 *     c-1 and c - min(live workers' clocks) <= S; each gradient is applied
 *     as it arrives, scaled by 1/N (N = the configured workers);
 *   - none (ASP): the server has this worker's gradients up to c-1.
 * Live workers are those connected and not done; one whose connection
 * closes, or that is silent for longer than the timeout, is dropped from
 * the bound (and re-admitted if it comes back).
 *
 * Restarts: a server saves its range, its optimizer state, its version and
 * every worker's clock to its checkpoint (a safetensors file) and resumes
 * from it. Workers redial with back-off; on reconnecting they learn the
 * server's clock for them and push their last gradient again when the
 * server lacks it. Updates applied after the server's last checkpoint, other
 * than that last gradient, are lost, as with any restart from a checkpoint.
 *
 * Wire: net/ (the cluster key, the encryption, optionally an allow-list),
 * control messages PS_MSG_* and bulk transfers with a 32-byte metadata
 * header (ps_impl.h). Servers are not gossip members.
 *
 * Threads: ps_server_run runs its loop on the calling thread. A client owns
 * a loop thread of its own; every ps_client_* function is for the training
 * thread that owns the trainer.
 */
#ifndef RUMOR_PEER_PS_H
#define RUMOR_PEER_PS_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "net/net.h"
#include "peer/train/train.h"

#define PS_MAX_SERVERS 64
#define PS_MAX_WORKERS 1024
#define PS_STALENESS_NONE (-1) /* ASP: no bound */
#define PS_PING_MS 500         /* keep-alive period, both ways */
#define PS_MIN_TIMEOUT_MS 1000 /* silence limits below this would drop live peers between pings */

/* ============================================================================
 * The server
 * ========================================================================== */

struct ps_server_config {
  /* The transport's keys; copied by net_init. */
  const struct net_identity *identity;
  const uint8_t *cluster_key;
  const struct net_allowlist *allow; /* may be NULL */
  const char *listen;                /* HOST:PORT */
  const char *model;                 /* the spec every worker must train */
  struct optim_config optim;
  uint64_t seed;           /* the initial parameters (model_init_params), as the workers' */
  int64_t schedule_steps;  /* the learning-rate schedule's length in rounds; 0: the workers' */
  int range, ranges;       /* this server holds range `range` of `ranges` */
  int stage, stages;       /* of this stage's slice (stages <= 1: of the whole model) */
  int64_t staleness;       /* 0 BSP, > 0 SSP, PS_STALENESS_NONE ASP */
  int workers;             /* N: BSP waits for N workers before the first round; SSP/ASP scale by 1/N */
  const char *checkpoint;  /* required: resumed from when present, saved to */
  int64_t checkpoint_every; /* updates between saves (also at exit); >= 1 */
  uint32_t worker_timeout_ms;    /* a worker silent this long is dropped */
  uint32_t handshake_timeout_ms; /* 0: net's default */
  uint32_t heartbeat_ms, dead_after_ms; /* net_config's, as given (0 heartbeat: none) */
  const atomic_int *stop;        /* polled; non-zero ends the run (may be NULL) */
  /* Called once listening, with the bound address and our public key (text);
   * the CLI prints its JSON line there. */
  void (*on_listen)(const char *addr, const char *id, void *arg);
  void *on_listen_arg;
};

/* What a server did, for its result line. */
struct ps_server_stats {
  int64_t version;       /* updates applied in all (BSP: rounds) */
  int64_t rounds_partial; /* BSP rounds closed early by a restart's recovery */
  uint64_t grads;        /* gradients accepted */
  uint64_t stale;        /* gradients dropped as duplicates or too old */
  uint64_t nonfinite;    /* gradients dropped as not finite */
  uint64_t pulls;        /* parameter slices sent */
  uint64_t dropped;      /* workers dropped (closed or silent) */
  int64_t max_gap;       /* largest c - min(live clocks) at a release */
  int workers_seen;
  bool resumed;          /* started from the checkpoint */
};

/* Runs a server until *stop or until every worker is done (at least one
 * said so, none is live, and --workers of them said so or were dropped).
 * Saves the checkpoint at the end. Returns 0 or
 * a negative code with a message (bad flags or checkpoint: RUMOR_EFORMAT /
 * RUMOR_ECORRUPT; a network failure to listen). `st` gets the figures. */
int ps_server_run(const struct ps_server_config *cfg, struct ps_server_stats *st,
                  struct rumor_err *e) RUMOR_MUST_CHECK;

/* Parses "I/S" (0 <= I < S <= PS_MAX_SERVERS). Returns 0 or RUMOR_EFORMAT. */
int ps_range_parse(const char *s, int *range, int *ranges, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Parses "S" (>= 0) or "none". Returns 0 or RUMOR_EFORMAT. */
int ps_staleness_parse(const char *s, int64_t *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Range `i` of `n` of P parameters: [*lo, *hi). */
void ps_range_bounds(int64_t P, int i, int n, int64_t *lo, int64_t *hi);

/* ============================================================================
 * The worker
 * ========================================================================== */

struct ps_client_config {
  const struct net_identity *identity;
  const uint8_t *cluster_key;
  const struct net_allowlist *allow; /* may be NULL */
  const char *servers;               /* "A,B,...": server I holds range I */
  enum net_dtype wire;               /* gradients and parameters on the wire */
  uint32_t server_timeout_ms;        /* a server silent this long is redialed */
  uint32_t handshake_timeout_ms;     /* 0: net's default */
  uint32_t heartbeat_ms, dead_after_ms; /* net_config's, as given (0 heartbeat: none) */
  double give_up_s;                  /* fail when a server is unreachable this long */
  const atomic_int *stop;            /* polled while waiting (may be NULL) */
};

typedef struct ps_client ps_client_t;

struct ps_client_stats {
  uint64_t pushes, pulls, repushes, reconnects;
  double wait_s;       /* in pulls: the time the staleness bound (and the network) held us */
  int64_t last_version; /* the largest server version seen in a pull */
  int64_t max_gap;     /* the largest clock gap a server reported at our release */
  uint64_t bytes_in, bytes_out; /* every byte of the client's transport (as of its last tick) */
};

/* Starts the client's loop thread and dials every server. `t` must outlive
 * the client. Returns 0 or a negative code with a message (a bad list). */
int ps_client_start(ps_client_t **out, struct trainer *t, const struct ps_client_config *cfg,
                    struct rumor_err *e) RUMOR_MUST_CHECK;
/* Waits until every server admitted us, then pulls the current parameters
 * into the trainer and takes the servers' clock for us (trainer_take_step).
 * Returns 0 or a negative code (a server refused us, the give-up time
 * passed, a stop). */
int ps_client_join(ps_client_t *c, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The train_reducer (`arg` is the client): pushes the gradient in
 * model.grads (clipped first with --grad-clip), then pulls the parameters
 * for the next step, waiting as the staleness bound says, loads them and
 * returns 1 (the trainer's own update is skipped; st.step is our clock). */
int ps_client_reduce(void *arg, int64_t rows, struct rumor_err *e);
/* Tells every connected server we are done, and closes. */
void ps_client_finish(ps_client_t *c);
void ps_client_stats_get(ps_client_t *c, struct ps_client_stats *st);
/* Stops the loop thread (closing connections) and frees. NULL is fine. */
void ps_client_free(ps_client_t *c);
/* The result line's fields of a worker: sync "ps", ps_pushes, ps_pulls,
 * ps_repushes, ps_reconnects, ps_version, ps_max_clock_gap, ps_wait_s. */
void ps_client_result(const struct ps_client_stats *st, struct json_t *o);

/* ============================================================================
 * Watching servers (rumor top --servers)
 * ========================================================================== */

struct ps_status_worker {
  char id[NET_PUBKEY_STR_LEN + 1];
  int64_t clock; /* gradients the server took from it */
  bool live, done;
};

/* One server as a monitor sees it. */
struct ps_status {
  char addr[128]; /* PS_ADDR_MAX */
  bool reachable;
  char error[200]; /* why not, when !reachable */
  int range, ranges, workers;
  int stage, stages; /* stages 1: the whole model */
  int64_t version, staleness, max_gap;
  int nw;
  struct ps_status_worker *w; /* nw entries */
  struct query *q;            /* private */
};

struct ps_status_config {
  const struct net_identity *identity; /* any identity; the cluster key admits us */
  const uint8_t *cluster_key;
  const char *servers;                 /* "A,B,..." */
  uint32_t timeout_ms;                 /* for all answers together */
};

/* Asks every server at once. Returns 0 with *out (one entry per server, in
 * list order; free with ps_status_free) and *n, or RUMOR_EFORMAT for a bad
 * list. A server that does not answer is an entry with its reason. */
int ps_status_query(const struct ps_status_config *cfg, struct ps_status **out, int *n,
                    struct rumor_err *e) RUMOR_MUST_CHECK;
void ps_status_free(struct ps_status *st, int n);

#endif /* RUMOR_PEER_PS_H */
