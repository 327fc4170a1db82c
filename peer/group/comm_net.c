/* comm's transport over net/: a full mesh of authenticated, encrypted
 * connections between the members of a group, one process per member, run
 * on a libuv loop and thread of the transport's own.
 *
 * Member r listens; it dials every member j < r (retrying until the connect
 * deadline) and members above dial it. Each member proves a key derived
 * from the group's identity for its index and admits exactly the others'.
 * The dialer sends HELLO (group, rank, size, agreement), the acceptor
 * answers HELLO_OK or REJECT. A collective's message travels as one bulk
 * transfer whose metadata is the message's header; bulk transfers on one
 * connection arrive in the order sent, so each (source, tag) stays a FIFO.
 * net's heartbeat judges a member whose process stopped; a reset or closed
 * connection fails the group naming the member. */
#include "peer/group/comm_impl.h"

#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Control message types ("t") and the protocol version ("v"). */
enum {
  CMSG_HELLO = 1,    /* dialer → acceptor: group, rank, size, agreement */
  CMSG_HELLO_OK = 2, /* acceptor → dialer */
  CMSG_REJECT = 3,   /* either way: why */
  CMSG_ABORT = 4,    /* either way: the member blamed, the code, why */
};
_Static_assert(CMSG_HELLO == 1 && CMSG_HELLO_OK == 2 && CMSG_REJECT == 3 && CMSG_ABORT == 4,
               "comm message numbers travel on the wire");
#define COMM_PROTO_VERSION 1

/* A message's header as bulk metadata, little-endian:
 * magic u32 | version u16, kind u16 | tag u64 | seq u64 | step u32 | 0 u32 |
 * total i64 | shape u64 | bytes u64. The payload is bytes rounded up to
 * whole floats, at least one. */
#define META_MAGIC 0x4d4f4352u /* "RCOM" */
#define META_BYTES 56

#define GROUP_MAX 64     /* characters of a group name */
#define AGREE_MAX 4096   /* characters of the agreement text */
#define ADDR_MAX 128
#define TICK_MS 100
#define DIAL_RETRY_MS 200
#define DEFAULT_CONNECT_MS 30000
#define DEFAULT_HEARTBEAT_MS 250
#define DEFAULT_DEAD_AFTER_MS 2000
/* What one member may hold received and not yet taken by its collectives:
 * a member sending more is breaking the protocol. */
#define INBOX_MAX_MSGS 65536
#define INBOX_MAX_BYTES (8ull << 30)

/* A message on its way out: the copy of the payload net's bulk transfer
 * reads from until its callback. */
struct tx {
  struct tx *next;
  struct comm_net *n;
  size_t cap; /* bytes of the allocation (comm_pool_get's) */
  int dst;
  uint8_t meta[META_BYTES];
  uint64_t count; /* floats */
  float data[];
};

/* Member j as this member sees it. */
struct peer {
  struct comm_net *n;
  int index;                     /* j */
  uint8_t key[NET_PUBKEY_BYTES]; /* its derived key */
  char addr[ADDR_MAX];           /* where to dial it (j < rank) */
  /* Loop thread only. */
  net_conn_t *conn;
  bool dialing, dialed, left;
  uint64_t next_dial_ms;
  char dial_err[256];
  struct tx *wait_head, *wait_tail; /* sends queued until the connection agreed */
  /* Under mu. */
  bool ready; /* connected and agreed */
};

struct comm_net {
  struct comm_transport t; /* first: the transport pointer is the comm_net */
  pthread_mutex_t mu;
  pthread_cond_t cond;
  char group[GROUP_MAX + 1];
  char agreement[AGREE_MAX + 1];
  char listen[ADDR_MAX];
  char addr[ADDR_MAX];
  struct net_identity self;
  uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
  uint32_t connect_timeout_ms;
  struct peer *peers; /* [size]; this member's entry is unused */

  /* The loop thread's. */
  uv_loop_t loop;
  uv_timer_t tick;
  net_t *net;
  pthread_t thread;
  uint64_t start_ms;
  bool closing;

  /* Under mu. */
  int ready_count;
  int64_t pending; /* sends not yet confirmed or dropped */
};

static struct comm_net *of(struct comm_transport *t) { return (struct comm_net *)t; }

/* ---- identities ---- */

/* Member `index`'s identity: an Ed25519 key pair from a seed that is
 * BLAKE2b-256 of a label, keyed with the group identity's secret seed. The
 * label differs from the pipeline's, so a member's key never equals a
 * stage's. */
static void derive_identity(const struct net_identity *group, int index, struct net_identity *out) {
  char label[64];
  snprintf(label, sizeof label, "rumor group comm member %d v1", index);
  net_identity_derive(group, label, out);
}

/* ---- metadata ---- */


