/*
 * The CUDA backend: one GPU, one stream, one cuBLAS handle.
 *
 * Ordering: every op, copy and event record is enqueued on the backend's
 * single non-blocking stream, so ops run on the GPU in the order they were
 * called. Entries that hand a value to the host (reductions, count-sketch,
 * synchronous copies) wait for the stream first; the rest return at once.
 *
 * Threads: a backend belongs to one thread at a time (see tensor.h). Every
 * entry makes the backend's device current in the calling thread first, so
 * a backend may move between threads at step boundaries and several
 * backends (GPUs) may be used from one thread.
 *
 * Errors: tensor_cuda_open and the allocators return errors (NULL from the
 * allocators, after clearing CUDA's last-error state so that a later launch
 * check does not report it). Inside ops, a failing CUDA or cuBLAS call or
 * kernel launch is a panic naming the call, file and line: the device state
 * is unknown after it.
 *
 * Numerics: cuBLAS opens in its default FP32 math mode (no TF32), so GEMMs
 * match the CPU to FP32 rounding; tensor_backend_set_tf32 switches every
 * later GEMM to TF32 tensor cores. Reductions are float partials per block,
 * summed in double on the host.
 *
 * Waiting: the device is set to block the waiting host thread
 * (cudaDeviceScheduleBlockingSync) and events are created with
 * cudaEventBlockingSync, so a stream or event synchronisation sleeps
 * instead of spinning a core the gossip and network threads need.
 *
 * Libraries: cudart is linked statically and cuBLAS is loaded at open
 * (tensor_cublas.h), so a CUDA build starts on a host without either; it
 * then has no usable GPU and "auto" falls back to the CPU.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <limits.h>
#include <math.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>

#include "kernels/kernels.h" /* kern_*: the kernel launchers */
#include "tensor/tensor_cublas.h" /* tensor_cublas: cuBLAS, loaded at run time */
#include "tensor/tensor_cuda_vmm.h" /* buffers that give memory back (tensor_discard) */
#include "tensor/tensor_impl.h"

#ifndef RUMOR_CUDA_ARCHS
#define RUMOR_CUDA_ARCHS "unknown"
#endif

/* A failing CUDA runtime call inside an op: panic with the call text. */
#define CUDA_CHECK(call)                                                                    \
  do {                                                                                      \
    cudaError_t cerr_ = (call);                                                             \
    if (cerr_ != cudaSuccess)                                                               \
      rumor_panic(__FILE__, __LINE__, "%s failed: %s: %s", #call, cudaGetErrorName(cerr_),  \
                  cudaGetErrorString(cerr_));                                               \
  } while (0)

/* A failing cuBLAS call inside an op (cuBLAS is loaded: the backend is open). */
#define CUBLAS_CHECK(call)                                                                         \
  do {                                                                                             \
    cublasStatus_t berr_ = (call);                                                                 \
    if (berr_ != CUBLAS_STATUS_SUCCESS)                                                            \
      rumor_panic(__FILE__, __LINE__, "%s failed: %s: %s", #call, tensor_cublas()->status_name(berr_), \
                  tensor_cublas()->status_string(berr_));                                          \
  } while (0)

