/*
 * ps_impl.h — the parameter server's wire format, shared by server.c and
 * client.c (private to peer/ps/).
 *
 * Control messages (net msgpack maps, "v" = PS_PROTO_VERSION):
 *   HELLO   worker → server: model (canonical spec), nparams, range, ranges,
 *           clock (gradients pushed so far), steps (schedule length),
 *           optim (text of the optimizer settings, compared as is), and for
 *           a group's stage: stage, stages (absent: 0/1, a whole replica)
 *   WELCOME server → worker: lo, hi (within the worker's vector), version,
 *           clock (the server's clock for this worker), staleness (-1:
 *           none), workers
 *   REJECT  server → worker: why (then the server closes)
 *   PULL    worker → server: clock (we want the parameters to compute
 *           gradient number `clock`), final (the last pull: no bound), wire
 *   DONE    worker → server: clock
 *   PING    either way, every PS_PING_MS
 *   STATUS_REQ  a monitor (rumor top --servers) → server, instead of HELLO
 *   STATUS  server → monitor: range, ranges, stage, stages, version,
 *           staleness, workers (expected), max_gap, w: [[key (bin 32), clock, live, done], ...]
 * Bulk transfers carry PS_META_BYTES of metadata (little-endian):
 *   u32 magic, u16 protocol version, u16 kind, i64 a, i64 b, i64 c
 *   GRAD   (worker → server): a = gradient number, b = rows, c = 0;
 *          count = the server's range length
 *   PARAMS (server → worker): a = the clock the worker is at from now on,
 *          b = the server's version, c = the clock gap at the release
 */
#ifndef RUMOR_PEER_PS_IMPL_H
#define RUMOR_PEER_PS_IMPL_H

#include <string.h>

#include "peer/pipeline/pipeline.h"
#include "peer/ps/ps.h"

enum {
  PS_MSG_HELLO = 1,
  PS_MSG_WELCOME = 2,
  PS_MSG_REJECT = 3,
  PS_MSG_PULL = 4,
  PS_MSG_DONE = 5,
  PS_MSG_PING = 6,
  PS_MSG_STATUS_REQ = 7,
  PS_MSG_STATUS = 8,
};
_Static_assert(PS_MSG_HELLO == 1 && PS_MSG_WELCOME == 2 && PS_MSG_REJECT == 3 && PS_MSG_PULL == 4 &&
                   PS_MSG_DONE == 5 && PS_MSG_PING == 6 && PS_MSG_STATUS_REQ == 7 && PS_MSG_STATUS == 8,
               "parameter-server message numbers travel on the wire");
#define PS_PROTO_VERSION 1

enum { PS_KIND_GRAD = 1, PS_KIND_PARAMS = 2 };
_Static_assert(PS_KIND_GRAD == 1 && PS_KIND_PARAMS == 2, "transfer kinds travel on the wire");

#define PS_META_MAGIC 0x31535052u /* "RPS1" */
#define PS_META_BYTES 32
#define PS_MAX_MSG_BYTES (64u << 10) /* our messages are tiny */
#define PS_WHY_MAX 400
#define PS_STATUS_MAX_WORKERS 1024 /* workers listed in a STATUS (about 46 bytes each) */
#define PS_OPTIM_TEXT_MAX 256

struct ps_meta {
  uint16_t kind;
  int64_t a, b, c;
};


static inline void ps_meta_write(uint8_t out[PS_META_BYTES], const struct ps_meta *m) {
  uint32_t magic = PS_META_MAGIC;
  for (int i = 0; i < 4; i++) out[i] = (uint8_t)(magic >> (8 * i));
  out[4] = (uint8_t)PS_PROTO_VERSION, out[5] = 0;
  out[6] = (uint8_t)m->kind, out[7] = (uint8_t)(m->kind >> 8);
  le_put_u64(out + 8, (uint64_t)m->a);
  le_put_u64(out + 16, (uint64_t)m->b);
  le_put_u64(out + 24, (uint64_t)m->c);
}

/* Returns 0, or -1 when the blob is not a metadata header of ours. */
static inline int ps_meta_read(const uint8_t *p, size_t len, struct ps_meta *m) {
  if (len != PS_META_BYTES) return -1;
  uint32_t magic = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  if (magic != PS_META_MAGIC || p[4] != PS_PROTO_VERSION || p[5] != 0) return -1;
  m->kind = (uint16_t)(p[6] | p[7] << 8);
  m->a = (int64_t)le_get_u64(p + 8);
  m->b = (int64_t)le_get_u64(p + 16);
  m->c = (int64_t)le_get_u64(p + 24);
  return 0;
}

#define PS_ADDR_MAX 128 /* bytes of a server address, NUL included */

/* Splits --servers "A,B,..." into addrs[0..*n) (each passing
 * net_addr_check_dial, at most PS_MAX_SERVERS). Returns 0 or RUMOR_EFORMAT
 * naming the flag and the bad entry. */
int ps_servers_parse(const char *list, char (*addrs)[PS_ADDR_MAX], int *n, struct rumor_err *e) RUMOR_MUST_CHECK;

/* The optimizer settings a worker and a server must agree on, as text. */
void ps_optim_text(const struct optim_config *o, char *buf, size_t n);

/* A message field as a bounded string (copied, NUL-terminated). Returns 0 or
 * RUMOR_EPROTO when absent, not a string or too long. */
int ps_msg_str(const struct net_msg *m, const char *key, char *out, size_t n) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_PS_IMPL_H */
