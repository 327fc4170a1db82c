/* Connections between neighbouring pipeline stages over net/. */
#include "peer/pipeline/pipeline.h"

#include <errno.h>
#include <pthread.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* Control message types ("t") and the protocol version ("v"). */
enum {
  LMSG_HELLO = 1,    /* dialer → acceptor: group, stage, stages, agreement */
  LMSG_HELLO_OK = 2, /* acceptor → dialer */
  LMSG_REJECT = 3,   /* either way: why */
  LMSG_START = 4,    /* forward: step, epoch, samples */
  LMSG_ABORT = 5,    /* either way: the stage that failed, why */
  LMSG_PING = 6,     /* either way, every idle_timeout/4 (≤ 1 s): keeps the idle timeout away */
};
_Static_assert(LMSG_HELLO == 1 && LMSG_HELLO_OK == 2 && LMSG_REJECT == 3 && LMSG_START == 4 && LMSG_ABORT == 5 &&
                   LMSG_PING == 6,
               "stage link message numbers travel on the wire");
_Static_assert(STAGE_LINK_ACT == 1 && STAGE_LINK_GRAD == 2 && STAGE_LINK_EVAL == 3 && STAGE_LINK_TIED_PARAM == 4 &&
                   STAGE_LINK_TIED_GRAD == 5 && STAGE_LINK_AGREE == 6,
               "transfer kinds travel on the wire");
#define LINK_PROTO_VERSION 1

/* Transfer metadata: magic, version, kind, step, micro-batch, rows; 32
 * bytes, little-endian. */
#define META_MAGIC 0x47545352u /* "RSTG" */
#define META_BYTES 32

#define TICK_MS 100
/* PINGs go out at a quarter of the idle timeout (at most every second), so a
 * late tick or a slow neighbour never looks silent. */
#define PING_MS_MAX 1000
#define DIAL_RETRY_MS 200
#define INBOX_MAX_ITEMS 65536
#define INBOX_MAX_BYTES (4ull << 30)
#define WHY_MAX 400

struct item {
  struct item *next;
  enum stage_link_dir dir;
  uint32_t kind;
  int64_t step;
  int32_t mb;
  int64_t rows;
  size_t bytes;
  float *data;
};

struct tx {
  struct stage_link *l;
  enum stage_link_dir dir;
  enum net_dtype wire;
  uint8_t meta[META_BYTES];
  float *data;
  uint64_t count;
};

struct stage_link {
  struct stage_link_config cfg;
  char group[STAGE_LINK_GROUP_MAX + 1];
  char agreement[STAGE_LINK_AGREE_MAX + 1];
  char prev[128];
  char listen[128];
  char addr[128];
  struct net_identity self;                   /* this stage's derived identity */
  uint8_t want_key[2][NET_PUBKEY_BYTES];      /* the neighbours' derived keys */
  bool has[2];                                /* a neighbour exists in this direction */
  uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
  void (*idle)(void *);
  void *idle_arg;

  /* Loop thread only (the host's event loop). */
  uv_loop_t *loop;
  bool running;  /* the net and the timer exist on the loop (written before the start returns) */
  bool handles_closed; /* under mu: the close finished */
  int start_rc;  /* what the start on the loop returned */
  struct rumor_err start_err;
  net_t *net;
  uv_timer_t tick;
  net_conn_t *conn[2];
  /* Liveness, per direction: bytes received so far on conn[d] and when that
   * count last moved. net's own idle timeout also counts bytes we send (our
   * PINGs), so it cannot tell that the neighbour has gone silent. */
  uint64_t rx_bytes[2], rx_at_ms[2];
  uint64_t start_ms, last_ping_ms, next_dial_ms;
  bool dialing, dialed, closing;
  char dial_err[256];

  /* Shared, under mu. */
  pthread_mutex_t mu;
  pthread_cond_t cond;
  bool ready[2];  /* connected and agreed */
  bool closed[2]; /* the neighbour closed the link gracefully */
  bool failed;
  int fail_stage;
  char why[WHY_MAX];
  struct item *inbox, *inbox_tail;
  size_t inbox_items, inbox_bytes;
  bool have_start;
  struct stage_link_pos start;
  int64_t pending; /* transfers sent and not yet confirmed */
};

static int neighbour(const struct stage_link *l, enum stage_link_dir d) {
  return d == STAGE_LINK_PREV ? l->cfg.stage - 1 : l->cfg.stage + 1;
}

/* Records the first failure and wakes the training thread. Any thread. */
static void fail(struct stage_link *l, int stage, const char *fmt, ...) RUMOR_PRINTF(3, 4);
static void fail(struct stage_link *l, int stage, const char *fmt, ...) {
  pthread_mutex_lock(&l->mu);
  if (!l->failed) {
    l->failed = true;
    l->fail_stage = stage;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(l->why, sizeof l->why, fmt, ap);
    va_end(ap);
  }
  pthread_cond_broadcast(&l->cond);
  pthread_mutex_unlock(&l->mu);
}

/* ---- identities ---- */

/* Stage `stage`'s identity: an Ed25519 key pair from a seed that is
 * BLAKE2b-256 of a label, keyed with the group identity's secret seed (the
 * first NET_SEED_BYTES of libsodium's secret key). */
static void derive_identity(const struct net_identity *group, int stage, struct net_identity *out) {
  char label[64];
  snprintf(label, sizeof label, "rumor pipeline stage %d v1", stage);
  net_identity_derive(group, label, out);
}

/* ---- metadata ---- */


/* Floats per row of a transfer of `kind` to or from the neighbour in `d`:
 * activations and their gradients by the stage's widths; a tied
 * parameter's value or gradient in one row of tied_floats; an agreement
 * in one row of STAGE_LINK_AGREE_FLOATS. */
