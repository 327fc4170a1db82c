/* `rumor peer --group G --stage s/S`: one stage of a model-parallel peer
 * group, as `rumor group` starts it or a scheduler runs it on each node. */
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "gossip/gossip.h"
#include "peer/cli/cli.h"
#include "peer/cli/group_flags.h"
#include "peer/pipeline/stage_link.h"
#include "peer/sync/stage_sync.h"
#include "util/json.h"

bool cmd_stage_wanted(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--group") == 0 || strncmp(argv[i], "--group=", 8) == 0) return true;
  return false;
}

/* Everything one stage process holds, for the clean-up ladder. */
struct stage_proc {
  struct group_flags f;
  struct stage_config sc;
  struct stage_plan plan;
  struct net_keys keys;
  bool have_keys;
  stage_link_t *link;
  struct stage_trainer t;
  bool have_trainer;
  gossip_t *g;
  struct stage_sync ss;
  bool have_sync;
  float *mine, *theirs, *donor;
};

static void print_result(struct stage_proc *p, double secs, int64_t s0) {
  struct stage_trainer *t = &p->t;
  struct gossip_stats gs;
  gossip_stats_get(p->g, &gs);
  const struct pipe_stats *ps = &t->pipe.st;
  double idle = ps->step_s > 0 ? ps->wait_s / ps->step_s : 0;
  size_t act_bytes = (size_t)ps->slots * ps->slot_bytes;
  char head[160] = "";
  if (p->sc.stage == p->sc.stages - 1) {
    log_info("final test accuracy %.4f, test loss %.4f after %lld steps", t->accuracy, t->test_loss, (long long)t->st.step);
    snprintf(head, sizeof head, "\"test_accuracy\":%.6f,\"test_loss\":%.6f,", t->accuracy, t->test_loss);
  }
  printf("{%s\"group\":\"%s\",\"stage\":%d,\"stages\":%d,\"steps\":%lld,\"epochs\":%lld,\"samples_per_s\":%.1f,"
         "\"micro_batches\":%d,\"schedule\":\"%s\",\"step_ms\":%.3f,\"idle_fraction\":%.6f,\"bubble_theory\":%.6f,\"timed_steps\":%lld,"
         "\"act_slots\":%d,\"act_peak_bytes\":%zu,\"exchanges\":%llu,\"exchanges_failed\":%llu,"
         "\"exchanges_rejected\":%llu,\"id\":\"%s\"}\n",
         head, p->sc.group, p->sc.stage, p->sc.stages, (long long)t->st.step, (long long)t->st.epoch,
         secs > 0 ? (double)(t->st.samples - s0) / secs : 0.0, p->sc.micro, pipe_schedule_name(p->sc.sched),
         ps->steps > 0 ? 1e3 * ps->step_s / (double)ps->steps : 0.0, idle,
         pipe_bubble_theory(p->sc.stages, p->sc.micro), (long long)ps->steps, ps->slots, act_bytes,
         (unsigned long long)gs.exchanges_ok, (unsigned long long)gs.exchanges_failed,
         (unsigned long long)gs.exchanges_rejected, gossip_self_id(p->g));
  fflush(stdout);
}

static int start_gossip(struct stage_proc *p, struct rumor_err *e) {
  struct stage_trainer *t = &p->t;
  enum net_dtype wire;
  int rc = group_flags_wire(&p->f, &wire, e);
  if (rc) return rc;
  int64_t P = t->model.nparams, S = stage_trainer_state_floats(t);
  p->mine = tensor_host_alloc(t->be, (size_t)P * sizeof(float));
  p->theirs = tensor_host_alloc(t->be, (size_t)P * sizeof(float));
  p->donor = tensor_host_alloc(t->be, (size_t)S * sizeof(float));
  if (!p->mine || !p->theirs || !p->donor)
    return rumor_err_set(e, -ENOMEM, "cannot allocate host buffers for gossip");
  static char label[256];
  if ((rc = stage_gossip_label(&p->sc, &p->plan, label, sizeof label, e))) return rc;
  struct gossip_config gc;
  gossip_config_default(&gc);
  net_flags_gossip_config(&p->f.net, &p->keys, &gc);
  gc.role = GOSSIP_ROLE_PEER;
  gc.model = label;
  gc.nparams = (uint64_t)P;
  gc.state_floats = (uint64_t)S;
  gc.optimizer = optim_kind_name(t->optim.cfg.kind);
  gc.wire = wire;
  gc.alpha = (float)p->f.alpha;
  gc.exchange_timeout_ms = (uint32_t)p->f.exchange_timeout_ms;
  gc.seed = p->sc.train.seed + (uint64_t)p->sc.stage;
  gc.sketch_k = (int)p->f.sketch_k;
  gc.xch_mine = p->mine;
  gc.xch_theirs = p->theirs;
  gc.donor_buf = p->donor;
  if ((rc = gossip_start(&p->g, &gc, e))) return rc;
  printf("{\"listen\":\"%s\",\"id\":\"%s\",\"role\":\"stage\",\"group\":\"%s\",\"stage\":%d,\"cluster\":\"%s\"}\n",
         gossip_advertised(p->g), gossip_self_id(p->g), p->sc.group, p->sc.stage, label);
  fflush(stdout);
  return 0;
}

