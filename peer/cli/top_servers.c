/* `rumor top --servers A,B`: parameter servers and their workers, as the
 * servers see them (peer/ps/ps.h, "Watching servers"). Servers and their
 * workers are not gossip members, so the member table of `rumor top
 * --bootstrap` never shows them. */
#include <stdio.h>
#include <time.h>

#include "peer/cli/cli_impl.h"
#include "peer/ps/ps.h"

static void print_json(FILE *f, const struct ps_status *st, int n) {
  struct json_buf b;
  json_buf_init(&b);
  json_obj_begin(&b);
  json_key(&b, "servers");
  json_arr_begin(&b);
  for (int i = 0; i < n; i++) {
    const struct ps_status *s = &st[i];
    json_obj_begin(&b);
    json_key(&b, "addr"), json_str(&b, s->addr);
    json_key(&b, "reachable"), json_bool(&b, s->reachable);
    json_key(&b, "error"), json_str(&b, s->error);
    if (s->reachable) {
      json_key(&b, "range"), json_int(&b, s->range);
      json_key(&b, "ranges"), json_int(&b, s->ranges);
      json_key(&b, "version"), json_int(&b, s->version);
      json_key(&b, "staleness"), json_int(&b, s->staleness); /* -1: none (ASP) */
      json_key(&b, "workers_expected"), json_int(&b, s->workers);
      json_key(&b, "max_gap"), json_int(&b, s->max_gap);
      json_key(&b, "workers");
      json_arr_begin(&b);
      for (int k = 0; k < s->nw; k++) {
        json_obj_begin(&b);
        json_key(&b, "id"), json_str(&b, s->w[k].id);
        json_key(&b, "clock"), json_int(&b, s->w[k].clock);
        json_key(&b, "state"), json_str(&b, s->w[k].done ? "done" : s->w[k].live ? "live" : "dropped");
        json_obj_end(&b);
      }
      json_arr_end(&b);
    }
    json_obj_end(&b);
  }
  json_arr_end(&b);
  json_obj_end(&b);
  fprintf(f, "%.*s\n", (int)b.len, b.data);
  json_buf_free(&b);
}

static void print_table(FILE *f, const struct ps_status *st, int n) {
  fprintf(f, "%-21s %-6s %9s %9s %7s  %s\n", "SERVER", "RANGE", "VERSION", "STALENESS", "MAX-GAP", "WORKERS (clock)");
  for (int i = 0; i < n; i++) {
    const struct ps_status *s = &st[i];
    if (!s->reachable) {
      fprintf(f, "%-21.21s UNREACHABLE: %s\n", s->addr, s->error);
      continue;
    }
    char range[32], stale[24];
    snprintf(range, sizeof range, "%d/%d", s->range, s->ranges);
    if (s->staleness < 0) snprintf(stale, sizeof stale, "none");
    else snprintf(stale, sizeof stale, "%lld", (long long)s->staleness);
    fprintf(f, "%-21.21s %-6s %9lld %9s %7lld ", s->addr, range, (long long)s->version, stale, (long long)s->max_gap);
    for (int k = 0; k < s->nw; k++)
      fprintf(f, " %.8s:%lld%s", s->w[k].id, (long long)s->w[k].clock,
              s->w[k].done ? "(done)" : s->w[k].live ? "" : "(dropped)");
    fprintf(f, "\n");
  }
  fflush(f);
}

int top_servers(const struct net_keys *keys, const char *servers, double interval_s, int64_t count, bool json,
                uint32_t timeout_ms) {
  struct ps_status_config cfg = {.identity = &keys->identity, .cluster_key = keys->cluster_key, .servers = servers,
                                 .timeout_ms = timeout_ms};
  for (int64_t k = 0; count == 0 || k < count; k++) {
    if (k) {
      struct timespec ts = {(time_t)interval_s, (long)((interval_s - (double)(time_t)interval_s) * 1e9)};
      nanosleep(&ts, NULL);
    }
    if (signals_stop_requested()) break;
    struct ps_status *st;
    int n;
    struct rumor_err e = {0};
    if (ps_status_query(&cfg, &st, &n, &e)) {
      fprintf(stderr, "rumor top: %s\n", e.msg);
      return 2;
    }
    int reachable = 0;
    for (int i = 0; i < n; i++) reachable += st[i].reachable;
    if (json) print_json(stdout, st, n);
    else print_table(stdout, st, n);
    ps_status_free(st, n);
    if (count == 1 && reachable == 0) return 1;
  }
  return 0;
}
