/* One stage's micro-batch schedule: passes, activation slots, transfers. */
#include "peer/pipeline/pipeline.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

static bool first_stage(const struct pipeline *p) { return p->stage == 0; }
static bool last_stage(const struct pipeline *p) { return p->stage == p->stages - 1; }

static struct tensor rows_of(const struct tensor *t, int64_t rows, int64_t cols) {
  int64_t shape[2] = {rows, cols};
  return tensor_view(t, 0, 2, shape);
}

/* ---- slots ---- */

static void slot_free(struct pipeline *p, struct pipe_slot *s) {
  for (int i = 0; i < p->m->nstash; i++) tensor_free(&s->t[i]);
}

/* A new slot: tensors shaped like the model's stash. */
static int slot_alloc(struct pipeline *p, struct pipe_slot *s, struct rumor_err *e) {
  memset(s, 0, sizeof *s);
  const struct model *m = p->m;
  for (int i = 0; i < m->nstash; i++) {
    const struct tensor *like = &p->slots[0].t[i];
    int rc = tensor_alloc(&s->t[i], m->be, like->dtype, like->ndim, like->shape, e);
    if (rc) {
      slot_free(p, s);
      return rumor_err_prefix(e, "activations of micro-batch slot %d", p->nslots);
    }
  }
  return 0;
}

static size_t slot_bytes(const struct pipeline *p) {
  size_t b = 0;
  for (int i = 0; i < p->m->nstash; i++) b += tensor_nbytes(&p->slots[0].t[i]);
  return b;
}

/* Points the model's stash at slot k (non-owning views). */
static void bind_slot(struct pipeline *p, int k) {
  struct model *m = p->m;
  for (int i = 0; i < m->nstash; i++) {
    *m->stash[i] = p->slots[k].t[i];
    m->stash[i]->owner = false;
  }
}

/* A free slot for micro-batch mb, allocating one when every slot is busy. */
static int take_slot(struct pipeline *p, int mb, struct rumor_err *e) {
  int k = 0;
  while (k < p->nslots && p->slots[k].busy) k++;
  if (k == p->nslots) {
    RUMOR_ASSERT(p->nslots < p->micro);
    int rc = slot_alloc(p, &p->slots[k], e);
    if (rc) return rc;
    p->nslots++;
  }
  p->slots[k].busy = true;
  p->slot_of[mb] = k;
  return k;
}

static void give_slot(struct pipeline *p, int mb) {
  p->slots[p->slot_of[mb]].busy = false;
  p->slot_of[mb] = -1;
}

/* ---- set-up ---- */

int pipeline_init(struct pipeline *p, struct model *m, stage_link_t *link, int stage, int stages, int micro,
                  enum pipe_schedule sched, struct rumor_err *e) {
  memset(p, 0, sizeof *p);
  RUMOR_ASSERT(micro >= 1 && micro <= PIPE_MAX_MICRO && 0 <= stage && stage < stages);
  p->m = m;
  p->link = link;
  p->stage = stage;
  p->stages = stages;
  p->micro = micro;
  p->sched = sched;
  p->mb_rows = m->max_rows;
  p->u0 = m->u0;
  p->u1 = m->u1;
  p->in_width = model_act_width(m, p->u0);
  p->out_width = model_act_width(m, p->u1);
  p->actions = xmalloc((size_t)(2 * micro) * sizeof *p->actions);
  p->slot_of = xmalloc((size_t)micro * sizeof *p->slot_of);
  for (int i = 0; i < micro; i++) p->slot_of[i] = -1;
  p->slots = xcalloc((size_t)micro, sizeof *p->slots);
  /* Slot 0 is the model's own stash; the model keeps non-owning views. */
  for (int i = 0; i < m->nstash; i++) {
    p->slots[0].t[i] = *m->stash[i];
    m->stash[i]->owner = false;
  }
  p->nslots = 1;
  int64_t ds[2] = {p->mb_rows, p->in_width}, os[2] = {p->mb_rows, p->out_width};
  int rc;
  if ((rc = tensor_alloc(&p->din, m->be, TENSOR_F32, 2, ds, e)) || (rc = tensor_alloc(&p->dout, m->be, TENSOR_F32, 2, os, e)))
    goto fail;
  int64_t w = p->in_width > p->out_width ? p->in_width : p->out_width;
  size_t hb = (size_t)(p->mb_rows * w) * sizeof(float);
  size_t xb = (size_t)(p->mb_rows * m->io.input_per_row) * tensor_dtype_size(m->io.input_dtype);
  p->host = tensor_host_alloc(m->be, hb);
  p->eval_x = tensor_host_alloc(m->be, xb);
  p->labels = tensor_host_alloc(m->be, (size_t)model_targets(m, p->mb_rows) * sizeof(int32_t));
  if (!p->host || !p->eval_x || !p->labels) {
    rc = rumor_err_set(e, -ENOMEM, "cannot allocate %zu bytes of host staging", hb + xb);
    goto fail;
  }
  p->tied_floats = pipeline_tied_floats(m, stages);
  if (p->tied_floats > 0 && (first_stage(p) || last_stage(p))) {
    p->tied_host = tensor_host_alloc(m->be, (size_t)p->tied_floats * sizeof(float));
    if (!p->tied_host) {
      rc = rumor_err_set(e, -ENOMEM, "cannot allocate the tied parameter's host staging");
      goto fail;
    }
    if (first_stage(p) && (rc = tensor_alloc(&p->tied_dev, m->be, TENSOR_F32, 1, &p->tied_floats, e))) goto fail;
  }
  p->st.slots = 1;
  p->st.slot_bytes = slot_bytes(p);
  return 0;
fail:
  pipeline_free(p);
  return rc;
}

