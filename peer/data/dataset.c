/* IDX reader (via zlib, which reads plain files transparently), sharding
 * and batch gathering. */
#include "peer/data/data_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

#define IDX_MAGIC_U8_1D 0x00000801u
#define IDX_MAGIC_U8_3D 0x00000803u
#define IDX_READ_CHUNK (1 << 20)

static uint32_t be32(const uint8_t *p) {
  return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* Reads exactly n bytes; returns 0, 1 on a short read (EOF), -1 on error. */
static int gz_read_exact(gzFile f, void *buf, size_t n) {
  uint8_t *p = buf;
  while (n > 0) {
    unsigned want = n > IDX_READ_CHUNK ? IDX_READ_CHUNK : (unsigned)n;
    int r = gzread(f, p, want);
    if (r < 0) return -1;
    if (r == 0) return 1;
    p += r;
    n -= (size_t)r;
  }
  return 0;
}

static int gz_fail(gzFile f, const char *path, struct rumor_err *e) {
  int zerr;
  const char *msg = gzerror(f, &zerr);
  if (zerr == Z_ERRNO) return rumor_err_set(e, -errno, "%s: read error: %s", path, strerror(errno));
  return rumor_err_set(e, RUMOR_ECORRUPT, "%s: corrupt gzip data (%s)", path, msg);
}

/* Reads one IDX file of unsigned bytes with `ndims` dimensions into a new
 * buffer. The buffer grows as data actually arrives, so a header that lies
 * about its size cannot make us allocate more than the file holds. */
static int idx_read(const char *path, uint32_t magic, int ndims, int64_t *dims, uint8_t **out,
                    struct rumor_err *e) {
  /* Opened and checked first (a FIFO must not block gzopen), then handed to
   * zlib, which owns the descriptor from gzdopen on. */
  int fd = file_open_regular(path, O_RDONLY, 0, NULL, e);
  if (fd < 0) return fd;
  errno = 0;
  gzFile f = gzdopen(fd, "rb");
  if (!f) {
    int err = errno ? errno : ENOMEM;
    close(fd);
    return rumor_err_set(e, -err, "cannot open %s: %s", path, strerror(err));
  }
  gzbuffer(f, 1 << 17);
  int rc = 0;
  uint8_t *data = NULL;
  uint8_t hdr[4 + 4 * 3];
  size_t hlen = 4 + 4 * (size_t)ndims;
  int r = gz_read_exact(f, hdr, hlen);
  if (r < 0) { rc = gz_fail(f, path, e); goto out; }
  if (r > 0) { rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: truncated IDX header", path); goto out; }
  uint32_t got_magic = be32(hdr);
  if (got_magic != magic) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: wrong IDX magic 0x%08x (expected 0x%08x: %s)", path, got_magic,
                       magic, ndims == 1 ? "unsigned-byte labels, 1 dimension" : "unsigned-byte images, 3 dimensions");
    goto out;
  }
  int64_t total = 1;
  for (int i = 0; i < ndims; i++) {
    dims[i] = be32(hdr + 4 + 4 * i);
    if (dims[i] == 0) { rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: dimension %d is zero", path, i); goto out; }
    total *= dims[i];
    if (total > DATASET_MAX_BYTES) {
      rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: declared size exceeds %lld bytes", path, (long long)DATASET_MAX_BYTES);
      goto out;
    }
  }
  if (dims[0] > DATASET_MAX_SAMPLES) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: %lld samples is more than the limit of %lld", path,
                       (long long)dims[0], (long long)DATASET_MAX_SAMPLES);
    goto out;
  }
  size_t cap = 0, have = 0;
  while ((int64_t)have < total) {
    if (have == cap) {
      size_t ncap = cap ? cap * 2 : IDX_READ_CHUNK;
      if ((int64_t)ncap > total) ncap = (size_t)total;
      uint8_t *nd = realloc(data, ncap);
      if (!nd) { rc = rumor_err_set(e, -ENOMEM, "%s: out of memory reading %zu bytes", path, ncap); goto out; }
      data = nd;
      cap = ncap;
    }
    size_t want = cap - have > IDX_READ_CHUNK ? IDX_READ_CHUNK : cap - have;
    int n = gzread(f, data + have, (unsigned)want);
    if (n < 0) { rc = gz_fail(f, path, e); goto out; }
    if (n == 0) {
      rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: truncated: header declares %lld data bytes, file has %zu", path,
                         (long long)total, have);
      goto out;
    }
    have += (size_t)n;
  }
  uint8_t extra;
  r = gzread(f, &extra, 1);
  if (r < 0) { rc = gz_fail(f, path, e); goto out; }
  if (r > 0) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: trailing bytes after the %lld declared data bytes", path, (long long)total);
    goto out;
  }
  *out = data;
  data = NULL;
out:
  free(data);
  gzclose(f);
  return rc;
}

int dataset_load(const char *images_path, const char *labels_path, struct dataset *out,
                 struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  int64_t idims[3], ldims[1];
  uint8_t *pixels = NULL, *labels = NULL;
  int rc = idx_read(images_path, IDX_MAGIC_U8_3D, 3, idims, &pixels, e);
  if (rc) return rc;
  rc = idx_read(labels_path, IDX_MAGIC_U8_1D, 1, ldims, &labels, e);
  if (rc) {
    free(pixels);
    return rc;
  }
  if (idims[0] != ldims[0]) {
    free(pixels);
    free(labels);
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s has %lld images but %s has %lld labels", images_path,
                         (long long)idims[0], labels_path, (long long)ldims[0]);
  }
  if (idims[1] * idims[2] > DATASET_MAX_FEATURES) {
    free(pixels);
    free(labels);
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: images of %lldx%lld pixels are too large", images_path,
                         (long long)idims[1], (long long)idims[2]);
  }
  out->count = idims[0];
  out->rows = idims[1];
  out->cols = idims[2];
  out->features = idims[1] * idims[2];
  out->pixels = pixels;
  out->labels = labels;
  int maxl = 0;
  for (int64_t i = 0; i < out->count; i++) maxl = labels[i] > maxl ? labels[i] : maxl;
  out->num_classes = maxl + 1;
  return 0;
}

