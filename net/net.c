/*
 * The net object: configuration, listening and accepting, dialing (name
 * resolution, trying each address), the thread hand-off queue, statistics
 * and closing everything.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/transport_impl.h"

#define NET_DEFAULT_MAX_MSG (1u << 20)
#define NET_DEFAULT_MAX_BULK (16ull << 30)
#define NET_DEFAULT_CHUNK (1u << 20)
#define NET_DEFAULT_MAX_QUEUED (8u << 20)
#define NET_DEFAULT_MAX_PENDING 64
#define NET_DEFAULT_MAX_CONNS 1024
#define NET_DEFAULT_HS_TIMEOUT_MS 10000
#define NET_DEFAULT_IDLE_TIMEOUT_MS 120000
#define NET_DEFAULT_LINGER_MS 2000
#define NET_DEFAULT_HEARTBEAT_MS 250
#define NET_DEFAULT_DEAD_AFTER_MS 1000
#define NET_DEFAULT_SPARE_DECAY_MS 10000
#define NET_MAX_MSG_LIMIT (64u << 20)

void net_config_defaults(struct net_config *c) {
  memset(c, 0, sizeof *c);
  c->max_msg_bytes = NET_DEFAULT_MAX_MSG;
  c->max_bulk_bytes = NET_DEFAULT_MAX_BULK;
  c->bulk_chunk_bytes = NET_DEFAULT_CHUNK;
  c->max_queued_bytes = NET_DEFAULT_MAX_QUEUED;
  c->max_pending_handshakes = NET_DEFAULT_MAX_PENDING;
  c->max_conns = NET_DEFAULT_MAX_CONNS;
  c->handshake_timeout_ms = NET_DEFAULT_HS_TIMEOUT_MS;
  c->idle_timeout_ms = NET_DEFAULT_IDLE_TIMEOUT_MS;
  c->close_linger_ms = NET_DEFAULT_LINGER_MS;
  c->heartbeat_ms = NET_DEFAULT_HEARTBEAT_MS;
  c->dead_after_ms = NET_DEFAULT_DEAD_AFTER_MS;
  c->spare_frame_decay_ms = NET_DEFAULT_SPARE_DECAY_MS;
  c->suites = NET_SUITE_AES256GCM | NET_SUITE_CHACHA20POLY1305;
  c->offload = true;
  c->msg_limits.max_depth = NET_MSG_MAX_DEPTH;
  c->msg_limits.max_elems = NET_MSG_DEFAULT_MAX_ELEMS;
}

/* ---- addresses ------------------------------------------------------------------- */

int net_addr_parse(const char *s, int min_port, char *host, size_t hostcap, int *port, struct rumor_err *e) {
  const char *colon;
  size_t hl;
  const char *h = s;
  if (s[0] == '[') {
    const char *rb = strchr(s, ']');
    if (!rb || rb[1] != ':') return rumor_err_set(e, RUMOR_EFORMAT, "'%s': expected [address]:port", s);
    h = s + 1;
    hl = (size_t)(rb - h);
    colon = rb + 1;
  } else {
    colon = strrchr(s, ':');
    if (!colon) return rumor_err_set(e, RUMOR_EFORMAT, "'%s': expected host:port", s);
    if (memchr(s, ':', (size_t)(colon - s)))
      return rumor_err_set(e, RUMOR_EFORMAT, "'%s': write IPv6 addresses as [address]:port", s);
    hl = (size_t)(colon - s);
  }
  if (hl >= hostcap) return rumor_err_set(e, RUMOR_EFORMAT, "'%s': host name too long", s);
  for (size_t i = 0; i < hl; i++)
    if ((unsigned char)h[i] <= ' ' || (unsigned char)h[i] >= 0x7f)
      return rumor_err_set(e, RUMOR_EFORMAT, "'%s': the host has a space or a control character", s);
  int64_t p;
  if (parse_i64(colon + 1, min_port, 65535, &p) != 0) {
    bool number = parse_i64(colon + 1, INT64_MIN, INT64_MAX, &p) == 0;
    return rumor_err_set(e, RUMOR_EFORMAT, "'%s': port must be %sin [%d, 65535]", s, number ? "" : "a number ",
                         min_port);
  }
  memcpy(host, h, hl);
  host[hl] = '\0';
  *port = (int)p;
  return 0;
}

int net_addr_check_listen(const char *s, struct rumor_err *e) {
  char host[NET_HOST_MAX];
  int port;
  return net_addr_parse(s, 0, host, sizeof host, &port, e);
}

