/* `rumor peer --group G --stage s/S`: one stage of a model-parallel peer
 * group, as `rumor group` starts it or a scheduler runs it on each node. */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

bool cmd_stage_wanted(int argc, char **argv) {
  for (int i = 1; i < argc; i++)
    if (strcmp(argv[i], "--group") == 0 || STR_PREFIX(argv[i], "--group=")) return true;
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
  int dp_rank, dp_size;  /* --dp r/D (0/1 without it) */
  int tp_rank, tp_size;  /* --tp t/T (0/1 without it) */
  int member, members;   /* this process's index among the group's processes: dp_rank x T + tp_rank of T x D,
                            or (in_stages) stage x N + stage_rank of S x N */
  bool in_stages;        /* a data-parallel member or a tensor-parallel rank of a pipeline's stage (--dp or --tp
                            with S > 1): the stage's N = D or T processes share a communicator, and process r of
                            stage s links to process r of stages s - 1 and s + 1 */
  int stage_rank, per_stage; /* in_stages: r (dp_rank or tp_rank) and N (D or T) */
  struct train_dp dp;    /* with dp_size > 1: tc.dp points here */
  struct train_tp tp;    /* with tp_size > 1: tc.tp points here */
  comm_t *comm;          /* every process of the group (the mesh) */
  comm_t *dp_comm, *tp_comm; /* its data-parallel and tensor-parallel sub-communicators, or NULL */
  comm_t *ep_comm;       /* --expert-parallel P: its run of P data-parallel members (a sub-communicator), or NULL */
  char peer_addrs[COMM_MAX_MEMBERS][NET_HOST_MAX + 8]; /* --comm-peers */
  bool averages;         /* a data- or tensor-parallel process that averages its shard with other groups' */
  struct member mb;
  stage_link_t *link;
  struct tb_train tb; /* --tensorboard */
};

/* Opens a result line naming the group and this stage. */
static json_t *open_line(const struct stage_proc *p) {
  json_t *o = result_open();
  json_text_set(o, "group", json_text_str(p->st.group));
  json_text_set(o, "stage", json_integer(p->st.stage));
  return o;
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
  json_t *o = open_line(p);
  json_text_set(o, "stages", json_integer(p->st.stages));
  if (p->in_stages) json_text_set(o, "member", json_integer(p->member));
  if (p->in_stages && p->tp_size > 1) json_text_set(o, "tensor_parallel", json_integer(p->tp_size));
  result_training(o, t, secs, s0);
  json_text_set(o, "micro_batches", json_integer(p->st.micro));
  json_text_set(o, "step_ms", json_text_real(ps->steps > 0 ? 1e3 * ps->step_s / (double)ps->steps : 0.0));
  json_text_set(o, "idle_fraction", json_text_real(idle));
  json_text_set(o, "bubble_theory", json_text_real(pipe_bubble_theory(p->st.stages, p->st.micro)));
  json_text_set(o, "timed_steps", json_integer(ps->steps));
  json_text_set(o, "act_slots", json_integer(ps->slots));
  json_text_set(o, "act_peak_bytes", json_integer((json_int_t)ps->slots * (json_int_t)ps->slot_bytes));
  json_text_set(o, "schedule", json_string(pipe_schedule_name(p->st.sched)));
  sync_result(s, &gs, o);
  json_text_set(o, "id", json_string(gossip_self_id(p->mb.g)));
  result_print(o);
}

/* The links' addresses: --link-listen parses (port 0: any), --link-prev
 * can be dialed. Returns 0, or RUMOR_EFORMAT naming the flag. */
static int check_link_addrs(const struct pipe_flags *pf, struct rumor_err *e) {
  if (pf->link_listen && net_addr_check_listen(pf->link_listen, e)) return rumor_err_prefix(e, "--link-listen");
  if (pf->link_prev && net_addr_check_dial(pf->link_prev, e)) return rumor_err_prefix(e, "--link-prev");
  return 0;
}

/* --comm-listen and --comm-peers: process `rank` of a communicator needs
 * the addresses of processes 0 .. rank − 1 (`whose`: "of the group", or
 * "of stage s/S"). */
static int comm_addrs_usage(struct stage_proc *p, int rank, const char *whose, const char *which, const char *val,
                            struct rumor_err *e) {
  const struct pipe_flags *pf = &p->f.pipe;
  if (net_addr_check_listen(pf->comm_listen, e)) return rumor_err_prefix(e, "--comm-listen");
  size_t n = 0;
  if (pf->comm_peers &&
      net_addr_list_split(pf->comm_peers, &p->peer_addrs[0][0], sizeof p->peer_addrs[0], COMM_MAX_MEMBERS, &n, e))
    return rumor_err_prefix(e, "--comm-peers");
  if ((int)n != rank)
    return rumor_err_set(e, RUMOR_EFORMAT, "process %d %s (%s %s) needs --comm-peers with the addresses of processes "
                         "0 .. %d (%d of them), not %zu", rank, whose, which, val, rank - 1, rank, n);
  return 0;
}

