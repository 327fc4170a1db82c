/*
 * Shared pieces of the net integration tests (header-only; every test file
 * is its own binary). Provides:
 *   - tpeer: a net_t with callbacks that record what happened;
 *   - RUN_UNTIL: run the loop until a condition holds or a deadline passes;
 *   - tproxy: a TCP proxy on the same loop that can record, flip a bit at a
 *     byte offset, cut the stream, or duplicate / swap / drop whole transport
 *     frames of the client-to-server direction, or hold that direction to a
 *     rate (a slow link);
 *   - tnet_finish: closes everything and checks the loop closes clean;
 *   - tchild: a peer in a child process of its own (to be stopped or killed).
 * Everything runs on 127.0.0.1 with ephemeral ports.
 */
#ifndef RUMOR_TEST_NET_HELPERS_H
#define RUMOR_TEST_NET_HELPERS_H

#include <criterion/criterion.h>
#include <execinfo.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "net/net.h"
#include "net/net_impl.h"
#include "test_net_lsan.h"

/* AddressSanitizer keeps freed memory in quarantine, so process-wide memory
 * figures only mean something without it. */
#if defined(__SANITIZE_ADDRESS__)
#define TN_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define TN_ASAN 1
#endif
#endif
#ifndef TN_ASAN
#define TN_ASAN 0
#endif

/* Helpers a given test file may not use. */
#define TN_FN static __attribute__((unused))

/* ---- the loop and its deadline tick ------------------------------------------ */

static uv_loop_t g_loop;
static uv_timer_t g_tick;

TN_FN void tick_cb(uv_timer_t *t) { (void)t; }

/* RUMOR_TEST_DEBUG=1: debug logs, and a backtrace on a crash (Criterion
 * otherwise reports only "CRASH"). */
TN_FN void crash_handler(int sig) {
  void *frames[64];
  int n = backtrace(frames, 64);
  fprintf(stderr, "signal %d; backtrace:\n", sig);
  backtrace_symbols_fd(frames, n, 2);
  signal(sig, SIG_DFL);
  raise(sig);
}

TN_FN void tloop_init(void) {
  if (getenv("RUMOR_TEST_DEBUG")) {
    log_set_level(LOG_DEBUG);
    signal(SIGSEGV, crash_handler);
    signal(SIGABRT, crash_handler);
    signal(SIGBUS, crash_handler);
    signal(SIGPIPE, crash_handler);
    signal(SIGILL, crash_handler);
  }
  cr_assert_eq(uv_loop_init(&g_loop), 0);
  uv_timer_init(&g_loop, &g_tick);
  uv_timer_start(&g_tick, tick_cb, 10, 10); /* bounds every uv_run(ONCE) */
}

#define RUN_UNTIL(cond, secs)                                                   \
  do {                                                                          \
    double end_ = clock_now_s() + (secs);                                       \
    while (!(cond) && clock_now_s() < end_) uv_run(&g_loop, UV_RUN_ONCE);       \
  } while (0)

/* Runs the loop for `secs` seconds. */
TN_FN void run_for(double secs) {
  double end = clock_now_s() + secs;
  while (clock_now_s() < end) uv_run(&g_loop, UV_RUN_ONCE);
}

/* ---- keys ------------------------------------------------------------------------ */

static uint8_t g_cluster[NET_CLUSTER_KEY_BYTES];

TN_FN void tkeys_init(void) {
  cr_assert_eq(net_crypto_init(), 0);
  cr_assert_eq(net_cluster_key_generate(g_cluster), 0);
}

/* ---- a recording peer ----------------------------------------------------------- */

struct tpeer {
  const char *label;
  net_t *net;
  struct net_identity id;
  uint8_t cluster[NET_CLUSTER_KEY_BYTES];
  struct net_config cfg;
  bool closed_net;
  /* connections */
  int accepted, dial_ok, dial_fail, dial_status, closed, close_status;
  char dial_detail[512], close_detail[512];
  net_conn_t *conn;
  /* messages */
  int msgs;
  uint64_t last_type, last_seq;
  bool msgs_in_order;
  /* inbound bulk */
  float *rx_buf;
  uint64_t rx_cap;
  int bulk_begins, bulk_done, bulk_ok, bulk_status;
  uint64_t bulk_count;
  enum net_dtype bulk_wire;
  bool refuse;
  char meta[64];
  /* outbound bulk */
  int sent_done, sent_status;
};

