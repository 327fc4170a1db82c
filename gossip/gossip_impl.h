/*
 * gossip_impl.h — the gossip runtime's insides, private to gossip/.
 *
 * struct gossip is split by concern; each part is owned (written) by one
 * file, and the other files reach it through that file's functions below:
 *
 *   core        runtime.c   configuration, identity, the event loop and its
 *                           thread, the net, SWIM, start and stop, and the
 *                           dispatch of every net callback to the parts
 *   links       links.c     one connection per member identity, dialing and
 *                           queueing, neighbour choice
 *   guard       guard.c     defences per member: strikes and backoff, rate
 *                           limits, the replay check of exchange transfers
 *   join        join.c      the bootstrap list, JOIN, and a newcomer's state
 *                           pull
 *   exchange    exchange.c  the exchange slot and the exchange in progress
 *   donation    donation.c  the donation slot: states for newcomers,
 *                           parameters for monitors
 *   monitoring  stats.c     figures published by training, counters, the
 *                           member view, STATS requests, /metrics
 *
 * wire.c holds the codecs both the runtime and the monitor (monitor.c) use;
 * http.c the metrics endpoint's server; testing.c the testing build's
 * attacks (RUMOR_TESTING only).
 *
 * Threads: everything here runs on the loop thread unless a function says
 * "training thread" or "any thread". `lock` guards what other threads read:
 * the join flags, the published figures, counters and member view.
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
  GMSG_RING_READY = 18,  /* all-reduce: ready to receive round {step, ring} from our predecessor */
  GMSG_RING_AHEAD = 19,  /* all-reduce: your round's step is done here; we are at "step" */
  GMSG_RING_ABORT = 20,  /* all-reduce: round {step, ring} failed; nothing of it is applied */
  GMSG_REACH = 21,       /* a bootstrap node dialed a joiner back: {ok, addr, why} */
};
_Static_assert(GMSG_JOIN == 1 && GMSG_PING == 4 && GMSG_XCH_REQ == 8 && GMSG_STATE_BUSY == 12 &&
                   GMSG_MEMBERS_REQ == 13 && GMSG_STATS == 16 && GMSG_PARAMS_REQ == 17 &&
                   GMSG_RING_READY == 18 && GMSG_RING_ABORT == 20,
               "gossip message numbers are part of the protocol");
#define GOSSIP_PROTO_VERSION 1

/* Kinds of bulk transfer (the "k" field of the bulk metadata). */
enum { GBULK_EXCHANGE = 1, GBULK_STATE = 2, GBULK_PARAMS = 3, GBULK_RING = 4 };
/* The exchange id ("x") in the metadata of a bulk that belongs to no
 * exchange (a donation): every bulk carries one, only GBULK_EXCHANGE reads it. */
#define GBULK_NO_EXCHANGE_ID UINT64_C(0)

#define GOSSIP_STATS_WAITERS 64
#define GOSSIP_STATS_FRESH_MS 500   /* figures younger than this are answered at once */
#define GOSSIP_STATS_WAIT_MS 1000   /* else wait this long for the training thread */

#define GOSSIP_MAX_BOOTSTRAP 32
#define GOSSIP_LINK_QUEUE 32      /* control messages held while dialing */
/* A connection retired after a simultaneous dial (links.c, link_take) is
 * closed after this long without traffic: longer than any silence inside an
 * exchange or pull started on it in the moment before both ends agreed. */
#define GOSSIP_LINK_RETIRE_MS 30000
#define GOSSIP_TICK_MS 20
/* A pull for a later step (a ring member rejoining: sync_ring_rejoin) ends
 * after this many members said they are not that far: a ring's members are
 * at one round, one asked after another costs a round trip each (a large
 * cluster on a slow network would wait seconds to start), and a member
 * that is further still tells us in the ring (RING_AHEAD). */
#define GOSSIP_PULL_BEHIND_ENOUGH 3
/* gossip_state_pull_ahead gives up (keeps our own state) after this long. */
#define GOSSIP_PULL_OPTIONAL_MS 10000

/* Slot states (gossip.h). The exchange slot's word also counts rounds:
 * word = round << 3 | state, and every IDLE → WANT starts a new round, so a
 * message about an earlier round (a queued snapshot_ready) is recognised as
 * stale. WANT records who asked: we (INIT) or a partner (RESP).
 *
 * Between exchanges the training thread keeps a snapshot ready in `mine`:
 * IDLE or READY → WRITING (it copies its parameters at a step boundary) →
 * READY. A partner's request takes a READY snapshot at once (READY → BUSY,
 * a new round) instead of waiting for our next step boundary; one that
 * comes during the copy turns WRITING into WANT_RESP, and the end of the
 * copy hands it over (WANT_RESP → BUSY). Training thread: → WRITING, → READY,
 * WANT → and APPLY →; loop thread: the rest. */
enum {
  SLOT_IDLE = 0,
  SLOT_WANT = 1,
  SLOT_BUSY = 2,
  SLOT_APPLY = 3,
  SLOT_WANT_RESP = 4,
  SLOT_WRITING = 5,
  SLOT_READY = 6
};

/* ---- links (links.c) ---- */

