/* Token corpora (plain text and llm.c shards from a file, a directory and a
 * glob), the validation split by name and by fraction, every load error, and
 * the window batcher: shards disjoint and complete, deterministic shuffles,
 * x/y offset by one, no window across a file boundary. Files are written to a
 * fresh temporary directory, removed after each test. */
#include <criterion/criterion.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "peer/data/data.h"

static char dir[64];

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-test-tok-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}
static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}
TestSuite(tokens, .init = setup, .fini = teardown);

static char *path_of(const char *name) {
  static char paths[16][256];
  static int which;
  char *path = paths[which++ % 16];
  snprintf(path, 256, "%s/%s", dir, name);
  return path;
}

static char *write_bytes(const char *name, const void *data, size_t n) {
  char *path = path_of(name);
  FILE *f = fopen(path, "wb");
  cr_assert_not_null(f, "cannot create %s", path);
  if (n) cr_assert_eq(fwrite(data, 1, n, f), n);
  cr_assert_eq(fclose(f), 0);
  return path;
}

static void put_le32(uint8_t *p, int32_t v) {
  uint32_t u = (uint32_t)v;
  p[0] = (uint8_t)u, p[1] = (uint8_t)(u >> 8), p[2] = (uint8_t)(u >> 16), p[3] = (uint8_t)(u >> 24);
}

/* A shard's bytes: the llm.c header (magic, version, declared count) and n
 * tokens, plus `extra` zero bytes. Caller frees. */
static uint8_t *shard_bytes(int32_t magic, int32_t version, int32_t declared, const uint16_t *tok, size_t n,
                            size_t extra, size_t *len) {
  *len = TOKEN_SHARD_HEADER_BYTES + 2 * n + extra;
  uint8_t *b = calloc(1, *len);
  cr_assert_not_null(b);
  put_le32(b, magic);
  put_le32(b + 4, version);
  put_le32(b + 8, declared);
  for (size_t i = 0; i < n; i++) {
    b[TOKEN_SHARD_HEADER_BYTES + 2 * i] = (uint8_t)tok[i];
    b[TOKEN_SHARD_HEADER_BYTES + 2 * i + 1] = (uint8_t)(tok[i] >> 8);
  }
  return b;
}

static char *write_shard_raw(const char *name, int32_t magic, int32_t version, int32_t declared, const uint16_t *tok,
                             size_t n, size_t extra) {
  size_t len;
  uint8_t *b = shard_bytes(magic, version, declared, tok, n, extra, &len);
  char *path = write_bytes(name, b, len);
  free(b);
  return path;
}

static char *write_shard(const char *name, const uint16_t *tok, size_t n) {
  return write_shard_raw(name, TOKEN_SHARD_MAGIC, TOKEN_SHARD_VERSION, (int32_t)n, tok, n, 0);
}

/* Tokens first, first+1, ... (mod 65536): a token names its position. */
static uint16_t *ramp(uint16_t *buf, size_t n, unsigned first) {
  for (size_t i = 0; i < n; i++) buf[i] = (uint16_t)(first + i);
  return buf;
}

static void load_ok(const char *spec, int64_t vocab, int64_t T, double frac, struct token_corpus *c) {
  struct rumor_err e = {0};
  int rc = token_corpus_load(c, spec, vocab, T, frac, &e);
  cr_assert_eq(rc, 0, "loading %s: %s", spec, e.msg);
}

/* The load must fail with `code` and a message holding every needle. */
static void expect_reject(const char *spec, int64_t vocab, int64_t T, double frac, int code, const char *n1,
                          const char *n2) {
  struct token_corpus c;
  struct rumor_err e = {0};
  int rc = token_corpus_load(&c, spec, vocab, T, frac, &e);
  cr_assert_neq(rc, 0, "%s should be rejected (%s)", spec, n2);
  cr_assert_eq(rc, code, "%s: code %d, expected %d (%s)", spec, rc, code, e.msg);
  cr_assert_eq(e.code, rc);
  cr_assert(strstr(e.msg, n1) != NULL, "message '%s' should mention '%s'", e.msg, n1);
  cr_assert(!n2 || strstr(e.msg, n2) != NULL, "message '%s' should mention '%s'", e.msg, n2);
  cr_assert(c.nfiles == 0 && c.files == NULL && c.train.segs == NULL, "a failed load leaves the corpus zeroed");
}

