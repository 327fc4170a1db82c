/*
 * replay — spots a partner that sends the very same parameters twice: an old
 * round replayed (a live peer's parameters change with every step and every
 * average). The fingerprint is ‖θ‖² of what it sent, a deterministic
 * reduction that two different vectors practically never share. The gossip
 * layer rejects snapshots whose step goes backwards (gossip/guard.c); this
 * catches a replay repeated at the same step, from a partner we had not
 * heard from before it began.
 *
 * A repeat is skipped, not held against the sender: an honest peer that has
 * not moved since (all peers equal at the start, before the first step)
 * sends the same vector again, and averaging with a copy we already took
 * in loses little.
 *
 * Training thread.
 */
#ifndef RUMOR_PEER_REPLAY_H
#define RUMOR_PEER_REPLAY_H

#include <stdbool.h>
#include <stdint.h>

#define REPLAY_PARTNERS 64
#define REPLAY_ID_BYTES 32

struct replay_table {
  struct replay_entry {
    uint8_t id[REPLAY_ID_BYTES];
    double fingerprint;
    uint64_t seen;
  } e[REPLAY_PARTNERS];
  int n;
  uint64_t seen;
};

/* Records `fingerprint` as partner `id`'s latest; true when it equals the
 * one recorded before (a repeat). */
bool replay_check(struct replay_table *t, const uint8_t *id, double fingerprint);

#endif /* RUMOR_PEER_REPLAY_H */
