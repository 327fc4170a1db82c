/* The group communicator over net/ (authenticated, encrypted, on
 * 127.0.0.1 with port 0): three members, each with its own net transport,
 * give bit for bit the in-process transport's results for every collective
 * at small and above-1-MiB sizes; a member with another cluster key or
 * group identity is refused; a differing agreement text fails the start
 * naming the difference; a member that leaves, aborts, is killed or stops
 * (SIGSTOP) fails the others naming it. */
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "peer/group/comm.h"

#include "../support/comm_check.h"
#include "../support/proc.h"

#define N 3

static struct net_identity group_id;
static uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];

static void setup(void) {
  cr_assert_eq(net_identity_generate(&group_id), 0);
  cr_assert_eq(net_cluster_key_generate(cluster_key), 0);
}

static void teardown(void) {
  proc_kill_all();
  net_identity_wipe(&group_id);
}

TestSuite(comm_net, .init = setup, .fini = teardown, .timeout = 60);

struct opts {
  const struct net_identity *id[N]; /* NULL: the group's */
  const uint8_t *key[N];            /* NULL: the cluster's */
  const char *agreement[N];         /* NULL: "model=mlp layout=dp3" */
  uint32_t connect_ms, heartbeat_ms, dead_ms;
};

/* Starts member r, dialing the addresses in addrs[0..r). */
static int start_member(comm_t **c, int r, int size, const char *const *addrs, const struct opts *o,
                        struct rumor_err *e) {
  struct comm_net_config cfg = {
      .identity = o && o->id[r] ? o->id[r] : &group_id,
      .cluster_key = o && o->key[r] ? o->key[r] : cluster_key,
      .group = "g1",
      .agreement = o && o->agreement[r] ? o->agreement[r] : "model=mlp layout=dp3",
      .rank = r,
      .size = size,
      .listen = "127.0.0.1:0",
      .peers = addrs,
      .connect_timeout_ms = o && o->connect_ms ? o->connect_ms : 10000,
      .heartbeat_ms = o ? o->heartbeat_ms : 0,
      .dead_after_ms = o ? o->dead_ms : 0,
  };
  return comm_net_start(c, &cfg, e);
}

/* Starts members first..size-1 (those before `first` run elsewhere at
 * addrs[0..first)). */
static void start_group(comm_t **comms, int first, int size, char addrs[][64], const struct opts *o) {
  const char *a[N];
  for (int r = 0; r < size; r++) a[r] = addrs[r];
  for (int r = first; r < size; r++) {
    struct rumor_err e;
    cr_assert_eq(start_member(&comms[r], r, size, a, o, &e), 0, "member %d: %s", r, e.msg);
    snprintf(addrs[r], 64, "%s", comm_net_address(comms[r]));
    cr_assert(strncmp(addrs[r], "127.0.0.1:", 10) == 0 && atoi(addrs[r] + 10) > 0, "address '%s'", addrs[r]);
  }
}

/* ---- every collective, over both transports ---- */

#define BIG ((1 << 20) + 5) /* 4 MiB of floats: the ring */

/* Runs a fixed sequence of collectives and keeps every result, end to end,
 * in m->out. */
static void sequence_member(struct member *m) {
  int r = m->rank, P = m->size, rc = comm_wait_ready(m->c, &m->e);
  int64_t a2a_send[N], a2a_recv[N], total_recv = 0;
  for (int j = 0; j < P; j++) {
    a2a_send[j] = (r * 7 + j * 3) % 5 == 0 ? 0 : 1000 * (r + 1) + j + (r == 1 ? 300000 : 0);
    a2a_recv[j] = (j * 7 + r * 3) % 5 == 0 ? 0 : 1000 * (j + 1) + r + (j == 1 ? 300000 : 0);
    total_recv += a2a_recv[j];
  }
  int64_t sizes[] = {1000, BIG, BIG, BIG, total_recv, 1 << 19};
  int64_t total = 0;
  for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) total += sizes[k];
  float *out = xcalloc((size_t)total, sizeof(float)), *p = out;
  m->out = out;
  m->out_n = total;
  comm_fill(p, r, 0, 1000);
  if (!rc) rc = comm_all_reduce(m->c, p, 1000, &m->e);
  p += 1000;
  comm_fill(p, r, 0, BIG);
  if (!rc) rc = comm_all_reduce(m->c, p, BIG, &m->e);
  p += BIG;
  comm_fill(p, r, 0, BIG);
  if (!rc) rc = comm_reduce_scatter(m->c, p, BIG, &m->e);
  int64_t lo, hi;
  comm_chunk(BIG, P, r, &lo, &hi);
  for (int64_t i = 0; i < BIG; i++) /* only the own chunk is defined */
    if (i < lo || i >= hi) p[i] = 0;
  p += BIG;
  comm_fill(p + lo, r + 10, lo, hi - lo);
  if (!rc) rc = comm_all_gather(m->c, p, BIG, &m->e);
  p += BIG;
  int64_t st = 0;
  for (int j = 0; j < P; j++) st += a2a_send[j];
  float *send = xmalloc((size_t)st * sizeof(float));
  comm_fill(send, r + 20, 0, st);
  if (!rc) rc = comm_all_to_all(m->c, send, a2a_send, p, a2a_recv, &m->e);
  free(send);
  p += total_recv;
  if (r == 1) comm_fill(p, 1, 0, 1 << 19);
  if (!rc) rc = comm_broadcast(m->c, 1, p, (int64_t)sizeof(float) << 19, &m->e);
  if (!rc) rc = comm_barrier(m->c, &m->e);
  m->rc = rc;
}

