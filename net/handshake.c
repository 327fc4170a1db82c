/*
 * The handshake: HELLO (client), WELCOME (server), AUTH (client), then the
 * server's first encrypted frame (READY) confirms the transport keys. The
 * message layouts and the argument for each property are in docs/net.md.
 *
 * Every function here works on bytes only; the connection code moves them.
 * Every check that fails sets hs->fail and a message; nothing asserts on
 * received bytes.
 */
#include <stdio.h>
#include <string.h>

#include "net/net_impl.h"

#define TRANSCRIPT_LABEL "rumor v1 transcript"
#define HS_KEYS_LABEL "rumor v1 handshake keys"
#define TRANSPORT_KEYS_LABEL "rumor v1 transport keys"
#define SERVER_SIG_LABEL "rumor v1 server signature"
#define CLIENT_SIG_LABEL "rumor v1 client signature"
#define TH_BYTES 64 /* transcript hash snapshots: BLAKE2b-512 */
#define SIGNED_MAX (32 + TH_BYTES + NET_PUBKEY_BYTES)

static const uint8_t zero_nonce[crypto_aead_chacha20poly1305_ietf_NPUBBYTES];

const char *net_hs_fail_name(enum net_hs_fail f) {
  switch (f) {
  case NET_HS_FAIL_TIMEOUT: return "timeout";
  case NET_HS_FAIL_CLOSED: return "closed";
  case NET_HS_FAIL_MALFORMED: return "malformed";
  case NET_HS_FAIL_VERSION: return "version";
  case NET_HS_FAIL_CLUSTER: return "cluster-key";
  case NET_HS_FAIL_AUTH: return "auth";
  case NET_HS_FAIL_NOT_ALLOWED: return "not-allowed";
  case NET_HS_FAIL_REJECTED: return "rejected";
  case NET_HS_FAIL_SELF: return "self";
  case NET_HS_FAIL_BUSY: return "busy";
  case NET_HS_FAIL__COUNT: break;
  }
  return "unknown";
}

static int fail(struct net_hs *hs, enum net_hs_fail why, int code, struct rumor_err *e, const char *fmt,
                const char *detail) {
  hs->fail = why;
  hs->state = NET_HS_S_FAILED;
  return rumor_err_set(e, code, fmt, detail);
}

static void th_snapshot(const crypto_generichash_state *th, uint8_t out[TH_BYTES]) {
  crypto_generichash_state copy;
  memcpy(&copy, th, sizeof copy);
  crypto_generichash_final(&copy, out, TH_BYTES);
  sodium_memzero(&copy, sizeof copy);
}

static void th_start(struct net_hs *hs) {
  crypto_generichash_init(&hs->th, NULL, 0, TH_BYTES);
  crypto_generichash_update(&hs->th, (const uint8_t *)TRANSCRIPT_LABEL, sizeof TRANSCRIPT_LABEL);
}

/* out = BLAKE2b-512(key = mix_key, label || dh || th): two 32-byte keys. */
static void derive_pair(const struct net_hs *hs, const char *label, const uint8_t th[TH_BYTES],
                        uint8_t first[32], uint8_t second[32]) {
  uint8_t out[64];
  crypto_generichash_state st;
  crypto_generichash_init(&st, hs->kr->mix_key, sizeof hs->kr->mix_key, sizeof out);
  crypto_generichash_update(&st, (const uint8_t *)label, strlen(label) + 1);
  crypto_generichash_update(&st, hs->dh, sizeof hs->dh);
  crypto_generichash_update(&st, th, TH_BYTES);
  crypto_generichash_final(&st, out, sizeof out);
  memcpy(first, out, 32);
  memcpy(second, out + 32, 32);
  sodium_memzero(out, sizeof out);
  sodium_memzero(&st, sizeof st);
}

/* The bytes an identity signs: label || transcript snapshot || own key. */
static size_t signed_bytes(uint8_t *buf, const char *label, const uint8_t th[TH_BYTES], const uint8_t pk[32]) {
  size_t l = strlen(label) + 1;
  memcpy(buf, label, l);
  memcpy(buf + l, th, TH_BYTES);
  memcpy(buf + l + TH_BYTES, pk, NET_PUBKEY_BYTES);
  return l + TH_BYTES + NET_PUBKEY_BYTES;
}

