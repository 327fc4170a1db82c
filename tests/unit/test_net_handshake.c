/*
 * The handshake as pure functions: both sides agree on per-direction keys
 * and learn each other's verified identity; the cluster key, allow-lists,
 * versions and ciphers gate it; any modified bit, a replayed AUTH or a
 * replayed HELLO gets an attacker nothing.
 */
#include <criterion/criterion.h>
#include <string.h>

#include "net/net_impl.h"
#include "../integration/test_net_lsan.h"

static struct net_identity id_a, id_b;
static uint8_t cluster[NET_CLUSTER_KEY_BYTES];
static struct net_keyring kr_a, kr_b; /* a = client, b = server */

static void make_ring(struct net_keyring *kr, const struct net_identity *id, const uint8_t *ck,
                      const struct net_allowlist *allow, unsigned suites) {
  struct net_config cfg;
  net_config_defaults(&cfg);
  cfg.identity = id;
  cfg.cluster_key = ck;
  cfg.allow = allow;
  if (suites) cfg.suites = suites;
  struct rumor_err e = {0};
  cr_assert_eq(net_keyring_init(kr, &cfg, &e), 0, "%s", e.msg);
}

static void setup(void) {
  cr_assert_eq(net_crypto_init(), 0);
  cr_assert_eq(net_identity_generate(&id_a), 0);
  cr_assert_eq(net_identity_generate(&id_b), 0);
  cr_assert_eq(net_cluster_key_generate(cluster), 0);
  make_ring(&kr_a, &id_a, cluster, NULL, 0);
  make_ring(&kr_b, &id_b, cluster, NULL, 0);
}

static void teardown(void) {
  net_keyring_wipe(&kr_a);
  net_keyring_wipe(&kr_b);
}

/* The three messages of one handshake, as sent. */
struct transcript {
  uint8_t hello[NET_HS_HELLO_LEN], welcome[NET_HS_FRAME_MAX], auth[NET_HS_AUTH_LEN];
  size_t welcome_len;
};

/* Runs a whole handshake; returns 0 when both sides finished. */
static int run(struct net_hs *c, struct net_hs *s, struct transcript *t) {
  struct rumor_err e = {0};
  if (net_hs_client_start(c, &kr_a, t->hello) < 0) return -1;
  net_hs_server_start(s, &kr_b);
  int rc = net_hs_server_on_hello(s, t->hello, sizeof t->hello, t->welcome, &t->welcome_len, &e);
  if (rc < 0) return rc;
  rc = net_hs_client_on_welcome(c, t->welcome, t->welcome_len, t->auth, &e);
  if (rc < 0) return rc;
  return net_hs_server_on_auth(s, t->auth, sizeof t->auth, &e);
}

Test(net_handshake, both_sides_derive_the_same_keys_and_verified_identities, .init = setup, .fini = teardown) {
  struct net_hs c, s;
  struct transcript t;
  cr_assert_eq(run(&c, &s, &t), 0);
  cr_assert_eq(s.state, NET_HS_S_DONE);
  cr_assert_eq(c.state, NET_HS_S_CLIENT_WAIT_READY);
  cr_assert_eq(memcmp(c.k_c2s, s.k_c2s, 32), 0);
  cr_assert_eq(memcmp(c.k_s2c, s.k_s2c, 32), 0);
  cr_assert_neq(memcmp(c.k_c2s, c.k_s2c, 32), 0, "one key per direction");
  cr_assert_eq(memcmp(c.peer_pk, id_b.pk, 32), 0);
  cr_assert_eq(memcmp(s.peer_pk, id_a.pk, 32), 0);
  cr_assert_eq(c.suite, NET_SUITE_AES256GCM);
  cr_assert_eq(t.welcome_len, NET_HS_WELCOME_LEN);
  /* identities never travel in the clear */
  cr_assert_null(memmem(t.welcome, t.welcome_len, id_b.pk, 32));
  cr_assert_null(memmem(t.auth, sizeof t.auth, id_a.pk, 32));
  cr_assert_null(memmem(t.hello, sizeof t.hello, id_a.pk, 32));
  /* the ephemeral secrets are gone */
  uint8_t zero[32] = {0};
  cr_assert_eq(memcmp(c.e_sk, zero, 32), 0);
  cr_assert_eq(memcmp(s.e_sk, zero, 32), 0);
  cr_assert_eq(memcmp(s.dh, zero, 32), 0);
  net_hs_wipe(&c);
  net_hs_wipe(&s);
}

