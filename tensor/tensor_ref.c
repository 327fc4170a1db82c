/* Plain reference ops: the obviously-correct versions every backend is
 * tested against. Double accumulation, no blocking, no threads. */
#include "tensor/tensor_ref.h"

#include <math.h>
#include <stdlib.h>

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

void tensor_ref_add(const float *x, const float *y, float *out, int64_t n) {
  for (int64_t i = 0; i < n; i++) out[i] = x[i] + y[i];
}

/* ---- transformer ops ---- */

void tensor_ref_embedding_fwd(const int32_t *tokens, const float *wte, const float *wpe, float *out, int64_t r,
                              int64_t t, int64_t c) {
  for (int64_t i = 0; i < r * t; i++) {
    const float *e = wte + (int64_t)tokens[i] * c, *p = wpe + (i % t) * c;
    for (int64_t j = 0; j < c; j++) out[i * c + j] = e[j] + p[j];
  }
}

void tensor_ref_embedding_bwd(const int32_t *tokens, const float *dout, float *dwte, float *dwpe, int64_t r,
                              int64_t t, int64_t c) {
  for (int64_t i = 0; i < r * t; i++) {
    float *e = dwte + (int64_t)tokens[i] * c, *p = dwpe + (i % t) * c;
    for (int64_t j = 0; j < c; j++) {
      e[j] += dout[i * c + j];
      p[j] += dout[i * c + j];
    }
  }
}

void tensor_ref_embedding_shard_fwd(const int32_t *tokens, const float *wte, int64_t lo, int64_t v, const float *wpe,
                                    float *out, int64_t r, int64_t t, int64_t c) {
  for (int64_t i = 0; i < r * t; i++) {
    int64_t tok = (int64_t)tokens[i] - lo;
    for (int64_t j = 0; j < c; j++) {
      float e = tok >= 0 && tok < v ? wte[tok * c + j] : 0.0f, p = wpe ? wpe[(i % t) * c + j] : 0.0f;
      out[i * c + j] = e + p;
    }
  }
}

void tensor_ref_embedding_shard_bwd(const int32_t *tokens, const float *dout, int64_t lo, int64_t v, float *dwte,
                                    float *dwpe, int64_t r, int64_t t, int64_t c) {
  for (int64_t i = 0; i < r * t; i++) {
    int64_t tok = (int64_t)tokens[i] - lo;
    for (int64_t j = 0; j < c; j++) {
      if (tok >= 0 && tok < v) dwte[tok * c + j] += dout[i * c + j];
      if (dwpe) dwpe[(i % t) * c + j] += dout[i * c + j];
    }
  }
}

void tensor_ref_xent_shard_stats(const float *logits, const int32_t *labels, int64_t lo, float *lse, float *target,
                                 int64_t rows, int64_t cols) {
  for (int64_t r = 0; r < rows; r++) {
    const float *x = logits + r * cols;
    double mx = -INFINITY, sum = 0.0;
    for (int64_t c = 0; c < cols; c++) mx = x[c] > mx ? x[c] : mx;
    for (int64_t c = 0; c < cols; c++) sum += exp((double)x[c] - mx);
    lse[r] = (float)(mx + log(sum));
    int64_t k = (int64_t)labels[r] - lo;
    target[r] = k >= 0 && k < cols ? x[k] : 0.0f;
  }
}

void tensor_ref_xent_shard_grad(const float *logits, const int32_t *labels, int64_t lo, const float *parts,
                                int64_t nparts, const float *target, float *dlogits, float *losses, int64_t rows,
                                int64_t cols, float grad_scale) {
  for (int64_t r = 0; r < rows; r++) {
    double mx = -INFINITY, sum = 0.0;
    for (int64_t s = 0; s < nparts; s++) mx = parts[s * rows + r] > mx ? parts[s * rows + r] : mx;
    for (int64_t s = 0; s < nparts; s++) sum += exp((double)parts[s * rows + r] - mx);
    double whole = mx + log(sum);
    if (losses) losses[r] = (float)(whole - (double)target[r]);
    int64_t k = (int64_t)labels[r] - lo;
    for (int64_t c = 0; c < cols; c++) {
      double p = exp((double)logits[r * cols + c] - whole);
      dlogits[r * cols + c] = (float)((double)grad_scale * (p - (c == k ? 1.0 : 0.0)));
    }
  }
}

