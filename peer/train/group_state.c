/* What the members of a group that splits one replica share: the
 * tensor-parallel ranks' collectives, the global gradient norm, and the
 * whole model's state gathered for a checkpoint or scattered from one
 * (train_impl.h). */
#include "peer/train/train_impl.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

static bool on_cpu(const struct trainer *t) { return tensor_backend_device(t->be) == TENSOR_DEVICE_CPU; }


/* model_tp's all-reduce: in place on the CPU, through pinned host memory on
 * a device (grown to the largest call). */
static int tp_all_reduce(void *arg, struct tensor *x, int64_t n, struct rumor_err *e) {
  struct trainer *t = arg;
  comm_t *c = t->cfg.tp->comm;
  if (on_cpu(t)) return comm_all_reduce(c, x->data, n, e);
  if (n > t->tp_host_floats) {
    tensor_host_free(t->be, t->tp_host);
    t->tp_host = tensor_host_alloc(t->be, (size_t)n * sizeof(float));
    t->tp_host_floats = t->tp_host ? n : 0;
    if (!t->tp_host)
      return rumor_err_set(e, -ENOMEM, "cannot allocate %lld floats of pinned staging for the tensor-parallel "
                           "all-reduce", (long long)n);
  }
  tensor_copy_to_host(x, 0, t->tp_host, (size_t)n * sizeof(float));
  int rc = comm_all_reduce(c, t->tp_host, n, e);
  if (rc == 0) tensor_copy_from_host(x, 0, t->tp_host, (size_t)n * sizeof(float));
  return rc;
}

void group_tp_setup(struct trainer *t) {
  comm_t *c = t->cfg.tp->comm;
  t->tp = (struct model_tp){.rank = comm_rank(c), .size = comm_size(c), .all_reduce = tp_all_reduce, .arg = t};
}

int group_pass_failed(struct trainer *t, struct rumor_err *e) {
  if (t->cfg.tp && t->tp.failed) {
    *e = t->tp.err;
    return t->tp.failed;
  }
  if (t->model.ep && t->ep.failed) {
    *e = t->ep.err;
    e->code = t->ep.failed;
    return rumor_err_prefix(e, "expert-parallel member %d/%d", t->ep.rank, t->ep.size);
  }
  return 0;
}

/* model_ep's collectives over the member's run (host buffers: the model
 * stages device tensors itself). */
static int ep_all_gather(void *arg, float *buf, int64_t each, struct rumor_err *e) {
  comm_t *c = arg;
  return comm_all_gather(c, buf, each * comm_size(c), e);
}

static int ep_all_to_all(void *arg, const float *send, const int64_t *send_counts, float *recv,
                         const int64_t *recv_counts, struct rumor_err *e) {
  return comm_all_to_all(arg, send, send_counts, recv, recv_counts, e);
}

static void ep_abort(void *arg, const char *why) { comm_abort(arg, why); }

int group_ep_setup(struct trainer *t, struct rumor_err *e) {
  comm_t *c = t->cfg.dp->experts;
  t->ep = (struct model_ep){.rank = comm_rank(c),
                            .size = comm_size(c),
                            .all_gather = ep_all_gather,
                            .all_to_all = ep_all_to_all,
                            .abort = ep_abort,
                            .arg = c};
  return model_use_ep(&t->model, &t->ep, e);
}

int group_grad_sq_norm(struct trainer *t, int64_t lo, int64_t hi, comm_t *over, double *out, struct rumor_err *e) {
  const struct model *m = &t->model;
  const struct model_table *tab = model_own_table(m);
  double sq = 0;
  for (size_t i = 0; i < tab->n; i++) {
    const struct model_param *p = &tab->p[i];
    /* A replicated parameter's gradient is the same on every rank: once. */
    if (m->tp && m->tp_layout.slice[i].dim < 0 && m->tp->rank != 0) continue;
    int64_t a = p->offset - m->param_base, b = a + p->numel;
    if (a < lo) a = lo;
    if (b > hi) b = hi;
    if (b <= a) continue;
    struct tensor g = tensor_view(&m->grads, a, 1, (int64_t[]){b - a});
    sq += tensor_sq_norm(&g);
  }
  float part = (float)sq;
  int rc = over ? comm_all_reduce(over, &part, 1, e) : 0;
  *out = part;
  return rc;
}

int group_clip(struct trainer *t, int64_t lo, int64_t hi, comm_t *over, struct rumor_err *e) {
  if (t->cfg.grad_clip <= 0) return 0;
  double sq;
  int rc = group_grad_sq_norm(t, lo, hi, over, &sq, e);
  if (rc) return rc;
  double norm = sqrt(sq);
  t->grad_norm = norm;
  if (norm > t->cfg.grad_clip) {
    if (hi > lo) {
      struct tensor g = tensor_view(&t->model.grads, lo, 1, (int64_t[]){hi - lo});
      tensor_scale(&g, (float)(t->cfg.grad_clip / norm));
    }
    t->clipped_steps++;
  }
  return 0;
}

