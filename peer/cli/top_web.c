/*
 * `rumor top --web`: the live web view. One page (peer/cli/top_web.html,
 * embedded at build time: peer/CMakeLists.txt makes top_web_page from it)
 * and the latest state as JSON, served read-only by the metrics endpoint's
 * HTTP server on the monitor's own loop (gossip_monitor_serve). The page's
 * script polls /state.json and draws the table and the charts; nothing here
 * formats figures for the browser.
 */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <uv.h>

#include "gossip/monitor.h"
#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

#define TOP_WEB_ADDR_MAX 160

struct top_web {
  char *state; /* the latest /state.json body, or NULL before the first poll */
  size_t state_len;
  char *metrics; /* the latest /metrics body (Prometheus text), or NULL before the first poll */
  size_t metrics_len;
  char *failure; /* /state.json's body while the last poll failed ({"error": ...}), else NULL */
  size_t failure_len;
};

static char *copy_bytes(const void *p, size_t n) {
  char *c = xmalloc(n ? n : 1);
  memcpy(c, p, n);
  return c;
}

static int web_handler(void *ctx, const char *path, char **body, size_t *len, const char **type) {
  struct top_web *w = ctx;
  if (strcmp(path, "/") == 0 || strcmp(path, "/index.html") == 0) {
    *body = copy_bytes(top_web_page, top_web_page_len);
    *len = top_web_page_len;
    *type = "text/html; charset=utf-8";
    return 200;
  }
  if (strcmp(path, "/state.json") == 0) {
    if (w->failure) { /* the figures held are stale: the page shows why instead */
      *body = copy_bytes(w->failure, w->failure_len);
      *len = w->failure_len;
      *type = "application/json";
      return 503;
    }
    if (!w->state) {
      static const char none[] = "{\"error\":\"no figures yet: the first poll has not finished\"}\n";
      *body = copy_bytes(none, sizeof none - 1);
      *len = sizeof none - 1;
      *type = "application/json";
      return 503;
    }
    *body = copy_bytes(w->state, w->state_len);
    *len = w->state_len;
    *type = "application/json";
    return 200;
  }
  if (strcmp(path, "/metrics") == 0) {
    static const char none[] = "# rumor top: no figures yet, the first poll has not finished\n";
    *body = w->metrics ? copy_bytes(w->metrics, w->metrics_len) : copy_bytes(none, sizeof none - 1);
    *len = w->metrics ? w->metrics_len : sizeof none - 1;
    *type = "text/plain; version=0.0.4; charset=utf-8";
    return 200;
  }
  static const char nf[] = "not found; the web view serves /, /state.json and /metrics\n";
  *body = copy_bytes(nf, sizeof nf - 1);
  *len = sizeof nf - 1;
  return 404;
}

/* Turns --web's value into "host:port" for the server: "PORT" and
 * "localhost:PORT" become 127.0.0.1:PORT; anything else must name its host
 * as a numeric address ("HOST:PORT", "[v6]:PORT"). Sets *loopback when the
 * host is a loopback address. Returns 0, or RUMOR_EFORMAT with a message
 * naming the value. */
static int web_addr(const char *spec, char *addr, size_t cap, bool *loopback, struct rumor_err *e) {
  int64_t port;
  const char *colon = strrchr(spec, ':');
  if (!colon) {
    if (parse_i64(spec, 0, 65535, &port))
      return rumor_err_set(e, RUMOR_EFORMAT, "--web %s: expected PORT or HOST:PORT with a port in [0, 65535]", spec);
    snprintf(addr, cap, "127.0.0.1:%d", (int)port);
    *loopback = true;
    return 0;
  }
  if (colon == spec)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "--web %s: name the host (PORT alone serves 127.0.0.1; 0.0.0.0:PORT serves every interface)",
                         spec);
  if (parse_i64(colon + 1, 0, 65535, &port))
    return rumor_err_set(e, RUMOR_EFORMAT, "--web %s: the port must be a number in [0, 65535]", spec);
  size_t hl = (size_t)(colon - spec);
  if (hl + 8 > cap) return rumor_err_set(e, RUMOR_EFORMAT, "--web %s: the host is too long", spec);
  if (STR_EQ_LIT(spec, hl, "localhost")) {
    snprintf(addr, cap, "127.0.0.1:%d", (int)port);
    *loopback = true;
    return 0;
  }
  char host[TOP_WEB_ADDR_MAX];
  snprintf(host, sizeof host, "%.*s", (int)hl, spec);
  struct sockaddr_storage ss;
  bool v6 = hl >= 2 && host[0] == '[' && host[hl - 1] == ']';
  if (v6) host[hl - 1] = '\0';
  if (v6 ? uv_ip6_addr(host + 1, 0, (struct sockaddr_in6 *)&ss) : uv_ip4_addr(host, 0, (struct sockaddr_in *)&ss))
    return rumor_err_set(e, RUMOR_EFORMAT, "--web %s: the host must be an IPv4 address or [IPv6] (or localhost)",
                         spec);
  snprintf(addr, cap, "%.*s:%d", (int)hl, spec, (int)port);
  *loopback = net_http_host_is_loopback(spec, hl); /* the rule the server applies to Host */
  return 0;
}