/* A connection to one member, by identity. */
struct gossip_link {
  uint8_t id[NET_PUBKEY_BYTES];
  char addr[SWIM_ADDR_MAX];
  net_conn_t *conn;       /* open connection, or NULL */
  bool dialing;
  uint64_t next_dial_ms;  /* backoff after failed dials */
  uint32_t dial_failures;
  /* Dials to move the link off a relay (links.c, go_direct): one under way,
   * and those that failed since the link last took a relayed connection. */
  bool direct_dial;
  uint32_t direct_failures;
  /* Messages waiting for the dial to finish (copied encodings). */
  uint8_t *queue[GOSSIP_LINK_QUEUE];
  size_t queue_len[GOSSIP_LINK_QUEUE];
  size_t nqueue;
};

struct gossip_links {
  struct gossip_link *v;
  size_t n, cap;
};

/* ---- guard (guard.c) ---- */

/* A token bucket: `rate` tokens a second, holding at most 2·rate (at least
 * one). */
struct gossip_bucket {
  double tokens;
  uint64_t last_ms;
  bool init;
};

/* What the guard knows of one member. */
struct gossip_guard_entry {
  uint8_t id[NET_PUBKEY_BYTES];
  uint64_t backoff_until_ms; /* no exchanges (or donations asked) with it before this */
  uint32_t strikes;          /* rejected updates from it, less forgiven ones */
  struct gossip_bucket xch_bucket, conn_bucket;
  uint64_t rl_xch, rl_conn, rl_logged_ms; /* refusals since the last log line */
  /* The newest snapshot step received from it at incarnation `step_inc`
   * (an older one is a replay). */
  uint64_t last_step, step_inc;
  bool have_step;
  /* It finished training and lingers (gossip_finished): its own exchange
   * transfer said so, or a partner's listed it; cleared when it comes back
   * after failing or leaving, or when its own transfer is not marked done.
   * Counted only while we linger ourselves. */
  bool finished;
};

struct gossip_guard {
  struct gossip_guard_entry *v;
  size_t n, cap;
};

/* ---- join (join.c) ---- */

/* A member that cannot accept connections (relay.c). Loop thread. */
struct gossip_relay {
  bool needed;             /* we are reached through a relay (--no-inbound, or REACH said so) */
  bool registered, pending;
  char via[SWIM_ADDR_MAX];    /* the relay we are registered with */
  char trying[SWIM_ADDR_MAX]; /* the candidate asked last */
  size_t next;             /* round-robin over the candidates */
  uint64_t retry_ms;
  bool none_logged;        /* said once that no candidate is left */
  /* Candidates that refused (not relays), skipped for a while. */
#define GOSSIP_RELAY_REFUSED 8
  char refused[GOSSIP_RELAY_REFUSED][SWIM_ADDR_MAX];
  uint64_t refused_until[GOSSIP_RELAY_REFUSED];
  size_t refused_next;
};

struct gossip_join {
  char *boot[GOSSIP_MAX_BOOTSTRAP];
  char boot_err[GOSSIP_MAX_BOOTSTRAP][160];
  size_t nboot, boot_next;
  bool dialing;
  bool joined, failed; /* under lock: the training thread waits on them */
  uint64_t started_ms, retry_ms;
  uint32_t rounds;
  char error[1024];    /* under lock, once failed */
  /* The newcomer's state pull. pull_buf and pull_wanted are set by the
   * training thread (gossip_join_wait), pull_done and first_peer read by it:
   * all under lock. */
  float *pull_buf;
  bool pull_wanted, pull_done, first_peer;
  bool pulling;
  bool req_queued; /* the request waited in the donor's link queue for a dial (gossip_join_on_link_lost) */
  uint8_t donor[NET_PUBKEY_BYTES];
  uint64_t pull_retry_ms, pull_recv_id;
  uint32_t pull_attempts;
  struct gossip_train_pos pull_pos;
  net_conn_t *pull_conn;
  uint64_t pull_begin_ns; /* monotonic: when the donor's transfer began (its BEGIN arrived) */
  /* A later pull (gossip_state_pull): the donor to ask first, if alive;
   * later: one was asked for, so a state of our own exists to keep (loop
   * thread; for the messages). */
  uint8_t prefer[NET_PUBKEY_BYTES];
  bool have_prefer, later;
  uint64_t min_step; /* the step a donor must have reached (0: any); sent in STATE_REQ as "min" */
  bool optional;     /* gossip_state_pull_ahead: after GOSSIP_PULL_OPTIONAL_MS, keep our own */
  /* Members that answered this pull (min_step > 0) that they are before
   * min_step: once every donor we could ask has, or GOSSIP_PULL_BEHIND_ENOUGH
   * of them, nobody is ahead of us as far as we know and the pull ends
   * (pull_tick). nbehind ids, room for behind_cap. */
  uint8_t (*behind)[NET_PUBKEY_BYTES];
  size_t nbehind, behind_cap;
};

/* ---- exchange (exchange.c) ---- */

/* The exchange in progress, if any. */
struct gossip_xch {
  bool active;
  bool initiator;
  uint64_t xid;
  uint8_t partner[NET_PUBKEY_BYTES];
  net_conn_t *conn;
  bool accepted;            /* initiator: the partner said yes */
  bool from_ready;          /* responder: answered with the snapshot kept ready */
  bool sending, receiving;  /* bulk transfers in flight */
  uint64_t send_id, recv_id;
  uint64_t recv_bytes;      /* the partner's transfer on the wire (its dtype's encoded size), from its BEGIN */
  net_conn_t *recv_conn;    /* where the partner's buffer arrives */
  bool sent_ok, recv_ok;
  uint64_t deadline_ms, started_ms;
  uint32_t attempts;        /* partners asked for this snapshot */
  bool queued;              /* initiator: the request waits in the link's queue for a dial (gossip_send) */
  uint64_t snapshot_step;
};

