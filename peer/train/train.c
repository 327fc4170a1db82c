/* The single-peer training loop. */
#include "peer/train/train.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void train_config_default(struct train_config *c) {
  memset(c, 0, sizeof *c);
  c->model = NULL;
  c->data_dir = "/usr/share/datasets/fashion-mnist";
  c->device = "auto";
  c->threads = 0;
  c->shard = (struct shard){0, 1};
  c->seed = 1;
  c->data_seed = 1;
  c->epochs = 10;
  c->batch = 128;
  optim_config_default(&c->optim);
  c->log_every_s = 5.0;
  c->eval_each_epoch = true;
}

static int load_data(struct trainer *t, struct rumor_err *e) {
  int rc = dataset_load_split(t->cfg.data_dir, "train", &t->train, e);
  if (rc) return rumor_err_prefix(e, "training data");
  rc = dataset_load_split(t->cfg.data_dir, "t10k", &t->test, e);
  if (rc) return rumor_err_prefix(e, "test data");
  t->have_test = true;
  if (t->test.features != t->train.features)
    return rumor_err_set(e, RUMOR_ECORRUPT, "test images are %lldx%lld but training images are %lldx%lld",
                         (long long)t->test.rows, (long long)t->test.cols, (long long)t->train.rows,
                         (long long)t->train.cols);
  return 0;
}

static int check_model_fits_data(const struct model_spec *spec, const struct trainer *t, struct rumor_err *e) {
  char s[MODEL_SPEC_MAX];
  model_spec_format(spec, s, sizeof s);
  if (spec->widths[0] != t->train.features)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s takes %lld inputs but the images have %lldx%lld = %lld pixels", s,
                         (long long)spec->widths[0], (long long)t->train.rows, (long long)t->train.cols,
                         (long long)t->train.features);
  int classes = t->train.num_classes > t->test.num_classes ? t->train.num_classes : t->test.num_classes;
  if (spec->widths[spec->nlayers] < classes)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s has %lld outputs but the labels go up to %d", s,
                         (long long)spec->widths[spec->nlayers], classes - 1);
  return 0;
}

