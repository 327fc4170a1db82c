/*
 * The testing build only (rumor_gossip_testing, RUMOR_TESTING defined): a
 * member that holds valid keys but misbehaves on purpose, so that the
 * reliability tests can check what honest peers do about it. The release
 * build has none of this, and no branch of its data path leads here.
 *
 * The attack comes from the environment, RUMOR_TEST_ATTACK=KIND, read when
 * a peer's runtime starts (the testing binary's --attack KIND sets it, and
 * the stages a launcher starts inherit it). Kinds:
 *
 * Changing a copy of our snapshot once it is taken (loop thread, before it
 * is sent; the snapshot itself stays ours):
 *   nan       a few values set to NaN
 *   inf       a few values set to +Inf
 *   scale     the model multiplied by -1000
 *   signflip  the model multiplied by -1 (passes the distance check: only
 *             clipping limits it)
 *   replay    records its first snapshot taken at step TEST_REPLAY_STEP or
 *             later (a round of training, not the initialisation), stays
 *             honest for TEST_REPLAY_AFTER more, then sends the recorded one
 *             again, with its old step, every time
 * Acting in the protocol:
 *   short     sends one value fewer than the model has
 *   flood     every tick (20 ms), each live peer gets TEST_FLOOD_REQS
 *             exchange requests (for exchanges that never follow) and one new
 *             connection, closed as soon as it is up: about 1000 requests and
 *             50 connections a second per peer, far above the rate limits.
 *   baddonor  a state donated to a newcomer is multiplied by -1000 (the
 *             exchanges stay honest)
 *   loseready the first RING_READY of each all-reduce attempt is not sent,
 *             as if the link had lost it (only RING_READY_RESEND_MS's
 *             repetitions go out)
 *   badfin    every exchange transfer lists a finished member whose key is
 *             7 bytes long (exchange.c, "finished members")
 *   freeze    all-reduce only: the whole process stops itself (SIGSTOP, as
 *             `kill -STOP` would) once, as its loop thread is about to start
 *             the round of step TEST_FREEZE_STEP, and waits for SIGCONT. Its
 *             last round is complete: every piece it sent was confirmed, and
 *             its confirmations of the pieces it received went to the
 *             sockets in earlier callbacks. So every other member completes
 *             that round too, and all are at one step: a test can tell
 *             exactly when the others are ahead of it.
 *   freezexch gossip averaging: the whole process stops itself (SIGSTOP)
 *             once, in its first exchange of a snapshot of step
 *             TEST_FREEZE_XCH_STEP or later (training, with a steady stream
 *             of exchanges, by then), as the partner's parameters begin to
 *             arrive: the exchange is agreed on both sides and under way,
 *             its transfers unfinished. It logs the partner first. A test
 *             that kills it then kills a member mid-exchange, for certain.
 *   slowconfirm all-reduce: the confirmations that its pieces of a round's
 *             last phase were delivered are taken TEST_SLOW_CONFIRM_MS late
 *             (ring.c holds them; at once when their connection closes, as
 *             a real confirmation comes before the close), so it stays in
 *             each round that long after its successor, which got
 *             everything, completed it: the window in which failing the
 *             round would leave it a round behind (ring.c,
 *             others_may_complete).
 *   nangrad   all-reduce: the first float of its contribution to every
 *             reduce round is NaN, so that every member's sum is NaN
 *             while its own parameters stay finite.
 *   staleready all-reduce: the first RING_READY of each attempt names
 *             another attempt (a nonce not its own), as a READY of an
 *             attempt that failed does when it arrives late: the
 *             predecessor's pieces sent on it are refused, and only
 *             the READYs after it name the attempt.
 *
 * Loop thread, but gossip_testing_start (in gossip_start).
 */
#include <math.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip_impl.h"

#define TEST_FLOOD_REQS 20
#define TEST_REPLAY_AFTER 30
#define TEST_REPLAY_STEP 50
#define TEST_FREEZE_STEP 20
#define TEST_FREEZE_XCH_STEP 100
#define TEST_SLOW_CONFIRM_MS 300

static const char *const NAMES[] = {"none",  "nan",   "inf",       "scale",    "signflip", "replay",   "short",
                                    "flood", "loseready", "baddonor", "badfin", "freeze", "freezexch",
                                    "slowconfirm", "nangrad", "staleready"};

int gossip_testing_start(struct gossip *g, struct rumor_err *e) {
  struct gossip_test *t = &g->test;
  memset(t, 0, sizeof *t);
  const char *kind = getenv("RUMOR_TEST_ATTACK");
  if (!kind || !*kind || g->cfg.role != GOSSIP_ROLE_PEER) return 0;
  for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
    if (strcmp(kind, NAMES[i]) == 0) {
      t->attack = (enum gossip_test_attack)i;
      if (t->attack != TEST_NONE) log_warn("TESTING ONLY: this member attacks the cluster (%s)", kind);
      return 0;
    }
  return rumor_err_set(e, RUMOR_EFORMAT,
                       "RUMOR_TEST_ATTACK (--attack) must be one of none, nan, inf, scale, signflip, replay, short, "
                       "flood, loseready, baddonor, badfin, freeze, freezexch, slowconfirm, nangrad, staleready "
                       "(not '%s')",
                       kind);
}

void gossip_testing_donation(struct gossip *g, float *state, uint64_t n) {
  if (g->test.attack != TEST_BAD_DONOR) return;
  log_warn("TESTING ONLY: donating a poisoned state");
  for (uint64_t i = 0; i < n; i++) state[i] *= -1000.0f;
}

bool gossip_testing_lose_ready(struct gossip *g, bool first_of_attempt) {
  return g->test.attack == TEST_LOSE_READY && first_of_attempt;
}