/* The data-parallel options against the rest. */
static int dp_usage(struct stage_proc *p, int stage, int stages, struct rumor_err *e) {
  const struct pipe_flags *pf = &p->f.pipe;
  p->members = p->dp_size * p->tp_size;
  p->member = p->dp_rank * p->tp_size + p->tp_rank;
  if (pf->expert_parallel > 1) {
    struct model_spec spec;
    if (!p->tc.model) return rumor_err_set(e, RUMOR_EFORMAT, "--expert-parallel needs --model");
    if (model_spec_parse(p->tc.model, &spec, e)) return rumor_err_prefix(e, "--model");
    if (group_ep_check(&p->f, &spec, stages, p->dp_size, p->tp_size, p->tc.batch, e)) return RUMOR_EFORMAT;
  }
  if (stages > 1 && p->members > 1) {
    /* Data-parallel members or tensor-parallel ranks inside a pipeline
     * (one kind: group_stage_dp_check): process stage x N + r. */
    if (group_stage_dp_check(&p->f, stages, p->dp_size, p->tp_size, e)) return RUMOR_EFORMAT;
    p->in_stages = true;
    p->per_stage = p->dp_size * p->tp_size;
    p->stage_rank = p->dp_rank * p->tp_size + p->tp_rank;
    p->members = stages * p->per_stage;
    p->member = stage * p->per_stage + p->stage_rank;
    if (p->tp_size > 1) {
      struct model_spec spec;
      if (model_spec_parse(p->tc.model, &spec, e)) return rumor_err_prefix(e, "--model");
      if (model_tp_check(&spec, p->tp_size, e)) return rumor_err_prefix(e, "--tp %s", pf->tp);
    }
    char whose[48];
    snprintf(whose, sizeof whose, "of stage %d/%d", stage, stages);
    return comm_addrs_usage(p, p->stage_rank, whose, p->dp_size > 1 ? "--dp" : "--tp", p->dp_size > 1 ? pf->dp : pf->tp,
                            e);
  }
  const char *which = p->tp_size > 1 ? "--tp" : "--dp", *val = p->tp_size > 1 ? pf->tp : pf->dp;
  if (p->members > COMM_MAX_MEMBERS)
    return rumor_err_set(e, RUMOR_EFORMAT, "%d data-parallel members of %d tensor-parallel ranks: %d processes, "
                         "more than %d", p->dp_size, p->tp_size, p->members, COMM_MAX_MEMBERS);
  if (p->dp_size == 1 && p->tp_size > 1 && pf->zero)
    return rumor_err_set(e, RUMOR_EFORMAT, "--zero %lld needs data-parallel members (--dp r/D, D > 1)",
                         (long long)pf->zero);
  if (p->members == 1) {
    if (pf->zero) return rumor_err_set(e, RUMOR_EFORMAT, "--zero %lld needs data-parallel members (--dp r/D, D > 1)",
                                       (long long)pf->zero);
    return 0;
  }
  if (group_shard_check(&p->f, p->dp_size, p->tp_size, p->averages, e)) return RUMOR_EFORMAT;
  if (p->tp_size > 1) {
    struct model_spec spec;
    if (model_spec_parse(p->tc.model, &spec, e)) return rumor_err_prefix(e, "--model");
    if (model_tp_check(&spec, p->tp_size, e)) return rumor_err_prefix(e, "--tp %s", pf->tp);
  }
  return comm_addrs_usage(p, p->member, "of the group", which, val, e);
}

/* A stage process's member and rank in its stage, for log and run names:
 * "m1" (data-parallel member 1), "t0" (tensor-parallel rank 0) or both,
 * "m1t0". */
static void member_tag(const struct stage_proc *p, char *buf, size_t n) {
  if (p->dp_size > 1 && p->tp_size > 1) snprintf(buf, n, "m%dt%d", p->dp_rank, p->tp_rank);
  else snprintf(buf, n, "%c%d", p->tp_size > 1 ? 't' : 'm', p->tp_size > 1 ? p->tp_rank : p->dp_rank);
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
                      "the same training options and identity. With --dp r/D or --tp t/T inside a stage,\n"
                      "the process averages its shard of the stage (its piece of its slices) with the same\n"
                      "process of other groups, given --listen or --bootstrap (gossip, NoLoCo, DiLoCo or\n"
                      "every step's gradient), else trains alone. `rumor group`\n"
                      "starts all stages of a group on one host. A stage that fails or vanishes stops its\n"
                      "whole group.");
  *done = true;
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  group_flags_finish(&p->f, specs);
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
      gossip_flags_setup(&p->f.gossip, specs, &p->mb.setup, &e) || check_link_addrs(&p->f.pipe, &e) ||
      net_flags_check(&p->f.net, p->f.gossip.servers, p->mb.setup.sync.kind != SYNC_PS, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  p->dp_size = p->tp_size = 1;
  if ((p->f.pipe.dp && group_dp_parse("dp", p->f.pipe.dp, &p->dp_rank, &p->dp_size, &e)) ||
      (p->f.pipe.tp && group_dp_parse("tp", p->f.pipe.tp, &p->tp_rank, &p->tp_size, &e))) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  /* A data- or tensor-parallel group trains alone unless it is told where
   * to listen for other groups or whom to join. */
  p->averages = p->f.net.bootstrap || args_given(specs, "listen");
  if (dp_usage(p, stage, stages, &e)) {
    fprintf(stderr, "rumor peer: %s\n", e.msg);
    return 2;
  }
  if (stage > 0 && !p->f.pipe.link_prev) {
    fprintf(stderr, "rumor peer: stage %d/%d needs --link-prev HOST:PORT (the previous stage's link address)\n", stage,
            stages);
    return 2;
  }
  char name[96], tag[32];
  member_tag(p, tag, sizeof tag);
  if (p->in_stages)
    snprintf(name, sizeof name, "%s:s%d%s", p->f.gossip.name ? p->f.gossip.name : p->st.group, stage, tag);
  else if (p->members > 1)
    snprintf(name, sizeof name, "%s:m%d", p->f.gossip.name ? p->f.gossip.name : p->st.group, p->member);
  else
    snprintf(name, sizeof name, "%s:s%d", p->f.gossip.name ? p->f.gossip.name : p->st.group, stage);
  log_set_name(name);
  *done = false;
  return 0;
}

