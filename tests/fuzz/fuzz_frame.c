/*
 * Fuzz harness: everything that parses bytes from a peer, below the socket.
 * The first input byte picks a mode:
 *
 *   0  raw: the bytes go straight into an authenticated session's receive
 *      machine (split at sizes taken from the input, alternating the
 *      staging and the direct-read paths). Exercises header checks, length
 *      caps and authentication failures.
 *   1  sealed: the input is a list of records, each sealed with the peer's
 *      key before it is fed, so the fuzzer reaches what comes after
 *      authentication: frame dispatch, msgpack messages, the bulk transfer
 *      state machine, the digest check, the heartbeat (PING: the session
 *      speaks protocol version 3). Record: u8 type, u32 a, u32 b,
 *      u16 len, len bytes of payload (all big-endian).
 *   2  handshake: the input is offered to a server as a HELLO and to a client
 *      (after its own HELLO) as a WELCOME.
 *   3  sealed, with chunk authentication handed to "workers" (the async
 *      path: deferred frames, paused input, out-of-order completion): jobs
 *      are queued and completed after each feed, in an order the input picks.
 *
 * Nothing may crash, leak, assert, or write outside the receive buffer.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "net/net_impl.h"
#include "tests/fuzz/fuzz.h"

/* Results are looked at (warn_unused_result) but do not matter here. */
static volatile int g_sink;
#define USE(x) (g_sink += (x) < 0)

#define DST_FLOATS 4096

static bool g_verbose; /* RUMOR_FUZZ_VERBOSE=1: say how transfers and sessions end */
static float g_dst[DST_FLOATS + 16]; /* guard band checked after each input */
static const float GUARD = 1234.5f;

static int f_begin(void *ctx, const struct net_bulk_info *info, float **dst, void **arg) {
  (void)ctx;
  if (info->count > DST_FLOATS || (info->meta_len && info->meta[0] == 'x')) return -1;
  *dst = g_dst;
  *arg = g_dst;
  return 0;
}
static void f_done(void *ctx, uint64_t id, int status, float *dst, void *arg) {
  (void)ctx;
  if (dst != g_dst || arg != g_dst) __builtin_trap();
  if (g_verbose) fprintf(stderr, "transfer %llu ended: %d\n", (unsigned long long)id, status);
}
static void f_msg(void *ctx, const struct net_msg *m) {
  (void)ctx;
  uint64_t u;
  USE(net_msg_get_uint(m, "seq", &u));
}
static int f_result(void *ctx, uint64_t id, enum net_bulk_result r) {
  (void)ctx, (void)id, (void)r;
  return 0;
}
static void f_ping(void *ctx, uint64_t interval_ms) {
  (void)ctx;
  if (g_verbose) fprintf(stderr, "PING (every %llu ms)\n", (unsigned long long)interval_ms);
}
static const struct net_sess_ops ops = {.on_msg = f_msg, .on_bulk_begin = f_begin, .on_bulk_done = f_done,
                                        .send_result = f_result, .on_ping = f_ping};

/* The async mode's pretend worker pool. */
#define MAX_PENDING 64
static struct net_rx_job *g_pending[MAX_PENDING];
static int g_npending;
static int f_submit(void *ctx, struct net_rx_job *job) {
  (void)ctx;
  if (g_npending == MAX_PENDING) return -1; /* the session then runs it inline */
  g_pending[g_npending++] = job;
  return 0;
}
static const struct net_sess_ops async_ops = {.on_msg = f_msg, .on_bulk_begin = f_begin, .on_bulk_done = f_done,
                                              .send_result = f_result, .on_ping = f_ping, .submit = f_submit};

/* Runs and completes every pending job, last first when `reverse`. */
static void complete_jobs(struct net_sess *s, bool reverse) {
  while (g_npending > 0) {
    int n = g_npending;
    g_npending = 0;
    struct net_rx_job *jobs[MAX_PENDING];
    memcpy(jobs, g_pending, (size_t)n * sizeof jobs[0]);
    for (int i = 0; i < n; i++) net_rx_job_run(jobs[i]);
    for (int i = 0; i < n; i++) USE(net_sess_job_done(s, jobs[reverse ? n - 1 - i : i]));
    USE(net_sess_resume(s)); /* may feed the backlog and queue more jobs */
  }
}

static const uint8_t key_in[32] = {1, 2, 3};  /* what the peer seals with */
static const uint8_t key_out[32] = {4, 5, 6};

static void sess_new(struct net_sess *s, struct net_aead *peer, unsigned suite, bool async) {
  struct net_config cfg;
  net_config_defaults(&cfg);
  cfg.max_msg_bytes = 65536;
  cfg.max_bulk_bytes = 1u << 20;
  net_sess_init(s, false, &cfg, async ? &async_ops : &ops, NULL);
  s->last_out_id = 3; /* pretend we sent transfers 1..3 */
  net_sess_set_keys(s, suite, key_out, key_in);
  net_aead_init(peer, suite, key_in);
}

