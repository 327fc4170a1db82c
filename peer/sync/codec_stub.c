/* TEMP STUB until the codec branch lands. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "peer/sync/codec.h"
int codec_parse(const char *text, struct codec *out, struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  if (!strcmp(text, "none")) return 0;
  if (!strcmp(text, "f16")) { out->kind = CODEC_F16; return 0; }
  if (!strcmp(text, "i8")) { out->kind = CODEC_I8; return 0; }
  if (sscanf(text, "topk:%lf:%d", &out->fraction, &out->bits) == 2) { out->kind = CODEC_TOPK; return 0; }
  return rumor_err_set(e, RUMOR_EFORMAT, "bad codec '%s'", text);
}
void codec_format(const struct codec *c, char *buf, size_t n) {
  switch (c->kind) {
  case CODEC_NONE: snprintf(buf, n, "none"); break;
  case CODEC_F16: snprintf(buf, n, "f16"); break;
  case CODEC_I8: snprintf(buf, n, "i8"); break;
  case CODEC_TOPK: snprintf(buf, n, "topk:%g:%d", c->fraction, c->bits); break;
  }
}
uint32_t codec_topk_keep(const struct codec *c, uint32_t len) { (void)c; return len; }
uint64_t codec_bytes(const struct codec *c, uint64_t n) { (void)c; return 4 * n; }
void codec_encode(const struct codec *c, const float *x, float *residual, uint64_t n, uint8_t *out) {
  (void)c; for (uint64_t i = 0; i < n; i++) { float v = x[i] + (residual ? residual[i] : 0); memcpy(out + 4 * i, &v, 4); if (residual) residual[i] = 0; }
}
int codec_decode_add(const struct codec *c, const uint8_t *in, uint64_t len, uint64_t n, float w, float *acc, struct rumor_err *e) {
  (void)c, (void)e, (void)len; for (uint64_t i = 0; i < n; i++) { float v; memcpy(&v, in + 4 * i, 4); acc[i] += w * v; } return 0;
}