static bool mapped(const char *path) {
  FILE *f = fopen("/proc/self/maps", "r");
  cr_assert_not_null(f);
  char line[1024];
  bool found = false;
  while (!found && fgets(line, sizeof line, f)) found = strstr(line, path) != NULL;
  fclose(f);
  return found;
}

Test(tokens, text_bytes_become_tokens_and_need_a_vocabulary_of_256) {
  const uint8_t text[] = "In the beginning\xff\x00\x01 God";
  char *p = write_bytes("genesis.txt", text, sizeof text - 1);
  struct token_corpus c;
  load_ok(p, 256, 4, 0.0, &c);
  cr_assert_eq(c.nfiles, 1);
  cr_assert_eq(c.train.nsegs, 1);
  cr_assert_eq(c.train.ntokens, (int64_t)sizeof text - 1);
  cr_assert_eq(c.val.nsegs, 0, "val_fraction 0: no validation part");
  cr_assert_eq(c.val.ntokens, 0);
  for (size_t i = 0; i < sizeof text - 1; i++) cr_assert_eq(c.train.segs[0].tokens[i], text[i], "byte %zu", i);
  cr_assert_str_eq(c.train.segs[0].path, p);
  cr_assert(!mapped(p), "text is converted into an owned buffer, not kept mapped");
  token_corpus_free(&c);
  cr_assert_eq(c.nfiles, 0);

  expect_reject(p, 255, 4, 0.0, RUMOR_EFORMAT, p, "vocabulary of at least 256");
  expect_reject(p, 255, 4, 0.0, RUMOR_EFORMAT, "has 255", NULL);
  expect_reject(write_bytes("empty.txt", "", 0), 50257, 4, 0.0, RUMOR_EFORMAT, "empty.txt", "empty file");
}

Test(tokens, shards_load_from_a_file_a_directory_and_a_glob_mapped_in_name_order) {
  uint16_t a[300], b[200], v[150];
  ramp(a, 300, 1000), ramp(b, 200, 2000), ramp(v, 150, 3000);
  /* Written out of order: loading sorts by name. */
  char *pb = write_shard("corpus_train_000001.bin", b, 200);
  char *pa = write_shard("corpus_train_000000.bin", a, 300);
  char *pv = write_shard("corpus_val_000000.bin", v, 150);
  write_bytes("notes.txt", "not a shard", 11); /* a directory loads only *.bin */
  write_bytes(".hidden.bin", "junk", 4);       /* nor hidden files */

  struct token_corpus c;
  load_ok(pa, 50257, 16, 0.0, &c);
  cr_assert_eq(c.nfiles, 1);
  cr_assert_eq(c.train.ntokens, 300);
  cr_assert_eq(memcmp(c.train.segs[0].tokens, a, sizeof a), 0);
  cr_assert(mapped(pa), "a shard is used in place, mapped");
  token_corpus_free(&c);
  cr_assert(!mapped(pa), "freeing the corpus unmaps its shards");

  load_ok(dir, 50257, 16, 0.0, &c);
  cr_assert_eq(c.nfiles, 3);
  cr_assert(c.val_from_files);
  cr_assert_eq(c.train.nsegs, 2);
  cr_assert_str_eq(c.train.segs[0].path, pa);
  cr_assert_str_eq(c.train.segs[1].path, pb);
  cr_assert_eq(memcmp(c.train.segs[1].tokens, b, sizeof b), 0);
  cr_assert_eq(c.train.ntokens, 500);
  cr_assert_eq(c.val.nsegs, 1);
  cr_assert_str_eq(c.val.segs[0].path, pv);
  cr_assert_eq(memcmp(c.val.segs[0].tokens, v, sizeof v), 0);
  token_corpus_free(&c);

  char pattern[256];
  snprintf(pattern, sizeof pattern, "%s/corpus_train_*.bin", dir);
  load_ok(pattern, 50257, 16, 0.0, &c);
  cr_assert_eq(c.nfiles, 2);
  cr_assert(!c.val_from_files);
  cr_assert_eq(c.val.nsegs, 0);
  cr_assert_str_eq(c.train.segs[0].path, pa);
  cr_assert_str_eq(c.train.segs[1].path, pb);
  token_corpus_free(&c);
}

