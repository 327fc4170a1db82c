/*
 * The gossip runtime's core: configuration, the loop thread, start and
 * stop (leaving), SWIM bound to the network, and the dispatch of every net
 * callback to the part that owns what it is about (gossip_impl.h).
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
  c->quorum_wait_ms = GOSSIP_QUORUM_WAIT_MS;
  c->sit_out_loss = GOSSIP_SIT_OUT_LOSS;
  c->max_xch_per_s = 100; /* well above an honest partner's rate, even with exchanges every step */
  c->max_conn_per_s = 5;
  c->optimizer = "";
  c->model = "";
}

uint64_t gossip_now_ms(struct gossip *g) { return uv_now(&g->loop); }

static const char *role_name(enum swim_role r) { return r == SWIM_ROLE_BOOTSTRAP ? "bootstrap" : "peer"; }

void gossip_member_label(struct gossip *g, const uint8_t *id, char *buf, size_t n) {
  char key[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(key, id);
  struct swim_member *m = swim_find(&g->swim, id);
  const char *addr = m && m->info.addr[0] ? m->info.addr : memcmp(id, g->identity.pk, NET_PUBKEY_BYTES) == 0 ? g->advertise : "?";
  snprintf(buf, n, "%s (%.8s)", addr, key);
}

/* ---- SWIM on the wire ---- */

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
  gossip_member_label(g, m->info.id, label, sizeof label);
  if (added)
    log_info("member %s %s: %s %s (incarnation %llu)", label, m->info.state == SWIM_ALIVE ? "joined" : "known",
             role_name(m->info.role), swim_state_name(m->info.state), (unsigned long long)m->info.incarnation);
  else if (old != m->info.state)
    log_info("member %s is now %s (was %s, incarnation %llu)", label, swim_state_name(m->info.state),
             swim_state_name(old), (unsigned long long)m->info.incarnation);
  else
    log_debug("member %s %s a state (incarnation %llu)", label, m->info.ready ? "holds" : "does not hold",
              (unsigned long long)m->info.incarnation);
  bool gone = m->info.state == SWIM_DEAD || m->info.state == SWIM_LEFT;
  if (gone) {
    bool left = m->info.state == SWIM_LEFT;
    gossip_join_on_member_gone(g, m->info.id, left);
    gossip_xch_on_member_lost(g, m->info.id, left ? "partner left" : "partner failed");
  } else if (m->info.state == SWIM_ALIVE && (old == SWIM_DEAD || old == SWIM_LEFT)) {
    gossip_guard_on_return(g, m->info.id);
  }
  gossip_link_on_member(g, &m->info, gone);
  gossip_publish(g);
}

/* ---- net callbacks: dispatched to the parts ---- */

static void on_accept(net_conn_t *c, void *ud) {
  struct gossip *g = ud;
  if (!gossip_guard_allow_conn(g, net_conn_peer_key(c), gossip_now_ms(g))) {
    net_conn_close(c);
    return;
  }
  gossip_link_adopt(g, net_conn_peer_key(c), c);
}

/* PING, ACK, LEAVE and PING_REQ: SWIM's. Returns false when malformed. */
static bool swim_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const uint8_t *from = net_conn_peer_key(c);
  uint64_t now = gossip_now_ms(g);
  struct swim_update u[SWIM_MAX_PIGGYBACK];
  uint64_t seq = 0;
  int n = gossip_get_updates(m, "u", u, SWIM_MAX_PIGGYBACK);
  if (n < 0 || (m->type != GMSG_LEAVE && net_msg_get_uint(m, "s", &seq))) return false;
  switch (m->type) {
  case GMSG_PING: swim_on_ping(&g->swim, from, seq, u, (size_t)n, now); return true;
  case GMSG_ACK: swim_on_ack(&g->swim, from, seq, u, (size_t)n, now); return true;
  case GMSG_LEAVE:
    for (int i = 0; i < n; i++) swim_apply(&g->swim, &u[i], now);
    return true;
  default: { /* GMSG_PING_REQ */
    const uint8_t *target;
    size_t tlen;
    if (net_msg_get_bin(m, "target", &target, &tlen) || tlen != SWIM_ID_BYTES) return false;
    swim_on_ping_req(&g->swim, from, target, seq, u, (size_t)n, now);
    return true;
  }
  }
}

