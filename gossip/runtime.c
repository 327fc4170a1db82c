/*
 * The gossip runtime: the loop thread, connections to members by identity,
 * SWIM's messages on the wire, joining through the bootstrap list, leaving,
 * and the figures other threads read.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <sodium.h>

#include "gossip/gossip_impl.h"

void gossip_config_default(struct gossip_config *c) {
  memset(c, 0, sizeof *c);
  net_config_defaults(&c->net);
  c->listen = "127.0.0.1:0";
  c->role = GOSSIP_ROLE_PEER;
  struct swim_config sc;
  swim_config_default(&sc);
  c->period_ms = sc.period_ms;
  c->ping_timeout_ms = sc.ping_timeout_ms;
  c->suspect_timeout_ms = sc.suspect_timeout_ms;
  c->join_timeout_ms = 60000;
  c->wire = NET_DTYPE_F32;
  c->alpha = 0.5f;
  c->exchange_timeout_ms = 60000;
  c->max_xch_per_s = 100; /* well above an honest partner's rate, even with exchanges every step */
  c->max_conn_per_s = 5;
  c->optimizer = "";
  c->model = "";
}

uint64_t gossip_now_ms(struct gossip *g) { return uv_now(&g->loop); }

uint64_t gossip_derive_sketch_seed(const uint8_t cluster_key[NET_CLUSTER_KEY_BYTES]) {
  static const char label[] = "rumor count-sketch seed v1";
  uint8_t out[8];
  crypto_generichash(out, sizeof out, (const uint8_t *)label, sizeof label - 1, cluster_key, NET_CLUSTER_KEY_BYTES);
  uint64_t seed = 0;
  for (int i = 0; i < 8; i++) seed = seed << 8 | out[i];
  return seed;
}

static const char *role_name(enum swim_role r) { return r == SWIM_ROLE_BOOTSTRAP ? "bootstrap" : "peer"; }

/* "127.0.0.1:4000 (AbCdEf12)" for log lines. */
static void member_label(const struct swim_update *u, char *buf, size_t n) {
  char key[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(key, u->id);
  snprintf(buf, n, "%s (%.8s)", u->addr[0] ? u->addr : "?", key);
}

/* ---- links: one connection per member identity ---- */

struct gossip_link *gossip_link_get(struct gossip *g, const uint8_t *id, bool create) {
  for (size_t i = 0; i < g->nlinks; i++)
    if (memcmp(g->links[i].id, id, NET_PUBKEY_BYTES) == 0) return &g->links[i];
  if (!create) return NULL;
  if (g->nlinks == g->links_cap) {
    g->links_cap = g->links_cap ? 2 * g->links_cap : 16;
    g->links = xrealloc(g->links, g->links_cap * sizeof *g->links);
  }
  struct gossip_link *l = &g->links[g->nlinks++];
  memset(l, 0, sizeof *l);
  memcpy(l->id, id, NET_PUBKEY_BYTES);
  return l;
}

static void link_drop_queue(struct gossip_link *l) {
  for (size_t i = 0; i < l->nqueue; i++) free(l->queue[i]);
  l->nqueue = 0;
}

struct dial_ctx {
  struct gossip *g;
  uint8_t id[NET_PUBKEY_BYTES];
};

static void on_link_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct dial_ctx *d = arg;
  struct gossip *g = d->g;
  struct gossip_link *l = gossip_link_get(g, d->id, true);
  l->dialing = false;
  if (status < 0) {
    l->dial_failures++;
    uint64_t backoff = 100ull << (l->dial_failures < 6 ? l->dial_failures : 6);
    l->next_dial_ms = gossip_now_ms(g) + (backoff > 5000 ? 5000 : backoff);
    log_debug("dial %s failed: %s", l->addr, detail ? detail : rumor_strerror(status));
    link_drop_queue(l);
    free(d);
    return;
  }
  if (memcmp(net_conn_peer_key(c), d->id, NET_PUBKEY_BYTES) != 0) {
    /* Someone else answers at that address now (a restarted node with a new
     * identity, a reused port): not the member we wanted. */
    log_info("%s answered with another identity than expected; closing", net_conn_peer_name(c));
    net_conn_close(c);
    link_drop_queue(l);
    free(d);
    return;
  }
  l->dial_failures = 0;
  if (!l->conn) l->conn = c;
  for (size_t i = 0; i < l->nqueue; i++) {
    int rc = net_conn_send_raw_msg(c, l->queue[i], l->queue_len[i]);
    if (rc) log_debug("queued message to %s dropped: %s", l->addr, rumor_strerror(rc));
  }
  link_drop_queue(l);
  free(d);
}

int gossip_send(struct gossip *g, const uint8_t *id, struct net_msgbuf *b) {
  if (!g->net) return -ENOTCONN;
  struct gossip_link *l = gossip_link_get(g, id, true);
  if (l->conn) return net_conn_send_msg(l->conn, b);
  if (!l->addr[0]) {
    struct swim_member *m = swim_find(&g->swim, id);
    if (!m || !m->info.addr[0]) return -EHOSTUNREACH;
    snprintf(l->addr, sizeof l->addr, "%s", m->info.addr);
  }
  if (l->nqueue < GOSSIP_LINK_QUEUE) {
    size_t len;
    const uint8_t *data = net_msgbuf_data(b, &len);
    if (!data) return -ENOMEM;
    l->queue[l->nqueue] = xmalloc(len);
    memcpy(l->queue[l->nqueue], data, len);
    l->queue_len[l->nqueue++] = len;
  }
  if (!l->dialing && gossip_now_ms(g) >= l->next_dial_ms) {
    struct dial_ctx *d = xmalloc(sizeof *d);
    d->g = g;
    memcpy(d->id, id, NET_PUBKEY_BYTES);
    int rc = net_dial(g->net, l->addr, on_link_dial, d);
    if (rc) {
      free(d);
      link_drop_queue(l);
      l->next_dial_ms = gossip_now_ms(g) + 1000;
      return rc;
    }
    l->dialing = true;
  }
  return 0;
}

