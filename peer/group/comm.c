/* comm's collectives and sub-communicators, written once over the
 * transport seam of comm_impl.h. */
#include "peer/group/comm_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* A broadcast above COMM_DIRECT_MAX_BYTES goes down a chain of the members
 * (root, root + 1, ...) in segments of this many bytes, so that every
 * member forwards one segment while it receives the next. */
#define CHAIN_SEGMENT_BYTES (1 << 20)
/* Sub-communicators nest at most this deep: a wire tag holds 16 bits per
 * level. */
#define COMM_MAX_DEPTH 4
/* The most floats one collective takes (bytes must fit an int64). */
#define COMM_MAX_FLOATS (INT64_MAX / 8)

struct comm {
  struct comm_transport *t; /* this member's transport, shared by the group's communicators here */
  struct comm *parent;      /* NULL for the group's own */
  struct comm *children;    /* live sub-communicators; under t->mu */
  struct comm *sibling;     /* next child of parent; under t->mu */
  uint64_t tag;             /* wire tag: 0 for the group, parent's << 16 | own below it */
  uint32_t own_tag;
  int depth;
  int rank, size;
  int *members;  /* members[i]: group rank of this communicator's rank i */
  uint64_t seq;  /* collectives started; the calling thread only */
  _Atomic uint64_t sent, received;
  struct comm_idle idle; /* comm_set_idle's; the calling thread only */
};

/* ---- creation ---- */

comm_t *comm_create_top(struct comm_transport *t) {
  struct comm *c = xcalloc(1, sizeof *c);
  c->t = t;
  c->rank = t->rank;
  c->size = t->size;
  c->members = xmalloc((size_t)t->size * sizeof *c->members);
  for (int i = 0; i < t->size; i++) c->members[i] = i;
  return c;
}

comm_t *comm_sub(comm_t *parent, const int *members, int n, uint32_t tag) {
  RUMOR_ASSERT(parent && members && n >= 1 && n <= parent->size && tag >= 1 && tag <= 65535);
  RUMOR_ASSERT(parent->depth + 1 <= COMM_MAX_DEPTH);
  struct comm *c = xcalloc(1, sizeof *c);
  c->t = parent->t;
  c->parent = parent;
  c->own_tag = tag;
  c->tag = parent->tag << 16 | tag;
  c->depth = parent->depth + 1;
  c->size = n;
  c->rank = -1;
  c->members = xmalloc((size_t)n * sizeof *c->members);
  for (int i = 0; i < n; i++) {
    RUMOR_ASSERT(members[i] >= 0 && members[i] < parent->size);
    for (int k = 0; k < i; k++) RUMOR_ASSERT(members[k] != members[i]); /* each member once */
    if (members[i] == parent->rank) c->rank = i;
    c->members[i] = parent->members[members[i]];
  }
  RUMOR_ASSERT(c->rank >= 0); /* the caller is in the list */
  pthread_mutex_lock(c->t->mu);
  for (struct comm *s = parent->children; s; s = s->sibling) RUMOR_ASSERT(s->own_tag != tag);
  c->sibling = parent->children;
  parent->children = c;
  pthread_mutex_unlock(c->t->mu);
  return c;
}

void comm_free(comm_t *c, uint32_t flush_ms) {
  if (!c) return;
  struct comm_transport *t = c->t;
  pthread_mutex_lock(t->mu);
  RUMOR_ASSERT(!c->children); /* sub-communicators are freed first */
  if (c->parent) {
    struct comm **p = &c->parent->children;
    while (*p != c) p = &(*p)->sibling;
    *p = c->sibling;
  }
  pthread_mutex_unlock(t->mu);
  if (!c->parent) t->ops->free(t, flush_ms);
  free(c->members);
  free(c);
}

int comm_rank(const comm_t *c) { return c->rank; }
int comm_size(const comm_t *c) { return c->size; }