/* A kernel launcher from kernels/kernels.h that returned an error. */
#define KERN_CHECK(call)                                                                    \
  do {                                                                                      \
    if ((call) != 0) rumor_panic(__FILE__, __LINE__, "%s failed: %s", #call, kern_last_error()); \
  } while (0)

/* A device buffer that only grows (cuda_scratch_reserve); freed at close. */
struct cuda_scratch {
  void *p;
  size_t cap; /* bytes */
};

struct cuda_backend {
  struct tensor_backend base; /* first: the tensor layer casts */
  int device;                 /* CUDA device ordinal */
  cudaStream_t stream;        /* every op is enqueued here */
  cudaStream_t beside;        /* copies that later ops must not wait for (copy_d2h_beside) */
  cudaEvent_t beside_after;   /* orders a beside copy after the work on `stream` */
  cublasHandle_t blas;        /* bound to `stream` */
  float *d_partials;          /* device [KERN_REDUCE_MAX_BLOCKS]: reduction partials */
  float *h_partials;          /* pinned host [KERN_REDUCE_MAX_BLOCKS]: their copy */
  uint64_t *d_count;          /* device counter for count_nonfinite */
  uint64_t *h_count;          /* pinned host copy of it */
  double *d_sketch;           /* device [sketch_cap] buckets, grown on demand */
  int sketch_cap;
  /* Scratch of the transformer ops, grown on demand to the largest request
   * and kept until close (sizes at each op below). Used only in stream
   * order, so one buffer serves every op of its kind. */
  struct cuda_scratch bias_part;    /* bias gradient: per-chunk column sums */
  struct cuda_scratch emb_sort;     /* embedding backward: token sort, run pieces */
  struct cuda_scratch ln_part;      /* LayerNorm backward: dw, db partials */
  struct cuda_scratch attn_heads;   /* attention: q, k, v (and grads) by head */
  struct cuda_scratch attn_scores;  /* attention: T×T scores, probabilities */
  /* Memory: buffers from cudaMalloc (their sizes, for the count), and
   * while `discardable` from the chunked set `vmm` (opened on first use;
   * NULL where the driver has none). live/peak: bytes held now and at
   * most, over both (tensor_backend_peak_bytes). */
  struct cuda_vmm *vmm;
  bool vmm_tried, discardable;
  struct cuda_alloc {
    void *p;
    size_t bytes;
  } *plain;
  size_t nplain, plain_cap, plain_live, peak;
};

static struct cuda_backend *cuda_of(tensor_backend_t be) { return (struct cuda_backend *)be; }

static void *stream_of(struct cuda_backend *b) { return (void *)b->stream; }

/* Makes the backend's device current in the calling thread; returns the
 * backend for chaining. */
static struct cuda_backend *enter(tensor_backend_t be) {
  struct cuda_backend *b = cuda_of(be);
  CUDA_CHECK(cudaSetDevice(b->device));
  return b;
}

/* ---- device count -------------------------------------------------------------- */

/* The device count, asked once per process: it cannot change while the
 * process runs, and without a driver each query is a failed dlopen.
 * -1 until the first call. */
static atomic_int g_device_count = -1;

/* True when the NVIDIA driver library can be loaded. The statically linked
 * CUDA runtime must not be initialised without it: on machines with no
 * driver, cudart's failed start-up leaves state behind that corrupted the
 * heap of multi-threaded processes later (seen with glibc's malloc checks in
 * gossip peers). The handle is kept open for cudart's own dlopen. */
static bool driver_present(void) {
  void *h = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
  if (!h) {
    log_debug("cuda: no NVIDIA driver (libcuda.so.1: %s); no CUDA device will be used", dlerror());
    return false;
  }
  return true;
}

int tensor_cuda_count(void) {
  int cached = atomic_load(&g_device_count);
  if (cached >= 0) return cached;
  int count = 0;
  if (!driver_present()) {
    atomic_store(&g_device_count, 0);
    return 0;
  }
  cudaError_t err = cudaGetDeviceCount(&count);
  if (err != cudaSuccess) {
    /* No driver, no device, a driver older than the runtime, ...: no GPU. */
    log_debug("cuda: cudaGetDeviceCount failed (%s: %s): no NVIDIA driver, no device, or a driver "
              "too old for CUDA runtime %d; no CUDA device will be used",
              cudaGetErrorName(err), cudaGetErrorString(err), CUDART_VERSION);
    (void)cudaGetLastError();
    count = 0;
  }
  if (count < 0) count = 0;
  atomic_store(&g_device_count, count);
  return count;
}

/* ---- backend lifetime ---------------------------------------------------------- */

/* Releases whatever `b` holds (a partly opened backend too). Runs with the
 * device current. */
static void cuda_release(struct cuda_backend *b) {
  if (b->stream) (void)cudaStreamSynchronize(b->stream);
  if (b->beside) (void)cudaStreamSynchronize(b->beside);
  if (b->blas) (void)tensor_cublas()->destroy(b->blas);
  if (b->d_sketch) (void)cudaFree(b->d_sketch);
  struct cuda_scratch *scratch[] = {&b->bias_part, &b->emb_sort, &b->ln_part, &b->attn_heads, &b->attn_scores};
  for (size_t i = 0; i < sizeof scratch / sizeof scratch[0]; i++)
    if (scratch[i]->p) (void)cudaFree(scratch[i]->p);
  if (b->d_partials) (void)cudaFree(b->d_partials);
  if (b->d_count) (void)cudaFree(b->d_count);
  if (b->h_partials) (void)cudaFreeHost(b->h_partials);
  if (b->h_count) (void)cudaFreeHost(b->h_count);
  cuda_vmm_close(b->vmm);
  free(b->plain);
  if (b->beside_after) (void)cudaEventDestroy(b->beside_after);
  if (b->beside) (void)cudaStreamDestroy(b->beside);
  if (b->stream) (void)cudaStreamDestroy(b->stream);
  (void)cudaGetLastError();
  free(b);
}

static void cuda_close(tensor_backend_t be) {
  struct cuda_backend *b = enter(be);
  CUDA_CHECK(cudaStreamSynchronize(b->stream));
  CUDA_CHECK(cudaStreamSynchronize(b->beside));
  cuda_release(b);
}

static void cuda_sync(tensor_backend_t be) {
  struct cuda_backend *b = enter(be);
  CUDA_CHECK(cudaStreamSynchronize(b->stream));
}

/* ---- memory ---------------------------------------------------------------------- */

static void note_peak(struct cuda_backend *b) {
  size_t now = b->plain_live + cuda_vmm_live_bytes(b->vmm);
  if (now > b->peak) b->peak = now;
}

/* Buffers of at least this many chunks are chunked while discardable: a
 * chunked buffer rounds up to whole chunks (2 MiB), which would waste more
 * than a smaller one could give back (a model's activations and biases). */
#define CUDA_CHUNKED_MIN_CHUNKS 16

/* Device memory; NULL (never a panic) when it cannot be had. A request for 0
 * bytes still returns a distinct valid pointer, as tensor_alloc expects.
 * While discardable, large buffers from the chunked set where there is one. */
static void *cuda_mem_alloc(tensor_backend_t be, size_t bytes) {
  struct cuda_backend *b = enter(be);
  void *p = NULL;
  if (b->discardable && b->vmm && bytes >= CUDA_CHUNKED_MIN_CHUNKS * cuda_vmm_chunk_bytes(b->vmm)) {
    p = cuda_vmm_alloc(b->vmm, bytes);
    log_debug("%s: %zu bytes of chunked memory at %p", b->base.name, bytes, p);
    note_peak(b);
    return p;
  }
  cudaError_t err = cudaMalloc(&p, bytes ? bytes : 1);
  if (err != cudaSuccess) {
    log_debug("%s: cudaMalloc(%zu) failed: %s", b->base.name, bytes, cudaGetErrorString(err));
    (void)cudaGetLastError(); /* not sticky; keep it out of later launch checks */
    return NULL;
  }
  if (b->nplain == b->plain_cap) {
    b->plain_cap = b->plain_cap ? 2 * b->plain_cap : 16;
    b->plain = xrealloc(b->plain, b->plain_cap * sizeof *b->plain);
  }
  b->plain[b->nplain++] = (struct cuda_alloc){p, bytes};
  b->plain_live += bytes;
  note_peak(b);
  return p;
}

static void cuda_mem_info(tensor_backend_t be, size_t *free_bytes, size_t *total_bytes) {
  enter(be);
  CUDA_CHECK(cudaMemGetInfo(free_bytes, total_bytes));
}

/* cudaFree waits for the device, so no op still in flight can touch p; a
 * chunked block waits for both streams first. */
static void cuda_mem_free(tensor_backend_t be, void *p) {
  struct cuda_backend *b = enter(be);
  for (size_t i = 0; i < b->nplain; i++)
    if (b->plain[i].p == p) {
      b->plain_live -= b->plain[i].bytes;
      b->plain[i] = b->plain[--b->nplain];
      CUDA_CHECK(cudaFree(p));
      return;
    }
  CUDA_CHECK(cudaStreamSynchronize(b->stream));
  CUDA_CHECK(cudaStreamSynchronize(b->beside));
  bool chunked = cuda_vmm_free(b->vmm, p);
  RUMOR_ASSERT(chunked); /* else p is no buffer of this backend */
}

static void cuda_set_discardable(tensor_backend_t be, bool on) {
  struct cuda_backend *b = enter(be);
  b->discardable = on;
  if (!on || b->vmm_tried) return;
  b->vmm_tried = true;
  struct rumor_err e = {0};
  b->vmm = cuda_vmm_open(b->device, &e);
  if (!b->vmm)
    log_info("%s: memory cannot be given back here (%s): sharded parameters and gradients stay allocated",
             b->base.name, e.msg);
}

/* tensor_discard has waited for the stream; the copies beside it read only
 * what stays. */
static void cuda_mem_discard(tensor_backend_t be, void *p, size_t bytes) {
  struct cuda_backend *b = enter(be);
  if (!b->vmm) return;
  CUDA_CHECK(cudaStreamSynchronize(b->beside));
  cuda_vmm_discard(b->vmm, p, bytes);
}

static int cuda_mem_recommit(tensor_backend_t be, void *p, size_t bytes, struct rumor_err *e) {
  struct cuda_backend *b = enter(be);
  int rc = cuda_vmm_recommit(b->vmm, p, bytes, (void *)b->stream, e);
  note_peak(b);
  return rc;
}

static void cuda_mem_held(tensor_backend_t be, int64_t *live, int64_t *peak, bool reset) {
  struct cuda_backend *b = cuda_of(be);
  size_t now = b->plain_live + cuda_vmm_live_bytes(b->vmm);
  *live = (int64_t)now;
  *peak = (int64_t)b->peak;
  if (reset) b->peak = now;
}

/* Pinned host memory, so that async copies really overlap; NULL on failure. */
static void *cuda_host_alloc(tensor_backend_t be, size_t bytes) {
  struct cuda_backend *b = enter(be);
  void *p = NULL;
  cudaError_t err = cudaMallocHost(&p, bytes ? bytes : 1);
  if (err != cudaSuccess) {
    log_debug("%s: cudaMallocHost(%zu) failed: %s", b->base.name, bytes, cudaGetErrorString(err));
    (void)cudaGetLastError();
    return NULL;
  }
  return p;
}

static void cuda_host_free(tensor_backend_t be, void *p) {
  enter(be);
  CUDA_CHECK(cudaFreeHost(p));
}

/* Copies are enqueued on the stream; the synchronous forms then wait for it
 * (and so for every op before them). */
static void cuda_copy(struct cuda_backend *b, void *dst, const void *src, size_t bytes,
                      enum cudaMemcpyKind kind, bool async) {
  if (bytes == 0) return;
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, kind, b->stream));
  if (!async) CUDA_CHECK(cudaStreamSynchronize(b->stream));
}

