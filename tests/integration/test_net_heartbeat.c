/*
 * The heartbeat (protocol version 3, docs/net.md "Heartbeat"): a peer
 * whose loop stops (a process SIGSTOPped) is judged dead once it has been
 * silent for dead_after_ms, and the connection is aborted with the verdict;
 * an idle connection between live peers stays open on PINGs; a connection
 * busy with a bulk transfer on a slow link (a 1 MiB chunk taking 2 s) is
 * not judged, because the bytes of a frame still arriving are life; and a
 * peer whose heartbeat is off is never judged.
 *
 * The defaults are used (a PING after 250 ms without sending, a verdict
 * after 1000 ms of silence): the figures are the ones docs/net.md states.
 * Timings are asserted only as generous bounds around them.
 */
#include "test_net_helpers.h"

static struct tpeer srv, cli;

static void setup(void) { tpair_setup(&srv, &cli); }
static void finish(void) { tpair_finish(&srv, &cli); }

static uint64_t frames_in(net_conn_t *c) {
  struct net_conn_stats st;
  net_conn_stats_get(c, &st);
  return st.frames_in;
}

/* ---- a peer whose loop stops ------------------------------------------------------------ */

/* In the child: connected, it only heartbeats until it is stopped and killed. */
static void child_dialed(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n, (void)c, (void)detail, (void)arg;
  if (status != 0) _exit(3);
}

Test(net_heartbeat, a_stopped_peer_is_judged_dead_after_a_second_of_silence, .fini = tchild_reap, .timeout = 60) {
  tkeys_init();
  tchild_start(child_dialed, NULL);
  tloop_init();
  tpeer_setup(&srv, "server");
  tpeer_setup(&cli, "unused");
  cr_assert_eq(srv.cfg.heartbeat_ms, 250, "the default interval");
  cr_assert_eq(srv.cfg.dead_after_ms, 1000, "the default verdict");
  tpeer_start(&srv, true);
  tchild_tell_port(net_listen_port(srv.net));
  /* Its first frame is a PING: from then on it is judged. */
  RUN_UNTIL(srv.conn && frames_in(srv.conn) >= 1, 20);
  cr_assert(srv.conn && frames_in(srv.conn) >= 1, "the child connected and pinged");
  /* Idle on both sides for three times the limit: PINGs keep it open. */
  uint64_t f0 = frames_in(srv.conn);
  run_for(3.0);
  cr_assert_eq(srv.closed, 0, "a live idle peer is not judged: %s", srv.close_detail);
  uint64_t pings = frames_in(srv.conn) - f0;
  cr_assert_geq(pings, 6, "about one PING every 250 ms, %llu in 3 s", (unsigned long long)pings);
  /* Its loop stops. */
  cr_assert_eq(kill(g_child, SIGSTOP), 0);
  double t0 = clock_now_s();
  RUN_UNTIL(srv.closed, 10);
  double dt = clock_now_s() - t0;
  fprintf(stderr, "figure: verdict %.3f s after SIGSTOP (limit 1.000 s; %llu PINGs in the 3 s before)\n", dt,
          (unsigned long long)pings);
  cr_assert_eq(srv.closed, 1, "the stopped peer's connection was closed");
  cr_assert_eq(srv.close_status, RUMOR_ETIMEDOUT, "%s", srv.close_detail);
  cr_assert(strstr(srv.close_detail, "heartbeat verdict"), "%s", srv.close_detail);
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.dead_verdicts, 1);
  /* Not before the limit (its last byte left at most one interval before the
   * stop), and within it plus a generous allowance for a loaded machine. */
  cr_assert(dt >= 0.7, "judged after %.3f s: before a second of silence", dt);
  cr_assert(dt < 4.0, "judged after %.3f s", dt);
  tchild_reap();
  finish();
}

/* ---- a busy slow link is not silence ------------------------------------------------------ */