void comm_chunk(int64_t n, int size, int r, int64_t *lo, int64_t *hi) {
  RUMOR_ASSERT(n >= 0 && size >= 1 && r >= 0 && r < size);
  int64_t q = n / size, rem = n % size;
  *lo = r * q + (r < rem ? r : rem);
  *hi = *lo + q + (r < rem ? 1 : 0);
}

/* ---- failure ---- */

bool comm_failed(comm_t *c, int *member, char *why, size_t n) {
  struct comm_transport *t = c->t;
  pthread_mutex_lock(t->mu);
  bool f = t->failed;
  if (f) {
    if (member) *member = t->fail_member;
    if (why && n) snprintf(why, n, "%s", t->why);
  }
  pthread_mutex_unlock(t->mu);
  return f;
}

void comm_abort(comm_t *c, const char *why) {
  struct comm_transport *t = c->t;
  char text[COMM_WHY_MAX];
  snprintf(text, sizeof text, "%s stopped: %s", t->label[t->rank], why ? why : "(no reason given)");
  comm_transport_fail(t, t->rank, RUMOR_ECANCELED, "%s", text);
  t->ops->abort(t, t->rank, RUMOR_ECANCELED, text);
}

void comm_set_idle(comm_t *c, void (*fn)(void *arg), void *arg) { c->idle = (struct comm_idle){fn, arg}; }

void comm_bytes(const comm_t *c, uint64_t *sent, uint64_t *received) {
  if (sent) *sent = atomic_load(&c->sent);
  if (received) *received = atomic_load(&c->received);
}

int comm_wait_ready(comm_t *c, struct rumor_err *e) {
  return c->t->ops->wait_ready ? c->t->ops->wait_ready(c->t, e) : comm_transport_check(c->t, e);
}

const char *comm_net_address(const comm_t *c) {
  return c->t->ops->address ? c->t->ops->address(c->t) : "";
}

/* ---- messages ---- */

static void count_bytes(struct comm *c, uint64_t sent, uint64_t received) {
  for (struct comm *a = c; a; a = a->parent) {
    atomic_fetch_add(&a->sent, sent);
    atomic_fetch_add(&a->received, received);
  }
}

static int xsend(struct comm *c, int dst, const struct comm_hdr *base, uint32_t step, const void *data, uint64_t bytes,
                 struct rumor_err *e) {
  struct comm_hdr h = *base;
  h.step = step;
  h.bytes = bytes;
  int rc = c->t->ops->send(c->t, c->members[dst], c->tag, &h, data, e);
  if (rc == 0) count_bytes(c, bytes, 0);
  return rc;
}

static const char *kind_name(uint32_t kind) {
  switch (kind) {
  case COMM_KIND_ALL_REDUCE: return "all_reduce";
  case COMM_KIND_REDUCE_SCATTER: return "reduce_scatter";
  case COMM_KIND_ALL_GATHER: return "all_gather";
  case COMM_KIND_ALL_TO_ALL: return "all_to_all";
  case COMM_KIND_BARRIER: return "barrier";
  case COMM_KIND_BROADCAST: return "broadcast";
  default: return "an unknown collective";
  }
}

/* "all_reduce of 7 floats (collective #3)", for mismatch messages. */
static void describe(const struct comm_hdr *h, char *buf, size_t n) {
  const char *k = kind_name(h->kind);
  unsigned long long seq = (unsigned long long)h->seq;
  switch (h->kind) {
  case COMM_KIND_ALL_REDUCE: snprintf(buf, n, "%s of %" PRId64 " floats (collective #%llu)", k, h->total, seq); break;
  case COMM_KIND_REDUCE_SCATTER:
  case COMM_KIND_ALL_GATHER:
    snprintf(buf, n, "%s of %" PRId64 " floats, counts digest %016" PRIx64 " (collective #%llu)", k, h->total, h->shape,
             seq);
    break;
  case COMM_KIND_BROADCAST:
    snprintf(buf, n, "%s of %" PRId64 " bytes from member %" PRIu64 " (collective #%llu)", k, h->total, h->shape, seq);
    break;
  default: snprintf(buf, n, "%s (kind %u, collective #%llu)", k, h->kind, seq); break;
  }
}

