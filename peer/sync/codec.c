/* Compressed pseudo-gradients: the codecs of --outer-compress (contract and
 * wire formats in peer/sync/codec.h). */
#include "peer/sync/codec.h"

#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* Below this absmax an i8 block's scale would be subnormal and its inverse
 * overflow: such a block is sent as zeros (the error is below 1.5e-36). */
#define I8_TINY (127.0f * FLT_MIN)
#define F16_MAX_FINITE 0x7bffu /* 65504 */
#define F16_EXP_MASK 0x7c00u
#define F32_ABS_MASK 0x7fffffffu
#define F32_EXP_MASK 0x7f800000u
#define TOPK_LEVELS_MAX 256 /* 2^bits for the largest bits */
/* The relative slack of codec_topk_keep: far above the rounding of F·len
 * (a few 1e-16), far below any real excess of F·len over an integer. */
#define TOPK_KEEP_SLACK 1e-12
#define CODEC_ALLOWED "allowed: none, f16, i8 or topk:F:BITS with F a decimal in (0, 1] (e.g. 0.03) and BITS 2, 4 or 8"

/* ---- little-endian numbers and bit streams ---------------------------------------- */

static uint32_t f32_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

static float f32_of_bits(uint32_t u) {
  float f;
  memcpy(&f, &u, sizeof f);
  return f;
}

static void st_f32(uint8_t *p, float f) {
  uint32_t u = f32_bits(f);
  p[0] = (uint8_t)u, p[1] = (uint8_t)(u >> 8), p[2] = (uint8_t)(u >> 16), p[3] = (uint8_t)(u >> 24);
}

