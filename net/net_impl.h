/*
 * net_impl — net's private pieces shared between its files, the tests and
 * the fuzz harnesses: wire constants, the handshake state machine, AEAD
 * framing, the receive state machine of an authenticated session, bulk
 * transfer state and msgpack validation. Nothing here touches libuv except
 * the test hooks at the end; see docs/net.md for the wire format.
 */
#ifndef RUMOR_NET_IMPL_H
#define RUMOR_NET_IMPL_H

#include <sodium.h>

#include "net/net.h"

/* ---- handshake wire format (all integers big-endian) ---------------------- */
#define NET_MAGIC "rumr"
#define NET_MAGIC_BYTES 4
/* Protocol versions this build speaks. Version 2 (bulk frames sealed with
 * OpenSSL's AEAD, the transfer digest over the chunks' AEAD tags) replaced
 * version 1 (libsodium's AEAD, a BLAKE2b tree over the chunks' bytes); a
 * version-1 peer is refused with a message that says so. Version 3 adds the
 * heartbeat (NET_FRAME_PING): a session of version 2 neither sends nor
 * accepts one, so a build without it, which would drop the connection on an
 * unknown frame type, still talks to this one (without verdicts). */
#define NET_PROTO_MIN 2
#define NET_PROTO_MAX 3
#define NET_PROTO_PING 3 /* the first version with NET_FRAME_PING */
#define NET_PROTO_RELAY 3 /* the first version with relay frames (RELAY_LISTEN, CIRCUIT_*) */
#define NET_PROTO_RETIRED 1 /* the last version this build no longer accepts */
#define NET_HS_LEN_BYTES 2     /* each handshake message: u16 length, then body */
#define NET_HS_FRAME_MAX 512   /* cap on a pre-authentication message body */
#define NET_X25519_BYTES 32
#define NET_SIG_BYTES 64
#define NET_HS_TAG_BYTES 16    /* cluster tag on HELLO */
#define NET_HS_AEAD_BYTES 16   /* Poly1305 tag of the encrypted handshake parts */
#define NET_HS_SEALED_ID_BYTES (NET_PUBKEY_BYTES + NET_SIG_BYTES + NET_HS_AEAD_BYTES)
#define NET_HS_HELLO_LEN (8 + NET_X25519_BYTES + NET_HS_TAG_BYTES)        /* 56 */
#define NET_HS_WELCOME_LEN (8 + NET_X25519_BYTES + NET_HS_SEALED_ID_BYTES) /* 152 */
#define NET_HS_AUTH_LEN (4 + NET_HS_SEALED_ID_BYTES)                       /* 116 */
#define NET_HS_REJECT_LEN 8
#define NET_HS_WELCOME_CLEAR (8 + NET_X25519_BYTES) /* the unencrypted prefix */

enum net_hs_type { NET_HS_HELLO = 1, NET_HS_WELCOME = 2, NET_HS_AUTH = 3, NET_HS_REJECT = 0x7f };
enum net_reject_reason { NET_REJECT_VERSION = 1, NET_REJECT_CLUSTER = 2 };
_Static_assert(NET_HS_HELLO == 1 && NET_HS_WELCOME == 2 && NET_HS_AUTH == 3 && NET_HS_REJECT == 0x7f,
               "handshake message types are wire values");
_Static_assert(NET_HS_HELLO_LEN == 56 && NET_HS_WELCOME_LEN == 152 && NET_HS_AUTH_LEN == 116,
               "handshake message sizes are part of protocol versions 1 and 2");
_Static_assert(NET_HS_WELCOME_LEN <= NET_HS_FRAME_MAX, "handshake frames fit the pre-auth cap");

/* ---- transport frames ----------------------------------------------------- */
/* u32 len | u8 type | u8 flags | u16 reserved | u64 a | u64 b | ct | tag.
 * len counts the bytes after itself. The 24-byte header is the AEAD's
 * associated data; the nonce is the frame's position in its direction. */
#define NET_FRAME_HDR 24
#define NET_FRAME_LEN_BYTES 4
#define NET_TAG_BYTES 16
#define NET_FRAME_OVERHEAD (NET_FRAME_HDR + NET_TAG_BYTES)
#define NET_AEAD_KEY_BYTES 32
#define NET_AEAD_NONCE_BYTES 12

