/*
 * comm — a group communicator: collectives among the processes that hold
 * one replica together (a peer group's tensor-parallel, data-parallel /
 * ZeRO and, next, expert members), over net/'s authenticated, encrypted
 * transport.
 *
 * Two layers, one header:
 *   transport  point-to-point messages between the N members of a group,
 *              each (source, tag) a FIFO: over net/ (a full mesh of
 *              connections, one process per member), or in one process
 *              (threads, for tests);
 *   collectives all-reduce (sum), reduce-scatter, all-gather and
 *              all-to-all on host float buffers, over any transport and
 *              any subset of its members (a sub-communicator: the members
 *              of a group that share a tensor-parallel or a data-parallel
 *              axis).
 *
 * Sizes that do not divide: a collective over n floats cuts them into one
 * contiguous chunk per member, comm_chunk's (the first n mod size members
 * get one float more); the _v forms take explicit per-member counts
 * (zero allowed) instead.
 *
 * Algorithms: when a member's piece is at most COMM_DIRECT_MAX_BYTES a
 * collective sends every member's piece straight to every other member
 * (one round, size − 1 messages each); above it a ring (size − 1 rounds of
 * reduce-scatter and size − 1 of all-gather, each member sending
 * 2(size − 1)/size of the buffer in all). A member's piece is what the
 * direct form sends one other member: the whole buffer for all-reduce, the
 * largest chunk for reduce-scatter and all-gather, the buffer for a
 * broadcast (above the limit a broadcast runs down the chain root,
 * root + 1, ... in 1 MiB segments). All-to-all is always direct. Every
 * member ends with bit-identical results (members of a data-parallel group
 * must hold identical parameters): the direct all-reduce sums the members'
 * buffers in member order 0, 1, ... on every member, and the ring reduces
 * each chunk once, at its owner, then hands it out as it is. The ring's
 * result is the same within float rounding as a sum in member order, not
 * bit-identical to it.
 *
 * Mismatches: every message carries the collective's number on its
 * communicator, its kind, its size and a digest of the counts, checked on
 * receipt; members whose calls differ (another collective, another n,
 * another cut, all-to-all counts that disagree) fail with RUMOR_EPROTO
 * naming both sides. A broadcast whose members name different roots may
 * wait for the stop flag or a failure instead: no member sends what the
 * others wait for.
 *
 * Failure: a member that dies, closes its connections, is silent past the
 * transport's dead-after time or sends a malformed message fails the
 * communicator: every call then returns at once with the failure's code
 * (-ECONNRESET for a member lost, RUMOR_ETIMEDOUT for one silent,
 * RUMOR_EPROTO for a malformed message) and a message naming the culprit
 * member and why, and
 * comm_failed says who. comm_abort tells the other members that this one
 * stops, and why (they fail with RUMOR_ECANCELED). A member that leaves
 * (comm_free) fails the others' collectives that still wait for it
 * (-ECONNRESET, "... left the group").
 *
 * CUDA: collectives take host buffers; a caller whose tensors live on a
 * device copies them through pinned host memory (tensor_host_alloc), on a
 * copy stream where it can overlap them with the transfer (ZeRO's
 * segments: peer/train/zero.c).
 *
 * Threads: a communicator belongs to one thread, the one that calls its
 * collectives; they block it. Distinct communicators of one group (the
 * group's and its sub-communicators) may run on distinct threads at once:
 * their traffic never mixes. comm_failed, comm_abort and comm_bytes may be
 * called from any thread. The net transport runs its connections on a loop
 * thread of its own.
 */
#ifndef RUMOR_PEER_GROUP_COMM_H
#define RUMOR_PEER_GROUP_COMM_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>

#include "net/net.h"
#include "util/util.h"

#define COMM_MAX_MEMBERS 256
#define COMM_DIRECT_MAX_BYTES (64 << 10) /* per member's piece: direct below, ring above */

typedef struct comm comm_t;

/* ---- transports ---- */

/* N communicators in this process, one per member (comms[i] is member
 * i's), each to be used from its own thread. For tests and for a group of
 * threads. Free each with comm_free. */
void comm_local_create(int size, comm_t **comms);

struct comm_net_config {
  const struct net_identity *identity; /* the group's identity: each member proves a key derived from it
                                          for its index (BLAKE2b keyed with its seed), and admits exactly
                                          the other members' derived keys */
  const uint8_t *cluster_key;          /* the gossip cluster's key */
  const char *group;                   /* the group's name, checked between members */
  const char *agreement;               /* text every member must hold identical (model, layout, ...;
                                          printable, at most 4096 characters); a mismatch fails the
                                          start with RUMOR_EPROTO naming both texts' first difference */
  int rank, size;
  int key_base;                /* the derived keys are those of indices key_base + 0 .. size − 1: 0 for a
                                  group's one communicator; a group of several communicators (a pipeline's
                                  stages, each with data-parallel members) gives each a distinct range, so
                                  a member of one never admits a member of another (0 .. 65535 − size) */
  const char *listen;          /* "host:port" the members above this one dial (port 0: any;
                                  NULL: "127.0.0.1:0") */
  const char *const *peers;    /* peers[j], j < rank: member j's address, dialed by this one */
  uint32_t connect_timeout_ms; /* every member must be connected and agree within this (0: 30 s) */
  uint32_t heartbeat_ms, dead_after_ms; /* net's heartbeat: a member whose loop stops is lost
                                           (0: 250 ms and 2000 ms) */
  const atomic_int *stop;      /* polled while blocked: non-zero ends the call with RUMOR_ECANCELED */
};

