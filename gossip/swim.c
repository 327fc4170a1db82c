/* SWIM membership: probing, suspicion, refutation and piggybacked gossip. */
#include "gossip/swim_impl.h"

#include <math.h>
#include <stdlib.h>
#include <stdio.h>
#include <string.h>

const char *swim_state_name(enum swim_state s) {
  switch (s) {
  case SWIM_ALIVE: return "alive";
  case SWIM_SUSPECT: return "suspect";
  case SWIM_DEAD: return "failed";
  case SWIM_LEFT: return "left";
  }
  return "?";
}

void swim_config_default(struct swim_config *c) {
  c->period_ms = 1000;
  c->ping_timeout_ms = 300;
  c->suspect_timeout_ms = 5000;
  c->indirect_k = 3;
  c->retention_ms = 600000;
  c->reconnect_ms = 5000;
}

static bool same_id(const uint8_t *a, const uint8_t *b) { return memcmp(a, b, SWIM_ID_BYTES) == 0; }

static int rank(enum swim_state s) { return (int)s; } /* ALIVE < SUSPECT < DEAD < LEFT */

/* True when `n` should replace what we know, `o`. */
static bool supersedes(const struct swim_update *n, const struct swim_update *o) {
  if (n->incarnation != o->incarnation) return n->incarnation > o->incarnation;
  return rank(n->state) > rank(o->state);
}

static bool is_live(enum swim_state s) { return s == SWIM_ALIVE || s == SWIM_SUSPECT; }

struct swim_member *swim_find(struct swim *s, const uint8_t *id) {
  for (size_t i = 0; i < s->nmembers; i++)
    if (same_id(s->members[i].info.id, id)) return &s->members[i];
  return NULL;
}

size_t swim_count_live(const struct swim *s, int role) {
  size_t n = 0;
  for (size_t i = 0; i < s->nmembers; i++)
    if (is_live(s->members[i].info.state) && (role < 0 || (int)s->members[i].info.role == role)) n++;
  return n;
}

/* How many times each update is piggybacked: λ·⌈log2(n + 1)⌉ with λ = 3,
 * enough for an update to reach every member with high probability. */
static uint32_t retransmit_limit(const struct swim *s) {
  uint32_t lg = 1;
  while ((1u << lg) < s->nmembers + 2) lg++;
  return 3 * lg;
}

static void enqueue(struct swim *s, const struct swim_update *u) {
  for (size_t i = 0; i < s->nqueue; i++)
    if (same_id(s->queue[i].u.id, u->id)) {
      s->queue[i].u = *u; /* the newer news about a member replaces the older */
      s->queue[i].sent = 0;
      return;
    }
  if (s->nqueue == s->qcap) {
    s->qcap = s->qcap ? 2 * s->qcap : 16;
    s->queue = xrealloc(s->queue, s->qcap * sizeof *s->queue);
  }
  s->queue[s->nqueue++] = (struct swim_queued){*u, 0};
}

size_t swim_take_updates(struct swim *s, struct swim_update *out, size_t max) {
  if (max > SWIM_MAX_PIGGYBACK) max = SWIM_MAX_PIGGYBACK;
  uint32_t limit = retransmit_limit(s);
  size_t n = 0;
  /* Pick the least-sent updates first: selection over a small queue. */
  while (n < max) {
    size_t best = SIZE_MAX;
    for (size_t i = 0; i < s->nqueue; i++) {
      bool used = false;
      for (size_t j = 0; j < n && !used; j++) used = same_id(out[j].id, s->queue[i].u.id);
      if (!used && (best == SIZE_MAX || s->queue[i].sent < s->queue[best].sent)) best = i;
    }
    if (best == SIZE_MAX) break;
    out[n++] = s->queue[best].u;
    s->queue[best].sent++;
  }
  /* Drop updates that have been sent enough. */
  size_t w = 0;
  for (size_t i = 0; i < s->nqueue; i++)
    if (s->queue[i].sent < limit) s->queue[w++] = s->queue[i];
  s->nqueue = w;
  return n;
}

