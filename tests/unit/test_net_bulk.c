/*
 * Wire encodings of bulk buffers: the F16C fast path gives exactly what
 * util's reference conversion gives (every half value, special values,
 * random floats, odd lengths); i8 stays within absmax/254 per block, keeps
 * non-finite blocks non-finite, and its AVX2 path gives the reference's
 * bytes; encoded lengths; the transfer digest (over the chunks' AEAD
 * tags) depends on every byte, the chunk order, the parameters and the
 * session key.
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

/* ---- i8: block-wise 8-bit ---- */

/* Encodes n values with net_dtype_encode (the fast path where the CPU has
 * it), checks the bytes against the scalar reference, decodes them both
 * ways and checks the floats agree bit for bit. Returns the decoded values
 * (malloc'd). */
static float *i8_roundtrip(const float *src, size_t n) {
  size_t bytes = (size_t)net_dtype_bytes(NET_DTYPE_I8, n);
  uint8_t *fast = malloc(bytes + 1), *ref = malloc(bytes + 1);
  fast[bytes] = ref[bytes] = 0xa5; /* guard byte */
  net_dtype_encode(NET_DTYPE_I8, fast, src, n);
  net_i8_encode_ref(ref, src, n);
  cr_assert_eq(fast[bytes], 0xa5, "encode wrote past %zu bytes", bytes);
  for (size_t i = 0; i < bytes; i++)
    cr_assert_eq(fast[i], ref[i], "n=%zu: byte %zu (block %zu) fast 0x%02x, reference 0x%02x", n, i,
                 i / (4 + NET_I8_BLOCK), fast[i], ref[i]);
  float *got = malloc((n + 1) * sizeof *got), *want = malloc((n + 1) * sizeof *want);
  got[n] = want[n] = 12345.0f; /* guard */
  net_dtype_decode(NET_DTYPE_I8, got, fast, n);
  net_i8_decode_ref(want, ref, n);
  cr_assert(got[n] == 12345.0f, "decode wrote past %zu values", n);
  for (size_t i = 0; i < n; i++)
    cr_assert(memcmp(&got[i], &want[i], 4) == 0 || (isnan(got[i]) && isnan(want[i])),
              "n=%zu: value %zu fast %a, reference %a", n, i, (double)got[i], (double)want[i]);
  free(fast);
  free(ref);
  free(want);
  return got;
}

/* Checks |x - y| <= absmax / 254 (+ a few ulps of absmax, + 1e-35) in
 * every block of a roundtrip, and prints the worst ratio to the bound. */
static void i8_check_bound(const float *x, const float *y, size_t n) {
  double worst = 0;
  size_t worst_at = 0;
  for (size_t b = 0; b < n; b += NET_I8_BLOCK) {
    size_t k = n - b < NET_I8_BLOCK ? n - b : NET_I8_BLOCK;
    double m = 0;
    for (size_t i = b; i < b + k; i++) m = fmax(m, fabs((double)x[i]));
    double bound = m / 254 + m * 4e-7 + 1e-35;
    for (size_t i = b; i < b + k; i++) {
      cr_assert(isfinite(y[i]), "value %zu (%a) decoded as %a in a finite block", i, (double)x[i], (double)y[i]);
      double err = fabs((double)x[i] - (double)y[i]);
      cr_assert_leq(err, bound, "value %zu: %a decoded as %a (error %g, bound %g, absmax %g)", i, (double)x[i],
                    (double)y[i], err, bound, m);
      if (bound > 0 && err / bound > worst) worst = err / bound, worst_at = i;
    }
  }
  cr_log_info("i8 n=%zu: worst error %.3f of the bound, at %zu", n, worst, worst_at);
}

Test(net_bulk, i8_roundtrip_stays_within_absmax_over_254_in_every_block) {
  size_t n = 1000003; /* a short last block */
  float *v = malloc(n * sizeof *v);
  struct rng r;
  rng_seed(&r, 12, 0);
  for (size_t i = 0; i < n; i++) {
    /* magnitudes from 1e-30 to 1e30, one per block, and a few outliers */
    double mag = pow(10.0, (double)((i / NET_I8_BLOCK) % 61) - 30.0);
    double u = (double)(rng_next_u64(&r) >> 11) / 9007199254740992.0 * 2 - 1;
    v[i] = (float)(u * mag * (i % 97 == 0 ? 50 : 1));
  }
  float *y = i8_roundtrip(v, n);
  i8_check_bound(v, y, n);
  free(y);
  for (size_t len = 1; len <= 3 * NET_I8_BLOCK + 1; len++) { /* every tail and block boundary */
    y = i8_roundtrip(v + 7, len);
    i8_check_bound(v + 7, y, len);
    free(y);
  }
  free(v);
}

