/* util: half-precision conversion, the seeded generator, strict number
 * parsing, atomic file writes (modes, no-replace, symlinks, temporaries,
 * errors), reads that refuse FIFOs and devices, and CPU lists. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <criterion/criterion.h>
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "util/util.h"

Test(half, f16_and_bf16_round_trip_and_special_values) {
  struct rng r;
  rng_seed(&r, 1, 2);
  for (int i = 0; i < 100000; i++) {
    float x = rng_normal(&r) * powf(2.0f, (float)(int)rng_below(&r, 20) - 10);
    float h = half_to_f32(half_from_f32(x)), b = bf16_to_f32(bf16_from_f32(x));
    if (fabsf(x) >= 6.2e-5f) cr_assert(fabsf(h - x) <= fabsf(x) * (1.0f / 2048), "f16 %g -> %g", x, h);
    else cr_assert(fabsf(h - x) <= 6e-8f, "f16 subnormal %g -> %g", x, h);
    cr_assert(fabsf(b - x) <= fabsf(x) * (1.0f / 256), "bf16 %g -> %g", x, b);
  }
  cr_assert(isnan(half_to_f32(half_from_f32(NAN))));
  cr_assert(isnan(bf16_to_f32(bf16_from_f32(NAN))));
  cr_assert(isinf(half_to_f32(half_from_f32(1e6f))));
  cr_assert(isinf(half_to_f32(half_from_f32(-INFINITY))) && half_to_f32(half_from_f32(-INFINITY)) < 0);
  cr_assert_eq(half_to_f32(half_from_f32(65504.0f)), 65504.0f);
  cr_assert_eq(half_from_f32(1.0f), 0x3c00);
  cr_assert_eq(half_from_f32(1.0f + 1.0f / 2048), 0x3c00); /* tie rounds to even */
  cr_assert_eq(half_from_f32(5.9604645e-8f), 0x0001);      /* smallest subnormal */
  cr_assert_eq(bf16_from_f32(1.0f), 0x3f80);
  /* every f16 value converts exactly to f32 and back */
  for (uint32_t h = 0; h < 65536; h++) {
    float f = half_to_f32((uint16_t)h);
    if (!isnan(f)) cr_assert_eq(half_from_f32(f), h, "0x%04x", h);
  }
}

Test(rng, reproducible_streams_and_unbiased_below) {
  struct rng a, b, c;
  rng_seed(&a, 5, 1);
  rng_seed(&b, 5, 1);
  rng_seed(&c, 5, 2);
  bool differ = false;
  for (int i = 0; i < 100; i++) {
    uint64_t x = rng_next_u64(&a);
    cr_assert_eq(x, rng_next_u64(&b));
    differ |= x != rng_next_u64(&c);
  }
  cr_assert(differ, "streams 1 and 2 are identical");
  int counts[7] = {0};
  for (int i = 0; i < 70000; i++) counts[rng_below(&a, 7)]++;
  for (int i = 0; i < 7; i++) cr_assert(counts[i] > 9400 && counts[i] < 10600, "bucket %d: %d", i, counts[i]);
  double s = 0, s2 = 0;
  for (int i = 0; i < 100000; i++) {
    double z = rng_normal(&a);
    s += z;
    s2 += z * z;
  }
  cr_assert(fabs(s / 1e5) < 0.02 && fabs(s2 / 1e5 - 1) < 0.03, "normal mean %g var %g", s / 1e5, s2 / 1e5);
}

Test(parse, numbers_are_strict) {
  int64_t i;
  double d;
  cr_assert_eq(parse_i64("42", 0, 100, &i), 0);
  cr_assert_eq(i, 42);
  cr_assert_neq(parse_i64("42x", 0, 100, &i), 0);
  cr_assert_neq(parse_i64("101", 0, 100, &i), 0);
  cr_assert_neq(parse_i64("", 0, 100, &i), 0);
  cr_assert_neq(parse_i64("99999999999999999999", 0, INT64_MAX, &i), 0);
  cr_assert_eq(parse_f64("1e-3", 0, 1, &d), 0);
  cr_assert_neq(parse_f64("inf", 0, 1e308, &d), 0);
  cr_assert_neq(parse_f64("nan", -1, 1, &d), 0);
  cr_assert_neq(parse_f64("0.5.5", 0, 1, &d), 0);
}

