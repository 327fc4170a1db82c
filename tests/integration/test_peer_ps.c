/* `rumor ps` and `rumor peer --sync ps` as users run them: servers and
 * workers as separate processes on 127.0.0.1. With staleness 0 one round
 * equals one step of a single process on every worker's batch together;
 * with staleness S no worker is released more than S clocks ahead of the
 * slowest; a killed server restarted from its checkpoint lets the workers
 * finish; a killed worker is dropped from the bound; bad command lines and
 * bad peers get clear errors. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../support/cluster.h"
#include "peer/train/train.h"
#include "peer/train/train_impl.h"
#include "../support/ckpt_params.h"
#include "../support/fmnist.h"
#include "../support/one_step.h"

static struct cluster C;

static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(ps, .init = setup, .fini = teardown, .timeout = 120);

#define MODEL "mlp:784-32-10"
#define SEED "7"

/* A process of this file: its files and, for a server, its address. */
struct node {
  pid_t pid;
  char key[256], out[256], log[256], ckpt[256], addr[64];
};

static void node_files(struct node *n, const char *tag) {
  snprintf(n->out, sizeof n->out, "%s/%s.out", C.dir, tag);
  snprintf(n->log, sizeof n->log, "%s/%s.log", C.dir, tag);
  snprintf(n->ckpt, sizeof n->ckpt, "%s/%s.safetensors", C.dir, tag);
  if (!n->key[0]) cluster_make_identity(&C, tag, n->key, sizeof n->key);
}

/* Starts `rumor ps` as server `tag` holding range R of `ranges`, on
 * `listen` (127.0.0.1:0 the first time; the same address on a restart),
 * with `extra` options (NULL-terminated), and waits for its address. */
static void start_server(struct node *n, const char *tag, const char *range, const char *staleness,
                         const char *workers, const char *max_steps, const char *listen, char *const *extra) {
  node_files(n, tag);
  char *argv[64] = {RUMOR_BIN, "ps", "--listen", (char *)listen, "--cluster-key", C.key, "--identity", n->key,
                    "--model", MODEL, "--seed", SEED, "--range", (char *)range, "--staleness", (char *)staleness,
                    "--workers", (char *)workers, "--max-steps", (char *)max_steps, "--checkpoint", n->ckpt,
                    "--checkpoint-every", "1", "--worker-timeout-ms", "3000"};
  int k = 26;
  for (int i = 0; extra && extra[i] && k < 63; i++) argv[k++] = extra[i];
  argv[k] = NULL;
  char *before = proc_slurp(n->out);
  size_t seen = strlen(before);
  free(before);
  n->pid = proc_spawn(argv, n->out, n->log);
  cr_assert_gt(n->pid, 0);
  double t0 = cluster_now();
  for (;;) {
    char *s = proc_slurp(n->out);
    const char *p = strlen(s) > seen ? strstr(s + seen, "\"listen\":\"") : NULL;
    if (p) {
      p += 10;
      snprintf(n->addr, sizeof n->addr, "%.*s", (int)(strchr(p, '"') - p), p);
      free(s);
      return;
    }
    free(s);
    cr_assert(cluster_now() - t0 < 30, "server %s did not start: %s", tag, proc_slurp(n->log));
    usleep(20000);
  }
}

/* Starts worker `tag` on shard `shard` against the comma list `servers`. */
static void start_worker(struct node *n, const char *tag, const char *servers, const char *shard,
                         const char *max_steps, char *const *extra) {
  node_files(n, tag);
  char *argv[64] = {RUMOR_BIN, "peer", "--sync", "ps", "--servers", (char *)servers, "--cluster-key", C.key,
                    "--identity", n->key, "--model", MODEL, "--seed", SEED, "--shard", (char *)shard, "--batch",
                    "16", "--max-steps", (char *)max_steps, "--threads", "1", "--no-eval", "--log-every", "1",
                    "--checkpoint", n->ckpt};
  int k = 28;
  for (int i = 0; extra && extra[i] && k < 63; i++) argv[k++] = extra[i];
  argv[k] = NULL;
  n->pid = proc_spawn(argv, n->out, n->log);
  cr_assert_gt(n->pid, 0);
}

