/* Network faults between peers on separate test hosts (deploy/testnet.sh:
 * network namespaces joined by a switch, with per-host delay, loss, rate
 * and cuts): a host cut off for 30 s and healed (both sides keep training,
 * the drift Ξ returns under its bound, the cut-off peer keeps its verdicts
 * to itself and takes a member's table after the heal), 100 ms round trips over 100 Mbit/s
 * links (exchanges complete, training proceeds), 1 % loss (no stuck
 * exchange, no false failure verdict), and a peer stopped for longer than
 * the suspicion time (declared failed, and back with a higher incarnation
 * when it resumes); an all-reduce member cut off from the others (it waits
 * for a quorum, then takes their state); an all-reduce member whose link
 * loses packets (it leaves the ring for a while, then takes the others'
 * state). Every test skips, saying why, where test hosts cannot be made
 * (not root, no network namespaces).
 *
 * Figures go to stderr ("figure: ...") for docs/reliability.md. */
#include <criterion/criterion.h>
#include <libgen.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../support/cluster.h"
#include "gossip/drift.h"
#include "peer/train/train.h"
#include "../support/ckpt_params.h"
#include "../support/fmnist.h"

static struct cluster C;
static char testnet_sh[512], netsim_bin[512], net_name[32];
static bool net_up;

/* Runs a testnet.sh command (quietly unless it fails); returns its status. */
static int testnet(const char *fmt, ...) {
  char args[512], cmd[1200];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(args, sizeof args, fmt, ap);
  va_end(ap);
  snprintf(cmd, sizeof cmd, "%s %s >/dev/null 2>%s/testnet.err", testnet_sh, args, C.dir);
  int st = system(cmd);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

static void setup(void) {
  cluster_init(&C);
  snprintf(testnet_sh, sizeof testnet_sh, "%s/deploy/testnet.sh", RUMOR_SOURCE_DIR);
  /* RUMOR_TESTING_BIN is <build>/tests/rumor-testing; netsim is <build>/tests/netsim/netsim. */
  char bin[512];
  snprintf(bin, sizeof bin, "%s", RUMOR_TESTING_BIN);
  snprintf(netsim_bin, sizeof netsim_bin, "%s/netsim/netsim", dirname(bin));
  snprintf(net_name, sizeof net_name, "rtn%d", (int)getpid() % 100000);
  setenv("TESTNET_NAME", net_name, 1);
  setenv("TESTNET_NETSIM", netsim_bin, 1);
  char owner[16];
  snprintf(owner, sizeof owner, "%d", (int)getpid());
  setenv("TESTNET_OWNER", owner, 1);
  if (testnet("gc")) fprintf(stderr, "testnet gc failed\n");
}

static void teardown(void) {
  proc_kill_all();
  if (net_up && testnet("down")) fprintf(stderr, "testnet down failed\n");
  net_up = false;
  cluster_fini(&C, false);
}
TestSuite(netfaults, .init = setup, .fini = teardown, .timeout = 400);


/* Makes K test hosts, or skips the test with testnet.sh's reason. */
static void hosts_up(int k) {
  if (!have_fmnist())
    cr_skip_test("Fashion-MNIST not installed at " RUMOR_FMNIST_DIR " (apt-get install dataset-fashion-mnist)");
  int rc = testnet("check");
  if (rc != 0) {
    char path[128];
    snprintf(path, sizeof path, "%s/testnet.err", C.dir);
    char *why = proc_slurp(path);
    why[strcspn(why, "\n")] = '\0';
    cr_skip_test("test hosts cannot be made here: %s", why);
  }
  if (testnet("up %d", k) != 0) {
    char path[128];
    snprintf(path, sizeof path, "%s/testnet.err", C.dir);
    cr_assert_fail("testnet up failed: %s", proc_slurp(path));
  }
  net_up = true;
}

/* Timing of membership: compressed like the other multi-process tests, or
 * rumor's defaults (1 s probes, 300 ms ping timeout, 5 s suspicion) where
 * round trips are long or packets are lost. */
enum timing { FAST, DEFAULT };

/* Starts `rumor <cmd>` on test host `h` as a new node (its own identity),
 * listening on the host's address. Returns the node index. */
static int spawn_on(int h, const char *cmd, enum timing tm, char *const *args) {
  int i = cluster_new_node(&C);
  struct cluster_node *nd = &C.node[i];
  char host[16], listen[40];
  snprintf(host, sizeof host, "%d", h);
  snprintf(listen, sizeof listen, "10.77.0.%d:0", h);
  char *argv[96];
  int n = 0;
  argv[n++] = testnet_sh;
  argv[n++] = "exec";
  argv[n++] = host;
  argv[n++] = RUMOR_TESTING_BIN; /* the testing build, as every fault test */
  argv[n++] = (char *)cmd;
  argv[n++] = "--listen";
  argv[n++] = listen;
  argv[n++] = "--cluster-key";
  argv[n++] = C.key;
  argv[n++] = "--identity";
  argv[n++] = nd->id_file;
  if (tm == FAST) {
    static char period[16], ping[16], suspect[16];
    snprintf(period, sizeof period, "%d", CLUSTER_PERIOD_MS);
    snprintf(ping, sizeof ping, "%d", CLUSTER_PING_TIMEOUT_MS);
    snprintf(suspect, sizeof suspect, "%d", CLUSTER_SUSPECT_MS);
    argv[n++] = "--period-ms";
    argv[n++] = period;
    argv[n++] = "--ping-timeout-ms";
    argv[n++] = ping;
    argv[n++] = "--suspect-ms";
    argv[n++] = suspect;
  }
  for (int k = 0; args && args[k] && n < 94; k++) argv[n++] = args[k];
  argv[n] = NULL;
  char what[64];
  snprintf(what, sizeof what, "%s on host %d", cmd, h);
  cluster_start_node(&C, i, argv, what);
  return i;
}

/* A bootstrap on host 1 and `n` peers on hosts 2..n+1, training until told
 * to stop (SIGTERM saves their checkpoint), checkpointing every 20 steps so
 * the drift can be measured while they run, gossiping every 4 steps or, with
 * `allreduce`, in an all-reduce ring. Waits until all train. */
/* A flag and its value every peer of the next start_cluster gets (NULL: none). */
static const char *peer_flag, *peer_flag_value;

static void start_cluster_sync(int n, enum timing tm, const char *model, bool allreduce, int *peer) {
  char *bargs[] = {NULL};
  int b = spawn_on(1, "bootstrap", tm, bargs);
  snprintf(C.boot, sizeof C.boot, "%s", C.node[b].addr);
  char wait[16], shard[16][24];
  snprintf(wait, sizeof wait, "%d", n);
  for (int i = 0; i < n; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/%d", i, n);
    char *args[] = {"--bootstrap", C.boot, "--threads", "1", "--log-every", "2", "--model", (char *)model,
                    "--shard", shard[i], "--epochs", "1000", "--batch", "64", "--lr", "0.05", "--no-eval",
                    "--wait-peers", wait, "--checkpoint", C.node[C.n].ckpt, "--checkpoint-every", "20",
                    allreduce ? "--sync" : "--gossip-every", allreduce ? "allreduce" : "4",
                    (char *)peer_flag, (char *)peer_flag_value, NULL};
    peer[i] = spawn_on(i + 2, "peer", tm, args);
  }
  for (int i = 0; i < n; i++)
    cr_assert(cluster_wait_file(C.node[peer[i]].log, "first step", 90), "peer %d did not start training: %s", i,
              proc_slurp(C.node[peer[i]].log));
}

static void start_cluster(int n, enum timing tm, const char *model, int *peer) {
  start_cluster_sync(n, tm, model, false, peer);
}

/* Reads a checkpoint's parameters (a new array) and its step. */
static float *load_params(const char *path, int64_t *n, int64_t *step) {
  struct checkpoint ck;
  struct rumor_err e;
  for (int tries = 0;; tries++) {
    if (checkpoint_open(path, &ck, &e) == 0) break;
    cr_assert_lt(tries, 50, "cannot read %s: %s", path, e.msg); /* not written yet */
    usleep(100000);
  }
  *step = ck.info.st.step;
  float *p = ckpt_params_copy(&ck, n);
  checkpoint_close(&ck);
  return p;
}

/* Relative drift Ξ/‖θ̄‖ over the peers' latest checkpoints; steps[] gets
 * each one's step. */
static double rel_drift(const int *peer, int n, int64_t *steps) {
  float *theta[16] = {NULL};
  int64_t P = 0;
  double norms[16];
  cr_assert(n >= 1 && n <= 16);
  for (int i = 0; i < n; i++) {
    theta[i] = load_params(C.node[peer[i]].ckpt, &P, &steps[i]);
    double s = 0;
    for (int64_t j = 0; j < P; j++) s += (double)theta[i][j] * theta[i][j];
    norms[i] = sqrt(s);
  }
  double xi = drift_exact((const float *const *)theta, (size_t)n, (uint64_t)P);
  double mean_norm = drift_mean_norm(norms, (size_t)n, xi);
  for (int i = 0; i < n; i++) free(theta[i]);
  return xi / mean_norm;
}

#define DRIFT_BOUND 0.05 /* Ξ/‖θ̄‖, as in the gossip tests */
#define CUT_S 30         /* how long the cut host stays cut off */
#define HEAL_S 45        /* the drift must be back under its bound this long after the heal */

/* Every peer of peer[0..n) has saved a checkpoint of step `min_step` or
 * later (they save every 20 steps), and their relative drift is under
 * DRIFT_BOUND: the run is under way and the replicas agree. */
struct converged {
  const int *peer;
  int n;
  int64_t min_step;
  double drift; /* out: the last one measured */
  int64_t steps[16];
};
static bool all_converged(void *arg) {
  struct converged *cv = arg;
  for (int i = 0; i < cv->n; i++) {
    struct checkpoint ck;
    struct rumor_err e;
    if (checkpoint_open(C.node[cv->peer[i]].ckpt, &ck, &e) != 0) return false;
    int64_t step = ck.info.st.step;
    checkpoint_close(&ck);
    if (step < cv->min_step) return false;
  }
  cv->drift = rel_drift(cv->peer, cv->n, cv->steps);
  return cv->drift < DRIFT_BOUND;
}

/* Sleeps until `t0` + `secs` (cluster_now's clock). */
static void sleep_until(double t0, double secs) {
  double left = t0 + secs - cluster_now();
  if (left > 0) usleep((useconds_t)(left * 1e6));
}

/* The log stamp (ms of day) of node i's first line at or after `since` with
 * both `a` and `b`, or -1. */
static long first_line_after(int i, long since, const char *a, const char *b) {
  char *s = proc_slurp(C.node[i].log);
  long at = -1;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
    long t = cluster_log_ms(line);
    if (t >= since && strstr(line, a) && (!b || strstr(line, b))) {
      at = t;
      break;
    }
  }
  free(s);
  return at;
}