struct gossip_exchange {
  _Atomic uint64_t word; /* the slot: round << 3 | state (above) */
  float *mine, *theirs;  /* the caller's buffers (gossip_config) */
  _Atomic uint64_t ready_step; /* the step of the snapshot in `mine` (WRITING → READY) */
  float alpha;
  struct gossip_xch x;
  /* Written by a worker thread while the slot is BUSY after the transfers
   * (x inactive), read by the training thread while it is APPLY. */
  struct gossip_xch_delta delta;
};

/* ---- delta.c ---- */

/* theirs[i] ← theirs[i] − mine[i] for i < n, in one pass, with the
 * statistics of the difference in *out. Any thread. */
void gossip_delta(float *restrict theirs, const float *restrict mine, uint64_t n, struct gossip_xch_delta *out);

/* ---- donation (donation.c) ---- */

struct gossip_donation {
  _Atomic int state;        /* the slot: SLOT_IDLE, SLOT_WANT, SLOT_BUSY */
  float *buf;               /* the caller's buffer (gossip_config.donor_buf) */
  net_conn_t *conn;         /* the newcomer or monitor being served */
  uint8_t to[NET_PUBKEY_BYTES];
  struct gossip_train_pos pos;
  uint64_t send_id;
  /* The donation in progress is a monitor's PARAMS_REQ: set before the slot
   * turns WANT; the figures captured at the same boundary
   * (gossip_donor_done) travel with the parameters. */
  _Atomic bool params_only;
  /* The request named a "min" step (gossip_state_pull: a ring member left
   * behind or rejoining), not a newcomer's join; set with params_only. */
  _Atomic bool catch_up;
  double norm;
  double *sketch;           /* sketch_k doubles */
  bool have_sketch;
};

/* ---- all-reduce (ring.c) ---- */

#define RING_MAX_MEMBERS 1024
#define RING_PIECE_FLOATS (1u << 20) /* at most this many floats per transfer (4 MiB in f32) */
#define RING_READY_MAX 1024         /* READY messages remembered (the newest per member) */
#define RING_HELD_MAX 16            /* testing build: last-phase deliveries held back at once */
/* While nothing of the predecessor's has arrived, our RING_READY is sent
 * again this often: a READY queued on a link whose dial failed, or on a
 * connection closed under it, is lost, and the predecessor would wait for
 * it until the round's deadline (exchange_timeout_ms); and a predecessor
 * whose attempt failed spent ours (gossip_ring_spend_ready) and waits for
 * it again. */
#define RING_READY_RESEND_MS 250
#define RING_STALE_READY_MAX 4 /* stale successor READYs one attempt outlives (gossip_ring_piece_refused) */
#define RING_REFUSED_WAIT_MS 1000 /* then, for the successor's current READY: 4 of its repetitions */
#define RING_PATH_MIN_SEGS 1000 /* fewer segments sent in a window: too few to judge the link by */

/* What a round moves (gossip.h): a reduce round sums `count` floats
 * (reduce-scatter then all-gather, 2(n−1) phases); a gather round collects
 * every member's block of ag_words words (all-gather only, n−1 phases). */
enum ring_kind { RING_REDUCE = 0, RING_GATHER = 1 };

/* One transfer of a round: phase p (0 .. phases − 1), piece j. */
struct ring_io {
  uint8_t state; /* RING_IO_* */
  uint64_t id;
  net_conn_t *conn;
};
enum { RING_IO_NONE = 0, RING_IO_BUSY = 1, RING_IO_DONE = 2 };

/* What a member said in its latest RING_READY. */
struct ring_ready {
  uint8_t id[NET_PUBKEY_BYTES];
  uint64_t step, hash, nonce;
  bool answered; /* told RING_AHEAD for this READY */
  bool spent;    /* a failed attempt sent on it (gossip_ring_spend_ready): not taken again */
};

