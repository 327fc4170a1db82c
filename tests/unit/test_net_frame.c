/*
 * Transport frames without sockets: sealed frames fed into a receiving
 * session in any split arrive once and in order; any modified, duplicated,
 * reordered, reflected or dropped frame stops the session; lengths are
 * checked before anything is allocated (an i8 chunk's too); bulk transfers
 * land in the app's buffer in every wire dtype and a wrong digest is
 * reported as corrupt. OpenSSL's sealing is
 * the construction of protocol version 1 bit for bit (libsodium's AEADs),
 * and workers sealing and opening at once with one key agree with one
 * thread doing it all.
 */
#include <criterion/criterion.h>
#include <pthread.h>
#include <string.h>

#include "net/net_impl.h"
#include "../integration/test_net_lsan.h"

/* ---- a receiving session with recording ops ----------------------------------- */

struct sink {
  int ready, msgs, begins, done, results_sent, bye, pings;
  uint64_t ping_interval;
  int done_status;
  uint64_t last_result_id;
  enum net_bulk_result last_result;
  float *dst;
  uint64_t dst_cap;
};

static void s_ready(void *ctx) { ((struct sink *)ctx)->ready++; }
static void s_msg(void *ctx, const struct net_msg *m) {
  (void)m;
  ((struct sink *)ctx)->msgs++;
}
static int s_begin(void *ctx, const struct net_bulk_info *info, float **dst, void **arg) {
  struct sink *k = ctx;
  k->begins++;
  if (!k->dst || info->count > k->dst_cap) return -ECONNREFUSED;
  *dst = k->dst;
  *arg = k;
  return 0;
}
static void s_done(void *ctx, uint64_t id, int status, float *dst, void *arg) {
  struct sink *k = ctx;
  (void)id, (void)dst, (void)arg;
  k->done++;
  k->done_status = status;
}
static void s_bye(void *ctx) { ((struct sink *)ctx)->bye++; }
static void s_ping(void *ctx, uint64_t interval_ms) {
  struct sink *k = ctx;
  k->pings++;
  k->ping_interval = interval_ms;
}
static int s_send_result(void *ctx, uint64_t id, enum net_bulk_result r) {
  struct sink *k = ctx;
  k->results_sent++;
  k->last_result_id = id;
  k->last_result = r;
  return 0;
}
static const struct net_sess_ops sink_ops = {.on_ready = s_ready, .on_msg = s_msg, .on_bulk_begin = s_begin,
                                              .on_bulk_done = s_done, .on_bye = s_bye, .on_ping = s_ping,
                                              .send_result = s_send_result};

static uint8_t key_c2s[32], key_s2c[32];
static struct net_config cfg;

static void setup(void) {
  cr_assert_eq(net_crypto_init(), 0);
  randombytes_buf(key_c2s, 32);
  randombytes_buf(key_s2c, 32);
  net_config_defaults(&cfg);
}

/* A server-side session receiving what `tx` (client side) seals. */
static void pair(struct net_sess *rx, struct sink *k, struct net_aead *tx, unsigned suite) {
  memset(k, 0, sizeof *k);
  net_sess_init(rx, false, &cfg, &sink_ops, k);
  net_sess_set_keys(rx, suite, key_s2c, key_c2s);
  net_aead_init(tx, suite, key_c2s);
}

/* Seals one frame into out; returns its length. */
static size_t seal(struct net_aead *tx, uint8_t *out, uint8_t type, uint64_t a, uint64_t b, const void *pt,
                   size_t n) {
  net_frame_hdr_write(out, type, n, a, b);
  if (n) memcpy(out + NET_FRAME_HDR, pt, n);
  cr_assert_eq(net_aead_seal(tx, out, out + NET_FRAME_HDR, n), 0);
  return NET_FRAME_OVERHEAD + n;
}

static size_t seal_msg(struct net_aead *tx, uint8_t *out, uint64_t type) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, type, 1);
  net_msgbuf_put_str(&b, "k", "value", 5);
  size_t len;
  const uint8_t *p = net_msgbuf_data(&b, &len);
  size_t n = seal(tx, out, NET_FRAME_MSG, 0, 0, p, len);
  net_msgbuf_free(&b);
  return n;
}