int top_web_check(const char *spec, struct rumor_err *e) {
  char addr[TOP_WEB_ADDR_MAX];
  bool loopback;
  return web_addr(spec, addr, sizeof addr, &loopback, e);
}

int top_web_start(struct gossip_monitor *m, const char *spec, struct top_web **out, struct rumor_err *e) {
  *out = NULL;
  char addr[TOP_WEB_ADDR_MAX];
  bool loopback = false;
  int rc = web_addr(spec, addr, sizeof addr, &loopback, e);
  if (rc) return rc;
  struct top_web *w = xcalloc(1, sizeof *w);
  int port = 0;
  if ((rc = gossip_monitor_serve(m, "--web", addr, web_handler, w, &port, e))) {
    free(w);
    return rc;
  }
  const char *colon = strrchr(addr, ':');
  fprintf(stderr, "rumor top: web view at http://%.*s:%d/\n", (int)(colon - addr), addr, port);
  if (!loopback)
    fprintf(stderr, "rumor top: warning: --web %s is reachable from other machines; the view has no "
                    "authentication and shows the cluster's addresses and figures\n", spec);
  *out = w;
  return 0;
}

void top_web_set_state(struct top_web *w, const char *json, size_t len) {
  free(w->failure);
  w->failure = NULL;
  free(w->state);
  w->state = copy_bytes(json, len);
  w->state_len = len;
}

/* One gauge in Prometheus' text format, left out when v is NaN (a figure
 * that does not exist now is absent, not a number). */
static void put_gauge(FILE *f, const char *name, const char *help, double v) {
  if (isnan(v)) return;
  fprintf(f, "# HELP %s %s\n# TYPE %s gauge\n%s %.15g\n", name, help, name, name, v); /* 15: Unix ms survive */
}

/* Makes /metrics: the figures of report r (NULL after a failed poll: none,
 * so that nothing stale is served) and the poll's time and outcome. */
static void set_metrics(struct top_web *w, const struct gossip_cluster_report *r, double mean_loss, double poll_s) {
  char *text = NULL;
  size_t len = 0;
  FILE *b = open_memstream(&text, &len);
  RUMOR_ASSERT(b);
  if (r) {
    put_gauge(b, "rumor_cluster_xi",
              "Consensus distance between the replicas, sqrt((1/n) sum |theta_i - mean theta|^2), estimated from "
              "the peers' count-sketches (as rumor top shows it)",
              r->xi);
    put_gauge(b, "rumor_cluster_xi_relative", "The consensus distance over the norm of the mean parameters",
              r->rel_drift);
    put_gauge(b, "rumor_cluster_parameter_norm", "Norm of the peers' mean parameters", r->mean_norm);
    put_gauge(b, "rumor_cluster_xi_exact",
              "The consensus distance computed from the peers' parameters (rumor top --exact only)", r->xi_exact);
    put_gauge(b, "rumor_cluster_drift_peers", "Peers whose sketches the consensus distance covers",
              isnan(r->xi) ? NAN : (double)r->drift_n);
    put_gauge(b, "rumor_cluster_mean_loss", "Mean training loss over the peers that report one", mean_loss);
    put_gauge(b, "rumor_cluster_peers", "Peers in the member table", (double)r->peers);
    put_gauge(b, "rumor_cluster_peers_reachable", "Peers that answered the last poll", (double)r->reachable_peers);
  }
  put_gauge(b, "rumor_cluster_poll_timestamp_seconds", "Unix time at which the last poll began", poll_s);
  put_gauge(b, "rumor_cluster_poll_success", "1 when the last poll reached the cluster, 0 when it failed",
            r ? 1 : 0);
  int closed = fclose(b); /* a memory stream fails only when out of memory */
  RUMOR_ASSERT(closed == 0);
  free(w->metrics);
  w->metrics = text;
  w->metrics_len = len;
}

void top_web_set_metrics(struct top_web *w, const struct gossip_cluster_report *r, double mean_loss) {
  set_metrics(w, r, mean_loss, r->time_s);
}

void top_web_set_failure(struct top_web *w, double now_s, const char *why) {
  json_t *o = json_object();
  RUMOR_ASSERT(o);
  json_text_set(o, "error", json_text_str(why));
  json_text_set(o, "time", json_text_time(now_s));
  free(w->failure);
  w->failure = json_text_dump_times(o, &w->failure_len);
  json_decref(o);
  set_metrics(w, NULL, NAN, now_s);
}

void top_web_free(struct top_web *w) {
  if (!w) return;
  free(w->state);
  free(w->metrics);
  free(w->failure);
  free(w);
}
