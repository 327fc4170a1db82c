/*
 * The CUDA backend's transformer ops (tensor.h, "transformer ops", and
 * tensor_add) against the plain reference ops tensor_ref_*, on random inputs.
 *
 * - Shapes include T = 1, T = 127, widths that are not multiples of 32, one
 *   head, R = 1 and R = 3, GPT-2 small's width and heads, GPT-2's context
 *   length, and an attention case that needs two rounds of the backend's
 *   score scratch. Later shapes are smaller than earlier ones, so they run
 *   on scratch grown (and left dirty) by the earlier ones.
 * - Every device tensor is a view with sentinel guard elements on both
 *   sides (checked after each op) and starts as NaN, so an output element
 *   that was never written, or a read of an output that must not be read
 *   (dw, db with beta = 0), fails the comparison.
 * - Comparisons: |got − ref| <= atol + rtol·|ref| element-wise, NaN/Inf in
 *   `got` exactly where `ref` has them; failures name the worst element and
 *   the seed. Tolerances are stated at each test with the reason.
 * - Accumulating outputs (embedding bwd, LayerNorm dx) start from random
 *   values; dw, db are checked with beta 0 (not read), 0.5 and 1.
 * - Embedding bwd and LayerNorm bwd are run twice on the same inputs and
 *   must give bitwise equal results; embedding bwd also at GPT-2's batch
 *   (8 × 1024 positions of one token: the longest run there is) and with
 *   tokens outside [0, V), which must be skipped without a write outside
 *   dwte.
 *
 * - The tied head's products and the cross-entropy on padded rows (GPT's
 *   logits, V = 65 in rows of 128 and 50257 in rows of 50304): the padding
 *   is neither written nor read.
 *
 * Every test needs a GPU and skips with "no CUDA GPU: ..." when
 * tensor_cuda_device_count() is 0. RUMOR_TEST_SEED=<n> repeats a run's
 * random inputs.
 */
#include <criterion/criterion.h>
#include <float.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor_ref.h"

#include "../support/cuda_check.h"

/* ---- shapes ------------------------------------------------------------------------------ */

/* (R, T, C, heads) for embedding, LayerNorm and attention; the larger first,
 * so that later shapes run on scratch grown (and dirtied) before. */
struct xf_shape {
  int64_t r, t, c;
  int nh;
};
static const struct xf_shape kXfShapes[] = {
    {1, 1024, 64, 1}, /* GPT-2's context length, one head of 64 */
    {2, 96, 768, 12}, /* GPT-2 small's width and heads */
    {2, 256, 64, 2},  /* two heads of 32 */
    {3, 127, 48, 4},  /* T = 127, hs = 12 */
    {1, 64, 33, 1},   /* C not a multiple of 32, one head of 33 */
    {3, 33, 100, 5},  /* hs = 20, nothing a power of two */
    {3, 1, 12, 3},    /* T = 1, R = 3, hs = 4 */
    {1, 1, 8, 1},     /* T = 1, R = 1 */
};
#define NXF ((int)(sizeof kXfShapes / sizeof kXfShapes[0]))

static void shape_name(char *buf, size_t len, const char *op, const struct xf_shape *s) {
  snprintf(buf, len, "%s R=%" PRId64 " T=%" PRId64 " C=%" PRId64 " nh=%d", op, s->r, s->t, s->c, s->nh);
}

/* ==== element-wise ======================================================================= */

Test(cuda_nn, add_matches_reference_in_and_out_of_place) {
  open_gpu();
  for (int s = 0; s < NSIZES; s++) {
    int64_t n = kSizes[s];
    int mark = arena_mark();
    float *x = hbuf(n), *y = hbuf(n), *ref = hbuf(n), *got = hbuf(n);
    fill_normal(x, n, 0.0f, 1.0f);
    fill_normal(y, n, 0.0f, 1.0f);
    tensor_ref_add(x, y, ref, n);
    char what[64];
    for (int mode = 0; mode < 3; mode++) { /* out separate, out = x, out = y */
      struct dev dx = dev_from(1, &n, x), dy = dev_from(1, &n, y), dout = dev_new(1, &n);
      struct dev *o = mode == 0 ? &dout : mode == 1 ? &dx : &dy;
      tensor_add(&dx.t, &dy.t, &o->t);
      dev_download(o, got);
      static const char *const modes[] = {"out of place", "out = x", "out = y"};
      snprintf(what, sizeof what, "add n=%" PRId64 " (%s)", n, modes[mode]);
      cr_assert(matches_exactly(what, got, ref, n), "%s", g_why); /* one float add per element */
      cr_assert(guards_intact(o, what), "%s", g_why);
    }
    arena_release(mark);
  }
  close_gpu();
}

/* Tolerance: the kernels build GELU from expf (2 ulp) and IEEE division, in
 * the exp(−2|u|) form, so the relative error is a few ulp except in the far
 * tails, where an ulp-level error of u (|u| up to ~50) becomes ~|2u|·1e-7
 * relative on values below 1e-20; atol 1e-6 covers those with room, rtol
 * 1e-5 is ~80 ulp. A wrong constant or formula misses by 1e-3 or more. */
Test(cuda_nn, gelu_tanh_fwd_and_bwd_match_reference_with_specials_in_and_out_of_place) {
  open_gpu();
  const double atol = 1e-6, rtol = 1e-5;
  for (int s = 0; s < NSIZES; s++) {
    int64_t n = kSizes[s];
    int mark = arena_mark();
    float *x = hbuf(n), *y = hbuf(n), *dy = hbuf(n), *dx = hbuf(n), *got = hbuf(n);
    fill_normal(x, n, 0.0f, 3.0f);
    add_specials(x, n);
    fill_normal(dy, n, 0.0f, 1.0f);
    tensor_ref_gelu_tanh_fwd(x, y, n);
    tensor_ref_gelu_tanh_bwd(x, dy, dx, n);
    cr_assert(
        activation_matches("gelu_tanh", tensor_gelu_tanh_fwd, tensor_gelu_tanh_bwd, x, y, dy, dx, n, got, atol, rtol),
        "%s", g_why);
    arena_release(mark);
  }
  close_gpu();
}

/* ==== embedding ============================================================================ */

/* Tokens in [0, v): mostly from a few small ids (many repeats), some
 * uniform, and the first and last rows of the table both used. */
static void fill_tokens(int32_t *tok, int64_t n, int64_t v) {
  for (int64_t i = 0; i < n; i++) {
    uint64_t pick = rng_below(&g_rng, 4);
    uint64_t bound = pick == 0 ? (uint64_t)v : (uint64_t)(v < 5 ? v : 5);
    tok[i] = (int32_t)rng_below(&g_rng, bound);
  }
  tok[0] = (int32_t)(v - 1);
  if (n > 1) tok[n - 1] = 0;
}