Test(net_handshake, every_session_gets_fresh_keys, .init = setup, .fini = teardown) {
  struct net_hs c1, s1, c2, s2;
  struct transcript t1, t2;
  cr_assert_eq(run(&c1, &s1, &t1), 0);
  cr_assert_eq(run(&c2, &s2, &t2), 0);
  cr_assert_neq(memcmp(c1.k_c2s, c2.k_c2s, 32), 0);
  cr_assert_neq(memcmp(t1.hello + 8, t2.hello + 8, 32), 0, "fresh ephemeral keys");
}

Test(net_handshake, a_different_cluster_key_is_rejected_at_hello, .init = setup, .fini = teardown) {
  uint8_t other[NET_CLUSTER_KEY_BYTES];
  memcpy(other, cluster, sizeof other);
  other[31] ^= 0x80;
  net_keyring_wipe(&kr_a);
  make_ring(&kr_a, &id_a, other, NULL, 0);
  struct net_hs c, s;
  struct transcript t;
  struct rumor_err e = {0};
  cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
  net_hs_server_start(&s, &kr_b);
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), RUMOR_EAUTH);
  cr_assert_eq(s.fail, NET_HS_FAIL_CLUSTER);
  cr_assert_eq(t.welcome_len, NET_HS_REJECT_LEN, "the client is told why");
  cr_assert_eq(net_hs_client_on_welcome(&c, t.welcome, t.welcome_len, t.auth, &e), RUMOR_EAUTH);
  cr_assert_eq(c.fail, NET_HS_FAIL_CLUSTER, "%s", e.msg);
}

Test(net_handshake, without_the_cluster_key_a_forged_welcome_cannot_be_opened, .init = setup, .fini = teardown) {
  /* A server that knows the tag key (say, it replays a tag) but not the
   * mixing key cannot make a WELCOME the client accepts: model it with a
   * server whose cluster key differs only in what it mixes. */
  struct net_hs c, s;
  struct transcript t;
  struct rumor_err e = {0};
  cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
  net_hs_server_start(&s, &kr_b);
  kr_b.mix_key[0] ^= 1;
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), 0);
  cr_assert_eq(net_hs_client_on_welcome(&c, t.welcome, t.welcome_len, t.auth, &e), RUMOR_EAUTH);
  cr_assert_eq(c.fail, NET_HS_FAIL_AUTH);
}

Test(net_handshake, allow_lists_are_enforced_on_both_sides, .init = setup, .fini = teardown) {
  struct net_identity stranger;
  cr_assert_eq(net_identity_generate(&stranger), 0);
  struct net_allowlist al;
  net_allowlist_from_keys(&al, (const uint8_t(*)[NET_PUBKEY_BYTES])stranger.pk, 1);
  struct net_hs c, s;
  struct transcript t;
  /* the server does not admit the client */
  net_keyring_wipe(&kr_b);
  make_ring(&kr_b, &id_b, cluster, &al, 0);
  cr_assert_eq(run(&c, &s, &t), RUMOR_EAUTH);
  cr_assert_eq(s.fail, NET_HS_FAIL_NOT_ALLOWED);
  /* the client does not admit the server */
  net_keyring_wipe(&kr_b);
  make_ring(&kr_b, &id_b, cluster, NULL, 0);
  net_keyring_wipe(&kr_a);
  make_ring(&kr_a, &id_a, cluster, &al, 0);
  cr_assert_eq(run(&c, &s, &t), RUMOR_EAUTH);
  cr_assert_eq(c.fail, NET_HS_FAIL_NOT_ALLOWED);
  net_allowlist_free(&al);
}

