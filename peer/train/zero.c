/* A data-parallel member of a peer group: its share of each step, ZeRO
 * stages 0 to 3 (train.h, struct train_dp). */
#include "peer/train/train_impl.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>

int64_t trainer_peak_rss_bytes(void) {
  struct rusage ru;
  if (getrusage(RUSAGE_SELF, &ru) != 0) return 0;
  return (int64_t)ru.ru_maxrss * 1024; /* KiB on Linux */
}

bool trainer_is_dp(const struct trainer *t) { return t->cfg.dp != NULL; }

static bool on_cpu(const struct trainer *t) { return tensor_backend_device(t->be) == TENSOR_DEVICE_CPU; }


/* Rows [*lo, *hi) of a batch of `rows` that this member trains on. */
static void my_rows(const struct train_zero *z, int64_t rows, int64_t *lo, int64_t *hi) {
  comm_chunk(rows, z->size, z->rank, lo, hi);
}

/* Per-member counts of the flat range [a, b): its intersection with each
 * member's piece (contiguous and in member order, so they cover [a, b)). */
static void range_counts(struct train_zero *z, int64_t a, int64_t b) {
  for (int j = 0; j < z->size; j++) {
    int64_t lo = z->cut[j] > a ? z->cut[j] : a, hi = z->cut[j + 1] < b ? z->cut[j + 1] : b;
    z->counts[j] = hi > lo ? hi - lo : 0;
  }
}

enum coll { COLL_ALL_REDUCE, COLL_REDUCE_SCATTER, COLL_ALL_GATHER };

/* Collectives move at most this many floats at a time (4 MiB): the
 * communicator copies what it sends and receives, so a whole-buffer call
 * would hold copies the size of the parameters; segments bound that to a
 * few of these, and the device staging buffer to one. */
#define SEGMENT_FLOATS ((int64_t)1 << 20)

/* Runs collective `op` on buf[0..n), the elements [a, a + n) of the flat
 * range (per-member counts from their pieces for the _v forms). */
static int run_op(struct train_zero *z, enum coll op, float *buf, int64_t a, int64_t n, struct rumor_err *e) {
  if (op == COLL_ALL_REDUCE) return comm_all_reduce(z->dp.comm, buf, n, e);
  range_counts(z, a, a + n);
  return op == COLL_REDUCE_SCATTER ? comm_reduce_scatter_v(z->dp.comm, buf, z->counts, e)
                                   : comm_all_gather_v(z->dp.comm, buf, z->counts, e);
}

/* The part of [a, b) the device must send (`out`) or take back (!out) for
 * `op`: all of it for an all-reduce; only this member's piece of it going
 * out for an all-gather (the others' parts are overwritten) and coming
 * back for a reduce-scatter (what it leaves elsewhere is undefined). */
static void moved_part(const struct train_zero *z, enum coll op, bool out, int64_t a, int64_t b, int64_t *lo,
                       int64_t *hi) {
  *lo = a, *hi = b;
  if (op == COLL_ALL_REDUCE || (out ? op != COLL_ALL_GATHER : op != COLL_REDUCE_SCATTER)) return;
  int64_t plo = z->cut[z->rank], phi = z->cut[z->rank + 1];
  *lo = plo > a ? plo : a;
  *hi = phi < b ? phi : b;
  if (*hi < *lo) *hi = *lo;
}

/* Starts copying segment [s, e) of x into staging half i beside the
 * training stream, once that half's previous copy back has landed. */
static void stage_out(struct trainer *t, enum coll op, const struct tensor *x, int i, int64_t s, int64_t e) {
  struct train_zero *z = &t->zero;
  RUMOR_ASSERT(e - s <= z->host_floats);
  tensor_event_wait(z->back_ev[i]);
  int64_t lo, hi;
  moved_part(z, op, true, s, e, &lo, &hi);
  if (hi > lo) tensor_copy_to_host_beside(x, lo, z->host[i] + (lo - s), (size_t)(hi - lo) * sizeof(float), z->out_ev[i]);
  else tensor_event_record(z->out_ev[i]);
}

/* A collective over [a, b) of a device tensor through the pinned staging
 * halves, segment by segment: segment k + 1 is copied out on the copy
 * stream while segment k is on the wire, and each result is copied back on
 * the training stream (ordered before whatever reads it next), so copies
 * overlap communication. */