static float ld_f32(const uint8_t *p) {
  return f32_of_bits((uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24);
}

static void st_u16(uint8_t *p, uint16_t h) {
  p[0] = (uint8_t)h, p[1] = (uint8_t)(h >> 8);
}

static uint16_t ld_u16(const uint8_t *p) {
  return (uint16_t)(p[0] | p[1] << 8);
}

/* A bit stream writer (codec.h's layout): fields of at most 24 bits. */
struct bitw {
  uint8_t *p;
  uint32_t acc; /* pending bits, the oldest lowest */
  int n;        /* how many (below 8 between calls) */
};

static void bitw_put(struct bitw *b, uint32_t v, int width) {
  b->acc |= v << b->n;
  b->n += width;
  for (; b->n >= 8; b->n -= 8, b->acc >>= 8) *b->p++ = (uint8_t)b->acc;
}

/* Writes the last partial byte, zero-padded. */
static void bitw_flush(struct bitw *b) {
  if (b->n > 0) *b->p++ = (uint8_t)b->acc;
  b->acc = 0;
  b->n = 0;
}

/* The matching reader: it takes a byte only when a field needs it, so k
 * fields of `width` bits read exactly ⌈k·width/8⌉ bytes. */
struct bitr {
  const uint8_t *p;
  uint32_t acc;
  int n;
};

static uint32_t bitr_get(struct bitr *b, int width) {
  for (; b->n < width; b->n += 8) b->acc |= (uint32_t)*b->p++ << b->n;
  uint32_t v = b->acc & ((1u << width) - 1);
  b->acc >>= width;
  b->n -= width;
  return v;
}

/* Bytes of a bit stream of k fields of `width` bits. */
static uint64_t stream_bytes(uint64_t k, unsigned width) {
  return (k * width + 7) / 8;
}

/* ---- the codec's text and sizes ------------------------------------------------------ */

bool codec_valid(const struct codec *c) {
  switch (c->kind) {
  case CODEC_NONE:
  case CODEC_F16:
  case CODEC_I8: return true;
  case CODEC_TOPK: return c->fraction > 0.0 && c->fraction <= 1.0 && (c->bits == 2 || c->bits == 4 || c->bits == 8);
  }
  return false;
}

/* Parses the "F:BITS" of "topk:F:BITS" into c; 0 or RUMOR_EFORMAT with the
 * reason in e (without the text, which the caller adds). */
static int parse_topk(const char *spec, struct codec *c, struct rumor_err *e) {
  const char *colon = strchr(spec, ':');
  if (!colon) return rumor_err_set(e, RUMOR_EFORMAT, "topk needs :F:BITS");
  size_t flen = (size_t)(colon - spec);
  char f[64];
  if (flen == 0 || flen >= sizeof f) return rumor_err_set(e, RUMOR_EFORMAT, "F is missing or too long");
  memcpy(f, spec, flen);
  f[flen] = '\0';
  /* strtod also reads signs, spaces, hexadecimal, nan and inf: only digits,
   * a point and an exponent are a decimal here. */
  bool chars_ok = (f[0] >= '0' && f[0] <= '9') || f[0] == '.';
  for (size_t i = 0; i < flen; i++)
    if (!strchr("0123456789.eE+-", f[i])) chars_ok = false;
  char *end;
  double v = chars_ok ? strtod(f, &end) : 0.0;
  if (!chars_ok || *end != '\0' || !(v > 0.0 && v <= 1.0))
    return rumor_err_set(e, RUMOR_EFORMAT, "F \"%s\" is not a decimal in (0, 1]", f);
  const char *bits = colon + 1;
  int b = strcmp(bits, "2") == 0 ? 2 : strcmp(bits, "4") == 0 ? 4 : strcmp(bits, "8") == 0 ? 8 : 0;
  if (!b) return rumor_err_set(e, RUMOR_EFORMAT, "BITS \"%.16s\" is not 2, 4 or 8", bits);
  c->kind = CODEC_TOPK;
  c->fraction = v;
  c->bits = b;
  return 0;
}

int codec_parse(const char *text, struct codec *out, struct rumor_err *e) {
  if (!text) return rumor_err_set(e, RUMOR_EFORMAT, "no codec given; " CODEC_ALLOWED);
  struct codec c = {CODEC_NONE, 0.0, 0};
  struct rumor_err why = {0, "unknown codec"};
  int rc = 0;
  if (strcmp(text, "none") == 0) c.kind = CODEC_NONE;
  else if (strcmp(text, "f16") == 0) c.kind = CODEC_F16;
  else if (strcmp(text, "i8") == 0) c.kind = CODEC_I8;
  else if (STR_PREFIX(text, "topk:")) rc = parse_topk(text + STR_LEN("topk:"), &c, &why);
  else if (strcmp(text, "topk") == 0) rc = rumor_err_set(&why, RUMOR_EFORMAT, "topk needs :F:BITS");
  else rc = RUMOR_EFORMAT;
  if (rc) return rumor_err_set(e, RUMOR_EFORMAT, "codec \"%.100s\": %s; " CODEC_ALLOWED, text, why.msg);
  *out = c;
  return 0;
}

void codec_format(const struct codec *c, char *buf, size_t n) {
  if (n == 0) return;
  if (!codec_valid(c)) {
    snprintf(buf, n, "invalid");
    return;
  }
  switch (c->kind) {
  case CODEC_NONE: snprintf(buf, n, "none"); return;
  case CODEC_F16: snprintf(buf, n, "f16"); return;
  case CODEC_I8: snprintf(buf, n, "i8"); return;
  case CODEC_TOPK: break;
  }
  /* The fewest significant digits that read back as the same double; 17
   * always do. %g's forms (0.03, 1e-05) are decimals codec_parse reads. */
  char f[32];
  for (int digits = 1; digits <= 17; digits++) {
    snprintf(f, sizeof f, "%.*g", digits, c->fraction);
    if (strtod(f, NULL) == c->fraction) break;
  }
  snprintf(buf, n, "topk:%s:%d", f, c->bits);
}

uint32_t codec_topk_keep(const struct codec *c, uint32_t len) {
  if (len == 0) return 0;
  if (!(c->fraction > 0.0)) return 1;
  if (c->fraction >= 1.0) return len;
  double k = ceil(c->fraction * len * (1.0 - TOPK_KEEP_SLACK));
  return k < 1.0 ? 1 : k > len ? len : (uint32_t)k;
}

/* Bytes of one top-k chunk of len (1..CODEC_TOPK_CHUNK) values. */
static uint64_t topk_chunk_bytes(const struct codec *c, uint32_t len) {
  uint32_t k = codec_topk_keep(c, len);
  return 4 + stream_bytes(k, CODEC_TOPK_INDEX_BITS) + stream_bytes(k, (unsigned)c->bits);
}

uint64_t codec_bytes(const struct codec *c, uint64_t n) {
  if (!codec_valid(c)) return UINT64_MAX;
  switch (c->kind) {
  case CODEC_NONE: return n > UINT64_MAX / 4 ? UINT64_MAX : n * 4;
  case CODEC_F16: return n > UINT64_MAX / 2 ? UINT64_MAX : n * 2;
  case CODEC_I8: {
    uint64_t scales = 4 * (n / CODEC_I8_BLOCK + (n % CODEC_I8_BLOCK != 0)); /* at most 2^59: no overflow */
    return n > UINT64_MAX - scales ? UINT64_MAX : n + scales;
  }
  case CODEC_TOPK: {
    uint64_t full = n / CODEC_TOPK_CHUNK, rest = n % CODEC_TOPK_CHUNK;
    uint64_t tail = rest ? topk_chunk_bytes(c, (uint32_t)rest) : 0, per = topk_chunk_bytes(c, CODEC_TOPK_CHUNK);
    return full > (UINT64_MAX - tail) / per ? UINT64_MAX : full * per + tail;
  }
  }
  return UINT64_MAX;
}

/* Values per block of the encode and decode loops: i8's and top-k's are
 * their formats'; none and f16 have none, and take top-k's size. */
static uint32_t block_values(const struct codec *c) {
  return c->kind == CODEC_I8 ? CODEC_I8_BLOCK : CODEC_TOPK_CHUNK;
}

/* The top-k levels: lv[u] = (2u − L) / L in float, u in [0, L]. The value
 * of code u under scale s is s · lv[u], in encoder and decoder alike. */
static void topk_levels(const struct codec *c, float *lv) {
  uint32_t L = (1u << c->bits) - 1;
  for (uint32_t u = 0; u <= L; u++) lv[u] = (float)((int32_t)(2 * u) - (int32_t)L) / (float)L;
}

/* ---- encoding -------------------------------------------------------------------------
 * Each block encoder reads v[0..len) (x + residual, or x) and, where r is
 * not NULL (then r is v's own memory), leaves r = v − decoded in float, 0
 * where v is not finite. */

static void none_block_encode(const float *v, float *r, uint32_t len, uint8_t *out) {
  for (uint32_t i = 0; i < len; i++) st_f32(out + 4 * (size_t)i, v[i]);
  if (r) memset(r, 0, len * sizeof *r); /* v − v, and 0 where v is not finite */
}

static void f16_block_encode(const float *v, float *r, uint32_t len, uint8_t *out) {
  for (uint32_t i = 0; i < len; i++) {
    uint16_t h = half_from_f32(v[i]);
    bool finite = isfinite(v[i]);
    if (finite && (h & F16_EXP_MASK) == F16_EXP_MASK) h = (uint16_t)((h & 0x8000u) | F16_MAX_FINITE);
    st_u16(out + 2 * (size_t)i, h);
    if (r) {
      float d = half_to_f32(h);
      r[i] = finite ? v[i] - d : 0.0f;
    }
  }
}

/* Leaves r = v where v is finite and 0 where it is not: a block or chunk
 * spoilt by a non-finite value sends nothing. */
static void keep_finite(float *r, uint32_t len) {
  if (r)
    for (uint32_t i = 0; i < len; i++)
      if (!isfinite(r[i])) r[i] = 0.0f;
}

static void i8_block_encode(const float *v, float *r, uint32_t len, uint8_t *out) {
  float m = 0.0f;
  bool finite = true;
  for (uint32_t i = 0; i < len; i++) {
    if (!isfinite(v[i])) finite = false;
    else if (fabsf(v[i]) > m) m = fabsf(v[i]);
  }
  if (!finite) {
    st_f32(out, NAN);
    memset(out + 4, 0, len);
    keep_finite(r, len);
    return;
  }
  float s = 0.0f, inv = 0.0f;
  if (m >= I8_TINY) {
    s = m / 127.0f;
    if (!isfinite(127.0f * s)) s = nextafterf(s, 0.0f); /* the decoder refuses a scale whose 127·s overflows */
    inv = 1.0f / s;
  }
  st_f32(out, s);
  for (uint32_t i = 0; i < len; i++) {
    long q = inv == 0.0f ? 0 : lrintf(v[i] * inv);
    q = q > 127 ? 127 : q < -127 ? -127 : q;
    out[4 + i] = (uint8_t)(int8_t)q;
    if (r) {
      float d = (float)q * s;
      r[i] = v[i] - d;
    }
  }
}

/* The top-k choice of a chunk: keep entry i when key[i] > thr, or when
 * key[i] == thr and it is among the first `ties` such entries. */
struct topk_cut {
  uint32_t thr, ties;
};

/* Finds the cut that keeps the k (1 <= k < len) largest keys, ties to the
 * lower index: a radix select over the keys' 31 bits (the sign bit is
 * clear), most significant digit first: 11 bits (the exponent and the
 * mantissa's top 3, so that values of one magnitude spread over buckets),
 * then 10 and 10. Each pass makes a histogram of one digit of the keys
 * still in the running and keeps those of the bucket where the k-th largest
 * lies, compacted into cand (len entries of scratch), so only the first
 * pass reads all len keys. */
static struct topk_cut topk_select(const uint32_t *key, uint32_t len, uint32_t k, uint32_t *cand) {
  static const int shifts[] = {20, 10, 0}, widths[] = {11, 10, 10};
  const uint32_t *in = key;
  uint32_t m = len, prefix = 0; /* prefix: the digits of the k-th largest key found so far */
  for (size_t p = 0; p < sizeof shifts / sizeof shifts[0]; p++) {
    uint32_t hist[1u << 11] = {0}, mask = (1u << widths[p]) - 1;
    int shift = shifts[p];
    for (uint32_t i = 0; i < m; i++) hist[(in[i] >> shift) & mask]++;
    uint32_t b = mask;
    for (; hist[b] < k; b--) k -= hist[b]; /* the keys in higher buckets are all kept */
    prefix |= b << shift;
    /* Every key of this bucket is kept: the cut lies just below its
     * smallest possible key, which is above 0 as k < len. */
    if (hist[b] == k) return (struct topk_cut){prefix - 1, 0};
    uint32_t kept = 0;
    for (uint32_t i = 0; i < m; i++)
      if (((in[i] >> shift) & mask) == b) cand[kept++] = in[i];
    in = cand, m = kept;
  }
  return (struct topk_cut){prefix, k};
}

/* The nearest level to x under scale s (s >= |x|): the rounded code and its
 * neighbours compared by the decoded value, the lowest code on a tie. */
static uint32_t topk_code(float x, float s, const float *lv, uint32_t L) {
  if (!(s > 0.0f)) return L; /* s = 0: every level decodes as 0 */
  long u0 = lrintf((x / s + 1.0f) * 0.5f * (float)L);
  u0 = u0 < 0 ? 0 : u0 > (long)L ? (long)L : u0;
  uint32_t best = (uint32_t)u0;
  float best_err = fabsf(x - s * lv[best]);
  for (long u = u0 - 1; u <= u0 + 1; u += 2) {
    if (u < 0 || u > (long)L) continue;
    float err = fabsf(x - s * lv[u]);
    if (err < best_err || (err == best_err && (uint32_t)u < best)) best = (uint32_t)u, best_err = err;
  }
  return best;
}

/* One chunk of len (1..CODEC_TOPK_CHUNK) values into topk_chunk_bytes. */
static void topk_chunk_encode(const struct codec *c, const float *lv, const float *v, float *r, uint32_t len,
                              uint8_t *out) {
  uint32_t k = codec_topk_keep(c, len), L = (1u << c->bits) - 1, max_key = 0;
  uint32_t key[CODEC_TOPK_CHUNK], cand[CODEC_TOPK_CHUNK]; /* 32 KiB of stack */
  uint16_t idx[CODEC_TOPK_CHUNK];
  bool finite = true;
  for (uint32_t i = 0; i < len; i++) {
    key[i] = f32_bits(v[i]) & F32_ABS_MASK; /* orders finite values by |v| */
    if (key[i] >= F32_EXP_MASK) finite = false;
    if (key[i] > max_key) max_key = key[i];
  }
  /* A spoilt chunk (see codec.h) sends indices 0 .. k−1; so does a chunk
   * kept whole, whose cut keeps every key. */
  struct topk_cut cut = finite && k < len ? topk_select(key, len, k, cand) : (struct topk_cut){0, len};
  uint32_t m = 0;
  for (uint32_t i = 0; i < len && m < k; i++) {
    bool keep = !finite || key[i] > cut.thr;
    if (!keep && key[i] == cut.thr && cut.ties > 0) keep = true, cut.ties--;
    if (keep) idx[m++] = (uint16_t)i;
  }
  RUMOR_ASSERT(m == k);
  float s = finite ? f32_of_bits(max_key) : NAN;
  st_f32(out, s);
  struct bitw w = {out + 4, 0, 0};
  for (uint32_t j = 0; j < k; j++) bitw_put(&w, idx[j], CODEC_TOPK_INDEX_BITS);
  bitw_flush(&w);
  for (uint32_t j = 0; j < k; j++) {
    uint32_t u = finite ? topk_code(v[idx[j]], s, lv, L) : 0;
    bitw_put(&w, u, c->bits);
    if (r && finite) {
      float d = s * lv[u];
      r[idx[j]] = v[idx[j]] - d; /* the others keep r = v: not sent */
    }
  }
  bitw_flush(&w);
  if (!finite) keep_finite(r, len);
}

void codec_encode(const struct codec *c, const float *x, float *residual, uint64_t n, uint8_t *out) {
  RUMOR_ASSERT(codec_valid(c));
  float lv[TOPK_LEVELS_MAX];
  if (c->kind == CODEC_TOPK) topk_levels(c, lv);
  uint32_t block = block_values(c);
  for (uint64_t off = 0; off < n; off += block) {
    uint32_t len = n - off < block ? (uint32_t)(n - off) : block;
    const float *v = x + off;
    float *r = residual ? residual + off : NULL;
    if (r) {
      for (uint32_t i = 0; i < len; i++) r[i] += v[i]; /* r becomes v = x + r */
      v = r;
    }
    switch (c->kind) {
    case CODEC_NONE: none_block_encode(v, r, len, out); break;
    case CODEC_F16: f16_block_encode(v, r, len, out); break;
    case CODEC_I8: i8_block_encode(v, r, len, out); break;
    case CODEC_TOPK: topk_chunk_encode(c, lv, v, r, len, out); break;
    }
    out += codec_bytes(c, len);
  }
}

/* ---- decoding -------------------------------------------------------------------------
 * First every block is validated (the *_check functions, which report the
 * first fault), then every block is added: acc changes only for a stream
 * that is valid throughout. `name` is the codec's text, `blk` the block's
 * number and `off` the index of its first value, for messages. */

static int none_block_check(const uint8_t *in, uint32_t len, uint64_t off, const char *name, struct rumor_err *e) {
  for (uint32_t i = 0; i < len; i++) {
    float x = ld_f32(in + 4 * (size_t)i);
    if (!isfinite(x))
      return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: value %llu is %g, not finite", name,
                           (unsigned long long)(off + i), (double)x);
  }
  return 0;
}

