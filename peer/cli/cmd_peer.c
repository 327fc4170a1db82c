/* `rumor peer`: train one replica as a member of a gossip cluster. */
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "gossip/gossip.h"
#include "peer/cli/cli.h"
#include "peer/cli/net_flags.h"
#include "peer/sync/peer_sync.h"
#include "peer/cli/train_flags.h"


struct gossip_flags {
  int64_t every, exchange_timeout_ms, linger_ms, wait_peers, wait_peers_ms, sketch_k;
  int64_t max_local_steps, max_hold_ms; /* bounded drift (peer_sync_hold) */
  double interval, alpha, max_distance;
  const char *wire, *name;
  bool no_state_pull;
  bool clip;                       /* clipped averaging (peer/clip.h) */
  double clip_tau, max_xch_rate, max_conn_rate;
  const char *attack;              /* testing only (peer/attack.h) */
  const char *train_cpus, *net_cpus; /* CPU lists, or NULL */
};

static int parse_wire(const char *s, enum net_dtype *out) {
  if (strcmp(s, "f32") == 0) *out = NET_DTYPE_F32;
  else if (strcmp(s, "f16") == 0) *out = NET_DTYPE_F16;
  else if (strcmp(s, "bf16") == 0) *out = NET_DTYPE_BF16;
  else return RUMOR_EFORMAT;
  return 0;
}

/* `gs` and `id`: the gossip figures and our key, taken before we left. */
static void print_result(struct trainer *t, const struct gossip_stats *gs, const char *id, double secs, int64_t s0,
                         const struct peer_sync *ps) {
  double acc = -1, loss = -1;
  if (t->have_test) trainer_evaluate(t, &t->test, &acc, &loss);
  log_info("final test accuracy %.4f, test loss %.4f after %lld steps; %llu exchanges applied, %llu failed, %llu rejected; "
           "at most %lld steps between applied exchanges",
           acc, loss, (long long)t->st.step, (unsigned long long)gs->exchanges_ok,
           (unsigned long long)gs->exchanges_failed, (unsigned long long)gs->exchanges_rejected,
           (long long)ps->longest_local);
  if (ps->holds)
    log_info("held training %llu times for an exchange (%.1f s in all, %llu gave up after --max-hold-ms)",
             (unsigned long long)ps->holds, ps->hold_s, (unsigned long long)ps->hold_timeouts);
  printf("{\"test_accuracy\":%.6f,\"test_loss\":%.6f,\"steps\":%lld,\"epochs\":%lld,\"samples_per_s\":%.1f,"
         "\"exchanges\":%llu,\"exchanges_failed\":%llu,\"exchanges_rejected\":%llu,\"exchange_requests\":%llu,"
         "\"exchange_refusals\":%llu,\"exchange_idle\":%llu,\"exchanges_clipped\":%llu,\"exchange_rate_limited\":%llu,"
         "\"conn_rate_limited\":%llu,\"longest_local_steps\":%lld,\"holds\":%llu,\"hold_timeouts\":%llu,"
         "\"hold_s\":%.3f,\"id\":\"%s\"}\n",
         acc, loss, (long long)t->st.step, (long long)t->st.epoch,
         secs > 0 ? (double)(t->st.samples - s0) / secs : 0.0, (unsigned long long)gs->exchanges_ok,
         (unsigned long long)gs->exchanges_failed, (unsigned long long)gs->exchanges_rejected,
         (unsigned long long)gs->exchange_requests, (unsigned long long)gs->exchange_refusals,
         (unsigned long long)gs->exchange_idle, (unsigned long long)ps->clip.clipped,
         (unsigned long long)gs->exchange_rate_limited, (unsigned long long)gs->conn_rate_limited,
         (long long)ps->longest_local, (unsigned long long)ps->holds, (unsigned long long)ps->hold_timeouts, ps->hold_s,
         id);
  fflush(stdout);
}

