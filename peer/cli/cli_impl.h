/*
 * cli_impl.h — the command line's insides (private to peer/cli/): the
 * option parser, one option table per concern (training, cluster, gossip,
 * pipeline), reused by every subcommand that takes those options, the
 * pieces of a gossiping member that `rumor peer` and a pipeline stage
 * share, the subcommands and the charts of `rumor top`.
 */
#ifndef RUMOR_PEER_CLI_IMPL_H
#define RUMOR_PEER_CLI_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "gossip/gossip.h"
#include "peer/cli/cli.h"
#include "peer/ps/ps.h"
#include "peer/sync/sync.h"
#include "peer/train/train.h"

struct json_t; /* jansson's value: result lines are built with util/json_text.h */
#include "util/tfevents.h"
#include "util/util.h"

/* ============================================================================
 * Parsing
 * ========================================================================== */

/*
 * Declarative long-option parsing for the subcommands.
 *
 * A subcommand lists its options in an array of struct arg_spec ending with
 * a zero entry. args_parse accepts "--name value" and "--name=value", checks
 * types and ranges, and prints either the generated --help or one clear
 * error naming the option and the bad value.
 */

enum arg_type {
  ARG_FLAG,  /* bool *: set to true when present */
  ARG_STR,   /* const char **: points into argv */
  ARG_INT,   /* int64_t *, checked against [min, max] */
  ARG_FLOAT, /* double *, checked against [min, max] */
};

struct arg_spec {
  const char *name; /* without the leading "--" */
  enum arg_type type;
  void *dest;
  const char *metavar; /* shown in --help, e.g. "N" or "FILE" */
  const char *help;    /* one line; the default is appended when known */
  double min, max;     /* for ARG_INT / ARG_FLOAT; both 0 means unbounded */
};

enum { ARGS_OK = 0, ARGS_HELP = 1, ARGS_ERROR = 2 };

/* Appends specs[0..count) to out[*n..max) (not terminated). */
void args_append(struct arg_spec *out, size_t *n, size_t max, const struct arg_spec *specs, size_t count);

/* Appends --log-json (every subcommand that logs at length takes it). */
void args_log_json_spec(bool *log_json, struct arg_spec *out, size_t *n, size_t max);

/* Parses argv[1..argc) (argv[0] is the subcommand name). `synopsis` is the
 * first line of --help ("rumor train [options]") and `about` a paragraph
 * under it. Returns ARGS_OK, ARGS_HELP (help printed on stdout) or ARGS_ERROR
 * (message printed on stderr). Defaults are whatever `dest` holds before. */
int args_parse(const struct arg_spec *specs, int argc, char **argv, const char *synopsis,
               const char *about);

/* True when the option was given on the command line in the last args_parse
 * call with these specs (for options whose presence matters). */
bool args_given(const struct arg_spec *specs, const char *name);

/* ============================================================================
 * Option tables, one per concern
 *
 * Each concern has a struct holding its values (defaults set by _default),
 * a _specs function that appends its options to a subcommand's table, and
 * a function that turns the parsed values into configuration. Every option
 * is declared and parsed in exactly one place.
 * ========================================================================== */

/* Who is asking for a table: some help texts and some options differ. */
enum flags_for {
  FLAGS_TRAIN,    /* rumor train */
  FLAGS_PEER,     /* rumor peer */
  FLAGS_LAUNCHER, /* rumor group: starts the stages */
  FLAGS_STAGE,    /* rumor peer --group G --stage s/S: one stage */
  FLAGS_MONITOR,  /* rumor top */
};

/* ---- training: rumor train, peer and group ---- */

struct train_flags {
  const char *model, *data, *device, *shard, *optimizer, *schedule, *checkpoint, *resume, *init_from;
  int64_t threads, seed, data_seed, epochs, batch, max_steps, checkpoint_every, warmup, eval_every, eval_batches;
  double lr, momentum, weight_decay, log_every, val_fraction, grad_clip, slowdown;
  int64_t moe_every;                              /* 0: the spec's */
  double capacity_factor, moe_aux_loss, moe_z_loss; /* capacity 0: the spec's */
  bool nesterov, no_eval, log_json, tf32;
  const char *tensorboard; /* --tensorboard DIR, or NULL (tensorboard.c) */
};

