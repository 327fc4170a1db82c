/*
 * `rumor keygen` as a user runs it: files with mode 0600, the public key on
 * stdout (the form allow-lists use), no silent overwrite, clear errors and
 * non-zero exits on bad flags and paths.
 */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "net/net.h"
#include "test_net_lsan.h"

static char dir[256];

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-keygen-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) cr_log_warn("could not remove %s", dir);
}

/* Runs `rumor` with args; captures stdout and stderr; returns the exit
 * status (or -1 when it did not exit normally). The child is reaped by PID. */
static int run(const char *const *args, char *out, size_t out_cap, char *err, size_t err_cap) {
  char of[300], ef[300];
  snprintf(of, sizeof of, "%s/.stdout", dir);
  snprintf(ef, sizeof ef, "%s/.stderr", dir);
  pid_t pid = fork();
  cr_assert_geq(pid, 0);
  if (pid == 0) {
    int o = open(of, O_WRONLY | O_CREAT | O_TRUNC, 0600), e = open(ef, O_WRONLY | O_CREAT | O_TRUNC, 0600);
    if (o < 0 || e < 0 || dup2(o, 1) < 0 || dup2(e, 2) < 0) _exit(126);
    const char *argv[16] = {RUMOR_BIN};
    for (int i = 0; args[i] && i < 14; i++) argv[i + 1] = args[i];
    execv(RUMOR_BIN, (char *const *)argv);
    _exit(127);
  }
  int st = 0;
  cr_assert_eq(waitpid(pid, &st, 0), pid);
  FILE *f = fopen(of, "r");
  size_t n = f ? fread(out, 1, out_cap - 1, f) : 0;
  out[n] = '\0';
  if (f) fclose(f);
  f = fopen(ef, "r");
  n = f ? fread(err, 1, err_cap - 1, f) : 0;
  err[n] = '\0';
  if (f) fclose(f);
  unlink(of);
  unlink(ef);
  return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

Test(net_keygen, writes_a_0600_identity_and_prints_its_public_key, .init = setup, .fini = teardown) {
  char p[300], out[512], err[1024];
  snprintf(p, sizeof p, "%s/id", dir);
  const char *args[] = {"keygen", "-o", p, NULL};
  cr_assert_eq(run(args, out, sizeof out, err, sizeof err), 0, "%s", err);
  struct stat st;
  cr_assert_eq(stat(p, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600, "mode %o", st.st_mode & 0777);
  cr_assert_eq(strlen(out), NET_PUBKEY_STR_LEN + 1, "one key and a newline: '%s'", out);
  uint8_t pk[NET_PUBKEY_BYTES];
  cr_assert_eq(net_pubkey_parse(out, NET_PUBKEY_STR_LEN, pk), 0);
  struct net_identity id;
  struct rumor_err e = {0};
  cr_assert_eq(net_identity_load(p, &id, &e), 0, "%s", e.msg);
  cr_assert_eq(memcmp(id.pk, pk, NET_PUBKEY_BYTES), 0, "the printed key is the file's");
  /* --public prints the same key again */
  char out2[512];
  const char *pub[] = {"keygen", "--public", p, NULL};
  cr_assert_eq(run(pub, out2, sizeof out2, err, sizeof err), 0, "%s", err);
  cr_assert_str_eq(out2, out);
  /* and the printed line is a valid allow-list */
  char al_path[300];
  snprintf(al_path, sizeof al_path, "%s/allow", dir);
  FILE *f = fopen(al_path, "w");
  fputs(out, f);
  fclose(f);
  struct net_allowlist al;
  cr_assert_eq(net_allowlist_load(al_path, &al, &e), 0, "%s", e.msg);
  cr_assert(net_allowlist_contains(&al, id.pk));
  net_allowlist_free(&al);
  net_identity_wipe(&id);
}

Test(net_keygen, refuses_to_overwrite_without_force, .init = setup, .fini = teardown) {
  char p[300], out[512], err[1024], first[512];
  snprintf(p, sizeof p, "%s/id", dir);
  const char *args[] = {"keygen", "-o", p, NULL};
  cr_assert_eq(run(args, first, sizeof first, err, sizeof err), 0);
  cr_assert_eq(run(args, out, sizeof out, err, sizeof err), 1);
  cr_assert(strstr(err, "already exists") && strstr(err, "--force"), "%s", err);
  const char *pub[] = {"keygen", "--public", p, NULL};
  cr_assert_eq(run(pub, out, sizeof out, err, sizeof err), 0);
  cr_assert_str_eq(out, first, "the old key is untouched");
  const char *forced[] = {"keygen", "--out", p, "--force", NULL};
  cr_assert_eq(run(forced, out, sizeof out, err, sizeof err), 0, "%s", err);
  cr_assert_str_neq(out, first, "a new key");
}

Test(net_keygen, writes_a_0600_cluster_key, .init = setup, .fini = teardown) {
  char p[300], out[512], err[1024];
  snprintf(p, sizeof p, "%s/cluster", dir);
  const char *args[] = {"keygen", "--cluster", "-o", p, NULL};
  cr_assert_eq(run(args, out, sizeof out, err, sizeof err), 0, "%s", err);
  struct stat st;
  cr_assert_eq(stat(p, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600);
  cr_assert_eq(st.st_size, (off_t)strlen("rumor-cluster-key v1\nkey \n") + NET_PUBKEY_STR_LEN);
  uint8_t k[NET_CLUSTER_KEY_BYTES];
  struct rumor_err e = {0};
  cr_assert_eq(net_cluster_key_load(p, k, &e), 0, "%s", e.msg);
  cr_assert_eq(out[0], '\0', "a cluster key is not printed");
  cr_assert_eq(run(args, out, sizeof out, err, sizeof err), 1, "no overwrite");
}

Test(net_keygen, bad_flags_and_paths_fail_clearly, .init = setup, .fini = teardown) {
  char out[512], err[1024];
  const char *none[] = {"keygen", NULL};
  cr_assert_eq(run(none, out, sizeof out, err, sizeof err), 2);
  cr_assert(strstr(err, "-o FILE"), "%s", err);
  const char *bogus[] = {"keygen", "--bogus", NULL};
  cr_assert_eq(run(bogus, out, sizeof out, err, sizeof err), 2);
  cr_assert(strstr(err, "--bogus"), "%s", err);
  const char *noval[] = {"keygen", "-o", NULL};
  cr_assert_eq(run(noval, out, sizeof out, err, sizeof err), 2);
  const char *both[] = {"keygen", "--public", "x", "--cluster", NULL};
  cr_assert_eq(run(both, out, sizeof out, err, sizeof err), 2);
  const char *nodir[] = {"keygen", "-o", "/nonexistent-dir/id", NULL};
  cr_assert_eq(run(nodir, out, sizeof out, err, sizeof err), 1);
  cr_assert(strstr(err, "/nonexistent-dir/id") && strstr(err, "No such file"), "%s", err);
  char p[300];
  snprintf(p, sizeof p, "%s/readable", dir);
  const char *mk[] = {"keygen", "-o", p, NULL};
  cr_assert_eq(run(mk, out, sizeof out, err, sizeof err), 0);
  cr_assert_eq(chmod(p, 0644), 0);
  const char *pub[] = {"keygen", "--public", p, NULL};
  cr_assert_eq(run(pub, out, sizeof out, err, sizeof err), 1);
  cr_assert(strstr(err, "chmod 600"), "%s", err);
  const char *help[] = {"keygen", "--help", NULL};
  cr_assert_eq(run(help, out, sizeof out, err, sizeof err), 0);
  cr_assert(strstr(out, "--cluster"), "%s", out);
}
