/*
 * Bounds on what a peer can make us do: frames declaring huge lengths,
 * msgpack bombs, slow and idle peers, floods of unauthenticated connections,
 * a receiver that stops reading (backpressure), oversized transfers, and the
 * thread hand-off.
 */
#include <pthread.h>
#include <stdatomic.h>

#include "test_net_helpers.h"

static struct tpeer srv, cli;

static void setup(void) {
  tloop_init();
  tkeys_init();
  tpeer_setup(&srv, "server");
  tpeer_setup(&cli, "client");
}

static void finish(void) {
  struct tpeer *ps[] = {&srv, &cli};
  tnet_finish(ps, 2);
}

static void connect_once(void) {
  int ok0 = cli.dial_ok, acc0 = srv.accepted;
  tpeer_dial_port(&cli, net_listen_port(srv.net));
  RUN_UNTIL(cli.dial_ok > ok0 && srv.accepted > acc0, 5);
  cr_assert_eq(cli.dial_ok, ok0 + 1, "%s", cli.dial_detail);
}

static void start_pair(void) {
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
}

/* ---- huge declared lengths ---------------------------------------------------- */

struct mem {
  uint64_t vm, rss, heap;
};
static struct mem mem_now(void) {
  struct mem m;
  mem_usage(&m.vm, &m.rss);
  m.heap = heap_in_use();
  return m;
}
static void assert_growth_below(struct mem a, struct mem b, uint64_t limit, const char *what) {
  int64_t dvm = (int64_t)(b.vm - a.vm), drss = (int64_t)(b.rss - a.rss), dheap = (int64_t)(b.heap - a.heap);
  cr_log_info("%s: growth vm %lld B, rss %lld B, heap %lld B", what, (long long)dvm, (long long)drss, (long long)dheap);
  cr_assert_lt(dvm, (int64_t)limit, "%s: virtual memory grew by %lld bytes", what, (long long)dvm);
  cr_assert_lt(drss, (int64_t)limit, "%s: resident memory grew by %lld bytes", what, (long long)drss);
  cr_assert_lt(dheap, (int64_t)limit, "%s: heap grew by %lld bytes", what, (long long)dheap);
}

Test(net_limits, a_frame_declaring_4GiB_is_rejected_with_less_than_1MiB_of_growth, .init = setup) {
  start_pair();
  const uint8_t types[] = {NET_FRAME_MSG, NET_FRAME_BULK_BEGIN, NET_FRAME_BULK_DATA, 0x42};
  for (size_t i = 0; i < sizeof types; i++) {
    connect_once();
    run_for(0.05); /* settle: both sides have their buffers */
    int closed0 = srv.closed;
    struct mem before = mem_now();
    uint8_t hdr[NET_FRAME_HDR] = {0xff, 0xff, 0xff, 0xff, types[i]};
    cr_assert_eq(net_test_conn_write_raw(cli.conn, hdr, sizeof hdr), 0);
    RUN_UNTIL(srv.closed > closed0, 5);
    struct mem after = mem_now();
    cr_assert_eq(srv.closed, closed0 + 1, "the server drops the connection");
    cr_assert_neq(srv.close_status, 0);
    assert_growth_below(before, after, 1u << 20, "4 GiB frame");
    RUN_UNTIL(cli.conn == NULL, 5);
  }
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.dropped_violation, sizeof types);
  cr_assert_eq(srv.msgs + srv.bulk_begins, 0);
  finish();
}

Test(net_limits, an_oversized_handshake_message_is_rejected_before_reading_it, .init = setup) {
  start_pair();
  struct mem before = mem_now();
  struct traw r;
  traw_connect(&r, net_listen_port(srv.net));
  const uint8_t big[] = {0xff, 0xff, 'r', 'u', 'm', 'r'};
  traw_write(&r, big, sizeof big);
  RUN_UNTIL(r.eof, 5);
  cr_assert(r.eof);
  struct mem after = mem_now();
  assert_growth_below(before, after, 1u << 20, "65535-byte handshake message");
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_MALFORMED], 1);
  traw_close(&r);
  finish();
}

/* ---- msgpack bombs over an authenticated connection ------------------------------ */

struct bomb {
  uint8_t b[256];
  size_t n;
  const char *name;
};

static size_t wrap_in_map(uint8_t *out, const uint8_t *v, size_t n) {
  out[0] = 0x81; /* {"x": v} */
  out[1] = 0xa1;
  out[2] = 'x';
  memcpy(out + 3, v, n);
  return n + 3;
}

