/*
 * model — the interface every model implements, the parameter table that
 * everything else reads, and the optimisers over the flat buffers.
 *
 * A model is named by a spec string ("mlp:784-512-256-10"); its family
 * (the part before ':') picks the implementation. Parameters, gradients and
 * optimiser state are each ONE flat buffer. Where each parameter lives in
 * the buffer, its checkpoint name and shape, whether weight decay applies
 * and which pipeline unit it belongs to are the model's parameter table
 * (struct model_table): checkpoints, the pipeline split, stage training, the
 * optimiser's decay mask, the drift sketch and every size check read it, and
 * no file outside peer/model/ knows a model's layout.
 *
 * Units: a model is a chain of units (the MLP's layers, a transformer's
 * blocks), the grain at which a pipeline splits it. Unit u's parameters form
 * one contiguous range of the flat buffer, and the units follow each other
 * in order, so the parameters of units [u0, u1) — one pipeline stage — are
 * one contiguous range too. Rows are the unit of data: one sample of the
 * MLP, one sequence of a language model. Between units the activations are
 * `model_boundary(spec, u)` floats per row.
 *
 * Threads: a model belongs to the thread that drives its backend.
 */
#ifndef RUMOR_PEER_MODEL_H
#define RUMOR_PEER_MODEL_H

#include <stdint.h>

#include "tensor/tensor.h"

struct json_t; /* jansson's value (util/json_text.h) */

#define MODEL_SPEC_MAX 256  /* characters of a canonical spec string, with the NUL */
#define MODEL_NAME_MAX 96   /* characters of a parameter's name, with the NUL */
#define MODEL_MAX_UNITS 258 /* pipeline units of one model */
#define MODEL_MAX_STASH 2048 /* per-micro-batch activation tensors of one stage */
#define MLP_MAX_LAYERS 16
#define MLP_MAX_WIDTH (1 << 20)
#define GPT_MAX_LAYERS 128
#define GPT_MAX_WIDTH (1 << 16)
#define GPT_MAX_CONTEXT (1 << 16)
#define GPT_MAX_VOCAB (1 << 20)
#define GPT_MAX_EXPERTS 64
#define GPT_MOE_CAPACITY_PCT 125 /* the default capacity factor, 1.25 (Switch Transformer) */
#define MODEL_MOE_AUX_WEIGHT 0.01  /* the load-balancing loss's default weight α (Switch Transformer) */
#define MODEL_MOE_Z_WEIGHT 0.001   /* the router z-loss's default weight β (ST-MoE) */

/* ---- specs ------------------------------------------------------------------- */

enum model_family { MODEL_MLP = 1, MODEL_GPT = 2 };
enum mlp_act { MLP_ACT_RELU = 0, MLP_ACT_GELU = 1 };

/* A parsed spec: the family and its hyperparameters. A value that may be
 * copied; only peer/model/ reads the union (everyone else asks the functions
 * below). */
struct model_spec {
  enum model_family family;
  union {
    struct {
      int nlayers;                          /* linear layers, >= 1 */
      int64_t widths[MLP_MAX_LAYERS + 1];   /* widths[0] inputs ... widths[nlayers] outputs */
      enum mlp_act act;                     /* between layers, not after the last */
    } mlp;
    struct {
      int layers, heads;
      int64_t width, context, vocab; /* C (a multiple of heads), T, V */
      /* Mixture of experts (0 experts: dense): every moe_every-th block
       * (blocks l with (l + 1) % moe_every == 0) has `experts` MLPs and a
       * router sending each token to its top `topk`, each expert taking
       * at most capacity_pct / 100 · N · topk / experts of a pass's N
       * tokens (gpt_moe.c). Spec parts E, K, M and F (percent). */
      int experts, topk, moe_every, capacity_pct;
    } gpt;
  } u;
};

/* Parses a spec string: "mlp:784-512-256-10[:relu|:gelu]",
 * "gpt:L6-H6-C384-T256-V256", or a preset name: "gpt2" (L12-H12-C768-T1024-
 * V50257), "gpt2-medium", "gpt2-large", "gpt2-xl" (GPT-2's other sizes).
 * Returns 0 or RUMOR_EFORMAT with a message that quotes the spec and names
 * the bad part. */