static int f16_block_check(const uint8_t *in, uint32_t len, uint64_t off, const char *name, struct rumor_err *e) {
  for (uint32_t i = 0; i < len; i++) {
    uint16_t h = ld_u16(in + 2 * (size_t)i);
    if ((h & F16_EXP_MASK) == F16_EXP_MASK)
      return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: value %llu is an f16 %s (bits 0x%04x)", name,
                           (unsigned long long)(off + i), h & 0x3ffu ? "NaN" : "infinity", h);
  }
  return 0;
}

/* A scale is finite and >= 0; for i8 also 127·s is finite, so that every
 * code's value is. */
static int scale_check(float s, bool i8, uint64_t blk, const char *name, struct rumor_err *e) {
  if (isfinite(s) && s >= 0.0f && (!i8 || isfinite(127.0f * s))) return 0;
  return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: %s %llu has scale %g, not a finite number >= 0%s", name,
                       i8 ? "block" : "chunk", (unsigned long long)blk, (double)s,
                       i8 ? " whose 127 multiple is finite" : "");
}

static int i8_block_check(const uint8_t *in, uint32_t len, uint64_t blk, uint64_t off, const char *name,
                          struct rumor_err *e) {
  if (scale_check(ld_f32(in), true, blk, name, e)) return RUMOR_ECORRUPT;
  for (uint32_t i = 0; i < len; i++)
    if (in[4 + i] == 0x80) /* −128: the encoder clamps to ±127, and 128·s may overflow */
      return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: block %llu value %llu has code -128 (codes are -127..127)",
                           name, (unsigned long long)blk, (unsigned long long)(off + i));
  return 0;
}

