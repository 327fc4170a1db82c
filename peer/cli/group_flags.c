/* The options of `rumor group` and of its stage processes: the pipeline's
 * own, and the training, cluster and gossip tables shared with `rumor
 * peer`. */
#include <string.h>

#include "peer/cli/cli_impl.h"

void group_flags_default(struct group_flags *f) {
  memset(f, 0, sizeof *f);
  train_flags_default(&f->train);
  net_flags_default(&f->net);
  gossip_flags_default(&f->gossip);
  struct pipe_flags *p = &f->pipe;
  p->schedule = "gpipe";
  p->micro = 4;
  p->link_wait_ms = 120000;
  p->link_timeout_ms = 10000;
  p->link_listen = "127.0.0.1:0";
  p->stages = 1;
  p->data_parallel = 1;
  p->tensor_parallel = 1;
  p->expert_parallel = 1;
  p->comm_listen = "127.0.0.1:0";
}

static void add(struct arg_spec *specs, size_t *n, const struct arg_spec *s) {
  RUMOR_ASSERT(*n + 1 < GROUP_FLAGS_MAX_SPECS);
  specs[(*n)++] = *s;
}

/* The pipeline's own options. */
static void pipe_flags_specs(struct pipe_flags *f, enum flags_for who, struct arg_spec *specs, size_t *n) {
  if (who == FLAGS_LAUNCHER) {
    const struct arg_spec own[] = {
        {"stages", ARG_INT, &f->stages, "S", "stage processes in the group (each holds a contiguous run of units)", 1,
         PIPE_MAX_STAGES},
        {"devices", ARG_STR, &f->devices, "D0,D1,...",
         "one device per stage (cpu, cuda:N; one name alone: every stage on it; default: cuda:s for each stage when "
         "there are S GPUs, else cpu)"},
        {"data-parallel", ARG_INT, &f->data_parallel, "D",
         "member processes that split every batch (see --zero); with --stages S, D members in each stage (S x D "
         "processes)", 1, COMM_MAX_MEMBERS},
        {"tensor-parallel", ARG_INT, &f->tensor_parallel, "T",
         "processes that split every layer (Megatron: attention by heads, the MLP by columns then rows, the "
         "vocabulary); with --data-parallel D, each member is T of them (T x D processes); with --stages S, T ranks "
         "in each stage (S x T processes, S x D x T with --data-parallel D)",
         1, COMM_MAX_MEMBERS},
    };
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) add(specs, n, &own[i]);
    const struct arg_spec ep = {"expert-parallel", ARG_INT, &f->expert_parallel, "P",
                                "processes that split a mixture-of-experts model's experts, each on its own slice of "
                                "every batch, its tokens sent to their experts' processes and back (an all-to-all "
                                "inside each block); with --data-parallel D, D x P processes (runs of P split the "
                                "experts; all of them sum their gradients); with --stages S, D x P in each stage",
                                1, MODEL_EP_MAX};
    add(specs, n, &ep);
  } else {
    const struct arg_spec own[] = {
        {"stage", ARG_STR, &f->stage, "s/S", "this process is stage s of S of the group (required)"},
        {"link-listen", ARG_STR, &f->link_listen, "HOST:PORT", "address the next stage dials (port 0: any free port)"},
        {"link-prev", ARG_STR, &f->link_prev, "HOST:PORT", "the previous stage's --link-listen address (not on stage 0)"},
        {"dp", ARG_STR, &f->dp, "r/D", "this process is in data-parallel member r of D of its stage (default 0/1)"},
        {"tp", ARG_STR, &f->tp, "t/T", "this process is tensor-parallel rank t of T of its member (default 0/1)"},
        {"expert-parallel", ARG_INT, &f->expert_parallel, "P",
         "the --dp members, in runs of P (members r with the same r / P), split the model's experts", 1,
         MODEL_EP_MAX},
        {"comm-listen", ARG_STR, &f->comm_listen, "HOST:PORT",
         "address the data-parallel members above this one dial (port 0: any free port)"},
        {"comm-peers", ARG_STR, &f->comm_peers, "A0,A1,...",
         "the --comm-listen addresses of the group's processes 0 .. k-1, where k = r x T + t (with --stage s/S, S > 1: "
         "of its stage's processes 0 .. k-1, k = r or t) (required for k > 0)"},
    };
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) add(specs, n, &own[i]);
  }
  const struct arg_spec pipe[] = {
      {"group", ARG_STR, &f->group, "NAME",
       who == FLAGS_LAUNCHER ? "the group's name, in logs and checked between stages (default: group-PID)"
                             : "the group's name, the same for all its stages (required)"},
      {"micro-batches", ARG_INT, &f->micro, "M", "micro-batches per step, pipelined through the stages", 1, PIPE_MAX_MICRO},
      {"pipeline", ARG_STR, &f->schedule, "NAME",
       "pipeline schedule: gpipe, or 1f1b (stores at most S-s micro-batches of activations instead of M)"},
      {"zero", ARG_INT, &f->zero, "Z",
       "ZeRO stage of the data-parallel members: 0 nothing sharded, 1 optimizer state, 2 and gradients, 3 and "
       "parameters (gathered per unit as they are needed); 0 or 1 with --stages > 1; default 0, or 1 with "
       "--expert-parallel (at 1 to 3 a member holds whole only the experts it runs; 0 keeps every expert everywhere)",
       0, 3},
      {"link-wait-ms", ARG_INT, &f->link_wait_ms, "MS", "neighbouring stages must connect within this", 100, 86400000},
      {"link-timeout-ms", ARG_INT, &f->link_timeout_ms, "MS", "a neighbouring stage silent this long is lost", 1000,
       3600000},
  };
  for (size_t i = 0; i < sizeof pipe / sizeof pipe[0]; i++) add(specs, n, &pipe[i]);
}

