/* The IDX reader on good and bad files (plain and gzip, and a FIFO),
 * sharding and the deterministic shuffle. Files are written to a fresh
 * temporary directory. */
#include <criterion/criterion.h>
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#include "peer/data/data.h"

static char dir[64];

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-test-ds-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}
static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}
TestSuite(dataset, .init = setup, .fini = teardown);

static void put_be32(uint8_t *p, uint32_t v) {
  p[0] = (uint8_t)(v >> 24), p[1] = (uint8_t)(v >> 16), p[2] = (uint8_t)(v >> 8), p[3] = (uint8_t)v;
}

/* Writes bytes to dir/name, gzip-compressed when gz. Returns the path. */
static char *write_file(const char *name, const uint8_t *data, size_t n, bool gz) {
  static char paths[8][256];
  static int which;
  char *path = paths[which++ % 8];
  snprintf(path, 256, "%s/%s", dir, name);
  if (gz) {
    gzFile f = gzopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(gzwrite(f, data, (unsigned)n), (int)n);
    cr_assert_eq(gzclose(f), Z_OK);
  } else {
    FILE *f = fopen(path, "wb");
    cr_assert_not_null(f);
    cr_assert_eq(fwrite(data, 1, n, f), n);
    fclose(f);
  }
  return path;
}

/* An images file of `count` r×c images, pixel = (i*7 + j) & 255. */
static size_t make_images(uint8_t *buf, uint32_t magic, uint32_t count, uint32_t r, uint32_t c) {
  put_be32(buf, magic);
  put_be32(buf + 4, count);
  put_be32(buf + 8, r);
  put_be32(buf + 12, c);
  for (size_t i = 0; i < (size_t)count * r * c; i++) buf[16 + i] = (uint8_t)((i * 7) & 255);
  return 16 + (size_t)count * r * c;
}

static size_t make_labels(uint8_t *buf, uint32_t magic, uint32_t count) {
  put_be32(buf, magic);
  put_be32(buf + 4, count);
  for (uint32_t i = 0; i < count; i++) buf[8 + i] = (uint8_t)(i % 10);
  return 8 + count;
}

static uint8_t img[16 + 100 * 28 * 28 + 64], lab[8 + 100 + 64];

static int load(const char *ip, const char *lp, struct dataset *ds, struct rumor_err *e) {
  return dataset_load(ip, lp, ds, e);
}

Test(dataset, reads_plain_and_gzip_files_identically) {
  size_t ni = make_images(img, 0x803, 100, 28, 28), nl = make_labels(lab, 0x801, 100);
  for (int gz = 0; gz < 2; gz++) {
    char *ip = write_file(gz ? "i.gz" : "i", img, ni, gz), *lp = write_file(gz ? "l.gz" : "l", lab, nl, gz);
    struct dataset ds;
    struct rumor_err e;
    cr_assert_eq(load(ip, lp, &ds, &e), 0, "%s", e.msg);
    cr_assert_eq(ds.count, 100);
    cr_assert_eq(ds.features, 784);
    cr_assert_eq(ds.num_classes, 10);
    cr_assert_eq(memcmp(ds.pixels, img + 16, 100 * 784), 0);
    cr_assert_eq(memcmp(ds.labels, lab + 8, 100), 0);
    dataset_free(&ds);
  }
}

static void expect_reject(const char *ip, const char *lp, const char *needle) {
  struct dataset ds;
  struct rumor_err e = {0};
  int rc = load(ip, lp, &ds, &e);
  cr_assert_neq(rc, 0, "should be rejected (%s)", needle);
  cr_assert(strstr(e.msg, needle) != NULL, "message '%s' should mention '%s'", e.msg, needle);
}

Test(dataset, rejects_wrong_magic_truncation_trailing_bytes_and_count_mismatch) {
  size_t ni = make_images(img, 0x803, 100, 28, 28), nl = make_labels(lab, 0x801, 100);
  char *good_i = write_file("good-i", img, ni, false), *good_l = write_file("good-l", lab, nl, false);

  make_images(img, 0x804, 100, 28, 28);
  expect_reject(write_file("magic-i", img, ni, false), good_l, "wrong IDX magic");
  make_images(img, 0x803, 100, 28, 28);
  expect_reject(good_i, good_i, "wrong IDX magic"); /* images file given as labels */

  expect_reject(write_file("trunc-i", img, ni - 1, false), good_l, "truncated");
  expect_reject(write_file("trunc-i.gz", img, ni - 500, true), good_l, "truncated");
  expect_reject(write_file("hdr-i", img, 10, false), good_l, "truncated IDX header");
  img[ni] = 1;
  expect_reject(write_file("long-i", img, ni + 1, false), good_l, "trailing bytes");

  make_labels(lab, 0x801, 99);
  expect_reject(good_i, write_file("l99", lab, nl - 1, false), "100 images but");

  /* A header claiming 4 G images in a tiny file: rejected without allocating them. */
  put_be32(img + 4, 0xffffffffu);
  expect_reject(write_file("huge-i", img, 64, false), good_l, "exceeds");
  put_be32(img + 4, 100);
  put_be32(img + 8, 0);
  expect_reject(write_file("zero-i", img, ni, false), good_l, "zero");

  /* Corrupt gzip stream. */
  make_images(img, 0x803, 100, 28, 28);
  char *gz = write_file("bad.gz", img, ni, true);
  FILE *f = fopen(gz, "r+b");
  cr_assert_not_null(f);
  fseek(f, 40, SEEK_SET);
  uint8_t junk[64];
  memset(junk, 0xa5, sizeof junk);
  fwrite(junk, 1, sizeof junk, f);
  fclose(f);
  struct dataset ds;
  struct rumor_err e;
  cr_assert_neq(load(gz, good_l, &ds, &e), 0, "corrupt gzip accepted");

  expect_reject("/nonexistent/rumor/images", good_l, "/nonexistent/rumor/images");
}

