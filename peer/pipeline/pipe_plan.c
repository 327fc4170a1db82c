/* Stage split and micro-batch schedules (pure functions). */
#include "peer/pipeline/pipe_plan.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int64_t layer_params(const struct model_spec *s, int l) { return s->widths[l + 1] * s->widths[l] + s->widths[l + 1]; }

/* Multiply-adds of one training sample through layer l: forward, weight
 * gradient and input gradient, except that the first layer's input needs
 * no gradient. */
static int64_t layer_train_macs(const struct model_spec *s, int l) {
  return (l == 0 ? 2 : 3) * model_spec_flops(s, l, l + 1);
}

static int64_t train_macs(const struct model_spec *s, int l0, int l1) {
  int64_t m = 0;
  for (int l = l0; l < l1; l++) m += layer_train_macs(s, l);
  return m;
}

int pipe_split_balance(const struct model_spec *spec, int stages, struct pipe_split *out, struct rumor_err *e) {
  int L = spec->nlayers;
  char name[MODEL_SPEC_MAX];
  model_spec_format(spec, name, sizeof name);
  if (stages < 1 || stages > L)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "%d stages cannot split %s: it has %d layer%s and each stage needs at least one", stages, name,
                         L, L == 1 ? "" : "s");
  /* cost[l]: layer l's share of the parameters plus its share of the
   * training multiply-adds. pre[j] = cost of layers [0, j). */
  double P = (double)model_spec_param_count(spec), F = (double)train_macs(spec, 0, L);
  double pre[MODEL_MAX_LAYERS + 1];
  pre[0] = 0;
  for (int l = 0; l < L; l++)
    pre[l + 1] = pre[l] + (double)layer_params(spec, l) / P + (double)layer_train_macs(spec, l) / F;
  /* best[k][j]: the smallest possible largest-stage cost when k stages take
   * layers [0, j); cut[k][j]: where the k-th stage starts in that optimum. */
  double best[PIPE_MAX_STAGES + 1][MODEL_MAX_LAYERS + 1];
  int cut[PIPE_MAX_STAGES + 1][MODEL_MAX_LAYERS + 1];
  for (int j = 1; j <= L; j++) best[1][j] = pre[j], cut[1][j] = 0;
  for (int k = 2; k <= stages; k++)
    for (int j = k; j <= L; j++) {
      best[k][j] = -1;
      for (int i = k - 1; i < j; i++) { /* stage k takes layers [i, j) */
        double c = pre[j] - pre[i];
        double m = best[k - 1][i] > c ? best[k - 1][i] : c;
        if (best[k][j] < 0 || m < best[k][j]) best[k][j] = m, cut[k][j] = i;
      }
    }
  memset(out, 0, sizeof *out);
  out->stages = stages;
  out->first[stages] = L;
  for (int k = stages, j = L; k >= 1; k--) {
    out->first[k - 1] = cut[k][j];
    j = cut[k][j];
  }
  RUMOR_ASSERT(out->first[0] == 0);
  return 0;
}

int64_t pipe_split_params(const struct model_spec *spec, const struct pipe_split *sp, int s) {
  return model_spec_layer_offset(spec, sp->first[s + 1]) - model_spec_layer_offset(spec, sp->first[s]);
}

int64_t pipe_split_flops(const struct model_spec *spec, const struct pipe_split *sp, int s) {
  return train_macs(spec, sp->first[s], sp->first[s + 1]);
}

/* "layer 3" or "layers 0-2" (inclusive). */
static void layer_range(int a, int b, char *buf, size_t n) {
  if (b - a == 1) snprintf(buf, n, "layer %d", a);
  else snprintf(buf, n, "layers %d-%d", a, b - 1);
}

void pipe_split_describe(const struct model_spec *spec, const struct pipe_split *sp, int s, char *buf, size_t n) {
  int a = sp->first[s], b = sp->first[s + 1];
  char widths[MODEL_SPEC_MAX], range[32];
  size_t w = 0;
  widths[0] = '\0';
  for (int i = a; i <= b && w < sizeof widths; i++)
    w += (size_t)snprintf(widths + w, sizeof widths - w, i > a ? "-%lld" : "%lld", (long long)spec->widths[i]);
  layer_range(a, b, range, sizeof range);
  int64_t p = pipe_split_params(spec, sp, s), f = pipe_split_flops(spec, sp, s);
  double P = (double)model_spec_param_count(spec), F = (double)train_macs(spec, 0, spec->nlayers);
  snprintf(buf, n, "stage %d/%d: %s (%s), %lld parameters (%.1f%%), %lld training multiply-adds per sample (%.1f%%)", s,
           sp->stages, range, widths, (long long)p, 100.0 * (double)p / P, (long long)f, 100.0 * (double)f / F);
}

