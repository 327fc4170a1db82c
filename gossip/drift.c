/* Consensus distance, exact and from count-sketches. */
#include "gossip/drift.h"

#include <math.h>
#include <stdlib.h>

double drift_from_sketches(const double *const *sketches, size_t n, int k) {
  if (n < 1 || k < 1) return NAN;
  double total = 0;
  for (int b = 0; b < k; b++) {
    double mean = 0;
    for (size_t i = 0; i < n; i++) mean += sketches[i][b];
    mean /= (double)n;
    for (size_t i = 0; i < n; i++) {
      double d = sketches[i][b] - mean;
      total += d * d;
    }
  }
  return sqrt(total / (double)n);
}

double drift_exact(const float *const *params, size_t n, uint64_t p) {
  if (n < 1) return NAN;
  /* Per coordinate: the mean, then the squared deviations. Blocks keep the
   * n rows' slices in cache. */
  enum { BLOCK = 4096 };
  double mean[BLOCK];
  double total = 0;
  for (uint64_t j0 = 0; j0 < p; j0 += BLOCK) {
    size_t m = p - j0 < BLOCK ? (size_t)(p - j0) : BLOCK;
    for (size_t j = 0; j < m; j++) mean[j] = 0;
    for (size_t i = 0; i < n; i++) {
      const float *x = params[i] + j0;
      for (size_t j = 0; j < m; j++) mean[j] += x[j];
    }
    for (size_t j = 0; j < m; j++) mean[j] /= (double)n;
    for (size_t i = 0; i < n; i++) {
      const float *x = params[i] + j0;
      double s = 0;
      for (size_t j = 0; j < m; j++) {
        double d = (double)x[j] - mean[j];
        s += d * d;
      }
      total += s;
    }
  }
  return sqrt(total / (double)n);
}

double drift_mean_norm(const double *norms, size_t n, double xi) {
  if (n < 1) return NAN;
  double ms = 0;
  for (size_t i = 0; i < n; i++) ms += norms[i] * norms[i];
  ms = ms / (double)n - xi * xi;
  return ms > 0 ? sqrt(ms) : 0;
}
