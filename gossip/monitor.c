/*
 * The monitor client: member table from a bootstrap address, figures from
 * every member, parameters on request. See monitor.h.
 *
 * One poll is a small state machine on the monitor's own loop:
 *   MEMBERS  try the bootstrap addresses in turn until one answers
 *            MEMBERS_REQ (each gets the poll timeout);
 *   NODES    for every listed member, reuse or dial a connection (the key
 *            that answers must be the member's), send STATS_REQ and, for
 *            peers with `exact`, PARAMS_REQ (retried while the peer's donor
 *            slot is busy); everything unanswered at the deadline is
 *            reported with its reason.
 * Requests carry a number ("q") that answers echo, so a late answer to an
 * earlier poll is never taken for a current one.
 */
#include "gossip/monitor.h"

#include <errno.h>
#include <math.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/drift.h"
#include "gossip/gossip_impl.h"

#define MON_TICK_MS 20
#define MON_PARAMS_RETRY_MS 50

/* A member we have talked to: connections are kept across polls. Allocated
 * one by one (dial callbacks and connections point at them); freed at close. */
struct mon_link {
  struct gossip_monitor *m;
  uint8_t id[NET_PUBKEY_BYTES];
  char addr[SWIM_ADDR_MAX];
  net_conn_t *conn;
  bool dialing;
};

/* What one poll still waits for from node i. */
struct mon_req {
  struct mon_link *link;
  uint64_t q;             /* STATS_REQ number */
  uint64_t sent_ms;
  bool sent, stats_done, want_params, params_done;
  uint64_t params_retry_ms; /* resend PARAMS_REQ then (0: not waiting to) */
  bool bulk_active;
  uint64_t bulk_id;
  float *bulk_buf;
  net_conn_t *bulk_conn;
};

enum mon_phase { MON_IDLE, MON_MEMBERS, MON_NODES, MON_DRAIN };

struct gossip_monitor {
  struct gossip_monitor_config cfg;
  struct net_identity identity;
  uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
  uint64_t sketch_seed;
  uv_loop_t loop;
  uv_timer_t tick;
  net_t *net;
  bool closing;

  char *boot[GOSSIP_MAX_BOOTSTRAP];
  size_t nboot;
  net_conn_t *boot_conn[GOSSIP_MAX_BOOTSTRAP]; /* kept open across polls */

  struct mon_link **links;
  size_t nlinks, links_cap;

  /* The poll in progress. */
  enum mon_phase phase;
  struct gossip_cluster_report *r;
  struct mon_req *reqs;
  uint64_t deadline_ms, next_q;
  size_t boot_i;
  bool boot_dialing, boot_sent;
  uint64_t boot_q;
  char boot_errors[1024];
  uint64_t exact_bytes;
  int poll_rc;
  bool poll_over, loop_live;
  uint64_t sleep_until_ms; /* gossip_monitor_sleep runs until then (0: done) */
  struct gossip_http *http; /* gossip_monitor_serve's server, or NULL */
};

static uint64_t now_ms(struct gossip_monitor *m) {
  uv_update_time(&m->loop);
  return uv_now(&m->loop);
}

static bool stop_requested(const struct gossip_monitor *m) { return m->cfg.stop && atomic_load(m->cfg.stop); }

static struct mon_link *link_find(struct gossip_monitor *m, const uint8_t *id) {
  for (size_t i = 0; i < m->nlinks; i++)
    if (memcmp(m->links[i]->id, id, NET_PUBKEY_BYTES) == 0) return m->links[i];
  return NULL;
}

static struct mon_link *link_get(struct gossip_monitor *m, const uint8_t *id, const char *addr) {
  struct mon_link *l = link_find(m, id);
  if (!l) {
    if (m->nlinks == m->links_cap) {
      m->links_cap = m->links_cap ? 2 * m->links_cap : 16;
      m->links = xrealloc(m->links, m->links_cap * sizeof *m->links);
    }
    l = xcalloc(1, sizeof *l);
    l->m = m;
    memcpy(l->id, id, NET_PUBKEY_BYTES);
    m->links[m->nlinks++] = l;
  }
  if (addr) snprintf(l->addr, sizeof l->addr, "%s", addr);
  return l;
}

/* ---- node requests ---- */

static void node_fail(struct gossip_monitor *m, size_t i, const char *fmt, ...) RUMOR_PRINTF(3, 4);
static void node_fail(struct gossip_monitor *m, size_t i, const char *fmt, ...) {
  struct gossip_node_report *nr = &m->r->nodes[i];
  struct mon_req *q = &m->reqs[i];
  va_list ap;
  va_start(ap, fmt);
  if (!q->stats_done) {
    nr->reachable = false;
    vsnprintf(nr->error, sizeof nr->error, fmt, ap);
    q->stats_done = true;
  } else if (q->want_params && !q->params_done) {
    vsnprintf(nr->params_error, sizeof nr->params_error, fmt, ap);
  }
  va_end(ap);
  q->params_done = true;
  q->params_retry_ms = 0;
}

