/*
 * Happy paths over real TCP on 127.0.0.1: the handshake, control messages,
 * a 100 MB buffer arriving bit-exact (one way and both ways at once), f16,
 * bf16 and i8 wire encodings, refusal and cancellation, graceful close.
 */
#include <errno.h>
#include <math.h>

#include "test_net_helpers.h"

#define BIG_COUNT (25u * 1000u * 1000u) /* 100 MB of float32 */

static struct tpeer srv, cli;

static void setup(void) {
  tloop_init();
  tkeys_init();
  tpeer_setup(&srv, "server");
  tpeer_setup(&cli, "client");
}

/* Starts both nets and connects the client; both sides see the connection. */
static void connect_pair(void) {
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  tpeer_dial_port(&cli, net_listen_port(srv.net));
  RUN_UNTIL(cli.dial_ok + cli.dial_fail > 0 && srv.accepted > 0, 5);
  cr_assert_eq(cli.dial_ok, 1, "dial succeeded: %s", cli.dial_detail);
  cr_assert_eq(srv.accepted, 1);
}

static void finish(void) {
  struct tpeer *ps[] = {&srv, &cli};
  tnet_finish(ps, 2);
}

static float *random_floats(uint64_t n, uint64_t seed, float scale) {
  float *v = malloc(n * sizeof *v);
  cr_assert(v);
  struct rng r;
  rng_seed(&r, seed, 0);
  for (uint64_t i = 0; i < n; i++) v[i] = scale * rng_normal(&r);
  return v;
}

Test(net_transfer, handshake_authenticates_both_identities_and_closes_clean, .init = setup) {
  connect_pair();
  cr_assert_eq(memcmp(net_conn_peer_key(cli.conn), srv.id.pk, NET_PUBKEY_BYTES), 0, "client sees the server's key");
  cr_assert_eq(memcmp(net_conn_peer_key(srv.conn), cli.id.pk, NET_PUBKEY_BYTES), 0, "server sees the client's key");
  cr_assert(net_conn_inbound(srv.conn) && !net_conn_inbound(cli.conn));
  cr_assert_eq(net_conn_suite(cli.conn), NET_SUITE_AES256GCM, "AES-256-GCM is preferred when both have it");
  cr_assert(strncmp(net_conn_peer_addr(srv.conn), "127.0.0.1:", 10) == 0, "addr %s", net_conn_peer_addr(srv.conn));
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_ok, 1);
  cr_assert_eq(st.hs_failed, 0);
  cr_assert_eq(st.conns_open, 1);
  /* graceful close from the client: both sides report status 0 */
  net_conn_close(cli.conn);
  RUN_UNTIL(cli.closed && srv.closed, 5);
  cr_assert_eq(cli.closed, 1);
  cr_assert_eq(srv.closed, 1);
  cr_assert_eq(cli.close_status, 0, "client close: %s", cli.close_detail);
  cr_assert_eq(srv.close_status, 0, "server close: %s", srv.close_detail);
  finish();
}

Test(net_transfer, control_messages_arrive_in_order_with_typed_fields, .init = setup) {
  connect_pair();
  for (uint64_t i = 0; i < 1000; i++) cr_assert_eq(tpeer_send_msg(&cli, 7, i), 0);
  RUN_UNTIL(srv.msgs == 1000, 10);
  cr_assert_eq(srv.msgs, 1000);
  cr_assert(srv.msgs_in_order);
  cr_assert_eq(srv.last_type, 7);
  struct net_conn_stats cs;
  net_conn_stats_get(cli.conn, &cs);
  cr_assert_eq(cs.msgs_out, 1000);
  cr_assert_gt(cs.bytes_out, 1000 * NET_FRAME_OVERHEAD);
  finish();
}

