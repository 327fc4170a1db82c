/* The cluster options: rumor peer, group, bootstrap and top. */
#include <sodium.h>
#include <string.h>

#include "peer/cli/cli_impl.h"

void net_flags_default(struct net_flags *f) {
  memset(f, 0, sizeof *f);
  struct gossip_config c;
  gossip_config_default(&c);
  f->listen = "127.0.0.1:0";
  f->period_ms = c.period_ms;
  f->ping_timeout_ms = c.ping_timeout_ms;
  f->suspect_ms = c.suspect_timeout_ms;
  f->join_timeout_ms = c.join_timeout_ms;
  f->handshake_timeout_ms = c.net.handshake_timeout_ms;
  f->heartbeat_ms = c.net.heartbeat_ms;
  f->dead_after_ms = c.net.dead_after_ms;
  f->linger_ms = 500;
}

/* The options `rumor top` takes: it joins nothing and listens nowhere. */
static bool monitor_takes(const char *name) {
  static const char *const names[] = {"bootstrap",          "cluster-key",  "identity",      "allow-list",
                                      "handshake-timeout-ms", "heartbeat-ms", "dead-after-ms"};
  for (size_t i = 0; i < sizeof names / sizeof names[0]; i++)
    if (strcmp(name, names[i]) == 0) return true;
  return false;
}

static void net_flags_help_for(enum flags_for who, struct arg_spec *sp) {
  if (who == FLAGS_MONITOR) {
    if (strcmp(sp->name, "bootstrap") == 0)
      sp->help = "cluster members to ask for the member table; required unless --servers";
    else if (strcmp(sp->name, "identity") == 0) sp->help = "this monitor's identity (rumor keygen); required";
    else if (strcmp(sp->name, "allow-list") == 0) sp->help = "talk only to members whose public keys FILE lists";
  } else if (who == FLAGS_LAUNCHER) {
    if (strcmp(sp->name, "listen") == 0)
      sp->help = "gossip address of stage (or process) 0; stage s, process k: port + s, + k; port 0: any free port";
    else if (strcmp(sp->name, "advertise") == 0) sp->help = "address others dial for stage 0 (stage s: port + s)";
    else if (strcmp(sp->name, "metrics") == 0) sp->help = "serve stage 0's metrics here (stage s: port + s)";
    else if (strcmp(sp->name, "bootstrap") == 0) {
      sp->metavar = "L0;L1;...";
      sp->help = "one address list per stage (or data- or tensor-parallel process), separated by ';': stage s "
                 "joins stage s of other groups through Ls";
    }
  } else if (who == FLAGS_STAGE && strcmp(sp->name, "bootstrap") == 0) {
    sp->help = "addresses of this stage's (or shard's) cluster: the same stage or process of other groups, or "
               "its bootstrap nodes";
  }
}

void net_flags_specs(struct net_flags *f, enum flags_for who, bool with_listen, struct arg_spec *out, size_t *n,
                     size_t max) {
  const struct arg_spec listen_specs[] = {
      {"listen", ARG_STR, &f->listen, "HOST:PORT", "address to listen on (port 0: any free port)"},
      {"advertise", ARG_STR, &f->advertise, "HOST:PORT", "address others dial (default: the listen address)"},
      {"metrics", ARG_STR, &f->metrics, "HOST:PORT",
       "serve Prometheus metrics (/metrics) and readiness (/healthz) over plain HTTP here"},
      {"linger-ms", ARG_INT, &f->linger_ms, "MS", "time to spread LEAVE on exit", 0, 60000},
  };
  const struct arg_spec specs[] = {
      {"bootstrap", ARG_STR, &f->bootstrap, "A,B,...", "addresses of cluster members to join through"},
      {"cluster-key", ARG_STR, &f->cluster_key, "FILE", "the cluster's key (rumor keygen --cluster); required"},
      {"identity", ARG_STR, &f->identity, "FILE", "this node's identity (rumor keygen); required"},
      {"allow-list", ARG_STR, &f->allow_list, "FILE", "admit only the public keys listed in FILE"},
      {"period-ms", ARG_INT, &f->period_ms, "MS", "membership probe period", 10, 600000},
      {"ping-timeout-ms", ARG_INT, &f->ping_timeout_ms, "MS", "probe answer deadline", 5, 600000},
      {"suspect-ms", ARG_INT, &f->suspect_ms, "MS", "suspicion time before a member is declared failed", 10,
       3600000},
      {"join-timeout-ms", ARG_INT, &f->join_timeout_ms, "MS", "give up joining after this long", 100, 86400000},
      {"handshake-timeout-ms", ARG_INT, &f->handshake_timeout_ms, "MS", "connection handshake deadline", 100,
       600000},
  };
  const struct arg_spec relay_specs[] = {
      {"no-inbound", ARG_FLAG, &f->no_inbound, NULL,
       "this host cannot accept connections (behind a NAT): listen nowhere and be reached through a relay"},
      {"relay", ARG_FLAG, &f->relay, NULL, "relay for members that cannot accept connections"},
      {"relay-rate", ARG_FLOAT, &f->relay_rate_mbit, "MBIT",
       "as a relay, forward at most this many Mbit/s from one peer (0: no cap)", 0, 1e6},
  };
  size_t nspecs = sizeof specs / sizeof specs[0];
  if (with_listen)
    for (size_t i = 0; i < sizeof listen_specs / sizeof listen_specs[0]; i++) {
      RUMOR_ASSERT(*n < max);
      out[*n] = listen_specs[i];
      net_flags_help_for(who, &out[(*n)++]);
    }
  if (with_listen && who == FLAGS_PEER) /* rumor peer and rumor bootstrap */
    for (size_t i = 0; i < sizeof relay_specs / sizeof relay_specs[0]; i++) {
      RUMOR_ASSERT(*n < max);
      out[(*n)++] = relay_specs[i];
    }
  for (size_t i = 0; i < nspecs; i++) {
    if (who == FLAGS_MONITOR && !monitor_takes(specs[i].name)) continue;
    RUMOR_ASSERT(*n < max);
    out[*n] = specs[i];
    net_flags_help_for(who, &out[(*n)++]);
  }
  net_flags_heartbeat_specs(f, out, n, max);
}

