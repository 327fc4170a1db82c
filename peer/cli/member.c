/* A gossiping member: the gossip runtime, its buffers and the sync path of
 * one trainer, as `rumor peer` and each stage of a group run them. */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

int member_start(struct member *mb, struct trainer *t, const struct net_flags *nf, const struct net_keys *keys,
                 const struct gossip_flags *gf, const char *label, uint64_t seed, const char *role,
                 const struct json_t *extra, struct rumor_err *e) {
  int64_t P = trainer_shard_floats(t), S = trainer_state_floats(t);
  struct sync_gossip_plan plan;
  sync_scheme_of(&mb->setup.sync)->plan(&mb->setup.sync, P, &plan);
  int64_t X = (int64_t)plan.buf_floats;
  mb->be = t->be;
  mb->mine = tensor_host_alloc(t->be, (size_t)X * sizeof(float));
  mb->theirs = tensor_host_alloc(t->be, (size_t)X * sizeof(float));
  mb->donor = tensor_host_alloc(t->be, (size_t)S * sizeof(float));
  if (!mb->mine || !mb->theirs || !mb->donor)
    return rumor_err_set(e, -ENOMEM, "cannot allocate %.1f MiB of host buffers for gossip",
                         (double)(2 * X + S) * 4 / (1 << 20));
  /* Touch every page now, before joining: otherwise the kernel faults them
   * in during the first exchange or the state pull, on the network thread
   * (measured: a 436 MB pull at 0.3 GB/s, most of it clearing fresh pages
   * inside the transfer; tests/bench/bench-join.sh). The donor buffer is
   * the pull's destination and the donations' source, so it is touched
   * too, though a peer that neither pulls nor donates never reads it. */
  memset(mb->mine, 0, (size_t)X * sizeof(float));
  memset(mb->theirs, 0, (size_t)X * sizeof(float));
  memset(mb->donor, 0, (size_t)S * sizeof(float));
  struct gossip_config gc;
  gossip_config_default(&gc);
  net_flags_gossip_config(nf, keys, &gc);
  gossip_flags_gossip_config(gf, &mb->setup, &gc);
  gc.sync = plan.protocol;
  gc.wire = plan.wire;
  gc.gather_floats = plan.gather_floats;
  gc.scheme = sync_scheme_of(&mb->setup.sync)->name;
  gc.role = GOSSIP_ROLE_PEER;
  gc.nparams = (uint64_t)P;
  gc.state_floats = (uint64_t)S;
  gc.optimizer = optim_kind_name(t->optim.cfg.kind);
  gc.seed = seed;
  gc.xch_mine = mb->mine;
  gc.xch_theirs = mb->theirs;
  gc.donor_buf = mb->donor;
  /* The label members must share: members of different schemes (or
   * outer settings) never mix. gossip_start copies it. */
  char full[GOSSIP_LABEL_MAX + 1];
  const char *scheme = plan.label;
  if ((size_t)snprintf(full, sizeof full, "%s%s", label, scheme) >= sizeof full)
    return rumor_err_set(e, RUMOR_ETOOBIG, "the cluster label '%s%s' is longer than %d characters", label, scheme,
                         GOSSIP_LABEL_MAX);
  gc.model = full;
  int rc = gossip_start(&mb->g, &gc, e);
  if (rc) return rc;
  json_t *line = json_object();
  json_text_set(line, "listen", json_text_str(gossip_advertised(mb->g)));
  json_text_set(line, "id", json_text_str(gossip_self_id(mb->g)));
  json_text_set(line, "role", json_text_str(role));
  json_text_set(line, "metrics_port", json_integer(gossip_metrics_port(mb->g)));
  if (extra) {
    const char *key;
    json_t *v;
    /* json_object_foreach takes a non-const object; it only reads it. */
    json_object_foreach((json_t *)extra, key, v) json_text_set(line, key, json_incref(v));
  }
  json_text_print(stdout, line);
  return 0;
}

/* Takes the state pulled into the donor buffer (at *pos) unless the pull
 * policy refuses it (sync_pull_take); a refused donor is struck and
 * another asked, and after SYNC_PULL_ASKS refusals we start from our own. */
static int take_pulled(struct member *mb, struct trainer *t, struct gossip_train_pos *pos, struct rumor_err *e) {
  int jr = 0;
  struct sync_own_state own;
  sync_own_keep(&own, t);
  char why[200];
  for (int asked = 1; jr == 0; asked++) {
    if (sync_pull_take(t, &own, mb->donor, why, sizeof why)) {
      char loss[96] = "";
      if (!isnan(own.pulled_loss))
        snprintf(loss, sizeof loss, ": loss %.4f on %lld training %s (our own: %.4f)", own.pulled_loss,
                 (long long)own.rows, trainer_row_noun(t), own.loss);
      log_info("starting from the cluster's state at step %llu (epoch %llu)%s", (unsigned long long)pos->step,
               (unsigned long long)pos->epoch + 1, loss);
      break;
    }
    log_warn("refused the cluster's state at step %llu: %s (a broken or hostile donor)", (unsigned long long)pos->step,
             why);
    gossip_refuse_donation(mb->g, "it donated a state worse than a fresh model");
    if (asked == SYNC_PULL_ASKS) {
      jr = 1;
      break;
    }
    jr = gossip_state_pull(mb->g, NULL, 0, mb->donor, pos, signals_stop_flag(), e);
    if (jr < 0 && !signals_stop_requested()) {
      log_warn("no other donor: %s", e->msg);
      jr = 1;
    }
  }
  return jr;
}

