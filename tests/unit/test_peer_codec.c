/*
 * The pseudo-gradient codecs of --outer-compress (peer/sync/codec.h): the
 * text of a codec and its refusals; ⌈F·len⌉ and the encoded sizes against
 * formulas worked out here in integers; round trips (none exact, f16 within
 * 2^-11 relative, i8 within absmax/254 per block, top-k keeping exactly the
 * entries a brute-force sort picks, each within s/L); the wire bytes of
 * small examples worked out by hand; error feedback (the residual is
 * exactly v − decoded, and over many rounds nothing is lost); determinism
 * and ties; and hostile streams, each refused with RUMOR_ECORRUPT and the
 * accumulator left byte for byte as it was.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/sync/codec.h" /* defines: codec_parse, codec_format, codec_bytes, codec_encode, codec_decode_add */

/* ---- helpers --------------------------------------------------------------------- */

static struct codec codec_of(const char *text) {
  struct codec c;
  struct rumor_err e = {0};
  int rc = codec_parse(text, &c, &e);
  cr_assert_eq(rc, 0, "codec_parse(\"%s\"): %d %s", text, rc, e.msg);
  return c;
}

static float *floats(uint64_t n) {
  float *p = malloc((n ? n : 1) * sizeof *p);
  cr_assert(p);
  return p;
}

/* n normal values with a spread of magnitudes: scale 10^[-3, 3) per block
 * of 128, so that blocks and chunks differ. */
static float *random_vector(uint64_t n, uint64_t seed) {
  float *x = floats(n);
  struct rng r;
  rng_seed(&r, seed, 0);
  float scale = 1.0f;
  for (uint64_t i = 0; i < n; i++) {
    if (i % 128 == 0) scale = powf(10.0f, 6.0f * rng_uniform(&r) - 3.0f);
    x[i] = scale * rng_normal(&r);
  }
  return x;
}

/* Encodes x (no residual) into a new buffer of exactly codec_bytes. */
static uint8_t *encode(const struct codec *c, const float *x, uint64_t n, uint64_t *len) {
  *len = codec_bytes(c, n);
  uint8_t *out = malloc(*len ? *len : 1);
  cr_assert(out);
  codec_encode(c, x, NULL, n, out);
  return out;
}

/* Decodes `in` into a new vector that starts at 0, w = 1. */
static float *decode(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n) {
  float *y = floats(n);
  memset(y, 0, n * sizeof *y);
  struct rumor_err e = {0};
  int rc = codec_decode_add(c, in, len, n, 1.0f, y, &e);
  cr_assert_eq(rc, 0, "decoding what the encoder wrote: %d %s", rc, e.msg);
  return y;
}

/* ---- the codec's text ---------------------------------------------------------------- */

Test(peer_codec, canonical_texts_format_as_they_are_parsed) {
  const char *texts[] = {"none", "f16", "i8", "topk:0.03:2", "topk:1:8", "topk:0.5:4", "topk:0.001:8", "topk:1e-05:2"};
  for (size_t i = 0; i < sizeof texts / sizeof texts[0]; i++) {
    struct codec c = codec_of(texts[i]);
    char buf[CODEC_TEXT_MAX];
    codec_format(&c, buf, sizeof buf);
    cr_assert_str_eq(buf, texts[i], "format(parse(\"%s\"))", texts[i]);
  }
  struct codec c = codec_of("topk:0.03:2");
  cr_assert(c.kind == CODEC_TOPK && c.fraction == 0.03 && c.bits == 2, "topk:0.03:2 parsed as %d %.17g %d", c.kind,
            c.fraction, c.bits);
  const char *other[][2] = {{"topk:.5:4", "topk:0.5:4"}, {"topk:0.030:2", "topk:0.03:2"}, {"topk:1.0:8", "topk:1:8"},
                            {"topk:3e-2:2", "topk:0.03:2"}};
  for (size_t i = 0; i < sizeof other / sizeof other[0]; i++) {
    struct codec d = codec_of(other[i][0]);
    char buf[CODEC_TEXT_MAX];
    codec_format(&d, buf, sizeof buf);
    cr_assert_str_eq(buf, other[i][1], "format(parse(\"%s\"))", other[i][0]);
  }
}

Test(peer_codec, every_fraction_survives_format_and_parse) {
  struct rng r;
  rng_seed(&r, 5, 0);
  for (int t = 0; t < 20000; t++) {
    /* uniform doubles in (0, 1], and tiny ones down to 1e-300 */
    double f = t % 2 ? (double)(rng_next_u64(&r) >> 11) / 9007199254740992.0 : pow(10.0, -300.0 * rng_uniform(&r));
    if (!(f > 0.0)) continue;
    struct codec c = {CODEC_TOPK, f, 2 << (t % 3)}, back;
    char buf[2 * CODEC_TEXT_MAX];
    codec_format(&c, buf, sizeof buf);
    cr_assert(strlen(buf) < CODEC_TEXT_MAX, "\"%s\" does not fit CODEC_TEXT_MAX", buf);
    struct rumor_err e = {0};
    cr_assert_eq(codec_parse(buf, &back, &e), 0, "%.17g -> \"%s\": %s", f, buf, e.msg);
    cr_assert(back.kind == CODEC_TOPK && back.fraction == f && back.bits == c.bits, "%.17g -> \"%s\" -> %.17g", f,
              buf, back.fraction);
  }
}

