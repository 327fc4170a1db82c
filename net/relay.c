/*
 * Relays: circuits that carry a whole connection's byte stream through a
 * third member, for peers that cannot accept connections (behind a NAT).
 *
 * Three roles, all on the loop thread:
 *  - the listener (a NATed peer) keeps a connection to a relay and asks it
 *    to take circuits for it (RELAY_LISTEN);
 *  - the dialer opens a circuit on its own connection to that relay
 *    (CIRCUIT_OPEN with the target's key) and runs an ordinary handshake
 *    and session over it: the relay forwards sealed bytes and can drop
 *    them, but neither read nor forge them, and the dialer checks that the
 *    key that answered is the one it asked for;
 *  - the relay pairs the two hops and forwards CIRCUIT_DATA and
 *    CIRCUIT_END between them, with backpressure (it stops reading a source
 *    whose destination has too much queued) and a per-peer rate cap.
 *
 * A hop is one circuit's end on one carrier connection. Circuit ids are
 * chosen by whoever opens the hop: odd on the dialing side of the carrier,
 * even on the accepting side, so the two never collide.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/transport_impl.h"

#define RELAY_HIGH_WATER (4u << 20) /* a destination queue above this holds its sources */
#define RELAY_TICK_MS 20
#define RELAY_MAX_HOPS 256          /* circuits on one carrier */

struct net_hop {
  uint64_t id;
  struct net_conn *inner; /* an endpoint: the connection running over this circuit */
  struct net_conn *peer;  /* at a relay: the other carrier, and the id there */
  uint64_t peer_id;
  bool fin_in, fin_out;   /* FIN received on / sent on this hop */
};

struct net_carrier {
  struct net_hop *hops;
  size_t n, cap;
  uint64_t next_id;
  bool listening;         /* a relay: the peer at the other end takes circuits through us */
  double tokens;          /* a relay: bytes this peer may still have forwarded (rate cap) */
  uint64_t refill_ms;
};

/* A carrier this net dialed for relaying, by the address it was dialed at. */
struct net_relay_link {
  struct net_relay_link *next;
  net_t *net;
  char addr[NET_ADDR_STR];
  struct net_conn *conn;  /* open carrier; NULL while dialing */
  struct net_conn **waiting; /* circuit connections waiting for the carrier */
  size_t nwaiting;
  net_relay_cb listen_cb; /* a registration asked for (called on the answer and on loss) */
  void *listen_arg;
  bool listen_sent, listen_ok;
};

/* ---- hops ---------------------------------------------------------------------------- */

static struct net_carrier *carrier_of(struct net_conn *c) {
  if (!c->carrier) {
    c->carrier = xcalloc(1, sizeof *c->carrier);
    c->carrier->next_id = c->inbound ? 2 : 1;
    c->carrier->tokens = (double)c->net->cfg.relay_rate_bytes;
    c->carrier->refill_ms = uv_now(c->net->loop);
  }
  return c->carrier;
}

static struct net_hop *hop_find(struct net_conn *c, uint64_t id) {
  struct net_carrier *k = c->carrier;
  if (!k) return NULL;
  for (size_t i = 0; i < k->n; i++)
    if (k->hops[i].id == id) return &k->hops[i];
  return NULL;
}

/* A new hop with a fresh id (ours) or the peer's id; NULL when full. */
static struct net_hop *hop_add(struct net_conn *c, uint64_t id) {
  struct net_carrier *k = carrier_of(c);
  if (k->n >= RELAY_MAX_HOPS) return NULL;
  if (k->n == k->cap) {
    k->cap = k->cap ? 2 * k->cap : 8;
    k->hops = xrealloc(k->hops, k->cap * sizeof *k->hops);
  }
  if (!id) {
    id = k->next_id;
    k->next_id += 2;
  }
  struct net_hop *h = &k->hops[k->n++];
  memset(h, 0, sizeof *h);
  h->id = id;
  return h;
}

static void hop_remove(struct net_conn *c, uint64_t id) {
  struct net_carrier *k = c->carrier;
  if (!k) return;
  for (size_t i = 0; i < k->n; i++)
    if (k->hops[i].id == id) {
      k->hops[i] = k->hops[--k->n];
      return;
    }
}

