/*
 * kernels — the CUDA kernels of rumor behind a plain C header.
 *
 * This header includes no CUDA header, so C code (tensor/tensor_cuda.c) can
 * call the launchers below. Streams are passed as `void *` holding a
 * cudaStream_t; every launcher enqueues its work on that stream and returns
 * at once (stream order, no host synchronisation).
 *
 * Conventions for every launcher:
 *  - Pointers are device pointers; counts are elements, 64-bit, and may be
 *    0 (then nothing is launched). Element-wise kernels use grid-stride
 *    loops, so any n works with a bounded grid.
 *  - Two arguments may alias only where the contract says so.
 *  - The return value is 0 when everything was enqueued, or the CUDA error
 *    code (a cudaError_t value) of the first failed launch or call; then
 *    kern_last_error() describes it (kernel name, file and line).
 *  - The calling thread must have the stream's device current
 *    (cudaSetDevice).
 */
#ifndef RUMOR_KERNELS_H
#define RUMOR_KERNELS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* The most partial sums a reduction launcher writes (one per block). */
#define KERN_REDUCE_MAX_BLOCKS 1024
/* Count-sketch bucket counts up to this accumulate in shared memory per block;
 * larger ones go straight to global double atomics. */
#define KERN_SKETCH_SHARED_MAX 8192

/* The message for the calling thread's last failed launcher call:
 * "<kernel> (<file>:<line>): <CUDA error name>: <description>".
 * "no error" when none failed yet. The string is thread-local and valid until
 * the next failure in this thread. */
const char *kern_last_error(void);

/* 0 when this binary holds kernel code runnable on the current device, else
 * the CUDA error (typically cudaErrorNoKernelImageForDevice) with
 * kern_last_error() set. Creates the device's context if needed. */
int kern_check_device(void);

/* ---- element-wise ------------------------------------------------------------- */

/* y[r,c] += bias[c] for y [rows, cols] row-major, bias [cols]. */
int kern_bias_add(float *y, const float *bias, int64_t rows, int64_t cols, void *stream);
/* Bytes of scratch kern_bias_grad needs: one float per column per chunk of
 * rows when there is more than one chunk (KERN_BIAS_ROWS_PER_CHUNK rows
 * each, at most KERN_BIAS_MAX_CHUNKS and at most KERN_BIAS_PART_MAX floats
 * in all; then longer chunks), else 0. 768 KiB for 8192 rows of 768. */
size_t kern_bias_grad_scratch_bytes(int64_t rows, int64_t cols);
#define KERN_BIAS_ROWS_PER_CHUNK 256
#define KERN_BIAS_MAX_CHUNKS 1024
#define KERN_BIAS_PART_MAX ((int64_t)1 << 22) /* floats: 16 MiB of partials at most */
/* db[c] ← Σ_r dy[r,c] + beta·db[c] for dy [rows, cols]; when beta is 0, db is
 * not read (it may hold NaN). rows may be 0. The rows are cut into chunks
 * (kern_bias_grad_scratch_bytes), each summed by its own blocks into
 * scratch, then the chunks are added in chunk order: deterministic (the
 * chunking depends on the shape only), no atomics, and the whole GPU busy
 * at C = 768. scratch: at least kern_bias_grad_scratch_bytes (NULL when that
 * is 0; smaller: cudaErrorInvalidValue, nothing enqueued), in use until the
 * stream passes this point. db must not overlap dy. */
int kern_bias_grad(const float *dy, float *db, int64_t rows, int64_t cols, float beta, void *scratch,
                   size_t scratch_bytes, void *stream);
/* y ← max(x, 0) (NaN gives 0); y may alias x. */
int kern_relu_fwd(const float *x, float *y, int64_t n, void *stream);
/* dx ← y > 0 ? dy : 0 where y is the ReLU output; dx may alias dy or y. */
int kern_relu_bwd(const float *y, const float *dy, float *dx, int64_t n, void *stream);
/* Exact GELU, y ← x·Φ(x) = ½x(1 + erf(x/√2)); y may alias x. */
int kern_gelu_fwd(const float *x, float *y, int64_t n, void *stream);
/* dx ← dy·(Φ(x) + x·φ(x)) where x is the GELU input; dx may alias dy or x. */
int kern_gelu_bwd(const float *x, const float *dy, float *dx, int64_t n, void *stream);
/* Softmax cross-entropy over the rows of logits [rows, cols] with labels
 * [rows] in [0, cols) (not checked here): losses[r] ← −log softmax(x_r)[label],
 * dlogits[r,:] ← grad_scale·(softmax(x_r) − onehot(label)). Rows are `ld`
 * floats apart (ld >= cols; padded rows, tensor.h: the ld − cols floats
 * after each row are neither read nor written). dlogits may alias
 * logits (every logit of a row is read before any of the row is written);
 * losses must not overlap either. One warp per row. */