static void meta_write(uint8_t *m, uint64_t tag, const struct comm_hdr *h) {
  le_put_u32(m, META_MAGIC);
  le_put_u32(m + 4, (uint32_t)COMM_PROTO_VERSION | h->kind << 16);
  le_put_u64(m + 8, tag);
  le_put_u64(m + 16, h->seq);
  le_put_u32(m + 24, h->step);
  le_put_u32(m + 28, 0);
  le_put_u64(m + 32, (uint64_t)h->total);
  le_put_u64(m + 40, h->shape);
  le_put_u64(m + 48, h->bytes);
}

static uint64_t payload_floats(uint64_t bytes) {
  uint64_t f = (bytes + sizeof(float) - 1) / sizeof(float);
  return f ? f : 1;
}

/* Reads and checks metadata against the transfer; false when malformed. */
static bool meta_read(const struct net_bulk_info *info, uint64_t *tag, struct comm_hdr *h) {
  const uint8_t *m = info->meta;
  if (info->meta_len != META_BYTES || le_get_u32(m) != META_MAGIC ||
      (le_get_u32(m + 4) & 0xffff) != COMM_PROTO_VERSION || info->wire != NET_DTYPE_F32)
    return false;
  h->kind = le_get_u32(m + 4) >> 16;
  *tag = le_get_u64(m + 8);
  h->seq = le_get_u64(m + 16);
  h->step = le_get_u32(m + 24);
  h->total = (int64_t)le_get_u64(m + 32);
  h->shape = le_get_u64(m + 40);
  h->bytes = le_get_u64(m + 48);
  return h->kind >= 1 && h->kind <= COMM_KIND__MAX && le_get_u32(m + 28) == 0 && h->bytes <= UINT64_MAX - 8 &&
         info->count == payload_floats(h->bytes);
}

/* ---- sending (loop thread, but for net_send) ---- */

static void tx_free(struct tx *x) {
  struct comm_net *n = x->n;
  comm_pool_put(&n->t, x, x->cap);
  pthread_mutex_lock(&n->mu);
  n->pending--;
  pthread_cond_broadcast(&n->cond);
  pthread_mutex_unlock(&n->mu);
}

static void on_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct tx *x = arg;
  if (status != 0 && !x->n->closing)
    log_debug("comm: transfer %llu to %s ended with %s", (unsigned long long)id, net_conn_peer_name(c),
              rumor_strerror(status));
  tx_free(x); /* a lost connection is reported by on_close */
}

static void tx_start(struct comm_net *n, struct tx *x) {
  struct peer *p = &n->peers[x->dst];
  struct net_bulk_send s = {.src = x->data, .count = x->count, .wire = NET_DTYPE_F32, .no_digest = true,
                            .meta = x->meta, .meta_len = META_BYTES, .done = on_sent, .arg = x};
  int rc = net_conn_send_bulk(p->conn, &s, NULL);
  if (rc == -ENOTCONN) {
    tx_free(x); /* the connection is closing: on_close says why (lost, or left) */
    return;
  }
  if (rc) {
    comm_transport_fail(&n->t, x->dst, rc, "cannot send to %s: %s", n->t.label[x->dst], rumor_strerror(rc));
    tx_free(x);
  }
}

/* Sends now when the connection has agreed, else queues behind the others
 * for it; a member that left needs nothing more. */
static void tx_on_loop(net_t *net, void *arg, int status) {
  (void)net;
  struct tx *x = arg;
  struct comm_net *n = x->n;
  struct peer *p = &n->peers[x->dst];
  pthread_mutex_lock(&n->mu);
  bool ready = p->ready;
  pthread_mutex_unlock(&n->mu);
  if (status != 0 || n->closing || p->left || (ready && !p->conn)) {
    tx_free(x);
    return;
  }
  if (ready && !p->wait_head) {
    tx_start(n, x);
    return;
  }
  x->next = NULL;
  if (p->wait_tail) p->wait_tail->next = x;
  else p->wait_head = x;
  p->wait_tail = x;
}

static void drop_waiting(struct peer *p) {
  for (struct tx *x = p->wait_head, *nx; x; x = nx) {
    nx = x->next;
    tx_free(x);
  }
  p->wait_head = p->wait_tail = NULL;
}

