/*
 * What a member that is ahead means to the all-reduce ring's round
 * (gossip_ring_heard_ahead), on a hand-made ring of three: us in the
 * middle, our predecessor and our successor, in a round of step 10 (10
 * steps completed) with pieces still to come from the predecessor.
 *
 * The case found in bench-chaos (a 15 s stall after a relay was killed):
 * a member that is not our predecessor in this attempt answered a READY of
 * an earlier attempt, where it was, with RING_AHEAD; that one must not
 * fail the round, but our predecessor's RING_AHEAD for the same step must,
 * though the step is known by then. Before the fix it was dropped as
 * nothing new, and the round waited on the predecessor until its timeout.
 *
 * And which of the successor's READYs a failed attempt spends
 * (gossip_ring_spend_ready, the suite ring_spend below), and what a piece
 * the successor refused does to the attempt (gossip_ring_piece_refused,
 * the suite ring_refused).
 */
#include <criterion/criterion.h>
#include <string.h>

#include "gossip/gossip_impl.h"

static uint8_t ids[3][NET_PUBKEY_BYTES]; /* sorted by key: pred, us, succ */
static struct gossip_ring r;
#define PRED ids[0]
#define SUCC ids[2]
static uint8_t other[NET_PUBKEY_BYTES]; /* a member outside this attempt's ring */

static void setup(void) {
  for (int i = 0; i < 3; i++) memset(ids[i], 0x10 * (i + 1), NET_PUBKEY_BYTES);
  memset(other, 0x77, NET_PUBKEY_BYTES);
  memset(&r, 0, sizeof r);
  r.ids = ids;
  r.n = 3;
  r.me = 1;
  r.active = true;
  r.step = 10;
  r.pos = 10;
  r.recv_left = 4;
}

TestSuite(ring_ahead, .init = setup);

Test(ring_ahead, the_predecessors_ring_ahead_fails_the_round_after_another_member_told_that_step) {
  cr_assert_not(gossip_ring_heard_ahead(&r, other, 11, false), "another member's RING_AHEAD failed the round");
  cr_assert_eq(r.ahead_step, 11);
  cr_assert(memcmp(r.ahead_id, other, NET_PUBKEY_BYTES) == 0);
  cr_assert(gossip_ring_heard_ahead(&r, PRED, 11, false),
            "the predecessor's RING_AHEAD for a step already known left the round waiting on it");
  cr_assert(memcmp(r.ahead_id, other, NET_PUBKEY_BYTES) == 0, "the first member to tell the step is kept");
}

Test(ring_ahead, a_ring_ahead_fails_the_round_only_from_the_predecessor_we_still_wait_for) {
  cr_assert_not(gossip_ring_heard_ahead(&r, SUCC, 11, false));
  cr_assert(memcmp(r.ahead_id, SUCC, NET_PUBKEY_BYTES) == 0);
  r.recv_left = 0; /* everything of the predecessor's arrived: nothing to wait for */
  cr_assert_not(gossip_ring_heard_ahead(&r, PRED, 11, false));
  r.recv_left = 1;
  r.failing = true; /* failing already */
  cr_assert_not(gossip_ring_heard_ahead(&r, PRED, 11, false));
  r.failing = false;
  r.active = false; /* between rounds: noted for the next catch-up only */
  cr_assert_not(gossip_ring_heard_ahead(&r, PRED, 12, false));
  cr_assert_eq(r.ahead_step, 12);
  cr_assert(memcmp(r.ahead_id, PRED, NET_PUBKEY_BYTES) == 0);
}

Test(ring_ahead, a_step_not_past_ours_or_not_past_the_round_changes_nothing) {
  cr_assert_not(gossip_ring_heard_ahead(&r, PRED, 10, false));
  cr_assert_eq(r.ahead_step, 0, "a member at our own position was noted as ahead");
  r.pos = 11; /* our own position is that step already */
  cr_assert_not(gossip_ring_heard_ahead(&r, PRED, 11, false));
  cr_assert_eq(r.ahead_step, 0);
  r.pos = 9; /* past our position (noted) but not past the round's step: it has not completed our round */
  cr_assert_not(gossip_ring_heard_ahead(&r, PRED, 10, false));
  cr_assert_eq(r.ahead_step, 10);
}

Test(ring_ahead, the_furthest_member_ahead_is_the_one_kept) {
  cr_assert_not(gossip_ring_heard_ahead(&r, other, 13, false));
  cr_assert(gossip_ring_heard_ahead(&r, PRED, 11, false));
  cr_assert_eq(r.ahead_step, 13);
  cr_assert(memcmp(r.ahead_id, other, NET_PUBKEY_BYTES) == 0);
}

Test(ring_ahead, a_ready_two_steps_past_ours_fails_the_round_from_anyone_one_step_past_does_nothing) {
  cr_assert_not(gossip_ring_heard_ahead(&r, SUCC, 11, true), "a READY for the next step (a quicker member) failed it");
  cr_assert_eq(r.ahead_step, 0);
  cr_assert(gossip_ring_heard_ahead(&r, other, 12, true));
  cr_assert_eq(r.ahead_step, 12);
  cr_assert(gossip_ring_heard_ahead(&r, SUCC, 12, true), "a second READY for a step already known did not fail it");
  cr_assert(memcmp(r.ahead_id, other, NET_PUBKEY_BYTES) == 0);
}

/* gossip_ring_spend_ready: an attempt failed after sending on the
 * successor's READY; the next must not send on it again (bench-chaos: all
 * eight members retried every 100 ms for minutes, each first one to retry
 * sending on its successor's READY of the failed attempt, refused, failing
 * the ring again). */
