/* Backend selection, tensor bookkeeping and op dispatch with shape checks. */
#include "tensor/tensor_impl.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t tensor_dtype_size(enum tensor_dtype dt) {
  switch (dt) {
  case TENSOR_F32: return 4;
  case TENSOR_I32: return 4;
  case TENSOR_F16: return 2;
  case TENSOR_BF16: return 2;
  }
  return 0;
}

const char *tensor_dtype_name(enum tensor_dtype dt) {
  switch (dt) {
  case TENSOR_F32: return "F32";
  case TENSOR_I32: return "I32";
  case TENSOR_F16: return "F16";
  case TENSOR_BF16: return "BF16";
  }
  return "?";
}

/* ---- backends ---- */

bool tensor_cuda_compiled(void) {
#ifdef RUMOR_HAVE_CUDA
  return true;
#else
  return false;
#endif
}

int tensor_cuda_device_count(void) {
#ifdef RUMOR_HAVE_CUDA
  return tensor_cuda_count();
#else
  return 0;
#endif
}

/* Set once the "no GPU, using the CPU" notice has been logged (process-wide
 * so that several backends opened with "auto" say it once). */
static atomic_bool g_fallback_logged;

int tensor_backend_open(const char *spec, tensor_backend_t *out, struct rumor_err *e) {
  *out = NULL;
  if (!spec || strcmp(spec, "auto") == 0) {
#ifdef RUMOR_HAVE_CUDA
    if (tensor_cuda_device_count() > 0) {
      struct rumor_err ce;
      if (tensor_cuda_open(0, out, &ce) == 0) return 0;
      /* A GPU is there but unusable (no cuBLAS library, no kernels for its
       * architecture, no memory left, ...): say why, once, then train on
       * the CPU. */
      if (!atomic_exchange(&g_fallback_logged, true))
        log_warn("cannot use CUDA device 0 (%s); using the CPU backend", ce.msg);
      return tensor_cpu_open(out, e);
    }
#endif
    if (!atomic_exchange(&g_fallback_logged, true)) {
      if (tensor_cuda_compiled())
        log_info("no usable CUDA GPU found; using the CPU backend");
      else
        log_info("built without CUDA; using the CPU backend");
    }
    return tensor_cpu_open(out, e);
  }
  if (strcmp(spec, "cpu") == 0) return tensor_cpu_open(out, e);
  if (STR_PREFIX(spec, "cuda")) {
    int64_t dev = 0;
    const char *rest = spec + STR_LEN("cuda");
    if (*rest == ':') {
      if (parse_i64(rest + 1, 0, 1023, &dev) != 0)
        return rumor_err_set(e, RUMOR_EFORMAT, "unknown device '%s': expected cuda:N with N a device number", spec);
    } else if (*rest != '\0') {
      return rumor_err_set(e, RUMOR_EFORMAT, "unknown device '%s' (expected cpu, cuda, cuda:N or auto)", spec);
    }
    if (!tensor_cuda_compiled())
      return rumor_err_set(e, RUMOR_EDEVICE, "device '%s' requested but this rumor was built without CUDA", spec);
    int count = tensor_cuda_device_count();
    if (dev >= count)
      return rumor_err_set(e, RUMOR_EDEVICE, "device '%s' requested but %d CUDA device%s usable", spec, count,
                           count == 1 ? " is" : "s are");
#ifdef RUMOR_HAVE_CUDA
    return tensor_cuda_open((int)dev, out, e);
#endif
  }
  return rumor_err_set(e, RUMOR_EFORMAT, "unknown device '%s' (expected cpu, cuda, cuda:N or auto)", spec);
}

void tensor_backend_close(tensor_backend_t be) {
  if (be) be->ops->close(be);
}
enum tensor_device tensor_backend_device(tensor_backend_t be) { return be->device; }
const char *tensor_backend_name(tensor_backend_t be) { return be->name; }
void tensor_backend_set_threads(tensor_backend_t be, int threads) {
  if (be->ops->set_threads) be->ops->set_threads(be, threads < 1 ? 1 : threads);
}
void tensor_backend_set_tf32(tensor_backend_t be, bool on) {
  if (be->ops->set_tf32) be->ops->set_tf32(be, on);
}
void tensor_backend_sync(tensor_backend_t be) { be->ops->sync(be); }

/* ---- memory ---- */

int64_t tensor_numel(const struct tensor *t) {
  int64_t n = 1;
  for (int i = 0; i < t->ndim; i++) n *= t->shape[i];
  return n;
}

size_t tensor_nbytes(const struct tensor *t) { return (size_t)tensor_numel(t) * tensor_dtype_size(t->dtype); }

static void set_shape(struct tensor *t, int ndim, const int64_t *shape) {
  RUMOR_ASSERT(ndim >= 1 && ndim <= TENSOR_MAX_DIMS);
  t->ndim = ndim;
  for (int i = 0; i < TENSOR_MAX_DIMS; i++) {
    t->shape[i] = i < ndim ? shape[i] : 1;
    RUMOR_ASSERT(t->shape[i] >= 0);
  }
}

