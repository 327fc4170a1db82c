/*
 * swim_impl.h — the SWIM membership protocol as a state machine, free of any
 * transport or clock: the owner feeds it received messages and the current
 * time, and it asks for messages to be sent through callbacks. The gossip
 * runtime (runtime.c) binds it to net/ and libuv; tests bind it to a
 * simulated network with a virtual clock.
 *
 * Protocol (Das, Gupta, Motivala 2002, with incarnation numbers):
 *  - every period, probe the next member of a shuffled round-robin order:
 *    PING; if no ACK within ping_timeout, ask `indirect_k` others to PING-REQ
 *    it; if still no ACK when the period ends, the member becomes SUSPECT;
 *  - a SUSPECT member that is not refuted within suspect_timeout is DEAD
 *    (failed); a member that announces LEFT is never suspected again;
 *  - a member hearing that it is suspected (or declared dead) refutes by
 *    raising its incarnation and gossiping ALIVE;
 *  - membership changes travel piggybacked on PING / ACK / PING-REQ, each
 *    update retransmitted about 3·log2(n+1) times;
 *  - every reconnect_ms, one random DEAD member is pinged anyway, so that
 *    two sides of a healed partition, each holding the other failed, find
 *    each other again (plain SWIM never probes a dead member);
 *  - a suspicion (ours, or the transport's verdict: swim_suspect) and a
 *    refutation are also told at once to every live member, the suspect
 *    included, in a PING each: views agree within a round trip, which the
 *    all-reduce ring needs (its members must agree on who is in a round);
 *  - time during which the owner could not tick (our own stall: a stopped
 *    process, a blocked loop) is not held against anyone: the probe in
 *    flight and the suspicions' timers move on by it.
 *
 * Update precedence, for one member: a higher incarnation wins; at equal
 * incarnation LEFT > DEAD > SUSPECT > ALIVE.
 *
 * Threads: one thread (the loop thread) owns a swim instance.
 */
#ifndef RUMOR_GOSSIP_SWIM_IMPL_H
#define RUMOR_GOSSIP_SWIM_IMPL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

#define SWIM_ID_BYTES 32
#define SWIM_ADDR_MAX 128
#define SWIM_MAX_MEMBERS 4096
#define SWIM_MAX_PIGGYBACK 16

enum swim_state { SWIM_ALIVE = 0, SWIM_SUSPECT = 1, SWIM_DEAD = 2, SWIM_LEFT = 3 };
enum swim_role { SWIM_ROLE_PEER = 0, SWIM_ROLE_BOOTSTRAP = 1 };

const char *swim_state_name(enum swim_state s); /* "alive", "suspect", "failed", "left" */

/* One member's identity and what is known of it; also the unit of gossip. */
struct swim_update {
  uint8_t id[SWIM_ID_BYTES]; /* Ed25519 public key */
  char addr[SWIM_ADDR_MAX];  /* where it listens, "host:port" */
  enum swim_role role;
  enum swim_state state;
  uint64_t incarnation;
  bool ready; /* a peer holding a state (it can donate and exchange); set by
                 its owner with a new incarnation, so it spreads like any news */
  bool relay; /* it relays for members that cannot accept connections (--relay) */
};

struct swim_member {
  struct swim_update info;
  uint64_t since_ms;       /* when `info.state` was last set */
  uint64_t last_heard_ms;  /* last message from it (any kind) */
  /* Our own verdict (SUSPECT, then DEAD), made while we saw no majority of
   * the cluster alive ("Minority" in swim.c): held here, told to no one,
   * and dropped as soon as we hear from the member or the others say it is
   * alive. */
  bool quiet;
};

/* A quiet suspicion is declared failed (quietly) after this many
 * suspect_timeouts: a member cut off for longer than that ends by holding
 * the others failed, as before. */
#define SWIM_QUIET_HOLD 6

struct swim_config {
  uint32_t period_ms;          /* protocol period (one probe each) */
  uint32_t ping_timeout_ms;    /* direct ACK deadline within a period */
  uint32_t suspect_timeout_ms; /* SUSPECT → DEAD without refutation */
  uint32_t indirect_k;         /* members asked to probe on our behalf */
  uint32_t retention_ms;       /* how long DEAD / LEFT members are remembered */
  uint32_t reconnect_ms;       /* ping one random DEAD member this often (0: never); see swim_tick */
};
void swim_config_default(struct swim_config *c);

/* What the state machine asks its owner to do. Each send carries updates to
 * piggyback (n ≤ SWIM_MAX_PIGGYBACK); the owner may drop a send (e.g. no
 * connection), which the protocol then treats like a lost message. */
struct swim_io {
  void *ctx;
  void (*send_ping)(void *ctx, const struct swim_member *to, uint64_t seq, const struct swim_update *u, size_t n);
  void (*send_ack)(void *ctx, const uint8_t *to_id, uint64_t seq, const struct swim_update *u, size_t n);
  void (*send_ping_req)(void *ctx, const struct swim_member *via, const struct swim_member *target, uint64_t seq,
                        const struct swim_update *u, size_t n);
  /* A member was added or changed state (`old` is ALIVE for additions). */
  void (*on_change)(void *ctx, const struct swim_member *m, enum swim_state old, bool added);
};

