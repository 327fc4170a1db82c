/*
 * GPT-2: a decoder-only transformer language model, with hand-written
 * backpropagation over the tensor layer's transformer ops.
 *
 * Spec: "gpt:L6-H6-C384-T256-V256" (layers, heads, width, context,
 * vocabulary; the parts in any order, each once), or a preset name ("gpt2",
 * model.c). Architecture as GPT-2's: token and position embeddings, L
 * pre-LayerNorm blocks (causal multi-head self-attention, then a 4C GELU
 * (tanh) MLP, each added to the residual stream), a final LayerNorm and an
 * LM head tied to the token embedding. No dropout.
 *
 * Units: 0 the embeddings, 1..L the blocks, L+1 the final LayerNorm and the
 * head. A row is one sequence of T tokens: unit 0 reads (rows, T) I32 tokens,
 * units exchange (rows, T·C) floats, the head writes (rows, T·V) logits.
 *
 * Layout and names are Hugging Face's GPT2LMHeadModel's, linear weights in
 * its Conv1D layout (in, out), so a checkpoint loads there as is:
 * transformer.wte.weight (V, C), transformer.wpe.weight (T, C),
 * transformer.h.<i>.{ln_1, attn.c_attn, attn.c_proj, ln_2, mlp.c_fc,
 * mlp.c_proj}.{weight, bias}, transformer.ln_f.{weight, bias}; lm_head.weight
 * is wte itself and is not stored. Weight decay applies to the matrices
 * (embeddings included, as nanoGPT and llm.c do), not to biases and
 * LayerNorm gains.
 *
 * The tied head: a model holding unit L+1 but not unit 0 (the last stage of
 * a pipeline) keeps its own copy of wte and of its gradient outside the
 * flat buffers (model_tied); the pipeline adds that gradient to unit 0's and
 * refreshes the copy after each update.
 *
 * Memory: per sequence position and block the backward keeps qkv, the
 * attention output, the residual after attention and the MLP's
 * pre-activation (10·C floats with the block's input) plus LayerNorm
 * statistics and the attention's log-sum-exp; LayerNorm outputs and the
 * GELU output are recomputed in the backward (cheap element-wise passes)
 * into scratch shared by all blocks.
 */
#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/model_impl.h"
#include "util/json_text.h"

#define GP(s) (&(s)->u.gpt)
/* The layer norms' epsilon as config.json states it: TENSOR_LAYERNORM_EPS
 * (a float), written as the double Python reads. */
#define GPT_HF_LAYERNORM_EPS 1e-5

/* Table entries per block, in flat-buffer order. */
enum {
  B_LN1_W, B_LN1_B, B_ATTN_W, B_ATTN_B, B_PROJ_W, B_PROJ_B,
  B_LN2_W, B_LN2_B, B_FC_W, B_FC_B, B_MPROJ_W, B_MPROJ_B, B_NPARAMS
};
static const char *const BLOCK_NAMES[B_NPARAMS] = {
    "ln_1.weight",   "ln_1.bias",   "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight",   "ln_2.bias",   "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};

/* A block's activations for one micro-batch (the pipeline's stash). */
struct gpt_block_acts {
  struct tensor qkv;    /* (max_rows, T, 3C) */
  struct tensor att;    /* (max_rows, T, C): attention output before c_proj */
  struct tensor lse;    /* (max_rows, H, T) */
  struct tensor mid;    /* (max_rows, T, C): the residual after attention */
  struct tensor fc;     /* (max_rows, T, 4C): c_fc's output, before GELU */
  struct tensor ln1_mean, ln1_rstd, ln2_mean, ln2_rstd; /* (max_rows·T) */
};

struct gpt_ws {
  struct tensor p[GPT_MAX_LAYERS][B_NPARAMS];  /* views into params */
  struct tensor g[GPT_MAX_LAYERS][B_NPARAMS];  /* views into grads */
  struct tensor wte, wpe, lnf_w, lnf_b;       /* views (wte: into params or the tied copy) */
  struct tensor dwte, dwpe, dlnf_w, dlnf_b;
  struct tensor wte_copy, dwte_copy;          /* the tied copy, on a head stage without unit 0 */
  bool dwte_written; /* the head wrote dwte in this step's backward and unit 0's has not run yet: set by the
                       head, consumed by unit 0, so a backward run one unit at a time (ZeRO) adds unit 0's
                       share to the head's as a whole-model backward does */
  int64_t positions;                          /* of the passes; 0: the context */
  struct tensor acts[GPT_MAX_LAYERS + 3];     /* acts[u]: the input of unit u; acts[L+2] the logits */
  struct gpt_block_acts blk[GPT_MAX_LAYERS];
  struct tensor lnf_mean, lnf_rstd;           /* (max_rows·T) */
  /* Scratch shared by all units (never live across two passes). */
  struct tensor ln_out, dres, dtmp; /* (max_rows·T, C) */
  struct tensor big;                /* (max_rows·T, 4C): the GELU output, then its gradient */
};

/* ---- spec ---- */

/* Reads one "<letter><integer>" part of the spec at *p. */
static int parse_part(const char *s, const char **p, char *letter, long long *value, struct rumor_err *e) {
  const char *start = *p;
  *letter = *start;
  char *end;
  errno = 0;
  *value = isdigit((unsigned char)start[1]) ? strtoll(start + 1, &end, 10) : -1;
  if (*value < 0 || errno) {
    int len = (int)strcspn(start, "-");
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': '%.*s' is not a letter and a number (e.g. L6)", s,
                         len, start);
  }
  *p = end;
  return 0;
}