/* ---- the AEAD itself ------------------------------------------------------------- */

/* Seals with libsodium what net_aead_seal_at seals at position ctr: the
 * 96-bit nonce 0^32 | be64 ctr, the header as associated data, the tag
 * after the ciphertext. */
static void sodium_seal(unsigned suite, const uint8_t key[32], uint64_t ctr, uint8_t *frame, const uint8_t *pt,
                        size_t n) {
  uint8_t nonce[12] = {0};
  for (int i = 0; i < 8; i++) nonce[4 + i] = (uint8_t)(ctr >> (56 - 8 * i));
  uint8_t *ct = frame + NET_FRAME_HDR;
  if (suite == NET_SUITE_AES256GCM)
    crypto_aead_aes256gcm_encrypt_detached(ct, ct + n, NULL, pt, n, frame, NET_FRAME_HDR, NULL, nonce, key);
  else
    crypto_aead_chacha20poly1305_ietf_encrypt_detached(ct, ct + n, NULL, pt, n, frame, NET_FRAME_HDR, NULL, nonce,
                                                       key);
}

Test(net_frame, openssl_seals_exactly_what_libsodium_sealed_in_version_1, .init = setup) {
  cr_log_info("frames sealed by %s", net_aead_aes_impl());
  size_t sizes[] = {0, 1, 15, 16, 17, 1000, 65536 + 3};
  uint64_t ctrs[] = {0, 1, 255, 1ull << 32, UINT64_MAX - 1};
  const size_t max = 65536 + 3;
  uint8_t *pt = malloc(max), *a = malloc(NET_FRAME_OVERHEAD + max), *b = malloc(NET_FRAME_OVERHEAD + max);
  randombytes_buf(pt, max);
  for (unsigned suite = NET_SUITE_AES256GCM; suite <= NET_SUITE_CHACHA20POLY1305; suite <<= 1) {
    if (suite == NET_SUITE_AES256GCM && !crypto_aead_aes256gcm_is_available()) {
      cr_log_warn("no AES-NI here: libsodium cannot check AES-256-GCM");
      continue;
    }
    struct net_aead x;
    net_aead_init(&x, suite, key_c2s);
    for (size_t si = 0; si < sizeof sizes / sizeof sizes[0]; si++)
      for (size_t ci = 0; ci < sizeof ctrs / sizeof ctrs[0]; ci++) {
        size_t n = sizes[si];
        net_frame_hdr_write(a, NET_FRAME_BULK_DATA, n, 7, ctrs[ci]);
        memcpy(b, a, NET_FRAME_HDR);
        cr_assert_eq(net_aead_seal_at(&x, ctrs[ci], a, pt, n), 0);
        sodium_seal(suite, key_c2s, ctrs[ci], b, pt, n);
        cr_assert_eq(memcmp(a, b, NET_FRAME_OVERHEAD + n), 0, "suite %u, %zu bytes at %llu", suite, n,
                     (unsigned long long)ctrs[ci]);
        /* and it opens, in place, only at its own position */
        cr_assert_eq(net_aead_open_at(&x, ctrs[ci], a, a + NET_FRAME_HDR, n, a + NET_FRAME_HDR + n), 0);
        cr_assert_eq(memcmp(a + NET_FRAME_HDR, pt, n), 0);
        memcpy(a + NET_FRAME_HDR, b + NET_FRAME_HDR, n);
        cr_assert_eq(net_aead_open_at(&x, ctrs[ci] + 1, a, a + NET_FRAME_HDR, n, a + NET_FRAME_HDR + n),
                     RUMOR_EAUTH);
      }
    net_aead_wipe(&x);
  }
  free(pt), free(a), free(b);
}

/* Workers of one connection: each seals and opens its share of positions
 * with the one shared, read-only struct net_aead. */
#define MT_THREADS 4
#define MT_FRAMES 64
#define MT_BYTES 4099
struct mt_arg {
  const struct net_aead *aead;
  uint8_t *frames; /* MT_FRAMES frames of NET_FRAME_OVERHEAD + MT_BYTES */
  int first, failures;
};