static int64_t transfer_width(const stage_link_t *l, enum stage_link_dir d, uint32_t kind) {
  if (kind == STAGE_LINK_TIED_PARAM || kind == STAGE_LINK_TIED_GRAD) return l->cfg.tied_floats;
  if (kind == STAGE_LINK_AGREE) return STAGE_LINK_AGREE_FLOATS;
  return d == STAGE_LINK_PREV ? l->cfg.in_width : l->cfg.out_width;
}

/* Transfers of one row in f32: a tied parameter, its gradient, an
 * agreement. */
static bool exact_kind(uint32_t kind) {
  return kind == STAGE_LINK_TIED_PARAM || kind == STAGE_LINK_TIED_GRAD || kind == STAGE_LINK_AGREE;
}

/* The encoding of a transfer of `kind`: the configured one for activations
 * and their gradients (values a step uses once, where 8 or 16 bits lose
 * little), f32 for the rest (the model itself, or exact values). */
static enum net_dtype transfer_wire(const stage_link_t *l, uint32_t kind) {
  return exact_kind(kind) ? NET_DTYPE_F32 : l->cfg.wire;
}

static int64_t max_rows(const stage_link_t *l, uint32_t kind) { return exact_kind(kind) ? 1 : l->cfg.max_rows; }

/* magic u32 | version u16, kind u16 | step u64 | mb u32 | 0 u32 | rows u64 */
static void meta_write(uint8_t *m, uint32_t kind, int64_t step, int32_t mb, int64_t rows) {
  le_put_u32(m, META_MAGIC);
  le_put_u32(m + 4, (uint32_t)LINK_PROTO_VERSION | kind << 16);
  le_put_u64(m + 8, (uint64_t)step);
  le_put_u32(m + 16, (uint32_t)mb);
  le_put_u32(m + 20, 0);
  le_put_u64(m + 24, (uint64_t)rows);
}

/* ---- sending (loop thread) ---- */

static void tx_free(struct tx *t) {
  struct stage_link *l = t->l;
  free(t->data);
  free(t);
  pthread_mutex_lock(&l->mu);
  l->pending--;
  pthread_cond_broadcast(&l->cond);
  pthread_mutex_unlock(&l->mu);
}

static void on_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct tx *t = arg;
  struct stage_link *l = t->l;
  if (status != 0 && !l->closing)
    log_debug("transfer %llu to stage %d ended with %s", (unsigned long long)id, neighbour(l, t->dir),
              rumor_strerror(status));
  tx_free(t);
}

static void tx_on_loop(net_t *n, void *arg, int status) {
  struct tx *t = arg;
  struct stage_link *l = t->l;
  net_conn_t *c = status == 0 ? l->conn[t->dir] : NULL;
  if (!c) {
    tx_free(t); /* the link has failed or is closing: the failure is recorded */
    return;
  }
  struct net_bulk_send s = {.src = t->data, .count = t->count, .wire = t->wire, .no_digest = true,
                            .meta = t->meta, .meta_len = META_BYTES, .done = on_sent, .arg = t};
  int rc = net_conn_send_bulk(c, &s, NULL);
  if (rc) {
    fail(l, neighbour(l, t->dir), "cannot send to stage %d/%d: %s", neighbour(l, t->dir), l->cfg.stages,
         rumor_strerror(rc));
    tx_free(t);
  }
}

static int send_msg(struct stage_link *l, net_conn_t *c, struct net_msgbuf *b) {
  int rc = net_conn_send_msg(c, b);
  net_msgbuf_free(b);
  if (rc) log_debug("stage link: cannot send a message to %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
  return rc;
}

/* ---- the connections (loop thread) ---- */

static enum stage_link_dir conn_dir(net_conn_t *c) { return (enum stage_link_dir)((intptr_t)net_conn_data(c) - 1); }

static void send_hello(struct stage_link *l, net_conn_t *c) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, LMSG_HELLO, LINK_PROTO_VERSION);
  net_msgbuf_put_str(&b, "group", l->group, strlen(l->group));
  net_msgbuf_put_int(&b, "stage", l->cfg.stage);
  net_msgbuf_put_int(&b, "stages", l->cfg.stages);
  net_msgbuf_put_str(&b, "agree", l->agreement, strlen(l->agreement));
  (void)send_msg(l, c, &b);
}

static void reject(struct stage_link *l, net_conn_t *c, const char *why) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, LMSG_REJECT, LINK_PROTO_VERSION);
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  (void)send_msg(l, c, &b);
}

/* Copies a string field (printable ASCII) into buf; false when absent,
 * too long or not printable. */
static bool get_text(const struct net_msg *m, const char *key, char *buf, size_t n) {
  const char *s;
  size_t len;
  if (net_msg_get_str(m, key, &s, &len) || len >= n) return false;
  for (size_t i = 0; i < len; i++)
    if ((unsigned char)s[i] < 0x20 || (unsigned char)s[i] > 0x7e) return false;
  memcpy(buf, s, len);
  buf[len] = '\0';
  return true;
}

/* The first space-separated "key=value" item where two agreement texts
 * differ, for a message that says what to fix. */
static void first_difference(const char *a, const char *b, char *da, char *db, size_t n) {
  for (;;) {
    size_t la = strcspn(a, " "), lb = strcspn(b, " ");
    if (la != lb || strncmp(a, b, la) != 0 || !a[la] || !b[lb]) {
      snprintf(da, n, "%.*s", (int)(la < n - 1 ? la : n - 1), a);
      snprintf(db, n, "%.*s", (int)(lb < n - 1 ? lb : n - 1), b);
      return;
    }
    a += la + 1;
    b += lb + 1;
  }
}