int model_spec_parse(const char *s, struct model_spec *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The canonical spec string: parse(format(s)) == s. */
void model_spec_format(const struct model_spec *s, char *buf, size_t len);
/* True when both name the same architecture. */
bool model_spec_equal(const struct model_spec *a, const struct model_spec *b);

/* What a model takes and gives, per row. */
struct model_io {
  enum tensor_dtype input_dtype; /* TENSOR_F32 features (MLP), TENSOR_I32 tokens (GPT) */
  int64_t input_per_row;         /* values per row that unit 0 reads */
  int64_t labels_per_row;        /* targets per row */
  int64_t classes;               /* logits per target */
};
void model_spec_io(const struct model_spec *s, struct model_io *out);
int model_spec_units(const struct model_spec *s);
/* "layer" or "block": what one unit is, for messages. */
const char *model_spec_unit_noun(const struct model_spec *s);
/* Floats per row entering unit u, 0 < u < units: what one pipeline stage
 * sends the next. */
int64_t model_spec_boundary(const struct model_spec *s, int u);
/* Multiply-adds of training one row through unit u: forward, weight
 * gradient and, except for unit 0, input gradient. */
int64_t model_spec_unit_macs(const struct model_spec *s, int u);
/* A short description of units [u0, u1) for logs, e.g. "784-512-256". */
void model_spec_describe_units(const struct model_spec *s, int u0, int u1, char *buf, size_t n);

/* ---- the parameter table ---------------------------------------------------------- */

struct model_param {
  char name[MODEL_NAME_MAX];     /* checkpoint name, e.g. "layers.0.weight" */
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS]; /* as stored, row-major, in memory and in checkpoints */
  int64_t offset;                /* elements from the start of the whole model's flat buffer */
  int64_t numel;
  bool decay;                    /* weight decay applies (matrices, not biases) */
  int unit;                      /* the pipeline unit it belongs to */
};

/* A model's parameters in flat-buffer order (offsets ascending, without gaps;
 * units ascending). */
struct model_table {
  struct model_param *p;
  size_t n;
  int nunits;
  int64_t nparams;                        /* elements in all */
  int64_t unit_offset[MODEL_MAX_UNITS + 1]; /* unit u holds [unit_offset[u], unit_offset[u+1]) */
  int tied_entry; /* an entry of unit 0 that the last unit uses too (GPT's wte; model_tied), or -1 */
};

void model_table_build(const struct model_spec *s, struct model_table *t);
void model_table_free(struct model_table *t);
/* The entry named `name`, or NULL. */
const struct model_param *model_table_find(const struct model_table *t, const char *name);
/* Elements of the whole model (builds the table). */
int64_t model_spec_param_count(const struct model_spec *s);

/* Hugging Face's config.json for the model, a new JSON object (the caller
 * json_decref's it), when its family has one (GPT: GPT2Config); NULL when it
 * has none. */
struct json_t *model_hf_config(const struct model_spec *s);
/* The spec a Hugging Face config.json describes (`text`, `len` bytes;
 * `name` for messages): model_type "gpt2" with n_layer, n_head, n_embd,
 * n_positions and vocab_size. Returns 0 or RUMOR_EFORMAT naming the file and
 * the fault (not JSON, another model type, a missing or bad field, an
 * activation other than GPT-2's). */
int model_spec_from_hf_config(const char *text, size_t len, const char *name, struct model_spec *out,
                              struct rumor_err *e) RUMOR_MUST_CHECK;
/* What a tensor name in a Hugging Face checkpoint is to this spec's table:
 * the entry (written into *entry), one to ignore (buffers such as GPT-2's
 * attn.bias, or lm_head.weight, tied to the embedding), or unknown. Names
 * are taken with or without GPT2LMHeadModel's "transformer." prefix. */
