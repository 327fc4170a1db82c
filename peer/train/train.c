/* The training loop of a whole replica or of one pipeline stage. */
#include "peer/train/train_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <time.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

void train_config_default(struct train_config *c) {
  memset(c, 0, sizeof *c);
  c->model = NULL;
  c->data_dir = NULL;
  c->val_fraction = 0.1;
  c->eval_batches = -1;
  c->device = "auto";
  c->threads = 0;
  c->shard = (struct shard){0, 1};
  c->seed = 1;
  c->data_seed = 1;
  c->moe_aux_weight = MODEL_MOE_AUX_WEIGHT;
  c->moe_z_weight = MODEL_MOE_Z_WEIGHT;
  c->epochs = 10;
  c->batch = 128;
  optim_config_default(&c->optim);
  c->log_every_s = 5.0;
  c->eval_each_epoch = true;
}

bool trainer_is_stage(const struct trainer *t) { return t->stage.stages > 0; }
bool trainer_in_group_comm(const struct trainer *t) { return t->cfg.tp || t->cfg.dp; }
static bool first_stage(const struct trainer *t) { return !trainer_is_stage(t) || t->stage.stage == 0; }
bool trainer_has_loss(const struct trainer *t) {
  return !trainer_is_stage(t) || t->stage.stage == t->stage.stages - 1;
}
/* This process needs the batches' inputs (x) or labels (y). */
static bool needs_batches(const struct trainer *t) { return first_stage(t) || trainer_has_loss(t); }

/* ---- set-up ---- */

/* A resumed run keeps the batches of the run it continues: its batch,
 * shard and seeds come from the checkpoint. One given on the command line
 * that differs is refused, not dropped without a word. */
static int refuse_other_run(const struct train_config *cfg, const struct ckpt_info *in, struct rumor_err *e) {
  /* Each option as given and as saved, in the same words. */
  char want[4][48], have[4][48];
  snprintf(want[0], sizeof want[0], "%lld", (long long)cfg->batch);
  snprintf(have[0], sizeof have[0], "%lld", (long long)in->batch);
  snprintf(want[1], sizeof want[1], "%lld/%lld", (long long)cfg->shard.index, (long long)cfg->shard.count);
  snprintf(have[1], sizeof have[1], "%lld/%lld", (long long)in->shard.index, (long long)in->shard.count);
  snprintf(want[2], sizeof want[2], "%llu", (unsigned long long)cfg->seed);
  snprintf(have[2], sizeof have[2], "%llu", (unsigned long long)in->seed);
  snprintf(want[3], sizeof want[3], "%llu", (unsigned long long)cfg->data_seed);
  snprintf(have[3], sizeof have[3], "%llu", (unsigned long long)in->data_seed);
  const char *flag[4] = {"--batch", "--shard", "--seed", "--data-seed"};
  const bool given[4] = {cfg->batch_given, cfg->shard_given, cfg->seed_given, cfg->data_seed_given};
  for (int i = 0; i < 4; i++)
    if (given[i] && strcmp(want[i], have[i]) != 0)
      return rumor_err_set(e, RUMOR_EFORMAT,
                           "%s %s does not match the checkpoint %s, which was saved with %s %s (a resumed run keeps "
                           "its batches: leave %s out, or start a new run without --resume)",
                           flag[i], want[i], cfg->resume, flag[i], have[i], flag[i]);
  return 0;
}

/* Takes the run's identity from the open checkpoint `ck`, so that the
 * resumed run sees the same batches in the same order; closes it on
 * failure. */
static int resume_identity(struct trainer *t, struct checkpoint *ck, struct model_spec *spec, struct rumor_err *e) {
  const struct train_config *cfg = &t->cfg;
  int rc;
  *spec = ck->info.spec;
  if (cfg->model) {
    struct model_spec want;
    if ((rc = model_spec_parse(cfg->model, &want, e))) goto fail;
    if (!model_spec_equal(&want, spec)) {
      char a[MODEL_SPEC_MAX], b[MODEL_SPEC_MAX];
      model_spec_format(&want, a, sizeof a);
      model_spec_format(spec, b, sizeof b);
      rc = rumor_err_set(e, RUMOR_ESHAPE, "--model %s does not match the checkpoint %s, which holds %s", a, cfg->resume, b);
      goto fail;
    }
  }
  if ((rc = refuse_other_run(cfg, &ck->info, e))) goto fail;
  t->cfg.seed = ck->info.seed;
  t->cfg.data_seed = ck->info.data_seed;
  t->cfg.shard = ck->info.shard;
  t->cfg.batch = ck->info.batch;
  t->st = ck->info.st;
  /* The optimiser whose state the file holds, and the schedule's length,
   * unless the command line says otherwise (and then it must agree). */
  if (ck->has_optim && !cfg->optim_given) t->cfg.optim.kind = ck->info.optim_kind;
  if (ck->has_optim && cfg->optim_given && cfg->optim.kind != ck->info.optim_kind) {
    rc = rumor_err_set(e, RUMOR_ESHAPE, "--optimizer %s does not match the checkpoint %s, which holds %s state",
                       optim_kind_name(cfg->optim.kind), cfg->resume, optim_kind_name(ck->info.optim_kind));
    goto fail;
  }
  if (ck->info.epochs > 0 && !cfg->epochs_given) t->cfg.epochs = ck->info.epochs;
  t->resumed_schedule = ck->info.schedule_steps;
  return 0;
fail:
  checkpoint_close(ck);
  return rc;
}

/* Opens cfg->resume (a damaged checkpoint falls back to the previous one:
 * train.h) and takes the run's identity from it. */
static int open_resume(struct trainer *t, struct checkpoint *ck, struct model_spec *spec, struct rumor_err *e) {
  int rc = checkpoint_open_latest(t->cfg.resume, ck, t->resumed_from, sizeof t->resumed_from, e);
  return rc ? rc : resume_identity(t, ck, spec, e);
}

/* A pipeline stage's --resume X: its own file of a staged run, X-stage<s>
 * (train_stage_checkpoint_path, as --checkpoint X writes it), when there is
 * one that holds this stage's units; else X itself: a whole model's
 * checkpoint of any run (rumor train's, a data- or tensor-parallel
 * group's), or the stage files of a pipeline of another split, which the
 * checkpoint layer puts together, of which it takes its units. The plan
 * (t->plan) follows the run's batch. */
static int open_stage_resume(struct trainer *t, struct checkpoint *ck, struct rumor_err *e) {
  const struct train_config *cfg = &t->cfg;
  char own[CHECKPOINT_PATH_MAX + 32];
  train_stage_checkpoint_path(cfg->resume, t->stage.stage, own, sizeof own);
  const char *paths[2] = {own, cfg->resume};
  struct model_spec spec;
  int rc = 0;
  for (int i = 0; i < 2; i++) {
    rc = checkpoint_open_part_latest(paths[i], ck, t->resumed_from, sizeof t->resumed_from, e);
    if (rc == -ENOENT && i == 0) continue;
    if (rc || (rc = resume_identity(t, ck, &spec, e))) return rc; /* resume_identity closed ck */
    if ((rc = train_stage_plan(&t->cfg, &t->plan, e))) break;
    if (t->plan.u0 >= ck->u0 && t->plan.u1 <= ck->u1) return 0;
    if (i == 1) {
      rc = rumor_err_set(e, RUMOR_ESHAPE, "%s holds %ss %d-%d (stage %d/%d of a pipeline), not this stage's %d-%d",
                         t->resumed_from, model_spec_unit_noun(&spec), ck->u0, ck->u1 - 1, ck->info.stage,
                         ck->info.stages, t->plan.u0, t->plan.u1 - 1);
      break;
    }
    log_info("%s holds %ss %d-%d, not this stage's %d-%d: taking them from all of %s's", t->resumed_from,
             model_spec_unit_noun(&spec), ck->u0, ck->u1 - 1, t->plan.u0, t->plan.u1 - 1, cfg->resume);
    checkpoint_close(ck);
  }
  checkpoint_close(ck);
  return rc;
}

