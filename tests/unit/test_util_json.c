/* util/json_text.h: JSON through jansson with rumor's policy. The reader
 * refuses what readers could disagree on (duplicate keys at any depth, NUL,
 * invalid UTF-8, integers that would round) and says where; the writer keeps
 * key order, writes compact text with 9-digit reals (unix times to the
 * millisecond), null for non-finite numbers, and repairs rather than drops strings that are not UTF-8; the
 * --log-json lines it builds read back. */
#include <criterion/criterion.h>
#include <fcntl.h>
#include <limits.h>
#include <float.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "util/json_text.h"
#include "util/util.h"

/* Parses a NUL-terminated literal; returns the result code. */
static int parse(const char *text, json_t **out, struct rumor_err *e) {
  return json_text_parse(text, strlen(text), out, e);
}

Test(json_text, parses_nested_documents_and_escapes) {
  const char *text = "{\"a\": [1, -2.5e3, true, null], \"s\": \"x\\u00e9\\n\\\"q\\\"\\ud83d\\ude00\", \"o\": {}}";
  json_t *d;
  struct rumor_err e;
  cr_assert_eq(parse(text, &d, &e), 0, "%s", e.msg);
  const json_t *a = json_object_get(d, "a");
  cr_assert(json_is_array(a) && json_array_size(a) == 4);
  cr_assert(json_is_integer(json_array_get(a, 0)) && json_integer_value(json_array_get(a, 0)) == 1);
  cr_assert(json_is_real(json_array_get(a, 1)) && json_real_value(json_array_get(a, 1)) == -2500.0);
  cr_assert(json_is_true(json_array_get(a, 2)) && json_is_null(json_array_get(a, 3)));
  cr_assert_str_eq(json_string_value(json_object_get(d, "s")), "x\xc3\xa9\n\"q\"\xf0\x9f\x98\x80");
  cr_assert(json_is_object(json_object_get(d, "o")));
  cr_assert_null(json_object_get(d, "missing"));
  json_decref(d);
}

Test(json_text, malformed_input_is_refused_with_byte_line_and_column) {
  const char *bad[] = {"",         "{",          "[1,]",     "{\"a\" 1}", "[\"abc", "[01]",       "[1.]",
                       "[-]",      "[tru]",      "[1] x",    "[\"\\ud800\"]", "[\"\\x\"]", "{\"a\":\"\x01\"}", "[nul]",
                       "\"top-level string\"", "42"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    json_t *d = (json_t *)1;
    struct rumor_err e = {0};
    cr_assert_eq(parse(bad[i], &d, &e), RUMOR_EFORMAT, "'%s' accepted", bad[i]);
    cr_assert_null(d);
    cr_assert(strstr(e.msg, "at byte") && strstr(e.msg, "line") && strstr(e.msg, "column"), "%s", e.msg);
  }
}

Test(json_text, duplicate_keys_are_refused_at_any_depth) {
  const char *dup[] = {"{\"a\":1,\"a\":2}", "{\"o\":{\"k\":\"x\",\"k\":\"x\"}}",
                       "[{\"x\":1},{\"y\":[{\"z\":1,\"z\":1}]}]",
                       /* the same key spelt with an escape */
                       "{\"rumor.step\":\"1\",\"rumor\\u002estep\":\"9\"}"};
  for (size_t i = 0; i < sizeof dup / sizeof dup[0]; i++) {
    json_t *d;
    struct rumor_err e = {0};
    cr_assert_eq(parse(dup[i], &d, &e), RUMOR_EFORMAT, "'%s' accepted", dup[i]);
    cr_assert(strstr(e.msg, "duplicate"), "%s", e.msg);
  }
  json_t *d;
  struct rumor_err e;
  cr_assert_eq(parse("{\"a\":{\"k\":1},\"b\":{\"k\":1}}", &d, &e), 0, "%s", e.msg); /* equal keys, other objects */
  json_decref(d);
}

Test(json_text, nul_and_invalid_utf8_are_refused) {
  const char *bad[] = {"[\"a\\u0000b\"]", "{\"a\\u0000\":1}", "[\"\xff\"]", "[\"\xc0\xaf\"]", "[\"\xed\xa0\x80\"]",
                       "{\"\xe2\x82\":1}"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    json_t *d;
    struct rumor_err e = {0};
    cr_assert_eq(parse(bad[i], &d, &e), RUMOR_EFORMAT, "input %zu accepted", i);
  }
}

Test(json_text, integers_beyond_int64_are_refused_not_rounded) {
  json_t *d;
  struct rumor_err e;
  cr_assert_eq(parse("[9223372036854775807,-9223372036854775808]", &d, &e), 0, "%s", e.msg);
  cr_assert_eq(json_integer_value(json_array_get(d, 0)), INT64_MAX);
  cr_assert_eq(json_integer_value(json_array_get(d, 1)), INT64_MIN);
  json_decref(d);
  cr_assert_eq(parse("[9223372036854775808]", &d, &e), RUMOR_EFORMAT);
  cr_assert_eq(parse("[-9223372036854775809]", &d, &e), RUMOR_EFORMAT);
}