static void cuda_copy_h2d(tensor_backend_t be, void *dst, const void *src, size_t bytes, bool async) {
  cuda_copy(enter(be), dst, src, bytes, cudaMemcpyHostToDevice, async);
}

static void cuda_copy_d2h(tensor_backend_t be, void *dst, const void *src, size_t bytes, bool async) {
  cuda_copy(enter(be), dst, src, bytes, cudaMemcpyDeviceToHost, async);
}

/* Device → pinned host on the second stream: it waits for what `stream`
 * holds now (an event recorded there; cudaStreamWaitEvent takes the
 * event's state at the call, so re-recording it later is safe) and later
 * work on `stream` does not wait for it. */
static void cuda_copy_d2h_beside(tensor_backend_t be, void *dst, const void *src, size_t bytes, void *ev) {
  struct cuda_backend *b = enter(be);
  CUDA_CHECK(cudaEventRecord(b->beside_after, b->stream));
  CUDA_CHECK(cudaStreamWaitEvent(b->beside, b->beside_after, 0));
  if (bytes) CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToHost, b->beside));
  CUDA_CHECK(cudaEventRecord((cudaEvent_t)ev, b->beside));
}

/* dst ← src on the device, stream-ordered. Overlapping ranges (views of one
 * buffer) go through a temporary, since cudaMemcpy does not promise memmove
 * semantics: stream-ordered from the device's memory pool, or, where the
 * device or driver has none (cudaMallocAsync unsupported), a plain
 * cudaMalloc, freed after the stream drains. */
static void cuda_copy_d2d(tensor_backend_t be, void *dst, const void *src, size_t bytes) {
  struct cuda_backend *b = enter(be);
  if (bytes == 0 || dst == src) return;
  const char *d = dst, *s = src;
  if (d < s + bytes && s < d + bytes) {
    void *tmp = NULL;
    bool pooled = cudaMallocAsync(&tmp, bytes, b->stream) == cudaSuccess;
    if (!pooled) {
      (void)cudaGetLastError(); /* not sticky: clear it and take the plain allocator */
      CUDA_CHECK(cudaMalloc(&tmp, bytes));
    }
    CUDA_CHECK(cudaMemcpyAsync(tmp, src, bytes, cudaMemcpyDeviceToDevice, b->stream));
    CUDA_CHECK(cudaMemcpyAsync(dst, tmp, bytes, cudaMemcpyDeviceToDevice, b->stream));
    if (pooled) {
      CUDA_CHECK(cudaFreeAsync(tmp, b->stream));
    } else {
      CUDA_CHECK(cudaStreamSynchronize(b->stream));
      CUDA_CHECK(cudaFree(tmp));
    }
    return;
  }
  CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, b->stream));
}

/* ---- events ------------------------------------------------------------------------ */

/* A cudaEvent_t without timing (cheaper to record and query) whose
 * cudaEventSynchronize (cuda_ev_wait) sleeps instead of spinning (the
 * device's blocking-sync flag covers stream waits, not event waits); NULL
 * on failure. */
static void *cuda_ev_create(tensor_backend_t be) {
  struct cuda_backend *b = enter(be);
  cudaEvent_t ev = NULL;
  cudaError_t err = cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventBlockingSync);
  if (err != cudaSuccess) {
    log_debug("%s: cudaEventCreateWithFlags failed: %s", b->base.name, cudaGetErrorString(err));
    (void)cudaGetLastError();
    return NULL;
  }
  return (void *)ev;
}

static void cuda_ev_destroy(tensor_backend_t be, void *ev) {
  enter(be);
  CUDA_CHECK(cudaEventDestroy((cudaEvent_t)ev));
}

static void cuda_ev_record(tensor_backend_t be, void *ev) {
  struct cuda_backend *b = enter(be);
  CUDA_CHECK(cudaEventRecord((cudaEvent_t)ev, b->stream));
}