/* --expert-parallel P: the member's run of P (data-parallel ranks with the
 * same rank / P) splits the experts, over a sub-communicator of its own. */
static void start_experts(struct stage_proc *p) {
  int P = (int)p->f.pipe.expert_parallel, members[MODEL_EP_MAX], first = p->dp_rank / P * P;
  if (P == 1) return;
  for (int j = 0; j < P; j++) members[j] = first + j;
  p->ep_comm = comm_sub(p->dp.comm, members, P, 3);
  p->dp.experts = p->ep_comm;
}

/* Starts listening for (and dialing) the other data-parallel members; they
 * must all agree on the run and the ZeRO stage (they connect in join). */
static int start_comm(struct stage_proc *p, struct rumor_err *e) {
  char agree[STAGE_LINK_AGREE_MAX + 1], text[STAGE_LINK_AGREE_MAX + 64];
  train_stage_agreement(&p->tc, &p->plan, agree, sizeof agree);
  snprintf(text, sizeof text, "%s zero=%lld experts=%lld stage=%d/%d", agree, (long long)p->f.pipe.zero,
           (long long)p->f.pipe.expert_parallel, p->st.stage, p->st.stages);
  /* Inside a pipeline, one communicator per stage: its D members, with
   * keys of their own (stage x D + r), so no stage admits another's. */
  int rank = p->in_stages ? p->stage_rank : p->member, size = p->in_stages ? p->per_stage : p->members;
  const char *peers[COMM_MAX_MEMBERS];
  for (int j = 0; j < rank; j++) peers[j] = p->peer_addrs[j];
  struct comm_net_config cc = {.identity = &p->keys.identity,
                               .cluster_key = p->keys.cluster_key,
                               .group = p->st.group,
                               .agreement = text,
                               .rank = rank,
                               .size = size,
                               .key_base = p->in_stages ? p->st.stage * p->per_stage : 0,
                               .listen = p->f.pipe.comm_listen,
                               .peers = peers,
                               .connect_timeout_ms = (uint32_t)p->f.pipe.link_wait_ms,
                               .heartbeat_ms = (uint32_t)p->f.net.heartbeat_ms,
                               .dead_after_ms = (uint32_t)p->f.net.dead_after_ms,
                               .stop = signals_stop_flag()};
  int rc = comm_net_start(&p->comm, &cc, e);
  if (rc) return rumor_err_prefix(e, "process %d/%d of the group", p->member, p->members);
  /* The processes of one data-parallel member (its tensor-parallel ranks),
   * and those holding the same slices in every member: of the group, or
   * inside a pipeline of the stage (its communicator's ranks are the same
   * r x T + t). */
  int tp_members[COMM_MAX_MEMBERS], dp_members[COMM_MAX_MEMBERS];
  for (int j = 0; j < p->tp_size; j++) tp_members[j] = p->dp_rank * p->tp_size + j;
  for (int j = 0; j < p->dp_size; j++) dp_members[j] = j * p->tp_size + p->tp_rank;
  if (p->tp_size > 1) {
    p->tp_comm = p->dp_size > 1 ? comm_sub(p->comm, tp_members, p->tp_size, 1) : p->comm;
    p->tp = (struct train_tp){.comm = p->tp_comm, .all = p->comm};
    p->tc.tp = &p->tp;
  }
  if (p->dp_size > 1) {
    p->dp_comm = p->tp_size > 1 ? comm_sub(p->comm, dp_members, p->dp_size, 2) : p->comm;
    p->dp = (struct train_dp){.comm = p->dp_comm, .zero = (int)p->f.pipe.zero, .lazy_gather = p->averages};
    p->tc.dp = &p->dp;
    start_experts(p);
  }
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
  if (p->f.train.tensorboard) {
    char run[96]; /* named like the stage's log lines (a stage's members or ranks apart) */
    const char *who = p->f.gossip.name ? p->f.gossip.name : p->st.group;
    char tag[32];
    member_tag(p, tag, sizeof tag);
    if (p->in_stages)
      snprintf(run, sizeof run, "%s:s%d%s", who, p->st.stage, tag);
    else
      snprintf(run, sizeof run, "%s:s%d", who, p->st.stage);
    if ((rc = tb_train_open(&p->tb, p->f.train.tensorboard, run, e))) return rc;
  }
  /* A stage's data-parallel members: their communicator first (the
   * trainer takes its members), connecting meanwhile; they meet in run. */
  if (p->in_stages && (rc = start_comm(p, e))) return rc;
  if ((rc = trainer_init(&p->t, &p->tc, e))) return rc;
  p->have_trainer = true;
  tb_train_attach(&p->tb, &p->t, &p->mb);
  char label[256];
  if ((rc = train_stage_label(&p->tc, &p->plan, label, sizeof label, e))) return rc;
  if (p->in_stages) { /* process r of stage s meets process r of stage s of other groups only */
    size_t len = strlen(label);
    int w = snprintf(label + len, sizeof label - len, " dp %d/%d tp %d/%d", p->dp_rank, p->dp_size, p->tp_rank,
                     p->tp_size);
    if (w < 0 || (size_t)w >= sizeof label - len)
      return rumor_err_set(e, RUMOR_ETOOBIG, "the stage process's gossip label is over %zu characters",
                           sizeof label - 1);
  }
  json_t *extra = json_object();
  json_text_set(extra, "group", json_text_str(p->st.group));
  json_text_set(extra, "stage", json_integer(p->st.stage));
  if (p->in_stages) json_text_set(extra, "member", json_integer(p->member)); /* process stage x N + r */
  json_text_set(extra, "cluster", json_text_str(label));
  rc = member_start(&p->mb, &p->t, &p->f.net, &p->keys, &p->f.gossip, label, p->tc.seed + (uint64_t)p->st.stage, "stage",
                    extra, e);
  json_decref(extra);
  if (rc) return rc;
  char agree[STAGE_LINK_AGREE_MAX + 1], text[STAGE_LINK_AGREE_MAX + 64];
  /* The trainer's run: a resumed one's batch, seeds and shard are its checkpoint's. */
  train_stage_agreement(&p->t.cfg, &p->t.plan, agree, sizeof agree);
  /* Process r of each stage links to process r of the next: the
   * neighbours must split the batch, or the layers, alike. */
  snprintf(text, sizeof text, "%s data-parallel=%d/%d tensor-parallel=%d/%d zero=%lld", agree, p->dp_rank, p->dp_size,
           p->tp_rank, p->tp_size, (long long)p->f.pipe.zero);
  const struct pipe_flags *pf = &p->f.pipe;
  struct stage_link_config lc = {.identity = &p->keys.identity,
                                 .cluster_key = p->keys.cluster_key,
                                 .host = p->mb.g,
                                 .group = p->st.group,
                                 .stage = p->st.stage,
                                 .stages = p->st.stages,
                                 .listen = pf->link_listen,
                                 .prev = pf->link_prev,
                                 .agreement = text,
                                 .in_width = model_act_width(&p->t.model, p->plan.u0),
                                 .out_width = model_act_width(&p->t.model, p->plan.u1),
                                 .max_rows = p->t.plan.mb_rows, /* a data-parallel member's: of its slice */
                                 /* a tensor-parallel rank's widths and tied slice: rank t's, as its neighbours' */
                                 .tied_floats = pipeline_tied_floats(&p->t.model, p->st.stages),
                                 .wire = p->mb.setup.wire,
                                 .connect_timeout_ms = (uint32_t)pf->link_wait_ms,
                                 .idle_timeout_ms = (uint32_t)pf->link_timeout_ms,
                                 .heartbeat_ms = (uint32_t)p->f.net.heartbeat_ms,
                                 .dead_after_ms = (uint32_t)p->f.net.dead_after_ms,
                                 .stop = signals_stop_flag()};
  if ((rc = stage_link_start(&p->link, &lc, e))) return rc;
  trainer_set_link(&p->t, p->link);
  json_t *o = open_line(p);
  json_text_set(o, "stages", json_integer(p->st.stages));
  json_text_set(o, "pid", json_integer(getpid()));
  json_text_set(o, "link", json_text_str(stage_link_address(p->link)));
  if (p->in_stages) {
    json_text_set(o, "member", json_integer(p->member));
    json_text_set(o, "comm", json_text_str(comm_net_address(p->comm)));
  }
  json_text_print(stdout, o);
  return 0;
}

