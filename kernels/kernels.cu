/*
 * The CUDA kernels behind kernels/kernels.h, and their launchers (the
 * transformer ops' are in nn.cu; kernels_impl.cuh holds what both share).
 *
 * Every kernel takes 64-bit element counts and walks them with a grid-stride
 * loop, so grids stay bounded (kGridMax blocks) whatever the size. Every
 * launch is followed by KERN_LAUNCHED(kernel), which reads cudaGetLastError
 * and, on failure, records the kernel's name with file and line for
 * kern_last_error() and returns the error from the launcher.
 *
 * Float accuracy: element-wise kernels use the same float formulas as the
 * CPU backend (tensor/tensor_cpu.c); nvcc may contract a·b + c into one FMA,
 * which differs from the CPU by at most an ulp or so.
 */
#include "kernels/kernels.h"

#include <cuda_runtime.h>
#include <math.h>
#include <stdio.h>

#include "kernels/kernels_impl.cuh" /* launch geometry, KERN_LAUNCHED, warp_sum */

using namespace rumor_kern;

static_assert(sizeof(unsigned long long) == sizeof(uint64_t), "uint64_t counter is an unsigned long long");

namespace {

thread_local char g_last_error[512] = "no error";

}  // namespace

int rumor_kern::record_failure(cudaError_t err, const char *what, const char *file, int line) {
  // A fault inside a kernel is reported by whichever call comes next, so
  // the launch named here may not be the one that faulted.
  bool sticky = err == cudaErrorIllegalAddress || err == cudaErrorLaunchFailure ||
                err == cudaErrorMisalignedAddress || err == cudaErrorIllegalInstruction ||
                err == cudaErrorHardwareStackError || err == cudaErrorAssert;
  snprintf(g_last_error, sizeof g_last_error, "%s (%s:%d): %s: %s%s", what, file, line, cudaGetErrorName(err),
           cudaGetErrorString(err),
           sticky ? " (an earlier kernel may have faulted: CUDA reports faults at the next call; "
                    "CUDA_LAUNCH_BLOCKING=1 names the kernel)"
                  : "");
  return (int)err;
}

extern "C" const char *kern_last_error(void) { return g_last_error; }

/* ---- shared device helpers ------------------------------------------------------ */

