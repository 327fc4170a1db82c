/*
 * One connection on libuv: the pre-authentication handshake I/O, the
 * authenticated session's reads (straight into bulk buffers when possible),
 * the outbound queue with its byte cap (control frames ahead of bulk chunks,
 * bulk chunks produced only as the socket drains), timeouts and closing.
 *
 * Everything here runs on the loop thread.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/tcp_counters.h"
#include "net/transport_impl.h"

static const struct net_sess_ops sess_ops;
static void pump(struct net_conn *c);
static void session_violation(struct net_conn *c);
static void check_close_done(struct net_conn *c);

void *net_alloc_aligned(size_t n) {
  const size_t a = 64; /* crypto_generichash_state asks for 64-byte alignment */
  n = (n + a - 1) / a * a;
  void *p = aligned_alloc(a, n);
  if (!p) rumor_panic(__FILE__, __LINE__, "out of memory allocating %zu bytes", n);
  memset(p, 0, n);
  return p;
}

/* ---- frames -------------------------------------------------------------------- */

static struct net_txframe *frame_alloc(size_t cap) {
  struct net_txframe *f = xmalloc(sizeof *f + cap);
  memset(f, 0, sizeof *f);
  f->cap = cap;
  f->data = (uint8_t *)(f + 1);
  return f;
}

/* A chunk frame goes back to its net's pool while there is room and the
 * net is not closing (net_frame_pool_free empties it then). */
static void frame_release(struct net_conn *c, struct net_txframe *f) {
  net_t *n = c->net;
  if (f->pooled && !n->closing && n->frame_pool_n < NET_FRAME_POOL_MAX) {
    f->next = n->frame_pool;
    n->frame_pool = f;
    n->frame_pool_n++;
    return;
  }
  free(f);
}

/* Takes a spare frame off the pool (which must hold one). The window's
 * low-water mark follows (frame_pool_decay). */
static struct net_txframe *frame_pool_pop(net_t *n) {
  struct net_txframe *f = n->frame_pool;
  n->frame_pool = f->next;
  f->next = NULL;
  n->frame_pool_n--;
  if (n->frame_pool_n < n->frame_pool_low) n->frame_pool_low = n->frame_pool_n;
  return f;
}

void net_frame_pool_free(net_t *n) {
  while (n->frame_pool) free(frame_pool_pop(n));
}

/* Once a decay window (cfg.spare_frame_decay_ms) has passed, frees the
 * spare frames no transfer took in it (the pool's low-water mark): the
 * pool shrinks back to what the traffic of the last window needed. Called
 * when frames are taken and on the connections' timers. */
static void frame_pool_decay(net_t *n) {
  uint32_t window = n->cfg.spare_frame_decay_ms;
  uint64_t now = uv_now(n->loop);
  if (!window || now - n->frame_pool_since < window) return;
  for (unsigned k = n->frame_pool_low; k > 0 && n->frame_pool; k--) free(frame_pool_pop(n));
  n->frame_pool_low = n->frame_pool_n;
  n->frame_pool_since = now;
}

/* A frame buffer for a bulk frame of `size` bytes. */
static struct net_txframe *chunk_frame_get(struct net_conn *c, size_t size) {
  struct net_txframe *f;
  net_t *n = c->net;
  size_t cap = n->chunk_frame_cap;
  frame_pool_decay(n);
  if (size <= cap && n->frame_pool) {
    f = frame_pool_pop(n);
  } else if (size <= cap) {
    f = frame_alloc(cap);
    f->pooled = true;
  } else {
    f = frame_alloc(size);
  }
  f->sealed = true;
  f->transport = true;
  f->is_bye = f->is_ping = false;
  return f;
}

/* ---- naming and logging ------------------------------------------------------------- */

void net_conn_set_name(struct net_conn *c) {
  if (c->surfaced || c->state == CONN_OPEN || c->sess.tx.suite) {
    char k[NET_PUBKEY_STR_LEN + 1];
    net_pubkey_format(k, c->peer_pk);
    snprintf(c->name, sizeof c->name, "%s key=%.12s", c->addr, k);
  } else {
    snprintf(c->name, sizeof c->name, "%s", c->addr);
  }
}

static void set_peer_addr(struct net_conn *c) {
  struct sockaddr_storage ss;
  int len = sizeof ss;
  char ip[INET6_ADDRSTRLEN] = "?";
  if (uv_tcp_getpeername(&c->tcp, (struct sockaddr *)&ss, &len) != 0) return;
  if (ss.ss_family == AF_INET6) {
    const struct sockaddr_in6 *a = (const struct sockaddr_in6 *)&ss;
    uv_ip6_name(a, ip, sizeof ip);
    snprintf(c->addr, sizeof c->addr, "[%s]:%u", ip, ntohs(a->sin6_port));
  } else {
    const struct sockaddr_in *a = (const struct sockaddr_in *)&ss;
    uv_ip4_name(a, ip, sizeof ip);
    snprintf(c->addr, sizeof c->addr, "%s:%u", ip, ntohs(a->sin_port));
  }
  net_conn_set_name(c);
}

/* ---- creation and destruction ----------------------------------------------------- */

static void on_timer(uv_timer_t *t);

struct net_conn *net_conn_new(net_t *n, bool inbound) {
  struct net_conn *c = net_alloc_aligned(sizeof *c);
  c->net = n;
  c->inbound = inbound;
  c->state = inbound ? CONN_HANDSHAKE : CONN_RESOLVING;
  RUMOR_ASSERT(uv_tcp_init(n->loop, &c->tcp) == 0);
  c->tcp.data = c;
  RUMOR_ASSERT(uv_timer_init(n->loop, &c->timer) == 0);
  c->timer.data = c;
  c->refs = 2;
  c->next = n->conns;
  if (n->conns) n->conns->prev = c;
  n->conns = c;
  n->n_conns++;
  /* uv_now is cached per loop iteration; a dial made after blocking work
   * outside the loop must not start its deadline in the past. */
  uv_update_time(n->loop);
  c->last_activity = uv_now(n->loop);
  snprintf(c->addr, sizeof c->addr, "?");
  snprintf(c->name, sizeof c->name, "?");
  /* The handshake deadline covers resolving, connecting and the handshake. */
  uv_timer_start(&c->timer, on_timer, n->cfg.handshake_timeout_ms, 0);
  return c;
}

void net_conn_stats_add(struct net_conn_stats *to, const struct net_conn_stats *s) {
  to->bytes_in += s->bytes_in;
  to->bytes_out += s->bytes_out;
  to->frames_in += s->frames_in;
  to->frames_out += s->frames_out;
  to->msgs_in += s->msgs_in;
  to->msgs_out += s->msgs_out;
  to->bulk_in_ok += s->bulk_in_ok;
  to->bulk_in_failed += s->bulk_in_failed;
  to->bulk_out_ok += s->bulk_out_ok;
  to->bulk_out_failed += s->bulk_out_failed;
}

static void finish(struct net_conn *c) {
  net_t *n = c->net;
  struct net_conn_stats s;
  net_conn_stats_get(c, &s);
  net_conn_stats_add(c->circ ? &n->stats.relayed : &n->stats.total, &s);
  if (c->surfaced) {
    if (n->cbs.on_close) n->cbs.on_close(c, c->close_status, c->close_detail, n->ud);
  } else if (c->dial_cb) {
    net_dial_cb cb = c->dial_cb;
    c->dial_cb = NULL;
    cb(n, NULL, c->close_status ? c->close_status : RUMOR_ECANCELED, c->close_detail, c->dial_arg);
  }
  free(c->stage);
  net_sess_free(&c->sess);
  net_hs_wipe(&c->hs);
  if (c->ai) uv_freeaddrinfo(c->ai);
  net_conn_unlink(c); /* may free the net: nothing after this */
  free(c);
}

