/* Atomic file replacement and bounded whole-file reads. */
#include "util.h"

#include <errno.h>
#include <fcntl.h>
#include <libgen.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
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

int file_write_atomic(const char *path, const struct file_part *parts, size_t nparts,
                      unsigned mode, struct rumor_err *e) {
  size_t plen = strlen(path);
  char *tmp = xmalloc(plen + 32);
  snprintf(tmp, plen + 32, "%s.tmp.%d", path, (int)getpid());
  char *dircopy = xstrdup(path);
  const char *dir = dirname(dircopy);
  int rc = 0, fd = -1, dfd = -1;

  fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, mode);
  if (fd < 0) {
    rc = rumor_err_set(e, -errno, "cannot create %s: %s", tmp, strerror(errno));
    goto out;
  }
  for (size_t i = 0; i < nparts; i++) {
    if (parts[i].len == 0) continue;
    rc = file_write_full(fd, parts[i].data, parts[i].len);
    if (rc < 0) {
      rumor_err_set(e, rc, "cannot write %s: %s", tmp, strerror(-rc));
      goto out_unlink;
    }
  }
  if (fsync(fd) < 0) {
    rc = rumor_err_set(e, -errno, "cannot fsync %s: %s", tmp, strerror(errno));
    goto out_unlink;
  }
  if (close(fd) < 0) {
    fd = -1;
    rc = rumor_err_set(e, -errno, "cannot close %s: %s", tmp, strerror(errno));
    goto out_unlink;
  }
  fd = -1;
  if (rename(tmp, path) < 0) {
    rc = rumor_err_set(e, -errno, "cannot rename %s to %s: %s", tmp, path, strerror(errno));
    goto out_unlink;
  }
  /* Make the rename itself durable. */
  dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd < 0 || fsync(dfd) < 0) {
    rc = rumor_err_set(e, -errno, "cannot fsync directory %s: %s", dir, strerror(errno));
  }
  goto out;

out_unlink:
  unlink(tmp);
out:
  if (fd >= 0) close(fd);
  if (dfd >= 0) close(dfd);
  free(tmp);
  free(dircopy);
  return rc;
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