bool gossip_pick_peer(struct gossip *g, uint8_t *out, const uint8_t *exclude, bool donors_only) {
  uint64_t now = gossip_now_ms(g);
  size_t n = 0;
  size_t *cand = xmalloc((g->swim.nmembers + 1) * sizeof *cand);
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || m->info.state != SWIM_ALIVE) continue;
    if (exclude && memcmp(m->info.id, exclude, NET_PUBKEY_BYTES) == 0) continue;
    struct gossip_link *l = gossip_link_get(g, m->info.id, false);
    if (l && l->backoff_until_ms > now) continue;
    if (donors_only && !m->info.ready) continue;
    cand[n++] = i;
  }
  bool ok = n > 0;
  if (ok) memcpy(out, g->swim.members[cand[rng_below(&g->rng, n)]].info.id, NET_PUBKEY_BYTES);
  free(cand);
  return ok;
}

/* Rank of `id` among the alive peers and ourselves (when we are a peer),
 * ordered by key. */
static size_t peer_rank(struct gossip *g, const uint8_t *id) {
  size_t r = 0;
  if (g->cfg.role == GOSSIP_ROLE_PEER && memcmp(g->identity.pk, id, NET_PUBKEY_BYTES) < 0) r++;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role == SWIM_ROLE_PEER && m->info.state == SWIM_ALIVE &&
        memcmp(m->info.id, id, NET_PUBKEY_BYTES) < 0)
      r++;
  }
  return r;
}

void gossip_update_role(struct gossip *g) {
  atomic_store(&g->active, peer_rank(g, g->identity.pk) % 2 == 0);
}

bool gossip_pick_partner(struct gossip *g, uint8_t *out, const uint8_t *exclude) {
  uint64_t now = gossip_now_ms(g);
  size_t n = 0;
  size_t *cand = xmalloc((g->swim.nmembers + 1) * sizeof *cand);
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || m->info.state != SWIM_ALIVE) continue;
    if (exclude && memcmp(m->info.id, exclude, NET_PUBKEY_BYTES) == 0) continue;
    struct gossip_link *l = gossip_link_get(g, m->info.id, false);
    if (!m->info.ready || (l && l->backoff_until_ms > now)) continue;
    if (peer_rank(g, m->info.id) % 2 == 1) cand[n++] = i;
  }
  bool ok = n > 0;
  if (ok) memcpy(out, g->swim.members[cand[rng_below(&g->rng, n)]].info.id, NET_PUBKEY_BYTES);
  free(cand);
  return ok || gossip_pick_peer(g, out, exclude, true);
}

void gossip_fail_stat(struct gossip *g, const char *why) {
  pthread_mutex_lock(&g->lock);
  g->stats.exchanges_failed++;
  snprintf(g->stats.last_failure, sizeof g->stats.last_failure, "%s", why);
  pthread_mutex_unlock(&g->lock);
}

/* ---- SWIM on the wire ---- */

/* Updates travel as an array of [id (bin 32), addr (str), role, state,
 * incarnation, ready (bool)]. */
void gossip_put_updates(struct net_msgbuf *b, const struct swim_update *u, size_t n) {
  msgpack_packer *pk = net_msgbuf_put_key(b, "u");
  msgpack_pack_array(pk, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    size_t alen = strnlen(u[i].addr, SWIM_ADDR_MAX - 1);
    msgpack_pack_array(pk, 6);
    msgpack_pack_bin(pk, SWIM_ID_BYTES);
    msgpack_pack_bin_body(pk, u[i].id, SWIM_ID_BYTES);
    msgpack_pack_str(pk, alen);
    msgpack_pack_str_body(pk, u[i].addr, alen);
    msgpack_pack_uint8(pk, (uint8_t)u[i].role);
    msgpack_pack_uint8(pk, (uint8_t)u[i].state);
    msgpack_pack_uint64(pk, u[i].incarnation);
    if (u[i].ready) msgpack_pack_true(pk);
    else msgpack_pack_false(pk);
  }
}

static bool printable(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] < 0x21 || s[i] > 0x7e) return false;
  return true;
}

/* Decodes and validates the "u" array (absent: zero updates). Returns the
 * count or a negative code; never trusts a length or enum from the wire. */
int gossip_get_updates(const struct net_msg *m, const char *key, struct swim_update *out, size_t max) {
  const msgpack_object *items;
  uint32_t n;
  int rc = net_msg_get_array(m, key, &items, &n);
  if (rc == RUMOR_ENOTFOUND) return 0;
  if (rc) return rc;
  if (n > max) return RUMOR_EPROTO;
  for (uint32_t i = 0; i < n; i++) {
    const msgpack_object *o = &items[i];
    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != 6) return RUMOR_EPROTO;
    const msgpack_object *f = o->via.array.ptr;
    const uint8_t *id;
    const char *addr;
    size_t idlen, alen;
    uint64_t role, state, inc;
    bool ready;
    if (net_obj_bin(&f[0], &id, &idlen) || idlen != SWIM_ID_BYTES || net_obj_str(&f[1], &addr, &alen) ||
        alen >= SWIM_ADDR_MAX || !printable(addr, alen) || net_obj_uint(&f[2], &role) || role > SWIM_ROLE_BOOTSTRAP ||
        net_obj_uint(&f[3], &state) || state > SWIM_LEFT || net_obj_uint(&f[4], &inc) || net_obj_bool(&f[5], &ready))
      return RUMOR_EPROTO;
    memset(&out[i], 0, sizeof out[i]);
    memcpy(out[i].id, id, SWIM_ID_BYTES);
    memcpy(out[i].addr, addr, alen);
    out[i].role = (enum swim_role)role;
    out[i].state = (enum swim_state)state;
    out[i].incarnation = inc;
    out[i].ready = ready;
  }
  return (int)n;
}