static void handle_hello(struct stage_link *l, net_conn_t *c, const struct net_msg *m) {
  char group[STAGE_LINK_GROUP_MAX + 1], agree[STAGE_LINK_AGREE_MAX + 1], why[WHY_MAX];
  int64_t stage, stages;
  int me = l->cfg.stage, S = l->cfg.stages;
  if (!get_text(m, "group", group, sizeof group) || net_msg_get_int(m, "stage", &stage) ||
      net_msg_get_int(m, "stages", &stages) || !get_text(m, "agree", agree, sizeof agree)) {
    fail(l, me + 1, "stage %d/%d sent a malformed HELLO", me + 1, S);
    net_conn_close(c);
    return;
  }
  why[0] = '\0';
  if (strcmp(group, l->group) != 0)
    snprintf(why, sizeof why, "group '%s' dialed stage %d of group '%s'", group, me, l->group);
  else if (stages != S || stage != me + 1)
    snprintf(why, sizeof why, "stage %lld/%lld dialed stage %d/%d (want stage %d/%d)", (long long)stage,
             (long long)stages, me, S, me + 1, S);
  else if (strcmp(agree, l->agreement) != 0) {
    char theirs[160], ours[160];
    first_difference(agree, l->agreement, theirs, ours, sizeof ours);
    snprintf(why, sizeof why, "stage %d/%d is configured differently: it has %s, stage %d has %s", me + 1, S, theirs, me,
             ours);
  }
  if (why[0]) {
    reject(l, c, why);
    fail(l, me + 1, "%s", why);
    return;
  }
  struct net_msgbuf b;
  net_msgbuf_init(&b, LMSG_HELLO_OK, LINK_PROTO_VERSION);
  if (send_msg(l, c, &b)) return;
  pthread_mutex_lock(&l->mu);
  l->ready[STAGE_LINK_NEXT] = true;
  pthread_cond_broadcast(&l->cond);
  pthread_mutex_unlock(&l->mu);
  log_info("stage %d/%d of group %s connected from %s", me + 1, S, l->group, net_conn_peer_addr(c));
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct stage_link *l = ud;
  if (!net_conn_data(c)) return; /* one we refused, closing */
  enum stage_link_dir d = conn_dir(c);
  int other = neighbour(l, d), S = l->cfg.stages;
  pthread_mutex_lock(&l->mu);
  bool ready = l->ready[d];
  pthread_mutex_unlock(&l->mu);
  if (m->version != LINK_PROTO_VERSION) {
    fail(l, other, "stage %d/%d speaks stage-link version %llu, this stage %d", other, S,
         (unsigned long long)m->version, LINK_PROTO_VERSION);
    net_conn_close(c);
    return;
  }
  switch (m->type) {
  case LMSG_HELLO:
    if (d != STAGE_LINK_NEXT || ready) break;
    handle_hello(l, c, m);
    return;
  case LMSG_HELLO_OK:
    if (d != STAGE_LINK_PREV || ready) break;
    pthread_mutex_lock(&l->mu);
    l->ready[STAGE_LINK_PREV] = true;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mu);
    log_info("connected to stage %d/%d of group %s at %s", other, S, l->group, net_conn_peer_addr(c));
    return;
  case LMSG_REJECT: {
    char why[WHY_MAX];
    if (!get_text(m, "why", why, sizeof why)) snprintf(why, sizeof why, "(no reason given)");
    fail(l, other, "stage %d/%d refused this stage: %s", other, S, why);
    return;
  }
  case LMSG_START: {
    if (d != STAGE_LINK_PREV || !ready) break;
    struct stage_link_pos p;
    if (net_msg_get_int(m, "step", &p.step) || net_msg_get_int(m, "epoch", &p.epoch) ||
        net_msg_get_int(m, "samples", &p.samples) || p.step < 0 || p.epoch < 0 || p.samples < 0)
      break;
    pthread_mutex_lock(&l->mu);
    l->start = p;
    l->have_start = true;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mu);
    return;
  }
  case LMSG_ABORT: {
    int64_t stage;
    char why[WHY_MAX];
    if (net_msg_get_int(m, "stage", &stage) || stage < 0 || stage >= S || !get_text(m, "why", why, sizeof why)) break;
    fail(l, (int)stage, "%s", why);
    return;
  }
  case LMSG_PING: return;
  default: break;
  }
  fail(l, other, "stage %d/%d broke the stage-link protocol (message type %llu)", other, S, (unsigned long long)m->type);
  net_conn_close(c);
}