/* The most positions any token of [lo, lo + v) takes in tok[0..n). */
static int64_t max_repeats(const int32_t *tok, int64_t n, int64_t lo, int64_t v) {
  int64_t *count = calloc((size_t)v, sizeof *count), most = 0;
  cr_assert_not_null(count);
  for (int64_t i = 0; i < n; i++) {
    int64_t k = (int64_t)tok[i] - lo;
    if (k >= 0 && k < v && ++count[k] > most) most = count[k];
  }
  free(count);
  return most;
}

/* dwte against the reference loop. Contract (kernels.h): a token seen at
 * most twice is summed in the loop's order, so exactly; a frequent token's
 * positions are regrouped into pieces of KERN_EMB_PIECE, which moves the
 * float sum of k unit-normal terms by at most about 1.5e-7·k (measured
 * worst case over 2000 sums on the CPU for k = 65 .. 65536). Held to
 * 1e-6 + 5e-7·k, k the largest count, with rtol 1e-6. */
static bool dwte_matches(const char *what, const float *got, const float *ref, int64_t len, int64_t most) {
  if (most <= 2) return matches_exactly(what, got, ref, len);
  return matches(what, got, ref, len, 1e-6 + 5e-7 * (double)most, 1e-6);
}

/* Embedding fwd is one float add per element, so it is held to exact
 * equality, and so is dwpe (summed in the reference's order); dwte as
 * dwte_matches. */
static void run_embedding(const struct xf_shape *s, int64_t v, bool same_token) {
  const int64_t r = s->r, t = s->t, c = s->c, tmax = t + 3, n = r * t;
  int mark = arena_mark();
  int32_t *tok = hbuf_i32(n);
  if (same_token)
    for (int64_t i = 0; i < n; i++) tok[i] = (int32_t)(v / 2);
  else
    fill_tokens(tok, n, v);
  float *wte = hbuf(v * c), *wpe = hbuf(tmax * c), *ref = hbuf(n * c), *got = hbuf(n * c);
  fill_normal(wte, v * c, 0.0f, 1.0f);
  fill_normal(wpe, tmax * c, 0.0f, 1.0f);
  int64_t st[2] = {r, t}, swte[2] = {v, c}, swpe[2] = {tmax, c}, sout[3] = {r, t, c};
  struct dev dtok = dev_new_dt(TENSOR_I32, 2, st);
  dev_upload(&dtok, tok);
  struct dev dwte = dev_from(2, swte, wte), dwpe = dev_from(2, swpe, wpe), dout = dev_new(3, sout);
  char what[128];

  tensor_embedding_fwd(&dtok.t, &dwte.t, &dwpe.t, &dout.t);
  tensor_ref_embedding_fwd(tok, wte, wpe, ref, r, t, c);
  dev_download(&dout, got);
  shape_name(what, sizeof what, same_token ? "embedding_fwd (one token)" : "embedding_fwd", s);
  cr_assert(matches_exactly(what, got, ref, n * c), "%s", g_why);
  cr_assert(guards_intact(&dout, what), "%s", g_why);

  /* Backward onto random gradients already there (it accumulates). */
  float *g = hbuf(n * c), *gte = hbuf(v * c), *gpe = hbuf(tmax * c);
  fill_normal(g, n * c, 0.0f, 1.0f);
  fill_normal(gte, v * c, 0.0f, 1.0f);
  fill_normal(gpe, tmax * c, 0.0f, 1.0f);
  struct dev dg = dev_from(3, sout, g), dgte = dev_from(2, swte, gte), dgpe = dev_from(2, swpe, gpe);
  tensor_embedding_bwd(&dtok.t, &dg.t, &dgte.t, &dgpe.t);
  tensor_ref_embedding_bwd(tok, g, gte, gpe, r, t, c);
  float *got_te = hbuf(v * c), *got_pe = hbuf(tmax * c);
  dev_download(&dgte, got_te);
  dev_download(&dgpe, got_pe);
  shape_name(what, sizeof what, same_token ? "embedding_bwd dwte (one token)" : "embedding_bwd dwte", s);
  cr_assert(dwte_matches(what, got_te, gte, v * c, max_repeats(tok, n, 0, v)), "%s", g_why);
  cr_assert(guards_intact(&dgte, what), "%s", g_why);
  shape_name(what, sizeof what, same_token ? "embedding_bwd dwpe (one token)" : "embedding_bwd dwpe", s);
  cr_assert(matches_exactly(what, got_pe, gpe, tmax * c), "%s", g_why); /* rows t .. tmax−1 untouched */
  cr_assert(guards_intact(&dgpe, what), "%s", g_why);
  arena_release(mark);
}

Test(cuda_nn, embedding_fwd_and_accumulating_bwd_equal_reference_with_repeated_tokens) {
  open_gpu();
  static const int64_t vocab[] = {1, 7, 1000};
  for (int i = 0; i < NXF; i++)
    for (int j = 0; j < 3; j++) run_embedding(&kXfShapes[i], vocab[j], false);
  run_embedding(&kXfShapes[0], 50257, false); /* GPT-2's vocabulary: 16 sort bits */
  run_embedding(&kXfShapes[0], 50257, true);  /* one token everywhere: one run of 1024 */
  close_gpu();
}

Test(cuda_nn, embedding_bwd_is_bitwise_deterministic) {
  open_gpu();
  const int64_t r = 8, t = 1024, c = 96, v = 50257, n = r * t;
  int32_t *tok = hbuf_i32(n);
  /* Skewed ids (u⁴·v): thousands of repeats of the small ones. */
  for (int64_t i = 0; i < n; i++) {
    double u = rng_uniform(&g_rng);
    tok[i] = (int32_t)(u * u * u * u * (double)(v - 1));
  }
  float *g = hbuf(n * c), *gte = hbuf(v * c), *gpe = hbuf(t * c);
  fill_normal(g, n * c, 0.0f, 1.0f);
  fill_normal(gte, v * c, 0.0f, 1.0f);
  fill_normal(gpe, t * c, 0.0f, 1.0f);
  int64_t st[2] = {r, t}, sg[3] = {r, t, c}, swte[2] = {v, c}, swpe[2] = {t, c};
  struct dev dtok = dev_new_dt(TENSOR_I32, 2, st);
  dev_upload(&dtok, tok);
  struct dev dg = dev_from(3, sg, g), dgte = dev_new(2, swte), dgpe = dev_new(2, swpe);
  float *te[2] = {hbuf(v * c), hbuf(v * c)}, *pe[2] = {hbuf(t * c), hbuf(t * c)};
  for (int run = 0; run < 2; run++) {
    dev_upload(&dgte, gte);
    dev_upload(&dgpe, gpe);
    tensor_embedding_bwd(&dtok.t, &dg.t, &dgte.t, &dgpe.t);
    dev_download(&dgte, te[run]);
    dev_download(&dgpe, pe[run]);
  }
  cr_assert(same_bits("embedding_bwd dwte, two runs", te[0], te[1], v * c), "%s", g_why);
  cr_assert(same_bits("embedding_bwd dwpe, two runs", pe[0], pe[1], t * c), "%s", g_why);
  tensor_ref_embedding_bwd(tok, g, gte, gpe, r, t, c);
  cr_assert(dwte_matches("embedding_bwd dwte (R=8 T=1024 C=96 V=50257)", te[0], gte, v * c, max_repeats(tok, n, 0, v)),
            "%s", g_why);
  cr_assert(matches_exactly("embedding_bwd dwpe (R=8 T=1024 C=96 V=50257)", pe[0], gpe, t * c), "%s", g_why);
  close_gpu();
}

