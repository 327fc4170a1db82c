/*
 * gossip_impl.h — the gossip runtime's private state, shared by runtime.c
 * (loop thread, connections, membership glue, join) and exchange.c (the
 * exchange and donation protocols and their slots). Not for use outside
 * gossip/.
 */
#ifndef RUMOR_GOSSIP_IMPL_H
#define RUMOR_GOSSIP_IMPL_H

#include <pthread.h>
#include <stdatomic.h>

#include "gossip/gossip.h"
#include "gossip/swim_impl.h"

/* Message types on the wire: pinned, they are the protocol. */
enum gossip_msg_type {
  GMSG_JOIN = 1,
  GMSG_JOIN_OK = 2,
  GMSG_JOIN_REJECT = 3,
  GMSG_PING = 4,
  GMSG_ACK = 5,
  GMSG_PING_REQ = 6,
  GMSG_LEAVE = 7,
  GMSG_XCH_REQ = 8,
  GMSG_XCH_ACCEPT = 9,
  GMSG_XCH_REJECT = 10,
  GMSG_STATE_REQ = 11,
  GMSG_STATE_BUSY = 12,
  GMSG_MEMBERS_REQ = 13, /* a monitor asks for the member table */
  GMSG_MEMBERS = 14,
  GMSG_STATS_REQ = 15,   /* a monitor asks for a node's figures */
  GMSG_STATS = 16,
  GMSG_PARAMS_REQ = 17,  /* a monitor asks for the parameters (exact drift) */
};
_Static_assert(GMSG_JOIN == 1 && GMSG_PING == 4 && GMSG_XCH_REQ == 8 && GMSG_STATE_BUSY == 12 &&
                   GMSG_MEMBERS_REQ == 13 && GMSG_STATS == 16 && GMSG_PARAMS_REQ == 17,
               "gossip message numbers are part of the protocol");
#define GOSSIP_PROTO_VERSION 1

/* Kinds of bulk transfer (the "k" field of the bulk metadata). */
enum { GBULK_EXCHANGE = 1, GBULK_STATE = 2, GBULK_PARAMS = 3 };

#define GOSSIP_STATS_WAITERS 64
#define GOSSIP_STATS_FRESH_MS 500   /* figures younger than this are answered at once */
#define GOSSIP_STATS_WAIT_MS 1000   /* else wait this long for the training thread */

#define GOSSIP_MAX_BOOTSTRAP 32
#define GOSSIP_LINK_QUEUE 32      /* control messages held while dialing */
#define GOSSIP_TICK_MS 20

/* Slot states (see gossip.h). The exchange slot's word also counts rounds:
 * word = round << 3 | state, and every IDLE → WANT starts a new round, so a
 * message about an earlier round (a queued snapshot_ready) is recognised as
 * stale. WANT records who asked: we (INIT) or a partner (RESP). */
enum { SLOT_IDLE = 0, SLOT_WANT = 1, SLOT_BUSY = 2, SLOT_APPLY = 3, SLOT_WANT_RESP = 4 };

/* A connection to one member, by identity. */
struct gossip_link {
  uint8_t id[NET_PUBKEY_BYTES];
  char addr[SWIM_ADDR_MAX];
  net_conn_t *conn;       /* open connection, or NULL */
  bool dialing;
  uint64_t next_dial_ms;  /* backoff after failed dials */
  uint32_t dial_failures;
  uint64_t backoff_until_ms; /* no exchanges with it before this (misbehaviour, failures) */
  uint32_t strikes;          /* rejected updates from it */
  /* Defences (guard.c): rate limits, and the newest snapshot step received
   * from it at incarnation `step_inc` (an older one is a replay). */
  struct gossip_bucket { double tokens; uint64_t last_ms; bool init; } xch_bucket, conn_bucket;
  uint64_t rl_xch, rl_conn, rl_logged_ms; /* refusals since the last log line */
  uint64_t last_step, step_inc;
  bool have_step;
  /* Messages waiting for the dial to finish (copied encodings). */
  uint8_t *queue[GOSSIP_LINK_QUEUE];
  size_t queue_len[GOSSIP_LINK_QUEUE];
  size_t nqueue;
};

/* The exchange in progress (loop thread only), if any. */
struct gossip_xch {
  bool active;
  bool initiator;
  uint64_t xid;
  uint8_t partner[NET_PUBKEY_BYTES];
  net_conn_t *conn;
  bool accepted;            /* initiator: the partner said yes */
  bool sending, receiving;  /* bulk transfers in flight */
  uint64_t send_id, recv_id;
  net_conn_t *recv_conn;    /* where the partner's buffer arrives */
  bool sent_ok, recv_ok;
  uint64_t deadline_ms, started_ms;
  uint32_t attempts;        /* partners asked for this snapshot */
  uint64_t snapshot_step;
};

#ifdef RUMOR_TESTING
enum gossip_test_attack { TEST_NONE = 0, TEST_NAN, TEST_INF, TEST_SCALE, TEST_SIGNFLIP, TEST_REPLAY, TEST_SHORT,
                          TEST_FLOOD };
