/*
 * gossip — cluster membership and gossip averaging over net/.
 *
 * A gossip_t runs its own libuv loop on its own thread ("the loop thread"):
 * the transport, SWIM membership (probes, suspicion, refutation, LEAVE), the
 * join protocol, the exchange protocol and state donations. It knows nothing
 * of models or datasets: parameters are flat float32 host buffers of
 * `nparams` elements, a peer's full state `state_floats` elements.
 *
 * The training thread meets it only at step boundaries, through two slots
 * (one exchange, one donation), by polling:
 *
 *   exchange slot   IDLE ──(training: time to gossip, or loop: a partner
 *                          asked)──▶ WANT_SNAPSHOT ──(training filled `mine`)──▶
 *                   BUSY (the loop sends `mine`, receives `theirs`) ──(both
 *                   transfers confirmed)──▶ APPLY ──(training applied or
 *                   rejected `theirs`)──▶ IDLE; the loop abandons a failed
 *                   exchange from BUSY back to IDLE, nothing applied.
 *
 * Whoever holds a slot state owns its buffers: the training thread writes
 * `mine` only in WANT_SNAPSHOT and reads `theirs` only in APPLY; the loop
 * thread touches them only in BUSY. Training never waits on the network, and
 * the network never touches live parameters.
 *
 * Threads: gossip_start, gossip_stop, gossip_join_wait, gossip_ready,
 * gossip_on_loop and the gossip_xch_*, gossip_donor_* and
 * gossip_stats_publish / _wanted functions are for the training (main)
 * thread; those marked "any thread" may be called from anywhere; everything
 * else happens on the loop thread. The runtime's insides are described in
 * gossip_impl.h.
 */
#ifndef RUMOR_GOSSIP_H
#define RUMOR_GOSSIP_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "net/net.h"
#include "util/util.h"

typedef struct gossip gossip_t;

enum gossip_role { GOSSIP_ROLE_PEER = 0, GOSSIP_ROLE_BOOTSTRAP = 1 };

/* How peers keep their replicas together (rumor peer --sync). */
enum gossip_sync {
  GOSSIP_SYNC_GOSSIP = 0,    /* averaging exchanges with random partners (the exchange slot) */
  GOSSIP_SYNC_ALLREDUCE = 1, /* bulk-synchronous ring all-reduce of every step's gradient */
};

#define GOSSIP_LABEL_MAX 255 /* characters of the label peers must share (gossip_config.model) */
/* Words in an all-gather round's result (every member's block: n ×
 * gather_floats), at most: 8 GiB. A larger ring fails its rounds. */
#define GOSSIP_GATHER_MAX_FLOATS (UINT64_C(1) << 31)

struct gossip_config {
  /* Identity and admission (required); copied. */
  const struct net_identity *identity;
  const uint8_t *cluster_key;
  const struct net_allowlist *allow; /* optional */
  struct net_config net;             /* transport tuning; identity fields are set from above */

  const char *listen;    /* "host:port" (port 0: any free port); unused with no_inbound */
  /* We cannot accept connections (behind a NAT): listen nowhere, register
   * with a relay and advertise "@RELAY" (net.h, relays). A member that
   * listens but that a bootstrap node cannot dial back does the same. */
  bool no_inbound;
  bool relay;            /* relay for such members (sets net.relay; net.relay_rate_bytes caps it) */
  const char *advertise; /* address others dial us at; NULL: the listen host and bound port */
  const char *bootstrap; /* comma-separated addresses; NULL or "": we are the first member */
  enum gossip_role role;
  const char *name;      /* short label for logs ("peer-2"); optional */
  /* Pin the network thread, and so libuv's pool threads it starts (they
   * encrypt and decrypt), to these CPUs; NULL: no pinning. Copied. */
  const struct cpu_list *net_cpus;

  /* Membership timing (SWIM). */
  uint32_t period_ms, ping_timeout_ms, suspect_timeout_ms;
  /* Joining: how long to keep trying the bootstrap list and donors. */
  uint32_t join_timeout_ms;