/* A scratch directory /tmp/rumor-test-file-XXXXXX in dir (64 bytes). */
static void scratch_make(char *dir) {
  snprintf(dir, 64, "/tmp/rumor-test-file-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}

static void scratch_remove(const char *dir) {
  char cmd[160];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
}

/* The names in `dir` (without . and ..), space-separated, into out[n];
 * returns how many there are. */
static int dir_entries(const char *dir, char *out, size_t n) {
  DIR *d = opendir(dir);
  cr_assert_not_null(d, "cannot open %s", dir);
  int count = 0;
  out[0] = '\0';
  for (struct dirent *de; (de = readdir(d)) != NULL;) {
    if (strcmp(de->d_name, ".") == 0 || strcmp(de->d_name, "..") == 0) continue;
    count++;
    size_t used = strlen(out);
    snprintf(out + used, n - used, "%s%s", used ? " " : "", de->d_name);
  }
  closedir(d);
  return count;
}

/* Asserts that `path` holds exactly `len` bytes equal to `want`. */
static void expect_contents(const char *path, const char *want, size_t len, const char *what) {
  uint8_t *buf;
  size_t n;
  struct rumor_err e;
  cr_assert_eq(file_read_all(path, 1 << 20, &buf, &n, &e), 0, "%s: %s", what, e.msg);
  cr_assert_eq(n, len, "%s: %s holds %zu bytes, want %zu", what, path, n, len);
  cr_assert_eq(memcmp(buf, want, len), 0, "%s: %s holds '%.*s', want '%.*s'", what, path, (int)n, (const char *)buf,
               (int)len, want);
  free(buf);
}

/* Writes `text` to `path` (an atomic replace of mode `mode`), or fails the
 * test. */
static void put_text(const char *path, const char *text, unsigned mode) {
  struct file_part part = {text, strlen(text)};
  struct rumor_err e;
  cr_assert_eq(file_write_atomic(path, &part, 1, mode, 0, &e), 0, "%s", e.msg);
}

/* After a write that failed: `path` holds exactly `len` bytes of `want`,
 * still as inode `ino`, and `dir` holds nothing else (no temporary left). */
static void expect_intact(const char *dir, const char *path, const char *want, size_t len, ino_t ino,
                          const char *what) {
  expect_contents(path, want, len, what);
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  cr_assert_eq(st.st_ino, ino, "%s: the old file was replaced", what);
  char names[512];
  int count = dir_entries(dir, names, sizeof names);
  const char *base = strrchr(path, '/') + 1;
  cr_assert(count == 1 && strcmp(names, base) == 0, "%s: %s holds '%s', want only '%s'", what, dir, names, base);
}

Test(file, atomic_write_creates_the_file_with_its_mode_and_reads_back) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  struct file_part parts[] = {{"hello ", 6}, {"world", 5}};
  struct rumor_err e;
  cr_assert_eq(file_write_atomic(path, parts, 2, 0600, 0, &e), 0, "%s", e.msg);
  struct stat st;
  cr_assert_eq(stat(path, &st), 0);
  cr_assert_eq(st.st_mode & 0777, 0600);
  expect_contents(path, "hello world", 11, "new file");
  uint8_t *buf;
  size_t n;
  cr_assert_eq(file_read_all(path, 5, &buf, &n, &e), RUMOR_ETOOBIG);
  cr_assert_neq(file_read_all(dir, 100, &buf, &n, &e), 0); /* a directory */
  scratch_remove(dir);
}

/* Replacing is a rename of a complete new file over the old one: the path
 * then holds exactly the new bytes (no tail of the longer old file), it is
 * a new inode with the new mode, a reader that opened the old file still
 * reads all of the old bytes (nobody sees a mix), and no temporary is left. */
Test(file, atomic_write_replaces_an_existing_file_whole_and_leaves_no_temporary) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  const char *old_text = "the old contents, longer than the new";
  struct file_part old_part = {old_text, strlen(old_text)};
  struct rumor_err e;
  cr_assert_eq(file_write_atomic(path, &old_part, 1, 0644, 0, &e), 0, "%s", e.msg);
  struct stat before, after;
  cr_assert_eq(stat(path, &before), 0);
  int reader = open(path, O_RDONLY);
  cr_assert_geq(reader, 0);

  struct file_part parts[] = {{"new ", 4}, {"bytes", 5}};
  cr_assert_eq(file_write_atomic(path, parts, 2, 0600, 0, &e), 0, "%s", e.msg);
  expect_contents(path, "new bytes", 9, "replaced file");
  cr_assert_eq(stat(path, &after), 0);
  cr_assert_neq(after.st_ino, before.st_ino, "the old file was rewritten in place (inode %llu), not replaced",
                (unsigned long long)after.st_ino);
  cr_assert_eq(after.st_mode & 0777, 0600, "mode %o, want the new 0600", after.st_mode & 0777);

  char seen[256];
  ssize_t got = read(reader, seen, sizeof seen);
  close(reader);
  cr_assert(got == (ssize_t)strlen(old_text) && memcmp(seen, old_text, (size_t)got) == 0,
            "a reader of the old file saw %zd bytes '%.*s', want the whole old contents", got, (int)(got > 0 ? got : 0),
            seen);

  char names[512];
  int count = dir_entries(dir, names, sizeof names);
  cr_assert(count == 1 && strcmp(names, "f") == 0, "after replacing, %s holds '%s', want only 'f'", dir, names);
  scratch_remove(dir);
}

