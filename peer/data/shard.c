/* Shards of a permutation and per-epoch shuffles, for both batchers. */
#include "peer/data/data_impl.h"

#include <stdlib.h>
#include <string.h>

/* Fisher-Yates with our seeded generator. */
static void shuffle(int64_t *a, int64_t n, struct rng *r) {
  for (int64_t i = n - 1; i > 0; i--) {
    int64_t j = (int64_t)rng_below(r, (uint64_t)i + 1);
    int64_t t = a[i];
    a[i] = a[j];
    a[j] = t;
  }
}

int64_t *shard_rows(int64_t total, struct shard shard, uint64_t data_seed, uint64_t stream, int64_t *n) {
  *n = total / shard.count + (shard.index < total % shard.count ? 1 : 0);
  if (*n == 0) return NULL;
  int64_t *perm = xmalloc((size_t)total * sizeof *perm);
  for (int64_t i = 0; i < total; i++) perm[i] = i;
  struct rng r;
  rng_seed(&r, data_seed, stream);
  shuffle(perm, total, &r);
  int64_t *rows = xmalloc((size_t)*n * sizeof *rows);
  for (int64_t k = 0; k < *n; k++) rows[k] = perm[shard.index + k * shard.count];
  free(perm);
  return rows;
}

void shard_epoch_order(const int64_t *base, int64_t *order, int64_t n, uint64_t seed, struct shard shard,
                       int64_t epoch) {
  memcpy(order, base, (size_t)n * sizeof *order);
  struct rng r;
  rng_seed(&r, seed ^ ((uint64_t)shard.index << 32), (uint64_t)epoch + 1);
  shuffle(order, n, &r);
}