namespace {

// Sum of v over a 1-D block of whole warps (blockDim.x <= 1024); the result is
// valid in thread 0 only. Call once per kernel (its shared array is not
// re-synchronised for a second use).
__device__ float block_sum(float v) {
  __shared__ float warp_part[32];
  const int lane = threadIdx.x % kWarp, warp = threadIdx.x / kWarp;
  v = warp_sum(v);
  if (lane == 0) warp_part[warp] = v;
  __syncthreads();
  if (warp == 0) {
    const int nwarps = blockDim.x / kWarp;
    v = lane < nwarps ? warp_part[lane] : 0.0f;
    v = warp_sum(v);
  }
  return v;
}

// The count-sketch hash: a line-for-line copy of tensor_sketch_mix32 and
// tensor_sketch_hash in tensor/tensor.h (32-bit unsigned arithmetic, which
// wraps identically on host and device). kern_sketch_hash_host exposes the
// host compilation so a test can compare it with the header's version.
__host__ __device__ inline uint32_t sketch_mix32(uint32_t h) {
  h ^= h >> 16;
  h *= 0x85ebca6bu;
  h ^= h >> 13;
  h *= 0xc2b2ae35u;
  h ^= h >> 16;
  return h;
}

__host__ __device__ inline uint32_t sketch_hash(uint64_t seed, uint64_t i) {
  uint32_t key = sketch_mix32((uint32_t)(i >> 32) ^ (uint32_t)seed) ^ (uint32_t)(seed >> 32);
  return sketch_mix32(((uint32_t)i * 0x9e3779b1u) ^ key);
}

/* ---- kernels ---------------------------------------------------------------------- */

// y [rows, cols] += bias [cols] broadcast over rows. 2-D grid-stride: x over
// columns (coalesced), y over rows; no integer division per element.
__global__ void bias_add_kernel(float *y, const float *bias, int64_t rows, int64_t cols) {
  const int64_t c_step = (int64_t)gridDim.x * blockDim.x, r_step = (int64_t)gridDim.y * blockDim.y;
  for (int64_t r = (int64_t)blockIdx.y * blockDim.y + threadIdx.y; r < rows; r += r_step)
    for (int64_t c = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; c < cols; c += c_step)
      y[r * cols + c] += bias[c];
}

constexpr int kGradCols = 32;  // columns per tile of bias_grad (one warp wide)
constexpr int kGradRows = 32;  // row lanes per tile (blockDim.y)

// Column sums of the chunk blockIdx.y of rows of dy [rows, cols] (chunks of
// rows_per_chunk rows). Block (32, 32) owns tiles of 32 columns: thread
// (tx, ty) sums rows r0+ty, r0+ty+32, ... of the chunk in column c0+tx in
// float, then warp ty = 0 adds the 32 row-lane sums from shared memory in a
// fixed order, so results do not vary between runs. With one chunk (out ==
// db) the sum goes to db (+ beta·db); with several, to out[chunk·cols + c]
// for bias_grad_sum_kernel.
__global__ void __launch_bounds__(kGradCols * kGradRows)
    bias_grad_kernel(const float *dy, float *out, int64_t rows, int64_t cols, int64_t rows_per_chunk, bool direct,
                     float beta) {
  __shared__ float part[kGradRows][kGradCols + 1];  // +1: no bank conflicts reading columns
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t chunk = blockIdx.y, r0 = chunk * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  for (int64_t c0 = (int64_t)blockIdx.x * kGradCols; c0 < cols; c0 += (int64_t)gridDim.x * kGradCols) {
    const int64_t c = c0 + tx;
    float acc = 0.0f;
    if (c < cols)
      for (int64_t r = r0 + ty; r < r1; r += kGradRows) acc += dy[r * cols + c];
    part[ty][tx] = acc;
    __syncthreads();
    if (ty == 0 && c < cols) {
      float s = 0.0f;
      for (int j = 0; j < kGradRows; j++) s += part[j][tx];
      if (direct) out[c] = beta == 0.0f ? s : s + beta * out[c];
      else out[chunk * cols + c] = s;
    }
    __syncthreads();  // `part` is rewritten by the next tile
  }
}

// db[c] ← Σ_chunk part[chunk·cols + c] in chunk order (+ beta·db[c]; db not
// read when beta is 0).
__global__ void bias_grad_sum_kernel(const float *part, float *db, int64_t cols, int64_t nchunks, float beta) {
  GRID_STRIDE(c, cols) {
    float s = 0.0f;
    for (int64_t k = 0; k < nchunks; k++) s += part[k * cols + c];
    db[c] = beta == 0.0f ? s : s + beta * db[c];
  }
}

__global__ void relu_fwd_kernel(const float *x, float *y, int64_t n) {
  GRID_STRIDE(i, n) {
    float v = x[i];
    y[i] = v > 0.0f ? v : 0.0f;
  }
}

__global__ void relu_bwd_kernel(const float *y, const float *dy, float *dx, int64_t n) {
  GRID_STRIDE(i, n) { dx[i] = y[i] > 0.0f ? dy[i] : 0.0f; }
}

constexpr float kInvSqrt2 = 0.70710678118654752440f;
constexpr float kInvSqrt2Pi = 0.39894228040143267794f;

__global__ void gelu_fwd_kernel(const float *x, float *y, int64_t n) {
  GRID_STRIDE(i, n) {
    float v = x[i];
    y[i] = 0.5f * v * (1.0f + erff(v * kInvSqrt2));
  }
}

__global__ void gelu_bwd_kernel(const float *x, const float *dy, float *dx, int64_t n) {
  GRID_STRIDE(i, n) {
    float v = x[i];
    float cdf = 0.5f * (1.0f + erff(v * kInvSqrt2));
    float pdf = expf(-0.5f * v * v) * kInvSqrt2Pi;
    dx[i] = dy[i] * (cdf + v * pdf);
  }
}

constexpr int kXentWarps = 8;  // rows in flight per block (one warp each)

// One warp per row (grid-stride over rows). Pass 1 reads the row's maximum
// and the label's logit, pass 2 the sum of exponentials, pass 3 writes the
// gradient. Each lane reads and writes only its own columns (c ≡ lane mod
// 32), except x[label], which every lane reads in pass 1; the __syncwarp
// before pass 3 orders those reads before the write of d[label], so d may
// alias x.
__global__ void softmax_xent_kernel(const float *logits, const int32_t *labels, float *dlogits,
                                    float *losses, int64_t rows, int64_t cols, int64_t ld, float grad_scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t first = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const int64_t step = ((int64_t)gridDim.x * blockDim.x) / kWarp;
  for (int64_t r = first; r < rows; r += step) {
    const float *x = logits + r * ld;
    float *d = dlogits + r * ld;
    const int64_t label = labels[r];
    const float x_label = x[label];
    float mx = -INFINITY;
    for (int64_t c = lane; c < cols; c += kWarp) mx = fmaxf(mx, x[c]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int64_t c = lane; c < cols; c += kWarp) sum += expf(x[c] - mx);
    sum = warp_sum(sum);
    __syncwarp();
    const float scale = grad_scale / sum;
    for (int64_t c = lane; c < cols; c += kWarp) {
      float g = expf(x[c] - mx) * scale;
      d[c] = c == label ? g - grad_scale : g;
    }
    if (lane == 0) losses[r] = logf(sum) + mx - x_label;
  }
}

// The vocabulary-parallel cross-entropy's two passes, one warp per row as
// softmax_xent_kernel. stats: max, then the sum of exponentials (float
// lanes, warp_sum's fixed order); lse in float.
__global__ void xent_shard_stats_kernel(const float *logits, const int32_t *labels, float *lse, float *target,
                                        int64_t rows, int64_t cols, int64_t ld, int64_t lo) {
  const int lane = threadIdx.x % kWarp;
  const int64_t first = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const int64_t step = ((int64_t)gridDim.x * blockDim.x) / kWarp;
  for (int64_t r = first; r < rows; r += step) {
    const float *x = logits + r * ld;
    float mx = -INFINITY;
    for (int64_t c = lane; c < cols; c += kWarp) mx = fmaxf(mx, x[c]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int64_t c = lane; c < cols; c += kWarp) sum += expf(x[c] - mx);
    sum = warp_sum(sum);
    if (lane == 0) {
      const int64_t k = (int64_t)labels[r] - lo;
      lse[r] = logf(sum) + mx;
      target[r] = (k >= 0 && k < cols) ? x[k] : 0.0f;
    }
  }
}

// grad: every lane combines the parts itself (nparts is small: the ranks of
// a tensor-parallel group), in double and in part order.
__global__ void xent_shard_grad_kernel(const float *logits, const int32_t *labels, const float *parts, int64_t nparts,
                                       const float *target, float *dlogits, float *losses, int64_t rows,
                                       int64_t cols, int64_t ld, int64_t lo, float grad_scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t first = ((int64_t)blockIdx.x * blockDim.x + threadIdx.x) / kWarp;
  const int64_t step = ((int64_t)gridDim.x * blockDim.x) / kWarp;
  for (int64_t r = first; r < rows; r += step) {
    double mx = parts[r], sum = 0.0;
    for (int64_t s = 1; s < nparts; s++) mx = fmax(mx, (double)parts[s * rows + r]);
    for (int64_t s = 0; s < nparts; s++) sum += exp((double)parts[s * rows + r] - mx);
    const double whole = mx + log(sum);
    if (lane == 0 && losses) losses[r] = (float)(whole - (double)target[r]);
    const float *x = logits + r * ld;
    float *d = dlogits + r * ld;
    const float l = (float)whole;
    const int64_t k = (int64_t)labels[r] - lo;
    for (int64_t c = lane; c < cols; c += kWarp) {
      const float g = expf(x[c] - l) * grad_scale;
      d[c] = c == k ? g - grad_scale : g;
    }
  }
}

// m is NULL exactly when momentum is 0 (the launcher sees to it).
__global__ void sgd_kernel(float *p, const float *g, float *m, int64_t n, float lr, float mu, float wd,
                           bool nesterov) {
  GRID_STRIDE(i, n) {
    float grad = g[i] + wd * p[i];
    float step = grad;
    if (m) {
      float mi = mu * m[i] + grad;
      m[i] = mi;
      step = nesterov ? grad + mu * mi : mi;
    }
    p[i] -= lr * step;
  }
}

// decay = 1 − lr·wd, step_size = lr/(1 − β1^t), inv_sqrt_bc2 = 1/√(1 − β2^t).
__global__ void adamw_kernel(float *p, const float *g, float *m, float *v, int64_t n, float b1, float b2,
                             float eps, float decay, float step_size, float inv_sqrt_bc2) {
  GRID_STRIDE(i, n) {
    float gi = g[i];
    float mi = b1 * m[i] + (1.0f - b1) * gi;
    float vi = b2 * v[i] + (1.0f - b2) * gi * gi;
    m[i] = mi;
    v[i] = vi;
    p[i] = p[i] * decay - step_size * mi / (sqrtf(vi) * inv_sqrt_bc2 + eps);
  }
}

__global__ void axpby_kernel(float a, const float *x, float b, float *y, int64_t n) {
  GRID_STRIDE(i, n) { y[i] = a * x[i] + b * y[i]; }
}

__global__ void scale_kernel(float *x, float a, int64_t n) {
  GRID_STRIDE(i, n) { x[i] *= a; }
}

__global__ void fill_kernel(float *x, float v, int64_t n) {
  GRID_STRIDE(i, n) { x[i] = v; }
}

// What a reduction adds per element: x, x², or (x − y)².
enum class Reduce { kSum, kSqNorm, kSqDist };

template <Reduce kind>
__device__ float reduce_term(const float *x, const float *y, int64_t i) {
  if constexpr (kind == Reduce::kSum) {
    return x[i];
  } else if constexpr (kind == Reduce::kSqNorm) {
    return x[i] * x[i];
  } else {
    float d = x[i] - y[i];
    return d * d;
  }
}

// partials[blockIdx.x] ← the float sum of this block's terms.
template <Reduce kind>
__global__ void reduce_kernel(const float *x, const float *y, int64_t n, float *partials) {
  float acc = 0.0f;
  GRID_STRIDE(i, n) { acc += reduce_term<kind>(x, y, i); }
  acc = block_sum(acc);
  if (threadIdx.x == 0) partials[blockIdx.x] = acc;
}

// *count += the number of elements whose exponent bits are all ones (NaN,
// ±Inf); an integer test, immune to fast-math assumptions.
__global__ void count_nonfinite_kernel(const float *x, int64_t n, unsigned long long *count) {
  unsigned long long bad = 0;
  GRID_STRIDE(i, n) { bad += (__float_as_uint(x[i]) & 0x7f800000u) == 0x7f800000u; }
  bad = warp_sum(bad);
  if (threadIdx.x % kWarp == 0 && bad) atomicAdd(count, bad);
}

// Where element i goes: a line-for-line copy of tensor_sketch_bucket in
// tensor/tensor.h (the blocked layout: groups of 8 share one hash). Each
// thread recomputes its group's hash; that costs less than sharing it.
__device__ inline uint32_t sketch_bucket(uint64_t seed, uint64_t i, uint32_t mask, bool *negative) {
  uint32_t h = sketch_hash(seed, i >> 3), lane = (uint32_t)(i & 7);
  *negative = (h >> lane) & 1u;
  return (((h >> 8) << 3) | lane) & mask;
}

// Count-sketch with k = mask + 1 <= KERN_SKETCH_SHARED_MAX float buckets in
// dynamic shared memory (k·4 bytes), flushed into out with double atomics.
__global__ void sketch_shared_kernel(const float *x, int64_t n, uint64_t seed, uint32_t mask, double *out) {
  extern __shared__ float bucket[];
  const uint32_t k = mask + 1;
  for (uint32_t j = threadIdx.x; j < k; j += blockDim.x) bucket[j] = 0.0f;
  __syncthreads();
  GRID_STRIDE(i, n) {
    bool neg;
    uint32_t b = sketch_bucket(seed, (uint64_t)i, mask, &neg);
    float v = x[i];
    atomicAdd(&bucket[b], neg ? -v : v);
  }
  __syncthreads();
  for (uint32_t j = threadIdx.x; j < k; j += blockDim.x) {
    float b = bucket[j];
    if (b != 0.0f) atomicAdd(&out[j], (double)b);  // NaN != 0, so NaN propagates
  }
}

// Count-sketch with many buckets: each element goes straight to out.
__global__ void sketch_global_kernel(const float *x, int64_t n, uint64_t seed, uint32_t mask, double *out) {
  GRID_STRIDE(i, n) {
    bool neg;
    uint32_t b = sketch_bucket(seed, (uint64_t)i, mask, &neg);
    double v = (double)x[i];
    atomicAdd(&out[b], neg ? -v : v);
  }
}

}  // namespace

