/* Restarts of `rumor train` as a user meets them: a run SIGKILLed at random
 * moments while it checkpoints every step always restarts from the last
 * complete checkpoint, and the restarted pieces add up to the straight run
 * bit for bit; a damaged latest checkpoint is rejected with a clear message
 * and the previous one is used; a full disk (RLIMIT_FSIZE) fails the run
 * with a clear message and leaves both checkpoints as they were. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>

#include "../support/proc.h"
#include "../support/fmnist.h"

static char dir[64];

static void setup(void) { proc_scratch_make(dir, sizeof dir, "restart"); }
static void teardown(void) { proc_scratch_remove(dir); }
TestSuite(restart, .init = setup, .fini = teardown, .timeout = 300);


static char *path(const char *name) {
  static char buf[8][256];
  static int w;
  char *p = buf[w++ % 8];
  snprintf(p, 256, "%s/%s", dir, name);
  return p;
}

static bool exists(const char *p) {
  struct stat st;
  return stat(p, &st) == 0;
}

static char *read_all(const char *p, size_t *n) {
  FILE *f = fopen(p, "rb");
  cr_assert_not_null(f, "cannot open %s", p);
  fseek(f, 0, SEEK_END);
  *n = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  char *b = malloc(*n ? *n : 1);
  cr_assert_eq(fread(b, 1, *n, f), *n);
  fclose(f);
  return b;
}

static bool same_file(const char *a, const char *b) {
  size_t na, nb;
  char *fa = read_all(a, &na), *fb = read_all(b, &nb);
  bool same = na == nb && memcmp(fa, fb, na) == 0;
  free(fa), free(fb);
  return same;
}

/* The training run every test uses: up to 1000 steps over 9 epochs of a
 * quarter of Fashion-MNIST (118 steps an epoch) with a model of 200k
 * parameters (a 1.6 MB checkpoint), resumed from `resume` or fresh, saving to
 * `ckpt` (and every `every` steps when not NULL). */
#define RUN_ARGS "--epochs", "9", "--max-steps", "1000", "--threads", "1", "--log-every", "0", "--no-eval"

static int argv_of(char **argv, const char *resume, const char *ckpt, const char *every) {
  int n = 0;
  argv[n++] = RUMOR_BIN;
  argv[n++] = "train";
  const char *common[] = {RUN_ARGS};
  for (size_t i = 0; i < sizeof common / sizeof common[0]; i++) argv[n++] = (char *)common[i];
  if (resume) {
    argv[n++] = "--resume";
    argv[n++] = (char *)resume;
  } else {
    argv[n++] = "--model";
    argv[n++] = "mlp:784-256-10";
    argv[n++] = "--shard";
    argv[n++] = "1/4";
  }
  argv[n++] = "--checkpoint";
  argv[n++] = (char *)ckpt;
  if (every) {
    argv[n++] = "--checkpoint-every";
    argv[n++] = (char *)every;
  }
  argv[n] = NULL;
  return n;
}

/* The step of the last "checkpoint saved to ... (step S)" line, or -1. */
static long last_saved_step(const char *log) {
  long step = -1;
  for (const char *p = log; (p = strstr(p, "checkpoint saved to ")) != NULL; p++) {
    const char *q = strstr(p, "(step ");
    if (q) step = strtol(q + 6, NULL, 10);
  }
  return step;
}

static long resumed_step(const char *log) {
  const char *p = strstr(log, "resumed from ");
  if (!p) return -1;
  const char *q = strstr(p, " at step ");
  return q ? strtol(q + 9, NULL, 10) : -1;
}

