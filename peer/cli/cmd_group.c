/* `rumor group`: starts the S stage processes of one model-parallel peer
 * group on this host (each a `rumor peer --group G --stage s/S` child),
 * passes their output through, and stops the group when one of them ends
 * badly. */
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

#define LINE_MAX_BYTES 65536
#define NOTICE_S 3.0 /* after a stage failed, the others get this long to notice on their own */
#define GRACE_S 20.0 /* after SIGTERM, stages get this long before SIGKILL */
/* Processes of one group: S stages, or D data-parallel members of one stage. */
#define GROUP_MAX_MEMBERS (PIPE_MAX_STAGES > COMM_MAX_MEMBERS ? PIPE_MAX_STAGES : COMM_MAX_MEMBERS)

struct child {
  int stage;
  pid_t pid;
  int fd; /* read end of its stdout, −1 once closed */
  char *buf;
  size_t len;
  char link[128]; /* its link address, once it printed it */
  char comm[128]; /* its data-parallel address, once it printed it */
  bool exited;
  int status;
  bool signalled; /* the launcher sent it a signal */
  int failed_stage; /* −1, or the culprit it reported */
  int64_t failed_at_us; /* when it failed (wall clock, its line's failed_at_us), with failed_stage */
  char error[512];
  char result[LINE_MAX_BYTES]; /* its result line (with "steps") */
};

struct group {
  struct group_flags f;
  int S, D, T;
  int P; /* --expert-parallel: D counts every data-parallel member, D / P runs of P that split the experts */
  int N; /* processes: S stages (T = D = 1), T x D (S = 1), or S x D or S x T (S > 1): kids[i] is stage i;
            process i (data-parallel member i / T, tensor-parallel rank i % T); or process i of stage i / N,
            its data-parallel member or tensor-parallel rank i % N (N = D or T). A failure line's failed_stage
            names one of them */
  char name[STAGE_LINK_GROUP_MAX + 1];
  char devices[GROUP_MAX_MEMBERS][32]; /* kids[i]'s */
  bool averages; /* its processes average with other groups (stages always; data- or tensor-parallel processes
                    with --bootstrap or --listen) */
  char bootstrap[GROUP_MAX_MEMBERS][1024]; /* --bootstrap's list for each stage, or each data- or tensor-parallel
                                              process */
  char servers[PIPE_MAX_STAGES][1024];   /* --servers' list for each stage (--sync ps) */
  struct child kids[GROUP_MAX_MEMBERS];
  int nkids;
};

/* "stage", "member" or "process": what kids[i] is, for messages ("stage 1/2", "member 0/3", "process 3/4"). */
static const char *what(const struct group *g) {
  return g->S == 1 && g->N > 1 ? "member" : g->N > g->S ? "process" : "stage";
}

/* Data-parallel members, tensor-parallel ranks or both inside pipeline
 * stages (S x D x T processes). */
static bool in_stages(const struct group *g) { return g->S > 1 && g->N > g->S; }
/* Processes per stage: D x T. */
static int per_stage(const struct group *g) { return g->D * g->T; }

/* kids[i]'s stage, and its place r in the stage (S x N: process i = stage x N + r; its data-parallel member or
 * tensor-parallel rank) or, in a group of one stage, its data-parallel member. */
static int kid_stage(const struct group *g, int i) { return in_stages(g) ? i / per_stage(g) : g->S > 1 ? i : 0; }
static int kid_member(const struct group *g, int i) {
  return in_stages(g) ? i % per_stage(g) : g->S > 1 ? 0 : i / g->T;
}

/* kids[i] for messages: "stage 1/2", "member 0/3", or "process 3/4 (stage 1/2, data-parallel member 1/2)". */
static void kid_name(const struct group *g, int i, char *buf, size_t n) {
  if (in_stages(g) && g->D > 1 && g->T > 1)
    snprintf(buf, n, "process %d/%d (stage %d/%d, data-parallel member %d/%d, tensor-parallel rank %d/%d)", i, g->N,
             kid_stage(g, i), g->S, kid_member(g, i) / g->T, g->D, kid_member(g, i) % g->T, g->T);
  else if (in_stages(g))
    snprintf(buf, n, "process %d/%d (stage %d/%d, %s %d/%d)", i, g->N, kid_stage(g, i), g->S,
             g->T > 1 ? "tensor-parallel rank" : "data-parallel member", kid_member(g, i), per_stage(g));
  else
    snprintf(buf, n, "%s %d/%d", what(g), i, g->N);
}

/* ---- command lines of the stages ---- */

/* "host:port" with port + s (unchanged when port is 0). */
static int offset_addr(const char *flag, const char *addr, int s, char *out, size_t n, struct rumor_err *e) {
  char host[NET_HOST_MAX];
  int port;
  if (net_addr_parse(addr, 0, host, sizeof host, &port, e)) return rumor_err_prefix(e, "--%s", flag);
  if (port != 0 && port + s > 65535)
    return rumor_err_set(e, RUMOR_EFORMAT, "--%s '%s': port + %d is past 65535", flag, addr, s);
  snprintf(out, n, strchr(host, ':') ? "[%s]:%d" : "%s:%d", host, port ? port + s : 0);
  return 0;
}