/* ---- launchers -------------------------------------------------------------------- */

extern "C" int kern_check_device(void) {
  cudaFuncAttributes attr;
  cudaError_t err = cudaFuncGetAttributes(&attr, relu_fwd_kernel);
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return record_failure(err, "cudaFuncGetAttributes(relu_fwd_kernel)", __FILE__, __LINE__);
  }
  return 0;
}

extern "C" int kern_bias_add(float *y, const float *bias, int64_t rows, int64_t cols, void *stream) {
  if (rows == 0 || cols == 0) return 0;
  const dim3 block(kWarp, kBlock / kWarp);
  const int gx = blocks_for(cols, block.x, kGridMax);
  const int gy = blocks_for(rows, block.y, kGridMax / gx > 0 ? kGridMax / gx : 1);
  bias_add_kernel<<<dim3(gx, gy), block, 0, as_stream(stream)>>>(y, bias, rows, cols);
  KERN_LAUNCHED(bias_add_kernel);
  return 0;
}

// Chunks of rows for bias_grad's partials: KERN_BIAS_ROWS_PER_CHUNK rows
// each, at most KERN_BIAS_MAX_CHUNKS and KERN_BIAS_PART_MAX partials. A
// function of the shape only, so the summation order, hence the bits, never
// change.
static int64_t bias_chunks(int64_t rows, int64_t cols) {
  int64_t k = (rows + KERN_BIAS_ROWS_PER_CHUNK - 1) / KERN_BIAS_ROWS_PER_CHUNK;
  if (k > KERN_BIAS_MAX_CHUNKS) k = KERN_BIAS_MAX_CHUNKS;
  if (cols > 0 && k > KERN_BIAS_PART_MAX / cols) k = KERN_BIAS_PART_MAX / cols;
  return k < 1 ? 1 : k;
}

