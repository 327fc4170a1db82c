/* Model-parallel peer groups as users run them: `rumor group` starts S
 * stage processes on 127.0.0.1. One group step equals one single-process
 * step on the same batch and seed (S = 2 and 4, GPipe and 1F1B, even and
 * uneven micro-batches, ReLU and GELU); two groups of two stages gossiping
 * stage by stage train Fashion-MNIST to 0.85; a killed stage stops its
 * group with a clear message while the other group trains on; bad flags
 * fail cleanly. Every process is started by PID and ended by the suite. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../support/cluster.h"
#include "peer/safetensors.h"

static struct cluster C;

static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(group, .init = setup, .fini = teardown, .timeout = 240);

static bool have_fmnist(void) {
  struct stat st;
  return stat(RUMOR_FMNIST_DIR "/train-images-idx3-ubyte.gz", &st) == 0;
}
#define SKIP_WITHOUT_DATA()                                                                                    \
  do {                                                                                                         \
    if (!have_fmnist())                                                                                        \
      cr_skip_test("Fashion-MNIST not installed at " RUMOR_FMNIST_DIR " (apt-get install dataset-fashion-mnist)"); \
  } while (0)

/* A fresh identity file in the scratch directory. */
static void make_identity(const char *name, char *path, size_t n) {
  snprintf(path, n, "%s/%s.key", C.dir, name);
  cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, path);
}

/* Runs `rumor args...` to completion; returns the wait status. */
static int run(char **out, char **err, double secs, char *const *args) {
  char *argv[96];
  int n = 0;
  argv[n++] = RUMOR_BIN;
  for (int i = 0; args[i] && n < 95; i++) argv[n++] = args[i];
  argv[n] = NULL;
  return proc_run(argv, secs, C.dir, out, err);
}

/* ---- one step equals one single-process step ---- */


static const struct st_tensor *find(const struct st_file *f, const char *name, const char *path) {
  const struct st_tensor *t = safetensors_find(f, name);
  cr_assert_not_null(t, "%s has no tensor %s", path, name);
  return t;
}

/* Checks |got − ref| ≤ atol + rtol·|ref| on every element (and that got is
 * finite). Returns the failing count; *worst gets the largest normalised
 * error |got − ref| / (atol + rtol·|ref|) (≤ 1 passes) at *worst_at, and
 * *rel the largest plain relative error |got − ref| / |ref|. */
static int64_t compare(const float *got, const float *ref, int64_t n, double rtol, double atol, double *worst,
                       int64_t *worst_at, double *rel) {
  int64_t bad = 0;
  for (int64_t i = 0; i < n; i++) {
    cr_assert(isfinite(got[i]), "element %lld is %f", (long long)i, got[i]);
    double d = fabs((double)got[i] - (double)ref[i]), r = fabs((double)ref[i]);
    double norm = d / (atol + rtol * r);
    if (norm > *worst) *worst = norm, *worst_at = i;
    if (r > 0 && d / r > *rel) *rel = d / r;
    if (norm > 1) bad++;
  }
  return bad;
}

static double max_abs(const float *x, int64_t n) {
  double m = 0;
  for (int64_t i = 0; i < n; i++) m = fmax(m, fabs(x[i]));
  return m;
}