enum net_frame_type {
  NET_FRAME_READY = 1,       /* server -> client, first frame: key confirmation */
  NET_FRAME_MSG = 2,         /* a control message (msgpack map) */
  NET_FRAME_BULK_BEGIN = 3,  /* a = id, b = count; dtype, flags, chunk, metadata */
  NET_FRAME_BULK_DATA = 4,   /* a = id, b = first element; the payload */
  NET_FRAME_BULK_END = 5,    /* a = id, b = count; the digest (or nothing) */
  NET_FRAME_BULK_ABORT = 6,  /* a = id: the sender gave up on this transfer */
  NET_FRAME_BULK_RESULT = 7, /* a = id, b = enum net_bulk_result: the receiver's verdict */
  NET_FRAME_BYE = 8,         /* graceful close */
  NET_FRAME_PING = 9,        /* a = the sender's heartbeat interval in ms: it is alive (version 3) */
  /* Relays (docs/net.md, "Relays"): these
   * travel hop by hop, between a peer and a relay; a circuit's own stream
   * (a whole inner connection: its handshake and frames, sealed end to end)
   * rides in CIRCUIT_DATA. */
  NET_FRAME_RELAY_LISTEN = 10, /* to a relay, a = 1: take circuits for me; from it, a = 1 accepted, 0 refused */
  NET_FRAME_CIRCUIT_OPEN = 11, /* a = circuit id; a public key: the target (to a relay) or the origin (from one) */
  NET_FRAME_CIRCUIT_DATA = 12, /* a = circuit id; bytes of the circuit's stream */
  NET_FRAME_CIRCUIT_END = 13,  /* a = circuit id, b = enum net_circuit_end */
};
_Static_assert(NET_FRAME_READY == 1 && NET_FRAME_MSG == 2 && NET_FRAME_BULK_BEGIN == 3 &&
                   NET_FRAME_BULK_DATA == 4 && NET_FRAME_BULK_END == 5 && NET_FRAME_BULK_ABORT == 6 &&
                   NET_FRAME_BULK_RESULT == 7 && NET_FRAME_BYE == 8 && NET_FRAME_PING == 9,
               "frame types are wire values");

/* Why a circuit ended (CIRCUIT_END's b). FIN half-closes: no more bytes
 * from this side. */
enum net_circuit_end {
  NET_CIRCUIT_FIN = 0,
  NET_CIRCUIT_RESET = 1,       /* the endpoint dropped its connection */
  NET_CIRCUIT_UNREACHABLE = 2, /* the relay holds no registration for the target */
  NET_CIRCUIT_NOT_RELAY = 3,   /* the other side does not relay (or does not take circuits) */
  NET_CIRCUIT_BUSY = 4,        /* too many circuits or connections */
  NET_CIRCUIT_LOST = 5,        /* the relay lost its connection to the other end */
  NET_CIRCUIT_END__MAX = 5,
};
#define NET_CIRCUIT_PIECE_MAX (256u << 10) /* bytes of one CIRCUIT_DATA frame */

enum net_bulk_result {
  NET_BULK_OK = 0,
  NET_BULK_REFUSED = 1,
  NET_BULK_CORRUPT = 2,
  NET_BULK_CANCELED = 3,
};

#define NET_BULK_BEGIN_FIXED 8     /* u8 dtype | u8 flags | u16 0 | u32 chunk_elems */
#define NET_BULK_FLAG_DIGEST 0x01
#define NET_DIGEST_BYTES 32
#define NET_DIGEST_LEAF_BYTES NET_TAG_BYTES /* a leaf of the transfer digest is a chunk's AEAD tag */
#define NET_BULK_CHUNK_MAX (16u << 20) /* receiver's cap on one chunk's payload */
#define NET_BULK_CHUNK_MIN 4096
#define NET_BULK_WINDOW_CHUNKS 4   /* outbound chunk frames in flight per connection */
/* Spare full-size chunk frames a net keeps for reuse, shared by all its
 * connections: two connections' windows and one. Kept per connection, they
 * grew with every partner ever sent a transfer (5 MiB each at the default
 * chunk) until that connection closed. */
#define NET_FRAME_POOL_MAX (2 * NET_BULK_WINDOW_CHUNKS + 1)
#define NET_RX_STAGE_BYTES (64u << 10)
#define NET_RX_DIRECT_MIN (16u << 10) /* body bytes read straight into place */