/* After a cut of ours: the first member we hear from again while SWIM holds
 * quiet verdicts (swim.c, "minority") is asked for its member table, which
 * ends at once every verdict of ours it contradicts. Without it our view
 * came back one member at a time, as each one's SWIM message reached us
 * through dials left waiting out TCP's SYN backoff since the cut
 * (bench-chaos: 8 s for the last of seven, while our all-reduce ring, formed
 * in our partial view, and the others', formed with us, blocked each
 * other). At most once per second; the answer is taken only from the
 * member asked. */
#define GOSSIP_TABLE_ASK_MS 1000

static void ask_table_after_cut(struct gossip *g, net_conn_t *c) {
  uint64_t now = gossip_now_ms(g);
  if (!swim_count_quiet(&g->swim) || (g->table_asked_ms && now - g->table_asked_ms < GOSSIP_TABLE_ASK_MS)) return;
  if (gossip_send_request(c, GMSG_MEMBERS_REQ, 0)) return;
  g->table_asked_ms = now;
  memcpy(g->table_asked_of, net_conn_peer_key(c), NET_PUBKEY_BYTES);
}

static void on_table(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  /* Only an answer to our question (an all-zero key is nobody's). */
  if (memcmp(net_conn_peer_key(c), g->table_asked_of, NET_PUBKEY_BYTES) != 0) return;
  memset(g->table_asked_of, 0, NET_PUBKEY_BYTES); /* one answer per question */
  size_t before = swim_count_quiet(&g->swim);
  if (!gossip_take_table(g, c, m, "member table")) return;
  size_t after = swim_count_quiet(&g->swim);
  log_info("back from a cut: the member table of %s ends %zu of our %zu verdicts made while we saw no majority",
           net_conn_peer_name(c), before - after, before);
  gossip_publish(g);
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct gossip *g = ud;
  if (m->version != GOSSIP_PROTO_VERSION) {
    log_debug("ignoring message type %llu of version %llu from %s", (unsigned long long)m->type,
              (unsigned long long)m->version, net_conn_peer_name(c));
    return;
  }
  switch ((enum gossip_msg_type)m->type) {
  case GMSG_JOIN:
  case GMSG_JOIN_OK:
  case GMSG_JOIN_REJECT:
  case GMSG_STATE_BUSY: gossip_join_on_msg(g, c, m); return;
  case GMSG_PING:
  case GMSG_ACK:
  case GMSG_LEAVE:
  case GMSG_PING_REQ:
    if (swim_msg(g, c, m)) {
      ask_table_after_cut(g, c);
      return;
    }
    break;
  case GMSG_MEMBERS: on_table(g, c, m); return;
  case GMSG_XCH_REQ:
  case GMSG_XCH_ACCEPT:
  case GMSG_XCH_REJECT: gossip_xch_on_msg(g, c, m); return;
  case GMSG_STATE_REQ:
  case GMSG_PARAMS_REQ: gossip_donation_on_msg(g, c, m); return;
  case GMSG_MEMBERS_REQ:
  case GMSG_STATS_REQ: gossip_stats_on_msg(g, c, m); return;
  case GMSG_RING_READY:
  case GMSG_RING_AHEAD:
  case GMSG_RING_ABORT: gossip_ring_on_msg(g, c, m); return;
  case GMSG_REACH: gossip_relay_on_reach(g, c, m); return;
  default:
    log_debug("ignoring unknown message type %llu from %s", (unsigned long long)m->type, net_conn_peer_name(c));
    return;
  }
  log_warn("malformed message (type %llu) from %s; dropping the connection", (unsigned long long)m->type,
           net_conn_peer_name(c));
  net_conn_close(c);
}

