/*
 * bench_net_exchange — two processes on loopback exchange an fp32 buffer in
 * both directions at once over rumor's encrypted transport, the way one
 * gossip exchange does. The parent is the client, a forked child the server.
 *
 * One round: the client sends GO (a control message) and starts its
 * transfer; the server starts its own on GO. The client's clock stops when
 * its transfer is confirmed (the server has the whole, digest-checked
 * buffer) and the server's transfer has arrived whole. Prints each round
 * and a machine-readable summary line:
 *   bench_net_exchange: median_ms=... min_ms=... mb=... reps=...
 *
 * --relay: the server listens nowhere; a third process relays (net/relay.c)
 * and the client reaches the server through it, so every byte crosses
 * loopback twice and is sealed twice (end to end and hop by hop).
 *
 * usage: bench_net_exchange [--mb N] [--reps N] [--wire f32|f16|bf16|i8]
 *                           [--no-digest] [--suite aes|chacha]
 *                           [--sock-buf BYTES] [--chunk BYTES] [--relay]
 */
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "net/net.h"

#define MSG_GO 1
#define MAX_REPS 100

struct opts {
  uint64_t mb;
  int reps;
  enum net_dtype wire;
  bool no_digest;
  unsigned suites;
  int sock_buf;
  size_t chunk;
  bool relay;
};

struct side {
  net_t *net;
  net_conn_t *conn;
  uv_loop_t *loop;
  const struct opts *o;
  float *src, *dst;
  uint64_t count;
  int round, sent, recvd, sent_status, recv_status;
  bool closed;
  bool is_server;
};

/* Made before the fork: the client must know the server's key to reach it
 * through a relay. */
static struct net_identity g_server_id, g_client_id;

static void die(const char *what, int rc) {
  fprintf(stderr, "bench_net_exchange: %s: %s\n", what, rumor_strerror(rc));
  exit(1);
}

static void on_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  struct side *s = arg;
  (void)c, (void)id;
  s->sent++;
  s->sent_status = status;
}

static void start_send(struct side *s) {
  struct net_bulk_send b = {.src = s->src, .count = s->count, .wire = s->o->wire, .no_digest = s->o->no_digest,
                            .done = on_sent, .arg = s};
  uint64_t id;
  int rc = net_conn_send_bulk(s->conn, &b, &id);
  if (rc) die("send", rc);
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct side *s = ud;
  (void)c;
  if (m->type == MSG_GO && s->is_server) start_send(s);
}

static int on_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **arg, void *ud) {
  struct side *s = ud;
  (void)c;
  if (info->count != s->count) return -1;
  *dst = s->dst;
  *arg = s;
  return 0;
}

static void on_done(net_conn_t *c, uint64_t id, int status, float *dst, void *arg, void *ud) {
  struct side *s = ud;
  (void)c, (void)id, (void)dst, (void)arg;
  s->recvd++;
  s->recv_status = status;
}

/* With --relay the server also learns of its connection to the relay:
 * the exchange is the relayed one. */
static void on_accept(net_conn_t *c, void *ud) {
  struct side *s = ud;
  if (!s->o->relay || net_conn_relayed(c)) s->conn = c;
}
static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct side *s = ud;
  (void)status, (void)detail;
  if (c != s->conn) return;
  s->conn = NULL;
  s->closed = true;
}

static const struct net_callbacks cbs = {.on_accept = on_accept, .on_message = on_message,
                                         .on_bulk_begin = on_begin, .on_bulk_done = on_done, .on_close = on_close};

static void side_init(struct side *s, const struct opts *o, const uint8_t *cluster, bool server) {
  memset(s, 0, sizeof *s);
  s->o = o;
  s->is_server = server;
  s->count = o->mb * 1000 * 1000 / 4;
  s->loop = malloc(sizeof *s->loop);
  uv_loop_init(s->loop);
  s->src = malloc(s->count * sizeof(float));
  s->dst = malloc(s->count * sizeof(float));
  if (!s->src || !s->dst) die("malloc", -12);
  struct rng r;
  rng_seed(&r, server ? 1 : 2, 0);
  for (uint64_t i = 0; i < s->count; i++) s->src[i] = rng_uniform(&r) - 0.5f;
  memset(s->dst, 0, s->count * sizeof(float)); /* touch it: no page faults while timing */
  struct net_config cfg;
  net_config_defaults(&cfg);
  cfg.identity = server ? &g_server_id : &g_client_id;
  cfg.cluster_key = cluster;
  cfg.suites = o->suites;
  cfg.sock_buf_bytes = o->sock_buf;
  cfg.bulk_chunk_bytes = o->chunk;
  cfg.max_bulk_bytes = 64ull << 30;
  if (cfg.max_queued_bytes < 4 * o->chunk + (1u << 20)) cfg.max_queued_bytes = 4 * o->chunk + (1u << 20);
  cfg.idle_timeout_ms = 0;
  struct rumor_err e = {0};
  int rc = net_init(&s->net, s->loop, &cfg, &cbs, s, &e);
  if (rc) {
    fprintf(stderr, "bench_net_exchange: %s\n", e.msg);
    exit(1);
  }
}

