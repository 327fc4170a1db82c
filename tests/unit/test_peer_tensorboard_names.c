/* TensorBoard run names (peer/cli/tensorboard.c, tb_run_name): a name that
 * is already a path component stays as it is; one that must change ('/'
 * or backslash, too long, empty, "." or "..") becomes a path component that
 * no other name maps to. */
#include <criterion/criterion.h>
#include <string.h>

#include "peer/cli/cli_impl.h"
#include "util/tfevents.h"

static void run_name(const char *name, char out[TB_RUN_MAX + 1]) {
  tb_run_name(name, out, TB_RUN_MAX + 1);
  cr_assert(out[0] && strcmp(out, ".") != 0 && strcmp(out, "..") != 0, "'%s' → '%s'", name, out);
  cr_assert_null(strchr(out, '/'), "'%s' → '%s'", name, out);
  cr_assert_null(strchr(out, '\\'), "'%s' → '%s'", name, out);
  cr_assert_leq(strlen(out), TB_RUN_MAX, "'%s' → %zu bytes", name, strlen(out));
}

Test(tensorboard_names, plain_names_are_kept) {
  char out[TB_RUN_MAX + 1];
  static const char *const names[] = {"peer-1", "train", "grp:s2", "a_b", "Ω-ünïcode"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
    run_name(names[i], out);
    cr_assert_str_eq(out, names[i]);
  }
}

Test(tensorboard_names, names_that_must_change_stay_apart) {
  char long_a[300], long_b[300];
  memset(long_a, 'x', sizeof long_a - 1);
  long_a[sizeof long_a - 1] = '\0';
  memcpy(long_b, long_a, sizeof long_b);
  long_b[200] = 'y'; /* differs only past the cut */
  static const char *fixed[] = {"a/b", "a\\b", "a_b", "", ".", "..", "_", "a//b", "a__b"};
  const char *names[sizeof fixed / sizeof fixed[0] + 2];
  size_t n = 0;
  for (size_t i = 0; i < sizeof fixed / sizeof fixed[0]; i++) names[n++] = fixed[i];
  names[n++] = long_a;
  names[n++] = long_b;
  char out[sizeof names / sizeof names[0]][TB_RUN_MAX + 1];
  for (size_t i = 0; i < n; i++) run_name(names[i], out[i]);
  for (size_t i = 0; i < n; i++)
    for (size_t j = i + 1; j < n; j++)
      cr_assert_str_neq(out[i], out[j], "'%.40s' and '%.40s' share the run '%s'", names[i], names[j], out[i]);
  cr_assert_eq(strncmp(out[0], "a_b-", 4), 0, "a/b → %s", out[0]);
  cr_assert_eq(strlen(out[n - 1]), TB_RUN_MAX, "a long name is cut to the longest run name");
}