static void make_bombs(struct bomb *bs, size_t *count) {
  size_t k = 0;
  const uint8_t a32ff[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
  const uint8_t a32_20[] = {0xdd, 0x20, 0x00, 0x00, 0x00};
  const uint8_t m32ff[] = {0xdf, 0xff, 0xff, 0xff, 0xff};
  const uint8_t s32ff[] = {0xdb, 0xff, 0xff, 0xff, 0xff};
  const uint8_t b32ff[] = {0xc6, 0xff, 0xff, 0xff, 0xff};
  const uint8_t *raw[] = {a32ff, a32_20, m32ff, s32ff, b32ff};
  const char *names[] = {"dd ff ff ff ff", "dd 20 00 00 00", "df ff ff ff ff", "str32 4G", "bin32 4G"};
  for (size_t i = 0; i < 5; i++) {
    memcpy(bs[k].b, raw[i], 5);
    bs[k].n = 5;
    bs[k++].name = names[i];
    bs[k].n = wrap_in_map(bs[k].b, raw[i], 5);
    bs[k++].name = names[i];
  }
  /* 32 nested array32 headers, each declaring 1 element */
  uint8_t nest[32 * 5 + 1];
  for (int i = 0; i < 32; i++) memcpy(nest + 5 * i, (const uint8_t[]){0xdd, 0, 0, 0, 1}, 5);
  nest[160] = 0xc0;
  memcpy(bs[k].b, nest, sizeof nest);
  bs[k].n = sizeof nest;
  bs[k++].name = "32 nested array32 headers";
  bs[k].n = wrap_in_map(bs[k].b, nest, sizeof nest);
  bs[k++].name = "32 nested array32 headers in a map";
  /* depth 33: 32 fixarrays of one element inside the map */
  uint8_t deep[33];
  memset(deep, 0x91, 32);
  deep[32] = 0xc0;
  bs[k].n = wrap_in_map(bs[k].b, deep, 33);
  bs[k++].name = "depth 33";
  /* an ext type and a timestamp */
  const uint8_t ext[] = {0xd6, 0xff, 0, 0, 0, 0};
  bs[k].n = wrap_in_map(bs[k].b, ext, sizeof ext);
  bs[k++].name = "ext/timestamp";
  *count = k;
}

Test(net_limits, msgpack_bombs_are_rejected_without_calling_the_decoder, .init = setup) {
  start_pair();
  struct bomb bs[20];
  size_t nb = 0;
  make_bombs(bs, &nb);
  uint64_t calls0 = net_test_msgpack_decoder_calls();
  for (size_t i = 0; i < nb; i++) {
    connect_once();
    int closed0 = srv.closed;
    struct mem before = mem_now();
    cr_assert_eq(net_test_conn_send_frame(cli.conn, NET_FRAME_MSG, 0, 0, bs[i].b, bs[i].n), 0);
    RUN_UNTIL(srv.closed > closed0, 5);
    cr_assert_eq(srv.closed, closed0 + 1, "%s: the connection is dropped", bs[i].name);
    assert_growth_below(before, mem_now(), 1u << 20, bs[i].name);
    RUN_UNTIL(cli.conn == NULL, 5);
  }
  cr_assert_eq(net_test_msgpack_decoder_calls(), calls0, "msgpack-c never saw a bomb");
  cr_assert_eq(srv.msgs, 0);
  /* and a good message still goes through the decoder */
  connect_once();
  cr_assert_eq(tpeer_send_msg(&cli, 1, 0), 0);
  RUN_UNTIL(srv.msgs == 1, 5);
  cr_assert_eq(net_test_msgpack_decoder_calls(), calls0 + 1);
  finish();
}

/* ---- slow and idle peers, floods -------------------------------------------------- */

Test(net_limits, a_client_sending_one_byte_a_second_is_dropped_at_the_handshake_timeout, .init = setup,
     .timeout = 30) {
  srv.cfg.handshake_timeout_ms = 1500;
  start_pair();
  static uint8_t hello[NET_HS_LEN_BYTES + NET_HS_HELLO_LEN];
  net_be16_put(hello, NET_HS_HELLO_LEN);
  memcpy(hello + 2, NET_MAGIC, 4);
  struct traw r;
  traw_connect(&r, net_listen_port(srv.net));
  double t0 = clock_now_s();
  traw_drip(&r, hello, sizeof hello, 1000);
  RUN_UNTIL(r.eof, 10);
  cr_assert(r.eof, "the server hung up");
  double dt = r.eof_at - t0;
  cr_assert(dt > 1.3 && dt < 3.0, "dropped after %.2f s (timeout 1.5 s)", dt);
  cr_assert_leq(r.drip_pos, 3, "only a couple of bytes got through");
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_TIMEOUT], 1);
  traw_close(&r);
  finish();
}

