/*
 * bench_tensor_nn — the CPU backend's transformer ops, forward and
 * backward, at the shapes of the training targets: GPT-2 small (R 4,
 * T 1024, C 768, 12 heads, V 50257) and gpt:L6-H6-C384-T256-V256 (R 8,
 * T 256, C 384, 6 heads), on 1 thread and on every core.
 *
 *   bench_tensor_nn [reps (default 3)] [gpt2|small|all (default all)]
 *
 * Each figure is the best of `reps` timed runs after one warm-up. Columns:
 * milliseconds per call, GFLOP/s from nominal flop counts, and GB/s of the
 * minimal memory traffic (each input read once, each output written once).
 * Nominal flops: causal attention forward 2·R·nh·T²·hs (two GEMMs over the
 * lower triangle), backward 5·R·nh·T²·hs (the score GEMM recomputed, then
 * four); LayerNorm 8 per element forward and 14 backward; GELU 20 forward
 * and 30 backward (exp counted as 12); embedding and add 1 per element. The
 * linear-layer GEMM of the qkv projection is timed as a yardstick of what
 * the machine's sgemm reaches.
 *
 * Not a test: nothing here passes or fails.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tensor/tensor.h"

struct shape {
  const char *name;
  int64_t r, t, c, v;
  int nh;
};

static tensor_backend_t be;

static struct tensor alloc_or_die(int ndim, const int64_t *shape, enum tensor_dtype dt) {
  struct tensor t;
  struct rumor_err e;
  if (tensor_alloc(&t, be, dt, ndim, shape, &e)) {
    fprintf(stderr, "bench_tensor_nn: %s\n", e.msg);
    exit(1);
  }
  return t;
}

/* Random floats in ±scale (the CPU backend's tensor data is host memory). */
static struct tensor rand_tensor(struct rng *r, int ndim, const int64_t *shape, float scale) {
  struct tensor t = alloc_or_die(ndim, shape, TENSOR_F32);
  float *p = t.data;
  for (int64_t i = 0; i < tensor_numel(&t); i++) p[i] = (2.0f * rng_uniform(r) - 1.0f) * scale;
  return t;
}

/* The tensors of one shape: inputs random, outputs written once by the
 * forward ops before the backward ones read them. */
struct bufs {
  struct tensor tok, wte, wpe, x, x2, y, dy, dx, w, b, dw, db, mean, rstd;
  struct tensor qkv, att, lse, dqkv, h, h2, dh, wqkv;
};

static void bufs_init(struct bufs *B, const struct shape *s, struct rng *r) {
  int64_t rt[2] = {s->r, s->t}, rtc[3] = {s->r, s->t, s->c}, rt3[3] = {s->r, s->t, 3 * s->c};
  int64_t rt4[2] = {s->r * s->t, 4 * s->c}, vc[2] = {s->v, s->c}, tc[2] = {s->t, s->c}, c1 = s->c;
  int64_t rows = s->r * s->t, lse[3] = {s->r, s->nh, s->t}, w3[2] = {s->c, 3 * s->c};
  B->tok = alloc_or_die(2, rt, TENSOR_I32);
  for (int64_t i = 0; i < rows; i++) ((int32_t *)B->tok.data)[i] = (int32_t)rng_below(r, (uint64_t)s->v);
  B->wte = rand_tensor(r, 2, vc, 0.1f), B->wpe = rand_tensor(r, 2, tc, 0.1f);
  B->x = rand_tensor(r, 3, rtc, 1), B->x2 = rand_tensor(r, 3, rtc, 1), B->y = rand_tensor(r, 3, rtc, 1);
  B->dy = rand_tensor(r, 3, rtc, 1), B->dx = rand_tensor(r, 3, rtc, 0);
  B->w = rand_tensor(r, 1, &c1, 1), B->b = rand_tensor(r, 1, &c1, 1);
  B->dw = rand_tensor(r, 1, &c1, 0), B->db = rand_tensor(r, 1, &c1, 0);
  B->mean = rand_tensor(r, 1, &rows, 0), B->rstd = rand_tensor(r, 1, &rows, 0);
  B->qkv = rand_tensor(r, 3, rt3, 1), B->att = rand_tensor(r, 3, rtc, 0), B->lse = rand_tensor(r, 3, lse, 0);
  B->dqkv = rand_tensor(r, 3, rt3, 0);
  B->h = rand_tensor(r, 2, rt4, 2), B->h2 = rand_tensor(r, 2, rt4, 0), B->dh = rand_tensor(r, 2, rt4, 1);
  B->wqkv = rand_tensor(r, 2, w3, 0.05f);
}

