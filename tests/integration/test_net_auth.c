/*
 * Admission over real TCP: a peer without the cluster key, or whose key is
 * not on an allow-list, never gets a connection and never delivers a byte;
 * a protocol version mismatch is reported clearly on both sides.
 */
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

/* Starts both, dials, and waits until the dial has an outcome and the
 * server has counted the handshake. */
static void attempt(void) {
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  tpeer_dial_port(&cli, net_listen_port(srv.net));
  struct net_stats st = {0};
  RUN_UNTIL(cli.dial_ok + cli.dial_fail > 0 && (net_stats_get(srv.net, &st), st.hs_ok + st.hs_failed > 0), 5);
  cr_assert_eq(cli.dial_ok + cli.dial_fail, 1, "the dial callback ran once");
}

static void assert_nothing_delivered(void) {
  cr_assert_eq(srv.accepted, 0, "no connection surfaced on the server");
  cr_assert_eq(srv.msgs + cli.msgs, 0);
  cr_assert_eq(srv.bulk_begins + cli.bulk_begins, 0);
}

Test(net_auth, matching_keys_connect, .init = setup) {
  attempt();
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
  finish();
}

Test(net_auth, wrong_cluster_key_is_rejected_and_nothing_is_delivered, .init = setup) {
  cli.cluster[0] ^= 1;
  attempt();
  cr_assert_eq(cli.dial_fail, 1);
  cr_assert_eq(cli.dial_status, RUMOR_EAUTH, "status %d: %s", cli.dial_status, cli.dial_detail);
  cr_assert(strstr(cli.dial_detail, "cluster key"), "client is told why: %s", cli.dial_detail);
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_CLUSTER], 1);
  cr_assert_eq(st.hs_ok, 0);
  net_stats_get(cli.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_CLUSTER], 1);
  assert_nothing_delivered();
  finish();
}

Test(net_auth, client_not_on_the_servers_allow_list_is_rejected, .init = setup) {
  struct net_identity other;
  cr_assert_eq(net_identity_generate(&other), 0);
  struct net_allowlist al;
  net_allowlist_from_keys(&al, (const uint8_t(*)[NET_PUBKEY_BYTES])other.pk, 1);
  srv.cfg.allow = &al;
  attempt();
  net_allowlist_free(&al);
  cr_assert_eq(cli.dial_fail, 1);
  cr_assert_eq(cli.dial_status, RUMOR_EAUTH, "%s", cli.dial_detail);
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_NOT_ALLOWED], 1);
  net_stats_get(cli.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_REJECTED], 1, "the client learns it was refused after proving itself");
  assert_nothing_delivered();
  finish();
}

Test(net_auth, server_not_on_the_clients_allow_list_is_rejected, .init = setup) {
  struct net_identity other;
  cr_assert_eq(net_identity_generate(&other), 0);
  struct net_allowlist al;
  net_allowlist_from_keys(&al, (const uint8_t(*)[NET_PUBKEY_BYTES])other.pk, 1);
  cli.cfg.allow = &al;
  attempt();
  net_allowlist_free(&al);
  cr_assert_eq(cli.dial_fail, 1);
  struct net_stats st;
  net_stats_get(cli.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_NOT_ALLOWED], 1, "%s", cli.dial_detail);
  cr_assert(strstr(cli.dial_detail, "allow-list"), "%s", cli.dial_detail);
  assert_nothing_delivered();
  finish();
}

Test(net_auth, keys_on_both_allow_lists_connect, .init = setup) {
  struct net_allowlist as, ac;
  net_allowlist_from_keys(&as, (const uint8_t(*)[NET_PUBKEY_BYTES])cli.id.pk, 1);
  net_allowlist_from_keys(&ac, (const uint8_t(*)[NET_PUBKEY_BYTES])srv.id.pk, 1);
  srv.cfg.allow = &as;
  cli.cfg.allow = &ac;
  attempt();
  net_allowlist_free(&as);
  net_allowlist_free(&ac);
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
  finish();
}

Test(net_auth, a_peer_with_our_own_identity_is_rejected, .init = setup) {
  cli.id = srv.id;
  attempt();
  cr_assert_eq(cli.dial_fail, 1);
  struct net_stats st;
  net_stats_get(cli.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_SELF], 1, "%s", cli.dial_detail);
  assert_nothing_delivered();
  finish();
}

