/* What the parameter server and its workers share: ranges, the staleness
 * flag, the optimizer agreement text. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/ps/ps_impl.h"

int ps_range_parse(const char *s, int *range, int *ranges, struct rumor_err *e) {
  const char *slash = s ? strchr(s, '/') : NULL;
  int64_t i, n;
  char head[32];
  if (!slash || (size_t)(slash - s) >= sizeof head) goto bad;
  snprintf(head, sizeof head, "%.*s", (int)(slash - s), s);
  if (parse_i64(head, 0, PS_MAX_SERVERS - 1, &i) || parse_i64(slash + 1, 1, PS_MAX_SERVERS, &n) || i >= n) goto bad;
  *range = (int)i;
  *ranges = (int)n;
  return 0;
bad:
  return rumor_err_set(e, RUMOR_EFORMAT, "--range must be I/S with 0 <= I < S <= %d, not '%s'", PS_MAX_SERVERS,
                       s ? s : "");
}

int ps_staleness_parse(const char *s, int64_t *out, struct rumor_err *e) {
  if (s && strcmp(s, "none") == 0) {
    *out = PS_STALENESS_NONE;
    return 0;
  }
  if (s && parse_i64(s, 0, 1000000000, out) == 0) return 0;
  return rumor_err_set(e, RUMOR_EFORMAT, "--staleness must be a number of steps (0: BSP) or none (ASP), not '%s'",
                       s ? s : "");
}

void ps_range_bounds(int64_t P, int i, int n, int64_t *lo, int64_t *hi) {
  RUMOR_ASSERT(n >= 1 && 0 <= i && i < n && P >= 0);
  *lo = P * i / n;
  *hi = P * (i + 1) / n;
}

void ps_optim_text(const struct optim_config *o, char *buf, size_t n) {
  snprintf(buf, n, "%s lr=%.9g momentum=%.9g nesterov=%d wd=%.9g betas=%.9g,%.9g eps=%.9g schedule=%s warmup=%lld",
           optim_kind_name(o->kind), o->lr, o->momentum, (int)o->nesterov, o->weight_decay, o->beta1, o->beta2,
           o->eps, optim_schedule_name(o->schedule), (long long)o->warmup_steps);
}

int ps_servers_parse(const char *list, char (*addrs)[PS_ADDR_MAX], int *n, struct rumor_err *e) {
  size_t k;
  int rc = net_addr_list_split(list, &addrs[0][0], PS_ADDR_MAX, PS_MAX_SERVERS, &k, e);
  *n = rc ? 0 : (int)k;
  return rc ? rumor_err_prefix(e, "--servers") : 0;
}

int ps_msg_str(const struct net_msg *m, const char *key, char *out, size_t n) {
  const char *s;
  size_t len;
  if (net_msg_get_str(m, key, &s, &len) || len >= n || memchr(s, 0, len)) return RUMOR_EPROTO;
  memcpy(out, s, len);
  out[len] = 0;
  return 0;
}