Test(net_bulk, i8_zero_and_tiny_blocks_arrive_as_zeros) {
  float v[300] = {0};
  v[1] = -0.0f;
  for (size_t i = 200; i < 300; i++) v[i] = 1e-37f * (float)(i % 3); /* absmax below 127 FLT_MIN */
  uint8_t enc[300 + 12];
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 300), sizeof enc);
  net_dtype_encode(NET_DTYPE_I8, enc, v, 300);
  float s;
  memcpy(&s, enc, 4);
  cr_assert(s == 0.0f, "an all-zero block's scale is 0, not %a", (double)s);
  float *y = i8_roundtrip(v, 300);
  for (size_t i = 0; i < 300; i++) cr_assert(y[i] == 0.0f, "value %zu decoded as %a", i, (double)y[i]);
  free(y);
}

Test(net_bulk, i8_one_huge_value_flattens_only_its_own_block) {
  float v[3 * NET_I8_BLOCK];
  for (size_t i = 0; i < 3 * NET_I8_BLOCK; i++) v[i] = 1e-3f * (float)((int)(i % 17) - 8);
  v[NET_I8_BLOCK + 5] = 3e30f;
  float *y = i8_roundtrip(v, 3 * NET_I8_BLOCK);
  cr_assert(fabsf(y[NET_I8_BLOCK + 5] - 3e30f) <= 3e30f / 254, "the huge value: %a", (double)y[NET_I8_BLOCK + 5]);
  for (size_t i = NET_I8_BLOCK; i < 2 * NET_I8_BLOCK; i++)
    if (i != NET_I8_BLOCK + 5) cr_assert(y[i] == 0.0f, "small value %zu beside the huge one: %a", i, (double)y[i]);
  /* the neighbouring blocks keep their own scale */
  i8_check_bound(v, y, NET_I8_BLOCK);
  i8_check_bound(v + 2 * NET_I8_BLOCK, y + 2 * NET_I8_BLOCK, NET_I8_BLOCK);
  cr_assert(y[3] != 0.0f && fabsf(y[3] - v[3]) <= 8e-3f / 254, "%a vs %a", (double)y[3], (double)v[3]);
  free(y);
}

Test(net_bulk, i8_a_block_with_nan_or_inf_arrives_non_finite_and_alone) {
  const float bad[] = {NAN, INFINITY, -INFINITY, -NAN};
  size_t n = 4 * NET_I8_BLOCK + 50; /* the last block short */
  float *v = malloc(n * sizeof *v);
  for (size_t w = 0; w < 4; w++) {
    size_t spots[] = {0, 7, NET_I8_BLOCK - 1, NET_I8_BLOCK + 63, 4 * NET_I8_BLOCK + 49};
    for (size_t k = 0; k < sizeof spots / sizeof spots[0]; k++) {
      for (size_t i = 0; i < n; i++) v[i] = 0.25f * (float)((int)(i % 9) - 4);
      size_t at = spots[k], blk = at / NET_I8_BLOCK;
      v[at] = bad[w];
      float *y = i8_roundtrip(v, n);
      for (size_t i = 0; i < n; i++) {
        if (i / NET_I8_BLOCK == blk)
          cr_assert(!isfinite(y[i]), "%a at %zu: value %zu of its block decoded finite (%a)", (double)bad[w], at, i,
                    (double)y[i]);
        else
          cr_assert(fabsf(y[i] - v[i]) <= 1.0f / 254 + 1e-6f, "%a at %zu: value %zu of another block: %a vs %a",
                    (double)bad[w], at, i, (double)y[i], (double)v[i]);
      }
      free(y);
    }
  }
  free(v);
}

Test(net_bulk, i8_decoding_any_bytes_gives_floats_and_a_non_finite_scale_stays_non_finite) {
  uint8_t enc[4 + NET_I8_BLOCK];
  float y[NET_I8_BLOCK];
  const uint32_t scales[] = {0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f7fffffu};
  for (size_t s = 0; s < 4; s++) {
    memcpy(enc, &scales[s], 4);
    for (size_t i = 0; i < NET_I8_BLOCK; i++) enc[4 + i] = (uint8_t)(i * 37 + 1); /* -128 included */
    enc[4 + 3] = 0x80;
    net_dtype_decode(NET_DTYPE_I8, y, enc, NET_I8_BLOCK);
    float scale;
    memcpy(&scale, enc, 4);
    for (size_t i = 0; i < NET_I8_BLOCK; i++)
      if (!isfinite(scale)) cr_assert(!isfinite(y[i]), "scale %a, value %zu decoded finite", (double)scale, i);
  }
}

