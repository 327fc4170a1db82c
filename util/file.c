/* Atomic file replacement and bounded whole-file reads. */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <unistd.h>

int file_write_full(int fd, const void *buf, size_t n) {
  const uint8_t *p = buf;
  while (n > 0) {
    ssize_t w = write(fd, p, n > (1u << 30) ? (1u << 30) : n);
    if (w < 0) {
      if (errno == EINTR) continue;
      return -errno;
    }
    p += w;
    n -= (size_t)w;
  }
  return 0;
}

/* ---- atomic files ---------------------------------------------------------------- */

#define TEMP_TAG ".tmp."
#define TEMP_HEX_DIGITS 16 /* 64 random bits */

/* The directory holding `path`, as a new string. */
static char *dir_of(const char *path) {
  char *copy = xstrdup(path);
  char *dir = xstrdup(dirname(copy));
  free(copy);
  return dir;
}

/* A fresh `path`.tmp.PID.HEX (a new string) into *out. */
static int temp_name(const char *path, char **out, struct rumor_err *e) {
  uint64_t r;
  for (;;) {
    ssize_t got = getrandom(&r, sizeof r, 0);
    if (got == (ssize_t)sizeof r) break;
    if (got < 0 && errno != EINTR)
      return rumor_err_set(e, -errno, "cannot draw a temporary name for %s: getrandom: %s", path, strerror(errno));
  }
  size_t cap = strlen(path) + STR_LEN(TEMP_TAG) + 24 + TEMP_HEX_DIGITS;
  *out = xmalloc(cap);
  snprintf(*out, cap, "%s" TEMP_TAG "%d.%0*llx", path, (int)getpid(), TEMP_HEX_DIGITS, (unsigned long long)r);
  return 0;
}

/* fsync of the directory holding `path`, which makes a rename or link in it
 * durable. */
static int sync_dir(const char *path, struct rumor_err *e) {
  char *dir = dir_of(path);
  int rc = 0, fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (fd < 0 || fsync(fd) < 0)
    rc = rumor_err_set(e, -errno, "cannot fsync directory %s (for %s): %s", dir, path, strerror(errno));
  if (fd >= 0) close(fd);
  free(dir);
  return rc;
}

static void release(struct file_atomic *fa) {
  if (fa->fd >= 0) close(fa->fd);
  fa->fd = -1;
  free(fa->path);
  free(fa->tmp);
  fa->path = fa->tmp = NULL;
}

void file_atomic_abort(struct file_atomic *fa) {
  if (!fa->path) return;
  if (fa->fd >= 0) close(fa->fd);
  fa->fd = -1;
  unlink(fa->tmp);
  release(fa);
}

/* Removes the temporary and releases the handle after a failure whose
 * message is already in `e`; returns `rc`. Used as
 * `return aborted(fa, rumor_err_set(e, ...))`: the message is written
 * before the names it uses are freed. */
static int aborted(struct file_atomic *fa, int rc) {
  file_atomic_abort(fa);
  return rc;
}

int file_atomic_open(struct file_atomic *fa, const char *path, unsigned mode, struct rumor_err *e) {
  *fa = (struct file_atomic){.fd = -1, .mode = mode & 07777};
  char *tmp;
  int rc = temp_name(path, &tmp, e);
  if (rc) return rc;
  int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, fa->mode);
  if (fd < 0) {
    rc = -errno;
    char *dir = dir_of(path);
    rumor_err_set(e, rc, "cannot create a temporary file in %s for %s: %s", dir, path, strerror(-rc));
    free(dir);
    free(tmp);
    return rc;
  }
  fa->fd = fd;
  fa->tmp = tmp;
  fa->path = xstrdup(path);
  /* The umask may have removed bits from what open(2) created; the file
   * gets exactly `mode`, never more at any moment. */
  if (fchmod(fd, fa->mode) < 0)
    return aborted(fa, rumor_err_set(e, -errno, "cannot set mode %04o on %s (for %s): %s", fa->mode, tmp, path,
                                     strerror(errno)));
  return 0;
}

int file_atomic_write(struct file_atomic *fa, const void *buf, size_t n, struct rumor_err *e) {
  RUMOR_ASSERT(fa->path && fa->fd >= 0);
  int rc = file_write_full(fa->fd, buf, n);
  if (rc)
    return aborted(fa, rumor_err_set(e, rc, "cannot write %s (its temporary %s): %s", fa->path, fa->tmp,
                                     strerror(-rc)));
  return 0;
}

int file_atomic_sync(struct file_atomic *fa, struct rumor_err *e) {
  RUMOR_ASSERT(fa->path);
  if (fa->fd < 0) return 0;
  if (fsync(fa->fd) < 0)
    return aborted(fa, rumor_err_set(e, -errno, "cannot fsync %s (its temporary %s): %s", fa->path, fa->tmp,
                                     strerror(errno)));
  int fd = fa->fd;
  fa->fd = -1;
  if (close(fd) < 0)
    return aborted(fa, rumor_err_set(e, -errno, "cannot close %s (its temporary %s): %s", fa->path, fa->tmp,
                                     strerror(errno)));
  return 0;
}

int file_atomic_commit(struct file_atomic *fa, unsigned flags, struct rumor_err *e) {
  int rc = file_atomic_sync(fa, e);
  if (rc) return rc;
  if (flags & FILE_ATOMIC_NO_REPLACE) {
    /* link(2) never replaces nor follows what is at `path`. */
    if (link(fa->tmp, fa->path) < 0) {
      if (errno == EEXIST) return aborted(fa, rumor_err_set(e, -EEXIST, "%s already exists", fa->path));
      return aborted(fa, rumor_err_set(e, -errno, "cannot create %s: %s", fa->path, strerror(errno)));
    }
    unlink(fa->tmp);
  } else if (rename(fa->tmp, fa->path) < 0) {
    return aborted(fa, rumor_err_set(e, -errno, "cannot rename %s to %s: %s", fa->tmp, fa->path, strerror(errno)));
  }
  rc = sync_dir(fa->path, e);
  release(fa);
  return rc;
}

