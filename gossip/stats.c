/*
 * Monitoring on the node's side: the figures the training thread publishes,
 * the STATS / MEMBERS / PARAMS requests that `rumor top` sends, and the
 * Prometheus text served on the metrics endpoint.
 *
 * The O(P) parts (parameter norm, count-sketch) are computed by the training
 * thread only when someone asked (stats_wanted), never by the loop thread,
 * which must not touch parameters.
 */
#include <errno.h>
#include <math.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

/* ---- training thread ---- */

bool gossip_stats_wanted(gossip_t *g) { return atomic_load(&g->stats_wanted); }

static void answer_waiters(net_t *n, void *arg, int status);

void gossip_stats_publish(gossip_t *g, const struct gossip_peer_stats *s) {
  pthread_mutex_lock(&g->lock);
  g->pstats = *s;
  g->pstats.sketch = NULL;
  if (s->sketch) {
    memcpy(g->psketch, s->sketch, (size_t)g->sketch_k * sizeof(double));
    g->have_sketch = true;
  }
  g->have_stats = true;
  g->stats_ms = clock_now_ns() / 1000000;
  pthread_mutex_unlock(&g->lock);
  if (s->sketch && atomic_exchange(&g->stats_wanted, false)) {
    if (net_call(g->net, answer_waiters, g) != 0) log_debug("cannot hand fresh figures to the network thread");
  }
}

uint64_t gossip_sketch_seed(const gossip_t *g) { return g->sketch_seed; }
int gossip_sketch_k(const gossip_t *g) { return g->sketch_k; }

/* ---- loop thread: requests ---- */

static const char *role_text(const struct gossip *g) { return g->cfg.role == GOSSIP_ROLE_BOOTSTRAP ? "bootstrap" : "peer"; }

