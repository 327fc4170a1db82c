/* Identities, cluster keys, allow-lists and their files. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "net/net_impl.h"

#define IDENTITY_MAGIC "rumor-identity v1"
#define CLUSTER_MAGIC "rumor-cluster-key v1"
#define B64_VARIANT sodium_base64_VARIANT_ORIGINAL
#define B64_BUF_32 (NET_PUBKEY_STR_LEN + 1) /* 32 bytes -> 44 chars + NUL */

int net_crypto_init(void) {
  /* sodium_init is idempotent and thread-safe; 1 means "already done". */
  return sodium_init() < 0 ? -EIO : 0;
}

int net_identity_generate(struct net_identity *id) {
  if (net_crypto_init() < 0) return -EIO;
  return crypto_sign_keypair(id->pk, id->sk) == 0 ? 0 : -EIO;
}

int net_cluster_key_generate(uint8_t key[NET_CLUSTER_KEY_BYTES]) {
  if (net_crypto_init() < 0) return -EIO;
  randombytes_buf(key, NET_CLUSTER_KEY_BYTES);
  return 0;
}

void net_identity_wipe(struct net_identity *id) { sodium_memzero(id, sizeof *id); }

void net_identity_derive(const struct net_identity *parent, const char *label, struct net_identity *out) {
  uint8_t seed[NET_SEED_BYTES];
  crypto_generichash(seed, sizeof seed, (const uint8_t *)label, strlen(label), parent->sk, NET_SEED_BYTES);
  crypto_sign_seed_keypair(out->pk, out->sk, seed);
  sodium_memzero(seed, sizeof seed);
}

void net_pubkey_format(char out[NET_PUBKEY_STR_LEN + 1], const uint8_t pk[NET_PUBKEY_BYTES]) {
  sodium_bin2base64(out, NET_PUBKEY_STR_LEN + 1, pk, NET_PUBKEY_BYTES, B64_VARIANT);
}

/* Decodes exactly 32 bytes from canonical base64 text of length `len`. */
static int b64_decode_32(const char *s, size_t len, uint8_t out[32]) {
  if (len != NET_PUBKEY_STR_LEN) return RUMOR_EFORMAT;
  size_t got = 0;
  const char *end = NULL;
  if (sodium_base642bin(out, 32, s, len, NULL, &got, &end, B64_VARIANT) != 0 || got != 32 ||
      end != s + len)
    return RUMOR_EFORMAT;
  /* Canonical only: re-encoding must give the same text (no stray low bits). */
  char back[B64_BUF_32];
  sodium_bin2base64(back, sizeof back, out, 32, B64_VARIANT);
  if (memcmp(back, s, len) != 0) return RUMOR_EFORMAT;
  return 0;
}

int net_pubkey_parse(const char *s, size_t len, uint8_t pk[NET_PUBKEY_BYTES]) {
  return b64_decode_32(s, len, pk);
}

/* ---- secret files -------------------------------------------------------- */

/* Writes `len` bytes to `path` with mode 0600, atomically (util's
 * file_write_atomic: an unpredictable temporary created with O_EXCL |
 * O_NOFOLLOW, fsync, then rename over `path` (force) or link to `path`,
 * which fails if anything is there, so an existing key is never replaced,
 * even by a race). */
static int secret_file_write(const char *path, const void *data, size_t len, bool force, struct rumor_err *e) {
  struct file_part part = {data, len};
  int rc = file_write_atomic(path, &part, 1, 0600, force ? 0 : FILE_ATOMIC_NO_REPLACE, e);
  if (rc == -EEXIST && !force)
    rumor_err_set(e, -EEXIST, "%s already exists; refusing to overwrite it (use --force)", path);
  return rc;
}

/* Reads a small secret file into buf (NUL-terminated), refusing files that
 * group or others may read or write. The caller wipes buf. */