/* ---- keys derived from the configuration ---------------------------------- */
struct net_keyring {
  struct net_identity id;
  uint8_t tag_key[32]; /* keys the HELLO's cluster tag */
  uint8_t mix_key[32]; /* keys every session-key derivation */
  struct net_allowlist allow;
  bool have_allow;
  unsigned suites; /* enum net_suite, limited to what this CPU can do */
};
int net_keyring_init(struct net_keyring *kr, const struct net_config *cfg, struct rumor_err *e);
void net_keyring_wipe(struct net_keyring *kr);

/* ---- the handshake (pure: bytes in, bytes out) ---------------------------- */
enum net_hs_state {
  NET_HS_S_CLIENT_WAIT_WELCOME,
  NET_HS_S_CLIENT_WAIT_READY,
  NET_HS_S_SERVER_WAIT_HELLO,
  NET_HS_S_SERVER_WAIT_AUTH,
  NET_HS_S_DONE,
  NET_HS_S_FAILED,
};

struct net_hs {
  const struct net_keyring *kr;
  enum net_hs_state state;
  bool client;
  uint8_t e_pk[NET_X25519_BYTES], e_sk[NET_X25519_BYTES];
  uint8_t peer_e[NET_X25519_BYTES];
  uint8_t dh[NET_X25519_BYTES];
  uint8_t k_hs_s2c[32], k_hs_c2s[32];
  crypto_generichash_state th; /* running transcript hash */
  uint8_t version;
  unsigned suite;
  uint8_t peer_pk[NET_PUBKEY_BYTES];
  uint8_t k_c2s[NET_AEAD_KEY_BYTES], k_s2c[NET_AEAD_KEY_BYTES]; /* transport keys when done */
  enum net_hs_fail fail; /* why, when a step failed */
};

/* Client: starts a handshake; writes the HELLO body (NET_HS_HELLO_LEN). */
int net_hs_client_start(struct net_hs *hs, const struct net_keyring *kr, uint8_t *out) RUMOR_MUST_CHECK;
/* Server: starts waiting for a HELLO. */
void net_hs_server_start(struct net_hs *hs, const struct net_keyring *kr);
/* Server: takes the HELLO body. On success writes the WELCOME into out
 * (*out_len bytes). On failure returns a negative code and hs->fail; when
 * *out_len > 0 the caller sends out (a REJECT) before closing. */