static int split_list(const char *flag, const char *list, char sep, char (*out)[32], int want, bool one_ok,
                      struct rumor_err *e) {
  int n = 0;
  for (const char *p = list; n <= want;) {
    const char *q = strchr(p, sep);
    size_t len = q ? (size_t)(q - p) : strlen(p);
    if (len == 0 || len >= 32) return rumor_err_set(e, RUMOR_EFORMAT, "--%s '%s': empty or too long entry", flag, list);
    if (n < want) snprintf(out[n], 32, "%.*s", (int)len, p);
    n++;
    if (!q) break;
    p = q + 1;
  }
  if (n == 1 && one_ok) {
    for (int i = 1; i < want; i++) memcpy(out[i], out[0], 32);
    return 0;
  }
  if (n != want)
    return rumor_err_set(e, RUMOR_EFORMAT, "--%s '%s' names %d entr%s for %d stages", flag, list, n,
                         n == 1 ? "y" : "ies", want);
  return 0;
}

/* Splits `value` of --flag into one list per stage, separated by ';', and
 * checks every address in them (net_addr_list_check). Returns 0, or
 * RUMOR_EFORMAT naming the flag when there are not S lists, one is too
 * long, or an entry is bad (`why`: what a stage's list is for). */
/* `noun`: what each list is for ("stage" or "process"). */
static int stage_lists(const char *flag, const char *value, int S, const char *noun, char (*out)[1024],
                       const char *why, struct rumor_err *e) {
  const char *nouns = strcmp(noun, "process") == 0 ? "processes" : "stages";
  int n = 0;
  for (const char *p = value;; n++) {
    const char *q = strchr(p, ';');
    size_t len = q ? (size_t)(q - p) : strlen(p);
    if (n < S) {
      if (len >= 1024) return rumor_err_set(e, RUMOR_EFORMAT, "--%s: list %d is too long", flag, n);
      snprintf(out[n], 1024, "%.*s", (int)len, p);
    }
    if (!q) break;
    p = q + 1;
  }
  n++;
  if (n != S)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--%s '%s' has %d list%s for %d %s: give one address list per %s, separated by ';' "
                         "(%s)",
                         flag, value, n, n == 1 ? "" : "s", S, nouns, noun, why);
  for (int s = 0; s < S; s++)
    if (net_addr_list_check(out[s], e)) return rumor_err_prefix(e, "--%s: %s %d's list", flag, noun, s);
  return 0;
}

/* Options the launcher sets per stage itself rather than passing on. */
static bool launcher_only(const char *name) {
  static const char *const own[] = {"stages",    "devices", "listen", "advertise", "metrics", "bootstrap",
                                    "servers",   "name",    "group",  "threads",   "data-parallel",
                                    "tensor-parallel"};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++)
    if (strcmp(name, own[i]) == 0) return true;
  return false;
}

static const struct arg_spec *find_spec(const struct arg_spec *specs, const char *name, size_t len) {
  for (const struct arg_spec *s = specs; s->name; s++)
    if (strlen(s->name) == len && strncmp(s->name, name, len) == 0) return s;
  return NULL;
}

#define ARGV_MAX 256

static void free_argv(char **argv);

static void push(char **argv, int *n, const char *s) {
  RUMOR_ASSERT(*n < ARGV_MAX - 1);
  argv[(*n)++] = xstrdup(s);
}

/* The stage's argv (malloc'd strings; free with free_argv). */
static int stage_argv(struct group *g, const struct arg_spec *specs, int argc, char **argv, int k, char **out,
                      struct rumor_err *e) {
  bool members = g->S == 1 && g->N > 1, staged = in_stages(g);
  /* Its data-parallel member and tensor-parallel rank: process k is member
   * k / T, rank k % T of the group, or of its stage (index k mod D x T). */
  int n = 0, s = kid_stage(g, k), d = staged ? kid_member(g, k) / g->T : kid_member(g, k);
  int tr = staged ? kid_member(g, k) % g->T : members ? k % g->T : 0;
  char buf[1100];
  push(out, &n, "rumor");
  push(out, &n, "peer");
  push(out, &n, "--group");
  push(out, &n, g->name);
  snprintf(buf, sizeof buf, "%d/%d", s, g->S);
  push(out, &n, "--stage");
  push(out, &n, buf);
  push(out, &n, "--device");
  push(out, &n, g->devices[k]);
  push(out, &n, "--link-listen");
  push(out, &n, "127.0.0.1:0");
  if (s > 0) { /* member d of the previous stage (a stage of its own without members) */
    push(out, &n, "--link-prev");
    push(out, &n, g->kids[staged ? k - per_stage(g) : s - 1].link);
  }
  if (members || staged) {
    if (g->D > 1) {
      snprintf(buf, sizeof buf, "%d/%d", d, g->D);
      push(out, &n, "--dp");
      push(out, &n, buf);
    }
    if (g->P > 1) {
      snprintf(buf, sizeof buf, "%d", g->P);
      push(out, &n, "--expert-parallel");
      push(out, &n, buf);
    }
    if (g->T > 1) {
      snprintf(buf, sizeof buf, "%d/%d", tr, g->T);
      push(out, &n, "--tp");
      push(out, &n, buf);
    }
    push(out, &n, "--comm-listen");
    push(out, &n, "127.0.0.1:0");
    /* The communicator's processes before this one: the group's, or its stage's. */
    int first = staged ? s * per_stage(g) : 0;
    if (k > first) {
      size_t used = 0;
      for (int j = first; j < k; j++) used += strlen(g->kids[j].comm) + 1;
      char *list = xmalloc(used);
      list[0] = '\0';
      for (int j = first; j < k; j++) {
        if (j > first) strcat(list, ",");
        strcat(list, g->kids[j].comm);
      }
      push(out, &n, "--comm-peers");
      push(out, &n, list);
      free(list);
    }
  }
  push(out, &n, "--name");
  push(out, &n, g->f.gossip.name ? g->f.gossip.name : g->name);
  const char *addr_flags[] = {"listen", "advertise", "metrics"};
  const char *addr_vals[] = {g->f.net.listen, g->f.net.advertise, g->f.net.metrics};
  int slot = members || staged ? k : s; /* stage s, or process k, listens on port + slot */
  for (int i = 0; g->averages && i < 3; i++) {
    if (!addr_vals[i]) continue;
    int rc = offset_addr(addr_flags[i], addr_vals[i], slot, buf, sizeof buf, e);
    if (rc) { /* prepare() checked the last stage's port already */
      out[n] = NULL;
      free_argv(out);
      return rc;
    }
    char flag[32];
    snprintf(flag, sizeof flag, "--%s", addr_flags[i]);
    push(out, &n, flag);
    push(out, &n, buf);
  }
  if (g->f.train.threads > 0) {
    snprintf(buf, sizeof buf, "%lld", (long long)g->f.train.threads);
    push(out, &n, "--threads");
    push(out, &n, buf);
  } else {
    /* Stages on one host share its cores. */
    long cores = sysconf(_SC_NPROCESSORS_ONLN);
    snprintf(buf, sizeof buf, "%ld", cores / g->N > 1 ? cores / g->N : 1);
    push(out, &n, "--threads");
    push(out, &n, buf);
  }
  if (g->f.net.bootstrap) {
    push(out, &n, "--bootstrap");
    push(out, &n, g->bootstrap[slot]);
  }
  if (g->f.gossip.servers) {
    push(out, &n, "--servers");
    push(out, &n, g->servers[s]);
  }
  for (int i = 1; i < argc; i++) {
    const char *a = argv[i];
    const char *name = a + STR_LEN("--"), *eq = strchr(name, '=');
    size_t len = eq ? (size_t)(eq - name) : strlen(name);
    const struct arg_spec *sp = find_spec(specs, name, len);
    RUMOR_ASSERT(sp); /* args_parse accepted the command line */
    bool has_value = sp->type != ARG_FLAG && !eq;
    if (!launcher_only(sp->name)) {
      push(out, &n, a);
      if (has_value) push(out, &n, argv[i + 1]);
    }
    if (has_value) i++;
  }
  out[n] = NULL;
  return 0;
}