bool gossip_testing_stale_ready(struct gossip *g, bool first_of_attempt) {
  return g->test.attack == TEST_STALE_READY && first_of_attempt;
}

uint64_t gossip_testing_confirm_delay_ms(struct gossip *g) {
  return g->test.attack == TEST_SLOW_CONFIRM ? TEST_SLOW_CONFIRM_MS : 0;
}

void gossip_testing_ring_start(struct gossip *g, uint64_t step, bool reduce) {
  if (g->test.attack == TEST_NAN_GRAD && reduce) g->ring.acc[0] = NAN;
  if (g->test.attack != TEST_FREEZE || step != TEST_FREEZE_STEP || g->test.frozen) return;
  g->test.frozen = true;
  log_warn("TESTING ONLY: stopping this process (SIGSTOP) before the all-reduce of step %llu",
           (unsigned long long)step);
  raise(SIGSTOP);
  log_warn("TESTING ONLY: resumed (SIGCONT)");
}

void gossip_testing_xch_receiving(struct gossip *g) {
  struct gossip_test *t = &g->test;
  if (t->attack != TEST_FREEZE_XCH || t->frozen || g->xch.x.snapshot_step < TEST_FREEZE_XCH_STEP) return;
  t->frozen = true;
  char who[200];
  gossip_member_label(g, g->xch.x.partner, who, sizeof who);
  log_warn("TESTING ONLY: stopping this process (SIGSTOP) mid-exchange with %s, as its parameters begin to arrive",
           who);
  raise(SIGSTOP);
  log_warn("TESTING ONLY: resumed (SIGCONT)");
}

void gossip_testing_free(struct gossip *g) {
  free(g->test.recorded);
  g->test.recorded = NULL;
  free(g->test.out);
  g->test.out = NULL;
}

void gossip_testing_snapshot(struct gossip *g, uint64_t *step) {
  struct gossip_test *t = &g->test;
  uint64_t n = g->cfg.nparams;
  t->snapshots++;
  bool poisons = t->attack == TEST_NAN || t->attack == TEST_INF || t->attack == TEST_SCALE ||
                 t->attack == TEST_SIGNFLIP || t->attack == TEST_REPLAY;
  if (!poisons) return;
  /* A copy is poisoned and sent; our own snapshot stays what the training
   * thread took (it averages from it, peer/sync/sync.h): the attacker keeps
   * an honest state, as a real one would to pass the donation checks. */
  if (!t->out) t->out = xmalloc((size_t)n * sizeof(float));
  memcpy(t->out, g->xch.mine, (size_t)n * sizeof(float));
  float *p = t->out;
  switch (t->attack) {
  case TEST_NAN:
  case TEST_INF:
    for (uint64_t i = 0; i < n; i += n / 7 + 1) p[i] = t->attack == TEST_NAN ? NAN : INFINITY;
    return;
  case TEST_SCALE:
    for (uint64_t i = 0; i < n; i++) p[i] *= -1000.0f;
    return;
  case TEST_SIGNFLIP:
    for (uint64_t i = 0; i < n; i++) p[i] = -p[i];
    return;
  case TEST_REPLAY:
    if (!t->recorded) {
      if (*step < TEST_REPLAY_STEP) return; /* a round of training, not the state everyone starts from */
      t->recorded = xmalloc((size_t)n * sizeof(float));
      memcpy(t->recorded, p, (size_t)n * sizeof(float));
      t->recorded_step = *step;
      t->replay_from = t->snapshots + TEST_REPLAY_AFTER;
    } else if (t->snapshots > t->replay_from) {
      if (t->snapshots == t->replay_from + 1)
        log_warn("TESTING ONLY: replaying the snapshot of step %llu from now on", (unsigned long long)t->recorded_step);
      memcpy(p, t->recorded, (size_t)n * sizeof(float));
      *step = t->recorded_step;
    }
    return;
  default: return;
  }
}

const float *gossip_testing_send_src(struct gossip *g) { return g->test.out ? g->test.out : g->xch.mine; }

bool gossip_testing_bad_fin(struct gossip *g) { return g->test.attack == TEST_BAD_FIN; }

uint64_t gossip_testing_send_count(struct gossip *g, uint64_t count) {
  return g->test.attack == TEST_SHORT && count > 0 ? count - 1 : count;
}

static void on_flood_dial(net_t *n, net_conn_t *c, int status, const char *detail, void *arg) {
  if (status == 0 && c) net_conn_close(c);
}

void gossip_testing_tick(struct gossip *g, uint64_t now) {
  if (g->test.attack != TEST_FLOOD || g->stopping || !atomic_load(&g->ready)) return;
  for (size_t i = 0; i < g->swim.nmembers; i++) {
    const struct swim_member *m = &g->swim.members[i];
    if (m->info.role != SWIM_ROLE_PEER || m->info.state != SWIM_ALIVE || !m->info.addr[0]) continue;
    for (int k = 0; k < TEST_FLOOD_REQS; k++) {
      struct net_msgbuf b;
      net_msgbuf_init(&b, GMSG_XCH_REQ, GOSSIP_PROTO_VERSION);
      net_msgbuf_put_uint(&b, "x", rng_next_u64(&g->rng));
      net_msgbuf_put_uint(&b, "n", g->cfg.nparams);
      net_msgbuf_put_str(&b, "model", g->model, strlen(g->model));
      net_msgbuf_put_uint(&b, "step", 0);
      (void)gossip_send(g, m->info.id, &b);
      net_msgbuf_free(&b);
    }
    if (net_dial_peer(g->net, m->info.addr, m->info.id, on_flood_dial, NULL)) log_debug("flood: cannot dial %s", m->info.addr);
  }
}
