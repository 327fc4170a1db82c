/*
 * Defences against members that hold valid keys but misbehave: strikes and
 * backoff, per-peer rate limits on exchange requests and connections, and
 * the checks on an exchange transfer that the loop can make before a single
 * value arrives (its length, a replayed round). The values themselves (NaN,
 * distance, clipping) are checked by the training thread (peer_sync).
 *
 * Loop thread only.
 */
#include <errno.h>
#include <stdio.h>
#include <string.h>

#include "gossip/gossip_impl.h"

#define GUARD_LOG_EVERY_MS 5000 /* at most one rate-limit line per member this often */

static void label(struct gossip *g, const uint8_t *id, char *buf, size_t n) {
  char k[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(k, id);
  struct swim_member *m = swim_find(&g->swim, id);
  snprintf(buf, n, "%s (%.8s)", m ? m->info.addr : "?", k);
}

void gossip_strike(struct gossip *g, const uint8_t *id, const char *why) {
  struct gossip_link *l = gossip_link_get(g, id, true);
  l->strikes++;
  uint64_t backoff = 1000ull << (l->strikes < 8 ? l->strikes : 8);
  l->backoff_until_ms = gossip_now_ms(g) + backoff;
  char who[200];
  label(g, id, who, sizeof who);
  log_warn("rejected parameters from %s: %s; no exchanges with it for %llu s", who, why,
           (unsigned long long)(backoff / 1000));
}

void gossip_forgive(struct gossip *g, const uint8_t *id) {
  struct gossip_link *l = gossip_link_get(g, id, false);
  if (l && l->strikes > 0) l->strikes--;
}

/* A token bucket: `rate` per second, up to 2·rate at once. */
static bool bucket_take(struct gossip_bucket *b, uint64_t now, double rate) {
  if (rate <= 0) return true;
  double burst = 2 * rate > 1 ? 2 * rate : 1;
  if (!b->init) {
    b->init = true;
    b->tokens = burst;
    b->last_ms = now;
  }
  b->tokens += (double)(now - b->last_ms) * rate / 1e3;
  if (b->tokens > burst) b->tokens = burst;
  b->last_ms = now;
  if (b->tokens < 1) return false;
  b->tokens -= 1;
  return true;
}

static void log_refusals(struct gossip *g, struct gossip_link *l, uint64_t now) {
  if (l->rl_logged_ms && now - l->rl_logged_ms < GUARD_LOG_EVERY_MS) return;
  char who[200];
  label(g, l->id, who, sizeof who);
  log_warn("rate limit: refused %llu exchange requests and %llu connections from %s (limits %g and %g a second)",
           (unsigned long long)l->rl_xch, (unsigned long long)l->rl_conn, who, g->cfg.max_xch_per_s,
           g->cfg.max_conn_per_s);
  l->rl_logged_ms = now;
  l->rl_xch = l->rl_conn = 0;
}

bool gossip_guard_allow_xch(struct gossip *g, const uint8_t *id) {
  uint64_t now = gossip_now_ms(g);
  struct gossip_link *l = gossip_link_get(g, id, true);
  if (bucket_take(&l->xch_bucket, now, g->cfg.max_xch_per_s)) return true;
  l->rl_xch++;
  pthread_mutex_lock(&g->lock);
  g->stats.exchange_rate_limited++;
  pthread_mutex_unlock(&g->lock);
  log_refusals(g, l, now);
  return false;
}

bool gossip_guard_allow_conn(struct gossip *g, const uint8_t *id) {
  uint64_t now = gossip_now_ms(g);
  struct gossip_link *l = gossip_link_get(g, id, true);
  if (bucket_take(&l->conn_bucket, now, g->cfg.max_conn_per_s)) return true;
  l->rl_conn++;
  pthread_mutex_lock(&g->lock);
  g->stats.conn_rate_limited++;
  pthread_mutex_unlock(&g->lock);
  log_refusals(g, l, now);
  return false;
}

int gossip_guard_xch_bulk(struct gossip *g, net_conn_t *c, const struct net_bulk_info *info, uint64_t xid,
                          uint64_t step) {
  struct gossip_xch *x = &g->xch;
  const uint8_t *from = net_conn_peer_key(c);
  /* Not the partner's transfer for this exchange: the exchange code refuses
   * it without blaming anyone (a late transfer of an abandoned exchange). */
  if (!x->active || xid != x->xid || memcmp(from, x->partner, NET_PUBKEY_BYTES) != 0) return 0;
  char why[160];
  if (info->count != g->cfg.nparams) {
    snprintf(why, sizeof why, "it sent %llu values for a model of %llu parameters", (unsigned long long)info->count,
             (unsigned long long)g->cfg.nparams);
    gossip_xch_refuse(g, why);
    return -ECONNREFUSED;
  }
  /* Snapshot steps of one member only grow while its incarnation stands (a
   * restart or a refutation raises it): an older step is a replay. */
  struct gossip_link *l = gossip_link_get(g, from, true);
  struct swim_member *m = swim_find(&g->swim, from);
  uint64_t inc = m ? m->info.incarnation : 0;
  if (l->have_step && l->step_inc == inc && step < l->last_step) {
    snprintf(why, sizeof why, "it replayed an old round (a snapshot of step %llu after one of step %llu)",
             (unsigned long long)step, (unsigned long long)l->last_step);
    gossip_xch_refuse(g, why);
    return -ECONNREFUSED;
  }
  l->have_step = true;
  l->step_inc = inc;
  l->last_step = step;
  return 0;
}
