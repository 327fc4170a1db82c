/*
 * comm_impl — the private seam between comm's collectives (comm.c) and its
 * transports (comm_local.c: threads of one process; comm_net.c: a full mesh
 * over net/).
 *
 * A transport moves messages between the members of one group: a header
 * (struct comm_hdr) and a payload of bytes, addressed by the destination's
 * rank and a wire tag (one per communicator: 0 for the group, a
 * sub-communicator's tag path below it). Each (source, tag) is a FIFO. The
 * receiving side is common to every transport: it delivers into this
 * member's inbox (comm_transport_push_locked) and the collectives wait on it
 * (comm_transport_recv), so a transport is its send, abort and free.
 *
 * Threads: the collectives' thread calls send, recv, abort; a transport may
 * push, fail and mark members gone from any thread, under *mu.
 */
#ifndef RUMOR_PEER_GROUP_COMM_IMPL_H
#define RUMOR_PEER_GROUP_COMM_IMPL_H

#include <pthread.h>

#include "peer/group/comm.h"

#define COMM_WHY_MAX 400  /* bytes of a failure's message, NUL included */
#define COMM_LABEL_MAX 96 /* bytes of a member's label, NUL included */
/* Large message buffers are kept for reuse (a fresh one costs a page fault
 * per 4 KiB, more than the copy into it): at most this many, of at least
 * COMM_POOL_MIN_BYTES each, COMM_POOL_MAX_BYTES in all, per member. */
#define COMM_POOL_SLOTS 8
#define COMM_POOL_MIN_BYTES (256u << 10)
#define COMM_POOL_MAX_BYTES (512ull << 20)

/* What a collective's message says about itself, so that members whose
 * calls disagree find out instead of mixing up buffers. */
enum comm_kind {
  COMM_KIND_ALL_REDUCE = 1,
  COMM_KIND_REDUCE_SCATTER = 2,
  COMM_KIND_ALL_GATHER = 3,
  COMM_KIND_ALL_TO_ALL = 4,
  COMM_KIND_BARRIER = 5,
  COMM_KIND_BROADCAST = 6,
  COMM_KIND__MAX = COMM_KIND_BROADCAST,
};
_Static_assert(COMM_KIND_ALL_REDUCE == 1 && COMM_KIND_REDUCE_SCATTER == 2 && COMM_KIND_ALL_GATHER == 3 &&
                   COMM_KIND_ALL_TO_ALL == 4 && COMM_KIND_BARRIER == 5 && COMM_KIND_BROADCAST == 6,
               "collective kinds travel on the wire");

struct comm_hdr {
  uint64_t seq;   /* the sender communicator's collective number (0, 1, ...) */
  uint32_t kind;  /* enum comm_kind */
  uint32_t step;  /* round within the collective */
  int64_t total;  /* floats of the whole collective (bytes for a broadcast; 0 for all-to-all) */
  uint64_t shape; /* a digest of the counts (_v forms), the root (broadcast), else 0 */
  uint64_t bytes; /* payload bytes of this message */
};

/* One received message. The payload follows the struct (float-aligned);
 * whoever holds it frees it with comm_msg_free. */
struct comm_msg {
  struct comm_msg *next;
  size_t cap; /* bytes of the allocation (comm_pool_get's) */
  uint64_t tag;
  struct comm_hdr h;
  float data[];
};

/* What a waiting receiver runs meanwhile (comm_set_idle). */
struct comm_idle {
  void (*fn)(void *arg);
  void *arg;
};

struct comm_transport;
struct comm_transport_ops {
  /* Queues a copy of data[0..h->bytes) for member `dst` (!= this one) under
   * `tag`; never waits for the receiver. Returns 0, or a negative code with
   * a message (the transport has failed). */
  int (*send)(struct comm_transport *t, int dst, uint64_t tag, const struct comm_hdr *h, const void *data,
              struct rumor_err *e);
  /* Waits for the next message from `src` under `tag` (see
   * comm_transport_recv, which both transports use). */
  int (*recv)(struct comm_transport *t, int src, uint64_t tag, const struct comm_idle *idle, struct comm_msg **out,
              struct rumor_err *e);
  /* Tells every other member that the group failed, blaming `member` with
   * `code` and `why`. Best effort; never blocks. */
  void (*abort)(struct comm_transport *t, int member, int code, const char *why);
  /* Optional: waits until every member is connected (NULL: always ready). */
  int (*wait_ready)(struct comm_transport *t, struct rumor_err *e);
  /* Optional: the address members above this one dial (NULL: none). */
  const char *(*address)(const struct comm_transport *t);
  /* Frees the transport (and the common part, comm_transport_destroy). */
  void (*free)(struct comm_transport *t, uint32_t flush_ms);
};