/* Joins the stage's cluster (taking a live stage's state when there is
 * one), then agrees on the starting position with the other stages. */
static int join(struct stage_proc *p, struct rumor_err *e) {
  struct stage_trainer *t = &p->t;
  struct gossip_train_pos pos;
  int jr = gossip_join_wait(p->g, p->f.no_state_pull ? NULL : p->donor, &pos, signals_stop_flag(), e);
  if (jr < 0) return jr;
  struct stage_link_pos lp = {0, 0, 0};
  if (jr == 0) {
    stage_trainer_load_state(t, p->donor);
    lp = (struct stage_link_pos){(int64_t)pos.step, (int64_t)pos.epoch, (int64_t)pos.samples};
    log_info("took stage %d's state from the cluster at step %llu (epoch %llu)", p->sc.stage,
             (unsigned long long)pos.step, (unsigned long long)pos.epoch + 1);
  } else {
    log_info("starting from our own initialisation");
  }
  int rc;
  if (p->sc.stage > 0) {
    /* Stage 0's position wins: every stage must run the same steps. */
    if ((rc = stage_link_recv_start(p->link, &lp, e))) return rc;
  }
  stage_trainer_set_position(t, lp.step, lp.epoch, lp.samples);
  if ((rc = stage_link_send_start(p->link, &lp, e))) return rc;
  if (lp.step > 0) log_info("the group continues from step %lld (epoch %lld)", (long long)lp.step, (long long)lp.epoch + 1);
  return 0;
}

static int wait_peers(struct stage_proc *p, struct rumor_err *e) {
  if (p->f.wait_peers <= 1) return 0;
  double deadline = clock_now_s() + (double)p->f.wait_peers_ms / 1e3;
  while ((int64_t)gossip_ready_peers(p->g) < p->f.wait_peers) {
    if (signals_stop_requested())
      return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
    char why[400];
    int culprit;
    if (stage_link_failed(p->link, &culprit, why, sizeof why)) return rumor_err_set(e, RUMOR_ECANCELED, "%s", why);
    if (clock_now_s() > deadline)
      return rumor_err_set(e, RUMOR_ETIMEDOUT, "only %zu of %lld groups ready after %lld ms", gossip_ready_peers(p->g),
                           (long long)p->f.wait_peers, (long long)p->f.wait_peers_ms);
    stage_sync_boundary(&p->ss);
    const struct timespec tick = {0, 10 * 1000000};
    nanosleep(&tick, NULL);
  }
  log_info("%lld groups ready: starting", (long long)p->f.wait_peers);
  return 0;
}

/* Ends the group after a failure: says which stage failed and why, and
 * tells the neighbours (they pass it on). Returns the exit status. */
static int stop_group(struct stage_proc *p, const struct rumor_err *e) {
  int me = p->sc.stage, S = p->sc.stages;
  char why[400];
  int culprit = me;
  if (p->link && stage_link_failed(p->link, &culprit, why, sizeof why)) {
    /* A neighbour's failure, or one passed on to us. */
  } else if (signals_stop_requested()) {
    snprintf(why, sizeof why, "stage %d/%d stopped on signal %d", me, S, signals_stop_requested());
  } else {
    snprintf(why, sizeof why, "stage %d/%d failed: %.360s", me, S, e->msg);
  }
  if (p->link) stage_link_abort(p->link, culprit, why);
  /* For the launcher (and schedulers): which stage took the group down. */
  struct json_buf b;
  json_buf_init(&b);
  json_obj_begin(&b);
  json_key(&b, "group");
  json_str(&b, p->sc.group);
  json_key(&b, "stage");
  json_int(&b, me);
  json_key(&b, "failed_stage");
  json_int(&b, culprit);
  json_key(&b, "stopped");
  json_bool(&b, signals_stop_requested() != 0);
  json_key(&b, "error");
  json_str(&b, why);
  json_obj_end(&b);
  printf("%.*s\n", (int)b.len, b.data);
  fflush(stdout);
  json_buf_free(&b);
  if (signals_stop_requested()) {
    log_info("group %s stops: %s", p->sc.group, why);
    return 0;
  }
  log_error("group %s stops: %s", p->sc.group, why);
  fprintf(stderr, "rumor peer: group %s, stage %d/%d: stopping because %s\n", p->sc.group, me, S, why);
  return 1;
}

static void free_proc(struct stage_proc *p) {
  if (p->g) gossip_stop(p->g, (uint32_t)p->f.linger_ms);
  if (p->have_sync) stage_sync_free(&p->ss);
  stage_link_close(p->link, 10000);
  if (p->have_trainer) {
    tensor_host_free(p->t.be, p->mine);
    tensor_host_free(p->t.be, p->theirs);
    tensor_host_free(p->t.be, p->donor);
    stage_trainer_free(&p->t);
  }
  if (p->have_keys) net_keys_free(&p->keys);
}