/* --sync ps: takes this stage's slice and clock from its servers (the
 * scheme's join, once it started: member_ready). Every stage of the group
 * must be at the same step: stage 0's position is passed on, and a stage
 * whose servers have it elsewhere stops the group. */
static int join_servers(struct stage_proc *p, struct stage_link_pos *lp, struct rumor_err *e) {
  struct trainer *t = &p->t;
  ps_worker_net(&p->f.net, &p->keys, &p->f.gossip, &p->mb.setup.sync);
  int rc = member_ready(&p->mb, t, e);
  if (rc || (rc = sync_join(&p->mb.sync, e))) return rc;
  *lp = (struct stage_link_pos){t->st.step, t->st.epoch, t->st.samples};
  log_info("took stage %d's slice from its servers at step %lld", p->st.stage, (long long)t->st.step);
  if (p->st.stage == 0) return 0;
  int64_t own = t->st.step;
  if ((rc = stage_link_recv_start(p->link, lp, e))) return rc;
  if (lp->step != own)
    return rumor_err_set(e, RUMOR_EPROTO,
                         "stage %d's servers have this group at step %lld but stage 0's at step %lld: the stages' "
                         "servers were restarted from checkpoints of different rounds",
                         p->st.stage, (long long)own, (long long)lp->step);
  return 0;
}

/* Stage 0's position wins down the links: every stage must run the same
 * steps. `recv`: take stage 0's position from the previous stage (a stage
 * past the first; --sync ps's join has taken it already). A stage that
 * resumed its own state (own_state) must be at that step already. Sets the
 * trainer's position (unless own_state) and passes it on. */
static int pass_position(struct stage_proc *p, struct stage_link_pos *lp, bool own_state, bool recv,
                         struct rumor_err *e) {
  struct trainer *t = &p->t;
  int64_t own = lp->step;
  int rc;
  if (recv && p->st.stage > 0 && (rc = stage_link_recv_start(p->link, lp, e))) return rc;
  if (own_state && lp->step != own)
    return rumor_err_set(e, RUMOR_ESHAPE,
                         "stage %d resumed at step %lld from %s, but stage 0 at step %lld: the stages' checkpoints "
                         "are of different steps (one fell back to its .prev?); resume from files of one save",
                         p->st.stage, (long long)own, t->resumed_from, (long long)lp->step);
  if (!own_state) trainer_set_position(t, lp->step, lp->epoch, lp->samples);
  if ((rc = stage_link_send_start(p->link, lp, e))) return rc;
  if (lp->step > 0)
    log_info("the group continues from step %lld (epoch %lld)", (long long)lp->step, (long long)lp->epoch + 1);
  return 0;
}

