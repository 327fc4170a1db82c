/*
 * rumor-testing: the `rumor` command over the testing builds of gossip and
 * net (RUMOR_TESTING), for the tests that need a member to misbehave.
 *
 * It takes everything `rumor` takes, plus `--attack KIND` anywhere on the
 * command line (for `peer` and `group`): the option is taken out, and KIND
 * goes to the gossip runtime through RUMOR_TEST_ATTACK (gossip/testing.c),
 * which the stages a launcher starts inherit. The release binary has no such
 * option and no such code.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/cli/cli.h"
#include "util/util.h"

int main(int argc, char **argv) {
  int n = 0;
  for (int i = 0; i < argc; i++) {
    if (strcmp(argv[i], "--attack") == 0) {
      if (i + 1 >= argc) {
        fprintf(stderr, "rumor-testing: --attack needs a KIND (nan, inf, scale, signflip, replay, short, flood, "
                        "loseready, baddonor, badfin, freeze, freezexch, slowconfirm, nangrad, staleready)\n");
        return 2;
      }
      setenv("RUMOR_TEST_ATTACK", argv[++i], 1);
      continue;
    }
    if (STR_PREFIX(argv[i], "--attack=")) {
      setenv("RUMOR_TEST_ATTACK", argv[i] + STR_LEN("--attack="), 1);
      continue;
    }
    argv[n++] = argv[i];
  }
  argv[n] = NULL;
  return cli_main(n, argv);
}
