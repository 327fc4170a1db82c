/* Token corpora for language models: llm.c token shards (mapped read-only),
 * plain text (bytes as tokens), directory and glob specs, the validation
 * split, and the window batcher. The contracts are in data.h. */
#include "peer/data/data_impl.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

/* Shard tokens are used in place, as the little-endian uint16 the file holds. */
#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "token shards are mapped as little-endian uint16: this needs a little-endian host"
#endif

#define TOKEN_SCAN_CHUNK 65536                /* tokens per max-scan block */
#define TOKEN_WINDOW_STREAM 0x544f4b57494eull /* "TOKWIN": the window permutation's RNG stream */

struct token_file {
  char *path;
  void *map; /* a shard's mapping (the whole file), or NULL */
  size_t map_len;
  uint16_t *text; /* a text file's tokens, or NULL */
  const uint16_t *tokens;
  int64_t count;
  bool val; /* named as a validation file (only when the spec names several files) */
};

struct path_list {
  char **v;
  int64_t n, cap;
};

static int32_t le32(const uint8_t *p) {
  uint32_t v = (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
  int32_t r;
  memcpy(&r, &v, sizeof r);
  return r;
}

/* Index of the first token > max_id, or -1. Scans block by block for the
 * block's largest token (a loop the compiler vectorises) and looks closer only
 * in a block that fails. */
static int64_t first_out_of_range(const uint16_t *t, int64_t n, uint16_t max_id) {
  for (int64_t i = 0; i < n; i += TOKEN_SCAN_CHUNK) {
    int64_t m = n - i < TOKEN_SCAN_CHUNK ? n - i : TOKEN_SCAN_CHUNK;
    uint16_t hi = 0;
    for (int64_t j = 0; j < m; j++) hi = t[i + j] > hi ? t[i + j] : hi;
    if (hi <= max_id) continue;
    for (int64_t j = 0; j < m; j++)
      if (t[i + j] > max_id) return i + j;
  }
  return -1;
}

int token_shard_parse(const void *buf, size_t len, const char *name, int64_t vocab, const uint16_t **tokens,
                      int64_t *count, struct rumor_err *e) {
  const uint8_t *p = buf;
  RUMOR_ASSERT(((uintptr_t)buf & 1) == 0 && vocab >= 1);
  if (len >= 4 && le32(p) != TOKEN_SHARD_MAGIC)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: wrong magic %d: not an llm.c token shard (magic %d)", name, le32(p),
                         TOKEN_SHARD_MAGIC);
  if (len < TOKEN_SHARD_HEADER_BYTES)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: truncated header: %zu bytes, an llm.c token shard's header is %d",
                         name, len, TOKEN_SHARD_HEADER_BYTES);
  int32_t version = le32(p + 4), n = le32(p + 8);
  if (version != TOKEN_SHARD_VERSION)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: unsupported shard version %d (rumor reads version %d: uint16 tokens)",
                         name, version, TOKEN_SHARD_VERSION);
  if (n <= 0)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: the header declares %s (token count %d)", name,
                         n == 0 ? "zero tokens" : "a negative number of tokens", n);
  uint64_t need = TOKEN_SHARD_HEADER_BYTES + 2 * (uint64_t)n;
  if (len < need)
    return rumor_err_set(e, RUMOR_ECORRUPT,
                         "%s: truncated: the header declares %d tokens (%llu bytes with the header), the file has "
                         "%zu bytes", name, n, (unsigned long long)need, len);
  if (len > need)
    return rumor_err_set(e, RUMOR_ECORRUPT, "%s: %llu byte%s after the %d tokens the header declares", name,
                         (unsigned long long)(len - need), len - need == 1 ? "" : "s", n);
  const uint16_t *t = (const uint16_t *)(p + TOKEN_SHARD_HEADER_BYTES);
  if (vocab <= UINT16_MAX) {
    int64_t bad = first_out_of_range(t, n, (uint16_t)(vocab - 1));
    if (bad >= 0)
      return rumor_err_set(e, RUMOR_ECORRUPT, "%s: token %u at index %lld is outside the model's vocabulary of %lld",
                           name, (unsigned)t[bad], (long long)bad, (long long)vocab);
  }
  *tokens = t;
  *count = n;
  return 0;
}

