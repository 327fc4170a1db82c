/*
 * Control messages: the validation pass rejects every bomb and malformed
 * input before msgpack-c is called (counted by a hook), accepts what the
 * builder and ordinary msgpack produce, and the typed accessors check types.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "net/net_impl.h"
#include "../integration/test_net_lsan.h"

static int decode(const uint8_t *p, size_t n, struct net_msg *m) {
  struct rumor_err e = {0};
  return net_msg_decode(p, n, NULL, m, &e);
}

/* Decodes and expects a rejection that never reached msgpack-c. */
static void expect_rejected_before_decoder(const uint8_t *p, size_t n, const char *what) {
  uint64_t calls = net_test_msgpack_decoder_calls();
  struct net_msg m;
  struct rumor_err e = {0};
  int rc = net_msg_decode(p, n, NULL, &m, &e);
  cr_assert_lt(rc, 0, "%s: must be rejected", what);
  cr_assert_eq(net_test_msgpack_decoder_calls(), calls, "%s: the decoder was called (%s)", what, e.msg);
  cr_assert_neq(e.msg[0], '\0', "%s: a reason is given", what);
}

/* {"t": 1, "v": 1, "x": <value bytes>} */
static size_t in_msg(uint8_t *out, const uint8_t *v, size_t n) {
  const uint8_t head[] = {0x83, 0xa1, 't', 0x01, 0xa1, 'v', 0x01, 0xa1, 'x'};
  memcpy(out, head, sizeof head);
  memcpy(out + sizeof head, v, n);
  return sizeof head + n;
}

Test(net_msg, bombs_from_the_issue_are_rejected_before_msgpack_c_sees_them) {
  const uint8_t a32ff[] = {0xdd, 0xff, 0xff, 0xff, 0xff};
  const uint8_t a32_20[] = {0xdd, 0x20, 0x00, 0x00, 0x00};
  expect_rejected_before_decoder(a32ff, sizeof a32ff, "dd ff ff ff ff");
  expect_rejected_before_decoder(a32_20, sizeof a32_20, "dd 20 00 00 00");
  uint8_t buf[512];
  expect_rejected_before_decoder(buf, in_msg(buf, a32ff, 5), "dd ff ff ff ff inside a map");
  expect_rejected_before_decoder(buf, in_msg(buf, a32_20, 5), "dd 20 00 00 00 inside a map");
  /* 32 nested array32 headers of one element each */
  uint8_t nest[32 * 5 + 1];
  for (int i = 0; i < 32; i++) memcpy(nest + 5 * i, (const uint8_t[]){0xdd, 0, 0, 0, 1}, 5);
  nest[160] = 0xc0;
  expect_rejected_before_decoder(nest, sizeof nest, "32 nested array32 headers");
  expect_rejected_before_decoder(buf, in_msg(buf, nest, sizeof nest), "32 nested array32 headers in a map");
  /* the same nesting with a huge count at every level */
  for (int i = 0; i < 32; i++) memcpy(nest + 5 * i, (const uint8_t[]){0xdd, 0x7f, 0xff, 0xff, 0xff}, 5);
  expect_rejected_before_decoder(buf, in_msg(buf, nest, sizeof nest), "32 nested array32 of 2G elements");
}

Test(net_msg, depth_16_is_accepted_and_17_or_33_rejected) {
  uint8_t v[64], buf[128];
  /* the top map is depth 1; x holds 14 nested arrays and a nil: depth 16 */
  memset(v, 0x91, 14);
  v[14] = 0xc0;
  struct net_msg m;
  size_t n = in_msg(buf, v, 15);
  cr_assert_eq(decode(buf, n, &m), 0, "depth 16");
  net_msg_free(&m);
  memset(v, 0x91, 15);
  v[15] = 0xc0;
  expect_rejected_before_decoder(buf, in_msg(buf, v, 16), "depth 17");
  memset(v, 0x91, 32);
  v[32] = 0xc0;
  expect_rejected_before_decoder(buf, in_msg(buf, v, 33), "depth 33");
  /* an empty container at the depth limit is fine */
  memset(v, 0x91, 14);
  v[14] = 0x90;
  cr_assert_eq(decode(buf, in_msg(buf, v, 15), &m), 0);
  net_msg_free(&m);
}

