/* The bootstrap node: membership only. */
#include "bootstrap/bootstrap.h"

#include <time.h>

int bootstrap_run(const struct gossip_config *cfg, const atomic_int *stop, uint32_t linger_ms,
                  void (*on_ready)(gossip_t *g, void *arg), void *arg, struct rumor_err *e) {
  struct gossip_config c = *cfg;
  c.role = GOSSIP_ROLE_BOOTSTRAP;
  c.model = "";
  c.nparams = 0;
  c.xch_mine = c.xch_theirs = c.donor_buf = NULL;
  gossip_t *g;
  int rc = gossip_start(&g, &c, e);
  if (rc) return rc;
  if (on_ready) on_ready(g, arg);
  const struct timespec tick = {0, 50 * 1000000};
  while (!*stop) nanosleep(&tick, NULL);
  log_info("stopping (signal %d)", (int)*stop);
  gossip_stop(g, linger_ms);
  return 0;
}
