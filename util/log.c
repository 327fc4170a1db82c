/* Logging: one line per call, written with a single write(2) so lines from
 * several threads or processes sharing a file never interleave. */
#include "util.h"

#include <stdatomic.h>
#include <stdio.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

static _Atomic int g_level = LOG_INFO;  /* process-wide: one log per process */
static _Atomic bool g_json = false;
static char g_name[48];                 /* set once at start-up, before threads */

void log_set_level(enum log_level level) { atomic_store(&g_level, (int)level); }
void log_set_json(bool on) { atomic_store(&g_json, on); }
void log_set_name(const char *name) { snprintf(g_name, sizeof g_name, "%s", name ? name : ""); }
bool log_enabled(enum log_level level) { return (int)level >= atomic_load(&g_level); }

static const char *level_name(enum log_level l) {
  switch (l) {
  case LOG_DEBUG: return "debug";
  case LOG_INFO: return "info";
  case LOG_WARN: return "warn";
  default: return "error";
  }
}

/* Appends `s` to buf[*n..cap) as a JSON string body (no quotes). */
static void json_escape_into(char *buf, size_t cap, size_t *n, const char *s) {
  for (; *s && *n + 7 < cap; s++) {
    unsigned char c = (unsigned char)*s;
    if (c == '"' || c == '\\') {
      buf[(*n)++] = '\\';
      buf[(*n)++] = (char)c;
    } else if (c < 0x20) {
      *n += (size_t)snprintf(buf + *n, cap - *n, "\\u%04x", c);
    } else {
      buf[(*n)++] = (char)c;
    }
  }
}

void log_vmsg(enum log_level level, const char *fmt, va_list ap) {
  if (!log_enabled(level)) return;
  char msg[2048];
  vsnprintf(msg, sizeof msg, fmt, ap);
  size_t len = strlen(msg);
  while (len > 0 && msg[len - 1] == '\n') msg[--len] = '\0';

  int64_t ms = clock_wall_ms();
  time_t secs = (time_t)(ms / 1000);
  struct tm tm;
  localtime_r(&secs, &tm);

  char line[4096];
  size_t n = 0;
  if (atomic_load(&g_json)) {
    char ts[64];
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    n += (size_t)snprintf(line, sizeof line, "{\"ts\":\"%s.%03d\",\"level\":\"%s\",\"name\":\"",
                          ts, (int)(ms % 1000), level_name(level));
    json_escape_into(line, sizeof line, &n, g_name);
    n += (size_t)snprintf(line + n, sizeof line - n, "\",\"pid\":%d,\"msg\":\"", (int)getpid());
    json_escape_into(line, sizeof line, &n, msg);
    n += (size_t)snprintf(line + n, sizeof line - n, "\"}\n");
  } else {
    char ts[16];
    strftime(ts, sizeof ts, "%H:%M:%S", &tm);
    static const char *tags[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};
    if (g_name[0])
      n = (size_t)snprintf(line, sizeof line, "%s.%03d %s [%s] %s\n", ts, (int)(ms % 1000),
                           tags[level], g_name, msg);
    else
      n = (size_t)snprintf(line, sizeof line, "%s.%03d %s %s\n", ts, (int)(ms % 1000), tags[level], msg);
  }
  if (n >= sizeof line) {
    n = sizeof line - 1;
    line[n - 1] = '\n';
  }
  ssize_t w = write(STDERR_FILENO, line, n);
  (void)w; /* nothing sensible to do if stderr is gone */
}

void log_msg(enum log_level level, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  log_vmsg(level, fmt, ap);
  va_end(ap);
}