/* Fills `f` with the defaults shown in --help. */
void train_flags_default(struct train_flags *f);
/* Appends the training options' specs to out[*n..max) (not terminated).
 * Groups have no --resume; the launcher's --device is --devices. */
void train_flags_specs(struct train_flags *f, enum flags_for who, struct arg_spec *out, size_t *n, size_t max);
/* Turns parsed flags into a configuration (`specs` is the array that was
 * parsed, to tell given options from defaults). Returns 0 or RUMOR_EFORMAT
 * with a message naming the option. */
int train_flags_config(const struct train_flags *f, const struct arg_spec *specs, struct train_config *cfg,
                       struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- the cluster: addresses, keys, membership timing (peer, group, bootstrap, top) ---- */

struct net_flags {
  const char *listen, *advertise, *bootstrap, *cluster_key, *identity, *allow_list, *metrics;
  int64_t period_ms, ping_timeout_ms, suspect_ms, join_timeout_ms, handshake_timeout_ms;
  int64_t heartbeat_ms, dead_after_ms; /* the transport's heartbeat (net_config) */
  int64_t linger_ms; /* members: time to spread LEAVE on exit */
  bool no_inbound, relay; /* rumor peer and bootstrap: reached through a relay / serve as one */
  double relay_rate_mbit; /* a relay's cap per peer, Mbit/s (0: none) */
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
 * and --metrics (members listen; `rumor top` does not). The launcher's
 * address options are per stage (port + s) and its --bootstrap one list per
 * stage. */
void net_flags_specs(struct net_flags *f, enum flags_for who, bool with_listen, struct arg_spec *out, size_t *n,
                     size_t max);
/* Checks the flags before anything starts: --listen and --metrics
 * parse (port 0: any), --advertise can be dialed by others
 * (gossip_advertise_check), every entry of --bootstrap and of `servers`
 * (--servers, or NULL) is host:port with a port in [1, 65535], and
 * --dead-after-ms exceeds --heartbeat-ms (net_flags_check_heartbeat).
 * `member`: the command joins a gossip cluster, so without --advertise the
 * --listen host must be one others can dial (gossip_listen_advertisable).
 * For the commands that take one list each; the launcher checks its
 * per-stage forms itself. Returns 0, or RUMOR_EFORMAT naming the flag and
 * the entry. */
int net_flags_check(const struct net_flags *f, const char *servers, bool member,
                    struct rumor_err *e) RUMOR_MUST_CHECK;
/* --heartbeat-ms and --dead-after-ms, for a command with an option table of
 * its own (rumor ps): appends their specs to out[*n..max), and checks them
 * (Returns 0, or RUMOR_EFORMAT naming both). */
void net_flags_heartbeat_specs(struct net_flags *f, struct arg_spec *out, size_t *n, size_t max);
int net_flags_check_heartbeat(const struct net_flags *f, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Loads the key files (required: --cluster-key and --identity). */
int net_flags_load_keys(const struct net_flags *f, struct net_keys *k, struct rumor_err *e) RUMOR_MUST_CHECK;
void net_keys_free(struct net_keys *k);
/* Fills the membership and transport parts of a gossip configuration. The
 * keys must outlive gossip_start's copy (they are copied there). */
void net_flags_gossip_config(const struct net_flags *f, const struct net_keys *k, struct gossip_config *c);

/* ---- gossip: how a member averages, its defences, its placement (peer and group) ---- */

struct gossip_flags {
  double sit_out_loss;
  int64_t every, exchange_timeout_ms, quorum_wait_ms, wait_peers, wait_peers_ms, sketch_k;
  int64_t max_local_steps, max_hold_ms; /* bounded drift (average.c's hold; NoLoCo's wait) */
  int64_t finish_wait_ms;               /* exchange on after the last step (sync_finish) */
  double interval, alpha, max_distance;
  const char *wire, *name;
  const char *sync;                  /* --sync: "gossip", "allreduce" or "ps" */
  const char *servers;               /* --servers A,B,...: the parameter servers of --sync ps */
  bool no_state_pull;
  bool clip;                         /* clipped averaging (sync.h) */
  double clip_tau, max_xch_rate, max_conn_rate;
  const char *train_cpus, *net_cpus; /* CPU lists, or NULL */
  /* The outer optimizer (sync.h, "Outer optimizers"). */
  const char *outer, *outer_compress;
  int64_t local_steps, outer_overlap_steps;
  double outer_lr, outer_momentum;
  bool outer_overlap;
};

/* What the gossip flags decide beyond their ranges, checked. */
struct gossip_setup {
  /* --sync and --outer, parsed once: sync.kind SYNC_PS is a worker of
   * parameter servers, not a gossip member (cmd_ps.c); the others choose a
   * scheme (sync_scheme_of). */
  struct sync_config sync;
  enum net_dtype wire;
  double finish_wait_s; /* sync_finish's bound (0: leave at the last step) */
  struct cpu_list train_cpus, net_cpus;
  bool pin_train, pin_net;
};

void gossip_flags_default(struct gossip_flags *f);
void gossip_flags_specs(struct gossip_flags *f, enum flags_for who, struct arg_spec *out, size_t *n, size_t max);
/* Checks the values (wire, CPU lists, a drift bound with gossip off, the
 * outer optimizer's options; `specs`, what was parsed, tells which were
 * given). Returns 0 or RUMOR_EFORMAT with a message naming the option. */
int gossip_flags_setup(const struct gossip_flags *f, const struct arg_spec *specs, struct gossip_setup *out,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
/* What the chosen scheme adds to the training configuration: the state it
 * keeps with the model (train_config.extra; nothing for --sync ps). */
void gossip_setup_train(const struct gossip_setup *s, struct train_config *tc);
/* Fills the exchange, monitoring and rate-limit parts of a gossip
 * configuration (the caller sets the model and the buffers). */
void gossip_flags_gossip_config(const struct gossip_flags *f, const struct gossip_setup *s, struct gossip_config *c);

/* ---- model-parallel groups: the pipeline's own options (group) ---- */

struct pipe_flags {
  const char *group, *schedule;
  int64_t micro, link_wait_ms, link_timeout_ms;
  const char *stage, *link_listen, *link_prev; /* one stage process */
  int64_t stages;                              /* the launcher */
  const char *devices;
  /* Data-parallel members inside the group (peer/train/train.h, struct
   * train_dp): the launcher's count, each member's "r/D", where it listens
   * for the members above it and the addresses of those below. */
  int64_t data_parallel, tensor_parallel, zero;
  int64_t expert_parallel; /* members that split the experts: the launcher's P (D x P members), each process's too */
  const char *dp, *tp, *comm_listen, *comm_peers;
};

/* Everything `rumor group` and one stage take. */
struct group_flags {
  struct train_flags train;
  struct net_flags net;
  struct gossip_flags gossip;
  struct pipe_flags pipe;
};

#define GROUP_FLAGS_MAX_SPECS 120

void group_flags_default(struct group_flags *f);
/* Defaults that depend on other options, after args_parse (`specs`):
 * --expert-parallel P > 1 without --zero takes ZeRO 1, so each process
 * holds whole only the experts it runs. The launcher and every process
 * apply it alike (they parse the same options). */
void group_flags_finish(struct group_flags *f, const struct arg_spec *specs);
/* Fills specs (terminated, at most GROUP_FLAGS_MAX_SPECS entries) with the
 * options of the launcher or of one stage process (FLAGS_LAUNCHER or
 * FLAGS_STAGE). */
void group_flags_specs(struct group_flags *f, enum flags_for who, struct arg_spec *specs);
/* Parses "s/S" (0 <= s < S <= PIPE_MAX_STAGES). */
int group_stage_parse(const char *s, int *stage, int *stages, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Parses --dp "r/D" or --tp "t/T" (`flag`: "dp" or "tp"; 0 <= r < N <=
 * COMM_MAX_MEMBERS). */
int group_dp_parse(const char *flag, const char *s, int *rank, int *size, struct rumor_err *e) RUMOR_MUST_CHECK;
/* What a group of D data-parallel members of T tensor-parallel ranks
 * (D x T > 1) may combine with averaging between groups (`averages`:
 * --bootstrap or --listen given): gossip only (--sync gossip, with or
 * without --outer), ZeRO 1 to 3 with D > 1, not ZeRO 3 with T > 1. The
 * launcher and each process check alike. Returns 0 or RUMOR_EFORMAT. */
int group_shard_check(const struct group_flags *f, int D, int T, bool averages, struct rumor_err *e) RUMOR_MUST_CHECK;
/* What --expert-parallel P (f->pipe.expert_parallel) needs, the same for
 * the launcher and each process: data-parallel members in runs of P (D, all
 * of them, a multiple of P), no tensor-parallel ranks, a mixture-of-experts
 * model with at least P experts (model_ep_check), a batch of at least D
 * rows, and with S > 1 stages slices of it that fill the micro-batches
 * (every member runs as many). 0 at once for P = 1. Returns 0 or RUMOR_EFORMAT naming the option. */
int group_ep_check(const struct group_flags *f, const struct model_spec *spec, int S, int D, int T, int64_t batch,
                   struct rumor_err *e) RUMOR_MUST_CHECK;
/* What a pipelined group of S > 1 stages with D data-parallel members of T
 * tensor-parallel ranks in each may have: ZeRO 0 or 1 (0 without
 * data-parallel members); averaging with other groups by gossip, NoLoCo or
 * DiLoCo, but not --servers, --sync ps, --sync allreduce without --outer
 * nor --outer-overlap (not built yet). 0 at once for S = 1 or D x T = 1.
 * The launcher and each process check alike. Returns 0 or RUMOR_EFORMAT
 * naming the option. */
int group_stage_dp_check(const struct group_flags *f, int S, int D, int T, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The training configuration of stage `stage` of `stages` from parsed flags
 * (`specs` is what was parsed), its stage part in *st (cfg->stage points to
 * it; the link is set later), and its plan. Returns 0 or RUMOR_EFORMAT with
 * a message naming the option. */
int group_flags_config(const struct group_flags *f, const struct arg_spec *specs, int stage, int stages,
                       struct train_config *cfg, struct train_stage *st, struct stage_plan *plan,
                       struct rumor_err *e) RUMOR_MUST_CHECK;

/* ============================================================================
 * A gossiping member: what `rumor peer` and a pipeline stage share
 * ========================================================================== */

struct member {
  struct gossip_setup setup;
  gossip_t *g;
  float *mine, *theirs, *donor; /* the gossip runtime's host buffers (tensor_host_alloc) */
  tensor_backend_t be;          /* where they came from */
  struct sync sync;
  bool have_sync;
  /* The scheme's changes to the parameters when the last step ended (and
   * saved its checkpoint): one after it leaves that checkpoint stale
   * (member_finish). */
  uint64_t changes_at_end;
};

/* Starts the gossip runtime for trainer `t` under the model label `label`
 * (what partners must match), with `seed` for neighbour choice. Prints the
 * member's announce line on stdout, one JSON object: "listen", "id", "role"
 * (`role`), "metrics_port", then the members of the object `extra` in its
 * order (NULL: none; borrowed; its keys must differ from those four). */
int member_start(struct member *mb, struct trainer *t, const struct net_flags *nf, const struct net_keys *keys,
                 const struct gossip_flags *gf, const char *label, uint64_t seed, const char *role,
                 const struct json_t *extra, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Joins: takes a live member's state into the trainer (unless --no-state-pull
 * or `own_state`), by the one pull policy (sync_pull_take: a refused donor
 * is struck and another asked). Returns 0 with *pos set when it did (the
 * caller sets the trainer's position), 1 when it starts from its own
 * state, or a negative code. */
int member_join(struct member *mb, struct trainer *t, const struct gossip_flags *gf, bool own_state,
                struct gossip_train_pos *pos, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Starts the sync path and says the member is ready to exchange. */
int member_ready(struct member *mb, struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* With --wait-peers N: holds training (serving donations) until N members
 * (us included) are ready. `failed` (may be NULL) is polled too: it returns
 * true with a message when waiting must end (a pipeline neighbour failed). */
int member_wait_peers(struct member *mb, const struct gossip_flags *gf, const char *what,
                      bool (*failed)(void *arg, struct rumor_err *e), void *arg, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The training loop of `rumor peer`, a group's stage and a parameter-server
 * worker (cmd_ps.c, with no member): steps until the trainer is done or a
 * stop signal, each followed by the scheme's boundary (sync_boundary).
 * *changes_at_end (may be NULL) gets the scheme's changes when the last
 * step ended (member_finish). *secs and *steps: this run's. Returns 0
 * (done, or stopped: signals_stop_requested says which) or the error that
 * ends the member. */
int sync_train(struct sync *s, struct trainer *t, uint64_t *changes_at_end, double *secs, int64_t *steps,
               struct rumor_err *e) RUMOR_MUST_CHECK;
/* sync_train on the member's scheme. */
int member_train(struct member *mb, struct trainer *t, double *secs, int64_t *steps,
                 struct rumor_err *e) RUMOR_MUST_CHECK;
/* After the last step: the scheme's finish (sync_finish: gossip averaging
 * waits --finish-wait-ms for partners that still train; `failed`, which
 * may be NULL, ends the wait as in member_wait_peers). Then saves the
 * checkpoint again when the scheme changed the parameters after the last
 * step saved them (an exchange at its boundary, its hold or while
 * waiting; an outer round). `secs` and `steps`: this process's training. */
int member_finish(struct member *mb, struct trainer *t, double secs, int64_t steps,
                  bool (*failed)(void *arg, struct rumor_err *e), void *arg, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Leaves the cluster (telling it for up to `linger_ms`) and stops the
 * gossip runtime; the sync path's figures stay readable. */
void member_leave(struct member *mb, int64_t linger_ms);
/* member_leave unless done, then frees everything but the trainer. */
void member_free(struct member *mb, int64_t linger_ms);

/* ============================================================================
 * Result lines (result.c): one JSON object on stdout, the same names
 * everywhere, in the order they are added. The caller opens the object
 * (result_open), adds pieces (the functions below, json_text_set), and
 * result_print prints and releases it.
 * ========================================================================== */

/* A new, empty result object. */
struct json_t *result_open(void);
/* steps, epochs, samples_per_s and, where the loss is, test_accuracy,
 * test_loss and train_losses (the training loss at each epoch's end). */
void result_training(struct json_t *o, const struct trainer *t, double secs, int64_t samples_at_start);
/* Prints `o` as one line on stdout, flushes, and releases it. */
void result_print(struct json_t *o);
/* The final evaluation of a peer or a worker that left its cluster. False
 * when a stop signal cut it short (logged): then no result line, as on any
 * stop, since an earlier evaluation's figures would pass for the final ones.
 * Another failure is logged and the figures stay those of the last one. */
bool result_final_evaluation(struct trainer *t);
/* "validation loss L, token accuracy A" for a language model, "test accuracy
 * A, test loss L" otherwise: the words of the final log line. */
void result_describe_final(const struct trainer *t, char *buf, size_t len);

/* ============================================================================
 * Subcommands: each takes the arguments after its own name (argv[0] is the
 * subcommand name), returns the exit status and prints its own --help.
 * ========================================================================== */

/* The exit status of `rumor train`, `eval` and `sample` stopped by SIGINT,
 * SIGTERM or SIGHUP before they finished (128 + SIGINT, as a shell reports
 * a Ctrl-C), with no result line. (`rumor peer` and `rumor group` leave
 * their cluster on a stop and exit 0 instead.) */
#define CLI_EXIT_INTERRUPTED 130

int cmd_train(int argc, char **argv);
int cmd_eval(int argc, char **argv);
int cmd_sample(int argc, char **argv);
int cmd_peer(int argc, char **argv);
int cmd_bootstrap(int argc, char **argv);
int cmd_keygen(int argc, char **argv);
int cmd_top(int argc, char **argv);
/* `rumor top --servers A,B`: polls parameter servers (top_servers.c) every
 * interval_s, `count` times (0: until a stop signal), as a table or JSON.
 * Returns the exit status (1 when a single poll reached no server). */
int top_servers(const struct net_keys *keys, const char *servers, double interval_s, int64_t count, bool json,
                uint32_t timeout_ms);

/* `rumor top --web [HOST:]PORT` (top_web.c): one self-contained page at "/"
 * (peer/cli/top_web.html, embedded at build time as top_web_page) that polls
 * "/state.json", the latest state top_web_set_state was given, and draws the
 * member table and the Ξ and loss charts; "/metrics" serves the cluster's
 * figures to Prometheus (top_web_set_metrics). Served read-only from the
 * monitor's loop (gossip_monitor_serve), so only while top polls or sleeps.
 * `spec` is "PORT" (127.0.0.1:PORT) or "HOST:PORT"; a host that is not a
 * loopback address is served only when named, with a warning. Prints the URL
 * on stderr (the port chosen for port 0). Returns 0 and *out, or a negative
 * code (RUMOR_EFORMAT for a bad spec) with a message naming it. The web view
 * must be freed (top_web_free) after the monitor is closed. */
struct top_web;
struct gossip_monitor;
int top_web_start(struct gossip_monitor *m, const char *spec, struct top_web **out,
                  struct rumor_err *e) RUMOR_MUST_CHECK;
/* Hands the web view the figures of the last poll for "/metrics": the
 * cluster's gauges in Prometheus' text format (rumor_cluster_xi,
 * _xi_relative, _parameter_norm, _xi_exact, _drift_peers, _mean_loss,
 * _peers, _peers_reachable, _poll_timestamp_seconds, _poll_success; a
 * figure that is NaN is left out), so that Prometheus can scrape what no
 * single node knows. */
struct gossip_cluster_report;
void top_web_set_metrics(struct top_web *w, const struct gossip_cluster_report *r, double mean_loss);
/* The last poll (at now_s, Unix seconds) failed for `why`: until the next
 * good poll, /state.json answers 503 with {"error": why, "time": ...} (the
 * page keeps its last table and says why) and /metrics holds only
 * rumor_cluster_poll_success 0 and the poll's time, so that stale figures
 * are never served as current. */
void top_web_set_failure(struct top_web *w, double now_s, const char *why);
/* Checks a --web value as top_web_start would, serving nothing: 0, or
 * RUMOR_EFORMAT with the message. For the command line's checks. */
int top_web_check(const char *spec, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Replaces the state served at /state.json by json[0..len) (copied). */
void top_web_set_state(struct top_web *w, const char *json, size_t len);
void top_web_free(struct top_web *w);
extern const unsigned char top_web_page[]; /* the page's bytes (generated) */
extern const size_t top_web_page_len;
/* Parameter servers (cmd_ps.c): `rumor ps` runs one; `rumor peer --sync
 * ps` is a worker, which cmd_peer hands to ps_worker_check (at parse time:
 * the options a worker does not take) and ps_worker_run (the whole run). */
int cmd_ps(int argc, char **argv);
int ps_worker_check(const struct net_flags *nf, const struct gossip_flags *gf, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The parameter servers' connection settings of a worker (our keys and
 * --servers) into a sync configuration (its `net`), for the ps scheme. */
void ps_worker_net(const struct net_flags *nf, const struct net_keys *keys, const struct gossip_flags *gf,
                   struct sync_config *c);
int ps_worker_run(struct trainer *t, const struct net_flags *nf, const struct net_keys *keys,
                  const struct gossip_flags *gf, const struct gossip_setup *setup,
                  struct rumor_err *e) RUMOR_MUST_CHECK;
/* Model-parallel mode: `rumor group` starts a peer group's stages on one
 * host; `rumor peer --group G --stage s/S` is one stage (cmd_peer hands such
 * a command line to cmd_stage). */
int cmd_group(int argc, char **argv);
int cmd_stage(int argc, char **argv);
bool cmd_stage_wanted(int argc, char **argv);

/* ============================================================================
 * TensorBoard (tensorboard.c): --tensorboard DIR
 * ========================================================================== */

/*
 * A training process writes one run, DIR/RUN (util/tfevents.h): `rumor
 * train` the run "train", a peer its --name or else tb_member_name of its
 * key, a group's stage "NAME:sS" (its log name). Its trainer's observer
 * writes the training figures at training steps, the evaluation's at each
 * evaluation, and a member's exchange figures with them; `rumor top` writes
 * the run "cluster" at refresh numbers. Training thread (top: its thread).
 */

/* Characters of a member's key that name it: what `rumor top` shows. */
#define TB_MEMBER_ID_CHARS 8

struct tb_train {
  tb_writer_t *w;              /* NULL: no --tensorboard */
  const struct member *mb;     /* its exchange figures go along; may be NULL */
  int64_t loss_step, all_step; /* steps last written (-1: none) */
  int64_t eval_step;           /* the last evaluation written: its step and figures */
  double eval_loss, eval_accuracy;
  double next_loss_s, next_all_s, next_norm_s; /* clock_now_s() when each is due */
  double rate_s;               /* the throughput window's start (0: the trainer's start) */
  int64_t rate_samples;
};

/* `name` as one path component: '/' and backslash become '_'; "", "." and ".."
 * become "_"; cut to n − 1 bytes. A name so changed gets "-" and 8 hex
 * digits of its hash appended (within n, when n > 16), so that names stay
 * apart. */
void tb_run_name(const char *name, char *out, size_t n);
/* A member's name from its key (NET_PUBKEY_STR_LEN base64 characters): the
 * first TB_MEMBER_ID_CHARS, '/' as '_' and '+' as '-'. */
void tb_member_name(const char *id, char *out, size_t n);
/* Opens DIR/`name` (tb_run_name of it) for a training process. Returns 0,
 * or the error of tb_open prefixed with the flag. */
int tb_train_open(struct tb_train *tb, const char *dir, const char *name, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Makes `tb` the observer of `t` (after trainer_init), with the exchange
 * figures of `mb` (NULL: none). Does nothing when tb has no file. */
void tb_train_attach(struct tb_train *tb, struct trainer *t, const struct member *mb);
/* Flushes and closes (a tb_train never opened, zeroed, is fine). */
void tb_train_close(struct tb_train *tb);
/* `rumor top --tensorboard`: one refresh's figures at step `refresh`. */
struct gossip_cluster_report;
void tb_top_write(tb_writer_t *w, int64_t refresh, const struct gossip_cluster_report *r, double mean_loss);

/* ============================================================================
 * Charts
 * ========================================================================== */

/*
 * Line charts of time series as SVG files, and terminal sparklines, for
 * `rumor top`. No plotting library: the SVG is a few kinds of element
 * written as text, and the viewer (any browser) draws its fonts and
 * antialiasing. PNG is no longer written (docs/architecture.md, "Libraries
 * and what we keep hand-made"): nothing read it, and `rumor top --web` shows
 * the same charts live.
 *
 * A chart has one or more panels stacked vertically, all sharing the x axis
 * (seconds). NaN values are gaps in a line. Pure functions; any thread.
 */

enum plot_format { PLOT_UNKNOWN = 0, PLOT_SVG, PLOT_PNG };

/* The format named by a path's extension (".svg" or ".png", any case).
 * PLOT_PNG is recognised only so that its refusal can say why. */
enum plot_format plot_format_of(const char *path);
/* 0 when plot_write would take `path` as a name (it ends in .svg), else
 * RUMOR_EFORMAT with a message naming it (for a .png: why, and what to use
 * instead). Touches no file: for the command line's checks. */
int plot_check_path(const char *path, struct rumor_err *e) RUMOR_MUST_CHECK;

struct plot_series {
  const char *name; /* legend text, UTF-8 */
  const double *y;  /* one value per x; NaN leaves a gap */
  uint32_t rgb;     /* 0xRRGGBB */
};

struct plot_panel {
  const char *title;
  bool log_y; /* log10 y axis; non-positive values are gaps */
  const struct plot_series *series;
  size_t nseries;
};

/* Writes the chart to `path` as SVG, atomically (a temporary file renamed
 * over it), so a viewer never reads half a file. `x` holds n ≥ 1 times in
 * seconds, non-decreasing. Returns 0, or RUMOR_EFORMAT naming the path when
 * it does not end in .svg (a .png is refused with the reason and what to do
 * instead), or an I/O error. */
int plot_write(const char *path, const double *x, size_t n, const struct plot_panel *panels, size_t npanels,
               struct rumor_err *e) RUMOR_MUST_CHECK;

/* The last `width` values of y[0..n) as a UTF-8 sparkline (▁▂▃▄▅▆▇█, a space
 * for NaN), scaled between their minimum and maximum; `log_y` scales
 * log10(y). Writes at most cap-1 bytes and a NUL; returns bytes written. */
size_t plot_sparkline(char *out, size_t cap, const double *y, size_t n, size_t width, bool log_y);

#endif /* RUMOR_PEER_CLI_IMPL_H */
