/*
 * safetensors — reading and writing the safetensors format
 * (https://huggingface.co/docs/safetensors): an 8-byte little-endian header
 * length, a JSON header naming each tensor's dtype, shape and byte range, and
 * the raw little-endian data. PyTorch and the Hugging Face stack read the
 * files rumor writes.
 *
 * Integrity: rumor adds "rumor.blake2b" to the header's __metadata__, a
 * BLAKE2b-256 digest of the whole file computed with that value's 64 hex
 * digits set to '0'. Any flipped bit or lost byte is therefore detected.
 * Files are written atomically (util's file_write_atomic).
 */
#ifndef RUMOR_PEER_SAFETENSORS_H
#define RUMOR_PEER_SAFETENSORS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tensor/tensor.h"
#include "util/json.h"

#define SAFETENSORS_MAX_HEADER (16u << 20)
#define SAFETENSORS_MAX_TENSORS 4096
#define SAFETENSORS_MAX_NAME 128

struct st_tensor {
  char name[SAFETENSORS_MAX_NAME];
  enum tensor_dtype dtype;
  int ndim;
  int64_t shape[TENSOR_MAX_DIMS];
  const void *data; /* host memory: the caller's when writing, the file buffer when read */
  size_t nbytes;
};

struct st_meta {
  const char *key, *value;
};

/* Writes the tensors in the order given, with the metadata pairs and the
 * integrity digest, atomically to `path` (mode 0644). */
int safetensors_write(const char *path, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                      size_t nmeta, struct rumor_err *e) RUMOR_MUST_CHECK;

struct st_file {
  uint8_t *buf; /* the whole file */
  size_t len;
  struct st_tensor *tensors;
  size_t ntensors;
  struct st_meta *meta;
  size_t nmeta;
  struct json_doc doc; /* owns the strings meta points to */
};

/* Reads and fully validates a file: header bounds, JSON shape, known dtypes,
 * every byte range inside the data section, ranges covering it without gaps
 * or overlap, sizes matching shapes, and (when present, or always when
 * `require_digest`) the rumor.blake2b digest. Returns 0, a negative errno, or
 * RUMOR_ECORRUPT with a message naming the file and the fault. */
int safetensors_read(const char *path, bool require_digest, struct st_file *f,
                     struct rumor_err *e) RUMOR_MUST_CHECK;
void safetensors_free(struct st_file *f);
const struct st_tensor *safetensors_find(const struct st_file *f, const char *name);
const char *safetensors_meta(const struct st_file *f, const char *key);

#endif /* RUMOR_PEER_SAFETENSORS_H */
