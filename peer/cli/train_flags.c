/* The training options: rumor train, peer and group. */
#include <math.h>
#include <string.h>

#include "peer/cli/cli_impl.h"

void train_flags_default(struct train_flags *f) {
  struct train_config cfg;
  train_config_default(&cfg);
  memset(f, 0, sizeof *f);
  f->slowdown = 1;
  f->model = "mlp:784-512-256-10";
  f->data = cfg.data_dir;
  f->device = cfg.device;
  f->shard = "0/1";
  f->optimizer = "sgd";
  f->schedule = "cosine";
  f->seed = 1;
  f->data_seed = 1;
  f->epochs = cfg.epochs;
  f->batch = cfg.batch;
  f->lr = cfg.optim.lr;
  f->momentum = cfg.optim.momentum;
  f->weight_decay = cfg.optim.weight_decay;
  f->log_every = cfg.log_every_s;
  f->val_fraction = cfg.val_fraction;
  f->eval_batches = cfg.eval_batches;
  f->moe_aux_loss = cfg.moe_aux_weight;
  f->moe_z_loss = cfg.moe_z_weight;
}

void train_flags_specs(struct train_flags *f, enum flags_for who, struct arg_spec *out, size_t *n, size_t max) {
  const struct arg_spec specs[] = {
      {"model", ARG_STR, &f->model, "SPEC",
       "architecture: mlp:784-512-256-10, mlp:784-256-10:gelu, gpt:L6-H6-C384-T256-V256 (layers, heads, width, "
       "context, vocabulary), gpt2, or a mixture of experts gpt:...-E8-K2 (E experts of which each token takes K)"},
      {"data", ARG_STR, &f->data, "PATH",
       "an MLP's images: a directory with train-/t10k- IDX files (plain or .gz; default " TRAIN_DEFAULT_IMAGES
       "); a GPT's tokens: a text file (bytes), a directory of llm.c token shards or a glob (default "
       TOKEN_DEFAULT_CORPUS ")"},
      {"val-fraction", ARG_FLOAT, &f->val_fraction, "X",
       "tokens: the end of the stream held out for validation, unless *_val* shards exist", 0, 0.9},
      {"device", ARG_STR, &f->device, "DEV", "auto, cpu, cuda or cuda:N"},
      {"threads", ARG_INT, &f->threads, "N", "CPU threads (0: all cores)", 0, 4096},
      {"tf32", ARG_FLAG, &f->tf32, NULL,
       "GPU matrix products in TF32 on tensor cores (inputs rounded to 10 mantissa bits, FP32 sums): faster, "
       "slightly less exact; recorded in checkpoints and the result line. On the CPU it is accepted and recorded "
       "but changes nothing (default: off, plain FP32)"},
      {"moe-every", ARG_INT, &f->moe_every, "N",
       "a mixture of experts (--model gpt:...-E8-K2): every N-th block has experts (the spec's M part; default 1)",
       0, GPT_MAX_LAYERS},
      {"capacity-factor", ARG_FLOAT, &f->capacity_factor, "X",
       "a mixture of experts: each expert takes at most X · tokens · K / E of a pass's tokens, the rest skip it "
       "through the residual (the spec's F part, percent; default 1.25)", 0, 1000},
      {"moe-aux-loss", ARG_FLOAT, &f->moe_aux_loss, "A", "a mixture of experts: the load-balancing loss's weight",
       0, 1e3},
      {"moe-z-loss", ARG_FLOAT, &f->moe_z_loss, "B", "a mixture of experts: the router z-loss's weight", 0, 1e3},
      {"shard", ARG_STR, &f->shard, "I/N", "train on shard I of N of the training set (N <= 65536)"},
      {"seed", ARG_INT, &f->seed, "N", "seed for initialisation and shuffling", 0, 9007199254740991.0},
      {"data-seed", ARG_INT, &f->data_seed, "N", "seed of the shard split (same on every peer)", 0,
       9007199254740991.0},
      {"epochs", ARG_INT, &f->epochs, "N", "passes over the shard", 1, TRAIN_EPOCHS_MAX},
      {"batch", ARG_INT, &f->batch, "N", "batch size", 1, TRAIN_BATCH_MAX},
      {"max-steps", ARG_INT, &f->max_steps, "N",
       "stop after N updates (0: no limit); without --epochs, also the learning-rate schedule's length", 0,
       (double)TRAIN_STEPS_MAX},
      {"optimizer", ARG_STR, &f->optimizer, "NAME", "sgd or adamw"},
      {"lr", ARG_FLOAT, &f->lr, "X", "peak learning rate", 0, 1e6},
      {"momentum", ARG_FLOAT, &f->momentum, "X", "SGD momentum", 0, 1},
      {"nesterov", ARG_FLAG, &f->nesterov, NULL, "Nesterov momentum"},
      {"weight-decay", ARG_FLOAT, &f->weight_decay, "X", "weight decay", 0, 1e6},
      {"schedule", ARG_STR, &f->schedule, "NAME", "learning-rate schedule: cosine or constant"},
      {"warmup", ARG_INT, &f->warmup, "N", "linear warm-up steps", 0, 1e15},
      {"slowdown", ARG_FLOAT, &f->slowdown, "X",
       "simulate a slower machine: each step takes X times its compute time (a straggler in benchmarks)", 1, 1000},
      {"grad-clip", ARG_FLOAT, &f->grad_clip, "X", "clip the gradients' global norm to X before each update; a pipeline stage clips its own "
       "slice's norm; the progress lines show the norm and the result line counts clipped_steps (0: off)",
       0, 1e12},
      {"checkpoint", ARG_STR, &f->checkpoint, "PATH",
       "save a checkpoint here, each epoch and at the end: a safetensors file, or a directory (DIR/) in the Hugging "
       "Face layout (model.safetensors, optimizer.safetensors, config.json)"},
      {"checkpoint-every", ARG_INT, &f->checkpoint_every, "N", "also save every N steps (0: off)", 0, 1e15},
      {"resume", ARG_STR, &f->resume, "PATH",
       "continue from a checkpoint (model, shard, batch, seeds, position; a given --batch, --shard or seed must match "
       "it)"},
      {"init-from", ARG_STR, &f->init_from, "DIR",
       "start from the weights of a Hugging Face GPT-2 directory (config.json and model.safetensors) and train "
       "from step 0 (fine-tuning)"},
      {"log-every", ARG_FLOAT, &f->log_every, "SEC", "seconds between progress lines (0: off)", 0, 1e6},
      {"no-eval", ARG_FLAG, &f->no_eval, NULL, "skip the test-set evaluation after each epoch"},
      {"eval-every", ARG_INT, &f->eval_every, "N", "also evaluate every N steps (0: at epoch ends only)", 0, 1e15},
      {"eval-batches", ARG_INT, &f->eval_batches, "N",
       "batches of --batch rows of the evaluation set per evaluation (0: all of it; -1: all test images, or 20 "
       "batches of validation windows)",
       -1, 1e15},
      {"tensorboard", ARG_STR, &f->tensorboard, "DIR",
       "write TensorBoard event files (loss, evaluation, learning rate, throughput, exchanges, bytes, parameter "
       "norm) to the run directory DIR/RUN, made when missing; RUN: 'train' for rumor train, a peer's --name or "
       "the first 8 characters of its key, NAME:sS for a group's stage"},
  };
  bool group = who == FLAGS_LAUNCHER || who == FLAGS_STAGE;
  for (size_t i = 0; i < sizeof specs / sizeof specs[0]; i++) {
    struct arg_spec sp = specs[i];
    /* The launcher's --device is --devices (one per stage). Groups resume
     * (and start from Hugging Face weights) when they are data- or
     * tensor-parallel: the group commands refuse them for pipelines. */
    if (who == FLAGS_LAUNCHER && strcmp(sp.name, "device") == 0) continue;
    if (group && strcmp(sp.name, "resume") == 0)
      sp.help = "continue a data- or tensor-parallel group from any whole-model checkpoint (each process takes its "
                "slices and its piece); needs --model, checked against the file";
    if (group && strcmp(sp.name, "init-from") == 0)
      sp.help = "start a data- or tensor-parallel group from a Hugging Face model directory's weights";
    if (group && strcmp(sp.name, "checkpoint") == 0)
      sp.help = "each stage saves its units to FILE-stage<s> (X.safetensors: X-stage<s>.safetensors), each epoch and "
                "at the end";
    if (who == FLAGS_LAUNCHER && strcmp(sp.name, "threads") == 0)
      sp.help = "CPU threads per stage (0: the host's cores divided among the stages)";
    RUMOR_ASSERT(*n < max);
    out[(*n)++] = sp;
  }
  args_log_json_spec(&f->log_json, out, n, max);
}

