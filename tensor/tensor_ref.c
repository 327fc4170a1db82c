/* Plain reference ops: the obviously-correct versions every backend is
 * tested against. Double accumulation, no blocking, no threads. */
#include "tensor/tensor_ref.h"

#include <math.h>

void tensor_ref_gemm(bool trans_a, bool trans_b, int m, int n, int k, float alpha, const float *a,
                     const float *b, float beta, float *c) {
  for (int i = 0; i < m; i++) {
    for (int j = 0; j < n; j++) {
      double acc = 0.0;
      for (int p = 0; p < k; p++) {
        float av = trans_a ? a[(size_t)p * m + i] : a[(size_t)i * k + p];
        float bv = trans_b ? b[(size_t)j * k + p] : b[(size_t)p * n + j];
        acc += (double)av * (double)bv;
      }
      float *cij = &c[(size_t)i * n + j];
      *cij = (float)(alpha * acc + (beta == 0.0f ? 0.0 : (double)beta * *cij));
    }
  }
}

void tensor_ref_bias_add(float *y, const float *bias, int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++)
    for (int64_t c = 0; c < cols; c++) y[r * cols + c] += bias[c];
}

void tensor_ref_bias_grad(const float *dy, float *db, int64_t rows, int64_t cols, float beta) {
  for (int64_t c = 0; c < cols; c++) {
    double acc = 0.0;
    for (int64_t r = 0; r < rows; r++) acc += dy[r * cols + c];
    db[c] = (float)(acc + (beta == 0.0f ? 0.0 : (double)beta * db[c]));
  }
}

void tensor_ref_relu_fwd(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) y[i] = x[i] > 0.0f ? x[i] : 0.0f;
}

void tensor_ref_relu_bwd(const float *y, const float *dy, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++) dx[i] = y[i] > 0.0f ? dy[i] : 0.0f;
}

void tensor_ref_gelu_fwd(const float *x, float *y, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = x[i];
    y[i] = (float)(0.5 * v * (1.0 + erf(v / sqrt(2.0))));
  }
}

void tensor_ref_gelu_bwd(const float *x, const float *dy, float *dx, int64_t n) {
  for (int64_t i = 0; i < n; i++) {
    double v = x[i];
    double cdf = 0.5 * (1.0 + erf(v / sqrt(2.0)));
    double pdf = exp(-0.5 * v * v) / sqrt(2.0 * M_PI);
    dx[i] = (float)((double)dy[i] * (cdf + v * pdf));
  }
}

void tensor_ref_softmax_xent(const float *logits, const int32_t *labels, float *dlogits,
                             float *losses, int64_t rows, int64_t cols, float grad_scale) {
  for (int64_t r = 0; r < rows; r++) {
    const float *x = logits + r * cols;
    double mx = -INFINITY;
    for (int64_t c = 0; c < cols; c++) mx = x[c] > mx ? x[c] : mx;
    double sum = 0.0;
    for (int64_t c = 0; c < cols; c++) sum += exp((double)x[c] - mx);
    int32_t label = labels[r];
    losses[r] = (float)(log(sum) + mx - (double)x[label]);
    for (int64_t c = 0; c < cols; c++) {
      double p = exp((double)x[c] - mx) / sum;
      dlogits[r * cols + c] = (float)((double)grad_scale * (p - (c == label ? 1.0 : 0.0)));
    }
  }
}

void tensor_ref_sgd_step(float *p, const float *g, float *m, int64_t n, const struct tensor_sgd *hp) {
  for (int64_t i = 0; i < n; i++) {
    float grad = g[i] + hp->weight_decay * p[i];
    float step = grad;
    if (hp->momentum != 0.0f) {
      m[i] = hp->momentum * m[i] + grad;
      step = hp->nesterov ? grad + hp->momentum * m[i] : m[i];
    }
    p[i] -= hp->lr * step;
  }
}

void tensor_ref_adamw_step(float *p, const float *g, float *m, float *v, int64_t n,
                           const struct tensor_adamw *hp) {
  double bc1 = 1.0 - pow(hp->beta1, (double)hp->step);
  double bc2 = 1.0 - pow(hp->beta2, (double)hp->step);
  for (int64_t i = 0; i < n; i++) {
    p[i] *= 1.0f - hp->lr * hp->weight_decay;
    m[i] = hp->beta1 * m[i] + (1.0f - hp->beta1) * g[i];
    v[i] = hp->beta2 * v[i] + (1.0f - hp->beta2) * g[i] * g[i];
    double mhat = m[i] / bc1, vhat = v[i] / bc2;
    p[i] -= (float)(hp->lr * mhat / (sqrt(vhat) + hp->eps));
  }
}

void tensor_ref_count_sketch(const float *x, int64_t n, uint64_t seed, int k, double *out) {
  for (int j = 0; j < k; j++) out[j] = 0.0;
  for (int64_t i = 0; i < n; i++) {
    bool neg;
    uint32_t b = tensor_sketch_bucket(seed, (uint64_t)i, k, &neg);
    out[b] += neg ? -(double)x[i] : (double)x[i];
  }
}