Test(comm_net, collectives_equal_the_local_transports_bit_for_bit) {
  comm_t *net[N], *local[N];
  char addrs[N][64];
  start_group(net, 0, N, addrs, NULL);
  struct member mn[N], ml[N];
  double t0 = clock_now_s();
  members_run(net, N, sequence_member, NULL, mn);
  double t_net = clock_now_s() - t0;
  comm_local_create(N, local);
  members_run(local, N, sequence_member, NULL, ml);
  for (int r = 0; r < N; r++) {
    cr_assert_eq(mn[r].rc, 0, "net member %d: %s", r, mn[r].e.msg);
    cr_assert_eq(ml[r].rc, 0, "local member %d: %s", r, ml[r].e.msg);
    comm_check_sum(mn[r].out, N, 0, 1000, mn[r].bad, sizeof mn[r].bad);
    comm_check_sum(mn[r].out + 1000, N, 0, BIG, mn[r].bad, sizeof mn[r].bad);
    cr_assert(!mn[r].bad[0], "member %d: %s", r, mn[r].bad);
    cr_assert_eq(mn[r].out_n, ml[r].out_n);
    for (int64_t i = 0; i < mn[r].out_n; i++)
      if (memcmp(&mn[r].out[i], &ml[r].out[i], sizeof(float)) != 0)
        cr_assert_fail("member %d element %lld: net %.9g, local %.9g", r, (long long)i, (double)mn[r].out[i],
                       (double)ml[r].out[i]);
    uint64_t s, rv;
    comm_bytes(net[r], &s, &rv);
    cr_assert(s > 3 * BIG && rv > 3 * BIG, "bytes %llu/%llu", (unsigned long long)s, (unsigned long long)rv);
    cr_assert(!comm_failed(net[r], NULL, NULL, 0));
  }
  cr_log_info("net sequence: %.2f s", t_net);
  for (int r = 0; r < N; r++) {
    comm_free(net[r], 2000);
    comm_free(local[r], 0);
    free(mn[r].out);
    free(ml[r].out);
  }
}

/* ---- refusals ---- */

static void ready_member(struct member *m) { m->rc = comm_wait_ready(m->c, &m->e); }

/* Member 2 holds another secret: it is refused by both others, which in
 * turn time out waiting for it. */
static void check_refused(const struct opts *o) {
  comm_t *c[N];
  char addrs[N][64];
  start_group(c, 0, N, addrs, o);
  struct member ms[N];
  members_run(c, N, ready_member, NULL, ms);
  cr_log_info("member 2: %s / member 0: %s", ms[2].e.msg, ms[0].e.msg);
  cr_assert_eq(ms[2].rc, RUMOR_EAUTH, "member 2: %d %s", ms[2].rc, ms[2].e.msg);
  cr_assert(strstr(ms[2].e.msg, "refused the handshake"), "member 2: %s", ms[2].e.msg);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(ms[r].rc, RUMOR_ETIMEDOUT, "member %d: %d %s", r, ms[r].rc, ms[r].e.msg);
    cr_assert(strstr(ms[r].e.msg, "group member 2 did not connect"), "member %d: %s", r, ms[r].e.msg);
    int who = -1;
    cr_assert(comm_failed(c[r], &who, NULL, 0) && who == 2, "culprit %d", who);
  }
  for (int r = 0; r < N; r++) comm_free(c[r], 0);
}

Test(comm_net, a_member_with_another_cluster_key_is_refused) {
  uint8_t other[NET_CLUSTER_KEY_BYTES];
  cr_assert_eq(net_cluster_key_generate(other), 0);
  struct opts o = {.key = {NULL, NULL, other}, .connect_ms = 1500};
  check_refused(&o);
}