Test(net_transfer, chacha20poly1305_is_used_when_one_side_lacks_aes, .init = setup) {
  cli.cfg.suites = NET_SUITE_CHACHA20POLY1305;
  connect_pair();
  cr_assert_eq(net_conn_suite(cli.conn), NET_SUITE_CHACHA20POLY1305);
  cr_assert_eq(net_conn_suite(srv.conn), NET_SUITE_CHACHA20POLY1305);
  float v[1000];
  for (int i = 0; i < 1000; i++) v[i] = (float)i;
  srv.rx_buf = calloc(1000, sizeof(float));
  srv.rx_cap = 1000;
  cr_assert_eq(tpeer_send_bulk(&cli, v, 1000, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done, 5);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(memcmp(v, srv.rx_buf, sizeof v), 0);
  finish();
}

Test(net_transfer, buffer_of_100MB_arrives_bit_exact, .init = setup, .timeout = 120) {
  float *src = random_floats(BIG_COUNT, 1, 1.0f);
  connect_pair();
  srv.rx_buf = malloc(BIG_COUNT * sizeof(float));
  memset(srv.rx_buf, 0xff, BIG_COUNT * sizeof(float));
  srv.rx_cap = BIG_COUNT;
  double t0 = clock_now_s();
  cr_assert_eq(tpeer_send_bulk(&cli, src, BIG_COUNT, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done && srv.bulk_done, 60);
  double dt = clock_now_s() - t0;
  cr_assert_eq(srv.bulk_begins, 1);
  cr_assert_eq(srv.bulk_done, 1);
  cr_assert_eq(srv.bulk_status, 0, "receiver status %d", srv.bulk_status);
  cr_assert_eq(cli.sent_status, 0, "sender status %d", cli.sent_status);
  cr_assert_eq(srv.bulk_count, BIG_COUNT);
  cr_assert_str_eq(srv.meta, "meta!");
  cr_assert_eq(memcmp(src, srv.rx_buf, BIG_COUNT * sizeof(float)), 0, "bit-exact");
  fprintf(stderr, "100 MB one way in one process: %.3f s\n", dt);
  struct net_stats st;
  net_stats_get(cli.net, &st);
  cr_assert_geq(st.total.bytes_out, (uint64_t)BIG_COUNT * 4);
  cr_assert_eq(st.total.bulk_out_ok, 1);
  /* The kernel's counters (what the ring judges a link by) are the
   * sender's socket's: at least a segment per 64 KiB sent (loopback's MSS
   * is 64 KiB less headers), a receiver that sent little far fewer. */
  struct net_tcp_path cp, sp;
  int rc = net_conn_tcp_path(cli.conn, &cp);
  if (rc == -ENOTSUP) cr_skip_test("this kernel has no tcpi_data_segs_out");
  cr_assert_eq(rc, 0, "net_conn_tcp_path: %d", rc);
  cr_assert_eq(net_conn_tcp_path(srv.conn, &sp), 0);
  cr_assert_geq(cp.data_segs_out, st.total.bytes_out / 65536, "%llu segments for %llu bytes",
                (unsigned long long)cp.data_segs_out, (unsigned long long)st.total.bytes_out);
  cr_assert_leq(cp.retrans_segs, cp.data_segs_out);
  cr_assert_lt(sp.data_segs_out * 100, cp.data_segs_out, "the receiver sent %llu segments, the sender %llu",
               (unsigned long long)sp.data_segs_out, (unsigned long long)cp.data_segs_out);
  free(src);
  finish();
}

Test(net_transfer, both_directions_at_once_like_a_gossip_exchange, .init = setup, .timeout = 120) {
  float *a = random_floats(BIG_COUNT, 2, 1.0f), *b = random_floats(BIG_COUNT, 3, 1.0f);
  connect_pair();
  srv.rx_buf = malloc(BIG_COUNT * sizeof(float));
  srv.rx_cap = BIG_COUNT;
  cli.rx_buf = malloc(BIG_COUNT * sizeof(float));
  cli.rx_cap = BIG_COUNT;
  cr_assert_eq(tpeer_send_bulk(&cli, a, BIG_COUNT, NET_DTYPE_F32), 0);
  cr_assert_eq(tpeer_send_bulk(&srv, b, BIG_COUNT, NET_DTYPE_F32), 0);
  /* Control messages keep flowing during the transfer. */
  for (uint64_t i = 0; i < 10; i++) cr_assert_eq(tpeer_send_msg(&srv, 9, i), 0);
  RUN_UNTIL(cli.sent_done && srv.sent_done && cli.bulk_done && srv.bulk_done, 90);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.sent_status, 0);
  cr_assert_eq(srv.bulk_status, 0);
  cr_assert_eq(cli.bulk_status, 0);
  cr_assert_eq(cli.msgs, 10);
  cr_assert_eq(memcmp(a, srv.rx_buf, BIG_COUNT * sizeof(float)), 0);
  cr_assert_eq(memcmp(b, cli.rx_buf, BIG_COUNT * sizeof(float)), 0);
  free(a);
  free(b);
  finish();
}

/* |got - ref| <= atol + rtol * |ref| for every element, with the worst printed. */
static void check_close(const float *got, const float *ref, uint64_t n, double atol, double rtol, const char *what) {
  double worst = 0;
  uint64_t wi = 0;
  for (uint64_t i = 0; i < n; i++) {
    cr_assert(isfinite(got[i]), "%s: element %llu is not finite", what, (unsigned long long)i);
    double err = fabs((double)got[i] - ref[i]) - (atol + rtol * fabs(ref[i]));
    if (err > worst || i == 0) {
      worst = err;
      wi = i;
    }
  }
  cr_assert_leq(worst, 0.0, "%s: worst element %llu: got %g, want %g", what, (unsigned long long)wi, got[wi], ref[wi]);
}

static void half_roundtrip(enum net_dtype wire, double rtol) {
  const uint64_t n = 3u * 1000u * 1000u + 17; /* not a multiple of the chunk */
  connect_pair();
  float *src = random_floats(n, 4, 3.0f);
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, src, n, wire), 0);
  RUN_UNTIL(cli.sent_done && srv.bulk_done, 60);
  cr_assert_eq(srv.bulk_status, 0);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.bulk_wire, wire);
  check_close(srv.rx_buf, src, n, 1e-7, rtol, net_dtype_name(wire));
  /* and exactly what the reference conversion gives */
  for (uint64_t i = 0; i < n; i += 997) {
    float want = wire == NET_DTYPE_F16 ? half_to_f32(half_from_f32(src[i])) : bf16_to_f32(bf16_from_f32(src[i]));
    cr_assert_eq(srv.rx_buf[i], want, "element %llu", (unsigned long long)i);
  }
  struct net_conn_stats cs;
  net_conn_stats_get(cli.conn, &cs);
  cr_assert_lt(cs.bytes_out, n * 2 + (1u << 20), "half the bytes on the wire");
  free(src);
  finish();
}

