/* A group's step equals the single process's, for data-parallel members
 * (ZeRO 0-3, peer/train/zero.c), tensor-parallel ranks (model_init_tp) and
 * both together: each process of the group is a trainer on its own thread
 * over the in-process communicator; they train N steps on the batches
 * `rumor train --batch B` reads, and every member's piece of the
 * parameters, its loss and the checkpoint the group gathers equal one
 * trainer's after the same N steps.
 *
 * Tolerances: the members sum slice gradients where the single process
 * sums the whole batch at once, so results agree within float rounding
 * compounded over the steps: SGD 2e-6 and AdamW 5e-5 absolute on
 * parameters of order 0.1 (Adam divides by the root of the second moment,
 * which magnifies rounding on elements with tiny gradients), losses 1e-5
 * relative. Members of one group are bit-identical to each other. */
#include <criterion/criterion.h>
#include <math.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "peer/train/train.h"
#include "peer/train/train_impl.h"

struct run {
  const char *model;
  int64_t batch;
  int steps;
  enum optim_kind optim;
  const char *checkpoint; /* saved after the steps, or NULL */
};

struct member {
  const struct run *run;
  comm_t *comm;
  int zero;
  int rc;
  char msg[512];
  float *params; /* all of them, as the member holds them (ZeRO 3: only its piece is live) */
  int64_t P, lo, hi;
  double loss;
  int64_t peak_unused;
};

static void config(const struct run *r, struct train_config *cfg) {
  train_config_default(cfg);
  cfg->model = r->model;
  cfg->batch = r->batch;
  cfg->max_steps = r->steps;
  cfg->seed = 7;
  cfg->threads = 1;
  cfg->eval_each_epoch = false;
  cfg->log_every_s = 0;
  cfg->optim.kind = r->optim;
  cfg->optim.lr = r->optim == OPTIM_ADAMW ? 1e-3 : 0.05;
  cfg->optim.weight_decay = r->optim == OPTIM_ADAMW ? 0.1 : 0.0;
  cfg->grad_clip = 1.0;
  cfg->shard = (struct shard){0, 1};
}

/* How the data-parallel members run their collectives (train_dp): the
 * device path's pipelined staging on the CPU, in segments of this many
 * floats (0: the default), and lazy gathers with a resync after each step
 * as a group that averages with others runs them. */
static struct {
  bool staged, lazy;
  int64_t segment;
} g_mode;

static int train(struct trainer *t, const struct run *r, struct rumor_err *e) {
  while (!trainer_done(t)) {
    int rc = trainer_step(t, e);
    if (rc == 0 && g_mode.lazy) rc = trainer_group_resync(t, false, NULL, e);
    if (rc) return rc;
  }
  return r->checkpoint ? trainer_save(t, r->checkpoint, e) : 0;
}

static void *member_main(void *arg) {
  struct member *m = arg;
  struct train_config cfg;
  config(m->run, &cfg);
  struct train_dp dp = {.comm = m->comm,
                        .zero = m->zero,
                        .staged = g_mode.staged,
                        .lazy_gather = g_mode.lazy,
                        .segment_floats = g_mode.segment};
  cfg.dp = &dp;
  struct rumor_err e = {0};
  struct trainer t;
  if ((m->rc = trainer_init(&t, &cfg, &e))) {
    snprintf(m->msg, sizeof m->msg, "%s", e.msg);
    return NULL;
  }
  if ((m->rc = train(&t, m->run, &e))) snprintf(m->msg, sizeof m->msg, "%s", e.msg);
  m->P = t.model.nparams;
  zero_piece(&dp, m->P, &m->lo, &m->hi);
  m->params = malloc((size_t)m->P * sizeof(float));
  tensor_copy_to_host(&t.model.params, 0, m->params, (size_t)m->P * sizeof(float));
  m->loss = t.last_loss;
  trainer_free(&t);
  return NULL;
}