static int net_send(struct comm_transport *t, int dst, uint64_t tag, const struct comm_hdr *h, const void *data,
                    struct rumor_err *e) {
  struct comm_net *n = of(t);
  RUMOR_ASSERT(dst >= 0 && dst < t->size && dst != t->rank);
  int rc = comm_transport_check(t, e);
  if (rc) return rc;
  uint64_t count = payload_floats(h->bytes);
  if (count > (SIZE_MAX - sizeof(struct tx)) / sizeof(float))
    return rumor_err_set(e, RUMOR_ETOOBIG, "a message of %llu bytes", (unsigned long long)h->bytes);
  size_t cap;
  struct tx *x = comm_pool_get(t, sizeof *x + (size_t)count * sizeof(float), &cap);
  if (!x) return rumor_err_set(e, -ENOMEM, "out of memory for a message of %llu bytes", (unsigned long long)h->bytes);
  x->n = n;
  x->cap = cap;
  x->dst = dst;
  x->count = count;
  meta_write(x->meta, tag, h);
  x->data[count - 1] = 0.0f; /* the padding */
  if (h->bytes) memcpy(x->data, data, (size_t)h->bytes);
  pthread_mutex_lock(&n->mu);
  n->pending++;
  pthread_mutex_unlock(&n->mu);
  if (net_call(n->net, tx_on_loop, x) != 0) {
    tx_free(x);
    return rumor_err_set(e, RUMOR_ECANCELED, "the communicator is closing");
  }
  return 0;
}

/* ---- control messages (loop thread) ---- */

static void send_msg(net_conn_t *c, struct net_msgbuf *b) {
  int rc = net_conn_send_msg(c, b);
  net_msgbuf_free(b);
  if (rc) log_debug("comm: cannot send a message to %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
}

static int conn_member(net_conn_t *c) { return (int)(intptr_t)net_conn_data(c) - 1; }

static void send_hello(struct comm_net *n, net_conn_t *c) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, CMSG_HELLO, COMM_PROTO_VERSION);
  net_msgbuf_put_str(&b, "group", n->group, strlen(n->group));
  net_msgbuf_put_int(&b, "rank", n->t.rank);
  net_msgbuf_put_int(&b, "size", n->t.size);
  net_msgbuf_put_str(&b, "agree", n->agreement, strlen(n->agreement));
  send_msg(c, &b);
}

static void send_text(net_conn_t *c, unsigned type, int member, int code, const char *why) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, type, COMM_PROTO_VERSION);
  if (type == CMSG_ABORT) {
    net_msgbuf_put_int(&b, "member", member);
    net_msgbuf_put_int(&b, "code", code);
  }
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  send_msg(c, &b);
}

/* Copies a printable ASCII string field into buf; false when absent, too
 * long or not printable. */
static bool get_text(const struct net_msg *m, const char *key, char *buf, size_t cap) {
  const char *s;
  size_t len;
  if (net_msg_get_str(m, key, &s, &len) || len >= cap) return false;
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) return false;
  memcpy(buf, s, len);
  buf[len] = '\0';
  return true;
}

/* The first space-separated item where two agreement texts differ (as the
 * pipeline's stage links report it), for a message that says what to fix. */
static void first_difference(const char *a, const char *b, char *da, char *db, size_t cap) {
  for (;;) {
    size_t la = strcspn(a, " "), lb = strcspn(b, " ");
    if (la != lb || strncmp(a, b, la) != 0 || !a[la] || !b[lb]) {
      snprintf(da, cap, "%.*s", (int)(la < cap - 1 ? la : cap - 1), a);
      snprintf(db, cap, "%.*s", (int)(lb < cap - 1 ? lb : cap - 1), b);
      return;
    }
    a += la + 1;
    b += lb + 1;
  }
}

/* Member j agreed: its sends may go, its waiters wake. */
static void mark_ready(struct comm_net *n, int j, net_conn_t *c) {
  struct peer *p = &n->peers[j];
  pthread_mutex_lock(&n->mu);
  p->ready = true;
  n->ready_count++;
  comm_transport_set_addr_locked(&n->t, j, net_conn_peer_addr(c));
  pthread_cond_broadcast(&n->cond);
  pthread_mutex_unlock(&n->mu);
  while (p->wait_head) {
    struct tx *x = p->wait_head;
    p->wait_head = x->next;
    if (!p->wait_head) p->wait_tail = NULL;
    tx_start(n, x);
  }
}

static void handle_hello(struct comm_net *n, net_conn_t *c, int j, const struct net_msg *m) {
  char group[GROUP_MAX + 1], agree[AGREE_MAX + 1], why[COMM_WHY_MAX];
  int64_t rank, size;
  int me = n->t.rank, N = n->t.size;
  if (!get_text(m, "group", group, sizeof group) || net_msg_get_int(m, "rank", &rank) ||
      net_msg_get_int(m, "size", &size) || !get_text(m, "agree", agree, sizeof agree)) {
    comm_transport_fail(&n->t, j, RUMOR_EPROTO, "group member %d (%s) sent a malformed HELLO", j,
                        net_conn_peer_addr(c));
    net_conn_close(c);
    return;
  }
  why[0] = '\0';
  if (strcmp(group, n->group) != 0)
    snprintf(why, sizeof why, "group '%s' dialed member %d of group '%s'", group, me, n->group);
  else if (size != N || rank != j)
    snprintf(why, sizeof why, "member %lld of %lld dialed member %d of %d (its key is member %d's of %d)",
             (long long)rank, (long long)size, me, N, j, N);
  else if (strcmp(agree, n->agreement) != 0) {
    char theirs[160], ours[160];
    first_difference(agree, n->agreement, theirs, ours, sizeof ours);
    snprintf(why, sizeof why, "group member %d is configured differently: it has '%s', member %d has '%s'", j, theirs,
             me, ours);
  }
  if (why[0]) {
    send_text(c, CMSG_REJECT, 0, 0, why);
    comm_transport_fail(&n->t, j, RUMOR_EPROTO, "%s", why);
    return;
  }
  struct net_msgbuf b;
  net_msgbuf_init(&b, CMSG_HELLO_OK, COMM_PROTO_VERSION);
  send_msg(c, &b);
  mark_ready(n, j, c);
  log_info("comm: member %d/%d of group %s connected from %s", j, N, n->group, net_conn_peer_addr(c));
}