/* The part every transport has: this member, its inbox and its failure. */
struct comm_transport {
  const struct comm_transport_ops *ops;
  int rank, size;
  pthread_mutex_t *mu; /* guards everything below; may be shared between transports (local) */
  pthread_cond_t *cond; /* signalled on a new message, a member gone, a failure */
  const atomic_int *stop; /* polled while blocked (NULL: never) */

  /* Under *mu. */
  struct comm_msg **head, **tail; /* per source rank: messages received, oldest first */
  bool *gone;                     /* per source rank: it left the group (closed gracefully) */
  char (*label)[COMM_LABEL_MAX];  /* per rank: "group member 2 (127.0.0.1:40123)" for messages */
  size_t queued_msgs;
  uint64_t queued_bytes;
  void *pool[COMM_POOL_SLOTS]; /* spare buffers, NULL or pool_cap[i] bytes */
  size_t pool_cap[COMM_POOL_SLOTS];
  uint64_t pool_bytes;
  bool failed;
  int fail_member; /* rank in the group */
  int fail_code;
  char why[COMM_WHY_MAX];
};

/* Sets up the common part (mu and cond are the transport's). */
void comm_transport_init(struct comm_transport *t, const struct comm_transport_ops *ops, int rank, int size,
                         pthread_mutex_t *mu, pthread_cond_t *cond);
/* Frees queued messages and the arrays (not mu or cond). */
void comm_transport_destroy(struct comm_transport *t);

/* Records the first failure (later ones are ignored) and wakes the waiters.
 * The _locked form wants *mu held. Any thread. */
void comm_transport_fail(struct comm_transport *t, int member, int code, const char *fmt, ...) RUMOR_PRINTF(4, 5);
void comm_transport_fail_locked(struct comm_transport *t, int member, int code, const char *fmt, ...)
    RUMOR_PRINTF(4, 5);
/* Sets member `r`'s label to "group member R (addr)"; *mu held. */
void comm_transport_set_addr_locked(struct comm_transport *t, int r, const char *addr);
/* The failure as a return code with its message in `e`; *mu held. */
int comm_transport_failure_locked(const struct comm_transport *t, struct rumor_err *e);
/* 0, or the failure (takes *mu). */
int comm_transport_check(struct comm_transport *t, struct rumor_err *e);
/* Appends a received message from `src` to the inbox and wakes the
 * waiters; takes ownership of m. *mu held. */
void comm_transport_push_locked(struct comm_transport *t, int src, struct comm_msg *m);
/* Member `src` left the group gracefully: a recv that waits on it with
 * nothing queued fails naming it. *mu held. */
void comm_transport_gone_locked(struct comm_transport *t, int src);
/* The common blocking receive (the ops' recv for both transports): the
 * oldest message from `src` under `tag`, else waits for one, the failure,
 * `src` gone, or the stop flag; with `idle` (else NULL), runs idle->fn
 * every IDLE_POLL_MS while it waits, *mu released. */
int comm_transport_recv(struct comm_transport *t, int src, uint64_t tag, const struct comm_idle *idle,
                        struct comm_msg **out, struct rumor_err *e);
/* A buffer of at least `bytes` (its size in *cap) from t's spares or
 * malloc, or NULL when out of memory; comm_pool_put gives it back (or frees
 * it). Any thread; they take *mu, which must not be held. */
void *comm_pool_get(struct comm_transport *t, size_t bytes, size_t *cap);
void comm_pool_put(struct comm_transport *t, void *p, size_t cap);
/* A message able to hold `bytes` of payload (rounded up to whole floats, at
 * least one) from t's pool, or NULL when out of memory; comm_msg_free
 * gives it back to the pool of the transport that frees it. */
struct comm_msg *comm_msg_alloc(struct comm_transport *t, uint64_t bytes);
void comm_msg_free(struct comm_transport *t, struct comm_msg *m);

/* Wraps a transport into the group's top-level communicator (which frees
 * it in comm_free). */
comm_t *comm_create_top(struct comm_transport *t);

#endif /* RUMOR_PEER_GROUP_COMM_IMPL_H */