TN_FN void tp_on_accept(net_conn_t *c, void *ud) {
  struct tpeer *p = ud;
  p->accepted++;
  p->conn = c;
}

TN_FN void tp_on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct tpeer *p = ud;
  (void)c;
  uint64_t seq = 0;
  if (net_msg_get_uint(m, "seq", &seq) == 0) {
    if (p->msgs > 0 && seq != p->last_seq + 1) p->msgs_in_order = false;
    p->last_seq = seq;
  }
  p->msgs++;
  p->last_type = m->type;
}

TN_FN int tp_on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct tpeer *p = ud;
  (void)c;
  p->bulk_begins++;
  p->bulk_count = info->count;
  p->bulk_wire = info->wire;
  snprintf(p->meta, sizeof p->meta, "%.*s", (int)(info->meta_len < 63 ? info->meta_len : 63), (const char *)info->meta);
  if (p->refuse || info->count > p->rx_cap) return -ECONNREFUSED;
  *dst = p->rx_buf;
  *dst_arg = p;
  return 0;
}

TN_FN void tp_on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  struct tpeer *p = ud;
  (void)c, (void)id, (void)dst;
  cr_assert_eq(dst_arg, p, "dst_arg passed back");
  p->bulk_done++;
  p->bulk_status = status;
  if (status == 0) p->bulk_ok++;
}

TN_FN void tp_on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct tpeer *p = ud;
  p->closed++;
  p->close_status = status;
  snprintf(p->close_detail, sizeof p->close_detail, "%s", detail);
  if (p->conn == c) p->conn = NULL;
}

static const struct net_callbacks tp_callbacks = {
    .on_accept = tp_on_accept,
    .on_message = tp_on_message,
    .on_bulk_begin = tp_on_bulk_begin,
    .on_bulk_done = tp_on_bulk_done,
    .on_close = tp_on_close,
};

/* Defaults compressed for tests: short timeouts so a stall fails fast. */
TN_FN void tpeer_config(struct tpeer *p) {
  net_config_defaults(&p->cfg);
  p->cfg.identity = &p->id;
  p->cfg.cluster_key = p->cluster;
  p->cfg.handshake_timeout_ms = 2000;
  /* long enough for a test that spends seconds making data between loop runs */
  p->cfg.idle_timeout_ms = 15000;
  p->cfg.close_linger_ms = 1000;
}

/* Creates identity and config; call tpeer_start after adjusting p->cfg. */
TN_FN void tpeer_setup(struct tpeer *p, const char *label) {
  memset(p, 0, sizeof *p);
  p->label = label;
  p->msgs_in_order = true;
  cr_assert_eq(net_identity_generate(&p->id), 0);
  memcpy(p->cluster, g_cluster, sizeof p->cluster);
  tpeer_config(p);
}

TN_FN void tpeer_start(struct tpeer *p, bool listen) {
  struct rumor_err e = {0};
  int rc = net_init(&p->net, &g_loop, &p->cfg, &tp_callbacks, p, &e);
  cr_assert_eq(rc, 0, "net_init(%s): %s", p->label, e.msg);
  if (listen) cr_assert_eq(net_listen(p->net, "127.0.0.1:0", &e), 0, "listen: %s", e.msg);
}

TN_FN void tp_dial_cb(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct tpeer *p = arg;
  (void)n;
  p->dial_status = status;
  snprintf(p->dial_detail, sizeof p->dial_detail, "%s", detail);
  if (status == 0) {
    p->dial_ok++;
    p->conn = c;
  } else {
    p->dial_fail++;
  }
}

TN_FN void tpeer_dial_port(struct tpeer *p, int port) {
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  cr_assert_eq(net_dial(p->net, addr, tp_dial_cb, p), 0);
}

TN_FN void tp_sent_cb(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct tpeer *p = arg;
  (void)c, (void)id;
  p->sent_done++;
  p->sent_status = status;
}

TN_FN int tpeer_send_bulk(struct tpeer *p, const float *src, uint64_t count, enum net_dtype wire) {
  struct net_bulk_send s = {.src = src, .count = count, .wire = wire, .meta = "meta!", .meta_len = 5,
                            .done = tp_sent_cb, .arg = p};
  uint64_t id;
  return net_conn_send_bulk(p->conn, &s, &id);
}