/* This process's whole local state (parameters, then each optimizer part,
 * model.nparams floats each) into `local`: from its own buffers, or
 * gathered from the data-parallel members' pieces (then only member 0
 * gets it: `local` is NULL on the others). */
static int local_state(struct trainer *t, float *local, struct rumor_err *e) {
  if (t->cfg.dp) return zero_gather_local(t, local, e);
  int64_t P = t->model.nparams;
  int parts = optim_state_per_param(t->optim.cfg.kind);
  tensor_copy_to_host(&t->model.params, 0, local, (size_t)P * sizeof(float));
  tensor_copy_to_host(&t->optim.state, 0, local + P, (size_t)(P * parts) * sizeof(float));
  return 0;
}

/* Where rank j of T holds units [u0, u1) in its flat buffer: [*at, *at +
 * *n) of its model_tp_local_params. */
static void rank_units(const struct model_spec *spec, int T, int j, int u0, int u1, int64_t *at, int64_t *n) {
  struct model_tp_layout l;
  struct rumor_err e;
  RUMOR_ASSERT(model_tp_layout_build(spec, T, j, &l, &e) == 0); /* the ranks' model was built with it */
  *at = l.local.unit_offset[u0];
  *n = l.local.unit_offset[u1] - *at;
  model_tp_layout_free(&l);
}

/* The tensor-parallel ranks' local states (of the units this process's
 * model holds: all, or a pipeline stage's), gathered to rank 0 and put
 * together there into the whole model's layout (`full`, table.nparams
 * floats per part; NULL elsewhere), the units' range of it written. Every
 * part of the state has the parameters' layout. */
static int assemble_tp(struct trainer *t, const float *local, float *full, int parts, struct rumor_err *e) {
  comm_t *c = t->cfg.tp->comm;
  const struct model *m = &t->model;
  int T = comm_size(c), me = comm_rank(c);
  const struct model_spec *spec = &m->spec;
  int64_t PL = m->nparams, PW = m->table.nparams, counts[COMM_MAX_MEMBERS], at[COMM_MAX_MEMBERS], total = 0, most = 0;
  for (int j = 0; j < T; j++) {
    rank_units(spec, T, j, m->u0, m->u1, &at[j], &counts[j]);
    total += counts[j];
    int64_t lp = model_tp_local_params(spec, T, j);
    if (lp > most) most = lp;
  }
  float *all = me == 0 ? xmalloc((size_t)(total > 0 ? total : 1) * sizeof(float)) : NULL;
  /* Rank j's whole buffer with its units in place (zero elsewhere). */
  float *rank_buf = me == 0 ? xcalloc((size_t)most + 1, sizeof(float)) : NULL;
  int rc = 0;
  for (int s = 0; rc == 0 && s < parts; s++) {
    rc = comm_gather_v(c, 0, local + PL * s, PL, all, counts, e);
    int64_t off = 0;
    for (int j = 0; rc == 0 && me == 0 && j < T; off += counts[j], j++) {
      memcpy(rank_buf + at[j], all + off, (size_t)counts[j] * sizeof(float));
      model_tp_gather(spec, T, j, rank_buf, full + PW * s);
    }
  }
  free(all);
  free(rank_buf);
  return rc;
}

/* ---- the sync scheme's state in a whole-model checkpoint ---- */

/* The per-parameter segments of the sync scheme's state (an outer
 * optimizer's anchor, momentum, ...): one shard-sized run each. */
static int extra_runs(const struct trainer *t) {
  int n = 0;
  for (int i = 0; i < t->cfg.extra.n; i++) n += t->cfg.extra.seg[i].per_param > 0;
  return n;
}

/* The sync scheme's state put together in the whole model's layout on the
 * group's first process (dp_first and tp_first): `x` names its segments,
 * whose data *keep owns (free it). Elsewhere x->n stays 0. Collective. */