struct gossip_ring {
  float *acc, *out;  /* the caller's buffers (xch_mine, xch_theirs): count floats each */
  uint64_t count;    /* nparams + 1 */
  /* Gather rounds: our block (ag_words = gather_floats words, the training
   * thread's gossip_ag_buf; NULL when 0) and the result, n blocks in ring
   * order (ag_cap words), grown on the loop thread when a round starts. */
  float *ag_mine, *ag_out;
  uint64_t ag_words, ag_cap;
  /* The round in progress (loop thread). */
  uint8_t kind;      /* enum ring_kind */
  bool active, failing;
  uint64_t gen;      /* rounds started: tells a stale callback from the current round's */
  uint64_t step, hash;
  uint8_t (*ids)[NET_PUBKEY_BYTES];    /* the ring, in ring order (ring.c, view_ring) */
  uint8_t (*sorted)[NET_PUBKEY_BYTES]; /* the same n keys sorted, for lookups */
  size_t n, me;
  uint64_t nonce;      /* this attempt's, in our RING_READY: pieces for another attempt are refused */
  uint64_t succ_nonce; /* the successor's attempt, from its RING_READY */
  uint32_t pieces;   /* per segment */
  struct ring_io *recv, *send; /* 2(n−1)·pieces each */
  uint32_t recv_left, send_left, inflight;
  bool cancelling;
  bool succ_ready;
  net_conn_t *send_conn;
  uint64_t started_ms, deadline_ms;
  uint64_t ready_sent_ms; /* when our RING_READY of this attempt last went out */
  bool heard_pred;        /* a piece of the predecessor's began arriving in this attempt */
  uint32_t ready_sends;   /* our RING_READYs of this attempt so far */
  /* Refused pieces (gossip_ring_piece_refused): pieces of ours the
   * successor confirmed in this attempt, and its READYs we found stale. */
  uint32_t delivered, stale_readies;
  uint64_t refused_ms; /* when a refusal spent the successor's READY (0: no such wait) */
  uint64_t stale_told; /* the last stale nonce a predecessor sent on, answered with our READY again */
  char why[200];
  /* Between rounds (loop thread). */
  uint64_t pos;      /* steps this member has completed, as far as the loop knows */
  size_t done_members; /* the ring's size in the last round done (logged when it changes) */
  uint8_t (*done_ids)[NET_PUBKEY_BYTES]; /* that ring's keys (done_members of them; NULL before the first) */
  /* Quorum (gossip_config.quorum_wait_ms): the round in progress waits for
   * a majority of done_ids in view before its first READY; since when
   * (kept across attempts until one has its majority; 0: not waiting). */
  bool awaiting_quorum;
  uint64_t quorum_since_ms;
  uint8_t ahead_id[NET_PUBKEY_BYTES];
  uint64_t ahead_step; /* the highest step another member said it had reached (0: none) */
  /* Our link to the successor ("Sitting out"): the connection watched, its
   * kernel counters when the window began, and when that was. */
  const net_conn_t *path_conn;
  struct net_tcp_path path_at;
  uint64_t path_since_ms;
  /* The advice for the training thread (under lock): sit out, and why. */
  bool sit_out;
  char sit_out_why[200];
  struct ring_ready *readies;
  size_t nreadies;
  /* Shared with the training thread, under lock. */
  int status;          /* enum gossip_ar_status */
  struct gossip_ar_info info;
  /* The last gather round's result, set when it ends DONE (ag_out, its
   * ring's size and our index) and cleared when the next round starts. */
  const float *ag_result;
  size_t ag_members, ag_self;
#ifdef RUMOR_TESTING
  /* slowconfirm: deliveries of our last-phase pieces, taken once due_ms
   * passes (gossip_ring_tick); each still counts in `inflight`. */
  struct ring_held {
    uint64_t gen, id, due_ms;
    uint32_t k;
  } held[RING_HELD_MAX];
  size_t nheld;
#endif
};

/* ---- monitoring (stats.c) ---- */

struct stats_waiter {
  net_conn_t *conn;
  uint64_t q; /* the request's number, echoed in the answer */
  uint64_t deadline_ms;
};

struct gossip_monitoring {
  uint64_t sketch_seed;
  int sketch_k;
  /* Figures published by the training thread, under lock. */
  struct gossip_peer_stats pstats;
  double *psketch;           /* sketch_k doubles, valid when have_sketch */
  bool have_stats, have_sketch;
  uint64_t stats_ms;         /* monotonic ms of the last publish */
  uint64_t sketch_ms;        /* monotonic ms of the last publish with a sketch (and norm) */
  _Atomic bool wanted;       /* a monitor asked for fresh figures */
  struct stats_waiter waiters[GOSSIP_STATS_WAITERS]; /* STATS requests waiting for them */
  size_t nwaiters;
  struct gossip_http *http;  /* the metrics endpoint, or NULL */
  /* For other threads, under lock. */
  struct gossip_stats counters;
  uint64_t last_exchange_ms; /* monotonic, 0 before the first */
  struct gossip_member_view *pub;
  size_t npub, pub_cap;
};

#ifdef RUMOR_TESTING
enum gossip_test_attack { TEST_NONE = 0, TEST_NAN, TEST_INF, TEST_SCALE, TEST_SIGNFLIP, TEST_REPLAY, TEST_SHORT,
                          TEST_FLOOD, TEST_LOSE_READY, TEST_BAD_DONOR, TEST_BAD_FIN, TEST_FREEZE, TEST_FREEZE_XCH,
                          TEST_SLOW_CONFIRM, TEST_NAN_GRAD, TEST_STALE_READY };
struct gossip_test {
  enum gossip_test_attack attack;
  uint64_t snapshots;
  float *recorded; /* replay: the first snapshot taken after step 0 */
  float *out;      /* the poisoned copy of our snapshot that is sent (NULL: none) */
  uint64_t recorded_step;
  uint64_t replay_from; /* replay once this many snapshots were taken */
  bool frozen;          /* freeze, freezexch: stopped once already */
};
#endif

struct gossip {
  /* The core (runtime.c). */
  struct gossip_config cfg;
  struct cpu_list net_cpus; /* cfg.net_cpus points here when set */
  struct net_identity identity;
  uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
  char self_id_text[NET_PUBKEY_STR_LEN + 1];
  char advertise[SWIM_ADDR_MAX];
  char model[GOSSIP_LABEL_MAX + 1];
  char optimizer[32];
  char scheme[16]; /* cfg.scheme, or the protocol's name */
  uv_loop_t loop;
  uv_thread_t thread;
  uv_timer_t tick;
  net_t *net;
  struct swim swim;
  struct rng rng;
  bool stopping;
  /* Our own stalls (loop time, ms): when the last tick ran, and until when
   * connections cut by others are taken as their verdicts on us, not as
   * evidence against them (runtime.c, on_tick and on_close). */
  uint64_t last_tick_ms, stalled_until_ms;
  /* After a cut of ours (SWIM holds quiet verdicts): when we last asked a
   * member for its table, and whom (runtime.c, ask_table_after_cut). */
  uint64_t table_asked_ms;
  uint8_t table_asked_of[NET_PUBKEY_BYTES];
  uint64_t quiet_noted; /* swim.quieted when last logged (runtime.c, note_quiet) */
  /* Holding a state: the training thread sets it after joining and
   * building its model (gossip_ready); from then on we exchange and donate. */
  _Atomic bool ready;
  /* Our role in the bipartite exchange graph (AD-PSGD): peers sorted by key,
   * even ranks initiate ("active"), odd ranks only answer. Two initiators
   * then never wait on each other. Written by links.c, read by training. */
  _Atomic bool active;
  /* The training thread took its last step (gossip_finished): our exchange
   * transfers are marked done from then on. */
  _Atomic bool finished;
  pthread_mutex_t lock;
  pthread_cond_t cond; /* broadcast when a join flag changes */

