/*
 * cli.h — running the rumor binary from a command-line test: one run with
 * its output captured, the check of a clean failure, and a number read from
 * a JSON result line.
 *
 * Header-only (static inline functions). Include after criterion.h and
 * proc.h; RUMOR_BIN names the binary (set by tests/CMakeLists.txt).
 */
#ifndef RUMOR_TESTS_CLI_H
#define RUMOR_TESTS_CLI_H

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

/* Runs RUMOR_BIN with the arguments that follow `secs` (NULL-terminated, at
 * most 62) in the directory `cwd`, with `secs` as its deadline; stdout and
 * stderr go to *out and *err (either may be NULL). Returns the wait status,
 * as proc_run does. */
static inline int cli_rumor(const char *cwd, char **out, char **err, double secs, ...) {
  char *argv[64];
  int n = 0;
  argv[n++] = RUMOR_BIN;
  va_list ap;
  va_start(ap, secs);
  for (char *a; n < 63 && (a = va_arg(ap, char *)) != NULL;) argv[n++] = a;
  va_end(ap);
  argv[n] = NULL;
  return proc_run(argv, secs, cwd, out, err);
}

/* Asserts a clean failure: a normal exit with `code`, and stderr containing
 * `needle`. Frees `err`. */
static inline void cli_expect_fail(int st, int code, char *err, const char *needle, const char *what) {
  cr_assert(st >= 0 && WIFEXITED(st), "%s: did not exit normally (status %d): %s", what, st, err);
  cr_assert_eq(WEXITSTATUS(st), code, "%s: exit %d, want %d: %s", what, WEXITSTATUS(st), code, err);
  cr_assert(strstr(err, needle) != NULL, "%s: stderr should mention '%s': %s", what, needle, err);
  free(err);
}

/* The number after "key": in a JSON line, or NaN where the key is absent. */
static inline double cli_json_number(const char *json, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\":", key);
  const char *p = json ? strstr(json, pat) : NULL;
  return p ? strtod(p + strlen(pat), NULL) : NAN;
}

#endif
