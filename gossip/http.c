/*
 * A minimal HTTP/1.0 server for the metrics endpoint and `rumor top --web`
 * (gossip_monitor_serve): GET and HEAD only, one request per connection,
 * bounded header size and time, a cap on concurrent clients (a full server
 * drops its oldest unfinished client), a lingering close (on_shut: input
 * after the request is drained, so that it cannot reset the connection
 * under the answer), and on a loopback bind only requests
 * whose Host is a loopback name (DNS rebinding). It answers
 * Prometheus scrapes, health probes and the web view's page and polls; it is
 * not a general web server. Plain text and unauthenticated: bind it to an address
 * that only the monitoring system reaches. The request's bytes are read by
 * net's net_http_parse (a pure function, fuzzed): this file is the I/O
 * around it and the answers.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

#define HTTP_MAX_CLIENTS 32
#define HTTP_TIMEOUT_MS 5000        /* from the connection to the end of the request */
#define HTTP_WRITE_TIMEOUT_MS 30000 /* from the answer to the end of its write (a large /state.json, a slow client) */
#define HTTP_LINGER_MS 2000         /* after the answer: input read and dropped until the client closes */

struct http_client {
  uv_tcp_t tcp;     /* first: the handle's data points here */
  struct http_client *prev, *next; /* the server's list of open clients */
  uv_timer_t timer;
  uv_write_t wreq;
  uv_shutdown_t sreq;
  struct gossip_http *srv;
  char req[NET_HTTP_HEAD_MAX]; /* the request as read; not NUL-terminated */
  size_t len;
  char *resp;
  int handles;      /* open handles; freed at 0 */
  bool responded, head_only, closing;
  bool lingering; /* the answer handed over whole and our side shut (on_shut) */
};

struct gossip_http {
  uv_tcp_t listener;
  gossip_http_handler handler;
  void *ctx;
  int port;
  int clients;              /* allocated, until their handles have closed */
  int live;                 /* of them, not closing: what the cap counts */
  struct http_client *head; /* newest first */
  bool loopback;            /* bound to a loopback address: Host is checked */
  bool stopping, listener_closed;
};

static void maybe_free_server(struct gossip_http *h) {
  if (h->stopping && h->listener_closed && h->clients == 0) free(h);
}

static void on_listener_closed(uv_handle_t *hd) {
  struct gossip_http *h = hd->data;
  h->listener_closed = true;
  maybe_free_server(h);
}

static void on_client_handle_closed(uv_handle_t *hd) {
  struct http_client *c = hd->data;
  if (--c->handles > 0) return;
  struct gossip_http *h = c->srv;
  if (c->prev) c->prev->next = c->next;
  else h->head = c->next;
  if (c->next) c->next->prev = c->prev;
  free(c->resp);
  free(c);
  h->clients--;
  maybe_free_server(h);
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf);
static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf);

static void client_close(struct http_client *c) {
  if (!c->closing) {
    /* Counted out now: its handles close at the end of this loop
     * iteration, and a client accepted before then must not find the
     * server full of clients that are already going. */
    c->closing = true;
    c->srv->live--;
  }
  if (!uv_is_closing((uv_handle_t *)&c->tcp)) uv_close((uv_handle_t *)&c->tcp, on_client_handle_closed);
  if (!uv_is_closing((uv_handle_t *)&c->timer)) uv_close((uv_handle_t *)&c->timer, on_client_handle_closed);
}

static void on_timeout(uv_timer_t *t) { client_close(t->data); }

/* The answer is out and our side of the connection shut (FIN after the
 * answer): keep reading, and dropping, what the client still sends until it
 * closes or HTTP_LINGER_MS pass. Closing with unread input would make the
 * kernel reset the connection and drop whatever of the answer it had not
 * delivered yet (a request with a body, a client that pipelines, or one
 * slow to read a large answer). */
