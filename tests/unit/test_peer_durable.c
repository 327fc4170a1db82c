/* Durable checkpoints: a writer SIGKILLed at random moments during 100
 * checkpoint writes always leaves the last complete checkpoint loadable; a
 * truncated or bit-flipped checkpoint is rejected with a message naming the
 * fault and the previous one (`path`.prev) is used; a full disk
 * (RLIMIT_FSIZE) leaves both the current and the previous checkpoint intact;
 * temporary files of killed writers are cleaned up. */
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "peer/train/train.h"

static char dir[64];
static tensor_backend_t be;

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-test-durable-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0);
  log_set_level(LOG_WARN);
}
static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
  tensor_backend_close(be);
}
TestSuite(durable, .init = setup, .fini = teardown, .timeout = 240);

static char *path(const char *name) {
  static char buf[4][256];
  static int w;
  char *p = buf[w++ % 4];
  snprintf(p, 256, "%s/%s", dir, name);
  return p;
}

/* A model of about 200k parameters: each write is about 1.6 MB with the
 * momentum, long enough for kills to land inside writes. */
static void make(struct model *m, struct optim *o, const char *spec_s) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(spec_s, &spec, &e), 0);
  cr_assert_eq(model_init_full(m, &spec, be, 8, &e), 0);
  model_init_params(m, 42);
  struct optim_config oc;
  optim_config_default(&oc);
  cr_assert_eq(optim_init(o, &oc, m, &e), 0);
}

static struct ckpt_info info_at(const struct model *m, int64_t step) {
  struct ckpt_info in;
  memset(&in, 0, sizeof in);
  in.spec = m->spec;
  in.st = (struct train_state){.step = step, .epoch = 0, .step_in_epoch = 0, .samples = step * 8};
  in.shard = (struct shard){0, 1};
  in.batch = 8;
  in.norm_mean = 0.5;
  in.norm_std = 0.25;
  return in;
}

/* Every parameter and the momentum hold `step`: a file whose contents do
 * not match its own metadata would show. Plain loops over the CPU backend's
 * host memory: forked writers must not use the parent's thread pool. */
static void stamp(struct model *m, struct optim *o, int64_t step) {
  float *p = m->params.data, *s = o->state.data;
  for (int64_t i = 0; i < tensor_numel(&m->params); i++) p[i] = (float)step;
  for (int64_t i = 0; i < tensor_numel(&o->state); i++) s[i] = (float)step;
}

/* Temporaries whose writer's PID runs no process now (the ones the next
 * save must remove; a PID reused within a second cannot be told from its
 * writer and stays, harmlessly, until later). */
static int count_dead_temporaries(void) {
  DIR *d = opendir(dir);
  cr_assert_not_null(d);
  int n = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;) {
    const char *t = strstr(de->d_name, ".tmp.");
    if (!t) continue;
    long pid = strtol(t + 5, NULL, 10);
    if (pid > 0 && kill((pid_t)pid, 0) < 0 && errno == ESRCH) {
      fprintf(stderr, "left behind: %s\n", de->d_name);
      n++;
    }
  }
  closedir(d);
  return n;
}

static int count_temporaries(void) {
  DIR *d = opendir(dir);
  cr_assert_not_null(d);
  int n = 0;
  for (struct dirent *de; (de = readdir(d)) != NULL;)
    if (strstr(de->d_name, ".tmp.")) {
      n++;
      if (getenv("DURABLE_DEBUG")) fprintf(stderr, "temporary: %s\n", de->d_name);
    }
  closedir(d);
  return n;
}

/* Opens the latest checkpoint and checks that it is self-consistent: every
 * value equals its recorded step. Returns the step. */
static int64_t load_step(const char *p, char *used, size_t used_len) {
  struct checkpoint ck;
  struct rumor_err e;
  cr_assert_eq(checkpoint_open_latest(p, &ck, used, used_len, &e), 0, "no loadable checkpoint: %s", e.msg);
  int64_t step = ck.info.st.step;
  const struct st_tensor *w = safetensors_find(&ck.file, "layers.0.weight");
  const struct st_tensor *mo = safetensors_find(&ck.file, "optimizer.momentum");
  cr_assert(w && mo);
  const float *a = w->data, *b = mo->data;
  cr_assert(a[0] == (float)step && a[w->nbytes / 4 - 1] == (float)step && b[mo->nbytes / 4 - 1] == (float)step,
            "checkpoint of step %lld holds values of another step (%g, %g)", (long long)step, a[0], b[0]);
  checkpoint_close(&ck);
  return step;
}