int file_write_atomic(const char *path, const struct file_part *parts, size_t nparts, unsigned mode, unsigned flags,
                      struct rumor_err *e) {
  struct stat st;
  if ((flags & FILE_ATOMIC_NO_REPLACE) && lstat(path, &st) == 0)
    return rumor_err_set(e, -EEXIST, "%s already exists", path); /* before writing anything */
  struct file_atomic fa;
  int rc = file_atomic_open(&fa, path, mode, e);
  for (size_t i = 0; rc == 0 && i < nparts; i++)
    if (parts[i].len) rc = file_atomic_write(&fa, parts[i].data, parts[i].len, e);
  return rc ? rc : file_atomic_commit(&fa, flags, e);
}

int file_link_atomic(const char *target, const char *linkpath, struct rumor_err *e) {
  char *tmp;
  int rc = temp_name(linkpath, &tmp, e);
  if (rc) return rc;
  if (link(target, tmp) < 0) {
    rc = rumor_err_set(e, -errno, "cannot link %s to %s: %s", tmp, target, strerror(errno));
  } else if (rename(tmp, linkpath) < 0) {
    rc = rumor_err_set(e, -errno, "cannot rename %s to %s: %s", tmp, linkpath, strerror(errno));
    unlink(tmp);
  } else {
    rc = sync_dir(linkpath, e);
  }
  free(tmp);
  return rc;
}

long file_atomic_temp_pid(const char *name, const char *base) {
  size_t blen = strlen(base);
  if (strncmp(name, base, blen) != 0 || !STR_PREFIX(name + blen, TEMP_TAG)) return 0;
  const char *p = name + blen + STR_LEN(TEMP_TAG);
  if (*p < '1' || *p > '9') return 0; /* no sign, space or leading zero */
  char *end;
  errno = 0;
  long pid = strtol(p, &end, 10);
  if (errno || pid <= 0 || pid > INT_MAX) return 0;
  /* PATH.tmp.PID and PATH.tmp.PID.tmp.PID: the names of older writers. */
  if (*end == '\0' || STR_PREFIX(end, TEMP_TAG)) return pid;
  size_t hex = *end == '.' ? strspn(end + 1, "0123456789abcdef") : 0;
  return hex == TEMP_HEX_DIGITS && end[1 + hex] == '\0' ? pid : 0;
}

/* What a path that is not a regular file is, for messages. */
const char *file_kind(unsigned m) {
  if (S_ISDIR(m)) return "a directory";
  if (S_ISFIFO(m)) return "a FIFO";
  if (S_ISCHR(m)) return "a character device";
  if (S_ISBLK(m)) return "a block device";
  if (S_ISSOCK(m)) return "a socket";
  return "of an unknown kind";
}

int file_open_regular(const char *path, int flags, unsigned mode, struct stat *st, struct rumor_err *e) {
  /* O_NONBLOCK makes the open itself return at once: a FIFO without a
   * writer would otherwise block here, before the check below, and no stop
   * signal could end the wait (they are blocked in every thread). */
  int fd = open(path, flags | O_NONBLOCK | O_CLOEXEC, mode);
  if (fd < 0) return rumor_err_set(e, -errno, "cannot open %s: %s", path, strerror(errno));
  struct stat own;
  if (!st) st = &own;
  int rc = 0, fl;
  if (fstat(fd, st) < 0) rc = rumor_err_set(e, -errno, "cannot stat %s: %s", path, strerror(errno));
  else if (!S_ISREG(st->st_mode))
    rc = rumor_err_set(e, -EINVAL, "%s is not a regular file (it is %s)", path, file_kind(st->st_mode));
  else if ((fl = fcntl(fd, F_GETFL)) < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) < 0)
    rc = rumor_err_set(e, -errno, "cannot clear O_NONBLOCK on %s: %s", path, strerror(errno));
  if (rc) {
    close(fd);
    return rc;
  }
  return fd;
}

int file_read_all(const char *path, size_t max_len, uint8_t **out, size_t *out_len,
                  struct rumor_err *e) {
  struct stat st;
  int fd = file_open_regular(path, O_RDONLY, 0, &st, e);
  if (fd < 0) return fd;
  if ((uint64_t)st.st_size > max_len) {
    close(fd);
    return rumor_err_set(e, RUMOR_ETOOBIG, "%s is %lld bytes, more than the limit of %zu", path,
                         (long long)st.st_size, max_len);
  }
  size_t n = (size_t)st.st_size;
  uint8_t *buf = malloc(n ? n : 1);
  if (!buf) {
    close(fd);
    return rumor_err_set(e, -ENOMEM, "cannot allocate %zu bytes to read %s", n, path);
  }
  size_t got = 0;
  while (got < n) {
    ssize_t r = read(fd, buf + got, n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r <= 0) {
      int rc = r < 0 ? rumor_err_set(e, -errno, "cannot read %s: %s", path, strerror(errno))
                     : rumor_err_set(e, RUMOR_ECORRUPT, "%s shrank while being read", path);
      free(buf);
      close(fd);
      return rc;
    }
    got += (size_t)r;
  }
  close(fd);
  *out = buf;
  *out_len = n;
  return 0;
}
