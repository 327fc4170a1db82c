/*
 * Monitoring on the node's side: the figures the training thread publishes,
 * the counters every part reports events to, the member view other threads
 * read, the STATS and MEMBERS requests that `rumor top` sends (its
 * PARAMS_REQ is a donation: donation.c), and the Prometheus text served on
 * the metrics endpoint.
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

int gossip_monitoring_init(struct gossip *g, struct rumor_err *e) {
  struct gossip_monitoring *mon = &g->mon;
  mon->sketch_k = g->cfg.sketch_k ? g->cfg.sketch_k : 1024;
  if (mon->sketch_k < 1 || mon->sketch_k > 65536 || (mon->sketch_k & (mon->sketch_k - 1)))
    return rumor_err_set(e, RUMOR_EFORMAT, "sketch size %d is not a power of two in [1, 65536]", mon->sketch_k);
  mon->psketch = xcalloc((size_t)mon->sketch_k, sizeof(double));
  mon->sketch_seed = gossip_derive_sketch_seed(g->cluster_key);
  return 0;
}

void gossip_monitoring_free(struct gossip *g) {
  free(g->mon.psketch);
  free(g->mon.pub);
  g->mon.psketch = NULL;
  g->mon.pub = NULL;
}

void gossip_count_applied(struct gossip *g, uint64_t bytes_received) {
  struct gossip_stats *c = &g->mon.counters;
  pthread_mutex_lock(&g->lock);
  c->exchanges_ok++;
  g->mon.last_exchange_ms = clock_now_ns() / 1000000;
  c->exchange_bytes_sent = net_dtype_bytes(g->cfg.wire, g->cfg.nparams);
  c->exchange_bytes_received = bytes_received;
  pthread_mutex_unlock(&g->lock);
}

void gossip_count(struct gossip *g, enum gossip_event ev, const char *why) {
  struct gossip_stats *c = &g->mon.counters;
  pthread_mutex_lock(&g->lock);
  switch (ev) {
  case GOSSIP_EV_XCH_FAILED:
    c->exchanges_failed++;
    snprintf(c->last_failure, sizeof c->last_failure, "%.120s", why ? why : "");
    break;
  case GOSSIP_EV_XCH_REJECTED:
    c->exchanges_rejected++;
    snprintf(c->last_failure, sizeof c->last_failure, "rejected: %.100s", why ? why : "");
    break;
  case GOSSIP_EV_XCH_REQUESTED: c->exchange_requests++; break;
  case GOSSIP_EV_XCH_REFUSED: c->exchange_refusals++; break;
  case GOSSIP_EV_XCH_IDLE: c->exchange_idle++; break;
  case GOSSIP_EV_DONATED: c->donations++; break;
  case GOSSIP_EV_XCH_RATE_LIMITED: c->exchange_rate_limited++; break;
  case GOSSIP_EV_CONN_RATE_LIMITED: c->conn_rate_limited++; break;
  }
  pthread_mutex_unlock(&g->lock);
}

/* ---- training thread ---- */

bool gossip_stats_wanted(gossip_t *g) { return atomic_load(&g->mon.wanted); }

static void answer_waiters(net_t *n, void *arg, int status);

void gossip_stats_publish(gossip_t *g, const struct gossip_peer_stats *s) {
  struct gossip_monitoring *mon = &g->mon;
  pthread_mutex_lock(&g->lock);
  mon->pstats = *s;
  mon->pstats.sketch = NULL;
  if (s->sketch) {
    memcpy(mon->psketch, s->sketch, (size_t)mon->sketch_k * sizeof(double));
    mon->have_sketch = true;
  }
  mon->have_stats = true;
  mon->stats_ms = clock_now_ns() / 1000000;
  if (s->sketch) mon->sketch_ms = mon->stats_ms;
  pthread_mutex_unlock(&g->lock);
  if (s->sketch && atomic_exchange(&mon->wanted, false)) {
    if (net_call(g->net, answer_waiters, g) != 0) log_debug("cannot hand fresh figures to the network thread");
  }
}

bool gossip_monitoring_sketch(struct gossip *g, double *norm, double *sketch) {
  pthread_mutex_lock(&g->lock);
  bool have = g->mon.have_sketch;
  *norm = g->mon.pstats.param_norm;
  if (have) memcpy(sketch, g->mon.psketch, (size_t)g->mon.sketch_k * sizeof(double));
  pthread_mutex_unlock(&g->lock);
  return have;
}