static int in_stage_join(struct stage_proc *p, struct rumor_err *e);

/* Joins the stage's cluster (taking a live stage's state when there is
 * one), or its servers, then agrees on the starting position with the
 * other stages. */
static int join(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  int rc = stage_link_wait_ready(p->link, e);
  if (rc) return rc;
  if (p->in_stages && p->averages) return in_stage_join(p, e);
  struct stage_link_pos lp = {0, 0, 0};
  int64_t shard_step = t->st.step; /* of the slice this stage holds */
  if (p->mb.setup.sync.kind == SYNC_PS) {
    if ((rc = join_servers(p, &lp, e)) || (rc = pass_position(p, &lp, false, false, e))) return rc;
  } else {
    struct gossip_train_pos pos;
    /* A resumed group keeps its own state, as a resumed peer does. */
    bool resumed = p->tc.resume != NULL, own_state = false;
    int jr = member_join(&p->mb, t, &p->f.gossip, resumed, &pos, e);
    if (jr < 0) return jr;
    if (jr == 0) {
      lp = (struct stage_link_pos){(int64_t)pos.step, (int64_t)pos.epoch, (int64_t)pos.samples};
      shard_step = (int64_t)pos.step;
      log_info("took stage %d's state from the cluster at step %llu (epoch %llu)", p->st.stage,
               (unsigned long long)pos.step, (unsigned long long)pos.epoch + 1);
    } else if (resumed) { /* position and data order are already its checkpoint's */
      lp = (struct stage_link_pos){t->st.step, t->st.epoch, t->st.samples};
      own_state = true;
    } else {
      log_info("starting from our own initialisation");
    }
    if ((rc = pass_position(p, &lp, own_state, true, e))) return rc;
  }
  if (!p->mb.have_sync && (rc = member_ready(&p->mb, t, e))) return rc;
  stage_link_set_idle(p->link, sync_idle, &p->mb.sync);
  /* Every step's gradient: the stages' slices, taken from different
   * groups' stages, go on from one step. */
  return trainer_group_join_converge(t, shard_step, e);
}

static int shard_train(struct stage_proc *p, double *secs, int64_t *steps, bool *stale, struct rumor_err *e);
static int shard_finish(struct stage_proc *p, double secs, int64_t steps, bool *stale, struct rumor_err *e);

static bool link_failed(void *arg, struct rumor_err *e) {
  struct stage_proc *p = arg;
  char why[400];
  int culprit;
  if (!(p->link && stage_link_failed(p->link, &culprit, why, sizeof why)) &&
      !(p->comm && comm_failed(p->comm, &culprit, why, sizeof why)))
    return false;
  rumor_err_set(e, RUMOR_ECANCELED, "%s", why);
  return true;
}

static int run(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  int rc;
  if (p->in_stages) {
    if ((rc = comm_wait_ready(p->comm, e))) return rc;
    if (p->tp_size > 1)
      log_info("stage %d/%d, tensor-parallel rank %d/%d: all %d ranks of the stage connected", p->st.stage,
               p->st.stages, p->tp_rank, p->tp_size, p->tp_size);
    else
      log_info("stage %d/%d, data-parallel member %d/%d: all %d members of the stage connected (ZeRO %lld)",
               p->st.stage, p->st.stages, p->dp_rank, p->dp_size, p->dp_size, (long long)p->f.pipe.zero);
  }
  if ((rc = member_wait_peers(&p->mb, &p->f.gossip, "groups", link_failed, p, e))) return rc;
  /* Members or ranks in the stages that average with other groups make
   * their stage's copies whole again after every change (shard_train). */
  bool shards = p->in_stages && p->averages;
  if (shards && (rc = trainer_group_resync(t, p->mb.sync.changes > 0, NULL, e))) return rc;
  int64_t s0 = t->st.samples, steps;
  double secs;
  bool stale = false; /* shards: a change after the last step's checkpoint */
  rc = shards ? shard_train(p, &secs, &steps, &stale, e) : member_train(&p->mb, t, &secs, &steps, e);
  if (rc) return rc;
  if (signals_stop_requested())
    return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
  /* The same stage of groups still training is not left alone (the links
   * keep pinging meanwhile; our neighbours wait for us in the evaluation).
   * A neighbour that fails meanwhile ends the wait and the group. The
   * stage's copies then agree bit for bit (shard_finish checks too). */
  if (shards) rc = shard_finish(p, secs, steps, &stale, e);
  else if ((rc = member_finish(&p->mb, t, secs, steps, link_failed, p, e)) == 0 && p->in_stages)
    rc = trainer_group_check(t, e);
  if (rc || (rc = trainer_evaluate(t, e))) return rc;
  if (stale && (rc = trainer_checkpoint(t, e))) return rc; /* the result line's parameters */
  print_result(p, secs, s0);
  return 0;
}

/* ---- a data- or tensor-parallel member ---- */

/*
 * A data- or tensor-parallel process (--dp r/D or --tp t/T) holds its
 * slices of the model (a tensor-parallel rank) and trains on its slice of
 * every batch (a data-parallel member); its group's processes talk over
 * the communicator. With --bootstrap or --listen the group averages with
 * other groups shard by shard (issue #31): each process runs a gossip
 * member over its shard (trainer_shard_params: a rank's slices, or a ZeRO
 * piece of them) that meets only the process holding the same shard in
 * other groups (the label says which), and after every step the group
 * makes its copies whole and equal again (trainer_group_resync). Without
 * either it trains alone, with no gossip runtime and no gossip buffers.
 */