static void expect_group_step_equals_single(int stages, const char *schedule, const char *micro, const char *batch,
                                            const char *model, const char *steps) {
  SKIP_WITHOUT_DATA();
  char id[256], ref[256], grp[256], stages_s[8];
  make_identity("group", id, sizeof id);
  snprintf(ref, sizeof ref, "%s/ref.safetensors", C.dir);
  snprintf(grp, sizeof grp, "%s/group.safetensors", C.dir);
  snprintf(stages_s, sizeof stages_s, "%d", stages);
  /* lr 0.5 makes the step large next to the weights, so a wrong gradient
   * shows in the parameters; momentum's buffer after the first step is the
   * gradient itself, compared too. */
  char *common[] = {"--model", (char *)model, "--batch", (char *)batch, "--max-steps", (char *)steps, "--seed", "7",
                    "--lr", "0.5", "--no-eval", "--threads", "1", "--log-every", "0", NULL};
  char *single[64] = {"train", "--checkpoint", ref};
  int n = 3;
  for (int i = 0; common[i]; i++) single[n++] = common[i];
  single[n] = NULL;
  char *out, *err;
  int st = run(&out, &err, 120, single);
  cr_assert(proc_exited_with(st, 0), "single-process step failed: %s", err);
  free(out), free(err);

  char *group[64] = {"group", "--stages", stages_s, "--micro-batches", (char *)micro, "--schedule", (char *)schedule,
                     "--cluster-key", C.key, "--identity", id, "--checkpoint", grp};
  n = 13;
  for (int i = 0; common[i]; i++) group[n++] = common[i];
  group[n] = NULL;
  st = run(&out, &err, 120, group);
  cr_assert(proc_exited_with(st, 0), "group step failed (status %d): %s\n%s", st, out, err);
  cr_assert(strstr(out, "\"status\":\"ok\"") != NULL, "no ok summary: %s", out);
  free(out), free(err);

  struct st_file rf;
  struct rumor_err e;
  cr_assert_eq(safetensors_read(ref, true, &rf, &e), 0, "%s", e.msg);
  const struct st_tensor *rmom = find(&rf, "optimizer.momentum", ref);
  cr_assert_gt(max_abs(rmom->data, (int64_t)(rmom->nbytes / sizeof(float))), 0, "the single-process step had no gradient");
  int64_t off = 0, layers = 0;
  double worst_p = 0, worst_g = 0;
  bool one_step = strcmp(steps, "1") == 0;
  for (int s = 0; s < stages; s++) {
    char path[300];
    snprintf(path, sizeof path, "%s/group-stage%d.safetensors", C.dir, s);
    struct st_file gf;
    cr_assert_eq(safetensors_read(path, true, &gf, &e), 0, "stage %d wrote no checkpoint: %s", s, e.msg);
    cr_assert_str_eq(safetensors_meta(&gf, "rumor.step"), steps);
    const struct st_tensor *gmom = find(&gf, "optimizer.momentum", path);
    int64_t goff = 0;
    for (size_t k = 0; k < gf.ntensors; k++) {
      const struct st_tensor *t = &gf.tensors[k];
      if (strncmp(t->name, "layers.", 7) != 0) continue;
      const struct st_tensor *r = find(&rf, t->name, ref);
      cr_assert_eq(t->nbytes, r->nbytes, "%s: %zu bytes, the single process has %zu", t->name, t->nbytes, r->nbytes);
      int64_t cnt = (int64_t)(t->nbytes / sizeof(float));
      double wp = 0, wg = 0, rp = 0, rg_rel = 0;
      int64_t at = 0, gat = 0;
      /* Parameters: relative error ≤ 1e-5 on every element. One step moves
       * each weight by lr·g, so the floor below which an error is not
       * relative (a weight that happens to sit at zero) is 1e-9 absolute;
       * over several steps rounding compounds, and the floor is 1e-6 of the
       * tensor's largest weight. */
      double patol = one_step ? 1e-9 : 1e-6 * max_abs(r->data, cnt);
      int64_t badp = compare(t->data, r->data, cnt, 1e-5, patol, &wp, &at, &rp);
      /* The gradient (momentum after one step) of the same tensor. Its
       * elements sum many products that cancel, so the floor is 1e-5 of the
       * tensor's largest gradient. */
      const float *gg = (const float *)gmom->data + goff, *rg = (const float *)rmom->data + off;
      int64_t badg = one_step ? compare(gg, rg, cnt, 1e-5, 1e-5 * max_abs(rg, cnt), &wg, &gat, &rg_rel) : 0;
      fprintf(stderr,
              "S=%d %s M=%s stage %d %s: parameters: worst normalised error %.3g, relative %.3g; gradient: %.3g, %.3g\n",
              stages, schedule, micro, s, t->name, wp, rp, wg, rg_rel);
      cr_assert_eq(badp, 0, "%s: %lld parameters off by more than 1e-5 relative (worst at %lld: %.9g vs %.9g)",
                   t->name, (long long)badp, (long long)at, ((const float *)t->data)[at], ((const float *)r->data)[at]);
      cr_assert_eq(badg, 0, "%s: %lld gradient elements off (worst at %lld: %.9g vs %.9g)", t->name, (long long)badg,
                   (long long)gat, gg[gat], rg[gat]);
      worst_p = fmax(worst_p, wp), worst_g = fmax(worst_g, wg);
      off += cnt, goff += cnt, layers++;
    }
    cr_assert_eq(goff * (int64_t)sizeof(float), (int64_t)gmom->nbytes, "stage %d momentum size", s);
    safetensors_free(&gf);
  }
  cr_assert_eq(off * (int64_t)sizeof(float), (int64_t)rmom->nbytes, "the stages together do not hold every parameter");
  cr_assert_gt(layers, 0);
  fprintf(stderr, "S=%d %s M=%s batch %s: worst normalised error %.3g (parameters), %.3g (gradient)\n", stages,
          schedule, micro, batch, worst_p, worst_g);
  safetensors_free(&rf);
}

Test(group, two_stages_gpipe_step_equals_single_process_step) {
  expect_group_step_equals_single(2, "gpipe", "4", "64", "mlp:784-64-48-32-10", "1");
}

Test(group, two_stages_1f1b_uneven_micro_batches_equal_single_process_step) {
  expect_group_step_equals_single(2, "1f1b", "4", "50", "mlp:784-64-48-32-10", "1");
}

Test(group, four_stages_gpipe_step_equals_single_process_step) {
  expect_group_step_equals_single(4, "gpipe", "8", "64", "mlp:784-64-48-32-10", "1");
}

Test(group, four_stages_1f1b_gelu_uneven_step_equals_single_process_step) {
  expect_group_step_equals_single(4, "1f1b", "7", "60", "mlp:784-64-48-32-10:gelu", "1");
}

Test(group, four_stages_1f1b_three_steps_equal_three_single_process_steps) {
  expect_group_step_equals_single(4, "1f1b", "4", "64", "mlp:784-64-48-32-10", "3");
}
