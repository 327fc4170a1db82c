/* `rumor ps`: one parameter server (ps.h). Everything here runs on the
 * thread that called ps_server_run, which runs the loop: no locks. */
#include <errno.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/ps/ps_impl.h"
#include "peer/train/train.h"

#define TICK_MS 100
#define PROGRESS_MS 5000
#define CKPT_FORMAT "ps-1"

struct server;

struct worker {
  struct server *srv;
  uint8_t key[NET_PUBKEY_BYTES];
  char name[16];    /* key prefix, for log lines */
  net_conn_t *conn; /* NULL while disconnected */
  int64_t clock;    /* gradients taken from it: the number of the next one expected */
  bool live;        /* counted in the bound and in BSP rounds */
  bool done;        /* said DONE */
  uint64_t grace_ms; /* restored from the checkpoint: live until this time unless it reconnects (0: none) */
  uint64_t rx_bytes, rx_at_ms;
  bool pull_pending, pull_final;
  int64_t pull_want;
  enum net_dtype pull_wire;
  float *sendbuf; /* len floats: the slice in flight to it, owned; unchanged while `sending` */
  bool sending;
};

/* An inbound gradient transfer. */
struct rx {
  float *buf;
  int64_t index, rows;
};

struct server {
  struct ps_server_config cfg;
  struct ps_server_stats st;
  char spec[MODEL_SPEC_MAX];
  char optim_text[PS_OPTIM_TEXT_MAX];
  int64_t P, lo, hi, len; /* the model's parameters; [lo, hi) of them held here */
  int64_t slice_lo, slice_len; /* the workers' vector within the model: a stage's slice, or all of it */
  char stage_text[32];         /* "s/S", or "" for the whole model */
  bool bsp;
  tensor_backend_t be;
  struct tensor params, grad; /* (len) on the CPU */
  struct optim optim;         /* over the range: nparams = len, spans shifted by -lo */
  float *sum;                 /* (len) BSP: the round's row-weighted sum */
  double sum_rows;
  int contributors;
  int64_t version, saved_version, schedule_steps;
  struct worker **w; /* each allocated once, freed at the end (transfers point to them) */
  int nw;
  bool assembled; /* N workers have registered */
  bool any_done;
  uv_loop_t loop;
  net_t *net;
  uv_timer_t tick;
  uint64_t last_ping_ms, last_progress_ms;
  bool stopping;
  bool finish; /* every worker is done or gone: stop at the next tick */
  int rc; /* a failure that ends the run */
  struct rumor_err err;
};

static void serve_pulls(struct server *s);

static int live_count(const struct server *s) {
  int n = 0;
  for (int i = 0; i < s->nw; i++) n += s->w[i]->live;
  return n;
}

/* The bound's minimum: the smallest live clock; 0 while workers are still
 * to come (they start at 0); INT64_MAX when none is live. */
static int64_t min_live_clock(const struct server *s) {
  if (!s->assembled) return 0;
  int64_t m = INT64_MAX;
  for (int i = 0; i < s->nw; i++)
    if (s->w[i]->live && s->w[i]->clock < m) m = s->w[i]->clock;
  return m;
}

/* ============================================================================
 * State: initial parameters, the optimizer over the range, checkpoints
 * ========================================================================== */

/* Parameters as a fresh run of the same model and seed starts them. */
static int init_params(struct server *s, const struct model_spec *spec, struct rumor_err *e) {
  struct model m;
  int rc = model_init_full(&m, spec, s->be, 1, e);
  if (rc) return rumor_err_prefix(e, "the initial parameters");
  model_init_params(&m, s->cfg.seed);
  memcpy(s->params.data, (const float *)m.params.data + s->lo, (size_t)s->len * sizeof(float));
  model_free(&m);
  return 0;
}

static struct worker *worker_add(struct server *s, const uint8_t key[NET_PUBKEY_BYTES], int64_t clock) {
  RUMOR_ASSERT(s->nw < PS_MAX_WORKERS);
  struct worker *w = xcalloc(1, sizeof *w);
  w->srv = s;
  memcpy(w->key, key, NET_PUBKEY_BYTES);
  char text[NET_PUBKEY_STR_LEN + 1];
  net_pubkey_format(text, key);
  snprintf(w->name, sizeof w->name, "%.8s", text);
  w->clock = clock;
  w->sendbuf = xmalloc((size_t)(s->len ? s->len : 1) * sizeof(float));
  s->w = xrealloc(s->w, (size_t)(s->nw + 1) * sizeof *s->w);
  s->w[s->nw++] = w;
  if (!s->assembled && s->nw >= s->cfg.workers) {
    s->assembled = true;
    log_info("%d workers registered: rounds and the staleness bound count them from now on", s->nw);
  }
  return w;
}

/* "KEY:clock:d|l ..." (d: done). Returns 0 or RUMOR_ECORRUPT. */
static int parse_workers(struct server *s, const char *text, uint64_t grace_until, struct rumor_err *e) {
  const char *p = text;
  while (*p) {
    while (*p == ' ') p++;
    if (!*p) break;
    const char *c1 = strchr(p, ':');
    uint8_t key[NET_PUBKEY_BYTES];
    char *end;
    if (!c1 || net_pubkey_parse(p, (size_t)(c1 - p), key) != 0 || s->nw >= PS_MAX_WORKERS) goto bad;
    long long clock = strtoll(c1 + 1, &end, 10);
    if (end == c1 + 1 || clock < 0 || *end != ':' || (end[1] != 'd' && end[1] != 'l')) goto bad;
    struct worker *w = worker_add(s, key, clock);
    w->done = end[1] == 'd';
    w->live = !w->done;
    s->any_done |= w->done;
    w->grace_ms = w->live ? grace_until : 0;
    p = end + 2;
  }
  return 0;
bad:
  return rumor_err_set(e, RUMOR_ECORRUPT, "%s: rumor.ps.workers is malformed", s->cfg.checkpoint);
}