static void expect_exit_0(struct node *n, const char *what, double secs) {
  int st = proc_wait(n->pid, secs);
  cr_assert(proc_exited_with(st, 0), "%s did not finish cleanly (status %d): %s", what, st, proc_slurp(n->log));
}

/* A number from the last line of n's stdout that has `key`, or NAN. */
static double result(const struct node *n, const char *key) { return cluster_line_number(n->out, key, key); }

/* A server checkpoint's slice of the parameters (the caller frees it). */
static float *load_slice(const char *path, int64_t *n) {
  struct st_file f;
  struct rumor_err e;
  cr_assert_eq(safetensors_read(path, true, &f, &e), 0, "%s", e.msg);
  const struct st_tensor *t = safetensors_find(&f, "ps.params");
  cr_assert_not_null(t, "%s has no ps.params", path);
  *n = (int64_t)(t->nbytes / sizeof(float));
  float *p = xmalloc(t->nbytes);
  memcpy(p, t->data, t->nbytes);
  safetensors_free(&f);
  return p;
}

/* The parameters of a group stage's checkpoint that holds unit `unit` of
 * MODEL, in flat-buffer order (the caller frees them). */
static float *stage_ckpt_params(const char *path, int unit, int64_t *n) {
  struct model_spec spec;
  struct model_table tab;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(MODEL, &spec, &e), 0);
  model_table_build(&spec, &tab);
  struct st_file f;
  cr_assert_eq(safetensors_read(path, true, &f, &e), 0, "%s", e.msg);
  int64_t lo = tab.unit_offset[unit];
  *n = tab.unit_offset[unit + 1] - lo;
  float *p = xmalloc((size_t)*n * sizeof(float));
  for (size_t k = 0; k < tab.n; k++) {
    if (tab.p[k].unit != unit) continue;
    const struct st_tensor *t = safetensors_find(&f, tab.p[k].name);
    cr_assert(t && t->nbytes == (size_t)tab.p[k].numel * sizeof(float), "%s: no entry %s", path, tab.p[k].name);
    memcpy(p + (tab.p[k].offset - lo), t->data, t->nbytes);
  }
  safetensors_free(&f);
  model_table_free(&tab);
  return p;
}

/* ‖a − b‖ / ‖b‖ over n values, printing the worst element. */
static double rel_diff(const float *a, const float *b, int64_t n, const char *what) {
  double d2 = 0, s2 = 0, worst = 0;
  int64_t at = 0;
  for (int64_t j = 0; j < n; j++) {
    cr_assert(isfinite(a[j]), "%s: value %lld is not finite", what, (long long)j);
    double d = (double)a[j] - b[j];
    d2 += d * d;
    s2 += (double)b[j] * b[j];
    if (fabs(d) > worst) worst = fabs(d), at = j;
  }
  fprintf(stderr, "%s: relative difference %.3g (worst element %lld off by %.3g)\n", what, sqrt(d2 / s2),
          (long long)at, worst);
  return sqrt(d2 / s2);
}

