/* TensorBoard event files: TFRecord framing, CRC32C and a hand-encoded
 * protobuf Event (tfevents.h). */
#include "util/tfevents.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

/* The largest record tb_scalar makes: the Event's fixed fields, the tag and
 * the varint lengths around it. */
#define TB_EVENT_MAX (TB_TAG_MAX + 64)

struct tb_writer {
  int fd;
  char *path;
  uint8_t *buf; /* records not yet written (TB_BUF_BYTES) */
  size_t len;
  off_t good;   /* the file's length after the last complete write */
  int error;    /* the first write error (negative errno); nothing is written after it */
  bool tag_warned; /* a tag over TB_TAG_MAX was reported */
};

/* ---- CRC32C ---------------------------------------------------------------- */

static uint32_t crc_table[256];
static pthread_once_t crc_once = PTHREAD_ONCE_INIT;

static void crc_table_init(void) {
  for (uint32_t i = 0; i < 256; i++) {
    uint32_t c = i;
    for (int k = 0; k < 8; k++) c = (c & 1) ? (c >> 1) ^ 0x82F63B78u : c >> 1;
    crc_table[i] = c;
  }
}

uint32_t tb_crc32c(uint32_t crc, const void *data, size_t n) {
  pthread_once(&crc_once, crc_table_init);
  const uint8_t *p = data;
  crc = ~crc;
  for (size_t i = 0; i < n; i++) crc = crc_table[(crc ^ p[i]) & 0xff] ^ (crc >> 8);
  return ~crc;
}

uint32_t tb_crc_mask(uint32_t crc) { return ((crc >> 15) | (crc << 17)) + TB_MASK_DELTA; }

/* ---- protobuf encoding ------------------------------------------------------ */

enum { PB_VARINT = 0, PB_FIXED64 = 1, PB_LEN = 2, PB_FIXED32 = 5 };

static size_t put_varint(uint8_t *p, uint64_t v) {
  size_t n = 0;
  while (v >= 0x80) {
    p[n++] = (uint8_t)(v | 0x80);
    v >>= 7;
  }
  p[n++] = (uint8_t)v;
  return n;
}

static size_t put_le(uint8_t *p, uint64_t v, int bytes) {
  for (int i = 0; i < bytes; i++) p[i] = (uint8_t)(v >> (8 * i));
  return (size_t)bytes;
}

static size_t put_key(uint8_t *p, unsigned field, unsigned wire) { return put_varint(p, (uint64_t)(field << 3 | wire)); }

static size_t put_double(uint8_t *p, unsigned field, double v) {
  uint64_t bits;
  memcpy(&bits, &v, sizeof bits);
  size_t n = put_key(p, field, PB_FIXED64);
  return n + put_le(p + n, bits, 8);
}

static size_t put_float(uint8_t *p, unsigned field, float v) {
  uint32_t bits;
  memcpy(&bits, &v, sizeof bits);
  size_t n = put_key(p, field, PB_FIXED32);
  return n + put_le(p + n, bits, 4);
}

static size_t put_bytes(uint8_t *p, unsigned field, const void *s, size_t len) {
  size_t n = put_key(p, field, PB_LEN);
  n += put_varint(p + n, len);
  memcpy(p + n, s, len);
  return n + len;
}

/* Event{wall_time, step, summary{value{tag, simple_value}}}, or with a NULL
 * tag Event{wall_time, step, file_version}. `out` holds TB_EVENT_MAX bytes. */
static size_t encode_event(uint8_t *out, double wall, int64_t step, const char *tag, float value) {
  size_t n = put_double(out, 1, wall);
  n += put_key(out + n, 2, PB_VARINT);
  n += put_varint(out + n, (uint64_t)step);
  if (!tag) return n + put_bytes(out + n, 3, TB_FILE_VERSION, strlen(TB_FILE_VERSION));
  uint8_t val[TB_TAG_MAX + 16], sum[TB_TAG_MAX + 32];
  size_t nv = put_bytes(val, 1, tag, strlen(tag));
  nv += put_float(val + nv, 2, value);
  size_t ns = put_bytes(sum, 1, val, nv);
  return n + put_bytes(out + n, 5, sum, ns);
}

/* ---- the file --------------------------------------------------------------- */

void tb_flush(tb_writer_t *w) {
  if (!w || w->error || w->len == 0) return;
  int rc = file_write_full(w->fd, w->buf, w->len);
  if (rc == 0) {
    w->good += (off_t)w->len;
    w->len = 0;
    return;
  }
  /* Cut a record written in part, so that readers see whole records only. */
  if (ftruncate(w->fd, w->good) == 0) (void)lseek(w->fd, w->good, SEEK_SET);
  w->error = rc;
  w->len = 0;
  log_warn("tensorboard: cannot write %s: %s; no more figures go to it", w->path, strerror(-rc));
}

/* Writes the record of n bytes of data (tfevents.h) to out[0, n + 16);
 * returns n + 16. */
static size_t frame(uint8_t *out, const uint8_t *data, size_t n) {
  put_le(out, n, 8);
  put_le(out + 8, tb_crc_mask(tb_crc32c(0, out, 8)), 4);
  memcpy(out + 12, data, n);
  put_le(out + 12 + n, tb_crc_mask(tb_crc32c(0, data, n)), 4);
  return n + 16;
}