  struct gossip_links links;
  uint32_t link_retire_ms; /* GOSSIP_LINK_RETIRE_MS (tests shorten it) */
  struct gossip_guard guard;
  struct gossip_join join;
  struct gossip_exchange xch;
  struct gossip_donation don;
  struct gossip_ring ring;
  struct gossip_relay relay;
  struct gossip_monitoring mon;
#ifdef RUMOR_TESTING
  struct gossip_test test;
#endif
};

/* ---- runtime.c ---- */

uint64_t gossip_now_ms(struct gossip *g);
/* "127.0.0.1:4000 (AbCdEf12)": how log lines name a member. */
void gossip_member_label(struct gossip *g, const uint8_t *id, char *buf, size_t n);

/* ---- wire.c: codecs shared with the monitor (any thread) ---- */

/* The cluster-wide count-sketch seed: a keyed hash of a fixed label under the
 * cluster key, so members and monitors agree without configuration. */
uint64_t gossip_derive_sketch_seed(const uint8_t cluster_key[NET_CLUSTER_KEY_BYTES]);
/* Splits a comma-separated address list (--bootstrap) into out[0..*n)
 * (malloc'd; the caller frees them, also on error). NULL or "" is no list.
 * Every entry must pass net_addr_check_dial; RUMOR_EFORMAT names the flag
 * and the bad entry. */
