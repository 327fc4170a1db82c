/*
 * The mixture-of-experts kernels behind kernels/kernels.h ("mixture of
 * experts"): routing (softmax, top-K, gates, then slots per expert),
 * its backward, and the dispatch / combine permutations with theirs.
 *
 * Conventions are kernels.cu's: 64-bit counts, bounded grids that stride
 * over the rest, KERN_LAUNCHED after every launch.
 *
 * Determinism: no atomics. Each output element has one writer, and every
 * sum runs in an order fixed by the shapes: a lane's strided partials,
 * then warp_sum's fixed butterfly, then fixed-order loops. The slots come
 * from one block per expert that walks the N·K choices in the contract's
 * order (k = 0 for every token, then k = 1, ...) with a block-wide prefix
 * sum per tile, so they are the sequential loop's, exactly.
 */
#include <cub/block/block_scan.cuh>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "kernels/kernels_impl.cuh" /* launch geometry, KERN_LAUNCHED, warp_sum, warp_max */

using namespace rumor_kern;

namespace {

constexpr int kRowWarps = 8;  // rows (or choices) in flight per block of the warp-per-row kernels

__device__ inline int64_t warp_row0(void) { return (int64_t)blockIdx.x * kRowWarps + threadIdx.x / kWarp; }
__device__ inline int64_t warp_row_step(void) { return (int64_t)gridDim.x * kRowWarps; }

// The CPU backend's ranking (tensor_cpu_nn.c, moe_order_key and moe_rank),
// bit for bit: an unsigned key that orders like the float, −0 taken as
// +0; the rank puts the larger key first and, on a tie, the lower index.
// Every rank is > 0 and they are distinct within a row.
__device__ inline uint32_t order_key(float f) {
  const uint32_t u = __float_as_uint(f == 0.0f ? 0.0f : f);
  return (u & 0x80000000u) ? ~u : (u | 0x80000000u);
}
__device__ inline uint64_t rank_of(float l, int64_t j) {
  return ((uint64_t)order_key(l) << 32) | (uint32_t)(INT32_MAX - j);
}
__device__ inline uint64_t warp_max_u64(uint64_t v) {
  for (int o = kWarp / 2; o > 0; o >>= 1) {
    const uint64_t w = __shfl_xor_sync(kFullMask, (unsigned long long)v, o);
    v = w > v ? w : v;
  }
  return v;
}

// One probability from its logit, the row's max and the sum of e^(l − max):
// the one expression for every use, so probs and the gates see the same
// bits.
__device__ inline float prob_of(float l, float mx, float sum) { return expf(l - mx) / sum; }

// Routing's row part, one warp per token: probs, lse, the K best experts
// (K passes, each the best rank below the previous pick, by a warp max),
// then the gates (lanes over k, after __syncwarp makes lane 0's expert
// writes visible). psel, the chosen probabilities' sum in k order, is
// computed alike by every lane.
__global__ void __launch_bounds__(kRowWarps *kWarp)
    moe_route_rows_kernel(const float *logits, float *probs, float *lse, int32_t *expert, float *gate, int64_t n,
                          int64_t e, int k) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t i = warp_row0(); i < n; i += warp_row_step()) {
    const float *l = logits + i * e;
    float mx = -INFINITY;
    for (int64_t j = lane; j < e; j += kWarp) mx = fmaxf(mx, l[j]);
    mx = warp_max(mx);
    float s = 0.0f;
    for (int64_t j = lane; j < e; j += kWarp) s += expf(l[j] - mx);
    const float sum = warp_sum(s);
    for (int64_t j = lane; j < e; j += kWarp) probs[i * e + j] = prob_of(l[j], mx, sum);
    if (lane == 0) lse[i] = mx + logf(sum);
    uint64_t prev = UINT64_MAX;
    float psel = 0.0f;
    for (int c = 0; c < k; c++) {
      uint64_t best = 0;
      for (int64_t j = lane; j < e; j += kWarp) {
        const uint64_t r = rank_of(l[j], j);
        if (r < prev && r > best) best = r;
      }
      best = warp_max_u64(best);
      prev = best;
      const int64_t ex = INT32_MAX - (int64_t)(uint32_t)best;
      if (lane == 0) expert[i * k + c] = (int32_t)ex;
      psel += prob_of(l[ex], mx, sum);
    }
    __syncwarp();
    for (int c = lane; c < k; c += kWarp) {
      const float p = prob_of(l[expert[i * k + c]], mx, sum);
      gate[i * k + c] = k == 1 ? p : p / psel;
    }
  }
}

constexpr int kSlotThreads = 256;  // threads of the per-expert slot kernel
constexpr int kSlotItems = 4;      // consecutive choices per thread per tile
constexpr int kSlotTile = kSlotThreads * kSlotItems;

