/*
 * tensor_ref — the plain reference ops: obviously-correct host loops (double
 * accumulation) that the tests compare every backend's op against. Raw host
 * pointers, row-major. Never used in training; built into rumor_tensor_ref,
 * which only the tests and benchmarks link.
 */
#ifndef RUMOR_TENSOR_REF_H
#define RUMOR_TENSOR_REF_H

#include "tensor/tensor.h"

void tensor_ref_gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float *a,
                     const float *b, float beta, float *c);
void tensor_ref_bias_add(float *y, const float *bias, int64_t rows, int64_t cols);
void tensor_ref_bias_grad(const float *dy, float *db, int64_t rows, int64_t cols, float beta);
void tensor_ref_relu_fwd(const float *x, float *y, int64_t n);
void tensor_ref_relu_bwd(const float *y, const float *dy, float *dx, int64_t n);
void tensor_ref_gelu_fwd(const float *x, float *y, int64_t n);
void tensor_ref_gelu_bwd(const float *x, const float *dy, float *dx, int64_t n);
void tensor_ref_softmax_xent(const float *logits, const int32_t *labels, float *dlogits,
                             float *losses, int64_t rows, int64_t cols, float grad_scale);
void tensor_ref_add(const float *x, const float *y, float *out, int64_t n);
void tensor_ref_embedding_fwd(const int32_t *tokens, const float *wte, const float *wpe, float *out, int64_t r,
                              int64_t t, int64_t c);
void tensor_ref_embedding_bwd(const int32_t *tokens, const float *dout, float *dwte, float *dwpe, int64_t r,
                              int64_t t, int64_t c);
/* The vocabulary-parallel ops (tensor.h's _shard_ ones): wte holds the
 * vocabulary rows [lo, lo + v); wpe / dwpe may be NULL. */
void tensor_ref_embedding_shard_fwd(const int32_t *tokens, const float *wte, int64_t lo, int64_t v, const float *wpe,
                                    float *out, int64_t r, int64_t t, int64_t c);
void tensor_ref_embedding_shard_bwd(const int32_t *tokens, const float *dout, int64_t lo, int64_t v, float *dwte,
                                    float *dwpe, int64_t r, int64_t t, int64_t c);
void tensor_ref_xent_shard_stats(const float *logits, const int32_t *labels, int64_t lo, float *lse, float *target,
                                 int64_t rows, int64_t cols);
void tensor_ref_xent_shard_grad(const float *logits, const int32_t *labels, int64_t lo, const float *parts,
                                int64_t nparts, const float *target, float *dlogits, float *losses, int64_t rows,
                                int64_t cols, float grad_scale);
void tensor_ref_layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                              int64_t rows, int64_t c);
void tensor_ref_layernorm_bwd(const float *x, const float *w, const float *mean, const float *rstd, const float *dy,
                              float *dx, float *dw, float *db, int64_t rows, int64_t c, float beta);
/* The reference attention keeps the T×T probabilities it needs in its own
 * memory; lse as tensor.h. */
void tensor_ref_attention_fwd(const float *qkv, float *out, float *lse, int64_t r, int64_t t, int64_t c, int nh);
void tensor_ref_attention_bwd(const float *qkv, const float *out, const float *lse, const float *dout, float *dqkv,
                              int64_t r, int64_t t, int64_t c, int nh);
void tensor_ref_gelu_tanh_fwd(const float *x, float *y, int64_t n);
void tensor_ref_gelu_tanh_bwd(const float *x, const float *dy, float *dx, int64_t n);
/* Mixture of experts (tensor.h's tensor_moe_*): n tokens of width ch, e
 * experts of cap rows, k choices per token. The routing's softmax is in
 * double, its top-K picked by K passes over each row; gates are formed from
 * the stored (float) probabilities. */
void tensor_ref_moe_route(const float *logits, float *probs, float *lse, int32_t *expert, float *gate, int32_t *slot,
                          int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e, int k, int64_t cap);
void tensor_ref_moe_route_bwd(const float *probs, const float *lse, const int32_t *expert, const float *gate,
                              const float *dgate, const float *daux, float zscale, float *dlogits, int64_t n,
                              int64_t e, int k);
void tensor_ref_moe_dispatch(const float *x, const int32_t *expert, const int32_t *slot, float *xe, int64_t n,
                             int64_t ch, int k, int64_t e, int64_t cap);
void tensor_ref_moe_dispatch_bwd(const float *dxe, const int32_t *expert, const int32_t *slot, float *dx, int64_t n,
                                 int64_t ch, int k, int64_t e, int64_t cap);
void tensor_ref_moe_combine(const float *ye, const int32_t *expert, const int32_t *slot, const float *gate, float *out,
                            int64_t n, int64_t ch, int k, int64_t e, int64_t cap);
void tensor_ref_moe_combine_bwd(const float *dout, const float *ye, const int32_t *expert, const int32_t *slot,
                                const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k, int64_t e,
                                int64_t cap);
void tensor_ref_sgd_step(float *p, const float *g, float *m, int64_t n, const struct tensor_sgd *hp);
void tensor_ref_adamw_step(float *p, const float *g, float *m, float *v, int64_t n,
                           const struct tensor_adamw *hp);
void tensor_ref_count_sketch(const float *x, int64_t n, uint64_t seed, int k, double *out);

#endif /* RUMOR_TENSOR_REF_H */
