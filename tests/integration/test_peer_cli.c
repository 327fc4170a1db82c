/* The `rumor` command as a user runs it: one epoch of Fashion-MNIST reaches
 * the target accuracy; checkpoints evaluate and resume bit for bit, and
 * those written by release 0.1 still evaluate and resume; bad flags, bad
 * data, bad checkpoints, unusable checkpoint destinations, resumed runs
 * given another batch, shard or seed, unknown devices and FIFOs given as
 * input files give a clear message and a non-zero exit, never a crash or a
 * hang. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include "peer/train/train.h"
#include "../support/proc.h"
#include "../support/cli.h"
#include "../support/ckpt_params.h"
#include "../support/fmnist.h"

static char dir[64];

static void setup(void) { proc_scratch_make(dir, sizeof dir, "cli"); }
static void teardown(void) { proc_scratch_remove(dir); }
/* rumor(&out, &err, secs, args..., NULL): the binary run in this suite's scratch directory. */
#define rumor(out, err, secs, ...) cli_rumor(dir, out, err, secs, __VA_ARGS__)

TestSuite(cli, .init = setup, .fini = teardown, .timeout = 300);

Test(cli, one_epoch_reaches_084_and_eval_agrees) {
  SKIP_WITHOUT_DATA();
  char ck[256], *out, *err;
  snprintf(ck, sizeof ck, "%s/one.safetensors", dir);
  int st = rumor(&out, &err, 240, "train", "--model", "mlp:784-512-256-10", "--epochs", "1", "--threads", "2",
                 "--log-every", "0", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "train failed: %s", err);
  double acc = cli_json_number(out, "test_accuracy");
  cr_assert(acc >= 0.84, "one epoch reached test accuracy %.4f < 0.84 (%s)", acc, out);
  free(out), free(err);
  st = rumor(&out, &err, 60, "eval", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "eval failed: %s", err);
  double eacc = cli_json_number(out, "accuracy");
  cr_assert(fabs(eacc - acc) < 1e-6, "eval says %.6f, train said %.6f", eacc, acc);
  free(out), free(err);
}