/* The bound of each part: [lo, hi]. */
static int check_part(const char *s, char letter, long long v, long long lo, long long hi, const char *what,
                      struct rumor_err *e) {
  if (v < lo || v > hi)
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': %c%lld: %s must be in [%lld, %lld]", s, letter, v,
                         what, lo, hi);
  return 0;
}

static int gpt_parse(const char *s, const char *p, struct model_spec *out, struct rumor_err *e) {
  long long v[5] = {-1, -1, -1, -1, -1};
  static const char LETTERS[] = "LHCTV";
  for (;;) {
    char letter;
    long long value;
    int rc = parse_part(s, &p, &letter, &value, e);
    if (rc) return rc;
    const char *at = strchr(LETTERS, letter);
    if (!at || !letter)
      return rumor_err_set(e, RUMOR_EFORMAT,
                           "bad model spec '%s': unknown part '%c%lld' (L layers, H heads, C width, T context, "
                           "V vocabulary)",
                           s, letter, value);
    if (v[at - LETTERS] >= 0)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': %c given twice", s, letter);
    v[at - LETTERS] = value;
    if (*p == '\0') break;
    if (*p != '-') return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': unexpected '%s'", s, p);
    p++;
  }
  for (int i = 0; i < 5; i++)
    if (v[i] < 0)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': missing %c (e.g. gpt:L6-H6-C384-T256-V256)", s,
                           LETTERS[i]);
  int rc;
  if ((rc = check_part(s, 'L', v[0], 1, GPT_MAX_LAYERS, "the number of layers", e)) ||
      (rc = check_part(s, 'H', v[1], 1, 1024, "the number of heads", e)) ||
      (rc = check_part(s, 'C', v[2], 1, GPT_MAX_WIDTH, "the width", e)) ||
      (rc = check_part(s, 'T', v[3], 1, GPT_MAX_CONTEXT, "the context", e)) ||
      (rc = check_part(s, 'V', v[4], 2, GPT_MAX_VOCAB, "the vocabulary", e)))
    return rc;
  if (v[2] % v[1] != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': the width C%lld is not a multiple of the heads H%lld",
                         s, v[2], v[1]);
  GP(out)->layers = (int)v[0];
  GP(out)->heads = (int)v[1];
  GP(out)->width = v[2];
  GP(out)->context = v[3];
  GP(out)->vocab = v[4];
  return 0;
}

static void gpt_format(const struct model_spec *s, char *buf, size_t len) {
  snprintf(buf, len, "gpt:L%d-H%d-C%lld-T%lld-V%lld", GP(s)->layers, GP(s)->heads, (long long)GP(s)->width,
           (long long)GP(s)->context, (long long)GP(s)->vocab);
}

/* ---- the table ---- */

/* Appends one entry: a matrix (d0, d1), or a vector (d0) when d1 is 0. */
static void put(struct model_param *out, size_t *n, int64_t *off, int unit, int64_t d0, int64_t d1,
                const char *name) {
  int64_t numel = d1 ? d0 * d1 : d0;
  if (out) {
    struct model_param *p = &out[*n];
    *p = (struct model_param){.ndim = d1 ? 2 : 1, .shape = {d0, d1}, .offset = *off, .numel = numel,
                              .decay = d1 != 0, .unit = unit};
    snprintf(p->name, sizeof p->name, "%s", name);
  }
  *off += numel;
  (*n)++;
}

