/*
 * The transformer kernels behind kernels/kernels.h ("transformer ops"): the
 * element-wise add and GELU (tanh form), token/position embedding, LayerNorm,
 * and the pieces of causal attention between the backend's cuBLAS GEMMs.
 *
 * Conventions are kernels.cu's: 64-bit counts, bounded grids with
 * grid-stride loops, KERN_LAUNCHED after every launch. Row kernels put one
 * warp (or one block) on a row and stride over the rows; every index that
 * can pass 2^31 (rows·c, batches·t·t) is computed in int64_t.
 *
 * Determinism: no float atomics anywhere. Every sum runs in an order fixed by
 * the shapes: a lane's strided partials, then warp_sum's fixed butterfly,
 * then fixed-order loops over tiles and chunks.
 */
#include <cub/device/device_radix_sort.cuh>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

#include "kernels/kernels.h"
#include "kernels/kernels_impl.cuh" /* launch geometry, KERN_LAUNCHED, warp_sum */

using namespace rumor_kern;

namespace {

/* ---- element-wise ---------------------------------------------------------------- */

__global__ void add_kernel(const float *x, const float *y, float *out, int64_t n) {
  GRID_STRIDE(i, n) { out[i] = x[i] + y[i]; }
}

constexpr float kGeluK = 0.79788456080286535588f;  // √(2/π)
constexpr float kGeluC = 0.044715f;

// The pieces of GELU_tanh at x, with u = √(2/π)(x + 0.044715x³): returns
// σ(2u) = ½(1 + tanh u), and sets *sech2 = sech²u and *du = du/dx. Both come
// from e = exp(−2|u|) in [0, 1] (no overflow, and no 1 + tanh(u) ≈ 1 − 1
// cancellation in the negative tail): σ(2u) = 1/(1+e) for u >= 0, e/(1+e)
// below, sech²u = 4e/(1+e)². x = ±Inf gives σ 1 or 0 and sech² 0; NaN gives
// NaN throughout.
__device__ inline float gelu_tanh_parts(float x, float *sech2, float *du) {
  const float x2 = x * x;
  const float u = kGeluK * (x + kGeluC * x2 * x);
  const float e = expf(-2.0f * fabsf(u));
  const float inv = 1.0f / (1.0f + e);
  *sech2 = 4.0f * e * inv * inv;
  *du = kGeluK * (1.0f + 3.0f * kGeluC * x2);
  return u >= 0.0f ? inv : e * inv;
}

__global__ void gelu_tanh_fwd_kernel(const float *x, float *y, int64_t n) {
  GRID_STRIDE(i, n) {
    float sech2, du;
    const float v = x[i];
    y[i] = v * gelu_tanh_parts(v, &sech2, &du);
  }
}

// The second term x/2·sech²·du is taken as 0 where sech² underflowed to 0 for
// a finite x: there du (∝ x²) may have overflowed to Inf for |x| > ~1e19,
// and 0·Inf would make a NaN where the true value is 0. For x = ±Inf the
// product is left to give NaN, as the double reference does.
__global__ void gelu_tanh_bwd_kernel(const float *x, const float *dy, float *dx, int64_t n) {
  GRID_STRIDE(i, n) {
    float sech2, du;
    const float v = x[i];
    const float s = gelu_tanh_parts(v, &sech2, &du);
    const float tail = (sech2 == 0.0f && isfinite(v)) ? 0.0f : 0.5f * v * sech2 * du;
    dx[i] = dy[i] * (s + tail);
  }
}

/* ---- embedding ---------------------------------------------------------------------- */

// Rows i < n = r·t (block-stride): out[i,:] ← wte[tokens[i] − lo,:] (zeros
// for a token outside the shard [lo, lo + v)) + wpe[i mod t,:] (nothing when
// wpe is NULL). In the shard with wpe it is the plain e + p.
__global__ void embedding_fwd_kernel(const int32_t *tokens, const float *wte, const float *wpe, float *out,
                                     int64_t n, int64_t t, int64_t c, int64_t lo, int64_t v) {
  for (int64_t i = blockIdx.x; i < n; i += gridDim.x) {
    const int64_t tok = (int64_t)tokens[i] - lo;  // block-uniform
    const float *e = (tok >= 0 && tok < v) ? wte + tok * c : nullptr, *p = wpe ? wpe + (i % t) * c : nullptr;
    float *o = out + i * c;
    for (int64_t j = threadIdx.x; j < c; j += blockDim.x) {
      if (e && p) o[j] = e[j] + p[j];
      else o[j] = e ? e[j] : (p ? p[j] : 0.0f);
    }
  }
}

// Sort input: keys[i] ← tokens[i] − lo when in [0, v), else v (sorts after
// every real token and is skipped); vals[i] ← i. n <= INT32_MAX (the
// launcher).
__global__ void embedding_keys_kernel(const int32_t *tokens, uint32_t *keys, int32_t *vals, int64_t n, int64_t lo,
                                      int32_t v) {
  GRID_STRIDE(i, n) {
    const int64_t tok = (int64_t)tokens[i] - lo;
    keys[i] = (tok >= 0 && tok < v) ? (uint32_t)tok : (uint32_t)v;
    vals[i] = (int32_t)i;
  }
}

constexpr int kEmbWarps = 8;  // sorted positions (or pieces) per block, one warp each
constexpr int64_t kEmbPiece = KERN_EMB_PIECE;

// After the sort (keys ascending, vals the positions, ascending within one
// key: the sort is stable), the sorted positions are cut into pieces of
// kEmbPiece. A piece whose first position continues the run of the
// previous piece's last token (a "continuation") gets that run's sum over
// the piece, in position order, in part[piece·c + col]; other pieces'
// rows of part are not written. One warp per piece, lane l on column
// 32·y + l (y = blockIdx.y, strided by gridDim.y).
__global__ void __launch_bounds__(kEmbWarps *kWarp)
    embedding_piece_kernel(const uint32_t *keys, const int32_t *vals, const float *dout, float *part, int64_t n,
                           int64_t c, uint32_t v) {
  const int lane = threadIdx.x % kWarp;
  const int64_t npieces = (n + kEmbPiece - 1) / kEmbPiece, step = (int64_t)gridDim.x * kEmbWarps;
  for (int64_t pc = (int64_t)blockIdx.x * kEmbWarps + threadIdx.x / kWarp; pc < npieces; pc += step) {
    const int64_t i0 = pc * kEmbPiece, i1 = i0 + kEmbPiece < n ? i0 + kEmbPiece : n;
    const uint32_t key = keys[i0];
    if (i0 == 0 || key >= v || keys[i0 - 1] != key) continue;  // warp-uniform: not a continuation
    for (int64_t col = (int64_t)blockIdx.y * kWarp + lane; col < c; col += (int64_t)gridDim.y * kWarp) {
      float acc = 0.0f;
      for (int64_t j = i0; j < i1 && keys[j] == key; j++) acc += dout[(int64_t)vals[j] * c + col];
      part[pc * c + col] = acc;
    }
  }
}

// dwte after the pieces: only the warp at the first position i of a key's
// run works. Lane l owns column 32·y + l of that token's row: onto the
// value already there it adds the run's dout rows inside i's piece in
// position order, then the continuation sums of the following pieces in
// piece order. Each (token, column) has exactly one owner, so there are no
// write conflicts.
__global__ void __launch_bounds__(kEmbWarps *kWarp)
    embedding_dwte_kernel(const uint32_t *keys, const int32_t *vals, const float *dout, const float *part,
                          float *dwte, int64_t n, int64_t c, uint32_t v) {
  const int lane = threadIdx.x % kWarp;
  const int64_t npieces = (n + kEmbPiece - 1) / kEmbPiece, step = (int64_t)gridDim.x * kEmbWarps;
  for (int64_t i = (int64_t)blockIdx.x * kEmbWarps + threadIdx.x / kWarp; i < n; i += step) {
    const uint32_t key = keys[i];
    if (key >= v || (i > 0 && keys[i - 1] == key)) continue;  // warp-uniform
    float *row = dwte + (int64_t)key * c;
    const int64_t first = i / kEmbPiece, end = (first + 1) * kEmbPiece < n ? (first + 1) * kEmbPiece : n;
    for (int64_t col = (int64_t)blockIdx.y * kWarp + lane; col < c; col += (int64_t)gridDim.y * kWarp) {
      float acc = row[col];
      for (int64_t j = i; j < end && keys[j] == key; j++) acc += dout[(int64_t)vals[j] * c + col];
      for (int64_t pc = first + 1; pc < npieces && keys[pc * kEmbPiece] == key; pc++) acc += part[pc * c + col];
      row[col] = acc;
    }
  }
}

// dwpe[p, col] += dout[s, p, col] for s = 0, 1, ... r−1 in turn (the
// reference's order); one thread per (p, col).
__global__ void embedding_dwpe_kernel(const float *dout, float *dwpe, int64_t r, int64_t t, int64_t c) {
  const int64_t tc = t * c;
  GRID_STRIDE(i, tc) {
    float acc = dwpe[i];
    for (int64_t s = 0; s < r; s++) acc += dout[s * tc + i];
    dwpe[i] = acc;
  }
}

/* ---- LayerNorm ------------------------------------------------------------------------ */

constexpr int kRowWarps = 8;  // rows in flight per block of the warp-per-row kernels

// The first row of this warp and the stride between its rows.
__device__ inline int64_t warp_row0(void) { return (int64_t)blockIdx.x * kRowWarps + threadIdx.x / kWarp; }
__device__ inline int64_t warp_row_step(void) { return (int64_t)gridDim.x * kRowWarps; }

__global__ void __launch_bounds__(kRowWarps *kWarp)
    layernorm_fwd_kernel(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                         int64_t rows, int64_t c, float eps) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = warp_row0(); r < rows; r += warp_row_step()) {
    const float *xr = x + r * c;
    float s = 0.0f;
    for (int64_t j = lane; j < c; j += kWarp) s += xr[j];
    const float mu = warp_sum(s) / (float)c;
    float ss = 0.0f;
    for (int64_t j = lane; j < c; j += kWarp) {
      const float d = xr[j] - mu;
      ss += d * d;
    }
    const float rs = 1.0f / sqrtf(warp_sum(ss) / (float)c + eps);
    float *yr = y + r * c;
    for (int64_t j = lane; j < c; j += kWarp) yr[j] = (xr[j] - mu) * rs * w[j] + b[j];
    if (lane == 0) {
      mean[r] = mu;
      rstd[r] = rs;
    }
  }
}