Test(peer_codec, bad_texts_are_refused_with_the_text_and_what_is_allowed) {
  const char *bad[] = {"topk",          "topk:0:2",       "topk:1.5:2",  "topk:0.03:3", "topk:0.03:2x", "f32",
                       "",              "topk:nan:2",     "topk:inf:2",  "topk:-0.5:2", "topk: 0.5:2", "topk:0x1p-3:2",
                       "topk:0.03",     "topk::2",        "topk:0.03:",  "NONE",        "i8 ",          "topk:0.5:2:2",
                       "topk:1e-400:2", "topk:1.0000001:4"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct codec c = {CODEC_I8, 0.25, 4};
    struct rumor_err e = {0};
    int rc = codec_parse(bad[i], &c, &e);
    cr_assert_eq(rc, RUMOR_EFORMAT, "\"%s\" gave %d", bad[i], rc);
    char quoted[64];
    snprintf(quoted, sizeof quoted, "\"%s\"", bad[i]);
    cr_assert(strstr(e.msg, quoted), "\"%s\": message does not quote it: %s", bad[i], e.msg);
    cr_assert(strstr(e.msg, "topk:F:BITS") && strstr(e.msg, "2, 4 or 8"), "\"%s\": message: %s", bad[i], e.msg);
    cr_assert(c.kind == CODEC_I8 && c.fraction == 0.25 && c.bits == 4, "\"%s\": the output changed", bad[i]);
  }
  struct rumor_err e = {0};
  struct codec c;
  cr_assert_eq(codec_parse("topk:0.03:3", &c, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "BITS \"3\""), "the fault is named: %s", e.msg);
  cr_assert_eq(codec_parse("topk:1.5:2", &c, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "F \"1.5\""), "the fault is named: %s", e.msg);
}

/* ---- sizes ----------------------------------------------------------------------------- */

Test(peer_codec, topk_keep_is_the_exact_ceiling_for_decimal_fractions) {
  cr_assert_eq(codec_topk_keep(&(struct codec){CODEC_TOPK, 0.03, 2}, 100), 3, "0.03 * 100 is 3, not 4");
  cr_assert_eq(codec_topk_keep(&(struct codec){CODEC_TOPK, 0.07, 2}, 100), 7, "0.07 * 100 is 7");
  cr_assert_eq(codec_topk_keep(&(struct codec){CODEC_TOPK, 1e-9, 2}, 4096), 1, "at least one");
  cr_assert_eq(codec_topk_keep(&(struct codec){CODEC_TOPK, 1.0, 2}, 4096), 4096, "F = 1 keeps all");
  cr_assert_eq(codec_topk_keep(&(struct codec){CODEC_TOPK, 0.5, 2}, 0), 0, "an empty chunk keeps none");
  /* F = m/100 and m/1000 against integer arithmetic: ⌈m·len/q⌉ */
  const uint32_t denoms[] = {100, 1000};
  for (size_t d = 0; d < 2; d++)
    for (uint32_t m = 1; m <= denoms[d]; m += d ? 7 : 1) {
      struct codec c = {CODEC_TOPK, (double)m / denoms[d], 4};
      for (uint32_t len = 1; len <= CODEC_TOPK_CHUNK; len++) {
        uint32_t want = (uint32_t)(((uint64_t)m * len + denoms[d] - 1) / denoms[d]);
        cr_assert_eq(codec_topk_keep(&c, len), want, "F = %u/%u, len %u: %u, want %u", m, denoms[d], len,
                     codec_topk_keep(&c, len), want);
      }
    }
}

/* The size by the formula of codec.h, in integers: F = num/100. */
static uint64_t topk_bytes_ref(uint64_t n, uint64_t num, uint64_t bits) {
  uint64_t total = 0;
  for (uint64_t off = 0; off < n; off += CODEC_TOPK_CHUNK) {
    uint64_t len = n - off < CODEC_TOPK_CHUNK ? n - off : CODEC_TOPK_CHUNK;
    uint64_t k = (num * len + 99) / 100;
    total += 4 + (12 * k + 7) / 8 + (bits * k + 7) / 8;
  }
  return total;
}