/* The gossip label of a shard: e.g. "gpt:... shard dp 1/2 tp 0/2", and
 * " ep 1/2" for an expert-parallel member. */
static int shard_label(const struct stage_proc *p, char *buf, size_t n, struct rumor_err *e) {
  char spec[MODEL_SPEC_MAX];
  model_spec_format(&p->plan.spec, spec, sizeof spec);
  int w = snprintf(buf, n, "%s shard dp %d/%d tp %d/%d", spec, p->dp_rank, p->dp_size, p->tp_rank, p->tp_size);
  int P = (int)p->f.pipe.expert_parallel; /* experts: the run's rank, which `rumor top` shows on the part line */
  if (P > 1 && w >= 0 && (size_t)w < n) w += snprintf(buf + w, n - (size_t)w, " ep %d/%d", p->dp_rank % P, P);
  if (w < 0 || (size_t)w >= n)
    return rumor_err_set(e, RUMOR_ETOOBIG, "the shard's gossip label for %s is over %zu characters", spec, n - 1);
  return 0;
}

/* Starts the gossip member of this process's shard. */
static int shard_start(struct stage_proc *p, struct rumor_err *e) {
  char label[256];
  int rc = shard_label(p, label, sizeof label, e);
  if (rc) return rc;
  json_t *extra = json_object();
  json_text_set(extra, "group", json_text_str(p->st.group));
  json_text_set(extra, "member", json_integer(p->member));
  json_text_set(extra, "members", json_integer(p->members));
  json_text_set(extra, "cluster", json_text_str(label));
  rc = member_start(&p->mb, &p->t, &p->f.net, &p->keys, &p->f.gossip, label, p->tc.seed + (uint64_t)p->member, "shard",
                    extra, e);
  json_decref(extra);
  return rc;
}

/* Loads the keys, starts the communicator, builds the trainer (and, when
 * the group averages, its shard's gossip member) and prints the address
 * line the launcher passes to the members above this one. */
static int dp_prepare(struct stage_proc *p, struct rumor_err *e) {
  int rc = net_flags_load_keys(&p->f.net, &p->keys, e);
  if (rc) return rc;
  p->have_keys = true;
  if (p->f.train.tensorboard) {
    char run[96];
    snprintf(run, sizeof run, "%s:m%d", p->f.gossip.name ? p->f.gossip.name : p->st.group, p->member);
    if ((rc = tb_train_open(&p->tb, p->f.train.tensorboard, run, e))) return rc;
  }
  if ((rc = start_comm(p, e))) return rc;
  if ((rc = trainer_init(&p->t, &p->tc, e))) return rc;
  p->have_trainer = true;
  if (p->averages && (rc = shard_start(p, e))) return rc;
  tb_train_attach(&p->tb, &p->t, p->averages ? &p->mb : NULL);
  json_t *o = open_line(p);
  json_text_set(o, "stages", json_integer(p->st.stages));
  json_text_set(o, "pid", json_integer(getpid()));
  json_text_set(o, "member", json_integer(p->member));
  json_text_set(o, "comm", json_text_str(comm_net_address(p->comm)));
  json_text_print(stdout, o);
  return 0;
}

/* The latest position any process of the communicator (the group's, or
 * the stage's) pulled: use = {1, step, epoch, samples}, or use[0] = 0
 * when none pulled. */
static int members_agree(struct stage_proc *p, bool pulled, const struct gossip_train_pos *pos, int64_t use[4],
                         struct rumor_err *e) {
  int64_t mine[4] = {pulled, (int64_t)pos->step, (int64_t)pos->epoch, (int64_t)pos->samples};
  memset(use, 0, 4 * sizeof *use);
  for (int j = 0; j < comm_size(p->comm); j++) {
    int64_t theirs[4];
    memcpy(theirs, mine, sizeof theirs);
    int rc = comm_broadcast(p->comm, j, theirs, sizeof theirs, e);
    if (rc) return rc;
    if (theirs[0] && (!use[0] || theirs[1] > use[1])) memcpy(use, theirs, 4 * sizeof *use);
  }
  if (pulled)
    log_info("took shard %d/%d's state from the cluster at step %llu (epoch %llu)", p->member, p->members,
             (unsigned long long)pos->step, (unsigned long long)pos->epoch + 1);
  return 0;
}

/* Each process pulls its shard's state from the same shard of a live
 * group (or keeps its own), and the group takes the latest position any
 * process pulled: every process must run the same steps, and the pulls,
 * each from its own donor, may have been served steps apart (the pieces
 * pulled earlier catch up by the sync path's next exchange or round). */
static int shard_join(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  struct gossip_train_pos pos = {0, 0, 0};
  int64_t own = t->st.step;
  /* A resumed group keeps its own state, as a resumed peer does. */
  int jr = member_join(&p->mb, t, &p->f.gossip, p->tc.resume != NULL, &pos, e);
  if (jr < 0) return jr;
  int64_t use[4];
  int rc = members_agree(p, jr == 0, &pos, use, e);
  if (rc) return rc;
  if (use[0]) {
    trainer_set_position(t, use[1], use[2], use[3]);
    log_info("the group continues from step %lld (epoch %lld)", (long long)use[1], (long long)use[2] + 1);
  }
  rc = member_ready(&p->mb, t, e);
  /* Every step's gradient: the shards, pulled from different processes,
   * go on from one step. */
  if (rc == 0) rc = trainer_group_join_converge(t, jr == 0 ? (int64_t)pos.step : own, e);
  /* A pulled shard, or an outer round due at the start, changed pieces. */
  if (rc == 0 && use[0]) rc = trainer_group_resync_state(t, e);
  if (rc == 0) rc = trainer_group_resync(t, jr == 0 || p->mb.sync.changes > 0, NULL, e);
  return rc;
}

