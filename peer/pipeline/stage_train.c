/* The training loop of one pipeline stage. */
#include "peer/pipeline/stage_train.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- plan and agreement ---- */

int stage_plan_make(const struct stage_config *cfg, struct stage_plan *out, struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  if (!cfg->train.model) return rumor_err_set(e, RUMOR_EFORMAT, "--model is required");
  int rc = model_spec_parse(cfg->train.model, &out->spec, e);
  if (rc) return rumor_err_prefix(e, "--model");
  if ((rc = pipe_split_balance(&out->spec, cfg->stages, &out->split, e))) return rumor_err_prefix(e, "--stages");
  RUMOR_ASSERT(0 <= cfg->stage && cfg->stage < cfg->stages);
  out->l0 = out->split.first[cfg->stage];
  out->l1 = out->split.first[cfg->stage + 1];
  if (cfg->micro < 1 || cfg->micro > PIPE_MAX_MICRO)
    return rumor_err_set(e, RUMOR_EFORMAT, "--micro-batches must be in [1, %d], not %d", PIPE_MAX_MICRO, cfg->micro);
  if (cfg->micro > cfg->train.batch)
    return rumor_err_set(e, RUMOR_EFORMAT, "--micro-batches %d is more than the --batch of %lld rows", cfg->micro,
                         (long long)cfg->train.batch);
  out->mb_rows = (cfg->train.batch + cfg->micro - 1) / cfg->micro;
  return 0;
}

void stage_agreement(const struct stage_config *cfg, const struct stage_plan *plan, char *buf, size_t n) {
  const struct train_config *c = &cfg->train;
  char spec[MODEL_SPEC_MAX], split[PIPE_MAX_STAGES * 4 + 8];
  model_spec_format(&plan->spec, spec, sizeof spec);
  pipe_split_format(&plan->split, split, sizeof split);
  snprintf(buf, n,
           "model=%s split=%s schedule=%s micro-batches=%d batch=%lld seed=%" PRIu64 " data-seed=%" PRIu64
           " shard=%lld/%lld epochs=%lld max-steps=%lld optimizer=%s lr=%.9g momentum=%.9g nesterov=%d "
           "weight-decay=%.9g schedule=%s warmup=%lld eval=%d",
           spec, split, pipe_schedule_name(cfg->sched), cfg->micro, (long long)c->batch, c->seed, c->data_seed,
           (long long)c->shard.index, (long long)c->shard.count, (long long)c->epochs, (long long)c->max_steps,
           optim_kind_name(c->optim.kind), c->optim.lr, c->optim.momentum, c->optim.nesterov ? 1 : 0,
           c->optim.weight_decay, optim_schedule_name(c->optim.schedule), (long long)c->optim.warmup_steps,
           c->eval_each_epoch ? 1 : 0);
}

int stage_gossip_label(const struct stage_config *cfg, const struct stage_plan *plan, char *buf, size_t n,
                       struct rumor_err *e) {
  char spec[MODEL_SPEC_MAX], split[PIPE_MAX_STAGES * 4 + 8];
  model_spec_format(&plan->spec, spec, sizeof spec);
  pipe_split_format(&plan->split, split, sizeof split);
  int w = snprintf(buf, n, "%s stage %d/%d layers %d-%d of %s", spec, cfg->stage, cfg->stages, plan->l0, plan->l1 - 1,
                   split);
  if (w < 0 || (size_t)w >= n)
    return rumor_err_set(e, RUMOR_ETOOBIG, "the stage's gossip label for %s is over %zu characters", spec, n - 1);
  return 0;
}

void stage_checkpoint_path(const char *path, int stage, char *buf, size_t n) {
  static const char ext[] = ".safetensors";
  size_t len = strlen(path), el = sizeof ext - 1;
  if (len > el && strcmp(path + len - el, ext) == 0)
    snprintf(buf, n, "%.*s-stage%d%s", (int)(len - el), path, stage, ext);
  else
    snprintf(buf, n, "%s-stage%d", path, stage);
}

/* ---- set-up ---- */

static bool is_first(const struct stage_trainer *t) { return t->cfg.stage == 0; }
static bool is_last(const struct stage_trainer *t) { return t->cfg.stage == t->cfg.stages - 1; }

