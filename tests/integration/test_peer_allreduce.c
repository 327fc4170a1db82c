/* `rumor peer --sync allreduce` as users run it: peers as separate
 * processes on 127.0.0.1 sum every step's gradient over a ring. One step on
 * N members equals one step of a single process on their N batches
 * together; a member that is SIGSTOPped or killed is dropped and the ring
 * re-forms without it; a newcomer pulls the state and enters the ring; and
 * every member that finishes holds the same parameters. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../support/cluster.h"
#include "peer/train/train.h"
#include "peer/train/train_impl.h"
#include "../support/ckpt_params.h"
#include "../support/fmnist.h"
#include "../support/http.h"
#include "../support/one_step.h"

static struct cluster C;

static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(allreduce, .init = setup, .fini = teardown, .timeout = 240);

#define MODEL "mlp:784-32-10"

static void expect_clean_exit(int i) {
  int st = cluster_wait(&C, i, 180);
  cr_assert(proc_exited_with(st, 0), "peer %d did not finish cleanly (status %d): %s", i, st,
            proc_slurp(C.node[i].log));
}

/* Every checkpoint in idx[0..n) holds exactly the same parameters. */
static void expect_same_params(const int *idx, int n) {
  int64_t P0, P;
  float *a = ckpt_params_load(C.node[idx[0]].ckpt, &P0);
  for (int k = 1; k < n; k++) {
    float *b = ckpt_params_load(C.node[idx[k]].ckpt, &P);
    cr_assert_eq(P, P0);
    int64_t diff = 0;
    for (int64_t j = 0; j < P; j++) diff += a[j] != b[j];
    cr_assert_eq(diff, 0, "peer %d's parameters differ from peer %d's in %lld of %lld values", idx[k], idx[0],
                 (long long)diff, (long long)P);
    free(b);
  }
  free(a);
}

/* A member; its progress lines come every 50 ms (--log-every 0.05), so a
 * test sees that a run is under way before it strikes. */
static int start_member(const char *shard, const char *max_steps, const char *wait_peers) {
  return cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--shard", shard, "--max-steps", max_steps,
                            "--batch", "16", "--seed", "7", "--no-eval", "--wait-peers", wait_peers, "--log-every",
                            "0.05", "--checkpoint", C.node[C.n].ckpt, NULL);
}

/* The step in the epoch of node i's last progress line, or -1 before the
 * first. */
static long long progress_step(int i) {
  char *s = proc_slurp(C.node[i].log);
  long long step = -1;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n")) {
    const char *p = strstr(line, "  step ");
    if (p && strstr(line, " samples/s")) step = atoll(p + STR_LEN("  step "));
  }
  free(s);
  return step;
}

/* A member in mid-run: past its first step, still running, not done. */
struct mid_run {
  int node;
  long long step; /* the last progress line's */
};
static bool in_mid_run(void *arg) {
  struct mid_run *m = arg;
  m->step = progress_step(m->node);
  return m->step >= 2 && cluster_alive(&C, m->node) && !cluster_log_has(&C, m->node, "training done");
}

static bool is_stopped_cond(void *arg) { return cluster_stopped(&C, *(int *)arg); }

/* Waits until member i trains past its first step and still runs, so that
 * a fault sent next strikes a run under way (a fixed sleep cannot tell). */
static void wait_mid_run(int i, const char *what) {
  struct mid_run m = {i, -1};
  cr_assert(cluster_poll(in_mid_run, &m, 60), "%s was not training past its first step (last progress at step %lld): %s",
            what, m.step, proc_slurp(C.node[i].log));
  fprintf(stderr, "%s runs, at step %lld or later\n", what, m.step);
}

/* "ADDR (": how logs name node i (its address, then its key). */
static void member_pattern(int i, char *pat, size_t n) { snprintf(pat, n, "%s (", C.node[i].addr); }