static void ephemeral_new(struct net_hs *hs) {
  randombytes_buf(hs->e_sk, sizeof hs->e_sk);
  crypto_scalarmult_base(hs->e_pk, hs->e_sk);
}

/* Drops what only the handshake needed; the transport keys stay. */
static void wipe_ephemeral(struct net_hs *hs) {
  sodium_memzero(hs->e_sk, sizeof hs->e_sk);
  sodium_memzero(hs->dh, sizeof hs->dh);
  sodium_memzero(hs->k_hs_s2c, sizeof hs->k_hs_s2c);
  sodium_memzero(hs->k_hs_c2s, sizeof hs->k_hs_c2s);
  sodium_memzero(&hs->th, sizeof hs->th);
}

void net_hs_wipe(struct net_hs *hs) { sodium_memzero(hs, sizeof *hs); }

/* Checks a peer's verified identity against ours and the allow-list. */
static int admit(struct net_hs *hs, const uint8_t pk[32], struct rumor_err *e) {
  if (sodium_memcmp(pk, hs->kr->id.pk, NET_PUBKEY_BYTES) == 0)
    return fail(hs, NET_HS_FAIL_SELF, RUMOR_EAUTH, e, "the peer has our own identity key%s", "");
  if (hs->kr->have_allow && !net_allowlist_contains(&hs->kr->allow, pk)) {
    char s[NET_PUBKEY_STR_LEN + 1];
    net_pubkey_format(s, pk);
    return fail(hs, NET_HS_FAIL_NOT_ALLOWED, RUMOR_EAUTH, e, "peer key %s is not on the allow-list", s);
  }
  return 0;
}

int net_hs_client_start(struct net_hs *hs, const struct net_keyring *kr, uint8_t *out) {
  memset(hs, 0, sizeof *hs);
  hs->kr = kr;
  hs->client = true;
  ephemeral_new(hs);
  memcpy(out, NET_MAGIC, NET_MAGIC_BYTES);
  out[4] = NET_HS_HELLO;
  out[5] = NET_PROTO_MIN;
  out[6] = NET_PROTO_MAX;
  out[7] = (uint8_t)kr->suites;
  memcpy(out + 8, hs->e_pk, NET_X25519_BYTES);
  crypto_generichash(out + 8 + NET_X25519_BYTES, NET_HS_TAG_BYTES, out, 8 + NET_X25519_BYTES, kr->tag_key,
                     sizeof kr->tag_key);
  th_start(hs);
  crypto_generichash_update(&hs->th, out, NET_HS_HELLO_LEN);
  hs->state = NET_HS_S_CLIENT_WAIT_WELCOME;
  return 0;
}

void net_hs_server_start(struct net_hs *hs, const struct net_keyring *kr) {
  memset(hs, 0, sizeof *hs);
  hs->kr = kr;
  hs->state = NET_HS_S_SERVER_WAIT_HELLO;
}

/* The explanation for a peer whose newest version is one we retired. */
static void retired_version_msg(char *d, size_t cap, unsigned lo, unsigned hi) {
  if (lo == hi)
    snprintf(d, cap, "the peer speaks protocol version %u, which this rumor no longer accepts", hi);
  else
    snprintf(d, cap, "the peer speaks protocol versions %u..%u, which this rumor no longer accepts", lo, hi);
}
#define RETIRED_WHY                                                                                  \
  " (version 2 seals bulk frames with OpenSSL's AEAD and checks transfers by their AEAD tags); upgrade it"

static size_t write_reject(uint8_t *out, uint8_t reason) {
  memcpy(out, NET_MAGIC, NET_MAGIC_BYTES);
  out[4] = NET_HS_REJECT;
  out[5] = reason;
  out[6] = NET_PROTO_MIN;
  out[7] = NET_PROTO_MAX;
  return NET_HS_REJECT_LEN;
}

