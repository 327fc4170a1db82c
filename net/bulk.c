/*
 * Bulk transfers: wire encodings of float32 buffers, the transfer digest,
 * and the outbound producer that turns a source buffer into frames one at a
 * time (so memory stays bounded whatever the buffer's size).
 */
#include <errno.h>
#include <float.h>
#include <math.h>
#include <stdatomic.h>
#include <string.h>

#include "net/net_impl.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the bulk wire encodings are little-endian; add byte swaps for this host"
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#include <immintrin.h>
#define NET_HAVE_X86 1
#endif

bool net_dtype_valid(enum net_dtype d) {
  switch (d) {
  case NET_DTYPE_F32:
  case NET_DTYPE_F16:
  case NET_DTYPE_BF16:
  case NET_DTYPE_I8: return true;
  }
  return false;
}

uint64_t net_dtype_bytes(enum net_dtype d, uint64_t n) {
  switch (d) {
  case NET_DTYPE_F32: return n > UINT64_MAX / 4 ? UINT64_MAX : n * 4;
  case NET_DTYPE_F16:
  case NET_DTYPE_BF16: return n > UINT64_MAX / 2 ? UINT64_MAX : n * 2;
  case NET_DTYPE_I8: {
    uint64_t scales = 4 * (n / NET_I8_BLOCK + (n % NET_I8_BLOCK != 0)); /* at most 2^59: no overflow */
    return n > UINT64_MAX - scales ? UINT64_MAX : n + scales;
  }
  }
  return 0;
}

const char *net_dtype_name(enum net_dtype d) {
  switch (d) {
  case NET_DTYPE_F32: return "f32";
  case NET_DTYPE_F16: return "f16";
  case NET_DTYPE_BF16: return "bf16";
  case NET_DTYPE_I8: return "i8";
  }
  return "unknown";
}

uint32_t net_bulk_chunk_elems(enum net_dtype d, size_t chunk_bytes) {
  if (d == NET_DTYPE_I8) return (uint32_t)(chunk_bytes / (4 + NET_I8_BLOCK) * NET_I8_BLOCK);
  uint64_t one = net_dtype_bytes(d, 1);
  return one ? (uint32_t)(chunk_bytes / one) : 0;
}

/* ---- i8: block-wise 8-bit, the reference ------------------------------------------ */

/* A block is a little-endian float32 scale s, then one int8 q per value;
 * the value is q * s. s = absmax / 127 and q = round-to-nearest-even of
 * x / s (as x times the float inverse of s), so |x - q s| <= absmax / 254
 * plus rounding of a few ulps. A block with a NaN or an infinity is sent
 * with s = NaN and q = 0: every value arrives as NaN, so the receiver's
 * checks see it. A block whose absmax is below I8_TINY (its scale would be
 * subnormal and its inverse overflow) is sent as zeros: the error is below
 * 1.5e-36. */
#define I8_TINY (127.0f * FLT_MIN)

/* The scale of a block from its absmax `m` (when all its values are
 * finite), or NaN; *inv is 1/s, or 0 when no value needs quantising. */
static float i8_scale(float m, bool finite, float *inv) {
  *inv = 0.0f;
  if (!finite) return NAN;
  if (!(m >= I8_TINY)) return 0.0f;
  float s = m / 127.0f;
  *inv = 1.0f / s;
  return s;
}

static int8_t i8_quantise(float x, float inv) {
  long q = lrintf(x * inv);
  return (int8_t)(q > 127 ? 127 : q < -127 ? -127 : q);
}

/* One block of k (1..NET_I8_BLOCK) values into 4 + k bytes. */
static void i8_block_encode_ref(uint8_t *dst, const float *src, size_t k) {
  float m = 0.0f;
  bool finite = true;
  for (size_t i = 0; i < k; i++) {
    if (!isfinite(src[i])) finite = false;
    else if (fabsf(src[i]) > m) m = fabsf(src[i]);
  }
  float inv, s = i8_scale(m, finite, &inv);
  memcpy(dst, &s, 4);
  int8_t *q = (int8_t *)(void *)(dst + 4);
  if (inv == 0.0f) memset(q, 0, k);
  else
    for (size_t i = 0; i < k; i++) q[i] = i8_quantise(src[i], inv);
}