static void *mt_worker(void *p) {
  struct mt_arg *m = p;
  for (int i = m->first; i < MT_FRAMES; i += MT_THREADS) {
    uint8_t *f = m->frames + (size_t)i * (NET_FRAME_OVERHEAD + MT_BYTES);
    uint8_t copy[NET_FRAME_OVERHEAD + MT_BYTES];
    if (net_aead_seal_at(m->aead, (uint64_t)i, f, f + NET_FRAME_HDR, MT_BYTES) != 0) m->failures++;
    memcpy(copy, f, sizeof copy);
    uint8_t *ct = copy + NET_FRAME_HDR;
    if (net_aead_open_at(m->aead, (uint64_t)i, copy, ct, MT_BYTES, ct + MT_BYTES) != 0) m->failures++;
  }
  return NULL;
}

Test(net_frame, workers_sealing_at_once_with_one_key_match_one_thread, .init = setup) {
  const size_t fsz = NET_FRAME_OVERHEAD + MT_BYTES;
  for (unsigned suite = NET_SUITE_AES256GCM; suite <= NET_SUITE_CHACHA20POLY1305; suite <<= 1) {
    uint8_t *mt = malloc(MT_FRAMES * fsz), *st = malloc(MT_FRAMES * fsz);
    for (int i = 0; i < MT_FRAMES; i++) {
      net_frame_hdr_write(mt + i * fsz, NET_FRAME_BULK_DATA, MT_BYTES, 1, (uint64_t)i * MT_BYTES);
      randombytes_buf(mt + i * fsz + NET_FRAME_HDR, MT_BYTES);
    }
    memcpy(st, mt, MT_FRAMES * fsz);
    struct net_aead x;
    net_aead_init(&x, suite, key_c2s);
    pthread_t th[MT_THREADS];
    struct mt_arg args[MT_THREADS];
    for (int t = 0; t < MT_THREADS; t++) {
      args[t] = (struct mt_arg){.aead = &x, .frames = mt, .first = t};
      cr_assert_eq(pthread_create(&th[t], NULL, mt_worker, &args[t]), 0);
    }
    for (int t = 0; t < MT_THREADS; t++) {
      pthread_join(th[t], NULL);
      cr_assert_eq(args[t].failures, 0, "thread %d", t);
    }
    for (int i = 0; i < MT_FRAMES; i++) {
      uint8_t *f = st + i * fsz;
      cr_assert_eq(net_aead_seal_at(&x, (uint64_t)i, f, f + NET_FRAME_HDR, MT_BYTES), 0);
    }
    cr_assert_eq(memcmp(mt, st, MT_FRAMES * fsz), 0, "suite %u", suite);
    net_aead_wipe(&x);
    free(mt), free(st);
  }
}

Test(net_frame, frames_arrive_once_whatever_the_read_sizes, .init = setup) {
  for (unsigned suite = NET_SUITE_AES256GCM; suite <= NET_SUITE_CHACHA20POLY1305; suite <<= 1) {
    struct net_aead tx;
    uint8_t stream[4096];
    size_t len = 0;
    net_aead_init(&tx, suite, key_c2s);
    for (int i = 0; i < 20; i++) len += seal_msg(&tx, stream + len, (uint64_t)i);
    size_t splits[] = {1, 2, 3, 7, 24, 40, 100, 4096};
    for (size_t si = 0; si < sizeof splits / sizeof splits[0]; si++) {
      struct net_sess rx;
      struct sink k;
      pair(&rx, &k, &tx, suite);
      for (size_t off = 0; off < len; off += splits[si]) {
        size_t n = len - off < splits[si] ? len - off : splits[si];
        cr_assert_eq(net_sess_rx_feed(&rx, stream + off, n), 0, "%s", rx.err.msg);
      }
      cr_assert_eq(k.msgs, 20, "split %zu", splits[si]);
      cr_assert_eq(rx.frames_in, 20);
      net_sess_free(&rx);
    }
  }
}