static bool ends_with(const char *s, const char *suffix) {
  size_t n = strlen(s), m = strlen(suffix);
  return n >= m && memcmp(s + n - m, suffix, m) == 0;
}

/* llm.c's and nanoGPT's naming of validation files: "_val" then '_' or '.'
 * in the file's name (not its directory). */
static bool is_val_name(const char *path) {
  const char *base = strrchr(path, '/');
  base = base ? base + 1 : path;
  for (const char *p = base; (p = strstr(p, "_val")) != NULL; p++)
    if (p[STR_LEN("_val")] == '_' || p[STR_LEN("_val")] == '.') return true;
  return false;
}

/* Converts a text file's bytes into an owned buffer of tokens 0..255. */
static int text_load(struct token_file *f, const uint8_t *bytes, size_t len, int64_t vocab, int64_t *text_left,
                     struct rumor_err *e) {
  if (vocab < 256)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: plain text is read as bytes (tokens 0..255), which needs a "
                         "vocabulary of at least 256 token ids; the model's has %lld", f->path, (long long)vocab);
  if ((uint64_t)len > (uint64_t)*text_left)
    return rumor_err_set(e, RUMOR_ETOOBIG, "%s: %zu bytes of plain text pass the limit of %lld bytes of text per "
                         "corpus (tokenize large corpora into llm.c shards)", f->path, len, TOKEN_MAX_TEXT_BYTES);
  uint16_t *t = malloc(len * sizeof *t);
  if (!t) return rumor_err_set(e, -ENOMEM, "%s: out of memory for %zu tokens", f->path, len);
  for (size_t i = 0; i < len; i++) t[i] = bytes[i];
  *text_left -= (int64_t)len;
  f->text = t;
  f->tokens = t;
  f->count = (int64_t)len;
  return 0;
}

/* Loads one file into `f` (which takes `path`, a heap string, in every case).
 * On failure f holds only its path. */
static int file_load(struct token_file *f, char *path, int64_t vocab, int64_t *text_left, struct rumor_err *e) {
  f->path = path;
  struct stat st;
  int fd = file_open_regular(path, O_RDONLY, 0, &st, e);
  if (fd < 0) return fd;
  int rc = 0;
  if (st.st_size == 0) rc = rumor_err_set(e, RUMOR_EFORMAT, "%s: empty file (no tokens)", path);
  else if ((uint64_t)st.st_size > SIZE_MAX / 2)
    rc = rumor_err_set(e, RUMOR_ETOOBIG, "%s: %lld bytes is too large", path, (long long)st.st_size);
  if (rc) {
    close(fd);
    return rc;
  }
  size_t len = (size_t)st.st_size;
  /* MAP_SHARED and read-only: every process mapping the file reads the same
   * page-cache pages. */
  void *map = mmap(NULL, len, PROT_READ, MAP_SHARED, fd, 0);
  int map_errno = errno;
  close(fd);
  if (map == MAP_FAILED) return rumor_err_set(e, -map_errno, "cannot map %s: %s", path, strerror(map_errno));
  if (ends_with(path, ".bin") || (len >= 4 && le32(map) == TOKEN_SHARD_MAGIC)) {
    rc = token_shard_parse(map, len, path, vocab, &f->tokens, &f->count, e);
    if (rc) {
      munmap(map, len);
      return rc;
    }
    f->map = map;
    f->map_len = len;
    return 0;
  }
  rc = text_load(f, map, len, vocab, text_left, e);
  munmap(map, len);
  return rc;
}

static void paths_add(struct path_list *l, const char *dir, const char *name) {
  if (l->n == l->cap) {
    l->cap = l->cap ? 2 * l->cap : 16;
    l->v = xrealloc(l->v, (size_t)l->cap * sizeof *l->v);
  }
  size_t dn = dir ? strlen(dir) : 0, nn = strlen(name);
  bool slash = dn > 0 && dir[dn - 1] != '/';
  char *p = xmalloc(dn + slash + nn + 1);
  if (dn) memcpy(p, dir, dn);
  if (slash) p[dn] = '/';
  memcpy(p + dn + slash, name, nn + 1);
  l->v[l->n++] = p;
}

static void paths_free(struct path_list *l) {
  for (int64_t i = 0; i < l->n; i++) free(l->v[i]);
  free(l->v);
  memset(l, 0, sizeof *l);
}