Test(peer_codec, encoded_sizes_follow_the_formulas) {
  const uint64_t ns[] = {0, 1, 127, 128, 129, 4095, 4096, 4097, 1000003};
  for (size_t i = 0; i < sizeof ns / sizeof ns[0]; i++) {
    uint64_t n = ns[i];
    cr_assert_eq(codec_bytes(&(struct codec){CODEC_NONE, 0, 0}, n), 4 * n, "none, n %llu", (unsigned long long)n);
    cr_assert_eq(codec_bytes(&(struct codec){CODEC_F16, 0, 0}, n), 2 * n, "f16, n %llu", (unsigned long long)n);
    cr_assert_eq(codec_bytes(&(struct codec){CODEC_I8, 0, 0}, n), n + 4 * ((n + 127) / 128), "i8, n %llu",
                 (unsigned long long)n);
    const uint64_t fr[] = {3, 25, 100}, bits[] = {2, 4, 8};
    for (size_t f = 0; f < 3; f++)
      for (size_t b = 0; b < 3; b++) {
        struct codec c = {CODEC_TOPK, (double)fr[f] / 100, (int)bits[b]};
        uint64_t want = topk_bytes_ref(n, fr[f], bits[b]);
        cr_assert_eq(codec_bytes(&c, n), want, "topk:%g:%d n %llu: %llu, want %llu", c.fraction, c.bits,
                     (unsigned long long)n, (unsigned long long)codec_bytes(&c, n), (unsigned long long)want);
      }
  }
  /* one value at topk:x:2: a scale, one 12-bit index in 2 bytes, one code in 1 */
  cr_assert_eq(codec_bytes(&(struct codec){CODEC_TOPK, 0.03, 2}, 1), 7);
  cr_assert_eq(codec_bytes(&(struct codec){CODEC_NONE, 0, 0}, UINT64_MAX / 4 + 1), UINT64_MAX);
  cr_assert_eq(codec_bytes(&(struct codec){CODEC_F16, 0, 0}, UINT64_MAX / 2 + 1), UINT64_MAX);
  cr_assert_eq(codec_bytes(&(struct codec){CODEC_I8, 0, 0}, UINT64_MAX), UINT64_MAX);
  cr_assert_eq(codec_bytes(&(struct codec){CODEC_TOPK, 1.0, 8}, UINT64_MAX), UINT64_MAX);
  cr_assert_eq(codec_bytes(&(struct codec){CODEC_TOPK, 0.03, 3}, 10), UINT64_MAX, "an invalid codec");
}

/* ---- the wire bytes of small examples, worked out by hand -------------------------------- */

static void expect_bytes(const char *text, const float *x, uint64_t n, const uint8_t *want, size_t want_len) {
  struct codec c = codec_of(text);
  uint64_t len;
  uint8_t *got = encode(&c, x, n, &len);
  cr_assert_eq(len, want_len, "%s: %llu bytes, want %zu", text, (unsigned long long)len, want_len);
  for (size_t i = 0; i < want_len; i++)
    cr_assert_eq(got[i], want[i], "%s: byte %zu is 0x%02x, want 0x%02x", text, i, got[i], want[i]);
  free(got);
}

Test(peer_codec, wire_bytes_are_little_endian_as_documented) {
  expect_bytes("none", (float[]){1.0f, -2.0f}, 2, (uint8_t[]){0x00, 0x00, 0x80, 0x3f, 0x00, 0x00, 0x00, 0xc0}, 8);
  expect_bytes("f16", (float[]){1.0f, -2.0f, 1e6f}, 3, (uint8_t[]){0x00, 0x3c, 0x00, 0xc0, 0xff, 0x7b}, 6);
  /* absmax 127: s = 1; −63.5 rounds to the even −64 */
  expect_bytes("i8", (float[]){127.0f, -63.5f, 0.0f}, 3, (uint8_t[]){0x00, 0x00, 0x80, 0x3f, 0x7f, 0xc0, 0x00}, 7);
  /* k = 2 of 4: indices 1 and 3, s = 2, L = 3: −2 is code 0 (−s), 1 is
   * nearest to s/3 (code 2); indices 0x001, 0x003 as 12-bit fields: 01 30 00;
   * codes 0 and 2 as 2-bit fields: 0b1000 */
  expect_bytes("topk:0.5:2", (float[]){0.5f, -2.0f, 0.0f, 1.0f}, 4,
               (uint8_t[]){0x00, 0x00, 0x00, 0x40, 0x01, 0x30, 0x00, 0x08}, 8);
}

/* ---- round trips ---------------------------------------------------------------------------- */

Test(peer_codec, none_round_trips_exactly) {
  uint64_t n = 1000;
  float *x = random_vector(n, 1);
  x[0] = -0.0f, x[1] = FLT_MIN / 8, x[2] = FLT_MAX, x[3] = -FLT_TRUE_MIN;
  struct codec c = codec_of("none");
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len);
  float *y = floats(n);
  for (uint64_t i = 0; i < n; i++) y[i] = -0.0f; /* −0 + v is v, bit for bit */
  struct rumor_err e = {0};
  cr_assert_eq(codec_decode_add(&c, b, len, n, 1.0f, y, &e), 0, "%s", e.msg);
  for (uint64_t i = 0; i < n; i++)
    cr_assert_eq(memcmp(&x[i], &y[i], 4), 0, "value %llu: %a, want %a", (unsigned long long)i, y[i], x[i]);
  free(x), free(b), free(y);
}