/* --moe-every and --capacity-factor rewrite the spec's M and F parts (so
 * checkpoints, labels and agreements carry them); the losses' weights go
 * to the trainer. `spec`: the parsed --model, or NULL (the checkpoint's). */
static int moe_flags(const struct train_flags *f, const struct arg_spec *specs, struct train_config *cfg,
                     struct model_spec *spec, struct rumor_err *e) {
  cfg->moe_aux_weight = f->moe_aux_loss;
  cfg->moe_z_weight = f->moe_z_loss;
  bool every = args_given(specs, "moe-every"), cap = args_given(specs, "capacity-factor");
  if (!every && !cap) return 0;
  const char *flag = every ? "--moe-every" : "--capacity-factor";
  if (!spec || spec->family != MODEL_GPT || !spec->u.gpt.experts)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s is for a mixture of experts: give --model gpt:...-E<experts> (e.g. "
                         "gpt:L6-H6-C384-T256-V256-E8-K2)", flag);
  if (every && (f->moe_every < 1 || f->moe_every > spec->u.gpt.layers))
    return rumor_err_set(e, RUMOR_EFORMAT, "--moe-every %lld: must be in [1, %d], the model's blocks",
                         (long long)f->moe_every, spec->u.gpt.layers);
  double pct = f->capacity_factor * 100;
  if (cap && (pct < 1 || fabs(pct - round(pct)) > 1e-6))
    return rumor_err_set(e, RUMOR_EFORMAT, "--capacity-factor %g: must be at least 0.01, in hundredths", f->capacity_factor);
  if (every) spec->u.gpt.moe_every = (int)f->moe_every;
  if (cap) spec->u.gpt.capacity_pct = (int)round(pct);
  /* The rewritten spec outlives every copy of the configuration: one per
   * process (a command parses its flags once). */
  static char text[MODEL_SPEC_MAX];
  model_spec_format(spec, text, sizeof text);
  cfg->model = text;
  return 0;
}

