/*
 * tensor_cpu.h — private to the CPU backend (tensor_cpu.c, tensor_cpu_nn.c);
 * not a public header and not for use outside tensor/. It holds what the
 * backend's source files share: the backend struct, its thread count and
 * scratch memory, the parallel-loop helpers, the GEMM, and the transformer
 * entries that tensor_cpu_nn.c implements for the ops table in tensor_cpu.c.
 *
 * Threads: like every backend, one caller thread at a time (tensor.h). The
 * entries below fork OpenMP teams of at most `threads` workers inside a call
 * and join them before returning.
 */
#ifndef RUMOR_TENSOR_CPU_H
#define RUMOR_TENSOR_CPU_H

#include <omp.h>

#include "tensor/tensor_impl.h"

/* Below this many elements a loop runs on one thread: an OpenMP fork costs
 * a few microseconds, about what 64 K simple float ops cost. */
#define CPU_PAR_MIN 65536
#define CPU_ALIGN 64

struct cpu_backend {
  struct tensor_backend base;
  int threads;
  /* Scratch for the ops (cpu_scratch): 64-byte aligned, grown on demand,
   * freed at close. */
  float *scratch;
  size_t scratch_floats;
};

static inline int nthreads(tensor_backend_t be) { return ((struct cpu_backend *)be)->threads; }

/* At least `floats` floats of 64-byte aligned scratch owned by the backend.
 * The contents are undefined; the memory stays valid until the next call
 * (which may move it) or the backend's close. Call it from the caller's
 * thread, before forking, and hand out disjoint parts to the workers.
 * Out of memory panics, naming the size. */
float *cpu_scratch(tensor_backend_t be, size_t floats);

/* Row-major C[m,n] ← alpha·op(A)·op(B) + beta·C through dnnl_sgemm, which
 * runs on `threads` OpenMP threads: the calling thread's nthreads ICV is set
 * to `threads` for the call and restored after it. Inside a parallel region
 * pass 1, so oneDNN (Debian's build uses OpenMP) neither forks a nested team
 * nor waits for one (measured: two workers each running their own GEMM
 * reach twice the one-thread rate). Panics when oneDNN reports an error. */
void cpu_sgemm(int threads, bool ta, bool tb, int m, int n, int k, float alpha, const float *a, int lda,
               const float *b, int ldb, float beta, float *c, int ldc);

/* Kernels are plain loops compiled several times and picked at load time:
 * CPU_KERNEL for AVX2 and baseline x86-64; CPU_KERNEL_WIDE also for
 * x86-64-v4 (AVX-512) and v3 (AVX2 with FMA), for the transformer kernels,
 * which do enough arithmetic per byte to profit. Not under the sanitizers
 * (ifuncs and ASan do not mix) or with other compilers. */
#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__) && !defined(RUMOR_NO_TARGET_CLONES)
#define CPU_KERNEL __attribute__((target_clones("avx2", "default")))
#define CPU_KERNEL_WIDE __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define CPU_KERNEL
#define CPU_KERNEL_WIDE
#endif

/* Runs the statement(s) for [lo, hi) ranges covering [0, n): the whole
 * range on the caller's thread when n is small or one thread is set, else
 * one contiguous chunk (a multiple of 16 elements) per worker. */
#define CPU_FOR(be, n, lo, hi, ...)                                        \
  do {                                                                     \
    int64_t n_ = (n);                                                      \
    int t_ = nthreads(be);                                                 \
    if (t_ <= 1 || n_ < CPU_PAR_MIN) {                                     \
      int64_t lo = 0, hi = n_;                                             \
      __VA_ARGS__;                                                         \
    } else {                                                               \
      _Pragma("omp parallel num_threads(t_)") {                            \
        int nt_ = omp_get_num_threads();                                   \
        int64_t chunk_ = (((n_ + nt_ - 1) / nt_) + 15) & ~(int64_t)15;    \
        int64_t lo = (int64_t)omp_get_thread_num() * chunk_;               \
        int64_t hi = lo + chunk_ < n_ ? lo + chunk_ : n_;                  \
        if (lo < hi) { __VA_ARGS__; }                                      \
      }                                                                    \
    }                                                                      \
  } while (0)