Test(peer_codec, f16_is_within_half_an_ulp) {
  uint64_t n = 5000;
  float *x = random_vector(n, 2);
  struct codec c = codec_of("f16");
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len);
  float *y = decode(&c, b, len, n);
  double worst = 0;
  uint64_t at = 0;
  for (uint64_t i = 0; i < n; i++) { /* |x| in [1e-5, 1e5): normal halves, below 65504 */
    if (fabsf(x[i]) < 1e-4f || fabsf(x[i]) > 6e4f) continue;
    double rel = fabs((double)y[i] - x[i]) / fabs(x[i]);
    if (!(rel <= worst)) worst = rel, at = i;
  }
  cr_assert(worst <= 1.0 / 2048, "worst relative error %g at %llu (%g -> %g), bound 2^-11", worst,
            (unsigned long long)at, x[at], y[at]);
  free(x), free(b), free(y);
}

Test(peer_codec, i8_is_within_absmax_over_254_per_block) {
  uint64_t n = 1000; /* 7 blocks of 128 and one of 104 */
  float *x = random_vector(n, 3);
  for (uint64_t i = 256; i < 384; i++) x[i] *= 1e-38f; /* a block below 127·FLT_MIN: sent as zeros */
  for (uint64_t i = 384; i < 512; i++) /* x/s = ±63.5 (ties) where s = absmax/127 is rounded */
    x[i] = (i == 384 ? 0x1.8a8566p-15f : 0x1.8a8566p-16f) * (i % 2 ? -1.0f : 1.0f);
  struct codec c = codec_of("i8");
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len);
  float *y = decode(&c, b, len, n);
  for (uint64_t off = 0; off < n; off += 128) {
    uint64_t end = off + 128 < n ? off + 128 : n;
    float m = 0;
    for (uint64_t i = off; i < end; i++) m = fmaxf(m, fabsf(x[i]));
    /* half a step, plus the rounding of s (up to |q| = 127 times) and of
     * q·s: a few 2^-24 of m */
    double bound = m < 127.0f * FLT_MIN ? m : m / 254.0 + m * 0x1p-20, worst = 0;
    uint64_t at = off;
    for (uint64_t i = off; i < end; i++) {
      double err = fabs((double)y[i] - x[i]);
      cr_assert(isfinite(y[i]), "value %llu is %g", (unsigned long long)i, y[i]);
      if (err > worst) worst = err, at = i;
    }
    cr_assert(worst <= bound, "block at %llu: worst error %g at %llu (%g -> %g), bound absmax/254 = %g",
              (unsigned long long)off, worst, (unsigned long long)at, x[at], y[at], bound);
  }
  free(x), free(b), free(y);
}

/* The k entries of x[0..len) of largest |x|, ties to the lower index, by
 * sorting: kept[i] is set for them. */
static const float *g_sort_x; /* qsort's comparator has no context argument */
static int by_magnitude(const void *a, const void *b) {
  uint32_t i = *(const uint32_t *)a, j = *(const uint32_t *)b;
  float x = fabsf(g_sort_x[i]), y = fabsf(g_sort_x[j]);
  return x > y ? -1 : x < y ? 1 : (i > j) - (i < j);
}

static void topk_reference(const float *x, uint32_t len, uint32_t k, bool *kept) {
  uint32_t *order = malloc(len * sizeof *order);
  for (uint32_t i = 0; i < len; i++) order[i] = i, kept[i] = false;
  g_sort_x = x;
  qsort(order, len, sizeof *order, by_magnitude);
  for (uint32_t j = 0; j < k; j++) kept[order[j]] = true;
  free(order);
}

/* Top-k of x under `text`: per chunk, exactly the reference's entries are
 * nonzero, each within s/L of x (s the chunk's largest |x|). */
