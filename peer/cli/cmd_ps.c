/* `rumor ps` (a parameter server) and the worker side of `rumor peer --sync
 * ps` (peer/ps/ps.h). */
#include <stdio.h>
#include <string.h>

#include "peer/cli/cli_impl.h"
#include "peer/ps/ps.h"
#include "util/json_text.h"


/* ============================================================================
 * The server
 * ========================================================================== */

struct ps_flags {
  struct train_flags tf; /* the optimizer, the model, the seed and the schedule, as the workers take them */
  struct net_flags nf;   /* the keys' files and the heartbeat (--heartbeat-ms, --dead-after-ms) */
  const char *listen, *range, *staleness, *name, *stage;
  int64_t workers, handshake_timeout_ms, worker_timeout_ms;
};

static void announce(const char *addr, const char *id, void *arg) {
  (void)arg;
  json_t *line = result_open();
  json_text_set(line, "listen", json_text_str(addr));
  json_text_set(line, "id", json_string(id));
  json_text_set(line, "role", json_string("ps"));
  json_text_print(stdout, line);
}

static int parse_ps(struct ps_flags *f, struct arg_spec *specs, int argc, char **argv) {
  train_flags_default(&f->tf);
  net_flags_default(&f->nf);
  f->tf.checkpoint_every = 10;
  f->listen = "0.0.0.0:7480";
  f->range = "0/1";
  f->staleness = "0";
  f->handshake_timeout_ms = 10000;
  f->worker_timeout_ms = 10000;
  struct train_flags *t = &f->tf;
  const struct arg_spec list[] = {
      {"listen", ARG_STR, &f->listen, "HOST:PORT", "address to listen on (port 0: any free port)"},
      {"cluster-key", ARG_STR, &f->nf.cluster_key, "FILE", "the cluster's key (rumor keygen --cluster); required"},
      {"identity", ARG_STR, &f->nf.identity, "FILE", "this server's identity (rumor keygen); required"},
      {"allow-list", ARG_STR, &f->nf.allow_list, "FILE", "admit only the public keys listed in FILE"},
      {"handshake-timeout-ms", ARG_INT, &f->handshake_timeout_ms, "MS", "connection handshake deadline", 100, 600000},
      {"range", ARG_STR, &f->range, "I/S", "hold the I-th of S contiguous ranges of the parameters"},
      {"stage", ARG_STR, &f->stage, "s/G",
       "serve stage s of the G-stage peer groups of `rumor group --sync ps`: --range then cuts that stage's slice "
       "of the model (the groups' balanced split), and the workers are stage s of every group"},
      {"staleness", ARG_STR, &f->staleness, "S",
       "0: BSP (every round waits for every live worker and applies their mean); S > 0: SSP (the fastest worker "
       "runs at most S steps ahead of the slowest); none: ASP"},
      {"workers", ARG_INT, &f->workers, "N", "the workers of the run; required (BSP waits for N; SSP/ASP scale by 1/N)",
       1, PS_MAX_WORKERS},
      {"worker-timeout-ms", ARG_INT, &f->worker_timeout_ms, "MS",
       "drop a worker from the bound when it is silent this long", PS_MIN_TIMEOUT_MS, 86400000},
      {"model", ARG_STR, &t->model, "SPEC", "the workers' model (mlp:784-512-256-10, gpt:..., gpt2)"},
      {"seed", ARG_INT, &t->seed, "N", "seed of the initial parameters (the workers')", 0, 9007199254740991.0},
      {"optimizer", ARG_STR, &t->optimizer, "NAME", "sgd or adamw"},
      {"lr", ARG_FLOAT, &t->lr, "X", "peak learning rate", 0, 1e6},
      {"momentum", ARG_FLOAT, &t->momentum, "X", "SGD momentum", 0, 1},
      {"nesterov", ARG_FLAG, &t->nesterov, NULL, "Nesterov momentum"},
      {"weight-decay", ARG_FLOAT, &t->weight_decay, "X", "weight decay", 0, 1e6},
      {"schedule", ARG_STR, &t->schedule, "NAME", "learning-rate schedule: cosine or constant"},
      {"warmup", ARG_INT, &t->warmup, "N", "linear warm-up steps", 0, 1e15},
      {"max-steps", ARG_INT, &t->max_steps, "N",
       "the schedule's length in steps, as the workers' --max-steps (0, or --epochs given: the workers say)", 0, 1e15},
      {"epochs", ARG_INT, &t->epochs, "N",
       "the workers' --epochs: the schedule's length is then taken from the workers (they know their shards)", 1,
       1000000},
      {"checkpoint", ARG_STR, &t->checkpoint, "PATH",
       "this server's state (safetensors): resumed from when it exists, saved every --checkpoint-every updates and "
       "at exit; required"},
      {"checkpoint-every", ARG_INT, &t->checkpoint_every, "N", "updates between saves (BSP: rounds)", 1, 1e15},
      {"name", ARG_STR, &f->name, "NAME", "label for log lines"},
  };
  size_t n = 0;
  for (; n < sizeof list / sizeof list[0]; n++) specs[n] = list[n];
  net_flags_heartbeat_specs(&f->nf, specs, &n, 62);
  args_log_json_spec(&t->log_json, specs, &n, 63);
  specs[n] = (struct arg_spec){0};
  return args_parse(specs, argc, argv,
                    "rumor ps --listen HOST:PORT --cluster-key FILE --identity FILE --workers N --checkpoint PATH "
                    "[options]",
                    "Runs one parameter server: holds a range of the parameters and its optimizer state,\n"
                    "applies the gradients that workers (`rumor peer --sync ps --servers A,B,...`) push and\n"
                    "answers their pulls within the staleness bound. Prints its address and public key as\n"
                    "JSON on stdout; stops on SIGINT/SIGTERM or once every worker is done, saving its\n"
                    "checkpoint, and resumes from it when restarted.");
}