// dx[r] += rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w, one warp per row.
__global__ void __launch_bounds__(kRowWarps *kWarp)
    layernorm_dx_kernel(const float *x, const float *w, const float *mean, const float *rstd, const float *dy,
                        float *dx, int64_t rows, int64_t c) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t r = warp_row0(); r < rows; r += warp_row_step()) {
    const float *xr = x + r * c, *dyr = dy + r * c;
    const float mu = mean[r], rs = rstd[r];
    float sg = 0.0f, sgx = 0.0f;
    for (int64_t j = lane; j < c; j += kWarp) {
      const float g = dyr[j] * w[j];
      sg += g;
      sgx += g * ((xr[j] - mu) * rs);
    }
    const float mg = warp_sum(sg) / (float)c, mgx = warp_sum(sgx) / (float)c;
    float *dxr = dx + r * c;
    for (int64_t j = lane; j < c; j += kWarp) {
      const float g = dyr[j] * w[j], xh = (xr[j] - mu) * rs;
      dxr[j] += rs * (g - mg - xh * mgx);
    }
  }
}

constexpr int kLnTileCols = 32;  // columns per tile (one warp wide)
constexpr int kLnTileRows = 32;  // row lanes per tile (blockDim.y)

// Partial dw, db of one chunk of rows (blockIdx.y) for tiles of 32 columns
// (blockIdx.x, strided): thread (tx, ty) sums rows ty, ty + 32, ... of the
// chunk for column c0 + tx; then row lane 0 adds the 32 lane sums in order
// and writes part[chunk·c + col] (dw) and part[(nchunks + chunk)·c + col]
// (db). Shared memory: 2·32·33 floats (8.4 KB).
__global__ void __launch_bounds__(kLnTileCols *kLnTileRows)
    layernorm_dwdb_part_kernel(const float *x, const float *mean, const float *rstd, const float *dy, float *part,
                               int64_t rows, int64_t c, int64_t rows_per_chunk, int64_t nchunks) {
  __shared__ float pw[kLnTileRows][kLnTileCols + 1];  // +1: no bank conflicts reading columns
  __shared__ float pb[kLnTileRows][kLnTileCols + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t chunk = blockIdx.y;
  const int64_t r0 = chunk * rows_per_chunk;
  const int64_t r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
  for (int64_t c0 = (int64_t)blockIdx.x * kLnTileCols; c0 < c; c0 += (int64_t)gridDim.x * kLnTileCols) {
    const int64_t col = c0 + tx;
    float aw = 0.0f, ab = 0.0f;
    if (col < c)
      for (int64_t r = r0 + ty; r < r1; r += kLnTileRows) {
        const float g = dy[r * c + col];
        aw += g * ((x[r * c + col] - mean[r]) * rstd[r]);
        ab += g;
      }
    pw[ty][tx] = aw;
    pb[ty][tx] = ab;
    __syncthreads();
    if (ty == 0 && col < c) {
      float sw = 0.0f, sb = 0.0f;
      for (int j = 0; j < kLnTileRows; j++) {
        sw += pw[j][tx];
        sb += pb[j][tx];
      }
      part[chunk * c + col] = sw;
      part[(nchunks + chunk) * c + col] = sb;
    }
    __syncthreads();  // pw, pb are rewritten by the next tile
  }
}

// dw[col] ← Σ_chunk part (in chunk order) + beta·dw[col] (dw not read when
// beta is 0); the same for db.
__global__ void layernorm_dwdb_sum_kernel(const float *part, float *dw, float *db, int64_t c, int64_t nchunks,
                                          float beta) {
  GRID_STRIDE(col, c) {
    float sw = 0.0f, sb = 0.0f;
    for (int64_t k = 0; k < nchunks; k++) {
      sw += part[k * c + col];
      sb += part[(nchunks + k) * c + col];
    }
    dw[col] = beta == 0.0f ? sw : sw + beta * dw[col];
    db[col] = beta == 0.0f ? sb : sb + beta * db[col];
  }
}

/* ---- attention --------------------------------------------------------------------------- */

// Rows (s, pos) of x (r·t rows of width parts·c; block-stride) against the
// head layout: heads[p][s][h][pos][d] is x[s][pos][p·c + h·hs + d]. Threads
// walk a row's columns, so reads are coalesced and writes come in runs of
// hs. split: heads ← x; otherwise x ← heads.
template <bool split>
__global__ void heads_kernel(const float *src, float *dst, int64_t rows, int64_t t, int c, int nh, int parts) {
  const int hs = c / nh, width = parts * c;
  const int64_t part_elems = rows * c;
  for (int64_t row = blockIdx.x; row < rows; row += gridDim.x) {
    const int64_t s = row / t, pos = row % t;
    for (int col = threadIdx.x; col < width; col += blockDim.x) {
      const int p = col / c, rem = col - p * c, h = rem / hs, d = rem - h * hs;
      const int64_t hi = p * part_elems + ((s * nh + h) * t + pos) * hs + d, xi = row * width + col;
      if (split)
        dst[hi] = src[xi];
      else
        dst[xi] = src[hi];
    }
  }
}

// Softmax rows: row i of `nrows` = batches·t is query q = i mod t; keys k <= q
// count. One warp per row; each lane reads and writes only its own k
// (≡ lane mod 32), so the in-place write after the reductions is safe.
__global__ void __launch_bounds__(kRowWarps *kWarp)
    attn_softmax_fwd_kernel(float *s, float *lse, int64_t nrows, int64_t t) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t i = warp_row0(); i < nrows; i += warp_row_step()) {
    float *row = s + i * t;
    const int64_t q = i % t;
    float mx = -INFINITY;
    for (int64_t k = lane; k <= q; k += kWarp) mx = fmaxf(mx, row[k]);
    mx = warp_max(mx);
    float sum = 0.0f;
    for (int64_t k = lane; k <= q; k += kWarp) sum += expf(row[k] - mx);
    sum = warp_sum(sum);
    const float inv = 1.0f / sum;
    for (int64_t k = lane; k < t; k += kWarp) row[k] = k <= q ? expf(row[k] - mx) * inv : 0.0f;
    if (lane == 0) lse[i] = mx + logf(sum);
  }
}