int tensor_alloc(struct tensor *t, tensor_backend_t be, enum tensor_dtype dt, int ndim,
                 const int64_t *shape, struct rumor_err *e) {
  memset(t, 0, sizeof *t);
  set_shape(t, ndim, shape);
  t->dtype = dt;
  t->be = be;
  size_t bytes = tensor_nbytes(t);
  t->data = be->ops->mem_alloc(be, bytes);
  if (!t->data) {
    memset(t, 0, sizeof *t);
    return rumor_err_set(e, be->device == TENSOR_DEVICE_CPU ? -ENOMEM : RUMOR_EDEVICE,
                         "cannot allocate %.1f MiB on %s", (double)bytes / (1 << 20), be->name);
  }
  t->owner = true;
  return 0;
}

void tensor_free(struct tensor *t) {
  if (t->owner && t->data) t->be->ops->mem_free(t->be, t->data);
  memset(t, 0, sizeof *t);
}

struct tensor tensor_view(const struct tensor *base, int64_t offset, int ndim, const int64_t *shape) {
  struct tensor v;
  memset(&v, 0, sizeof v);
  set_shape(&v, ndim, shape);
  v.dtype = base->dtype;
  v.be = base->be;
  RUMOR_ASSERT(offset >= 0 && offset + tensor_numel(&v) <= tensor_numel(base));
  v.data = (char *)base->data + (size_t)offset * tensor_dtype_size(base->dtype);
  v.owner = false;
  return v;
}

struct tensor tensor_flat(const struct tensor *t) {
  int64_t n = tensor_numel(t);
  return tensor_view(t, 0, 1, &n);
}

void *tensor_host_alloc(tensor_backend_t be, size_t bytes) { return be->ops->host_alloc(be, bytes); }
void tensor_host_free(tensor_backend_t be, void *p) {
  if (p) be->ops->host_free(be, p);
}

static char *elem_ptr(const struct tensor *t, int64_t offset, size_t bytes) {
  RUMOR_ASSERT(offset >= 0);
  size_t start = (size_t)offset * tensor_dtype_size(t->dtype);
  RUMOR_ASSERT(start + bytes <= tensor_nbytes(t));
  return (char *)t->data + start;
}

bool tensor_backend_mem_info(tensor_backend_t be, size_t *free_bytes, size_t *total_bytes) {
  if (!be->ops->mem_info) return false;
  be->ops->mem_info(be, free_bytes, total_bytes);
  return true;
}

void tensor_copy_from_host(struct tensor *dst, int64_t offset, const void *host, size_t bytes) {
  dst->be->ops->copy_h2d(dst->be, elem_ptr(dst, offset, bytes), host, bytes, false);
}
void tensor_copy_to_host(const struct tensor *src, int64_t offset, void *host, size_t bytes) {
  src->be->ops->copy_d2h(src->be, host, elem_ptr(src, offset, bytes), bytes, false);
}
void tensor_copy_from_host_async(struct tensor *dst, int64_t offset, const void *host, size_t bytes) {
  dst->be->ops->copy_h2d(dst->be, elem_ptr(dst, offset, bytes), host, bytes, true);
}
void tensor_copy_to_host_async(const struct tensor *src, int64_t offset, void *host, size_t bytes) {
  src->be->ops->copy_d2h(src->be, host, elem_ptr(src, offset, bytes), bytes, true);
}
struct tensor_event {
  tensor_backend_t be;
  void *impl;
};

void tensor_copy_to_host_beside(const struct tensor *src, int64_t offset, void *host, size_t bytes,
                                tensor_event_t done) {
  RUMOR_ASSERT(done && done->be == src->be);
  src->be->ops->copy_d2h_beside(src->be, host, elem_ptr(src, offset, bytes), bytes, done->impl);
}
void tensor_copy(struct tensor *dst, const struct tensor *src) {
  RUMOR_ASSERT(dst->be == src->be && dst->dtype == src->dtype);
  RUMOR_ASSERT(tensor_numel(dst) == tensor_numel(src));
  dst->be->ops->copy_d2d(dst->be, dst->data, src->data, tensor_nbytes(src));
}

/* ---- events ---- */

tensor_event_t tensor_event_create(tensor_backend_t be) {
  void *impl = be->ops->ev_create(be);
  if (!impl) return NULL;
  struct tensor_event *ev = xmalloc(sizeof *ev);
  ev->be = be;
  ev->impl = impl;
  return ev;
}
void tensor_event_destroy(tensor_event_t ev) {
  if (!ev) return;
  ev->be->ops->ev_destroy(ev->be, ev->impl);
  free(ev);
}
void tensor_event_record(tensor_event_t ev) { ev->be->ops->ev_record(ev->be, ev->impl); }
bool tensor_event_query(tensor_event_t ev) { return ev->be->ops->ev_query(ev->be, ev->impl); }
void tensor_event_wait(tensor_event_t ev) { ev->be->ops->ev_wait(ev->be, ev->impl); }