Test(net_transfer, f16_wire_round_trip_within_tolerance, .init = setup, .timeout = 60) {
  half_roundtrip(NET_DTYPE_F16, 1.0 / 2048);
}

Test(net_transfer, bf16_wire_round_trip_within_tolerance, .init = setup, .timeout = 60) {
  half_roundtrip(NET_DTYPE_BF16, 1.0 / 256);
}

/* i8 over a real connection: what the reference encoding gives (the
 * sender's chunks are whole blocks, so chunking changes nothing), within
 * absmax/254 of every block, a poisoned block still poisoned, and about a
 * quarter of f32's bytes on the wire. */
Test(net_transfer, i8_wire_round_trip_within_a_block_bound_and_keeps_nan, .init = setup, .timeout = 60) {
  const uint64_t n = 3u * 1000u * 1000u + 17; /* not a multiple of the chunk nor of the block */
  connect_pair();
  float *src = random_floats(n, 5, 3.0f);
  const uint64_t poisoned = 2u * 1000u * 1000u + 3; /* a NaN: its block must arrive non-finite */
  src[poisoned] = NAN;
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, src, n, NET_DTYPE_I8), 0);
  RUN_UNTIL(cli.sent_done && srv.bulk_done, 60);
  cr_assert_eq(srv.bulk_status, 0);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.bulk_wire, NET_DTYPE_I8);
  uint8_t *enc = malloc((size_t)net_dtype_bytes(NET_DTYPE_I8, n));
  float *want = malloc(n * sizeof(float));
  net_i8_encode_ref(enc, src, (size_t)n);
  net_i8_decode_ref(want, enc, (size_t)n);
  double worst = 0;
  for (uint64_t b = 0; b < n; b += NET_I8_BLOCK) {
    uint64_t end = b + NET_I8_BLOCK < n ? b + NET_I8_BLOCK : n;
    bool bad = poisoned >= b && poisoned < end;
    double m = 0;
    for (uint64_t i = b; i < end; i++) m = fmax(m, fabs((double)src[i]));
    for (uint64_t i = b; i < end; i++) {
      float got = srv.rx_buf[i];
      if (bad) {
        cr_assert(!isfinite(got), "element %llu of the poisoned block arrived finite", (unsigned long long)i);
        continue;
      }
      cr_assert(memcmp(&got, &want[i], 4) == 0, "element %llu: got %a, reference %a", (unsigned long long)i,
                (double)got, (double)want[i]);
      double err = fabs((double)got - src[i]);
      cr_assert_leq(err, m / 254 + m * 4e-7, "element %llu: error %g, absmax %g", (unsigned long long)i, err, m);
      if (m > 0 && err / (m / 254) > worst) worst = err / (m / 254);
    }
  }
  cr_log_info("i8: worst error %.4f of absmax/254", worst);
  struct net_conn_stats cs;
  net_conn_stats_get(cli.conn, &cs);
  cr_assert_lt(cs.bytes_out, net_dtype_bytes(NET_DTYPE_I8, n) + (1u << 20), "about a byte per value on the wire");
  free(enc);
  free(want);
  free(src);
  finish();
}