Test(cli, resume_continues_bit_for_bit) {
  SKIP_WITHOUT_DATA();
  /* 120 steps straight vs 60 steps, stop, resume for 60 more: identical
   * parameters and optimizer state. */
  char a[256], b[256], *out, *err;
  snprintf(a, sizeof a, "%s/straight.safetensors", dir);
  snprintf(b, sizeof b, "%s/halves.safetensors", dir);
  int st = rumor(&out, &err, 120, "train", "--model", "mlp:784-64-10", "--epochs", "1", "--threads", "1",
                 "--log-every", "0", "--no-eval", "--shard", "1/4", "--max-steps", "100", "--checkpoint", a, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  st = rumor(&out, &err, 120, "train", "--model", "mlp:784-64-10", "--epochs", "1", "--threads", "1",
             "--log-every", "0", "--no-eval", "--shard", "1/4", "--max-steps", "50", "--checkpoint", b, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  st = rumor(&out, &err, 120, "train", "--resume", b, "--epochs", "1", "--threads", "1", "--log-every", "0",
             "--no-eval", "--max-steps", "100", "--checkpoint", b, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert(strstr(err, "resumed from") != NULL, "%s", err);
  free(out), free(err);
  size_t na, nb;
  char *fa = proc_slurp_n(a, &na), *fb = proc_slurp_n(b, &nb);
  cr_assert_eq(na, nb, "checkpoint sizes differ");
  cr_assert_eq(memcmp(fa, fb, na), 0, "a resumed run differs from the straight run");
  free(fa), free(fb);
}

Test(cli, resume_keeps_the_runs_optimizer_and_schedule) {
  SKIP_WITHOUT_DATA();
  /* An AdamW run of 3 epochs, stopped at step 40 and resumed without
   * --optimizer or --epochs, goes on as AdamW on the 3-epoch schedule: the
   * same file as the run that never stopped. */
  char a[256], b[256], *out, *err;
  snprintf(a, sizeof a, "%s/adamw-straight.safetensors", dir);
  snprintf(b, sizeof b, "%s/adamw-halves.safetensors", dir);
  char *common[] = {"--model", "mlp:784-32-10", "--optimizer", "adamw", "--lr", "0.002", "--epochs", "3",
                    "--threads", "1", "--log-every", "0", "--no-eval", "--shard", "2/4"};
  int st = rumor(&out, &err, 120, "train", common[0], common[1], common[2], common[3], common[4], common[5], common[6],
                 common[7], common[8], common[9], common[10], common[11], common[12], common[13], common[14],
                 "--max-steps", "80", "--checkpoint", a, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  st = rumor(&out, &err, 120, "train", common[0], common[1], common[2], common[3], common[4], common[5], common[6],
             common[7], common[8], common[9], common[10], common[11], common[12], common[13], common[14], "--max-steps",
             "40", "--checkpoint", b, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  st = rumor(&out, &err, 120, "train", "--resume", b, "--threads", "1", "--log-every", "0", "--no-eval", "--lr",
             "0.002", "--max-steps", "80", "--checkpoint", b, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert(!strstr(err, "starting it from zero"), "the AdamW state was dropped: %s", err);
  free(out), free(err);
  size_t na, nb;
  char *fa = proc_slurp_n(a, &na), *fb = proc_slurp_n(b, &nb);
  cr_assert(na == nb && memcmp(fa, fb, na) == 0, "the resumed run left the run's optimizer or schedule");
  free(fa), free(fb);
  /* Asking for another optimizer than the file's state is refused. */
  st = rumor(NULL, &err, 60, "train", "--resume", b, "--optimizer", "sgd", "--max-steps", "90", NULL);
  cli_expect_fail(st, 1, err, "--optimizer sgd does not match the checkpoint", "resume with another optimizer");
}

Test(cli, bad_flags_are_usage_errors) {
  char *err;
  struct {
    const char *a, *b, *needle;
  } cases[] = {
      {"--bogus", NULL, "unknown option '--bogus'"},
      {"--epochs", "0", "--epochs"},
      {"--epochs", "ten", "'ten'"},
      {"--lr", "abc", "--lr"},
      {"--lr", "nan", "--lr"},
      {"--batch", "-3", "--batch"},
      {"--shard", "5/4", "bad shard '5/4'"},
      {"--shard", "0/1000000", "bad shard '0/1000000': expected i/n with 0 <= i < n <= 65536"},
      {"--model", "mlp:784-x-10", "mlp:784-x-10"},
      {"--optimizer", "rmsprop", "--optimizer"},
      {"--epochs", NULL, "needs a value"},
      {"stray", NULL, "unexpected argument 'stray'"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    int st = rumor(NULL, &err, 30, "train", cases[i].a, cases[i].b, NULL);
    cli_expect_fail(st, 2, err, cases[i].needle, cases[i].a);
  }
  int st = rumor(NULL, &err, 30, "frobnicate", NULL);
  cli_expect_fail(st, 2, err, "unknown command 'frobnicate'", "unknown command");
  st = rumor(NULL, &err, 30, "eval", NULL);
  cli_expect_fail(st, 2, err, "--checkpoint", "eval without checkpoint");
}

/* --eval-batches' help says what 0 and the default -1 mean. */
Test(cli, eval_batches_help_says_what_0_and_minus_1_mean) {
  char *out;
  int st = rumor(&out, NULL, 30, "train", "--help", NULL);
  cr_assert(proc_exited_with(st, 0));
  const char *line = strstr(out, "--eval-batches");
  cr_assert(line && strstr(line, "0: all of it") && strstr(line, "-1: all test images"), "%s", out);
  free(out);
}

/* An unknown RUMOR_LOG_LEVEL is named once, with the accepted values, and
 * ignored; a known one says nothing. */
Test(cli, an_unknown_log_level_is_named_and_ignored) {
  char *err;
  cr_assert_eq(setenv("RUMOR_LOG_LEVEL", "verbose", 1), 0);
  int st = rumor(NULL, &err, 30, "train", "--epochs", "0", NULL);
  const char *warn = "ignoring RUMOR_LOG_LEVEL='verbose': not debug, info, warn or error";
  const char *first = strstr(err, warn);
  cr_assert(first && !strstr(first + 1, warn), "the warning should appear once: %s", err);
  cli_expect_fail(st, 2, err, "--epochs", "a usage error under an unknown log level");
  cr_assert_eq(setenv("RUMOR_LOG_LEVEL", "warn", 1), 0);
  st = rumor(NULL, &err, 30, "train", "--epochs", "0", NULL);
  cr_assert_null(strstr(err, "RUMOR_LOG_LEVEL"), "%s", err);
  cli_expect_fail(st, 2, err, "--epochs", "a usage error under a known log level");
  unsetenv("RUMOR_LOG_LEVEL");
}

static void copy_dataset(const char *to) {
  char cmd[1024];
  snprintf(cmd, sizeof cmd, "mkdir -p %s && cp " RUMOR_FMNIST_DIR "/*.gz %s/ && gunzip -f %s/*.gz", to, to, to);
  cr_assert_eq(system(cmd), 0);
}

Test(cli, bad_data_is_reported_not_crashed_on) {
  SKIP_WITHOUT_DATA();
  char *err, d[256], cmd[1024];
  int st = rumor(NULL, &err, 30, "train", "--data", "/nonexistent/data", NULL);
  cli_expect_fail(st, 1, err, "/nonexistent/data", "missing data dir");

  snprintf(d, sizeof d, "%s/data", dir);
  copy_dataset(d);
  /* wrong magic */
  snprintf(cmd, sizeof cmd, "printf '\\000\\000\\010\\007' | dd of=%s/train-images-idx3-ubyte bs=1 count=4 conv=notrunc 2>/dev/null", d);
  cr_assert_eq(system(cmd), 0);
  st = rumor(NULL, &err, 60, "train", "--data", d, "--epochs", "1", NULL);
  cli_expect_fail(st, 1, err, "wrong IDX magic", "wrong magic");
  copy_dataset(d);
  /* truncated */
  snprintf(cmd, sizeof cmd, "truncate -s 1000000 %s/train-images-idx3-ubyte", d);
  cr_assert_eq(system(cmd), 0);
  st = rumor(NULL, &err, 60, "train", "--data", d, "--epochs", "1", NULL);
  cli_expect_fail(st, 1, err, "truncated", "truncated images");
  copy_dataset(d);
  /* labels for fewer images than there are */
  snprintf(cmd, sizeof cmd, "printf '\\000\\000\\352\\137' | dd of=%s/train-labels-idx1-ubyte bs=1 seek=4 count=4 conv=notrunc 2>/dev/null && truncate -s 60007 %s/train-labels-idx1-ubyte", d, d);
  cr_assert_eq(system(cmd), 0);
  st = rumor(NULL, &err, 60, "train", "--data", d, "--epochs", "1", NULL);
  cli_expect_fail(st, 1, err, "60000 images but", "label count");
  /* a model that does not fit the data */
  copy_dataset(d);
  st = rumor(NULL, &err, 60, "train", "--data", d, "--model", "mlp:100-10", NULL);
  cli_expect_fail(st, 1, err, "takes 100 inputs", "input width");
  st = rumor(NULL, &err, 60, "train", "--data", d, "--model", "mlp:784-5", NULL);
  cli_expect_fail(st, 1, err, "5 outputs", "output width");
}

/* A learning rate far too high: the loss becomes NaN within a few steps.
 * The run stops with an error naming the divergence, and the checkpoint
 * saved every step keeps the last finite parameters (before, the run
 * exited 0 and saved NaN). */
Test(cli, a_diverging_run_stops_and_keeps_its_last_good_checkpoint) {
  SKIP_WITHOUT_DATA();
  char ck[256], *out, *err;
  snprintf(ck, sizeof ck, "%s/diverged.safetensors", dir);
  int st = rumor(&out, &err, 60, "train", "--model", "mlp:784-64-10", "--lr", "1e4", "--schedule", "constant",
                 "--max-steps", "100", "--threads", "1", "--log-every", "0", "--no-eval", "--shard", "1/4",
                 "--checkpoint", ck, "--checkpoint-every", "1", NULL);
  free(out);
  cr_assert(strstr(err, "checkpoint saved") != NULL, "no step was saved before the divergence: %s", err);
  cli_expect_fail(st, 1, err, "training diverged", "a diverging run");
  int64_t n;
  float *p = ckpt_params_load(ck, &n);
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) bad += !isfinite(p[i]);
  free(p);
  cr_assert_eq(bad, 0, "the kept checkpoint has %lld non-finite parameters of %lld", (long long)bad, (long long)n);
}

Test(cli, bad_checkpoints_and_devices_are_reported) {
  SKIP_WITHOUT_DATA();
  char *err, ck[256], cmd[512];
  snprintf(ck, sizeof ck, "%s/c.safetensors", dir);
  int st = rumor(NULL, &err, 120, "train", "--model", "mlp:784-16-10", "--max-steps", "5", "--no-eval",
                 "--log-every", "0", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(err);
  snprintf(cmd, sizeof cmd, "printf 'X' | dd of=%s bs=1 seek=5000 count=1 conv=notrunc 2>/dev/null", ck);
  cr_assert_eq(system(cmd), 0);
  st = rumor(NULL, &err, 60, "eval", "--checkpoint", ck, NULL);
  cli_expect_fail(st, 1, err, "digest mismatch", "bit-flipped checkpoint");
  st = rumor(NULL, &err, 60, "train", "--resume", ck, NULL);
  cli_expect_fail(st, 1, err, "digest mismatch", "resume from a corrupt checkpoint");
  snprintf(cmd, sizeof cmd, "truncate -s 100 %s", ck);
  cr_assert_eq(system(cmd), 0);
  st = rumor(NULL, &err, 60, "eval", "--checkpoint", ck, NULL);
  cli_expect_fail(st, 1, err, ck, "truncated checkpoint");
  st = rumor(NULL, &err, 60, "eval", "--checkpoint", "/nonexistent.safetensors", NULL);
  cli_expect_fail(st, 1, err, "/nonexistent.safetensors", "missing checkpoint");
  /* A run that resumes keeps its batches: a given --batch, --shard or seed
   * that differs from the file's is refused, not dropped (a new run's file
   * replaces the damaged ck). */
  st = rumor(NULL, &err, 120, "train", "--model", "mlp:784-16-10", "--max-steps", "2", "--no-eval", "--log-every", "0",
             "--shard", "1/4", "--batch", "8", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(err);
  st = rumor(NULL, &err, 60, "train", "--resume", ck, "--batch", "64", "--max-steps", "3", NULL);
  cli_expect_fail(st, 1, err, "--batch 64 does not match the checkpoint", "resume with another batch");
  st = rumor(NULL, &err, 60, "train", "--resume", ck, "--shard", "0/4", "--max-steps", "3", NULL);
  cli_expect_fail(st, 1, err, "--shard 0/4 does not match the checkpoint", "resume with another shard");
  st = rumor(NULL, &err, 60, "train", "--resume", ck, "--seed", "99", "--max-steps", "3", NULL);
  cli_expect_fail(st, 1, err, "--seed 99 does not match the checkpoint", "resume with another seed");
  st = rumor(NULL, &err, 60, "train", "--resume", ck, "--shard", "1/4", "--batch", "8", "--max-steps", "3", "--no-eval",
             "--log-every", "0", NULL);
  cr_assert(proc_exited_with(st, 0), "the same batch and shard as the file's were refused: %s", err);
  free(err);
  /* A destination that cannot be written is refused before any training,
   * not at the first save after it. */
  char bad[300];
  snprintf(bad, sizeof bad, "%s/missing-dir/x.safetensors", dir);
  st = rumor(NULL, &err, 60, "train", "--model", "mlp:784-16-10", "--epochs", "1", "--checkpoint", bad, NULL);
  cr_assert(!strstr(err, "epoch 1/1 done"), "trained before refusing the checkpoint path: %s", err);
  cli_expect_fail(st, 1, err, "missing-dir: No such file or directory", "checkpoint in a missing directory");
  snprintf(bad, sizeof bad, "%s/", ck);
  st = rumor(NULL, &err, 60, "train", "--model", "mlp:784-16-10", "--max-steps", "1", "--checkpoint", bad, NULL);
  cli_expect_fail(st, 1, err, "exists and is not a directory", "a file given as a checkpoint directory");
  st = rumor(NULL, &err, 60, "train", "--device", "tpu:0", "--max-steps", "1", NULL);
  cli_expect_fail(st, 1, err, "unknown device 'tpu:0'", "unknown device");
  st = rumor(NULL, &err, 60, "train", "--device", "cuda:7", "--max-steps", "1", NULL);
  cli_expect_fail(st, 1, err, "cuda:7", "absent GPU");
}

/* Every input file a user names, given as a FIFO (no writer), used to block
 * in open(2) with the stop signals blocked: only SIGKILL ended it. Each is
 * now refused at once, exit 1, naming the path. A 15 s deadline per command
 * turns a regression into a failure instead of a hung suite. */
Test(cli, a_fifo_given_as_any_input_file_is_refused_not_waited_on) {
  char f[128], d[128], idx[128], cfg[192], key[128], id[128], *err;
  snprintf(f, sizeof f, "%s/fifo", dir);
  snprintf(d, sizeof d, "%s/hub", dir);          /* a checkpoint directory whose config.json is a FIFO */
  snprintf(idx, sizeof idx, "%s/idx", dir);      /* an IDX data directory whose files are FIFOs */
  snprintf(cfg, sizeof cfg, "%s/config.json", d);
  snprintf(key, sizeof key, "%s/cluster.key", dir);
  snprintf(id, sizeof id, "%s/id", dir);
  cr_assert_eq(mkfifo(f, 0600), 0);
  cr_assert(mkdir(d, 0700) == 0 && mkfifo(cfg, 0600) == 0 && mkdir(idx, 0700) == 0);
  const char *idx_names[] = {"train-images-idx3-ubyte", "train-labels-idx1-ubyte", "t10k-images-idx3-ubyte",
                             "t10k-labels-idx1-ubyte"};
  for (size_t i = 0; i < 4; i++) {
    char p[192];
    snprintf(p, sizeof p, "%s/%s", idx, idx_names[i]);
    cr_assert_eq(mkfifo(p, 0600), 0);
  }
  int st = rumor(NULL, &err, 30, "keygen", "--cluster", "-o", key, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(err);
  st = rumor(NULL, &err, 30, "keygen", "-o", id, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(err);
  struct {
    const char *what, *args[14], *names; /* args: NULL-terminated */
  } cases[] = {
      {"peer --identity", {"peer", "--cluster-key", key, "--identity", f, "--model", "mlp:784-16-10"}, f},
      {"peer --cluster-key", {"peer", "--cluster-key", f, "--identity", id, "--model", "mlp:784-16-10"}, f},
      {"bootstrap --allow-list", {"bootstrap", "--listen", "127.0.0.1:0", "--cluster-key", key, "--identity", id,
                                  "--allow-list", f}, f},
      {"keygen --public", {"keygen", "--public", f}, f},
      {"train --resume", {"train", "--resume", f}, f},
      {"eval --checkpoint", {"eval", "--checkpoint", f}, f},
      {"train --data (tokens)", {"train", "--model", "gpt:L1-H2-C32-T16-V256", "--data", f}, f},
      {"train --data (IDX)", {"train", "--model", "mlp:784-16-10", "--data", idx}, idx},
      {"sample --checkpoint DIR", {"sample", "--checkpoint", d}, cfg},
      {"train --init-from DIR", {"train", "--init-from", d}, cfg},
      {"ps --checkpoint", {"ps", "--listen", "127.0.0.1:0", "--cluster-key", key, "--identity", id, "--workers", "1",
                           "--model", "mlp:784-16-10", "--checkpoint", f}, f},
      {"top --csv", {"top", "--bootstrap", "127.0.0.1:1", "--cluster-key", key, "--identity", id, "--once", "--csv",
                     f}, f},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    const char *const *a = cases[i].args;
    st = rumor(NULL, &err, 15, a[0], a[1], a[2], a[3], a[4], a[5], a[6], a[7], a[8], a[9], a[10], a[11], a[12], a[13],
               NULL);
    cr_assert(st >= 0, "%s: still waiting after 15 s", cases[i].what);
    cr_assert(strstr(err, "is not a regular file (it is a FIFO)") && strstr(err, cases[i].names),
              "%s: stderr should refuse the FIFO by name: %s", cases[i].what, err);
    cli_expect_fail(st, 1, err, cases[i].names, cases[i].what);
  }
}

/* ---- checkpoints written by release 0.1 (tests/data, see its README) ------------ */

struct old_run {
  const char *kind;  /* --optimizer */
  double accuracy, loss; /* what release 0.1 reported for the step-3 checkpoint's test set */
  const char *state[2];  /* its optimizer state tensors */
};
static const struct old_run old_runs[] = {
    {"sgd", 0.2011, 2.064409, {"optimizer.momentum", NULL}},
    {"adamw", 0.3748, 3.368270, {"optimizer.exp_avg", "optimizer.exp_avg_sq"}},
};

static void old_path(char *buf, size_t n, const char *kind, const char *suffix) {
  snprintf(buf, n, "%s/tests/data/ckpt-0.1-mlp-%s%s.safetensors", RUMOR_SOURCE_DIR, kind, suffix);
}

/* A copy in the scratch directory, so no run can touch tests/data. */
static void copy_to_scratch(const char *from, char *to, size_t n, const char *name) {
  snprintf(to, n, "%s/%s", dir, name);
  char cmd[1200];
  snprintf(cmd, sizeof cmd, "cp '%s' '%s'", from, to);
  cr_assert_eq(system(cmd), 0, "%s", cmd);
}

Test(cli, release_0_1_checkpoints_evaluate_to_what_that_release_reported) {
  SKIP_WITHOUT_DATA();
  for (int k = 0; k < 2; k++) {
    const struct old_run *r = &old_runs[k];
    char src[512], ck[256], *out, *err;
    old_path(src, sizeof src, r->kind, "");
    copy_to_scratch(src, ck, sizeof ck, "old.safetensors");
    int st = rumor(&out, &err, 60, "eval", "--checkpoint", ck, "--threads", "1", NULL);
    cr_assert(proc_exited_with(st, 0), "eval of the release-0.1 %s checkpoint failed: %s", r->kind, err);
    cr_assert_eq(cli_json_number(out, "step"), 3, "%s: %s", r->kind, out);
    cr_assert_eq(cli_json_number(out, "samples"), 10000, "%s: %s", r->kind, out);
    /* The same numbers, up to the order of float sums on another CPU (a
     * sample or two near a tie). */
    double acc = cli_json_number(out, "accuracy"), loss = cli_json_number(out, "loss");
    cr_assert(fabs(acc - r->accuracy) <= 2.5e-4, "%s: accuracy %.6f, release 0.1 reported %.4f", r->kind, acc,
              r->accuracy);
    cr_assert(fabs(loss - r->loss) <= 1e-5 + 1e-4 * r->loss, "%s: loss %.6f, release 0.1 reported %.6f", r->kind, loss,
              r->loss);
    free(out), free(err);
  }
}

/* |got − ref| ≤ atol + rtol·|ref| over n elements, atol = 1e-6 of the largest
 * |ref| (optimizer state spans many magnitudes); fails naming the worst. */
static void expect_close_to_release(const char *kind, const char *what, const float *got, const float *ref, int64_t n) {
  double scale = 0;
  for (int64_t i = 0; i < n; i++) scale = fmax(scale, fabs(ref[i]));
  double atol = 1e-6 * scale, rtol = 1e-4, worst = 0;
  int64_t at = -1, same = 0;
  for (int64_t i = 0; i < n; i++) {
    cr_assert(isfinite(got[i]), "%s %s: element %lld is %g", kind, what, (long long)i, got[i]);
    double excess = fabs((double)got[i] - ref[i]) / (atol + rtol * fabs(ref[i]));
    if (excess > worst) worst = excess, at = i;
    same += memcmp(&got[i], &ref[i], sizeof(float)) == 0;
  }
  cr_assert(worst <= 1.0, "%s %s: element %lld is %.9g, release 0.1 has %.9g (|diff| %.3g > %.3g + %.0e·|ref|)", kind,
            what, (long long)at, at >= 0 ? got[at] : 0.0, at >= 0 ? ref[at] : 0.0,
            at >= 0 ? fabs((double)got[at] - ref[at]) : 0.0, atol, rtol);
  if (same != n) fprintf(stderr, "%s %s: within tolerance, %lld of %lld elements bit-identical\n", kind, what,
                         (long long)same, (long long)n);
}

/* Release 0.1 trained 3 steps and saved; today's `rumor train --resume`
 * runs steps 4 and 5. The result must be where release 0.1's own
 * uninterrupted 5-step run ended (the -step5 files): same parameters and
 * optimizer state, up to float rounding on another CPU. The plain command
 * `rumor train --resume F --max-steps 5` continues from step 3 as well
 * (with the CLI's default schedule of 10 epochs, so not the same rates). */
Test(cli, release_0_1_checkpoints_resume_at_step_3_on_that_release_trajectory) {
  SKIP_WITHOUT_DATA();
  char src[512], in[256], *out, *err;
  old_path(src, sizeof src, "sgd", "");
  copy_to_scratch(src, in, sizeof in, "plain.safetensors");
  int st = rumor(&out, &err, 120, "train", "--resume", in, "--max-steps", "5", "--threads", "1", "--log-every", "0",
                 NULL);
  cr_assert(proc_exited_with(st, 0), "plain resume failed: %s", err);
  cr_assert(strstr(err, "resumed from") && strstr(err, " at step 3 "), "%s", err);
  cr_assert_eq(cli_json_number(out, "steps"), 5, "%s", out);
  free(out), free(err);

  for (int k = 0; k < 2; k++) {
    const struct old_run *r = &old_runs[k];
    char ref_path[512], res[256];
    old_path(src, sizeof src, r->kind, "");
    old_path(ref_path, sizeof ref_path, r->kind, "-step5");
    copy_to_scratch(src, in, sizeof in, "in.safetensors");
    snprintf(res, sizeof res, "%s/resumed-%s.safetensors", dir, r->kind);
    st = rumor(&out, &err, 120, "train", "--resume", in, "--optimizer", r->kind, "--epochs", "1", "--max-steps", "5",
               "--threads", "1", "--log-every", "0", "--no-eval", "--checkpoint", res, NULL);
    cr_assert(proc_exited_with(st, 0), "%s: resume failed: %s", r->kind, err);
    cr_assert(strstr(err, "resumed from") && strstr(err, " at step 3 "), "%s: %s", r->kind, err);
    cr_assert(!strstr(err, "starting it from zero"), "%s: the optimizer state was not restored: %s", r->kind, err);
    cr_assert_eq(cli_json_number(out, "steps"), 5, "%s: %s", r->kind, out);
    free(out), free(err);

    struct checkpoint got, ref;
    struct rumor_err e;
    cr_assert_eq(checkpoint_open(res, &got, &e), 0, "%s", e.msg);
    cr_assert_eq(checkpoint_open(ref_path, &ref, &e), 0, "%s", e.msg);
    cr_assert_eq(got.info.st.step, 5);
    cr_assert_eq(got.info.st.step_in_epoch, 5);
    cr_assert_eq(got.info.st.samples, 160, "%s: %lld samples (96 before + 2 × 32)", r->kind,
                 (long long)got.info.st.samples);
    cr_assert_eq(got.info.optim_kind, ref.info.optim_kind);
    int64_t n = ref.table.nparams;
    float *g = xmalloc((size_t)n * sizeof(float)), *w = xmalloc((size_t)n * sizeof(float));
    checkpoint_params(&got, g);
    checkpoint_params(&ref, w);
    expect_close_to_release(r->kind, "parameters", g, w, n);
    for (int s = 0; s < 2 && r->state[s]; s++) {
      const struct st_tensor *gs = safetensors_find(&got.file, r->state[s]);
      const struct st_tensor *ws = safetensors_find(&ref.file, r->state[s]);
      cr_assert(gs && ws && gs->nbytes == ws->nbytes, "%s: %s missing or of another size", r->kind, r->state[s]);
      expect_close_to_release(r->kind, r->state[s], gs->data, ws->data, (int64_t)(ws->nbytes / sizeof(float)));
    }
    free(g), free(w);
    checkpoint_close(&got);
    checkpoint_close(&ref);
  }
}