static uint8_t filler[2u << 20];

Test(net_frame, one_flipped_bit_anywhere_stops_the_session, .init = setup) {
  struct net_aead tx;
  uint8_t frame[256];
  for (size_t bit = 0;; bit++) {
    struct net_sess rx;
    struct sink k;
    pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
    size_t n = seal_msg(&tx, frame, 1);
    if (bit >= n * 8) {
      net_sess_free(&rx);
      break;
    }
    frame[bit / 8] ^= (uint8_t)(1u << (bit % 8));
    int rc = net_sess_rx_feed(&rx, frame, n);
    /* A length made larger waits for more bytes (over a connection, the
     * idle timeout ends that); give it enough that it must decide. */
    if (rc == 0 && !rx.stop) rc = net_sess_rx_feed(&rx, filler, sizeof filler);
    cr_assert_lt(rc, 0, "bit %zu accepted", bit);
    cr_assert_eq(k.msgs, 0, "bit %zu: nothing delivered", bit);
    net_sess_free(&rx);
  }
}

Test(net_frame, duplicated_reordered_dropped_and_reflected_frames_fail, .init = setup) {
  struct net_aead tx;
  uint8_t f[3][256];
  size_t n[3];
  struct net_sess rx;
  struct sink k;
  /* duplicate */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n[0] = seal_msg(&tx, f[0], 1);
  cr_assert_eq(net_sess_rx_feed(&rx, f[0], n[0]), 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f[0], n[0]), RUMOR_EAUTH);
  cr_assert_eq(k.msgs, 1);
  net_sess_free(&rx);
  /* reorder */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  for (int i = 0; i < 3; i++) n[i] = seal_msg(&tx, f[i], (uint64_t)i);
  cr_assert_eq(net_sess_rx_feed(&rx, f[1], n[1]), RUMOR_EAUTH);
  cr_assert_eq(k.msgs, 0);
  net_sess_free(&rx);
  /* drop */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  for (int i = 0; i < 3; i++) n[i] = seal_msg(&tx, f[i], (uint64_t)i);
  cr_assert_eq(net_sess_rx_feed(&rx, f[0], n[0]), 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f[2], n[2]), RUMOR_EAUTH);
  cr_assert_eq(k.msgs, 1);
  net_sess_free(&rx);
  /* reflected: a frame we sent ourselves, echoed back */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n[0] = seal_msg(&rx.tx, f[0], 1);
  cr_assert_eq(net_sess_rx_feed(&rx, f[0], n[0]), RUMOR_EAUTH);
  net_sess_free(&rx);
  /* a frame from another session (replayed across connections) */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  struct net_aead other;
  uint8_t other_key[32];
  randombytes_buf(other_key, 32);
  net_aead_init(&other, NET_SUITE_AES256GCM, other_key);
  n[0] = seal_msg(&other, f[0], 1);
  cr_assert_eq(net_sess_rx_feed(&rx, f[0], n[0]), RUMOR_EAUTH);
  net_sess_free(&rx);
}

Test(net_frame, lengths_are_checked_before_anything_is_allocated, .init = setup) {
  const uint8_t types[] = {NET_FRAME_MSG, NET_FRAME_BULK_BEGIN, NET_FRAME_BULK_DATA, NET_FRAME_BULK_END,
                           NET_FRAME_BYE, NET_FRAME_BULK_RESULT, NET_FRAME_PING, 0, 99};
  for (size_t i = 0; i < sizeof types; i++) {
    struct net_aead tx;
    struct net_sess rx;
    struct sink k;
    pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
    uint8_t hdr[NET_FRAME_HDR] = {0xff, 0xff, 0xff, 0xff, types[i]};
    cr_assert_lt(net_sess_rx_feed(&rx, hdr, sizeof hdr), 0, "type %u", types[i]);
    cr_assert_eq(rx.rxbuf_cap, 0, "type %u: nothing allocated", types[i]);
    net_sess_free(&rx);
  }
  /* a control message one byte over the cap */
  struct net_aead tx;
  struct net_sess rx;
  struct sink k;
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  uint8_t hdr[NET_FRAME_HDR];
  net_frame_hdr_write(hdr, NET_FRAME_MSG, cfg.max_msg_bytes + 1, 0, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, hdr, sizeof hdr), RUMOR_ETOOBIG);
  cr_assert_eq(rx.rxbuf_cap, 0);
  net_sess_free(&rx);
  /* below the minimum */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  memset(hdr, 0, sizeof hdr);
  hdr[3] = 5;
  cr_assert_eq(net_sess_rx_feed(&rx, hdr, sizeof hdr), RUMOR_EPROTO);
  net_sess_free(&rx);
}