int net_hs_server_on_hello(struct net_hs *hs, const uint8_t *in, size_t len, uint8_t *out, size_t *out_len,
                           struct rumor_err *e) {
  *out_len = 0;
  if (hs->state != NET_HS_S_SERVER_WAIT_HELLO)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "unexpected handshake message%s", "");
  if (len < 8 || memcmp(in, NET_MAGIC, NET_MAGIC_BYTES) != 0 || in[4] != NET_HS_HELLO)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "not a rumor HELLO (bad magic or type)%s", "");
  uint8_t cmin = in[5], cmax = in[6];
  uint8_t v = cmax < NET_PROTO_MAX ? cmax : NET_PROTO_MAX;
  if (cmin > cmax || v < cmin || v < NET_PROTO_MIN) {
    *out_len = write_reject(out, NET_REJECT_VERSION);
    char d[192];
    if (cmin <= cmax && cmax <= NET_PROTO_RETIRED) {
      retired_version_msg(d, sizeof d, cmin, cmax);
      return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e, "%s" RETIRED_WHY, d);
    }
    snprintf(d, sizeof d, "%u..%u (we speak %u..%u)", cmin, cmax, NET_PROTO_MIN, NET_PROTO_MAX);
    return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e, "no common protocol version: the peer speaks %s", d);
  }
  if (len != NET_HS_HELLO_LEN)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "HELLO has the wrong size%s", "");
  uint8_t tag[NET_HS_TAG_BYTES];
  crypto_generichash(tag, sizeof tag, in, 8 + NET_X25519_BYTES, hs->kr->tag_key, sizeof hs->kr->tag_key);
  if (crypto_verify_16(tag, in + 8 + NET_X25519_BYTES) != 0) {
    *out_len = write_reject(out, NET_REJECT_CLUSTER);
    return fail(hs, NET_HS_FAIL_CLUSTER, RUMOR_EAUTH, e,
                "the peer does not hold our cluster key (HELLO tag mismatch)%s", "");
  }
  unsigned common = in[7] & hs->kr->suites;
  if (!common) {
    *out_len = write_reject(out, NET_REJECT_VERSION);
    return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e, "no cipher suite in common%s", "");
  }
  hs->version = v;
  hs->suite = (common & NET_SUITE_AES256GCM) ? NET_SUITE_AES256GCM : NET_SUITE_CHACHA20POLY1305;
  memcpy(hs->peer_e, in + 8, NET_X25519_BYTES);
  ephemeral_new(hs);
  if (crypto_scalarmult(hs->dh, hs->e_sk, hs->peer_e) != 0)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "HELLO carries a degenerate ephemeral key%s", "");

  /* WELCOME: the clear prefix, then our identity and signature, encrypted. */
  memcpy(out, NET_MAGIC, NET_MAGIC_BYTES);
  out[4] = NET_HS_WELCOME;
  out[5] = v;
  out[6] = (uint8_t)hs->suite;
  out[7] = 0;
  memcpy(out + 8, hs->e_pk, NET_X25519_BYTES);
  th_start(hs);
  crypto_generichash_update(&hs->th, in, NET_HS_HELLO_LEN);
  crypto_generichash_update(&hs->th, out, NET_HS_WELCOME_CLEAR);
  uint8_t t1[TH_BYTES], plain[NET_PUBKEY_BYTES + NET_SIG_BYTES], sigmsg[SIGNED_MAX];
  th_snapshot(&hs->th, t1);
  derive_pair(hs, HS_KEYS_LABEL, t1, hs->k_hs_s2c, hs->k_hs_c2s);
  size_t sl = signed_bytes(sigmsg, SERVER_SIG_LABEL, t1, hs->kr->id.pk);
  memcpy(plain, hs->kr->id.pk, NET_PUBKEY_BYTES);
  crypto_sign_detached(plain + NET_PUBKEY_BYTES, NULL, sigmsg, sl, hs->kr->id.sk);
  unsigned long long clen = 0;
  crypto_aead_chacha20poly1305_ietf_encrypt(out + NET_HS_WELCOME_CLEAR, &clen, plain, sizeof plain, t1,
                                            sizeof t1, NULL, zero_nonce, hs->k_hs_s2c);
  crypto_generichash_update(&hs->th, out + NET_HS_WELCOME_CLEAR, NET_HS_SEALED_ID_BYTES);
  crypto_generichash_update(&hs->th, hs->kr->id.pk, NET_PUBKEY_BYTES);
  sodium_memzero(plain, sizeof plain);
  *out_len = NET_HS_WELCOME_LEN;
  hs->state = NET_HS_S_SERVER_WAIT_AUTH;
  return 0;
}

