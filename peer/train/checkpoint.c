/* Model, optimizer and training position ↔ safetensors. */
#include "peer/train/train.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <libgen.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "util/json_text.h"


void checkpoint_prev_path(const char *path, char *out, size_t n) { snprintf(out, n, "%s.prev", path); }

/* True when the process (or thread) `pid` started after Unix time `t`, so
 * it cannot have written a file last modified at `t`: its PID was reused.
 * False when unknown. */
static bool started_after(long pid, time_t t) {
  char path[64];
  snprintf(path, sizeof path, "/proc/%ld/stat", pid);
  FILE *f = fopen(path, "r");
  if (!f) return false;
  char buf[1024];
  size_t n = fread(buf, 1, sizeof buf - 1, f);
  fclose(f);
  buf[n] = '\0';
  const char *p = strrchr(buf, ')'); /* the command name may hold spaces */
  unsigned long long start = 0;
  /* After ")": state (field 3) ... starttime is field 22. */
  for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
  if (!p || sscanf(p + 1, "%llu", &start) != 1) return false;
  f = fopen("/proc/stat", "r");
  if (!f) return false;
  unsigned long long btime = 0;
  char line[256];
  while (fgets(line, sizeof line, f))
    if (sscanf(line, "btime %llu", &btime) == 1) break;
  fclose(f);
  long hz = sysconf(_SC_CLK_TCK);
  if (!btime || hz <= 0) return false;
  return (double)btime + (double)start / (double)hz > (double)t + 1.0;
}

/* Removes the temporaries of `path` and of `path`.prev (util's atomic
 * files: `path`.tmp.PID.HEX, and the older `path`.tmp.PID) whose writer
 * (PID) no longer runs: what a process killed mid-write leaves behind. A PID
 * that runs again, but in a process started after the file was last
 * written, is a reused one (pid_max is 32768 on some machines). Best
 * effort. */
static void remove_stale_temporaries(const char *path) {
  char *dcopy = xstrdup(path), *bcopy = xstrdup(path);
  const char *dir = dirname(dcopy), *base = basename(bcopy);
  char prev[CHECKPOINT_PATH_MAX + 8];
  checkpoint_prev_path(base, prev, sizeof prev);
  DIR *d = opendir(dir);
  for (struct dirent *de; d && (de = readdir(d)) != NULL;) {
    long pid = file_atomic_temp_pid(de->d_name, base);
    if (!pid) pid = file_atomic_temp_pid(de->d_name, prev);
    if (!pid || pid == (long)getpid()) continue;
    char full[1400];
    int fl = snprintf(full, sizeof full, "%s/%s", dir, de->d_name);
    if (fl < 0 || (size_t)fl >= sizeof full) continue; /* never act on a cut name */
    struct stat st;
    bool gone = kill((pid_t)pid, 0) < 0 && errno == ESRCH;
    if (!gone && !(stat(full, &st) == 0 && started_after(pid, st.st_mtime))) continue; /* may still be at work */
    if (unlink(full) == 0) log_info("removed %s, left by a process that died while writing a checkpoint", full);
  }
  if (d) closedir(d);
  free(dcopy);
  free(bcopy);
}

/* Makes `path`.prev another name of the current file at `path` (a hard link,
 * put in place by rename so `path`.prev is never missing or partial).
 * Returns 0 when there is no current file; logs and returns an error code
 * when the link cannot be made (the new checkpoint is still written). */
static int keep_previous(const char *path) {
  char prev[CHECKPOINT_PATH_MAX + 8];
  checkpoint_prev_path(path, prev, sizeof prev);
  struct rumor_err e;
  int rc = file_link_atomic(path, prev, &e);
  if (rc == -ENOENT) return 0;
  if (rc) log_warn("cannot keep the previous checkpoint as %s: %s", prev, e.msg);
  return rc;
}

/* The metadata strings of a checkpoint; `b` holds their text. */
struct meta_text {
  char spec[MODEL_SPEC_MAX], step[24], epoch[24], sie[24], samples[24], seed[24], dseed[24], shard[48], batch[24],
      epochs[24], sched[24], mean[32], std[32], stage[32], layers[32];
  struct st_meta m[24];
  size_t n;
};

static void meta_add(struct meta_text *t, const char *key, const char *value) {
  RUMOR_ASSERT(t->n < sizeof t->m / sizeof t->m[0]);
  t->m[t->n++] = (struct st_meta){key, value};
}