static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct stage_link *l = ud;
  if (!net_conn_data(c)) return RUMOR_ECANCELED; /* one we refused, closing */
  enum stage_link_dir d = conn_dir(c);
  int other = neighbour(l, d), S = l->cfg.stages;
  const uint8_t *m = info->meta;
  pthread_mutex_lock(&l->mu);
  bool ready = l->ready[d];
  size_t items = l->inbox_items, bytes = l->inbox_bytes;
  pthread_mutex_unlock(&l->mu);
  char why[200] = "";
  uint32_t kind = 0;
  int64_t rows = 0, width = 0;
  if (!ready) snprintf(why, sizeof why, "a transfer before HELLO");
  else if (info->meta_len != META_BYTES || le_get_u32(m) != META_MAGIC || (le_get_u32(m + 4) & 0xffff) != LINK_PROTO_VERSION)
    snprintf(why, sizeof why, "a transfer without valid metadata");
  else {
    kind = le_get_u32(m + 4) >> 16;
    rows = (int64_t)le_get_u64(m + 24);
    bool kind_ok = kind == STAGE_LINK_AGREE ||
                   (d == STAGE_LINK_PREV ? (kind == STAGE_LINK_ACT || kind == STAGE_LINK_EVAL ||
                                            (kind == STAGE_LINK_TIED_PARAM && l->cfg.tied_floats > 0))
                                         : (kind == STAGE_LINK_GRAD ||
                                            (kind == STAGE_LINK_TIED_GRAD && l->cfg.tied_floats > 0)));
    width = transfer_width(l, d, kind);
    if (!kind_ok) snprintf(why, sizeof why, "a transfer of kind %u from the wrong side", kind);
    else if (info->wire != transfer_wire(l, kind))
      snprintf(why, sizeof why, "a transfer of kind %u in %s (want %s)", kind, net_dtype_name(info->wire),
               net_dtype_name(transfer_wire(l, kind)));
    else if (rows < 1 || rows > max_rows(l, kind) || info->count != (uint64_t)(rows * width))
      snprintf(why, sizeof why, "%llu floats as %lld rows (want rows in [1, %lld] of %lld floats)",
               (unsigned long long)info->count, (long long)rows, (long long)max_rows(l, kind), (long long)width);
    else if (items >= INBOX_MAX_ITEMS || bytes + info->count * sizeof(float) > INBOX_MAX_BYTES)
      snprintf(why, sizeof why, "more transfers than the schedule allows (%zu waiting, %zu bytes)", items, bytes);
  }
  if (why[0]) {
    /* Refused; the failure stops this stage, which closes the link. */
    fail(l, other, "stage %d/%d sent %s", other, S, why);
    return RUMOR_EPROTO;
  }
  struct item *it = calloc(1, sizeof *it);
  float *buf = malloc(info->count * sizeof(float));
  if (!it || !buf) {
    free(it);
    free(buf);
    fail(l, l->cfg.stage, "out of memory for a transfer of %llu floats from stage %d", (unsigned long long)info->count,
         other);
    return -ENOMEM;
  }
  it->dir = d;
  it->kind = kind;
  it->step = (int64_t)le_get_u64(m + 8);
  it->mb = (int32_t)le_get_u32(m + 16);
  it->rows = rows;
  it->bytes = info->count * sizeof(float);
  it->data = buf;
  *dst = buf;
  *dst_arg = it;
  return 0;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  struct stage_link *l = ud;
  struct item *it = dst_arg;
  if (status != 0) {
    /* Cut by a closing connection: on_close reports why. */
    free(it->data);
    free(it);
    return;
  }
  pthread_mutex_lock(&l->mu);
  if (l->inbox_tail) l->inbox_tail->next = it;
  else l->inbox = it;
  l->inbox_tail = it;
  l->inbox_items++;
  l->inbox_bytes += it->bytes;
  pthread_cond_broadcast(&l->cond);
  pthread_mutex_unlock(&l->mu);
}

static void on_accept(net_conn_t *c, void *ud) {
  struct stage_link *l = ud;
  if (!l->has[STAGE_LINK_NEXT] || l->conn[STAGE_LINK_NEXT] || l->closing ||
      memcmp(net_conn_peer_key(c), l->want_key[STAGE_LINK_NEXT], NET_PUBKEY_BYTES) != 0) {
    log_warn("stage link: unexpected connection from %s; closing it", net_conn_peer_name(c));
    net_conn_set_data(c, NULL);
    net_conn_close(c);
    return;
  }
  net_conn_set_data(c, (void *)(intptr_t)(STAGE_LINK_NEXT + 1));
  l->conn[STAGE_LINK_NEXT] = c;
  l->rx_at_ms[STAGE_LINK_NEXT] = 0; /* the tick starts the silence clock */
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct stage_link *l = ud;
  if (!net_conn_data(c)) return; /* one we refused */
  enum stage_link_dir d = conn_dir(c);
  if (l->conn[d] != c) return;
  l->conn[d] = NULL;
  l->rx_at_ms[d] = 0;
  int other = neighbour(l, d), S = l->cfg.stages;
  if (l->closing) return;
  if (status == 0) {
    pthread_mutex_lock(&l->mu);
    l->closed[d] = true;
    pthread_cond_broadcast(&l->cond);
    pthread_mutex_unlock(&l->mu);
    log_info("stage %d/%d closed the link", other, S);
    return;
  }
  fail(l, other, "stage %d/%d (%s) is gone: %s", other, S, net_conn_peer_addr(c),
       detail && *detail ? detail : rumor_strerror(status));
}

static void start_dial(struct stage_link *l);

static void on_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct stage_link *l = arg;
  l->dialing = false;
  if (status < 0) {
    snprintf(l->dial_err, sizeof l->dial_err, "%s", detail && *detail ? detail : rumor_strerror(status));
    /* Refused by the handshake (wrong key or identity) is final; a stage
     * not listening yet is retried until the connect deadline. */
    if (status == RUMOR_EAUTH) {
      fail(l, l->cfg.stage - 1, "stage %d/%d at %s refused the handshake: %s (same --cluster-key and --identity?)",
           l->cfg.stage - 1, l->cfg.stages, l->prev, l->dial_err);
      return;
    }
    l->next_dial_ms = uv_now(l->loop) + DIAL_RETRY_MS;
    return;
  }
  if (l->closing || memcmp(net_conn_peer_key(c), l->want_key[STAGE_LINK_PREV], NET_PUBKEY_BYTES) != 0) {
    net_conn_set_data(c, NULL);
    net_conn_close(c);
    if (!l->closing)
      fail(l, l->cfg.stage - 1, "%s answered with another identity than stage %d/%d of this group", l->prev,
           l->cfg.stage - 1, l->cfg.stages);
    return;
  }
  l->dialed = true;
  net_conn_set_data(c, (void *)(intptr_t)(STAGE_LINK_PREV + 1));
  l->conn[STAGE_LINK_PREV] = c;
  l->rx_at_ms[STAGE_LINK_PREV] = 0; /* the tick starts the silence clock */
  send_hello(l, c);
}

