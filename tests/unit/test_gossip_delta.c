/* gossip_delta: the partner's snapshot minus ours, in place, with the
 * statistics that validation and clipping read (sync.c), against a plain
 * double-precision loop; lengths around the lanes and blocks it works in. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdlib.h>

#include "gossip/gossip_impl.h"

static float uniform(uint64_t *s) {
  *s = *s * 6364136223846793005ull + 1442695040888963407ull;
  return (float)((*s >> 40) * 0x1p-24) * 2.0f - 1.0f;
}

Test(delta, differences_and_statistics_match_a_plain_loop_for_every_length) {
  const uint64_t lengths[] = {0, 1, 15, 16, 17, 4095, 4096, 4097, 100003};
  for (size_t l = 0; l < sizeof lengths / sizeof *lengths; l++) {
    uint64_t n = lengths[l], seed = n + 1;
    float *theirs = malloc((n + 1) * sizeof *theirs), *mine = malloc((n + 1) * sizeof *mine);
    float *want = malloc((n + 1) * sizeof *want);
    double sq_dist = 0, sq_norm = 0;
    for (uint64_t i = 0; i < n; i++) {
      mine[i] = uniform(&seed);
      theirs[i] = mine[i] + 0.01f * uniform(&seed);
      want[i] = theirs[i] - mine[i];
      sq_dist += (double)want[i] * want[i];
      sq_norm += (double)mine[i] * mine[i];
    }
    struct gossip_xch_delta d;
    gossip_delta(theirs, mine, n, &d);
    for (uint64_t i = 0; i < n; i++)
      cr_assert(theirs[i] == want[i], "n %llu: value %llu is %g, want %g", (unsigned long long)n,
                (unsigned long long)i, theirs[i], want[i]);
    cr_assert_eq(d.nonfinite, 0);
    cr_assert(fabs(d.sq_dist - sq_dist) <= 1e-5 * sq_dist, "n %llu: ‖d‖² %.9g, want %.9g", (unsigned long long)n,
              d.sq_dist, sq_dist);
    cr_assert(fabs(d.sq_norm_mine - sq_norm) <= 1e-5 * sq_norm, "n %llu: ‖mine‖² %.9g, want %.9g",
              (unsigned long long)n, d.sq_norm_mine, sq_norm);
    free(theirs), free(mine), free(want);
  }
}

Test(delta, counts_the_partners_nan_and_infinite_values_wherever_they_are) {
  enum { N = 5000 };
  static float theirs[N], mine[N];
  for (int i = 0; i < N; i++) theirs[i] = mine[i] = 1.0f;
  theirs[0] = NAN;          /* a lane of the first block */
  theirs[4100] = INFINITY;  /* the second block */
  theirs[N - 1] = -INFINITY; /* the tail after the last full lane group */
  mine[7] = 3.0f;           /* ours is not what is counted */
  struct gossip_xch_delta d;
  gossip_delta(theirs, mine, N, &d);
  cr_assert_eq(d.nonfinite, 3);
  cr_assert(theirs[7] == -2.0f);
  cr_assert(isnan(d.sq_dist), "the distance over non-finite values is %g, not NaN", d.sq_dist);
}