/* Frames one record into the buffer, writing the buffer first
 * when the record does not fit. */
static void append_record(tb_writer_t *w, const uint8_t *data, size_t n) {
  if (w->error) return;
  if (w->len + n + 16 > TB_BUF_BYTES) tb_flush(w);
  if (w->error) return;
  w->len += frame(w->buf + w->len, data, n);
}

static double wall_now(void) {
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

void tb_scalar(tb_writer_t *w, const char *tag, int64_t step, double value) {
  if (!w || w->error) return;
  if (strlen(tag) > TB_TAG_MAX) {
    if (!w->tag_warned) log_warn("tensorboard: tag '%.40s...' is longer than %d bytes; not written", tag, TB_TAG_MAX);
    w->tag_warned = true;
    return;
  }
  uint8_t ev[TB_EVENT_MAX];
  size_t n = encode_event(ev, wall_now(), step, tag, (float)value);
  append_record(w, ev, n);
}

int tb_status(const tb_writer_t *w) { return w->error; }
const char *tb_path(const tb_writer_t *w) { return w->path; }

/* mkdir -p: creates each missing component of `path`. */
static int make_dirs(const char *path, struct rumor_err *e) {
  char *p = xstrdup(path);
  int rc = 0;
  for (char *s = p + 1;; s++) {
    if (*s != '/' && *s != '\0') continue;
    char c = *s;
    *s = '\0';
    struct stat st;
    bool have = stat(p, &st) == 0;
    if (!have && mkdir(p, 0755) < 0 && errno != EEXIST) {
      rc = rumor_err_set(e, -errno, "cannot create directory %s: %s", p, strerror(errno));
      break;
    }
    if (!have && stat(p, &st) < 0) { /* EEXIST: another process made it meanwhile */
      rc = rumor_err_set(e, -errno, "cannot create directory %s: %s", p, strerror(errno));
      break;
    }
    if (!S_ISDIR(st.st_mode)) {
      rc = rumor_err_set(e, -ENOTDIR, "cannot create directory %s: a file of that name is in the way", p);
      break;
    }
    *s = c;
    if (c == '\0') break;
  }
  free(p);
  return rc;
}

static int check_run(const char *run, struct rumor_err *e) {
  size_t n = strlen(run);
  if (n == 0 || n > TB_RUN_MAX || strchr(run, '/') || strcmp(run, ".") == 0 || strcmp(run, "..") == 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "tensorboard run name '%s' must be one path component of 1 to %d bytes",
                         run, TB_RUN_MAX);
  return 0;
}

/* Creates a new event file in `rundir`; its path in *path (malloc'd). */
static int create_file(const char *rundir, char **path, struct rumor_err *e) {
  char host[256] = "localhost";
  if (gethostname(host, sizeof host) < 0) snprintf(host, sizeof host, "localhost");
  host[sizeof host - 1] = '\0';
  for (char *h = host; *h; h++)
    if (*h == '/') *h = '_';
  size_t cap = strlen(rundir) + strlen(host) + 96;
  char *p = xmalloc(cap);
  long long secs = (long long)time(NULL);
  for (int k = 0; k < 1000; k++) {
    int len = snprintf(p, cap, "%s/events.out.tfevents.%lld.%s.%d.rumor", rundir, secs, host, (int)getpid());
    if (k) snprintf(p + len, cap - (size_t)len, ".%d", k);
    int fd = open(p, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    if (fd >= 0) {
      *path = p;
      return fd;
    }
    if (errno != EEXIST) break;
  }
  int err = errno;
  int rc = rumor_err_set(e, -err, "cannot create %s: %s", p, strerror(err));
  free(p);
  return rc;
}

tb_writer_t *tb_open(const char *dir, const char *run, struct rumor_err *e) {
  if (check_run(run, e)) return NULL;
  if (!dir || !dir[0]) {
    rumor_err_set(e, RUMOR_EFORMAT, "the tensorboard directory is empty");
    return NULL;
  }
  size_t cap = strlen(dir) + strlen(run) + 2;
  char *rundir = xmalloc(cap);
  snprintf(rundir, cap, "%s/%s", dir, run);
  char *path = NULL;
  int rc = make_dirs(rundir, e);
  int fd = rc ? rc : create_file(rundir, &path, e);
  free(rundir);
  if (fd < 0) return NULL;
  /* The first record says which format follows. */
  uint8_t ev[TB_EVENT_MAX], rec[TB_EVENT_MAX + 16];
  size_t n = frame(rec, ev, encode_event(ev, wall_now(), 0, NULL, 0));
  if ((rc = file_write_full(fd, rec, n)) < 0) {
    rumor_err_set(e, rc, "cannot write %s: %s", path, strerror(-rc));
    close(fd);
    unlink(path);
    free(path);
    return NULL;
  }
  tb_writer_t *w = xcalloc(1, sizeof *w);
  w->fd = fd;
  w->path = path;
  w->buf = xmalloc(TB_BUF_BYTES);
  w->good = (off_t)n;
  return w;
}

void tb_close(tb_writer_t *w) {
  if (!w) return;
  tb_flush(w);
  if (close(w->fd) < 0 && !w->error) log_warn("tensorboard: cannot close %s: %s", w->path, strerror(errno));
  free(w->buf);
  free(w->path);
  free(w);
}
