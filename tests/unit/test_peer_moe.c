/* Mixture-of-experts GPT blocks (peer/model/gpt_moe.c, issue #32): the
 * spec's E, K, M and F parts and their errors, the table's names (Mixtral's
 * and Switch's: mlp.router, mlp.experts.<e>.*), config.json's fields, the
 * whole model's gradient (router, experts, every other parameter, with the
 * load-balancing and z-losses) by finite differences, and determinism.
 * CPU backend. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/model/model.h"
#include "util/json_text.h"

#define ROWS 3

static tensor_backend_t be;

static void setup(void) {
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
}
static void teardown(void) { tensor_backend_close(be); }
TestSuite(moe, .init = setup, .fini = teardown);

static struct model_spec parse(const char *s) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &spec, &e), 0, "%s: %s", s, e.msg);
  return spec;
}

Test(moe, specs_parse_format_canonically_and_bad_ones_are_named) {
  char buf[MODEL_SPEC_MAX];
  struct model_spec a = parse("gpt:K2-E8-L4-H2-C8-T5-V11");
  model_spec_format(&a, buf, sizeof buf);
  cr_assert_str_eq(buf, "gpt:L4-H2-C8-T5-V11-E8-K2");
  struct model_spec b = parse("gpt:L4-H2-C8-T5-V11-E8-M2-F100");
  model_spec_format(&b, buf, sizeof buf);
  cr_assert_str_eq(buf, "gpt:L4-H2-C8-T5-V11-E8-K1-M2-F100");
  struct model_spec d = parse("gpt:L4-H2-C8-T5-V11");
  cr_assert_eq(d.u.gpt.experts, 0);
  const struct {
    const char *spec, *says;
  } bad[] = {
      {"gpt:L4-H2-C8-T5-V11-K2", "K is for a mixture of experts: give E too"},
      {"gpt:L4-H2-C8-T5-V11-E4-K5", "K5: the experts each token goes to must be in [1, 4]"},
      {"gpt:L4-H2-C8-T5-V11-E65", "E65: the number of experts"},
      {"gpt:L4-H2-C8-T5-V11-E4-M5", "M5: the blocks between mixture-of-experts blocks"},
      {"gpt:L4-H2-C8-T5-V11-E4-F0", "F0: the capacity factor in percent"},
  };
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    struct model_spec s;
    struct rumor_err e = {0};
    cr_assert_eq(model_spec_parse(bad[i].spec, &s, &e), RUMOR_EFORMAT, "%s accepted", bad[i].spec);
    cr_assert(strstr(e.msg, bad[i].spec) && strstr(e.msg, bad[i].says), "%s: %s", bad[i].spec, e.msg);
  }
}

Test(moe, the_table_names_the_router_and_every_expert_and_config_json_round_trips) {
  struct model_spec s = parse("gpt:L2-H2-C8-T5-V11-E3-K2-M2");
  struct model_table t;
  model_table_build(&s, &t);
  /* Block 0 dense (12 entries), block 1: 8 + the router + 3 experts × 4. */
  cr_assert_eq(t.n, 2 + 12 + 8 + 1 + 12 + 2);
  cr_assert_str_eq(t.p[2 + 12 + 8].name, "transformer.h.1.mlp.router.weight");
  cr_assert_eq(t.p[2 + 12 + 8].shape[0], 8);
  cr_assert_eq(t.p[2 + 12 + 8].shape[1], 3);
  cr_assert_str_eq(t.p[2 + 12 + 9].name, "transformer.h.1.mlp.experts.0.c_fc.weight");
  cr_assert_str_eq(t.p[2 + 12 + 8 + 12].name, "transformer.h.1.mlp.experts.2.c_proj.bias");
  cr_assert_str_eq(t.p[t.n - 1].name, "transformer.ln_f.bias");
  model_table_free(&t);
  json_t *cfg = model_hf_config(&s);
  char *text = json_dumps(cfg, JSON_COMPACT);
  struct model_spec back;
  struct rumor_err e = {0};
  cr_assert_eq(model_spec_from_hf_config(text, strlen(text), "config.json", &back, &e), 0, "%s", e.msg);
  cr_assert(model_spec_equal(&s, &back));
  free(text);
  json_decref(cfg);
}

/* ---- the gradient ---- */

static void random_batch(const struct model *m, uint64_t seed, int32_t *x, int32_t *y) {
  struct rng r;
  rng_seed(&r, seed, 7);
  int64_t n = ROWS * m->io.input_per_row;
  for (int64_t i = 0; i < n; i++) x[i] = (int32_t)rng_below(&r, (uint64_t)m->io.classes);
  for (int64_t i = 0; i < n; i++) y[i] = (int32_t)rng_below(&r, (uint64_t)m->io.classes);
}