/* A message from `src` that does not fit this member's call: fails the
 * group here, blaming the sender, and tells the others. Returns
 * RUMOR_EPROTO. */
static int mismatch(struct comm *c, int src, const struct comm_hdr *got, const struct comm_hdr *want,
                    struct rumor_err *e) {
  struct comm_transport *t = c->t;
  const char *them = t->label[c->members[src]], *me = t->label[t->rank];
  char a[160], b[160], why[COMM_WHY_MAX];
  describe(got, a, sizeof a);
  describe(want, b, sizeof b);
  if (got->seq != want->seq || got->kind != want->kind || got->total != want->total || got->shape != want->shape)
    snprintf(why, sizeof why, "collective mismatch: %s called %s, %s called %s", them, a, me, b);
  else if (got->kind == COMM_KIND_ALL_TO_ALL && got->bytes != want->bytes)
    snprintf(why, sizeof why, "all_to_all counts disagree (collective #%llu): %s sends %llu floats to %s, which expects %llu",
             (unsigned long long)got->seq, them, (unsigned long long)(got->bytes / sizeof(float)), me,
             (unsigned long long)(want->bytes / sizeof(float)));
  else
    snprintf(why, sizeof why, "%s: %s sent round %u with %llu bytes, %s expected round %u with %llu bytes", b, them,
             got->step, (unsigned long long)got->bytes, me, want->step, (unsigned long long)want->bytes);
  comm_transport_fail(t, c->members[src], RUMOR_EPROTO, "%s", why);
  t->ops->abort(t, c->members[src], RUMOR_EPROTO, why);
  return comm_transport_check(t, e);
}

/* Receives the next message of this collective from `src`: round `step`,
 * `bytes` of payload. The caller frees *out. */
static int xrecv(struct comm *c, int src, const struct comm_hdr *base, uint32_t step, uint64_t bytes,
                 struct comm_msg **out, struct rumor_err *e) {
  struct comm_msg *m;
  int rc = c->t->ops->recv(c->t, c->members[src], c->tag, c->idle.fn ? &c->idle : NULL, &m, e);
  if (rc) return rc;
  struct comm_hdr want = *base;
  want.step = step;
  want.bytes = bytes;
  const struct comm_hdr *h = &m->h;
  if (h->seq != want.seq || h->kind != want.kind || h->total != want.total || h->shape != want.shape ||
      h->step != want.step || h->bytes != want.bytes) {
    rc = mismatch(c, src, h, &want, e);
    comm_msg_free(c->t, m);
    return rc;
  }
  count_bytes(c, 0, bytes);
  *out = m;
  return 0;
}

/* Receives into dst[0..bytes). */
static int xrecv_into(struct comm *c, int src, const struct comm_hdr *base, uint32_t step, void *dst, uint64_t bytes,
                      struct rumor_err *e) {
  struct comm_msg *m = NULL;
  int rc = xrecv(c, src, base, step, bytes, &m, e);
  if (rc) return rc;
  if (bytes) memcpy(dst, m->data, (size_t)bytes);
  comm_msg_free(c->t, m);
  return 0;
}

/* Starts a collective: checks the failure and numbers it. */
static int begin(struct comm *c, uint32_t kind, int64_t total, uint64_t shape, struct comm_hdr *base,
                 struct rumor_err *e) {
  int rc = comm_transport_check(c->t, e);
  if (rc) return rc;
  *base = (struct comm_hdr){.seq = c->seq++, .kind = kind, .total = total, .shape = shape};
  return 0;
}

/* ---- arithmetic ---- */