/* GPT-2's training batch (8 × 1024 positions, C = 768, V = 50257) all of one
 * token: a run of 8192, the embedding backward's worst case (split into
 * pieces, kernels.h). Deterministic and within dwte_matches of the loop. */
Test(cuda_nn, embedding_bwd_at_gpt2_batch_of_one_token_is_deterministic_and_matches) {
  open_gpu();
  const int64_t r = 8, t = 1024, c = 768, v = 50257, n = r * t;
  int32_t *tok = hbuf_i32(n);
  for (int64_t i = 0; i < n; i++) tok[i] = 198; /* GPT-2's newline, say */
  float *g = hbuf(n * c), *gte = hbuf(v * c), *gpe = hbuf(t * c);
  fill_normal(g, n * c, 0.0f, 1.0f);
  fill_normal(gte, v * c, 0.0f, 1.0f);
  fill_normal(gpe, t * c, 0.0f, 1.0f);
  int64_t st[2] = {r, t}, sg[3] = {r, t, c}, swte[2] = {v, c}, swpe[2] = {t, c};
  struct dev dtok = dev_new_dt(TENSOR_I32, 2, st);
  dev_upload(&dtok, tok);
  struct dev dg = dev_from(3, sg, g), dgte = dev_new(2, swte), dgpe = dev_new(2, swpe);
  float *te[2] = {hbuf(v * c), hbuf(v * c)}, *pe = hbuf(t * c);
  for (int run = 0; run < 2; run++) {
    dev_upload(&dgte, gte);
    dev_upload(&dgpe, gpe);
    tensor_embedding_bwd(&dtok.t, &dg.t, &dgte.t, &dgpe.t);
    dev_download(&dgte, te[run]);
  }
  dev_download(&dgpe, pe);
  cr_assert(same_bits("embedding_bwd dwte (one token, 8192 positions), two runs", te[0], te[1], v * c), "%s", g_why);
  cr_assert(guards_intact(&dgte, "embedding_bwd dwte (one token)"), "%s", g_why);
  tensor_ref_embedding_bwd(tok, g, gte, gpe, r, t, c);
  cr_assert(dwte_matches("embedding_bwd dwte (R=8 T=1024 C=768 V=50257, one token)", te[0], gte, v * c, n), "%s",
            g_why);
  cr_assert(matches_exactly("embedding_bwd dwpe (R=8 T=1024 C=768)", pe, gpe, t * c), "%s", g_why);
  close_gpu();
}

/* Tokens outside [0, V) break tensor_embedding_fwd's precondition; the
 * contract (tensor.h) is that both passes then skip them: a zero row from
 * wte, no gradient, nothing read or written outside wte and dwte. The
 * extremes (INT32_MIN, INT32_MAX) would address far outside the table if
 * used, which CUDA reports as an illegal address (a panic here). */
Test(cuda_nn, embedding_skips_tokens_outside_the_vocabulary_without_writing_out_of_bounds) {
  open_gpu();
  const int64_t r = 2, t = 64, c = 48, v = 100, n = r * t;
  int32_t *tok = hbuf_i32(n);
  fill_tokens(tok, n, v);
  const int32_t bad[] = {-1, (int32_t)v, (int32_t)v + 5, INT32_MIN, INT32_MAX, -100};
  for (size_t k = 0; k < sizeof bad / sizeof bad[0]; k++) tok[7 * k + 3] = bad[k];
  float *wte = hbuf(v * c), *wpe = hbuf(t * c), *ref = hbuf(n * c), *got = hbuf(n * c);
  fill_normal(wte, v * c, 0.0f, 1.0f);
  fill_normal(wpe, t * c, 0.0f, 1.0f);
  int64_t st[2] = {r, t}, swte[2] = {v, c}, swpe[2] = {t, c}, sout[3] = {r, t, c};
  struct dev dtok = dev_new_dt(TENSOR_I32, 2, st);
  dev_upload(&dtok, tok);
  struct dev dwte = dev_from(2, swte, wte), dwpe = dev_from(2, swpe, wpe), dout = dev_new(3, sout);
  tensor_embedding_fwd(&dtok.t, &dwte.t, &dwpe.t, &dout.t);
  tensor_ref_embedding_shard_fwd(tok, wte, 0, v, wpe, ref, r, t, c);
  dev_download(&dout, got);
  cr_assert(matches_exactly("embedding_fwd with tokens outside [0, V)", got, ref, n * c), "%s", g_why);
  cr_assert(guards_intact(&dout, "embedding_fwd with tokens outside [0, V)"), "%s", g_why);
  float *g = hbuf(n * c), *gte = hbuf(v * c), *gpe = hbuf(t * c), *got_te = hbuf(v * c), *got_pe = hbuf(t * c);
  fill_normal(g, n * c, 0.0f, 1.0f);
  fill_normal(gte, v * c, 0.0f, 1.0f);
  fill_normal(gpe, t * c, 0.0f, 1.0f);
  struct dev dg = dev_from(3, sout, g), dgte = dev_from(2, swte, gte), dgpe = dev_from(2, swpe, gpe);
  tensor_embedding_bwd(&dtok.t, &dg.t, &dgte.t, &dgpe.t);
  tensor_ref_embedding_shard_bwd(tok, g, 0, v, gte, gpe, r, t, c);
  dev_download(&dgte, got_te);
  dev_download(&dgpe, got_pe);
  cr_assert(dwte_matches("embedding_bwd dwte with tokens outside [0, V)", got_te, gte, v * c,
                         max_repeats(tok, n, 0, v)),
            "%s", g_why);
  cr_assert(matches_exactly("embedding_bwd dwpe with tokens outside [0, V)", got_pe, gpe, t * c), "%s", g_why);
  cr_assert(guards_intact(&dgte, "embedding_bwd dwte") && guards_intact(&dgpe, "embedding_bwd dwpe"), "%s", g_why);
  close_gpu();
}

