/* util/tfevents: CRC32C, the TFRecord framing and the Event encoding, read
 * back by the independent reader in tests/support/tfevents_read.h; a
 * corrupted byte caught by the reader's CRC checks; clear errors for paths
 * that cannot be created; a write error that leaves whole records. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "../support/tfevents_read.h"
#include "util/tfevents.h"

static char dir[64];

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-test-tb-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "cannot remove %s\n", dir);
}

static uint8_t *slurp(const char *path, size_t *n) {
  FILE *f = fopen(path, "rb");
  cr_assert_not_null(f, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long len = ftell(f);
  rewind(f);
  uint8_t *buf = malloc((size_t)len + 1);
  cr_assert_eq(fread(buf, 1, (size_t)len, f), (size_t)len);
  fclose(f);
  *n = (size_t)len;
  return buf;
}

Test(tfevents, crc32c_matches_the_standard_test_vector) {
  cr_assert_eq(tb_crc32c(0, "123456789", 9), 0xE3069283u, "got %08x", tb_crc32c(0, "123456789", 9));
  /* Continued over two pieces, the same. */
  cr_assert_eq(tb_crc32c(tb_crc32c(0, "1234", 4), "56789", 5), 0xE3069283u);
  cr_assert_eq(tfr_crc32c((const uint8_t *)"123456789", 9), 0xE3069283u, "the test's reader disagrees");
  /* 32 zero bytes: the other vector of RFC 3720 (iSCSI), B.4. */
  uint8_t z[32] = {0};
  cr_assert_eq(tb_crc32c(0, z, 32), 0x8A9136AAu, "got %08x", tb_crc32c(0, z, 32));
  cr_assert_eq(tb_crc_mask(0), 0xa282ead8u);
}

Test(tfevents, scalars_read_back_with_their_tags_steps_and_values, .init = setup, .fini = teardown) {
  char logdir[128], rundir[192], path[512];
  snprintf(logdir, sizeof logdir, "%s/logs/deeper", dir); /* made like mkdir -p */
  struct rumor_err e = {0};
  double t0 = (double)time(NULL);
  tb_writer_t *w = tb_open(logdir, "peer-a", &e);
  cr_assert_not_null(w, "%s", e.msg);
  tb_scalar(w, "train/loss", 1, 0.5);
  tb_scalar(w, "train/loss", 2, 0.25);
  tb_scalar(w, "eval/test_accuracy", 2, 0.875);
  tb_scalar(w, "big/step", 5000000000LL, -3.5);
  tb_flush(w);
  cr_assert_eq(tb_status(w), 0);
  snprintf(rundir, sizeof rundir, "%s/peer-a", logdir);
  cr_assert_eq(tfr_find(rundir, path, sizeof path), 1, "one event file in %s", rundir);
  cr_assert_str_eq(path, tb_path(w));
  /* events.out.tfevents.<unix seconds>.<host>.<pid>.rumor */
  char host[256], want[512];
  gethostname(host, sizeof host);
  long long secs = atoll(strrchr(path, '/') + 1 + strlen("events.out.tfevents."));
  snprintf(want, sizeof want, "%s/events.out.tfevents.%lld.%s.%d.rumor", rundir, secs, host, (int)getpid());
  cr_assert_str_eq(path, want);
  cr_assert(secs >= (long long)t0 && secs <= (long long)t0 + 5);

  struct tfr_file f;
  char err[200];
  cr_assert_eq(tfr_read(path, &f, err, sizeof err), 0, "%s", err);
  cr_assert_str_eq(f.version, "brain.Event:2");
  cr_assert_eq(f.records, 5, "the version record and 4 scalars, got %zu", f.records);
  const struct {
    const char *tag;
    int64_t step;
    float v;
  } exp[] = {{"train/loss", 1, 0.5f}, {"train/loss", 2, 0.25f}, {"eval/test_accuracy", 2, 0.875f},
             {"big/step", 5000000000LL, -3.5f}};
  cr_assert_eq(f.n, 4);
  for (size_t i = 0; i < 4; i++) {
    cr_assert_str_eq(f.s[i].tag, exp[i].tag);
    cr_assert_eq(f.s[i].step, exp[i].step, "%s: step %lld", exp[i].tag, (long long)f.s[i].step);
    cr_assert_eq(f.s[i].value, exp[i].v, "%s: %g, want %g", exp[i].tag, f.s[i].value, exp[i].v);
    cr_assert(f.s[i].wall >= t0 && f.s[i].wall < t0 + 60, "wall time %f", f.s[i].wall);
  }
  tfr_free(&f);
  tb_close(w);
}

