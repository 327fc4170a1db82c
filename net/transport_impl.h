/*
 * transport_impl — the libuv objects behind net_t and net_conn_t, shared by
 * net.c (the net: listening, dialing, hand-off, closing) and conn.c (one
 * connection: handshake I/O, the outbound queue, reading, closing).
 *
 * Ownership: a net owns its connections (a list); a connection owns its
 * handles (tcp, timer) and requests. A connection is freed in the close
 * callback of its last handle once no request is pending (refs == 0); the
 * net is freed once it has no connection and no handle left.
 */
#ifndef RUMOR_NET_TRANSPORT_IMPL_H
#define RUMOR_NET_TRANSPORT_IMPL_H

#include <pthread.h>

#include "net/net_impl.h"

#define NET_ADDR_STR 64
#define NET_NAME_STR 112
#define NET_DETAIL_STR 512 /* as struct rumor_err.msg */
#define NET_CTRL_RESERVE 4096 /* queue bytes kept for our own small frames (RESULT, ABORT, BYE) */
#define NET_LISTEN_BACKLOG 128

enum conn_state {
  CONN_RESOLVING,  /* dial: waiting for getaddrinfo */
  CONN_CONNECTING, /* dial: TCP connect in progress */
  CONN_HANDSHAKE,  /* TCP up, not yet authenticated */
  CONN_OPEN,       /* authenticated and reported to the app */
  CONN_CLOSING,    /* BYE sent or received; flushing */
  CONN_CLOSED,     /* handles closing; waiting to be freed */
};

/* One outbound frame. Control frames wait in the control queue (unsealed);
 * every transport frame then goes through the ordered queue (txq), where a
 * bulk chunk may still be being sealed on a worker thread (ready == false);
 * frames leave txq for uv_write strictly in order, which is also the order of
 * their nonces. A write owns its frame until the write callback; a worker
 * job owns it until the job's after-work callback. */
struct net_txframe {
  uv_write_t req;
  uv_work_t work;
  struct net_txframe *next;
  struct net_conn *conn;
  size_t len;    /* bytes to write */
  size_t cap;    /* bytes available at data */
  bool pooled;   /* a bulk chunk buffer that goes back to the pool */
  bool sealed;   /* false: a control frame sealed when it leaves the control queue */
  bool ready;    /* in txq: sealed and writable */
  bool orphan;   /* its connection dropped it while a worker was sealing it */
  bool is_bye;
  bool is_ping;  /* our heartbeat: not activity for the idle timeout */
  bool transport;/* counts as a frame in the stats (handshake messages do not) */
  struct net_tx_bulk *t;  /* bulk DATA frames: their transfer (for the digest leaf) */
  /* A CIRCUIT_DATA piece that ends a frame of a connection running over the
   * circuit: that frame's write completes when this piece is written (or
   * fails when it is dropped). relay.c. */
  struct net_txframe *carried;
  struct net_tx_job job;
  uint8_t *data;
};

