/*
 * Joining: dialing the bootstrap list, JOIN and its answers (both sides),
 * and a newcomer's state pull. A newcomer sends STATE_REQ to a random live
 * peer; the donor (one newcomer at a time, donation.c) answers with its
 * whole state as a bulk transfer or STATE_BUSY, and the newcomer tries
 * another donor after a backoff.
 *
 * Loop thread, except gossip_join_wait and gossip_join_wake.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "gossip/gossip_impl.h"

static bool same_id(const uint8_t *a, const uint8_t *b) { return memcmp(a, b, NET_PUBKEY_BYTES) == 0; }

int gossip_join_init(struct gossip *g, const char *bootstrap, struct rumor_err *e) {
  struct gossip_join *j = &g->join;
  int rc = gossip_split_addrs(bootstrap, j->boot, GOSSIP_MAX_BOOTSTRAP, &j->nboot, e);
  if (rc) return rc;
  j->started_ms = gossip_now_ms(g);
  j->joined = j->nboot == 0;
  return 0;
}

void gossip_join_free(struct gossip *g) {
  for (size_t i = 0; i < g->join.nboot; i++) free(g->join.boot[i]);
  free(g->join.behind);
  memset(&g->join, 0, sizeof g->join);
}

bool gossip_joined(struct gossip *g) { return g->join.joined; }

bool gossip_join_pulling(struct gossip *g) {
  pthread_mutex_lock(&g->lock);
  bool pulling = g->join.later && g->join.pull_wanted && !g->join.pull_done;
  pthread_mutex_unlock(&g->lock);
  return pulling;
}

void gossip_join_wake(struct gossip *g) {
  pthread_mutex_lock(&g->lock);
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

/* Joining failed for good: the training thread's wait ends with `why`. */
static void join_fail(struct gossip *g) {
  pthread_mutex_lock(&g->lock);
  g->join.failed = true;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
  log_error("%s", g->join.error);
}

static void join_fail_message(struct gossip *g) {
  struct gossip_join *j = &g->join;
  size_t n = (size_t)snprintf(j->error, sizeof j->error,
                              "could not join the cluster through any bootstrap address within %u ms:",
                              g->cfg.join_timeout_ms);
  for (size_t i = 0; i < j->nboot && n < sizeof j->error; i++)
    n += (size_t)snprintf(j->error + n, sizeof j->error - n, "%s %s (%s)", i ? ";" : "", j->boot[i],
                          j->boot_err[i][0] ? j->boot_err[i] : "no answer");
}

/* ---- the newcomer's side ---- */

static void send_join(struct gossip *g, net_conn_t *c) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_JOIN, GOSSIP_PROTO_VERSION);
  /* The address we advertise now: the relay's once we go through one. */
  net_msgbuf_put_str(&b, "addr", g->swim.self.addr, strlen(g->swim.self.addr));
  net_msgbuf_put_uint(&b, "role", (uint64_t)g->cfg.role);
  net_msgbuf_put_uint(&b, "inc", g->swim.self.incarnation);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  net_msgbuf_put_uint(&b, "nparams", g->cfg.nparams);
  if (g->cfg.relay) net_msgbuf_put_bool(&b, "relay", true); /* optional: we relay (--relay) */
  int rc = net_conn_send_msg(c, &b);
  if (rc) log_warn("cannot send JOIN to %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
  net_msgbuf_free(&b);
}