Test(tokens, validation_files_are_chosen_by_llm_c_and_nanogpt_names) {
  uint16_t t[100];
  ramp(t, 100, 0);
  const char *val[] = {"fineweb_val_000000.bin", "tiny_shakespeare_val.bin"};
  const char *train[] = {"fineweb_train_000001.bin", "interval_x.bin", "my_values.bin", "tiny_shakespeare_train.bin",
                         "x_valid.bin", "x_val"};
  for (size_t i = 0; i < 2; i++) write_shard(val[i], t, 100);
  for (size_t i = 0; i < 6; i++) write_shard(train[i], t, 100);
  char pattern[256];
  snprintf(pattern, sizeof pattern, "%s/*", dir);
  struct token_corpus c;
  load_ok(pattern, 50257, 8, 0.5, &c); /* val_fraction is unused when _val files exist */
  cr_assert(c.val_from_files);
  cr_assert_eq(c.val.nsegs, 2);
  cr_assert_eq(c.train.nsegs, 6);
  cr_assert_eq(c.val.ntokens, 200);
  cr_assert_eq(c.train.ntokens, 600);
  for (int64_t i = 0; i < c.val.nsegs; i++) cr_assert(strstr(c.val.segs[i].path, "_val") != NULL);
  /* byte order: "fineweb_val_..." < "tiny_shakespeare_val.bin" */
  cr_assert(strstr(c.val.segs[0].path, val[0]) && strstr(c.val.segs[1].path, val[1]));
  token_corpus_free(&c);

  /* A single file is split by fraction whatever its name. */
  load_ok(path_of(val[0]), 50257, 8, 0.2, &c);
  cr_assert(!c.val_from_files);
  cr_assert_eq(c.train.ntokens, 80);
  cr_assert_eq(c.val.ntokens, 20);
  token_corpus_free(&c);
}

Test(tokens, the_validation_fraction_holds_out_exactly_the_rounded_tail_of_the_stream) {
  uint8_t text[1000];
  for (int i = 0; i < 1000; i++) text[i] = (uint8_t)('a' + i % 26);
  char *p = write_bytes("t.txt", text, 1000);
  struct token_corpus c;
  load_ok(p, 256, 16, 0.1, &c);
  cr_assert_eq(c.train.nsegs, 1);
  cr_assert_eq(c.train.ntokens, 900);
  cr_assert_eq(c.val.nsegs, 1);
  cr_assert_eq(c.val.ntokens, 100);
  cr_assert_eq(c.val.segs[0].offset, 900);
  cr_assert_eq(c.val.segs[0].tokens, c.train.segs[0].tokens + 900, "the two parts share the one buffer");
  token_corpus_free(&c);

  /* 100 tokens · 0.29 = 28.999999999999996 in doubles: rounded, not truncated. */
  char *q = write_bytes("h.txt", text, 100);
  load_ok(q, 256, 4, 0.29, &c);
  cr_assert_eq(c.val.ntokens, 29);
  cr_assert_eq(c.train.ntokens, 71);
  token_corpus_free(&c);

  /* Across files (no _val names): 600 + 400 tokens, half held out. The first
   * file is cut at 500; the validation part is its last 100 and the second
   * file. */
  uint16_t a[600], b[400];
  char *pa = write_shard("part_a.bin", ramp(a, 600, 0), 600);
  char *pb = write_shard("part_b.bin", ramp(b, 400, 600), 400);
  char pattern[256];
  snprintf(pattern, sizeof pattern, "%s/part_*.bin", dir);
  load_ok(pattern, 50257, 16, 0.5, &c);
  cr_assert_eq(c.train.nsegs, 1);
  cr_assert_eq(c.train.segs[0].count, 500);
  cr_assert_str_eq(c.train.segs[0].path, pa);
  cr_assert_eq(c.val.nsegs, 2);
  cr_assert(c.val.segs[0].count == 100 && c.val.segs[0].offset == 500 && c.val.segs[0].tokens[0] == 500);
  cr_assert_str_eq(c.val.segs[0].path, pa);
  cr_assert(c.val.segs[1].count == 400 && c.val.segs[1].offset == 0 && c.val.segs[1].tokens[0] == 600);
  cr_assert_str_eq(c.val.segs[1].path, pb);
  token_corpus_free(&c);

  /* A cut on a file boundary leaves no empty segment. */
  load_ok(pattern, 50257, 16, 0.4, &c);
  cr_assert_eq(c.train.nsegs, 1);
  cr_assert_eq(c.val.nsegs, 1);
  cr_assert_str_eq(c.val.segs[0].path, pb);
  token_corpus_free(&c);
}

