/*
 * cluster.h — local clusters for integration tests: a scratch directory
 * with a cluster key, a bootstrap node and peers started as `rumor`
 * processes on 127.0.0.1 with ephemeral ports, each with its own identity,
 * stdout file (its JSON lines) and log file. Every process is registered with
 * proc.h so the suite's .fini can end them all.
 *
 * Header-only; include after proc.h and criterion.
 */
#ifndef RUMOR_TESTS_CLUSTER_H
#define RUMOR_TESTS_CLUSTER_H

#include <math.h>
#include <stdarg.h>
#include <time.h>

#include "proc.h"
#include "util/json_text.h"

#define CLUSTER_MAX 16

/* Membership timing compressed for tests. */
#define CLUSTER_PERIOD_MS 100
#define CLUSTER_PING_TIMEOUT_MS 60
#define CLUSTER_SUSPECT_MS 1000

struct cluster_node {
  pid_t pid;
  char id_file[256], out[256], log[256], ckpt[256];
  char addr[64]; /* advertised "127.0.0.1:PORT" */
  int exit_status;
};

struct cluster {
  const char *bin; /* the command nodes run: RUMOR_BIN, or RUMOR_TESTING_BIN for attacks */
  char dir[64];
  char key[256];
  char boot[64]; /* the bootstrap's address */
  int n;
  struct cluster_node node[CLUSTER_MAX];
};

static inline void cluster_sh(const char *fmt, ...) {
  char cmd[2048];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(cmd, sizeof cmd, fmt, ap);
  va_end(ap);
  cr_assert_eq(system(cmd), 0, "command failed: %s", cmd);
}

static inline void cluster_init(struct cluster *c) {
  memset(c, 0, sizeof *c);
  snprintf(c->dir, sizeof c->dir, "/tmp/rumor-test-cluster-XXXXXX");
  cr_assert_not_null(mkdtemp(c->dir));
  snprintf(c->key, sizeof c->key, "%s/cluster.key", c->dir);
  /* Known before a node starts, so its own arguments can name it. */
  for (int i = 0; i < CLUSTER_MAX; i++)
    snprintf(c->node[i].ckpt, sizeof c->node[i].ckpt, "%s/node%d.safetensors", c->dir, i);
  cluster_sh("%s keygen --cluster -o %s >/dev/null 2>&1", RUMOR_BIN, c->key);
  c->bin = RUMOR_BIN;
}

/* Ends every process and removes the scratch directory, unless `keep` or
 * RUMOR_KEEP_LOGS is set in the environment (then its path is printed). */
static inline void cluster_fini(struct cluster *c, bool keep) {
  proc_kill_all();
  if (!c->dir[0]) return;
  if (keep || getenv("RUMOR_KEEP_LOGS")) {
    fprintf(stderr, "cluster logs kept in %s\n", c->dir);
    return;
  }
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", c->dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", c->dir);
}

static inline double cluster_now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (double)t.tv_sec + (double)t.tv_nsec * 1e-9;
}

/* ---- waiting for conditions ------------------------------------------------------
 * A test waits for what it needs, never for a fixed time: `ready(arg)` is
 * asked about every 50 ms until it says yes or `secs` pass. Returns
 * whether it said yes (it is asked once more at the deadline). */
typedef bool (*cluster_cond_fn)(void *arg);
static inline bool cluster_poll(cluster_cond_fn ready, void *arg, double secs) {
  double t0 = cluster_now();
  for (;;) {
    bool late = cluster_now() - t0 >= secs;
    if (ready(arg)) return true;
    if (late) return false;
    usleep(50000);
  }
}

struct cluster_file_has {
  const char *path, *needle;
};
static inline bool cluster_file_has_cond(void *arg) {
  const struct cluster_file_has *f = arg;
  char *s = proc_slurp(f->path);
  bool found = strstr(s, f->needle) != NULL;
  free(s);
  return found;
}

/* Waits until `path` contains `needle`; returns true when it does. */
static inline bool cluster_wait_file(const char *path, const char *needle, double secs) {
  struct cluster_file_has f = {path, needle};
  return cluster_poll(cluster_file_has_cond, &f, secs);
}

/* The state letter of process `pid` (/proc/PID/stat: R, S, D, T for
 * stopped, Z for a zombie...), or 0 when there is no such process. */