/* A bulk transfer begins: its metadata says which part it is for. */
static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct gossip *g = ud;
  struct net_msg meta;
  struct rumor_err e;
  uint64_t kind, xid, step = 0, epoch = 0, samples = 0;
  *dst_arg = NULL;
  if (!info->meta || net_msg_decode(info->meta, info->meta_len, NULL, &meta, &e)) return RUMOR_EPROTO;
  int rc = RUMOR_EPROTO;
  if (net_msg_get_uint(&meta, "k", &kind) || net_msg_get_uint(&meta, "x", &xid) ||
      net_msg_get_uint(&meta, "step", &step)) {
    /* malformed */
  } else if (kind == GBULK_RING) {
    rc = gossip_ring_on_bulk_begin(g, c, info, &meta, dst, dst_arg);
  } else if (kind == GBULK_EXCHANGE) {
    rc = gossip_xch_on_bulk_begin(g, c, info, &meta, xid, step, dst);
  } else if (kind == GBULK_STATE && !net_msg_get_uint(&meta, "epoch", &epoch) &&
             !net_msg_get_uint(&meta, "samples", &samples)) {
    struct gossip_train_pos pos = {step, epoch, samples};
    rc = gossip_join_on_bulk_begin(g, c, info, &pos, dst);
  }
  net_msg_free(&meta);
  return rc;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  struct gossip *g = ud;
  if (gossip_ring_on_bulk_done(g, c, id, status, dst_arg)) return;
  if (!gossip_xch_on_bulk_done(g, c, id, status)) (void)gossip_join_on_bulk_done(g, c, id, status);
}

/* Says once when SWIM made suspicions quiet (swim.c, "minority"). */
static void note_quiet(struct gossip *g) {
  if (g->swim.quieted == g->quiet_noted) return;
  g->quiet_noted = g->swim.quieted;
  log_warn("we see no majority of the cluster alive (cut off?): our suspicions of %zu members are told to no one",
           swim_count_quiet(&g->swim));
}

/* A connection cut (a reset, EOF without BYE: the process died) or judged
 * dead by the heartbeat is evidence against its member: SWIM suspects it at
 * once (and tells everyone), so that the ring re-forms without it in a
 * second rather than after the suspicion SWIM's own probes would raise.
 * Not with the heartbeat off (SWIM's verdicts alone, as before it), not
 * while we stop, and not right after a stall of our own: those cuts are the
 * others' verdicts on us. */
static void suspect_on_close(struct gossip *g, net_conn_t *c, int status, const char *detail) {
  bool cut = status == -ECONNRESET || status == -EPIPE || net_conn_judged_dead(c);
  uint64_t now = gossip_now_ms(g);
  if (!cut || !g->cfg.net.heartbeat_ms || g->stopping || !gossip_joined(g) || now < g->stalled_until_ms) return;
  const uint8_t *id = net_conn_peer_key(c);
  /* Only the member's link counts: a connection retired beside it (links.c:
   * a relayed one the member left for a direct one) may fall silent while
   * the member answers on its link. */
  const struct gossip_link *l = gossip_link_get(g, id, false);
  if (!l || l->conn != c) return;
  if (!swim_suspect(&g->swim, id, now)) return;
  char label[200];
  gossip_member_label(g, id, label, sizeof label);
  log_info("member %s is suspected at once: its connection %s (%s)", label,
           net_conn_judged_dead(c) ? "fell silent" : "was cut", detail);
  note_quiet(g);
  gossip_publish(g);
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct gossip *g = ud;
  suspect_on_close(g, c, status, detail);
  const uint8_t *id = gossip_link_forget(g, c);
  gossip_xch_on_close(g, c, id);
  /* Cut by an error (a reset, EOF from a dead process): an exchange with
   * that member, pending on no bulk connection yet, is abandoned now rather
   * than at the failure verdict. */
  if (id && status != 0) gossip_xch_on_member_lost(g, id, "connection to the partner lost");
  gossip_ring_on_close(g, c);
  gossip_join_on_close(g, c, status);
  gossip_donation_on_close(g, c);
  gossip_stats_on_close(g, c);
}