int kern_softmax_xent(const float *logits, const int32_t *labels, float *dlogits, float *losses,
                      int64_t rows, int64_t cols, int64_t ld, float grad_scale, void *stream);

/* Vocabulary-parallel cross-entropy (tensor.h's tensor_xent_shard_stats and
 * _grad): logits [rows, cols] hold the classes [lo, lo + cols), rows `ld`
 * floats apart as kern_softmax_xent's (dlogits alike). stats:
 * lse[r] ← the shard's log-sum-exp of row r, target[r] ← its label's logit
 * or 0 when the label is elsewhere. grad: with L[r] the log-sum-exp of
 * parts[0..nparts)[r] (parts [nparts, rows], summed in double in part
 * order), losses[r] ← L − target[r] (losses NULL: not written),
 * dlogits ← grad_scale·(exp(logits − L) − onehot(label − lo)); dlogits may
 * alias logits (each element is read by the lane that writes it). One warp
 * per row. */
int kern_xent_shard_stats(const float *logits, const int32_t *labels, float *lse, float *target, int64_t rows,
                          int64_t cols, int64_t ld, int64_t lo, void *stream);
int kern_xent_shard_grad(const float *logits, const int32_t *labels, const float *parts, int64_t nparts,
                         const float *target, float *dlogits, float *losses, int64_t rows, int64_t cols, int64_t ld,
                         int64_t lo, float grad_scale, void *stream);

/* SGD with momentum, PyTorch semantics: g' = g + wd·p; m ← μ·m + g';
 * p ← p − lr·(nesterov ? g' + μ·m : m). With μ = 0 the momentum buffer is
 * neither read nor written and `m` may be NULL: p ← p − lr·g'. */
int kern_sgd_step(float *p, const float *g, float *m, int64_t n, float lr, float momentum,
                  float weight_decay, bool nesterov, void *stream);
/* AdamW, PyTorch semantics, step t >= 1: p ← p·(1 − lr·wd);
 * m ← β1·m + (1−β1)·g; v ← β2·v + (1−β2)·g²;
 * p ← p − lr/(1−β1^t) · m / (√v / √(1−β2^t) + eps). The bias corrections are
 * computed on the host in double. */
int kern_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
                    float beta2, float eps, float weight_decay, int64_t step, void *stream);

/* y ← a·x + b·y; y may alias x. */
int kern_axpby(float a, const float *x, float b, float *y, int64_t n, void *stream);
/* x ← a·x. */
int kern_scale(float *x, float a, int64_t n, void *stream);
/* x ← v. */
int kern_fill(float *x, float v, int64_t n, void *stream);

/* ---- reductions ----------------------------------------------------------------
 * Each writes one float partial per block to partials[0 .. *nparts) with
 * *nparts <= KERN_REDUCE_MAX_BLOCKS (0 when n is 0); the caller copies them to
 * the host after the stream reaches this point and sums them in double.
 * Within a block, values are accumulated in float. */
int kern_sum_partials(const float *x, int64_t n, float *partials, int *nparts, void *stream);
int kern_sq_norm_partials(const float *x, int64_t n, float *partials, int *nparts, void *stream);
/* Partials of ‖x − y‖². */
int kern_sq_dist_partials(const float *x, const float *y, int64_t n, float *partials, int *nparts,
                          void *stream);
/* *count ← number of NaN or ±Inf among x[0..n) (a device uint64 counter,
 * zeroed by the launcher on the stream first). */
int kern_count_nonfinite(const float *x, int64_t n, uint64_t *count, void *stream);

/* ---- count-sketch ----------------------------------------------------------------
 * out[k] (device doubles) ← the count-sketch of x: zeroed on the stream, then
 * out[b(i)] += s(i)·x[i] with b, s from tensor_sketch_bucket (tensor/tensor.h),
 * reproduced bit for bit in device code. k is a power of two in [1, 2^20].
 * Buckets accumulate in float per block (shared memory) when
 * k <= KERN_SKETCH_SHARED_MAX and are then added to `out` with double atomics;
 * the order of additions, hence the last bits, varies from run to run. */
int kern_count_sketch(const float *x, int64_t n, uint64_t seed, int k, double *out, void *stream);

/* The device hash compiled for the host, so that tests can prove it equals
 * tensor_sketch_hash without a GPU. */
uint32_t kern_sketch_hash_host(uint64_t seed, uint64_t i);

/* ---- transformer ops (kernels/nn.cu) -----------------------------------------
 * The kernels behind tensor.h's transformer ops. Shapes: r sequences of t
 * positions, width c, nh heads of hs = c/nh columns, v vocabulary rows. The
 * contracts (what is overwritten, what accumulates) are tensor.h's; here
 * only what the launchers add. Sums are in float, in an order fixed by the
 * shapes alone (never by timing, atomics or the device model), so every
 * launcher is deterministic: the same inputs give the same bits on every
 * run on one GPU model. Launchers that need scratch memory take a device
 * buffer from the caller, who asks its size first (the *_scratch calls). */

