/* `rumor top --web` against a live 2-peer cluster on 127.0.0.1: the page and
 * /state.json over a plain socket (every member, valid JSON, the chart
 * series), read-only (any other method 405, unknown paths 404), a silent
 * client, an oversized request and a server full of silent clients that do
 * not stop it, HEAD, headers against sniffing and caching, a foreign Host
 * refused (DNS rebinding), input after the request drained rather than
 * resetting the answer; a cluster gone is reported, never its stale
 * figures; headless Chromium
 * (Debian's `chromium`, installed by deploy/install-deps.sh) renders the
 * page, and the rendered DOM holds both peers in the table and a chart drawn
 * by the page's script; /metrics publishes the cluster's gauges (Ξ, peers)
 * in Prometheus' format; bad --web values are clear errors. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "../support/cluster.h"
#include "../support/fmnist.h"
#include "../support/http.h"
#include "net/net.h"
#include "util/util.h"

static struct cluster C;
static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(top_web, .init = setup, .fini = teardown, .timeout = 300);

#define HTTP_CLIENTS_MAX 32   /* gossip/http.c's HTTP_MAX_CLIENTS: clients it holds at once */
#define FLOOD_BYTES (1 << 20)

struct top_run {
  pid_t pid;
  int port;
  int peer[2];
  char err[300];
};

/* Whether `rumor top` still runs (a zombie would still answer kill(pid, 0)). */
static bool top_alive(const struct top_run *t) { return waitpid(t->pid, NULL, WNOHANG) == 0; }

/* A bootstrap node and two training peers, and `rumor top --web SPEC`
 * refreshing every 0.5 s; waits for its URL on stderr. */
static void start(struct top_run *t, const char *spec) {
  cluster_start_bootstrap(&C, NULL);
  for (int i = 0; i < 2; i++)
    t->peer[i] = cluster_start_peer(&C, "--model", "mlp:784-32-10", "--shard", i ? "1/2" : "0/2", "--epochs",
                                    "1000", "--max-steps", "1000000", "--no-eval", "--wait-peers", "2",
                                    "--gossip-every", "4", NULL);
  for (int i = 0; i < 2; i++)
    cr_assert(cluster_wait_file(C.node[t->peer[i]].log, "first step", 60), "peer %d did not start training: %s", i,
              proc_slurp(C.node[t->peer[i]].log));
  t->pid = cluster_start_top_web(&C, "top", spec, t->err, sizeof t->err, &t->port);
}

/* /state.json once both peers report training figures and Ξ is known (at
 * most 60 s):
 * parsed, with the response's status checked. */
static json_t *state_when_training(const struct top_run *t) {
  double t0 = cluster_now();
  for (;;) {
    char *resp = http_get(t->port, "/state.json");
    int status = http_status(resp);
    cr_assert(status == 200 || status == 503, "/state.json: %.300s", resp);
    cr_assert(top_alive(t), "top exited: %s", proc_slurp(t->err));
    if (status == 200) {
      cr_assert_not_null(strstr(resp, "Content-Type: application/json"), "%.300s", resp);
      const char *body = http_body(resp);
      json_t *s = NULL;
      struct rumor_err e = {0};
      cr_assert_eq(json_text_parse(body, strlen(body), &s, &e), 0, "/state.json is not JSON (%s): %s", e.msg, body);
      size_t training = 0, i;
      const json_t *nd;
      json_array_foreach(json_object_get(s, "nodes"), i, nd) training += json_is_integer(json_object_get(nd, "step"));
      free(resp);
      if (training == 2 && json_is_number(json_object_get(json_object_get(s, "drift"), "xi"))) return s;
      json_decref(s);
    } else {
      free(resp);
    }
    cr_assert(cluster_now() - t0 < 60, "the peers' figures never reached /state.json");
    usleep(200000);
  }
}

/* The node of `s` whose address is `addr`, or NULL. */
static const json_t *node_at(const json_t *s, const char *addr) {
  size_t i;
  const json_t *nd;
  json_array_foreach(json_object_get(s, "nodes"), i, nd) {
    const char *a = json_string_value(json_object_get(nd, "addr"));
    if (a && strcmp(a, addr) == 0) return nd;
  }
  return NULL;
}

