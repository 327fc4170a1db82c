/* `rumor peer`: train one replica as a member of a gossip cluster. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

/* Everything one peer process holds, for the clean-up ladder. */
struct peer_proc {
  struct train_flags tf;
  struct net_flags nf;
  struct gossip_flags gf;
  struct train_config tc;
  struct net_keys keys;
  bool have_keys;
  struct trainer t;
  bool have_trainer;
  struct member mb;
  struct tb_train tb; /* --tensorboard */
};

/* `gs` and `id`: the gossip figures and our key, taken before we left. */
static void print_result(struct peer_proc *p, const struct gossip_stats *gs, const char *id, double secs, int64_t s0) {
  struct trainer *t = &p->t;
  const struct sync *s = &p->mb.sync;
  if (!result_final_evaluation(t)) return; /* we left the cluster already */
  char final[96];
  result_describe_final(t, final, sizeof final);
  log_info("final %s after %lld steps (%s); %llu exchanges applied, %llu failed, %llu rejected; %.1f MB sent, "
           "%.1f MB received",
           final, (long long)t->st.step, s->scheme->name, (unsigned long long)gs->exchanges_ok,
           (unsigned long long)gs->exchanges_failed, (unsigned long long)gs->exchanges_rejected,
           (double)gs->bytes_out / 1e6, (double)gs->bytes_in / 1e6);
  if (s->avg.holds)
    log_info("held training %llu times for an exchange (%.1f s in all, %llu gave up after --max-hold-ms)",
             (unsigned long long)s->avg.holds, s->avg.hold_s, (unsigned long long)s->avg.hold_timeouts);
  json_t *o = result_open();
  result_training(o, t, secs, s0);
  sync_result(s, gs, o);
  json_text_set(o, "id", json_string(id));
  result_print(o);
}

/* Parses and checks the command line. Returns 0, or the exit status of a
 * usage error or --help (with *done set). */
