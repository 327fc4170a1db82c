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

/* A cut never splits a UTF-8 character: names of 2-byte characters, cut at
 * every parity, end in whole characters before the hash. */
Test(tensorboard_names, a_cut_keeps_whole_characters) {
  for (int extra = 0; extra < 2; extra++) {
    char name[400] = "";
    size_t len = 0;
    if (extra) name[len++] = 'a';
    while (len + 2 < sizeof name - 1) name[len++] = (char)0xC3, name[len++] = (char)0xA9; /* é */
    name[len] = '\0';
    char out[TB_RUN_MAX + 1];
    run_name(name, out);
    const char *dash = strrchr(out, '-');
    cr_assert_not_null(dash, "%s", out);
    size_t body = (size_t)(dash - out) - (size_t)extra;
    cr_assert_eq(body % 2, 0, "a cut inside a character: %zu bytes of é", body);
  }
}