extern "C" size_t kern_bias_grad_scratch_bytes(int64_t rows, int64_t cols) {
  const int64_t k = bias_chunks(rows, cols);
  return k > 1 ? (size_t)(k * cols) * sizeof(float) : 0;
}

extern "C" int kern_bias_grad(const float *dy, float *db, int64_t rows, int64_t cols, float beta, void *scratch,
                              size_t scratch_bytes, void *stream) {
  if (cols == 0) return 0;
  const int64_t nchunks = bias_chunks(rows, cols), per_chunk = rows > 0 ? (rows + nchunks - 1) / nchunks : 1;
  const size_t need = kern_bias_grad_scratch_bytes(rows, cols);
  KERN_REQUIRE(need == 0 || (scratch != nullptr && scratch_bytes >= need), "kern_bias_grad: scratch buffer too small");
  cudaStream_t st = as_stream(stream);
  const bool direct = nchunks == 1;
  float *out = direct ? db : static_cast<float *>(scratch);
  const dim3 grid(blocks_for(cols, kGradCols, kGridMax), (unsigned)nchunks), block(kGradCols, kGradRows);
  bias_grad_kernel<<<grid, block, 0, st>>>(dy, out, rows, cols, per_chunk, direct, beta);
  KERN_LAUNCHED(bias_grad_kernel);
  if (!direct) {
    bias_grad_sum_kernel<<<blocks_for(cols, kBlock, kGridMax), kBlock, 0, st>>>(out, db, cols, nchunks, beta);
    KERN_LAUNCHED(bias_grad_sum_kernel);
  }
  return 0;
}

