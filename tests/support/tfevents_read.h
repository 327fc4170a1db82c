/*
 * tfevents_read.h — an independent reader of TensorBoard event files for
 * tests: TFRecord framing with both masked CRC32C checks, and a generic
 * protobuf decoder that finds Event.wall_time (1), step (2), file_version
 * (3) and summary (5) → Summary.value (1) → tag (1), simple_value (2).
 * It shares no code with util/tfevents.c (its CRC is bit by bit, from the
 * polynomial), so a test reading the writer's files with it checks the
 * writer against the format, not against itself.
 *
 * Header-only (static inline functions); include after the C library
 * headers. No Criterion: every function reports failure by return value
 * and a message.
 */
#ifndef RUMOR_TESTS_TFEVENTS_READ_H
#define RUMOR_TESTS_TFEVENTS_READ_H

#include <dirent.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

struct tfr_scalar {
  char tag[300];
  int64_t step;
  float value;
  double wall;
};

struct tfr_file {
  char version[64]; /* the first record's file_version ("" when it had none) */
  size_t records;
  struct tfr_scalar *s;
  size_t n;
};

/* CRC32C bit by bit, from the reflected polynomial. */
static inline uint32_t tfr_crc32c(const uint8_t *p, size_t n) {
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < n; i++) {
    c ^= p[i];
    for (int k = 0; k < 8; k++) c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1)));
  }
  return ~c;
}

static inline uint32_t tfr_masked(const uint8_t *p, size_t n) {
  uint32_t c = tfr_crc32c(p, n);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

static inline uint64_t tfr_le(const uint8_t *p, int bytes) {
  uint64_t v = 0;
  for (int i = bytes - 1; i >= 0; i--) v = v << 8 | p[i];
  return v;
}

/* A protobuf field: its number, wire type and value (varint / fixed bits,
 * or the bytes of a length-delimited field). */
struct tfr_field {
  unsigned num, wire;
  uint64_t v;
  const uint8_t *data;
  size_t len;
};

static inline bool tfr_varint(const uint8_t **p, const uint8_t *end, uint64_t *out) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64 && *p < end; shift += 7) {
    uint8_t b = *(*p)++;
    v |= (uint64_t)(b & 0x7f) << shift;
    if (!(b & 0x80)) {
      *out = v;
      return true;
    }
  }
  return false;
}

/* Reads the next field of [*p, end); false on malformed input. */
static inline bool tfr_next(const uint8_t **p, const uint8_t *end, struct tfr_field *f) {
  uint64_t key;
  if (!tfr_varint(p, end, &key)) return false;
  f->num = (unsigned)(key >> 3);
  f->wire = (unsigned)(key & 7);
  f->data = NULL;
  f->len = 0;
  switch (f->wire) {
  case 0: return tfr_varint(p, end, &f->v);
  case 1:
  case 5: {
    size_t k = f->wire == 1 ? 8 : 4;
    if ((size_t)(end - *p) < k) return false;
    f->v = tfr_le(*p, (int)k);
    *p += k;
    return true;
  }
  case 2:
    if (!tfr_varint(p, end, &f->v) || f->v > (uint64_t)(end - *p)) return false;
    f->data = *p;
    f->len = (size_t)f->v;
    *p += f->len;
    return true;
  default: return false;
  }
}

/* Summary.Value: tag and simple_value into *s. */
static inline bool tfr_value(const uint8_t *p, const uint8_t *end, struct tfr_scalar *s) {
  struct tfr_field f;
  bool tag = false, val = false;
  while (p < end) {
    if (!tfr_next(&p, end, &f)) return false;
    if (f.num == 1 && f.wire == 2 && f.len < sizeof s->tag) {
      memcpy(s->tag, f.data, f.len);
      s->tag[f.len] = '\0';
      tag = true;
    } else if (f.num == 2 && f.wire == 5) {
      uint32_t bits = (uint32_t)f.v;
      memcpy(&s->value, &bits, 4);
      val = true;
    }
  }
  return tag && val;
}

static inline void tfr_push(struct tfr_file *out, const struct tfr_scalar *s) {
  out->s = realloc(out->s, (out->n + 1) * sizeof *out->s);
  out->s[out->n++] = *s;
}

/* One Event: its scalars appended to out; its file_version kept when it is
 * the file's first record (TensorBoard reads the version from there only). */
