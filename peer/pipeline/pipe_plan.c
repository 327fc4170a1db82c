/* Stage split and micro-batch schedules (pure functions). */
#include "peer/pipeline/pipeline.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The costs the split balances: each unit's parameters and training
 * multiply-adds, and their totals. */
struct unit_costs {
  int n;
  int64_t params[MODEL_MAX_UNITS], macs[MODEL_MAX_UNITS];
  double P, F;
};

static void unit_costs(const struct model_spec *spec, struct unit_costs *c) {
  struct model_table t;
  model_table_build(spec, &t);
  c->n = t.nunits;
  c->P = c->F = 0;
  for (int u = 0; u < c->n; u++) {
    c->params[u] = t.unit_offset[u + 1] - t.unit_offset[u];
    c->macs[u] = model_spec_unit_macs(spec, u);
    c->P += (double)c->params[u];
    c->F += (double)c->macs[u];
  }
  if (c->P <= 0) c->P = 1;
  if (c->F <= 0) c->F = 1;
  model_table_free(&t);
}

int pipe_split_balance(const struct model_spec *spec, int stages, struct pipe_split *out, struct rumor_err *e) {
  struct unit_costs *c = xmalloc(sizeof *c);
  unit_costs(spec, c);
  int L = c->n;
  if (stages < 1 || stages > L || stages > PIPE_MAX_STAGES) {
    char name[MODEL_SPEC_MAX];
    model_spec_format(spec, name, sizeof name);
    const char *noun = model_spec_unit_noun(spec);
    free(c);
    if (stages > PIPE_MAX_STAGES)
      return rumor_err_set(e, RUMOR_EFORMAT, "%d stages are more than the %d a group may have", stages, PIPE_MAX_STAGES);
    return rumor_err_set(e, RUMOR_EFORMAT, "%d stages cannot split %s: it has %d %s%s and each stage needs at least one",
                         stages, name, L, noun, L == 1 ? "" : "s");
  }
  /* pre[j]: the cost of units [0, j), a unit's cost being its share of the
   * parameters plus its share of the training multiply-adds.
   * best[k][j]: the smallest possible largest-stage cost when k stages take
   * units [0, j); cut[k][j]: where the k-th stage starts in that optimum. */
  size_t W = (size_t)L + 1;
  double *pre = xmalloc(W * sizeof *pre), *best = xmalloc((size_t)(stages + 1) * W * sizeof *best);
  int *cut = xmalloc((size_t)(stages + 1) * W * sizeof *cut);
#define BEST(k, j) best[(size_t)(k) * W + (size_t)(j)]
#define CUT(k, j) cut[(size_t)(k) * W + (size_t)(j)]
  pre[0] = 0;
  for (int u = 0; u < L; u++) pre[u + 1] = pre[u] + (double)c->params[u] / c->P + (double)c->macs[u] / c->F;
  for (int j = 1; j <= L; j++) BEST(1, j) = pre[j], CUT(1, j) = 0;
  for (int k = 2; k <= stages; k++)
    for (int j = k; j <= L; j++) {
      BEST(k, j) = -1;
      for (int i = k - 1; i < j; i++) { /* stage k takes units [i, j) */
        double cost = pre[j] - pre[i];
        double m = BEST(k - 1, i) > cost ? BEST(k - 1, i) : cost;
        if (BEST(k, j) < 0 || m < BEST(k, j)) BEST(k, j) = m, CUT(k, j) = i;
      }
    }
  memset(out, 0, sizeof *out);
  out->stages = stages;
  out->first[stages] = L;
  for (int k = stages, j = L; k >= 1; k--) {
    out->first[k - 1] = CUT(k, j);
    j = CUT(k, j);
  }
#undef BEST
#undef CUT
  RUMOR_ASSERT(out->first[0] == 0);
  free(pre);
  free(best);
  free(cut);
  free(c);
  return 0;
}

int64_t pipe_split_params(const struct model_spec *spec, const struct pipe_split *sp, int s) {
  struct model_table t;
  model_table_build(spec, &t);
  int64_t n = t.unit_offset[sp->first[s + 1]] - t.unit_offset[sp->first[s]];
  model_table_free(&t);
  return n;
}

int64_t pipe_split_flops(const struct model_spec *spec, const struct pipe_split *sp, int s) {
  int64_t f = 0;
  for (int u = sp->first[s]; u < sp->first[s + 1]; u++) f += model_spec_unit_macs(spec, u);
  return f;
}

/* "layer 3" or "layers 0-2" (inclusive). */
static void unit_range(const struct model_spec *spec, int a, int b, char *buf, size_t n) {
  const char *noun = model_spec_unit_noun(spec);
  if (b - a == 1) snprintf(buf, n, "%s %d", noun, a);
  else snprintf(buf, n, "%ss %d-%d", noun, a, b - 1);
}

void pipe_split_describe(const struct model_spec *spec, const struct pipe_split *sp, int s, char *buf, size_t n) {
  int a = sp->first[s], b = sp->first[s + 1];
  char what[MODEL_SPEC_MAX], range[48];
  model_spec_describe_units(spec, a, b, what, sizeof what);
  unit_range(spec, a, b, range, sizeof range);
  struct unit_costs *c = xmalloc(sizeof *c);
  unit_costs(spec, c);
  int64_t p = pipe_split_params(spec, sp, s), f = pipe_split_flops(spec, sp, s);
  snprintf(buf, n, "stage %d/%d: %s (%s), %lld parameters (%.1f%%), %lld training multiply-adds per row (%.1f%%)", s,
           sp->stages, range, what, (long long)p, 100.0 * (double)p / c->P, (long long)f, 100.0 * (double)f / c->F);
  free(c);
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
