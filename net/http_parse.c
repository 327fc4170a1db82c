/* The parser of HTTP/1.x request heads (net.h, "HTTP requests"): what the
 * metrics endpoint and `rumor top --web` read from untrusted clients. It
 * looks at each line once, in order, as soon as the line is whole, so that
 * the first fault in the byte stream decides the answer and a request is
 * refused as soon as its bytes show it is bad (RFC 9112, stricter where
 * that costs a real client nothing). */
#include <strings.h>

#include "net/net.h"

#define REASON_BYTE "control byte in request\n"
#define REASON_LINE "bad request line\n"
#define REASON_VERSION "unsupported HTTP version\n"
#define REASON_METHOD "only GET and HEAD\n"
#define REASON_FIELD "bad header line\n"
#define REASON_FOLD "folded header line\n"
#define REASON_HOSTS "more than one Host header\n"
#define REASON_NO_HOST "HTTP/1.1 request without Host\n"
#define REASON_TOO_LARGE "request too large\n"

#define HTTP_VERSION_PREFIX "HTTP/1."

/* Records the answer; returns false, for `return refuse(...)` in the line
 * parsers. */
static bool refuse(struct net_http_request *r, int status, const char *reason) {
  r->status = status;
  r->reason = reason;
  return false;
}

/* A token character (RFC 9110 tchar): methods and field names. */
static bool is_tchar(uint8_t c) {
  if ((c >= 'a' && c <= 'z') || (c >= 'A' && c <= 'Z') || (c >= '0' && c <= '9')) return true;
  return c != '\0' && strchr("!#$%&'*+-.^_`|~", c) != NULL;
}

/* Whether p[0..n) holds a byte no line of a head may hold: a control byte
 * other than HTAB (NUL and a CR not before LF among them), or DEL. */
static bool has_bad_byte(const uint8_t *p, size_t n) {
  for (size_t i = 0; i < n; i++)
    if ((p[i] < 0x20 && p[i] != '\t') || p[i] == 0x7f) return true;
  return false;
}

/* "METHOD SP TARGET SP HTTP/1.x", the line without its CRLF. Returns false
 * when it refused. */
static bool request_line(const uint8_t *p, size_t n, struct net_http_request *r) {
  size_t i = 0;
  while (i < n && is_tchar(p[i])) i++;
  size_t mlen = i;
  if (mlen == 0 || i == n || p[i] != ' ') return refuse(r, 400, REASON_LINE);
  size_t t0 = ++i;
  while (i < n && p[i] > ' ' && p[i] < 0x7f) i++; /* visible ASCII */
  if (i == t0 || i == n || p[i] != ' ') return refuse(r, 400, REASON_LINE);
  size_t tlen = i - t0;
  const uint8_t *v = p + i + 1;
  size_t vlen = n - i - 1;
  if (vlen != STR_LEN(HTTP_VERSION_PREFIX "0") || memcmp(v, STR_LIT(HTTP_VERSION_PREFIX)) != 0 ||
      (v[vlen - 1] != '0' && v[vlen - 1] != '1'))
    return refuse(r, 400, REASON_VERSION);
  r->minor_version = v[vlen - 1] - '0';
  if (STR_EQ_LIT(p, mlen, "GET")) r->method = NET_HTTP_GET;
  else if (STR_EQ_LIT(p, mlen, "HEAD")) r->method = NET_HTTP_HEAD;
  else return refuse(r, 405, REASON_METHOD);
  r->target = (const char *)p + t0;
  r->target_len = tlen;
  const char *q = memchr(r->target, '?', tlen);
  r->path = r->target;
  r->path_len = q ? (size_t)(q - r->target) : tlen;
  return true;
}

/* "NAME: VALUE", the line without its CRLF; only Host is kept. Returns
 * false when it refused. */
static bool field_line(const uint8_t *p, size_t n, struct net_http_request *r) {
  if (p[0] == ' ' || p[0] == '\t') return refuse(r, 400, REASON_FOLD); /* obsolete line folding */
  size_t i = 0;
  while (i < n && is_tchar(p[i])) i++;
  if (i == 0 || i == n || p[i] != ':') return refuse(r, 400, REASON_FIELD);
  if (!(i == STR_LEN("host") && strncasecmp((const char *)p, "host", i) == 0)) return true;
  if (r->host) return refuse(r, 400, REASON_HOSTS);
  size_t a = i + 1, b = n;
  while (a < b && (p[a] == ' ' || p[a] == '\t')) a++;
  while (b > a && (p[b - 1] == ' ' || p[b - 1] == '\t')) b--;
  r->host = (const char *)p + a;
  r->host_len = b - a;
  return true;
}

void net_http_parse(const void *buf, size_t len, struct net_http_request *r) {
  *r = (struct net_http_request){0};
  if (len == 0) return; /* (no bytes: buf may be NULL) */
  const uint8_t *p = buf;
  size_t limit = len < NET_HTTP_HEAD_MAX ? len : NET_HTTP_HEAD_MAX;
  for (size_t pos = 0, line = 0;; line++) {
    const uint8_t *nl = memchr(p + pos, '\n', limit - pos);
    if (!nl) { /* a line still coming: refuse what is already bad */
      size_t n = limit - pos;
      if (n && p[limit - 1] == '\r') n--; /* its LF may come next */
      if (has_bad_byte(p + pos, n)) refuse(r, 400, REASON_BYTE);
      else if (len >= NET_HTTP_HEAD_MAX) refuse(r, 431, REASON_TOO_LARGE);
      return;
    }
    size_t end = (size_t)(nl - p), n = end - pos;
    if (n && p[end - 1] == '\r') n--;
    if (has_bad_byte(p + pos, n)) {
      refuse(r, 400, REASON_BYTE);
      return;
    }
    if (line == 0) {
      if (!request_line(p + pos, n, r)) return;
    } else if (n == 0) { /* the blank line: the head's end */
      r->complete = true;
      r->head_len = end + 1;
      if (r->minor_version == 1 && !r->host) refuse(r, 400, REASON_NO_HOST);
      return;
    } else if (!field_line(p + pos, n, r)) {
      return;
    }
    pos = end + 1;
  }
}

bool net_http_host_is_loopback(const char *h, size_t len) {
  size_t host_len = len;
  if (len && h[0] == '[') {
    const char *close = memchr(h, ']', len);
    if (!close) return false;
    host_len = (size_t)(close - h) + 1;
  } else {
    const char *colon = memchr(h, ':', len);
    if (colon) host_len = (size_t)(colon - h);
  }
  /* What follows the host: nothing, or ":PORT" of digits. */
  if (host_len < len) {
    if (h[host_len] != ':' || host_len + 1 == len) return false;
    for (size_t i = host_len + 1; i < len; i++)
      if (h[i] < '0' || h[i] > '9') return false;
  }
  if (host_len == STR_LEN("localhost") && strncasecmp(h, "localhost", host_len) == 0) return true;
  if (STR_EQ_LIT(h, host_len, "[::1]")) return true;
  if (host_len <= STR_LEN("127.") || memcmp(h, STR_LIT("127.")) != 0) return false;
  for (size_t i = STR_LEN("127."); i < host_len; i++)
    if (!((h[i] >= '0' && h[i] <= '9') || h[i] == '.')) return false;
  return true;
}