Test(net_transfer, refused_transfer_reports_to_the_sender_and_the_connection_survives, .init = setup) {
  connect_pair();
  srv.refuse = true;
  float *v = random_floats(3u << 20, 5, 1.0f);
  cr_assert_eq(tpeer_send_bulk(&cli, v, 3u << 20, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done, 10);
  cr_assert_eq(cli.sent_status, -ECONNREFUSED);
  cr_assert_eq(srv.bulk_done, 0, "a refused transfer never reaches on_bulk_done");
  /* the next transfer on the same connection works */
  srv.refuse = false;
  srv.rx_buf = malloc((3u << 20) * sizeof(float));
  srv.rx_cap = 3u << 20;
  cli.sent_done = 0;
  cr_assert_eq(tpeer_send_bulk(&cli, v, 3u << 20, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done && srv.bulk_done, 10);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.bulk_status, 0);
  cr_assert_eq(memcmp(v, srv.rx_buf, (3u << 20) * sizeof(float)), 0);
  free(v);
  finish();
}

Test(net_transfer, canceled_send_fails_on_both_sides_and_the_connection_survives, .init = setup) {
  connect_pair();
  const uint64_t n = 20u << 20;
  float *v = random_floats(n, 6, 1.0f);
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  struct net_bulk_send s = {.src = v, .count = n, .wire = NET_DTYPE_F32, .done = tp_sent_cb, .arg = &cli};
  uint64_t id;
  cr_assert_eq(net_conn_send_bulk(cli.conn, &s, &id), 0);
  RUN_UNTIL(srv.bulk_begins == 1, 5);
  cr_assert_eq(net_conn_cancel_send(cli.conn, id), 0);
  /* done runs at once, or as soon as worker threads stop reading the buffer */
  RUN_UNTIL(cli.sent_done, 5);
  cr_assert_eq(cli.sent_done, 1);
  cr_assert_eq(cli.sent_status, RUMOR_ECANCELED);
  RUN_UNTIL(srv.bulk_done, 5);
  cr_assert_eq(srv.bulk_done, 1);
  cr_assert_eq(srv.bulk_status, RUMOR_ECANCELED, "the receiver is told, never half-delivered");
  cr_assert_eq(net_conn_cancel_send(cli.conn, id), RUMOR_ENOTFOUND);
  cr_assert_eq(tpeer_send_msg(&cli, 1, 0), 0);
  RUN_UNTIL(srv.msgs == 1, 5);
  cr_assert_eq(srv.msgs, 1, "the connection still works");
  free(v);
  finish();
}

Test(net_transfer, canceled_receive_tells_the_sender, .init = setup) {
  connect_pair();
  const uint64_t n = 20u << 20;
  float *v = random_floats(n, 7, 1.0f);
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, v, n, NET_DTYPE_F32), 0);
  RUN_UNTIL(srv.bulk_begins == 1, 5);
  cr_assert_eq(net_conn_cancel_recv(srv.conn, 1), 0);
  RUN_UNTIL(srv.bulk_done, 5);
  cr_assert_eq(srv.bulk_done, 1);
  cr_assert_eq(srv.bulk_status, RUMOR_ECANCELED);
  RUN_UNTIL(cli.sent_done, 10);
  cr_assert_eq(cli.sent_status, RUMOR_ECANCELED);
  cr_assert_eq(srv.bulk_done, 1, "on_bulk_done exactly once");
  free(v);
  finish();
}