static void on_join_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct gossip *g = arg;
  struct gossip_join *j = &g->join;
  size_t i = j->boot_next;
  j->dialing = false;
  if (j->joined || g->stopping) {
    if (c) net_conn_close(c);
    return;
  }
  if (status < 0) {
    snprintf(j->boot_err[i], sizeof j->boot_err[i], "%s", detail ? detail : rumor_strerror(status));
    log_warn("bootstrap %s: %s", j->boot[i], j->boot_err[i]);
    j->boot_next = (i + 1) % j->nboot;
    if (j->boot_next == 0) {
      /* A whole pass failed: back off before the next (0.5 s doubling to 5 s). */
      j->rounds++;
      uint64_t backoff = 250ull << (j->rounds < 5 ? j->rounds : 5);
      j->retry_ms = gossip_now_ms(g) + (backoff > 5000 ? 5000 : backoff);
    }
    return;
  }
  gossip_link_adopt(g, net_conn_peer_key(c), c);
  snprintf(j->boot_err[i], sizeof j->boot_err[i], "connected, but no JOIN reply");
  j->boot_next = (i + 1) % j->nboot; /* if no reply comes, the retry tries the next one */
  send_join(g, c);
}

static void join_dial_tick(struct gossip *g, uint64_t now) {
  struct gossip_join *j = &g->join;
  if (j->joined || j->failed || j->dialing || j->nboot == 0) return;
  if (now - j->started_ms >= g->cfg.join_timeout_ms && g->cfg.role == GOSSIP_ROLE_BOOTSTRAP) {
    /* A bootstrap node whose list is all down (say, the others restart too)
     * is what newcomers dial: it starts as the first member rather than
     * serve forever as "not ready". Members that join later merge in. */
    join_fail_message(g);
    log_warn("%s; starting as the first member", j->error);
    pthread_mutex_lock(&g->lock);
    j->joined = true;
    pthread_cond_broadcast(&g->cond);
    pthread_mutex_unlock(&g->lock);
    gossip_publish(g);
    return;
  }
  if (now - j->started_ms >= g->cfg.join_timeout_ms) {
    pthread_mutex_lock(&g->lock);
    join_fail_message(g);
    pthread_mutex_unlock(&g->lock);
    join_fail(g);
    return;
  }
  if (now < j->retry_ms) return;
  /* A reply overdue from a connected bootstrap counts as a failure. */
  int rc = net_dial(g->net, j->boot[j->boot_next], on_join_dial, g);
  if (rc) {
    snprintf(j->boot_err[j->boot_next], sizeof j->boot_err[j->boot_next], "%s", rumor_strerror(rc));
    j->boot_next = (j->boot_next + 1) % j->nboot;
    j->retry_ms = now + 250;
    return;
  }
  j->dialing = true;
  j->retry_ms = now + g->cfg.period_ms * 5; /* JOIN reply deadline before the next address */
}

bool gossip_take_table(struct gossip *g, net_conn_t *c, const struct net_msg *m, const char *what) {
  size_t cap = SWIM_MAX_MEMBERS + 1;
  struct swim_update *tab = xmalloc(cap * sizeof *tab);
  int n = gossip_get_updates(m, "u", tab, cap);
  if (n < 0) {
    log_warn("malformed %s from %s; dropping the connection", what, net_conn_peer_name(c));
    free(tab);
    net_conn_close(c);
    return false;
  }
  uint64_t now = gossip_now_ms(g);
  for (int i = 0; i < n; i++) swim_apply(&g->swim, &tab[i], now);
  free(tab);
  return true;
}

static void handle_join_ok(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  struct gossip_join *j = &g->join;
  if (j->joined || !gossip_take_table(g, c, m, "JOIN reply")) return;
  pthread_mutex_lock(&g->lock);
  j->joined = true;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
  size_t peers = swim_count_live(&g->swim, SWIM_ROLE_PEER);
  log_info("joined through %s: %zu members known, %zu other peer%s", net_conn_peer_addr(c), g->swim.nmembers, peers,
           peers == 1 ? "" : "s");
  gossip_publish(g);
}

static void handle_join_reject(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const char *why;
  size_t n;
  if (net_msg_get_str(m, "why", &why, &n)) why = "no reason given", n = strlen(why);
  pthread_mutex_lock(&g->lock);
  snprintf(g->join.error, sizeof g->join.error, "%s refused to let us join: %.*s", net_conn_peer_addr(c), (int)n, why);
  pthread_mutex_unlock(&g->lock);
  join_fail(g);
}