static int secret_file_read(const char *path, char *buf, size_t cap, size_t *len, struct rumor_err *e) {
  struct stat st;
  int fd = file_open_regular(path, O_RDONLY, 0, &st, e);
  if (fd < 0) return fd;
  int rc = 0;
  if (st.st_mode & 077) {
    rc = rumor_err_set(e, -EACCES,
                       "%s holds a secret key but group or others may access it (mode %04o); "
                       "run: chmod 600 %s",
                       path, (unsigned)(st.st_mode & 07777), path);
    goto out;
  }
  if ((uint64_t)st.st_size >= cap) {
    rc = rumor_err_set(e, RUMOR_ETOOBIG, "%s is %lld bytes, too large for a key file", path,
                       (long long)st.st_size);
    goto out;
  }
  size_t got = 0;
  while (got < cap - 1) {
    ssize_t r = read(fd, buf + got, cap - 1 - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) {
      rc = rumor_err_set(e, -errno, "cannot read %s: %s", path, strerror(errno));
      goto out;
    }
    if (r == 0) break;
    got += (size_t)r;
  }
  buf[got] = '\0';
  *len = got;
out:
  close(fd);
  return rc;
}

/* Splits the text into lines; for each of the `n` expected lines checks the
 * exact prefix and decodes the 32-byte base64 value after it. */
struct kv_line {
  const char *prefix; /* "public " etc., or the magic line when value is NULL */
  uint8_t *value;     /* 32 bytes out */
};

static int parse_key_file(const char *path, const char *text, size_t len, const struct kv_line *lines,
                          size_t n, struct rumor_err *e) {
  const char *p = text, *end = text + len;
  for (size_t i = 0; i < n; i++) {
    if (p >= end)
      return rumor_err_set(e, RUMOR_EFORMAT, "%s: line %zu: missing (file truncated?)", path, i + 1);
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    const char *le = nl ? nl : end;
    size_t ll = (size_t)(le - p);
    if (ll > 0 && p[ll - 1] == '\r') ll--;
    size_t pl = strlen(lines[i].prefix);
    if (ll < pl || memcmp(p, lines[i].prefix, pl) != 0) {
      if (i == 0)
        return rumor_err_set(e, RUMOR_EFORMAT, "%s: not a %s file (first line must be '%s')", path,
                             lines[0].prefix, lines[0].prefix);
      return rumor_err_set(e, RUMOR_EFORMAT, "%s: line %zu: expected '%s<base64>'", path, i + 1,
                           lines[i].prefix);
    }
    if (lines[i].value) {
      if (b64_decode_32(p + pl, ll - pl, lines[i].value) != 0)
        return rumor_err_set(e, RUMOR_EFORMAT, "%s: line %zu: not a 32-byte base64 value", path, i + 1);
    } else if (ll != pl) {
      return rumor_err_set(e, RUMOR_EFORMAT, "%s: unsupported header '%.*s' (this build reads '%s')", path,
                           (int)(ll > 64 ? 64 : ll), p, lines[i].prefix);
    }
    p = nl ? nl + 1 : end;
  }
  for (; p < end; p++)
    if (*p != '\n' && *p != '\r' && *p != ' ')
      return rumor_err_set(e, RUMOR_EFORMAT, "%s: unexpected text after line %zu", path, n);
  return 0;
}

int net_identity_save(const char *path, const struct net_identity *id, bool force, struct rumor_err *e) {
  if (net_crypto_init() < 0) return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  char pk[B64_BUF_32], seed[B64_BUF_32];
  uint8_t raw_seed[NET_SEED_BYTES];
  char text[256];
  crypto_sign_ed25519_sk_to_seed(raw_seed, id->sk);
  net_pubkey_format(pk, id->pk);
  sodium_bin2base64(seed, sizeof seed, raw_seed, sizeof raw_seed, B64_VARIANT);
  int n = snprintf(text, sizeof text, IDENTITY_MAGIC "\npublic %s\nseed %s\n", pk, seed);
  int rc = secret_file_write(path, text, (size_t)n, force, e);
  sodium_memzero(raw_seed, sizeof raw_seed);
  sodium_memzero(seed, sizeof seed);
  sodium_memzero(text, sizeof text);
  return rc;
}

