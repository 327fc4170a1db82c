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
};
_Static_assert(GMSG_JOIN == 1 && GMSG_PING == 4 && GMSG_XCH_REQ == 8 && GMSG_STATE_BUSY == 12,
               "gossip message numbers are part of the protocol");
#define GOSSIP_PROTO_VERSION 1

/* Kinds of bulk transfer (the "k" field of the bulk metadata). */
enum { GBULK_EXCHANGE = 1, GBULK_STATE = 2 };

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

struct gossip {
  struct gossip_config cfg;
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

  /* Published for other threads under `lock`. */
  pthread_mutex_t lock;
  pthread_cond_t cond;
  struct gossip_stats stats;
  uint64_t last_exchange_ms; /* monotonic, 0 before the first */
  struct gossip_member_view *pub;
  size_t npub, pub_cap;
};

/* runtime.c */
uint64_t gossip_now_ms(struct gossip *g);
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
void gossip_donor_on_ready(net_t *n, void *arg, int status);
void gossip_pull_tick(struct gossip *g, uint64_t now);
void gossip_pull_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m);

#endif /* RUMOR_GOSSIP_IMPL_H */
