/* The safetensors format with rumor's whole-file BLAKE2b digest. */
#include "peer/train/train.h"

#include <errno.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "util/json_text.h"

#define DIGEST_KEY "rumor.blake2b"
#define DIGEST_BYTES 32
#define DIGEST_HEX (2 * DIGEST_BYTES)
/* What the digest's value holds while the digest is computed. */
#define DIGEST_ZEROS "0000000000000000000000000000000000000000000000000000000000000000"
_Static_assert(STR_LEN(DIGEST_ZEROS) == DIGEST_HEX, "one zero per hex digit of the digest");
#define MAX_FILE_BYTES ((size_t)1 << 42)

static int dtype_parse(const char *s, enum tensor_dtype *dt) {
  static const enum tensor_dtype all[] = {TENSOR_F32, TENSOR_I32, TENSOR_F16, TENSOR_BF16};
  for (size_t i = 0; i < sizeof all / sizeof all[0]; i++)
    if (strcmp(s, tensor_dtype_name(all[i])) == 0) {
      *dt = all[i];
      return 0;
    }
  return -1;
}

#define DIGEST_NONE (-1)
#define DIGEST_TWICE (-2)

/* Finds the digest value's 64 hex characters in the raw header. Returns their
 * offset in `hdr`, DIGEST_NONE when the key is absent, or DIGEST_TWICE when
 * it appears more than once (which a reader must refuse: either copy could
 * be the one that is checked). */
static long find_digest(const char *hdr, size_t len) {
  static const char needle[] = "\"" DIGEST_KEY "\":\"";
  size_t nl = sizeof needle - 1;
  long found = DIGEST_NONE;
  for (size_t i = 0; i + nl + DIGEST_HEX <= len; i++) {
    if (memcmp(hdr + i, needle, nl) == 0) {
      if (found >= 0) return DIGEST_TWICE;
      found = (long)(i + nl);
    }
  }
  return found;
}

static void digest_file(const uint8_t *len8, const char *hdr, size_t hlen, long digest_at,
                        const struct st_tensor *ts, size_t nts, const uint8_t *data, size_t dlen,
                        uint8_t out[DIGEST_BYTES]) {
  crypto_generichash_state st;
  crypto_generichash_init(&st, NULL, 0, DIGEST_BYTES);
  crypto_generichash_update(&st, len8, 8);
  crypto_generichash_update(&st, (const uint8_t *)hdr, (size_t)digest_at);
  crypto_generichash_update(&st, (const uint8_t *)DIGEST_ZEROS, DIGEST_HEX);
  crypto_generichash_update(&st, (const uint8_t *)hdr + digest_at + DIGEST_HEX, hlen - (size_t)digest_at - DIGEST_HEX);
  if (data) {
    crypto_generichash_update(&st, data, dlen);
  } else {
    for (size_t i = 0; i < nts; i++) crypto_generichash_update(&st, ts[i].data, ts[i].nbytes);
  }
  crypto_generichash_final(&st, out, DIGEST_BYTES);
}

/* The header of a file of these tensors: its 8-byte length into `len8`,
 * and the JSON, padded, with the file's digest (a new buffer, `*hlen`
 * bytes). */