void tensor_ref_layernorm_fwd(const float *x, const float *w, const float *b, float *y, float *mean, float *rstd,
                              int64_t rows, int64_t c) {
  for (int64_t i = 0; i < rows; i++) {
    const float *xi = x + i * c;
    double mu = 0.0, var = 0.0;
    for (int64_t j = 0; j < c; j++) mu += xi[j];
    mu /= (double)c;
    for (int64_t j = 0; j < c; j++) var += ((double)xi[j] - mu) * ((double)xi[j] - mu);
    var /= (double)c;
    double rs = 1.0 / sqrt(var + (double)TENSOR_LAYERNORM_EPS);
    for (int64_t j = 0; j < c; j++) y[i * c + j] = (float)(((double)xi[j] - mu) * rs * w[j] + b[j]);
    mean[i] = (float)mu;
    rstd[i] = (float)rs;
  }
}

void tensor_ref_layernorm_bwd(const float *x, const float *w, const float *mean, const float *rstd, const float *dy,
                              float *dx, float *dw, float *db, int64_t rows, int64_t c, float beta) {
  for (int64_t j = 0; j < c; j++) {
    double sw = 0.0, sb = 0.0;
    for (int64_t i = 0; i < rows; i++) {
      double xhat = ((double)x[i * c + j] - mean[i]) * rstd[i];
      sw += (double)dy[i * c + j] * xhat;
      sb += dy[i * c + j];
    }
    dw[j] = (float)(sw + (beta == 0.0f ? 0.0 : (double)beta * dw[j]));
    db[j] = (float)(sb + (beta == 0.0f ? 0.0 : (double)beta * db[j]));
  }
  /* dx = rstd·(g − mean(g) − x̂·mean(g·x̂)) with g = dy·w. */
  for (int64_t i = 0; i < rows; i++) {
    double mg = 0.0, mgx = 0.0;
    for (int64_t j = 0; j < c; j++) {
      double g = (double)dy[i * c + j] * w[j], xhat = ((double)x[i * c + j] - mean[i]) * rstd[i];
      mg += g;
      mgx += g * xhat;
    }
    mg /= (double)c;
    mgx /= (double)c;
    for (int64_t j = 0; j < c; j++) {
      double g = (double)dy[i * c + j] * w[j], xhat = ((double)x[i * c + j] - mean[i]) * rstd[i];
      dx[i * c + j] += (float)((double)rstd[i] * (g - mg - xhat * mgx));
    }
  }
}

/* q, k, v of position `pos` of sequence `s`, head `h`. */
static const float *qkv_at(const float *qkv, int64_t s, int64_t pos, int64_t t, int64_t c, int part, int64_t h,
                           int64_t hs) {
  return qkv + (s * t + pos) * 3 * c + part * c + h * hs;
}

/* Causal probabilities of query `q` of (s, h) over keys 0..q into p[0..q]
 * (double), from the scaled scores; returns the log-sum-exp. */
static double ref_probs(const float *qkv, int64_t s, int64_t h, int64_t q, int64_t t, int64_t c, int64_t hs,
                        double *p) {
  const float *qv = qkv_at(qkv, s, q, t, c, 0, h, hs);
  double scale = 1.0 / sqrt((double)hs), mx = -INFINITY;
  for (int64_t k = 0; k <= q; k++) {
    const float *kv = qkv_at(qkv, s, k, t, c, 1, h, hs);
    double dot = 0.0;
    for (int64_t d = 0; d < hs; d++) dot += (double)qv[d] * kv[d];
    p[k] = dot * scale;
    if (p[k] > mx) mx = p[k];
  }
  double sum = 0.0;
  for (int64_t k = 0; k <= q; k++) sum += exp(p[k] - mx);
  for (int64_t k = 0; k <= q; k++) p[k] = exp(p[k] - mx) / sum;
  return mx + log(sum);
}