static int cmp_path(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

static bool is_regular(const char *path) {
  struct stat st;
  return stat(path, &st) == 0 && S_ISREG(st.st_mode);
}

/* Every regular "*.bin" file of `dir` not starting with '.'. */
static int paths_from_dir(const char *dir, struct path_list *l, struct rumor_err *e) {
  DIR *d = opendir(dir);
  if (!d) return rumor_err_set(e, -errno, "cannot read directory %s: %s", dir, strerror(errno));
  struct dirent *ent;
  int rc = 0;
  while ((ent = readdir(d)) != NULL) {
    if (ent->d_name[0] == '.' || !ends_with(ent->d_name, ".bin")) continue;
    if (l->n == TOKEN_MAX_FILES) {
      rc = rumor_err_set(e, RUMOR_ETOOBIG, "%s: more than %d *.bin files", dir, TOKEN_MAX_FILES);
      break;
    }
    paths_add(l, dir, ent->d_name);
    if (!is_regular(l->v[l->n - 1])) free(l->v[--l->n]);
  }
  closedir(d);
  if (rc == 0 && l->n == 0) rc = rumor_err_set(e, RUMOR_ENOTFOUND, "no *.bin token shards in directory %s", dir);
  return rc;
}

/* Every regular file matching the glob(3) pattern. */
static int paths_from_glob(const char *pattern, struct path_list *l, struct rumor_err *e) {
  glob_t g;
  int r = glob(pattern, 0, NULL, &g);
  if (r == GLOB_NOMATCH) return rumor_err_set(e, RUMOR_ENOTFOUND, "no files match %s", pattern);
  if (r == GLOB_NOSPACE) return rumor_err_set(e, -ENOMEM, "out of memory matching %s", pattern);
  if (r != 0) return rumor_err_set(e, -EIO, "cannot read the directories of %s", pattern);
  int rc = 0;
  for (size_t i = 0; i < g.gl_pathc && rc == 0; i++) {
    if (!is_regular(g.gl_pathv[i])) continue;
    if (l->n == TOKEN_MAX_FILES)
      rc = rumor_err_set(e, RUMOR_ETOOBIG, "%s: more than %d files", pattern, TOKEN_MAX_FILES);
    else
      paths_add(l, NULL, g.gl_pathv[i]);
  }
  globfree(&g);
  if (rc == 0 && l->n == 0) rc = rumor_err_set(e, RUMOR_ENOTFOUND, "no regular files match %s", pattern);
  return rc;
}

/* The files `spec` names, sorted by strcmp; *several: a directory or glob
 * (whose file names choose the validation split). */
static int spec_resolve(const char *spec, struct path_list *l, bool *several, struct rumor_err *e) {
  struct stat st;
  int rc;
  *several = false;
  if (stat(spec, &st) == 0) {
    if (!S_ISDIR(st.st_mode)) {
      paths_add(l, NULL, spec);
      return 0;
    }
    rc = paths_from_dir(spec, l, e);
  } else if (strpbrk(spec, "*?[")) {
    rc = paths_from_glob(spec, l, e);
  } else {
    return rumor_err_set(e, -errno, "cannot open %s: %s", spec, strerror(errno));
  }
  if (rc) return rc;
  *several = true;
  qsort(l->v, (size_t)l->n, sizeof *l->v, cmp_path);
  return 0;
}

/* Loads every listed file into c->files, taking the paths over. */
static int files_load(struct token_corpus *c, struct path_list *l, bool several, int64_t vocab,
                      struct rumor_err *e) {
  c->files = xcalloc((size_t)l->n, sizeof *c->files);
  int64_t text_left = TOKEN_MAX_TEXT_BYTES, total = 0;
  int rc = 0;
  for (int64_t i = 0; i < l->n; i++) {
    struct token_file *f = &c->files[c->nfiles++];
    char *path = l->v[i];
    l->v[i] = NULL;
    if (rc) {
      f->path = path; /* freed with the corpus */
      continue;
    }
    rc = file_load(f, path, vocab, &text_left, e);
    if (rc) continue;
    f->val = several && is_val_name(path);
    total += f->count;
    if (total > TOKEN_MAX_TOKENS)
      rc = rumor_err_set(e, RUMOR_ETOOBIG, "%s: the corpus passes the limit of %lld tokens", path, TOKEN_MAX_TOKENS);
  }
  return rc;
}

static void split_add(struct token_split *s, const struct token_file *f, int64_t offset, int64_t count) {
  if (count <= 0) return;
  s->segs[s->nsegs++] = (struct token_segment){f->tokens + offset, count, f->path, offset};
  s->ntokens += count;
}

/* Fills the splits from the loaded files: by name when any file is a
 * validation file, otherwise the last round(n · val_fraction) tokens of the
 * stream are held out. */
static void splits_build(struct token_corpus *c, double val_fraction) {
  int64_t n = 0;
  for (int64_t i = 0; i < c->nfiles; i++) {
    c->val_from_files |= c->files[i].val;
    n += c->files[i].count;
  }
  c->train.segs = xcalloc((size_t)c->nfiles, sizeof *c->train.segs);
  c->val.segs = xcalloc((size_t)c->nfiles, sizeof *c->val.segs);
  if (c->val_from_files) {
    for (int64_t i = 0; i < c->nfiles; i++) {
      const struct token_file *f = &c->files[i];
      split_add(f->val ? &c->val : &c->train, f, 0, f->count);
    }
    return;
  }
  int64_t cut = n - (int64_t)llround((double)n * val_fraction), pos = 0;
  for (int64_t i = 0; i < c->nfiles; i++) {
    const struct token_file *f = &c->files[i];
    int64_t head = cut - pos < 0 ? 0 : (cut - pos > f->count ? f->count : cut - pos);
    split_add(&c->train, f, 0, head);
    split_add(&c->val, f, head, f->count - head);
    pos += f->count;
  }
}

static int64_t seg_windows(const struct token_segment *s, int64_t context) {
  return s->count > 0 ? (s->count - 1) / context : 0;
}

int64_t token_split_windows(const struct token_split *s, int64_t context) {
  int64_t w = 0;
  for (int64_t i = 0; i < s->nsegs; i++) w += seg_windows(&s->segs[i], context);
  return w;
}

/* Fails unless the split has at least one window. */
static int split_check(const struct token_split *s, const char *which, const char *spec, int64_t context,
                       double val_fraction, struct rumor_err *e) {
  if (token_split_windows(s, context) > 0) return 0;
  if (s->nsegs == 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: the %s split is empty (validation fraction %g)", spec, which,
                         val_fraction);
  const struct token_segment *longest = &s->segs[0];
  for (int64_t i = 1; i < s->nsegs; i++)
    if (s->segs[i].count > longest->count) longest = &s->segs[i];
  return rumor_err_set(e, RUMOR_EFORMAT, "%s: the %s split has no window of %lld tokens (context %lld + 1): its "
                       "longest segment has %lld tokens, from %s (%lld tokens in the split)", spec, which,
                       (long long)context + 1, (long long)context, (long long)longest->count, longest->path,
                       (long long)s->ntokens);
}

int token_corpus_load(struct token_corpus *out, const char *spec, int64_t vocab, int64_t context,
                      double val_fraction, struct rumor_err *e) {
  memset(out, 0, sizeof *out);
  if (!spec || !*spec) return rumor_err_set(e, RUMOR_EFORMAT, "no token corpus given (a file, directory or glob)");
  if (vocab < 1 || vocab > INT32_MAX)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: a vocabulary of %lld token ids is out of range", spec,
                         (long long)vocab);
  if (context < 1 || context > TOKEN_MAX_CONTEXT)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: context %lld is outside [1, %lld]", spec, (long long)context,
                         TOKEN_MAX_CONTEXT);
  if (!(val_fraction >= 0.0 && val_fraction < 1.0))
    return rumor_err_set(e, RUMOR_EFORMAT, "%s: validation fraction %g is outside [0, 1)", spec, val_fraction);
  struct path_list l = {0};
  bool several;
  int rc = spec_resolve(spec, &l, &several, e);
  if (rc == 0) rc = files_load(out, &l, several, vocab, e);
  paths_free(&l);
  if (rc) goto fail;
  if (several && out->nfiles > 0) {
    bool any_train = false;
    for (int64_t i = 0; i < out->nfiles; i++) any_train |= !out->files[i].val;
    if (!any_train) {
      rc = rumor_err_set(e, RUMOR_EFORMAT, "%s: every file is a validation file (named *_val_* or *_val.*); "
                         "no training data", spec);
      goto fail;
    }
  }
  splits_build(out, val_fraction);
  rc = split_check(&out->train, "training", spec, context, val_fraction, e);
  if (rc == 0 && (out->val_from_files || val_fraction > 0.0))
    rc = split_check(&out->val, "validation", spec, context, val_fraction, e);
  if (rc) goto fail;
  return 0;