Test(comm_net, a_member_with_another_group_identity_is_refused) {
  struct net_identity other;
  cr_assert_eq(net_identity_generate(&other), 0);
  struct opts o = {.id = {NULL, NULL, &other}, .connect_ms = 1500};
  check_refused(&o);
  net_identity_wipe(&other);
}

Test(comm_net, a_differing_agreement_fails_the_start_naming_it) {
  struct opts o = {.agreement = {NULL, NULL, "model=mlp layout=dp2"}};
  comm_t *c[N];
  char addrs[N][64];
  start_group(c, 0, N, addrs, &o);
  struct member ms[N];
  members_run(c, N, ready_member, NULL, ms);
  cr_log_info("member 0: %s / member 2: %s", ms[0].e.msg, ms[2].e.msg);
  for (int r = 0; r < N; r++) {
    cr_assert_eq(ms[r].rc, RUMOR_EPROTO, "member %d: %d %s", r, ms[r].rc, ms[r].e.msg);
    cr_assert(r < 2 ? strstr(ms[r].e.msg, "layout=dp2") && strstr(ms[r].e.msg, "layout=dp3")
                    : strstr(ms[r].e.msg, "refused this member") != NULL,
              "member %d: %s", r, ms[r].e.msg);
  }
  for (int r = 0; r < 2; r++) {
    int who = -1;
    cr_assert(comm_failed(c[r], &who, NULL, 0) && who == 2, "member %d blames %d", r, who);
  }
  for (int r = 0; r < N; r++) comm_free(c[r], 0);
}

Test(comm_net, bad_configurations_are_refused_with_a_message) {
  comm_t *c;
  struct rumor_err e;
  struct comm_net_config cfg = {.identity = &group_id, .cluster_key = cluster_key, .group = "g1", .rank = 1,
                                .size = 2, .listen = "127.0.0.1:0"};
  cr_assert_eq(comm_net_start(&c, &cfg, &e), -EINVAL);
  cr_assert(strstr(e.msg, "addresses of members 0"), "%s", e.msg);
  const char *bad[] = {"nowhere"};
  cfg.peers = bad;
  cr_assert_eq(comm_net_start(&c, &cfg, &e), RUMOR_EFORMAT, "%s", e.msg);
  cr_assert(strstr(e.msg, "member 0's address"), "%s", e.msg);
  cfg.rank = 0;
  cfg.group = "a group";
  cr_assert_eq(comm_net_start(&c, &cfg, &e), RUMOR_EFORMAT);
  cfg.group = "g1";
  cfg.heartbeat_ms = 500, cfg.dead_after_ms = 400;
  cr_assert_eq(comm_net_start(&c, &cfg, &e), -EINVAL);
  cr_assert(strstr(e.msg, "dead_after_ms"), "%s", e.msg);
  cr_assert(c == NULL);
}

/* ---- members that go ---- */

enum going { GO_FREE, GO_ABORT };

/* Member 2 leaves (or aborts) after one collective; the others' next one
 * fails naming it. */
static void going_member(struct member *m) {
  enum going how = *(const enum going *)m->ctx;
  float b[64] = {0};
  int rc = comm_wait_ready(m->c, &m->e);
  if (!rc) rc = comm_all_reduce(m->c, b, 64, &m->e);
  if (m->rank == 2) {
    m->rc = rc;
    if (how == GO_ABORT) comm_abort(m->c, "disk full");
    comm_free(m->c, 1000);
    return;
  }
  if (!rc) rc = comm_all_reduce(m->c, b, 64, &m->e);
  m->rc = rc;
}

static void check_going(enum going how, int want_rc, const char *want) {
  comm_t *c[N];
  char addrs[N][64];
  start_group(c, 0, N, addrs, NULL);
  struct member ms[N];
  members_run(c, N, going_member, &how, ms);
  cr_assert_eq(ms[2].rc, 0, "%s", ms[2].e.msg);
  cr_log_info("member 0: %s", ms[0].e.msg);
  for (int r = 0; r < 2; r++) {
    cr_assert_eq(ms[r].rc, want_rc, "member %d: %d %s", r, ms[r].rc, ms[r].e.msg);
    cr_assert(strstr(ms[r].e.msg, "group member 2") && strstr(ms[r].e.msg, want), "member %d: %s", r, ms[r].e.msg);
    int who = -1;
    cr_assert(comm_failed(c[r], &who, NULL, 0) && who == 2, "member %d blames %d", r, who);
  }
  for (int r = 0; r < 2; r++) comm_free(c[r], 0);
}