static void swim_send_ping(void *ctx, const struct swim_member *to, uint64_t seq, const struct swim_update *u,
                           size_t n) {
  struct gossip *g = ctx;
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_PING, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "s", seq);
  gossip_put_updates(&b, u, n);
  (void)gossip_send(g, to->info.id, &b);
  net_msgbuf_free(&b);
}

static void swim_send_ack(void *ctx, const uint8_t *to, uint64_t seq, const struct swim_update *u, size_t n) {
  struct gossip *g = ctx;
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_ACK, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "s", seq);
  gossip_put_updates(&b, u, n);
  (void)gossip_send(g, to, &b);
  net_msgbuf_free(&b);
}

static void swim_send_ping_req(void *ctx, const struct swim_member *via, const struct swim_member *target,
                               uint64_t seq, const struct swim_update *u, size_t n) {
  struct gossip *g = ctx;
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_PING_REQ, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "s", seq);
  net_msgbuf_put_bin(&b, "target", target->info.id, SWIM_ID_BYTES);
  gossip_put_updates(&b, u, n);
  (void)gossip_send(g, via->info.id, &b);
  net_msgbuf_free(&b);
}

static void swim_changed(void *ctx, const struct swim_member *m, enum swim_state old, bool added) {
  struct gossip *g = ctx;
  char label[200];
  member_label(&m->info, label, sizeof label);
  if (added)
    log_info("member %s %s: %s %s (incarnation %llu)", label, m->info.state == SWIM_ALIVE ? "joined" : "known",
             role_name(m->info.role), swim_state_name(m->info.state), (unsigned long long)m->info.incarnation);
  else if (old != m->info.state)
    log_info("member %s is now %s (was %s, incarnation %llu)", label, swim_state_name(m->info.state),
             swim_state_name(old), (unsigned long long)m->info.incarnation);
  else
    log_debug("member %s %s a state (incarnation %llu)", label, m->info.ready ? "holds" : "does not hold",
              (unsigned long long)m->info.incarnation);
  struct gossip_link *l = gossip_link_get(g, m->info.id, true);
  if (m->info.addr[0] && strcmp(l->addr, m->info.addr) != 0) {
    snprintf(l->addr, sizeof l->addr, "%s", m->info.addr);
    l->next_dial_ms = 0;
    l->dial_failures = 0;
  }
  if (m->info.state == SWIM_DEAD || m->info.state == SWIM_LEFT) {
    if (g->pulling && memcmp(g->donor, m->info.id, NET_PUBKEY_BYTES) == 0) {
      log_info("our donor %s; asking another peer", m->info.state == SWIM_LEFT ? "left" : "failed");
      if (g->pull_conn) (void)net_conn_cancel_recv(g->pull_conn, g->pull_recv_id);
      g->pulling = false;
      g->pull_conn = NULL;
      g->pull_retry_ms = gossip_now_ms(g);
    }
    if (g->xch.active && memcmp(g->xch.partner, m->info.id, NET_PUBKEY_BYTES) == 0)
      gossip_xch_abandon(g, m->info.state == SWIM_LEFT ? "partner left" : "partner failed");
    if (l->conn) net_conn_close(l->conn);
  } else if (m->info.state == SWIM_ALIVE && (old == SWIM_DEAD || old == SWIM_LEFT)) {
    l->backoff_until_ms = 0;
  }
  gossip_publish(g);
}

/* ---- joining ---- */

static void join_fail_message(struct gossip *g) {
  size_t n = (size_t)snprintf(g->join_error, sizeof g->join_error,
                              "could not join the cluster through any bootstrap address within %u ms:",
                              g->cfg.join_timeout_ms);
  for (size_t i = 0; i < g->nboot && n < sizeof g->join_error; i++)
    n += (size_t)snprintf(g->join_error + n, sizeof g->join_error - n, "%s %s (%s)", i ? ";" : "", g->boot[i],
                          g->boot_err[i][0] ? g->boot_err[i] : "no answer");
}

static void signal_waiters(struct gossip *g) {
  pthread_mutex_lock(&g->lock);
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

static void send_join(struct gossip *g, net_conn_t *c) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_JOIN, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "addr", g->advertise, strlen(g->advertise));
  net_msgbuf_put_uint(&b, "role", (uint64_t)g->cfg.role);
  net_msgbuf_put_uint(&b, "inc", g->swim.self.incarnation);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  net_msgbuf_put_uint(&b, "nparams", g->cfg.nparams);
  int rc = net_conn_send_msg(c, &b);
  if (rc) log_warn("cannot send JOIN to %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
  net_msgbuf_free(&b);
}

static void on_join_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct gossip *g = arg;
  size_t i = g->boot_next;
  g->join_dialing = false;
  if (g->joined || g->stopping) {
    if (c) net_conn_close(c);
    return;
  }
  if (status < 0) {
    snprintf(g->boot_err[i], sizeof g->boot_err[i], "%s", detail ? detail : rumor_strerror(status));
    log_warn("bootstrap %s: %s", g->boot[i], g->boot_err[i]);
    g->boot_next = (i + 1) % g->nboot;
    if (g->boot_next == 0) {
      /* A whole pass failed: back off before the next (0.5 s doubling to 5 s). */
      g->join_rounds++;
      uint64_t backoff = 250ull << (g->join_rounds < 5 ? g->join_rounds : 5);
      g->join_retry_ms = gossip_now_ms(g) + (backoff > 5000 ? 5000 : backoff);
    }
    return;
  }
  struct gossip_link *l = gossip_link_get(g, net_conn_peer_key(c), true);
  if (!l->conn) l->conn = c;
  snprintf(g->boot_err[i], sizeof g->boot_err[i], "connected, but no JOIN reply");
  g->boot_next = (i + 1) % g->nboot; /* if no reply comes, the retry tries the next one */
  send_join(g, c);
}

