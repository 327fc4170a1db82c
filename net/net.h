/*
 * net — rumor's authenticated, encrypted transport: libuv TCP connections,
 * a mutually authenticated handshake bound to a cluster key, AEAD framing,
 * msgpack control messages and streaming of large float buffers.
 *
 * It also holds the parser of HTTP request heads that the metrics endpoint
 * and `rumor top --web` read (a pure function, below).
 *
 * net knows nothing of tensors, models or gossip. It depends on util, libuv,
 * libsodium, OpenSSL's libcrypto (the frames' AEAD) and msgpack-c. The wire
 * format and the security argument are in docs/net.md.
 *
 * Threads: every function here must be called on the thread that runs the
 * net's loop ("the loop thread"), except the key/file helpers, the message
 * builder and decoder and the HTTP parser (any thread, no shared state) and
 * net_call (any thread).
 * Every callback runs on the loop thread.
 *
 * Errors: functions return 0 or a negative code (-errno or RUMOR_E*, see
 * util.h). If a function that takes a callback fails, the callback is never
 * called. Once it succeeds, the callback is called exactly once.
 */
#ifndef RUMOR_NET_H
#define RUMOR_NET_H

#include <msgpack.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <uv.h>

#include "util/util.h"

/* ============================================================================
 * Keys
 * ========================================================================== */

#define NET_PUBKEY_BYTES 32      /* Ed25519 public key: a peer's identity */
#define NET_SECKEY_BYTES 64      /* Ed25519 secret key (libsodium layout) */
#define NET_SEED_BYTES 32        /* the secret seed the identity file stores */
#define NET_CLUSTER_KEY_BYTES 32 /* shared admission secret of one cluster */
/* Public keys are written everywhere (keygen output, allow-lists, logs) as
 * standard padded base64: 44 characters. */
#define NET_PUBKEY_STR_LEN 44
#define NET_KEYFILE_MAX 4096     /* key files are tiny; larger ones are refused */
#define NET_ALLOWLIST_MAX (1u << 20)

/* A static identity. `sk` is secret: wipe with net_identity_wipe. */
struct net_identity {
  uint8_t pk[NET_PUBKEY_BYTES];
  uint8_t sk[NET_SECKEY_BYTES];
};

/* A set of admitted public keys (sorted; duplicates removed). */
struct net_allowlist {
  size_t n;
  uint8_t (*keys)[NET_PUBKEY_BYTES];
};

/* libsodium must be initialised once per process before any other call;
 * net_init and the key functions do it themselves. Returns 0 or -EIO. */
int net_crypto_init(void) RUMOR_MUST_CHECK;

/* Fresh random identity / cluster key. Returns 0 or a negative code. */
int net_identity_generate(struct net_identity *id) RUMOR_MUST_CHECK;
int net_cluster_key_generate(uint8_t key[NET_CLUSTER_KEY_BYTES]) RUMOR_MUST_CHECK;
void net_identity_wipe(struct net_identity *id);
/* A key pair derived from `parent` for one use: its seed is BLAKE2b-256 of
 * `label`, keyed with the parent's secret seed (the first NET_SEED_BYTES of
 * its secret key), so whoever holds the parent's identity file can derive
 * it, and different labels (a pipeline stage's, a group communicator
 * member's) never give the same key. */
void net_identity_derive(const struct net_identity *parent, const char *label, struct net_identity *out);

/* Writes a secret file with mode 0600, atomically: it appears complete or not
 * at all. Unless `force`, an existing file is never replaced (-EEXIST, with a
 * message that names --force). Formats: see docs/net.md. */
int net_identity_save(const char *path, const struct net_identity *id, bool force,
                      struct rumor_err *e) RUMOR_MUST_CHECK;
int net_cluster_key_save(const char *path, const uint8_t key[NET_CLUSTER_KEY_BYTES], bool force,
                         struct rumor_err *e) RUMOR_MUST_CHECK;

/* Loads a secret file written by the functions above. Refuses (-EACCES) a
 * file that group or others may read or write, RUMOR_EFORMAT / RUMOR_ECORRUPT
 * a malformed one, each with a message naming the file. */
int net_identity_load(const char *path, struct net_identity *id, struct rumor_err *e) RUMOR_MUST_CHECK;
int net_cluster_key_load(const char *path, uint8_t key[NET_CLUSTER_KEY_BYTES],
                         struct rumor_err *e) RUMOR_MUST_CHECK;