static inline char cluster_proc_state(pid_t pid) {
  char path[64], st[512] = "";
  snprintf(path, sizeof path, "/proc/%d/stat", (int)pid);
  FILE *f = fopen(path, "r");
  if (!f) return 0;
  size_t n = fread(st, 1, sizeof st - 1, f);
  fclose(f);
  st[n] = '\0';
  const char *close = strrchr(st, ')'); /* the name may hold spaces */
  return close && close[1] == ' ' ? close[2] : 0;
}

/* Whether node i's process still runs (stopped counts; exited, zombie or
 * reaped does not). Reaps nothing, so cluster_wait still gets its status. */
static inline bool cluster_alive(const struct cluster *c, int i) {
  char s = cluster_proc_state(c->node[i].pid);
  return s && s != 'Z' && s != 'X';
}

/* Whether node i's process is stopped (SIGSTOP: state T). */
static inline bool cluster_stopped(const struct cluster *c, int i) {
  char s = cluster_proc_state(c->node[i].pid);
  return s == 'T' || s == 't';
}

static inline bool cluster_log_has(const struct cluster *c, int i, const char *needle) {
  char *s = proc_slurp(c->node[i].log);
  bool found = strstr(s, needle) != NULL;
  free(s);
  return found;
}

/* The metrics port node i announced on stdout ("metrics_port":N; it was
 * started with --metrics 127.0.0.1:0). */
static inline int cluster_metrics_port(const struct cluster *c, int i) {
  char *out = proc_slurp(c->node[i].out);
  const char *p = strstr(out, "\"metrics_port\":");
  int port = p ? atoi(p + STR_LEN("\"metrics_port\":")) : 0;
  cr_assert_gt(port, 0, "node %d announced no metrics port: %s", i, out);
  free(out);
  return port;
}

/* Adds node i: its output and log paths and a new identity. Returns i. */
static inline int cluster_new_node(struct cluster *c) {
  cr_assert_lt(c->n, CLUSTER_MAX);
  int i = c->n++;
  struct cluster_node *nd = &c->node[i];
  char dir[sizeof c->dir];
  memcpy(dir, c->dir, sizeof dir);
  snprintf(nd->id_file, sizeof nd->id_file, "%s/id%d.key", dir, i);
  snprintf(nd->out, sizeof nd->out, "%s/node%d.out", dir, i);
  snprintf(nd->log, sizeof nd->log, "%s/node%d.log", dir, i);
  cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, nd->id_file);
  return i;
}

/* Runs argv (NULL-terminated) as node i and waits for its {"listen": ...}
 * line, whose address goes to node i's addr; `what` names the node in a
 * failure. */
static inline void cluster_start_node(struct cluster *c, int i, char *const *argv, const char *what) {
  struct cluster_node *nd = &c->node[i];
  nd->pid = proc_spawn(argv, nd->out, nd->log);
  cr_assert_gt(nd->pid, 0);
  cr_assert(cluster_wait_file(nd->out, "\"listen\":", 60), "node %d (%s) did not start: %s", i, what,
            proc_slurp(nd->log));
  char *out = proc_slurp(nd->out);
  const char *p = strstr(out, "\"listen\":\"") + STR_LEN("\"listen\":\"");
  const char *q = strchr(p, '"');
  snprintf(nd->addr, sizeof nd->addr, "%.*s", (int)(q - p), p);
  free(out);
}

/* Starts `rumor <cmd> <args...> NULL` as node i (a new identity) and waits
 * for its {"listen": ...} line. Returns the node index. */
static inline int cluster_spawn(struct cluster *c, const char *cmd, char *const *args) {
  int i = cluster_new_node(c);
  struct cluster_node *nd = &c->node[i];
  char period[16], ping[16], suspect[16];
  snprintf(period, sizeof period, "%d", CLUSTER_PERIOD_MS);
  snprintf(ping, sizeof ping, "%d", CLUSTER_PING_TIMEOUT_MS);
  snprintf(suspect, sizeof suspect, "%d", CLUSTER_SUSPECT_MS);
  char *argv[96];
  int n = 0;
  argv[n++] = (char *)c->bin;
  argv[n++] = (char *)cmd;
  argv[n++] = "--listen";
  argv[n++] = "127.0.0.1:0";
  argv[n++] = "--cluster-key";
  argv[n++] = c->key;
  argv[n++] = "--identity";
  argv[n++] = nd->id_file;
  argv[n++] = "--period-ms";
  argv[n++] = period;
  argv[n++] = "--ping-timeout-ms";
  argv[n++] = ping;
  argv[n++] = "--suspect-ms";
  argv[n++] = suspect;
  for (int k = 0; args && args[k] && n < 94; k++) argv[n++] = args[k];
  argv[n] = NULL;
  cluster_start_node(c, i, argv, cmd);
  return i;
}