static struct ring_ready readies[2];

static void with_readies(void) {
  setup();
  readies[0] = (struct ring_ready){.step = 10, .hash = 0xabc, .nonce = 7};
  memcpy(readies[0].id, SUCC, NET_PUBKEY_BYTES);
  readies[1] = (struct ring_ready){.step = 10, .hash = 0xabc, .nonce = 5};
  memcpy(readies[1].id, PRED, NET_PUBKEY_BYTES);
  r.readies = readies;
  r.nreadies = 2;
  r.hash = 0xabc;
}

TestSuite(ring_spend, .init = with_readies);

Test(ring_spend, the_successors_ready_an_attempt_sent_on_is_spent_when_it_fails) {
  r.succ_ready = true;
  r.succ_nonce = 7;
  gossip_ring_spend_ready(&r);
  cr_assert_not(readies[0].step == r.step && readies[0].hash == r.hash,
                "the next attempt of step %llu would send on the failed one's READY again",
                (unsigned long long)r.step);
  cr_assert_not(r.succ_ready);
  cr_assert(readies[0].spent, "the same READY arriving again would be taken again");
  cr_assert(readies[0].answered, "a spent READY would be answered with RING_AHEAD");
  cr_assert_eq(readies[1].step, 10, "the predecessor's READY was touched");
  cr_assert_eq(readies[1].nonce, 5);
}

Test(ring_spend, a_ready_the_attempt_did_not_send_on_is_kept) {
  r.succ_ready = false; /* the successor's READY came after the attempt failed: for the next one */
  gossip_ring_spend_ready(&r);
  cr_assert_eq(readies[0].step, 10);
  cr_assert_eq(readies[0].nonce, 7);
  cr_assert_not(readies[0].spent);
  r.succ_ready = true;
  r.succ_nonce = 6; /* sent on an older one; the stored one is newer */
  gossip_ring_spend_ready(&r);
  cr_assert_eq(readies[0].step, 10, "the successor's newer READY was spent");
  r.n = 1; /* a ring of one has no successor */
  r.succ_ready = true;
  r.succ_nonce = 7;
  gossip_ring_spend_ready(&r);
  cr_assert_eq(readies[0].step, 10);
}

/* gossip_ring_piece_refused: the successor refused a piece of ours, sent
 * on its READY with a nonce. A READY of an attempt that failed, arriving
 * after the failure, is taken by the next attempt; failing the ring for the
 * refusal made every member retry into the next late READY (bench-chaos:
 * six members retrying every 100 ms for 10 s). */
static struct ring_io sends[2];

static void with_sends(void) {
  with_readies();
  memset(sends, 0, sizeof sends);
  r.send = sends;
  r.pieces = 1;
  sends[0].state = RING_IO_BUSY;
  r.succ_ready = true;
  r.succ_nonce = 7; /* the successor's stored READY (readies[0]) */
}

TestSuite(ring_refused, .init = with_sends);

Test(ring_refused, a_piece_refused_on_a_stale_ready_spends_it_and_the_attempt_goes_on) {
  cr_assert_not(gossip_ring_piece_refused(&r, 0, 7, 5000), "the attempt failed on a successor's stale READY");
  cr_assert_eq(sends[0].state, RING_IO_NONE, "the refused piece cannot go again");
  cr_assert_not(r.succ_ready, "the next pieces would go on the stale READY again");
  cr_assert(readies[0].spent, "the stale READY arriving again would be taken again");
  cr_assert_eq(readies[1].nonce, 5, "the predecessor's READY was touched");
  cr_assert_eq(r.stale_readies, 1);
  cr_assert_eq(r.refused_ms, 5000, "the wait for the successor's current READY is not bounded");
}

Test(ring_refused, a_piece_refused_on_an_older_ready_than_the_one_we_hold_goes_again_on_it) {
  r.succ_nonce = readies[0].nonce = 8; /* the successor's current READY came while the piece was on its way */
  cr_assert_not(gossip_ring_piece_refused(&r, 0, 7, 5000));
  cr_assert(r.succ_ready, "the successor's current READY was spent for an older one's refusal");
  cr_assert_not(readies[0].spent);
  cr_assert_eq(r.stale_readies, 0);
  cr_assert_eq(r.refused_ms, 0, "a wait began though a current READY is here");
  cr_assert_eq(sends[0].state, RING_IO_NONE);
}

Test(ring_refused, a_refusal_after_the_successor_confirmed_a_piece_fails_the_attempt) {
  r.delivered = 1; /* what it took is lost with the attempt it left */
  cr_assert(gossip_ring_piece_refused(&r, 0, 7, 5000));
  r.succ_nonce = 8;
  cr_assert(gossip_ring_piece_refused(&r, 0, 7, 5000));
}

Test(ring_refused, an_attempt_outlives_a_bounded_number_of_stale_readies) {
  for (uint64_t i = 0; i <= RING_STALE_READY_MAX; i++) {
    readies[0] = (struct ring_ready){.step = 10, .hash = 0xabc, .nonce = 100 + i};
    memcpy(readies[0].id, SUCC, NET_PUBKEY_BYTES);
    r.succ_ready = true;
    r.succ_nonce = 100 + i;
    sends[0].state = RING_IO_BUSY;
    bool failed = gossip_ring_piece_refused(&r, 0, 100 + i, 5000);
    if (i < RING_STALE_READY_MAX)
      cr_assert_not(failed, "stale READY %llu failed the attempt", (unsigned long long)i + 1);
    else
      cr_assert(failed, "a successor refusing every READY kept the attempt waiting");
  }
}
