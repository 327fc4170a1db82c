/*
 * Fuzz harness: the decoder of compressed pseudo-gradients
 * (codec_decode_add, peer/sync/codec.h), which reads bytes off the network.
 * The first input byte picks the codec (bits 0-1 the kind, bits 2-3 the
 * top-k bits, bits 4-6 the top-k fraction), the next two the number of
 * values n (little-endian, modulo FUZZ_N_MAX + 1); the rest is the stream.
 * Any input must be either refused with RUMOR_ECORRUPT, a message and the
 * accumulator untouched, or accepted, and then:
 *   - every accumulated value is finite;
 *   - re-encoding the decoded values gives a stream the decoder accepts;
 *   - none and f16: that stream is the input, byte for byte (every finite
 *     float and half survives the round trip);
 *   - i8: its values are within absmax/254 per block of the decoded ones
 *     (plus 2^-20 of absmax for the rounding of the scale and q·s);
 *   - top-k: at most k values per chunk are nonzero, and the re-encoded
 *     stream is a fixed point (encoding its decoded values gives it back)
 *     where each chunk's scale is 0 or at least 2^-100 (below that, kept
 *     values may round to 0 and drop out).
 * A broken promise aborts; nothing may crash, leak or read outside the input.
 */
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/sync/codec.h"
#include "tests/fuzz/fuzz.h"

#define FUZZ_N_MAX 16384 /* four top-k chunks; none's 64 KiB stays under run-fuzzers.sh's -max_len */
#define FUZZ_HEADER 3
#define FUZZ_TINY_SCALE 0x1p-100f

static const double g_fractions[8] = {0.001, 0.01, 0.03, 0.1, 0.25, 0.5, 0.999, 1.0};
static const int g_bits[4] = {2, 4, 8, 8};

/* Decodes `in` into a new vector of n −0.0 values (−0 + v is v, bit for
 * bit). Returns NULL when the decoder refuses it, after checking the
 * refusal: a message, and the vector unchanged. */
static float *decode(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n) {
  float *y = malloc((n ? n : 1) * sizeof *y);
  if (!y) abort();
  for (uint64_t i = 0; i < n; i++) y[i] = -0.0f;
  struct rumor_err e = {0};
  int rc = codec_decode_add(c, in, len, n, 1.0f, y, &e);
  if (getenv("RUMOR_FUZZ_VERBOSE")) fprintf(stderr, "n %llu: %s\n", (unsigned long long)n, rc ? e.msg : "accepted");
  if (rc == 0) return y;
  if (rc != RUMOR_ECORRUPT || strncmp(e.msg, "codec ", sizeof("codec ") - 1) != 0) abort();
  for (uint64_t i = 0; i < n; i++)
    if (!signbit(y[i]) || y[i] != 0.0f) abort(); /* a refused stream adds nothing */
  free(y);
  return NULL;
}

static uint8_t *encode(const struct codec *c, const float *y, uint64_t n, uint64_t *len) {
  *len = codec_bytes(c, n);
  uint8_t *out = malloc(*len ? *len : 1);
  if (!out) abort();
  codec_encode(c, y, NULL, n, out);
  return out;
}

/* i8: y2 (decoded from the encoding of y) is within absmax/254 per block
 * (and roundings), or 0 for a block below the encoder's tiny limit. */
static void check_i8(const float *y, const float *y2, uint64_t n) {
  for (uint64_t off = 0; off < n; off += CODEC_I8_BLOCK) {
    uint64_t end = off + CODEC_I8_BLOCK < n ? off + CODEC_I8_BLOCK : n;
    float m = 0.0f;
    for (uint64_t i = off; i < end; i++) m = fmaxf(m, fabsf(y[i]));
    double bound = m < 127.0f * FLT_MIN ? m : m / 254.0 + m * 0x1p-20; /* + the rounding of s and q·s */
    for (uint64_t i = off; i < end; i++)
      if (fabs((double)y2[i] - y[i]) > bound) abort();
  }
}

/* Top-k: at most k nonzero values per chunk of y; b2 = encode(y), whose
 * decoded values are y2, is a fixed point where every chunk's scale is 0
 * or at least FUZZ_TINY_SCALE. */
static void check_topk(const struct codec *c, const float *y, const float *y2, const uint8_t *b2, uint64_t len2,
                       uint64_t n) {
  bool normal_scales = true;
  const uint8_t *p = b2;
  for (uint64_t off = 0; off < n; off += CODEC_TOPK_CHUNK) {
    uint32_t cl = n - off < CODEC_TOPK_CHUNK ? (uint32_t)(n - off) : CODEC_TOPK_CHUNK, nonzero = 0;
    for (uint32_t i = 0; i < cl; i++) nonzero += y[off + i] != 0.0f;
    if (nonzero > codec_topk_keep(c, cl)) abort();
    float s;
    memcpy(&s, p, sizeof s); /* the chunk's scale (little-endian, as this host) */
    if (s != 0.0f && !(s >= FUZZ_TINY_SCALE)) normal_scales = false;
    p += codec_bytes(c, cl);
  }
  if (!normal_scales) return;
  uint64_t len3;
  uint8_t *b3 = encode(c, y2, n, &len3);
  if (len3 != len2 || memcmp(b3, b2, len2) != 0) abort();
  free(b3);
}

/* The promises of an accepted stream (see the top of the file). */
static void check_accepted(const struct codec *c, const uint8_t *in, uint64_t len, const float *y, uint64_t n) {
  for (uint64_t i = 0; i < n; i++)
    if (!isfinite(y[i])) abort();
  uint64_t len2;
  uint8_t *b2 = encode(c, y, n, &len2);
  if (len2 != len) abort();
  float *y2 = decode(c, b2, len2, n);
  if (!y2) abort(); /* the encoder's output of finite values is always accepted */
  switch (c->kind) {
  case CODEC_NONE:
  case CODEC_F16:
    if (memcmp(b2, in, len) != 0) abort();
    break;
  case CODEC_I8: check_i8(y, y2, n); break;
  case CODEC_TOPK: check_topk(c, y, y2, b2, len2, n); break;
  }
  free(y2);
  free(b2);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size < FUZZ_HEADER) return 0;
  struct codec c = {(enum codec_kind)(data[0] & 3), g_fractions[(data[0] >> 4) & 7], g_bits[(data[0] >> 2) & 3]};
  uint64_t n = (uint64_t)(data[1] | data[2] << 8) % (FUZZ_N_MAX + 1);
  size_t len = size - FUZZ_HEADER;
  /* A copy of exactly len bytes, so that AddressSanitizer sees any read
   * past the end. */
  uint8_t *buf = malloc(len ? len : 1);
  if (!buf) abort();
  if (len) memcpy(buf, data + FUZZ_HEADER, len);
  float *y = decode(&c, buf, len, n);
  if (y) check_accepted(&c, buf, len, y, n);
  free(y);
  free(buf);
  return 0;
}
