/* `rumor peer --sync ps`: a worker's side of the parameter server (ps.h).
 *
 * Threads: the client's loop thread owns the net, the connections and the
 * fields marked "loop thread"; the training thread sets what it wants (a
 * gradient to push, a clock to pull) under `mu` and kicks the loop with
 * net_call; the loop does the sending, and the callbacks record what came
 * back under `mu` and signal `cond`. No net function is called with `mu`
 * held (a callback may run inside it and take `mu`). */
#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "peer/ps/ps_impl.h"

#define TICK_MS 50
#define DIAL_BACKOFF_MIN_MS 100
#define DIAL_BACKOFF_MAX_MS 2000
#define WAIT_SLICE_MS 50

struct link {
  struct ps_client *cl;
  int index;
  char addr[PS_ADDR_MAX];
  /* Loop thread. */
  net_conn_t *conn; /* open and ours, from the dial until on_close */
  bool dialing;
  uint64_t next_dial_ms, backoff_ms;
  uint64_t rx_bytes, rx_at_ms;
  int64_t pushed; /* the highest gradient number ever pushed to it, -1 */
  /* Under mu. */
  bool welcomed, admitted_once;
  int64_t lo, hi;
  int64_t acked; /* the server's clock for us: it holds our gradients below this */
  bool pushing;
  bool pull_sent, pulled; /* for cl->want, on this connection */
  int64_t pulled_at, pulled_version, pulled_gap;
  double down_since; /* when it lost (or never had) its connection; 0 while welcomed */
};

/* An outbound gradient slice (owned until its done callback). */
struct push {
  struct link *k;
  float *buf;
  int64_t index;
};

struct ps_client {
  struct ps_client_config cfg;
  struct trainer *t;
  int64_t P;
  int n;
  struct link links[PS_MAX_SERVERS];
  float *stage; /* (P) the training thread's copy of the gradient; training thread only */
  char spec[MODEL_SPEC_MAX], optim_text[PS_OPTIM_TEXT_MAX];
  /* Loop thread. */
  uv_loop_t loop;
  uv_thread_t thread;
  bool thread_started;
  net_t *net;
  uv_timer_t tick;
  uint64_t last_ping_ms;
  bool closing; /* ps_client_free began: connections end for good */
  /* Shared, under mu. */
  pthread_mutex_t mu;
  pthread_cond_t cond;
  bool started, stopped; /* the loop thread is up / has ended */
  int start_rc;
  struct rumor_err start_err;
  float *grad;   /* (P) gradient number clock-1, kept for a push again after a server restart */
  int64_t grad_rows;
  float *params; /* (P) where pulled slices land; the training thread reads it once every slice is in */
  int64_t clock; /* gradients we have pushed (handed to the loop) */
  int64_t want;  /* the clock whose parameters we wait for; -1: none */
  bool want_final;
  bool failed;
  char why[PS_WHY_MAX];
  struct ps_client_stats stats;
};

static uint64_t now_ms(void) { return clock_now_ns() / 1000000; }

/* Records the first fatal failure and wakes the training thread. Takes mu. */
static void fail(struct ps_client *cl, const char *fmt, ...) RUMOR_PRINTF(2, 3);
static void fail(struct ps_client *cl, const char *fmt, ...) {
  pthread_mutex_lock(&cl->mu);
  if (!cl->failed) {
    cl->failed = true;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(cl->why, sizeof cl->why, fmt, ap);
    va_end(ap);
  }
  pthread_cond_broadcast(&cl->cond);
  pthread_mutex_unlock(&cl->mu);
}