static int gather_extra(struct trainer *t, bool dp_first, bool tp_first, struct ckpt_extra *x, float **keep,
                        struct rumor_err *e) {
  const struct train_extra_spec *xs = &t->cfg.extra;
  struct model *m = &t->model;
  int runs = extra_runs(t), rc = 0;
  int64_t X = t->extra_off[xs->n], PL = m->nparams, W = m->table.nparams;
  float *own = xmalloc((size_t)(X > 0 ? X : 1) * sizeof(float));
  tensor_copy_to_host(&t->extra, 0, own, (size_t)X * sizeof(float));
  /* Each run's shard, put together into this rank's buffer (PL floats a run). */
  float *local = dp_first ? xcalloc((size_t)(PL * runs > 0 ? PL * runs : 1), sizeof(float)) : NULL;
  for (int i = 0, r = 0; rc == 0 && i < xs->n; i++) {
    if (!xs->seg[i].per_param) continue;
    RUMOR_ASSERT(xs->seg[i].per_param == 1);
    const float *mine = own + t->extra_off[i];
    if (t->cfg.dp) rc = zero_gather_host(t, mine, local ? local + PL * r : NULL, e);
    else memcpy(local + PL * r + t->shard_lo, mine, (size_t)t->shard_n * sizeof(float));
    r++;
  }
  float *full = NULL;
  if (rc == 0 && t->cfg.tp && dp_first) {
    if (tp_first) full = xcalloc((size_t)(W * runs > 0 ? W * runs : 1), sizeof(float));
    rc = assemble_tp(t, local, full, runs, e);
  }
  const float *whole = t->cfg.tp ? full : local;
  /* Each run's length in `whole`: the whole model's (a rank's slices put
   * together), or a data-parallel process's own (its stage's units, inside
   * a pipeline). A pipeline stage's tensor-parallel runs keep the range of
   * the whole layout its units fill, moved to the front as group_save
   * does with the parameters. */
  int64_t run = t->cfg.tp ? W : PL;
  if (rc == 0 && full && trainer_is_stage(t)) {
    int64_t base = m->table.unit_offset[m->u0];
    run = m->table.unit_offset[m->u1] - base;
    for (int r = 0; r < runs; r++) memmove(full + run * r, full + W * r + base, (size_t)run * sizeof(float));
  }
  x->n = 0;
  if (rc == 0 && dp_first && tp_first)
    for (int i = 0, r = 0; i < xs->n; i++) {
      bool pp = xs->seg[i].per_param > 0;
      /* A fixed segment (counters) is the same on every process: ours. */
      x->t[x->n++] = (struct ckpt_extra_tensor){xs->seg[i].name, pp ? whole + run * r++ : own + t->extra_off[i],
                                                 pp ? run : xs->seg[i].fixed};
      RUMOR_ASSERT(!pp || xs->seg[i].fixed == 0);
    }
  /* The first process keeps what x points into. */
  keep[0] = own, keep[1] = local, keep[2] = full;
  return rc;
}

int group_save(struct trainer *t, const char *path, const struct ckpt_info *info, struct rumor_err *e) {
  struct model *m = &t->model;
  int parts = 1 + optim_state_per_param(t->optim.cfg.kind);
  bool dp_first = !t->cfg.dp || t->zero.rank == 0;
  bool tp_first = !t->cfg.tp || comm_rank(t->cfg.tp->comm) == 0;
  float *local = NULL, *full = NULL;
  if (dp_first) local = xmalloc((size_t)(m->nparams * parts) * sizeof(float));
  int rc = local_state(t, local, e);
  /* Only data-parallel member 0 of each rank takes part in the ranks'
   * gather: its tensor-parallel communicator is the first members'. */
  if (rc == 0 && t->cfg.tp && dp_first) {
    if (tp_first) full = xmalloc((size_t)(m->table.nparams * parts) * sizeof(float));
    rc = assemble_tp(t, local, full, parts, e);
  }
  const float *whole = t->cfg.tp ? full : local;
  struct ckpt_info with = *info; /* its extra: the whole model's, gathered here */
  struct ckpt_extra x = {0};
  float *keep[3] = {NULL, NULL, NULL};
  int64_t bad = 0; /* the whole model's non-finite parameters, counted by the first process */
  with.extra = NULL;
  if (rc == 0 && t->cfg.extra.n > 0) {
    rc = gather_extra(t, dp_first, tp_first, &x, keep, e);
    if (x.n) with.extra = &x;
  }
  if (rc == 0 && dp_first && tp_first) {
    /* The whole model as one process holds it (a tensor-parallel rank's
     * slices put together), or a pipeline stage's units: the range of the
     * whole layout they fill, each part packed after the previous one. */
    struct model view = *m;
    if (t->cfg.tp) {
      const struct model_table *tab = &m->table;
      int64_t base = tab->unit_offset[m->u0], P = tab->unit_offset[m->u1] - base;
      for (int s = 0; s < parts; s++) memmove(full + P * s, full + tab->nparams * s + base, (size_t)P * sizeof(float));
      view.nparams = P;
      view.param_base = base;
    }
    /* As trainer_save: non-finite parameters are not written over the
     * last good state. */
    for (int64_t i = 0; i < view.nparams; i++) bad += !isfinite(whole[i]);
    if (bad == 0) rc = checkpoint_save_host(path, &view, &t->optim, whole, &with, e);
  }
  free(local);
  free(full);
  for (int i = 0; i < 3; i++) free(keep[i]);
  /* Every member learns whether the file was written, and why not: a failed
   * save fails the whole group, not its first process alone. (The count
   * travels as a float: exact below 2^24.) */
  comm_t *all = t->cfg.tp ? t->cfg.tp->all : t->zero.dp.comm;
  float failed[2] = {rc == 0 ? 0.0f : 1.0f, (float)bad};
  struct rumor_err e2 = {0};
  int arc = comm_all_reduce(all, failed, 2, &e2);
  if (rc) return rc;
  if (arc) {
    *e = e2;
    return arc;
  }
  if (failed[1] > 0) return trainer_refuse_nonfinite(t, (int64_t)failed[1], path, e);
  if (failed[0] > 0) return rumor_err_set(e, -EIO, "the group's first process could not write the checkpoint %s", path);
  return 0;
}