/* Feeds n bytes alternating the two ways a connection delivers them. */
static void feed(struct net_sess *s, const uint8_t *p, size_t n, uint8_t split) {
  size_t step = 1 + split;
  bool direct = split & 1;
  while (n > 0 && !s->stop) {
    uint8_t *d;
    size_t dn;
    net_sess_rx_direct(s, &d, &dn);
    if (direct && dn) {
      size_t k = dn < n ? dn : n;
      memcpy(d, p, k);
      if (net_sess_rx_commit(s, k) != 0) return;
      p += k;
      n -= k;
    } else {
      size_t k = step < n ? step : n;
      if (net_sess_rx_feed(s, p, k) != 0) return;
      p += k;
      n -= k;
    }
    direct = !direct;
  }
}

static void mode_raw(const uint8_t *data, size_t size) {
  struct net_sess s;
  struct net_aead peer;
  if (size < 1) return;
  sess_new(&s, &peer, (data[0] & 1) ? NET_SUITE_CHACHA20POLY1305 : NET_SUITE_AES256GCM, false);
  feed(&s, data + 1, size - 1, data[0] >> 1);
  net_sess_fail_inbound(&s, RUMOR_ECANCELED);
  net_sess_free(&s);
}

static void mode_sealed(const uint8_t *data, size_t size, bool async) {
  struct net_sess s;
  struct net_aead peer;
  if (size < 1) return;
  sess_new(&s, &peer, NET_SUITE_AES256GCM, async);
  uint8_t split = data[0];
  bool reverse = split & 0x80;
  data++, size--;
  uint8_t *frame = malloc(NET_FRAME_OVERHEAD + 65536);
  while (size >= 11 && !s.stop) {
    uint8_t type = data[0];
    uint64_t a = net_be32_get(data + 1), b = net_be32_get(data + 5);
    size_t len = net_be16_get(data + 9);
    data += 11, size -= 11;
    if (len > size) len = size;
    net_frame_hdr_write(frame, type, len, a, b);
    if (len) memcpy(frame + NET_FRAME_HDR, data, len);
    if (net_aead_seal(&peer, frame, frame + NET_FRAME_HDR, len) != 0) break;
    feed(&s, frame, NET_FRAME_OVERHEAD + len, split);
    if (async && (type & 1)) complete_jobs(&s, reverse); /* sometimes let jobs pile up */
    data += len, size -= len;
  }
  if (async) complete_jobs(&s, reverse);
  if (g_verbose) fprintf(stderr, "session: %s\n", s.stop ? s.err.msg : "ok");
  net_sess_fail_inbound(&s, RUMOR_ECANCELED);
  net_sess_free(&s);
  free(frame);
}

static struct net_keyring g_ring;
static bool g_ring_ready;

static void mode_handshake(const uint8_t *data, size_t size) {
  if (!g_ring_ready) {
    struct net_identity id;
    uint8_t seed[32] = {9}, cluster[32] = {7};
    crypto_sign_seed_keypair(id.pk, id.sk, seed);
    struct net_config cfg;
    net_config_defaults(&cfg);
    cfg.identity = &id;
    cfg.cluster_key = cluster;
    if (net_keyring_init(&g_ring, &cfg, NULL) != 0) __builtin_trap();
    g_ring_ready = true;
  }
  struct net_hs hs;
  uint8_t out[NET_HS_FRAME_MAX];
  size_t out_len = 0;
  net_hs_server_start(&hs, &g_ring);
  if (net_hs_server_on_hello(&hs, data, size, out, &out_len, NULL) == 0 && out_len != NET_HS_WELCOME_LEN)
    __builtin_trap();
  net_hs_wipe(&hs);
  uint8_t hello[NET_HS_HELLO_LEN], auth[NET_HS_AUTH_LEN];
  if (net_hs_client_start(&hs, &g_ring, hello) != 0) __builtin_trap();
  USE(net_hs_client_on_welcome(&hs, data, size, auth, NULL));
  net_hs_wipe(&hs);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (net_crypto_init() != 0) __builtin_trap();
  g_verbose = getenv("RUMOR_FUZZ_VERBOSE") != NULL;
  if (!g_verbose) log_set_level(LOG_ERROR); /* peers' mistakes are logged as warnings */
  if (size < 1) return 0;
  for (int i = 0; i < 16; i++) g_dst[DST_FLOATS + i] = GUARD;
  switch (data[0] % 4) {
  case 0: mode_raw(data + 1, size - 1); break;
  case 1: mode_sealed(data + 1, size - 1, false); break;
  case 2: mode_handshake(data + 1, size - 1); break;
  default: mode_sealed(data + 1, size - 1, true); break;
  }
  for (int i = 0; i < 16; i++)
    if (g_dst[DST_FLOATS + i] != GUARD) __builtin_trap(); /* wrote past the app's buffer */
  return 0;
}