Test(tokens, malformed_shards_are_rejected_naming_the_file_and_the_fault) {
  uint16_t t[64];
  ramp(t, 64, 100);
  char *p;
  p = write_shard_raw("magic.bin", 20240521, 1, 64, t, 64, 0);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "wrong magic 20240521");
  p = write_bytes("text-named.bin", "plain text in a .bin file", 25);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "wrong magic");
  p = write_bytes("tiny.bin", "ab", 2);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "truncated header");
  p = write_shard_raw("version.bin", TOKEN_SHARD_MAGIC, 2, 64, t, 64, 0);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "unsupported shard version 2");
  p = write_shard_raw("trunc.bin", TOKEN_SHARD_MAGIC, 1, 65, t, 64, 0);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "truncated: the header declares 65 tokens");
  p = write_shard_raw("trunc-odd.bin", TOKEN_SHARD_MAGIC, 1, 64, t, 64, 0);
  cr_assert_eq(truncate(p, TOKEN_SHARD_HEADER_BYTES + 127), 0, "truncate %s", p);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "truncated");
  p = write_shard_raw("long.bin", TOKEN_SHARD_MAGIC, 1, 64, t, 64, 3);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "3 bytes after the 64 tokens");
  p = write_shard_raw("zero.bin", TOKEN_SHARD_MAGIC, 1, 0, t, 0, 0);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "zero tokens");
  p = write_shard_raw("negative.bin", TOKEN_SHARD_MAGIC, 1, -5, t, 0, 0);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "negative");
  /* header only, and the magic in a file not named .bin: still a shard */
  p = write_shard_raw("hdr-only.dat", TOKEN_SHARD_MAGIC, 1, 64, t, 0, 0);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "truncated");
  p = write_bytes("empty.bin", "", 0);
  expect_reject(p, 50257, 8, 0, RUMOR_EFORMAT, p, "empty file");

  /* A token outside the model's vocabulary: its value and index. */
  uint16_t big[200];
  ramp(big, 200, 0);
  big[137] = 50257;
  p = write_shard("vocab.bin", big, 200);
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, p, "token 50257 at index 137");
  expect_reject(p, 50257, 8, 0, RUMOR_ECORRUPT, "vocabulary of 50257", NULL);
  struct token_corpus c;
  load_ok(p, 50258, 8, 0, &c); /* one more id and it fits */
  token_corpus_free(&c);
  big[137] = 65535;
  p = write_shard("vocab-max.bin", big, 200);
  load_ok(p, 65536, 8, 0, &c);
  token_corpus_free(&c);
  expect_reject(p, 200, 8, 0, RUMOR_ECORRUPT, "token 65535 at index 137", NULL);
}