int gossip_split_addrs(const char *list, char **out, size_t max, size_t *n, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Sends a request of `type` numbered `q` (STATS_REQ, MEMBERS_REQ,
 * PARAMS_REQ: the answer echoes "q") on `c`: 0 or the send's error. */
int gossip_send_request(net_conn_t *c, uint64_t type, uint64_t q);
/* Member updates travel under "u" as an array of [id (bin 32), addr (str),
 * role, state, incarnation, ready (bool)]. */
void gossip_put_updates(struct net_msgbuf *b, const struct swim_update *u, size_t n);
/* Decodes and validates the array of updates under `key` (absent: zero).
 * Returns the count, or RUMOR_EPROTO for anything malformed or more than max;
 * never trusts a length or enum from the wire. */
int gossip_get_updates(const struct net_msg *m, const char *key, struct swim_update *out, size_t max);
/* True when s[0..n) is printable ASCII without spaces. */
bool gossip_printable(const char *s, size_t n);

/* ---- links.c ---- */

void gossip_links_free(struct gossip *g);
struct gossip_link *gossip_link_get(struct gossip *g, const uint8_t *id, bool create);
/* Uses `c`, a connection authenticated as member `id`, for that member
 * unless it has one open already; messages queued for the member go out on
 * it then. */
void gossip_link_adopt(struct gossip *g, const uint8_t *id, net_conn_t *c);
/* `c` closed: forgets it. Returns the member it served, or NULL. */
const uint8_t *gossip_link_forget(struct gossip *g, net_conn_t *c);
/* A member's address or state changed (from SWIM): a new address is dialed
 * afresh; a member gone (failed or left) has its connection closed. */
void gossip_link_on_member(struct gossip *g, const struct swim_update *m, bool gone);
/* Sends an encoded message to member `id` (dialing its address if needed).
 * Returns 0 or a negative code; the message may still be lost. With no
 * connection open the message waits in the link's queue for a dial; a
 * full queue (GOSSIP_LINK_QUEUE messages) refuses it with -ENOBUFS, and
 * nothing is queued. -EHOSTUNREACH: the member's address is unknown. A
 * message queued for a dial that fails is lost with the link's queue, and
 * gossip_on_link_lost says so; that may happen within this call (the dial
 * cannot start: then this message's loss is also the returned error).
 * Callers treat any error as the message lost: one that resends on a timer
 * anyway (the ring's READY, SWIM's probes) need not act on it. */
int gossip_send(struct gossip *g, const uint8_t *id, struct net_msgbuf *b);
/* True when the link to member `id` has an open connection: a message sent
 * now goes out on it, not into the queue of a dial. */
bool gossip_link_open(struct gossip *g, const uint8_t *id);
/* Dials, once its backoff ends, for a link whose messages wait in its queue
 * with no dial under way (they were queued during the backoff). */
void gossip_links_tick(struct gossip *g, uint64_t now);
/* runtime.c: the messages queued on the link to member `id` were dropped
 * because its dial failed (`why`): dispatched to the parts that wait for
 * an answer to one of them. */
void gossip_on_link_lost(struct gossip *g, const uint8_t *id, const char *why);
/* The open connection to member `id`, or NULL after starting a dial to it
 * (when none is under way and its backoff allows). */
net_conn_t *gossip_link_conn(struct gossip *g, const uint8_t *id);
/* True while a message to member `id` would wait out a dial backoff: no
 * connection is open and its last dial failed (or could not start) less
 * than its backoff ago. `now` in loop milliseconds (gossip_now_ms). */
bool gossip_link_dial_backed_off(struct gossip *g, const uint8_t *id, uint64_t now);
/* Picks a uniformly random ALIVE peer (not self, not backed off, not
 * `exclude`, and when `donors_only` not one that said it is still joining).
 * One whose link is in a dial backoff (gossip_link_dial_backed_off) is
 * picked only when no other qualifies. Returns false when there is none. */
bool gossip_pick_peer(struct gossip *g, uint8_t *out, const uint8_t *exclude, bool donors_only);
/* The ready, alive, reachable peers a state pull could ask, less the
 * `nskip` in `skip` (backoffs aside: a member backed off is asked later). */
size_t gossip_count_donors(struct gossip *g, const uint8_t (*skip)[NET_PUBKEY_BYTES], size_t nskip);
/* The same, among passive peers only (the partners an active peer asks);
 * falls back to any peer when no passive one is free. Once we finished
 * (gossip_finished), partners not known to have finished come first.
 * Members in a dial backoff come after all of those. */
bool gossip_pick_partner(struct gossip *g, uint8_t *out, const uint8_t *exclude);
/* Recomputes our active/passive role from the member table. */
void gossip_update_role(struct gossip *g);

/* ---- guard.c ---- */

/* Takes a token from `b` at time now_ms; false when it is empty. `rate` 0
 * means no limit. Pure: for tests as well. */
bool gossip_bucket_take(struct gossip_bucket *b, uint64_t now_ms, double rate);
void gossip_guard_free(struct gossip *g);
/* Counts a misbehaviour of member `id` (its parameters were rejected: `why`)
 * and keeps exchanges with it off for a backoff that doubles with each
 * strike (2 s to 256 s). */
void gossip_strike(struct gossip *g, const uint8_t *id, const char *why, uint64_t now);
/* A clean exchange with `id`: one strike is forgiven, so an honest peer's
 * rare outlier fades while a consistent offender's backoff keeps growing. */
void gossip_forgive(struct gossip *g, const uint8_t *id);
/* Strikes so far against `id` (0 for a member never struck). */
uint32_t gossip_strikes(struct gossip *g, const uint8_t *id);
/* True while exchanges with `id` are off. */
bool gossip_backed_off(struct gossip *g, const uint8_t *id, uint64_t now);
/* Keeps `id` off until `until_ms` at least (a busy or slow donor). */
void gossip_back_off(struct gossip *g, const uint8_t *id, uint64_t until_ms);
/* `id` came back (alive after failed or left): its backoff ends, and it is
 * no longer taken as finished. */
void gossip_guard_on_return(struct gossip *g, const uint8_t *id);
/* `id` finished training (or, false: its own transfer was not marked
 * done). Returns true when that changes what we know (the caller then
 * republishes the member view). */
bool gossip_guard_note_finished(struct gossip *g, const uint8_t *id, bool finished);
/* True when `id` is known to have finished (gossip_guard_note_finished). */
bool gossip_guard_finished(struct gossip *g, const uint8_t *id);
/* Rate limits: false when member `id` is over its budget of exchange
 * requests (connections); the refusal is counted and logged now and then. */
bool gossip_guard_allow_xch(struct gossip *g, const uint8_t *id, uint64_t now);
bool gossip_guard_allow_conn(struct gossip *g, const uint8_t *id, uint64_t now);
/* The verdict on an exchange transfer from partner `id` about to begin:
 * `count` values of the partner's snapshot of `step`. True to take it; false
 * with the reason in why[0..n) when its length is not the model's or its
 * step is older than one the partner already sent at its current
 * incarnation (a replayed round). The caller refuses it and strikes. */
bool gossip_guard_check_transfer(struct gossip *g, const uint8_t *id, uint64_t count, uint64_t step, char *why,
                                 size_t n);

/* ---- join.c ---- */

int gossip_join_init(struct gossip *g, const char *bootstrap, struct rumor_err *e) RUMOR_MUST_CHECK;
void gossip_join_free(struct gossip *g);
/* True once we are a member (loop thread). */
bool gossip_joined(struct gossip *g);
/* True while the training thread waits for a state it asked for with
 * gossip_state_pull (catching up): it serves no donation until then (loop
 * thread). */
bool gossip_join_pulling(struct gossip *g);
void gossip_join_tick(struct gossip *g, uint64_t now);
/* relay.c: registering with a relay when we cannot be dialed. */
void gossip_relay_tick(struct gossip *g, uint64_t now);
void gossip_relay_dial_back(struct gossip *g, const uint8_t *id, const char *addr);
void gossip_relay_on_reach(struct gossip *g, net_conn_t *c, const struct net_msg *m);
/* JOIN, JOIN_OK, JOIN_REJECT and STATE_BUSY. */
void gossip_join_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
/* Applies the member table in `m` (key "u": a JOIN reply, a MEMBERS answer)
 * to SWIM; false, with `what` logged as malformed and the connection
 * closed, when it does not parse. */
bool gossip_take_table(struct gossip *g, net_conn_t *c, const struct net_msg *m, const char *what);
/* The donor's state transfer begins (position from its metadata): returns 0
 * with *dst set, or a negative code to refuse it. */
int gossip_join_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                              const struct gossip_train_pos *pos, float **dst);
/* A transfer ended: true when it was the pull's. */
bool gossip_join_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status);
/* Connection `c` closed with `status`: a pull receiving on it, or waiting
 * for the donor's answer when it was cut (not closed gracefully), asks
 * another member at once. */