Test(net_msg, declared_lengths_are_checked_against_the_bytes_left) {
  uint8_t buf[128];
  const struct {
    uint8_t v[9];
    size_t n;
    const char *what;
  } cases[] = {
      {{0xdb, 0xff, 0xff, 0xff, 0xff}, 5, "str32 of 4 GiB"},
      {{0xc6, 0x00, 0x01, 0x00, 0x00}, 5, "bin32 of 64 KiB"},
      {{0xda, 0x00, 0x05, 'a'}, 4, "str16 of 5 with 1 byte"},
      {{0xdf, 0xff, 0xff, 0xff, 0xff}, 5, "map32 of 4G pairs"},
      {{0xde, 0x00, 0x02, 0xc0, 0xc0, 0xc0}, 6, "map16 of 2 pairs with 3 objects"},
      {{0xcf, 0x00, 0x00}, 3, "uint64 cut short"},
      {{0xcb, 0x00}, 2, "float64 cut short"},
      {{0xd9}, 1, "str8 without its length"},
      {{0x92, 0xc0}, 2, "fixarray of 2 with 1"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
    expect_rejected_before_decoder(buf, in_msg(buf, cases[i].v, cases[i].n), cases[i].what);
}

Test(net_msg, ext_types_reserved_bytes_non_maps_and_trailing_bytes_are_rejected) {
  uint8_t buf[128];
  const uint8_t fixext4[] = {0xd6, 0xff, 0, 0, 0, 0}; /* a timestamp */
  const uint8_t ext8[] = {0xc7, 0x01, 0x05, 0x00};
  const uint8_t c1[] = {0xc1};
  expect_rejected_before_decoder(buf, in_msg(buf, fixext4, sizeof fixext4), "timestamp ext");
  expect_rejected_before_decoder(buf, in_msg(buf, ext8, sizeof ext8), "ext8");
  expect_rejected_before_decoder(buf, in_msg(buf, c1, 1), "0xc1");
  const uint8_t arr[] = {0x91, 0x01};
  expect_rejected_before_decoder(arr, sizeof arr, "a top-level array");
  const uint8_t num[] = {0x05};
  expect_rejected_before_decoder(num, 1, "a top-level number");
  expect_rejected_before_decoder(num, 0, "nothing");
  const uint8_t two[] = {0x80, 0x80};
  expect_rejected_before_decoder(two, 2, "two messages");
}

Test(net_msg, element_count_is_bounded) {
  /* {"t":1,"v":1,"x":[nil x 70000]}: every element is one byte, but there
   * are more than the default 65536 */
  size_t n = 70000;
  uint8_t *buf = malloc(n + 64);
  const uint8_t head[] = {0x83, 0xa1, 't', 0x01, 0xa1, 'v', 0x01, 0xa1, 'x', 0xdd};
  memcpy(buf, head, sizeof head);
  net_be32_put(buf + sizeof head, (uint32_t)n);
  memset(buf + sizeof head + 4, 0xc0, n);
  expect_rejected_before_decoder(buf, sizeof head + 4 + n, "70000 elements");
  struct net_msg_limits lim = {.max_elems = 100000};
  struct net_msg m;
  cr_assert_eq(net_msg_decode(buf, sizeof head + 4 + n, &lim, &m, NULL), 0, "accepted with a larger limit");
  net_msg_free(&m);
  free(buf);
}

Test(net_msg, type_and_version_are_required_unsigned_integers) {
  struct net_msg m;
  const uint8_t no_t[] = {0x81, 0xa1, 'v', 0x01};
  cr_assert_lt(decode(no_t, sizeof no_t, &m), 0);
  const uint8_t neg_t[] = {0x82, 0xa1, 't', 0xff, 0xa1, 'v', 0x01};
  cr_assert_lt(decode(neg_t, sizeof neg_t, &m), 0);
  const uint8_t str_v[] = {0x82, 0xa1, 't', 0x01, 0xa1, 'v', 0xa1, '1'};
  cr_assert_lt(decode(str_v, sizeof str_v, &m), 0);
  const uint8_t ok[] = {0x82, 0xa1, 't', 0x07, 0xa1, 'v', 0x02};
  cr_assert_eq(decode(ok, sizeof ok, &m), 0);
  cr_assert_eq(m.type, 7);
  cr_assert_eq(m.version, 2);
  net_msg_free(&m);
}

Test(net_msg, builder_output_round_trips_through_the_typed_accessors) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, 42, 3);
  net_msgbuf_put_uint(&b, "u", 18446744073709551615ull);
  net_msgbuf_put_int(&b, "i", -5);
  net_msgbuf_put_double(&b, "d", 0.25);
  net_msgbuf_put_bool(&b, "b", true);
  net_msgbuf_put_str(&b, "s", "hello", 5);
  net_msgbuf_put_bin(&b, "bin", "\x00\x01\x02", 3);
  msgpack_packer *pk = net_msgbuf_put_key(&b, "arr");
  msgpack_pack_array(pk, 3);
  for (int i = 0; i < 3; i++) msgpack_pack_int(pk, i * 10);
  pk = net_msgbuf_put_key(&b, "map");
  msgpack_pack_map(pk, 1);
  msgpack_pack_str(pk, 1);
  msgpack_pack_str_body(pk, "k", 1);
  msgpack_pack_uint8(pk, 9);
  size_t len;
  const uint8_t *p = net_msgbuf_data(&b, &len);
  struct net_msg m;
  cr_assert_eq(decode(p, len, &m), 0);
  cr_assert_eq(m.type, 42);
  cr_assert_eq(m.version, 3);
  uint64_t u;
  int64_t i;
  double d;
  bool bo;
  const char *s;
  const uint8_t *bp;
  size_t sl;
  const msgpack_object *items, *map;
  uint32_t n;
  cr_assert_eq(net_msg_get_uint(&m, "u", &u), 0);
  cr_assert_eq(u, 18446744073709551615ull);
  cr_assert_eq(net_msg_get_int(&m, "i", &i), 0);
  cr_assert_eq(i, -5);
  cr_assert_eq(net_msg_get_double(&m, "d", &d), 0);
  cr_assert_eq(d, 0.25);
  cr_assert_eq(net_msg_get_bool(&m, "b", &bo), 0);
  cr_assert(bo);
  cr_assert_eq(net_msg_get_str(&m, "s", &s, &sl), 0);
  cr_assert_eq(sl, 5);
  cr_assert_eq(memcmp(s, "hello", 5), 0);
  cr_assert_eq(net_msg_get_bin(&m, "bin", &bp, &sl), 0);
  cr_assert_eq(sl, 3);
  cr_assert_eq(bp[2], 2);
  cr_assert_eq(net_msg_get_array(&m, "arr", &items, &n), 0);
  cr_assert_eq(n, 3);
  cr_assert_eq(net_obj_int(&items[2], &i), 0);
  cr_assert_eq(i, 20);
  cr_assert_eq(net_msg_get_map(&m, "map", &map), 0);
  cr_assert_eq(net_obj_uint(net_obj_map_get(map, "k"), &u), 0);
  cr_assert_eq(u, 9);
  /* missing keys and wrong types are errors, not crashes */
  cr_assert_eq(net_msg_get_uint(&m, "nope", &u), RUMOR_ENOTFOUND);
  cr_assert_eq(net_msg_get_uint(&m, "i", &u), RUMOR_EPROTO, "negative is not unsigned");
  cr_assert_eq(net_msg_get_int(&m, "u", &i), RUMOR_EPROTO, "2^64-1 does not fit int64");
  cr_assert_eq(net_msg_get_str(&m, "bin", &s, &sl), RUMOR_EPROTO);
  cr_assert_eq(net_msg_get_bool(&m, "s", &bo), RUMOR_EPROTO);
  cr_assert_eq(net_msg_get_array(&m, "map", &items, &n), RUMOR_EPROTO);
  cr_assert_eq(net_msg_get_double(&m, "i", &d), 0, "integers convert to double");
  cr_assert_eq(d, -5.0);
  net_msg_free(&m);
  net_msgbuf_free(&b);
}