void net_conn_unref(struct net_conn *c) {
  RUMOR_ASSERT(c->refs > 0);
  if (--c->refs == 0) finish(c);
}

void net_conn_on_handle_closed(uv_handle_t *h) { net_conn_unref(h->data); }

static size_t queued(const struct net_conn *c) { return c->ctl_bytes + c->txq_bytes + c->inflight_bytes; }

/* Ends an outbound transfer with `status`: its callback runs now, or — when
 * worker jobs still read its source buffer or frames of it still wait in
 * txq — as soon as they are done, so the caller may free the buffer in the
 * callback. */
static void tx_finish(struct net_conn *c, struct net_tx_bulk *t, int status) {
  if (t->jobs || t->unflushed) {
    t->zombie = true;
    t->zombie_status = status;
    t->next = c->zombie_head;
    c->zombie_head = t;
    return;
  }
  if (status == 0) c->st.bulk_out_ok++;
  else c->st.bulk_out_failed++;
  t->done(c, t->id, status, t->arg);
  free(t->meta);
  free(t);
}

/* A zombie's last job or frame is gone: report it. */
static void tx_release_zombie(struct net_conn *c, struct net_tx_bulk *t) {
  if (!t->zombie || t->jobs || t->unflushed) return;
  for (struct net_tx_bulk **pp = &c->zombie_head; *pp; pp = &(*pp)->next)
    if (*pp == t) {
      *pp = t->next;
      break;
    }
  t->zombie = false;
  tx_finish(c, t, t->zombie_status);
}

/* Detaches and fails every outbound transfer. */
static void cancel_outbound(struct net_conn *c, int status) {
  struct net_tx_bulk *lists[2] = {c->tx_head, c->wait_head};
  c->tx_head = c->tx_tail = c->wait_head = NULL;
  for (int i = 0; i < 2; i++) {
    for (struct net_tx_bulk *t = lists[i], *next; t; t = next) {
      next = t->next;
      tx_finish(c, t, status);
    }
  }
}

/* A frame that will never be written: the circuit frame it ends fails. */
static void frame_drop(struct net_txframe *f) {
  struct net_txframe *carried = f->carried;
  free(f);
  if (carried) net_conn_write_done(carried, RUMOR_ECANCELED);
}

static void free_ctl_queue(struct net_conn *c) {
  while (c->ctl_head) {
    struct net_txframe *f = c->ctl_head;
    c->ctl_head = f->next;
    frame_drop(f);
  }
  c->ctl_tail = NULL;
  c->ctl_bytes = 0;
}

/* Drops every frame of txq; one still being sealed is left to its job. */
static void drop_txq(struct net_conn *c) {
  struct net_txframe *f = c->txq_head;
  c->txq_head = c->txq_tail = NULL;
  c->txq_bytes = 0;
  while (f) {
    struct net_txframe *next = f->next;
    if (!f->ready) {
      f->orphan = true; /* the job's callback frees it */
    } else {
      if (f->t) {
        f->t->unflushed--;
        tx_release_zombie(c, f->t);
      }
      frame_drop(f);
    }
    f = next;
  }
}

void net_conn_abort(struct net_conn *c, int status, int hs_fail, const char *fmt, ...) {
  if (c->state == CONN_CLOSED) return;
  net_t *n = c->net;
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(c->close_detail, sizeof c->close_detail, fmt, ap);
  va_end(ap);
  enum conn_state was = c->state;
  c->state = CONN_CLOSED;
  c->close_status = status;
  if (hs_fail >= 0 && hs_fail < NET_HS_FAIL__COUNT) {
    n->stats.hs_failed++;
    n->stats.hs_fail[hs_fail]++;
    log_warn("net: handshake with %s failed (%s): %s", c->name, net_hs_fail_name((enum net_hs_fail)hs_fail),
             c->close_detail);
  } else if (was < CONN_OPEN && status != RUMOR_ECANCELED) {
    log_warn("net: connection to %s failed: %s", c->name, c->close_detail);
  } else if (status != 0 && status != RUMOR_ECANCELED) {
    log_warn("net: dropping %s: %s", c->name, c->close_detail);
  } else {
    log_debug("net: closed %s: %s", c->name, c->close_detail);
  }
  if (c->counted_pending) {
    n->n_pending--;
    c->counted_pending = false;
  }
  c->sess.stop = true;
  uv_timer_stop(&c->timer);
  if (c->circ || c->carrier || c->circ_wait) net_relay_conn_gone(c, status);
  free_ctl_queue(c);
  int st = status ? status : RUMOR_ECANCELED;
  cancel_outbound(c, st);
  drop_txq(c);
  net_sess_fail_inbound(&c->sess, st);
  if (c->resolving) uv_cancel((uv_req_t *)&c->gai);
  if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, net_conn_on_handle_closed);
  if (!uv_is_closing((uv_handle_t *)&c->timer)) uv_close((uv_handle_t *)&c->timer, net_conn_on_handle_closed);
}

/* ---- writing ------------------------------------------------------------------------ */

static void write_done(struct net_txframe *f, int status) {
  struct net_conn *c = f->conn;
  c->inflight_bytes -= f->len;
  bool bye = f->is_bye;
  if (status == 0) {
    c->st.bytes_out += f->len;
    if (f->transport) c->st.frames_out++;
    c->last_tx = uv_now(c->net->loop);
    if (!f->is_ping) c->last_activity = c->last_tx;
  }
  struct net_txframe *carried = f->carried;
  f->carried = NULL;
  frame_release(c, f);
  if (carried) net_conn_write_done(carried, status);
  if (c->state == CONN_CLOSED) return;
  if (status < 0) {
    if (c->circ) /* the carrier dropped the frame: the relay connection went */
      net_conn_abort(c, -ENETRESET, c->state < CONN_OPEN ? NET_HS_FAIL_CLOSED : -1,
                     "the circuit through the relay closed (%s)", rumor_strerror(status));
    else
      net_conn_abort(c, status, c->state < CONN_OPEN ? NET_HS_FAIL_CLOSED : -1, "write failed: %s",
                     uv_strerror(status));
    return;
  }
  if (c->reject_then_close && c->state == CONN_HANDSHAKE) {
    char d[NET_DETAIL_STR];
    snprintf(d, sizeof d, "%s", c->close_detail);
    net_conn_abort(c, c->close_status, (int)c->hs.fail, "%s", d);
    return;
  }
  if (bye) {
    log_debug("net: BYE to %s written", c->name);
    c->bye_written = true;
    check_close_done(c);
    return;
  }
  pump(c);
}

void net_conn_write_done(struct net_txframe *f, int status) {
  struct net_conn *c = f->conn;
  bool circ = c->circ;
  write_done(f, status);
  if (circ) net_conn_unref(c); /* net_circuit_write's reference; may free c: last */
}

static void on_write(uv_write_t *req, int status) { write_done(req->data, status); }

/* Hands a complete frame to libuv (or to the circuit it runs over). On
 * failure the connection is aborted. */
