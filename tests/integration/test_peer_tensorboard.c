/* --tensorboard DIR: the event files of `rumor train`, of two gossiping
 * peers and of `rumor top`, read back with the independent record parser of
 * tests/support/tfevents_read.h (both CRCs checked, the protobuf decoded),
 * hold the figures the runs printed: every evaluation line's accuracy and
 * losses, the result line's final figures, the exchange counts, and Ξ. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../support/cluster.h"
#include "../support/cli.h"
#include "../support/fmnist.h"
#include "../support/tfevents_read.h"

static struct cluster C;
static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(tensorboard, .init = setup, .fini = teardown, .timeout = 120);

/* Reads the one event file of DIR/RUN. */
static void read_run(const char *dir, const char *run, struct tfr_file *f) {
  char rundir[512], path[1024], err[256];
  snprintf(rundir, sizeof rundir, "%s/%s", dir, run);
  cr_assert_eq(tfr_find(rundir, path, sizeof path), 1, "want one event file in %s", rundir);
  cr_assert_eq(tfr_read(path, f, err, sizeof err), 0, "%s: %s", path, err);
  cr_assert_str_eq(f->version, "brain.Event:2", "%s: first record", path);
}

/* The value under `tag` at `step` (the last one written there), or NAN. */
static double value_at(const struct tfr_file *f, const char *tag, int64_t step) {
  double v = NAN;
  for (size_t i = 0; i < f->n; i++)
    if (f->s[i].step == step && strcmp(f->s[i].tag, tag) == 0) v = f->s[i].value;
  return v;
}

/* |tb − printed| within what printing with `decimals` decimals and storing
 * as a float leave. */
static void expect_near(double tb, double printed, int decimals, const char *what) {
  double tol = 0.5 * pow(10, -decimals) + 1e-6 * fabs(printed);
  cr_assert(fabs(tb - printed) <= tol, "%s: tensorboard has %.9g, the run printed %.9g", what, tb, printed);
}

/* The number after "key" (and a colon) in a JSON text. */
static double json_number(const char *json, const char *key) {
  char pat[64];
  snprintf(pat, sizeof pat, "\"%s\"", key);
  const char *p = json ? strstr(json, pat) : NULL;
  cr_assert_not_null(p, "no %s in %s", key, json);
  p += strlen(pat);
  while (*p == ' ' || *p == ':') p++;
  return strtod(p, NULL);
}