Test(restart, sigkill_at_random_moments_restarts_from_the_last_complete_checkpoint_and_ends_bit_for_bit) {
  SKIP_WITHOUT_DATA();
  char *argv[40], *out, *err;
  /* The straight run. */
  argv_of(argv, NULL, path("straight.safetensors"), NULL);
  int st = proc_run(argv, 120, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);

  /* The same run, checkpointing every step, killed at random moments and
   * restarted from its checkpoint each time. */
  char ck[256]; /* a copy: path() reuses its buffers */
  snprintf(ck, sizeof ck, "%s", path("killed.safetensors"));
  srand((unsigned)time(NULL));
  long expect_from = -1; /* the step the next restart must load (-1: a fresh start) */
  int kills = 0, restarts = 0;
  for (int round = 0; round < 12; round++) {
    bool have = exists(ck) || exists(path("killed.safetensors.prev"));
    argv_of(argv, have ? ck : NULL, ck, "1");
    char log[256];
    snprintf(log, sizeof log, "%s/round%d.log", dir, round);
    pid_t pid = proc_spawn(argv, NULL, log);
    cr_assert_gt(pid, 0);
    /* Most kills land while it trains and checkpoints: at a random moment
     * in the 300 ms after its first save of this run (start-up takes from a
     * few hundred ms to seconds under sanitizers). Every fourth lands at a
     * random moment of the start-up instead. */
    if (round % 4 != 3) {
      for (int w = 0; w < 600; w++) {
        char *t = proc_slurp(log);
        bool saving = strstr(t, "checkpoint saved to ") != NULL;
        free(t);
        siginfo_t si = {0}; /* ended already? (left to proc_wait to reap) */
        if (saving || (waitid(P_PID, (id_t)pid, &si, WEXITED | WNOHANG | WNOWAIT) == 0 && si.si_pid == pid)) break;
        usleep(50000);
      }
    }
    usleep((useconds_t)(rand() % 300000));
    kill(pid, SIGKILL);
    int status = proc_wait(pid, 30);
    char *text = proc_slurp(log);
    bool killed = WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL;
    long got = resumed_step(text);
    /* Killed while starting up (before it loaded anything) is no restart. */
    cr_assert(!have || got >= 0 || killed, "round %d did not resume: %s", round, text);
    if (have && got >= 0) {
      /* The last checkpoint the killed run reported complete, or the one
       * after it when the kill came between its rename and its log line. */
      cr_assert(got == expect_from || got == expect_from + 1, "round %d resumed at step %ld, want %ld (or %ld)", round,
                got, expect_from, expect_from + 1);
      restarts++;
    }
    long saved = last_saved_step(text);
    if (saved >= 0) expect_from = saved;
    free(text);
    if (!killed) {
      /* It finished before the kill: start the next round afresh. */
      cr_assert(proc_exited_with(status, 0), "round %d failed (status %d)", round, status);
      break;
    }
    kills++;
  }
  fprintf(stderr, "%d SIGKILLs, %d restarts from the checkpoint of the killed run\n", kills, restarts);
  cr_assert_geq(restarts, 3, "too few restarts were tested");
  /* The last restart runs to the end. */
  argv_of(argv, ck, ck, "1");
  st = proc_run(argv, 120, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  long got = resumed_step(err);
  cr_assert(got == expect_from || got == expect_from + 1, "the last restart resumed at step %ld, want %ld", got,
            expect_from);
  free(out), free(err);
  cr_assert(same_file(path("straight.safetensors"), ck),
            "the run killed %d times and restarted differs from the straight run", kills);
}

static void flip_byte(const char *p, long at) {
  FILE *f = fopen(p, "r+b");
  cr_assert_not_null(f);
  fseek(f, at, SEEK_SET);
  int c = fgetc(f);
  fseek(f, at, SEEK_SET);
  fputc(c ^ 0x40, f);
  fclose(f);
}

Test(restart, a_damaged_checkpoint_is_rejected_clearly_and_the_previous_one_resumes_bit_for_bit) {
  SKIP_WITHOUT_DATA();
  char *argv[40], *out, *err;
  argv_of(argv, NULL, path("straight.safetensors"), NULL);
  int st = proc_run(argv, 120, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);

  /* 110 steps with a checkpoint every 50 and at the end: the current one
   * holds step 110, the previous one step 100. */
  char ck[256];
  snprintf(ck, sizeof ck, "%s", path("ck.safetensors"));
  argv_of(argv, NULL, ck, "50");
  argv[5] = "110"; /* --max-steps */
  st = proc_run(argv, 120, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  struct stat sb;
  cr_assert_eq(stat(ck, &sb), 0);
  flip_byte(ck, sb.st_size / 2);

  argv_of(argv, ck, ck, NULL);
  st = proc_run(argv, 120, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "the run with a damaged checkpoint failed (status %d): %s", st, err);
  char want[512];
  snprintf(want, sizeof want, "using the previous checkpoint %s.prev (step 100)", ck);
  cr_assert(strstr(err, "checkpoint rejected") && strstr(err, "digest mismatch") && strstr(err, want),
            "no clear message about the damaged checkpoint: %s", err);
  cr_assert_eq(resumed_step(err), 100, "%s", err);
  free(out), free(err);
  cr_assert(same_file(path("straight.safetensors"), ck), "resuming from the previous checkpoint is not bit for bit");
}

Test(restart, a_full_disk_fails_the_run_clearly_and_leaves_both_checkpoints_intact) {
  SKIP_WITHOUT_DATA();
  char *argv[40], *out, *err;
  char ck[256];
  snprintf(ck, sizeof ck, "%s", path("ck.safetensors"));
  argv_of(argv, NULL, ck, "50");
  argv[5] = "100"; /* --max-steps */
  int st = proc_run(argv, 120, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  char cmd[600];
  snprintf(cmd, sizeof cmd, "cp %s %s && cp %s.prev %s", ck, path("before"), ck, path("before.prev"));
  cr_assert_eq(system(cmd), 0);
  struct stat sb;
  cr_assert_eq(stat(ck, &sb), 0);

  /* Resume under a file-size limit of half a checkpoint: the next save
   * cannot complete. */
  argv_of(argv, ck, ck, "50");
  char log[256];
  snprintf(log, sizeof log, "%s", path("full.log"));
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    struct rlimit rl = {.rlim_cur = (rlim_t)sb.st_size / 2, .rlim_max = (rlim_t)sb.st_size / 2};
    if (setrlimit(RLIMIT_FSIZE, &rl)) _exit(125);
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0644); /* small: under the limit */
    if (fd < 0) _exit(126);
    dup2(fd, 2);
    int nul = open("/dev/null", O_WRONLY);
    if (nul >= 0) dup2(nul, 1);
    execv(argv[0], argv);
    _exit(127);
  }
  proc_register(pid);
  st = proc_wait(pid, 120);
  char *text = proc_slurp(log);
  cr_assert(proc_exited_with(st, 1), "a run that cannot save should exit 1 (status %d): %s", st, text);
  cr_assert(strstr(text, "File too large") != NULL, "no clear message about the failed save: %s", text);
  free(text);
  cr_assert(same_file(path("before"), ck), "the current checkpoint changed");
  snprintf(cmd, sizeof cmd, "%s.prev", ck);
  cr_assert(same_file(path("before.prev"), cmd), "the previous checkpoint changed");
  snprintf(cmd, sizeof cmd, "ls %s | grep -q '[.]tmp[.]'", dir);
  cr_assert_neq(system(cmd), 0, "the failed save left a temporary file");
}