Test(ps, one_bsp_round_of_two_workers_on_two_servers_equals_one_step_on_both_batches) {
  SKIP_WITHOUT_DATA();
  struct node s[2] = {0}, w[2] = {0};
  start_server(&s[0], "s0", "0/2", "0", "2", "1", "127.0.0.1:0", NULL);
  start_server(&s[1], "s1", "1/2", "0", "2", "1", "127.0.0.1:0", NULL);
  char servers[160];
  snprintf(servers, sizeof servers, "%s,%s", s[0].addr, s[1].addr);
  start_worker(&w[0], "w0", servers, "0/2", "1", NULL);
  start_worker(&w[1], "w1", servers, "1/2", "1", NULL);
  for (int i = 0; i < 2; i++) expect_exit_0(&w[i], "worker", 60);
  for (int i = 0; i < 2; i++) expect_exit_0(&s[i], "server", 30); /* every worker said it is done */
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(result(&w[i], "steps"), 1);
    cr_assert_eq(result(&s[i], "version"), 1, "server %d applied more or fewer than one round", i);
    cr_assert_eq(result(&s[i], "grads"), 2);
  }
  int64_t P, Q, n0, n1;
  float *a = ckpt_params_load(w[0].ckpt, &P), *b = ckpt_params_load(w[1].ckpt, &Q);
  cr_assert_eq(P, Q);
  cr_assert_eq(memcmp(a, b, (size_t)P * sizeof(float)), 0, "the two workers hold different parameters");
  /* The servers' checkpoints, side by side, are what the workers pulled. */
  float *lo = load_slice(s[0].ckpt, &n0), *hi = load_slice(s[1].ckpt, &n1);
  cr_assert_eq(n0 + n1, P);
  cr_assert_eq(memcmp(lo, a, (size_t)n0 * sizeof(float)), 0);
  cr_assert_eq(memcmp(hi, a + n0, (size_t)n1 * sizeof(float)), 0);
  float *single = one_step_on_all_batches(MODEL, strtoull(SEED, NULL, 10), 2, 16, &Q);
  cr_assert_eq(P, Q);
  /* Summed in another order, so equal to rounding. */
  double rel = rel_diff(a, single, P, "BSP round vs single step on the 32 rows");
  cr_assert(rel < 1e-6, "the servers' round differs from the single process's step by %.3g (relative)", rel);
  free(a), free(b), free(lo), free(hi), free(single);
}

/* A straggler (4x slower steps) and a fast worker under --staleness 2: the
 * fast one is held, so no release is more than 2 clocks ahead of the
 * slowest live worker; it does run ahead (a gap above 0), unlike BSP. */
Test(ps, ssp_never_releases_a_worker_more_than_s_clocks_ahead_of_the_slowest) {
  SKIP_WITHOUT_DATA();
  struct node s = {0}, w[2] = {0};
  start_server(&s, "s", "0/1", "2", "2", "40", "127.0.0.1:0", NULL);
  char *slow[] = {"--slowdown", "4", NULL};
  start_worker(&w[0], "fast", s.addr, "0/2", "40", NULL);
  start_worker(&w[1], "slow", s.addr, "1/2", "40", slow);
  for (int i = 0; i < 2; i++) expect_exit_0(&w[i], "worker", 90);
  expect_exit_0(&s, "server", 30);
  double gap = result(&s, "max_clock_gap");
  fprintf(stderr, "SSP S=2: largest clock gap at a release %g; fast worker waited %.2f s, slow one %.2f s\n", gap,
          result(&w[0], "ps_wait_s"), result(&w[1], "ps_wait_s"));
  cr_assert(gap <= 2, "a worker was released %g clocks ahead of the slowest (bound 2)", gap);
  cr_assert(gap >= 1, "the fast worker never ran ahead (gap %g): SSP behaved like BSP", gap);
  for (int i = 0; i < 2; i++) {
    cr_assert(result(&w[i], "ps_max_clock_gap") <= 2);
    cr_assert_eq(result(&w[i], "steps"), 40);
  }
  cr_assert_eq(result(&s, "version"), 80, "SSP applies every gradient: 2 workers x 40 steps");
}

/* --staleness none: each gradient is applied as it comes and nobody is
 * held; the fast worker's releases may be any distance ahead. */
Test(ps, asp_applies_every_gradient_and_holds_nobody) {
  SKIP_WITHOUT_DATA();
  struct node s = {0}, w[2] = {0};
  start_server(&s, "s", "0/1", "none", "2", "30", "127.0.0.1:0", NULL);
  char *slow[] = {"--slowdown", "4", NULL};
  start_worker(&w[0], "fast", s.addr, "0/2", "30", NULL);
  start_worker(&w[1], "slow", s.addr, "1/2", "30", slow);
  for (int i = 0; i < 2; i++) expect_exit_0(&w[i], "worker", 90);
  expect_exit_0(&s, "server", 30);
  fprintf(stderr, "ASP: largest clock gap at a release %g\n", result(&s, "max_clock_gap"));
  cr_assert_eq(result(&s, "version"), 60, "ASP applies every gradient: 2 workers x 30 steps");
  cr_assert_eq(result(&s, "stale"), 0);
  for (int i = 0; i < 2; i++) cr_assert_eq(result(&w[i], "steps"), 30);
}

