/* The HTTP request-head parser (net.h, net_http_parse) behind the metrics
 * endpoint and `rumor top --web`: good heads with their method, path and
 * Host; the faults it answers (400 for bytes and lines, 405 for methods, 431
 * for a head that does not end), each in the order its bytes come; what
 * follows the head (a body, a pipelined request) is left alone; every prefix
 * of a good head asks for more; and which Host values are loopback ones. */
#include <criterion/criterion.h>
#include <stdlib.h>
#include <string.h>

#include "net/net.h"

static struct net_http_request parse(const char *s, size_t n) {
  struct net_http_request r;
  net_http_parse(s, n, &r);
  return r;
}

#define PARSE(lit) parse(STR_LIT(lit))

/* Whether p[0..n) is the string `want`. */
static bool is(const char *p, size_t n, const char *want) { return p && n == strlen(want) && memcmp(p, want, n) == 0; }

Test(net_http, a_good_get_gives_its_method_path_without_query_and_host) {
  static const char req[] = "GET /state.json?since=3 HTTP/1.1\r\nUser-Agent: x\r\nHost:  localhost:8080 \r\n\r\n";
  struct net_http_request r = parse(req, sizeof req - 1);
  cr_assert_eq(r.status, 0, "refused: %d %s", r.status, r.reason);
  cr_assert(r.complete);
  cr_assert_eq(r.head_len, sizeof req - 1);
  cr_assert_eq(r.method, NET_HTTP_GET);
  cr_assert_eq(r.minor_version, 1);
  cr_assert(is(r.target, r.target_len, "/state.json?since=3"), "target %.*s", (int)r.target_len, r.target);
  cr_assert(is(r.path, r.path_len, "/state.json"), "path %.*s", (int)r.path_len, r.path);
  cr_assert(is(r.host, r.host_len, "localhost:8080"), "host '%.*s'", (int)r.host_len, r.host);
}

Test(net_http, head_and_bare_lf_lines_and_http10_without_host_are_good) {
  struct net_http_request r = PARSE("HEAD / HTTP/1.0\n\n");
  cr_assert(r.status == 0 && r.complete && r.method == NET_HTTP_HEAD && r.minor_version == 0);
  cr_assert_null(r.host, "an absent Host must be NULL");
  cr_assert(is(r.path, r.path_len, "/"));
  r = PARSE("GET /metrics HTTP/1.1\r\nhOsT: 127.0.0.1\r\nAccept: */*\n\r\n");
  cr_assert(r.status == 0 && r.complete && is(r.host, r.host_len, "127.0.0.1"), "%d %s", r.status, r.reason);
}

/* A body or a second request after the blank line is not the parser's:
 * the head ends where it ends and the first request is what counts. */
Test(net_http, what_follows_the_head_is_left_alone) {
  static const char two[] = "GET /a HTTP/1.1\r\nHost: localhost\r\n\r\nPOST /b HTTP/1.1\r\n\0\0\0";
  struct net_http_request r = parse(two, sizeof two - 1);
  cr_assert(r.status == 0 && r.complete && r.method == NET_HTTP_GET && is(r.path, r.path_len, "/a"));
  cr_assert_eq(r.head_len, STR_LEN("GET /a HTTP/1.1\r\nHost: localhost\r\n\r\n"));
}

/* Every proper prefix of a good head asks for more, never an answer. */
Test(net_http, every_prefix_of_a_good_head_asks_for_more) {
  static const char req[] = "GET /x?y HTTP/1.1\r\nHost: [::1]:9\r\nX-A: b\tc\r\n\r\n";
  for (size_t n = 0; n < sizeof req - 1; n++) {
    struct net_http_request r = parse(req, n);
    cr_assert(r.status == 0 && !r.complete, "prefix of %zu bytes: status %d, complete %d", n, r.status, r.complete);
  }
}

struct bad_case {
  const char *req;
  size_t len;
  int status;
  const char *reason;
};
#define BAD(lit, status, reason) {STR_LIT(lit), status, reason}