Test(allreduce, one_step_on_three_members_equals_one_step_on_their_three_batches_together) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int peer[3];
  char shard[3][8];
  for (int i = 0; i < 3; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/3", i);
    peer[i] = start_member(shard[i], "1", "3");
  }
  for (int i = 0; i < 3; i++) expect_clean_exit(peer[i]);
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_rounds"), 1);
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_members"), 3);
  }
  expect_same_params(peer, 3);
  int64_t P, Q;
  float *ring = ckpt_params_load(C.node[peer[0]].ckpt, &P);
  float *single = one_step_on_all_batches(MODEL, 7, 3, 16, &Q);
  cr_assert_eq(P, Q);
  /* Summed in another order, so equal to rounding. */
  double d2 = 0, s2 = 0;
  for (int64_t j = 0; j < P; j++) {
    double d = (double)ring[j] - single[j];
    d2 += d * d;
    s2 += (double)single[j] * single[j];
  }
  double rel = sqrt(d2 / s2);
  fprintf(stderr, "ring step vs single step on the 48 rows: relative difference %.3g\n", rel);
  cr_assert(rel < 1e-6, "the ring's step differs from the single process's by %.3g (relative)", rel);
  free(ring);
  free(single);
}

/* A learning rate far too high: the ring's summed gradient is soon not
 * finite, which drops the step on every member and leaves the parameters
 * as they were, so every later step would be dropped too. Each member
 * stops with "training diverged" (check_finite) instead of dropping every
 * step to the end and exiting 0, as it did before. */
Test(allreduce, a_diverged_ring_stops_instead_of_dropping_every_step) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int peer[2];
  char shard[2][8];
  for (int i = 0; i < 2; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/2", i);
    peer[i] = cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--shard", shard[i], "--max-steps",
                                 "300", "--batch", "16", "--seed", "7", "--no-eval", "--wait-peers", "2", "--lr", "1e4",
                                 "--schedule", "constant", NULL);
  }
  for (int i = 0; i < 2; i++) {
    int st = cluster_wait(&C, peer[i], 120);
    char *log = proc_slurp(C.node[peer[i]].log);
    cr_assert(proc_exited_with(st, 1), "peer %d did not stop with an error (status %d): %s", i, st, log);
    cr_assert(strstr(log, "training diverged") != NULL, "peer %d does not say it diverged: %s", i, log);
    free(log);
  }
}

/* A member whose every contribution holds a NaN (parameters finite, so no
 * member's own check fires): every round's sum is NaN, every member drops
 * the step, and after SYNC_NONFINITE_MAX (8) such sums in a row all of them
 * stop at the same step, where they dropped every step to the end before. */
Test(allreduce, a_ring_whose_sums_stay_non_finite_stops_every_member_at_one_step) {
  SKIP_WITHOUT_DATA();
  C.bin = RUMOR_TESTING_BIN;
  cluster_start_bootstrap(&C, NULL);
  int peer[3];
  for (int i = 0; i < 3; i++) {
    char shard[8];
    snprintf(shard, sizeof shard, "%d/3", i);
    peer[i] = cluster_start_peer(&C, "--attack", i == 2 ? "nangrad" : "none", "--model", MODEL, "--sync",
                                 "allreduce", "--shard", shard, "--max-steps", "300", "--batch", "16", "--seed", "7",
                                 "--no-eval", "--wait-peers", "3", NULL);
  }
  char first[3][64];
  for (int i = 0; i < 3; i++) {
    int st = cluster_wait(&C, peer[i], 120);
    char *log = proc_slurp(C.node[peer[i]].log);
    cr_assert(proc_exited_with(st, 1), "member %d did not stop with an error (status %d): %s", i, st, log);
    const char *p = strstr(log, "the ring's summed gradient was not finite at steps ");
    cr_assert(p, "member %d does not say that the ring's sums were not finite: %s", i, log);
    snprintf(first[i], sizeof first[i], "%.40s", p + strlen("the ring's summed gradient was not finite at "));
    int dropped = 0;
    for (const char *q = log; (q = strstr(q, "step dropped on every member")) != NULL; q++) dropped++;
    cr_assert_eq(dropped, 7, "member %d dropped %d steps before it stopped: %s", i, dropped, log);
    free(log);
  }
  for (int i = 1; i < 3; i++) cr_assert_str_eq(first[i], first[0], "members 0 and %d stopped at different steps", i);
}

/* A SIGSTOPped member stalls the ring until it is declared failed; then the
 * others go on without it and finish together. */