static void free_argv(char **argv) {
  for (int i = 0; argv[i]; i++) free(argv[i]);
}

/* ---- children ---- */

static pid_t spawn(char **argv, int *out_fd) {
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return -1;
  pid_t parent = getpid();
  pid_t pid = fork();
  if (pid < 0) {
    close(fds[0]);
    close(fds[1]);
    return -1;
  }
  if (pid == 0) {
    /* A stage must not outlive its launcher. */
    prctl(PR_SET_PDEATHSIG, SIGTERM);
    if (getppid() != parent) _exit(1);
    if (dup2(fds[1], STDOUT_FILENO) < 0) _exit(126);
    execv("/proc/self/exe", argv);
    _exit(127);
  }
  close(fds[1]);
  *out_fd = fds[0];
  return pid;
}

/* Handles one line of a stage's stdout: passes it on and notes what the
 * launcher needs from it. */
static void child_line(struct child *k, const char *line, size_t len) {
  fwrite(line, 1, len, stdout);
  fputc('\n', stdout);
  fflush(stdout);
  json_t *doc;
  if (len == 0 || line[0] != '{' || json_text_parse(line, len, &doc, NULL) != 0) return;
  const char *link = json_string_value(json_object_get(doc, "link")); /* NULL unless a string */
  if (link) snprintf(k->link, sizeof k->link, "%s", link);
  const char *comm = json_string_value(json_object_get(doc, "comm"));
  if (comm) snprintf(k->comm, sizeof k->comm, "%s", comm);
  bool on_signal = json_is_true(json_object_get(doc, "stopped"));
  const json_t *failed = json_object_get(doc, "failed_stage");
  if (json_is_integer(failed) && !on_signal) {
    /* A stage that failed, or saw which stage failed (not one we stopped). */
    k->failed_stage = (int)json_integer_value(failed);
    const json_t *at = json_object_get(doc, "failed_at_us");
    k->failed_at_us = json_is_integer(at) ? (int64_t)json_integer_value(at) : clock_wall_us();
    const char *why = json_string_value(json_object_get(doc, "error"));
    if (why) snprintf(k->error, sizeof k->error, "%s", why);
  }
  if (json_object_get(doc, "steps") && len < sizeof k->result) {
    memcpy(k->result, line, len);
    k->result[len] = '\0';
  }
  json_decref(doc);
}

/* Reads what is available from a stage's stdout. Returns false at EOF. */
static bool child_read(struct child *k) {
  char tmp[8192];
  ssize_t r = read(k->fd, tmp, sizeof tmp);
  if (r < 0 && (errno == EINTR || errno == EAGAIN)) return true;
  if (r <= 0) {
    if (k->len) child_line(k, k->buf, k->len);
    k->len = 0;
    close(k->fd);
    k->fd = -1;
    return false;
  }
  for (ssize_t i = 0; i < r; i++) {
    if (tmp[i] == '\n') {
      child_line(k, k->buf, k->len);
      k->len = 0;
    } else if (k->len < LINE_MAX_BYTES) {
      k->buf[k->len++] = tmp[i];
    }
  }
  return true;
}

