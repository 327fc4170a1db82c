/* Error codes and error records. */
#include "util.h"

#include <errno.h>
#include <stdio.h>
#include <string.h>

const char *rumor_strerror(int code) {
  switch (code) {
  case RUMOR_OK: return "success";
  case RUMOR_ECORRUPT: return "corrupt data";
  case RUMOR_EFORMAT: return "malformed input";
  case RUMOR_EAUTH: return "authentication failed";
  case RUMOR_EPROTO: return "protocol error";
  case RUMOR_ETOOBIG: return "size exceeds limit";
  case RUMOR_EDEVICE: return "device error";
  case RUMOR_ESHAPE: return "shape or dtype mismatch";
  case RUMOR_ECANCELED: return "operation canceled";
  case RUMOR_ETIMEDOUT: return "timed out";
  case RUMOR_ENOTFOUND: return "not found";
  case RUMOR_EDIVERGED: return "training diverged";
  default: break;
  }
  if (code < 0 && code > -4096) return strerror(-code);
  return "unknown error";
}

int rumor_err_set(struct rumor_err *e, int code, const char *fmt, ...) {
  if (e) {
    va_list ap;
    va_start(ap, fmt);
    e->code = code;
    vsnprintf(e->msg, sizeof e->msg, fmt, ap);
    va_end(ap);
  }
  return code;
}

int rumor_err_prefix(struct rumor_err *e, const char *fmt, ...) {
  if (!e) return 0;
  char prefix[256], old[sizeof e->msg];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(prefix, sizeof prefix, fmt, ap);
  va_end(ap);
  memcpy(old, e->msg, sizeof old);
  /* "prefix: old", the prefix cut so that the separator and a NUL fit. */
  const size_t sep = STR_LEN(": ");
  size_t n = strlen(prefix);
  if (n > sizeof e->msg - sep - 1) n = sizeof e->msg - sep - 1;
  memcpy(e->msg, prefix, n);
  memcpy(e->msg + n, STR_LIT(": "));
  size_t rest = sizeof e->msg - n - sep - 1;
  size_t olen = strnlen(old, rest);
  memcpy(e->msg + n + sep, old, olen);
  e->msg[n + sep + olen] = '\0';
  return e->code;
}