/* A write that fails part-way (the file-size limit, in a child process, as
 * a full disk would) returns -EFBIG and leaves the old file exactly as it
 * was, same inode, and no temporary behind. */
Test(file, failed_atomic_write_keeps_the_old_file_and_leaves_no_temporary) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  const char *old_text = "the old contents";
  struct file_part old_part = {old_text, strlen(old_text)};
  struct rumor_err e;
  cr_assert_eq(file_write_atomic(path, &old_part, 1, 0644, 0, &e), 0, "%s", e.msg);
  struct stat before;
  cr_assert_eq(stat(path, &before), 0);

  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 64, .rlim_max = 64};
    if (setrlimit(RLIMIT_FSIZE, &rl) != 0) _exit(2);
    static char big[4096];
    memset(big, 'x', sizeof big);
    struct file_part part = {big, sizeof big};
    int rc = file_write_atomic(path, &part, 1, 0644, 0, &e);
    _exit(rc == -EFBIG && strstr(e.msg, "File too large") ? 0 : 1);
  }
  int status;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0,
            "a 4 KiB write under a 64-byte file-size limit did not fail with -EFBIG (status %d)", status);

  expect_intact(dir, path, old_text, strlen(old_text), before.st_ino, "after the failed write");
  scratch_remove(dir);
}

/* The file gets exactly the mode asked for: a umask that would remove bits
 * (077 on a 0644 file) or one that removes none (0 on a 0600 secret)
 * changes nothing. */
Test(file, atomic_write_gives_exactly_its_mode_whatever_the_umask) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  struct rumor_err e;
  struct file_part part = {STR_LIT("x")};
  const unsigned masks[] = {077, 0, 0277}, modes[] = {0644, 0600, 0640};
  for (size_t i = 0; i < sizeof masks / sizeof masks[0]; i++) {
    mode_t old = umask(masks[i]);
    int rc = file_write_atomic(path, &part, 1, modes[i], 0, &e);
    umask(old);
    cr_assert_eq(rc, 0, "%s", e.msg);
    struct stat st;
    cr_assert_eq(stat(path, &st), 0);
    cr_assert_eq(st.st_mode & 07777, modes[i], "umask %03o: mode %04o, want %04o", masks[i], st.st_mode & 07777,
                 modes[i]);
  }
  scratch_remove(dir);
}

/* No-replace (how keys are written without --force): -EEXIST naming the
 * path, the old file intact (same bytes, same inode), nothing left behind.
 * The streaming form meets a file that appeared while it wrote the same
 * way: link(2) refuses, the temporary goes. */