// One block per expert x (block-stride over the experts). Walks the
// choices in order o = c·n + i (choice c of token i) a tile at a time:
// each thread counts its kSlotItems consecutive choices of x, a block scan
// turns the counts into ranks, and choice o gets slot `rank` (−1 from cap
// on). Then assigned[x], kept[x], and psum[x] = Σ_i probs[i, x] (strided
// partials, a fixed warp butterfly, the warps' sums in order).
__global__ void __launch_bounds__(kSlotThreads)
    moe_route_slots_kernel(const int32_t *expert, const float *probs, int32_t *slot, int32_t *assigned,
                           int32_t *kept, float *psum, int64_t n, int64_t e, int k, int64_t cap) {
  using Scan = cub::BlockScan<int, kSlotThreads>;
  __shared__ typename Scan::TempStorage scan_tmp;
  __shared__ float warp_part[kSlotThreads / kWarp];
  const int64_t total = n * k;
  for (int64_t x = blockIdx.x; x < e; x += gridDim.x) {
    int64_t base = 0;  // choices of x before this tile (block-uniform)
    for (int64_t t0 = 0; t0 < total; t0 += kSlotTile) {
      const int64_t o0 = t0 + (int64_t)threadIdx.x * kSlotItems;
      bool mine[kSlotItems];
      int count = 0;
      for (int q = 0; q < kSlotItems; q++) {
        const int64_t o = o0 + q, at = (o % n) * k + o / n;  // only read when o < total
        mine[q] = o < total && expert[at] == x;
        count += mine[q];
      }
      int rank, tile_count;
      Scan(scan_tmp).ExclusiveSum(count, rank, tile_count);
      for (int q = 0; q < kSlotItems; q++)
        if (mine[q]) {
          const int64_t o = o0 + q, s = base + rank++;
          slot[(o % n) * k + o / n] = s < cap ? (int32_t)s : -1;
        }
      base += tile_count;
      __syncthreads();  // scan_tmp is reused by the next tile
    }
    float ps = 0.0f;
    for (int64_t i = threadIdx.x; i < n; i += kSlotThreads) ps += probs[i * e + x];
    ps = warp_sum(ps);
    if (threadIdx.x % kWarp == 0) warp_part[threadIdx.x / kWarp] = ps;
    __syncthreads();
    if (threadIdx.x == 0) {
      float sum = 0.0f;
      for (int w = 0; w < kSlotThreads / kWarp; w++) sum += warp_part[w];
      psum[x] = sum;
      assigned[x] = (int32_t)base;
      kept[x] = (int32_t)(base < cap ? base : cap);
    }
    __syncthreads();  // warp_part is reused by the next expert
  }
}

// Routing's backward, one warp per token (tensor.h; the CPU's algebra):
// gp_k = (dgate_k − shift)·inv with shift, inv = 0, 1 for K = 1 and
// Σ_j dgate_j·gate_j, 1/Σ_j p[e_j] for K > 1; dprob = daux + Σ_k gp_k at
// e_k; pd = Σ_e p·dprob; dlogits = p·(dprob − pd) + zscale·lse·p. Choices
// with an expert outside [0, e) are skipped.
__global__ void __launch_bounds__(kRowWarps *kWarp)
    moe_route_bwd_kernel(const float *probs, const float *lse, const int32_t *expert, const float *gate,
                         const float *dgate, const float *daux, float zscale, float *dlogits, int64_t n, int64_t e,
                         int k) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t i = warp_row0(); i < n; i += warp_row_step()) {
    const float *p = probs + i * e;
    const int32_t *ex = expert + i * k;
    const float *dg = dgate + i * k;
    float dot = 0.0f, ps = 0.0f;
    for (int c = lane; c < k; c += kWarp)
      if (ex[c] >= 0 && ex[c] < e) {
        dot += dg[c] * gate[i * k + c];
        ps += p[ex[c]];
      }
    dot = warp_sum(dot);
    ps = warp_sum(ps);
    const float shift = k == 1 ? 0.0f : dot, inv = k == 1 ? 1.0f : 1.0f / ps;
    float pd = 0.0f;
    for (int64_t j = lane; j < e; j += kWarp) {
      float d = daux[j];
      for (int c = 0; c < k; c++)
        if (ex[c] == j) d += (dg[c] - shift) * inv;
      pd += p[j] * d;
    }
    pd = warp_sum(pd);
    const float zl = zscale * lse[i];
    for (int64_t j = lane; j < e; j += kWarp) {
      float d = daux[j];
      for (int c = 0; c < k; c++)
        if (ex[c] == j) d += (dg[c] - shift) * inv;
      dlogits[i * e + j] = p[j] * (d - pd) + zl * p[j];
    }
  }
}

