/* `--sync gossip --outer K`: NoLoCo (sync.h, "Outer optimizers"). Every H
 * steps a member exchanges its parameters with one random partner through
 * the exchange slot and takes g = θ − (φ + φ_j)/2 as its outer gradient:
 *
 *   g = θ − φ − w·(φ_j − φ),   w = ½ (times clipping's scale with --clip)
 *
 * the difference φ_j − φ arriving as gossip averaging's does. Between
 * rounds a member answers no request (its parameters are not a round's
 * end); at a round boundary it keeps its snapshot ready, and an active
 * member asks a passive one (the bipartite graph of links.c), so the pairs
 * form among members at the same boundary. Without --outer-overlap the
 * member waits there for one exchange, at most --max-hold-ms while none is
 * under way; with it, the snapshot of the boundary is what it answers all
 * round long, and the exchange that lands is applied at the next boundary. */
#include <math.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "peer/sync/sync_impl.h"
#include "util/json_text.h"

#define NOLOCO_ASK_MIN_S 0.002 /* pacing of a member's own requests, doubling ... */
#define NOLOCO_ASK_MAX_S 0.05  /* ... up to this */

/* The snapshot the partner gets: the parameters at this round's boundary
 * (with --outer-overlap, kept in outer.prev while training goes on). */
static void snapshot(struct sync *s) {
  struct trainer *t = s->t;
  struct tensor params = trainer_shard_params(t);
  const struct tensor *src = s->cfg.outer.overlap ? &s->outer.prev : &params;
  tensor_copy_to_host(src, 0, gossip_xch_mine(s->g), (size_t)trainer_shard_floats(t) * sizeof(float));
}

/* The step of this round's boundary (the snapshot's tag). */
static uint64_t boundary_step(const struct sync *s) {
  int64_t step = s->t->st.step;
  return (uint64_t)(s->cfg.outer.overlap ? step - step % s->cfg.outer.local_steps : step);
}

/* One turn of the slot (gossip_xch_begin): copies our snapshot when an
 * exchange wants one (our own request, or a partner's while we have one:
 * `have_snapshot`), makes it ready for passive partners' requests when
 * `offer`, and declines a partner's request between rounds. The turn is
 * the caller's (an APPLY in particular). */
static void serve(struct sync *s, bool want, bool have_snapshot, bool offer, struct gossip_xch_turn *turn) {
  gossip_xch_begin(s->g, want, offer && have_snapshot, turn);
  if (turn->work == GOSSIP_XCH_SNAPSHOT && !have_snapshot && turn->partner_asked) {
    gossip_xch_decline(s->g, "not at an outer round's boundary");
    turn->work = GOSSIP_XCH_NONE;
  } else if (turn->work == GOSSIP_XCH_SNAPSHOT || turn->refresh) {
    snapshot(s);
    gossip_xch_copied(s->g, boundary_step(s));
  }
}

/* The round's outer gradient into outer.work: θ − φ_b − w·d, φ_b our
 * snapshot (the parameters now, or outer.prev overlapping), d the
 * partner's difference when an exchange is to be applied (`apply`). A
 * rejected one is reported and the round is our own. */
static void gradient(struct sync *s, const struct gossip_xch_turn *apply) {
  struct sync_outer *o = &s->outer;
  struct tensor params = trainer_shard_params(s->t);
  tensor_copy(&o->work, &o->anchor);
  tensor_axpby(-1.0f, s->cfg.outer.overlap ? &o->prev : &params, 1.0f, &o->work);
  int rc = -1;
  if (apply) {
    char why[200];
    float w;
    rc = sync_xch_judge(s, apply, 0.5f, &w, why, sizeof why);
    if (rc == 0) tensor_axpby(-w, sync_xch_delta_dev(s), 1.0f, &o->work);
    sync_xch_done(s, rc, why);
  }
  /* Our parameters went out and the partner's came in, in the exchange's
   * encoding (nothing when no exchange completed). */
  struct gossip_stats gs;
  gossip_stats_get(s->g, &gs);
  o->last_bytes = apply ? (double)(gs.exchange_bytes_sent + gs.exchange_bytes_received) : 0.0;
  o->alone_last = rc != 0;
  if (rc != 0) o->alone++;
}

/* Without --outer-overlap: at the boundary, until one exchange lands (or
 * none is under way after --max-hold-ms, or no partner is left). Returns
 * true with its turn in *turn when one is to be applied. */