static int client_on_reject(struct net_hs *hs, const uint8_t *in, struct rumor_err *e) {
  char d[192];
  switch (in[5]) {
  case NET_REJECT_VERSION:
    if (in[6] <= in[7] && in[7] <= NET_PROTO_RETIRED) { /* an old server: it cannot take our versions */
      retired_version_msg(d, sizeof d, in[6], in[7]);
      return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e,
                  "the peer rejected the handshake: %s" RETIRED_WHY, d);
    }
    snprintf(d, sizeof d, "no common protocol version or cipher (the peer speaks %u..%u, we %u..%u)", in[6], in[7],
             NET_PROTO_MIN, NET_PROTO_MAX);
    return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e, "the peer rejected the handshake: %s", d);
  case NET_REJECT_CLUSTER:
    return fail(hs, NET_HS_FAIL_CLUSTER, RUMOR_EAUTH, e,
                "the peer rejected the handshake: %s", "we do not hold its cluster key");
  default:
    return fail(hs, NET_HS_FAIL_REJECTED, RUMOR_EAUTH, e, "the peer rejected the handshake%s", "");
  }
}

int net_hs_client_on_welcome(struct net_hs *hs, const uint8_t *in, size_t len, uint8_t *out, struct rumor_err *e) {
  if (hs->state != NET_HS_S_CLIENT_WAIT_WELCOME)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "unexpected handshake message%s", "");
  if (len < 8 || memcmp(in, NET_MAGIC, NET_MAGIC_BYTES) != 0)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "not a rumor peer (bad magic)%s", "");
  if (in[4] == NET_HS_REJECT && len == NET_HS_REJECT_LEN) return client_on_reject(hs, in, e);
  if (in[4] != NET_HS_WELCOME || len != NET_HS_WELCOME_LEN)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "malformed WELCOME%s", "");
  uint8_t v = in[5];
  unsigned suite = in[6];
  if (v < NET_PROTO_MIN || v > NET_PROTO_MAX)
    return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e, "the peer chose a protocol version we do not speak%s", "");
  if ((suite != NET_SUITE_AES256GCM && suite != NET_SUITE_CHACHA20POLY1305) || !(suite & hs->kr->suites) || in[7] != 0)
    return fail(hs, NET_HS_FAIL_VERSION, RUMOR_EPROTO, e, "the peer chose a cipher we did not offer%s", "");
  hs->version = v;
  hs->suite = suite;
  memcpy(hs->peer_e, in + 8, NET_X25519_BYTES);
  if (crypto_scalarmult(hs->dh, hs->e_sk, hs->peer_e) != 0)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "WELCOME carries a degenerate ephemeral key%s", "");
  crypto_generichash_update(&hs->th, in, NET_HS_WELCOME_CLEAR);
  uint8_t t1[TH_BYTES], t2[TH_BYTES], t3[TH_BYTES], plain[NET_PUBKEY_BYTES + NET_SIG_BYTES], sigmsg[SIGNED_MAX];
  th_snapshot(&hs->th, t1);
  derive_pair(hs, HS_KEYS_LABEL, t1, hs->k_hs_s2c, hs->k_hs_c2s);
  if (crypto_aead_chacha20poly1305_ietf_decrypt(plain, NULL, NULL, in + NET_HS_WELCOME_CLEAR, NET_HS_SEALED_ID_BYTES,
                                                t1, sizeof t1, zero_nonce, hs->k_hs_s2c) != 0)
    return fail(hs, NET_HS_FAIL_AUTH, RUMOR_EAUTH, e,
                "cannot decrypt the peer's identity: it holds another cluster key, or the handshake was tampered with%s",
                "");
  memcpy(hs->peer_pk, plain, NET_PUBKEY_BYTES);
  size_t sl = signed_bytes(sigmsg, SERVER_SIG_LABEL, t1, hs->peer_pk);
  if (crypto_sign_verify_detached(plain + NET_PUBKEY_BYTES, sigmsg, sl, hs->peer_pk) != 0)
    return fail(hs, NET_HS_FAIL_AUTH, RUMOR_EAUTH, e, "the peer's handshake signature is invalid%s", "");
  int rc = admit(hs, hs->peer_pk, e);
  if (rc < 0) return rc;
  crypto_generichash_update(&hs->th, in + NET_HS_WELCOME_CLEAR, NET_HS_SEALED_ID_BYTES);
  crypto_generichash_update(&hs->th, hs->peer_pk, NET_PUBKEY_BYTES);
  th_snapshot(&hs->th, t2);

  /* AUTH: our identity and signature over everything so far. */
  out[0] = NET_HS_AUTH;
  out[1] = out[2] = out[3] = 0;
  sl = signed_bytes(sigmsg, CLIENT_SIG_LABEL, t2, hs->kr->id.pk);
  memcpy(plain, hs->kr->id.pk, NET_PUBKEY_BYTES);
  crypto_sign_detached(plain + NET_PUBKEY_BYTES, NULL, sigmsg, sl, hs->kr->id.sk);
  crypto_aead_chacha20poly1305_ietf_encrypt(out + 4, NULL, plain, sizeof plain, t2, sizeof t2, NULL, zero_nonce,
                                            hs->k_hs_c2s);
  crypto_generichash_update(&hs->th, out, NET_HS_AUTH_LEN);
  crypto_generichash_update(&hs->th, hs->kr->id.pk, NET_PUBKEY_BYTES);
  th_snapshot(&hs->th, t3);
  derive_pair(hs, TRANSPORT_KEYS_LABEL, t3, hs->k_c2s, hs->k_s2c);
  sodium_memzero(plain, sizeof plain);
  wipe_ephemeral(hs);
  hs->state = NET_HS_S_CLIENT_WAIT_READY;
  return 0;
}