/* ==== vocabulary-parallel embedding and cross-entropy ==================================== */

/* A shard [lo, lo + vs) of a vocabulary of v, with and without wpe / dwpe:
 * the same exactness as the whole op (one add per element; sums in the
 * reference's order). Tokens of other shards give zeros and no gradient. */
static void run_embedding_shard(const struct xf_shape *s, int64_t v, int64_t lo, int64_t vs, bool with_wpe) {
  const int64_t r = s->r, t = s->t, c = s->c, tmax = t + 3, n = r * t;
  int mark = arena_mark();
  int32_t *tok = hbuf_i32(n);
  fill_tokens(tok, n, v);
  float *wte = hbuf(vs * c), *wpe = hbuf(tmax * c), *ref = hbuf(n * c), *got = hbuf(n * c);
  fill_normal(wte, vs * c, 0.0f, 1.0f);
  fill_normal(wpe, tmax * c, 0.0f, 1.0f);
  int64_t st[2] = {r, t}, swte[2] = {vs, c}, swpe[2] = {tmax, c}, sout[3] = {r, t, c};
  struct dev dtok = dev_new_dt(TENSOR_I32, 2, st);
  dev_upload(&dtok, tok);
  struct dev dwte = dev_from(2, swte, wte), dwpe = dev_from(2, swpe, wpe), dout = dev_new(3, sout);
  char what[160];
  tensor_embedding_shard_fwd(&dtok.t, &dwte.t, lo, with_wpe ? &dwpe.t : NULL, &dout.t);
  tensor_ref_embedding_shard_fwd(tok, wte, lo, vs, with_wpe ? wpe : NULL, ref, r, t, c);
  dev_download(&dout, got);
  shape_name(what, sizeof what, with_wpe ? "embedding_shard_fwd (wpe)" : "embedding_shard_fwd", s);
  cr_assert(matches_exactly(what, got, ref, n * c), "%s", g_why);
  cr_assert(guards_intact(&dout, what), "%s", g_why);
  float *g = hbuf(n * c), *gte = hbuf(vs * c), *gpe = hbuf(tmax * c), *got_te = hbuf(vs * c), *got_pe = hbuf(tmax * c);
  fill_normal(g, n * c, 0.0f, 1.0f);
  fill_normal(gte, vs * c, 0.0f, 1.0f);
  fill_normal(gpe, tmax * c, 0.0f, 1.0f);
  struct dev dg = dev_from(3, sout, g), dgte = dev_from(2, swte, gte), dgpe = dev_from(2, swpe, gpe);
  tensor_embedding_shard_bwd(&dtok.t, &dg.t, lo, &dgte.t, with_wpe ? &dgpe.t : NULL);
  tensor_ref_embedding_shard_bwd(tok, g, lo, vs, gte, with_wpe ? gpe : NULL, r, t, c);
  dev_download(&dgte, got_te);
  dev_download(&dgpe, got_pe);
  shape_name(what, sizeof what, "embedding_shard_bwd dwte", s);
  cr_assert(dwte_matches(what, got_te, gte, vs * c, max_repeats(tok, n, lo, vs)), "%s", g_why);
  shape_name(what, sizeof what, with_wpe ? "embedding_shard_bwd dwpe" : "embedding_shard_bwd dwpe (untouched)", s);
  cr_assert(matches_exactly(what, got_pe, gpe, tmax * c), "%s", g_why);
  cr_assert(guards_intact(&dgte, what) && guards_intact(&dgpe, what), "%s", g_why);
  arena_release(mark);
}

Test(cuda_nn, embedding_shards_equal_reference_with_and_without_positions) {
  open_gpu();
  for (int i = 0; i < NXF; i++) {
    run_embedding_shard(&kXfShapes[i], 1000, 0, 334, true);
    run_embedding_shard(&kXfShapes[i], 1000, 334, 333, false);
    run_embedding_shard(&kXfShapes[i], 7, 6, 1, false);
  }
  run_embedding_shard(&kXfShapes[0], 50257, 25129, 25128, true); /* GPT-2's vocabulary over two ranks */
  close_gpu();
}

/* Tolerances: the kernels sum a row's exponentials in float lanes (the
 * reference in double) and take expf (2 ulp): lse within 1e-5 relative
 * (cols up to 50257 terms of <= 1), targets exact, the combined loss 1e-5
 * relative with 1e-5 absolute (a loss near 0 is a difference of two lse of
 * size ~10), dlogits 1e-5 relative and 1e-9 absolute (underflowing tails). */
static void run_xent_shard(int64_t rows, int64_t cols, int64_t lo, int64_t v, int nparts, float scale) {
  int mark = arena_mark();
  float *x = hbuf(rows * cols), *lse_ref = hbuf(rows), *tg_ref = hbuf(rows), *got = hbuf(rows * cols);
  float *parts = hbuf(nparts * rows), *d_ref = hbuf(rows * cols), *l_ref = hbuf(rows);
  int32_t *lab = hbuf_i32(rows);
  fill_normal(x, rows * cols, 0.0f, scale);
  for (int64_t r = 0; r < rows; r++) lab[r] = (int32_t)rng_below(&g_rng, (uint64_t)v);
  lab[0] = (int32_t)lo; /* one label surely in the shard */
  fill_normal(parts, nparts * rows, 5.0f, 2.0f);
  int64_t sx[2] = {rows, cols}, sp[2] = {nparts, rows};
  struct dev dx = dev_from(2, sx, x), dlab = dev_new_dt(TENSOR_I32, 1, &rows), dlse = dev_vec(rows),
             dtg = dev_vec(rows);
  dev_upload(&dlab, lab);
  char what[128];
  tensor_xent_shard_stats(&dx.t, cols, &dlab.t, lo, &dlse.t, &dtg.t);
  tensor_ref_xent_shard_stats(x, lab, lo, lse_ref, tg_ref, rows, cols);
  dev_download(&dlse, got);
  snprintf(what, sizeof what, "xent_shard_stats lse [%" PRId64 ", %" PRId64 "] lo %" PRId64, rows, cols, lo);
  cr_assert(matches(what, got, lse_ref, rows, 0, 1e-5), "%s", g_why);
  dev_download(&dtg, got);
  snprintf(what, sizeof what, "xent_shard_stats target [%" PRId64 ", %" PRId64 "]", rows, cols);
  cr_assert(matches_exactly(what, got, tg_ref, rows), "%s", g_why);
  memcpy(parts, lse_ref, (size_t)rows * sizeof(float)); /* this shard's part, the others made up */
  struct dev dparts = dev_from(2, sp, parts), dd = dev_new(2, sx), dl = dev_vec(rows);
  tensor_ref_xent_shard_grad(x, lab, lo, parts, nparts, tg_ref, d_ref, l_ref, rows, cols, 0.5f);
  for (int alias = 0; alias < 2; alias++) {
    struct dev *out = alias ? &dx : &dd;
    tensor_xent_shard_grad(&dx.t, cols, &dlab.t, lo, &dparts.t, &dtg.t, &out->t, &dl.t, 0.5f);
    dev_download(out, got);
    snprintf(what, sizeof what, "xent_shard_grad dlogits [%" PRId64 ", %" PRId64 "]%s", rows, cols,
             alias ? " in place" : "");
    cr_assert(matches(what, got, d_ref, rows * cols, 1e-9, 1e-5), "%s", g_why);
    cr_assert(guards_intact(out, what), "%s", g_why);
    dev_download(&dl, got);
    cr_assert(matches("xent_shard_grad losses", got, l_ref, rows, 1e-5, 1e-5), "%s", g_why);
  }
  arena_release(mark);
}