struct net_conn {
  net_t *net;
  struct net_conn *prev, *next;
  uv_tcp_t tcp;
  uv_timer_t timer;
  uv_getaddrinfo_t gai;
  uv_connect_t creq;
  uv_shutdown_t sreq;
  unsigned refs; /* open handles and pending requests */
  enum conn_state state;
  bool inbound, surfaced, counted_pending, reading, local_close;
#ifdef RUMOR_TESTING
  bool test_paused; /* net_test_conn_pause_read */
#endif
  bool bye_queued, bye_sealed, bye_written, shutdown_started, eof;
  bool pumping;
  /* dialing */
  net_dial_cb dial_cb;
  void *dial_arg;
  struct addrinfo *ai, *ai_next;
  bool retrying;  /* tcp handle closed to try the next address */
  bool resolving; /* the getaddrinfo request is pending (holds a ref) */
  /* who */
  char addr[NET_ADDR_STR];
  char name[NET_NAME_STR];
  uint8_t peer_pk[NET_PUBKEY_BYTES];
  void *data;
  /* handshake (pre-authentication framing: u16 length + body) */
  struct net_hs hs;
  uint8_t hs_buf[NET_HS_LEN_BYTES + NET_HS_FRAME_MAX];
  size_t hs_got, hs_want;
  bool reject_then_close;
  /* authenticated session */
  struct net_sess sess;
  unsigned suite;
  uint8_t *stage; /* NET_RX_STAGE_BYTES, allocated when the session opens */
  /* outbound */
  struct net_txframe *ctl_head, *ctl_tail;
  size_t ctl_bytes;      /* control frames waiting in the queue */
  struct net_txframe *txq_head, *txq_tail;
  size_t txq_bytes;      /* frames in txq (being sealed or waiting their turn) */
  size_t inflight_bytes; /* frames handed to uv_write, not yet completed */
  struct net_tx_bulk *tx_head, *tx_tail; /* transfers to send; the head is current */
  struct net_tx_bulk *wait_head;         /* sent completely, waiting for the RESULT */
  struct net_tx_bulk *zombie_head;       /* finished, waiting for their worker jobs */
  bool rx_paused;        /* reading stopped while received chunks are on workers */
  uint64_t next_tx_id;
  /* closing */
  int close_status;
  char close_detail[NET_DETAIL_STR];
  uint64_t last_activity; /* uv_now, ms: the last byte in or out other than PINGs (the idle timeout) */
  uint32_t retire_ms;     /* net_conn_retire: closed after this much activity-free time; 0: not retired */
  /* Liveness of an open connection (docs/net.md, "Heartbeat"), loop time in ms. */
  uint64_t last_rx;      /* a byte last arrived (or reading was paused by us) */
  uint64_t last_tx;      /* a frame last went to the socket, or finished writing */
  uint64_t timer_due;    /* when the open connection's timer was due: lateness is our own stall */
  uint64_t app_bytes_in; /* bytes received less PING frames, at the last read: growth is activity */
  uint32_t peer_ping_ms; /* the interval the peer announced in its PINGs; 0: none seen, never judged */
  uint8_t version;       /* the session's protocol version */
  bool verdict_pending;  /* silent past the limit: the socket is read once more before the verdict */
  bool judged_dead;      /* aborted on the heartbeat verdict */
  struct net_conn_stats st;
  /* relays (relay.c). A connection over a circuit has no socket: its bytes
   * travel in CIRCUIT_DATA frames of `circ_carrier`, its connection to the
   * relay, under circuit id `circ_id` there. */
  struct net_conn *circ_carrier; /* NULL: a TCP connection, or the carrier is gone */
  uint64_t circ_id;
  bool circ;                     /* runs over a circuit (for its whole life) */
  bool circ_fin_sent;            /* our FIN (the end of our stream) is out */
  bool circ_check_target;        /* dialed through a relay: the peer must be circ_target */
  uint8_t circ_target[NET_PUBKEY_BYTES];
  struct net_relay_link *circ_wait; /* dialed: waiting for the carrier to open */
  struct net_carrier *carrier;   /* the circuits this connection carries (relay.c), or NULL */
  bool read_held;                /* a relay stopped reading it (backpressure, rate cap) */
};

struct net_call_item {
  struct net_call_item *next;
  net_call_fn fn;
  void *arg;
};