int train_flags_config(const struct train_flags *f, const struct arg_spec *specs, struct train_config *cfg,
                       struct rumor_err *e) {
  train_config_default(cfg);
  cfg->stop = signals_stop_flag(); /* SIGINT/SIGTERM end an evaluation between batches */
  if (shard_parse(f->shard, &cfg->shard, e)) return rumor_err_prefix(e, "--shard");
  if (optim_kind_parse(f->optimizer, &cfg->optim.kind))
    return rumor_err_set(e, RUMOR_EFORMAT, "--optimizer must be sgd or adamw, not '%s'", f->optimizer);
  if (optim_schedule_parse(f->schedule, &cfg->optim.schedule))
    return rumor_err_set(e, RUMOR_EFORMAT, "--schedule must be cosine or constant, not '%s'", f->schedule);
  cfg->model = ((f->resume || f->init_from) && !args_given(specs, "model")) ? NULL : f->model;
  struct model_spec spec;
  if (cfg->model && model_spec_parse(cfg->model, &spec, e)) return rumor_err_prefix(e, "--model");
  if (moe_flags(f, specs, cfg, cfg->model ? &spec : NULL, e)) return RUMOR_EFORMAT;
  cfg->data_dir = f->data;
  cfg->device = f->device;
  cfg->threads = (int)f->threads;
  cfg->tf32 = f->tf32;
  cfg->seed = (uint64_t)f->seed;
  cfg->data_seed = (uint64_t)f->data_seed;
  cfg->epochs = f->epochs;
  cfg->epochs_given = args_given(specs, "epochs");
  cfg->optim_given = args_given(specs, "optimizer");
  cfg->batch_given = args_given(specs, "batch");
  cfg->shard_given = args_given(specs, "shard");
  cfg->seed_given = args_given(specs, "seed");
  cfg->data_seed_given = args_given(specs, "data-seed");
  cfg->batch = f->batch;
  cfg->max_steps = f->max_steps;
  cfg->optim.lr = f->lr;
  cfg->optim.momentum = f->momentum;
  cfg->optim.nesterov = f->nesterov;
  cfg->optim.weight_decay = f->weight_decay;
  cfg->optim.warmup_steps = f->warmup;
  cfg->checkpoint = f->checkpoint;
  cfg->checkpoint_every = f->checkpoint_every;
  cfg->resume = f->resume;
  cfg->log_every_s = f->log_every;
  cfg->eval_each_epoch = !f->no_eval;
  cfg->eval_every = f->eval_every;
  cfg->eval_batches = f->eval_batches;
  cfg->val_fraction = f->val_fraction;
  cfg->grad_clip = f->grad_clip;
  cfg->slowdown = f->slowdown;
  cfg->init_from = f->init_from;
  if (f->resume && f->init_from)
    return rumor_err_set(e, RUMOR_EFORMAT, "--resume and --init-from exclude each other (a resumed run has its weights)");
  return 0;
}
