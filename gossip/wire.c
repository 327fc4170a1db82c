/*
 * What gossip's messages carry, shared by the runtime and the monitor:
 * member updates, address lists and the sketch seed. Any thread: no state.
 */
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <sodium.h>

#include "gossip/gossip_impl.h"

uint64_t gossip_derive_sketch_seed(const uint8_t cluster_key[NET_CLUSTER_KEY_BYTES]) {
  static const char label[] = "rumor count-sketch seed v1";
  uint8_t out[8];
  crypto_generichash(out, sizeof out, (const uint8_t *)label, sizeof label - 1, cluster_key, NET_CLUSTER_KEY_BYTES);
  uint64_t seed = 0;
  for (int i = 0; i < 8; i++) seed = seed << 8 | out[i];
  return seed;
}

int gossip_split_addrs(const char *list, char **out, size_t max, size_t *nout, struct rumor_err *e) {
  *nout = 0;
  if (!list || !*list) return 0;
  RUMOR_ASSERT(max <= GOSSIP_MAX_BOOTSTRAP);
  char addrs[GOSSIP_MAX_BOOTSTRAP][SWIM_ADDR_MAX]; /* what the member table can hold */
  size_t n;
  if (net_addr_list_split(list, &addrs[0][0], SWIM_ADDR_MAX, max, &n, e)) return rumor_err_prefix(e, "--bootstrap");
  for (size_t i = 0; i < n; i++) out[i] = xstrdup(addrs[i]);
  *nout = n;
  return 0;
}

/* True for 0.0.0.0 and ::, in any spelling inet_pton takes: "every
 * address" to a listener, and no one's address to dial. */
static bool unspecified_host(const char *host) {
  struct in_addr a4;
  struct in6_addr a6;
  if (inet_pton(AF_INET, host, &a4) == 1) return a4.s_addr == htonl(INADDR_ANY);
  if (inet_pton(AF_INET6, host, &a6) == 1) return IN6_IS_ADDR_UNSPECIFIED(&a6);
  return false;
}

int gossip_advertise_check(const char *addr, struct rumor_err *e) {
  char host[NET_HOST_MAX];
  int port;
  int rc = net_addr_check_dial(addr, e);
  if (rc == 0) rc = net_addr_parse(addr, 1, host, sizeof host, &port, e);
  if (rc) return rc;
  if (strlen(addr) >= SWIM_ADDR_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "'%s' is longer than %d characters", addr, SWIM_ADDR_MAX - 1);
  if (unspecified_host(host))
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "'%s': %s means every local address, which others cannot dial; give this host's address or "
                         "name",
                         addr, host);
  return 0;
}

int gossip_listen_advertisable(const char *listen, struct rumor_err *e) {
  char host[NET_HOST_MAX];
  int port;
  int rc = net_addr_parse(listen, 0, host, sizeof host, &port, e);
  if (rc) {
    rumor_err_prefix(e, "--listen"); /* returns 0 when e is NULL: rc is the code */
    return rc;
  }
  if (!host[0] || unspecified_host(host))
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--listen %s does not say which address others should dial; add --advertise HOST:PORT",
                         listen);
  return 0;
}

void gossip_put_updates(struct net_msgbuf *b, const struct swim_update *u, size_t n) {
  msgpack_packer *pk = net_msgbuf_put_key(b, "u");
  msgpack_pack_array(pk, (uint32_t)n);
  for (size_t i = 0; i < n; i++) {
    size_t alen = strnlen(u[i].addr, SWIM_ADDR_MAX - 1);
    msgpack_pack_array(pk, u[i].relay ? 7 : 6); /* the relay flag: only when set, so older builds read the rest */
    msgpack_pack_bin(pk, SWIM_ID_BYTES);
    msgpack_pack_bin_body(pk, u[i].id, SWIM_ID_BYTES);
    msgpack_pack_str(pk, alen);
    msgpack_pack_str_body(pk, u[i].addr, alen);
    msgpack_pack_uint8(pk, (uint8_t)u[i].role);
    msgpack_pack_uint8(pk, (uint8_t)u[i].state);
    msgpack_pack_uint64(pk, u[i].incarnation);
    if (u[i].ready) msgpack_pack_true(pk);
    else msgpack_pack_false(pk);
    if (u[i].relay) msgpack_pack_true(pk);
  }
}

bool gossip_printable(const char *s, size_t n) {
  for (size_t i = 0; i < n; i++)
    if (s[i] < 0x21 || s[i] > 0x7e) return false;
  return true;
}

int gossip_get_updates(const struct net_msg *m, const char *key, struct swim_update *out, size_t max) {
  const msgpack_object *items;
  uint32_t n;
  int rc = net_msg_get_array(m, key, &items, &n);
  if (rc == RUMOR_ENOTFOUND) return 0;
  if (rc) return rc;
  if (n > max) return RUMOR_EPROTO;
  for (uint32_t i = 0; i < n; i++) {
    const msgpack_object *o = &items[i];
    if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size < 6 || o->via.array.size > 7) return RUMOR_EPROTO;
    const msgpack_object *f = o->via.array.ptr;
    const uint8_t *id;
    const char *addr;
    size_t idlen, alen;
    uint64_t role, state, inc;
    bool ready, relay = false;
    if (o->via.array.size == 7 && net_obj_bool(&o->via.array.ptr[6], &relay)) return RUMOR_EPROTO;
    if (net_obj_bin(&f[0], &id, &idlen) || idlen != SWIM_ID_BYTES || net_obj_str(&f[1], &addr, &alen) ||
        alen >= SWIM_ADDR_MAX || !gossip_printable(addr, alen) || net_obj_uint(&f[2], &role) ||
        role > SWIM_ROLE_BOOTSTRAP || net_obj_uint(&f[3], &state) || state > SWIM_LEFT || net_obj_uint(&f[4], &inc) ||
        net_obj_bool(&f[5], &ready))
      return RUMOR_EPROTO;
    memset(&out[i], 0, sizeof out[i]);
    memcpy(out[i].id, id, SWIM_ID_BYTES);
    memcpy(out[i].addr, addr, alen);
    out[i].role = (enum swim_role)role;
    out[i].state = (enum swim_state)state;
    out[i].incarnation = inc;
    out[i].ready = ready;
    out[i].relay = relay;
  }
  return (int)n;
}

int gossip_send_request(net_conn_t *c, uint64_t type, uint64_t q) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, type, GOSSIP_PROTO_VERSION);
  net_msgbuf_put_uint(&b, "q", q);
  int rc = net_conn_send_msg(c, &b);
  net_msgbuf_free(&b);
  return rc;
}