Test(net_limits, unauthenticated_connections_beyond_the_cap_are_refused, .init = setup, .timeout = 30) {
  srv.cfg.max_pending_handshakes = 3;
  srv.cfg.handshake_timeout_ms = 800;
  start_pair();
  struct traw r[4];
  for (int i = 0; i < 4; i++) traw_connect(&r[i], net_listen_port(srv.net));
  RUN_UNTIL(r[3].eof, 0.5);
  cr_assert(r[3].eof, "the fourth is closed at once");
  cr_assert(!r[0].eof && !r[1].eof && !r[2].eof, "the first three wait for their deadline");
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_BUSY], 1);
  RUN_UNTIL(r[0].eof && r[1].eof && r[2].eof, 3);
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_TIMEOUT], 3);
  for (int i = 0; i < 4; i++) traw_close(&r[i]);
  connect_once(); /* room again */
  finish();
}

/* An idle connection whose peer heartbeats is closed with a BYE: the peer
 * is alive (bench-chaos: a cut at the 120 s idle limit made a gossip
 * member suspect a live peer and fail an all-reduce round). */
Test(net_limits, an_idle_connection_to_a_live_peer_is_closed_gracefully_after_the_idle_timeout, .init = setup) {
  srv.cfg.idle_timeout_ms = 300;
  cli.cfg.idle_timeout_ms = 0; /* never */
  cli.cfg.heartbeat_ms = 100;  /* it PINGs before the limit */
  start_pair();
  connect_once();
  double t0 = clock_now_s();
  RUN_UNTIL(srv.closed && cli.closed, 5);
  double dt = clock_now_s() - t0;
  cr_assert_eq(srv.close_status, 0, "%s", srv.close_detail);
  cr_assert_eq(cli.close_status, 0, "the other side sees a BYE, not a cut: %s", cli.close_detail);
  cr_assert(dt > 0.25 && dt < 2.0, "closed after %.2f s", dt);
  finish();
}

/* A peer that never PINGs (its heartbeat off) may be gone: cut. */
Test(net_limits, an_idle_connection_is_closed_after_the_idle_timeout, .init = setup) {
  srv.cfg.idle_timeout_ms = 300;
  cli.cfg.idle_timeout_ms = 0; /* never */
  cli.cfg.heartbeat_ms = 0;
  start_pair();
  connect_once();
  double t0 = clock_now_s();
  RUN_UNTIL(srv.closed && cli.closed, 5);
  double dt = clock_now_s() - t0;
  cr_assert_eq(srv.close_status, RUMOR_ETIMEDOUT, "%s", srv.close_detail);
  cr_assert_eq(cli.close_status, -ECONNRESET, "the other side sees a cut: %s", cli.close_detail);
  cr_assert(dt > 0.25 && dt < 2.0, "closed after %.2f s", dt);
  finish();
}

Test(net_limits, traffic_keeps_a_connection_alive, .init = setup) {
  srv.cfg.idle_timeout_ms = 300;
  start_pair();
  connect_once();
  for (int i = 0; i < 10; i++) {
    cr_assert_eq(tpeer_send_msg(&cli, 1, (uint64_t)i), 0);
    run_for(0.1);
  }
  cr_assert_eq(srv.closed, 0);
  cr_assert_eq(srv.msgs, 10);
  finish();
}

/* ---- backpressure ------------------------------------------------------------------ */

static size_t g_max_queued;
static net_conn_t *g_watch;
static void watch_cb(uv_check_t *h) {
  (void)h;
  if (g_watch) {
    size_t q = net_conn_queued_bytes(g_watch);
    if (q > g_max_queued) g_max_queued = q;
  }
}