/* The bootstrap node; `args` (NULL-terminated, may be NULL) are extra
 * options, e.g. the same timing as the peers'. */
static inline void cluster_start_bootstrap(struct cluster *c, char *const *args) {
  int i = cluster_spawn(c, "bootstrap", args);
  snprintf(c->boot, sizeof c->boot, "%s", c->node[i].addr);
}

/* A peer joining through the bootstrap, with the given extra arguments
 * (NULL-terminated). Its checkpoint path is available as node[i].ckpt. */
static inline int cluster_start_peer(struct cluster *c, ...) {
  char *args[64];
  int n = 0;
  args[n++] = "--bootstrap";
  args[n++] = c->boot;
  args[n++] = "--threads";
  args[n++] = "1";
  args[n++] = "--log-every";
  args[n++] = "1";
  va_list ap;
  va_start(ap, c);
  for (char *a; n < 62 && (a = va_arg(ap, char *)) != NULL;) args[n++] = a;
  va_end(ap);
  args[n] = NULL;
  return cluster_spawn(c, "peer", args);
}

/* A model-parallel group started with `rumor group` (its launcher). */
struct cluster_group {
  pid_t pid;
  char out[256], log[256];
};

/* Starts `<c->bin> group --group NAME ... args` (a new identity, the
 * cluster's key and fast membership timing, one thread per stage), stdout
 * and stderr to files in the scratch directory. */
static inline void cluster_start_group(struct cluster *c, struct cluster_group *g, const char *name, char *const *args) {
  snprintf(g->out, sizeof g->out, "%s/%s.out", c->dir, name);
  snprintf(g->log, sizeof g->log, "%s/%s.log", c->dir, name);
  char id[256];
  snprintf(id, sizeof id, "%s/%s.key", c->dir, name);
  cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, id);
  char *argv[96] = {(char *)c->bin, "group", "--group", (char *)name, "--cluster-key", c->key, "--identity", id,
                    "--period-ms", "100", "--ping-timeout-ms", "60", "--suspect-ms", "1000", "--threads", "1",
                    "--log-every", "1"};
  int n = 18;
  for (int i = 0; args[i] && n < 95; i++) argv[n++] = args[i];
  argv[n] = NULL;
  g->pid = proc_spawn(argv, g->out, g->log);
  cr_assert_gt(g->pid, 0);
}

/* A text of `chars` letters and spaces from a fixed generator, for a
 * byte-level GPT (any text works; this one needs no package), written to
 * DIR/text.txt. Returns its path (a static buffer). */
static inline const char *cluster_make_text(const struct cluster *c, int chars) {
  static char path[256];
  snprintf(path, sizeof path, "%s/text.txt", c->dir);
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  uint64_t x = 88172645463325252ull;
  for (int i = 0; i < chars; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    fputc(x % 7 == 0 ? ' ' : 'a' + (int)(x % 23), f);
  }
  fclose(f);
  return path;
}

/* A fresh identity key DIR/NAME.key; its path into `path`. */
static inline void cluster_make_identity(const struct cluster *c, const char *name, char *path, size_t n) {
  snprintf(path, n, "%s/%s.key", c->dir, name);
  cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, path);
}

/* `rumor top --web SPEC --interval 0.5` on the cluster (SPEC binding
 * 127.0.0.1: "0" or "127.0.0.1:0"), with a new identity; its stdout and stderr go to DIR/NAME.out and DIR/NAME.err (the
 * latter's path into err, n bytes). Waits for the URL it prints. Returns
 * its PID (registered with proc.h, so the suite's .fini ends it) and sets
 * *port. */