static void send_stats(struct gossip *g, net_conn_t *c, uint64_t q) {
  struct gossip_stats gs;
  gossip_stats_get(g, &gs);
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_STATS, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "q", q);
  net_msgbuf_put_str(&b, "role", role_text(g), strlen(role_text(g)));
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  net_msgbuf_put_uint(&b, "n", g->cfg.nparams);
  net_msgbuf_put_bool(&b, "ready", atomic_load(&g->ready));
  net_msgbuf_put_uint(&b, "x_ok", gs.exchanges_ok);
  net_msgbuf_put_uint(&b, "x_failed", gs.exchanges_failed);
  net_msgbuf_put_uint(&b, "x_rejected", gs.exchanges_rejected);
  net_msgbuf_put_str(&b, "last_failure", gs.last_failure, strlen(gs.last_failure));
  net_msgbuf_put_double(&b, "last_x_age", gs.last_exchange_age_s);
  net_msgbuf_put_uint(&b, "bytes_in", gs.bytes_in);
  net_msgbuf_put_uint(&b, "bytes_out", gs.bytes_out);
  net_msgbuf_put_uint(&b, "members", gs.members_alive + gs.members_suspect + 1);
  net_msgbuf_put_uint(&b, "donations", gs.donations);
  pthread_mutex_lock(&g->lock);
  uint64_t now = clock_now_ns() / 1000000;
  if (g->have_stats) {
    net_msgbuf_put_int(&b, "step", g->pstats.step);
    net_msgbuf_put_int(&b, "epoch", g->pstats.epoch);
    net_msgbuf_put_int(&b, "samples", g->pstats.samples);
    net_msgbuf_put_double(&b, "loss", g->pstats.loss);
    net_msgbuf_put_double(&b, "sps", g->pstats.samples_per_s);
    net_msgbuf_put_double(&b, "norm", g->pstats.param_norm);
    net_msgbuf_put_double(&b, "age", (double)(now - g->stats_ms) / 1e3);
  }
  if (g->have_sketch) {
    net_msgbuf_put_uint(&b, "sk_k", (uint64_t)g->sketch_k);
    net_msgbuf_put_uint(&b, "sk_seed", g->sketch_seed);
    /* Little-endian doubles; every supported platform is little-endian. */
    net_msgbuf_put_bin(&b, "sketch", g->psketch, (size_t)g->sketch_k * sizeof(double));
  }
  pthread_mutex_unlock(&g->lock);
  if (net_conn_send_msg(c, &b)) log_debug("cannot answer STATS from %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

static void answer_waiters(net_t *n, void *arg, int status) {
  struct gossip *g = arg;
  if (status) return;
  for (size_t i = 0; i < g->nwaiters; i++)
    if (g->waiters[i].conn) send_stats(g, g->waiters[i].conn, g->waiters[i].q);
  g->nwaiters = 0;
}

static void handle_stats_req(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  uint64_t q = 0;
  if (net_msg_get_uint(m, "q", &q)) q = 0;
  pthread_mutex_lock(&g->lock);
  bool fresh = g->have_sketch && clock_now_ns() / 1000000 - g->stats_ms < GOSSIP_STATS_FRESH_MS;
  pthread_mutex_unlock(&g->lock);
  /* Bootstrap nodes and peers not yet training have nothing to compute. */
  if (fresh || g->cfg.role != GOSSIP_ROLE_PEER || !atomic_load(&g->ready) ||
      g->nwaiters == GOSSIP_STATS_WAITERS) {
    send_stats(g, c, q);
    return;
  }
  g->waiters[g->nwaiters++] = (struct stats_waiter){c, q, gossip_now_ms(g) + GOSSIP_STATS_WAIT_MS};
  atomic_store(&g->stats_wanted, true);
}

static void handle_members_req(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  uint64_t q = 0;
  if (net_msg_get_uint(m, "q", &q)) q = 0;
  size_t cap = g->swim.nmembers + 1;
  struct swim_update *tab = xmalloc(cap * sizeof *tab);
  size_t n = swim_snapshot(&g->swim, tab, cap);
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_MEMBERS, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "q", q);
  gossip_put_updates(&b, tab, n);
  if (net_conn_send_msg(c, &b)) log_debug("cannot answer MEMBERS from %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
  free(tab);
}

/* A monitor wants our parameters (exact drift): served through the
 * donation slot, which the training thread fills at its next boundary. */
static void handle_params_req(struct gossip *g, net_conn_t *c) {
  struct net_msgbuf b;
  int expected = SLOT_IDLE;
  bool can = g->cfg.role == GOSSIP_ROLE_PEER && atomic_load(&g->ready) && !g->stopping &&
             atomic_load(&g->donor_state) == SLOT_IDLE;
  if (can) {
    /* Set before the slot turns WANT: the training thread reads it then. */
    atomic_store(&g->donor_params_only, true);
    if (!atomic_compare_exchange_strong(&g->donor_state, &expected, SLOT_WANT)) {
      atomic_store(&g->donor_params_only, false);
      can = false;
    }
  }
  if (!can) {
    net_msgbuf_init(&b, GMSG_STATE_BUSY, GOSSIP_PROTO_VERSION);
    net_msgbuf_put_str(&b, "why", "busy", 4);
    net_msgbuf_put_bool(&b, "fatal", false);
    if (net_conn_send_msg(c, &b)) log_debug("cannot answer PARAMS from %s", net_conn_peer_name(c));
    net_msgbuf_free(&b);
    return;
  }
  g->donor_conn = c;
  memcpy(g->donor_to, net_conn_peer_key(c), NET_PUBKEY_BYTES);
}

void gossip_stats_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  switch (m->type) {
  case GMSG_STATS_REQ: handle_stats_req(g, c, m); return;
  case GMSG_MEMBERS_REQ: handle_members_req(g, c, m); return;
  case GMSG_PARAMS_REQ: handle_params_req(g, c); return;
  default: return;
  }
}

