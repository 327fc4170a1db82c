/*
 * Fuzz harness: gossip's member-update decoder (gossip_get_updates), fed the
 * control messages net_msg_decode accepts, as SWIM's PING / ACK / PING-REQ /
 * JOIN-OK / MEMBERS handlers feed it. Any input must be either refused (a
 * negative code) or decoded into updates that keep the decoder's promises:
 * at most `max` of them, the id the 32 bytes on the wire, the address
 * NUL-terminated, printable and the bytes on the wire, role and state in
 * range, the relay flag the seventh field's (false without one); and the same updates encoded again (gossip_put_updates) decode to
 * themselves. A broken promise aborts; nothing may crash, leak or read
 * outside the message.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"
#include "tests/fuzz/fuzz.h"

#define MAX_UPDATES (SWIM_MAX_MEMBERS + 1) /* what JOIN-OK and MEMBERS allow */

static struct swim_update g_out[MAX_UPDATES], g_again[MAX_UPDATES];

/* Checks update `u`, decoded from wire entry `o`; aborts on a broken promise. */
static void check_update(const struct swim_update *u, const msgpack_object *o) {
  /* Six fields, or seven with the relay flag (written only when set). */
  if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size < 6 || o->via.array.size > 7) abort();
  const msgpack_object *f = o->via.array.ptr;
  bool relay = o->via.array.size == 7 && f[6].type == MSGPACK_OBJECT_BOOLEAN && f[6].via.boolean;
  if ((o->via.array.size == 7 && f[6].type != MSGPACK_OBJECT_BOOLEAN) || u->relay != relay) abort();
  if (f[0].type != MSGPACK_OBJECT_BIN || f[0].via.bin.size != SWIM_ID_BYTES ||
      memcmp(u->id, f[0].via.bin.ptr, SWIM_ID_BYTES) != 0)
    abort();
  const char *nul = memchr(u->addr, '\0', sizeof u->addr);
  if (!nul) abort();
  size_t alen = (size_t)(nul - u->addr);
  if (f[1].type != MSGPACK_OBJECT_STR || f[1].via.str.size != alen || memcmp(u->addr, f[1].via.str.ptr, alen) != 0)
    abort();
  for (size_t i = 0; i < alen; i++)
    if (u->addr[i] < 0x21 || u->addr[i] > 0x7e) abort();
  if ((unsigned)u->role > SWIM_ROLE_BOOTSTRAP || (unsigned)u->state > SWIM_LEFT) abort();
}

/* Encodes out[0..n) as a message of `type` and decodes it again: it must
 * come back the same. */
static void round_trip(uint64_t type, const struct swim_update *out, int n) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, type, GOSSIP_PROTO_VERSION);
  gossip_put_updates(&b, out, (size_t)n);
  size_t len;
  const uint8_t *p = net_msgbuf_data(&b, &len);
  struct net_msg m;
  struct rumor_err e = {0};
  if (b.failed || net_msg_decode(p, len, NULL, &m, &e) != 0) abort();
  if (gossip_get_updates(&m, "u", g_again, MAX_UPDATES) != n) abort();
  for (int i = 0; i < n; i++) {
    const struct swim_update *x = &out[i], *y = &g_again[i];
    if (memcmp(x->id, y->id, SWIM_ID_BYTES) != 0 || strcmp(x->addr, y->addr) != 0 || x->role != y->role ||
        x->state != y->state || x->incarnation != y->incarnation || x->ready != y->ready || x->relay != y->relay)
      abort();
  }
  net_msg_free(&m);
  net_msgbuf_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct net_msg m;
  struct rumor_err e = {0};
  bool verbose = getenv("RUMOR_FUZZ_VERBOSE") != NULL; /* say what became of each input */
  if (net_msg_decode(data, size, NULL, &m, &e) != 0) {
    if (verbose) fprintf(stderr, "not a message: %s\n", e.msg);
    return 0;
  }
  int n = gossip_get_updates(&m, "u", g_out, MAX_UPDATES);
  if (verbose) fprintf(stderr, "updates: %d\n", n);
  if (n > MAX_UPDATES) abort();
  if (n >= 0) {
    const msgpack_object *items = NULL;
    uint32_t count = 0;
    if (n > 0 && (net_msg_get_array(&m, "u", &items, &count) != 0 || count != (uint32_t)n)) abort();
    for (int i = 0; i < n; i++) check_update(&g_out[i], &items[i]);
    round_trip(m.type, g_out, n);
  }
  /* With a piggyback-sized table (PING / ACK): the same answer, or a
   * refusal when there are more updates than fit. */
  int small = gossip_get_updates(&m, "u", g_again, SWIM_MAX_PIGGYBACK);
  bool fits = n >= 0 && n <= SWIM_MAX_PIGGYBACK;
  if (fits ? small != n : small >= 0) abort();
  net_msg_free(&m);
  return 0;
}