/* ---- a member's side: answering a newcomer's JOIN ---- */

static void send_join_reject(net_conn_t *c, const char *why) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_JOIN_REJECT, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  if (net_conn_send_msg(c, &b)) log_debug("cannot send JOIN_REJECT to %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

static void handle_join(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const char *addr, *model;
  size_t alen, mlen;
  uint64_t role, inc, nparams;
  if (net_msg_get_str(m, "addr", &addr, &alen) || alen == 0 || alen >= SWIM_ADDR_MAX || !gossip_printable(addr, alen) ||
      net_msg_get_uint(m, "role", &role) || role > SWIM_ROLE_BOOTSTRAP || net_msg_get_uint(m, "inc", &inc) ||
      net_msg_get_str(m, "model", &model, &mlen) || mlen >= sizeof g->model || net_msg_get_uint(m, "nparams", &nparams)) {
    log_warn("malformed JOIN from %s; dropping the connection", net_conn_peer_name(c));
    net_conn_close(c);
    return;
  }
  char their_model[256];
  memcpy(their_model, model, mlen);
  their_model[mlen] = '\0';
  if (role == SWIM_ROLE_PEER) {
    /* The cluster's model: ours (a peer), or the first one a bootstrap saw. */
    if (!g->model[0] && g->cfg.role == GOSSIP_ROLE_BOOTSTRAP) snprintf(g->model, sizeof g->model, "%s", their_model);
    if (strcmp(their_model, g->model) != 0) {
      char why[600];
      snprintf(why, sizeof why, "model mismatch: this cluster trains %s, the joiner has %s", g->model, their_model);
      log_warn("refused JOIN from %s: %s", net_conn_peer_name(c), why);
      send_join_reject(c, why);
      return;
    }
  }
  bool relay = false;
  if (net_msg_get_bool(m, "relay", &relay) == RUMOR_EPROTO) relay = false;
  struct swim_update u = {.role = (enum swim_role)role, .state = SWIM_ALIVE, .incarnation = inc, .relay = relay};
  memcpy(u.id, net_conn_peer_key(c), SWIM_ID_BYTES);
  memcpy(u.addr, addr, alen);
  swim_apply(&g->swim, &u, gossip_now_ms(g));
  gossip_link_adopt(g, u.id, c);
  gossip_link_on_member(g, &u, false);

  size_t cap = g->swim.nmembers + 1;
  struct swim_update *tab = xmalloc(cap * sizeof *tab);
  size_t n = swim_snapshot(&g->swim, tab, cap);
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_JOIN_OK, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  gossip_put_updates(&b, tab, n);
  int rc = net_conn_send_msg(c, &b);
  if (rc) log_warn("cannot answer JOIN from %s: %s", net_conn_peer_name(c), rumor_strerror(rc));
  net_msgbuf_free(&b);
  free(tab);
  if (rc == 0) gossip_relay_dial_back(g, u.id, u.addr);
}

/* ---- the state pull ---- */

/* The pull's outcome, which the training thread waits for. */
static void set_pull_result(struct gossip *g, bool first) {
  pthread_mutex_lock(&g->lock);
  g->join.first_peer = first;
  g->join.pull_done = true;
  pthread_cond_broadcast(&g->cond);
  pthread_mutex_unlock(&g->lock);
}

/* The donor asked said it is before our pull's min_step: counted once,
 * however often it is asked. */
static void note_behind(struct gossip_join *j) {
  for (size_t k = 0; k < j->nbehind; k++)
    if (same_id(j->behind[k], j->donor)) return;
  if (j->nbehind == j->behind_cap) {
    j->behind_cap = j->behind_cap ? 2 * j->behind_cap : 8;
    j->behind = xrealloc(j->behind, j->behind_cap * sizeof *j->behind);
  }
  memcpy(j->behind[j->nbehind++], j->donor, NET_PUBKEY_BYTES);
}

static void handle_state_busy(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  struct gossip_join *j = &g->join;
  if (!j->pulling || !same_id(net_conn_peer_key(c), j->donor)) return;
  const char *why;
  size_t n;
  bool fatal = false;
  if (net_msg_get_str(m, "why", &why, &n)) why = "?", n = 1;
  if (net_msg_get_bool(m, "fatal", &fatal)) fatal = false;
  j->pulling = false;
  bool behind = false;
  if (net_msg_get_bool(m, "behind", &behind)) behind = false; /* optional */
  if (behind && j->min_step) {
    /* Not busy: only not as far as we need. Another donor at once; pull_tick
     * ends the pull when none is left. */
    note_behind(j);
    gossip_back_off(g, j->donor, gossip_now_ms(g) + 1000);
    j->pull_retry_ms = gossip_now_ms(g);
    log_debug("donor %s is before ring position %llu (%.*s)", net_conn_peer_name(c), (unsigned long long)j->min_step,
              (int)n, why);
    return;
  }
  if (fatal) {
    pthread_mutex_lock(&g->lock);
    snprintf(j->error, sizeof j->error, "cannot take a state from this cluster: %s: %.*s", net_conn_peer_addr(c),
             (int)n, why);
    pthread_mutex_unlock(&g->lock);
    join_fail(g);
    return;
  }
  j->pull_attempts++;
  uint64_t now = gossip_now_ms(g);
  uint64_t backoff = 50ull << (j->pull_attempts < 5 ? j->pull_attempts : 5);
  j->pull_retry_ms = now + backoff + rng_below(&g->rng, 100);
  gossip_back_off(g, j->donor, now + 500); /* prefer another donor next */
  log_debug("donor %s busy (%.*s); retrying", net_conn_peer_name(c), (int)n, why);
}

/* No peer holds a state yet: the cluster is forming. The smallest key among
 * the live peers starts from its own initialisation (the same seed gives the
 * same weights anyway); the others pull from it once it is ready. True when
 * that is us. */
static bool first_of_the_cluster(struct gossip *g) {
  bool any_ready = false, smallest = true;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || m->info.state != SWIM_ALIVE) continue;
    any_ready |= m->info.ready;
    if (memcmp(m->info.id, g->identity.pk, NET_PUBKEY_BYTES) < 0) smallest = false;
  }
  return !any_ready && smallest;
}