/* --init-from: the spec and the weights of a Hugging Face directory. */
static int init_from(struct trainer *t, struct rumor_err *e) {
  const struct train_config *cfg = &t->cfg;
  int rc = hf_import(cfg->init_from, &t->plan.spec, &t->init_params, e);
  if (rc || !cfg->model) return rc;
  struct model_spec want;
  if ((rc = model_spec_parse(cfg->model, &want, e))) return rc;
  if (want.family == MODEL_GPT && want.u.gpt.experts && !model_spec_equal(&want, &t->plan.spec)) {
    /* A mixture of experts from the dense model of its shape (upcycling). */
    float *moe = malloc((size_t)model_spec_param_count(&want) * sizeof(float));
    if (!moe) return rumor_err_set(e, -ENOMEM, "no memory to upcycle %s", cfg->init_from);
    rc = model_upcycle(&t->plan.spec, t->init_params, &want, cfg->seed, moe, e);
    free(t->init_params);
    t->init_params = moe;
    if (rc) return rumor_err_prefix(e, "--init-from %s", cfg->init_from);
    t->plan.spec = want;
    log_info("upcycled %s: every expert starts as its block's dense MLP, the routers afresh", cfg->init_from);
    return 0;
  }
  if (!model_spec_equal(&want, &t->plan.spec)) {
    char a[MODEL_SPEC_MAX], b[MODEL_SPEC_MAX];
    model_spec_format(&want, a, sizeof a);
    model_spec_format(&t->plan.spec, b, sizeof b);
    return rumor_err_set(e, RUMOR_ESHAPE, "--model %s does not match --init-from %s, which holds %s", a,
                         cfg->init_from, b);
  }
  return 0;
}

/* The model this process holds and where it comes from: a stage's plan, the
 * resumed checkpoint (left open in *ck, *resumed set), or --model. */
static int choose_model(struct trainer *t, struct checkpoint *ck, bool *resumed, struct rumor_err *e) {
  const struct train_config *cfg = &t->cfg;
  int rc;
  if (trainer_is_stage(t)) {
    if (cfg->resume) {
      if ((rc = open_stage_resume(t, ck, e))) return rc;
      *resumed = true;
      return 0;
    }
    if (cfg->init_from && (rc = init_from(t, e))) return rc; /* the whole model's, checked against --model */
    return train_stage_plan(cfg, &t->plan, e);
  }
  if (cfg->resume) {
    if ((rc = open_resume(t, ck, &t->plan.spec, e))) return rc;
    *resumed = true;
  } else if (cfg->init_from) {
    if ((rc = init_from(t, e))) return rc;
  } else if ((rc = model_spec_parse(cfg->model ? cfg->model : "mlp:784-512-256-10", &t->plan.spec, e))) {
    return rc;
  }
  t->plan.u0 = 0;
  t->plan.u1 = model_spec_units(&t->plan.spec);
  t->plan.mb_rows = t->cfg.batch;
  return 0;
}

static int alloc_batches(struct trainer *t, struct rumor_err *e) {
  int nbuf = trainer_is_stage(t) ? 1 : 2;
  for (int i = 0; i < nbuf && needs_batches(t); i++) {
    t->xh[i] = tensor_host_alloc(t->be, (size_t)t->cfg.batch * t->data.x_bytes_per_row);
    t->yh[i] = tensor_host_alloc(t->be, (size_t)(t->cfg.batch * t->data.y_per_row) * sizeof(int32_t));
    if (!t->xh[i] || !t->yh[i]) return rumor_err_set(e, -ENOMEM, "cannot allocate host batch buffers");
  }
  return 0;
}

static void log_setup(const struct trainer *t) {
  char s[MODEL_SPEC_MAX];
  model_spec_format(&t->plan.spec, s, sizeof s);
  const struct train_config *c = &t->cfg;
  if (trainer_is_stage(t)) {
    char desc[400];
    pipe_split_describe(&t->plan.spec, &t->plan.split, t->stage.stage, desc, sizeof desc);
    char dp[96] = "";
    if (c->dp)
      snprintf(dp, sizeof dp, ", data-parallel member %d/%d (ZeRO %d%s) on its slice of each batch", t->zero.rank,
               t->zero.size, c->dp->zero, c->dp->experts ? ", expert-parallel" : "");
    log_info("group %s %s on %s%s; %d micro-batches of up to %lld rows, %s schedule; shard %lld/%lld: %lld batches "
             "of %lld per epoch",
             t->stage.group, desc, tensor_backend_name(t->be), dp, t->stage.micro, (long long)t->plan.mb_rows,
             pipe_schedule_name(t->stage.sched), (long long)c->shard.index, (long long)c->shard.count,
             (long long)t->steps_per_epoch, (long long)c->batch);
    return;
  }
  log_info("model %s: %lld parameters (%.1f MiB) on %s; shard %lld/%lld: %lld %s, %lld batches of %lld per epoch",
           s, (long long)t->model.nparams, (double)t->model.nparams * 4 / (1 << 20), tensor_backend_name(t->be),
           (long long)c->shard.index, (long long)c->shard.count, (long long)train_data_shard_rows(&t->data),
           trainer_row_noun(t), (long long)t->steps_per_epoch, (long long)c->batch);
  if (t->model.ep) {
    int lo, hi;
    model_ep_experts(&t->plan.spec, t->ep.size, t->ep.rank, &lo, &hi);
    log_info("expert-parallel rank %d/%d: runs experts %d-%d of each mixture-of-experts block on the rows its run's "
             "members route to them", t->ep.rank, t->ep.size, lo, hi - 1);
  }
  if (c->resume)
    log_info("resumed from %s at step %lld (epoch %lld, batch %lld)", t->resumed_from, (long long)t->st.step,
             (long long)t->st.epoch + 1, (long long)t->st.step_in_epoch);
}

/* Where --checkpoint saves this process's part: the path itself, or a
 * stage's file beside it. */
static void checkpoint_path_of(const struct trainer *t, char *path, size_t n) {
  if (trainer_is_stage(t)) train_stage_checkpoint_path(t->cfg.checkpoint, t->stage.stage, path, n);
  else snprintf(path, n, "%s", t->cfg.checkpoint);
}

/* The sync scheme's state (train_config.extra): zeroed, on the device. */
static int alloc_extra(struct trainer *t, struct rumor_err *e) {
  const struct train_extra_spec *x = &t->cfg.extra;
  RUMOR_ASSERT(x->n >= 0 && x->n <= TRAIN_EXTRA_MAX);
  int64_t off = 0;
  for (int i = 0; i < x->n; i++) {
    t->extra_off[i] = off;
    off += x->seg[i].per_param * t->shard_n + x->seg[i].fixed;
  }
  t->extra_off[x->n] = off;
  if (off == 0) return 0;
  int rc = tensor_alloc(&t->extra, t->be, TENSOR_F32, 1, &off, e);
  if (rc) return rumor_err_prefix(e, "the sync scheme's state (%lld floats)", (long long)off);
  tensor_fill(&t->extra, 0.0f);
  return 0;
}

/* --resume: the scheme's segments from the checkpoint, by name and length;
 * when one is missing (a checkpoint of a run without them) they all stay
 * zero, and the scheme starts its state afresh. A checkpoint holds each
 * per-parameter segment over the parameters it holds: a replica's or a
 * stage's (this trainer's shard), or, written by a group (group_save),
 * the whole model's, of which a group member takes its tensor-parallel
 * slices and then its shard of them. */
