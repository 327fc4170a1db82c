/* `rumor top` and the metrics endpoint against a real 3-peer cluster on
 * 127.0.0.1: every member listed with every field, the sketch estimate of
 * the consensus distance within 10 % of the exact one, a killed peer shown
 * as unreachable, Prometheus text that promtool accepts, CSV and chart
 * files; and clear errors for bad flags and dead addresses. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "../support/cluster.h"
#include "../support/http.h"
#include "util/util.h"
#include "../support/fmnist.h"

static struct cluster C;
static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(top, .init = setup, .fini = teardown, .timeout = 240);


/* The metrics port node i announced on stdout. */
static int metrics_port(int i) {
  char *out = proc_slurp(C.node[i].out);
  const char *p = strstr(out, "\"metrics_port\":");
  int port = p ? atoi(p + 15) : 0;
  free(out);
  return port;
}

/* `rumor top ARGS... NULL` with the cluster's keys; returns the wait status. */
static int run_top(char **out, char **err, ...) {
  char id[300];
  snprintf(id, sizeof id, "%s/top.key", C.dir);
  if (access(id, F_OK) != 0) cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, id);
  char *argv[40] = {RUMOR_BIN, "top", "--bootstrap", C.boot, "--cluster-key", C.key, "--identity", id};
  int n = 8;
  va_list ap;
  va_start(ap, err);
  for (char *a; n < 39 && (a = va_arg(ap, char *)) != NULL;) argv[n++] = a;
  va_end(ap);
  argv[n] = NULL;
  return proc_run(argv, 60, C.dir, out, err);
}

/* The value after "key": in s (a number), or NAN for null or absent. */
static double num_after(const char *s, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(s, pat);
  if (!p || strncmp(p + strlen(pat), "null", 4) == 0) return NAN;
  return strtod(p + strlen(pat), NULL);
}

/* The node objects of a snapshot: pointers to each {"id": ... up to the
 * next one (the strings are cut in place). */
static int split_nodes(char *json, char **nodes, int max) {
  char *p = strstr(json, "\"nodes\":[");
  cr_assert_not_null(p, "no nodes in %s", json);
  int n = 0;
  for (char *q = strstr(p, "{\"id\":"); q && n < max; n++) {
    nodes[n] = q;
    char *next = strstr(q + 1, "{\"id\":");
    if (next) next[-1] = '\0';
    q = next;
  }
  return n;
}

static const char *const NODE_FIELDS[] = {
    "id", "addr", "role", "state", "reachable", "error", "rtt_ms", "ready", "model", "nparams", "step", "epoch",
    "samples", "loss", "samples_per_s", "param_norm", "exchanges_ok", "exchanges_failed", "exchanges_rejected",
    "donations", "last_failure", "last_exchange_age_s", "bytes_in", "bytes_out", "exchange_bytes_out",
    "exchange_bytes_in", "members", "stats_age_s", "sketch_k",
};

#define NPARAMS (784 * 128 + 128 + 128 * 10 + 10) /* mlp:784-128-10 */

static void start_cluster(int *peer) {
  char *boot_args[] = {"--metrics", "127.0.0.1:0", NULL};
  cluster_start_bootstrap(&C, boot_args);
  for (int i = 0; i < 3; i++) {
    char shard[8];
    snprintf(shard, sizeof shard, "%d/3", i);
    /* Gossip every 4 steps: the replicas differ measurably between
     * exchanges, so Ξ is well above rounding. */
    peer[i] = cluster_start_peer(&C, "--model", "mlp:784-128-10", "--shard", shard, "--epochs", "1000", "--max-steps",
                                 "100000", "--no-eval", "--wait-peers", "3", "--gossip-every", "4", "--metrics",
                                 "127.0.0.1:0", NULL);
  }
  for (int i = 0; i < 3; i++)
    cr_assert(cluster_wait_file(C.node[peer[i]].log, "first step", 60), "peer %d did not start training: %s", i,
              proc_slurp(C.node[peer[i]].log));
  usleep(1500000);
}