Test(net_bulk, encoded_lengths_per_dtype_and_block_aligned_chunks) {
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 0), 0);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 1), 5);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 127), 131);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 128), 132);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 129), 137);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, 1000003), 1000003 + 4 * 7813);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_F32, 10), 40);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_F16, 10), 20);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_BF16, 10), 20);
  cr_assert_eq(net_dtype_bytes((enum net_dtype)0, 10), 0, "unknown dtype");
  cr_assert_eq(net_dtype_bytes((enum net_dtype)5, 10), 0, "unknown dtype");
  /* sizes that do not fit saturate (callers compare them with limits) */
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_I8, UINT64_MAX), UINT64_MAX);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_F32, UINT64_MAX / 2), UINT64_MAX);
  cr_assert_eq(net_dtype_bytes(NET_DTYPE_F16, UINT64_MAX), UINT64_MAX);
  cr_assert_str_eq(net_dtype_name(NET_DTYPE_I8), "i8");
  cr_assert(net_dtype_valid(NET_DTYPE_I8) && !net_dtype_valid((enum net_dtype)5));
  const size_t chunk_bytes[] = {NET_BULK_CHUNK_MIN, 1u << 20, 16u << 20, 1000004};
  for (size_t i = 0; i < sizeof chunk_bytes / sizeof chunk_bytes[0]; i++) {
    uint32_t e = net_bulk_chunk_elems(NET_DTYPE_I8, chunk_bytes[i]);
    cr_assert(e > 0 && e % NET_I8_BLOCK == 0, "%u elements per chunk is not whole blocks", e);
    cr_assert_leq(net_dtype_bytes(NET_DTYPE_I8, e), chunk_bytes[i]);
    cr_assert_gt(net_dtype_bytes(NET_DTYPE_I8, e + NET_I8_BLOCK), chunk_bytes[i], "not the most that fit");
    cr_assert_eq(net_bulk_chunk_elems(NET_DTYPE_F32, chunk_bytes[i]), chunk_bytes[i] / 4);
  }
}

static const uint8_t digest_key[NET_AEAD_KEY_BYTES] = {42};

/* The digest a sender under `key` puts in END for the n bytes at p, sent
 * as DATA frames of `chunk` bytes (transfer 1, from position 0), the way
 * net_bulk_tx_produce and the connection compute it. `d`: a fixed-width
 * dtype (not i8). */
static void digest_keyed(uint8_t out[32], const uint8_t key[NET_AEAD_KEY_BYTES], const uint8_t *p, size_t n,
                         size_t chunk, uint64_t count, enum net_dtype d) {
  crypto_generichash_state root;
  struct net_aead a;
  uint8_t *frame = malloc(NET_FRAME_OVERHEAD + chunk);
  net_aead_init(&a, NET_SUITE_CHACHA20POLY1305, key);
  net_digest_root_init(&root, count, d, (uint32_t)chunk);
  for (size_t off = 0; off < n; off += chunk) {
    size_t len = n - off < chunk ? n - off : chunk;
    net_frame_hdr_write(frame, NET_FRAME_BULK_DATA, len, 1, off / net_dtype_bytes(d, 1));
    cr_assert_eq(net_aead_seal(&a, frame, p + off, len), 0);
    net_digest_add_tag(&root, frame + NET_FRAME_HDR + len);
  }
  net_digest_final(&root, out);
  net_aead_wipe(&a);
  free(frame);
}

static void digest(uint8_t out[32], const uint8_t *p, size_t n, size_t chunk, uint64_t count, enum net_dtype d) {
  digest_keyed(out, digest_key, p, n, chunk, count, d);
}

Test(net_bulk, the_digest_depends_on_every_byte_the_order_the_parameters_and_the_key) {
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
  /* the same bytes sent in another session (another key) give another digest */
  uint8_t other_key[NET_AEAD_KEY_BYTES] = {43};
  digest_keyed(b, other_key, buf, sizeof buf, 1024, 1024, NET_DTYPE_F32);
  cr_assert_neq(memcmp(a, b, 32), 0, "session key is bound");
}