static char *make_header(const struct st_tensor *ts, size_t nts, const struct st_meta *meta, size_t nmeta,
                         uint8_t len8[8], size_t *hlen_out) {
  json_t *root = json_object(), *md = json_object();
  RUMOR_ASSERT(root && md);
  for (size_t i = 0; i < nmeta; i++) {
    RUMOR_ASSERT(strcmp(meta[i].key, DIGEST_KEY) != 0);
    json_text_set(md, meta[i].key, json_text_str(meta[i].value));
  }
  /* A placeholder of zeros, replaced in the text below. */
  json_text_set(md, DIGEST_KEY, json_string(DIGEST_ZEROS));
  json_text_set(root, "__metadata__", md);
  size_t off = 0;
  for (size_t i = 0; i < nts; i++) {
    json_t *shape = json_array(), *t = json_object();
    RUMOR_ASSERT(shape && t);
    int64_t numel = 1;
    for (int d = 0; d < ts[i].ndim; d++) {
      json_text_push(shape, json_integer(ts[i].shape[d]));
      numel *= ts[i].shape[d];
    }
    RUMOR_ASSERT((size_t)numel * tensor_dtype_size(ts[i].dtype) == ts[i].nbytes);
    json_text_set(t, "dtype", json_string(tensor_dtype_name(ts[i].dtype)));
    json_text_set(t, "shape", shape);
    json_text_set(t, "data_offsets", json_pack("[I,I]", (json_int_t)off, (json_int_t)(off + ts[i].nbytes)));
    /* Two tensors of one name would leave one out of the header. */
    RUMOR_ASSERT(!json_object_get(root, ts[i].name));
    json_text_set(root, ts[i].name, t);
    off += ts[i].nbytes;
  }
  size_t jlen;
  char *text = json_text_dump(root, &jlen);
  json_decref(root);
  /* Pad with spaces so the data starts 8-byte aligned, as the reference
   * implementation does. */
  size_t hlen = (jlen + 7) & ~(size_t)7;
  char *hdr = xmalloc(hlen + 1);
  memcpy(hdr, text, jlen);
  memset(hdr + jlen, ' ', hlen - jlen);
  hdr[hlen] = '\0';
  free(text);

  for (int b = 0; b < 8; b++) len8[b] = (uint8_t)((uint64_t)hlen >> (8 * b));
  long at = find_digest(hdr, hlen);
  RUMOR_ASSERT(at >= 0);
  uint8_t digest[DIGEST_BYTES];
  digest_file(len8, hdr, hlen, at, ts, nts, NULL, 0, digest);
  sodium_bin2hex(hdr + at, DIGEST_HEX + 1, digest, DIGEST_BYTES);
  hdr[at + DIGEST_HEX] = '"'; /* bin2hex wrote a NUL over the closing quote */
  *hlen_out = hlen;
  return hdr;
}

int safetensors_write_to(struct file_atomic *fa, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                         size_t nmeta, struct rumor_err *e) {
  if (sodium_init() < 0) {
    file_atomic_abort(fa);
    return rumor_err_set(e, -EIO, "libsodium failed to initialise");
  }
  uint8_t len8[8];
  size_t hlen;
  char *hdr = make_header(ts, nts, meta, nmeta, len8, &hlen);
  int rc = file_atomic_write(fa, len8, sizeof len8, e);
  if (rc == 0) rc = file_atomic_write(fa, hdr, hlen, e);
  for (size_t i = 0; rc == 0 && i < nts; i++)
    if (ts[i].nbytes) rc = file_atomic_write(fa, ts[i].data, ts[i].nbytes, e);
  free(hdr);
  return rc;
}

int safetensors_write(const char *path, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                      size_t nmeta, struct rumor_err *e) {
  struct file_atomic fa;
  int rc = file_atomic_open(&fa, path, 0644, e);
  if (rc == 0) rc = safetensors_write_to(&fa, ts, nts, meta, nmeta, e);
  return rc ? rc : file_atomic_commit(&fa, 0, e);
}

static int corrupt(struct rumor_err *e, const char *path, const char *why) {
  return rumor_err_set(e, RUMOR_ECORRUPT, "%s: not a valid checkpoint: %s", path, why);
}

struct range {
  size_t begin, end;
};
/* By begin, then end: a zero-size range sorts before a range starting at the
 * same offset, whatever order the header lists them in (as the reference
 * implementation sorts them). */