static void make_meta(const struct model *m, const struct optim *o, const struct ckpt_info *info,
                      struct meta_text *t) {
  memset(t, 0, sizeof *t);
  model_spec_format(&m->spec, t->spec, sizeof t->spec);
  snprintf(t->step, sizeof t->step, "%" PRId64, info->st.step);
  snprintf(t->epoch, sizeof t->epoch, "%" PRId64, info->st.epoch);
  snprintf(t->sie, sizeof t->sie, "%" PRId64, info->st.step_in_epoch);
  snprintf(t->samples, sizeof t->samples, "%" PRId64, info->st.samples);
  snprintf(t->seed, sizeof t->seed, "%" PRIu64, info->seed);
  snprintf(t->dseed, sizeof t->dseed, "%" PRIu64, info->data_seed);
  snprintf(t->shard, sizeof t->shard, "%" PRId64 "/%" PRId64, info->shard.index, info->shard.count);
  snprintf(t->batch, sizeof t->batch, "%" PRId64, info->batch);
  snprintf(t->epochs, sizeof t->epochs, "%" PRId64, info->epochs);
  snprintf(t->sched, sizeof t->sched, "%" PRId64, info->schedule_steps);
  snprintf(t->mean, sizeof t->mean, "%.17g", info->norm_mean);
  snprintf(t->std, sizeof t->std, "%.17g", info->norm_std);
  bool stage = info->stages > 0;
  meta_add(t, "format", "pt");
  meta_add(t, "rumor.format", stage ? CHECKPOINT_STAGE_FORMAT : CHECKPOINT_FORMAT);
  meta_add(t, "rumor.model", t->spec);
  meta_add(t, "rumor.step", t->step);
  meta_add(t, "rumor.epoch", t->epoch);
  meta_add(t, "rumor.step_in_epoch", t->sie);
  meta_add(t, "rumor.samples", t->samples);
  meta_add(t, "rumor.seed", t->seed);
  meta_add(t, "rumor.data_seed", t->dseed);
  meta_add(t, "rumor.shard", t->shard);
  meta_add(t, "rumor.batch", t->batch);
  meta_add(t, "rumor.epochs", t->epochs);
  meta_add(t, "rumor.schedule_steps", t->sched);
  meta_add(t, "rumor.optimizer", o ? optim_kind_name(o->cfg.kind) : "none");
  meta_add(t, "rumor.norm_mean", t->mean);
  meta_add(t, "rumor.norm_std", t->std);
  meta_add(t, "rumor.peer_id", info->peer_id);
  meta_add(t, "rumor.tf32", info->tf32 ? "true" : "false");
  if (stage) {
    snprintf(t->stage, sizeof t->stage, "%d/%d", info->stage, info->stages);
    snprintf(t->layers, sizeof t->layers, "%d-%d", m->u0, m->u1 - 1);
    meta_add(t, "rumor.group", info->group);
    meta_add(t, "rumor.stage", t->stage);
    meta_add(t, "rumor.layers", t->layers);
    meta_add(t, "rumor.split", info->split);
  }
}

/* Writes one safetensors file to `path` with the durability described at
 * checkpoint_save: staged, the current file kept as .prev, renamed. */
static int save_file(const char *path, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                     size_t nmeta, struct rumor_err *e) {
  remove_stale_temporaries(path);
  /* The new file is complete and durable under its temporary name before
   * the current one becomes the previous one and the new one takes its
   * place: a failed write (full disk) changes neither. */
  struct file_atomic fa;
  int rc = file_atomic_open(&fa, path, 0644, e);
  if (rc == 0) rc = safetensors_write_to(&fa, ts, nts, meta, nmeta, e);
  if (rc == 0) rc = file_atomic_sync(&fa, e);
  if (rc) /* the message names the temporary file */
    return rumor_err_prefix(e, "cannot save %s", path);
  (void)keep_previous(path);
  return file_atomic_commit(&fa, 0, e);
}

int checkpoint_save_tensors(const char *path, const struct st_tensor *ts, size_t nts, const struct st_meta *meta,
                            size_t nmeta, struct rumor_err *e) {
  if (strlen(path) > CHECKPOINT_PATH_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "checkpoint path of %zu bytes is too long (at most %d): %.60s...",
                         strlen(path), CHECKPOINT_PATH_MAX, path);
  return save_file(path, ts, nts, meta, nmeta, e);
}

int checkpoint_read_tensors(const char *path, struct st_file *f, char *used, size_t used_len, struct rumor_err *e) {
  struct rumor_err first = {0}, second = {0};
  int rc = safetensors_read(path, true, f, &first);
  if (rc == 0) {
    if (used) snprintf(used, used_len, "%s", path);
    return 0;
  }
  char prev[CHECKPOINT_PATH_MAX + 8];
  checkpoint_prev_path(path, prev, sizeof prev);
  int rc2 = safetensors_read(prev, true, f, &second);
  if (rc2 == 0) {
    if (rc != -ENOENT) log_warn("checkpoint rejected: %s; using the previous checkpoint %s", first.msg, prev);
    if (used) snprintf(used, used_len, "%s", prev);
    return 0;
  }
  if (rc == -ENOENT && rc2 == -ENOENT) return 1;
  if (rc2 == -ENOENT) return rumor_err_set(e, rc, "%s", first.msg);
  return rumor_err_set(e, rc, "%s; the previous checkpoint is unusable too: %s", first.msg, second.msg);
}

bool checkpoint_is_dir(const char *path) {
  struct stat st;
  size_t n = strlen(path);
  return (n > 0 && path[n - 1] == '/') || (stat(path, &st) == 0 && S_ISDIR(st.st_mode));
}