static void start_dial(struct stage_link *l) {
  int rc = net_dial(l->net, l->prev, on_dial, l);
  if (rc) {
    snprintf(l->dial_err, sizeof l->dial_err, "%s", rumor_strerror(rc));
    l->next_dial_ms = uv_now(l->loop) + DIAL_RETRY_MS;
    return;
  }
  l->dialing = true;
}

static void on_tick(uv_timer_t *t) {
  struct stage_link *l = t->data;
  if (l->closing) return;
  uint64_t now = uv_now(l->loop);
  pthread_mutex_lock(&l->mu);
  bool ready_prev = !l->has[STAGE_LINK_PREV] || l->ready[STAGE_LINK_PREV];
  bool ready_next = !l->has[STAGE_LINK_NEXT] || l->ready[STAGE_LINK_NEXT];
  bool failed = l->failed;
  pthread_mutex_unlock(&l->mu);
  if (failed) return;
  if (l->has[STAGE_LINK_PREV] && !l->dialed && !l->dialing && now >= l->next_dial_ms) start_dial(l);
  if (now - l->start_ms > l->cfg.connect_timeout_ms) {
    int me = l->cfg.stage, S = l->cfg.stages;
    if (!ready_prev)
      fail(l, me - 1, "stage %d/%d at %s did not %s within %u ms%s%s", me - 1, S, l->prev,
           l->dialed ? "agree" : "answer", l->cfg.connect_timeout_ms, l->dial_err[0] ? ": " : "", l->dial_err);
    else if (!ready_next)
      fail(l, me + 1, "stage %d/%d did not connect to %s within %u ms", me + 1, S, l->addr, l->cfg.connect_timeout_ms);
  }
  for (int d = 0; d < 2; d++) {
    if (!l->conn[d]) continue;
    struct net_conn_stats st;
    net_conn_stats_get(l->conn[d], &st);
    if (st.bytes_in != l->rx_bytes[d] || !l->rx_at_ms[d]) {
      l->rx_bytes[d] = st.bytes_in;
      l->rx_at_ms[d] = now;
    } else if (l->cfg.idle_timeout_ms && now - l->rx_at_ms[d] >= l->cfg.idle_timeout_ms) {
      int other = neighbour(l, (enum stage_link_dir)d);
      fail(l, other, "stage %d/%d is gone: silent for %llu ms (limit %u ms)", other, l->cfg.stages,
           (unsigned long long)(now - l->rx_at_ms[d]), l->cfg.idle_timeout_ms);
      net_conn_close(l->conn[d]);
      return;
    }
  }
  uint32_t ping_ms = l->cfg.idle_timeout_ms / 4;
  if (ping_ms == 0 || ping_ms > PING_MS_MAX) ping_ms = PING_MS_MAX;
  if (now - l->last_ping_ms >= ping_ms) {
    l->last_ping_ms = now;
    for (int d = 0; d < 2; d++)
      if (l->conn[d]) {
        struct net_msgbuf b;
        net_msgbuf_init(&b, LMSG_PING, LINK_PROTO_VERSION);
        (void)send_msg(l, l->conn[d], &b);
      }
  }
}

/* ---- start and stop ---- */

static void free_link(struct stage_link *l) {
  for (struct item *it = l->inbox, *nx; it; it = nx) {
    nx = it->next;
    free(it->data);
    free(it);
  }
  net_identity_wipe(&l->self);
  sodium_memzero(l->cluster_key, sizeof l->cluster_key);
  pthread_mutex_destroy(&l->mu);
  pthread_cond_destroy(&l->cond);
  free(l);
}

/* The part of the start that runs on the host's loop thread: the net (with
 * the neighbours' keys as its allow-list), the listener and the timer. */
static void start_on_loop(uv_loop_t *loop, void *arg) {
  struct stage_link *l = arg;
  struct rumor_err *e = &l->start_err;
  l->loop = loop;
  uint8_t keys[2][NET_PUBKEY_BYTES];
  size_t nkeys = 0;
  for (int d = 0; d < 2; d++)
    if (l->has[d]) memcpy(keys[nkeys++], l->want_key[d], NET_PUBKEY_BYTES);
  struct net_allowlist allow;
  net_allowlist_from_keys(&allow, (const uint8_t(*)[NET_PUBKEY_BYTES])keys, nkeys);
  struct net_config nc;
  net_config_defaults(&nc);
  nc.identity = &l->self;
  nc.cluster_key = l->cluster_key;
  nc.allow = &allow;
  nc.idle_timeout_ms = l->cfg.idle_timeout_ms;
  nc.heartbeat_ms = l->cfg.heartbeat_ms;
  nc.dead_after_ms = l->cfg.dead_after_ms;
  nc.max_conns = 16;
  nc.max_pending_handshakes = 8;
  /* One transfer per micro-batch: latency matters more here than spreading
   * the sealing over worker threads (inline sealing measured 10-30 % shorter
   * steps when compute is negligible: fewer thread hand-offs per transfer). */
  nc.offload = false;
  int64_t w = l->cfg.in_width > l->cfg.out_width ? l->cfg.in_width : l->cfg.out_width;
  int64_t most = l->cfg.max_rows * w > l->cfg.tied_floats ? l->cfg.max_rows * w : l->cfg.tied_floats;
  if (most < STAGE_LINK_AGREE_FLOATS) most = STAGE_LINK_AGREE_FLOATS;
  nc.max_bulk_bytes = (uint64_t)most * sizeof(float) + 1;
  const struct net_callbacks cbs = {.on_accept = on_accept,
                                    .on_message = on_message,
                                    .on_bulk_begin = on_bulk_begin,
                                    .on_bulk_done = on_bulk_done,
                                    .on_close = on_close};
  int rc = net_init(&l->net, loop, &nc, &cbs, l, e);
  net_allowlist_free(&allow);
  if (rc) {
    l->start_rc = rc;
    return;
  }
  if (l->has[STAGE_LINK_NEXT]) {
    const char *lst = l->listen;
    if ((rc = net_listen(l->net, lst, e))) {
      rumor_err_prefix(e, "--link-listen");
      l->start_rc = rc;
      net_close(l->net, NULL, NULL); /* nothing else is open: it closes on its own */
      l->net = NULL;
      return;
    }
    const char *colon = strrchr(lst, ':');
    snprintf(l->addr, sizeof l->addr, "%.*s:%d", (int)(colon - lst), lst, net_listen_port(l->net));
  }
  uv_update_time(loop);
  l->start_ms = l->last_ping_ms = uv_now(loop);
  uv_timer_init(loop, &l->tick);
  l->tick.data = l;
  uv_timer_start(&l->tick, on_tick, 0, TICK_MS);
  l->running = true;
}