/* out ← x + y; out may alias x or y. */
int kern_add(const float *x, const float *y, float *out, int64_t n, void *stream);
/* GELU, tanh form: y ← x·σ(2u) = x/2·(1 + tanh u), u = √(2/π)(x + 0.044715x³),
 * computed from exp(−2|u|) so that neither tail cancels; y may alias x. */
int kern_gelu_tanh_fwd(const float *x, float *y, int64_t n, void *stream);
/* dx ← dy·(σ(2u) + x/2·sech²(u)·du/dx); dx may alias dy or x. */
int kern_gelu_tanh_bwd(const float *x, const float *dy, float *dx, int64_t n, void *stream);

/* out (r·t, c) ← wte[tokens[i] − lo] + wpe[i mod t] for the vocabulary
 * shard [lo, lo + v) that wte (v, c) holds (lo 0 and v the whole vocabulary
 * for the plain op): a token outside the shard gives zeros from wte, and a
 * NULL wpe adds nothing. One block per row, threads over channels. */
int kern_embedding_fwd(const int32_t *tokens, const float *wte, const float *wpe, float *out, int64_t r, int64_t t,
                       int64_t c, int64_t lo, int64_t v, void *stream);
/* *bytes ← the scratch kern_embedding_bwd needs for n = r·t tokens, v
 * vocabulary rows and width c. Asks CUB for its sort's temporary size, so
 * the calling thread needs the device current (as every launcher). Returns
 * 0 or a CUDA error (n or v past 32-bit limits: cudaErrorInvalidValue). */
int kern_embedding_bwd_scratch(int64_t n, int64_t v, int64_t c, size_t *bytes);
/* Sorted positions per piece of the embedding backward (below). */
#define KERN_EMB_PIECE 64
/* dwte[tokens[i] − lo] += dout[i] and (dwpe not NULL) dwpe[p] +=
 * Σ_s dout[s·t + p]. No atomics: the (token, i) pairs are sorted by token
 * with CUB's stable radix sort, and the sorted positions are cut into
 * pieces of KERN_EMB_PIECE. A token's run of positions is summed piece by
 * piece: the part in the piece where the run starts is added in ascending
 * i onto the value already there, then each later piece's sum (taken in
 * ascending i, by its own warp) in piece order. So the result is
 * deterministic, bitwise equal between runs, and bitwise the plain loop's
 * for every token whose run does not reach past its first piece with two
 * or more positions; a longer run (a frequent token) differs from the plain
 * loop by the rounding of the regrouped sum, and costs one warp about
 * KERN_EMB_PIECE + run/KERN_EMB_PIECE adds instead of `run`. dwpe is summed
 * in the reference's order (bitwise). Tokens outside the shard [lo, lo + v)
 * (for the whole table lo = 0: any token < 0 or >= v) are skipped: nothing
 * is read or written for them.
 * scratch: scratch_bytes from kern_embedding_bwd_scratch (smaller:
 * cudaErrorInvalidValue, nothing enqueued); it is in use until the stream
 * passes this point. */
int kern_embedding_bwd(const int32_t *tokens, const float *dout, float *dwte, float *dwpe, int64_t r, int64_t t,
                       int64_t c, int64_t lo, int64_t v, void *scratch, size_t scratch_bytes, void *stream);

/* LayerNorm forward over rows of x (rows, c): one warp per row, two passes
 * (mean, then the biased variance of x − mean), rstd = 1/sqrt(var + eps).
 * y must not alias x. */
int kern_layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                       int64_t rows, int64_t c, float eps, void *stream);
/* Bytes of scratch kern_layernorm_bwd needs: two floats per column per chunk
 * of rows (at most KERN_LN_MAX_CHUNKS chunks; 6 MiB for c = 768). */
size_t kern_layernorm_bwd_scratch_bytes(int64_t rows, int64_t c);
#define KERN_LN_ROWS_PER_CHUNK 256
#define KERN_LN_MAX_CHUNKS 1024
/* LayerNorm backward: dx += (one warp per row); dw ← beta·dw + Σ dy·x̂ and
 * db ← beta·db + Σ dy (dw, db not read when beta is 0), summed per chunk of
 * rows into scratch and then over the chunks in order: deterministic,
 * no atomics. scratch as kern_embedding_bwd. dx must not alias x or dy. */
int kern_layernorm_bwd(const float *x, const float *w, const float *mean, const float *rstd, const float *dy,
                       float *dx, float *dw, float *db, int64_t rows, int64_t c, float beta, void *scratch,
                       size_t scratch_bytes, void *stream);