__global__ void __launch_bounds__(kRowWarps *kWarp)
    attn_probs_kernel(float *s, const float *lse, int64_t nrows, int64_t t) {
  const int lane = threadIdx.x % kWarp;
  for (int64_t i = warp_row0(); i < nrows; i += warp_row_step()) {
    float *row = s + i * t;
    const int64_t q = i % t;
    const float l = lse[i];
    for (int64_t k = lane; k < t; k += kWarp) row[k] = k <= q ? expf(row[k] - l) : 0.0f;
  }
}

// Row i (query q = i mod t of batch b = b0 + i / t, sequence b / nh, head
// b mod nh): D = Σ_d dout·out over the head's columns, then
// dp[i][k] ← p[i][k]·(dp[i][k] − D)·scale for k <= q, 0 after.
__global__ void __launch_bounds__(kRowWarps *kWarp)
    attn_dscores_kernel(const float *p, float *dp, const float *out, const float *dout, int64_t b0, int64_t nrows,
                        int64_t t, int64_t c, int nh, float scale) {
  const int lane = threadIdx.x % kWarp;
  const int64_t hs = c / nh;
  for (int64_t i = warp_row0(); i < nrows; i += warp_row_step()) {
    const int64_t b = b0 + i / t, q = i % t;
    const int64_t off = ((b / nh) * t + q) * c + (b % nh) * hs;
    float dd = 0.0f;
    for (int64_t d = lane; d < hs; d += kWarp) dd += dout[off + d] * out[off + d];
    dd = warp_sum(dd);
    const float *pr = p + i * t;
    float *dr = dp + i * t;
    for (int64_t k = lane; k < t; k += kWarp) dr[k] = k <= q ? pr[k] * (dr[k] - dd) * scale : 0.0f;
  }
}