static size_t gpt_table(const struct model_spec *s, struct model_param *out) {
  int64_t C = GP(s)->width, off = 0;
  size_t n = 0;
  put(out, &n, &off, 0, GP(s)->vocab, C, "transformer.wte.weight");
  put(out, &n, &off, 0, GP(s)->context, C, "transformer.wpe.weight");
  /* (rows, cols) of each block entry; cols 0: a vector. */
  const int64_t dims[B_NPARAMS][2] = {{C, 0}, {C, 0}, {C, 3 * C}, {3 * C, 0}, {C, C},     {C, 0},
                                      {C, 0}, {C, 0}, {C, 4 * C}, {4 * C, 0}, {4 * C, C}, {C, 0}};
  for (int l = 0; l < GP(s)->layers; l++)
    for (int k = 0; k < B_NPARAMS; k++) {
      char name[MODEL_NAME_MAX];
      snprintf(name, sizeof name, "transformer.h.%d.%s", l, BLOCK_NAMES[k]);
      put(out, &n, &off, l + 1, dims[k][0], dims[k][1], name);
    }
  put(out, &n, &off, GP(s)->layers + 1, C, 0, "transformer.ln_f.weight");
  put(out, &n, &off, GP(s)->layers + 1, C, 0, "transformer.ln_f.bias");
  return n;
}

static int gpt_units(const struct model_spec *s) { return GP(s)->layers + 2; }

static void gpt_io(const struct model_spec *s, struct model_io *out) {
  *out = (struct model_io){.input_dtype = TENSOR_I32,
                           .input_per_row = GP(s)->context,
                           .labels_per_row = GP(s)->context,
                           .classes = GP(s)->vocab};
}

static int64_t gpt_boundary(const struct model_spec *s, int u) { return GP(s)->context * GP(s)->width; }

/* Multiply-adds per row (T positions): the matrix products forward, weight
 * gradient and input gradient (3×), attention's two products forward and
 * four backward, causal (half), plus its recomputation. Element-wise work
 * is left out. */
static int64_t gpt_unit_macs(const struct model_spec *s, int u) {
  int64_t T = GP(s)->context, C = GP(s)->width, V = GP(s)->vocab;
  if (u == 0) return T * C; /* the embedding gather and its scatter */
  if (u == GP(s)->layers + 1) return 3 * T * C * V;
  int64_t linear = 3 * T * 12 * C * C, attention = (2 + 4 + 1) * T * T * C / 2;
  return linear + attention;
}

static void gpt_describe_units(const struct model_spec *s, int u0, int u1, char *buf, size_t n) {
  int L = GP(s)->layers;
  size_t w = 0;
  buf[0] = '\0';
  if (u0 == 0) w += (size_t)snprintf(buf + w, n - w, "embeddings");
  int b0 = u0 > 1 ? u0 : 1, b1 = u1 < L + 1 ? u1 : L + 1; /* blocks [b0, b1) as units */
  if (b0 < b1 && w < n)
    w += (size_t)snprintf(buf + w, n - w, b1 - b0 == 1 ? "%sblock %d" : "%sblocks %d-%d", w ? ", " : "", b0 - 1,
                          b1 - 2);
  if (u1 == L + 2 && w < n) snprintf(buf + w, n - w, "%shead", w ? ", " : "");
}

/* GPT-2's initialisation (Hugging Face's _init_weights, nanoGPT): matrices
 * and embeddings N(0, 0.02), the two projections into the residual stream
 * N(0, 0.02/sqrt(2L)), biases 0, LayerNorm gains 1. */
static void fill_normal(float *dst, int64_t n, float std, struct rng *r) {
  for (int64_t k = 0; k < n; k++) dst[k] = std * rng_normal(r);
}
static void fill_value(float *dst, int64_t n, float v) {
  for (int64_t k = 0; k < n; k++) dst[k] = v;
}

static void gpt_init_unit(const struct model_spec *s, int u, struct rng *r, float *out) {
  int64_t C = GP(s)->width, T = GP(s)->context, V = GP(s)->vocab;
  int L = GP(s)->layers;
  if (u == 0) {
    fill_normal(out, V * C, 0.02f, r);
    fill_normal(out + V * C, T * C, 0.02f, r);
    return;
  }
  if (u == L + 1) {
    fill_value(out, C, 1.0f);
    fill_value(out + C, C, 0.0f);
    return;
  }
  /* A block, its entries in table order (gpt_table). */
  const int64_t sizes[B_NPARAMS] = {C, C, C * 3 * C, 3 * C, C * C, C, C, C, C * 4 * C, 4 * C, 4 * C * C, C};
  float proj_std = 0.02f / sqrtf(2.0f * (float)L);
  for (int k = 0; k < B_NPARAMS; k++) {
    if (k == B_LN1_W || k == B_LN2_W) fill_value(out, sizes[k], 1.0f);
    else if (k == B_PROJ_W || k == B_MPROJ_W) fill_normal(out, sizes[k], proj_std, r);
    else if (k == B_ATTN_W || k == B_FC_W) fill_normal(out, sizes[k], 0.02f, r);
    else fill_value(out, sizes[k], 0.0f);
    out += sizes[k];
  }
}

/* ---- workspace ---- */

