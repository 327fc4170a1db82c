/*
 * Control messages: the non-allocating msgpack validation pass, decoding
 * with msgpack-c only after it, typed accessors and the builder.
 *
 * Why a validation pass: msgpack-c's C unpacker allocates what a header
 * declares before it looks at the bytes behind it (an array32 header of 4 G
 * elements reserves 96 GiB; 32 nested array32 headers reserve 1 GiB). The
 * pass below walks the encoding iteratively, checks every declared length
 * against the bytes actually left, bounds depth and element count, and
 * computes how much msgpack-c will need, so the decoder never sees a bomb.
 */
#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <string.h>

#include "net/net_impl.h"

#ifdef RUMOR_TESTING
static _Atomic uint64_t g_decoder_calls; /* test hook: proves bombs never reach msgpack-c */

uint64_t net_test_msgpack_decoder_calls(void) { return atomic_load(&g_decoder_calls); }
#endif

/* Zone bytes msgpack-c may use per container beyond its element array
 * (alignment padding). */
#define ZONE_SLACK_PER_CONTAINER 16
#define ZONE_BASE 256

static uint32_t lim_or(uint32_t v, uint32_t def) { return v ? v : def; }

int net_mp_validate(const uint8_t *p, size_t n, const struct net_msg_limits *lim, size_t *zone_bytes,
                    struct rumor_err *e) {
  const uint32_t max_depth = lim ? lim_or(lim->max_depth, NET_MSG_MAX_DEPTH) : NET_MSG_MAX_DEPTH;
  const uint32_t max_elems = lim ? lim_or(lim->max_elems, NET_MSG_DEFAULT_MAX_ELEMS) : NET_MSG_DEFAULT_MAX_ELEMS;
  if (max_depth > NET_MSG_MAX_DEPTH)
    return rumor_err_set(e, -EINVAL, "depth limit %u above the supported %d", max_depth, NET_MSG_MAX_DEPTH);
  /* remain[d]: objects still to read inside the container open at depth d
   * (d = 0 is the top level, which holds exactly one object). */
  uint64_t remain[NET_MSG_MAX_DEPTH + 1];
  uint32_t depth = 0;
  uint64_t elems = 0;
  size_t zone = ZONE_BASE, pos = 0;
  remain[0] = 1;
  if (n == 0) return rumor_err_set(e, RUMOR_EPROTO, "empty message");
  uint8_t first = p[0];
  if (!((first >= 0x80 && first <= 0x8f) || first == 0xde || first == 0xdf))
    return rumor_err_set(e, RUMOR_EPROTO, "message is not a map (first byte 0x%02x)", first);

  for (;;) {
    while (depth > 0 && remain[depth] == 0) depth--;
    if (depth == 0 && remain[0] == 0) break;
    remain[depth]--;
    if (pos >= n) return rumor_err_set(e, RUMOR_EPROTO, "truncated at byte %zu", pos);
    if (++elems > max_elems)
      return rumor_err_set(e, RUMOR_ETOOBIG, "more than %u objects", max_elems);
    if (depth + 1 > max_depth)
      return rumor_err_set(e, RUMOR_ETOOBIG, "nesting deeper than %u at byte %zu", max_depth, pos);
    const size_t at = pos;
    const uint8_t b = p[pos++];
    const size_t left = n - pos;
    uint64_t payload = 0;  /* bytes that follow the header (str, bin, numbers) */
    uint64_t children = 0; /* objects contained (arrays: n, maps: 2n) */
    size_t elem_size = 0;  /* msgpack-c's per-entry size for this container */
    bool container = false;

    if (b <= 0x7f || b >= 0xe0 || b == 0xc0 || b == 0xc2 || b == 0xc3) {
      /* fixint, nil, bool */
    } else if (b <= 0x8f) {
      container = true;
      children = 2u * (uint64_t)(b & 0x0f);
      elem_size = sizeof(msgpack_object_kv);
    } else if (b <= 0x9f) {
      container = true;
      children = b & 0x0f;
      elem_size = sizeof(msgpack_object);
    } else if (b <= 0xbf) {
      payload = b & 0x1f;
    } else {
      size_t hl = 0; /* length-field bytes */
      switch (b) {
      case 0xc4: hl = 1; break;          /* bin8 */
      case 0xc5: hl = 2; break;          /* bin16 */
      case 0xc6: hl = 4; break;          /* bin32 */
      case 0xca: payload = 4; break;     /* float32 */
      case 0xcb: payload = 8; break;     /* float64 */
      case 0xcc: case 0xd0: payload = 1; break;
      case 0xcd: case 0xd1: payload = 2; break;
      case 0xce: case 0xd2: payload = 4; break;
      case 0xcf: case 0xd3: payload = 8; break;
      case 0xd9: hl = 1; break;          /* str8 */
      case 0xda: hl = 2; break;          /* str16 */
      case 0xdb: hl = 4; break;          /* str32 */
      case 0xdc: case 0xde: hl = 2; break; /* array16, map16 */
      case 0xdd: case 0xdf: hl = 4; break; /* array32, map32 */
      case 0xc1:
        return rumor_err_set(e, RUMOR_EPROTO, "reserved byte 0xc1 at byte %zu", at);
      default: /* 0xc7-0xc9 ext8/16/32, 0xd4-0xd8 fixext */
        return rumor_err_set(e, RUMOR_EPROTO, "extension type 0x%02x at byte %zu is not accepted", b, at);
      }
      if (hl) {
        if (left < hl) return rumor_err_set(e, RUMOR_EPROTO, "truncated length at byte %zu", at);
        uint64_t v = hl == 1 ? p[pos] : hl == 2 ? net_be16_get(p + pos) : net_be32_get(p + pos);
        pos += hl;
        if (b == 0xdc || b == 0xdd) {
          container = true;
          children = v;
          elem_size = sizeof(msgpack_object);
        } else if (b == 0xde || b == 0xdf) {
          container = true;
          children = 2 * v;
          elem_size = sizeof(msgpack_object_kv);
        } else {
          payload = v;
        }
      }
    }
    if (container) {
      /* Each contained object takes at least one byte. */
      if (children > n - pos)
        return rumor_err_set(e, RUMOR_EPROTO,
                             "container at byte %zu declares %llu objects but only %zu bytes remain", at,
                             (unsigned long long)children, n - pos);
      uint64_t entries = elem_size == sizeof(msgpack_object_kv) ? children / 2 : children;
      zone += (size_t)entries * elem_size + ZONE_SLACK_PER_CONTAINER;
      if (children > 0) {
        depth++;
        remain[depth] = children;
      }
    } else {
      if (payload > n - pos)
        return rumor_err_set(e, RUMOR_EPROTO, "object at byte %zu declares %llu bytes but only %zu remain", at,
                             (unsigned long long)payload, n - pos);
      pos += (size_t)payload;
    }
  }
  if (pos != n) return rumor_err_set(e, RUMOR_EPROTO, "%zu trailing bytes after the message", n - pos);
  if (zone_bytes) *zone_bytes = zone;
  return 0;
}