/* ---- embedding backward's scratch ------------------------------------------------------- */

constexpr size_t kScratchAlign = 256;

size_t align_up(size_t x) { return (x + kScratchAlign - 1) / kScratchAlign * kScratchAlign; }

// The bits a radix sort needs for keys 0 .. v (v itself marks a skipped token).
int key_bits(int64_t v) {
  int bits = 1;
  while (bits < 32 && ((int64_t)1 << bits) <= v) bits++;
  return bits;
}

// The embedding backward's scratch carved from one buffer: sort input and
// output keys and values (n each), the pieces' partial sums (one row of c
// floats per piece of KERN_EMB_PIECE sorted positions), then CUB's
// temporary storage.
struct EmbScratch {
  uint32_t *keys_in, *keys_out;
  int32_t *vals_in, *vals_out;
  float *part;
  void *temp;
  size_t temp_bytes;
  size_t total;  // bytes the whole layout needs
};

// Lays out the scratch for n tokens of width c from `base` (NULL: sizes
// only) and asks CUB for its temporary size. Returns 0 or the CUDA error
// CUB gave.
int emb_scratch_layout(int64_t n, int64_t v, int64_t c, char *base, EmbScratch *s) {
  const size_t arr = align_up((size_t)n * sizeof(uint32_t));
  const size_t parts = align_up((size_t)((n + kEmbPiece - 1) / kEmbPiece * c) * sizeof(float));
  static_assert(sizeof(uint32_t) == sizeof(int32_t), "keys and values take the same room");
  *s = EmbScratch{};
  if (base) {
    s->keys_in = reinterpret_cast<uint32_t *>(base);
    s->keys_out = reinterpret_cast<uint32_t *>(base + arr);
    s->vals_in = reinterpret_cast<int32_t *>(base + 2 * arr);
    s->vals_out = reinterpret_cast<int32_t *>(base + 3 * arr);
    s->part = reinterpret_cast<float *>(base + 4 * arr);
    s->temp = base + 4 * arr + parts;
  }
  cudaError_t err = cub::DeviceRadixSort::SortPairs(nullptr, s->temp_bytes, s->keys_in, s->keys_out, s->vals_in,
                                                    s->vals_out, (int)n, 0, key_bits(v));
  if (err != cudaSuccess) {
    (void)cudaGetLastError();
    return record_failure(err, "cub::DeviceRadixSort::SortPairs (temporary size)", __FILE__, __LINE__);
  }
  s->total = 4 * arr + parts + align_up(s->temp_bytes);
  return 0;
}

}  // namespace