static void expect_status(int port, const char *method, const char *path, int want) {
  char *resp = http_request(port, method, path);
  cr_assert_eq(http_status(resp), want, "%s %s: want %d, got: %.200s", method, path, want, resp);
  free(resp);
}

/* HEAD: the headers alone; 405 says what is allowed; no sniffing, no
 * caching; a Host that is not loopback is refused on a loopback bind (DNS
 * rebinding), a loopback one with its port answered; as many silent clients
 * as the server holds at once do not keep a new one out (the oldest
 * unfinished one goes), nor as many that were answered and never read. */
static void check_http_hardening(const struct top_run *t) {
  char *resp;
  resp = http_request(t->port, "HEAD", "/state.json");
  cr_assert_eq(http_status(resp), 200, "HEAD: %.200s", resp);
  cr_assert_str_empty(http_body(resp), "HEAD sent a body: %.200s", resp);
  cr_assert(strstr(resp, "X-Content-Type-Options: nosniff\r\n") && strstr(resp, "Cache-Control: no-store\r\n"),
            "%.300s", resp);
  free(resp);
  resp = http_request(t->port, "POST", "/");
  cr_assert_not_null(strstr(resp, "Allow: GET, HEAD\r\n"), "405 without Allow: %.300s", resp);
  free(resp);
  static const char rebind[] = "GET /state.json HTTP/1.1\r\nHost: attacker.example:80\r\n\r\n";
  resp = http_raw(t->port, rebind, sizeof rebind - 1);
  cr_assert_eq(http_status(resp), 403, "a foreign Host was answered: %.200s", resp);
  /* The body is exactly its line (it once ended in a NUL: a length counted
   * by hand, one too many). */
  static const char forbidden[] = "this server answers only requests for a loopback host\n";
  char length[48];
  snprintf(length, sizeof length, "\r\nContent-Length: %zu\r\n", sizeof forbidden - 1);
  cr_assert_str_eq(http_body(resp), forbidden, "403 body: %.300s", resp);
  cr_assert_not_null(strstr(resp, length), "403 without %s: %.300s", length + 2, resp);
  free(resp);
  char local[200];
  int n = snprintf(local, sizeof local, "GET /state.json HTTP/1.1\r\nhost: localhost:%d\r\n\r\n", t->port);
  resp = http_raw(t->port, local, (size_t)n);
  cr_assert_eq(http_status(resp), 200, "Host localhost refused: %.200s", resp);
  free(resp);

  int idle[HTTP_CLIENTS_MAX];
  for (int i = 0; i < HTTP_CLIENTS_MAX; i++) idle[i] = http_connect(t->port);
  usleep(200000);
  expect_status(t->port, "GET", "/state.json", 200);
  for (int i = 0; i < HTTP_CLIENTS_MAX; i++) close(idle[i]);

  /* As many clients that ask and never read nor close: their answers are
   * out, so they are the ones to go when a new client comes. */
  static const char ask[] = "GET /state.json HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  for (int i = 0; i < HTTP_CLIENTS_MAX; i++) {
    idle[i] = http_connect(t->port);
    cr_assert_eq(send(idle[i], ask, sizeof ask - 1, MSG_NOSIGNAL), (ssize_t)(sizeof ask - 1));
  }
  usleep(300000);
  expect_status(t->port, "GET", "/state.json", 200);
  for (int i = 0; i < HTTP_CLIENTS_MAX; i++) close(idle[i]);
}

/* A lingering close: a client with a small receive window asks for the
 * page (11 KB) and sends more bytes after its request, as a client with a
 * body or a pipelined request does. Closing with that input unread would
 * reset the connection and drop the part of the page the kernel had not
 * delivered yet; the server drains it instead, and the whole page arrives. */
