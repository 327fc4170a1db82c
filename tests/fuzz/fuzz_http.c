/*
 * Fuzz harness: the HTTP request-head parser (net.h, net_http_parse) that
 * reads what clients of the metrics endpoint and `rumor top --web` send.
 * Any input must give one of the three answers with its promises kept:
 * every pointer inside the head, a status only with its reason, a good head
 * judged the same without what follows it, and the same answer for a
 * prefix as for the whole (a prefix of a good head asks for more; a refusal
 * of a prefix is the whole input's refusal). Nothing may read past the
 * input or NET_HTTP_HEAD_MAX.
 */
#include <string.h>

#include "net/net.h"
#include "tests/fuzz/fuzz.h"

#define CHECK(cond) \
  do {              \
    if (!(cond)) __builtin_trap(); \
  } while (0)

static volatile int g_sink;

static bool inside(const char *p, size_t n, const uint8_t *data, size_t len) {
  return (const uint8_t *)p >= data && n <= len && (const uint8_t *)p + n <= data + len;
}

/* Reasons are literals: compared by text (equal literals need not share
 * storage). */
static bool same_reason(const char *a, const char *b) { return a == b || (a && b && strcmp(a, b) == 0); }

static bool same(const struct net_http_request *a, const struct net_http_request *b) {
  return a->status == b->status && same_reason(a->reason, b->reason) && a->complete == b->complete &&
         a->head_len == b->head_len && a->method == b->method && a->minor_version == b->minor_version &&
         a->target == b->target && a->target_len == b->target_len && a->path == b->path &&
         a->path_len == b->path_len && a->host == b->host && a->host_len == b->host_len;
}

static void check_promises(const struct net_http_request *r, const uint8_t *data, size_t size) {
  CHECK(r->status == 0 || r->status == 400 || r->status == 405 || r->status == 431);
  CHECK((r->status != 0) == (r->reason != NULL));
  if (r->reason) CHECK(r->reason[0] && r->reason[strlen(r->reason) - 1] == '\n');
  if (r->status == 431) CHECK(size >= NET_HTTP_HEAD_MAX && !r->complete);
  if (!r->status && !r->complete) CHECK(size < NET_HTTP_HEAD_MAX);
  if (!r->complete) return;
  CHECK(r->head_len >= 2 && r->head_len <= size && r->head_len <= NET_HTTP_HEAD_MAX);
  CHECK(data[r->head_len - 1] == '\n');
  if (r->status) return;
  CHECK(r->method == NET_HTTP_GET || r->method == NET_HTTP_HEAD);
  CHECK(r->minor_version == 0 || r->minor_version == 1);
  CHECK(r->target_len > 0 && inside(r->target, r->target_len, data, r->head_len));
  CHECK(r->path == r->target && r->path_len <= r->target_len && !memchr(r->path, '?', r->path_len));
  for (size_t i = 0; i < r->target_len; i++) CHECK(r->target[i] > ' ' && r->target[i] < 0x7f);
  if (r->host) {
    CHECK(inside(r->host, r->host_len, data, r->head_len));
    for (size_t i = 0; i < r->host_len; i++) CHECK(r->host[i] != '\r' && r->host[i] != '\n' && r->host[i] != '\0');
    g_sink += net_http_host_is_loopback(r->host, r->host_len);
  }
  if (r->minor_version == 1) CHECK(r->host != NULL);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  struct net_http_request r, again;
  net_http_parse(data, size, &r);
  check_promises(&r, data, size);
  net_http_parse(data, size, &again);
  CHECK(same(&r, &again));

  /* What follows a complete head changes nothing. */
  if (r.complete) {
    net_http_parse(data, r.head_len, &again);
    CHECK(same(&r, &again));
  }
  /* A few prefixes: stable answers as bytes arrive. */
  size_t cuts[] = {size / 2, size ? size - 1 : 0, r.complete ? r.head_len - 1 : 0, 1};
  for (size_t k = 0; k < sizeof cuts / sizeof cuts[0]; k++) {
    if (cuts[k] >= size) continue;
    struct net_http_request p;
    net_http_parse(data, cuts[k], &p);
    check_promises(&p, data, cuts[k]);
    if (p.status) CHECK(p.status == r.status && same_reason(p.reason, r.reason));
    if (r.complete && cuts[k] < r.head_len) CHECK(!p.complete && (p.status == 0 || p.status == r.status));
    if (!r.status && r.complete && cuts[k] < r.head_len) CHECK(p.status == 0);
  }
  /* The host check takes any bytes. */
  g_sink += net_http_host_is_loopback((const char *)data, size < 300 ? size : 300);
  return 0;
}