static void join_tick(struct gossip *g, uint64_t now) {
  if (g->joined || g->join_failed || g->join_dialing || g->nboot == 0) return;
  if (now - g->join_started_ms >= g->cfg.join_timeout_ms && g->cfg.role == GOSSIP_ROLE_BOOTSTRAP) {
    /* A bootstrap node whose list is all down (say, the others restart too)
     * is what newcomers dial: it starts as the first member rather than
     * serve forever as "not ready". Members that join later merge in. */
    join_fail_message(g);
    log_warn("%s; starting as the first member", g->join_error);
    pthread_mutex_lock(&g->lock);
    g->joined = true;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    gossip_publish(g);
    return;
  }
  if (now - g->join_started_ms >= g->cfg.join_timeout_ms) {
    pthread_mutex_lock(&g->lock);
    g->join_failed = true;
    join_fail_message(g);
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    log_error("%s", g->join_error);
    return;
  }
  if (now < g->join_retry_ms) return;
  /* A reply overdue from a connected bootstrap counts as a failure. */
  int rc = net_dial(g->net, g->boot[g->boot_next], on_join_dial, g);
  if (rc) {
    snprintf(g->boot_err[g->boot_next], sizeof g->boot_err[g->boot_next], "%s", rumor_strerror(rc));
    g->boot_next = (g->boot_next + 1) % g->nboot;
    g->join_retry_ms = now + 250;
    return;
  }
  g->join_dialing = true;
  g->join_retry_ms = now + g->cfg.period_ms * 5; /* JOIN reply deadline before the next address */
}