int stage_link_check_group(const char *group, struct rumor_err *e) {
  if (!group || !*group || strlen(group) > STAGE_LINK_GROUP_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "the group name must have 1 to %d characters", STAGE_LINK_GROUP_MAX);
  for (const char *p = group; *p; p++)
    if ((unsigned char)*p <= 0x20 || (unsigned char)*p > 0x7e || *p == '"' || *p == '\\')
      return rumor_err_set(e, RUMOR_EFORMAT, "group name '%s': use letters, digits and punctuation (no spaces or quotes)",
                           group);
  return 0;
}

int stage_link_start(stage_link_t **out, const struct stage_link_config *cfg, struct rumor_err *e) {
  *out = NULL;
  RUMOR_ASSERT(cfg->stages >= 1 && 0 <= cfg->stage && cfg->stage < cfg->stages && cfg->max_rows >= 1);
  int rc = stage_link_check_group(cfg->group, e);
  if (rc) return rc;
  enum net_dtype wire = cfg->wire ? cfg->wire : NET_DTYPE_F32;
  RUMOR_ASSERT(net_dtype_bytes(wire, 1) > 0); /* the CLI parsed it */
  char wire_item[32];
  snprintf(wire_item, sizeof wire_item, " wire=%s", net_dtype_name(wire));
  if (strlen(cfg->agreement) + strlen(wire_item) > STAGE_LINK_AGREE_MAX)
    return rumor_err_set(e, RUMOR_ETOOBIG, "the stage agreement text is over %d characters", STAGE_LINK_AGREE_MAX);
  if (cfg->stage > 0 && (!cfg->prev || !*cfg->prev))
    return rumor_err_set(e, RUMOR_EFORMAT, "stage %d/%d needs the previous stage's address (--link-prev HOST:PORT)",
                         cfg->stage, cfg->stages);
  if (cfg->prev && strlen(cfg->prev) >= sizeof ((struct stage_link *)0)->prev)
    return rumor_err_set(e, RUMOR_EFORMAT, "--link-prev '%s' is too long", cfg->prev);
  if (cfg->stage > 0 && net_addr_check_dial(cfg->prev, e)) return rumor_err_prefix(e, "--link-prev");
  const char *listen = cfg->listen ? cfg->listen : "127.0.0.1:0";
  if (strlen(listen) >= sizeof ((struct stage_link *)0)->listen)
    return rumor_err_set(e, RUMOR_EFORMAT, "--link-listen '%s' is too long", listen);
  if (net_addr_check_listen(listen, e)) return rumor_err_prefix(e, "--link-listen");
  struct stage_link *l = xcalloc(1, sizeof *l);
  l->cfg = *cfg;
  snprintf(l->group, sizeof l->group, "%s", cfg->group);
  /* The wire encoding is agreed like the rest: a neighbour that sends
   * another one would be refused at its first transfer anyway. */
  snprintf(l->agreement, sizeof l->agreement, "%s%s", cfg->agreement, wire_item);
  l->cfg.wire = wire;
  snprintf(l->prev, sizeof l->prev, "%s", cfg->prev ? cfg->prev : "");
  snprintf(l->listen, sizeof l->listen, "%s", listen);
  l->cfg.group = l->group;
  l->cfg.agreement = l->agreement;
  l->cfg.prev = l->prev;
  l->cfg.identity = NULL;
  l->cfg.cluster_key = NULL;
  l->cfg.listen = l->listen;
  pthread_mutex_init(&l->mu, NULL);
  pthread_cond_init(&l->cond, NULL);
  l->has[STAGE_LINK_PREV] = cfg->stage > 0;
  l->has[STAGE_LINK_NEXT] = cfg->stage < cfg->stages - 1;
  if (cfg->stages == 1) { /* a group of one: nothing to connect */
    *out = l;
    return 0;
  }
  RUMOR_ASSERT(cfg->host);
  if (net_crypto_init()) {
    free_link(l);
    return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  }
  derive_identity(cfg->identity, cfg->stage, &l->self);
  memcpy(l->cluster_key, cfg->cluster_key, NET_CLUSTER_KEY_BYTES);
  for (int d = 0; d < 2; d++) {
    if (!l->has[d]) continue;
    struct net_identity id;
    derive_identity(cfg->identity, neighbour(l, (enum stage_link_dir)d), &id);
    memcpy(l->want_key[d], id.pk, NET_PUBKEY_BYTES);
    net_identity_wipe(&id);
  }
  rc = gossip_on_loop(cfg->host, start_on_loop, l);
  if (rc == 0) rc = l->start_rc;
  if (rc) {
    if (l->start_rc) *e = l->start_err;
    else rumor_err_set(e, rc, "cannot start the stage link: the network is shutting down");
    free_link(l);
    return rc;
  }
  *out = l;
  return 0;
}