/* An IDX file that is a FIFO used to be checked by stat(2) before gzopen
 * (a FIFO swapped in between would block); the file is now opened without
 * blocking, checked, then handed to zlib. Refused at once, named. */
Test(dataset, a_fifo_as_an_idx_file_is_refused_at_once, .timeout = 10) {
  size_t nl = make_labels(lab, 0x801, 100);
  char *good_l = write_file("train-labels-idx1-ubyte", lab, nl, false);
  char fifo[256];
  snprintf(fifo, sizeof fifo, "%s/train-images-idx3-ubyte", dir);
  cr_assert_eq(mkfifo(fifo, 0600), 0);
  expect_reject(fifo, good_l, "is not a regular file (it is a FIFO)");
  expect_reject(fifo, good_l, fifo);
  struct dataset ds;
  struct rumor_err e = {0};
  cr_assert_eq(dataset_load_split(dir, "train", &ds, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, fifo), "%s", e.msg);
}

Test(dataset, load_split_names_the_missing_file) {
  struct dataset ds;
  struct rumor_err e;
  cr_assert_neq(dataset_load_split(dir, "train", &ds, &e), 0);
  cr_assert(strstr(e.msg, "train-images-idx3-ubyte") != NULL, "%s", e.msg);
  cr_assert_neq(dataset_load_split("/nonexistent-dir", "train", &ds, &e), 0);
  cr_assert(strstr(e.msg, "/nonexistent-dir") != NULL, "%s", e.msg);
}

Test(dataset, shards_are_disjoint_complete_and_shuffles_deterministic) {
  size_t ni = make_images(img, 0x803, 100, 28, 28), nl = make_labels(lab, 0x801, 100);
  struct dataset ds;
  struct rumor_err e;
  cr_assert_eq(load(write_file("i", img, ni, false), write_file("l", lab, nl, false), &ds, &e), 0, "%s", e.msg);
  int seen[100] = {0};
  int64_t total = 0;
  for (int s = 0; s < 3; s++) {
    struct batcher b;
    cr_assert_eq(batcher_init(&b, &ds, (struct shard){s, 3}, 7, 9, 0.5, 0.25, &e), 0, "%s", e.msg);
    total += b.rows.n;
    for (int64_t i = 0; i < b.rows.n; i++) seen[b.rows.base[i]]++;
    /* same (seed, epoch) → same order; another epoch → another order */
    int64_t *o1 = xmalloc((size_t)b.rows.n * sizeof *o1);
    shard_order_start_epoch(&b.rows, 4);
    memcpy(o1, b.rows.order, (size_t)b.rows.n * sizeof *o1);
    shard_order_start_epoch(&b.rows, 5);
    bool differs = memcmp(o1, b.rows.order, (size_t)b.rows.n * sizeof *o1) != 0;
    shard_order_start_epoch(&b.rows, 4);
    cr_assert_eq(memcmp(o1, b.rows.order, (size_t)b.rows.n * sizeof *o1), 0, "epoch shuffle not reproducible");
    cr_assert(differs, "epochs 4 and 5 have the same order");
    /* a batch is normalised pixels and labels of the ordered samples */
    float x[10 * 784];
    int32_t y[10];
    int64_t rows = batcher_fill(&b, 0, 10, x, y);
    cr_assert_eq(rows, 10);
    int64_t idx = b.rows.order[0];
    cr_assert_eq(y[0], ds.labels[idx]);
    cr_assert_float_eq(x[5], (float)((ds.pixels[idx * 784 + 5] / 255.0 - 0.5) / 0.25), 1e-6);
    cr_assert_eq(shard_order_steps(&b.rows, 10), (b.rows.n + 9) / 10);
    free(o1);
    batcher_free(&b);
  }
  cr_assert_eq(total, 100);
  for (int i = 0; i < 100; i++) cr_assert_eq(seen[i], 1, "sample %d is in %d shards", i, seen[i]);
  dataset_free(&ds);
}

Test(dataset, shard_parse_accepts_and_rejects) {
  struct shard s;
  struct rumor_err e;
  cr_assert_eq(shard_parse("2/4", &s, &e), 0);
  cr_assert(s.index == 2 && s.count == 4);
  const char *bad[] = {"4/4", "-1/4", "1/0", "1", "a/b", "1/4x", "/4", ""};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++)
    cr_assert_eq(shard_parse(bad[i], &s, &e), RUMOR_EFORMAT, "'%s' accepted", bad[i]);
}
