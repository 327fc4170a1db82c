/* `rumor peer --group G --stage s/S`: one stage of a model-parallel peer
 * group, as `rumor group` starts it or a scheduler runs it on each node. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "peer/cli/cli_impl.h"
#include "util/json.h"

bool cmd_stage_wanted(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--group") == 0 || strncmp(argv[i], "--group=", 8) == 0) return true;
  return false;
}

/* Everything one stage process holds, for the clean-up ladder. */
struct stage_proc {
  struct group_flags f;
  struct train_config tc;
  struct train_stage st;
  struct stage_plan plan;
  struct net_keys keys;
  bool have_keys;
  struct trainer t;
  bool have_trainer;
  struct member mb;
  stage_link_t *link;
};

/* Opens a result line naming the group and this stage. */
static void open_line(struct json_buf *b, const struct stage_proc *p) {
  json_buf_init(b);
  json_obj_begin(b);
  json_key(b, "group");
  json_str(b, p->st.group);
  json_key(b, "stage");
  json_int(b, p->st.stage);
}

static void print_result(struct stage_proc *p, double secs, int64_t s0) {
  struct trainer *t = &p->t;
  struct gossip_stats gs;
  gossip_stats_get(p->mb.g, &gs);
  const struct pipe_stats *ps = &t->pipe.st;
  const struct sync *s = &p->mb.sync;
  double idle = ps->step_s > 0 ? ps->wait_s / ps->step_s : 0;
  if (trainer_has_loss(t)) {
    char final[96];
    result_describe_final(t, final, sizeof final);
    log_info("final %s after %lld steps", final, (long long)t->st.step);
  }
  struct json_buf b;
  open_line(&b, p);
  json_key(&b, "stages");
  json_int(&b, p->st.stages);
  result_training(&b, t, secs, s0);
  const struct {
    const char *key;
    double v;
  } pipe[] = {
      {"micro_batches", p->st.micro},
      {"step_ms", ps->steps > 0 ? 1e3 * ps->step_s / (double)ps->steps : 0.0},
      {"idle_fraction", idle},
      {"bubble_theory", pipe_bubble_theory(p->st.stages, p->st.micro)},
      {"timed_steps", (double)ps->steps},
      {"act_slots", ps->slots},
      {"act_peak_bytes", (double)ps->slots * (double)ps->slot_bytes},
  };
  for (size_t i = 0; i < sizeof pipe / sizeof pipe[0]; i++) {
    json_key(&b, pipe[i].key);
    json_num(&b, pipe[i].v);
  }
  json_key(&b, "schedule");
  json_str(&b, pipe_schedule_name(p->st.sched));
  result_gossip(&b, &gs, s);
  json_key(&b, "id");
  json_str(&b, gossip_self_id(p->mb.g));
  result_print(&b);
}

/* Parses and checks the command line. Returns 0, or the exit status of a
 * usage error or --help (with *done set). */