int checkpoint_check_dest(const char *path, struct rumor_err *e) {
  size_t n = strlen(path);
  if (n == 0) return rumor_err_set(e, RUMOR_EFORMAT, "empty path");
  if (n > CHECKPOINT_PATH_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "a path of %zu bytes is too long (at most %d): %.60s...", n,
                         CHECKPOINT_PATH_MAX, path);
  bool dir = checkpoint_is_dir(path);
  char bare[CHECKPOINT_PATH_MAX + 1];
  snprintf(bare, sizeof bare, "%s", path);
  while (n > 1 && bare[n - 1] == '/') bare[--n] = '\0';
  struct stat st;
  bool exists = stat(bare, &st) == 0;
  if (exists && dir && !S_ISDIR(st.st_mode))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: %s exists and is not a directory", path, bare);
  if (exists && !dir && !S_ISREG(st.st_mode))
    return rumor_err_set(e, -EINVAL, "%s is not a regular file (it is %s)", path, file_kind(st.st_mode));
  /* Where the files are created: the directory itself, or the one holding
   * the file (or the directory checkpoint, which the first save makes). */
  const char *parent = exists && dir ? bare : dirname(bare); /* in bare, or static */
  if (stat(parent, &st) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: directory %s: %s", path, parent, strerror(errno));
  if (!S_ISDIR(st.st_mode))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: %s is not a directory", path, parent);
  if (access(parent, W_OK | X_OK) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: cannot write in directory %s: %s", path, parent,
                         strerror(errno));
  return 0;
}

void checkpoint_dir_file(const char *dir, const char *file, char *out, size_t n) {
  size_t len = strlen(dir);
  snprintf(out, n, "%s%s%s", dir, len && dir[len - 1] == '/' ? "" : "/", file);
}

/* A directory checkpoint's config.json, when the model has one. */
static int save_config(const char *dir, const struct model_spec *spec, struct rumor_err *e) {
  json_t *cfg = model_hf_config(spec);
  if (!cfg) return 0;
  size_t len;
  char *text = json_text_dump(cfg, &len);
  json_decref(cfg);
  char path[1100];
  checkpoint_dir_file(dir, CHECKPOINT_CONFIG_FILE, path, sizeof path);
  struct file_part parts[2] = {{text, len}, {STR_LIT("\n")}};
  int rc = file_write_atomic(path, parts, 2, 0644, 0, e);
  free(text);
  return rc;
}

/* The directory layout (train.h): the optimizer state first, then the
 * weights, whose step names the state that belongs to them. */
static int save_dir(const char *dir, const struct model *m, const struct st_tensor *ts, size_t nweights,
                    size_t nstate, const struct meta_text *meta, struct rumor_err *e) {
  if (mkdir(dir, 0755) < 0 && errno != EEXIST)
    return rumor_err_set(e, -errno, "cannot create checkpoint directory %s: %s", dir, strerror(errno));
  char path[1100];
  int rc = 0;
  if (nstate) {
    checkpoint_dir_file(dir, CHECKPOINT_OPTIM_FILE, path, sizeof path);
    rc = save_file(path, ts + nweights, nstate, meta->m, meta->n, e);
  }
  checkpoint_dir_file(dir, CHECKPOINT_MODEL_FILE, path, sizeof path);
  if (rc == 0) rc = save_file(path, ts, nweights, meta->m, meta->n, e);
  if (rc == 0) rc = save_config(dir, &m->spec, e);
  return rc;
}

static int save_from(const char *path, const struct model *m, const struct optim *o, const float *params,
                     const float *state, const struct ckpt_info *info, struct rumor_err *e);

int checkpoint_save(const char *path, const struct model *m, const struct optim *o,
                    const struct ckpt_info *info, struct rumor_err *e) {
  if (strlen(path) > CHECKPOINT_PATH_MAX) return checkpoint_save_host(path, m, o, NULL, info, e); /* its message */
  /* On the CPU the tensors are host memory already: written from where they
   * are. A copy of the whole model and state at every save (a peer saves
   * every few seconds) was a large allocation again and again, whose freed
   * blocks glibc kept: all-reduce members' RSS climbed 15-17 % in
   * tests/bench/bench-chaos.sh without a fault. */
  if (tensor_backend_device(m->be) == TENSOR_DEVICE_CPU) {
    /* What the copy's bounds checks said: the tensors hold what is read. */
    RUMOR_ASSERT(tensor_numel(&m->params) >= m->nparams);
    RUMOR_ASSERT(!o || tensor_numel(&o->state) >= m->nparams * optim_state_per_param(o->cfg.kind));
    return save_from(path, m, o, m->params.data, o ? o->state.data : NULL, info, e);
  }
  int64_t P = m->nparams;
  int nstate = o ? optim_state_per_param(o->cfg.kind) : 0;
  size_t pbytes = (size_t)P * sizeof(float);
  float *host = tensor_host_alloc(m->be, pbytes * (size_t)(1 + nstate));
  if (!host) return rumor_err_set(e, -ENOMEM, "cannot allocate %zu bytes to save %s", pbytes * (size_t)(1 + nstate), path);
  tensor_copy_to_host(&m->params, 0, host, pbytes);
  if (o) tensor_copy_to_host(&o->state, 0, host + P, pbytes * (size_t)nstate);
  int rc = checkpoint_save_host(path, m, o, host, info, e);
  tensor_host_free(m->be, host);
  return rc;
}

int checkpoint_save_host(const char *path, const struct model *m, const struct optim *o, const float *host,
                         const struct ckpt_info *info, struct rumor_err *e) {
  return save_from(path, m, o, host, host ? host + m->nparams : NULL, info, e);
}

/* checkpoint_save_host with the parameters at `params` and the optimizer
 * state (per-param parts of m->nparams floats, one after the other) at
 * `state`. */
static int save_from(const char *path, const struct model *m, const struct optim *o, const float *params,
                     const float *state, const struct ckpt_info *info, struct rumor_err *e) {
  /* Every name derived from it (.prev, staging, a directory's files) must
   * fit its buffer: a cut name could unlink the wrong file. */
  if (strlen(path) > CHECKPOINT_PATH_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "checkpoint path of %zu bytes is too long (at most %d): %.60s...",
                         strlen(path), CHECKPOINT_PATH_MAX, path);
  int64_t P = m->nparams;
  int nstate = o ? optim_state_per_param(o->cfg.kind) : 0;
  size_t pbytes = (size_t)P * sizeof(float);

  /* The model's entries for the units it holds, then the optimizer state,
   * then the sync scheme's tensors. */
  const struct ckpt_extra *x = info->extra;
  size_t nextra = x ? x->n : 0;
  RUMOR_ASSERT(nextra <= CKPT_EXTRA_MAX);
  struct st_tensor *ts = xcalloc(m->table.n + (size_t)nstate + nextra, sizeof *ts);
  size_t nts = 0;
  for (size_t i = 0; i < m->table.n; i++) {
    const struct model_param *p = &m->table.p[i];
    if (p->unit < m->u0 || p->unit >= m->u1) continue;
    struct st_tensor *t = &ts[nts++];
    *t = (struct st_tensor){.dtype = TENSOR_F32, .ndim = p->ndim, .data = params + (p->offset - m->param_base),
                            .nbytes = (size_t)p->numel * sizeof(float)};
    memcpy(t->shape, p->shape, sizeof t->shape);
    snprintf(t->name, sizeof t->name, "%s", p->name);
  }
  size_t nweights = nts;
  for (int s = 0; s < nstate; s++) {
    struct st_tensor *t = &ts[nts++];
    *t = (struct st_tensor){.dtype = TENSOR_F32, .ndim = 1, .shape = {P}, .data = state + P * s, .nbytes = pbytes};
    snprintf(t->name, sizeof t->name, "%s", optim_state_name(o->cfg.kind, s));
  }
  for (size_t i = 0; i < nextra; i++) {
    struct st_tensor *t = &ts[nts++];
    *t = (struct st_tensor){.dtype = TENSOR_F32, .ndim = 1, .shape = {x->t[i].len}, .data = x->t[i].data,
                            .nbytes = (size_t)x->t[i].len * sizeof(float)};
    snprintf(t->name, sizeof t->name, "%s", x->t[i].name);
  }
  struct meta_text meta;
  make_meta(m, o, info, &meta);
  int rc = checkpoint_is_dir(path) ? save_dir(path, m, ts, nweights, nts - nweights, &meta, e)
                                   : save_file(path, ts, nts, meta.m, meta.n, e);
  free(ts);
  return rc;
}

/* An integer of the metadata within [min, max], the range the matching
 * option takes: a value past it (a damaged or crafted file; the digest has
 * no key) would size buffers that no command line can ask for. */
static int meta_i64(const struct checkpoint *ck, const char *path, const char *key, int64_t min, int64_t max,
                    int64_t *out, struct rumor_err *e) {
  const char *v = safetensors_meta(&ck->file, key);
  if (!v || parse_i64(v, INT64_MIN, INT64_MAX, out))
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata %s is missing or not an integer", path, key);
  if (*out < min || *out > max)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata %s is %lld, outside [%lld, %lld]", path, key,
                         (long long)*out, (long long)min, (long long)max);
  return 0;
}

