/*
 * Donations: the slot through which the training thread hands over its
 * state — a whole state (parameters and optimiser state) to a newcomer that
 * asked with STATE_REQ, or the parameters alone to a monitor that asked
 * with PARAMS_REQ (exact drift). One at a time; others are told STATE_BUSY.
 *
 * Slot: IDLE ──(loop: a request)──▶ WANT ──(training: buffer filled,
 * gossip_donor_done)──▶ BUSY (the loop sends it) ──(sent or failed)──▶ IDLE.
 *
 * Loop thread, except the functions marked "training thread".
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

static void on_ready(net_t *n, void *arg, int status);

void gossip_donation_init(struct gossip *g) {
  g->don.buf = g->cfg.donor_buf;
  g->don.sketch = xcalloc((size_t)g->mon.sketch_k, sizeof(double));
}

void gossip_donation_free(struct gossip *g) {
  free(g->don.sketch);
  g->don.sketch = NULL;
}

/* ---- training thread ---- */

bool gossip_donor_poll(gossip_t *g) { return atomic_load(&g->don.state) == SLOT_WANT; }
float *gossip_donor_buf(gossip_t *g) { return g->don.buf; }
bool gossip_donor_sending(gossip_t *g) { return atomic_load(&g->don.state) == SLOT_BUSY; }
bool gossip_donor_params_only(gossip_t *g) { return atomic_load(&g->don.params_only); }
bool gossip_donor_catch_up(gossip_t *g) { return atomic_load(&g->don.catch_up); }

void gossip_donor_done(gossip_t *g, const struct gossip_train_pos *pos) {
  struct gossip_donation *d = &g->don;
  d->pos = *pos;
  /* A monitor's pull: the figures just published describe these parameters. */
  if (atomic_load(&d->params_only)) d->have_sketch = gossip_monitoring_sketch(g, &d->norm, d->sketch);
  int expected = SLOT_WANT;
  if (!atomic_compare_exchange_strong(&d->state, &expected, SLOT_BUSY)) return;
  if (net_call(g->net, on_ready, g) != 0) atomic_store(&d->state, SLOT_IDLE);
}

/* ---- loop thread ---- */

/* `behind`: not busy, but before the step the request asked for ("min"):
 * the asker looks no further here, and stops when every donor said so. */
static void send_busy_as(net_conn_t *c, const char *why, bool fatal, bool behind) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, GMSG_STATE_BUSY, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  net_msgbuf_put_bool(&b, "fatal", fatal);
  if (behind) net_msgbuf_put_bool(&b, "behind", true);
  if (net_conn_send_msg(c, &b)) log_debug("cannot answer a state request from %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

static void send_busy(net_conn_t *c, const char *why, bool fatal) { send_busy_as(c, why, fatal, false); }

static void on_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct gossip *g = arg;
  if (status == 0) {
    gossip_count(g, GOSSIP_EV_DONATED, NULL);
    log_info("donated our state to %s", net_conn_peer_name(c));
  } else {
    log_warn("state donation to %s failed: %s", net_conn_peer_name(c), rumor_strerror(status));
  }
  g->don.conn = NULL;
  atomic_store(&g->don.state, SLOT_IDLE);
}

/* The training thread filled the buffer: send it. */
static void on_ready(net_t *n, void *arg, int status) {
  struct gossip *g = arg;
  struct gossip_donation *d = &g->don;
  if (status) return;
  bool params_only = atomic_exchange(&d->params_only, false);
  if (!d->conn || g->stopping) {
    d->conn = NULL;
    atomic_store(&d->state, SLOT_IDLE);
    return;
  }
  struct net_msgbuf meta;
  net_msgbuf_init(&meta, 0, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&meta, "k", params_only ? GBULK_PARAMS : GBULK_STATE);
  net_msgbuf_put_uint(&meta, "x", GBULK_NO_EXCHANGE_ID);
  net_msgbuf_put_uint(&meta, "step", d->pos.step);
  net_msgbuf_put_uint(&meta, "epoch", d->pos.epoch);
  net_msgbuf_put_uint(&meta, "samples", d->pos.samples);
  /* The sketch rides in the metadata when it fits (k up to about 8000). */
  int k = g->mon.sketch_k;
  if (params_only && d->have_sketch && (size_t)k * sizeof(double) + 1024 <= NET_BULK_META_MAX) {
    net_msgbuf_put_double(&meta, "norm", d->norm);
    net_msgbuf_put_uint(&meta, "sk_seed", g->mon.sketch_seed);
    net_msgbuf_put_bin(&meta, "sketch", d->sketch, (size_t)k * sizeof(double));
  }
  size_t mlen;
  const uint8_t *mdata = net_msgbuf_data(&meta, &mlen);
#ifdef RUMOR_TESTING
  if (!params_only) gossip_testing_donation(g, d->buf, g->cfg.state_floats);
#endif
  /* A state travels exactly (f32): it seeds a replica. */
  struct net_bulk_send s = {.src = d->buf, .count = params_only ? g->cfg.nparams : g->cfg.state_floats,
                            .wire = NET_DTYPE_F32, .meta = mdata, .meta_len = mlen, .done = on_sent, .arg = g};
  int rc = net_conn_send_bulk(d->conn, &s, &d->send_id);
  net_msgbuf_free(&meta);
  if (rc) {
    log_warn("cannot donate our state to %s: %s", net_conn_peer_name(d->conn), rumor_strerror(rc));
    d->conn = NULL;
    atomic_store(&d->state, SLOT_IDLE);
  }
}