/* Allow-list file: one public key per line; '#' starts a comment (whole line
 * or after the key); blank lines are ignored. A bad line is RUMOR_EFORMAT with
 * "FILE:LINE: ..." in the message. Free with net_allowlist_free. */
int net_allowlist_load(const char *path, struct net_allowlist *al, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Builds an allow-list from `n` keys (copied). */
void net_allowlist_from_keys(struct net_allowlist *al, const uint8_t (*keys)[NET_PUBKEY_BYTES], size_t n);
bool net_allowlist_contains(const struct net_allowlist *al, const uint8_t pk[NET_PUBKEY_BYTES]);
void net_allowlist_free(struct net_allowlist *al);

/* Text form of a public key: writes NET_PUBKEY_STR_LEN characters and a NUL. */
void net_pubkey_format(char out[NET_PUBKEY_STR_LEN + 1], const uint8_t pk[NET_PUBKEY_BYTES]);
/* Parses exactly one canonical text key (no surrounding space). Returns 0 or
 * RUMOR_EFORMAT. */
int net_pubkey_parse(const char *s, size_t len, uint8_t pk[NET_PUBKEY_BYTES]) RUMOR_MUST_CHECK;

/* ============================================================================
 * Control messages: msgpack maps with a type ("t") and a version ("v")
 * ========================================================================== */

#define NET_MSG_KEY_TYPE "t"
#define NET_MSG_KEY_VERSION "v"
#define NET_MSG_MAX_DEPTH 16          /* nesting depth; the top map is depth 1 */
#define NET_MSG_DEFAULT_MAX_ELEMS 65536 /* objects in one message, all levels */

/* Limits for the validation pass. Zero fields take the defaults above. */
struct net_msg_limits {
  uint32_t max_depth;
  uint32_t max_elems;
};

/* A received, validated and decoded message. Valid only inside the callback
 * that received it (its strings point into the frame); net_msg_decode's
 * callers free it with net_msg_free. */
struct net_msg {
  uint64_t type;
  uint64_t version;
  const msgpack_object *root; /* the top-level map */
  /* private */
  msgpack_zone zone;
  msgpack_object obj;
  bool zone_live;
};

/* Validates data[0..len) without allocating (every declared length against
 * the bytes remaining, depth, element count, no ext types, exactly one
 * top-level map, no trailing bytes), only then decodes it with msgpack-c into
 * a zone sized from the validated input, and checks the "t" and "v" fields
 * (unsigned integers). `data` must outlive `m`. Returns 0, or RUMOR_EPROTO /
 * RUMOR_ETOOBIG with the reason in `e`; on failure `m` holds nothing. */
int net_msg_decode(const uint8_t *data, size_t len, const struct net_msg_limits *lim,
                   struct net_msg *m, struct rumor_err *e) RUMOR_MUST_CHECK;
void net_msg_free(struct net_msg *m);

/* Typed access by key. Each returns 0, RUMOR_ENOTFOUND when the key is absent,
 * or RUMOR_EPROTO when the value has another type or does not fit. Strings
 * and binaries are not NUL-terminated; they point into the message. */
const msgpack_object *net_msg_get(const struct net_msg *m, const char *key);
int net_msg_get_uint(const struct net_msg *m, const char *key, uint64_t *out) RUMOR_MUST_CHECK;
int net_msg_get_int(const struct net_msg *m, const char *key, int64_t *out) RUMOR_MUST_CHECK;
/* Accepts float32, float64 and integers. */
int net_msg_get_double(const struct net_msg *m, const char *key, double *out) RUMOR_MUST_CHECK;
int net_msg_get_bool(const struct net_msg *m, const char *key, bool *out) RUMOR_MUST_CHECK;
int net_msg_get_str(const struct net_msg *m, const char *key, const char **s, size_t *len) RUMOR_MUST_CHECK;
int net_msg_get_bin(const struct net_msg *m, const char *key, const uint8_t **p, size_t *len) RUMOR_MUST_CHECK;
int net_msg_get_array(const struct net_msg *m, const char *key, const msgpack_object **items,
                      uint32_t *n) RUMOR_MUST_CHECK;
int net_msg_get_map(const struct net_msg *m, const char *key, const msgpack_object **map) RUMOR_MUST_CHECK;
/* The same checks on any object (an array item, a nested map's value). */
int net_obj_uint(const msgpack_object *o, uint64_t *out) RUMOR_MUST_CHECK;
int net_obj_int(const msgpack_object *o, int64_t *out) RUMOR_MUST_CHECK;
int net_obj_double(const msgpack_object *o, double *out) RUMOR_MUST_CHECK;
int net_obj_bool(const msgpack_object *o, bool *out) RUMOR_MUST_CHECK;
int net_obj_str(const msgpack_object *o, const char **s, size_t *len) RUMOR_MUST_CHECK;
int net_obj_bin(const msgpack_object *o, const uint8_t **p, size_t *len) RUMOR_MUST_CHECK;
/* Value of `key` in a map object, or NULL. */
const msgpack_object *net_obj_map_get(const msgpack_object *map, const char *key);

/* Builds one message. The map header is written last, so fields need not be
 * counted in advance. Keys must be unique; "t" and "v" are written by init.
 * Allocation failures are remembered and reported by net_conn_send_msg
 * (-ENOMEM). */
struct net_msgbuf {
  msgpack_sbuffer sbuf;
  msgpack_packer pk;
  uint32_t nfields;
  bool failed;
};
void net_msgbuf_init(struct net_msgbuf *b, uint64_t type, uint64_t version);
void net_msgbuf_put_uint(struct net_msgbuf *b, const char *key, uint64_t v);
void net_msgbuf_put_int(struct net_msgbuf *b, const char *key, int64_t v);
void net_msgbuf_put_double(struct net_msgbuf *b, const char *key, double v);
void net_msgbuf_put_bool(struct net_msgbuf *b, const char *key, bool v);
void net_msgbuf_put_str(struct net_msgbuf *b, const char *key, const char *s, size_t len);
void net_msgbuf_put_bin(struct net_msgbuf *b, const char *key, const void *p, size_t len);
/* Writes `key` and returns the packer: the caller packs exactly one value
 * (an array, a nested map, ...) with the msgpack_pack_* functions. */
msgpack_packer *net_msgbuf_put_key(struct net_msgbuf *b, const char *key);
/* The finished encoding; valid until the next put or free. */
const uint8_t *net_msgbuf_data(struct net_msgbuf *b, size_t *len);
void net_msgbuf_free(struct net_msgbuf *b);

/* ============================================================================
 * Addresses: "host:port", "[v6addr]:port", or ":port" (to listen on every
 * IPv4 address). Hosts may be names. These parse and check text only and
 * may be called from any thread, except net_addr_resolve (the caller's loop).
 * Their messages quote the address; callers prefix the flag it came from.
 * ========================================================================== */

#define NET_HOST_MAX 256 /* bytes of a host, NUL included */

/* Splits `s` into host[0..hostcap) (an IPv6 address without its brackets;
 * "" for ":port") and *port, a number in [min_port, 65535]. A host with a
 * space or a control character is refused. Returns 0, or RUMOR_EFORMAT. */
int net_addr_parse(const char *s, int min_port, char *host, size_t hostcap, int *port,
                   struct rumor_err *e) RUMOR_MUST_CHECK;
/* Checks that `s` can be listened on: net_addr_parse's forms, port 0 (any)
 * allowed (names are not resolved). Returns 0, or RUMOR_EFORMAT. */
int net_addr_check_listen(const char *s, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Checks that `s` can be dialed: a host and a port in [1, 65535] (names are
 * not resolved). Returns 0, or RUMOR_EFORMAT. */
int net_addr_check_dial(const char *s, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Checks a comma-separated list of addresses to dial (--bootstrap,
 * --servers): no empty entry, each one passing net_addr_check_dial.
 * Returns 0, or RUMOR_EFORMAT naming the first bad entry. */
int net_addr_list_check(const char *list, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Checks `list` as net_addr_list_check does and copies its entries, in
 * order, into `out`: at most `max` rows of `width` bytes each, entry i
 * NUL-terminated at out + i·width; *n gets the count. More than `max`
 * entries, or one of `width` bytes or more, is refused. Returns 0, or
 * RUMOR_EFORMAT (out then holds nothing the caller may use). */
int net_addr_list_split(const char *list, char *out, size_t width, size_t max, size_t *n,
                        struct rumor_err *e) RUMOR_MUST_CHECK;
/* Parses an address to listen on (port 0: any) and resolves its host, names
 * synchronously through `loop`'s resolver (":port" is 0.0.0.0). Returns 0,
 * RUMOR_EFORMAT, or a libuv error when the name does not resolve. */
int net_addr_resolve(uv_loop_t *loop, const char *s, struct sockaddr_storage *ss,
                     struct rumor_err *e) RUMOR_MUST_CHECK;

/* ============================================================================
 * HTTP requests: the parser behind gossip's small HTTP server (the metrics
 * endpoint, `rumor top --web`). A pure function over untrusted bytes: no
 * allocation, no I/O, no state, any thread; every pointer it returns points
 * into the input. It reads the head of one HTTP/1.x request (the request
 * line and the header fields, up to the blank line); a body, and whatever
 * follows the head (a pipelined request), are the caller's, which answers
 * one request per connection. Fuzzed (tests/fuzz/fuzz_http.c).
 * ========================================================================== */

/* The longest head read: one that has not ended within this many bytes is
 * answered 431. */
#define NET_HTTP_HEAD_MAX 8192

enum net_http_method { NET_HTTP_OTHER = 0, NET_HTTP_GET, NET_HTTP_HEAD };

struct net_http_request {
  /* 0 while the request is good so far; else the status to answer now:
   * 400 (a control byte or NUL, a CR not before LF, a malformed request
   * line or header line, a folded line, a second Host, an HTTP/1.1
   * request without Host), 405 (a method other than GET and HEAD) or 431
   * (no blank line within NET_HTTP_HEAD_MAX bytes). Decided in the order
   * the bytes come: the first fault in the stream is the one reported. */
  int status;
  const char *reason;  /* with a status: a static line for the answer's body, e.g. "bad request line\n" */
  bool complete;       /* the head ended within the input, at head_len bytes */
  size_t head_len;     /* bytes of the head, its blank line included */
  enum net_http_method method;
  int minor_version;   /* 0 or 1: HTTP/1.0 or HTTP/1.1 */
  const char *target;  /* the request target as sent ("/state.json?x=1") */
  size_t target_len;
  const char *path;    /* the target before any '?' */
  size_t path_len;
  const char *host;    /* the Host field's value without surrounding white space; NULL when absent */
  size_t host_len;
};

/* Parses the request head at the start of buf[0..len). `len` may be any
 * prefix of what the client sent so far, and the answer is one of: need
 * more bytes (status 0, !complete), answer now with `status`, or a
 * complete, good head (status 0, complete: method, target, path and host
 * are set). Results are stable as bytes arrive: a prefix of a good head is
 * never refused, and a refusal stays the same refusal with more bytes. Reads
 * at most NET_HTTP_HEAD_MAX bytes of `buf`. */
void net_http_parse(const void *buf, size_t len, struct net_http_request *req);

/* Whether a Host value (the parser's `host`) names a loopback address:
 * "localhost", "[::1]" or "127." followed by digits and dots, each with or
 * without ":port" (case-insensitive for localhost). A server bound to
 * loopback answers only those, so that a web page whose name was re-bound
 * to 127.0.0.1 (DNS rebinding) cannot read it from a browser. */
bool net_http_host_is_loopback(const char *host, size_t len);

/* ============================================================================
 * The transport
 * ========================================================================== */

typedef struct net net_t;
typedef struct net_conn net_conn_t;

/* Wire encodings of bulk float buffers. The buffers themselves are float32 on
 * both ends; f16 and bf16 halve the bytes on the wire (converted on the fly,
 * round to nearest even). i8 is block-wise 8-bit: each block of
 * NET_I8_BLOCK values travels as a float32 scale (absmax / 127) and one
 * signed byte per value (round to nearest); a block holding a NaN or an
 * infinity arrives as all NaN (docs/net.md). Values pinned: they travel on
 * the wire. */
enum net_dtype { NET_DTYPE_F32 = 1, NET_DTYPE_F16 = 2, NET_DTYPE_BF16 = 3, NET_DTYPE_I8 = 4 };
#define NET_I8_BLOCK 128 /* values per i8 block (the last block of a chunk may be shorter) */

/* Encoded bytes of `n` values in dtype `d`: 4n, 2n, or for i8 n plus 4 per
 * block (a chunk's blocks start at its first value, so this is exact for
 * any chunk). 0 for an unknown dtype; UINT64_MAX when the size does not fit
 * in 64 bits (callers compare it with a limit). */
uint64_t net_dtype_bytes(enum net_dtype d, uint64_t n);
/* "f32", "f16", "bf16", "i8", or "unknown". */
const char *net_dtype_name(enum net_dtype d);
/* Replaces x[0..n) by what a receiver gets when they travel as one
 * transfer in dtype `d` (encoded and decoded in place; i8 blocks start at
 * x[0]); f32 leaves them as they are. Any thread. */
void net_dtype_roundtrip(enum net_dtype d, float *x, size_t n);

/* Why a handshake failed (counted in net_stats.hs_fail). */
enum net_hs_fail {
  NET_HS_FAIL_TIMEOUT = 0,   /* no complete handshake within the timeout */
  NET_HS_FAIL_CLOSED,        /* connection closed or reset during the handshake */
  NET_HS_FAIL_MALFORMED,     /* bad magic, size or message order */
  NET_HS_FAIL_VERSION,       /* no protocol version (or cipher) in common */
  NET_HS_FAIL_CLUSTER,       /* the other side does not hold our cluster key */
  NET_HS_FAIL_AUTH,          /* decryption, signature or key confirmation failed */
  NET_HS_FAIL_NOT_ALLOWED,   /* the peer's key is not on our allow-list */
  NET_HS_FAIL_REJECTED,      /* the peer refused us (sent a reject, or closed after our proof) */
  NET_HS_FAIL_SELF,          /* the peer has our own identity key */
  NET_HS_FAIL_BUSY,          /* too many unauthenticated connections */
  NET_HS_FAIL__COUNT
};
const char *net_hs_fail_name(enum net_hs_fail f);

/* Cipher suites for the transport frames (bit mask). */
enum net_suite { NET_SUITE_AES256GCM = 1u << 0, NET_SUITE_CHACHA20POLY1305 = 1u << 1 };

struct net_config {
  /* Required. Copied by net_init (the secret key too; wiped on close). */
  const struct net_identity *identity;
  const uint8_t *cluster_key; /* NET_CLUSTER_KEY_BYTES */
  /* Optional: when set, only these keys are admitted, in both directions. */
  const struct net_allowlist *allow;

  size_t max_msg_bytes;          /* largest control message (default 1 MiB) */
  uint64_t max_bulk_bytes;       /* largest inbound bulk payload on the wire (default 16 GiB) */
  size_t bulk_chunk_bytes;       /* payload bytes per outbound bulk frame (default 1 MiB) */
  size_t max_queued_bytes;       /* outbound bytes queued per connection (default 8 MiB) */
  uint32_t max_pending_handshakes; /* concurrent unauthenticated connections (default 64) */
  uint32_t max_conns;            /* open connections, all states (default 1024) */
  uint32_t handshake_timeout_ms; /* default 10000 */
  uint32_t idle_timeout_ms;      /* no byte in or out for this long drops an open connection;
                                    0 = never (default 120000) */
  uint32_t close_linger_ms;      /* graceful close waits this long for the peer (default 2000) */
  /* The heartbeat (protocol version 3; docs/net.md, "Heartbeat"). An open
   * connection that has sent nothing for heartbeat_ms sends a PING; a peer
   * that pings us and from which nothing has arrived for dead_after_ms (or
   * 4 times the interval it announced, when that is longer) is judged dead:
   * the connection is aborted with RUMOR_ETIMEDOUT (net_conn_judged_dead).
   * Any byte received counts as life, the bytes of a frame still arriving
   * too. heartbeat_ms 0 turns it off on this side: no PINGs, no verdicts.
   * Otherwise dead_after_ms must exceed heartbeat_ms. */
  uint32_t heartbeat_ms;         /* default 250 */
  uint32_t dead_after_ms;        /* default 1000 */
  /* Spare outbound chunk buffers (net_stats.spare_frame_bytes) that no
   * transfer needed for a whole window of this many ms are freed: a burst
   * of transfers at once (a state donation beside a ring round) keeps its
   * buffers, a MiB each, only until the traffic is back to what it was.
   * 0 keeps them until net_close (default 10000). */
  uint32_t spare_frame_decay_ms;
  uint32_t suites;               /* enum net_suite mask allowed (default both) */
  int sock_buf_bytes;            /* SO_SNDBUF/SO_RCVBUF; 0 = the system's (default 0) */
  bool relay;                    /* relay circuits for members that cannot accept connections
                                    (net_relay_listen; default false) */
  uint64_t relay_rate_bytes;     /* a relay forwards at most this many bytes per second from one
                                    peer (0 = no cap; default 0): a peer over it is read no faster */
  bool offload;                  /* seal and open bulk chunks on libuv's thread pool, so
                                    crypto and hashing use more than the loop's core
                                    (default true; UV_THREADPOOL_SIZE sets the pool) */
  struct net_msg_limits msg_limits;
};
void net_config_defaults(struct net_config *c);

/* What a receiver learns when a bulk transfer starts. */
struct net_bulk_info {
  uint64_t id;           /* unique per connection and direction */
  uint64_t count;        /* float32 elements */
  enum net_dtype wire;
  bool digest;           /* the transfer digest (over the chunks' AEAD tags) will be checked at the end */
  const uint8_t *meta;   /* the sender's metadata blob, valid during the callback */
  size_t meta_len;
};

/* Application callbacks. Any may be NULL except where said. `ud` is the
 * pointer given to net_init. */
struct net_callbacks {
  /* An inbound connection finished its handshake, or the net opened one to
   * a relay for itself (net_dial_via, net_relay_listen). The peer's key,
   * address and user data are available through the net_conn_* getters. */
  void (*on_accept)(net_conn_t *c, void *ud);
  /* A control message arrived on an open connection. `m` is valid only
   * during the call. */
  void (*on_message)(net_conn_t *c, const struct net_msg *m, void *ud);
  /* A bulk transfer starts. Return 0 and set *dst to a buffer of
   * info->count floats (and *dst_arg to anything) to accept it; return a
   * negative code to refuse it (the sender's completion reports the refusal).
   * NULL callback: every transfer is refused. The buffer must stay valid
   * until on_bulk_done for this id. */
  int (*on_bulk_begin)(net_conn_t *c, const struct net_bulk_info *info, float **dst,
                       void **dst_arg, void *ud);
  /* An accepted inbound transfer ended. status 0: dst holds the complete,
   * digest-checked buffer. Any other status (cut, corrupt, canceled, closed):
   * dst holds garbage and must not be used. Called exactly once per accepted
   * transfer, also when the connection or the net closes. */
  void (*on_bulk_done)(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud);
  /* A connection that was reported open (on_accept or a successful dial)
   * is closed: status 0 for a graceful close by either side (BYE exchanged),
   * else the reason; `detail` says more. The connection is freed after this
   * returns. */
  void (*on_close)(net_conn_t *c, int status, const char *detail, void *ud);
};

/* Creates a net on `loop` (owned by the caller, which runs it). Returns 0 and
 * *out, or a negative code with a message in `e`. When SIGPIPE still has its
 * default action it is set to ignored (process-wide), so that writing to a
 * peer that vanished fails with EPIPE instead of killing the process. */
int net_init(net_t **out, uv_loop_t *loop, const struct net_config *cfg,
             const struct net_callbacks *cbs, void *ud, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Listens on "host:port", "[v6addr]:port" or ":port" (all IPv4 addresses);
 * port 0 picks a free port (see net_listen_port). Names are resolved
 * synchronously. One listener per net. */
int net_listen(net_t *n, const char *addr, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The bound port of the listener, or 0 when not listening. */
int net_listen_port(const net_t *n);

/* Dials "host:port" or "[v6addr]:port" (names resolved with uv_getaddrinfo;
 * each address tried in turn). `cb` gets the open, authenticated connection
 * with status 0, or NULL and a negative status with a reason in `detail` (a
 * handshake failure is RUMOR_EAUTH, RUMOR_EPROTO or RUMOR_ETIMEDOUT). */
typedef void (*net_dial_cb)(net_t *n, net_conn_t *c, int status, const char *detail, void *arg);
int net_dial(net_t *n, const char *addr, net_dial_cb cb, void *arg) RUMOR_MUST_CHECK;

/* ---- relays ----------------------------------------------------------------
 * A peer that cannot accept connections (behind a NAT) keeps a connection to
 * a relay (a member with net_config.relay) and is reached through it: a
 * circuit carries a whole connection — handshake, frames, bulk — sealed end
 * to end, so the relay forwards bytes it can drop but can neither read nor
 * forge (docs/net.md, "Relays"). Such a peer's address is written
 * "@HOST:PORT", the relay's address behind NET_RELAY_ADDR_PREFIX. */
#define NET_RELAY_ADDR_PREFIX '@'

/* Dials `target` through the relay at `relay` ("host:port"): reuses this
 * net's connection to the relay or dials one (which the application then
 * learns of through on_accept, as an ordinary connection to that member).
 * `cb` as for net_dial; a relay that holds no registration for the target
 * fails it with -EHOSTUNREACH, a peer that answers with another key with
 * RUMOR_EAUTH. */
int net_dial_via(net_t *n, const char *relay, const uint8_t target[NET_PUBKEY_BYTES], net_dial_cb cb,
                 void *arg) RUMOR_MUST_CHECK;
/* net_dial for "host:port", net_dial_via for "@host:port" (the peer `pk`). */
int net_dial_peer(net_t *n, const char *addr, const uint8_t pk[NET_PUBKEY_BYTES], net_dial_cb cb,
                  void *arg) RUMOR_MUST_CHECK;
/* Asks the relay at `relay` to take circuits for us. `cb` gets 0 once it
 * accepted (then circuits to us arrive through on_accept), or a negative
 * status (-EPERM: not a relay; a dial failure); after a 0 it is called once
 * more, with a negative status, if the registration ends (the connection
 * to the relay closed). Returns -EALREADY when one is under way there. */
typedef void (*net_relay_cb)(net_t *n, int status, const char *detail, void *arg);
int net_relay_listen(net_t *n, const char *relay, net_relay_cb cb, void *arg) RUMOR_MUST_CHECK;
/* True for a connection that runs over a relay's circuit. */
bool net_conn_relayed(const net_conn_t *c);

/* Queues a control message (the bytes are copied). Control messages go ahead
 * of bulk chunks not yet made (behind the few already being sealed). Returns
 * -ENOBUFS when the connection's outbound queue would exceed
 * max_queued_bytes (less a small reserve for protocol frames),
 * RUMOR_ETOOBIG above max_msg_bytes, RUMOR_EPROTO for bytes that are not a
 * valid message, -ENOTCONN when the connection is closing. */
int net_conn_send_msg(net_conn_t *c, struct net_msgbuf *b) RUMOR_MUST_CHECK;
/* The same with an already encoded message (tests and relays). The bytes
 * must be a valid message for the peer to accept it. */
int net_conn_send_raw_msg(net_conn_t *c, const uint8_t *data, size_t len) RUMOR_MUST_CHECK;

/* Sends `count` float32 elements from `src` as a bulk transfer. `src` must
 * stay valid and unchanged until `done` is called. Chunks are produced lazily
 * as the socket drains, so memory stays bounded whatever `count` is. Transfers
 * on one connection are sent one after another in the order of these calls;
 * both directions may transfer at once. `done` gets 0 once the receiver has
 * confirmed the complete, digest-checked buffer, else the reason:
 * -ECONNREFUSED (the receiver refused it), RUMOR_ECORRUPT (the receiver's
 * digest check failed), RUMOR_ECANCELED (canceled by either side, or the
 * connection or net closed), or why the connection was lost. */
typedef void (*net_bulk_sent_cb)(net_conn_t *c, uint64_t id, int status, void *arg);
struct net_bulk_send {
  const float *src;
  uint64_t count;
  enum net_dtype wire;
  bool no_digest;       /* skip the transfer digest (AEAD still authenticates and orders every chunk) */
  const void *meta;     /* copied; at most NET_BULK_META_MAX bytes */
  size_t meta_len;
  net_bulk_sent_cb done; /* required */
  void *arg;
};
#define NET_BULK_META_MAX 65536
int net_conn_send_bulk(net_conn_t *c, const struct net_bulk_send *s, uint64_t *id_out) RUMOR_MUST_CHECK;
/* Abandons an outbound transfer: the receiver is told, and `done` is called
 * with RUMOR_ECANCELED — before this returns, or, when worker threads are
 * still sealing chunks of `src`, as soon as they are done with it (so `src`
 * may be freed in `done`, never before). Returns RUMOR_ENOTFOUND when no
 * such transfer is pending. */
int net_conn_cancel_send(net_conn_t *c, uint64_t id);
/* Abandons the current inbound transfer with this id; later chunks are
 * discarded. on_bulk_done is called with RUMOR_ECANCELED — before this
 * returns, or as soon as worker threads stop writing into dst. */
int net_conn_cancel_recv(net_conn_t *c, uint64_t id);

/* Graceful close: queued control messages are sent, outbound transfers are
 * canceled, a BYE is sent, and the connection closes when the peer answers
 * (or after close_linger_ms). on_close follows. Safe to call twice. */
void net_conn_close(net_conn_t *c);

/* The application will start nothing new on this open connection (it keeps
 * another to the same peer): it is closed gracefully, as by net_conn_close,
 * once no byte other than PINGs has gone in or out for idle_ms, so that
 * exchanges already under way on it finish first. The peer may retire its
 * end too; the first to fire closes both. A connection that carries relay
 * circuits is never retired (its circuits keep it). A second call can only
 * shorten the wait. */
void net_conn_retire(net_conn_t *c, uint32_t idle_ms);

/* Getters, valid until on_close returns. */
const uint8_t *net_conn_peer_key(const net_conn_t *c); /* NET_PUBKEY_BYTES, verified */
const char *net_conn_peer_addr(const net_conn_t *c);   /* "1.2.3.4:5678" or "[::1]:5678" */
const char *net_conn_peer_name(const net_conn_t *c);   /* "addr key-prefix" for log lines */
bool net_conn_inbound(const net_conn_t *c);
void net_conn_set_data(net_conn_t *c, void *data);
void *net_conn_data(const net_conn_t *c);
net_t *net_conn_net(const net_conn_t *c);
/* Bytes queued for sending: control messages waiting, frames being sealed or
 * waiting their turn, and frames handed to libuv whose write has not
 * completed. Never above max_queued_bytes. */
size_t net_conn_queued_bytes(const net_conn_t *c);
/* The transport cipher chosen for this connection (enum net_suite). */
unsigned net_conn_suite(const net_conn_t *c);
/* True when the connection was aborted on the heartbeat verdict (the peer
 * pinged, then fell silent for the limit): valid in on_close. */
bool net_conn_judged_dead(const net_conn_t *c);

/* Statistics. Bytes are wire bytes (headers, tags and handshake included). */
struct net_conn_stats {
  uint64_t bytes_in, bytes_out;
  uint64_t frames_in, frames_out;
  uint64_t msgs_in, msgs_out;
  uint64_t bulk_in_ok, bulk_in_failed, bulk_out_ok, bulk_out_failed;
};
struct net_stats {
  struct net_conn_stats total; /* all connections, closed ones included: wire bytes (what runs
                                  over a relay is inside its carrier connection's bytes) */
  uint64_t conns_accepted, conns_dialed, conns_open;
  uint64_t hs_ok, hs_failed;
  uint64_t hs_fail[NET_HS_FAIL__COUNT];
  uint64_t dropped_violation; /* open connections dropped for a protocol violation */
  uint64_t dead_verdicts;     /* open connections aborted on the heartbeat verdict (silent peer) */
  uint64_t relay_bytes;       /* a relay: circuit bytes forwarded */
  uint64_t relay_circuits;    /* a relay: circuits open through it now */
  uint64_t relay_refused;     /* a relay: circuits refused for lack of room */
  uint64_t relay_holds;       /* a relay: times it stopped reading a peer (rate cap, full queue) */
  uint64_t relayed_open;      /* our open connections that run over a relay */
  struct net_conn_stats relayed; /* the part of `total` that ran over relays */
  uint64_t spare_frame_bytes;    /* outbound chunk buffers kept for reuse, shared by every connection: at
                                    most 9 chunk frames (net_impl.h, NET_FRAME_POOL_MAX) */
};
void net_conn_stats_get(const net_conn_t *c, struct net_conn_stats *s);
/* The kernel's counters for what a connection sends (for a connection over
 * a relay: its carrier's, the hop to the relay). Counts since the socket
 * opened; segments, not bytes (a retransmission counts in both). */
struct net_tcp_path {
  uint64_t data_segs_out; /* segments with data sent, retransmissions included */
  uint64_t retrans_segs;  /* of them, retransmissions */
  uint32_t rtt_us;        /* smoothed round-trip time */
};
/* Returns 0, or a negative code (-ENOTCONN: no socket; -ENOTSUP: a kernel
 * before 4.6). Loop thread. */
int net_conn_tcp_path(const net_conn_t *c, struct net_tcp_path *out);
void net_stats_get(const net_t *n, struct net_stats *s);

/* Runs fn(n, arg, 0) on the loop thread, soon. Safe to call from any thread
 * while the net is alive (not after net_close's callback). Calls run in the
 * order queued. When the net closes first, fn(n, arg, RUMOR_ECANCELED) is
 * called instead (still on the loop thread), so `arg` can always be freed.
 * Returns 0, or RUMOR_ECANCELED when net_close was already called (fn is then
 * never called). */
typedef void (*net_call_fn)(net_t *n, void *arg, int status);
int net_call(net_t *n, net_call_fn fn, void *arg) RUMOR_MUST_CHECK;

/* Closes everything: stops listening, cancels pending dials (their callbacks
 * get RUMOR_ECANCELED), closes open connections gracefully (bounded by
 * close_linger_ms; every pending bulk callback gets a non-zero status, then
 * on_close), runs or cancels queued net_call functions, and finally calls
 * `cb` once every handle is closed; `n` is freed after `cb` returns. The
 * caller then runs the loop until it has nothing left, and uv_loop_close
 * returns 0. Calling it twice is a broken invariant. */
void net_close(net_t *n, void (*cb)(void *arg), void *arg);

#endif /* RUMOR_NET_H */