TN_FN int tpeer_send_msg(struct tpeer *p, uint64_t type, uint64_t seq) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, type, 1);
  net_msgbuf_put_uint(&b, "seq", seq);
  net_msgbuf_put_str(&b, "hello", "world", 5);
  int rc = net_conn_send_msg(p->conn, &b);
  net_msgbuf_free(&b);
  return rc;
}

/* ---- closing everything -------------------------------------------------------------- */

static int g_nets_closed;
TN_FN void tp_net_closed(void *arg) {
  struct tpeer *p = arg;
  p->closed_net = true;
  g_nets_closed++;
}

/* Closes the given peers' nets (and any extra handles the test closed
 * itself), runs the loop dry within a deadline, and checks that the loop
 * closes clean. */
TN_FN void tnet_finish(struct tpeer **peers, int n) {
  int want = g_nets_closed;
  for (int i = 0; i < n; i++) {
    if (peers[i]->net && !peers[i]->closed_net) {
      net_close(peers[i]->net, tp_net_closed, peers[i]);
      want++;
    }
  }
  RUN_UNTIL(g_nets_closed == want, 10);
  cr_assert_eq(g_nets_closed, want, "every net_close callback ran");
  uv_close((uv_handle_t *)&g_tick, NULL);
  double end = clock_now_s() + 10;
  while (uv_loop_alive(&g_loop) && clock_now_s() < end) {
    uv_run(&g_loop, UV_RUN_NOWAIT);
    usleep(1000);
  }
  uv_run(&g_loop, UV_RUN_NOWAIT);
  cr_assert_eq(uv_loop_close(&g_loop), 0, "the loop closes clean (no handle left open)");
  for (int i = 0; i < n; i++) {
    net_identity_wipe(&peers[i]->id);
    free(peers[i]->rx_buf);
    peers[i]->rx_buf = NULL;
  }
}

/* A suite's usual start and end: the loop, the keys, a server and a client
 * peer set up (not started); then their nets closed and the loop checked. */
TN_FN void tpair_setup(struct tpeer *srv, struct tpeer *cli) {
  tloop_init();
  tkeys_init();
  tpeer_setup(srv, "server");
  tpeer_setup(cli, "client");
}

TN_FN void tpair_finish(struct tpeer *srv, struct tpeer *cli) {
  struct tpeer *ps[] = {srv, cli};
  tnet_finish(ps, 2);
}

/* ---- a peer in a child process -------------------------------------------------------- */

static pid_t g_child = -1;
static int g_child_port_fd = -1;

/* Forks a child that waits for the parent's listening port
 * (tchild_tell_port), then makes a loop and a net of its own (the default
 * configuration, the test's cluster key, a fresh identity), dials
 * 127.0.0.1:PORT with `cb` (`arg`, in the child's memory) and runs its loop
 * until it is killed. Call tkeys_init first; end it with tchild_reap. */
TN_FN void tchild_start(net_dial_cb cb, void *arg) {
  int pfd[2];
  cr_assert_eq(pipe(pfd), 0);
  g_child = fork();
  cr_assert_geq(g_child, 0);
  if (g_child > 0) {
    close(pfd[0]);
    g_child_port_fd = pfd[1];
    return;
  }
  close(pfd[1]);
  int port = 0;
  if (read(pfd[0], &port, sizeof port) != sizeof port) _exit(2);
  uv_loop_t loop;
  uv_loop_init(&loop);
  struct net_identity id;
  if (net_identity_generate(&id) != 0) _exit(2);
  struct net_config cfg;
  net_config_defaults(&cfg);
  cfg.identity = &id;
  cfg.cluster_key = g_cluster;
  net_t *n;
  if (net_init(&n, &loop, &cfg, NULL, NULL, NULL) != 0) _exit(2);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  if (net_dial(n, addr, cb, arg) != 0) _exit(2);
  uv_run(&loop, UV_RUN_DEFAULT);
  _exit(0);
}

TN_FN void tchild_tell_port(int port) {
  cr_assert_eq(write(g_child_port_fd, &port, sizeof port), (ssize_t)sizeof port);
  close(g_child_port_fd);
  g_child_port_fd = -1;
}