/* The server's configuration from parsed flags (the caller sets the keys). */
static int ps_config(const struct ps_flags *f, const struct arg_spec *specs, struct ps_server_config *c,
                     struct rumor_err *e) {
  memset(c, 0, sizeof *c);
  const struct train_flags *t = &f->tf;
  int rc;
  if ((rc = ps_range_parse(f->range, &c->range, &c->ranges, e)) ||
      (rc = ps_staleness_parse(f->staleness, &c->staleness, e)))
    return rc;
  c->stages = 1;
  if (f->stage && (rc = group_stage_parse(f->stage, &c->stage, &c->stages, e))) return rc;
  if (net_addr_check_listen(f->listen, e)) return rumor_err_prefix(e, "--listen");
  if ((rc = net_flags_check_heartbeat(&f->nf, e))) return rc;
  if (!args_given(specs, "workers")) return rumor_err_set(e, RUMOR_EFORMAT, "--workers N is required");
  if (!t->checkpoint)
    return rumor_err_set(e, RUMOR_EFORMAT, "--checkpoint PATH is required (a server must survive restarts)");
  optim_config_default(&c->optim);
  if (optim_kind_parse(t->optimizer, &c->optim.kind))
    return rumor_err_set(e, RUMOR_EFORMAT, "--optimizer must be sgd or adamw, not '%s'", t->optimizer);
  if (optim_schedule_parse(t->schedule, &c->optim.schedule))
    return rumor_err_set(e, RUMOR_EFORMAT, "--schedule must be cosine or constant, not '%s'", t->schedule);
  struct model_spec spec;
  if (model_spec_parse(t->model, &spec, e)) return rumor_err_prefix(e, "--model");
  c->optim.lr = t->lr;
  c->optim.momentum = t->momentum;
  c->optim.nesterov = t->nesterov;
  c->optim.weight_decay = t->weight_decay;
  c->optim.warmup_steps = t->warmup;
  c->listen = f->listen;
  c->model = t->model;
  c->seed = (uint64_t)t->seed;
  c->schedule_steps = args_given(specs, "epochs") ? 0 : t->max_steps; /* as train.c: --epochs wins */
  c->workers = (int)f->workers;
  c->checkpoint = t->checkpoint;
  c->checkpoint_every = t->checkpoint_every;
  c->worker_timeout_ms = (uint32_t)f->worker_timeout_ms;
  c->handshake_timeout_ms = (uint32_t)f->handshake_timeout_ms;
  c->heartbeat_ms = (uint32_t)f->nf.heartbeat_ms;
  c->dead_after_ms = (uint32_t)f->nf.dead_after_ms;
  c->stop = signals_stop_flag();
  c->on_listen = announce;
  return 0;
}

static void print_server_result(const struct ps_server_stats *st) {
  json_t *o = result_open();
  const struct {
    const char *key;
    int64_t v;
  } figs[] = {{"version", st->version},        {"grads", (int64_t)st->grads},       {"stale", (int64_t)st->stale},
              {"nonfinite", (int64_t)st->nonfinite}, {"pulls", (int64_t)st->pulls}, {"dropped", (int64_t)st->dropped},
              {"max_clock_gap", st->max_gap},  {"rounds_partial", st->rounds_partial},
              {"workers_seen", st->workers_seen}};
  for (size_t i = 0; i < sizeof figs / sizeof figs[0]; i++) json_text_set(o, figs[i].key, json_integer(figs[i].v));
  json_text_set(o, "resumed", json_boolean(st->resumed));
  result_print(o);
}