Test(allreduce, a_sigstopped_member_is_dropped_after_the_failure_timeout) {
  SKIP_WITHOUT_DATA();
  char *timing[] = {"--suspect-ms", "1000", NULL};
  cluster_start_bootstrap(&C, timing);
  int peer[3];
  char shard[3][8];
  for (int i = 0; i < 3; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/3", i);
    peer[i] = start_member(shard[i], "600", "3");
  }
  for (int i = 0; i < 3; i++)
    cr_assert(cluster_wait_file(C.node[peer[i]].log, "first step", 60), "peer %d did not start training", i);
  wait_mid_run(peer[2], "peer 2");
  kill(C.node[peer[2]].pid, SIGSTOP);
  double t0 = cluster_now();
  cr_assert(cluster_poll(is_stopped_cond, &peer[2], 10), "SIGSTOP did not stop peer 2");
  for (int i = 0; i < 2; i++) expect_clean_exit(peer[i]);
  double took = cluster_now() - t0;
  /* The stop hit the run: the stopped member had not finished, and each
   * other one declared it suspect or failed and ended in a ring without it. */
  cr_assert(!cluster_log_has(&C, peer[2], "training done"), "peer 2 had finished before the SIGSTOP: %s",
            proc_slurp(C.node[peer[2]].log));
  kill(C.node[peer[2]].pid, SIGKILL);
  char stopped[80];
  member_pattern(peer[2], stopped, sizeof stopped);
  for (int i = 0; i < 2; i++) {
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_members"), 2, "peer %d's last ring", i);
    cr_assert_eq(cluster_result(&C, peer[i], "steps"), 600);
    cr_assert(cluster_log_has(&C, peer[i], "failed"), "peer %d logged no failed round", i);
    /* Out of the ring once suspect (the heartbeat's verdict makes SWIM
     * suspect it at once), or once failed (SWIM's own timeout). */
    cr_assert(cluster_log_first(&C, peer[i], stopped, "is now suspect") >= 0 ||
                  cluster_log_first(&C, peer[i], stopped, "is now failed") >= 0,
              "peer %d never declared the stopped member suspect or failed: %s", i, proc_slurp(C.node[peer[i]].log));
  }
  fprintf(stderr, "the two others finished %.1f s after the SIGSTOP\n", took);
  expect_same_params(peer, 2);
}

Test(allreduce, a_killed_member_is_dropped_and_a_newcomer_enters_the_ring) {
  SKIP_WITHOUT_DATA();
  char *timing[] = {"--suspect-ms", "1000", NULL};
  cluster_start_bootstrap(&C, timing);
  int peer[4];
  peer[0] = start_member("0/3", "4000", "3");
  peer[1] = start_member("1/3", "4000", "3");
  peer[2] = start_member("2/3", "4000", "3");
  for (int i = 0; i < 3; i++)
    cr_assert(cluster_wait_file(C.node[peer[i]].log, "first step", 60), "peer %d did not start training", i);
  wait_mid_run(peer[2], "peer 2");
  kill(C.node[peer[2]].pid, SIGKILL);
  /* The kill hit the running member (not one that had exited). */
  int st = cluster_wait(&C, peer[2], 10);
  cr_assert(st >= 0 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "peer 2 was not killed mid-run (status %d): %s", st,
            proc_slurp(C.node[peer[2]].log));
  /* The member's failure verdict, not a round's "failed": a newcomer
   * started before the verdict joins the ring that still counts the killed
   * member, and no ring re-forms with it (seen under load). The two left
   * run quickly meanwhile: 4000 steps leave the newcomer time to enter. */
  char killed[80];
  member_pattern(peer[2], killed, sizeof killed);
  cr_assert(cluster_wait_log_line(&C, peer[0], killed, "is now failed", 30),
            "the killed member was not declared failed: %s", proc_slurp(C.node[peer[0]].log));
  /* A newcomer: it pulls the state, enters the ring, and all finish at the
   * same step with the same parameters. */
  peer[3] = start_member("2/3", "4000", "1");
  cr_assert(cluster_wait_file(C.node[peer[3]].log, "starting from the cluster's state at step", 60),
            "the newcomer did not take the state: %s", proc_slurp(C.node[peer[3]].log));
  int alive[3] = {peer[0], peer[1], peer[3]};
  for (int i = 0; i < 3; i++) expect_clean_exit(alive[i]);
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(cluster_result(&C, alive[i], "allreduce_members"), 3, "member %d's last ring", alive[i]);
    cr_assert_eq(cluster_result(&C, alive[i], "steps"), 4000);
  }
  /* The two ran rings of 2 after the kill ("is now failed" above): their
   * last rings of 3 are with the newcomer. Whether a round of theirs failed
   * on its arrival ("the ring re-forms") depends on when they saw it ready:
   * between two rounds, the next simply counts it (seen under ASan). */
  expect_same_params(alive, 3);
}