static void send_simple(net_conn_t *c, uint64_t type, uint64_t q) {
  int rc = gossip_send_request(c, type, q);
  if (rc) log_debug("monitor: cannot send to %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
}

static void node_send_stats(struct gossip_monitor *m, size_t i) {
  struct mon_req *q = &m->reqs[i];
  q->q = ++m->next_q;
  q->sent = true;
  q->sent_ms = now_ms(m);
  send_simple(q->link->conn, GMSG_STATS_REQ, q->q);
}

static void on_node_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg);

/* Sends or dials for every node that waits on link l (or on any, l NULL). */
static void nodes_kick(struct gossip_monitor *m, struct mon_link *only) {
  if (m->phase != MON_NODES) return;
  for (size_t i = 0; i < m->r->n; i++) {
    struct mon_req *q = &m->reqs[i];
    if (q->stats_done || q->sent || (only && q->link != only)) continue;
    struct mon_link *l = q->link;
    if (l->conn) {
      node_send_stats(m, i);
    } else if (!l->dialing) {
      int rc = net_dial_peer(m->net, l->addr, l->id, on_node_dial, l);
      if (rc) node_fail(m, i, "cannot dial %s: %s", l->addr, rumor_strerror(rc));
      else l->dialing = true;
    }
  }
}


static void on_node_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n;
  struct mon_link *l = arg;
  struct gossip_monitor *m = l->m;
  l->dialing = false;
  if (status < 0) {
    if (m->phase == MON_NODES)
      for (size_t i = 0; i < m->r->n; i++)
        if (m->reqs[i].link == l && !m->reqs[i].stats_done)
          node_fail(m, i, "unreachable: %s", detail && *detail ? detail : rumor_strerror(status));
    return;
  }
  if (memcmp(net_conn_peer_key(c), l->id, NET_PUBKEY_BYTES) != 0) {
    char who[NET_PUBKEY_STR_LEN + 1];
    net_pubkey_format(who, net_conn_peer_key(c));
    net_conn_close(c);
    if (m->phase == MON_NODES)
      for (size_t i = 0; i < m->r->n; i++)
        if (m->reqs[i].link == l && !m->reqs[i].stats_done)
          node_fail(m, i, "another node (%.8s) answers at %s", who, l->addr);
    return;
  }
  if (l->conn) net_conn_close(l->conn);
  l->conn = c;
  nodes_kick(m, l);
}

/* ---- the member table ---- */

struct boot_dial {
  struct gossip_monitor *m;
  size_t i;
  uint64_t gen;
};

static void boot_try(struct gossip_monitor *m);

static void boot_failed(struct gossip_monitor *m, const char *why) {
  size_t len = strlen(m->boot_errors);
  snprintf(m->boot_errors + len, sizeof m->boot_errors - len, "%s%s (%s)", len ? "; " : "", m->boot[m->boot_i], why);
  m->boot_i++;
  m->boot_sent = m->boot_dialing = false;
  boot_try(m);
}

static void boot_send(struct gossip_monitor *m) {
  m->boot_q = ++m->next_q;
  m->boot_sent = true;
  m->deadline_ms = now_ms(m) + m->cfg.timeout_ms;
  send_simple(m->boot_conn[m->boot_i], GMSG_MEMBERS_REQ, m->boot_q);
}

static void on_boot_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n;
  struct boot_dial *d = arg;
  struct gossip_monitor *m = d->m;
  size_t i = d->i;
  bool current = m->phase == MON_MEMBERS && m->boot_dialing && m->boot_i == i && d->gen == m->boot_q;
  free(d);
  if (status == 0) {
    if (!m->boot_conn[i]) m->boot_conn[i] = c;
    else if (m->boot_conn[i] != c) net_conn_close(c);
    /* The bootstrap node is a member too: remember the connection for it. */
    struct mon_link *l = link_get(m, net_conn_peer_key(c), NULL);
    if (!l->conn) l->conn = m->boot_conn[i];
  }
  if (!current) return;
  m->boot_dialing = false;
  if (status < 0) boot_failed(m, detail && *detail ? detail : rumor_strerror(status));
  else boot_send(m);
}

static void poll_finish(struct gossip_monitor *m, int rc);

static void boot_try(struct gossip_monitor *m) {
  if (m->boot_i >= m->nboot) {
    poll_finish(m, RUMOR_ETIMEDOUT);
    return;
  }
  if (m->boot_conn[m->boot_i]) {
    boot_send(m);
    return;
  }
  struct boot_dial *d = xmalloc(sizeof *d);
  /* boot_q doubles as this attempt's number: a late dial of an earlier
   * attempt is told apart. */
  m->boot_q = ++m->next_q;
  *d = (struct boot_dial){m, m->boot_i, m->boot_q};
  m->deadline_ms = now_ms(m) + m->cfg.timeout_ms + m->cfg.handshake_timeout_ms;
  int rc = net_dial(m->net, m->boot[m->boot_i], on_boot_dial, d);
  if (rc) {
    free(d);
    boot_failed(m, rumor_strerror(rc));
    return;
  }
  m->boot_dialing = true;
}