void swim_init(struct swim *s, const struct swim_config *cfg, const struct swim_io *io, const struct swim_update *self,
               uint64_t seed, uint64_t now_ms) {
  memset(s, 0, sizeof *s);
  s->cfg = *cfg;
  s->io = *io;
  s->self = *self;
  s->self.state = SWIM_ALIVE;
  rng_seed(&s->rng, seed, 0x5357494dull /* "SWIM" */);
  s->next_seq = 1;
  s->period_started_ms = now_ms;
  s->last_reconnect_ms = now_ms;
  s->last_tick_ms = now_ms;
  enqueue(s, &s->self);
}

void swim_free(struct swim *s) {
  free(s->members);
  free(s->queue);
  free(s->rr);
  memset(s, 0, sizeof *s);
}

static void notify(struct swim *s, const struct swim_member *m, enum swim_state old, bool added) {
  if (s->io.on_change) s->io.on_change(s->io.ctx, m, old, added);
}

/* Tells every live member the news `u` at once, in a PING of its own
 * (sequence numbers no probe waits for: the ACKs only bring their news):
 * a suspicion or a refutation reaches everyone within a round trip rather
 * than after a few periods of piggybacking. One message per member, once
 * per such event. */
static void tell_all(struct swim *s, const struct swim_update *u) {
  for (size_t i = 0; i < s->nmembers; i++)
    if (is_live(s->members[i].info.state)) s->io.send_ping(s->io.ctx, &s->members[i], s->next_seq++, u, 1);
}

static void refute(struct swim *s, uint64_t their_incarnation) {
  if (s->self.state == SWIM_LEFT) return; /* we are leaving: let it stand */
  if (their_incarnation >= s->self.incarnation) s->self.incarnation = their_incarnation + 1;
  else s->self.incarnation++;
  s->refutations++;
  enqueue(s, &s->self);
  tell_all(s, &s->self);
}

void swim_announce(struct swim *s) {
  if (s->self.state == SWIM_LEFT) return;
  s->self.incarnation++;
  enqueue(s, &s->self);
  tell_all(s, &s->self);
}

void swim_tell_self(struct swim *s, const uint8_t *id) {
  struct swim_member *m = swim_find(s, id);
  if (m && is_live(m->info.state) && s->self.state != SWIM_LEFT)
    s->io.send_ping(s->io.ctx, m, s->next_seq++, &s->self, 1);
}

bool swim_apply(struct swim *s, const struct swim_update *u, uint64_t now_ms) {
  if (same_id(u->id, s->self.id)) {
    /* Someone thinks we are suspect, dead or gone: we are not. */
    if (u->state != SWIM_ALIVE && u->incarnation >= s->self.incarnation) refute(s, u->incarnation);
    /* Old news about us still travels: our refutation never reached
     * everyone (it went out on a connection that was closing when we were
     * paused, say, and used up its retransmissions). Spread it again, or a
     * member that holds us failed would never take us back. */
    else if (u->state != SWIM_ALIVE && s->self.state != SWIM_LEFT) enqueue(s, &s->self);
    return false;
  }
  struct swim_member *m = swim_find(s, u->id);
  if (!m) {
    if (s->nmembers >= SWIM_MAX_MEMBERS) return false; /* table full: ignore newcomers */
    if (s->nmembers == s->cap) {
      s->cap = s->cap ? 2 * s->cap : 16;
      s->members = xrealloc(s->members, s->cap * sizeof *s->members);
    }
    m = &s->members[s->nmembers++];
    memset(m, 0, sizeof *m);
    m->info = *u;
    m->since_ms = now_ms;
    m->last_heard_ms = now_ms;
    enqueue(s, u);
    notify(s, m, SWIM_ALIVE, true);
    return true;
  }
  /* A quiet verdict of ours (swim_member.quiet) yields to the others' word
   * that the member is alive at the incarnation we judged. */
  bool unquiet = m->quiet && u->state == SWIM_ALIVE && u->incarnation >= m->info.incarnation;
  if (!supersedes(u, &m->info) && !unquiet) return false;
  m->quiet = false;
  enum swim_state old = m->info.state;
  bool was_ready = m->info.ready;
  char addr[SWIM_ADDR_MAX];
  memcpy(addr, m->info.addr, sizeof addr);
  m->info = *u;
  if (!m->info.addr[0]) memcpy(m->info.addr, addr, sizeof addr); /* keep a known address */
  if (old != u->state) m->since_ms = now_ms;
  enqueue(s, &m->info);
  if (old != u->state || was_ready != m->info.ready || strcmp(addr, m->info.addr) != 0) notify(s, m, old, false);
  return true;
}

