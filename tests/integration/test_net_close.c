/*
 * Ends of connections: a sender process killed mid-buffer (nothing is
 * delivered), graceful closes from either side, closing a net with dials
 * and transfers pending (every callback runs once), and a truncated stream
 * reported as a cut rather than a close.
 */
#include "test_net_helpers.h"

static struct tpeer srv, cli;

static void setup(void) { tpair_setup(&srv, &cli); }
static void finish(void) { tpair_finish(&srv, &cli); }

/* ---- a sender process killed mid-transfer -------------------------------------------- */

#define CHILD_COUNT (50u * 1000u * 1000u) /* 200 MB */

static void child_sent(net_conn_t *c, uint64_t id, int status, void *arg) { (void)c, (void)id, (void)status, (void)arg; }

/* In the child: streams a buffer until killed. */
static void child_dialed(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n, (void)detail, (void)arg;
  if (status != 0) _exit(3);
  float *src = calloc(CHILD_COUNT, sizeof(float));
  struct net_bulk_send s = {.src = src, .count = CHILD_COUNT, .wire = NET_DTYPE_F32, .done = child_sent};
  uint64_t id;
  if (!src || net_conn_send_bulk(c, &s, &id) != 0) _exit(4);
}

Test(net_close, a_sender_killed_mid_buffer_delivers_nothing, .fini = tchild_reap, .timeout = 60) {
  tkeys_init();
  tchild_start(child_dialed, NULL);
  tloop_init();
  tpeer_setup(&srv, "server");
  tpeer_setup(&cli, "unused");
  tpeer_start(&srv, true);
  tchild_tell_port(net_listen_port(srv.net));
  srv.rx_buf = malloc((size_t)CHILD_COUNT * sizeof(float));
  memset(srv.rx_buf, 0x7f, (size_t)CHILD_COUNT * sizeof(float));
  srv.rx_cap = CHILD_COUNT;
  /* Wait until a good part of the buffer has arrived, then kill the sender. */
  struct net_conn_stats cs = {0};
  RUN_UNTIL(srv.conn && (net_conn_stats_get(srv.conn, &cs), cs.bytes_in > (40u << 20)), 20);
  cr_assert_gt(cs.bytes_in, 40u << 20, "the transfer was under way");
  cr_assert_eq(srv.bulk_begins, 1);
  kill(g_child, SIGKILL);
  int wst = 0;
  cr_assert_eq(waitpid(g_child, &wst, 0), g_child);
  g_child = -1;
  cr_assert(WIFSIGNALED(wst) && WTERMSIG(wst) == SIGKILL, "the child died by our SIGKILL");
  RUN_UNTIL(srv.bulk_done && srv.closed, 10);
  cr_assert_eq(srv.bulk_done, 1, "the receiver is told exactly once");
  cr_assert_neq(srv.bulk_status, 0, "reported as failed, never delivered");
  cr_assert_eq(srv.bulk_ok, 0);
  cr_assert_eq(srv.closed, 1);
  cr_assert_neq(srv.close_status, 0, "a dead peer is not a graceful close: %s", srv.close_detail);
  finish();
}

/* ---- graceful closes ------------------------------------------------------------------ */

static void connect_pair(void) {
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  tpeer_dial_port(&cli, net_listen_port(srv.net));
  RUN_UNTIL(cli.dial_ok && srv.accepted, 5);
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
}

Test(net_close, a_close_from_the_server_flushes_queued_messages_first, .init = setup) {
  connect_pair();
  for (uint64_t i = 0; i < 100; i++) cr_assert_eq(tpeer_send_msg(&srv, 2, i), 0);
  net_conn_close(srv.conn);
  cr_assert_eq(tpeer_send_msg(&srv, 2, 100), -ENOTCONN, "nothing can be queued after close");
  RUN_UNTIL(cli.closed && srv.closed, 5);
  cr_assert_eq(cli.msgs, 100, "every message queued before the close arrived");
  cr_assert(cli.msgs_in_order);
  cr_assert_eq(cli.close_status, 0, "%s", cli.close_detail);
  cr_assert_eq(srv.close_status, 0, "%s", srv.close_detail);
  finish();
}