static int node_order(const void *a, const void *b) {
  const struct gossip_node_report *x = a, *y = b;
  int r = strcmp(x->role, y->role); /* "bootstrap" < "peer" */
  if (r) return r;
  r = strcmp(x->addr, y->addr);
  return r ? r : strcmp(x->id, y->id);
}

static void on_members(struct gossip_monitor *m, const struct net_msg *msg) {
  size_t cap = SWIM_MAX_MEMBERS + 1;
  struct swim_update *tab = xmalloc(cap * sizeof *tab);
  int n = gossip_get_updates(msg, "u", tab, cap);
  if (n < 0) {
    free(tab);
    boot_failed(m, "malformed member table");
    return;
  }
  struct gossip_cluster_report *r = m->r;
  snprintf(r->via, sizeof r->via, "%s", m->boot[m->boot_i]);
  r->nodes = xcalloc((size_t)n + 1, sizeof *r->nodes);
  for (int i = 0; i < n; i++) {
    if (tab[i].state == SWIM_LEFT) continue;
    struct gossip_node_report *nr = &r->nodes[r->n++];
    net_pubkey_format(nr->id, tab[i].id);
    snprintf(nr->addr, sizeof nr->addr, "%s", tab[i].addr);
    snprintf(nr->role, sizeof nr->role, "%s", tab[i].role == SWIM_ROLE_BOOTSTRAP ? "bootstrap" : "peer");
    snprintf(nr->state, sizeof nr->state, "%s", swim_state_name(tab[i].state));
    nr->last_exchange_age_s = -1;
    nr->loss = nr->samples_per_s = nr->param_norm = NAN;
    nr->outer_round = -1;
    nr->outer_norm = nr->outer_bytes = nr->outer_wait_s = NAN;
  }
  qsort(r->nodes, r->n, sizeof *r->nodes, node_order);
  m->reqs = xcalloc(r->n + 1, sizeof *m->reqs);
  for (size_t i = 0; i < r->n; i++) {
    uint8_t id[NET_PUBKEY_BYTES];
    RUMOR_ASSERT(net_pubkey_parse(r->nodes[i].id, strlen(r->nodes[i].id), id) == 0);
    m->reqs[i].link = link_get(m, id, r->nodes[i].addr);
    if (strcmp(r->nodes[i].role, "peer") == 0) r->peers++;
  }
  free(tab);
  m->phase = MON_NODES;
  m->deadline_ms = now_ms(m) + m->cfg.timeout_ms;
  nodes_kick(m, NULL);
}

/* ---- figures ---- */

static void copy_str(const struct net_msg *msg, const char *key, char *out, size_t cap) {
  const char *s;
  size_t len;
  out[0] = '\0';
  if (net_msg_get_str(msg, key, &s, &len)) return;
  if (len >= cap) len = cap - 1;
  for (size_t i = 0; i < len; i++) out[i] = s[i] >= 0x20 && s[i] < 0x7f ? s[i] : '?'; /* for terminals */
  out[len] = '\0';
}

/* Reads an optional field: absent leaves *out alone, a wrong type fails. */
#define OPT(call) ((rc = (call)) == 0 || rc == RUMOR_ENOTFOUND)

/* Checks a sketch from the wire: k a power of two, the cluster's seed,
 * every value finite. Returns a malloc'd copy, or NULL. */
static double *take_sketch(struct gossip_monitor *m, const struct net_msg *msg, uint64_t k, int *k_out) {
  const uint8_t *p;
  size_t len;
  uint64_t seed;
  if (net_msg_get_bin(msg, "sketch", &p, &len) || net_msg_get_uint(msg, "sk_seed", &seed)) return NULL;
  if (k == 0 || k > 65536 || (k & (k - 1)) || len != k * sizeof(double) || seed != m->sketch_seed) return NULL;
  double *s = xmalloc(len);
  memcpy(s, p, len);
  for (uint64_t i = 0; i < k; i++)
    if (!isfinite(s[i])) {
      free(s);
      return NULL;
    }
  *k_out = (int)k;
  return s;
}

/* A mixture of experts' optional figures: n experts, fractions in [0, 1],
 * losses finite. Returns 0 or RUMOR_EPROTO. */