Test(file, no_replace_gives_eexist_and_leaves_the_old_file_intact) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  struct rumor_err e;
  struct file_part old_part = {STR_LIT("the old key")}, new_part = {STR_LIT("new")};
  cr_assert_eq(file_write_atomic(path, &old_part, 1, 0600, 0, &e), 0, "%s", e.msg);
  struct stat before;
  cr_assert_eq(stat(path, &before), 0);
  cr_assert_eq(file_write_atomic(path, &new_part, 1, 0600, FILE_ATOMIC_NO_REPLACE, &e), -EEXIST);
  cr_assert(strstr(e.msg, path) && strstr(e.msg, "already exists"), "%s", e.msg);

  struct file_atomic fa;
  cr_assert_eq(file_atomic_open(&fa, path, 0600, &e), 0, "%s", e.msg);
  cr_assert_eq(file_atomic_write(&fa, STR_LIT("new"), &e), 0, "%s", e.msg);
  cr_assert_eq(file_atomic_commit(&fa, FILE_ATOMIC_NO_REPLACE, &e), -EEXIST, "%s", e.msg);
  cr_assert(strstr(e.msg, path), "%s", e.msg);
  file_atomic_abort(&fa); /* after a commit: nothing to do */

  expect_intact(dir, path, old_part.data, old_part.len, before.st_ino, "after the refused writes");
  scratch_remove(dir);
}

/* A symlink planted at the path, to a file elsewhere (a key an attacker
 * would have us overwrite, or create): with no-replace nothing is written
 * through it, whether the link dangles or not, in either form; with
 * replace, the rename replaces the link itself and the target is never
 * touched. The temporary (whose name cannot be guessed, so no link can
 * wait at it) is opened O_EXCL | O_NOFOLLOW: it is a new regular file with
 * one link, and no failure leaves it behind. */
Test(file, nothing_is_written_through_a_symlink_at_the_path) {
  char dir[64], elsewhere[64];
  scratch_make(dir);
  scratch_make(elsewhere);
  char path[128], victim[128], absent[128];
  snprintf(path, sizeof path, "%s/key", dir);
  snprintf(victim, sizeof victim, "%s/victim", elsewhere);
  snprintf(absent, sizeof absent, "%s/absent", elsewhere);
  struct rumor_err e;
  static const char victim_text[] = "victim's bytes";
  struct file_part part = {STR_LIT("secret")};
  put_text(victim, victim_text, 0644);
  const char *targets[] = {victim, absent};
  for (size_t i = 0; i < 2; i++) {
    unlink(path);
    cr_assert_eq(symlink(targets[i], path), 0, "symlink: %s", strerror(errno));
    cr_assert_eq(file_write_atomic(path, &part, 1, 0600, FILE_ATOMIC_NO_REPLACE, &e), -EEXIST, "%s", e.msg);
    struct file_atomic fa;
    cr_assert_eq(file_atomic_open(&fa, path, 0600, &e), 0, "%s", e.msg);
    struct stat st;
    cr_assert_eq(lstat(fa.tmp, &st), 0, "the temporary %s is missing", fa.tmp);
    cr_assert(S_ISREG(st.st_mode) && st.st_nlink == 1, "the temporary is not a new regular file");
    cr_assert_eq(file_atomic_temp_pid(strrchr(fa.tmp, '/') + 1, "key"), (long)getpid(), "temporary %s", fa.tmp);
    cr_assert_eq(file_atomic_write(&fa, part.data, part.len, &e), 0, "%s", e.msg);
    cr_assert_eq(file_atomic_commit(&fa, FILE_ATOMIC_NO_REPLACE, &e), -EEXIST, "%s", e.msg);
    cr_assert_eq(lstat(path, &st), 0);
    cr_assert(S_ISLNK(st.st_mode), "the symlink at %s was replaced", path);
  }
  expect_contents(victim, victim_text, sizeof victim_text - 1, "the symlink's target");
  struct stat st;
  cr_assert_neq(stat(absent, &st), 0, "a file was created through a dangling symlink");
  char names[512];
  int count = dir_entries(dir, names, sizeof names);
  cr_assert(count == 1 && strcmp(names, "key") == 0, "%s holds '%s', want only the link 'key'", dir, names);

  cr_assert_eq(file_write_atomic(path, &part, 1, 0600, 0, &e), 0, "%s", e.msg);
  cr_assert_eq(lstat(path, &st), 0);
  cr_assert(S_ISREG(st.st_mode), "replacing left the symlink at %s", path);
  expect_contents(path, part.data, part.len, "the replaced link");
  expect_contents(victim, victim_text, sizeof victim_text - 1, "the old link's target");
  scratch_remove(dir);
  scratch_remove(elsewhere);
}

