/* A strict recursive-descent JSON reader and an appending writer. */
#include "json.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* ---- arena: every node and string of one document, freed at once ---- */
struct arena_block {
  struct arena_block *next;
  size_t used, cap;
  max_align_t data[];
};

static void *arena_alloc(void **arena, size_t n) {
  n = (n + 15) & ~(size_t)15;
  struct arena_block *b = *arena;
  if (!b || b->cap - b->used < n) {
    size_t cap = n > 16384 ? n : 16384;
    struct arena_block *nb = malloc(sizeof *nb + cap);
    if (!nb) return NULL;
    nb->next = b;
    nb->used = 0;
    nb->cap = cap;
    *arena = b = nb;
  }
  void *p = (char *)b->data + b->used;
  b->used += n;
  return p;
}

static void arena_free(void *arena) {
  for (struct arena_block *b = arena; b;) {
    struct arena_block *next = b->next;
    free(b);
    b = next;
  }
}

struct parser {
  const char *s;
  size_t len, pos;
  void *arena;
  struct rumor_err *e;
};

static int fail(struct parser *p, const char *why) {
  return rumor_err_set(p->e, RUMOR_EFORMAT, "invalid JSON at byte %zu: %s", p->pos, why);
}

static void skip_ws(struct parser *p) {
  while (p->pos < p->len) {
    char c = p->s[p->pos];
    if (c != ' ' && c != '\t' && c != '\n' && c != '\r') break;
    p->pos++;
  }
}

static int parse_value(struct parser *p, struct json_value *v, int depth);

static int hex4(struct parser *p, unsigned *out) {
  if (p->len - p->pos < 4) return fail(p, "truncated \\u escape");
  unsigned v = 0;
  for (int i = 0; i < 4; i++) {
    char c = p->s[p->pos++];
    v <<= 4;
    if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
    else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
    else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
    else return fail(p, "bad hex digit in \\u escape");
  }
  *out = v;
  return 0;
}

static size_t put_utf8(char *o, unsigned cp) {
  if (cp < 0x80) { o[0] = (char)cp; return 1; }
  if (cp < 0x800) { o[0] = (char)(0xc0 | (cp >> 6)); o[1] = (char)(0x80 | (cp & 0x3f)); return 2; }
  if (cp < 0x10000) {
    o[0] = (char)(0xe0 | (cp >> 12)); o[1] = (char)(0x80 | ((cp >> 6) & 0x3f));
    o[2] = (char)(0x80 | (cp & 0x3f)); return 3;
  }
  o[0] = (char)(0xf0 | (cp >> 18)); o[1] = (char)(0x80 | ((cp >> 12) & 0x3f));
  o[2] = (char)(0x80 | ((cp >> 6) & 0x3f)); o[3] = (char)(0x80 | (cp & 0x3f)); return 4;
}

/* Parses a string starting after the opening quote. The decoded text is never
 * longer than the escaped source, so one allocation of the source span fits. */
static int parse_string(struct parser *p, char **out, size_t *out_len) {
  size_t start = p->pos, end = start;
  while (end < p->len && p->s[end] != '"') {
    if (p->s[end] == '\\') end++;
    end++;
  }
  if (end >= p->len) return fail(p, "unterminated string");
  char *o = arena_alloc(&p->arena, end - start + 1);
  if (!o) return rumor_err_set(p->e, -ENOMEM, "out of memory parsing JSON");
  size_t n = 0;
  while (p->pos < end) {
    unsigned char c = (unsigned char)p->s[p->pos++];
    if (c < 0x20) return fail(p, "control character in string");
    if (c != '\\') { o[n++] = (char)c; continue; }
    char esc = p->s[p->pos++];
    switch (esc) {
    case '"': o[n++] = '"'; break;
    case '\\': o[n++] = '\\'; break;
    case '/': o[n++] = '/'; break;
    case 'b': o[n++] = '\b'; break;
    case 'f': o[n++] = '\f'; break;
    case 'n': o[n++] = '\n'; break;
    case 'r': o[n++] = '\r'; break;
    case 't': o[n++] = '\t'; break;
    case 'u': {
      unsigned cp;
      if (hex4(p, &cp)) return p->e ? p->e->code : RUMOR_EFORMAT;
      if (cp >= 0xd800 && cp < 0xdc00) {
        unsigned lo;
        if (p->pos + 2 > end || p->s[p->pos] != '\\' || p->s[p->pos + 1] != 'u')
          return fail(p, "unpaired surrogate");
        p->pos += 2;
        if (hex4(p, &lo)) return p->e ? p->e->code : RUMOR_EFORMAT;
        if (lo < 0xdc00 || lo > 0xdfff) return fail(p, "bad low surrogate");
        cp = 0x10000 + ((cp - 0xd800) << 10) + (lo - 0xdc00);
      } else if (cp >= 0xdc00 && cp < 0xe000) {
        return fail(p, "unpaired surrogate");
      }
      if (cp == 0) return fail(p, "NUL in string");
      n += put_utf8(o + n, cp);
      break;
    }
    default: return fail(p, "bad escape");
    }
  }
  o[n] = '\0';
  p->pos = end + 1;
  *out = o;
  *out_len = n;
  return 0;
}