static void apply_all(struct swim *s, const struct swim_update *u, size_t n, uint64_t now_ms) {
  for (size_t i = 0; i < n; i++) swim_apply(s, &u[i], now_ms);
}

/* A message arrived from `from`. If we hold it suspect or failed, put that
 * news back at the head of the queue: our reply carries it, and a member that
 * was merely slow (paused, partitioned) learns of it and refutes. */
static void heard(struct swim *s, const uint8_t *from, uint64_t now_ms) {
  struct swim_member *m = swim_find(s, from);
  if (!m) return;
  m->last_heard_ms = now_ms;
  if (m->quiet) { /* our verdict alone, told to no one: it was wrong */
    enum swim_state old = m->info.state;
    m->quiet = false;
    m->info.state = SWIM_ALIVE;
    m->since_ms = now_ms;
    notify(s, m, old, false);
    return;
  }
  if (m->info.state == SWIM_SUSPECT || m->info.state == SWIM_DEAD) enqueue(s, &m->info);
}

void swim_set_ready(struct swim *s, bool ready, bool at_once) {
  if (s->self.ready == ready || s->self.state == SWIM_LEFT) return;
  s->self.ready = ready;
  s->self.incarnation++;
  enqueue(s, &s->self);
  if (at_once) tell_all(s, &s->self);
}

void swim_set_addr(struct swim *s, const char *addr) {
  if (s->self.state == SWIM_LEFT || strcmp(s->self.addr, addr) == 0) return;
  snprintf(s->self.addr, sizeof s->self.addr, "%s", addr);
  s->self.incarnation++;
  enqueue(s, &s->self);
}

void swim_leave(struct swim *s, uint64_t now_ms) {
  s->self.state = SWIM_LEFT;
  s->self.incarnation++;
  enqueue(s, &s->self);
}

size_t swim_snapshot(const struct swim *s, struct swim_update *out, size_t max) {
  size_t n = 0;
  if (n < max) out[n++] = s->self;
  for (size_t i = 0; i < s->nmembers && n < max; i++) out[n++] = s->members[i].info;
  return n;
}

/* ---- probing ---- */

static void rebuild_round_robin(struct swim *s) {
  free(s->rr);
  s->rr = xmalloc((s->nmembers ? s->nmembers : 1) * sizeof *s->rr);
  s->rr_len = 0;
  for (size_t i = 0; i < s->nmembers; i++)
    if (is_live(s->members[i].info.state)) memcpy(s->rr[s->rr_len++], s->members[i].info.id, SWIM_ID_BYTES);
  for (size_t i = s->rr_len; i > 1; i--) { /* Fisher-Yates */
    size_t j = (size_t)rng_below(&s->rng, i);
    uint8_t t[SWIM_ID_BYTES];
    memcpy(t, s->rr[i - 1], SWIM_ID_BYTES);
    memcpy(s->rr[i - 1], s->rr[j], SWIM_ID_BYTES);
    memcpy(s->rr[j], t, SWIM_ID_BYTES);
  }
  s->rr_pos = 0;
}

/* The next live member in round-robin order, or NULL when there is none. */
static struct swim_member *next_target(struct swim *s) {
  for (int pass = 0; pass < 2; pass++) {
    while (s->rr_pos < s->rr_len) {
      struct swim_member *m = swim_find(s, s->rr[s->rr_pos++]);
      if (m && is_live(m->info.state)) return m;
    }
    rebuild_round_robin(s);
  }
  return NULL;
}