static void restore_extra(struct trainer *t, const struct checkpoint *ck) {
  const struct train_extra_spec *x = &t->cfg.extra;
  struct model *m = &t->model;
  /* A group member's segments are the whole model's (a pipeline stage's
   * file: its units' range of them, spread back into the whole layout);
   * a replica's or a stage's what the file holds (a stage's own, or the
   * whole model's, of which it takes its units' range). `from`: where this
   * process's shard starts in the layout it reads from (a rank's slices,
   * or the whole model's). */
  bool group = trainer_in_group_comm(t);
  int64_t W = group ? m->table.nparams : ck->nparams, have = group ? ck->nparams : W;
  int64_t from = group ? m->param_base + t->shard_lo : m->param_base - ck->base;
  for (int i = 0; i < x->n; i++)
    if (!checkpoint_extra(ck, x->seg[i].name, x->seg[i].per_param * have + x->seg[i].fixed)) {
      log_warn("%s has no %s of this model's size: the sync scheme's state starts afresh", t->resumed_from,
               x->seg[i].name);
      return;
    }
  float *slices = m->tp ? xmalloc((size_t)model_tp_local_params(&m->spec, m->tp->size, m->tp->rank) * sizeof(float))
                        : NULL;
  float *spread = have != W ? xcalloc((size_t)W, sizeof(float)) : NULL;
  for (int i = 0; i < x->n; i++) {
    const float *src = checkpoint_extra(ck, x->seg[i].name, x->seg[i].per_param * have + x->seg[i].fixed);
    int64_t at = t->extra_off[i];
    if (x->seg[i].per_param) {
      const float *mine = src;
      if (spread) { /* a stage's file: its units' range of the whole layout */
        memcpy(spread + ck->base, src, (size_t)have * sizeof(float));
        mine = spread;
      }
      if (m->tp) {
        model_tp_scatter(&m->spec, m->tp->size, m->tp->rank, mine, slices);
        mine = slices;
      }
      tensor_copy_from_host(&t->extra, at, mine + from, (size_t)t->shard_n * sizeof(float));
      at += t->shard_n;
    }
    if (x->seg[i].fixed)
      tensor_copy_from_host(&t->extra, at, src + x->seg[i].per_param * have, (size_t)x->seg[i].fixed * sizeof(float));
  }
  free(slices);
  free(spread);
}

struct tensor trainer_extra(struct trainer *t, int i) {
  RUMOR_ASSERT(i >= 0 && i < t->cfg.extra.n);
  int64_t len = t->extra_off[i + 1] - t->extra_off[i];
  return tensor_view(&t->extra, t->extra_off[i], 1, &len);
}

/* A group member resumes from a whole-model checkpoint of any layout: it
 * takes its slices and its piece (group_load). */
static int restore_group(struct trainer *t, const struct checkpoint *ck, struct rumor_err *e) {
  char want[MODEL_SPEC_MAX], have[MODEL_SPEC_MAX];
  model_spec_format(&ck->info.spec, have, sizeof have);
  model_spec_format(&t->model.spec, want, sizeof want);
  if (strcmp(want, have) != 0) return rumor_err_set(e, RUMOR_ESHAPE, "checkpoint holds model %s, not %s", have, want);
  /* In the whole model's layout: a stage's file (a member of a pipelined
   * group) fills its units' range, the only one the member reads. */
  int64_t W = ck->table.nparams;
  int nstate = checkpoint_optim_part(ck, t->optim.cfg.kind, 0) ? optim_state_per_param(t->optim.cfg.kind) : 0;
  bool part = ck->nparams != W;
  /* Zeros where a stage's file has nothing: a rank's scatter reads them. */
  float *full = calloc((size_t)W * (size_t)(1 + (part ? nstate : 0)), sizeof(float));
  if (!full) return rumor_err_set(e, -ENOMEM, "no memory for the checkpoint's %lld parameters", (long long)W);
  checkpoint_params(ck, full);
  const float *parts[2] = {NULL, NULL};
  for (int s = 0; s < nstate; s++) {
    parts[s] = checkpoint_optim_part(ck, t->optim.cfg.kind, s);
    if (part) {
      memcpy(full + W * (1 + s) + ck->base, parts[s], (size_t)ck->nparams * sizeof(float));
      parts[s] = full + W * (1 + s);
    }
  }
  if (!nstate)
    log_warn("checkpoint has no %s optimizer state; starting it from zero", optim_kind_name(t->optim.cfg.kind));
  group_load(t, full, nstate ? parts : NULL);
  t->optim.step = ck->info.st.step;
  free(full);
  restore_extra(t, ck);
  return 0;
}

/* The most rows a data-parallel member's model holds at once: its slice
 * of a batch (comm_chunk's largest), or a stage's micro-batch of it. */
static int64_t member_rows(const struct trainer *t) {
  int D = comm_size(t->cfg.dp->comm);
  int64_t slice = (t->cfg.batch + D - 1) / D;
  return trainer_is_stage(t) ? (slice + t->stage.micro - 1) / t->stage.micro : slice;
}

/* The backend, the data and the model (a tensor-parallel rank's slices,
 * an expert-parallel rank's exchanges) of trainer_init; `resumed`: the
 * checkpoint's info, or NULL. */
static int open_model(struct trainer *t, const struct ckpt_info *resumed, struct rumor_err *e) {
  const struct train_config *cfg = &t->cfg;
  const struct model_spec *spec = &t->plan.spec;
  int rc;
  if ((rc = tensor_backend_open(cfg->device, &t->be, e))) return rc;
  if (cfg->threads > 0) tensor_backend_set_threads(t->be, cfg->threads);
  tensor_backend_set_tf32(t->be, cfg->tf32);
  if ((rc = train_data_load(&t->data, &t->cfg, spec, resumed, e))) return rc;
  if (cfg->dp) t->plan.mb_rows = member_rows(t);
  if (cfg->tp) group_tp_setup(t);
  /* ZeRO 2 and 3 give back the gradients and parameters outside a member's
   * piece between uses, and expert-parallel members at ZeRO 1-3 those of
   * the experts others run: on a GPU that takes buffers that can. */
  bool shards = cfg->dp && (cfg->dp->zero >= 2 || (cfg->dp->zero == 1 && cfg->dp->experts));
  if (shards) tensor_backend_set_discardable(t->be, true);
  rc = cfg->tp ? model_init_tp(&t->model, spec, t->plan.u0, t->plan.u1, t->be, t->plan.mb_rows, &t->tp, e)
               : model_init(&t->model, spec, t->plan.u0, t->plan.u1, t->be, t->plan.mb_rows, e);
  if (shards) tensor_backend_set_discardable(t->be, false);
  if (rc) return rc;
  model_set_moe_losses(&t->model, cfg->moe_aux_weight, cfg->moe_z_weight);
  /* Every member of an expert-parallel run takes part in every pass: the
   * CLI (group_ep_check) gives each a row of every full batch. */
  RUMOR_ASSERT(!(cfg->dp && cfg->dp->experts) || cfg->batch >= comm_size(cfg->dp->comm));
  return cfg->dp && cfg->dp->experts ? group_ep_setup(t, e) : 0;
}

/* The optimizer over the parameters this process updates (a ZeRO 1-3
 * member's piece, else all of them), and the shard the sync path sees
 * (the piece, or everything). A `fresh` ZeRO 3 member first draws its
 * parameters and gives back what is not its piece, so its peak stays at
 * its share (the draw may hold a host copy of the whole model meanwhile). */
static int init_optimizer(struct trainer *t, bool fresh, struct rumor_err *e) {
  const struct train_dp *dp = t->cfg.dp;
  struct model *m = &t->model;
  int64_t lo = 0, hi = m->nparams;
  if (dp) zero_piece(dp, m->nparams, &lo, &hi);
  if (fresh && dp && dp->zero == 3) {
    model_init_params(m, t->cfg.seed);
    tensor_discard(&m->params, 0, lo);
    tensor_discard(&m->params, hi, m->nparams - hi);
  }
  t->shard_lo = lo;
  t->shard_n = hi - lo;
  if (dp && dp->zero >= 1) /* the table's positions: a stage's start after param_base */
    return optim_init_range(&t->optim, &t->cfg.optim, model_own_table(m), m->param_base + lo, m->param_base + hi,
                            t->be, e);
  return optim_init(&t->optim, &t->cfg.optim, m, e);
}

/* The schedule's length and the step to stop at. The schedule spans the
 * configured epochs even when max_steps stops the run earlier, so a run
 * cut short and resumed follows the same rates. Without --epochs, a run
 * given --max-steps (how language models are trained: a number of steps,
 * not of passes) has a schedule of that many steps; resumed, it keeps it,
 * or takes a new --max-steps as its new length (training extended).
 * RUMOR_ECORRUPT when a resumed position is past its epoch. */