static void conn_write(struct net_conn *c, struct net_txframe *f) {
  uv_buf_t b = uv_buf_init((char *)f->data, (unsigned)f->len);
  f->conn = c;
  f->req.data = f;
  c->inflight_bytes += f->len;
  c->last_tx = uv_now(c->net->loop);
  int rc = c->circ ? net_circuit_write(c, f) : uv_write(&f->req, (uv_stream_t *)&c->tcp, &b, 1, on_write);
  if (rc < 0) {
    c->inflight_bytes -= f->len;
    frame_release(c, f);
    if (c->circ)
      net_conn_abort(c, -ENETRESET, c->state < CONN_OPEN ? NET_HS_FAIL_CLOSED : -1,
                     "the circuit through the relay closed (%s)", rumor_strerror(rc));
    else
      net_conn_abort(c, rc, c->state < CONN_OPEN ? NET_HS_FAIL_CLOSED : -1, "write failed: %s", uv_strerror(rc));
  }
}

static void send_hs(struct net_conn *c, const uint8_t *body, size_t len) {
  struct net_txframe *f = frame_alloc(NET_HS_LEN_BYTES + len);
  net_be16_put(f->data, (uint16_t)len);
  memcpy(f->data + NET_HS_LEN_BYTES, body, len);
  f->len = NET_HS_LEN_BYTES + len;
  f->sealed = true;
  conn_write(c, f);
}

int net_conn_queue_frame(struct net_conn *c, uint8_t type, uint64_t a, uint64_t b, const void *pt, size_t len,
                         size_t limit, struct net_txframe *carried) {
  if (c->bye_sealed) return -ENOTCONN; /* nothing may follow our BYE */
  size_t fl = NET_FRAME_OVERHEAD + len;
  if (queued(c) + fl > limit) return -ENOBUFS;
  struct net_txframe *f = frame_alloc(fl);
  net_frame_hdr_write(f->data, type, len, a, b);
  if (len) memcpy(f->data + NET_FRAME_HDR, pt, len);
  f->len = fl;
  f->transport = true;
  f->carried = carried;
  if (c->ctl_tail) c->ctl_tail->next = f;
  else c->ctl_head = f;
  c->ctl_tail = f;
  c->ctl_bytes += fl;
  return 0;
}

/* Queues a control frame if the queue stays within `limit` bytes. */
static int queue_ctl(struct net_conn *c, uint8_t type, uint64_t a, uint64_t b, const void *pt, size_t len,
                     size_t limit) {
  return net_conn_queue_frame(c, type, a, b, pt, len, limit, NULL);
}

void net_conn_pump(struct net_conn *c) { pump(c); }
size_t net_conn_queued(const struct net_conn *c) { return queued(c); }

/* Our own small frames (RESULT, ABORT) may use the reserve; a peer that makes
 * us exceed even that is not reading, and is dropped. */
static int queue_proto(struct net_conn *c, uint8_t type, uint64_t a, uint64_t b) {
  int rc = queue_ctl(c, type, a, b, NULL, 0, c->net->cfg.max_queued_bytes);
  if (rc == -ENOBUFS) {
    net_conn_abort(c, -ENOBUFS, -1, "outbound queue full (%zu bytes): the peer is not reading", queued(c));
    return rc;
  }
  if (rc < 0) return rc;
  return 0;
}

static void move_to_wait(struct net_conn *c) {
  struct net_tx_bulk *t = c->tx_head;
  c->tx_head = t->next;
  if (!c->tx_head) c->tx_tail = NULL;
  t->next = c->wait_head;
  c->wait_head = t;
}

static void txq_append(struct net_conn *c, struct net_txframe *f) {
  f->next = NULL;
  f->conn = c;
  if (c->txq_tail) c->txq_tail->next = f;
  else c->txq_head = f;
  c->txq_tail = f;
  c->txq_bytes += f->len;
}

/* Writes the ready frames at the head of txq, in order. A bulk DATA frame's
 * digest leaf (its AEAD tag) joins its transfer's root here, so leaves go in
 * chunk order. A DATA frame that failed to seal is never written: its
 * position in the nonce sequence is lost, so the connection is dropped. */
static void flush(struct net_conn *c) {
  while (c->txq_head && c->txq_head->ready && c->state != CONN_CLOSED) {
    struct net_txframe *f = c->txq_head;
    c->txq_head = f->next;
    if (!c->txq_head) c->txq_tail = NULL;
    c->txq_bytes -= f->len;
    f->next = NULL;
    struct net_tx_bulk *t = f->t;
    f->t = NULL;
    int sealed = t ? f->job.status : 0;
    if (t) {
      if (sealed == 0 && t->digest && !t->zombie) net_digest_add_tag(&t->root, f->job.leaf);
      t->unflushed--;
      tx_release_zombie(c, t); /* may free t; the frame is a copy, so the write needs nothing of it */
    }
    if (sealed < 0) {
      frame_release(c, f);
      net_conn_abort(c, sealed, -1, "cannot seal a bulk frame: OpenSSL failed");
      return;
    }
    conn_write(c, f);
  }
}

static void tx_work(uv_work_t *w) {
  struct net_txframe *f = w->data;
  net_tx_job_run(&f->job);
}

static void tx_after_work(uv_work_t *w, int status) {
  struct net_txframe *f = w->data;
  struct net_conn *c = f->conn;
  struct net_tx_bulk *t = f->t;
  (void)status; /* never canceled */
  t->jobs--;
  if (f->orphan) {
    t->unflushed--;
    f->t = NULL;
    free(f);
    tx_release_zombie(c, t);
  } else {
    f->ready = true;
    pump(c); /* writes it when its turn comes; a zombie t is released there */
  }
  net_conn_unref(c); /* may free c: last */
}

/* Seals one control frame and queues it in order. */
static int seal_ctl(struct net_conn *c, struct net_txframe *f) {
  int rc = net_aead_seal(&c->sess.tx, f->data, f->data + NET_FRAME_HDR, f->len - NET_FRAME_OVERHEAD);
  if (rc < 0) {
    free(f);
    net_conn_abort(c, rc, -1, "cannot seal a control frame: %s",
                   rc == -EOVERFLOW ? "nonce space exhausted" : "OpenSSL failed");
    return rc;
  }
  f->sealed = f->ready = true;
  txq_append(c, f);
  return 0;
}

/* Makes the next frame of the current outbound transfer. Returns false when
 * nothing can be made now. */
static bool produce_bulk(struct net_conn *c) {
  net_t *n = c->net;
  struct net_tx_bulk *t = c->tx_head;
  if (t->phase == NET_TX_END && t->unflushed) return false; /* END needs every leaf in the root */
  size_t size = net_bulk_tx_next_size(t);
  if (size == 0) {
    move_to_wait(c);
    return true;
  }
  if (queued(c) + size > n->bulk_window) return false;
  struct net_txframe *f = chunk_frame_get(c, size);
  f->conn = c;
  int rc;
  if (t->phase == NET_TX_DATA) {
    rc = net_bulk_tx_prepare_data(&c->sess.tx, t, f->data, &f->job, &f->len);
    if (rc < 0) goto fail;
    f->t = t;
    t->unflushed++;
    f->ready = false;
    if (n->cfg.offload) {
      f->work.data = f;
      t->jobs++;
      c->refs++;
      if (uv_queue_work(n->loop, &f->work, tx_work, tx_after_work) == 0) {
        txq_append(c, f);
        goto out;
      }
      t->jobs--;
      c->refs--;
    }
    net_tx_job_run(&f->job);
    f->ready = true;
  } else {
    rc = net_bulk_tx_produce(&c->sess.tx, t, f->data, &f->len);
    if (rc < 0) goto fail;
    f->ready = true;
  }
  txq_append(c, f);
out:
  if (t->phase == NET_TX_WAIT_RESULT) move_to_wait(c);
  return true;
fail:
  frame_release(c, f);
  net_conn_abort(c, rc, -1, "cannot produce a bulk frame: %s", rumor_strerror(rc));
  return false;
}

