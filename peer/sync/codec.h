/* Placeholder until the codec branch lands (same API). */
#ifndef RUMOR_PEER_SYNC_CODEC_H
#define RUMOR_PEER_SYNC_CODEC_H
#include <stddef.h>
#include <stdint.h>
#include "util/util.h"
enum codec_kind { CODEC_NONE = 0, CODEC_F16 = 1, CODEC_I8 = 2, CODEC_TOPK = 3 };
struct codec {
  enum codec_kind kind;
  double fraction;
  int bits;
};
#define CODEC_TOPK_CHUNK 4096
#define CODEC_TEXT_MAX 32
int codec_parse(const char *text, struct codec *out, struct rumor_err *e) RUMOR_MUST_CHECK;
void codec_format(const struct codec *c, char *buf, size_t n);
uint32_t codec_topk_keep(const struct codec *c, uint32_t len);
uint64_t codec_bytes(const struct codec *c, uint64_t n);
void codec_encode(const struct codec *c, const float *x, float *residual, uint64_t n, uint8_t *out);
int codec_decode_add(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n, float w, float *acc,
                     struct rumor_err *e) RUMOR_MUST_CHECK;
#endif