static int send_msg(net_conn_t *c, struct net_msgbuf *b) {
  int rc = net_conn_send_msg(c, b);
  net_msgbuf_free(b);
  if (rc) log_debug("cannot send a message to %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
  return rc;
}

/* ============================================================================
 * Loop thread: sending what the training thread wants
 * ========================================================================== */

static void pump(struct link *k);

static void on_push_done(net_conn_t *c, uint64_t id, int status, void *arg) {
  (void)id;
  struct push *p = arg;
  struct link *k = p->k;
  struct ps_client *cl = k->cl;
  pthread_mutex_lock(&cl->mu);
  k->pushing = false;
  if (status == 0) {
    if (k->acked < p->index + 1) k->acked = p->index + 1;
    cl->stats.pushes++;
  }
  pthread_mutex_unlock(&cl->mu);
  free(p->buf);
  free(p);
  if (status == 0) pump(k);
  else if (status == -ECONNREFUSED && k->conn == c) {
    log_warn("server %s refused our gradient: reconnecting", k->addr);
    net_conn_close(c);
  }
}

static void send_grad(struct link *k, struct push *p, int64_t rows) {
  uint8_t meta[PS_META_BYTES];
  ps_meta_write(meta, &(struct ps_meta){.kind = PS_KIND_GRAD, .a = p->index, .b = rows});
  struct net_bulk_send b = {.src = p->buf,
                            .count = (uint64_t)(k->hi - k->lo),
                            .wire = k->cl->cfg.wire,
                            .meta = meta,
                            .meta_len = sizeof meta,
                            .done = on_push_done,
                            .arg = p};
  uint64_t id;
  int rc = net_conn_send_bulk(k->conn, &b, &id);
  if (rc) {
    log_warn("cannot push to %s (%s): reconnecting", k->addr, rumor_strerror(rc));
    pthread_mutex_lock(&k->cl->mu);
    k->pushing = false;
    pthread_mutex_unlock(&k->cl->mu);
    free(p->buf);
    free(p);
    net_conn_close(k->conn);
    return;
  }
  if (p->index <= k->pushed) {
    pthread_mutex_lock(&k->cl->mu);
    k->cl->stats.repushes++;
    pthread_mutex_unlock(&k->cl->mu);
  } else {
    k->pushed = p->index;
  }
}

static void send_pull(struct link *k, int64_t want, bool final) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, PS_MSG_PULL, PS_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "clock", (uint64_t)want);
  net_msgbuf_put_bool(&b, "final", final);
  net_msgbuf_put_uint(&b, "wire", (uint64_t)k->cl->cfg.wire);
  if (send_msg(k->conn, &b)) {
    pthread_mutex_lock(&k->cl->mu);
    k->pull_sent = false; /* tried again at the next tick */
    pthread_mutex_unlock(&k->cl->mu);
  }
}

/* Pushes the gradient the server lacks and asks for the parameters we
 * want, each once per connection. */
static void pump(struct link *k) {
  struct ps_client *cl = k->cl;
  if (!k->conn) return;
  struct push *p = NULL;
  int64_t rows = 0, want = -1;
  bool final = false;
  pthread_mutex_lock(&cl->mu);
  if (k->welcomed && !k->pushing && k->acked < cl->clock) {
    if (k->acked < cl->clock - 1)
      log_warn("server %s lacks our gradients %lld to %lld; only the last one is still here to push again", k->addr,
               (long long)k->acked, (long long)cl->clock - 1);
    p = xmalloc(sizeof *p);
    p->k = k;
    p->index = cl->clock - 1;
    p->buf = xmalloc((size_t)(k->hi - k->lo) * sizeof(float));
    memcpy(p->buf, cl->grad + k->lo, (size_t)(k->hi - k->lo) * sizeof(float));
    rows = cl->grad_rows;
    k->pushing = true;
    k->acked = cl->clock - 1; /* (not below it: what is lost is lost) */
  }
  if (k->welcomed && cl->want >= 0 && !k->pulled && !k->pull_sent) {
    want = cl->want;
    final = cl->want_final;
    k->pull_sent = true;
  }
  pthread_mutex_unlock(&cl->mu);
  if (p) send_grad(k, p, rows);
  if (want >= 0 && k->conn) send_pull(k, want, final);
}

static void kick_on_loop(net_t *n, void *arg, int status) {
  (void)n;
  struct ps_client *cl = arg;
  if (status) return;
  for (int i = 0; i < cl->n; i++) pump(&cl->links[i]);
}

/* ============================================================================
 * Loop thread: connections
 * ========================================================================== */

