/*
 * proc.h — child processes for integration tests: spawn with output to
 * files, wait with a deadline, kill by PID, and a registry so a test can end
 * every process it started even when an assertion fails half-way (call
 * proc_kill_all from the suite's .fini), and scratch directories.
 *
 * Header-only (static inline functions) so each test binary gets its own copy.
 */
#ifndef RUMOR_TESTS_PROC_H
#define RUMOR_TESTS_PROC_H

#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#define PROC_MAX 64

static pid_t proc_pids[PROC_MAX];

static inline void proc_register(pid_t pid) {
  for (int i = 0; i < PROC_MAX; i++)
    if (proc_pids[i] == 0) {
      proc_pids[i] = pid;
      return;
    }
}

static inline void proc_forget(pid_t pid) {
  for (int i = 0; i < PROC_MAX; i++)
    if (proc_pids[i] == pid) proc_pids[i] = 0;
}

/* Starts argv[0] with stdout and stderr appended to the given files (NULL:
 * /dev/null) in its own process group. Returns the PID (> 0) or -1. */
static inline pid_t proc_spawn(char *const argv[], const char *out_path, const char *err_path) {
  pid_t pid = fork();
  if (pid < 0) return -1;
  if (pid == 0) {
    setpgid(0, 0);
    int out = open(out_path ? out_path : "/dev/null", O_WRONLY | O_CREAT | O_APPEND, 0644);
    int err = open(err_path ? err_path : "/dev/null", O_WRONLY | O_CREAT | O_APPEND, 0644);
    int nul = open("/dev/null", O_RDONLY);
    if (out < 0 || err < 0 || nul < 0) _exit(126);
    dup2(nul, 0);
    dup2(out, 1);
    dup2(err, 2);
    execv(argv[0], argv);
    _exit(127);
  }
  proc_register(pid);
  return pid;
}

/* Waits up to `secs` for pid. Returns its wait status, or -1 on timeout (the
 * process is then killed with SIGKILL and reaped). */
static inline int proc_wait(pid_t pid, double secs) {
  struct timespec t0, now;
  clock_gettime(CLOCK_MONOTONIC, &t0);
  for (;;) {
    int status;
    pid_t r = waitpid(pid, &status, WNOHANG);
    if (r == pid) {
      proc_forget(pid);
      return status;
    }
    if (r < 0 && errno != EINTR) {
      proc_forget(pid);
      return -1;
    }
    clock_gettime(CLOCK_MONOTONIC, &now);
    if ((double)(now.tv_sec - t0.tv_sec) + (double)(now.tv_nsec - t0.tv_nsec) * 1e-9 > secs) {
      kill(pid, SIGKILL);
      waitpid(pid, &status, 0);
      proc_forget(pid);
      return -1;
    }
    usleep(20000);
  }
}

/* Sends `sig` to every registered process, then SIGKILLs and reaps any still
 * alive after a grace period. */
static inline void proc_kill_all(void) {
  for (int i = 0; i < PROC_MAX; i++)
    if (proc_pids[i] > 0) kill(proc_pids[i], SIGTERM);
  for (int i = 0; i < PROC_MAX; i++)
    if (proc_pids[i] > 0) {
      if (proc_wait(proc_pids[i], 3.0) < 0) { /* proc_wait killed and reaped it */ }
      proc_pids[i] = 0;
    }
}

/* Reads a whole small file into a static-lifetime buffer the caller frees. */
/* A whole file, NUL-terminated, its length in *n (may be NULL); "" when it
 * cannot be read. The caller frees it. */
static inline char *proc_slurp_n(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  if (n) *n = 0;
  if (!f) return strdup("");
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  fseek(f, 0, SEEK_SET);
  char *buf = malloc((size_t)len + 1);
  size_t got = fread(buf, 1, (size_t)len, f);
  buf[got] = '\0';
  fclose(f);
  if (n) *n = got;
  return buf;
}

static inline char *proc_slurp(const char *path) { return proc_slurp_n(path, NULL); }

/* Runs a command to completion (at most `secs`) capturing stdout and stderr
 * into *out and *err (malloc'd; either may be NULL). Returns the wait status
 * or -1 on timeout. `scratch` is a directory for the capture files. */
static inline int proc_run(char *const argv[], double secs, const char *scratch, char **out, char **err) {
  char op[512], ep[512];
  static int seq;
  snprintf(op, sizeof op, "%s/run-%d-%d.out", scratch, (int)getpid(), seq);
  snprintf(ep, sizeof ep, "%s/run-%d-%d.err", scratch, (int)getpid(), seq++);
  unlink(op);
  unlink(ep);
  pid_t pid = proc_spawn(argv, op, ep);
  if (pid < 0) return -1;
  int st = proc_wait(pid, secs);
  if (out) *out = proc_slurp(op);
  if (err) *err = proc_slurp(ep);
  unlink(op);
  unlink(ep);
  return st;
}

/* A fresh scratch directory /tmp/rumor-test-NAME-XXXXXX in dir[n]. */
static inline void proc_scratch_make(char *dir, size_t n, const char *name) {
  snprintf(dir, n, "/tmp/rumor-test-%s-XXXXXX", name);
  cr_assert_not_null(mkdtemp(dir), "cannot make a scratch directory %s", dir);
}

/* Ends every process this test started, then removes the scratch directory. */
static inline void proc_scratch_remove(const char *dir) {
  proc_kill_all();
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  cr_assert_eq(system(cmd), 0, "cannot remove %s", dir);
}

/* True when the wait status is a normal exit with `code`. */
static inline bool proc_exited_with(int status, int code) {
  return status >= 0 && WIFEXITED(status) && WEXITSTATUS(status) == code;
}

#endif /* RUMOR_TESTS_PROC_H */