void pipeline_free(struct pipeline *p) {
  if (!p->m) return;
  /* Give the model back its own stash (slot 0), as owner. */
  for (int i = 0; i < p->m->nstash; i++) *p->m->stash[i] = p->slots[0].t[i];
  for (int k = 1; k < p->nslots; k++) slot_free(p, &p->slots[k]);
  tensor_free(&p->din);
  tensor_free(&p->dout);
  tensor_host_free(p->m->be, p->host);
  tensor_host_free(p->m->be, p->eval_x);
  tensor_host_free(p->m->be, p->labels);
  tensor_host_free(p->m->be, p->tied_host);
  tensor_free(&p->tied_dev);
  free(p->actions);
  free(p->slot_of);
  free(p->slots);
  memset(p, 0, sizeof *p);
}

int pipeline_micro_count(int64_t rows, int micro) { return rows < micro ? (int)rows : micro; }

void pipeline_micro_rows(int64_t rows, int micro, int i, int64_t *offset, int64_t *count) {
  int64_t n = pipeline_micro_count(rows, micro);
  int64_t base = rows / n, extra = rows % n;
  *count = base + (i < extra ? 1 : 0);
  *offset = i * base + (i < extra ? i : extra);
}

/* ---- the tied parameter ----
 * A model whose last unit uses an entry of unit 0 (model_tied: GPT's token
 * embedding, which its head multiplies by) has that entry on stage 0 and a
 * copy of it on the last stage. Before passes that use the copy, stage 0
 * sends its value down the pipeline; after a step's backward passes, the
 * last stage sends the copy's gradient up, and stage 0 adds it to the
 * entry's, so the update is the single-process one. Stages between relay
 * both unchanged. Tags: (step, 0) before a step, (evaluation, 1) before an
 * evaluation, (step, 0) for the gradient. */

int64_t pipeline_tied_floats(const struct model *m, int stages) {
  /* A tensor-parallel rank's: its slice of the entry (its vocabulary rows). */
  const struct model_table *tab = model_own_table(m);
  int k = tab->tied_entry;
  return stages > 1 && k >= 0 ? tab->p[k].numel : 0;
}

/* Waits for a one-row transfer (kind, tag, mb) from the neighbour in
 * `from` (*data: malloc'd), counting the wait in the step's. */
static int recv_row(struct pipeline *p, enum stage_link_dir from, enum stage_link_kind kind, int64_t tag, int32_t mb,
                    float **data, struct rumor_err *e) {
  int64_t rows;
  double waited;
  int rc = stage_link_recv(p->link, from, kind, tag, mb, data, &rows, &waited, e);
  p->cur_wait += waited;
  return rc;
}

/* Receives a tied transfer from the neighbour in `from` and passes it on to
 * the other side (a stage between), or hands it to the caller (*out,
 * malloc'd, when out is not NULL). */
static int tied_recv(struct pipeline *p, enum stage_link_dir from, enum stage_link_kind kind, int64_t tag, int32_t mb,
                     float **out, struct rumor_err *e) {
  float *data;
  int rc = recv_row(p, from, kind, tag, mb, &data, e);
  if (rc) return rc;
  if (out) {
    *out = data;
    return 0;
  }
  enum stage_link_dir to = from == STAGE_LINK_PREV ? STAGE_LINK_NEXT : STAGE_LINK_PREV;
  rc = stage_link_send(p->link, to, kind, tag, mb, 1, data, e);
  free(data);
  return rc;
}