static int parse_moe(struct gossip_node_report *nr, const struct net_msg *msg) {
  uint64_t n = 0;
  nr->moe_experts = 0;
  if (net_msg_get_uint(msg, "moe_n", &n)) return 0;
  const uint8_t *p;
  size_t len;
  if (n == 0 || n > GOSSIP_MAX_EXPERTS || net_msg_get_double(msg, "moe_aux", &nr->moe_aux_loss) ||
      net_msg_get_double(msg, "moe_z", &nr->moe_z_loss) || net_msg_get_double(msg, "moe_drop", &nr->moe_dropped) ||
      net_msg_get_bin(msg, "moe_load", &p, &len) || len != n * sizeof(double))
    return RUMOR_EPROTO;
  memcpy(nr->moe_load, p, len);
  bool ok = isfinite(nr->moe_aux_loss) && isfinite(nr->moe_z_loss) && nr->moe_dropped >= 0 && nr->moe_dropped <= 1;
  for (uint64_t x = 0; x < n; x++) ok = ok && nr->moe_load[x] >= 0 && nr->moe_load[x] <= 1;
  if (!ok) return RUMOR_EPROTO;
  nr->moe_experts = (int)n;
  return 0;
}

static int parse_stats(struct gossip_monitor *m, struct gossip_node_report *nr, const struct net_msg *msg) {
  int rc;
  if (net_msg_get_uint(msg, "n", &nr->nparams) || net_msg_get_bool(msg, "ready", &nr->ready) ||
      net_msg_get_uint(msg, "x_ok", &nr->exchanges_ok) || net_msg_get_uint(msg, "x_failed", &nr->exchanges_failed) ||
      net_msg_get_uint(msg, "x_rejected", &nr->exchanges_rejected) ||
      net_msg_get_uint(msg, "bytes_in", &nr->bytes_in) || net_msg_get_uint(msg, "bytes_out", &nr->bytes_out) ||
      net_msg_get_uint(msg, "members", &nr->members) || net_msg_get_uint(msg, "donations", &nr->donations) ||
      net_msg_get_double(msg, "last_x_age", &nr->last_exchange_age_s))
    return RUMOR_EPROTO;
  nr->exchange_bytes_out = nr->exchange_bytes_in = 0;
  nr->relayed_links = nr->relayed_bytes = nr->relay_bytes = 0;
  nr->finished = false;
  if (!OPT(net_msg_get_bool(msg, "done", &nr->finished)) ||
      !OPT(net_msg_get_uint(msg, "x_bytes_out", &nr->exchange_bytes_out)) ||
      !OPT(net_msg_get_uint(msg, "x_bytes_in", &nr->exchange_bytes_in)) ||
      !OPT(net_msg_get_uint(msg, "relayed_links", &nr->relayed_links)) ||
      !OPT(net_msg_get_uint(msg, "relayed_bytes", &nr->relayed_bytes)) ||
      !OPT(net_msg_get_uint(msg, "relay_bytes", &nr->relay_bytes)))
    return RUMOR_EPROTO;
  copy_str(msg, "model", nr->model, sizeof nr->model);
  copy_str(msg, "via", nr->via, sizeof nr->via);
  copy_str(msg, "sync", nr->sync, sizeof nr->sync);
  nr->round = nr->ring_members = nr->rounds_failed = 0;
  if (!OPT(net_msg_get_uint(msg, "round", &nr->round)) || !OPT(net_msg_get_uint(msg, "ring_n", &nr->ring_members)) ||
      !OPT(net_msg_get_uint(msg, "ar_failed", &nr->rounds_failed)))
    return RUMOR_EPROTO;
  copy_str(msg, "last_failure", nr->last_failure, sizeof nr->last_failure);
  char role[sizeof nr->role];
  copy_str(msg, "role", role, sizeof role);
  if (strcmp(role, "peer") != 0 && strcmp(role, "bootstrap") != 0) return RUMOR_EPROTO;
  if (strcmp(role, nr->role) != 0) snprintf(nr->role, sizeof nr->role, "%s", role);
  if (net_msg_get(msg, "step")) {
    if (!(OPT(net_msg_get_int(msg, "step", &nr->step)) && OPT(net_msg_get_int(msg, "epoch", &nr->epoch)) &&
          OPT(net_msg_get_int(msg, "samples", &nr->samples)) && OPT(net_msg_get_double(msg, "loss", &nr->loss)) &&
          OPT(net_msg_get_double(msg, "sps", &nr->samples_per_s)) &&
          OPT(net_msg_get_double(msg, "norm", &nr->param_norm)) &&
          OPT(net_msg_get_double(msg, "age", &nr->stats_age_s)) &&
          OPT(net_msg_get_int(msg, "rss", &nr->peak_rss_bytes))))
      return RUMOR_EPROTO;
    if (nr->peak_rss_bytes < 0) return RUMOR_EPROTO;
    nr->have_train = true;
  }
  if ((rc = parse_moe(nr, msg))) return rc;
  nr->outer_round = -1;
  nr->outer_norm = nr->outer_bytes = nr->outer_wait_s = NAN;
  if (net_msg_get(msg, "o_round")) {
    if (!(OPT(net_msg_get_int(msg, "o_round", &nr->outer_round)) &&
          OPT(net_msg_get_double(msg, "o_norm", &nr->outer_norm)) &&
          OPT(net_msg_get_double(msg, "o_bytes", &nr->outer_bytes)) &&
          OPT(net_msg_get_double(msg, "o_wait", &nr->outer_wait_s))) ||
        nr->outer_round < 0)
      return RUMOR_EPROTO;
  }
  uint64_t k = 0;
  if (net_msg_get_uint(msg, "sk_k", &k) == 0) {
    free(nr->sketch);
    nr->sketch = take_sketch(m, msg, k, &nr->sketch_k);
    if (!nr->sketch) {
      nr->sketch_k = 0;
      return RUMOR_EPROTO;
    }
  }
  return 0;
}

