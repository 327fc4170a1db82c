/* The gossip options: how a member averages, its defences and its
 * placement. The same table, with the same defaults, for `rumor peer`,
 * `rumor group` and each stage of a group. */
#include <string.h>

#include "peer/cli/cli_impl.h"

void gossip_flags_default(struct gossip_flags *f) {
  memset(f, 0, sizeof *f);
  f->every = 1;
  f->exchange_timeout_ms = 60000;
  f->quorum_wait_ms = GOSSIP_QUORUM_WAIT_MS;
  f->sit_out_loss = 100.0 * GOSSIP_SIT_OUT_LOSS;
  f->alpha = 0.5;
  f->max_distance = 10.0;
  f->wire = "f32";
  f->sync = "gossip";
  f->wait_peers_ms = 60000;
  f->sketch_k = 1024;
  f->max_hold_ms = 2000;
  f->max_xch_rate = 100;
  f->max_conn_rate = 5;
  f->outer = "none";
  f->outer_compress = "none";
  f->local_steps = OUTER_DEFAULT_LOCAL_STEPS;
  f->outer_lr = OUTER_DEFAULT_LR;
  f->outer_momentum = OUTER_DEFAULT_MOMENTUM;
}

void gossip_flags_specs(struct gossip_flags *f, enum flags_for who, struct arg_spec *out, size_t *n, size_t max) {
  bool group = who == FLAGS_LAUNCHER || who == FLAGS_STAGE;
  const struct arg_spec specs[] = {
      {"sync", ARG_STR, &f->sync, "SCHEME",
       "how replicas stay together: gossip (averaging with random partners), allreduce (ring all-reduce of every "
       "step's gradient, bulk-synchronous) or ps (parameter servers: --servers)"},
      {"servers", ARG_STR, &f->servers, who == FLAGS_LAUNCHER ? "A,B;C,D" : "A,B,...",
       who == FLAGS_LAUNCHER ? "--sync ps: one list of server addresses per stage, separated by ';', each in range "
                               "order (stage s's servers: rumor ps --stage s/S --range I/K)"
       : who == FLAGS_STAGE  ? "--sync ps: this stage's parameter servers (rumor ps --stage s/S --range I/K), in "
                               "range order"
                             : "--sync ps: the parameter servers' addresses, in range order (rumor ps --range I/S)"},
      {"gossip-every", ARG_INT, &f->every, "N", "start an exchange every N steps (0: off)", 0, 1e12},
      {"gossip-interval", ARG_FLOAT, &f->interval, "SEC", "... or every SEC seconds (0: off)", 0, 1e6},
      {"alpha", ARG_FLOAT, &f->alpha, "X", "averaging weight: x <- x + X (x_partner - x), both as exchanged", 1e-6, 1},
      {"max-local-steps", ARG_INT, &f->max_local_steps, "N",
       "bound drift: after N steps without an applied exchange, hold training until one applies (0: never hold)", 0,
       1e12},
      {"max-hold-ms", ARG_INT, &f->max_hold_ms, "MS",
       "... holding at most this long at a time (with --outer and --sync gossip: the wait for a partner at a round's "
       "boundary)",
       1, 86400000},
      {"finish-wait-ms", ARG_INT, &f->finish_wait_ms, "MS",
       group ? "after the last step, each stage keeps averaging (without training) until the same stage of every "
               "other group has finished (one whose slices it rejected is not waited for), at most MS; then saves, "
               "evaluates and leaves (0: leave at once)"
             : "after the last step, keep averaging (without training) until no partner still trains (one whose "
               "parameters it rejected is not waited for) and the partners it meets agree with it, at most MS; then "
               "save, leave and evaluate (0: leave at once)",
       0, 86400000},
      {"wire", ARG_STR, &f->wire, "DTYPE",
       "parameters (and a group's activations and their gradients) on the wire: f32, f16, bf16 or i8 (8-bit, a "
       "scale per 128 values)"},
      {"max-distance", ARG_FLOAT, &f->max_distance, "R", "reject a partner farther than R times our norm", 1e-6, 1e12},
      {"clip", ARG_FLAG, &f->clip, NULL, "clipped averaging: move at most alpha*tau towards a partner (robust to bad peers)"},
      {"clip-tau", ARG_FLOAT, &f->clip_tau, "TAU", "... with this fixed tau (0: adaptive, from recent distances)", 0, 1e30},
      {"max-exchange-rate", ARG_FLOAT, &f->max_xch_rate, "N",
       "answer at most N exchange requests a second per peer (0: no limit)", 0, 1e9},
      {"max-conn-rate", ARG_FLOAT, &f->max_conn_rate, "N", "accept at most N connections a second per peer (0: no limit)",
       0, 1e9},
      {"exchange-timeout-ms", ARG_INT, &f->exchange_timeout_ms, "MS", "abandon an exchange after this long", 10,
       86400000},
      {"quorum-wait-ms", ARG_INT, &f->quorum_wait_ms, "MS",
       "--sync allreduce: when no majority of the members of our last round is in view (cut off from the "
       "cluster?), wait up to MS for more before going on without them, rather than train on alone and race ahead "
       "(0: go on at once)",
       0, 86400000},
      {"sit-out-loss", ARG_FLOAT, &f->sit_out_loss, "PCT",
       "--sync allreduce (DiLoCo too): when our link to the next member of the ring retransmits PCT % or more of "
       "what we send "
       "(over 2 s), leave the ring for 10 s (twice as long when it recurs within a minute of our return, at most 80 "
       "s) so that it does not go at our link's pace (0: never; processes of a group never leave)",
       0, 100},
      {"no-state-pull", ARG_FLAG, &f->no_state_pull, NULL,
       group ? "start from our own seed instead of a live group's state"
             : "start from our own seed (or --resume's checkpoint) instead of a live peer's state"},
      {"name", ARG_STR, &f->name, "NAME",
       group ? "label for log lines (default: the group name and stage)" : "label for log lines"},
      {"wait-peers", ARG_INT, &f->wait_peers, "N",
       group ? "start training once N groups (us included) are present"
             : "start training once N peers (us included) are present",
       0, 65536},
      {"wait-peers-ms", ARG_INT, &f->wait_peers_ms, "MS", "... waiting at most this long", 0, 86400000},
      {"sketch-k", ARG_INT, &f->sketch_k, "K", "count-sketch buckets for drift monitoring (a power of two)", 1, 65536},
      {"train-cpus", ARG_STR, &f->train_cpus, "LIST",
       "run training (the main thread and its compute threads) on these CPUs, e.g. 0-6"},
      {"net-cpus", ARG_STR, &f->net_cpus, "LIST", "run the network thread and its encryption workers on these CPUs, e.g. 7"},
      {"outer", ARG_STR, &f->outer, "KIND",
       "an outer optimizer every --local-steps steps: none, sgd or nesterov; with --sync allreduce it is DiLoCo "
       "(the ring averages pseudo-gradients), with --sync gossip NoLoCo (one random partner a round)"},
      {"local-steps", ARG_INT, &f->local_steps, "H", "--outer: inner steps per outer round", 1, 1e9},
      {"outer-lr", ARG_FLOAT, &f->outer_lr, "X", "--outer: the outer learning rate", 1e-6, 10},
      {"outer-momentum", ARG_FLOAT, &f->outer_momentum, "M",
       "--outer: the outer momentum (0: none); with topk, the decay of the error-feedback accumulator that stands for "
       "it (SparseLoCo)",
       0, 0.999},
      {"outer-compress", ARG_STR, &f->outer_compress, "C",
       "--outer: what a round sends: none, f16, i8 (8-bit, a scale per 128 values) or topk:F:BITS (DiLoCo: the "
       "fraction F of largest entries per chunk at BITS = 2, 4 or 8 bits, the rest kept for the next round)"},
      {"outer-overlap", ARG_FLAG, &f->outer_overlap, NULL,
       "--outer: run a round's communication beside the next round's steps and apply it one round late"},
      {"outer-overlap-steps", ARG_INT, &f->outer_overlap_steps, "N",
       "--outer-overlap with DiLoCo: apply a round N inner steps after its boundary (1 to --local-steps; 0: at the "
       "next boundary)",
       0, 1e9},
  };
  args_append(out, n, max, specs, sizeof specs / sizeof specs[0]);
}