static int plan_schedule(struct trainer *t, struct rumor_err *e) {
  t->steps_per_epoch = train_data_steps_per_epoch(&t->data, t->cfg.batch);
  t->total_steps = t->cfg.epochs * t->steps_per_epoch;
  t->schedule_by_steps = !t->cfg.epochs_given && (t->cfg.resume ? t->resumed_schedule > 0 : t->cfg.max_steps > 0);
  if (t->schedule_by_steps) t->total_steps = t->cfg.max_steps > 0 ? t->cfg.max_steps : t->resumed_schedule;
  t->stop_step = t->total_steps;
  if (t->cfg.max_steps > 0 && t->cfg.max_steps < t->stop_step) t->stop_step = t->cfg.max_steps;
  if (t->st.step_in_epoch >= t->steps_per_epoch)
    return rumor_err_set(e, RUMOR_ECORRUPT, "checkpoint position (batch %lld of epoch %lld) is past the epoch's %lld "
                         "batches", (long long)t->st.step_in_epoch, (long long)t->st.epoch,
                         (long long)t->steps_per_epoch);
  return 0;
}

int trainer_init(struct trainer *t, const struct train_config *cfg, struct rumor_err *e) {
  memset(t, 0, sizeof *t);
  t->cfg = *cfg;
  /* A data- or tensor-parallel member of a group of one stage holds a
   * whole replica to the trainer. Data-parallel members (ZeRO 0 or 1: the
   * micro-batches' gradients accumulate whole) and tensor-parallel ranks
   * of a pipeline's stages, or both, are stages. */
  bool one_stage = !cfg->stage || cfg->stage->stages == 1;
  RUMOR_ASSERT(!cfg->dp || one_stage || cfg->dp->zero <= 1);
  if ((cfg->dp || cfg->tp) && one_stage) t->cfg.stage = NULL;
  if (t->cfg.stage) {
    t->stage = *cfg->stage;
    t->cfg.stage = &t->stage;
  }
  t->loss_avg = t->last_loss = t->accuracy = t->test_loss = t->grad_norm = NAN;
  struct checkpoint ck;
  bool resumed = false;
  int rc;
  if (cfg->checkpoint) {
    char path[1024];
    checkpoint_path_of(t, path, sizeof path);
    /* A stage of a directory checkpoint saves its file inside it: the
     * directory is checked and made first (the stages may race to it). */
    bool in_dir = trainer_is_stage(t) && checkpoint_is_dir(cfg->checkpoint);
    if (in_dir && (rc = checkpoint_check_dest(cfg->checkpoint, e))) return rumor_err_prefix(e, "--checkpoint");
    if (in_dir && mkdir(cfg->checkpoint, 0755) < 0 && errno != EEXIST)
      return rumor_err_set(e, -errno, "--checkpoint: cannot make the directory %s: %s", cfg->checkpoint,
                           strerror(errno));
    if ((rc = checkpoint_check_dest(path, e))) return rumor_err_prefix(e, "--checkpoint");
  }
  if ((rc = choose_model(t, &ck, &resumed, e))) return rc;
  if ((rc = open_model(t, resumed ? &ck.info : NULL, e)) || (rc = init_optimizer(t, !resumed && !t->init_params, e)))
    goto fail;
  if ((rc = alloc_extra(t, e))) goto fail;
  if (resumed && (cfg->tp || cfg->dp)) {
    rc = restore_group(t, &ck, e);
    checkpoint_close(&ck);
    resumed = false;
    if (rc) goto fail;
  } else if (resumed) {
    rc = checkpoint_restore(&ck, &t->model, &t->optim, e);
    if (rc == 0) restore_extra(t, &ck);
    checkpoint_close(&ck);
    resumed = false;
    if (rc) goto fail;
  } else if (t->init_params) {
    if (cfg->tp || cfg->dp) group_load(t, t->init_params, NULL);
    else /* a stage's units from the whole model's */
      tensor_copy_from_host(&t->model.params, 0, t->init_params + t->model.param_base,
                            (size_t)t->model.nparams * sizeof(float));
    free(t->init_params);
    t->init_params = NULL;
    log_info("weights from %s", cfg->init_from);
  } else if (!(cfg->dp && cfg->dp->zero == 3)) {
    model_init_params(&t->model, t->cfg.seed);
  }
  if (cfg->dp && (rc = zero_init(t, e))) goto fail;
  if (trainer_is_stage(t) && (rc = pipeline_init(&t->pipe, &t->model, t->stage.link, t->stage.stage, t->stage.stages,
                                                 t->stage.micro, t->stage.sched, e)))
    goto fail;

  if ((rc = plan_schedule(t, e))) goto fail;
  if ((rc = alloc_batches(t, e))) goto fail;
  train_data_start_epoch(&t->data, t->st.epoch);
  t->t_start = t->t_last_log = clock_now_s();
  t->samples_at_start = t->st.samples;
  /* The device's most from here on: training's, not the set-up's (which may
   * hold a whole model a moment before ZeRO gives most of it back). */
  (void)tensor_backend_peak_bytes(t->be, true);
  log_setup(t);
  return 0;
fail:
  if (resumed) checkpoint_close(&ck);
  trainer_free(t);
  return rc;
}

void trainer_free(struct trainer *t) {
  pipeline_free(&t->pipe);
  if (t->cfg.dp) zero_free(t);
  if (t->tp_host) tensor_host_free(t->be, t->tp_host);
  tensor_free(&t->extra);
  free(t->init_params);
  if (t->be) {
    for (int i = 0; i < 2; i++) {
      tensor_host_free(t->be, t->xh[i]);
      tensor_host_free(t->be, t->yh[i]);
    }
  }
  free(t->epoch_losses);
  optim_free(&t->optim);
  model_free(&t->model);
  train_data_free(&t->data);
  tensor_backend_close(t->be);
  memset(t, 0, sizeof *t);
}

void trainer_set_link(struct trainer *t, stage_link_t *link) {
  RUMOR_ASSERT(trainer_is_stage(t));
  t->stage.link = link;
  t->pipe.link = link;
}

bool trainer_done(const struct trainer *t) { return t->st.step >= t->stop_step; }

/* ---- progress ---- */

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
  char eta[32], loss[32] = "", idle[32] = "", norm[32] = "";
  format_duration(remaining, eta, sizeof eta);
  if (trainer_has_loss(t)) snprintf(loss, sizeof loss, "  loss %.4f", t->loss_avg);
  char moe[96] = "";
  if (t->moe.experts)
    snprintf(moe, sizeof moe, "  aux %.4f  z %.4f  dropped %.1f%%", t->moe.aux_loss, t->moe.z_loss,
             100 * t->moe.dropped_fraction);
  if (t->cfg.grad_clip > 0) snprintf(norm, sizeof norm, "  grad norm %.3g", t->grad_norm);
  if (trainer_is_stage(t)) {
    const struct pipe_stats *ps = &t->pipe.st;
    snprintf(idle, sizeof idle, "  idle %.1f%%", 100 * (ps->step_s > 0 ? ps->wait_s / ps->step_s : 0));
  }
  log_info("epoch %lld/%lld  step %lld/%lld%s%s%s  lr %.4g  %.0f samples/s%s  ETA %s", (long long)t->st.epoch + 1,
           (long long)t->cfg.epochs, (long long)t->st.step_in_epoch, (long long)t->steps_per_epoch, loss, moe, norm,
           lr, rate, idle, eta);
  t->t_last_log = now;
}

/* ---- state ---- */

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
  info.epochs = t->cfg.epochs;
  info.schedule_steps = t->schedule_by_steps ? t->total_steps : 0;
  info.norm_mean = t->data.norm_mean;
  info.norm_std = t->data.norm_std;
  snprintf(info.peer_id, sizeof info.peer_id, "%s", t->cfg.peer_id ? t->cfg.peer_id : "");
  info.tf32 = t->cfg.tf32;
  if (trainer_is_stage(t)) {
    snprintf(info.group, sizeof info.group, "%s", t->stage.group);
    info.stage = t->stage.stage;
    info.stages = t->stage.stages;
    pipe_split_format(&t->plan.split, info.split, sizeof info.split);
  }
  return info;
}