/* Table index of block l's entry k, and of the head's two. */
static size_t block_entry(int l, int k) { return 2 + (size_t)l * B_NPARAMS + (size_t)k; }

static struct tensor view_of(struct tensor *flat, const struct model *m, const struct model_param *p) {
  return tensor_view(flat, p->offset - m->param_base, p->ndim, p->shape);
}

static void bind_params(struct model *m, struct gpt_ws *ws) {
  const struct model_table *t = &m->table;
  int L = GP(&m->spec)->layers;
  if (m->u0 == 0) {
    ws->wte = view_of(&m->params, m, &t->p[0]);
    ws->dwte = view_of(&m->grads, m, &t->p[0]);
    ws->wpe = view_of(&m->params, m, &t->p[1]);
    ws->dwpe = view_of(&m->grads, m, &t->p[1]);
  }
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= L; u++)
    for (int k = 0; k < B_NPARAMS; k++) {
      const struct model_param *p = &t->p[block_entry(u - 1, k)];
      ws->p[u - 1][k] = view_of(&m->params, m, p);
      ws->g[u - 1][k] = view_of(&m->grads, m, p);
    }
  if (m->u1 == L + 2) {
    ws->lnf_w = view_of(&m->params, m, &t->p[block_entry(L, 0)]);
    ws->lnf_b = view_of(&m->params, m, &t->p[block_entry(L, 1)]);
    ws->dlnf_w = view_of(&m->grads, m, &t->p[block_entry(L, 0)]);
    ws->dlnf_b = view_of(&m->grads, m, &t->p[block_entry(L, 1)]);
  }
}

/* Allocates a stashed (per micro-batch) tensor. */
static int stashed(struct model *m, struct tensor *t, enum tensor_dtype dt, int ndim, const int64_t *shape,
                   struct rumor_err *e) {
  int rc = tensor_alloc(t, m->be, dt, ndim, shape, e);
  if (rc == 0) m->stash[m->nstash++] = t;
  return rc;
}

static int alloc_block_acts(struct model *m, struct gpt_block_acts *b, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int64_t R = m->max_rows, T = GP(s)->context, C = GP(s)->width, N = R * T;
  const int64_t qkv[3] = {R, T, 3 * C}, rtc[3] = {R, T, C}, lse[3] = {R, GP(s)->heads, T}, fc[3] = {R, T, 4 * C};
  int rc;
  if ((rc = stashed(m, &b->qkv, TENSOR_F32, 3, qkv, e)) || (rc = stashed(m, &b->att, TENSOR_F32, 3, rtc, e)) ||
      (rc = stashed(m, &b->lse, TENSOR_F32, 3, lse, e)) || (rc = stashed(m, &b->mid, TENSOR_F32, 3, rtc, e)) ||
      (rc = stashed(m, &b->fc, TENSOR_F32, 3, fc, e)) || (rc = stashed(m, &b->ln1_mean, TENSOR_F32, 1, &N, e)) ||
      (rc = stashed(m, &b->ln1_rstd, TENSOR_F32, 1, &N, e)) || (rc = stashed(m, &b->ln2_mean, TENSOR_F32, 1, &N, e)) ||
      (rc = stashed(m, &b->ln2_rstd, TENSOR_F32, 1, &N, e)))
    return rc;
  return 0;
}

static int alloc_scratch(struct model *m, struct gpt_ws *ws, bool blocks, struct rumor_err *e) {
  int64_t C = GP(&m->spec)->width, N = m->max_rows * GP(&m->spec)->context;
  const int64_t nc[2] = {N, C}, n4c[2] = {N, 4 * C};
  int rc;
  if ((rc = tensor_alloc(&ws->ln_out, m->be, TENSOR_F32, 2, nc, e)) ||
      (rc = tensor_alloc(&ws->dres, m->be, TENSOR_F32, 2, nc, e)) ||
      (rc = tensor_alloc(&ws->dtmp, m->be, TENSOR_F32, 2, nc, e)))
    return rc;
  return blocks ? tensor_alloc(&ws->big, m->be, TENSOR_F32, 2, n4c, e) : 0;
}