/* Two writers of one path draw different temporaries, both named
 * PATH.tmp.PID.HEX; abort removes one, and a commit that fails (a
 * directory stands at the path) removes the other. The names of older
 * writers (PATH.tmp.PID, PATH.tmp.PID.tmp.PID) are recognised too, so that
 * checkpoints still clean them up; other names are not. */
Test(file, temporaries_are_unpredictable_and_never_left_behind) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  struct rumor_err e;
  struct file_atomic a, b;
  cr_assert_eq(file_atomic_open(&a, path, 0644, &e), 0, "%s", e.msg);
  cr_assert_eq(file_atomic_open(&b, path, 0644, &e), 0, "%s", e.msg);
  cr_assert_str_neq(a.tmp, b.tmp, "two temporaries of one path share a name");
  char names[512];
  cr_assert_eq(dir_entries(dir, names, sizeof names), 2, "%s", names);
  file_atomic_abort(&a);
  file_atomic_abort(&a); /* twice: nothing more */
  cr_assert_eq(mkdir(path, 0755), 0);
  char inside[160];
  snprintf(inside, sizeof inside, "%s/x", path);
  cr_assert_eq(mkdir(inside, 0755), 0); /* a non-empty directory: rename fails */
  cr_assert_eq(file_atomic_write(&b, STR_LIT("data"), &e), 0, "%s", e.msg);
  cr_assert_lt(file_atomic_commit(&b, 0, &e), 0, "a rename over a non-empty directory succeeded");
  cr_assert(strstr(e.msg, path), "%s", e.msg);
  int count = dir_entries(dir, names, sizeof names);
  cr_assert(count == 1 && strcmp(names, "f") == 0, "%s holds '%s', want only the directory 'f'", dir, names);

  char pid[32];
  snprintf(pid, sizeof pid, "%d", (int)getpid());
  struct {
    const char *suffix;
    long pid;
  } cases[] = {{".tmp.123", 123},
               {".tmp.123.tmp.123", 123},
               {".tmp.123.0123456789abcdef", 123},
               {".tmp.123.0123456789abcde", 0},
               {".tmp.123.0123456789ABCDEF", 0},
               {".tmp.123.0123456789abcdef0", 0},
               {".tmp.123x", 0},
               {".tmp.-5", 0},
               {".tmp.0", 0},
               {".tmp.", 0},
               {".prev.tmp.123", 0},
               {"", 0}};
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char name[96];
    snprintf(name, sizeof name, "ck%s", cases[i].suffix);
    cr_assert_eq(file_atomic_temp_pid(name, "ck"), cases[i].pid, "%s", name);
  }
  scratch_remove(dir);
}

/* A directory the writer may not write in, and one that does not exist:
 * a clear error naming the path, the directory and the reason, and
 * nothing created. Root may write anywhere, so a root test drops to
 * nobody in a child process. */
Test(file, an_unwritable_directory_gives_an_error_naming_the_path) {
  char dir[64];
  scratch_make(dir);
  cr_assert_eq(chmod(dir, 0755), 0);
  char locked[128], path[160], missing[160];
  snprintf(locked, sizeof locked, "%s/locked", dir);
  cr_assert_eq(mkdir(locked, 0555), 0);
  snprintf(path, sizeof path, "%s/f", locked);
  snprintf(missing, sizeof missing, "%s/none/f", dir);
  struct rumor_err e;
  struct file_part part = {STR_LIT("x")};
  cr_assert_eq(file_write_atomic(missing, &part, 1, 0644, 0, &e), -ENOENT, "%s", e.msg);
  cr_assert(strstr(e.msg, missing) && strstr(e.msg, "No such file or directory"), "%s", e.msg);

  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    if (geteuid() == 0 && (setgid(65534) != 0 || setuid(65534) != 0)) _exit(2);
    int rc = file_write_atomic(path, &part, 1, 0644, 0, &e);
    bool clear = rc == -EACCES && strstr(e.msg, path) && strstr(e.msg, locked) && strstr(e.msg, "Permission denied");
    if (!clear) fprintf(stderr, "rc %d: %s\n", rc, e.msg);
    _exit(clear ? 0 : 1);
  }
  int status;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) != 2, "cannot drop root to test an unwritable directory");
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "no clear error for an unwritable directory");
  char names[512];
  cr_assert_eq(dir_entries(locked, names, sizeof names), 0, "%s holds '%s'", locked, names);
  scratch_remove(dir);
}

