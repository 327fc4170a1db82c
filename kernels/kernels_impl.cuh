/*
 * kernels_impl.cuh — what the kernel files (kernels.cu, nn.cu) share: launch
 * geometry, the launch-check macros and warp reductions. Private to
 * kernels/; C code sees only kernels/kernels.h.
 *
 * Everything here lives in namespace rumor_kern; the .cu files bring it in
 * with `using namespace rumor_kern`.
 */
#ifndef RUMOR_KERNELS_IMPL_CUH
#define RUMOR_KERNELS_IMPL_CUH

#include <cuda_runtime.h>
#include <stdint.h>

namespace rumor_kern {

constexpr int kBlock = 256;     // threads per block of the 1-D kernels
constexpr int kGridMax = 8192;  // at most this many blocks; grid-stride loops cover the rest
constexpr int kWarp = 32;
constexpr unsigned kFullMask = 0xffffffffu;

static_assert(kBlock % kWarp == 0, "block reductions assume whole warps");

// Records a failure of `what` (a kernel or call name, or a sentence saying
// which argument was refused) for kern_last_error() and returns `err` as an
// int. Defined in kernels.cu (the thread-local message lives there).
int record_failure(cudaError_t err, const char *what, const char *file, int line);

// Blocks for n items handled `per_block` at a time: at least 1, at most cap.
inline int blocks_for(int64_t n, int64_t per_block, int cap) {
  int64_t b = (n + per_block - 1) / per_block;
  return (int)(b < 1 ? 1 : (b > cap ? cap : b));
}

inline cudaStream_t as_stream(void *s) { return static_cast<cudaStream_t>(s); }

// Sum over the 32 lanes of a full warp; every lane gets the result. The
// butterfly order is fixed, so the result does not vary between runs.
template <typename T>
__device__ inline T warp_sum(T v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v += __shfl_xor_sync(kFullMask, v, o);
  return v;
}

__device__ inline float warp_max(float v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(kFullMask, v, o));
  return v;
}

}  // namespace rumor_kern

// After a launch: on failure, record the kernel's name and return the error.
#define KERN_LAUNCHED(kernel) KERN_LAUNCHED_AS(#kernel)
#define KERN_LAUNCHED_AS(name)                                                                     \
  do {                                                                                             \
    cudaError_t kerr_ = cudaGetLastError();                                                        \
    if (kerr_ != cudaSuccess) return rumor_kern::record_failure(kerr_, (name), __FILE__, __LINE__); \
  } while (0)

// A runtime call inside a launcher (memset): on failure, record and return.
#define KERN_CALL(call)                                                      \
  do {                                                                       \
    cudaError_t kerr_ = (call);                                              \
    if (kerr_ != cudaSuccess) {                                              \
      (void)cudaGetLastError();                                              \
      return rumor_kern::record_failure(kerr_, #call, __FILE__, __LINE__);   \
    }                                                                        \
  } while (0)

// An argument a launcher cannot serve (a size past a 32-bit limit, a scratch
// buffer too small): nothing is enqueued, cudaErrorInvalidValue is returned
// and kern_last_error() carries `why`.
#define KERN_REQUIRE(cond, why)                                                                 \
  do {                                                                                          \
    if (!(cond))                                                                                \
      return rumor_kern::record_failure(cudaErrorInvalidValue, (why), __FILE__, __LINE__);     \
  } while (0)

// for (int64_t i = first index of this thread; i < n; i += all threads)
#define GRID_STRIDE(i, n)                                                              \
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x, i##_step_ =          \
                       (int64_t)gridDim.x * blockDim.x;                                 \
       i < (n); i += i##_step_)

#endif /* RUMOR_KERNELS_IMPL_CUH */