  /* Peers only: what one replica is. Peers with another model are refused. */
  const char *model;     /* model spec string (at most GOSSIP_LABEL_MAX characters) */
  uint64_t nparams;      /* floats in a parameter snapshot */
  uint64_t state_floats; /* floats in a donated state (parameters first) */
  const char *optimizer; /* must match for donations */
  enum net_dtype wire;   /* encoding of exchanged parameters (or gradients) on the wire */
  /* GOSSIP_SYNC_ALLREDUCE: xch_mine and xch_theirs hold nparams + 1 floats
   * each and serve the all-reduce; exchange requests are refused. */
  enum gossip_sync sync;
  /* The sync scheme's name, for monitors ("gossip", "allreduce", "diloco",
   * "noloco"; NULL: the protocol's). Copied; at most 15 characters. */
  const char *scheme;
  /* GOSSIP_SYNC_ALLREDUCE: words in one member's all-gather block, the same
   * on every member (0: no all-gather rounds; at most GOSSIP_GATHER_MAX_FLOATS). */
  uint64_t gather_floats;
  float alpha;           /* averaging weight: x ← x + α·(x'_s − x_s), the snapshots exchanged (sync.h) */
  /* Host buffers owned by the caller (pinned memory for GPU peers), kept
   * until gossip_stop: our snapshot and the partner's parameters (nparams
   * floats each) and a donated state (state_floats floats). */
  float *xch_mine, *xch_theirs, *donor_buf;
  uint32_t exchange_timeout_ms; /* an exchange not done by then is abandoned */
  /* GOSSIP_SYNC_ALLREDUCE: a round whose ring holds no majority of the
   * members of the last ring we completed a round with (those that left
   * since not counted) waits this long for more before going on without
   * them: a member cut off from the cluster does not train on alone and
   * race ahead of it (ring.c, "Quorum"). 0: go on at once. */
  uint32_t quorum_wait_ms;
  /* GOSSIP_SYNC_ALLREDUCE: when, over GOSSIP_PATH_WINDOW_MS of rounds, the
   * kernel retransmitted at least this fraction of the segments we sent to
   * the next member, the ring advises us to sit out (gossip_ar_sit_out):
   * a lossy link paces the whole ring (ring.c, "Sitting out"). 0: never. */
  float sit_out_loss;
  uint64_t seed;         /* neighbour choice */

  /* Monitoring. */
  const char *metrics;   /* "host:port" for the HTTP endpoint (/metrics, /healthz), or NULL */
  int sketch_k;          /* count-sketch buckets (a power of two; default 1024) */

  /* Per-peer rate limits (guard.c): exchange requests answered and
   * connections accepted per second from one member identity, in bursts of
   * up to twice that; beyond them requests are refused ("rate limited") and
   * connections closed. 0: no limit. */
  double max_xch_per_s, max_conn_per_s;
};
#define GOSSIP_QUORUM_WAIT_MS 30000 /* gossip_config.quorum_wait_ms's default */
#define GOSSIP_SIT_OUT_LOSS 0.02f   /* gossip_config.sit_out_loss's default */
#define GOSSIP_PATH_WINDOW_MS 2000  /* the window over which sit_out_loss is measured */
void gossip_config_default(struct gossip_config *c);

/* Starts the loop thread: listens, joins through the bootstrap list (in the
 * background) and begins membership. Returns 0, or a negative code with a
 * message (bad address, cannot listen). */
