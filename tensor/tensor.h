/*
 * tensor — tensors and the compute backends behind one interface.
 *
 * A backend (tensor_backend_t) is one device: the CPU (oneDNN GEMM + plain C)
 * or one CUDA GPU (cuBLAS + kernels/). Tensors are descriptors over memory of
 * one backend. All ops are enqueued in order on the backend's single stream;
 * on the CPU they run at once. Functions returning a value to the host
 * (tensor_sum, tensor_sq_norm, ...) wait for the stream first.
 *
 * Threads: a backend and its tensors belong to one thread at a time (the
 * training thread). Host buffers from tensor_host_alloc may be read by any
 * thread once the copy into them is known complete (tensor_event_query).
 *
 * Errors: set-up calls (open, alloc) return a negative code with a message.
 * Ops on valid tensors cannot fail at run time; a CUDA or cuBLAS failure
 * inside an op is reported with the failing call, file and line, and aborts
 * (the device state is unknown after it). Shape mismatches between operands
 * are bugs in the caller and hit RUMOR_ASSERT.
 */
#ifndef RUMOR_TENSOR_H
#define RUMOR_TENSOR_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

#define TENSOR_MAX_DIMS 4

enum tensor_dtype {
  TENSOR_F32 = 0,
  TENSOR_I32 = 1,  /* class labels */
  TENSOR_F16 = 2,  /* storage and wire only; no compute ops */
  TENSOR_BF16 = 3, /* storage and wire only; no compute ops */
};
size_t tensor_dtype_size(enum tensor_dtype dt);
const char *tensor_dtype_name(enum tensor_dtype dt); /* "F32", "I32", "F16", "BF16" */

enum tensor_device { TENSOR_DEVICE_CPU = 0, TENSOR_DEVICE_CUDA = 1 };

typedef struct tensor_backend *tensor_backend_t;
typedef struct tensor_event *tensor_event_t;

/* A tensor: `data` points into memory of backend `be` (device memory for
 * CUDA). Row-major; `shape[0..ndim)` are the extents; unused extents are 1. */
struct tensor {
  void *data;
  int64_t shape[TENSOR_MAX_DIMS];
  int ndim;
  enum tensor_dtype dtype;
  tensor_backend_t be;
  bool owner; /* allocated by tensor_alloc; tensor_free releases it */
};

/* ---- backends ---------------------------------------------------------------- */

/* Opens a backend from a device spec: "cpu", "cuda", "cuda:N", or "auto"
 * (CUDA device 0 when one is usable, else the CPU, logging the fall-back once
 * per process). An explicit "cuda" without a usable GPU is an error.
 * Returns 0, or RUMOR_EDEVICE / RUMOR_EFORMAT with a message naming the spec. */
int tensor_backend_open(const char *spec, tensor_backend_t *out, struct rumor_err *e) RUMOR_MUST_CHECK;
void tensor_backend_close(tensor_backend_t be);
enum tensor_device tensor_backend_device(tensor_backend_t be);
/* "cpu" or "cuda:0"; a longer description (GPU model, memory) goes to the log
 * at open. The string lives as long as the backend. */
const char *tensor_backend_name(tensor_backend_t be);
/* CPU: the number of threads oneDNN and the plain loops may use (>= 1).
 * Ignored by CUDA. */
void tensor_backend_set_threads(tensor_backend_t be, int threads);
/* GEMMs in TF32 (on: inputs rounded to 10 mantissa bits on the tensor
 * cores, FP32 accumulation) or plain FP32 (off, the default at open). CUDA:
 * every GEMM enqueued after the call, including attention's batched ones.
 * The CPU backend accepts the switch and changes nothing: its GEMMs stay
 * FP32. */
void tensor_backend_set_tf32(tensor_backend_t be, bool on);
/* The device's free and total memory in bytes; false where not known (the
 * CPU: host memory is not the backend's to count). */
bool tensor_backend_mem_info(tensor_backend_t be, size_t *free_bytes, size_t *total_bytes);
/* Waits until every op enqueued on `be` has finished. */
void tensor_backend_sync(tensor_backend_t be);
/* Number of usable CUDA devices: 0 when built without CUDA or with no GPU. */
int tensor_cuda_device_count(void);
/* True when this binary contains the CUDA backend. */
bool tensor_cuda_compiled(void);

/* ---- memory -------------------------------------------------------------------- */