void group_load(struct trainer *t, const float *params, const float *const *state) {
  struct model *m = &t->model;
  int64_t P = m->nparams;
  float *local = NULL;
  /* A rank's slices of every unit; a stage's start param_base into them
   * (or into the whole model's buffer). */
  if (m->tp) local = xmalloc((size_t)model_tp_local_params(&m->spec, m->tp->size, m->tp->rank) * sizeof(float));
  if (m->tp) model_tp_scatter(&m->spec, m->tp->size, m->tp->rank, params, local);
  tensor_copy_from_host(&m->params, 0, (m->tp ? local : params) + m->param_base, (size_t)P * sizeof(float));
  int parts = optim_state_per_param(t->optim.cfg.kind);
  for (int s = 0; state && s < parts; s++) {
    const float *src = state[s];
    if (m->tp) {
      model_tp_scatter(&m->spec, m->tp->size, m->tp->rank, state[s], local);
      src = local;
    }
    /* The optimizer covers [lo, lo + nparams) of the buffer: all of it, or a ZeRO piece. */
    tensor_copy_from_host(&t->optim.state, (int64_t)s * t->optim.nparams, src + t->optim.lo,
                          (size_t)t->optim.nparams * sizeof(float));
  }
  free(local);
}

/* ---- between groups: the shards' copies made whole and equal again ---- */

/* Packs (or, `back`, unpacks) the replicated parameters' values of `x`,
 * a flat tensor in this rank's parameter layout starting at element
 * `base`, in table order into buf; with buf NULL only counts them.
 * Returns the floats. */
static int64_t replicated_copy(struct model *m, struct tensor *x, int64_t base, float *buf, bool back) {
  const struct model_table *tab = model_own_table(m);
  int64_t at = 0;
  for (size_t i = 0; i < tab->n; i++) {
    if (m->tp_layout.slice[i].dim >= 0) continue; /* split across the ranks */
    if (tab->p[i].unit < m->u0 || tab->p[i].unit >= m->u1) continue; /* another stage's */
    int64_t a = base + tab->p[i].offset - m->param_base, n = tab->p[i].numel;
    if (buf && back) tensor_copy_from_host(x, a, buf + at, (size_t)n * sizeof(float));
    else if (buf) tensor_copy_to_host(x, a, buf + at, (size_t)n * sizeof(float));
    at += n;
  }
  return at;
}

/* The tensor-parallel ranks' mean of the replicated parameters' values in
 * x (laid out as replicated_copy's); every rank sums in the same order,
 * so all hold the same bits after. */
static int average_replicated(struct trainer *t, struct tensor *x, int64_t base, struct rumor_err *e) {
  struct model *m = &t->model;
  int64_t n = replicated_copy(m, x, base, NULL, false);
  if (n == 0) return 0;
  float *buf = xmalloc((size_t)n * sizeof(float));
  replicated_copy(m, x, base, buf, false);
  int rc = comm_all_reduce(t->cfg.tp->comm, buf, n, e);
  if (rc == 0) {
    float inv = 1.0f / (float)comm_size(t->cfg.tp->comm);
    for (int64_t i = 0; i < n; i++) buf[i] *= inv;
    replicated_copy(m, x, base, buf, true);
  }
  free(buf);
  return rc;
}

static comm_t *group_all(const struct trainer *t) { return t->cfg.tp ? t->cfg.tp->all : t->zero.dp.comm; }

/* A step in two floats of at most 24 bits each (exact); steps are below
 * TRAIN_STEPS_MAX < 2^48. */
#define STEP_UNIT 16777216.0

/* A step into two floats at v. */
static void put_value(float *v, int64_t step) {
  v[0] = (float)fmod((double)step, STEP_UNIT);
  v[1] = (float)floor((double)step / STEP_UNIT);
}

/* This process's step into its two floats of `slots` (process r's at 2r). */
static void put_step(const struct trainer *t, float *slots, int r) { put_value(slots + 2 * r, t->st.step); }

