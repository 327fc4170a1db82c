/*
 * tensor_impl.h — the private interface between tensor.c (dispatch, shape
 * checks) and the backends (tensor_cpu.c, tensor_cuda.c). Not for use
 * outside tensor/.
 *
 * Every entry takes raw device pointers and element counts that tensor.c has
 * already checked against the tensors' shapes. Entries run in stream order on
 * the backend; those returning host values synchronise first. An entry left
 * NULL is not supported by that backend (tensor.c asserts before calling).
 */
#ifndef RUMOR_TENSOR_IMPL_H
#define RUMOR_TENSOR_IMPL_H

#include "tensor/tensor.h"

struct tensor_backend_ops {
  void (*close)(tensor_backend_t be);
  void (*set_threads)(tensor_backend_t be, int threads); /* optional */
  /* tensor_backend_set_tf32; optional (NULL: FP32 only, the switch is a
   * no-op, as on the CPU). */
  void (*set_tf32)(tensor_backend_t be, bool on);
  void (*sync)(tensor_backend_t be);

  /* Device memory: NULL on failure (the caller reports it). */
  void *(*mem_alloc)(tensor_backend_t be, size_t bytes);
  void (*mem_free)(tensor_backend_t be, void *p);
  /* Free and total device memory; NULL where not known (the CPU). */
  void (*mem_info)(tensor_backend_t be, size_t *free_bytes, size_t *total_bytes);
  /* Host memory for fast/async copies: NULL on failure. */
  void *(*host_alloc)(tensor_backend_t be, size_t bytes);
  void (*host_free)(tensor_backend_t be, void *p);
  /* tensor_discard: [p, p + bytes) of a mem_alloc block may give its memory
   * back; optional (NULL: the memory stays). */
  void (*mem_discard)(tensor_backend_t be, void *p, size_t bytes);
  /* tensor_recommit: memory that mem_discard gave back within [p, p +
   * bytes) is taken again, zero-filled in stream order; 0 or an error.
   * Optional (NULL: memory comes back by itself, as pages do on the CPU). */
  int (*mem_recommit)(tensor_backend_t be, void *p, size_t bytes, struct rumor_err *e);
  /* tensor_backend_set_discardable; optional (NULL: every block can). */
  void (*set_discardable)(tensor_backend_t be, bool on);
  /* tensor_backend_live_bytes and _peak_bytes (and its reset); optional
   * (NULL: not known, the CPU). */
  void (*mem_held)(tensor_backend_t be, int64_t *live, int64_t *peak, bool reset);
  void (*copy_h2d)(tensor_backend_t be, void *dst, const void *src, size_t bytes, bool async);
  void (*copy_d2h)(tensor_backend_t be, void *dst, const void *src, size_t bytes, bool async);
  void (*copy_d2d)(tensor_backend_t be, void *dst, const void *src, size_t bytes);
  /* tensor_copy_to_host_beside: device → host off the backend's stream,
   * after everything enqueued so far; `ev` (ev_create's) recorded after it. */
  void (*copy_d2h_beside)(tensor_backend_t be, void *dst, const void *src, size_t bytes, void *ev);

  /* Events. `ev_create` returns backend-private state (NULL on failure). */
  void *(*ev_create)(tensor_backend_t be);
  void (*ev_destroy)(tensor_backend_t be, void *ev);
  void (*ev_record)(tensor_backend_t be, void *ev);
  bool (*ev_query)(tensor_backend_t be, void *ev);
  void (*ev_wait)(tensor_backend_t be, void *ev);