Test(tokens, specs_that_match_nothing_and_bad_arguments_are_rejected) {
  char spec[256];
  snprintf(spec, sizeof spec, "%s/fineweb_*.bin", dir);
  expect_reject(spec, 50257, 8, 0, RUMOR_ENOTFOUND, spec, "no files match");
  expect_reject(dir, 50257, 8, 0, RUMOR_ENOTFOUND, dir, "no *.bin");
  expect_reject("/nonexistent/rumor/corpus.bin", 50257, 8, 0, -ENOENT, "/nonexistent/rumor/corpus.bin", NULL);
  mkdir(path_of("sub.bin"), 0700); /* a directory named like a shard is not one */
  expect_reject(dir, 50257, 8, 0, RUMOR_ENOTFOUND, dir, "no *.bin");

  uint16_t t[100];
  char *p = write_shard("only_val.bin", ramp(t, 100, 0), 100);
  expect_reject(dir, 50257, 8, 0, RUMOR_EFORMAT, dir, "every file is a validation file");
  expect_reject(p, 50257, 0, 0, RUMOR_EFORMAT, p, "context 0");
  expect_reject(p, 0, 8, 0, RUMOR_EFORMAT, p, "vocabulary");
  expect_reject(p, 50257, 8, 1.0, RUMOR_EFORMAT, p, "validation fraction 1");
  expect_reject(p, 50257, 8, -0.1, RUMOR_EFORMAT, p, "validation fraction");
  expect_reject(p, 50257, 8, NAN, RUMOR_EFORMAT, p, "validation fraction");
  expect_reject("", 50257, 8, 0, RUMOR_EFORMAT, "no token corpus", NULL);
}

/* `--data FIFO` blocked in open(2) for ever; a FIFO named directly (or by
 * a glob, whose matches must be regular files) is refused at once. The
 * timeout turns a regression into a failure rather than a hung suite. */
Test(tokens, a_fifo_is_refused_at_once_naming_it, .timeout = 10) {
  char *p = path_of("pipe.bin");
  cr_assert_eq(mkfifo(p, 0600), 0);
  expect_reject(p, 50257, 8, 0, -EINVAL, p, "is not a regular file (it is a FIFO)");
  char *t = path_of("pipe.txt");
  cr_assert_eq(mkfifo(t, 0600), 0);
  expect_reject(t, 256, 8, 0, -EINVAL, t, "is not a regular file (it is a FIFO)");
  char spec[256];
  snprintf(spec, sizeof spec, "%s/pipe.*", dir);
  expect_reject(spec, 256, 8, 0, RUMOR_ENOTFOUND, spec, "no regular files match");
}

Test(tokens, a_context_longer_than_a_split_is_rejected_naming_split_file_and_counts) {
  uint16_t t[100];
  char *p = write_shard("small.bin", ramp(t, 100, 0), 100);
  struct token_corpus c;
  load_ok(p, 50257, 99, 0.0, &c); /* 100 tokens: exactly one window of 99 + 1 */
  cr_assert_eq(token_split_windows(&c.train, 99), 1);
  token_corpus_free(&c);
  expect_reject(p, 50257, 100, 0.0, RUMOR_EFORMAT, "training split has no window of 101 tokens",
                "longest segment has 100 tokens, from");
  expect_reject(p, 50257, 100, 0.0, RUMOR_EFORMAT, "small.bin (100 tokens in the split)", NULL);
  /* val 20 tokens: too few for a context of 32; train (80) is enough */
  expect_reject(p, 50257, 32, 0.2, RUMOR_EFORMAT, "validation split has no window of 33 tokens",
                "has 20 tokens, from");
  load_ok(p, 50257, 19, 0.2, &c);
  cr_assert_eq(token_split_windows(&c.val, 19), 1);
  token_corpus_free(&c);
  /* A fraction so small that it rounds to no token at all. */
  expect_reject(p, 50257, 8, 0.001, RUMOR_EFORMAT, "the validation split is empty", p);

  /* Files each shorter than a window: no window, though the total is enough. */
  write_shard("f1.bin", t, 40), write_shard("f2.bin", t, 40);
  expect_reject(dir, 50257, 100, 0.0, RUMOR_EFORMAT, "training split has no window of 101",
                "(180 tokens in the split)");
  /* A validation file too short, while training is fine */
  write_shard("x_val.bin", t, 10);
  expect_reject(dir, 50257, 20, 0.0, RUMOR_EFORMAT, "validation split has no window of 21",
                "x_val.bin (10 tokens in the split)");
}