static int parse(struct stage_proc *p, int argc, char **argv, bool *done) {
  group_flags_default(&p->f);
  struct arg_spec specs[GROUP_FLAGS_MAX_SPECS];
  group_flags_specs(&p->f, FLAGS_STAGE, specs);
  int ar = args_parse(specs, argc, argv, "rumor peer --group NAME --stage s/S --cluster-key FILE --identity FILE [options]",
                      "Runs stage s of S of a model-parallel peer group: it holds a contiguous run of the\n"
                      "model's units, exchanges activations and their gradients with stages s-1 and s+1\n"
                      "over the authenticated transport (--link-listen, --link-prev), and averages its slice\n"
                      "of the parameters with stage s of other groups (--bootstrap), with the same gossip,\n"
                      "clipping, drift bound and rate limits as `rumor peer`. Every stage of a group gets\n"
                      "the same training options and identity. `rumor group` starts all stages of a group\n"
                      "on one host. A stage that fails or vanishes stops its whole group.");
  *done = true;
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(p->f.train.log_json);
  struct rumor_err e = {0};
  int stage, stages;
  if (!p->f.pipe.group) {
    fprintf(stderr, "rumor peer: --group NAME is required with --stage\n");
    return 2;
  }
  if (!p->f.pipe.stage) {
    fprintf(stderr, "rumor peer: --stage s/S is required with --group\n");
    return 2;
  }
  if (group_stage_parse(p->f.pipe.stage, &stage, &stages, &e) ||
      group_flags_config(&p->f, specs, stage, stages, &p->tc, &p->st, &p->plan, &e) ||
      gossip_flags_setup(&p->f.gossip, &p->mb.setup, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  if (stage > 0 && !p->f.pipe.link_prev) {
    fprintf(stderr, "rumor peer: stage %d/%d needs --link-prev HOST:PORT (the previous stage's link address)\n", stage,
            stages);
    return 2;
  }
  char name[96];
  snprintf(name, sizeof name, "%s:s%d", p->f.gossip.name ? p->f.gossip.name : p->st.group, stage);
  log_set_name(name);
  *done = false;
  return 0;
}

/* Pins training, loads the keys, builds the trainer, starts gossip and,
 * on its event loop, the links to the neighbouring stages. */
static int prepare(struct stage_proc *p, struct rumor_err *e) {
  if (p->mb.setup.pin_train && cpu_pin_self(&p->mb.setup.train_cpus, e))
    return rumor_err_prefix(e, "--train-cpus %s", p->f.gossip.train_cpus);
  int rc = net_flags_load_keys(&p->f.net, &p->keys, e);
  if (rc) return rc;
  p->have_keys = true;
  if ((rc = trainer_init(&p->t, &p->tc, e))) return rc;
  p->have_trainer = true;
  char label[256], extra[512];
  if ((rc = train_stage_label(&p->tc, &p->plan, label, sizeof label, e))) return rc;
  snprintf(extra, sizeof extra, "\"group\":\"%s\",\"stage\":%d,\"cluster\":\"%s\"", p->st.group, p->st.stage, label);
  rc = member_start(&p->mb, &p->t, &p->f.net, &p->keys, &p->f.gossip, label, p->tc.seed + (uint64_t)p->st.stage, "stage",
                    extra, e);
  if (rc) return rc;
  char agree[STAGE_LINK_AGREE_MAX + 1];
  train_stage_agreement(&p->tc, &p->plan, agree, sizeof agree);
  const struct pipe_flags *pf = &p->f.pipe;
  struct stage_link_config lc = {.identity = &p->keys.identity,
                                 .cluster_key = p->keys.cluster_key,
                                 .host = p->mb.g,
                                 .group = p->st.group,
                                 .stage = p->st.stage,
                                 .stages = p->st.stages,
                                 .listen = pf->link_listen,
                                 .prev = pf->link_prev,
                                 .agreement = agree,
                                 .in_width = model_act_width(&p->t.model, p->plan.u0),
                                 .out_width = model_act_width(&p->t.model, p->plan.u1),
                                 .max_rows = p->plan.mb_rows,
                                 .tied_floats = pipeline_tied_floats(&p->t.model, p->st.stages),
                                 .wire = p->mb.setup.wire,
                                 .connect_timeout_ms = (uint32_t)pf->link_wait_ms,
                                 .idle_timeout_ms = (uint32_t)pf->link_timeout_ms,
                                 .stop = signals_stop_flag()};
  if ((rc = stage_link_start(&p->link, &lc, e))) return rc;
  trainer_set_link(&p->t, p->link);
  printf("{\"group\":\"%s\",\"stage\":%d,\"stages\":%d,\"pid\":%d,\"link\":\"%s\"}\n", p->st.group, p->st.stage,
         p->st.stages, (int)getpid(), stage_link_address(p->link));
  fflush(stdout);
  return 0;
}

/* Joins the stage's cluster (taking a live stage's state when there is
 * one), then agrees on the starting position with the other stages. */
static int join(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  int rc = stage_link_wait_ready(p->link, e);
  if (rc) return rc;
  struct gossip_train_pos pos;
  int jr = member_join(&p->mb, t, &p->f.gossip, false, &pos, e);
  if (jr < 0) return jr;
  struct stage_link_pos lp = {0, 0, 0};
  if (jr == 0) {
    lp = (struct stage_link_pos){(int64_t)pos.step, (int64_t)pos.epoch, (int64_t)pos.samples};
    log_info("took stage %d's state from the cluster at step %llu (epoch %llu)", p->st.stage,
             (unsigned long long)pos.step, (unsigned long long)pos.epoch + 1);
  } else {
    log_info("starting from our own initialisation");
  }
  /* Stage 0's position wins: every stage must run the same steps. */
  if (p->st.stage > 0 && (rc = stage_link_recv_start(p->link, &lp, e))) return rc;
  trainer_set_position(t, lp.step, lp.epoch, lp.samples);
  if ((rc = stage_link_send_start(p->link, &lp, e))) return rc;
  if (lp.step > 0) log_info("the group continues from step %lld (epoch %lld)", (long long)lp.step, (long long)lp.epoch + 1);
  if ((rc = member_ready(&p->mb, t, e))) return rc;
  stage_link_set_idle(p->link, sync_idle, &p->mb.sync);
  return 0;
}

static bool link_failed(void *arg, struct rumor_err *e) {
  struct stage_proc *p = arg;
  char why[400];
  int culprit;
  if (!stage_link_failed(p->link, &culprit, why, sizeof why)) return false;
  rumor_err_set(e, RUMOR_ECANCELED, "%s", why);
  return true;
}

static int run(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  int rc = member_wait_peers(&p->mb, &p->f.gossip, "groups", link_failed, p, e);
  if (rc) return rc;
  double t0 = clock_now_s();
  int64_t s0 = t->st.samples;
  bool first = true;
  while (!trainer_done(t)) {
    if (signals_stop_requested())
      return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
    if ((rc = trainer_step(t, e))) return rc;
    if (first) {
      if (trainer_has_loss(t)) log_info("first step: loss %.4f at step %lld", t->last_loss, (long long)t->st.step);
      else log_info("first step done (the loss is on the last stage)");
      first = false;
    }
    sync_boundary(&p->mb.sync);
    sync_hold(&p->mb.sync, signals_stop_flag());
  }
  double secs = clock_now_s() - t0;
  if ((rc = trainer_evaluate(t, e))) return rc;
  print_result(p, secs, s0);
  return 0;
}

/* Ends the group after a failure: says which stage failed and why, and
 * tells the neighbours (they pass it on). Returns the exit status. */
static int stop_group(struct stage_proc *p, const struct rumor_err *e) {
  int me = p->st.stage, S = p->st.stages;
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
  open_line(&b, p);
  json_key(&b, "failed_stage");
  json_int(&b, culprit);
  json_key(&b, "stopped");
  json_bool(&b, signals_stop_requested() != 0);
  json_key(&b, "error");
  json_str(&b, why);
  result_print(&b);
  if (signals_stop_requested()) {
    log_info("group %s stops: %s", p->st.group, why);
    return 0;
  }
  log_error("group %s stops: %s", p->st.group, why);
  fprintf(stderr, "rumor peer: group %s, stage %d/%d: stopping because %s\n", p->st.group, me, S, why);
  return 1;
}

int cmd_stage(int argc, char **argv) {
  static struct stage_proc proc;
  struct stage_proc *p = &proc;
  memset(p, 0, sizeof *p);
  bool done;
  int status = parse(p, argc, argv, &done);
  if (done) return status;
  struct rumor_err e = {0};
  int rc = prepare(p, &e);
  if (rc == 0) rc = join(p, &e);
  if (rc == 0) rc = run(p, &e);
  /* A failure, even before the links exist, is reported as the group's
   * (the launcher names the stage that failed). */
  status = rc == 0 ? 0 : stop_group(p, &e);
  /* The links first: they ride on the gossip runtime's event loop. */
  stage_link_close(p->link, 10000);
  member_free(&p->mb, p->f.net.linger_ms);
  if (p->have_trainer) trainer_free(&p->t);
  if (p->have_keys) net_keys_free(&p->keys);
  return status;
}