/* SIGKILLs and reaps the child, if any (a suite's .fini too). */
TN_FN void tchild_reap(void) {
  if (g_child > 0) {
    kill(g_child, SIGKILL);
    waitpid(g_child, NULL, 0);
    g_child = -1;
  }
}

/* ---- memory measurement ------------------------------------------------------------- */

/* Virtual size and resident size in bytes, from /proc/self/status. */
TN_FN void mem_usage(uint64_t *vm, uint64_t *rss) {
  *vm = *rss = 0;
  FILE *f = fopen("/proc/self/status", "r");
  if (!f) return;
  char line[256];
  unsigned long long v;
  while (fgets(line, sizeof line, f)) {
    if (sscanf(line, "VmSize: %llu kB", &v) == 1) *vm = v * 1024;
    if (sscanf(line, "VmRSS: %llu kB", &v) == 1) *rss = v * 1024;
  }
  fclose(f);
}

/* Bytes malloc has handed out (arena and mmapped blocks). */
TN_FN uint64_t heap_in_use(void) {
  struct mallinfo2 mi = mallinfo2();
  return (uint64_t)mi.uordblks + (uint64_t)mi.hblkhd;
}

/* ---- a TCP proxy ----------------------------------------------------------------------- */

enum { TP_C2S = 0, TP_S2C = 1 };
enum tproxy_frame_op { TP_FRAME_NONE, TP_FRAME_DUP, TP_FRAME_SWAP, TP_FRAME_DROP };

#define TP_REC_MAX (4u << 20)
/* Bytes of the handshake in each direction (length prefixes included). */
#define TP_HS_C2S (NET_HS_LEN_BYTES * 2 + NET_HS_HELLO_LEN + NET_HS_AUTH_LEN)
#define TP_HS_S2C (NET_HS_LEN_BYTES + NET_HS_WELCOME_LEN)

struct tproxy;
struct tproxy_side {
  uv_tcp_t tcp;
  struct tproxy *px;
  int dir; /* the direction of the bytes read from this side */
  bool open;
};

struct tproxy {
  uv_tcp_t listener;
  int port, target_port;
  struct tproxy_side down; /* the client's side: bytes read here go c2s */
  struct tproxy_side up;   /* the server's side: bytes read here go s2c */
  uv_connect_t creq;
  bool connected, have_client, closing;
  uint64_t count[2];
  /* faults */
  int flip_dir;
  uint64_t flip_at; /* stream offset of the byte whose bit is flipped */
  uint8_t flip_mask;
  int cut_dir;
  uint64_t cut_at;  /* close both sides once this many bytes went that way */
  bool cut_done;
  /* c2s frame surgery after the handshake */
  enum tproxy_frame_op frame_op;
  uint64_t frame_index; /* which transport frame (0 = first after the handshake) */
  uint8_t *fbuf;
  size_t fbuf_len, fbuf_cap;
  uint64_t frames_seen;
  uint8_t *held; /* a frame held back for a swap */
  size_t held_len;
  /* recording of c2s */
  uint8_t *rec;
  size_t rec_len;
  /* c2s rate limit (tproxy_throttle): bytes wait in `slow` and leave in
   * 10 ms slices; reading from the client stops while more than
   * TP_SLOW_HIGH bytes wait, so that its socket fills as on a slow link */
  uint64_t rate_c2s;
  uint8_t *slow;
  size_t slow_len, slow_cap;
  uv_timer_t slow_timer;
  bool throttled, down_stopped, down_eof;
  int handles;
};
#define TP_SLOW_HIGH (64u << 10)

TN_FN void px_handle_closed(uv_handle_t *h) {
  struct tproxy_side *s = h->data;
  s->px->handles--;
}

TN_FN void px_close_sides(struct tproxy *px) {
  if (px->down.open) {
    px->down.open = false;
    uv_close((uv_handle_t *)&px->down.tcp, px_handle_closed);
  }
  if (px->up.open) {
    px->up.open = false;
    uv_close((uv_handle_t *)&px->up.tcp, px_handle_closed);
  }
}

struct px_write {
  uv_write_t req;
  char data[];
};
TN_FN void px_write_done(uv_write_t *req, int status) {
  (void)status;
  free(req);
}