static inline pid_t cluster_start_top_web(struct cluster *c, const char *name, const char *spec, char *err, size_t n,
                                          int *port) {
  char id[300], out[300];
  cluster_make_identity(c, name, id, sizeof id);
  snprintf(out, sizeof out, "%s/%s.out", c->dir, name);
  snprintf(err, n, "%s/%s.err", c->dir, name);
  char *argv[] = {RUMOR_BIN, "top", "--bootstrap", c->boot, "--cluster-key", c->key, "--identity", id,
                  "--web", (char *)spec, "--interval", "0.5", NULL};
  pid_t pid = proc_spawn(argv, out, err);
  cr_assert_gt(pid, 0);
  cr_assert(cluster_wait_file(err, "web view at http://127.0.0.1:", 30), "top printed no URL: %s", proc_slurp(err));
  char *text = proc_slurp(err);
  *port = atoi(strstr(text, "http://127.0.0.1:") + 17);
  cr_assert_gt(*port, 0, "no port in: %s", text);
  free(text);
  return pid;
}

/* One stage of group `group` as its own process, as a scheduler runs it:
 * `<c->bin> peer --group GROUP --stage STAGE` on mlp:784-32-16-10 (20
 * steps, no evaluation, one thread) with identity `id`, dialling `prev`
 * (NULL for stage 0), plus `extra` options (NULL-terminated; may be NULL).
 * stdout and stderr go to DIR/TAG.out and DIR/TAG.log, whose paths are
 * written into `out` and `log` (256 bytes each). */
static inline pid_t cluster_start_stage_proc(struct cluster *c, const char *group, const char *tag, const char *id,
                                             const char *stage, const char *prev, char *const *extra, char *out,
                                             char *log) {
  snprintf(out, 256, "%s/%s.out", c->dir, tag);
  snprintf(log, 256, "%s/%s.log", c->dir, tag);
  char *argv[64] = {(char *)c->bin, "peer", "--group", (char *)group, "--stage", (char *)stage, "--cluster-key",
                    c->key, "--identity", (char *)id, "--model", "mlp:784-32-16-10", "--max-steps", "20",
                    "--no-eval", "--threads", "1", "--link-wait-ms", "20000"};
  int n = 19;
  if (prev) argv[n++] = "--link-prev", argv[n++] = (char *)prev;
  for (int i = 0; extra && extra[i] && n < 63; i++) argv[n++] = extra[i];
  argv[n] = NULL;
  pid_t pid = proc_spawn(argv, out, log);
  cr_assert_gt(pid, 0);
  return pid;
}

/* The link address ("link":"HOST:PORT") a stage prints on stdout, waited
 * for up to 60 s. */
static inline void cluster_link_addr(const char *out, char *addr, size_t n) {
  cr_assert(cluster_wait_file(out, "\"link\":\"127", 60), "the stage printed no link address: %s", proc_slurp(out));
  char *s = proc_slurp(out);
  const char *p = strstr(s, "\"link\":\"") + 8;
  snprintf(addr, n, "%.*s", (int)(strchr(p, '"') - p), p);
  free(s);
}

/* Runs `rumor ARGS...` (RUMOR_BIN; NULL-terminated, at most 94 arguments)
 * to completion in the scratch directory, at most `secs`; returns the wait
 * status, with stdout and stderr in *out and *err (the caller frees them). */
static inline int cluster_run(const struct cluster *c, char *const *args, double secs, char **out, char **err) {
  char *argv[96];
  int n = 0;
  argv[n++] = RUMOR_BIN;
  for (int i = 0; args[i] && n < 95; i++) argv[n++] = args[i];
  argv[n] = NULL;
  return proc_run(argv, secs, c->dir, out, err);
}

/* Runs `rumor ARGS...` as cluster_run does and asserts that it exits with
 * `code` and that its stderr contains `needle`. */
static inline void cluster_expect_exit(const struct cluster *c, char *const *args, int code, const char *needle) {
  char *out, *err;
  int st = cluster_run(c, args, 60, &out, &err);
  cr_assert(st >= 0 && WIFEXITED(st), "%s: did not exit normally (status %d): %s", args[0], st, err);
  cr_assert_eq(WEXITSTATUS(st), code, "exit %d, want %d: %s", WEXITSTATUS(st), code, err);
  cr_assert(strstr(err, needle) != NULL, "stderr should mention '%s': %s", needle, err);
  free(out), free(err);
}

/* A number from the last line of `path` that contains `has`, or NAN. */
static inline double cluster_line_number(const char *path, const char *has, const char *key) {
  char *s = proc_slurp(path), pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  double v = NAN;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
    const char *p = strstr(line, pat);
    if (strstr(line, has) && p) v = strtod(p + strlen(pat), NULL);
  }
  free(s);
  return v;
}