static int collective_staged(struct trainer *t, enum coll op, struct tensor *x, int64_t a, int64_t b,
                             struct rumor_err *e) {
  struct train_zero *z = &t->zero;
  if (b <= a) return 0;
  int64_t seg = z->host_floats;
  stage_out(t, op, x, 0, a, b - a < seg ? b : a + seg);
  int rc = 0;
  for (int64_t s = a, k = 0; s < b && rc == 0; s += seg, k++) {
    int i = (int)(k & 1);
    int64_t end = b - s < seg ? b : s + seg;
    if (end < b) stage_out(t, op, x, i ^ 1, end, b - end < seg ? b : end + seg);
    tensor_event_wait(z->out_ev[i]);
    rc = run_op(z, op, z->host[i], s, end - s, e);
    int64_t lo, hi;
    moved_part(z, op, false, s, end, &lo, &hi);
    if (rc == 0 && hi > lo)
      tensor_copy_from_host_async(x, lo, z->host[i] + (lo - s), (size_t)(hi - lo) * sizeof(float));
    tensor_event_record(z->back_ev[i]);
  }
  /* A failure leaves a copy out in flight: it must land before the
   * staging is reused or freed. */
  for (int i = 0; i < 2; i++) tensor_event_wait(z->out_ev[i]);
  return rc;
}

/* A collective over [a, b) of x: in place on the CPU, through the staging
 * on a device (or when train_dp.staged asks for it). Large ranges move in
 * segments whose per-member counts are their intersections with the
 * members' pieces, so the pieces end up as one call over the whole range
 * would leave them. */
static int collective(struct trainer *t, enum coll op, struct tensor *x, int64_t a, int64_t b, struct rumor_err *e) {
  if (t->zero.host[0]) return collective_staged(t, op, x, a, b, e);
  int64_t seg = t->zero.seg;
  for (int64_t s = a; s < b; s += seg) {
    int64_t end = b - s < seg ? b : s + seg;
    int rc = run_op(&t->zero, op, (float *)x->data + s, s, end - s, e);
    if (rc) return rc;
  }
  return 0;
}

/* Gives back the memory of [a, b) of x outside this member's piece. */
static void release_outside(struct trainer *t, struct tensor *x, int64_t a, int64_t b) {
  const struct train_zero *z = &t->zero;
  int64_t lo = z->cut[z->rank], hi = z->cut[z->rank + 1];
  if (a < lo) tensor_discard(x, a, (lo < b ? lo : b) - a);
  if (b > hi) {
    int64_t from = hi > a ? hi : a;
    tensor_discard(x, from, b - from);
  }
}

/* ---- experts (ep_aware) ---- */

/* Unit u's experts' region [*a, *b) of the flat buffers and one expert's
 * floats (*per), when this member moves experts only to and from their
 * members and u has experts. */
static bool unit_experts(const struct trainer *t, int u, int64_t *a, int64_t *b, int64_t *per) {
  if (!t->zero.ep_aware || !model_ep_expert_span(&t->model, u, a, per)) return false;
  *b = *a + (int64_t)t->model.spec.u.gpt.experts * *per;
  return true;
}

/* The part [*lo, *hi) of region [a, a + E·per) that expert-parallel rank
 * `r` runs. */
static void run_by(const struct trainer *t, int64_t a, int64_t per, int r, int64_t *lo, int64_t *hi) {
  int x0, x1;
  model_ep_experts(&t->model.spec, t->ep.size, r, &x0, &x1);
  *lo = a + x0 * per;
  *hi = a + x1 * per;
}

/* |[a0, b0) ∩ [a1, b1)|, its start in *at. */
static int64_t overlap(int64_t a0, int64_t b0, int64_t a1, int64_t b1, int64_t *at) {
  *at = a0 > a1 ? a0 : a1;
  int64_t end = b0 < b1 ? b0 : b1;
  return end > *at ? end - *at : 0;
}

static float *xbuf(struct train_zero *z, int64_t n) {
  if (n > z->xbuf_floats) {
    z->xbuf = xrealloc(z->xbuf, (size_t)n * sizeof(float));
    z->xbuf_floats = n;
  }
  return z->xbuf;
}

