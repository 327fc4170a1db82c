/*
 * json_text — JSON in and out through jansson (https://jansson.readthedocs.io,
 * Debian's libjansson), with rumor's policy in one place.
 *
 * Reading. json_text_parse takes a byte range (never NUL-terminated text; it
 * reads nothing past `len`) and refuses duplicate keys (readers disagree on
 * which copy counts), "\u0000" in strings and keys (C strings could not hold
 * it), invalid UTF-8, anything after the value, and nesting deeper than
 * jansson's build-time JSON_PARSER_MAX_DEPTH (2048, which bounds its
 * recursion). Integers must fit json_int_t (int64); larger ones are refused,
 * not rounded. The caller caps the size before reading (a safetensors header,
 * a config file, one result line) and checks the type and range of every
 * value it uses: the parser checks syntax only.
 *
 * Writing. Values are built with jansson's constructors (json_object,
 * json_integer, json_true, ...) and the helpers below, which never return
 * NULL and never drop a key: jansson's rare failures (out of memory, a key
 * that is not UTF-8) abort with the call site, as xmalloc does. Text comes
 * out compact ("key":value, no spaces, which scripts match with sed), keys
 * in insertion order, reals with 9 significant digits (enough for a float)
 * and always a '.' or an exponent, so that 4.0 reads back as a real. A unix
 * time needs more digits than that: a document holding times made by
 * json_text_time is written with json_text_dump_times.
 *
 * Any thread; values are not shared between threads.
 */
#ifndef RUMOR_JSON_TEXT_H
#define RUMOR_JSON_TEXT_H

#include <jansson.h>
#include <stddef.h>
#include <stdio.h>

#include "util/util.h"

/* The dump flags of every JSON rumor writes. */
#define JSON_TEXT_FLAGS (JSON_COMPACT | JSON_REAL_PRECISION(9))

/* Parses text[0..len) into *out (the caller json_decref's it). Returns 0, or
 * RUMOR_EFORMAT ("invalid JSON at byte B (line L, column C): why") or -ENOMEM
 * with the message in `e` (which may be NULL); *out is then NULL. */
int json_text_parse(const char *text, size_t len, json_t **out, struct rumor_err *e) RUMOR_MUST_CHECK;

/* A real, or null when v is NaN or infinite (JSON cannot spell them). The
 * value is v rounded to 9 significant digits, the text JSON_TEXT_FLAGS
 * prints for it (so it prints the same with json_text_dump_times). */
json_t *json_text_real(double v);
/* A unix time in seconds as a real rounded to the millisecond, or null when
 * not finite. JSON_TEXT_FLAGS' 9 digits would print it to the nearest 100 s:
 * write a document that holds one with json_text_dump_times. */
json_t *json_text_time(double unix_s);
/* A string holding s, with each byte of an invalid UTF-8 sequence replaced
 * by '?' (a message cut in the middle of a character, a file name in another
 * encoding) rather than refused. */
json_t *json_text_str(const char *s);
/* Sets obj[key] = v, taking the reference to v. */
void json_text_set(json_t *obj, const char *key, json_t *v);
/* Appends v to arr, taking the reference to v. */
void json_text_push(json_t *arr, json_t *v);

/* The compact text of v, NUL-terminated, malloc'd (free it); its length in
 * *len when len is not NULL. */
char *json_text_dump(const json_t *v, size_t *len);
/* As json_text_dump, for a document whose reals were all made by
 * json_text_real and json_text_time (built, not parsed): it prints reals with
 * 15 significant digits, which shows each one as the short decimal it was
 * rounded to: a time to the millisecond, any other real as json_text_dump
 * would. */
char *json_text_dump_times(const json_t *v, size_t *len);
/* Prints v as one line on f, flushes f, and releases v (json_decref). */
void json_text_print(FILE *f, json_t *v);

#endif /* RUMOR_JSON_TEXT_H */