TN_FN void px_send(struct tproxy *px, int dir, const uint8_t *p, size_t n) {
  struct tproxy_side *to = dir == TP_C2S ? &px->up : &px->down;
  if (!to->open || n == 0) return;
  struct px_write *w = malloc(sizeof *w + n);
  memcpy(w->data, p, n);
  uv_buf_t b = uv_buf_init(w->data, (unsigned)n);
  if (uv_write(&w->req, (uv_stream_t *)&to->tcp, &b, 1, px_write_done) != 0) free(w);
}

/* c2s after the handshake, frame by frame, with the configured surgery. */
TN_FN void px_frames(struct tproxy *px, const uint8_t *p, size_t n) {
  if (n == 0) return;
  if (px->fbuf_len + n > px->fbuf_cap) {
    px->fbuf_cap = (px->fbuf_len + n) * 2;
    px->fbuf = realloc(px->fbuf, px->fbuf_cap);
  }
  memcpy(px->fbuf + px->fbuf_len, p, n);
  px->fbuf_len += n;
  size_t off = 0;
  while (px->fbuf_len - off >= 4) {
    size_t fl = 4 + (size_t)net_be32_get(px->fbuf + off);
    if (px->fbuf_len - off < fl) break;
    const uint8_t *f = px->fbuf + off;
    uint64_t k = px->frames_seen++;
    if (k == px->frame_index && px->frame_op == TP_FRAME_DUP) {
      px_send(px, TP_C2S, f, fl);
      px_send(px, TP_C2S, f, fl);
    } else if (k == px->frame_index && px->frame_op == TP_FRAME_DROP) {
      /* dropped */
    } else if (k == px->frame_index && px->frame_op == TP_FRAME_SWAP) {
      px->held = malloc(fl);
      memcpy(px->held, f, fl);
      px->held_len = fl;
    } else {
      px_send(px, TP_C2S, f, fl);
      if (px->held) {
        px_send(px, TP_C2S, px->held, px->held_len);
        free(px->held);
        px->held = NULL;
      }
    }
    off += fl;
  }
  if (off) memmove(px->fbuf, px->fbuf + off, px->fbuf_len - off);
  px->fbuf_len -= off;
}

/* c2s bytes through the rate limit. */
TN_FN void px_slow_add(struct tproxy *px, const uint8_t *p, size_t n) {
  if (px->slow_len + n > px->slow_cap) {
    px->slow_cap = (px->slow_len + n) * 2;
    px->slow = realloc(px->slow, px->slow_cap);
  }
  memcpy(px->slow + px->slow_len, p, n);
  px->slow_len += n;
  if (px->slow_len > TP_SLOW_HIGH && !px->down_stopped && px->down.open) {
    uv_read_stop((uv_stream_t *)&px->down.tcp);
    px->down_stopped = true;
  }
}

TN_FN void px_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *b);
TN_FN void px_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b);

TN_FN void px_slow_tick(uv_timer_t *t) {
  struct tproxy *px = t->data;
  size_t k = (size_t)(px->rate_c2s / 100);
  if (k == 0) k = 1;
  if (k > px->slow_len) k = px->slow_len;
  px_send(px, TP_C2S, px->slow, k);
  memmove(px->slow, px->slow + k, px->slow_len - k);
  px->slow_len -= k;
  if (px->down_eof && px->slow_len == 0) px_close_sides(px); /* the client's last bytes are through */
  if (px->down_stopped && px->slow_len < TP_SLOW_HIGH / 2 && px->down.open) {
    uv_read_start((uv_stream_t *)&px->down.tcp, px_alloc, px_read);
    px->down_stopped = false;
  }
}

