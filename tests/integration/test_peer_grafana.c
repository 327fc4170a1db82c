/* The Grafana dashboard (deploy/grafana/rumor.json) against live nodes: it
 * parses, has a title, panels and a Prometheus datasource variable that
 * every query uses, and every metric its queries name is one that rumor
 * serves on /metrics — read from a gossip cluster of two training peers and
 * its bootstrap node, from `rumor top --web` watching them (rumor_cluster_*:
 * Ξ is the cluster's, no node's), and from an all-reduce peer (the
 * rumor_allreduce_* series exist only there). promtool, when installed, checks the queries'
 * PromQL syntax. */
#include <criterion/criterion.h>
#include <ctype.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "../support/cluster.h"
#include "../support/fmnist.h"
#include "../support/http.h"
#include "util/util.h"

#define DASHBOARD RUMOR_SOURCE_DIR "/deploy/grafana/rumor.json"
#define MAX_NAMES 256

static struct cluster C;
static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(grafana, .init = setup, .fini = teardown, .timeout = 300);

/* ---- the metric names a node serves ---- */

struct names {
  char *v[MAX_NAMES];
  int n;
};

static bool names_has(const struct names *s, const char *name, size_t len) {
  for (int i = 0; i < s->n; i++)
    if (strlen(s->v[i]) == len && strncmp(s->v[i], name, len) == 0) return true;
  return false;
}

static bool is_name_start(char c) { return isalpha((unsigned char)c) || c == '_' || c == ':'; }
static bool is_name_char(char c) { return isalnum((unsigned char)c) || c == '_' || c == ':'; }

/* Adds the sample names of Prometheus text (every line but comments). */
static void names_add_text(struct names *s, const char *text) {
  for (const char *line = text; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : line + strlen(line)) {
    if (*line == '#' || !is_name_start(*line)) continue;
    size_t len = 0;
    while (is_name_char(line[len])) len++;
    if (!names_has(s, line, len) && s->n < MAX_NAMES) s->v[s->n++] = strndup(line, len);
  }
}

static void names_free(struct names *s) {
  for (int i = 0; i < s->n; i++) free(s->v[i]);
  s->n = 0;
}

/* The body of node i's /metrics (malloc'd). */
static char *scrape(int i) {
  char *resp = http_get(cluster_metrics_port(&C, i), "/metrics");
  cr_assert_eq(http_status(resp), 200, "node %d: /metrics: %.200s", i, resp);
  char *body = xstrdup(http_body(resp));
  free(resp);
  return body;
}

/* Scrapes node i until its text holds every string of `want` (NULL-ended),
 * at most 60 s; returns the last body (malloc'd). */
static char *scrape_until(int i, const char *const *want) {
  double t0 = cluster_now();
  for (;;) {
    char *body = scrape(i);
    bool all = true;
    for (int k = 0; want[k]; k++) all &= strstr(body, want[k]) != NULL;
    if (all) return body;
    cr_assert(cluster_now() - t0 < 60, "node %d never served all of its metrics; last /metrics:\n%s", i, body);
    free(body);
    usleep(200000);
  }
}

/* ---- the names a PromQL expression uses ---- */

static bool word_in(const char *w, size_t len, const char *const *list) {
  for (int i = 0; list[i]; i++)
    if (strlen(list[i]) == len && strncmp(list[i], w, len) == 0) return true;
  return false;
}

/* Aggregations and keywords: never metric names, whatever follows them. */
static const char *const PROMQL_WORDS[] = {
    "sum", "avg", "min", "max", "count", "stddev", "stdvar", "topk", "bottomk", "quantile", "count_values", "group",
    "and", "or", "unless", "offset", "bool", "atan2", "by", "without", "on", "ignoring", "group_left", "group_right",
    NULL};
/* Words after which a parenthesised list of label names follows. */
static const char *const PROMQL_LABEL_LISTS[] = {"by", "without", "on", "ignoring", "group_left", "group_right",
                                                 NULL};
/* Functions (a name followed by '('). */
static const char *const PROMQL_FUNCTIONS[] = {
    "rate", "irate", "increase", "delta", "idelta", "deriv", "abs", "clamp", "clamp_min", "clamp_max", "ceil",
    "floor", "round", "exp", "ln", "log2", "log10", "sqrt", "sort", "sort_desc", "absent", "changes", "resets",
    "time", "timestamp", "vector", "scalar", "histogram_quantile", "label_replace", "label_join",
    "predict_linear", "avg_over_time", "min_over_time", "max_over_time", "sum_over_time", "count_over_time",
    "last_over_time", "quantile_over_time", NULL};