/* Attention helpers; the GEMMs between them are cuBLAS calls made by the
 * backend. "Head layout" is (parts, r, nh, t, hs): part p of sequence s,
 * head h is one contiguous t×hs matrix, batch b = s·nh + h.
 *
 * heads ← x split by head: x (r, t, parts·c) row-major, parts 1 (dout) or
 * 3 (qkv: q, k, v). parts·c must fit in an int. */
int kern_heads_split(const float *x, float *heads, int64_t r, int64_t t, int64_t c, int nh, int parts,
                     void *stream);
/* The inverse: x (r, t, parts·c) ← heads (overwritten, every element). */
int kern_heads_merge(const float *heads, float *x, int64_t r, int64_t t, int64_t c, int nh, int parts,
                     void *stream);
/* Causal softmax of `batches` t×t scaled-score matrices s, in place: row q
 * becomes the probabilities over keys 0..q and exact zeros after q;
 * lse[b·t + q] ← the log-sum-exp of the row's scores 0..q. One warp per
 * row. */
int kern_attn_softmax_fwd(float *s, float *lse, int64_t batches, int64_t t, void *stream);
/* The backward's recomputation: s[row][k] ← exp(s[row][k] − lse[row]) for
 * k <= q, 0 after. */
int kern_attn_probs(float *s, const float *lse, int64_t batches, int64_t t, void *stream);
/* dp (batches, t, t) ← p ⊙ (dp − D)·scale, zero above the diagonal, for the
 * batches b0 .. b0 + batches − 1 (p and dp hold just those), with D of
 * query q of batch b = rowsum(dout ⊙ out) over that head's hs columns of
 * row (s, q); out and dout are (r, t, c). */
int kern_attn_dscores(const float *p, float *dp, const float *out, const float *dout, int64_t b0, int64_t batches,
                      int64_t t, int64_t c, int nh, float scale, void *stream);

/* ---- mixture of experts (kernels/moe.cu) -------------------------------------------
 * The kernels behind tensor.h's tensor_moe_* ops, whose contracts they
 * keep: n tokens of width ch, e experts of cap rows, k choices per token
 * (k >= 1, n·k <= INT32_MAX, and for routing k <= e; else
 * cudaErrorInvalidValue and nothing enqueued: the data ops also take
 * expert parallelism's packed form, e = 1 and k = K); expert, slot [n,k] I32, gate, dgate [n,k]; xe, dxe, ye, dye
 * [e·cap, ch]. No atomics and no scratch: every launcher is deterministic,
 * and the experts, slots and counts are exactly the CPU backend's for the
 * same logits (the same ranking of equal logits). A choice is kept when
 * its expert is in [0, e) and its slot in [0, cap); no other is read. */

/* Routing: one warp per token (softmax, lse, K passes of a warp max over
 * the ranks, gates), then one block per expert that walks the n·k choices
 * in the contract's order with a block-wide prefix sum (slots, assigned,
 * kept) and sums its column of probs (psum). n may be 0 (the counts and
 * psum are still written). */
int kern_moe_route(const float *logits, float *probs, float *lse, int32_t *expert, float *gate, int32_t *slot,
                   int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e, int k, int64_t cap,
                   void *stream);
/* Routing's backward into dlogits [n,e] (overwritten), one warp per token. */
int kern_moe_route_bwd(const float *probs, const float *lse, const int32_t *expert, const float *gate,
                       const float *dgate, const float *daux, float zscale, float *dlogits, int64_t n, int64_t e,
                       int k, void *stream);
/* xe ← 0 (a memset on the stream), then each kept choice's row ← its
 * token's row of x, one block per token. */
int kern_moe_dispatch(const float *x, const int32_t *expert, const int32_t *slot, float *xe, int64_t n, int64_t ch,
                      int k, int64_t e, int64_t cap, void *stream);
/* dx[i,:] += the token's kept rows of dxe in k order (the CPU's adds:
 * bitwise its result), one block per token. */
int kern_moe_dispatch_bwd(const float *dxe, const int32_t *expert, const int32_t *slot, float *dx, int64_t n,
                          int64_t ch, int k, int64_t e, int64_t cap, void *stream);
/* out ← Σ_k gate·ye rows (overwritten), one block per token. */
int kern_moe_combine(const float *ye, const int32_t *expert, const int32_t *slot, const float *gate, float *out,
                     int64_t n, int64_t ch, int k, int64_t e, int64_t cap, void *stream);
/* dye ← 0 (a memset), then one warp per choice: its row of dye ←
 * gate·dout and dgate ← the dot product of dout and ye's row (0 when
 * dropped). */
int kern_moe_combine_bwd(const float *dout, const float *ye, const int32_t *expert, const int32_t *slot,
                         const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k, int64_t e,
                         int64_t cap, void *stream);

#ifdef __cplusplus
}
#endif

#endif /* RUMOR_KERNELS_H */