TN_FN void px_forward(struct tproxy *px, int dir, uint8_t *p, size_t n) {
  uint64_t start = px->count[dir];
  if (dir == px->flip_dir && px->flip_at >= start && px->flip_at < start + n) p[px->flip_at - start] ^= px->flip_mask;
  if (dir == px->cut_dir && !px->cut_done && start + n >= px->cut_at) {
    px_send(px, dir, p, (size_t)(px->cut_at - start));
    px->count[dir] = px->cut_at;
    px->cut_done = true;
    px_close_sides(px);
    return;
  }
  px->count[dir] += n;
  if (dir == TP_C2S && px->rec && px->rec_len < TP_REC_MAX) {
    size_t k = n < TP_REC_MAX - px->rec_len ? n : TP_REC_MAX - px->rec_len;
    memcpy(px->rec + px->rec_len, p, k);
    px->rec_len += k;
  }
  if (dir == TP_C2S && px->frame_op != TP_FRAME_NONE) {
    /* the handshake passes untouched; frames after it go through surgery */
    size_t hs_left = start < TP_HS_C2S ? (size_t)(TP_HS_C2S - start) : 0;
    if (hs_left > n) hs_left = n;
    px_send(px, dir, p, hs_left);
    px_frames(px, p + hs_left, n - hs_left);
    return;
  }
  if (dir == TP_C2S && px->throttled) {
    px_slow_add(px, p, n);
    return;
  }
  px_send(px, dir, p, n);
}

TN_FN void px_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b) {
  (void)h;
  b->base = malloc(sz);
  b->len = sz;
}

TN_FN void px_read(uv_stream_t *s, ssize_t nread, const uv_buf_t *b) {
  struct tproxy_side *side = s->data;
  struct tproxy *px = side->px;
  if (nread > 0 && side->open) px_forward(px, side->dir, (uint8_t *)b->base, (size_t)nread);
  free(b->base);
  if (nread < 0 && side == &px->down && px->slow_len > 0) {
    uv_read_stop(s);
    px->down_eof = true; /* the bytes still held go first */
  } else if (nread < 0) {
    px_close_sides(px); /* either side ended: end both */
  }
}

TN_FN void px_connected(uv_connect_t *req, int status) {
  struct tproxy *px = req->data;
  if (status < 0 || !px->down.open) {
    px_close_sides(px);
    return;
  }
  px->connected = true;
  uv_read_start((uv_stream_t *)&px->down.tcp, px_alloc, px_read);
  uv_read_start((uv_stream_t *)&px->up.tcp, px_alloc, px_read);
}

TN_FN void px_on_conn(uv_stream_t *srv, int status) {
  struct tproxy *px = srv->data;
  if (status < 0 || px->have_client) return;
  px->have_client = true;
  uv_tcp_init(&g_loop, &px->down.tcp);
  px->down.tcp.data = &px->down;
  px->down.open = true;
  px->handles++;
  if (uv_accept(srv, (uv_stream_t *)&px->down.tcp) != 0) {
    px_close_sides(px);
    return;
  }
  uv_tcp_init(&g_loop, &px->up.tcp);
  px->up.tcp.data = &px->up;
  px->up.open = true;
  px->handles++;
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", px->target_port, &a);
  px->creq.data = px;
  if (uv_tcp_connect(&px->creq, &px->up.tcp, (const struct sockaddr *)&a, px_connected) != 0) px_close_sides(px);
}

/* A proxy for one connection to 127.0.0.1:target_port. */
TN_FN void tproxy_start(struct tproxy *px, int target_port) {
  memset(px, 0, sizeof *px);
  px->target_port = target_port;
  px->flip_dir = -1;
  px->cut_dir = -1;
  px->down.px = px->up.px = px;
  px->down.dir = TP_C2S;
  px->up.dir = TP_S2C;
  uv_tcp_init(&g_loop, &px->listener);
  px->listener.data = px;
  px->handles = 1;
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", 0, &a);
  cr_assert_eq(uv_tcp_bind(&px->listener, (const struct sockaddr *)&a, 0), 0);
  cr_assert_eq(uv_listen((uv_stream_t *)&px->listener, 8, px_on_conn), 0);
  struct sockaddr_storage ss;
  int len = sizeof ss;
  uv_tcp_getsockname(&px->listener, (struct sockaddr *)&ss, &len);
  px->port = ntohs(((struct sockaddr_in *)&ss)->sin_port);
}

TN_FN void px_listener_closed(uv_handle_t *h) {
  struct tproxy *px = h->data;
  px->handles--;
}

/* Limits the client-to-server direction to `bytes_per_s` (and no more
 * than TP_SLOW_HIGH bytes held in the proxy). Call before the client dials. */
TN_FN void tproxy_throttle(struct tproxy *px, uint64_t bytes_per_s) {
  px->rate_c2s = bytes_per_s;
  px->throttled = true;
  uv_timer_init(&g_loop, &px->slow_timer);
  px->slow_timer.data = px;
  px->handles++;
  uv_timer_start(&px->slow_timer, px_slow_tick, 10, 10);
}