static void on_dialed(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n;
  struct link *k = arg;
  struct ps_client *cl = k->cl;
  k->dialing = false;
  if (status) {
    if (status == RUMOR_EAUTH) {
      fail(cl, "server %s refused the handshake: %s (the same --cluster-key everywhere; an allow-list that lists us)",
           k->addr, detail ? detail : rumor_strerror(status));
      return;
    }
    log_debug("dialing server %s: %s; again in %llu ms", k->addr, detail ? detail : rumor_strerror(status),
              (unsigned long long)k->backoff_ms);
    k->next_dial_ms = now_ms() + k->backoff_ms;
    k->backoff_ms = k->backoff_ms * 2 > DIAL_BACKOFF_MAX_MS ? DIAL_BACKOFF_MAX_MS : k->backoff_ms * 2;
    return;
  }
  k->conn = c;
  k->rx_at_ms = now_ms();
  net_conn_set_data(c, k);
  struct net_msgbuf b;
  net_msgbuf_init(&b, PS_MSG_HELLO, PS_PROTO_VERSION);
  net_msgbuf_put_str(&b, "model", cl->spec, strlen(cl->spec));
  net_msgbuf_put_str(&b, "optim", cl->optim_text, strlen(cl->optim_text));
  net_msgbuf_put_uint(&b, "nparams", (uint64_t)cl->P);
  net_msgbuf_put_uint(&b, "range", (uint64_t)k->index);
  net_msgbuf_put_uint(&b, "ranges", (uint64_t)cl->n);
  const struct train_stage *st = cl->t->cfg.stage;
  if (st) { /* a group's stage: its servers hold this stage's slice */
    net_msgbuf_put_uint(&b, "stage", (uint64_t)st->stage);
    net_msgbuf_put_uint(&b, "stages", (uint64_t)st->stages);
  }
  pthread_mutex_lock(&cl->mu);
  net_msgbuf_put_uint(&b, "clock", (uint64_t)cl->clock);
  pthread_mutex_unlock(&cl->mu);
  net_msgbuf_put_uint(&b, "steps", (uint64_t)cl->t->total_steps);
  if (send_msg(c, &b)) net_conn_close(c);
}

static void dial(struct link *k) {
  k->dialing = true;
  int rc = net_dial(k->cl->net, k->addr, on_dialed, k);
  if (rc) {
    k->dialing = false;
    k->next_dial_ms = now_ms() + k->backoff_ms;
  }
}

static void on_welcome(struct link *k, const struct net_msg *m) {
  struct ps_client *cl = k->cl;
  int64_t lo, hi, version, clock, stale, workers, want_lo, want_hi;
  if (net_msg_get_int(m, "lo", &lo) || net_msg_get_int(m, "hi", &hi) || net_msg_get_int(m, "version", &version) ||
      net_msg_get_int(m, "clock", &clock) || net_msg_get_int(m, "staleness", &stale) ||
      net_msg_get_int(m, "workers", &workers) || clock < 0 || version < 0) {
    log_warn("malformed WELCOME from %s: reconnecting", k->addr);
    net_conn_close(k->conn);
    return;
  }
  ps_range_bounds(cl->P, k->index, cl->n, &want_lo, &want_hi);
  if (lo != want_lo || hi != want_hi) {
    fail(cl, "server %s holds [%lld, %lld), not range %d/%d [%lld, %lld) of our %lld parameters", k->addr,
         (long long)lo, (long long)hi, k->index, cl->n, (long long)want_lo, (long long)want_hi, (long long)cl->P);
    return;
  }
  pthread_mutex_lock(&cl->mu);
  bool again = k->admitted_once;
  k->admitted_once = true;
  k->welcomed = true;
  k->lo = lo;
  k->hi = hi;
  k->acked = clock;
  k->pushing = false;
  k->pull_sent = false;
  k->down_since = 0;
  if (again) cl->stats.reconnects++;
  pthread_cond_broadcast(&cl->cond);
  pthread_mutex_unlock(&cl->mu);
  k->backoff_ms = DIAL_BACKOFF_MIN_MS;
  log_info("server %s (range %d/%d, %s) %s: version %lld, our clock there %lld", k->addr, k->index, cl->n,
           stale == 0 ? "BSP" : stale < 0 ? "ASP" : "SSP", again ? "reconnected" : "admitted us", (long long)version,
           (long long)clock);
  pump(k);
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  (void)ud;
  struct link *k = net_conn_data(c);
  if (!k) return;
  if (m->type == PS_MSG_WELCOME) {
    on_welcome(k, m);
  } else if (m->type == PS_MSG_REJECT) {
    char why[PS_WHY_MAX];
    if (ps_msg_str(m, "why", why, sizeof why)) snprintf(why, sizeof why, "no reason given");
    fail(k->cl, "server %s refused us: %s", k->addr, why);
  } else if (m->type != PS_MSG_PING) {
    log_warn("unexpected message type %llu from server %s: reconnecting", (unsigned long long)m->type, k->addr);
    net_conn_close(c);
  }
}