/* SIGKILL a server mid-run and restart it on the same address from its
 * checkpoint: it resumes (version and clocks), the workers reconnect, push
 * again what it lacks, and both finish their steps in lockstep (BSP). */
Test(ps, a_killed_server_restarted_from_its_checkpoint_lets_the_workers_finish) {
  SKIP_WITHOUT_DATA();
  struct node s[2] = {0}, w[2] = {0};
  start_server(&s[0], "s0", "0/2", "0", "2", "600", "127.0.0.1:0", NULL);
  start_server(&s[1], "s1", "1/2", "0", "2", "600", "127.0.0.1:0", NULL);
  char servers[160];
  snprintf(servers, sizeof servers, "%s,%s", s[0].addr, s[1].addr);
  char *paced[] = {"--slowdown", "8", NULL}; /* a few ms a step: the kill lands mid-run */
  start_worker(&w[0], "w0", servers, "0/2", "600", paced);
  start_worker(&w[1], "w1", servers, "1/2", "600", paced);
  for (int i = 0; i < 2; i++)
    cr_assert(cluster_wait_file(w[i].log, "first step", 60), "worker %d did not start: %s", i, proc_slurp(w[i].log));
  usleep(300 * 1000);
  cr_assert_eq(kill(w[0].pid, 0), 0, "the run ended before the kill: make it longer");
  kill(s[1].pid, SIGKILL);
  proc_wait(s[1].pid, 10);
  cr_assert(cluster_wait_file(w[0].log, "lost server", 10), "the workers did not notice the kill");
  usleep(500 * 1000);
  char addr[64];
  snprintf(addr, sizeof addr, "%s", s[1].addr);
  start_server(&s[1], "s1", "1/2", "0", "2", "600", addr, NULL);
  for (int i = 0; i < 2; i++) expect_exit_0(&w[i], "worker", 90);
  for (int i = 0; i < 2; i++) expect_exit_0(&s[i], "server", 30);
  cr_assert(cluster_wait_file(s[1].log, "resumed from", 1), "the restarted server did not resume: %s",
            proc_slurp(s[1].log));
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(result(&w[i], "steps"), 600);
    cr_assert_geq(result(&w[i], "ps_reconnects"), 1, "worker %d did not reconnect", i);
  }
  double v0 = result(&s[0], "version"), v1 = result(&s[1], "version");
  fprintf(stderr, "after the restart: server versions %g and %g, %g rounds closed early\n", v0, v1,
          result(&s[1], "rounds_partial"));
  cr_assert_eq(v0, 600);
  cr_assert_eq(v1, 600, "the restarted server skipped or repeated rounds");
  int64_t P, Q;
  float *a = ckpt_params_load(w[0].ckpt, &P), *b = ckpt_params_load(w[1].ckpt, &Q);
  cr_assert_eq(memcmp(a, b, (size_t)P * sizeof(float)), 0, "the workers ended with different parameters");
  free(a), free(b);
}

/* Three workers under BSP; one is killed: the server drops it from the
 * rounds and the two others finish. */