int cmd_ps(int argc, char **argv) {
  static struct ps_flags f;
  memset(&f, 0, sizeof f);
  struct arg_spec specs[64];
  int ar = parse_ps(&f, specs, argc, argv);
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(f.tf.log_json);
  log_set_name(f.name ? f.name : "ps");
  struct rumor_err e = {0};
  struct ps_server_config cfg;
  struct net_keys keys;
  int rc = ps_config(&f, specs, &cfg, &e);
  if (rc == 0 && (rc = net_flags_load_keys(&f.nf, &keys, &e)) == 0) {
    cfg.identity = &keys.identity;
    cfg.cluster_key = keys.cluster_key;
    cfg.allow = keys.have_allow ? &keys.allow : NULL;
    struct ps_server_stats st;
    rc = ps_server_run(&cfg, &st, &e);
    net_keys_free(&keys);
    if (rc == 0) print_server_result(&st);
  }
  if (rc == 0) return 0;
  fprintf(stderr, "rumor ps: %s\n", e.msg);
  return rc == RUMOR_EFORMAT ? 2 : 1;
}

/* ============================================================================
 * The worker (rumor peer --sync ps)
 * ========================================================================== */

int ps_worker_check(const struct net_flags *nf, const struct gossip_flags *gf, struct rumor_err *e) {
  const char *gossip_only = nf->bootstrap  ? "--bootstrap"
                            : nf->metrics  ? "--metrics"
                            : gf->wait_peers > 1 ? "--wait-peers"
                                                 : NULL;
  if (gossip_only)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "%s is for gossip members; a --sync ps worker joins no gossip cluster and talks to --servers "
                         "only",
                         gossip_only);
  return 0;
}

static void print_worker_result(struct trainer *t, const struct sync *sy, const char *id, double secs, int64_t s0) {
  if (!result_final_evaluation(t)) return;
  struct ps_client_stats st;
  ps_client_stats_get(sy->scheme_state, &st);
  char final[96];
  result_describe_final(t, final, sizeof final);
  log_info("final %s after %lld steps; %llu pushes, %llu pulls, %.1f s waiting, largest clock gap %lld", final,
           (long long)t->st.step, (unsigned long long)st.pushes, (unsigned long long)st.pulls, st.wait_s,
           (long long)st.max_gap);
  json_t *o = result_open();
  result_training(o, t, secs, s0);
  struct gossip_stats none = {0}; /* no gossip runtime */
  sync_result(sy, &none, o);
  json_text_set(o, "id", json_string(id));
  result_print(o);
}

void ps_worker_net(const struct net_flags *nf, const struct net_keys *keys, const struct gossip_flags *gf,
                   struct sync_config *c) {
  c->net = (struct sync_net){.identity = &keys->identity,
                             .cluster_key = keys->cluster_key,
                             .allow = keys->have_allow ? &keys->allow : NULL,
                             .servers = gf->servers,
                             .handshake_timeout_ms = (uint32_t)nf->handshake_timeout_ms,
                             .heartbeat_ms = (uint32_t)nf->heartbeat_ms,
                             .dead_after_ms = (uint32_t)nf->dead_after_ms};
}

/* A whole replica's worker: the ps scheme with no gossip runtime. */
int ps_worker_run(struct trainer *t, const struct net_flags *nf, const struct net_keys *keys,
                  const struct gossip_flags *gf, const struct gossip_setup *setup, struct rumor_err *e) {
  char id[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(id, keys->identity.pk);
  struct sync_config cfg = setup->sync;
  ps_worker_net(nf, keys, gf, &cfg);
  cfg.stop = signals_stop_flag();
  struct sync sy;
  int rc = sync_init(&sy, NULL, t, &cfg, e);
  if (rc) return rc;
  json_t *line = result_open();
  json_text_set(line, "id", json_string(id));
  json_text_set(line, "role", json_string("worker"));
  json_text_set(line, "sync", json_string("ps"));
  json_text_set(line, "servers", json_text_str(gf->servers));
  json_text_print(stdout, line);
  int64_t s0 = t->st.samples, steps;
  double secs = 0;
  if ((rc = sync_join(&sy, e)) == 0) rc = sync_train(&sy, t, NULL, &secs, &steps, e);
  bool stopped = signals_stop_requested() != 0;
  struct sync_finish_args fin = {0};
  /* DONE to the servers; a stopped worker is dropped instead, and may come back. */
  if (rc == 0 && !stopped) rc = sync_finish(&sy, &fin, e);
  if (rc == 0 && !stopped) {
    log_info("training done after %lld steps (%.1f s)", (long long)t->st.step, secs);
    print_worker_result(t, &sy, id, secs, s0);
  }
  sync_free(&sy);
  if (rc) return rc;
  if (stopped) {
    log_info("signal %d: stopping at step %lld", signals_stop_requested(), (long long)t->st.step);
    if (t->cfg.checkpoint && trainer_save(t, t->cfg.checkpoint, e)) fprintf(stderr, "rumor peer: %s\n", e->msg);
  }
  return 0;
}
