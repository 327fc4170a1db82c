/* `--sync ps` as a sync scheme (peer/sync/sync.h): a worker of parameter
 * servers. Its init starts the client of its servers (the config's `net`:
 * our keys and --servers) and installs the client's reducer; its join takes
 * the parameters and the clock from the servers; its finish tells them we
 * are done. It exchanges with no one: a group's stage keeps a gossip
 * runtime only as the event loop of its links, and a whole replica's worker
 * runs the scheme with no runtime at all (cmd_ps.c). */
#include <string.h>

#include "peer/ps/ps.h"
#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

/* How long a server may be silent before it is redialed, and how long one
 * may stay unreachable before the worker gives up. */
#define PS_SCHEME_SERVER_TIMEOUT_MS 10000
#define PS_SCHEME_GIVE_UP_S 120.0

void ps_client_result(const struct ps_client_stats *st, json_t *o) {
  json_text_set(o, "sync", json_string("ps"));
  const struct {
    const char *key;
    int64_t v;
  } figs[] = {{"ps_pushes", (int64_t)st->pushes},         {"ps_pulls", (int64_t)st->pulls},
              {"ps_repushes", (int64_t)st->repushes},     {"ps_reconnects", (int64_t)st->reconnects},
              {"ps_version", st->last_version},           {"ps_max_clock_gap", st->max_gap}};
  for (size_t i = 0; i < sizeof figs / sizeof figs[0]; i++) json_text_set(o, figs[i].key, json_integer(figs[i].v));
  json_text_set(o, "ps_wait_s", json_text_real(st->wait_s));
}

static void ps_plan(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out) {
  *out = (struct sync_gossip_plan){.protocol = GOSSIP_SYNC_GOSSIP, .buf_floats = (uint64_t)nparams, .wire = c->wire};
  snprintf(out->label, sizeof out->label, " sync=ps");
}

static int ps_init(struct sync *s, struct rumor_err *e) {
  const struct sync_net *n = &s->cfg.net;
  RUMOR_ASSERT(n->identity && n->cluster_key && n->servers);
  const struct ps_client_config cc = {.identity = n->identity,
                                      .cluster_key = n->cluster_key,
                                      .allow = n->allow,
                                      .servers = n->servers,
                                      .wire = s->cfg.wire,
                                      .server_timeout_ms = PS_SCHEME_SERVER_TIMEOUT_MS,
                                      .handshake_timeout_ms = n->handshake_timeout_ms,
                                      .heartbeat_ms = n->heartbeat_ms,
                                      .dead_after_ms = n->dead_after_ms,
                                      .give_up_s = PS_SCHEME_GIVE_UP_S,
                                      .stop = s->cfg.stop};
  ps_client_t *cl;
  int rc = ps_client_start(&cl, s->t, &cc, e);
  if (rc) return rc;
  s->scheme_state = cl;
  return 0;
}

static int ps_reduce(void *arg, int64_t rows, struct rumor_err *e) {
  struct sync *s = arg;
  return ps_client_reduce(s->scheme_state, rows, e);
}

static int ps_join(struct sync *s, struct rumor_err *e) { return ps_client_join(s->scheme_state, e); }

/* DONE: the servers stop counting us in their bound. */
static int ps_finish(struct sync *s, const struct sync_finish_args *f, struct rumor_err *e) {
  (void)f, (void)e;
  ps_client_finish(s->scheme_state);
  return 0;
}

static void ps_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  (void)gs;
  struct ps_client_stats st;
  ps_client_stats_get(s->scheme_state, &st);
  ps_client_result(&st, o);
}

/* The servers' connections, beside a stage's gossip runtime (none for a
 * whole worker). */
static void ps_own_bytes(const struct sync *s, uint64_t *in, uint64_t *out) {
  struct ps_client_stats st;
  ps_client_stats_get(s->scheme_state, &st);
  *in += st.bytes_in;
  *out += st.bytes_out;
}

static void ps_free(struct sync *s) {
  ps_client_free(s->scheme_state);
  s->scheme_state = NULL;
}

const struct sync_scheme sync_scheme_ps = {
    .name = "ps",
    .plan = ps_plan,
    .init = ps_init,
    .reduce = ps_reduce,
    .join = ps_join,
    .finish = ps_finish,
    .result = ps_result,
    .own_bytes = ps_own_bytes,
    .free = ps_free,
};