static int gpt_init(struct model *m, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int L = GP(s)->layers;
  int64_t R = m->max_rows, T = GP(s)->context, C = GP(s)->width, N = R * T;
  struct gpt_ws *ws = xcalloc(1, sizeof *ws);
  m->impl = ws;
  bind_params(m, ws);
  int rc;
  if (m->u1 == L + 2 && m->u0 > 0) { /* the head without unit 0: its own copy of wte */
    const int64_t vc[2] = {GP(s)->vocab, C};
    if ((rc = tensor_alloc(&ws->wte_copy, m->be, TENSOR_F32, 2, vc, e)) ||
        (rc = tensor_alloc(&ws->dwte_copy, m->be, TENSOR_F32, 2, vc, e)))
      return rc;
    ws->wte = ws->wte_copy;
    ws->dwte = ws->dwte_copy;
  }
  for (int u = m->u0; u <= m->u1; u++) {
    int64_t shape[2] = {R, model_act_width(m, u)};
    if ((rc = stashed(m, &ws->acts[u], model_act_dtype(m, u), 2, shape, e))) return rc;
  }
  bool blocks = false;
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= L; u++) {
    if ((rc = alloc_block_acts(m, &ws->blk[u - 1], e))) return rc;
    blocks = true;
  }
  if (m->u1 == L + 2 &&
      ((rc = stashed(m, &ws->lnf_mean, TENSOR_F32, 1, &N, e)) || (rc = stashed(m, &ws->lnf_rstd, TENSOR_F32, 1, &N, e))))
    return rc;
  return alloc_scratch(m, ws, blocks, e);
}

static void gpt_free(struct model *m) {
  struct gpt_ws *ws = m->impl;
  if (!ws) return;
  /* Every owner the workspace holds is in the stash or the scratch. */
  for (int i = 0; i < m->nstash; i++) tensor_free(m->stash[i]);
  m->nstash = 0;
  struct tensor *own[] = {&ws->wte_copy, &ws->dwte_copy, &ws->ln_out, &ws->dres, &ws->dtmp, &ws->big};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) tensor_free(own[i]);
  free(ws);
  m->impl = NULL;
}

static struct tensor *gpt_act(struct model *m, int u) { return &((struct gpt_ws *)m->impl)->acts[u]; }

static bool gpt_tied(struct model *m, struct tensor **param, struct tensor **grad) {
  struct gpt_ws *ws = m->impl;
  if (!ws->wte_copy.data) return false;
  *param = &ws->wte_copy;
  *grad = &ws->dwte_copy;
  return true;
}

/* ---- passes ---- */

/* Positions per sequence of the passes (model_set_positions). */
static int64_t positions(const struct model *m) {
  const struct gpt_ws *ws = m->impl;
  return ws->positions ? ws->positions : GP(&m->spec)->context;
}

static void gpt_set_positions(struct model *m, int64_t t) {
  RUMOR_ASSERT(t >= 1 && t <= GP(&m->spec)->context);
  ((struct gpt_ws *)m->impl)->positions = t;
}

/* A view of the first `rows` rows of t, reshaped to (d0, d1[, d2]). */
static struct tensor v2(const struct tensor *t, int64_t d0, int64_t d1) {
  int64_t shape[2] = {d0, d1};
  return tensor_view(t, 0, 2, shape);
}
static struct tensor v3(const struct tensor *t, int64_t d0, int64_t d1, int64_t d2) {
  int64_t shape[3] = {d0, d1, d2};
  return tensor_view(t, 0, 3, shape);
}
static struct tensor v1(const struct tensor *t, int64_t n) { return tensor_view(t, 0, 1, &n); }

/* y ← x·W + b for x (N, in), W (in, out) in Conv1D layout, b (out). */
static void linear(const struct tensor *x, const struct tensor *w, const struct tensor *b, struct tensor *y) {
  tensor_gemm(false, false, 1.0f, x, w, 0.0f, y);
  tensor_bias_add(y, b);
}

/* The backward of linear: dW ← beta·dW + xᵀ·dy, db ← beta·db + Σ dy and,
 * when dx is not NULL, dx ← dy·Wᵀ. */
static void linear_bwd(const struct tensor *x, const struct tensor *w, const struct tensor *dy, struct tensor *dw,
                       struct tensor *db, struct tensor *dx, float beta) {
  tensor_gemm(true, false, 1.0f, x, dy, beta, dw);
  tensor_bias_grad(dy, db, beta);
  if (dx) tensor_gemm(false, true, 1.0f, dy, w, 0.0f, dx);
}

static void embed_forward(struct model *m, int64_t rows) {
  struct gpt_ws *ws = m->impl;
  int64_t T = positions(m), C = GP(&m->spec)->width;
  struct tensor tok = v2(&ws->acts[0], rows, T), out = v3(&ws->acts[1], rows, T, C);
  tensor_embedding_fwd(&tok, &ws->wte, &ws->wpe, &out);
}