uint64_t gossip_sketch_seed(const gossip_t *g) { return g->mon.sketch_seed; }
int gossip_sketch_k(const gossip_t *g) { return g->mon.sketch_k; }

/* ---- figures for other threads ---- */

static const char *role_name(enum swim_role r) { return r == SWIM_ROLE_BOOTSTRAP ? "bootstrap" : "peer"; }

void gossip_publish(struct gossip *g) {
  struct gossip_monitoring *mon = &g->mon;
  gossip_update_role(g);
  size_t need = g->swim.nmembers + 1;
  pthread_mutex_lock(&g->lock);
  if (need > mon->pub_cap) {
    mon->pub_cap = need * 2;
    mon->pub = xrealloc(mon->pub, mon->pub_cap * sizeof *mon->pub);
  }
  mon->npub = 0;
  for (size_t i = 0; i < need; i++) {
    const struct swim_update *u = i == 0 ? &g->swim.self : &g->swim.members[i - 1].info;
    struct gossip_member_view *v = &mon->pub[mon->npub++];
    net_pubkey_format(v->id, u->id);
    snprintf(v->addr, sizeof v->addr, "%s", u->addr);
    v->role = role_name(u->role);
    v->state = swim_state_name(u->state);
    v->incarnation = u->incarnation;
    v->ready = u->ready;
    v->self = i == 0;
    /* Looked up only while we linger (the guard's table is a list). */
    bool linger = i > 0 && atomic_load(&g->finished);
    v->finished = linger && gossip_guard_finished(g, u->id);
    v->struck = linger && gossip_strikes(g, u->id) > 0;
  }
  struct gossip_stats *s = &mon->counters;
  s->members_alive = s->members_suspect = s->members_failed = s->members_left = 0;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    switch (g->swim.members[i].info.state) {
    case SWIM_ALIVE: s->members_alive++; break;
    case SWIM_SUSPECT: s->members_suspect++; break;
    case SWIM_DEAD: s->members_failed++; break;
    case SWIM_LEFT: s->members_left++; break;
    }
  }
  pthread_mutex_unlock(&g->lock); /* the byte counts: every tick (gossip_stats_tick) */
}

void gossip_stats_get(gossip_t *g, struct gossip_stats *s) {
  pthread_mutex_lock(&g->lock);
  *s = g->mon.counters;
  uint64_t last = g->mon.last_exchange_ms;
  pthread_mutex_unlock(&g->lock);
  s->last_exchange_age_s = last ? (double)(clock_now_ns() / 1000000 - last) / 1e3 : -1.0;
}

size_t gossip_members(gossip_t *g, struct gossip_member_view *out, size_t max) {
  pthread_mutex_lock(&g->lock);
  size_t n = g->mon.npub;
  for (size_t i = 0; i < n && i < max; i++) out[i] = g->mon.pub[i];
  pthread_mutex_unlock(&g->lock);
  return n;
}

size_t gossip_live_partners(gossip_t *g) {
  pthread_mutex_lock(&g->lock);
  size_t n = 0;
  for (size_t i = 1; i < g->mon.npub; i++) /* pub[0] is ourselves */
    if (strcmp(g->mon.pub[i].role, "peer") == 0 && g->mon.pub[i].ready && !g->mon.pub[i].struck &&
        strcmp(g->mon.pub[i].state, "alive") == 0)
      n++;
  pthread_mutex_unlock(&g->lock);
  return n;
}

size_t gossip_training_partners(gossip_t *g) {
  pthread_mutex_lock(&g->lock);
  size_t n = 0;
  for (size_t i = 1; i < g->mon.npub; i++) {
    const struct gossip_member_view *v = &g->mon.pub[i];
    /* A suspect partner may be a slow one still training: it counts until
     * it is declared failed. */
    bool up = strcmp(v->state, "alive") == 0 || strcmp(v->state, "suspect") == 0;
    if (strcmp(v->role, "peer") == 0 && v->ready && up && !v->finished && !v->struck) n++;
  }
  pthread_mutex_unlock(&g->lock);
  return n;
}

