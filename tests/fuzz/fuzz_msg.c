/*
 * Fuzz harness: the control-message validator and decoder, then every typed
 * accessor on every key of what was accepted. Any input must be either
 * rejected with an error or decoded into a message whose accessors behave;
 * nothing may crash, leak, or reach msgpack-c without passing validation.
 */
#include <string.h>

#include "net/net_impl.h"
#include "tests/fuzz/fuzz.h"

/* Results are looked at (warn_unused_result) but do not matter here. */
static volatile int g_sink;
#define USE(x) (g_sink += (x) < 0)

static void poke(const msgpack_object *o, int depth) {
  uint64_t u;
  int64_t i;
  double d;
  bool b;
  const char *s;
  const uint8_t *p;
  size_t n;
  USE(net_obj_uint(o, &u));
  USE(net_obj_int(o, &i));
  USE(net_obj_double(o, &d));
  USE(net_obj_bool(o, &b));
  USE(net_obj_str(o, &s, &n));
  USE(net_obj_bin(o, &p, &n));
  if (depth > NET_MSG_MAX_DEPTH + 1) __builtin_trap(); /* validation bounds the depth */
  if (o->type == MSGPACK_OBJECT_ARRAY)
    for (uint32_t k = 0; k < o->via.array.size; k++) poke(&o->via.array.ptr[k], depth + 1);
  if (o->type == MSGPACK_OBJECT_MAP)
    for (uint32_t k = 0; k < o->via.map.size; k++) {
      poke(&o->via.map.ptr[k].key, depth + 1);
      poke(&o->via.map.ptr[k].val, depth + 1);
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  /* Validation alone, with tight limits, must agree with itself. */
  struct net_msg_limits tight = {.max_depth = 4, .max_elems = 64};
  size_t zone = 0;
  USE(net_mp_validate(data, size, &tight, &zone, NULL));

  struct net_msg m;
  struct rumor_err e = {0};
  uint64_t calls = net_test_msgpack_decoder_calls();
  int rc = net_msg_decode(data, size, NULL, &m, &e);
  if (rc != 0) {
    /* A rejection by the validator never called the decoder. */
    size_t z;
    if (net_mp_validate(data, size, NULL, &z, NULL) != 0 && net_test_msgpack_decoder_calls() != calls)
      __builtin_trap();
    return 0;
  }
  poke(m.root, 1);
  const char *keys[] = {"t", "v", "seq", "x", "", "name"};
  for (size_t k = 0; k < sizeof keys / sizeof keys[0]; k++) {
    const msgpack_object *items, *map;
    uint32_t n;
    uint64_t u;
    const char *s;
    size_t sl;
    USE(net_msg_get_array(&m, keys[k], &items, &n));
    USE(net_msg_get_map(&m, keys[k], &map));
    USE(net_msg_get_uint(&m, keys[k], &u));
    USE(net_msg_get_str(&m, keys[k], &s, &sl));
  }
  net_msg_free(&m);
  return 0;
}