static void block_forward(struct model *m, int u, int64_t rows) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  struct gpt_block_acts *a = &ws->blk[u - 1];
  struct tensor *P = ws->p[u - 1];
  int64_t T = positions(m), C = GP(s)->width, N = rows * T;
  struct tensor x = v2(&ws->acts[u], N, C), y = v2(&ws->acts[u + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor qkv = v2(&a->qkv, N, 3 * C), att = v2(&a->att, N, C), mid = v2(&a->mid, N, C);
  struct tensor fc = v2(&a->fc, N, 4 * C), g = v2(&ws->big, N, 4 * C);
  struct tensor m1 = v1(&a->ln1_mean, N), r1 = v1(&a->ln1_rstd, N), m2 = v1(&a->ln2_mean, N),
                r2 = v1(&a->ln2_rstd, N);
  tensor_layernorm_fwd(&x, &P[B_LN1_W], &P[B_LN1_B], &ln, &m1, &r1);
  linear(&ln, &P[B_ATTN_W], &P[B_ATTN_B], &qkv);
  struct tensor qkv3 = v3(&a->qkv, rows, T, 3 * C), att3 = v3(&a->att, rows, T, C);
  struct tensor lse = v3(&a->lse, rows, GP(s)->heads, T);
  tensor_attention_fwd(&qkv3, GP(s)->heads, &att3, &lse);
  linear(&att, &P[B_PROJ_W], &P[B_PROJ_B], &mid);
  tensor_add(&mid, &x, &mid);
  tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2);
  linear(&ln, &P[B_FC_W], &P[B_FC_B], &fc);
  tensor_gelu_tanh_fwd(&fc, &g);
  linear(&g, &P[B_MPROJ_W], &P[B_MPROJ_B], &y);
  tensor_add(&y, &mid, &y);
}

static void head_forward(struct model *m, int64_t rows) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  struct tensor x = v2(&ws->acts[L + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor mf = v1(&ws->lnf_mean, N), rf = v1(&ws->lnf_rstd, N), logits = v2(&ws->acts[L + 2], N, GP(s)->vocab);
  tensor_layernorm_fwd(&x, &ws->lnf_w, &ws->lnf_b, &ln, &mf, &rf);
  tensor_gemm(false, true, 1.0f, &ln, &ws->wte, 0.0f, &logits); /* the tied head: ln_f(x)·wteᵀ */
}

static void gpt_forward(struct model *m, int a, int b, int64_t rows) {
  int L = GP(&m->spec)->layers;
  for (int u = a; u < b; u++) {
    if (u == 0) embed_forward(m, rows);
    else if (u <= L) block_forward(m, u, rows);
    else head_forward(m, rows);
  }
}

/* dlogits (N, V) → ws->dres = dL/d(ln_f's input). */
static void head_backward(struct model *m, int64_t rows, const struct tensor *dout, float beta) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  struct tensor dl = v2(dout, N, GP(s)->vocab), x = v2(&ws->acts[L + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor mf = v1(&ws->lnf_mean, N), rf = v1(&ws->lnf_rstd, N);
  struct tensor dres = v2(&ws->dres, N, C), dln = v2(&ws->dtmp, N, C);
  tensor_layernorm_fwd(&x, &ws->lnf_w, &ws->lnf_b, &ln, &mf, &rf); /* its output, recomputed */
  tensor_gemm(true, false, 1.0f, &dl, &ln, beta, &ws->dwte);
  ws->dwte_written = true;
  tensor_gemm(false, false, 1.0f, &dl, &ws->wte, 0.0f, &dln);
  tensor_fill(&dres, 0.0f);
  tensor_layernorm_bwd(&x, &ws->lnf_w, &mf, &rf, &dln, &dres, &ws->dlnf_w, &ws->dlnf_b, beta);
}

/* ws->dres holds dL/d(block output) on entry and dL/d(block input) on return. */
static void block_backward(struct model *m, int u, int64_t rows, float beta) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  struct gpt_block_acts *a = &ws->blk[u - 1];
  struct tensor *P = ws->p[u - 1], *G = ws->g[u - 1];
  int64_t T = positions(m), C = GP(s)->width, N = rows * T;
  struct tensor x = v2(&ws->acts[u], N, C), ln = v2(&ws->ln_out, N, C), dres = v2(&ws->dres, N, C);
  struct tensor dtmp = v2(&ws->dtmp, N, C), big = v2(&ws->big, N, 4 * C);
  struct tensor att = v2(&a->att, N, C), mid = v2(&a->mid, N, C), fc = v2(&a->fc, N, 4 * C);
  struct tensor m1 = v1(&a->ln1_mean, N), r1 = v1(&a->ln1_rstd, N), m2 = v1(&a->ln2_mean, N),
                r2 = v1(&a->ln2_rstd, N);
  /* The MLP: its output projection needs the GELU output, recomputed. */
  tensor_gelu_tanh_fwd(&fc, &big);
  linear_bwd(&big, &P[B_MPROJ_W], &dres, &G[B_MPROJ_W], &G[B_MPROJ_B], &big, beta);
  tensor_gelu_tanh_bwd(&fc, &big, &big);
  tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2);
  linear_bwd(&ln, &P[B_FC_W], &big, &G[B_FC_W], &G[B_FC_B], &dtmp, beta);
  tensor_layernorm_bwd(&mid, &P[B_LN2_W], &m2, &r2, &dtmp, &dres, &G[B_LN2_W], &G[B_LN2_B], beta);
  /* Attention: dres now holds dL/d mid. */
  linear_bwd(&att, &P[B_PROJ_W], &dres, &G[B_PROJ_W], &G[B_PROJ_B], &dtmp, beta);
  struct tensor qkv3 = v3(&a->qkv, rows, T, 3 * C), att3 = v3(&a->att, rows, T, C);
  struct tensor lse = v3(&a->lse, rows, GP(s)->heads, T), datt3 = v3(&ws->dtmp, rows, T, C);
  struct tensor dqkv3 = v3(&ws->big, rows, T, 3 * C), dqkv = v2(&ws->big, N, 3 * C);
  tensor_attention_bwd(&qkv3, &att3, &lse, &datt3, GP(s)->heads, &dqkv3);
  tensor_layernorm_fwd(&x, &P[B_LN1_W], &P[B_LN1_B], &ln, &m1, &r1);
  linear_bwd(&ln, &P[B_ATTN_W], &dqkv, &G[B_ATTN_W], &G[B_ATTN_B], &dtmp, beta);
  tensor_layernorm_bwd(&x, &P[B_LN1_W], &m1, &r1, &dtmp, &dres, &G[B_LN1_W], &G[B_LN1_B], beta);
}