/* Allocates a tensor of `ndim` extents on `be`, contents undefined.
 * Returns 0, or -ENOMEM / RUMOR_EDEVICE with the size in the message. */
int tensor_alloc(struct tensor *t, tensor_backend_t be, enum tensor_dtype dt, int ndim,
                 const int64_t *shape, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Frees an owning tensor (no-op for views); leaves `t` zeroed. */
void tensor_free(struct tensor *t);
/* A non-owning view of `ndim`/`shape` starting `offset` elements into `base`.
 * The view must fit inside base (asserted). */
struct tensor tensor_view(const struct tensor *base, int64_t offset, int ndim, const int64_t *shape);
/* A 1-D view of the whole tensor. */
struct tensor tensor_flat(const struct tensor *t);
int64_t tensor_numel(const struct tensor *t);
size_t tensor_nbytes(const struct tensor *t);

/* The elements [offset, offset + count) of `t` are not needed until they
 * are written again (ZeRO's sharded parameters and gradients between
 * uses): the backend may give back the memory they occupy, and they read as
 * unspecified values until tensor_recommit takes it again. Waits for the
 * work enqueued on `t`'s backend first. On the CPU the whole pages inside
 * the range are returned to the system (madvise MADV_DONTNEED: a page is
 * zero and costs nothing until touched again), so the resident memory
 * follows what is live. On CUDA, in a buffer of at least 32 MiB allocated
 * while the backend was discardable (tensor_backend_set_discardable), the
 * whole chunks of device memory inside the range (2 MiB) go back to the
 * device; they read as zeros, and a write to one before tensor_recommit
 * faults. Elsewhere the memory stays. */
void tensor_discard(struct tensor *t, int64_t offset, int64_t count);

/* [offset, offset + count) of `t` is about to be written: memory that
 * tensor_discard gave back there is taken again (zero-filled, in stream
 * order), the rest is untouched. Returns 0, or -ENOMEM with the reason in
 * `e` when the device has no room for it. Nothing to do on the CPU. */
int tensor_recommit(struct tensor *t, int64_t offset, int64_t count, struct rumor_err *e);

/* Buffers allocated while `on` may be given back in parts (tensor_discard)
 * and taken again (tensor_recommit). On CUDA those of at least 16 chunks
 * (32 MiB) are mapped chunk by chunk (the driver's virtual memory
 * management) where the driver offers it: a smaller one would waste more in
 * its rounding to whole chunks than it could give back. Elsewhere, and on
 * the CPU (where any buffer can), nothing changes. Off at open. */
void tensor_backend_set_discardable(tensor_backend_t be, bool on);

/* The device memory the backend's buffers hold now, and the most they held
 * at once since the backend opened or the last reset (tensor_alloc, less
 * what tensor_discard gave back), in bytes: not the ops' own scratch nor
 * the CUDA context. -1 where not known (the CPU: see the process's RSS).
 * `reset`: the count of the most starts again from what is held now. */
int64_t tensor_backend_live_bytes(tensor_backend_t be);
int64_t tensor_backend_peak_bytes(tensor_backend_t be, bool reset);

/* A tensor shaped like `like` that mirrors the host buffer `host` (from
 * tensor_host_alloc, at least as large as `like`): on the CPU a view of the
 * buffer itself, elsewhere a new device buffer. After the host buffer
 * changes, tensor_mirror_refresh makes the mirror hold it (a copy on a GPU,
 * nothing on the CPU). Free it with tensor_free. Returns 0, or an allocation
 * error. */
int tensor_mirror_host(struct tensor *out, const struct tensor *like, void *host, struct rumor_err *e) RUMOR_MUST_CHECK;
void tensor_mirror_refresh(struct tensor *mirror, const void *host);

/* Host memory suited to fast and asynchronous copies with `be`: pinned
 * (page-locked) for CUDA, 64-byte aligned for the CPU. NULL on failure. */
void *tensor_host_alloc(tensor_backend_t be, size_t bytes);
void tensor_host_free(tensor_backend_t be, void *p);

/* Copies between host memory and a tensor, `bytes` from element `offset`
 * (counted in the tensor's dtype). The synchronous forms return when the
 * data has arrived. The async forms only enqueue: `host` must be from
 * tensor_host_alloc and must stay untouched until an event recorded after
 * the copy completes. */
void tensor_copy_from_host(struct tensor *dst, int64_t offset, const void *host, size_t bytes);
void tensor_copy_to_host(const struct tensor *src, int64_t offset, void *host, size_t bytes);
void tensor_copy_from_host_async(struct tensor *dst, int64_t offset, const void *host, size_t bytes);
void tensor_copy_to_host_async(const struct tensor *src, int64_t offset, void *host, size_t bytes);
/* Copies `bytes` from element `offset` of src into `host` beside the
 * backend's stream: the copy starts once everything enqueued so far has
 * finished, but nothing enqueued later waits for it (on CUDA it runs on a
 * second stream, so a copy engine moves it while kernels run). `done` is
 * recorded when it has finished. Neither src's range nor `host` (from
 * tensor_host_alloc) may be written until `done` completes. The CPU copies
 * at once. Same thread as the rest of the backend's work. */
void tensor_copy_to_host_beside(const struct tensor *src, int64_t offset, void *host, size_t bytes,
                                tensor_event_t done);
/* dst ← src, same numel and dtype, same backend. */
void tensor_copy(struct tensor *dst, const struct tensor *src);

/* Events mark a point in the backend's stream (CPU events are complete as
 * soon as they are recorded). */
tensor_event_t tensor_event_create(tensor_backend_t be);
void tensor_event_destroy(tensor_event_t ev);
void tensor_event_record(tensor_event_t ev);
/* True when all work before the last record has finished (an event never
 * recorded counts as complete); never blocks. */
bool tensor_event_query(tensor_event_t ev);
void tensor_event_wait(tensor_event_t ev);

/* ---- ops (F32 unless stated; all tensors on one backend) ------------------------- */

/* C ← alpha·op(A)·op(B) + beta·C, row-major 2-D. op(A) is [M,K] (A is [K,M]
 * when trans_a), op(B) is [K,N] (B is [N,K] when trans_b), C is [M,N]. */
void tensor_gemm(bool trans_a, bool trans_b, float alpha, const struct tensor *a,
                 const struct tensor *b, float beta, struct tensor *c);

/* Padded rows. A matrix [R, cols] may live in the first `cols` columns of
 * a 2-D tensor [R, ld] (cols <= ld; the ld − cols columns after them in
 * each row are padding, and ld, the tensor's shape[1], is the row stride).
 * GPT pads its logits' rows to a multiple of 64 floats, so that the tied
 * head's products and the cross-entropy read and write aligned rows on a
 * GPU (model.h, model_logits_stride). The ops that take a `cols` read and
 * write only those leading columns of each row: padding is never read and
 * is left as it was (it may hold anything, NaN included). */

/* tensor_gemm on padded rows: A, B and C are the leading a_cols, b_cols
 * and c_cols columns of a, b and c (each at most its tensor's shape[1]);
 * the shapes must agree as tensor_gemm's do with those widths.
 * tensor_gemm is this with every width its tensor's shape[1]. */
void tensor_gemm_cols(bool trans_a, bool trans_b, float alpha, const struct tensor *a, int64_t a_cols,
                      const struct tensor *b, int64_t b_cols, float beta, struct tensor *c, int64_t c_cols);
/* y[r,c] += bias[c] for y [R,C], bias [C]. */
void tensor_bias_add(struct tensor *y, const struct tensor *bias);
/* db[c] ← beta·db[c] + Σ_r dy[r,c]. */
void tensor_bias_grad(const struct tensor *dy, struct tensor *db, float beta);
/* y ← max(x, 0); y may alias x. */
void tensor_relu_fwd(const struct tensor *x, struct tensor *y);
/* dx ← dy · [y > 0], where y is the ReLU output; dx may alias dy. */
void tensor_relu_bwd(const struct tensor *y, const struct tensor *dy, struct tensor *dx);
/* Exact GELU: y ← x·Φ(x) (erf form, as PyTorch's default); y may alias x. */
void tensor_gelu_fwd(const struct tensor *x, struct tensor *y);
/* dx ← dy · GELU'(x), where x is the GELU input; dx may alias dy. */
void tensor_gelu_bwd(const struct tensor *x, const struct tensor *dy, struct tensor *dx);
/* Softmax cross-entropy over rows of logits [R,C] with I32 labels [R]
 * (0 <= label < C, checked by the caller when data is loaded).
 * losses [R] ← −log softmax(logits)[label]; dlogits [R,C] ←
 * grad_scale·(softmax − onehot). dlogits may alias logits. */
void tensor_softmax_xent(const struct tensor *logits, const struct tensor *labels,
                         struct tensor *dlogits, struct tensor *losses, float grad_scale);
/* The same over padded rows: the classes are the first `cols` columns of
 * logits [R, ld] (0 <= label < cols); dlogits [R, ld] receives the
 * gradient in those columns, its padding untouched. tensor_softmax_xent is
 * this with cols = ld, bit for bit. */
void tensor_softmax_xent_cols(const struct tensor *logits, int64_t cols, const struct tensor *labels,
                              struct tensor *dlogits, struct tensor *losses, float grad_scale);

/* Vocabulary-parallel softmax cross-entropy (Megatron's): logits [R,ld]
 * hold the classes [lo, lo + v) of each row in their first v = `cols`
 * columns (padded rows: cols <= ld; the padding is never read, and dlogits'
 * is left as it was), the rest of the vocabulary being other shards' (no
 * rank holds a whole row). Two passes around the caller's all-reduce:
 *
 * tensor_xent_shard_stats: lse [R] ← log Σ_c exp(logits[r,c]) (this shard's
 * log-sum-exp, computed stably) and target [R] ← logits[r, labels[r] − lo]
 * when the label is in the shard, else 0.
 *
 * The caller then gathers every shard's lse into parts [S,R] (shard s's in
 * row s) and sums target over the shards, and calls
 * tensor_xent_shard_grad: with L[r] = log Σ_s exp(parts[s,r]) (the whole
 * row's log-sum-exp, in double, in shard order), losses [R] ← L − target
 * (NULL: not written) and dlogits[r, 0..v) ← grad_scale·(exp(logits − L) −
 * onehot(labels − lo)). dlogits may alias logits. Labels are in [0, the
 * whole vocabulary) (checked by the caller when data is loaded). Equal to
 * tensor_softmax_xent's within float rounding (not bitwise). */
void tensor_xent_shard_stats(const struct tensor *logits, int64_t cols, const struct tensor *labels, int64_t lo,
                             struct tensor *lse, struct tensor *target);
void tensor_xent_shard_grad(const struct tensor *logits, int64_t cols, const struct tensor *labels, int64_t lo,
                            const struct tensor *parts, const struct tensor *target, struct tensor *dlogits,
                            struct tensor *losses, float grad_scale);

/* out ← x + y (element-wise; out may alias x or y). */
void tensor_add(const struct tensor *x, const struct tensor *y, struct tensor *out);

/* ---- transformer ops (F32; I32 tokens) ------------------------------------------
 * Shapes are read from the tensors; a batch of R sequences of T positions
 * with width C may be shaped (R, T, C) or (R·T, C) where only the element
 * count and the last extent matter. Gradient contracts say which outputs
 * are overwritten and which accumulate: a tensor that several paths of a
 * transformer write (the residual stream, a tied embedding) accumulates. */

/* Token and position embedding: out[r,t,:] ← wte[tokens[r,t],:] + wpe[t,:]
 * for tokens I32 (R, T) with 0 <= token < V (the data loader checks), wte
 * (V, C), wpe (Tmax, C) with T <= Tmax, out (R, T, C). A token outside
 * [0, V) breaks that precondition but never memory: both backends treat it
 * as the shard forms below do (a zero row; no gradient), reading and
 * writing nothing outside wte and dwte. */
void tensor_embedding_fwd(const struct tensor *tokens, const struct tensor *wte, const struct tensor *wpe,
                          struct tensor *out);
/* Its backward, accumulating: dwte[tokens[r,t],:] += dout[r,t,:] and
 * dwpe[t,:] += Σ_r dout[r,t,:]. Deterministic (the same sums in the same
 * order on every run) on both backends. The CPU adds each row's terms in
 * position order; CUDA does too for a token seen at most twice, and sums a
 * frequent token's positions in fixed pieces (kernels.h, KERN_EMB_PIECE),
 * so there dwte may differ from the CPU's by the rounding of that
 * regrouping (about 1e-7 times the token's count, for unit terms). */
void tensor_embedding_bwd(const struct tensor *tokens, const struct tensor *dout, struct tensor *dwte,
                          struct tensor *dwpe);

/* The vocabulary-parallel forms (Megatron's, for a tensor-parallel rank
 * that holds the vocabulary rows [lo, lo + v) of wte, wte (v, C)):
 * out[r,t,:] ← (lo <= tokens[r,t] < lo + v ? wte[tokens[r,t] − lo,:] : 0)
 * + (wpe ? wpe[t,:] : 0). A token outside the shard is not an error:
 * another shard holds its row. With lo 0 and every token inside it is
 * tensor_embedding_fwd bit for bit; so is the sum over the shards of their
 * outputs when exactly one shard passes wpe (each element is then the sum
 * of one wte value, one wpe value and zeros). */
void tensor_embedding_shard_fwd(const struct tensor *tokens, const struct tensor *wte, int64_t lo,
                                const struct tensor *wpe, struct tensor *out);
/* Its backward, accumulating in tensor_embedding_bwd's order:
 * dwte[tokens[r,t] − lo,:] += dout[r,t,:] for the tokens in the shard, and
 * (when dwpe is not NULL) dwpe[t,:] += Σ_r dout[r,t,:]. */
void tensor_embedding_shard_bwd(const struct tensor *tokens, const struct tensor *dout, int64_t lo,
                                struct tensor *dwte, struct tensor *dwpe);

/* LayerNorm over the last extent C of x (rows R), as torch.nn.LayerNorm
 * with eps 1e-5 (biased variance): y ← (x − μ)·σ⁻¹·w + b with w, b (C);
 * mean and rstd (R) receive μ and σ⁻¹ = 1/sqrt(var + eps) for the backward.
 * y must not alias x. */
#define TENSOR_LAYERNORM_EPS 1e-5f
void tensor_layernorm_fwd(const struct tensor *x, const struct tensor *w, const struct tensor *b, struct tensor *y,
                          struct tensor *mean, struct tensor *rstd);
/* Its backward from dy: dx += dL/dx (accumulates: x is the residual
 * stream), dw ← beta·dw + Σ_r dy·x̂, db ← beta·db + Σ_r dy, with x̂ the
 * normalised x recomputed from mean and rstd. dx must not alias dy or x. */
void tensor_layernorm_bwd(const struct tensor *x, const struct tensor *w, const struct tensor *mean,
                          const struct tensor *rstd, const struct tensor *dy, struct tensor *dx, struct tensor *dw,
                          struct tensor *db, float beta);

/* Causal multi-head self-attention as GPT-2's, without dropout: qkv
 * (R, T, 3C) holds each position's query, key and value (columns [0, C),
 * [C, 2C), [2C, 3C)), each split into `nheads` heads of hs = C/nheads
 * columns (head h at columns h·hs). Per sequence and head,
 * out ← softmax(q·kᵀ/√hs, keys t' <= t only)·v, the heads side by side in
 * out (R, T, C). lse (R, nheads, T) receives each query's log-sum-exp of its
 * scaled scores: the backward recomputes the probabilities from it, so no
 * T×T matrix is kept between the passes. */
void tensor_attention_fwd(const struct tensor *qkv, int nheads, struct tensor *out, struct tensor *lse);
/* Its backward: dqkv (R, T, 3C) ← dL/dqkv (overwritten) from dout (R, T, C),
 * given the forward's qkv, out and lse. */
void tensor_attention_bwd(const struct tensor *qkv, const struct tensor *out, const struct tensor *lse,
                          const struct tensor *dout, int nheads, struct tensor *dqkv);

/* GELU in GPT-2's tanh form: y ← x/2·(1 + tanh(√(2/π)·(x + 0.044715·x³)))
 * (torch.nn.GELU(approximate="tanh")); y may alias x. */
void tensor_gelu_tanh_fwd(const struct tensor *x, struct tensor *y);
/* dx ← dy·d/dx GELU_tanh(x), x the forward's input; dx may alias dy. */
void tensor_gelu_tanh_bwd(const struct tensor *x, const struct tensor *dy, struct tensor *dx);

/* ---- mixture of experts (F32; I32 indices and counts) ----------------------------
 *
 * A sparse MLP block (Switch Transformer, GShard) over N tokens of width C
 * and E experts, each holding `cap` rows of its input buffer (capacity:
 * the caller's ceil(factor · N · K / E)). The experts' matrix products run
 * on [E·cap, C] buffers, expert e on rows [e·cap, (e+1)·cap) (tensor_gemm
 * on views, one per expert). Every op is deterministic: the same inputs
 * give the same bits, run to run, whatever the thread count; the CPU and
 * CUDA backends agree within float rounding (exactly on indices, slots and
 * counts, given the same logits). */

/* Routing. probs[n,:] ← softmax(logits[n,:]) and lse[n] ← its
 * log-sum-exp. Token n's K largest probabilities, largest first (ties:
 * the lower expert index), give expert[n,k] and gate[n,k]: the
 * probability itself for K = 1, renormalised over the K to sum 1 for K > 1.
 * The K are picked by comparing the logits (the softmax keeps their
 * order), so every backend picks the same experts from the same logits
 * whatever its exp's rounding; logits equal as floats (−0 = +0) tie.
 * slot[n,k] is the row of expert[n,k]'s buffer the choice takes, filled in
 * the order (k = 0, n = 0..N−1), then (k = 1, n = 0..N−1), ... (first
 * choices before second choices, GShard), or −1 when the expert's `cap`
 * rows are already taken (the choice is dropped: the token skips that
 * expert, its residual carries it). assigned[e] ← the choices of expert e
 * (dropped ones included), kept[e] ← its rows filled (<= cap), psum[e] ←
 * Σ_n probs[n,e]. Shapes: logits, probs [N,E]; lse [N]; expert, slot
 * [N,K] I32; gate [N,K]; assigned, kept [E] I32; psum [E]. 1 <= K <= E. */
void tensor_moe_route(const struct tensor *logits, int k, int64_t cap, struct tensor *probs, struct tensor *lse,
                      struct tensor *expert, struct tensor *gate, struct tensor *slot, struct tensor *assigned,
                      struct tensor *kept, struct tensor *psum);
/* Its backward into the router's logits: dlogits[n,:] ← the softmax's
 * backward (through probs) of dprob[n,e] = daux[e] + the gates' part,
 * where the gates' part is dgate[n,k] at e = expert[n,k] for K = 1, and
 * for K > 1 the renormalisation's backward over the K chosen
 * ((dgate[n,k] − Σ_j dgate[n,j]·gate[n,j]) / Σ_j probs[n,expert[n,j]]);
 * plus, added to dlogits[n,e] after the softmax's backward (d lse/d logits
 * = probs), zscale · lse[n] · probs[n,e] (the router z-loss's gradient:
 * zscale = 2 · β · the loss scale / N for β · mean_n lse[n]²). daux [E]
 * carries the load-balancing loss's gradient (α · E · f_e / N times the
 * loss scale, f_e held constant as in Switch). dgate [N,K] (0 for dropped
 * choices); dlogits [N,E] is overwritten. */
void tensor_moe_route_bwd(const struct tensor *probs, const struct tensor *lse, const struct tensor *expert,
                          const struct tensor *gate, const struct tensor *dgate, const struct tensor *daux,
                          float zscale, struct tensor *dlogits);
/* xe[expert[n,k]·cap + slot[n,k], :] ← x[n,:] for every kept choice; rows
 * no choice fills are zeroed. x [N,C]; xe [E·cap, C]. Here and in the
 * three ops below a choice is kept when 0 <= slot[n,k] < cap and
 * 0 <= expert[n,k] < E (route's output always is, or has slot −1); any
 * other is treated as dropped, so no index reaches outside the buffers. */
void tensor_moe_dispatch(const struct tensor *x, const struct tensor *expert, const struct tensor *slot, int64_t cap,
                         struct tensor *xe);
/* Its backward, accumulating: dx[n,:] += Σ_k dxe[expert[n,k]·cap + slot[n,k], :]
 * over token n's kept choices, k in order. */
void tensor_moe_dispatch_bwd(const struct tensor *dxe, const struct tensor *expert, const struct tensor *slot,
                             int64_t cap, struct tensor *dx);
/* out[n,:] ← Σ_k gate[n,k] · ye[expert[n,k]·cap + slot[n,k], :] over token
 * n's kept choices, k in order (0 for a token with none). ye [E·cap, C];
 * out [N,C] is overwritten. */
void tensor_moe_combine(const struct tensor *ye, const struct tensor *expert, const struct tensor *slot,
                        const struct tensor *gate, int64_t cap, struct tensor *out);
/* Its backward: dye[expert[n,k]·cap + slot[n,k], :] ← gate[n,k] · dout[n,:]
 * for every kept choice, other rows 0 (dye overwritten); dgate[n,k] ←
 * dout[n,:] · ye[expert[n,k]·cap + slot[n,k], :], 0 for a dropped choice. */
void tensor_moe_combine_bwd(const struct tensor *dout, const struct tensor *ye, const struct tensor *expert,
                            const struct tensor *slot, const struct tensor *gate, int64_t cap, struct tensor *dye,
                            struct tensor *dgate);

/* SGD with momentum, PyTorch semantics: g ← g + wd·p; m ← μ·m + g;
 * p ← p − lr·(nesterov ? g + μ·m : m). `mom` may be NULL when μ = 0. */
struct tensor_sgd {
  float lr, momentum, weight_decay;
  bool nesterov;
};
void tensor_sgd_step(struct tensor *params, const struct tensor *grads, struct tensor *mom,
                     const struct tensor_sgd *hp);

/* AdamW, PyTorch semantics: p ← p·(1 − lr·wd); m ← β1·m + (1−β1)·g;
 * v ← β2·v + (1−β2)·g²; p ← p − lr·(m/(1−β1^t)) / (sqrt(v/(1−β2^t)) + eps).
 * `step` is t, counted from 1. */
struct tensor_adamw {
  float lr, beta1, beta2, eps, weight_decay;
  int64_t step;
};
void tensor_adamw_step(struct tensor *params, const struct tensor *grads, struct tensor *m,
                       struct tensor *v, const struct tensor_adamw *hp);

/* y ← a·x + b·y. */
void tensor_axpby(float a, const struct tensor *x, float b, struct tensor *y);
void tensor_scale(struct tensor *x, float a);
void tensor_fill(struct tensor *x, float v);
/* Reductions, accumulated in double (CPU) or float partials summed in double
 * (CUDA); they wait for the stream. */
double tensor_sum(const struct tensor *x);
double tensor_sq_norm(const struct tensor *x);
double tensor_sq_dist(const struct tensor *x, const struct tensor *y); /* ‖x − y‖² */
/* What gossip checks before averaging `y` into `x`, in one pass where the
 * backend has one: the non-finite values of y, ‖y − x‖² and ‖x‖². */
struct tensor_diff_stats {
  int64_t nonfinite_y;
  double sq_dist, sq_norm_x;
};
void tensor_diff_stats(const struct tensor *x, const struct tensor *y, struct tensor_diff_stats *out);
/* Number of NaN or ±Inf elements. */
int64_t tensor_count_nonfinite(const struct tensor *x);

/* Count-sketch of x into k buckets (k a power of two, 1 <= k <= 2^20):
 * out[bucket(i)] += sign(i)·x[i] with bucket and sign from
 * tensor_sketch_bucket. Linear in x and distance-preserving in expectation:
 * E‖S(x) − S(y)‖² = ‖x − y‖². `out_host` has k doubles and is overwritten.
 * Waits for the stream. */
void tensor_count_sketch(const struct tensor *x, uint64_t seed, int k, double *out_host);

/* The hash every backend's count-sketch uses, so that sketches made on
 * different devices of one cluster agree. Built from 32-bit multiplies
 * (murmur3's finaliser) so that it vectorises on AVX2 and is cheap on GPUs. */
static inline uint32_t tensor_sketch_mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}
static inline uint32_t tensor_sketch_hash(uint64_t seed, uint64_t i) {
  uint32_t key = tensor_sketch_mix32((uint32_t)(i >> 32) ^ (uint32_t)seed) ^ (uint32_t)(seed >> 32);
  return tensor_sketch_mix32(((uint32_t)i * 0x9e3779b1u) ^ key);
}

/* Where element i goes: a blocked count-sketch. Indices form groups of 8
 * (g = i >> 3, lane = i & 7) and one hash h = tensor_sketch_hash(seed, g)
 * serves a group: its 8 elements go to 8 adjacent buckets
 * ((h >> 8) << 3 | lane) mod k, with sign − where bit `lane` of h is set.
 * Elements of one group never share a bucket (for k >= 8) and elements of
 * different groups get independent signs, so the sketch is unbiased like a
 * plain count-sketch, while a CPU adds a whole group with one vector
 * operation (memory speed instead of one scattered add per element). */
static inline uint32_t tensor_sketch_bucket(uint64_t seed, uint64_t i, int k, bool *negative) {
  uint32_t h = tensor_sketch_hash(seed, i >> 3), lane = (uint32_t)(i & 7);
  *negative = (h >> lane) & 1u;
  return (((h >> 8) << 3) | lane) & (uint32_t)(k - 1);
}

#endif /* RUMOR_TENSOR_H */