/* The two sides of an experts' exchange over region [a, b) (one expert:
 * per floats), for each member j: mine[j] floats of this member's piece
 * that j runs, and theirs[j] floats of j's piece that this member runs
 * (the pieces tile the buffer in member order, so the latter, j by j, are
 * this member's experts whole). Returns Σ mine. */
static int64_t runner_counts(struct trainer *t, int64_t a, int64_t b, int64_t per, int64_t *mine, int64_t *theirs) {
  struct train_zero *z = &t->zero;
  int64_t plo, pn = overlap(z->cut[z->rank], z->cut[z->rank + 1], a, b, &plo), olo, ohi, at, sum = 0;
  run_by(t, a, per, z->ep_of[z->rank], &olo, &ohi);
  for (int j = 0; j < z->size; j++) {
    int64_t lo, hi;
    run_by(t, a, per, z->ep_of[j], &lo, &hi);
    sum += mine[j] = overlap(plo, plo + pn, lo, hi, &at);
    theirs[j] = overlap(z->cut[j], z->cut[j + 1], olo, ohi, &at);
  }
  return sum;
}

/* Where a non-empty mine[j] of runner_counts starts, relative to this
 * member's piece of the region (which starts at plo). */
static int64_t mine_at(struct trainer *t, int64_t a, int64_t per, int j, int64_t plo) {
  int64_t lo, hi;
  run_by(t, a, per, t->zero.ep_of[j], &lo, &hi);
  return lo > plo ? lo - plo : 0;
}

/* All-gather of an experts' region [a, b) to the members that run them:
 * member m receives from every member the part of its piece that m's
 * experts span, which together are those experts whole; nobody receives
 * experts it does not run. One all-to-all. */
static int experts_to_runners(struct trainer *t, struct tensor *x, int64_t a, int64_t b, int64_t per,
                              struct rumor_err *e) {
  struct train_zero *z = &t->zero;
  int64_t plo, pn = overlap(z->cut[z->rank], z->cut[z->rank + 1], a, b, &plo), olo, ohi;
  run_by(t, a, per, z->ep_of[z->rank], &olo, &ohi);
  int64_t ns = runner_counts(t, a, b, per, z->counts, z->counts2);
  float *buf = xbuf(z, pn + ns + (ohi - olo)), *send = buf + pn, *recv = send + ns;
  if (pn > 0) tensor_copy_to_host(x, plo, buf, (size_t)pn * sizeof(float));
  int64_t k = 0;
  for (int j = 0; j < z->size; k += z->counts[j], j++)
    if (z->counts[j] > 0) memcpy(send + k, buf + mine_at(t, a, per, j, plo), (size_t)z->counts[j] * sizeof(float));
  int rc = comm_all_to_all(z->dp.comm, send, z->counts, recv, z->counts2, e);
  if (rc == 0 && ohi > olo) tensor_copy_from_host(x, olo, recv, (size_t)(ohi - olo) * sizeof(float));
  return rc;
}

/* Reduce-scatter of an experts' region [a, b) of the gradients from the
 * members that run them: each such member's gradient of its experts is
 * already the sum over its run's tokens, and only those members' go to
 * the pieces; a piece sums what the runs' members of each expert sent, in
 * member order (the other members' gradients there are not read). */
static int experts_from_runners(struct trainer *t, struct tensor *g, int64_t a, int64_t b, int64_t per,
                                struct rumor_err *e) {
  struct train_zero *z = &t->zero;
  int64_t plo, pn = overlap(z->cut[z->rank], z->cut[z->rank + 1], a, b, &plo), olo, ohi;
  run_by(t, a, per, z->ep_of[z->rank], &olo, &ohi);
  int64_t nr = runner_counts(t, a, b, per, z->counts2, z->counts); /* the other way round */
  float *buf = xbuf(z, (ohi - olo) + nr + pn), *recv = buf + (ohi - olo), *sum = recv + nr;
  if (ohi > olo) tensor_copy_to_host(g, olo, buf, (size_t)(ohi - olo) * sizeof(float));
  int rc = comm_all_to_all(z->dp.comm, buf, z->counts, recv, z->counts2, e);
  if (rc || pn == 0) return rc;
  memset(sum, 0, (size_t)pn * sizeof(float));
  int64_t k = 0;
  for (int j = 0; j < z->size; k += z->counts2[j], j++) {
    float *into = sum + (z->counts2[j] > 0 ? mine_at(t, a, per, j, plo) : 0);
    for (int64_t i = 0; i < z->counts2[j]; i++) into[i] += recv[k + i];
  }
  tensor_copy_from_host(g, plo, sum, (size_t)pn * sizeof(float));
  return 0;
}