struct swim_pending_req; /* an indirect probe we perform for someone */

struct swim {
  struct swim_config cfg;
  struct swim_io io;
  struct swim_update self;
  struct rng rng;

  struct swim_member *members; /* excluding self */
  size_t nmembers, cap;

  /* Probe in progress. */
  uint8_t probe_id[SWIM_ID_BYTES];
  bool probing, probe_acked, probe_indirect_sent;
  uint64_t probe_seq, probe_started_ms, period_started_ms;
  uint64_t last_reconnect_ms;
  uint64_t last_tick_ms; /* a longer gap than ping_timeout_ms to the next tick is our own stall */
  uint64_t next_seq;
  size_t rr_pos; /* position in the round-robin order */
  uint8_t (*rr)[SWIM_ID_BYTES];
  size_t rr_len;

  /* Indirect probes performed for others: our seq → (requester, their seq). */
  struct swim_relay {
    uint64_t our_seq, their_seq, expires_ms;
    uint8_t requester[SWIM_ID_BYTES];
  } relays[64];
  size_t nrelays;

  /* Updates waiting to be piggybacked, with how often each was sent. */
  struct swim_queued {
    struct swim_update u;
    uint32_t sent;
  } *queue;
  size_t nqueue, qcap;

  /* Counters for monitoring and tests. */
  uint64_t probes, probes_failed, suspicions, refutations, reconnects, stalls, quieted;
};

/* Starts with only `self` known (state ALIVE). `seed` drives probe order. */
void swim_init(struct swim *s, const struct swim_config *cfg, const struct swim_io *io, const struct swim_update *self,
               uint64_t seed, uint64_t now_ms);
void swim_free(struct swim *s);

/* Advances timers: starts probes, sends indirect requests, raises
 * suspicions, declares failures, forgets old tombstones. Call at least every
 * ping_timeout / 2 ms. */
void swim_tick(struct swim *s, uint64_t now_ms);

/* Incoming messages (from the member with id `from`). */
void swim_on_ping(struct swim *s, const uint8_t *from, uint64_t seq, const struct swim_update *u, size_t n,
                  uint64_t now_ms);
void swim_on_ack(struct swim *s, const uint8_t *from, uint64_t seq, const struct swim_update *u, size_t n,
                 uint64_t now_ms);
void swim_on_ping_req(struct swim *s, const uint8_t *from, const uint8_t *target, uint64_t seq,
                      const struct swim_update *u, size_t n, uint64_t now_ms);

/* Applies one update (from a message, a join reply, ...). Returns true when
 * it changed what we know. Updates about ourselves trigger refutation. */
bool swim_apply(struct swim *s, const struct swim_update *u, uint64_t now_ms);

/* Suspects member `id` now, on evidence from outside SWIM (the transport
 * judged our connection to it dead): ALIVE → SUSPECT at its incarnation,
 * told at once to every live member, the suspect included, so that one
 * that is only slow refutes; SWIM's own timer declares it failed after
 * suspect_timeout as for any suspicion. Returns false (nothing done) when
 * it is unknown or not ALIVE. When, with it suspect, we see no majority of
 * the cluster alive, we are the likelier one cut off: this suspicion and
 * every other we hold become quiet (swim_member.quiet), told to no one. */
bool swim_suspect(struct swim *s, const uint8_t *id, uint64_t now_ms);
/* How many members we hold by a quiet verdict. */
size_t swim_count_quiet(const struct swim *s);

/* We may have been suspected or declared failed without hearing it (our
 * owner saw its loop stall: a stopped process): raises our incarnation and
 * tells every live member at once that we are alive. */
void swim_announce(struct swim *s);
/* Tells member `id` (when we hold it live) at once what we say of
 * ourselves: after swim_announce, a member whose connection to us closed
 * under it (our stop outlived its heartbeat verdict) lost that news. */
void swim_tell_self(struct swim *s, const uint8_t *id);

/* Marks us ready or not (see swim_update.ready) with a new incarnation
 * (nothing when it is already so); `at_once`: told to every live member
 * now, not only as the news spreads (an all-reduce ring waits for a
 * member that sits out until it knows). */
void swim_set_ready(struct swim *s, bool ready, bool at_once);

/* Changes the address we advertise (a relay's "@HOST:PORT"), with a new
 * incarnation. */
void swim_set_addr(struct swim *s, const char *addr);

/* Marks us as leaving: our state becomes LEFT and is queued for gossip. */
void swim_leave(struct swim *s, uint64_t now_ms);

/* Fills up to `max` updates to piggyback on an outgoing message (the least
 * sent first) and counts them as sent. */
size_t swim_take_updates(struct swim *s, struct swim_update *out, size_t max);
/* All known members (self first) as updates, for a JOIN reply. Returns the
 * number written (at most `max`). */
size_t swim_snapshot(const struct swim *s, struct swim_update *out, size_t max);

struct swim_member *swim_find(struct swim *s, const uint8_t *id);
/* Number of members in state ALIVE or SUSPECT with `role` (excluding self). */
size_t swim_count_live(const struct swim *s, int role /* -1: any */);

#endif /* RUMOR_GOSSIP_SWIM_IMPL_H */