static void check_lingering_close(const struct top_run *t) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0);
  int small = 2048; /* before connect: the window the server sees */
  setsockopt(fd, SOL_SOCKET, SO_RCVBUF, &small, sizeof small);
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)t->port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "connect: %s", strerror(errno));
  static const char req[] = "GET / HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
  cr_assert_eq(send(fd, req, sizeof req - 1, MSG_NOSIGNAL), (ssize_t)(sizeof req - 1));
  usleep(300000); /* answered and (before the fix) closed by now */
  char junk[1000];
  memset(junk, 'x', sizeof junk);
  (void)send(fd, junk, sizeof junk, MSG_NOSIGNAL);
  usleep(300000);
  size_t cap = 1 << 16, got = 0;
  char *buf = xmalloc(cap);
  int err = 0;
  for (;;) {
    ssize_t r = read(fd, buf + got, cap - got - 1);
    if (r < 0) err = errno;
    if (r <= 0) break;
    got += (size_t)r;
    if (got + 1 == cap) break;
  }
  buf[got] = '\0';
  close(fd);
  const char *cl = strstr(buf, "Content-Length: ");
  cr_assert_not_null(cl, "no Content-Length in %zu bytes (read error: %s): %.200s", got, err ? strerror(err) : "none",
                     buf);
  size_t want = strtoul(cl + 16, NULL, 10);
  size_t body = got - (size_t)(http_body(buf) - buf);
  cr_assert_eq(body, want, "the page arrived cut: %zu of %zu bytes (read error: %s)", body, want,
               err ? strerror(err) : "none");
  free(buf);
}

/* The cluster gone (its only bootstrap address killed): the figures are not
 * served as current. /state.json says why, /metrics keeps only the poll's
 * time and success 0. */
static void check_cluster_gone_is_reported(const struct top_run *t) {
  char *resp;
  kill(C.node[0].pid, SIGKILL);
  double t0 = cluster_now();
  for (;;) {
    resp = http_get(t->port, "/state.json");
    if (http_status(resp) == 503) break;
    cr_assert(cluster_now() - t0 < 30, "/state.json still served after the cluster went: %.200s", resp);
    free(resp);
    usleep(200000);
  }
  cr_assert_not_null(strstr(http_body(resp), "\"error\":"), "no error in: %s", resp);
  free(resp);
  resp = http_get(t->port, "/metrics");
  cr_assert(strstr(resp, "\nrumor_cluster_poll_success 0\n") && !strstr(resp, "rumor_cluster_xi"),
            "stale /metrics: %s", resp);
  free(resp);
}