/* Node i's first log line with `a` and `b` (a static buffer; "" when none):
 * what a failed assertion on count_lines shows. */
static const char *line_with(int i, const char *a, const char *b) {
  static char found[512];
  found[0] = '\0';
  char *s = proc_slurp(C.node[i].log);
  for (char *line = strtok(s, "\n"); line && !found[0]; line = strtok(NULL, "\n"))
    if (strstr(line, a) && (!b || strstr(line, b))) snprintf(found, sizeof found, "%s", line);
  free(s);
  return found;
}

static int count_lines(int i, const char *a, const char *b) {
  char *s = proc_slurp(C.node[i].log);
  int n = 0;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    if (strstr(line, a) && (!b || strstr(line, b))) n++;
  free(s);
  return n;
}

/* Lines of node i's log stamped at or after `since` with `a` and `b`. */
static int count_lines_after(int i, long since, const char *a, const char *b) {
  char *s = proc_slurp(C.node[i].log);
  int n = 0;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    if (cluster_log_ms(line) >= since && strstr(line, a) && (!b || strstr(line, b))) n++;
  free(s);
  return n;
}

/* Frames the switch dropped for loss (netsim's counters; 0 with netem). */
static long long frames_lost(void) {
  char path[256];
  snprintf(path, sizeof path, "/run/rumor-testnet/%s/stats", net_name);
  char *s = proc_slurp(path);
  long long lost = 0;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
    long long rx, tx, l;
    char port[32];
    if (sscanf(line, "%31s %lld %lld %lld", port, &rx, &tx, &l) == 4) lost += l;
  }
  free(s);
  return lost;
}

static void stop_all(const int *peer, int n) {
  for (int i = 0; i < n; i++) kill(C.node[peer[i]].pid, SIGTERM);
  for (int i = 0; i < n; i++) {
    int st = cluster_wait(&C, peer[i], 60);
    cr_assert(proc_exited_with(st, 0), "peer %d did not leave cleanly (status %d): %s", i, st,
              proc_slurp(C.node[peer[i]].log));
  }
}