void tensor_ref_attention_fwd(const float *qkv, float *out, float *lse, int64_t r, int64_t t, int64_t c, int nh) {
  int64_t hs = c / nh;
  double *p = xmalloc((size_t)t * sizeof(double));
  for (int64_t s = 0; s < r; s++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t q = 0; q < t; q++) {
        lse[(s * nh + h) * t + q] = (float)ref_probs(qkv, s, h, q, t, c, hs, p);
        for (int64_t d = 0; d < hs; d++) {
          double acc = 0.0;
          for (int64_t k = 0; k <= q; k++) acc += p[k] * qkv_at(qkv, s, k, t, c, 2, h, hs)[d];
          out[(s * t + q) * c + h * hs + d] = (float)acc;
        }
      }
  free(p);
}

void tensor_ref_attention_bwd(const float *qkv, const float *out, const float *lse, const float *dout, float *dqkv,
                              int64_t r, int64_t t, int64_t c, int nh) {
  (void)out;
  (void)lse; /* the reference recomputes the probabilities from qkv alone */
  int64_t hs = c / nh;
  double scale = 1.0 / sqrt((double)hs);
  double *p = xmalloc((size_t)t * sizeof(double)), *dp = xmalloc((size_t)t * sizeof(double));
  double *acc = xcalloc((size_t)(r * t * 3 * c), sizeof(double));
  for (int64_t s = 0; s < r; s++)
    for (int64_t h = 0; h < nh; h++)
      for (int64_t q = 0; q < t; q++) {
        (void)ref_probs(qkv, s, h, q, t, c, hs, p);
        const float *dov = dout + (s * t + q) * c + h * hs;
        /* dP[k] = dO·v_k; dS = P ⊙ (dP − Σ P·dP); dV_k += P[k]·dO. */
        double pdp = 0.0;
        for (int64_t k = 0; k <= q; k++) {
          const float *vv = qkv_at(qkv, s, k, t, c, 2, h, hs);
          double dot = 0.0;
          for (int64_t d = 0; d < hs; d++) dot += (double)dov[d] * vv[d];
          dp[k] = dot;
          pdp += p[k] * dot;
          double *dv = acc + (s * t + k) * 3 * c + 2 * c + h * hs;
          for (int64_t d = 0; d < hs; d++) dv[d] += p[k] * dov[d];
        }
        const float *qv = qkv_at(qkv, s, q, t, c, 0, h, hs);
        double *dq = acc + (s * t + q) * 3 * c + h * hs;
        for (int64_t k = 0; k <= q; k++) {
          double ds = p[k] * (dp[k] - pdp) * scale;
          const float *kv = qkv_at(qkv, s, k, t, c, 1, h, hs);
          double *dk = acc + (s * t + k) * 3 * c + c + h * hs;
          for (int64_t d = 0; d < hs; d++) {
            dq[d] += ds * kv[d];
            dk[d] += ds * qv[d];
          }
        }
      }
  for (int64_t i = 0; i < r * t * 3 * c; i++) dqkv[i] = (float)acc[i];
  free(acc);
  free(dp);
  free(p);
}

/* 0.5·(1 + tanh(u)) is evaluated as the equal sigmoid(2u) = 1/(1 + e^(−2u)):
 * 1 + tanh(u) cancels in double for u < −5 (x < −5.3: 1 + tanh(−17.5) =
 * 1.3e-15 carries tanh's absolute error of 1e-16, 10 % of it), while the
 * sigmoid keeps full relative accuracy everywhere. Likewise 0.5·(1 − tanh²)
 * = 2·s·(1 − s), with 1 − s = sigmoid(−2u) computed on its own. */