static void start_probe(struct swim *s, uint64_t now_ms) {
  s->period_started_ms = now_ms;
  struct swim_member *t = next_target(s);
  if (!t) {
    s->probing = false;
    return;
  }
  memcpy(s->probe_id, t->info.id, SWIM_ID_BYTES);
  s->probing = true;
  s->probe_acked = false;
  s->probe_indirect_sent = false;
  s->probe_seq = s->next_seq++;
  s->probe_started_ms = now_ms;
  s->probes++;
  struct swim_update u[SWIM_MAX_PIGGYBACK];
  size_t n = swim_take_updates(s, u, SWIM_MAX_PIGGYBACK);
  s->io.send_ping(s->io.ctx, t, s->probe_seq, u, n);
}

static void send_indirect(struct swim *s, struct swim_member *target) {
  /* Up to k distinct random live members other than the target. */
  size_t cand[SWIM_MAX_MEMBERS > 256 ? 256 : SWIM_MAX_MEMBERS];
  size_t nc = 0;
  for (size_t i = 0; i < s->nmembers && nc < sizeof cand / sizeof cand[0]; i++) {
    struct swim_member *m = &s->members[i];
    if (m->info.state == SWIM_ALIVE && !same_id(m->info.id, target->info.id)) cand[nc++] = i;
  }
  for (uint32_t k = 0; k < s->cfg.indirect_k && nc > 0; k++) {
    size_t pick = (size_t)rng_below(&s->rng, nc);
    struct swim_member *via = &s->members[cand[pick]];
    cand[pick] = cand[--nc];
    struct swim_update u[SWIM_MAX_PIGGYBACK];
    size_t n = swim_take_updates(s, u, SWIM_MAX_PIGGYBACK);
    s->io.send_ping_req(s->io.ctx, via, target, s->probe_seq, u, n);
  }
}

/* ---- minority ----
 * A member cut off from the others (a partition, a NAT's mapping lost)
 * loses every connection at once and suspects everyone, then declares
 * everyone failed after suspect_timeout; when the cut healed, it spread
 * that news (its replies, its reconnect probes) and the cluster's members
 * took each other for failed, refuted, and took each other back, the ring
 * re-forming at each step (bench-chaos: 2-4 s of no training after each
 * 10 s cut, once a ring of four out of eight). Seeing no majority alive,
 * we are the likelier one cut off: our verdicts stay here (quiet), the
 * suspicion held SWIM_QUIET_HOLD times longer before it turns to a quiet
 * DEAD, and the first word from the member (heard) or of it from others
 * (swim_apply) ends it. The majority's verdicts on us are what the cluster
 * acts on, and our refutation what brings us back. A real loss of most of
 * the cluster at once is judged by the survivors as slowly (their
 * suspicions held, the ring going on without the suspects meanwhile). */

/* True when we see no majority of the cluster alive: ourselves and the
 * members we hold ALIVE are at most half of ourselves and the members we
 * hold ALIVE or SUSPECT, or DEAD by a quiet verdict of ours. */
static bool in_minority(const struct swim *s) {
  size_t known = 1, alive = 1; /* ourselves */
  for (size_t i = 0; i < s->nmembers; i++) {
    const struct swim_member *m = &s->members[i];
    if (m->info.state == SWIM_ALIVE) alive++, known++;
    else if (m->info.state == SWIM_SUSPECT || (m->info.state == SWIM_DEAD && m->quiet)) known++;
  }
  return 2 * alive <= known;
}

size_t swim_count_quiet(const struct swim *s) {
  size_t n = 0;
  for (size_t i = 0; i < s->nmembers; i++) n += s->members[i].quiet;
  return n;
}