/* A reduce-scatter or all-gather over [a, b), which holds whole units:
 * their experts' regions (ep_aware) move only from or to the members that
 * run them, the rest as collective moves it. */
static int collective_units(struct trainer *t, enum coll op, struct tensor *x, int64_t a, int64_t b,
                            struct rumor_err *e) {
  const struct model_table *tab = model_own_table(&t->model);
  int64_t from = a;
  int rc = 0;
  for (int u = 0; u < tab->nunits && rc == 0; u++) {
    int64_t xa, xb, per;
    if (!unit_experts(t, u, &xa, &xb, &per) || xb <= a || xa >= b) continue;
    RUMOR_ASSERT(a <= xa && xb <= b);
    if ((rc = collective(t, op, x, from, xa, e))) break;
    rc = op == COLL_ALL_GATHER ? experts_to_runners(t, x, xa, xb, per, e) : experts_from_runners(t, x, xa, xb, per, e);
    from = xb;
  }
  return rc ? rc : collective(t, op, x, from, b, e);
}

/* ZeRO 3: the flat range of unit u's parameters, and for the unit that
 * uses the tied entry without holding it (GPT's head) that entry's too. */
static void unit_range(const struct model *m, int u, int64_t *a, int64_t *b) {
  *a = model_own_table(m)->unit_offset[u];
  *b = model_own_table(m)->unit_offset[u + 1];
}

static const struct model_param *tied_user(const struct model *m, int u) {
  const struct model_table *tab = model_own_table(m);
  if (tab->tied_entry < 0 || u != tab->nunits - 1 || u == 0) return NULL;
  return &tab->p[tab->tied_entry];
}

/* The device memory held at `where` (debug; the first steps only). */
static void log_device_memory(const struct trainer *t, const char *where) {
  if (t->st.step >= 2 || !log_enabled(LOG_DEBUG)) return;
  int64_t live = tensor_backend_live_bytes(t->be);
  if (live >= 0)
    log_debug("ZeRO %d, step %lld, %s: %.1f MiB of device memory held (at most %.1f MiB)", t->zero.dp.zero,
              (long long)t->st.step, where, (double)live / 1048576.0,
              (double)tensor_backend_peak_bytes(t->be, false) / 1048576.0);
}

/* Takes back the memory of unit u's range of x (and of the tied entry it
 * uses) before it is written: a device gives discarded memory back only on
 * request (tensor_recommit). */
static int recommit_unit(struct trainer *t, struct tensor *x, int u, struct rumor_err *e) {
  struct model *m = &t->model;
  int64_t a, b, xa, xb, per, lo, hi;
  unit_range(m, u, &a, &b);
  int rc;
  if (unit_experts(t, u, &xa, &xb, &per)) { /* not the experts other members run */
    run_by(t, xa, per, t->zero.ep_of[t->zero.rank], &lo, &hi);
    if ((rc = tensor_recommit(x, a, xa - a, e)) == 0 && (rc = tensor_recommit(x, lo, hi - lo, e)) == 0)
      rc = tensor_recommit(x, xb, b - xb, e);
  } else {
    rc = tensor_recommit(x, a, b - a, e);
  }
  const struct model_param *tp = tied_user(m, u);
  if (rc == 0 && tp) rc = tensor_recommit(x, tp->offset, tp->numel, e);
  return rc ? rumor_err_prefix(e, "ZeRO %d, unit %d", t->zero.dp.zero, u) : 0;
}

static int gather_unit(struct trainer *t, int u, struct rumor_err *e) {
  struct model *m = &t->model;
  int64_t a, b;
  unit_range(m, u, &a, &b);
  int rc = recommit_unit(t, &m->params, u, e);
  if (rc == 0) rc = collective_units(t, COLL_ALL_GATHER, &m->params, a, b, e);
  const struct model_param *tp = tied_user(m, u);
  if (rc == 0 && tp) rc = collective(t, COLL_ALL_GATHER, &m->params, tp->offset, tp->offset + tp->numel, e);
  return rc;
}