Test(net_close, closing_both_ends_at_once_is_clean, .init = setup) {
  connect_pair();
  net_conn_close(srv.conn);
  net_conn_close(cli.conn);
  net_conn_close(cli.conn); /* twice is harmless */
  RUN_UNTIL(cli.closed && srv.closed, 5);
  cr_assert_eq(cli.close_status, 0, "%s", cli.close_detail);
  cr_assert_eq(srv.close_status, 0, "%s", srv.close_detail);
  cr_assert_eq(cli.closed + srv.closed, 2);
  finish();
}

Test(net_close, a_graceful_close_mid_transfer_fails_the_transfer_on_both_sides, .init = setup) {
  connect_pair();
  const uint64_t n = 20u << 20;
  float *v = calloc(n, sizeof(float));
  srv.rx_buf = malloc(n * sizeof(float));
  srv.rx_cap = n;
  cr_assert_eq(tpeer_send_bulk(&cli, v, n, NET_DTYPE_F32), 0);
  RUN_UNTIL(srv.bulk_begins, 5);
  net_conn_close(srv.conn); /* the receiver leaves */
  cr_assert_eq(srv.bulk_done, 1);
  cr_assert_eq(srv.bulk_status, RUMOR_ECANCELED);
  RUN_UNTIL(cli.closed && srv.closed, 5);
  cr_assert_eq(cli.sent_done, 1);
  cr_assert_eq(cli.sent_status, RUMOR_ECANCELED);
  cr_assert_eq(srv.bulk_done, 1, "once");
  cr_assert_eq(srv.close_status, 0, "%s", srv.close_detail);
  cr_assert_eq(cli.close_status, 0, "%s", cli.close_detail);
  free(v);
  finish();
}

/* ---- closing a net with work pending ---------------------------------------------------- */

static void ignore_conn(uv_stream_t *s, int status) { (void)s, (void)status; }
static void closed_cb(uv_handle_t *h) { *(bool *)h->data = true; }

Test(net_close, closing_the_net_cancels_dials_that_are_still_in_their_handshake, .init = setup) {
  /* a listener that never accepts: TCP connects, the handshake never ends */
  uv_tcp_t mute;
  bool mute_closed = false;
  uv_tcp_init(&g_loop, &mute);
  mute.data = &mute_closed;
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  cr_assert_eq(uv_tcp_bind(&mute, (const struct sockaddr *)&a, 0), 0);
  cr_assert_eq(uv_listen((uv_stream_t *)&mute, 8, ignore_conn), 0);
  struct sockaddr_storage ss;
  int len = sizeof ss;
  uv_tcp_getsockname(&mute, (struct sockaddr *)&ss, &len);
  int port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
  tpeer_start(&cli, false);
  for (int i = 0; i < 3; i++) tpeer_dial_port(&cli, port);
  run_for(0.1);
  cr_assert_eq(cli.dial_ok + cli.dial_fail, 0, "still pending");
  net_close(cli.net, tp_net_closed, &cli);
  RUN_UNTIL(cli.closed_net, 5);
  cr_assert(cli.closed_net);
  cr_assert_eq(cli.dial_fail, 3, "every dial callback ran once");
  cr_assert_eq(cli.dial_status, RUMOR_ECANCELED);
  uv_close((uv_handle_t *)&mute, closed_cb);
  RUN_UNTIL(mute_closed, 5);
  finish();
}

Test(net_close, the_loop_closes_clean_after_a_busy_net, .init = setup) {
  connect_pair();
  for (uint64_t i = 0; i < 50; i++) cr_assert_eq(tpeer_send_msg(&cli, 1, i), 0);
  float v[1000] = {0};
  srv.rx_buf = malloc(sizeof v);
  srv.rx_cap = 1000;
  cr_assert_eq(tpeer_send_bulk(&cli, v, 1000, NET_DTYPE_BF16), 0);
  /* close immediately: everything pending resolves, and tnet_finish checks
   * that uv_loop_close returns 0 */
  finish();
  cr_assert_eq(cli.sent_done, 1);
  cr_assert_eq(cli.closed, 1);
  cr_assert_eq(srv.closed, 1);
  cr_assert_eq(cli.close_status, 0, "%s", cli.close_detail);
  cr_assert_eq(srv.close_status, 0, "%s", srv.close_detail);
}