struct gossip_test {
  enum gossip_test_attack attack;
  uint64_t snapshots;
  float *recorded; /* replay: the first snapshot taken after step 0 */
  uint64_t recorded_step;
  uint64_t replay_from; /* replay once this many snapshots were taken */
};
#endif

struct gossip {
  struct gossip_config cfg;
  struct cpu_list net_cpus; /* cfg.net_cpus points here when set */
  struct net_identity identity;
  uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
  char self_id_text[NET_PUBKEY_STR_LEN + 1];
  char advertise[SWIM_ADDR_MAX];
  char model[256];
  char optimizer[32];

  uv_loop_t loop;
  uv_thread_t thread;
  uv_timer_t tick;
  net_t *net;
  struct swim swim;
  struct rng rng;
  bool stopping;

  struct gossip_link *links;
  size_t nlinks, links_cap;

  /* Joining. */
  char *boot[GOSSIP_MAX_BOOTSTRAP];
  char boot_err[GOSSIP_MAX_BOOTSTRAP][160];
  size_t nboot, boot_next;
  bool join_dialing, joined, join_failed;
  uint64_t join_started_ms, join_retry_ms;
  uint32_t join_rounds;
  char join_error[1024];
  /* State pull (newcomer). */
  float *pull_buf;          /* set by gossip_join_wait */
  bool pull_wanted, pulling, pull_done, first_peer;
  uint8_t donor[NET_PUBKEY_BYTES];
  uint64_t pull_retry_ms, pull_recv_id;
  uint32_t pull_attempts;
  struct gossip_train_pos pull_pos;
  net_conn_t *pull_conn;

  /* The exchange slot: round << 3 | state (see above). */
  _Atomic uint64_t xch_word;
  float *mine, *theirs;
  struct gossip_xch xch;
  float alpha;

  /* The donation slot. */
  _Atomic int donor_state;
  float *donor_buf;
  net_conn_t *donor_conn;   /* the newcomer being served */
  uint8_t donor_to[NET_PUBKEY_BYTES];
  struct gossip_train_pos donor_pos;
  uint64_t donor_send_id;

  /* Ready to exchange and donate: joined and holding a state. Written by
   * the training thread (after join_wait), read by the loop. */
  _Atomic bool ready;
  /* Our role in the bipartite exchange graph (AD-PSGD): peers sorted by key,
   * even ranks initiate ("active"), odd ranks only answer. Two initiators
   * then never wait on each other. Written by the loop, read by training. */
  _Atomic bool active;

  /* Monitoring (stats.c). Figures published by the training thread, under
   * `lock`; STATS requests waiting for fresh ones (loop thread). */
  uint64_t sketch_seed;
  int sketch_k;
  struct gossip_peer_stats pstats;
  double *psketch;           /* sketch_k doubles, valid when have_sketch */
  bool have_stats, have_sketch;
  uint64_t stats_ms;         /* monotonic ms of the last publish */
  _Atomic bool stats_wanted;
  struct stats_waiter {
    net_conn_t *conn;
    uint64_t q; /* the request's number, echoed in the answer */
    uint64_t deadline_ms;
  } waiters[GOSSIP_STATS_WAITERS];
  size_t nwaiters;
  struct gossip_http *http;  /* the metrics endpoint, or NULL */
  /* The donation in progress is a monitor's PARAMS_REQ: set by the loop
   * before the slot turns WANT; the figures captured at the same boundary
   * (gossip_donor_done) travel with the parameters. */
  _Atomic bool donor_params_only;
  double donor_norm;
  double *donor_sketch;      /* sketch_k doubles */
  bool donor_have_sketch;

  /* Published for other threads under `lock`. */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct gossip_stats stats;
  uint64_t last_exchange_ms; /* monotonic, 0 before the first */
  struct gossip_member_view *pub;
  size_t npub, pub_cap;
#ifdef RUMOR_TESTING
  struct gossip_test test;
#endif
};

/* guard.c (loop thread): defences against misbehaving members. */
/* Counts a misbehaviour of member `id` (its parameters were rejected: `why`)
 * and keeps exchanges with it off for a backoff that doubles with each
 * strike (2 s to 256 s). */
void gossip_strike(struct gossip *g, const uint8_t *id, const char *why);
/* A clean exchange with `id`: one strike is forgiven, so an honest peer's
 * rare outlier fades while a consistent offender's backoff keeps growing. */
void gossip_forgive(struct gossip *g, const uint8_t *id);
/* Rate limits: false when member `id` is over its budget of exchange
 * requests (connections); the refusal is counted and logged now and then. */
bool gossip_guard_allow_xch(struct gossip *g, const uint8_t *id);
bool gossip_guard_allow_conn(struct gossip *g, const uint8_t *id);
/* An exchange transfer begins (bulk metadata: exchange `xid`, the partner's
 * snapshot `step`): refuses it (returns a negative code, ends the exchange
 * and strikes the partner) when its length is not the model's or its step
 * is older than one the partner already sent (a replayed round). 0: go on. */
