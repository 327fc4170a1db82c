/*
 * Fuzz harness: the safetensors reader (safetensors_parse, which
 * safetensors_read is a wrapper of; its header is parsed by jansson through
 * util/json_text.h), with and without a required digest.
 * Any input must be either refused with RUMOR_ECORRUPT or accepted as a file
 * whose tensors and metadata keep the reader's promises: every tensor's bytes
 * inside the data section and as many as its shape and dtype say, names
 * NUL-terminated and unique, metadata strings readable. A broken promise
 * aborts; nothing may crash, leak or read outside the input.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/train/train.h"
#include "tests/fuzz/fuzz.h"

static volatile uint8_t g_sink;
static bool g_verbose; /* RUMOR_FUZZ_VERBOSE=1: say what became of each input */

/* A copy in a buffer of exactly `size` bytes (so that AddressSanitizer sees
 * any read past the end), which safetensors_parse takes over. */
static uint8_t *copy_input(const uint8_t *data, size_t size) {
  if (size == 0) return NULL;
  uint8_t *buf = malloc(size);
  if (!buf) abort();
  memcpy(buf, data, size);
  return buf;
}

struct span {
  size_t begin, end;
};

static int span_cmp(const void *a, const void *b) {
  const struct span *x = a, *y = b;
  if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
  return x->end < y->end ? -1 : x->end > y->end;
}

/* Checks what an accepted file promises; aborts on a broken promise. */
static void walk(const struct st_file *f) {
  if (f->len < 8 || f->ntensors > SAFETENSORS_MAX_TENSORS) abort();
  uint64_t hlen = 0;
  for (int b = 0; b < 8; b++) hlen |= (uint64_t)f->buf[b] << (8 * b);
  if (hlen > f->len - 8) abort();
  const uint8_t *data = f->buf + 8 + hlen, *end = f->buf + f->len;
  struct span *spans = calloc(f->ntensors ? f->ntensors : 1, sizeof *spans);
  if (!spans) abort();
  for (size_t i = 0; i < f->ntensors; i++) {
    const struct st_tensor *t = &f->tensors[i];
    if (!memchr(t->name, '\0', sizeof t->name)) abort();
    if (t->ndim < 0 || t->ndim > TENSOR_MAX_DIMS) abort();
    /* The shape's element count, without overflow, must match the bytes. */
    uint64_t bytes = tensor_dtype_size(t->dtype);
    for (int d = 0; d < t->ndim; d++) {
      if (t->shape[d] < 0) abort();
      if (t->shape[d] != 0 && bytes > UINT64_MAX / (uint64_t)t->shape[d]) abort();
      bytes *= (uint64_t)t->shape[d];
    }
    if (bytes != t->nbytes) abort();
    const uint8_t *p = t->data;
    if (p < data || p > end || t->nbytes > (size_t)(end - p)) abort();
    if (t->nbytes) g_sink ^= p[0] ^ p[t->nbytes - 1];
    spans[i] = (struct span){(size_t)(p - data), (size_t)(p - data) + t->nbytes};
    if (safetensors_find(f, t->name) != t) abort(); /* names are unique */
  }
  /* No gaps, no overlap: sorted by start, the ranges tile the data. */
  qsort(spans, f->ntensors, sizeof *spans, span_cmp);
  size_t pos = 0;
  for (size_t i = 0; i < f->ntensors; i++) {
    if (spans[i].begin != pos) abort();
    pos = spans[i].end;
  }
  free(spans);
  if (pos != (size_t)(end - data)) abort();
  for (size_t i = 0; i < f->nmeta; i++) {
    const struct st_meta *m = &f->meta[i];
    if (!m->key || !m->value) abort();
    g_sink ^= (uint8_t)(strlen(m->key) + strlen(m->value));
    if (!safetensors_meta(f, m->key)) abort();
  }
}

static int parse(const uint8_t *data, size_t size, bool require_digest) {
  struct st_file f;
  struct rumor_err e = {0};
  int rc = safetensors_parse(copy_input(data, size), size, "fuzz", require_digest, &f, &e);
  if (g_verbose) fprintf(stderr, "%s: %s\n", require_digest ? "strict" : "lax", rc ? e.msg : "accepted");
  if (rc == 0) {
    walk(&f);
    safetensors_free(&f);
  } else if (rc != RUMOR_ECORRUPT || e.msg[0] == '\0') {
    abort(); /* a bad file is corrupt, and says why */
  }
  return rc;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  g_verbose = getenv("RUMOR_FUZZ_VERBOSE") != NULL;
  int lax = parse(data, size, false);
  int strict = parse(data, size, true);
  if (strict == 0 && lax != 0) abort(); /* requiring the digest only refuses more */
  return 0;
}
