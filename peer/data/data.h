/*
 * data — MNIST-format IDX files (plain or gzip), token corpora for language
 * models (plain text and llm.c token shards), sharding and batching.
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
#define SHARD_MAX 65536 /* the most shards a data set is cut into */
/* Parses "i/n" with 0 <= i < n <= SHARD_MAX. */
int shard_parse(const char *s, struct shard *out, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Which rows (samples, windows) a shard trains on and in what order: its
 * part of a permutation shared by every peer, shuffled afresh each epoch
 * (shard.c). Both batchers keep one. */
struct shard_order {
  struct shard shard;
  uint64_t seed;  /* of the epoch shuffles */
  int64_t n;      /* rows in this shard */
  int64_t *base;  /* this shard's rows, in shard order */
  int64_t *order; /* this epoch's order (a permutation of base) */
  int64_t epoch;
};
/* Shuffles the shard for `epoch` (deterministic in seed, epoch, shard). */
void shard_order_start_epoch(struct shard_order *o, int64_t epoch);
/* Batches per epoch for batch size `bs` (the last one may be short). */
int64_t shard_order_steps(const struct shard_order *o, int64_t bs);

struct batcher {
  const struct dataset *ds;
  struct shard_order rows; /* sample indices */
  float lut[256];          /* pixel value → normalised float */
};

/* Picks this shard's samples from a permutation drawn from `data_seed`.
 * Returns RUMOR_EFORMAT when the shard would be empty. */
int batcher_init(struct batcher *b, const struct dataset *ds, struct shard shard, uint64_t data_seed,
                 uint64_t seed, double mean, double std, struct rumor_err *e) RUMOR_MUST_CHECK;
void batcher_free(struct batcher *b);
/* Gathers batch number `step` of the current epoch into x (rows × features,
 * normalised) and y (rows). Returns the number of rows (<= bs). */
int64_t batcher_fill(const struct batcher *b, int64_t step, int64_t bs, float *x, int32_t *y);
/* The normalisation table: pixel v → (v/255 − mean) / std. */
void dataset_norm_lut(double mean, double std, float lut[256]);
/* Gathers samples [first, first+rows) in file order (for evaluation),
 * normalised with `lut`. */
void dataset_gather_range(const struct dataset *ds, const float lut[256], int64_t first, int64_t rows,
                          float *x, int32_t *y);

/* ---- token corpora (language models) -----------------------------------------
 * A corpus is the training and validation token streams of a language model,
 * each a list of segments of uint16 tokens: one segment per file, or the
 * pieces of a file cut in two by the validation fraction. A training window
 * is T+1 consecutive tokens of one segment (T = the model's context): inputs
 * x = tokens[s, s+T), targets y = tokens[s+1, s+T]. Windows start at
 * s = 0, T, 2T, ... of each segment (stride T, so every target is predicted
 * once per epoch); the last partial window of a segment is dropped, and no
 * window crosses a segment boundary (the end of one file is no context for
 * the start of the next).
 *
 * Inputs, told apart per file:
 *  - llm.c token shards: a header of 256 little-endian int32 ([0] magic
 *    TOKEN_SHARD_MAGIC, [1] version 1, [2] token count), then that many
 *    little-endian uint16 tokens. They are mapped read-only (mmap, shared), so
 *    peers on one machine share the page cache rather than each holding a
 *    copy; nothing is copied. A mapped file must not be truncated while the
 *    corpus is loaded (reading a vanished page raises SIGBUS). A file whose
 *    name ends in ".bin", or whose first 4 bytes are the magic, must be a
 *    valid shard.
 *  - plain text (any other file): each byte is a token 0..255, converted
 *    once into an owned buffer (2 bytes per byte, at most TOKEN_MAX_TEXT_BYTES
 *    of text per corpus).
 * Loading reads every shard token once, to check it against the model's
 * vocabulary (an id past the embedding table would be read out of bounds);
 * on a large corpus that is one pass over the files, which also warms the
 * page cache for the next peer on the machine. A loaded corpus is read-only:
 * any number of threads and batchers may read it at once. Every host that
 * maps shards must be little-endian (checked at build time).
 */
#define TOKEN_SHARD_MAGIC 20240520
#define TOKEN_SHARD_VERSION 1
#define TOKEN_SHARD_HEADER_INTS 256
#define TOKEN_SHARD_HEADER_BYTES (TOKEN_SHARD_HEADER_INTS * 4)
/* Bounds checked before anything sized by the files is allocated. */
#define TOKEN_MAX_FILES 65536                   /* files of one corpus */
#define TOKEN_MAX_TOKENS (1LL << 38)            /* tokens of one corpus (512 GiB of shards) */
#define TOKEN_MAX_TEXT_BYTES (1LL << 30)        /* plain text of one corpus (2 GiB as tokens) */
#define TOKEN_MAX_CONTEXT (1LL << 20)           /* T */
#define TOKEN_MAX_WINDOWS (1LL << 28)           /* windows of one split (8 bytes each, per array) */
/* Where deploy/install-deps.sh puts the default corpus, the King James Bible
 * as plain text (deploy/make-corpus.sh writes it anywhere). */
#define TOKEN_DEFAULT_CORPUS "/usr/local/share/rumor/kjv.txt"

struct token_segment {
  const uint16_t *tokens; /* count tokens, read-only (mapped or owned by the corpus) */
  int64_t count;
  const char *path;       /* the file they come from (owned by the corpus) */
  int64_t offset;         /* index of tokens[0] among that file's tokens */
};

/* One split (training or validation): a view into its corpus's files. */
struct token_split {
  struct token_segment *segs;
  int64_t nsegs;
  int64_t ntokens; /* over all segments */
};

struct token_file; /* private: one loaded file (mapping or owned buffer) */

struct token_corpus {
  struct token_split train, val; /* val.nsegs == 0: no validation part */
  bool val_from_files;           /* val comes from files named *_val[_.]* */
  struct token_file *files;      /* what backs the segments (private) */
  int64_t nfiles;
};

/* Loads the corpus named by `spec` for a model with `vocab` token ids and a
 * context of `context` tokens:
 *  - a regular file: the one file (text or shard, above);
 *  - a directory: every "*.bin" file in it (names starting with '.' are
 *    skipped);
 *  - otherwise a glob(3) pattern: every regular file it matches.
 * Several files are taken in byte order of their paths (strcmp, not the
 * locale's collation, so every peer sees the same stream). Among them, files
 * whose name contains "_val" followed by '_' or '.' (llm.c's and nanoGPT's
 * naming: fineweb_val_000000.bin, tiny_shakespeare_val.bin) form the
 * validation split and the others the training split; `val_fraction` is then
 * unused. Otherwise (a single file, or no such names) the validation split is
 * the end of the token stream (all files concatenated in order): with
 * n tokens in all and v = round(n · val_fraction), validation is the last v
 * tokens [n − v, n) and training the first n − v; the file holding token
 * n − v is cut there into two segments. val_fraction is in [0, 1); 0 means no
 * validation split.
 *
 * Each split must hold at least one window of context+1 tokens in one segment
 * (an empty validation split is allowed when it is empty by choice:
 * val_fraction 0 and no _val files). 1 <= context <= TOKEN_MAX_CONTEXT;
 * vocab >= 1 (>= 256 for text).
 *
 * Returns 0 and fills `out` (free it with token_corpus_free), or fails with
 * `out` zeroed and a message naming the file (or pattern) and the fault:
 * RUMOR_ECORRUPT for a malformed shard (wrong magic, unsupported version,
 * truncated, bytes after the tokens, zero tokens, a token >= vocab: its value
 * and index), RUMOR_EFORMAT for an empty file, text with vocab < 256, a bad
 * argument, only validation files, or a split without a window (naming the
 * split, its longest segment's file and the counts), RUMOR_ENOTFOUND when
 * nothing matches, RUMOR_ETOOBIG past a TOKEN_MAX_ limit, a negative errno
 * when a file cannot be read. */
int token_corpus_load(struct token_corpus *out, const char *spec, int64_t vocab, int64_t context,
                      double val_fraction, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Unmaps and frees everything; the splits' segments are gone after this. */
void token_corpus_free(struct token_corpus *c);

/* Checks an llm.c token shard held in memory (`buf`, 2-byte aligned, `len`
 * bytes; `name` for messages) and returns its tokens, which point into buf.
 * Fails with RUMOR_ECORRUPT (wrong magic, truncated header, unsupported
 * version, negative or zero count, truncated tokens, trailing bytes, a token
 * >= vocab). */
int token_shard_parse(const void *buf, size_t len, const char *name, int64_t vocab, const uint16_t **tokens,
                      int64_t *count, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Windows of `context` (T) tokens in a split: the sum over its segments of
 * (count − 1) / T. */
int64_t token_split_windows(const struct token_split *s, int64_t context);
/* Gathers windows [first, first+rows) in order (segment by segment, for
 * evaluation): x and y are rows × T, y the window shifted by one. */
void token_split_gather(const struct token_split *s, int64_t context, int64_t first, int64_t rows, int32_t *x,
                        int32_t *y);

struct token_batcher {
  const struct token_split *split;
  int64_t context;         /* T */
  int64_t *win_first;      /* split->nsegs + 1 entries: global index of each segment's first window */
  struct shard_order rows; /* global window indices */
};

/* Picks this shard's windows: all windows of the split, permuted from
 * `data_seed` (the same on every peer), split into shard.count strided parts
 * (window perm[shard.index + k·shard.count]), so the shards are disjoint,
 * together hold every window once, and each is a random sample of the whole
 * split. Starts epoch 0. Fails with RUMOR_EFORMAT when the shard would be
 * empty, RUMOR_ETOOBIG past TOKEN_MAX_WINDOWS. The split must outlive b. */
int token_batcher_init(struct token_batcher *b, const struct token_split *split, int64_t context,
                       struct shard shard, uint64_t data_seed, uint64_t seed, struct rumor_err *e) RUMOR_MUST_CHECK;
void token_batcher_free(struct token_batcher *b);
/* Gathers batch number `step` of the current epoch: x and y are rows × T
 * (row r: window order[step·bs + r]; y[r][t] = x[r][t+1] within the window's
 * T+1 tokens). Returns the number of rows (<= bs). */
int64_t token_batcher_fill(const struct token_batcher *b, int64_t step, int64_t bs, int32_t *x, int32_t *y);

#endif /* RUMOR_PEER_DATA_H */