int net_addr_check_dial(const char *s, struct rumor_err *e) {
  char host[NET_HOST_MAX];
  int port;
  int rc = net_addr_parse(s, 1, host, sizeof host, &port, e);
  if (rc) return rc;
  if (!host[0]) return rumor_err_set(e, RUMOR_EFORMAT, "'%s': the host is missing (expected host:port)", s);
  return 0;
}

int net_addr_list_check(const char *list, struct rumor_err *e) {
  if (!list || !*list) return rumor_err_set(e, RUMOR_EFORMAT, "no address (expected host:port,host:port,...)");
  for (const char *p = list;;) {
    size_t len = strcspn(p, ",");
    if (len == 0)
      return rumor_err_set(e, RUMOR_EFORMAT, "'%s' has an empty entry (expected host:port,host:port,...)", list);
    char one[NET_HOST_MAX + 8];
    if (len >= sizeof one) return rumor_err_set(e, RUMOR_EFORMAT, "'%.40s...': address too long", p);
    memcpy(one, p, len);
    one[len] = '\0';
    int rc = net_addr_check_dial(one, e);
    if (rc) return rc;
    if (!p[len]) return 0;
    p += len + 1;
  }
}

int net_addr_list_split(const char *list, char *out, size_t width, size_t max, size_t *n, struct rumor_err *e) {
  *n = 0;
  int rc = net_addr_list_check(list, e);
  if (rc) return rc;
  for (const char *p = list;;) {
    size_t len = strcspn(p, ",");
    if (*n == max) return rumor_err_set(e, RUMOR_EFORMAT, "more than %zu addresses", max);
    if (len >= width)
      return rumor_err_set(e, RUMOR_EFORMAT, "'%.*s' is longer than %zu characters", (int)len, p, width - 1);
    memcpy(out + *n * width, p, len);
    out[*n * width + len] = '\0';
    (*n)++;
    if (!p[len]) return 0;
    p += len + 1;
  }
}

int net_addr_resolve(uv_loop_t *loop, const char *s, struct sockaddr_storage *ss, struct rumor_err *e) {
  char host[NET_HOST_MAX];
  int port;
  int rc = net_addr_parse(s, 0, host, sizeof host, &port, e);
  if (rc) return rc;
  const char *h = host[0] ? host : "0.0.0.0";
  memset(ss, 0, sizeof *ss);
  if (uv_ip4_addr(h, port, (struct sockaddr_in *)ss) == 0) return 0;
  if (uv_ip6_addr(h, port, (struct sockaddr_in6 *)ss) == 0) return 0;
  uv_getaddrinfo_t req;
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_PASSIVE};
  char ps[8];
  snprintf(ps, sizeof ps, "%d", port);
  rc = uv_getaddrinfo(loop, &req, NULL, h, ps, &hints);
  if (rc < 0) return rumor_err_set(e, rc, "'%s': cannot resolve the host name '%s': %s", s, h, uv_strerror(rc));
  memcpy(ss, req.addrinfo->ai_addr, req.addrinfo->ai_addrlen);
  uv_freeaddrinfo(req.addrinfo);
  return 0;
}

/* ---- init ----------------------------------------------------------------------- */

static void on_async(uv_async_t *a);

static int check_config(const struct net_config *c, struct rumor_err *e) {
  if (c->max_msg_bytes < 64 || c->max_msg_bytes > NET_MAX_MSG_LIMIT)
    return rumor_err_set(e, -EINVAL, "net: max_msg_bytes must be in [64, %u]", NET_MAX_MSG_LIMIT);
  if (c->bulk_chunk_bytes < NET_BULK_CHUNK_MIN || c->bulk_chunk_bytes > NET_BULK_CHUNK_MAX ||
      c->bulk_chunk_bytes % 4)
    return rumor_err_set(e, -EINVAL, "net: bulk_chunk_bytes must be a multiple of 4 in [%u, %u]",
                         NET_BULK_CHUNK_MIN, NET_BULK_CHUNK_MAX);
  size_t need = c->bulk_chunk_bytes + NET_FRAME_OVERHEAD;
  size_t begin_max = NET_FRAME_OVERHEAD + NET_BULK_BEGIN_FIXED + NET_BULK_META_MAX;
  if (begin_max > need) need = begin_max;
  if (c->max_queued_bytes < need + NET_CTRL_RESERVE)
    return rumor_err_set(e, -EINVAL, "net: max_queued_bytes must be at least %zu for %zu-byte bulk chunks",
                         need + NET_CTRL_RESERVE, c->bulk_chunk_bytes);
  if (!c->handshake_timeout_ms || !c->max_pending_handshakes || !c->max_conns || !c->close_linger_ms)
    return rumor_err_set(e, -EINVAL, "net: timeouts and connection limits must be positive");
  if (c->heartbeat_ms && c->dead_after_ms <= c->heartbeat_ms)
    return rumor_err_set(e, -EINVAL,
                         "net: dead_after_ms (%u) must exceed heartbeat_ms (%u): a peer is judged dead after "
                         "dead_after_ms of silence, and it pings every heartbeat_ms (heartbeat_ms 0 turns both off)",
                         c->dead_after_ms, c->heartbeat_ms);
  if (c->msg_limits.max_depth > NET_MSG_MAX_DEPTH)
    return rumor_err_set(e, -EINVAL, "net: message depth limit above %d", NET_MSG_MAX_DEPTH);
  return 0;
}