void gossip_on_link_lost(struct gossip *g, const uint8_t *id, const char *why) {
  gossip_xch_on_link_lost(g, id, why);
  gossip_join_on_link_lost(g, id, why);
}

const char *gossip_advertised(const gossip_t *g) { return g->advertise; }
const char *gossip_self_id(const gossip_t *g) { return g->self_id_text; }

/* ---- the training thread says it holds a state ---- */

static void ready_on_loop(net_t *n, void *arg, int status) {
  struct gossip *g = arg;
  if (status) return;
  swim_set_ready(&g->swim, true, false);
  gossip_publish(g);
}

void gossip_ready(gossip_t *g) {
  atomic_store(&g->ready, true);
  if (net_call(g->net, ready_on_loop, g) != 0) log_warn("cannot announce that we are ready");
}

struct away_req {
  struct gossip *g;
  bool away;
};

static void away_on_loop(net_t *n, void *arg, int status) {
  struct away_req *r = arg;
  if (status == 0) {
    r->g->ring.path_conn = NULL; /* our link is judged afresh, on rounds after our return */
    swim_set_ready(&r->g->swim, !r->away, true);
    gossip_publish(r->g);
  }
  free(r);
}

void gossip_ring_away(gossip_t *g, bool away) {
  struct away_req *r = xmalloc(sizeof *r);
  *r = (struct away_req){g, away};
  if (net_call(g->net, away_on_loop, r) != 0) {
    free(r);
    log_warn("cannot tell the ring that we %s", away ? "leave it for a while" : "are back");
  }
}

static void finished_on_loop(net_t *n, void *arg, int status) {
  if (status == 0) gossip_publish(arg); /* the view now marks the partners known to have finished */
}

void gossip_finished(gossip_t *g) {
  atomic_store(&g->finished, true);
  if (net_call(g->net, finished_on_loop, g) != 0) log_debug("cannot republish the member view");
}

/* ---- the loop thread ---- */

/* The tick came `gap` ms after the last one. A gap the others' heartbeat
 * verdicts may have seen (a stopped process, a blocked or starved loop: half
 * their limit or more, since our last PING may have left up to an interval
 * before it began) means they may hold us suspect: say at once that we are
 * alive, and for a while take the cuts that follow for their verdicts on us,
 * not as evidence against them. */
static void check_stall(struct gossip *g, uint64_t now) {
  const struct net_config *nc = &g->cfg.net;
  uint64_t gap = now - g->last_tick_ms;
  g->last_tick_ms = now;
  if (!nc->heartbeat_ms || gap < nc->dead_after_ms / 2) return;
  g->stalled_until_ms = now + nc->dead_after_ms;
  if (g->stopping || !gossip_joined(g)) return;
  log_msg(gap >= nc->dead_after_ms ? LOG_INFO : LOG_DEBUG,
          "our loop stalled for %llu ms (stopped, or starved of CPU): telling every member that we are alive",
          (unsigned long long)gap);
  swim_announce(&g->swim);
}