extern "C" int kern_relu_fwd(const float *x, float *y, int64_t n, void *stream) {
  if (n == 0) return 0;
  relu_fwd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, y, n);
  KERN_LAUNCHED(relu_fwd_kernel);
  return 0;
}

extern "C" int kern_relu_bwd(const float *y, const float *dy, float *dx, int64_t n, void *stream) {
  if (n == 0) return 0;
  relu_bwd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(y, dy, dx, n);
  KERN_LAUNCHED(relu_bwd_kernel);
  return 0;
}

extern "C" int kern_gelu_fwd(const float *x, float *y, int64_t n, void *stream) {
  if (n == 0) return 0;
  gelu_fwd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, y, n);
  KERN_LAUNCHED(gelu_fwd_kernel);
  return 0;
}

extern "C" int kern_gelu_bwd(const float *x, const float *dy, float *dx, int64_t n, void *stream) {
  if (n == 0) return 0;
  gelu_bwd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, dy, dx, n);
  KERN_LAUNCHED(gelu_bwd_kernel);
  return 0;
}

extern "C" int kern_softmax_xent(const float *logits, const int32_t *labels, float *dlogits, float *losses,
                                 int64_t rows, int64_t cols, int64_t ld, float grad_scale, void *stream) {
  if (rows == 0 || cols == 0) return 0;
  softmax_xent_kernel<<<blocks_for(rows, kXentWarps, kGridMax), kXentWarps * kWarp, 0, as_stream(stream)>>>(
      logits, labels, dlogits, losses, rows, cols, ld, grad_scale);
  KERN_LAUNCHED(softmax_xent_kernel);
  return 0;
}