static int meta_f64(const struct checkpoint *ck, const char *path, const char *key, double *out, struct rumor_err *e) {
  const char *v = safetensors_meta(&ck->file, key);
  if (!v || parse_f64(v, -1e30, 1e30, out))
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata %s is missing or not a number", path, key);
  return 0;
}

/* The tensor `name` of the checkpoint: its weights' file, then (optimizer
 * state in a directory checkpoint) the state's. */
static const struct st_tensor *ck_find(const struct checkpoint *ck, const char *name) {
  const struct st_tensor *t = safetensors_find(&ck->file, name);
  return t || !ck->state_file.buf ? t : safetensors_find(&ck->state_file, name);
}

const float *checkpoint_optim_part(const struct checkpoint *ck, enum optim_kind kind, int part) {
  if (!ck->has_optim || ck->info.optim_kind != kind) return NULL;
  const struct st_tensor *t = ck_find(ck, optim_state_name(kind, part));
  return t ? t->data : NULL;
}

static int expect_tensor(const struct checkpoint *ck, const char *path, const char *name, int ndim,
                         const int64_t *shape, struct rumor_err *e) {
  const struct st_tensor *t = ck_find(ck, name);
  if (!t) return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor %s is missing", path, name);
  bool ok = t->dtype == TENSOR_F32 && t->ndim == ndim;
  for (int d = 0; ok && d < ndim; d++) ok = t->shape[d] == shape[d];
  if (!ok) return rumor_err_set(e, RUMOR_ECORRUPT, "%s: tensor %s has the wrong dtype or shape for the model", path, name);
  return 0;
}

/* The optimizer state of a directory checkpoint whose weights are at step
 * `step`: optimizer.safetensors, or its .prev when a save was cut between
 * the two files. Sets *found; neither file there is no error (the state
 * starts from zero, with a warning), but a file that is there and unusable
 * (damaged, or of another step) is: the caller then falls back to the
 * previous checkpoint rather than drop the state that belongs to it. */
