/*
 * sync_impl.h — what the scheme files of peer/sync/ share; private to the
 * folder. Training thread only.
 */
#ifndef RUMOR_PEER_SYNC_IMPL_H
#define RUMOR_PEER_SYNC_IMPL_H

#include "peer/sync/sync.h"

/* The schemes (one table entry each; sync.c chooses). */
extern const struct sync_scheme sync_scheme_gossip;    /* average.c */
extern const struct sync_scheme sync_scheme_allreduce; /* allreduce.c */
extern const struct sync_scheme sync_scheme_diloco;    /* diloco.c */
extern const struct sync_scheme sync_scheme_noloco;    /* noloco.c */
extern const struct sync_scheme sync_scheme_ps;        /* peer/ps/ps_scheme.c */

bool sync_stopped(const struct sync *s);
/* Sleeps about `secs` while serving donations and figures (sync_idle). */
void sync_idle_for(struct sync *s, double secs);

/* ---- the exchange slot's training side (exchange.c) ---- */

/* Sets up staging and the snapshot's copies; `dev_copy` asks for the
 * device copy of the snapshot on a GPU (sync.h, snap_dev). */
int sync_xch_init(struct sync *s, bool dev_copy, struct rumor_err *e) RUMOR_MUST_CHECK;
void sync_xch_free(struct sync *s);
/* The slot's turn at this boundary (gossip_xch_begin; `want`: start an
 * exchange), and the copies it asks for: our parameters into
 * gossip_xch_mine() for an exchange (GOSSIP_XCH_SNAPSHOT) or to keep a
 * snapshot ready for partners (one copy per state of the parameters;
 * asynchronous on a GPU, finished at a later boundary), handed back with
 * gossip_xch_copied once they landed. Returns the turn; an APPLY is left to
 * the caller (sync_xch_judge, then sync_xch_done). *copy_started: a copy for
 * an exchange began now. */
void sync_xch_turn(struct sync *s, bool want, struct gossip_xch_turn *turn, bool *copy_started);
/* GOSSIP_XCH_APPLY: validates the partner's snapshot (the turn's delta) and
 * applies clipping. Returns 0 with *weight (α times the clipping scale:
 * what to scale θ'_s − θ_s by), a negative code (rejected: the sender is
 * backed off) or 1 (a far outlier skipped by clipping), with the reason in
 * why[0..n). */
int sync_xch_judge(struct sync *s, const struct gossip_xch_turn *turn, float alpha, float *weight, char *why,
                   size_t n);
/* The partner's difference θ'_s − θ_s on our device (refreshed from the
 * receive buffer). */
const struct tensor *sync_xch_delta_dev(struct sync *s);
/* Reports the outcome (gossip_xch_apply_done) and counts it; rc as
 * sync_xch_judge's. */
void sync_xch_done(struct sync *s, int rc, const char *why);

/* ---- ring rounds (allreduce.c) ---- */

enum sync_round_kind { SYNC_ROUND_REDUCE, SYNC_ROUND_GATHER };
/* Fills this member's contribution before each attempt (the ring adds into
 * the buffer, so a retry must fill it again). */
typedef void (*sync_fill_fn)(struct sync *s, void *arg);
/* Runs ring round `id` (gossip_ar_start or gossip_ag_start) until it is
 * done, retrying a failed one with the ring re-formed from the membership
 * and serving donations and figures meanwhile. Returns 0 when done (the
 * result in gossip_ar_result or gossip_ag_result), 1 when the member was
 * left behind and took the state of one ahead (catch_up: the round is
 * dropped), or a negative code (stopped, every pulled state refused).
 * The catch-up asks for a donor that completed round `id` (its ring
 * position past it) and takes a state of step `min_step` or later. */
