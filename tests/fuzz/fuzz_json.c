/*
 * Fuzz harness: util's JSON reader. Any input must be either refused with
 * RUMOR_EFORMAT and a message, or parsed into a tree that keeps json.h's
 * promises, checked on every node: depth at most JSON_MAX_DEPTH, strings and
 * keys NUL-terminated at their length (the reader refuses NUL), integers
 * exact, json_get finding the first of equal keys. A broken promise aborts;
 * nothing may crash, leak or read outside the input.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "util/json.h"

#define GET_CHECKS 16 /* keys per object looked up again with json_get */

static volatile size_t g_sink;

static void walk(const struct json_value *v, int depth) {
  if (depth > JSON_MAX_DEPTH) abort();
  switch (v->type) {
  case JSON_NULL:
    break;
  case JSON_BOOL:
    g_sink += v->boolean;
    break;
  case JSON_NUMBER:
    /* The integer and the double come from the same literal. */
    if (v->is_integer && (double)v->integer != v->number) abort();
    if (v->number != v->number) abort(); /* no literal reads as NaN */
    break;
  case JSON_STRING:
    if (!v->string || strlen(v->string) != v->len) abort();
    break;
  case JSON_ARRAY:
    if (v->len && !v->items) abort();
    for (size_t i = 0; i < v->len; i++) walk(&v->items[i], depth + 1);
    break;
  case JSON_OBJECT:
    if (v->len && (!v->items || !v->keys)) abort();
    for (size_t i = 0; i < v->len; i++) {
      if (!v->keys[i]) abort();
      g_sink += strlen(v->keys[i]);
      if (i < GET_CHECKS) { /* json_get is a linear search: all keys would make big objects quadratic */
        const struct json_value *first = json_get(v, v->keys[i]);
        if (!first || first < v->items || first > &v->items[i]) abort();
        if (strcmp(v->keys[first - v->items], v->keys[i]) != 0) abort();
      }
      walk(&v->items[i], depth + 1);
    }
    break;
  default:
    abort();
  }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* An exact-size copy, not NUL-terminated: a read past `len` is a bug. */
  char *text = malloc(size ? size : 1);
  if (!text) abort();
  if (size) memcpy(text, data, size);
  struct json_doc doc;
  struct rumor_err e = {0};
  int rc = json_parse(text, size, &doc, &e);
  if (getenv("RUMOR_FUZZ_VERBOSE")) fprintf(stderr, "%s\n", rc ? e.msg : "accepted"); /* what became of it */
  if (rc == 0) {
    walk(&doc.root, 0);
    if (json_get(&doc.root, "") && doc.root.type != JSON_OBJECT) abort();
    json_doc_free(&doc);
  } else if ((rc != RUMOR_EFORMAT && rc != -ENOMEM) || e.msg[0] == '\0') {
    abort(); /* bad input is a format error, and says where */
  }
  free(text);
  return 0;
}