static int find_file(const char *dir, const char *name, char *buf, size_t len) {
  struct stat st;
  snprintf(buf, len, "%s/%s", dir, name);
  if (stat(buf, &st) == 0) return 0;
  snprintf(buf, len, "%s/%s.gz", dir, name);
  if (stat(buf, &st) == 0) return 0;
  return -1;
}

int dataset_load_split(const char *dir, const char *split, struct dataset *out, struct rumor_err *e) {
  char images[4096], labels[4096], name[64];
  struct stat st;
  if (stat(dir, &st) != 0) return rumor_err_set(e, -errno, "data directory %s: %s", dir, strerror(errno));
  if (!S_ISDIR(st.st_mode)) return rumor_err_set(e, -ENOTDIR, "data directory %s is not a directory", dir);
  snprintf(name, sizeof name, "%s-images-idx3-ubyte", split);
  if (find_file(dir, name, images, sizeof images))
    return rumor_err_set(e, -ENOENT, "no %s or %s.gz in %s", name, name, dir);
  snprintf(name, sizeof name, "%s-labels-idx1-ubyte", split);
  if (find_file(dir, name, labels, sizeof labels))
    return rumor_err_set(e, -ENOENT, "no %s or %s.gz in %s", name, name, dir);
  return dataset_load(images, labels, out, e);
}

void dataset_free(struct dataset *ds) {
  free(ds->pixels);
  free(ds->labels);
  memset(ds, 0, sizeof *ds);
}

void dataset_pixel_stats(const struct dataset *ds, double *mean, double *std) {
  uint64_t hist[256] = {0};
  int64_t n = ds->count * ds->features;
  for (int64_t i = 0; i < n; i++) hist[ds->pixels[i]]++;
  double s = 0, s2 = 0;
  for (int v = 0; v < 256; v++) {
    double x = v / 255.0;
    s += (double)hist[v] * x;
    s2 += (double)hist[v] * x * x;
  }
  *mean = n ? s / (double)n : 0.0;
  double var = n ? s2 / (double)n - *mean * *mean : 0.0;
  *std = var > 1e-12 ? sqrt(var) : 1.0;
}

int shard_parse(const char *s, struct shard *out, struct rumor_err *e) {
  int64_t i, n;
  const char *slash = s ? strchr(s, '/') : NULL;
  char a[32];
  if (!slash || (size_t)(slash - s) >= sizeof a) goto bad;
  memcpy(a, s, (size_t)(slash - s));
  a[slash - s] = '\0';
  if (parse_i64(a, 0, SHARD_MAX - 1, &i) || parse_i64(slash + 1, 1, SHARD_MAX, &n) || i >= n) goto bad;
  out->index = i;
  out->count = n;
  return 0;
bad:
  return rumor_err_set(e, RUMOR_EFORMAT, "bad shard '%s': expected i/n with 0 <= i < n <= %d (e.g. 0/4)", s ? s : "",
                       SHARD_MAX);
}

int batcher_init(struct batcher *b, const struct dataset *ds, struct shard shard, uint64_t data_seed,
                 uint64_t seed, double mean, double std, struct rumor_err *e) {
  memset(b, 0, sizeof *b);
  if (!shard_order_init(&b->rows, ds->count, shard, data_seed, 0x5348415244ull /* "SHARD" */, seed))
    return rumor_err_set(e, RUMOR_EFORMAT, "shard %lld/%lld of a %lld-sample data set is empty",
                         (long long)shard.index, (long long)shard.count, (long long)ds->count);
  b->ds = ds;
  dataset_norm_lut(mean, std, b->lut);
  return 0;
}

void batcher_free(struct batcher *b) {
  shard_order_free(&b->rows);
  memset(b, 0, sizeof *b);
}

static void gather(const float *lut, const struct dataset *ds, int64_t idx, float *x, int32_t *y) {
  const uint8_t *px = ds->pixels + idx * ds->features;
  for (int64_t f = 0; f < ds->features; f++) x[f] = lut[px[f]];
  *y = ds->labels[idx];
}

int64_t batcher_fill(const struct batcher *b, int64_t step, int64_t bs, float *x, int32_t *y) {
  int64_t first = step * bs;
  RUMOR_ASSERT(first >= 0 && first < b->rows.n);
  int64_t rows = b->rows.n - first < bs ? b->rows.n - first : bs;
  for (int64_t r = 0; r < rows; r++) gather(b->lut, b->ds, b->rows.order[first + r], x + r * b->ds->features, y + r);
  return rows;
}

void dataset_norm_lut(double mean, double std, float lut[256]) {
  for (int v = 0; v < 256; v++) lut[v] = (float)((v / 255.0 - mean) / std);
}

void dataset_gather_range(const struct dataset *ds, const float lut[256], int64_t first, int64_t rows,
                          float *x, int32_t *y) {
  RUMOR_ASSERT(first >= 0 && first + rows <= ds->count);
  for (int64_t r = 0; r < rows; r++) gather(lut, ds, first + r, x + r * ds->features, y + r);
}