/* Never blocks: cudaErrorNotReady means the work is still in flight. An
 * event never recorded counts as complete. */
static bool cuda_ev_query(tensor_backend_t be, void *ev) {
  enter(be);
  cudaError_t err = cudaEventQuery((cudaEvent_t)ev);
  if (err == cudaErrorNotReady) {
    (void)cudaGetLastError(); /* a status, not an error: keep it out of launch checks */
    return false;
  }
  if (err != cudaSuccess)
    rumor_panic(__FILE__, __LINE__, "cudaEventQuery(ev) failed: %s: %s", cudaGetErrorName(err),
                cudaGetErrorString(err));
  return true;
}

static void cuda_ev_wait(tensor_backend_t be, void *ev) {
  enter(be);
  CUDA_CHECK(cudaEventSynchronize((cudaEvent_t)ev));
}

/* ---- GEMM ------------------------------------------------------------------------- */

/* Row-major C[m,n] ← alpha·op(A)·op(B) + beta·C through column-major cuBLAS.
 * A row-major matrix with row stride ld is, read column-major, its transpose
 * with leading dimension ld. So C = op(A)·op(B) is computed as the
 * column-major product Cᵀ[n,m] = op(B)ᵀ·op(A)ᵀ: B goes first with B's
 * transpose flag, A second with A's, and m and n swap places. */
static void cuda_gemm(tensor_backend_t be, bool ta, bool tb, int m, int n, int k, float alpha,
                      const float *a, int lda, const float *b, int ldb, float beta, float *c, int ldc) {
  struct cuda_backend *cb = enter(be);
  if (m == 0 || n == 0) return;
  if (k == 0) {
    /* An empty product: C ← beta·C (C not read when beta is 0, as BLAS). Done
     * here because cuBLAS rejects the zero leading dimensions of [m,0]. */
    RUMOR_ASSERT(ldc == n);
    int64_t cn = (int64_t)m * n;
    if (beta == 0.0f)
      KERN_CHECK(kern_fill(c, 0.0f, cn, stream_of(cb)));
    else if (beta != 1.0f)
      KERN_CHECK(kern_scale(c, beta, cn, stream_of(cb)));
    return;
  }
  CUBLAS_CHECK(tensor_cublas()->sgemm(cb->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, n,
                                      m, k, &alpha, b, ldb, a, lda, &beta, c, ldc));
}

/* ---- element-wise ops ------------------------------------------------------------ */

static void cuda_bias_add(tensor_backend_t be, float *y, const float *bias, int64_t rows, int64_t cols) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_bias_add(y, bias, rows, cols, stream_of(b)));
}

static void *cuda_scratch_reserve(struct cuda_backend *b, struct cuda_scratch *s, size_t bytes, const char *what);

/* Scratch: one float per column per chunk of rows (kernels.h; none for
 * 256 rows or fewer, 768 KiB for 8192 rows of 768, 16 MiB at most). */
static void cuda_bias_grad(tensor_backend_t be, const float *dy, float *db, int64_t rows, int64_t cols,
                           float beta) {
  struct cuda_backend *b = enter(be);
  const size_t bytes = kern_bias_grad_scratch_bytes(rows, cols);
  void *scratch = bytes ? cuda_scratch_reserve(b, &b->bias_part, bytes, "bias gradient") : NULL;
  KERN_CHECK(kern_bias_grad(dy, db, rows, cols, beta, scratch, bytes ? b->bias_part.cap : 0, stream_of(b)));
}

static void cuda_relu_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_relu_fwd(x, y, n, stream_of(b)));
}

static void cuda_relu_bwd(tensor_backend_t be, const float *y, const float *dy, float *dx, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_relu_bwd(y, dy, dx, n, stream_of(b)));
}

static void cuda_gelu_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_gelu_fwd(x, y, n, stream_of(b)));
}

static void cuda_gelu_bwd(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_gelu_bwd(x, dy, dx, n, stream_of(b)));
}

static void cuda_softmax_xent(tensor_backend_t be, const float *logits, const int32_t *labels,
                              float *dlogits, float *losses, int64_t rows, int64_t cols, int64_t ld,
                              float grad_scale) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_softmax_xent(logits, labels, dlogits, losses, rows, cols, ld, grad_scale, stream_of(b)));
}

static void cuda_sgd_step(tensor_backend_t be, float *p, const float *g, float *m, int64_t n,
                          const struct tensor_sgd *hp) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_sgd_step(p, g, m, n, hp->lr, hp->momentum, hp->weight_decay, hp->nesterov, stream_of(b)));
}

static void cuda_adamw_step(tensor_backend_t be, float *p, const float *g, float *m, float *v, int64_t n,
                            const struct tensor_adamw *hp) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_adamw_step(p, g, m, v, n, hp->lr, hp->beta1, hp->beta2, hp->eps, hp->weight_decay, hp->step,
                             stream_of(b)));
}

static void cuda_axpby(tensor_backend_t be, float a, const float *x, float bb, float *y, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_axpby(a, x, bb, y, n, stream_of(b)));
}

static void cuda_scale(tensor_backend_t be, float *x, float a, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_scale(x, a, n, stream_of(b)));
}

static void cuda_fill(tensor_backend_t be, float *x, float v, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_fill(x, v, n, stream_of(b)));
}

/* ---- reductions ------------------------------------------------------------------- */

/* Waits for the `nparts` partials just enqueued and sums them in double. */
static double sum_partials(struct cuda_backend *b, int nparts) {
  if (nparts == 0) return 0.0;
  cuda_copy(b, b->h_partials, b->d_partials, (size_t)nparts * sizeof(float), cudaMemcpyDeviceToHost, false);
  double total = 0.0;
  for (int i = 0; i < nparts; i++) total += (double)b->h_partials[i];
  return total;
}

static double cuda_sum(tensor_backend_t be, const float *x, int64_t n) {
  struct cuda_backend *b = enter(be);
  int nparts = 0;
  KERN_CHECK(kern_sum_partials(x, n, b->d_partials, &nparts, stream_of(b)));
  return sum_partials(b, nparts);
}

