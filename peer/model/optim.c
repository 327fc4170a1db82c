/* SGD with momentum and AdamW over flat buffers; warm-up + cosine schedule. */
#include "peer/model/optim.h"

#include <math.h>
#include <string.h>

void optim_config_default(struct optim_config *c) {
  memset(c, 0, sizeof *c);
  c->kind = OPTIM_SGD;
  c->lr = 0.05;
  c->momentum = 0.9;
  c->weight_decay = 0.0;
  c->beta1 = 0.9;
  c->beta2 = 0.999;
  c->eps = 1e-8;
  c->schedule = OPTIM_SCHED_COSINE;
  c->warmup_steps = 0;
}

int optim_kind_parse(const char *s, enum optim_kind *out) {
  if (strcmp(s, "sgd") == 0) *out = OPTIM_SGD;
  else if (strcmp(s, "adamw") == 0) *out = OPTIM_ADAMW;
  else return RUMOR_EFORMAT;
  return 0;
}

int optim_schedule_parse(const char *s, enum optim_schedule *out) {
  if (strcmp(s, "constant") == 0) *out = OPTIM_SCHED_CONSTANT;
  else if (strcmp(s, "cosine") == 0) *out = OPTIM_SCHED_COSINE;
  else return RUMOR_EFORMAT;
  return 0;
}

const char *optim_kind_name(enum optim_kind k) { return k == OPTIM_ADAMW ? "adamw" : "sgd"; }
const char *optim_schedule_name(enum optim_schedule s) { return s == OPTIM_SCHED_COSINE ? "cosine" : "constant"; }

int optim_state_per_param(enum optim_kind k) { return k == OPTIM_ADAMW ? 2 : 1; }

int optim_init(struct optim *o, const struct optim_config *cfg, tensor_backend_t be, int64_t nparams,
               struct rumor_err *e) {
  memset(o, 0, sizeof *o);
  o->cfg = *cfg;
  o->nparams = nparams;
  int64_t n = nparams * optim_state_per_param(cfg->kind);
  int rc = tensor_alloc(&o->state, be, TENSOR_F32, 1, &n, e);
  if (rc) return rumor_err_prefix(e, "optimizer state");
  tensor_fill(&o->state, 0.0f);
  return 0;
}

void optim_free(struct optim *o) {
  tensor_free(&o->state);
  memset(o, 0, sizeof *o);
}

double optim_lr_at(const struct optim_config *c, int64_t step, int64_t total_steps) {
  if (c->warmup_steps > 0 && step < c->warmup_steps) return c->lr * (double)(step + 1) / (double)c->warmup_steps;
  if (c->schedule == OPTIM_SCHED_CONSTANT || total_steps <= c->warmup_steps) return c->lr;
  double t = (double)(step - c->warmup_steps) / (double)(total_steps - c->warmup_steps);
  if (t > 1.0) t = 1.0;
  return c->lr * 0.5 * (1.0 + cos(M_PI * t));
}

void optim_apply(struct optim *o, struct tensor *params, const struct tensor *grads, double lr) {
  RUMOR_ASSERT(tensor_numel(params) == o->nparams);
  o->step++;
  if (o->cfg.kind == OPTIM_SGD) {
    struct tensor_sgd hp = {.lr = (float)lr,
                            .momentum = (float)o->cfg.momentum,
                            .weight_decay = (float)o->cfg.weight_decay,
                            .nesterov = o->cfg.nesterov};
    tensor_sgd_step(params, grads, hp.momentum != 0.0f ? &o->state : NULL, &hp);
  } else {
    struct tensor m = tensor_view(&o->state, 0, 1, &o->nparams);
    struct tensor v = tensor_view(&o->state, o->nparams, 1, &o->nparams);
    struct tensor_adamw hp = {.lr = (float)lr,
                              .beta1 = (float)o->cfg.beta1,
                              .beta2 = (float)o->cfg.beta2,
                              .eps = (float)o->cfg.eps,
                              .weight_decay = (float)o->cfg.weight_decay,
                              .step = o->step};
    tensor_adamw_step(params, grads, &m, &v, &hp);
  }
}