Test(tensorboard, train_writes_every_evaluation_and_the_final_figures_it_prints) {
  SKIP_WITHOUT_DATA();
  char tb[256], *out, *err;
  snprintf(tb, sizeof tb, "%s/tb/runs", C.dir); /* made like mkdir -p */
  /* 300 samples in batches of 32: 10 steps an epoch, an evaluation on 160
   * test images every 4 steps and at each epoch's end. */
  int st = cli_rumor(C.dir, &out, &err, 120, "train", "--model", "mlp:784-16-10", "--shard", "0/200", "--batch", "32",
                     "--epochs", "3", "--eval-every", "4", "--eval-batches", "5", "--threads", "1", "--log-every", "0",
                     "--tensorboard", tb, NULL);
  cr_assert(proc_exited_with(st, 0), "rumor train failed (%d): %s", st, err);
  struct tfr_file f;
  read_run(tb, "train", &f);

  /* Every evaluation line: "step N: train loss X, test accuracy A, test
   * loss L" and "epoch e/3 done at step N: train loss X, test accuracy A,
   * test loss L". */
  int evals = 0;
  for (char *line = strtok(err, "\n"); line; line = strtok(NULL, "\n")) {
    const char *p = strstr(line, "step "), *q = strstr(line, ": train loss ");
    if (!p || !q || !strstr(line, "test accuracy")) continue;
    long long step = atoll(p + 5);
    double loss = strtod(q + 13, NULL), acc = strtod(strstr(line, "test accuracy ") + 14, NULL),
           tloss = strtod(strstr(line, "test loss ") + 10, NULL);
    expect_near(value_at(&f, "train/loss_avg", step), loss, 4, line);
    expect_near(value_at(&f, "eval/test_accuracy", step), acc, 4, line);
    expect_near(value_at(&f, "eval/test_loss", step), tloss, 4, line);
    evals++;
  }
  cr_assert_geq(evals, 8, "3 epoch ends and the --eval-every lines, got %d", evals);
  /* The final evaluation repeats the last epoch's on the same parameters:
   * one point, not two. */
  cr_assert_eq(tfr_count(&f, "eval/test_accuracy"), (size_t)evals, "%zu evaluations written, %d printed",
               tfr_count(&f, "eval/test_accuracy"), evals);

  /* The result line: the last figures under each tag, to float precision. */
  double steps = json_number(out, "steps");
  const struct tfr_scalar *acc = tfr_last(&f, "eval/test_accuracy"), *tl = tfr_last(&f, "eval/test_loss"),
                          *avg = tfr_last(&f, "train/loss_avg");
  cr_assert(acc && tl && avg);
  cr_assert_eq((double)acc->step, steps, "the final evaluation at step %lld, the run made %.0f steps",
               (long long)acc->step, steps);
  expect_near(acc->value, json_number(out, "test_accuracy"), 7, "test_accuracy");
  expect_near(tl->value, json_number(out, "test_loss"), 7, "test_loss");
  expect_near(avg->value, json_number(out, "train_loss"), 7, "train_loss");

  /* The other figures, at steps that go up. */
  const char *tags[] = {"train/loss", "train/loss_avg", "train/lr", "train/samples_per_s", "train/param_norm",
                        "eval/test_accuracy"};
  for (size_t i = 0; i < sizeof tags / sizeof tags[0]; i++) {
    cr_assert(tfr_steps_increase(&f, tags[i]), "%s: steps do not increase (%zu points)", tags[i],
              tfr_count(&f, tags[i]));
    cr_assert_gt(tfr_last(&f, tags[i])->value, 0, "%s", tags[i]);
  }
  cr_assert_eq(tfr_last(&f, "train/loss")->step, (int64_t)steps, "the last step is written");
  cr_assert_null(tfr_last(&f, "gossip/exchanges"), "rumor train has no exchanges");
  tfr_free(&f);
  free(out);
  free(err);

  /* A directory that cannot be made: a clear error before training. */
  char blocked[300];
  cluster_sh("touch %s/tb/file", C.dir);
  snprintf(blocked, sizeof blocked, "%s/tb/file/sub", C.dir);
  st = cli_rumor(C.dir, NULL, &err, 60, "train", "--model", "mlp:784-16-10", "--tensorboard", blocked, NULL);
  cli_expect_fail(st, 1, err, "--tensorboard", "an unwritable --tensorboard");
}

/* The member name a peer's run takes without --name: the start of its key
 * as in its result line, '/' and '+' replaced. */
static void key_run_name(const char *out_path, char *name, size_t n) {
  char *out = proc_slurp(out_path);
  const char *p = strstr(out, "\"id\":\"");
  cr_assert_not_null(p, "no id in %s", out);
  snprintf(name, n < 9 ? n : 9, "%s", p + 6);
  for (char *c = name; *c; c++) *c = *c == '/' ? '_' : *c == '+' ? '-' : *c;
  free(out);
}

Test(tensorboard, two_peers_write_one_run_each_with_their_exchange_counts) {
  SKIP_WITHOUT_DATA();
  char tb[256];
  snprintf(tb, sizeof tb, "%s/tb", C.dir);
  cluster_start_bootstrap(&C, NULL);
  int peer[2];
  for (int i = 0; i < 2; i++) {
    char shard[16];
    snprintf(shard, sizeof shard, "%d/100", i);
    /* --max-local-steps: each peer holds every 4 steps until an exchange
     * applies, so both count exchanges however fast they train. */
    peer[i] = cluster_start_peer(&C, "--model", "mlp:784-16-10", "--shard", shard, "--batch", "32", "--epochs", "2",
                                 "--eval-batches", "5", "--wait-peers", "2", "--gossip-every", "1",
                                 "--max-local-steps", "4", "--tensorboard", tb,
                                 /* the first is named; the second's run takes its key */
                                 i == 0 ? "--name" : NULL, "alpha", NULL);
  }
  for (int i = 0; i < 2; i++) {
    int st = cluster_wait(&C, peer[i], 90);
    cr_assert(proc_exited_with(st, 0), "peer %d failed (%d): %s", i, st, proc_slurp(C.node[peer[i]].log));
  }
  char runs[2][16];
  snprintf(runs[0], sizeof runs[0], "alpha");
  key_run_name(C.node[peer[1]].out, runs[1], sizeof runs[1]);
  for (int i = 0; i < 2; i++) {
    struct tfr_file f;
    read_run(tb, runs[i], &f);
    const struct tfr_scalar *x = tfr_last(&f, "gossip/exchanges");
    cr_assert_not_null(x, "%s: no gossip/exchanges", runs[i]);
    double printed = cluster_result(&C, peer[i], "exchanges");
    /* Written at the last step, before the step boundary that may apply one more. */
    cr_assert(x->value >= 1 && x->value <= printed, "%s: %g exchanges in tensorboard, %g printed", runs[i], x->value,
              printed);
    const char *counts[] = {"gossip/exchanges_failed", "gossip/exchanges_rejected", "gossip/exchanges_clipped",
                            "gossip/bytes_in", "gossip/bytes_out"};
    for (size_t k = 0; k < sizeof counts / sizeof counts[0]; k++)
      cr_assert(tfr_steps_increase(&f, counts[k]), "%s: %s missing or not along the steps", runs[i], counts[k]);
    cr_assert_gt(tfr_last(&f, "gossip/bytes_out")->value, 0, "%s", runs[i]);
    expect_near(tfr_last(&f, "eval/test_accuracy")->value, cluster_result(&C, peer[i], "test_accuracy"), 7,
                runs[i]);
    tfr_free(&f);
  }
}