static int parse(struct peer_proc *p, int argc, char **argv, bool *done) {
  train_flags_default(&p->tf);
  net_flags_default(&p->nf);
  gossip_flags_default(&p->gf);
  struct arg_spec specs[96];
  size_t n = 0;
  train_flags_specs(&p->tf, FLAGS_PEER, specs, &n, 95);
  net_flags_specs(&p->nf, FLAGS_PEER, true, specs, &n, 95);
  gossip_flags_specs(&p->gf, FLAGS_PEER, specs, &n, 95);
  specs[n] = (struct arg_spec){0};
  int ar = args_parse(specs, argc, argv, "rumor peer --bootstrap A,B --cluster-key FILE --identity FILE [options]",
                      "Trains one replica as a member of a cluster: joins through the bootstrap list\n"
                      "(none: the first member), starts from a live peer's state, trains on its shard\n"
                      "and averages its parameters with a random neighbour every few steps. Prints the\n"
                      "final test accuracy as JSON on stdout; SIGINT/SIGTERM leave the cluster cleanly.\n"
                      "`rumor peer --group G --stage s/S` runs one stage of a peer group instead (see\n"
                      "`rumor group --help`).");
  *done = ar != ARGS_OK;
  if (*done) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(p->tf.log_json);
  if (p->gf.name) log_set_name(p->gf.name);
  struct rumor_err e = {0};
  bool ps = false;
  if (train_flags_config(&p->tf, specs, &p->tc, &e) || gossip_flags_setup(&p->gf, specs, &p->mb.setup, &e) ||
      ((ps = p->mb.setup.sync.kind == SYNC_PS) && ps_worker_check(&p->nf, &p->gf, &e)) ||
      net_flags_check(&p->nf, p->gf.servers, !ps, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    *done = true;
    return 2;
  }
  gossip_setup_train(&p->mb.setup, &p->tc);
  return 0;
}

/* Pins training, loads the keys, builds the trainer. */
static int prepare(struct peer_proc *p, struct rumor_err *e) {
  /* Before any compute thread exists, so that they inherit it (the network
   * thread, started later, pins itself to --net-cpus). */
  if (p->mb.setup.pin_train && cpu_pin_self(&p->mb.setup.train_cpus, e))
    return rumor_err_prefix(e, "--train-cpus %s", p->gf.train_cpus);
  int rc = net_flags_load_keys(&p->nf, &p->keys, e);
  if (rc) return rc;
  p->have_keys = true;
  if (p->tf.tensorboard) {
    /* The run is named like the peer: --name, else its key as top shows it. */
    char id[NET_PUBKEY_STR_LEN + 1], name[TB_MEMBER_ID_CHARS + 1];
    net_pubkey_format(id, p->keys.identity.pk);
    tb_member_name(id, name, sizeof name);
    if ((rc = tb_train_open(&p->tb, p->tf.tensorboard, p->gf.name ? p->gf.name : name, e))) return rc;
  }
  if ((rc = trainer_init(&p->t, &p->tc, e))) return rc;
  p->have_trainer = true;
  tb_train_attach(&p->tb, &p->t, &p->mb);
  return 0;
}

/* Joins the cluster and takes a live peer's state unless we resume. */
static int join(struct peer_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  char spec[MODEL_SPEC_MAX];
  model_spec_format(&t->model.spec, spec, sizeof spec);
  int rc = member_start(&p->mb, t, &p->nf, &p->keys, &p->gf, spec, p->tc.seed, "peer", NULL, e);
  if (rc) return rc;
  struct gossip_train_pos pos;
  int jr = member_join(&p->mb, t, &p->gf, p->tc.resume != NULL, &pos, e);
  if (jr < 0) return jr;
  if (jr == 0) {
    trainer_set_position(t, (int64_t)pos.step, (int64_t)pos.epoch, t->st.samples);
  } else {
    log_info("starting from %s", p->tc.resume ? "the checkpoint" : "our own initialisation");
  }
  if ((rc = member_ready(&p->mb, t, e))) return rc;
  rc = member_wait_peers(&p->mb, &p->gf, "peers", NULL, NULL, e);
  /* A stop signal while waiting is not a failure: the loop does not run
   * and the peer leaves as on any stop. */
  return rc == RUMOR_ECANCELED && signals_stop_requested() ? 0 : rc;
}

/* Trains until done or stopped; then leaves and prints the result. */
static int run(struct peer_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  int64_t s0 = t->st.samples, steps;
  double secs;
  int rc = member_train(&p->mb, t, &secs, &steps, e);
  if (rc) return rc;
  if (signals_stop_requested()) {
    log_info("signal %d: leaving the cluster at step %lld", signals_stop_requested(), (long long)t->st.step);
    if (p->tc.checkpoint && trainer_save(t, p->tc.checkpoint, e)) fprintf(stderr, "rumor peer: %s\n", e->msg);
    return 0;
  }
  /* Leave first, then evaluate: partners stop asking a peer that no longer
   * trains (an exchange request would wait for a step boundary that never
   * comes) while the test set is evaluated. */
  log_info("training done after %lld steps (%.1f s)", (long long)t->st.step, secs);
  if ((rc = member_finish(&p->mb, t, secs, steps, NULL, NULL, e))) return rc;
  if (signals_stop_requested()) {
    /* Stopped while waiting for the others: leave at once, as on any stop
     * (the checkpoint of the last step, or of the wait, is saved). */
    log_info("signal %d: leaving the cluster after our last step", signals_stop_requested());
    return 0;
  }
  struct gossip_stats gs;
  gossip_stats_get(p->mb.g, &gs);
  char id[NET_PUBKEY_STR_LEN + 1];
  snprintf(id, sizeof id, "%s", gossip_self_id(p->mb.g));
  member_leave(&p->mb, p->nf.linger_ms);
  print_result(p, &gs, id, secs, s0);
  return 0;
}

int cmd_peer(int argc, char **argv) {
  /* One stage of a model-parallel group (rumor peer --group G --stage s/S). */
  if (cmd_stage_wanted(argc, argv)) return cmd_stage(argc, argv);
  static struct peer_proc proc;
  struct peer_proc *p = &proc;
  memset(p, 0, sizeof *p);
  bool done;
  int status = parse(p, argc, argv, &done);
  if (done) return status;
  struct rumor_err e = {0};
  int rc = prepare(p, &e);
  /* A worker of parameter servers is no gossip member: it talks to the
   * servers only (cmd_ps.c). */
  if (rc == 0 && p->mb.setup.sync.kind == SYNC_PS) rc = ps_worker_run(&p->t, &p->nf, &p->keys, &p->gf, &p->mb.setup, &e);
  else if (rc == 0 && (rc = join(p, &e)) == 0) rc = run(p, &e);
  status = rc == 0 ? 0 : rc == RUMOR_EFORMAT ? 2 : 1;
  if (rc) fprintf(stderr, "rumor peer: %s\n", e.msg);
  member_free(&p->mb, p->nf.linger_ms);
  tb_train_close(&p->tb);
  if (p->have_trainer) trainer_free(&p->t);
  if (p->have_keys) net_keys_free(&p->keys);
  return status;
}