static void add(float *restrict dst, const float *restrict src, int64_t n) {
  for (int64_t i = 0; i < n; i++) dst[i] += src[i];
}

static int mod(int a, int p) { return ((a % p) + p) % p; }

/* FNV-1a over the counts: members that cut a buffer differently disagree. */
static uint64_t counts_digest(const int64_t *counts, int size) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (int i = 0; i < size; i++)
    for (int b = 0; b < 8; b++) {
      h ^= (uint8_t)((uint64_t)counts[i] >> (8 * b));
      h *= 0x100000001b3ull;
    }
  return h;
}

static int check_counts(const struct comm *c, const char *what, const int64_t *counts, int64_t *offs, int64_t *total,
                        int64_t *most, struct rumor_err *e) {
  if (!counts) return rumor_err_set(e, -EINVAL, "%s: no counts", what);
  *total = 0;
  *most = 0;
  for (int i = 0; i < c->size; i++) {
    if (counts[i] < 0 || counts[i] > COMM_MAX_FLOATS - *total)
      return rumor_err_set(e, -EINVAL, "%s: counts[%d] = %" PRId64 " is out of range", what, i, counts[i]);
    offs[i] = *total;
    *total += counts[i];
    if (counts[i] > *most) *most = counts[i];
  }
  return 0;
}

/* ---- reduce-scatter and all-gather: the building blocks ---- */

/* Every member sends chunk j to member j, which sums the contributions in
 * member order. One round (step `step`). */
static int rs_direct(struct comm *c, const struct comm_hdr *base, uint32_t step, float *buf, const int64_t *counts,
                     const int64_t *offs, struct rumor_err *e) {
  int r = c->rank, P = c->size, rc = 0;
  for (int j = 0; j < P && !rc; j++)
    if (j != r) rc = xsend(c, j, base, step, buf + offs[j], (uint64_t)counts[j] * sizeof(float), e);
  if (rc) return rc;
  int64_t cnt = counts[r];
  float *mine = buf + offs[r];
  float *acc = cnt ? xmalloc((size_t)cnt * sizeof(float)) : NULL;
  for (int m = 0; m < P && !rc; m++) {
    struct comm_msg *msg = NULL;
    if (m != r && (rc = xrecv(c, m, base, step, (uint64_t)cnt * sizeof(float), &msg, e))) break;
    const float *x = m == r ? mine : msg->data;
    if (m == 0 && cnt) memcpy(acc, x, (size_t)cnt * sizeof(float));
    else if (m > 0) add(acc, x, cnt);
    comm_msg_free(c->t, msg);
  }
  if (!rc && cnt) memcpy(mine, acc, (size_t)cnt * sizeof(float));
  free(acc);
  return rc;
}

/* A ring: in round s member r sends its partial sum of chunk r − s − 1 to
 * r + 1 and adds its own data to the partial sum of chunk r − s − 2 from
 * r − 1; after size − 1 rounds (steps step0, ...) member r holds chunk r
 * summed over every member, once. */
static int rs_ring(struct comm *c, const struct comm_hdr *base, uint32_t step0, float *buf, const int64_t *counts,
                   const int64_t *offs, struct rumor_err *e) {
  int r = c->rank, P = c->size, next = mod(r + 1, P), prev = mod(r - 1, P);
  for (int s = 0; s < P - 1; s++) {
    int out = mod(r - s - 1, P), in = mod(r - s - 2, P);
    int rc = xsend(c, next, base, step0 + (uint32_t)s, buf + offs[out], (uint64_t)counts[out] * sizeof(float), e);
    struct comm_msg *m = NULL;
    if (!rc) rc = xrecv(c, prev, base, step0 + (uint32_t)s, (uint64_t)counts[in] * sizeof(float), &m, e);
    if (rc) return rc;
    add(buf + offs[in], m->data, counts[in]);
    comm_msg_free(c->t, m);
  }
  return 0;
}