Test(json_text, nesting_is_bounded_by_janssons_limit) {
  size_t deep = JSON_PARSER_MAX_DEPTH + 1, ok = 100;
  char *text = malloc(2 * deep);
  cr_assert_not_null(text);
  memset(text, '[', deep);
  memset(text + deep, ']', deep);
  json_t *d;
  struct rumor_err e = {0};
  cr_assert_eq(json_text_parse(text, 2 * deep, &d, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "depth"), "%s", e.msg);
  memset(text + ok, ']', ok);
  cr_assert_eq(json_text_parse(text, 2 * ok, &d, &e), 0, "%s", e.msg);
  json_decref(d);
  free(text);
}

Test(json_text, reads_nothing_past_len) {
  /* An exact-size heap copy, not NUL-terminated (AddressSanitizer would see
   * a read past it). */
  const char src[] = "{\"a\":1}";
  char *text = malloc(sizeof src - 1);
  cr_assert_not_null(text);
  memcpy(text, src, sizeof src - 1);
  json_t *d;
  struct rumor_err e;
  cr_assert_eq(json_text_parse(text, sizeof src - 1, &d, &e), 0, "%s", e.msg);
  json_decref(d);
  cr_assert_eq(json_text_parse(text, 5, &d, &e), RUMOR_EFORMAT); /* {"a": */
  cr_assert_eq(json_text_parse("[1]garbage", 3, &d, &e), 0, "%s", e.msg);
  json_decref(d);
  free(text);
}

Test(json_text, writes_compact_text_in_insertion_order_with_nine_digit_reals) {
  json_t *o = json_object(), *arr = json_array();
  json_text_set(o, "z", json_text_real(0.1f));
  json_text_set(o, "a", json_text_real(4.0));
  json_text_set(o, "m", json_text_real(1e-5));
  json_text_set(o, "nan", json_text_real(NAN));
  json_text_set(o, "inf", json_text_real(-INFINITY));
  json_text_set(o, "i", json_integer(-42));
  json_text_push(arr, json_true());
  json_text_push(arr, json_text_str("tab\there \"q\""));
  json_text_set(o, "arr", arr);
  json_text_set(o, "z", json_integer(7)); /* replaced in place */
  size_t len;
  char *text = json_text_dump(o, &len);
  cr_assert_str_eq(text, "{\"z\":7,\"a\":4.0,\"m\":1e-5,\"nan\":null,\"inf\":null,\"i\":-42,"
                         "\"arr\":[true,\"tab\\there \\\"q\\\"\"]}");
  cr_assert_eq(len, strlen(text));
  free(text);
  /* A float survives the 9 digits exactly. */
  json_t *r = json_object();
  json_text_set(r, "x", json_text_real(0.1f));
  text = json_text_dump(r, NULL);
  cr_assert_str_eq(text, "{\"x\":0.100000001}");
  json_t *back;
  struct rumor_err e;
  cr_assert_eq(parse(text, &back, &e), 0, "%s", e.msg);
  cr_assert_eq((float)json_real_value(json_object_get(back, "x")), 0.1f);
  json_decref(back);
  free(text);
  json_decref(r);
  json_decref(o);
}

/* A unix time keeps its milliseconds (9 digits would print it to 100 s),
 * and the other reals of the same document print as json_text_dump would. */
Test(json_text, times_keep_milliseconds_and_other_reals_keep_nine_digits) {
  json_t *o = json_object(), *arr = json_array();
  json_text_set(o, "time", json_text_time(1712345678.1234));
  json_text_push(arr, json_text_time(1712345678.0));
  json_text_push(arr, json_text_time(1712345678.9996)); /* rounds up a second */
  json_text_push(arr, json_text_time(NAN));
  json_text_set(o, "t", arr);
  json_text_set(o, "x", json_text_real(0.1f));
  json_text_set(o, "third", json_text_real(1.0 / 3));
  json_text_set(o, "big", json_text_real(DBL_MAX));
  json_text_set(o, "small", json_text_real(-1e-5));
  json_text_set(o, "n", json_integer(3));
  const char *want = "{\"time\":1712345678.123,\"t\":[1712345678.0,1712345679.0,null],\"x\":0.100000001,"
                     "\"third\":0.333333333,\"big\":1.79769313e308,\"small\":-1e-5,\"n\":3}";
  size_t len;
  char *text = json_text_dump_times(o, &len);
  cr_assert_str_eq(text, want);
  cr_assert_eq(len, strlen(text));
  /* Every value reads back as a real (the time to the millisecond), and the
   * text is stable: written again, it is the same. */
  json_t *back;
  struct rumor_err e;
  cr_assert_eq(parse(text, &back, &e), 0, "%s", e.msg);
  cr_assert(json_is_real(json_object_get(back, "time")));
  cr_assert_eq(json_real_value(json_object_get(back, "time")), 1712345678.123);
  char *again = json_text_dump_times(back, NULL);
  cr_assert_str_eq(again, text);
  free(again);
  json_decref(back);
  free(text);
  /* Without _times the reals other than times are the same text. */
  json_object_del(o, "time");
  json_object_del(o, "t");
  text = json_text_dump(o, NULL);
  cr_assert_str_eq(text, "{\"x\":0.100000001,\"third\":0.333333333,\"big\":1.79769313e308,\"small\":-1e-5,\"n\":3}");
  free(text);
  json_decref(o);
}