/* Whether the padding bits of a stream of `bits` bits ending at byte `end`
 * (exclusive) are zero. */
static bool padding_zero(const uint8_t *end, uint64_t bits) {
  unsigned used = (unsigned)(bits % 8);
  return used == 0 || (end[-1] >> used) == 0;
}

static int topk_chunk_check(const struct codec *c, const uint8_t *in, uint32_t len, uint64_t blk, const char *name,
                            struct rumor_err *e) {
  if (scale_check(ld_f32(in), false, blk, name, e)) return RUMOR_ECORRUPT;
  uint32_t k = codec_topk_keep(c, len);
  struct bitr r = {in + 4, 0, 0};
  for (uint32_t j = 0, prev = 0; j < k; j++) {
    uint32_t i = bitr_get(&r, CODEC_TOPK_INDEX_BITS);
    if (i >= len)
      return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: chunk %llu index %u is %u, not below the chunk's %u values",
                           name, (unsigned long long)blk, j, i, len);
    if (j > 0 && i <= prev)
      return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: chunk %llu index %u is %u, not above the one before (%u)",
                           name, (unsigned long long)blk, j, i, prev);
    prev = i;
  }
  const uint8_t *idx_end = in + 4 + stream_bytes(k, CODEC_TOPK_INDEX_BITS);
  const uint8_t *val_end = idx_end + stream_bytes(k, (unsigned)c->bits);
  if (!padding_zero(idx_end, (uint64_t)k * CODEC_TOPK_INDEX_BITS) || !padding_zero(val_end, (uint64_t)k * c->bits))
    return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: chunk %llu has padding bits that are not zero", name,
                         (unsigned long long)blk);
  return 0;
}