/* Every member sends its chunk to every other. One round. */
static int ag_direct(struct comm *c, const struct comm_hdr *base, uint32_t step, float *buf, const int64_t *counts,
                     const int64_t *offs, struct rumor_err *e) {
  int r = c->rank, P = c->size, rc = 0;
  for (int j = 0; j < P && !rc; j++)
    if (j != r) rc = xsend(c, j, base, step, buf + offs[r], (uint64_t)counts[r] * sizeof(float), e);
  for (int m = 0; m < P && !rc; m++)
    if (m != r) rc = xrecv_into(c, m, base, step, buf + offs[m], (uint64_t)counts[m] * sizeof(float), e);
  return rc;
}

/* A ring: in round s member r passes chunk r − s on to r + 1 and takes
 * chunk r − s − 1 from r − 1. */
static int ag_ring(struct comm *c, const struct comm_hdr *base, uint32_t step0, float *buf, const int64_t *counts,
                   const int64_t *offs, struct rumor_err *e) {
  int r = c->rank, P = c->size, next = mod(r + 1, P), prev = mod(r - 1, P);
  for (int s = 0; s < P - 1; s++) {
    int out = mod(r - s, P), in = mod(r - s - 1, P);
    uint32_t step = step0 + (uint32_t)s;
    int rc = xsend(c, next, base, step, buf + offs[out], (uint64_t)counts[out] * sizeof(float), e);
    if (!rc) rc = xrecv_into(c, prev, base, step, buf + offs[in], (uint64_t)counts[in] * sizeof(float), e);
    if (rc) return rc;
  }
  return 0;
}

static bool direct(int64_t piece_floats) { return piece_floats * (int64_t)sizeof(float) <= COMM_DIRECT_MAX_BYTES; }

/* ---- the collectives ---- */

/* Below the threshold every member sends its whole buffer to every other
 * and each sums the size contributions in member order 0, 1, ...: the
 * same additions in the same order everywhere. Above it, a ring
 * reduce-scatter computes each chunk once, at its owner, and a ring
 * all-gather hands it out as it is. */
int comm_all_reduce(comm_t *c, float *buf, int64_t n, struct rumor_err *e) {
  if (n < 0 || n > COMM_MAX_FLOATS || (n && !buf))
    return rumor_err_set(e, -EINVAL, "all_reduce: bad buffer (%" PRId64 " floats at %p)", n, (void *)buf);
  struct comm_hdr base;
  int rc = begin(c, COMM_KIND_ALL_REDUCE, n, 0, &base, e);
  int r = c->rank, P = c->size;
  if (rc || P == 1) return rc;
  if (direct(n)) {
    for (int j = 0; j < P && !rc; j++)
      if (j != r) rc = xsend(c, j, &base, 0, buf, (uint64_t)n * sizeof(float), e);
    float *acc = n ? xmalloc((size_t)n * sizeof(float)) : NULL;
    for (int m = 0; m < P && !rc; m++) {
      struct comm_msg *msg = NULL;
      if (m != r && (rc = xrecv(c, m, &base, 0, (uint64_t)n * sizeof(float), &msg, e))) break;
      const float *x = m == r ? buf : msg->data;
      if (m == 0 && n) memcpy(acc, x, (size_t)n * sizeof(float));
      else if (m > 0) add(acc, x, n);
      comm_msg_free(c->t, msg);
    }
    if (!rc && n) memcpy(buf, acc, (size_t)n * sizeof(float));
    free(acc);
    return rc;
  }
  int64_t counts[COMM_MAX_MEMBERS], offs[COMM_MAX_MEMBERS];
  for (int i = 0; i < P; i++) {
    int64_t lo, hi;
    comm_chunk(n, P, i, &lo, &hi);
    counts[i] = hi - lo;
    offs[i] = lo;
  }
  rc = rs_ring(c, &base, 0, buf, counts, offs, e);
  if (!rc) rc = ag_ring(c, &base, (uint32_t)(P - 1), buf, counts, offs, e);
  return rc;
}