static void check_topk(const char *text, const float *x, uint64_t n) {
  struct codec c = codec_of(text);
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len);
  float *y = decode(&c, b, len, n);
  bool *kept = malloc(CODEC_TOPK_CHUNK * sizeof *kept);
  float L = (float)((1 << c.bits) - 1);
  for (uint64_t off = 0; off < n; off += CODEC_TOPK_CHUNK) {
    uint32_t cl = n - off < CODEC_TOPK_CHUNK ? (uint32_t)(n - off) : CODEC_TOPK_CHUNK;
    topk_reference(x + off, cl, codec_topk_keep(&c, cl), kept);
    float s = 0;
    for (uint32_t i = 0; i < cl; i++) s = fmaxf(s, fabsf(x[off + i]));
    for (uint32_t i = 0; i < cl; i++) {
      uint64_t at = off + i;
      if (!kept[i]) {
        cr_assert(y[at] == 0.0f, "%s: value %llu (%g) not kept, but decoded as %g", text, (unsigned long long)at,
                  x[at], y[at]);
        continue;
      }
      cr_assert(y[at] != 0.0f, "%s: value %llu (%g) should be kept", text, (unsigned long long)at, x[at]);
      double err = fabs((double)y[at] - x[at]), bound = s / L + s * 0x1p-20; /* + the rounding of lv and s·lv */
      cr_assert(err <= bound, "%s: value %llu: %g -> %g, error %g above s/L = %g", text, (unsigned long long)at,
                x[at], y[at], err, bound);
    }
  }
  free(b), free(y), free(kept);
}

Test(peer_codec, topk_keeps_exactly_the_largest_entries_of_each_chunk) {
  uint64_t n = 2 * CODEC_TOPK_CHUNK + 1000;
  float *x = random_vector(n, 4);
  const char *texts[] = {"topk:0.03:2", "topk:0.03:8", "topk:0.25:4", "topk:0.001:2", "topk:1:2", "topk:0.999:8"};
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) check_topk(texts[t], x, n);
  /* many ties: magnitudes from a handful of values, either sign */
  struct rng r;
  rng_seed(&r, 40, 0);
  for (uint64_t i = 0; i < n; i++) x[i] = (float)(1 + rng_below(&r, 5)) * (rng_below(&r, 2) ? 1.0f : -1.0f);
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) check_topk(texts[t], x, n);
  /* keys that agree in their top bytes and differ only in the last */
  for (uint64_t i = 0; i < n; i++) x[i] = 1.0f + (float)rng_below(&r, 200) * FLT_EPSILON;
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) check_topk(texts[t], x, n);
  /* short vectors: one chunk shorter than CODEC_TOPK_CHUNK */
  for (uint64_t m = 1; m <= 40; m++) check_topk("topk:0.1:4", x, m);
  free(x);
}

Test(peer_codec, topk_ties_go_to_the_lower_index) {
  float x[10] = {1, -1, 1, -1, 1, -1, 1, -1, 1, -1};
  struct codec c = codec_of("topk:0.3:2"); /* k = 3 */
  uint64_t len;
  uint8_t *b = encode(&c, x, 10, &len);
  float *y = decode(&c, b, len, 10);
  for (int i = 0; i < 10; i++)
    cr_assert_eq(y[i] != 0.0f, i < 3, "value %d decoded as %g: indices 0, 1 and 2 are kept", i, y[i]);
  free(b), free(y);
  float z[6] = {5, 1, 3, -3, 3, 3}; /* k = 3: 5, then the first two of the 3s */
  c = codec_of("topk:0.5:8");
  b = encode(&c, z, 6, &len);
  y = decode(&c, b, len, 6);
  const bool want[6] = {true, false, true, true, false, false};
  for (int i = 0; i < 6; i++) cr_assert_eq(y[i] != 0.0f, want[i], "value %d decoded as %g", i, y[i]);
  free(b), free(y);
}

Test(peer_codec, encoding_is_deterministic) {
  uint64_t n = 3 * CODEC_TOPK_CHUNK + 77;
  float *x = random_vector(n, 6), *r1 = random_vector(n, 7), *r2 = floats(n);
  memcpy(r2, r1, n * sizeof *r1);
  const char *texts[] = {"none", "f16", "i8", "topk:0.03:2", "topk:0.5:8"};
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
    struct codec c = codec_of(texts[t]);
    uint64_t len = codec_bytes(&c, n);
    uint8_t *a = malloc(len), *b = malloc(len);
    codec_encode(&c, x, r1, n, a);
    codec_encode(&c, x, r2, n, b);
    cr_assert_eq(memcmp(a, b, len), 0, "%s: two encodings of the same input differ", texts[t]);
    cr_assert_eq(memcmp(r1, r2, n * sizeof *r1), 0, "%s: the residuals differ", texts[t]);
    free(a), free(b);
  }
  free(x), free(r1), free(r2);
}

/* ---- error feedback ---------------------------------------------------------------------------- */