static int parse_number(struct parser *p, struct json_value *v) {
  size_t start = p->pos;
  bool integer = true;
  if (p->pos < p->len && p->s[p->pos] == '-') p->pos++;
  if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9') return fail(p, "bad number");
  if (p->s[p->pos] == '0') p->pos++;
  else while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
  if (p->pos < p->len && p->s[p->pos] == '.') {
    integer = false;
    p->pos++;
    if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9') return fail(p, "bad fraction");
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
  }
  if (p->pos < p->len && (p->s[p->pos] == 'e' || p->s[p->pos] == 'E')) {
    integer = false;
    p->pos++;
    if (p->pos < p->len && (p->s[p->pos] == '+' || p->s[p->pos] == '-')) p->pos++;
    if (p->pos >= p->len || p->s[p->pos] < '0' || p->s[p->pos] > '9') return fail(p, "bad exponent");
    while (p->pos < p->len && p->s[p->pos] >= '0' && p->s[p->pos] <= '9') p->pos++;
  }
  char buf[64];
  size_t n = p->pos - start;
  if (n >= sizeof buf) return fail(p, "number too long");
  memcpy(buf, p->s + start, n);
  buf[n] = '\0';
  v->type = JSON_NUMBER;
  v->number = strtod(buf, NULL);
  v->is_integer = false;
  if (integer) {
    errno = 0;
    long long x = strtoll(buf, NULL, 10);
    if (!errno) {
      v->is_integer = true;
      v->integer = x;
    }
  }
  return 0;
}

static int parse_container(struct parser *p, struct json_value *v, int depth, bool object) {
  char close = object ? '}' : ']';
  size_t cap = 0;
  v->type = object ? JSON_OBJECT : JSON_ARRAY;
  v->len = 0;
  v->items = NULL;
  v->keys = NULL;
  skip_ws(p);
  if (p->pos < p->len && p->s[p->pos] == close) {
    p->pos++;
    return 0;
  }
  for (;;) {
    if (v->len == cap) {
      size_t ncap = cap ? cap * 2 : 8;
      struct json_value *items = arena_alloc(&p->arena, ncap * sizeof *items);
      char **keys = object ? arena_alloc(&p->arena, ncap * sizeof *keys) : NULL;
      if (!items || (object && !keys)) return rumor_err_set(p->e, -ENOMEM, "out of memory parsing JSON");
      if (v->len) {
        memcpy(items, v->items, v->len * sizeof *items);
        if (object) memcpy(keys, v->keys, v->len * sizeof *keys);
      }
      v->items = items;
      v->keys = keys;
      cap = ncap;
    }
    skip_ws(p);
    if (object) {
      size_t klen;
      if (p->pos >= p->len || p->s[p->pos] != '"') return fail(p, "expected a key string");
      p->pos++;
      int rc = parse_string(p, &v->keys[v->len], &klen);
      if (rc) return rc;
      skip_ws(p);
      if (p->pos >= p->len || p->s[p->pos] != ':') return fail(p, "expected ':'");
      p->pos++;
    }
    int rc = parse_value(p, &v->items[v->len], depth + 1);
    if (rc) return rc;
    v->len++;
    skip_ws(p);
    if (p->pos >= p->len) return fail(p, "unterminated container");
    char c = p->s[p->pos++];
    if (c == close) return 0;
    if (c != ',') return fail(p, "expected ',' or end of container");
  }
}

static int expect_word(struct parser *p, const char *w) {
  size_t n = strlen(w);
  if (p->len - p->pos < n || memcmp(p->s + p->pos, w, n) != 0) return fail(p, "unexpected token");
  p->pos += n;
  return 0;
}