static void embed_backward(struct model *m, int64_t rows, bool accumulate) {
  struct gpt_ws *ws = m->impl;
  int64_t T = positions(m), C = GP(&m->spec)->width;
  if (!accumulate) {
    if (!ws->dwte_written) tensor_fill(&ws->dwte, 0.0f);
    tensor_fill(&ws->dwpe, 0.0f);
  }
  struct tensor tok = v2(&ws->acts[0], rows, T), dres = v3(&ws->dres, rows, T, C);
  tensor_embedding_bwd(&tok, &dres, &ws->dwte, &ws->dwpe);
  ws->dwte_written = false;
}

static void gpt_backward(struct model *m, int a, int b, int64_t rows, struct tensor *dout, struct tensor *din,
                         bool accumulate) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  float beta = accumulate ? 1.0f : 0.0f;
  struct tensor dres = v2(&ws->dres, N, C);
  if (b == L + 2) {
    head_backward(m, rows, dout, beta);
  } else {
    struct tensor d = v2(dout, N, C);
    tensor_copy(&dres, &d);
  }
  for (int u = (b < L + 1 ? b : L + 1) - 1; u >= (a > 1 ? a : 1); u--) block_backward(m, u, rows, beta);
  if (a == 0) {
    embed_backward(m, rows, accumulate);
  } else if (din) {
    struct tensor d = v2(din, N, C);
    tensor_copy(&d, &dres);
  }
}


/* ---- Hugging Face ---- */

static json_t *gpt_hf_config(const struct model_spec *s) {
  char spec[MODEL_SPEC_MAX];
  gpt_format(s, spec, sizeof spec);
  json_t *b = json_object();
  RUMOR_ASSERT(b);
  json_text_set(b, "architectures", json_pack("[s]", "GPT2LMHeadModel"));
  json_text_set(b, "model_type", json_string("gpt2"));
  const struct {
    const char *key;
    int64_t v;
  } ints[] = {{"vocab_size", GP(s)->vocab}, {"n_positions", GP(s)->context}, {"n_ctx", GP(s)->context},
              {"n_embd", GP(s)->width},    {"n_layer", GP(s)->layers},      {"n_head", GP(s)->heads},
              {"bos_token_id", GP(s)->vocab - 1}, {"eos_token_id", GP(s)->vocab - 1}};
  for (size_t i = 0; i < sizeof ints / sizeof ints[0]; i++) json_text_set(b, ints[i].key, json_integer(ints[i].v));
  json_text_set(b, "n_inner", json_null());
  json_text_set(b, "activation_function", json_string("gelu_new")); /* GPT-2's tanh form */
  const char *zero[] = {"resid_pdrop", "embd_pdrop", "attn_pdrop"};
  for (size_t i = 0; i < 3; i++) json_text_set(b, zero[i], json_text_real(0.0));
  json_text_set(b, "layer_norm_epsilon", json_text_real(GPT_HF_LAYERNORM_EPS));
  json_text_set(b, "initializer_range", json_text_real(0.02));
  json_text_set(b, "tie_word_embeddings", json_true());
  json_text_set(b, "torch_dtype", json_string("float32"));
  json_text_set(b, "rumor_model", json_string(spec));
  return b;
}

