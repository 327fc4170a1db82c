/*
 * net_flags — the command-line options that put a process into a cluster
 * (addresses, keys, membership timing), shared by `rumor peer`,
 * `rumor bootstrap` and `rumor top`.
 */
#ifndef RUMOR_PEER_NET_FLAGS_H
#define RUMOR_PEER_NET_FLAGS_H

#include "gossip/gossip.h"
#include "peer/cli/args.h"

struct net_flags {
  const char *listen, *advertise, *bootstrap, *cluster_key, *identity, *allow_list, *metrics;
  int64_t period_ms, ping_timeout_ms, suspect_ms, join_timeout_ms, handshake_timeout_ms;
};

/* Keys loaded from the files the flags name; wiped by net_keys_free. */
struct net_keys {
  struct net_identity identity;
  uint8_t cluster_key[NET_CLUSTER_KEY_BYTES];
  struct net_allowlist allow;
  bool have_allow;
};

void net_flags_default(struct net_flags *f);
/* Appends the specs to out[*n..max). `with_listen` adds --listen, --advertise
 * and --metrics (members listen; `rumor top` does not). */
void net_flags_specs(struct net_flags *f, bool with_listen, struct arg_spec *out, size_t *n, size_t max);
/* Loads the key files (required: --cluster-key and --identity). */
int net_flags_load_keys(const struct net_flags *f, struct net_keys *k, struct rumor_err *e) RUMOR_MUST_CHECK;
void net_keys_free(struct net_keys *k);
/* Fills the membership and transport parts of a gossip configuration. The
 * keys must outlive gossip_start's copy (they are copied there). */
void net_flags_gossip_config(const struct net_flags *f, const struct net_keys *k, struct gossip_config *c);

#endif /* RUMOR_PEER_NET_FLAGS_H */