int gossip_start(gossip_t **out, const struct gossip_config *cfg, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Leaves gracefully: gossips LEAVE to the members (waiting up to
 * `linger_ms` for it to be sent), closes every connection, stops the loop
 * thread and frees everything. */
void gossip_stop(gossip_t *g, uint32_t linger_ms);

/* Runs fn(loop, arg) on the loop thread and returns once it has returned:
 * for other parts of this process that keep their own handles and
 * connections on the same event loop (a pipeline stage's links), so that a
 * process has one event loop and one network thread. Those parts must close
 * every handle they opened before gossip_stop, or the loop never ends. Not
 * for the loop thread itself. Returns 0, or RUMOR_ECANCELED (fn not run)
 * when the runtime is stopping. */
int gossip_on_loop(gossip_t *g, void (*fn)(uv_loop_t *loop, void *arg), void *arg) RUMOR_MUST_CHECK;

/* Checks an address to advertise (--advertise) before anything starts: one
 * others can dial (net_addr_check_dial: a host and a port in [1, 65535]),
 * not an unspecified address (0.0.0.0, [::]), short enough for the member
 * table. Returns 0, or RUMOR_EFORMAT with a message quoting it (the caller
 * names the flag). Any thread. */
int gossip_advertise_check(const char *addr, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Without --advertise, the --listen address stands for it (with the port
 * bound): its host must be one others can dial, not missing (":7000") and
 * not unspecified (0.0.0.0, [::]). Returns 0, or RUMOR_EFORMAT with a
 * message naming --listen and suggesting --advertise. Any thread. */
int gossip_listen_advertisable(const char *listen, struct rumor_err *e) RUMOR_MUST_CHECK;

/* The address others dial us at ("127.0.0.1:40123"); valid after start. */
const char *gossip_advertised(const gossip_t *g);
/* Our public key in text form. */
const char *gossip_self_id(const gossip_t *g);
/* The TCP port of the metrics endpoint (bound, so useful with port 0), or 0
 * without one; valid after start. */
int gossip_metrics_port(const gossip_t *g);

/* Where a donated state stands in training. */
struct gossip_train_pos {
  uint64_t step, epoch, samples;
};

/* Blocks until the node has joined and, for a peer, holds an initial state.
 * Returns 0 when a live peer donated its state into `state_buf`
 * (state_floats floats) and *pos, 1 when there is no other peer to take it
 * from (start from the seed), or a negative code with a message naming every
 * address tried when joining failed for join_timeout_ms. `stop` (may be
 * NULL) is polled; when it becomes non-zero the wait ends with
 * RUMOR_ECANCELED. */
int gossip_join_wait(gossip_t *g, float *state_buf, struct gossip_train_pos *pos, const atomic_int *stop,
                     struct rumor_err *e) RUMOR_MUST_CHECK;

/* Peers that hold or have held a state (ready), whatever their state now,
 * ourselves included once we are ready: how far the cluster has assembled.
 * A fast peer may finish and leave before a slow one's view catches up, so
 * departed ready peers still count. Any thread. */
size_t gossip_ready_peers(gossip_t *g);

/* Alive peers that hold a state, ourselves excluded: partners an exchange
 * could find now (as of the last published member view); after
 * gossip_finished, not those struck (gossip_member_view). Any thread. */
size_t gossip_live_partners(gossip_t *g);

/* The training thread holds a state (after gossip_join_wait and building
 * its model): from now on it may exchange and donate. */
void gossip_ready(gossip_t *g);

/* The end of a run (rumor peer --finish-wait-ms): the training thread took
 * its last step and goes on only exchanging, so that partners still
 * training are not left alone and the replicas end together. From now on
 * our exchange transfers are marked done (optional metadata that older
 * peers ignore, with the other members we know finished: exchange.c).
 * Training thread. */
void gossip_finished(gossip_t *g);
/* Alive or suspect peers that hold a state, ourselves excluded, that have
 * not told us they finished and whose parameters we do not reject
 * (finished and struck ones are known only after gossip_finished): those
 * --finish-wait-ms waits for. Any thread. */
size_t gossip_training_partners(gossip_t *g);

/* ---- the exchange slot (training thread) ---- */

enum gossip_xch_work {
  GOSSIP_XCH_NONE = 0,
  GOSSIP_XCH_SNAPSHOT, /* copy the current parameters into gossip_xch_mine() */
  GOSSIP_XCH_APPLY,    /* validate and average in gossip_xch_theirs() */
};

/* What the partner's snapshot is to ours (valid while APPLY, below). */
struct gossip_xch_delta {
  int64_t nonfinite;   /* values the partner sent that are NaN or ±Inf */
  double sq_dist;      /* ‖θ'_s − θ_s‖² (NaN when nonfinite > 0) */
  double sq_norm_mine; /* ‖θ_s‖² */
};

/* One step boundary's dealings with the slot: gossip_xch_begin says what
 * the training thread does now, and it answers once, when its part is done:
 * gossip_xch_copied after copying its parameters into gossip_xch_mine()
 * (GOSSIP_XCH_SNAPSHOT, or a refresh the slot took), possibly at a later
 * boundary (an asynchronous copy on a GPU), or gossip_xch_apply_done after
 * averaging in the partner's difference (GOSSIP_XCH_APPLY). */
struct gossip_xch_turn {
  enum gossip_xch_work work;
  bool started;       /* this call started an exchange of ours (IDLE or READY → WANT) */
  bool partner_asked; /* SNAPSHOT: a partner's request waits for it (not one of ours) */
  bool refresh;       /* NONE: the slot is ours to refresh the ready snapshot (then gossip_xch_copied) */
  bool in_flight;     /* an exchange is under way after this call (the slot holds more than a ready snapshot) */
  /* APPLY, stable until gossip_xch_apply_done: gossip_xch_theirs() holds
   * the partner's snapshot minus ours (θ'_s − θ_s), computed off the
   * training thread when the transfers ended; its statistics, the
   * partner's key (NET_PUBKEY_BYTES) and the averaging weight α. */
  const struct gossip_xch_delta *delta;
  const uint8_t *partner;
  float alpha;
};
/* At a step boundary. `want` asks to start an exchange (every k steps or t
 * seconds: the caller's schedule), taken only when the slot is free;
 * `refresh` lets the slot hand out a refresh of the snapshot kept ready (so
 * that a partner's request is answered at once rather than at our next
 * boundary), taken only when there is nothing else to do. A partner's
 * request that arrives during a refresh is answered with it. */
void gossip_xch_begin(gossip_t *g, bool want, bool refresh, struct gossip_xch_turn *out);
/* The copy the slot asked for (SNAPSHOT or a refresh) is complete in
 * `mine`, taken at `step`. A copy for an exchange abandoned meanwhile is
 * dropped. */
void gossip_xch_copied(gossip_t *g, uint64_t step);
/* True while an exchange is under way (as gossip_xch_turn.in_flight), for
 * a caller waiting between boundaries. */
bool gossip_xch_in_flight(gossip_t *g);
float *gossip_xch_mine(gossip_t *g);   /* nparams floats */
float *gossip_xch_theirs(gossip_t *g); /* nparams floats */
/* Refuses the partner's request that waits for our snapshot (`why` goes
 * to the partner, who asks someone else): for a scheme that exchanges
 * only at its own boundaries (NoLoCo between rounds). The slot returns to
 * idle on the loop thread soon after; until then gossip_xch_begin may
 * say GOSSIP_XCH_SNAPSHOT again, and declining again is harmless. */
void gossip_xch_decline(gossip_t *g, const char *why);
/* Withdraws the snapshot kept ready (READY → IDLE), so that no partner
 * takes it any more: it no longer stands for our parameters (NoLoCo after
 * a round's update). Returns false when a partner's request took it just
 * now: that exchange goes on. */
bool gossip_xch_unready(gossip_t *g);
/* The partner's parameters were applied (status 0) or rejected (negative,
 * with `why`); the slot returns to idle and the outcome is counted and
 * logged (a rejection backs the sender off). Status > 0: not applied
 * because clipped averaging found it a far outlier (`why`): counted as
 * rejected, but the sender is not backed off (it may be an honest peer that
 * drifted, which catches up by applying ours). */
void gossip_xch_apply_done(gossip_t *g, int status, const char *why);

/* ---- all-reduce (cfg.sync == GOSSIP_SYNC_ALLREDUCE; training thread) ----
 *
 * One round sums a vector of nparams + 1 floats over every ready peer
 * (alive or suspect, the caller included) along a ring ordered by key
 * (with each member behind a relay placed after one that accepts
 * connections: ring.c, view_ring):
 * reduce-scatter then all-gather, each segment cut into pieces of
 * RING_PIECE_FLOATS that flow on as soon as they arrive, so every link of
 * the ring carries data at once. A round is identified by its step and its
 * ring (a hash of the members' keys): a member sends to its successor only
 * after the successor said RING_READY for the same round, so members whose
 * views of the membership differ never mix data; the round fails and is
 * started again once the views agree.
 *
 * A round fails, and nothing of it is delivered, when a transfer fails, a
 * neighbour it still needs fails or leaves (SWIM's verdict: a SIGSTOPped
 * peer stalls the ring until it is declared failed), a ready peer outside
 * the ring appears (a newcomer: the ring re-forms with it), another member
 * aborts the round, or the exchange timeout passes. A member whose round
 * failed after others completed it is told so (RING_AHEAD) and reports
 * GOSSIP_AR_BEHIND: it takes the state of a member that is ahead
 * (gossip_state_pull) instead of its own step.
 *
 * Buffers: the caller writes its contribution into gossip_ar_buf() before
 * gossip_ar_start and must not touch it until the round ends (the ring adds
 * partial sums into it); the sum is in gossip_ar_result() after
 * GOSSIP_AR_DONE, until the next start.
 *
 * The same ring also runs all-gather rounds (cfg.gather_floats > 0; DiLoCo's
 * compressed pseudo-gradients): every member contributes one opaque block of
 * gather_floats 32-bit words, and every member receives the n blocks of the
 * ring's members in ring (key) order, bit-exact: blocks always travel as
 * f32, whatever cfg.wire, and are never added or converted. A round is of one
 * kind: its kind (and block size) is part of its name, so a reduce round
 * and a gather round never exchange pieces or READYs, even at one step.
 * Both kinds count steps on one position: a member's rounds, of whichever
 * kind, take consecutive steps, and RING_AHEAD and BEHIND mean the same for
 * both. A gather round ends, fails and is reported exactly as a reduce round
 * (gossip_ar_wait, gossip_ar_info). */
enum gossip_ar_status {
  GOSSIP_AR_IDLE = 0,
  GOSSIP_AR_RUNNING,
  GOSSIP_AR_DONE,
  GOSSIP_AR_FAILED, /* try again (a new ring from the current membership) */
  GOSSIP_AR_BEHIND, /* others completed this step: take their state */
};
struct gossip_ar_info {
  uint64_t step;          /* of the last round */
  size_t members;         /* in its ring */
  char why[200];          /* why it failed */
  uint8_t ahead[NET_PUBKEY_BYTES]; /* BEHIND: a member that is ahead ... */
  uint64_t ahead_step;    /* ... and the step it is at */
  uint64_t rounds_done, rounds_failed;
};
float *gossip_ar_buf(gossip_t *g);          /* nparams + 1 floats */
const float *gossip_ar_result(gossip_t *g); /* nparams + 1 floats */
/* Starts the round of `step` (the optimizer steps this member has applied)
 * on the contribution in gossip_ar_buf(). Returns 0, or RUMOR_ECANCELED
 * when the runtime is stopping. */
int gossip_ar_start(gossip_t *g, uint64_t step) RUMOR_MUST_CHECK;
/* Waits up to `ms` for the round to end; returns its status (RUNNING when
 * it has not ended yet). */
enum gossip_ar_status gossip_ar_wait(gossip_t *g, uint32_t ms);
void gossip_ar_info(gossip_t *g, struct gossip_ar_info *out);
/* After GOSSIP_AR_BEHIND, when no member is left to take a later state
 * from (the ones ahead finished and left): the ring forgets that others
 * were ahead, so that the next rounds run with whoever is there (else
 * every round would fail as behind). Training thread. */
void gossip_ar_forget_ahead(gossip_t *g);

/* True, once, when the ring advises this member to leave it for a while:
 * our link to the next member lost at least cfg.sit_out_loss of what we
 * sent over the last window, so every round went at its pace; the ring
 * has members enough left for its quorum without us; and no other peer
 * is away or joining. `why` says what was measured. Training thread. */
bool gossip_ar_sit_out(gossip_t *g, char *why, size_t n);
/* Out of the ring (true) and back (false): while out, the membership holds
 * us not ready (no ring takes us, no newcomer picks us to take a state
 * from), told to every live member at once; back, ready again, and the
 * ring re-forms with us. Our own readiness (gossip_ready: /healthz,
 * donations) stays as it is. Training thread. */
void gossip_ring_away(gossip_t *g, bool away);

/* Our all-gather block: gather_floats words (NULL when gather_floats is 0),
 * written before gossip_ag_start and untouched until the round ends. */
float *gossip_ag_buf(gossip_t *g);
/* Starts the all-gather round of `step` on the block in gossip_ag_buf()
 * (consecutive with the reduce rounds' steps, as gossip_ar_start's). Needs
 * gather_floats > 0. Returns 0, or RUMOR_ECANCELED when the runtime is
 * stopping. The round ends as a reduce round does: gossip_ar_wait and
 * gossip_ar_info report it (DONE, FAILED, BEHIND). */
int gossip_ag_start(gossip_t *g, uint64_t step) RUMOR_MUST_CHECK;
/* After a gather round's GOSSIP_AR_DONE: the members' blocks, n ×
 * gather_floats words in ring order, with *members = n and *self = our
 * index; valid until the next start (of either kind). NULL with
 * *members = 0 when the last round was not a gather round that ended DONE. */
const float *gossip_ag_result(gossip_t *g, size_t *members, size_t *self);

/* The state just pulled (gossip_join_wait, gossip_state_pull) is refused
 * (`why`): its donor is struck (backed off, longer each time), so that the
 * next pull asks another peer first. Training thread. */
void gossip_refuse_donation(gossip_t *g, const char *why);
/* Takes the state of a live peer after joining (an all-reduce member that
 * fell behind): asks `from` first (NULL: any ready peer), then others, as a
 * newcomer does. `min_step` > 0: only a donor whose ring position is at
 * that step (round) or later gives its state; one at an earlier step
 * answers STATE_BUSY "behind" (it cannot help one that is behind), and
 * once every ready peer, or GOSSIP_PULL_BEHIND_ENOUGH of them, said so the
 * pull ends. Returns 0 with the state in state_buf and *pos, 1 when no
 * other peer is left to take it from (or none is that far), or a negative
 * code (stopped, no donor within twice the join timeout). */
int gossip_state_pull(gossip_t *g, const uint8_t *from, uint64_t min_step, float *state_buf,
                      struct gossip_train_pos *pos, const atomic_int *stop, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The same, from any ready peer, for a member that would rather keep its
 * own state than wait (a DiLoCo member rejoining its ring): 1 also when no
 * donor gave one within GOSSIP_PULL_OPTIONAL_MS (its donors busy, or of a
 * version that answers "busy" where it means "behind"). */
int gossip_state_pull_ahead(gossip_t *g, uint64_t min_step, float *state_buf, struct gossip_train_pos *pos,
                            const atomic_int *stop, struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- the donation slot (training thread) ---- */

/* True when a newcomer asked for our state: fill gossip_donor_buf() with
 * state_floats floats and call gossip_donor_done. */
bool gossip_donor_poll(gossip_t *g);
float *gossip_donor_buf(gossip_t *g);
/* True while a donation filled from gossip_donor_buf() is being sent: the
 * buffer must not be written until it turns false (training thread). */
bool gossip_donor_sending(gossip_t *g);
void gossip_donor_done(gossip_t *g, const struct gossip_train_pos *pos);
/* True when the pending donation is a monitor's request for the parameters
 * alone (rumor top --exact): the training thread then copies only the
 * parameters into the donor buffer and publishes fresh figures with a sketch
 * (gossip_stats_publish) before gossip_donor_done; they travel along. */
bool gossip_donor_params_only(gossip_t *g);
/* True when the pending state request is a ring member's catch-up
 * (gossip_state_pull with min_step > 0), not a newcomer's join. */
bool gossip_donor_catch_up(gossip_t *g);

/* ---- monitoring: what the training thread publishes (training thread) ---- */

#define GOSSIP_MAX_EXPERTS 64 /* a mixture of experts' experts in the figures */

/* A peer's training figures, answered to STATS requests (rumor top) and
 * served on the metrics endpoint. `sketch` holds sketch_k doubles: the
 * count-sketch of the parameters made with gossip_sketch_seed(). */
struct gossip_peer_stats {
  int64_t step, epoch, samples;
  double loss;          /* moving average of the training loss */
  double samples_per_s;
  double param_norm;    /* ‖θ‖ */
  const double *sketch; /* sketch_k values; may be NULL */
  /* An outer optimizer's (DiLoCo, NoLoCo): rounds applied (-1: none), the
   * last round's ‖averaged pseudo-gradient‖ and its bytes sent and received,
   * and the training thread's total wait for rounds in seconds. */
  int64_t outer_round;
  double outer_norm, outer_bytes, outer_wait_s;
  int64_t peak_rss_bytes; /* the process's peak resident memory so far (0: not known) */
  /* A mixture-of-experts model's last step (moe_experts 0: none): the
   * auxiliary losses, the fraction of token-expert choices dropped for
   * capacity and each expert's share of the choices. */
  int moe_experts;
  double moe_aux_loss, moe_z_loss, moe_dropped;
  double moe_load[GOSSIP_MAX_EXPERTS];
};
/* True when someone asked for fresh figures since the last publish (so the
 * O(P) sketch is computed only when a monitor wants it). */
bool gossip_stats_wanted(gossip_t *g);
/* Publishes figures (copied). Call when gossip_stats_wanted, or now and
 * then; it answers the STATS requests waiting for them. */
void gossip_stats_publish(gossip_t *g, const struct gossip_peer_stats *s);
/* The cluster-wide sketch seed (derived from the cluster key, so every
 * member and monitor agrees without configuration) and bucket count. */
uint64_t gossip_sketch_seed(const gossip_t *g);
int gossip_sketch_k(const gossip_t *g);

/* ---- figures (any thread) ---- */

struct gossip_stats {
  uint64_t exchanges_ok, exchanges_failed, exchanges_rejected;
  uint64_t exchange_requests; /* requests we sent */
  uint64_t exchange_refusals; /* requests partners refused (busy, not ready) */
  uint64_t exchange_idle;     /* snapshots that found no free partner */
  char last_failure[128];
  double last_exchange_age_s; /* -1 before the first */
  uint64_t members_alive, members_suspect, members_failed, members_left;
  uint64_t bytes_in, bytes_out;
  uint64_t dead_verdicts; /* connections closed on the heartbeat's verdict (net_stats.dead_verdicts) */
  uint64_t donations;
  uint64_t exchange_rate_limited; /* partners' requests refused by our rate limit */
  uint64_t conn_rate_limited;     /* connections closed by our rate limit */
  /* The last applied exchange's parameters on the wire, each way: encoded
   * payload bytes (net_dtype_bytes of the count in the sender's wire
   * dtype; frame headers and tags, about 40 bytes a MiB, left out). 0
   * before the first. */
  uint64_t exchange_bytes_sent, exchange_bytes_received;
  /* Relays: our open connections that run over one and their bytes (in +
   * out, inside bytes_in/out's wire bytes); as a relay, the bytes we
   * forwarded and the circuits open through us; the relay we are reached
   * through ("" when dialed directly). */
  uint64_t relayed_links, relayed_bytes, relay_bytes, relay_circuits;
  char via[128];
};
void gossip_stats_get(gossip_t *g, struct gossip_stats *s);

/* A member as seen from here (for monitoring and tests). */
struct gossip_member_view {
  char id[NET_PUBKEY_STR_LEN + 1];
  char addr[128];
  const char *role;  /* "peer" or "bootstrap" */
  const char *state; /* "alive", "suspect", "failed", "left" */
  uint64_t incarnation;
  bool ready; /* holds a state: trains, exchanges and donates */
  bool self;
  /* Known to have finished training (its exchange transfer said so, or a
   * partner's listed it); always false before we called gossip_finished. */
  bool finished;
  /* We rejected its parameters and have not applied an exchange with it
   * since (strikes, gossip/guard.c): while we linger we do not wait for
   * it. Always false before we called gossip_finished. */
  bool struck;
};
/* Copies up to `max` members (self first); returns how many there are. */
size_t gossip_members(gossip_t *g, struct gossip_member_view *out, size_t max);

#endif /* RUMOR_GOSSIP_H */