static float *single(const struct run *r, int64_t *P, double *loss) {
  struct train_config cfg;
  config(r, &cfg);
  struct run plain = *r;
  plain.checkpoint = NULL;
  struct rumor_err e = {0};
  struct trainer t;
  cr_assert_eq(trainer_init(&t, &cfg, &e), 0, "%s", e.msg);
  cr_assert_eq(train(&t, &plain, &e), 0, "%s", e.msg);
  *P = t.model.nparams;
  float *out = malloc((size_t)*P * sizeof(float));
  tensor_copy_to_host(&t.model.params, 0, out, (size_t)*P * sizeof(float));
  *loss = t.last_loss;
  trainer_free(&t);
  return out;
}

static void group_equals_single(const struct run *r, int D, int zero) {
  int64_t P;
  double loss1;
  float *ref = single(r, &P, &loss1);
  comm_t *comms[8];
  comm_local_create(D, comms);
  struct member ms[8];
  pthread_t th[8];
  memset(ms, 0, sizeof ms);
  for (int i = 0; i < D; i++) {
    ms[i] = (struct member){.run = r, .comm = comms[i], .zero = zero};
    cr_assert_eq(pthread_create(&th[i], NULL, member_main, &ms[i]), 0);
  }
  for (int i = 0; i < D; i++) pthread_join(th[i], NULL);
  double tol = r->optim == OPTIM_ADAMW ? 5e-5 : 2e-6;
  for (int i = 0; i < D; i++) {
    cr_assert_eq(ms[i].rc, 0, "member %d of %d (ZeRO %d): %s", i, D, zero, ms[i].msg);
    cr_assert_eq(ms[i].P, P);
    /* ZeRO 3 members hold only their piece; the others hold everything. */
    int64_t lo = zero == 3 ? ms[i].lo : 0, hi = zero == 3 ? ms[i].hi : P;
    double worst = 0;
    int64_t at = -1;
    for (int64_t k = lo; k < hi; k++) {
      double d = fabs((double)ms[i].params[k] - (double)ref[k]);
      if (!(d <= worst)) worst = d, at = k;
    }
    cr_expect(worst <= tol, "%s, D=%d, ZeRO %d: member %d's parameter %lld is %.9g, the single process's %.9g "
              "(%.3g apart, tolerance %.1g)", r->model, D, zero, i, (long long)at, ms[i].params[at], ref[at], worst, tol);
    cr_expect(fabs(ms[i].loss - loss1) <= 1e-5 * fabs(loss1), "%s, D=%d, ZeRO %d: member %d's last loss %.8f, the "
              "single process's %.8f", r->model, D, zero, i, ms[i].loss, loss1);
    if (zero < 3 && i > 0)
      cr_expect(memcmp(ms[i].params, ms[0].params, (size_t)P * sizeof(float)) == 0,
                "ZeRO %d: members 0 and %d hold different parameters", zero, i);
  }
  for (int i = 0; i < D; i++) {
    free(ms[i].params);
    comm_free(comms[i], 0);
  }
  free(ref);
}

/* Fashion-MNIST batches of 50 on 3 members: slices of 17, 17 and 16 rows. */
static const struct run mlp_sgd = {"mlp:784-48-24-10", 50, 6, OPTIM_SGD, NULL};
static const struct run mlp_adam = {"mlp:784-48-24-10", 50, 6, OPTIM_ADAMW, NULL};
/* GPT: the tied head adds to unit 0's gradient, which ZeRO 2/3 reduce last. */
static const struct run gpt_adam = {"gpt:L2-H2-C16-T12-V256", 6, 5, OPTIM_ADAMW, NULL};

Test(zero, mlp_sgd_every_stage_d2) {
  for (int z = 0; z <= 3; z++) group_equals_single(&mlp_sgd, 2, z);
}

Test(zero, mlp_adamw_every_stage_d3) {
  for (int z = 0; z <= 3; z++) group_equals_single(&mlp_adam, 3, z);
}

Test(zero, gpt_adamw_every_stage_d2_and_d3) {
  for (int z = 0; z <= 3; z++) {
    group_equals_single(&gpt_adam, 2, z);
    group_equals_single(&gpt_adam, 3, z);
  }
}