Test(comm_net, a_member_that_leaves_fails_the_others_naming_it) { check_going(GO_FREE, -ECONNRESET, "left the group"); }

Test(comm_net, a_member_that_aborts_fails_the_others_with_its_reason) {
  check_going(GO_ABORT, RUMOR_ECANCELED, "disk full");
}

/* Member 0 in a child process: it reports its address, joins one
 * all-reduce, then idles until the parent kills or stops it. */
static void child_member0(int fd, const struct opts *o) {
  alarm(30); /* never outlives a broken test */
  comm_t *c;
  struct rumor_err e;
  if (start_member(&c, 0, N, NULL, o, &e)) _exit(2);
  char addr[64];
  snprintf(addr, sizeof addr, "%s", comm_net_address(c));
  if (write(fd, addr, sizeof addr) != (ssize_t)sizeof addr) _exit(3);
  float b[64] = {0};
  if (comm_wait_ready(c, &e) || comm_all_reduce(c, b, 64, &e)) _exit(4);
  for (;;) pause();
}

/* Members 1 and 2 finish a first all-reduce with member 0, wait until
 * the main thread has killed or stopped it, and try a second. */
struct death {
  pthread_mutex_t mu;
  pthread_cond_t cond;
  int first_done;
  bool signalled;
  pid_t pid;
  int sig;
};

static void second_round_member(struct member *m) {
  struct death *d = m->ctx;
  float b[64] = {0};
  int rc = comm_wait_ready(m->c, &m->e);
  if (!rc) rc = comm_all_reduce(m->c, b, 64, &m->e);
  if (rc) snprintf(m->bad, sizeof m->bad, "the first round failed");
  pthread_mutex_lock(&d->mu);
  d->first_done++;
  pthread_cond_broadcast(&d->cond);
  while (!d->signalled) pthread_cond_wait(&d->cond, &d->mu);
  pthread_mutex_unlock(&d->mu);
  if (!rc) rc = comm_all_reduce(m->c, b, 64, &m->e);
  m->rc = rc;
}

static void *signal_member0(void *arg) {
  struct death *d = arg;
  pthread_mutex_lock(&d->mu);
  while (d->first_done < N - 1) pthread_cond_wait(&d->cond, &d->mu);
  kill(d->pid, d->sig);
  d->signalled = true;
  pthread_cond_broadcast(&d->cond);
  pthread_mutex_unlock(&d->mu);
  return NULL;
}

static void check_child_death(int sig, int want_rc, const char *want) {
  struct opts o = {.heartbeat_ms = 100, .dead_ms = 800};
  int fds[2];
  cr_assert_eq(pipe(fds), 0);
  pid_t pid = fork();
  cr_assert(pid >= 0);
  if (pid == 0) {
    close(fds[0]);
    child_member0(fds[1], &o);
  }
  proc_register(pid);
  close(fds[1]);
  char addrs[N][64];
  cr_assert_eq(read(fds[0], addrs[0], sizeof addrs[0]), (ssize_t)sizeof addrs[0]);
  close(fds[0]);
  comm_t *c[N];
  start_group(c, 1, N, addrs, &o);
  struct death d = {.pid = pid, .sig = sig};
  pthread_mutex_init(&d.mu, NULL);
  pthread_cond_init(&d.cond, NULL);
  pthread_t th;
  pthread_create(&th, NULL, signal_member0, &d);
  struct member ms[N];
  members_run(c + 1, N - 1, second_round_member, &d, ms);
  pthread_join(th, NULL);
  kill(pid, SIGKILL);
  proc_wait(pid, 5.0);
  cr_log_info("member 1: %s", ms[0].e.msg);
  for (int r = 0; r < N - 1; r++) {
    cr_assert(!ms[r].bad[0], "member %d: %s: %s", r + 1, ms[r].bad, ms[r].e.msg);
    cr_assert_eq(ms[r].rc, want_rc, "member %d: %d %s", r + 1, ms[r].rc, ms[r].e.msg);
    cr_assert(strstr(ms[r].e.msg, "group member 0 (127.0.0.1:") && strstr(ms[r].e.msg, want), "member %d: %s", r + 1,
              ms[r].e.msg);
    int who = -1;
    cr_assert(comm_failed(c[r + 1], &who, NULL, 0) && who == 0, "member %d blames %d", r + 1, who);
  }
  for (int r = 1; r < N; r++) comm_free(c[r], 0);
}

Test(comm_net, a_killed_member_is_named_lost) { check_child_death(SIGKILL, -ECONNRESET, "lost"); }

Test(comm_net, a_stopped_member_is_judged_silent) { check_child_death(SIGSTOP, RUMOR_ETIMEDOUT, "lost"); }