static void send_end(struct net_conn *c, uint64_t id, enum net_circuit_end why) {
  if (c->state != CONN_OPEN) return;
  if (net_conn_queue_frame(c, NET_FRAME_CIRCUIT_END, id, why, NULL, 0, SIZE_MAX, NULL) == 0) net_conn_pump(c);
}

static const char *end_reason(enum net_circuit_end why) {
  switch (why) {
  case NET_CIRCUIT_FIN: return "closed";
  case NET_CIRCUIT_RESET: return "reset by the other end";
  case NET_CIRCUIT_UNREACHABLE: return "the relay holds no registration for that peer";
  case NET_CIRCUIT_NOT_RELAY: return "the relay does not relay (no --relay)";
  case NET_CIRCUIT_BUSY: return "the relay or the peer has too many circuits";
  case NET_CIRCUIT_LOST: return "the relay lost its connection to the other end";
  }
  return "unknown reason";
}

/* ---- the relay's side ------------------------------------------------------------------- */

/* The open connection of a peer that asked us to take circuits for it. */
static struct net_conn *listener_of(net_t *n, const uint8_t *pk) {
#ifdef RUMOR_TESTING
  if (n->test_relay_any_target)
    for (struct net_conn *c = n->conns; c; c = c->next)
      if (c->state == CONN_OPEN && c->inbound && c->carrier && c->carrier->listening) return c;
#endif
  for (struct net_conn *c = n->conns; c; c = c->next)
    if (c->state == CONN_OPEN && c->inbound && c->carrier && c->carrier->listening &&
        memcmp(c->peer_pk, pk, NET_PUBKEY_BYTES) == 0)
      return c;
  return NULL;
}

static void relay_on_open(struct net_conn *c, uint64_t id, const uint8_t *target) {
  net_t *n = c->net;
  if (!n->cfg.relay) {
    send_end(c, id, NET_CIRCUIT_NOT_RELAY);
    return;
  }
  struct net_conn *to = listener_of(n, target);
  if (!to || to == c) {
    send_end(c, id, NET_CIRCUIT_UNREACHABLE);
    return;
  }
  struct net_hop *a = hop_add(c, id);
  struct net_hop *b = a ? hop_add(to, 0) : NULL;
  if (!b) {
    if (a) hop_remove(c, id);
    n->stats.relay_refused++;
    send_end(c, id, NET_CIRCUIT_BUSY);
    return;
  }
  a->peer = to;
  a->peer_id = b->id;
  b->peer = c;
  b->peer_id = id;
  n->stats.relay_circuits++;
  if (net_conn_queue_frame(to, NET_FRAME_CIRCUIT_OPEN, b->id, 0, c->peer_pk, NET_PUBKEY_BYTES, SIZE_MAX, NULL) == 0)
    net_conn_pump(to);
  log_debug("net: relaying circuit %s#%llu -> %s#%llu", c->name, (unsigned long long)id, to->name,
            (unsigned long long)b->id);
}

/* Refills c's rate budget for the time since the last refill (a bucket of
 * a quarter second's bytes, at least 1 MiB). */
static void refill(struct net_conn *c) {
  struct net_carrier *k = c->carrier;
  double rate = (double)c->net->cfg.relay_rate_bytes;
  uint64_t now = uv_now(c->net->loop);
  double burst = rate / 4 > (1 << 20) ? rate / 4 : (1 << 20);
  k->tokens += rate * (double)(now - k->refill_ms) / 1000.0;
  if (k->tokens > burst) k->tokens = burst;
  k->refill_ms = now;
}

/* Takes `len` bytes out of c's rate budget; false when it is spent. */
static bool spend(struct net_conn *c, size_t len) {
  if (!c->net->cfg.relay_rate_bytes) return true;
  refill(c);
  c->carrier->tokens -= (double)len;
  return c->carrier->tokens >= 0;
}

static void relay_tick_start(net_t *n);