/* The whole loss (the mean cross-entropy plus the auxiliary losses of this
 * one pass) at the model's parameters, and each expert's load. */
static double loss_of(struct model *m, const int32_t *x, const int32_t *y, int64_t *load) {
  int64_t n = ROWS * m->io.input_per_row;
  tensor_copy_from_host(model_act(m, 0), 0, x, (size_t)n * sizeof(int32_t));
  tensor_copy_from_host(&m->labels, 0, y, (size_t)n * sizeof(int32_t));
  int L = m->table.nunits;
  model_moe_stats_reset(m);
  model_forward(m, 0, L, ROWS);
  model_loss(m, ROWS, model_act(m, L), 1.0f / (float)n);
  memcpy(load, m->moe_stats.load, sizeof m->moe_stats.load);
  return model_mean_loss(m, ROWS) + m->moe_stats.aux_loss + m->moe_stats.z_loss;
}

/* Every parameter by central differences (h = 1e-2, float32), as
 * test_peer_gpt's check, with the auxiliary losses weighted up (so that
 * their gradients are seen). Routing is piecewise constant: a step that
 * moves a choice from one expert to another (seen as a change in the
 * experts' loads) crosses a kink, and that parameter is left out; at most
 * 5 % may be. `spec`'s capacity drops nothing (F400), so no token sits on
 * a capacity boundary. */
static void gradient_matches(const char *spec) {
  struct model m;
  struct model_spec s = parse(spec);
  struct rumor_err e;
  cr_assert_eq(model_init(&m, &s, 0, s.u.gpt.layers + 2, be, ROWS, &e), 0, "%s", e.msg);
  model_init_params(&m, 3);
  model_set_moe_losses(&m, 0.5, 0.05);
  int64_t P = m.nparams;
  float *p = xmalloc((size_t)P * sizeof(float)), *g = xmalloc((size_t)P * sizeof(float));
  struct rng r;
  rng_seed(&r, 5, 1);
  tensor_copy_to_host(&m.params, 0, p, (size_t)P * sizeof(float));
  for (int64_t i = 0; i < P; i++) p[i] += 0.3f * rng_normal(&r);
  tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
  int32_t x[ROWS * 5], y[ROWS * 5];
  random_batch(&m, 11, x, y);
  int64_t load0[GPT_MAX_EXPERTS], lu[GPT_MAX_EXPERTS], ld[GPT_MAX_EXPERTS];
  (void)loss_of(&m, x, y, load0);
  int L = m.table.nunits;
  model_backward(&m, 0, L, ROWS, model_act(&m, L), NULL, false);
  tensor_copy_to_host(&m.grads, 0, g, (size_t)P * sizeof(float));
  const float h = 1e-2f;
  int worst = -1, skipped = 0;
  double worst_err = 0, worst_num = 0, worst_ana = 0;
  for (int64_t i = 0; i < P; i++) {
    float keep = p[i];
    p[i] = keep + h;
    tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
    double up = loss_of(&m, x, y, lu);
    p[i] = keep - h;
    tensor_copy_from_host(&m.params, 0, p, (size_t)P * sizeof(float));
    double down = loss_of(&m, x, y, ld);
    p[i] = keep;
    if (memcmp(lu, load0, sizeof lu) != 0 || memcmp(ld, load0, sizeof ld) != 0) {
      skipped++;
      continue;
    }
    double num = (up - down) / (2.0 * h), err = fabs(num - g[i]) / (2e-4 + 2e-2 * fabs(num));
    if (err > worst_err) worst_err = err, worst = (int)i, worst_num = num, worst_ana = g[i];
  }
  const char *name = "?";
  for (size_t k = 0; k < m.table.n; k++)
    if (worst >= m.table.p[k].offset && worst < m.table.p[k].offset + m.table.p[k].numel) name = m.table.p[k].name;
  cr_assert(worst_err <= 1.0, "%s: parameter %d (%s): analytic %.6g vs numeric %.6g (%.3g of the tolerance)", spec,
            worst, name, worst_ana, worst_num, worst_err);
  cr_assert_leq(skipped, P / 20, "%s: %d of %lld parameters moved a token to another expert", spec, skipped,
                (long long)P);
  fprintf(stderr, "moe gradient check %s: worst %.3g of the tolerance at %s, %d of %lld left out (routing kinks)\n",
          spec, worst_err, name, skipped, (long long)P);
  free(p);
  free(g);
  model_free(&m);
}