void pipe_split_format(const struct pipe_split *sp, char *buf, size_t n) {
  size_t w = 0;
  buf[0] = '\0';
  for (int s = 0; s <= sp->stages && w < n; s++) w += (size_t)snprintf(buf + w, n - w, s ? ",%d" : "%d", sp->first[s]);
}

int pipe_schedule_parse(const char *s, enum pipe_schedule *out) {
  if (strcmp(s, "gpipe") == 0) *out = PIPE_GPIPE;
  else if (strcmp(s, "1f1b") == 0) *out = PIPE_1F1B;
  else return RUMOR_EFORMAT;
  return 0;
}

const char *pipe_schedule_name(enum pipe_schedule s) { return s == PIPE_1F1B ? "1f1b" : "gpipe"; }

void pipe_schedule_actions(enum pipe_schedule sched, int stages, int stage, int micro, struct pipe_action *out) {
  RUMOR_ASSERT(stages >= 1 && 0 <= stage && stage < stages && micro >= 1);
  int n = 0;
  if (sched == PIPE_GPIPE) {
    for (int i = 0; i < micro; i++) out[n++] = (struct pipe_action){PIPE_F, i};
    for (int i = micro - 1; i >= 0; i--) out[n++] = (struct pipe_action){PIPE_B, i};
  } else {
    int warm = stages - stage - 1 < micro ? stages - stage - 1 : micro;
    int f = 0, b = 0;
    while (f < warm) out[n++] = (struct pipe_action){PIPE_F, f++};
    while (f < micro) {
      out[n++] = (struct pipe_action){PIPE_F, f++};
      out[n++] = (struct pipe_action){PIPE_B, b++};
    }
    while (b < micro) out[n++] = (struct pipe_action){PIPE_B, b++};
  }
  RUMOR_ASSERT(n == 2 * micro);
}

int pipe_schedule_peak_stash(enum pipe_schedule sched, int stages, int stage, int micro) {
  if (sched == PIPE_GPIPE) return micro;
  return stages - stage < micro ? stages - stage : micro;
}

double pipe_bubble_theory(int stages, int micro) { return (double)(stages - 1) / (double)(micro + stages - 1); }

double pipe_schedule_simulate(enum pipe_schedule sched, int stages, int micro, double f, double b, double *idle) {
  int S = stages, M = micro;
  struct pipe_action *acts = xmalloc((size_t)(S * 2 * M) * sizeof *acts);
  /* done[op][s][i]: finish time of op on stage s for micro-batch i, or −1. */
  double *done = xmalloc((size_t)(2 * S * M) * sizeof(double));
  int *next = xcalloc((size_t)S, sizeof(int));
  double *free_at = xcalloc((size_t)S, sizeof(double)), *busy = xcalloc((size_t)S, sizeof(double));
  for (int i = 0; i < 2 * S * M; i++) done[i] = -1;
#define DONE(op, s, i) done[((op) * S + (s)) * M + (i)]
  for (int s = 0; s < S; s++) pipe_schedule_actions(sched, S, s, M, acts + s * 2 * M);
  int remaining = S * 2 * M;
  double span = 0;
  while (remaining > 0) {
    bool progressed = false;
    for (int s = 0; s < S; s++) {
      while (next[s] < 2 * M) {
        struct pipe_action a = acts[s * 2 * M + next[s]];
        double dep;
        if (a.op == PIPE_F) dep = s == 0 ? 0 : DONE(PIPE_F, s - 1, a.mb);
        else dep = s == S - 1 ? DONE(PIPE_F, s, a.mb) : DONE(PIPE_B, s + 1, a.mb);
        if (dep < 0) break;
        double start = free_at[s] > dep ? free_at[s] : dep;
        double t = a.op == PIPE_F ? f : b;
        free_at[s] = start + t;
        busy[s] += t;
        DONE(a.op, s, a.mb) = free_at[s];
        if (free_at[s] > span) span = free_at[s];
        next[s]++;
        remaining--;
        progressed = true;
      }
    }
    if (!progressed) {
      span = -1;
      break;
    }
  }
#undef DONE
  if (idle)
    for (int s = 0; s < S; s++) idle[s] = span > 0 ? (span - busy[s]) / span : 0;
  free(acts);
  free(done);
  free(next);
  free(free_at);
  free(busy);
  return span;
}