Test(durable, sigkill_at_random_moments_during_100_writes_leaves_the_last_complete_checkpoint) {
  struct model m;
  struct optim o;
  make(&m, &o, "mlp:784-256-10");
  char p[256]; /* a copy: path() reuses its buffers */
  snprintf(p, sizeof p, "%s", path("ck.safetensors"));
  srand((unsigned)time(NULL));
  /* How long one write takes here (fsyncs included): kills land in the
   * first four writes' worth of time after the writer starts. */
  struct timespec t0, t1;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (int64_t s = 1; s <= 3; s++) {
    struct rumor_err e;
    struct ckpt_info in = info_at(&m, s);
    cr_assert_eq(checkpoint_save(path("probe.safetensors"), &m, &o, &in, &e), 0, "%s", e.msg);
  }
  clock_gettime(CLOCK_MONOTONIC, &t1);
  long write_us = ((t1.tv_sec - t0.tv_sec) * 1000000L + (t1.tv_nsec - t0.tv_nsec) / 1000) / 3;
  fprintf(stderr, "one checkpoint write of %zu bytes takes about %ld us here\n",
          (size_t)m.nparams * 8, write_us);
  unlink(path("probe.safetensors"));
  unlink(path("probe.safetensors.prev"));
  int64_t committed = 0; /* the step of the checkpoint that must survive */
  int mid_write = 0, kills = 0;
  while (kills < 100) {
    int fds[2];
    cr_assert_eq(pipe(fds), 0);
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
      /* The writer: checkpoints of steps committed+1, +2, ... as fast as it
       * can, acknowledging each step after checkpoint_save returned. */
      close(fds[0]);
      struct rumor_err e;
      for (int64_t s = committed + 1;; s++) {
        stamp(&m, &o, s);
        struct ckpt_info in = info_at(&m, s);
        if (checkpoint_save(p, &m, &o, &in, &e)) _exit(3);
        if (write(fds[1], &s, sizeof s) != sizeof s) _exit(4);
      }
    }
    close(fds[1]);
    /* A random moment within the first four writes. */
    long us = rand() % (4 * write_us + 1);
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    nanosleep(&ts, NULL);
    kill(pid, SIGKILL);
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL, "the writer failed on its own (status %d)", status);
    int64_t acked = committed, s;
    while (read(fds[0], &s, sizeof s) == sizeof s) acked = s;
    close(fds[0]);
    kills++;
    mid_write += count_temporaries() > 0;
    if (acked == 0 && committed == 0) {
      /* Killed before the very first checkpoint was complete: there may be
       * nothing to load yet (or the first one, if the ack was lost). */
      struct stat st;
      if (stat(p, &st) != 0) continue;
    }
    char used[512];
    int64_t got = load_step(p, used, sizeof used);
    /* The last acknowledged write, or the one after it when the kill came
     * between its rename and the acknowledgement. Never an older one. */
    cr_assert(got == acked || got == acked + 1, "kill %d: loaded step %lld, but step %lld was complete", kills,
              (long long)got, (long long)acked);
    cr_assert_str_eq(used, p, "kill %d: the current checkpoint should be complete, but %s was used", kills, used);
    committed = got;
  }
  fprintf(stderr, "100 kills: %d found a write in progress (a temporary file); the last checkpoint is step %lld\n",
          mid_write, (long long)committed);
  cr_assert_gt(mid_write, 0, "no kill landed inside a write: the test proved nothing");
  cr_assert_gt(committed, 0);
  /* The next save removes what the killed writers left behind. */
  struct rumor_err e;
  stamp(&m, &o, committed + 1);
  struct ckpt_info in = info_at(&m, committed + 1);
  cr_assert_eq(checkpoint_save(p, &m, &o, &in, &e), 0, "%s", e.msg);
  cr_assert_eq(count_dead_temporaries(), 0, "temporary files of killed writers were not removed");
  char prev[512];
  checkpoint_prev_path(p, prev, sizeof prev);
  cr_assert_eq(load_step(prev, NULL, 0), committed, "the previous checkpoint is not the one before");
  model_free(&m), optim_free(&o);
}