static double cuda_sq_norm(tensor_backend_t be, const float *x, int64_t n) {
  struct cuda_backend *b = enter(be);
  int nparts = 0;
  KERN_CHECK(kern_sq_norm_partials(x, n, b->d_partials, &nparts, stream_of(b)));
  return sum_partials(b, nparts);
}

static double cuda_sq_dist(tensor_backend_t be, const float *x, const float *y, int64_t n) {
  struct cuda_backend *b = enter(be);
  int nparts = 0;
  KERN_CHECK(kern_sq_dist_partials(x, y, n, b->d_partials, &nparts, stream_of(b)));
  return sum_partials(b, nparts);
}

static int64_t cuda_count_nonfinite(tensor_backend_t be, const float *x, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_count_nonfinite(x, n, b->d_count, stream_of(b)));
  cuda_copy(b, b->h_count, b->d_count, sizeof *b->h_count, cudaMemcpyDeviceToHost, false);
  return (int64_t)*b->h_count;
}

/* Count-sketch into device buckets (kept between calls, grown to the largest
 * k seen), then copied to `out_host` after the stream drains. */
static void cuda_count_sketch(tensor_backend_t be, const float *x, int64_t n, uint64_t seed, int k,
                              double *out_host) {
  struct cuda_backend *b = enter(be);
  if (k > b->sketch_cap) {
    if (b->d_sketch) CUDA_CHECK(cudaFree(b->d_sketch));
    b->d_sketch = NULL;
    b->sketch_cap = 0;
    CUDA_CHECK(cudaMalloc((void **)&b->d_sketch, (size_t)k * sizeof(double)));
    b->sketch_cap = k;
  }
  KERN_CHECK(kern_count_sketch(x, n, seed, k, b->d_sketch, stream_of(b)));
  cuda_copy(b, out_host, b->d_sketch, (size_t)k * sizeof(double), cudaMemcpyDeviceToHost, false);
}

/* ---- transformer ops ------------------------------------------------------------ */

#define CUDA_SCRATCH_ROUND ((size_t)1 << 20) /* scratch grows in whole MiB */

/* Makes `s` hold at least `bytes` and returns it. Growing waits for the
 * stream (ops already queued may still use the old buffer), frees it and
 * allocates the new size; out of memory is a panic naming `what` and the
 * size, as any CUDA failure inside an op. In steady state (the same shapes
 * every step) nothing is allocated. */
static void *cuda_scratch_reserve(struct cuda_backend *b, struct cuda_scratch *s, size_t bytes, const char *what) {
  if (s->p && bytes <= s->cap) return s->p;
  CUDA_CHECK(cudaStreamSynchronize(b->stream));
  if (s->p) CUDA_CHECK(cudaFree(s->p));
  s->p = NULL;
  s->cap = 0;
  size_t want = (bytes + CUDA_SCRATCH_ROUND - 1) / CUDA_SCRATCH_ROUND * CUDA_SCRATCH_ROUND;
  if (want == 0) want = CUDA_SCRATCH_ROUND;
  cudaError_t err = cudaMalloc(&s->p, want);
  if (err != cudaSuccess)
    rumor_panic(__FILE__, __LINE__, "%s: cudaMalloc(%zu bytes) for the %s scratch failed: %s: %s", b->base.name, want,
                what, cudaGetErrorName(err), cudaGetErrorString(err));
  s->cap = want;
  log_debug("%s: %s scratch grown to %.1f MiB", b->base.name, what, (double)want / (double)(1u << 20));
  return s->p;
}

static void cuda_add(tensor_backend_t be, const float *x, const float *y, float *out, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_add(x, y, out, n, stream_of(b)));
}

static void cuda_gelu_tanh_fwd(tensor_backend_t be, const float *x, float *y, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_gelu_tanh_fwd(x, y, n, stream_of(b)));
}

static void cuda_gelu_tanh_bwd(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_gelu_tanh_bwd(x, dy, dx, n, stream_of(b)));
}

static void cuda_embedding_fwd(tensor_backend_t be, const int32_t *tokens, const float *wte, const float *wpe,
                               float *out, int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_embedding_fwd(tokens, wte, wpe, out, r, t, c, lo, v, stream_of(b)));
}

/* Scratch: the token sort's keys and values (16 bytes per token: 128 KiB
 * for r·t = 8192), the run pieces' sums (c floats per KERN_EMB_PIECE
 * tokens: 384 KiB for r·t = 8192, c = 768) and CUB's temporary storage
 * (CUB's to size; not measured here), rounded up to whole MiB. */
static void cuda_embedding_bwd(tensor_backend_t be, const int32_t *tokens, const float *dout, float *dwte,
                               float *dwpe, int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v) {
  struct cuda_backend *b = enter(be);
  size_t bytes = 0;
  KERN_CHECK(kern_embedding_bwd_scratch(r * t, v, c, &bytes));
  void *scratch = cuda_scratch_reserve(b, &b->emb_sort, bytes, "embedding sort");
  KERN_CHECK(
      kern_embedding_bwd(tokens, dout, dwte, dwpe, r, t, c, lo, v, scratch, b->emb_sort.cap, stream_of(b)));
}

static void cuda_xent_shard_stats(tensor_backend_t be, const float *logits, const int32_t *labels, float *lse,
                                  float *target, int64_t rows, int64_t cols, int64_t ld, int64_t lo) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_xent_shard_stats(logits, labels, lse, target, rows, cols, ld, lo, stream_of(b)));
}

static void cuda_xent_shard_grad(tensor_backend_t be, const float *logits, const int32_t *labels, const float *parts,
                                 int64_t nparts, const float *target, float *dlogits, float *losses, int64_t rows,
                                 int64_t cols, int64_t ld, int64_t lo, float grad_scale) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_xent_shard_grad(logits, labels, parts, nparts, target, dlogits, losses, rows, cols, ld, lo,
                                  grad_scale, stream_of(b)));
}

static void cuda_layernorm_fwd(tensor_backend_t be, const float *x, const float *w, const float *bias, float *y,
                               float *mean, float *rstd, int64_t rows, int64_t c) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_layernorm_fwd(x, w, bias, y, mean, rstd, rows, c, TENSOR_LAYERNORM_EPS, stream_of(b)));
}

/* Scratch: dw and db partials, 2 floats per column per chunk of 256 rows
 * (at most 1024 chunks): 6 MiB at most for c = 768. */