enum model_hf_name { MODEL_HF_ENTRY, MODEL_HF_IGNORE, MODEL_HF_UNKNOWN };
enum model_hf_name model_hf_lookup(const struct model_table *t, const char *name, const struct model_param **entry);

/* ---- a model on a backend ----------------------------------------------------------- */

struct model_family_ops; /* private: peer/model/model_impl.h */

/* ---- tensor parallelism (Megatron) ---------------------------------------------------
 *
 * A tensor-parallel (TP) rank r of a group of T holds only its slices of
 * the model (model_init_tp): a GPT's attention by heads (q, k and v of heads
 * [r·H/T, (r+1)·H/T)), its attention output projection by input rows, its
 * MLP's c_fc by output columns and c_proj by input rows, and the token
 * embedding (and so the tied LM head) by vocabulary rows; LayerNorms, wpe
 * and the biases added after a row-parallel product are replicated (every
 * rank holds them whole). An MLP's layers alternate column-parallel (output
 * units split) and row-parallel (input units split), starting with a column
 * layer; a last layer that would be column-parallel is replicated instead,
 * so every rank ends with the whole logits. A dimension of n that does not
 * divide by T is cut as model_tp_chunk cuts it.
 *
 * Communication is Megatron's pair of conjugate operators: identity forward
 * and all-reduce backward before a column-parallel product, all-reduce
 * forward and identity backward after a row-parallel one. Per GPT block two
 * all-reduces of (rows·T, C) forward (after the attention projection and
 * after the MLP's) and two backward (the gradients of the LayerNorm outputs
 * entering c_attn and c_fc); the embedding adds one forward, the head one
 * backward, the vocabulary-parallel loss one of (T + 1)·targets floats. No
 * rank ever holds a whole row of logits. The gradients of replicated
 * parameters come out identical on every rank.
 *
 * With T = 1 a rank is the whole model and its passes are bit for bit
 * model_init's.
 *
 * Pipeline stages compose: a rank may hold units [u0, u1) (T×S processes,
 * rank r of stage s exchanging activations with rank r of stages s ± 1;
 * a boundary inside an MLP's column/row pair carries the rank's columns).
 * On a head stage without unit 0, model_tied's copy holds the rank's
 * vocabulary rows of wte (tp_layout.local's entry), kept equal to those of
 * the same rank of stage 0.
 */
#define MODEL_TP_MAX 256 /* ranks of one tensor-parallel group */

/* The collectives of a TP rank, supplied by its caller; shared by the
 * rank's models (a pipeline stage's one), outlives them. */
struct model_tp {
  int rank, size; /* 0 <= rank < size <= MODEL_TP_MAX */
  /* Sums the first n floats of t (a tensor on the model's backend) across
   * the group's ranks, in place, every rank ending with identical values.
   * Every rank calls it in the same order with the same n. The callback
   * does whatever the backend needs: wait for the work enqueued on t,
   * copy it through host memory, copy the sum back before the backend's
   * next op reads it. Returns 0 or a negative code with a message in e. */
  int (*all_reduce)(void *arg, struct tensor *t, int64_t n, struct rumor_err *e);
  void *arg;
  /* The passes (model_forward, _backward, _loss, _score, _evaluate) are
   * void: they only enqueue work. When all_reduce fails they record the
   * first failure here (`failed` its code, `err` its message), skip every
   * later all_reduce (so no rank blocks on a group that is gone) and go on
   * computing garbage. The caller checks `failed` after each step and
   * stops the group; it clears both before reusing the struct. */
  int failed;
  struct rumor_err err;
};

/* How a rank holds one table entry. */
struct model_tp_slice {
  int dim;        /* the dimension split across ranks, or -1: replicated (held whole) */
  int groups;     /* dim is `groups` equal blocks, each cut across the ranks (c_attn's q|k|v: 3), else 1 */
  int64_t lo, hi; /* this rank's range [lo, hi) within each block (model_tp_chunk of the block's length) */
};