static void damage(const char *p, long truncate_to, long flip_at) {
  if (truncate_to >= 0) cr_assert_eq(truncate(p, truncate_to), 0);
  if (flip_at >= 0) {
    int fd = open(p, O_RDWR);
    cr_assert_geq(fd, 0);
    unsigned char c;
    cr_assert_eq(pread(fd, &c, 1, flip_at), 1);
    c ^= 0x01;
    cr_assert_eq(pwrite(fd, &c, 1, flip_at), 1);
    close(fd);
  }
}

static size_t file_size(const char *p) {
  struct stat st;
  cr_assert_eq(stat(p, &st), 0);
  return (size_t)st.st_size;
}

Test(durable, truncated_or_bit_flipped_checkpoint_is_rejected_and_the_previous_one_used) {
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, "mlp:20-16-4");
  char p[256];
  snprintf(p, sizeof p, "%s", path("c.safetensors"));
  size_t n = 0;
  /* Truncations (header, data, the last byte) and bit flips (length prefix,
   * JSON header, data). */
  const char *what[] = {"truncated to 0 bytes", "truncated to 6 bytes", "truncated by half", "truncated by one byte",
                        "bit flip in the length prefix", "bit flip in the header", "bit flip in the data"};
  for (int k = 0; k < 7; k++) {
    for (int64_t s = 1; s <= 2; s++) {
      stamp(&m, &o, s);
      struct ckpt_info in = info_at(&m, s);
      cr_assert_eq(checkpoint_save(p, &m, &o, &in, &e), 0, "%s", e.msg);
    }
    n = file_size(p);
    long cut[] = {0, 6, (long)n / 2, (long)n - 1, -1, -1, -1};
    long flip[] = {-1, -1, -1, -1, 3, 40, (long)n - 5};
    damage(p, cut[k], flip[k]);
    struct checkpoint ck;
    cr_assert_neq(checkpoint_open(p, &ck, &e), 0, "%s: accepted", what[k]);
    cr_assert(strstr(e.msg, p) != NULL, "%s: the message should name the file: %s", what[k], e.msg);
    char used[512];
    int64_t step = load_step(p, used, sizeof used);
    cr_assert_eq(step, 1, "%s: loaded step %lld, want the previous checkpoint's 1", what[k], (long long)step);
    cr_assert(strstr(used, ".prev") != NULL, "%s: used %s", what[k], used);
  }
  /* Both damaged: an error that names both faults. */
  char prev[512];
  checkpoint_prev_path(p, prev, sizeof prev);
  damage(prev, 10, -1);
  struct checkpoint ck;
  cr_assert_neq(checkpoint_open_latest(p, &ck, NULL, 0, &e), 0, "two damaged checkpoints accepted");
  cr_assert(strstr(e.msg, p) && strstr(e.msg, prev), "the error should name both files: %s", e.msg);
  model_free(&m), optim_free(&o);
}

Test(durable, full_disk_leaves_the_current_and_previous_checkpoints_intact) {
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, "mlp:784-64-10");
  char p[256];
  snprintf(p, sizeof p, "%s", path("full.safetensors"));
  for (int64_t s = 1; s <= 2; s++) {
    stamp(&m, &o, s);
    struct ckpt_info in = info_at(&m, s);
    cr_assert_eq(checkpoint_save(p, &m, &o, &in, &e), 0, "%s", e.msg);
  }
  size_t n = file_size(p);
  /* Limits below the file's size: the write fails at the start, in the
   * header, or in the middle of the data. */
  rlim_t limits[] = {0, 100, n / 2, n - 1};
  for (int k = 0; k < 4; k++) {
    pid_t pid = fork();
    cr_assert_neq(pid, -1);
    if (pid == 0) {
      signal(SIGXFSZ, SIG_IGN); /* as rumor does (signals_init) */
      struct rlimit rl = {.rlim_cur = limits[k], .rlim_max = limits[k]};
      if (setrlimit(RLIMIT_FSIZE, &rl)) _exit(5);
      stamp(&m, &o, 3);
      struct ckpt_info in = info_at(&m, 3);
      int rc = checkpoint_save(p, &m, &o, &in, &e);
      if (rc == 0) _exit(1);
      fprintf(stderr, "limit %llu bytes: %s\n", (unsigned long long)limits[k], e.msg);
      _exit(strstr(e.msg, "File too large") ? 0 : 2);
    }
    int status;
    cr_assert_eq(waitpid(pid, &status, 0), pid);
    cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
              "under a %llu-byte file-size limit the write did not fail with a clear error (status %d)",
              (unsigned long long)limits[k], status);
    char used[512];
    cr_assert_eq(load_step(p, used, sizeof used), 2, "the current checkpoint changed");
    cr_assert_str_eq(used, p);
    char prev[512];
    checkpoint_prev_path(p, prev, sizeof prev);
    cr_assert_eq(load_step(prev, NULL, 0), 1, "the previous checkpoint changed");
    cr_assert_eq(count_temporaries(), 0, "the failed write left a temporary file");
  }
  model_free(&m), optim_free(&o);
}