Test(cuda_nn, xent_shards_match_reference_in_and_out_of_place) {
  open_gpu();
  run_xent_shard(37, 103, 0, 103, 1, 3.0f);       /* one shard: the whole row */
  run_xent_shard(64, 26, 26, 101, 4, 30.0f);      /* sharp softmax, uneven shard */
  run_xent_shard(5, 25129, 25128, 50257, 2, 1.0f); /* GPT-2's vocabulary over two ranks */
  run_xent_shard(1, 1, 0, 2, 2, 1.0f);
  close_gpu();
}

/* ==== padded rows (GPT's logits) ========================================================= */

/* The padding columns [cols, ld) of d ([rows, ld]) still hold the poison
 * NaN it started with: never written. `all` is host scratch of rows·ld. */
static bool padding_untouched(const struct dev *d, int64_t cols, float *all, const char *what) {
  int64_t rows = d->t.shape[0], ld = d->t.shape[1];
  dev_download(d, all);
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = cols; c < ld; c++) {
      uint32_t bits;
      memcpy(&bits, &all[r * ld + c], 4);
      if (bits != POISON_BITS)
        return fail_why("%s: padding [%" PRId64 ", %" PRId64 "] was written (0x%08x; seed %" PRIu64 ")", what, r, c,
                        bits, g_seed);
    }
  return true;
}

static void pack_rows(const float *src, int64_t rows, int64_t cols, int64_t ld, float *dst) {
  for (int64_t r = 0; r < rows; r++) memcpy(dst + r * cols, src + r * ld, (size_t)cols * sizeof *dst);
}

/* The tied head's three products (tensor_gemm_cols) and the cross-entropy
 * over logits padded as GPT pads them (V classes in rows of ld floats, the
 * padding NaN) against the reference on the packed matrices; the padding
 * is neither written nor read (a NaN read would reach the finite
 * results). Tolerances: the GEMMs 1e-5 + 1e-4·|ref| (FP32, sums of k <=
 * 50257 products of unit-scale terms, cuBLAS's order against the
 * reference's double); the cross-entropy as run_xent_shard's. */
static void run_padded_head(int64_t n, int64_t c, int64_t v, int64_t ld) {
  int mark = arena_mark();
  float *ln = hbuf(n * c), *wte = hbuf(v * c), *dw = hbuf(v * c), *ref = hbuf(n * v), *d_ref = hbuf(n * v);
  float *l_ref = hbuf(n), *all = hbuf(n * ld), *got = hbuf(n * v), *dx_ref = hbuf(n * c);
  int32_t *lab = hbuf_i32(n);
  fill_normal(ln, n * c, 0.0f, 1.0f);
  fill_normal(wte, v * c, 0.0f, 0.5f);
  fill_normal(dw, v * c, 0.0f, 1.0f);
  for (int64_t r = 0; r < n; r++) lab[r] = (int32_t)rng_below(&g_rng, (uint64_t)v);
  lab[0] = (int32_t)(v - 1);
  int64_t snc[2] = {n, c}, svc[2] = {v, c}, spad[2] = {n, ld};
  struct dev dln = dev_from(2, snc, ln), dwte = dev_from(2, svc, wte), lg = dev_new(2, spad), dl = dev_new(2, spad);
  struct dev dlab = dev_new_dt(TENSOR_I32, 1, &n), ls = dev_vec(n), gw = dev_from(2, svc, dw), gx = dev_new(2, snc);
  dev_upload(&dlab, lab);
  char what[128];
  tensor_ref_gemm(false, true, (int)n, (int)v, (int)c, 1.0f, ln, wte, 0.0f, ref);
  tensor_gemm_cols(false, true, 1.0f, &dln.t, c, &dwte.t, c, 0.0f, &lg.t, v);
  snprintf(what, sizeof what, "gemm_cols logits [%" PRId64 ", %" PRId64 " of %" PRId64 "]", n, v, ld);
  cr_assert(padding_untouched(&lg, v, all, what) && guards_intact(&lg, what), "%s", g_why);
  pack_rows(all, n, v, ld, got);
  cr_assert(matches(what, got, ref, n * v, 1e-5, 1e-4), "%s", g_why);
  tensor_ref_softmax_xent(got, lab, d_ref, l_ref, n, v, 0.5f); /* on the device's logits */
  for (int alias = 0; alias < 2; alias++) {
    struct dev *out = alias ? &lg : &dl;
    tensor_softmax_xent_cols(&lg.t, v, &dlab.t, &out->t, &ls.t, 0.5f);
    snprintf(what, sizeof what, "softmax_xent_cols [%" PRId64 ", %" PRId64 " of %" PRId64 "]%s", n, v, ld,
             alias ? " in place" : "");
    cr_assert(padding_untouched(out, v, all, what) && guards_intact(out, what), "%s", g_why);
    pack_rows(all, n, v, ld, got);
    cr_assert(matches(what, got, d_ref, n * v, 1e-9, 1e-5), "%s", g_why);
    dev_download(&ls, got);
    cr_assert(matches("softmax_xent_cols losses", got, l_ref, n, 1e-5, 1e-5), "%s", g_why);
  }
  /* Backward from the reference's dlogits, placed in the padded rows. */
  for (int64_t r = 0; r < n; r++) tensor_copy_from_host(&dl.t, r * ld, d_ref + r * v, (size_t)v * sizeof(float));
  tensor_ref_gemm(true, false, (int)v, (int)c, (int)n, 1.0f, d_ref, ln, 1.0f, dw);
  tensor_ref_gemm(false, false, (int)n, (int)c, (int)v, 1.0f, d_ref, wte, 0.0f, dx_ref);
  tensor_gemm_cols(true, false, 1.0f, &dl.t, v, &dln.t, c, 1.0f, &gw.t, c);
  tensor_gemm_cols(false, false, 1.0f, &dl.t, v, &dwte.t, c, 0.0f, &gx.t, c);
  float *gwh = hbuf(v * c), *gxh = hbuf(n * c);
  dev_download(&gw, gwh);
  dev_download(&gx, gxh);
  cr_assert(matches("gemm_cols dwte += dlogitsᵀ·x", gwh, dw, v * c, 1e-5, 1e-4) && guards_intact(&gw, "dwte"), "%s",
            g_why);
  cr_assert(matches("gemm_cols dx = dlogits·wte", gxh, dx_ref, n * c, 1e-5, 1e-4) && guards_intact(&gx, "dx"), "%s",
            g_why);
  arena_release(mark);
}