static void cuda_layernorm_bwd(tensor_backend_t be, const float *x, const float *w, const float *mean,
                               const float *rstd, const float *dy, float *dx, float *dw, float *db, int64_t rows,
                               int64_t c, float beta) {
  struct cuda_backend *b = enter(be);
  void *scratch = cuda_scratch_reserve(b, &b->ln_part, kern_layernorm_bwd_scratch_bytes(rows, c), "LayerNorm");
  KERN_CHECK(kern_layernorm_bwd(x, w, mean, rstd, dy, dx, dw, db, rows, c, beta, scratch, b->ln_part.cap,
                                stream_of(b)));
}

/* Attention runs on the head layout (kern_heads_split: q, k, v of batch
 * b = sequence·nh + head each one contiguous t×hs matrix) with
 * cublasSgemmStridedBatched for the products, in rounds of `group` batches
 * whose t×t score matrices fit the scores scratch. Scratch, with
 * N = r·t·c and B = r·nh:
 *   attn_heads:  forward 3N floats (q, k, v; the output reuses q's room),
 *                backward 7N (q, k, v; dout; dq, dk, dv);
 *   attn_scores: forward group·t² floats, backward 2·group·t² (P; dP, dS),
 *                with group = B when B·t² <= CUDA_ATTN_SCORES_MAX, else as
 *                many batches as fit (at least one).
 * GPT-2 small (c = 768, nh = 12) at r = 4, t = 1024: B·t² = 48M floats, one
 * round; forward 36 + 192 MiB, backward 84 + 384 MiB. At r = 8: two rounds
 * (64 and 32 batches), forward 72 + 256 MiB, backward 168 + 512 MiB. */
#define CUDA_ATTN_SCORES_MAX ((int64_t)1 << 26) /* floats per t×t buffer set: 256 MiB */

struct attn_geom {
  int64_t r, t, c, n;    /* n = r·t·c: the floats of one part in head layout */
  int nh, hs;            /* heads, head size c/nh */
  int64_t batches;       /* B = r·nh */
  int64_t group;         /* batches per round */
  float scale;           /* 1/√hs, the score scale */
};

static struct attn_geom attn_geom_of(int64_t r, int64_t t, int64_t c, int nh) {
  struct attn_geom g = {.r = r, .t = t, .c = c, .n = r * t * c, .nh = nh, .batches = r * nh};
  RUMOR_ASSERT(nh > 0 && c % nh == 0 && c / nh <= INT_MAX && t <= INT_MAX);
  g.hs = (int)(c / nh);
  int64_t fit = CUDA_ATTN_SCORES_MAX / (t * t);
  g.group = fit < 1 ? 1 : (fit > g.batches ? g.batches : fit);
  if (g.group > INT_MAX) g.group = INT_MAX; /* cuBLAS's batch count is an int */
  g.scale = (float)(1.0 / sqrt((double)g.hs));
  return g;
}

/* Row-major strided-batched GEMM: for i < batch, C_i ← alpha·op(A_i)·op(B_i)
 * + beta·C_i with X_i = X + i·stride_x; shapes, leading dimensions and the
 * operand swap as cuda_gemm. Sizes are ints here (attn_geom_of checks). */
static void gemm_strided(struct cuda_backend *cb, bool ta, bool tb, int64_t m, int64_t n, int64_t k, float alpha,
                         const float *a, int64_t lda, int64_t sa, const float *b, int64_t ldb, int64_t sb,
                         float beta, float *c, int64_t ldc, int64_t sc, int64_t batch) {
  CUBLAS_CHECK(tensor_cublas()->sgemm_strided_batched(
      cb->blas, tb ? CUBLAS_OP_T : CUBLAS_OP_N, ta ? CUBLAS_OP_T : CUBLAS_OP_N, (int)n, (int)m, (int)k, &alpha, b,
      (int)ldb, (long long)sb, a, (int)lda, (long long)sa, &beta, c, (int)ldc, (long long)sc, (int)batch));
}

static void cuda_attention_fwd(tensor_backend_t be, const float *qkv, float *out, float *lse, int64_t r, int64_t t,
                               int64_t c, int nh) {
  struct cuda_backend *b = enter(be);
  const struct attn_geom g = attn_geom_of(r, t, c, nh);
  float *q = cuda_scratch_reserve(b, &b->attn_heads, (size_t)(3 * g.n) * sizeof(float), "attention heads");
  float *k = q + g.n, *v = q + 2 * g.n;
  float *s = cuda_scratch_reserve(b, &b->attn_scores, (size_t)(g.group * t * t) * sizeof(float), "attention scores");
  const int64_t mat = t * g.hs, sq = t * t, hs = g.hs;
  KERN_CHECK(kern_heads_split(qkv, q, r, t, c, nh, 3, stream_of(b)));
  for (int64_t b0 = 0; b0 < g.batches; b0 += g.group) {
    const int64_t nb = g.batches - b0 < g.group ? g.batches - b0 : g.group;
    float *qb = q + b0 * mat;
    /* S = scale·Q·Kᵀ; P = causal softmax(S), lse; O = P·V into q's room
     * (this round's q is consumed by then). */
    gemm_strided(b, false, true, t, t, hs, g.scale, qb, hs, mat, k + b0 * mat, hs, mat, 0.0f, s, t, sq, nb);
    KERN_CHECK(kern_attn_softmax_fwd(s, lse + b0 * t, nb, t, stream_of(b)));
    gemm_strided(b, false, false, t, hs, t, 1.0f, s, t, sq, v + b0 * mat, hs, mat, 0.0f, qb, hs, mat, nb);
  }
  KERN_CHECK(kern_heads_merge(q, out, r, t, c, nh, 1, stream_of(b)));
}

/* The backward per round: P = exp(scale·Q·Kᵀ − lse) (causal), dV = Pᵀ·dO,
 * dP = dO·Vᵀ, dS = P ⊙ (dP − rowsum(dO ⊙ O))·scale, dQ = dS·K, dK = dSᵀ·Q. */