static void pull_tick(struct gossip *g, uint64_t now) {
  struct gossip_join *j = &g->join;
  pthread_mutex_lock(&g->lock);
  bool wanted = j->pull_wanted && !j->pull_done && !j->failed;
  pthread_mutex_unlock(&g->lock);
  if (!wanted || !j->joined) return;
  if (j->pulling) {
    if (now < j->pull_retry_ms) return;
    log_warn("the donor did not deliver its state in time; trying another peer");
    gossip_back_off(g, j->donor, now + 5000);
    if (j->pull_conn) (void)net_conn_cancel_recv(j->pull_conn, j->pull_recv_id);
    j->pulling = false;
    j->pull_conn = NULL;
    j->pull_retry_ms = now;
  }
  if (now < j->pull_retry_ms) return;
  if (swim_count_live(&g->swim, SWIM_ROLE_PEER) == 0) {
    /* A pull for a later step (a ring member rejoining) asks whether anyone
     * is ahead: its caller tells what it found. */
    if (!j->min_step)
      log_info("no other peer in the cluster: %s",
               j->later ? "keeping our own state" : "starting from our own initialisation");
    set_pull_result(g, true);
    return;
  }
  if (j->min_step &&
      (j->nbehind >= GOSSIP_PULL_BEHIND_ENOUGH || gossip_count_donors(g, j->behind, j->nbehind) == 0)) {
    log_debug("no member is at ring position %llu or later: keeping our own state", (unsigned long long)j->min_step);
    set_pull_result(g, true);
    return;
  }
  if (j->optional && now - j->started_ms > GOSSIP_PULL_OPTIONAL_MS) {
    log_info("no member gave a state past ring position %llu within %u ms: keeping our own state",
             (unsigned long long)j->min_step, GOSSIP_PULL_OPTIONAL_MS);
    set_pull_result(g, true);
    return;
  }
  if (now - j->started_ms > (uint64_t)g->cfg.join_timeout_ms * 2) {
    pthread_mutex_lock(&g->lock);
    snprintf(j->error, sizeof j->error, "joined, but no peer donated its state within %u ms", g->cfg.join_timeout_ms * 2);
    pthread_mutex_unlock(&g->lock);
    join_fail(g);
    return;
  }
  uint8_t donor[NET_PUBKEY_BYTES];
  const struct swim_member *pm = j->have_prefer ? swim_find(&g->swim, j->prefer) : NULL;
  j->have_prefer = false; /* asked first, once */
  if (pm && pm->info.state == SWIM_ALIVE && pm->info.ready && !gossip_backed_off(g, pm->info.id, now)) {
    memcpy(donor, pm->info.id, sizeof donor);
  } else if (!gossip_pick_peer(g, donor, NULL, true)) {
    if (first_of_the_cluster(g)) {
      log_info("no peer holds a state yet and ours is the smallest key: %s",
               j->later ? "keeping our own state" : "starting from our own initialisation");
      set_pull_result(g, true);
      return;
    }
    j->pull_retry_ms = now + 100; /* a donor is backed off, or the first peer is not ready yet */
    return;
  }
  memcpy(j->donor, donor, sizeof donor);
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_STATE_REQ, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
  net_msgbuf_put_uint(&b, "n", g->cfg.nparams);
  net_msgbuf_put_uint(&b, "sf", g->cfg.state_floats);
  net_msgbuf_put_str(&b, "opt", g->optimizer, strlen(g->optimizer));
  if (j->min_step) net_msgbuf_put_uint(&b, "min", j->min_step);
  bool queued = !gossip_link_open(g, donor);
  int rc = gossip_send(g, donor, &b);
  net_msgbuf_free(&b);
  if (rc) {
    j->pull_retry_ms = now + 200;
    return;
  }
  j->pulling = true;
  j->req_queued = queued;
  j->pull_retry_ms = now + g->cfg.exchange_timeout_ms; /* deadline for this donor */
}

