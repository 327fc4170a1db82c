/* `rumor bootstrap`: run a bootstrap node. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "bootstrap/bootstrap.h"
#include "peer/cli/cli_impl.h"
#include "util/json_text.h"


/* Announces where we listen, as one JSON line on stdout, for scripts. */
static void announce(gossip_t *g, void *arg) {
  json_t *o = result_open();
  json_text_set(o, "listen", json_text_str(gossip_advertised(g)));
  json_text_set(o, "id", json_string(gossip_self_id(g)));
  json_text_set(o, "role", json_string("bootstrap"));
  json_text_set(o, "metrics_port", json_integer(gossip_metrics_port(g)));
  json_text_print(stdout, o);
}

int cmd_bootstrap(int argc, char **argv) {
  struct net_flags nf;
  net_flags_default(&nf);
  nf.listen = "0.0.0.0:7470";
  bool log_json = false;
  struct arg_spec specs[36];
  size_t n = 0;
  net_flags_specs(&nf, FLAGS_PEER, true, specs, &n, 33);
  args_log_json_spec(&log_json, specs, &n, 35);
  specs[n] = (struct arg_spec){0};
  int ar = args_parse(specs, argc, argv, "rumor bootstrap --listen HOST:PORT --cluster-key FILE --identity FILE [options]",
                      "Runs a bootstrap node: a long-lived member without a model that newcomers dial\n"
                      "first. Prints its address and public key as JSON on stdout; stops on SIGINT or\n"
                      "SIGTERM after telling the cluster it leaves.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(log_json);
  log_set_name("bootstrap");
  struct rumor_err e = {0};
  if (nf.no_inbound) {
    fprintf(stderr, "rumor bootstrap: --no-inbound: a bootstrap node is what newcomers dial; it must accept connections\n");
    return 2;
  }
  if (net_flags_check(&nf, NULL, true, &e)) {
    fprintf(stderr, "rumor bootstrap: %s\n", e.msg);
    return 2;
  }
  struct net_keys keys;
  if (net_flags_load_keys(&nf, &keys, &e)) {
    fprintf(stderr, "rumor bootstrap: %s\n", e.msg);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }
  struct gossip_config gc;
  gossip_config_default(&gc);
  net_flags_gossip_config(&nf, &keys, &gc);
  int rc = bootstrap_run(&gc, signals_stop_flag(), (uint32_t)nf.linger_ms, announce, NULL, &e);
  net_keys_free(&keys);
  if (rc) {
    fprintf(stderr, "rumor bootstrap: %s\n", e.msg);
    return 1;
  }
  return 0;
}