static void cuda_attention_bwd(tensor_backend_t be, const float *qkv, const float *out, const float *lse,
                               const float *dout, float *dqkv, int64_t r, int64_t t, int64_t c, int nh) {
  struct cuda_backend *b = enter(be);
  const struct attn_geom g = attn_geom_of(r, t, c, nh);
  float *q = cuda_scratch_reserve(b, &b->attn_heads, (size_t)(7 * g.n) * sizeof(float), "attention heads");
  float *k = q + g.n, *v = q + 2 * g.n, *dO = q + 3 * g.n, *dq = q + 4 * g.n, *dk = q + 5 * g.n, *dv = q + 6 * g.n;
  const int64_t sq = t * t, mat = t * g.hs, hs = g.hs;
  float *p = cuda_scratch_reserve(b, &b->attn_scores, (size_t)(2 * g.group * sq) * sizeof(float), "attention scores");
  float *ds = p + g.group * sq;
  KERN_CHECK(kern_heads_split(qkv, q, r, t, c, nh, 3, stream_of(b)));
  KERN_CHECK(kern_heads_split(dout, dO, r, t, c, nh, 1, stream_of(b)));
  for (int64_t b0 = 0; b0 < g.batches; b0 += g.group) {
    const int64_t nb = g.batches - b0 < g.group ? g.batches - b0 : g.group, o = b0 * mat;
    gemm_strided(b, false, true, t, t, hs, g.scale, q + o, hs, mat, k + o, hs, mat, 0.0f, p, t, sq, nb);
    KERN_CHECK(kern_attn_probs(p, lse + b0 * t, nb, t, stream_of(b)));
    gemm_strided(b, true, false, t, hs, t, 1.0f, p, t, sq, dO + o, hs, mat, 0.0f, dv + o, hs, mat, nb);
    gemm_strided(b, false, true, t, t, hs, 1.0f, dO + o, hs, mat, v + o, hs, mat, 0.0f, ds, t, sq, nb);
    KERN_CHECK(kern_attn_dscores(p, ds, out, dout, b0, nb, t, c, nh, g.scale, stream_of(b)));
    gemm_strided(b, false, false, t, hs, t, 1.0f, ds, t, sq, k + o, hs, mat, 0.0f, dq + o, hs, mat, nb);
    gemm_strided(b, true, false, t, hs, t, 1.0f, ds, t, sq, q + o, hs, mat, 0.0f, dk + o, hs, mat, nb);
  }
  KERN_CHECK(kern_heads_merge(dq, dqkv, r, t, c, nh, 3, stream_of(b)));
}

/* CUBLAS_TF32_TENSOR_OP_MATH: cublasSgemm and the strided-batched form may
 * round their inputs to TF32 on tensor cores (accumulation stays FP32);
 * CUBLAS_DEFAULT_MATH: plain FP32. The handle is bound to our one stream,
 * so the mode applies to the GEMMs enqueued after this call. */
static void cuda_set_tf32(tensor_backend_t be, bool on) {
  struct cuda_backend *b = enter(be);
  CUBLAS_CHECK(tensor_cublas()->set_math_mode(b->blas, on ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH));
}

/* ---- mixture of experts (kernels/moe.cu; no scratch) ---- */

static void cuda_moe_route(tensor_backend_t be, const float *logits, float *probs, float *lse, int32_t *expert,
                           float *gate, int32_t *slot, int32_t *assigned, int32_t *kept, float *psum, int64_t n,
                           int64_t e, int k, int64_t cap) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_moe_route(logits, probs, lse, expert, gate, slot, assigned, kept, psum, n, e, k, cap, stream_of(b)));
}

static void cuda_moe_route_bwd(tensor_backend_t be, const float *probs, const float *lse, const int32_t *expert,
                               const float *gate, const float *dgate, const float *daux, float zscale, float *dlogits,
                               int64_t n, int64_t e, int k) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_moe_route_bwd(probs, lse, expert, gate, dgate, daux, zscale, dlogits, n, e, k, stream_of(b)));
}

static void cuda_moe_dispatch(tensor_backend_t be, const float *x, const int32_t *expert, const int32_t *slot,
                              float *xe, int64_t n, int64_t c, int k, int64_t e, int64_t cap) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_moe_dispatch(x, expert, slot, xe, n, c, k, e, cap, stream_of(b)));
}

static void cuda_moe_dispatch_bwd(tensor_backend_t be, const float *dxe, const int32_t *expert, const int32_t *slot,
                                  float *dx, int64_t n, int64_t c, int k, int64_t e, int64_t cap) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_moe_dispatch_bwd(dxe, expert, slot, dx, n, c, k, e, cap, stream_of(b)));
}

static void cuda_moe_combine(tensor_backend_t be, const float *ye, const int32_t *expert, const int32_t *slot,
                             const float *gate, float *out, int64_t n, int64_t c, int k, int64_t e, int64_t cap) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_moe_combine(ye, expert, slot, gate, out, n, c, k, e, cap, stream_of(b)));
}

static void cuda_moe_combine_bwd(tensor_backend_t be, const float *dout, const float *ye, const int32_t *expert,
                                 const int32_t *slot, const float *gate, float *dye, float *dgate, int64_t n,
                                 int64_t c, int k, int64_t e, int64_t cap) {
  struct cuda_backend *b = enter(be);
  KERN_CHECK(kern_moe_combine_bwd(dout, ye, expert, slot, gate, dye, dgate, n, c, k, e, cap, stream_of(b)));
}