static int cmp_range(const void *a, const void *b) {
  const struct range *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

int safetensors_read(const char *path, bool require_digest, struct st_file *f, struct rumor_err *e) {
  memset(f, 0, sizeof *f);
  uint8_t *buf;
  size_t len;
  int rc = file_read_all(path, MAX_FILE_BYTES, &buf, &len, e);
  if (rc) return rc;
  return safetensors_parse(buf, len, path, require_digest, f, e);
}

/* Checks the whole-file digest (when present, or demanded) before anything
 * else in the file is trusted. *at gets its place in the header, or −1. */
static int check_digest(struct st_file *f, const char *name, const char *hdr, size_t hlen, const uint8_t *data,
                        size_t dlen, bool require_digest, long *at, struct rumor_err *e) {
  *at = find_digest(hdr, hlen);
  if (*at == DIGEST_TWICE) return corrupt(e, name, "rumor.blake2b appears more than once");
  if (*at < 0) return require_digest ? corrupt(e, name, "no rumor.blake2b digest in the header") : 0;
  uint8_t want[DIGEST_BYTES], got[DIGEST_BYTES];
  if (sodium_hex2bin(want, sizeof want, hdr + *at, DIGEST_HEX, NULL, NULL, NULL) != 0)
    return corrupt(e, name, "digest is not hexadecimal");
  digest_file(f->buf, hdr, hlen, *at, NULL, 0, data, dlen, got);
  if (sodium_memcmp(want, got, DIGEST_BYTES) != 0)
    return corrupt(e, name, "BLAKE2b digest mismatch (the file is damaged or truncated)");
  return 0;
}

/* The __metadata__ object: string values (each key once: the parser refuses
 * duplicates). `digest_at` is where the raw search found the digest (−1:
 * nowhere). */
static int parse_metadata(struct st_file *f, const char *name, json_t *v, long digest_at,
                          struct rumor_err *e) {
  if (!json_is_object(v)) return corrupt(e, name, "__metadata__ is not an object");
  f->meta = xcalloc(json_object_size(v) ? json_object_size(v) : 1, sizeof *f->meta);
  const char *key;
  json_t *value;
  json_object_foreach(v, key, value) {
    if (!json_is_string(value))
      return rumor_err_set(e, RUMOR_ECORRUPT, "%s: not a valid checkpoint: metadata '%s' is not a string", name, key);
    /* A digest spelt so that the raw search missed it (escapes, spaces)
     * would otherwise pass unchecked. */
    if (digest_at < 0 && strcmp(key, DIGEST_KEY) == 0)
      return corrupt(e, name, "rumor.blake2b is not in the form the digest check reads");
    f->meta[f->nmeta++] = (struct st_meta){key, json_string_value(value)};
  }
  return 0;
}

/* A non-negative integer no larger than `max`, or false. */
static bool uint_at_most(const json_t *v, uint64_t max, uint64_t *out) {
  if (!json_is_integer(v) || json_integer_value(v) < 0 || (uint64_t)json_integer_value(v) > max) return false;
  *out = (uint64_t)json_integer_value(v);
  return true;
}

/* One tensor entry `key` → t and its byte range in the data section. */
static int parse_tensor(const char *name, const char *key, const json_t *v, const uint8_t *data, size_t dlen,
                        struct st_tensor *t, struct range *r, struct rumor_err *e) {
  if (strlen(key) >= SAFETENSORS_MAX_NAME) return corrupt(e, name, "tensor name too long");
  snprintf(t->name, sizeof t->name, "%s", key);
  const json_t *dt = json_object_get(v, "dtype"), *shape = json_object_get(v, "shape"),
               *offs = json_object_get(v, "data_offsets");
  if (!json_is_string(dt) || dtype_parse(json_string_value(dt), &t->dtype))
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' has a missing or unsupported dtype", name, key);
  if (!json_is_array(shape) || json_array_size(shape) > TENSOR_MAX_DIMS)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' has a bad shape", name, key);
  t->ndim = (int)json_array_size(shape);
  uint64_t numel = 1;
  for (size_t d = 0; d < json_array_size(shape); d++) {
    uint64_t x;
    if (!uint_at_most(json_array_get(shape, d), (uint64_t)1 << 40, &x))
      return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' has a bad extent", name, key);
    t->shape[d] = (int64_t)x;
    /* Checked before multiplying: two extents of up to 2^40 would wrap the
     * count (2^40 * 2^24 is 0 modulo 2^64, which matches 0 bytes). */
    if (x != 0 && numel > ((uint64_t)1 << 40) / x)
      return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' is too large", name, key);
    numel *= x;
  }
  if (!json_is_array(offs) || json_array_size(offs) != 2)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' has bad data_offsets", name, key);
  uint64_t b0, b1;
  if (!uint_at_most(json_array_get(offs, 0), dlen, &b0) || !uint_at_most(json_array_get(offs, 1), dlen, &b1) ||
      b1 < b0)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' lies outside the data section (truncated file?)", name,
                         key);
  t->nbytes = (size_t)(b1 - b0);
  if (t->nbytes != numel * tensor_dtype_size(t->dtype))
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor '%s' has %zu bytes for %llu elements of %s", name, key,
                         t->nbytes, (unsigned long long)numel, tensor_dtype_name(t->dtype));
  t->data = data + b0;
  *r = (struct range){(size_t)b0, (size_t)b1};
  return 0;
}

/* The tensors' byte ranges cover the data section exactly, without gaps or
 * overlap. */