static void handle_abort(struct comm_net *n, int j, const struct net_msg *m) {
  int64_t member, code;
  char why[COMM_WHY_MAX];
  if (net_msg_get_int(m, "member", &member) || member < 0 || member >= n->t.size ||
      net_msg_get_int(m, "code", &code) || !get_text(m, "why", why, sizeof why)) {
    comm_transport_fail(&n->t, j, RUMOR_EPROTO, "%s sent a malformed ABORT", n->t.label[j]);
    return;
  }
  /* Only the codes a group fails with; anything else reads as a stop. */
  if (code != RUMOR_EPROTO && code != RUMOR_ETIMEDOUT && code != -ECONNRESET && code != RUMOR_EAUTH) code = RUMOR_ECANCELED;
  comm_transport_fail(&n->t, (int)member, (int)code, "%s", why);
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct comm_net *n = ud;
  if (!net_conn_data(c) || n->closing) return; /* one we refused, closing */
  int j = conn_member(c);
  pthread_mutex_lock(&n->mu);
  bool ready = n->peers[j].ready;
  pthread_mutex_unlock(&n->mu);
  if (m->version != COMM_PROTO_VERSION) {
    comm_transport_fail(&n->t, j, RUMOR_EPROTO, "group member %d (%s) speaks comm version %llu, this member %d", j,
                        net_conn_peer_addr(c), (unsigned long long)m->version, COMM_PROTO_VERSION);
    net_conn_close(c);
    return;
  }
  switch (m->type) {
  case CMSG_HELLO:
    if (j < n->t.rank || ready) break;
    handle_hello(n, c, j, m);
    return;
  case CMSG_HELLO_OK:
    if (j > n->t.rank || ready) break;
    mark_ready(n, j, c);
    log_info("comm: connected to member %d/%d of group %s at %s", j, n->t.size, n->group, net_conn_peer_addr(c));
    return;
  case CMSG_REJECT: {
    char why[COMM_WHY_MAX];
    if (!get_text(m, "why", why, sizeof why)) snprintf(why, sizeof why, "(no reason given)");
    comm_transport_fail(&n->t, j, RUMOR_EPROTO, "group member %d (%s) refused this member: %s", j,
                        net_conn_peer_addr(c), why);
    return;
  }
  case CMSG_ABORT: handle_abort(n, j, m); return;
  default: break;
  }
  comm_transport_fail(&n->t, j, RUMOR_EPROTO, "group member %d (%s) broke the comm protocol (message type %llu)", j,
                      net_conn_peer_addr(c), (unsigned long long)m->type);
  net_conn_close(c);
}

/* ---- receiving (loop thread) ---- */

static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct comm_net *n = ud;
  if (!net_conn_data(c) || n->closing) return RUMOR_ECANCELED;
  int j = conn_member(c);
  uint64_t tag;
  struct comm_hdr h;
  pthread_mutex_lock(&n->mu);
  bool ready = n->peers[j].ready;
  bool full = n->t.queued_msgs >= INBOX_MAX_MSGS;
  uint64_t room = INBOX_MAX_BYTES - n->t.queued_bytes;
  pthread_mutex_unlock(&n->mu);
  const char *why = NULL;
  if (!ready) why = "a transfer before HELLO";
  else if (!meta_read(info, &tag, &h)) why = "a transfer without valid metadata";
  else if (full || h.bytes > room) why = "more than the collectives take (its messages overflow the inbox)";
  if (why) {
    comm_transport_fail(&n->t, j, RUMOR_EPROTO, "%s sent %s", n->t.label[j], why);
    return RUMOR_EPROTO;
  }
  struct comm_msg *m = comm_msg_alloc(&n->t, h.bytes);
  if (!m) {
    comm_transport_fail(&n->t, n->t.rank, -ENOMEM, "out of memory for a message of %llu bytes from %s",
                        (unsigned long long)h.bytes, n->t.label[j]);
    return -ENOMEM;
  }
  m->tag = tag;
  m->h = h;
  *dst = m->data;
  *dst_arg = m;
  return 0;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  (void)id;
  (void)dst;
  struct comm_net *n = ud;
  struct comm_msg *m = dst_arg;
  if (status != 0) {
    comm_msg_free(&n->t, m); /* cut by a closing connection: on_close says why */
    return;
  }
  pthread_mutex_lock(&n->mu);
  comm_transport_push_locked(&n->t, conn_member(c), m);
  pthread_mutex_unlock(&n->mu);
}