int net_msg_decode(const uint8_t *data, size_t len, const struct net_msg_limits *lim, struct net_msg *m,
                   struct rumor_err *e) {
  memset(m, 0, sizeof *m);
  size_t zone_bytes = 0;
  int rc = net_mp_validate(data, len, lim, &zone_bytes, e);
  if (rc < 0) return rc;
  if (!msgpack_zone_init(&m->zone, zone_bytes)) return rumor_err_set(e, -ENOMEM, "cannot allocate a %zu-byte zone", zone_bytes);
  m->zone_live = true;
  size_t off = 0;
#ifdef RUMOR_TESTING
  atomic_fetch_add(&g_decoder_calls, 1);
#endif
  msgpack_unpack_return ur = msgpack_unpack((const char *)data, len, &off, &m->zone, &m->obj);
  if (ur != MSGPACK_UNPACK_SUCCESS || off != len || m->obj.type != MSGPACK_OBJECT_MAP) {
    net_msg_free(m);
    return rumor_err_set(e, RUMOR_EPROTO, "msgpack decoder rejected the message (%d)", (int)ur);
  }
  m->root = &m->obj;
  rc = net_msg_get_uint(m, NET_MSG_KEY_TYPE, &m->type);
  if (rc == 0) rc = net_msg_get_uint(m, NET_MSG_KEY_VERSION, &m->version);
  if (rc < 0) {
    net_msg_free(m);
    return rumor_err_set(e, RUMOR_EPROTO, "message lacks an unsigned \"t\" (type) or \"v\" (version)");
  }
  return 0;
}