static void handle_join(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const char *addr, *model;
  size_t alen, mlen;
  uint64_t role, inc, nparams;
  if (net_msg_get_str(m, "addr", &addr, &alen) || alen == 0 || alen >= SWIM_ADDR_MAX || !printable(addr, alen) ||
      net_msg_get_uint(m, "role", &role) || role > SWIM_ROLE_BOOTSTRAP || net_msg_get_uint(m, "inc", &inc) ||
      net_msg_get_str(m, "model", &model, &mlen) || mlen >= sizeof g->model || net_msg_get_uint(m, "nparams", &nparams)) {
    log_warn("malformed JOIN from %s; dropping the connection", net_conn_peer_name(c));
    net_conn_close(c);
    return;
  }
  char their_model[256];
  memcpy(their_model, model, mlen);
  their_model[mlen] = '\0';
  struct net_msgbuf b;
  if (role == SWIM_ROLE_PEER) {
    /* The cluster's model: ours (a peer), or the first one a bootstrap saw. */
    if (!g->model[0] && g->cfg.role == GOSSIP_ROLE_BOOTSTRAP) snprintf(g->model, sizeof g->model, "%s", their_model);
    if (strcmp(their_model, g->model) != 0) {
      char why[600];
      snprintf(why, sizeof why, "model mismatch: this cluster trains %s, the joiner has %s", g->model, their_model);
      log_warn("refused JOIN from %s: %s", net_conn_peer_name(c), why);
      net_msgbuf_init(&b, GMSG_JOIN_REJECT, GOSSIP_PROTO_VERSION);
      net_msgbuf_put_str(&b, "why", why, strlen(why));
      if (net_conn_send_msg(c, &b)) log_debug("cannot send JOIN_REJECT to %s", net_conn_peer_name(c));
      net_msgbuf_free(&b);
      return;
    }
  }
  struct swim_update u = {.role = (enum swim_role)role, .state = SWIM_ALIVE, .incarnation = inc};
  memcpy(u.id, net_conn_peer_key(c), SWIM_ID_BYTES);
  memcpy(u.addr, addr, alen);
  swim_apply(&g->swim, &u, gossip_now_ms(g));
  struct gossip_link *l = gossip_link_get(g, u.id, true);
  if (!l->conn) l->conn = c;
  snprintf(l->addr, sizeof l->addr, "%s", u.addr);

  size_t cap = g->swim.nmembers + 1;
  struct swim_update *tab = xmalloc(cap * sizeof *tab);
  size_t n = swim_snapshot(&g->swim, tab, cap);
  net_msgbuf_init(&b, GMSG_JOIN_OK, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  gossip_put_updates(&b, tab, n);
  int rc = net_conn_send_msg(c, &b);
  if (rc) log_warn("cannot answer JOIN from %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
  net_msgbuf_free(&b);
  free(tab);
}

static void handle_join_ok(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  if (g->joined) return;
  size_t cap = SWIM_MAX_MEMBERS + 1;
  struct swim_update *tab = xmalloc(cap * sizeof *tab);
  int n = gossip_get_updates(m, "u", tab, cap);
  if (n < 0) {
    log_warn("malformed JOIN reply from %s", net_conn_peer_name(c));
    free(tab);
    net_conn_close(c);
    return;
  }
  uint64_t now = gossip_now_ms(g);
  for (int i = 0; i < n; i++) swim_apply(&g->swim, &tab[i], now);
  free(tab);
  pthread_mutex_lock(&g->lock);
  g->joined = true;
  pthread_mutex_unlock(&g->lock);
  size_t peers = swim_count_live(&g->swim, SWIM_ROLE_PEER);
  log_info("joined through %s: %zu members known, %zu other peer%s", net_conn_peer_addr(c), g->swim.nmembers, peers,
           peers == 1 ? "" : "s");
  gossip_publish(g);
  signal_waiters(g);
}

static void handle_join_reject(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const char *why;
  size_t n;
  if (net_msg_get_str(m, "why", &why, &n)) why = "no reason given", n = strlen(why);
  pthread_mutex_lock(&g->lock);
  snprintf(g->join_error, sizeof g->join_error, "%s refused to let us join: %.*s", net_conn_peer_addr(c), (int)n, why);
  g->join_failed = true;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
  log_error("%s", g->join_error);
}

/* ---- net callbacks ---- */

static void on_accept(net_conn_t *c, void *ud) {
  struct gossip *g = ud;
  if (!gossip_guard_allow_conn(g, net_conn_peer_key(c))) {
    net_conn_close(c);
    return;
  }
  struct gossip_link *l = gossip_link_get(g, net_conn_peer_key(c), true);
  if (!l->conn) l->conn = c;
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct gossip *g = ud;
  if (m->version != GOSSIP_PROTO_VERSION) {
    log_debug("ignoring message type %llu of version %llu from %s", (unsigned long long)m->type,
              (unsigned long long)m->version, net_conn_peer_name(c));
    return;
  }
  const uint8_t *from = net_conn_peer_key(c);
  uint64_t now = gossip_now_ms(g);
  struct swim_update u[SWIM_MAX_PIGGYBACK];
  int n;
  uint64_t seq;
  switch ((enum gossip_msg_type)m->type) {
  case GMSG_JOIN: handle_join(g, c, m); return;
  case GMSG_JOIN_OK: handle_join_ok(g, c, m); return;
  case GMSG_JOIN_REJECT: handle_join_reject(g, c, m); return;
  case GMSG_PING:
  case GMSG_ACK:
  case GMSG_LEAVE:
    n = gossip_get_updates(m, "u", u, SWIM_MAX_PIGGYBACK);
    if (n < 0 || (m->type != GMSG_LEAVE && net_msg_get_uint(m, "s", &seq))) break;
    if (m->type == GMSG_PING) swim_on_ping(&g->swim, from, seq, u, (size_t)n, now);
    else if (m->type == GMSG_ACK) swim_on_ack(&g->swim, from, seq, u, (size_t)n, now);
    else for (int i = 0; i < n; i++) swim_apply(&g->swim, &u[i], now);
    return;
  case GMSG_PING_REQ: {
    const uint8_t *target;
    size_t tlen;
    n = gossip_get_updates(m, "u", u, SWIM_MAX_PIGGYBACK);
    if (n < 0 || net_msg_get_uint(m, "s", &seq) || net_msg_get_bin(m, "target", &target, &tlen) ||
        tlen != SWIM_ID_BYTES)
      break;
    swim_on_ping_req(&g->swim, from, target, seq, u, (size_t)n, now);
    return;
  }
  case GMSG_XCH_REQ:
  case GMSG_XCH_ACCEPT:
  case GMSG_XCH_REJECT:
    gossip_xch_on_msg(g, c, m);
    return;
  case GMSG_STATE_REQ:
  case GMSG_STATE_BUSY:
    gossip_pull_on_msg(g, c, m);
    return;
  case GMSG_MEMBERS_REQ:
  case GMSG_STATS_REQ:
  case GMSG_PARAMS_REQ:
    gossip_stats_on_msg(g, c, m);
    return;
  default:
    log_debug("ignoring unknown message type %llu from %s", (unsigned long long)m->type, net_conn_peer_name(c));
    return;
  }
  log_warn("malformed message (type %llu) from %s; dropping the connection", (unsigned long long)m->type,
           net_conn_peer_name(c));
  net_conn_close(c);
}

static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct gossip *g = ud;
  struct net_msg meta;
  struct rumor_err e;
  uint64_t kind, xid;
  if (!info->meta || net_msg_decode(info->meta, info->meta_len, NULL, &meta, &e)) return RUMOR_EPROTO;
  int rc = RUMOR_EPROTO;
  if (!net_msg_get_uint(&meta, "k", &kind) && !net_msg_get_uint(&meta, "x", &xid)) {
    uint64_t xstep = 0;
    if (kind == GBULK_EXCHANGE && net_msg_get_uint(&meta, "step", &xstep)) rc = RUMOR_EPROTO;
    else if (kind == GBULK_EXCHANGE && (rc = gossip_guard_xch_bulk(g, c, info, xid, xstep)) != 0) { /* refused */ }
    else rc = gossip_xch_on_bulk_begin(g, c, info, kind, xid, dst);
    if (rc == 0 && kind == GBULK_STATE) {
      uint64_t step = 0, epoch = 0, samples = 0;
      if (net_msg_get_uint(&meta, "step", &step) || net_msg_get_uint(&meta, "epoch", &epoch) ||
          net_msg_get_uint(&meta, "samples", &samples))
        rc = RUMOR_EPROTO;
      g->pull_pos = (struct gossip_train_pos){step, epoch, samples};
    }
  }
  net_msg_free(&meta);
  *dst_arg = NULL;
  return rc;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  gossip_xch_on_bulk_done(ud, c, id, status);
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct gossip *g = ud;
  bool partner_lost = false;
  for (size_t i = 0; i < g->nlinks; i++)
    if (g->links[i].conn == c) {
      g->links[i].conn = NULL;
      /* Cut by an error (a reset, EOF from a dead process) while an exchange
       * with it is pending on no bulk connection yet: the partner is gone,
       * so the exchange is abandoned now rather than at the failure verdict. */
      partner_lost |= status != 0 && g->xch.active && memcmp(g->links[i].id, g->xch.partner, NET_PUBKEY_BYTES) == 0;
    }
  gossip_xch_on_close(g, c);
  if (partner_lost && g->xch.active) gossip_xch_abandon(g, "connection to the partner lost");
  gossip_stats_on_close(g, c);
}

/* ---- figures for other threads ---- */

void gossip_publish(struct gossip *g) {
  gossip_update_role(g);
  size_t need = g->swim.nmembers + 1;
  pthread_mutex_lock(&g->lock);
  if (need > g->pub_cap) {
    g->pub_cap = need * 2;
    g->pub = xrealloc(g->pub, g->pub_cap * sizeof *g->pub);
  }
  g->npub = 0;
  for (size_t i = 0; i < need; i++) {
    const struct swim_update *u = i == 0 ? &g->swim.self : &g->swim.members[i - 1].info;
    struct gossip_member_view *v = &g->pub[g->npub++];
    net_pubkey_format(v->id, u->id);
    snprintf(v->addr, sizeof v->addr, "%s", u->addr);
    v->role = role_name(u->role);
    v->state = swim_state_name(u->state);
    v->incarnation = u->incarnation;
    v->ready = u->ready;
    v->self = i == 0;
  }
  struct gossip_stats *s = &g->stats;
  s->members_alive = s->members_suspect = s->members_failed = s->members_left = 0;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    switch (g->swim.members[i].info.state) {
    case SWIM_ALIVE: s->members_alive++; break;
    case SWIM_SUSPECT: s->members_suspect++; break;
    case SWIM_DEAD: s->members_failed++; break;
    case SWIM_LEFT: s->members_left++; break;
    }
  }
  if (g->net) {
    struct net_stats ns;
    net_stats_get(g->net, &ns);
    s->bytes_in = ns.total.bytes_in;
    s->bytes_out = ns.total.bytes_out;
  }
  pthread_mutex_unlock(&g->lock);
}