static int open_dir_state(struct checkpoint *ck, const char *dir, int64_t step, bool *found, struct rumor_err *e) {
  char path[1100], prev[1110];
  checkpoint_dir_file(dir, CHECKPOINT_OPTIM_FILE, path, sizeof path);
  checkpoint_prev_path(path, prev, sizeof prev);
  const char *candidates[2] = {path, prev};
  char why[2][512];
  int absent = 0;
  *found = false;
  for (int i = 0; i < 2; i++) {
    struct rumor_err fe = {0};
    int64_t got;
    if (safetensors_read(candidates[i], true, &ck->state_file, &fe) != 0) {
      absent += fe.code == -ENOENT;
      snprintf(why[i], sizeof why[i], "%.500s", fe.msg);
      continue;
    }
    const char *v = safetensors_meta(&ck->state_file, "rumor.step");
    if (v && parse_i64(v, 0, INT64_MAX, &got) == 0 && got == step) return *found = true, 0;
    snprintf(why[i], sizeof why[i], "%.400s holds the state of step %.40s", candidates[i], v ? v : "(none)");
    safetensors_free(&ck->state_file);
  }
  if (absent == 2) {
    log_warn("%s: no optimizer state (neither %s nor %s exists)", dir, path, prev);
    return 0;
  }
  return rumor_err_set(e, RUMOR_ECORRUPT, "%s: no usable optimizer state of step %lld: %s; %s", dir, (long long)step,
                       why[0], why[1]);
}

/* A file whose optimizer state, when not in the file itself, is in the
 * directory `state_dir` (a directory checkpoint; NULL otherwise). */
static int open_at(const char *path, const char *state_dir, bool part_ok, struct checkpoint *ck,
                   struct rumor_err *e);

static int open_latest(const char *path, bool part_ok, struct checkpoint *ck, char *used, size_t used_len,
                       struct rumor_err *e);
static int open_stage_set(const char *path, struct checkpoint *ck, struct rumor_err *e);

/* True when `whole` (a checkpoint file, or a directory checkpoint's model
 * file) is missing but a pipelined group's first stage file for `path`
 * (train_stage_checkpoint_path's, or its .prev) stands for it. */
static bool stage_set_at(const char *path, const char *whole) {
  struct stat st;
  char first[CHECKPOINT_PATH_MAX + 32], prev[CHECKPOINT_PATH_MAX + 40];
  if (stat(whole, &st) == 0 || errno != ENOENT) return false;
  train_stage_checkpoint_path(path, 0, first, sizeof first);
  checkpoint_prev_path(first, prev, sizeof prev);
  return stat(first, &st) == 0 || stat(prev, &st) == 0;
}

static int open_path(const char *path, bool part_ok, struct checkpoint *ck, struct rumor_err *e) {
  if (!checkpoint_is_dir(path))
    return stage_set_at(path, path) ? open_stage_set(path, ck, e) : open_at(path, NULL, part_ok, ck, e);
  char model[1100];
  checkpoint_dir_file(path, CHECKPOINT_MODEL_FILE, model, sizeof model);
  return stage_set_at(path, model) ? open_stage_set(path, ck, e) : open_at(model, path, part_ok, ck, e);
}

int checkpoint_open(const char *path, struct checkpoint *ck, struct rumor_err *e) {
  return open_path(path, false, ck, e);
}

/* A stage file's rumor.stage ("s/S") and rumor.layers ("a-b": units a to b)
 * into ck: the units it holds and where their parameters lie. */
static int stage_units(struct checkpoint *ck, const char *path, struct rumor_err *e) {
  const char *stage = safetensors_meta(&ck->file, "rumor.stage"), *layers = safetensors_meta(&ck->file, "rumor.layers");
  int s, S, a, b, end = 0;
  if (!stage || sscanf(stage, "%d/%d%n", &s, &S, &end) != 2 || stage[end] || S < 1 || s < 0 || s >= S ||
      S > PIPE_MAX_STAGES)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata rumor.stage is missing or not s/S", path);
  end = 0;
  if (!layers || sscanf(layers, "%d-%d%n", &a, &b, &end) != 2 || layers[end] || a < 0 || b < a ||
      b >= ck->table.nunits)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata rumor.layers is missing or outside the model's %d units",
                         path, ck->table.nunits);
  ck->info.stage = s;
  ck->info.stages = S;
  ck->u0 = a;
  ck->u1 = b + 1;
  ck->base = ck->table.unit_offset[a];
  ck->nparams = ck->table.unit_offset[b + 1] - ck->base;
  return 0;
}