int trainer_init(struct trainer *t, const struct train_config *cfg, struct rumor_err *e) {
  memset(t, 0, sizeof *t);
  t->cfg = *cfg;
  struct checkpoint ck;
  bool resumed = false;
  int rc;
  struct model_spec spec;

  if (cfg->resume) {
    /* A damaged checkpoint falls back to the previous one (checkpoint.h). */
    if ((rc = checkpoint_open_latest(cfg->resume, &ck, t->resumed_from, sizeof t->resumed_from, e))) return rc;
    resumed = true;
    spec = ck.info.spec;
    if (cfg->model) {
      struct model_spec want;
      if ((rc = model_spec_parse(cfg->model, &want, e))) goto fail;
      char a[MODEL_SPEC_MAX], b[MODEL_SPEC_MAX];
      model_spec_format(&want, a, sizeof a);
      model_spec_format(&spec, b, sizeof b);
      if (strcmp(a, b) != 0) {
        rc = rumor_err_set(e, RUMOR_ESHAPE, "--model %s does not match the checkpoint %s, which holds %s", a,
                           cfg->resume, b);
        goto fail;
      }
    }
    /* The run's identity comes from the checkpoint so the resumed run sees
     * the same batches in the same order. */
    t->cfg.seed = ck.info.seed;
    t->cfg.data_seed = ck.info.data_seed;
    t->cfg.shard = ck.info.shard;
    t->cfg.batch = ck.info.batch;
    t->st = ck.info.st;
  } else {
    if ((rc = model_spec_parse(cfg->model ? cfg->model : "mlp:784-512-256-10", &spec, e))) return rc;
  }

  if ((rc = tensor_backend_open(cfg->device, &t->be, e))) goto fail;
  if (cfg->threads > 0) tensor_backend_set_threads(t->be, cfg->threads);
  if ((rc = load_data(t, e))) goto fail;
  if ((rc = check_model_fits_data(&spec, t, e))) goto fail;
  if (resumed) {
    t->norm_mean = ck.info.norm_mean;
    t->norm_std = ck.info.norm_std;
  } else {
    dataset_pixel_stats(&t->train, &t->norm_mean, &t->norm_std);
  }
  dataset_norm_lut(t->norm_mean, t->norm_std, t->lut);
  if ((rc = batcher_init(&t->batcher, &t->train, t->cfg.shard, t->cfg.data_seed, t->cfg.seed, t->norm_mean,
                         t->norm_std, e)))
    goto fail;
  if ((rc = model_init(&t->model, &spec, t->be, t->cfg.batch, e))) goto fail;
  if ((rc = optim_init(&t->optim, &t->cfg.optim, t->be, t->model.nparams, e))) goto fail;
  if (resumed) {
    if ((rc = checkpoint_restore(&ck, &t->model, &t->optim, e))) goto fail;
    checkpoint_close(&ck);
    resumed = false;
  } else {
    model_init_params(&t->model, t->cfg.seed);
  }

  t->steps_per_epoch = batcher_steps_per_epoch(&t->batcher, t->cfg.batch);
  /* The schedule spans the configured epochs even when max_steps stops the
   * run earlier, so a run cut short and resumed follows the same rates. */
  t->total_steps = t->cfg.epochs * t->steps_per_epoch;
  t->stop_step = t->total_steps;
  if (t->cfg.max_steps > 0 && t->cfg.max_steps < t->stop_step) t->stop_step = t->cfg.max_steps;
  if (t->st.step_in_epoch >= t->steps_per_epoch) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "checkpoint position (batch %lld of epoch %lld) is past the epoch's %lld batches",
                       (long long)t->st.step_in_epoch, (long long)t->st.epoch, (long long)t->steps_per_epoch);
    goto fail;
  }
  for (int i = 0; i < 2; i++) {
    t->xh[i] = tensor_host_alloc(t->be, (size_t)(t->cfg.batch * t->train.features) * sizeof(float));
    t->yh[i] = tensor_host_alloc(t->be, (size_t)t->cfg.batch * sizeof(int32_t));
    if (!t->xh[i] || !t->yh[i]) {
      rc = rumor_err_set(e, -ENOMEM, "cannot allocate host batch buffers");
      goto fail;
    }
  }
  batcher_start_epoch(&t->batcher, t->st.epoch);
  t->loss_avg = NAN;
  t->t_start = t->t_last_log = clock_now_s();
  t->samples_at_start = t->st.samples;

  char s[MODEL_SPEC_MAX];
  model_spec_format(&spec, s, sizeof s);
  log_info("model %s: %lld parameters (%.1f MiB) on %s; shard %lld/%lld: %lld samples, %lld batches of %lld per epoch",
           s, (long long)t->model.nparams, (double)t->model.nparams * 4 / (1 << 20), tensor_backend_name(t->be),
           (long long)t->cfg.shard.index, (long long)t->cfg.shard.count, (long long)t->batcher.n,
           (long long)t->steps_per_epoch, (long long)t->cfg.batch);
  if (cfg->resume)
    log_info("resumed from %s at step %lld (epoch %lld, batch %lld)", t->resumed_from, (long long)t->st.step,
             (long long)t->st.epoch + 1, (long long)t->st.step_in_epoch);
  return 0;
fail:
  if (resumed) checkpoint_close(&ck);
  trainer_free(t);
  return rc;
}

void trainer_free(struct trainer *t) {
  if (t->be) {
    for (int i = 0; i < 2; i++) {
      tensor_host_free(t->be, t->xh[i]);
      tensor_host_free(t->be, t->yh[i]);
    }
  }
  optim_free(&t->optim);
  model_free(&t->model);
  batcher_free(&t->batcher);
  dataset_free(&t->train);
  dataset_free(&t->test);
  tensor_backend_close(t->be);
  memset(t, 0, sizeof *t);
}

bool trainer_done(const struct trainer *t) { return t->st.step >= t->stop_step; }

static void stage(struct trainer *t, int buf) {
  t->rows[buf] = batcher_fill(&t->batcher, t->st.step_in_epoch, t->cfg.batch, t->xh[buf], t->yh[buf]);
}