int gossip_join_on_bulk_begin(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info,
                              const struct gossip_train_pos *pos, float **dst) {
  struct gossip_join *j = &g->join;
  if (!j->pulling || !same_id(net_conn_peer_key(c), j->donor) || info->count != g->cfg.state_floats || !j->pull_buf)
    return -ECONNREFUSED;
  j->pull_recv_id = info->id;
  j->pull_conn = c;
  j->pull_pos = *pos;
  j->pull_begin_ns = clock_now_ns();
  *dst = j->pull_buf;
  return 0;
}

bool gossip_join_on_bulk_done(struct gossip *g, net_conn_t *c, uint64_t id, int status) {
  struct gossip_join *j = &g->join;
  if (!j->pulling || c != j->pull_conn || id != j->pull_recv_id) return false;
  j->pulling = false;
  j->pull_conn = NULL;
  char who[200];
  gossip_member_label(g, j->donor, who, sizeof who);
  if (status == 0) {
    /* The figure tests/bench/bench-join.sh reads: from BEGIN to the checked END. */
    double s = (double)(clock_now_ns() - j->pull_begin_ns) / 1e9, mb = (double)g->cfg.state_floats * 4 / 1e6;
    log_info("received the state of %s (step %llu, epoch %llu): %.1f MB in %.3f s, %.2f GB/s", who,
             (unsigned long long)j->pull_pos.step, (unsigned long long)j->pull_pos.epoch, mb, s,
             s > 0 ? mb / 1e3 / s : 0.0);
    set_pull_result(g, false);
  } else {
    log_warn("state transfer from %s failed: %s; trying another peer", who, rumor_strerror(status));
    j->pull_retry_ms = gossip_now_ms(g) + 200;
  }
  return true;
}