Test(ps, a_killed_worker_is_dropped_from_the_bound_and_the_others_finish) {
  SKIP_WITHOUT_DATA();
  struct node s = {0}, w[3] = {0};
  start_server(&s, "s", "0/1", "0", "3", "400", "127.0.0.1:0", NULL);
  char *paced[] = {"--slowdown", "4", NULL};
  const char *shard[3] = {"0/3", "1/3", "2/3"}, *tag[3] = {"w0", "w1", "w2"};
  for (int i = 0; i < 3; i++) start_worker(&w[i], tag[i], s.addr, shard[i], "400", paced);
  for (int i = 0; i < 3; i++)
    cr_assert(cluster_wait_file(w[i].log, "first step", 60), "worker %d did not start: %s", i, proc_slurp(w[i].log));
  usleep(200 * 1000);
  cr_assert_eq(kill(w[0].pid, 0), 0, "the run ended before the kill: make it longer");
  kill(w[2].pid, SIGKILL);
  proc_wait(w[2].pid, 10);
  for (int i = 0; i < 2; i++) expect_exit_0(&w[i], "worker", 90);
  expect_exit_0(&s, "server", 30);
  cr_assert(cluster_wait_file(s.log, "dropped from the bound", 1), "no drop logged: %s", proc_slurp(s.log));
  cr_assert_eq(result(&s, "dropped"), 1);
  cr_assert_eq(result(&s, "version"), 400);
  for (int i = 0; i < 2; i++) cr_assert_eq(result(&w[i], "steps"), 400);
}

/* `rumor top --servers` shows each server's version and its workers'
 * clocks and states, as JSON and as a table. */
Test(ps, top_shows_the_servers_version_and_each_workers_clock) {
  SKIP_WITHOUT_DATA();
  struct node s = {0}, w[2] = {0};
  start_server(&s, "s", "0/1", "2", "2", "100000", "127.0.0.1:0", NULL);
  const char *shard[2] = {"0/2", "1/2"}, *tag[2] = {"w0", "w1"};
  for (int i = 0; i < 2; i++) start_worker(&w[i], tag[i], s.addr, shard[i], "100000", NULL);
  for (int i = 0; i < 2; i++)
    cr_assert(cluster_wait_file(w[i].log, "first step", 60), "worker %d did not start: %s", i, proc_slurp(w[i].log));
  usleep(300 * 1000);
  char id[300];
  cluster_make_identity(&C, "top", id, sizeof id);
  char *json[] = {"top", "--servers", s.addr, "--cluster-key", C.key, "--identity", id, "--once", "--json", NULL};
  char *out, *err;
  int st = cluster_run(&C, json, 60, &out, &err);
  cr_assert(proc_exited_with(st, 0), "rumor top failed: %s", err);
  cr_assert(strstr(out, "\"reachable\":true") && strstr(out, "\"staleness\":2"), "%s", out);
  const char *v = strstr(out, "\"version\":");
  cr_assert(v && strtol(v + 10, NULL, 10) > 0, "%s", out);
  int live = 0;
  for (const char *p = out; (p = strstr(p, "\"clock\":")); p++) {
    cr_assert_gt(strtol(p + 8, NULL, 10), 0, "a worker at clock 0: %s", out);
    live++;
  }
  cr_assert_eq(live, 2, "two workers expected: %s", out);
  free(out), free(err);
  char *table[] = {"top", "--servers", s.addr, "--cluster-key", C.key, "--identity", id, "--once", NULL};
  st = cluster_run(&C, table, 60, &out, &err);
  cr_assert(proc_exited_with(st, 0), "rumor top failed: %s", err);
  cr_assert(strstr(out, "VERSION") && strstr(out, "0/1"), "%s", out);
  free(out), free(err);
  char *nobody[] = {"top", "--servers", "127.0.0.1:1", "--cluster-key", C.key, "--identity", id, "--once", NULL};
  st = cluster_run(&C, nobody, 60, &out, &err);
  cr_assert(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 1 && strstr(out, "UNREACHABLE"), "%s", out);
  free(out), free(err);
}