static void format_duration(double s, char *buf, size_t n) {
  if (!isfinite(s) || s < 0) s = 0;
  long v = (long)(s + 0.5);
  if (v >= 3600) snprintf(buf, n, "%ldh%02ldm", v / 3600, (v / 60) % 60);
  else if (v >= 60) snprintf(buf, n, "%ldm%02lds", v / 60, v % 60);
  else snprintf(buf, n, "%lds", v);
}

static void progress(struct trainer *t, double lr) {
  double now = clock_now_s();
  double el = now - t->t_start;
  double rate = el > 0 ? (double)(t->st.samples - t->samples_at_start) / el : 0;
  double remaining = rate > 0 ? (double)(t->stop_step - t->st.step) * (double)t->cfg.batch / rate : 0;
  char eta[32];
  format_duration(remaining, eta, sizeof eta);
  log_info("epoch %lld/%lld  step %lld/%lld  loss %.4f  lr %.4g  %.0f samples/s  ETA %s",
           (long long)t->st.epoch + 1, (long long)t->cfg.epochs, (long long)t->st.step_in_epoch,
           (long long)t->steps_per_epoch, t->loss_avg, lr, rate, eta);
  t->t_last_log = now;
}

static struct ckpt_info make_info(const struct trainer *t) {
  struct ckpt_info info;
  memset(&info, 0, sizeof info);
  info.spec = t->model.spec;
  info.st = t->st;
  info.optim_kind = t->optim.cfg.kind;
  info.seed = t->cfg.seed;
  info.data_seed = t->cfg.data_seed;
  info.shard = t->cfg.shard;
  info.batch = t->cfg.batch;
  info.norm_mean = t->norm_mean;
  info.norm_std = t->norm_std;
  snprintf(info.peer_id, sizeof info.peer_id, "%s", t->cfg.peer_id ? t->cfg.peer_id : "");
  return info;
}

double trainer_check_loss(struct trainer *t, int64_t n) {
  if (n > t->train.count) n = t->train.count;
  int64_t bs = t->cfg.batch, F = t->train.features;
  float *x = tensor_host_alloc(t->be, (size_t)(bs * F) * sizeof(float));
  int32_t *y = tensor_host_alloc(t->be, (size_t)bs * sizeof(int32_t));
  RUMOR_ASSERT(x && y);
  double loss = 0;
  int64_t correct = 0;
  for (int64_t first = 0; first < n; first += bs) {
    int64_t rows = n - first < bs ? n - first : bs;
    dataset_gather_range(&t->train, t->lut, first, rows, x, y);
    tensor_copy_from_host(&t->model.acts[0], 0, x, (size_t)(rows * F) * sizeof(float));
    tensor_copy_from_host(&t->model.labels, 0, y, (size_t)rows * sizeof(int32_t));
    model_evaluate_batch(&t->model, rows, y, &correct, &loss);
  }
  tensor_host_free(t->be, x);
  tensor_host_free(t->be, y);
  return n > 0 ? loss / (double)n : 0.0;
}

int64_t trainer_state_floats(const struct trainer *t) {
  return t->model.nparams * (1 + optim_state_per_param(t->optim.cfg.kind));
}

void trainer_copy_state(struct trainer *t, float *out) {
  int64_t P = t->model.nparams;
  tensor_copy_to_host(&t->model.params, 0, out, (size_t)P * sizeof(float));
  tensor_copy_to_host(&t->optim.state, 0, out + P, tensor_nbytes(&t->optim.state));
}

void trainer_load_state(struct trainer *t, const float *state, int64_t step, int64_t epoch) {
  int64_t P = t->model.nparams;
  tensor_copy_from_host(&t->model.params, 0, state, (size_t)P * sizeof(float));
  tensor_copy_from_host(&t->optim.state, 0, state + P, tensor_nbytes(&t->optim.state));
  t->optim.step = step;
  t->st.step = step;
  t->st.epoch = epoch;
  t->st.step_in_epoch = 0;
  t->staged = false;
  batcher_start_epoch(&t->batcher, epoch);
}