void gossip_join_on_close(struct gossip *g, net_conn_t *c, int status) {
  struct gossip_join *j = &g->join;
  if (!j->pulling) return;
  if (j->pull_conn == c) {
    j->pulling = false;
    j->pull_conn = NULL;
    j->pull_retry_ms = gossip_now_ms(g) + 200;
  } else if (!j->pull_conn && status != 0 && same_id(net_conn_peer_key(c), j->donor)) {
    /* The request, or the donor's answer, went with the connection: waiting
     * for the donor's deadline (the exchange timeout) would leave us
     * without a state for a minute. */
    char who[200];
    gossip_member_label(g, j->donor, who, sizeof who);
    log_info("the connection to our donor %s was lost before its state began (%s); asking another peer", who,
             rumor_strerror(status));
    gossip_back_off(g, j->donor, gossip_now_ms(g) + 5000);
    j->pulling = false;
    j->pull_retry_ms = gossip_now_ms(g);
  }
}

void gossip_join_on_member_gone(struct gossip *g, const uint8_t *id, bool left) {
  struct gossip_join *j = &g->join;
  if (!j->pulling || !same_id(j->donor, id)) return;
  log_info("our donor %s; asking another peer", left ? "left" : "failed");
  if (j->pull_conn) (void)net_conn_cancel_recv(j->pull_conn, j->pull_recv_id);
  j->pulling = false;
  j->pull_conn = NULL;
  j->pull_retry_ms = gossip_now_ms(g);
}

void gossip_join_on_link_lost(struct gossip *g, const uint8_t *id, const char *why) {
  struct gossip_join *j = &g->join;
  if (!j->pulling || !j->req_queued || j->pull_conn || !same_id(j->donor, id)) return;
  /* Before, the pull waited for the donor's deadline (the exchange
   * timeout, a minute): a newcomer that dialed a donor at the address it
   * had before it moved to a relay sat out that minute. */
  char who[200];
  gossip_member_label(g, id, who, sizeof who);
  log_info("our state request to %s was lost (%s); asking again", who, why);
  j->pulling = false;
  j->pull_retry_ms = gossip_now_ms(g) + 200;
}

/* ---- the loop's entry points ---- */

void gossip_join_tick(struct gossip *g, uint64_t now) {
  join_dial_tick(g, now);
  pull_tick(g, now);
}

void gossip_join_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  switch (m->type) {
  case GMSG_JOIN: handle_join(g, c, m); return;
  case GMSG_JOIN_OK: handle_join_ok(g, c, m); return;
  case GMSG_JOIN_REJECT: handle_join_reject(g, c, m); return;
  case GMSG_STATE_BUSY: handle_state_busy(g, c, m); return;
  default: return;
  }
}

/* ---- the training thread's wait ---- */

/* Waits, under g->lock, for the pull (or, without one and unless
 * `must_pull`, the join) to end. */
static int pull_wait(gossip_t *g, bool must_pull, struct gossip_train_pos *pos, const atomic_int *stop,
                     struct rumor_err *e) {
  struct gossip_join *j = &g->join;
  for (;;) {
    if (stop && *stop) return rumor_err_set(e, RUMOR_ECANCELED, "interrupted while joining");
    if (j->failed) return rumor_err_set(e, RUMOR_EAUTH, "%s", j->error);
    if (j->pull_done) {
      if (j->first_peer) return 1;
      *pos = j->pull_pos;
      return 0;
    }
    if (j->joined && !j->pull_wanted && !must_pull) return 1;
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_nsec += 100 * 1000000;
    if (ts.tv_nsec >= 1000000000) ts.tv_sec++, ts.tv_nsec -= 1000000000;
    pthread_cond_timedwait(&g->cond, &g->lock, &ts);
  }
}