static void i8_block_decode_ref(float *dst, const uint8_t *src, size_t k) {
  float s;
  memcpy(&s, src, 4);
  const int8_t *q = (const int8_t *)(const void *)(src + 4);
  for (size_t i = 0; i < k; i++) dst[i] = (float)q[i] * s;
}

void net_i8_encode_ref(uint8_t *dst, const float *src, size_t n) {
  for (size_t i = 0; i < n; i += NET_I8_BLOCK) {
    size_t k = n - i < NET_I8_BLOCK ? n - i : NET_I8_BLOCK;
    i8_block_encode_ref(dst, src + i, k);
    dst += 4 + k;
  }
}

void net_i8_decode_ref(float *dst, const uint8_t *src, size_t n) {
  for (size_t i = 0; i < n; i += NET_I8_BLOCK) {
    size_t k = n - i < NET_I8_BLOCK ? n - i : NET_I8_BLOCK;
    i8_block_decode_ref(dst + i, src, k);
    src += 4 + k;
  }
}

/* ---- conversions ------------------------------------------------------------ */

#ifdef NET_HAVE_X86
__attribute__((target("avx,f16c"))) static void f16_encode_f16c(uint16_t *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m128i h = _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT);
    _mm_storeu_si128((__m128i *)(void *)(dst + i), h);
  }
  if (i < n) half_from_f32_n(dst + i, src + i, n - i);
}

__attribute__((target("avx,f16c"))) static void f16_decode_f16c(float *dst, const uint16_t *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(const void *)(src + i))));
  if (i < n) half_to_f32_n(dst + i, src + i, n - i);
}

/* bfloat16 with AVX2, 16 values at a time; the same rounding (to nearest
 * even) and NaN handling (quiet, sign kept) as util's bf16_from_f32. */
__attribute__((target("avx2"))) static void bf16_encode_avx2(uint16_t *dst, const float *src, size_t n) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), inf = _mm256_set1_epi32(0x7f800000);
  const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7fff), quiet = _mm256_set1_epi32(0x40);
  size_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __m256i r[2];
    for (int k = 0; k < 2; k++) {
      __m256i x = _mm256_loadu_si256((const __m256i *)(const void *)(src + i + 8 * k));
      __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, abs_mask), inf);
      __m256i hi = _mm256_srli_epi32(x, 16);
      __m256i bias = _mm256_add_epi32(half, _mm256_and_si256(hi, one));
      __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(x, bias), 16);
      r[k] = _mm256_blendv_epi8(rounded, _mm256_or_si256(hi, quiet), nan);
    }
    /* every lane is below 0x10000, so the unsigned saturating pack is exact */
    __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r[0], r[1]), 0xd8);
    _mm256_storeu_si256((__m256i *)(void *)(dst + i), packed);
  }
  if (i < n) bf16_from_f32_n(dst + i, src + i, n - i);
}

__attribute__((target("avx2"))) static void bf16_decode_avx2(float *dst, const uint16_t *src, size_t n) {
  size_t i = 0;
  for (; i + 8 <= n; i += 8) {
    __m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(const void *)(src + i)));
    _mm256_storeu_si256((__m256i *)(void *)(dst + i), _mm256_slli_epi32(w, 16));
  }
  if (i < n) bf16_to_f32_n(dst + i, src + i, n - i);
}

/* A whole i8 block (NET_I8_BLOCK values) with AVX2; the same bytes as
 * i8_block_encode_ref (the same absmax, scale and inverse, and
 * cvtps_epi32 rounds to nearest even like lrintf). */