static void on_tick(uv_timer_t *t) {
  struct gossip *g = t->data;
  uint64_t now = gossip_now_ms(g);
  check_stall(g, now);
  if (!g->stopping) {
    gossip_relay_tick(g, now);
    gossip_join_tick(g, now);
    if (gossip_joined(g)) swim_tick(&g->swim, now);
    note_quiet(g);
  }
  gossip_links_tick(g, now);
  gossip_xch_tick(g, now);
  gossip_ring_tick(g, now);
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

/* ---- start ---- */

/* The address to advertise: --advertise, which others must be able to dial
 * (gossip_advertise_check), else the listen host with the bound port. A
 * wildcard listen address cannot be dialed by others. */
static int make_advertise(struct gossip *g, const char *listen, struct rumor_err *e) {
  if (g->cfg.advertise && *g->cfg.advertise) {
    if (gossip_advertise_check(g->cfg.advertise, e)) return rumor_err_prefix(e, "--advertise");
    snprintf(g->advertise, sizeof g->advertise, "%s", g->cfg.advertise);
    return 0;
  }
  char host[NET_HOST_MAX], addr[NET_HOST_MAX + 8];
  int port;
  int rc = gossip_listen_advertisable(listen, e);
  if (rc || (rc = net_addr_parse(listen, 0, host, sizeof host, &port, e))) return rc;
  /* The bound port, with the host written back the way net_addr_parse takes it. */
  snprintf(addr, sizeof addr, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, net_listen_port(g->net));
  if (strlen(addr) >= sizeof g->advertise || gossip_advertise_check(addr, NULL))
    return rumor_err_set(e, RUMOR_EFORMAT, "--listen %s: the host is too long to advertise; add --advertise HOST:PORT",
                         listen);
  memcpy(g->advertise, addr, strlen(addr) + 1); /* fits: checked above */
  return 0;
}

static void free_gossip(struct gossip *g) {
#ifdef RUMOR_TESTING
  gossip_testing_free(g);
#endif
  gossip_links_free(g);
  gossip_guard_free(g);
  gossip_join_free(g);
  gossip_donation_free(g);
  gossip_ring_free(g);
  gossip_monitoring_free(g);
  swim_free(&g->swim);
  net_identity_wipe(&g->identity);
  sodium_memzero(g->cluster_key, sizeof g->cluster_key);
  pthread_mutex_destroy(&g->lock);
  pthread_cond_destroy(&g->cond);
  free(g);
}

static void on_closed_handle(uv_handle_t *h) {}

/* The configuration, copied, and the parts that need no loop. */
static struct gossip *make_gossip(const struct gossip_config *cfg, struct rumor_err *e) {
  struct gossip *g = xcalloc(1, sizeof *g);
  g->cfg = *cfg;
  g->identity = *cfg->identity;
  memcpy(g->cluster_key, cfg->cluster_key, NET_CLUSTER_KEY_BYTES);
  g->cfg.identity = &g->identity;
  g->cfg.cluster_key = g->cluster_key;
  snprintf(g->model, sizeof g->model, "%s", cfg->model ? cfg->model : "");
  snprintf(g->scheme, sizeof g->scheme, "%s",
           cfg->scheme ? cfg->scheme : cfg->sync == GOSSIP_SYNC_ALLREDUCE ? "allreduce" : "gossip");
  snprintf(g->optimizer, sizeof g->optimizer, "%s", cfg->optimizer ? cfg->optimizer : "");
  g->cfg.model = g->model;
  g->cfg.optimizer = g->optimizer;
  if (cfg->net_cpus) {
    g->net_cpus = *cfg->net_cpus;
    g->cfg.net_cpus = &g->net_cpus;
  }
  g->cfg.listen = NULL; /* only used during the start */
  g->cfg.bootstrap = NULL;
  g->cfg.allow = NULL;
  g->xch.mine = cfg->xch_mine;
  g->xch.theirs = cfg->xch_theirs;
  g->xch.alpha = cfg->alpha;
  net_pubkey_format(g->self_id_text, g->identity.pk);
  pthread_mutex_init(&g->lock, NULL);
  pthread_cond_init(&g->cond, NULL);
  rng_seed(&g->rng, cfg->seed ^ clock_now_ns(), 0x474f53ull);
  int rc = 0;
  if (cfg->role == GOSSIP_ROLE_PEER && (!cfg->xch_mine || !cfg->xch_theirs || !cfg->donor_buf || !cfg->nparams))
    rc = rumor_err_set(e, -EINVAL, "a gossip peer needs its parameter count and host buffers");
  if (rc == 0) rc = gossip_monitoring_init(g, e);
  if (rc == 0) gossip_donation_init(g);
  if (rc == 0) rc = gossip_ring_init(g, e);
#ifdef RUMOR_TESTING
  if (rc == 0) rc = gossip_testing_start(g, e);
#endif
  if (rc) {
    free_gossip(g);
    return NULL;
  }
  return g;
}

/* SWIM with ourselves as its first member. */
static void start_swim(struct gossip *g) {
  struct swim_config sc;
  swim_config_default(&sc);
  sc.period_ms = g->cfg.period_ms;
  sc.ping_timeout_ms = g->cfg.ping_timeout_ms;
  sc.suspect_timeout_ms = g->cfg.suspect_timeout_ms;
  sc.reconnect_ms = 5 * g->cfg.period_ms; /* heals partitions longer than the suspicion time */
  const struct swim_io io = {g, swim_send_ping, swim_send_ack, swim_send_ping_req, swim_changed};
  struct swim_update self = {.role = g->cfg.role == GOSSIP_ROLE_BOOTSTRAP ? SWIM_ROLE_BOOTSTRAP : SWIM_ROLE_PEER,
                             .state = SWIM_ALIVE,
                             /* Wall-clock milliseconds: a restarted member outranks its old self. */
                             .incarnation = (uint64_t)clock_wall_ms()};
  memcpy(self.id, g->identity.pk, SWIM_ID_BYTES);
  snprintf(self.addr, sizeof self.addr, "%s", g->advertise);
  self.relay = g->cfg.relay;
  uv_update_time(&g->loop);
  swim_init(&g->swim, &sc, &io, &self, g->cfg.seed + 17, gossip_now_ms(g));
}

int gossip_start(gossip_t **out, const struct gossip_config *cfg, struct rumor_err *e) {
  *out = NULL;
  struct gossip *g = make_gossip(cfg, e);
  if (!g) return e->code;
  int rc = uv_loop_init(&g->loop);
  if (rc) {
    free_gossip(g);
    return rumor_err_set(e, rc, "uv_loop_init: %s", uv_strerror(rc));
  }
  struct net_config nc = cfg->net;
  nc.relay = cfg->relay;
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
  g->link_retire_ms = GOSSIP_LINK_RETIRE_MS;
  /* Every address is checked before anything is dialed: --advertise by
   * make_advertise, --bootstrap by gossip_join_init (gossip_split_addrs);
   * the commands check them all before they start. */
  if (!cfg->no_inbound && (rc = net_listen(g->net, cfg->listen, e))) {
    rumor_err_prefix(e, "--listen");
    goto fail_net;
  }
  g->relay.needed = cfg->no_inbound;
  /* Until a relay takes us, our address is "@" alone: no one can dial us
   * yet, and we join and dial out meanwhile. */
  if (cfg->no_inbound) snprintf(g->advertise, sizeof g->advertise, "%c", NET_RELAY_ADDR_PREFIX);
  if ((rc = cfg->no_inbound ? 0 : make_advertise(g, cfg->listen, e)) || (rc = gossip_join_init(g, cfg->bootstrap, e)) ||
      (rc = gossip_metrics_start(g, e)))
    goto fail_net;
  start_swim(g);
  gossip_publish(g);
  g->last_tick_ms = gossip_now_ms(g);
  uv_timer_init(&g->loop, &g->tick);
  g->tick.data = g;
  uv_timer_start(&g->tick, on_tick, GOSSIP_TICK_MS, GOSSIP_TICK_MS);
  if ((rc = uv_thread_create(&g->thread, loop_main, g))) {
    rumor_err_set(e, rc, "cannot start the network thread: %s", uv_strerror(rc));
    uv_close((uv_handle_t *)&g->tick, on_closed_handle);
    goto fail_net;
  }
  log_info("%s %s as %.12s... (%s%s)", cfg->no_inbound ? "reached through a relay, not" : "listening on",
           cfg->no_inbound ? "listening" : g->advertise, g->self_id_text,
           g->cfg.role == GOSSIP_ROLE_BOOTSTRAP ? "bootstrap" : "peer", cfg->relay ? ", relay" : "");
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
  gossip_xch_abandon(g, "shutting down");
  gossip_ring_abandon(g, "shutting down");
  uint64_t now = gossip_now_ms(g);
  if (gossip_joined(g)) {
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
  gossip_join_wake(g);
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