/* A peer that goes away must not kill the process: writes to its socket
 * then fail with EPIPE instead of raising SIGPIPE. Only the default action
 * is changed; a handler the application installed is left alone. */
static void ignore_sigpipe(void) {
  struct sigaction old;
  if (sigaction(SIGPIPE, NULL, &old) == 0 && old.sa_handler == SIG_DFL && !(old.sa_flags & SA_SIGINFO)) {
    struct sigaction ign;
    memset(&ign, 0, sizeof ign);
    ign.sa_handler = SIG_IGN;
    sigemptyset(&ign.sa_mask);
    sigaction(SIGPIPE, &ign, NULL);
  }
}

int net_init(net_t **out, uv_loop_t *loop, const struct net_config *cfg, const struct net_callbacks *cbs, void *ud,
             struct rumor_err *e) {
  *out = NULL;
  int rc = check_config(cfg, e);
  if (rc < 0) return rc;
  ignore_sigpipe();
  net_t *n = xcalloc(1, sizeof *n);
  n->loop = loop;
  n->cfg = *cfg;
  n->cfg.identity = NULL; /* copied into the keyring; the caller's memory is not kept */
  n->cfg.cluster_key = NULL;
  n->cfg.allow = NULL;
  if (cbs) n->cbs = *cbs;
  n->ud = ud;
  rc = net_keyring_init(&n->kr, cfg, e);
  if (rc < 0) goto err_free;
  if (pthread_mutex_init(&n->call_mu, NULL) != 0) {
    rc = rumor_err_set(e, -ENOMEM, "net: cannot create a mutex");
    goto err_keys;
  }
  rc = uv_async_init(loop, &n->async, on_async);
  if (rc < 0) {
    rumor_err_set(e, rc, "net: uv_async_init: %s", uv_strerror(rc));
    goto err_mutex;
  }
  n->async.data = n;
  RUMOR_ASSERT(uv_tcp_init(loop, &n->listener) == 0);
  n->listener.data = n;
  n->handles = 2;
  net_relay_init(n);
  n->chunk_frame_cap = NET_FRAME_OVERHEAD + cfg->bulk_chunk_bytes;
  n->bulk_window = NET_BULK_WINDOW_CHUNKS * n->chunk_frame_cap;
  if (n->bulk_window > cfg->max_queued_bytes - NET_CTRL_RESERVE) n->bulk_window = cfg->max_queued_bytes - NET_CTRL_RESERVE;
  *out = n;
  return 0;

err_mutex:
  pthread_mutex_destroy(&n->call_mu);
err_keys:
  net_keyring_wipe(&n->kr);
err_free:
  free(n);
  return rc;
}

/* ---- listening ------------------------------------------------------------------------ */

static void on_connection(uv_stream_t *server, int status) {
  net_t *n = server->data;
  if (status < 0) {
    log_warn("net: accept failed: %s", uv_strerror(status));
    return;
  }
  struct net_conn *c = net_conn_new(n, true);
  int rc = uv_accept(server, (uv_stream_t *)&c->tcp);
  if (rc < 0) {
    net_conn_abort(c, rc, -1, "accept failed: %s", uv_strerror(rc));
    return;
  }
  n->stats.conns_accepted++;
  if (n->closing) {
    net_conn_abort(c, RUMOR_ECANCELED, -1, "the net is closing");
    return;
  }
  if (n->n_pending >= n->cfg.max_pending_handshakes || n->n_conns > n->cfg.max_conns) {
    net_conn_abort(c, -EBUSY, NET_HS_FAIL_BUSY, "too many connections (%u unauthenticated, %u in all)", n->n_pending,
                   n->n_conns - 1);
    return;
  }
  c->counted_pending = true;
  n->n_pending++;
  net_conn_start_handshake(c);
}