void gossip_join_on_close(struct gossip *g, net_conn_t *c, int status);
/* Member `id` failed or left: a pull from it moves on. */
void gossip_join_on_member_gone(struct gossip *g, const uint8_t *id, bool left);
/* The link to member `id` dropped its queue, its dial having failed
 * (`why`): a state request to it that waited there is lost, and the pull
 * asks again 200 ms later (another member, or this one at its next
 * address). */
void gossip_join_on_link_lost(struct gossip *g, const uint8_t *id, const char *why);
/* Wakes the training thread's waits (a stop). Any thread. */
void gossip_join_wake(struct gossip *g);

/* ---- exchange.c ---- */

void gossip_xch_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
/* The partner's exchange transfer begins (exchange `xid`, its snapshot of
 * `step`, the rest of its metadata in `meta`: what it says of finished
 * members, below): returns 0 with *dst set, or a negative code to refuse it
 * (a refusal on the guard's verdict ends the exchange and strikes the
 * partner). */
int gossip_xch_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                             const struct net_msg *meta, uint64_t xid, uint64_t step, float **dst);
/* A transfer ended: true when it was the exchange's. */
bool gossip_xch_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status);
void gossip_xch_tick(struct gossip *g, uint64_t now);
/* Connection `c` closed; `link_id`: the member whose link it was (the one
 * our requests go out on), or NULL. */
void gossip_xch_on_close(struct gossip *g, net_conn_t *c, const uint8_t *link_id);
/* The link to member `id` dropped its queue, its dial having failed
 * (`why`): a request of ours that waited there is lost, and another partner
 * is asked at once. */
void gossip_xch_on_link_lost(struct gossip *g, const uint8_t *id, const char *why);
/* Member `id` is gone or its connection broke (`why`): an exchange with it
 * is abandoned, nothing applied. */
void gossip_xch_on_member_lost(struct gossip *g, const uint8_t *id, const char *why);
/* Ends the exchange in progress, nothing applied (shutting down). */
void gossip_xch_abandon(struct gossip *g, const char *why);

/* ---- ring.c: all-reduce ---- */

/* Sets the ring up from the configuration; a gather block larger than
 * GOSSIP_GATHER_MAX_FLOATS, or one without GOSSIP_SYNC_ALLREDUCE, is refused
 * with a message. */
int gossip_ring_init(struct gossip *g, struct rumor_err *e) RUMOR_MUST_CHECK;
void gossip_ring_free(struct gossip *g);
/* RING_READY, RING_AHEAD and RING_ABORT. */
void gossip_ring_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
/* `from` said it has completed `step` steps: in a RING_AHEAD (`ready`
 * false), or in a RING_READY (`ready` true; only one for pos + 2 or later
 * counts: it completed a round we never took part in). Notes the furthest
 * member ahead (ahead_step, ahead_id: the one a catch-up asks first) and
 * returns whether the round in progress must fail: it completed our round,
 * and it is a READY, or our predecessor's RING_AHEAD while we still wait
 * for its pieces, whether or not another member told that step first.
 * Ring state only, no I/O (test_gossip_ring). */
bool gossip_ring_heard_ahead(struct gossip_ring *r, const uint8_t *from, uint64_t step, bool ready);
/* An attempt ends, failed: the successor's READY it sent on (the stored
 * one with succ_nonce) is spent, so that the next attempt waits for the
 * successor's fresh one. Every member of a ring fails together (ABORT),
 * and the first to retry would otherwise send on the successor's READY of
 * the attempt that just failed, have its pieces refused ("an earlier
 * attempt"), fail the ring again and so on: bench-chaos saw all eight
 * members retry every 100 ms for minutes. Ring state only (test_gossip_ring). */
void gossip_ring_spend_ready(struct gossip_ring *r);
/* The successor refused piece k of ours, sent on its READY with `nonce`
 * (the refusal comes before any of the piece's data is taken): the slot is
 * free again. A READY of an earlier attempt arriving after that attempt
 * failed here is taken by the next one, whose pieces the successor (in a
 * later attempt already) refuses; failing the ring for it made every member
 * fail and retry, and the retry met the next late READY: bench-chaos saw
 * six members retry every 100 ms for 10 s, until the membership changed.
 * So while the successor has confirmed no piece of this attempt, a refusal
 * only spends that READY (when it is still the one we send on) and we wait
 * for the successor's current one (at most RING_REFUSED_WAIT_MS from
 * `now_ms`: a successor refusing for another reason, in another view of the
 * ring, sends none, and the tick fails the attempt); true when the attempt
 * must fail: after a delivery (what the successor took is lost with its
 * attempt), or after RING_STALE_READY_MAX stale READYs. Ring state only
 * (test_gossip_ring). */
bool gossip_ring_piece_refused(struct gossip_ring *r, uint32_t k, uint64_t nonce, uint64_t now_ms);
/* A ring piece begins (metadata: round `step`, ring `hash` (which names the
 * round's kind), phase, piece):
 * 0 with *dst and *dst_arg set, or a negative code to refuse it. */