static int load_data(struct stage_trainer *t, struct rumor_err *e) {
  int rc = dataset_load_split(t->cfg.train.data_dir, "train", &t->train, e);
  if (rc) return rumor_err_prefix(e, "training data");
  if ((rc = dataset_load_split(t->cfg.train.data_dir, "t10k", &t->test, e))) return rumor_err_prefix(e, "test data");
  t->have_test = true;
  if (t->test.features != t->train.features)
    return rumor_err_set(e, RUMOR_ECORRUPT, "test images have %lld pixels but training images %lld",
                         (long long)t->test.features, (long long)t->train.features);
  const struct model_spec *s = &t->plan.spec;
  char name[MODEL_SPEC_MAX];
  model_spec_format(s, name, sizeof name);
  if (s->widths[0] != t->train.features)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s takes %lld inputs but the images have %lld pixels", name,
                         (long long)s->widths[0], (long long)t->train.features);
  int classes = t->train.num_classes > t->test.num_classes ? t->train.num_classes : t->test.num_classes;
  if (s->widths[s->nlayers] < classes)
    return rumor_err_set(e, RUMOR_ESHAPE, "model %s has %lld outputs but the labels go up to %d", name,
                         (long long)s->widths[s->nlayers], classes - 1);
  return 0;
}

int stage_trainer_init(struct stage_trainer *t, const struct stage_config *cfg, stage_link_t *link,
                       struct rumor_err *e) {
  memset(t, 0, sizeof *t);
  t->cfg = *cfg;
  t->link = link;
  t->loss_avg = t->last_loss = t->accuracy = t->test_loss = NAN;
  int rc;
  if (cfg->train.resume) return rumor_err_set(e, RUMOR_EFORMAT, "--resume is not supported for a peer group");
  if ((rc = stage_plan_make(cfg, &t->plan, e))) return rc;
  if ((rc = tensor_backend_open(cfg->train.device, &t->be, e))) goto fail;
  if (cfg->train.threads > 0) tensor_backend_set_threads(t->be, cfg->train.threads);
  if ((rc = load_data(t, e))) goto fail;
  dataset_pixel_stats(&t->train, &t->norm_mean, &t->norm_std);
  dataset_norm_lut(t->norm_mean, t->norm_std, t->lut);
  if ((rc = batcher_init(&t->batcher, &t->train, cfg->train.shard, cfg->train.data_seed, cfg->train.seed, t->norm_mean,
                         t->norm_std, e)))
    goto fail;
  if ((rc = model_init_layers(&t->model, &t->plan.spec, t->plan.l0, t->plan.l1, t->be, t->plan.mb_rows, e))) goto fail;
  model_init_params(&t->model, cfg->train.seed);
  if ((rc = optim_init(&t->optim, &cfg->train.optim, t->be, t->model.nparams, e))) goto fail;
  if ((rc = pipeline_init(&t->pipe, &t->model, link, cfg->stage, cfg->stages, cfg->micro, cfg->sched, e))) goto fail;
  t->steps_per_epoch = batcher_steps_per_epoch(&t->batcher, cfg->train.batch);
  t->total_steps = cfg->train.epochs * t->steps_per_epoch;
  t->stop_step = t->total_steps;
  if (cfg->train.max_steps > 0 && cfg->train.max_steps < t->stop_step) t->stop_step = cfg->train.max_steps;
  size_t xb = (size_t)(cfg->train.batch * t->train.features) * sizeof(float);
  t->xh = tensor_host_alloc(t->be, xb);
  t->yh = tensor_host_alloc(t->be, (size_t)cfg->train.batch * sizeof(int32_t));
  if (!t->xh || !t->yh) {
    rc = rumor_err_set(e, -ENOMEM, "cannot allocate %zu bytes of host batch buffers", xb);
    goto fail;
  }
  batcher_start_epoch(&t->batcher, 0);
  t->t_start = t->t_last_log = clock_now_s();

  char desc[400];
  pipe_split_describe(&t->plan.spec, &t->plan.split, cfg->stage, desc, sizeof desc);
  log_info("group %s %s on %s; %d micro-batches of up to %lld rows, %s schedule; shard %lld/%lld: %lld batches of %lld "
           "per epoch",
           cfg->group, desc, tensor_backend_name(t->be), cfg->micro, (long long)t->plan.mb_rows,
           pipe_schedule_name(cfg->sched), (long long)cfg->train.shard.index, (long long)cfg->train.shard.count,
           (long long)t->steps_per_epoch, (long long)cfg->train.batch);
  return 0;
fail:
  stage_trainer_free(t);
  return rc;
}

void stage_trainer_free(struct stage_trainer *t) {
  pipeline_free(&t->pipe);
  if (t->be) {
    tensor_host_free(t->be, t->xh);
    tensor_host_free(t->be, t->yh);
  }
  optim_free(&t->optim);
  model_free(&t->model);
  batcher_free(&t->batcher);
  dataset_free(&t->train);
  dataset_free(&t->test);
  tensor_backend_close(t->be);
  memset(t, 0, sizeof *t);
}

bool stage_trainer_done(const struct stage_trainer *t) { return t->st.step >= t->stop_step; }

/* ---- steps ---- */

