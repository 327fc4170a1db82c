/*
 * gpt_impl.h — what GPT's files share (private to peer/model/): the table's
 * entry order, the workspace of a GPT model (its views, stashed
 * activations and scratch) and the mixture-of-experts MLP (gpt_moe.c) the
 * passes of gpt.c call in a mixture-of-experts block.
 */
#ifndef RUMOR_PEER_MODEL_GPT_IMPL_H
#define RUMOR_PEER_MODEL_GPT_IMPL_H

#include "peer/model/tp_impl.h"

#define GP(s) (&(s)->u.gpt)
/* The layer norms' epsilon as config.json states it: TENSOR_LAYERNORM_EPS
 * (a float), written as the double Python reads. */
#define GPT_HF_LAYERNORM_EPS 1e-5
/* The logits' row stride in floats is the vocabulary the model holds (V,
 * or a tensor-parallel rank's share) rounded up to a multiple of this, so
 * that on a GPU the tied head's products and the cross-entropy read and
 * write aligned rows (llm.c pads GPT-2's 50257 to 50304 for the same
 * reason). Only the logits are padded: the parameters, and so checkpoints,
 * Hugging Face files, gossip and parameter counts, keep V rows (gpt.c). */
#define GPT_LOGITS_ALIGN 64

/* Table entries per block, in flat-buffer order. A mixture-of-experts
 * block (gpt_block_is_moe) has the first B_ROUTER, then the router (C, E)
 * and X_NPARAMS per expert (an MLP's c_fc and c_proj, weight and bias). */
enum {
  B_LN1_W, B_LN1_B, B_ATTN_W, B_ATTN_B, B_PROJ_W, B_PROJ_B,
  B_LN2_W, B_LN2_B, B_FC_W, B_FC_B, B_MPROJ_W, B_MPROJ_B, B_NPARAMS
};
enum { B_ROUTER = B_FC_W };
enum { X_FC_W, X_FC_B, X_PROJ_W, X_PROJ_B, X_NPARAMS };

/* A mixture-of-experts block's activations for one micro-batch (gpt_moe.c;
 * N = max_rows·T tokens, cap = gpt_moe_capacity of N). */
struct gpt_moe_acts {
  struct tensor probs;          /* (N, E): the router's softmax */
  struct tensor lse;            /* (N): its log-sum-exp */
  struct tensor expert, slot;   /* (N, K) I32: each choice's expert and row in its buffer (−1: dropped) */
  struct tensor gate;           /* (N, K) */
  struct tensor assigned, kept; /* (E) I32: choices of each expert, and rows it kept */
  struct tensor psum;           /* (E): Σ_n probs[n, e] */
  struct tensor daux;           /* (E): α·E·f_e of the pass, the load-balancing loss's gradient per unit scale */
  struct tensor hpre;           /* (E·cap, 4C): each expert's c_fc output, before GELU (EP: the rank's experts',
                                   (orows, 4C)) */
  struct tensor ye;             /* (E·cap, C): each expert's output (EP: the rank's kept choices' outputs, packed,
                                   (nk, C)) */
  /* An expert-parallel rank's (gpt_moe_ep.c), unallocated otherwise: */
  struct tensor prow;           /* (N, K) I32: each choice's row in the rank's packed buffers, or −1 (dropped) */
  struct tensor plan;           /* (P·W): the pass's all-gathered counts (gpt_moe_ep.c's head) */
  struct tensor xo;             /* (orows, C): the inputs of this rank's experts (the rows every rank sent) */
  struct tensor oex, osl;       /* (orows, 1) I32: each received row's expert (local index) and slot */
};

/* A block's activations for one micro-batch (the pipeline's stash); the
 * widths are the model's own (struct gpt_ws). */
struct gpt_block_acts {
  struct tensor qkv;    /* (max_rows, T, 3·cl): the (local) heads' q | k | v */
  struct tensor att;    /* (max_rows, T, cl): attention output before c_proj */
  struct tensor lse;    /* (max_rows, hl, T) */
  struct tensor mid;    /* (max_rows, T, C): the residual after attention */
  struct tensor fc;     /* (max_rows, T, fl): c_fc's output, before GELU */
  struct tensor ln1_mean, ln1_rstd, ln2_mean, ln2_rstd; /* (max_rows·T) */
  struct gpt_moe_acts moe;  /* a mixture-of-experts block's (fc unused) */
};

/* The scratch of a model's mixture-of-experts blocks (shared by them;
 * never live across two passes). */