static int open_at(const char *path, const char *state_dir, bool part_ok, struct checkpoint *ck,
                   struct rumor_err *e) {
  memset(ck, 0, sizeof *ck);
  int rc = safetensors_read(path, true, &ck->file, e);
  if (rc) return rc;
  struct ckpt_info *in = &ck->info;
  const char *fmt = safetensors_meta(&ck->file, "rumor.format");
  bool part = part_ok && fmt && strcmp(fmt, CHECKPOINT_STAGE_FORMAT) == 0;
  if (!fmt || (!part && strcmp(fmt, CHECKPOINT_FORMAT) != 0)) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: not a rumor checkpoint of format %s%s%s (rumor.format is %s)", path,
                       CHECKPOINT_FORMAT, part_ok ? " or " : "", part_ok ? CHECKPOINT_STAGE_FORMAT : "",
                       fmt ? fmt : "missing");
    goto fail;
  }
  const char *spec = safetensors_meta(&ck->file, "rumor.model");
  struct rumor_err se;
  if (!spec || model_spec_parse(spec, &in->spec, &se)) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata rumor.model is missing or invalid", path);
    goto fail;
  }
  int64_t seed, dseed;
  if ((rc = meta_i64(ck, path, "rumor.step", 0, TRAIN_STEPS_MAX, &in->st.step, e)) ||
      (rc = meta_i64(ck, path, "rumor.epoch", 0, TRAIN_STEPS_MAX, &in->st.epoch, e)) ||
      (rc = meta_i64(ck, path, "rumor.step_in_epoch", 0, TRAIN_STEPS_MAX, &in->st.step_in_epoch, e)) ||
      (rc = meta_i64(ck, path, "rumor.samples", 0, INT64_MAX, &in->st.samples, e)) ||
      (rc = meta_i64(ck, path, "rumor.seed", 0, INT64_MAX, &seed, e)) ||
      (rc = meta_i64(ck, path, "rumor.data_seed", 0, INT64_MAX, &dseed, e)) ||
      (rc = meta_i64(ck, path, "rumor.batch", 1, TRAIN_BATCH_MAX, &in->batch, e)) ||
      (safetensors_meta(&ck->file, "rumor.epochs") &&
       (rc = meta_i64(ck, path, "rumor.epochs", 0, TRAIN_EPOCHS_MAX, &in->epochs, e))) ||
      (safetensors_meta(&ck->file, "rumor.schedule_steps") &&
       (rc = meta_i64(ck, path, "rumor.schedule_steps", 0, TRAIN_STEPS_MAX, &in->schedule_steps, e))) ||
      (rc = meta_f64(ck, path, "rumor.norm_mean", &in->norm_mean, e)) ||
      (rc = meta_f64(ck, path, "rumor.norm_std", &in->norm_std, e)))
    goto fail;
  in->seed = (uint64_t)seed;
  in->data_seed = (uint64_t)dseed;
  if (in->norm_std <= 0.0) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata rumor.norm_std must be positive", path);
    goto fail;
  }
  const char *shard = safetensors_meta(&ck->file, "rumor.shard");
  if (!shard || shard_parse(shard, &in->shard, NULL)) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: metadata rumor.shard is missing or invalid", path);
    goto fail;
  }
  const char *peer = safetensors_meta(&ck->file, "rumor.peer_id");
  snprintf(in->peer_id, sizeof in->peer_id, "%s", peer ? peer : "");
  const char *tf32 = safetensors_meta(&ck->file, "rumor.tf32");
  in->tf32 = tf32 && strcmp(tf32, "true") == 0;

  model_table_build(&in->spec, &ck->table);
  ck->u0 = 0;
  ck->u1 = ck->table.nunits;
  ck->base = 0;
  ck->nparams = ck->table.nparams;
  if (part && (rc = stage_units(ck, path, e))) goto fail;
  for (size_t i = 0; i < ck->table.n; i++) {
    const struct model_param *p = &ck->table.p[i];
    if (p->unit < ck->u0 || p->unit >= ck->u1) continue;
    if ((rc = expect_tensor(ck, path, p->name, p->ndim, p->shape, e))) goto fail;
  }
  const char *opt = safetensors_meta(&ck->file, "rumor.optimizer");
  if (opt && strcmp(opt, "none") != 0) {
    if (optim_kind_parse(opt, &in->optim_kind)) {
      rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: unknown optimizer '%s'", path, opt);
      goto fail;
    }
    ck->has_optim = true;
    if (state_dir && (rc = open_dir_state(ck, state_dir, in->st.step, &ck->has_optim, e))) goto fail;
    int64_t P = ck->nparams;
    for (int s = 0; ck->has_optim && s < optim_state_per_param(in->optim_kind); s++)
      if ((rc = expect_tensor(ck, path, optim_state_name(in->optim_kind, s), 1, &P, e))) goto fail;
  }
  return 0;
fail:
  checkpoint_close(ck);
  return rc;
}

static int open_latest(const char *path, bool part_ok, struct checkpoint *ck, char *used, size_t used_len,
                       struct rumor_err *e) {
  struct rumor_err first = {0};
  int rc = open_path(path, part_ok, ck, &first);
  if (rc == 0) {
    if (used) snprintf(used, used_len, "%s", path);
    return 0;
  }
  char model[1100], prev[1110];
  bool dir = checkpoint_is_dir(path);
  if (dir) checkpoint_dir_file(path, CHECKPOINT_MODEL_FILE, model, sizeof model);
  checkpoint_prev_path(dir ? model : path, prev, sizeof prev);
  struct rumor_err second = {0};
  int rc2 = open_at(prev, dir ? path : NULL, part_ok, ck, &second);
  if (rc2 == 0) {
    log_warn("checkpoint rejected: %s; using the previous checkpoint %s (step %lld)", first.msg, prev,
             (long long)ck->info.st.step);
    if (used) snprintf(used, used_len, "%s", prev);
    return 0;
  }
  if (rc2 == -ENOENT) return rumor_err_set(e, rc, "%s", first.msg);
  return rumor_err_set(e, rc, "%s; the previous checkpoint is unusable too: %s", first.msg, second.msg);
}