Test(top_web, page_and_state_are_served_read_only_and_survive_bad_clients) {
  SKIP_WITHOUT_DATA();
  struct top_run t;
  start(&t, "127.0.0.1:0");

  /* The page: HTML, self-contained (nothing fetched from elsewhere). */
  char *resp = http_get(t.port, "/");
  cr_assert_eq(http_status(resp), 200, "%.300s", resp);
  cr_assert_not_null(strstr(resp, "Content-Type: text/html"), "%.300s", resp);
  const char *page = http_body(resp);
  cr_assert(strstr(page, "<svg") && strstr(page, "state.json") && strstr(page, "<table"), "%.500s", page);
  static const char *const external[] = {"<script src", "<link", "@import", "url(", "@font-face", "src=\"http",
                                         "href=\"http"};
  for (size_t i = 0; i < sizeof external / sizeof external[0]; i++)
    cr_assert_null(strstr(page, external[i]), "the page loads something from elsewhere: '%s'", external[i]);
  free(resp);

  /* The state: the --json snapshot, every member, and the charts' series. */
  json_t *s = state_when_training(&t);
  cr_assert_eq(json_integer_value(json_object_get(s, "members")), 3, "members");
  cr_assert_eq(json_integer_value(json_object_get(s, "reachable_peers")), 2, "reachable peers");
  cr_assert(json_is_number(json_object_get(json_object_get(s, "drift"), "xi")), "drift.xi is not a number");
  cr_assert_not_null(node_at(s, C.boot), "the bootstrap node %s is missing", C.boot);
  for (int i = 0; i < 2; i++) {
    const json_t *nd = node_at(s, C.node[t.peer[i]].addr);
    cr_assert_not_null(nd, "peer %s is missing", C.node[t.peer[i]].addr);
    cr_assert(json_is_true(json_object_get(nd, "reachable")), "peer %d unreachable", i);
    cr_assert(json_is_number(json_object_get(nd, "loss")), "peer %d has no loss", i);
  }
  cr_assert(json_real_value(json_object_get(s, "interval_s")) == 0.5, "interval_s");
  const json_t *h = json_object_get(s, "history");
  size_t n = json_array_size(json_object_get(h, "time"));
  cr_assert_geq(n, 1, "no history");
  static const char *const series[] = {"xi", "xi_exact", "mean_loss"};
  for (size_t i = 0; i < 3; i++)
    cr_assert_eq(json_array_size(json_object_get(h, series[i])), n, "history.%s has not %zu values", series[i], n);
  json_decref(s);

  /* The cluster's gauges for Prometheus: Ξ and the peer counts of the same
   * poll, in a text that promtool (when installed) accepts. */
  double t0 = cluster_now();
  for (;;) { /* Ξ once both peers' sketches are in one poll */
    resp = http_get(t.port, "/metrics");
    cr_assert_eq(http_status(resp), 200, "/metrics: %.300s", resp);
    if (strstr(resp, "\nrumor_cluster_xi ")) break;
    cr_assert(cluster_now() - t0 < 30, "no rumor_cluster_xi in 30 s:\n%s", resp);
    free(resp);
    usleep(200000);
  }
  cr_assert_not_null(strstr(resp, "Content-Type: text/plain; version=0.0.4"), "%.300s", resp);
  const char *m = http_body(resp);
  static const char *const gauges[] = {"\nrumor_cluster_xi ", "\nrumor_cluster_xi_relative ",
                                       "\nrumor_cluster_parameter_norm ", "\nrumor_cluster_mean_loss ",
                                       "\nrumor_cluster_peers 2\n", "\nrumor_cluster_peers_reachable 2\n",
                                       "# TYPE rumor_cluster_xi gauge\n"};
  for (size_t i = 0; i < sizeof gauges / sizeof gauges[0]; i++)
    cr_assert_not_null(strstr(m, gauges[i]), "/metrics lacks '%s':\n%s", gauges[i] + 1, m);
  double xi = strtod(strstr(m, "\nrumor_cluster_xi ") + 18, NULL);
  cr_assert(isfinite(xi) && xi > 0, "rumor_cluster_xi %g", xi);
  cr_assert_null(strstr(m, "rumor_cluster_xi_exact"), "Ξ exact published without --exact:\n%s", m);
  cr_assert_not_null(strstr(m, "\nrumor_cluster_poll_success 1\n"), "no poll_success 1:\n%s", m);
  for (const char *line = m; *line; line = strchr(line, '\n') ? strchr(line, '\n') + 1 : line + strlen(line)) {
    if (*line == '#' || *line == '\n') continue;
    const char *sp = strchr(line, ' ');
    cr_assert_not_null(sp, "a sample without a value: %.80s", line);
    char *end;
    double v = strtod(sp + 1, &end);
    cr_assert(end > sp + 1 && (*end == '\n' || !*end) && isfinite(v), "not a finite value: %.80s", line);
  }
  if (system("command -v promtool >/dev/null 2>&1") == 0) {
    char path[300];
    snprintf(path, sizeof path, "%s/top-metrics.txt", C.dir);
    FILE *f = fopen(path, "w");
    cr_assert_not_null(f);
    fputs(m, f);
    fclose(f);
    cluster_sh("promtool check metrics < %s", path);
  }
  free(resp);

  /* Read-only. */
  expect_status(t.port, "POST", "/", 405);
  expect_status(t.port, "PUT", "/state.json", 405);
  expect_status(t.port, "DELETE", "/state.json", 405);
  expect_status(t.port, "GET", "/nope", 404);
  expect_status(t.port, "GET", "/state.json/../etc/passwd", 404);

  /* A client that connects and says nothing, a request as long as the
   * server takes without its end, and a flood far beyond, hold nothing:
   * the state is still served, and top still runs. */
  int silent = http_connect(t.port);
  char *flood = xmalloc(FLOOD_BYTES);
  memset(flood, 'A', FLOOD_BYTES);
  resp = http_raw(t.port, flood, NET_HTTP_HEAD_MAX);
  cr_assert_eq(http_status(resp), 431, "a request without its end: %.200s", resp);
  free(resp);
  free(http_raw(t.port, flood, FLOOD_BYTES)); /* answered 431 or reset: the server stops reading */
  free(flood);
  expect_status(t.port, "GET", "/state.json", 200);
  close(silent);

  check_http_hardening(&t);
  check_lingering_close(&t);
  check_cluster_gone_is_reported(&t);
  cr_assert(top_alive(&t), "top exited: %s", proc_slurp(t.err));
}

#define CHROMIUM "/usr/bin/chromium" /* Debian's package `chromium` */

static bool have_chromium(void) { return access(CHROMIUM, X_OK) == 0; }