static void on_stats(struct gossip_monitor *m, net_conn_t *c, const struct net_msg *msg) {
  uint64_t qn;
  if (m->phase != MON_NODES || net_msg_get_uint(msg, "q", &qn)) return;
  for (size_t i = 0; i < m->r->n; i++) {
    struct mon_req *q = &m->reqs[i];
    if (q->q != qn || q->stats_done || q->link->conn != c) continue; /* only the asked node answers */
    struct gossip_node_report *nr = &m->r->nodes[i];
    q->stats_done = true;
    nr->rtt_ms = (double)(now_ms(m) - q->sent_ms);
    if (parse_stats(m, nr, msg)) {
      nr->reachable = false;
      snprintf(nr->error, sizeof nr->error, "malformed STATS answer");
      return;
    }
    nr->reachable = true;
    m->r->reachable_peers += strcmp(nr->role, "peer") == 0;
    if (m->cfg.exact && strcmp(nr->role, "peer") == 0 && nr->ready && nr->nparams > 0) {
      q->want_params = true;
      send_simple(c, GMSG_PARAMS_REQ, qn);
    }
    return;
  }
}

static void on_params_busy(struct gossip_monitor *m, net_conn_t *c, const struct net_msg *msg) {
  if (m->phase != MON_NODES) return;
  bool fatal = false;
  if (net_msg_get_bool(msg, "fatal", &fatal)) fatal = false;
  for (size_t i = 0; i < m->r->n; i++) {
    struct mon_req *q = &m->reqs[i];
    if (q->link->conn != c || !q->want_params || q->params_done || q->bulk_active || q->params_retry_ms) continue;
    if (fatal) node_fail(m, i, "the peer refuses to send its parameters");
    else q->params_retry_ms = now_ms(m) + MON_PARAMS_RETRY_MS; /* its donor slot is busy: ask again */
    return;
  }
}

static void on_message(net_conn_t *c, const struct net_msg *msg, void *ud) {
  struct gossip_monitor *m = ud;
  if (msg->version != GOSSIP_PROTO_VERSION) return;
  switch (msg->type) {
  case GMSG_MEMBERS: {
    uint64_t q;
    if (m->phase == MON_MEMBERS && m->boot_sent && c == m->boot_conn[m->boot_i] &&
        net_msg_get_uint(msg, "q", &q) == 0 && q == m->boot_q)
      on_members(m, msg);
    return;
  }
  case GMSG_STATS: on_stats(m, c, msg); return;
  case GMSG_STATE_BUSY: on_params_busy(m, c, msg); return;
  default: return; /* membership traffic is not for us */
  }
}

/* ---- parameters (exact drift) ---- */

struct mon_bulk {
  size_t i;
  double norm;
  double *sketch;
  int sketch_k;
  int64_t step;
};