void gossip_stats_get(gossip_t *g, struct gossip_stats *s) {
  pthread_mutex_lock(&g->lock);
  *s = g->stats;
  uint64_t last = g->last_exchange_ms;
  pthread_mutex_unlock(&g->lock);
  s->last_exchange_age_s = last ? (double)(clock_now_ns() / 1000000 - last) / 1e3 : -1.0;
}

size_t gossip_members(gossip_t *g, struct gossip_member_view *out, size_t max) {
  pthread_mutex_lock(&g->lock);
  size_t n = g->npub;
  for (size_t i = 0; i < n && i < max; i++) out[i] = g->pub[i];
  pthread_mutex_unlock(&g->lock);
  return n;
}

const char *gossip_advertised(const gossip_t *g) { return g->advertise; }
const char *gossip_self_id(const gossip_t *g) { return g->self_id_text; }

/* ---- the loop thread ---- */

static void on_tick(uv_timer_t *t) {
  struct gossip *g = t->data;
  uint64_t now = gossip_now_ms(g);
  if (!g->stopping) {
    join_tick(g, now);
    if (g->joined) swim_tick(&g->swim, now);
    gossip_pull_tick(g, now);
  }
  gossip_xch_tick(g, now);
  gossip_stats_tick(g, now);
#ifdef RUMOR_TESTING
  gossip_testing_tick(g, now);
#endif
  static const uint64_t publish_every = 250;
  if (now / publish_every != (now - GOSSIP_TICK_MS) / publish_every) gossip_publish(g);
}

static void loop_main(void *arg) {
  struct gossip *g = arg;
  /* Before the first bulk transfer starts libuv's pool threads: they
   * inherit this thread's CPUs. */
  struct rumor_err e;
  if (g->cfg.net_cpus && cpu_pin_self(g->cfg.net_cpus, &e)) log_warn("network thread: %s", e.msg);
  uv_run(&g->loop, UV_RUN_DEFAULT);
}

int gossip_split_addrs(const char *list, char **out, size_t max, size_t *nout, struct rumor_err *e) {
  *nout = 0;
  if (!list) return 0;
  const char *p = list;
  while (*p) {
    const char *comma = strchr(p, ',');
    size_t len = comma ? (size_t)(comma - p) : strlen(p);
    if (len > 0) {
      if (*nout == max) return rumor_err_set(e, RUMOR_EFORMAT, "--bootstrap lists more than %zu addresses", max);
      if (len >= SWIM_ADDR_MAX)
        return rumor_err_set(e, RUMOR_EFORMAT, "bootstrap address '%.*s' is too long", (int)len, p);
      char *a = xmalloc(len + 1);
      memcpy(a, p, len);
      a[len] = '\0';
      out[(*nout)++] = a;
      if (!strrchr(a, ':'))
        return rumor_err_set(e, RUMOR_EFORMAT, "bootstrap address '%s' has no port (expected host:port)", a);
    }
    p += len + (comma ? 1 : 0);
  }
  return 0;
}

/* The address to advertise: --advertise, else the listen host with the
 * bound port. A wildcard listen address cannot be dialed by others. */
static int make_advertise(struct gossip *g, struct rumor_err *e) {
  if (g->cfg.advertise && *g->cfg.advertise) {
    if (strlen(g->cfg.advertise) >= sizeof g->advertise || !strrchr(g->cfg.advertise, ':'))
      return rumor_err_set(e, RUMOR_EFORMAT, "bad --advertise '%s' (expected host:port)", g->cfg.advertise);
    snprintf(g->advertise, sizeof g->advertise, "%s", g->cfg.advertise);
    return 0;
  }
  const char *colon = strrchr(g->cfg.listen, ':');
  size_t hlen = colon ? (size_t)(colon - g->cfg.listen) : 0;
  char host[SWIM_ADDR_MAX];
  if (hlen >= sizeof host) hlen = sizeof host - 1;
  memcpy(host, g->cfg.listen, hlen);
  host[hlen] = '\0';
  if (hlen == 0 || strcmp(host, "0.0.0.0") == 0 || strcmp(host, "[::]") == 0)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--listen %s does not say which address others should dial; add --advertise HOST:PORT",
                         g->cfg.listen);
  snprintf(g->advertise, sizeof g->advertise, "%s:%d", host, net_listen_port(g->net));
  return 0;
}

static void free_gossip(struct gossip *g) {
#ifdef RUMOR_TESTING
  gossip_testing_free(g);
#endif
  for (size_t i = 0; i < g->nlinks; i++) link_drop_queue(&g->links[i]);
  free(g->links);
  for (size_t i = 0; i < g->nboot; i++) free(g->boot[i]);
  swim_free(&g->swim);
  free(g->pub);
  free(g->psketch);
  free(g->donor_sketch);
  net_identity_wipe(&g->identity);
  sodium_memzero(g->cluster_key, sizeof g->cluster_key);
  pthread_mutex_destroy(&g->lock);
  pthread_cond_destroy(&g->cond);
  free(g);
}

static void on_closed_handle(uv_handle_t *h) {}