/* A process of a pipelined group with members or ranks in its stages that
 * averages with other groups: it pulls its shard from the same process of
 * a live group, its stage's processes take the latest position any of
 * them pulled (members_agree), and stage 0's position wins down the
 * links, as a plain stage's does (join). */
static int in_stage_join(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  struct gossip_train_pos pos = {0, 0, 0};
  bool resumed = p->tc.resume != NULL;
  int64_t own = t->st.step;
  int jr = member_join(&p->mb, t, &p->f.gossip, resumed, &pos, e);
  if (jr < 0) return jr;
  int64_t use[4];
  int rc = members_agree(p, jr == 0, &pos, use, e);
  if (rc) return rc;
  bool own_state = resumed && !use[0]; /* resumed: position and data order are already its */
  struct stage_link_pos lp = {0, 0, 0};
  if (use[0]) lp = (struct stage_link_pos){use[1], use[2], use[3]};
  else if (own_state) lp = (struct stage_link_pos){t->st.step, t->st.epoch, t->st.samples};
  if ((rc = pass_position(p, &lp, own_state, true, e)) || (rc = member_ready(&p->mb, t, e))) return rc;
  stage_link_set_idle(p->link, sync_idle, &p->mb.sync);
  if ((rc = trainer_group_join_converge(t, jr == 0 ? (int64_t)pos.step : own, e))) return rc;
  if (use[0] && (rc = trainer_group_resync_state(t, e))) return rc;
  return trainer_group_resync(t, jr == 0 || p->mb.sync.changes > 0, NULL, e);
}

/* The training loop of a process whose group averages: a step, the sync
 * path's boundary, then the group's copies made whole again. *stale: a
 * change after the last step's checkpoint. */
static int shard_train(struct stage_proc *p, double *secs, int64_t *steps, bool *stale, struct rumor_err *e) {
  struct trainer *t = &p->t;
  struct sync *s = &p->mb.sync;
  double t0 = clock_now_s();
  int64_t step0 = t->st.step;
  uint64_t seen = s->changes;
  /* Every step's gradient between groups: a whole state donated between
   * the update and the resync would carry replicated parameters the ranks
   * have not averaged yet (a late group of tensor-parallel ZeRO 1 ranks
   * ended 6e-5 from the live one); what is asked meanwhile is served after
   * it. (Not for the schemes whose boundary runs rounds: a late process of
   * DiLoCo pulls outer states from processes waiting in those rounds.) */
  bool hold = t->reducer.reduce != NULL;
  int rc = 0;
  while (rc == 0 && !trainer_done(t) && !signals_stop_requested()) {
    if ((rc = trainer_step(t, e))) break;
    if (t->st.step == step0 + 1) log_info("first step: loss %.4f at step %lld", t->last_loss, (long long)t->st.step);
    sync_hold_state(s, hold);
    rc = sync_boundary(s, e);
    bool any = false;
    if (rc == 0) rc = trainer_group_resync(t, s->changes != seen, &any, e);
    sync_hold_state(s, false);
    if (rc) break;
    if (hold) sync_idle(s);
    seen = s->changes;
    if (trainer_done(t)) *stale = any;
  }
  *secs = clock_now_s() - t0;
  *steps = t->st.step - step0;
  return rc;
}

/* Averages on with the groups still training (--finish-wait-ms), makes
 * the copies whole, and checks that they agree. */
static int shard_finish(struct stage_proc *p, double secs, int64_t steps, bool *stale, struct rumor_err *e) {
  struct sync *s = &p->mb.sync;
  uint64_t before = s->changes;
  struct sync_finish_args f = {.max_s = p->mb.setup.finish_wait_s,
                               .step_s = steps > 0 ? secs / (double)steps : 0,
                               .stop = signals_stop_flag(),
                               .failed = link_failed,
                               .arg = p};
  int rc = sync_finish(s, &f, e);
  bool any;
  if (rc == 0) rc = trainer_group_resync(&p->t, s->changes != before, &any, e);
  if (rc == 0 && any) *stale = true;
  return rc ? rc : trainer_group_check(&p->t, e);
}