Test(net_limits, a_receiver_that_stops_reading_does_not_grow_the_senders_queue_past_the_cap, .init = setup,
     .timeout = 60) {
  const size_t cap = 3u << 20;
  const uint64_t n = 64u << 20 >> 2; /* 64 MB */
  cli.cfg.max_queued_bytes = cap;
  srv.cfg.idle_timeout_ms = cli.cfg.idle_timeout_ms = 10000;
  start_pair();
  connect_once();
  uv_check_t check;
  uv_check_init(&g_loop, &check);
  uv_check_start(&check, watch_cb);
  g_watch = cli.conn;
  cr_assert_eq(net_test_conn_pause_read(srv.conn, true), 0);
  float *src = calloc(n, sizeof(float));
  for (uint64_t i = 0; i < n; i++) src[i] = (float)i;
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  /* Warm up first: worker threads, their stacks and malloc arenas, and the
   * crypto library's one-time set-up are not what this test measures. */
  cr_assert_eq(net_test_conn_pause_read(srv.conn, false), 0);
  cr_assert_eq(tpeer_send_bulk(&cli, src, 4u << 20, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done == 1, 10);
  cr_assert_eq(cli.sent_status, 0);
  cli.sent_done = 0;
  srv.bulk_done = 0;
  cr_assert_eq(net_test_conn_pause_read(srv.conn, true), 0);
  struct mem before = mem_now();
  cr_assert_eq(tpeer_send_bulk(&cli, src, n, NET_DTYPE_F32), 0);
  /* Stuff control messages in until the queue refuses them. */
  uint8_t pad[8192] = {0};
  int sent = 0, refused = 0;
  double end = clock_now_s() + 1.5;
  while (clock_now_s() < end) {
    struct net_msgbuf b;
    net_msgbuf_init(&b, 5, 1);
    net_msgbuf_put_uint(&b, "seq", (uint64_t)sent);
    net_msgbuf_put_bin(&b, "pad", pad, sizeof pad);
    int rc = net_conn_send_msg(cli.conn, &b);
    net_msgbuf_free(&b);
    if (rc == 0) sent++;
    else {
      cr_assert_eq(rc, -ENOBUFS);
      refused++;
    }
    cr_assert_leq(net_conn_queued_bytes(cli.conn), cap);
    uv_run(&g_loop, UV_RUN_NOWAIT);
  }
  struct mem mid = mem_now();
  cr_assert_gt(refused, 0, "the queue pushed back");
  cr_assert_leq(g_max_queued, cap, "queued bytes peaked at %zu (cap %zu)", g_max_queued, cap);
  if (!TN_ASAN) assert_growth_below(before, mid, cap + (2u << 20), "stalled sender");
  cr_assert_eq(cli.sent_done, 0);
  /* The receiver reads again: everything arrives, messages in order. */
  cr_assert_eq(net_test_conn_pause_read(srv.conn, false), 0);
  RUN_UNTIL(cli.sent_done && srv.msgs == sent, 30);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.bulk_status, 0);
  cr_assert_eq(srv.msgs, sent);
  cr_assert(srv.msgs_in_order);
  cr_assert_eq(memcmp(src, srv.rx_buf, n * sizeof(float)), 0);
  cr_assert_leq(g_max_queued, cap);
  g_watch = NULL;
  uv_close((uv_handle_t *)&check, NULL);
  free(src);
  finish();
}

/* ---- spare send buffers ------------------------------------------------------------------ */

#define SPARE_PARTNERS 8

/* A peer sends transfers to many partners over a run (gossip partners,
 * ring neighbours after every re-formation, state pulls). The full-size
 * chunk buffers it keeps for reuse are the net's, not each connection's:
 * kept per connection they grew by a window (4-5 MiB) with every partner
 * ever sent to, until that connection closed. */
