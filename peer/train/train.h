/*
 * train — one process's training: the loop (data, model, optimiser,
 * evaluation, progress lines), its checkpoints, and the safetensors files
 * they are stored in.
 *
 * A trainer drives either a whole replica or one stage of a pipeline
 * (train_config.stage): the same loop, where a stage's step is its share of
 * a pipelined step (peer/pipeline/pipeline.h) followed by its own update of
 * its own units, which is the single-process update restricted to them. The
 * loop is driven one step at a time (trainer_step), so a caller can act
 * between steps: the sync path hands snapshots to the network and applies
 * received averages exactly there.
 *
 * Threads: a trainer belongs to the thread that created it.
 */
#ifndef RUMOR_PEER_TRAIN_H
#define RUMOR_PEER_TRAIN_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "peer/data/data.h"
#include "peer/group/comm.h"
#include "peer/model/model.h"
#include "peer/pipeline/pipeline.h"
#include "tensor/tensor.h"

struct json_t; /* jansson's value (util/json_text.h) */

/* ============================================================================
 * Safetensors
 * ========================================================================== */

/*
 * Reading and writing the safetensors format
 * (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
 * length, a JSON header naming each tensor's dtype, shape and byte range, and
 * the raw little-endian data. PyTorch and the Hugging Face stack read the
 * files rumor writes.
 *
 * The header is untrusted input: its length is capped
 * (SAFETENSORS_MAX_HEADER) before jansson parses it (util/json_text.h:
 * duplicate keys at any depth, "\u0000" and invalid UTF-8 are refused), and
 * every value is checked before it is used.
 *
 * Integrity: rumor adds "rumor.blake2b" to the header's __metadata__, a
 * BLAKE2b-256 digest of the whole file computed with that value's 64 hex
 * digits set to '0'. Any flipped bit or lost byte is therefore detected.
 * Files are written atomically (util's atomic files).
 */

#define SAFETENSORS_MAX_HEADER (16u << 20)
#define SAFETENSORS_MAX_TENSORS 4096
#define SAFETENSORS_MAX_NAME 128

struct st_tensor {
  char name[SAFETENSORS_MAX_NAME];
  enum tensor_dtype dtype;
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS];
  const void *data; /* host memory: the caller's when writing, the file buffer when read */
  size_t nbytes;
};

struct st_meta {
  const char *key, *value;
};

/* Writes the tensors in the order given, with the metadata pairs and the
 * integrity digest, atomically to `path` (mode 0644). */