static void progress(struct stage_trainer *t, double lr) {
  double now = clock_now_s(), el = now - t->t_start;
  double rate = el > 0 ? (double)(t->st.samples - t->samples_at_start) / el : 0;
  const struct pipe_stats *ps = &t->pipe.st;
  double idle = ps->step_s > 0 ? ps->wait_s / ps->step_s : 0;
  if (is_last(t))
    log_info("epoch %lld/%lld  step %lld/%lld  loss %.4f  lr %.4g  %.0f samples/s  idle %.1f%%", (long long)t->st.epoch + 1,
             (long long)t->cfg.train.epochs, (long long)t->st.step_in_epoch, (long long)t->steps_per_epoch, t->loss_avg,
             lr, rate, 100 * idle);
  else
    log_info("epoch %lld/%lld  step %lld/%lld  lr %.4g  %.0f samples/s  idle %.1f%%", (long long)t->st.epoch + 1,
             (long long)t->cfg.train.epochs, (long long)t->st.step_in_epoch, (long long)t->steps_per_epoch, lr, rate,
             100 * idle);
  t->t_last_log = now;
}

int stage_trainer_evaluate(struct stage_trainer *t, struct rumor_err *e) {
  int64_t correct = 0;
  double loss = 0;
  int rc = pipeline_eval(&t->pipe, &t->test, t->lut, &correct, &loss, e);
  if (rc) return rc;
  if (is_last(t)) {
    t->accuracy = (double)correct / (double)t->test.count;
    t->test_loss = loss / (double)t->test.count;
  }
  return 0;
}

int stage_trainer_step(struct stage_trainer *t, struct rumor_err *e) {
  RUMOR_ASSERT(!stage_trainer_done(t));
  if (!t->started) {
    t->started = true;
    t->t_start = t->t_last_log = clock_now_s();
    t->samples_at_start = t->st.samples;
  }
  int64_t bs = t->cfg.train.batch;
  int64_t first = t->st.step_in_epoch * bs;
  int64_t rows = t->batcher.n - first < bs ? t->batcher.n - first : bs;
  if (is_first(t) || is_last(t)) {
    int64_t got = batcher_fill(&t->batcher, t->st.step_in_epoch, bs, t->xh, t->yh);
    RUMOR_ASSERT(got == rows);
  }
  double loss_sum = 0;
  int rc = pipeline_step(&t->pipe, t->st.step, rows, is_first(t) ? t->xh : NULL, is_last(t) ? t->yh : NULL, &loss_sum, e);
  if (rc) return rc;
  double lr = optim_lr_at(&t->cfg.train.optim, t->st.step, t->total_steps);
  optim_apply(&t->optim, &t->model.params, &t->model.grads, lr);
  tensor_backend_sync(t->be);

  t->st.step++;
  t->st.samples += rows;
  bool epoch_end = ++t->st.step_in_epoch == t->steps_per_epoch;
  if (epoch_end) {
    t->st.epoch++;
    t->st.step_in_epoch = 0;
    batcher_start_epoch(&t->batcher, t->st.epoch);
  }
  if (is_last(t)) {
    t->last_loss = loss_sum / (double)rows;
    t->loss_avg = isnan(t->loss_avg) ? t->last_loss : 0.95 * t->loss_avg + 0.05 * t->last_loss;
  }
  if (t->cfg.train.log_every_s > 0 && clock_now_s() - t->t_last_log >= t->cfg.train.log_every_s) progress(t, lr);
  if (epoch_end) {
    if (t->cfg.train.eval_each_epoch && (rc = stage_trainer_evaluate(t, e))) return rc;
    if (is_last(t))
      log_info("epoch %lld/%lld done at step %lld: train loss %.4f, test accuracy %.4f, test loss %.4f",
               (long long)t->st.epoch, (long long)t->cfg.train.epochs, (long long)t->st.step, t->loss_avg, t->accuracy,
               t->test_loss);
    else
      log_info("epoch %lld/%lld done at step %lld", (long long)t->st.epoch, (long long)t->cfg.train.epochs,
               (long long)t->st.step);
  }
  const char *ck = t->cfg.train.checkpoint;
  if (ck && (epoch_end || stage_trainer_done(t) ||
             (t->cfg.train.checkpoint_every > 0 && t->st.step % t->cfg.train.checkpoint_every == 0))) {
    char path[1024];
    stage_checkpoint_path(ck, t->cfg.stage, path, sizeof path);
    if ((rc = stage_trainer_save(t, path, e))) return rc;
  }
  return 0;
}

/* ---- state ---- */

int64_t stage_trainer_state_floats(const struct stage_trainer *t) {
  return t->model.nparams * (1 + optim_state_per_param(t->optim.cfg.kind));
}

