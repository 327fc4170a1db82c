/*
 * Relays over real TCP on 127.0.0.1: a peer that does not listen registers
 * with a relay, another reaches it through a circuit; messages and a bulk
 * transfer arrive whole both ways, authenticated end to end; a relay that
 * flips a bit or answers for the wrong key is caught; a relay that is not
 * one, a target that is not registered, and a relay that dies mid-transfer
 * each end what they must and nothing more.
 */
#include "test_net_helpers.h"

#define COUNT (3u * 1000u * 1000u) /* 12 MB of float32: many circuit pieces */

static struct tpeer relay, natted, dialer;

/* What the NATed side and the dialer see of relayed connections (the
 * recording callbacks also see the carrier to the relay). */
static net_conn_t *relayed_in;
static int relayed_closed, relayed_close_status;
static char relayed_close_detail[512];
static int listen_status = 1, listen_calls;

static void on_accept(net_conn_t *c, void *ud) {
  tp_on_accept(c, ud);
  if (net_conn_relayed(c)) relayed_in = c;
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  tp_on_close(c, status, detail, ud);
  if (net_conn_relayed(c)) {
    relayed_closed++;
    relayed_close_status = status;
    snprintf(relayed_close_detail, sizeof relayed_close_detail, "%s", detail);
    if (c == relayed_in) relayed_in = NULL;
  }
}

static const struct net_callbacks cbs = {.on_accept = on_accept,
                                         .on_message = tp_on_message,
                                         .on_bulk_begin = tp_on_bulk_begin,
                                         .on_bulk_done = tp_on_bulk_done,
                                         .on_close = on_close};

static void on_listen(net_t *n, int status, const char *detail, void *arg) {
  (void)n, (void)detail, (void)arg;
  listen_status = status;
  listen_calls++;
}

static void start(struct tpeer *p, bool listen) {
  cr_assert_eq(net_init(&p->net, &g_loop, &p->cfg, &cbs, p, NULL), 0);
  if (listen) cr_assert_eq(net_listen(p->net, "127.0.0.1:0", NULL), 0);
}

static void relay_addr(char *out, size_t cap) { snprintf(out, cap, "127.0.0.1:%d", net_listen_port(relay.net)); }

static void setup(void) {
  tloop_init();
  tkeys_init();
  tpeer_setup(&relay, "relay");
  tpeer_setup(&natted, "natted");
  tpeer_setup(&dialer, "dialer");
  relay.cfg.relay = true;
  relayed_in = NULL;
  relayed_closed = 0;
  listen_status = 1;
  listen_calls = 0;
}

static void finish(void) {
  struct tpeer *ps[] = {&relay, &natted, &dialer};
  tnet_finish(ps, 3);
}

/* Starts the three nets and asks the relay to take `natted`; returns the
 * answer's status. */
static int try_register_natted(void) {
  start(&relay, true);
  start(&natted, false);
  start(&dialer, false);
  char ra[64];
  relay_addr(ra, sizeof ra);
  cr_assert_eq(net_relay_listen(natted.net, ra, on_listen, NULL), 0);
  RUN_UNTIL(listen_calls > 0, 5);
  cr_assert_eq(listen_calls, 1, "the relay answered");
  return listen_status;
}

static void register_natted(void) { cr_assert_eq(try_register_natted(), 0, "the relay accepted the registration"); }

/* The dialer reaches `natted` through the relay. */
static net_conn_t *dial_natted(void) {
  char ra[64];
  relay_addr(ra, sizeof ra);
  cr_assert_eq(net_dial_via(dialer.net, ra, natted.id.pk, tp_dial_cb, &dialer), 0);
  RUN_UNTIL(dialer.dial_ok + dialer.dial_fail > 0 && relayed_in, 5);
  cr_assert_eq(dialer.dial_ok, 1, "dial through the relay: %s", dialer.dial_detail);
  cr_assert(relayed_in, "the NATed peer accepted the circuit");
  return dialer.conn;
}

static float *pattern(uint64_t n, float scale) {
  float *v = malloc(n * sizeof *v);
  cr_assert(v);
  for (uint64_t i = 0; i < n; i++) v[i] = scale * (float)(i % 1000) - 3.0f;
  return v;
}

/* Registers, dials through the relay and starts a COUNT-float transfer
 * from the dialer to the NATed peer; returns its source (free it after). */
static float *relayed_transfer(float scale) {
  register_natted();
  net_conn_t *out = dial_natted();
  natted.conn = relayed_in;
  natted.rx_buf = calloc(COUNT, sizeof(float));
  natted.rx_cap = COUNT;
  float *a = pattern(COUNT, scale);
  dialer.conn = out;
  cr_assert_eq(tpeer_send_bulk(&dialer, a, COUNT, NET_DTYPE_F32), 0);
  return a;
}