/* A rank's slices of a whole model: `local` is the rank's own parameter
 * table (the whole table's names, units and decay, the local shapes, and
 * offsets into the rank's flat buffer: entries in table order without gaps,
 * so each unit and each run of units is one contiguous range, as in a whole
 * model), slice[i] how table entry i is cut. */
struct model_tp_layout {
  int size, rank;
  struct model_table local;
  struct model_tp_slice *slice; /* (local.n), owner */
};

/* The range [*lo, *hi) of rank r when n is cut into `size` contiguous
 * chunks: the first n mod size ranks get one more (comm_chunk's cut). */
void model_tp_chunk(int64_t n, int size, int r, int64_t *lo, int64_t *hi);
/* 0 when `spec` splits over `size` ranks, else RUMOR_EFORMAT naming the spec,
 * the size and why (a GPT's heads not a multiple of it, a width or a
 * vocabulary smaller than it, a size outside [1, MODEL_TP_MAX]). */
int model_tp_check(const struct model_spec *spec, int size, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Builds rank `rank`'s layout (free with model_tp_layout_free). Returns 0
 * or model_tp_check's error. */
int model_tp_layout_build(const struct model_spec *spec, int size, int rank, struct model_tp_layout *out,
                          struct rumor_err *e) RUMOR_MUST_CHECK;
void model_tp_layout_free(struct model_tp_layout *l);
/* Elements of rank `rank`'s flat buffer (all units). */
int64_t model_tp_local_params(const struct model_spec *spec, int size, int rank);
/* The whole model's flat buffer (model_spec_param_count floats) → rank
 * `rank`'s (model_tp_local_params floats), and back: gather writes the
 * rank's slices into `full` and leaves the other ranks' parts untouched
 * (replicated entries are written by every rank, whole), so gathering every
 * rank rebuilds the whole buffer, and scatter then gather is the identity
 * on a rank's slices. Pure host functions; (spec, size) must pass
 * model_tp_check (asserted). A pipeline stage holding units [u0, u1) holds
 * local.unit_offset[u0] .. local.unit_offset[u1] of the rank's buffer. */
void model_tp_scatter(const struct model_spec *spec, int size, int rank, const float *full, float *local);
void model_tp_gather(const struct model_spec *spec, int size, int rank, const float *local, float *full);

/* ---- expert parallelism -----------------------------------------------------------------
 *
 * An expert-parallel (EP) rank r of P (model_use_ep) holds the whole model
 * but runs only experts [lo, hi) of each mixture-of-experts block
 * (model_ep_experts: comm_chunk's cut of E). Every rank routes its own
 * tokens, and the ranks' passes make one pass over the union of their
 * tokens, in rank order, exactly as one process would run it on the
 * concatenated rows: the capacity comes from the total tokens, the expert
 * buffers' slots are taken in (choice k, rank, token) order, and the
 * load-balancing loss's f_e and P_e are over all of them.
 *
 * Per MoE block and micro-batch, forward: one all-gather of 2 + K·E + E
 * floats per rank (tokens, choices per k and expert, router sums), then an
 * all-to-all carrying the kept tokens' rows (C floats each) to their
 * experts' ranks and one carrying the experts' outputs back; backward: the
 * two all-to-alls again (output gradients there, input gradients back).
 * The gradients of the experts a rank does not run are 0 there (written, or
 * left as they are when accumulating; with model_ep.own_experts_only not
 * touched at all), and every other gradient is the rank's own tokens'
 * part: summing the ranks' gradients (the data-parallel all-reduce of the
 * trainer) gives the single process's gradient. A rank's own experts'
 * gradients are already the sum over the ranks' tokens.
 *
 * A rank reads and writes only its own experts' parameters; which of the
 * others it holds, and how current they are, is the caller's (the trainer
 * at ZeRO 0 keeps them all equal; at ZeRO 1-3 it moves experts' weights
 * and gradients only to and from the ranks that run them). Every rank must
 * run the same passes in the same order with the same MoE blocks (the
 * collectives pair them up).
 */
#define MODEL_EP_MAX 64 /* ranks of one expert-parallel group (at least one expert each) */
struct model_ep {
  int rank, size; /* 0 <= rank < size <= the experts of a block (<= MODEL_EP_MAX) */
  /* Collectives over the P ranks, supplied by the caller, on host float
   * buffers: all_gather fills buf[j·each .. (j+1)·each) with rank j's (its
   * own already in place); all_to_all is comm_all_to_all's contract.
   * Return 0 or a negative code with a message in e. */
  int (*all_gather)(void *arg, float *buf, int64_t each, struct rumor_err *e);
  int (*all_to_all)(void *arg, const float *send, const int64_t *send_counts, float *recv,
                    const int64_t *recv_counts, struct rumor_err *e);
  /* Stops the group for `why` (comm_abort): called when this rank finds
   * another's routing plan impossible, so no rank waits for it. */
  void (*abort)(void *arg, const char *why);
  void *arg;
  /* The caller sets it around passes whose rows are padding (a rank with
   * no row of an evaluation batch still takes part in its collectives): the
   * rank then routes none of them. No backward may follow such a pass. */
  bool ghost;
  /* Set by the caller when it takes the experts' gradients from their
   * ranks only: the backward then leaves the gradients of other ranks'
   * experts untouched (no zeros written, no memory touched) instead of
   * writing 0 there. */
  bool own_experts_only;
  /* As model_tp's: the first failure (the passes then skip every later
   * collective and compute garbage); the caller checks after each step. */
  int failed;
  struct rumor_err err;
};

struct model {
  struct model_spec spec;
  struct model_table table; /* the whole model's */
  struct model_io io;
  const struct model_family_ops *ops;
  tensor_backend_t be;
  /* The units this model holds: [u0, u1), all of them unless built for one
   * stage of a pipeline. params and grads hold exactly these units' entries,
   * starting at param_base elements into the whole model's layout. */
  int u0, u1;
  int64_t param_base;
  int64_t nparams;
  struct tensor params; /* (nparams) flat, owner */
  struct tensor grads;  /* (nparams) flat, owner */

  /* Workspace for up to max_rows rows. */
  int64_t max_rows;
  int64_t positions;    /* model_set_positions' t when not the default, else 0 */
  struct tensor labels; /* (max_rows · labels_per_row) I32, filled by the caller */
  struct tensor losses; /* (max_rows · labels_per_row) per-target losses of the last loss */
  /* Per-micro-batch activations: every tensor a forward pass writes and a
   * backward pass reads, the input of unit u0 and the output of unit u1 − 1
   * included. The pipeline keeps one such set per micro-batch in flight and
   * binds it by assigning through these pointers (views, not owners). */
  struct tensor *stash[MODEL_MAX_STASH];
  int nstash;
  void *impl; /* the family's workspace */

  /* A tensor-parallel rank (model_init_tp): its collectives (the caller's)
   * and slices; NULL and zero in a whole model. In a rank, params and grads
   * hold its slices in tp_layout.local's layout, param_base and nparams
   * count in that layout, and model_act of a split boundary (an MLP's
   * between a column and a row layer, a GPT's logits) holds the rank's
   * columns only (model_act_width says how many). */
  struct model_tp *tp;
  struct model_tp_layout tp_layout;

  /* A mixture-of-experts model (model_spec's experts > 0): the auxiliary
   * losses' weights (model_set_moe_losses; defaults 0.01 and 0.001), the
   * loss gradient's scale per target of the backward to come (model_loss
   * sets it; model_set_loss_scale on stages without the loss), and the
   * figures of the forward passes since model_moe_stats_reset. */
  double moe_aux_weight, moe_z_weight;
  int moe_blocks; /* the mixture-of-experts blocks among this model's units */
  struct model_ep *ep; /* an expert-parallel rank's collectives (model_use_ep; the caller's), or NULL */
  float loss_scale;
  struct model_moe_stats {
    double aux_loss, z_loss; /* summed over every block's forward pass (weights applied) */
    int64_t passes;          /* MoE blocks' forward passes: moe_blocks per micro-batch */
    int64_t choices, dropped; /* token-expert choices made and dropped for capacity */
    int64_t load[GPT_MAX_EXPERTS]; /* choices per expert, over every MoE block */
  } moe_stats;
};

/* The table whose offsets and shapes index m->params and m->grads: a
 * tensor-parallel rank's own (tp_layout.local), else the whole model's. */
static inline const struct model_table *model_own_table(const struct model *m) {
  return m->tp ? &m->tp_layout.local : &m->table;
}

/* Allocates parameters, gradients and workspace for units [u0, u1) of
 * `spec` on `be` (0 <= u0 < u1 <= units). Parameters are uninitialised until
 * model_init_params or a load. Returns 0 or a negative code with a message
 * (e.g. the model does not fit on the device). */
int model_init(struct model *m, const struct model_spec *spec, int u0, int u1, tensor_backend_t be, int64_t max_rows,
               struct rumor_err *e) RUMOR_MUST_CHECK;
/* model_init for tensor-parallel rank tp->rank of tp->size (see "tensor
 * parallelism" above): the same units, the rank's slices of them. m->table
 * stays the whole model's table. model_init_params gives the rank exactly
 * model_tp_scatter of the whole model's initial values. Returns 0, the
 * model_tp_check error (RUMOR_EFORMAT naming spec and size), or
 * model_init's errors. */
int model_init_tp(struct model *m, const struct model_spec *spec, int u0, int u1, tensor_backend_t be,
                  int64_t max_rows, struct model_tp *tp, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The same for every unit. */
int model_init_full(struct model *m, const struct model_spec *spec, tensor_backend_t be, int64_t max_rows,
                    struct rumor_err *e) RUMOR_MUST_CHECK;
void model_free(struct model *m);

/* The family's initialisation, drawn from `seed` on the host, identical on
 * every backend; each unit has its own stream, so a stage's units get
 * exactly the values the whole model's would. */
void model_init_params(struct model *m, uint64_t seed);

/* The tensor holding the input of unit `u` (u0 <= u <= u1; u == u1 is the
 * output of unit u1 − 1, the logits when u1 is the last unit), shaped
 * (max_rows, per-row values). The caller fills model_act(m, u0) before a forward
 * pass; pipeline stages exchange these. */
struct tensor *model_act(struct model *m, int u);
/* Values per row of model_act(m, u), and their dtype. */
int64_t model_act_width(const struct model *m, int u);
enum tensor_dtype model_act_dtype(const struct model *m, int u);
/* Floats from one target's logits to the next's in the logits
 * (model_act(m, units)): io.classes, or more where the family pads each
 * target's logits (a GPT: V rounded up to a multiple of 64, so that a GPU
 * reads aligned rows). A target's classes are the first io.classes floats
 * (on a tensor-parallel GPT rank, those of its vocabulary share: gpt.c),
 * and the floats after them up to the stride are padding that no pass
 * reads and whose value is unspecified (tensor.h, "padded rows"). Padding is internal to the
 * passes: the parameters, and so everything outside the model, are the
 * same without it. */
int64_t model_logits_stride(const struct model *m);

/* A parameter that two units use (GPT's token embedding: unit 0 gathers
 * from it, the head multiplies by it). A model that holds the head but not
 * unit 0 (the last stage of a pipeline) works on its own copy of it, outside
 * params and grads: model_tied returns that copy, its gradient (written by
 * the head's backward like any other gradient) and the table entry it
 * copies, or NULL when the model has none. Whoever splits the model keeps
 * the copy equal to unit 0's value and adds the copy's gradient to unit
 * 0's. In a model holding both users, a backward without `accumulate`
 * writes the gradient in the first user's backward and adds in the other's. */
const struct model_param *model_tied(struct model *m, struct tensor **param, struct tensor **grad);

/* Language models: the passes that follow run on sequences of t positions,
 * 1 <= t <= the spec's context (which is the default), so that sampling
 * runs on the tokens so far: a row's input is then t tokens, its labels and
 * losses t, its logits t·classes, all packed. Returns false (and does
 * nothing) for models without positions. */
bool model_set_positions(struct model *m, int64_t t);

/* Forward pass through units [a, b) (u0 <= a < b <= u1) on model_act(a)
 * (`rows` rows), leaving model_act(b). Only enqueues work. */
void model_forward(struct model *m, int a, int b, int64_t rows);
/* Backward pass through units [a, b) after model_forward over the same
 * rows: `dout` holds dL/d model_act(b) (rows × width; overwritten). Writes
 * the units' gradients into grads (overwriting them, or adding to them when
 * `accumulate`) and, when `din` is not NULL, dL/d model_act(a) into `din`
 * (a buffer of its own; a must be > 0 or the input must be floats). */
void model_backward(struct model *m, int a, int b, int64_t rows, struct tensor *dout, struct tensor *din,
                    bool accumulate);

/* Loss at the logits (model_act(units), u1 must be the last unit) for the
 * labels: fills losses and writes grad_scale·dL/dlogits into `dlogits`
 * (rows·labels_per_row × model_logits_stride, the classes of each target
 * written, its padding left as it was; may be the logits themselves). */
void model_loss(struct model *m, int64_t rows, struct tensor *dlogits, float grad_scale);
/* Targets in `rows` rows: the count a mean loss divides by. */
int64_t model_targets(const struct model *m, int64_t rows);
/* The loss gradient's scale per target for the next backward pass
 * (model_loss sets it; a pipeline stage without the loss sets it itself):
 * a mixture-of-experts model scales its auxiliary losses' gradients alike,
 * so they add up over micro-batches as the main loss does. */
void model_set_loss_scale(struct model *m, float scale);
/* The auxiliary losses' weights of a mixture-of-experts model: Switch's
 * load-balancing loss α·E·Σ f_e·P_e and the router z-loss β·mean(lse²). */
void model_set_moe_losses(struct model *m, double aux_weight, double z_weight);
/* Clears the figures model_moe_stats gathers. */
void model_moe_stats_reset(struct model *m);
/* A dense GPT's parameters (`params`, its flat layout) into those of the
 * mixture of experts `moe` of the same shape (upcycling): every expert of a
 * mixture-of-experts block starts as a copy of that block's dense MLP, each
 * router from N(0, 0.02) drawn with `seed`, everything else as it is. out:
 * model_spec_param_count(moe) floats. Returns 0, or RUMOR_ESHAPE naming
 * both when moe is not dense's shape with experts. */
int model_upcycle(const struct model_spec *dense, const float *params, const struct model_spec *moe, uint64_t seed,
                  float *out, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Experts [*lo, *hi) of an expert-parallel rank of `size` (see "expert
 * parallelism" above). */
void model_ep_experts(const struct model_spec *s, int size, int rank, int *lo, int *hi);
/* Unit u's experts in m's flat buffers (relative to param_base): true for
 * a mixture-of-experts block, with *first the offset of expert 0's first
 * entry and *per the floats of one expert (its entries follow each other,
 * expert after expert: expert x is [first + x·per, first + (x+1)·per));
 * false for any other unit. */
bool model_ep_expert_span(const struct model *m, int u, int64_t *first, int64_t *per);
/* 0 when `spec` can be split over `size` expert-parallel ranks (a GPT with
 * mixture-of-experts blocks and at least `size` experts), else
 * RUMOR_EFORMAT naming the spec and why. */
int model_ep_check(const struct model_spec *spec, int size, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Makes m (model_init'd, not a tensor-parallel rank, before its first pass
 * and before a pipeline binds its stash) expert-parallel rank ep->rank of
 * ep->size: allocates the buffers the exchanges need (the owner side for
 * ep->size times the rows) and keeps `ep` (the caller's; it outlives m).
 * Returns 0, model_ep_check's error or an allocation error. */
int model_use_ep(struct model *m, struct model_ep *ep, struct rumor_err *e) RUMOR_MUST_CHECK;

/* One training step's math on the batch in model_act(0) / labels: forward,
 * mean loss, backward into grads. Only enqueues work. */
void model_forward_backward(struct model *m, int64_t rows);
/* The mean of the last loss over `rows` rows (waits for it). */
float model_mean_loss(const struct model *m, int64_t rows);

/* Scores logits already in model_act(units) after a forward pass: adds to
 * *correct the targets whose argmax logit equals the label (`labels_host`,
 * rows · labels_per_row, also copied into m->labels by the caller) and to
 * *loss_sum their summed loss. */
void model_score(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct, double *loss_sum);
/* Forward over every unit, then model_score. */
void model_evaluate(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct, double *loss_sum);

/* ---- optimisers -------------------------------------------------------------------- */

/*
 * The optimiser's state is ONE flat buffer on the model's backend: (P) for
 * SGD's momentum, (2P) for AdamW's first and second moments (m then v), so it
 * checkpoints and transfers as one piece. Weight decay applies to the table
 * entries marked `decay` only.
 */
enum optim_kind { OPTIM_SGD = 0, OPTIM_ADAMW = 1 };
enum optim_schedule { OPTIM_SCHED_CONSTANT = 0, OPTIM_SCHED_COSINE = 1 };

struct optim_config {
  enum optim_kind kind;
  double lr;           /* peak learning rate */
  double momentum;     /* SGD */
  bool nesterov;       /* SGD */
  double weight_decay; /* L2 for SGD (PyTorch style), decoupled for AdamW; on `decay` entries */
  double beta1, beta2, eps; /* AdamW */
  enum optim_schedule schedule;
  int64_t warmup_steps; /* linear warm-up from lr/warmup to lr */
};

/* Defaults: SGD, lr 0.05, momentum 0.9, no weight decay, cosine schedule. */
void optim_config_default(struct optim_config *c);
/* Parses "sgd" / "adamw" and "constant" / "cosine". RUMOR_EFORMAT otherwise. */
int optim_kind_parse(const char *s, enum optim_kind *out) RUMOR_MUST_CHECK;
int optim_schedule_parse(const char *s, enum optim_schedule *out) RUMOR_MUST_CHECK;
const char *optim_kind_name(enum optim_kind k);
const char *optim_schedule_name(enum optim_schedule s);
/* Number of state floats per parameter: 1 (SGD) or 2 (AdamW). */
int optim_state_per_param(enum optim_kind k);
/* Checkpoint names of the state's parts (optim_state_per_param of them),
 * e.g. "optimizer.exp_avg". */
const char *optim_state_name(enum optim_kind k, int part);

/* A run of parameters with one decay setting: [offset, offset + count) of
 * the model's flat buffer. */
struct optim_span {
  int64_t offset, count;
  bool decay;
};

struct optim {
  struct optim_config cfg;
  int64_t nparams;
  int64_t lo;          /* the first flat position it updates: 0, or optim_init_range's lo */
  struct tensor state; /* (P) or (2P) flat, owner; zero-initialised */
  int64_t step;        /* updates applied so far */
  struct optim_span *spans; /* the decay mask of the model's table, merged into runs */
  size_t nspans;
};

/* An optimiser for the parameters model `m` holds. */
int optim_init(struct optim *o, const struct optim_config *cfg, const struct model *m,
               struct rumor_err *e) RUMOR_MUST_CHECK;
/* An optimiser for the flat positions [lo, hi) of table `tab`'s buffer (a
 * parameter server's range): the single process's update restricted to
 * them, its decay mask cut to the range; state on backend `be`. */
int optim_init_range(struct optim *o, const struct optim_config *cfg, const struct model_table *tab, int64_t lo,
                     int64_t hi, tensor_backend_t be, struct rumor_err *e) RUMOR_MUST_CHECK;
void optim_free(struct optim *o);

/* The learning rate for update number `step` (0-based) of `total_steps`. */
double optim_lr_at(const struct optim_config *c, int64_t step, int64_t total_steps);

/* Applies one update with learning rate `lr` and increments o->step. */
void optim_apply(struct optim *o, struct tensor *params, const struct tensor *grads, double lr);

#endif /* RUMOR_PEER_MODEL_H */