int net_hs_server_on_auth(struct net_hs *hs, const uint8_t *in, size_t len, struct rumor_err *e) {
  if (hs->state != NET_HS_S_SERVER_WAIT_AUTH)
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "unexpected handshake message%s", "");
  if (len != NET_HS_AUTH_LEN || in[0] != NET_HS_AUTH || in[1] || in[2] || in[3])
    return fail(hs, NET_HS_FAIL_MALFORMED, RUMOR_EPROTO, e, "malformed AUTH%s", "");
  uint8_t t2[TH_BYTES], t3[TH_BYTES], plain[NET_PUBKEY_BYTES + NET_SIG_BYTES], sigmsg[SIGNED_MAX];
  th_snapshot(&hs->th, t2);
  if (crypto_aead_chacha20poly1305_ietf_decrypt(plain, NULL, NULL, in + 4, NET_HS_SEALED_ID_BYTES, t2, sizeof t2,
                                                zero_nonce, hs->k_hs_c2s) != 0)
    return fail(hs, NET_HS_FAIL_AUTH, RUMOR_EAUTH, e,
                "cannot decrypt the peer's identity (tampered, replayed, or another cluster key)%s", "");
  memcpy(hs->peer_pk, plain, NET_PUBKEY_BYTES);
  size_t sl = signed_bytes(sigmsg, CLIENT_SIG_LABEL, t2, hs->peer_pk);
  if (crypto_sign_verify_detached(plain + NET_PUBKEY_BYTES, sigmsg, sl, hs->peer_pk) != 0)
    return fail(hs, NET_HS_FAIL_AUTH, RUMOR_EAUTH, e, "the peer's handshake signature is invalid%s", "");
  sodium_memzero(plain, sizeof plain);
  int rc = admit(hs, hs->peer_pk, e);
  if (rc < 0) return rc;
  crypto_generichash_update(&hs->th, in, NET_HS_AUTH_LEN);
  crypto_generichash_update(&hs->th, hs->peer_pk, NET_PUBKEY_BYTES);
  th_snapshot(&hs->th, t3);
  derive_pair(hs, TRANSPORT_KEYS_LABEL, t3, hs->k_c2s, hs->k_s2c);
  wipe_ephemeral(hs);
  hs->state = NET_HS_S_DONE;
  return 0;
}