/* Tokens of file f at position i: (f << 12) | i, so a token names its file
 * and place. */
static struct token_corpus three_files(int64_t T, const int *sizes) {
  static uint16_t buf[4096];
  for (int f = 0; f < 3; f++) {
    for (int i = 0; i < sizes[f]; i++) buf[i] = (uint16_t)(((f + 1) << 12) | i);
    char name[32];
    snprintf(name, sizeof name, "seg%d.bin", f);
    write_shard(name, buf, (size_t)sizes[f]);
  }
  struct token_corpus c;
  load_ok(dir, 65536, T, 0.0, &c);
  return c;
}

/* Checks a window's rows: one file, consecutive positions, y = x shifted by
 * one, start a multiple of T; returns the window's key (file << 12 | start). */
static int check_window(const int32_t *x, const int32_t *y, int64_t T) {
  int file = x[0] >> 12, start = x[0] & 0xfff;
  cr_assert(file >= 1 && file <= 3, "token %d", x[0]);
  cr_assert_eq(start % T, 0, "window starts at %d, not a multiple of %lld", start, (long long)T);
  for (int64_t t = 0; t < T; t++) {
    cr_assert_eq(x[t], x[0] + t, "x[%lld] = %d: the window crosses a file boundary or skips", (long long)t, x[t]);
    cr_assert_eq(y[t], x[t] + 1, "y[%lld] = %d, x[%lld] = %d: y is not x shifted by one", (long long)t, y[t],
                 (long long)t, x[t]);
  }
  return x[0];
}

Test(tokens, windows_stride_by_the_context_and_never_cross_a_file) {
  const int sizes[3] = {10, 13, 4};
  struct token_corpus c = three_files(4, sizes);
  /* (10-1)/4 + (13-1)/4 + (4-1)/4 = 2 + 3 + 0 */
  cr_assert_eq(token_split_windows(&c.train, 4), 5);
  int32_t x[5 * 4], y[5 * 4];
  token_split_gather(&c.train, 4, 0, 5, x, y);
  const int want[5] = {1 << 12 | 0, 1 << 12 | 4, 2 << 12 | 0, 2 << 12 | 4, 2 << 12 | 8};
  for (int r = 0; r < 5; r++) cr_assert_eq(check_window(x + 4 * r, y + 4 * r, 4), want[r], "window %d", r);
  /* a gather from the middle, across a segment boundary */
  token_split_gather(&c.train, 4, 1, 3, x, y);
  for (int r = 0; r < 3; r++) cr_assert_eq(check_window(x + 4 * r, y + 4 * r, 4), want[r + 1]);
  token_split_gather(&c.train, 4, 4, 1, x, y);
  cr_assert_eq(x[0], want[4]);
  token_corpus_free(&c);
}

/* Every window of every shard over one epoch, counted by key. */
static void check_shards_cover_once(const struct token_corpus *c, int64_t T, int n, int64_t epoch) {
  static int seen[4 << 12];
  memset(seen, 0, sizeof seen);
  int64_t total = token_split_windows(&c->train, T), bs = 5, got = 0;
  int32_t *x = calloc((size_t)(bs * T), sizeof *x), *y = calloc((size_t)(bs * T), sizeof *y);
  for (int s = 0; s < n; s++) {
    struct token_batcher b;
    struct rumor_err e;
    cr_assert_eq(token_batcher_init(&b, &c->train, T, (struct shard){s, n}, 11, 12, &e), 0, "%s", e.msg);
    cr_assert_eq(b.rows.n, total / n + (s < total % n), "shard %d/%d holds %lld windows", s, n, (long long)b.rows.n);
    shard_order_start_epoch(&b.rows, epoch);
    int64_t steps = shard_order_steps(&b.rows, bs);
    for (int64_t step = 0; step < steps; step++) {
      int64_t rows = token_batcher_fill(&b, step, bs, x, y);
      cr_assert_eq(rows, step < steps - 1 ? bs : b.rows.n - (steps - 1) * bs, "rows of step %lld", (long long)step);
      for (int64_t r = 0; r < rows; r++) seen[check_window(x + r * T, y + r * T, T)]++;
      got += rows;
    }
    token_batcher_free(&b);
  }
  cr_assert_eq(got, total);
  int64_t distinct = 0;
  for (int k = 0; k < (4 << 12); k++) {
    cr_assert(seen[k] <= 1, "window %#x seen %d times with %d shards", k, seen[k], n);
    distinct += seen[k];
  }
  cr_assert_eq(distinct, total, "%d shards cover %lld of %lld windows", n, (long long)distinct, (long long)total);
  free(x);
  free(y);
}