static void relay_forward(struct net_conn *c, struct net_hop *h, const uint8_t *pt, size_t len) {
  struct net_conn *to = h->peer;
  net_t *n = c->net;
#ifdef RUMOR_TESTING
  uint8_t *bent = NULL;
  if (n->test_relay_flip && n->stats.relay_bytes + len > n->test_relay_flip_after) {
    bent = xmalloc(len);
    memcpy(bent, pt, len);
    bent[len / 2] ^= 0x10;
    pt = bent;
  }
#endif
  int rc = to->state != CONN_OPEN ? -ENOTCONN
                                  : net_conn_queue_frame(to, NET_FRAME_CIRCUIT_DATA, h->peer_id, 0, pt, len,
                                                         SIZE_MAX, NULL);
#ifdef RUMOR_TESTING
  free(bent);
#endif
  if (rc < 0) return; /* the other end is going away: its END follows */
  n->stats.relay_bytes += len;
  net_conn_pump(to);
  bool over = !spend(c, len);
  if (over || net_conn_queued(to) > RELAY_HIGH_WATER) {
    if (!c->read_held) n->stats.relay_holds++;
    net_conn_hold_read(c, true);
    relay_tick_start(n);
  }
}

/* The relay's timer: refills the rate budgets and lets held sources read
 * again once their budget is positive and their destinations drained. */
static void on_relay_tick(uv_timer_t *t) {
  net_t *n = t->data;
  bool any_held = false;
  for (struct net_conn *c = n->conns; c; c = c->next) {
    struct net_carrier *k = c->carrier;
    if (!k || c->state != CONN_OPEN || !c->read_held) continue;
    bool ok = true;
    if (n->cfg.relay_rate_bytes) {
      refill(c);
      ok = k->tokens >= 0;
    }
    for (size_t i = 0; ok && i < k->n; i++)
      if (k->hops[i].peer && net_conn_queued(k->hops[i].peer) > RELAY_HIGH_WATER / 2) ok = false;
    if (ok) net_conn_hold_read(c, false);
    else any_held = true;
  }
  if (!any_held) {
    uv_timer_stop(&n->relay_timer);
    n->relay_timer_on = false;
  }
}

static void relay_tick_start(net_t *n) {
  if (n->relay_timer_on || n->closing) return;
  n->relay_timer_on = true;
  uv_timer_start(&n->relay_timer, on_relay_tick, RELAY_TICK_MS, RELAY_TICK_MS);
}

/* An END on hop h of c at the relay: passed on; the pair goes once both
 * directions ended or on a reset. */
static void relay_end(struct net_conn *c, struct net_hop *h, enum net_circuit_end why) {
  struct net_conn *to = h->peer;
  uint64_t id = h->id, peer_id = h->peer_id;
  struct net_hop *o = hop_find(to, peer_id);
  send_end(to, peer_id, why); /* the other end learns why: FIN, or the reset as it was given */
  if (why == NET_CIRCUIT_FIN) {
    h->fin_in = true;
    if (o) o->fin_out = true;
    if (!(o && o->fin_in)) return;
  }
  hop_remove(c, id);
  hop_remove(to, peer_id);
  c->net->stats.relay_circuits--;
}

/* ---- the endpoints' side ------------------------------------------------------------------ */