static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct gossip_monitor *m = ud;
  if (m->phase != MON_NODES) return RUMOR_ECANCELED;
  size_t i;
  for (i = 0; i < m->r->n; i++) {
    struct mon_req *q = &m->reqs[i];
    if (q->link->conn == c && q->want_params && !q->params_done && !q->bulk_active) break;
  }
  if (i == m->r->n) return -EPERM; /* nothing asked */
  struct gossip_node_report *nr = &m->r->nodes[i];
  struct net_msg meta = {0};
  struct rumor_err e = {0};
  uint64_t kind = 0, step = 0;
  if (net_msg_decode(info->meta, info->meta_len, NULL, &meta, &e) ||
      (net_msg_get_uint(&meta, "k", &kind) == 0 && kind != GBULK_PARAMS) || net_msg_get_uint(&meta, "step", &step)) {
    if (meta.zone_live) net_msg_free(&meta);
    node_fail(m, i, "unexpected transfer instead of parameters");
    return RUMOR_EPROTO;
  }
  if (info->count != nr->nparams) {
    net_msg_free(&meta);
    node_fail(m, i, "sent %llu parameters, announced %llu", (unsigned long long)info->count,
              (unsigned long long)nr->nparams);
    return RUMOR_EPROTO;
  }
  uint64_t bytes = info->count * sizeof(float);
  if (m->exact_bytes + bytes > m->cfg.exact_max_bytes) {
    net_msg_free(&meta);
    node_fail(m, i, "parameters of all peers exceed the --exact limit of %.0f MiB",
              (double)m->cfg.exact_max_bytes / (1 << 20));
    return -ENOMEM;
  }
  float *buf = malloc(bytes ? bytes : 1);
  if (!buf) {
    net_msg_free(&meta);
    node_fail(m, i, "cannot allocate %.1f MiB for its parameters", (double)bytes / (1 << 20));
    return -ENOMEM;
  }
  struct mon_bulk *b = xcalloc(1, sizeof *b);
  b->i = i;
  b->step = (int64_t)step;
  b->norm = NAN;
  const uint8_t *p;
  size_t len;
  if (net_msg_get_double(&meta, "norm", &b->norm) == 0 && net_msg_get_bin(&meta, "sketch", &p, &len) == 0)
    b->sketch = take_sketch(m, &meta, len / sizeof(double), &b->sketch_k);
  net_msg_free(&meta);
  m->exact_bytes += bytes;
  struct mon_req *q = &m->reqs[i];
  q->bulk_active = true;
  q->bulk_id = info->id;
  q->bulk_buf = buf;
  q->bulk_conn = c;
  *dst = buf;
  *dst_arg = b;
  return 0;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  (void)c;
  (void)id;
  struct gossip_monitor *m = ud;
  struct mon_bulk *b = dst_arg;
  struct mon_req *q = &m->reqs[b->i];
  struct gossip_node_report *nr = &m->r->nodes[b->i];
  q->bulk_active = false;
  q->bulk_conn = NULL;
  q->bulk_buf = NULL;
  if (status == 0 && !q->params_done) {
    nr->params = dst;
    nr->params_step = b->step;
    if (b->sketch) {
      /* These figures were made with the parameters, at one boundary. */
      free(nr->sketch);
      nr->sketch = b->sketch;
      nr->sketch_k = b->sketch_k;
      nr->param_norm = b->norm;
      b->sketch = NULL;
    }
    q->params_done = true;
  } else {
    free(dst);
    if (!q->params_done) node_fail(m, b->i, "parameter transfer failed: %s", rumor_strerror(status));
  }
  free(b->sketch);
  free(b);
}

/* ---- connections ---- */

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct gossip_monitor *m = ud;
  for (size_t j = 0; j < m->nboot; j++) {
    if (m->boot_conn[j] != c) continue;
    m->boot_conn[j] = NULL;
    if (m->phase == MON_MEMBERS && j == m->boot_i && m->boot_sent)
      boot_failed(m, status ? (detail && *detail ? detail : rumor_strerror(status)) : "closed the connection");
  }
  for (size_t k = 0; k < m->nlinks; k++) {
    struct mon_link *l = m->links[k];
    if (l->conn != c) continue;
    l->conn = NULL;
    if (m->phase != MON_NODES) continue;
    for (size_t i = 0; i < m->r->n; i++) {
      struct mon_req *q = &m->reqs[i];
      if (q->link != l) continue;
      if (q->sent && (!q->stats_done || (q->want_params && !q->params_done)))
        node_fail(m, i, "connection lost: %s", status ? (detail && *detail ? detail : rumor_strerror(status)) : "closed");
      else if (!q->sent)
        nodes_kick(m, l); /* redial */
    }
  }
}

/* ---- the poll ---- */

static void compute_drift(struct gossip_monitor *m) {
  struct gossip_cluster_report *r = m->r;
  const double **sk = xcalloc(r->n + 1, sizeof *sk);
  const float **pp = xcalloc(r->n + 1, sizeof *pp);
  double *norms = xcalloc(r->n + 1, sizeof *norms);
  int k = 0;
  size_t ns = 0, np = 0;
  uint64_t P = 0; /* the first peer's parameter count; others must match */
  for (size_t i = 0; i < r->n; i++) {
    struct gossip_node_report *nr = &r->nodes[i];
    if (strcmp(nr->role, "peer") != 0 || !nr->reachable) continue;
    if (m->cfg.exact) {
      if (!nr->params || (np > 0 && nr->nparams != P)) continue;
      P = nr->nparams;
      pp[np++] = nr->params;
    }
    if (!nr->sketch || !isfinite(nr->param_norm) || (k && nr->sketch_k != k)) continue;
    k = nr->sketch_k;
    norms[ns] = nr->param_norm;
    sk[ns++] = nr->sketch;
  }
  r->drift_n = ns;
  r->xi = r->mean_norm = r->rel_drift = r->xi_exact = NAN;
  if (ns >= 2) {
    r->xi = drift_from_sketches(sk, ns, k);
    r->mean_norm = drift_mean_norm(norms, ns, r->xi);
    r->rel_drift = r->mean_norm > 0 ? r->xi / r->mean_norm : NAN;
  }
  r->exact_n = np;
  if (m->cfg.exact && np >= 2) r->xi_exact = drift_exact(pp, np, P);
  if (ns < 2)
    snprintf(r->drift_note, sizeof r->drift_note, "%zu of %zu peers gave %s; drift needs 2", ns, r->peers,
             m->cfg.exact ? "parameters" : "a sketch");
  else if (ns < r->peers)
    snprintf(r->drift_note, sizeof r->drift_note, "drift over %zu of %zu peers (%zu unreachable or without figures)",
             ns, r->peers, r->peers - ns);
  free(sk);
  free(pp);
  free(norms);
}