static int dp_run(struct stage_proc *p, struct rumor_err *e) {
  struct trainer *t = &p->t;
  int rc = comm_wait_ready(p->comm, e);
  if (rc) return rc;
  log_info("process %d/%d (data-parallel member %d/%d, tensor-parallel rank %d/%d): all %d members connected "
           "(ZeRO %lld)", p->member, p->members, p->dp_rank, p->dp_size, p->tp_rank, p->tp_size, p->members,
           (long long)p->f.pipe.zero);
  if (p->averages) {
    if ((rc = shard_join(p, e))) return rc;
    if ((rc = member_wait_peers(&p->mb, &p->f.gossip, "groups", link_failed, p, e))) return rc;
    /* Exchanges while waiting moved pieces. */
    if ((rc = trainer_group_resync(t, p->mb.sync.changes > 0, NULL, e))) return rc;
  }
  int64_t s0 = t->st.samples, steps = 0;
  double secs = 0;
  bool stale = false;
  if (p->averages) {
    rc = shard_train(p, &secs, &steps, &stale, e);
  } else {
    double t0 = clock_now_s();
    while (rc == 0 && !trainer_done(t) && !signals_stop_requested()) {
      if ((rc = trainer_step(t, e))) break;
      if (++steps == 1) log_info("first step: loss %.4f at step %lld", t->last_loss, (long long)t->st.step);
    }
    secs = clock_now_s() - t0;
  }
  if (rc) return rc;
  if (signals_stop_requested())
    return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
  if ((rc = p->averages ? shard_finish(p, secs, steps, &stale, e) : trainer_group_check(t, e))) return rc;
  if ((rc = trainer_evaluate(t, e))) return rc;
  /* The result line evaluates the parameters as they are now: so must the checkpoint. */
  if (stale && (rc = trainer_checkpoint(t, e))) return rc;
  char final[96];
  result_describe_final(t, final, sizeof final);
  log_info("final %s after %lld steps", final, (long long)t->st.step);
  json_t *o = open_line(p);
  json_text_set(o, "stages", json_integer(p->st.stages));
  json_text_set(o, "member", json_integer(p->member));
  if (p->tp_size > 1) json_text_set(o, "tensor_parallel", json_integer(p->tp_size));
  result_training(o, t, secs, s0);
  if (p->averages) {
    struct gossip_stats gs;
    gossip_stats_get(p->mb.g, &gs);
    sync_result(&p->mb.sync, &gs, o);
    json_text_set(o, "id", json_string(gossip_self_id(p->mb.g)));
  }
  result_print(o);
  return 0;
}

/* Ends the group after a failure: says which stage failed and why, and
 * tells the neighbours (they pass it on). A failure the link carries (a
 * neighbour's, or one passed on, or a neighbour that left) names that
 * stage; any other names this one. The line's failed_at_us (wall clock)
 * lets the launcher tell which of two stages that both failed on their own
 * failed first. Returns the exit status. */
static int stop_group(struct stage_proc *p, const struct rumor_err *e) {
  int64_t at_us = clock_wall_us();
  int me = p->st.stage, S = p->st.stages, N = p->per_stage;
  char why[400], said[400];
  /* The culprit as the launcher counts processes (a stage, or process k of
   * a data- or tensor-parallel group: stage x N + r inside a pipeline),
   * and the stage the links pass on. */
  int culprit = p->members > 1 ? p->member : me, link_stage = me;
  int member = -1;
  if (p->link && stage_link_failed(p->link, &link_stage, why, sizeof why)) {
    /* A neighbour's failure, or one passed on to us: inside a pipeline
     * with members, the neighbour in our own column. */
    culprit = p->in_stages ? link_stage * N + p->stage_rank : link_stage;
  } else if (p->comm && comm_failed(p->comm, &member, said, sizeof said)) {
    if (p->in_stages) { /* a member of our stage */
      culprit = me * N + member;
      snprintf(why, sizeof why, "stage %d/%d: %.380s", me, S, said);
    } else { /* a data-parallel group has one stage: the launcher counts its members */
      culprit = member;
      snprintf(why, sizeof why, "%s", said);
    }
  } else if (signals_stop_requested()) {
    snprintf(why, sizeof why, "stage %d/%d stopped on signal %d", me, S, signals_stop_requested());
  } else if (p->in_stages) {
    snprintf(why, sizeof why, "stage %d/%d %s %d/%d failed: %.340s", me, S, p->tp_size > 1 ? "rank" : "member",
             p->stage_rank, N, e->msg);
  } else if (p->members > 1) {
    snprintf(why, sizeof why, "member %d/%d failed: %.360s", p->member, p->members, e->msg);
  } else {
    snprintf(why, sizeof why, "stage %d/%d failed: %.360s", me, S, e->msg);
  }
  if (p->link) stage_link_abort(p->link, link_stage, why);
  if (p->comm) comm_abort(p->comm, why);
  /* For the launcher (and schedulers): which stage took the group down. */
  json_t *o = open_line(p);
  json_text_set(o, "failed_stage", json_integer(culprit));
  json_text_set(o, "stopped", json_boolean(signals_stop_requested() != 0));
  json_text_set(o, "error", json_text_str(why));
  json_text_set(o, "failed_at_us", json_integer(at_us));
  result_print(o);
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
  int rc;
  if (p->members > 1 && !p->in_stages) {
    rc = dp_prepare(p, &e);
    if (rc == 0) rc = dp_run(p, &e);
  } else {
    rc = prepare(p, &e);
    if (rc == 0) rc = join(p, &e);
    if (rc == 0) rc = run(p, &e);
  }
  /* A failure, even before the links exist, is reported as the group's
   * (the launcher names the stage that failed). */
  status = rc == 0 ? 0 : stop_group(p, &e);
  /* The links first: they ride on the gossip runtime's event loop. */
  stage_link_close(p->link, 10000);
  member_free(&p->mb, p->f.net.linger_ms);
  tb_train_close(&p->tb);
  if (p->have_trainer) trainer_free(&p->t);
  /* After the trainer: it used them to the end. */
  if (p->ep_comm) comm_free(p->ep_comm, 0);
  if (p->dp_comm != p->comm) comm_free(p->dp_comm, 0);
  if (p->tp_comm != p->comm) comm_free(p->tp_comm, 0);
  comm_free(p->comm, 10000);
  if (p->have_keys) net_keys_free(&p->keys);
  return status;
}