/* A peer opened a circuit to us through the relay at the other end of c. */
static void endpoint_on_open(struct net_conn *c, uint64_t id, const uint8_t *origin) {
  net_t *n = c->net;
  if (!c->carrier || !c->carrier->listening || hop_find(c, id)) {
    send_end(c, id, NET_CIRCUIT_NOT_RELAY);
    return;
  }
  if (n->closing || n->n_pending >= n->cfg.max_pending_handshakes || n->n_conns >= n->cfg.max_conns) {
    send_end(c, id, NET_CIRCUIT_BUSY);
    return;
  }
  struct net_hop *h = hop_add(c, id);
  if (!h) {
    send_end(c, id, NET_CIRCUIT_BUSY);
    return;
  }
  struct net_conn *in = net_conn_new(n, true);
  in->circ = true;
  in->circ_carrier = c;
  in->circ_id = id;
  h->inner = in;
  char key[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(key, origin);
  snprintf(in->addr, sizeof in->addr, "%c%.62s", NET_RELAY_ADDR_PREFIX, c->addr);
  net_conn_set_name(in);
  log_debug("net: circuit %llu from %.8s via %s", (unsigned long long)id, key, c->name);
  n->stats.conns_accepted++;
  in->counted_pending = true;
  n->n_pending++;
  net_conn_start_handshake(in);
}

static int endpoint_on_end(struct net_conn *c, struct net_hop *h, enum net_circuit_end why) {
  struct net_conn *in = h->inner;
  if (why == NET_CIRCUIT_FIN) {
    h->fin_in = true;
    if (h->fin_out) {
      hop_remove(c, h->id);
      in->circ_carrier = NULL;
    }
    net_conn_on_eof(in);
    return 0;
  }
  hop_remove(c, h->id);
  in->circ_carrier = NULL;
  /* Only the far end's own reset is evidence against it (as a TCP reset
   * is); what the relay says of its own state is not. */
  net_conn_abort(in, why == NET_CIRCUIT_UNREACHABLE ? -EHOSTUNREACH : why == NET_CIRCUIT_RESET ? -ECONNRESET : -ENETRESET,
                 in->state < CONN_OPEN ? NET_HS_FAIL_CLOSED : -1, "circuit through %s: %s", c->name,
                 end_reason(why));
  return 0;
}

/* ---- frames from a carrier -------------------------------------------------------------- */

static int on_listen(struct net_conn *c, uint64_t a) {
  net_t *n = c->net;
  if (!c->inbound) { /* an answer to our RELAY_LISTEN */
    for (struct net_relay_link *l = n->rlinks; l; l = l->next) {
      if (l->conn != c || !l->listen_sent || l->listen_ok) continue;
      net_relay_cb cb = l->listen_cb;
      void *arg = l->listen_arg;
      l->listen_ok = a == 1;
      if (l->listen_ok) {
        carrier_of(c)->listening = true;
      } else { /* refused: the link stays a plain carrier */
        l->listen_cb = NULL;
        l->listen_sent = false;
      }
      if (cb) cb(n, l->listen_ok ? 0 : -EPERM, l->listen_ok ? "" : end_reason(NET_CIRCUIT_NOT_RELAY), arg);
      return 0;
    }
    return 0;
  }
  if (a != 1) return RUMOR_EPROTO;
  bool ok = n->cfg.relay;
  if (ok) {
    /* The newest registration of a key wins (a peer that reconnected). */
    for (struct net_conn *o = n->conns; o; o = o->next)
      if (o != c && o->carrier && memcmp(o->peer_pk, c->peer_pk, NET_PUBKEY_BYTES) == 0)
        o->carrier->listening = false;
    carrier_of(c)->listening = true;
    log_info("net: relaying for %s", c->name);
  }
  if (net_conn_queue_frame(c, NET_FRAME_RELAY_LISTEN, ok ? 1 : 0, ok ? 0 : NET_CIRCUIT_NOT_RELAY, NULL, 0, SIZE_MAX,
                           NULL) == 0)
    net_conn_pump(c);
  return 0;
}

int net_relay_on_frame(struct net_conn *c, uint8_t type, uint64_t a, uint64_t b, const uint8_t *pt, size_t len) {
  if (type == NET_FRAME_RELAY_LISTEN) return on_listen(c, a);
  if (a == 0) return RUMOR_EPROTO;
  struct net_hop *h = hop_find(c, a);
  switch (type) {
  case NET_FRAME_CIRCUIT_OPEN:
    if (h) return RUMOR_EPROTO; /* an id in use */
    if ((a & 1) != (c->inbound ? 1u : 0u)) return RUMOR_EPROTO; /* an id from our half */
    /* Whoever dialed a carrier is an endpoint; a relay only accepts them.
     * So an OPEN from the dialing side asks us to relay, and one from the
     * accepting side (a relay) brings a circuit to us. */
    if (c->inbound) relay_on_open(c, a, pt);
    else endpoint_on_open(c, a, pt);
    return 0;
  case NET_FRAME_CIRCUIT_DATA:
    if (!h) return 0; /* ended here already: the rest of its bytes is dropped */
    if (h->fin_in) return RUMOR_EPROTO;
    if (h->inner) net_conn_feed(h->inner, pt, len);
    else relay_forward(c, h, pt, len);
    return 0;
  case NET_FRAME_CIRCUIT_END:
    if (b > NET_CIRCUIT_END__MAX) return RUMOR_EPROTO;
    if (!h) return 0;
    if (h->fin_in && b == NET_CIRCUIT_FIN) return RUMOR_EPROTO;
    if (h->inner) return endpoint_on_end(c, h, (enum net_circuit_end)b);
    relay_end(c, h, (enum net_circuit_end)b);
    return 0;
  default: return RUMOR_EPROTO;
  }
}

/* ---- dialing through a relay ---------------------------------------------------------------- */

/* Opens circuit connection `in` on carrier c: OPEN, then the handshake. */
static void circuit_start(struct net_conn *c, struct net_conn *in) {
  if (c->state == CONN_OPEN && c->version < NET_PROTO_RELAY) {
    net_conn_abort(in, -EPROTONOSUPPORT, -1, "no circuit through %s: its build has no relays (protocol version %u)",
                   c->name, c->version);
    return;
  }
  struct net_hop *h = c->state == CONN_OPEN ? hop_add(c, 0) : NULL;
  if (!h) {
    net_conn_abort(in, -EBUSY, -1, "no circuit through %s: %s", c->name,
                   c->state == CONN_OPEN ? "too many circuits on it" : "the relay connection closed");
    return;
  }
  h->inner = in;
  in->circ_carrier = c;
  in->circ_id = h->id;
  snprintf(in->addr, sizeof in->addr, "%c%.62s", NET_RELAY_ADDR_PREFIX, c->addr);
  net_conn_set_name(in);
  if (net_conn_queue_frame(c, NET_FRAME_CIRCUIT_OPEN, h->id, 0, in->circ_target, NET_PUBKEY_BYTES, SIZE_MAX,
                           NULL) < 0) {
    net_conn_abort(in, -ENOTCONN, -1, "no circuit through %s: it is closing", c->name);
    return;
  }
  net_conn_pump(c);
  net_conn_start_handshake(in);
}

/* Sends our RELAY_LISTEN on the link's open carrier (a relay of an older
 * build, without relays, is refused here with a message that says so). */
static void send_listen(struct net_relay_link *l) {
  struct net_conn *c = l->conn;
  if (c->version < NET_PROTO_RELAY) {
    net_relay_cb cb = l->listen_cb;
    void *arg = l->listen_arg;
    l->listen_cb = NULL;
    char why[160];
    snprintf(why, sizeof why, "its build has no relays (protocol version %u)", c->version);
    cb(l->net, -EPROTONOSUPPORT, why, arg);
    return;
  }
  l->listen_sent = true;
  if (net_conn_queue_frame(c, NET_FRAME_RELAY_LISTEN, 1, 0, NULL, 0, SIZE_MAX, NULL) == 0) net_conn_pump(c);
}

static void link_free(net_t *n, struct net_relay_link *l) {
  for (struct net_relay_link **pp = &n->rlinks; *pp; pp = &(*pp)->next)
    if (*pp == l) {
      *pp = l->next;
      break;
    }
  free(l->waiting);
  free(l);
}

static void on_carrier_dialed(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct net_relay_link *l = arg;
  struct net_conn **waiting = l->waiting;
  size_t nw = l->nwaiting;
  l->waiting = NULL;
  l->nwaiting = 0;
  for (size_t i = 0; i < nw; i++) waiting[i]->circ_wait = NULL;
  if (status < 0) {
    for (size_t i = 0; i < nw; i++)
      net_conn_abort(waiting[i], status, -1, "cannot reach the relay %s: %s", l->addr, detail);
    net_relay_cb cb = l->listen_cb;
    void *cb_arg = l->listen_arg;
    link_free(n, l);
    free(waiting);
    if (cb) cb(n, status, detail, cb_arg);
    return;
  }
  l->conn = c;
  carrier_of(c);
  /* The carrier is an ordinary connection to a member: the application
   * learns of it like of an inbound one, and may use it. */
  if (n->cbs.on_accept) n->cbs.on_accept(c, n->ud);
  if (c->state == CONN_OPEN && l->listen_cb && !l->listen_sent) send_listen(l);
  for (size_t i = 0; i < nw; i++) circuit_start(c, waiting[i]);
  free(waiting);
}

/* The link for relay address `relay`, dialing it when there is none. */
static struct net_relay_link *link_get(net_t *n, const char *relay, int *rc) {
  for (struct net_relay_link *l = n->rlinks; l; l = l->next)
    if (strcmp(l->addr, relay) == 0 && (!l->conn || l->conn->state == CONN_OPEN)) return l;
  struct net_relay_link *l = xcalloc(1, sizeof *l);
  l->net = n;
  snprintf(l->addr, sizeof l->addr, "%s", relay);
  *rc = net_dial(n, relay, on_carrier_dialed, l);
  if (*rc < 0) {
    free(l);
    return NULL;
  }
  l->next = n->rlinks;
  n->rlinks = l;
  return l;
}

int net_dial_via(net_t *n, const char *relay, const uint8_t target[NET_PUBKEY_BYTES], net_dial_cb cb, void *arg) {
  if (n->closing) return RUMOR_ECANCELED;
  if (!cb || !target) return -EINVAL;
  int rc = net_addr_check_dial(relay, NULL);
  if (rc < 0) return rc;
  if (n->n_conns >= n->cfg.max_conns) return -EBUSY;
  /* We are the target's relay: the circuit starts on its own carrier. */
  struct net_conn *direct = n->cfg.relay ? listener_of(n, target) : NULL;
  struct net_relay_link *l = NULL;
  if (!direct && !(l = link_get(n, relay, &rc))) return rc;
  struct net_conn *in = net_conn_new(n, false);
  in->circ = true;
  in->circ_check_target = true;
  memcpy(in->circ_target, target, NET_PUBKEY_BYTES);
  in->dial_cb = cb;
  in->dial_arg = arg;
  in->state = CONN_CONNECTING;
  snprintf(in->addr, sizeof in->addr, "%c%.62s", NET_RELAY_ADDR_PREFIX, relay);
  net_conn_set_name(in);
  n->stats.conns_dialed++;
  if (direct) {
    circuit_start(direct, in);
  } else if (l->conn) {
    circuit_start(l->conn, in);
  } else {
    l->waiting = xrealloc(l->waiting, (l->nwaiting + 1) * sizeof *l->waiting);
    l->waiting[l->nwaiting++] = in;
    in->circ_wait = l;
  }
  return 0;
}

int net_dial_peer(net_t *n, const char *addr, const uint8_t pk[NET_PUBKEY_BYTES], net_dial_cb cb, void *arg) {
  if (addr[0] == NET_RELAY_ADDR_PREFIX) return net_dial_via(n, addr + 1, pk, cb, arg);
  return net_dial(n, addr, cb, arg);
}

int net_relay_listen(net_t *n, const char *relay, net_relay_cb cb, void *arg) {
  if (n->closing) return RUMOR_ECANCELED;
  if (!cb) return -EINVAL;
  int rc = net_addr_check_dial(relay, NULL);
  if (rc < 0) return rc;
  struct net_relay_link *l = link_get(n, relay, &rc);
  if (!l) return rc;
  if (l->listen_cb) return -EALREADY;
  l->listen_cb = cb;
  l->listen_arg = arg;
  if (l->conn && l->conn->state == CONN_OPEN) send_listen(l);
  return 0;
}

/* c->hs holds the identity the WELCOME proved. */
int net_circuit_check_peer(struct net_conn *c, struct rumor_err *e) {
  if (memcmp(c->hs.peer_pk, c->circ_target, NET_PUBKEY_BYTES) == 0) return 0;
  char want[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(want, c->circ_target);
  return rumor_err_set(e, RUMOR_EAUTH, "the peer reached through %s is not %.12s... (a relay answering for it?)",
                       c->circ_carrier ? c->circ_carrier->name : "the relay", want);
}

/* ---- a circuit connection's I/O ------------------------------------------------------------- */

int net_circuit_write(struct net_conn *c, struct net_txframe *f) {
  struct net_conn *k = c->circ_carrier;
  if (!k || k->state != CONN_OPEN) return -ENOTCONN;
  struct net_hop *h = hop_find(k, c->circ_id);
  if (!h || h->fin_out) return -ENOTCONN;
  for (size_t off = 0; off < f->len;) {
    size_t len = f->len - off > NET_CIRCUIT_PIECE_MAX ? NET_CIRCUIT_PIECE_MAX : f->len - off;
    bool last = off + len == f->len;
    int rc = net_conn_queue_frame(k, NET_FRAME_CIRCUIT_DATA, c->circ_id, 0, f->data + off, len, SIZE_MAX,
                                  last ? f : NULL);
    if (rc < 0) return rc; /* pieces already queued go out; the connection is dropped */
    off += len;
  }
  c->refs++; /* until the carrier writes the last piece (or drops it) */
  net_conn_pump(k);
  return 0;
}

void net_circuit_shutdown(struct net_conn *c) {
  struct net_conn *k = c->circ_carrier;
  struct net_hop *h = k ? hop_find(k, c->circ_id) : NULL;
  if (!h || h->fin_out) return;
  h->fin_out = true;
  send_end(k, c->circ_id, NET_CIRCUIT_FIN);
  if (h->fin_in) {
    hop_remove(k, c->circ_id);
    c->circ_carrier = NULL;
  }
}

/* ---- teardown ------------------------------------------------------------------------------- */

void net_relay_conn_gone(struct net_conn *c, int status) {
  net_t *n = c->net;
  (void)status;
  if (c->circ_wait) { /* still waiting for its carrier */
    struct net_relay_link *l = c->circ_wait;
    for (size_t i = 0; i < l->nwaiting; i++)
      if (l->waiting[i] == c) {
        l->waiting[i] = l->waiting[--l->nwaiting];
        break;
      }
    c->circ_wait = NULL;
  }
  if (c->circ_carrier) { /* our circuit: tell the other end, unless it ended */
    struct net_conn *k = c->circ_carrier;
    struct net_hop *h = hop_find(k, c->circ_id);
    if (h && !(h->fin_in && h->fin_out)) send_end(k, c->circ_id, NET_CIRCUIT_RESET);
    hop_remove(k, c->circ_id);
    c->circ_carrier = NULL;
  }
  struct net_carrier *kc = c->carrier;
  if (kc) { /* the circuits we carry */
    c->carrier = NULL;
    for (size_t i = 0; i < kc->n; i++) {
      struct net_hop *h = &kc->hops[i];
      if (h->inner) {
        h->inner->circ_carrier = NULL;
        /* -ENETRESET: the relay went, not the peer at the other end. */
        net_conn_abort(h->inner, -ENETRESET, h->inner->state < CONN_OPEN ? NET_HS_FAIL_CLOSED : -1,
                       "the connection to the relay %s closed", c->name);
      } else if (h->peer) {
        send_end(h->peer, h->peer_id, NET_CIRCUIT_LOST);
        hop_remove(h->peer, h->peer_id);
        n->stats.relay_circuits--;
      }
    }
    free(kc->hops);
    free(kc);
  }
  for (struct net_relay_link *l = n->rlinks; l; l = l->next) {
    if (l->conn != c) continue;
    net_relay_cb cb = l->listen_ok ? l->listen_cb : NULL;
    void *arg = l->listen_arg;
    link_free(n, l);
    if (cb) cb(n, -ECONNRESET, "the connection to the relay closed", arg);
    break;
  }
}

void net_relay_init(net_t *n) {
  RUMOR_ASSERT(uv_timer_init(n->loop, &n->relay_timer) == 0);
  n->relay_timer.data = n;
  n->handles++;
}

void net_relay_close(net_t *n, uv_close_cb cb) {
  uv_timer_stop(&n->relay_timer);
  n->relay_timer_on = false;
  uv_close((uv_handle_t *)&n->relay_timer, cb);
}

bool net_conn_relayed(const net_conn_t *c) { return c->circ; }

#ifdef RUMOR_TESTING
void net_test_relay_misbehave(net_t *n, bool flip, uint64_t flip_after, bool any_target) {
  n->test_relay_flip = flip;
  n->test_relay_flip_after = flip_after;
  n->test_relay_any_target = any_target;
}
#endif