int cmd_peer(int argc, char **argv) {
  /* One stage of a model-parallel group (rumor peer --group G --stage s/S). */
  if (cmd_stage_wanted(argc, argv)) return cmd_stage(argc, argv);
  struct train_flags tf;
  struct net_flags nf;
  train_flags_default(&tf);
  net_flags_default(&nf);
  struct gossip_flags gf = {.every = 1, .exchange_timeout_ms = 60000, .linger_ms = 500, .interval = 0,
                            .alpha = 0.5, .max_distance = 10.0, .wire = "f32", .wait_peers_ms = 60000,
                            .sketch_k = 1024, .max_hold_ms = 2000, .max_xch_rate = 100, .max_conn_rate = 5, .attack = "none"};
  struct arg_spec specs[80];
  size_t n = 0;
  train_flags_specs(&tf, specs, &n, 70);
  net_flags_specs(&nf, true, specs, &n, 70);
  const struct arg_spec own[] = {
      {"gossip-every", ARG_INT, &gf.every, "N", "start an exchange every N steps (0: off)", 0, 1e12},
      {"gossip-interval", ARG_FLOAT, &gf.interval, "SEC", "... or every SEC seconds (0: off)", 0, 1e6},
      {"alpha", ARG_FLOAT, &gf.alpha, "X", "averaging weight: x <- (1-X) x + X x_partner", 1e-6, 1},
      {"max-local-steps", ARG_INT, &gf.max_local_steps, "N",
       "bound drift: after N steps without an applied exchange, hold training until one applies (0: never hold)", 0,
       1e12},
      {"max-hold-ms", ARG_INT, &gf.max_hold_ms, "MS", "... holding at most this long at a time", 1, 86400000},
      {"wire", ARG_STR, &gf.wire, "DTYPE", "parameters on the wire: f32, f16 or bf16"},
      {"max-distance", ARG_FLOAT, &gf.max_distance, "R", "reject a partner farther than R times our norm", 1e-6, 1e12},
      {"exchange-timeout-ms", ARG_INT, &gf.exchange_timeout_ms, "MS", "abandon an exchange after this long", 10,
       86400000},
      {"no-state-pull", ARG_FLAG, &gf.no_state_pull, NULL, "start from our own seed instead of a live peer's state"},
      {"linger-ms", ARG_INT, &gf.linger_ms, "MS", "time to spread LEAVE on exit", 0, 60000},
      {"name", ARG_STR, &gf.name, "NAME", "label for log lines"},
      {"wait-peers", ARG_INT, &gf.wait_peers, "N", "start training once N peers (us included) are present", 0, 65536},
      {"wait-peers-ms", ARG_INT, &gf.wait_peers_ms, "MS", "... waiting at most this long", 0, 86400000},
      {"sketch-k", ARG_INT, &gf.sketch_k, "K", "count-sketch buckets for drift monitoring (a power of two)", 1, 65536},
      {"clip", ARG_FLAG, &gf.clip, NULL, "clipped averaging: move at most alpha*tau towards a partner (robust to bad peers)"},
      {"clip-tau", ARG_FLOAT, &gf.clip_tau, "TAU", "... with this fixed tau (0: adaptive, the median recent distance)", 0,
       1e30},
      {"max-exchange-rate", ARG_FLOAT, &gf.max_xch_rate, "N", "answer at most N exchange requests a second per peer (0: no limit)",
       0, 1e9},
      {"max-conn-rate", ARG_FLOAT, &gf.max_conn_rate, "N", "accept at most N connections a second per peer (0: no limit)", 0,
       1e9},
      {"train-cpus", ARG_STR, &gf.train_cpus, "LIST",
       "run training (the main thread and its compute threads) on these CPUs, e.g. 0-6"},
      {"net-cpus", ARG_STR, &gf.net_cpus, "LIST", "run the network thread and its encryption workers on these CPUs, e.g. 7"},
      {"attack", ARG_STR, &gf.attack, "KIND", "TESTING ONLY: misbehave (nan, inf, scale, signflip, replay, short, flood)"},
  };
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) specs[n++] = own[i];
  specs[n] = (struct arg_spec){0};
  int ar = args_parse(specs, argc, argv,
                      "rumor peer --bootstrap A,B --cluster-key FILE --identity FILE [options]",
                      "Trains one replica as a member of a cluster: joins through the bootstrap list\n"
                      "(none: the first member), starts from a live peer's state, trains on its shard\n"
                      "and averages its parameters with a random neighbour every few steps. Prints the\n"
                      "final test accuracy as JSON on stdout; SIGINT/SIGTERM leave the cluster cleanly.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(tf.log_json);
  if (gf.name) log_set_name(gf.name);

  struct rumor_err e = {0};
  struct train_config tc;
  enum net_dtype wire;
  if (train_flags_config(&tf, specs, &tc, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  if (gf.max_local_steps > 0 && gf.every == 0 && gf.interval == 0) {
    fprintf(stderr, "rumor peer: --max-local-steps %lld bounds the steps between exchanges, but gossip is off "
                    "(--gossip-every 0 and no --gossip-interval)\n", (long long)gf.max_local_steps);
    return 2;
  }
  if (parse_wire(gf.wire, &wire)) {
    fprintf(stderr, "rumor peer: --wire must be f32, f16 or bf16, not '%s'\n", gf.wire);
    return 2;
  }
  struct cpu_list train_cpus, net_cpus;
  if (gf.train_cpus && cpu_list_parse(gf.train_cpus, &train_cpus, &e)) {
    fprintf(stderr, "rumor peer: --train-cpus: %s\n", e.msg);
    return 2;
  }
  if (gf.net_cpus && cpu_list_parse(gf.net_cpus, &net_cpus, &e)) {
    fprintf(stderr, "rumor peer: --net-cpus: %s\n", e.msg);
    return 2;
  }
  /* Before any compute thread exists, so that they inherit it (the network
   * thread, started later, pins itself to --net-cpus). */
  if (gf.train_cpus && cpu_pin_self(&train_cpus, &e)) {
    fprintf(stderr, "rumor peer: --train-cpus %s: %s\n", gf.train_cpus, e.msg);
    return 1;
  }
  enum attack_kind attack_kind;
  if (attack_parse(gf.attack, &attack_kind, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  struct attack attack;
  attack_init(&attack, attack_kind);
  if (attack_kind != ATTACK_NONE) log_warn("TESTING ONLY: this peer attacks the cluster (--attack %s)", gf.attack);
  struct net_keys keys;
  if (net_flags_load_keys(&nf, &keys, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }

  int status = 1;
  struct trainer t;
  gossip_t *g = NULL;
  struct peer_sync ps;
  memset(&ps, 0, sizeof ps);
  float *mine = NULL, *theirs = NULL, *donor = NULL;
  if (trainer_init(&t, &tc, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    net_keys_free(&keys);
    return 1;
  }
  int64_t P = t.model.nparams, S = trainer_state_floats(&t);
  mine = tensor_host_alloc(t.be, (size_t)P * sizeof(float));
  theirs = tensor_host_alloc(t.be, (size_t)P * sizeof(float));
  donor = tensor_host_alloc(t.be, (size_t)S * sizeof(float));
  if (!mine || !theirs || !donor) {
    rumor_err_set(&e, -ENOMEM, "cannot allocate %.1f MiB of host buffers for gossip", (double)(2 * P + S) * 4 / (1 << 20));
    goto out;
  }
  char spec[MODEL_SPEC_MAX];
  model_spec_format(&t.model.spec, spec, sizeof spec);
  struct gossip_config gc;
  gossip_config_default(&gc);
  net_flags_gossip_config(&nf, &keys, &gc);
  gc.role = GOSSIP_ROLE_PEER;
  gc.net_cpus = gf.net_cpus ? &net_cpus : NULL;
  gc.model = spec;
  gc.nparams = (uint64_t)P;
  gc.state_floats = (uint64_t)S;
  gc.optimizer = optim_kind_name(t.optim.cfg.kind);
  gc.wire = wire;
  gc.alpha = (float)gf.alpha;
  gc.exchange_timeout_ms = (uint32_t)gf.exchange_timeout_ms;
  gc.seed = tc.seed;
  gc.sketch_k = (int)gf.sketch_k;
  gc.max_xch_per_s = gf.max_xch_rate;
  gc.max_conn_per_s = gf.max_conn_rate;
  gc.test_attack = attack_gossip_bits(attack_kind);
  gc.xch_mine = mine;
  gc.xch_theirs = theirs;
  gc.donor_buf = donor;
  if (gossip_start(&g, &gc, &e)) goto out;
  printf("{\"listen\":\"%s\",\"id\":\"%s\",\"role\":\"peer\",\"metrics_port\":%d}\n", gossip_advertised(g), gossip_self_id(g),
         gossip_metrics_port(g));
  fflush(stdout);

  struct gossip_train_pos pos;
  int jr = gossip_join_wait(g, gf.no_state_pull || tc.resume ? NULL : donor, &pos, signals_stop_flag(), &e);
  if (jr < 0) goto out;
  if (jr == 0) {
    trainer_load_state(&t, donor, (int64_t)pos.step, (int64_t)pos.epoch);
    log_info("starting from the cluster's state at step %llu (epoch %llu): loss %.4f on %d training samples",
             (unsigned long long)pos.step, (unsigned long long)pos.epoch + 1,
             trainer_check_loss(&t, PEER_SYNC_CHECK_SAMPLES), PEER_SYNC_CHECK_SAMPLES);
  } else {
    log_info("starting from %s", tc.resume ? "the checkpoint" : "our own initialisation");
  }
  struct peer_sync_config sc = {.every_steps = gf.every, .every_s = gf.interval, .max_distance = gf.max_distance,
                                .clip = gf.clip, .clip_tau = gf.clip_tau,
                                .max_local_steps = gf.max_local_steps, .max_hold_s = (double)gf.max_hold_ms / 1e3,
                                .attack = attack_kind != ATTACK_NONE ? &attack : NULL};
  if (peer_sync_init(&ps, g, &t, &sc, &e)) goto out;
  gossip_ready(g);
  if (gf.wait_peers > 1) {
    /* Hold training until the cluster is assembled, serving donations to
     * the peers still joining (they pull this state). */
    double deadline = clock_now_s() + (double)gf.wait_peers_ms / 1e3;
    while ((int64_t)gossip_ready_peers(g) < gf.wait_peers) {
      if (signals_stop_requested()) break; /* the training loop below will not run */
      if (clock_now_s() > deadline) {
        rumor_err_set(&e, RUMOR_ETIMEDOUT, "only %zu of %lld peers ready after %lld ms", gossip_ready_peers(g),
                      (long long)gf.wait_peers, (long long)gf.wait_peers_ms);
        goto out;
      }
      peer_sync_boundary(&ps);
      const struct timespec tick = {0, 10 * 1000000};
      nanosleep(&tick, NULL);
    }
    if (!signals_stop_requested()) log_info("%lld peers ready: starting", (long long)gf.wait_peers);
  }

  double t0 = clock_now_s();
  int64_t s0 = t.st.samples;
  bool first = true;
  while (!trainer_done(&t) && !signals_stop_requested()) {
    if (trainer_step(&t, &e)) goto out;
    if (first) {
      log_info("first step: loss %.4f at step %lld", t.last_loss, (long long)t.st.step);
      first = false;
    }
    peer_sync_boundary(&ps);
    peer_sync_hold(&ps, signals_stop_flag());
  }
  if (signals_stop_requested()) {
    log_info("signal %d: leaving the cluster at step %lld", signals_stop_requested(), (long long)t.st.step);
    if (tc.checkpoint && trainer_save(&t, tc.checkpoint, &e)) fprintf(stderr, "rumor peer: %s\n", e.msg);
  } else {
    /* Leave first, then evaluate: partners stop asking a peer that no
     * longer trains (an exchange request would wait for a step boundary
     * that never comes) while the test set is evaluated. */
    double secs = clock_now_s() - t0;
    log_info("training done after %lld steps (%.1f s)", (long long)t.st.step, secs);
    struct gossip_stats gs;
    gossip_stats_get(g, &gs);
    char id[NET_PUBKEY_STR_LEN + 1];
    snprintf(id, sizeof id, "%s", gossip_self_id(g));
    gossip_stop(g, (uint32_t)gf.linger_ms);
    g = NULL;
    print_result(&t, &gs, id, secs, s0, &ps);
  }
  status = 0;
out:
  if (status) fprintf(stderr, "rumor peer: %s\n", e.msg);
  if (g) gossip_stop(g, (uint32_t)gf.linger_ms);
  peer_sync_free(&ps);
  if (t.be) {
    tensor_host_free(t.be, mine);
    tensor_host_free(t.be, theirs);
    tensor_host_free(t.be, donor);
  }
  trainer_free(&t);
  net_keys_free(&keys);
  attack_free(&attack);
  return status;
}
