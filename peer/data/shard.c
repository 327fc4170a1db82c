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

bool shard_order_init(struct shard_order *o, int64_t total, struct shard shard, uint64_t data_seed, uint64_t stream,
                      uint64_t seed) {
  memset(o, 0, sizeof *o);
  int64_t n = total / shard.count + (shard.index < total % shard.count ? 1 : 0);
  if (n == 0) return false;
  int64_t *perm = xmalloc((size_t)total * sizeof *perm);
  for (int64_t i = 0; i < total; i++) perm[i] = i;
  struct rng r;
  rng_seed(&r, data_seed, stream);
  shuffle(perm, total, &r);
  o->base = xmalloc((size_t)n * sizeof *o->base);
  for (int64_t k = 0; k < n; k++) o->base[k] = perm[shard.index + k * shard.count];
  free(perm);
  o->order = xmalloc((size_t)n * sizeof *o->order);
  o->shard = shard;
  o->seed = seed;
  o->n = n;
  shard_order_start_epoch(o, 0);
  return true;
}

void shard_order_free(struct shard_order *o) {
  free(o->base);
  free(o->order);
  memset(o, 0, sizeof *o);
}

void shard_order_start_epoch(struct shard_order *o, int64_t epoch) {
  memcpy(o->order, o->base, (size_t)o->n * sizeof *o->order);
  struct rng r;
  rng_seed(&r, o->seed ^ ((uint64_t)o->shard.index << 32), (uint64_t)epoch + 1);
  shuffle(o->order, o->n, &r);
  o->epoch = epoch;
}

int64_t shard_order_steps(const struct shard_order *o, int64_t bs) { return (o->n + bs - 1) / bs; }