Test(tensorboard, top_once_writes_the_consensus_distance_it_prints) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int peer[2];
  for (int i = 0; i < 2; i++) {
    char shard[8];
    snprintf(shard, sizeof shard, "%d/2", i);
    peer[i] = cluster_start_peer(&C, "--model", "mlp:784-16-10", "--shard", shard, "--epochs", "1000", "--max-steps",
                                 "1000000", "--no-eval", "--wait-peers", "2", "--gossip-every", "4", NULL);
  }
  for (int i = 0; i < 2; i++)
    cr_assert(cluster_wait_file(C.node[peer[i]].log, "first step", 60), "peer %d did not start training: %s", i,
              proc_slurp(C.node[peer[i]].log));
  char id[300], tb[256], *out, *err;
  cluster_make_identity(&C, "top", id, sizeof id);
  snprintf(tb, sizeof tb, "%s/toptb", C.dir);
  char *args[] = {"top", "--bootstrap", C.boot, "--cluster-key", C.key, "--identity", id, "--once", "--json",
                  "--exact", "--tensorboard", tb, NULL};
  int st = cluster_run(&C, args, 60, &out, &err);
  cr_assert(proc_exited_with(st, 0), "rumor top failed (%d): %s", st, err);
  struct tfr_file f;
  read_run(tb, "cluster", &f);
  const struct {
    const char *tag, *key;
  } drift[] = {{"cluster/xi", "xi"}, {"cluster/xi_rel", "rel_drift"}, {"cluster/xi_exact", "xi_exact"}};
  for (size_t i = 0; i < sizeof drift / sizeof drift[0]; i++) {
    const struct tfr_scalar *s = tfr_last(&f, drift[i].tag);
    cr_assert_not_null(s, "no %s", drift[i].tag);
    cr_assert_eq(s->step, 0, "%s: the first refresh is step 0", drift[i].tag);
    double printed = json_number(strstr(out, "\"drift\""), drift[i].key);
    cr_assert(isfinite(printed) && printed >= 0, "%s: %s", drift[i].key, out);
    expect_near(s->value, printed, 7, drift[i].tag);
  }
  /* The members the printed table has alive (the bootstrap and two peers,
   * unless one was late to answer a ping). */
  int alive = 0;
  for (const char *p = out; (p = strstr(p, "\"state\"")); p++) {
    const char *v = p + 7;
    while (*v == ' ' || *v == ':') v++;
    alive += strncmp(v, "\"alive\"", 7) == 0;
  }
  cr_assert_geq(alive, 2, "%s", out);
  cr_assert_eq(value_at(&f, "cluster/members_alive", 0), alive);
  for (int i = 0; i < 2; i++) {
    char name[16], tag[64];
    key_run_name(C.node[peer[i]].out, name, sizeof name);
    snprintf(tag, sizeof tag, "member/%s/loss", name);
    const struct tfr_scalar *s = tfr_last(&f, tag);
    cr_assert(s && isfinite(s->value) && s->value > 0, "no %s", tag);
    snprintf(tag, sizeof tag, "member/%s/step", name);
    cr_assert(tfr_last(&f, tag) && tfr_last(&f, tag)->value >= 1, "no %s", tag);
  }
  tfr_free(&f);
  free(out);
  free(err);
}
