/* The safetensors reader on files held in memory (safetensors_parse): it
 * accepts what the writer wrote exactly as safetensors_read does, and refuses
 * the headers the fuzz harness (tests/fuzz/fuzz_safetensors.c) showed to need
 * care: extents whose product wraps, a digest key that appears twice or in a
 * spelling the digest check does not read, more tensors than the limit. A
 * zero-size tensor may share its offset with the next tensor, whatever order
 * the header lists them in. */
#include <criterion/criterion.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "peer/train/train.h"

/* A file: the 8-byte little-endian length of `hdr`, `hdr`, then `dlen` bytes
 * of data (zeros), in a malloc'd buffer for safetensors_parse. */
static uint8_t *st_file(const char *hdr, size_t dlen, size_t *len) {
  size_t hlen = strlen(hdr);
  *len = 8 + hlen + dlen;
  uint8_t *buf = calloc(1, *len);
  cr_assert_not_null(buf);
  for (int b = 0; b < 8; b++) buf[b] = (uint8_t)((uint64_t)hlen >> (8 * b));
  memcpy(buf + 8, hdr, hlen);
  return buf;
}

/* Parses `hdr` + `dlen` zero bytes; returns the result, the file freed. */
static int parse(const char *hdr, size_t dlen, bool require_digest, struct rumor_err *e) {
  size_t len;
  uint8_t *buf = st_file(hdr, dlen, &len);
  struct st_file f;
  int rc = safetensors_parse(buf, len, "mem", require_digest, &f, e);
  if (rc == 0) safetensors_free(&f);
  return rc;
}

Test(safetensors, parse_accepts_what_write_wrote_as_read_does) {
  char dir[] = "/tmp/rumor-test-st-XXXXXX", file[64];
  cr_assert_not_null(mkdtemp(dir));
  snprintf(file, sizeof file, "%s/a.safetensors", dir);
  float w[6] = {1, 2, 3, 4, 5, 6};
  int32_t labels[2] = {7, -8};
  struct st_tensor ts[3] = {
      {.name = "w", .dtype = TENSOR_F32, .ndim = 2, .shape = {2, 3}, .data = w, .nbytes = sizeof w},
      {.name = "empty", .dtype = TENSOR_F32, .ndim = 1, .shape = {0}, .data = w, .nbytes = 0},
      {.name = "labels", .dtype = TENSOR_I32, .ndim = 1, .shape = {2}, .data = labels, .nbytes = sizeof labels},
  };
  struct st_meta meta[1] = {{"rumor.step", "12"}};
  struct rumor_err e;
  cr_assert_eq(safetensors_write(file, ts, 3, meta, 1, &e), 0, "%s", e.msg);

  struct st_file r, p;
  cr_assert_eq(safetensors_read(file, true, &r, &e), 0, "%s", e.msg);
  uint8_t *buf;
  size_t len;
  cr_assert_eq(file_read_all(file, 1 << 20, &buf, &len, &e), 0, "%s", e.msg);
  cr_assert_eq(safetensors_parse(buf, len, file, true, &p, &e), 0, "%s", e.msg);
  cr_assert_eq(p.ntensors, 3);
  cr_assert_eq(p.ntensors, r.ntensors);
  for (size_t i = 0; i < p.ntensors; i++) {
    cr_assert_str_eq(p.tensors[i].name, r.tensors[i].name);
    cr_assert_eq(p.tensors[i].nbytes, r.tensors[i].nbytes);
    cr_assert_eq(memcmp(p.tensors[i].data, r.tensors[i].data, p.tensors[i].nbytes), 0);
  }
  cr_assert_str_eq(safetensors_meta(&p, "rumor.step"), "12");
  cr_assert_eq(memcmp(safetensors_find(&p, "w")->data, w, sizeof w), 0);
  safetensors_free(&p);
  safetensors_free(&r);
  unlink(file);
  rmdir(dir);
}

Test(safetensors, a_damaged_buffer_is_refused_with_its_name) {
  struct rumor_err e;
  uint8_t *buf = malloc(4);
  cr_assert_not_null(buf);
  memset(buf, 0xff, 4);
  struct st_file f;
  cr_assert_eq(safetensors_parse(buf, 4, "shard-3", false, &f, &e), RUMOR_ECORRUPT); /* buf is freed */
  cr_assert_not_null(strstr(e.msg, "shard-3"), "%s", e.msg);
  cr_assert_eq(safetensors_parse(NULL, 0, "empty", false, &f, &e), RUMOR_ECORRUPT);
}

Test(safetensors, extents_whose_product_wraps_are_refused) {
  struct rumor_err e;
  /* 2^40 * 2^24 elements is 0 modulo 2^64, which 0 bytes would match. */
  cr_assert_eq(parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[1099511627776,16777216],\"data_offsets\":[0,0]}}", 0,
                     false, &e),
               RUMOR_ECORRUPT);
  cr_assert_not_null(strstr(e.msg, "too large"), "%s", e.msg);
  /* A zero extent makes any other extent harmless. */
  cr_assert_eq(parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[0,1099511627776,1099511627776],\"data_offsets\":[0,0]}}",
                     0, false, &e),
               0, "%s", e.msg);
  cr_assert_eq(parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[1048576,1048576],\"data_offsets\":[0,4]}}", 4, false, &e),
               RUMOR_ECORRUPT);
}