Test(net_http, faults_are_answered_with_their_status_and_reason) {
  static const struct bad_case cases[] = {
      BAD("POST / HTTP/1.0\r\n\r\n", 405, "only GET and HEAD\n"),
      BAD("get / HTTP/1.0\r\n\r\n", 405, "only GET and HEAD\n"),
      BAD("DELETE /state.json HTTP/1.1\r\n", 405, "only GET and HEAD\n"), /* known at the line's end */
      BAD("GET /\r\n\r\n", 400, "bad request line\n"),
      BAD("GET  / HTTP/1.0\r\n\r\n", 400, "bad request line\n"),
      BAD("GET / HTTP/1.0 \r\n\r\n", 400, "unsupported HTTP version\n"),
      BAD("\r\nGET / HTTP/1.0\r\n\r\n", 400, "bad request line\n"),
      BAD("GET / HTTP/2.0\r\n\r\n", 400, "unsupported HTTP version\n"),
      BAD("GET / HTTP/1.2\r\n\r\n", 400, "unsupported HTTP version\n"),
      BAD("GET /\xc3\xa9 HTTP/1.0\r\n\r\n", 400, "bad request line\n"),
      BAD("GET / HTTP/1.1\r\n\r\n", 400, "HTTP/1.1 request without Host\n"),
      BAD("GET / HTTP/1.1\r\nHost: a\r\nHost: b\r\n\r\n", 400, "more than one Host header\n"),
      BAD("GET / HTTP/1.0\r\nHost : a\r\n\r\n", 400, "bad header line\n"),
      BAD("GET / HTTP/1.0\r\nno colon\r\n\r\n", 400, "bad header line\n"),
      BAD("GET / HTTP/1.0\r\n: empty name\r\n\r\n", 400, "bad header line\n"),
      BAD("GET / HTTP/1.0\r\nX: a\r\n folded\r\n\r\n", 400, "folded header line\n"),
      BAD("GET / HTTP/1.0\r\nX: a\rb\r\n\r\n", 400, "control byte in request\n"),
      BAD("GET / HTTP/1.0\r\nX: \x7f\r\n\r\n", 400, "control byte in request\n"),
      BAD("GET /\0 HTTP/1.0\r\n\r\n", 400, "control byte in request\n"),
      /* Refused before the head ends: the NUL is already there. */
      BAD("GET / HTTP/1.0\r\nHost: local\0", 400, "control byte in request\n"),
      /* The first fault in the byte stream wins: the method's 405 comes
       * before the NUL of a later line. */
      BAD("POST / HTTP/1.0\r\nX: \0\r\n\r\n", 405, "only GET and HEAD\n"),
      BAD("GET / HTTP/1.0\r\nX: \0\r\nHost: a\r\nHost: b\r\n\r\n", 400, "control byte in request\n"),
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    struct net_http_request r = parse(cases[i].req, cases[i].len);
    cr_assert_eq(r.status, cases[i].status, "case %zu: status %d, want %d", i, r.status, cases[i].status);
    cr_assert_str_eq(r.reason, cases[i].reason, "case %zu", i);
  }
}

/* A head that has not ended within NET_HTTP_HEAD_MAX bytes is 431, one
 * byte short of it is still read, and a head that ends exactly at the
 * limit is good; nothing past the limit is looked at. */
Test(net_http, a_head_longer_than_the_limit_is_431) {
  size_t cap = NET_HTTP_HEAD_MAX + 64;
  char *big = malloc(cap);
  cr_assert_not_null(big);
  memset(big, 'A', cap);
  struct net_http_request r = parse(big, NET_HTTP_HEAD_MAX - 1);
  cr_assert(r.status == 0 && !r.complete, "a short flood was answered %d", r.status);
  r = parse(big, NET_HTTP_HEAD_MAX);
  cr_assert_eq(r.status, 431);
  cr_assert_str_eq(r.reason, "request too large\n");

  static const char start[] = "GET / HTTP/1.0\r\nX-Pad: ";
  memcpy(big, start, sizeof start - 1);
  memcpy(big + NET_HTTP_HEAD_MAX - 4, "\r\n\r\n", 4);
  r = parse(big, cap);
  cr_assert(r.status == 0 && r.complete && r.head_len == NET_HTTP_HEAD_MAX, "status %d, head %zu", r.status,
            r.head_len);
  memcpy(big + NET_HTTP_HEAD_MAX - 4, "x\r\n\r", 4);
  big[NET_HTTP_HEAD_MAX] = '\n'; /* the blank line ends one byte past the limit */
  r = parse(big, cap);
  cr_assert_eq(r.status, 431);
  big[NET_HTTP_HEAD_MAX + 1] = '\0'; /* past the limit: never read */
  r = parse(big, cap);
  cr_assert_eq(r.status, 431);
  free(big);
}

Test(net_http, loopback_hosts_are_recognised_and_others_refused) {
  static const char *yes[] = {"localhost", "LocalHost:80", "127.0.0.1", "127.0.0.1:8080", "127.1", "[::1]",
                              "[::1]:9470"};
  static const char *no[] = {"",          "attacker.example", "attacker.example:80", "127.evil.com",
                             "127.",      "localhost.evil",   "localhost:",          "localhost:80x",
                             "[::1]x",    "[::1",             "[::2]:80",            "128.0.0.1",
                             "0.0.0.0",   "127.0.0.1:8080:1", "::1",                 "127.0.0.1 "};
  for (size_t i = 0; i < sizeof yes / sizeof yes[0]; i++)
    cr_assert(net_http_host_is_loopback(yes[i], strlen(yes[i])), "'%s' is loopback", yes[i]);
  for (size_t i = 0; i < sizeof no / sizeof no[0]; i++)
    cr_assert(!net_http_host_is_loopback(no[i], strlen(no[i])), "'%s' is not loopback", no[i]);
  /* A NUL inside is not a loopback name either. */
  cr_assert(!net_http_host_is_loopback(STR_LIT("local\0host")));
}