Test(net_handshake, versions_and_ciphers_are_negotiated, .init = setup, .fini = teardown) {
  struct net_hs c, s;
  struct transcript t;
  struct rumor_err e = {0};
  /* a client speaking 1..2 (a build without the heartbeat) gets version 2 */
  cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
  cr_assert_eq(t.hello[5], 2, "we offer 2..3");
  cr_assert_eq(t.hello[6], 3, "we offer 2..3");
  t.hello[5] = 1;
  t.hello[6] = 2;
  net_hs_server_start(&s, &kr_b);
  /* the range is covered by the tag, so recompute it as the client would */
  crypto_generichash(t.hello + 40, 16, t.hello, 40, kr_a.tag_key, 32);
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), 0);
  cr_assert_eq(t.welcome[5], 2);
  /* a client speaking 2..4 gets our highest, 3 (the heartbeat) */
  t.hello[5] = 2;
  t.hello[6] = 4;
  net_hs_server_start(&s, &kr_b);
  crypto_generichash(t.hello + 40, 16, t.hello, 40, kr_a.tag_key, 32);
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), 0);
  cr_assert_eq(t.welcome[5], NET_PROTO_PING);
  /* a client speaking only 4..5 gets a REJECT naming our range */
  t.hello[5] = 4;
  t.hello[6] = 5;
  net_hs_server_start(&s, &kr_b);
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), RUMOR_EPROTO);
  cr_assert_eq(s.fail, NET_HS_FAIL_VERSION);
  cr_assert_eq(t.welcome_len, NET_HS_REJECT_LEN);
  cr_assert_eq(t.welcome[4], NET_HS_REJECT);
  cr_assert_eq(t.welcome[6], NET_PROTO_MIN);
  cr_assert_eq(t.welcome[7], NET_PROTO_MAX);
  cr_assert_eq(net_hs_client_on_welcome(&c, t.welcome, t.welcome_len, t.auth, &e), RUMOR_EPROTO);
  cr_assert_eq(c.fail, NET_HS_FAIL_VERSION);
  cr_assert(strstr(e.msg, "version"), "%s", e.msg);
  /* a client offering only ChaCha20-Poly1305 gets it */
  net_keyring_wipe(&kr_a);
  make_ring(&kr_a, &id_a, cluster, NULL, NET_SUITE_CHACHA20POLY1305);
  cr_assert_eq(run(&c, &s, &t), 0);
  cr_assert_eq(s.suite, NET_SUITE_CHACHA20POLY1305);
  cr_assert_eq(c.suite, NET_SUITE_CHACHA20POLY1305);
}

/* A HELLO as a protocol-version-1 rumor sends it (versions 1..1). */
static void hello_v1(struct net_hs *c, uint8_t hello[NET_HS_HELLO_LEN]) {
  cr_assert_eq(net_hs_client_start(c, &kr_a, hello), 0);
  hello[5] = hello[6] = 1;
  crypto_generichash(hello + 40, 16, hello, 40, kr_a.tag_key, 32);
}

Test(net_handshake, a_version_1_peer_is_refused_with_a_message_that_says_so, .init = setup, .fini = teardown) {
  cr_assert_eq(NET_PROTO_MIN, 2, "version 1 is retired");
  struct net_hs c, s;
  struct transcript t;
  struct rumor_err e = {0};
  /* we are the server: an old client's HELLO gets REJECT/version and a clear message */
  hello_v1(&c, t.hello);
  net_hs_server_start(&s, &kr_b);
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), RUMOR_EPROTO);
  cr_assert_eq(s.fail, NET_HS_FAIL_VERSION);
  cr_assert_eq(t.welcome_len, NET_HS_REJECT_LEN);
  cr_assert_eq(t.welcome[4], NET_HS_REJECT);
  cr_assert_eq(t.welcome[5], NET_REJECT_VERSION);
  cr_assert_eq(t.welcome[6], NET_PROTO_MIN);
  cr_assert_eq(t.welcome[7], NET_PROTO_MAX);
  cr_log_info("server: %s", e.msg);
  cr_assert(strstr(e.msg, "the peer speaks protocol version 1, which this rumor no longer accepts"), "%s", e.msg);
  cr_assert(strstr(e.msg, "OpenSSL"), "%s", e.msg);
  cr_assert(strstr(e.msg, "upgrade it"), "%s", e.msg);
  /* we are the client: an old server answers our HELLO (2..3) with REJECT/version 1..1 */
  const uint8_t old_reject[NET_HS_REJECT_LEN] = {'r', 'u', 'm', 'r', NET_HS_REJECT, NET_REJECT_VERSION, 1, 1};
  struct rumor_err e2 = {0};
  cr_assert_eq(net_hs_client_on_welcome(&c, old_reject, sizeof old_reject, t.auth, &e2), RUMOR_EPROTO);
  cr_assert_eq(c.fail, NET_HS_FAIL_VERSION);
  cr_log_info("client: %s", e2.msg);
  cr_assert(strstr(e2.msg, "the peer speaks protocol version 1, which this rumor no longer accepts"), "%s", e2.msg);
  cr_assert(strstr(e2.msg, "upgrade it"), "%s", e2.msg);
  /* and a peer that speaks 1..2 is not refused: it gets version 2 */
  cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
  t.hello[5] = 1;
  t.hello[6] = 2;
  crypto_generichash(t.hello + 40, 16, t.hello, 40, kr_a.tag_key, 32);
  net_hs_server_start(&s, &kr_b);
  cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), 0);
  cr_assert_eq(t.welcome[5], 2);
  net_hs_wipe(&c);
  net_hs_wipe(&s);
}