/* Sends what may be sent now: queued control frames first (sealed here, so
 * nonces follow the wire order), then BYE when closing, then bulk frames while
 * the queue stays under the bulk window; then writes what is ready, in order. */
static void pump(struct net_conn *c) {
  if ((c->state != CONN_OPEN && c->state != CONN_CLOSING) || c->pumping) return;
  c->pumping = true;
  bool progress = true;
  while (progress && (c->state == CONN_OPEN || c->state == CONN_CLOSING)) {
    progress = false;
    while (c->ctl_head && c->state != CONN_CLOSED) {
      struct net_txframe *f = c->ctl_head;
      c->ctl_head = f->next;
      if (!c->ctl_head) c->ctl_tail = NULL;
      c->ctl_bytes -= f->len;
      if (seal_ctl(c, f) < 0) break;
      progress = true;
    }
    if (c->state == CONN_CLOSING && c->bye_queued && !c->ctl_head) {
      c->bye_queued = false;
      c->bye_sealed = true;
      struct net_txframe *f = frame_alloc(NET_FRAME_OVERHEAD);
      net_frame_hdr_write(f->data, NET_FRAME_BYE, 0, 0, 0);
      f->len = NET_FRAME_OVERHEAD;
      f->transport = f->is_bye = true;
      if (seal_ctl(c, f) < 0) break;
      progress = true;
    }
    while (c->state == CONN_OPEN && c->tx_head && !c->ctl_head && produce_bulk(c)) progress = true;
    struct net_txframe *head = c->txq_head;
    flush(c);
    if (c->txq_head != head) progress = true;
  }
  c->pumping = false;
}

/* ---- the close sequence --------------------------------------------------------------- */

static void on_shutdown(uv_shutdown_t *req, int status) {
  struct net_conn *c = req->data;
  if (c->state == CONN_CLOSED) return;
  (void)status; /* a failed shutdown only means the peer is already gone */
  check_close_done(c);
}

/* In CLOSING: once our BYE is out, half-close; once the peer's end of the
 * stream has arrived too, close. Waiting for the peer's EOF avoids a reset
 * that could discard our BYE in the peer's receive buffer. */
static void check_close_done(struct net_conn *c) {
  if (c->state != CONN_CLOSING || !c->bye_written) return;
  if (!c->shutdown_started) {
    c->shutdown_started = true;
    c->sreq.data = c;
    if (c->circ) net_circuit_shutdown(c);
    else if (uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, on_shutdown) == 0) return;
  }
  if (c->eof) net_conn_abort(c, 0, -1, "%s", c->local_close ? "closed" : "closed by the peer");
}

/* Starts the graceful close (BYE after the queued control frames). */
static void begin_closing(struct net_conn *c, bool local) {
  c->state = CONN_CLOSING;
  c->local_close = local;
  c->bye_queued = true;
  uv_timer_start(&c->timer, on_timer, c->net->cfg.close_linger_ms, 0);
  cancel_outbound(c, RUMOR_ECANCELED);
  pump(c);
}

void net_conn_close(net_conn_t *c) {
  if (c->state != CONN_OPEN) return;
  /* Our inbound transfer can no longer complete: tell the app now and
   * discard the rest of it (the peer stops when it sees our BYE). */
  net_sess_cancel_inbound(&c->sess, RUMOR_ECANCELED);
  if (c->state == CONN_OPEN) begin_closing(c, true);
}

/* ---- timers ------------------------------------------------------------------------------ */

static bool heartbeat_on(const struct net_conn *c) {
  return c->net->cfg.heartbeat_ms && c->version >= NET_PROTO_PING;
}

/* The silence after which the peer is judged dead: dead_after_ms, or 4
 * times the interval it announced when that is longer; 0 when it is not
 * judged (no heartbeat on this side or this version, or no PING from it
 * yet: a peer whose heartbeat is off is never judged). */
static uint64_t dead_limit(const struct net_conn *c) {
  if (!heartbeat_on(c) || !c->peer_ping_ms) return 0;
  uint64_t own = c->net->cfg.dead_after_ms, theirs = 4 * (uint64_t)c->peer_ping_ms;
  return own > theirs ? own : theirs;
}

/* Arms an open connection's timer for the nearest of: the idle limit, our
 * next PING (nothing sent for heartbeat_ms; while frames are queued, they
 * are the life the peer sees, so only look again later) and the verdict on
 * a silent peer. Events between firings only move these later, so a timer
 * that fires early just arms itself again. */
static void open_timer_arm(struct net_conn *c, uint64_t now) {
  const struct net_config *cfg = &c->net->cfg;
  uint64_t due = UINT64_MAX;
  if (cfg->idle_timeout_ms) due = c->last_activity + cfg->idle_timeout_ms;
  if (c->retire_ms && c->last_activity + c->retire_ms < due) due = c->last_activity + c->retire_ms;
  if (heartbeat_on(c)) {
    uint64_t ping = (queued(c) ? now : c->last_tx) + cfg->heartbeat_ms;
    if (ping < due) due = ping;
  }
  uint64_t limit = dead_limit(c);
  if (limit && c->last_rx + limit < due) due = c->last_rx + limit;
  if (c->verdict_pending) due = now + 1; /* after this iteration's reads */
  if (due == UINT64_MAX) {
    uv_timer_stop(&c->timer);
    return;
  }
  if (due <= now) due = now + 1;
  c->timer_due = due;
  uv_timer_start(&c->timer, on_timer, due - now, 0);
}

static void send_ping(struct net_conn *c) {
  const struct net_config *cfg = &c->net->cfg;
  if (queue_ctl(c, NET_FRAME_PING, cfg->heartbeat_ms, 0, NULL, 0, cfg->max_queued_bytes) != 0) return;
  c->ctl_tail->is_ping = true;
  pump(c);
}

static void abort_idle(struct net_conn *c, uint64_t idle) {
  struct net_tx_bulk *tb = c->tx_head;
  log_debug("net: %s idle: ctl %zu txq %zu (head ready %d) inflight %zu; tx %s phase %d jobs %u unflushed %u; "
            "rx paused %d/%d deferred %d jobs %u state %d chunk %llu leaf_next %llu backlog %zu",
            c->name, c->ctl_bytes, c->txq_bytes, c->txq_head ? c->txq_head->ready : -1, c->inflight_bytes,
            tb ? "active" : "none", tb ? (int)tb->phase : -1, tb ? tb->jobs : 0, tb ? tb->unflushed : 0,
            c->sess.paused, c->rx_paused, c->sess.deferred, c->sess.jobs, (int)c->sess.rx_state,
            (unsigned long long)c->sess.ib.chunk_index, (unsigned long long)c->sess.ib.leaf_next,
            c->sess.backlog_len);
  net_conn_abort(c, RUMOR_ETIMEDOUT, -1, "idle for %llu ms (limit %u ms)", (unsigned long long)idle,
                 c->net->cfg.idle_timeout_ms);
}

/* True while we do not read this connection (chunks wait for workers, or
 * a test paused it): its silence is then ours, not the peer's. */
static bool not_reading(const struct net_conn *c) {
#ifdef RUMOR_TESTING
  if (c->test_paused) return true;
#endif
  return c->rx_paused || c->read_held; /* a relay holding a source back reads it no faster */
}