static int parse_wire(const char *s, enum net_dtype *out) {
  if (strcmp(s, "f32") == 0) *out = NET_DTYPE_F32;
  else if (strcmp(s, "f16") == 0) *out = NET_DTYPE_F16;
  else if (strcmp(s, "bf16") == 0) *out = NET_DTYPE_BF16;
  else if (strcmp(s, "i8") == 0) *out = NET_DTYPE_I8;
  else return RUMOR_EFORMAT;
  return 0;
}

static int parse_sync(const char *s, enum sync_kind *out) {
  if (strcmp(s, "gossip") == 0) *out = SYNC_GOSSIP;
  else if (strcmp(s, "allreduce") == 0) *out = SYNC_ALLREDUCE;
  else if (strcmp(s, "ps") == 0) *out = SYNC_PS;
  else return RUMOR_EFORMAT;
  return 0;
}

static int parse_outer(const char *s, enum outer_kind *out) {
  if (strcmp(s, "none") == 0) *out = OUTER_NONE;
  else if (strcmp(s, "sgd") == 0) *out = OUTER_SGD;
  else if (strcmp(s, "nesterov") == 0) *out = OUTER_NESTEROV;
  else return RUMOR_EFORMAT;
  return 0;
}

/* --sync: the scheme, and the options it rules out. */
static int setup_sync(const struct gossip_flags *f, enum sync_kind kind, struct rumor_err *e) {
  bool ps = kind == SYNC_PS, allreduce = kind == SYNC_ALLREDUCE;
  if (ps && (!f->servers || !*f->servers))
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--sync ps needs --servers A,B,...: the parameter servers' addresses, in range order");
  if (!ps && f->servers)
    return rumor_err_set(e, RUMOR_EFORMAT, "--servers is for --sync ps (parameter servers), not --sync %s", f->sync);
  if (!allreduce && !ps) return 0;
  const char *clash = f->max_local_steps > 0 ? "--max-local-steps"
                      : f->clip             ? "--clip"
                      : f->interval > 0     ? "--gossip-interval"
                      : f->finish_wait_ms > 0 ? "--finish-wait-ms"
                                            : NULL;
  if (clash)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s is a gossip option; --sync %s %s instead", clash, f->sync,
                         ps ? "pushes every step's gradient to the parameter servers" : "sums every step's gradient");
  return 0;
}