static inline bool tfr_event(const uint8_t *p, const uint8_t *end, struct tfr_file *out, char *err, size_t errn) {
  struct tfr_field f;
  struct tfr_scalar base = {.step = 0};
  const uint8_t *sum = NULL, *sum_end = NULL;
  while (p < end) {
    if (!tfr_next(&p, end, &f)) {
      snprintf(err, errn, "malformed Event field");
      return false;
    }
    if (f.num == 1 && f.wire == 1) memcpy(&base.wall, &f.v, 8);
    else if (f.num == 2 && f.wire == 0) base.step = (int64_t)f.v;
    else if (f.num == 3 && f.wire == 2 && out->records == 0 && f.len < sizeof out->version) {
      memcpy(out->version, f.data, f.len);
      out->version[f.len] = '\0';
    } else if (f.num == 5 && f.wire == 2) {
      sum = f.data;
      sum_end = f.data + f.len;
    }
  }
  while (sum && sum < sum_end) {
    if (!tfr_next(&sum, sum_end, &f) || f.num != 1 || f.wire != 2) {
      snprintf(err, errn, "malformed Summary");
      return false;
    }
    struct tfr_scalar s = base;
    if (!tfr_value(f.data, f.data + f.len, &s)) {
      snprintf(err, errn, "malformed Summary.Value");
      return false;
    }
    tfr_push(out, &s);
  }
  return true;
}

/* Parses a whole event file in memory. Returns 0, or -1 with a message
 * (a CRC mismatch names the record and which CRC). */
static inline int tfr_parse(const uint8_t *buf, size_t n, struct tfr_file *out, char *err, size_t errn) {
  memset(out, 0, sizeof *out);
  size_t off = 0;
  while (off < n) {
    if (n - off < 12) {
      snprintf(err, errn, "record %zu: truncated header", out->records);
      return -1;
    }
    uint64_t len = tfr_le(buf + off, 8);
    if ((uint32_t)tfr_le(buf + off + 8, 4) != tfr_masked(buf + off, 8)) {
      snprintf(err, errn, "record %zu: length CRC mismatch", out->records);
      return -1;
    }
    if (len > n - off - 12 || n - off - 12 - len < 4) {
      snprintf(err, errn, "record %zu: truncated data", out->records);
      return -1;
    }
    const uint8_t *data = buf + off + 12;
    if ((uint32_t)tfr_le(data + len, 4) != tfr_masked(data, (size_t)len)) {
      snprintf(err, errn, "record %zu: data CRC mismatch", out->records);
      return -1;
    }
    if (!tfr_event(data, data + len, out, err, errn)) return -1;
    out->records++;
    off += 12 + (size_t)len + 4;
  }
  return 0;
}

static inline int tfr_read(const char *path, struct tfr_file *out, char *err, size_t errn) {
  FILE *f = fopen(path, "rb");
  if (!f) {
    snprintf(err, errn, "cannot open %.150s", path);
    return -1;
  }
  uint8_t *buf = NULL;
  size_t n = 0, cap = 0;
  for (;;) {
    if (n == cap) buf = realloc(buf, cap = cap ? 2 * cap : 65536);
    size_t got = fread(buf + n, 1, cap - n, f);
    if (got == 0) break;
    n += got;
  }
  fclose(f);
  int rc = tfr_parse(buf, n, out, err, errn);
  free(buf);
  return rc;
}

static inline void tfr_free(struct tfr_file *f) {
  free(f->s);
  memset(f, 0, sizeof *f);
}

/* The last scalar under `tag`, or NULL. */
static inline const struct tfr_scalar *tfr_last(const struct tfr_file *f, const char *tag) {
  for (size_t i = f->n; i-- > 0;)
    if (strcmp(f->s[i].tag, tag) == 0) return &f->s[i];
  return NULL;
}

/* How many scalars carry `tag`. */
static inline size_t tfr_count(const struct tfr_file *f, const char *tag) {
  size_t k = 0;
  for (size_t i = 0; i < f->n; i++) k += strcmp(f->s[i].tag, tag) == 0;
  return k;
}

/* True when the steps under `tag` never go down and do go up at least once. */
static inline bool tfr_steps_increase(const struct tfr_file *f, const char *tag) {
  int64_t last = -1, first = -1;
  for (size_t i = 0; i < f->n; i++) {
    if (strcmp(f->s[i].tag, tag) != 0) continue;
    if (first < 0) first = f->s[i].step;
    if (f->s[i].step < last) return false;
    last = f->s[i].step;
  }
  return last > first;
}

/* The path of the only events.out.tfevents.* file in `dir` into out;
 * returns how many such files there are. */
static inline int tfr_find(const char *dir, char *out, size_t n) {
  DIR *d = opendir(dir);
  if (!d) return 0;
  int k = 0;
  for (struct dirent *de; (de = readdir(d));) {
    if (strncmp(de->d_name, "events.out.tfevents.", 20) != 0) continue;
    if (k++ == 0) snprintf(out, n, "%s/%s", dir, de->d_name);
  }
  closedir(d);
  return k;
}

#endif /* RUMOR_TESTS_TFEVENTS_READ_H */