Test(ps, bad_flags_are_usage_errors) {
  char ps_key[256];
  cluster_make_identity(&C, "usage", ps_key, sizeof ps_key);
  char *no_workers[] = {"ps", "--cluster-key", C.key, "--identity", ps_key, "--checkpoint", "x", NULL};
  cluster_expect_exit(&C, no_workers, 2, "--workers N is required");
  char *no_ckpt[] = {"ps", "--cluster-key", C.key, "--identity", ps_key, "--workers", "2", NULL};
  cluster_expect_exit(&C, no_ckpt, 2, "--checkpoint PATH is required");
  char *range[] = {"ps", "--workers", "2", "--checkpoint", "x", "--range", "2/2", NULL};
  cluster_expect_exit(&C, range, 2, "--range must be I/S");
  char *stale[] = {"ps", "--workers", "2", "--checkpoint", "x", "--staleness", "soon", NULL};
  cluster_expect_exit(&C, stale, 2, "--staleness must be a number of steps (0: BSP) or none");
  char *no_key[] = {"ps", "--workers", "2", "--checkpoint", "x", NULL};
  cluster_expect_exit(&C, no_key, 2, "--cluster-key FILE is required");
  char *model[] = {"ps", "--workers", "2", "--checkpoint", "x", "--model", "mlp:", NULL};
  cluster_expect_exit(&C, model, 2, "--model");
  /* A checkpoint it could not write is refused before it serves. */
  char *dest[] = {"ps", "--cluster-key", C.key, "--identity", ps_key, "--workers", "2", "--checkpoint",
                  "/nonexistent-rumor/x", NULL};
  cluster_expect_exit(&C, dest, 2, "--checkpoint: /nonexistent-rumor/x: directory /nonexistent-rumor: No such file");
  char *dir_dest[] = {"ps", "--cluster-key", C.key, "--identity", ps_key, "--workers", "2", "--checkpoint", "/tmp/", NULL};
  cluster_expect_exit(&C, dir_dest, 2, "a parameter server saves one file, not a directory");
  char *no_servers[] = {"peer", "--sync", "ps", NULL};
  cluster_expect_exit(&C, no_servers, 2, "--sync ps needs --servers");
  char *stray[] = {"peer", "--servers", "127.0.0.1:1", NULL};
  cluster_expect_exit(&C, stray, 2, "--servers is for --sync ps");
  char *boot[] = {"peer", "--sync", "ps", "--servers", "127.0.0.1:1", "--bootstrap", "127.0.0.1:2", NULL};
  cluster_expect_exit(&C, boot, 2, "--bootstrap is for gossip members");
  char *clip[] = {"peer", "--sync", "ps", "--servers", "127.0.0.1:1", "--clip", NULL};
  cluster_expect_exit(&C, clip, 2, "--clip is a gossip option");
  char *group[] = {"group", "--sync", "ps", "--servers", "127.0.0.1:1", "--stages", "2", NULL};
  cluster_expect_exit(&C, group, 2, "--servers '127.0.0.1:1' has 1 list for 2 stages");
  char *group_boot[] = {"group", "--sync", "ps", "--servers", "127.0.0.1:1;127.0.0.1:2", "--stages", "2",
                        "--bootstrap", "127.0.0.1:3;127.0.0.1:4", NULL};
  cluster_expect_exit(&C, group_boot, 2, "--bootstrap is for gossip members");
  char *stage[] = {"ps", "--workers", "2", "--checkpoint", "x", "--stage", "2/2", NULL};
  cluster_expect_exit(&C, stage, 2, "--stage '2/2': expected s/S");
}

/* Two 2-stage groups on stage servers (rumor ps --stage s/2) take, BSP,
 * the same steps as two whole replicas on one server: the stage servers'
 * slices side by side equal the whole server's parameters to rounding
 * (a group sums its micro-batches' gradients in another order), and each
 * group's stages end holding exactly what their servers hold. */
