/* SGD with momentum and AdamW over flat buffers, with the table's decay mask;
 * warm-up + cosine schedule. */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/model.h"

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

static const char *const STATE_SGD[] = {"optimizer.momentum"};
static const char *const STATE_ADAMW[] = {"optimizer.exp_avg", "optimizer.exp_avg_sq"};

const char *optim_state_name(enum optim_kind k, int part) {
  RUMOR_ASSERT(0 <= part && part < optim_state_per_param(k));
  return k == OPTIM_ADAMW ? STATE_ADAMW[part] : STATE_SGD[part];
}

int optim_init_range(struct optim *o, const struct optim_config *cfg, const struct model_table *tab, int64_t lo,
                     int64_t hi, tensor_backend_t be, struct rumor_err *e) {
  RUMOR_ASSERT(0 <= lo && lo <= hi);
  memset(o, 0, sizeof *o);
  o->cfg = *cfg;
  o->nparams = hi - lo;
  o->lo = lo;
  int64_t n = o->nparams * optim_state_per_param(cfg->kind);
  if (n < 1) n = 1;
  int rc = tensor_alloc(&o->state, be, TENSOR_F32, 1, &n, e);
  if (rc) return rumor_err_prefix(e, "optimizer state");
  tensor_fill(&o->state, 0.0f);
  /* The decay mask: the table entries' parts inside [lo, hi), merged into
   * runs of one setting, at offsets within the range. */
  o->spans = xcalloc(tab->n ? tab->n : 1, sizeof *o->spans);
  for (size_t i = 0; i < tab->n; i++) {
    const struct model_param *p = &tab->p[i];
    int64_t a = p->offset > lo ? p->offset : lo, b = p->offset + p->numel < hi ? p->offset + p->numel : hi;
    if (a >= b) continue;
    struct optim_span *last = o->nspans ? &o->spans[o->nspans - 1] : NULL;
    if (last && last->decay == p->decay && last->offset + last->count == a - lo) last->count += b - a;
    else o->spans[o->nspans++] = (struct optim_span){a - lo, b - a, p->decay};
  }
  return 0;
}

int optim_init(struct optim *o, const struct optim_config *cfg, const struct model *m, struct rumor_err *e) {
  /* The units a model holds are one contiguous range of the table's
   * buffer (model.h), and no other unit's entry lies inside it. */
  const struct model_table *t = m->tp ? &m->tp_layout.local : &m->table; /* a TP rank's own layout */
  return optim_init_range(o, cfg, t, m->param_base, m->param_base + m->nparams, m->be, e);
}

void optim_free(struct optim *o) {
  tensor_free(&o->state);
  free(o->spans);
  memset(o, 0, sizeof *o);
}

double optim_lr_at(const struct optim_config *c, int64_t step, int64_t total_steps) {
  if (c->warmup_steps > 0 && step < c->warmup_steps) return c->lr * (double)(step + 1) / (double)c->warmup_steps;
  if (c->schedule == OPTIM_SCHED_CONSTANT || total_steps <= c->warmup_steps) return c->lr;
  double t = (double)(step - c->warmup_steps) / (double)(total_steps - c->warmup_steps);
  if (t > 1.0) t = 1.0;
  return c->lr * 0.5 * (1.0 + cos(M_PI * t));
}

/* One update of the elements [off, off + n) with weight decay `wd`. */
static void apply_range(struct optim *o, struct tensor *params, const struct tensor *grads, int64_t off, int64_t n,
                        double lr, double wd) {
  struct tensor p = tensor_view(params, off, 1, &n), g = tensor_view(grads, off, 1, &n);
  if (o->cfg.kind == OPTIM_SGD) {
    struct tensor_sgd hp = {.lr = (float)lr,
                            .momentum = (float)o->cfg.momentum,
                            .weight_decay = (float)wd,
                            .nesterov = o->cfg.nesterov};
    struct tensor mom = tensor_view(&o->state, off, 1, &n);
    tensor_sgd_step(&p, &g, hp.momentum != 0.0f ? &mom : NULL, &hp);
  } else {
    struct tensor m = tensor_view(&o->state, off, 1, &n);
    struct tensor v = tensor_view(&o->state, o->nparams + off, 1, &n);
    struct tensor_adamw hp = {.lr = (float)lr,
                              .beta1 = (float)o->cfg.beta1,
                              .beta2 = (float)o->cfg.beta2,
                              .eps = (float)o->cfg.eps,
                              .weight_decay = (float)wd,
                              .step = o->step};
    tensor_adamw_step(&p, &g, &m, &v, &hp);
  }
}

void optim_apply(struct optim *o, struct tensor *params, const struct tensor *grads, double lr) {
  RUMOR_ASSERT(tensor_numel(params) >= o->nparams);
  o->step++;
  if (o->nparams == 0) return;
  double wd = o->cfg.weight_decay;
  /* Without decay the mask does not matter: one op over everything. */
  if (wd == 0.0) {
    apply_range(o, params, grads, 0, o->nparams, lr, 0.0);
    return;
  }
  for (size_t i = 0; i < o->nspans; i++)
    apply_range(o, params, grads, o->spans[i].offset, o->spans[i].count, lr, o->spans[i].decay ? wd : 0.0);
}