/* ---- connections (loop thread) ---- */

static void on_accept(net_conn_t *c, void *ud) {
  struct comm_net *n = ud;
  int j = -1;
  for (int k = n->t.rank + 1; k < n->t.size; k++)
    if (memcmp(net_conn_peer_key(c), n->peers[k].key, NET_PUBKEY_BYTES) == 0) j = k;
  if (j < 0 || n->peers[j].conn || n->peers[j].left || n->closing) {
    log_warn("comm: unexpected connection from %s; closing it", net_conn_peer_name(c));
    net_conn_set_data(c, NULL);
    net_conn_close(c);
    return;
  }
  net_conn_set_data(c, (void *)(intptr_t)(j + 1));
  n->peers[j].conn = c;
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct comm_net *n = ud;
  if (!net_conn_data(c)) return; /* one we refused */
  int j = conn_member(c);
  struct peer *p = &n->peers[j];
  if (p->conn != c) return;
  p->conn = NULL;
  p->left = true;
  drop_waiting(p);
  if (n->closing) return;
  if (status == 0) {
    pthread_mutex_lock(&n->mu);
    comm_transport_gone_locked(&n->t, j);
    pthread_mutex_unlock(&n->mu);
    log_info("comm: group member %d closed its connection", j);
    return;
  }
  int code = net_conn_judged_dead(c) ? RUMOR_ETIMEDOUT : -ECONNRESET;
  comm_transport_fail(&n->t, j, code, "group member %d (%s) lost: %s", j, net_conn_peer_addr(c),
                      detail && *detail ? detail : rumor_strerror(status));
}

static void on_dial(net_t *net, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)net;
  struct peer *p = arg;
  struct comm_net *n = p->n;
  int j = p->index;
  p->dialing = false;
  if (status < 0) {
    snprintf(p->dial_err, sizeof p->dial_err, "%s", detail && *detail ? detail : rumor_strerror(status));
    /* A refused handshake (another key or identity) is final; a member not
     * listening yet is dialed again until the connect deadline. */
    if (status == RUMOR_EAUTH && !n->closing) {
      comm_transport_fail(&n->t, j, RUMOR_EAUTH,
                          "group member %d at %s refused the handshake: %s (same cluster key and group identity?)", j,
                          p->addr, p->dial_err);
      return;
    }
    p->next_dial_ms = uv_now(&n->loop) + DIAL_RETRY_MS;
    return;
  }
  if (n->closing || memcmp(net_conn_peer_key(c), p->key, NET_PUBKEY_BYTES) != 0) {
    net_conn_set_data(c, NULL);
    net_conn_close(c);
    if (!n->closing)
      comm_transport_fail(&n->t, j, RUMOR_EAUTH, "%s answered with another member's identity than member %d's",
                          p->addr, j);
    return;
  }
  p->dialed = true;
  net_conn_set_data(c, (void *)(intptr_t)(j + 1));
  p->conn = c;
  send_hello(n, c);
}

static void start_dial(struct comm_net *n, struct peer *p) {
  int rc = net_dial(n->net, p->addr, on_dial, p);
  if (rc) {
    snprintf(p->dial_err, sizeof p->dial_err, "%s", rumor_strerror(rc));
    p->next_dial_ms = uv_now(&n->loop) + DIAL_RETRY_MS;
    return;
  }
  p->dialing = true;
}

/* Dials whom this member dials, and fails the group when the connect
 * deadline passes with a member not agreed. */
