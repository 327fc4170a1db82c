/* `rumor keygen`: identities and cluster keys for net's handshake. */
#include <sodium.h>
#include <stdio.h>
#include <string.h>

#include "net/net.h"
#include "peer/cli/cli_impl.h"

#define KEYGEN_MAX_ARGS 64

static const char *synopsis = "rumor keygen -o FILE [--force] | --cluster -o FILE [--force] | --public FILE";
static const char *about =
    "Writes a new Ed25519 identity to FILE (mode 0600) and prints its public key, in the\n"
    "base64 form that allow-list files use. With --cluster, writes a new 32-byte cluster\n"
    "key instead: every member of a cluster needs the same one. With --public, prints\n"
    "the public key of an existing identity file. An existing FILE is never replaced\n"
    "unless --force is given.";

int cmd_keygen(int argc, char **argv) {
  const char *out = NULL, *pub = NULL;
  bool cluster = false, force = false;
  const struct arg_spec specs[] = {
      {"out", ARG_STR, &out, "FILE", "where to write the new key (also -o FILE)", 0, 0},
      {"cluster", ARG_FLAG, &cluster, NULL, "write a cluster key instead of an identity", 0, 0},
      {"force", ARG_FLAG, &force, NULL, "replace FILE if it exists", 0, 0},
      {"public", ARG_STR, &pub, "FILE", "print the public key of an identity file and exit", 0, 0},
      {NULL, ARG_FLAG, NULL, NULL, NULL, 0, 0},
  };
  /* Accept the short "-o FILE" too (args_parse knows only long options). */
  if (argc > KEYGEN_MAX_ARGS) {
    fprintf(stderr, "keygen: too many arguments\n");
    return 2;
  }
  char *args[KEYGEN_MAX_ARGS + 1];
  for (int i = 0; i < argc; i++) args[i] = strcmp(argv[i], "-o") == 0 && i > 0 ? "--out" : argv[i];
  args[argc] = NULL;
  int rc = args_parse(specs, argc, args, synopsis, about);
  if (rc == ARGS_HELP) return 0;
  if (rc != ARGS_OK) return 2;
  if (pub && (out || cluster || force)) {
    fprintf(stderr, "keygen: --public takes no other option\n");
    return 2;
  }
  if (!pub && !out) {
    fprintf(stderr, "keygen: missing -o FILE (see --help)\n");
    return 2;
  }
  struct rumor_err e = {0};
  if (pub) {
    struct net_identity id;
    if (net_identity_load(pub, &id, &e) != 0) {
      fprintf(stderr, "keygen: %s\n", e.msg);
      return 1;
    }
    char s[NET_PUBKEY_STR_LEN + 1];
    net_pubkey_format(s, id.pk);
    net_identity_wipe(&id);
    printf("%s\n", s);
    return 0;
  }
  if (cluster) {
    uint8_t key[NET_CLUSTER_KEY_BYTES];
    if (net_cluster_key_generate(key) != 0) {
      fprintf(stderr, "keygen: cannot generate a key (libsodium failed)\n");
      return 1;
    }
    rc = net_cluster_key_save(out, key, force, &e);
    sodium_memzero(key, sizeof key);
    if (rc != 0) {
      fprintf(stderr, "keygen: %s\n", e.msg);
      return 1;
    }
    fprintf(stderr, "keygen: wrote a cluster key to %s (mode 0600); copy it to every member\n", out);
    return 0;
  }
  struct net_identity id;
  if (net_identity_generate(&id) != 0) {
    fprintf(stderr, "keygen: cannot generate a key (libsodium failed)\n");
    return 1;
  }
  rc = net_identity_save(out, &id, force, &e);
  char s[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(s, id.pk);
  net_identity_wipe(&id);
  if (rc != 0) {
    fprintf(stderr, "keygen: %s\n", e.msg);
    return 1;
  }
  fprintf(stderr, "keygen: wrote an identity to %s (mode 0600); its public key:\n", out);
  printf("%s\n", s);
  return 0;
}