/* Process r's step from the summed slots. */
static int64_t slot_step(const float *slots, int r) {
  return (int64_t)slots[2 * r] + (int64_t)slots[2 * r + 1] * (int64_t)STEP_UNIT;
}

/* ---- agreements across a pipeline's stages ----
 * A group whose stages hold data-parallel members or tensor-parallel ranks
 * agrees inside each stage over the stage's communicator (group_all), then
 * across the stages over the links (pipeline_agree): process r of every
 * stage carries its stage's (already agreed) values up and the result back
 * down, so every process of the group ends with the same. */

static bool across_stages(const struct trainer *t) { return trainer_is_stage(t) && t->pipe.stages > 1; }

/* What arrives over the links is checked before it is read as steps: a
 * flag is 0 or 1, a step two whole floats below STEP_UNIT (put_value). */
static bool flag_ok(float f) { return f == 0.0f || f == 1.0f; }
static bool step_ok(const float *v) {
  for (int i = 0; i < 2; i++)
    if (!(v[i] >= 0 && v[i] < STEP_UNIT && v[i] == floorf(v[i]))) return false;
  return true;
}

/* [flag]: any stage's. */
static void fold_any(float *acc, const float *mine, int n) {
  (void)n;
  if (flag_ok(acc[0]) && mine[0] > acc[0]) acc[0] = mine[0];
}

/* [pulled, lo (two floats), hi (two floats)]: any, the smallest, the
 * largest (steps as put_value writes them). What is not so stays, for the
 * caller to refuse. */
static void fold_steps(float *acc, const float *mine, int n) {
  (void)n;
  if (!flag_ok(acc[0]) || !step_ok(acc + 1) || !step_ok(acc + 3)) return;
  if (mine[0] > acc[0]) acc[0] = mine[0];
  if (slot_step(mine + 1, 0) < slot_step(acc + 1, 0)) acc[1] = mine[1], acc[2] = mine[2];
  if (slot_step(mine + 3, 0) > slot_step(acc + 3, 0)) acc[3] = mine[3], acc[4] = mine[4];
}

/* Agrees on v across the stages (nothing to do without stages); refuses a
 * result that is not `n` flags, or a flag and two steps (n = 5). */
static int agree_across(struct trainer *t, float *v, int n, pipe_combine_fn fold, struct rumor_err *e) {
  if (!across_stages(t)) return 0;
  int rc = pipeline_agree(&t->pipe, t->stage_agreements++, v, n, fold, e);
  if (rc) return rc;
  bool ok = flag_ok(v[0]) && (n == 1 || (n == 5 && step_ok(v + 1) && step_ok(v + 3)));
  if (!ok)
    return rumor_err_set(e, RUMOR_EPROTO, "the stages' agreement %lld came back as what no stage sends (%g, ...)",
                         (long long)t->stage_agreements - 1, (double)v[0]);
  return 0;
}

/* The group's processes' steps, smallest and largest, and whether any took
 * a pulled state (trainer_load_state) since the last agreement: one
 * all-reduce of [pulled, then two floats per process], then across the
 * stages. */
static int step_range(struct trainer *t, int64_t *lo, int64_t *hi, bool *pulled, struct rumor_err *e) {
  comm_t *all = group_all(t);
  int members = all ? comm_size(all) : 1, me = all ? comm_rank(all) : 0, rc;
  float v[1 + 2 * COMM_MAX_MEMBERS] = {0};
  /* A plain stage (no communicator) does not track its pulls: steps that
   * differ between stages say one was taken. */
  v[0] = t->state_pulled || !all ? 1.0f : 0.0f;
  put_step(t, v + 1, me);
  if (all && (rc = comm_all_reduce(all, v, 1 + 2 * (int64_t)members, e))) return rc;
  *lo = INT64_MAX, *hi = 0;
  for (int r = 0; r < members; r++) {
    int64_t s = slot_step(v + 1, r);
    if (s < *lo) *lo = s;
    if (s > *hi) *hi = s;
  }
  float w[5] = {v[0] > 0 ? 1.0f : 0.0f}; /* the members' sum of flags */
  put_value(w + 1, *lo);
  put_value(w + 3, *hi);
  if ((rc = agree_across(t, w, 5, fold_steps, e))) return rc;
  *pulled = w[0] > 0;
  *lo = slot_step(w + 1, 0), *hi = slot_step(w + 3, 0);
  return 0;
}

/* How many times the processes of a group that dropped a step take their
 * shards again before they give up on holding shards of one step. A late
 * group's donors may run alone in their rings, a step every few
 * milliseconds, so each retake can land a step or three past the others'
 * and they leapfrog (8 tries were once not enough); a try costs one
 * shard's pull. */