Test(net_relay, circuit_carries_messages_and_bulk_both_ways_end_to_end, .init = setup, .timeout = 60) {
  register_natted();
  net_conn_t *out = dial_natted();
  cr_assert(net_conn_relayed(out) && net_conn_relayed(relayed_in));
  cr_assert_eq(memcmp(net_conn_peer_key(out), natted.id.pk, NET_PUBKEY_BYTES), 0, "the dialer sees the target's key");
  cr_assert_eq(memcmp(net_conn_peer_key(relayed_in), dialer.id.pk, NET_PUBKEY_BYTES), 0,
               "the NATed peer sees the dialer's key, not the relay's");
  cr_assert_eq(net_conn_peer_addr(out)[0], NET_RELAY_ADDR_PREFIX, "addr %s", net_conn_peer_addr(out));

  /* messages in order, then 12 MB each way at once */
  natted.conn = relayed_in;
  for (uint64_t i = 1; i <= 50; i++) cr_assert_eq(tpeer_send_msg(&dialer, 7, i), 0);
  RUN_UNTIL(natted.msgs == 50, 10);
  cr_assert_eq(natted.msgs, 50);
  cr_assert(natted.msgs_in_order);
  float *a = pattern(COUNT, 0.5f), *b = pattern(COUNT, -0.25f);
  natted.rx_buf = calloc(COUNT, sizeof(float));
  dialer.rx_buf = calloc(COUNT, sizeof(float));
  natted.rx_cap = dialer.rx_cap = COUNT;
  cr_assert_eq(tpeer_send_bulk(&dialer, a, COUNT, NET_DTYPE_F32), 0);
  cr_assert_eq(tpeer_send_bulk(&natted, b, COUNT, NET_DTYPE_F32), 0);
  RUN_UNTIL(dialer.sent_done && natted.sent_done && dialer.bulk_done && natted.bulk_done, 30);
  cr_assert_eq(dialer.sent_status, 0);
  cr_assert_eq(natted.sent_status, 0);
  cr_assert_eq(natted.bulk_ok, 1);
  cr_assert_eq(dialer.bulk_ok, 1);
  cr_assert_eq(memcmp(natted.rx_buf, a, COUNT * sizeof(float)), 0, "bit-exact dialer -> NATed");
  cr_assert_eq(memcmp(dialer.rx_buf, b, COUNT * sizeof(float)), 0, "bit-exact NATed -> dialer");

  struct net_stats rs, ds;
  net_stats_get(relay.net, &rs);
  net_stats_get(dialer.net, &ds);
  cr_assert_geq(rs.relay_bytes, 2ull * COUNT * sizeof(float), "the relay forwarded both transfers");
  cr_assert_eq(rs.relay_circuits, 1);
  cr_assert_eq(ds.relayed_open, 1);
  cr_assert_geq(ds.relayed.bytes_out, (uint64_t)COUNT * sizeof(float), "relayed bytes are counted apart");
  cr_assert_geq(ds.total.bytes_out, ds.relayed.bytes_out, "and inside the carrier's wire bytes");

  /* a graceful close ends the circuit at the relay; the carriers stay */
  net_conn_close(out);
  RUN_UNTIL(relayed_closed == 2, 5);
  cr_assert_eq(relayed_closed, 2);
  cr_assert_eq(relayed_close_status, 0, "graceful: %s", relayed_close_detail);
  RUN_UNTIL(({ net_stats_get(relay.net, &rs); rs.relay_circuits == 0; }), 5);
  cr_assert_eq(rs.relay_circuits, 0);
  cr_assert_eq(relay.closed, 0, "the relay's connections stay open");
  free(a);
  free(b);
  finish();
  free(natted.rx_buf);
  free(dialer.rx_buf);
}

Test(net_relay, a_relay_cannot_forge_or_misdirect, .init = setup, .timeout = 60) {
  register_natted();
  /* a relay that answers for another key: the dialer refuses the peer */
  uint8_t other[NET_PUBKEY_BYTES];
  randombytes_buf(other, sizeof other);
  net_test_relay_misbehave(relay.net, false, 0, true);
  char ra[64];
  relay_addr(ra, sizeof ra);
  cr_assert_eq(net_dial_via(dialer.net, ra, other, tp_dial_cb, &dialer), 0);
  RUN_UNTIL(dialer.dial_ok + dialer.dial_fail > 0, 5);
  cr_assert_eq(dialer.dial_fail, 1, "a peer with another key than asked for is refused");
  cr_assert_eq(dialer.dial_status, RUMOR_EAUTH, "status %d: %s", dialer.dial_status, dialer.dial_detail);
  cr_assert(strstr(dialer.dial_detail, "is not"), "detail: %s", dialer.dial_detail);

  /* a relay that flips a bit of a forwarded frame: authentication fails */
  net_test_relay_misbehave(relay.net, false, 0, false);
  dialer.dial_fail = 0;
  net_conn_t *out = dial_natted();
  natted.conn = relayed_in;
  natted.rx_buf = calloc(COUNT, sizeof(float));
  natted.rx_cap = COUNT;
  float *a = pattern(COUNT, 1.0f);
  struct net_stats rs;
  net_stats_get(relay.net, &rs);
  net_test_relay_misbehave(relay.net, true, rs.relay_bytes + 100000, false);
  dialer.conn = out;
  cr_assert_eq(tpeer_send_bulk(&dialer, a, COUNT, NET_DTYPE_F32), 0);
  RUN_UNTIL(dialer.sent_done && relayed_closed >= 1, 20);
  cr_assert_eq(dialer.sent_done, 1);
  cr_assert_neq(dialer.sent_status, 0, "the tampered transfer did not succeed");
  cr_assert_eq(natted.bulk_ok, 0);
  cr_assert_geq(relayed_closed, 1, "the circuit connection was dropped");
  struct net_stats ns;
  net_stats_get(natted.net, &ns);
  cr_assert_geq(ns.dropped_violation, 1, "the NATed side found a frame that failed authentication");
  cr_assert_eq(relay.closed, 0, "the carriers survive a dropped circuit");
  free(a);
  finish();
  free(natted.rx_buf);
}