void gossip_stats_tick(struct gossip *g, uint64_t now) {
  /* Requests whose figures did not come in time get what we have. */
  size_t w = 0;
  for (size_t i = 0; i < g->nwaiters; i++) {
    if (now >= g->waiters[i].deadline_ms) {
      if (g->waiters[i].conn) send_stats(g, g->waiters[i].conn, g->waiters[i].q);
    } else {
      g->waiters[w++] = g->waiters[i];
    }
  }
  g->nwaiters = w;
}

void gossip_stats_on_close(struct gossip *g, net_conn_t *c) {
  for (size_t i = 0; i < g->nwaiters; i++)
    if (g->waiters[i].conn == c) g->waiters[i].conn = NULL;
}

/* ---- the metrics endpoint ---- */

struct text {
  char *p;
  size_t len, cap;
};

static void tprintf(struct text *t, const char *fmt, ...) RUMOR_PRINTF(2, 3);
static void tprintf(struct text *t, const char *fmt, ...) {
  for (;;) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(t->p ? t->p + t->len : NULL, t->p ? t->cap - t->len : 0, fmt, ap);
    va_end(ap);
    if (n >= 0 && t->p && (size_t)n < t->cap - t->len) {
      t->len += (size_t)n;
      return;
    }
    t->cap = t->cap ? 2 * t->cap + (size_t)n : 4096 + (size_t)n;
    t->p = xrealloc(t->p, t->cap);
  }
}