static void reap(struct group *g) {
  for (int i = 0; i < g->nkids; i++) {
    struct child *k = &g->kids[i];
    if (k->exited) continue;
    int st;
    pid_t r = waitpid(k->pid, &st, WNOHANG);
    if (r != k->pid) continue;
    k->exited = true;
    k->status = st;
    char name[128];
    kid_name(g, i, name, sizeof name);
    if (WIFSIGNALED(st))
      log_error("group %s: %s (pid %d) was killed by signal %d (%s)", g->name, name, (int)k->pid, WTERMSIG(st),
                strsignal(WTERMSIG(st)));
    else if (WEXITSTATUS(st) != 0)
      log_warn("group %s: %s (pid %d) exited with status %d", g->name, name, (int)k->pid, WEXITSTATUS(st));
  }
}

/* Waits up to `secs` for poll events on the open stage outputs and reads
 * them. */
static void pump(struct group *g, int ms) {
  struct pollfd pf[GROUP_MAX_MEMBERS];
  int idx[GROUP_MAX_MEMBERS], n = 0;
  for (int i = 0; i < g->nkids; i++)
    if (g->kids[i].fd >= 0) pf[n] = (struct pollfd){.fd = g->kids[i].fd, .events = POLLIN}, idx[n++] = i;
  if (n == 0) {
    usleep((useconds_t)ms * 1000);
    return;
  }
  if (poll(pf, (nfds_t)n, ms) <= 0) return;
  for (int j = 0; j < n; j++)
    if (pf[j].revents) child_read(&g->kids[idx[j]]);
}

static void signal_all(struct group *g, int sig) {
  for (int i = 0; i < g->nkids; i++)
    if (!g->kids[i].exited) {
      kill(g->kids[i].pid, sig);
      g->kids[i].signalled = true;
    }
}

static bool child_bad(const struct child *k) { return k->exited && !(WIFEXITED(k->status) && WEXITSTATUS(k->status) == 0); }

/* ---- the command ---- */