fail:
  token_corpus_free(out);
  return rc;
}

void token_corpus_free(struct token_corpus *c) {
  for (int64_t i = 0; i < c->nfiles; i++) {
    struct token_file *f = &c->files[i];
    if (f->map) munmap(f->map, f->map_len);
    free(f->text);
    free(f->path);
  }
  free(c->files);
  free(c->train.segs);
  free(c->val.segs);
  memset(c, 0, sizeof *c);
}

static void window_copy(const uint16_t *t, int64_t context, int32_t *x, int32_t *y) {
  for (int64_t i = 0; i < context; i++) {
    x[i] = t[i];
    y[i] = t[i + 1];
  }
}

void token_split_gather(const struct token_split *s, int64_t context, int64_t first, int64_t rows, int32_t *x,
                        int32_t *y) {
  RUMOR_ASSERT(context >= 1 && first >= 0 && rows >= 0 && first + rows <= token_split_windows(s, context));
  int64_t seg = 0, w = first; /* window w of segment seg */
  for (int64_t r = 0; r < rows; r++, w++) {
    while (w >= seg_windows(&s->segs[seg], context)) w -= seg_windows(&s->segs[seg++], context);
    window_copy(s->segs[seg].tokens + w * context, context, x + r * context, y + r * context);
  }
}