static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct ps_client *cl = ud;
  struct link *k = net_conn_data(c);
  struct ps_meta m;
  if (!k || ps_meta_read(info->meta, info->meta_len, &m) || m.kind != PS_KIND_PARAMS) {
    log_warn("refusing a transfer from %s: not parameters", net_conn_peer_name(c));
    return RUMOR_EPROTO;
  }
  pthread_mutex_lock(&cl->mu);
  bool ok = k->welcomed && k->pull_sent && !k->pulled && cl->want >= 0 && m.a >= cl->want &&
            m.a <= INT64_MAX / 4 && info->count == (uint64_t)(k->hi - k->lo);
  pthread_mutex_unlock(&cl->mu);
  if (!ok) {
    log_warn("refusing parameters from %s: unasked for, or not our range's size", k->addr);
    return RUMOR_EPROTO;
  }
  struct ps_meta *keep = malloc(sizeof *keep);
  if (!keep) return -ENOMEM;
  *keep = m;
  *dst = cl->params + k->lo;
  *dst_arg = keep;
  return 0;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  (void)id, (void)dst;
  struct ps_client *cl = ud;
  struct link *k = net_conn_data(c);
  struct ps_meta *m = dst_arg;
  if (k) {
    pthread_mutex_lock(&cl->mu);
    if (status == 0) {
      k->pulled = true;
      k->pulled_at = m->a;
      k->pulled_version = m->b;
      k->pulled_gap = m->c;
      cl->stats.pulls++;
      pthread_cond_broadcast(&cl->cond);
    } else {
      k->pull_sent = false; /* asked again */
    }
    pthread_mutex_unlock(&cl->mu);
  }
  free(m);
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct ps_client *cl = ud;
  struct link *k = net_conn_data(c);
  if (!k || k->conn != c) return;
  k->conn = NULL;
  k->next_dial_ms = now_ms() + k->backoff_ms;
  pthread_mutex_lock(&cl->mu);
  bool was = k->welcomed;
  k->welcomed = false;
  k->pushing = false;
  k->pull_sent = false;
  if (k->down_since == 0) k->down_since = clock_now_s();
  pthread_mutex_unlock(&cl->mu);
  if (was && !cl->closing)
    log_warn("lost server %s (%s%s%s): redialing", k->addr, status ? rumor_strerror(status) : "closed",
             detail && *detail ? ": " : "", detail ? detail : "");
}

static void on_tick(uv_timer_t *h) {
  struct ps_client *cl = h->data;
  uint64_t now = now_ms();
  bool ping = now - cl->last_ping_ms >= PS_PING_MS;
  if (ping) cl->last_ping_ms = now;
  for (int i = 0; i < cl->n; i++) {
    struct link *k = &cl->links[i];
    if (!k->conn) {
      if (!k->dialing && now >= k->next_dial_ms) dial(k);
      continue;
    }
    struct net_conn_stats cs;
    net_conn_stats_get(k->conn, &cs);
    if (cs.bytes_in != k->rx_bytes) {
      k->rx_bytes = cs.bytes_in;
      k->rx_at_ms = now;
    } else if (now - k->rx_at_ms >= cl->cfg.server_timeout_ms) {
      log_warn("server %s silent for %llu ms: reconnecting", k->addr, (unsigned long long)(now - k->rx_at_ms));
      k->rx_at_ms = now;
      net_conn_close(k->conn);
      continue;
    }
    if (ping) {
      struct net_msgbuf b;
      net_msgbuf_init(&b, PS_MSG_PING, PS_PROTO_VERSION);
      (void)send_msg(k->conn, &b);
    }
    pump(k);
  }
  /* The transport's byte counts, for the result line (every tick). */
  struct net_stats ns;
  net_stats_get(cl->net, &ns);
  pthread_mutex_lock(&cl->mu);
  cl->stats.bytes_in = ns.total.bytes_in;
  cl->stats.bytes_out = ns.total.bytes_out;
  pthread_mutex_unlock(&cl->mu);
}

