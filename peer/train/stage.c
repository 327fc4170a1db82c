/* What the stages of a group must agree on: the plan, the agreement text,
 * the gossip label and the checkpoint names. */
#include <inttypes.h>
#include <stdio.h>
#include <string.h>

#include "peer/train/train.h"

int train_stage_plan(const struct train_config *cfg, struct stage_plan *out, struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  const struct train_stage *st = cfg->stage;
  RUMOR_ASSERT(st && 0 <= st->stage && st->stage < st->stages);
  if (!cfg->model) return rumor_err_set(e, RUMOR_EFORMAT, "--model is required");
  int rc = model_spec_parse(cfg->model, &out->spec, e);
  if (rc) return rumor_err_prefix(e, "--model");
  if ((rc = pipe_split_balance(&out->spec, st->stages, &out->split, e))) return rumor_err_prefix(e, "--stages");
  out->u0 = out->split.first[st->stage];
  out->u1 = out->split.first[st->stage + 1];
  if (st->micro < 1 || st->micro > PIPE_MAX_MICRO)
    return rumor_err_set(e, RUMOR_EFORMAT, "--micro-batches must be in [1, %d], not %d", PIPE_MAX_MICRO, st->micro);
  if (st->micro > cfg->batch)
    return rumor_err_set(e, RUMOR_EFORMAT, "--micro-batches %d is more than the --batch of %lld rows", st->micro,
                         (long long)cfg->batch);
  out->mb_rows = (cfg->batch + st->micro - 1) / st->micro;
  return 0;
}

void train_stage_agreement(const struct train_config *c, const struct stage_plan *plan, char *buf, size_t n) {
  char spec[MODEL_SPEC_MAX], split[PIPE_MAX_STAGES * 4 + 8];
  model_spec_format(&plan->spec, spec, sizeof spec);
  pipe_split_format(&plan->split, split, sizeof split);
  snprintf(buf, n,
           "model=%s split=%s schedule=%s micro-batches=%d batch=%lld seed=%" PRIu64 " data-seed=%" PRIu64
           " shard=%lld/%lld epochs=%lld max-steps=%lld optimizer=%s lr=%.9g momentum=%.9g nesterov=%d "
           "weight-decay=%.9g schedule=%s warmup=%lld eval=%d",
           spec, split, pipe_schedule_name(c->stage->sched), c->stage->micro, (long long)c->batch, c->seed,
           c->data_seed, (long long)c->shard.index, (long long)c->shard.count, (long long)c->epochs,
           (long long)c->max_steps, optim_kind_name(c->optim.kind), c->optim.lr, c->optim.momentum,
           c->optim.nesterov ? 1 : 0, c->optim.weight_decay, optim_schedule_name(c->optim.schedule),
           (long long)c->optim.warmup_steps, c->eval_each_epoch ? 1 : 0);
}

int train_stage_label(const struct train_config *cfg, const struct stage_plan *plan, char *buf, size_t n,
                      struct rumor_err *e) {
  char spec[MODEL_SPEC_MAX], split[PIPE_MAX_STAGES * 4 + 8];
  model_spec_format(&plan->spec, spec, sizeof spec);
  pipe_split_format(&plan->split, split, sizeof split);
  int w = snprintf(buf, n, "%s stage %d/%d %ss %d-%d of %s", spec, cfg->stage->stage, cfg->stage->stages,
                   model_spec_unit_noun(&plan->spec), plan->u0, plan->u1 - 1, split);
  if (w < 0 || (size_t)w >= n)
    return rumor_err_set(e, RUMOR_ETOOBIG, "the stage's gossip label for %s is over %zu characters", spec, n - 1);
  return 0;
}

void train_stage_checkpoint_path(const char *path, int stage, char *buf, size_t n) {
  static const char ext[] = ".safetensors";
  size_t len = strlen(path), el = sizeof ext - 1;
  if (checkpoint_is_dir(path)) { /* stage<s>.safetensors inside it, beside the merged model's files */
    char file[32];
    snprintf(file, sizeof file, "stage%d%s", stage, ext);
    checkpoint_dir_file(path, file, buf, n);
  } else if (len > el && strcmp(path + len - el, ext) == 0)
    snprintf(buf, n, "%.*s-stage%d%s", (int)(len - el), path, stage, ext);
  else
    snprintf(buf, n, "%s-stage%d", path, stage);
}