/* ---- ops ---- */

static void check_f32(const struct tensor *t) { RUMOR_ASSERT(t->dtype == TENSOR_F32 && t->data); }

static void check_same(const struct tensor *a, const struct tensor *b) {
  check_f32(a);
  check_f32(b);
  RUMOR_ASSERT(a->be == b->be);
  RUMOR_ASSERT(tensor_numel(a) == tensor_numel(b));
}

/* Rows of a matrix view: every extent but the last, multiplied (0 when the
 * last is 0: nothing to do, and no division by it). */
static int64_t rows_of(const struct tensor *t) {
  int64_t cols = t->shape[t->ndim - 1];
  return t->ndim == 1 ? 1 : cols ? tensor_numel(t) / cols : 0;
}
static int64_t cols_of(const struct tensor *t) { return t->shape[t->ndim - 1]; }

void tensor_gemm_cols(bool trans_a, bool trans_b, float alpha, const struct tensor *a, int64_t a_cols,
                      const struct tensor *b, int64_t b_cols, float beta, struct tensor *c, int64_t c_cols) {
  check_f32(a);
  check_f32(b);
  check_f32(c);
  RUMOR_ASSERT(a->ndim == 2 && b->ndim == 2 && c->ndim == 2);
  RUMOR_ASSERT(a->be == c->be && b->be == c->be);
  RUMOR_ASSERT(0 <= a_cols && a_cols <= a->shape[1] && 0 <= b_cols && b_cols <= b->shape[1] && 0 <= c_cols &&
               c_cols <= c->shape[1]);
  int64_t m = trans_a ? a_cols : a->shape[0];
  int64_t k = trans_a ? a->shape[0] : a_cols;
  int64_t kb = trans_b ? b_cols : b->shape[0];
  int64_t n = trans_b ? b->shape[0] : b_cols;
  RUMOR_ASSERT(k == kb && c->shape[0] == m && c_cols == n);
  RUMOR_ASSERT(m < INT32_MAX && n < INT32_MAX && k < INT32_MAX);
  RUMOR_ASSERT(a->shape[1] < INT32_MAX && b->shape[1] < INT32_MAX && c->shape[1] < INT32_MAX);
  if (m == 0 || n == 0) return;
  c->be->ops->gemm(c->be, trans_a, trans_b, (int)m, (int)n, (int)k, alpha, a->data, (int)a->shape[1],
                   b->data, (int)b->shape[1], beta, c->data, (int)c->shape[1]);
}

void tensor_gemm(bool trans_a, bool trans_b, float alpha, const struct tensor *a,
                 const struct tensor *b, float beta, struct tensor *c) {
  tensor_gemm_cols(trans_a, trans_b, alpha, a, a->shape[1], b, b->shape[1], beta, c, c->shape[1]);
}

void tensor_bias_add(struct tensor *y, const struct tensor *bias) {
  check_f32(y);
  check_f32(bias);
  RUMOR_ASSERT(tensor_numel(bias) == cols_of(y));
  y->be->ops->bias_add(y->be, y->data, bias->data, rows_of(y), cols_of(y));
}

void tensor_bias_grad(const struct tensor *dy, struct tensor *db, float beta) {
  check_f32(dy);
  check_f32(db);
  RUMOR_ASSERT(tensor_numel(db) == cols_of(dy));
  dy->be->ops->bias_grad(dy->be, dy->data, db->data, rows_of(dy), cols_of(dy), beta);
}

void tensor_relu_fwd(const struct tensor *x, struct tensor *y) {
  check_same(x, y);
  x->be->ops->relu_fwd(x->be, x->data, y->data, tensor_numel(x));
}

void tensor_relu_bwd(const struct tensor *y, const struct tensor *dy, struct tensor *dx) {
  check_same(y, dy);
  check_same(dy, dx);
  y->be->ops->relu_bwd(y->be, y->data, dy->data, dx->data, tensor_numel(y));
}

void tensor_gelu_fwd(const struct tensor *x, struct tensor *y) {
  check_same(x, y);
  x->be->ops->gelu_fwd(x->be, x->data, y->data, tensor_numel(x));
}

void tensor_gelu_bwd(const struct tensor *x, const struct tensor *dy, struct tensor *dx) {
  check_same(x, dy);
  check_same(dy, dx);
  x->be->ops->gelu_bwd(x->be, x->data, dy->data, dx->data, tensor_numel(x));
}