/* A device's path on the CPU: collectives through the two pinned halves
 * in segments of 1000 floats (the model has 20 K parameters: the copies
 * of one segment overlap the next one's transfer dozens of times a step),
 * copying out only what goes out and back only what comes back. The same
 * steps, to the same tolerance. */
Test(zero, staged_segmented_collectives_every_stage) {
  g_mode.staged = true;
  g_mode.segment = 1000;
  for (int z = 0; z <= 3; z++) group_equals_single(&mlp_adam, 2, z);
  group_equals_single(&gpt_adam, 3, 3);
  g_mode.staged = false;
  g_mode.segment = 0;
}

/* ZeRO 1 and 2 members of a group that averages with others leave each
 * step's all-gather to the resync after it (train_dp.lazy_gather): the
 * same steps. */
Test(zero, lazy_gathers_equal_eager_ones) {
  g_mode.lazy = true;
  for (int z = 1; z <= 2; z++) group_equals_single(&mlp_adam, 2, z);
  group_equals_single(&gpt_adam, 3, 2);
  g_mode.lazy = false;
}

/* More members than rows in a batch: a member with no rows still takes
 * part in every collective, with a zero gradient. */
Test(zero, members_without_rows) {
  static const struct run tiny = {"mlp:784-16-10", 2, 3, OPTIM_SGD, NULL};
  group_equals_single(&tiny, 3, 1);
  group_equals_single(&tiny, 3, 3);
}

/* A ZeRO 3 group's checkpoint is the single process's layout: member 0
 * writes what every member gathered, and it loads into one trainer that
 * then holds the single process's parameters. */
Test(zero, checkpoint_gathers_the_single_layout) {
  char dir[] = "/tmp/rumor-zero-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char path[256];
  snprintf(path, sizeof path, "%s/g.safetensors", dir);
  struct run r = mlp_adam;
  r.checkpoint = path;
  int64_t P;
  double loss1;
  float *ref = single(&r, &P, &loss1);
  comm_t *comms[2];
  comm_local_create(2, comms);
  struct member ms[2] = {{.run = &r, .comm = comms[0], .zero = 3}, {.run = &r, .comm = comms[1], .zero = 3}};
  pthread_t th[2];
  for (int i = 0; i < 2; i++) pthread_create(&th[i], NULL, member_main, &ms[i]);
  for (int i = 0; i < 2; i++) pthread_join(th[i], NULL);
  for (int i = 0; i < 2; i++) cr_assert_eq(ms[i].rc, 0, "%s", ms[i].msg);
  struct checkpoint ck;
  struct rumor_err e = {0};
  cr_assert_eq(checkpoint_open(path, &ck, &e), 0, "%s", e.msg);
  cr_assert(ck.has_optim);
  cr_assert_eq(ck.info.st.step, r.steps);
  float *got = malloc((size_t)P * sizeof(float));
  checkpoint_params(&ck, got);
  for (int64_t k = 0; k < P; k++)
    cr_assert(fabs((double)got[k] - (double)ref[k]) <= 5e-5, "parameter %lld: %g saved, %g single", (long long)k,
              got[k], ref[k]);
  checkpoint_close(&ck);
  free(got);
  free(ref);
  for (int i = 0; i < 2; i++) {
    free(ms[i].params);
    comm_free(comms[i], 0);
  }
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}

/* ---- tensor-parallel ranks, alone and with data-parallel members ---- */

struct rank {
  const struct run *run;
  struct train_tp tp;
  struct train_dp dp;
  bool has_dp;
  int rc;
  char msg[512];
  double loss;
};

static void *rank_main(void *arg) {
  struct rank *k = arg;
  struct train_config cfg;
  config(k->run, &cfg);
  cfg.tp = &k->tp;
  if (k->has_dp) cfg.dp = &k->dp;
  struct rumor_err e = {0};
  struct trainer t;
  if ((k->rc = trainer_init(&t, &cfg, &e))) {
    snprintf(k->msg, sizeof k->msg, "%s", e.msg);
    return NULL;
  }
  if ((k->rc = train(&t, k->run, &e))) snprintf(k->msg, sizeof k->msg, "%s", e.msg);
  k->loss = t.last_loss;
  trainer_free(&t);
  return NULL;
}

