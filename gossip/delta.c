/* The partner's snapshot against ours, when an exchange's transfers end. */
#include <float.h>
#include <math.h>

#include "gossip/gossip_impl.h"

/* Lanes of partial sums (a vector's worth or two) and values per block:
 * float partials over a block of DELTA_BLOCK / DELTA_LANES values each stay
 * accurate to about 1e-5 relative, and the blocks add up in double. The
 * lanes are independent, so the compiler vectorises the inner loop without
 * reassociating anything; compiled for AVX2 and AVX-512 beside the baseline
 * and picked at load time (not under the sanitizers, as in tensor_cpu.h). */
#define DELTA_LANES 16
#define DELTA_BLOCK 4096

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__) && !defined(__SANITIZE_ADDRESS__) && \
    !defined(__SANITIZE_THREAD__)
#define DELTA_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define DELTA_CLONES
#endif

DELTA_CLONES void gossip_delta(float *restrict theirs, const float *restrict mine, uint64_t n,
                               struct gossip_xch_delta *out) {
  double sq_dist = 0, sq_norm = 0;
  int64_t bad = 0;
  for (uint64_t b = 0; b < n; b += DELTA_BLOCK) {
    uint64_t e = n - b < DELTA_BLOCK ? n : b + DELTA_BLOCK, i = b;
    float ad[DELTA_LANES] = {0}, am[DELTA_LANES] = {0};
    int32_t ab[DELTA_LANES] = {0};
    for (; i + DELTA_LANES <= e; i += DELTA_LANES)
      for (int j = 0; j < DELTA_LANES; j++) {
        float t = theirs[i + j], m = mine[i + j], d = t - m;
        ab[j] += !(fabsf(t) <= FLT_MAX); /* NaN or ±Inf */
        theirs[i + j] = d;
        ad[j] += d * d;
        am[j] += m * m;
      }
    for (; i < e; i++) {
      float t = theirs[i], m = mine[i], d = t - m;
      ab[0] += !(fabsf(t) <= FLT_MAX);
      theirs[i] = d;
      ad[0] += d * d;
      am[0] += m * m;
    }
    for (int j = 0; j < DELTA_LANES; j++) sq_dist += ad[j], sq_norm += am[j], bad += ab[j];
  }
  *out = (struct gossip_xch_delta){.nonfinite = bad, .sq_dist = sq_dist, .sq_norm_mine = sq_norm};
}