static int parse_value(struct parser *p, struct json_value *v, int depth) {
  if (depth > JSON_MAX_DEPTH) return fail(p, "nesting too deep");
  memset(v, 0, sizeof *v);
  skip_ws(p);
  if (p->pos >= p->len) return fail(p, "unexpected end");
  char c = p->s[p->pos];
  switch (c) {
  case '{': p->pos++; return parse_container(p, v, depth, true);
  case '[': p->pos++; return parse_container(p, v, depth, false);
  case '"': p->pos++; v->type = JSON_STRING; return parse_string(p, &v->string, &v->len);
  case 't': v->type = JSON_BOOL; v->boolean = true; return expect_word(p, "true");
  case 'f': v->type = JSON_BOOL; v->boolean = false; return expect_word(p, "false");
  case 'n': v->type = JSON_NULL; return expect_word(p, "null");
  default: return parse_number(p, v);
  }
}

int json_parse(const char *text, size_t len, struct json_doc *doc, struct rumor_err *e) {
  struct parser p = {.s = text, .len = len, .pos = 0, .arena = NULL, .e = e};
  int rc = parse_value(&p, &doc->root, 0);
  if (!rc) {
    skip_ws(&p);
    if (p.pos != p.len) rc = fail(&p, "trailing bytes after the value");
  }
  if (rc) {
    arena_free(p.arena);
    memset(doc, 0, sizeof *doc);
    return rc;
  }
  doc->arena = p.arena;
  return 0;
}

void json_doc_free(struct json_doc *doc) {
  arena_free(doc->arena);
  memset(doc, 0, sizeof *doc);
}

const struct json_value *json_get(const struct json_value *obj, const char *key) {
  if (!obj || obj->type != JSON_OBJECT) return NULL;
  for (size_t i = 0; i < obj->len; i++)
    if (strcmp(obj->keys[i], key) == 0) return &obj->items[i];
  return NULL;
}

/* ---- writer ---- */
static void put(struct json_buf *b, const char *s, size_t n) {
  if (b->len + n + 1 > b->cap) {
    size_t cap = b->cap ? b->cap : 256;
    while (cap < b->len + n + 1) cap *= 2;
    b->data = xrealloc(b->data, cap);
    b->cap = cap;
  }
  memcpy(b->data + b->len, s, n);
  b->len += n;
  b->data[b->len] = '\0';
}

static void sep(struct json_buf *b) {
  if (b->need_comma) put(b, ",", 1);
  b->need_comma = true;
}

void json_buf_init(struct json_buf *b) { memset(b, 0, sizeof *b); put(b, "", 0); }
void json_buf_free(struct json_buf *b) { free(b->data); memset(b, 0, sizeof *b); }
void json_obj_begin(struct json_buf *b) { sep(b); put(b, "{", 1); b->need_comma = false; }
void json_obj_end(struct json_buf *b) { put(b, "}", 1); b->need_comma = true; }
void json_arr_begin(struct json_buf *b) { sep(b); put(b, "[", 1); b->need_comma = false; }
void json_arr_end(struct json_buf *b) { put(b, "]", 1); b->need_comma = true; }

static void put_escaped(struct json_buf *b, const char *s) {
  put(b, "\"", 1);
  for (; *s; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      char esc[2] = {'\\', (char)c};
      put(b, esc, 2);
    } else if (c < 0x20) {
      char esc[8];
      snprintf(esc, sizeof esc, "\\u%04x", c);
      put(b, esc, 6);
    } else {
      put(b, (const char *)&c, 1);
    }
  }
  put(b, "\"", 1);
}

void json_key(struct json_buf *b, const char *key) {
  sep(b);
  put_escaped(b, key);
  put(b, ":", 1);
  b->need_comma = false;
}
void json_str(struct json_buf *b, const char *s) { sep(b); put_escaped(b, s); }
void json_num(struct json_buf *b, double v) {
  sep(b);
  if (!isfinite(v)) { put(b, "null", 4); return; }
  char t[40];
  int n = snprintf(t, sizeof t, "%.9g", v);
  put(b, t, (size_t)n);
}
void json_int(struct json_buf *b, int64_t v) {
  sep(b);
  char t[32];
  int n = snprintf(t, sizeof t, "%lld", (long long)v);
  put(b, t, (size_t)n);
}
void json_bool(struct json_buf *b, bool v) { sep(b); put(b, v ? "true" : "false", v ? 4 : 5); }
void json_null(struct json_buf *b) { sep(b); put(b, "null", 4); }
void json_raw(struct json_buf *b, const char *s, size_t n) { sep(b); put(b, s, n); }