extern "C" int kern_xent_shard_stats(const float *logits, const int32_t *labels, float *lse, float *target,
                                     int64_t rows, int64_t cols, int64_t ld, int64_t lo, void *stream) {
  if (rows == 0 || cols == 0) return 0;
  xent_shard_stats_kernel<<<blocks_for(rows, kXentWarps, kGridMax), kXentWarps * kWarp, 0, as_stream(stream)>>>(
      logits, labels, lse, target, rows, cols, ld, lo);
  KERN_LAUNCHED(xent_shard_stats_kernel);
  return 0;
}

extern "C" int kern_xent_shard_grad(const float *logits, const int32_t *labels, const float *parts, int64_t nparts,
                                    const float *target, float *dlogits, float *losses, int64_t rows, int64_t cols,
                                    int64_t ld, int64_t lo, float grad_scale, void *stream) {
  if (rows == 0 || cols == 0) return 0;
  xent_shard_grad_kernel<<<blocks_for(rows, kXentWarps, kGridMax), kXentWarps * kWarp, 0, as_stream(stream)>>>(
      logits, labels, parts, nparts, target, dlogits, losses, rows, cols, ld, lo, grad_scale);
  KERN_LAUNCHED(xent_shard_grad_kernel);
  return 0;
}

extern "C" int kern_sgd_step(float *p, const float *g, float *m, int64_t n, float lr, float momentum,
                             float weight_decay, bool nesterov, void *stream) {
  if (n == 0) return 0;
  float *mom = momentum == 0.0f ? nullptr : m;  // PyTorch keeps no buffer when μ = 0
  sgd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(p, g, mom, n, lr, momentum,
                                                                                weight_decay, nesterov);
  KERN_LAUNCHED(sgd_kernel);
  return 0;
}

