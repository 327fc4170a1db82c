/*
 * json — a small, strict JSON reader and an appending JSON writer.
 *
 * The reader parses a bounded document (safetensors headers, config files)
 * into a tree allocated from one arena; it rejects depth above
 * JSON_MAX_DEPTH, invalid UTF-8 escapes, trailing bytes and duplicate
 * handling is left to the caller (json_get returns the first match). It never
 * reads past `len` and never asserts on input.
 *
 * The writer appends to a growable buffer; it escapes strings and formats
 * floats so that they round-trip (%.9g).
 */
#ifndef RUMOR_JSON_H
#define RUMOR_JSON_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

#define JSON_MAX_DEPTH 32

enum json_type { JSON_NULL, JSON_BOOL, JSON_NUMBER, JSON_STRING, JSON_ARRAY, JSON_OBJECT };

struct json_value {
  enum json_type type;
  bool boolean;
  double number;
  bool is_integer;   /* the literal had no fraction or exponent */
  int64_t integer;   /* exact value when is_integer and it fits */
  char *string;      /* NUL-terminated, for JSON_STRING */
  size_t len;        /* string length, or element count for arrays/objects */
  char **keys;       /* JSON_OBJECT: len keys */
  struct json_value *items; /* JSON_ARRAY / JSON_OBJECT: len values */
};

struct json_doc {
  struct json_value root;
  void *arena; /* owns every allocation of the tree */
};

/* Parses text[0..len). Returns 0, or RUMOR_EFORMAT with the byte offset and
 * reason in `e`. On failure `doc` holds nothing to free. */
int json_parse(const char *text, size_t len, struct json_doc *doc, struct rumor_err *e) RUMOR_MUST_CHECK;
void json_doc_free(struct json_doc *doc);

/* The value of `key` in an object, or NULL (also when `obj` is not an object). */
const struct json_value *json_get(const struct json_value *obj, const char *key);

/* ---- writer ---- */
struct json_buf {
  char *data;
  size_t len, cap;
  bool need_comma; /* a value was written at the current nesting level */
};
void json_buf_init(struct json_buf *b);
void json_buf_free(struct json_buf *b);
void json_obj_begin(struct json_buf *b);
void json_obj_end(struct json_buf *b);
void json_arr_begin(struct json_buf *b);
void json_arr_end(struct json_buf *b);
/* Writes `"key":` inside an object; the next value call completes the pair. */
void json_key(struct json_buf *b, const char *key);
void json_str(struct json_buf *b, const char *s);
void json_num(struct json_buf *b, double v); /* non-finite values become null */
void json_int(struct json_buf *b, int64_t v);
void json_bool(struct json_buf *b, bool v);
void json_null(struct json_buf *b);
/* Appends raw, already valid JSON text. */
void json_raw(struct json_buf *b, const char *s, size_t n);

#endif /* RUMOR_JSON_H */
