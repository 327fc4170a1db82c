/*
 * Key files and allow-lists: round trips, 0600 and refusal to overwrite,
 * refusal to load secrets others can read or that are not regular files, and
 * malformed input named by file and line.
 */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/net_impl.h"
#include "../integration/test_net_lsan.h"

static char dir[256];

static void setup(void) {
  cr_assert_eq(net_crypto_init(), 0);
  snprintf(dir, sizeof dir, "/tmp/rumor-keys-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void) {
  char cmd[300];
  snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
  if (system(cmd) != 0) cr_log_warn("could not remove %s", dir);
}

static void path_of(char *out, size_t cap, const char *name) { snprintf(out, cap, "%s/%s", dir, name); }

static void write_file(const char *path, const char *text, mode_t mode) {
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  fputs(text, f);
  fclose(f);
  cr_assert_eq(chmod(path, mode), 0);
}

Test(net_keys, an_identity_round_trips_through_a_0600_file, .init = setup, .fini = teardown) {
  char p[300];
  path_of(p, sizeof p, "id");
  struct net_identity id, back;
  struct rumor_err e = {0};
  cr_assert_eq(net_identity_generate(&id), 0);
  cr_assert_eq(net_identity_save(p, &id, false, &e), 0, "%s", e.msg);
  struct stat st;
  cr_assert_eq(stat(p, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600, "mode %o", st.st_mode & 0777);
  cr_assert_eq(net_identity_load(p, &back, &e), 0, "%s", e.msg);
  cr_assert_eq(memcmp(&id, &back, sizeof id), 0);
  /* the loaded key signs what the public key verifies */
  uint8_t sig[64];
  crypto_sign_detached(sig, NULL, (const uint8_t *)"x", 1, back.sk);
  cr_assert_eq(crypto_sign_verify_detached(sig, (const uint8_t *)"x", 1, id.pk), 0);
  /* the file starts with its magic and version */
  FILE *f = fopen(p, "r");
  char line[64];
  cr_assert_not_null(fgets(line, sizeof line, f));
  fclose(f);
  cr_assert_str_eq(line, "rumor-identity v1\n");
}

Test(net_keys, an_existing_file_is_not_overwritten_unless_forced, .init = setup, .fini = teardown) {
  char p[300];
  path_of(p, sizeof p, "id");
  struct net_identity a, b, back;
  struct rumor_err e = {0};
  cr_assert_eq(net_identity_generate(&a), 0);
  cr_assert_eq(net_identity_generate(&b), 0);
  cr_assert_eq(net_identity_save(p, &a, false, &e), 0);
  cr_assert_eq(net_identity_save(p, &b, false, &e), -EEXIST);
  cr_assert(strstr(e.msg, "--force"), "%s", e.msg);
  cr_assert_eq(net_identity_load(p, &back, &e), 0);
  cr_assert_eq(memcmp(back.pk, a.pk, 32), 0, "untouched");
  cr_assert_eq(net_identity_save(p, &b, true, &e), 0, "%s", e.msg);
  cr_assert_eq(net_identity_load(p, &back, &e), 0);
  cr_assert_eq(memcmp(back.pk, b.pk, 32), 0, "replaced");
  /* no temporary files are left behind */
  char cmd[400];
  snprintf(cmd, sizeof cmd, "test $(ls -A '%s' | wc -l) -eq 1", dir);
  cr_assert_eq(system(cmd), 0);
}

Test(net_keys, a_secret_that_others_can_read_is_refused, .init = setup, .fini = teardown) {
  char p[300];
  path_of(p, sizeof p, "id");
  struct net_identity id;
  struct rumor_err e = {0};
  cr_assert_eq(net_identity_generate(&id), 0);
  cr_assert_eq(net_identity_save(p, &id, false, &e), 0);
  const mode_t bad[] = {0644, 0640, 0604, 0620, 0602};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_eq(chmod(p, bad[i]), 0);
    cr_assert_eq(net_identity_load(p, &id, &e), -EACCES, "mode %o", bad[i]);
    cr_assert(strstr(e.msg, "chmod 600") && strstr(e.msg, p), "%s", e.msg);
  }
  cr_assert_eq(chmod(p, 0400), 0);
  cr_assert_eq(net_identity_load(p, &id, &e), 0, "0400 is fine");
}

/* `rumor peer --identity FIFO` waited for ever in open(2), deaf to SIGTERM:
 * every key file reader now refuses a FIFO at once (the timeout turns a
 * regression into a failure rather than a hung suite). */
Test(net_keys, a_fifo_as_a_key_file_or_allow_list_is_refused_at_once, .init = setup, .fini = teardown,
     .timeout = 10) {
  char p[300];
  path_of(p, sizeof p, "fifo");
  cr_assert_eq(mkfifo(p, 0600), 0);
  struct net_identity id;
  uint8_t key[NET_CLUSTER_KEY_BYTES];
  struct net_allowlist al;
  struct rumor_err e = {0};
  cr_assert_eq(net_identity_load(p, &id, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, p) && strstr(e.msg, "is not a regular file (it is a FIFO)"), "%s", e.msg);
  cr_assert_eq(net_cluster_key_load(p, key, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, p) && strstr(e.msg, "is not a regular file"), "%s", e.msg);
  cr_assert_eq(net_allowlist_load(p, &al, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, p) && strstr(e.msg, "is not a regular file"), "%s", e.msg);
}

Test(net_keys, malformed_identity_files_are_named_with_the_reason, .init = setup, .fini = teardown) {
  char p[300];
  path_of(p, sizeof p, "id");
  struct net_identity id, good;
  struct rumor_err e = {0};
  cr_assert_eq(net_identity_generate(&good), 0);
  char pk[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(pk, good.pk);
  char text[512];
  const char *cases[] = {
      "",
      "hello\n",
      "rumor-identity v2\npublic AAAA\nseed BBBB\n",
      "rumor-identity v1\n",
      "rumor-identity v1\npublic nope\nseed nope\n",
      "rumor-cluster-key v1\nkey AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=\n",
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    write_file(p, cases[i], 0600);
    cr_assert_lt(net_identity_load(p, &id, &e), 0, "case %zu", i);
    cr_assert(strstr(e.msg, p), "case %zu names the file: %s", i, e.msg);
  }
  /* a public key that does not belong to the seed */
  snprintf(text, sizeof text, "rumor-identity v1\npublic %s\nseed %s\n", pk,
           "AAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAA=");
  write_file(p, text, 0600);
  cr_assert_eq(net_identity_load(p, &id, &e), RUMOR_ECORRUPT, "%s", e.msg);
  /* trailing garbage */
  struct net_identity g2;
  cr_assert_eq(net_identity_generate(&g2), 0);
  cr_assert_eq(net_identity_save(p, &g2, true, &e), 0);
  FILE *f = fopen(p, "a");
  fputs("extra\n", f);
  fclose(f);
  cr_assert_eq(net_identity_load(p, &id, &e), RUMOR_EFORMAT, "%s", e.msg);
  cr_assert_eq(net_identity_load("/nonexistent/id", &id, &e), -ENOENT);
}

Test(net_keys, a_cluster_key_round_trips, .init = setup, .fini = teardown) {
  char p[300];
  path_of(p, sizeof p, "cluster");
  uint8_t k[32], back[32];
  struct rumor_err e = {0};
  cr_assert_eq(net_cluster_key_generate(k), 0);
  cr_assert_eq(net_cluster_key_save(p, k, false, &e), 0);
  struct stat st;
  cr_assert_eq(stat(p, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600);
  cr_assert_eq(net_cluster_key_load(p, back, &e), 0, "%s", e.msg);
  cr_assert_eq(memcmp(k, back, 32), 0);
  cr_assert_eq(net_cluster_key_save(p, k, false, &e), -EEXIST);
  cr_assert_eq(chmod(p, 0644), 0);
  cr_assert_eq(net_cluster_key_load(p, back, &e), -EACCES);
  struct net_identity id;
  cr_assert_eq(chmod(p, 0600), 0);
  cr_assert_lt(net_identity_load(p, &id, &e), 0, "a cluster key is not an identity");
}

Test(net_keys, allow_lists_take_comments_blank_lines_and_duplicates, .init = setup, .fini = teardown) {
  struct net_identity a, b, c;
  cr_assert_eq(net_identity_generate(&a), 0);
  cr_assert_eq(net_identity_generate(&b), 0);
  cr_assert_eq(net_identity_generate(&c), 0);
  char ka[45], kb[45], text[1024], p[300];
  net_pubkey_format(ka, a.pk);
  net_pubkey_format(kb, b.pk);
  snprintf(text, sizeof text,
           "# peers of the test cluster\n\n  %s   # node a\r\n%s\n\t%s\n# end\n", ka, kb, ka);
  path_of(p, sizeof p, "allow");
  write_file(p, text, 0644);
  struct net_allowlist al;
  struct rumor_err e = {0};
  cr_assert_eq(net_allowlist_load(p, &al, &e), 0, "%s", e.msg);
  cr_assert_eq(al.n, 2, "duplicates merged");
  cr_assert(net_allowlist_contains(&al, a.pk));
  cr_assert(net_allowlist_contains(&al, b.pk));
  cr_assert(!net_allowlist_contains(&al, c.pk));
  net_allowlist_free(&al);
  write_file(p, "", 0644);
  cr_assert_eq(net_allowlist_load(p, &al, &e), 0);
  cr_assert_eq(al.n, 0);
  net_allowlist_free(&al);
}

Test(net_keys, a_bad_allow_list_line_is_named_by_file_and_line, .init = setup, .fini = teardown) {
  struct net_identity a;
  cr_assert_eq(net_identity_generate(&a), 0);
  char ka[45], text[1024], p[300], want[400];
  net_pubkey_format(ka, a.pk);
  path_of(p, sizeof p, "allow");
  const char *bad[] = {"not-a-key", "AAAA", "%s extra-words", "%s\x01"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    char line[128];
    snprintf(line, sizeof line, bad[i], ka);
    snprintf(text, sizeof text, "# header\n%s\n\n%s\n", ka, line);
    write_file(p, text, 0644);
    struct net_allowlist al;
    struct rumor_err e = {0};
    cr_assert_eq(net_allowlist_load(p, &al, &e), RUMOR_EFORMAT, "case %zu", i);
    snprintf(want, sizeof want, "%s:4:", p);
    cr_assert(strstr(e.msg, want), "case %zu: '%s' should name %s", i, e.msg, want);
  }
}

Test(net_keys, public_keys_print_and_parse_canonically) {
  cr_assert_eq(net_crypto_init(), 0);
  struct net_identity a;
  cr_assert_eq(net_identity_generate(&a), 0);
  char s[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(s, a.pk);
  cr_assert_eq(strlen(s), NET_PUBKEY_STR_LEN);
  uint8_t back[32];
  cr_assert_eq(net_pubkey_parse(s, strlen(s), back), 0);
  cr_assert_eq(memcmp(back, a.pk, 32), 0);
  cr_assert_eq(net_pubkey_parse(s, strlen(s) - 1, back), RUMOR_EFORMAT);
  /* the last character carries 4 unused bits: a non-zero one is not canonical */
  char alt[NET_PUBKEY_STR_LEN + 1];
  memcpy(alt, s, sizeof alt);
  const char *b64 = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  int idx = (int)(strchr(b64, alt[42]) - b64);
  alt[42] = b64[idx ^ 1];
  cr_assert_eq(net_pubkey_parse(alt, strlen(alt), back), RUMOR_EFORMAT);
}
