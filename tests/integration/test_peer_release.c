/* What the release build is and offers: no attack, no test entry point and
 * no testing code in the `rumor` binary (they live in rumor-testing only);
 * the gossip options (clipping, the drift bound, rate limits) are one table,
 * taken with the same defaults by `rumor peer`, `rumor group` and a stage
 * (`rumor peer --group G --stage s/S`); and --version reports the project's
 * version. */
#include <criterion/criterion.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../support/proc.h"

static char dir[64];

static void setup(void) { proc_scratch_make(dir, sizeof dir, "release"); }
static void teardown(void) { proc_scratch_remove(dir); }
TestSuite(release, .init = setup, .fini = teardown, .timeout = 120);

/* Runs `bin args...`; returns the wait status with stdout and stderr. */
static int run(const char *bin, char **out, char **err, char *const *args) {
  char *argv[32];
  int n = 0;
  argv[n++] = (char *)bin;
  for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
  argv[n] = NULL;
  return proc_run(argv, 60, dir, out, err);
}

Test(release, peer_help_offers_no_attack_and_the_option_is_refused) {
  char *out, *err;
  int st = run(RUMOR_BIN, &out, &err, (char *[]){"peer", "--help", NULL});
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert(strstr(out, "--clip") != NULL, "the help lists the real options: %s", out);
  cr_assert(strstr(out, "attack") == NULL && strstr(out, "TESTING") == NULL, "the release help offers testing: %s", out);
  free(out), free(err);
  st = run(RUMOR_BIN, &out, &err,
           (char *[]){"peer", "--attack", "signflip", "--cluster-key", "k", "--identity", "i", NULL});
  cr_assert(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) == 2, "status %d: %s", st, err);
  cr_assert(strstr(err, "unknown option '--attack'") != NULL, "%s", err);
  free(out), free(err);
}

Test(release, the_release_binary_carries_no_testing_code) {
  size_t n, m;
  char *bin = proc_slurp_n(RUMOR_BIN, &n), *testing = proc_slurp_n(RUMOR_TESTING_BIN, &m);
  cr_assert(n > 100000 && m > 100000, "cannot read the binaries (%zu and %zu bytes)", n, m);
  /* Strings and symbols only the testing build has: the attack's variable,
   * its log line, and the transport's test hooks. The testing binary has
   * them, so the check can fail. */
  const char *marks[] = {"RUMOR_TEST_ATTACK", "TESTING ONLY", "net_test_conn_write_raw", "gossip_testing_snapshot"};
  for (size_t i = 0; i < sizeof marks / sizeof marks[0]; i++) {
    cr_assert(memmem(testing, m, marks[i], strlen(marks[i])) != NULL, "rumor-testing lacks '%s'", marks[i]);
    cr_assert(memmem(bin, n, marks[i], strlen(marks[i])) == NULL, "the release binary contains '%s'", marks[i]);
  }
  free(bin), free(testing);
}

/* The help line of option `opt` ("  --opt ..."), up to its end, or "". */
static void help_line(const char *help, const char *opt, char *line, size_t n) {
  char pat[64];
  snprintf(pat, sizeof pat, "  --%s ", opt);
  const char *p = strstr(help, pat);
  line[0] = '\0';
  if (!p) return;
  const char *q = strchr(p, '\n');
  snprintf(line, n, "%.*s", (int)(q ? q - p : (long)strlen(p)), p);
}

Test(release, peer_group_and_stage_take_the_same_gossip_options_with_the_same_defaults) {
  char *peer, *group, *stage, *err;
  cr_assert(proc_exited_with(run(RUMOR_BIN, &peer, &err, (char *[]){"peer", "--help", NULL}), 0));
  free(err);
  cr_assert(proc_exited_with(run(RUMOR_BIN, &group, &err, (char *[]){"group", "--help", NULL}), 0));
  free(err);
  cr_assert(
      proc_exited_with(run(RUMOR_BIN, &stage, &err, (char *[]){"peer", "--group", "g", "--stage", "0/2", "--help", NULL}), 0));
  free(err);
  const char *opts[] = {"clip", "clip-tau", "max-local-steps", "max-hold-ms", "max-exchange-rate", "max-conn-rate",
                        "gossip-every", "alpha", "wire", "max-distance", "exchange-timeout-ms", "sketch-k",
                        "train-cpus", "net-cpus", "linger-ms"};
  for (size_t i = 0; i < sizeof opts / sizeof opts[0]; i++) {
    char a[512], b[512], c[512];
    help_line(peer, opts[i], a, sizeof a);
    help_line(group, opts[i], b, sizeof b);
    help_line(stage, opts[i], c, sizeof c);
    cr_assert(a[0] && b[0] && c[0], "--%s missing: peer '%s', group '%s', stage '%s'", opts[i], a, b, c);
    cr_assert_str_eq(a, b, "--%s differs between peer and group", opts[i]);
    cr_assert_str_eq(a, c, "--%s differs between peer and a stage", opts[i]);
  }
  free(peer), free(group), free(stage);
}

Test(release, version_is_the_projects) {
  char *out, *err;
  cr_assert(proc_exited_with(run(RUMOR_BIN, &out, &err, (char *[]){"--version", NULL}), 0));
  char want[64];
  snprintf(want, sizeof want, "rumor %s\n", RUMOR_VERSION);
  cr_assert_str_eq(out, want);
  free(out), free(err);
}