/* Evaluation rows [first, first + rows) (pipe_gather_fn). */
static void gather_eval(void *arg, int64_t first, int64_t rows, void *x, int32_t *y) {
  train_data_gather(arg, true, first, rows, x, y);
}

/* A data-parallel member's slice of the evaluation rows: its rows start at
 * `from` (pipe_gather_fn over a struct eval_slice). */
struct eval_slice {
  const struct train_data *data;
  int64_t from;
};
static void gather_eval_slice(void *arg, int64_t first, int64_t rows, void *x, int32_t *y) {
  const struct eval_slice *s = arg;
  train_data_gather(s->data, true, s->from + first, rows, x, y);
}

/* Sums v[0..n) over a stage's data-parallel members (bit-identical on
 * every one). The communicator sums floats: each value travels as a float
 * and the float of its remainder, so the sum keeps about float precision
 * of the total (a loss sum of thousands to 1e-7 relative, counts below
 * 2^24 exactly). */
static int stage_dp_sum(struct trainer *t, double *v, int n, struct rumor_err *e) {
  float buf[4];
  RUMOR_ASSERT(n >= 1 && 2 * n <= (int)(sizeof buf / sizeof buf[0]));
  for (int i = 0; i < n; i++) {
    buf[2 * i] = (float)v[i];
    buf[2 * i + 1] = (float)(v[i] - (double)buf[2 * i]);
  }
  int rc = comm_all_reduce(t->zero.dp.comm, buf, 2 * n, e);
  for (int i = 0; rc == 0 && i < n; i++) v[i] = (double)buf[2 * i] + (double)buf[2 * i + 1];
  return rc;
}

/* A stage's evaluation of `n` rows, pipelined through its group. With
 * data-parallel members each member's pipeline (member r of every stage)
 * scores its slice of the rows (comm_chunk's r-th), and the last stage's
 * members sum their figures, so each of them holds the whole set's. */
static int stage_eval(struct trainer *t, int64_t n, int64_t *correct, double *loss, struct rumor_err *e) {
  if (!t->cfg.dp) {
    int rc = pipeline_eval(&t->pipe, n, 0, gather_eval, &t->data, correct, loss, e);
    return rc ? rc : group_pass_failed(t, e);
  }
  int64_t lo, hi;
  comm_chunk(n, t->zero.size, t->zero.rank, &lo, &hi);
  struct eval_slice slice = {&t->data, lo};
  /* A member with no rows skips on every stage of its pipeline alike;
   * expert-parallel members all run the chunks of the largest slice (the
   * first's), padding where theirs has fewer. */
  int64_t lo0, hi0, chunks = 0;
  comm_chunk(n, t->zero.size, 0, &lo0, &hi0);
  if (t->model.ep) chunks = (hi0 - lo0 + t->pipe.mb_rows - 1) / t->pipe.mb_rows;
  int rc = hi > lo || chunks ? pipeline_eval(&t->pipe, hi - lo, chunks, gather_eval_slice, &slice, correct, loss, e)
                             : 0;
  if (rc || !trainer_has_loss(t)) return rc;
  double v[2] = {(double)*correct, *loss};
  if ((rc = stage_dp_sum(t, v, 2, e))) return rc;
  *correct = (int64_t)llround(v[0]);
  *loss = v[1];
  return 0;
}

/* Loss and correct predictions over the first n rows of the evaluation or
 * the training set in file order, batch by batch (a whole replica). Before
 * each batch a set `stop` (may be NULL) ends it early. Returns the rows
 * evaluated: n, or fewer when stopped. */
static int64_t evaluate_whole(struct trainer *t, bool eval, int64_t n, const atomic_int *stop, int64_t *correct,
                              double *loss, int *rc, struct rumor_err *e) {
  int64_t bs = t->cfg.batch, ypr = t->data.y_per_row, first;
  void *x = tensor_host_alloc(t->be, (size_t)bs * t->data.x_bytes_per_row);
  int32_t *y = tensor_host_alloc(t->be, (size_t)(bs * ypr) * sizeof(int32_t));
  RUMOR_ASSERT(x && y);
  for (first = 0; first < n && !(stop && atomic_load(stop)); first += bs) {
    int64_t rows = n - first < bs ? n - first : bs;
    train_data_gather(&t->data, eval, first, rows, x, y);
    if (t->cfg.dp) {
      if ((*rc = zero_evaluate(t, rows, x, y, correct, loss, e))) break; /* each member scores its slice */
      continue;
    }
    tensor_copy_from_host(model_act(&t->model, 0), 0, x, (size_t)rows * t->data.x_bytes_per_row);
    tensor_copy_from_host(&t->model.labels, 0, y, (size_t)(rows * ypr) * sizeof(int32_t));
    model_evaluate(&t->model, rows, y, correct, loss);
    if ((*rc = group_pass_failed(t, e))) break;
  }
  tensor_host_free(t->be, x);
  tensor_host_free(t->be, y);
  return first < n ? first : n;
}

double trainer_check_loss(struct trainer *t, int64_t targets, int64_t *rows) {
  RUMOR_ASSERT(!trainer_is_stage(t));
  int64_t have = train_data_check_rows(&t->data), n = targets / t->data.y_per_row;
  if (n < 1) n = 1;
  if (n > have) n = have;
  *rows = n;
  double loss = 0;
  int64_t correct = 0;
  int rc = 0;
  struct rumor_err ignored;
  RUMOR_ASSERT(!t->cfg.dp); /* a data-parallel group's members do not gossip */
  evaluate_whole(t, false, n, NULL, &correct, &loss, &rc, &ignored); /* a few rows, and a donation check needs all */
  return n > 0 ? loss / (double)(n * t->data.y_per_row) : 0.0;
}

const char *trainer_row_noun(const struct trainer *t) { return t->data.tokens ? "windows" : "samples"; }

/* The evaluation's rows: all of the test set for images; for tokens
 * eval_batches batches of validation windows (20 unless set). */
static int64_t eval_rows(const struct trainer *t) {
  int64_t batches = t->cfg.eval_batches >= 0 ? t->cfg.eval_batches : t->data.tokens ? 20 : 0;
  return train_data_eval_rows(&t->data, batches * t->cfg.batch);
}

int trainer_evaluate(struct trainer *t, struct rumor_err *e) {
  int64_t n = eval_rows(t);
  if (n == 0) return 0;
  /* A lazy step (train_dp.lazy_gather) left the parameters partial: every
   * member evaluates at the same point, so every member gathers here. */
  if (t->cfg.dp && t->zero.partial) {
    int rc = zero_gather_params(t, e);
    if (rc) return rc;
  }
  int64_t correct = 0;
  double loss = 0, t0 = clock_now_s();
  if (trainer_is_stage(t)) {
    int rc = stage_eval(t, n, &correct, &loss, e);
    if (rc) return rc;
  } else {
    int rc = 0;
    int64_t done = evaluate_whole(t, true, n, t->cfg.stop, &correct, &loss, &rc, e);
    if (rc) return rc;
    if (done < n)
      return rumor_err_set(e, RUMOR_ECANCELED, "evaluation stopped by signal %d after %lld of %lld %s",
                           atomic_load(t->cfg.stop), (long long)done, (long long)n, trainer_row_noun(t));
  }
  t->eval_seconds = clock_now_s() - t0;
  if (trainer_has_loss(t)) {
    double targets = (double)(n * t->data.y_per_row);
    t->accuracy = (double)correct / targets;
    t->test_loss = loss / targets;
  }
  if (t->observer.fn) t->observer.fn(t->observer.arg, t, true);
  return 0;
}

/* Floats of the optimizer's state of the shard. */
static int64_t optim_floats(const struct trainer *t) {
  return t->shard_n * optim_state_per_param(t->optim.cfg.kind);
}