Test(net_frame, a_client_accepts_nothing_before_ready_and_nothing_after_bye, .init = setup) {
  struct net_aead tx;
  struct net_sess rx;
  struct sink k = {0};
  uint8_t f[256];
  net_sess_init(&rx, true, &cfg, &sink_ops, &k); /* client side */
  net_sess_set_keys(&rx, NET_SUITE_AES256GCM, key_c2s, key_s2c);
  net_aead_init(&tx, NET_SUITE_AES256GCM, key_s2c);
  size_t n = seal_msg(&tx, f, 1);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO, "a message before READY");
  net_sess_free(&rx);
  net_sess_init(&rx, true, &cfg, &sink_ops, &k);
  net_sess_set_keys(&rx, NET_SUITE_AES256GCM, key_c2s, key_s2c);
  net_aead_init(&tx, NET_SUITE_AES256GCM, key_s2c);
  n = seal(&tx, f, NET_FRAME_READY, 0, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
  cr_assert_eq(k.ready, 1);
  n = seal(&tx, f, NET_FRAME_READY, 0, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO, "a second READY");
  net_sess_free(&rx);
  /* a version-2 session (a peer without the heartbeat) opens with READY too */
  memset(&k, 0, sizeof k);
  net_sess_init(&rx, true, &cfg, &sink_ops, &k);
  net_sess_set_keys(&rx, NET_SUITE_AES256GCM, key_c2s, key_s2c);
  rx.version = 2;
  net_aead_init(&tx, NET_SUITE_AES256GCM, key_s2c);
  n = seal(&tx, f, NET_FRAME_READY, 0, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0, "READY in version 2: %s", rx.err.msg);
  cr_assert_eq(k.ready, 1);
  /* relay frames are version 3's too */
  n = seal(&tx, f, NET_FRAME_CIRCUIT_END, 1, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  cr_assert(strstr(rx.err.msg, "version 2"), "%s", rx.err.msg);
  net_sess_free(&rx);
  /* BYE, then anything */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n = seal(&tx, f, NET_FRAME_BYE, 0, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
  cr_assert_eq(k.bye, 1);
  n = seal_msg(&tx, f, 1);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  net_sess_free(&rx);
}

Test(net_frame, a_ping_is_taken_from_version_3_on_and_carries_nothing, .init = setup) {
  struct net_aead tx;
  struct net_sess rx;
  struct sink k;
  uint8_t f[256];
  /* version 3: taken, with the interval its sender announces; what follows is read as usual */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  cr_assert_eq(rx.version, NET_PROTO_MAX);
  size_t n = seal(&tx, f, NET_FRAME_PING, 250, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
  cr_assert_eq(k.pings, 1);
  cr_assert_eq(k.ping_interval, 250);
  cr_assert_eq(rx.pings_in, 1);
  n = seal_msg(&tx, f, 1);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
  cr_assert_eq(k.msgs, 1);
  /* a PING with a payload is a violation, refused from its header */
  uint8_t pad[8] = {0};
  n = seal(&tx, f, NET_FRAME_PING, 250, 0, pad, sizeof pad);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  cr_assert(strstr(rx.err.msg, "PING frame carries 8 bytes"), "%s", rx.err.msg);
  net_sess_free(&rx);
  /* version 2 (a build without the heartbeat) never sends one: a violation */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  rx.version = 2;
  n = seal(&tx, f, NET_FRAME_PING, 250, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  cr_assert(strstr(rx.err.msg, "version 2"), "%s", rx.err.msg);
  cr_assert_eq(k.pings, 0);
  net_sess_free(&rx);
}

/* ---- bulk through the producer and the session ---------------------------------------- */

/* Streams one transfer produced by the real producer into rx. */
static int stream_transfer(struct net_aead *tx, struct net_sess *rx, const float *src, uint64_t count,
                           enum net_dtype wire, uint32_t chunk_elems, bool corrupt_digest) {
  /* its digest state wants 64-byte alignment */
  struct net_tx_bulk *t = aligned_alloc(64, (sizeof *t + 63) / 64 * 64);
  memset(t, 0, sizeof *t);
  t->id = 1;
  t->src = src;
  t->count = count;
  t->wire = wire;
  t->digest = true;
  t->chunk_elems = chunk_elems;
  t->phase = NET_TX_BEGIN;
  uint8_t *frame = malloc(NET_FRAME_OVERHEAD + (size_t)chunk_elems * 4 + 64);
  int rc = 0;
  while (rc == 0 && net_bulk_tx_next_size(t)) {
    size_t len;
    bool end = t->phase == NET_TX_END;
    if (end && corrupt_digest) {
      /* an authentic END whose digest is wrong: a sender bug, not an attack */
      uint8_t bad[NET_DIGEST_BYTES] = {1};
      len = seal(tx, frame, NET_FRAME_BULK_END, t->id, t->count, bad, sizeof bad);
      t->phase = NET_TX_WAIT_RESULT;
    } else {
      cr_assert_eq(net_bulk_tx_produce(tx, t, frame, &len), 0);
    }
    /* exercise the direct-read path the connection uses */
    size_t off = 0;
    while (rc == 0 && off < len) {
      uint8_t *p;
      size_t n;
      net_sess_rx_direct(rx, &p, &n);
      if (n) {
        size_t take = n < len - off ? n : len - off;
        memcpy(p, frame + off, take);
        rc = net_sess_rx_commit(rx, take);
        off += take;
      } else {
        size_t take = len - off < 1000 ? len - off : 1000;
        rc = net_sess_rx_feed(rx, frame + off, take);
        off += take;
      }
    }
  }
  free(frame);
  free(t);
  return rc;
}

/* What the receiver must hold after `src` travelled in `wire` in chunks of
 * `chunk` elements: each chunk encoded on its own (i8 blocks restart at
 * each chunk, so a chunk that is not whole blocks ends with a short one). */
static void expect_wire(enum net_dtype wire, const float *src, uint64_t n, uint32_t chunk, float *want) {
  uint8_t *enc = malloc((size_t)net_dtype_bytes(NET_DTYPE_I8, chunk));
  for (uint64_t c = 0; c < n; c += chunk) {
    size_t len = (size_t)(n - c < chunk ? n - c : chunk);
    for (size_t i = 0; i < len; i++) {
      float x = src[c + i];
      if (wire == NET_DTYPE_F16) x = half_to_f32(half_from_f32(x));
      else if (wire == NET_DTYPE_BF16) x = bf16_to_f32(bf16_from_f32(x));
      want[c + i] = x;
    }
    if (wire == NET_DTYPE_I8) {
      net_i8_encode_ref(enc, src + c, len);
      net_i8_decode_ref(want + c, enc, len);
    }
  }
  free(enc);
}

Test(net_frame, bulk_transfers_land_in_the_app_buffer_in_every_dtype, .init = setup) {
  const uint64_t n = 100003;
  float *src = malloc(n * sizeof(float)), *want = malloc(n * sizeof(float));
  struct rng r;
  rng_seed(&r, 5, 0);
  for (uint64_t i = 0; i < n; i++) src[i] = rng_normal(&r);
  /* i8 twice: chunks of whole blocks (what senders use), and chunks that
   * end in a short block (which receivers accept too) */
  const struct {
    enum net_dtype wire;
    uint32_t chunk;
  } runs[] = {{NET_DTYPE_F32, 16384}, {NET_DTYPE_F16, 16384}, {NET_DTYPE_BF16, 16384}, {NET_DTYPE_I8, 16384},
              {NET_DTYPE_I8, 1000}};
  for (size_t w = 0; w < sizeof runs / sizeof runs[0]; w++) {
    struct net_aead tx;
    struct net_sess rx;
    struct sink k;
    pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
    k.dst = calloc(n, sizeof(float));
    k.dst_cap = n;
    cr_assert_eq(stream_transfer(&tx, &rx, src, n, runs[w].wire, runs[w].chunk, false), 0, "%s", rx.err.msg);
    cr_assert_eq(k.done, 1);
    cr_assert_eq(k.done_status, 0);
    cr_assert_eq(k.results_sent, 1);
    cr_assert_eq(k.last_result, NET_BULK_OK);
    expect_wire(runs[w].wire, src, n, runs[w].chunk, want);
    for (uint64_t i = 0; i < n; i++)
      cr_assert_eq(k.dst[i], want[i], "%s (chunks of %u) element %llu", net_dtype_name(runs[w].wire), runs[w].chunk,
                   (unsigned long long)i);
    free(k.dst);
    net_sess_free(&rx);
  }
  free(src);
  free(want);
}

/* An i8 chunk whose length is not the encoded size of the elements due
 * (values without their scales, one byte short or over, a partial block
 * counted as whole, a huge length) stops the session before its body is
 * read or anything is allocated for it. */
Test(net_frame, an_i8_chunk_of_the_wrong_length_is_refused, .init = setup) {
  const uint64_t count = 1000;   /* chunks of 384 elements: 384, 384, 232 */
  const uint32_t chunk = 384;
  const uint64_t good = 384 + 4 * 3; /* 396 bytes */
  const uint64_t bad[] = {384, good - 1, good + 1, 4 * 384, 0, 1, 0xffffffffu - 40};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct net_aead tx;
    struct net_sess rx;
    struct sink k;
    pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
    k.dst = calloc(count, sizeof(float));
    k.dst_cap = count;
    uint8_t begin[NET_BULK_BEGIN_FIXED] = {NET_DTYPE_I8, 0, 0, 0}, f[NET_FRAME_OVERHEAD + NET_BULK_BEGIN_FIXED];
    net_be32_put(begin + 4, chunk);
    size_t n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, count, begin, sizeof begin);
    cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0, "%s", rx.err.msg);
    cr_assert_eq(k.begins, 1);
    size_t cap_before = rx.rxbuf_cap;
    uint8_t hdr[NET_FRAME_HDR];
    net_frame_hdr_write(hdr, NET_FRAME_BULK_DATA, (size_t)bad[i], 1, 0);
    cr_assert_eq(net_sess_rx_feed(&rx, hdr, sizeof hdr), RUMOR_EPROTO, "%llu bytes accepted",
                 (unsigned long long)bad[i]);
    cr_assert_eq(rx.rxbuf_cap, cap_before, "%llu bytes: a buffer was allocated", (unsigned long long)bad[i]);
    cr_assert(rx.stop, "%llu bytes: the session goes on", (unsigned long long)bad[i]);
    free(k.dst);
    net_sess_free(&rx);
  }
}

/* BEGIN's chunk is bounded by its encoded size, for i8 as for the rest. */
Test(net_frame, an_i8_begin_with_an_oversized_chunk_is_refused, .init = setup) {
  struct net_aead tx;
  struct net_sess rx;
  struct sink k;
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  uint8_t begin[NET_BULK_BEGIN_FIXED] = {NET_DTYPE_I8, 0, 0, 0}, f[NET_FRAME_OVERHEAD + NET_BULK_BEGIN_FIXED];
  net_be32_put(begin + 4, NET_BULK_CHUNK_MAX); /* 16 Mi values: 16 MiB + scales, over the cap */
  size_t n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, 1u << 30, begin, sizeof begin);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_ETOOBIG);
  cr_assert_eq(k.begins, 0);
  net_sess_free(&rx);
}