void tensor_softmax_xent_cols(const struct tensor *logits, int64_t cols, const struct tensor *labels,
                              struct tensor *dlogits, struct tensor *losses, float grad_scale) {
  check_same(logits, dlogits);
  check_f32(losses);
  RUMOR_ASSERT(labels->dtype == TENSOR_I32 && labels->be == logits->be);
  RUMOR_ASSERT(cols_of(logits) == cols_of(dlogits) && 0 <= cols && cols <= cols_of(logits));
  int64_t rows = rows_of(logits);
  RUMOR_ASSERT(tensor_numel(labels) == rows && tensor_numel(losses) == rows);
  logits->be->ops->softmax_xent(logits->be, logits->data, labels->data, dlogits->data, losses->data,
                                rows, cols, cols_of(logits), grad_scale);
}

void tensor_softmax_xent(const struct tensor *logits, const struct tensor *labels,
                         struct tensor *dlogits, struct tensor *losses, float grad_scale) {
  tensor_softmax_xent_cols(logits, cols_of(logits), labels, dlogits, losses, grad_scale);
}

void tensor_add(const struct tensor *x, const struct tensor *y, struct tensor *out) {
  check_same(x, y);
  check_same(y, out);
  x->be->ops->add(x->be, x->data, y->data, out->data, tensor_numel(x));
}

/* ---- transformer ops ---- */