/* --outer and its options: given without --outer, or with options of
 * gossip averaging that an outer scheme replaces, they are refused. */
static int setup_outer(const struct gossip_flags *f, const struct arg_spec *specs, struct sync_config *c,
                       struct rumor_err *e) {
  struct outer_config *o = &c->outer;
  if (parse_outer(f->outer, &o->kind))
    return rumor_err_set(e, RUMOR_EFORMAT, "--outer must be none, sgd or nesterov, not '%s'", f->outer);
  if (codec_parse(f->outer_compress, &o->compress, e)) return rumor_err_prefix(e, "--outer-compress");
  o->local_steps = f->local_steps;
  o->lr = f->outer_lr;
  o->momentum = f->outer_momentum;
  o->overlap = f->outer_overlap;
  o->overlap_steps = f->outer_overlap_steps;
  static const char *const outer_only[] = {"local-steps", "outer-lr", "outer-momentum", "outer-compress",
                                           "outer-overlap", "outer-overlap-steps"};
  for (size_t i = 0; i < sizeof outer_only / sizeof outer_only[0]; i++)
    if (o->kind == OUTER_NONE && specs && args_given(specs, outer_only[i]))
      return rumor_err_set(e, RUMOR_EFORMAT, "--%s is an option of --outer sgd|nesterov, which is not given",
                           outer_only[i]);
  if (o->kind == OUTER_NONE) return 0;
  static const char *const averaging_only[] = {"gossip-every", "gossip-interval", "max-local-steps",
                                               "finish-wait-ms", "alpha"};
  for (size_t i = 0; i < sizeof averaging_only / sizeof averaging_only[0]; i++)
    if (specs && args_given(specs, averaging_only[i]))
      return rumor_err_set(e, RUMOR_EFORMAT,
                           "--%s is an option of gossip averaging; with --outer a member communicates once every "
                           "--local-steps steps and ends with an outer round",
                           averaging_only[i]);
  return sync_config_check(c, e);
}