int net_listen(net_t *n, const char *addr, struct rumor_err *e) {
  if (n->closing) return rumor_err_set(e, RUMOR_ECANCELED, "net: closing");
  if (n->listening) return rumor_err_set(e, -EALREADY, "net: already listening on port %d", n->port);
  struct sockaddr_storage ss;
  int rc = net_addr_resolve(n->loop, addr, &ss, e);
  if (rc < 0) return rc;
  rc = uv_tcp_bind(&n->listener, (const struct sockaddr *)&ss, 0);
  if (rc == 0) rc = uv_listen((uv_stream_t *)&n->listener, NET_LISTEN_BACKLOG, on_connection);
  if (rc < 0) return rumor_err_set(e, rc, "cannot listen on %s: %s", addr, uv_strerror(rc));
  struct sockaddr_storage bound;
  int len = sizeof bound;
  rc = uv_tcp_getsockname(&n->listener, (struct sockaddr *)&bound, &len);
  if (rc < 0) return rumor_err_set(e, rc, "getsockname: %s", uv_strerror(rc));
  n->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                               : ((struct sockaddr_in *)&bound)->sin_port);
  n->listening = true;
  log_info("net: listening on %s (port %d)", addr, n->port);
  return 0;
}

int net_listen_port(const net_t *n) { return n->listening ? n->port : 0; }

/* ---- dialing ---------------------------------------------------------------------------- */

static void on_connected(uv_connect_t *req, int status);

static void on_retry_closed(uv_handle_t *h) {
  struct net_conn *c = h->data;
  c->retrying = false;
  if (c->state == CONN_CLOSED) {
    net_conn_on_handle_closed(h);
    return;
  }
  RUMOR_ASSERT(uv_tcp_init(c->net->loop, &c->tcp) == 0);
  c->tcp.data = c;
  net_try_connect(c);
}

/* The last attempt failed with `err`: try the next address, or give up. */
static void connect_next(struct net_conn *c, int err) {
  if (!c->ai_next) {
    net_conn_abort(c, err, -1, "cannot connect to %s: %s", c->addr, uv_strerror(err));
    return;
  }
  c->retrying = true; /* a fresh handle: the failed socket may be of another family */
  uv_close((uv_handle_t *)&c->tcp, on_retry_closed);
}

void net_try_connect(struct net_conn *c) {
  struct addrinfo *ai = c->ai_next;
  c->ai_next = ai->ai_next;
  c->creq.data = c;
  int rc = uv_tcp_connect(&c->creq, &c->tcp, ai->ai_addr, on_connected);
  if (rc < 0) connect_next(c, rc);
}

static void on_connected(uv_connect_t *req, int status) {
  struct net_conn *c = req->data;
  if (c->state == CONN_CLOSED) return;
  if (status < 0) {
    connect_next(c, status);
    return;
  }
  net_conn_start_handshake(c);
}

static void on_resolved(uv_getaddrinfo_t *req, int status, struct addrinfo *res) {
  struct net_conn *c = req->data;
  c->resolving = false;
  if (c->state == CONN_CLOSED) {
    if (res) uv_freeaddrinfo(res);
    net_conn_unref(c); /* may free c */
    return;
  }
  c->refs--; /* not the last: the handles are open */
  if (status < 0 || !res) {
    net_conn_abort(c, status < 0 ? status : -ENOENT, -1, "cannot resolve %s: %s", c->addr,
                   status < 0 ? uv_strerror(status) : "no address");
    return;
  }
  c->ai = c->ai_next = res;
  c->state = CONN_CONNECTING;
  net_try_connect(c);
}

int net_dial(net_t *n, const char *addr, net_dial_cb cb, void *arg) {
  if (n->closing) return RUMOR_ECANCELED;
  if (!cb) return -EINVAL;
  char host[NET_HOST_MAX], ps[8];
  int port;
  int rc = net_addr_parse(addr, 1, host, sizeof host, &port, NULL);
  if (rc < 0) return rc;
  if (!host[0]) return RUMOR_EFORMAT;
  if (n->n_conns >= n->cfg.max_conns) return -EBUSY;
  struct net_conn *c = net_conn_new(n, false);
  snprintf(c->addr, sizeof c->addr, "%s", addr);
  net_conn_set_name(c);
  snprintf(ps, sizeof ps, "%d", port);
  struct addrinfo hints = {.ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV};
  c->gai.data = c;
  rc = uv_getaddrinfo(n->loop, &c->gai, on_resolved, host, ps, &hints);
  if (rc < 0) {
    net_conn_abort(c, rc, -1, "cannot resolve %s: %s", addr, uv_strerror(rc)); /* dial_cb unset: not called */
    return rc;
  }
  c->resolving = true;
  c->refs++;
  c->dial_cb = cb;
  c->dial_arg = arg;
  n->stats.conns_dialed++;
  return 0;
}