void tensor_ref_gelu_tanh_fwd(const float *x, float *y, int64_t n) {
  const double k = sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < n; i++) {
    double v = x[i], u = k * (v + 0.044715 * v * v * v);
    y[i] = (float)(v / (1.0 + exp(-2.0 * u)));
  }
}

void tensor_ref_gelu_tanh_bwd(const float *x, const float *dy, float *dx, int64_t n) {
  const double k = sqrt(2.0 / M_PI);
  for (int64_t i = 0; i < n; i++) {
    double v = x[i], u = k * (v + 0.044715 * v * v * v);
    double s = 1.0 / (1.0 + exp(-2.0 * u)), sc = 1.0 / (1.0 + exp(2.0 * u)); /* sc = 1 − s */
    double du = k * (1.0 + 3.0 * 0.044715 * v * v);
    dx[i] = (float)((double)dy[i] * (s + 2.0 * v * s * sc * du));
  }
}

/* ---- mixture of experts ---- */

/* Whether expert a ranks before expert b on row l: the larger logit, and
 * on a tie (−0 equals +0) the lower index. */
static bool ref_moe_before(const float *l, int64_t a, int64_t b) { return l[a] > l[b] || (l[a] == l[b] && a < b); }

/* Row n's softmax in double (stored as float), its log-sum-exp, and its K
 * best experts by K passes over the row; gates from the stored probs. */
static void ref_moe_route_row(const float *l, int64_t e, int k, float *probs, float *lse, int32_t *expert,
                              float *gate, bool *chosen) {
  double mx = -INFINITY, sum = 0.0;
  for (int64_t j = 0; j < e; j++) mx = l[j] > mx ? l[j] : mx;
  for (int64_t j = 0; j < e; j++) sum += exp((double)l[j] - mx);
  for (int64_t j = 0; j < e; j++) probs[j] = (float)(exp((double)l[j] - mx) / sum);
  *lse = (float)(mx + log(sum));
  for (int64_t j = 0; j < e; j++) chosen[j] = false;
  double psel = 0.0;
  for (int i = 0; i < k; i++) {
    int64_t best = -1;
    for (int64_t j = 0; j < e; j++)
      if (!chosen[j] && (best < 0 || ref_moe_before(l, j, best))) best = j;
    chosen[best] = true;
    expert[i] = (int32_t)best;
    psel += probs[best];
  }
  for (int i = 0; i < k; i++) gate[i] = k == 1 ? probs[expert[i]] : (float)(probs[expert[i]] / psel);
}

void tensor_ref_moe_route(const float *logits, float *probs, float *lse, int32_t *expert, float *gate, int32_t *slot,
                          int32_t *assigned, int32_t *kept, float *psum, int64_t n, int64_t e, int k, int64_t cap) {
  bool *chosen = xmalloc((size_t)e * sizeof *chosen);
  for (int64_t i = 0; i < n; i++)
    ref_moe_route_row(logits + i * e, e, k, probs + i * e, lse + i, expert + i * k, gate + i * k, chosen);
  free(chosen);
  for (int64_t j = 0; j < e; j++) assigned[j] = kept[j] = 0;
  for (int c = 0; c < k; c++) /* first choices of every token, then second choices, ... */
    for (int64_t i = 0; i < n; i++) {
      int32_t x = expert[i * k + c];
      slot[i * k + c] = assigned[x] < cap ? assigned[x] : -1;
      assigned[x]++;
      if (slot[i * k + c] >= 0) kept[x]++;
    }
  for (int64_t j = 0; j < e; j++) {
    double s = 0.0;
    for (int64_t i = 0; i < n; i++) s += probs[i * e + j];
    psum[j] = (float)s;
  }
}