Test(net_transfer, zero_element_and_tiny_transfers_work, .init = setup) {
  connect_pair();
  srv.rx_buf = malloc(16 * sizeof(float));
  srv.rx_cap = 16;
  float v[3] = {1, 2, 3};
  cr_assert_eq(tpeer_send_bulk(&cli, v, 0, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done == 1, 5);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(tpeer_send_bulk(&cli, v, 3, NET_DTYPE_F16), 0);
  RUN_UNTIL(cli.sent_done == 2 && srv.bulk_done == 2, 5);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.bulk_ok, 2);
  cr_assert_eq(srv.rx_buf[2], 3.0f);
  finish();
}

Test(net_transfer, closing_the_net_calls_every_pending_callback_once, .init = setup) {
  connect_pair();
  const uint64_t n = 30u << 20;
  float *v = random_floats(n, 8, 1.0f);
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, v, n, NET_DTYPE_F32), 0);
  cr_assert_eq(tpeer_send_bulk(&cli, v, n, NET_DTYPE_F32), 0); /* queued behind the first */
  RUN_UNTIL(srv.bulk_begins == 1, 5);
  net_close(cli.net, tp_net_closed, &cli);
  RUN_UNTIL(cli.closed_net && srv.closed, 10);
  cr_assert_eq(cli.sent_done, 2, "both sends completed once");
  cr_assert_neq(cli.sent_status, 0);
  cr_assert_eq(cli.closed, 1, "on_close once");
  cr_assert_eq(srv.bulk_done, 1, "receiver told once");
  cr_assert_neq(srv.bulk_status, 0);
  cr_assert_eq(srv.bulk_ok, 0);
  free(v);
  finish();
}

Test(net_transfer, the_inline_crypto_path_delivers_too, .init = setup, .timeout = 120) {
  /* offload off on the client, on at the server: both code paths, both ways */
  cli.cfg.offload = false;
  connect_pair();
  const uint64_t n = 7u * 1000u * 1000u + 3;
  float *a = random_floats(n, 9, 1.0f), *b = random_floats(n, 10, 2.0f);
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cli.rx_buf = malloc(n * sizeof(float));
  cli.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, a, n, NET_DTYPE_F32), 0);
  cr_assert_eq(tpeer_send_bulk(&srv, b, n, NET_DTYPE_F16), 0);
  RUN_UNTIL(cli.sent_done && srv.sent_done && cli.bulk_done && srv.bulk_done, 60);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.sent_status, 0);
  cr_assert_eq(memcmp(a, srv.rx_buf, n * sizeof(float)), 0);
  for (uint64_t i = 0; i < n; i += 101) cr_assert_eq(cli.rx_buf[i], half_to_f32(half_from_f32(b[i])));
  free(a);
  free(b);
  finish();
}
