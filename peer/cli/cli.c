/* The `rumor` command: dispatches to a subcommand. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#ifdef __GLIBC__ /* defined by the headers above */
#include <malloc.h>
#endif

#include "peer/cli/cli_impl.h"

struct subcommand {
  const char *name;
  int (*run)(int argc, char **argv);
  const char *summary;
};

static const struct subcommand commands[] = {
    /* name, function, one-line summary; kept in the order of --help */
    {"train", cmd_train, "train one peer on its own (no network)"},
    {"eval", cmd_eval, "evaluate a checkpoint on a test set"},
    {"sample", cmd_sample, "continue a prompt with a language-model checkpoint"},
    {"peer", cmd_peer, "train as a member of a gossip cluster"},
    {"ps", cmd_ps, "run a parameter server for workers of `rumor peer --sync ps`"},
    {"group", cmd_group, "train as a model-parallel peer group of S stage processes"},
    {"bootstrap", cmd_bootstrap, "run a bootstrap node that newcomers dial first"},
    {"top", cmd_top, "watch a cluster: every member's figures and the drift between replicas"},
    {"keygen", cmd_keygen, "write an identity or a cluster key"},
    {NULL, NULL, NULL},
};

static void usage(FILE *f) {
  fprintf(f, "usage: rumor <command> [options]\n\n"
             "rumor trains one model on many machines by gossip averaging.\n\ncommands:\n");
  for (size_t i = 0; commands[i].name; i++)
    fprintf(f, "  %-10s %s\n", commands[i].name, commands[i].summary);
  fprintf(f, "\nRun 'rumor <command> --help' for the options of one command.\n");
}

/* RUMOR_LOG_LEVEL: debug, info, warn or error. Another value is ignored
 * with one warning, and removed from the environment so that the stage
 * processes of `rumor group` do not repeat it and `rumor top` quietens its
 * log as without it. Main thread, before any other exists. */
static void log_level_from_env(void) {
  const char *level = getenv("RUMOR_LOG_LEVEL");
  if (!level) return;
  static const struct {
    const char *name;
    enum log_level level;
  } levels[] = {{"debug", LOG_DEBUG}, {"info", LOG_INFO}, {"warn", LOG_WARN}, {"error", LOG_ERROR}};
  for (size_t i = 0; i < sizeof levels / sizeof levels[0]; i++)
    if (strcmp(level, levels[i].name) == 0) {
      log_set_level(levels[i].level);
      return;
    }
  fprintf(stderr, "rumor: ignoring RUMOR_LOG_LEVEL='%.64s': not debug, info, warn or error\n", level);
  unsetenv("RUMOR_LOG_LEVEL");
}

#ifdef __GLIBC__
/* Whether the environment sets glibc's tunable `name` ("mmap_threshold"):
 * the operator's choice is left alone. */
static bool malloc_tuned(const char *name, const char *old_var) {
  const char *t = getenv("GLIBC_TUNABLES");
  char full[64];
  snprintf(full, sizeof full, "glibc.malloc.%s=", name);
  return (t && strstr(t, full)) || getenv(old_var);
}
#endif

/* A long-lived peer allocates and frees buffers of a MiB and more under
 * churn (chunk frames beyond the net's pool, relayed frames' backlogs, the
 * state swap of a catch-up). glibc's threshold for giving such a buffer
 * its own mapping slides up to the largest one freed (up to 32 MiB), after
 * which they come from the arenas and their holes are never handed back:
 * the resident set grew by steps over a 10-minute chaos run
 * (tests/bench/bench-chaos.sh). Fixed thresholds: a MiB and more is mapped
 * and unmapped; what recurs every step (relay pieces of 256 KiB, first
 * backlogs of 512 KiB) stays in the arenas, whose tops are trimmed past
 * 4 MiB free rather than at every free. */
static void tune_malloc(void) {
#ifdef __GLIBC__
  /* A tuning only: an allocator that refuses (a sanitizer's) goes on as it is. */
  if (!malloc_tuned("mmap_threshold", "MALLOC_MMAP_THRESHOLD_")) (void)mallopt(M_MMAP_THRESHOLD, 1 << 20);
  if (!malloc_tuned("trim_threshold", "MALLOC_TRIM_THRESHOLD_")) (void)mallopt(M_TRIM_THRESHOLD, 4 << 20);
#endif
}

int cli_main(int argc, char **argv) {
  tune_malloc();
  log_level_from_env();
  /* Before any thread exists: every later thread inherits the blocked stop
   * signals, which only the signal thread receives (see util.h). */
  if (signals_init() != 0) {
    fprintf(stderr, "rumor: cannot set up signal handling\n");
    return 1;
  }
  if (argc < 2) {
    usage(stderr);
    return 2;
  }
  if (strcmp(argv[1], "--help") == 0 || strcmp(argv[1], "-h") == 0 || strcmp(argv[1], "help") == 0) {
    usage(stdout);
    return 0;
  }
  if (strcmp(argv[1], "--version") == 0) {
    printf("rumor %s\n", RUMOR_VERSION);
    return 0;
  }
  for (size_t i = 0; commands[i].name; i++)
    if (strcmp(argv[1], commands[i].name) == 0) return commands[i].run(argc - 1, argv + 1);
  fprintf(stderr, "rumor: unknown command '%s'\n\n", argv[1]);
  usage(stderr);
  return 2;
}