/* After the heal of the cut: peer 0 took the cut-off peer (its "ADDR (" in
 * lone_pat) back as alive at or after heal_at (a log stamp), and then the
 * relative drift of peer[0..n) is under DRIFT_BOUND. */
struct healed {
  const int *peer;
  int n;
  const char *lone_pat;
  long heal_at;
  long back_at;  /* out: the log stamp of "is now alive", or -1 */
  double drift;  /* out: the last one measured */
  long under_at; /* out: when it was under its bound (ms of day), or -1 */
};
static bool all_healed(void *arg) {
  struct healed *h = arg;
  if (h->back_at < 0) h->back_at = first_line_after(h->peer[0], h->heal_at, h->lone_pat, "is now alive");
  if (h->back_at < 0) return false;
  int64_t st[16];
  h->drift = rel_drift(h->peer, h->n, st);
  if (h->drift >= DRIFT_BOUND) return false;
  h->under_at = cluster_wall_ms_of_day();
  return true;
}

Test(netfaults, a_host_cut_off_for_30s_keeps_training_and_drift_returns_under_its_bound_after_the_heal) {
  const int n = 4, cut = 4; /* peers on hosts 2..5; host 5 (peer 3) is cut off */
  hosts_up(n + 1);
  int peer[4];
  setenv("RUMOR_LOG_LEVEL", "info", 1);
  start_cluster(n, FAST, "mlp:784-64-10", peer);
  /* Training and exchanging under way, and the replicas close: every peer
   * saved step 100 or later, and the drift is under its bound. */
  struct converged cv = {peer, n, 100, NAN, {0}};
  cr_assert(cluster_poll(all_converged, &cv, 60), "the peers did not train together before the cut (drift %.4f)",
            cv.drift);
  int64_t s0[4], s1[4], s2[4];
  double before = cv.drift;
  memcpy(s0, cv.steps, sizeof s0);
  long cut_at = cluster_wall_ms_of_day();
  double cut_t0 = cluster_now();
  cr_assert_eq(testnet("cut %d", cut + 1), 0);
  fprintf(stderr, "figure: cut host %d off at steps %lld-%lld; relative drift before %.4f\n", cut + 1,
          (long long)s0[0], (long long)s0[n - 1], before);
  /* The cut lasts CUT_S (the fault itself, not a wait for something): long
   * past the suspicion time, so that the drift grows. That it hit the host
   * it names shows in both sides' verdicts, checked after the heal. */
  sleep_until(cut_t0, CUT_S);
  double during = rel_drift(peer, n, s1);
  long heal_at = cluster_wall_ms_of_day();
  cr_assert_eq(testnet("heal %d", cut + 1), 0);
  /* Both sides kept training through the cut. */
  for (int i = 0; i < n; i++)
    cr_assert_gt(s1[i], s0[i] + 100, "peer %d did not train while host %d was cut off (step %lld -> %lld)", i, cut + 1,
                 (long long)s0[i], (long long)s1[i]);
  /* Each side declared the other failed: the cut was longer than the
   * suspicion time. */
  const char *lone = C.node[peer[cut - 1]].addr;
  char lone_pat[80];
  snprintf(lone_pat, sizeof lone_pat, "%s (", lone);
  for (int i = 0; i < n - 1; i++) {
    long t = first_line_after(peer[i], cut_at, lone_pat, "is now failed");
    cr_assert_geq(t, 0, "peer %d never declared the cut-off peer failed", i);
    fprintf(stderr, "figure: peer %d declared the cut-off peer failed %ld ms after the cut\n", i, t - cut_at);
  }
  cr_assert_gt(count_lines(peer[cut - 1], "is now failed", NULL), 0, "the cut-off peer never noticed the cut");

  /* After the heal: everyone alive again, and the drift back under its
   * bound, within a few seconds. A request queued for a member while its
   * dial failed or waited out its backoff used to be lost unheard, and
   * the exchange held to its 60 s timeout with the drift up (issue #30):
   * HEAL_S, under that timeout, catches it when it happens, with a margin
   * for a loaded machine (0.6–3.4 s in four runs). */
  struct healed hd = {peer, n, lone_pat, heal_at, -1, NAN, -1};
  (void)cluster_poll(all_healed, &hd, HEAL_S);
  double after = hd.drift;
  long back_at = hd.back_at, under_at = hd.under_at;
  fprintf(stderr, "figure: relative drift before the cut %.4f, at the end of the 30 s cut %.4f, after the heal %.4f\n",
          before, during, after);
  cr_assert_geq(back_at, 0, "the cut-off peer never came back in peer 0's view after the heal");
  fprintf(stderr, "figure: the cut-off peer was alive again in peer 0's view %ld ms after the heal\n",
          back_at - heal_at);
  cr_assert_geq(under_at, 0, "the drift stayed at %.4f, above its bound %.2f, %d s after the heal", after,
                DRIFT_BOUND, HEAL_S);
  /* Alone, it saw no majority: its verdicts stayed its own, and the first
   * member it heard from after the heal gave it its table (gossip/swim.c,
   * "minority"; runtime.c, ask_table_after_cut). */
  cr_assert_gt(count_lines(peer[cut - 1], "are told to no one", NULL), 0,
               "the cut-off peer's suspicions were told to the others: %s", proc_slurp(C.node[peer[cut - 1]].log));
  cr_assert_gt(count_lines(peer[cut - 1], "back from a cut: the member table of", NULL), 0,
               "the cut-off peer took no member's table after the heal: %s", proc_slurp(C.node[peer[cut - 1]].log));
  for (int i = 0; i < n - 1; i++)
    cr_assert_eq(count_lines_after(peer[i], cut_at, "is now failed", NULL),
                 count_lines_after(peer[i], cut_at, "is now failed", lone_pat),
                 "peer %d took a member other than the cut-off one for failed: %s", i, proc_slurp(C.node[peer[i]].log));
  fprintf(stderr, "figure: the drift was back under %.2f %ld ms after the heal\n", DRIFT_BOUND, under_at - heal_at);
  stop_all(peer, n);
  double final = rel_drift(peer, n, s2);
  fprintf(stderr, "figure: final relative drift %.4f\n", final);
  /* The drift sampled once, when the peers stop, moves about its steady
   * state, which on a loaded machine sits near the bound (0.048 before the
   * cut and 0.0516 at the end in one CI run, the drift under the bound
   * 856 ms after the heal): the end is held to the bound or to 1.5 times
   * the drift before the cut, whichever is larger. A peer left out of the
   * mixing ends near the cut's drift (0.5 and more). */
  double end_bound = fmax(DRIFT_BOUND, 1.5 * before);
  cr_assert_lt(final, end_bound, "final relative drift %.4f above %.4f (before the cut %.4f)", final, end_bound,
               before);
}