Test(net_handshake, one_flipped_bit_in_any_message_fails_the_handshake, .init = setup, .fini = teardown) {
  struct transcript good;
  struct net_hs c, s;
  cr_assert_eq(run(&c, &s, &good), 0);
  struct rumor_err e = {0};
  /* HELLO */
  for (size_t i = 0; i < NET_HS_HELLO_LEN * 8; i++) {
    uint8_t hello[NET_HS_HELLO_LEN], out[NET_HS_FRAME_MAX];
    size_t out_len;
    cr_assert_eq(net_hs_client_start(&c, &kr_a, hello), 0);
    hello[i / 8] ^= (uint8_t)(1u << (i % 8));
    net_hs_server_start(&s, &kr_b);
    cr_assert_lt(net_hs_server_on_hello(&s, hello, sizeof hello, out, &out_len, &e), 0, "HELLO bit %zu", i);
  }
  /* WELCOME */
  for (size_t i = 0; i < NET_HS_WELCOME_LEN * 8; i++) {
    struct transcript t;
    cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
    net_hs_server_start(&s, &kr_b);
    cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), 0);
    t.welcome[i / 8] ^= (uint8_t)(1u << (i % 8));
    cr_assert_lt(net_hs_client_on_welcome(&c, t.welcome, t.welcome_len, t.auth, &e), 0, "WELCOME bit %zu", i);
  }
  /* AUTH */
  for (size_t i = 0; i < NET_HS_AUTH_LEN * 8; i++) {
    struct transcript t;
    cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
    net_hs_server_start(&s, &kr_b);
    cr_assert_eq(net_hs_server_on_hello(&s, t.hello, sizeof t.hello, t.welcome, &t.welcome_len, &e), 0);
    cr_assert_eq(net_hs_client_on_welcome(&c, t.welcome, t.welcome_len, t.auth, &e), 0);
    t.auth[i / 8] ^= (uint8_t)(1u << (i % 8));
    cr_assert_lt(net_hs_server_on_auth(&s, t.auth, sizeof t.auth, &e), 0, "AUTH bit %zu", i);
  }
}

Test(net_handshake, a_replayed_auth_fails_on_a_new_session, .init = setup, .fini = teardown) {
  struct net_hs c, s;
  struct transcript old;
  cr_assert_eq(run(&c, &s, &old), 0);
  /* The attacker replays the old HELLO (accepted: it carries a valid tag)
   * and then the old AUTH, which was bound to the old server ephemeral. */
  struct rumor_err e = {0};
  struct net_hs s2;
  uint8_t welcome[NET_HS_FRAME_MAX];
  size_t wl;
  net_hs_server_start(&s2, &kr_b);
  cr_assert_eq(net_hs_server_on_hello(&s2, old.hello, sizeof old.hello, welcome, &wl, &e), 0);
  cr_assert_neq(memcmp(welcome + 8, old.welcome + 8, 32), 0, "the server picked a fresh ephemeral");
  cr_assert_eq(net_hs_server_on_auth(&s2, old.auth, sizeof old.auth, &e), RUMOR_EAUTH);
  cr_assert_eq(s2.fail, NET_HS_FAIL_AUTH);
}

Test(net_handshake, messages_out_of_order_or_of_the_wrong_size_fail, .init = setup, .fini = teardown) {
  struct net_hs c, s;
  struct transcript t;
  struct rumor_err e = {0};
  cr_assert_eq(net_hs_client_start(&c, &kr_a, t.hello), 0);
  net_hs_server_start(&s, &kr_b);
  cr_assert_lt(net_hs_server_on_auth(&s, t.hello, sizeof t.hello, &e), 0, "AUTH before HELLO");
  net_hs_server_start(&s, &kr_b);
  cr_assert_lt(net_hs_server_on_hello(&s, t.hello, sizeof t.hello - 1, t.welcome, &t.welcome_len, &e), 0);
  cr_assert_eq(s.fail, NET_HS_FAIL_MALFORMED);
  net_hs_server_start(&s, &kr_b);
  cr_assert_lt(net_hs_server_on_hello(&s, t.hello, 3, t.welcome, &t.welcome_len, &e), 0);
  cr_assert_lt(net_hs_client_on_welcome(&c, t.hello, sizeof t.hello, t.auth, &e), 0, "a HELLO is no WELCOME");
}

Test(net_handshake, our_own_identity_on_the_other_side_is_refused, .init = setup, .fini = teardown) {
  net_keyring_wipe(&kr_a);
  make_ring(&kr_a, &id_b, cluster, NULL, 0);
  struct net_hs c, s;
  struct transcript t;
  cr_assert_eq(run(&c, &s, &t), RUMOR_EAUTH);
  cr_assert_eq(c.fail, NET_HS_FAIL_SELF);
}