__attribute__((target("avx2"))) static void i8_block_encode_avx2(uint8_t *dst, const float *src) {
  const __m256i abs_mask = _mm256_set1_epi32(0x7fffffff), max_finite = _mm256_set1_epi32(0x7f7fffff);
  __m256 m = _mm256_setzero_ps();
  __m256i bad = _mm256_setzero_si256();
  for (int i = 0; i < NET_I8_BLOCK; i += 8) {
    __m256i a = _mm256_and_si256(_mm256_loadu_si256((const __m256i *)(const void *)(src + i)), abs_mask);
    bad = _mm256_or_si256(bad, _mm256_cmpgt_epi32(a, max_finite));
    m = _mm256_max_ps(m, _mm256_castsi256_ps(a));
  }
  __m128 m4 = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
  m4 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
  m4 = _mm_max_ss(m4, _mm_shuffle_ps(m4, m4, 1));
  float inv, s = i8_scale(_mm_cvtss_f32(m4), _mm256_testz_si256(bad, bad), &inv);
  memcpy(dst, &s, 4);
  if (inv == 0.0f) {
    memset(dst + 4, 0, NET_I8_BLOCK);
    return;
  }
  const __m256 vinv = _mm256_set1_ps(inv);
  const __m256i lo = _mm256_set1_epi32(-127), hi = _mm256_set1_epi32(127);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int i = 0; i < NET_I8_BLOCK; i += 32) {
    __m256i q[4];
    for (int k = 0; k < 4; k++) {
      __m256i v = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(src + i + 8 * k), vinv));
      q[k] = _mm256_min_epi32(_mm256_max_epi32(v, lo), hi);
    }
    /* the packs work within 128-bit lanes; the permute puts the 4-byte
     * groups back in order */
    __m256i b = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256((__m256i *)(void *)(dst + 4 + i), _mm256_permutevar8x32_epi32(b, order));
  }
}

__attribute__((target("avx2"))) static void i8_block_decode_avx2(float *dst, const uint8_t *src) {
  float s;
  memcpy(&s, src, 4);
  const __m256 vs = _mm256_set1_ps(s);
  for (int i = 0; i < NET_I8_BLOCK; i += 8) {
    __m256i q = _mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)(src + 4 + i)));
    _mm256_storeu_ps(dst + i, _mm256_mul_ps(_mm256_cvtepi32_ps(q), vs));
  }
}

static void i8_encode_avx2(uint8_t *dst, const float *src, size_t n) {
  size_t i = 0;
  for (; i + NET_I8_BLOCK <= n; i += NET_I8_BLOCK, dst += 4 + NET_I8_BLOCK) i8_block_encode_avx2(dst, src + i);
  if (i < n) i8_block_encode_ref(dst, src + i, n - i);
}

static void i8_decode_avx2(float *dst, const uint8_t *src, size_t n) {
  size_t i = 0;
  for (; i + NET_I8_BLOCK <= n; i += NET_I8_BLOCK, src += 4 + NET_I8_BLOCK) i8_block_decode_avx2(dst + i, src);
  if (i < n) i8_block_decode_ref(dst + i, src, n - i);
}