Test(json_text, strings_that_are_not_utf8_are_repaired_not_dropped) {
  const struct {
    const char *in, *out;
  } cases[] = {
      {"plain", "plain"},
      {"caf\xc3\xa9 \xce\x9e", "caf\xc3\xa9 \xce\x9e"},     /* valid UTF-8 stays */
      {"cut \xe2\x82", "cut ??"},                           /* a character cut by %.360s */
      {"latin1 caf\xe9!", "latin1 caf?!"},                  /* another encoding */
      {"\xc0\xaf overlong, \xed\xa0\x80 surrogate", "?? overlong, ??? surrogate"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    json_t *s = json_text_str(cases[i].in);
    cr_assert_str_eq(json_string_value(s), cases[i].out);
    json_decref(s);
  }
}

Test(json_text, log_json_lines_read_back) {
  char path[] = "/tmp/rumor-test-log-XXXXXX";
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  int saved = dup(STDERR_FILENO);
  cr_assert_geq(saved, 0);
  cr_assert_geq(dup2(fd, STDERR_FILENO), 0);
  log_set_name("peer \"7\"");
  log_set_json(true);
  log_info("said \"hi\"\tand \x01 then \xff");
  log_set_json(false);
  dup2(saved, STDERR_FILENO);
  close(saved);
  char buf[1024];
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  close(fd);
  unlink(path);
  cr_assert_gt(n, 0);
  buf[n] = '\0';
  cr_assert_eq(buf[n - 1], '\n', "%s", buf);
  cr_assert_null(memchr(buf, '\n', (size_t)n - 1), "one line: %s", buf);
  json_t *d;
  struct rumor_err e;
  cr_assert_eq(json_text_parse(buf, (size_t)n, &d, &e), 0, "%s: %s", e.msg, buf);
  cr_assert_str_eq(json_string_value(json_object_get(d, "level")), "info");
  cr_assert_str_eq(json_string_value(json_object_get(d, "name")), "peer \"7\"");
  cr_assert_str_eq(json_string_value(json_object_get(d, "msg")), "said \"hi\"\tand \x01 then ?");
  cr_assert_eq(json_integer_value(json_object_get(d, "pid")), getpid());
  cr_assert(strncmp(buf, "{\"ts\":\"", 7) == 0, "%s", buf);
  json_decref(d);
}

/* A message of control bytes escapes to six times its length: the line is
 * cut to PIPE_BUF (one atomic write to a pipe), still one valid JSON line
 * whose message is the start of the original with "..." after it. */
Test(json_text, a_log_json_line_longer_than_pipe_buf_is_cut_to_fit) {
  char path[] = "/tmp/rumor-log-json-XXXXXX";
  int fd = mkstemp(path);
  cr_assert_geq(fd, 0);
  int saved = dup(STDERR_FILENO);
  cr_assert_geq(dup2(fd, STDERR_FILENO), 0);
  char msg[2000];
  memset(msg, '\x01', sizeof msg - 1);
  msg[sizeof msg - 1] = '\0';
  log_set_json(true);
  log_info("%s", msg);
  log_set_json(false);
  dup2(saved, STDERR_FILENO);
  close(saved);
  char buf[3 * PIPE_BUF];
  ssize_t n = pread(fd, buf, sizeof buf - 1, 0);
  close(fd);
  unlink(path);
  cr_assert_gt(n, 0);
  cr_assert_leq(n, PIPE_BUF, "a line of %zd bytes", n);
  buf[n] = '\0';
  cr_assert_null(memchr(buf, '\n', (size_t)n - 1), "one line: %s", buf);
  json_t *d;
  struct rumor_err e;
  cr_assert_eq(json_text_parse(buf, (size_t)n, &d, &e), 0, "%s: %s", e.msg, buf);
  const char *m = json_string_value(json_object_get(d, "msg"));
  size_t ml = strlen(m);
  cr_assert(ml > 100 && strcmp(m + ml - 3, "...") == 0, "message of %zu bytes: %.40s", ml, m);
  for (size_t k = 0; k < ml - 3; k++) cr_assert_eq(m[k], '\x01', "byte %zu of the message", k);
  json_decref(d);
}