Test(peer_codec, residual_is_exactly_v_minus_decoded) {
  uint64_t n = 2 * CODEC_TOPK_CHUNK + 300;
  float *x = random_vector(n, 8), *r0 = random_vector(n, 9), *r = floats(n), *v = floats(n), *y = floats(n);
  for (uint64_t i = 0; i < n; i += 3) r0[i] = 0.0f;
  const char *texts[] = {"none", "f16", "i8", "topk:0.03:2", "topk:0.2:4", "topk:1:8"};
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
    struct codec c = codec_of(texts[t]);
    memcpy(r, r0, n * sizeof *r);
    for (uint64_t i = 0; i < n; i++) v[i] = x[i] + r0[i];
    uint64_t len = codec_bytes(&c, n);
    uint8_t *b = malloc(len);
    codec_encode(&c, x, r, n, b);
    memset(y, 0, n * sizeof *y);
    struct rumor_err e = {0};
    cr_assert_eq(codec_decode_add(&c, b, len, n, 1.0f, y, &e), 0, "%s: %s", texts[t], e.msg);
    for (uint64_t i = 0; i < n; i++) {
      float want = v[i] - y[i];
      cr_assert(r[i] == want, "%s: residual %llu is %a, want v - decoded = %a - %a = %a", texts[t],
                (unsigned long long)i, r[i], v[i], y[i], want);
    }
    free(b);
  }
  free(x), free(r0), free(r), free(v), free(y);
}

/* Encodes the same x for `rounds` rounds with error feedback and adds every
 * decoded round up. The residual must stay within `bound`·m (m the chunk's
 * max|x|); the sum is rounds·x less the last residual, so its mean must come
 * within bound/rounds·m of x, plus 1e-4·m for the float sums. */
static void check_feedback(const char *text, int rounds, double bound) {
  double tol = bound / rounds + 1e-4;
  uint64_t n = 2 * CODEC_TOPK_CHUNK + 500;
  float *x = random_vector(n, 10), *r = floats(n), *sum = floats(n);
  memset(r, 0, n * sizeof *r);
  memset(sum, 0, n * sizeof *sum);
  struct codec c = codec_of(text);
  uint64_t len = codec_bytes(&c, n);
  uint8_t *b = malloc(len);
  /* per 128-block scales differ: compare within each block's own scale */
  double worst = 0, worst_r = 0;
  for (int t = 0; t < rounds; t++) {
    codec_encode(&c, x, r, n, b);
    struct rumor_err e = {0};
    cr_assert_eq(codec_decode_add(&c, b, len, n, 1.0f, sum, &e), 0, "%s round %d: %s", text, t, e.msg);
  }
  uint64_t at = 0;
  for (uint64_t off = 0; off < n; off += CODEC_TOPK_CHUNK) {
    uint64_t end = off + CODEC_TOPK_CHUNK < n ? off + CODEC_TOPK_CHUNK : n;
    float m = 0;
    for (uint64_t i = off; i < end; i++) m = fmaxf(m, fabsf(x[i]));
    for (uint64_t i = off; i < end; i++) {
      double err = fabs((double)sum[i] / rounds - x[i]) / m, rr = fabs(r[i]) / m;
      if (err > worst) worst = err, at = i;
      if (rr > worst_r) worst_r = rr;
    }
  }
  cr_log_info("%s, %d rounds: mean off by %.3g of absmax (bound %g), residual up to %.3g of absmax (bound %g)", text,
              rounds, worst, tol, worst_r, bound);
  cr_assert(worst <= tol, "%s, %d rounds: mean of the decoded rounds off by %g of the chunk's absmax at %llu "
            "(%g against %g), bound %g", text, rounds, worst, (unsigned long long)at, sum[at] / rounds, x[at], tol);
  cr_assert(worst_r <= bound, "%s: residual reached %g of the chunk's absmax, bound %g", text, worst_r, bound);
  free(x), free(r), free(sum), free(b);
}

Test(peer_codec, error_feedback_loses_nothing_in_the_long_run) {
  /* Residual bounds: f16 and i8 leave at most half a quantisation step
   * (2^-11 relative, absmax/254); top-k with fraction F sends an entry once
   * its residual is among the largest F of its chunk, which keeps it within
   * about 1/F of the chunk's absmax (measured: 0.1/F here). Without error
   * feedback the entries top-k never sends would be off by all of x. */
  check_feedback("f16", 200, 1.0 / 1024);
  check_feedback("i8", 200, 1.0 / 127);
  check_feedback("topk:0.03:2", 2000, 1.0 / 0.03);
  check_feedback("topk:0.1:4", 1000, 1.0 / 0.1);
  check_feedback("topk:0.01:8", 4000, 1.0 / 0.01);
}