Test(moe, top1_every_block_gradient_matches_finite_differences) { gradient_matches("gpt:L2-H2-C8-T5-V11-E4-F400"); }

Test(moe, top2_every_other_block_gradient_matches_finite_differences) {
  gradient_matches("gpt:L2-H2-C8-T5-V11-E3-K2-M2-F400");
}

/* Dropped choices: at capacity factor 0.25 most choices are dropped; the
 * forward and backward still run, the drops are counted, and the same
 * seed gives the same bits twice. */
Test(moe, drops_are_counted_and_the_same_seed_gives_the_same_bits) {
  struct model_spec s = parse("gpt:L2-H2-C8-T5-V11-E4-K2-F25");
  float *out[2];
  int64_t dropped[2];
  for (int run = 0; run < 2; run++) {
    struct model m;
    struct rumor_err e;
    cr_assert_eq(model_init(&m, &s, 0, 4, be, ROWS, &e), 0, "%s", e.msg);
    model_init_params(&m, 9);
    int32_t x[ROWS * 5], y[ROWS * 5];
    random_batch(&m, 4, x, y);
    int64_t load[GPT_MAX_EXPERTS];
    double loss = loss_of(&m, x, y, load);
    cr_assert(isfinite(loss));
    model_backward(&m, 0, 4, ROWS, model_act(&m, 4), NULL, false);
    dropped[run] = m.moe_stats.dropped;
    cr_assert_eq(m.moe_stats.choices, 2 * ROWS * 5 * 2, "choices: %lld", (long long)m.moe_stats.choices);
    out[run] = xmalloc((size_t)m.nparams * sizeof(float));
    tensor_copy_to_host(&m.grads, 0, out[run], (size_t)m.nparams * sizeof(float));
    if (run == 1) cr_assert_eq(memcmp(out[0], out[1], (size_t)m.nparams * sizeof(float)), 0);
    model_free(&m);
  }
  /* 15 tokens, 2 choices each, 4 experts of ceil(0.25 · 15 · 2 / 4) = 2 rows: at most 8 of 30 kept per block. */
  cr_assert_geq(dropped[0], 2 * (30 - 8), "dropped %lld", (long long)dropped[0]);
  cr_assert_eq(dropped[0], dropped[1]);
  free(out[0]);
  free(out[1]);
}

/* --init-from a dense GPT-2 directory upcycles: each expert of a
 * mixture-of-experts block is a copy of that block's dense MLP, the router
 * is drawn afresh, every other entry is the dense one's. */
Test(moe, upcycling_copies_the_dense_mlp_into_every_expert) {
  struct model_spec dense = parse("gpt:L2-H2-C8-T5-V11"), moe = parse("gpt:L2-H2-C8-T5-V11-E3-K2-M2");
  int64_t Pd = model_spec_param_count(&dense), Pm = model_spec_param_count(&moe);
  float *d = xmalloc((size_t)Pd * sizeof(float)), *m = xmalloc((size_t)Pm * sizeof(float));
  for (int64_t i = 0; i < Pd; i++) d[i] = (float)i;
  struct rumor_err e = {0};
  cr_assert_eq(model_upcycle(&dense, d, &moe, 7, m, &e), 0, "%s", e.msg);
  struct model_table td, tm;
  model_table_build(&dense, &td);
  model_table_build(&moe, &tm);
  const struct model_param *fc = model_table_find(&td, "transformer.h.1.mlp.c_fc.weight");
  for (int x = 0; x < 3; x++) {
    char name[MODEL_NAME_MAX];
    snprintf(name, sizeof name, "transformer.h.1.mlp.experts.%d.c_fc.weight", x);
    const struct model_param *ex = model_table_find(&tm, name);
    cr_assert_not_null(ex);
    cr_assert_eq(memcmp(m + ex->offset, d + fc->offset, (size_t)fc->numel * sizeof(float)), 0, "%s", name);
  }
  const struct model_param *router = model_table_find(&tm, "transformer.h.1.mlp.router.weight");
  double sq = 0;
  for (int64_t k = 0; k < router->numel; k++) sq += (double)m[router->offset + k] * m[router->offset + k];
  cr_assert(sq > 0 && sq < router->numel * 0.01, "the router is drawn from N(0, 0.02): Σx² = %g", sq);
  const struct model_param *ln = model_table_find(&tm, "transformer.ln_f.weight"),
                           *lnd = model_table_find(&td, "transformer.ln_f.weight");
  cr_assert_eq(memcmp(m + ln->offset, d + lnd->offset, (size_t)ln->numel * sizeof(float)), 0);
  struct model_spec other = parse("gpt:L2-H2-C16-T5-V11-E3");
  cr_assert_eq(model_upcycle(&dense, d, &other, 7, m, &e), RUMOR_ESHAPE);
  cr_assert(strstr(e.msg, "cannot be upcycled"), "%s", e.msg);
  model_table_free(&td);
  model_table_free(&tm);
  free(d);
  free(m);
}