static int tied_value(struct pipeline *p, int64_t tag, int32_t mb, struct rumor_err *e) {
  if (p->tied_floats == 0) return 0;
  struct model *m = p->m;
  size_t bytes = (size_t)p->tied_floats * sizeof(float);
  if (first_stage(p)) {
    const struct model_param *ent = &model_own_table(m)->p[model_own_table(m)->tied_entry];
    tensor_copy_to_host(&m->params, ent->offset - m->param_base, p->tied_host, bytes);
    return stage_link_send(p->link, STAGE_LINK_NEXT, STAGE_LINK_TIED_PARAM, tag, mb, 1, p->tied_host, e);
  }
  if (!last_stage(p)) return tied_recv(p, STAGE_LINK_PREV, STAGE_LINK_TIED_PARAM, tag, mb, NULL, e);
  float *data;
  int rc = tied_recv(p, STAGE_LINK_PREV, STAGE_LINK_TIED_PARAM, tag, mb, &data, e);
  if (rc) return rc;
  struct tensor *copy, *grad;
  RUMOR_ASSERT(model_tied(m, &copy, &grad));
  tensor_copy_from_host(copy, 0, data, bytes);
  free(data);
  return 0;
}

static int tied_gradient(struct pipeline *p, int64_t step, struct rumor_err *e) {
  if (p->tied_floats == 0) return 0;
  struct model *m = p->m;
  size_t bytes = (size_t)p->tied_floats * sizeof(float);
  if (last_stage(p)) {
    struct tensor *copy, *grad;
    RUMOR_ASSERT(model_tied(m, &copy, &grad));
    tensor_copy_to_host(grad, 0, p->tied_host, bytes);
    return stage_link_send(p->link, STAGE_LINK_PREV, STAGE_LINK_TIED_GRAD, step, 0, 1, p->tied_host, e);
  }
  if (!first_stage(p)) return tied_recv(p, STAGE_LINK_NEXT, STAGE_LINK_TIED_GRAD, step, 0, NULL, e);
  float *data;
  int rc = tied_recv(p, STAGE_LINK_NEXT, STAGE_LINK_TIED_GRAD, step, 0, &data, e);
  if (rc) return rc;
  const struct model_param *ent = &model_own_table(m)->p[model_own_table(m)->tied_entry];
  struct tensor g = tensor_view(&m->grads, ent->offset - m->param_base, 1, &ent->numel);
  tensor_copy_from_host(&p->tied_dev, 0, data, bytes);
  free(data);
  tensor_axpby(1.0f, &p->tied_dev, 1.0f, &g);
  return 0;
}

/* ---- agreements ---- */

static int agree_recv(struct pipeline *p, enum stage_link_dir from, int64_t seq, int32_t leg, float *v, int n,
                      pipe_combine_fn combine, struct rumor_err *e) {
  float *data;
  int rc = recv_row(p, from, STAGE_LINK_AGREE, seq, leg, &data, e);
  if (rc) return rc;
  if (combine) combine(data, v, n); /* up: the stages before us, then ours */
  memcpy(v, data, (size_t)n * sizeof(float));
  free(data);
  return 0;
}

int pipeline_agree(struct pipeline *p, int64_t seq, float *v, int n, pipe_combine_fn combine, struct rumor_err *e) {
  RUMOR_ASSERT(n >= 1 && n <= STAGE_LINK_AGREE_FLOATS);
  if (p->stages == 1) return 0;
  float row[STAGE_LINK_AGREE_FLOATS] = {0};
  int rc;
  /* Leg 0 up the links (folding), leg 1 back down (the result). */
  if (!first_stage(p) && (rc = agree_recv(p, STAGE_LINK_PREV, seq, 0, v, n, combine, e))) return rc;
  if (!last_stage(p)) {
    memcpy(row, v, (size_t)n * sizeof(float));
    if ((rc = stage_link_send(p->link, STAGE_LINK_NEXT, STAGE_LINK_AGREE, seq, 0, 1, row, e))) return rc;
    if ((rc = agree_recv(p, STAGE_LINK_NEXT, seq, 1, v, n, NULL, e))) return rc;
  }
  if (first_stage(p)) return 0;
  memcpy(row, v, (size_t)n * sizeof(float));
  return stage_link_send(p->link, STAGE_LINK_PREV, STAGE_LINK_AGREE, seq, 1, 1, row, e);
}

/* ---- one step ---- */