/* The same over rows: [lo, hi) ranges of whole rows covering [0, rows),
 * split across the workers when rows·cols is large enough. */
#define CPU_FOR_ROWS(be, rows, cols, lo, hi, ...)                           \
  do {                                                                     \
    int64_t r_ = (rows);                                                   \
    int t_ = nthreads(be);                                                 \
    if (t_ <= 1 || r_ < 2 || r_ * (int64_t)(cols) < CPU_PAR_MIN) {         \
      int64_t lo = 0, hi = r_;                                             \
      __VA_ARGS__;                                                         \
    } else {                                                               \
      _Pragma("omp parallel num_threads(t_)") {                            \
        int nt_ = omp_get_num_threads();                                   \
        int64_t chunk_ = (r_ + nt_ - 1) / nt_;                             \
        int64_t lo = (int64_t)omp_get_thread_num() * chunk_;               \
        int64_t hi = lo + chunk_ < r_ ? lo + chunk_ : r_;                  \
        if (lo < hi) { __VA_ARGS__; }                                      \
      }                                                                    \
    }                                                                      \
  } while (0)

/* ---- transformer entries (tensor_cpu_nn.c); contracts in tensor.h and
 * tensor_impl.h ---- */
void cpu_add(tensor_backend_t be, const float *x, const float *y, float *out, int64_t n);
void cpu_embedding_fwd(tensor_backend_t be, const int32_t *tokens, const float *wte, const float *wpe, float *out,
                       int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v);
void cpu_embedding_bwd(tensor_backend_t be, const int32_t *tokens, const float *dout, float *dwte, float *dwpe,
                       int64_t r, int64_t t, int64_t c, int64_t lo, int64_t v);
void cpu_layernorm_fwd(tensor_backend_t be, const float *x, const float *w, const float *b, float *y, float *mean,
                       float *rstd, int64_t rows, int64_t c);
void cpu_layernorm_bwd(tensor_backend_t be, const float *x, const float *w, const float *mean, const float *rstd,
                       const float *dy, float *dx, float *dw, float *db, int64_t rows, int64_t c, float beta);
void cpu_attention_fwd(tensor_backend_t be, const float *qkv, float *out, float *lse, int64_t r, int64_t t, int64_t c,
                       int nh);
void cpu_attention_bwd(tensor_backend_t be, const float *qkv, const float *out, const float *lse, const float *dout,
                       float *dqkv, int64_t r, int64_t t, int64_t c, int nh);
void cpu_gelu_tanh_fwd(tensor_backend_t be, const float *x, float *y, int64_t n);
void cpu_gelu_tanh_bwd(tensor_backend_t be, const float *x, const float *dy, float *dx, int64_t n);

void cpu_moe_route(tensor_backend_t be, const float *logits, float *probs, float *lse, int32_t *expert, float *gate,
                   int32_t *slot, int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e, int k,
                   int64_t cap);
void cpu_moe_route_bwd(tensor_backend_t be, const float *probs, const float *lse, const int32_t *expert,
                       const float *gate, const float *dgate, const float *daux, float zscale, float *dlogits,
                       int64_t n, int64_t e, int k);
void cpu_moe_dispatch(tensor_backend_t be, const float *x, const int32_t *expert, const int32_t *slot, float *xe,
                      int64_t n, int64_t ch, int k, int64_t e, int64_t cap);
void cpu_moe_dispatch_bwd(tensor_backend_t be, const float *dxe, const int32_t *expert, const int32_t *slot, float *dx,
                          int64_t n, int64_t ch, int k, int64_t e, int64_t cap);
void cpu_moe_combine(tensor_backend_t be, const float *ye, const int32_t *expert, const int32_t *slot,
                     const float *gate, float *out, int64_t n, int64_t ch, int k, int64_t e, int64_t cap);
void cpu_moe_combine_bwd(tensor_backend_t be, const float *dout, const float *ye, const int32_t *expert,
                         const int32_t *slot, const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k,
                         int64_t e, int64_t cap);

#endif /* RUMOR_TENSOR_CPU_H */