static void release_unit(struct trainer *t, int u) {
  struct model *m = &t->model;
  int64_t a, b;
  unit_range(m, u, &a, &b);
  release_outside(t, &m->params, a, b);
  const struct model_param *tp = tied_user(m, u);
  if (tp) release_outside(t, &m->params, tp->offset, tp->offset + tp->numel);
}

/* An expert-parallel member at ZeRO 1-3: every member's expert-parallel
 * rank (runs of P consecutive members: train_dp.experts), its model told
 * to leave other members' experts' gradients alone, and the memory of
 * their weights and gradients outside its piece given back. No
 * collective: the communicator may not be connected yet. */
static void ep_aware_init(struct trainer *t) {
  struct train_zero *z = &t->zero;
  RUMOR_ASSERT(z->size % t->ep.size == 0 && z->rank % t->ep.size == t->ep.rank);
  for (int j = 0; j < z->size; j++) z->ep_of[j] = j % t->ep.size;
  z->ep_aware = true;
  t->ep.own_experts_only = true;
  const struct model_table *tab = model_own_table(&t->model);
  for (int u = 0; u < tab->nunits; u++) {
    int64_t xa, xb, per, lo, hi;
    if (!unit_experts(t, u, &xa, &xb, &per)) continue;
    run_by(t, xa, per, t->ep.rank, &lo, &hi);
    struct tensor *bufs[2] = {&t->model.params, &t->model.grads};
    for (int i = 0; i < 2; i++) {
      release_outside(t, bufs[i], xa, lo);
      release_outside(t, bufs[i], hi, xb);
    }
  }
}

int zero_init(struct trainer *t, struct rumor_err *e) {
  struct train_zero *z = &t->zero;
  struct model *m = &t->model;
  int rc;
  z->dp = *t->cfg.dp;
  z->rank = comm_rank(z->dp.comm);
  z->size = comm_size(z->dp.comm);
  for (int j = 0; j < z->size; j++) {
    int64_t hi;
    comm_chunk(m->nparams, z->size, j, &z->cut[j], &hi);
  }
  z->cut[z->size] = m->nparams;
  z->counts = xcalloc((size_t)z->size, sizeof *z->counts);
  z->counts2 = xcalloc((size_t)z->size, sizeof *z->counts2);
  int64_t most = 0; /* the largest range one collective moves */
  if (z->dp.zero <= 1) {
    most = m->nparams;
  } else {
    int64_t maxw = 0;
    const struct model_table *tab = model_own_table(m);
    for (int u = 0; u < tab->nunits; u++) {
      if (tab->unit_offset[u + 1] - tab->unit_offset[u] > most) most = tab->unit_offset[u + 1] - tab->unit_offset[u];
      if (u > 0 && model_act_width(m, u) > maxw) maxw = model_act_width(m, u);
    }
    if (tab->tied_entry >= 0 && tab->p[tab->tied_entry].numel > most) most = tab->p[tab->tied_entry].numel;
    int64_t shape[1] = {m->max_rows * (maxw > 0 ? maxw : 1)};
    for (int i = 0; i < 2; i++) {
      rc = tensor_alloc(&z->dbuf[i], t->be, TENSOR_F32, 1, shape, e);
      if (rc) return rumor_err_prefix(e, "ZeRO %d's per-unit gradient buffers", z->dp.zero);
    }
  }
  z->seg = z->dp.segment_floats > 0 ? z->dp.segment_floats : SEGMENT_FLOATS;
  if (most > z->seg) most = z->seg;
  if (!on_cpu(t) || z->dp.staged) {
    z->host_floats = most;
    for (int i = 0; i < 2; i++) {
      z->host[i] = tensor_host_alloc(t->be, (size_t)most * sizeof(float));
      z->out_ev[i] = tensor_event_create(t->be);
      z->back_ev[i] = tensor_event_create(t->be);
      if (!z->host[i] || !z->out_ev[i] || !z->back_ev[i])
        return rumor_err_set(e, -ENOMEM, "cannot allocate 2 x %lld floats of pinned staging (and its events) for "
                             "the group's collectives", (long long)most);
    }
  }
  if (m->ep && z->dp.zero >= 1) ep_aware_init(t);
  if (z->dp.zero >= 2) release_outside(t, &m->grads, 0, m->nparams);
  if (z->dp.zero == 3) release_outside(t, &m->params, 0, m->nparams);
  log_device_memory(t, "set up");
  return 0;
}