  /* Row-major C[m,n] ← alpha·op(A)·op(B) + beta·C with leading dimensions
   * lda/ldb/ldc (row strides in elements). */
  void (*gemm)(tensor_backend_t be, bool trans_a, bool trans_b, int m, int n, int k, float alpha,
               const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc);
  void (*bias_add)(tensor_backend_t be, float *y, const float *bias, int64_t rows, int64_t cols);
  void (*bias_grad)(tensor_backend_t be, const float *dy, float *db, int64_t rows, int64_t cols,
                    float beta);
  void (*relu_fwd)(tensor_backend_t be, const float *x, float *y, int64_t n);
  void (*relu_bwd)(tensor_backend_t be, const float *y, const float *dy, float *dx, int64_t n);
  void (*gelu_fwd)(tensor_backend_t be, const float *x, float *y, int64_t n);
  void (*gelu_bwd)(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n);
  /* The classes are the first `cols` columns of rows `ld` floats apart
   * (padded rows, tensor.h; ld = cols unpadded), in logits and dlogits. */
  void (*softmax_xent)(tensor_backend_t be, const float *logits, const int32_t *labels,
                       float *dlogits, float *losses, int64_t rows, int64_t cols, int64_t ld, float grad_scale);
  void (*add)(tensor_backend_t be, const float *x, const float *y, float *out, int64_t n);
  /* Transformer entries (tensor.h): r sequences of t positions, width c,
   * v vocabulary rows, nh heads. */
  /* The embedding ops take the vocabulary shard [lo, lo + v) of wte
   * (tensor_embedding_shard_fwd; lo 0 and v the whole vocabulary for the
   * plain ops); wpe and dwpe may be NULL (no position term). */
  void (*embedding_fwd)(tensor_backend_t be, const int32_t *tokens, const float *wte, const float *wpe, float *out,
                        int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v);
  void (*embedding_bwd)(tensor_backend_t be, const int32_t *tokens, const float *dout, float *dwte, float *dwpe,
                        int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v);
  /* Vocabulary-parallel cross-entropy (tensor.h): the first cols columns of
   * logits [rows, ld] hold the classes [lo, lo + cols) (dlogits alike);
   * parts [nparts, rows]. losses may be NULL. */
  void (*xent_shard_stats)(tensor_backend_t be, const float *logits, const int32_t *labels, float *lse,
                           float *target, int64_t rows, int64_t cols, int64_t ld, int64_t lo);
  void (*xent_shard_grad)(tensor_backend_t be, const float *logits, const int32_t *labels, const float *parts,
                          int64_t nparts, const float *target, float *dlogits, float *losses, int64_t rows,
                          int64_t cols, int64_t ld, int64_t lo, float grad_scale);
  void (*layernorm_fwd)(tensor_backend_t be, const float *x, const float *w, const float *b, float *y, float *mean,
                        float *rstd, int64_t rows, int64_t c);
  void (*layernorm_bwd)(tensor_backend_t be, const float *x, const float *w, const float *mean, const float *rstd,
                        const float *dy, float *dx, float *dw, float *db, int64_t rows, int64_t c, float beta);
  void (*attention_fwd)(tensor_backend_t be, const float *qkv, float *out, float *lse, int64_t r, int64_t t,
                        int64_t c, int nh);
  void (*attention_bwd)(tensor_backend_t be, const float *qkv, const float *out, const float *lse, const float *dout,
                        float *dqkv, int64_t r, int64_t t, int64_t c, int nh);
  void (*gelu_tanh_fwd)(tensor_backend_t be, const float *x, float *y, int64_t n);
  void (*gelu_tanh_bwd)(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n);
  /* Mixture of experts (tensor.h): n tokens of width c, e experts of cap
   * rows each, k choices per token (1 <= k, and k <= e for routing: the
   * data ops also take a packed form, e = 1, k = K); expert, slot [n,k] I32,
   * gate, dgate [n,k]; xe, dxe, ye, dye [e·cap, c]. tensor.c has checked
   * the shapes: e >= 1 and cap >= 0 for moe_route (n >= 0: with none,
   * assigned, kept and psum are still written); n, c, e and cap >= 1 for
   * the others (tensor.c does the empty cases itself). */
  void (*moe_route)(tensor_backend_t be, const float *logits, float *probs, float *lse, int32_t *expert, float *gate,
                    int32_t *slot, int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e, int k,
                    int64_t cap);
  void (*moe_route_bwd)(tensor_backend_t be, const float *probs, const float *lse, const int32_t *expert,
                        const float *gate, const float *dgate, const float *daux, float zscale, float *dlogits,
                        int64_t n, int64_t e, int k);
  void (*moe_dispatch)(tensor_backend_t be, const float *x, const int32_t *expert, const int32_t *slot, float *xe,
                       int64_t n, int64_t c, int k, int64_t e, int64_t cap);
  void (*moe_dispatch_bwd)(tensor_backend_t be, const float *dxe, const int32_t *expert, const int32_t *slot,
                           float *dx, int64_t n, int64_t c, int k, int64_t e, int64_t cap);
  void (*moe_combine)(tensor_backend_t be, const float *ye, const int32_t *expert, const int32_t *slot,
                      const float *gate, float *out, int64_t n, int64_t c, int k, int64_t e, int64_t cap);
  void (*moe_combine_bwd)(tensor_backend_t be, const float *dout, const float *ye, const int32_t *expert,
                          const int32_t *slot, const float *gate, float *dye, float *dgate, int64_t n, int64_t c,
                          int k, int64_t e, int64_t cap);
  void (*sgd_step)(tensor_backend_t be, float *p, const float *g, float *m, int64_t n,
                   const struct tensor_sgd *hp);
  void (*adamw_step)(tensor_backend_t be, float *p, const float *g, float *m, float *v, int64_t n,
                     const struct tensor_adamw *hp);
  void (*axpby)(tensor_backend_t be, float a, const float *x, float b, float *y, int64_t n);
  void (*scale)(tensor_backend_t be, float *x, float a, int64_t n);
  void (*fill)(tensor_backend_t be, float *x, float v, int64_t n);
  double (*sum)(tensor_backend_t be, const float *x, int64_t n);
  double (*sq_norm)(tensor_backend_t be, const float *x, int64_t n);
  double (*sq_dist)(tensor_backend_t be, const float *x, const float *y, int64_t n);
  int64_t (*count_nonfinite)(tensor_backend_t be, const float *x, int64_t n);
  /* Optional (NULL: tensor_diff_stats runs the three reductions above). */
  void (*diff_stats)(tensor_backend_t be, const float *x, const float *y, int64_t n, struct tensor_diff_stats *out);
  void (*count_sketch)(tensor_backend_t be, const float *x, int64_t n, uint64_t seed, int k,
                       double *out_host);
};

/* The common head of every backend; each backend embeds it first in its own
 * struct and casts. */
struct tensor_backend {
  const struct tensor_backend_ops *ops;
  enum tensor_device device;
  char name[64];
};

/* Backend constructors, called by tensor_backend_open. Each returns 0 or a
 * negative code with a message. */
int tensor_cpu_open(tensor_backend_t *out, struct rumor_err *e);
#ifdef RUMOR_HAVE_CUDA
int tensor_cuda_open(int device, tensor_backend_t *out, struct rumor_err *e);
int tensor_cuda_count(void);
#endif

#endif /* RUMOR_TENSOR_IMPL_H */