/* Whether a <polyline> between `from` and `end` has points. */
static bool has_drawn_polyline(const char *from, const char *end) {
  for (const char *p = strstr(from, "<polyline points=\""); p && p < end; p = strstr(p + 1, "<polyline points=\"")) {
    const char *v = p + 18;
    if (*v >= '0' && *v <= '9') return true;
  }
  return false;
}

Test(top_web, headless_chromium_renders_the_members_and_a_chart) {
  SKIP_WITHOUT_DATA();
  if (!have_chromium())
    cr_skip_test("chromium is not installed (apt-get install chromium; deploy/install-deps.sh installs it): the "
                 "rendered page is not checked");
  struct top_run t;
  start(&t, "0"); /* PORT alone: 127.0.0.1 */
  json_decref(state_when_training(&t));

  char url[64], profile[300];
  snprintf(url, sizeof url, "http://127.0.0.1:%d/", t.port);
  snprintf(profile, sizeof profile, "%s/chromium", C.dir);
  char user_dir[320];
  snprintf(user_dir, sizeof user_dir, "--user-data-dir=%s", profile);
  char *argv[] = {CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", user_dir,
                  "--virtual-time-budget=5000", "--dump-dom", url, NULL};
  char *dom = NULL, *err = NULL;
  int st = proc_run(argv, 120, C.dir, &dom, &err);
  cr_assert(proc_exited_with(st, 0), "chromium failed (status %d): %s", st, err);

  /* Both peers (and the bootstrap node) in the member table... */
  const char *table = strstr(dom, "<table id=\"members\"");
  cr_assert_not_null(table, "no member table in the rendered page:\n%s", dom);
  for (int i = 0; i < 2; i++) {
    char cell[96];
    snprintf(cell, sizeof cell, "<td class=\"l\">%s</td>", C.node[t.peer[i]].addr);
    cr_assert_not_null(strstr(table, cell), "peer %s is not in the rendered table:\n%s", C.node[t.peer[i]].addr,
                       table);
  }
  /* ... and a chart the script drew: an <svg> holding a polyline with points. */
  bool drawn = false;
  static const char *const charts[] = {"<svg id=\"chart-loss\"", "<svg id=\"chart-xi\""};
  for (int k = 0; k < 2; k++) {
    const char *svg = strstr(dom, charts[k]);
    cr_assert_not_null(svg, "no %s in the rendered page", charts[k]);
    const char *end = strstr(svg, "</svg>");
    cr_assert_not_null(end);
    bool d = has_drawn_polyline(svg, end);
    fprintf(stderr, "%s>: %s\n", charts[k], d ? "a line drawn" : "no line");
    drawn |= d;
  }
  cr_assert(drawn, "no chart drawn in the rendered page:\n%s", dom);
  cr_assert(has_drawn_polyline(strstr(dom, charts[0]), strstr(strstr(dom, charts[0]), "</svg>")),
            "the loss chart has no line although both peers report a loss");
  free(dom);
  free(err);
}

Test(top_web, bad_web_values_are_clear_errors) {
  char id[300];
  cluster_make_identity(&C, "top", id, sizeof id);
  struct {
    const char *value, *needle;
  } cases[] = {
      {":8080", "--web :8080: name the host"},
      {"70000", "--web 70000: expected PORT or HOST:PORT"},
      {"127.0.0.1:http", "the port must be a number"},
      {"1.2.3.4.5:8080", "--web 1.2.3.4.5:8080: the host must be an IPv4 address"},
      {"[::1:8080", "--web [::1:8080: the host must be"},
  };
  char csv[300];
  snprintf(csv, sizeof csv, "%s/top.csv", C.dir);
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *args[] = {"top", "--bootstrap", "127.0.0.1:1", "--cluster-key", C.key, "--identity", id, "--csv", csv,
                    "--web", (char *)cases[i].value, "--once", NULL};
    cluster_expect_exit(&C, args, 2, cases[i].needle);
    cr_assert_neq(access(csv, F_OK), 0, "--web %s was refused after --csv made %s", cases[i].value, csv);
  }
  char *servers[] = {"top", "--servers", "127.0.0.1:1", "--cluster-key", C.key, "--identity", id, "--web", "0",
                     NULL};
  cluster_expect_exit(&C, servers, 2, "--web shows a gossip cluster");
}
