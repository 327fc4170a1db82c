/* The part of comm's transports that they share: a member's inbox of
 * received messages, the blocking receive and the failure record. */
#include "peer/group/comm_impl.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

/* How often a blocked receive looks at the stop flag (only when there is
 * one: the flag is set by a signal handler, which cannot signal a condition
 * variable). */
#define STOP_POLL_MS 50
#define IDLE_POLL_MS 2

void comm_transport_init(struct comm_transport *t, const struct comm_transport_ops *ops, int rank, int size,
                         pthread_mutex_t *mu, pthread_cond_t *cond) {
  RUMOR_ASSERT(size >= 1 && size <= COMM_MAX_MEMBERS && rank >= 0 && rank < size);
  t->ops = ops;
  t->rank = rank;
  t->size = size;
  t->mu = mu;
  t->cond = cond;
  t->stop = NULL;
  t->head = xcalloc((size_t)size, sizeof *t->head);
  t->tail = xcalloc((size_t)size, sizeof *t->tail);
  t->gone = xcalloc((size_t)size, sizeof *t->gone);
  t->label = xcalloc((size_t)size, sizeof *t->label);
  for (int r = 0; r < size; r++) snprintf(t->label[r], sizeof t->label[r], "group member %d", r);
  t->queued_msgs = 0;
  t->queued_bytes = 0;
  memset(t->pool, 0, sizeof t->pool);
  memset(t->pool_cap, 0, sizeof t->pool_cap);
  t->pool_bytes = 0;
  t->failed = false;
  t->fail_member = -1;
  t->fail_code = 0;
  t->why[0] = '\0';
}

void comm_transport_destroy(struct comm_transport *t) {
  for (int r = 0; r < t->size; r++)
    for (struct comm_msg *m = t->head[r], *nx; m; m = nx) {
      nx = m->next;
      free(m);
    }
  for (int i = 0; i < COMM_POOL_SLOTS; i++) free(t->pool[i]);
  free(t->head);
  free(t->tail);
  free(t->gone);
  free(t->label);
}

void comm_transport_set_addr_locked(struct comm_transport *t, int r, const char *addr) {
  snprintf(t->label[r], sizeof t->label[r], "group member %d (%s)", r, addr);
}

static void vfail_locked(struct comm_transport *t, int member, int code, const char *fmt, va_list ap) {
  if (!t->failed) {
    t->failed = true;
    t->fail_member = member;
    t->fail_code = code;
    vsnprintf(t->why, sizeof t->why, fmt, ap);
  }
  pthread_cond_broadcast(t->cond);
}

void comm_transport_fail_locked(struct comm_transport *t, int member, int code, const char *fmt, ...) {
  va_list ap;
  va_start(ap, fmt);
  vfail_locked(t, member, code, fmt, ap);
  va_end(ap);
}

void comm_transport_fail(struct comm_transport *t, int member, int code, const char *fmt, ...) {
  pthread_mutex_lock(t->mu);
  va_list ap;
  va_start(ap, fmt);
  vfail_locked(t, member, code, fmt, ap);
  va_end(ap);
  pthread_mutex_unlock(t->mu);
}

int comm_transport_failure_locked(const struct comm_transport *t, struct rumor_err *e) {
  return rumor_err_set(e, t->fail_code, "%s", t->why);
}

int comm_transport_check(struct comm_transport *t, struct rumor_err *e) {
  pthread_mutex_lock(t->mu);
  int rc = t->failed ? comm_transport_failure_locked(t, e) : 0;
  pthread_mutex_unlock(t->mu);
  return rc;
}

void comm_transport_push_locked(struct comm_transport *t, int src, struct comm_msg *m) {
  m->next = NULL;
  if (t->tail[src]) t->tail[src]->next = m;
  else t->head[src] = m;
  t->tail[src] = m;
  t->queued_msgs++;
  t->queued_bytes += m->h.bytes;
  pthread_cond_broadcast(t->cond);
}

void comm_transport_gone_locked(struct comm_transport *t, int src) {
  t->gone[src] = true;
  pthread_cond_broadcast(t->cond);
}

/* Unlinks and returns the oldest message from `src` under `tag`, or NULL.
 * *mu held. */
static struct comm_msg *take_locked(struct comm_transport *t, int src, uint64_t tag) {
  struct comm_msg *prev = NULL, *m = t->head[src];
  while (m && m->tag != tag) prev = m, m = m->next;
  if (!m) return NULL;
  if (prev) prev->next = m->next;
  else t->head[src] = m->next;
  if (t->tail[src] == m) t->tail[src] = prev;
  t->queued_msgs--;
  t->queued_bytes -= m->h.bytes;
  m->next = NULL;
  return m;
}