static void on_shut(uv_shutdown_t *req, int status) {
  struct http_client *c = req->data;
  if (status < 0 || uv_is_closing((uv_handle_t *)&c->tcp)) {
    client_close(c);
    return;
  }
  uv_timer_start(&c->timer, on_timeout, HTTP_LINGER_MS, 0);
  c->lingering = true;
  c->len = 0;
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) client_close(c);
}

static void on_written(uv_write_t *req, int status) {
  struct http_client *c = req->data;
  c->sreq.data = c;
  if (status < 0 || uv_is_closing((uv_handle_t *)&c->tcp) ||
      uv_shutdown(&c->sreq, (uv_stream_t *)&c->tcp, on_shut) != 0)
    client_close(c);
}

/* Answers and closes: status line, headers (Content-Length is the body's
 * even for HEAD, which gets no body) and the body. */
static void respond(struct http_client *c, int status, const char *type, const char *body, size_t blen) {
  if (c->responded) return;
  c->responded = true;
  uv_read_stop((uv_stream_t *)&c->tcp);
  const char *reason = status == 200   ? "OK"
                       : status == 403 ? "Forbidden"
                       : status == 404 ? "Not Found"
                       : status == 405 ? "Method Not Allowed"
                       : status == 431 ? "Request Header Fields Too Large"
                       : status == 503 ? "Service Unavailable"
                                       : "Bad Request";
  char head[512];
  int n = snprintf(head, sizeof head,
                   "HTTP/1.0 %d %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\nCache-Control: no-store\r\n"
                   "X-Content-Type-Options: nosniff\r\n%sConnection: close\r\n\r\n",
                   status, reason, type, blen, status == 405 ? "Allow: GET, HEAD\r\n" : "");
  RUMOR_ASSERT(n > 0 && (size_t)n < sizeof head); /* handlers' types are short literals */
  if (c->head_only) blen = 0;
  c->resp = xmalloc((size_t)n + blen);
  memcpy(c->resp, head, (size_t)n);
  if (blen) memcpy(c->resp + n, body, blen);
  uv_buf_t buf = uv_buf_init(c->resp, (unsigned)((size_t)n + blen));
  c->wreq.data = c;
  uv_timer_start(&c->timer, on_timeout, HTTP_WRITE_TIMEOUT_MS, 0);
  if (uv_write(&c->wreq, (uv_stream_t *)&c->tcp, &buf, 1, on_written) != 0) client_close(c);
}

#define HTTP_FORBIDDEN_BODY "this server answers only requests for a loopback host\n"

/* A complete, well-formed request head (net_http_parse): the Host check on
 * a loopback bind, then the handler's answer. */
static void handle_request(struct http_client *c, const struct net_http_request *r) {
  c->head_only = r->method == NET_HTTP_HEAD;
  /* Clients without Host (HTTP/1.0) pass. */
  if (c->srv->loopback && r->host && !net_http_host_is_loopback(r->host, r->host_len)) {
    respond(c, 403, "text/plain", STR_LIT(HTTP_FORBIDDEN_BODY));
    return;
  }
  /* The handler takes a string: the path ends in place, at the '?' or the
   * space after it (the request is answered once and not parsed again). */
  c->req[(size_t)(r->path - c->req) + r->path_len] = '\0';
  char *body = NULL;
  size_t blen = 0;
  const char *type = "text/plain; charset=utf-8";
  int status = c->srv->handler(c->srv->ctx, r->path, &body, &blen, &type);
  respond(c, status, type, body ? body : "", body ? blen : 0);
  free(body);
}

static void on_alloc(uv_handle_t *hd, size_t suggested, uv_buf_t *buf) {
  struct http_client *c = hd->data;
  /* Never full while a request is read: the parser answers 431 once
   * NET_HTTP_HEAD_MAX bytes hold no whole head. */
  *buf = uv_buf_init(c->req + c->len, (unsigned)(sizeof c->req - c->len));
}