// The row of choice c of token i in the expert buffers, or −1 when it is
// dropped (or its indices lie outside the buffers).
__device__ inline int64_t row_of(const int32_t *expert, const int32_t *slot, int64_t i, int k, int c, int64_t e,
                                 int64_t cap) {
  const int64_t x = expert[i * k + c], s = slot[i * k + c];
  return (x >= 0 && x < e && s >= 0 && s < cap) ? x * cap + s : -1;
}

// Dispatch after the buffer is zeroed: one block per token (block-stride),
// threads over the width; each kept choice's row is the token's alone.
__global__ void moe_dispatch_kernel(const float *x, const int32_t *expert, const int32_t *slot, float *xe, int64_t n,
                                    int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x)
    for (int c = 0; c < k; c++) {
      const int64_t r = row_of(expert, slot, i, k, c, e, cap);  // block-uniform
      if (r < 0) continue;
      for (int64_t j = threadIdx.x; j < ch; j += blockDim.x) xe[r * ch + j] = x[i * ch + j];
    }
}

// dx[i,:] += the token's kept rows of dxe, in k order (the CPU's order:
// the same float adds, so the same bits).
__global__ void moe_dispatch_bwd_kernel(const float *dxe, const int32_t *expert, const int32_t *slot, float *dx,
                                        int64_t n, int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x)
    for (int64_t j = threadIdx.x; j < ch; j += blockDim.x) {
      float acc = dx[i * ch + j];
      for (int c = 0; c < k; c++) {
        const int64_t r = row_of(expert, slot, i, k, c, e, cap);
        if (r >= 0) acc += dxe[r * ch + j];
      }
      dx[i * ch + j] = acc;
    }
}

// out[i,:] ← Σ_k gate·ye[row] over the kept choices in k order, from 0.
__global__ void moe_combine_kernel(const float *ye, const int32_t *expert, const int32_t *slot, const float *gate,
                                   float *out, int64_t n, int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x)
    for (int64_t j = threadIdx.x; j < ch; j += blockDim.x) {
      float acc = 0.0f;
      for (int c = 0; c < k; c++) {
        const int64_t r = row_of(expert, slot, i, k, c, e, cap);
        if (r >= 0) acc += gate[i * k + c] * ye[r * ch + j];
      }
      out[i * ch + j] = acc;
    }
}

// Combine's backward after dye is zeroed, one warp per choice o = i·k + c:
// dye[row,:] ← gate·dout[i,:] and dgate[o] ← dout[i,:]·ye[row,:] (lane
// partials, then the warp's butterfly); 0 for a dropped choice.
__global__ void __launch_bounds__(kRowWarps *kWarp)
    moe_combine_bwd_kernel(const float *dout, const float *ye, const int32_t *expert, const int32_t *slot,
                           const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k, int64_t e,
                           int64_t cap) {
  const int lane = threadIdx.x % kWarp;
  const int64_t total = n * k;
  for (int64_t o = warp_row0(); o < total; o += warp_row_step()) {
    const int64_t i = o / k;
    const int64_t r = row_of(expert, slot, i, k, (int)(o % k), e, cap);  // warp-uniform
    float dot = 0.0f;
    if (r >= 0) {
      const float g = gate[o];
      const float *d = dout + i * ch, *y = ye + r * ch;
      float *dy = dye + r * ch;
      for (int64_t j = lane; j < ch; j += kWarp) {
        dy[j] = g * d[j];
        dot += d[j] * y[j];
      }
    }
    dot = warp_sum(dot);
    if (lane == 0) dgate[o] = dot;
  }
}

// Threads for a block that walks one row of ch columns: whole warps, at
// most kBlock, no more than the row needs.
int row_block(int64_t ch) {
  int64_t warps = (ch + kWarp - 1) / kWarp;
  if (warps < 1) warps = 1;
  if (warps > kBlock / kWarp) warps = kBlock / kWarp;
  return (int)warps * kWarp;
}

// The limits every launcher checks: the choices' count fits the I32 counts,
// and the experts and k are in range. 0 when they hold. Routing picks k of
// e experts (k <= e); the data ops also take more choices than experts:
// expert parallelism packs a rank's kept choices into one "expert" (e = 1,
// k = K) with the packed row as the slot, and every index is checked
// against e and cap where it is read (row_of).
int moe_check(int64_t n, int64_t e, int k, int64_t cap, bool routing) {
  KERN_REQUIRE(e >= 1 && e <= INT32_MAX && k >= 1, "kern_moe_*: not 1 <= k and 1 <= e <= INT32_MAX");
  KERN_REQUIRE(!routing || k <= e, "kern_moe_route*: top-k of e experts with k > e");
  KERN_REQUIRE(n >= 0 && n <= INT32_MAX / k && cap >= 0 && cap <= INT32_MAX,
               "kern_moe_*: n·k or cap past INT32_MAX");
  return 0;
}

}  // namespace

