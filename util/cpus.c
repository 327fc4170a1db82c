/* CPU lists ("0-3,8") and pinning the calling thread to one. */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include "util.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static void set_bit(struct cpu_list *c, int cpu) { c->bits[cpu / 64] |= 1ull << (cpu % 64); }
static bool has_bit(const struct cpu_list *c, int cpu) { return (c->bits[cpu / 64] >> (cpu % 64)) & 1; }

/* One number of a list, in [0, CPU_LIST_MAX). */
static int cpu_number(const char **p, int *out) {
  const char *s = *p;
  if (*s < '0' || *s > '9') return RUMOR_EFORMAT;
  long v = 0;
  while (*s >= '0' && *s <= '9') {
    v = v * 10 + (*s - '0');
    if (v >= CPU_LIST_MAX) return RUMOR_EFORMAT;
    s++;
  }
  *p = s;
  *out = (int)v;
  return 0;
}

/* `set` as a CPU list ("0-3,8") in buf[0..n), cut with "..." if longer. */
static void format_cpus(const cpu_set_t *set, char *buf, size_t n) {
  size_t len = 0;
  buf[0] = '\0';
  for (int lo = 0; lo < CPU_SETSIZE && len < n; lo++) {
    if (!CPU_ISSET(lo, set)) continue;
    int hi = lo;
    while (hi + 1 < CPU_SETSIZE && CPU_ISSET(hi + 1, set)) hi++;
    int w = hi > lo ? snprintf(buf + len, n - len, "%s%d-%d", len ? "," : "", lo, hi)
                    : snprintf(buf + len, n - len, "%s%d", len ? "," : "", lo);
    if (w < 0 || (size_t)w >= n - len) {
      if (n >= sizeof "...") memcpy(buf + n - sizeof "...", "...", sizeof "..."); /* with its NUL */
      return;
    }
    len += (size_t)w;
    lo = hi;
  }
}

int cpu_list_parse(const char *s, struct cpu_list *out, struct rumor_err *e) {
  struct cpu_list c;
  memset(&c, 0, sizeof c);
  const char *p = s ? s : "";
  if (!*p) return rumor_err_set(e, RUMOR_EFORMAT, "empty CPU list");
  while (*p) {
    int lo, hi;
    if (cpu_number(&p, &lo)) goto bad;
    hi = lo;
    if (*p == '-') {
      p++;
      if (cpu_number(&p, &hi) || hi < lo) goto bad;
    }
    for (int i = lo; i <= hi; i++) set_bit(&c, i);
    if (*p == ',') {
      p++;
      if (!*p) goto bad;
    } else if (*p) {
      goto bad;
    }
  }
  /* Every CPU must be one this process may run on. */
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
    for (int i = 0; i < CPU_LIST_MAX; i++)
      if (has_bit(&c, i) && (i >= CPU_SETSIZE || !CPU_ISSET(i, &allowed))) {
        char may[128];
        format_cpus(&allowed, may, sizeof may);
        return rumor_err_set(e, RUMOR_EFORMAT, "CPU %d in '%s' is not one this process may run on (it may use %s)",
                             i, s, may);
      }
  }
  *out = c;
  return 0;
bad:
  return rumor_err_set(e, RUMOR_EFORMAT, "bad CPU list '%s' (want numbers and ranges, e.g. 0-3,8)", s);
}

int cpu_pin_self(const struct cpu_list *c, struct rumor_err *e) {
  cpu_set_t set;
  CPU_ZERO(&set);
  for (int i = 0; i < CPU_LIST_MAX && i < CPU_SETSIZE; i++)
    if (has_bit(c, i)) CPU_SET(i, &set);
  int rc = pthread_setaffinity_np(pthread_self(), sizeof set, &set);
  if (rc) return rumor_err_set(e, -rc, "cannot pin the thread to its CPUs: %s", strerror(rc));
  return 0;
}