int net_hs_server_on_hello(struct net_hs *hs, const uint8_t *in, size_t len, uint8_t *out,
                           size_t *out_len, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Client: takes the WELCOME (or REJECT) body; writes the AUTH body. */
int net_hs_client_on_welcome(struct net_hs *hs, const uint8_t *in, size_t len, uint8_t *out,
                             struct rumor_err *e) RUMOR_MUST_CHECK;
/* Server: takes the AUTH body; on success the transport keys are ready. */
int net_hs_server_on_auth(struct net_hs *hs, const uint8_t *in, size_t len, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Wipes every secret (ephemeral keys, DH output, handshake and transport keys). */
void net_hs_wipe(struct net_hs *hs);

/* ---- AEAD framing ---------------------------------------------------------- */
/* One direction's AEAD (OpenSSL's AES-256-GCM or ChaCha20-Poly1305): the key
 * and the next position. It holds no OpenSSL object, so workers may seal and
 * open with it at once (each thread uses a context of its own; frame.c). */
struct net_aead {
  uint8_t key[NET_AEAD_KEY_BYTES];
  unsigned suite; /* enum net_suite: exactly one bit */
  uint64_t ctr;   /* the next frame's position: the nonce */
};
void net_aead_init(struct net_aead *a, unsigned suite, const uint8_t key[NET_AEAD_KEY_BYTES]);
void net_aead_wipe(struct net_aead *a);
/* Fills the 24-byte header at frame[0..24) for a payload of pt_len bytes. */
void net_frame_hdr_write(uint8_t *frame, uint8_t type, size_t pt_len, uint64_t a, uint64_t b);
/* Encrypts pt (pt_len bytes; may be frame + NET_FRAME_HDR for in place) to
 * frame + NET_FRAME_HDR and appends the tag; the header must be written.
 * Returns 0, -EOVERFLOW when the nonce space is exhausted, or -EIO when
 * OpenSSL failed (the frame's payload and tag are then zeros: never send it;
 * the position is used up, so the connection must be dropped). */
int net_aead_seal(struct net_aead *a, uint8_t *frame, const uint8_t *pt, size_t pt_len) RUMOR_MUST_CHECK;
/* Decrypts ct in place after checking the tag against hdr and the expected
 * position. Returns 0 or RUMOR_EAUTH (ct then holds garbage). */
int net_aead_open(struct net_aead *a, const uint8_t hdr[NET_FRAME_HDR], uint8_t *ct, size_t len,
                  const uint8_t tag[NET_TAG_BYTES]) RUMOR_MUST_CHECK;
/* Takes the next position for a frame sealed or opened later (on a worker
 * thread) with the _at forms; -EOVERFLOW when the nonce space is exhausted. */
int net_aead_reserve(struct net_aead *a, uint64_t *ctr) RUMOR_MUST_CHECK;
/* Seal / open at an explicit position. They only read `a`, so any number of
 * threads may use one net_aead at once while the loop thread reserves.
 * Seal returns 0 or -EIO (OpenSSL failed: as for net_aead_seal); open returns
 * 0 or RUMOR_EAUTH (a wrong tag or an OpenSSL failure; ct holds garbage). */
int net_aead_seal_at(const struct net_aead *a, uint64_t ctr, uint8_t *frame, const uint8_t *pt,
                     size_t pt_len) RUMOR_MUST_CHECK;
int net_aead_open_at(const struct net_aead *a, uint64_t ctr, const uint8_t hdr[NET_FRAME_HDR], uint8_t *ct,
                     size_t len, const uint8_t tag[NET_TAG_BYTES]) RUMOR_MUST_CHECK;

/* Which library seals the frames (OpenSSL's version string). */
const char *net_aead_aes_impl(void);

struct net_frame_hdr {
  uint32_t len; /* bytes after the length field */
  uint8_t type, flags;
  uint16_t reserved;
  uint64_t a, b;
  size_t ct_len;
};

/* ---- bulk transfer state -------------------------------------------------- */
/* Outbound: produced lazily, one frame at a time, by the connection. */
enum net_tx_phase { NET_TX_BEGIN, NET_TX_DATA, NET_TX_END, NET_TX_WAIT_RESULT };
struct net_tx_bulk {
  struct net_tx_bulk *next;
  unsigned jobs;      /* DATA frames being sealed on worker threads (they read src) */
  unsigned unflushed; /* DATA frames made but not yet written (their tag is not in root) */
  bool zombie;        /* finished (canceled, refused, lost): done runs once jobs and unflushed reach 0 */
  int zombie_status;
  uint64_t id;
  const float *src;
  uint64_t count, next_elem, chunk_index;
  uint32_t chunk_elems;
  enum net_dtype wire;
  bool digest;
  enum net_tx_phase phase;
  uint8_t *meta;
  size_t meta_len;
  crypto_generichash_state root;
  net_bulk_sent_cb done;
  void *arg;
};

/* Chunks whose authentication may be in progress on worker threads at once
 * (per connection and direction). */
#define NET_RX_JOBS_MAX 4

/* Inbound: at most one at a time per connection. */
struct net_rx_bulk {
  bool active;       /* between BEGIN and END/ABORT */
  bool accepted;     /* the app gave a buffer and has not been told the end */
  bool result_sent;  /* our RESULT for this id is out */
  bool fail_pending; /* told to fail while chunks were on worker threads: report when they finish */
  int fail_status;
  uint64_t leaf_next; /* chunks below this index have their tag in root */
  uint8_t leaves[NET_RX_JOBS_MAX][NET_DIGEST_LEAF_BYTES];
  bool leaf_ready[NET_RX_JOBS_MAX];
  uint64_t id, count, next_elem, chunk_index;
  uint32_t chunk_elems;
  enum net_dtype wire;
  bool digest;
  float *dst;
  void *dst_arg;
  crypto_generichash_state root;
};

/* True for a dtype this build knows (the values of enum net_dtype). */
bool net_dtype_valid(enum net_dtype d);
/* Conversions between float32 buffers and wire encodings (fast paths when the
 * CPU has F16C or AVX2). `dst` / `src` on the wire side hold exactly
 * net_dtype_bytes(d, n) bytes; i8 blocks start at element 0 (each call is
 * one independent run of blocks, so a chunk is encoded and decoded alone).
 * For F32 they copy. Decoding never fails: any bytes give floats (a
 * non-finite i8 scale gives non-finite values). */
void net_dtype_encode(enum net_dtype d, uint8_t *dst, const float *src, size_t n);
void net_dtype_decode(enum net_dtype d, float *dst, const uint8_t *src, size_t n);
/* The i8 reference (scalar) conversions, for tests of the fast path. */
void net_i8_encode_ref(uint8_t *dst, const float *src, size_t n);
void net_i8_decode_ref(float *dst, const uint8_t *src, size_t n);
/* True when the SIMD conversions (F16C for f16, AVX2 for bf16 and i8) are used. */
bool net_dtype_fast_path(void);
/* Elements per outbound chunk of at most `chunk_bytes` encoded bytes (for
 * i8 a whole number of blocks, so that chunk boundaries are block
 * boundaries). */
uint32_t net_bulk_chunk_elems(enum net_dtype d, size_t chunk_bytes);
/* Outbound producer: the size of t's next frame (0 when it waits for the
 * receiver's RESULT), and writing that frame, sealed, into `frame`. */
size_t net_bulk_tx_next_size(const struct net_tx_bulk *t);
int net_bulk_tx_produce(struct net_aead *aead, struct net_tx_bulk *t, uint8_t *frame, size_t *len) RUMOR_MUST_CHECK;

/* A DATA frame to seal, possibly on a worker thread: everything it needs,
 * so the job touches nothing the loop thread changes meanwhile. */
struct net_tx_job {
  const struct net_aead *aead;
  uint64_t ctr;
  uint8_t *frame;
  const float *src;
  size_t elems;
  enum net_dtype wire;
  bool digest;
  uint64_t chunk_index;
  int status;                          /* out: 0, or -EIO when sealing failed (never send the frame) */
  uint8_t leaf[NET_DIGEST_LEAF_BYTES]; /* out: the chunk's digest leaf (its AEAD tag) */
};
/* Loop thread: takes t's next DATA frame (t->phase must be NET_TX_DATA):
 * reserves its nonce, writes its header into `frame` and describes the rest
 * in `job`; advances t. */
int net_bulk_tx_prepare_data(struct net_aead *aead, struct net_tx_bulk *t, uint8_t *frame, struct net_tx_job *job,
                             size_t *len) RUMOR_MUST_CHECK;
/* Any thread: encodes and seals a prepared DATA frame; sets j->status and,
 * on success, j->leaf. */
void net_tx_job_run(struct net_tx_job *j);

/* A received DATA frame to authenticate (and widen) on a worker
 * thread. Made by the session, run by the owner's worker, handed back with
 * net_sess_job_done. */
struct net_rx_job {
  const struct net_aead *aead;
  uint64_t ctr;
  uint8_t hdr[NET_FRAME_HDR], tag[NET_TAG_BYTES];
  uint8_t *body;    /* the ciphertext, decrypted in place */
  size_t len;
  uint8_t *scratch; /* owned by the job (f16/bf16 bodies); freed by net_sess_job_done */
  float *decode_to; /* f16/bf16: where the floats go; NULL for f32 (already in place) */
  size_t elems;
  enum net_dtype wire;
  bool digest;
  uint64_t chunk_index;
  int status;       /* out: 0 or RUMOR_EAUTH */
  uint8_t leaf[NET_DIGEST_LEAF_BYTES]; /* out: the chunk's AEAD tag, once authenticated */
  void *owner;      /* for the owner's bookkeeping (its uv_work_t) */
};
void net_rx_job_run(struct net_rx_job *j);
/* The transfer digest (protocol version 2): BLAKE2b-256 over a parameter
 * block and, in chunk order, each DATA frame's 16-byte AEAD tag, which
 * authenticates the chunk's bytes, header and position (see docs/net.md).
 * Hashing 16 bytes per chunk makes it cost next to nothing. */
void net_digest_root_init(crypto_generichash_state *root, uint64_t count, enum net_dtype wire,
                          uint32_t chunk_elems);
void net_digest_add_tag(crypto_generichash_state *root, const uint8_t tag[NET_DIGEST_LEAF_BYTES]);
void net_digest_final(crypto_generichash_state *root, uint8_t out[NET_DIGEST_BYTES]);

/* ---- the authenticated session: receive state machine and frame dispatch -- */
/* What the session asks of its owner (the libuv connection, or a fuzz
 * harness). Each may be NULL. */
struct net_sess_ops {
  void (*on_ready)(void *ctx);
  void (*on_msg)(void *ctx, const struct net_msg *m);
  int (*on_bulk_begin)(void *ctx, const struct net_bulk_info *info, float **dst, void **dst_arg);
  void (*on_bulk_done)(void *ctx, uint64_t id, int status, float *dst, void *dst_arg);
  void (*on_bulk_result)(void *ctx, uint64_t id, enum net_bulk_result r);
  void (*on_bye)(void *ctx);
  /* The peer's heartbeat: it pings every `interval_ms` while it sends
   * nothing else (the frame's `a`, as it claims it). */
  void (*on_ping)(void *ctx, uint64_t interval_ms);
  /* A relay frame (RELAY_LISTEN, CIRCUIT_*), its size already checked.
   * Returns 0, or a negative code with the reason (a violation: the session
   * stops). `pt` is valid during the call. */
  int (*on_relay)(void *ctx, uint8_t type, uint64_t a, uint64_t b, const uint8_t *pt, size_t len);
  /* Queue a small frame (RESULT) to the peer; returns 0 or a negative code. */
  int (*send_result)(void *ctx, uint64_t id, enum net_bulk_result r);
  /* Optional: run a chunk's authentication elsewhere (a worker thread); the
   * owner calls net_rx_job_run there and net_sess_job_done back on the loop
   * thread. A negative return runs the job inline instead. */
  int (*submit)(void *ctx, struct net_rx_job *job);
};

enum net_rx_state { NET_RX_HDR, NET_RX_BODY, NET_RX_TAG };

struct net_sess {
  struct net_aead tx, rx;
  bool client;       /* the client's first frame must be READY */
  uint8_t version;   /* the session's protocol version: PING only from NET_PROTO_PING
                        (net_sess_init sets NET_PROTO_MAX; the owner sets the negotiated one) */
  bool ready;        /* READY seen (client) or sent (server) */
  bool bye;          /* the peer said BYE: nothing may follow */
  bool stop;         /* set by the owner to stop processing input (closing) */
  bool paused;       /* waiting for worker jobs: input is kept in `backlog` */
  bool deferred;     /* a complete frame waits (in rxbuf) for the jobs to finish */
  unsigned jobs;     /* chunks being authenticated on worker threads */
  uint8_t *backlog;  /* input received while paused, replayed by net_sess_resume */
  size_t backlog_len, backlog_cap;
  bool body_owned;   /* body is a scratch buffer that goes to a job */
  /* receive machine */
  enum net_rx_state rx_state;
  uint8_t hdr[NET_FRAME_HDR];
  size_t hdr_got;
  struct net_frame_hdr h;
  uint8_t *body;     /* where the current frame's ciphertext goes */
  size_t body_got;
  uint8_t tag[NET_TAG_BYTES];
  size_t tag_got;
  uint8_t *rxbuf;    /* owned scratch for bodies that do not go straight to a bulk buffer */
  size_t rxbuf_cap;
  /* inbound bulk */
  struct net_rx_bulk ib;
  uint64_t last_in_id;
  uint64_t last_out_id; /* for checking RESULT ids: set by the owner */
  /* limits */
  size_t max_msg_bytes;
  uint64_t max_bulk_bytes;
  struct net_msg_limits msg_limits;
  /* owner */
  const struct net_sess_ops *ops;
  void *ctx;
  /* counters */
  uint64_t frames_in, msgs_in, bulk_in_ok, bulk_in_failed;
  uint64_t pings_in; /* PING frames (NET_FRAME_OVERHEAD bytes each) */
  struct rumor_err err; /* the violation that stopped the session */
};

void net_sess_init(struct net_sess *s, bool client, const struct net_config *cfg,
                   const struct net_sess_ops *ops, void *ctx);
/* Keys: tx_key for frames we send, rx_key for frames we receive. */
void net_sess_set_keys(struct net_sess *s, unsigned suite, const uint8_t tx_key[32], const uint8_t rx_key[32]);
/* Ends an inbound transfer that is in progress (the connection is going
 * away): on_bulk_done(status) when the app holds a buffer — at once, or when
 * the chunks still on worker threads have finished writing into it. */
void net_sess_fail_inbound(struct net_sess *s, int status);
/* Tells the app its inbound transfer failed (the same timing) but keeps
 * reading the transfer's frames, discarding them (cancel, local close). */
void net_sess_cancel_inbound(struct net_sess *s, int status);
/* Loop thread, once per submitted job after it ran: applies its result and
 * frees it. Returns 0, or a violation code with s->err set. */
int net_sess_job_done(struct net_sess *s, struct net_rx_job *j) RUMOR_MUST_CHECK;
/* Loop thread: continues after jobs finished (a deferred frame, the
 * backlog). Same return as net_sess_rx_feed. */
int net_sess_resume(struct net_sess *s) RUMOR_MUST_CHECK;
void net_sess_free(struct net_sess *s);
/* Where the next received bytes may be written directly, and how many (the
 * rest of the current frame body); *n is 0 when a staging buffer should be
 * used. */
void net_sess_rx_direct(struct net_sess *s, uint8_t **p, size_t *n);
/* After a direct read of n bytes into the pointer from net_sess_rx_direct. */
int net_sess_rx_commit(struct net_sess *s, size_t n) RUMOR_MUST_CHECK;
/* Feeds n received bytes (copied as needed). Returns 0, or a negative code
 * with s->err set when the peer broke the protocol or a frame failed
 * authentication; the session must then be dropped. Stops early (returning
 * 0) when s->stop is set by a callback. */
int net_sess_rx_feed(struct net_sess *s, const uint8_t *data, size_t n) RUMOR_MUST_CHECK;

/* ---- msgpack validation --------------------------------------------------- */
/* The non-allocating pass run before msgpack-c sees any bytes. On success
 * *zone_bytes is an upper bound of what msgpack_unpack allocates. */
int net_mp_validate(const uint8_t *p, size_t n, const struct net_msg_limits *lim, size_t *zone_bytes,
                    struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- internal helpers ------------------------------------------------------- */
static inline void net_be16_put(uint8_t *p, uint16_t v) {
  p[0] = (uint8_t)(v >> 8);
  p[1] = (uint8_t)v;
}
static inline void net_be32_put(uint8_t *p, uint32_t v) {
  for (int i = 3; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}
static inline void net_be64_put(uint8_t *p, uint64_t v) {
  for (int i = 7; i >= 0; i--, v >>= 8) p[i] = (uint8_t)v;
}
static inline uint16_t net_be16_get(const uint8_t *p) { return (uint16_t)((p[0] << 8) | p[1]); }
static inline uint32_t net_be32_get(const uint8_t *p) {
  return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}
static inline uint64_t net_be64_get(const uint8_t *p) {
  uint64_t v = 0;
  for (int i = 0; i < 8; i++) v = (v << 8) | p[i];
  return v;
}

/* ---- test hooks: compiled into the testing build only (rumor_net_testing) --- */
#ifdef RUMOR_TESTING
/* How many times msgpack-c's decoder has been called in this process. */
uint64_t net_test_msgpack_decoder_calls(void);
/* Stops or resumes reading from a connection (simulates a stalled receiver). */
int net_test_conn_pause_read(net_conn_t *c, bool pause);
/* Sends an arbitrary frame (type, a, b, payload) through the connection's
 * encryption, bypassing every sender-side check. */
int net_test_conn_send_frame(net_conn_t *c, uint8_t type, uint64_t a, uint64_t b, const void *pt,
                             size_t len) RUMOR_MUST_CHECK;

/* Writes raw bytes to the connection's socket, bypassing framing and
 * encryption (to send what no honest peer would). */
int net_test_conn_write_raw(net_conn_t *c, const void *p, size_t len) RUMOR_MUST_CHECK;

/* A dishonest relay: `flip` flips one bit of every forwarded CIRCUIT_DATA
 * frame's bytes past the first `flip_after` forwarded bytes; `any_target`
 * sends every circuit to the first registered peer whatever key was asked. */
void net_test_relay_misbehave(net_t *n, bool flip, uint64_t flip_after, bool any_target);
#endif /* RUMOR_TESTING */

#endif /* RUMOR_NET_IMPL_H */
