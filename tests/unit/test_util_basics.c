/* util: JSON reader/writer, half-precision conversion, the seeded generator,
 * strict number parsing, atomic file writes and CPU lists. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <sched.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "util/json.h"
#include "util/util.h"

Test(json, parses_nested_documents_and_escapes) {
  const char *text = "{\"a\": [1, -2.5e3, true, null], \"s\": \"x\\u00e9\\n\\\"q\\\"\\ud83d\\ude00\", \"o\": {}}";
  struct json_doc d;
  struct rumor_err e;
  cr_assert_eq(json_parse(text, strlen(text), &d, &e), 0, "%s", e.msg);
  const struct json_value *a = json_get(&d.root, "a");
  cr_assert(a && a->type == JSON_ARRAY && a->len == 4);
  cr_assert(a->items[0].is_integer && a->items[0].integer == 1);
  cr_assert_float_eq(a->items[1].number, -2500.0, 1e-9);
  cr_assert(a->items[2].type == JSON_BOOL && a->items[2].boolean);
  cr_assert_eq(a->items[3].type, JSON_NULL);
  const struct json_value *s = json_get(&d.root, "s");
  cr_assert_str_eq(s->string, "x\xc3\xa9\n\"q\"\xf0\x9f\x98\x80");
  cr_assert_eq(json_get(&d.root, "o")->type, JSON_OBJECT);
  cr_assert_null(json_get(&d.root, "missing"));
  json_doc_free(&d);
}

Test(json, rejects_malformed_input_with_an_offset) {
  const char *bad[] = {"", "{", "[1,]", "{\"a\" 1}", "\"abc", "01", "1.", "-", "tru", "[1] x", "\"\\ud800\"",
                       "\"\\x\"", "{\"a\":\"\x01\"}", "nul"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct json_doc d;
    struct rumor_err e;
    cr_assert_eq(json_parse(bad[i], strlen(bad[i]), &d, &e), RUMOR_EFORMAT, "'%s' accepted", bad[i]);
    cr_assert(strstr(e.msg, "at byte") != NULL, "%s", e.msg);
  }
  /* depth limit */
  char deep[200];
  memset(deep, '[', 40);
  memset(deep + 40, ']', 40);
  struct json_doc d;
  struct rumor_err e;
  cr_assert_eq(json_parse(deep, 80, &d, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "deep") != NULL, "%s", e.msg);
}

Test(json, writer_round_trips) {
  struct json_buf b;
  json_buf_init(&b);
  json_obj_begin(&b);
  json_key(&b, "n");
  json_num(&b, 0.1f);
  json_key(&b, "i");
  json_int(&b, -42);
  json_key(&b, "s");
  json_str(&b, "tab\there \"q\"");
  json_key(&b, "inf");
  json_num(&b, INFINITY);
  json_key(&b, "arr");
  json_arr_begin(&b);
  json_bool(&b, false);
  json_null(&b);
  json_arr_end(&b);
  json_obj_end(&b);
  struct json_doc d;
  struct rumor_err e;
  cr_assert_eq(json_parse(b.data, b.len, &d, &e), 0, "%s: %s", e.msg, b.data);
  cr_assert_eq((float)json_get(&d.root, "n")->number, 0.1f);
  cr_assert_eq(json_get(&d.root, "i")->integer, -42);
  cr_assert_str_eq(json_get(&d.root, "s")->string, "tab\there \"q\"");
  cr_assert_eq(json_get(&d.root, "inf")->type, JSON_NULL);
  cr_assert_eq(json_get(&d.root, "arr")->len, 2);
  json_doc_free(&d);
  json_buf_free(&b);
}

Test(half, f16_and_bf16_round_trip_and_special_values) {
  struct rng r;
  rng_seed(&r, 1, 2);
  for (int i = 0; i < 100000; i++) {
    float x = rng_normal(&r) * powf(2.0f, (float)(int)rng_below(&r, 20) - 10);
    float h = half_to_f32(half_from_f32(x)), b = bf16_to_f32(bf16_from_f32(x));
    if (fabsf(x) >= 6.2e-5f) cr_assert(fabsf(h - x) <= fabsf(x) * (1.0f / 2048), "f16 %g -> %g", x, h);
    else cr_assert(fabsf(h - x) <= 6e-8f, "f16 subnormal %g -> %g", x, h);
    cr_assert(fabsf(b - x) <= fabsf(x) * (1.0f / 256), "bf16 %g -> %g", x, b);
  }
  cr_assert(isnan(half_to_f32(half_from_f32(NAN))));
  cr_assert(isnan(bf16_to_f32(bf16_from_f32(NAN))));
  cr_assert(isinf(half_to_f32(half_from_f32(1e6f))));
  cr_assert(isinf(half_to_f32(half_from_f32(-INFINITY))) && half_to_f32(half_from_f32(-INFINITY)) < 0);
  cr_assert_eq(half_to_f32(half_from_f32(65504.0f)), 65504.0f);
  cr_assert_eq(half_from_f32(1.0f), 0x3c00);
  cr_assert_eq(half_from_f32(1.0f + 1.0f / 2048), 0x3c00); /* tie rounds to even */
  cr_assert_eq(half_from_f32(5.9604645e-8f), 0x0001);      /* smallest subnormal */
  cr_assert_eq(bf16_from_f32(1.0f), 0x3f80);
  /* every f16 value converts exactly to f32 and back */
  for (uint32_t h = 0; h < 65536; h++) {
    float f = half_to_f32((uint16_t)h);
    if (!isnan(f)) cr_assert_eq(half_from_f32(f), h, "0x%04x", h);
  }
}