/* A second name put in place atomically (a checkpoint's .prev): the link
 * is replaced whole, it is the same file as its target, a missing target is
 * -ENOENT, and no temporary is left either way. */
Test(file, a_link_replaces_its_old_name_atomically) {
  char dir[64];
  scratch_make(dir);
  char a[128], b[128], none[128];
  snprintf(a, sizeof a, "%s/a", dir);
  snprintf(b, sizeof b, "%s/b", dir);
  snprintf(none, sizeof none, "%s/none", dir);
  put_text(a, "aaa", 0644);
  put_text(b, "bbbb", 0644);
  struct rumor_err e;
  cr_assert_eq(file_link_atomic(a, b, &e), 0, "%s", e.msg);
  struct stat sa, sb;
  cr_assert(stat(a, &sa) == 0 && stat(b, &sb) == 0 && sa.st_ino == sb.st_ino, "b is not another name of a");
  cr_assert_eq(file_link_atomic(none, b, &e), -ENOENT, "%s", e.msg);
  expect_contents(b, STR_LIT("aaa"), "the link after a failed relink");
  char names[512];
  int count = dir_entries(dir, names, sizeof names);
  cr_assert(count == 2 && (strcmp(names, "a b") == 0 || strcmp(names, "b a") == 0), "%s holds '%s'", dir, names);
  scratch_remove(dir);
}

/* A FIFO without a writer used to block open(2) for ever (and the stop
 * signals are blocked in rumor's threads, so nothing but SIGKILL ended it).
 * Now it and a device are refused at once, naming the path and its kind;
 * the timeout turns a regression into a failure instead of a hung suite. */
Test(file, a_fifo_or_a_device_is_refused_at_once_naming_the_path, .timeout = 10) {
  char dir[64];
  scratch_make(dir);
  char fifo[128];
  snprintf(fifo, sizeof fifo, "%s/fifo", dir);
  cr_assert_eq(mkfifo(fifo, 0600), 0, "mkfifo %s: %s", fifo, strerror(errno));
  uint8_t *buf;
  size_t n;
  struct rumor_err e = {0};
  cr_assert_eq(file_read_all(fifo, 100, &buf, &n, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, fifo) && strstr(e.msg, "is not a regular file (it is a FIFO)"), "%s", e.msg);
  /* Opened for appending, as `rumor top --csv` does (O_RDWR opens a FIFO
   * without blocking, but the read of its header line would block). */
  cr_assert_eq(file_open_regular(fifo, O_RDWR | O_CREAT | O_APPEND, 0644, NULL, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, "(it is a FIFO)"), "%s", e.msg);
  cr_assert_eq(file_read_all("/dev/null", 100, &buf, &n, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, "/dev/null is not a regular file (it is a character device)"), "%s", e.msg);
  cr_assert_eq(file_read_all(dir, 100, &buf, &n, &e), -EINVAL, "%s", e.msg);
  cr_assert(strstr(e.msg, "(it is a directory)"), "%s", e.msg);
  scratch_remove(dir);
}

/* A regular file comes back as a blocking, close-on-exec descriptor with
 * its fstat: O_NONBLOCK was only for the open. */
Test(file, a_regular_file_opens_blocking_and_close_on_exec) {
  char dir[64];
  scratch_make(dir);
  char path[128];
  snprintf(path, sizeof path, "%s/f", dir);
  struct file_part part = {"12345", 5};
  struct rumor_err e = {0};
  cr_assert_eq(file_write_atomic(path, &part, 1, 0600, 0, &e), 0, "%s", e.msg);
  struct stat st;
  int fd = file_open_regular(path, O_RDONLY, 0, &st, &e);
  cr_assert_geq(fd, 0, "%s", e.msg);
  cr_assert_eq(st.st_size, 5);
  cr_assert_eq(fcntl(fd, F_GETFL) & O_NONBLOCK, 0, "O_NONBLOCK is still set");
  cr_assert_neq(fcntl(fd, F_GETFD) & FD_CLOEXEC, 0, "FD_CLOEXEC is not set");
  close(fd);
  char missing[160];
  snprintf(missing, sizeof missing, "%s/none", dir);
  cr_assert_eq(file_open_regular(missing, O_RDONLY, 0, NULL, &e), -ENOENT);
  cr_assert(strstr(e.msg, missing), "%s", e.msg);
  scratch_remove(dir);
}

