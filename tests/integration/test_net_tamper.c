/*
 * An active attacker between two peers: a TCP proxy flips single bits (at
 * every byte of the handshake and across the transfer's frames), duplicates,
 * reorders or drops whole frames, cuts the stream, or replays a recorded
 * session. Every case must end with the connection dropped (or never made)
 * and nothing delivered: no message, no successful transfer.
 */
#include "test_net_helpers.h"

static struct tpeer srv, cli;
static int srv_port;

#define CHUNK_BYTES 65536
#define COUNT 100000 /* 400 000 bytes: 6 full chunks and one of 6784 bytes */
#define META_LEN 5
#define BEGIN_FRAME (NET_FRAME_OVERHEAD + NET_BULK_BEGIN_FIXED + META_LEN)
#define DATA_FRAME (NET_FRAME_OVERHEAD + CHUNK_BYTES)
#define LAST_DATA (NET_FRAME_OVERHEAD + (COUNT * 4 - 6 * CHUNK_BYTES))
#define END_FRAME (NET_FRAME_OVERHEAD + NET_DIGEST_BYTES)
#define TRANSFER_BYTES (BEGIN_FRAME + 6 * DATA_FRAME + LAST_DATA + END_FRAME)

static float g_src[COUNT];

static void setup(void) {
  tloop_init();
  tkeys_init();
  tpeer_setup(&srv, "server");
  tpeer_setup(&cli, "client");
  for (struct tpeer *p = &srv; p; p = p == &srv ? &cli : NULL) {
    p->cfg.handshake_timeout_ms = 400;
    p->cfg.idle_timeout_ms = 400;
    p->cfg.close_linger_ms = 200;
    p->cfg.bulk_chunk_bytes = CHUNK_BYTES;
    /* The offsets and frame numbers below are those of a stream without
     * heartbeats; a_flipped_bit_in_a_ping_... turns them on. */
    p->cfg.heartbeat_ms = 0;
  }
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  srv_port = net_listen_port(srv.net);
  srv.rx_buf = malloc(COUNT * sizeof(float));
  srv.rx_cap = COUNT;
  for (int i = 0; i < COUNT; i++) g_src[i] = (float)i * 0.25f;
}

static void finish(void) {
  struct tpeer *ps[] = {&srv, &cli};
  tnet_finish(ps, 2);
}

struct outcome {
  bool dialed;      /* the client's handshake completed */
  bool delivered;   /* the server got a complete transfer or a message */
  bool sender_ok;   /* the sender was told of success */
  bool dropped;     /* the connection ended on a failure */
};

/* One connection through a fresh proxy configured by `cfg`; optionally a
 * transfer. Returns what happened; leaves nothing open. */
static struct outcome run_once(void (*cfg)(struct tproxy *, void *), void *arg, bool transfer) {
  struct tproxy px;
  tproxy_start(&px, srv_port);
  cfg(&px, arg);
  int ok0 = cli.dial_ok, fail0 = cli.dial_fail, bulk_ok0 = srv.bulk_ok, msgs0 = srv.msgs, sent0 = cli.sent_done;
  int srv_closed0 = srv.closed, srv_acc0 = srv.accepted;
  struct net_stats st0;
  net_stats_get(srv.net, &st0);
  tpeer_dial_port(&cli, px.port);
  RUN_UNTIL(cli.dial_ok + cli.dial_fail > ok0 + fail0, 3);
  struct outcome o = {.dialed = cli.dial_ok > ok0};
  cr_assert_eq(cli.dial_ok + cli.dial_fail, ok0 + fail0 + 1, "the dial ended");
  if (o.dialed && transfer) {
    net_conn_t *c = cli.conn;
    struct net_bulk_send s = {.src = g_src, .count = COUNT, .wire = NET_DTYPE_F32, .meta = "meta!",
                              .meta_len = META_LEN, .done = tp_sent_cb, .arg = &cli};
    uint64_t id;
    cr_assert_eq(net_conn_send_bulk(c, &s, &id), 0);
    RUN_UNTIL(cli.sent_done > sent0 && cli.conn == NULL, 3);
    cr_assert_gt(cli.sent_done, sent0, "the sender was told the outcome");
    o.sender_ok = cli.sent_status == 0;
  }
  if (cli.conn) net_conn_close(cli.conn);
  RUN_UNTIL(cli.conn == NULL && srv.closed - srv_closed0 == srv.accepted - srv_acc0, 3);
  struct net_stats st;
  net_stats_get(srv.net, &st);
  o.delivered = srv.bulk_ok > bulk_ok0 || srv.msgs > msgs0;
  o.dropped = st.hs_failed > st0.hs_failed || st.dropped_violation > st0.dropped_violation || srv.close_status != 0 ||
              !o.dialed;
  tproxy_stop(&px);
  return o;
}