static void bufs_free(struct bufs *B) {
  struct tensor *all[] = {&B->tok, &B->wte, &B->wpe, &B->x,   &B->x2,   &B->y,    &B->dy,  &B->dx,
                          &B->w,   &B->b,   &B->dw,  &B->db,  &B->mean, &B->rstd, &B->qkv, &B->att,
                          &B->lse, &B->dqkv, &B->h,  &B->h2,  &B->dh,   &B->wqkv};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++) tensor_free(all[i]);
}

enum op {
  OP_EMB_FWD, OP_EMB_BWD, OP_LN_FWD, OP_LN_BWD, OP_ATT_FWD, OP_ATT_BWD,
  OP_GELU_FWD, OP_GELU_BWD, OP_ADD, OP_QKV_GEMM, OP_COUNT
};
static const char *op_names[OP_COUNT] = {"embedding fwd", "embedding bwd", "layernorm fwd", "layernorm bwd",
                                         "attention fwd", "attention bwd", "gelu_tanh fwd", "gelu_tanh bwd",
                                         "add",           "qkv gemm (ref)"};

static void run_op(enum op op, struct bufs *B, int nh) {
  switch (op) {
  case OP_EMB_FWD: tensor_embedding_fwd(&B->tok, &B->wte, &B->wpe, &B->y); break;
  case OP_EMB_BWD: tensor_embedding_bwd(&B->tok, &B->dy, &B->wte, &B->wpe); break; /* accumulates: harmless */
  case OP_LN_FWD: tensor_layernorm_fwd(&B->x, &B->w, &B->b, &B->y, &B->mean, &B->rstd); break;
  case OP_LN_BWD: tensor_layernorm_bwd(&B->x, &B->w, &B->mean, &B->rstd, &B->dy, &B->dx, &B->dw, &B->db, 0); break;
  case OP_ATT_FWD: tensor_attention_fwd(&B->qkv, nh, &B->att, &B->lse); break;
  case OP_ATT_BWD: tensor_attention_bwd(&B->qkv, &B->att, &B->lse, &B->dy, nh, &B->dqkv); break;
  case OP_GELU_FWD: tensor_gelu_tanh_fwd(&B->h, &B->h2); break;
  case OP_GELU_BWD: tensor_gelu_tanh_bwd(&B->h, &B->dh, &B->h2); break;
  case OP_ADD: tensor_add(&B->x, &B->x2, &B->y); break;
  case OP_QKV_GEMM: { /* into dqkv, viewed 2-D: qkv keeps its random contents for attention */
    int64_t a2[2] = {B->x.shape[0] * B->x.shape[1], B->x.shape[2]}, c2[2] = {a2[0], B->wqkv.shape[1]};
    struct tensor a = tensor_view(&B->x, 0, 2, a2), c = tensor_view(&B->dqkv, 0, 2, c2);
    tensor_gemm(false, false, 1.0f, &a, &B->wqkv, 0.0f, &c);
    break;
  }
  default: break;
  }
}