size_t gossip_ready_peers(gossip_t *g) {
  pthread_mutex_lock(&g->lock);
  size_t peers = g->mon.npub > 0 && g->mon.pub[0].ready ? 1 : 0;
  for (size_t i = 1; i < g->mon.npub; i++)
    if (strcmp(g->mon.pub[i].role, "peer") == 0 && g->mon.pub[i].ready) peers++;
  pthread_mutex_unlock(&g->lock);
  return peers;
}

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
  net_msgbuf_put_bool(&b, "done", atomic_load(&g->finished)); /* optional for monitors: newer than "ready" */
  net_msgbuf_put_uint(&b, "x_ok", gs.exchanges_ok);
  net_msgbuf_put_uint(&b, "x_failed", gs.exchanges_failed);
  net_msgbuf_put_uint(&b, "x_rejected", gs.exchanges_rejected);
  net_msgbuf_put_str(&b, "last_failure", gs.last_failure, strlen(gs.last_failure));
  net_msgbuf_put_double(&b, "last_x_age", gs.last_exchange_age_s);
  net_msgbuf_put_uint(&b, "bytes_in", gs.bytes_in);
  net_msgbuf_put_uint(&b, "bytes_out", gs.bytes_out);
  net_msgbuf_put_uint(&b, "members", gs.members_alive + gs.members_suspect + 1);
  net_msgbuf_put_uint(&b, "donations", gs.donations);
  net_msgbuf_put_uint(&b, "relayed_links", gs.relayed_links); /* relays: optional for monitors */
  net_msgbuf_put_uint(&b, "relayed_bytes", gs.relayed_bytes);
  net_msgbuf_put_uint(&b, "relay_bytes", gs.relay_bytes);
  net_msgbuf_put_str(&b, "via", gs.via, strlen(gs.via));
  net_msgbuf_put_uint(&b, "x_bytes_out", gs.exchange_bytes_sent);
  net_msgbuf_put_uint(&b, "x_bytes_in", gs.exchange_bytes_received);
  if (g->cfg.role == GOSSIP_ROLE_PEER) {
    bool ar = g->cfg.sync == GOSSIP_SYNC_ALLREDUCE;
    net_msgbuf_put_str(&b, "sync", g->scheme, strlen(g->scheme));
    if (ar) {
      net_msgbuf_put_uint(&b, "round", g->ring.pos); /* the loop's own field: we are on the loop thread */
      pthread_mutex_lock(&g->lock);
      net_msgbuf_put_uint(&b, "ring_n", g->ring.info.members);
      net_msgbuf_put_uint(&b, "ar_failed", g->ring.info.rounds_failed);
      pthread_mutex_unlock(&g->lock);
    }
  }
  pthread_mutex_lock(&g->lock);
  uint64_t now = clock_now_ns() / 1000000;
  if (g->mon.have_stats) {
    net_msgbuf_put_int(&b, "step", g->mon.pstats.step);
    net_msgbuf_put_int(&b, "epoch", g->mon.pstats.epoch);
    net_msgbuf_put_int(&b, "samples", g->mon.pstats.samples);
    net_msgbuf_put_double(&b, "loss", g->mon.pstats.loss);
    net_msgbuf_put_double(&b, "sps", g->mon.pstats.samples_per_s);
    net_msgbuf_put_double(&b, "norm", g->mon.pstats.param_norm);
    net_msgbuf_put_double(&b, "age", (double)(now - g->mon.stats_ms) / 1e3);
    if (g->mon.pstats.peak_rss_bytes > 0) net_msgbuf_put_int(&b, "rss", g->mon.pstats.peak_rss_bytes); /* optional */
    const struct gossip_peer_stats *ps = &g->mon.pstats;
    if (ps->moe_experts > 0) { /* optional: a mixture of experts' figures */
      net_msgbuf_put_uint(&b, "moe_n", (uint64_t)ps->moe_experts);
      net_msgbuf_put_double(&b, "moe_aux", ps->moe_aux_loss);
      net_msgbuf_put_double(&b, "moe_z", ps->moe_z_loss);
      net_msgbuf_put_double(&b, "moe_drop", ps->moe_dropped);
      net_msgbuf_put_bin(&b, "moe_load", ps->moe_load, (size_t)ps->moe_experts * sizeof(double));
    }
    if (g->mon.pstats.outer_round >= 0) { /* optional: an outer optimizer's round */
      net_msgbuf_put_int(&b, "o_round", g->mon.pstats.outer_round);
      net_msgbuf_put_double(&b, "o_norm", g->mon.pstats.outer_norm);
      net_msgbuf_put_double(&b, "o_bytes", g->mon.pstats.outer_bytes);
      net_msgbuf_put_double(&b, "o_wait", g->mon.pstats.outer_wait_s);
    }
  }
  if (g->mon.have_sketch) {
    net_msgbuf_put_uint(&b, "sk_k", (uint64_t)g->mon.sketch_k);
    net_msgbuf_put_uint(&b, "sk_seed", g->mon.sketch_seed);
    /* Little-endian doubles; every supported platform is little-endian. */
    net_msgbuf_put_bin(&b, "sketch", g->mon.psketch, (size_t)g->mon.sketch_k * sizeof(double));
  }
  pthread_mutex_unlock(&g->lock);
  if (net_conn_send_msg(c, &b)) log_debug("cannot answer STATS from %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

static void answer_waiters(net_t *n, void *arg, int status) {
  struct gossip *g = arg;
  if (status) return;
  for (size_t i = 0; i < g->mon.nwaiters; i++)
    if (g->mon.waiters[i].conn) send_stats(g, g->mon.waiters[i].conn, g->mon.waiters[i].q);
  g->mon.nwaiters = 0;
}

static void handle_stats_req(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  uint64_t q = 0;
  if (net_msg_get_uint(m, "q", &q)) q = 0;
  pthread_mutex_lock(&g->lock);
  /* The sketch's own age counts: training publishes its cheap figures every
   * second without one, which must not make an old sketch look fresh. */
  bool fresh = g->mon.have_sketch && clock_now_ns() / 1000000 - g->mon.sketch_ms < GOSSIP_STATS_FRESH_MS;
  pthread_mutex_unlock(&g->lock);
  /* Bootstrap nodes and peers not yet training have nothing to compute. */
  if (fresh || g->cfg.role != GOSSIP_ROLE_PEER || !atomic_load(&g->ready) ||
      g->mon.nwaiters == GOSSIP_STATS_WAITERS) {
    send_stats(g, c, q);
    return;
  }
  g->mon.waiters[g->mon.nwaiters++] = (struct stats_waiter){c, q, gossip_now_ms(g) + GOSSIP_STATS_WAIT_MS};
  atomic_store(&g->mon.wanted, true);
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

void gossip_stats_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  switch (m->type) {
  case GMSG_STATS_REQ: handle_stats_req(g, c, m); return;
  case GMSG_MEMBERS_REQ: handle_members_req(g, c, m); return;
  default: return;
  }
}

void gossip_stats_tick(struct gossip *g, uint64_t now) {
  /* The transport's byte counts, fresh for every tick: a round's bytes and
   * the result line's are read from them. */
  if (g->net) {
    struct net_stats ns;
    net_stats_get(g->net, &ns);
    pthread_mutex_lock(&g->lock);
    g->mon.counters.bytes_in = ns.total.bytes_in;
    g->mon.counters.bytes_out = ns.total.bytes_out;
    g->mon.counters.relayed_links = ns.relayed_open;
    g->mon.counters.relayed_bytes = ns.relayed.bytes_in + ns.relayed.bytes_out;
    g->mon.counters.relay_bytes = ns.relay_bytes;
    g->mon.counters.relay_circuits = ns.relay_circuits;
    snprintf(g->mon.counters.via, sizeof g->mon.counters.via, "%s", g->relay.registered ? g->relay.via : "");
    g->mon.counters.dead_verdicts = ns.dead_verdicts;
    pthread_mutex_unlock(&g->lock);
  }
  /* Requests whose figures did not come in time get what we have. */
  size_t w = 0;
  for (size_t i = 0; i < g->mon.nwaiters; i++) {
    if (now >= g->mon.waiters[i].deadline_ms) {
      if (g->mon.waiters[i].conn) send_stats(g, g->mon.waiters[i].conn, g->mon.waiters[i].q);
    } else {
      g->mon.waiters[w++] = g->mon.waiters[i];
    }
  }
  g->mon.nwaiters = w;
}

void gossip_stats_on_close(struct gossip *g, net_conn_t *c) {
  for (size_t i = 0; i < g->mon.nwaiters; i++)
    if (g->mon.waiters[i].conn == c) g->mon.waiters[i].conn = NULL;
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

/* A metric with one unlabelled integer sample. */
static void metric_u64(struct text *t, const char *name, const char *type, const char *help, uint64_t v) {
  metric(t, name, type, help);
  tprintf(t, "%s %llu\n", name, (unsigned long long)v);
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
  tprintf(t, "rumor_info{role=\"%s\",model=\"%s\",id=\"%s\",version=\"%s\"} 1\n", role_text(g), model, id, RUMOR_VERSION);
  metric(t, "rumor_ready", "gauge", "1 when the node holds a state and trains (peers), or has joined (bootstrap).");
  tprintf(t, "rumor_ready %d\n", g->cfg.role == GOSSIP_ROLE_PEER ? (int)atomic_load(&g->ready) : (int)gossip_joined(g));
  metric(t, "rumor_finished", "gauge",
         "1 when the peer took its last step and only averages with partners still training (--finish-wait-ms).");
  tprintf(t, "rumor_finished %d\n", (int)atomic_load(&g->finished));
  metric(t, "rumor_members", "gauge", "Cluster members known to this node, by state (this node not included).");
  tprintf(t, "rumor_members{state=\"alive\"} %llu\nrumor_members{state=\"suspect\"} %llu\n",
          (unsigned long long)gs.members_alive, (unsigned long long)gs.members_suspect);
  tprintf(t, "rumor_members{state=\"failed\"} %llu\nrumor_members{state=\"left\"} %llu\n",
          (unsigned long long)gs.members_failed, (unsigned long long)gs.members_left);
  metric(t, "rumor_exchanges_total", "counter", "Parameter exchanges, by outcome.");
  tprintf(t, "rumor_exchanges_total{result=\"applied\"} %llu\n", (unsigned long long)gs.exchanges_ok);
  tprintf(t, "rumor_exchanges_total{result=\"failed\"} %llu\n", (unsigned long long)gs.exchanges_failed);
  tprintf(t, "rumor_exchanges_total{result=\"rejected\"} %llu\n", (unsigned long long)gs.exchanges_rejected);
  metric(t, "rumor_exchange_wire_bytes", "gauge",
         "Encoded parameter bytes of the last applied exchange, by direction (frame overhead excluded).");
  tprintf(t, "rumor_exchange_wire_bytes{direction=\"sent\"} %llu\n", (unsigned long long)gs.exchange_bytes_sent);
  tprintf(t, "rumor_exchange_wire_bytes{direction=\"received\"} %llu\n",
          (unsigned long long)gs.exchange_bytes_received);
  metric(t, "rumor_exchange_requests_total", "counter", "Exchange requests this node sent.");
  tprintf(t, "rumor_exchange_requests_total %llu\n", (unsigned long long)gs.exchange_requests);
  metric(t, "rumor_exchange_refusals_total", "counter", "Exchange requests partners refused (busy, not ready).");
  tprintf(t, "rumor_exchange_refusals_total %llu\n", (unsigned long long)gs.exchange_refusals);
  metric(t, "rumor_rate_limited_total", "counter",
         "Partners' exchange requests and connections this node refused by its rate limits, by kind.");
  tprintf(t, "rumor_rate_limited_total{kind=\"exchange\"} %llu\n", (unsigned long long)gs.exchange_rate_limited);
  tprintf(t, "rumor_rate_limited_total{kind=\"connection\"} %llu\n", (unsigned long long)gs.conn_rate_limited);
  metric(t, "rumor_donations_total", "counter", "States donated to newcomers.");
  tprintf(t, "rumor_donations_total %llu\n", (unsigned long long)gs.donations);
  metric(t, "rumor_network_received_bytes_total", "counter", "Bytes received on cluster connections (wire bytes).");
  tprintf(t, "rumor_network_received_bytes_total %llu\n", (unsigned long long)gs.bytes_in);
  metric(t, "rumor_network_sent_bytes_total", "counter", "Bytes sent on cluster connections (wire bytes).");
  tprintf(t, "rumor_network_sent_bytes_total %llu\n", (unsigned long long)gs.bytes_out);
  metric_u64(t, "rumor_relayed_links", "gauge", "Open connections of this node that run over a relay.",
             gs.relayed_links);
  metric_u64(t, "rumor_relayed_bytes_total", "counter",
             "Bytes in and out on connections that ran over a relay (inside the wire bytes above).", gs.relayed_bytes);
  metric_u64(t, "rumor_relay_forwarded_bytes_total", "counter", "Circuit bytes this node forwarded as a relay.",
             gs.relay_bytes);
  metric_u64(t, "rumor_relay_circuits", "gauge", "Circuits open through this node as a relay.", gs.relay_circuits);
  metric_u64(t, "rumor_network_dead_verdicts_total", "counter",
             "Connections this node closed on the heartbeat's verdict: the peer pinged, then fell silent.",
             gs.dead_verdicts);
  if (gs.last_exchange_age_s >= 0) {
    metric(t, "rumor_last_exchange_age_seconds", "gauge", "Time since the last applied exchange.");
    tprintf(t, "rumor_last_exchange_age_seconds %.3f\n", gs.last_exchange_age_s);
  }
  if (g->cfg.sync == GOSSIP_SYNC_ALLREDUCE) {
    pthread_mutex_lock(&g->lock);
    struct gossip_ar_info ar = g->ring.info;
    pthread_mutex_unlock(&g->lock);
    metric(t, "rumor_allreduce_rounds_total", "counter", "All-reduce rounds completed.");
    tprintf(t, "rumor_allreduce_rounds_total %llu\n", (unsigned long long)ar.rounds_done);
    metric(t, "rumor_allreduce_rounds_failed_total", "counter", "All-reduce rounds that failed (and were tried again).");
    tprintf(t, "rumor_allreduce_rounds_failed_total %llu\n", (unsigned long long)ar.rounds_failed);
    metric(t, "rumor_allreduce_ring_members", "gauge", "Members in the last all-reduce round's ring.");
    tprintf(t, "rumor_allreduce_ring_members %zu\n", ar.members);
  }
  pthread_mutex_lock(&g->lock);
  if (g->mon.have_stats) {
    struct gossip_peer_stats s = g->mon.pstats;
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
    if (s.peak_rss_bytes > 0) {
      metric(t, "rumor_peak_rss_bytes", "gauge", "The process's peak resident memory so far.");
      tprintf(t, "rumor_peak_rss_bytes %lld\n", (long long)s.peak_rss_bytes);
    }
    if (s.moe_experts > 0) {
      metric(t, "rumor_moe_aux_loss", "gauge", "A mixture of experts' load-balancing loss at the last step.");
      tprintf(t, "rumor_moe_aux_loss %.6g\n", s.moe_aux_loss);
      metric(t, "rumor_moe_z_loss", "gauge", "A mixture of experts' router z-loss at the last step.");
      tprintf(t, "rumor_moe_z_loss %.6g\n", s.moe_z_loss);
      metric(t, "rumor_moe_dropped_fraction", "gauge", "Token-expert choices dropped for capacity at the last step.");
      tprintf(t, "rumor_moe_dropped_fraction %.6g\n", s.moe_dropped);
      metric(t, "rumor_moe_expert_load", "gauge", "Each expert's share of the token-expert choices at the last step.");
      for (int x = 0; x < s.moe_experts; x++) tprintf(t, "rumor_moe_expert_load{expert=\"%d\"} %.6g\n", x, s.moe_load[x]);
    }
    if (s.outer_round >= 0) {
      metric(t, "rumor_outer_rounds_total", "counter", "Outer rounds applied (DiLoCo, NoLoCo).");
      tprintf(t, "rumor_outer_rounds_total %lld\n", (long long)s.outer_round);
      metric(t, "rumor_outer_pseudo_gradient_norm", "gauge", "L2 norm of the last round's averaged pseudo-gradient.");
      tprintf(t, "rumor_outer_pseudo_gradient_norm %.6g\n", isfinite(s.outer_norm) ? s.outer_norm : 0.0);
      metric(t, "rumor_outer_round_bytes", "gauge", "Payload bytes sent and received in the last outer round.");
      tprintf(t, "rumor_outer_round_bytes %.0f\n", s.outer_bytes);
      metric(t, "rumor_outer_wait_seconds_total", "counter", "Seconds training waited for outer rounds' communication.");
      tprintf(t, "rumor_outer_wait_seconds_total %.3f\n", s.outer_wait_s);
    }
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
    bool ok = g->cfg.role == GOSSIP_ROLE_PEER ? atomic_load(&g->ready) : gossip_joined(g);
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
  int rc = gossip_http_start(&g->loop, "--metrics", g->cfg.metrics, metrics_handler, g, &g->mon.http, e);
  if (rc == 0) log_info("metrics on http://%s/metrics (port %d)", g->cfg.metrics, gossip_http_port(g->mon.http));
  return rc;
}

int gossip_metrics_port(const gossip_t *g) { return g->mon.http ? gossip_http_port(g->mon.http) : 0; }

void gossip_metrics_stop(struct gossip *g) {
  gossip_http_stop(g->mon.http);
  g->mon.http = NULL;
}
