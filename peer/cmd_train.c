/* `rumor train`: one peer, no network. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "peer/args.h"
#include "peer/cli.h"
#include "peer/train.h"

static volatile sig_atomic_t g_stop; /* set by SIGINT/SIGTERM; read between steps */

static void on_signal(int sig) { g_stop = sig; }

/* Options shared by `train` and (later) `peer`: everything about one
 * replica's training. Fills `cfg` from the parsed values. */
struct train_flags {
  const char *model, *data, *device, *shard, *optimizer, *schedule, *checkpoint, *resume;
  int64_t threads, seed, data_seed, epochs, batch, max_steps, checkpoint_every, warmup;
  double lr, momentum, weight_decay, log_every;
  bool nesterov, no_eval, log_json;
};

int cmd_train(int argc, char **argv) {
  struct train_config cfg;
  train_config_default(&cfg);
  struct train_flags f = {
      .model = "mlp:784-512-256-10", .data = cfg.data_dir, .device = cfg.device, .shard = "0/1",
      .optimizer = "sgd", .schedule = "cosine", .threads = 0, .seed = 1, .data_seed = 1, .epochs = cfg.epochs,
      .batch = cfg.batch, .lr = cfg.optim.lr, .momentum = cfg.optim.momentum, .weight_decay = cfg.optim.weight_decay,
      .log_every = cfg.log_every_s,
  };
  const struct arg_spec specs[] = {
      {"model", ARG_STR, &f.model, "SPEC", "architecture, e.g. mlp:784-512-256-10 or mlp:784-256-10:gelu"},
      {"data", ARG_STR, &f.data, "DIR", "directory with train-/t10k- IDX files (plain or .gz)"},
      {"device", ARG_STR, &f.device, "DEV", "auto, cpu, cuda or cuda:N"},
      {"threads", ARG_INT, &f.threads, "N", "CPU threads (0: all cores)", 0, 4096},
      {"shard", ARG_STR, &f.shard, "I/N", "train on shard I of N of the training set"},
      {"seed", ARG_INT, &f.seed, "N", "seed for initialisation and shuffling", 0, 9007199254740991.0},
      {"data-seed", ARG_INT, &f.data_seed, "N", "seed of the shard split (same on every peer)", 0, 9007199254740991.0},
      {"epochs", ARG_INT, &f.epochs, "N", "passes over the shard", 1, 1000000},
      {"batch", ARG_INT, &f.batch, "N", "batch size", 1, 1048576},
      {"max-steps", ARG_INT, &f.max_steps, "N", "stop after N updates (0: no limit)", 0, 1e15},
      {"optimizer", ARG_STR, &f.optimizer, "NAME", "sgd or adamw"},
      {"lr", ARG_FLOAT, &f.lr, "X", "peak learning rate", 0, 1e6},
      {"momentum", ARG_FLOAT, &f.momentum, "X", "SGD momentum", 0, 1},
      {"nesterov", ARG_FLAG, &f.nesterov, NULL, "Nesterov momentum"},
      {"weight-decay", ARG_FLOAT, &f.weight_decay, "X", "weight decay", 0, 1e6},
      {"schedule", ARG_STR, &f.schedule, "NAME", "learning-rate schedule: cosine or constant"},
      {"warmup", ARG_INT, &f.warmup, "N", "linear warm-up steps", 0, 1e15},
      {"checkpoint", ARG_STR, &f.checkpoint, "FILE", "save a safetensors checkpoint here (each epoch and at the end)"},
      {"checkpoint-every", ARG_INT, &f.checkpoint_every, "N", "also save every N steps (0: off)", 0, 1e15},
      {"resume", ARG_STR, &f.resume, "FILE", "continue from a checkpoint (model, shard, seeds, position)"},
      {"log-every", ARG_FLOAT, &f.log_every, "SEC", "seconds between progress lines (0: off)", 0, 1e6},
      {"no-eval", ARG_FLAG, &f.no_eval, NULL, "skip the test-set evaluation after each epoch"},
      {"log-json", ARG_FLAG, &f.log_json, NULL, "log one JSON object per line"},
      {0},
  };
  int ar = args_parse(specs, argc, argv, "rumor train [options]",
                      "Trains one replica on its own (no network) and prints the final test accuracy\n"
                      "as JSON on stdout. Progress goes to stderr.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(f.log_json);

  struct rumor_err e = {0};
  if (shard_parse(f.shard, &cfg.shard, &e) || optim_kind_parse(f.optimizer, &cfg.optim.kind) ||
      optim_schedule_parse(f.schedule, &cfg.optim.schedule)) {
    if (!e.msg[0]) snprintf(e.msg, sizeof e.msg, "--optimizer must be sgd or adamw and --schedule cosine or constant");
    fprintf(stderr, "rumor train: %s\n", e.msg);
    return 2;
  }
  cfg.model = (f.resume && !args_given(specs, "model")) ? NULL : f.model;
  cfg.data_dir = f.data;
  cfg.device = f.device;
  cfg.threads = (int)f.threads;
  cfg.seed = (uint64_t)f.seed;
  cfg.data_seed = (uint64_t)f.data_seed;
  cfg.epochs = f.epochs;
  cfg.batch = f.batch;
  cfg.max_steps = f.max_steps;
  cfg.optim.lr = f.lr;
  cfg.optim.momentum = f.momentum;
  cfg.optim.nesterov = f.nesterov;
  cfg.optim.weight_decay = f.weight_decay;
  cfg.optim.warmup_steps = f.warmup;
  cfg.checkpoint = f.checkpoint;
  cfg.checkpoint_every = f.checkpoint_every;
  cfg.resume = f.resume;
  cfg.log_every_s = f.log_every;
  cfg.eval_each_epoch = !f.no_eval;

  struct trainer t;
  if (trainer_init(&t, &cfg, &e)) {
    fprintf(stderr, "rumor train: %s\n", e.msg);
    return 1;
  }
  struct sigaction sa;
  memset(&sa, 0, sizeof sa);
  sa.sa_handler = on_signal;
  sigaction(SIGINT, &sa, NULL);
  sigaction(SIGTERM, &sa, NULL);

  int status = 0;
  double t0 = clock_now_s();
  int64_t s0 = t.st.samples;
  while (!trainer_done(&t) && !g_stop) {
    if (trainer_step(&t, &e)) {
      fprintf(stderr, "rumor train: %s\n", e.msg);
      status = 1;
      break;
    }
  }
  double secs = clock_now_s() - t0;
  if (g_stop) {
    log_warn("interrupted by signal %d at step %lld", (int)g_stop, (long long)t.st.step);
    if (cfg.checkpoint && trainer_save(&t, cfg.checkpoint, &e)) fprintf(stderr, "rumor train: %s\n", e.msg);
    status = 130;
  }
  if (status == 0) {
    double acc = -1, loss = -1;
    if (t.have_test) trainer_evaluate(&t, &t.test, &acc, &loss);
    log_info("final test accuracy %.4f, test loss %.4f after %lld steps", acc, loss, (long long)t.st.step);
    printf("{\"test_accuracy\":%.6f,\"test_loss\":%.6f,\"steps\":%lld,\"epochs\":%lld,\"samples_per_s\":%.1f}\n", acc,
           loss, (long long)t.st.step, (long long)t.st.epoch, secs > 0 ? (double)(t.st.samples - s0) / secs : 0.0);
    fflush(stdout);
  }
  trainer_free(&t);
  return status;
}
