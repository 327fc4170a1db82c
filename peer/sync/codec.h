/*
 * codec — compressed pseudo-gradients for --outer-compress: a vector of n
 * float32 values encoded as none (float32), f16, i8 (blockwise 8-bit) or
 * top-k (the largest entries of each chunk, quantised to 2, 4 or 8 bits),
 * with optional error feedback, and a decoder for untrusted bytes that adds
 * the decoded values into an accumulator.
 *
 * Wire formats. All multi-byte numbers are little-endian; a "bit stream"
 * puts field j of width W at stream bits [j·W, (j+1)·W), stream bit b being
 * bit (b mod 8) of byte ⌊b/8⌋ (least significant bit first), and ends at a
 * byte boundary with zero padding bits. The size is a pure function of the
 * codec and n (codec_bytes), so it is never sent.
 *
 *   none  n float32 values.
 *   f16   n IEEE binary16 values, rounded to nearest even, except that a
 *         finite value beyond the binary16 range is sent as ±65504 (the
 *         largest finite half) rather than ±Inf; non-finite inputs are sent
 *         as they are (Inf, or a quiet NaN).
 *   i8    per block of CODEC_I8_BLOCK values (the last block shorter): a
 *         float32 scale s = absmax / 127 (lowered by one ulp where 127·s
 *         would overflow), then one int8 q per value, q = x / s rounded to
 *         nearest even and clamped to [−127, 127]; the value is q·s, within
 *         absmax/254 of x plus the roundings of s and q·s (a few 2^-24 of
 *         absmax). A block whose absmax is below 127·FLT_MIN is sent as
 *         s = 0 and q = 0. A block holding a NaN or an infinity is sent with
 *         s = NaN and q = 0, which every decoder refuses.
 *   topk  per chunk of CODEC_TOPK_CHUNK values (the last chunk shorter, len
 *         values), k = codec_topk_keep(c, len) kept entries: those of
 *         largest |v|, ties to the lower index. A float32 scale s = the
 *         largest |v| of the chunk; then the k indices (each < len, strictly
 *         increasing) as a bit stream of 12-bit fields; then the k values as
 *         a bit stream of `bits`-bit codes u in [0, L], L = 2^bits − 1, the
 *         value being s · ((2u − L) / L), the fraction rounded to float
 *         before the product: 2^bits levels from −s to s, symmetric about 0
 *         and without it, as kept entries are the large ones. Each kept
 *         value is sent as its nearest level (within s/L, plus a few 2^-24
 *         of s for the roundings). Entries not kept decode as 0. A chunk
 *         holding a NaN or an infinity is sent with s = NaN, indices
 *         0 .. k−1 and codes 0, which every decoder refuses.
 *
 * Error feedback: with a residual r, the encoder encodes v = x + r and
 * leaves r = v − decode(v), computed in float with the decoder's own
 * arithmetic, so what a round could not send is added to the next. A
 * non-finite v leaves r = 0 (one bad round is dropped instead of poisoning
 * every later one); the other entries of an i8 block or top-k chunk that a
 * non-finite value spoilt keep r = v, as nothing of them was sent. (Any
 * non-finite input makes the stream one that receivers refuse whole: a
 * caller checks its vector is finite before it sends.)
 *
 * Threads: every function is pure over its arguments (no global state);
 * calls on disjoint buffers may run concurrently.
 */
#ifndef RUMOR_PEER_SYNC_CODEC_H
#define RUMOR_PEER_SYNC_CODEC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

enum codec_kind { CODEC_NONE = 0, CODEC_F16 = 1, CODEC_I8 = 2, CODEC_TOPK = 3 };

struct codec {
  enum codec_kind kind;
  double fraction; /* CODEC_TOPK: F in (0, 1], the fraction of each chunk kept */
  int bits;        /* CODEC_TOPK: 2, 4 or 8 bits per kept value */
};

#define CODEC_I8_BLOCK 128     /* values per i8 block, as net's NET_I8_BLOCK */
#define CODEC_TOPK_CHUNK 4096  /* values per top-k chunk (the last may be shorter) */
#define CODEC_TOPK_INDEX_BITS 12 /* bits per top-k index: every index of a chunk fits */
_Static_assert(CODEC_TOPK_CHUNK <= 1 << CODEC_TOPK_INDEX_BITS, "top-k indices must fit their field");
#define CODEC_TEXT_MAX 32 /* a buffer that holds any codec_format text and its NUL */

/* Whether `c` is a codec the functions below accept: a known kind and, for
 * CODEC_TOPK, F in (0, 1] and bits 2, 4 or 8. Encoding or decoding with an
 * invalid codec is a bug of the caller and panics. */
bool codec_valid(const struct codec *c);

/* Parses "none", "f16", "i8" or "topk:F:BITS" (F a decimal number in
 * (0, 1] such as 0.03, .5 or 1e-3 — no sign, hexadecimal, nan or inf — and
 * BITS 2, 4 or 8). Returns 0 with *out set, or RUMOR_EFORMAT with a message
 * quoting the text and saying what is allowed (*out untouched). */
int codec_parse(const char *text, struct codec *out, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Writes the canonical text of `c` into buf (n bytes, truncated if short;
 * CODEC_TEXT_MAX always suffices): what codec_parse reads back to the same
 * codec, with F in the fewest digits that give back the same double, e.g.
 * "topk:0.03:2". An invalid codec writes "invalid". */
void codec_format(const struct codec *c, char *buf, size_t n);

/* Entries kept of a top-k chunk of `len` values: ⌈F·len⌉, with a relative
 * tolerance of 1e-12 for the rounding of F·len (0.03·100 is 3, not 4), at
 * least 1 and at most len (0 when len is 0). */
uint32_t codec_topk_keep(const struct codec *c, uint32_t len);

/* Encoded size in bytes of n values: a pure function of (c, n), so every
 * member of a cluster computes the same. none: 4n; f16: 2n; i8: n + 4 per
 * block; topk: per chunk 4 + ⌈12k/8⌉ + ⌈bits·k/8⌉. UINT64_MAX on overflow or
 * for an invalid codec. */
uint64_t codec_bytes(const struct codec *c, uint64_t n);

/* Encodes x[0..n) into out[0 .. codec_bytes(c, n)). `residual` is NULL or n
 * floats of error feedback (see above), read and updated. Deterministic: the
 * same codec, x and residual give the same bytes and residual. x and
 * residual must not overlap each other or out. */
void codec_encode(const struct codec *c, const float *x, float *residual, uint64_t n, uint8_t *out);

/* Decodes `in` (len bytes, untrusted: off the network) as n values and adds
 * w · value to acc[0..n). Everything is validated before anything is added:
 * len == codec_bytes(c, n); every scale finite and >= 0 (and, for i8, 127·s
 * finite); no i8 code −128; every top-k index below its chunk's length and
 * strictly increasing within the chunk; zero padding bits; every none or f16
 * value finite. So every decoded value is finite; w and acc are the
 * caller's. Returns 0, or RUMOR_ECORRUPT with a message naming the codec and
 * the fault (which block, chunk, index or value), and then acc is unchanged.
 * Never reads outside in[0..len). */
int codec_decode_add(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n, float w, float *acc,
                     struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_SYNC_CODEC_H */