static void poll_finish(struct gossip_monitor *m, int rc) {
  m->phase = MON_IDLE;
  m->poll_rc = rc;
  m->poll_over = true;
}

/* Ends the node phase: cancels transfers still running and waits for them
 * (their buffers must not be freed before on_bulk_done). */
static void nodes_end(struct gossip_monitor *m, int rc) {
  m->poll_rc = rc;
  m->phase = MON_DRAIN;
  for (size_t i = 0; i < m->r->n; i++)
    if (m->reqs[i].bulk_active && m->reqs[i].bulk_conn)
      (void)net_conn_cancel_recv(m->reqs[i].bulk_conn, m->reqs[i].bulk_id);
}

static bool nodes_complete(const struct gossip_monitor *m) {
  for (size_t i = 0; i < m->r->n; i++) {
    const struct mon_req *q = &m->reqs[i];
    if (!q->stats_done || (q->want_params && !q->params_done) || q->bulk_active) return false;
  }
  return true;
}

static void on_tick(uv_timer_t *t) {
  struct gossip_monitor *m = t->data;
  uint64_t now = now_ms(m);
  if (m->phase == MON_IDLE) {
    if (stop_requested(m) || (m->sleep_until_ms && now >= m->sleep_until_ms)) m->sleep_until_ms = 0;
    return;
  }
  bool stop = stop_requested(m);
  if (m->phase == MON_MEMBERS) {
    if (stop) poll_finish(m, RUMOR_ECANCELED);
    else if (now >= m->deadline_ms) {
      char why[64];
      snprintf(why, sizeof why, "no answer within %u ms", m->cfg.timeout_ms);
      boot_failed(m, why);
    }
    return;
  }
  if (m->phase == MON_NODES) {
    if (stop) {
      nodes_end(m, RUMOR_ECANCELED);
    } else if (now >= m->deadline_ms) {
      for (size_t i = 0; i < m->r->n; i++) {
        struct mon_req *q = &m->reqs[i];
        if (!q->stats_done) node_fail(m, i, "no answer within %u ms", m->cfg.timeout_ms);
        else if (q->want_params && !q->params_done)
          node_fail(m, i, "parameters not received within %u ms", m->cfg.timeout_ms);
      }
      nodes_end(m, 0);
    } else {
      for (size_t i = 0; i < m->r->n; i++) {
        struct mon_req *q = &m->reqs[i];
        if (q->params_retry_ms && now >= q->params_retry_ms && !q->params_done) {
          q->params_retry_ms = 0;
          if (q->link->conn) send_simple(q->link->conn, GMSG_PARAMS_REQ, q->q);
        }
      }
      if (nodes_complete(m)) nodes_end(m, 0);
    }
  }
  if (m->phase == MON_DRAIN) {
    bool busy = false;
    for (size_t i = 0; i < m->r->n; i++) busy |= m->reqs[i].bulk_active;
    if (!busy) poll_finish(m, m->poll_rc);
  }
}

void gossip_monitor_config_default(struct gossip_monitor_config *c) {
  memset(c, 0, sizeof *c);
  c->timeout_ms = 3000;
  c->handshake_timeout_ms = 3000;
  struct net_config nc;
  net_config_defaults(&nc);
  c->heartbeat_ms = nc.heartbeat_ms;
  c->dead_after_ms = nc.dead_after_ms;
  c->exact_max_bytes = 4ull << 30;
}

