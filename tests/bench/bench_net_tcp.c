/*
 * bench_net_tcp — the baseline for bench_net_exchange: the same two-way
 * exchange of an fp32 buffer between two processes on loopback, over plain
 * TCP with no encryption and no framing. Each side has a sender thread
 * (blocking 1 MiB writes) and reads with its main thread into a buffer it
 * touched beforehand, as the rumor bench does; TCP_NODELAY on both ends.
 *
 * One round: the client writes a GO byte and starts sending; the server
 * starts sending once it reads GO, and writes a DONE byte after both of its
 * directions finished. The client's clock stops when it has the server's
 * whole buffer and the DONE byte (the server has the client's buffer).
 * With --one-way only the server sends (the shape of a newcomer's state
 * pull: tests/bench/bench-join.sh). Prints each round and:
 *   bench_net_tcp: median_ms=... min_ms=... mb=... reps=...
 *
 * usage: bench_net_tcp [--mb N] [--reps N] [--one-way]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define IO_CHUNK (1u << 20)
#define MAX_REPS 100

static double now_s(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return t.tv_sec + t.tv_nsec * 1e-9;
}

static void die(const char *what) {
  fprintf(stderr, "bench_net_tcp: %s: %s\n", what, strerror(errno));
  exit(1);
}

static void write_all(int fd, const uint8_t *p, size_t n) {
  while (n) {
    ssize_t w = write(fd, p, n < IO_CHUNK ? n : IO_CHUNK);
    if (w < 0 && errno == EINTR) continue;
    if (w <= 0) die("write");
    p += w;
    n -= (size_t)w;
  }
}

static void read_all(int fd, uint8_t *p, size_t n) {
  while (n) {
    ssize_t r = read(fd, p, n < IO_CHUNK ? n : IO_CHUNK);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) die("read");
    p += r;
    n -= (size_t)r;
  }
}

struct job {
  int fd;
  const uint8_t *p;
  size_t n;
};
static void *sender(void *arg) {
  struct job *j = arg;
  write_all(j->fd, j->p, j->n);
  return NULL;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return x < y ? -1 : x > y;
}

/* One round on one side; returns the client's elapsed ms. One way: only
 * the server sends its buffer. */
static double round_trip(int fd, bool client, bool one_way, uint8_t *src, uint8_t *dst, size_t n) {
  uint8_t b = 'G';
  double t0 = now_s();
  if (client) write_all(fd, &b, 1);
  else read_all(fd, &b, 1);
  pthread_t th;
  memset(&th, 0, sizeof th);
  struct job j = {fd, src, n};
  bool sends = !one_way || !client, receives = !one_way || client;
  if (sends && pthread_create(&th, NULL, sender, &j)) die("pthread_create");
  if (receives) read_all(fd, dst, n);
  if (sends) pthread_join(th, NULL);
  if (client) read_all(fd, &b, 1);
  else {
    b = 'D';
    write_all(fd, &b, 1);
  }
  return (now_s() - t0) * 1e3;
}

static uint8_t *buffer(size_t n, int fill) {
  uint8_t *p = malloc(n);
  if (!p) die("malloc");
  memset(p, fill, n);
  return p;
}

int main(int argc, char **argv) {
  unsigned long long mb = 100;
  int reps = 5;
  bool one_way = false;
  for (int i = 1; i < argc; i++) {
    if (!strcmp(argv[i], "--one-way")) one_way = true;
    else if (i + 1 < argc && !strcmp(argv[i], "--mb")) mb = strtoull(argv[++i], NULL, 10);
    else if (i + 1 < argc && !strcmp(argv[i], "--reps")) reps = atoi(argv[++i]);
    else {
      fprintf(stderr, "usage: bench_net_tcp [--mb N] [--reps N] [--one-way]\n");
      return 2;
    }
  }
  if (mb == 0 || reps < 1 || reps > MAX_REPS) return 2;
  size_t n = (size_t)(mb * 1000 * 1000);
  int ls = socket(AF_INET, SOCK_STREAM, 0);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
  socklen_t al = sizeof a;
  if (ls < 0 || bind(ls, (struct sockaddr *)&a, sizeof a) || listen(ls, 1) ||
      getsockname(ls, (struct sockaddr *)&a, &al))
    die("listen");
  pid_t child = fork();
  if (child < 0) die("fork");
  int one = 1;
  if (child == 0) { /* server */
    close(ls);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    if (fd < 0 || connect(fd, (struct sockaddr *)&a, sizeof a)) die("connect");
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    uint8_t *src = buffer(n, 1), *dst = buffer(n, 0);
    for (int r = -1; r < reps; r++) round_trip(fd, false, one_way, src, dst, n);
    _exit(0);
  }
  int fd = accept(ls, NULL, NULL);
  if (fd < 0) die("accept");
  setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
  uint8_t *src = buffer(n, 2), *dst = buffer(n, 0);
  double times[MAX_REPS];
  printf(one_way ? "raw TCP, one way: %llu MB\n" : "raw TCP exchange: %llu MB each way\n", mb);
  for (int r = -1; r < reps; r++) { /* round -1 warms up and is not counted */
    double ms = round_trip(fd, true, one_way, src, dst, n);
    if (r < 0) continue;
    times[r] = ms;
    printf("  round %d: %8.1f ms  (%.0f MB/s %s)\n", r, ms, (double)mb / (ms / 1e3), one_way ? "one way" : "each way");
  }
  close(fd);
  waitpid(child, NULL, 0);
  qsort(times, (size_t)reps, sizeof times[0], cmp_double);
  printf("bench_net_tcp: median_ms=%.1f min_ms=%.1f mb=%llu reps=%d\n", times[reps / 2], times[0], mb, reps);
  return 0;
}