Test(top, once_json_lists_every_member_and_sketch_drift_is_within_10_percent_of_exact) {
  SKIP_WITHOUT_DATA();
  int peer[3];
  start_cluster(peer);

  for (int round = 0; round < 3; round++) {
    char *out, *err;
    int st = run_top(&out, &err, "--once", "--json", "--exact", NULL);
    cr_assert(proc_exited_with(st, 0), "top failed (status %d): %s", st, err);
    cr_assert_eq(num_after(out, "members"), 4, "%s", out);
    cr_assert_eq(num_after(out, "peers"), 3, "%s", out);
    cr_assert_eq(num_after(out, "reachable_peers"), 3, "%s", out);
    double xi = num_after(out, "xi"), exact = num_after(out, "xi_exact");
    cr_assert_eq(num_after(out, "exact_n"), 3, "%s", out);
    cr_assert(isfinite(xi) && isfinite(exact) && exact > 0, "no drift figures: %s", out);
    fprintf(stderr, "round %d: sketch Ξ %.6g, exact Ξ %.6g (%+.2f%%), Ξ/‖θ̄‖ %.3g\n", round, xi, exact,
            100 * (xi / exact - 1), num_after(out, "rel_drift"));
    cr_assert(fabs(xi / exact - 1) <= 0.10, "sketch Ξ %g vs exact %g", xi, exact);

    char *nodes[8];
    int n = split_nodes(out, nodes, 8);
    cr_assert_eq(n, 4, "%d nodes listed", n);
    int peers = 0;
    for (int i = 0; i < n; i++) {
      for (size_t f = 0; f < sizeof NODE_FIELDS / sizeof NODE_FIELDS[0]; f++) {
        char pat[64];
        snprintf(pat, sizeof pat, "\"%s\":", NODE_FIELDS[f]);
        cr_assert_not_null(strstr(nodes[i], pat), "node %d lacks %s: %s", i, NODE_FIELDS[f], nodes[i]);
      }
      cr_assert_not_null(strstr(nodes[i], "\"reachable\":true"), "%s", nodes[i]);
      if (!strstr(nodes[i], "\"role\":\"peer\"")) continue;
      peers++;
      cr_assert_gt(num_after(nodes[i], "step"), 0, "%s", nodes[i]);
      cr_assert(isfinite(num_after(nodes[i], "loss")), "%s", nodes[i]);
      cr_assert_gt(num_after(nodes[i], "samples_per_s"), 0, "%s", nodes[i]);
      cr_assert_gt(num_after(nodes[i], "param_norm"), 0, "%s", nodes[i]);
      cr_assert_gt(num_after(nodes[i], "exchanges_ok"), 0, "%s", nodes[i]);
      cr_assert_gt(num_after(nodes[i], "bytes_in"), 0, "%s", nodes[i]);
      /* f32 on the wire: 4 bytes a parameter each way, per exchange */
      cr_assert_eq(num_after(nodes[i], "exchange_bytes_out"), 4.0 * NPARAMS, "%s", nodes[i]);
      cr_assert_eq(num_after(nodes[i], "exchange_bytes_in"), 4.0 * NPARAMS, "%s", nodes[i]);
      cr_assert_eq(num_after(nodes[i], "members"), 4, "%s", nodes[i]);
      cr_assert_eq(num_after(nodes[i], "sketch_k"), 1024, "%s", nodes[i]);
      cr_assert_eq(num_after(nodes[i], "nparams"), NPARAMS, "%s", nodes[i]);
      cr_assert_not_null(strstr(nodes[i], "\"have_params\":true"), "%s", nodes[i]);
    }
    cr_assert_eq(peers, 3);
    free(out);
    free(err);
  }

  /* The table view names every member too. */
  char *out, *err;
  int st = run_top(&out, &err, "--once", NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert(strstr(out, "Ξ ") && strstr(out, "3/3 peers reachable"), "%s", out);
  /* the bytes of an exchange, each way: 4 * 101770 = 397.5 KiB */
  cr_assert(strstr(out, "XCHG-IN") && strstr(out, "XCHG-OUT") && strstr(out, " 397.5K "), "%s", out);
  for (int i = 0; i < 3; i++) cr_assert_not_null(strstr(out, C.node[peer[i]].addr), "%s", out);
  free(out);
  free(err);

  /* Prometheus: the peer's and the bootstrap's endpoints. */
  int have_promtool = system("command -v promtool >/dev/null 2>&1") == 0;
  for (int who = 0; who < 2; who++) {
    int node = who ? 0 : peer[0], port = metrics_port(node);
    cr_assert_gt(port, 0, "node %d announced no metrics port", node);
    char *resp = http_get(port, "/metrics");
    cr_assert(strncmp(resp, "HTTP/1.0 200", 12) == 0 || strncmp(resp, "HTTP/1.1 200", 12) == 0, "%.200s", resp);
    cr_assert_not_null(strstr(resp, "text/plain; version=0.0.4"), "%.300s", resp);
    const char *body = strstr(resp, "\r\n\r\n");
    cr_assert_not_null(body);
    body += 4;
    cr_assert_not_null(strstr(body, "# TYPE rumor_network_sent_bytes_total counter"), "%s", body);
    if (!who) {
      cr_assert_not_null(strstr(body, "rumor_exchanges_total{result=\"applied\"}"), "%s", body);
      cr_assert_not_null(strstr(body, "rumor_training_loss"), "%s", body);
      char line[96];
      snprintf(line, sizeof line, "rumor_exchange_wire_bytes{direction=\"sent\"} %d\n", 4 * NPARAMS);
      cr_assert_not_null(strstr(body, line), "no '%s' in %s", line, body);
      snprintf(line, sizeof line, "rumor_exchange_wire_bytes{direction=\"received\"} %d\n", 4 * NPARAMS);
      cr_assert_not_null(strstr(body, line), "no '%s' in %s", line, body);
    }
    char path[300];
    snprintf(path, sizeof path, "%s/metrics-%d.txt", C.dir, who);
    FILE *f = fopen(path, "w");
    fputs(body, f);
    fclose(f);
    if (have_promtool) cluster_sh("promtool check metrics < %s", path);
    char *hz = http_get(port, "/healthz");
    cr_assert(strstr(hz, " 200 ") != NULL, "/healthz of node %d: %.200s", node, hz);
    free(hz);
    free(resp);
  }
  if (!have_promtool)
    fprintf(stderr, "promtool not installed (apt-get install prometheus): Prometheus format not checked by it\n");

  /* A time series and a chart from a short live run; PNG charts are
   * refused, saying what to use instead. */
  char csv[300], png[300], svg[300];
  snprintf(csv, sizeof csv, "%s/top.csv", C.dir);
  snprintf(png, sizeof png, "%s/top.png", C.dir);
  snprintf(svg, sizeof svg, "%s/top.svg", C.dir);
  st = run_top(&out, &err, "--count", "3", "--interval", "0.2", "--csv", csv, "--plot", svg, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out);
  free(err);
  st = run_top(&out, &err, "--count", "2", "--interval", "0.2", "--json", "--csv", csv, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out);
  free(err);
  st = run_top(&out, &err, "--count", "1", "--plot", png, NULL);
  cr_assert(proc_exited_with(st, 2) && strstr(err, png) && strstr(err, ".svg"), "status %d: %s", st, err);
  cr_assert_neq(access(png, F_OK), 0, "a PNG was written");
  free(out);
  free(err);
  char *rows = proc_slurp(csv);
  int lines = 0;
  for (char *p = rows; (p = strchr(p, '\n')); p++) lines++;
  cr_assert_eq(lines, 1 + 5, "header and 5 rows expected:\n%s", rows);
  cr_assert(strncmp(rows, "unix_time,", 10) == 0, "%s", rows);
  free(rows);
  char *img = proc_slurp(svg);
  cr_assert(strstr(img, "<svg ") && strstr(img, "mean loss"), "not the chart: %.200s", img);
  free(img);
  if (system("command -v python3 >/dev/null 2>&1") == 0)
    cluster_sh("python3 -c \"import xml.etree.ElementTree as E,sys; E.parse(sys.argv[1])\" %s", svg);

  /* Kill a peer: the next snapshot lists it, unreachable, with a reason. */
  kill(C.node[peer[2]].pid, SIGKILL);
  cluster_wait(&C, peer[2], 5);
  st = run_top(&out, &err, "--once", "--json", "--timeout-ms", "2000", NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert_eq(num_after(out, "peers"), 3, "the killed peer was dropped: %s", out);
  cr_assert_eq(num_after(out, "reachable_peers"), 2, "%s", out);
  char *nodes[8];
  int n = split_nodes(out, nodes, 8);
  bool seen = false;
  for (int i = 0; i < n; i++) {
    if (!strstr(nodes[i], C.node[peer[2]].addr)) continue;
    seen = true;
    cr_assert_not_null(strstr(nodes[i], "\"reachable\":false"), "%s", nodes[i]);
    cr_assert_null(strstr(nodes[i], "\"error\":\"\""), "no reason given: %s", nodes[i]);
    cr_assert(isnan(num_after(nodes[i], "step")), "stale figures shown for a dead peer: %s", nodes[i]);
  }
  cr_assert(seen, "killed peer %s not listed: %s", C.node[peer[2]].addr, out);
  cr_assert_eq(num_after(out, "n"), 2, "drift over the 2 live peers: %s", out);
  free(out);
  free(err);
}

/* A bootstrap node whose own --bootstrap list is all dead starts as the
 * first member after its join timeout: ready on /healthz, admitting peers. */
Test(top, bootstrap_with_every_listed_address_dead_starts_as_the_first_member) {
  SKIP_WITHOUT_DATA();
  char *boot_args[] = {"--metrics", "127.0.0.1:0", "--bootstrap", "127.0.0.1:1", "--join-timeout-ms", "1000", NULL};
  cluster_start_bootstrap(&C, boot_args);
  int port = metrics_port(0);
  cr_assert_gt(port, 0);
  bool ready = false;
  for (int i = 0; i < 100 && !ready; i++) {
    char *hz = http_get(port, "/healthz");
    ready = strstr(hz, " 200 ") != NULL;
    free(hz);
    if (!ready) usleep(100000);
  }
  cr_assert(ready, "the bootstrap node never became ready: %s", proc_slurp(C.node[0].log));
  cr_assert(cluster_log_has(&C, 0, "starting as the first member"), "%s", proc_slurp(C.node[0].log));
  int p = cluster_start_peer(&C, "--model", "mlp:784-32-10", "--max-steps", "20", "--no-eval", NULL);
  int st = cluster_wait(&C, p, 60);
  cr_assert(proc_exited_with(st, 0), "the peer could not join and train (status %d): %s", st,
            proc_slurp(C.node[p].log));
}

/* A peer past its last step that lingers (--finish-wait-ms) while another
 * trains: top shows it "done" (JSON "finished"), its metrics say
 * rumor_finished 1; once the other leaves, it stops waiting and exits. */
Test(top, a_peer_that_finished_and_lingers_is_shown_done_and_leaves_after_the_last) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int done = cluster_start_peer(&C, "--model", "mlp:784-32-10", "--shard", "0/2", "--epochs", "1000", "--max-steps",
                                "20", "--no-eval", "--wait-peers", "2", "--finish-wait-ms", "120000", "--metrics",
                                "127.0.0.1:0", NULL);
  int trains = cluster_start_peer(&C, "--model", "mlp:784-32-10", "--shard", "1/2", "--epochs", "1000",
                                  "--max-steps", "1000000", "--no-eval", "--wait-peers", "2", NULL);
  cr_assert(cluster_wait_file(C.node[done].log, "averaging with partners that still train", 60),
            "the short peer never finished its steps: %s", proc_slurp(C.node[done].log));
  char *out = NULL, *err = NULL;
  int st, peers = 0, finished = 0;
  /* The log line comes just before the peer marks itself finished. */
  for (int attempt = 0; attempt < 5 && finished == 0; attempt++) {
    if (attempt) free(out), free(err), usleep(200000);
    st = run_top(&out, &err, "--once", "--json", NULL);
    cr_assert(proc_exited_with(st, 0), "top failed (status %d): %s", st, err);
    char *copy = xstrdup(out), *nodes[8];
    int n = split_nodes(copy, nodes, 8);
    peers = finished = 0;
    for (int i = 0; i < n; i++) {
      peers += strstr(nodes[i], "\"role\":\"peer\"") != NULL;
      finished += strstr(nodes[i], "\"finished\":true") != NULL;
    }
    free(copy);
  }
  cr_assert_eq(peers, 2, "top lists %d peers: %s", peers, out);
  cr_assert_eq(finished, 1, "top should show exactly the short peer finished: %s", out);
  free(out), free(err);
  st = run_top(&out, &err, "--once", NULL);
  cr_assert(proc_exited_with(st, 0), "top failed (status %d): %s", st, err);
  cr_assert(strstr(out, " done "), "the table shows no peer in state done: %s", out);
  free(out), free(err);
  char *metrics = http_get(metrics_port(done), "/metrics");
  cr_assert(strstr(metrics, "\nrumor_finished 1\n"), "the lingering peer's metrics: %s", metrics);
  free(metrics);
  /* The other leaves: nobody trains any more, so the lingering peer ends
   * long before its 120 s. */
  kill(C.node[trains].pid, SIGTERM);
  st = cluster_wait(&C, done, 60);
  cr_assert(proc_exited_with(st, 0), "the lingering peer did not end cleanly (status %d): %s", st,
            proc_slurp(C.node[done].log));
  cr_assert(cluster_log_has(&C, done, "no partner is still training"), "%s", proc_slurp(C.node[done].log));
  cluster_wait(&C, trains, 30);
}

Test(top, bad_flags_and_dead_addresses_are_clear_errors) {
  char id[300];
  snprintf(id, sizeof id, "%s/top.key", C.dir);
  cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, id);
  snprintf(C.boot, sizeof C.boot, "127.0.0.1:1");
  char *out, *err;
  int st = run_top(&out, &err, "--once", "--timeout-ms", "500", NULL);
  cr_assert(proc_exited_with(st, 1), "status %d: %s", st, err);
  cr_assert_not_null(strstr(err, "127.0.0.1:1"), "the address tried is not named: %s", err);
  free(out);
  free(err);

  /* --plot takes SVG only, refused before anything is asked of the network
   * (the address is dead: a refusal after trying it would name it) and
   * before any file is made. */
  const char *bad_plots[] = {"drift.jpg", "drift.png"};
  for (size_t i = 0; i < sizeof bad_plots / sizeof bad_plots[0]; i++) {
    st = run_top(&out, &err, "--once", "--timeout-ms", "500", "--plot", bad_plots[i], NULL);
    cr_assert(proc_exited_with(st, 2), "status %d: %s", st, err);
    cr_assert(strstr(err, bad_plots[i]) && strstr(err, "--plot") && strstr(err, ".svg"), "%s", err);
    cr_assert_null(strstr(err, "127.0.0.1:1"), "the network was tried before the flag was checked: %s", err);
    char made[300];
    snprintf(made, sizeof made, "%s/%s", C.dir, bad_plots[i]);
    cr_assert_neq(access(made, F_OK), 0, "%s was written", made);
    free(out);
    free(err);
  }

  st = run_top(&out, &err, "--once", "--interval", "-1", NULL);
  cr_assert(proc_exited_with(st, 2), "status %d: %s", st, err);
  cr_assert_not_null(strstr(err, "--interval"), "%s", err);
  free(out);
  free(err);

  char csv[300];
  snprintf(csv, sizeof csv, "%s/other.csv", C.dir);
  cluster_sh("echo 'a,b,c' > %s", csv);
  st = run_top(&out, &err, "--once", "--csv", csv, NULL);
  cr_assert(proc_exited_with(st, 2), "status %d: %s", st, err);
  cr_assert(strstr(err, csv) && strstr(err, "other columns"), "%s", err);
  free(out);
  free(err);

  char *argv[] = {RUMOR_BIN, "top", "--bootstrap", "127.0.0.1:1", "--once", NULL};
  st = proc_run(argv, 20, C.dir, &out, &err);
  cr_assert(proc_exited_with(st, 2), "status %d: %s", st, err);
  cr_assert_not_null(strstr(err, "--cluster-key"), "%s", err);
  free(out);
  free(err);

  /* --servers watches servers instead of the cluster: not both. */
  st = run_top(&out, &err, "--once", "--servers", "127.0.0.1:2", NULL);
  cr_assert(proc_exited_with(st, 2), "status %d: %s", st, err);
  cr_assert(strstr(err, "--bootstrap") && strstr(err, "--servers") && strstr(err, "not both"), "%s", err);
  free(out);
  free(err);

  /* Addresses are checked before any is dialed, and named with the flag. */
  const struct {
    const char *boot, *servers, *says;
  } bad_addrs[] = {
      {"127.0.0.1:99999", NULL, "--bootstrap: '127.0.0.1:99999': port must be in [1, 65535]"},
      {"127.0.0.1:1,", NULL, "--bootstrap: '127.0.0.1:1,' has an empty entry"},
      {NULL, "127.0.0.1:2,127.0.0.1:0", "--servers: '127.0.0.1:0': port must be in [1, 65535]"},
  };
  for (size_t i = 0; i < sizeof bad_addrs / sizeof bad_addrs[0]; i++) {
    char *a[] = {RUMOR_BIN, "top", "--cluster-key", C.key, "--identity", id, "--once",
                 bad_addrs[i].boot ? "--bootstrap" : "--servers",
                 (char *)(bad_addrs[i].boot ? bad_addrs[i].boot : bad_addrs[i].servers), NULL};
    st = proc_run(a, 20, C.dir, &out, &err);
    cr_assert(proc_exited_with(st, 2), "status %d: %s", st, err);
    cr_assert_not_null(strstr(err, bad_addrs[i].says), "%s", err);
    free(out);
    free(err);
  }

  /* A host name passes the check; one that does not resolve is the
   * address that failed. */
  snprintf(C.boot, sizeof C.boot, "nohost.invalid:7470");
  st = run_top(&out, &err, "--once", "--timeout-ms", "500", NULL);
  cr_assert(proc_exited_with(st, 1), "status %d: %s", st, err);
  cr_assert_not_null(strstr(err, "nohost.invalid:7470"), "the address tried is not named: %s", err);
  free(out);
  free(err);
}