static void on_read(uv_stream_t *s, ssize_t n, const uv_buf_t *buf) {
  struct http_client *c = s->data;
  if (n < 0) {
    client_close(c);
    return;
  }
  if (c->responded) return; /* lingering (on_shut): dropped; c->len stays 0 */
  c->len += (size_t)n;
  struct net_http_request r;
  net_http_parse(c->req, c->len, &r);
  if (r.status) respond(c, r.status, "text/plain", r.reason, strlen(r.reason));
  else if (r.complete) handle_request(c, &r);
}

static void on_connection(uv_stream_t *l, int status) {
  struct gossip_http *h = l->data;
  if (status < 0 || h->stopping) return;
  struct http_client *c = xcalloc(1, sizeof *c);
  c->srv = h;
  uv_tcp_init(l->loop, &c->tcp);
  uv_timer_init(l->loop, &c->timer);
  c->tcp.data = c;
  c->timer.data = c;
  c->handles = 2;
  h->clients++;
  h->live++;
  c->next = h->head;
  if (h->head) h->head->prev = c;
  h->head = c;
  if (uv_accept(l, (uv_stream_t *)&c->tcp) != 0) {
    client_close(c);
    return;
  }
  if (h->live > HTTP_MAX_CLIENTS) {
    /* Full: the oldest client still sending its request goes, so that
     * clients that connect and say nothing cannot keep everyone out; else
     * the oldest lingering one (it has its whole answer). Only clients
     * whose answer is still being written keep their place. */
    struct http_client *oldest = NULL, *oldest_done = NULL;
    for (struct http_client *o = h->head; o; o = o->next) {
      if (o == c || o->closing) continue;
      if (!o->responded) oldest = o;
      else if (o->lingering) oldest_done = o;
    }
    if (!oldest) oldest = oldest_done;
    if (!oldest) {
      client_close(c);
      return;
    }
    client_close(oldest);
  }
  uv_timer_start(&c->timer, on_timeout, HTTP_TIMEOUT_MS, 0);
  if (uv_read_start((uv_stream_t *)&c->tcp, on_alloc, on_read) != 0) client_close(c);
}

int gossip_http_start(uv_loop_t *loop, const char *what, const char *addr, gossip_http_handler handler, void *ctx,
                      struct gossip_http **out, struct rumor_err *e) {
  struct sockaddr_storage ss;
  int rc = net_addr_resolve(loop, addr, &ss, e);
  if (rc) return rumor_err_prefix(e, "%s", what);
  struct gossip_http *h = xcalloc(1, sizeof *h);
  h->handler = handler;
  h->ctx = ctx;
  uv_tcp_init(loop, &h->listener);
  h->listener.data = h;
  if ((rc = uv_tcp_bind(&h->listener, (const struct sockaddr *)&ss, 0)) ||
      (rc = uv_listen((uv_stream_t *)&h->listener, 64, on_connection))) {
    rumor_err_set(e, rc, "cannot listen on %s for %s: %s", addr, what, uv_strerror(rc));
    h->stopping = true; /* freed when the listener's close completes */
    uv_close((uv_handle_t *)&h->listener, on_listener_closed);
    return rc;
  }
  struct sockaddr_storage bound;
  int blen = sizeof bound;
  uv_tcp_getsockname(&h->listener, (struct sockaddr *)&bound, &blen);
  h->port = ntohs(bound.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&bound)->sin6_port
                                              : ((struct sockaddr_in *)&bound)->sin_port);
  if (bound.ss_family == AF_INET6) {
    const struct in6_addr *a6 = &((struct sockaddr_in6 *)&bound)->sin6_addr;
    h->loopback = IN6_IS_ADDR_LOOPBACK(a6);
  } else {
    h->loopback = (ntohl(((struct sockaddr_in *)&bound)->sin_addr.s_addr) >> 24) == 127;
  }
  *out = h;
  return 0;
}

int gossip_http_port(const struct gossip_http *h) { return h->port; }

void gossip_http_stop(struct gossip_http *h) {
  if (!h || h->stopping) return;
  h->stopping = true;
  uv_close((uv_handle_t *)&h->listener, on_listener_closed);
  for (struct http_client *c = h->head; c; c = c->next) client_close(c);
}