/* ---- launchers -------------------------------------------------------------------------- */

extern "C" int kern_add(const float *x, const float *y, float *out, int64_t n, void *stream) {
  if (n == 0) return 0;
  add_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, y, out, n);
  KERN_LAUNCHED(add_kernel);
  return 0;
}

extern "C" int kern_gelu_tanh_fwd(const float *x, float *y, int64_t n, void *stream) {
  if (n == 0) return 0;
  gelu_tanh_fwd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, y, n);
  KERN_LAUNCHED(gelu_tanh_fwd_kernel);
  return 0;
}

extern "C" int kern_gelu_tanh_bwd(const float *x, const float *dy, float *dx, int64_t n, void *stream) {
  if (n == 0) return 0;
  gelu_tanh_bwd_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, as_stream(stream)>>>(x, dy, dx, n);
  KERN_LAUNCHED(gelu_tanh_bwd_kernel);
  return 0;
}

// Threads for a block that walks one row of c columns: whole warps, at most
// kBlock, no more than the row needs.
static int row_block(int64_t c) {
  int64_t warps = (c + kWarp - 1) / kWarp;
  if (warps < 1) warps = 1;
  if (warps > kBlock / kWarp) warps = kBlock / kWarp;
  return (int)warps * kWarp;
}

extern "C" int kern_embedding_fwd(const int32_t *tokens, const float *wte, const float *wpe, float *out, int64_t r,
                                  int64_t t, int64_t c, int64_t lo, int64_t v, void *stream) {
  const int64_t n = r * t;
  if (n == 0 || c == 0) return 0;
  embedding_fwd_kernel<<<blocks_for(n, 1, kGridMax), row_block(c), 0, as_stream(stream)>>>(tokens, wte, wpe, out, n,
                                                                                          t, c, lo, v);
  KERN_LAUNCHED(embedding_fwd_kernel);
  return 0;
}