struct tensor trainer_shard_params(struct trainer *t) {
  return tensor_view(&t->model.params, t->shard_lo, 1, &t->shard_n);
}

struct tensor trainer_shard_grads(struct trainer *t) {
  return tensor_view(&t->model.grads, t->shard_lo, 1, &t->shard_n);
}

int64_t trainer_shard_floats(const struct trainer *t) { return t->shard_n; }

bool trainer_holds_part(const struct trainer *t) { return trainer_is_stage(t) || t->cfg.dp || t->cfg.tp; }

int64_t trainer_state_floats(const struct trainer *t) {
  return t->shard_n + optim_floats(t) + t->extra_off[t->cfg.extra.n];
}

/* Where part `part` of the shard's optimizer state starts in optim.state:
 * the optimizer covers the whole buffer, or (ZeRO >= 1) exactly the shard. */
static int64_t optim_shard_offset(const struct trainer *t, int part) {
  int64_t per = t->optim.nparams;
  RUMOR_ASSERT(per == t->model.nparams || (t->optim.lo - t->model.param_base == t->shard_lo && per == t->shard_n));
  return (int64_t)part * per + (per == t->shard_n ? 0 : t->shard_lo);
}

int64_t trainer_state_extra_at(const struct trainer *t, int i) {
  RUMOR_ASSERT(i >= 0 && i <= t->cfg.extra.n);
  return t->shard_n + optim_floats(t) + t->extra_off[i];
}

/* How shard_state_move moves the shard's state and a host copy of it. */
enum state_move { STATE_OUT, STATE_IN, STATE_SWAP };
/* Host floats a swap goes through (cap of them at buf). */
struct state_bounce {
  float *buf;
  int64_t cap;
};
#define STATE_SWAP_BOUNCE_FLOATS (256 * 1024) /* 1 MiB: few device copies, nothing like a state's size */

/* n floats at `off` of x and host[0..n): copied out, in, or exchanged
 * through the bounce buffer. */
static void state_move_seg(struct tensor *x, int64_t off, float *host, int64_t n, enum state_move how,
                           const struct state_bounce *b) {
  size_t bytes = (size_t)n * sizeof(float);
  if (how == STATE_OUT) tensor_copy_to_host(x, off, host, bytes);
  else if (how == STATE_IN) tensor_copy_from_host(x, off, host, bytes);
  else
    for (int64_t i = 0; i < n; i += b->cap) {
      size_t k = (size_t)(n - i < b->cap ? n - i : b->cap) * sizeof(float);
      tensor_copy_to_host(x, off + i, b->buf, k);
      tensor_copy_from_host(x, off + i, host + i, k);
      memcpy(host + i, b->buf, k);
    }
}

/* The shard's state (trainer_copy_state's layout) and host[0..state_floats):
 * see enum state_move; `b` only for STATE_SWAP. */
static void shard_state_move(struct trainer *t, float *host, enum state_move how, const struct state_bounce *b) {
  int64_t P = t->shard_n, O = optim_floats(t), X = t->extra_off[t->cfg.extra.n];
  int parts = optim_state_per_param(t->optim.cfg.kind);
  state_move_seg(&t->model.params, t->shard_lo, host, P, how, b);
  for (int s = 0; s < parts; s++)
    state_move_seg(&t->optim.state, optim_shard_offset(t, s), host + P * (1 + s), P, how, b);
  if (X) state_move_seg(&t->extra, 0, host + P + O, X, how, b);
}

void trainer_copy_state(struct trainer *t, float *out) { shard_state_move(t, out, STATE_OUT, NULL); }

void trainer_load_state(struct trainer *t, const float *state) {
  shard_state_move(t, (float *)state, STATE_IN, NULL); /* STATE_IN only reads it */
  t->state_pulled = trainer_in_group_comm(t);
}

void trainer_swap_state(struct trainer *t, float *state) {
  float small[4096]; /* when not even the bounce buffer can be had */
  /* Page-locked on a GPU: each piece is copied straight by the device. */
  struct state_bounce b = {tensor_host_alloc(t->be, STATE_SWAP_BOUNCE_FLOATS * sizeof(float)),
                           STATE_SWAP_BOUNCE_FLOATS};
  if (!b.buf) b = (struct state_bounce){small, (int64_t)(sizeof small / sizeof small[0])};
  shard_state_move(t, state, STATE_SWAP, &b);
  if (b.buf != small) tensor_host_free(t->be, b.buf);
  t->state_pulled = trainer_in_group_comm(t);
}

void trainer_load_fresh(struct trainer *t, const float *params) {
  tensor_copy_from_host(&t->model.params, 0, params, (size_t)t->model.nparams * sizeof(float));
  tensor_fill(&t->optim.state, 0.0f); /* as optim_init leaves it */
  if (t->extra.data) tensor_fill(&t->extra, 0.0f);
}

void trainer_set_position(struct trainer *t, int64_t step, int64_t epoch, int64_t samples) {
  t->optim.step = step;
  t->st.step = step;
  t->st.epoch = epoch;
  t->st.step_in_epoch = 0;
  t->st.samples = samples;
  t->staged = false;
  train_data_start_epoch(&t->data, epoch);
}

void trainer_take_step(struct trainer *t, int64_t step) {
  t->optim.step = step;
  t->st.step = step;
}

/* This process's parameters that are NaN or infinite, where it saves and
 * judges them alone (a whole replica, a pipeline stage); 0 for a data- or
 * tensor-parallel group's process, which saves with its group (group_save,
 * a collective, checks the whole model it puts together) and stops with it
 * at the group's one loss. */
static int64_t own_nonfinite(const struct trainer *t) {
  return t->cfg.dp || t->cfg.tp ? 0 : tensor_count_nonfinite(&t->model.params);
}

int trainer_refuse_nonfinite(const struct trainer *t, int64_t bad, const char *path, struct rumor_err *e) {
  return rumor_err_set(e, RUMOR_EDIVERGED,
                       "training diverged: %lld of the parameters after step %lld are NaN or infinite (learning "
                       "rate %g); not saved over %s, which keeps the last good state: lower --lr or add --grad-clip",
                       (long long)bad, (long long)t->st.step,
                       optim_lr_at(&t->cfg.optim, t->st.step, t->total_steps), path);
}

int trainer_save(struct trainer *t, const char *path, struct rumor_err *e) {
  /* Parameters that are not finite (a step's update overflowed: its own
   * loss was still finite) are never written over the last good state. */
  int64_t bad = own_nonfinite(t);
  if (bad) return trainer_refuse_nonfinite(t, bad, path, e);
  struct ckpt_info info = make_info(t);
  const struct train_extra_spec *xs = &t->cfg.extra;
  int64_t X = t->extra_off[xs->n];
  float *host = NULL;
  struct ckpt_extra x = {.n = (size_t)xs->n};
  bool group = t->cfg.dp || t->cfg.tp; /* group_save puts the whole model's together itself */
  if (X && !group) {
    /* Host memory on the CPU: written from where it is (checkpoint_save). */
    const float *src = t->extra.data;
    if (tensor_backend_device(t->be) != TENSOR_DEVICE_CPU) {
      if (!(host = malloc((size_t)X * sizeof(float))))
        return rumor_err_set(e, -ENOMEM, "cannot save %s: no memory for the sync scheme's %lld floats", path,
                             (long long)X);
      tensor_copy_to_host(&t->extra, 0, host, (size_t)X * sizeof(float));
      src = host;
    }
    for (int i = 0; i < xs->n; i++)
      x.t[i] = (struct ckpt_extra_tensor){xs->seg[i].name, src + t->extra_off[i], t->extra_off[i + 1] - t->extra_off[i]};
    info.extra = &x;
  }
  int rc = group ? group_save(t, path, &info, e) : checkpoint_save(path, &t->model, &t->optim, &info, e);
  free(host);
  if (rc == 0 && (!t->cfg.dp || t->zero.rank == 0) && (!t->cfg.tp || t->tp.rank == 0)) log_info("%scheckpoint saved to %s (step %lld)", trainer_is_stage(t) ? "stage " : "", path,
                        (long long)t->st.step);
  return rc;
}