Test(ps, two_groups_on_stage_servers_step_as_two_whole_workers) {
  SKIP_WITHOUT_DATA();
  struct node ss[2] = {0}, sw = {0}, w[2] = {0};
  char *stage_flag[2][3] = {{"--stage", "0/2", NULL}, {"--stage", "1/2", NULL}};
  for (int i = 0; i < 2; i++) {
    char tag[16];
    snprintf(tag, sizeof tag, "stage%d", i);
    start_server(&ss[i], tag, "0/1", "0", "2", "8", "127.0.0.1:0", stage_flag[i]);
  }
  start_server(&sw, "whole", "0/1", "0", "2", "8", "127.0.0.1:0", NULL);
  char lists[200], id[300];
  snprintf(lists, sizeof lists, "%s,%s", ss[0].addr, ss[1].addr);
  cluster_make_identity(&C, "top", id, sizeof id);
  char *top[] = {"top", "--servers", lists, "--cluster-key", C.key, "--identity", id, "--once", NULL};
  char *out, *err;
  int rc = cluster_run(&C, top, 60, &out, &err);
  cr_assert(proc_exited_with(rc, 0) && strstr(out, "STAGE") && strstr(out, " 0/2 ") && strstr(out, " 1/2 "),
            "rumor top --servers shows no stages: %s %s", out, err);
  free(out), free(err);
  snprintf(lists, sizeof lists, "%s;%s", ss[0].addr, ss[1].addr);
  struct cluster_group g[2];
  const char *names[2] = {"ga", "gb"};
  for (int i = 0; i < 2; i++) {
    char shard[8], ck[256];
    snprintf(shard, sizeof shard, "%d/2", i);
    snprintf(ck, sizeof ck, "%s/%s.safetensors", C.dir, names[i]);
    char *args[] = {"--stages", "2", "--sync", "ps", "--servers", lists, "--model", MODEL, "--seed", SEED, "--shard",
                    shard, "--batch", "16", "--micro-batches", "2", "--max-steps", "8", "--no-eval", "--checkpoint",
                    ck, NULL};
    cluster_start_group(&C, &g[i], names[i], args);
    start_worker(&w[i], i ? "w1" : "w0", sw.addr, shard, "8", NULL);
  }
  for (int i = 0; i < 2; i++) {
    int st = proc_wait(g[i].pid, 90);
    cr_assert(proc_exited_with(st, 0), "group %s failed (status %d): %s", names[i], st, proc_slurp(g[i].log));
    expect_exit_0(&w[i], "whole worker", 60);
    for (int s = 0; s < 2; s++) {
      char has[64];
      snprintf(has, sizeof has, "\"stage\":%d,\"stages\":2,\"steps\"", s);
      cr_assert_eq(cluster_line_number(g[i].out, has, "ps_pushes"), 8, "group %s stage %d: %s", names[i], s,
                   proc_slurp(g[i].out));
    }
  }
  for (int i = 0; i < 2; i++) {
    expect_exit_0(&ss[i], "stage server", 30);
    cr_assert_eq(result(&ss[i], "version"), 8, "stage server %d applied %g rounds", i, result(&ss[i], "version"));
  }
  expect_exit_0(&sw, "whole server", 30);
  int64_t n0, n1, P;
  float *lo = load_slice(ss[0].ckpt, &n0), *hi = load_slice(ss[1].ckpt, &n1), *all = load_slice(sw.ckpt, &P);
  cr_assert_eq(n0 + n1, P, "the stage slices hold %lld + %lld values, the model %lld", (long long)n0, (long long)n1,
               (long long)P);
  float *both = xmalloc((size_t)P * sizeof(float));
  memcpy(both, lo, (size_t)n0 * sizeof(float));
  memcpy(both + n0, hi, (size_t)n1 * sizeof(float));
  double rel = rel_diff(both, all, P, "stage servers vs whole-model server after 8 BSP rounds");
  cr_assert(rel < 1e-5, "the groups' rounds differ from the whole replicas' by %.3g (relative)", rel);
  for (int i = 0; i < 2; i++)
    for (int s = 0; s < 2; s++) {
      char path[300];
      snprintf(path, sizeof path, "%s/%s-stage%d.safetensors", C.dir, names[i], s);
      int64_t n;
      float *mine = stage_ckpt_params(path, s, &n); /* MODEL's two layers: one a stage */
      cr_assert_eq(n, s ? n1 : n0);
      cr_assert_eq(memcmp(mine, s ? hi : lo, (size_t)n * sizeof(float)), 0, "group %s stage %d holds other values "
                   "than its servers", names[i], s);
      free(mine);
    }
  free(lo), free(hi), free(all), free(both);
}