struct net {
  uv_loop_t *loop;
  struct net_config cfg;
  struct net_callbacks cbs;
  void *ud;
  struct net_keyring kr;
  uv_tcp_t listener;
  bool listening;
  int port;
  uv_async_t async;
  pthread_mutex_t call_mu;
  struct net_call_item *call_head, *call_tail; /* guarded by call_mu */
  bool call_closed;                             /* guarded by call_mu */
  unsigned handles; /* listener + async while open */
  struct net_conn *conns;
  uint32_t n_conns, n_pending;
  bool closing;
  void (*close_cb)(void *arg);
  void *close_arg;
  size_t chunk_frame_cap; /* frame bytes of one full outbound bulk chunk */
  size_t bulk_window;     /* outbound bytes a bulk transfer may have queued */
  struct net_txframe *frame_pool; /* spare frames of chunk_frame_cap bytes (loop thread; conn.c) */
  unsigned frame_pool_n;          /* at most NET_FRAME_POOL_MAX */
  unsigned frame_pool_low;        /* the fewest spare frames since frame_pool_since (the decay window) */
  uint64_t frame_pool_since;      /* uv_now when the window began */
  struct net_relay_link *rlinks; /* carriers this net dialed, by relay address (relay.c) */
  uv_timer_t relay_timer;        /* a relay: refills rate budgets and releases held readers */
  bool relay_timer_on;
#ifdef RUMOR_TESTING
  bool test_relay_flip, test_relay_any_target; /* net_test_relay_misbehave */
  uint64_t test_relay_flip_after;
#endif
  struct net_stats stats; /* closed connections folded in; live ones added on read */
};

/* conn.c */
struct net_conn *net_conn_new(net_t *n, bool inbound);
/* The TCP connection is up: start the handshake (client or server side). */
void net_conn_start_handshake(struct net_conn *c);
/* Hard close: log, count, cancel everything with `status`, close handles. */
void net_conn_abort(struct net_conn *c, int status, int hs_fail, const char *fmt, ...) RUMOR_PRINTF(4, 5);
void net_conn_on_handle_closed(uv_handle_t *h);
/* Drops one reference (a handle closed, a request finished); frees at zero. */
void net_conn_unref(struct net_conn *c);
void net_conn_set_name(struct net_conn *c);
/* Frees the net's spare chunk frames (when it is freed). */
void net_frame_pool_free(net_t *n);
void *net_alloc_aligned(size_t n);
/* Queues a frame (sealed when it leaves the control queue) if the queue
 * stays within `limit` bytes: -ENOBUFS otherwise, -ENOTCONN after our BYE.
 * `carried`: see struct net_txframe. Call net_conn_pump after. */
int net_conn_queue_frame(struct net_conn *c, uint8_t type, uint64_t a, uint64_t b, const void *pt, size_t len,
                         size_t limit, struct net_txframe *carried);
void net_conn_pump(struct net_conn *c);
void net_conn_stats_add(struct net_conn_stats *to, const struct net_conn_stats *s);
size_t net_conn_queued(const struct net_conn *c);
/* A circuit connection: bytes of its stream arrived / its stream ended. */
void net_conn_feed(struct net_conn *c, const uint8_t *p, size_t len);
void net_conn_on_eof(struct net_conn *c);
/* The write of frame `f` (of f->conn) completed with `status`. */
void net_conn_write_done(struct net_txframe *f, int status);
/* Stops (hold) or allows reading from c's socket, beside its other reasons. */
void net_conn_hold_read(struct net_conn *c, bool hold);
/* relay.c */
struct net_relay_link;
struct net_carrier;
void net_relay_init(net_t *n);
void net_relay_close(net_t *n, uv_close_cb cb);
int net_relay_on_frame(struct net_conn *c, uint8_t type, uint64_t a, uint64_t b, const uint8_t *pt, size_t len);
/* c is being aborted: ends the circuit it runs over and the circuits it carries. */
void net_relay_conn_gone(struct net_conn *c, int status);
/* A circuit connection's I/O: a frame to write (completes through
 * net_conn_write_done), and the end of our stream (FIN). */
int net_circuit_write(struct net_conn *c, struct net_txframe *f);
void net_circuit_shutdown(struct net_conn *c);
/* Our outbound circuit connection finished its handshake: checks the peer. */
int net_circuit_check_peer(struct net_conn *c, struct rumor_err *e);
/* net.c */
void net_conn_unlink(struct net_conn *c);
void net_try_connect(struct net_conn *c);

#endif /* RUMOR_NET_TRANSPORT_IMPL_H */