Test(cuda_nn, padded_logits_match_reference_and_leave_the_padding_alone) {
  open_gpu();
  run_padded_head(37, 24, 65, 128);      /* a small vocabulary, padded to 128 */
  run_padded_head(64, 64, 50257, 50304); /* GPT-2's, padded to 50304 */
  run_padded_head(5, 8, 64, 64);         /* no padding */
  close_gpu();
}

/* ==== LayerNorm ============================================================================ */

/* [rows, c]: the transformer shapes' R·T × C, plus one row, a width of 1,
 * a row count past the 1024-chunk cap of the dw/db partials, and a width
 * past the column-tile grid cap (8192 tiles of 32). */
static const int64_t kLnShapes[][2] = {{2 * 96, 768}, {1024, 64}, {381, 48}, {64, 33},     {99, 100},
                                       {3, 12},       {1, 8},     {1, 1},    {300001, 3}, {2, 300007}};
#define NLN ((int)(sizeof kLnShapes / sizeof kLnShapes[0]))

/* Tolerances (x ~ N(3, 2²), so the mean is not small against the spread):
 * mean and the variance are float sums of c terms (lane partials, then the
 * warp's butterfly), relative error ~√(c/32)·1e-7 typical; an error δμ of
 * the mean moves x̂ by δμ·rstd. y = x̂·w + b with |w| <= ~3: atol 3e-5,
 * rtol 1e-5 is ~10x the typical error at c = 768 and covers c = 300007
 * (~100 terms a lane). Rows of few columns can have a spread far below
 * their mean (c = 3: some of 300001 rows have σ ~ 0.01, rstd ~ 100), where
 * the float mean's own rounding (a few ulp of |μ|) is amplified by rstd:
 * such a row is allowed 3e-6·|μ|·rstd more on y (~8 ulp of |μ|, times
 * rstd and |w|), and 1e-6·|μ|·rstd² more on rstd. For well-conditioned
 * rows (|μ|·rstd ~ 1.5) that adds ~5e-6. A one-pass variance
 * (E[x²] − μ²) fails these at x ~ N(3, 2²). */
static void run_layernorm_fwd(int64_t rows, int64_t c) {
  int mark = arena_mark();
  const int64_t n = rows * c;
  float *x = hbuf(n), *w = hbuf(c), *b = hbuf(c), *y = hbuf(n), *mean = hbuf(rows), *rstd = hbuf(rows);
  float *got = hbuf(n), *got_m = hbuf(rows), *got_r = hbuf(rows);
  fill_normal(x, n, 3.0f, 2.0f);
  fill_normal(w, c, 1.0f, 0.5f);
  fill_normal(b, c, 0.0f, 0.5f);
  int64_t sx[2] = {rows, c};
  struct dev dx = dev_from(2, sx, x), dw = dev_from(1, &c, w), db = dev_from(1, &c, b), dy = dev_new(2, sx);
  struct dev dm = dev_new(1, &rows), dr = dev_new(1, &rows);
  tensor_layernorm_fwd(&dx.t, &dw.t, &db.t, &dy.t, &dm.t, &dr.t);
  tensor_ref_layernorm_fwd(x, w, b, y, mean, rstd, rows, c);
  dev_download(&dy, got);
  dev_download(&dm, got_m);
  dev_download(&dr, got_r);
  double *allow_y = hbuf_bytes((size_t)rows * sizeof(double)), *allow_r = hbuf_bytes((size_t)rows * sizeof(double));
  for (int64_t i = 0; i < rows; i++) {
    double cond = fabs((double)mean[i]) * rstd[i]; /* |μ|·rstd: how much the mean's rounding is amplified */
    allow_y[i] = 3e-6 * cond;
    allow_r[i] = 1e-6 * cond * rstd[i];
  }
  char what[96];
  snprintf(what, sizeof what, "layernorm_fwd [%" PRId64 ", %" PRId64 "] y", rows, c);
  cr_assert(matches_rows(what, got, y, n, 3e-5, 1e-5, allow_y, c), "%s", g_why);
  cr_assert(guards_intact(&dy, what), "%s", g_why);
  snprintf(what, sizeof what, "layernorm_fwd [%" PRId64 ", %" PRId64 "] mean", rows, c);
  cr_assert(matches(what, got_m, mean, rows, 1e-5, 1e-5), "%s", g_why);
  cr_assert(guards_intact(&dm, what), "%s", g_why);
  snprintf(what, sizeof what, "layernorm_fwd [%" PRId64 ", %" PRId64 "] rstd", rows, c);
  cr_assert(matches_rows(what, got_r, rstd, rows, 0.0, 2e-5, allow_r, 1), "%s", g_why);
  cr_assert(guards_intact(&dr, what), "%s", g_why);
  arena_release(mark);
}

Test(cuda_nn, layernorm_fwd_matches_reference) {
  open_gpu();
  for (int s = 0; s < NLN; s++) run_layernorm_fwd(kLnShapes[s][0], kLnShapes[s][1]);
  close_gpu();
}

/* Inputs of a LayerNorm backward, on the host and on the device. mean and
 * rstd come from the reference forward, so both sides see the same x̂. */
struct ln_bwd_case {
  int64_t rows, c;
  float *x, *w, *mean, *rstd, *dy, *dx0, *dw0, *db0; /* host */
  struct dev dx_in, dw_in, dm, dr, ddy, ddx, ddw, ddb;
};