extern "C" int kern_embedding_bwd_scratch(int64_t n, int64_t v, int64_t c, size_t *bytes) {
  *bytes = 0;
  KERN_REQUIRE(n >= 0 && n <= INT32_MAX, "kern_embedding_bwd_scratch: more than INT32_MAX tokens");
  KERN_REQUIRE(v >= 1 && v < INT32_MAX, "kern_embedding_bwd_scratch: vocabulary not in [1, INT32_MAX)");
  EmbScratch s;
  int rc = emb_scratch_layout(n, v, c, nullptr, &s);
  if (rc != 0) return rc;
  *bytes = s.total;
  return 0;
}

// Grid y of the dwte kernel: one block row per 32-column tile, capped (the
// kernel strides over the rest). 65535 is CUDA's limit on gridDim.y.
constexpr int kGridYMax = 65535;

extern "C" int kern_embedding_bwd(const int32_t *tokens, const float *dout, float *dwte, float *dwpe, int64_t r,
                                  int64_t t, int64_t c, int64_t lo, int64_t v, void *scratch, size_t scratch_bytes,
                                  void *stream) {
  const int64_t n = r * t;
  if (n == 0 || c == 0) return 0;
  KERN_REQUIRE(n <= INT32_MAX, "kern_embedding_bwd: more than INT32_MAX tokens");
  KERN_REQUIRE(v >= 1 && v < INT32_MAX, "kern_embedding_bwd: vocabulary not in [1, INT32_MAX)");
  EmbScratch s;
  int rc = emb_scratch_layout(n, v, c, static_cast<char *>(scratch), &s);
  if (rc != 0) return rc;
  KERN_REQUIRE(scratch != nullptr && scratch_bytes >= s.total, "kern_embedding_bwd: scratch buffer too small");
  cudaStream_t st = as_stream(stream);

  embedding_keys_kernel<<<blocks_for(n, kBlock, kGridMax), kBlock, 0, st>>>(tokens, s.keys_in, s.vals_in, n, lo,
                                                                           (int32_t)v);
  KERN_LAUNCHED(embedding_keys_kernel);
  size_t temp_bytes = s.temp_bytes;
  KERN_CALL(cub::DeviceRadixSort::SortPairs(s.temp, temp_bytes, s.keys_in, s.keys_out, s.vals_in, s.vals_out, (int)n,
                                            0, key_bits(v), st));
  const int64_t npieces = (n + kEmbPiece - 1) / kEmbPiece;
  const dim3 pgrid(blocks_for(npieces, kEmbWarps, kGridMax), blocks_for(c, kWarp, kGridYMax));
  embedding_piece_kernel<<<pgrid, kEmbWarps * kWarp, 0, st>>>(s.keys_out, s.vals_out, dout, s.part, n, c,
                                                               (uint32_t)v);
  KERN_LAUNCHED(embedding_piece_kernel);
  const dim3 grid(blocks_for(n, kEmbWarps, kGridMax), blocks_for(c, kWarp, kGridYMax));
  embedding_dwte_kernel<<<grid, kEmbWarps * kWarp, 0, st>>>(s.keys_out, s.vals_out, dout, s.part, dwte, n, c,
                                                             (uint32_t)v);
  KERN_LAUNCHED(embedding_dwte_kernel);
  if (dwpe) {
    embedding_dwpe_kernel<<<blocks_for(t * c, kBlock, kGridMax), kBlock, 0, st>>>(dout, dwpe, r, t, c);
    KERN_LAUNCHED(embedding_dwpe_kernel);
  }
  return 0;
}