/* An integer field of a config, in [lo, hi]. */
static int hf_int(const json_t *cfg, const char *name, const char *key, int64_t lo, int64_t hi, int64_t *out,
                  struct rumor_err *e) {
  const json_t *v = json_object_get(cfg, key);
  if (!json_is_integer(v) || json_integer_value(v) < lo || json_integer_value(v) > hi)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: %s is missing or not an integer in [%lld, %lld]", name, key,
                         (long long)lo, (long long)hi);
  *out = json_integer_value(v);
  return 0;
}

static int gpt_hf_parse(const json_t *cfg, const char *name, struct model_spec *out, struct rumor_err *e) {
  int64_t L = 0, H = 0, C = 0, T = 0, V = 0; /* set by hf_int before use; zeros quiet -O3 */
  int rc;
  if ((rc = hf_int(cfg, name, "n_layer", 1, GPT_MAX_LAYERS, &L, e)) ||
      (rc = hf_int(cfg, name, "n_head", 1, 1024, &H, e)) ||
      (rc = hf_int(cfg, name, "n_embd", 1, GPT_MAX_WIDTH, &C, e)) ||
      (rc = hf_int(cfg, name, "n_positions", 1, GPT_MAX_CONTEXT, &T, e)) ||
      (rc = hf_int(cfg, name, "vocab_size", 2, GPT_MAX_VOCAB, &V, e)))
    return rc;
  if (C % H != 0) return rumor_err_set(e, RUMOR_EFORMAT, "%s: n_embd %lld is not a multiple of n_head %lld", name,
                                       (long long)C, (long long)H);
  const json_t *act = json_object_get(cfg, "activation_function");
  if (act && (!json_is_string(act) || (strcmp(json_string_value(act), "gelu_new") != 0 &&
                                       strcmp(json_string_value(act), "gelu_pytorch_tanh") != 0)))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: activation_function must be GPT-2's gelu_new (tanh)", name);
  const json_t *inner = json_object_get(cfg, "n_inner");
  if (inner && !json_is_null(inner) && !(json_is_number(inner) && json_number_value(inner) == 4.0 * (double)C))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: n_inner must be null or 4·n_embd", name);
  if (json_is_false(json_object_get(cfg, "tie_word_embeddings")))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: tie_word_embeddings is false; rumor's GPT ties the head", name);
  /* Absent: GPT-2's default, which is ours. Another epsilon would give other
   * activations than the model was trained with. */
  const json_t *eps = json_object_get(cfg, "layer_norm_epsilon");
  if (eps && !json_is_number(eps))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: layer_norm_epsilon is not a number; rumor's GPT uses %g", name,
                         GPT_HF_LAYERNORM_EPS);
  if (eps && fabs(json_number_value(eps) - GPT_HF_LAYERNORM_EPS) > 1e-6 * GPT_HF_LAYERNORM_EPS)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "%s: layer_norm_epsilon is %.9g; rumor's GPT normalises with %g (GPT-2's) and cannot use "
                         "another",
                         name, json_number_value(eps), GPT_HF_LAYERNORM_EPS);
  GP(out)->layers = (int)L;
  GP(out)->heads = (int)H;
  GP(out)->width = C;
  GP(out)->context = T;
  GP(out)->vocab = V;
  return 0;
}

/* Buffers of Hugging Face's GPT-2 (the causal mask) and the tied head. */
static bool gpt_hf_ignored(const char *name) {
  size_t n = strlen(name);
  const char *tails[] = {".attn.bias", ".attn.masked_bias"};
  for (size_t i = 0; i < 2; i++) {
    size_t k = strlen(tails[i]);
    if (n > k && strcmp(name + n - k, tails[i]) == 0) return true;
  }
  return strcmp(name, "lm_head.weight") == 0;
}

const struct model_family_ops model_gpt_ops = {
    .name = "gpt",
    .unit_noun = "block",
    .parse = gpt_parse,
    .format = gpt_format,
    .table = gpt_table,
    .units = gpt_units,
    .io = gpt_io,
    .boundary = gpt_boundary,
    .unit_macs = gpt_unit_macs,
    .describe_units = gpt_describe_units,
    .init_unit = gpt_init_unit,
    .init = gpt_init,
    .free = gpt_free,
    .act = gpt_act,
    .forward = gpt_forward,
    .backward = gpt_backward,
    .tied = gpt_tied,
    .tied_entry = 0, /* transformer.wte.weight */
    .set_positions = gpt_set_positions,
    .hf_config = gpt_hf_config,
    .hf_model_type = "gpt2",
    .hf_parse = gpt_hf_parse,
    .hf_ignored = gpt_hf_ignored,
    .hf_prefix = "transformer.",
};