static void ln_bwd_case_new(struct ln_bwd_case *k, int64_t rows, int64_t c) {
  const int64_t n = rows * c;
  k->rows = rows;
  k->c = c;
  k->x = hbuf(n);
  k->w = hbuf(c);
  k->mean = hbuf(rows);
  k->rstd = hbuf(rows);
  k->dy = hbuf(n);
  k->dx0 = hbuf(n);
  k->dw0 = hbuf(c);
  k->db0 = hbuf(c);
  float *b = hbuf(c), *y = hbuf(n);
  fill_normal(k->x, n, 3.0f, 2.0f);
  fill_normal(k->w, c, 1.0f, 0.5f);
  fill_normal(b, c, 0.0f, 0.5f);
  tensor_ref_layernorm_fwd(k->x, k->w, b, y, k->mean, k->rstd, rows, c);
  fill_normal(k->dy, n, 0.0f, 1.0f);
  fill_normal(k->dx0, n, 0.0f, 1.0f);
  fill_normal(k->dw0, c, 0.0f, 1.0f);
  fill_normal(k->db0, c, 0.0f, 1.0f);
  int64_t sx[2] = {rows, c};
  k->dx_in = dev_from(2, sx, k->x);
  k->dw_in = dev_from(1, &c, k->w);
  k->dm = dev_from(1, &rows, k->mean);
  k->dr = dev_from(1, &rows, k->rstd);
  k->ddy = dev_from(2, sx, k->dy);
  k->ddx = dev_new(2, sx);
  k->ddw = dev_new(1, &c);
  k->ddb = dev_new(1, &c);
}

/* Runs the device backward from the case's starting dx, dw, db (dw, db left
 * NaN when beta is 0: they must not be read) and downloads the results. */
static void ln_bwd_run(struct ln_bwd_case *k, float beta, float *dx, float *dw, float *db) {
  dev_upload(&k->ddx, k->dx0);
  if (beta != 0.0f) {
    dev_upload(&k->ddw, k->dw0);
    dev_upload(&k->ddb, k->db0);
  } else {
    float *nan = hbuf(k->c);
    fill_value(nan, k->c, NAN);
    dev_upload(&k->ddw, nan);
    dev_upload(&k->ddb, nan);
  }
  tensor_layernorm_bwd(&k->dx_in.t, &k->dw_in.t, &k->dm.t, &k->dr.t, &k->ddy.t, &k->ddx.t, &k->ddw.t, &k->ddb.t,
                       beta);
  dev_download(&k->ddx, dx);
  dev_download(&k->ddw, dw);
  dev_download(&k->ddb, db);
}

/* Tolerances: dx = old + rstd·(g − mean(g) − x̂·mean(g·x̂)), each term ~1
 * with float row means over c: atol 3e-5, rtol 1e-5. dw, db are float sums
 * over `rows` terms of size ~1 (lane sums over a chunk, 32 lanes, then the
 * chunks in order): atol 1e-5 + 5e-8·rows, rtol 1e-5, as bias_grad's. */
Test(cuda_nn, layernorm_bwd_matches_reference_accumulates_dx_and_honours_beta) {
  open_gpu();
  static const float betas[] = {0.0f, 0.5f, 1.0f};
  for (int s = 0; s < NLN; s++) {
    int mark = arena_mark();
    struct ln_bwd_case k;
    ln_bwd_case_new(&k, kLnShapes[s][0], kLnShapes[s][1]);
    const int64_t n = k.rows * k.c;
    float *dx = hbuf(n), *dw = hbuf(k.c), *db = hbuf(k.c);
    float *rdx = hbuf(n), *rdw = hbuf(k.c), *rdb = hbuf(k.c);
    for (int bi = 0; bi < 3; bi++) {
      float beta = betas[bi];
      ln_bwd_run(&k, beta, dx, dw, db);
      memcpy(rdx, k.dx0, (size_t)n * sizeof *rdx);
      memcpy(rdw, k.dw0, (size_t)k.c * sizeof *rdw);
      memcpy(rdb, k.db0, (size_t)k.c * sizeof *rdb);
      tensor_ref_layernorm_bwd(k.x, k.w, k.mean, k.rstd, k.dy, rdx, rdw, rdb, k.rows, k.c, beta);
      char what[112];
      snprintf(what, sizeof what, "layernorm_bwd [%" PRId64 ", %" PRId64 "] beta=%g dx", k.rows, k.c, beta);
      cr_assert(matches(what, dx, rdx, n, 3e-5, 1e-5), "%s", g_why);
      cr_assert(guards_intact(&k.ddx, what), "%s", g_why);
      const double atol = 1e-5 + 5e-8 * (double)k.rows;
      snprintf(what, sizeof what, "layernorm_bwd [%" PRId64 ", %" PRId64 "] beta=%g dw", k.rows, k.c, beta);
      cr_assert(matches(what, dw, rdw, k.c, atol, 1e-5), "%s", g_why);
      cr_assert(guards_intact(&k.ddw, what), "%s", g_why);
      snprintf(what, sizeof what, "layernorm_bwd [%" PRId64 ", %" PRId64 "] beta=%g db", k.rows, k.c, beta);
      cr_assert(matches(what, db, rdb, k.c, atol, 1e-5), "%s", g_why);
      cr_assert(guards_intact(&k.ddb, what), "%s", g_why);
    }
    arena_release(mark);
  }
  close_gpu();
}

Test(cuda_nn, layernorm_bwd_is_bitwise_deterministic) {
  open_gpu();
  struct ln_bwd_case k;
  ln_bwd_case_new(&k, 8192, 768); /* GPT-2 small, R·T = 8·1024 */
  const int64_t n = k.rows * k.c;
  float *dx[2] = {hbuf(n), hbuf(n)}, *dw[2] = {hbuf(k.c), hbuf(k.c)}, *db[2] = {hbuf(k.c), hbuf(k.c)};
  for (int run = 0; run < 2; run++) ln_bwd_run(&k, 1.0f, dx[run], dw[run], db[run]);
  cr_assert(same_bits("layernorm_bwd dx, two runs", dx[0], dx[1], n), "%s", g_why);
  cr_assert(same_bits("layernorm_bwd dw, two runs", dw[0], dw[1], k.c), "%s", g_why);
  cr_assert(same_bits("layernorm_bwd db, two runs", db[0], db[1], k.c), "%s", g_why);
  close_gpu();
}