/* Takes the slot for a request on `c`; false when it is not free (a
 * donation in progress). `params_only` and `catch_up` are set before the
 * slot turns WANT: the training thread reads them then. */
static bool take_slot(struct gossip *g, net_conn_t *c, bool params_only, bool catch_up) {
  struct gossip_donation *d = &g->don;
  int expected = SLOT_IDLE;
  if (atomic_load(&d->state) != SLOT_IDLE) return false;
  atomic_store(&d->params_only, params_only);
  atomic_store(&d->catch_up, catch_up);
  if (!atomic_compare_exchange_strong(&d->state, &expected, SLOT_WANT)) {
    atomic_store(&d->params_only, false);
    atomic_store(&d->catch_up, false);
    return false;
  }
  d->conn = c;
  memcpy(d->to, net_conn_peer_key(c), NET_PUBKEY_BYTES);
  return true;
}

static void handle_state_req(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  const char *model, *opt;
  size_t mlen, olen;
  uint64_t n, sf;
  if (net_msg_get_str(m, "model", &model, &mlen) || net_msg_get_uint(m, "n", &n) || net_msg_get_uint(m, "sf", &sf) ||
      net_msg_get_str(m, "opt", &opt, &olen)) {
    log_warn("malformed state request from %s; dropping the connection", net_conn_peer_name(c));
    net_conn_close(c);
    return;
  }
  if (g->cfg.role != GOSSIP_ROLE_PEER || !atomic_load(&g->ready) || g->stopping) {
    send_busy(c, g->cfg.role == GOSSIP_ROLE_PEER && !g->stopping ? "joining" : "not ready", false);
    return;
  }
  if (mlen != strlen(g->model) || memcmp(model, g->model, mlen) != 0 || n != g->cfg.nparams ||
      sf != g->cfg.state_floats || olen != strlen(g->optimizer) || memcmp(opt, g->optimizer, olen) != 0) {
    char why[600];
    snprintf(why, sizeof why, "state mismatch: this peer trains %s with %s, the newcomer %.*s with %.*s", g->model,
             g->optimizer, (int)mlen, model, (int)olen, opt);
    send_busy(c, why, true);
    return;
  }
  /* A member catching up serves nothing until its pull ends (its training
   * thread waits for it): two of them asking each other would each wait out
   * the donor timeout. Its state is behind anyway. And one that is not as
   * far as the asker needs ("min": only an all-reduce member left behind
   * sends it, and its ring position is where we are) would give a state
   * that helps nothing. */
  uint64_t min = 0;
  if (net_msg_get_uint(m, "min", &min)) min = 0; /* optional */
  if (gossip_join_pulling(g)) {
    send_busy(c, "catching up: pulling a state itself", false);
  } else if (g->ring.pos < min) {
    char why[96];
    snprintf(why, sizeof why, "at step %llu, before the step %llu asked for", (unsigned long long)g->ring.pos,
             (unsigned long long)min);
    send_busy_as(c, why, false, true);
  } else if (!take_slot(g, c, false, min > 0)) {
    send_busy(c, "already donating", false);
  }
}

/* A monitor wants our parameters (exact drift): served through the slot,
 * which the training thread fills at its next boundary. */
static void handle_params_req(struct gossip *g, net_conn_t *c) {
  bool can = g->cfg.role == GOSSIP_ROLE_PEER && atomic_load(&g->ready) && !g->stopping && !gossip_join_pulling(g);
  if (!can || !take_slot(g, c, true, false)) send_busy(c, "busy", false);
}

void gossip_donation_on_msg(struct gossip *g, net_conn_t *c, const struct net_msg *m) {
  if (m->type == GMSG_STATE_REQ) handle_state_req(g, c, m);
  else if (m->type == GMSG_PARAMS_REQ) handle_params_req(g, c);
}

void gossip_donation_on_close(struct gossip *g, net_conn_t *c) {
  struct gossip_donation *d = &g->don;
  if (d->conn != c) return;
  d->conn = NULL;
  int expected = SLOT_WANT;
  if (atomic_compare_exchange_strong(&d->state, &expected, SLOT_IDLE)) atomic_store(&d->params_only, false);
}