/* ---- launchers -------------------------------------------------------------------------- */

extern "C" int kern_moe_route(const float *logits, float *probs, float *lse, int32_t *expert, float *gate,
                              int32_t *slot, int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e,
                              int k, int64_t cap, void *stream) {
  int rc = moe_check(n, e, k, cap, true);
  if (rc != 0) return rc;
  cudaStream_t st = as_stream(stream);
  if (n > 0) {
    moe_route_rows_kernel<<<blocks_for(n, kRowWarps, kGridMax), kRowWarps * kWarp, 0, st>>>(logits, probs, lse,
                                                                                            expert, gate, n, e, k);
    KERN_LAUNCHED(moe_route_rows_kernel);
  }
  moe_route_slots_kernel<<<blocks_for(e, 1, kGridMax), kSlotThreads, 0, st>>>(expert, probs, slot, assigned, kept,
                                                                              psum, n, e, k, cap);
  KERN_LAUNCHED(moe_route_slots_kernel);
  return 0;
}

extern "C" int kern_moe_route_bwd(const float *probs, const float *lse, const int32_t *expert, const float *gate,
                                  const float *dgate, const float *daux, float zscale, float *dlogits, int64_t n,
                                  int64_t e, int k, void *stream) {
  int rc = moe_check(n, e, k, 0, true);
  if (rc != 0 || n == 0) return rc;
  moe_route_bwd_kernel<<<blocks_for(n, kRowWarps, kGridMax), kRowWarps * kWarp, 0, as_stream(stream)>>>(
      probs, lse, expert, gate, dgate, daux, zscale, dlogits, n, e, k);
  KERN_LAUNCHED(moe_route_bwd_kernel);
  return 0;
}

extern "C" int kern_moe_dispatch(const float *x, const int32_t *expert, const int32_t *slot, float *xe, int64_t n,
                                 int64_t ch, int k, int64_t e, int64_t cap, void *stream) {
  int rc = moe_check(n, e, k, cap, false);
  if (rc != 0 || ch == 0 || cap == 0) return rc;
  cudaStream_t st = as_stream(stream);
  KERN_CALL(cudaMemsetAsync(xe, 0, (size_t)(e * cap * ch) * sizeof(float), st));
  if (n == 0) return 0;
  moe_dispatch_kernel<<<blocks_for(n, 1, kGridMax), row_block(ch), 0, st>>>(x, expert, slot, xe, n, ch, k, e, cap);
  KERN_LAUNCHED(moe_dispatch_kernel);
  return 0;
}

extern "C" int kern_moe_dispatch_bwd(const float *dxe, const int32_t *expert, const int32_t *slot, float *dx,
                                     int64_t n, int64_t ch, int k, int64_t e, int64_t cap, void *stream) {
  int rc = moe_check(n, e, k, cap, false);
  if (rc != 0 || n == 0 || ch == 0) return rc;
  moe_dispatch_bwd_kernel<<<blocks_for(n, 1, kGridMax), row_block(ch), 0, as_stream(stream)>>>(dxe, expert, slot, dx,
                                                                                               n, ch, k, e, cap);
  KERN_LAUNCHED(moe_dispatch_bwd_kernel);
  return 0;
}

extern "C" int kern_moe_combine(const float *ye, const int32_t *expert, const int32_t *slot, const float *gate,
                                float *out, int64_t n, int64_t ch, int k, int64_t e, int64_t cap, void *stream) {
  int rc = moe_check(n, e, k, cap, false);
  if (rc != 0 || n == 0 || ch == 0) return rc;
  moe_combine_kernel<<<blocks_for(n, 1, kGridMax), row_block(ch), 0, as_stream(stream)>>>(ye, expert, slot, gate, out,
                                                                                          n, ch, k, e, cap);
  KERN_LAUNCHED(moe_combine_kernel);
  return 0;
}

extern "C" int kern_moe_combine_bwd(const float *dout, const float *ye, const int32_t *expert, const int32_t *slot,
                                    const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k,
                                    int64_t e, int64_t cap, void *stream) {
  int rc = moe_check(n, e, k, cap, false);
  if (rc != 0) return rc;
  cudaStream_t st = as_stream(stream);
  if (cap > 0 && ch > 0) KERN_CALL(cudaMemsetAsync(dye, 0, (size_t)(e * cap * ch) * sizeof(float), st));
  if (n == 0) return 0;
  moe_combine_bwd_kernel<<<blocks_for(n * k, kRowWarps, kGridMax), kRowWarps * kWarp, 0, st>>>(
      dout, ye, expert, slot, gate, dye, dgate, n, ch, k, e, cap);
  KERN_LAUNCHED(moe_combine_bwd_kernel);
  return 0;
}