int sync_ring_round(struct sync *s, enum sync_round_kind kind, uint64_t id, sync_fill_fn fill, void *arg,
                    uint64_t min_step, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Before a DiLoCo member, a whole replica, tells the ring it is ready
 * (starting, back from sitting out): when a member's ring position is past
 * outer round `round` (the one we would run next), its state (at min_step
 * or later, passing the pull policy) is taken now, while no ring holds us;
 * otherwise the ring re-forms with us as soon as we are ready, learns we
 * are behind and waits while we catch up. `when` names the moment in the
 * log. Returns 1 (taken: the trainer is at the donor's step), 0 (nobody is
 * past it, none answered soon, or it does not apply: a gradient ring, a
 * part of a replica, a run at its end), or a negative code. */
int sync_ring_rejoin(struct sync *s, uint64_t round, uint64_t min_step, const char *when,
                     struct rumor_err *e) RUMOR_MUST_CHECK;
/* Takes the ring's advice to sit out (gossip_ar_sit_out; our link to the
 * next member loses packets), for a whole replica's process not at its
 * last step: out for SYNC_SIT_OUT_S, twice as long each time it happens
 * again within SYNC_SIT_OUT_CALM_S of our return (at most
 * SYNC_SIT_OUT_MAX_S), training nothing (the membership holds us not
 * ready: no ring takes us, no newcomer picks us as its donor). Back, a
 * DiLoCo member takes a member's state first (sync_ring_rejoin, for
 * `round` and `min_step`); then ready again (an all-reduce member's next
 * round finds the ring ahead and catches up). Returns 0 (not advised, or
 * back with our own state), 1 (back with a member's: the round we were at
 * is dropped), or a negative code (stopped meanwhile). */
int sync_ring_sit_out(struct sync *s, uint64_t round, uint64_t min_step, struct rumor_err *e) RUMOR_MUST_CHECK;

/* After a reduce round: the sum (gossip_ar_result: P values and their
 * weight, the rows or members summed, as the last float) divided by its
 * weight into dst (P floats on the trainer's device). False, dst untouched,
 * when it is not finite or weighs less than 1 (every member sees the same
 * sum, so every member decides alike). */
bool sync_ring_mean(struct sync *s, struct tensor *dst);

/* ---- the outer optimizer (outer.c) ---- */

/* The segments of the state an outer scheme keeps with the model. */
void sync_outer_extra(const struct sync_config *c, struct train_extra_spec *out);
/* Binds the outer state to the trainer's extra state and starts it: a
 * fresh one (no state was resumed or donated: the anchor is the
 * parameters) or the one the trainer holds. */
int sync_outer_init(struct sync *s, struct rumor_err *e) RUMOR_MUST_CHECK;
void sync_outer_free(struct sync *s);
/* Reads the round counters back from the trainer's extra state (after a
 * state was loaded into it). */
void sync_outer_reload(struct sync *s);
/* Writes the round counters into the trainer's extra state. */
void sync_outer_store(struct sync *s);
/* True when this boundary ends a round: every local_steps steps, and at
 * the last step. */
bool sync_outer_due(const struct sync *s);
/* --outer-overlap's τ: the inner steps after its boundary at which a
 * round lands (--outer-overlap-steps, or H). */
int64_t sync_outer_landing_steps(const struct outer_config *c);
/* True when the round in flight lands at this boundary before the next
 * round's (--outer-overlap-steps below H). */
bool sync_outer_land_due(const struct sync *s);
/* A data- or tensor-parallel group member left behind by its shard's ring
 * (its parameters and inner state are a piece of its group's): takes only
 * the outer state of `state`, a full state pulled from a member that
 * completed the round (trainer_copy_state's layout): the anchor, the
 * momentum and the rounds done, and restarts its parameters from that
 * anchor, φ ← θ, as applying the round would have. Its inner optimizer
 * state and top-k residual stay its own; the step is the caller's
 * (allreduce.c takes the donor's, and the group follows). False (nothing
 * changed, why[0..n) says what was wrong) when the outer state is not
 * finite, not one after min_round rounds with nothing in flight, or
 * `step` (the donor's) does not go with its rounds. */
bool sync_outer_take(struct sync *s, const float *state, uint64_t step, uint64_t min_round, char *why, size_t n);
/* work ← θ − φ (this member's pseudo-gradient, on the device). */
void sync_outer_pseudo_gradient(struct sync *s);
/* The outer step with the averaged pseudo-gradient in outer.work: updates
 * the momentum and the anchor, then φ ← θ (or, overlapping, φ ← θ + (φ −
 * prev)); counts the round and stores the counters. */
void sync_outer_step(struct sync *s);
/* What an outer scheme's gossip plan shares: the encoding (f16 and i8
 * from --outer-compress) and the label, which names the scheme and every
 * setting members must agree on. The caller sets the protocol and the
 * buffers. */
void sync_outer_plan(const struct sync_config *c, const char *scheme, struct sync_gossip_plan *out);
/* The result line's outer figures. */
void sync_outer_result(const struct sync *s, struct json_t *o);

#endif /* RUMOR_PEER_SYNC_IMPL_H */