void zero_free(struct trainer *t) {
  struct train_zero *z = &t->zero;
  for (int i = 0; i < 2; i++) tensor_free(&z->dbuf[i]);
  for (int i = 0; i < 2; i++) {
    if (z->out_ev[i]) tensor_event_wait(z->out_ev[i]);
    if (z->back_ev[i]) tensor_event_wait(z->back_ev[i]);
    tensor_event_destroy(z->out_ev[i]);
    tensor_event_destroy(z->back_ev[i]);
    if (z->host[i]) tensor_host_free(t->be, z->host[i]);
  }
  free(z->counts);
  free(z->counts2);
  free(z->xbuf);
  memset(z, 0, sizeof *z);
}

/* ZeRO 2/3: forward one unit at a time (3: each unit's parameters gathered
 * before and given back after, but for the last unit's with `keep_last`:
 * a training step's backward starts with that unit, which then needs no
 * second all-gather of it, nor of a tied parameter it uses: GPT's head and
 * its token embedding). `rows` may be 0 (a member without rows in a short
 * batch still takes part in every collective). */
static int forward_units(struct trainer *t, int64_t rows, bool keep_last, struct rumor_err *e) {
  struct model *m = &t->model;
  bool z3 = t->zero.dp.zero == 3;
  int last = m->table.nunits - 1;
  for (int u = 0; u <= last; u++) {
    int rc = z3 ? gather_unit(t, u, e) : 0;
    if (rc) return rc;
    if (rows > 0) model_forward(m, u, u + 1, rows);
    if (z3 && !(keep_last && u == last)) release_unit(t, u);
  }
  return 0;
}

/* ZeRO 2/3: backward one unit at a time from the loss gradient in `dout`,
 * after forward_units(keep_last) (the last unit's parameters still
 * gathered); each unit's gradient is reduce-scattered as soon as it is
 * complete and the rest of its memory given back. Unit 0's is complete
 * last: the tied head adds to it (model.h, model_tied). */
static int backward_units(struct trainer *t, int64_t rows, struct tensor *dout, struct rumor_err *e) {
  struct model *m = &t->model;
  struct train_zero *z = &t->zero;
  bool z3 = z->dp.zero == 3;
  for (int u = m->table.nunits - 1, k = 0; u >= 0; u--, k ^= 1) {
    int rc = z3 && u < m->table.nunits - 1 ? gather_unit(t, u, e) : 0;
    if (rc == 0) rc = recommit_unit(t, &m->grads, u, e);
    if (rc) return rc;
    int64_t a, b;
    unit_range(m, u, &a, &b);
    if (rows > 0) {
      struct tensor *din = u > 0 ? &z->dbuf[k] : NULL;
      model_backward(m, u, u + 1, rows, dout, din, false);
      dout = din;
    } else {
      struct tensor g = tensor_view(&m->grads, a, 1, (int64_t[]){b - a});
      tensor_fill(&g, 0.0f);
      const struct model_param *tp = tied_user(m, u);
      if (tp) {
        struct tensor gt = tensor_view(&m->grads, tp->offset, 1, (int64_t[]){tp->numel});
        tensor_fill(&gt, 0.0f);
      }
    }
    if (z3) release_unit(t, u);
    if ((rc = collective_units(t, COLL_REDUCE_SCATTER, &m->grads, a, b, e))) return rc;
    release_outside(t, &m->grads, a, b);
  }
  return 0;
}

/* Copies this member's rows of the staged batch to the device. */
static void load_rows(struct trainer *t, const void *x, const int32_t *y, int64_t lo, int64_t n) {
  struct model *m = &t->model;
  if (n <= 0) return;
  size_t xb = t->data.x_bytes_per_row;
  int64_t ypr = t->data.y_per_row;
  tensor_copy_from_host(model_act(m, 0), 0, (const char *)x + (size_t)lo * xb, (size_t)n * xb);
  tensor_copy_from_host(&m->labels, 0, y + lo * ypr, (size_t)(n * ypr) * sizeof(int32_t));
}