/* ============================================================================
 * The loop thread's life
 * ========================================================================== */

static void on_tick_closed(uv_handle_t *h) { (void)h; }

static void on_net_closed(void *arg) {
  struct ps_client *cl = arg;
  cl->net = NULL;
  uv_close((uv_handle_t *)&cl->tick, on_tick_closed);
}

static void close_on_loop(net_t *n, void *arg, int status) {
  (void)status;
  struct ps_client *cl = arg;
  cl->closing = true;
  uv_timer_stop(&cl->tick);
  net_close(n, on_net_closed, cl);
}

static int net_start(struct ps_client *cl, struct rumor_err *e) {
  struct net_config nc;
  net_config_defaults(&nc);
  nc.identity = cl->cfg.identity;
  nc.cluster_key = cl->cfg.cluster_key;
  nc.allow = cl->cfg.allow;
  nc.max_msg_bytes = PS_MAX_MSG_BYTES;
  nc.max_bulk_bytes = (uint64_t)cl->P * sizeof(float) + 4096;
  nc.idle_timeout_ms = 0; /* our own check, on bytes received (ours go out as PINGs) */
  if (cl->cfg.handshake_timeout_ms) nc.handshake_timeout_ms = cl->cfg.handshake_timeout_ms;
  nc.heartbeat_ms = cl->cfg.heartbeat_ms;
  nc.dead_after_ms = cl->cfg.dead_after_ms;
  const struct net_callbacks cbs = {.on_message = on_message,
                                    .on_bulk_begin = on_bulk_begin,
                                    .on_bulk_done = on_bulk_done,
                                    .on_close = on_close};
  return net_init(&cl->net, &cl->loop, &nc, &cbs, cl, e);
}

static void loop_main(void *arg) {
  struct ps_client *cl = arg;
  struct rumor_err e = {0};
  int rc = net_start(cl, &e);
  if (rc == 0) {
    uv_timer_init(&cl->loop, &cl->tick);
    cl->tick.data = cl;
    uv_timer_start(&cl->tick, on_tick, 0, TICK_MS);
  }
  pthread_mutex_lock(&cl->mu);
  cl->started = true;
  cl->start_rc = rc;
  cl->start_err = e;
  pthread_cond_broadcast(&cl->cond);
  pthread_mutex_unlock(&cl->mu);
  if (rc == 0) uv_run(&cl->loop, UV_RUN_DEFAULT);
  int lc = uv_loop_close(&cl->loop);
  RUMOR_ASSERT(lc == 0);
  pthread_mutex_lock(&cl->mu);
  cl->stopped = true;
  pthread_cond_broadcast(&cl->cond);
  pthread_mutex_unlock(&cl->mu);
}

/* ============================================================================
 * The training thread
 * ========================================================================== */

/* Splits "A,B,..." into the links. */
static int parse_servers(struct ps_client *cl, const char *list, struct rumor_err *e) {
  char addrs[PS_MAX_SERVERS][PS_ADDR_MAX];
  int rc = ps_servers_parse(list, addrs, &cl->n, e);
  for (int i = 0; rc == 0 && i < cl->n; i++) {
    struct link *k = &cl->links[i];
    memcpy(k->addr, addrs[i], PS_ADDR_MAX);
    k->cl = cl;
    k->index = i;
    k->pushed = -1;
    k->backoff_ms = DIAL_BACKOFF_MIN_MS;
  }
  return rc;
}

static void client_free_mem(struct ps_client *cl) {
  free(cl->grad);
  free(cl->params);
  free(cl->stage);
  pthread_mutex_destroy(&cl->mu);
  pthread_cond_destroy(&cl->cond);
  free(cl);
}