static void on_tick(uv_timer_t *tm) {
  struct comm_net *n = tm->data;
  if (n->closing) return;
  uint64_t now = uv_now(&n->loop);
  pthread_mutex_lock(&n->mu);
  bool failed = n->t.failed, all = n->ready_count == n->t.size - 1;
  pthread_mutex_unlock(&n->mu);
  if (failed || all) return;
  for (int j = 0; j < n->t.rank; j++) {
    struct peer *p = &n->peers[j];
    if (!p->dialed && !p->dialing && now >= p->next_dial_ms) start_dial(n, p);
  }
  if (now - n->start_ms <= n->connect_timeout_ms) return;
  for (int j = 0; j < n->t.size; j++) {
    struct peer *p = &n->peers[j];
    pthread_mutex_lock(&n->mu);
    bool ready = p->ready;
    pthread_mutex_unlock(&n->mu);
    if (j == n->t.rank || ready) continue;
    if (j < n->t.rank)
      comm_transport_fail(&n->t, j, RUMOR_ETIMEDOUT, "group member %d at %s did not %s within %u ms%s%s", j, p->addr,
                          p->dialed ? "agree" : "answer", n->connect_timeout_ms, p->dial_err[0] ? ": " : "",
                          p->dial_err);
    else
      comm_transport_fail(&n->t, j, RUMOR_ETIMEDOUT, "group member %d did not %s %s within %u ms", j,
                          p->conn ? "agree with" : "connect to", n->addr, n->connect_timeout_ms);
    return;
  }
}

/* ---- abort, ready, address ---- */

struct abort_req {
  struct comm_net *n;
  int member, code;
  char why[COMM_WHY_MAX];
};

/* Sends the ABORT also when the net is closing (status RUMOR_ECANCELED):
 * net_close runs queued calls before it closes the connections, so the
 * ABORT still goes out ahead of the BYE of a comm_free that follows. */
static void abort_on_loop(net_t *net, void *arg, int status) {
  (void)net;
  (void)status;
  struct abort_req *r = arg;
  for (int j = 0; j < r->n->t.size; j++)
    if (r->n->peers[j].conn) send_text(r->n->peers[j].conn, CMSG_ABORT, r->member, r->code, r->why);
  free(r);
}

static void net_abort(struct comm_transport *t, int member, int code, const char *why) {
  struct comm_net *n = of(t);
  struct abort_req *r = xmalloc(sizeof *r);
  r->n = n;
  r->member = member;
  r->code = code;
  snprintf(r->why, sizeof r->why, "%s", why);
  if (net_call(n->net, abort_on_loop, r) != 0) free(r);
}

static int net_wait_ready(struct comm_transport *t, struct rumor_err *e) {
  struct comm_net *n = of(t);
  int rc = 0;
  pthread_mutex_lock(&n->mu);
  while (!rc && n->ready_count < t->size - 1) {
    if (t->failed) {
      rc = comm_transport_failure_locked(t, e);
    } else if (t->stop && atomic_load(t->stop)) {
      comm_transport_fail_locked(t, t->rank, RUMOR_ECANCELED, "%s was stopped (signal %d) before the group was ready",
                                 t->label[t->rank], (int)atomic_load(t->stop));
      rc = comm_transport_failure_locked(t, e);
    } else if (t->stop) {
      struct timespec ts;
      clock_gettime(CLOCK_REALTIME, &ts);
      ts.tv_nsec += TICK_MS * 1000000L;
      if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
      pthread_cond_timedwait(&n->cond, &n->mu, &ts);
    } else {
      pthread_cond_wait(&n->cond, &n->mu);
    }
  }
  if (!rc && t->failed) rc = comm_transport_failure_locked(t, e);
  pthread_mutex_unlock(&n->mu);
  return rc;
}

static const char *net_address(const struct comm_transport *t) { return ((const struct comm_net *)t)->addr; }

/* ---- start and free ---- */

static void *loop_main(void *arg) {
  struct comm_net *n = arg;
  uv_run(&n->loop, UV_RUN_DEFAULT);
  return NULL;
}

static void free_net(struct comm_net *n) {
  comm_transport_destroy(&n->t);
  net_identity_wipe(&n->self);
  sodium_memzero(n->cluster_key, sizeof n->cluster_key);
  pthread_mutex_destroy(&n->mu);
  pthread_cond_destroy(&n->cond);
  free(n->peers);
  free(n);
}

static void on_net_closed(void *arg) {
  struct comm_net *n = arg;
  n->net = NULL;
  uv_close((uv_handle_t *)&n->tick, NULL); /* then the loop has nothing left and the thread ends */
}

static void close_on_loop(net_t *net, void *arg, int status) {
  (void)status;
  struct comm_net *n = arg;
  n->closing = true;
  for (int j = 0; j < n->t.size; j++) drop_waiting(&n->peers[j]);
  net_close(net, on_net_closed, n);
}

/* Waits at most flush_ms for what this member sent to be confirmed, unless
 * the group failed (nobody waits for it then). */
static void flush(struct comm_net *n, uint32_t flush_ms) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_sec += flush_ms / 1000;
  ts.tv_nsec += (long)(flush_ms % 1000) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  pthread_mutex_lock(&n->mu);
  while (n->pending > 0 && !n->t.failed)
    if (pthread_cond_timedwait(&n->cond, &n->mu, &ts) == ETIMEDOUT) break;
  if (n->pending > 0 && !n->t.failed)
    log_warn("comm: closing with %lld message%s unconfirmed", (long long)n->pending, n->pending == 1 ? "" : "s");
  pthread_mutex_unlock(&n->mu);
}