static int check_ranges(const char *name, struct range *ranges, size_t n, size_t dlen, struct rumor_err *e) {
  qsort(ranges, n, sizeof *ranges, cmp_range);
  size_t pos = 0;
  for (size_t i = 0; i < n; i++) {
    if (ranges[i].begin != pos) return corrupt(e, name, "tensor byte ranges overlap or leave gaps");
    pos = ranges[i].end;
  }
  return pos == dlen ? 0 : corrupt(e, name, "data section length does not match the tensors");
}

int safetensors_parse(uint8_t *buf, size_t len, const char *name, bool require_digest, struct st_file *f,
                      struct rumor_err *e) {
  memset(f, 0, sizeof *f);
  f->buf = buf;
  f->len = len;
  struct range *ranges = NULL;
  int rc;
  if (sodium_init() < 0) { rc = rumor_err_set(e, -EIO, "libsodium failed to initialise"); goto fail; }
  if (f->len < 8) { rc = corrupt(e, name, "shorter than the 8-byte header length"); goto fail; }
  uint64_t hlen = 0;
  for (int b = 0; b < 8; b++) hlen |= (uint64_t)f->buf[b] << (8 * b);
  if (hlen < 2 || hlen > SAFETENSORS_MAX_HEADER || hlen > f->len - 8) {
    rc = corrupt(e, name, "header length out of range (truncated file?)");
    goto fail;
  }
  const char *hdr = (const char *)f->buf + 8;
  const uint8_t *data = f->buf + 8 + hlen;
  size_t dlen = f->len - 8 - (size_t)hlen;
  long at;
  if ((rc = check_digest(f, name, hdr, (size_t)hlen, data, dlen, require_digest, &at, e))) goto fail;
  struct rumor_err je;
  if (json_text_parse(hdr, (size_t)hlen, &f->header, &je)) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: not a valid checkpoint: header: %s", name, je.msg);
    goto fail;
  }
  json_t *root = f->header;
  if (!json_is_object(root)) { rc = corrupt(e, name, "header is not a JSON object"); goto fail; }
  size_t nkeys = json_object_size(root);
  if (nkeys > SAFETENSORS_MAX_TENSORS + 1) { rc = corrupt(e, name, "too many tensors"); goto fail; }
  f->tensors = xcalloc(nkeys ? nkeys : 1, sizeof *f->tensors);
  ranges = xcalloc(nkeys ? nkeys : 1, sizeof *ranges);
  const char *key;
  json_t *value;
  /* In the header's order; the parser refused repeated keys. */
  json_object_foreach(root, key, value) {
    if (strcmp(key, "__metadata__") == 0) {
      if ((rc = parse_metadata(f, name, value, at, e))) goto fail;
      continue;
    }
    if (f->ntensors == SAFETENSORS_MAX_TENSORS) { rc = corrupt(e, name, "too many tensors"); goto fail; }
    rc = parse_tensor(name, key, value, data, dlen, &f->tensors[f->ntensors], &ranges[f->ntensors], e);
    if (rc) goto fail;
    f->ntensors++;
  }
  if ((rc = check_ranges(name, ranges, f->ntensors, dlen, e))) goto fail;
  if (at >= 0) {
    /* The bytes the raw search checked must be __metadata__'s digest, not
     * a look-alike inside another key or a tensor's entry. */
    const char *dv = safetensors_meta(f, DIGEST_KEY);
    if (!dv || strlen(dv) != DIGEST_HEX || memcmp(dv, hdr + at, DIGEST_HEX) != 0) {
      rc = corrupt(e, name, "the digest checked is not __metadata__'s rumor.blake2b");
      goto fail;
    }
  }
  free(ranges);
  return 0;
fail:
  free(ranges);
  safetensors_free(f);
  return rc;
}

void safetensors_free(struct st_file *f) {
  free(f->buf);
  free(f->tensors);
  free(f->meta);
  json_decref(f->header);
  memset(f, 0, sizeof *f);
}

const struct st_tensor *safetensors_find(const struct st_file *f, const char *name) {
  for (size_t i = 0; i < f->ntensors; i++)
    if (strcmp(f->tensors[i].name, name) == 0) return &f->tensors[i];
  return NULL;
}

const char *safetensors_meta(const struct st_file *f, const char *key) {
  for (size_t i = 0; i < f->nmeta; i++)
    if (strcmp(f->meta[i].key, key) == 0) return f->meta[i].value;
  return NULL;
}