/* Bit 0: F16C and AVX; bit 1: AVX2; both with the OS saving YMM state. */
static int cpu_features(void) {
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return 0;
  bool osxsave = c & bit_OSXSAVE, avx = c & bit_AVX, f16c = c & bit_F16C;
  if (!(osxsave && avx)) return 0;
  unsigned lo, hi;
  __asm__("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  if ((lo & 6) != 6) return 0;
  int f = f16c ? 1 : 0;
  if (__get_cpuid_count(7, 0, &a, &b, &c, &d) && (b & bit_AVX2)) f |= 2;
  return f;
}
#endif

/* Worked out on first use by whichever thread gets there (workers too);
 * every thread computes the same value. */
static _Atomic int g_features = -1;

static int features(void) {
#ifdef NET_HAVE_X86
  int v = atomic_load_explicit(&g_features, memory_order_relaxed);
  if (v < 0) {
    v = cpu_features();
    atomic_store_explicit(&g_features, v, memory_order_relaxed);
  }
  return v;
#else
  return 0;
#endif
}

bool net_dtype_fast_path(void) { return (features() & 3) == 3; }

void net_dtype_encode(enum net_dtype d, uint8_t *dst, const float *src, size_t n) {
  switch (d) {
  case NET_DTYPE_F32: memcpy(dst, src, n * 4); return;
  case NET_DTYPE_F16:
#ifdef NET_HAVE_X86
    if (features() & 1) {
      f16_encode_f16c((uint16_t *)(void *)dst, src, n);
      return;
    }
#endif
    half_from_f32_n((uint16_t *)(void *)dst, src, n);
    return;
  case NET_DTYPE_BF16:
#ifdef NET_HAVE_X86
    if (features() & 2) {
      bf16_encode_avx2((uint16_t *)(void *)dst, src, n);
      return;
    }
#endif
    bf16_from_f32_n((uint16_t *)(void *)dst, src, n);
    return;
  case NET_DTYPE_I8:
#ifdef NET_HAVE_X86
    if (features() & 2) {
      i8_encode_avx2(dst, src, n);
      return;
    }
#endif
    net_i8_encode_ref(dst, src, n);
    return;
  }
}

void net_dtype_decode(enum net_dtype d, float *dst, const uint8_t *src, size_t n) {
  switch (d) {
  case NET_DTYPE_F32: memcpy(dst, src, n * 4); return;
  case NET_DTYPE_F16:
#ifdef NET_HAVE_X86
    if (features() & 1) {
      f16_decode_f16c(dst, (const uint16_t *)(const void *)src, n);
      return;
    }
#endif
    half_to_f32_n(dst, (const uint16_t *)(const void *)src, n);
    return;
  case NET_DTYPE_BF16:
#ifdef NET_HAVE_X86
    if (features() & 2) {
      bf16_decode_avx2(dst, (const uint16_t *)(const void *)src, n);
      return;
    }
#endif
    bf16_to_f32_n(dst, (const uint16_t *)(const void *)src, n);
    return;
  case NET_DTYPE_I8:
#ifdef NET_HAVE_X86
    if (features() & 2) {
      i8_decode_avx2(dst, src, n);
      return;
    }
#endif
    net_i8_decode_ref(dst, src, n);
    return;
  }
}

void net_dtype_roundtrip(enum net_dtype d, float *x, size_t n) {
  if (d == NET_DTYPE_F32 || !net_dtype_valid(d)) return;
  enum { STRIP = 64 * NET_I8_BLOCK }; /* whole i8 blocks, so that blocks start where a transfer's do */
  uint8_t enc[STRIP * 4];
  for (size_t i = 0; i < n; i += STRIP) {
    size_t k = n - i < STRIP ? n - i : STRIP;
    net_dtype_encode(d, enc, x + i, k);
    net_dtype_decode(d, x + i, enc, k);
  }
}

/* ---- the transfer digest ------------------------------------------------------ */

/* digest = BLAKE2b-256(personal "rumor.bulk.tags", u64 count | u8 dtype |
 * u32 chunk elements | tag_0 | tag_1 | ...), tag_i being DATA frame i's AEAD
 * tag as on the wire. Each tag already authenticates its chunk's bytes, its
 * header (transfer id, first element) and its position under the session's
 * key, so the digest needs no pass over the payload: 16 bytes per chunk. */
static const uint8_t root_personal[crypto_generichash_blake2b_PERSONALBYTES] = "rumor.bulk.tags";

void net_digest_root_init(crypto_generichash_state *root, uint64_t count, enum net_dtype wire, uint32_t chunk_elems) {
  uint8_t params[13];
  net_be64_put(params, count);
  params[8] = (uint8_t)wire;
  net_be32_put(params + 9, chunk_elems);
  crypto_generichash_blake2b_init_salt_personal(root, NULL, 0, NET_DIGEST_BYTES, NULL, root_personal);
  crypto_generichash_update(root, params, sizeof params);
}

void net_digest_add_tag(crypto_generichash_state *root, const uint8_t tag[NET_DIGEST_LEAF_BYTES]) {
  crypto_generichash_update(root, tag, NET_DIGEST_LEAF_BYTES);
}

void net_digest_final(crypto_generichash_state *root, uint8_t out[NET_DIGEST_BYTES]) {
  crypto_generichash_final(root, out, NET_DIGEST_BYTES);
}

/* ---- the outbound producer ------------------------------------------------------ */

size_t net_bulk_tx_next_size(const struct net_tx_bulk *t) {
  switch (t->phase) {
  case NET_TX_BEGIN: return NET_FRAME_OVERHEAD + NET_BULK_BEGIN_FIXED + t->meta_len;
  case NET_TX_DATA: {
    uint64_t left = t->count - t->next_elem;
    uint64_t n = left < t->chunk_elems ? left : t->chunk_elems;
    return NET_FRAME_OVERHEAD + (size_t)net_dtype_bytes(t->wire, n);
  }
  case NET_TX_END: return NET_FRAME_OVERHEAD + (t->digest ? NET_DIGEST_BYTES : 0);
  case NET_TX_WAIT_RESULT: return 0;
  }
  return 0;
}

int net_bulk_tx_produce(struct net_aead *aead, struct net_tx_bulk *t, uint8_t *frame, size_t *len) {
  uint8_t *pt = frame + NET_FRAME_HDR;
  size_t n;
  int rc;
  switch (t->phase) {
  case NET_TX_BEGIN:
    pt[0] = (uint8_t)t->wire;
    pt[1] = t->digest ? NET_BULK_FLAG_DIGEST : 0;
    pt[2] = pt[3] = 0;
    net_be32_put(pt + 4, t->chunk_elems);
    if (t->meta_len) memcpy(pt + NET_BULK_BEGIN_FIXED, t->meta, t->meta_len);
    n = NET_BULK_BEGIN_FIXED + t->meta_len;
    net_frame_hdr_write(frame, NET_FRAME_BULK_BEGIN, n, t->id, t->count);
    rc = net_aead_seal(aead, frame, pt, n);
    if (t->digest) net_digest_root_init(&t->root, t->count, t->wire, t->chunk_elems);
    t->phase = t->count ? NET_TX_DATA : NET_TX_END;
    break;
  case NET_TX_DATA: {
    struct net_tx_job job;
    rc = net_bulk_tx_prepare_data(aead, t, frame, &job, len);
    if (rc < 0) return rc;
    net_tx_job_run(&job);
    if (job.status < 0) return job.status;
    if (t->digest) net_digest_add_tag(&t->root, job.leaf);
    return 0;
  }
  case NET_TX_END:
    n = 0;
    if (t->digest) {
      net_digest_final(&t->root, pt);
      n = NET_DIGEST_BYTES;
    }
    net_frame_hdr_write(frame, NET_FRAME_BULK_END, n, t->id, t->count);
    rc = net_aead_seal(aead, frame, pt, n);
    t->phase = NET_TX_WAIT_RESULT;
    break;
  default: return -EINVAL;
  }
  if (rc < 0) return rc;
  *len = NET_FRAME_OVERHEAD + n;
  return 0;
}

int net_bulk_tx_prepare_data(struct net_aead *aead, struct net_tx_bulk *t, uint8_t *frame, struct net_tx_job *job,
                             size_t *len) {
  uint64_t left = t->count - t->next_elem;
  size_t elems = (size_t)(left < t->chunk_elems ? left : t->chunk_elems);
  size_t n = (size_t)net_dtype_bytes(t->wire, elems);
  int rc = net_aead_reserve(aead, &job->ctr);
  if (rc < 0) return rc;
  job->aead = aead;
  job->frame = frame;
  job->src = t->src + t->next_elem;
  job->elems = elems;
  job->wire = t->wire;
  job->digest = t->digest;
  job->chunk_index = t->chunk_index;
  net_frame_hdr_write(frame, NET_FRAME_BULK_DATA, n, t->id, t->next_elem);
  t->next_elem += elems;
  t->chunk_index++;
  if (t->next_elem == t->count) t->phase = NET_TX_END;
  *len = NET_FRAME_OVERHEAD + n;
  return 0;
}

void net_tx_job_run(struct net_tx_job *j) {
  size_t n = (size_t)net_dtype_bytes(j->wire, j->elems);
  uint8_t *pt = j->frame + NET_FRAME_HDR;
  if (j->wire == NET_DTYPE_F32) {
    /* Straight from the caller's buffer into the frame: one pass. */
    j->status = net_aead_seal_at(j->aead, j->ctr, j->frame, (const uint8_t *)j->src, n);
  } else {
    net_dtype_encode(j->wire, pt, j->src, j->elems);
    j->status = net_aead_seal_at(j->aead, j->ctr, j->frame, pt, n);
  }
  if (j->status == 0 && j->digest) memcpy(j->leaf, pt + n, NET_DIGEST_LEAF_BYTES);
}