/* An open connection's timer fired: idle limit, verdict, PING. Time our
 * loop spent stalled past the timer (a stopped process, a blocked or
 * starved loop: lateness above a quarter of the limit) is not counted as
 * the peer's silence, and a verdict waits for one more read of the socket,
 * since the timers of an iteration run before its reads. */
static void open_timer_fired(struct net_conn *c) {
  const struct net_config *cfg = &c->net->cfg;
  uint64_t now = uv_now(c->net->loop), limit = dead_limit(c);
  if (limit && now > c->timer_due && now - c->timer_due >= cfg->dead_after_ms / 4) {
    uint64_t late = now - c->timer_due;
    c->last_rx = c->last_rx + late < now ? c->last_rx + late : now;
    c->verdict_pending = false;
  }
  if (cfg->idle_timeout_ms && now - c->last_activity >= cfg->idle_timeout_ms) {
    if (dead_limit(c) && !c->tx_head && !c->ctl_bytes && !c->txq_bytes) {
      /* The peer heartbeats: it is alive, and we merely have had nothing
       * to say to each other. A BYE, not a cut: a cut tells a gossip
       * member that the peer died (its membership suspects it at once). */
      log_debug("net: %s idle for %llu ms: closing", c->name, (unsigned long long)(now - c->last_activity));
      net_conn_close(c);
      return;
    }
    abort_idle(c, now - c->last_activity);
    return;
  }
  if (c->retire_ms && now - c->last_activity >= c->retire_ms) {
    if (!c->carrier) {
      log_debug("net: %s retired and idle for %llu ms: closing", c->name,
                (unsigned long long)(now - c->last_activity));
      net_conn_close(c);
      return;
    }
    c->retire_ms = 0; /* it carries relay circuits: it stays */
  }
  if (not_reading(c)) c->last_rx = now;
  if (limit && now - c->last_rx >= limit) {
    if (c->verdict_pending) {
      c->judged_dead = true;
      c->net->stats.dead_verdicts++;
      net_conn_abort(c, RUMOR_ETIMEDOUT, -1, "silent for %llu ms (heartbeat verdict; limit %llu ms)",
                     (unsigned long long)(now - c->last_rx), (unsigned long long)limit);
      return;
    }
    c->verdict_pending = true;
  } else {
    c->verdict_pending = false;
  }
  if (heartbeat_on(c) && !queued(c) && now - c->last_tx >= cfg->heartbeat_ms) send_ping(c);
  if (c->state == CONN_OPEN) open_timer_arm(c, now);
}

static void on_timer(uv_timer_t *t) {
  struct net_conn *c = t->data;
  const struct net_config *cfg = &c->net->cfg;
  frame_pool_decay(c->net);
  switch (c->state) {
  case CONN_RESOLVING:
  case CONN_CONNECTING:
    net_conn_abort(c, RUMOR_ETIMEDOUT, -1, "no connection within %u ms", cfg->handshake_timeout_ms);
    break;
  case CONN_HANDSHAKE:
    net_conn_abort(c, RUMOR_ETIMEDOUT, NET_HS_FAIL_TIMEOUT, "handshake not completed within %u ms",
                   cfg->handshake_timeout_ms);
    break;
  case CONN_OPEN: open_timer_fired(c); break;
  case CONN_CLOSING:
    net_conn_abort(c, 0, -1, "the peer did not finish the close within %u ms", cfg->close_linger_ms);
    break;
  case CONN_CLOSED: break;
  }
}

void net_conn_retire(net_conn_t *c, uint32_t idle_ms) {
  if (c->state != CONN_OPEN || c->carrier || !idle_ms) return;
  if (c->retire_ms && c->retire_ms <= idle_ms) return;
  c->retire_ms = idle_ms;
  open_timer_arm(c, uv_now(c->net->loop));
}

/* ---- session ops (called from inside net_sess_rx_feed) ------------------------------------ */

static void became_open(struct net_conn *c) {
  net_t *n = c->net;
  c->state = CONN_OPEN;
  c->surfaced = true;
  if (c->counted_pending) {
    n->n_pending--;
    c->counted_pending = false;
  }
  n->stats.hs_ok++;
  net_conn_set_name(c);
  uint64_t now = uv_now(n->loop);
  c->last_rx = c->last_tx = c->last_activity = now;
  c->app_bytes_in = c->st.bytes_in;
  log_info("net: %s %s (%s)", c->inbound ? "accepted" : "connected to", c->name,
           c->suite == NET_SUITE_AES256GCM ? "aes256gcm" : "chacha20poly1305");
  /* A PING at once tells the peer that we heartbeat: it judges us from then on. */
  if (heartbeat_on(c)) send_ping(c);
  if (c->state == CONN_OPEN) open_timer_arm(c, now);
}

static void op_ping(void *ctx, uint64_t interval_ms) {
  struct net_conn *c = ctx;
  bool first = !c->peer_ping_ms;
  c->peer_ping_ms = interval_ms == 0 ? 1 : interval_ms > UINT32_MAX ? UINT32_MAX : (uint32_t)interval_ms;
  if (first && c->state == CONN_OPEN) open_timer_arm(c, uv_now(c->net->loop)); /* the verdict's deadline */
}

static void op_ready(void *ctx) {
  struct net_conn *c = ctx;
  if (c->state != CONN_HANDSHAKE) return;
  became_open(c);
  net_dial_cb cb = c->dial_cb;
  c->dial_cb = NULL;
  if (cb) cb(c->net, c, 0, "", c->dial_arg);
}

static void op_msg(void *ctx, const struct net_msg *m) {
  struct net_conn *c = ctx;
  if (c->net->cbs.on_message && (c->state == CONN_OPEN || c->state == CONN_CLOSING))
    c->net->cbs.on_message(c, m, c->net->ud);
}

static int op_bulk_begin(void *ctx, const struct net_bulk_info *info, float **dst, void **dst_arg) {
  struct net_conn *c = ctx;
  net_t *n = c->net;
  if (c->state != CONN_OPEN || !n->cbs.on_bulk_begin) return -ECONNREFUSED;
  return n->cbs.on_bulk_begin(c, info, dst, dst_arg, n->ud);
}

static void op_bulk_done(void *ctx, uint64_t id, int status, float *dst, void *dst_arg) {
  struct net_conn *c = ctx;
  if (c->net->cbs.on_bulk_done) c->net->cbs.on_bulk_done(c, id, status, dst, dst_arg, c->net->ud);
}

static struct net_tx_bulk *unlink_tx(struct net_conn *c, uint64_t id, bool *in_wait) {
  struct net_tx_bulk **pp, *prev = NULL;
  for (pp = &c->tx_head; *pp; prev = *pp, pp = &(*pp)->next) {
    if ((*pp)->id == id) {
      struct net_tx_bulk *t = *pp;
      *pp = t->next;
      if (c->tx_tail == t) c->tx_tail = prev;
      *in_wait = false;
      return t;
    }
  }
  for (pp = &c->wait_head; *pp; pp = &(*pp)->next) {
    if ((*pp)->id == id) {
      struct net_tx_bulk *t = *pp;
      *pp = t->next;
      *in_wait = true;
      return t;
    }
  }
  return NULL;
}