/* Waits on the condition; with a stop flag, wakes every STOP_POLL_MS to
 * look at it, with an idle function every IDLE_POLL_MS to run it. *mu
 * held. */
static void wait_locked(struct comm_transport *t, const struct comm_idle *idle) {
  if (!t->stop && !idle) {
    pthread_cond_wait(t->cond, t->mu);
    return;
  }
  struct timespec ts;
  clock_gettime(CLOCK_REALTIME, &ts);
  ts.tv_nsec += (idle ? IDLE_POLL_MS : STOP_POLL_MS) * 1000000L;
  if (ts.tv_nsec >= 1000000000L) ts.tv_sec++, ts.tv_nsec -= 1000000000L;
  pthread_cond_timedwait(t->cond, t->mu, &ts);
}

int comm_transport_recv(struct comm_transport *t, int src, uint64_t tag, const struct comm_idle *idle,
                        struct comm_msg **out, struct rumor_err *e) {
  RUMOR_ASSERT(src >= 0 && src < t->size && src != t->rank);
  *out = NULL;
  int rc = 0;
  pthread_mutex_lock(t->mu);
  for (;;) {
    if (t->failed) {
      rc = comm_transport_failure_locked(t, e);
      break;
    }
    if ((*out = take_locked(t, src, tag))) break;
    if (t->gone[src]) {
      comm_transport_fail_locked(t, src, -ECONNRESET, "%s left the group (closed its communicator) while %s waited for it",
                                 t->label[src], t->label[t->rank]);
      rc = comm_transport_failure_locked(t, e);
      break;
    }
    if (t->stop && atomic_load(t->stop)) {
      comm_transport_fail_locked(t, t->rank, RUMOR_ECANCELED, "%s was stopped (signal %d)", t->label[t->rank],
                                 (int)atomic_load(t->stop));
      rc = comm_transport_failure_locked(t, e);
      break;
    }
    wait_locked(t, idle);
    if (idle && !t->failed && !(*out = take_locked(t, src, tag))) {
      pthread_mutex_unlock(t->mu); /* idle->fn may take long: the transport's threads go on meanwhile */
      idle->fn(idle->arg);
      pthread_mutex_lock(t->mu);
    }
    if (*out) break;
  }
  pthread_mutex_unlock(t->mu);
  return rc;
}

void *comm_pool_get(struct comm_transport *t, size_t bytes, size_t *cap) {
  if (bytes >= COMM_POOL_MIN_BYTES) {
    /* The smallest spare that fits and wastes at most half of itself. */
    int best = -1;
    pthread_mutex_lock(t->mu);
    for (int i = 0; i < COMM_POOL_SLOTS; i++)
      if (t->pool[i] && t->pool_cap[i] >= bytes && t->pool_cap[i] / 2 <= bytes &&
          (best < 0 || t->pool_cap[i] < t->pool_cap[best]))
        best = i;
    void *p = NULL;
    if (best >= 0) {
      p = t->pool[best];
      *cap = t->pool_cap[best];
      t->pool[best] = NULL;
      t->pool_bytes -= *cap;
    }
    pthread_mutex_unlock(t->mu);
    if (p) return p;
  }
  *cap = bytes;
  return malloc(bytes);
}

void comm_pool_put(struct comm_transport *t, void *p, size_t cap) {
  if (p && cap >= COMM_POOL_MIN_BYTES) {
    pthread_mutex_lock(t->mu);
    for (int i = 0; i < COMM_POOL_SLOTS && p; i++)
      if (!t->pool[i] && t->pool_bytes + cap <= COMM_POOL_MAX_BYTES) {
        t->pool[i] = p;
        t->pool_cap[i] = cap;
        t->pool_bytes += cap;
        p = NULL;
      }
    pthread_mutex_unlock(t->mu);
  }
  free(p);
}

struct comm_msg *comm_msg_alloc(struct comm_transport *t, uint64_t bytes) {
  uint64_t floats = (bytes + sizeof(float) - 1) / sizeof(float);
  if (floats == 0) floats = 1;
  if (floats > (SIZE_MAX - sizeof(struct comm_msg)) / sizeof(float)) return NULL;
  size_t cap;
  struct comm_msg *m = comm_pool_get(t, sizeof(struct comm_msg) + (size_t)floats * sizeof(float), &cap);
  if (m) {
    m->next = NULL;
    m->cap = cap;
  }
  return m;
}

void comm_msg_free(struct comm_transport *t, struct comm_msg *m) {
  if (m) comm_pool_put(t, m, m->cap);
}