int trainer_checkpoint(struct trainer *t, struct rumor_err *e) {
  if (!t->cfg.checkpoint) return 0;
  char path[1024];
  checkpoint_path_of(t, path, sizeof path);
  return trainer_save(t, path, e);
}

/* ---- steps ---- */

/* A stage clips by the norm of its own units' gradients (train.h). */
void trainer_clip_gradients(struct trainer *t) {
  if (t->cfg.grad_clip <= 0) return;
  double norm = sqrt(tensor_sq_norm(&t->model.grads));
  t->grad_norm = norm;
  if (norm > t->cfg.grad_clip) {
    tensor_scale(&t->model.grads, (float)(t->cfg.grad_clip / norm));
    t->clipped_steps++;
  }
}

static void stage_batch(struct trainer *t, int buf) {
  t->rows[buf] = train_data_fill(&t->data, t->st.step_in_epoch, t->cfg.batch, t->xh[buf], t->yh[buf]);
}

/* The reducer, when there is one (train_reducer), timed for --slowdown. */
static int reduce(struct trainer *t, int64_t rows, struct rumor_err *e) {
  if (!t->reducer.reduce) return 0;
  double r0 = clock_now_s();
  int rc = t->reducer.reduce(t->reducer.arg, rows, e);
  t->reduce_s += clock_now_s() - r0;
  return rc;
}

/* Expert-parallel members run every pass together, each on its slice: a
 * batch too short to give every member a row for each of its
 * micro-batches (an epoch's short last batch) is dropped whole, as
 * PyTorch's drop_last drops it, by every member alike. Returns true (and
 * says so once) when `rows` is such a batch. */
static bool ep_drops_batch(struct trainer *t, int64_t rows) {
  if (!t->model.ep) return false;
  int micro = trainer_is_stage(t) ? t->stage.micro : 1;
  if (rows / t->zero.size >= micro) return false;
  if (!t->ep_dropped++)
    log_info("dropping a short batch of %lld rows: each of the %d expert-parallel members needs at least %d of them "
             "(said once)", (long long)rows, t->zero.size, micro);
  return true;
}

/* Enqueues a whole replica's step on the staged batch: its rows into
 * *rows_out, and with a reducer its loss into *loss (read before the
 * reducer runs: while it waits it may evaluate the check rows, for a
 * donation or a catch-up, which overwrites the batch's losses; without one
 * the caller reads the loss later, overlapping the device). Returns 0, 1
 * when the reducer dropped the step (train_reducer), or a negative code. */
static int step_whole(struct trainer *t, double lr, int64_t *rows_out, double *loss, struct rumor_err *e) {
  int buf = t->cur;
  if (!t->staged) stage_batch(t, buf);
  int64_t rows = t->rows[buf];
  *rows_out = rows;
  struct model *m = &t->model;
  if (ep_drops_batch(t, rows)) {
    *rows_out = 0;
    *loss = NAN;
    return 1;
  }
  if (t->cfg.dp) return zero_step(t, lr, rows, t->xh[buf], t->yh[buf], loss, e);
  tensor_copy_from_host_async(model_act(m, 0), 0, t->xh[buf], (size_t)rows * t->data.x_bytes_per_row);
  tensor_copy_from_host_async(&m->labels, 0, t->yh[buf], (size_t)(rows * t->data.y_per_row) * sizeof(int32_t));
  model_forward_backward(m, rows);
  int rc = group_pass_failed(t, e);
  if (rc) return rc;
  if (t->reducer.reduce) *loss = model_mean_loss(m, rows);
  if ((rc = t->cfg.tp && t->reducer.reduce ? group_reduce_between(t, rows, e) : reduce(t, rows, e))) return rc;
  if (t->cfg.tp) {
    if ((rc = group_clip(t, 0, m->nparams, t->cfg.tp->comm, e))) return rc;
  } else {
    trainer_clip_gradients(t);
  }
  optim_apply(&t->optim, &m->params, &m->grads, lr);
  return 0;
}

/* A stage's step: its share of the pipelined step, then its own update.
 * Returns 0, 1 when the reducer dropped the step, or a negative code. */
static int step_stage(struct trainer *t, double lr, int64_t *rows_out, double *loss, struct rumor_err *e) {
  int64_t bs = t->cfg.batch;
  int64_t first = t->st.step_in_epoch * bs;
  int64_t n = train_data_shard_rows(&t->data);
  int64_t rows = n - first < bs ? n - first : bs;
  if (ep_drops_batch(t, rows)) {
    *rows_out = 0;
    *loss = NAN;
    return 1;
  }
  if (needs_batches(t)) {
    int64_t got = train_data_fill(&t->data, t->st.step_in_epoch, bs, t->xh[0], t->yh[0]);
    RUMOR_ASSERT(got == rows);
  }
  /* A data-parallel member's pipeline runs over its slice of the batch
   * (struct train_dp), its loss scaled by the whole batch's targets. */
  int64_t lo = 0, hi = rows;
  if (t->cfg.dp) comm_chunk(rows, t->zero.size, t->zero.rank, &lo, &hi);
  double loss_sum = 0;
  int rc = 0;
  if (hi > lo) {
    const void *x = first_stage(t) ? (const char *)t->xh[0] + (size_t)lo * t->data.x_bytes_per_row : NULL;
    const int32_t *y = trainer_has_loss(t) ? t->yh[0] + lo * t->data.y_per_row : NULL;
    rc = pipeline_step(&t->pipe, t->st.step, hi - lo, rows, x, y, &loss_sum, e);
  } else { /* a short last batch left this member no rows: every stage of its pipeline skips alike */
    tensor_fill(&t->model.grads, 0.0f);
  }
  if (rc == 0) rc = group_pass_failed(t, e); /* a tensor-parallel rank's collectives inside the passes */
  if (rc) return rc;
  *rows_out = rows;
  if (t->cfg.dp && trainer_has_loss(t) && (rc = stage_dp_sum(t, &loss_sum, 1, e))) return rc;
  *loss = trainer_has_loss(t) ? loss_sum / (double)model_targets(&t->model, rows) : NAN;
  /* The stage's members sum their gradients and update (and with a
   * reducer average their pieces with other groups', group_reduce_between). */
  if (t->cfg.dp) return zero_update(t, lr, rows, e);
  /* This stage's slice (a rank's slices of it) with the same of other
   * groups; the stages then agree whether the step was dropped. */
  if (t->reducer.reduce && (rc = group_reduce_between(t, rows, e))) return rc;
  if (t->cfg.tp) { /* by the norm of the stage's units, over its ranks' slices */
    if ((rc = group_clip(t, 0, t->model.nparams, t->cfg.tp->comm, e))) return rc;
  } else {
    trainer_clip_gradients(t);
  }
  optim_apply(&t->optim, &t->model.params, &t->model.grads, lr);
  tensor_backend_sync(t->be);
  return 0;
}

/* An evaluation inside a step. One that a stop signal cut short is no
 * failure here: the step's checkpoint may still be due, and the caller's
 * loop sees the signal after the step. *evaluated: figures are new. */
static int eval_in_step(struct trainer *t, bool *evaluated, struct rumor_err *e) {
  int rc = trainer_evaluate(t, e);
  *evaluated = rc == 0;
  if (rc == RUMOR_ECANCELED && !trainer_is_stage(t)) {
    log_warn("step %lld: %s", (long long)t->st.step, e->msg);
    return 0;
  }
  return rc;
}

/* --eval-every: an evaluation between epoch ends, and its line. */
static int eval_now(struct trainer *t, struct rumor_err *e) {
  bool evaluated;
  int rc = eval_in_step(t, &evaluated, e);
  if (rc || !evaluated || !trainer_has_loss(t)) return rc;
  if (t->data.tokens)
    log_info("step %lld: train loss %.4f, val loss %.4f (evaluated in %.3f s)", (long long)t->st.step, t->loss_avg,
             t->test_loss, t->eval_seconds);
  else
    log_info("step %lld: train loss %.4f, test accuracy %.4f, test loss %.4f (evaluated in %.3f s)",
             (long long)t->st.step, t->loss_avg, t->accuracy, t->test_loss, t->eval_seconds);
  return 0;
}