static void op_bulk_result(void *ctx, uint64_t id, enum net_bulk_result r) {
  struct net_conn *c = ctx;
  bool in_wait = false;
  struct net_tx_bulk *t = unlink_tx(c, id, &in_wait);
  if (!t) return; /* canceled here already */
  /* A verdict before the end (success) or before the start (anything) of a
   * transfer is a protocol violation. */
  if ((r == NET_BULK_OK && t->phase != NET_TX_WAIT_RESULT) || t->phase == NET_TX_BEGIN) {
    tx_finish(c, t, RUMOR_EPROTO);
    c->net->stats.dropped_violation++;
    net_conn_abort(c, RUMOR_EPROTO, -1, "BULK_RESULT %d for transfer %llu at a point where none is due", (int)r,
                   (unsigned long long)id);
    return;
  }
  int status = 0;
  switch (r) {
  case NET_BULK_OK: status = 0; break;
  case NET_BULK_REFUSED: status = -ECONNREFUSED; break;
  case NET_BULK_CORRUPT: status = RUMOR_ECORRUPT; break;
  case NET_BULK_CANCELED: status = RUMOR_ECANCELED; break;
  }
  /* Stopped half-way: tell the receiver the stream of this id is over. */
  if (!in_wait && (t->phase == NET_TX_DATA || t->phase == NET_TX_END))
    (void)queue_proto(c, NET_FRAME_BULK_ABORT, id, 0);
  tx_finish(c, t, status);
  pump(c);
}

static void op_bye(void *ctx) {
  struct net_conn *c = ctx;
  log_debug("net: %s said BYE", c->name);
  if (c->state == CONN_OPEN) {
    net_sess_fail_inbound(&c->sess, RUMOR_ECANCELED);
    begin_closing(c, false);
  }
  check_close_done(c);
}

/* Received chunks authenticated on the thread pool. */
struct rx_work {
  uv_work_t work;
  struct net_conn *conn;
  struct net_rx_job *job;
};

static void rx_work_cb(uv_work_t *w) {
  struct rx_work *rw = w->data;
  net_rx_job_run(rw->job);
}

static void resume_reading(struct net_conn *c);

static void rx_after_work(uv_work_t *w, int status) {
  struct rx_work *rw = w->data;
  struct net_conn *c = rw->conn;
  (void)status; /* never canceled */
  int rc = net_sess_job_done(&c->sess, rw->job);
  free(rw);
  if (c->state != CONN_CLOSED) {
    if (rc == 0) rc = net_sess_resume(&c->sess);
    if (rc < 0) session_violation(c);
    else resume_reading(c);
  }
  net_conn_unref(c); /* may free c: last */
}

static int op_submit(void *ctx, struct net_rx_job *job) {
  struct net_conn *c = ctx;
  if (!c->net->cfg.offload) return -ENOTSUP;
  struct rx_work *rw = xmalloc(sizeof *rw);
  rw->conn = c;
  rw->job = job;
  rw->work.data = rw;
  c->refs++;
  int rc = uv_queue_work(c->net->loop, &rw->work, rx_work_cb, rx_after_work);
  if (rc < 0) {
    c->refs--;
    free(rw);
  }
  return rc;
}

static int op_send_result(void *ctx, uint64_t id, enum net_bulk_result r) {
  struct net_conn *c = ctx;
  if (c->state != CONN_OPEN && c->state != CONN_CLOSING) return -ENOTCONN;
  int rc = queue_proto(c, NET_FRAME_BULK_RESULT, id, (uint64_t)r);
  if (rc == 0) pump(c);
  return rc;
}

static int op_relay(void *ctx, uint8_t type, uint64_t a, uint64_t b, const uint8_t *pt, size_t len) {
  struct net_conn *c = ctx;
  if (c->state != CONN_OPEN && c->state != CONN_CLOSING) return 0;
  return net_relay_on_frame(c, type, a, b, pt, len);
}

static const struct net_sess_ops sess_ops = {
    .on_relay = op_relay,
    .on_ready = op_ready,
    .on_msg = op_msg,
    .on_bulk_begin = op_bulk_begin,
    .on_bulk_done = op_bulk_done,
    .on_bulk_result = op_bulk_result,
    .on_bye = op_bye,
    .on_ping = op_ping,
    .send_result = op_send_result,
    .submit = op_submit,
};

/* ---- reading ---------------------------------------------------------------------------- */

static bool hs_mode(const struct net_conn *c) { return c->sess.ops == NULL; }

static void on_alloc(uv_handle_t *h, size_t suggested, uv_buf_t *buf) {
  struct net_conn *c = h->data;
  if (hs_mode(c)) {
    buf->base = (char *)c->hs_buf + c->hs_got;
    buf->len = c->hs_want - c->hs_got;
    return;
  }
  uint8_t *p;
  size_t n;
  net_sess_rx_direct(&c->sess, &p, &n);
  if (n) {
    buf->base = (char *)p;
    buf->len = n > (1u << 30) ? (1u << 30) : n;
    return;
  }
  buf->base = (char *)c->stage;
  buf->len = NET_RX_STAGE_BYTES;
}

/* Keys are ready on this side: switch reading to the encrypted session. */
static void start_session(struct net_conn *c) {
  net_t *n = c->net;
  c->suite = c->hs.suite;
  c->version = c->hs.version;
  memcpy(c->peer_pk, c->hs.peer_pk, NET_PUBKEY_BYTES);
  net_sess_init(&c->sess, !c->inbound, &n->cfg, &sess_ops, c);
  c->sess.version = c->version;
  if (c->inbound) net_sess_set_keys(&c->sess, c->suite, c->hs.k_s2c, c->hs.k_c2s);
  else net_sess_set_keys(&c->sess, c->suite, c->hs.k_c2s, c->hs.k_s2c);
  net_hs_wipe(&c->hs);
  c->stage = xmalloc(NET_RX_STAGE_BYTES);
  net_conn_set_name(c);
}

/* A whole handshake message is in hs_buf. */
static void on_hs_message(struct net_conn *c) {
  const uint8_t *body = c->hs_buf + NET_HS_LEN_BYTES;
  size_t len = c->hs_want - NET_HS_LEN_BYTES;
  c->hs_got = 0;
  c->hs_want = NET_HS_LEN_BYTES;
  struct rumor_err e = {0};
  int rc;
  if (!c->inbound) {
    uint8_t out[NET_HS_AUTH_LEN];
    rc = net_hs_client_on_welcome(&c->hs, body, len, out, &e);
    if (rc < 0) {
      net_conn_abort(c, rc, (int)c->hs.fail, "%s", e.msg);
      return;
    }
    if (c->circ_check_target && (rc = net_circuit_check_peer(c, &e)) < 0) { /* before we authenticate */
      net_conn_abort(c, rc, NET_HS_FAIL_AUTH, "%s", e.msg);
      return;
    }
    send_hs(c, out, sizeof out);
    if (c->state == CONN_CLOSED) return;
    start_session(c); /* READY comes as the first encrypted frame */
    return;
  }
  if (c->hs.state == NET_HS_S_SERVER_WAIT_HELLO) {
    uint8_t out[NET_HS_FRAME_MAX];
    size_t out_len = 0;
    rc = net_hs_server_on_hello(&c->hs, body, len, out, &out_len, &e);
    if (rc < 0 && out_len) {
      /* Tell the client why (version, cluster key), then close. */
      c->reject_then_close = true;
      c->close_status = rc;
      snprintf(c->close_detail, sizeof c->close_detail, "%s", e.msg);
      if (!c->circ) uv_read_stop((uv_stream_t *)&c->tcp); /* net_conn_feed drops the rest */
      send_hs(c, out, out_len);
      return;
    }
    if (rc < 0) {
      net_conn_abort(c, rc, (int)c->hs.fail, "%s", e.msg);
      return;
    }
    send_hs(c, out, out_len);
    return;
  }
  rc = net_hs_server_on_auth(&c->hs, body, len, &e);
  if (rc < 0) {
    net_conn_abort(c, rc, (int)c->hs.fail, "%s", e.msg);
    return;
  }
  start_session(c);
  /* READY: the first frame under the new keys confirms them to the client. */
  struct net_txframe *f = frame_alloc(NET_FRAME_OVERHEAD);
  net_frame_hdr_write(f->data, NET_FRAME_READY, 0, 0, 0);
  int sealed = net_aead_seal(&c->sess.tx, f->data, f->data + NET_FRAME_HDR, 0);
  if (sealed < 0) {
    free(f);
    net_conn_abort(c, sealed, NET_HS_FAIL_AUTH, "cannot seal READY");
    return;
  }
  f->len = NET_FRAME_OVERHEAD;
  f->sealed = f->transport = true;
  conn_write(c, f);
  if (c->state == CONN_CLOSED) return;
  became_open(c);
  if (c->net->cbs.on_accept) c->net->cbs.on_accept(c, c->net->ud);
}