void group_flags_specs(struct group_flags *f, enum flags_for who, struct arg_spec *specs) {
  RUMOR_ASSERT(who == FLAGS_LAUNCHER || who == FLAGS_STAGE);
  size_t n = 0;
  pipe_flags_specs(&f->pipe, who, specs, &n);
  train_flags_specs(&f->train, who, specs, &n, GROUP_FLAGS_MAX_SPECS - 1);
  net_flags_specs(&f->net, who, true, specs, &n, GROUP_FLAGS_MAX_SPECS - 1);
  gossip_flags_specs(&f->gossip, who, specs, &n, GROUP_FLAGS_MAX_SPECS - 1);
  specs[n] = (struct arg_spec){0};
}

int group_stage_parse(const char *s, int *stage, int *stages, struct rumor_err *e) {
  const char *slash = s ? strchr(s, '/') : NULL;
  int64_t a, b;
  char first[24];
  if (!slash || (size_t)(slash - s) >= sizeof first)
    return rumor_err_set(e, RUMOR_EFORMAT, "--stage '%s': expected s/S, e.g. 0/2", s ? s : "");
  memcpy(first, s, (size_t)(slash - s));
  first[slash - s] = '\0';
  if (parse_i64(slash + 1, 1, PIPE_MAX_STAGES, &b) || parse_i64(first, 0, b - 1, &a))
    return rumor_err_set(e, RUMOR_EFORMAT, "--stage '%s': expected s/S with 0 <= s < S <= %d", s, PIPE_MAX_STAGES);
  *stage = (int)a;
  *stages = (int)b;
  return 0;
}

int group_dp_parse(const char *flag, const char *s, int *rank, int *size, struct rumor_err *e) {
  const char *slash = s ? strchr(s, '/') : NULL;
  int64_t a, b;
  char first[24];
  if (!slash || (size_t)(slash - s) >= sizeof first || parse_i64(slash + 1, 1, COMM_MAX_MEMBERS, &b))
    return rumor_err_set(e, RUMOR_EFORMAT, "--%s '%s': expected r/N with 0 <= r < N <= %d, e.g. 0/2", flag,
                         s ? s : "", COMM_MAX_MEMBERS);
  memcpy(first, s, (size_t)(slash - s));
  first[slash - s] = '\0';
  if (parse_i64(first, 0, b - 1, &a))
    return rumor_err_set(e, RUMOR_EFORMAT, "--%s '%s': expected r/N with 0 <= r < N <= %d, e.g. 0/2", flag, s,
                         COMM_MAX_MEMBERS);
  *rank = (int)a;
  *size = (int)b;
  return 0;
}

void group_flags_finish(struct group_flags *f, const struct arg_spec *specs) {
  if (f->pipe.expert_parallel > 1 && !args_given(specs, "zero")) f->pipe.zero = 1;
}

int group_flags_config(const struct group_flags *f, const struct arg_spec *specs, int stage, int stages,
                       struct train_config *cfg, struct train_stage *st, struct stage_plan *plan,
                       struct rumor_err *e) {
  int rc = train_flags_config(&f->train, specs, cfg, e);
  if (rc || (rc = stage_link_check_group(f->pipe.group, e))) return rc;
  cfg->model = f->train.model;
  if (f->train.resume || f->train.init_from) {
    const char *flag = f->train.resume ? "resume" : "init-from";
    if (!args_given(specs, "model"))
      return rumor_err_set(e, RUMOR_EFORMAT, "--%s in a group needs --model too: the group's processes agree on it "
                           "before any of them reads the weights (it is checked against them)", flag);
  }
  memset(st, 0, sizeof *st);
  st->group = f->pipe.group;
  st->stage = stage;
  st->stages = stages;
  st->micro = (int)f->pipe.micro;
  /* Data- and tensor-parallel processes run whole batches (their slices):
   * no micro-batches to check against the batch. */
  if (stages == 1 && (f->pipe.data_parallel > 1 || f->pipe.tensor_parallel > 1 || f->pipe.expert_parallel > 1 ||
                      f->pipe.dp || f->pipe.tp))
    st->micro = 1;
  if (pipe_schedule_parse(f->pipe.schedule, &st->sched))
    return rumor_err_set(e, RUMOR_EFORMAT, "--pipeline must be gpipe or 1f1b, not '%s'", f->pipe.schedule);
  cfg->stage = st;
  struct gossip_setup setup;
  if ((rc = gossip_flags_setup(&f->gossip, specs, &setup, e))) return rc;
  if (setup.sync.kind == SYNC_PS && (rc = ps_worker_check(&f->net, &f->gossip, e))) return rc;
  gossip_setup_train(&setup, cfg);
  return train_stage_plan(cfg, plan, e);
}