int gossip_guard_xch_bulk(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info, uint64_t xid,
                          uint64_t step);

#ifdef RUMOR_TESTING
/* testing.c: the testing build's misbehaving member (see there). */
int gossip_testing_start(struct gossip *g, struct rumor_err *e) RUMOR_MUST_CHECK;
void gossip_testing_free(struct gossip *g);
/* Poisons our snapshot in `mine` once it is taken; may change *step. */
void gossip_testing_snapshot(struct gossip *g, uint64_t *step);
/* How many of our `count` values to send. */
uint64_t gossip_testing_send_count(struct gossip *g, uint64_t count);
void gossip_testing_tick(struct gossip *g, uint64_t now);
#endif

/* runtime.c */
uint64_t gossip_now_ms(struct gossip *g);
/* The cluster-wide count-sketch seed: a keyed hash of a fixed label under the
 * cluster key, so members and monitors agree without configuration. */
uint64_t gossip_derive_sketch_seed(const uint8_t cluster_key[NET_CLUSTER_KEY_BYTES]);
/* Splits a comma-separated address list into out[0..*n) (malloc'd; the
 * caller frees them, also on error). RUMOR_EFORMAT names a bad address. */
int gossip_split_addrs(const char *list, char **out, size_t max, size_t *n, struct rumor_err *e) RUMOR_MUST_CHECK;
struct gossip_link *gossip_link_get(struct gossip *g, const uint8_t *id, bool create);
/* Sends an encoded message to member `id` (dialing its address if needed).
 * Returns 0 or a negative code; the message may still be lost. */
int gossip_send(struct gossip *g, const uint8_t *id, struct net_msgbuf *b);
/* Picks a uniformly random ALIVE peer (not self, not backed off, not
 * `exclude`, and when `donors_only` not one that said it is still joining).
 * Returns false when there is none. */
bool gossip_pick_peer(struct gossip *g, uint8_t *out, const uint8_t *exclude, bool donors_only);
/* The same, among passive peers only (the partners an active peer asks);
 * falls back to any peer when no passive one is free. */
bool gossip_pick_partner(struct gossip *g, uint8_t *out, const uint8_t *exclude);
/* Recomputes our active/passive role from the member table. */
void gossip_update_role(struct gossip *g);
void gossip_publish(struct gossip *g);
void gossip_fail_stat(struct gossip *g, const char *why);

/* stats.c (loop thread) */
void gossip_stats_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
void gossip_stats_tick(struct gossip *g, uint64_t now);
void gossip_stats_on_close(struct gossip *g, net_conn_t *c);
/* Starts the metrics endpoint on cfg.metrics. */
int gossip_metrics_start(struct gossip *g, struct rumor_err *e);
void gossip_metrics_stop(struct gossip *g);
void gossip_put_updates(struct net_msgbuf *b, const struct swim_update *u, size_t n);
/* Decodes and validates the array of updates under `key` (absent: zero).
 * Returns the count, or RUMOR_EPROTO for anything malformed or more than max. */
int gossip_get_updates(const struct net_msg *m, const char *key, struct swim_update *out, size_t max);

/* http.c: a minimal HTTP/1.0 server for GET requests on a libuv loop. The
 * handler fills *body (malloc'd, the server frees it) and returns the status
 * code. Loop thread only. */
struct gossip_http;
typedef int (*gossip_http_handler)(void *ctx, const char *path, char **body, size_t *len, const char **type);
int gossip_http_start(uv_loop_t *loop, const char *addr, gossip_http_handler h, void *ctx, struct gossip_http **out,
                      struct rumor_err *e) RUMOR_MUST_CHECK;
int gossip_http_port(const struct gossip_http *h);
/* Closes the listener and every client; frees `h` once all handles closed. */
void gossip_http_stop(struct gossip_http *h);

/* exchange.c (loop thread unless stated) */
void gossip_xch_on_snapshot_ready(net_t *n, void *arg, int status);
void gossip_xch_on_applied(net_t *n, void *arg, int status);
void gossip_xch_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
int gossip_xch_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                             uint64_t kind, uint64_t xid, float **dst);
void gossip_xch_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status);
void gossip_xch_tick(struct gossip *g, uint64_t now);
void gossip_xch_on_close(struct gossip *g, net_conn_t *c);
void gossip_xch_abandon(struct gossip *g, const char *why);
/* Ends the exchange in progress because the partner's transfer is refused
 * (`why`): nothing applied, the partner told, counted as rejected. */
void gossip_xch_refuse(struct gossip *g, const char *why);
void gossip_donor_on_ready(net_t *n, void *arg, int status);
void gossip_pull_tick(struct gossip *g, uint64_t now);
void gossip_pull_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);

#endif /* RUMOR_GOSSIP_IMPL_H */