int gossip_flags_setup(const struct gossip_flags *f, const struct arg_spec *specs, struct gossip_setup *out,
                       struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  enum sync_kind kind;
  if (parse_sync(f->sync, &kind))
    return rumor_err_set(e, RUMOR_EFORMAT, "--sync must be gossip, allreduce or ps, not '%s'", f->sync);
  if (setup_sync(f, kind, e)) return RUMOR_EFORMAT;
  if (f->max_local_steps > 0 && f->every == 0 && f->interval == 0)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--max-local-steps %lld bounds the steps between exchanges, but gossip is off "
                         "(--gossip-every 0 and no --gossip-interval)",
                         (long long)f->max_local_steps);
  if (f->finish_wait_ms > 0 && f->every == 0 && f->interval == 0)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--finish-wait-ms %lld keeps averaging after the last step, but gossip is off "
                         "(--gossip-every 0 and no --gossip-interval)",
                         (long long)f->finish_wait_ms);
  out->finish_wait_s = (double)f->finish_wait_ms / 1e3;
  if (parse_wire(f->wire, &out->wire))
    return rumor_err_set(e, RUMOR_EFORMAT, "--wire must be f32, f16, bf16 or i8, not '%s'", f->wire);
  if (f->train_cpus && cpu_list_parse(f->train_cpus, &out->train_cpus, e)) return rumor_err_prefix(e, "--train-cpus");
  if (f->net_cpus && cpu_list_parse(f->net_cpus, &out->net_cpus, e)) return rumor_err_prefix(e, "--net-cpus");
  out->pin_train = f->train_cpus != NULL;
  out->pin_net = f->net_cpus != NULL;
  out->sync = (struct sync_config){.kind = kind,
                                   .every_steps = f->every,
                                   .every_s = f->interval,
                                   .max_distance = f->max_distance,
                                   .clip = f->clip,
                                   .clip_tau = f->clip_tau,
                                   .max_local_steps = f->max_local_steps,
                                   .max_hold_s = (double)f->max_hold_ms / 1e3,
                                   .wire = out->wire,
                                   .own_start = f->no_state_pull};
  if (kind != SYNC_GOSSIP) out->sync.every_steps = 0;
  return setup_outer(f, specs, &out->sync, e);
}

void gossip_setup_train(const struct gossip_setup *s, struct train_config *tc) {
  memset(&tc->extra, 0, sizeof tc->extra);
  const struct sync_scheme *scheme = sync_scheme_of(&s->sync);
  if (scheme->extra) scheme->extra(&s->sync, &tc->extra);
}

void gossip_flags_gossip_config(const struct gossip_flags *f, const struct gossip_setup *s, struct gossip_config *c) {
  c->alpha = (float)f->alpha;
  c->exchange_timeout_ms = (uint32_t)f->exchange_timeout_ms;
  c->quorum_wait_ms = (uint32_t)f->quorum_wait_ms;
  c->sit_out_loss = s->sync.kind == SYNC_ALLREDUCE ? (float)(f->sit_out_loss / 100) : 0; /* and DiLoCo */
  c->sketch_k = (int)f->sketch_k;
  c->max_xch_per_s = f->max_xch_rate;
  c->max_conn_per_s = f->max_conn_rate;
  c->net_cpus = s->pin_net ? &s->net_cpus : NULL;
}
