/*
 * Wire encodings of bulk buffers: the F16C fast path gives exactly what
 * util's reference conversion gives (every half value, special values,
 * random floats, odd lengths); the transfer digest depends on every byte,
 * the chunk order and the parameters.
 */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "net/net_impl.h"
#include "../integration/test_net_lsan.h"

Test(net_bulk, f16_decode_matches_the_reference_for_all_65536_values) {
  cr_log_info("SIMD conversions (F16C, AVX2): %s", net_dtype_fast_path() ? "yes" : "no (reference only)");
  uint16_t *h = malloc(65536 * sizeof *h);
  float *got = malloc(65536 * sizeof *got);
  for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
  net_dtype_decode(NET_DTYPE_F16, got, (const uint8_t *)h, 65536);
  for (uint32_t i = 0; i < 65536; i++) {
    float want = half_to_f32((uint16_t)i);
    if (isnan(want)) cr_assert(isnan(got[i]), "0x%04x", i);
    else cr_assert_eq(memcmp(&got[i], &want, 4), 0, "0x%04x: got %g want %g", i, got[i], want);
  }
  free(h);
  free(got);
}

static void check_encode(enum net_dtype d, const float *src, size_t n) {
  uint16_t *got = malloc(n * sizeof *got + 2);
  net_dtype_encode(d, (uint8_t *)got, src, n);
  for (size_t i = 0; i < n; i++) {
    uint16_t want = d == NET_DTYPE_F16 ? half_from_f32(src[i]) : bf16_from_f32(src[i]);
    if (isnan(src[i])) {
      float back = d == NET_DTYPE_F16 ? half_to_f32(got[i]) : bf16_to_f32(got[i]);
      cr_assert(isnan(back), "%s: NaN stays NaN at %zu", net_dtype_name(d), i);
    } else {
      cr_assert_eq(got[i], want, "%s element %zu (%a): got 0x%04x want 0x%04x", net_dtype_name(d), i, src[i], got[i],
                   want);
    }
  }
  free(got);
}

Test(net_bulk, bf16_decode_matches_the_reference_for_all_65536_values) {
  uint16_t *h = malloc(65536 * sizeof *h);
  float *got = malloc((65536 + 7) * sizeof *got);
  for (uint32_t i = 0; i < 65536; i++) h[i] = (uint16_t)i;
  for (size_t off = 0; off < 3; off++) { /* unaligned starts and tails */
    net_dtype_decode(NET_DTYPE_BF16, got, (const uint8_t *)(h + off), 65536 - off);
    for (uint32_t i = 0; i + off < 65536; i++) {
      float want = bf16_to_f32((uint16_t)(i + off));
      cr_assert_eq(memcmp(&got[i], &want, 4), 0, "0x%04zx", i + off);
    }
  }
  free(h);
  free(got);
}

Test(net_bulk, f16_and_bf16_encoding_match_the_reference) {
  const float specials[] = {0.0f, -0.0f, 1.0f, -1.0f, 65504.0f, 65520.0f, 1e9f, -1e9f, INFINITY, -INFINITY, NAN,
                            5.96e-8f, 2.98e-8f, 6.1e-5f, 1e-40f, 0.33333334f, 2049.0f, 2051.0f, 3.0e38f};
  for (size_t n = 1; n <= sizeof specials / sizeof specials[0]; n++) {
    check_encode(NET_DTYPE_F16, specials, n); /* every length up to 19: tails of the 8-wide loop */
    check_encode(NET_DTYPE_BF16, specials, n);
  }
  size_t n = 1000003;
  float *v = malloc(n * sizeof *v);
  struct rng r;
  rng_seed(&r, 11, 0);
  for (size_t i = 0; i < n; i++) {
    uint32_t bits = (uint32_t)rng_next_u64(&r);
    memcpy(&v[i], &bits, 4); /* every bit pattern, subnormals and NaNs included */
  }
  check_encode(NET_DTYPE_F16, v, n);
  check_encode(NET_DTYPE_BF16, v, n);
  free(v);
}

static void digest(uint8_t out[32], const uint8_t *p, size_t n, size_t chunk, uint64_t count, enum net_dtype d) {
  crypto_generichash_state root;
  net_digest_root_init(&root, count, d, (uint32_t)chunk);
  for (size_t off = 0, i = 0; off < n; off += chunk, i++)
    net_digest_add_chunk(&root, i, p + off, n - off < chunk ? n - off : chunk);
  net_digest_final(&root, out);
}

Test(net_bulk, the_digest_depends_on_every_byte_the_order_and_the_parameters) {
  cr_assert_eq(net_crypto_init(), 0);
  uint8_t buf[4096], a[32], b[32];
  randombytes_buf(buf, sizeof buf);
  digest(a, buf, sizeof buf, 1024, 1024, NET_DTYPE_F32);
  digest(b, buf, sizeof buf, 1024, 1024, NET_DTYPE_F32);
  cr_assert_eq(memcmp(a, b, 32), 0, "deterministic");
  digest(b, buf, sizeof buf, 512, 1024, NET_DTYPE_F32);
  cr_assert_neq(memcmp(a, b, 32), 0, "chunking is bound");
  digest(b, buf, sizeof buf, 1024, 1024, NET_DTYPE_F16);
  cr_assert_neq(memcmp(a, b, 32), 0, "dtype is bound");
  /* swapping two chunks changes the digest */
  uint8_t sw[4096];
  memcpy(sw, buf + 1024, 1024);
  memcpy(sw + 1024, buf, 1024);
  memcpy(sw + 2048, buf + 2048, 2048);
  digest(b, sw, sizeof sw, 1024, 1024, NET_DTYPE_F32);
  cr_assert_neq(memcmp(a, b, 32), 0, "order is bound");
  for (int i = 0; i < 4096 * 8; i += 61) {
    buf[i / 8] ^= (uint8_t)(1u << (i % 8));
    digest(b, buf, sizeof buf, 1024, 1024, NET_DTYPE_F32);
    cr_assert_neq(memcmp(a, b, 32), 0, "bit %d", i);
    buf[i / 8] ^= (uint8_t)(1u << (i % 8));
  }
}