static void metric(struct text *t, const char *name, const char *type, const char *help) {
  tprintf(t, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

/* Label values are escaped as the text format requires. */
static void escape_label(char *out, size_t n, const char *s) {
  size_t o = 0;
  for (; *s && o + 2 < n; s++) {
    if (*s == '"' || *s == '\\') out[o++] = '\\', out[o++] = *s;
    else if (*s == '\n') out[o++] = '\\', out[o++] = 'n';
    else out[o++] = *s;
  }
  out[o] = '\0';
}

static void metrics_text(struct gossip *g, struct text *t) {
  struct gossip_stats gs;
  gossip_stats_get(g, &gs);
  char model[300], id[NET_PUBKEY_STR_LEN * 2 + 1];
  escape_label(model, sizeof model, g->model);
  escape_label(id, sizeof id, g->self_id_text);
  metric(t, "rumor_info", "gauge", "Node identity (always 1).");
  tprintf(t, "rumor_info{role=\"%s\",model=\"%s\",id=\"%s\",version=\"0.1.0\"} 1\n", role_text(g), model, id);
  metric(t, "rumor_ready", "gauge", "1 when the node holds a state and trains (peers), or has joined (bootstrap).");
  tprintf(t, "rumor_ready %d\n", g->cfg.role == GOSSIP_ROLE_PEER ? (int)atomic_load(&g->ready) : (int)g->joined);
  metric(t, "rumor_members", "gauge", "Cluster members known to this node, by state (this node not included).");
  tprintf(t, "rumor_members{state=\"alive\"} %llu\nrumor_members{state=\"suspect\"} %llu\n",
          (unsigned long long)gs.members_alive, (unsigned long long)gs.members_suspect);
  tprintf(t, "rumor_members{state=\"failed\"} %llu\nrumor_members{state=\"left\"} %llu\n",
          (unsigned long long)gs.members_failed, (unsigned long long)gs.members_left);
  metric(t, "rumor_exchanges_total", "counter", "Parameter exchanges, by outcome.");
  tprintf(t, "rumor_exchanges_total{result=\"applied\"} %llu\n", (unsigned long long)gs.exchanges_ok);
  tprintf(t, "rumor_exchanges_total{result=\"failed\"} %llu\n", (unsigned long long)gs.exchanges_failed);
  tprintf(t, "rumor_exchanges_total{result=\"rejected\"} %llu\n", (unsigned long long)gs.exchanges_rejected);
  metric(t, "rumor_exchange_requests_total", "counter", "Exchange requests this node sent.");
  tprintf(t, "rumor_exchange_requests_total %llu\n", (unsigned long long)gs.exchange_requests);
  metric(t, "rumor_exchange_refusals_total", "counter", "Exchange requests partners refused (busy, not ready).");
  tprintf(t, "rumor_exchange_refusals_total %llu\n", (unsigned long long)gs.exchange_refusals);
  metric(t, "rumor_donations_total", "counter", "States donated to newcomers.");
  tprintf(t, "rumor_donations_total %llu\n", (unsigned long long)gs.donations);
  metric(t, "rumor_network_received_bytes_total", "counter", "Bytes received on cluster connections (wire bytes).");
  tprintf(t, "rumor_network_received_bytes_total %llu\n", (unsigned long long)gs.bytes_in);
  metric(t, "rumor_network_sent_bytes_total", "counter", "Bytes sent on cluster connections (wire bytes).");
  tprintf(t, "rumor_network_sent_bytes_total %llu\n", (unsigned long long)gs.bytes_out);
  if (gs.last_exchange_age_s >= 0) {
    metric(t, "rumor_last_exchange_age_seconds", "gauge", "Time since the last applied exchange.");
    tprintf(t, "rumor_last_exchange_age_seconds %.3f\n", gs.last_exchange_age_s);
  }
  pthread_mutex_lock(&g->lock);
  if (g->have_stats) {
    struct gossip_peer_stats s = g->pstats;
    pthread_mutex_unlock(&g->lock);
    metric(t, "rumor_training_step", "gauge", "Optimizer steps applied.");
    tprintf(t, "rumor_training_step %lld\n", (long long)s.step);
    metric(t, "rumor_training_epoch", "gauge", "Current epoch (from 0).");
    tprintf(t, "rumor_training_epoch %lld\n", (long long)s.epoch);
    metric(t, "rumor_training_samples_total", "counter", "Samples this peer trained on.");
    tprintf(t, "rumor_training_samples_total %lld\n", (long long)s.samples);
    metric(t, "rumor_training_loss", "gauge", "Moving average of the training loss.");
    tprintf(t, "rumor_training_loss %.6g\n", isfinite(s.loss) ? s.loss : 0.0);
    metric(t, "rumor_training_samples_per_second", "gauge", "Training throughput.");
    tprintf(t, "rumor_training_samples_per_second %.3f\n", s.samples_per_s);
    metric(t, "rumor_parameter_norm", "gauge", "L2 norm of the parameters at the last figures.");
    tprintf(t, "rumor_parameter_norm %.6g\n", s.param_norm);
  } else {
    pthread_mutex_unlock(&g->lock);
  }
}

static int metrics_handler(void *ctx, const char *path, char **body, size_t *len, const char **type) {
  struct gossip *g = ctx;
  struct text t = {0};
  int status;
  if (strcmp(path, "/metrics") == 0) {
    metrics_text(g, &t);
    *type = "text/plain; version=0.0.4; charset=utf-8";
    status = 200;
  } else if (strcmp(path, "/healthz") == 0) {
    bool ok = g->cfg.role == GOSSIP_ROLE_PEER ? atomic_load(&g->ready) : g->joined;
    tprintf(&t, ok ? "ok\n" : "not ready\n");
    status = ok ? 200 : 503;
  } else {
    tprintf(&t, "not found; try /metrics or /healthz\n");
    status = 404;
  }
  *body = t.p;
  *len = t.len;
  return status;
}

int gossip_metrics_start(struct gossip *g, struct rumor_err *e) {
  if (!g->cfg.metrics || !*g->cfg.metrics) return 0;
  int rc = gossip_http_start(&g->loop, g->cfg.metrics, metrics_handler, g, &g->http, e);
  if (rc == 0) log_info("metrics on http://%s/metrics (port %d)", g->cfg.metrics, gossip_http_port(g->http));
  return rc;
}

int gossip_metrics_port(const gossip_t *g) { return g->http ? gossip_http_port(g->http) : 0; }

void gossip_metrics_stop(struct gossip *g) {
  gossip_http_stop(g->http);
  g->http = NULL;
}