/* ---- thread hand-off ---------------------------------------------------------------------- */

static void run_calls(net_t *n, struct net_call_item *it, int status) {
  while (it) {
    struct net_call_item *next = it->next;
    it->fn(n, it->arg, status);
    free(it);
    it = next;
  }
}

static void on_async(uv_async_t *a) {
  net_t *n = a->data;
  pthread_mutex_lock(&n->call_mu);
  struct net_call_item *it = n->call_head;
  n->call_head = n->call_tail = NULL;
  pthread_mutex_unlock(&n->call_mu);
  run_calls(n, it, 0);
}

int net_call(net_t *n, net_call_fn fn, void *arg) {
  struct net_call_item *it = xmalloc(sizeof *it);
  it->next = NULL;
  it->fn = fn;
  it->arg = arg;
  pthread_mutex_lock(&n->call_mu);
  if (n->call_closed) {
    pthread_mutex_unlock(&n->call_mu);
    free(it);
    return RUMOR_ECANCELED;
  }
  if (n->call_tail) n->call_tail->next = it;
  else n->call_head = it;
  n->call_tail = it;
  /* Under the mutex: once net_close has set call_closed, no thread can still
   * be about to touch the async handle. */
  uv_async_send(&n->async);
  pthread_mutex_unlock(&n->call_mu);
  return 0;
}

/* ---- statistics ----------------------------------------------------------------------------- */

void net_stats_get(const net_t *n, struct net_stats *s) {
  *s = n->stats;
  s->spare_frame_bytes = (uint64_t)n->frame_pool_n * n->chunk_frame_cap;
  s->conns_open = 0;
  for (const struct net_conn *c = n->conns; c; c = c->next) {
    struct net_conn_stats cs;
    net_conn_stats_get(c, &cs);
    net_conn_stats_add(c->circ ? &s->relayed : &s->total, &cs);
    if (c->surfaced && c->state != CONN_CLOSED) {
      s->conns_open++;
      if (c->circ) s->relayed_open++;
    }
  }
}

/* ---- closing -------------------------------------------------------------------------------- */

static void maybe_finish(net_t *n) {
  if (!n->closing || n->handles || n->conns) return;
  void (*cb)(void *) = n->close_cb;
  void *arg = n->close_arg;
  if (cb) cb(arg);
  net_frame_pool_free(n);
  net_keyring_wipe(&n->kr);
  pthread_mutex_destroy(&n->call_mu);
  free(n);
}

void net_conn_unlink(struct net_conn *c) {
  net_t *n = c->net;
  if (c->prev) c->prev->next = c->next;
  else n->conns = c->next;
  if (c->next) c->next->prev = c->prev;
  n->n_conns--;
  maybe_finish(n);
}

static void on_net_handle_closed(uv_handle_t *h) {
  net_t *n = h->data;
  n->handles--;
  maybe_finish(n);
}

void net_close(net_t *n, void (*cb)(void *arg), void *arg) {
  RUMOR_ASSERT(!n->closing);
  n->closing = true;
  n->close_cb = cb;
  n->close_arg = arg;
  pthread_mutex_lock(&n->call_mu);
  n->call_closed = true;
  struct net_call_item *it = n->call_head;
  n->call_head = n->call_tail = NULL;
  pthread_mutex_unlock(&n->call_mu);
  run_calls(n, it, RUMOR_ECANCELED);
  uv_close((uv_handle_t *)&n->async, on_net_handle_closed);
  uv_close((uv_handle_t *)&n->listener, on_net_handle_closed);
  net_relay_close(n, on_net_handle_closed);
  /* Connections leave the list only in close callbacks, so walking it while
   * closing them is safe. */
  for (struct net_conn *c = n->conns; c; c = c->next) {
    if (c->state == CONN_OPEN) net_conn_close(c);
    else if (c->state < CONN_OPEN) net_conn_abort(c, RUMOR_ECANCELED, -1, "the net is closing");
  }
}