static int meta_i64(const struct st_file *f, const char *key, int64_t *out) {
  const char *v = safetensors_meta(f, key);
  return v ? parse_i64(v, 0, INT64_MAX, out) : RUMOR_ENOTFOUND;
}

/* Checks that checkpoint `f` is this server's: format, model, range,
 * optimizer. */
static int check_identity(struct server *s, const struct st_file *f, struct rumor_err *e) {
  const char *path = s->cfg.checkpoint;
  const char *fmt = safetensors_meta(f, "rumor.format"), *model = safetensors_meta(f, "rumor.model");
  const char *range = safetensors_meta(f, "rumor.range"), *opt = safetensors_meta(f, "rumor.optimizer");
  char want_range[32];
  snprintf(want_range, sizeof want_range, "%d/%d", s->cfg.range, s->cfg.ranges);
  if (!fmt || strcmp(fmt, CKPT_FORMAT) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s is not a parameter server's checkpoint (rumor.format %s)", path,
                         fmt ? fmt : "missing");
  if (!model || strcmp(model, s->spec) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s holds model %s, not --model %s", path, model ? model : "?", s->spec);
  if (!range || strcmp(range, want_range) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s holds range %s, not --range %s", path, range ? range : "?",
                         want_range);
  const char *stage = safetensors_meta(f, "rumor.stage");
  if (strcmp(stage ? stage : "", s->stage_text) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s holds %s%s, not %s%s", path, stage ? "stage " : "the whole model",
                         stage ? stage : "", s->stage_text[0] ? "--stage " : "the whole model (no --stage)",
                         s->stage_text);
  if (!opt || strcmp(opt, optim_kind_name(s->cfg.optim.kind)) != 0)
    return rumor_err_set(e, RUMOR_EFORMAT, "%s holds %s state, not --optimizer %s", path, opt ? opt : "?",
                         optim_kind_name(s->cfg.optim.kind));
  return 0;
}

/* Resumes from the checkpoint. Returns 0, 1 when there is none, or an
 * error naming the file and the fault. */
static int load_checkpoint(struct server *s, struct rumor_err *e) {
  struct st_file f;
  char used[CHECKPOINT_PATH_MAX + 8];
  int rc = checkpoint_read_tensors(s->cfg.checkpoint, &f, used, sizeof used, e);
  if (rc) return rc; /* 1: none yet */
  if (strcmp(used, s->cfg.checkpoint) != 0) log_warn("resuming from %s", used);
  if ((rc = check_identity(s, &f, e))) goto out;
  const struct st_tensor *p = safetensors_find(&f, "ps.params"), *o = safetensors_find(&f, "ps.optimizer");
  size_t want_o = (size_t)tensor_numel(&s->optim.state) * sizeof(float);
  int64_t version, ostep, sched;
  const char *workers = safetensors_meta(&f, "rumor.ps.workers");
  if (!p || !o || p->dtype != TENSOR_F32 || o->dtype != TENSOR_F32 || p->nbytes != (size_t)s->len * sizeof(float) ||
      o->nbytes != want_o || meta_i64(&f, "rumor.version", &version) || meta_i64(&f, "rumor.optim_step", &ostep) ||
      meta_i64(&f, "rumor.schedule_steps", &sched) || !workers) {
    rc = rumor_err_set(e, RUMOR_ECORRUPT, "%s: missing or mis-sized entries for range %d/%d", s->cfg.checkpoint,
                       s->cfg.range, s->cfg.ranges);
    goto out;
  }
  memcpy(s->params.data, p->data, p->nbytes);
  memcpy(s->optim.state.data, o->data, o->nbytes);
  s->optim.step = ostep;
  s->version = s->saved_version = version;
  if (s->schedule_steps == 0) s->schedule_steps = sched;
  else if (sched && sched != s->schedule_steps)
    log_warn("%s was saved with a schedule of %lld steps; --max-steps %lld wins", s->cfg.checkpoint,
             (long long)sched, (long long)s->schedule_steps);
  rc = parse_workers(s, workers, clock_now_ns() / 1000000 + s->cfg.worker_timeout_ms, e);
  if (rc == 0) s->st.resumed = true;
out:
  safetensors_free(&f);
  return rc;
}

static char *workers_text(const struct server *s) {
  size_t cap = (size_t)s->nw * (NET_PUBKEY_STR_LEN + 32) + 1, n = 0;
  char *buf = xmalloc(cap);
  buf[0] = 0;
  for (int i = 0; i < s->nw; i++) {
    char key[NET_PUBKEY_STR_LEN + 1];
    net_pubkey_format(key, s->w[i]->key);
    n += (size_t)snprintf(buf + n, cap - n, "%s%s:%lld:%c", i ? " " : "", key, (long long)s->w[i]->clock,
                          s->w[i]->done ? 'd' : 'l');
  }
  return buf;
}

static int save_checkpoint(struct server *s, struct rumor_err *e) {
  char range[32], version[32], ostep[32], sched[32], stale[32];
  snprintf(range, sizeof range, "%d/%d", s->cfg.range, s->cfg.ranges);
  snprintf(version, sizeof version, "%lld", (long long)s->version);
  snprintf(ostep, sizeof ostep, "%lld", (long long)s->optim.step);
  snprintf(sched, sizeof sched, "%lld", (long long)s->schedule_steps);
  snprintf(stale, sizeof stale, "%lld", (long long)s->cfg.staleness);
  char *workers = workers_text(s);
  const struct st_meta meta[] = {
      {"rumor.format", CKPT_FORMAT},  {"rumor.model", s->spec},        {"rumor.range", range},
      {"rumor.version", version},     {"rumor.optim_step", ostep},     {"rumor.schedule_steps", sched},
      {"rumor.optimizer", optim_kind_name(s->cfg.optim.kind)},         {"rumor.staleness", stale},
      {"rumor.ps.workers", workers},  {"rumor.stage", s->stage_text},
  };
  struct st_tensor ts[2] = {{.name = "ps.params", .dtype = TENSOR_F32, .ndim = 1}, {.name = "ps.optimizer"}};
  ts[0].shape[0] = s->len;
  ts[0].data = s->params.data;
  ts[0].nbytes = (size_t)s->len * sizeof(float);
  ts[1] = (struct st_tensor){.name = "ps.optimizer", .dtype = TENSOR_F32, .ndim = 1};
  ts[1].shape[0] = tensor_numel(&s->optim.state);
  ts[1].data = s->optim.state.data;
  ts[1].nbytes = (size_t)ts[1].shape[0] * sizeof(float);
  size_t nmeta = sizeof meta / sizeof meta[0] - (s->stage_text[0] ? 0 : 1); /* rumor.stage: for a stage only */
  int rc = checkpoint_save_tensors(s->cfg.checkpoint, ts, 2, meta, nmeta, e);
  free(workers);
  if (rc == 0) s->saved_version = s->version;
  return rc;
}

static void maybe_save(struct server *s) {
  if (s->version - s->saved_version < s->cfg.checkpoint_every) return;
  struct rumor_err e = {0};
  if (save_checkpoint(s, &e)) log_error("cannot save the checkpoint at version %lld: %s", (long long)s->version, e.msg);
}

/* ============================================================================
 * Updates
 * ========================================================================== */

/* Applies s->grad (already scaled) as update number s->version, with the
 * learning rate of the schedule's step `lr_step`. */
static void apply_grad(struct server *s, int64_t lr_step) {
  double lr = optim_lr_at(&s->cfg.optim, lr_step, s->schedule_steps);
  s->optim.step = s->version;
  optim_apply(&s->optim, &s->params, &s->grad, lr);
  s->version++;
}

/* BSP: the round's mean (weighted by rows) as one update. */
static void close_round(struct server *s) {
  if (s->sum_rows > 0) {
    float *g = s->grad.data;
    float k = (float)(1.0 / s->sum_rows);
    for (int64_t i = 0; i < s->len; i++) g[i] = s->sum[i] * k;
    apply_grad(s, s->version);
  } else {
    log_warn("round %lld dropped: every gradient in it was not finite", (long long)s->version);
    s->version++;
  }
  memset(s->sum, 0, (size_t)s->len * sizeof(float));
  s->sum_rows = 0;
  s->contributors = 0;
  maybe_save(s);
}

/* BSP: closes the round once every live worker gave its gradient. */
static void try_round(struct server *s) {
  if (!s->bsp || !s->assembled || s->contributors == 0) return;
  for (int i = 0; i < s->nw; i++)
    if (s->w[i]->live && s->w[i]->clock <= s->version) return;
  close_round(s);
}

static bool all_finite(const float *g, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (!isfinite(g[i])) return false;
  return true;
}

/* BSP: gradient number `index` of worker `w`. */
static void take_bsp(struct server *s, struct worker *w, int64_t index, int64_t rows, const float *g, bool finite) {
  if (index < s->version || w->clock > index) {
    s->st.stale++;
    if (w->clock < index + 1) w->clock = index + 1;
    return;
  }
  if (index > s->version) {
    /* Our checkpoint is older than the workers' place: the rounds between
     * were applied by the server we replace and are lost. */
    log_warn("gradient %lld from %s is ahead of round %lld: rounds lost with the restart are skipped",
             (long long)index, w->name, (long long)s->version);
    if (s->contributors > 0) {
      s->st.rounds_partial++;
      close_round(s);
    }
    s->version = index;
  }
  if (finite) {
    for (int64_t i = 0; i < s->len; i++) s->sum[i] += (float)rows * g[i];
    s->sum_rows += (double)rows;
  }
  s->contributors++;
  w->clock = index + 1;
  try_round(s);
}

/* SSP / ASP: applied as it comes, scaled by 1/N. */
static void take_async(struct server *s, struct worker *w, int64_t index, const float *g, bool finite) {
  if (index < w->clock) {
    s->st.stale++;
    return;
  }
  w->clock = index + 1;
  if (!finite) return;
  float *dst = s->grad.data, k = 1.0f / (float)s->cfg.workers;
  for (int64_t i = 0; i < s->len; i++) dst[i] = g[i] * k;
  apply_grad(s, s->version / s->cfg.workers);
  maybe_save(s);
}

static void take_grad(struct server *s, struct worker *w, const struct rx *r) {
  bool finite = all_finite(r->buf, s->len);
  if (!finite) {
    s->st.nonfinite++;
    log_warn("gradient %lld from %s is not finite: not applied", (long long)r->index, w->name);
  } else {
    s->st.grads++;
  }
  if (s->bsp) take_bsp(s, w, r->index, r->rows, r->buf, finite);
  else take_async(s, w, r->index, r->buf, finite);
  serve_pulls(s);
}

/* ============================================================================
 * Pulls
 * ========================================================================== */

/* Whether w's pull may be answered now (ps.h, "Clocks"); *gap gets its
 * distance ahead of the slowest live worker, for the figures. */
static bool pull_ready(const struct server *s, const struct worker *w, int64_t *gap) {
  *gap = 0;
  if (s->bsp) return s->version >= w->pull_want;
  if (w->clock < w->pull_want) return false; /* its gradient is still on the way */
  if (w->pull_final) return true; /* no step follows: not a release, no gap */
  int64_t m = min_live_clock(s);
  if (m != INT64_MAX && w->pull_want > m) *gap = w->pull_want - m;
  return s->cfg.staleness == PS_STALENESS_NONE || *gap <= s->cfg.staleness;
}

/* A slice sent (or not: the worker pulls again on its next connection). */
static void on_params_sent(net_conn_t *c, uint64_t id, int status, void *arg) {
  (void)c, (void)id, (void)status;
  struct worker *w = arg;
  w->sending = false;
  if (!w->srv->stopping) serve_pulls(w->srv); /* a pull that came in meanwhile, on a new connection */
}

static void send_params(struct server *s, struct worker *w, int64_t gap) {
  int64_t at = s->bsp ? (s->version > w->pull_want ? s->version : w->pull_want)
                      : (w->clock > w->pull_want ? w->clock : w->pull_want);
  if (s->bsp && w->clock < at) w->clock = at; /* a newcomer or a rejoiner enters at the current round */
  memcpy(w->sendbuf, s->params.data, (size_t)s->len * sizeof(float));
  uint8_t meta[PS_META_BYTES];
  ps_meta_write(meta, &(struct ps_meta){.kind = PS_KIND_PARAMS, .a = at, .b = s->version, .c = gap});
  struct net_bulk_send b = {.src = w->sendbuf,
                            .count = (uint64_t)s->len,
                            .wire = w->pull_wire,
                            .meta = meta,
                            .meta_len = sizeof meta,
                            .done = on_params_sent,
                            .arg = w};
  uint64_t id;
  int rc = net_conn_send_bulk(w->conn, &b, &id);
  if (rc) {
    log_warn("cannot send the parameters to %s (%s): closing its connection", w->name, rumor_strerror(rc));
    net_conn_close(w->conn);
    return;
  }
  w->sending = true;
  w->pull_pending = false;
  s->st.pulls++;
  if (gap > s->st.max_gap) s->st.max_gap = gap;
  log_debug("released %s at clock %lld (version %lld, gap %lld)", w->name, (long long)at, (long long)s->version,
            (long long)gap);
}

static void serve_pulls(struct server *s) {
  for (int i = 0; i < s->nw; i++) {
    struct worker *w = s->w[i];
    int64_t gap;
    if (w->pull_pending && w->conn && !w->sending && pull_ready(s, w, &gap)) send_params(s, w, gap);
  }
}

/* ============================================================================
 * Workers coming and going
 * ========================================================================== */

static void check_finished(struct server *s);

/* Takes `w` out of the bound (its connection closed, it went silent, or its
 * grace after a restart passed). */
static void drop(struct server *s, struct worker *w, const char *why) {
  if (!w->live) return;
  w->live = false;
  w->grace_ms = 0;
  s->st.dropped++;
  log_warn("worker %s dropped from the bound at clock %lld: %s", w->name, (long long)w->clock, why);
  try_round(s);
  serve_pulls(s);
  check_finished(s);
}

/* Ends `w`'s connection now as far as we are concerned. */
static void detach(struct server *s, struct worker *w, const char *why) {
  net_conn_t *c = w->conn;
  w->conn = NULL;
  w->pull_pending = false;
  if (c) {
    net_conn_set_data(c, NULL);
    net_conn_close(c);
  }
  if (!w->done) drop(s, w, why);
}

static void reject(net_conn_t *c, const char *fmt, ...) RUMOR_PRINTF(2, 3);
static void reject(net_conn_t *c, const char *fmt, ...) {
  char why[PS_WHY_MAX];
  va_list ap;
  va_start(ap, fmt);
  vsnprintf(why, sizeof why, fmt, ap);
  va_end(ap);
  log_warn("refusing %s: %s", net_conn_peer_name(c), why);
  struct net_msgbuf b;
  net_msgbuf_init(&b, PS_MSG_REJECT, PS_PROTO_VERSION);
  net_msgbuf_put_str(&b, "why", why, strlen(why));
  if (net_conn_send_msg(c, &b)) log_debug("cannot tell %s why", net_conn_peer_name(c));
  net_msgbuf_free(&b);
  net_conn_close(c);
}

/* A monitor's STATUS_REQ: where this server and each worker stand. The
 * connection stays open for the monitor to close. */
static void send_status(struct server *s, net_conn_t *c) {
  struct net_msgbuf b;
  net_msgbuf_init(&b, PS_MSG_STATUS, PS_PROTO_VERSION);
  net_msgbuf_put_int(&b, "range", s->cfg.range);
  net_msgbuf_put_int(&b, "ranges", s->cfg.ranges);
  net_msgbuf_put_int(&b, "stage", s->cfg.stage);
  net_msgbuf_put_int(&b, "stages", s->cfg.stages > 1 ? s->cfg.stages : 1);
  net_msgbuf_put_int(&b, "version", s->version);
  net_msgbuf_put_int(&b, "staleness", s->cfg.staleness);
  net_msgbuf_put_int(&b, "workers", s->cfg.workers);
  net_msgbuf_put_int(&b, "max_gap", s->st.max_gap);
  int n = s->nw < PS_STATUS_MAX_WORKERS ? s->nw : PS_STATUS_MAX_WORKERS;
  msgpack_packer *pk = net_msgbuf_put_key(&b, "w");
  msgpack_pack_array(pk, (size_t)n);
  for (int i = 0; i < n; i++) {
    const struct worker *w = s->w[i];
    msgpack_pack_array(pk, 4);
    msgpack_pack_bin(pk, NET_PUBKEY_BYTES);
    msgpack_pack_bin_body(pk, w->key, NET_PUBKEY_BYTES);
    msgpack_pack_int64(pk, w->clock);
    if (w->live) msgpack_pack_true(pk); else msgpack_pack_false(pk);
    if (w->done) msgpack_pack_true(pk); else msgpack_pack_false(pk);
  }
  if (net_conn_send_msg(c, &b)) log_debug("cannot answer the status request of %s", net_conn_peer_name(c));
  net_msgbuf_free(&b);
}

struct hello {
  char model[MODEL_SPEC_MAX], optim[PS_OPTIM_TEXT_MAX];
  uint64_t nparams, range, ranges, clock, steps;
  uint64_t stage, stages; /* absent: 0/1, the whole model */
};

/* Reads and checks a HELLO against this server. Returns 0, or -1 after
 * refusing the connection. */
static int hello_check(struct server *s, net_conn_t *c, const struct net_msg *m, struct hello *h) {
  if (m->version != PS_PROTO_VERSION) {
    reject(c, "protocol version %llu; this server speaks %d", (unsigned long long)m->version, PS_PROTO_VERSION);
    return -1;
  }
  if (ps_msg_str(m, "model", h->model, sizeof h->model) || ps_msg_str(m, "optim", h->optim, sizeof h->optim) ||
      net_msg_get_uint(m, "nparams", &h->nparams) || net_msg_get_uint(m, "range", &h->range) ||
      net_msg_get_uint(m, "ranges", &h->ranges) || net_msg_get_uint(m, "clock", &h->clock) ||
      net_msg_get_uint(m, "steps", &h->steps) || h->clock > (uint64_t)INT64_MAX / 4 ||
      h->steps > (uint64_t)INT64_MAX / 4) {
    reject(c, "malformed HELLO");
    return -1;
  }
  if (net_msg_get_uint(m, "stage", &h->stage) || net_msg_get_uint(m, "stages", &h->stages))
    h->stage = 0, h->stages = 1;
  int stages = s->cfg.stages > 1 ? s->cfg.stages : 1;
  if (h->stages != (uint64_t)stages || h->stage != (uint64_t)s->cfg.stage) {
    if (stages > 1 && h->stages > 1)
      reject(c, "this server holds stage %d/%d's parameters; the worker trains stage %llu/%llu", s->cfg.stage, stages,
             (unsigned long long)h->stage, (unsigned long long)h->stages);
    else if (stages > 1)
      reject(c, "this server holds stage %d/%d's parameters; the worker trains a whole replica", s->cfg.stage, stages);
    else
      reject(c, "this server holds the whole model's parameters; the worker is stage %llu/%llu of a group (start "
                "servers with --stage s/S)",
             (unsigned long long)h->stage, (unsigned long long)h->stages);
    return -1;
  }
  if (strcmp(h->model, s->spec) != 0 || h->nparams != (uint64_t)s->slice_len) {
    reject(c, "this server holds model %s (%lld parameters%s%s), not %s", s->spec, (long long)s->slice_len,
           s->stage_text[0] ? " of stage " : "", s->stage_text, h->model);
    return -1;
  }
  if (h->range != (uint64_t)s->cfg.range || h->ranges != (uint64_t)s->cfg.ranges) {
    reject(c, "this server holds range %d/%d, but the worker lists it as server %llu of %llu (--servers must list "
              "the servers in range order)",
           s->cfg.range, s->cfg.ranges, (unsigned long long)h->range, (unsigned long long)h->ranges);
    return -1;
  }
  if (strcmp(h->optim, s->optim_text) != 0) {
    reject(c, "optimizer settings differ: the server's are '%s', the worker's '%s'", s->optim_text, h->optim);
    return -1;
  }
  if (s->schedule_steps && h->steps != (uint64_t)s->schedule_steps) {
    reject(c, "the learning-rate schedule spans %lld steps here and %llu steps on the worker (same --max-steps or "
              "--epochs everywhere)",
           (long long)s->schedule_steps, (unsigned long long)h->steps);
    return -1;
  }
  return 0;
}

/* The worker of this key, a new one, or NULL after refusing it. */
static struct worker *hello_worker(struct server *s, net_conn_t *c, const struct hello *h) {
  const uint8_t *key = net_conn_peer_key(c);
  for (int i = 0; i < s->nw; i++) {
    struct worker *w = s->w[i];
    if (memcmp(w->key, key, NET_PUBKEY_BYTES) != 0) continue;
    if (w->conn) { /* the old connection is stale: end it without dropping the worker */
      net_conn_set_data(w->conn, NULL);
      net_conn_close(w->conn);
      w->conn = NULL;
    }
    if ((int64_t)h->clock < w->clock) {
      log_warn("worker %s is back at clock %llu, behind our %lld: taking its clock", w->name,
               (unsigned long long)h->clock, (long long)w->clock);
      w->clock = (int64_t)h->clock;
    }
    return w;
  }
  if (live_count(s) >= s->cfg.workers || s->nw >= PS_MAX_WORKERS) {
    reject(c, "already %d live workers (--workers %d)", live_count(s), s->cfg.workers);
    return NULL;
  }
  int64_t clock = (int64_t)h->clock, m = min_live_clock(s);
  /* A newcomer to a running SSP/ASP cluster enters at its slowest clock,
   * so that it does not hold everyone back while it catches up. */
  if (!s->bsp && s->assembled && m != INT64_MAX && clock < m) clock = m;
  return worker_add(s, key, clock);
}

static void on_hello(struct server *s, net_conn_t *c, const struct net_msg *m) {
  struct hello h;
  if (hello_check(s, c, m, &h)) return;
  struct worker *w = hello_worker(s, c, &h);
  if (!w) return;
  if (s->schedule_steps == 0 && h.steps > 0) {
    s->schedule_steps = (int64_t)h.steps;
    log_info("learning-rate schedule: %lld steps (from the first worker)", (long long)s->schedule_steps);
  }
  bool was_live = w->live;
  w->conn = c;
  w->live = true;
  w->done = false;
  w->grace_ms = 0;
  w->pull_pending = false;
  w->rx_at_ms = uv_now(&s->loop);
  net_conn_set_data(c, w);
  struct net_msgbuf b;
  net_msgbuf_init(&b, PS_MSG_WELCOME, PS_PROTO_VERSION);
  net_msgbuf_put_int(&b, "lo", s->lo - s->slice_lo); /* within the worker's vector */
  net_msgbuf_put_int(&b, "hi", s->hi - s->slice_lo);
  net_msgbuf_put_int(&b, "version", s->version);
  net_msgbuf_put_int(&b, "clock", w->clock);
  net_msgbuf_put_int(&b, "staleness", s->cfg.staleness);
  net_msgbuf_put_int(&b, "workers", s->cfg.workers);
  int rc = net_conn_send_msg(c, &b);
  net_msgbuf_free(&b);
  if (rc) {
    detach(s, w, "cannot answer its HELLO");
    return;
  }
  log_info("worker %s %s at clock %lld (version %lld, %d live)", w->name, was_live ? "connected" : "joined",
           (long long)w->clock, (long long)s->version, live_count(s));
  try_round(s);
  serve_pulls(s);
}

static void on_pull(struct server *s, struct worker *w, const struct net_msg *m) {
  uint64_t clock, wire;
  bool final;
  if (net_msg_get_uint(m, "clock", &clock) || net_msg_get_bool(m, "final", &final) ||
      net_msg_get_uint(m, "wire", &wire) || clock > (uint64_t)INT64_MAX / 4 || wire > 255 ||
      net_dtype_bytes((enum net_dtype)wire, 1) == 0) {
    log_warn("malformed PULL from %s: dropping it", w->name);
    detach(s, w, "malformed PULL");
    return;
  }
  w->pull_pending = true;
  w->pull_want = (int64_t)clock;
  w->pull_final = final;
  w->pull_wire = (enum net_dtype)wire;
  serve_pulls(s);
}

static void on_done(struct server *s, struct worker *w) {
  log_info("worker %s is done at clock %lld", w->name, (long long)w->clock);
  w->done = true;
  w->live = false;
  s->any_done = true;
  try_round(s);
  serve_pulls(s);
  check_finished(s);
}

static void on_message(net_conn_t *c, const struct net_msg *m, void *ud) {
  struct server *s = ud;
  struct worker *w = net_conn_data(c);
  if (!w) {
    if (m->type == PS_MSG_HELLO) on_hello(s, c, m);
    else if (m->type == PS_MSG_STATUS_REQ) send_status(s, c);
    else reject(c, "expected HELLO first, got message type %llu", (unsigned long long)m->type);
    return;
  }
  switch (m->type) {
  case PS_MSG_PULL: on_pull(s, w, m); break;
  case PS_MSG_DONE: on_done(s, w); break;
  case PS_MSG_PING: break;
  default:
    log_warn("unexpected message type %llu from %s: dropping it", (unsigned long long)m->type, w->name);
    detach(s, w, "protocol violation");
  }
}

static int on_bulk_begin(net_conn_t *c, const struct net_bulk_info *info, float **dst, void **dst_arg, void *ud) {
  struct server *s = ud;
  struct worker *w = net_conn_data(c);
  struct ps_meta m;
  if (!w || ps_meta_read(info->meta, info->meta_len, &m) || m.kind != PS_KIND_GRAD ||
      info->count != (uint64_t)s->len || m.a < 0 || m.a > INT64_MAX / 4 || m.b < 1 || m.b > (1ll << 40)) {
    log_warn("refusing a transfer from %s: not a gradient of our range", net_conn_peer_name(c));
    return RUMOR_EPROTO;
  }
  struct rx *r = malloc(sizeof *r);
  float *buf = malloc((size_t)(s->len ? s->len : 1) * sizeof(float));
  if (!r || !buf) {
    free(r), free(buf);
    return -ENOMEM;
  }
  r->buf = buf;
  r->index = m.a;
  r->rows = m.b;
  *dst = buf;
  *dst_arg = r;
  return 0;
}

static void on_bulk_done(net_conn_t *c, uint64_t id, int status, float *dst, void *dst_arg, void *ud) {
  (void)id, (void)dst;
  struct server *s = ud;
  struct rx *r = dst_arg;
  struct worker *w = net_conn_data(c);
  if (status == 0 && w && !s->stopping) take_grad(s, w, r);
  free(r->buf);
  free(r);
}

static void on_close(net_conn_t *c, int status, const char *detail, void *ud) {
  struct server *s = ud;
  struct worker *w = net_conn_data(c);
  if (!w) return;
  w->conn = NULL;
  w->pull_pending = false;
  if (w->done || s->stopping) return;
  char why[PS_WHY_MAX];
  snprintf(why, sizeof why, "its connection closed (%s%s%s)", status ? rumor_strerror(status) : "gracefully",
           detail && *detail ? ": " : "", detail ? detail : "");
  drop(s, w, why);
}

/* ============================================================================
 * The loop
 * ========================================================================== */

static void on_tick_closed(uv_handle_t *h) { (void)h; }

static void on_net_closed(void *arg) {
  struct server *s = arg;
  s->net = NULL;
  uv_close((uv_handle_t *)&s->tick, on_tick_closed);
}

/* Saves and closes everything; the loop then runs out. */
static void begin_stop(struct server *s, const char *why) {
  if (s->stopping) return;
  s->stopping = true;
  log_info("stopping (%s) at version %lld", why, (long long)s->version);
  struct rumor_err e = {0};
  int rc = save_checkpoint(s, &e);
  if (rc && !s->rc) {
    s->rc = rc;
    s->err = e;
  } else if (rc == 0) {
    log_info("checkpoint saved to %s (version %lld)", s->cfg.checkpoint, (long long)s->version);
  }
  uv_timer_stop(&s->tick);
  net_close(s->net, on_net_closed, s);
}

/* Asks the next tick to stop once every worker is done or gone (not now:
 * this runs inside net's callbacks, where the net must not be closed). */
/* The run is over when no worker is live, one at least said DONE, and
 * every worker of --workers has said DONE or was dropped: a fast worker
 * that finishes before a slow one has even connected must not end it. */
static void check_finished(struct server *s) {
  if (s->stopping || !s->any_done || live_count(s) > 0) return;
  int ended = 0;
  for (int i = 0; i < s->nw; i++) ended += s->w[i]->done || !s->w[i]->live;
  if (ended >= s->cfg.workers) s->finish = true;
}

/* Drops workers silent for longer than the timeout, and restored ones that
 * did not come back in time. */
static void check_liveness(struct server *s, uint64_t now) {
  for (int i = 0; i < s->nw && !s->stopping; i++) {
    struct worker *w = s->w[i];
    if (w->conn) {
      struct net_conn_stats cs;
      net_conn_stats_get(w->conn, &cs);
      if (cs.bytes_in != w->rx_bytes) {
        w->rx_bytes = cs.bytes_in;
        w->rx_at_ms = now;
      } else if (now - w->rx_at_ms >= s->cfg.worker_timeout_ms) {
        char why[96];
        snprintf(why, sizeof why, "silent for %llu ms", (unsigned long long)(now - w->rx_at_ms));
        detach(s, w, why);
      }
    } else if (w->live && w->grace_ms && clock_now_ns() / 1000000 >= w->grace_ms) {
      drop(s, w, "it did not come back after the restart");
    }
  }
}

static void ping_all(struct server *s) {
  for (int i = 0; i < s->nw; i++) {
    if (!s->w[i]->conn) continue;
    struct net_msgbuf b;
    net_msgbuf_init(&b, PS_MSG_PING, PS_PROTO_VERSION);
    /* A full queue is fine: the transfer in it keeps the link busy anyway. */
    if (net_conn_send_msg(s->w[i]->conn, &b)) log_debug("no room for a PING to %s", s->w[i]->name);
    net_msgbuf_free(&b);
  }
}

static void on_tick(uv_timer_t *h) {
  struct server *s = h->data;
  if (s->cfg.stop && atomic_load(s->cfg.stop)) {
    begin_stop(s, "signal");
    return;
  }
  if (s->finish) {
    begin_stop(s, "every worker is done or gone");
    return;
  }
  uint64_t now = uv_now(&s->loop);
  check_liveness(s, now);
  check_finished(s); /* also after a restart where every worker had finished */
  if (s->stopping) return;
  if (now - s->last_ping_ms >= PS_PING_MS) {
    s->last_ping_ms = now;
    ping_all(s);
  }
  if (now - s->last_progress_ms >= PROGRESS_MS) {
    s->last_progress_ms = now;
    int64_t m = min_live_clock(s);
    log_info("version %lld, %d live workers, slowest clock %lld, largest gap at a release %lld",
             (long long)s->version, live_count(s), m == INT64_MAX ? -1ll : (long long)m, (long long)s->st.max_gap);
  }
}

/* The workers' vector within the model: stage s's units under the group's
 * balanced split (as every stage computes it), or the whole model. */
static int stage_slice(struct server *s, const struct model_spec *spec, const struct model_table *tab,
                       struct rumor_err *e) {
  s->slice_lo = 0;
  s->slice_len = tab->nparams;
  if (s->cfg.stages <= 1) return 0;
  struct pipe_split split;
  int rc = pipe_split_balance(spec, s->cfg.stages, &split, e);
  if (rc) return rumor_err_prefix(e, "--stage %d/%d", s->cfg.stage, s->cfg.stages);
  s->slice_lo = tab->unit_offset[split.first[s->cfg.stage]];
  s->slice_len = tab->unit_offset[split.first[s->cfg.stage + 1]] - s->slice_lo;
  snprintf(s->stage_text, sizeof s->stage_text, "%d/%d", s->cfg.stage, s->cfg.stages);
  return 0;
}

/* Builds the state: model, range, tensors, optimizer, and the checkpoint's
 * contents when it exists. */
static int server_init(struct server *s, const struct ps_server_config *cfg, struct rumor_err *e) {
  memset(s, 0, sizeof *s);
  s->cfg = *cfg;
  s->bsp = cfg->staleness == 0;
  s->schedule_steps = cfg->schedule_steps;
  if (cfg->checkpoint_every < 1) s->cfg.checkpoint_every = 1;
  /* The server saves one file; a bad destination is refused now, not at
   * every save while it serves. */
  if (checkpoint_is_dir(cfg->checkpoint))
    return rumor_err_set(e, RUMOR_EFORMAT, "--checkpoint %s: a parameter server saves one file, not a directory",
                         cfg->checkpoint);
  if (checkpoint_check_dest(cfg->checkpoint, e)) return rumor_err_prefix(e, "--checkpoint");
  struct model_spec spec;
  int rc = model_spec_parse(cfg->model, &spec, e);
  if (rc) return rumor_err_prefix(e, "--model");
  model_spec_format(&spec, s->spec, sizeof s->spec);
  ps_optim_text(&cfg->optim, s->optim_text, sizeof s->optim_text);
  struct model_table tab;
  model_table_build(&spec, &tab);
  s->P = tab.nparams;
  if ((rc = stage_slice(s, &spec, &tab, e))) goto out;
  if (s->slice_len < cfg->ranges) {
    rc = rumor_err_set(e, RUMOR_EFORMAT, "--range: %d ranges for %lld parameters%s%s", cfg->ranges,
                       (long long)s->slice_len, s->stage_text[0] ? " of stage " : "", s->stage_text);
    goto out;
  }
  ps_range_bounds(s->slice_len, cfg->range, cfg->ranges, &s->lo, &s->hi);
  s->lo += s->slice_lo;
  s->hi += s->slice_lo;
  s->len = s->hi - s->lo;
  if ((rc = tensor_backend_open("cpu", &s->be, e))) goto out;
  if ((rc = tensor_alloc(&s->params, s->be, TENSOR_F32, 1, &s->len, e)) ||
      (rc = tensor_alloc(&s->grad, s->be, TENSOR_F32, 1, &s->len, e)) ||
      (rc = optim_init_range(&s->optim, &s->cfg.optim, &tab, s->lo, s->hi, s->be, e)))
    goto out;
  s->sum = xcalloc((size_t)s->len, sizeof(float));
  rc = load_checkpoint(s, e);
  if (rc == 1) {
    log_info("no checkpoint at %s: starting from the initial parameters of seed %llu", cfg->checkpoint,
             (unsigned long long)cfg->seed);
    rc = init_params(s, &spec, e);
  } else if (rc == 0) {
    log_info("resumed from %s at version %lld with %d workers known", cfg->checkpoint, (long long)s->version, s->nw);
  }
out:
  model_table_free(&tab);
  return rc;
}

static void server_free(struct server *s) {
  for (int i = 0; i < s->nw; i++) {
    free(s->w[i]->sendbuf);
    free(s->w[i]);
  }
  free(s->w);
  free(s->sum);
  if (s->optim.spans) optim_free(&s->optim);
  tensor_free(&s->params);
  tensor_free(&s->grad);
  if (s->be) tensor_backend_close(s->be);
}

/* The net and the listener on our loop. */
static int server_listen(struct server *s, struct rumor_err *e) {
  struct net_config nc;
  net_config_defaults(&nc);
  nc.identity = s->cfg.identity;
  nc.cluster_key = s->cfg.cluster_key;
  nc.allow = s->cfg.allow;
  nc.max_msg_bytes = PS_MAX_MSG_BYTES;
  nc.max_bulk_bytes = (uint64_t)s->len * sizeof(float) + 4096;
  nc.idle_timeout_ms = s->cfg.worker_timeout_ms; /* connections that never say HELLO */
  if (s->cfg.handshake_timeout_ms) nc.handshake_timeout_ms = s->cfg.handshake_timeout_ms;
  nc.heartbeat_ms = s->cfg.heartbeat_ms;
  nc.dead_after_ms = s->cfg.dead_after_ms;
  const struct net_callbacks cbs = {.on_message = on_message,
                                    .on_bulk_begin = on_bulk_begin,
                                    .on_bulk_done = on_bulk_done,
                                    .on_close = on_close};
  int rc = net_init(&s->net, &s->loop, &nc, &cbs, s, e);
  if (rc) return rc;
  if ((rc = net_listen(s->net, s->cfg.listen, e))) {
    rumor_err_prefix(e, "--listen");
    net_close(s->net, NULL, NULL);
    s->net = NULL;
    return rc;
  }
  return 0;
}

int ps_server_run(const struct ps_server_config *cfg, struct ps_server_stats *st, struct rumor_err *e) {
  RUMOR_ASSERT(cfg->workers >= 1 && cfg->checkpoint && cfg->worker_timeout_ms >= PS_MIN_TIMEOUT_MS);
  struct server *s = xcalloc(1, sizeof *s);
  int rc = server_init(s, cfg, e);
  if (rc == 0 && (rc = uv_loop_init(&s->loop)) != 0) rc = rumor_err_set(e, rc, "uv_loop_init: %s", uv_strerror(rc));
  else if (rc == 0 && (rc = server_listen(s, e)) != 0) {
    uv_run(&s->loop, UV_RUN_DEFAULT); /* the net's close */
    (void)uv_loop_close(&s->loop);
  }
  if (rc) {
    server_free(s);
    free(s);
    return rc;
  }
  const char *colon = strrchr(cfg->listen, ':');
  char addr[160], id[NET_PUBKEY_STR_LEN + 1];
  snprintf(addr, sizeof addr, "%.*s:%d", colon ? (int)(colon - cfg->listen) : 0, cfg->listen,
           net_listen_port(s->net));
  net_pubkey_format(id, cfg->identity->pk);
  log_info("serving range %d/%d%s%s ([%lld, %lld) of %lld parameters) on %s, %s, %d workers", cfg->range,
           cfg->ranges, s->stage_text[0] ? " of stage " : "", s->stage_text, (long long)s->lo, (long long)s->hi,
           (long long)s->P, addr,
           s->bsp ? "BSP" : cfg->staleness < 0 ? "ASP (no bound)" : "SSP", cfg->workers);
  if (cfg->on_listen) cfg->on_listen(addr, id, cfg->on_listen_arg);
  uv_timer_init(&s->loop, &s->tick);
  s->tick.data = s;
  uv_timer_start(&s->tick, on_tick, TICK_MS, TICK_MS);
  uv_run(&s->loop, UV_RUN_DEFAULT);
  int lc = uv_loop_close(&s->loop);
  RUMOR_ASSERT(lc == 0); /* every handle closed */
  s->st.version = s->version;
  s->st.workers_seen = s->nw;
  if (st) *st = s->st;
  rc = s->rc;
  if (rc) *e = s->err;
  server_free(s);
  free(s);
  return rc;
}