/* Fills the bound slot's input of unit u0 with micro-batch rows: from the
 * batch on stage 0 (x_host, the model's input dtype), else from the
 * previous stage. */
static int load_input(struct pipeline *p, enum stage_link_kind kind, int64_t tag, int32_t mb, const void *x_host,
                      int64_t off, int64_t r, struct rumor_err *e) {
  struct model *m = p->m;
  struct tensor *in = model_act(m, p->u0);
  if (first_stage(p)) {
    size_t row_bytes = (size_t)p->in_width * tensor_dtype_size(in->dtype);
    tensor_copy_from_host(in, 0, (const uint8_t *)x_host + (size_t)off * row_bytes, (size_t)r * row_bytes);
    return 0;
  }
  float *data;
  int64_t got;
  double waited;
  int rc = stage_link_recv(p->link, STAGE_LINK_PREV, kind, tag, mb, &data, &got, &waited, e);
  if (kind == STAGE_LINK_ACT) p->cur_wait += waited;
  if (rc) return rc;
  if (got != r) {
    free(data);
    return rumor_err_set(e, RUMOR_EPROTO, "stage %d/%d sent %lld rows for micro-batch %d, expected %lld", p->stage - 1,
                         p->stages, (long long)got, mb, (long long)r);
  }
  tensor_copy_from_host(in, 0, data, (size_t)(r * p->in_width) * sizeof(float));
  free(data);
  return 0;
}

/* Sends the bound slot's output of unit u1 − 1 to the next stage. */
static int send_output(struct pipeline *p, enum stage_link_kind kind, int64_t tag, int32_t mb, int64_t r,
                       struct rumor_err *e) {
  tensor_copy_to_host(model_act(p->m, p->u1), 0, p->host, (size_t)(r * p->out_width) * sizeof(float));
  return stage_link_send(p->link, STAGE_LINK_NEXT, kind, tag, mb, r, p->host, e);
}

static int forward(struct pipeline *p, int64_t step, int mb, int64_t rows, int64_t loss_rows, const void *x_host,
                   const int32_t *y_host, double *loss_sum, struct rumor_err *e) {
  struct model *m = p->m;
  int64_t off, r;
  pipeline_micro_rows(rows, p->micro, mb, &off, &r);
  int k = take_slot(p, mb, e);
  if (k < 0) return k;
  bind_slot(p, k);
  int rc = load_input(p, STAGE_LINK_ACT, step, mb, x_host, off, r, e);
  if (rc) return rc;
  model_forward(m, p->u0, p->u1, r);
  if (!last_stage(p)) return send_output(p, STAGE_LINK_ACT, step, mb, r, e);
  /* The loss gradient replaces the logits in the slot (they are not needed
   * again); scaled by the whole batch's targets, as a single process does. */
  int64_t per = m->io.labels_per_row, n = model_targets(m, r);
  tensor_copy_from_host(&m->labels, 0, y_host + off * per, (size_t)n * sizeof(int32_t));
  model_loss(m, r, model_act(m, p->u1), 1.0f / (float)model_targets(m, loss_rows));
  struct tensor losses = tensor_view(&m->losses, 0, 1, &n);
  *loss_sum += tensor_sum(&losses);
  return 0;
}

static int backward(struct pipeline *p, int64_t step, int mb, int64_t rows, int64_t loss_rows, bool accumulate,
                    struct rumor_err *e) {
  struct model *m = p->m;
  int64_t off, r;
  pipeline_micro_rows(rows, p->micro, mb, &off, &r);
  RUMOR_ASSERT(p->slot_of[mb] >= 0);
  bind_slot(p, p->slot_of[mb]);
  struct tensor *dout = model_act(m, p->u1); /* the last stage's loss gradient */
  if (!last_stage(p)) {
    float *data;
    int64_t got;
    double waited;
    int rc = stage_link_recv(p->link, STAGE_LINK_NEXT, STAGE_LINK_GRAD, step, mb, &data, &got, &waited, e);
    p->cur_wait += waited;
    if (rc) return rc;
    if (got != r) {
      free(data);
      return rumor_err_set(e, RUMOR_EPROTO, "stage %d/%d sent %lld gradient rows for micro-batch %d, expected %lld",
                           p->stage + 1, p->stages, (long long)got, mb, (long long)r);
    }
    tensor_copy_from_host(&p->dout, 0, data, (size_t)(r * p->out_width) * sizeof(float));
    free(data);
    dout = &p->dout;
  }
  /* Every stage scales as the last stage's loss did (a mixture of
   * experts' auxiliary losses, wherever its blocks are): by the whole
   * batch's targets, a data-parallel member's too. */
  model_set_loss_scale(m, 1.0f / (float)model_targets(m, loss_rows));
  model_backward(m, p->u0, p->u1, r, dout, first_stage(p) ? NULL : &p->din, accumulate);
  give_slot(p, mb);
  if (first_stage(p)) return 0;
  struct tensor din = rows_of(&p->din, r, p->in_width);
  tensor_copy_to_host(&din, 0, p->host, (size_t)(r * p->in_width) * sizeof(float));
  return stage_link_send(p->link, STAGE_LINK_PREV, STAGE_LINK_GRAD, step, mb, r, p->host, e);
}