/* Every suspicion we hold becomes quiet, its news taken out of the queue. */
static void quiet_all(struct swim *s) {
  for (size_t i = 0; i < s->nmembers; i++) {
    struct swim_member *m = &s->members[i];
    if (m->info.state != SWIM_SUSPECT || m->quiet) continue;
    m->quiet = true;
    s->quieted++;
    for (size_t q = 0; q < s->nqueue; q++)
      if (same_id(s->queue[q].u.id, m->info.id)) {
        s->queue[q] = s->queue[--s->nqueue];
        break;
      }
  }
}

bool swim_suspect(struct swim *s, const uint8_t *id, uint64_t now_ms) {
  struct swim_member *m = swim_find(s, id);
  if (!m || m->info.state != SWIM_ALIVE) return false;
  struct swim_update u = m->info;
  u.state = SWIM_SUSPECT;
  s->suspicions++;
  swim_apply(s, &u, now_ms);
  if (in_minority(s)) quiet_all(s);
  else tell_all(s, &u);
  return true;
}

static void end_period(struct swim *s, uint64_t now_ms) {
  if (!s->probing) return;
  s->probing = false;
  if (s->probe_acked) return;
  s->probes_failed++;
  (void)swim_suspect(s, s->probe_id, now_ms);
}

static uint64_t later_by(uint64_t t, uint64_t gap, uint64_t now_ms) { return t + gap < now_ms ? t + gap : now_ms; }

/* The owner did not tick for `gap` ms until now: we could not hear anyone
 * meanwhile (their answers wait in our sockets), so the probe in flight
 * and the suspicions we hold get that time back. */
static void forgive_stall(struct swim *s, uint64_t gap, uint64_t now_ms) {
  s->stalls++;
  s->period_started_ms = later_by(s->period_started_ms, gap, now_ms);
  s->probe_started_ms = later_by(s->probe_started_ms, gap, now_ms);
  for (size_t i = 0; i < s->nmembers; i++)
    if (s->members[i].info.state == SWIM_SUSPECT) s->members[i].since_ms = later_by(s->members[i].since_ms, gap, now_ms);
}

/* Pings one random DEAD member (LEFT members said goodbye: never). The
 * ping carries the news that we hold it failed, first in line, so a member
 * that was only cut off refutes at once; its ACK brings it back ALIVE here,
 * and gossip spreads that to our side. A member that is really gone costs one
 * lost message every reconnect_ms. */
static void reconnect_probe(struct swim *s, uint64_t now_ms) {
  size_t ndead = 0;
  for (size_t i = 0; i < s->nmembers; i++) ndead += s->members[i].info.state == SWIM_DEAD;
  if (ndead == 0) return;
  size_t pick = (size_t)rng_below(&s->rng, ndead);
  for (size_t i = 0; i < s->nmembers; i++) {
    struct swim_member *m = &s->members[i];
    if (m->info.state != SWIM_DEAD || pick-- > 0) continue;
    if (!m->quiet) enqueue(s, &m->info); /* a quiet verdict is ours alone: its ACK (heard) ends it */
    struct swim_update u[SWIM_MAX_PIGGYBACK];
    size_t n = swim_take_updates(s, u, SWIM_MAX_PIGGYBACK);
    s->reconnects++;
    s->io.send_ping(s->io.ctx, m, s->next_seq++, u, n);
    return;
  }
}

