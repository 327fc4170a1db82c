/*
 * data_impl.h — what the image and token batchers share (private to
 * peer/data/): a shard's rows of a fixed permutation, and each epoch's
 * shuffle of them (shard.c).
 */
#ifndef RUMOR_PEER_DATA_IMPL_H
#define RUMOR_PEER_DATA_IMPL_H

#include "peer/data/data.h"

/* Rows (samples, windows) 0..total−1 permuted from `data_seed` on RNG stream
 * `stream` (the same on every peer), and shard.index's strided part of them
 * (perm[shard.index + k·shard.count]): a new array of *n entries (the caller
 * frees it; NULL and *n 0 when the shard is empty). */
int64_t *shard_rows(int64_t total, struct shard shard, uint64_t data_seed, uint64_t stream, int64_t *n);
/* order ← base (n rows) shuffled for (seed, shard, epoch): deterministic. */
void shard_epoch_order(const int64_t *base, int64_t *order, int64_t n, uint64_t seed, struct shard shard,
                       int64_t epoch);

#endif /* RUMOR_PEER_DATA_IMPL_H */