int zero_step(struct trainer *t, double lr, int64_t rows, const void *x, const int32_t *y, double *loss,
              struct rumor_err *e) {
  struct model *m = &t->model;
  struct train_zero *z = &t->zero;
  int U = m->table.nunits, rc;
  int64_t lo, hi;
  my_rows(z, rows, &lo, &hi);
  int64_t n = hi - lo;
  load_rows(t, x, y, lo, n);
  /* Each member scales its gradient by 1 / the whole batch's targets, so
   * that the members' sum is the batch's mean gradient. */
  float scale = 1.0f / (float)model_targets(m, rows);
  struct tensor *logits = model_act(m, U);
  if (z->dp.zero <= 1) {
    if (n > 0) {
      model_forward(m, 0, U, n);
      model_loss(m, n, logits, scale);
      model_backward(m, 0, U, n, logits, NULL, false);
    } else {
      tensor_fill(&m->grads, 0.0f);
    }
  } else {
    if ((rc = forward_units(t, n, true, e))) return rc;
    log_device_memory(t, "forward");
    if (n > 0) model_loss(m, n, logits, scale);
    if ((rc = backward_units(t, n, logits, e))) return rc;
    log_device_memory(t, "backward");
  }
  if ((rc = group_pass_failed(t, e))) return rc;
  /* The batch's loss: the members' summed losses over its targets. */
  float part = n > 0 ? model_mean_loss(m, n) * (float)model_targets(m, n) : 0.0f;
  if ((rc = comm_all_reduce(z->dp.comm, &part, 1, e))) return rc;
  *loss = (double)part / (double)model_targets(m, rows);
  return zero_update(t, lr, rows, e);
}

int zero_update(struct trainer *t, double lr, int64_t rows, struct rumor_err *e) {
  struct model *m = &t->model;
  struct train_zero *z = &t->zero;
  int rc;
  int64_t plo = z->cut[z->rank], pn = z->cut[z->rank + 1] - plo;
  if (z->dp.zero == 0) {
    if ((rc = collective(t, COLL_ALL_REDUCE, &m->grads, 0, m->nparams, e))) return rc;
    if (t->reducer.reduce) { /* each member's piece averaged between groups, then every piece everywhere again */
      if ((rc = group_reduce_between(t, rows, e))) return rc;
      if ((rc = collective(t, COLL_ALL_GATHER, &m->grads, 0, m->nparams, e))) return rc;
    }
    /* Every member holds the whole sum: the norm is this member's buffer's
     * (its tensor-parallel ranks' together). */
    if ((rc = group_clip(t, 0, m->nparams, t->cfg.tp ? t->cfg.tp->comm : NULL, e))) return rc;
    optim_apply(&t->optim, &m->params, &m->grads, lr);
  } else {
    if (z->dp.zero == 1 && (rc = collective_units(t, COLL_REDUCE_SCATTER, &m->grads, 0, m->nparams, e))) return rc;
    if (t->reducer.reduce && (rc = group_reduce_between(t, rows, e))) return rc;
    if ((rc = group_clip(t, plo, plo + pn, t->cfg.tp ? t->cfg.tp->all : z->dp.comm, e))) return rc;
    struct tensor p = tensor_view(&m->params, plo, 1, &pn), g = tensor_view(&m->grads, plo, 1, &pn);
    if (pn > 0) optim_apply(&t->optim, &p, &g, lr);
    else t->optim.step++;
    if (z->dp.zero <= 2 && z->dp.lazy_gather) z->partial = true; /* trainer_group_resync gathers */
    else if (z->dp.zero <= 2 && (rc = collective_units(t, COLL_ALL_GATHER, &m->params, 0, m->nparams, e))) return rc;
  }
  tensor_backend_sync(t->be);
  return 0;
}