int trainer_save(struct trainer *t, const char *path, struct rumor_err *e) {
  struct ckpt_info info = make_info(t);
  int rc = checkpoint_save(path, &t->model, &t->optim, &info, e);
  if (rc == 0) log_info("checkpoint saved to %s (step %lld)", path, (long long)t->st.step);
  return rc;
}

int trainer_step(struct trainer *t, struct rumor_err *e) {
  RUMOR_ASSERT(!trainer_done(t));
  if (!t->started) {
    /* Rates and ETA count from the first step, not from start-up (a peer
     * may wait to join in between). */
    t->started = true;
    t->t_start = t->t_last_log = clock_now_s();
    t->samples_at_start = t->st.samples;
  }
  int buf = t->cur;
  if (!t->staged) stage(t, buf);
  int64_t rows = t->rows[buf];
  struct model *m = &t->model;
  tensor_copy_from_host_async(&m->acts[0], 0, t->xh[buf], (size_t)(rows * t->train.features) * sizeof(float));
  tensor_copy_from_host_async(&m->labels, 0, t->yh[buf], (size_t)rows * sizeof(int32_t));
  double lr = optim_lr_at(&t->cfg.optim, t->st.step, t->total_steps);
  model_forward_backward(m, rows);
  optim_apply(&t->optim, &m->params, &m->grads, lr);

  t->st.step++;
  t->st.samples += rows;
  bool epoch_end = ++t->st.step_in_epoch == t->steps_per_epoch;
  if (epoch_end) {
    t->st.epoch++;
    t->st.step_in_epoch = 0;
    batcher_start_epoch(&t->batcher, t->st.epoch);
  }
  /* Gather the next batch on the host while the device computes. */
  t->cur ^= 1;
  t->staged = !trainer_done(t);
  if (t->staged) stage(t, t->cur);

  float loss = model_mean_loss(m, rows); /* waits for the device */
  t->last_loss = loss;
  t->loss_avg = isnan(t->loss_avg) ? loss : 0.95 * t->loss_avg + 0.05 * loss;
  if (t->cfg.log_every_s > 0 && clock_now_s() - t->t_last_log >= t->cfg.log_every_s) progress(t, lr);

  if (epoch_end) {
    double acc = NAN, tl = NAN;
    if (t->cfg.eval_each_epoch && t->have_test) trainer_evaluate(t, &t->test, &acc, &tl);
    log_info("epoch %lld/%lld done at step %lld: train loss %.4f, test accuracy %.4f, test loss %.4f",
             (long long)t->st.epoch, (long long)t->cfg.epochs, (long long)t->st.step, t->loss_avg, acc, tl);
  }
  if (t->cfg.checkpoint &&
      (epoch_end || trainer_done(t) || (t->cfg.checkpoint_every > 0 && t->st.step % t->cfg.checkpoint_every == 0))) {
    int rc = trainer_save(t, t->cfg.checkpoint, e);
    if (rc) return rc;
  }
  return 0;
}

void trainer_evaluate(struct trainer *t, const struct dataset *ds, double *accuracy, double *loss) {
  int64_t bs = t->cfg.batch, correct = 0;
  double loss_sum = 0;
  float *x = tensor_host_alloc(t->be, (size_t)(bs * ds->features) * sizeof(float));
  int32_t *y = tensor_host_alloc(t->be, (size_t)bs * sizeof(int32_t));
  RUMOR_ASSERT(x && y);
  for (int64_t first = 0; first < ds->count; first += bs) {
    int64_t rows = ds->count - first < bs ? ds->count - first : bs;
    dataset_gather_range(ds, t->lut, first, rows, x, y);
    tensor_copy_from_host(&t->model.acts[0], 0, x, (size_t)(rows * ds->features) * sizeof(float));
    tensor_copy_from_host(&t->model.labels, 0, y, (size_t)rows * sizeof(int32_t));
    model_evaluate_batch(&t->model, rows, y, &correct, &loss_sum);
  }
  tensor_host_free(t->be, x);
  tensor_host_free(t->be, y);
  *accuracy = (double)correct / (double)ds->count;
  *loss = loss_sum / (double)ds->count;
}