/* A worker whose list is malformed, whose model differs from the server's,
 * or who lists the servers out of order, fails with the server's reason;
 * the server keeps serving. */
Test(ps, mismatched_workers_are_refused_with_a_reason) {
  SKIP_WITHOUT_DATA();
  struct node s = {0};
  start_server(&s, "s", "0/1", "0", "1", "10", "127.0.0.1:0", NULL);
  char wkey[256];
  cluster_make_identity(&C, "bad-worker", wkey, sizeof wkey);
  char *base[] = {"peer", "--sync", "ps", "--cluster-key", C.key, "--identity", wkey, "--threads", "1", "--no-eval",
                  "--seed", SEED, "--max-steps", "10"};
  char *args[32];
  size_t nb = sizeof base / sizeof base[0];
  memcpy(args, base, sizeof base);
  char *bad_list[] = {"--servers", "127.0.0.1", "--model", MODEL, NULL};
  memcpy(args + nb, bad_list, sizeof bad_list);
  cluster_expect_exit(&C, args, 2, "--servers: '127.0.0.1': expected host:port");
  char *other_model[] = {"--servers", s.addr, "--model", "mlp:784-16-10", NULL};
  memcpy(args + nb, other_model, sizeof other_model);
  cluster_expect_exit(&C, args, 1, "this server holds model mlp:784-32-10");
  char two[160];
  snprintf(two, sizeof two, "127.0.0.1:1,%s", s.addr);
  char *order[] = {"--servers", two, "--model", MODEL, NULL};
  memcpy(args + nb, order, sizeof order);
  cluster_expect_exit(&C, args, 1, "range order");
  char *lr[] = {"--servers", s.addr, "--model", MODEL, "--lr", "0.5", NULL};
  memcpy(args + nb, lr, sizeof lr);
  cluster_expect_exit(&C, args, 1, "optimizer settings differ");
  /* Whole replicas and a group's stages never share a server. */
  struct node st = {0};
  char *stage0[] = {"--stage", "0/2", NULL};
  start_server(&st, "s-stage", "0/1", "0", "1", "10", "127.0.0.1:0", stage0);
  char *whole[] = {"--servers", st.addr, "--model", MODEL, NULL};
  memcpy(args + nb, whole, sizeof whole);
  cluster_expect_exit(&C, args, 1, "this server holds stage 0/2's parameters; the worker trains a whole replica");
  char lists[200];
  snprintf(lists, sizeof lists, "%s;%s", s.addr, s.addr);
  char *group[] = {"group", "--stages", "2", "--sync", "ps", "--servers", lists, "--cluster-key", C.key, "--identity",
                   wkey, "--threads", "1", "--no-eval", "--seed", SEED, "--max-steps", "10", "--model", MODEL, NULL};
  cluster_expect_exit(&C, group, 1, "this server holds the whole model's parameters; the worker is stage");
  kill(st.pid, SIGTERM);
  expect_exit_0(&st, "stage server", 20);
  /* A worker with another cluster's key never gets in. */
  char other_key[256];
  snprintf(other_key, sizeof other_key, "%s/other.key", C.dir);
  cluster_sh("%s keygen --cluster -o %s >/dev/null 2>&1", RUMOR_BIN, other_key);
  char *outsider[] = {"peer", "--sync", "ps", "--cluster-key", other_key, "--identity", wkey, "--threads", "1",
                      "--servers", s.addr, "--model", MODEL, "--max-steps", "10", NULL};
  cluster_expect_exit(&C, outsider, 1, "refused the handshake");
  cr_assert_eq(kill(s.pid, 0), 0, "the server died");
  kill(s.pid, SIGTERM);
  expect_exit_0(&s, "server", 20);
  cr_assert(cluster_wait_file(s.log, "refusing", 1), "the server logged no refusal");
}