struct gpt_moe_scratch {
  int64_t cap;               /* gpt_moe_capacity of max_rows·T tokens */
  struct tensor logits;      /* (N, E): the router's logits, then their gradient */
  struct tensor xe, dxe, dye; /* (E·cap, C): the experts' inputs, their gradient, their outputs' gradient */
  struct tensor h;           /* (E·cap, 4C): the GELU output, then its gradient */
  struct tensor dgate;       /* (N, K) */
  struct tensor daux;        /* (E): the scaled daux of the backward */
  float *host;               /* (2E) host floats: a pass's psum and its load-balancing gradient */
  /* An expert-parallel rank's (gpt_moe_ep.c): xe, dxe and dye then hold
   * the rank's kept choices packed, (nk, C), and h (orows, 4C). */
  int64_t nk, orows;         /* max_rows·T·K; the rows the rank's experts can take, (E/P rounded up)·capg */
  int64_t capg;              /* gpt_moe_capacity of P·max_rows·T tokens */
  struct tensor zeros;       /* (nk, 1) I32 zeros: the one "expert" of the packed buffers */
  struct tensor ones;        /* (orows, 1): the gates of the rank's gathers */
  struct tensor ob, oy, odx; /* (orows, C): rows received (or to send), the experts' outputs (then their
                                gradients), their inputs' gradients */
  float *hsend, *hrecv;      /* (max(nk, orows)·C) host, tensor_host_alloc'd */
  float *hplan;              /* (P·W) host */
  int32_t *hidx, *hidx2;     /* (max(nk, orows)) host */
  int64_t *hbase, *hkeep;    /* (P, K, E) host: the plan's runs of slots (gpt_moe_ep.c) */
};

struct gpt_ws {
  /* What the model holds: a whole model H heads, width C, 4C MLP columns,
   * vocabulary rows [0, V); a tensor-parallel rank its share. */
  int hl;                                      /* heads */
  int64_t cl, fl;                              /* attention width (hl·C/H) and MLP width */
  int64_t vlo, vl;                             /* the vocabulary rows [vlo, vlo + vl) of wte and the logits */
  int64_t vld;                                 /* the logits' row stride: vl rounded up to GPT_LOGITS_ALIGN */
  struct tensor p[GPT_MAX_LAYERS][B_NPARAMS];  /* views into params (the model's own shapes) */
  struct tensor g[GPT_MAX_LAYERS][B_NPARAMS];  /* views into grads */
  struct tensor wte, wpe, lnf_w, lnf_b;       /* views (wte (vl, C): into params or the tied copy) */
  struct tensor dwte, dwpe, dlnf_w, dlnf_b;
  struct tensor wte_copy, dwte_copy;          /* the tied copy (of a rank's rows), on a head stage without unit 0 */
  bool dwte_written; /* the head wrote dwte in this step's backward and unit 0's has not run yet: set by the
                       head, consumed by unit 0, so a backward run one unit at a time (ZeRO) adds unit 0's
                       share to the head's as a whole-model backward does */
  int64_t positions;                          /* of the passes; 0: the context */
  struct tensor acts[GPT_MAX_LAYERS + 3];     /* acts[u]: the input of unit u; acts[L+2] the (rank's) logits,
                                                 (max_rows·T, vld) of which the first vl columns are classes */
  struct gpt_block_acts blk[GPT_MAX_LAYERS];
  struct tensor lnf_mean, lnf_rstd;           /* (max_rows·T) */
  /* Scratch shared by all units (never live across two passes). */
  struct tensor ln_out, dres, dtmp; /* (max_rows·T, C) */
  struct tensor big;                /* (max_rows·T, max(fl, 3·cl)): the GELU output, then its gradient */
  struct tensor xent;               /* a rank of several: (max(T + 1, 2T)·max_rows·T), the loss's and score's exchange */
  struct gpt_moe_scratch moe;       /* with mixture-of-experts blocks */
};

/* True when block l (from 0) is a mixture-of-experts block. */
bool gpt_block_is_moe(const struct model_spec *s, int l);
/* Table entries of block l, and the index of its first. */
size_t gpt_block_entries(const struct model_spec *s, int l);
size_t gpt_block_first(const struct model_spec *s, int l);

/* Allocates a tensor of the per-micro-batch stash (model.h's stash: the
 * pipeline binds one set per micro-batch in flight). */