int gossip_start(gossip_t **out, const struct gossip_config *cfg, struct rumor_err *e) {
  *out = NULL;
  struct gossip *g = xcalloc(1, sizeof *g);
  g->cfg = *cfg;
  g->identity = *cfg->identity;
  memcpy(g->cluster_key, cfg->cluster_key, NET_CLUSTER_KEY_BYTES);
  g->cfg.identity = &g->identity;
  g->cfg.cluster_key = g->cluster_key;
  snprintf(g->model, sizeof g->model, "%s", cfg->model ? cfg->model : "");
  snprintf(g->optimizer, sizeof g->optimizer, "%s", cfg->optimizer ? cfg->optimizer : "");
  g->cfg.model = g->model;
  g->cfg.optimizer = g->optimizer;
  if (cfg->net_cpus) {
    g->net_cpus = *cfg->net_cpus;
    g->cfg.net_cpus = &g->net_cpus;
  }
  g->cfg.listen = NULL; /* only used below, during start */
  g->cfg.bootstrap = NULL;
  g->mine = cfg->xch_mine;
  g->theirs = cfg->xch_theirs;
  g->donor_buf = cfg->donor_buf;
  g->alpha = cfg->alpha;
  net_pubkey_format(g->self_id_text, g->identity.pk);
  pthread_mutex_init(&g->lock, NULL);
  pthread_cond_init(&g->cond, NULL);
  rng_seed(&g->rng, cfg->seed ^ clock_now_ns(), 0x474f53ull);
  if (cfg->role == GOSSIP_ROLE_PEER && (!g->mine || !g->theirs || !g->donor_buf || !cfg->nparams)) {
    free_gossip(g);
    return rumor_err_set(e, -EINVAL, "a gossip peer needs its parameter count and host buffers");
  }
  g->sketch_k = cfg->sketch_k ? cfg->sketch_k : 1024;
  if (g->sketch_k < 1 || g->sketch_k > 65536 || (g->sketch_k & (g->sketch_k - 1))) {
    int k = g->sketch_k;
    free_gossip(g);
    return rumor_err_set(e, RUMOR_EFORMAT, "sketch size %d is not a power of two in [1, 65536]", k);
  }
  g->psketch = xcalloc((size_t)g->sketch_k, sizeof(double));
  g->donor_sketch = xcalloc((size_t)g->sketch_k, sizeof(double));
  g->sketch_seed = gossip_derive_sketch_seed(g->cluster_key);
#ifdef RUMOR_TESTING
  if (gossip_testing_start(g, e)) {
    free_gossip(g);
    return RUMOR_EFORMAT;
  }
#endif

  int rc = uv_loop_init(&g->loop);
  if (rc) {
    free_gossip(g);
    return rumor_err_set(e, rc, "uv_loop_init: %s", uv_strerror(rc));
  }
  struct net_config nc = cfg->net;
  nc.identity = &g->identity;
  nc.cluster_key = g->cluster_key;
  nc.allow = cfg->allow;
  const struct net_callbacks cbs = {
      .on_accept = on_accept,
      .on_message = on_message,
      .on_bulk_begin = on_bulk_begin,
      .on_bulk_done = on_bulk_done,
      .on_close = on_close,
  };
  if ((rc = net_init(&g->net, &g->loop, &nc, &cbs, g, e))) goto fail_loop;
  g->cfg.listen = cfg->listen;
  if ((rc = net_listen(g->net, cfg->listen, e)) || (rc = make_advertise(g, e)) ||
      (rc = gossip_split_addrs(cfg->bootstrap, g->boot, GOSSIP_MAX_BOOTSTRAP, &g->nboot, e)) || (rc = gossip_metrics_start(g, e)))
    goto fail_net;

  struct swim_config sc;
  swim_config_default(&sc);
  sc.period_ms = cfg->period_ms;
  sc.ping_timeout_ms = cfg->ping_timeout_ms;
  sc.suspect_timeout_ms = cfg->suspect_timeout_ms;
  sc.reconnect_ms = 5 * cfg->period_ms; /* heals partitions longer than the suspicion time */
  const struct swim_io io = {g, swim_send_ping, swim_send_ack, swim_send_ping_req, swim_changed};
  struct swim_update self = {.role = cfg->role == GOSSIP_ROLE_BOOTSTRAP ? SWIM_ROLE_BOOTSTRAP : SWIM_ROLE_PEER,
                             .state = SWIM_ALIVE,
                             /* Wall-clock milliseconds: a restarted member outranks its old self. */
                             .incarnation = (uint64_t)clock_wall_ms()};
  memcpy(self.id, g->identity.pk, SWIM_ID_BYTES);
  snprintf(self.addr, sizeof self.addr, "%s", g->advertise);
  uv_update_time(&g->loop);
  uint64_t now = gossip_now_ms(g);
  swim_init(&g->swim, &sc, &io, &self, cfg->seed + 17, now);
  g->join_started_ms = now;
  g->joined = g->nboot == 0;
  gossip_publish(g);

  uv_timer_init(&g->loop, &g->tick);
  g->tick.data = g;
  uv_timer_start(&g->tick, on_tick, GOSSIP_TICK_MS, GOSSIP_TICK_MS);
  g->cfg.listen = NULL;
  if ((rc = uv_thread_create(&g->thread, loop_main, g))) {
    rumor_err_set(e, rc, "cannot start the network thread: %s", uv_strerror(rc));
    uv_close((uv_handle_t *)&g->tick, on_closed_handle);
    goto fail_net;
  }
  log_info("listening on %s as %.12s... (%s)", g->advertise, g->self_id_text, role_name(self.role));
  *out = g;
  return 0;

fail_net:
  gossip_metrics_stop(g);
  net_close(g->net, NULL, NULL);
  uv_run(&g->loop, UV_RUN_DEFAULT);
fail_loop:
  uv_loop_close(&g->loop);
  free_gossip(g);
  return rc;
}