/* The op's entry, asserted present: a backend without it is a bug here. */
#define NN_OP(be, op)                                                                                 \
  ((be)->ops->op ? (be)->ops->op                                                                    \
                 : (rumor_panic(__FILE__, __LINE__, "backend %s has no " #op, (be)->name), (be)->ops->op))

static void check_i32(const struct tensor *t, tensor_backend_t be) {
  RUMOR_ASSERT(t->dtype == TENSOR_I32 && t->data && t->be == be);
}

void tensor_embedding_shard_fwd(const struct tensor *tokens, const struct tensor *wte, int64_t lo,
                                const struct tensor *wpe, struct tensor *out) {
  check_f32(wte);
  check_f32(out);
  check_i32(tokens, out->be);
  RUMOR_ASSERT(wte->be == out->be && tokens->ndim >= 2 && lo >= 0);
  int64_t t = cols_of(tokens), r = rows_of(tokens), c = cols_of(wte);
  RUMOR_ASSERT(tensor_numel(out) == r * t * c);
  if (wpe) {
    check_f32(wpe);
    RUMOR_ASSERT(wpe->be == out->be && cols_of(wpe) == c && rows_of(wpe) >= t);
  }
  if (r * t == 0) return;
  NN_OP(out->be, embedding_fwd)(out->be, tokens->data, wte->data, wpe ? wpe->data : NULL, out->data, r, t, c, lo,
                                rows_of(wte));
}

void tensor_embedding_fwd(const struct tensor *tokens, const struct tensor *wte, const struct tensor *wpe,
                          struct tensor *out) {
  RUMOR_ASSERT(wpe);
  tensor_embedding_shard_fwd(tokens, wte, 0, wpe, out);
}

void tensor_embedding_shard_bwd(const struct tensor *tokens, const struct tensor *dout, int64_t lo,
                                struct tensor *dwte, struct tensor *dwpe) {
  check_f32(dout);
  check_f32(dwte);
  check_i32(tokens, dout->be);
  RUMOR_ASSERT(dwte->be == dout->be && tokens->ndim >= 2 && lo >= 0);
  int64_t t = cols_of(tokens), r = rows_of(tokens), c = cols_of(dwte);
  RUMOR_ASSERT(tensor_numel(dout) == r * t * c);
  if (dwpe) {
    check_f32(dwpe);
    RUMOR_ASSERT(dwpe->be == dout->be && cols_of(dwpe) == c && rows_of(dwpe) >= t);
  }
  if (r * t == 0) return;
  NN_OP(dout->be, embedding_bwd)(dout->be, tokens->data, dout->data, dwte->data, dwpe ? dwpe->data : NULL, r, t, c,
                                 lo, rows_of(dwte));
}

void tensor_embedding_bwd(const struct tensor *tokens, const struct tensor *dout, struct tensor *dwte,
                          struct tensor *dwpe) {
  RUMOR_ASSERT(dwpe);
  tensor_embedding_shard_bwd(tokens, dout, 0, dwte, dwpe);
}

void tensor_xent_shard_stats(const struct tensor *logits, int64_t cols, const struct tensor *labels, int64_t lo,
                             struct tensor *lse, struct tensor *target) {
  check_f32(logits);
  check_f32(lse);
  check_f32(target);
  check_i32(labels, logits->be);
  int64_t rows = rows_of(logits), ld = cols_of(logits);
  RUMOR_ASSERT(lse->be == logits->be && target->be == logits->be && lo >= 0 && cols >= 1 && cols <= ld);
  RUMOR_ASSERT(tensor_numel(labels) == rows && tensor_numel(lse) == rows && tensor_numel(target) == rows);
  if (rows == 0) return;
  NN_OP(logits->be, xent_shard_stats)(logits->be, logits->data, labels->data, lse->data, target->data, rows, cols,
                                      ld, lo);
}

void tensor_xent_shard_grad(const struct tensor *logits, int64_t cols, const struct tensor *labels, int64_t lo,
                            const struct tensor *parts, const struct tensor *target, struct tensor *dlogits,
                            struct tensor *losses, float grad_scale) {
  check_same(logits, dlogits);
  check_f32(parts);
  check_f32(target);
  check_i32(labels, logits->be);
  int64_t rows = rows_of(logits), ld = cols_of(logits);
  RUMOR_ASSERT(parts->be == logits->be && target->be == logits->be && lo >= 0 && cols >= 1 && cols <= ld);
  RUMOR_ASSERT(cols_of(dlogits) == ld);
  RUMOR_ASSERT(tensor_numel(labels) == rows && tensor_numel(target) == rows);
  RUMOR_ASSERT(parts->ndim == 2 && parts->shape[1] == rows && parts->shape[0] >= 1);
  if (losses) {
    check_f32(losses);
    RUMOR_ASSERT(losses->be == logits->be && tensor_numel(losses) == rows);
  }
  if (rows == 0) return;
  NN_OP(logits->be, xent_shard_grad)(logits->be, logits->data, labels->data, parts->data, parts->shape[0],
                                     target->data, dlogits->data, losses ? losses->data : NULL, rows, cols, ld, lo,
                                     grad_scale);
}

void tensor_layernorm_fwd(const struct tensor *x, const struct tensor *w, const struct tensor *b, struct tensor *y,
                          struct tensor *mean, struct tensor *rstd) {
  check_same(x, y);
  check_f32(w);
  check_f32(b);
  check_f32(mean);
  check_f32(rstd);
  int64_t rows = rows_of(x), c = cols_of(x);
  RUMOR_ASSERT(x->data != y->data);
  RUMOR_ASSERT(tensor_numel(w) == c && tensor_numel(b) == c && tensor_numel(mean) == rows &&
               tensor_numel(rstd) == rows);
  if (rows == 0) return;
  NN_OP(x->be, layernorm_fwd)(x->be, x->data, w->data, b->data, y->data, mean->data, rstd->data, rows, c);
}

void tensor_layernorm_bwd(const struct tensor *x, const struct tensor *w, const struct tensor *mean,
                          const struct tensor *rstd, const struct tensor *dy, struct tensor *dx, struct tensor *dw,
                          struct tensor *db, float beta) {
  check_same(x, dy);
  check_same(x, dx);
  check_f32(w);
  check_f32(mean);
  check_f32(rstd);
  check_f32(dw);
  check_f32(db);
  int64_t rows = rows_of(x), c = cols_of(x);
  RUMOR_ASSERT(dx->data != dy->data && dx->data != x->data);
  RUMOR_ASSERT(tensor_numel(w) == c && tensor_numel(dw) == c && tensor_numel(db) == c &&
               tensor_numel(mean) == rows && tensor_numel(rstd) == rows);
  if (rows == 0) {
    if (beta != 1.0f) {
      tensor_scale(dw, beta);
      tensor_scale(db, beta);
    }
    return;
  }
  NN_OP(x->be, layernorm_bwd)(x->be, x->data, w->data, mean->data, rstd->data, dy->data, dx->data, dw->data,
                             db->data, rows, c, beta);
}

/* Sequences, positions and width of an attention op from qkv's shape. */
static void attention_dims(const struct tensor *qkv, int nheads, int64_t *r, int64_t *t, int64_t *c) {
  RUMOR_ASSERT(qkv->ndim == 3 && nheads > 0);
  *r = qkv->shape[0];
  *t = qkv->shape[1];
  RUMOR_ASSERT(qkv->shape[2] % 3 == 0);
  *c = qkv->shape[2] / 3;
  RUMOR_ASSERT(*c % nheads == 0);
}

void tensor_attention_fwd(const struct tensor *qkv, int nheads, struct tensor *out, struct tensor *lse) {
  check_f32(qkv);
  check_f32(out);
  check_f32(lse);
  RUMOR_ASSERT(qkv->be == out->be && lse->be == out->be);
  int64_t r, t, c;
  attention_dims(qkv, nheads, &r, &t, &c);
  RUMOR_ASSERT(tensor_numel(out) == r * t * c && tensor_numel(lse) == r * nheads * t);
  if (r * t == 0) return;
  NN_OP(out->be, attention_fwd)(out->be, qkv->data, out->data, lse->data, r, t, c, nheads);
}

void tensor_attention_bwd(const struct tensor *qkv, const struct tensor *out, const struct tensor *lse,
                          const struct tensor *dout, int nheads, struct tensor *dqkv) {
  check_same(qkv, dqkv);
  check_same(out, dout);
  check_f32(lse);
  RUMOR_ASSERT(qkv->be == out->be && lse->be == out->be);
  int64_t r, t, c;
  attention_dims(qkv, nheads, &r, &t, &c);
  RUMOR_ASSERT(tensor_numel(out) == r * t * c && tensor_numel(lse) == r * nheads * t);
  if (r * t == 0) return;
  NN_OP(out->be, attention_bwd)(out->be, qkv->data, out->data, lse->data, dout->data, dqkv->data, r, t, c, nheads);
}

void tensor_gelu_tanh_fwd(const struct tensor *x, struct tensor *y) {
  check_same(x, y);
  NN_OP(x->be, gelu_tanh_fwd)(x->be, x->data, y->data, tensor_numel(x));
}

void tensor_gelu_tanh_bwd(const struct tensor *x, const struct tensor *dy, struct tensor *dx) {
  check_same(x, dy);
  check_same(dy, dx);
  NN_OP(x->be, gelu_tanh_bwd)(x->be, x->data, dy->data, dx->data, tensor_numel(x));
}

void tensor_sgd_step(struct tensor *params, const struct tensor *grads, struct tensor *mom,
                     const struct tensor_sgd *hp) {
  check_same(params, grads);
  if (mom) check_same(params, mom);
  RUMOR_ASSERT(mom || hp->momentum == 0.0f);
  params->be->ops->sgd_step(params->be, params->data, grads->data, mom ? mom->data : NULL,
                            tensor_numel(params), hp);
}

void tensor_adamw_step(struct tensor *params, const struct tensor *grads, struct tensor *m,
                       struct tensor *v, const struct tensor_adamw *hp) {
  check_same(params, grads);
  check_same(params, m);
  check_same(params, v);
  RUMOR_ASSERT(hp->step >= 1);
  params->be->ops->adamw_step(params->be, params->data, grads->data, m->data, v->data,
                              tensor_numel(params), hp);
}

void tensor_axpby(float a, const struct tensor *x, float b, struct tensor *y) {
  check_same(x, y);
  x->be->ops->axpby(x->be, a, x->data, b, y->data, tensor_numel(x));
}

void tensor_scale(struct tensor *x, float a) {
  check_f32(x);
  x->be->ops->scale(x->be, x->data, a, tensor_numel(x));
}

void tensor_discard(struct tensor *t, int64_t offset, int64_t count) {
  RUMOR_ASSERT(offset >= 0 && count >= 0 && offset + count <= tensor_numel(t));
  if (count == 0 || !t->be->ops->mem_discard) return;
  t->be->ops->sync(t->be);
  size_t es = tensor_dtype_size(t->dtype);
  t->be->ops->mem_discard(t->be, (char *)t->data + (size_t)offset * es, (size_t)count * es);
}

int tensor_recommit(struct tensor *t, int64_t offset, int64_t count, struct rumor_err *e) {
  RUMOR_ASSERT(offset >= 0 && count >= 0 && offset + count <= tensor_numel(t));
  if (count == 0 || !t->be->ops->mem_recommit) return 0;
  size_t es = tensor_dtype_size(t->dtype);
  return t->be->ops->mem_recommit(t->be, (char *)t->data + (size_t)offset * es, (size_t)count * es, e);
}

void tensor_backend_set_discardable(tensor_backend_t be, bool on) {
  if (be->ops->set_discardable) be->ops->set_discardable(be, on);
}

int64_t tensor_backend_live_bytes(tensor_backend_t be) {
  int64_t live = -1, peak = -1;
  if (be->ops->mem_held) be->ops->mem_held(be, &live, &peak, false);
  return live;
}

int64_t tensor_backend_peak_bytes(tensor_backend_t be, bool reset) {
  int64_t live = -1, peak = -1;
  if (be->ops->mem_held) be->ops->mem_held(be, &live, &peak, reset);
  return peak;
}

void tensor_fill(struct tensor *x, float v) {
  check_f32(x);
  x->be->ops->fill(x->be, x->data, v, tensor_numel(x));
}

double tensor_sum(const struct tensor *x) {
  check_f32(x);
  return x->be->ops->sum(x->be, x->data, tensor_numel(x));
}

double tensor_sq_norm(const struct tensor *x) {
  check_f32(x);
  return x->be->ops->sq_norm(x->be, x->data, tensor_numel(x));
}

double tensor_sq_dist(const struct tensor *x, const struct tensor *y) {
  check_same(x, y);
  return x->be->ops->sq_dist(x->be, x->data, y->data, tensor_numel(x));
}

void tensor_diff_stats(const struct tensor *x, const struct tensor *y, struct tensor_diff_stats *out) {
  check_same(x, y);
  const struct tensor_backend_ops *ops = x->be->ops;
  if (ops->diff_stats) {
    ops->diff_stats(x->be, x->data, y->data, tensor_numel(x), out);
    return;
  }
  out->nonfinite_y = ops->count_nonfinite(x->be, y->data, tensor_numel(y));
  out->sq_dist = ops->sq_dist(x->be, y->data, x->data, tensor_numel(x));
  out->sq_norm_x = ops->sq_norm(x->be, x->data, tensor_numel(x));
}

int tensor_mirror_host(struct tensor *out, const struct tensor *like, void *host, struct rumor_err *e) {
  if (tensor_backend_device(like->be) == TENSOR_DEVICE_CPU) {
    *out = *like; /* CPU memory is host memory: a view, no copies */
    out->data = host;
    out->owner = false;
    return 0;
  }
  return tensor_alloc(out, like->be, like->dtype, like->ndim, like->shape, e);
}

void tensor_mirror_refresh(struct tensor *mirror, const void *host) {
  if (mirror->data != host) tensor_copy_from_host(mirror, 0, host, tensor_nbytes(mirror));
}

int64_t tensor_count_nonfinite(const struct tensor *x) {
  check_f32(x);
  return x->be->ops->count_nonfinite(x->be, x->data, tensor_numel(x));
}

void tensor_count_sketch(const struct tensor *x, uint64_t seed, int k, double *out_host) {
  check_f32(x);
  RUMOR_ASSERT(k >= 1 && k <= (1 << 20) && (k & (k - 1)) == 0);
  x->be->ops->count_sketch(x->be, x->data, tensor_numel(x), seed, k, out_host);
}

/* ---- mixture of experts ---- */

/* Rows of the expert buffers [E·cap, C] and the experts E they hold (0 when
 * cap is 0: no row can be kept then). */
static int64_t moe_experts(const struct tensor *buf, int64_t cap) {
  RUMOR_ASSERT(buf->ndim == 2 && cap >= 0);
  if (cap == 0) {
    RUMOR_ASSERT(buf->shape[0] == 0);
    return 0;
  }
  RUMOR_ASSERT(buf->shape[0] % cap == 0);
  return buf->shape[0] / cap;
}

/* The choice tables of N tokens with K choices each: expert [N,K] I32 on
 * `be`, and when not NULL slot [N,K] I32 and gate [N,K] F32. Returns K. */
static int moe_choices(const struct tensor *expert, const struct tensor *slot, const struct tensor *gate, int64_t n,
                       tensor_backend_t be) {
  check_i32(expert, be);
  RUMOR_ASSERT(expert->ndim == 2 && expert->shape[0] == n);
  int64_t k = expert->shape[1];
  RUMOR_ASSERT(k >= 1 && k <= INT32_MAX);
  if (slot) {
    check_i32(slot, be);
    RUMOR_ASSERT(slot->ndim == 2 && slot->shape[0] == n && slot->shape[1] == k);
  }
  if (gate) {
    check_f32(gate);
    RUMOR_ASSERT(gate->be == be && gate->ndim == 2 && gate->shape[0] == n && gate->shape[1] == k);
  }
  return (int)k;
}

void tensor_moe_route(const struct tensor *logits, int k, int64_t cap, struct tensor *probs, struct tensor *lse,
                      struct tensor *expert, struct tensor *gate, struct tensor *slot, struct tensor *assigned,
                      struct tensor *kept, struct tensor *psum) {
  check_same(logits, probs);
  check_f32(lse);
  check_f32(psum);
  tensor_backend_t be = logits->be;
  RUMOR_ASSERT(logits->ndim == 2 && probs->ndim == 2 && probs->shape[1] == logits->shape[1]);
  int64_t n = logits->shape[0], e = logits->shape[1];
  RUMOR_ASSERT(e >= 1 && e <= INT32_MAX && k >= 1 && k <= e && cap >= 0 && cap <= INT32_MAX);
  RUMOR_ASSERT(n <= INT32_MAX / k); /* the counts are I32 */
  RUMOR_ASSERT(lse->be == be && tensor_numel(lse) == n && psum->be == be && tensor_numel(psum) == e);
  RUMOR_ASSERT(gate && slot && moe_choices(expert, slot, gate, n, be) == k);
  check_i32(assigned, be);
  check_i32(kept, be);
  RUMOR_ASSERT(tensor_numel(assigned) == e && tensor_numel(kept) == e);
  NN_OP(be, moe_route)(be, logits->data, probs->data, lse->data, expert->data, gate->data, slot->data, assigned->data,
                       kept->data, psum->data, n, e, k, cap);
}

void tensor_moe_route_bwd(const struct tensor *probs, const struct tensor *lse, const struct tensor *expert,
                          const struct tensor *gate, const struct tensor *dgate, const struct tensor *daux,
                          float zscale, struct tensor *dlogits) {
  check_same(probs, dlogits);
  check_f32(lse);
  check_f32(daux);
  tensor_backend_t be = probs->be;
  RUMOR_ASSERT(probs->ndim == 2 && dlogits->ndim == 2 && dlogits->shape[1] == probs->shape[1]);
  int64_t n = probs->shape[0], e = probs->shape[1];
  RUMOR_ASSERT(e >= 1 && e <= INT32_MAX);
  RUMOR_ASSERT(lse->be == be && tensor_numel(lse) == n && daux->be == be && tensor_numel(daux) == e);
  RUMOR_ASSERT(gate && dgate);
  int k = moe_choices(expert, NULL, gate, n, be);
  RUMOR_ASSERT(k <= e);
  check_f32(dgate);
  RUMOR_ASSERT(dgate->be == be && dgate->ndim == 2 && dgate->shape[0] == n && dgate->shape[1] == k);
  if (n == 0) return;
  NN_OP(be, moe_route_bwd)(be, probs->data, lse->data, expert->data, gate->data, dgate->data, daux->data, zscale,
                           dlogits->data, n, e, k);
}

void tensor_moe_dispatch(const struct tensor *x, const struct tensor *expert, const struct tensor *slot, int64_t cap,
                         struct tensor *xe) {
  check_f32(x);
  check_f32(xe);
  tensor_backend_t be = x->be;
  RUMOR_ASSERT(xe->be == be && x->ndim == 2 && xe->ndim == 2 && xe->shape[1] == x->shape[1]);
  int64_t n = x->shape[0], c = x->shape[1], e = moe_experts(xe, cap);
  int k = moe_choices(expert, slot, NULL, n, be);
  if (e == 0 || c == 0) return;
  if (n == 0) {
    tensor_fill(xe, 0.0f);
    return;
  }
  NN_OP(be, moe_dispatch)(be, x->data, expert->data, slot->data, xe->data, n, c, k, e, cap);
}

void tensor_moe_dispatch_bwd(const struct tensor *dxe, const struct tensor *expert, const struct tensor *slot,
                             int64_t cap, struct tensor *dx) {
  check_f32(dxe);
  check_f32(dx);
  tensor_backend_t be = dx->be;
  RUMOR_ASSERT(dxe->be == be && dx->ndim == 2 && dxe->ndim == 2 && dxe->shape[1] == dx->shape[1]);
  int64_t n = dx->shape[0], c = dx->shape[1], e = moe_experts(dxe, cap);
  int k = moe_choices(expert, slot, NULL, n, be);
  if (e == 0 || c == 0 || n == 0) return;
  NN_OP(be, moe_dispatch_bwd)(be, dxe->data, expert->data, slot->data, dx->data, n, c, k, e, cap);
}

void tensor_moe_combine(const struct tensor *ye, const struct tensor *expert, const struct tensor *slot,
                        const struct tensor *gate, int64_t cap, struct tensor *out) {
  check_f32(ye);
  check_f32(out);
  tensor_backend_t be = out->be;
  RUMOR_ASSERT(ye->be == be && out->ndim == 2 && ye->ndim == 2 && ye->shape[1] == out->shape[1]);
  int64_t n = out->shape[0], c = out->shape[1], e = moe_experts(ye, cap);
  int k = moe_choices(expert, slot, gate, n, be);
  if (n == 0 || c == 0) return;
  if (e == 0) {
    tensor_fill(out, 0.0f); /* no row to combine: every choice is dropped */
    return;
  }
  NN_OP(be, moe_combine)(be, ye->data, expert->data, slot->data, gate->data, out->data, n, c, k, e, cap);
}

void tensor_moe_combine_bwd(const struct tensor *dout, const struct tensor *ye, const struct tensor *expert,
                            const struct tensor *slot, const struct tensor *gate, int64_t cap, struct tensor *dye,
                            struct tensor *dgate) {
  check_same(ye, dye);
  check_f32(dout);
  tensor_backend_t be = dout->be;
  RUMOR_ASSERT(ye->be == be && dout->ndim == 2 && ye->ndim == 2 && dye->ndim == 2);
  RUMOR_ASSERT(ye->shape[1] == dout->shape[1] && dye->shape[0] == ye->shape[0] && dye->shape[1] == ye->shape[1]);
  int64_t n = dout->shape[0], c = dout->shape[1], e = moe_experts(ye, cap);
  int k = moe_choices(expert, slot, gate, n, be);
  check_f32(dgate);
  RUMOR_ASSERT(dgate->be == be && dgate->ndim == 2 && dgate->shape[0] == n && dgate->shape[1] == k);
  if (e == 0 || c == 0 || n == 0) { /* no choice can be kept, or nothing to read */
    if (e > 0 && c > 0) tensor_fill(dye, 0.0f);
    if (n > 0) tensor_fill(dgate, 0.0f);
    return;
  }
  NN_OP(be, moe_combine_bwd)(be, dout->data, ye->data, expert->data, slot->data, gate->data, dye->data, dgate->data, n,
                             c, k, e, cap);
}