static const char *skip_string(const char *p) {
  char q = *p++;
  while (*p && *p != q) p += (*p == '\\' && p[1]) ? 2 : 1;
  return *p ? p + 1 : p;
}

/* Skips from an opening bracket to past its match, strings included. */
static const char *skip_group(const char *p, char open, char close) {
  int depth = 0;
  while (*p) {
    if (*p == '"' || *p == '\'' || *p == '`') {
      p = skip_string(p);
      continue;
    }
    if (*p == open) depth++;
    if (*p == close && --depth == 0) return p + 1;
    p++;
  }
  return p;
}

static const char *skip_space(const char *p) {
  while (isspace((unsigned char)*p)) p++;
  return p;
}

/* Checks every metric name of `expr` against `served`: identifiers outside
 * strings, label matchers {...}, ranges [...], Grafana variables ($x,
 * ${x}) and label lists after by/without/on/ignoring/group_*, that are not
 * aggregations or keywords; a name followed by '(' must be a known function.
 * Returns NULL when all are served, or the first offending name (malloc'd,
 * "function NAME" for an unknown function). Counts the names in *nmetrics. */
static char *expr_unserved(const char *expr, const struct names *served, int *nmetrics) {
  for (const char *p = expr; *p;) {
    if (*p == '"' || *p == '\'' || *p == '`') p = skip_string(p);
    else if (*p == '{') p = skip_group(p, '{', '}');
    else if (*p == '[') p = skip_group(p, '[', ']');
    else if (*p == '$') {
      p++;
      if (*p == '{') p = skip_group(p, '{', '}');
      else
        while (is_name_char(*p)) p++;
    } else if (isdigit((unsigned char)*p) || *p == '.') {
      while (isalnum((unsigned char)*p) || *p == '.') p++; /* numbers, 1e3 */
    } else if (is_name_start(*p)) {
      const char *w = p;
      while (is_name_char(*p)) p++;
      size_t len = (size_t)(p - w);
      const char *next = skip_space(p);
      if (word_in(w, len, PROMQL_LABEL_LISTS) && *next == '(') p = skip_group(next, '(', ')');
      else if (word_in(w, len, PROMQL_WORDS)) continue;
      else if (*next == '(') {
        if (!word_in(w, len, PROMQL_FUNCTIONS)) {
          char *bad = xmalloc(len + 10);
          snprintf(bad, len + 10, "function %.*s", (int)len, w);
          return bad;
        }
      } else {
        if (!names_has(served, w, len)) return strndup(w, len);
        (*nmetrics)++;
      }
    } else {
      p++;
    }
  }
  return NULL;
}

/* ---- the dashboard ---- */

struct check {
  const struct names *served;
  int panels, targets, metrics;
  FILE *rules; /* promtool's rule file, or NULL */
};

/* A rule whose expression is `expr` with the dashboard's variables filled in. */
static void rule_add(FILE *f, const char *expr, int k) {
  fprintf(f, "      - record: rumor_dashboard:query_%d\n        expr: '", k);
  for (const char *p = expr; *p;) {
    if (strncmp(p, "$__rate_interval", 16) == 0) fputs("5m", f), p += 16;
    else if (strncmp(p, "$instance", 9) == 0) fputs(".*", f), p += 9;
    else if (strncmp(p, "$job", 4) == 0) fputs(".*", f), p += 4;
    else if (*p == '\'') fputs("''", f), p++;
    else fputc(*p++, f);
  }
  fputs("'\n", f);
}

static void check_panels(const json_t *panels, struct check *ck);