int ps_client_start(ps_client_t **out, struct trainer *t, const struct ps_client_config *cfg, struct rumor_err *e) {
  *out = NULL;
  RUMOR_ASSERT(cfg->server_timeout_ms >= PS_MIN_TIMEOUT_MS);
  struct ps_client *cl = xcalloc(1, sizeof *cl);
  cl->cfg = *cfg;
  cl->t = t;
  cl->P = t->model.nparams;
  cl->want = -1;
  cl->clock = t->st.step;
  pthread_mutex_init(&cl->mu, NULL);
  pthread_cond_init(&cl->cond, NULL);
  int rc = parse_servers(cl, cfg->servers ? cfg->servers : "", e);
  if (rc == 0 && cl->P < cl->n)
    rc = rumor_err_set(e, RUMOR_EFORMAT, "--servers: %d servers for %lld parameters", cl->n, (long long)cl->P);
  if (rc) {
    client_free_mem(cl);
    return rc;
  }
  cl->cfg.servers = NULL; /* not kept */
  model_spec_format(&t->model.spec, cl->spec, sizeof cl->spec);
  ps_optim_text(&t->cfg.optim, cl->optim_text, sizeof cl->optim_text);
  cl->grad = xcalloc((size_t)cl->P, sizeof(float));
  cl->params = xcalloc((size_t)cl->P, sizeof(float));
  cl->stage = xcalloc((size_t)cl->P, sizeof(float));
  double now = clock_now_s();
  for (int i = 0; i < cl->n; i++) cl->links[i].down_since = now;
  if ((rc = uv_loop_init(&cl->loop))) {
    client_free_mem(cl);
    return rumor_err_set(e, rc, "uv_loop_init: %s", uv_strerror(rc));
  }
  if ((rc = uv_thread_create(&cl->thread, loop_main, cl))) {
    (void)uv_loop_close(&cl->loop);
    client_free_mem(cl);
    return rumor_err_set(e, rc, "cannot start the parameter-server thread: %s", uv_strerror(rc));
  }
  cl->thread_started = true;
  pthread_mutex_lock(&cl->mu);
  while (!cl->started) pthread_cond_wait(&cl->cond, &cl->mu);
  rc = cl->start_rc;
  if (rc) *e = cl->start_err;
  pthread_mutex_unlock(&cl->mu);
  if (rc) {
    uv_thread_join(&cl->thread);
    client_free_mem(cl);
    return rc;
  }
  *out = cl;
  return 0;
}

static bool stop_requested(const struct ps_client *cl) { return cl->cfg.stop && atomic_load(cl->cfg.stop); }

/* One wait on cond (mu held), at most WAIT_SLICE_MS. Returns a negative code
 * with a message when waiting must end: a failure, a stop, a server away
 * for longer than give_up_s. */