Test(tokens, shards_are_disjoint_and_cover_every_window_once_per_epoch) {
  const int sizes[3] = {1000, 2049, 777};
  struct token_corpus c = three_files(8, sizes);
  cr_assert_eq(token_split_windows(&c.train, 8), 999 / 8 + 2048 / 8 + 776 / 8);
  for (int n = 1; n <= 4; n++) {
    if (n == 2) continue;
    check_shards_cover_once(&c, 8, n, 0);
    check_shards_cover_once(&c, 8, n, 3);
  }
  token_corpus_free(&c);
}

static int64_t *epoch_order(const struct token_split *s, struct shard sh, uint64_t seed, int64_t epoch, int64_t *n) {
  struct token_batcher b;
  struct rumor_err e;
  cr_assert_eq(token_batcher_init(&b, s, 8, sh, 5, seed, &e), 0, "%s", e.msg);
  shard_order_start_epoch(&b.rows, epoch);
  int64_t *o = malloc((size_t)b.rows.n * sizeof *o);
  memcpy(o, b.rows.order, (size_t)b.rows.n * sizeof *o);
  *n = b.rows.n;
  token_batcher_free(&b);
  return o;
}

Test(tokens, shuffles_are_deterministic_in_seed_epoch_and_shard) {
  const int sizes[3] = {1000, 2049, 777};
  struct token_corpus c = three_files(8, sizes);
  int64_t n1, n2;
  int64_t *a = epoch_order(&c.train, (struct shard){1, 3}, 9, 4, &n1);
  int64_t *b = epoch_order(&c.train, (struct shard){1, 3}, 9, 4, &n2);
  cr_assert_eq(n1, n2);
  cr_assert_eq(memcmp(a, b, (size_t)n1 * sizeof *a), 0, "the same (seed, epoch, shard) gave another order");
  free(b);
  b = epoch_order(&c.train, (struct shard){1, 3}, 9, 5, &n2);
  cr_assert_neq(memcmp(a, b, (size_t)n1 * sizeof *a), 0, "epochs 4 and 5 have the same order");
  free(b);
  b = epoch_order(&c.train, (struct shard){1, 3}, 10, 4, &n2);
  cr_assert_neq(memcmp(a, b, (size_t)n1 * sizeof *a), 0, "seeds 9 and 10 have the same order");
  free(b);
  /* A shard is a random sample of the corpus, not one contiguous region: shard
   * 0 of 3 holds windows of every file. */
  struct token_batcher tb;
  struct rumor_err e;
  cr_assert_eq(token_batcher_init(&tb, &c.train, 8, (struct shard){0, 3}, 5, 9, &e), 0, "%s", e.msg);
  bool file_seen[3] = {false};
  for (int64_t i = 0; i < tb.rows.n; i++) {
    int64_t w = tb.rows.base[i];
    file_seen[w < tb.win_first[1] ? 0 : w < tb.win_first[2] ? 1 : 2] = true;
  }
  cr_assert(file_seen[0] && file_seen[1] && file_seen[2]);
  /* the base is not in window order */
  bool sorted = true;
  for (int64_t i = 1; i < tb.rows.n; i++) sorted &= tb.rows.base[i] > tb.rows.base[i - 1];
  cr_assert(!sorted, "shard 0/3 is the windows in order");
  token_batcher_free(&tb);
  free(a);
  token_corpus_free(&c);
}