static void on_hs_bytes(struct net_conn *c) {
  if (c->hs_got < c->hs_want) return;
  if (c->hs_want == NET_HS_LEN_BYTES) {
    uint16_t len = net_be16_get(c->hs_buf);
    if (len == 0 || len > NET_HS_FRAME_MAX) {
      net_conn_abort(c, RUMOR_EPROTO, NET_HS_FAIL_MALFORMED,
                     "handshake message of %u bytes (limit %d before authentication)", len, NET_HS_FRAME_MAX);
      return;
    }
    c->hs_want = NET_HS_LEN_BYTES + len;
    return;
  }
  on_hs_message(c);
}

/* The session stopped on a violation: log one line and drop. */
static void session_violation(struct net_conn *c) {
  if (c->state == CONN_CLOSED) return;
  const struct rumor_err *e = &c->sess.err;
  if (c->state == CONN_HANDSHAKE) {
    net_conn_abort(c, RUMOR_EAUTH, NET_HS_FAIL_AUTH, "key confirmation failed: %s", e->msg);
    return;
  }
  c->net->stats.dropped_violation++;
  net_conn_abort(c, e->code ? e->code : RUMOR_EPROTO, -1, "%s", e->msg);
}

void net_conn_on_eof(struct net_conn *c) {
  log_debug("net: end of stream from %s", c->name);
  c->eof = true;
  switch (c->state) {
  case CONN_HANDSHAKE:
    if (!c->inbound && !hs_mode(c))
      net_conn_abort(c, RUMOR_EAUTH, NET_HS_FAIL_REJECTED,
                     "the peer closed the connection after our authentication "
                     "(is our key on its allow-list? does it hold our cluster key?)");
    else
      net_conn_abort(c, -ECONNRESET, NET_HS_FAIL_CLOSED, "connection closed during the handshake");
    break;
  case CONN_OPEN:
    net_conn_abort(c, -ECONNRESET, -1, "connection closed without BYE (cut or truncated)");
    break;
  case CONN_CLOSING: check_close_done(c); break;
  default: break;
  }
}

/* Activity for the idle timeout: bytes beyond the PINGs received. (A
 * PING split across reads counts once, at most 39 bytes of it.) */
static void count_activity(struct net_conn *c, uint64_t now) {
  uint64_t app = c->st.bytes_in - c->sess.pings_in * NET_FRAME_OVERHEAD;
  if (app > c->app_bytes_in) {
    c->app_bytes_in = app;
    c->last_activity = now;
  }
}

static void on_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *buf) {
  struct net_conn *c = s->data;
  if (c->state == CONN_CLOSED || nread == 0) return;
  if (nread < 0) {
    if (nread == UV_EOF) {
      net_conn_on_eof(c);
      return;
    }
    net_conn_abort(c, (int)nread, c->state == CONN_HANDSHAKE ? NET_HS_FAIL_CLOSED : -1, "read failed: %s",
                   uv_strerror((int)nread));
    return;
  }
  c->st.bytes_in += (uint64_t)nread;
  uint64_t now = uv_now(c->net->loop);
  if (hs_mode(c)) {
    c->last_activity = now;
    c->hs_got += (size_t)nread;
    on_hs_bytes(c);
    return;
  }
  /* Any byte is life, those of a frame still arriving too (a 1 MiB chunk
   * on a slow link takes seconds); it authenticates, or the connection is
   * dropped anyway. */
  c->last_rx = now;
  c->verdict_pending = false;
  int rc;
  if (buf->base == (char *)c->stage) rc = net_sess_rx_feed(&c->sess, c->stage, (size_t)nread);
  else rc = net_sess_rx_commit(&c->sess, (size_t)nread);
  if (rc < 0) {
    session_violation(c);
    return;
  }
  count_activity(c, now);
  if (c->sess.paused && c->state != CONN_CLOSED && !c->rx_paused) {
    /* chunks are being authenticated on workers: wait for them */
    c->rx_paused = true;
    uv_read_stop((uv_stream_t *)&c->tcp);
  }
}

/* Starts reading the socket again when no reason to hold it remains. */
static void restart_reading(struct net_conn *c) {
  if (c->rx_paused || c->read_held || c->eof || c->circ || c->state == CONN_CLOSED) return;
  c->last_rx = uv_now(c->net->loop); /* the silence while we did not read was ours */
#ifdef RUMOR_TESTING
  if (c->test_paused) return; /* net_test_conn_pause_read */
#endif
  int rc = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
  if (rc < 0) net_conn_abort(c, rc, -1, "cannot read: %s", uv_strerror(rc));
}

static void resume_reading(struct net_conn *c) {
  if (!c->rx_paused || c->sess.paused || c->state == CONN_CLOSED) return;
  c->rx_paused = false;
  restart_reading(c);
}

void net_conn_hold_read(struct net_conn *c, bool hold) {
  if (hold == c->read_held || c->circ || c->state == CONN_CLOSED) return;
  c->read_held = hold;
  if (hold) uv_read_stop((uv_stream_t *)&c->tcp);
  else restart_reading(c);
}

/* A circuit connection's input: what on_read does with a socket's bytes (a
 * circuit needs no read buffer of its own: the session keeps what arrives
 * while it waits for its workers). */
void net_conn_feed(struct net_conn *c, const uint8_t *p, size_t len) {
  uint64_t now = uv_now(c->net->loop);
  c->st.bytes_in += len;
  c->last_rx = now; /* any byte is life, as on a socket */
  c->verdict_pending = false;
  while (len && c->state != CONN_CLOSED && !c->reject_then_close) {
    if (hs_mode(c)) {
      c->last_activity = now;
      size_t k = c->hs_want - c->hs_got;
      if (k > len) k = len;
      memcpy(c->hs_buf + c->hs_got, p, k);
      c->hs_got += k;
      p += k;
      len -= k;
      on_hs_bytes(c);
      continue;
    }
    if (net_sess_rx_feed(&c->sess, p, len) < 0) session_violation(c);
    else count_activity(c, now);
    return;
  }
}