Test(peer_codec, non_finite_inputs_never_crash_and_are_refused_by_the_decoder) {
  uint64_t n = CODEC_TOPK_CHUNK + 300;
  float *x = random_vector(n, 11), *r = floats(n), *acc = floats(n);
  x[5] = NAN, x[CODEC_TOPK_CHUNK + 7] = INFINITY;
  const char *texts[] = {"none", "f16", "i8", "topk:0.03:2"};
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
    struct codec c = codec_of(texts[t]);
    for (uint64_t i = 0; i < n; i++) r[i] = 0.5f, acc[i] = 1.0f;
    uint64_t len = codec_bytes(&c, n);
    uint8_t *b = malloc(len);
    codec_encode(&c, x, r, n, b);
    struct rumor_err e = {0};
    cr_assert_eq(codec_decode_add(&c, b, len, n, 1.0f, acc, &e), RUMOR_ECORRUPT, "%s: a non-finite input", texts[t]);
    for (uint64_t i = 0; i < n; i++) {
      cr_assert(acc[i] == 1.0f, "%s: acc changed at %llu", texts[t], (unsigned long long)i);
      cr_assert(isfinite(r[i]), "%s: residual %llu is %g", texts[t], (unsigned long long)i, r[i]);
    }
    cr_assert(r[5] == 0.0f && r[CODEC_TOPK_CHUNK + 7] == 0.0f, "%s: non-finite v leaves 0", texts[t]);
    if (c.kind == CODEC_I8 || c.kind == CODEC_TOPK) /* the spoilt block's finite entries are kept whole */
      cr_assert(r[6] == x[6] + 0.5f, "%s: residual 6 is %g, want v = %g", texts[t], r[6], x[6] + 0.5f);
    free(b);
  }
  free(x), free(r), free(acc);
}

/* ---- hostile streams ------------------------------------------------------------------------------ */

/* Decodes `in` (len bytes, copied into a buffer of exactly len bytes, so
 * that AddressSanitizer sees any read past it) into an accumulator of
 * random values: it must be refused with RUMOR_ECORRUPT, a message holding
 * `needle`, and the accumulator unchanged. */
static void expect_refused(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n, const char *needle,
                           const char *what) {
  uint8_t *copy = malloc(len ? len : 1);
  if (len) memcpy(copy, in, len);
  float *acc = random_vector(n, 12), *before = floats(n);
  memcpy(before, acc, n * sizeof *acc);
  struct rumor_err e = {0};
  int rc = codec_decode_add(c, len ? copy : NULL, len, n, 0.5f, acc, &e);
  cr_assert_eq(rc, RUMOR_ECORRUPT, "%s: got %d (%s)", what, rc, e.msg);
  cr_assert(strstr(e.msg, needle), "%s: the message does not name \"%s\": %s", what, needle, e.msg);
  cr_assert_eq(memcmp(acc, before, n * sizeof *acc), 0, "%s: the accumulator changed", what);
  free(copy), free(acc), free(before);
}

Test(peer_codec, wrong_lengths_and_truncations_are_refused) {
  uint64_t n = CODEC_TOPK_CHUNK + 500;
  float *x = random_vector(n, 13);
  const char *texts[] = {"none", "f16", "i8", "topk:0.03:2", "topk:1:8"};
  for (size_t t = 0; t < sizeof texts / sizeof texts[0]; t++) {
    struct codec c = codec_of(texts[t]);
    uint64_t len;
    uint8_t *b = encode(&c, x, n, &len);
    expect_refused(&c, b, len - 1, n, "bytes", texts[t]);
    expect_refused(&c, b, len / 2, n, "bytes", texts[t]);
    expect_refused(&c, b, 0, n, "bytes", texts[t]);
    uint8_t *longer = calloc(len + 1, 1);
    memcpy(longer, b, len);
    expect_refused(&c, longer, len + 1, n, "bytes", texts[t]);
    expect_refused(&c, b, len, n + 1, "bytes", texts[t]); /* the right bytes for another n */
    free(b), free(longer);
  }
  float y = 0;
  struct rumor_err e = {0};
  cr_assert_eq(codec_decode_add(&(struct codec){CODEC_I8, 0, 0}, NULL, 0, 0, 1.0f, &y, &e), 0, "n = 0: %s", e.msg);
  free(x);
}

/* Rewrites 12-bit index field j of a top-k chunk that starts at `chunk`. */
static void set_index(uint8_t *chunk, uint32_t j, uint32_t v) {
  uint8_t *p = chunk + 4 + (j * 12) / 8;
  if (j % 2 == 0) p[0] = (uint8_t)v, p[1] = (uint8_t)((p[1] & 0xf0) | (v >> 8));
  else p[0] = (uint8_t)((p[0] & 0x0f) | (v & 0xf) << 4), p[1] = (uint8_t)(v >> 4);
}

static uint32_t get_index(const uint8_t *chunk, uint32_t j) {
  const uint8_t *p = chunk + 4 + (j * 12) / 8;
  return j % 2 == 0 ? (uint32_t)(p[0] | (p[1] & 0xf) << 8) : (uint32_t)(p[0] >> 4 | p[1] << 4);
}