static int prepare(struct group *g, const struct arg_spec *specs, struct rumor_err *e) {
  struct group_flags *f = &g->f;
  g->S = (int)f->pipe.stages;
  g->P = (int)f->pipe.expert_parallel;
  if (f->pipe.data_parallel * g->P > COMM_MAX_MEMBERS)
    return rumor_err_set(e, RUMOR_EFORMAT, "--data-parallel %lld x --expert-parallel %d is %lld processes, more than %d",
                         (long long)f->pipe.data_parallel, g->P, (long long)f->pipe.data_parallel * g->P,
                         COMM_MAX_MEMBERS);
  g->D = (int)f->pipe.data_parallel * g->P;
  g->T = (int)f->pipe.tensor_parallel;
  g->N = g->S * g->D * g->T;
  if (g->D * g->T > COMM_MAX_MEMBERS)
    return rumor_err_set(e, RUMOR_EFORMAT, "--data-parallel %d x --tensor-parallel %d is %d processes, more than %d",
                         g->D, g->T, g->D * g->T, COMM_MAX_MEMBERS);
  if (g->S * g->D * g->T > GROUP_MAX_MEMBERS)
    return rumor_err_set(e, RUMOR_EFORMAT, "--stages %d x %d processes per stage is %d processes, more than %d",
                         g->S, g->D * g->T, g->N, GROUP_MAX_MEMBERS);
  if (group_stage_dp_check(f, g->S, g->D, g->T, e)) return RUMOR_EFORMAT;
  bool members = g->S == 1 && g->N > 1;
  /* Stages always join their cluster; data- or tensor-parallel processes
   * only when told where to listen or whom to join, else the group trains
   * alone with no gossip runtime (and no gossip buffers). */
  g->averages = (!members && !in_stages(g)) || f->net.bootstrap || args_given(specs, "listen");
  if (!g->averages && f->net.metrics)
    return rumor_err_set(e, RUMOR_EFORMAT, "--metrics: a data- or tensor-parallel group that trains alone serves no "
                         "metrics%s", members ? "; give --listen or --bootstrap to average with other groups" : "");
  if (members && group_shard_check(f, g->D, g->T, g->averages, e)) return RUMOR_EFORMAT;
  /* Address lists and listening ports: one per stage, or per process (a
   * data- or tensor-parallel group's, or one with those in its stages). */
  bool per_process = members || in_stages(g);
  int slots = per_process ? g->N : g->S;
  const char *slot_noun = per_process ? "process" : "stage";
  if (g->D == 1 && f->pipe.zero)
    return rumor_err_set(e, RUMOR_EFORMAT, "--zero %lld needs --data-parallel D with D > 1", (long long)f->pipe.zero);
  if (f->pipe.group) snprintf(g->name, sizeof g->name, "%s", f->pipe.group);
  else snprintf(g->name, sizeof g->name, "group-%d", (int)getpid());
  f->pipe.group = g->name;
  struct train_config tc;
  struct train_stage st;
  struct stage_plan plan;
  int rc = group_flags_config(f, specs, 0, g->S, &tc, &st, &plan, e);
  if (rc) return rc;
  /* Devices: one per stage. */
  if (f->pipe.devices) {
    if ((rc = split_list("devices", f->pipe.devices, ',', g->devices, g->N, true, e))) return rc;
  } else {
    bool gpus = tensor_cuda_device_count() >= g->N;
    for (int i = 0; i < g->N; i++) snprintf(g->devices[i], sizeof g->devices[i], gpus ? "cuda:%d" : "cpu", i);
  }
  if (f->net.bootstrap &&
      (rc = stage_lists("bootstrap", f->net.bootstrap, slots, slot_noun, g->bootstrap,
                        per_process ? "process k joins process k of other groups"
                                    : "stage s joins stage s of other groups",
                        e)))
    return rc;
  if (f->gossip.servers &&
      (rc = stage_lists("servers", f->gossip.servers, g->S, "stage", g->servers,
                        "stage s talks to stage s's servers, rumor ps --stage s/S, in range order", e)))
    return rc;
  /* Stage s (process k) listens on port + s (k): the last one's port must exist. */
  const char *addr_flags[] = {"listen", "advertise", "metrics"};
  const char *addr_vals[] = {f->net.listen, f->net.advertise, f->net.metrics};
  for (int i = 0; i < 3; i++) {
    char buf[NET_HOST_MAX + 8];
    if (addr_vals[i] && (rc = offset_addr(addr_flags[i], addr_vals[i], slots - 1, buf, sizeof buf, e))) return rc;
  }
  /* Others dial the advertised addresses: no port 0, no 0.0.0.0. */
  if (f->net.advertise && (rc = gossip_advertise_check(f->net.advertise, e))) return rumor_err_prefix(e, "--advertise");
  /* ps workers, and groups that train alone, join no gossip cluster */
  bool member = g->averages && (!f->gossip.sync || strcmp(f->gossip.sync, "ps") != 0);
  if (member && !f->net.advertise && f->net.listen && (rc = gossip_listen_advertisable(f->net.listen, e))) return rc;
  /* Check the key files now rather than in S children. */
  struct net_keys keys;
  if ((rc = net_flags_load_keys(&f->net, &keys, e))) return rc;
  net_keys_free(&keys);
  char spec[MODEL_SPEC_MAX];
  model_spec_format(&plan.spec, spec, sizeof spec);
  if (g->T > 1 && (rc = model_tp_check(&plan.spec, g->T, e))) return rumor_err_prefix(e, "--tensor-parallel");
  if ((rc = group_ep_check(f, &plan.spec, g->S, g->D, g->T, tc.batch, e))) return rc;
  if (g->P > 1)
    log_info("group %s: the %d data-parallel members in runs of %d, each run splitting the %d experts of every "
             "mixture-of-experts block (members r with the same r / %d send each other their tokens)", g->name, g->D,
             g->P, plan.spec.u.gpt.experts, g->P);
  if (g->S == 1 && g->N > 1) {
    log_info("group %s: %s on %d data-parallel member%s (ZeRO %lld) of %d tensor-parallel rank%s, each member on its "
             "slice of every batch of %lld", g->name, spec, g->D, g->D == 1 ? "" : "s", (long long)f->pipe.zero, g->T,
             g->T == 1 ? "" : "s", (long long)tc.batch);
    for (int i = 0; i < g->N; i++)
      log_info("  member %d/%d (data-parallel %d/%d, tensor-parallel %d/%d) on %s", i, g->N, i / g->T, g->D, i % g->T,
               g->T, g->devices[i]);
    return 0;
  }
  log_info("group %s: %s in %d stages (balanced by parameters and multiply-adds), %lld micro-batches, %s schedule",
           g->name, spec, g->S, (long long)f->pipe.micro, pipe_schedule_name(st.sched));
  if (in_stages(g) && g->T > 1 && g->D > 1)
    log_info("  each stage: %d data-parallel members (ZeRO %lld) of %d tensor-parallel ranks, member r on its slice "
             "of every batch, rank t holding its slices of the stage's units; process k is stage k / %d, member "
             "k %% %d / %d, rank k %% %d; each linked to the same member and rank of the neighbouring stages", g->D,
             (long long)f->pipe.zero, g->T, g->D * g->T, g->D * g->T, g->T, g->T);
  else if (in_stages(g) && g->T > 1)
    log_info("  each stage: %d tensor-parallel ranks, rank t holding its slices of the stage's units, linked to "
             "rank t of the neighbouring stages; process k is stage k / %d, rank k %% %d", g->T, g->T, g->T);
  else if (in_stages(g))
    log_info("  each stage: %d data-parallel members (ZeRO %lld), member r on its slice of every batch of %lld, "
             "linked to member r of the neighbouring stages; process k is stage k / %d, member k %% %d", g->D,
             (long long)f->pipe.zero, (long long)tc.batch, g->D, g->D);
  for (int s = 0; s < g->S; s++) {
    char line[400];
    pipe_split_describe(&plan.spec, &plan.split, s, line, sizeof line);
    if (!in_stages(g)) {
      log_info("  %s on %s", line, g->devices[s]);
      continue;
    }
    log_info("  %s", line);
    for (int r = 0; r < per_stage(g); r++)
      log_info("    process %d: %s %d/%d on %s", s * per_stage(g) + r, g->T > 1 && g->D > 1 ? "member x rank"
               : g->T > 1 ? "rank" : "member", r, per_stage(g), g->devices[s * per_stage(g) + r]);
  }
  return 0;
}

/* Starts the processes in order; each but the first stage needs the
 * previous one's link address, each but the first member the addresses of
 * the members before it: they print them first thing. */
