/* Options of `rumor group` and of its stage processes. */
#include "peer/cli/group_flags.h"

#include <string.h>

void group_flags_default(struct group_flags *f) {
  memset(f, 0, sizeof *f);
  train_flags_default(&f->train);
  net_flags_default(&f->net);
  f->every = 1;
  f->exchange_timeout_ms = 60000;
  f->linger_ms = 500;
  f->alpha = 0.5;
  f->max_distance = 10.0;
  f->wire = "f32";
  f->wait_peers_ms = 60000;
  f->sketch_k = 1024;
  f->schedule = "gpipe";
  f->micro = 4;
  f->link_wait_ms = 120000;
  f->link_timeout_ms = 10000;
  f->link_listen = "127.0.0.1:0";
  f->stages = 2;
}

static void add(struct arg_spec *specs, size_t *n, const struct arg_spec *s) {
  RUMOR_ASSERT(*n + 1 < GROUP_FLAGS_MAX_SPECS);
  specs[(*n)++] = *s;
}

void group_flags_specs(struct group_flags *f, enum group_flags_for who, struct arg_spec *specs) {
  size_t n = 0;
  if (who == GROUP_FLAGS_LAUNCHER) {
    const struct arg_spec own[] = {
        {"stages", ARG_INT, &f->stages, "S", "stage processes in the group (each holds a contiguous run of layers)", 1,
         PIPE_MAX_STAGES},
        {"devices", ARG_STR, &f->devices, "D0,D1,...",
         "one device per stage (cpu, cuda:N; one name alone: every stage on it; default: cuda:s for each stage when "
         "there are S GPUs, else cpu)"},
    };
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) add(specs, &n, &own[i]);
  } else {
    const struct arg_spec own[] = {
        {"stage", ARG_STR, &f->stage, "s/S", "this process is stage s of S of the group (required)"},
        {"link-listen", ARG_STR, &f->link_listen, "HOST:PORT", "address the next stage dials (port 0: any free port)"},
        {"link-prev", ARG_STR, &f->link_prev, "HOST:PORT", "the previous stage's --link-listen address (not on stage 0)"},
    };
    for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) add(specs, &n, &own[i]);
  }
  const struct arg_spec pipe[] = {
      {"group", ARG_STR, &f->group, "NAME",
       who == GROUP_FLAGS_LAUNCHER ? "the group's name, in logs and checked between stages (default: group-PID)"
                                   : "the group's name, the same for all its stages (required)"},
      {"micro-batches", ARG_INT, &f->micro, "M", "micro-batches per step, pipelined through the stages", 1, PIPE_MAX_MICRO},
      {"pipeline", ARG_STR, &f->schedule, "NAME",
       "pipeline schedule: gpipe, or 1f1b (stores at most S-s micro-batches of activations instead of M)"},
      {"link-wait-ms", ARG_INT, &f->link_wait_ms, "MS", "neighbouring stages must connect within this", 100, 86400000},
      {"link-timeout-ms", ARG_INT, &f->link_timeout_ms, "MS", "a neighbouring stage silent this long is lost", 1000,
       3600000},
  };
  for (size_t i = 0; i < sizeof pipe / sizeof pipe[0]; i++) add(specs, &n, &pipe[i]);

  struct arg_spec tmp[64];
  size_t tn = 0;
  train_flags_specs(&f->train, tmp, &tn, 64);
  for (size_t i = 0; i < tn; i++) {
    /* --device is --devices for the launcher; --resume is not supported for
     * groups. */
    if ((strcmp(tmp[i].name, "device") == 0 && who == GROUP_FLAGS_LAUNCHER) || strcmp(tmp[i].name, "resume") == 0) {
      continue;
    } else if (strcmp(tmp[i].name, "checkpoint") == 0) {
      tmp[i].help = "each stage saves its layers to FILE-stage<s> (X.safetensors: X-stage<s>.safetensors), each "
                    "epoch and at the end";
    } else if (strcmp(tmp[i].name, "threads") == 0 && who == GROUP_FLAGS_LAUNCHER) {
      tmp[i].help = "CPU threads per stage (0: the host's cores divided among the stages)";
    }
    add(specs, &n, &tmp[i]);
  }
  tn = 0;
  net_flags_specs(&f->net, true, tmp, &tn, 64);
  for (size_t i = 0; i < tn; i++) {
    if (who == GROUP_FLAGS_LAUNCHER) {
      if (strcmp(tmp[i].name, "listen") == 0)
        tmp[i].help = "gossip address of stage 0 (stage s: port + s; port 0: any free port)";
      else if (strcmp(tmp[i].name, "advertise") == 0)
        tmp[i].help = "address others dial for stage 0 (stage s: port + s)";
      else if (strcmp(tmp[i].name, "metrics") == 0)
        tmp[i].help = "serve stage 0's metrics here (stage s: port + s)";
      else if (strcmp(tmp[i].name, "bootstrap") == 0) {
        tmp[i].metavar = "L0;L1;...";
        tmp[i].help = "one address list per stage, separated by ';': stage s joins stage s of other groups through Ls";
      }
    } else if (strcmp(tmp[i].name, "bootstrap") == 0) {
      tmp[i].help = "addresses of this stage's cluster (stage s of other groups, or its bootstrap nodes)";
    }
    add(specs, &n, &tmp[i]);
  }
  const struct arg_spec gossip[] = {
      {"gossip-every", ARG_INT, &f->every, "N", "start an exchange every N steps (0: off)", 0, 1e12},
      {"gossip-interval", ARG_FLOAT, &f->interval, "SEC", "... or every SEC seconds (0: off)", 0, 1e6},
      {"alpha", ARG_FLOAT, &f->alpha, "X", "averaging weight: x <- (1-X) x + X x_partner", 1e-6, 1},
      {"wire", ARG_STR, &f->wire, "DTYPE", "parameters on the wire: f32, f16 or bf16"},
      {"max-distance", ARG_FLOAT, &f->max_distance, "R", "reject a partner farther than R times our norm", 1e-6, 1e12},
      {"exchange-timeout-ms", ARG_INT, &f->exchange_timeout_ms, "MS", "abandon an exchange after this long", 10,
       86400000},
      {"no-state-pull", ARG_FLAG, &f->no_state_pull, NULL, "start from our own seed instead of a live group's state"},
      {"linger-ms", ARG_INT, &f->linger_ms, "MS", "time to spread LEAVE on exit", 0, 60000},
      {"name", ARG_STR, &f->name, "NAME", "label for log lines (default: the group name and stage)"},
      {"wait-peers", ARG_INT, &f->wait_peers, "N", "start training once N groups (us included) are present", 0, 65536},
      {"wait-peers-ms", ARG_INT, &f->wait_peers_ms, "MS", "... waiting at most this long", 0, 86400000},
      {"sketch-k", ARG_INT, &f->sketch_k, "K", "count-sketch buckets for drift monitoring (a power of two)", 1, 65536},
  };
  for (size_t i = 0; i < sizeof gossip / sizeof gossip[0]; i++) add(specs, &n, &gossip[i]);
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

int group_flags_stage_config(const struct group_flags *f, const struct arg_spec *specs, int stage, int stages,
                             struct stage_config *out, struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  struct train_flags tf = f->train;
  int rc = train_flags_config(&tf, specs, &out->train, e);
  if (rc) return rc;
  out->train.model = f->train.model;
  out->group = f->group;
  out->stage = stage;
  out->stages = stages;
  out->micro = (int)f->micro;
  if (pipe_schedule_parse(f->schedule, &out->sched))
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--pipeline must be gpipe or 1f1b, not '%s'",
                         f->schedule);
  struct stage_plan plan;
  return stage_plan_make(out, &plan, e);
}

int group_flags_wire(const struct group_flags *f, enum net_dtype *out, struct rumor_err *e) {
  if (strcmp(f->wire, "f32") == 0) *out = NET_DTYPE_F32;
  else if (strcmp(f->wire, "f16") == 0) *out = NET_DTYPE_F16;
  else if (strcmp(f->wire, "bf16") == 0) *out = NET_DTYPE_BF16;
  else return rumor_err_set(e, RUMOR_EFORMAT, "--wire must be f32, f16 or bf16, not '%s'", f->wire);
  return 0;
}