static void net_free(struct comm_transport *t, uint32_t flush_ms) {
  struct comm_net *n = of(t);
  flush(n, flush_ms);
  if (net_call(n->net, close_on_loop, n) != 0) log_warn("comm: the net was closed already");
  pthread_join(n->thread, NULL);
  int rc = uv_loop_close(&n->loop);
  if (rc) log_warn("comm: the loop did not close clean: %s", uv_strerror(rc));
  free_net(n);
}

static const struct comm_transport_ops net_ops = {
    .send = net_send,
    .recv = comm_transport_recv,
    .abort = net_abort,
    .wait_ready = net_wait_ready,
    .address = net_address,
    .free = net_free,
};

/* Checks what the caller gave before anything is allocated. */
static int check_config(const struct comm_net_config *cfg, struct rumor_err *e) {
  if (!cfg || !cfg->identity || !cfg->cluster_key)
    return rumor_err_set(e, -EINVAL, "comm: the group identity and the cluster key are required");
  if (cfg->size < 1 || cfg->size > COMM_MAX_MEMBERS || cfg->rank < 0 || cfg->rank >= cfg->size)
    return rumor_err_set(e, -EINVAL, "comm: member %d of %d (a group has 1 to %d members)", cfg->rank, cfg->size,
                         COMM_MAX_MEMBERS);
  if (cfg->key_base < 0 || cfg->key_base > 65535 - cfg->size)
    return rumor_err_set(e, -EINVAL, "comm: key base %d for %d members is outside 0 .. %d", cfg->key_base, cfg->size,
                         65535 - cfg->size);
  const char *g = cfg->group;
  if (!g || !*g || strlen(g) > GROUP_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "comm: the group name must have 1 to %d characters", GROUP_MAX);
  for (const char *p = g; *p; p++)
    if ((unsigned char)*p <= 0x20 || (unsigned char)*p > 0x7e)
      return rumor_err_set(e, RUMOR_EFORMAT, "comm: group name '%s': use letters, digits and punctuation", g);
  const char *a = cfg->agreement ? cfg->agreement : "";
  if (strlen(a) > AGREE_MAX)
    return rumor_err_set(e, RUMOR_ETOOBIG, "comm: the agreement text is over %d characters", AGREE_MAX);
  for (const char *p = a; *p; p++)
    if ((unsigned char)*p < 0x20 || (unsigned char)*p > 0x7e)
      return rumor_err_set(e, RUMOR_EFORMAT, "comm: the agreement text must be printable ASCII");
  const char *listen = cfg->listen ? cfg->listen : "127.0.0.1:0";
  if (strlen(listen) >= ADDR_MAX) return rumor_err_set(e, RUMOR_EFORMAT, "comm: listen address '%s' is too long", listen);
  if (net_addr_check_listen(listen, e)) return rumor_err_prefix(e, "comm: listen address");
  if (cfg->rank > 0 && !cfg->peers)
    return rumor_err_set(e, -EINVAL, "comm: member %d needs the addresses of members 0 to %d", cfg->rank, cfg->rank - 1);
  for (int j = 0; j < cfg->rank; j++) {
    if (!cfg->peers[j] || strlen(cfg->peers[j]) >= ADDR_MAX)
      return rumor_err_set(e, RUMOR_EFORMAT, "comm: member %d's address is missing or too long", j);
    if (net_addr_check_dial(cfg->peers[j], e)) return rumor_err_prefix(e, "comm: member %d's address", j);
  }
  uint32_t hb = cfg->heartbeat_ms ? cfg->heartbeat_ms : DEFAULT_HEARTBEAT_MS;
  uint32_t dead = cfg->dead_after_ms ? cfg->dead_after_ms : DEFAULT_DEAD_AFTER_MS;
  if (dead <= hb)
    return rumor_err_set(e, -EINVAL, "comm: dead_after_ms (%u) must exceed heartbeat_ms (%u)", dead, hb);
  return 0;
}

/* The net (the other members' keys as its allow-list), its listener and the
 * tick, on the caller's thread before the loop thread exists. */