Test(net_frame, a_wrong_digest_is_reported_as_corrupt, .init = setup) {
  const uint64_t n = 5000;
  float *src = calloc(n, sizeof(float));
  struct net_aead tx;
  struct net_sess rx;
  struct sink k;
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  k.dst = calloc(n, sizeof(float));
  k.dst_cap = n;
  cr_assert_eq(stream_transfer(&tx, &rx, src, n, NET_DTYPE_F32, 1024, true), 0);
  cr_assert_eq(k.done, 1);
  cr_assert_eq(k.done_status, RUMOR_ECORRUPT);
  cr_assert_eq(k.last_result, NET_BULK_CORRUPT);
  free(k.dst);
  free(src);
  net_sess_free(&rx);
}

Test(net_frame, a_refused_transfer_is_read_past_and_answered_once, .init = setup) {
  const uint64_t n = 5000;
  float *src = calloc(n, sizeof(float));
  struct net_aead tx;
  struct net_sess rx;
  struct sink k;
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM); /* no dst: refuse */
  cr_assert_eq(stream_transfer(&tx, &rx, src, n, NET_DTYPE_F32, 1024, false), 0, "%s", rx.err.msg);
  cr_assert_eq(k.begins, 1);
  cr_assert_eq(k.done, 0);
  cr_assert_eq(k.results_sent, 1);
  cr_assert_eq(k.last_result, NET_BULK_REFUSED);
  cr_assert(!rx.ib.active, "ready for the next transfer");
  free(src);
  net_sess_free(&rx);
}