void stage_trainer_copy_state(struct stage_trainer *t, float *out) {
  int64_t P = t->model.nparams;
  tensor_copy_to_host(&t->model.params, 0, out, (size_t)P * sizeof(float));
  tensor_copy_to_host(&t->optim.state, 0, out + P, tensor_nbytes(&t->optim.state));
}

void stage_trainer_load_state(struct stage_trainer *t, const float *state) {
  int64_t P = t->model.nparams;
  tensor_copy_from_host(&t->model.params, 0, state, (size_t)P * sizeof(float));
  tensor_copy_from_host(&t->optim.state, 0, state + P, tensor_nbytes(&t->optim.state));
}

void stage_trainer_set_position(struct stage_trainer *t, int64_t step, int64_t epoch, int64_t samples) {
  t->optim.step = step;
  t->st.step = step;
  t->st.epoch = epoch;
  t->st.step_in_epoch = 0;
  t->st.samples = samples;
  batcher_start_epoch(&t->batcher, epoch);
}

int stage_trainer_save(struct stage_trainer *t, const char *path, struct rumor_err *e) {
  const struct model *m = &t->model;
  const struct model_spec *s = &t->plan.spec;
  int64_t P = m->nparams;
  int nstate = optim_state_per_param(t->optim.cfg.kind);
  size_t pbytes = (size_t)P * sizeof(float);
  float *host = tensor_host_alloc(t->be, pbytes * (size_t)(1 + nstate));
  if (!host) return rumor_err_set(e, -ENOMEM, "cannot allocate %zu bytes to save %s", pbytes * (size_t)(1 + nstate), path);
  stage_trainer_copy_state(t, host);
  struct st_tensor ts[2 * MODEL_MAX_LAYERS + 2];
  size_t nts = 0;
  for (int l = m->l0; l < m->l1; l++) {
    int64_t off = model_spec_layer_offset(s, l) - m->param_base;
    int64_t out = s->widths[l + 1], in = s->widths[l];
    struct st_tensor *w = &ts[nts++], *b = &ts[nts++];
    *w = (struct st_tensor){.dtype = TENSOR_F32, .ndim = 2, .shape = {out, in}, .data = host + off,
                            .nbytes = (size_t)(out * in) * sizeof(float)};
    snprintf(w->name, sizeof w->name, "layers.%d.weight", l);
    *b = (struct st_tensor){.dtype = TENSOR_F32, .ndim = 1, .shape = {out}, .data = host + off + out * in,
                            .nbytes = (size_t)out * sizeof(float)};
    snprintf(b->name, sizeof b->name, "layers.%d.bias", l);
  }
  static const char *const sgd[] = {"optimizer.momentum"}, *const adamw[] = {"optimizer.exp_avg", "optimizer.exp_avg_sq"};
  for (int k = 0; k < nstate; k++) {
    struct st_tensor *x = &ts[nts++];
    *x = (struct st_tensor){.dtype = TENSOR_F32, .ndim = 1, .shape = {P}, .data = host + P * (1 + k), .nbytes = pbytes};
    snprintf(x->name, sizeof x->name, "%s", t->optim.cfg.kind == OPTIM_ADAMW ? adamw[k] : sgd[k]);
  }
  char spec[MODEL_SPEC_MAX], split[PIPE_MAX_STAGES * 4 + 8], stage[32], layers[32], step[24], epoch[24], samples[24],
      seed[24];
  model_spec_format(s, spec, sizeof spec);
  pipe_split_format(&t->plan.split, split, sizeof split);
  snprintf(stage, sizeof stage, "%d/%d", t->cfg.stage, t->cfg.stages);
  snprintf(layers, sizeof layers, "%d-%d", m->l0, m->l1 - 1);
  snprintf(step, sizeof step, "%" PRId64, t->st.step);
  snprintf(epoch, sizeof epoch, "%" PRId64, t->st.epoch);
  snprintf(samples, sizeof samples, "%" PRId64, t->st.samples);
  snprintf(seed, sizeof seed, "%" PRIu64, t->cfg.train.seed);
  struct st_meta meta[] = {
      {"format", "pt"},
      {"rumor.format", "stage-1"},
      {"rumor.model", spec},
      {"rumor.group", t->cfg.group},
      {"rumor.stage", stage},
      {"rumor.layers", layers},
      {"rumor.split", split},
      {"rumor.step", step},
      {"rumor.epoch", epoch},
      {"rumor.samples", samples},
      {"rumor.seed", seed},
      {"rumor.optimizer", optim_kind_name(t->optim.cfg.kind)},
  };
  int rc = safetensors_write(path, ts, nts, meta, sizeof meta / sizeof meta[0], e);
  tensor_host_free(t->be, host);
  if (rc == 0) log_info("stage checkpoint saved to %s (step %lld)", path, (long long)t->st.step);
  return rc;
}
