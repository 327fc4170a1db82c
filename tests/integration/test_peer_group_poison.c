/* A poisoned group among model-parallel groups (rumor-testing group --attack,
 * the testing build): its stages send their slices sign-flipped, which
 * passes the distance bound. Stages take `rumor peer`'s gossip defences
 * (--clip, --max-local-steps, rate limits) from the same option table and
 * run the same sync path, so with --clip every honest group trains as it
 * would among honest groups, and the control run without --clip shows that
 * the attack does real damage. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../support/cluster.h"
#include "../support/fmnist.h"

static struct cluster C;

/* The testing build: --attack exists there only. */
static void setup(void) {
  cluster_init(&C);
  C.bin = RUMOR_TESTING_BIN;
}
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(group_poison, .init = setup, .fini = teardown, .timeout = 300);

#define GROUPS 6
#define ATTACKER 2

/* Six groups of two stages on sixth shards, the third sign-flipping its
 * slices; every group with `clip` or without (with clipping the honest
 * groups end within a few thousandths of six honest groups: 0.861-0.865
 * against 0.864-0.866, and about 0.57-0.69 without). Returns the worst honest
 * group's test accuracy; *skipped gets the attacker's updates that honest
 * stages skipped as outliers (from their result lines). */
static double run(bool clip, double *skipped) {
  char boot[160];
  cluster_start_stage_bootstraps(&C, boot, sizeof boot);
  struct cluster_group g[GROUPS];
  char names[GROUPS][8];
  for (int i = 0; i < GROUPS; i++) {
    char shard[8];
    snprintf(names[i], sizeof names[i], "g%d", i);
    snprintf(shard, sizeof shard, "%d/%d", i, GROUPS);
    char *args[40] = {"--stages", "2", "--bootstrap", boot, "--model", "mlp:784-128-10", "--micro-batches", "2",
                      "--shard", shard, "--epochs", "4", "--batch", "64", "--lr", "0.1", "--no-eval", "--wait-peers",
                      "6", "--gossip-every", "1", "--max-local-steps", "8"};
    int n = 23;
    if (clip) args[n++] = "--clip";
    if (i == ATTACKER) args[n++] = "--attack", args[n++] = "signflip";
    args[n] = NULL;
    cluster_start_group(&C, &g[i], names[i], args);
  }
  double worst = 1;
  *skipped = 0;
  for (int i = 0; i < GROUPS; i++) {
    int st = proc_wait(g[i].pid, 240);
    cr_assert(proc_exited_with(st, 0), "group %s failed (status %d): %s", names[i], st, proc_slurp(g[i].log));
    if (i == ATTACKER) continue;
    double acc = cluster_line_number(g[i].out, "\"status\":\"ok\"", "test_accuracy");
    double clipped = 0, x = 0;
    for (int s = 0; s < 2; s++) {
      char has[64];
      snprintf(has, sizeof has, "\"stage\":%d,\"stages\":2,\"steps\"", s);
      *skipped += cluster_line_number(g[i].out, has, "exchanges_skipped");
      clipped += cluster_line_number(g[i].out, has, "exchanges_clipped");
      x += cluster_line_number(g[i].out, has, "exchanges");
    }
    fprintf(stderr, "signflip group, clipping %s: honest group %s: test accuracy %.4f, %.0f exchanges, %.0f clipped\n",
            clip ? "on" : "off", names[i], acc, x, clipped);
    if (!(acc >= worst)) worst = acc; /* NaN counts as worst */
  }
  return worst;
}

/* The bounds: with clipping the honest groups end at 0.843-0.866 on a
 * quiet machine (the same with the release before, built the same way:
 * 0.856-0.865) and were seen at 0.846-0.865 under the full suite's load,
 * once, in CI's run on a fresh clone, at 0.828-0.838, and once below 0.81
 * under the full suite's load on 2 cores (fewer of the attacker's updates
 * arrive as outliers when exchanges are slow); without it the worst falls
 * to 0.03-0.51 (0.10 on a quiet machine), and once, in CI's run on a fresh
 * clone under the full suite's load, only to 0.73 (slow exchanges carry
 * fewer of the attacker's updates there too). One bound separates the
 * two: 0.76, which every run with clipping has cleared and no run without
 * it has. A defence that stopped working would put the protected run
 * among the unprotected ones, below 0.76; the gap between the pair is what
 * the tests show. */
#define PROTECTED_MIN 0.76
#define UNPROTECTED_MAX PROTECTED_MIN

Test(group_poison, with_clipping_a_signflipping_group_leaves_every_honest_group_above_076) {
  SKIP_WITHOUT_DATA();
  double skipped, worst = run(true, &skipped);
  fprintf(stderr, "worst honest group with clipping: %.4f; %.0f attacker updates skipped as outliers\n", worst,
          skipped);
  cr_assert(worst >= PROTECTED_MIN, "an honest group reached only %.4f with clipping on", worst);
  cr_assert_gt(skipped, 0, "no honest stage skipped the attacker's outliers");
}

Test(group_poison, without_clipping_a_signflipping_group_does_real_damage) {
  /* The control: the attack above is strong enough to matter. */
  SKIP_WITHOUT_DATA();
  double skipped, worst = run(false, &skipped);
  fprintf(stderr, "worst honest group without clipping: %.4f\n", worst);
  cr_assert(worst < UNPROTECTED_MAX, "without clipping every honest group still reached %.4f: the attack proves nothing",
            worst);
}