static int start_stages(struct group *g, const struct arg_spec *specs, int argc, char **argv, struct rumor_err *e) {
  for (int i = 0; i < g->N; i++) {
    struct child *k = &g->kids[i];
    k->stage = kid_stage(g, i);
    k->fd = -1;
    k->failed_stage = -1;
    k->buf = xmalloc(LINE_MAX_BYTES);
    char *cargv[ARGV_MAX];
    int rc = stage_argv(g, specs, argc, argv, i, cargv, e);
    if (rc) return rc;
    k->pid = spawn(cargv, &k->fd);
    free_argv(cargv);
    if (k->pid < 0) return rumor_err_set(e, -errno, "cannot start %s %d: %s", what(g), i, strerror(errno));
    g->nkids++;
    char name[128];
    kid_name(g, i, name, sizeof name);
    log_info("group %s: %s is pid %d", g->name, name, (int)k->pid);
    double deadline = clock_now_s() + (double)g->f.pipe.link_wait_ms / 1e3;
    /* What the later processes need of it: member r of stage s + 1 its
     * link; the later members of its communicator its comm address. */
    bool need_link = k->stage < g->S - 1;
    bool need_comm = in_stages(g) ? kid_member(g, i) < per_stage(g) - 1 : g->S == 1 && i < g->N - 1;
    while ((need_link && !k->link[0]) || (need_comm && !k->comm[0])) {
      if (signals_stop_requested())
        return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
      pump(g, 100);
      reap(g);
      if (k->exited || k->fd < 0) return rumor_err_set(e, RUMOR_ECANCELED, "%s ended before it was listening", name);
      if (clock_now_s() > deadline)
        return rumor_err_set(e, RUMOR_ETIMEDOUT, "%s printed no address within %lld ms", name,
                             (long long)g->f.pipe.link_wait_ms);
    }
  }
  return 0;
}

/* Runs until every stage has ended; returns the group's exit status. When
 * a stage fails, the others normally notice at once (the link tells them);
 * those that have not after NOTICE_S get SIGTERM (a stage that has not
 * connected yet cannot be told), and SIGKILL GRACE_S later. */
static int supervise(struct group *g) {
  double term_at = 0, kill_at = 0;
  bool stopping = false, failed = false;
  for (;;) {
    pump(g, 100);
    reap(g);
    double now = clock_now_s();
    if (signals_stop_requested() && !stopping) {
      stopping = true;
      log_info("group %s: signal %d, stopping the stages", g->name, signals_stop_requested());
      term_at = now;
    }
    /* Before the test below: stages that all failed at once still fail the group. */
    if (!failed && !stopping) /* a stage failing while we stop them is not the group failing */
      for (int i = 0; i < g->nkids; i++)
        if (child_bad(&g->kids[i])) {
          failed = true;
          if (!term_at) term_at = now + NOTICE_S;
        }
    bool all = true;
    for (int i = 0; i < g->nkids; i++) all = all && g->kids[i].exited;
    if (all) break;
    if (term_at && now >= term_at && !kill_at) {
      if (!stopping) log_warn("group %s: stopping the stages still running", g->name);
      signal_all(g, SIGTERM);
      kill_at = now + GRACE_S;
    }
    if (kill_at && now > kill_at) {
      log_warn("group %s: stages still running %.0f s after SIGTERM; killing them", g->name, GRACE_S);
      signal_all(g, SIGKILL);
      kill_at = now + 1e9;
    }
  }
  while (true) { /* the rest of their output */
    bool open = false;
    for (int i = 0; i < g->nkids; i++)
      if (g->kids[i].fd >= 0) open = true, child_read(&g->kids[i]);
    if (!open) break;
  }
  return failed ? 1 : 0;
}

/* Among the stages the failure lines blame, the one to report: blamed by
 * the most lines; then one that blamed itself (a stage whose neighbour
 * failed or left blames that neighbour, so a self-blame is a stage that
 * failed on its own); then the one that failed first. Returns −1 when no
 * line blames a stage of the group. */
static int most_blamed(const struct group *g) {
  int votes[GROUP_MAX_MEMBERS] = {0};
  for (int i = 0; i < g->nkids; i++)
    if (g->kids[i].failed_stage >= 0 && g->kids[i].failed_stage < g->N) votes[g->kids[i].failed_stage]++;
  int best = -1;
  int64_t best_at = 0;
  bool best_self = false;
  for (int s = 0; s < g->N; s++) {
    if (!votes[s]) continue;
    bool self = s < g->nkids && g->kids[s].failed_stage == s;
    int64_t at = INT64_MAX; /* when it failed: its own line, else the first line blaming it */
    for (int i = 0; i < g->nkids; i++) {
      const struct child *k = &g->kids[i];
      if (k->failed_stage == s && (!self || i == s) && k->failed_at_us < at) at = k->failed_at_us;
    }
    if (best < 0 || votes[s] > votes[best] || (votes[s] == votes[best] && self && !best_self) ||
        (votes[s] == votes[best] && self == best_self && at < best_at))
      best = s, best_at = at, best_self = self;
  }
  return best;
}

/* The stage that took the group down: one killed by a signal we did not
 * send, else the most blamed stage (most_blamed) with its own error text
 * when it reported one, else the first that failed. */
static int culprit(const struct group *g, char *why, size_t n) {
  for (int i = 0; i < g->nkids; i++)
    if (g->kids[i].exited && WIFSIGNALED(g->kids[i].status) && !g->kids[i].signalled) {
      char name[128];
      kid_name(g, i, name, sizeof name);
      snprintf(why, n, "%s was killed by signal %d (%s)", name, WTERMSIG(g->kids[i].status),
               strsignal(WTERMSIG(g->kids[i].status)));
      return i;
    }
  int s = most_blamed(g);
  if (s >= 0) {
    /* Its own words; else those of the first line that blamed it. */
    const struct child *from = NULL;
    if (s < g->nkids && g->kids[s].failed_stage == s) from = &g->kids[s];
    else
      for (int i = 0; i < g->nkids; i++)
        if (g->kids[i].failed_stage == s && (!from || g->kids[i].failed_at_us < from->failed_at_us)) from = &g->kids[i];
    snprintf(why, n, "%s", from->error);
    return s;
  }
  for (int i = 0; i < g->nkids; i++)
    if (child_bad(&g->kids[i])) {
      char name[128];
      kid_name(g, i, name, sizeof name);
      snprintf(why, n, "%s exited with status %d", name, WEXITSTATUS(g->kids[i].status));
      return i;
    }
  snprintf(why, n, "unknown");
  return -1;
}

