/* `rumor top --servers A,B`: parameter servers and their workers, as the
 * servers see them (peer/ps/ps.h, "Watching servers"). Servers and their
 * workers are not gossip members, so the member table of `rumor top
 * --bootstrap` never shows them. */
#include <stdio.h>
#include <time.h>

#include "peer/cli/cli_impl.h"
#include "peer/ps/ps.h"
#include "util/json_text.h"

static void print_json(FILE *f, const struct ps_status *st, int n) {
  json_t *servers = json_array();
  for (int i = 0; i < n; i++) {
    const struct ps_status *s = &st[i];
    json_t *o = json_object();
    json_text_set(o, "addr", json_text_str(s->addr));
    json_text_set(o, "reachable", json_boolean(s->reachable));
    json_text_set(o, "error", json_text_str(s->error));
    if (s->reachable) {
      json_text_set(o, "range", json_integer(s->range));
      json_text_set(o, "ranges", json_integer(s->ranges));
      json_text_set(o, "stage", json_integer(s->stage));
      json_text_set(o, "stages", json_integer(s->stages)); /* 1: the whole model */
      json_text_set(o, "version", json_integer(s->version));
      json_text_set(o, "staleness", json_integer(s->staleness)); /* -1: none (ASP) */
      json_text_set(o, "workers_expected", json_integer(s->workers));
      json_text_set(o, "max_gap", json_integer(s->max_gap));
      json_t *workers = json_array();
      for (int k = 0; k < s->nw; k++) {
        json_t *w = json_object();
        json_text_set(w, "id", json_text_str(s->w[k].id));
        json_text_set(w, "clock", json_integer(s->w[k].clock));
        json_text_set(w, "state", json_string(s->w[k].done ? "done" : s->w[k].live ? "live" : "dropped"));
        json_text_push(workers, w);
      }
      json_text_set(o, "workers", workers);
    }
    json_text_push(servers, o);
  }
  json_t *doc = json_object();
  json_text_set(doc, "servers", servers);
  json_text_print(f, doc);
}

static void print_table(FILE *f, const struct ps_status *st, int n) {
  fprintf(f, "%-21s %-5s %-6s %9s %9s %7s  %s\n", "SERVER", "STAGE", "RANGE", "VERSION", "STALENESS", "MAX-GAP",
          "WORKERS (clock)");
  for (int i = 0; i < n; i++) {
    const struct ps_status *s = &st[i];
    if (!s->reachable) {
      fprintf(f, "%-21.21s UNREACHABLE: %s\n", s->addr, s->error);
      continue;
    }
    char range[32], stale[24], stage[32] = "-";
    snprintf(range, sizeof range, "%d/%d", s->range, s->ranges);
    if (s->stages > 1) snprintf(stage, sizeof stage, "%d/%d", s->stage, s->stages);
    if (s->staleness < 0) snprintf(stale, sizeof stale, "none");
    else snprintf(stale, sizeof stale, "%lld", (long long)s->staleness);
    fprintf(f, "%-21.21s %-5s %-6s %9lld %9s %7lld ", s->addr, stage, range, (long long)s->version, stale,
            (long long)s->max_gap);
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