static int wait_slice(struct ps_client *cl, const char *what, struct rumor_err *e) {
  if (cl->failed) return rumor_err_set(e, RUMOR_EPROTO, "%s", cl->why);
  if (stop_requested(cl))
    return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d while %s", (int)atomic_load(cl->cfg.stop), what);
  double now = clock_now_s();
  for (int i = 0; i < cl->n; i++) {
    const struct link *k = &cl->links[i];
    if (k->down_since > 0 && now - k->down_since > cl->cfg.give_up_s)
      return rumor_err_set(e, RUMOR_ETIMEDOUT, "server %s unreachable for %.0f s while %s", k->addr,
                           now - k->down_since, what);
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += WAIT_SLICE_MS * 1000000L;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  pthread_cond_timedwait(&cl->cond, &cl->mu, &ts);
  return 0;
}

static void kick(struct ps_client *cl) {
  if (net_call(cl->net, kick_on_loop, cl) != 0) log_debug("the parameter-server thread is closing");
}

/* Pulls the parameters for clock `want` from every server into cl->params;
 * *at gets the clock we are at from now on (>= want: a newcomer or a
 * rejoiner may be moved ahead). */
static int pull(struct ps_client *cl, int64_t want, bool final, int64_t *at, struct rumor_err *e) {
  double t0 = clock_now_s();
  pthread_mutex_lock(&cl->mu);
  cl->want = want;
  cl->want_final = final;
  for (int i = 0; i < cl->n; i++) cl->links[i].pulled = cl->links[i].pull_sent = false;
  pthread_mutex_unlock(&cl->mu);
  kick(cl);
  int rc = 0;
  pthread_mutex_lock(&cl->mu);
  for (;;) {
    int got = 0;
    for (int i = 0; i < cl->n; i++) got += cl->links[i].pulled;
    if (got == cl->n) break;
    if ((rc = wait_slice(cl, "waiting for the parameters", e))) break;
  }
  *at = want;
  for (int i = 0; rc == 0 && i < cl->n; i++) {
    const struct link *k = &cl->links[i];
    if (k->pulled_at > *at) *at = k->pulled_at;
    if (k->pulled_version > cl->stats.last_version) cl->stats.last_version = k->pulled_version;
    if (k->pulled_gap > cl->stats.max_gap) cl->stats.max_gap = k->pulled_gap;
  }
  if (rc == 0 && *at > cl->clock) {
    /* Moved ahead: the servers count us there; nothing older to push. */
    cl->clock = *at;
    for (int i = 0; i < cl->n; i++)
      if (cl->links[i].acked < *at) cl->links[i].acked = *at;
  }
  cl->want = -1;
  cl->stats.wait_s += clock_now_s() - t0;
  pthread_mutex_unlock(&cl->mu);
  return rc;
}

/* The pulled parameters into the trainer, at clock `at`. */
static void load(struct ps_client *cl, int64_t at) {
  struct trainer *t = cl->t;
  tensor_copy_from_host(&t->model.params, 0, cl->params, (size_t)cl->P * sizeof(float));
  trainer_take_step(t, at);
}

int ps_client_join(ps_client_t *cl, struct rumor_err *e) {
  int rc = 0;
  pthread_mutex_lock(&cl->mu);
  for (;;) {
    int in = 0;
    for (int i = 0; i < cl->n; i++) in += cl->links[i].welcomed;
    if (in == cl->n) break;
    if ((rc = wait_slice(cl, "connecting to the servers", e))) break;
  }
  int64_t want = cl->clock;
  pthread_mutex_unlock(&cl->mu);
  if (rc) return rc;
  int64_t at;
  if ((rc = pull(cl, want, false, &at, e))) return rc;
  load(cl, at);
  log_info("parameters from %d server%s: starting at clock %lld", cl->n, cl->n == 1 ? "" : "s", (long long)at);
  return 0;
}

int ps_client_reduce(void *arg, int64_t rows, struct rumor_err *e) {
  struct ps_client *cl = arg;
  struct trainer *t = cl->t;
  trainer_clip_gradients(t);
  tensor_copy_to_host(&t->model.grads, 0, cl->stage, (size_t)cl->P * sizeof(float));
  pthread_mutex_lock(&cl->mu);
  float *g = cl->grad;
  cl->grad = cl->stage; /* the loop copies slices out of cl->grad under mu only */
  cl->stage = g;
  cl->grad_rows = rows;
  int64_t want = ++cl->clock;
  pthread_mutex_unlock(&cl->mu);
  /* The last step's pull is not held by the bound: nothing follows it. */
  bool final = want >= t->stop_step;
  int64_t at;
  int rc = pull(cl, want, final, &at, e);
  if (rc) return rc;
  load(cl, at);
  return 1;
}

static void done_on_loop(net_t *n, void *arg, int status) {
  (void)n;
  struct ps_client *cl = arg;
  if (status) return;
  pthread_mutex_lock(&cl->mu);
  int64_t clock = cl->clock;
  pthread_mutex_unlock(&cl->mu);
  for (int i = 0; i < cl->n; i++) {
    struct link *k = &cl->links[i];
    if (!k->conn) continue;
    struct net_msgbuf b;
    net_msgbuf_init(&b, PS_MSG_DONE, PS_PROTO_VERSION);
    net_msgbuf_put_uint(&b, "clock", (uint64_t)clock);
    (void)send_msg(k->conn, &b);
  }
}

void ps_client_finish(ps_client_t *cl) {
  if (net_call(cl->net, done_on_loop, cl) != 0) log_debug("the parameter-server thread is closing");
}

void ps_client_stats_get(ps_client_t *cl, struct ps_client_stats *st) {
  pthread_mutex_lock(&cl->mu);
  *st = cl->stats;
  pthread_mutex_unlock(&cl->mu);
}

void ps_client_free(ps_client_t *cl) {
  if (!cl) return;
  /* net_close sends what is queued (a DONE) and closes gracefully, bounded
   * by net's close linger. */
  if (net_call(cl->net, close_on_loop, cl) != 0) log_warn("the parameter-server thread stopped on its own");
  uv_thread_join(&cl->thread);
  client_free_mem(cl);
}