static void on_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  struct side *s = arg;
  (void)n;
  if (status) {
    fprintf(stderr, "bench_net_exchange: dial: %s\n", detail);
    exit(1);
  }
  s->conn = c;
}

static double cpu_seconds(int who) {
  struct rusage ru;
  getrusage(who, &ru);
  return ru.ru_utime.tv_sec + ru.ru_utime.tv_usec * 1e-6 + ru.ru_stime.tv_sec + ru.ru_stime.tv_usec * 1e-6;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

static void on_listen(net_t *n, int status, const char *detail, void *arg) {
  (void)n;
  if (status) {
    fprintf(stderr, "bench_net_exchange: relay registration: %s\n", detail);
    exit(1);
  }
  *(bool *)arg = true;
}

/* The relay (--relay): a net that only relays; serves until killed. */
static void relay_main(const struct opts *o, const uint8_t *cluster, int port_fd) {
  uv_loop_t loop;
  uv_loop_init(&loop);
  struct net_identity id;
  if (net_identity_generate(&id)) die("identity", -1);
  struct net_config cfg;
  net_config_defaults(&cfg);
  cfg.identity = &id;
  cfg.cluster_key = cluster;
  cfg.suites = o->suites;
  cfg.sock_buf_bytes = o->sock_buf;
  cfg.relay = true;
  cfg.idle_timeout_ms = 0;
  net_t *n;
  struct rumor_err e = {0};
  if (net_init(&n, &loop, &cfg, NULL, NULL, &e) || net_listen(n, "127.0.0.1:0", &e)) {
    fprintf(stderr, "bench_net_exchange: relay: %s\n", e.msg);
    exit(1);
  }
  int port = net_listen_port(n);
  if (write(port_fd, &port, sizeof port) != sizeof port) exit(1);
  close(port_fd);
  uv_run(&loop, UV_RUN_DEFAULT);
  _exit(0);
}

/* The server: listens (and reports its port), or with --relay registers
 * with the relay at `relay_port` (and reports that it did). */
static void server_main(const struct opts *o, const uint8_t *cluster, int port_fd, int relay_port) {
  struct side s;
  side_init(&s, o, cluster, true);
  struct rumor_err e = {0};
  int port = 0;
  if (relay_port) {
    char ra[64];
    bool ok = false;
    snprintf(ra, sizeof ra, "127.0.0.1:%d", relay_port);
    int rc = net_relay_listen(s.net, ra, on_listen, &ok);
    if (rc) die("relay listen", rc);
    while (!ok) uv_run(s.loop, UV_RUN_ONCE);
    port = relay_port;
  } else {
    if (net_listen(s.net, "127.0.0.1:0", &e)) {
      fprintf(stderr, "bench_net_exchange: %s\n", e.msg);
      exit(1);
    }
    port = net_listen_port(s.net);
  }
  if (write(port_fd, &port, sizeof port) != sizeof port) exit(1);
  close(port_fd);
  /* Serve until the client closes the connection. */
  while (!s.closed) uv_run(s.loop, UV_RUN_ONCE);
  _exit(0);
}

static void usage(void) {
  fprintf(stderr, "usage: bench_net_exchange [--mb N] [--reps N] [--wire f32|f16|bf16|i8] [--no-digest]\n"
                  "                          [--suite aes|chacha] [--sock-buf BYTES] [--chunk BYTES] [--relay]\n");
  exit(2);
}

int main(int argc, char **argv) {
  struct opts o = {.mb = 100, .reps = 5, .wire = NET_DTYPE_F32, .suites = NET_SUITE_AES256GCM | NET_SUITE_CHACHA20POLY1305,
                   .chunk = 1u << 20};
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
    if (!strcmp(a, "--no-digest")) o.no_digest = true;
    else if (!strcmp(a, "--relay")) o.relay = true;
    else if (!v) usage();
    else if (!strcmp(a, "--mb")) o.mb = strtoull(v, NULL, 10), i++;
    else if (!strcmp(a, "--reps")) o.reps = atoi(v), i++;
    else if (!strcmp(a, "--sock-buf")) o.sock_buf = atoi(v), i++;
    else if (!strcmp(a, "--chunk")) o.chunk = strtoull(v, NULL, 10), i++;
    else if (!strcmp(a, "--wire")) {
      o.wire = !strcmp(v, "f16")    ? NET_DTYPE_F16
               : !strcmp(v, "bf16") ? NET_DTYPE_BF16
               : !strcmp(v, "i8")   ? NET_DTYPE_I8
                                    : NET_DTYPE_F32;
      i++;
    } else if (!strcmp(a, "--suite")) {
      o.suites = !strcmp(v, "chacha") ? NET_SUITE_CHACHA20POLY1305 : NET_SUITE_AES256GCM;
      i++;
    } else usage();
  }
  if (o.mb == 0 || o.reps < 1 || o.reps > MAX_REPS) usage();
  log_set_level(LOG_WARN);
  if (net_crypto_init()) die("libsodium", -1);
  uint8_t cluster[NET_CLUSTER_KEY_BYTES];
  if (net_cluster_key_generate(cluster) || net_identity_generate(&g_server_id) || net_identity_generate(&g_client_id))
    die("keys", -1);

  int pfd[2], relay_port = 0;
  pid_t relay = 0;
  if (o.relay) {
    if (pipe(pfd)) die("pipe", -1);
    relay = fork();
    if (relay < 0) die("fork", -1);
    if (relay == 0) {
      close(pfd[0]);
      relay_main(&o, cluster, pfd[1]);
    }
    close(pfd[1]);
    if (read(pfd[0], &relay_port, sizeof relay_port) != sizeof relay_port) die("the relay did not start", -1);
    close(pfd[0]);
  }
  if (pipe(pfd)) die("pipe", -1);
  pid_t child = fork();
  if (child < 0) die("fork", -1);
  if (child == 0) {
    close(pfd[0]);
    server_main(&o, cluster, pfd[1], relay_port);
  }
  close(pfd[1]);
  struct side s;
  side_init(&s, &o, cluster, false);
  int port = 0;
  if (read(pfd[0], &port, sizeof port) != sizeof port) die("child did not start", -1);
  close(pfd[0]);
  char addr[64];
  snprintf(addr, sizeof addr, "127.0.0.1:%d", port);
  int rc = o.relay ? net_dial_via(s.net, addr, g_server_id.pk, on_dial, &s) : net_dial(s.net, addr, on_dial, &s);
  if (rc) die("dial", rc);
  while (!s.conn) uv_run(s.loop, UV_RUN_ONCE);

  double times[MAX_REPS];
  printf("rumor exchange%s: %llu MB each way, wire %s, digest %s, cipher %s\n",
         o.relay ? " through a relay" : "", (unsigned long long)o.mb,
         net_dtype_name(o.wire), o.no_digest ? "off" : "on",
         net_conn_suite(s.conn) == NET_SUITE_AES256GCM ? "aes256gcm" : "chacha20poly1305");
  for (int r = -1; r < o.reps; r++) { /* round -1 warms up and is not counted */
    int sent0 = s.sent, recvd0 = s.recvd;
    double cpu0 = cpu_seconds(RUSAGE_SELF);
    double t0 = clock_now_s();
    struct net_msgbuf m;
    net_msgbuf_init(&m, MSG_GO, 1);
    rc = net_conn_send_msg(s.conn, &m);
    net_msgbuf_free(&m);
    if (rc) die("go", rc);
    start_send(&s);
    while (s.sent == sent0 || s.recvd == recvd0) uv_run(s.loop, UV_RUN_ONCE);
    double ms = (clock_now_s() - t0) * 1e3;
    double cpu = cpu_seconds(RUSAGE_SELF) - cpu0;
    if (s.sent_status || s.recv_status) {
      fprintf(stderr, "bench_net_exchange: round %d failed: sent %d, received %d\n", r, s.sent_status,
              s.recv_status);
      kill(child, SIGKILL);
      waitpid(child, NULL, 0);
      if (relay) kill(relay, SIGKILL), waitpid(relay, NULL, 0);
      return 1;
    }
    if (r < 0) continue;
    times[r] = ms;
    printf("  round %d: %8.1f ms  (%.0f MB/s each way; client CPU %.0f ms)\n", r, ms, (double)o.mb / (ms / 1e3),
           cpu * 1e3);
  }
  net_conn_close(s.conn);
  while (!s.closed) uv_run(s.loop, UV_RUN_ONCE);
  int st = 0;
  waitpid(child, &st, 0);
  if (relay) {
    kill(relay, SIGKILL);
    waitpid(relay, NULL, 0);
  }
  qsort(times, (size_t)o.reps, sizeof times[0], cmp_double);
  printf("bench_net_exchange: median_ms=%.1f min_ms=%.1f mb=%llu reps=%d\n", times[o.reps / 2], times[0],
         (unsigned long long)o.mb, o.reps);
  return 0;
}