/* Two bootstrap nodes, one per stage of two-stage groups: "B0;B1". */
static inline void cluster_start_stage_bootstraps(struct cluster *c, char *list, size_t n) {
  int b0 = cluster_spawn(c, "bootstrap", NULL), b1 = cluster_spawn(c, "bootstrap", NULL);
  snprintf(list, n, "%s;%s", c->node[b0].addr, c->node[b1].addr);
}

/* Waits for node i to exit (at most `secs`); returns its wait status or -1. */
static inline int cluster_wait(struct cluster *c, int i, double secs) {
  c->node[i].exit_status = proc_wait(c->node[i].pid, secs);
  return c->node[i].exit_status;
}

/* A number from node i's last JSON result line on stdout, or NAN. */
static inline double cluster_result(const struct cluster *c, int i, const char *key) {
  char *out = proc_slurp(c->node[i].out);
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = strstr(out, "\"test_accuracy\"") ? strstr(out, pat) : NULL;
  double v = p ? strtod(p + strlen(pat), NULL) : NAN;
  free(out);
  return v;
}

/* The numbers of array `key` in node i's last JSON result line (one with
 * "test_accuracy"), at most `max`; returns how many (0 without a result). */
static inline int cluster_result_array(const struct cluster *c, int i, const char *key, double *out, int max) {
  char *s = proc_slurp(c->node[i].out), *last = NULL;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    if (strstr(line, "\"test_accuracy\"")) last = line;
  int n = 0;
  json_t *doc;
  if (last && json_text_parse(last, strlen(last), &doc, NULL) == 0) {
    const json_t *a = json_object_get(doc, key);
    for (size_t k = 0; k < json_array_size(a) && n < max; k++) /* 0 unless an array */
      if (json_is_number(json_array_get(a, k))) out[n++] = json_number_value(json_array_get(a, k));
    json_decref(doc);
  }
  free(s);
  return n;
}

/* The train losses of node i's "epoch k done ... train loss X" log lines,
 * at most `max`; returns how many. For nodes stopped before their result
 * line; a finished node's figures are cluster_result_array(.., "train_losses"). */
static inline int cluster_epoch_losses(const struct cluster *c, int i, double *out, int max) {
  char *s = proc_slurp(c->node[i].log);
  int n = 0;
  for (char *line = strtok(s, "\n"); line && n < max; line = strtok(NULL, "\n")) {
    const char *p = strstr(line, "train loss ");
    if (strstr(line, " done at step ") && p) out[n++] = strtod(p + STR_LEN("train loss "), NULL);
  }
  free(s);
  return n;
}

/* Milliseconds since midnight of a log line's "HH:MM:SS.mmm" stamp. */
static inline long cluster_log_ms(const char *line) {
  int h, m, s, ms;
  if (sscanf(line, "%d:%d:%d.%d", &h, &m, &s, &ms) != 4) return -1;
  return ((h * 60L + m) * 60L + s) * 1000L + ms;
}

static inline long cluster_wall_ms_of_day(void) {
  struct timespec t;
  clock_gettime(CLOCK_REALTIME, &t);
  struct tm tm;
  localtime_r(&t.tv_sec, &tm);
  return ((tm.tm_hour * 60L + tm.tm_min) * 60L + tm.tm_sec) * 1000L + t.tv_nsec / 1000000;
}

/* The log stamp (ms of day) of node i's first line containing both `a` and
 * `b`, or -1. */
static inline long cluster_log_first(const struct cluster *c, int i, const char *a, const char *b) {
  char *s = proc_slurp(c->node[i].log);
  long at = -1;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    if (strstr(line, a) && (!b || strstr(line, b))) {
      at = cluster_log_ms(line);
      break;
    }
  free(s);
  return at;
}

struct cluster_log_line {
  const struct cluster *c;
  int i;
  const char *a, *b;
};
static inline bool cluster_log_line_cond(void *arg) {
  const struct cluster_log_line *l = arg;
  return cluster_log_first(l->c, l->i, l->a, l->b) >= 0;
}

/* Waits until one line of node i's log contains both `a` and `b` (b may be
 * NULL); returns whether one did within `secs`. */
static inline bool cluster_wait_log_line(const struct cluster *c, int i, const char *a, const char *b, double secs) {
  struct cluster_log_line l = {c, i, a, b};
  return cluster_poll(cluster_log_line_cond, &l, secs);
}

#endif /* RUMOR_TESTS_CLUSTER_H */