int net_identity_load(const char *path, struct net_identity *id, struct rumor_err *e) {
  if (net_crypto_init() < 0) return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  char text[NET_KEYFILE_MAX];
  size_t len = 0;
  uint8_t pk[NET_PUBKEY_BYTES], seed[NET_SEED_BYTES];
  int rc = secret_file_read(path, text, sizeof text, &len, e);
  if (rc < 0) goto out;
  const struct kv_line lines[] = {{IDENTITY_MAGIC, NULL}, {"public ", pk}, {"seed ", seed}};
  rc = parse_key_file(path, text, len, lines, 3, e);
  if (rc < 0) goto out;
  if (crypto_sign_seed_keypair(id->pk, id->sk, seed) != 0) {
    rc = rumor_err_set(e, -EIO, "%s: cannot derive the key pair", path);
    goto out;
  }
  if (sodium_memcmp(id->pk, pk, NET_PUBKEY_BYTES) != 0) {
    net_identity_wipe(id);
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: the public key does not match the secret seed", path);
    goto out;
  }
out:
  sodium_memzero(text, sizeof text);
  sodium_memzero(seed, sizeof seed);
  return rc;
}

int net_cluster_key_save(const char *path, const uint8_t key[NET_CLUSTER_KEY_BYTES], bool force,
                         struct rumor_err *e) {
  if (net_crypto_init() < 0) return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  char b64[B64_BUF_32], text[128];
  sodium_bin2base64(b64, sizeof b64, key, NET_CLUSTER_KEY_BYTES, B64_VARIANT);
  int n = snprintf(text, sizeof text, CLUSTER_MAGIC "\nkey %s\n", b64);
  int rc = secret_file_write(path, text, (size_t)n, force, e);
  sodium_memzero(b64, sizeof b64);
  sodium_memzero(text, sizeof text);
  return rc;
}

int net_cluster_key_load(const char *path, uint8_t key[NET_CLUSTER_KEY_BYTES], struct rumor_err *e) {
  if (net_crypto_init() < 0) return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  char text[NET_KEYFILE_MAX];
  size_t len = 0;
  int rc = secret_file_read(path, text, sizeof text, &len, e);
  if (rc == 0) {
    const struct kv_line lines[] = {{CLUSTER_MAGIC, NULL}, {"key ", key}};
    rc = parse_key_file(path, text, len, lines, 2, e);
    if (rc < 0) sodium_memzero(key, NET_CLUSTER_KEY_BYTES);
  }
  sodium_memzero(text, sizeof text);
  return rc;
}

/* ---- allow-lists ------------------------------------------------------------ */

static int cmp_key(const void *a, const void *b) { return memcmp(a, b, NET_PUBKEY_BYTES); }

static void allowlist_sort(struct net_allowlist *al) {
  if (al->n < 2) return;
  qsort(al->keys, al->n, NET_PUBKEY_BYTES, cmp_key);
  size_t w = 1;
  for (size_t r = 1; r < al->n; r++)
    if (memcmp(al->keys[r], al->keys[w - 1], NET_PUBKEY_BYTES) != 0) memcpy(al->keys[w++], al->keys[r], NET_PUBKEY_BYTES);
  al->n = w;
}

void net_allowlist_from_keys(struct net_allowlist *al, const uint8_t (*keys)[NET_PUBKEY_BYTES], size_t n) {
  al->n = n;
  al->keys = xmalloc(n ? n * NET_PUBKEY_BYTES : 1);
  if (n) memcpy(al->keys, keys, n * NET_PUBKEY_BYTES);
  allowlist_sort(al);
}

static bool is_space(char c) { return c == ' ' || c == '\t' || c == '\r'; }

