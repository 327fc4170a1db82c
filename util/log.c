/* Logging: one line per call, written with a single write(2) of at most
 * PIPE_BUF bytes, so lines from several threads or processes sharing a file
 * or a pipe never interleave (longer writes to a pipe may). */
#include "util.h"

#include <limits.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "json_text.h"

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

/* One --log-json line: {"ts","level","name","pid","msg"} and a newline,
 * malloc'd. */
static char *json_line(const char *ts, int ms, enum log_level level, const char *msg, size_t *len) {
  char when[80];
  snprintf(when, sizeof when, "%s.%03d", ts, ms);
  json_t *o = json_object();
  if (!o) rumor_panic(__FILE__, __LINE__, "out of memory building a log line");
  json_text_set(o, "ts", json_string(when));
  json_text_set(o, "level", json_string(level_name(level)));
  json_text_set(o, "name", json_text_str(g_name));
  json_text_set(o, "pid", json_integer(getpid()));
  json_text_set(o, "msg", json_text_str(msg));
  size_t n;
  char *text = json_text_dump(o, &n);
  json_decref(o);
  char *line = xrealloc(text, n + 2);
  line[n] = '\n';
  line[n + 1] = '\0';
  *len = n + 1;
  return line;
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

  /* A panic while a JSON line is built (out of memory) logs itself in the
   * plain form rather than recursing. */
  static _Thread_local bool building_json;
  if (atomic_load(&g_json) && !building_json) {
    char ts[64];
    strftime(ts, sizeof ts, "%Y-%m-%dT%H:%M:%S", &tm);
    size_t n;
    building_json = true;
    char *line = json_line(ts, (int)(ms % 1000), level, msg, &n);
    /* Escapes can make the line several times the message (\u0001 for a
     * control byte): cut the message until the line fits PIPE_BUF. */
    while (n > PIPE_BUF && len > 16) {
      free(line);
      len = len * 3 / 4;
      while (len > 0 && ((unsigned char)msg[len] & 0xC0) == 0x80) len--; /* not inside a character */
      memcpy(msg + len, "...", sizeof "..."); /* with its NUL */
      len += STR_LEN("...");
      line = json_line(ts, (int)(ms % 1000), level, msg, &n);
    }
    building_json = false;
    ssize_t w = write(STDERR_FILENO, line, n);
    (void)w; /* nothing sensible to do if stderr is gone */
    free(line);
    return;
  }
  char line[PIPE_BUF], ts[16];
  size_t n;
  strftime(ts, sizeof ts, "%H:%M:%S", &tm);
  static const char *tags[] = {"DEBUG", "INFO ", "WARN ", "ERROR"};
  if (g_name[0])
    n = (size_t)snprintf(line, sizeof line, "%s.%03d %s [%s] %s\n", ts, (int)(ms % 1000), tags[level], g_name, msg);
  else
    n = (size_t)snprintf(line, sizeof line, "%s.%03d %s %s\n", ts, (int)(ms % 1000), tags[level], msg);
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
