/*
 * Fuzz harness: util's JSON reader and writer (util/json_text.h, over
 * jansson). Any input must be either refused with RUMOR_EFORMAT (or -ENOMEM)
 * and a message saying where, or parsed into a tree that keeps json_text.h's
 * promises, checked on every node: depth at most JSON_PARSER_MAX_DEPTH,
 * strings and keys without NUL (their length is their strlen), each key of an
 * object once, no non-finite real. The accepted tree is then written with
 * rumor's flags and read back, and writing that again gives the same text
 * (the 9-digit reals are stable after one trip). A broken promise aborts;
 * nothing may crash, leak or read outside the input.
 *
 * jansson itself is Debian's build, not instrumented here: OSS-Fuzz fuzzes
 * it upstream (projects/jansson); this harness checks rumor's use of it.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "util/json_text.h"

static volatile size_t g_sink;

static void walk(json_t *v, int depth) {
  if (depth > JSON_PARSER_MAX_DEPTH) abort();
  switch (json_typeof(v)) {
  case JSON_NULL:
  case JSON_TRUE:
  case JSON_FALSE:
    break;
  case JSON_INTEGER:
    g_sink += (size_t)json_integer_value(v);
    break;
  case JSON_REAL:
    if (!isfinite(json_real_value(v))) abort(); /* no literal reads as NaN or infinity */
    break;
  case JSON_STRING:
    if (strlen(json_string_value(v)) != json_string_length(v)) abort(); /* "\u0000" is refused */
    break;
  case JSON_ARRAY:
    for (size_t i = 0; i < json_array_size(v); i++) walk(json_array_get(v, i), depth + 1);
    break;
  case JSON_OBJECT: {
    const char *key;
    json_t *item;
    size_t n = 0;
    json_object_foreach(v, key, item) {
      g_sink += strlen(key);
      if (json_object_get(v, key) != item) abort(); /* each key once: the one found is the one iterated */
      walk(item, depth + 1);
      n++;
    }
    if (n != json_object_size(v)) abort();
    break;
  }
  default:
    abort();
  }
}

/* Writes, reads back and writes again: the two texts must match. */
static void round_trip(const json_t *doc) {
  size_t len1, len2;
  char *t1 = json_text_dump(doc, &len1);
  json_t *back;
  struct rumor_err e = {0};
  if (json_text_parse(t1, len1, &back, &e) != 0) {
    fprintf(stderr, "rumor's own text does not read back: %s\n", e.msg);
    abort();
  }
  char *t2 = json_text_dump(back, &len2);
  if (len1 != len2 || memcmp(t1, t2, len1) != 0) abort();
  free(t2);
  json_decref(back);
  free(t1);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* An exact-size copy, not NUL-terminated: a read past `len` is a bug. */
  char *text = malloc(size ? size : 1);
  if (!text) abort();
  if (size) memcpy(text, data, size);
  json_t *doc;
  struct rumor_err e = {0};
  int rc = json_text_parse(text, size, &doc, &e);
  if (getenv("RUMOR_FUZZ_VERBOSE")) fprintf(stderr, "%s\n", rc ? e.msg : "accepted"); /* what became of it */
  if (rc == 0) {
    if (!json_is_object(doc) && !json_is_array(doc)) abort(); /* the top level is a container */
    walk(doc, 0);
    round_trip(doc);
    json_decref(doc);
  } else if (doc || e.msg[0] == '\0' || (rc == RUMOR_EFORMAT ? !strstr(e.msg, "at byte") : rc != -ENOMEM)) {
    abort(); /* bad input is a format error, and says where */
  }
  free(text);
  return 0;
}