/* Every member loses the first RING_READY of each attempt (the testing
 * build's "loseready"): only the repetitions (RING_READY_RESEND_MS, 1 s)
 * reach the predecessors. The rounds complete, each in about a second,
 * instead of each waiting out the exchange timeout (60 s) and failing. */
/* Two members of the testing build, both with `attack`, logging at debug
 * level (what the attacks' tests look for), run `steps` rounds; both must
 * finish within 40 s, where one round held to the exchange timeout alone
 * takes 60. */
static void two_attacking_members_finish(const char *attack, const char *steps, int peer[2]) {
  C.bin = RUMOR_TESTING_BIN;
  setenv("RUMOR_LOG_LEVEL", "debug", 1);
  cluster_start_bootstrap(&C, NULL);
  for (int i = 0; i < 2; i++)
    peer[i] = cluster_start_peer(&C, "--attack", attack, "--model", MODEL, "--sync", "allreduce", "--shard",
                                 i ? "1/2" : "0/2", "--max-steps", steps, "--batch", "16", "--seed", "7", "--no-eval",
                                 "--wait-peers", "2", "--checkpoint", C.node[C.n].ckpt, NULL);
  for (int i = 0; i < 2; i++) {
    int st = cluster_wait(&C, peer[i], 40);
    cr_assert(proc_exited_with(st, 0), "peer %d did not finish %s rounds within 40 s (status %d): %s", i, steps, st,
              proc_slurp(C.node[peer[i]].log));
  }
}

Test(allreduce, a_lost_ready_is_sent_again_and_the_rounds_complete) {
  SKIP_WITHOUT_DATA();
  int peer[2];
  two_attacking_members_finish("loseready", "4", peer); /* 4 rounds of ~1 s */
  for (int i = 0; i < 2; i++) {
    cr_assert(cluster_log_has(&C, peer[i], "lost on purpose"), "peer %d lost no READY", i);
    cr_assert(cluster_log_has(&C, peer[i], "telling it again"), "peer %d sent no READY again", i);
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_rounds"), 4, "peer %d's rounds", i);
    cr_assert_eq(cluster_result(&C, peer[i], "steps"), 4);
  }
  expect_same_params(peer, 2);
}

/* Every member's first RING_READY of each attempt names another attempt
 * (the testing build's "staleready"), as a READY of an attempt that failed
 * does when it arrives after the failure: the predecessor's pieces sent on
 * it are refused. Failing the round on that refusal failed every attempt,
 * each meeting the next stale READY (bench-chaos: six members retried every
 * 100 ms for 10 s). Now the refusal only spends that READY, the refusing
 * member sends its current one at once, and no round fails. */
Test(allreduce, a_piece_sent_on_a_stale_ready_is_sent_again_and_no_round_fails) {
  SKIP_WITHOUT_DATA();
  int peer[2];
  two_attacking_members_finish("staleready", "6", peer);
  for (int i = 0; i < 2; i++) {
    cr_assert(cluster_log_has(&C, peer[i], "names an attempt that is not ours"), "peer %d sent no stale READY", i);
    cr_assert(cluster_log_has(&C, peer[i], "refused a piece sent on a READY"), "no piece of peer %d was refused", i);
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_retries"), 0, "peer %d's rounds failed on refusals: %s", i,
                 proc_slurp(C.node[peer[i]].log));
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_rounds"), 6, "peer %d's rounds", i);
  }
  expect_same_params(peer, 2);
}