Test(safetensors, a_digest_key_twice_is_refused_even_when_not_required) {
  struct rumor_err e;
  char hdr[256];
  snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"rumor.blake2b\":\"%064d\",\"rumor.blake2b\":\"%064d\"}}", 0, 1);
  cr_assert_eq(parse(hdr, 0, false, &e), RUMOR_ECORRUPT);
  cr_assert_not_null(strstr(e.msg, "more than once"), "%s", e.msg);
}

Test(safetensors, a_digest_key_the_digest_check_cannot_read_is_refused) {
  struct rumor_err e;
  char hdr[256];
  snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"rumor\\u002eblake2b\":\"%064d\"}}", 1);
  cr_assert_eq(parse(hdr, 0, false, &e), RUMOR_ECORRUPT);
  snprintf(hdr, sizeof hdr, "{\"__metadata__\":{\"rumor.blake2b\" : \"%064d\"}}", 1);
  cr_assert_eq(parse(hdr, 0, false, &e), RUMOR_ECORRUPT);
  cr_assert_not_null(strstr(e.msg, "rumor.blake2b"), "%s", e.msg);
}

/* A header holding a valid digest of itself where the raw search finds it,
 * but not as __metadata__'s rumor.blake2b (here inside a tensor's entry,
 * whose extra keys a reader ignores): refused, so that no file passes the
 * check with a digest it does not declare. */
Test(safetensors, a_valid_digest_outside_the_metadata_is_refused) {
  char hdr[300];
  int n = snprintf(hdr, sizeof hdr,
                   "{\"a\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0],\"rumor.blake2b\":\"%064d\"}}", 0);
  char *at = strstr(hdr, "\"rumor.blake2b\":\"") + 17;
  size_t len;
  uint8_t *buf = st_file(hdr, 0, &len);
  cr_assert_eq(sodium_init() >= 0, true);
  uint8_t d[32];
  crypto_generichash(d, sizeof d, buf, len, NULL, 0); /* the digest's own 64 characters read as zeros */
  sodium_bin2hex(at, 65, d, sizeof d);
  at[64] = '"';
  memcpy(buf + 8, hdr, (size_t)n);
  struct st_file f;
  struct rumor_err e;
  cr_assert_eq(safetensors_parse(buf, len, "mem", false, &f, &e), RUMOR_ECORRUPT, "accepted");
  cr_assert_not_null(strstr(e.msg, "not __metadata__'s"), "%s", e.msg);
}

Test(safetensors, a_zero_size_tensor_may_share_an_offset_in_either_order) {
  struct rumor_err e;
  cr_assert_eq(parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]},"
                     "\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}}",
                     8, false, &e),
               0, "%s", e.msg);
  cr_assert_eq(parse("{\"z\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]},"
                     "\"a\":{\"dtype\":\"F32\",\"shape\":[2],\"data_offsets\":[0,8]}}",
                     8, false, &e),
               0, "%s", e.msg);
}

Test(safetensors, more_tensors_than_the_limit_are_refused) {
  struct rumor_err e;
  for (int n = SAFETENSORS_MAX_TENSORS; n <= SAFETENSORS_MAX_TENSORS + 1; n++) {
    size_t cap = (size_t)n * 64 + 8, used = 0;
    char *hdr = malloc(cap);
    cr_assert_not_null(hdr);
    hdr[used++] = '{';
    for (int i = 0; i < n; i++)
      used += (size_t)snprintf(hdr + used, cap - used, "%s\"%d\":{\"dtype\":\"F32\",\"shape\":[0],\"data_offsets\":[0,0]}",
                               i ? "," : "", i);
    snprintf(hdr + used, cap - used, "}");
    int rc = parse(hdr, 0, false, &e);
    free(hdr);
    if (n == SAFETENSORS_MAX_TENSORS) cr_assert_eq(rc, 0, "%s", e.msg);
    else cr_assert_eq(rc, RUMOR_ECORRUPT, "%d tensors accepted", n);
  }
}

Test(safetensors, a_key_twice_is_refused_at_any_depth) {
  /* Readers disagree on which value of a repeated key counts. */
  struct rumor_err e = {0};
  cr_assert_eq(parse("{\"__metadata__\":{\"rumor.step\":\"1\",\"rumor.step\":\"9\"}}", 0, false, &e), RUMOR_ECORRUPT);
  cr_assert(strstr(e.msg, "mem") && strstr(e.msg, "duplicate") && strstr(e.msg, "rumor.step"), "%s", e.msg);
  cr_assert_eq(parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4]},"
                     "\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[4,8]}}",
                     8, false, &e),
               RUMOR_ECORRUPT);
  cr_assert(strstr(e.msg, "duplicate") && strstr(e.msg, "\"a\""), "%s", e.msg);
  cr_assert_eq(parse("{\"a\":{\"dtype\":\"F32\",\"shape\":[1],\"data_offsets\":[0,4],\"dtype\":\"I32\"}}", 4, false,
                     &e),
               RUMOR_ECORRUPT);
  cr_assert(strstr(e.msg, "duplicate") && strstr(e.msg, "dtype"), "%s", e.msg);
  cr_assert_eq(parse("{\"__metadata__\":{\"rumor.step\":\"1\",\"rumor.epoch\":\"9\"}}", 0, false, &e), 0, "%s",
               e.msg);
}