#define GROUP_CATCH_UP_TRIES 32

/* After a step some process dropped: the group goes on from one step. When
 * nobody pulled a state (a ring's sum was not finite), that is the next
 * one. When some process took its shard from a ring (a late group), every
 * process whose shard is older than the latest any took takes its own
 * again at that step or later (the donors, each a process of a live group,
 * may have served steps apart), until all hold shards of one step. */
static int converge_after_drop(struct trainer *t, struct rumor_err *e) {
  for (int tries = 0;; tries++) {
    int64_t lo, hi;
    bool pulled;
    int rc = step_range(t, &lo, &hi, &pulled, e);
    if (rc) return rc;
    if (!pulled || lo == hi) {
      if (hi > t->st.step) trainer_take_step(t, hi); /* the train_reducer's: the step is counted */
      return 0;
    }
    if (tries == GROUP_CATCH_UP_TRIES)
      return rumor_err_set(e, RUMOR_EPROTO, "the group's processes took their shards at steps %lld to %lld and, in "
                           "%d more tries, could not take them all at one step", (long long)lo, (long long)hi,
                           GROUP_CATCH_UP_TRIES);
    if (t->st.step >= hi) continue;
    rc = t->reducer.catch_up ? t->reducer.catch_up(t->reducer.arg, hi, e) : 1;
    if (rc < 0) return rc;
    if (rc == 1) { /* nobody can give one: this shard stays older (the next rounds are the same for all) */
      log_warn("no process of our shard's ring could give a shard of step %lld: ours, of step %lld, stays",
               (long long)hi, (long long)t->st.step);
      trainer_take_step(t, hi);
    }
  }
}

/* While the group's communicator waits, `idle` runs (serving the states
 * other groups' processes pull); NULL stops it. Nothing for a plain stage,
 * which has no communicator. */
static void group_idle(struct trainer *t, void (*idle)(void *arg), void *arg) {
  comm_t *all = group_all(t);
  if (all) comm_set_idle(all, idle, arg);
}

int trainer_group_join_converge(struct trainer *t, int64_t shard_step, struct rumor_err *e) {
  if (!t->reducer.reduce || !t->reducer.catch_up) return 0;
  group_idle(t, t->reducer.idle, t->reducer.arg);
  trainer_take_step(t, shard_step);
  int rc = converge_after_drop(t, e);
  group_idle(t, NULL, NULL);
  return rc;
}

int trainer_stages_agree_step(struct trainer *t, void (*idle)(void *arg), void *arg, struct rumor_err *e) {
  if (!across_stages(t)) return 0;
  group_idle(t, idle, arg);
  int64_t lo, hi;
  bool pulled;
  int rc = step_range(t, &lo, &hi, &pulled, e);
  group_idle(t, NULL, NULL);
  if (rc) return rc;
  if (hi > t->st.step) {
    log_info("the group goes on from step %lld, which a process took from its ring (we were at step %lld)",
             (long long)hi, (long long)t->st.step);
    trainer_take_step(t, hi);
  }
  return 0;
}

int group_reduce_between(struct trainer *t, int64_t rows, struct rumor_err *e) {
  double r0 = clock_now_s();
  int rc = t->reducer.reduce(t->reducer.arg, rows, e);
  if (rc >= 0) {
    /* A process here may wait for one of ours still in its ring, whose
     * round waits for a process of another group, which may be pulling
     * our state to catch up: serve it meanwhile. Our state is the step's
     * start's until the update. */
    comm_t *all = group_all(t); /* NULL: a plain stage */
    group_idle(t, t->reducer.idle, t->reducer.arg);
    float dropped = rc > 0 ? 1.0f : 0.0f;
    rc = all ? comm_all_reduce(all, &dropped, 1, e) : 0;
    dropped = dropped > 0 ? 1.0f : 0.0f; /* the members' sum of flags */
    if (rc == 0) rc = agree_across(t, &dropped, 1, fold_any, e); /* every stage drops alike */
    if (rc == 0 && dropped > 0) rc = converge_after_drop(t, e);
    if (rc == 0 && dropped > 0) rc = 1;
    group_idle(t, NULL, NULL);
  }
  t->reduce_s += clock_now_s() - r0;
  if (rc) return rc;
  /* ZeRO 0 ranks hold every piece after (and all-gather them next); ZeRO
   * 1-2 ranks only their own, whose replicated entries no other rank of the
   * member holds alike: they average the replicated parameters after every
   * step instead (trainer_group_resync; ZeRO 3 ranks between groups are
   * refused by the command line). */
  bool whole = !t->cfg.dp || t->zero.dp.zero == 0;
  if (t->cfg.tp && !whole) t->replicated_apart = true;
  if (t->cfg.tp && whole && (rc = average_replicated(t, &t->model.grads, 0, e))) return rc;
  return 0;
}