int checkpoint_open_latest(const char *path, struct checkpoint *ck, char *used, size_t used_len,
                           struct rumor_err *e) {
  return open_latest(path, false, ck, used, used_len, e);
}

int checkpoint_open_part_latest(const char *path, struct checkpoint *ck, char *used, size_t used_len,
                                struct rumor_err *e) {
  return open_latest(path, true, ck, used, used_len, e);
}

/* Whether two files of one save agree on the run they belong to. */
static bool same_run(const struct ckpt_info *a, const struct ckpt_info *b) {
  return model_spec_equal(&a->spec, &b->spec) && a->st.step == b->st.step && a->st.epoch == b->st.epoch &&
         a->st.step_in_epoch == b->st.step_in_epoch && a->st.samples == b->st.samples && a->seed == b->seed &&
         a->data_seed == b->data_seed && a->batch == b->batch && a->shard.index == b->shard.index &&
         a->shard.count == b->shard.count;
}

/* The stage files of one save, put together into a whole model's
 * checkpoint in `ck` (its own buffer; the metadata of stage 0's file, the
 * sync scheme's tensors left out: a stage's are of its own layout). Every
 * stage file must be there (each with its .prev fallback), of the same
 * run and step, and together hold every unit once, in order. */
static int merge_stages(const char *path, struct checkpoint *part, int S, struct checkpoint *ck, struct rumor_err *e) {
  const struct checkpoint *p0 = &part[0];
  memset(ck, 0, sizeof *ck);
  ck->info = p0->info;
  ck->info.stage = ck->info.stages = 0;
  model_table_build(&ck->info.spec, &ck->table);
  ck->u0 = 0;
  ck->u1 = ck->table.nunits;
  ck->nparams = ck->table.nparams;
  ck->has_optim = true;
  for (int k = 0; k < S; k++)
    ck->has_optim = ck->has_optim && part[k].has_optim && part[k].info.optim_kind == p0->info.optim_kind;
  int nstate = ck->has_optim ? optim_state_per_param(p0->info.optim_kind) : 0;
  struct st_file *f = &ck->file;
  f->len = (size_t)ck->nparams * sizeof(float) * (size_t)(1 + nstate);
  f->buf = malloc(f->len ? f->len : 1);
  if (!f->buf) {
    model_table_free(&ck->table);
    return rumor_err_set(e, -ENOMEM, "no memory to put %s's %d stage files together", path, S);
  }
  f->tensors = xcalloc(ck->table.n + (size_t)nstate, sizeof *f->tensors);
  float *w = (float *)f->buf, *state = w + ck->nparams;
  for (size_t i = 0; i < ck->table.n; i++) {
    const struct model_param *p = &ck->table.p[i];
    const struct checkpoint *from = &part[0];
    for (int k = 0; k < S; k++)
      if (p->unit >= part[k].u0 && p->unit < part[k].u1) from = &part[k];
    const struct st_tensor *t = safetensors_find(&from->file, p->name); /* checked by open_at */
    struct st_tensor *m = &f->tensors[f->ntensors++];
    *m = *t;
    m->data = w + p->offset;
    memcpy(w + p->offset, t->data, t->nbytes);
  }
  for (int s = 0; s < nstate; s++) {
    struct st_tensor *m = &f->tensors[f->ntensors++];
    float *dst = state + (int64_t)s * ck->nparams;
    *m = (struct st_tensor){.dtype = TENSOR_F32, .ndim = 1, .shape = {ck->nparams}, .data = dst,
                            .nbytes = (size_t)ck->nparams * sizeof(float)};
    snprintf(m->name, sizeof m->name, "%s", optim_state_name(p0->info.optim_kind, s));
    for (int k = 0; k < S; k++)
      memcpy(dst + part[k].base, ck_find(&part[k], m->name)->data, (size_t)part[k].nparams * sizeof(float));
  }
  f->header = json_incref(p0->file.header); /* owns the strings of the metadata copied */
  f->nmeta = p0->file.nmeta;
  f->meta = xcalloc(f->nmeta ? f->nmeta : 1, sizeof *f->meta);
  memcpy(f->meta, p0->file.meta, f->nmeta * sizeof *f->meta);
  return 0;
}

static int open_stage_set(const char *path, struct checkpoint *ck, struct rumor_err *e) {
  struct checkpoint *part = xcalloc(PIPE_MAX_STAGES, sizeof *part);
  char name[CHECKPOINT_PATH_MAX + 32], used[CHECKPOINT_PATH_MAX + 40];
  int S = 1, n = 0, rc = 0;
  for (int k = 0; k < S && rc == 0; k++, n++) {
    train_stage_checkpoint_path(path, k, name, sizeof name);
    if ((rc = open_latest(name, true, &part[k], used, sizeof used, e))) {
      if (rc == -ENOENT)
        rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s stands for stage files, but stage %d/%d's %s is missing", path, k,
                           S, name);
      break;
    }
    if (k == 0 && (S = part[0].info.stages) < 1) {
      rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s is not a pipeline stage's file (rumor.format is not %s)", used,
                         CHECKPOINT_STAGE_FORMAT);
      break;
    }
    const struct checkpoint *c = &part[k];
    if (c->info.stages != S || c->info.stage != k || c->u0 != (k ? part[k - 1].u1 : 0) ||
        (k == S - 1 && c->u1 != c->table.nunits))
      rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s is stage %d/%d of units %d-%d, which does not continue %s's stage "
                         "files (stage %d of %d)", used, c->info.stage, c->info.stages, c->u0, c->u1 - 1, path, k, S);
    else if (!same_run(&c->info, &part[0].info))
      rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s is of step %lld, stage 0's file of step %lld (or of another run): "
                         "stage files of different saves", used, (long long)c->info.st.step,
                         (long long)part[0].info.st.step);
  }
  if (rc == 0) {
    rc = merge_stages(path, part, S, ck, e);
    if (rc == 0) log_info("%s: the %d stage files of step %lld put together", path, S, (long long)ck->info.st.step);
  }
  for (int k = 0; k < n; k++) checkpoint_close(&part[k]);
  free(part);
  return rc;
}