void net_flags_heartbeat_specs(struct net_flags *f, struct arg_spec *out, size_t *n, size_t max) {
  const struct arg_spec specs[] = {
      {"heartbeat-ms", ARG_INT, &f->heartbeat_ms, "MS",
       "send a heartbeat on a connection that has sent nothing for this long (0: no heartbeat, and no verdicts: "
       "failures are found by the membership probes alone)",
       0, 60000},
      {"dead-after-ms", ARG_INT, &f->dead_after_ms, "MS",
       "a connected peer silent this long is judged dead: the exchange, all-reduce round or state pull with it "
       "ends at once and the membership suspects it (above --heartbeat-ms)",
       1, 600000},
  };
  args_append(out, n, max, specs, sizeof specs / sizeof specs[0]);
}

int net_flags_check_heartbeat(const struct net_flags *f, struct rumor_err *e) {
  if (f->heartbeat_ms && f->dead_after_ms <= f->heartbeat_ms)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--dead-after-ms %lld must exceed --heartbeat-ms %lld (a peer that heartbeats is judged "
                         "dead after that much silence; --heartbeat-ms 0 turns both off)",
                         (long long)f->dead_after_ms, (long long)f->heartbeat_ms);
  return 0;
}

int net_flags_check(const struct net_flags *f, const char *servers, bool member, struct rumor_err *e) {
  if (net_flags_check_heartbeat(f, e)) return RUMOR_EFORMAT;
  if (f->no_inbound && f->relay)
    return rumor_err_set(e, RUMOR_EFORMAT, "--relay needs a member others can dial; it cannot go with --no-inbound");
  if (f->no_inbound && f->advertise)
    return rumor_err_set(e, RUMOR_EFORMAT, "--no-inbound: the address is the relay's; drop --advertise");
  if (f->no_inbound && !f->bootstrap)
    return rumor_err_set(e, RUMOR_EFORMAT, "--no-inbound needs --bootstrap: a relay is found through the cluster");
  if (!f->no_inbound && f->listen && net_addr_check_listen(f->listen, e)) return rumor_err_prefix(e, "--listen");
  if (!f->no_inbound && member && f->listen && !f->advertise && gossip_listen_advertisable(f->listen, e)) return RUMOR_EFORMAT;
  if (f->metrics && net_addr_check_listen(f->metrics, e)) return rumor_err_prefix(e, "--metrics");
  if (f->advertise && gossip_advertise_check(f->advertise, e)) return rumor_err_prefix(e, "--advertise");
  if (f->bootstrap && net_addr_list_check(f->bootstrap, e)) return rumor_err_prefix(e, "--bootstrap");
  if (servers && net_addr_list_check(servers, e)) return rumor_err_prefix(e, "--servers");
  return 0;
}

int net_flags_load_keys(const struct net_flags *f, struct net_keys *k, struct rumor_err *e) {
  memset(k, 0, sizeof *k);
  if (!f->cluster_key) return rumor_err_set(e, RUMOR_EFORMAT, "--cluster-key FILE is required (rumor keygen --cluster -o FILE)");
  if (!f->identity) return rumor_err_set(e, RUMOR_EFORMAT, "--identity FILE is required (rumor keygen -o FILE)");
  int rc = net_cluster_key_load(f->cluster_key, k->cluster_key, e);
  if (rc) return rc;
  if ((rc = net_identity_load(f->identity, &k->identity, e))) goto fail;
  if (f->allow_list) {
    if ((rc = net_allowlist_load(f->allow_list, &k->allow, e))) goto fail;
    k->have_allow = true;
  }
  return 0;
fail:
  net_keys_free(k);
  return rc;
}

void net_keys_free(struct net_keys *k) {
  net_identity_wipe(&k->identity);
  sodium_memzero(k->cluster_key, sizeof k->cluster_key);
  if (k->have_allow) net_allowlist_free(&k->allow);
  memset(k, 0, sizeof *k);
}

void net_flags_gossip_config(const struct net_flags *f, const struct net_keys *k, struct gossip_config *c) {
  c->identity = &k->identity;
  c->cluster_key = k->cluster_key;
  c->allow = k->have_allow ? &k->allow : NULL;
  c->listen = f->listen;
  c->advertise = f->advertise;
  c->no_inbound = f->no_inbound;
  c->relay = f->relay;
  c->net.relay_rate_bytes = (uint64_t)(f->relay_rate_mbit * 1e6 / 8);
  c->metrics = f->metrics;
  c->bootstrap = f->bootstrap;
  c->period_ms = (uint32_t)f->period_ms;
  c->ping_timeout_ms = (uint32_t)f->ping_timeout_ms;
  c->suspect_timeout_ms = (uint32_t)f->suspect_ms;
  c->join_timeout_ms = (uint32_t)f->join_timeout_ms;
  c->net.handshake_timeout_ms = (uint32_t)f->handshake_timeout_ms;
  c->net.heartbeat_ms = (uint32_t)f->heartbeat_ms;
  c->net.dead_after_ms = (uint32_t)f->dead_after_ms;
}