int token_batcher_init(struct token_batcher *b, const struct token_split *split, int64_t context,
                       struct shard shard, uint64_t data_seed, uint64_t seed, struct rumor_err *e) {
  memset(b, 0, sizeof *b);
  RUMOR_ASSERT(context >= 1 && shard.count >= 1 && shard.index >= 0 && shard.index < shard.count);
  int64_t total = token_split_windows(split, context);
  if (total > TOKEN_MAX_WINDOWS)
    return rumor_err_set(e, RUMOR_ETOOBIG, "%lld windows of %lld tokens pass the limit of %lld windows (use a "
                         "longer context)", (long long)total, (long long)context + 1, TOKEN_MAX_WINDOWS);
  if (!shard_order_init(&b->rows, total, shard, data_seed, TOKEN_WINDOW_STREAM, seed))
    return rumor_err_set(e, RUMOR_EFORMAT, "shard %lld/%lld of %lld windows of %lld tokens is empty",
                         (long long)shard.index, (long long)shard.count, (long long)total, (long long)context + 1);
  b->win_first = xmalloc((size_t)(split->nsegs + 1) * sizeof *b->win_first);
  b->win_first[0] = 0;
  for (int64_t i = 0; i < split->nsegs; i++)
    b->win_first[i + 1] = b->win_first[i] + seg_windows(&split->segs[i], context);
  b->split = split;
  b->context = context;
  return 0;
}

void token_batcher_free(struct token_batcher *b) {
  free(b->win_first);
  shard_order_free(&b->rows);
  memset(b, 0, sizeof *b);
}

int64_t token_batcher_fill(const struct token_batcher *b, int64_t step, int64_t bs, int32_t *x, int32_t *y) {
  int64_t first = step * bs, T = b->context;
  RUMOR_ASSERT(bs >= 1 && first >= 0 && first < b->rows.n);
  int64_t rows = b->rows.n - first < bs ? b->rows.n - first : bs;
  for (int64_t r = 0; r < rows; r++) {
    int64_t w = b->rows.order[first + r], lo = 0, hi = b->split->nsegs;
    /* win_first[lo] <= w < win_first[hi]; ends at w's segment */
    while (hi - lo > 1) {
      int64_t mid = lo + (hi - lo) / 2;
      if (b->win_first[mid] <= w) lo = mid;
      else hi = mid;
    }
    const uint16_t *t = b->split->segs[lo].tokens + (w - b->win_first[lo]) * T;
    window_copy(t, T, x + r * T, y + r * T);
  }
  return rows;
}