void net_msg_free(struct net_msg *m) {
  if (m->zone_live) msgpack_zone_destroy(&m->zone);
  memset(m, 0, sizeof *m);
}

/* ---- accessors --------------------------------------------------------------- */

const msgpack_object *net_obj_map_get(const msgpack_object *map, const char *key) {
  if (!map || map->type != MSGPACK_OBJECT_MAP) return NULL;
  size_t kl = strlen(key);
  for (uint32_t i = 0; i < map->via.map.size; i++) {
    const msgpack_object *k = &map->via.map.ptr[i].key;
    /* msgpack-c leaves ptr NULL for an empty string: compare only when non-empty */
    if (k->type == MSGPACK_OBJECT_STR && k->via.str.size == kl && (kl == 0 || memcmp(k->via.str.ptr, key, kl) == 0))
      return &map->via.map.ptr[i].val;
  }
  return NULL;
}

const msgpack_object *net_msg_get(const struct net_msg *m, const char *key) { return net_obj_map_get(m->root, key); }

int net_obj_uint(const msgpack_object *o, uint64_t *out) {
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type != MSGPACK_OBJECT_POSITIVE_INTEGER) return RUMOR_EPROTO;
  *out = o->via.u64;
  return 0;
}

int net_obj_int(const msgpack_object *o, int64_t *out) {
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type == MSGPACK_OBJECT_NEGATIVE_INTEGER) {
    *out = o->via.i64;
    return 0;
  }
  if (o->type == MSGPACK_OBJECT_POSITIVE_INTEGER && o->via.u64 <= (uint64_t)INT64_MAX) {
    *out = (int64_t)o->via.u64;
    return 0;
  }
  return RUMOR_EPROTO;
}

int net_obj_double(const msgpack_object *o, double *out) {
  if (!o) return RUMOR_ENOTFOUND;
  switch (o->type) {
  case MSGPACK_OBJECT_FLOAT32:
  case MSGPACK_OBJECT_FLOAT64: *out = o->via.f64; return 0;
  case MSGPACK_OBJECT_POSITIVE_INTEGER: *out = (double)o->via.u64; return 0;
  case MSGPACK_OBJECT_NEGATIVE_INTEGER: *out = (double)o->via.i64; return 0;
  default: return RUMOR_EPROTO;
  }
}

int net_obj_bool(const msgpack_object *o, bool *out) {
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type != MSGPACK_OBJECT_BOOLEAN) return RUMOR_EPROTO;
  *out = o->via.boolean;
  return 0;
}

int net_obj_str(const msgpack_object *o, const char **s, size_t *len) {
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type != MSGPACK_OBJECT_STR) return RUMOR_EPROTO;
  *s = o->via.str.ptr;
  *len = o->via.str.size;
  return 0;
}

int net_obj_bin(const msgpack_object *o, const uint8_t **p, size_t *len) {
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type != MSGPACK_OBJECT_BIN) return RUMOR_EPROTO;
  *p = (const uint8_t *)o->via.bin.ptr;
  *len = o->via.bin.size;
  return 0;
}

int net_msg_get_uint(const struct net_msg *m, const char *key, uint64_t *out) {
  return net_obj_uint(net_msg_get(m, key), out);
}
int net_msg_get_int(const struct net_msg *m, const char *key, int64_t *out) {
  return net_obj_int(net_msg_get(m, key), out);
}
int net_msg_get_double(const struct net_msg *m, const char *key, double *out) {
  return net_obj_double(net_msg_get(m, key), out);
}
int net_msg_get_bool(const struct net_msg *m, const char *key, bool *out) {
  return net_obj_bool(net_msg_get(m, key), out);
}
int net_msg_get_str(const struct net_msg *m, const char *key, const char **s, size_t *len) {
  return net_obj_str(net_msg_get(m, key), s, len);
}
int net_msg_get_bin(const struct net_msg *m, const char *key, const uint8_t **p, size_t *len) {
  return net_obj_bin(net_msg_get(m, key), p, len);
}