int gossip_monitor_open(gossip_monitor_t **out, const struct gossip_monitor_config *cfg, struct rumor_err *e) {
  *out = NULL;
  if (!cfg->identity || !cfg->cluster_key) return rumor_err_set(e, -EINVAL, "a monitor needs an identity and the cluster key");
  struct gossip_monitor *m = xcalloc(1, sizeof *m);
  m->cfg = *cfg;
  if (!m->cfg.timeout_ms) m->cfg.timeout_ms = 3000;
  if (!m->cfg.handshake_timeout_ms) m->cfg.handshake_timeout_ms = 3000;
  if (!m->cfg.exact_max_bytes) m->cfg.exact_max_bytes = 4ull << 30;
  m->identity = *cfg->identity;
  memcpy(m->cluster_key, cfg->cluster_key, NET_CLUSTER_KEY_BYTES);
  m->cfg.identity = &m->identity;
  m->cfg.cluster_key = m->cluster_key;
  m->cfg.bootstrap = NULL;
  int rc = gossip_split_addrs(cfg->bootstrap, m->boot, GOSSIP_MAX_BOOTSTRAP, &m->nboot, e);
  if (rc == 0 && m->nboot == 0) rc = rumor_err_set(e, RUMOR_EFORMAT, "--bootstrap ADDR is required (a bootstrap node or any peer)");
  if (rc) {
    for (size_t i = 0; i < m->nboot; i++) free(m->boot[i]);
    net_identity_wipe(&m->identity);
    sodium_memzero(m->cluster_key, sizeof m->cluster_key);
    free(m);
    return rc;
  }
  m->sketch_seed = gossip_derive_sketch_seed(m->cluster_key);
  if ((rc = uv_loop_init(&m->loop))) {
    gossip_monitor_close(m);
    return rumor_err_set(e, rc, "cannot create an event loop: %s", uv_strerror(rc));
  }
  m->loop_live = true;
  struct net_config nc;
  net_config_defaults(&nc);
  nc.identity = &m->identity;
  nc.cluster_key = m->cluster_key;
  nc.allow = cfg->allow;
  nc.handshake_timeout_ms = m->cfg.handshake_timeout_ms;
  nc.heartbeat_ms = m->cfg.heartbeat_ms;
  nc.dead_after_ms = m->cfg.dead_after_ms;
  nc.max_msg_bytes = 4u << 20; /* member tables of large clusters */
  const struct net_callbacks cbs = {.on_message = on_message, .on_bulk_begin = on_bulk_begin,
                                    .on_bulk_done = on_bulk_done, .on_close = on_close};
  if ((rc = net_init(&m->net, &m->loop, &nc, &cbs, m, e))) {
    gossip_monitor_close(m);
    return rc;
  }
  uv_timer_init(&m->loop, &m->tick);
  m->tick.data = m;
  uv_timer_start(&m->tick, on_tick, MON_TICK_MS, MON_TICK_MS);
  *out = m;
  return 0;
}

int gossip_monitor_poll(gossip_monitor_t *m, struct gossip_cluster_report *r, struct rumor_err *e) {
  memset(r, 0, sizeof *r);
  r->time_s = (double)clock_wall_ms() / 1e3;
  r->xi = r->mean_norm = r->rel_drift = r->xi_exact = NAN;
  m->r = r;
  m->reqs = NULL;
  m->boot_i = 0;
  m->boot_sent = m->boot_dialing = false;
  m->boot_errors[0] = '\0';
  m->exact_bytes = 0;
  m->poll_over = false;
  m->phase = MON_MEMBERS;
  boot_try(m);
  while (!m->poll_over) uv_run(&m->loop, UV_RUN_ONCE);
  int rc = m->poll_rc;
  if (rc == 0) compute_drift(m);
  free(m->reqs);
  m->reqs = NULL;
  m->r = NULL;
  if (rc) {
    gossip_cluster_report_free(r);
    if (rc == RUMOR_ECANCELED) return rumor_err_set(e, rc, "interrupted");
    return rumor_err_set(e, rc, "no bootstrap address answered: %s", m->boot_errors);
  }
  return 0;
}

void gossip_monitor_sleep(gossip_monitor_t *m, uint32_t ms) {
  m->sleep_until_ms = now_ms(m) + ms;
  if (m->sleep_until_ms == 0) return;
  while (m->sleep_until_ms) uv_run(&m->loop, UV_RUN_ONCE);
}

int gossip_monitor_serve(gossip_monitor_t *m, const char *what, const char *addr, gossip_monitor_http_handler h,
                         void *ctx, int *port, struct rumor_err *e) {
  if (m->http) return rumor_err_set(e, -EBUSY, "%s %s: this monitor already serves HTTP", what, addr);
  int rc = gossip_http_start(&m->loop, what, addr, h, ctx, &m->http, e);
  if (rc) return rc;
  *port = gossip_http_port(m->http);
  return 0;
}

static void on_net_closed(void *arg) { (void)arg; }

static void on_tick_closed(uv_handle_t *h) { (void)h; }

void gossip_monitor_close(gossip_monitor_t *m) {
  if (!m) return;
  if (m->loop_live) {
    if (m->net) net_close(m->net, on_net_closed, NULL);
    gossip_http_stop(m->http);
    if (m->tick.data) uv_close((uv_handle_t *)&m->tick, on_tick_closed);
    uv_run(&m->loop, UV_RUN_DEFAULT);
    if (uv_loop_close(&m->loop)) log_warn("monitor: event loop not empty at close");
  }
  for (size_t i = 0; i < m->nlinks; i++) free(m->links[i]);
  free(m->links);
  for (size_t i = 0; i < m->nboot; i++) free(m->boot[i]);
  net_identity_wipe(&m->identity);
  sodium_memzero(m->cluster_key, sizeof m->cluster_key);
  free(m);
}

void gossip_cluster_report_free(struct gossip_cluster_report *r) {
  for (size_t i = 0; i < r->n; i++) {
    free(r->nodes[i].sketch);
    free(r->nodes[i].params);
  }
  free(r->nodes);
  memset(r, 0, sizeof *r);
}