void trainer_group_agree_steps(struct trainer *t) { t->agree_steps = true; }

/* The agreement of trainer_group_agree_steps: `slots` holds, summed over
 * the members, each one's step in its own two floats. The trainer takes
 * the largest. */
static void take_largest_step(struct trainer *t, const float *slots, int members) {
  int64_t most = t->st.step;
  int who = -1;
  for (int r = 0; r < members; r++) {
    int64_t s = slot_step(slots, r);
    if (s > most) most = s, who = r;
  }
  if (who < 0) return;
  log_info("the group goes on from step %lld, which member %d took from its ring (we were at step %lld)",
           (long long)most, who, (long long)t->st.step);
  trainer_take_step(t, most);
}

/* The members agree whether any shard changed, whether any took a pulled
 * state (trainer_load_state) since the last agreement, and (agree_steps)
 * on the largest step: one all-reduce of [any, pulled, then two floats per
 * member]. */
static int agree(struct trainer *t, bool changed, float *any, float *pulled, struct rumor_err *e) {
  comm_t *all = group_all(t);
  int members = comm_size(all);
  int64_t n = 2 + (t->agree_steps ? 2 * (int64_t)members : 0);
  float v[2 + 2 * COMM_MAX_MEMBERS] = {0}; /* every step: no allocation */
  v[0] = changed || t->state_pulled ? 1.0f : 0.0f;
  v[1] = t->state_pulled ? 1.0f : 0.0f;
  if (t->agree_steps) put_step(t, v + 2, comm_rank(all));
  int rc = comm_all_reduce(all, v, n, e);
  if (rc == 0 && t->agree_steps) take_largest_step(t, v + 2, members);
  *any = v[0];
  *pulled = v[1];
  return rc;
}

static int resync(struct trainer *t, bool changed, bool *out, struct rumor_err *e) {
  float any, pulled;
  int rc = agree(t, changed, &any, &pulled, e);
  *out = rc == 0 && any > 0;
  if (rc) return rc;
  bool z3 = t->cfg.dp && t->zero.dp.zero == 3;
  if ((any > 0 || t->zero.partial) && t->cfg.dp && !z3 && (rc = zero_gather_params(t, e))) return rc;
  /* A process took a pulled shard's optimizer state (a ring's catch-up):
   * the copies of it the others hold (ZeRO 0, replicated entries) follow. */
  if (pulled > 0 && (rc = trainer_group_resync_state(t, e))) return rc;
  if (!t->cfg.tp) return 0;
  if (z3) /* refused by the command line (peer/cli/cmd_stage.c) */
    return rumor_err_set(e, RUMOR_EFORMAT, "ZeRO 3 tensor-parallel ranks cannot average replicated parameters");
  /* Equal replicated parameters and moments stay equal (the ranks'
   * gradients of them are equal): only a change needs the average, and
   * averaging equal values could still move them by a rounding (3a / 3).
   * After a pulled state whose moments the ranks could not average
   * (replicated_apart), every call: averaged parameters keep the ranks'
   * gradients, and so those moments, converging. */
  if (any == 0 && !t->replicated_apart) return 0;
  return average_replicated(t, &t->model.params, 0, e);
}

int trainer_group_resync(struct trainer *t, bool changed, bool *any_out, struct rumor_err *e) {
  bool ignored;
  bool *out = any_out ? any_out : &ignored;
  *out = changed;
  if (!t->cfg.dp && !t->cfg.tp) return 0;
  uint64_t s0, r0, s1, r1;
  comm_bytes(group_all(t), &s0, &r0);
  int rc = resync(t, changed, out, e);
  /* The step's figure (comm_step_bytes) includes the resync after it. */
  comm_bytes(group_all(t), &s1, &r1);
  t->comm_step_bytes += (double)(s1 - s0 + r1 - r0);
  return rc;
}

int trainer_group_resync_state(struct trainer *t, struct rumor_err *e) {
  bool zero0 = t->cfg.dp && t->zero.dp.zero == 0;
  int rc;
  t->state_pulled = false; /* what it was set for is done here */
  if (zero0 && (rc = zero_gather_state(t, e))) return rc;
  if (!t->cfg.tp) return 0;
  if (t->cfg.dp && !zero0) { /* the moments are spread over the members' pieces */
    t->replicated_apart = true;
    return 0;
  }
  int parts = optim_state_per_param(t->optim.cfg.kind);
  rc = 0;
  for (int s = 0; rc == 0 && s < parts; s++) rc = average_replicated(t, &t->optim.state, (int64_t)s * t->optim.nparams, e);
  return rc;
}

#define FNV_START 1469598103934665603ull

