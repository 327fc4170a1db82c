/*
 * http.h — plain-socket HTTP/1.0 requests to 127.0.0.1 for integration
 * tests of rumor's HTTP endpoints (the metrics endpoint, `rumor top --web`):
 * one request per connection, the whole response read until the server
 * closes, every read bounded by a 5 s timeout.
 *
 * Header-only; include after criterion.h. Uses xmalloc from util/util.h.
 */
#ifndef RUMOR_TESTS_HTTP_H
#define RUMOR_TESTS_HTTP_H

#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include "util/util.h"

/* A connected socket to 127.0.0.1:port with 5 s send and receive timeouts. */
static inline int http_connect(int port) {
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  cr_assert_geq(fd, 0, "socket: %s", strerror(errno));
  struct timeval tv = {5, 0};
  setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof tv);
  setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof tv);
  struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  cr_assert_eq(connect(fd, (struct sockaddr *)&a, sizeof a), 0, "cannot connect to 127.0.0.1:%d: %s", port,
               strerror(errno));
  return fd;
}

/* Sends req[0..len) (any bytes) and returns everything the server answers
 * until it closes the connection (malloc'd, NUL-terminated). */
static inline char *http_raw(int port, const char *req, size_t len) {
  int fd = http_connect(port);
  for (size_t off = 0; off < len;) {
    ssize_t w = send(fd, req + off, len - off, MSG_NOSIGNAL);
    if (w <= 0) break; /* the server may answer and close before reading it all */
    off += (size_t)w;
  }
  size_t cap = 1 << 16, got = 0;
  char *buf = xmalloc(cap);
  for (;;) {
    if (got + 1 == cap) buf = xrealloc(buf, cap *= 2);
    ssize_t r = read(fd, buf + got, cap - got - 1);
    if (r <= 0) break;
    got += (size_t)r;
  }
  buf[got] = '\0';
  close(fd);
  return buf;
}

/* `METHOD path` as HTTP/1.0; the whole response (malloc'd). */
static inline char *http_request(int port, const char *method, const char *path) {
  char req[512];
  int n = snprintf(req, sizeof req, "%s %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", method, path);
  return http_raw(port, req, (size_t)n);
}

static inline char *http_get(int port, const char *path) { return http_request(port, "GET", path); }

/* The status code of a response ("HTTP/1.x NNN ..."), or -1. */
static inline int http_status(const char *resp) {
  int code;
  return sscanf(resp, "HTTP/1.%*d %d", &code) == 1 ? code : -1;
}

/* The value of `series` (a metric's name with its labels, as printed:
 * `rumor_exchanges_total{result="applied"}`) on the /metrics page served on
 * `port`, or NAN when the page does not have it. */
static inline double http_metric(int port, const char *series) {
  char *resp = http_get(port, "/metrics");
  char pat[256];
  snprintf(pat, sizeof pat, "\n%s ", series);
  const char *p = strstr(resp, pat);
  double v = p ? strtod(p + strlen(pat), NULL) : NAN;
  free(resp);
  return v;
}

/* The body of a response (after the blank line), or "" when there is none. */
static inline const char *http_body(const char *resp) {
  const char *p = strstr(resp, "\r\n\r\n");
  return p ? p + 4 : "";
}

#endif /* RUMOR_TESTS_HTTP_H */