/* ---- leaving ---- */

static void on_net_closed(void *arg) {
  struct gossip *g = arg;
  g->net = NULL;
  uv_close((uv_handle_t *)&g->tick, on_closed_handle);
}

static void free_handle(uv_handle_t *h) { free(h); }

static void on_linger_done(uv_timer_t *t) {
  struct gossip *g = t->data;
  uv_close((uv_handle_t *)t, free_handle);
  net_close(g->net, on_net_closed, g);
}

struct stop_req {
  struct gossip *g;
  uint32_t linger_ms;
};

static void stop_on_loop(net_t *n, void *arg, int status) {
  struct stop_req *r = arg;
  struct gossip *g = r->g;
  uint32_t linger = r->linger_ms;
  free(r);
  if (status) return; /* the net is already closing */
  g->stopping = true;
  gossip_metrics_stop(g);
  if (g->xch.active) gossip_xch_abandon(g, "shutting down");
  uint64_t now = gossip_now_ms(g);
  if (g->joined) {
    swim_leave(&g->swim, now);
    /* Tell every live member directly: LEAVE must not depend on probes. */
    struct net_msgbuf b;
    net_msgbuf_init(&b, GMSG_LEAVE, GOSSIP_PROTO_VERSION);
    gossip_put_updates(&b, &g->swim.self, 1);
    size_t told = 0;
    for (size_t i = 0; i < g->swim.nmembers; i++) {
      const struct swim_member *m = &g->swim.members[i];
      if ((m->info.state == SWIM_ALIVE || m->info.state == SWIM_SUSPECT) && gossip_send(g, m->info.id, &b) == 0)
        told++;
    }
    net_msgbuf_free(&b);
    log_info("leaving: told %zu member%s", told, told == 1 ? "" : "s");
  }
  uv_timer_t *t = xmalloc(sizeof *t);
  uv_timer_init(&g->loop, t);
  t->data = g;
  uv_timer_start(t, on_linger_done, linger, 0);
}

void gossip_stop(gossip_t *g, uint32_t linger_ms) {
  if (!g) return;
  struct stop_req *r = xmalloc(sizeof *r);
  r->g = g;
  r->linger_ms = linger_ms;
  if (net_call(g->net, stop_on_loop, r) != 0) free(r);
  signal_waiters(g);
  uv_thread_join(&g->thread);
  int rc = uv_loop_close(&g->loop);
  if (rc) log_warn("gossip loop did not close cleanly: %s", uv_strerror(rc));
  free_gossip(g);
}

/* ---- other users of the loop ---- */

struct loop_call {
  struct gossip *g;
  void (*fn)(uv_loop_t *loop, void *arg);
  void *arg;
  pthread_mutex_t mu;
  pthread_cond_t cond;
  bool done;
  int status;
};

static void loop_call_run(net_t *n, void *arg, int status) {
  struct loop_call *c = arg;
  if (status == 0) c->fn(&c->g->loop, c->arg);
  pthread_mutex_lock(&c->mu);
  c->status = status ? RUMOR_ECANCELED : 0;
  c->done = true;
  pthread_cond_signal(&c->cond);
  pthread_mutex_unlock(&c->mu);
}

int gossip_on_loop(gossip_t *g, void (*fn)(uv_loop_t *loop, void *arg), void *arg) {
  struct loop_call c = {.g = g, .fn = fn, .arg = arg};
  pthread_mutex_init(&c.mu, NULL);
  pthread_cond_init(&c.cond, NULL);
  int rc = net_call(g->net, loop_call_run, &c);
  if (rc == 0) {
    pthread_mutex_lock(&c.mu);
    while (!c.done) pthread_cond_wait(&c.cond, &c.mu);
    pthread_mutex_unlock(&c.mu);
    rc = c.status;
  }
  pthread_mutex_destroy(&c.mu);
  pthread_cond_destroy(&c.cond);
  return rc;
}

/* ---- joining, seen from the training thread ---- */

int gossip_join_wait(gossip_t *g, float *state_buf, struct gossip_train_pos *pos, const atomic_int *stop,
                     struct rumor_err *e) {
  pthread_mutex_lock(&g->lock);
  g->pull_buf = state_buf;
  g->pull_wanted = g->cfg.role == GOSSIP_ROLE_PEER && state_buf != NULL;
  int rc;
  for (;;) {
    if (stop && *stop) {
      rc = rumor_err_set(e, RUMOR_ECANCELED, "interrupted while joining");
      break;
    }
    if (g->join_failed) {
      rc = rumor_err_set(e, RUMOR_EAUTH, "%s", g->join_error);
      break;
    }
    if (g->pull_done) {
      if (g->first_peer) {
        rc = 1;
      } else {
        *pos = g->pull_pos;
        rc = 0;
      }
      break;
    }
    if (g->joined && !g->pull_wanted) {
      rc = 1;
      break;
    }
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100 * 1000000;
    if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
    pthread_cond_timedwait(&g->cond, &g->lock, &ts);
  }
  pthread_mutex_unlock(&g->lock);
  return rc;
}

size_t gossip_live_partners(gossip_t *g) {
  pthread_mutex_lock(&g->lock);
  size_t n = 0;
  for (size_t i = 1; i < g->npub; i++) /* pub[0] is ourselves */
    if (strcmp(g->pub[i].role, "peer") == 0 && g->pub[i].ready && strcmp(g->pub[i].state, "alive") == 0) n++;
  pthread_mutex_unlock(&g->lock);
  return n;
}

size_t gossip_ready_peers(gossip_t *g) {
  pthread_mutex_lock(&g->lock);
  size_t peers = g->npub > 0 && g->pub[0].ready ? 1 : 0;
  for (size_t i = 1; i < g->npub; i++)
    if (strcmp(g->pub[i].role, "peer") == 0 && g->pub[i].ready) peers++;
  pthread_mutex_unlock(&g->lock);
  return peers;
}