Test(tfevents, a_corrupted_byte_fails_the_readers_crc_check, .init = setup, .fini = teardown) {
  struct rumor_err e = {0};
  tb_writer_t *w = tb_open(dir, "run", &e);
  cr_assert_not_null(w, "%s", e.msg);
  tb_scalar(w, "a", 7, 1.25);
  tb_scalar(w, "b", 8, 2.5);
  char path[512];
  snprintf(path, sizeof path, "%s", tb_path(w));
  tb_close(w);
  size_t n;
  uint8_t *buf = slurp(path, &n);
  struct tfr_file f;
  char err[200];
  cr_assert_eq(tfr_parse(buf, n, &f, err, sizeof err), 0, "the untouched file: %s", err);
  cr_assert_eq(f.n, 2);
  tfr_free(&f);
  /* The second record (the first scalar) starts after the first. */
  size_t second = 12 + (size_t)tfr_le(buf, 8) + 4;
  buf[second + 12 + 3] ^= 0x01; /* a data byte */
  cr_assert_eq(tfr_parse(buf, n, &f, err, sizeof err), -1, "a flipped data byte was accepted");
  cr_assert(strstr(err, "record 1: data CRC") != NULL, "%s", err);
  buf[second + 12 + 3] ^= 0x01;
  buf[second + 1] ^= 0x40; /* the length */
  cr_assert_eq(tfr_parse(buf, n, &f, err, sizeof err), -1, "a flipped length byte was accepted");
  cr_assert(strstr(err, "record 1: length CRC") != NULL, "%s", err);
  free(buf);
}

Test(tfevents, paths_that_cannot_be_made_are_clear_errors, .init = setup, .fini = teardown) {
  char blocker[128], logdir[192];
  snprintf(blocker, sizeof blocker, "%s/blocker", dir);
  FILE *f = fopen(blocker, "w");
  cr_assert_not_null(f);
  fclose(f);
  snprintf(logdir, sizeof logdir, "%s/sub", blocker);
  struct rumor_err e = {0};
  cr_assert_null(tb_open(logdir, "run", &e));
  cr_assert_eq(e.code, -ENOTDIR, "code %d: %s", e.code, e.msg);
  cr_assert(strstr(e.msg, blocker) != NULL, "the message names the path: %s", e.msg);
  cr_assert_null(tb_open(blocker, "run", &e), "a file given as the directory");
  cr_assert(strstr(e.msg, blocker) != NULL, "%s", e.msg);
  const char *bad[] = {"", ".", "..", "a/b"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_null(tb_open(dir, bad[i], &e), "run name '%s' accepted", bad[i]);
    cr_assert_eq(e.code, RUMOR_EFORMAT, "'%s': %s", bad[i], e.msg);
  }
}

Test(tfevents, a_write_error_is_kept_and_leaves_whole_records, .init = setup, .fini = teardown) {
  struct rumor_err e = {0};
  tb_writer_t *w = tb_open(dir, "run", &e);
  cr_assert_not_null(w, "%s", e.msg);
  tb_scalar(w, "before", 1, 1.0);
  tb_flush(w);
  /* Files may grow to 4 KiB from now on: the next flush writes part of
   * its buffer, then fails with EFBIG. */
  signal(SIGXFSZ, SIG_IGN);
  struct rlimit rl = {4096, 4096};
  cr_assert_eq(setrlimit(RLIMIT_FSIZE, &rl), 0);
  for (int i = 0; i < 400; i++) tb_scalar(w, "after/a/long/tag/to/fill/the/file", i, i);
  tb_flush(w);
  cr_assert_eq(tb_status(w), -EFBIG, "status %d", tb_status(w));
  tb_scalar(w, "dropped", 1000, 1.0); /* no crash, nothing written */
  tb_flush(w);
  char path[512];
  snprintf(path, sizeof path, "%s", tb_path(w));
  tb_close(w);
  struct tfr_file f;
  char err[200];
  cr_assert_eq(tfr_read(path, &f, err, sizeof err), 0, "the file must hold whole records only: %s", err);
  cr_assert_eq(f.n, 1, "only the scalar flushed before the error, got %zu", f.n);
  cr_assert_str_eq(f.s[0].tag, "before");
  tfr_free(&f);
}

Test(tfevents, two_writers_of_one_run_get_two_files, .init = setup, .fini = teardown) {
  struct rumor_err e = {0};
  tb_writer_t *a = tb_open(dir, "run", &e), *b = tb_open(dir, "run", &e);
  cr_assert(a && b, "%s", e.msg);
  cr_assert_str_neq(tb_path(a), tb_path(b));
  tb_close(a);
  tb_close(b);
}
