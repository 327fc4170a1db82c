/* Weights from a Hugging Face model directory (--init-from). */
#include "peer/train/train.h"

#include <errno.h>
#include <stdlib.h>
#include <stdint.h>
#include <string.h>
#include <sys/stat.h>

#define HF_MAX_CONFIG (1u << 20)

static int read_spec(const char *dir, struct model_spec *spec, struct rumor_err *e) {
  char path[1100];
  checkpoint_dir_file(dir, CHECKPOINT_CONFIG_FILE, path, sizeof path);
  uint8_t *text;
  size_t len;
  int rc = file_read_all(path, HF_MAX_CONFIG, &text, &len, e);
  if (rc) return rc;
  rc = model_spec_from_hf_config((const char *)text, len, path, spec, e);
  free(text);
  return rc;
}

/* Converts one tensor's values to F32 into `out`. A file's data need not be
 * aligned (any header length is valid), so 16-bit values are read through
 * an aligned copy when they are not. */
static int convert(const struct st_tensor *t, const char *path, float *out, int64_t numel, struct rumor_err *e) {
  size_t n = (size_t)numel;
  const uint16_t *halves = t->data;
  uint16_t *copy = NULL;
  if ((t->dtype == TENSOR_F16 || t->dtype == TENSOR_BF16) && (uintptr_t)t->data % _Alignof(uint16_t)) {
    copy = xmalloc(n ? n * sizeof *copy : 1);
    memcpy(copy, t->data, n * sizeof *copy);
    halves = copy;
  }
  switch (t->dtype) {
  case TENSOR_F32: memcpy(out, t->data, n * sizeof(float)); return 0;
  case TENSOR_F16: half_to_f32_n(out, halves, n); free(copy); return 0;
  case TENSOR_BF16: bf16_to_f32_n(out, halves, n); free(copy); return 0;
  default:
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: tensor %s is %s; F32, F16 or BF16 expected", path, t->name,
                         tensor_dtype_name(t->dtype));
  }
}

/* One tensor of the file into its table entry's place. */
static int import_tensor(const struct st_tensor *t, const char *path, const struct model_table *table, bool *seen,
                         float *params, struct rumor_err *e) {
  const struct model_param *p;
  switch (model_hf_lookup(table, t->name, &p)) {
  case MODEL_HF_IGNORE: return 0;
  case MODEL_HF_UNKNOWN:
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: tensor %s is not part of the model in %s", path, t->name,
                         CHECKPOINT_CONFIG_FILE);
  case MODEL_HF_ENTRY: break;
  }
  bool same = t->ndim == p->ndim;
  for (int d = 0; same && d < p->ndim; d++) same = t->shape[d] == p->shape[d];
  if (!same) {
    char want[64] = "", got[64] = "";
    for (int d = 0; d < p->ndim; d++)
      snprintf(want + strlen(want), sizeof want - strlen(want), "%s%lld", d ? "×" : "", (long long)p->shape[d]);
    for (int d = 0; d < t->ndim; d++)
      snprintf(got + strlen(got), sizeof got - strlen(got), "%s%lld", d ? "×" : "", (long long)t->shape[d]);
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: tensor %s has shape %s; the model needs %s", path, t->name, got,
                         want);
  }
  size_t i = (size_t)(p - table->p);
  if (seen[i]) return rumor_err_set(e, RUMOR_EFORMAT, "%s: tensor %s is there twice (with and without prefix)", path,
                                    p->name);
  seen[i] = true;
  return convert(t, path, params + p->offset, p->numel, e);
}

int hf_import(const char *dir, struct model_spec *spec, float **params, struct rumor_err *e) {
  int rc = read_spec(dir, spec, e);
  if (rc) return rc;
  char path[1100];
  checkpoint_dir_file(dir, CHECKPOINT_MODEL_FILE, path, sizeof path);
  struct st_file f;
  if ((rc = safetensors_read(path, false, &f, e))) {
    struct stat st;
    char index[1100];
    checkpoint_dir_file(dir, "model.safetensors.index.json", index, sizeof index);
    if (rc == -ENOENT && stat(index, &st) == 0)
      return rumor_err_set(e, RUMOR_EFORMAT, "%s: sharded checkpoints (%s) are not supported; save with "
                                             "max_shard_size large enough for one file", dir, index);
    return rc;
  }
  struct model_table table;
  model_table_build(spec, &table);
  bool *seen = xcalloc(table.n, sizeof *seen);
  float *out = malloc((size_t)table.nparams * sizeof(float));
  if (!out) rc = rumor_err_set(e, -ENOMEM, "%s: cannot allocate %lld parameters", dir, (long long)table.nparams);
  for (size_t i = 0; rc == 0 && i < f.ntensors; i++) rc = import_tensor(&f.tensors[i], path, &table, seen, out, e);
  for (size_t i = 0; rc == 0 && i < table.n; i++)
    if (!seen[i]) rc = rumor_err_set(e, RUMOR_EFORMAT, "%s: tensor %s is missing", path, table.p[i].name);
  free(seen);
  model_table_free(&table);
  safetensors_free(&f);
  if (rc) {
    free(out);
    return rc;
  }
  *params = out;
  return 0;
}