static int block_check(const struct codec *c, const uint8_t *in, uint32_t len, uint64_t blk, uint64_t off,
                       const char *name, struct rumor_err *e) {
  switch (c->kind) {
  case CODEC_NONE: return none_block_check(in, len, off, name, e);
  case CODEC_F16: return f16_block_check(in, len, off, name, e);
  case CODEC_I8: return i8_block_check(in, len, blk, off, name, e);
  case CODEC_TOPK: return topk_chunk_check(c, in, len, blk, name, e);
  }
  return 0;
}

/* Adds w · value for one validated block of len values to acc[0..len). */
static void block_add(const struct codec *c, const float *lv, const uint8_t *in, uint32_t len, float w, float *acc) {
  switch (c->kind) {
  case CODEC_NONE:
    for (uint32_t i = 0; i < len; i++) acc[i] += w * ld_f32(in + 4 * (size_t)i);
    return;
  case CODEC_F16:
    for (uint32_t i = 0; i < len; i++) acc[i] += w * half_to_f32(ld_u16(in + 2 * (size_t)i));
    return;
  case CODEC_I8: {
    float s = ld_f32(in);
    for (uint32_t i = 0; i < len; i++) {
      float d = (float)(int8_t)in[4 + i] * s;
      acc[i] += w * d;
    }
    return;
  }
  case CODEC_TOPK: {
    float s = ld_f32(in);
    uint32_t k = codec_topk_keep(c, len);
    struct bitr ri = {in + 4, 0, 0}, rv = {in + 4 + stream_bytes(k, CODEC_TOPK_INDEX_BITS), 0, 0};
    for (uint32_t j = 0; j < k; j++) {
      uint32_t i = bitr_get(&ri, CODEC_TOPK_INDEX_BITS);
      float d = s * lv[bitr_get(&rv, c->bits)];
      acc[i] += w * d;
    }
    return;
  }
  }
}

