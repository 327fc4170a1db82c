/* JSON through jansson with rumor's policy (json_text.h). */
#include "json_text.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int json_text_parse(const char *text, size_t len, json_t **out, struct rumor_err *e) {
  json_error_t je;
  /* JSON_REJECT_DUPLICATES: every object, at any depth. Without
   * JSON_DECODE_ANY the top level is an object or an array; without
   * JSON_ALLOW_NUL "\u0000" is refused. */
  *out = json_loadb(text, len, JSON_REJECT_DUPLICATES, &je);
  if (*out) return 0;
  if (json_error_code(&je) == json_error_out_of_memory)
    return rumor_err_set(e, -ENOMEM, "out of memory reading JSON (%zu bytes)", len);
  return rumor_err_set(e, RUMOR_EFORMAT, "invalid JSON at byte %d (line %d, column %d): %s", je.position, je.line,
                       je.column, je.text);
}

/* The dump flags of json_text_dump_times: 15 digits print any decimal of at
 * most 15 significant digits exactly as it was rounded to (a double holds
 * 15 exactly), and no more digits than it has. Not for parsed documents: a
 * real near DBL_MAX would round up past it and not read back. */
#define JSON_TEXT_TIME_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(15))

json_t *json_text_real(double v) {
  json_t *j;
  if (isfinite(v)) {
    char t[32];
    snprintf(t, sizeof t, "%.9g", v);
    j = json_real(strtod(t, NULL));
  } else {
    j = json_null();
  }
  if (!j) rumor_panic(__FILE__, __LINE__, "out of memory building JSON");
  return j;
}

json_t *json_text_time(double unix_s) {
  /* k / 1000 with k an exact integer is the double nearest the decimal
   * with 3 places, which 15 digits print back exactly until the year 33658. */
  double ms = unix_s * 1000; /* may overflow to Inf for absurd times: null then */
  json_t *j = isfinite(ms) ? json_real(round(ms) / 1000) : json_null();
  if (!j) rumor_panic(__FILE__, __LINE__, "out of memory building JSON");
  return j;
}

/* The length of the valid UTF-8 sequence at s (1 to 4), or 0 when the bytes
 * there are not one (a stray continuation byte, a cut or overlong sequence, a
 * surrogate, a code point above U+10FFFF). Reads no byte past a NUL. */
static size_t utf8_len(const unsigned char *s) {
  unsigned c = s[0];
  size_t n;
  uint32_t cp;
  if (c < 0x80) return 1;
  if (c >= 0xc2 && c <= 0xdf) n = 2, cp = c & 0x1f;
  else if (c >= 0xe0 && c <= 0xef) n = 3, cp = c & 0x0f;
  else if (c >= 0xf0 && c <= 0xf4) n = 4, cp = c & 0x07;
  else return 0;
  for (size_t i = 1; i < n; i++) {
    if ((s[i] & 0xc0) != 0x80) return 0;
    cp = cp << 6 | (s[i] & 0x3f);
  }
  if ((n == 3 && cp < 0x800) || (n == 4 && (cp < 0x10000 || cp > 0x10ffff)) || (cp >= 0xd800 && cp <= 0xdfff))
    return 0;
  return n;
}

json_t *json_text_str(const char *s) {
  json_t *j = json_string(s);
  if (!j) {
    /* Not UTF-8 (or out of memory, which the second try reports). */
    char *fixed = xstrdup(s);
    for (unsigned char *p = (unsigned char *)fixed; *p;) {
      size_t n = utf8_len(p);
      if (n == 0) *p++ = '?';
      else p += n;
    }
    j = json_string(fixed);
    free(fixed);
    if (!j) rumor_panic(__FILE__, __LINE__, "out of memory building JSON");
  }
  return j;
}

void json_text_set(json_t *obj, const char *key, json_t *v) {
  if (!v || json_object_set_new(obj, key, v) != 0)
    rumor_panic(__FILE__, __LINE__, "cannot set JSON key '%s' (out of memory, or not UTF-8)", key);
}

void json_text_push(json_t *arr, json_t *v) {
  if (!v || json_array_append_new(arr, v) != 0) rumor_panic(__FILE__, __LINE__, "out of memory building JSON");
}

char *json_text_dump(const json_t *v, size_t *len) {
  char *s = json_dumps(v, JSON_TEXT_FLAGS);
  if (!s) rumor_panic(__FILE__, __LINE__, "out of memory writing JSON");
  if (len) *len = strlen(s);
  return s;
}

char *json_text_dump_times(const json_t *v, size_t *len) {
  char *s = json_dumps(v, JSON_TEXT_TIME_FLAGS);
  if (!s) rumor_panic(__FILE__, __LINE__, "out of memory writing JSON");
  if (len) *len = strlen(s);
  return s;
}

void json_text_print(FILE *f, json_t *v) {
  char *s = json_text_dump(v, NULL);
  fprintf(f, "%s\n", s);
  fflush(f);
  free(s);
  json_decref(v);
}