/* Closes the proxy's handles and waits for their callbacks. */
TN_FN void tproxy_stop(struct tproxy *px) {
  px_close_sides(px);
  if (px->throttled) uv_close((uv_handle_t *)&px->slow_timer, px_listener_closed);
  uv_close((uv_handle_t *)&px->listener, px_listener_closed);
  RUN_UNTIL(px->handles == 0, 5);
  cr_assert_eq(px->handles, 0, "proxy handles closed");
  free(px->fbuf);
  free(px->held);
  free(px->rec);
  free(px->slow);
}

/* ---- a raw TCP client (no rumor protocol): writes given bytes ------------------------------------ */

struct traw {
  uv_tcp_t tcp;
  uv_connect_t creq;
  uv_timer_t timer;
  bool connected, eof, closed_tcp, closed_timer;
  uint64_t bytes_in;
  const uint8_t *drip; /* bytes written one at a time, one per interval */
  size_t drip_len, drip_pos;
  double eof_at;
};

TN_FN void traw_alloc(uv_handle_t *h, size_t sz, uv_buf_t *b) {
  static char buf[65536];
  (void)h, (void)sz;
  b->base = buf;
  b->len = sizeof buf;
}
TN_FN void traw_read(uv_stream_t *s, ssize_t n, const uv_buf_t *b) {
  struct traw *r = s->data;
  (void)b;
  if (n > 0) r->bytes_in += (uint64_t)n;
  if (n < 0 && !r->eof) {
    r->eof = true;
    r->eof_at = clock_now_s();
  }
}
TN_FN void traw_connected(uv_connect_t *req, int status) {
  struct traw *r = req->data;
  if (status == 0) {
    r->connected = true;
    uv_read_start((uv_stream_t *)&r->tcp, traw_alloc, traw_read);
  }
}
TN_FN void traw_write_done(uv_write_t *req, int status) {
  (void)status;
  free(req);
}
TN_FN void traw_write(struct traw *r, const void *p, size_t n) {
  struct px_write *w = malloc(sizeof *w + n);
  memcpy(w->data, p, n);
  uv_buf_t b = uv_buf_init(w->data, (unsigned)n);
  if (uv_write(&w->req, (uv_stream_t *)&r->tcp, &b, 1, traw_write_done) != 0) free(w);
}
TN_FN void traw_drip_cb(uv_timer_t *t) {
  struct traw *r = t->data;
  if (r->eof || r->drip_pos >= r->drip_len) return;
  traw_write(r, r->drip + r->drip_pos, 1);
  r->drip_pos++;
}

TN_FN void traw_connect(struct traw *r, int port) {
  memset(r, 0, sizeof *r);
  uv_tcp_init(&g_loop, &r->tcp);
  r->tcp.data = r;
  uv_timer_init(&g_loop, &r->timer);
  r->timer.data = r;
  struct sockaddr_in a;
  uv_ip4_addr("127.0.0.1", port, &a);
  r->creq.data = r;
  cr_assert_eq(uv_tcp_connect(&r->creq, &r->tcp, (const struct sockaddr *)&a, traw_connected), 0);
  RUN_UNTIL(r->connected, 5);
  cr_assert(r->connected, "raw client connected");
}

/* Writes one byte every interval_ms. */
TN_FN void traw_drip(struct traw *r, const uint8_t *p, size_t n, unsigned interval_ms) {
  r->drip = p;
  r->drip_len = n;
  uv_timer_start(&r->timer, traw_drip_cb, 0, interval_ms);
}

TN_FN void traw_closed_tcp(uv_handle_t *h) { ((struct traw *)h->data)->closed_tcp = true; }
TN_FN void traw_closed_timer(uv_handle_t *h) { ((struct traw *)h->data)->closed_timer = true; }
TN_FN void traw_close(struct traw *r) {
  uv_close((uv_handle_t *)&r->tcp, traw_closed_tcp);
  uv_close((uv_handle_t *)&r->timer, traw_closed_timer);
  RUN_UNTIL(r->closed_tcp && r->closed_timer, 5);
}

#endif /* RUMOR_TEST_NET_HELPERS_H */