/* A newcomer that becomes ready while a round is under way comes in at
 * the next round once another member may hold this one's result. Member 0
 * ("slowconfirm") takes the deliveries of its last pieces 300 ms late each
 * round, so nearly all the time member 1 has completed the round and member
 * 0 has not. Failing the round then, as members did for every newcomer,
 * left member 0 a round behind, to pull a whole state from member 1 (in CI,
 * with two "baddonor" members, an honest one stopped on it). Now neither
 * member falls behind, and the three finish with the same parameters. */
Test(allreduce, a_newcomer_does_not_fail_a_round_another_member_may_have_completed) {
  SKIP_WITHOUT_DATA();
  C.bin = RUMOR_TESTING_BIN;
  cluster_start_bootstrap(&C, NULL);
  int peer[3];
  const char *attack[3] = {"slowconfirm", "none", "none"};
  for (int i = 0; i < 3; i++) {
    if (i == 2) {
      cr_assert(cluster_wait_file(C.node[peer[0]].log, "is taken 300 ms late", 60), "member 0 held nothing: %s",
                proc_slurp(C.node[peer[0]].log));
      wait_mid_run(peer[0], "member 0");
    }
    char shard[8];
    snprintf(shard, sizeof shard, "%d/3", i);
    peer[i] = cluster_start_peer(&C, "--attack", attack[i], "--model", MODEL, "--sync", "allreduce", "--shard", shard,
                                 "--max-steps", "40", "--batch", "16", "--seed", "7", "--no-eval", "--wait-peers",
                                 i < 2 ? "2" : "1", "--log-every", "0.05", "--checkpoint", C.node[C.n].ckpt, NULL);
  }
  for (int i = 0; i < 3; i++) expect_clean_exit(peer[i]);
  cr_assert(cluster_log_has(&C, peer[2], "starting from the cluster's state at step"), "the newcomer took no state: %s",
            proc_slurp(C.node[peer[2]].log));
  for (int i = 0; i < 2; i++) {
    cr_assert(!cluster_log_has(&C, peer[i], "all-reduce: the cluster is at step"), "member %d fell behind: %s", i,
              proc_slurp(C.node[peer[i]].log));
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_catchups"), 0, "member %d caught up", i);
  }
  for (int i = 0; i < 3; i++) {
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_members"), 3, "member %d's last ring: %s", i,
                 proc_slurp(C.node[peer[i]].log));
    cr_assert_eq(cluster_result(&C, peer[i], "steps"), 40);
  }
  expect_same_params(peer, 3);
}

/* The step node i serves on /metrics (published about once a second), or
 * -1 when it has none yet. */
static long long metrics_step(int i) {
  double step = http_metric(cluster_metrics_port(&C, i), "rumor_training_step");
  return isnan(step) ? -1 : (long long)step;
}

/* Three members of the testing build: the first 3 − `frozen` with
 * `attack`, the others with "freeze", for `max_steps`. A frozen member stops
 * itself before its all-reduce of step FREEZE_STEP, when all three have
 * completed the round before; it is resumed once the members not frozen
 * dropped it and went on to FREEZE_STEP + 2, and then finds itself behind.
 * (A SIGSTOP from outside can land while one of the others still waits for
 * a piece, or a confirmation, of a round the stopped one completed: that
 * one is then a step behind the other and, when both are "baddonor", can
 * catch up only from the stopped one: seen in CI.) With two frozen, the
 * one left sees no majority of its last ring and waits --quorum-wait-ms
 * (1 s here, 30 s by default) before going on alone. */