/* After an epoch: the evaluation (when configured) and its line. */
static int end_epoch(struct trainer *t, struct rumor_err *e) {
  if (trainer_has_loss(t)) {
    if (t->nepoch_losses == t->epoch_losses_cap) {
      t->epoch_losses_cap = t->epoch_losses_cap ? 2 * t->epoch_losses_cap : 16;
      t->epoch_losses = xrealloc(t->epoch_losses, (size_t)t->epoch_losses_cap * sizeof *t->epoch_losses);
    }
    t->epoch_losses[t->nepoch_losses++] = t->loss_avg;
  }
  bool evaluated = false;
  if (t->cfg.eval_each_epoch) {
    int rc = eval_in_step(t, &evaluated, e);
    if (rc) return rc;
  }
  long long epoch = (long long)t->st.epoch, epochs = (long long)t->cfg.epochs, step = (long long)t->st.step;
  if (!trainer_has_loss(t))
    log_info("epoch %lld/%lld done at step %lld", epoch, epochs, step);
  else if (!evaluated) /* --no-eval, or a stop cut it short: no test figures to print */
    log_info("epoch %lld/%lld done at step %lld: train loss %.4f", epoch, epochs, step, t->loss_avg);
  else if (t->data.tokens)
    log_info("epoch %lld/%lld done at step %lld: train loss %.4f, val loss %.4f (evaluated in %.3f s)", epoch, epochs,
             step, t->loss_avg, t->test_loss, t->eval_seconds);
  else
    log_info("epoch %lld/%lld done at step %lld: train loss %.4f, test accuracy %.4f, test loss %.4f (evaluated in "
             "%.3f s)",
             epoch, epochs, step, t->loss_avg, t->accuracy, t->test_loss, t->eval_seconds);
  return 0;
}

/* --slowdown: stretches a step that computed for `compute_s` seconds to
 * slowdown times that, as on a slower machine (the network's share, the
 * reducer's wait or a stage's wait for its neighbours, is not stretched:
 * stretching a wait that includes the neighbour's own stretch compounds
 * from step to step). */
static void straggle(struct trainer *t, double compute_s) {
  double s = (t->cfg.slowdown - 1) * (compute_s > 0 ? compute_s : 0);
  struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
  nanosleep(&ts, NULL);
}

/* A mixture-of-experts model's figures of the step just computed (struct
 * train_moe), from the model's since the step began. */
static void moe_note(struct trainer *t) {
  const struct model_moe_stats *st = &t->model.moe_stats;
  struct train_moe *o = &t->moe;
  const struct model_spec *s = &t->model.spec;
  if (s->family != MODEL_GPT || !s->u.gpt.experts || t->model.moe_blocks == 0 || st->passes == 0) return;
  /* Each micro-batch passes through this model's (a stage's) own blocks. */
  double micro = (double)st->passes / (double)t->model.moe_blocks;
  o->experts = s->u.gpt.experts;
  o->aux_loss = st->aux_loss / micro;
  o->z_loss = st->z_loss / micro;
  o->dropped_fraction = st->choices > 0 ? (double)st->dropped / (double)st->choices : 0;
  for (int x = 0; x < o->experts; x++) o->load[x] = st->choices > 0 ? (double)st->load[x] / (double)st->choices : 0;
}

/* After a step with `rows` rows whose loss is `loss` (rc: step_whole's):
 * stops a diverged run before it saves its parameters or offers them to a
 * partner, so that the last checkpoint stays the last good one. A step
 * applied with a non-finite loss (rc 0) left the parameters non-finite: no
 * later step recovers. A step a reducer dropped (rc 1: a ring's sum that
 * is not finite drops it on every member, and the ring itself stops after
 * a run of those, allreduce.c; or a donated state replaced ours) left them
 * as they were: the run stops when they are not finite (own_nonfinite).
 * Returns 0 or RUMOR_EDIVERGED. */
static int check_finite(struct trainer *t, int rc, int64_t rows, double loss, double lr, struct rumor_err *e) {
  if (!trainer_has_loss(t) || rows == 0 || isfinite(loss)) return 0; /* no loss here, a batch dropped whole, fine */
  if (rc == 1 && own_nonfinite(t) == 0) return 0;
  return rumor_err_set(e, RUMOR_EDIVERGED,
                       "training diverged: step %lld's loss is %s (learning rate %g); stopped before saving its "
                       "parameters or sending them: lower --lr or add --grad-clip",
                       (long long)t->st.step, isnan(loss) ? "NaN" : "infinite", lr);
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
  double lr = optim_lr_at(&t->cfg.optim, t->st.step, t->total_steps), loss = NAN;
  double c0 = clock_now_s();
  t->reduce_s = 0;
  int64_t rows = 0;
  int rc;
  comm_t *top = t->cfg.tp ? t->cfg.tp->all : t->cfg.dp ? t->cfg.dp->comm : NULL;
  comm_t *experts = t->model.ep ? t->cfg.dp->experts : NULL;
  uint64_t sent0 = 0, recv0 = 0, sent1 = 0, recv1 = 0, es0 = 0, er0 = 0, es1 = 0, er1 = 0;
  if (top) comm_bytes(top, &sent0, &recv0);
  if (experts) comm_bytes(experts, &es0, &er0);
  model_moe_stats_reset(&t->model);
  rc = trainer_is_stage(t) ? step_stage(t, lr, &rows, &loss, e) : step_whole(t, lr, &rows, &loss, e);
  if (rc < 0) return rc;
  moe_note(t);
  if (top) comm_bytes(top, &sent1, &recv1);
  if (top) t->comm_step_bytes = (double)(sent1 - sent0 + recv1 - recv0);
  if (experts) comm_bytes(experts, &es1, &er1);
  if (experts) t->ep_step_bytes = (double)(es1 - es0 + er1 - er0);
  /* Dropped (rc 1): the batch is used up, but the step count is the
   * state's that replaced ours. */
  if (rc == 0) t->st.step++;
  t->st.samples += rows;
  bool epoch_end = ++t->st.step_in_epoch == t->steps_per_epoch;
  if (epoch_end) {
    t->st.epoch++;
    t->st.step_in_epoch = 0;
    train_data_start_epoch(&t->data, t->st.epoch);
  }
  if (!trainer_is_stage(t)) {
    /* Gather the next batch on the host while the device computes. */
    t->cur ^= 1;
    t->staged = !trainer_done(t);
    if (t->staged) stage_batch(t, t->cur);
    if (!t->reducer.reduce && !t->cfg.dp) loss = model_mean_loss(&t->model, rows); /* waits for the device */
  }
  if (t->cfg.slowdown > 1) {
    double waited = trainer_is_stage(t) ? t->pipe.cur_wait : 0; /* this step's */
    straggle(t, clock_now_s() - c0 - t->reduce_s - waited);
  }
  if (trainer_has_loss(t) && isfinite(loss)) { /* not a dropped batch's (NaN), nor a diverged one's: check_finite */
    t->last_loss = loss;
    t->loss_avg = isnan(t->loss_avg) ? loss : 0.95 * t->loss_avg + 0.05 * loss;
  }
  if ((rc = check_finite(t, rc, rows, loss, lr, e))) return rc;
  if (t->cfg.log_every_s > 0 && clock_now_s() - t->t_last_log >= t->cfg.log_every_s) progress(t, lr);
  if (epoch_end && (rc = end_epoch(t, e))) return rc;
  if (!epoch_end && t->cfg.eval_every > 0 && t->st.step % t->cfg.eval_every == 0 && (rc = eval_now(t, e))) return rc;
  if (epoch_end || trainer_done(t) || (t->cfg.checkpoint_every > 0 && t->st.step % t->cfg.checkpoint_every == 0))
    if ((rc = trainer_checkpoint(t, e))) return rc;
  if (t->observer.fn) t->observer.fn(t->observer.arg, t, false);
  return 0;
}