/* "exchange transferred after N ms" debug lines of node i: how many, and
 * their median duration. */
static int exchange_times(int i, double *median_ms) {
  char *s = proc_slurp(C.node[i].log);
  static double ms[100000];
  int n = 0;
  for (char *line = strtok(s, "\n"); line && n < 100000; line = strtok(NULL, "\n")) {
    const char *p = strstr(line, "exchange transferred after ");
    if (p) ms[n++] = strtod(p + STR_LEN("exchange transferred after "), NULL);
  }
  free(s);
  for (int a = 1; a < n; a++) /* insertion sort: n is small */
    for (int b = a; b > 0 && ms[b - 1] > ms[b]; b--) {
      double t = ms[b];
      ms[b] = ms[b - 1];
      ms[b - 1] = t;
    }
  *median_ms = n ? ms[n / 2] : NAN;
  return n;
}

#define SLOW_SPAN_S 24 /* how long the cluster runs on slow links */

/* Every peer of peer[0..n) saved a checkpoint more than 100 steps past
 * its step in s0[], completed `exchanges` exchanges and logged two epochs
 * or more, the last with a lower training loss than the first. */
struct trained {
  const int *peer;
  int n;
  const int64_t *s0;
  int exchanges;
};
static bool all_trained(void *arg) {
  const struct trained *t = arg;
  for (int i = 0; i < t->n; i++) {
    struct checkpoint ck;
    struct rumor_err e;
    if (checkpoint_open(C.node[t->peer[i]].ckpt, &ck, &e) != 0) return false;
    int64_t step = ck.info.st.step;
    checkpoint_close(&ck);
    double med, losses[4096];
    int ne = cluster_epoch_losses(&C, t->peer[i], losses, 4096);
    if (step <= t->s0[i] + 100 || exchange_times(t->peer[i], &med) < t->exchanges || ne < 2 ||
        losses[ne - 1] >= losses[0])
      return false;
  }
  return true;
}

Test(netfaults, at_100ms_round_trips_and_100mbit_links_exchanges_complete_and_training_proceeds) {
  const int n = 4;
  hosts_up(n + 1);
  /* 50 ms on what each host sends: 100 ms round trips between any two. */
  cr_assert_eq(testnet("shape all delay 50 rate 100"), 0);
  setenv("RUMOR_LOG_LEVEL", "debug", 1);
  int peer[4];
  /* A verdict after three of this path's retransmission timeouts and its
   * queue (docs/net.md): 1 s cut a live partner's exchange once in two
   * CI runs, its PINGs behind 0.8 MB transfers at 100 Mbit/s. */
  peer_flag = "--dead-after-ms", peer_flag_value = "3000";
  start_cluster(n, DEFAULT, "mlp:784-256-10", peer); /* 0.8 MB of parameters each way */
  peer_flag = peer_flag_value = NULL;
  int64_t s0[4], s1[4];
  double d0 = rel_drift(peer, n, s0), t0 = cluster_now();
  /* The cluster runs SLOW_SPAN_S on the slow links (the fault itself: long
   * past the 5 s suspicion time, so a false failure verdict would show);
   * then, checked rather than timed, every peer has trained 100 steps more,
   * completed 10 exchanges and seen its training loss fall (a loaded
   * machine may take longer; a quiet one does it in about 5 s). */
  sleep_until(t0, SLOW_SPAN_S);
  struct trained tr = {peer, n, s0, 10};
  (void)cluster_poll(all_trained, &tr, 60);
  double d1 = rel_drift(peer, n, s1), secs = cluster_now() - t0;
  stop_all(peer, n);
  fprintf(stderr, "figure: 100 ms RTT, 100 Mbit/s: relative drift %.4f -> %.4f over %.0f s\n", d0, d1, secs);
  for (int i = 0; i < n; i++) {
    double med;
    int x = exchange_times(peer[i], &med);
    int abandoned = count_lines(peer[i], "abandoned", NULL);
    int timed_out = count_lines(peer[i], "abandoned", "timed out");
    fprintf(stderr, "figure: 100 ms RTT, 100 Mbit/s: peer %d: %lld steps, %d exchanges (median %.0f ms), %d abandoned\n",
            i, (long long)(s1[i] - s0[i]), x, med, abandoned);
    double losses[4096];
    int ne = cluster_epoch_losses(&C, peer[i], losses, 4096);
    cr_assert_gt(s1[i], s0[i] + 100, "peer %d hardly trained", i);
    cr_assert(ne >= 2 && losses[ne - 1] < losses[0], "peer %d's training loss did not fall", i);
    cr_assert_geq(x, 10, "peer %d completed only %d exchanges in %.0f s", i, x, secs);
    /* The links really were slow: no exchange of 0.8 MB each way beats a
     * 100 ms round trip at 100 Mbit/s. */
    cr_assert_geq(med, 100, "peer %d's exchanges took %.0f ms: the links were not shaped", i, med);
    cr_assert_eq(timed_out, 0, "peer %d had exchanges time out (%d; the first: %s)", i, timed_out,
                 line_with(peer[i], "abandoned", "timed out"));
    cr_assert_eq(count_lines(peer[i], "is now failed", NULL), 0, "peer %d declared a live member failed", i);
  }
}

#define LOSS_SPAN_S 24 /* how long the cluster runs on lossy links (the fault itself) */
#define LOSS_GAP_S 10  /* the longest a peer may go without completing an exchange */

/* Exchange progress of peer[0..n) on lossy links: each peer's completed
 * exchanges ("exchange transferred" debug lines), when that count last grew
 * (cluster_now), and the longest each went without it growing. A peer
 * runs one exchange at a time, so a stuck one (held until the 60 s
 * exchange timeout) shows as a gap: neither side completes any other
 * exchange meanwhile. */
struct progress {
  const int *peer;
  int n;
  int done[4];
  double last[4];
  double gap[4]; /* s: the longest without one, so far */
  int worst;     /* the peer with the longest gap */
};