static void connect_through(struct tproxy *px) {
  tpeer_dial_port(&cli, px->port);
  RUN_UNTIL(cli.dial_ok && srv.accepted, 5);
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
}

Test(net_heartbeat, a_bulk_transfer_on_a_slow_link_is_not_taken_for_silence, .init = setup, .timeout = 60) {
  /* 1 MiB chunks (the default) at 512 KiB/s: each frame takes 2 s to
   * arrive, twice the verdict's limit; the sender's own socket is small, so
   * its frames wait in its queue and it has no reason to PING. */
  const uint64_t count = (2u << 20) / sizeof(float); /* 2 MiB: two chunks */
  cli.cfg.sock_buf_bytes = 64 << 10;
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  struct tproxy px;
  tproxy_start(&px, net_listen_port(srv.net));
  tproxy_throttle(&px, 512u << 10);
  connect_through(&px);
  float *src = malloc(count * sizeof(float));
  for (uint64_t i = 0; i < count; i++) src[i] = (float)i;
  srv.rx_buf = malloc(count * sizeof(float));
  srv.rx_cap = count;
  double t0 = clock_now_s();
  cr_assert_eq(tpeer_send_bulk(&cli, src, count, NET_DTYPE_F32), 0);
  RUN_UNTIL(cli.sent_done || srv.closed || cli.closed, 30);
  double dt = clock_now_s() - t0;
  fprintf(stderr, "figure: 2 MiB through a 512 KiB/s link in %.2f s\n", dt);
  cr_assert_eq(srv.closed + cli.closed, 0, "closed: %s / %s", srv.close_detail, cli.close_detail);
  cr_assert_eq(cli.sent_status, 0);
  cr_assert_eq(srv.bulk_ok, 1);
  cr_assert_eq(memcmp(src, srv.rx_buf, count * sizeof(float)), 0);
  cr_assert(dt >= 2.0, "the link was slow: %.2f s, where a chunk alone must take 2 s", dt);
  struct net_stats a, b;
  net_stats_get(srv.net, &a);
  net_stats_get(cli.net, &b);
  cr_assert_eq(a.dead_verdicts + b.dead_verdicts, 0);
  net_conn_close(cli.conn);
  RUN_UNTIL(srv.closed && cli.closed, 5);
  tproxy_stop(&px);
  free(src);
  finish();
}

/* ---- a peer without the heartbeat ----------------------------------------------------------- */

Test(net_heartbeat, a_peer_whose_heartbeat_is_off_is_never_judged, .init = setup, .timeout = 30) {
  cli.cfg.heartbeat_ms = 0; /* sends no PING: the server cannot tell silence from life */
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  tpeer_dial_port(&cli, net_listen_port(srv.net));
  RUN_UNTIL(cli.dial_ok && srv.accepted, 5);
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
  run_for(2.5);
  cr_assert_eq(srv.closed + cli.closed, 0, "closed: %s / %s", srv.close_detail, cli.close_detail);
  cr_assert_eq(frames_in(srv.conn), 0, "the client sent nothing");
  cr_assert_geq(frames_in(cli.conn), 1, "the server pinged");
  finish();
}

Test(net_heartbeat, dead_after_must_exceed_the_interval, .init = setup) {
  srv.cfg.heartbeat_ms = 500;
  srv.cfg.dead_after_ms = 500;
  struct rumor_err e = {0};
  cr_assert_eq(net_init(&srv.net, &g_loop, &srv.cfg, &tp_callbacks, &srv, &e), -EINVAL);
  cr_assert(strstr(e.msg, "dead_after_ms (500) must exceed heartbeat_ms (500)"), "%s", e.msg);
  srv.cfg.heartbeat_ms = 0; /* off: dead_after_ms is not used */
  cr_assert_eq(net_init(&srv.net, &g_loop, &srv.cfg, &tp_callbacks, &srv, &e), 0, "%s", e.msg);
  finish();
}