Test(peer_codec, bad_topk_indices_are_refused_and_nothing_is_added) {
  /* Two chunks; the faults are in the second (a short one of 500 values,
   * k = 15), so a decoder that added the first before checking the
   * second would change the accumulator. */
  uint64_t n = CODEC_TOPK_CHUNK + 500;
  struct codec c = codec_of("topk:0.03:4");
  float *x = random_vector(n, 14);
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len), *bad = malloc(len);
  uint8_t *second = bad + codec_bytes(&c, CODEC_TOPK_CHUNK);
  cr_assert_eq(get_index(b + codec_bytes(&c, CODEC_TOPK_CHUNK), 0) < 500, 1, "the helper reads the first index");
  struct {
    uint32_t j, v;
    const char *needle, *what;
  } cases[] = {
      {14, 500, "chunk 1 index 14 is 500", "an index equal to the chunk's length"},
      {14, 4095, "chunk 1 index 14 is 4095", "an index far past the chunk"},
      {3, 0, "chunk 1 index 3 is 0", "indices not increasing"},
  };
  for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
    memcpy(bad, b, len);
    set_index(second, cases[t].j, cases[t].v);
    expect_refused(&c, bad, len, n, cases[t].needle, cases[t].what);
  }
  memcpy(bad, b, len);
  set_index(second, 5, get_index(second, 4));
  expect_refused(&c, bad, len, n, "chunk 1 index 5", "a duplicate index");
  memcpy(bad, b, len);
  uint32_t i0 = get_index(second, 0), i1 = get_index(second, 1);
  set_index(second, 0, i1), set_index(second, 1, i0);
  expect_refused(&c, bad, len, n, "chunk 1 index 1", "two indices swapped");
  memcpy(bad, b, len);
  /* k = 15 indices: 180 bits, so the last index byte has 4 padding bits */
  second[4 + 22] |= 0x80;
  expect_refused(&c, bad, len, n, "padding", "index padding bits set");
  memcpy(bad, b, len);
  bad[len - 1] |= 0x80; /* 15 codes of 4 bits: 4 padding bits */
  expect_refused(&c, bad, len, n, "padding", "code padding bits set");
  free(x), free(b), free(bad);
}

Test(peer_codec, bad_scales_are_refused) {
  uint64_t n = CODEC_TOPK_CHUNK + 500;
  float *x = random_vector(n, 15);
  const float scales[] = {NAN, -NAN, INFINITY, -INFINITY, -1.0f, -FLT_MIN};
  const char *texts[] = {"i8", "topk:0.03:2"};
  for (size_t t = 0; t < 2; t++) {
    struct codec c = codec_of(texts[t]);
    uint64_t len;
    uint8_t *b = encode(&c, x, n, &len), *bad = malloc(len);
    /* the second block or chunk's scale */
    uint8_t *at = bad + codec_bytes(&c, c.kind == CODEC_I8 ? CODEC_I8_BLOCK : CODEC_TOPK_CHUNK);
    const char *needle = c.kind == CODEC_I8 ? "block 1 has scale" : "chunk 1 has scale";
    for (size_t s = 0; s < sizeof scales / sizeof scales[0]; s++) {
      memcpy(bad, b, len);
      memcpy(at, &scales[s], 4);
      char what[64];
      snprintf(what, sizeof what, "%s with scale %g", texts[t], scales[s]);
      expect_refused(&c, bad, len, n, needle, what);
    }
    free(b), free(bad);
  }
  /* i8: a scale whose 127 multiple overflows, and the code −128 */
  struct codec c = codec_of("i8");
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len);
  float big = FLT_MAX / 100;
  memcpy(b + 132, &big, 4);
  expect_refused(&c, b, len, n, "block 1 has scale", "i8 scale FLT_MAX/100");
  free(b);
  b = encode(&c, x, n, &len);
  b[132 + 4 + 9] = 0x80;
  expect_refused(&c, b, len, n, "block 1 value 137 has code -128", "i8 code -128");
  free(b), free(x);
}

Test(peer_codec, non_finite_values_are_refused) {
  uint64_t n = 300;
  float *x = random_vector(n, 16);
  struct codec c = codec_of("f16");
  uint64_t len;
  uint8_t *b = encode(&c, x, n, &len);
  const uint16_t bad[] = {0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xffff};
  for (size_t t = 0; t < sizeof bad / sizeof bad[0]; t++) {
    uint8_t *copy = malloc(len);
    memcpy(copy, b, len);
    copy[2 * 200] = (uint8_t)bad[t], copy[2 * 200 + 1] = (uint8_t)(bad[t] >> 8);
    char what[32];
    snprintf(what, sizeof what, "f16 0x%04x", bad[t]);
    expect_refused(&c, copy, len, n, "value 200 is an f16", what);
    free(copy);
  }
  free(b);
  c = codec_of("none");
  b = encode(&c, x, n, &len);
  const float nf[] = {NAN, INFINITY, -INFINITY};
  for (size_t t = 0; t < sizeof nf / sizeof nf[0]; t++) {
    memcpy(b + 4 * 299, &nf[t], 4);
    expect_refused(&c, b, len, n, "value 299", "a non-finite none value");
  }
  free(b), free(x);
}
