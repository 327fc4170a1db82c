/*
 * attack — testing only: a peer that holds valid keys but poisons what it
 * sends (`rumor peer --attack KIND`), so that the reliability tests can check
 * that honest peers reject or clip it, back it off, and keep training. Never
 * for real use: a peer started with --attack says so in its log.
 *
 * Kinds that change the snapshot sent in an exchange (training thread):
 *   nan       a few values set to NaN
 *   inf       a few values set to +Inf
 *   scale     the model multiplied by -1000
 *   signflip  the model multiplied by -1 (passes the distance check: only
 *             clipping limits it)
 *   replay    records its first snapshot after training began, stays honest
 *             for ATTACK_REPLAY_AFTER more, then sends the recorded one again,
 *             with its old step, every time
 * Kinds that act in the gossip layer (gossip_config.test_attack):
 *   short     one value fewer than the model has
 *   flood     floods every peer with exchange requests and connections
 */
#ifndef RUMOR_PEER_ATTACK_H
#define RUMOR_PEER_ATTACK_H

#include <stdbool.h>
#include <stdint.h>

#include "util/util.h"

#define ATTACK_REPLAY_AFTER 30

enum attack_kind { ATTACK_NONE = 0, ATTACK_NAN, ATTACK_INF, ATTACK_SCALE, ATTACK_SIGNFLIP, ATTACK_REPLAY,
                   ATTACK_SHORT, ATTACK_FLOOD };

struct attack {
  enum attack_kind kind;
  uint64_t snapshots;
  float *recorded; /* replay: the first snapshot taken after training began */
  int64_t recorded_step;
  uint64_t replay_from; /* replay once this many snapshots were sent */
};

/* Parses a kind name ("none" or one of the above). RUMOR_EFORMAT with a
 * message listing the kinds when unknown. */
int attack_parse(const char *s, enum attack_kind *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The GOSSIP_TEST_ATTACK_* bits for a kind (0 for snapshot kinds). */
uint32_t attack_gossip_bits(enum attack_kind k);
void attack_init(struct attack *a, enum attack_kind k);
/* Poisons the snapshot `p` (n floats, taken at *step) in place; may change
 * *step (replay). No-op for ATTACK_NONE and the gossip-layer kinds. */
void attack_snapshot(struct attack *a, float *p, int64_t n, int64_t *step);
void attack_free(struct attack *a);

#endif /* RUMOR_PEER_ATTACK_H */