int codec_decode_add(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n, float w, float *acc,
                     struct rumor_err *e) {
  RUMOR_ASSERT(codec_valid(c));
  char name[CODEC_TEXT_MAX];
  codec_format(c, name, sizeof name);
  uint64_t want = codec_bytes(c, n);
  if (want == UINT64_MAX || len != want)
    return rumor_err_set(e, RUMOR_ECORRUPT, "codec %s: %llu bytes, but %llu values take %llu", name,
                         (unsigned long long)len, (unsigned long long)n, (unsigned long long)want);
  uint32_t block = block_values(c);
  const uint8_t *p = in;
  for (uint64_t off = 0, blk = 0; off < n; off += block, blk++) {
    uint32_t bl = n - off < block ? (uint32_t)(n - off) : block;
    if (block_check(c, p, bl, blk, off, name, e)) return RUMOR_ECORRUPT;
    p += codec_bytes(c, bl);
  }
  float lv[TOPK_LEVELS_MAX];
  if (c->kind == CODEC_TOPK) topk_levels(c, lv);
  p = in;
  for (uint64_t off = 0; off < n; off += block) {
    uint32_t bl = n - off < block ? (uint32_t)(n - off) : block;
    block_add(c, lv, p, bl, w, acc + off);
    p += codec_bytes(c, bl);
  }
  return 0;
}