const char *stage_link_address(const stage_link_t *l) { return l->addr; }

void stage_link_set_idle(stage_link_t *l, void (*idle)(void *arg), void *arg) {
  l->idle = idle;
  l->idle_arg = arg;
}

static void on_tick_closed(uv_handle_t *h) {
  struct stage_link *l = h->data;
  pthread_mutex_lock(&l->mu);
  l->handles_closed = true;
  pthread_cond_broadcast(&l->cond);
  pthread_mutex_unlock(&l->mu);
}

static void on_net_closed(void *arg) {
  struct stage_link *l = arg;
  l->net = NULL;
  uv_close((uv_handle_t *)&l->tick, on_tick_closed);
}

static void close_on_loop(uv_loop_t *loop, void *arg) {
  struct stage_link *l = arg;
  l->closing = true;
  net_close(l->net, on_net_closed, l);
}

void stage_link_close(stage_link_t *l, uint32_t flush_ms) {
  if (!l) return;
  if (l->running) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += flush_ms / 1000;
    ts.tv_nsec += (long)(flush_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
    pthread_mutex_lock(&l->mu);
    while (l->pending > 0 && !l->failed)
      if (pthread_cond_timedwait(&l->cond, &l->mu, &ts) == ETIMEDOUT) break;
    if (l->pending > 0 && !l->failed)
      log_warn("closing the stage link with %lld transfer%s unconfirmed", (long long)l->pending,
               l->pending == 1 ? "" : "s");
    pthread_mutex_unlock(&l->mu);
    /* Every handle of the link closes before this returns: the host's loop
     * must not be left holding them (it would never end). */
    if (gossip_on_loop(l->cfg.host, close_on_loop, l) == 0) {
      pthread_mutex_lock(&l->mu);
      while (!l->handles_closed) pthread_cond_wait(&l->cond, &l->mu);
      pthread_mutex_unlock(&l->mu);
    } else {
      log_warn("stage link: the network stopped before the link was closed");
    }
  }
  free_link(l);
}

/* ---- waiting (training thread) ---- */

/* Waits on the condition for at most STAGE_LINK_IDLE_MS, with mu held; runs
 * the idle callback (without mu) when the period passes. Returns a negative
 * code with a message when a stop was requested. */
static int wait_tick(struct stage_link *l, double *next_idle, struct rumor_err *e) {
  if (l->cfg.stop && *l->cfg.stop)
    return rumor_err_set(e, RUMOR_ECANCELED, "stage %d/%d interrupted by signal %d", l->cfg.stage, l->cfg.stages,
                         (int)*l->cfg.stop);
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += STAGE_LINK_IDLE_MS * 1000000L;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  pthread_cond_timedwait(&l->cond, &l->mu, &ts);
  double now = clock_now_s();
  if (l->idle && now >= *next_idle) {
    *next_idle = now + STAGE_LINK_IDLE_MS * 1e-3;
    pthread_mutex_unlock(&l->mu);
    l->idle(l->idle_arg);
    pthread_mutex_lock(&l->mu);
  }
  return 0;
}

static int failure(struct stage_link *l, struct rumor_err *e) {
  return rumor_err_set(e, RUMOR_ECANCELED, "%s", l->why);
}

/* The neighbour in `dir` closed the link while this stage still needs it:
 * it left the group. The link fails with that neighbour as the culprit
 * (unless it had failed already), so this stage and those it tells blame
 * the stage that left, not themselves. Training thread, mu held. */
static int neighbour_left(struct stage_link *l, enum stage_link_dir dir, struct rumor_err *e) {
  if (!l->failed) {
    l->failed = true;
    l->fail_stage = neighbour(l, dir);
    snprintf(l->why, sizeof l->why, "stage %d/%d left the group (closed the link)", neighbour(l, dir),
             l->cfg.stages);
    pthread_cond_broadcast(&l->cond);
  }
  return failure(l, e);
}

int stage_link_wait_ready(stage_link_t *l, struct rumor_err *e) {
  double next_idle = 0;
  int rc = 0;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    if (l->failed) {
      rc = failure(l, e);
      break;
    }
    if ((!l->has[0] || l->ready[0]) && (!l->has[1] || l->ready[1])) break;
    if ((rc = wait_tick(l, &next_idle, e))) break;
  }
  pthread_mutex_unlock(&l->mu);
  return rc;
}

static int check_send(struct stage_link *l, enum stage_link_dir dir, struct rumor_err *e) {
  RUMOR_ASSERT(l->has[dir]);
  pthread_mutex_lock(&l->mu);
  int rc = 0;
  if (l->failed) rc = failure(l, e);
  else if (l->closed[dir]) rc = neighbour_left(l, dir, e);
  else l->pending++;
  pthread_mutex_unlock(&l->mu);
  return rc;
}

int stage_link_send(stage_link_t *l, enum stage_link_dir dir, enum stage_link_kind kind, int64_t step, int32_t mb,
                    int64_t rows, const float *data, struct rumor_err *e) {
  int64_t width = transfer_width(l, dir, kind);
  RUMOR_ASSERT(rows >= 1 && rows <= max_rows(l, kind) && width > 0);
  int rc = check_send(l, dir, e);
  if (rc) return rc;
  struct tx *t = xmalloc(sizeof *t);
  t->l = l;
  t->dir = dir;
  t->wire = transfer_wire(l, (uint32_t)kind);
  t->count = (uint64_t)(rows * width);
  t->data = xmalloc(t->count * sizeof(float));
  memcpy(t->data, data, t->count * sizeof(float));
  meta_write(t->meta, (uint32_t)kind, step, mb, rows);
  if (net_call(l->net, tx_on_loop, t) != 0) {
    tx_free(t);
    return rumor_err_set(e, RUMOR_ECANCELED, "the stage link is closing");
  }
  return 0;
}