int comm_reduce_scatter_v(comm_t *c, float *buf, const int64_t *counts, struct rumor_err *e) {
  int64_t offs[COMM_MAX_MEMBERS], total = 0, most = 0;
  int rc = check_counts(c, "reduce_scatter", counts, offs, &total, &most, e);
  if (rc) return rc;
  if (total && !buf) return rumor_err_set(e, -EINVAL, "reduce_scatter: no buffer for %" PRId64 " floats", total);
  struct comm_hdr base;
  if ((rc = begin(c, COMM_KIND_REDUCE_SCATTER, total, counts_digest(counts, c->size), &base, e)) || c->size == 1)
    return rc;
  return direct(most) ? rs_direct(c, &base, 0, buf, counts, offs, e) : rs_ring(c, &base, 0, buf, counts, offs, e);
}

int comm_all_gather_v(comm_t *c, float *buf, const int64_t *counts, struct rumor_err *e) {
  int64_t offs[COMM_MAX_MEMBERS], total = 0, most = 0;
  int rc = check_counts(c, "all_gather", counts, offs, &total, &most, e);
  if (rc) return rc;
  if (total && !buf) return rumor_err_set(e, -EINVAL, "all_gather: no buffer for %" PRId64 " floats", total);
  struct comm_hdr base;
  if ((rc = begin(c, COMM_KIND_ALL_GATHER, total, counts_digest(counts, c->size), &base, e)) || c->size == 1)
    return rc;
  return direct(most) ? ag_direct(c, &base, 0, buf, counts, offs, e) : ag_ring(c, &base, 0, buf, counts, offs, e);
}

static int even_counts(const comm_t *c, const char *what, int64_t n, int64_t *counts, struct rumor_err *e) {
  if (n < 0 || n > COMM_MAX_FLOATS) return rumor_err_set(e, -EINVAL, "%s: bad count %" PRId64, what, n);
  for (int i = 0; i < c->size; i++) {
    int64_t lo, hi;
    comm_chunk(n, c->size, i, &lo, &hi);
    counts[i] = hi - lo;
  }
  return 0;
}

int comm_reduce_scatter(comm_t *c, float *buf, int64_t n, struct rumor_err *e) {
  int64_t counts[COMM_MAX_MEMBERS];
  int rc = even_counts(c, "reduce_scatter", n, counts, e);
  return rc ? rc : comm_reduce_scatter_v(c, buf, counts, e);
}

int comm_all_gather(comm_t *c, float *buf, int64_t n, struct rumor_err *e) {
  int64_t counts[COMM_MAX_MEMBERS];
  int rc = even_counts(c, "all_gather", n, counts, e);
  return rc ? rc : comm_all_gather_v(c, buf, counts, e);
}

/* Direct: run j straight to member j; the runs received in member order. */
int comm_all_to_all(comm_t *c, const float *send, const int64_t *send_counts, float *recv, const int64_t *recv_counts,
                    struct rumor_err *e) {
  int64_t soffs[COMM_MAX_MEMBERS], roffs[COMM_MAX_MEMBERS], stotal = 0, rtotal = 0, most = 0;
  int rc = check_counts(c, "all_to_all send", send_counts, soffs, &stotal, &most, e);
  if (!rc) rc = check_counts(c, "all_to_all recv", recv_counts, roffs, &rtotal, &most, e);
  if (rc) return rc;
  int r = c->rank, P = c->size;
  if ((stotal && !send) || (rtotal && !recv))
    return rumor_err_set(e, -EINVAL, "all_to_all: no buffer for %" PRId64 " / %" PRId64 " floats", stotal, rtotal);
  if (send_counts[r] != recv_counts[r])
    return rumor_err_set(e, -EINVAL, "all_to_all: member %d sends itself %" PRId64 " floats but expects %" PRId64, r,
                         send_counts[r], recv_counts[r]);
  struct comm_hdr base;
  if ((rc = begin(c, COMM_KIND_ALL_TO_ALL, 0, 0, &base, e))) return rc;
  for (int j = 0; j < P && !rc; j++)
    if (j != r) rc = xsend(c, j, &base, 0, send + soffs[j], (uint64_t)send_counts[j] * sizeof(float), e);
  if (!rc && send_counts[r]) memmove(recv + roffs[r], send + soffs[r], (size_t)send_counts[r] * sizeof(float));
  for (int m = 0; m < P && !rc; m++)
    if (m != r) rc = xrecv_into(c, m, &base, 0, recv + roffs[m], (uint64_t)recv_counts[m] * sizeof(float), e);
  return rc;
}