int cmd_stage(int argc, char **argv) {
  static struct stage_proc proc;
  struct stage_proc *p = &proc;
  memset(p, 0, sizeof *p);
  group_flags_default(&p->f);
  struct arg_spec specs[GROUP_FLAGS_MAX_SPECS];
  group_flags_specs(&p->f, GROUP_FLAGS_STAGE, specs);
  int ar = args_parse(specs, argc, argv, "rumor peer --group NAME --stage s/S --cluster-key FILE --identity FILE [options]",
                      "Runs stage s of S of a model-parallel peer group: it holds a contiguous run of the\n"
                      "model's layers, exchanges activations and their gradients with stages s-1 and s+1\n"
                      "over the authenticated transport (--link-listen, --link-prev), and averages its slice\n"
                      "of the parameters with stage s of other groups (--bootstrap). Every stage of a group\n"
                      "gets the same training options and identity. `rumor group` starts all stages of a\n"
                      "group on one host. A stage that fails or vanishes stops its whole group.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(p->f.train.log_json);
  struct rumor_err e = {0};
  int stage, stages;
  if (!p->f.group) {
    fprintf(stderr, "rumor peer: --group NAME is required with --stage\n");
    return 2;
  }
  if (!p->f.stage) {
    fprintf(stderr, "rumor peer: --stage s/S is required with --group\n");
    return 2;
  }
  if (group_stage_parse(p->f.stage, &stage, &stages, &e) ||
      group_flags_stage_config(&p->f, specs, stage, stages, &p->sc, &e) || stage_plan_make(&p->sc, &p->plan, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  if (stage > 0 && !p->f.link_prev) {
    fprintf(stderr, "rumor peer: stage %d/%d needs --link-prev HOST:PORT (the previous stage's link address)\n", stage,
            stages);
    return 2;
  }
  char name[96];
  snprintf(name, sizeof name, "%s:s%d", p->f.name ? p->f.name : p->sc.group, stage);
  log_set_name(name);
  if (net_flags_load_keys(&p->f.net, &p->keys, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }
  p->have_keys = true;

  char agree[STAGE_LINK_AGREE_MAX + 1];
  stage_agreement(&p->sc, &p->plan, agree, sizeof agree);
  struct stage_link_config lc = {.identity = &p->keys.identity,
                                 .cluster_key = p->keys.cluster_key,
                                 .group = p->sc.group,
                                 .stage = stage,
                                 .stages = stages,
                                 .listen = p->f.link_listen,
                                 .prev = p->f.link_prev,
                                 .agreement = agree,
                                 .in_width = p->plan.spec.widths[p->plan.l0],
                                 .out_width = p->plan.spec.widths[p->plan.l1],
                                 .max_rows = p->plan.mb_rows,
                                 .connect_timeout_ms = (uint32_t)p->f.link_wait_ms,
                                 .idle_timeout_ms = (uint32_t)p->f.link_timeout_ms,
                                 .stop = signals_stop_flag()};
  int status = 1;
  if (stage_link_start(&p->link, &lc, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    free_proc(p);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }
  printf("{\"group\":\"%s\",\"stage\":%d,\"stages\":%d,\"pid\":%d,\"link\":\"%s\"}\n", p->sc.group, stage, stages,
         (int)getpid(), stage_link_address(p->link));
  fflush(stdout);

  if (stage_trainer_init(&p->t, &p->sc, p->link, &e)) goto fail;
  p->have_trainer = true;
  if (start_gossip(p, &e)) goto fail;
  if (stage_link_wait_ready(p->link, &e)) goto fail;
  if (join(p, &e)) goto fail;
  struct stage_sync_config ssc = {.every_steps = p->f.every, .every_s = p->f.interval, .max_distance = p->f.max_distance};
  if (stage_sync_init(&p->ss, p->g, &p->t, &ssc, &e)) goto fail;
  p->have_sync = true;
  stage_link_set_idle(p->link, stage_sync_idle, &p->ss);
  gossip_ready(p->g);
  if (wait_peers(p, &e)) goto fail;

  double t0 = clock_now_s();
  int64_t s0 = p->t.st.samples;
  bool first = true;
  while (!stage_trainer_done(&p->t)) {
    if (signals_stop_requested()) {
      rumor_err_set(&e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
      goto fail;
    }
    if (stage_trainer_step(&p->t, &e)) goto fail;
    if (first) {
      log_info("first step done%s", p->sc.stage == stages - 1 ? "" : " (the loss is on the last stage)");
      if (p->sc.stage == stages - 1) log_info("first step: loss %.4f at step %lld", p->t.last_loss, (long long)p->t.st.step);
      first = false;
    }
    stage_sync_boundary(&p->ss);
  }
  double secs = clock_now_s() - t0;
  if (stage_trainer_evaluate(&p->t, &e)) goto fail;
  print_result(p, secs, s0);
  status = 0;
  free_proc(p);
  return status;
fail:
  status = stop_group(p, &e);
  free_proc(p);
  return status;
}