void tensor_ref_moe_route_bwd(const float *probs, const float *lse, const int32_t *expert, const float *gate,
                              const float *dgate, const float *daux, float zscale, float *dlogits, int64_t n,
                              int64_t e, int k) {
  double *dprob = xmalloc((size_t)e * sizeof *dprob);
  for (int64_t i = 0; i < n; i++) {
    const float *p = probs + i * e;
    const int32_t *ex = expert + i * k;
    const float *g = gate + i * k, *dg = dgate + i * k;
    for (int64_t j = 0; j < e; j++) dprob[j] = daux[j];
    double dot = 0.0, psel = 0.0; /* Σ_j dgate·gate and Σ_j probs of the chosen */
    for (int c = 0; c < k; c++) {
      dot += (double)dg[c] * g[c];
      psel += p[ex[c]];
    }
    for (int c = 0; c < k; c++) dprob[ex[c]] += k == 1 ? (double)dg[c] : ((double)dg[c] - dot) / psel;
    double pd = 0.0;
    for (int64_t j = 0; j < e; j++) pd += (double)p[j] * dprob[j];
    for (int64_t j = 0; j < e; j++)
      dlogits[i * e + j] = (float)((double)p[j] * (dprob[j] - pd) + (double)zscale * lse[i] * p[j]);
  }
  free(dprob);
}

/* The row of choice (i, c) in the expert buffers, or −1 when dropped. */
static int64_t ref_moe_row(const int32_t *expert, const int32_t *slot, int64_t i, int k, int c, int64_t e,
                           int64_t cap) {
  int64_t x = expert[i * k + c], s = slot[i * k + c];
  return x >= 0 && x < e && s >= 0 && s < cap ? x * cap + s : -1;
}

void tensor_ref_moe_dispatch(const float *x, const int32_t *expert, const int32_t *slot, float *xe, int64_t n,
                             int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t j = 0; j < e * cap * ch; j++) xe[j] = 0.0f;
  for (int64_t i = 0; i < n; i++)
    for (int c = 0; c < k; c++) {
      int64_t r = ref_moe_row(expert, slot, i, k, c, e, cap);
      if (r >= 0)
        for (int64_t j = 0; j < ch; j++) xe[r * ch + j] = x[i * ch + j];
    }
}

void tensor_ref_moe_dispatch_bwd(const float *dxe, const int32_t *expert, const int32_t *slot, float *dx, int64_t n,
                                 int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = 0; i < n; i++)
    for (int c = 0; c < k; c++) {
      int64_t r = ref_moe_row(expert, slot, i, k, c, e, cap);
      if (r >= 0)
        for (int64_t j = 0; j < ch; j++) dx[i * ch + j] += dxe[r * ch + j];
    }
}

void tensor_ref_moe_combine(const float *ye, const int32_t *expert, const int32_t *slot, const float *gate, float *out,
                            int64_t n, int64_t ch, int k, int64_t e, int64_t cap) {
  for (int64_t i = 0; i < n; i++)
    for (int64_t j = 0; j < ch; j++) {
      double acc = 0.0;
      for (int c = 0; c < k; c++) {
        int64_t r = ref_moe_row(expert, slot, i, k, c, e, cap);
        if (r >= 0) acc += (double)gate[i * k + c] * ye[r * ch + j];
      }
      out[i * ch + j] = (float)acc;
    }
}

void tensor_ref_moe_combine_bwd(const float *dout, const float *ye, const int32_t *expert, const int32_t *slot,
                                const float *gate, float *dye, float *dgate, int64_t n, int64_t ch, int k, int64_t e,
                                int64_t cap) {
  for (int64_t j = 0; j < e * cap * ch; j++) dye[j] = 0.0f;
  for (int64_t i = 0; i < n; i++)
    for (int c = 0; c < k; c++) {
      int64_t r = ref_moe_row(expert, slot, i, k, c, e, cap);
      double dot = 0.0;
      if (r >= 0)
        for (int64_t j = 0; j < ch; j++) {
          dye[r * ch + j] = gate[i * k + c] * dout[i * ch + j];
          dot += (double)dout[i * ch + j] * ye[r * ch + j];
        }
      dgate[i * k + c] = (float)dot;
    }
}