int member_join(struct member *mb, struct trainer *t, const struct gossip_flags *gf, bool own_state,
                struct gossip_train_pos *pos, struct rumor_err *e) {
  bool pull = !gf->no_state_pull && !own_state;
  int jr = gossip_join_wait(mb->g, pull ? mb->donor : NULL, pos, signals_stop_flag(), e);
  return jr == 0 ? take_pulled(mb, t, pos, e) : jr;
}

int member_ready(struct member *mb, struct trainer *t, struct rumor_err *e) {
  mb->setup.sync.stop = signals_stop_flag();
  int rc = sync_init(&mb->sync, mb->g, t, &mb->setup.sync, e);
  if (rc) return rc;
  mb->have_sync = true;
  gossip_ready(mb->g);
  return sync_start(&mb->sync, e);
}

int member_wait_peers(struct member *mb, const struct gossip_flags *gf, const char *what,
                      bool (*failed)(void *arg, struct rumor_err *e), void *arg, struct rumor_err *e) {
  if (gf->wait_peers <= 1) return 0;
  /* Hold training until the cluster is assembled, serving donations to
   * the members still joining (they pull this state). */
  double deadline = clock_now_s() + (double)gf->wait_peers_ms / 1e3;
  while ((int64_t)gossip_ready_peers(mb->g) < gf->wait_peers) {
    if (signals_stop_requested())
      return rumor_err_set(e, RUMOR_ECANCELED, "interrupted by signal %d", signals_stop_requested());
    if (failed && failed(arg, e)) return RUMOR_ECANCELED;
    if (clock_now_s() > deadline)
      return rumor_err_set(e, RUMOR_ETIMEDOUT, "only %zu of %lld %s ready after %lld ms", gossip_ready_peers(mb->g),
                           (long long)gf->wait_peers, what, (long long)gf->wait_peers_ms);
    int rc = sync_boundary(&mb->sync, e);
    if (rc) return rc;
    const struct timespec tick = {0, 10 * 1000000};
    nanosleep(&tick, NULL);
  }
  log_info("%lld %s ready: starting", (long long)gf->wait_peers, what);
  return 0;
}

int member_train(struct member *mb, struct trainer *t, double *secs, int64_t *steps, struct rumor_err *e) {
  return sync_train(&mb->sync, t, &mb->changes_at_end, secs, steps, e);
}

int sync_train(struct sync *s, struct trainer *t, uint64_t *changes_at_end, double *secs, int64_t *steps,
               struct rumor_err *e) {
  double t0 = clock_now_s();
  int64_t step0 = t->st.step;
  bool first = true;
  int rc = 0;
  while (!trainer_done(t) && !signals_stop_requested()) {
    rc = trainer_step(t, e);
    if (rc) break;
    if (first) {
      if (trainer_has_loss(t)) log_info("first step: loss %.4f at step %lld", t->last_loss, (long long)t->st.step);
      else log_info("first step done (the loss is on the last stage)");
      first = false;
    }
    /* The last step saved its checkpoint: a change after it makes it stale. */
    if (trainer_done(t) && changes_at_end) *changes_at_end = s->changes;
    if ((rc = sync_boundary(s, e))) break;
  }
  *secs = clock_now_s() - t0;
  *steps = t->st.step - step0;
  /* A stop inside a step or a round (an all-reduce, a pipeline's wait) is
   * no failure: the caller sees the signal. */
  return rc == RUMOR_ECANCELED && signals_stop_requested() ? 0 : rc;
}

int member_finish(struct member *mb, struct trainer *t, double secs, int64_t steps,
                  bool (*failed)(void *arg, struct rumor_err *e), void *arg, struct rumor_err *e) {
  struct sync_finish_args f = {.max_s = mb->setup.finish_wait_s,
                               .step_s = steps > 0 ? secs / (double)steps : 0,
                               .stop = signals_stop_flag(),
                               .failed = failed,
                               .arg = arg};
  int rc = sync_finish(&mb->sync, &f, e);
  if (rc) return rc;
  /* The result line evaluates the parameters as they are now: the
   * checkpoint must hold the same. */
  return mb->sync.changes != mb->changes_at_end ? trainer_checkpoint(t, e) : 0;
}

void member_leave(struct member *mb, int64_t linger_ms) {
  if (mb->g) gossip_stop(mb->g, (uint32_t)linger_ms);
  mb->g = NULL;
}

void member_free(struct member *mb, int64_t linger_ms) {
  member_leave(mb, linger_ms);
  if (mb->have_sync) sync_free(&mb->sync);
  mb->have_sync = false;
  if (mb->be) {
    tensor_host_free(mb->be, mb->mine);
    tensor_host_free(mb->be, mb->theirs);
    tensor_host_free(mb->be, mb->donor);
  }
  mb->mine = mb->theirs = mb->donor = NULL;
}
