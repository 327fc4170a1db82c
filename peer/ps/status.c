/* `rumor top --servers`: asks parameter servers where they and their
 * workers stand (STATUS_REQ, ps_impl.h), on a loop of its own. */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/ps/ps_impl.h"

struct query {
  uv_loop_t loop;
  uv_timer_t timer;
  net_t *net;
  struct ps_status *st;
  int n, pending;
  bool closing;
};

static void finish_one(struct query *q, struct ps_status *st, const char *error) {
  if (error && !st->reachable && !st->error[0]) snprintf(st->error, sizeof st->error, "%s", error);
  q->pending--;
}

static void on_net_closed(void *arg) { (void)arg; }
static void on_timer_closed(uv_handle_t *h) { (void)h; }

static void close_all(struct query *q) {
  if (q->closing) return;
  q->closing = true;
  uv_timer_stop(&q->timer);
  uv_close((uv_handle_t *)&q->timer, on_timer_closed);
  net_close(q->net, on_net_closed, q);
}

/* Reads one worker entry [key, clock, live, done]. */
static int parse_worker(const msgpack_object *o, struct ps_status_worker *w) {
  if (o->type != MSGPACK_OBJECT_ARRAY || o->via.array.size != 4) return RUMOR_EPROTO;
  const msgpack_object *f = o->via.array.ptr;
  const uint8_t *key;
  size_t klen;
  int64_t clock;
  if (net_obj_bin(&f[0], &key, &klen) || klen != NET_PUBKEY_BYTES || net_obj_int(&f[1], &clock) ||
      net_obj_bool(&f[2], &w->live) || net_obj_bool(&f[3], &w->done))
    return RUMOR_EPROTO;
  net_pubkey_format(w->id, key);
  w->clock = clock;
  return 0;
}

static int parse_status(const struct net_msg *m, struct ps_status *st) {
  int64_t range, ranges, workers;
  const msgpack_object *items;
  uint32_t n;
  if (net_msg_get_int(m, "range", &range) || net_msg_get_int(m, "ranges", &ranges) ||
      net_msg_get_int(m, "version", &st->version) || net_msg_get_int(m, "staleness", &st->staleness) ||
      net_msg_get_int(m, "workers", &workers) || net_msg_get_int(m, "max_gap", &st->max_gap) ||
      net_msg_get_array(m, "w", &items, &n) || n > PS_STATUS_MAX_WORKERS || range < 0 || ranges < 1 ||
      range >= ranges || ranges > PS_MAX_SERVERS || workers < 1 || workers > PS_MAX_WORKERS)
    return RUMOR_EPROTO;
  st->range = (int)range;
  st->ranges = (int)ranges;
  int64_t stage, stages;
  if (net_msg_get_int(m, "stage", &stage) || net_msg_get_int(m, "stages", &stages)) stage = 0, stages = 1;
  if (stages < 1 || stages > PIPE_MAX_STAGES || stage < 0 || stage >= stages) return RUMOR_EPROTO;
  st->stage = (int)stage;
  st->stages = (int)stages;
  st->workers = (int)workers;
  st->w = xcalloc(n ? n : 1, sizeof *st->w);
  for (uint32_t i = 0; i < n; i++)
    if (parse_worker(&items[i], &st->w[i])) return RUMOR_EPROTO;
  st->nw = (int)n;
  return 0;
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct query *q = ud;
  struct ps_status *st = net_conn_data(c);
  if (!st || st->reachable || st->error[0]) return;
  if (m->type == PS_MSG_REJECT) {
    char why[PS_WHY_MAX];
    if (ps_msg_str(m, "why", why, sizeof why)) snprintf(why, sizeof why, "no reason given");
    snprintf(st->error, sizeof st->error, "refused: %.180s", why);
  } else if (m->type == PS_MSG_STATUS && parse_status(m, st) == 0) {
    st->reachable = true;
  } else if (m->type != PS_MSG_PING) {
    snprintf(st->error, sizeof st->error, "a malformed answer (message type %llu)", (unsigned long long)m->type);
  } else {
    return;
  }
  finish_one(q, st, NULL);
  net_conn_close(c);
  if (q->pending == 0) close_all(q);
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct query *q = ud;
  struct ps_status *st = net_conn_data(c);
  if (!st || st->reachable || st->error[0]) return;
  snprintf(st->error, sizeof st->error, "connection closed before an answer: %s",
           detail ? detail : rumor_strerror(status));
  finish_one(q, st, NULL);
  if (q->pending == 0) close_all(q);
}

static void on_dialed(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  (void)n;
  struct ps_status *st = arg;
  struct query *q = st->q;
  if (status) {
    snprintf(st->error, sizeof st->error, "unreachable: %s", detail ? detail : rumor_strerror(status));
    finish_one(q, st, NULL);
    if (q->pending == 0) close_all(q);
    return;
  }
  net_conn_set_data(c, st);
  struct net_msgbuf b;
  net_msgbuf_init(&b, PS_MSG_STATUS_REQ, PS_PROTO_VERSION);
  int rc = net_conn_send_msg(c, &b);
  net_msgbuf_free(&b);
  if (rc) net_conn_close(c); /* on_close says why */
}

static void on_timeout(uv_timer_t *t) {
  struct query *q = t->data;
  for (int i = 0; i < q->n; i++)
    if (!q->st[i].reachable && !q->st[i].error[0]) snprintf(q->st[i].error, sizeof q->st[i].error, "no answer in time");
  close_all(q);
}

int ps_status_query(const struct ps_status_config *cfg, struct ps_status **out, int *count, struct rumor_err *e) {
  struct query q = {0};
  char addrs[PS_MAX_SERVERS][PS_ADDR_MAX];
  int rc = ps_servers_parse(cfg->servers, addrs, &q.n, e);
  if (rc) return rc;
  q.st = xcalloc((size_t)q.n, sizeof *q.st);
  for (int i = 0; i < q.n; i++) memcpy(q.st[i].addr, addrs[i], PS_ADDR_MAX);
  RUMOR_ASSERT(uv_loop_init(&q.loop) == 0);
  struct net_config nc;
  net_config_defaults(&nc);
  nc.identity = cfg->identity;
  nc.cluster_key = cfg->cluster_key;
  nc.max_msg_bytes = PS_MAX_MSG_BYTES;
  const struct net_callbacks cbs = {.on_message = on_message, .on_close = on_close};
  if ((rc = net_init(&q.net, &q.loop, &nc, &cbs, &q, e))) {
    RUMOR_ASSERT(uv_loop_close(&q.loop) == 0);
    free(q.st);
    return rc;
  }
  uv_timer_init(&q.loop, &q.timer);
  q.timer.data = &q;
  uv_timer_start(&q.timer, on_timeout, cfg->timeout_ms, 0);
  q.pending = q.n;
  for (int i = 0; i < q.n; i++) {
    q.st[i].q = &q;
    int dr = net_dial(q.net, q.st[i].addr, on_dialed, &q.st[i]);
    if (dr) {
      snprintf(q.st[i].error, sizeof q.st[i].error, "cannot dial: %s", rumor_strerror(dr));
      q.pending--;
    }
  }
  if (q.pending == 0) close_all(&q);
  uv_run(&q.loop, UV_RUN_DEFAULT);
  RUMOR_ASSERT(uv_loop_close(&q.loop) == 0);
  for (int i = 0; i < q.n; i++) q.st[i].q = NULL;
  *out = q.st;
  *count = q.n;
  return 0;
}

void ps_status_free(struct ps_status *st, int n) {
  if (!st) return;
  for (int i = 0; i < n; i++) free(st[i].w);
  free(st);
}
