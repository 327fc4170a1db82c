/* Clipped gossip averaging: the adaptive threshold. */
#include "peer/sync/sync.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void clip_init(struct clip_state *c, double tau_fixed) {
  memset(c, 0, sizeof *c);
  c->tau_fixed = tau_fixed > 0 ? tau_fixed : 0;
}

static int cmp_double(const void *a, const void *b) {
  double x = *(const double *)a, y = *(const double *)b;
  return (x > y) - (x < y);
}

/* Records `dist` as partner `id`'s latest distance. */
static void remember(struct clip_state *c, const uint8_t *id, double dist) {
  int slot = -1, oldest = 0;
  for (int i = 0; i < c->n && slot < 0; i++) {
    if (memcmp(c->p[i].id, id, CLIP_ID_BYTES) == 0) slot = i;
    else if (c->p[i].seen < c->p[oldest].seen) oldest = i;
  }
  if (slot < 0) slot = c->n < CLIP_PARTNERS ? c->n++ : oldest;
  memcpy(c->p[slot].id, id, CLIP_ID_BYTES);
  c->p[slot].dist = dist;
  c->p[slot].seen = c->seen;
}

/* The distances the median is taken over (sync.h): the partners met in the
 * last CLIP_RECENT exchanges and, while fewer than CLIP_WARMUP, the most
 * recently met of the others up to CLIP_WARMUP. Returns how many. */
static int counted_distances(const struct clip_state *c, double *out) {
  bool taken[CLIP_PARTNERS] = {false};
  int m = 0;
  for (int i = 0; i < c->n; i++)
    if (c->seen - c->p[i].seen < CLIP_RECENT) {
      taken[i] = true;
      out[m++] = c->p[i].dist;
    }
  while (m < CLIP_WARMUP) {
    int newest = -1;
    for (int i = 0; i < c->n; i++)
      if (!taken[i] && (newest < 0 || c->p[i].seen > c->p[newest].seen)) newest = i;
    if (newest < 0) break; /* fewer than CLIP_WARMUP partners ever met */
    taken[newest] = true;
    out[m++] = c->p[newest].dist;
  }
  return m;
}

double clip_scale(struct clip_state *c, const uint8_t *id, double dist, double norm) {
  c->seen++;
  c->last_outlier = false;

  double tau;
  if (c->tau_fixed > 0) {
    tau = c->tau_fixed;
  } else {
    /* A distance of 0 (a partner equal to us, as every peer is while the
     * cluster assembles) says nothing about the spread of honest updates;
     * recorded, it would leave τ at its floor once training starts. */
    if (isfinite(dist) && dist > 0) remember(c, id, dist);
    double counted[CLIP_PARTNERS];
    int m = counted_distances(c, counted);
    qsort(counted, (size_t)m, sizeof(double), cmp_double);
    double median = m ? counted[m / 2] : 0;
    if (median < CLIP_FLOOR_REL * norm) median = CLIP_FLOOR_REL * norm;
    tau = CLIP_TAU_MEDIANS * median;
    bool warm_up = m < CLIP_WARMUP;
    if (warm_up && tau > CLIP_WARMUP_REL * norm) tau = CLIP_WARMUP_REL * norm;
    c->last_outlier = !warm_up && dist > CLIP_OUTLIER * median;
  }
  c->last_tau = tau;
  if (!isfinite(dist)) {
    /* Never the case after validation (a non-finite partner is rejected
     * first), and applying such an update would be a step into nowhere:
     * nothing of it, and an outlier. */
    c->last_outlier = true;
    return 0.0;
  }
  if (!(dist > tau)) return 1.0; /* also dist 0 */
  c->clipped++;
  return tau > 0 ? tau / dist : 0.0;
}