static bool cpu_in(const struct cpu_list *c, int cpu) { return (c->bits[cpu / 64] >> (cpu % 64)) & 1; }

Test(cpus, lists_parse_strictly_and_pinning_takes_effect) {
  struct cpu_list c;
  struct rumor_err e;
  cr_assert_eq(cpu_list_parse("0", &c, &e), 0, "%s", e.msg);
  cr_assert(cpu_in(&c, 0) && !cpu_in(&c, 1));
  long n = sysconf(_SC_NPROCESSORS_ONLN);
  if (n >= 2) {
    cr_assert_eq(cpu_list_parse("0-1", &c, &e), 0, "%s", e.msg);
    cr_assert(cpu_in(&c, 0) && cpu_in(&c, 1) && !cpu_in(&c, 2));
    cr_assert_eq(cpu_list_parse("1,0", &c, &e), 0, "%s", e.msg);
    cr_assert(cpu_in(&c, 0) && cpu_in(&c, 1));
  }
  const char *bad[] = {"", "x", "1-", "-1", "2-1", "0,", ",0", "0,,1", "0 1", "1024", "99999999999"};
  for (size_t i = 0; i < sizeof bad / sizeof bad[0]; i++) {
    cr_assert_neq(cpu_list_parse(bad[i], &c, &e), 0, "'%s' was accepted", bad[i]);
    cr_assert(strlen(e.msg) > 0, "no message for '%s'", bad[i]);
  }
  cr_assert_neq(cpu_list_parse("1000", &c, &e), 0, "a CPU this machine lacks was accepted");
  cr_assert(strstr(e.msg, "1000") != NULL, "the message does not name the CPU: %s", e.msg);

  /* Pin this thread to CPU 0, check the kernel agrees, and restore. */
  cpu_set_t before, now;
  cr_assert_eq(sched_getaffinity(0, sizeof before, &before), 0);
  cr_assert_eq(cpu_list_parse("0", &c, &e), 0, "%s", e.msg);
  cr_assert_eq(cpu_pin_self(&c, &e), 0, "%s", e.msg);
  cr_assert_eq(sched_getaffinity(0, sizeof now, &now), 0);
  cr_assert(CPU_ISSET(0, &now) && CPU_COUNT(&now) == 1, "pinned to %d CPUs", CPU_COUNT(&now));
  cr_assert_eq(sched_setaffinity(0, sizeof before, &before), 0);
}

/* A CPU the process may not use is refused with the CPUs it may use, as a
 * list (not their count). */
Test(cpus, a_cpu_outside_the_affinity_is_refused_naming_the_allowed_ones) {
  cpu_set_t before;
  cr_assert_eq(sched_getaffinity(0, sizeof before, &before), 0);
  if (!CPU_ISSET(0, &before) || !CPU_ISSET(1, &before)) cr_skip_test("needs CPUs 0 and 1 in this process's affinity");
  const struct {
    int cpus[2], ncpus;
    const char *list, *says;
  } cases[] = {
      {{0, 1}, 2, "0-99", "CPU 2 in '0-99' is not one this process may run on (it may use 0-1)"},
      {{1, 0}, 1, "0", "CPU 0 in '0' is not one this process may run on (it may use 1)"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    cpu_set_t mine;
    CPU_ZERO(&mine);
    for (int k = 0; k < cases[i].ncpus; k++) CPU_SET(cases[i].cpus[k], &mine);
    cr_assert_eq(sched_setaffinity(0, sizeof mine, &mine), 0);
    struct cpu_list c;
    struct rumor_err e = {0};
    int rc = cpu_list_parse(cases[i].list, &c, &e);
    cr_assert_eq(sched_setaffinity(0, sizeof before, &before), 0);
    cr_assert_eq(rc, RUMOR_EFORMAT, "'%s' was accepted", cases[i].list);
    cr_assert(strstr(e.msg, cases[i].says), "%s", e.msg);
  }
}