static bool wait_for_partner(struct sync *s, struct gossip_xch_turn *turn) {
  double t0 = clock_now_s(), next_ask = t0, pause = NOLOCO_ASK_MIN_S;
  bool offer = true;
  while (!sync_stopped(s)) {
    double now = clock_now_s();
    bool ask = !gossip_xch_in_flight(s->g) && now >= next_ask;
    if (ask) next_ask = now + pause, pause = fmin(2 * pause, NOLOCO_ASK_MAX_S);
    serve(s, ask, true, offer, turn);
    offer = false;
    if (turn->work == GOSSIP_XCH_APPLY) return true;
    if (!turn->in_flight && (now - t0 >= s->cfg.max_hold_s || gossip_live_partners(s->g) == 0)) {
      if (gossip_xch_unready(s->g)) break; /* else a partner just took our snapshot: see it through */
    }
    const struct timespec tick = {0, 200 * 1000};
    nanosleep(&tick, NULL);
    sync_idle(s);
  }
  gossip_xch_unready(s->g);
  return false;
}

/* With --outer-overlap: the exchange of the round that ends here, when one
 * is still under way (counted in outer_wait_s). Returns true with its turn
 * in *turn when one is to be applied. */
static bool land(struct sync *s, struct gossip_xch_turn *turn) {
  double t0 = clock_now_s();
  for (;;) {
    serve(s, false, true, false, turn);
    if (turn->work == GOSSIP_XCH_APPLY || !turn->in_flight || sync_stopped(s)) break;
    const struct timespec tick = {0, 200 * 1000};
    nanosleep(&tick, NULL);
    sync_idle(s);
  }
  s->outer.wait_s += clock_now_s() - t0;
  gossip_xch_unready(s->g);
  return turn->work == GOSSIP_XCH_APPLY;
}

static int noloco_boundary(struct sync *s, struct rumor_err *e) {
  (void)e;
  struct sync_outer *o = &s->outer;
  bool overlap = s->cfg.outer.overlap;
  struct gossip_xch_turn turn;
  if (!sync_outer_due(s)) {
    /* Between boundaries: overlapping, our ready snapshot still serves (and
     * a failed exchange of ours is asked again); otherwise requests are
     * declined, and an exchange landing late is not ours to apply. */
    double now = clock_now_s();
    bool want = overlap && o->in_flight && !gossip_xch_in_flight(s->g) && now >= o->next_ask_s;
    if (want) o->next_ask_s = now + NOLOCO_ASK_MAX_S;
    serve(s, want, overlap && o->in_flight, false, &turn);
    if (turn.work == GOSSIP_XCH_APPLY && !overlap)
      gossip_xch_apply_done(s->g, 1, "it arrived after our round ended"); /* not ours to apply; no blame */
    return 0;
  }
  if (o->in_flight) { /* overlapping: the round that ends here */
    bool got = land(s, &turn);
    gradient(s, got ? &turn : NULL);
    sync_outer_step(s);
  }
  if (overlap && !trainer_done(s->t)) {
    struct tensor params = trainer_shard_params(s->t);
    tensor_copy(&o->prev, &params);
    o->in_flight = true;
    sync_outer_store(s);
    serve(s, false, true, true, &turn); /* offered; the next boundary asks, when active */
    return 0;
  }
  double t0 = clock_now_s();
  bool got = wait_for_partner(s, &turn);
  o->wait_s += clock_now_s() - t0;
  gradient(s, got ? &turn : NULL);
  sync_outer_step(s);
  return 0;
}

static void noloco_plan(const struct sync_config *c, int64_t nparams, struct sync_gossip_plan *out) {
  sync_outer_plan(c, "noloco", out);
  out->protocol = GOSSIP_SYNC_GOSSIP;
  out->buf_floats = (uint64_t)nparams;
}

static int noloco_init(struct sync *s, struct rumor_err *e) {
  int rc = sync_outer_init(s, e);
  if (rc) return rc;
  if ((rc = sync_xch_init(s, false, e))) {
    sync_outer_free(s);
    return rc;
  }
  return 0;
}

static void noloco_free(struct sync *s) {
  sync_xch_free(s);
  sync_outer_free(s);
}

static void noloco_result(const struct sync *s, const struct gossip_stats *gs, json_t *o) {
  json_text_set(o, "exchanges", json_integer((json_int_t)gs->exchanges_ok));
  json_text_set(o, "exchanges_failed", json_integer((json_int_t)gs->exchanges_failed));
  json_text_set(o, "exchanges_rejected", json_integer((json_int_t)gs->exchanges_rejected));
  json_text_set(o, "exchanges_clipped", json_integer((json_int_t)s->x.clip.clipped));
  sync_outer_result(s, o);
  json_text_set(o, "outer_alone", json_integer((json_int_t)s->outer.alone));
}

const struct sync_scheme sync_scheme_noloco = {
    .name = "noloco",
    .extra = sync_outer_extra, /* a run ends with the last step's round: no finish */
    .plan = noloco_plan,
    .init = noloco_init,
    .boundary = noloco_boundary,
    .result = noloco_result,
    .free = noloco_free,
};