int gpt_stashed(struct model *m, struct tensor *t, enum tensor_dtype dt, int ndim, const int64_t *shape,
                struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- the mixture-of-experts MLP (gpt_moe.c) ---- */

/* The first n rows of t as (n, w), and the first n elements. */
static inline struct tensor gpt_rows(const struct tensor *t, int64_t n, int64_t w) {
  int64_t shape[2] = {n, w};
  return tensor_view(t, 0, 2, shape);
}
static inline struct tensor gpt_first(const struct tensor *t, int64_t n) { return tensor_view(t, 0, 1, &n); }

/* Table entry of block l's mixture (x −1: the router; else expert x's
 * X_* entry j) as a view of `flat` (params or grads). */
struct tensor gpt_moe_entry(struct model *m, struct tensor *flat, int l, int x, int j);
/* The buffers an expert's MLP runs on: expert rows [b·cap, b·cap + r) of
 * x, hpre, h (the GELU output, scratch), y (forward's output) or dy and dx
 * (backward's). */
struct gpt_moe_bufs {
  struct tensor *x, *hpre, *h, *y, *dy, *dx;
  int64_t cap;
};
/* Expert x (its parameters) of block l over the r rows of row block b:
 * forward writes hpre and y; backward (hpre and x the forward's) writes
 * the expert's gradients (overwritten, or added to with beta = 1; an
 * expert with r = 0 has zero gradients) and dx. */
void gpt_moe_expert_forward(struct model *m, int l, int x, int b, int64_t r, const struct gpt_moe_bufs *bf);
void gpt_moe_expert_backward(struct model *m, int l, int x, int b, int64_t r, float beta,
                             const struct gpt_moe_bufs *bf);
/* A pass's figures into m->moe_stats and the load-balancing loss's unit
 * gradient α·E·f_e into a->daux: per expert its choices (assigned) and
 * the rows it kept, the router's probabilities summed over the n tokens
 * (psum), and Σ_n lse_n² of them. */
void gpt_moe_add_stats(struct model *m, struct gpt_moe_acts *a, const int32_t *assigned, const int32_t *kept,
                       const float *psum, int64_t n, double lse_sq);
/* The router's backward over n tokens from dgate (n, K): its gradient
 * (overwritten, or added to with beta = 1) and dln += its input's. */
void gpt_moe_router_backward(struct model *m, int l, int64_t n, const struct tensor *ln, const struct tensor *dgate,
                             struct tensor *dln, float beta);
/* gpt_moe_forward and _backward of an expert-parallel rank (gpt_moe_ep.c). */
void gpt_moe_ep_forward(struct model *m, int l, int64_t n, const struct tensor *ln, struct tensor *out);
void gpt_moe_ep_backward(struct model *m, int l, int64_t n, const struct tensor *ln, const struct tensor *dout,
                         struct tensor *dln, float beta);
void gpt_moe_ep_free(struct gpt_moe_scratch *sc, tensor_backend_t be);

/* Rows of each expert's buffer for a pass over n tokens:
 * ceil(capacity_pct / 100 · n · K / E), at least 1. */
int64_t gpt_moe_capacity(const struct model_spec *s, int64_t n);
/* Block l's stashed activations (model stash) and, once per model, the
 * shared scratch. Return 0 or an allocation error. */
int gpt_moe_alloc_acts(struct model *m, struct gpt_moe_acts *a, struct rumor_err *e) RUMOR_MUST_CHECK;
int gpt_moe_alloc_scratch(struct model *m, struct gpt_moe_scratch *sc, struct rumor_err *e) RUMOR_MUST_CHECK;
void gpt_moe_free_scratch(struct gpt_moe_scratch *sc, tensor_backend_t be);
/* out (n, C) ← block l's mixture of experts applied to ln (n, C), ln_2's
 * output: the router, the dispatch to the experts' buffers, each expert's
 * MLP (GPT-2's), the gated combination (0 for a token every chosen expert
 * dropped: the residual carries it). Adds the pass to m->moe_stats. */
void gpt_moe_forward(struct model *m, int l, int64_t n, const struct tensor *ln, struct tensor *out);
/* Its backward from dout (n, C) = dL/d out: the router's and experts'
 * gradients (overwritten, or added to with beta = 1), the load-balancing
 * and z-losses' gradients included (scaled by m->loss_scale), and dln
 * (n, C) ← dL/d ln (overwritten). ln is the forward's, recomputed. */
void gpt_moe_backward(struct model *m, int l, int64_t n, const struct tensor *ln, const struct tensor *dout,
                      struct tensor *dln, float beta);

#endif /* RUMOR_PEER_MODEL_GPT_IMPL_H */