/* T ranks x D members (member k is data-parallel member k / T, rank k % T)
 * train and save; the checkpoint equals the single process's parameters
 * within `tol`, and every process's loss the single process's. */
static void layout_equals_single(const struct run *base, int T, int D, int zero, double tol) {
  char dir[] = "/tmp/rumor-tp-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char path[256];
  snprintf(path, sizeof path, "%s/g.safetensors", dir);
  struct run r = *base;
  r.checkpoint = path;
  int64_t P;
  double loss1;
  float *ref = single(&r, &P, &loss1);
  int N = T * D;
  comm_t *all[8];
  comm_local_create(N, all);
  struct rank ks[8];
  pthread_t th[8];
  memset(ks, 0, sizeof ks);
  for (int k = 0; k < N; k++) {
    int d = k / T, t = k % T, tp_members[8], dp_members[8];
    for (int j = 0; j < T; j++) tp_members[j] = d * T + j;
    for (int j = 0; j < D; j++) dp_members[j] = j * T + t;
    ks[k] = (struct rank){.run = &r, .has_dp = D > 1};
    ks[k].tp = (struct train_tp){.comm = comm_sub(all[k], tp_members, T, 1), .all = all[k]};
    if (D > 1) ks[k].dp = (struct train_dp){.comm = comm_sub(all[k], dp_members, D, 2), .zero = zero};
  }
  for (int k = 0; k < N; k++) cr_assert_eq(pthread_create(&th[k], NULL, rank_main, &ks[k]), 0);
  for (int k = 0; k < N; k++) pthread_join(th[k], NULL);
  for (int k = 0; k < N; k++) {
    cr_assert_eq(ks[k].rc, 0, "T=%d D=%d ZeRO %d, process %d: %s", T, D, zero, k, ks[k].msg);
    cr_expect(fabs(ks[k].loss - loss1) <= 1e-5 * fabs(loss1), "T=%d D=%d ZeRO %d: process %d's last loss %.8f, the "
              "single process's %.8f", T, D, zero, k, ks[k].loss, loss1);
  }
  struct checkpoint ck;
  struct rumor_err e = {0};
  cr_assert_eq(checkpoint_open(path, &ck, &e), 0, "%s", e.msg);
  cr_assert_eq(ck.table.nparams, P);
  float *got = malloc((size_t)P * sizeof(float));
  checkpoint_params(&ck, got);
  double worst = 0;
  int64_t at = 0;
  for (int64_t i = 0; i < P; i++) {
    double d = fabs((double)got[i] - (double)ref[i]);
    if (!(d <= worst)) worst = d, at = i;
  }
  cr_expect(worst <= tol, "%s, T=%d D=%d ZeRO %d: the group's parameter %lld is %.9g, the single process's %.9g "
            "(%.3g apart, tolerance %.1g)", base->model, T, D, zero, (long long)at, got[at], ref[at], worst, tol);
  checkpoint_close(&ck);
  free(got);
  free(ref);
  for (int k = 0; k < N; k++) {
    if (D > 1) comm_free(ks[k].dp.comm, 0);
    comm_free(ks[k].tp.comm, 0);
  }
  for (int k = 0; k < N; k++) comm_free(all[k], 0);
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}

static const struct run gpt_tp = {"gpt:L2-H4-C16-T12-V257", 6, 5, OPTIM_ADAMW, NULL};

Test(zero, tensor_parallel_gpt_t2_t4_and_mlp_t3) {
  layout_equals_single(&gpt_tp, 2, 1, 0, 5e-5);
  layout_equals_single(&gpt_tp, 4, 1, 0, 5e-5);
  layout_equals_single(&mlp_adam, 3, 1, 0, 5e-5);
}

Test(zero, tensor_parallel_with_data_parallel_members_every_stage) {
  for (int z = 0; z <= 3; z++) layout_equals_single(&gpt_tp, 2, 2, z, 5e-5);
  layout_equals_single(&mlp_sgd, 2, 3, 3, 2e-6);
}