int zero_evaluate(struct trainer *t, int64_t rows, const void *x, const int32_t *y, int64_t *correct, double *loss,
                  struct rumor_err *e) {
  struct model *m = &t->model;
  struct train_zero *z = &t->zero;
  int64_t lo, hi;
  my_rows(z, rows, &lo, &hi);
  int64_t n = hi - lo;
  /* An expert-parallel member without rows of this batch still runs the
   * passes' exchanges: on one padding row (the batch's first) that it
   * routes nowhere and does not score. */
  bool ghost = n == 0 && m->ep;
  load_rows(t, x, y, ghost ? 0 : lo, ghost ? 1 : n);
  if (ghost) t->ep.ghost = true;
  int rc;
  if (z->dp.zero == 3) {
    rc = forward_units(t, ghost ? 1 : n, false, e);
  } else {
    if (n > 0 || ghost) model_forward(m, 0, m->table.nunits, ghost ? 1 : n);
    rc = 0;
  }
  t->ep.ghost = false;
  if (rc) return rc;
  int64_t c = 0;
  double l = 0;
  if (n > 0) model_score(m, n, y + lo * t->data.y_per_row, &c, &l);
  if ((rc = group_pass_failed(t, e))) return rc;
  float sums[2] = {(float)c, (float)l}; /* c <= a batch's targets: exact in a float */
  if ((rc = comm_all_reduce(z->dp.comm, sums, 2, e))) return rc;
  *correct += (int64_t)sums[0];
  *loss += (double)sums[1];
  return 0;
}

/* Sends this member's piece of `src` (a device tensor: `per` floats per
 * member piece, starting at element `base`) to member 0, which receives
 * every member's into dst[0..P) (dst is NULL elsewhere): an all-to-all in
 * which only member 0 receives, so only it holds the whole buffer. */
static int gather_to_first(struct trainer *t, const struct tensor *src, int64_t base, bool whole, float *dst,
                           struct rumor_err *e) {
  struct train_zero *z = &t->zero;
  int64_t plo = z->cut[z->rank], pn = z->cut[z->rank + 1] - plo;
  float *mine = xmalloc((size_t)(pn > 0 ? pn : 1) * sizeof(float));
  /* `whole`: src holds every position (parameters, ZeRO 0's state) and this
   * member's piece is at plo; else src holds the piece alone. */
  if (pn > 0) tensor_copy_to_host(src, base + (whole ? plo : 0), mine, (size_t)pn * sizeof(float));
  int rc = zero_gather_host(t, mine, dst, e);
  free(mine);
  return rc;
}

int zero_gather_host(struct trainer *t, const float *mine, float *dst, struct rumor_err *e) {
  struct train_zero *z = &t->zero;
  for (int j = 0; j < z->size; j++) z->counts[j] = z->cut[j + 1] - z->cut[j];
  return comm_gather_v(z->dp.comm, 0, mine, z->counts[z->rank], dst, z->counts, e);
}

int zero_gather_local(struct trainer *t, float *local, struct rumor_err *e) {
  struct model *m = &t->model;
  struct train_zero *z = &t->zero;
  int64_t P = m->nparams, per = t->optim.nparams;
  int parts = optim_state_per_param(t->optim.cfg.kind);
  RUMOR_ASSERT((z->rank == 0) == (local != NULL));
  int rc = gather_to_first(t, &m->params, 0, true, local, e);
  for (int s = 0; rc == 0 && s < parts; s++)
    rc = gather_to_first(t, &t->optim.state, (int64_t)s * per, z->dp.zero == 0, local ? local + P * (1 + s) : NULL, e);
  return rc;
}

int zero_gather_params(struct trainer *t, struct rumor_err *e) {
  RUMOR_ASSERT(t->zero.dp.zero <= 2);
  int rc = collective_units(t, COLL_ALL_GATHER, &t->model.params, 0, t->model.nparams, e);
  if (rc == 0) t->zero.partial = false;
  return rc;
}

int zero_gather_state(struct trainer *t, struct rumor_err *e) {
  RUMOR_ASSERT(t->zero.dp.zero == 0 && t->optim.nparams == t->model.nparams);
  int parts = optim_state_per_param(t->optim.cfg.kind), rc = 0;
  int64_t n = t->model.nparams;
  for (int s = 0; rc == 0 && s < parts; s++) {
    struct tensor part = tensor_view(&t->optim.state, (int64_t)s * n, 1, &n);
    rc = collective(t, COLL_ALL_GATHER, &part, 0, n, e);
  }
  return rc;
}

void zero_piece(const struct train_dp *dp, int64_t n, int64_t *lo, int64_t *hi) {
  comm_chunk(n, comm_size(dp->comm), comm_rank(dp->comm), lo, hi);
}