void net_conn_start_handshake(struct net_conn *c) {
  net_t *n = c->net;
  c->state = CONN_HANDSHAKE;
  c->hs_got = 0;
  c->hs_want = NET_HS_LEN_BYTES;
  if (!c->circ) {
    uv_tcp_nodelay(&c->tcp, 1);
    if (n->cfg.sock_buf_bytes > 0) {
      int v = n->cfg.sock_buf_bytes;
      uv_send_buffer_size((uv_handle_t *)&c->tcp, &v);
      v = n->cfg.sock_buf_bytes;
      uv_recv_buffer_size((uv_handle_t *)&c->tcp, &v);
    }
    set_peer_addr(c);
    int rc = uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read);
    if (rc < 0) {
      net_conn_abort(c, rc, -1, "cannot read: %s", uv_strerror(rc));
      return;
    }
  }
  c->reading = true;
  if (c->inbound) {
    net_hs_server_start(&c->hs, &n->kr);
  } else {
    uint8_t hello[NET_HS_HELLO_LEN];
    if (net_hs_client_start(&c->hs, &n->kr, hello) < 0) {
      net_conn_abort(c, -EIO, -1, "cannot start the handshake");
      return;
    }
    send_hs(c, hello, sizeof hello);
  }
}

/* ---- the public per-connection API ---------------------------------------------------------- */

static size_t app_limit(const struct net_conn *c) { return c->net->cfg.max_queued_bytes - NET_CTRL_RESERVE; }

int net_conn_send_raw_msg(net_conn_t *c, const uint8_t *data, size_t len) {
  if (c->state != CONN_OPEN) return -ENOTCONN;
  if (len > c->net->cfg.max_msg_bytes) return RUMOR_ETOOBIG;
  if (net_mp_validate(data, len, &c->net->cfg.msg_limits, NULL, NULL) < 0) return RUMOR_EPROTO;
  int rc = queue_ctl(c, NET_FRAME_MSG, 0, 0, data, len, app_limit(c));
  if (rc < 0) return rc;
  c->st.msgs_out++;
  pump(c);
  return 0;
}

int net_conn_send_msg(net_conn_t *c, struct net_msgbuf *b) {
  if (b->failed) return -ENOMEM;
  size_t len;
  const uint8_t *p = net_msgbuf_data(b, &len);
  return net_conn_send_raw_msg(c, p, len);
}

int net_conn_send_bulk(net_conn_t *c, const struct net_bulk_send *s, uint64_t *id_out) {
  if (c->state != CONN_OPEN) return -ENOTCONN;
  if (!s->done || !net_dtype_valid(s->wire) || (s->count && !s->src) || (s->meta_len && !s->meta)) return -EINVAL;
  if (s->meta_len > NET_BULK_META_MAX || s->count > UINT64_MAX / 4) return RUMOR_ETOOBIG;
  struct net_tx_bulk *t = net_alloc_aligned(sizeof *t);
  t->id = ++c->next_tx_id;
  c->sess.last_out_id = t->id;
  t->src = s->src;
  t->count = s->count;
  t->wire = s->wire;
  t->digest = !s->no_digest;
  t->chunk_elems = net_bulk_chunk_elems(s->wire, c->net->cfg.bulk_chunk_bytes);
  t->phase = NET_TX_BEGIN;
  if (s->meta_len) {
    t->meta = xmalloc(s->meta_len);
    memcpy(t->meta, s->meta, s->meta_len);
    t->meta_len = s->meta_len;
  }
  t->done = s->done;
  t->arg = s->arg;
  if (c->tx_tail) c->tx_tail->next = t;
  else c->tx_head = t;
  c->tx_tail = t;
  if (id_out) *id_out = t->id;
  pump(c);
  return 0;
}

int net_conn_cancel_send(net_conn_t *c, uint64_t id) {
  bool in_wait = false;
  struct net_tx_bulk *t = unlink_tx(c, id, &in_wait);
  if (!t) return RUMOR_ENOTFOUND;
  if (!in_wait && (t->phase == NET_TX_DATA || t->phase == NET_TX_END) &&
      (c->state == CONN_OPEN || c->state == CONN_CLOSING))
    (void)queue_proto(c, NET_FRAME_BULK_ABORT, id, 0);
  tx_finish(c, t, RUMOR_ECANCELED);
  pump(c);
  return 0;
}

int net_conn_cancel_recv(net_conn_t *c, uint64_t id) {
  struct net_rx_bulk *ib = &c->sess.ib;
  if (!ib->active || ib->id != id || !ib->accepted) return RUMOR_ENOTFOUND;
  net_sess_cancel_inbound(&c->sess, RUMOR_ECANCELED); /* the rest is read and discarded */
  if (!ib->result_sent && (c->state == CONN_OPEN || c->state == CONN_CLOSING)) {
    ib->result_sent = true;
    if (queue_proto(c, NET_FRAME_BULK_RESULT, id, NET_BULK_CANCELED) == 0) pump(c);
  }
  return 0;
}

const uint8_t *net_conn_peer_key(const net_conn_t *c) { return c->peer_pk; }
const char *net_conn_peer_addr(const net_conn_t *c) { return c->addr; }
const char *net_conn_peer_name(const net_conn_t *c) { return c->name; }
bool net_conn_inbound(const net_conn_t *c) { return c->inbound; }
void net_conn_set_data(net_conn_t *c, void *data) { c->data = data; }
void *net_conn_data(const net_conn_t *c) { return c->data; }
net_t *net_conn_net(const net_conn_t *c) { return c->net; }
size_t net_conn_queued_bytes(const net_conn_t *c) { return queued(c); }
unsigned net_conn_suite(const net_conn_t *c) { return c->suite; }
bool net_conn_judged_dead(const net_conn_t *c) { return c->judged_dead; }

int net_conn_tcp_path(const net_conn_t *c, struct net_tcp_path *out) {
  memset(out, 0, sizeof *out);
  if (c->circ) {
    if (!c->circ_carrier) return -ENOTCONN; /* its carrier is gone */
    c = c->circ_carrier;                     /* a circuit: the carrier's socket, to the relay */
  }
  uv_os_fd_t fd;
  if (uv_fileno((const uv_handle_t *)&c->tcp, &fd) != 0) return -ENOTCONN;
  return net_tcp_counters(fd, &out->data_segs_out, &out->retrans_segs, &out->rtt_us);
}

void net_conn_stats_get(const net_conn_t *c, struct net_conn_stats *s) {
  *s = c->st;
  s->frames_in += c->sess.frames_in;
  s->msgs_in += c->sess.msgs_in;
  s->bulk_in_ok += c->sess.bulk_in_ok;
  s->bulk_in_failed += c->sess.bulk_in_failed;
}

/* ---- test hooks (the testing build only) --------------------------------------------------------- */

#ifdef RUMOR_TESTING
int net_test_conn_pause_read(net_conn_t *c, bool pause) {
  if (c->state == CONN_CLOSED) return -ENOTCONN;
  if (pause == c->test_paused) return 0;
  c->test_paused = pause;
  c->last_rx = uv_now(c->net->loop); /* our own pause is not the peer's silence */
  if (pause) return uv_read_stop((uv_stream_t *)&c->tcp);
  restart_reading(c);
  return 0;
}

int net_test_conn_send_frame(net_conn_t *c, uint8_t type, uint64_t a, uint64_t b, const void *pt, size_t len) {
  if (c->state != CONN_OPEN) return -ENOTCONN;
  int rc = queue_ctl(c, type, a, b, pt, len, SIZE_MAX);
  if (rc == 0) pump(c);
  return rc;
}

int net_test_conn_write_raw(net_conn_t *c, const void *p, size_t len) {
  if (c->state != CONN_OPEN) return -ENOTCONN;
  struct net_txframe *f = frame_alloc(len);
  memcpy(f->data, p, len);
  f->len = len;
  f->sealed = true;
  conn_write(c, f);
  return 0;
}
#endif /* RUMOR_TESTING */