Test(durable, temporaries_are_removed_only_when_their_writer_is_gone) {
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, "mlp:20-16-4");
  char p[256];
  snprintf(p, sizeof p, "%s", path("t.safetensors"));
  char mine_running[512], reused[512], dead[512];
  /* A live writer that started before its file was written (PID 1, which
   * runs since boot): kept. */
  snprintf(mine_running, sizeof mine_running, "%s.tmp.1", p);
  /* A PID that runs, but in a process started after the file was last
   * written (a reused PID): removed. */
  pid_t child = fork();
  cr_assert_neq(child, -1);
  if (child == 0) {
    pause();
    _exit(0);
  }
  snprintf(reused, sizeof reused, "%s.tmp.%d", p, (int)child);
  /* A PID that does not run: removed. */
  pid_t gone = fork();
  cr_assert_neq(gone, -1);
  if (gone == 0) _exit(0);
  cr_assert_eq(waitpid(gone, NULL, 0), gone);
  snprintf(dead, sizeof dead, "%s.prev.tmp.%d", p, (int)gone);
  /* The same in the names util's atomic files use now (PATH.tmp.PID.HEX). */
  char new_running[512], new_dead[512], new_prev_dead[512], not_ours[512];
  snprintf(new_running, sizeof new_running, "%s.tmp.1.0123456789abcdef", p);
  snprintf(new_dead, sizeof new_dead, "%s.tmp.%d.0123456789abcdef", p, (int)gone);
  snprintf(new_prev_dead, sizeof new_prev_dead, "%s.prev.tmp.%d.fedcba9876543210", p, (int)gone);
  /* Not a temporary of ours (a name that only starts like one): kept. */
  snprintf(not_ours, sizeof not_ours, "%s.tmp.%d.notes", p, (int)gone);
  const char *files[] = {mine_running, reused, dead, new_running, new_dead, new_prev_dead, not_ours};
  for (size_t i = 0; i < sizeof files / sizeof files[0]; i++) {
    FILE *f = fopen(files[i], "w");
    cr_assert_not_null(f);
    fputs("partial", f);
    fclose(f);
  }
  struct timespec old[2] = {{time(NULL) - 3600, 0}, {time(NULL) - 3600, 0}};
  cr_assert_eq(utimensat(AT_FDCWD, reused, old, 0), 0);
  stamp(&m, &o, 1);
  struct ckpt_info in = info_at(&m, 1);
  cr_assert_eq(checkpoint_save(p, &m, &o, &in, &e), 0, "%s", e.msg);
  kill(child, SIGKILL);
  waitpid(child, NULL, 0);
  struct stat st;
  cr_assert_eq(stat(mine_running, &st), 0, "the temporary of a running writer was removed");
  cr_assert_neq(stat(reused, &st), 0, "the temporary of a writer whose PID was reused was kept");
  cr_assert_neq(stat(dead, &st), 0, "the temporary of a dead writer was kept");
  cr_assert_eq(stat(new_running, &st), 0, "the temporary (PATH.tmp.PID.HEX) of a running writer was removed");
  cr_assert_neq(stat(new_dead, &st), 0, "the temporary (PATH.tmp.PID.HEX) of a dead writer was kept");
  cr_assert_neq(stat(new_prev_dead, &st), 0, "the temporary (PATH.prev.tmp.PID.HEX) of a dead writer was kept");
  cr_assert_eq(stat(not_ours, &st), 0, "a file that is no temporary of ours was removed");
  unlink(mine_running);
  unlink(new_running);
  unlink(not_ours);
  model_free(&m), optim_free(&o);
}
