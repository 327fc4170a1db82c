/* Always-on asserts and allocation that reports its call site on failure. */
#include "util.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

void rumor_panic(const char *file, int line, const char *fmt, ...) {
  char msg[1024];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(msg, sizeof msg, fmt, ap);
  va_end(ap);
  log_error("%s:%d: %s", file, line, msg);
  abort();
}

void *rumor_xmalloc_at(size_t n, const char *file, int line) {
  void *p = malloc(n ? n : 1);
  if (!p) rumor_panic(file, line, "out of memory: malloc(%zu)", n);
  return p;
}

void *rumor_xcalloc_at(size_t count, size_t size, const char *file, int line) {
  void *p = calloc(count ? count : 1, size ? size : 1);
  if (!p) rumor_panic(file, line, "out of memory: calloc(%zu, %zu)", count, size);
  return p;
}

void *rumor_xrealloc_at(void *old, size_t n, const char *file, int line) {
  void *p = realloc(old, n ? n : 1);
  if (!p) rumor_panic(file, line, "out of memory: realloc(%zu)", n);
  return p;
}

char *rumor_xstrdup_at(const char *s, const char *file, int line) {
  size_t n = strlen(s) + 1;
  char *p = rumor_xmalloc_at(n, file, line);
  memcpy(p, s, n);
  return p;
}