/* A pipeline stage holding a mixture-of-experts block without the loss
 * scales its auxiliary losses' gradients as the stage with the loss does
 * (model_set_loss_scale, as pipeline.c sets it): two stages give the whole
 * model's gradient, router included. */
Test(moe, a_stage_without_the_loss_scales_its_auxiliary_gradients_alike) {
  const char *spec = "gpt:L2-H2-C8-T5-V11-E3-K2";
  struct model_spec s = parse(spec);
  struct model w, a, b;
  struct rumor_err e;
  cr_assert_eq(model_init(&w, &s, 0, 4, be, ROWS, &e), 0, "%s", e.msg);
  cr_assert_eq(model_init(&a, &s, 0, 2, be, ROWS, &e), 0, "%s", e.msg);
  cr_assert_eq(model_init(&b, &s, 2, 4, be, ROWS, &e), 0, "%s", e.msg);
  struct model *all[3] = {&w, &a, &b};
  for (int i = 0; i < 3; i++) {
    model_init_params(all[i], 4);
    model_set_moe_losses(all[i], 0.5, 0.05); /* weighted up, so that a missing scale shows */
  }
  struct tensor *copy, *dcopy;
  const struct model_param *tied = model_tied(&b, &copy, &dcopy);
  int64_t wte = tied->numel, P = w.nparams, n = ROWS * 5;
  float *buf = xmalloc((size_t)P * sizeof(float));
  tensor_copy_to_host(&w.params, 0, buf, (size_t)P * sizeof(float));
  tensor_copy_from_host(copy, 0, buf + tied->offset, (size_t)wte * sizeof(float));
  int32_t x[ROWS * 5], y[ROWS * 5];
  random_batch(&w, 2, x, y);
  int64_t load[GPT_MAX_EXPERTS];
  (void)loss_of(&w, x, y, load);
  model_backward(&w, 0, 4, ROWS, model_act(&w, 4), NULL, false);

  tensor_copy_from_host(model_act(&a, 0), 0, x, (size_t)n * sizeof(int32_t));
  model_forward(&a, 0, 2, ROWS);
  tensor_copy(model_act(&b, 2), model_act(&a, 2));
  tensor_copy_from_host(&b.labels, 0, y, (size_t)n * sizeof(int32_t));
  model_forward(&b, 2, 4, ROWS);
  model_loss(&b, ROWS, model_act(&b, 4), 1.0f / (float)n);
  struct tensor din;
  int64_t ds[2] = {ROWS, 5 * 8};
  cr_assert_eq(tensor_alloc(&din, be, TENSOR_F32, 2, ds, &e), 0);
  model_backward(&b, 2, 4, ROWS, model_act(&b, 4), &din, false);
  model_set_loss_scale(&a, 1.0f / (float)n);
  model_backward(&a, 0, 2, ROWS, &din, NULL, false);

  float *gw = xmalloc((size_t)P * sizeof(float)), *gs = xmalloc((size_t)P * sizeof(float));
  float *gc = xmalloc((size_t)wte * sizeof(float));
  tensor_copy_to_host(&w.grads, 0, gw, (size_t)P * sizeof(float));
  tensor_copy_to_host(&a.grads, 0, gs, (size_t)a.nparams * sizeof(float));
  tensor_copy_to_host(&b.grads, 0, gs + a.nparams, (size_t)b.nparams * sizeof(float));
  tensor_copy_to_host(dcopy, 0, gc, (size_t)wte * sizeof(float));
  for (int64_t i = 0; i < wte; i++) gs[tied->offset + i] += gc[i];
  for (int64_t i = 0; i < P; i++)
    cr_assert(fabsf(gs[i] - gw[i]) <= 1e-6f + 1e-4f * fabsf(gw[i]), "gradient %lld: split %g vs whole %g",
              (long long)i, gs[i], gw[i]);
  tensor_free(&din);
  free(buf);
  free(gw);
  free(gs);
  free(gc);
  for (int i = 0; i < 3; i++) model_free(all[i]);
}