/* Nominal flops and minimal bytes of one call. */
static void op_cost(enum op op, const struct shape *s, double *flops, double *bytes) {
  double n = (double)(s->r * s->t * s->c), hs = (double)(s->c / s->nh);
  double att = (double)s->r * s->nh * (double)s->t * (double)s->t * hs, n4 = 4 * n;
  switch (op) {
  case OP_EMB_FWD: *flops = n, *bytes = 8 * n; break;
  case OP_EMB_BWD: *flops = 2 * n, *bytes = 4 * n + 16 * n; break;
  case OP_LN_FWD: *flops = 8 * n, *bytes = 8 * n; break;
  case OP_LN_BWD: *flops = 14 * n, *bytes = 16 * n; break;
  case OP_ATT_FWD: *flops = 2 * att, *bytes = 4 * (3 * n + n); break;
  case OP_ATT_BWD: *flops = 5 * att, *bytes = 4 * (3 * n + 2 * n + 3 * n); break;
  case OP_GELU_FWD: *flops = 20 * n4, *bytes = 8 * n4; break;
  case OP_GELU_BWD: *flops = 30 * n4, *bytes = 12 * n4; break;
  case OP_ADD: *flops = n, *bytes = 12 * n; break;
  case OP_QKV_GEMM: *flops = 2 * n * 3 * (double)s->c, *bytes = 4 * (n + 3 * n + 3.0 * s->c * s->c); break;
  default: *flops = *bytes = 0;
  }
}

static double time_op(enum op op, struct bufs *B, int nh, int reps) {
  run_op(op, B, nh); /* warm-up: pages, scratch, oneDNN's kernels */
  double best = 1e30;
  for (int i = 0; i < reps; i++) {
    double t0 = clock_now_s();
    run_op(op, B, nh);
    tensor_backend_sync(be);
    double dt = clock_now_s() - t0;
    best = dt < best ? dt : best;
  }
  return best;
}

static void bench_shape(const struct shape *s, int reps, int tmax) {
  struct rng r;
  rng_seed(&r, 1, 0);
  struct bufs B;
  bufs_init(&B, s, &r);
  printf("\n%s: R %lld T %lld C %lld heads %d V %lld\n", s->name, (long long)s->r, (long long)s->t,
         (long long)s->c, s->nh, (long long)s->v);
  printf("%-16s %7s %10s %9s %8s", "op", "threads", "ms", "GFLOP/s", "GB/s");
  printf("\n");
  const int threads[2] = {1, tmax};
  for (int op = 0; op < OP_COUNT; op++) {
    for (int ti = 0; ti < (tmax > 1 ? 2 : 1); ti++) {
      tensor_backend_set_threads(be, threads[ti]);
      double dt = time_op((enum op)op, &B, s->nh, reps), flops, bytes;
      op_cost((enum op)op, s, &flops, &bytes);
      printf("%-16s %7d %10.3f %9.1f %8.1f\n", op_names[op], threads[ti], dt * 1e3, flops / dt * 1e-9,
             bytes / dt * 1e-9);
    }
  }
  bufs_free(&B);
}

int main(int argc, char **argv) {
  int reps = argc > 1 ? atoi(argv[1]) : 3;
  const char *which = argc > 2 ? argv[2] : "all";
  if (reps <= 0 || (strcmp(which, "all") && strcmp(which, "gpt2") && strcmp(which, "small"))) {
    fprintf(stderr, "usage: bench_tensor_nn [reps>0] [gpt2|small|all]\n");
    return 2;
  }
  struct rumor_err e;
  if (tensor_backend_open("cpu", &be, &e)) {
    fprintf(stderr, "bench_tensor_nn: %s\n", e.msg);
    return 1;
  }
  long cores = sysconf(_SC_NPROCESSORS_ONLN);
  int tmax = cores < 1 ? 1 : cores > 256 ? 256 : (int)cores;
  const struct shape gpt2 = {"GPT-2 small", 4, 1024, 768, 50257, 12};
  const struct shape small = {"gpt:L6-H6-C384-T256-V256", 8, 256, 384, 256, 6};
  if (!strcmp(which, "all") || !strcmp(which, "gpt2")) bench_shape(&gpt2, reps, tmax);
  if (!strcmp(which, "all") || !strcmp(which, "small")) bench_shape(&small, reps, tmax);
  tensor_backend_close(be);
  return 0;
}