int group_shard_check(const struct group_flags *f, int D, int T, bool averages, struct rumor_err *e) {
  char which[48];
  if (T > 1) snprintf(which, sizeof which, "--tensor-parallel %d", T);
  else snprintf(which, sizeof which, "--data-parallel %d", D);
  if (f->gossip.servers)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s with --servers: a data- or tensor-parallel group with parameter "
                         "servers is not built yet", which);
  if (!averages) return 0;
  if (strcmp(f->gossip.sync, "ps") == 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s with --sync ps: data- or tensor-parallel groups average with other "
                         "groups by gossip (--sync gossip, with or without --outer: NoLoCo), by every step's gradient "
                         "over the ring (--sync allreduce) or by outer rounds over it (--sync allreduce --outer "
                         "sgd|nesterov: DiLoCo) so far", which);
  if (D > 1 && T > 1 && f->pipe.zero == 3)
    return rumor_err_set(e, RUMOR_EFORMAT, "--zero 3 with %s between groups: ZeRO 3 tensor-parallel ranks do not "
                         "hold their replicated parameters whole, which averaging needs; use --zero 2", which);
  return 0;
}

int group_stage_dp_check(const struct group_flags *f, int S, int D, int T, struct rumor_err *e) {
  if (S == 1 || D * T == 1) return 0;
  if (T > 1 && D == 1 && f->pipe.zero)
    return rumor_err_set(e, RUMOR_EFORMAT, "--zero %lld needs data-parallel members", (long long)f->pipe.zero);
  if (f->pipe.zero >= 2)
    return rumor_err_set(e, RUMOR_EFORMAT, "--zero %lld with --stages %d: ZeRO 2 and 3 shard the gradients, but a "
                         "pipeline stage accumulates its whole gradient over the micro-batches before its members sum "
                         "it; use --zero 0 or 1 (DeepSpeed, too, pairs pipeline parallelism with ZeRO 1 only)",
                         (long long)f->pipe.zero, S);
  /* With --bootstrap or --listen, process k averages with process k of
   * other groups: by gossip, NoLoCo, DiLoCo or every step's gradient, as a
   * data- or tensor-parallel group's processes do (group_shard_check's
   * refusals). */
  const char *what = NULL;
  if (f->gossip.servers) what = "--servers";
  else if (strcmp(f->gossip.sync, "ps") == 0) what = "--sync ps";
  if (what)
    return rumor_err_set(e, RUMOR_EFORMAT, "--%s %d with --stages %d: a pipelined group with %s inside its stages "
                         "trains alone or averages with other groups by gossip, with or without --outer (NoLoCo), by "
                         "every step's gradient (--sync allreduce) or by DiLoCo's rounds (--sync allreduce --outer) so "
                         "far; %s is not built for it yet",
                         D > 1 ? "data-parallel" : "tensor-parallel", D > 1 ? D : T, S,
                         D > 1 ? "data-parallel members" : "tensor-parallel ranks", what);
  return 0;
}

int group_ep_check(const struct group_flags *f, const struct model_spec *spec, int S, int D, int T, int64_t batch,
                   struct rumor_err *e) {
  int P = (int)f->pipe.expert_parallel;
  if (P == 1) return 0;
  if (T > 1)
    return rumor_err_set(e, RUMOR_EFORMAT, "--expert-parallel %d with --tensor-parallel %d: tensor-parallel ranks do "
                         "not take mixture-of-experts models yet", P, T);
  if (D % P != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "--expert-parallel %d: the %d data-parallel members (--dp r/%d) are not "
                         "runs of %d", P, D, D, P);
  if (model_ep_check(spec, P, e)) return rumor_err_prefix(e, "--expert-parallel %d", P);
  if (batch < D)
    return rumor_err_set(e, RUMOR_EFORMAT, "--expert-parallel %d: --batch %lld is smaller than the group's %d data- "
                         "and expert-parallel members, and each needs at least one row of every batch", P,
                         (long long)batch, D);
  /* Members whose slices make fewer micro-batches than others would skip
   * exchanges the others wait for. */
  if (S > 1 && batch / D < f->pipe.micro)
    return rumor_err_set(e, RUMOR_EFORMAT, "--expert-parallel %d with --stages %d: each of the %d members' slices of "
                         "--batch %lld (at least %lld rows) must fill the %lld micro-batches; use --micro-batches %lld "
                         "or fewer", P, S, D, (long long)batch, (long long)(batch / D), (long long)f->pipe.micro,
                         (long long)(batch / D));
  return 0;
}