Test(rng, reproducible_streams_and_unbiased_below) {
  struct rng a, b, c;
  rng_seed(&a, 5, 1);
  rng_seed(&b, 5, 1);
  rng_seed(&c, 5, 2);
  bool differ = false;
  for (int i = 0; i < 100; i++) {
    uint64_t x = rng_next_u64(&a);
    cr_assert_eq(x, rng_next_u64(&b));
    differ |= x != rng_next_u64(&c);
  }
  cr_assert(differ, "streams 1 and 2 are identical");
  int counts[7] = {0};
  for (int i = 0; i < 70000; i++) counts[rng_below(&a, 7)]++;
  for (int i = 0; i < 7; i++) cr_assert(counts[i] > 9400 && counts[i] < 10600, "bucket %d: %d", i, counts[i]);
  double s = 0, s2 = 0;
  for (int i = 0; i < 100000; i++) {
    double z = rng_normal(&a);
    s += z;
    s2 += z * z;
  }
  cr_assert(fabs(s / 1e5) < 0.02 && fabs(s2 / 1e5 - 1) < 0.03, "normal mean %g var %g", s / 1e5, s2 / 1e5);
}

Test(parse, numbers_are_strict) {
  int64_t i;
  double d;
  cr_assert_eq(parse_i64("42", 0, 100, &i), 0);
  cr_assert_eq(i, 42);
  cr_assert_neq(parse_i64("42x", 0, 100, &i), 0);
  cr_assert_neq(parse_i64("101", 0, 100, &i), 0);
  cr_assert_neq(parse_i64("", 0, 100, &i), 0);
  cr_assert_neq(parse_i64("99999999999999999999", 0, INT64_MAX, &i), 0);
  cr_assert_eq(parse_f64("1e-3", 0, 1, &d), 0);
  cr_assert_neq(parse_f64("inf", 0, 1e308, &d), 0);
  cr_assert_neq(parse_f64("nan", -1, 1, &d), 0);
  cr_assert_neq(parse_f64("0.5.5", 0, 1, &d), 0);
}

Test(file, atomic_write_replaces_and_reads_back) {
  char dir[] = "/tmp/rumor-test-file-XXXXXX";
  cr_assert_not_null(mkdtemp(dir));
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  struct file_part parts[] = {{"hello ", 6}, {"world", 5}};
  struct rumor_err e;
  cr_assert_eq(file_write_atomic(path, parts, 2, 0600, &e), 0, "%s", e.msg);
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600);
  uint8_t *buf;
  size_t n;
  cr_assert_eq(file_read_all(path, 100, &buf, &n, &e), 0);
  cr_assert_eq(n, 11);
  cr_assert_eq(memcmp(buf, "hello world", 11), 0);
  free(buf);
  cr_assert_eq(file_read_all(path, 5, &buf, &n, &e), RUMOR_ETOOBIG);
  cr_assert_neq(file_read_all(dir, 100, &buf, &n, &e), 0); /* a directory */
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}

static bool cpu_in(const struct cpu_list *c, int cpu) { return (c->bits[cpu / 64] >> (cpu % 64)) & 1; }

Test(cpus, lists_parse_strictly_and_pinning_takes_effect) {
  struct cpu_list c;
  struct rumor_err e;
  cr_assert_eq(cpu_list_parse("0", &c, &e), 0, "%s", e.msg);
  cr_assert(cpu_in(&c, 0) && !cpu_in(&c, 1));
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n >= 2) {
    cr_assert_eq(cpu_list_parse("0-1", &c, &e), 0, "%s", e.msg);
    cr_assert(cpu_in(&c, 0) && cpu_in(&c, 1) && !cpu_in(&c, 2));
    cr_assert_eq(cpu_list_parse("1,0", &c, &e), 0, "%s", e.msg);
    cr_assert(cpu_in(&c, 0) && cpu_in(&c, 1));
  }
  const char *bad[] = {"", "x", "1-", "-1", "2-1", "0,", ",0", "0,,1", "0 1", "1024", "99999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_neq(cpu_list_parse(bad[i], &c, &e), 0, "'%s' was accepted", bad[i]);
    cr_assert(strlen(e.msg) > 0, "no message for '%s'", bad[i]);
  }
  cr_assert_neq(cpu_list_parse("1000", &c, &e), 0, "a CPU this machine lacks was accepted");
  cr_assert(strstr(e.msg, "1000") != NULL, "the message does not name the CPU: %s", e.msg);

  /* Pin this thread to CPU 0, check the kernel agrees, and restore. */
  cpu_set_t before, now;
  cr_assert_eq(sched_getaffinity(0, sizeof before, &before), 0);
  cr_assert_eq(cpu_list_parse("0", &c, &e), 0, "%s", e.msg);
  cr_assert_eq(cpu_pin_self(&c, &e), 0, "%s", e.msg);
  cr_assert_eq(sched_getaffinity(0, sizeof now, &now), 0);
  cr_assert(CPU_ISSET(0, &now) && CPU_COUNT(&now) == 1, "pinned to %d CPUs", CPU_COUNT(&now));
  cr_assert_eq(sched_setaffinity(0, sizeof before, &before), 0);
}