static void cfg_none(struct tproxy *px, void *arg) { (void)px, (void)arg; }

struct flip {
  int dir;
  uint64_t at;
  uint8_t mask;
};
static void cfg_flip(struct tproxy *px, void *arg) {
  const struct flip *f = arg;
  px->flip_dir = f->dir;
  px->flip_at = f->at;
  px->flip_mask = f->mask;
}

Test(net_tamper, untouched_proxy_passes_everything, .init = setup, .timeout = 30) {
  struct outcome o = run_once(cfg_none, NULL, true);
  cr_assert(o.dialed && o.delivered && o.sender_ok);
  cr_assert_eq(memcmp(srv.rx_buf, g_src, sizeof g_src), 0);
  finish();
}

Test(net_tamper, one_flipped_bit_anywhere_in_the_handshake_fails_it, .init = setup, .timeout = 120) {
  /* client to server: HELLO and AUTH with their length prefixes */
  for (uint64_t at = 0; at < TP_HS_C2S; at++) {
    struct flip f = {TP_C2S, at, (uint8_t)(1u << (at % 8))};
    struct outcome o = run_once(cfg_flip, &f, true);
    cr_assert(!o.dialed && !o.delivered, "c2s byte %llu: the handshake must fail", (unsigned long long)at);
  }
  /* server to client: WELCOME and the READY frame */
  for (uint64_t at = 0; at < TP_HS_S2C + NET_FRAME_OVERHEAD; at++) {
    struct flip f = {TP_S2C, at, (uint8_t)(1u << ((at + 3) % 8))};
    struct outcome o = run_once(cfg_flip, &f, true);
    cr_assert(!o.dialed && !o.delivered, "s2c byte %llu: the handshake must fail", (unsigned long long)at);
  }
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.total.msgs_in, 0);
  cr_assert_eq(st.total.bulk_in_ok, 0);
  finish();
}

Test(net_tamper, one_flipped_bit_in_any_frame_drops_the_connection_and_discards_the_buffer, .init = setup,
     .timeout = 120) {
  /* Every byte of the BEGIN frame, every header and tag byte of the first
   * DATA frame, a sweep through its ciphertext, the last DATA frame's
   * header, and every byte of the END frame. */
  uint64_t base = TP_HS_C2S;
  uint64_t pos[600];
  size_t n = 0;
  for (uint64_t i = 0; i < BEGIN_FRAME; i++) pos[n++] = base + i;
  uint64_t d0 = base + BEGIN_FRAME;
  for (uint64_t i = 0; i < NET_FRAME_HDR; i++) pos[n++] = d0 + i;
  for (uint64_t i = NET_FRAME_HDR; i < DATA_FRAME - NET_TAG_BYTES; i += 4099) pos[n++] = d0 + i;
  for (uint64_t i = DATA_FRAME - NET_TAG_BYTES; i < DATA_FRAME; i++) pos[n++] = d0 + i;
  uint64_t dl = d0 + 6 * DATA_FRAME;
  for (uint64_t i = 0; i < NET_FRAME_HDR; i++) pos[n++] = dl + i;
  pos[n++] = dl + LAST_DATA - 1;
  uint64_t end = dl + LAST_DATA;
  for (uint64_t i = 0; i < END_FRAME; i++) pos[n++] = end + i;
  cr_assert_eq(end + END_FRAME, base + TRANSFER_BYTES);
  for (size_t k = 0; k < n; k++) {
    struct flip f = {TP_C2S, pos[k], (uint8_t)(1u << (k % 8))};
    struct outcome o = run_once(cfg_flip, &f, true);
    cr_assert(o.dialed, "byte %llu: the handshake is untouched", (unsigned long long)pos[k]);
    cr_assert(!o.delivered, "byte %llu: nothing may be delivered", (unsigned long long)pos[k]);
    cr_assert(!o.sender_ok, "byte %llu: the sender must not be told success", (unsigned long long)pos[k]);
    cr_assert(o.dropped, "byte %llu: the connection must be dropped", (unsigned long long)pos[k]);
    cr_assert_eq(srv.bulk_done, srv.bulk_begins - (srv.bulk_begins - srv.bulk_done),
                 "every accepted transfer was reported");
    if (srv.bulk_done) cr_assert_neq(srv.bulk_status, 0);
  }
  struct net_stats st;
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.total.bulk_in_ok, 0);
  cr_assert_eq(st.total.msgs_in, 0);
  finish();
}