int net_allowlist_load(const char *path, struct net_allowlist *al, struct rumor_err *e) {
  uint8_t *text = NULL;
  size_t len = 0;
  al->n = 0;
  al->keys = NULL;
  int rc = file_read_all(path, NET_ALLOWLIST_MAX, &text, &len, e);
  if (rc < 0) return rc;
  size_t cap = 16, n = 0;
  uint8_t (*keys)[NET_PUBKEY_BYTES] = xmalloc(cap * NET_PUBKEY_BYTES);
  const char *p = (const char *)text, *end = p + len;
  size_t lineno = 0;
  while (p < end) {
    lineno++;
    const char *nl = memchr(p, '\n', (size_t)(end - p));
    const char *le = nl ? nl : end;
    const char *s = p;
    while (s < le && is_space(*s)) s++;
    const char *t = s;
    while (t < le && !is_space(*t) && *t != '#') t++;
    const char *rest = t;
    while (rest < le && is_space(*rest)) rest++;
    if (t > s) {
      if (rest < le && *rest != '#') {
        rc = rumor_err_set(e, RUMOR_EFORMAT, "%s:%zu: unexpected text after the key: '%.*s'", path, lineno,
                           (int)((le - rest) > 40 ? 40 : (le - rest)), rest);
        goto fail;
      }
      if (n == cap) {
        cap *= 2;
        keys = xrealloc(keys, cap * NET_PUBKEY_BYTES);
      }
      if (b64_decode_32(s, (size_t)(t - s), keys[n]) != 0) {
        rc = rumor_err_set(e, RUMOR_EFORMAT,
                           "%s:%zu: not a public key: '%.*s' (expected %d characters of base64, "
                           "as printed by 'rumor keygen')",
                           path, lineno, (int)((t - s) > 60 ? 60 : (t - s)), s, NET_PUBKEY_STR_LEN);
        goto fail;
      }
      n++;
    } else if (t < le && *t != '#') {
      rc = rumor_err_set(e, RUMOR_EFORMAT, "%s:%zu: cannot parse line", path, lineno);
      goto fail;
    }
    p = nl ? nl + 1 : end;
  }
  free(text);
  al->n = n;
  al->keys = keys;
  allowlist_sort(al);
  return 0;
fail:
  free(text);
  free(keys);
  return rc;
}

bool net_allowlist_contains(const struct net_allowlist *al, const uint8_t pk[NET_PUBKEY_BYTES]) {
  if (!al || al->n == 0) return false;
  return bsearch(pk, al->keys, al->n, NET_PUBKEY_BYTES, cmp_key) != NULL;
}

void net_allowlist_free(struct net_allowlist *al) {
  free(al->keys);
  al->keys = NULL;
  al->n = 0;
}

/* ---- the keyring a net derives from its configuration ---------------------- */

#define KDF_CONTEXT "rumor_hs" /* crypto_kdf_CONTEXTBYTES == 8 */
#define KDF_ID_TAG 1
#define KDF_ID_MIX 2
_Static_assert(sizeof(KDF_CONTEXT) - 1 == crypto_kdf_CONTEXTBYTES, "kdf context is 8 bytes");

int net_keyring_init(struct net_keyring *kr, const struct net_config *cfg, struct rumor_err *e) {
  memset(kr, 0, sizeof *kr);
  if (net_crypto_init() < 0) return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  if (!cfg->identity || !cfg->cluster_key)
    return rumor_err_set(e, -EINVAL, "net: an identity and a cluster key are required");
  kr->id = *cfg->identity;
  if (crypto_kdf_derive_from_key(kr->tag_key, sizeof kr->tag_key, KDF_ID_TAG, KDF_CONTEXT, cfg->cluster_key) != 0 ||
      crypto_kdf_derive_from_key(kr->mix_key, sizeof kr->mix_key, KDF_ID_MIX, KDF_CONTEXT, cfg->cluster_key) != 0) {
    net_keyring_wipe(kr);
    return rumor_err_set(e, -EIO, "net: key derivation failed");
  }
  if (cfg->allow) {
    net_allowlist_from_keys(&kr->allow, (const uint8_t(*)[NET_PUBKEY_BYTES])cfg->allow->keys, cfg->allow->n);
    kr->have_allow = true;
  }
  kr->suites = cfg->suites & (NET_SUITE_AES256GCM | NET_SUITE_CHACHA20POLY1305);
  if (!crypto_aead_aes256gcm_is_available()) kr->suites &= ~(unsigned)NET_SUITE_AES256GCM;
  if (!kr->suites) {
    net_keyring_wipe(kr);
    return rumor_err_set(e, -EINVAL, "net: no usable cipher suite in the configuration");
  }
  return 0;
}

void net_keyring_wipe(struct net_keyring *kr) {
  net_allowlist_free(&kr->allow);
  sodium_memzero(kr, sizeof *kr);
}