Test(net_frame, bulk_frames_that_break_the_sequence_are_violations, .init = setup) {
  struct net_aead tx;
  struct net_sess rx;
  struct sink k;
  uint8_t f[512];
  float dst[64];
  uint8_t begin[NET_BULK_BEGIN_FIXED] = {NET_DTYPE_F32, NET_BULK_FLAG_DIGEST, 0, 0, 0, 0, 0, 16};
  /* DATA without BEGIN */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  size_t n = seal(&tx, f, NET_FRAME_BULK_DATA, 1, 0, dst, 64);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  net_sess_free(&rx);
  /* DATA at the wrong offset, of the wrong size, for the wrong id */
  const struct {
    uint64_t a, b;
    size_t len;
  } bad[] = {{1, 16, 64}, {1, 0, 60}, {2, 0, 64}};
  for (int i = 0; i < 3; i++) {
    pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
    k.dst = dst;
    k.dst_cap = 64;
    n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, 64, begin, sizeof begin);
    cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
    n = seal(&tx, f, NET_FRAME_BULK_DATA, bad[i].a, bad[i].b, dst, bad[i].len);
    cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO, "case %d", i);
    net_sess_fail_inbound(&rx, RUMOR_ECANCELED);
    cr_assert_eq(k.done, 1, "case %d: the app is told once", i);
    net_sess_free(&rx);
  }
  /* a reused id, an unknown dtype, a zero chunk */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, 0, begin, sizeof begin);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
  n = seal(&tx, f, NET_FRAME_BULK_END, 1, 0, dst, NET_DIGEST_BYTES);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), 0);
  n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, 0, begin, sizeof begin);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO, "id reused");
  net_sess_free(&rx);
  uint8_t bad_dtype[NET_BULK_BEGIN_FIXED] = {9, 0, 0, 0, 0, 0, 0, 16};
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, 0, bad_dtype, sizeof bad_dtype);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  net_sess_free(&rx);
  uint8_t zero_chunk[NET_BULK_BEGIN_FIXED] = {NET_DTYPE_F32, 0, 0, 0, 0, 0, 0, 0};
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n = seal(&tx, f, NET_FRAME_BULK_BEGIN, 1, 10, zero_chunk, sizeof zero_chunk);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_ETOOBIG);
  net_sess_free(&rx);
  /* a RESULT for a transfer we never sent */
  pair(&rx, &k, &tx, NET_SUITE_AES256GCM);
  n = seal(&tx, f, NET_FRAME_BULK_RESULT, 7, 0, NULL, 0);
  cr_assert_eq(net_sess_rx_feed(&rx, f, n), RUMOR_EPROTO);
  net_sess_free(&rx);
}