Test(net_msg, every_prefix_of_a_valid_message_is_rejected_and_never_crashes) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, 1, 1);
  net_msgbuf_put_str(&b, "name", "peer-17", 7);
  net_msgbuf_put_double(&b, "loss", 0.5);
  msgpack_packer *pk = net_msgbuf_put_key(&b, "list");
  msgpack_pack_array(pk, 2);
  msgpack_pack_bin(pk, 4);
  msgpack_pack_bin_body(pk, "abcd", 4);
  msgpack_pack_nil(pk);
  size_t len;
  const uint8_t *p = net_msgbuf_data(&b, &len);
  struct net_msg m;
  cr_assert_eq(decode(p, len, &m), 0);
  net_msg_free(&m);
  for (size_t k = 0; k < len; k++) {
    uint8_t *cut = malloc(k ? k : 1);
    memcpy(cut, p, k);
    cr_assert_lt(decode(cut, k, &m), 0, "prefix of %zu bytes", k);
    free(cut);
  }
  net_msgbuf_free(&b);
}

Test(net_msg, random_bytes_never_crash_and_never_leak) {
  struct rng r;
  rng_seed(&r, 99, 0);
  uint8_t buf[64];
  int accepted = 0;
  for (int iter = 0; iter < 200000; iter++) {
    size_t n = 1 + rng_below(&r, sizeof buf);
    for (size_t i = 0; i < n; i++) buf[i] = (uint8_t)rng_next_u64(&r);
    buf[0] = 0x80 | (buf[0] & 0x0f); /* mostly maps, so the walk goes deep */
    struct net_msg m;
    if (decode(buf, n, &m) == 0) {
      accepted++;
      net_msg_free(&m);
    }
  }
  cr_log_info("%d of 200000 random inputs were valid messages", accepted);
}

Test(net_msg, an_empty_key_is_found_and_compared_safely) {
  /* found by fuzz_msg: msgpack-c gives an empty string a NULL pointer */
  const uint8_t m_bytes[] = {0x83, 0xa1, 't', 0x01, 0xa1, 'v', 0x01, 0xa0, 0x05};
  struct net_msg m;
  cr_assert_eq(decode(m_bytes, sizeof m_bytes, &m), 0);
  uint64_t u = 0;
  cr_assert_eq(net_msg_get_uint(&m, "", &u), 0);
  cr_assert_eq(u, 5);
  net_msg_free(&m);
}