static void print_summary(const struct group *g, int status) {
  json_t *o = result_open();
  const struct child *last = &g->kids[g->N - 1]; /* the last stage, or any member: all hold the figures */
  json_t *doc;
  bool have = status == 0 && last->result[0] && json_text_parse(last->result, strlen(last->result), &doc, NULL) == 0;
  static const char *const keys[] = {"test_accuracy", "test_loss", "val_token_accuracy", "val_loss",
                                     "train_loss", "steps", "epochs", "samples_per_s", "comm_bytes_per_step",
                                     "expert_bytes_per_step", "moe_aux_loss", "moe_z_loss",
                                     "moe_dropped_fraction"};
  if (have) {
    for (size_t i = 0; i < sizeof keys / sizeof keys[0]; i++) {
      json_t *v = json_object_get(doc, keys[i]);
      if (json_is_number(v)) json_text_set(o, keys[i], json_incref(v)); /* as the stage wrote it */
    }
    json_decref(doc);
  }
  json_text_set(o, "group", json_text_str(g->name));
  json_text_set(o, "stages", json_integer(g->S));
  if (g->D > 1) {
    json_text_set(o, "data_parallel", json_integer(g->D));
    json_text_set(o, "zero", json_integer(g->f.pipe.zero));
  }
  if (g->T > 1) json_text_set(o, "tensor_parallel", json_integer(g->T));
  if (g->P > 1) json_text_set(o, "expert_parallel", json_integer(g->P));
  /* The largest process's peak resident memory, and device memory on a
   * GPU (each reported its own). */
  json_int_t peak = 0, dev_peak = -1;
  for (int i = 0; i < g->nkids; i++) {
    json_t *d;
    if (!g->kids[i].result[0] || json_text_parse(g->kids[i].result, strlen(g->kids[i].result), &d, NULL) != 0) continue;
    json_t *v = json_object_get(d, "peak_rss_bytes"), *dv = json_object_get(d, "device_peak_bytes");
    if (json_is_integer(v) && json_integer_value(v) > peak) peak = json_integer_value(v);
    if (json_is_integer(dv) && json_integer_value(dv) > dev_peak) dev_peak = json_integer_value(dv);
    json_decref(d);
  }
  if (peak > 0) json_text_set(o, "peak_rss_bytes", json_integer(peak));
  if (dev_peak >= 0) json_text_set(o, "device_peak_bytes", json_integer(dev_peak));
  json_text_set(o, "status", json_string(status == 0 ? "ok" : "failed"));
  if (status != 0) {
    char why[512];
    int s = culprit(g, why, sizeof why);
    json_text_set(o, "failed_stage", json_integer(s));
    json_text_set(o, "error", json_text_str(why));
  }
  result_print(o);
}

/* A pipelined group asked for a directory checkpoint (--checkpoint DIR/,
 * a Hugging Face model directory): once every stage has finished and
 * saved, their files are put together into DIR's model.safetensors,
 * config.json and optimizer.safetensors, which transformers loads. The
 * stage files stay (a --resume in the same split takes them back bit for
 * bit). 0, or 1 with the reason in `e`. */
static int merge_stage_files(const struct group *g, struct rumor_err *e) {
  const char *dir = g->f.train.checkpoint;
  if (g->S < 2 || !dir || !checkpoint_is_dir(dir)) return 0;
  int64_t step = 0;
  if (checkpoint_merge_stages(dir, &step, e)) {
    rumor_err_prefix(e, "its %d stage files could not be put together into %s (they are intact)", g->S, dir);
    return 1;
  }
  log_info("group %s: the %d stages' checkpoints of step %lld put together into %s", g->name, g->S, (long long)step,
           dir);
  return 0;
}