/* Listens (cfg->listen), then returns at once; the connections are made
 * on the transport's loop thread. comm_net_address gives the address to
 * hand to the members above. Returns 0 or a negative code with a message
 * (bad address, cannot listen, bad config). */
int comm_net_start(comm_t **out, const struct comm_net_config *cfg, struct rumor_err *e) RUMOR_MUST_CHECK;
/* "127.0.0.1:40123": where this member listens (the listen address's host
 * with the bound port; a listen address ":0" gives ":40123", whose host the
 * caller fills in). "" for an in-process communicator. */
const char *comm_net_address(const comm_t *c);
/* Waits until every member is connected and has agreed (or fails: a
 * member refused the handshake, RUMOR_EAUTH; one that did not connect in
 * time, RUMOR_ETIMEDOUT; a differing configuration, RUMOR_EPROTO). The
 * collectives need not wait for it: what they send waits for the
 * connection. Returns at once for an in-process communicator. */
int comm_wait_ready(comm_t *c, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Frees a communicator: a net one flushes what it sent (at most
 * flush_ms), closes its connections and stops its thread. Sub-communicators
 * must be freed first. NULL is a no-op. */
void comm_free(comm_t *c, uint32_t flush_ms);

/* ---- members and sub-communicators ---- */

int comm_rank(const comm_t *c);
int comm_size(const comm_t *c);
/* A communicator over members[0..n) of `parent` (ranks of the parent, in
 * the order given: the new ranks). Every one of them must create it with
 * the same list and `tag` (1..65535, distinct among the parent's live
 * sub-communicators) before its first collective; traffic of different
 * sub-communicators never mixes. The caller must be in the list. A wrong
 * list or tag is a broken invariant (an assert). Sub-communicators nest at
 * most 4 levels below the group. Failure is the group's: a failed group
 * fails every communicator over it. */
comm_t *comm_sub(comm_t *parent, const int *members, int n, uint32_t tag);

/* Chunk r of n floats cut into `size` contiguous chunks: [*lo, *hi). */
void comm_chunk(int64_t n, int size, int r, int64_t *lo, int64_t *hi);

/* ---- collectives (every member calls the same ones in the same order) ---- */

/* buf[0..n) ← the sum over members of their buf. */
int comm_all_reduce(comm_t *c, float *buf, int64_t n, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Member r's chunk of buf (counts[r] floats at offset Σ counts[<r]) ← the
 * sum over members of that chunk; the rest of buf is left undefined. */
int comm_reduce_scatter_v(comm_t *c, float *buf, const int64_t *counts, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Every member's chunk (counts[r] floats at offset Σ counts[<r], as member
 * r holds it) into every member's buf. */
int comm_all_gather_v(comm_t *c, float *buf, const int64_t *counts, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The same with comm_chunk's even cut of n floats. */
int comm_reduce_scatter(comm_t *c, float *buf, int64_t n, struct rumor_err *e) RUMOR_MUST_CHECK;
int comm_all_gather(comm_t *c, float *buf, int64_t n, struct rumor_err *e) RUMOR_MUST_CHECK;
/* send holds size runs, run j (send_counts[j] floats, in order) for member
 * j; recv gets size runs, run j (recv_counts[j] floats) from member j. The
 * counts must agree (member i's send_counts[j] == member j's
 * recv_counts[i]; a mismatch fails with RUMOR_EPROTO naming both). */
int comm_all_to_all(comm_t *c, const float *send, const int64_t *send_counts, float *recv,
                    const int64_t *recv_counts, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Every member's n floats (its own n: they may differ) into member root's
 * recv, member j's at offset Σ counts[<j] (counts: every member's n, read
 * on root only; recv and counts may be NULL elsewhere). Only root holds
 * them all (an all-to-all in which only root receives). */
int comm_gather_v(comm_t *c, int root, const float *send, int64_t n, float *recv, const int64_t *counts,
                  struct rumor_err *e) RUMOR_MUST_CHECK;
/* Waits until every member has called it. */
int comm_barrier(comm_t *c, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Member root's bytes[0..len) into every member's. */
int comm_broadcast(comm_t *c, int root, void *bytes, int64_t len, struct rumor_err *e) RUMOR_MUST_CHECK;

/* ---- failure ---- */

/* True once the communicator has failed: *member (rank in the top-level
 * group) and why[0..n) say who and what happened. */
bool comm_failed(comm_t *c, int *member, char *why, size_t n);
/* Tells every member that this one stops, for `why`, and fails the
 * communicator here. Best effort; never blocks. */
void comm_abort(comm_t *c, const char *why);

/* While this member's collectives on c wait for another member, fn(arg)
 * runs every few milliseconds on the waiting thread (the one that calls
 * c's collectives; fn NULL: nothing, the default). For work that must go
 * on while the group waits, such as serving a state another group's
 * process pulls. */
void comm_set_idle(comm_t *c, void (*fn)(void *arg), void *arg);

/* Bytes this member sent and received in collectives so far (payload,
 * before encryption): for the bytes-per-step figures. */
void comm_bytes(const comm_t *c, uint64_t *sent, uint64_t *received);

#endif /* RUMOR_PEER_GROUP_COMM_H */