static int start_net(struct comm_net *n, const struct comm_net_config *cfg, struct rumor_err *e) {
  int N = n->t.size;
  uint8_t(*keys)[NET_PUBKEY_BYTES] = xcalloc((size_t)N, sizeof *keys);
  size_t nkeys = 0;
  for (int j = 0; j < N; j++)
    if (j != n->t.rank) memcpy(keys[nkeys++], n->peers[j].key, NET_PUBKEY_BYTES);
  struct net_allowlist allow;
  net_allowlist_from_keys(&allow, (const uint8_t(*)[NET_PUBKEY_BYTES])keys, nkeys);
  free(keys);
  struct net_config nc;
  net_config_defaults(&nc);
  nc.identity = &n->self;
  nc.cluster_key = n->cluster_key;
  nc.allow = &allow;
  nc.idle_timeout_ms = 0; /* the heartbeat judges silence */
  nc.heartbeat_ms = cfg->heartbeat_ms ? cfg->heartbeat_ms : DEFAULT_HEARTBEAT_MS;
  nc.dead_after_ms = cfg->dead_after_ms ? cfg->dead_after_ms : DEFAULT_DEAD_AFTER_MS;
  nc.max_conns = (uint32_t)(2 * N + 8);
  nc.max_pending_handshakes = (uint32_t)(N + 8);
  nc.max_bulk_bytes = INBOX_MAX_BYTES + sizeof(float);
  const struct net_callbacks cbs = {.on_accept = on_accept,
                                    .on_message = on_message,
                                    .on_bulk_begin = on_bulk_begin,
                                    .on_bulk_done = on_bulk_done,
                                    .on_close = on_close};
  int rc = uv_loop_init(&n->loop);
  if (rc) {
    net_allowlist_free(&allow);
    return rumor_err_set(e, rc, "comm: cannot create a loop: %s", uv_strerror(rc));
  }
  rc = net_init(&n->net, &n->loop, &nc, &cbs, n, e);
  net_allowlist_free(&allow);
  if (!rc && (rc = net_listen(n->net, n->listen, e))) rumor_err_prefix(e, "comm: listen address");
  if (rc) {
    if (n->net) net_close(n->net, NULL, NULL);
    uv_run(&n->loop, UV_RUN_DEFAULT); /* nothing else is open: the net closes */
    (void)uv_loop_close(&n->loop);
    return rc;
  }
  const char *colon = strrchr(n->listen, ':');
  snprintf(n->addr, sizeof n->addr, "%.*s:%d", (int)(colon - n->listen), n->listen, net_listen_port(n->net));
  uv_update_time(&n->loop);
  n->start_ms = uv_now(&n->loop);
  uv_timer_init(&n->loop, &n->tick);
  n->tick.data = n;
  uv_timer_start(&n->tick, on_tick, 0, TICK_MS);
  return 0;
}

int comm_net_start(comm_t **out, const struct comm_net_config *cfg, struct rumor_err *e) {
  *out = NULL;
  int rc = check_config(cfg, e);
  if (rc) return rc;
  if (net_crypto_init()) return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  struct comm_net *n = xcalloc(1, sizeof *n);
  pthread_mutex_init(&n->mu, NULL);
  pthread_cond_init(&n->cond, NULL);
  comm_transport_init(&n->t, &net_ops, cfg->rank, cfg->size, &n->mu, &n->cond);
  n->t.stop = cfg->stop;
  snprintf(n->group, sizeof n->group, "%s", cfg->group);
  snprintf(n->agreement, sizeof n->agreement, "%s", cfg->agreement ? cfg->agreement : "");
  snprintf(n->listen, sizeof n->listen, "%s", cfg->listen ? cfg->listen : "127.0.0.1:0");
  n->connect_timeout_ms = cfg->connect_timeout_ms ? cfg->connect_timeout_ms : DEFAULT_CONNECT_MS;
  memcpy(n->cluster_key, cfg->cluster_key, NET_CLUSTER_KEY_BYTES);
  derive_identity(cfg->identity, cfg->key_base + cfg->rank, &n->self);
  n->peers = xcalloc((size_t)cfg->size, sizeof *n->peers);
  for (int j = 0; j < cfg->size; j++) {
    struct peer *p = &n->peers[j];
    p->n = n;
    p->index = j;
    struct net_identity id;
    derive_identity(cfg->identity, cfg->key_base + j, &id);
    memcpy(p->key, id.pk, NET_PUBKEY_BYTES);
    net_identity_wipe(&id);
    if (j < cfg->rank) {
      snprintf(p->addr, sizeof p->addr, "%s", cfg->peers[j]);
      comm_transport_set_addr_locked(&n->t, j, p->addr); /* no other thread yet */
    }
  }
  if ((rc = start_net(n, cfg, e))) {
    free_net(n);
    return rc;
  }
  comm_transport_set_addr_locked(&n->t, cfg->rank, n->addr);
  if ((rc = pthread_create(&n->thread, NULL, loop_main, n))) {
    /* Not started: close what start_net opened, here. */
    net_close(n->net, NULL, NULL);
    uv_close((uv_handle_t *)&n->tick, NULL);
    uv_run(&n->loop, UV_RUN_DEFAULT);
    (void)uv_loop_close(&n->loop);
    free_net(n);
    return rumor_err_set(e, -rc, "comm: cannot start the loop thread: %s", strerror(rc));
  }
  *out = comm_create_top(&n->t);
  return 0;
}
