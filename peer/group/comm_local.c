/* comm's in-process transport: N members as threads of one process. A send
 * copies the payload into a message and appends it to the destination's
 * inbox under the hub's one mutex; it never waits for the receiver. */
#include "peer/group/comm_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

struct local_hub;

/* One member's end. `t` first: the transport pointer is the endpoint. */
struct local_ep {
  struct comm_transport t;
  struct local_hub *hub;
  pthread_cond_t cond;
};

/* What the members share. Freed by the last member to leave. */
struct local_hub {
  pthread_mutex_t mu;
  int size;
  int live;               /* members not freed yet; under mu */
  struct local_ep **eps;  /* eps[r]: member r's end, NULL once freed; under mu */
};

static int local_send(struct comm_transport *t, int dst, uint64_t tag, const struct comm_hdr *h, const void *data,
                      struct rumor_err *e) {
  struct local_ep *ep = (struct local_ep *)t;
  struct local_hub *hub = ep->hub;
  RUMOR_ASSERT(dst >= 0 && dst < hub->size && dst != t->rank);
  struct comm_msg *m = comm_msg_alloc(t, h->bytes);
  if (!m) return rumor_err_set(e, -ENOMEM, "out of memory for a message of %llu bytes", (unsigned long long)h->bytes);
  m->tag = tag;
  m->h = *h;
  if (h->bytes) memcpy(m->data, data, (size_t)h->bytes);
  pthread_mutex_lock(&hub->mu);
  int rc = 0;
  if (t->failed) rc = comm_transport_failure_locked(t, e);
  else if (hub->eps[dst]) {
    /* The message is the sender's own; it lands in the receiver's inbox. */
    comm_transport_push_locked(&hub->eps[dst]->t, t->rank, m);
    m = NULL;
  }
  /* A member that left needs nothing more: its message is dropped. */
  pthread_mutex_unlock(&hub->mu);
  comm_msg_free(t, m);
  return rc;
}

static void local_abort(struct comm_transport *t, int member, int code, const char *why) {
  struct local_ep *ep = (struct local_ep *)t;
  struct local_hub *hub = ep->hub;
  pthread_mutex_lock(&hub->mu);
  for (int r = 0; r < hub->size; r++)
    if (hub->eps[r] && r != t->rank)
      comm_transport_fail_locked(&hub->eps[r]->t, member, code, "%s", why);
  pthread_mutex_unlock(&hub->mu);
}

/* Leaves the group: the others' receives from this member fail once they
 * have taken what it sent. */
static void local_free(struct comm_transport *t, uint32_t flush_ms) {
  (void)flush_ms; /* what was sent is in the receivers' inboxes already */
  struct local_ep *ep = (struct local_ep *)t;
  struct local_hub *hub = ep->hub;
  pthread_mutex_lock(&hub->mu);
  hub->eps[t->rank] = NULL;
  for (int r = 0; r < hub->size; r++)
    if (hub->eps[r]) comm_transport_gone_locked(&hub->eps[r]->t, t->rank);
  bool last = --hub->live == 0;
  comm_transport_destroy(t);
  pthread_mutex_unlock(&hub->mu);
  pthread_cond_destroy(&ep->cond);
  free(ep);
  if (last) {
    pthread_mutex_destroy(&hub->mu);
    free(hub->eps);
    free(hub);
  }
}

static const struct comm_transport_ops local_ops = {
    .send = local_send,
    .recv = comm_transport_recv,
    .abort = local_abort,
    .free = local_free,
};

void comm_local_create(int size, comm_t **comms) {
  RUMOR_ASSERT(size >= 1 && size <= COMM_MAX_MEMBERS);
  struct local_hub *hub = xcalloc(1, sizeof *hub);
  pthread_mutex_init(&hub->mu, NULL);
  hub->size = size;
  hub->live = size;
  hub->eps = xcalloc((size_t)size, sizeof *hub->eps);
  for (int r = 0; r < size; r++) {
    struct local_ep *ep = xcalloc(1, sizeof *ep);
    ep->hub = hub;
    pthread_cond_init(&ep->cond, NULL);
    comm_transport_init(&ep->t, &local_ops, r, size, &hub->mu, &ep->cond);
    hub->eps[r] = ep;
  }
  for (int r = 0; r < size; r++) comms[r] = comm_create_top(&hub->eps[r]->t);
}