extern "C" int kern_adamw_step(float *p, const float *g, float *m, float *v, int64_t n, float lr, float beta1,
                               float beta2, float eps, float weight_decay, int64_t step, void *stream) {
  if (n == 0) return 0;
  const float decay = 1.0f - lr * weight_decay;
  const float step_size = (float)(lr / (1.0 - pow((double)beta1, (double)step)));
  const float inv_sqrt_bc2 = (float)(1.0 / sqrt(1.0 - pow((double)beta2, (double)step)));
  adamw_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(
      p, g, m, v, n, beta1, beta2, eps, decay, step_size, inv_sqrt_bc2);
  KERN_LAUNCHED(adamw_kernel);
  return 0;
}

extern "C" int kern_axpby(float a, const float *x, float b, float *y, int64_t n, void *stream) {
  if (n == 0) return 0;
  axpby_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(a, x, b, y, n);
  KERN_LAUNCHED(axpby_kernel);
  return 0;
}

extern "C" int kern_scale(float *x, float a, int64_t n, void *stream) {
  if (n == 0) return 0;
  scale_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, a, n);
  KERN_LAUNCHED(scale_kernel);
  return 0;
}

extern "C" int kern_fill(float *x, float v, int64_t n, void *stream) {
  if (n == 0) return 0;
  fill_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, v, n);
  KERN_LAUNCHED(fill_kernel);
  return 0;
}

namespace {

template <Reduce kind>
int launch_reduce(const char *name, const float *x, const float *y, int64_t n, float *partials, int *nparts,
                  void *stream) {
  *nparts = 0;
  if (n == 0) return 0;
  const int blocks = blocks_for(n, kBlock, KERN_REDUCE_MAX_BLOCKS);
  reduce_kernel<kind><<<blocks, kBlock, 0, as_stream(stream)>>>(x, y, n, partials);
  KERN_LAUNCHED_AS(name);
  *nparts = blocks;
  return 0;
}

}  // namespace

extern "C" int kern_sum_partials(const float *x, int64_t n, float *partials, int *nparts, void *stream) {
  return launch_reduce<Reduce::kSum>("reduce_kernel<sum>", x, nullptr, n, partials, nparts, stream);
}

extern "C" int kern_sq_norm_partials(const float *x, int64_t n, float *partials, int *nparts, void *stream) {
  return launch_reduce<Reduce::kSqNorm>("reduce_kernel<sq_norm>", x, nullptr, n, partials, nparts, stream);
}

extern "C" int kern_sq_dist_partials(const float *x, const float *y, int64_t n, float *partials, int *nparts,
                                     void *stream) {
  return launch_reduce<Reduce::kSqDist>("reduce_kernel<sq_dist>", x, y, n, partials, nparts, stream);
}

extern "C" int kern_count_nonfinite(const float *x, int64_t n, uint64_t *count, void *stream) {
  KERN_CALL(cudaMemsetAsync(count, 0, sizeof *count, as_stream(stream)));
  if (n == 0) return 0;
  count_nonfinite_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(
      x, n, reinterpret_cast<unsigned long long *>(count));
  KERN_LAUNCHED(count_nonfinite_kernel);
  return 0;
}

// Sketch grids: each block should see a few thousand elements, so that the
// per-block flush (k atomics) stays small next to the work.
constexpr int kSketchPerBlock = 4096;
constexpr int kSketchGridMax = 512;

extern "C" int kern_count_sketch(const float *x, int64_t n, uint64_t seed, int k, double *out, void *stream) {
  KERN_CALL(cudaMemsetAsync(out, 0, (size_t)k * sizeof *out, as_stream(stream)));
  if (n == 0) return 0;
  const uint32_t mask = (uint32_t)k - 1;
  if (k <= KERN_SKETCH_SHARED_MAX) {
    const int blocks = blocks_for(n, kSketchPerBlock, kSketchGridMax);
    sketch_shared_kernel<<<blocks, kBlock, (size_t)k * sizeof(float), as_stream(stream)>>>(x, n, seed, mask,
                                                                                           out);
    KERN_LAUNCHED(sketch_shared_kernel);
  } else {
    sketch_global_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, n, seed, mask,
                                                                                            out);
    KERN_LAUNCHED(sketch_global_kernel);
  }
  return 0;
}

extern "C" uint32_t kern_sketch_hash_host(uint64_t seed, uint64_t i) { return sketch_hash(seed, i); }