static void progress_start(struct progress *p, const int *peer, int n) {
  cr_assert(n >= 1 && n <= 4);
  *p = (struct progress){.peer = peer, .n = n};
  double now = cluster_now();
  for (int i = 0; i < n; i++) {
    p->done[i] = count_lines(peer[i], "exchange transferred", NULL);
    p->last[i] = now;
  }
}

/* Takes a new look at the logs; returns false once a peer's gap exceeds
 * LOSS_GAP_S. */
static bool progress_update(struct progress *p) {
  double now = cluster_now();
  for (int i = 0; i < p->n; i++) {
    int x = count_lines(p->peer[i], "exchange transferred", NULL);
    if (x > p->done[i]) p->done[i] = x, p->last[i] = now;
    if (now - p->last[i] > p->gap[i]) p->gap[i] = now - p->last[i];
    if (p->gap[i] > p->gap[p->worst]) p->worst = i;
  }
  return p->gap[p->worst] <= LOSS_GAP_S;
}

/* Node i's log lines that tell how its exchanges ended short of
 * completion, and why: abandoned exchanges, heartbeat verdicts, SWIM
 * suspicions and failures (a new string). */
static char *exchange_ends(int i) {
  static const char *const pats[] = {"abandoned", "heartbeat verdict", "is now suspect", "is now failed",
                                     "suspected at once"};
  char *s = proc_slurp(C.node[i].log), *out = xcalloc(1, 1);
  size_t len = 0;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    for (size_t k = 0; k < sizeof pats / sizeof pats[0]; k++)
      if (strstr(line, pats[k])) {
        size_t l = strlen(line);
        out = xrealloc(out, len + l + 2);
        memcpy(out + len, line, l);
        len += l;
        out[len++] = '\n';
        out[len] = '\0';
        break;
      }
  free(s);
  return out;
}

/* Every peer completed an exchange after `since` (a cluster_now time). */
struct progress_after {
  struct progress *p;
  double since;
};
static bool all_progressed_after(void *arg) {
  struct progress_after *a = arg;
  (void)progress_update(a->p);
  for (int i = 0; i < a->p->n; i++)
    if (a->p->last[i] <= a->since) return false;
  return true;
}

/* "No exchange is stuck": every exchange ends, completed or abandoned,
 * within its bound, so every peer keeps completing exchanges: none goes
 * LOSS_GAP_S without one, during LOSS_SPAN_S of 1 % frame loss and until
 * each has completed one more after it (so an exchange stuck at the end is
 * caught too), and no exchange is abandoned at the exchange timeout.
 * "No live member is declared failed": no SWIM failure verdict.
 *
 * Not claimed: that no connection is ever judged dead by the heartbeat (1 s
 * of silence, docs/net.md). TCP recovers a lost frame (here a whole GSO
 * frame of up to 64 KiB) by retransmission, after up to its retransmission
 * timeout, which follows the measured round trip: on a loaded 2-core
 * machine, where the user-space switch (netsim) waits for a CPU, round
 * trips reach hundreds of ms and that timeout 1 to 3 s. A verdict then
 * abandons the exchange on that connection ("... failed: timed out"), SWIM
 * suspects the member and it refutes: the exchange is not stuck and the
 * member is not declared failed, so such verdicts are counted as figures. */
Test(netfaults, at_1pct_loss_no_exchange_is_stuck_and_no_live_member_is_declared_failed) {
  const int n = 4;
  hosts_up(n + 1);
  cr_assert_eq(testnet("shape all loss 1"), 0);
  setenv("RUMOR_LOG_LEVEL", "debug", 1);
  int peer[4];
  start_cluster(n, DEFAULT, "mlp:784-64-10", peer);
  struct progress pr;
  progress_start(&pr, peer, n);
  double t0 = cluster_now();
  bool moving = true;
  while (moving && cluster_now() - t0 < LOSS_SPAN_S) {
    usleep(200000);
    moving = progress_update(&pr);
  }
  cr_assert(moving, "peer %d completed no exchange for %.1f s (a stuck exchange?):\n%s", pr.worst,
            pr.gap[pr.worst], exchange_ends(peer[pr.worst]));
  struct progress_after pa = {&pr, cluster_now()};
  bool again = cluster_poll(all_progressed_after, &pa, LOSS_GAP_S);
  double span = cluster_now() - t0;
  stop_all(peer, n);
  long long lost = frames_lost();
  fprintf(stderr, "figure: 1%% loss: the switch dropped %lld frames\n", lost);
  char b[256];
  snprintf(b, sizeof b, "/run/rumor-testnet/%s/backend", net_name);
  char *backend = proc_slurp(b);
  if (STR_PREFIX(backend, "netsim")) cr_assert_gt(lost, 0, "no frame was lost: the links were not shaped");
  free(backend);
  for (int i = 0; i < n; i++) {
    double med;
    int x = exchange_times(peer[i], &med);
    fprintf(stderr,
            "figure: 1%% loss: peer %d: %d exchanges in %.0f s (median %.1f ms, longest gap %.1f s), %d suspicions, "
            "%d abandoned (%d at the timeout), %d connections judged dead by the heartbeat\n",
            i, x, span, med, pr.gap[i], count_lines(peer[i], "is now suspect", NULL),
            count_lines(peer[i], "abandoned", NULL), count_lines(peer[i], "abandoned", "timed out after"),
            count_lines(peer[i], "heartbeat verdict", NULL));
  }
  for (int i = 0; i < n; i++) {
    cr_assert(again || pr.last[i] > pa.since,
              "peer %d completed no exchange in the %d s after the lossy span (a stuck exchange?):\n%s", i, LOSS_GAP_S,
              exchange_ends(peer[i]));
    cr_assert_eq(count_lines(peer[i], "abandoned", "timed out after"), 0,
                 "peer %d held an exchange until the exchange timeout:\n%s", i, exchange_ends(peer[i]));
    cr_assert_eq(count_lines(peer[i], "is now failed", NULL), 0, "peer %d declared a live member failed:\n%s", i,
                 exchange_ends(peer[i]));
  }
}

/* "member ADDR (KEY) joined: peer alive (incarnation N)" and "member ADDR
 * (KEY) is now alive (was failed, incarnation N)": the incarnation. */