int gossip_join_wait(gossip_t *g, float *state_buf, struct gossip_train_pos *pos, const atomic_int *stop,
                     struct rumor_err *e) {
  struct gossip_join *j = &g->join;
  pthread_mutex_lock(&g->lock);
  j->pull_buf = state_buf;
  j->pull_wanted = g->cfg.role == GOSSIP_ROLE_PEER && state_buf != NULL;
  int rc = pull_wait(g, false, pos, stop, e);
  pthread_mutex_unlock(&g->lock);
  return rc;
}

struct pull_req {
  struct gossip *g;
  float *buf;
  uint8_t from[NET_PUBKEY_BYTES];
  bool have_from, optional;
  uint64_t min_step;
};

static void pull_on_loop(net_t *n, void *arg, int status) {
  struct pull_req *r = arg;
  struct gossip *g = r->g;
  struct gossip_join *j = &g->join;
  if (status == 0) {
    memcpy(j->prefer, r->from, NET_PUBKEY_BYTES);
    j->have_prefer = r->have_from;
    j->min_step = r->min_step;
    j->optional = r->optional;
    j->nbehind = 0; /* a new pull: every member may be ahead again */
    j->later = true;
    j->started_ms = gossip_now_ms(g); /* the donor deadline counts from now */
    j->pull_attempts = 0;
    j->pull_retry_ms = 0;
    pthread_mutex_lock(&g->lock);
    j->pull_buf = r->buf;
    j->pull_done = j->first_peer = false;
    j->pull_wanted = true;
    pthread_mutex_unlock(&g->lock);
  }
  free(r);
}

struct refusal {
  struct gossip *g;
  char why[160];
};

static void refuse_on_loop(net_t *n, void *arg, int status) {
  struct refusal *r = arg;
  if (status == 0) gossip_strike(r->g, r->g->join.donor, r->why, gossip_now_ms(r->g));
  free(r);
}

void gossip_refuse_donation(gossip_t *g, const char *why) {
  struct refusal *r = xcalloc(1, sizeof *r);
  r->g = g;
  snprintf(r->why, sizeof r->why, "%s", why);
  if (net_call(g->net, refuse_on_loop, r) != 0) free(r); /* stopping */
}

static int pull(gossip_t *g, const uint8_t *from, uint64_t min_step, bool optional, float *state_buf,
                struct gossip_train_pos *pos, const atomic_int *stop, struct rumor_err *e) {
  struct gossip_join *j = &g->join;
  pthread_mutex_lock(&g->lock);
  bool failed = j->failed;
  j->pull_done = false; /* the wait below must not see the last pull's result */
  pthread_mutex_unlock(&g->lock);
  if (failed) return rumor_err_set(e, RUMOR_EAUTH, "%s", j->error);
  struct pull_req *r = xcalloc(1, sizeof *r);
  r->g = g;
  r->buf = state_buf;
  if (from) memcpy(r->from, from, NET_PUBKEY_BYTES);
  r->have_from = from != NULL;
  r->min_step = min_step;
  r->optional = optional;
  if (net_call(g->net, pull_on_loop, r) != 0) {
    free(r);
    return rumor_err_set(e, RUMOR_ECANCELED, "the gossip runtime is stopping");
  }
  pthread_mutex_lock(&g->lock);
  int rc = pull_wait(g, true, pos, stop, e);
  j->pull_wanted = false;
  pthread_mutex_unlock(&g->lock);
  return rc;
}

int gossip_state_pull(gossip_t *g, const uint8_t *from, uint64_t min_step, float *state_buf,
                      struct gossip_train_pos *pos, const atomic_int *stop, struct rumor_err *e) {
  return pull(g, from, min_step, false, state_buf, pos, stop, e);
}

int gossip_state_pull_ahead(gossip_t *g, uint64_t min_step, float *state_buf, struct gossip_train_pos *pos,
                            const atomic_int *stop, struct rumor_err *e) {
  return pull(g, NULL, min_step, true, state_buf, pos, stop, e);
}