static void check_panel(const json_t *p, struct check *ck) {
  cr_assert(json_is_object(p), "a panel is not an object");
  const char *type = json_string_value(json_object_get(p, "type"));
  const char *title = json_string_value(json_object_get(p, "title"));
  cr_assert(type && title && *title, "a panel without a type or title");
  ck->panels++;
  if (strcmp(type, "row") == 0) {
    const json_t *inner = json_object_get(p, "panels");
    if (inner) check_panels(inner, ck);
    return;
  }
  if (strcmp(type, "text") == 0) return;
  const char *ds = json_string_value(json_object_get(json_object_get(p, "datasource"), "uid"));
  cr_assert(ds && strcmp(ds, "${datasource}") == 0, "panel '%s' does not use the datasource variable", title);
  const json_t *targets = json_object_get(p, "targets");
  cr_assert(json_is_array(targets) && json_array_size(targets) > 0, "panel '%s' has no query", title);
  size_t i;
  const json_t *t;
  json_array_foreach(targets, i, t) {
    const char *expr = json_string_value(json_object_get(t, "expr"));
    cr_assert(expr && *expr, "panel '%s': target %zu has no expr", title, i);
    int before = ck->metrics;
    char *bad = expr_unserved(expr, ck->served, &ck->metrics);
    cr_assert_null(bad, "panel '%s' queries %s, which rumor does not serve (expr: %s)", title, bad, expr);
    cr_assert_gt(ck->metrics, before, "panel '%s': no metric found in '%s'", title, expr);
    if (ck->rules) rule_add(ck->rules, expr, ck->targets);
    ck->targets++;
  }
}

static void check_panels(const json_t *panels, struct check *ck) {
  cr_assert(json_is_array(panels), "\"panels\" is not an array");
  size_t i;
  const json_t *p;
  json_array_foreach(panels, i, p) check_panel(p, ck);
}

/* The template variables: a datasource variable of type prometheus named
 * "datasource", and query variables whose label_values(METRIC..., label)
 * name served metrics. */
static void check_templating(const json_t *dash, struct check *ck) {
  const json_t *list = json_object_get(json_object_get(dash, "templating"), "list");
  cr_assert(json_is_array(list), "the dashboard has no templating list");
  bool have_ds = false;
  size_t i;
  const json_t *v;
  json_array_foreach(list, i, v) {
    const char *type = json_string_value(json_object_get(v, "type"));
    const char *name = json_string_value(json_object_get(v, "name"));
    cr_assert(type && name, "a template variable without a type or name");
    if (strcmp(type, "datasource") == 0) {
      const char *q = json_string_value(json_object_get(v, "query"));
      have_ds |= strcmp(name, "datasource") == 0 && q && strcmp(q, "prometheus") == 0;
    } else if (strcmp(type, "query") == 0) {
      const char *q = json_string_value(json_object_get(json_object_get(v, "query"), "query"));
      cr_assert(q && strncmp(q, "label_values(", 13) == 0, "variable %s: expected label_values(...), got %s", name,
                q ? q : "nothing");
      char *metric = xstrdup(q + 13);
      char *comma = strrchr(metric, ',');
      cr_assert_not_null(comma, "variable %s: %s", name, q);
      *comma = '\0';
      char *bad = expr_unserved(metric, ck->served, &ck->metrics);
      cr_assert_null(bad, "variable %s uses %s, which rumor does not serve", name, bad);
      free(metric);
    }
  }
  cr_assert(have_ds, "no template variable \"datasource\" of type datasource for prometheus");
}

/* The metric names of a 2-peer gossip cluster (bootstrap included), of a
 * `rumor top --web` watching it, and of an all-reduce peer, once each
 * serves what it ever will. */
static void live_names(struct names *served) {
  char *boot_args[] = {"--metrics", "127.0.0.1:0", NULL};
  cluster_start_bootstrap(&C, boot_args);
  int peer[2];
  for (int i = 0; i < 2; i++)
    peer[i] = cluster_start_peer(&C, "--model", "mlp:784-32-10", "--shard", i ? "1/2" : "0/2", "--epochs", "1000",
                                 "--max-steps", "100000", "--no-eval", "--wait-peers", "2", "--gossip-every", "2",
                                 "--metrics", "127.0.0.1:0", NULL);
  /* A peer serves its training figures once published, and the age of its
   * last exchange once one applied. */
  const char *const peer_wants[] = {"rumor_training_loss", "rumor_last_exchange_age_seconds", NULL};
  const char *const boot_wants[] = {"rumor_members{state=\"alive\"} 2", NULL};
  for (int i = 0; i < 2; i++) {
    char *body = scrape_until(peer[i], peer_wants);
    names_add_text(served, body);
    free(body);
  }
  char *body = scrape_until(0, boot_wants);
  names_add_text(served, body);
  free(body);

  /* rumor top --web publishes what no node knows (Ξ), once a poll has
   * both peers' sketches. */
  char top_err[300];
  int top_port = 0;
  cluster_start_top_web(&C, "top", "0", top_err, sizeof top_err, &top_port);
  double t0 = cluster_now();
  for (;;) {
    char *resp = http_get(top_port, "/metrics");
    cr_assert_eq(http_status(resp), 200, "rumor top: /metrics: %.200s", resp);
    bool all = strstr(resp, "\nrumor_cluster_xi ") && strstr(resp, "\nrumor_cluster_mean_loss ");
    if (all) names_add_text(served, http_body(resp));
    cr_assert(all || cluster_now() - t0 < 60, "rumor top never published Ξ; last /metrics:\n%s", resp);
    free(resp);
    if (all) break;
    usleep(200000);
  }

  /* An all-reduce peer joins a cluster of its own (sync=allreduce peers and
   * gossiping ones never share one), through a second bootstrap node. */
  int boot2 = cluster_spawn(&C, "bootstrap", NULL);
  snprintf(C.boot, sizeof C.boot, "%s", C.node[boot2].addr);
  int ar = cluster_start_peer(&C, "--model", "mlp:784-32-10", "--sync", "allreduce", "--epochs", "1000",
                              "--max-steps", "100000", "--no-eval", "--metrics", "127.0.0.1:0", NULL);
  const char *const ar_wants[] = {"rumor_allreduce_rounds_total", "rumor_allreduce_ring_members", NULL};
  body = scrape_until(ar, ar_wants);
  names_add_text(served, body);
  free(body);
}