int stage_link_recv(stage_link_t *l, enum stage_link_dir dir, enum stage_link_kind kind, int64_t step, int32_t mb,
                    float **data, int64_t *rows, double *waited_s, struct rumor_err *e) {
  RUMOR_ASSERT(l->has[dir]);
  double t0 = clock_now_s(), next_idle = t0 + STAGE_LINK_IDLE_MS * 1e-3;
  int rc = 0;
  bool blocked = false;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    struct item *prev = NULL, *it = l->inbox;
    while (it && !(it->dir == dir && it->kind == (uint32_t)kind && it->step == step && it->mb == mb))
      prev = it, it = it->next;
    if (it) {
      if (prev) prev->next = it->next;
      else l->inbox = it->next;
      if (l->inbox_tail == it) l->inbox_tail = prev;
      l->inbox_items--;
      l->inbox_bytes -= it->bytes;
      *data = it->data;
      *rows = it->rows;
      free(it);
      break;
    }
    if (l->failed) {
      rc = failure(l, e);
      break;
    }
    if (l->closed[dir]) {
      rc = neighbour_left(l, dir, e);
      break;
    }
    blocked = true;
    if ((rc = wait_tick(l, &next_idle, e))) break;
  }
  pthread_mutex_unlock(&l->mu);
  if (waited_s) *waited_s = blocked ? clock_now_s() - t0 : 0.0;
  return rc;
}

struct start_req {
  struct stage_link *l;
  struct stage_link_pos pos;
};

static void start_pos_on_loop(net_t *n, void *arg, int status) {
  struct start_req *r = arg;
  struct stage_link *l = r->l;
  net_conn_t *c = status == 0 ? l->conn[STAGE_LINK_NEXT] : NULL;
  if (c) {
    struct net_msgbuf b;
    net_msgbuf_init(&b, LMSG_START, LINK_PROTO_VERSION);
    net_msgbuf_put_int(&b, "step", r->pos.step);
    net_msgbuf_put_int(&b, "epoch", r->pos.epoch);
    net_msgbuf_put_int(&b, "samples", r->pos.samples);
    if (send_msg(l, c, &b)) fail(l, l->cfg.stage + 1, "cannot send the start position to stage %d", l->cfg.stage + 1);
  }
  free(r);
}

int stage_link_send_start(stage_link_t *l, const struct stage_link_pos *pos, struct rumor_err *e) {
  if (!l->has[STAGE_LINK_NEXT]) return 0;
  pthread_mutex_lock(&l->mu);
  int rc = l->failed ? failure(l, e) : 0;
  pthread_mutex_unlock(&l->mu);
  if (rc) return rc;
  struct start_req *r = xmalloc(sizeof *r);
  r->l = l;
  r->pos = *pos;
  if (net_call(l->net, start_pos_on_loop, r) != 0) {
    free(r);
    return rumor_err_set(e, RUMOR_ECANCELED, "the stage link is closing");
  }
  return 0;
}

int stage_link_recv_start(stage_link_t *l, struct stage_link_pos *pos, struct rumor_err *e) {
  RUMOR_ASSERT(l->has[STAGE_LINK_PREV]);
  double next_idle = 0;
  int rc = 0;
  pthread_mutex_lock(&l->mu);
  for (;;) {
    if (l->have_start) {
      *pos = l->start;
      l->have_start = false;
      break;
    }
    if (l->failed) {
      rc = failure(l, e);
      break;
    }
    if (l->closed[STAGE_LINK_PREV]) {
      rc = neighbour_left(l, STAGE_LINK_PREV, e);
      break;
    }
    if ((rc = wait_tick(l, &next_idle, e))) break;
  }
  pthread_mutex_unlock(&l->mu);
  return rc;
}

bool stage_link_failed(stage_link_t *l, int *stage, char *why, size_t n) {
  pthread_mutex_lock(&l->mu);
  bool f = l->failed;
  if (f) {
    if (stage) *stage = l->fail_stage;
    if (why) snprintf(why, n, "%s", l->why);
  }
  pthread_mutex_unlock(&l->mu);
  return f;
}

struct abort_req {
  struct stage_link *l;
  int stage;
  char why[WHY_MAX];
};

/* Sends the ABORT also when the net is closing (status RUMOR_ECANCELED):
 * net_close runs the queued calls before it closes the connections, and
 * stage_link_close, queued on the host's loop right after the abort, may
 * get there first. The ABORT then still goes out ahead of the BYE, and the
 * neighbours learn who failed and why instead of only that the link
 * closed. */
static void abort_on_loop(net_t *n, void *arg, int status) {
  (void)status;
  struct abort_req *r = arg;
  struct stage_link *l = r->l;
  for (int d = 0; d < 2; d++) {
    net_conn_t *c = l->conn[d];
    if (!c) continue;
    struct net_msgbuf b;
    net_msgbuf_init(&b, LMSG_ABORT, LINK_PROTO_VERSION);
    net_msgbuf_put_int(&b, "stage", r->stage);
    net_msgbuf_put_str(&b, "why", r->why, strlen(r->why));
    (void)send_msg(l, c, &b);
  }
  free(r);
}

void stage_link_abort(stage_link_t *l, int stage, const char *why) {
  fail(l, stage, "%s", why);
  if (!l->running) return;
  struct abort_req *r = xmalloc(sizeof *r);
  r->l = l;
  r->stage = stage;
  snprintf(r->why, sizeof r->why, "%s", why);
  if (net_call(l->net, abort_on_loop, r) != 0) free(r);
}