extern "C" int kern_layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                                  int64_t rows, int64_t c, float eps, void *stream) {
  if (rows == 0) return 0;
  layernorm_fwd_kernel<<<blocks_for(rows, kRowWarps, kGridMax), kRowWarps * kWarp, 0, as_stream(stream)>>>(
      x, w, b, y, mean, rstd, rows, c, eps);
  KERN_LAUNCHED(layernorm_fwd_kernel);
  return 0;
}

// Chunks of rows for the dw/db partials: KERN_LN_ROWS_PER_CHUNK rows each,
// at most KERN_LN_MAX_CHUNKS (then longer chunks). A function of the shape
// only, so the summation order, hence the bits, never change.
static int64_t ln_chunks(int64_t rows) {
  int64_t k = (rows + KERN_LN_ROWS_PER_CHUNK - 1) / KERN_LN_ROWS_PER_CHUNK;
  return k < 1 ? 1 : (k > KERN_LN_MAX_CHUNKS ? KERN_LN_MAX_CHUNKS : k);
}

extern "C" size_t kern_layernorm_bwd_scratch_bytes(int64_t rows, int64_t c) {
  return (size_t)(2 * ln_chunks(rows) * c) * sizeof(float);
}

extern "C" int kern_layernorm_bwd(const float *x, const float *w, const float *mean, const float *rstd,
                                  const float *dy, float *dx, float *dw, float *db, int64_t rows, int64_t c,
                                  float beta, void *scratch, size_t scratch_bytes, void *stream) {
  if (rows == 0 || c == 0) return 0;
  const int64_t nchunks = ln_chunks(rows), per_chunk = (rows + nchunks - 1) / nchunks;
  KERN_REQUIRE(scratch != nullptr && scratch_bytes >= kern_layernorm_bwd_scratch_bytes(rows, c),
               "kern_layernorm_bwd: scratch buffer too small");
  cudaStream_t st = as_stream(stream);
  float *part = static_cast<float *>(scratch);

  layernorm_dx_kernel<<<blocks_for(rows, kRowWarps, kGridMax), kRowWarps * kWarp, 0, st>>>(x, w, mean, rstd, dy, dx,
                                                                                          rows, c);
  KERN_LAUNCHED(layernorm_dx_kernel);
  const dim3 grid(blocks_for(c, kLnTileCols, kGridMax), (unsigned)nchunks), block(kLnTileCols, kLnTileRows);
  layernorm_dwdb_part_kernel<<<grid, block, 0, st>>>(x, mean, rstd, dy, part, rows, c, per_chunk, nchunks);
  KERN_LAUNCHED(layernorm_dwdb_part_kernel);
  layernorm_dwdb_sum_kernel<<<blocks_for(c, kBlock, kGridMax), kBlock, 0, st>>>(part, dw, db, c, nchunks, beta);
  KERN_LAUNCHED(layernorm_dwdb_sum_kernel);
  return 0;
}