int safetensors_write(const char *path, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                      size_t nmeta, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The same file's bytes into an atomic file the caller opened
 * (file_atomic_open) and commits; on a failure the handle is released and
 * its temporary removed, as util's calls do. */
int safetensors_write_to(struct file_atomic *fa, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                         size_t nmeta, struct rumor_err *e) RUMOR_MUST_CHECK;

struct st_file {
  uint8_t *buf; /* the whole file */
  size_t len;
  struct st_tensor *tensors;
  size_t ntensors;
  struct st_meta *meta;
  size_t nmeta;
  struct json_t *header; /* the parsed header: owns the strings meta points to */
};

/* Reads and fully validates a file: header bounds, JSON shape, known dtypes,
 * every byte range inside the data section, ranges covering it without gaps
 * or overlap, sizes matching shapes, and (when present, or always when
 * `require_digest`) the rumor.blake2b digest. Returns 0, a negative errno, or
 * RUMOR_ECORRUPT with a message naming the file and the fault. */
int safetensors_read(const char *path, bool require_digest, struct st_file *f,
                     struct rumor_err *e) RUMOR_MUST_CHECK;
/* The same checks on a file already in memory: buf[0..len), malloc'd (NULL
 * when len is 0), whose ownership passes to `f` in every case: on success
 * safetensors_free frees it, on failure it is already freed. `name` (a path,
 * or any label) is used in messages only. safetensors_read is this after
 * reading the file. */
int safetensors_parse(uint8_t *buf, size_t len, const char *name, bool require_digest, struct st_file *f,
                      struct rumor_err *e) RUMOR_MUST_CHECK;
void safetensors_free(struct st_file *f);
const struct st_tensor *safetensors_find(const struct st_file *f, const char *name);
const char *safetensors_meta(const struct st_file *f, const char *key);

/* ============================================================================
 * Checkpoints
 * ========================================================================== */

/*
 * A process's training state as one safetensors file.
 *
 * Tensors: the model's parameter table, by name and shape, in flat-buffer
 * order (for the MLP "layers.<l>.weight" (out, in) and "layers.<l>.bias",
 * so torch.nn.Linear layers load them directly), then the optimiser state:
 * "optimizer.momentum" (P) for SGD, or "optimizer.exp_avg" and
 * "optimizer.exp_avg_sq" (P each) for AdamW.
 * Metadata (strings): rumor.format, rumor.model, rumor.step, rumor.epoch,
 * rumor.step_in_epoch, rumor.samples, rumor.seed, rumor.data_seed,
 * rumor.shard, rumor.batch, rumor.epochs, rumor.schedule_steps, rumor.optimizer, rumor.norm_mean,
 * rumor.norm_std, rumor.peer_id, rumor.tf32 ("true" or "false"; absent in
 * files before it, read as false), plus the whole-file digest.
 * A pipeline stage's checkpoint (rumor.format "stage-1") holds its units'
 * entries only and adds rumor.group, rumor.stage ("s/S"), rumor.layers
 * ("u0-u1", inclusive) and rumor.split.
 *
 * A checkpoint path that names a directory (it exists as one, or ends in
 * '/') holds the same in the Hugging Face layout: model.safetensors (the
 * weights and the metadata), optimizer.safetensors (the optimizer state and
 * the same metadata) and, for models that have one, config.json
 * (model_hf_config), so GPT2LMHeadModel.from_pretrained(DIR) loads the
 * weights. The state is written first and the weights last; on reading, the
 * state whose rumor.step is the weights' is used (optimizer.safetensors or
 * its .prev, after a save cut between the two), else the state starts from
 * zero with a warning.
 */
#define CHECKPOINT_MODEL_FILE "model.safetensors"
#define CHECKPOINT_OPTIM_FILE "optimizer.safetensors"
#define CHECKPOINT_CONFIG_FILE "config.json"

/* The longest checkpoint path saved: with ".prev.tmp.PID.HEX" (util's atomic
 * files) or a directory's file name added it still fits 1024-byte names. */
#define CHECKPOINT_PATH_MAX 900

#define CHECKPOINT_FORMAT "1"
#define CHECKPOINT_STAGE_FORMAT "stage-1"

/* Where a run stands; saved with the weights so a resumed run continues the
 * same sequence of batches and learning rates. */
struct train_state {
  int64_t step;          /* optimizer updates applied */
  int64_t epoch;         /* current epoch, from 0 */
  int64_t step_in_epoch; /* batches of the current epoch already done */
  int64_t samples;       /* rows trained on by this process */
};

struct ckpt_info {
  struct model_spec spec;
  struct train_state st;
  enum optim_kind optim_kind;
  uint64_t seed, data_seed;
  struct shard shard;
  int64_t batch;
  int64_t epochs;   /* the run's configured epochs; 0 when unknown (older files) */
  int64_t schedule_steps; /* the schedule's length when set by --max-steps; 0: by epochs (or older files) */
  double norm_mean, norm_std;
  char peer_id[96]; /* free text; empty when unknown */
  bool tf32;        /* the run's GEMMs were TF32 (--tf32); false in older files */
  /* A pipeline stage's checkpoint: stages > 0. */
  char group[72];
  int stage, stages;
  char split[PIPE_MAX_STAGES * 4 + 8];
  /* Tensors a sync scheme keeps with the model (an outer optimizer's
   * state), saved after the optimizer's: NULL for none. */
  const struct ckpt_extra *extra;
};

/* Named float vectors saved beside the optimizer state (in a directory
 * checkpoint, in its optimizer.safetensors), each as a 1-D F32 tensor. */
#define CKPT_EXTRA_MAX 6
#define CKPT_EXTRA_NAME_MAX 32
struct ckpt_extra {
  size_t n;
  struct ckpt_extra_tensor {
    const char *name;  /* e.g. "outer.anchor" */
    const float *data; /* host memory */
    int64_t len;
  } t[CKPT_EXTRA_MAX];
};

/* Writes the parameters model `m` holds (its units' table entries), the
 * optimizer state (when `o` is not NULL) and `info` atomically to `path`.
 * Returns 0 or a negative code with a message; on failure the previous file
 * at `path` is intact.
 *
 * Durability: the new file is written to a temporary name and fsynced; then
 * the file at `path` is hard-linked to `path`.prev (so the previous
 * checkpoint survives a later corruption of the current one) and the new file
 * is renamed over `path`, and the directory fsynced. At every instant `path`
 * is a complete checkpoint (the old one or the new one), and a failed write
 * (a full disk) changes neither `path` nor `path`.prev. Temporary files left
 * by processes that died mid-write (`path`.tmp.PID.HEX and
 * `path`.prev.tmp.PID.HEX, PID no longer running) are removed. */
int checkpoint_save(const char *path, const struct model *m, const struct optim *o,
                    const struct ckpt_info *info, struct rumor_err *e) RUMOR_MUST_CHECK;

/* The same from host memory: `host` holds the parameters model `m` holds
 * (m->nparams floats) and then, when `o` is not NULL, the whole optimizer
 * state of those parameters (per-param parts of m->nparams floats each, as
 * o's kind has; o itself may be a range optimizer: only its kind is read).
 * A data-parallel group's member saves what it gathered this way. */
int checkpoint_save_host(const char *path, const struct model *m, const struct optim *o, const float *host,
                         const struct ckpt_info *info, struct rumor_err *e) RUMOR_MUST_CHECK;

/* A checkpoint of another layout than a trainer's (a parameter server's
 * range): exactly the tensors and metadata given, in one file, with
 * checkpoint_save's durability (staged and fsynced, the previous file kept
 * as `path`.prev, renamed over `path`). Returns 0 or an error naming the
 * path. */
int checkpoint_save_tensors(const char *path, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                            size_t nmeta, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Reads such a file (the digest required); when it is damaged, logs why
 * and reads `path`.prev instead. *used (may be NULL) gets the path read.
 * Returns 0, 1 when neither exists (a first start), or an error with both
 * reasons. The caller frees `f` (safetensors_free). */
int checkpoint_read_tensors(const char *path, struct st_file *f, char *used, size_t used_len,
                            struct rumor_err *e) RUMOR_MUST_CHECK;
/* True when `path` names a directory checkpoint (see above). */
bool checkpoint_is_dir(const char *path);
/* Checks at start-up that checkpoint_save can write `path` (a file, or a
 * directory checkpoint): not too long, not of the wrong kind, and in an
 * existing directory this process may write. An error names `path` and the
 * fault (callers prefix the option), so that a bad destination is refused
 * before any training, not at the first save. */
int checkpoint_check_dest(const char *path, struct rumor_err *e) RUMOR_MUST_CHECK;
/* `dir`/`file`. */
void checkpoint_dir_file(const char *dir, const char *file, char *out, size_t n);

struct checkpoint {
  struct st_file file;
  struct st_file state_file; /* a directory checkpoint's optimizer state (buf NULL otherwise) */
  struct ckpt_info info;
  struct model_table table; /* of info.spec: the whole model's */
  bool has_optim;
  /* What the file holds: units [u0, u1), the parameters [base, base +
   * nparams) of the whole model's flat layout (its optimizer state and
   * per-parameter extras have nparams floats). A whole-model file holds
   * every unit; a pipeline stage's file (checkpoint_open_part) its own. */
  int u0, u1;
  int64_t base, nparams;
};

/* Reads and validates a whole-model checkpoint (digest, every table entry
 * present with its shape, metadata parseable). */
int checkpoint_open(const char *path, struct checkpoint *ck, struct rumor_err *e) RUMOR_MUST_CHECK;
void checkpoint_close(struct checkpoint *ck);

/* The previous checkpoint's path: `path` with ".prev" appended. */
void checkpoint_prev_path(const char *path, char *out, size_t n);

/* Opens `path` like checkpoint_open; when it is missing, truncated or
 * damaged, logs why (naming the file and the fault) and opens `path`.prev
 * instead. *used (may be NULL) gets the path opened. Fails with both reasons
 * when neither is usable. */
int checkpoint_open_latest(const char *path, struct checkpoint *ck, char *used, size_t used_len,
                           struct rumor_err *e) RUMOR_MUST_CHECK;
/* checkpoint_open_latest that also takes a pipeline stage's file (format
 * CHECKPOINT_STAGE_FORMAT: the entries of its units, checked like a whole
 * file's, and ck->info.stage / stages from its metadata); ck->u0, u1,
 * base and nparams say what it holds. */
int checkpoint_open_part_latest(const char *path, struct checkpoint *ck, char *used, size_t used_len,
                                struct rumor_err *e) RUMOR_MUST_CHECK;
/* Copies the parameters into `m` (same spec; the units it holds, which the
 * file must hold: a whole model's from a whole file, a stage's from a
 * whole file or its own stage's) and, when `o` is not NULL and the file has
 * optimizer state of the same kind, the state into `o` (whose step is set
 * from the file); a range optimizer (optim_init_range) takes its range of
 * it. RUMOR_ESHAPE naming both when the file holds other units. */
int checkpoint_restore(const struct checkpoint *ck, struct model *m, struct optim *o,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
/* The extra tensor `name` of an open checkpoint (ckpt_info.extra when it
 * was saved) when it holds exactly `len` F32 values, else NULL. Valid
 * until checkpoint_close. */
const float *checkpoint_extra(const struct checkpoint *ck, const char *name, int64_t len);
/* Part `part` of the optimizer state of kind `kind` (P floats, the
 * parameters' layout) in an open checkpoint, or NULL when it has none of
 * that kind. Valid until checkpoint_close. */
const float *checkpoint_optim_part(const struct checkpoint *ck, enum optim_kind kind, int part);
/* Puts a pipelined group's stage files for `path` (train_stage_checkpoint_
 * path's, each with its .prev fallback: every stage's, of one save)
 * together into the whole model's checkpoint at `path` itself, written as
 * checkpoint_save writes (a directory: model.safetensors, config.json and
 * optimizer.safetensors, which transformers' from_pretrained loads). The
 * sync scheme's state stays in the stage files (it is in each stage's own
 * layout). *step gets the step written. Returns 0 or an error naming the
 * file at fault; the stage files are left as they are either way. */
int checkpoint_merge_stages(const char *path, int64_t *step, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The parameters an open checkpoint holds into `out` (table.nparams
 * floats, the whole model's flat-buffer order; a stage's file fills its
 * units' range and leaves the rest). */
void checkpoint_params(const struct checkpoint *ck, float *out);

/* Reads a Hugging Face model directory as GPT2LMHeadModel.save_pretrained
 * writes it (config.json and one model.safetensors; rumor's directory
 * checkpoints are such directories): the spec from config.json
 * (model_spec_from_hf_config) and every table entry's values, F32, F16 or
 * BF16 converted to F32, in flat-buffer order into a new host buffer
 * (*params, table.nparams floats; the caller frees it). Names as
 * model_hf_lookup. Returns 0 or an error naming the file and the fault: an
 * unknown tensor, a missing entry, a wrong shape or dtype, a sharded
 * checkpoint. */
int hf_import(const char *dir, struct model_spec *spec, float **params, struct rumor_err *e) RUMOR_MUST_CHECK;

/* ============================================================================
 * The trainer
 * ========================================================================== */

/* One stage of a pipeline: what every stage of a group must agree on, and
 * where this process stands in it. */
struct train_stage {
  const char *group;    /* the group's name */
  int stage, stages;
  int micro;            /* micro-batches per step */
  enum pipe_schedule sched;
  stage_link_t *link;   /* the connections to the neighbouring stages; not owned */
};

/* A data-parallel member of a peer group (rumor group --data-parallel D
 * --zero Z): the D members of `comm` split every batch of the whole run's
 * `batch` rows (member r takes comm_chunk's r-th slice of each batch's
 * rows: exactly the rows `rumor train --batch B` reads, so the group's step
 * equals the single process's within float rounding) and sum their
 * gradients. The ZeRO stage decides what is sharded, each member holding
 * comm_chunk's r-th contiguous piece of the flat parameter buffer:
 *   0  nothing: the gradient is all-reduced, every member updates all
 *      parameters;
 *   1  the optimizer state: the gradient is reduce-scattered, each member
 *      updates its piece and the parameters are all-gathered;
 *   2  also the gradients: the backward runs one unit at a time and each
 *      unit's gradient is reduce-scattered as soon as it is complete, the
 *      rest of the unit's gradient memory given back (tensor_discard);
 *   3  also the parameters: a unit's are all-gathered just before its
 *      forward and its backward and given back after each.
 * Every member ends each step with the same parameters (bit-identical:
 * comm's collectives are). */
struct train_dp {
  comm_t *comm; /* the data-parallel members; not owned */
  int zero;     /* 0 .. 3 */
  /* ZeRO 1/2 in a group that averages with other groups: a step leaves
   * the parameters' all-gather to the trainer_group_resync after it, which
   * runs once the sync path moved the pieces (one all-gather a step, not
   * two). Until then only this member's piece is current: everything that
   * reads the parameters between (the sync path) reads the shard alone,
   * and an evaluation gathers first. */
  bool lazy_gather;
  /* Tests: collectives take a device's path through pinned staging on the
   * CPU too (so the CPU runs check it). */
  bool staged;
  int64_t segment_floats; /* tests: floats a collective moves at a time (0: 4 MiB of them) */
  /* Expert parallelism (rumor group --expert-parallel P): the members of
   * `comm` in consecutive runs of P, each run splitting a mixture-of-experts
   * model's experts (model.h's "expert parallelism": tokens go to their
   * experts' members and back inside the passes). `experts` is this
   * member's run (a sub-communicator of comm), or NULL. */
  comm_t *experts;
};

/* A tensor-parallel rank of a peer group (rumor group --tensor-parallel T):
 * the model is built with model_init_tp over `comm`'s members (Megatron:
 * attention by heads, the MLP by columns then rows, the vocabulary), every
 * rank trains on the same rows, and the step equals the single process's.
 * With data-parallel members too, each of them is T such ranks, and `all`
 * holds every process of the group (the global gradient norm sums over it). */
struct train_tp {
  comm_t *comm; /* the T ranks that hold one replica together; not owned */
  comm_t *all;  /* every member of the group (T x D); `comm` itself without data-parallel members */
};

/* The ranges of the options that size a run (--batch, --epochs, --max-steps
 * and the step counts); a checkpoint's metadata is held to them too. */
#define TRAIN_BATCH_MAX 1048576
#define TRAIN_EPOCHS_MAX 1000000
#define TRAIN_STEPS_MAX 1000000000000000LL /* 1e15 */

/* State a sync scheme keeps with the model (an outer optimizer's anchor,
 * momentum and round): floats on the trainer's device, in named segments
 * of per_param × shard floats (trainer_shard_floats) + fixed floats each. The trainer owns them
 * (trainer_extra), zeroes them at start, saves each segment in checkpoints
 * under its name and restores it on --resume, and carries them in the full
 * state (trainer_state_floats: after the optimizer's) that donations and
 * state pulls move. */
#define TRAIN_EXTRA_MAX CKPT_EXTRA_MAX
struct train_extra_spec {
  int n;
  struct train_extra_seg {
    char name[CKPT_EXTRA_NAME_MAX];
    int64_t per_param, fixed;
  } seg[TRAIN_EXTRA_MAX];
};

struct train_config {
  const char *model;       /* spec string; NULL → from the resumed checkpoint */
  const char *data_dir;    /* images: a directory with <split>-images-idx3-ubyte[.gz] ...; tokens: a text
                            * file, a directory of token shards or a glob (token_corpus_load); NULL: the
                            * default for the model's input (TRAIN_DEFAULT_IMAGES, TOKEN_DEFAULT_CORPUS) */
  double val_fraction;     /* tokens: the part of the stream held out for validation (no _val files) */
  int64_t eval_batches;    /* batches of the evaluation set each evaluation reads (0: all of it; -1: all test
                              images, or 20 batches of validation windows) */
  int64_t eval_every;      /* steps between evaluations (0: at epoch ends only, when eval_each_epoch) */
  double grad_clip;        /* global gradient norm clipped to this before each update (0: off) */
  double slowdown;         /* >= 1: each step takes this many times its compute time (a simulated straggler;
                            * 0 or 1: full speed) */
  const char *device;      /* "auto", "cpu", "cuda", "cuda:N" */
  int threads;             /* CPU threads (0: all cores) */
  bool tf32;               /* GEMMs in TF32 on a GPU (tensor_backend_set_tf32; no effect on the CPU) */
  struct shard shard;
  uint64_t seed;           /* model initialisation and per-epoch shuffles */
  uint64_t data_seed;      /* the shard split; the same on every peer */
  int64_t epochs;
  int64_t batch;
  int64_t max_steps;       /* stop after this many updates (0: no limit); without epochs_given, the
                            * schedule's length too */
  struct optim_config optim;
  const char *checkpoint;  /* path to save to, or NULL (a stage saves to train_stage_checkpoint_path of it) */
  int64_t checkpoint_every;/* steps between saves (0: at epoch ends only) */
  const char *init_from;   /* a Hugging Face model directory whose weights start the run (hf_import), or NULL */
  const char *resume;      /* checkpoint to resume from, or NULL (whole models only). The run's seeds,
                            * shard and batch come from it (given ones must agree), and unless given on
                            * the command line its optimizer and epochs. */
  double moe_aux_weight, moe_z_weight; /* a mixture of experts' auxiliary losses' weights (model_set_moe_losses) */
  bool optim_given, epochs_given; /* --optimizer / --epochs were given (they must then match a resumed run) */
  bool batch_given, shard_given, seed_given, data_seed_given; /* given on the command line: a resumed run
                                                               * refuses a value other than its own */
  double log_every_s;      /* seconds between progress lines (0: none) */
  bool eval_each_epoch;
  const char *peer_id;     /* written into checkpoints; may be NULL */
  const struct train_stage *stage; /* a pipeline stage, or NULL for a whole replica */
  const struct train_dp *dp; /* a data-parallel member of a group (whole replicas only), or NULL */
  const struct train_tp *tp; /* a tensor-parallel rank of a group (whole replicas only), or NULL */
  const atomic_int *stop;  /* polled between a whole replica's evaluation batches: non-zero cuts the evaluation
                            * short (a stop signal; trainer_evaluate); may be NULL */
  struct train_extra_spec extra; /* a sync scheme's state kept with the model (n 0: none) */
};

void train_config_default(struct train_config *c);

/* What follows from a stage's configuration alone, the same in every stage:
 * the model, the split, this stage's units and the micro-batch rows. */
struct stage_plan {
  struct model_spec spec;
  struct pipe_split split;
  int u0, u1;
  int64_t mb_rows; /* ceil(batch / micro) */
};
/* Returns 0 or RUMOR_EFORMAT with a message naming the bad flag. */
int train_stage_plan(const struct train_config *cfg, struct stage_plan *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The text every stage of a group must hold identical (compared when
 * neighbours connect): model, split, schedule, micro-batches and every
 * setting that decides the batches, the learning rates and the updates. */
void train_stage_agreement(const struct train_config *cfg, const struct stage_plan *plan, char *buf, size_t n);
/* The gossip label of a stage: stage s of every group averages only with
 * peers that carry exactly the same label, e.g. "mlp:784-256-10 stage 0/2
 * layers 0-0 of 0,1,2". Returns 0 or RUMOR_ETOOBIG (over `n` characters). */
int train_stage_label(const struct train_config *cfg, const struct stage_plan *plan, char *buf, size_t n,
                      struct rumor_err *e) RUMOR_MUST_CHECK;
/* The checkpoint file of stage s for the group's --checkpoint PATH:
 * "run.safetensors" → "run-stage0.safetensors"; a directory checkpoint
 * ("run/", or an existing directory) → "run/stage0.safetensors"; other
 * names get "-stage0" appended. */
void train_stage_checkpoint_path(const char *path, int stage, char *buf, size_t n);

/* Where a trainer's batches come from (peer/train/source.c): images with a
 * label each (the model takes F32 inputs) or a token corpus (I32 tokens). */
#define TRAIN_DEFAULT_IMAGES "/usr/share/datasets/fashion-mnist"
struct train_data {
  bool tokens;
  bool have_eval;        /* a test set, or a validation split */
  size_t x_bytes_per_row; /* input bytes of one row */
  int64_t y_per_row;     /* labels of one row */
  /* Images. */
  struct dataset train, test;
  struct batcher batcher;
  double norm_mean, norm_std;
  float lut[256];
  /* Tokens. */
  struct token_corpus corpus;
  struct token_batcher tb;
  int64_t context;
};

/* Gradients summed across processes before each update (rumor peer --sync
 * allreduce): called after the backward pass with the step's gradient in
 * model.grads (the mean over this process's `rows` rows). Returns 0 when
 * model.grads holds the gradient to apply (the same on every member), 1
 * when the step is dropped because the state was replaced (the member fell
 * behind and took another's: parameters, optimizer state and st.step are
 * new, trainer_take_step), or a negative code with a message. A pipeline
 * stage's reducer sums its own slice (with the same stage of the other
 * groups), after the stage's share of the pipelined step. A group process
 * sums its shard with the same shard of other groups (group_reduce_between)
 * and, when its group goes on from a later step than its shard's after a
 * drop, takes its shard again: catch_up pulls one at `step` or later
 * (parameters, optimizer state and st.step new; returns 0), or finds
 * nobody to give one (1), or fails (negative). While the group's
 * processes wait for each other around it, they run idle (serving the
 * states other groups' processes pull: a process of another group may
 * need ours before its own group, and so ours, can go on). */
struct train_reducer {
  int (*reduce)(void *arg, int64_t rows, struct rumor_err *e);
  int (*catch_up)(void *arg, int64_t step, struct rumor_err *e);
  void (*idle)(void *arg);
  void *arg;
};

/* Someone watching the run (--tensorboard): called on the training thread
 * with `evaluated` false at the end of every trainer_step (after its
 * evaluation and checkpoint, if any), and with `evaluated` true at the end
 * of every trainer_evaluate, so also inside a step that evaluates. It reads
 * the trainer and must not change it. */
struct trainer;
struct train_observer {
  void (*fn)(void *arg, const struct trainer *t, bool evaluated);
  void *arg;
};

/* A data-parallel member's state (peer/train/zero.c). */
struct train_zero {
  struct train_dp dp;
  int rank, size;
  int64_t cut[COMM_MAX_MEMBERS + 1]; /* member j's piece of the flat buffer: [cut[j], cut[j + 1]) */
  int64_t *counts;        /* scratch: per-member counts of one collective (size) */
  struct tensor dbuf[2];  /* ZeRO 2/3: the per-unit backward's gradient ping-pong */
  /* A device backend's staging for collectives (NULL on the CPU unless
   * train_dp.staged): two pinned halves of host_floats each, so one
   * segment is copied out while the other is on the wire; out_ev[i]
   * marks half i's copy out done, back_ev[i] its copy back. */
  float *host[2];
  tensor_event_t out_ev[2], back_ev[2];
  int64_t host_floats;    /* the most a segment moves through them (<= seg) */
  int64_t seg;            /* floats a collective moves at a time */
  bool partial;           /* lazy_gather: only this member's piece of the parameters is current */
  /* Expert-parallel members at ZeRO 1-3: the experts' weights go only to
   * the members that run them (ep_of[j]: member j's expert-parallel rank)
   * and their gradients only from them; other experts' weights and
   * gradients are neither held nor current outside a member's piece. */
  bool ep_aware;
  int ep_of[COMM_MAX_MEMBERS];
  int64_t *counts2;       /* scratch: the other side's counts of an all-to-all (size) */
  float *xbuf;            /* host scratch of the experts' exchanges (xbuf_floats) */
  int64_t xbuf_floats;
};

struct trainer {
  struct train_config cfg;
  struct train_reducer reducer; /* none when reduce is NULL */
  struct train_observer observer; /* none when fn is NULL; set after trainer_init */
  struct train_stage stage; /* copied from cfg.stage (cfg.stage points here); stages 0 for a whole replica */
  struct stage_plan plan;   /* a stage's; for a whole replica: every unit, mb_rows = batch */
  tensor_backend_t be;
  struct model model;       /* the units this process holds */
  struct optim optim;
  struct train_data data;
  float *init_params;  /* --init-from's weights until the model holds them */
  int64_t steps_per_epoch;
  int64_t total_steps; /* the schedule's length: epochs × steps_per_epoch, or max_steps (train_config) */
  int64_t resumed_schedule; /* the resumed checkpoint's schedule_steps */
  bool schedule_by_steps;   /* the schedule's length is a number of steps (max_steps), not of epochs */
  int64_t stop_step;   /* total_steps, or max_steps when that is smaller */
  struct train_state st;
  struct pipeline pipe; /* a stage's runner */

  /* Double-buffered host batches (pinned on CUDA): the next batch is
   * gathered while the device works on the current one (a stage fills
   * xh[0] / yh[0] only). */
  void *xh[2]; /* floats (images) or I32 tokens */
  int32_t *yh[2];
  int64_t rows[2];
  int cur;
  bool staged; /* xh[cur] holds the batch for st's position */

  double loss_avg;       /* exponential moving average of the training loss (NaN on stages without the loss) */
  double last_loss;
  double accuracy, test_loss; /* the last evaluation (NaN on stages without the loss) */
  double eval_seconds;        /* how long the last evaluation took (wall clock) */
  double *epoch_losses;  /* loss_avg at the end of each epoch this run trained (where the loss is) */
  int64_t nepoch_losses, epoch_losses_cap;
  double t_start, t_last_log;
  double reduce_s;      /* of the current step: time in the reducer (not stretched by --slowdown) */
  /* --grad-clip only: the last step's global gradient norm before clipping
   * (NaN until then) and the steps of this run whose norm was clipped. */
  double grad_norm;
  int64_t clipped_steps;
  /* The sync scheme's state (cfg.extra): one allocation on the device,
   * segment i at extra_off[i]. */
  struct tensor extra;
  int64_t extra_off[TRAIN_EXTRA_MAX + 1];
  bool replicated_apart; /* tensor-parallel ranks whose replicated moments differ (trainer_group_resync_state) */
  bool agree_steps;      /* trainer_group_agree_steps was called */
  bool state_pulled;     /* a group process took a pulled state (trainer_load_state, _swap_state) not yet made whole */
  int64_t stage_agreements; /* a pipeline stage's process: pipeline_agree calls so far (their tags) */
  int64_t shard_lo, shard_n; /* the shard: [shard_lo, shard_lo + shard_n) of the flat buffer (trainer_shard_params) */
  struct train_zero zero; /* with cfg.dp */
  struct model_tp tp;     /* with cfg.tp: the model's collectives (model.tp points here) */
  struct model_ep ep;     /* with cfg.dp's experts: the model's expert-parallel collectives (model.ep points here) */
  float *tp_host;         /* a device backend's staging for them (NULL on the CPU) */
  double comm_step_bytes; /* a group member: payload bytes it sent and received in its last step */
  double ep_step_bytes;   /* an expert-parallel member: those of them its experts' exchanges moved */
  int64_t ep_dropped;     /* batches an expert-parallel member dropped for being too short (ep_drops_batch) */
  /* A mixture-of-experts model's figures of its last step (train.c,
   * trainer_moe_note): the auxiliary losses summed over its MoE blocks
   * (weights applied; averaged over micro-batches), the fraction of the
   * token-expert choices dropped for capacity, and each expert's share of
   * the choices (over every MoE block). */
  struct train_moe {
    int experts; /* 0: a dense model */
    double aux_loss, z_loss, dropped_fraction;
    double load[GPT_MAX_EXPERTS];
  } moe;
  int64_t tp_host_floats;
  bool started; /* the first step ran */
  char resumed_from[1024]; /* the checkpoint actually loaded (cfg.resume or its .prev) */
  int64_t samples_at_start;
};

/* Loads data, opens the device, builds the model (the whole one, fresh from
 * the seed or from cfg->resume; or a stage's units, initialised exactly as
 * the whole model's would be, with the pipeline over cfg->stage->link) and
 * the optimizer. Logs what it set up. Returns 0 or a negative code with a
 * message naming the bad input. */
int trainer_init(struct trainer *t, const struct train_config *cfg, struct rumor_err *e) RUMOR_MUST_CHECK;
void trainer_free(struct trainer *t);

/* A stage's link, when it exists only after trainer_init (it runs on the
 * gossip runtime's loop, which needs the trainer's sizes to start). */
void trainer_set_link(struct trainer *t, stage_link_t *link);

bool trainer_is_stage(const struct trainer *t);
/* True for a data-parallel member of a group (cfg.dp). */
bool trainer_is_dp(const struct trainer *t);
/* True for a tensor-parallel rank or a data-parallel member (cfg.tp, cfg.dp). */
bool trainer_in_group_comm(const struct trainer *t);
/* This process's peak resident memory so far, in bytes (getrusage). */
int64_t trainer_peak_rss_bytes(void);
/* True for a whole replica and for a pipeline's last stage: the loss is here. */
bool trainer_has_loss(const struct trainer *t);

/* True once the configured epochs (or max_steps) are done. */
bool trainer_done(const struct trainer *t);
/* Runs one optimisation step on the next batch. Advances epoch and batch
 * position; prints progress lines; at an epoch end evaluates (if
 * configured) and checkpoints (if configured). Returns a negative code when
 * a checkpoint could not be written, or (a stage) a neighbour failed or a
 * stop was requested. */
int trainer_step(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Accuracy and mean loss of the current parameters on the test set, into
 * t->accuracy and t->test_loss (a stage's: pipelined, every stage of the
 * group at the same point; NaN on stages other than the last). A whole
 * replica checks cfg.stop before each batch: when it is set the evaluation
 * ends there and RUMOR_ECANCELED is returned with a message, t->accuracy
 * and t->test_loss keep their previous values and the observer is not
 * called. Inside trainer_step such a cut is no failure: the step goes on to
 * its checkpoint, if one is due, and returns 0. */
int trainer_evaluate(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Mean loss of the current parameters on the first rows of the training
 * set in file order that hold at most `targets` targets (at least one row;
 * *rows gets how many): the same data on every peer, so a donor and the
 * newcomer that received its state must report the same figure. Whole
 * replicas only. */
double trainer_check_loss(struct trainer *t, int64_t targets, int64_t *rows);
/* "samples" or "windows": what a row of the trainer's data is, for messages. */
const char *trainer_row_noun(const struct trainer *t);

/* The part of the flat parameter buffer this process averages with the
 * same part in other groups (its shard, issue #31): all of the buffer for
 * a whole replica, a stage or a tensor-parallel rank (whose buffer holds
 * its slices), a data-parallel member's ZeRO piece [zero.cut[r],
 * zero.cut[r + 1]). The sync path, donations and state pulls see this
 * part only: trainer_state_floats, trainer_copy_state and
 * trainer_load_state cover the shard's parameters, their optimizer state
 * and the sync scheme's state, which is sized per shard float. */
struct tensor trainer_shard_params(struct trainer *t);
struct tensor trainer_shard_grads(struct trainer *t);
int64_t trainer_shard_floats(const struct trainer *t);
/* True when this process holds part of a replica (a stage, a data- or
 * tensor-parallel member of a group): a state it pulls or donates cannot
 * be judged by a loss of its own, only by its values being finite. */
bool trainer_holds_part(const struct trainer *t);
/* A data- or tensor-parallel group member, after the sync path may have
 * changed its shard between steps (`changed`: it did since the last
 * call): the group makes its copies whole and equal again. The members
 * agree whether any shard changed; if one did, or a lazy step
 * (train_dp.lazy_gather) left them partial, ZeRO 1-2 members all-gather
 * the pieces, and tensor-parallel ranks average their replicated
 * parameters (LayerNorms, position embedding, an MLP's last layer), which
 * each rank's sync moves on its own (after trainer_group_resync_state
 * could not average their moments: at every call). Collective over every process of the group: each
 * calls it at the same points. *any (may be NULL) gets whether any
 * member's shard changed. Returns 0 (at once, *any = changed, for other
 * trainers) or the communicator's error. */
int trainer_group_resync(struct trainer *t, bool changed, bool *any, struct rumor_err *e) RUMOR_MUST_CHECK;
/* From now on each trainer_group_resync also brings every member to the
 * largest step any member holds (in the same collective). For DiLoCo
 * between groups, where a member left behind by its shard's ring takes the
 * step of a member ahead while the other members' rings may not have left
 * them behind. Every member of the group calls it before the same resync. */
void trainer_group_agree_steps(struct trainer *t);
/* Every step's gradient between groups (a train_reducer with catch_up;
 * else returns 0 at once): after a group joined, each process having
 * taken its shard (a stage's slice, or a piece of it) from a live group at
 * `shard_step` (or kept its own, of that step), the processes whose shards
 * are older than the latest any holds take theirs again from their rings
 * until all hold shards of one step, which becomes the group's (the
 * donors, each moving on, may have served steps apart, and the rings
 * would sum the same gradient into parameters of different steps). Every
 * process of the group calls it at the same point, after the sync path is
 * ready. Returns 0 or a negative code. */
int trainer_group_join_converge(struct trainer *t, int64_t shard_step, struct rumor_err *e) RUMOR_MUST_CHECK;
/* A pipelined group (a stage's process; else returns 0 at once): every
 * process goes on from the largest step any holds, agreed in each stage
 * and across the stages over the links. `idle` (may be NULL) runs while
 * the stage's communicator waits. Every process of the group calls it at
 * the same point. Returns 0 or a negative code. */
int trainer_stages_agree_step(struct trainer *t, void (*idle)(void *arg), void *arg,
                              struct rumor_err *e) RUMOR_MUST_CHECK;
/* After each process of a group loaded a pulled state (its shard's):
 * ZeRO 0 data-parallel members, which each hold the whole optimizer state
 * but pulled only their piece's, all-gather the pieces of every moment.
 * Tensor-parallel ranks then average their replicated parameters'
 * optimizer state too, which the ranks' states (pulled from different
 * groups, or not at all) hold differently. With data-parallel members
 * above ZeRO 0 a rank's piece does not hold those moments whole: they stay
 * apart until the ranks' equal gradients wash the difference out, and
 * trainer_group_resync averages the parameters at every call from then
 * on. Collective over the group; 0 at once for other trainers. */
int trainer_group_resync_state(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Checks that the group's copies agree bit for bit: data-parallel members
 * holding whole parameters (ZeRO 0-2) the whole buffer, ZeRO 0's also the
 * whole optimizer state, tensor-parallel ranks their replicated
 * parameters. Collective, as above. Returns 0, the
 * communicator's error, or RUMOR_EPROTO naming the first member whose copy
 * differs from its member 0's. */
int trainer_group_check(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Segment i of the sync scheme's state (train_config.extra), a flat view
 * of per_param × shard floats + fixed floats on the trainer's device. */
struct tensor trainer_extra(struct trainer *t, int i);
/* Floats in the full state: parameters, then optimizer state, then the
 * sync scheme's (train_config.extra). */
int64_t trainer_state_floats(const struct trainer *t);
/* Where segment i of the sync scheme's state (train_config.extra) begins
 * in a full state of trainer_state_floats floats (trainer_copy_state's
 * layout); i = extra.n gives its end. */
int64_t trainer_state_extra_at(const struct trainer *t, int i);
/* Copies parameters and optimizer state to host memory (state_floats). */
void trainer_copy_state(struct trainer *t, float *out);
/* Replaces parameters and optimizer state with `state` (state_floats). */
void trainer_load_state(struct trainer *t, const float *state);
/* Exchanges parameters and optimizer state with `state` (state_floats):
 * the trainer takes it and `state` gets the trainer's, through a bounce
 * buffer of 1 MiB instead of a second copy of the state (a catch-up's
 * check keeps the state it may go back to this way: sync_pull_take). */
void trainer_swap_state(struct trainer *t, float *state);
/* Replaces the parameters with `params` (nparams floats, host) and zeroes
 * the optimizer state and the sync scheme's, as a fresh trainer's. */
void trainer_load_fresh(struct trainer *t, const float *params);
/* Continues from optimizer step `step` at the start of this shard's epoch
 * `epoch`, having trained on `samples` rows (a newcomer taking a live
 * peer's state; a stage taking stage 0's position). */
void trainer_set_position(struct trainer *t, int64_t step, int64_t epoch, int64_t samples);

/* Takes over optimizer step `step` with a state just loaded
 * (trainer_load_state) from a member of the same bulk-synchronous run,
 * keeping this process's place in its own data. */
void trainer_take_step(struct trainer *t, int64_t step);
/* --grad-clip (nothing without it): scales model.grads so their global norm
 * is at most cfg.grad_clip, noting the norm before (grad_norm) and counting
 * a clipped step (clipped_steps). The trainer calls it before its update; a
 * reducer that replaces the update (a parameter-server worker) calls it
 * before it sends the gradient. Training thread. */
void trainer_clip_gradients(struct trainer *t);

/* Saves a checkpoint of the current state to `path`. */
int trainer_save(struct trainer *t, const char *path, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Saves a checkpoint of the current state where cfg.checkpoint says (a
 * stage: its own file beside it, train_stage_checkpoint_path); 0 without
 * one. */
int trainer_checkpoint(struct trainer *t, struct rumor_err *e) RUMOR_MUST_CHECK;

#endif /* RUMOR_PEER_TRAIN_H */
