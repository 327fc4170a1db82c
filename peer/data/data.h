/*
 * data — MNIST-format IDX files (plain or gzip), sharding and batching.
 *
 * A dataset keeps the raw 8-bit pixels and labels in host memory (a quarter
 * of the float size); batches are normalised while they are gathered.
 * Sharding splits a fixed permutation of the samples (from the data seed, the
 * same on every peer) into n disjoint strided parts; each epoch shuffles the
 * shard from (seed, epoch, shard), so runs are reproducible.
 */
#ifndef RUMOR_PEER_DATA_H
#define RUMOR_PEER_DATA_H

#include <stdint.h>

#include "util/util.h"

/* Bounds applied to the declared sizes before anything is allocated. */
#define DATASET_MAX_SAMPLES 100000000LL
#define DATASET_MAX_FEATURES (1LL << 20)
#define DATASET_MAX_BYTES (1LL << 34)

struct dataset {
  int64_t count;    /* samples */
  int64_t rows, cols; /* image shape; features = rows·cols */
  int64_t features;
  uint8_t *pixels;  /* count × features, row-major */
  uint8_t *labels;  /* count */
  int num_classes;  /* 1 + the largest label */
};

/* Loads an images file (IDX3, magic 0x00000803) and a labels file (IDX1,
 * magic 0x00000801), each plain or gzip. Fails with RUMOR_ECORRUPT and a
 * message naming the file for a wrong magic, impossible dimensions, a
 * truncated or over-long file, or a label count that differs from the image
 * count; with a negative errno if a file cannot be read. */
int dataset_load(const char *images_path, const char *labels_path, struct dataset *out,
                 struct rumor_err *e) RUMOR_MUST_CHECK;
/* Loads "<split>-images-idx3-ubyte[.gz]" and "<split>-labels-idx1-ubyte[.gz]"
 * from `dir` (split "train" or "t10k", as MNIST and Fashion-MNIST name them). */
int dataset_load_split(const char *dir, const char *split, struct dataset *out,
                       struct rumor_err *e) RUMOR_MUST_CHECK;
void dataset_free(struct dataset *ds);
/* Mean and standard deviation of all pixels scaled to [0, 1]. */
void dataset_pixel_stats(const struct dataset *ds, double *mean, double *std);

struct shard {
  int64_t index, count; /* this is shard index of count, 0 <= index < count */
};
/* Parses "i/n" with 0 <= i < n <= 65536. */
int shard_parse(const char *s, struct shard *out, struct rumor_err *e) RUMOR_MUST_CHECK;

struct batcher {
  const struct dataset *ds;
  struct shard shard;
  uint64_t seed;
  int64_t n;       /* samples in this shard */
  int64_t *base;   /* this shard's sample indices, in shard order */
  int64_t *order;  /* this epoch's order (a permutation of base) */
  int64_t epoch;
  float lut[256];  /* pixel value → normalised float */
};

/* Picks this shard's samples from a permutation drawn from `data_seed`.
 * Returns RUMOR_EFORMAT when the shard would be empty. */
int batcher_init(struct batcher *b, const struct dataset *ds, struct shard shard, uint64_t data_seed,
                 uint64_t seed, double mean, double std, struct rumor_err *e) RUMOR_MUST_CHECK;
void batcher_free(struct batcher *b);
/* Shuffles the shard for `epoch` (deterministic in seed, epoch, shard). */
void batcher_start_epoch(struct batcher *b, int64_t epoch);
/* Batches per epoch for batch size `bs` (the last one may be short). */
int64_t batcher_steps_per_epoch(const struct batcher *b, int64_t bs);
/* Gathers batch number `step` of the current epoch into x (rows × features,
 * normalised) and y (rows). Returns the number of rows (<= bs). */
int64_t batcher_fill(const struct batcher *b, int64_t step, int64_t bs, float *x, int32_t *y);
/* The normalisation table: pixel v → (v/255 − mean) / std. */
void dataset_norm_lut(double mean, double std, float lut[256]);
/* Gathers samples [first, first+rows) in file order (for evaluation),
 * normalised with `lut`. */
void dataset_gather_range(const struct dataset *ds, const float lut[256], int64_t first, int64_t rows,
                          float *x, int32_t *y);

#endif /* RUMOR_PEER_DATA_H */
