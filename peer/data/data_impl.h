/*
 * data_impl.h — what the image and token batchers share (private to
 * peer/data/): a shard's rows of a fixed permutation, and each epoch's
 * shuffle of them (shard.c).
 */
#ifndef RUMOR_PEER_DATA_IMPL_H
#define RUMOR_PEER_DATA_IMPL_H

#include "peer/data/data.h"

/* Rows 0..total−1 permuted from `data_seed` on RNG stream `stream` (the
 * same on every peer), and shard.index's strided part of them
 * (perm[shard.index + k·shard.count]), shuffled for epoch 0 with `seed`.
 * Returns false, with nothing allocated, when the shard would be empty. */
bool shard_order_init(struct shard_order *o, int64_t total, struct shard shard, uint64_t data_seed, uint64_t stream,
                      uint64_t seed);
void shard_order_free(struct shard_order *o);

#endif /* RUMOR_PEER_DATA_IMPL_H */