#define FREEZE_STEP 20 /* gossip/testing.c's TEST_FREEZE_STEP */
static void leave_behind(int peer[3], const char *attack, const char *max_steps, int frozen) {
  C.bin = RUMOR_TESTING_BIN;
  cluster_start_bootstrap(&C, NULL);
  char shard[3][8];
  int going = 3 - frozen;
  for (int i = 0; i < 3; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/3", i);
    peer[i] = cluster_start_peer(&C, "--attack", i < going ? attack : "freeze", "--model", MODEL, "--sync",
                                 "allreduce", "--shard", shard[i], "--max-steps", max_steps, "--batch", "16", "--seed",
                                 "7", "--no-eval", "--wait-peers", "3", "--metrics", "127.0.0.1:0", "--checkpoint",
                                 C.node[C.n].ckpt, "--quorum-wait-ms", "1000", NULL);
  }
  double t0 = cluster_now();
  for (int i = going; i < 3; i++)
    while (!cluster_stopped(&C, peer[i])) {
      cr_assert(cluster_now() - t0 < 60, "peer %d did not stop itself: %s", i, proc_slurp(C.node[peer[i]].log));
      usleep(20 * 1000);
    }
  cr_assert(cluster_wait_file(C.node[peer[0]].log, "is now failed", 30), "the stopped member was not dropped: %s",
            proc_slurp(C.node[peer[0]].log));
  for (int i = 0; i < going; i++) {
    long long step;
    for (;;) {
      cr_assert_eq(waitpid(C.node[peer[i]].pid, NULL, WNOHANG), 0, "peer %d ended: %s", i,
                   proc_slurp(C.node[peer[i]].log));
      if ((step = metrics_step(peer[i])) >= FREEZE_STEP + 2) break;
      cr_assert(cluster_now() - t0 < 90, "peer %d did not go on without the stopped members (at step %lld): %s", i,
                step, proc_slurp(C.node[peer[i]].log));
      usleep(100 * 1000);
    }
  }
  for (int i = going; i < 3; i++) kill(C.node[peer[i]].pid, SIGCONT);
}

/* The member left behind pulls the state of one ahead, checks it, takes it
 * and finishes with the others, on the same parameters. */
Test(allreduce, a_member_left_behind_catches_up_and_finishes_with_the_others) {
  SKIP_WITHOUT_DATA();
  int peer[3];
  leave_behind(peer, "none", "6000", 1);
  for (int i = 0; i < 3; i++) expect_clean_exit(peer[i]);
  cr_assert(cluster_log_has(&C, peer[2], "all-reduce: now at step"), "it did not catch up: %s",
            proc_slurp(C.node[peer[2]].log));
  cr_assert_geq(cluster_result(&C, peer[2], "allreduce_catchups"), 1);
  for (int i = 0; i < 3; i++) cr_assert_eq(cluster_result(&C, peer[i], "steps"), 6000);
  expect_same_params(peer, 3);
}

/* It checks the state as a newcomer does. Both others are "baddonor" (the
 * state they donate × −1000, their own honest): it refuses each state,
 * strikes its donor, and stops with the reason instead of training on
 * from garbage. */
Test(allreduce, a_member_left_behind_refuses_poisoned_states_and_stops) {
  SKIP_WITHOUT_DATA();
  int peer[3];
  leave_behind(peer, "baddonor", "1000000", 1);
  int st = cluster_wait(&C, peer[2], 60);
  const char *log = C.node[peer[2]].log;
  cr_assert(proc_exited_with(st, 1), "the member left behind should stop (status %d): %s", st, proc_slurp(log));
  cr_assert(cluster_log_has(&C, peer[2], "all-reduce: the cluster is at step"), "it did not try to catch up: %s",
            proc_slurp(log));
  cr_assert(cluster_log_has(&C, peer[2], "all-reduce: refused the state pulled at step"), "%s", proc_slurp(log));
  cr_assert(cluster_log_has(&C, peer[2], "the 2 states pulled to catch up were refused"), "%s", proc_slurp(log));
  cr_assert(!cluster_log_has(&C, peer[2], "all-reduce: now at step"), "it took a poisoned state: %s", proc_slurp(log));
  for (int i = 0; i < 2; i++)
    cr_assert_eq(waitpid(C.node[peer[i]].pid, NULL, WNOHANG), 0, "peer %d stopped too: %s", i,
                 proc_slurp(C.node[peer[i]].log));
}

/* Two members left behind at once, beside one "baddonor": each refuses its
 * state, and the only other member is behind too, pulling. It answers
 * "catching up" (STATE_BUSY) rather than take a request it cannot serve
 * until its own pull ends: before, each asked the other and both waited out
 * the 60 s donor timeout. Now each asks the donor again once its strike
 * ends, refuses it again and stops with the reason, within seconds. And
 * both learn that they are behind while both are still there: the one to
 * which the donor sends its READY (for a step two or more ahead of it)
 * from that READY, the other from the donor's RING_AHEAD; before, the first
 * learnt it only once the other had left and the ring re-formed. */