static const struct tensor_backend_ops cuda_ops = {
    .close = cuda_close,
    .set_threads = NULL,
    .set_tf32 = cuda_set_tf32,
    .sync = cuda_sync,
    .mem_alloc = cuda_mem_alloc,
    .mem_free = cuda_mem_free,
    .mem_info = cuda_mem_info,
    .mem_discard = cuda_mem_discard,
    .mem_recommit = cuda_mem_recommit,
    .set_discardable = cuda_set_discardable,
    .mem_held = cuda_mem_held,
    .host_alloc = cuda_host_alloc,
    .host_free = cuda_host_free,
    .copy_h2d = cuda_copy_h2d,
    .copy_d2h = cuda_copy_d2h,
    .copy_d2d = cuda_copy_d2d,
    .copy_d2h_beside = cuda_copy_d2h_beside,
    .ev_create = cuda_ev_create,
    .ev_destroy = cuda_ev_destroy,
    .ev_record = cuda_ev_record,
    .ev_query = cuda_ev_query,
    .ev_wait = cuda_ev_wait,
    .gemm = cuda_gemm,
    .bias_add = cuda_bias_add,
    .bias_grad = cuda_bias_grad,
    .relu_fwd = cuda_relu_fwd,
    .relu_bwd = cuda_relu_bwd,
    .gelu_fwd = cuda_gelu_fwd,
    .gelu_bwd = cuda_gelu_bwd,
    .softmax_xent = cuda_softmax_xent,
    .add = cuda_add,
    .embedding_fwd = cuda_embedding_fwd,
    .embedding_bwd = cuda_embedding_bwd,
    .xent_shard_stats = cuda_xent_shard_stats,
    .xent_shard_grad = cuda_xent_shard_grad,
    .layernorm_fwd = cuda_layernorm_fwd,
    .layernorm_bwd = cuda_layernorm_bwd,
    .attention_fwd = cuda_attention_fwd,
    .attention_bwd = cuda_attention_bwd,
    .gelu_tanh_fwd = cuda_gelu_tanh_fwd,
    .gelu_tanh_bwd = cuda_gelu_tanh_bwd,
    .moe_route = cuda_moe_route,
    .moe_route_bwd = cuda_moe_route_bwd,
    .moe_dispatch = cuda_moe_dispatch,
    .moe_dispatch_bwd = cuda_moe_dispatch_bwd,
    .moe_combine = cuda_moe_combine,
    .moe_combine_bwd = cuda_moe_combine_bwd,
    .sgd_step = cuda_sgd_step,
    .adamw_step = cuda_adamw_step,
    .axpby = cuda_axpby,
    .scale = cuda_scale,
    .fill = cuda_fill,
    .sum = cuda_sum,
    .sq_norm = cuda_sq_norm,
    .sq_dist = cuda_sq_dist,
    .count_nonfinite = cuda_count_nonfinite,
    .count_sketch = cuda_count_sketch,
};

/* ---- open ---------------------------------------------------------------------------- */

/* In tensor_cuda_open: a failing CUDA call becomes an error return. */
#define OPEN_CUDA(call)                                                                        \
  do {                                                                                         \
    cudaError_t oerr_ = (call);                                                                \
    if (oerr_ != cudaSuccess) {                                                                \
      (void)cudaGetLastError();                                                                \
      rc = rumor_err_set(e, RUMOR_EDEVICE, "cuda:%d: %s failed: %s", device, #call,            \
                         cudaGetErrorString(oerr_));                                           \
      goto fail;                                                                               \
    }                                                                                          \
  } while (0)

int tensor_cuda_open(int device, tensor_backend_t *out, struct rumor_err *e) {
  *out = NULL;
  int count = tensor_cuda_count();
  if (device < 0 || device >= count)
    return rumor_err_set(e, RUMOR_EDEVICE, "cuda:%d: no such CUDA device (%d usable)", device, count);

  /* cuBLAS first: without it the device is of no use, and nothing of the
   * device has been touched yet. */
  struct rumor_err le;
  if (tensor_cublas_load(&le) != 0) return rumor_err_set(e, RUMOR_EDEVICE, "cuda:%d: %s", device, le.msg);

  int rc = 0;
  struct cuda_backend *b = xcalloc(1, sizeof *b);
  b->base.ops = &cuda_ops;
  b->base.device = TENSOR_DEVICE_CUDA;
  b->device = device;
  snprintf(b->base.name, sizeof b->base.name, "cuda:%d", device);

  OPEN_CUDA(cudaSetDevice(device));
  /* Host waits sleep rather than spin. CUDA 12 and later apply the flags to
   * a primary context that is already active too; where a driver refuses,
   * waits spin as before, which is slower for the other threads but not
   * wrong, so it is only logged. */
  cudaError_t ferr = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync);
  if (ferr != cudaSuccess) {
    log_debug("%s: cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) failed (%s); host waits will spin",
              b->base.name, cudaGetErrorString(ferr));
    (void)cudaGetLastError();
  }
  struct cudaDeviceProp prop;
  OPEN_CUDA(cudaGetDeviceProperties(&prop, device));
  if (kern_check_device() != 0) {
    rc = rumor_err_set(e, RUMOR_EDEVICE,
                       "cuda:%d: %s (compute capability %d.%d) cannot run this build's kernels, built for "
                       "CUDA architectures %s: %s",
                       device, prop.name, prop.major, prop.minor, RUMOR_CUDA_ARCHS, kern_last_error());
    goto fail;
  }
  OPEN_CUDA(cudaStreamCreateWithFlags(&b->stream, cudaStreamNonBlocking));
  OPEN_CUDA(cudaStreamCreateWithFlags(&b->beside, cudaStreamNonBlocking));
  OPEN_CUDA(cudaEventCreateWithFlags(&b->beside_after, cudaEventDisableTiming));
  const struct tensor_cublas *blas = tensor_cublas();
  cublasStatus_t st = blas->create(&b->blas);
  if (st == CUBLAS_STATUS_SUCCESS) st = blas->set_stream(b->blas, b->stream);
  /* Default math: true FP32, no TF32 tensor cores (tests hold GEMMs to FP32
   * tolerance against the CPU); tensor_backend_set_tf32 changes it. */
  if (st == CUBLAS_STATUS_SUCCESS) st = blas->set_math_mode(b->blas, CUBLAS_DEFAULT_MATH);
  if (st != CUBLAS_STATUS_SUCCESS) {
    (void)cudaGetLastError();
    rc = rumor_err_set(e, RUMOR_EDEVICE, "cuda:%d: cuBLAS set-up failed: %s", device, blas->status_string(st));
    goto fail;
  }
  OPEN_CUDA(cudaMalloc((void **)&b->d_partials, KERN_REDUCE_MAX_BLOCKS * sizeof(float)));
  OPEN_CUDA(cudaMalloc((void **)&b->d_count, sizeof(uint64_t)));
  OPEN_CUDA(cudaMallocHost((void **)&b->h_partials, KERN_REDUCE_MAX_BLOCKS * sizeof(float)));
  OPEN_CUDA(cudaMallocHost((void **)&b->h_count, sizeof(uint64_t)));

  log_info("%s: %s, %.1f GiB, %d SMs, compute capability %d.%d", b->base.name, prop.name,
           (double)prop.totalGlobalMem / (double)(1ull << 30), prop.multiProcessorCount, prop.major, prop.minor);
  *out = &b->base;
  return 0;

fail:
  cuda_release(b);
  return rc;
}
