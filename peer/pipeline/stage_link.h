/*
 * stage_link — the connections between neighbouring stages of one peer
 * group: activations travel forward (stage s → s+1), their gradients
 * backward (s+1 → s), over net/'s authenticated, encrypted transport.
 *
 * Admission: the same cluster key as the gossip cluster, and identities
 * derived from the group's identity (BLAKE2b keyed with its secret seed, one
 * Ed25519 key per stage index). Each side admits exactly the neighbours'
 * derived keys (an allow-list of one or two), so only processes holding the
 * group's identity file can take part in its pipeline. After the handshake
 * the dialer (stage s+1) sends HELLO with the group name, its stage, the
 * stage count and an agreement text (model, split, schedule, batch, seeds,
 * ...); stage s answers OK only when all of them match its own, else both
 * fail with the difference in the message.
 *
 * Liveness: PINGs every quarter of idle_timeout_ms (at most every second);
 * a neighbour silent for idle_timeout_ms, a connection lost, or a neighbour's ABORT fails the link. A failed link
 * records which stage failed and why (the first failure wins), and every
 * wait below returns at once with that message, so a dead stage stops its
 * whole group.
 *
 * Threads: the link runs its own libuv loop on its own thread. Every
 * stage_link_* function is for one other thread (the stage's training
 * thread). Waits block that thread; while they wait, the idle callback (if
 * set) runs on it every IDLE_MS, so gossip donations are still served.
 */
#ifndef RUMOR_PEER_STAGE_LINK_H
#define RUMOR_PEER_STAGE_LINK_H

#include <stdatomic.h>

#include "net/net.h"

typedef struct stage_link stage_link_t;

#define STAGE_LINK_GROUP_MAX 64    /* characters in a group name */
#define STAGE_LINK_AGREE_MAX 1024  /* characters in the agreement text */
#define STAGE_LINK_IDLE_MS 10      /* the idle callback's period while waiting */

enum stage_link_dir { STAGE_LINK_PREV = 0, STAGE_LINK_NEXT = 1 };

/* What a transfer carries (pinned: they travel in the transfer metadata). */
enum stage_link_kind {
  STAGE_LINK_ACT = 1,  /* training activations, forward */
  STAGE_LINK_GRAD = 2, /* gradients of those activations, backward */
  STAGE_LINK_EVAL = 3, /* evaluation activations, forward */
};

struct stage_link_config {
  const struct net_identity *identity; /* the group's identity; copied */
  const uint8_t *cluster_key;          /* copied */
  const char *group;                   /* the group's name (printable, at most STAGE_LINK_GROUP_MAX) */
  int stage, stages;
  const char *listen;    /* "host:port" the next stage dials (port 0: any); unused by the last stage */
  const char *prev;      /* the previous stage's address; required unless stage 0 */
  const char *agreement; /* what both neighbours must hold identical */
  int64_t in_width;      /* floats per row arriving from the previous stage (and sent back to it) */
  int64_t out_width;     /* floats per row sent to the next stage (and arriving back from it) */
  int64_t max_rows;      /* the most rows one transfer may carry */
  uint32_t connect_timeout_ms; /* neighbours must connect and agree within this */
  uint32_t idle_timeout_ms;    /* a connected neighbour silent this long is lost */
  const atomic_int *stop;      /* polled by waits: non-zero ends them (a stop signal); may be NULL */
};

/* Where training starts, sent from stage 0 down the pipeline so that every
 * stage runs the same steps (stages may pull their states from different
 * groups when they join). */
struct stage_link_pos {
  int64_t step, epoch, samples;
};

/* Listens (unless the last stage), starts dialing the previous stage
 * (unless the first) and returns at once. Returns 0, or a negative code
 * with a message (bad address, cannot listen). */
int stage_link_start(stage_link_t **out, const struct stage_link_config *cfg, struct rumor_err *e) RUMOR_MUST_CHECK;
/* The address the next stage dials ("127.0.0.1:40123"); "" for the last. */
const char *stage_link_address(const stage_link_t *l);
/* Sets the callback run every STAGE_LINK_IDLE_MS while a wait blocks. */
void stage_link_set_idle(stage_link_t *l, void (*idle)(void *arg), void *arg);

/* Waits until every neighbour is connected and has agreed. Returns 0, or a
 * negative code with the failure (or the stop) in `e`. */
int stage_link_wait_ready(stage_link_t *l, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Sends rows × width floats from `data` (copied before this returns) to
 * the neighbour in `dir`, tagged with kind, step and micro-batch. Never
 * blocks. Returns 0, or a negative code with a message when the link has
 * failed (nothing is sent then). */
int stage_link_send(stage_link_t *l, enum stage_link_dir dir, enum stage_link_kind kind, int64_t step, int32_t mb,
                    int64_t rows, const float *data, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Waits for the transfer (kind, step, mb) from the neighbour in `dir` and
 * hands it over: *data (malloc'd, rows × width floats; the caller frees it)
 * and *rows. *waited_s (may be NULL) gets the seconds spent blocked.
 * Returns 0, or a negative code with the failure in `e`. */
int stage_link_recv(stage_link_t *l, enum stage_link_dir dir, enum stage_link_kind kind, int64_t step, int32_t mb,
                    float **data, int64_t *rows, double *waited_s, struct rumor_err *e) RUMOR_MUST_CHECK;

/* Stage 0 sends the starting position to stage 1; every other stage
 * receives it from its previous stage and passes it on. */
int stage_link_send_start(stage_link_t *l, const struct stage_link_pos *pos, struct rumor_err *e) RUMOR_MUST_CHECK;
int stage_link_recv_start(stage_link_t *l, struct stage_link_pos *pos, struct rumor_err *e) RUMOR_MUST_CHECK;

/* True once the link has failed; *stage and why[0..n) say which stage and
 * what happened (the stage may be this one, after stage_link_abort). */
bool stage_link_failed(stage_link_t *l, int *stage, char *why, size_t n);
/* Tells every connected neighbour that the group stops because `stage`
 * failed (or stopped) for `why`, and fails the link here too, unless it had
 * already failed. Best effort; never blocks. */
void stage_link_abort(stage_link_t *l, int stage, const char *why);

/* Waits (at most flush_ms) until every transfer sent has been confirmed by
 * its receiver, then closes the connections gracefully, stops the loop
 * thread and frees everything. NULL is a no-op. */
void stage_link_close(stage_link_t *l, uint32_t flush_ms);

#endif /* RUMOR_PEER_STAGE_LINK_H */