int net_msg_get_array(const struct net_msg *m, const char *key, const msgpack_object **items, uint32_t *n) {
  const msgpack_object *o = net_msg_get(m, key);
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type != MSGPACK_OBJECT_ARRAY) return RUMOR_EPROTO;
  *items = o->via.array.ptr;
  *n = o->via.array.size;
  return 0;
}

int net_msg_get_map(const struct net_msg *m, const char *key, const msgpack_object **map) {
  const msgpack_object *o = net_msg_get(m, key);
  if (!o) return RUMOR_ENOTFOUND;
  if (o->type != MSGPACK_OBJECT_MAP) return RUMOR_EPROTO;
  *map = o;
  return 0;
}

/* ---- builder ------------------------------------------------------------------- */

#define MAP32_HDR 5

void net_msgbuf_init(struct net_msgbuf *b, uint64_t type, uint64_t version) {
  memset(b, 0, sizeof *b);
  msgpack_sbuffer_init(&b->sbuf);
  msgpack_packer_init(&b->pk, &b->sbuf, msgpack_sbuffer_write);
  static const char hdr[MAP32_HDR] = {(char)0xdf, 0, 0, 0, 0}; /* patched in net_msgbuf_data */
  if (msgpack_sbuffer_write(&b->sbuf, hdr, sizeof hdr) != 0) b->failed = true;
  net_msgbuf_put_uint(b, NET_MSG_KEY_TYPE, type);
  net_msgbuf_put_uint(b, NET_MSG_KEY_VERSION, version);
}

msgpack_packer *net_msgbuf_put_key(struct net_msgbuf *b, const char *key) {
  size_t kl = strlen(key);
  if (msgpack_pack_str(&b->pk, kl) != 0 || msgpack_pack_str_body(&b->pk, key, kl) != 0) b->failed = true;
  b->nfields++;
  return &b->pk;
}

void net_msgbuf_put_uint(struct net_msgbuf *b, const char *key, uint64_t v) {
  if (msgpack_pack_uint64(net_msgbuf_put_key(b, key), v) != 0) b->failed = true;
}
void net_msgbuf_put_int(struct net_msgbuf *b, const char *key, int64_t v) {
  if (msgpack_pack_int64(net_msgbuf_put_key(b, key), v) != 0) b->failed = true;
}
void net_msgbuf_put_double(struct net_msgbuf *b, const char *key, double v) {
  if (msgpack_pack_double(net_msgbuf_put_key(b, key), v) != 0) b->failed = true;
}
void net_msgbuf_put_bool(struct net_msgbuf *b, const char *key, bool v) {
  msgpack_packer *pk = net_msgbuf_put_key(b, key);
  if ((v ? msgpack_pack_true(pk) : msgpack_pack_false(pk)) != 0) b->failed = true;
}
void net_msgbuf_put_str(struct net_msgbuf *b, const char *key, const char *s, size_t len) {
  msgpack_packer *pk = net_msgbuf_put_key(b, key);
  if (msgpack_pack_str(pk, len) != 0 || msgpack_pack_str_body(pk, s, len) != 0) b->failed = true;
}
void net_msgbuf_put_bin(struct net_msgbuf *b, const char *key, const void *p, size_t len) {
  msgpack_packer *pk = net_msgbuf_put_key(b, key);
  if (msgpack_pack_bin(pk, len) != 0 || msgpack_pack_bin_body(pk, p, len) != 0) b->failed = true;
}

const uint8_t *net_msgbuf_data(struct net_msgbuf *b, size_t *len) {
  if (b->sbuf.size >= MAP32_HDR) net_be32_put((uint8_t *)b->sbuf.data + 1, b->nfields);
  *len = b->sbuf.size;
  return (const uint8_t *)b->sbuf.data;
}

void net_msgbuf_free(struct net_msgbuf *b) {
  msgpack_sbuffer_destroy(&b->sbuf);
  memset(b, 0, sizeof *b);
}
