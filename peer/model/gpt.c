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
 * units exchange (rows, T·C) floats, the head writes (rows, T·Vp) logits.
 *
 * Padded logits: each position's V logits are followed by Vp − V floats of
 * padding, Vp = V rounded up to a multiple of GPT_LOGITS_ALIGN (64;
 * model_logits_stride), so that on a GPU the tied head's GEMMs and the
 * cross-entropy run on aligned rows (ld 50304 for GPT-2, not 50257). No op
 * reads the padding (tensor.h, "padded rows"): the head's GEMMs write and
 * read the first V columns, the loss, the score and sampling read them.
 * Only the logits are padded: wte keeps its V rows, so the table, the flat
 * buffers, the optimizer, gossip, checkpoints, Hugging Face files and
 * parameter counts are what they are without padding. (llm.c pads wte
 * itself to Vp rows instead; that would put zero rows into every path that
 * reads or writes the whole model, each of which would then have to skip
 * them.) A tensor-parallel rank pads its own vocabulary share alike.
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
 * Tensor parallelism (model.h's "tensor parallelism", Megatron-LM's
 * layout; model_gpt_tp): rank r of T holds heads [r·H/T, (r+1)·H/T) of the
 * attention (those columns of c_attn's q, k and v blocks and of its bias,
 * those input rows of attn.c_proj), columns [lo, hi) of c_fc
 * (model_tp_chunk of 4C) and the same input rows of mlp.c_proj, and
 * vocabulary rows [vlo, vlo + vl) of wte (model_tp_chunk of V); LayerNorms,
 * wpe and the two projections' biases are replicated. Per block:
 *
 *   forward   ln_1 → c_attn (local heads) → attention → c_proj partial
 *             → ALL-REDUCE → + bias + residual → ln_2 → c_fc (local
 *             columns) → GELU → mlp.c_proj partial → ALL-REDUCE → + bias
 *             + residual
 *   backward  the same in reverse; the gradients of ln_2's and ln_1's
 *             outputs (partial sums over the local columns and heads) are
 *             ALL-REDUCEd before the LayerNorms' backward.
 *
 * The embedding looks up the rank's vocabulary rows (zeros for the other
 * tokens; rank 0 adds wpe) and all-reduces; the tied head multiplies by
 * the rank's rows of wte, so the rank holds logits [vlo, vlo + vl) only, and
 * its backward all-reduces the gradient of ln_f's output. The loss is the
 * vocabulary-parallel cross-entropy (tensor_xent_shard_*): one all-reduce
 * gathers every rank's log-sum-exp and the target logits. Everything
 * replicated is computed identically on every rank, so its gradients are
 * identical too.
 *
 * One set of passes serves whole models and ranks: they take the widths
 * from the workspace (hl, cl, fl, vl: H, C, 4C and V in a whole model) and
 * model_tp_all_reduce does nothing in a whole model, so a whole model runs
 * the ops it would without tensor parallelism. A rank of one runs the same
 * ops (but the sharded embedding's lookup, over every row) and its results
 * are a whole model's bit for bit.
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

#include "peer/model/gpt_impl.h"
#include "util/json_text.h"

static const char *const BLOCK_NAMES[B_NPARAMS] = {
    "ln_1.weight",   "ln_1.bias",   "attn.c_attn.weight", "attn.c_attn.bias", "attn.c_proj.weight", "attn.c_proj.bias",
    "ln_2.weight",   "ln_2.bias",   "mlp.c_fc.weight",    "mlp.c_fc.bias",    "mlp.c_proj.weight",  "mlp.c_proj.bias"};

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

/* The optional mixture-of-experts parts: E experts (0: dense), K and M
 * with E only. v: E, K, M as parsed (-1: not given). */
static int moe_parts(const char *s, const long long *v, int layers, struct model_spec *out, struct rumor_err *e) {
  int rc;
  static const char MOE_ONLY[] = "KMF";
  for (int i = 1; i < 4; i++)
    if (v[0] < 0 && v[i] >= 0)
      return rumor_err_set(e, RUMOR_EFORMAT, "bad model spec '%s': %c is for a mixture of experts: give E too (e.g. "
                           "-E8-K2)", s, MOE_ONLY[i - 1]);
  if (v[0] < 0) return 0;
  if ((rc = check_part(s, 'E', v[0], 1, GPT_MAX_EXPERTS, "the number of experts", e))) return rc;
  long long k = v[1] >= 0 ? v[1] : 1, every = v[2] >= 0 ? v[2] : 1, pct = v[3] >= 0 ? v[3] : GPT_MOE_CAPACITY_PCT;
  if ((rc = check_part(s, 'K', k, 1, v[0], "the experts each token goes to", e)) ||
      (rc = check_part(s, 'M', every, 1, layers, "the blocks between mixture-of-experts blocks", e)) ||
      (rc = check_part(s, 'F', pct, 1, 100000, "the capacity factor in percent", e)))
    return rc;
  GP(out)->experts = (int)v[0];
  GP(out)->topk = (int)k;
  GP(out)->moe_every = (int)every;
  GP(out)->capacity_pct = (int)pct;
  return 0;
}

static int gpt_parse(const char *s, const char *p, struct model_spec *out, struct rumor_err *e) {
  long long v[9] = {-1, -1, -1, -1, -1, -1, -1, -1, -1};
  static const char LETTERS[] = "LHCTVEKMF";
  for (;;) {
    char letter;
    long long value;
    int rc = parse_part(s, &p, &letter, &value, e);
    if (rc) return rc;
    const char *at = strchr(LETTERS, letter);
    if (!at || !letter)
      return rumor_err_set(e, RUMOR_EFORMAT,
                           "bad model spec '%s': unknown part '%c%lld' (L layers, H heads, C width, T context, "
                           "V vocabulary; E experts, K of them per token, M blocks apart, F capacity percent)",
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
  GP(out)->experts = GP(out)->topk = GP(out)->capacity_pct = 0;
  GP(out)->moe_every = 1;
  return moe_parts(s, v + 5, (int)v[0], out, e);
}

static void gpt_format(const struct model_spec *s, char *buf, size_t len) {
  int w = snprintf(buf, len, "gpt:L%d-H%d-C%lld-T%lld-V%lld", GP(s)->layers, GP(s)->heads, (long long)GP(s)->width,
                   (long long)GP(s)->context, (long long)GP(s)->vocab);
  if (GP(s)->experts && w > 0 && (size_t)w < len)
    w += snprintf(buf + w, len - (size_t)w, "-E%d-K%d", GP(s)->experts, GP(s)->topk);
  if (GP(s)->experts && GP(s)->moe_every > 1 && w > 0 && (size_t)w < len)
    w += snprintf(buf + w, len - (size_t)w, "-M%d", GP(s)->moe_every);
  if (GP(s)->experts && GP(s)->capacity_pct != GPT_MOE_CAPACITY_PCT && w > 0 && (size_t)w < len)
    snprintf(buf + w, len - (size_t)w, "-F%d", GP(s)->capacity_pct);
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

bool gpt_block_is_moe(const struct model_spec *s, int l) {
  return GP(s)->experts > 0 && (l + 1) % GP(s)->moe_every == 0;
}

size_t gpt_block_entries(const struct model_spec *s, int l) {
  return gpt_block_is_moe(s, l) ? B_ROUTER + 1 + (size_t)GP(s)->experts * X_NPARAMS : B_NPARAMS;
}

size_t gpt_block_first(const struct model_spec *s, int l) {
  size_t i = 2; /* wte, wpe */
  for (int j = 0; j < l; j++) i += gpt_block_entries(s, j);
  return i;
}

static size_t gpt_table(const struct model_spec *s, struct model_param *out) {
  int64_t C = GP(s)->width, off = 0;
  size_t n = 0;
  put(out, &n, &off, 0, GP(s)->vocab, C, "transformer.wte.weight");
  put(out, &n, &off, 0, GP(s)->context, C, "transformer.wpe.weight");
  /* (rows, cols) of each block entry; cols 0: a vector. */
  const int64_t dims[B_NPARAMS][2] = {{C, 0}, {C, 0}, {C, 3 * C}, {3 * C, 0}, {C, C},     {C, 0},
                                      {C, 0}, {C, 0}, {C, 4 * C}, {4 * C, 0}, {4 * C, C}, {C, 0}};
  for (int l = 0; l < GP(s)->layers; l++) {
    bool moe = gpt_block_is_moe(s, l);
    char name[MODEL_NAME_MAX];
    for (int k = 0; k < (moe ? B_ROUTER : B_NPARAMS); k++) {
      snprintf(name, sizeof name, "transformer.h.%d.%s", l, BLOCK_NAMES[k]);
      put(out, &n, &off, l + 1, dims[k][0], dims[k][1], name);
    }
    if (!moe) continue;
    /* The router (C, E), then each expert's MLP, GPT-2's own (Mixtral's
     * and Switch's naming: mlp.router, mlp.experts.<e>.*). */
    snprintf(name, sizeof name, "transformer.h.%d.mlp.router.weight", l);
    put(out, &n, &off, l + 1, C, GP(s)->experts, name);
    for (int x = 0; x < GP(s)->experts; x++)
      for (int k = 0; k < X_NPARAMS; k++) {
        snprintf(name, sizeof name, "transformer.h.%d.mlp.experts.%d.%s", l, x, BLOCK_NAMES[B_FC_W + k] + 4);
        put(out, &n, &off, l + 1, dims[B_FC_W + k][0], dims[B_FC_W + k][1], name);
      }
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

/* The logits' row stride for vl classes (GPT_LOGITS_ALIGN). */
static int64_t logits_ld(int64_t vl) { return (vl + GPT_LOGITS_ALIGN - 1) / GPT_LOGITS_ALIGN * GPT_LOGITS_ALIGN; }

/* model_act_width: the logits' rows padded (logits_ld), of a rank's
 * vocabulary rows only. */
static int64_t gpt_act_width(const struct model *m, int u) {
  const struct model_spec *s = &m->spec;
  if (u == 0) return GP(s)->context;
  if (u < GP(s)->layers + 2) return GP(s)->context * GP(s)->width;
  return GP(s)->context * logits_ld(model_own_table(m)->p[0].shape[0]);
}

/* Multiply-adds per row (T positions): the matrix products forward, weight
 * gradient and input gradient (3×), attention's two products forward and
 * four backward, causal (half), plus its recomputation. Element-wise work
 * is left out. */
static int64_t gpt_unit_macs(const struct model_spec *s, int u) {
  int64_t T = GP(s)->context, C = GP(s)->width, V = GP(s)->vocab;
  if (u == 0) return T * C; /* the embedding gather and its scatter */
  if (u == GP(s)->layers + 1) return 3 * T * C * V;
  /* A mixture-of-experts block: each token through K experts' MLPs (at
   * most: some are dropped) and the router. */
  int64_t mlp = gpt_block_is_moe(s, u - 1) ? GP(s)->topk * 8 * C * C + C * GP(s)->experts : 8 * C * C;
  int64_t linear = 3 * T * (4 * C * C + mlp), attention = (2 + 4 + 1) * T * T * C / 2;
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
  /* A block, its entries in table order (gpt_table); a mixture-of-experts
   * block's router as c_fc, each expert as the dense MLP. */
  const int64_t sizes[B_NPARAMS] = {C, C, C * 3 * C, 3 * C, C * C, C, C, C, C * 4 * C, 4 * C, 4 * C * C, C};
  float proj_std = 0.02f / sqrtf(2.0f * (float)L);
  bool moe = gpt_block_is_moe(s, u - 1);
  for (int k = 0, x = 0; k < B_NPARAMS; k++) {
    if (moe && k == B_ROUTER) { /* the router, then experts 0 .. E-2 (E-1's are the loop's last four) */
      fill_normal(out, C * GP(s)->experts, 0.02f, r);
      out += C * GP(s)->experts;
      for (; x < GP(s)->experts - 1; x++)
        for (int j = B_FC_W; j < B_NPARAMS; j++) {
          if (j == B_FC_W) fill_normal(out, sizes[j], 0.02f, r);
          else if (j == B_MPROJ_W) fill_normal(out, sizes[j], proj_std, r);
          else fill_value(out, sizes[j], 0.0f);
          out += sizes[j];
        }
    }
    if (k == B_LN1_W || k == B_LN2_W) fill_value(out, sizes[k], 1.0f);
    else if (k == B_PROJ_W || k == B_MPROJ_W) fill_normal(out, sizes[k], proj_std, r);
    else if (k == B_ATTN_W || k == B_FC_W) fill_normal(out, sizes[k], 0.02f, r);
    else fill_value(out, sizes[k], 0.0f);
    out += sizes[k];
  }
}

/* ---- workspace ---- */


/* A view of table entry i in `flat` (params or grads), in the model's own
 * layout (model_own_table). */
static struct tensor view_of(struct tensor *flat, const struct model *m, size_t i) {
  const struct model_param *p = &model_own_table(m)->p[i];
  return tensor_view(flat, p->offset - m->param_base, p->ndim, p->shape);
}

static void bind_params(struct model *m, struct gpt_ws *ws) {
  int L = GP(&m->spec)->layers;
  if (m->u0 == 0) {
    ws->wte = view_of(&m->params, m, 0);
    ws->dwte = view_of(&m->grads, m, 0);
    ws->wpe = view_of(&m->params, m, 1);
    ws->dwpe = view_of(&m->grads, m, 1);
  }
  /* A block's entries (a mixture-of-experts block's up to its router,
   * which takes c_fc's place; gpt_moe.c finds the experts'). */
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= L; u++) {
    size_t first = gpt_block_first(&m->spec, u - 1);
    int n = gpt_block_is_moe(&m->spec, u - 1) ? B_ROUTER + 1 : B_NPARAMS;
    for (int k = 0; k < n; k++) {
      ws->p[u - 1][k] = view_of(&m->params, m, first + (size_t)k);
      ws->g[u - 1][k] = view_of(&m->grads, m, first + (size_t)k);
    }
  }
  if (m->u1 == L + 2) {
    size_t head = gpt_block_first(&m->spec, L);
    ws->lnf_w = view_of(&m->params, m, head);
    ws->lnf_b = view_of(&m->params, m, head + 1);
    ws->dlnf_w = view_of(&m->grads, m, head);
    ws->dlnf_b = view_of(&m->grads, m, head + 1);
  }
}

/* Allocates a stashed (per micro-batch) tensor. */
int gpt_stashed(struct model *m, struct tensor *t, enum tensor_dtype dt, int ndim, const int64_t *shape,
                struct rumor_err *e) {
  int rc = tensor_alloc(t, m->be, dt, ndim, shape, e);
  if (rc == 0) m->stash[m->nstash++] = t;
  return rc;
}

static int alloc_block_acts(struct model *m, const struct gpt_ws *ws, int l, struct gpt_block_acts *b,
                            struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int64_t R = m->max_rows, T = GP(s)->context, C = GP(s)->width, N = R * T;
  const int64_t qkv[3] = {R, T, 3 * ws->cl}, att[3] = {R, T, ws->cl}, lse[3] = {R, ws->hl, T}, rtc[3] = {R, T, C},
                fc[3] = {R, T, ws->fl};
  bool moe = gpt_block_is_moe(s, l);
  int rc;
  if ((rc = gpt_stashed(m, &b->qkv, TENSOR_F32, 3, qkv, e)) || (rc = gpt_stashed(m, &b->att, TENSOR_F32, 3, att, e)) ||
      (rc = gpt_stashed(m, &b->lse, TENSOR_F32, 3, lse, e)) || (rc = gpt_stashed(m, &b->mid, TENSOR_F32, 3, rtc, e)) ||
      (moe ? (rc = gpt_moe_alloc_acts(m, &b->moe, e)) : (rc = gpt_stashed(m, &b->fc, TENSOR_F32, 3, fc, e))) ||
      (rc = gpt_stashed(m, &b->ln1_mean, TENSOR_F32, 1, &N, e)) ||
      (rc = gpt_stashed(m, &b->ln1_rstd, TENSOR_F32, 1, &N, e)) || (rc = gpt_stashed(m, &b->ln2_mean, TENSOR_F32, 1, &N, e)) ||
      (rc = gpt_stashed(m, &b->ln2_rstd, TENSOR_F32, 1, &N, e)))
    return rc;
  return 0;
}

static int alloc_scratch(struct model *m, struct gpt_ws *ws, bool blocks, struct rumor_err *e) {
  int64_t C = GP(&m->spec)->width, N = m->max_rows * GP(&m->spec)->context, S = m->tp ? m->tp->size : 1;
  int64_t bigw = ws->fl > 3 * ws->cl ? ws->fl : 3 * ws->cl, xn = (S + 1 > 2 * S ? S + 1 : 2 * S) * N;
  const int64_t nc[2] = {N, C}, nb[2] = {N, bigw};
  int rc;
  if ((rc = tensor_alloc(&ws->ln_out, m->be, TENSOR_F32, 2, nc, e)) ||
      (rc = tensor_alloc(&ws->dres, m->be, TENSOR_F32, 2, nc, e)) ||
      (rc = tensor_alloc(&ws->dtmp, m->be, TENSOR_F32, 2, nc, e)) ||
      (blocks && (rc = tensor_alloc(&ws->big, m->be, TENSOR_F32, 2, nb, e))))
    return rc;
  /* Only a rank of several exchanges the loss and the score. */
  return S > 1 && m->u1 == GP(&m->spec)->layers + 2 ? tensor_alloc(&ws->xent, m->be, TENSOR_F32, 1, &xn, e) : 0;
}

static int gpt_init(struct model *m, struct rumor_err *e) {
  const struct model_spec *s = &m->spec;
  int L = GP(s)->layers;
  int64_t R = m->max_rows, T = GP(s)->context, C = GP(s)->width, N = R * T;
  const struct model_table *t = model_own_table(m);
  struct gpt_ws *ws = xcalloc(1, sizeof *ws);
  m->impl = ws;
  ws->hl = GP(s)->heads / (m->tp ? m->tp->size : 1);
  ws->cl = C / GP(s)->heads * ws->hl;
  /* The MLP's width: 4C, or a rank's columns of it (tensor parallelism is
   * for dense models only: model_tp_check). */
  ws->fl = GP(s)->experts ? 4 * C : t->p[gpt_block_first(s, 0) + B_FC_B].shape[0];
  ws->vlo = m->tp ? m->tp_layout.slice[0].lo : 0;
  ws->vl = t->p[0].shape[0];
  ws->vld = logits_ld(ws->vl);
  bind_params(m, ws);
  int rc;
  if (m->u1 == L + 2 && m->u0 > 0) { /* the head without unit 0: its own copy of (the rank's rows of) wte */
    const int64_t vc[2] = {ws->vl, C};
    if ((rc = tensor_alloc(&ws->wte_copy, m->be, TENSOR_F32, 2, vc, e)) ||
        (rc = tensor_alloc(&ws->dwte_copy, m->be, TENSOR_F32, 2, vc, e)))
      return rc;
    ws->wte = ws->wte_copy;
    ws->dwte = ws->dwte_copy;
  }
  for (int u = m->u0; u <= m->u1; u++) {
    int64_t shape[2] = {R, model_act_width(m, u)};
    if ((rc = gpt_stashed(m, &ws->acts[u], model_act_dtype(m, u), 2, shape, e))) return rc;
  }
  /* No op reads the logits' padding; zeros there keep the buffer tidy for
   * whoever dumps it whole. */
  if (m->u1 == L + 2) tensor_fill(&ws->acts[L + 2], 0.0f);
  bool blocks = false;
  for (int u = m->u0 > 1 ? m->u0 : 1; u < m->u1 && u <= L; u++) {
    if ((rc = alloc_block_acts(m, ws, u - 1, &ws->blk[u - 1], e))) return rc;
    if (gpt_block_is_moe(s, u - 1)) {
      m->moe_blocks++;
      if (!ws->moe.host && (rc = gpt_moe_alloc_scratch(m, &ws->moe, e))) return rc;
    }
    blocks = true;
  }
  if (m->u1 == L + 2 &&
      ((rc = gpt_stashed(m, &ws->lnf_mean, TENSOR_F32, 1, &N, e)) || (rc = gpt_stashed(m, &ws->lnf_rstd, TENSOR_F32, 1, &N, e))))
    return rc;
  return alloc_scratch(m, ws, blocks, e);
}

static void gpt_free(struct model *m) {
  struct gpt_ws *ws = m->impl;
  if (!ws) return;
  /* Every owner the workspace holds is in the stash or the scratch. */
  for (int i = 0; i < m->nstash; i++) tensor_free(m->stash[i]);
  m->nstash = 0;
  struct tensor *own[] = {&ws->wte_copy, &ws->dwte_copy, &ws->ln_out, &ws->dres, &ws->dtmp, &ws->big, &ws->xent};
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) tensor_free(own[i]);
  gpt_moe_free_scratch(&ws->moe, m->be);
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

/* A view of the first `rows` rows of t, reshaped to (d0, d1[, d2]); v1:
 * n elements from `off`. */
static struct tensor v2(const struct tensor *t, int64_t d0, int64_t d1) {
  int64_t shape[2] = {d0, d1};
  return tensor_view(t, 0, 2, shape);
}
static struct tensor v3(const struct tensor *t, int64_t d0, int64_t d1, int64_t d2) {
  int64_t shape[3] = {d0, d1, d2};
  return tensor_view(t, 0, 3, shape);
}
static struct tensor v1(const struct tensor *t, int64_t off, int64_t n) { return tensor_view(t, off, 1, &n); }

/* y ← x·W + b for x (N, in), W (in, out) in Conv1D layout, b (out). */
static void linear(const struct tensor *x, const struct tensor *w, const struct tensor *b, struct tensor *y) {
  tensor_gemm(false, false, 1.0f, x, w, 0.0f, y);
  tensor_bias_add(y, b);
}

/* A projection into the residual stream: y ← x·W, summed over the ranks
 * when they hold parts of the product (row-parallel), then + b + res. A
 * whole model runs the gemm, the bias and the add, as linear and an add. */
static void linear_res(struct model *m, const struct tensor *x, const struct tensor *w, const struct tensor *b,
                       const struct tensor *res, struct tensor *y) {
  tensor_gemm(false, false, 1.0f, x, w, 0.0f, y);
  model_tp_all_reduce(m, y, tensor_numel(y));
  tensor_bias_add(y, b);
  tensor_add(y, res, y);
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
  if (!m->tp) {
    tensor_embedding_fwd(&tok, &ws->wte, &ws->wpe, &out);
    return;
  }
  /* The rank's vocabulary rows; rank 0 adds the positions, so the sum over
   * the ranks is the whole model's exactly. */
  tensor_embedding_shard_fwd(&tok, &ws->wte, ws->vlo, m->tp->rank == 0 ? &ws->wpe : NULL, &out);
  model_tp_all_reduce(m, &out, rows * T * C);
}

static void block_forward(struct model *m, int u, int64_t rows) {
  struct gpt_ws *ws = m->impl;
  struct gpt_block_acts *a = &ws->blk[u - 1];
  struct tensor *P = ws->p[u - 1];
  int64_t T = positions(m), C = GP(&m->spec)->width, N = rows * T;
  struct tensor x = v2(&ws->acts[u], N, C), y = v2(&ws->acts[u + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor qkv = v2(&a->qkv, N, 3 * ws->cl), att = v2(&a->att, N, ws->cl), mid = v2(&a->mid, N, C);
  struct tensor m1 = v1(&a->ln1_mean, 0, N), r1 = v1(&a->ln1_rstd, 0, N), m2 = v1(&a->ln2_mean, 0, N),
                r2 = v1(&a->ln2_rstd, 0, N);
  tensor_layernorm_fwd(&x, &P[B_LN1_W], &P[B_LN1_B], &ln, &m1, &r1);
  linear(&ln, &P[B_ATTN_W], &P[B_ATTN_B], &qkv);
  struct tensor qkv3 = v3(&a->qkv, rows, T, 3 * ws->cl), att3 = v3(&a->att, rows, T, ws->cl);
  struct tensor lse = v3(&a->lse, rows, ws->hl, T);
  tensor_attention_fwd(&qkv3, ws->hl, &att3, &lse);
  linear_res(m, &att, &P[B_PROJ_W], &P[B_PROJ_B], &x, &mid);
  tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2);
  if (gpt_block_is_moe(&m->spec, u - 1)) {
    gpt_moe_forward(m, u - 1, N, &ln, &y);
    tensor_add(&y, &mid, &y);
    return;
  }
  struct tensor fc = v2(&a->fc, N, ws->fl), g = v2(&ws->big, N, ws->fl);
  linear(&ln, &P[B_FC_W], &P[B_FC_B], &fc);
  tensor_gelu_tanh_fwd(&fc, &g);
  linear_res(m, &g, &P[B_MPROJ_W], &P[B_MPROJ_B], &mid, &y);
}

static void head_forward(struct model *m, int64_t rows) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  struct tensor x = v2(&ws->acts[L + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor mf = v1(&ws->lnf_mean, 0, N), rf = v1(&ws->lnf_rstd, 0, N), logits = v2(&ws->acts[L + 2], N, ws->vld);
  tensor_layernorm_fwd(&x, &ws->lnf_w, &ws->lnf_b, &ln, &mf, &rf);
  /* The tied head: ln_f(x)·wte[vlo, vlo + vl)ᵀ into the first vl columns of the padded rows. */
  tensor_gemm_cols(false, true, 1.0f, &ln, C, &ws->wte, C, 0.0f, &logits, ws->vl);
}

static void gpt_forward(struct model *m, int a, int b, int64_t rows) {
  int L = GP(&m->spec)->layers;
  for (int u = a; u < b; u++) {
    if (u == 0) embed_forward(m, rows);
    else if (u <= L) block_forward(m, u, rows);
    else head_forward(m, rows);
  }
}

/* dlogits (N, vld), the first vl columns of each row → ws->dres = dL/d(ln_f's input). */
static void head_backward(struct model *m, int64_t rows, const struct tensor *dout, float beta) {
  const struct model_spec *s = &m->spec;
  struct gpt_ws *ws = m->impl;
  int L = GP(s)->layers;
  int64_t N = rows * positions(m), C = GP(s)->width;
  struct tensor dl = v2(dout, N, ws->vld), x = v2(&ws->acts[L + 1], N, C), ln = v2(&ws->ln_out, N, C);
  struct tensor mf = v1(&ws->lnf_mean, 0, N), rf = v1(&ws->lnf_rstd, 0, N);
  struct tensor dres = v2(&ws->dres, N, C), dln = v2(&ws->dtmp, N, C);
  tensor_layernorm_fwd(&x, &ws->lnf_w, &ws->lnf_b, &ln, &mf, &rf); /* its output, recomputed */
  tensor_gemm_cols(true, false, 1.0f, &dl, ws->vl, &ln, C, beta, &ws->dwte, C);
  ws->dwte_written = true;
  tensor_gemm_cols(false, false, 1.0f, &dl, ws->vl, &ws->wte, C, 0.0f, &dln, C);
  model_tp_all_reduce(m, &dln, N * C); /* a rank: the other vocabulary rows' part */
  tensor_fill(&dres, 0.0f);
  tensor_layernorm_bwd(&x, &ws->lnf_w, &mf, &rf, &dln, &dres, &ws->dlnf_w, &ws->dlnf_b, beta);
}

/* ws->dres holds dL/d(block output) on entry and dL/d(block input) on
 * return. A rank sums the gradients of ln_2's and ln_1's outputs (partial
 * over its columns and heads) before the LayerNorms' backward. */
static void block_backward(struct model *m, int u, int64_t rows, float beta) {
  struct gpt_ws *ws = m->impl;
  struct gpt_block_acts *a = &ws->blk[u - 1];
  struct tensor *P = ws->p[u - 1], *G = ws->g[u - 1];
  int64_t T = positions(m), C = GP(&m->spec)->width, N = rows * T;
  struct tensor x = v2(&ws->acts[u], N, C), ln = v2(&ws->ln_out, N, C), dres = v2(&ws->dres, N, C);
  struct tensor dtmp = v2(&ws->dtmp, N, C), big = v2(&ws->big, N, ws->fl);
  struct tensor att = v2(&a->att, N, ws->cl), mid = v2(&a->mid, N, C);
  struct tensor m1 = v1(&a->ln1_mean, 0, N), r1 = v1(&a->ln1_rstd, 0, N), m2 = v1(&a->ln2_mean, 0, N),
                r2 = v1(&a->ln2_rstd, 0, N);
  if (gpt_block_is_moe(&m->spec, u - 1)) {
    tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2); /* ln_2's output, recomputed */
    gpt_moe_backward(m, u - 1, N, &ln, &dres, &dtmp, beta);
  } else {
    /* The MLP: its output projection needs the GELU output, recomputed. */
    struct tensor fc = v2(&a->fc, N, ws->fl);
    tensor_gelu_tanh_fwd(&fc, &big);
    linear_bwd(&big, &P[B_MPROJ_W], &dres, &G[B_MPROJ_W], &G[B_MPROJ_B], &big, beta);
    tensor_gelu_tanh_bwd(&fc, &big, &big);
    tensor_layernorm_fwd(&mid, &P[B_LN2_W], &P[B_LN2_B], &ln, &m2, &r2);
    linear_bwd(&ln, &P[B_FC_W], &big, &G[B_FC_W], &G[B_FC_B], &dtmp, beta);
    model_tp_all_reduce(m, &dtmp, N * C);
  }
  tensor_layernorm_bwd(&mid, &P[B_LN2_W], &m2, &r2, &dtmp, &dres, &G[B_LN2_W], &G[B_LN2_B], beta);
  /* Attention: dres now holds dL/d mid. */
  struct tensor datt = v2(&ws->dtmp, N, ws->cl);
  linear_bwd(&att, &P[B_PROJ_W], &dres, &G[B_PROJ_W], &G[B_PROJ_B], &datt, beta);
  struct tensor qkv3 = v3(&a->qkv, rows, T, 3 * ws->cl), att3 = v3(&a->att, rows, T, ws->cl);
  struct tensor lse = v3(&a->lse, rows, ws->hl, T), datt3 = v3(&ws->dtmp, rows, T, ws->cl);
  struct tensor dqkv3 = v3(&ws->big, rows, T, 3 * ws->cl), dqkv = v2(&ws->big, N, 3 * ws->cl);
  tensor_attention_bwd(&qkv3, &att3, &lse, &datt3, ws->hl, &dqkv3);
  tensor_layernorm_fwd(&x, &P[B_LN1_W], &P[B_LN1_B], &ln, &m1, &r1);
  linear_bwd(&ln, &P[B_ATTN_W], &dqkv, &G[B_ATTN_W], &G[B_ATTN_B], &dtmp, beta);
  model_tp_all_reduce(m, &dtmp, N * C);
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
  /* A rank scatters into its vocabulary rows only; every rank adds the
   * whole dL/d out to dwpe: the replicated gradient. */
  if (!m->tp) tensor_embedding_bwd(&tok, &dres, &ws->dwte, &ws->dwpe);
  else tensor_embedding_shard_bwd(&tok, &dres, ws->vlo, &ws->dwte, &ws->dwpe);
  ws->dwte_written = false;
}

static void gpt_backward(struct model *m, int a, int b, int64_t rows, struct tensor *dout, struct tensor *din,
                         bool accumulate) {
  struct gpt_ws *ws = m->impl;
  int L = GP(&m->spec)->layers;
  int64_t N = rows * positions(m), C = GP(&m->spec)->width;
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
  if (GP(s)->experts) { /* Mixtral's names where they fit */
    json_text_set(b, "num_local_experts", json_integer(GP(s)->experts));
    json_text_set(b, "num_experts_per_tok", json_integer(GP(s)->topk));
    json_text_set(b, "moe_every", json_integer(GP(s)->moe_every));
    json_text_set(b, "capacity_factor", json_text_real(GP(s)->capacity_pct / 100.0));
  }
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

/* A mixture of experts' fields of config.json (gpt_hf_config's). */
static int hf_moe_parse(const json_t *cfg, const char *name, struct model_spec *out, struct rumor_err *e) {
  int64_t E = 0, K = 0, M = 0;
  int rc;
  if ((rc = hf_int(cfg, name, "num_local_experts", 1, GPT_MAX_EXPERTS, &E, e)) ||
      (rc = hf_int(cfg, name, "num_experts_per_tok", 1, E, &K, e)) ||
      (rc = hf_int(cfg, name, "moe_every", 1, GP(out)->layers, &M, e)))
    return rc;
  const json_t *f = json_object_get(cfg, "capacity_factor");
  double pct = json_is_number(f) ? 100.0 * json_number_value(f) : -1;
  if (!(pct >= 1 && pct <= 100000) || fabs(pct - round(pct)) > 1e-6)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: capacity_factor is missing or not a number in [0.01, 1000] with at "
                         "most two decimals", name);
  GP(out)->experts = (int)E;
  GP(out)->topk = (int)K;
  GP(out)->moe_every = (int)M;
  GP(out)->capacity_pct = (int)round(pct);
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
  GP(out)->experts = GP(out)->topk = GP(out)->capacity_pct = 0; /* GPT-2 is dense */
  GP(out)->moe_every = 1;
  return json_object_get(cfg, "num_local_experts") ? hf_moe_parse(cfg, name, out, e) : 0;
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
    .act_width = gpt_act_width,
    .set_positions = gpt_set_positions,
    .hf_config = gpt_hf_config,
    .hf_model_type = "gpt2",
    .hf_parse = gpt_hf_parse,
    .hf_ignored = gpt_hf_ignored,
    .hf_prefix = "transformer.",
};

/* ---- tensor parallelism: the cut, the vocabulary-parallel loss and score ---- */

static bool ends_with(const char *s, const char *tail) {
  size_t n = strlen(s), k = strlen(tail);
  return n >= k && strcmp(s + n - k, tail) == 0;
}

static int gpt_tp_check(const struct model_spec *s, const char *spec, int size, struct rumor_err *e) {
  if (GP(s)->experts && size > 1)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "model '%s' cannot be split over %d tensor-parallel ranks: tensor parallelism of a mixture "
                         "of experts is not built; its experts are whole MLPs",
                         spec, size);
  if (GP(s)->heads % size != 0)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "model '%s' cannot be split over %d tensor-parallel ranks: its %d heads are not a multiple "
                         "of %d",
                         spec, size, GP(s)->heads, size);
  if (GP(s)->vocab < size)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "model '%s' cannot be split over %d tensor-parallel ranks: its vocabulary of %lld is "
                         "smaller than the ranks",
                         spec, size, (long long)GP(s)->vocab);
  return 0;
}

static void gpt_tp_split(const struct model_spec *s, size_t i, const struct model_param *p, int *dim, int *groups) {
  (void)s;
  (void)i;
  static const struct {
    const char *tail;
    int dim, groups;
  } CUTS[] = {
      {".wte.weight", 0, 1},         /* vocabulary rows */
      {"attn.c_attn.weight", 1, 3},  /* (C, 3C): the heads' columns of q, k and v */
      {"attn.c_attn.bias", 0, 3},
      {"attn.c_proj.weight", 0, 1},  /* (C, C): the heads' input rows */
      {"mlp.c_fc.weight", 1, 1},     /* (C, 4C): output columns */
      {"mlp.c_fc.bias", 0, 1},
      {"mlp.c_proj.weight", 0, 1},   /* (4C, C): the same as input rows */
  };
  *dim = -1;
  *groups = 1;
  for (size_t k = 0; k < sizeof CUTS / sizeof CUTS[0]; k++)
    if (ends_with(p->name, CUTS[k].tail)) {
      *dim = CUTS[k].dim;
      *groups = CUTS[k].groups;
    }
}

static void gpt_tp_loss(struct model *m, int64_t rows, struct tensor *dlogits, float grad_scale) {
  struct gpt_ws *ws = m->impl;
  int64_t n = model_targets(m, rows), S = m->tp->size, shape[2] = {n, ws->vld};
  struct tensor logits = tensor_view(model_act(m, m->u1), 0, 2, shape), dl = tensor_view(dlogits, 0, 2, shape);
  struct tensor labels = v1(&m->labels, 0, n), losses = v1(&m->losses, 0, n);
  if (S == 1) { /* the whole row: model.c's loss, bit for bit */
    tensor_softmax_xent_cols(&logits, ws->vl, &labels, &dl, &losses, grad_scale);
    return;
  }
  /* xent: S rows of n log-sum-exps (the rank's in row `rank`, zeros
   * elsewhere), then n target logits; one all-reduce gathers them all. */
  int64_t pshape[2] = {S, n};
  struct tensor all = v1(&ws->xent, 0, (S + 1) * n), parts = tensor_view(&ws->xent, 0, 2, pshape);
  struct tensor mine = v1(&ws->xent, m->tp->rank * n, n), target = v1(&ws->xent, S * n, n);
  tensor_fill(&all, 0.0f);
  tensor_xent_shard_stats(&logits, ws->vl, &labels, ws->vlo, &mine, &target);
  model_tp_all_reduce(m, &all, (S + 1) * n);
  tensor_xent_shard_grad(&logits, ws->vl, &labels, ws->vlo, &parts, &target, &dl, &losses, grad_scale);
}

/* The rank's best logit and its class per target into slots [rank·n, ...)
 * and [(S + rank)·n, ...) of `slots` (2·S·n floats, zeros elsewhere);
 * classes are below 2^24, exact in a float. */
static void local_best(const struct gpt_ws *ws, const float *logits, int64_t n, int rank, int64_t S, float *slots) {
  for (int64_t r = 0; r < n; r++) {
    const float *row = logits + r * ws->vld;
    int64_t best = 0;
    for (int64_t c = 1; c < ws->vl; c++)
      if (row[c] > row[best]) best = c;
    slots[rank * n + r] = row[best];
    slots[(S + rank) * n + r] = (float)(ws->vlo + best);
  }
}

/* model_score: the argmax over every rank's logits (the first maximal
 * class, as model.c's, since ranks hold ascending classes), and the loss. */
static void gpt_tp_score(struct model *m, int64_t rows, const int32_t *labels_host, int64_t *correct,
                         double *loss_sum) {
  struct gpt_ws *ws = m->impl;
  int64_t n = model_targets(m, rows), S = m->tp->size;
  float *logits = xmalloc((size_t)(n * ws->vld) * sizeof(float)), *slots = xcalloc((size_t)(2 * S * n), sizeof(float));
  struct tensor *out = model_act(m, m->u1);
  tensor_copy_to_host(out, 0, logits, (size_t)(n * ws->vld) * sizeof(float));
  local_best(ws, logits, n, m->tp->rank, S, slots);
  if (S > 1) {
    struct tensor x = v1(&ws->xent, 0, 2 * S * n);
    tensor_copy_from_host(&x, 0, slots, (size_t)(2 * S * n) * sizeof(float));
    model_tp_all_reduce(m, &x, 2 * S * n);
    tensor_copy_to_host(&x, 0, slots, (size_t)(2 * S * n) * sizeof(float));
  }
  for (int64_t r = 0; r < n; r++) {
    int64_t best = 0;
    for (int64_t s = 1; s < S; s++)
      if (slots[s * n + r] > slots[best * n + r]) best = s;
    *correct += (int64_t)slots[(S + best) * n + r] == labels_host[r];
  }
  model_loss(m, rows, out, 0.0f); /* the logits are on the host now */
  struct tensor losses = v1(&m->losses, 0, n);
  *loss_sum += tensor_sum(&losses);
  free(logits);
  free(slots);
}

/* A rank runs the passes above; it differs from a whole model in its
 * logits' width (its share, padded as a whole model's), its initial values,
 * the loss and the score. */
static const struct model_family_ops gpt_tp_ops = {
    .name = "gpt",
    .unit_noun = "block",
    .init = gpt_init,
    .free = gpt_free,
    .act = gpt_act,
    .forward = gpt_forward,
    .backward = gpt_backward,
    .tied = gpt_tied,
    .tied_entry = 0,
    .set_positions = gpt_set_positions,
    .act_width = gpt_act_width,
    .init_params = model_tp_init_params,
    .loss = gpt_tp_loss,
    .score = gpt_tp_score,
};

const struct model_tp_family model_gpt_tp = {
    .ops = &gpt_tp_ops,
    .check = gpt_tp_check,
    .split = gpt_tp_split,
};