Test(tokens, the_last_batch_is_short_and_an_empty_shard_is_refused) {
  const int sizes[3] = {41, 41, 41}; /* 5 windows of 8 each */
  struct token_corpus c = three_files(8, sizes);
  struct token_batcher b;
  struct rumor_err e;
  cr_assert_eq(token_batcher_init(&b, &c.train, 8, (struct shard){0, 1}, 1, 2, &e), 0, "%s", e.msg);
  cr_assert_eq(b.rows.n, 15);
  cr_assert_eq(shard_order_steps(&b.rows, 4), 4);
  int32_t x[4 * 8], y[4 * 8];
  cr_assert_eq(token_batcher_fill(&b, 0, 4, x, y), 4);
  cr_assert_eq(token_batcher_fill(&b, 3, 4, x, y), 3);
  cr_assert_eq(shard_order_steps(&b.rows, 15), 1);
  cr_assert_eq(shard_order_steps(&b.rows, 16), 1);
  token_batcher_free(&b);
  cr_assert_eq(token_batcher_init(&b, &c.train, 8, (struct shard){15, 16}, 1, 2, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "shard 15/16 of 15 windows") != NULL, "%s", e.msg);
  token_corpus_free(&c);
}

Test(tokens, shard_parse_works_from_memory) {
  uint16_t t[3] = {1, 2, 50256};
  size_t len;
  uint8_t *b = shard_bytes(TOKEN_SHARD_MAGIC, 1, 3, t, 3, 0, &len);
  const uint16_t *tok;
  int64_t n;
  struct rumor_err e;
  cr_assert_eq(token_shard_parse(b, len, "mem", 50257, &tok, &n, &e), 0, "%s", e.msg);
  cr_assert(n == 3 && tok == (const uint16_t *)(b + TOKEN_SHARD_HEADER_BYTES) && tok[2] == 50256);
  cr_assert_eq(token_shard_parse(b, len, "mem", 50256, &tok, &n, &e), RUMOR_ECORRUPT);
  cr_assert(strstr(e.msg, "mem: token 50256 at index 2") != NULL, "%s", e.msg);
  cr_assert_eq(token_shard_parse(b, len - 1, "mem", 50257, &tok, &n, &e), RUMOR_ECORRUPT);
  cr_assert_eq(token_shard_parse(b, 3, "mem", 50257, &tok, &n, &e), RUMOR_ECORRUPT);
  cr_assert_eq(token_shard_parse(NULL, 0, "mem", 50257, &tok, &n, &e), RUMOR_ECORRUPT);
  free(b);
}

/* The default corpus: the King James Bible from Debian's bible-kjv, as
 * written by deploy/install-deps.sh (or by deploy/make-corpus.sh here). */
Test(tokens, the_default_corpus_loads_as_several_megabytes_of_text) {
  const char *p = TOKEN_DEFAULT_CORPUS;
  struct stat st;
  if (stat(p, &st) != 0 || st.st_size == 0) {
    if (system("command -v bible >/dev/null 2>&1") != 0)
      cr_skip_test("no default corpus: %s is missing and `bible` (Debian's bible-kjv) is not on PATH", p);
    p = path_of("kjv.txt");
    char cmd[512];
    snprintf(cmd, sizeof cmd, "sh %s/deploy/make-corpus.sh %s", RUMOR_SOURCE_DIR, p);
    cr_assert_eq(system(cmd), 0, "%s failed", cmd);
  }
  struct token_corpus c;
  load_ok(p, 50257, 1024, 0.1, &c);
  int64_t n = c.train.ntokens + c.val.ntokens;
  cr_assert(n > 4000000 && n < 6000000, "%s holds %lld tokens (the KJV is about 4.3 MB)", p, (long long)n);
  cr_assert_eq(c.val.ntokens, (int64_t)llround((double)n * 0.1));
  const char *gen = "In the beginning God created the heaven and the earth.";
  bool found = false;
  for (int64_t i = 0; i + 60 < c.train.ntokens && i < 1000 && !found; i++) {
    found = true;
    for (size_t k = 0; gen[k] && found; k++) found = c.train.segs[0].tokens[i + (int64_t)k] == (uint8_t)gen[k];
  }
  cr_assert(found, "%s does not start with Genesis 1:1", p);
  token_corpus_free(&c);
}