int checkpoint_merge_stages(const char *path, int64_t *step, struct rumor_err *e) {
  struct checkpoint ck;
  int rc = open_stage_set(path, &ck, e);
  if (rc) return rc;
  /* The whole model's layout, from the merged table: what saving needs of
   * a model (its spec, table, units and count), without its buffers. */
  struct model m;
  memset(&m, 0, sizeof m);
  m.spec = ck.info.spec;
  m.table = ck.table;
  m.nparams = ck.nparams;
  m.u0 = 0;
  m.u1 = ck.table.nunits;
  struct optim o;
  memset(&o, 0, sizeof o);
  o.cfg.kind = ck.info.optim_kind;
  struct ckpt_info info = ck.info;
  info.stage = info.stages = 0;
  info.group[0] = info.split[0] = '\0';
  info.extra = NULL;
  rc = checkpoint_save_host(path, &m, ck.has_optim ? &o : NULL, (const float *)ck.file.buf, &info, e);
  *step = ck.info.st.step;
  checkpoint_close(&ck);
  return rc;
}

void checkpoint_close(struct checkpoint *ck) {
  safetensors_free(&ck->file);
  safetensors_free(&ck->state_file);
  model_table_free(&ck->table);
  memset(ck, 0, sizeof *ck);
}

const float *checkpoint_extra(const struct checkpoint *ck, const char *name, int64_t len) {
  const struct st_tensor *t = ck_find(ck, name);
  if (!t || t->dtype != TENSOR_F32 || t->ndim != 1 || t->shape[0] != len) return NULL;
  return t->data;
}

void checkpoint_params(const struct checkpoint *ck, float *out) {
  for (size_t i = 0; i < ck->table.n; i++) {
    const struct model_param *p = &ck->table.p[i];
    if (p->unit < ck->u0 || p->unit >= ck->u1) continue; /* not in a stage's file */
    const struct st_tensor *t = safetensors_find(&ck->file, p->name);
    RUMOR_ASSERT(t && t->nbytes == (size_t)p->numel * sizeof(float)); /* checked by checkpoint_open */
    memcpy(out + p->offset, t->data, t->nbytes);
  }
}

int checkpoint_restore(const struct checkpoint *ck, struct model *m, struct optim *o, struct rumor_err *e) {
  char want[MODEL_SPEC_MAX], have[MODEL_SPEC_MAX];
  model_spec_format(&ck->info.spec, have, sizeof have);
  model_spec_format(&m->spec, want, sizeof want);
  if (strcmp(want, have) != 0)
    return rumor_err_set(e, RUMOR_ESHAPE, "checkpoint holds model %s, not %s", have, want);
  if (m->u0 < ck->u0 || m->u1 > ck->u1)
    return rumor_err_set(e, RUMOR_ESHAPE, "the checkpoint holds units %d-%d of %s, not %d-%d", ck->u0, ck->u1 - 1, have,
                         m->u0, m->u1 - 1);
  RUMOR_ASSERT(m->param_base == m->table.unit_offset[m->u0]);
  for (size_t i = 0; i < ck->table.n; i++) {
    const struct model_param *p = &ck->table.p[i];
    if (p->unit < m->u0 || p->unit >= m->u1) continue;
    const struct st_tensor *t = safetensors_find(&ck->file, p->name);
    tensor_copy_from_host(&m->params, p->offset - m->param_base, t->data, t->nbytes);
  }
  if (o) {
    if (ck->has_optim && ck->info.optim_kind == o->cfg.kind) {
      /* The optimizer's range (a stage's units, a ZeRO member's piece of
       * them: o->lo is a position in the whole model's layout) of each part,
       * which covers [base, base + nparams) of it. */
      int64_t from = o->lo - ck->base;
      RUMOR_ASSERT(o->lo >= 0 && from >= 0 && from + o->nparams <= ck->nparams);
      for (int s = 0; s < optim_state_per_param(o->cfg.kind); s++) {
        const struct st_tensor *t = ck_find(ck, optim_state_name(o->cfg.kind, s));
        tensor_copy_from_host(&o->state, (int64_t)s * o->nparams, (const float *)t->data + from,
                              (size_t)o->nparams * sizeof(float));
      }
    } else {
      log_warn("checkpoint has no %s optimizer state; starting it from zero", optim_kind_name(o->cfg.kind));
      tensor_fill(&o->state, 0.0f);
    }
    o->step = ck->info.st.step;
  }
  return 0;
}