Test(cuda_nn, empty_batches_write_nothing_and_layernorm_bwd_still_scales_by_beta) {
  open_gpu();
  const int64_t c = 8, v = 5;
  int64_t st[2] = {0, 4}, s3[3] = {0, 4, c}, sqkv[3] = {0, 4, 3 * c}, sl[3] = {0, 2, 4}, swte[2] = {v, c};
  int64_t sx[2] = {0, c}, zero = 0;
  float ones[8] = {1, 1, 1, 1, 1, 1, 1, 1}, half[8], got[8];
  fill_value(half, c, 0.5f);
  struct dev tok = dev_new_dt(TENSOR_I32, 2, st), out = dev_new(3, s3), qkv = dev_new(3, sqkv), lse = dev_new(3, sl);
  struct dev wte = dev_new(2, swte), x = dev_new(2, sx), m = dev_new(1, &zero), dw = dev_from(1, &c, ones),
             db = dev_from(1, &c, ones), w = dev_from(1, &c, ones);
  tensor_embedding_fwd(&tok.t, &wte.t, &wte.t, &out.t);
  tensor_embedding_bwd(&tok.t, &out.t, &wte.t, &wte.t);
  tensor_attention_fwd(&qkv.t, 2, &out.t, &lse.t);
  tensor_attention_bwd(&qkv.t, &out.t, &lse.t, &out.t, 2, &qkv.t);
  tensor_layernorm_fwd(&x.t, &w.t, &w.t, &out.t, &m.t, &m.t);
  tensor_layernorm_bwd(&x.t, &w.t, &m.t, &m.t, &x.t, &out.t, &dw.t, &db.t, 0.5f);
  tensor_backend_sync(g_be);
  cr_assert(guards_intact(&out, "ops on an empty batch"), "%s", g_why);
  cr_assert(guards_intact(&lse, "attention on an empty batch"), "%s", g_why);
  cr_assert(guards_intact(&wte, "embedding on an empty batch"), "%s", g_why);
  dev_download(&dw, got);
  cr_assert(matches_exactly("layernorm_bwd with 0 rows: dw ← 0.5·dw", got, half, c), "%s", g_why);
  dev_download(&db, got);
  cr_assert(matches_exactly("layernorm_bwd with 0 rows: db ← 0.5·db", got, half, c), "%s", g_why);
  close_gpu();
}

/* ==== attention ============================================================================ */

/* Forward then backward on the device (the backward gets the device's own
 * out and lse, as in training) against the reference.
 *
 * Tolerances, for qkv ~ N(0, scale²): scores are float GEMMs over hs
 * terms, their error ~√hs·1e-7·|q||k|; probabilities, lse and out inherit
 * it, and the backward's GEMMs sum over up to T terms. At scale 1 the
 * errors are ~1e-6: out and lse atol 2e-5, rtol 1e-4; dqkv atol 5e-5, rtol
 * 1e-4. Sharper softmaxes (scale 3: scores ~9x larger, near one-hot rows)
 * scale the score error and the gradients by ~scale²: the tolerances are
 * multiplied by scale². Dropping the causal mask, the scale or a
 * transpose gives errors of order 1. */
static void run_attention(const struct xf_shape *s, float scale) {
  const int64_t r = s->r, t = s->t, c = s->c, nq = r * t * 3 * c, no = r * t * c, nl = r * s->nh * t;
  int mark = arena_mark();
  float *qkv = hbuf(nq), *out = hbuf(no), *lse = hbuf(nl), *dout = hbuf(no), *dqkv = hbuf(nq);
  float *got_o = hbuf(no), *got_l = hbuf(nl), *got_d = hbuf(nq);
  fill_normal(qkv, nq, 0.0f, scale);
  fill_normal(dout, no, 0.0f, 1.0f);
  int64_t sq[3] = {r, t, 3 * c}, so[3] = {r, t, c}, sl[3] = {r, s->nh, t};
  struct dev dq = dev_from(3, sq, qkv), dO = dev_new(3, so), dl = dev_new(3, sl);
  struct dev ddo = dev_from(3, so, dout), ddq = dev_new(3, sq);
  tensor_attention_fwd(&dq.t, s->nh, &dO.t, &dl.t);
  tensor_attention_bwd(&dq.t, &dO.t, &dl.t, &ddo.t, s->nh, &ddq.t);
  tensor_ref_attention_fwd(qkv, out, lse, r, t, c, s->nh);
  tensor_ref_attention_bwd(qkv, out, lse, dout, dqkv, r, t, c, s->nh);
  dev_download(&dO, got_o);
  dev_download(&dl, got_l);
  dev_download(&ddq, got_d);

  const double k = (double)scale * scale;
  char what[128], op[64];
  snprintf(op, sizeof op, "attention (qkv scale %g) out", scale);
  shape_name(what, sizeof what, op, s);
  cr_assert(matches(what, got_o, out, no, 2e-5 * k, 1e-4 * k), "%s", g_why);
  cr_assert(guards_intact(&dO, what), "%s", g_why);
  snprintf(op, sizeof op, "attention (qkv scale %g) lse", scale);
  shape_name(what, sizeof what, op, s);
  cr_assert(matches(what, got_l, lse, nl, 2e-5 * k, 1e-4 * k), "%s", g_why);
  cr_assert(guards_intact(&dl, what), "%s", g_why);
  snprintf(op, sizeof op, "attention_bwd (qkv scale %g) dqkv", scale);
  shape_name(what, sizeof what, op, s);
  cr_assert(matches(what, got_d, dqkv, nq, 5e-5 * k, 1e-4 * k), "%s", g_why);
  cr_assert(guards_intact(&ddq, what), "%s", g_why);
  arena_release(mark);
}

Test(cuda_nn, attention_fwd_and_bwd_match_reference) {
  open_gpu();
  for (int i = 0; i < NXF; i++) run_attention(&kXfShapes[i], 1.0f);
  close_gpu();
}

/* GPT-2 small's attention at its full context: T = 1024, 12 heads of 64
 * (C = 768), one sequence (the plain reference takes seconds per
 * sequence; the backend's rounds over several sequences are the test
 * below). */
Test(cuda_nn, attention_at_gpt2_small_t1024_12_heads_of_64_matches_reference) {
  open_gpu();
  const struct xf_shape gpt2 = {1, 1024, 768, 12};
  run_attention(&gpt2, 1.0f);
  close_gpu();
}

Test(cuda_nn, attention_matches_reference_with_sharp_softmax) {
  open_gpu();
  for (int i = 2; i < NXF; i++) run_attention(&kXfShapes[i], 3.0f);
  close_gpu();
}

/* T = 2048: the backend's 2^26-float score buffer holds 16 of the 18
 * (sequence, head) batches, so the work runs in two rounds (16, then 2),
 * and the second round's offsets into q, k, v, lse and dqkv are tested. */
Test(cuda_nn, attention_in_several_rounds_of_score_scratch_matches_reference) {
  open_gpu();
  const struct xf_shape s = {9, 2048, 16, 2};
  run_attention(&s, 1.0f);
  close_gpu();
}