Test(net_tamper, a_flipped_bit_in_the_receivers_answers_drops_the_connection, .init = setup, .timeout = 30) {
  /* the server's RESULT frame follows its handshake messages and READY */
  for (uint64_t i = 0; i < NET_FRAME_OVERHEAD; i++) {
    struct flip f = {TP_S2C, TP_HS_S2C + NET_FRAME_OVERHEAD + i, (uint8_t)(1u << (i % 8))};
    struct outcome o = run_once(cfg_flip, &f, true);
    cr_assert(o.dialed && !o.sender_ok, "s2c byte %llu", (unsigned long long)f.at);
  }
  finish();
}

Test(net_tamper, a_flipped_bit_in_a_ping_drops_the_connection, .init = setup, .timeout = 60) {
  /* Each side's first frame after the handshake is a PING (protocol
   * version 3), the client's at the start of its transport stream, the
   * server's right after READY. */
  for (struct tpeer *p = &srv; p; p = p == &srv ? &cli : NULL) {
    net_close(p->net, tp_net_closed, p);
    RUN_UNTIL(p->closed_net, 5);
    p->closed_net = false;
    p->cfg.heartbeat_ms = 250;
  }
  tpeer_start(&srv, true);
  tpeer_start(&cli, false);
  srv_port = net_listen_port(srv.net);
  for (uint64_t i = 0; i < NET_FRAME_OVERHEAD; i += 3) {
    struct flip f = {i % 2 ? TP_S2C : TP_C2S, (i % 2 ? TP_HS_S2C + NET_FRAME_OVERHEAD : TP_HS_C2S) + i,
                     (uint8_t)(1u << (i % 8))};
    struct outcome o = run_once(cfg_flip, &f, false);
    cr_assert(o.dropped, "%s byte %llu of the PING: the connection must be dropped", i % 2 ? "s2c" : "c2s",
              (unsigned long long)i);
  }
  finish();
}

struct surgery {
  enum tproxy_frame_op op;
  uint64_t index;
};
static void cfg_surgery(struct tproxy *px, void *arg) {
  const struct surgery *s = arg;
  px->frame_op = s->op;
  px->frame_index = s->index;
}

static void surgery_case(enum tproxy_frame_op op, const char *what) {
  /* frames: 0 BEGIN, 1..7 DATA, 8 END (a swap exchanges frames k and k+1) */
  static const uint64_t idx[] = {0, 1, 4, 7, 8};
  for (size_t i = 0; i < sizeof idx / sizeof idx[0]; i++) {
    if (op == TP_FRAME_SWAP && idx[i] == 8) continue; /* nothing follows END */
    struct surgery s = {op, idx[i]};
    struct outcome o = run_once(cfg_surgery, &s, true);
    cr_assert(o.dialed);
    if (op == TP_FRAME_DUP && idx[i] == 8) {
      /* The first END completes an authentic transfer; its copy is then
       * caught and the connection dropped. */
      cr_assert(o.dropped, "%s frame %llu", what, (unsigned long long)idx[i]);
      cr_assert_eq(memcmp(srv.rx_buf, g_src, sizeof g_src), 0);
      continue;
    }
    cr_assert(!o.delivered && !o.sender_ok && o.dropped, "%s frame %llu", what, (unsigned long long)idx[i]);
  }
}