int gossip_ring_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                              const struct net_msg *meta, float **dst, void **dst_arg);
/* A transfer ended: true when it was a ring piece (dst_arg set by the above). */
bool gossip_ring_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status, void *dst_arg);
void gossip_ring_tick(struct gossip *g, uint64_t now);
/* Ends the round in progress, nothing applied (shutting down). */
void gossip_ring_abandon(struct gossip *g, const char *why);
/* Connection `c` closes (it is freed right after): the ring forgets it. */
void gossip_ring_on_close(struct gossip *g, net_conn_t *c);

/* ---- donation.c ---- */

void gossip_donation_init(struct gossip *g);
void gossip_donation_free(struct gossip *g);
/* STATE_REQ (a newcomer) and PARAMS_REQ (a monitor). */
void gossip_donation_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
void gossip_donation_on_close(struct gossip *g, net_conn_t *c);

/* ---- stats.c: monitoring ---- */

/* Events other parts report; counted here (any thread). */
enum gossip_event {
  GOSSIP_EV_XCH_FAILED,       /* abandoned (why: the reason) */
  GOSSIP_EV_XCH_REJECTED,     /* the partner's parameters refused (why) */
  GOSSIP_EV_XCH_REQUESTED,    /* we asked a partner */
  GOSSIP_EV_XCH_REFUSED,      /* a partner refused our request */
  GOSSIP_EV_XCH_IDLE,         /* a snapshot found no free partner */
  GOSSIP_EV_DONATED,          /* a state donated */
  GOSSIP_EV_XCH_RATE_LIMITED, /* a request refused by our rate limit */
  GOSSIP_EV_CONN_RATE_LIMITED,
};
void gossip_count(struct gossip *g, enum gossip_event ev, const char *why);
/* An exchange applied; the partner's parameters took `bytes_received` on
 * the wire (ours: our --wire's size of them). Any thread. */
void gossip_count_applied(struct gossip *g, uint64_t bytes_received);
int gossip_monitoring_init(struct gossip *g, struct rumor_err *e) RUMOR_MUST_CHECK;
void gossip_monitoring_free(struct gossip *g);
/* The norm and sketch last published by the training thread into
 * norm/sketch (sketch_k doubles); false when no sketch was published. Any
 * thread. */
bool gossip_monitoring_sketch(struct gossip *g, double *norm, double *sketch);
/* Rebuilds the member view and the member and byte counts. */
void gossip_publish(struct gossip *g);
/* STATS_REQ and MEMBERS_REQ. */
void gossip_stats_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);
void gossip_stats_tick(struct gossip *g, uint64_t now);
void gossip_stats_on_close(struct gossip *g, net_conn_t *c);
/* Starts the metrics endpoint on cfg.metrics. */
int gossip_metrics_start(struct gossip *g, struct rumor_err *e) RUMOR_MUST_CHECK;
void gossip_metrics_stop(struct gossip *g);

/* ---- http.c: a minimal HTTP/1.0 server for GET requests on a libuv loop.
 * The handler fills *body (malloc'd, the server frees it) and returns the
 * status code. `what` names the option in error messages ("--metrics").
 * Serves the metrics endpoint and the monitor's (gossip_monitor_serve).
 * Loop thread only. ---- */
struct gossip_http;
typedef int (*gossip_http_handler)(void *ctx, const char *path, char **body, size_t *len, const char **type);
int gossip_http_start(uv_loop_t *loop, const char *what, const char *addr, gossip_http_handler h, void *ctx,
                      struct gossip_http **out, struct rumor_err *e) RUMOR_MUST_CHECK;
int gossip_http_port(const struct gossip_http *h);
/* Closes the listener and every client; frees `h` once all handles closed. */
void gossip_http_stop(struct gossip_http *h);

#ifdef RUMOR_TESTING
/* ---- testing.c: the testing build's misbehaving member (see there) ---- */
int gossip_testing_start(struct gossip *g, struct rumor_err *e) RUMOR_MUST_CHECK;
void gossip_testing_free(struct gossip *g);
/* Poisons a copy of our snapshot in `mine` once it is taken (the copy is
 * sent: gossip_testing_send_src); may change *step. */
void gossip_testing_snapshot(struct gossip *g, uint64_t *step);
/* What to send: the poisoned copy, or our snapshot. */
const float *gossip_testing_send_src(struct gossip *g);
/* How many of our `count` values to send. */
uint64_t gossip_testing_send_count(struct gossip *g, uint64_t count);
void gossip_testing_tick(struct gossip *g, uint64_t now);
/* Poisons a state about to be donated (`n` floats). */
void gossip_testing_donation(struct gossip *g, float *state, uint64_t n);
/* True when the all-reduce READY about to go out is to be lost instead. */
bool gossip_testing_lose_ready(struct gossip *g, bool first_of_attempt);
/* True when the all-reduce READY about to go out names another attempt (staleready). */
bool gossip_testing_stale_ready(struct gossip *g, bool first_of_attempt);
/* How long a last-phase piece's delivery is taken late (slowconfirm; 0: not). */
uint64_t gossip_testing_confirm_delay_ms(struct gossip *g);
/* As an all-reduce round of `step` (`reduce`: a reduce round, whose
 * contribution is in ring.acc) is about to start on the loop thread. */
void gossip_testing_ring_start(struct gossip *g, uint64_t step, bool reduce);
/* As the partner's transfer of an exchange begins (it is accepted). */
void gossip_testing_xch_receiving(struct gossip *g);
/* True when an exchange transfer's list of finished members is to be sent
 * malformed (badfin). */
bool gossip_testing_bad_fin(struct gossip *g);
#endif

#endif /* RUMOR_GOSSIP_IMPL_H */