// The checks both head launchers make; 0 when the shapes can be served.
static int heads_check(int64_t c, int nh, int parts) {
  KERN_REQUIRE(nh >= 1 && c % nh == 0, "kern_heads_*: c is not a multiple of the head count");
  KERN_REQUIRE(parts >= 1 && c <= INT32_MAX / parts, "kern_heads_*: parts·c does not fit in an int");
  return 0;
}

extern "C" int kern_heads_split(const float *x, float *heads, int64_t r, int64_t t, int64_t c, int nh, int parts,
                                void *stream) {
  if (r * t == 0 || c == 0) return 0;
  int rc = heads_check(c, nh, parts);
  if (rc != 0) return rc;
  heads_kernel<true><<<blocks_for(r * t, 1, kGridMax), row_block(parts * c), 0, as_stream(stream)>>>(
      x, heads, r * t, t, (int)c, nh, parts);
  KERN_LAUNCHED_AS("heads_kernel<split>");
  return 0;
}

extern "C" int kern_heads_merge(const float *heads, float *x, int64_t r, int64_t t, int64_t c, int nh, int parts,
                                void *stream) {
  if (r * t == 0 || c == 0) return 0;
  int rc = heads_check(c, nh, parts);
  if (rc != 0) return rc;
  heads_kernel<false><<<blocks_for(r * t, 1, kGridMax), row_block(parts * c), 0, as_stream(stream)>>>(
      heads, x, r * t, t, (int)c, nh, parts);
  KERN_LAUNCHED_AS("heads_kernel<merge>");
  return 0;
}

extern "C" int kern_attn_softmax_fwd(float *s, float *lse, int64_t batches, int64_t t, void *stream) {
  const int64_t nrows = batches * t;
  if (nrows == 0) return 0;
  attn_softmax_fwd_kernel<<<blocks_for(nrows, kRowWarps, kGridMax), kRowWarps * kWarp, 0, as_stream(stream)>>>(
      s, lse, nrows, t);
  KERN_LAUNCHED(attn_softmax_fwd_kernel);
  return 0;
}

extern "C" int kern_attn_probs(float *s, const float *lse, int64_t batches, int64_t t, void *stream) {
  const int64_t nrows = batches * t;
  if (nrows == 0) return 0;
  attn_probs_kernel<<<blocks_for(nrows, kRowWarps, kGridMax), kRowWarps * kWarp, 0, as_stream(stream)>>>(s, lse,
                                                                                                        nrows, t);
  KERN_LAUNCHED(attn_probs_kernel);
  return 0;
}

extern "C" int kern_attn_dscores(const float *p, float *dp, const float *out, const float *dout, int64_t b0,
                                 int64_t batches, int64_t t, int64_t c, int nh, float scale, void *stream) {
  const int64_t nrows = batches * t;
  if (nrows == 0) return 0;
  KERN_REQUIRE(nh >= 1 && c % nh == 0, "kern_attn_dscores: c is not a multiple of the head count");
  attn_dscores_kernel<<<blocks_for(nrows, kRowWarps, kGridMax), kRowWarps * kWarp, 0, as_stream(stream)>>>(
      p, dp, out, dout, b0, nrows, t, c, nh, scale);
  KERN_LAUNCHED(attn_dscores_kernel);
  return 0;
}