static unsigned long long incarnation_in(int i, const char *addr_pat, const char *what) {
  char *s = proc_slurp(C.node[i].log);
  unsigned long long inc = 0;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    if (strstr(line, addr_pat) && strstr(line, what)) {
      const char *p = strstr(line, "incarnation ");
      if (p) inc = strtoull(p + STR_LEN("incarnation "), NULL, 10);
    }
  free(s);
  return inc;
}

/* The roles of peer[0..n), judged by the exchanges each transferred (debug
 * lines "exchange transferred after N ms (we asked)" or "(we were asked...)")
 * since the log stamp `since`: an initiator and a responder, once every peer
 * transferred a few. */
struct roles {
  const int *peer;
  int n;
  long since;
  int victim[2]; /* out: an initiator, a responder */
};
static bool roles_known(void *arg) {
  struct roles *r = arg;
  r->victim[0] = r->victim[1] = -1;
  for (int i = 0; i < r->n; i++) {
    if (count_lines_after(r->peer[i], r->since, "exchange transferred", NULL) < 3) return false;
    int role = count_lines_after(r->peer[i], r->since, "exchange transferred", "(we asked)") > 0 ? 0 : 1;
    if (r->victim[role] < 0) r->victim[role] = i;
  }
  return r->victim[0] >= 0 && r->victim[1] >= 0;
}

static bool is_stopped_cond(void *arg) { return cluster_stopped(&C, *(int *)arg); }

/* Every peer of peer[0..n) but the victims logged `what` ("is now failed")
 * about both victims (their "ADDR (" in pat) at or after `since`. */
struct verdicts {
  const int *peer;
  int n;
  const int *victim;
  char (*pat)[80];
  long since;
  const char *what;
};
static bool all_declared(void *arg) {
  const struct verdicts *d = arg;
  for (int i = 0; i < d->n; i++) {
    if (i == d->victim[0] || i == d->victim[1]) continue;
    for (int v = 0; v < 2; v++)
      if (first_line_after(d->peer[i], d->since, d->pat[v], d->what) < 0) return false;
  }
  return true;
}

/* Node `node` completed more than `before` exchanges (`now`: how many). */
struct exchanged {
  int node, before, now;
};
static bool exchanged_more(void *arg) {
  struct exchanged *x = arg;
  double med;
  x->now = exchange_times(x->node, &med);
  return x->now > x->before;
}

/* Peers take roles by key (gossip_impl.h): active ones ask for exchanges,
 * passive ones answer. One of each is stopped at once: a paused initiator
 * whose request died with a connection must not sit out the exchange
 * timeout, and a paused responder must be asked again. */
Test(netfaults, stopped_peers_past_the_suspicion_time_are_removed_and_rejoin_with_a_higher_incarnation) {
  const int n = 4;
  hosts_up(n + 1);
  setenv("RUMOR_LOG_LEVEL", "debug", 1);
  int peer[4];
  start_cluster(n, FAST, "mlp:784-64-10", peer);
  /* Roles shift while peers join: judge them once all train (the last
   * "first step"), by exchanges transferred since, which every peer must
   * have done a few times. */
  struct roles r = {peer, n, -1, {-1, -1}};
  for (int i = 0; i < n; i++) {
    long t = cluster_log_first(&C, peer[i], "first step", NULL);
    if (t > r.since) r.since = t;
  }
  cr_assert(cluster_poll(roles_known, &r, 30), "expected initiating and answering peers, each exchanging; got %d and %d",
            r.victim[0], r.victim[1]);
  int victim[2] = {r.victim[0], r.victim[1]}; /* an initiator, a responder */
  int watcher = 0;
  while (watcher == victim[0] || watcher == victim[1]) watcher++;
  char pat[2][80];
  unsigned long long joined[2];
  for (int v = 0; v < 2; v++) {
    snprintf(pat[v], sizeof pat[v], "%s (", C.node[peer[victim[v]]].addr);
    joined[v] = incarnation_in(peer[watcher], pat[v], "joined: peer alive");
    cr_assert_gt(joined[v], 0, "peer %d never logged peer %d joining", watcher, victim[v]);
  }
  long stop_at = cluster_wall_ms_of_day();
  for (int v = 0; v < 2; v++) {
    cr_assert(cluster_alive(&C, peer[victim[v]]), "peer %d ended before the SIGSTOP: %s", victim[v],
              proc_slurp(C.node[peer[victim[v]]].log));
    kill(C.node[peer[victim[v]]].pid, SIGSTOP);
  }
  for (int v = 0; v < 2; v++)
    cr_assert(cluster_poll(is_stopped_cond, &peer[victim[v]], 10), "SIGSTOP did not stop peer %d", victim[v]);
  /* Wait for every verdict (the suspicion time is 1 s). */
  struct verdicts vd = {peer, n, victim, pat, stop_at, "is now failed"};
  cr_assert(cluster_poll(all_declared, &vd, 30), "not every peer declared both stopped peers failed");
  for (int i = 0; i < n; i++) {
    if (i == victim[0] || i == victim[1]) continue;
    for (int v = 0; v < 2; v++) {
      long t = first_line_after(peer[i], stop_at, pat[v], "is now failed");
      cr_assert_geq(t, 0, "peer %d did not declare stopped peer %d failed", i, victim[v]);
      fprintf(stderr, "figure: peer %d declared the stopped %s failed %ld ms after SIGSTOP\n", i,
              v ? "responder" : "initiator", t - stop_at);
    }
  }
  long cont_at = cluster_wall_ms_of_day();
  int before[2];
  for (int v = 0; v < 2; v++) {
    double med;
    before[v] = exchange_times(peer[victim[v]], &med);
    kill(C.node[peer[victim[v]]].pid, SIGCONT);
  }
  struct verdicts back = {peer, n, victim, pat, cont_at, "is now alive"};
  cr_assert(cluster_poll(all_declared, &back, 30), "not every peer took both resumed peers back");
  for (int i = 0; i < n; i++)
    for (int v = 0; v < 2; v++) {
      if (i == victim[0] || i == victim[1]) continue;
      long t = first_line_after(peer[i], cont_at, pat[v], "is now alive");
      cr_assert_geq(t, 0, "peer %d did not take resumed peer %d back", i, victim[v]);
      /* The last "alive" news of it: from failed, or from a suspicion of
       * the resumed peer with its new incarnation that reached us first. */
      unsigned long long inc = incarnation_in(peer[i], pat[v], "is now alive (was ");
      fprintf(stderr, "figure: peer %d took the resumed %s back %ld ms after SIGCONT, incarnation %llu -> %llu\n", i,
              v ? "responder" : "initiator", t - cont_at, joined[v], inc);
      cr_assert_gt(inc, joined[v], "peer %d: rejoined peer %d's incarnation %llu is not above %llu", i, victim[v], inc,
                   joined[v]);
    }
  /* Back in the exchanges: each completes some within 12 s of resuming (a
   * loaded machine slows everything down; the exchange timeout is 60 s). */
  for (int v = 0; v < 2; v++) {
    struct exchanged ex = {peer[victim[v]], before[v], before[v]};
    (void)cluster_poll(exchanged_more, &ex, 12);
    int after = ex.now;
    long done_at = first_line_after(peer[victim[v]], cont_at, "exchange transferred", NULL);
    fprintf(stderr, "figure: the resumed %s completed %d exchanges; the first %ld ms after SIGCONT\n",
            v ? "responder" : "initiator", after - before[v], done_at - cont_at);
    cr_assert_gt(after, before[v], "the resumed %s (peer %d) completed no exchange in the 12 s after SIGCONT",
                 v ? "responder" : "initiator", victim[v]);
  }
  stop_all(peer, n);
}

