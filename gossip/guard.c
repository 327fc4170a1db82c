/*
 * Defences against members that hold valid keys but misbehave: strikes and
 * backoff, per-member rate limits on exchange requests and connections, and
 * the verdict on an exchange transfer that the loop can give before a single
 * value arrives (its length, a replayed round). The values themselves (NaN,
 * distance, clipping) are checked by the training thread (peer/sync).
 *
 * The guard owns what it knows of each member (struct gossip_guard); it
 * gives verdicts and the caller acts on them. Loop thread only.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

#define GUARD_LOG_EVERY_MS 5000 /* at most one rate-limit line per member this often */

void gossip_guard_free(struct gossip *g) {
  free(g->guard.v);
  memset(&g->guard, 0, sizeof g->guard);
}

static struct gossip_guard_entry *entry(struct gossip *g, const uint8_t *id, bool create) {
  struct gossip_guard *gu = &g->guard;
  for (size_t i = 0; i < gu->n; i++)
    if (memcmp(gu->v[i].id, id, NET_PUBKEY_BYTES) == 0) return &gu->v[i];
  if (!create) return NULL;
  if (gu->n == gu->cap) {
    gu->cap = gu->cap ? 2 * gu->cap : 16;
    gu->v = xrealloc(gu->v, gu->cap * sizeof *gu->v);
  }
  struct gossip_guard_entry *en = &gu->v[gu->n++];
  memset(en, 0, sizeof *en);
  memcpy(en->id, id, NET_PUBKEY_BYTES);
  return en;
}

/* ---- strikes and backoff ---- */

void gossip_strike(struct gossip *g, const uint8_t *id, const char *why, uint64_t now) {
  struct gossip_guard_entry *en = entry(g, id, true);
  en->strikes++;
  uint64_t backoff = 1000ull << (en->strikes < 8 ? en->strikes : 8);
  en->backoff_until_ms = now + backoff;
  char who[200];
  gossip_member_label(g, id, who, sizeof who);
  log_warn("rejected parameters from %s: %s; no exchanges with it for %llu s", who, why,
           (unsigned long long)(backoff / 1000));
}

void gossip_forgive(struct gossip *g, const uint8_t *id) {
  struct gossip_guard_entry *en = entry(g, id, false);
  if (en && en->strikes > 0) en->strikes--;
}

uint32_t gossip_strikes(struct gossip *g, const uint8_t *id) {
  struct gossip_guard_entry *en = entry(g, id, false);
  return en ? en->strikes : 0;
}

bool gossip_backed_off(struct gossip *g, const uint8_t *id, uint64_t now) {
  struct gossip_guard_entry *en = entry(g, id, false);
  return en && en->backoff_until_ms > now;
}

void gossip_back_off(struct gossip *g, const uint8_t *id, uint64_t until_ms) {
  struct gossip_guard_entry *en = entry(g, id, true);
  if (until_ms > en->backoff_until_ms) en->backoff_until_ms = until_ms;
}

void gossip_guard_on_return(struct gossip *g, const uint8_t *id) {
  struct gossip_guard_entry *en = entry(g, id, false);
  if (en) en->backoff_until_ms = 0, en->finished = false;
}

/* ---- finished members (rumor peer --finish-wait-ms) ---- */

bool gossip_guard_note_finished(struct gossip *g, const uint8_t *id, bool finished) {
  struct gossip_guard_entry *en = entry(g, id, finished);
  if (!en || en->finished == finished) return false;
  en->finished = finished;
  char label[200];
  gossip_member_label(g, id, label, sizeof label);
  log_debug("member %s %s", label, finished ? "finished training" : "trains");
  return true;
}

bool gossip_guard_finished(struct gossip *g, const uint8_t *id) {
  struct gossip_guard_entry *en = entry(g, id, false);
  return en && en->finished;
}

/* ---- rate limits ---- */

bool gossip_bucket_take(struct gossip_bucket *b, uint64_t now, double rate) {
  if (rate <= 0) return true;
  double burst = 2 * rate > 1 ? 2 * rate : 1;
  if (!b->init) {
    b->init = true;
    b->tokens = burst;
    b->last_ms = now;
  }
  if (now > b->last_ms) b->tokens += (double)(now - b->last_ms) * rate / 1e3;
  if (b->tokens > burst) b->tokens = burst;
  b->last_ms = now > b->last_ms ? now : b->last_ms;
  if (b->tokens < 1) return false;
  b->tokens -= 1;
  return true;
}

static void log_refusals(struct gossip *g, struct gossip_guard_entry *en, uint64_t now) {
  if (en->rl_logged_ms && now - en->rl_logged_ms < GUARD_LOG_EVERY_MS) return;
  char who[200];
  gossip_member_label(g, en->id, who, sizeof who);
  log_warn("rate limit: refused %llu exchange requests and %llu connections from %s (limits %g and %g a second)",
           (unsigned long long)en->rl_xch, (unsigned long long)en->rl_conn, who, g->cfg.max_xch_per_s,
           g->cfg.max_conn_per_s);
  en->rl_logged_ms = now;
  en->rl_xch = en->rl_conn = 0;
}

bool gossip_guard_allow_xch(struct gossip *g, const uint8_t *id, uint64_t now) {
  struct gossip_guard_entry *en = entry(g, id, true);
  if (gossip_bucket_take(&en->xch_bucket, now, g->cfg.max_xch_per_s)) return true;
  en->rl_xch++;
  gossip_count(g, GOSSIP_EV_XCH_RATE_LIMITED, NULL);
  log_refusals(g, en, now);
  return false;
}

bool gossip_guard_allow_conn(struct gossip *g, const uint8_t *id, uint64_t now) {
  struct gossip_guard_entry *en = entry(g, id, true);
  if (gossip_bucket_take(&en->conn_bucket, now, g->cfg.max_conn_per_s)) return true;
  en->rl_conn++;
  gossip_count(g, GOSSIP_EV_CONN_RATE_LIMITED, NULL);
  log_refusals(g, en, now);
  return false;
}

/* ---- exchange transfers ---- */

bool gossip_guard_check_transfer(struct gossip *g, const uint8_t *id, uint64_t count, uint64_t step, char *why,
                                 size_t n) {
  if (count != g->cfg.nparams) {
    snprintf(why, n, "it sent %llu values for a model of %llu parameters", (unsigned long long)count,
             (unsigned long long)g->cfg.nparams);
    return false;
  }
  /* Snapshot steps of one member only grow while its incarnation stands (a
   * restart or a refutation raises it): an older step is a replay. */
  struct gossip_guard_entry *en = entry(g, id, true);
  struct swim_member *m = swim_find(&g->swim, id);
  uint64_t inc = m ? m->info.incarnation : 0;
  if (en->have_step && en->step_inc == inc && step < en->last_step) {
    snprintf(why, n, "it replayed an old round (a snapshot of step %llu after one of step %llu)",
             (unsigned long long)step, (unsigned long long)en->last_step);
    return false;
  }
  en->have_step = true;
  en->step_inc = inc;
  en->last_step = step;
  return true;
}
