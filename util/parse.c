/* Strict number parsing for flags and file fields. */
#include "util.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

int parse_i64(const char *s, int64_t min, int64_t max, int64_t *out) {
  if (!s || !*s) return RUMOR_EFORMAT;
  char *end;
  errno = 0;
  long long v = strtoll(s, &end, 10);
  if (errno || *end || end == s || v < min || v > max) return RUMOR_EFORMAT;
  *out = v;
  return 0;
}

int parse_f64(const char *s, double min, double max, double *out) {
  if (!s || !*s) return RUMOR_EFORMAT;
  char *end;
  errno = 0;
  double v = strtod(s, &end);
  if (errno || *end || end == s || !isfinite(v) || v < min || v > max) return RUMOR_EFORMAT;
  *out = v;
  return 0;
}