int cmd_group(int argc, char **argv) {
  static struct group grp;
  struct group *g = &grp;
  memset(g, 0, sizeof *g);
  group_flags_default(&g->f);
  struct arg_spec specs[GROUP_FLAGS_MAX_SPECS];
  group_flags_specs(&g->f, FLAGS_LAUNCHER, specs);
  int ar = args_parse(specs, argc, argv,
                      "rumor group (--stages S [--data-parallel D [--zero 0|1]] [--tensor-parallel T] | "
                      "[--tensor-parallel T] [--data-parallel D [--zero Z]]) [--expert-parallel P] [--devices D0,D1,...] --cluster-key FILE "
                      "--identity FILE [options]",
                      "Trains one replica as a peer group of processes on this host.\n"
                      "\n"
                      "--tensor-parallel T: T processes each hold a slice of every layer (attention by\n"
                      "heads, the MLP by columns then rows, the vocabulary) and all-reduce activations.\n"
                      "--data-parallel D: D members split every batch (each takes its slice of the rows\n"
                      "`rumor train --batch B` reads) and sum their gradients. --zero shards what they\n"
                      "hold: 1 the optimizer state, 2 also the gradients, 3 also the parameters (each\n"
                      "unit's gathered just before its forward and backward and given back after). Both\n"
                      "together make T x D processes. Their steps equal the single process's, they talk\n"
                      "over the authenticated transport, their checkpoint has the single process's layout\n"
                      "(--resume takes any). Such a group trains alone unless given --listen (process k\n"
                      "on port + k) or --bootstrap (one list per process, ';'-separated): then process k\n"
                      "averages its shard (its slices, or its ZeRO piece of them) with process k of other\n"
                      "groups of the same layout: by gossip (--sync gossip, with or without --outer:\n"
                      "NoLoCo), by DiLoCo's outer rounds over a ring (--sync allreduce --outer K), or by\n"
                      "every step's gradient over it (--sync allreduce).\n"
                      "\n"
                      "--expert-parallel P: P processes split a mixture-of-experts model's experts (a GPT\n"
                      "spec with -E<n>): each takes its slice of every batch as a data-parallel member\n"
                      "does, runs E / P experts of every mixture-of-experts block, and sends each token to\n"
                      "its experts' process and back (an all-to-all per block); the steps equal the single\n"
                      "process's. With --data-parallel D, D x P processes; with --stages S, D x P in each\n"
                      "stage. --zero shards over all of them; it defaults to 1 here, where a process holds\n"
                      "whole only the experts it runs and experts' weights and gradients travel only to and\n"
                      "from their processes (--zero 0: every process holds every expert).\n"
                      "\n"
                      "--stages S: S processes, each\n"
                      "holding a contiguous run of the model's units (split balanced by parameters and\n"
                      "multiply-adds; the split is printed). Each step runs --micro-batches M through the\n"
                      "stages (--pipeline gpipe or 1f1b); activations and gradients travel between stages\n"
                      "over the authenticated transport. Stage s averages its slice of the parameters with\n"
                      "stage s of other groups (--bootstrap takes one address list per stage, separated by\n"
                      "';'), with the gossip options of `rumor peer` (--clip, --max-local-steps, rate\n"
                      "limits). Groups gossip only with groups of the same model and split, never with plain\n"
                      "peers. Instead of gossip, --sync allreduce sums each step's gradient with stage s of\n"
                      "the other groups, and --sync ps pushes it to stage s's parameter servers (--servers\n"
                      "takes one list per stage, separated by ';'). If a stage dies, the group stops\n"
                      "(non-zero exit, naming the stage); other groups keep training. Stage output lines\n"
                      "pass through; the last line on stdout is the group's result as JSON. --checkpoint X\n"
                      "writes one file per stage (X-stage<s>.safetensors; a directory X/ gets X/stage<s>.safetensors,\n"
                      "put together into the Hugging Face directory X/ itself once every stage has finished);\n"
                      "--resume X --model M takes them back, or any whole-model checkpoint X, or stage files\n"
                      "of another split (each stage takes its units); --init-from DIR likewise. Any command\n"
                      "that reads a checkpoint X reads a group's stage files X-stage<s> put together.\n"
                      "\n"
                      "--stages S --data-parallel D: S x D processes, D members in each stage (process k is\n"
                      "member k % D of stage k / D). Member r of every stage is a pipeline over its slice\n"
                      "of each batch; each stage's members sum their gradients after the pipelined step\n"
                      "(--zero 0, or 1: the optimizer state sharded; ZeRO 2 and 3 are refused with stages:\n"
                      "a stage accumulates whole gradients over its micro-batches). --stages S\n"
                      "--tensor-parallel T: S x T processes, each stage's layers split over T ranks, rank t\n"
                      "linked to rank t of the neighbouring stages. Both: S x D x T processes. Its steps\n"
                      "equal the single process's; each stage writes its own checkpoint file (--resume and\n"
                      "--init-from as for --stages alone). Given --listen (process k on port + k) or\n"
                      "--bootstrap (one list per process), process k averages its shard with process k of\n"
                      "other groups of the same layout by gossip (with or without --outer: NoLoCo), by\n"
                      "every step's gradient (--sync allreduce: if a process's ring leaves it behind, every\n"
                      "stage's processes take their shards at one step before the pipeline goes on) or by\n"
                      "DiLoCo's rounds (--sync allreduce --outer); else the group trains alone.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  group_flags_finish(&g->f, specs);
  log_set_json(g->f.train.log_json);
  struct rumor_err e = {0};
  int rc = prepare(g, specs, &e);
  if (rc) {
    fprintf(stderr, "rumor group: %s\n", e.msg);
    return rc == RUMOR_EFORMAT || rc == RUMOR_ESHAPE ? 2 : 1;
  }
  log_set_name(g->name);
  int status;
  if (start_stages(g, specs, argc, argv, &e)) {
    log_error("group %s: %s", g->name, e.msg);
    signal_all(g, SIGTERM);
    supervise(g);
    status = 1;
  } else {
    status = supervise(g);
  }
  if (status == 0 && (status = merge_stage_files(g, &e)) != 0)
    fprintf(stderr, "rumor group: group %s trained, but %s\n", g->name, e.msg);
  print_summary(g, status);
  if (status != 0) {
    char why[512];
    int s = culprit(g, why, sizeof why);
    if (s >= 0) fprintf(stderr, "rumor group: group %s stopped because %s\n", g->name, why);
    else fprintf(stderr, "rumor group: group %s failed: %s\n", g->name, e.msg[0] ? e.msg : "see the stages' logs");
  }
  for (int i = 0; i < g->nkids; i++) free(g->kids[i].buf);
  return status;
}