Test(net_auth, unknown_or_retired_protocol_versions_get_a_clear_reject, .init = setup) {
  tpeer_start(&srv, true);
  /* HELLOs from a future rumor speaking versions 4..5 only, and from an old
   * one speaking only version 1 (retired: its bulk frames were sealed with
   * libsodium and checked by a BLAKE2b digest). */
  const uint8_t ranges[2][2] = {{4, 5}, {1, 1}};
  for (int i = 0; i < 2; i++) {
    uint8_t hello[NET_HS_LEN_BYTES + NET_HS_HELLO_LEN] = {0};
    net_be16_put(hello, NET_HS_HELLO_LEN);
    memcpy(hello + 2, NET_MAGIC, 4);
    hello[6] = NET_HS_HELLO;
    hello[7] = ranges[i][0];
    hello[8] = ranges[i][1];
    hello[9] = NET_SUITE_AES256GCM;
    struct traw r;
    traw_connect(&r, net_listen_port(srv.net));
    traw_write(&r, hello, sizeof hello);
    RUN_UNTIL(r.eof, 5);
    cr_assert(r.eof, "the server closes (versions %u..%u)", ranges[i][0], ranges[i][1]);
    cr_assert_eq(r.bytes_in, NET_HS_LEN_BYTES + NET_HS_REJECT_LEN, "after a REJECT message");
    struct net_stats st;
    net_stats_get(srv.net, &st);
    cr_assert_eq(st.hs_fail[NET_HS_FAIL_VERSION], (uint64_t)i + 1);
    traw_close(&r);
  }
  assert_nothing_delivered();
  finish();
}

Test(net_auth, a_non_rumor_client_is_dropped_as_malformed, .init = setup) {
  tpeer_start(&srv, true);
  struct traw r;
  traw_connect(&r, net_listen_port(srv.net));
  const char *http = "GET / HTTP/1.1\r\nHost: x\r\n\r\n";
  traw_write(&r, http, strlen(http));
  RUN_UNTIL(r.eof, 5);
  cr_assert(r.eof);
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_MALFORMED], 1);
  traw_close(&r);
  assert_nothing_delivered();
  finish();
}

Test(net_auth, dialing_nothing_reports_a_clear_error, .init = setup) {
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  int port = net_listen_port(srv.net);
  net_close(srv.net, tp_net_closed, &srv); /* nobody listens there any more */
  RUN_UNTIL(srv.closed_net, 5);
  tpeer_dial_port(&cli, port);
  RUN_UNTIL(cli.dial_fail, 5);
  cr_assert_eq(cli.dial_fail, 1);
  cr_assert_eq(cli.dial_status, UV_ECONNREFUSED, "%s", cli.dial_detail);
  cr_assert_eq(net_dial(cli.net, "no-port", tp_dial_cb, &cli), RUMOR_EFORMAT, "bad address: callback never called");
  cr_assert_eq(net_dial(cli.net, "::1:80", tp_dial_cb, &cli), RUMOR_EFORMAT);
  cr_assert_eq(cli.dial_fail, 1);
  finish();
}

Test(net_auth, ipv6_addresses_work, .init = setup) {
  tpeer_start(&srv, false);
  struct rumor_err e = {0};
  if (net_listen(srv.net, "[::1]:0", &e) != 0) {
    cr_log_warn("no IPv6 loopback here (%s); skipping", e.msg);
    finish();
    return;
  }
  tpeer_start(&cli, false);
  char addr[64];
  snprintf(addr, sizeof addr, "[::1]:%d", net_listen_port(srv.net));
  cr_assert_eq(net_dial(cli.net, addr, tp_dial_cb, &cli), 0);
  RUN_UNTIL(cli.dial_ok + cli.dial_fail == 1 && srv.accepted == 1, 5);
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
  cr_assert(strncmp(net_conn_peer_addr(srv.conn), "[::1]:", 6) == 0, "%s", net_conn_peer_addr(srv.conn));
  finish();
}

Test(net_auth, host_names_are_resolved, .init = setup) {
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  char addr[64];
  snprintf(addr, sizeof addr, "localhost:%d", net_listen_port(srv.net));
  cr_assert_eq(net_dial(cli.net, addr, tp_dial_cb, &cli), 0);
  RUN_UNTIL(cli.dial_ok + cli.dial_fail == 1, 5);
  cr_assert_eq(cli.dial_ok, 1, "%s", cli.dial_detail);
  cr_assert_eq(net_dial(cli.net, "no-such-host.invalid:1", tp_dial_cb, &cli), 0);
  RUN_UNTIL(cli.dial_fail == 1, 10);
  cr_assert_eq(cli.dial_fail, 1);
  cr_assert(strstr(cli.dial_detail, "cannot resolve"), "%s", cli.dial_detail);
  finish();
}