Test(allreduce, two_members_left_behind_at_once_do_not_wait_on_each_other) {
  SKIP_WITHOUT_DATA();
  int peer[3];
  leave_behind(peer, "baddonor", "1000000", 2);
  for (int i = 1; i < 3; i++) {
    int st = cluster_wait(&C, peer[i], 45); /* the donor timeout is 60 s */
    const char *log = C.node[peer[i]].log;
    cr_assert(proc_exited_with(st, 1), "peer %d, left behind, should have stopped within 45 s (status %d): %s", i, st,
              proc_slurp(log));
    cr_assert(cluster_log_has(&C, peer[i], "the 2 states pulled to catch up were refused"), "%s", proc_slurp(log));
    cr_assert(!cluster_log_has(&C, peer[i], "did not deliver its state in time"), "peer %d waited out a donor: %s", i,
              proc_slurp(log));
  }
  cr_assert_eq(waitpid(C.node[peer[0]].pid, NULL, WNOHANG), 0, "the member ahead stopped too");
  long first_stop = -1;
  for (int i = 1; i < 3; i++) {
    long at = cluster_log_first(&C, peer[i], "leaving: told", NULL);
    if (at >= 0 && (first_stop < 0 || at < first_stop)) first_stop = at;
  }
  for (int i = 1; i < 3; i++) {
    long learnt = cluster_log_first(&C, peer[i], "all-reduce: the cluster is at step", NULL);
    cr_assert(learnt >= 0 && learnt < first_stop, "peer %d learnt that it was behind only once the other had left: %s",
              i, proc_slurp(C.node[peer[i]].log));
  }
}

Test(allreduce, bad_combinations_are_usage_errors) {
  char *bad[] = {"peer", "--sync", "ring", NULL};
  cluster_expect_exit(&C, bad, 2, "--sync must be gossip, allreduce or ps, not 'ring'");
  char *clip[] = {"peer", "--sync", "allreduce", "--clip", NULL};
  cluster_expect_exit(&C, clip, 2, "--clip is a gossip option");
  char *group[] = {"group", "--sync", "allreduce", "--clip", "--stages", "2", NULL};
  cluster_expect_exit(&C, group, 2, "--clip is a gossip option");
}

/* `rumor top` names each member's scheme and the round it is at. */
Test(allreduce, top_shows_the_scheme_and_the_round_of_each_member) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int peer[2];
  peer[0] = start_member("0/2", "100000", "2");
  peer[1] = start_member("1/2", "100000", "2");
  for (int i = 0; i < 2; i++)
    cr_assert(cluster_wait_file(C.node[peer[i]].log, "first step", 60), "peer %d did not start training", i);
  usleep(500 * 1000);
  char id[300];
  snprintf(id, sizeof id, "%s/top.key", C.dir);
  cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, id);
  char *json[] = {"top", "--bootstrap", C.boot, "--cluster-key", C.key, "--identity", id, "--once", "--json", NULL};
  char *out, *err;
  int st = cluster_run(&C, json, 60, &out, &err);
  cr_assert(proc_exited_with(st, 0), "rumor top failed: %s", err);
  int members = 0;
  for (const char *p = out; (p = strstr(p, "\"sync\":\"allreduce\"")); p++) {
    members++;
    const char *r = strstr(p, "\"round\":");
    cr_assert_not_null(r);
    long round = strtol(r + 8, NULL, 10);
    cr_assert_gt(round, 0, "a member at round %ld: %s", round, out);
    const char *n = strstr(p, "\"ring_members\":");
    cr_assert_eq(strtol(n + 15, NULL, 10), 2, "%s", out);
  }
  cr_assert_eq(members, 2, "top should show two all-reduce members: %s", out);
  free(out), free(err);
  char *table[] = {"top", "--bootstrap", C.boot, "--cluster-key", C.key, "--identity", id, "--once", NULL};
  st = cluster_run(&C, table, 60, &out, &err);
  cr_assert(proc_exited_with(st, 0), "rumor top failed: %s", err);
  cr_assert(strstr(out, "SYNC") && strstr(out, "ROUND") && strstr(out, "allreduce"), "%s", out);
  free(out), free(err);
}