Test(net_limits, spare_send_buffers_stay_bounded_however_many_partners_a_net_sends_to, .init = setup,
     .timeout = 60) {
  static struct tpeer partners[SPARE_PARTNERS];
  net_conn_t *conns[SPARE_PARTNERS];
  const uint64_t n = 8u << 20 >> 2; /* 8 MB: 8 chunks of the default 1 MiB */
  float *src = calloc(n, sizeof(float));
  for (uint64_t i = 0; i < n; i++) src[i] = (float)i;
  cli.cfg.spare_frame_decay_ms = 0; /* the pool's bound, not its decay (the next test) */
  tpeer_start(&cli, false);
  for (int i = 0; i < SPARE_PARTNERS; i++) {
    tpeer_setup(&partners[i], "partner");
    tpeer_start(&partners[i], true);
    partners[i].rx_buf = malloc(n * sizeof(float));
    partners[i].rx_cap = n;
    tpeer_dial_port(&cli, net_listen_port(partners[i].net));
    RUN_UNTIL(cli.dial_ok == i + 1 && partners[i].accepted == 1, 5);
    cr_assert_eq(cli.dial_ok, i + 1, "dial %d: %s", i, cli.dial_detail);
    conns[i] = cli.conn;
  }
  /* Warm up (worker threads, their arenas, the crypto library), then one
   * transfer to each partner in turn, every connection kept open. */
  cr_assert_eq(tpeer_send_bulk(&cli, src, n, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done == 1 && partners[SPARE_PARTNERS - 1].bulk_done == 1, 10);
  cr_assert_eq(cli.sent_done, 1, "the warm-up transfer completed");
  cr_assert_eq(cli.sent_status, 0, "the warm-up transfer: status %d", cli.sent_status);
  uint64_t before = heap_in_use();
  for (int i = 0; i < SPARE_PARTNERS; i++) {
    int done = 1 + (i == SPARE_PARTNERS - 1); /* the last partner had the warm-up's too */
    memset(partners[i].rx_buf, 0xff, n * sizeof(float));
    cli.conn = conns[i];
    cr_assert_eq(tpeer_send_bulk(&cli, src, n, NET_DTYPE_F32), 0);
    RUN_UNTIL(cli.sent_done == i + 2 && partners[i].bulk_done == done, 10);
    cr_assert_eq(cli.sent_done, i + 2, "transfer %d completed", i);
    cr_assert_eq(cli.sent_status, 0, "transfer %d: status %d", i, cli.sent_status);
    cr_assert_eq(partners[i].bulk_ok, done, "transfer %d arrived whole", i);
    cr_assert_eq(memcmp(src, partners[i].rx_buf, n * sizeof(float)), 0, "transfer %d arrived bit for bit", i);
  }
  uint64_t after = heap_in_use();
  struct net_stats st;
  net_stats_get(cli.net, &st);
  uint64_t frame = NET_FRAME_OVERHEAD + cli.cfg.bulk_chunk_bytes;
  cr_log_info("spare frames %llu B; heap growth over %d partners %lld B", (unsigned long long)st.spare_frame_bytes,
              SPARE_PARTNERS, (long long)(after - before));
  cr_assert_gt(st.spare_frame_bytes, 0, "frames are kept for reuse");
  cr_assert_leq(st.spare_frame_bytes, NET_FRAME_POOL_MAX * frame, "at most the net's pool");
  /* Per connection, the buffers kept would be SPARE_PARTNERS windows (32 MiB and more). */
  if (!TN_ASAN)
    cr_assert_lt((int64_t)(after - before), (int64_t)((NET_FRAME_POOL_MAX + 2) * frame),
                 "heap grew by %lld bytes over %d partners", (long long)(after - before), SPARE_PARTNERS);
  free(src);
  struct tpeer *ps[SPARE_PARTNERS + 2] = {&srv, &cli};
  for (int i = 0; i < SPARE_PARTNERS; i++) ps[i + 2] = &partners[i];
  tnet_finish(ps, SPARE_PARTNERS + 2);
}

static uint64_t spare_bytes(net_t *n) {
  struct net_stats st;
  net_stats_get(n, &st);
  return st.spare_frame_bytes;
}

/* Spare buffers that no transfer took for a whole decay window are freed:
 * a burst of transfers at once (a state donation beside a ring round) held
 * its buffers, a MiB each, for the rest of the run, and the resident set
 * of a peer under chaos grew in steps (tests/bench/bench-chaos.sh). */
Test(net_limits, spare_send_buffers_no_transfer_takes_are_freed_after_the_decay_window, .init = setup,
     .timeout = 30) {
  const uint64_t n = 8u << 20 >> 2; /* 8 MB: 8 chunks of the default 1 MiB */
  float *src = calloc(n, sizeof(float));
  for (uint64_t i = 0; i < n; i++) src[i] = (float)i;
  cli.cfg.spare_frame_decay_ms = 500;
  start_pair();
  connect_once();
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, src, n, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done == 1 && srv.bulk_done == 1, 10);
  cr_assert_eq(cli.sent_status, 0, "the transfer: status %d", cli.sent_status);
  uint64_t kept = spare_bytes(cli.net);
  cr_assert_gt(kept, 0, "the transfer's buffers are kept for the next one");
  /* The connection stays open and idle: its heartbeat timer runs the decay. */
  RUN_UNTIL(spare_bytes(cli.net) == 0, 5);
  cr_assert_eq(spare_bytes(cli.net), 0, "%llu spare bytes still kept after 5 s (%llu right after the transfer)",
               (unsigned long long)spare_bytes(cli.net), (unsigned long long)kept);
  /* The next transfer allocates afresh and arrives whole. */
  memset(srv.rx_buf, 0xff, n * sizeof(float));
  cr_assert_eq(tpeer_send_bulk(&cli, src, n, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done == 2 && srv.bulk_done == 2, 10);
  cr_assert_eq(cli.sent_status, 0, "the second transfer: status %d", cli.sent_status);
  cr_assert_eq(memcmp(src, srv.rx_buf, n * sizeof(float)), 0, "the second transfer arrived bit for bit");
  cr_assert_gt(spare_bytes(cli.net), 0, "its buffers are kept again");
  free(src);
  finish();
}

/* ---- oversized transfers are refused, not fatal ---------------------------------------- */

Test(net_limits, a_transfer_above_the_receivers_limit_is_refused, .init = setup) {
  srv.cfg.max_bulk_bytes = 1u << 20;
  start_pair();
  connect_once();
  srv.rx_buf = malloc(4u << 20);
  srv.rx_cap = 1u << 20;
  float *v = calloc(1u << 20, sizeof(float));
  cr_assert_eq(tpeer_send_bulk(&cli, v, 1u << 20, NET_DTYPE_F32), 0); /* 4 MiB > 1 MiB */
  RUN_UNTIL(cli.sent_done, 5);
  cr_assert_eq(cli.sent_status, -ECONNREFUSED);
  cr_assert_eq(srv.bulk_begins, 0, "the app was not even asked");
  cr_assert_eq(tpeer_send_bulk(&cli, v, 1u << 17, NET_DTYPE_F32), 0); /* 512 KiB: fine */
  RUN_UNTIL(cli.sent_done == 2, 5);
  cr_assert_eq(cli.sent_status, 0);
  free(v);
  finish();
}

/* ---- thread hand-off ------------------------------------------------------------------- */

static atomic_int g_ran_ok, g_ran_canceled, g_queued;
static void call_fn(net_t *n, void *arg, int status) {
  (void)n;
  free(arg);
  if (status == 0) atomic_fetch_add(&g_ran_ok, 1);
  else atomic_fetch_add(&g_ran_canceled, 1);
}

struct caller {
  net_t *net;
  int n;
  atomic_bool *stop;
};
static void *caller_main(void *arg) {
  struct caller *c = arg;
  for (int i = 0; i < c->n || (c->stop && !atomic_load(c->stop)); i++) {
    int *payload = malloc(sizeof *payload);
    if (net_call(c->net, call_fn, payload) != 0) {
      free(payload);
      if (c->stop) break;
    } else {
      atomic_fetch_add(&g_queued, 1);
    }
  }
  return NULL;
}

Test(net_limits, net_call_runs_functions_from_other_threads_on_the_loop_exactly_once, .init = setup,
     .timeout = 60) {
  start_pair();
  pthread_t th[4];
  struct caller cs[4];
  for (int i = 0; i < 4; i++) {
    cs[i] = (struct caller){.net = srv.net, .n = 2000};
    pthread_create(&th[i], NULL, caller_main, &cs[i]);
  }
  for (int i = 0; i < 4; i++) pthread_join(th[i], NULL);
  RUN_UNTIL(atomic_load(&g_ran_ok) == 8000, 10);
  cr_assert_eq(atomic_load(&g_ran_ok), 8000);
  /* A thread still calling while the net closes: every accepted call runs
   * once, with status 0 or RUMOR_ECANCELED. */
  atomic_bool stop = false;
  struct caller late = {.net = cli.net, .n = 0, .stop = &stop};
  atomic_store(&g_queued, 0);
  atomic_store(&g_ran_ok, 0);
  pthread_create(&th[0], NULL, caller_main, &late);
  run_for(0.05);
  net_close(cli.net, tp_net_closed, &cli);
  pthread_join(th[0], NULL); /* it stops at the first refusal */
  RUN_UNTIL(cli.closed_net, 5);
  cr_assert(cli.closed_net);
  cr_assert_eq(atomic_load(&g_ran_ok) + atomic_load(&g_ran_canceled), atomic_load(&g_queued),
               "ran %d + canceled %d == queued %d", atomic_load(&g_ran_ok), atomic_load(&g_ran_canceled),
               atomic_load(&g_queued));
  finish();
}