int comm_gather_v(comm_t *c, int root, const float *send, int64_t n, float *recv, const int64_t *counts,
                  struct rumor_err *e) {
  int size = comm_size(c), me = comm_rank(c);
  RUMOR_ASSERT(0 <= root && root < size && n >= 0 && (me != root || counts));
  int64_t sc[COMM_MAX_MEMBERS] = {0}, rc_[COMM_MAX_MEMBERS] = {0};
  sc[root] = n;
  for (int j = 0; me == root && j < size; j++) rc_[j] = counts[j];
  return comm_all_to_all(c, send, sc, recv, rc_, e);
}

int comm_barrier(comm_t *c, struct rumor_err *e) {
  struct comm_hdr base;
  int rc = begin(c, COMM_KIND_BARRIER, 0, 0, &base, e);
  int r = c->rank, P = c->size;
  for (int j = 0; j < P && !rc; j++)
    if (j != r) rc = xsend(c, j, &base, 0, NULL, 0, e);
  for (int m = 0; m < P && !rc; m++)
    if (m != r) rc = xrecv_into(c, m, &base, 0, NULL, 0, e);
  return rc;
}

/* Direct: the root sends to every member. Above the threshold: down the
 * chain root, root + 1, ... in segments, each member forwarding a segment
 * as soon as it has it. */
int comm_broadcast(comm_t *c, int root, void *bytes, int64_t len, struct rumor_err *e) {
  if (root < 0 || root >= c->size) return rumor_err_set(e, -EINVAL, "broadcast: root %d of %d members", root, c->size);
  if (len < 0 || len > COMM_MAX_FLOATS || (len && !bytes))
    return rumor_err_set(e, -EINVAL, "broadcast: bad buffer (%" PRId64 " bytes at %p)", len, bytes);
  struct comm_hdr base;
  int rc = begin(c, COMM_KIND_BROADCAST, len, (uint64_t)root, &base, e);
  int r = c->rank, P = c->size;
  if (rc || P == 1) return rc;
  if (len <= COMM_DIRECT_MAX_BYTES) {
    if (r != root) return xrecv_into(c, root, &base, 0, bytes, (uint64_t)len, e);
    for (int j = 0; j < P && !rc; j++)
      if (j != r) rc = xsend(c, j, &base, 0, bytes, (uint64_t)len, e);
    return rc;
  }
  int pos = mod(r - root, P), next = mod(r + 1, P), prev = mod(r - 1, P);
  uint8_t *p = bytes;
  uint32_t step = 0;
  for (int64_t off = 0; off < len && !rc; off += CHAIN_SEGMENT_BYTES, step++) {
    int64_t seg = len - off < CHAIN_SEGMENT_BYTES ? len - off : CHAIN_SEGMENT_BYTES;
    if (pos > 0) rc = xrecv_into(c, prev, &base, step, p + off, (uint64_t)seg, e);
    if (!rc && pos < P - 1) rc = xsend(c, next, &base, step, p + off, (uint64_t)seg, e);
  }
  return rc;
}