void swim_tick(struct swim *s, uint64_t now_ms) {
  if (now_ms > s->last_tick_ms + s->cfg.ping_timeout_ms) forgive_stall(s, now_ms - s->last_tick_ms, now_ms);
  s->last_tick_ms = now_ms;
  /* Suspicion timeouts and tombstone expiry. */
  for (size_t i = 0; i < s->nmembers;) {
    struct swim_member *m = &s->members[i];
    uint64_t hold = (uint64_t)s->cfg.suspect_timeout_ms * (m->quiet ? SWIM_QUIET_HOLD : 1);
    if (m->info.state == SWIM_SUSPECT && now_ms - m->since_ms >= hold) {
      if (m->quiet) { /* failed here only: still told to no one */
        m->info.state = SWIM_DEAD;
        m->since_ms = now_ms;
        notify(s, m, SWIM_SUSPECT, false);
      } else {
        struct swim_update u = m->info;
        u.state = SWIM_DEAD;
        swim_apply(s, &u, now_ms);
      }
    }
    if ((m->info.state == SWIM_DEAD || m->info.state == SWIM_LEFT) && now_ms - m->since_ms >= s->cfg.retention_ms) {
      s->members[i] = s->members[--s->nmembers];
      continue;
    }
    i++;
  }
  /* Expired relays. */
  for (size_t i = 0; i < s->nrelays;)
    if (now_ms >= s->relays[i].expires_ms) s->relays[i] = s->relays[--s->nrelays];
    else i++;

  if (s->self.state == SWIM_LEFT) return; /* a leaving member probes no one */
  if (s->probing && !s->probe_acked && !s->probe_indirect_sent &&
      now_ms - s->probe_started_ms >= s->cfg.ping_timeout_ms) {
    s->probe_indirect_sent = true;
    struct swim_member *t = swim_find(s, s->probe_id);
    if (t) send_indirect(s, t);
  }
  if (s->cfg.reconnect_ms && now_ms - s->last_reconnect_ms >= s->cfg.reconnect_ms) {
    s->last_reconnect_ms = now_ms;
    reconnect_probe(s, now_ms);
  }
  if (now_ms - s->period_started_ms >= s->cfg.period_ms) {
    end_period(s, now_ms);
    start_probe(s, now_ms);
  } else if (!s->probing && s->nmembers > 0 && s->probes == 0) {
    start_probe(s, now_ms); /* the first probe need not wait a whole period */
  }
}

void swim_on_ping(struct swim *s, const uint8_t *from, uint64_t seq, const struct swim_update *u, size_t n,
                  uint64_t now_ms) {
  apply_all(s, u, n, now_ms);
  heard(s, from, now_ms);
  struct swim_update out[SWIM_MAX_PIGGYBACK];
  size_t no = swim_take_updates(s, out, SWIM_MAX_PIGGYBACK);
  s->io.send_ack(s->io.ctx, from, seq, out, no);
}

void swim_on_ack(struct swim *s, const uint8_t *from, uint64_t seq, const struct swim_update *u, size_t n,
                 uint64_t now_ms) {
  apply_all(s, u, n, now_ms);
  heard(s, from, now_ms);
  if (s->probing && seq == s->probe_seq) s->probe_acked = true;
  /* An ACK for a probe we ran on someone's behalf: pass it on. */
  for (size_t i = 0; i < s->nrelays; i++)
    if (s->relays[i].our_seq == seq) {
      struct swim_update out[SWIM_MAX_PIGGYBACK];
      size_t no = swim_take_updates(s, out, SWIM_MAX_PIGGYBACK);
      s->io.send_ack(s->io.ctx, s->relays[i].requester, s->relays[i].their_seq, out, no);
      s->relays[i] = s->relays[--s->nrelays];
      break;
    }
}

void swim_on_ping_req(struct swim *s, const uint8_t *from, const uint8_t *target, uint64_t seq,
                      const struct swim_update *u, size_t n, uint64_t now_ms) {
  apply_all(s, u, n, now_ms);
  heard(s, from, now_ms);
  struct swim_member *t = swim_find(s, target);
  if (!t || !is_live(t->info.state) || s->nrelays == sizeof s->relays / sizeof s->relays[0]) return;
  struct swim_relay *r = &s->relays[s->nrelays++];
  r->our_seq = s->next_seq++;
  r->their_seq = seq;
  r->expires_ms = now_ms + s->cfg.period_ms;
  memcpy(r->requester, from, SWIM_ID_BYTES);
  struct swim_update out[SWIM_MAX_PIGGYBACK];
  size_t no = swim_take_updates(s, out, SWIM_MAX_PIGGYBACK);
  s->io.send_ping(s->io.ctx, t, r->our_seq, out, no);
}