/* FNV-1a over `n` floats' bytes, continuing from h. */
static uint64_t fnv1a(uint64_t h, const float *x, int64_t n) {
  const unsigned char *b = (const unsigned char *)x;
  for (int64_t i = 0; i < n * (int64_t)sizeof(float); i++) h = (h ^ b[i]) * 1099511628211ull;
  return h;
}

/* FNV-1a, continuing from h, over floats [a, b) of a device tensor,
 * through a bounded host buffer (a whole-model copy would raise the peak
 * memory ZeRO saves). */
static uint64_t fnv1a_range(uint64_t h, const struct tensor *x, int64_t a, int64_t b) {
  enum { CHUNK = 1 << 20 };
  int64_t n = b - a;
  float *buf = xmalloc((size_t)(n < CHUNK ? (n > 0 ? n : 1) : CHUNK) * sizeof(float));
  for (int64_t at = 0; at < n; at += CHUNK) {
    int64_t k = n - at < CHUNK ? n - at : CHUNK;
    tensor_copy_to_host(x, a + at, buf, (size_t)k * sizeof(float));
    h = fnv1a(h, buf, k);
  }
  free(buf);
  return h;
}

static uint64_t fnv1a_tensor(const struct tensor *x, int64_t n) { return fnv1a_range(FNV_START, x, 0, n); }

/* The hash of the parameters every data-parallel member holds alike: all
 * of them, but for an expert-parallel member at ZeRO 1-3 (zero.ep_aware)
 * the experts' regions, which each member holds only of its own experts. */
static uint64_t fnv1a_shared_params(const struct trainer *t) {
  const struct model *m = &t->model;
  if (!t->zero.ep_aware) return fnv1a_tensor(&m->params, m->nparams);
  uint64_t h = FNV_START;
  int64_t from = 0, xa, per;
  for (int u = 0; u < model_own_table(m)->nunits; u++)
    if (model_ep_expert_span(m, u, &xa, &per)) {
      h = fnv1a_range(h, &m->params, from, xa);
      from = xa + (int64_t)m->spec.u.gpt.experts * per;
    }
  return fnv1a_range(h, &m->params, from, m->nparams);
}

/* Compares `h` with member 0's of `c`: *differs is set when they differ. */
static int compare_with_first(comm_t *c, uint64_t h, bool *differs, struct rumor_err *e) {
  uint64_t first = h;
  int rc = comm_broadcast(c, 0, &first, sizeof first, e);
  *differs = rc == 0 && first != h;
  return rc;
}

int trainer_group_check(struct trainer *t, struct rumor_err *e) {
  if (!t->cfg.dp && !t->cfg.tp) return 0;
  struct model *m = &t->model;
  bool dp_differs = false, tp_differs = false, state_differs = false;
  int rc = 0;
  if (t->cfg.dp && t->zero.dp.zero <= 2) {
    rc = compare_with_first(t->zero.dp.comm, fnv1a_shared_params(t), &dp_differs, e);
  }
  if (rc == 0 && t->cfg.dp && t->zero.dp.zero == 0) { /* each member holds the whole optimizer state */
    int64_t n = t->optim.nparams * optim_state_per_param(t->optim.cfg.kind);
    rc = compare_with_first(t->zero.dp.comm, fnv1a_tensor(&t->optim.state, n), &state_differs, e);
  }
  if (rc == 0 && t->cfg.tp && !(t->cfg.dp && t->zero.dp.zero == 3)) {
    int64_t n = replicated_copy(m, &m->params, 0, NULL, false);
    float *buf = xmalloc((size_t)(n > 0 ? n : 1) * sizeof(float));
    replicated_copy(m, &m->params, 0, buf, false);
    rc = compare_with_first(t->cfg.tp->comm, fnv1a(FNV_START, buf, n), &tp_differs, e);
    free(buf);
  }
  if (rc) return rc;
  /* Every process learns the verdict, so the whole group fails alike. */
  float bad[3] = {dp_differs ? 1.0f : 0.0f, tp_differs ? 1.0f : 0.0f, state_differs ? 1.0f : 0.0f};
  if ((rc = comm_all_reduce(group_all(t), bad, 3, e))) return rc;
  if (bad[0] > 0)
    return rumor_err_set(e, RUMOR_EPROTO, "the group's data-parallel members hold different parameters (%g of them "
                         "differ from their member 0's)", (double)bad[0]);
  if (bad[1] > 0)
    return rumor_err_set(e, RUMOR_EPROTO, "the group's tensor-parallel ranks hold different replicated parameters "
                         "(%g of them differ from their rank 0's)", (double)bad[1]);
  if (bad[2] > 0)
    return rumor_err_set(e, RUMOR_EPROTO, "the group's ZeRO 0 members hold different optimizer states (%g of them "
                         "differ from their member 0's)", (double)bad[2]);
  return 0;
}