int pipeline_step(struct pipeline *p, int64_t step, int64_t rows, int64_t loss_rows, const void *x_host,
                  const int32_t *y_host, double *loss_sum, struct rumor_err *e) {
  RUMOR_ASSERT(rows >= 1 && rows <= p->mb_rows * p->micro && loss_rows >= rows);
  RUMOR_ASSERT((x_host != NULL) == first_stage(p) && (y_host != NULL) == last_stage(p));
  double t0 = clock_now_s();
  p->cur_wait = 0;
  int n = pipeline_micro_count(rows, p->micro);
  pipe_schedule_actions(p->sched, p->stages, p->stage, n, p->actions);
  double loss = 0;
  bool accumulate = false;
  int rc = tied_value(p, step, 0, e);
  for (int a = 0; a < 2 * n && rc == 0; a++) {
    const struct pipe_action *act = &p->actions[a];
    if (act->op == PIPE_F) {
      rc = forward(p, step, act->mb, rows, loss_rows, x_host, y_host, &loss, e);
    } else {
      rc = backward(p, step, act->mb, rows, loss_rows, accumulate, e);
      accumulate = true;
    }
  }
  if (rc == 0) rc = tied_gradient(p, step, e);
  tensor_backend_sync(p->m->be);
  if (p->nslots > p->st.slots) p->st.slots = p->nslots;
  for (int i = 0; i < p->micro; i++) /* a failed step leaves slots taken */
    if (p->slot_of[i] >= 0) give_slot(p, i);
  if (rc) return rc;
  if (loss_sum) *loss_sum = loss;
  /* The first step warms up (kernels, connections, page faults): not timed. */
  if (p->steps_run++ >= 1) {
    p->st.steps++;
    p->st.step_s += clock_now_s() - t0;
    p->st.wait_s += p->cur_wait;
  }
  return 0;
}

/* ---- evaluation ---- */

int pipeline_eval(struct pipeline *p, int64_t count, int64_t chunks, pipe_gather_fn gather, void *arg,
                  int64_t *correct, double *loss_sum, struct rumor_err *e) {
  struct model *m = p->m;
  int64_t tag = p->evals++;
  /* Stage 0 needs the inputs, the last stage the labels; the gather makes both. */
  bool need = first_stage(p) || last_stage(p);
  bind_slot(p, 0);
  int rc = tied_value(p, tag, 1, e);
  int64_t own = (count + p->mb_rows - 1) / p->mb_rows;
  RUMOR_ASSERT(chunks <= own || m->ep); /* padding passes are an expert-parallel model's */
  for (int32_t chunk = 0; rc == 0 && (chunk < own || chunk < chunks); chunk++) {
    int64_t first = chunk * p->mb_rows, r = count - first < p->mb_rows ? count - first : p->mb_rows;
    bool pad = chunk >= own;
    if (pad) { /* one row of zeros (token 0, or a black image), routed nowhere and not scored */
      r = 1;
      memset(p->eval_x, 0, (size_t)p->in_width * tensor_dtype_size(model_act(m, p->u0)->dtype));
    } else if (need) {
      gather(arg, first, r, p->eval_x, p->labels);
    }
    if ((rc = load_input(p, STAGE_LINK_EVAL, tag, chunk, p->eval_x, 0, r, e))) break;
    if (pad) m->ep->ghost = true;
    model_forward(m, p->u0, p->u1, r);
    if (pad) m->ep->ghost = false;
    if (!last_stage(p)) {
      rc = send_output(p, STAGE_LINK_EVAL, tag, chunk, r, e);
    } else if (!pad) {
      tensor_copy_from_host(&m->labels, 0, p->labels, (size_t)model_targets(m, r) * sizeof(int32_t));
      model_score(m, r, p->labels, correct, loss_sum);
    }
  }
  return rc;
}