/* Two DiLoCo members on hosts 2 and 3 behind slow links (50 ms each way,
 * 4 Mbit/s: a round's 0.4 MB takes most of a second); each step takes 20
 * times its compute, so a round's 300 steps take longer than its
 * transfer. Returns the first member's result figure `key` and sets
 * *rounds. */
static double diloco_on_slow_links(const char *overlap, const char *key, double *rounds) {
  char *bargs[] = {NULL};
  int b = spawn_on(1, "bootstrap", DEFAULT, bargs);
  snprintf(C.boot, sizeof C.boot, "%s", C.node[b].addr);
  int peer[2];
  char shard[2][8];
  for (int i = 0; i < 2; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/2", i);
    char *args[] = {"--bootstrap", C.boot, "--threads", "1", "--model", "mlp:784-128-10", "--shard", shard[i],
                    "--max-steps", "1200", "--batch", "32", "--lr", "0.05", "--no-eval", "--wait-peers", "2",
                    "--sync", "allreduce", "--outer", "nesterov", "--local-steps", "300", "--slowdown", "20",
                    (char *)overlap, NULL};
    peer[i] = spawn_on(i + 2, "peer", DEFAULT, args);
  }
  for (int i = 0; i < 2; i++) {
    int st = cluster_wait(&C, peer[i], 240);
    cr_assert(proc_exited_with(st, 0), "member %d did not finish (status %d): %s", i, st,
              proc_slurp(C.node[peer[i]].log));
  }
  kill(C.node[b].pid, SIGTERM);
  cluster_wait(&C, b, 10);
  *rounds = cluster_result(&C, peer[0], "outer_rounds");
  return cluster_result(&C, peer[0], key);
}

/* --outer-overlap: a round's communication runs beside the next round's
 * steps, so training waits for the network only at the last round (which
 * ends the run in step), where without it every round's transfer is
 * waited for. */
Test(netfaults, with_outer_overlap_a_slow_link_does_not_stall_the_inner_steps) {
  hosts_up(3);
  cr_assert_eq(testnet("shape all delay 50 rate 4"), 0);
  double r0, r1;
  double waited = diloco_on_slow_links(NULL, "outer_wait_s", &r0);
  double overlapped = diloco_on_slow_links("--outer-overlap", "outer_wait_s", &r1);
  fprintf(stderr, "figure: DiLoCo on 4 Mbit/s, 100 ms RTT links, 4 rounds of 300 steps: training waited %.2f s for "
          "the network, %.2f s with --outer-overlap\n", waited, overlapped);
  cr_assert_eq(r0, 4);
  cr_assert_eq(r1, 4);
  /* 0.4 MB at 4 Mbit/s is 0.8 s a round: the links were slow. */
  cr_assert_geq(waited, 4 * 0.5, "without overlap training waited only %.2f s: the links were not shaped", waited);
  /* Overlap hides the transfers of the rounds before the last: at least one
   * round's worth (0.8 s) less waiting, however loaded the machine (a
   * ratio would be a timing: a loaded run gave 3.08 s against 5.93 s). */
  cr_assert_lt(overlapped + 0.8, waited, "with --outer-overlap training still waited %.2f s (%.2f s without)",
               overlapped, waited);
}

/* An all-reduce member cut off from the two others (issue #30's chaos: a
 * peer cut off for 10 s took 4,850 steps alone, in rings of one, and the
 * seven others dropped their own state for its after the heal). It waits
 * for a majority of its last ring instead (--quorum-wait-ms, 30 s by
 * default, past the cut), completes no round alone, and after the heal
 * takes the state of the two, who took none; all three end equal. */
#define QUORUM_CUT_S 8

/* Node i's key as its log names it ("listening on ADDR as KEY... (peer)"):
 * a static buffer. */
static const char *node_key(int i) {
  static char key[64];
  key[0] = '\0';
  char *s = proc_slurp(C.node[i].log);
  for (char *line = strtok(s, "\n"); line && !key[0]; line = strtok(NULL, "\n")) {
    const char *p = strstr(line, "listening on ");
    p = p && strstr(line, "(peer)") ? strstr(p, " as ") : NULL;
    if (p) snprintf(key, sizeof key, "%.*s", (int)strcspn(p + 4, ". "), p + 4);
  }
  free(s);
  cr_assert(strlen(key) >= 8, "no key in node %d's log", i);
  return key;
}

/* Node i logged a line with `a` and `b` at or after `since`. */
struct line_after {
  int i;
  long since;
  const char *a, *b;
};
static bool has_line_after(void *arg) {
  const struct line_after *l = arg;
  return first_line_after(l->i, l->since, l->a, l->b) >= 0;
}

