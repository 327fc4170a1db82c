/*
 * Bulk transfers: wire encodings of float32 buffers, the transfer digest,
 * and the outbound producer that turns a source buffer into frames one at a
 * time (so memory stays bounded whatever the buffer's size).
 */
#include <errno.h>
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

size_t net_dtype_size(enum net_dtype d) {
  switch (d) {
  case NET_DTYPE_F32: return 4;
  case NET_DTYPE_F16:
  case NET_DTYPE_BF16: return 2;
  }
  return 0;
}

const char *net_dtype_name(enum net_dtype d) {
  switch (d) {
  case NET_DTYPE_F32: return "f32";
  case NET_DTYPE_F16: return "f16";
  case NET_DTYPE_BF16: return "bf16";
  }
  return "unknown";
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
  }
}

/* ---- the transfer digest ------------------------------------------------------ */

static const uint8_t leaf_personal[crypto_generichash_blake2b_PERSONALBYTES] = "rumor.bulk.leaf";
static const uint8_t root_personal[crypto_generichash_blake2b_PERSONALBYTES] = "rumor.bulk.root";

void net_digest_root_init(crypto_generichash_state *root, uint64_t count, enum net_dtype wire, uint32_t chunk_elems) {
  uint8_t params[13];
  net_be64_put(params, count);
  params[8] = (uint8_t)wire;
  net_be32_put(params + 9, chunk_elems);
  crypto_generichash_blake2b_init_salt_personal(root, NULL, 0, NET_DIGEST_BYTES, NULL, root_personal);
  crypto_generichash_update(root, params, sizeof params);
}

void net_digest_leaf(uint8_t leaf[NET_DIGEST_BYTES], uint64_t chunk_index, const uint8_t *p, size_t n) {
  uint8_t salt[crypto_generichash_blake2b_SALTBYTES] = {0};
  net_be64_put(salt + 8, chunk_index);
  crypto_generichash_state st;
  crypto_generichash_blake2b_init_salt_personal(&st, NULL, 0, NET_DIGEST_BYTES, salt, leaf_personal);
  crypto_generichash_update(&st, p, n);
  crypto_generichash_final(&st, leaf, NET_DIGEST_BYTES);
}

void net_digest_add_chunk(crypto_generichash_state *root, uint64_t chunk_index, const uint8_t *p, size_t n) {
  uint8_t leaf[NET_DIGEST_BYTES];
  net_digest_leaf(leaf, chunk_index, p, n);
  crypto_generichash_update(root, leaf, sizeof leaf);
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
    return NET_FRAME_OVERHEAD + (size_t)n * net_dtype_size(t->wire);
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
    if (t->digest) crypto_generichash_update(&t->root, job.leaf, sizeof job.leaf);
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
  size_t n = elems * net_dtype_size(t->wire);
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
  size_t n = j->elems * net_dtype_size(j->wire);
  uint8_t *pt = j->frame + NET_FRAME_HDR;
  if (j->wire == NET_DTYPE_F32) {
    /* Straight from the caller's buffer into the frame: one pass. */
    if (j->digest) net_digest_leaf(j->leaf, j->chunk_index, (const uint8_t *)j->src, n);
    net_aead_seal_at(j->aead, j->ctr, j->frame, (const uint8_t *)j->src, n);
  } else {
    net_dtype_encode(j->wire, pt, j->src, j->elems);
    if (j->digest) net_digest_leaf(j->leaf, j->chunk_index, pt, n);
    net_aead_seal_at(j->aead, j->ctr, j->frame, pt, n);
  }
}