Test(net_tamper, a_duplicated_frame_fails, .init = setup, .timeout = 60) {
  surgery_case(TP_FRAME_DUP, "duplicated");
  finish();
}

Test(net_tamper, reordered_frames_fail, .init = setup, .timeout = 60) {
  surgery_case(TP_FRAME_SWAP, "swapped");
  finish();
}

Test(net_tamper, a_dropped_frame_fails, .init = setup, .timeout = 60) {
  surgery_case(TP_FRAME_DROP, "dropped");
  finish();
}

static void cfg_cut(struct tproxy *px, void *arg) {
  px->cut_dir = TP_C2S;
  px->cut_at = *(const uint64_t *)arg;
}

Test(net_tamper, a_stream_cut_anywhere_delivers_nothing, .init = setup, .timeout = 60) {
  const uint64_t cuts[] = {TP_HS_C2S + 10, TP_HS_C2S + BEGIN_FRAME, TP_HS_C2S + BEGIN_FRAME + 1000,
                           TP_HS_C2S + BEGIN_FRAME + 3 * DATA_FRAME, TP_HS_C2S + TRANSFER_BYTES - END_FRAME,
                           TP_HS_C2S + TRANSFER_BYTES - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    int begins0 = srv.bulk_begins, done0 = srv.bulk_done;
    struct outcome o = run_once(cfg_cut, (void *)&cuts[i], true);
    cr_assert(o.dialed);
    cr_assert(!o.delivered && !o.sender_ok, "cut at %llu", (unsigned long long)cuts[i]);
    cr_assert_eq(srv.bulk_done - done0, srv.bulk_begins - begins0, "each accepted transfer reported once");
    if (srv.bulk_done > done0) cr_assert_neq(srv.bulk_status, 0, "reported as failed, never delivered");
    cr_assert_neq(srv.close_status, 0, "a cut is not a graceful close: %s", srv.close_detail);
  }
  finish();
}

static void cfg_record(struct tproxy *px, void *arg) {
  (void)arg;
  px->rec = malloc(TP_REC_MAX);
}

Test(net_tamper, a_recorded_session_replayed_to_the_same_peer_is_rejected, .init = setup, .timeout = 30) {
  /* Record everything the client sends in a good session. */
  struct tproxy px;
  tproxy_start(&px, srv_port);
  cfg_record(&px, NULL);
  tpeer_dial_port(&cli, px.port);
  RUN_UNTIL(cli.dial_ok, 3);
  cr_assert_eq(cli.dial_ok, 1);
  cr_assert_eq(tpeer_send_bulk(&cli, g_src, COUNT, NET_DTYPE_F32), 0);
  cr_assert_eq(tpeer_send_msg(&cli, 3, 0), 0);
  RUN_UNTIL(cli.sent_done && srv.msgs == 1, 5);
  cr_assert_eq(srv.bulk_ok, 1);
  net_conn_close(cli.conn);
  RUN_UNTIL(cli.conn == NULL && srv.closed == 1, 3);
  size_t rec_len = px.rec_len;
  uint8_t *rec = malloc(rec_len);
  memcpy(rec, px.rec, rec_len);
  tproxy_stop(&px);
  cr_assert_gt(rec_len, TRANSFER_BYTES);

  /* Replay it byte for byte on a new connection. */
  struct net_stats st0, st;
  net_stats_get(srv.net, &st0);
  struct traw r;
  traw_connect(&r, srv_port);
  traw_write(&r, rec, rec_len);
  RUN_UNTIL(r.eof, 5);
  cr_assert(r.eof, "the server drops the replay");
  traw_close(&r);
  net_stats_get(srv.net, &st);
  cr_assert_eq(st.hs_failed, st0.hs_failed + 1);
  cr_assert_eq(st.hs_fail[NET_HS_FAIL_AUTH], st0.hs_fail[NET_HS_FAIL_AUTH] + 1, "the replayed AUTH does not verify");
  cr_assert_eq(srv.accepted, 1, "no second connection surfaced");
  cr_assert_eq(srv.msgs, 1, "no replayed message delivered");
  cr_assert_eq(srv.bulk_begins, 1, "no replayed transfer started");
  free(rec);
  finish();
}