Test(netfaults, an_allreduce_member_cut_off_waits_for_a_quorum_and_then_takes_the_majoritys_state) {
  const int n = 3, cut = 3; /* host 4: peer 2 */
  hosts_up(n + 1);
  int peer[3];
  setenv("RUMOR_LOG_LEVEL", "info", 1);
  start_cluster_sync(n, FAST, "mlp:784-64-10", true, peer);
  struct converged cv = {peer, n, 40, NAN, {0}};
  cr_assert(cluster_poll(all_converged, &cv, 60), "the members did not train together before the cut");
  const int lone = peer[cut - 1];
  long cut_at = cluster_wall_ms_of_day();
  double cut_t0 = cluster_now();
  cr_assert_eq(testnet("cut %d", cut + 1), 0);
  /* The fault hit it: it sees one of the three members of its last round. */
  cr_assert(cluster_wait_file(C.node[lone].log, "members of our last round in view (cut off?)", QUORUM_CUT_S),
            "the cut-off member did not wait for a quorum: %s", proc_slurp(C.node[lone].log));
  sleep_until(cut_t0, QUORUM_CUT_S);
  int64_t P, lone_step, major_step;
  free(load_params(C.node[lone].ckpt, &P, &lone_step));
  free(load_params(C.node[peer[0]].ckpt, &P, &major_step));
  long heal_at = cluster_wall_ms_of_day();
  cr_assert_eq(testnet("heal %d", cut + 1), 0);
  fprintf(stderr, "figure: after a %d s cut the lone member saved step %lld, the two others step %lld\n", QUORUM_CUT_S,
          (long long)lone_step, (long long)major_step);
  struct line_after took = {lone, heal_at, "all-reduce: the cluster is at step", "taking the state of"};
  cr_assert(cluster_poll(has_line_after, &took, 45),
            "the cut-off member did not take the majority's state after the heal: %s", proc_slurp(C.node[lone].log));
  /* And trains on with them: rounds of more than one member (below). */
  struct converged on = {&lone, 1, major_step + 100, NAN, {0}};
  cr_assert(cluster_poll(all_converged, &on, 30), "the cut-off member did not train on after catching up: %s",
            proc_slurp(C.node[lone].log));
  stop_all(peer, n);
  cr_assert_eq(count_lines_after(lone, cut_at, "done over 1 members", NULL), 0,
               "the cut-off member completed rounds alone: %s", proc_slurp(C.node[lone].log));
  /* The two may take each other's state (a step apart when a round fails
   * as the cut heals), never the cut-off member's. */
  char lone_key[80], named[16];
  snprintf(lone_key, sizeof lone_key, "taking the state of %.8s", node_key(lone));
  snprintf(named, sizeof named, "(%.8s)", node_key(lone));
  cr_assert_gt(count_lines(peer[0], named, NULL), 0, "the key read (%s) is not the one the others log", named);
  for (int i = 0; i < n - 1; i++)
    cr_assert_eq(count_lines_after(peer[i], cut_at, lone_key, NULL), 0,
                 "member %d took the cut-off member's state: %s", i, proc_slurp(C.node[peer[i]].log));
  cr_assert_gt(major_step, lone_step, "the two others did not train on through the cut");
}

/* An all-reduce member whose link loses packets (issue #30's chaos: while
 * one member of eight had 5 % loss, every round went at 45 % of its speed,
 * the rings' pace being their slowest link's). Its kernel retransmits what
 * it sends to the next member: it leaves the ring for 10 s
 * (--sit-out-loss, 2 % by default), the three others go on without it,
 * and once back it takes their state and the ring re-forms with four.
 * Nobody else leaves: its predecessor sees its ACKs lost, not its data. */
#define SIT_OUT_LOSS_PCT 5

Test(netfaults, an_allreduce_member_whose_link_loses_packets_leaves_the_ring_for_a_while_and_comes_back) {
  const int n = 4, lossy = 4; /* host 5: peer 3 */
  hosts_up(n + 1);
  int peer[4];
  setenv("RUMOR_LOG_LEVEL", "info", 1);
  start_cluster_sync(n, DEFAULT, "mlp:784-64-10", true, peer);
  struct converged cv = {peer, n, 40, NAN, {0}};
  cr_assert(cluster_poll(all_converged, &cv, 60), "the members did not train together before the loss");
  const int bad = peer[lossy - 1];
  long loss_at = cluster_wall_ms_of_day();
  long long lost0 = frames_lost();
  cr_assert_eq(testnet("shape %d loss %d", lossy + 1, SIT_OUT_LOSS_PCT), 0);
  struct line_after left = {bad, loss_at, "all-reduce: our link to the next member", "leaving the ring for 10 s"};
  cr_assert(cluster_poll(has_line_after, &left, 20), "the lossy member did not leave the ring: %s",
            proc_slurp(C.node[bad].log));
  long left_at = first_line_after(bad, loss_at, left.a, left.b);
  /* The fault hit it: the switch dropped frames, and its kernel retransmitted. */
  cr_assert_gt(frames_lost() - lost0, 0, "the switch dropped no frame");
  cr_assert_eq(testnet("shape %d", lossy + 1), 0);
  /* The others go on without it, ... */
  for (int i = 0; i < n - 1; i++) {
    struct line_after three = {peer[i], left_at, "done over 3 members", NULL};
    cr_assert(cluster_poll(has_line_after, &three, 10), "member %d did not go on without the lossy one: %s", i,
              proc_slurp(C.node[peer[i]].log));
  }
  /* ... and it comes back after 10 s, takes their state and rings of four
   * run again. */
  struct line_after back = {bad, left_at, "all-reduce: back in the ring after", NULL};
  cr_assert(cluster_poll(has_line_after, &back, 20), "the lossy member did not come back: %s",
            proc_slurp(C.node[bad].log));
  long back_at = first_line_after(bad, left_at, back.a, NULL);
  cr_assert_geq(back_at - left_at, 9500, "it came back after %ld ms, not 10 s", back_at - left_at);
  struct line_after took = {bad, back_at, "all-reduce: the cluster is at step", "taking the state of"};
  cr_assert(cluster_poll(has_line_after, &took, 20), "the member back did not take the cluster's state: %s",
            proc_slurp(C.node[bad].log));
  struct line_after four = {peer[0], back_at, "done over 4 members", NULL};
  cr_assert(cluster_poll(has_line_after, &four, 20), "the ring did not re-form with four: %s",
            proc_slurp(C.node[peer[0]].log));
  stop_all(peer, n);
  for (int i = 0; i < n - 1; i++)
    cr_assert_eq(count_lines(peer[i], "leaving the ring for", NULL), 0,
                 "member %d, whose link lost nothing, left the ring: %s", i, proc_slurp(C.node[peer[i]].log));
  fprintf(stderr, "figure: at %d %% loss the member left the ring %.1f s after the loss began, came back %.1f s "
          "later\n", SIT_OUT_LOSS_PCT, (double)(left_at - loss_at) / 1000, (double)(back_at - left_at) / 1000);
}
