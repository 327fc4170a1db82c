/*
 * The one pull policy (sync_pull_take) on a real trainer: a state is tried
 * by swapping it with the trainer's, so a refused one leaves the trainer's
 * state as it was, bit for bit, and an accepted one leaves the trainer's
 * former state in the buffer; nothing of the state's size is allocated.
 * The state here (AdamW's two moments and a sync scheme's extra segment
 * beside the parameters) has segments larger than the swap's 1 MiB bounce
 * buffer (256 Ki floats), so each goes through it in two pieces, the
 * second short. On a GPU (the device "auto") the swap copies to and from
 * the device.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "peer/sync/sync.h"
#include "peer/train/train.h"
#include "../support/fmnist.h"

static struct trainer T;
static int64_t S; /* trainer_state_floats */

static void setup(void) {
  if (!have_fmnist()) return; /* each test skips */
  struct train_config cfg;
  train_config_default(&cfg);
  cfg.model = "mlp:784-512-10"; /* 407,050 parameters: each segment > 256 Ki floats */
  cfg.data_dir = RUMOR_FMNIST_DIR;
  cfg.threads = 1;
  cfg.max_steps = 1;
  cfg.eval_each_epoch = false;
  cfg.log_every_s = 0;
  cfg.optim.kind = OPTIM_ADAMW;
  cfg.optim_given = true;
  cfg.extra.n = 1;
  strcpy(cfg.extra.seg[0].name, "outer.anchor");
  cfg.extra.seg[0].per_param = 1;
  cfg.extra.seg[0].fixed = 3;
  struct rumor_err e;
  cr_assert_eq(trainer_init(&T, &cfg, &e), 0, "%s", e.msg);
  S = trainer_state_floats(&T);
  cr_assert_gt(trainer_shard_floats(&T), 256 * 1024, "each segment must be larger than the bounce buffer");
}

static void teardown(void) {
  if (have_fmnist()) trainer_free(&T);
}

/* The trainer's state now (the caller frees it). */
static float *state_now(void) {
  float *x = malloc((size_t)S * sizeof(float));
  cr_assert_not_null(x);
  trainer_copy_state(&T, x);
  return x;
}

/* A state that differs from `base` in every segment: parameters scaled by
 * `scale`, the rest set to a pattern. */
static float *state_like(const float *base, float scale) {
  float *x = malloc((size_t)S * sizeof(float));
  cr_assert_not_null(x);
  int64_t P = trainer_shard_floats(&T);
  for (int64_t i = 0; i < S; i++) x[i] = i < P ? base[i] * scale : (float)(i % 97) * 0.01f;
  return x;
}

static void assert_same(const float *a, const float *b, const char *what) {
  for (int64_t i = 0; i < S; i++)
    if (memcmp(&a[i], &b[i], sizeof(float)) != 0)
      cr_assert_fail("%s: float %lld of %lld differs (%g against %g)", what, (long long)i, (long long)S, a[i], b[i]);
}

TestSuite(pull, .init = setup, .fini = teardown);

Test(pull, a_refused_state_leaves_ours_bit_for_bit_and_the_refused_one_in_its_buffer) {
  SKIP_WITHOUT_DATA();
  float *ours = state_now();
  float *bad = state_like(ours, 60.0f); /* finite, but a loss far above ours */
  float *buf = malloc((size_t)S * sizeof(float));
  memcpy(buf, bad, (size_t)S * sizeof(float));
  struct sync_own_state own;
  sync_own_keep(&own, &T);
  char why[200];
  for (int asked = 1; asked <= 2; asked++) { /* the second compares with the same loss of ours */
    cr_assert_not(sync_pull_take(&T, &own, buf, why, sizeof why), "ask %d: a state of loss %g was taken", asked,
                  own.pulled_loss);
    cr_assert(strstr(why, "is above"), "%s", why);
    cr_assert_gt(own.pulled_loss, sync_pull_max_loss(own.loss));
    float *now = state_now();
    assert_same(now, ours, "the trainer's state after a refused pull");
    assert_same(buf, bad, "the refused state in its buffer");
    free(now);
  }
  free(ours), free(bad), free(buf);
}

Test(pull, an_accepted_state_is_the_trainers_and_ours_is_left_in_its_buffer) {
  SKIP_WITHOUT_DATA();
  float *ours = state_now();
  float *good = state_like(ours, 1.001f);
  float *buf = malloc((size_t)S * sizeof(float));
  memcpy(buf, good, (size_t)S * sizeof(float));
  struct sync_own_state own;
  sync_own_keep(&own, &T);
  char why[200] = "";
  cr_assert(sync_pull_take(&T, &own, buf, why, sizeof why), "refused: %s", why);
  cr_assert(isfinite(own.pulled_loss) && own.rows > 0);
  float *now = state_now();
  assert_same(now, good, "the trainer's state after an accepted pull");
  assert_same(buf, ours, "the buffer after an accepted pull");
  free(now), free(ours), free(good), free(buf);
}

Test(pull, a_state_with_a_value_not_finite_is_refused_before_it_is_loaded) {
  SKIP_WITHOUT_DATA();
  float *ours = state_now();
  float *buf = state_like(ours, 1.0f);
  buf[S - 1] = NAN;
  struct sync_own_state own;
  sync_own_keep(&own, &T);
  char why[200];
  cr_assert_not(sync_pull_take(&T, &own, buf, why, sizeof why));
  char want[80];
  snprintf(want, sizeof want, "value %lld of %lld is not finite", (long long)(S - 1), (long long)S);
  cr_assert_str_eq(why, want);
  float *now = state_now();
  assert_same(now, ours, "the trainer's state after a refused pull");
  cr_assert(isnan(buf[S - 1]));
  free(now), free(ours), free(buf);
}

Test(pull, swapping_twice_gives_back_both_states) {
  SKIP_WITHOUT_DATA();
  float *ours = state_now();
  float *other = state_like(ours, -2.0f);
  float *buf = malloc((size_t)S * sizeof(float));
  memcpy(buf, other, (size_t)S * sizeof(float));
  trainer_swap_state(&T, buf);
  float *now = state_now();
  assert_same(now, other, "the trainer after one swap");
  assert_same(buf, ours, "the buffer after one swap");
  trainer_swap_state(&T, buf);
  free(now);
  now = state_now();
  assert_same(now, ours, "the trainer after two swaps");
  assert_same(buf, other, "the buffer after two swaps");
  free(now), free(ours), free(other), free(buf);
}