static json_t *load_dashboard(void) {
  size_t len;
  char *text = proc_slurp_n(DASHBOARD, &len);
  cr_assert_gt(len, 0, "cannot read %s", DASHBOARD);
  json_t *dash = NULL;
  struct rumor_err e = {0};
  cr_assert_eq(json_text_parse(text, len, &dash, &e), 0, "%s: %s", DASHBOARD, e.msg);
  free(text);
  cr_assert(json_is_object(dash), "%s: not a JSON object", DASHBOARD);
  return dash;
}

Test(grafana, dashboard_queries_name_only_metrics_that_live_nodes_serve) {
  SKIP_WITHOUT_DATA();
  json_t *dash = load_dashboard();
  const char *title = json_string_value(json_object_get(dash, "title"));
  cr_assert(title && *title, "the dashboard has no title");
  cr_assert(json_integer_value(json_object_get(dash, "schemaVersion")) >= 39, "schemaVersion older than Grafana 11");

  struct names served = {0};
  live_names(&served);
  cr_assert_gt(served.n, 10, "too few metrics scraped (%d)", served.n);

  /* The checker itself: a name rumor does not serve, or an unknown
   * function, is refused. */
  int dummy = 0;
  char *bad = expr_unserved("sum by (instance) (rate(rumor_no_such_metric_total{job=~\"$job\"}[5m]))", &served,
                            &dummy);
  cr_assert(bad && strcmp(bad, "rumor_no_such_metric_total") == 0, "an unserved metric passed: %s", bad);
  free(bad);
  bad = expr_unserved("rumor_training_loss_typo", &served, &dummy);
  cr_assert_not_null(bad, "a misspelt metric passed");
  free(bad);
  bad = expr_unserved("made_up(rumor_training_loss)", &served, &dummy);
  cr_assert(bad && strcmp(bad, "function made_up") == 0, "an unknown function passed: %s", bad);
  free(bad);

  char rules_path[300];
  snprintf(rules_path, sizeof rules_path, "%s/dashboard-rules.yml", C.dir);
  bool have_promtool = system("command -v promtool >/dev/null 2>&1") == 0;
  struct check ck = {.served = &served, .rules = have_promtool ? fopen(rules_path, "w") : NULL};
  if (ck.rules) fputs("groups:\n  - name: rumor_dashboard\n    rules:\n", ck.rules);
  check_panels(json_object_get(dash, "panels"), &ck);
  check_templating(dash, &ck);
  cr_assert_gt(ck.panels, 5, "only %d panels", ck.panels);
  fprintf(stderr, "dashboard '%s': %d panels, %d queries naming %d metrics, all served by rumor (%d names live)\n",
          title, ck.panels, ck.targets, ck.metrics, served.n);
  if (ck.rules) {
    fclose(ck.rules);
    cluster_sh("promtool check rules %s >/dev/null", rules_path);
  } else {
    fprintf(stderr, "promtool not installed (apt-get install prometheus): PromQL syntax not checked\n");
  }
  names_free(&served);
  json_decref(dash);
}
