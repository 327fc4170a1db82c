/* The model interface: the MLP's parameter table (names, shapes, offsets
 * without gaps, decay on weights only, one unit per layer), what the spec
 * says of the model's input, output and boundaries, a stage model holding
 * exactly its units' slice of the flat buffer, and the optimiser's decay
 * mask: weight decay moves the weights and leaves the biases alone. */
#include <criterion/criterion.h>
#include <math.h>
#include <string.h>

#include "peer/model/model.h"

static struct model_spec spec_of(const char *s) {
  struct model_spec sp;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse(s, &sp, &e), 0, "%s", e.msg);
  return sp;
}

Test(model, the_mlp_table_names_every_layer_like_torch_nn_linear) {
  struct model_spec s = spec_of("mlp:784-512-256-10");
  struct model_table t;
  model_table_build(&s, &t);
  cr_assert_eq(t.n, 6);
  cr_assert_eq(t.nunits, 3);
  const char *names[] = {"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias", "layers.2.weight",
                         "layers.2.bias"};
  const int64_t shapes[][2] = {{512, 784}, {512, 0}, {256, 512}, {256, 0}, {10, 256}, {10, 0}};
  int64_t off = 0;
  for (size_t i = 0; i < t.n; i++) {
    const struct model_param *p = &t.p[i];
    cr_assert_str_eq(p->name, names[i]);
    bool weight = i % 2 == 0;
    cr_assert_eq(p->ndim, weight ? 2 : 1, "%s", p->name);
    cr_assert_eq(p->shape[0], shapes[i][0], "%s", p->name);
    if (weight) cr_assert_eq(p->shape[1], shapes[i][1], "%s", p->name);
    cr_assert_eq(p->numel, weight ? shapes[i][0] * shapes[i][1] : shapes[i][0], "%s", p->name);
    cr_assert_eq(p->offset, off, "%s starts at %lld, want %lld (no gaps)", p->name, (long long)p->offset,
                 (long long)off);
    cr_assert_eq(p->decay, weight, "%s: weight decay on matrices only", p->name);
    cr_assert_eq(p->unit, (int)(i / 2), "%s", p->name);
    off += p->numel;
  }
  cr_assert_eq(t.nparams, off);
  cr_assert_eq(t.nparams, 784 * 512 + 512 + 512 * 256 + 256 + 256 * 10 + 10);
  for (int u = 0; u < 3; u++) cr_assert_eq(t.unit_offset[u], t.p[2 * u].offset, "unit %d", u);
  cr_assert_eq(t.unit_offset[3], t.nparams);
  cr_assert_not_null(model_table_find(&t, "layers.1.bias"));
  cr_assert_null(model_table_find(&t, "layers.3.weight"));
  model_table_free(&t);
}

Test(model, the_spec_says_what_goes_in_and_out_and_between_units) {
  struct model_spec s = spec_of("mlp:20-16-12-8:gelu");
  struct model_io io;
  model_spec_io(&s, &io);
  cr_assert_eq(io.input_dtype, TENSOR_F32);
  cr_assert_eq(io.input_per_row, 20);
  cr_assert_eq(io.labels_per_row, 1);
  cr_assert_eq(io.classes, 8);
  cr_assert_eq(model_spec_units(&s), 3);
  cr_assert_str_eq(model_spec_unit_noun(&s), "layer");
  cr_assert_eq(model_spec_boundary(&s, 1), 16);
  cr_assert_eq(model_spec_boundary(&s, 2), 12);
  cr_assert_eq(model_spec_unit_macs(&s, 0), 2 * 20 * 16, "the first layer needs no input gradient");
  cr_assert_eq(model_spec_unit_macs(&s, 1), 3 * 16 * 12);
  char buf[64];
  model_spec_describe_units(&s, 1, 3, buf, sizeof buf);
  cr_assert_str_eq(buf, "16-12-8");
  struct model_spec same = spec_of("mlp:20-16-12-8:gelu"), other = spec_of("mlp:20-16-12-8");
  cr_assert(model_spec_equal(&s, &same));
  cr_assert(!model_spec_equal(&s, &other), "the activation is part of the architecture");
}

Test(model, a_stage_model_holds_exactly_its_units_slice) {
  tensor_backend_t be;
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  struct model_spec s = spec_of("mlp:20-16-12-8");
  struct model m;
  cr_assert_eq(model_init(&m, &s, 1, 3, be, 4, &e), 0, "%s", e.msg);
  cr_assert_eq(m.param_base, 20 * 16 + 16, "the stage starts after layer 0");
  cr_assert_eq(m.nparams, 16 * 12 + 12 + 12 * 8 + 8);
  cr_assert_eq(model_act_width(&m, 1), 16);
  cr_assert_eq(model_act_width(&m, 3), 8, "the last unit's output is the logits");
  cr_assert_eq(m.nstash, 3, "an MLP stage keeps its layers' inputs and its output per micro-batch");
  model_free(&m);
  tensor_backend_close(be);
}

Test(model, weight_decay_moves_weights_and_leaves_biases_alone) {
  tensor_backend_t be;
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  struct model_spec s = spec_of("mlp:6-5-3");
  for (int kind = 0; kind < 2; kind++) {
    struct model m;
    struct optim o;
    struct optim_config oc;
    optim_config_default(&oc);
    oc.kind = kind ? OPTIM_ADAMW : OPTIM_SGD;
    oc.momentum = 0;
    oc.weight_decay = 0.5;
    cr_assert_eq(model_init_full(&m, &s, be, 2, &e), 0, "%s", e.msg);
    cr_assert_eq(optim_init(&o, &oc, &m, &e), 0, "%s", e.msg);
    cr_assert_eq(o.nspans, 4, "weights and biases alternate: 4 runs, got %zu", o.nspans);
    tensor_fill(&m.params, 1.0f);
    tensor_fill(&m.grads, 0.0f); /* only the decay moves anything */
    optim_apply(&o, &m.params, &m.grads, 0.1);
    float p[6 * 5 + 5 + 5 * 3 + 3];
    tensor_copy_to_host(&m.params, 0, p, sizeof p);
    /* SGD: p − lr·wd·p = 0.95; AdamW: p·(1 − lr·wd) = 0.95, and a zero
     * gradient moves nothing else. */
    for (size_t i = 0; i < m.table.n; i++) {
      const struct model_param *mp = &m.table.p[i];
      float want = mp->decay ? 0.95f : 1.0f;
      for (int64_t j = 0; j < mp->numel; j++)
        cr_assert(fabsf(p[mp->offset + j] - want) < 1e-6f, "%s %s[%lld] = %.7g, want %.7g",
                  kind ? "adamw" : "sgd", mp->name, (long long)j, p[mp->offset + j], want);
    }
    optim_free(&o);
    model_free(&m);
  }
  tensor_backend_close(be);
}