Test(net_relay, refusals_name_their_reason, .init = setup, .timeout = 30) {
  relay.cfg.relay = false;
  cr_assert_eq(try_register_natted(), -EPERM, "a member without --relay refuses to take circuits");
  char ra[64];
  relay_addr(ra, sizeof ra);
  /* a target that is registered nowhere */
  cr_assert_eq(net_dial_via(dialer.net, ra, natted.id.pk, tp_dial_cb, &dialer), 0);
  RUN_UNTIL(dialer.dial_ok + dialer.dial_fail > 0, 5);
  cr_assert_eq(dialer.dial_fail, 1);
  cr_assert(strstr(dialer.dial_detail, "does not relay"), "detail: %s", dialer.dial_detail);
  cr_assert_eq(net_dial_via(dialer.net, "no-port", natted.id.pk, tp_dial_cb, &dialer), RUMOR_EFORMAT);
  finish();
}

Test(net_relay, unregistered_target_is_unreachable, .init = setup, .timeout = 30) {
  start(&relay, true);
  start(&natted, false);
  start(&dialer, false);
  char ra[64];
  relay_addr(ra, sizeof ra);
  cr_assert_eq(net_dial_via(dialer.net, ra, natted.id.pk, tp_dial_cb, &dialer), 0);
  RUN_UNTIL(dialer.dial_ok + dialer.dial_fail > 0, 5);
  cr_assert_eq(dialer.dial_fail, 1);
  cr_assert_eq(dialer.dial_status, -EHOSTUNREACH, "status %d: %s", dialer.dial_status, dialer.dial_detail);
  finish();
}

Test(net_relay, a_relay_that_dies_costs_its_circuits_only, .init = setup, .timeout = 60) {
  float *a = relayed_transfer(2.0f);
  RUN_UNTIL(natted.bulk_begins > 0, 10);
  /* the relay goes away mid-transfer */
  net_close(relay.net, tp_net_closed, &relay);
  RUN_UNTIL(dialer.sent_done && listen_calls >= 2 && relayed_closed == 2, 10);
  cr_assert_eq(dialer.sent_done, 1);
  cr_assert_neq(dialer.sent_status, 0);
  cr_assert_eq(relayed_closed, 2, "both ends of the circuit closed");
  cr_assert(strstr(relayed_close_detail, "relay"), "the reason names the relay: %s", relayed_close_detail);
  cr_assert_eq(listen_calls, 2, "the NATed peer learns that its registration ended");
  cr_assert_lt(listen_status, 0);
  /* both nets still work: a direct connection between them */
  cr_assert_eq(net_listen(natted.net, "127.0.0.1:0", NULL), 0);
  dialer.dial_ok = 0;
  tpeer_dial_port(&dialer, net_listen_port(natted.net));
  RUN_UNTIL(dialer.dial_ok, 5);
  cr_assert_eq(dialer.dial_ok, 1);
  free(a);
  finish();
  free(natted.rx_buf);
}

Test(net_relay, a_relay_over_its_rate_cap_reads_no_faster_and_loses_nothing, .init = setup, .timeout = 60) {
  relay.cfg.relay_rate_bytes = 4u << 20; /* 4 MB/s from one peer: 12 MB cannot pass in one bucket */
  float *a = relayed_transfer(0.75f);
  RUN_UNTIL(dialer.sent_done && natted.bulk_done, 30);
  cr_assert_eq(dialer.sent_status, 0);
  cr_assert_eq(natted.bulk_ok, 1);
  cr_assert_eq(memcmp(natted.rx_buf, a, COUNT * sizeof(float)), 0, "bit-exact through a capped relay");
  struct net_stats rs;
  net_stats_get(relay.net, &rs);
  cr_assert_gt(rs.relay_holds, 0, "the cap held the sender back (holds %llu)", (unsigned long long)rs.relay_holds);
  free(a);
  finish();
  free(natted.rx_buf);
}
