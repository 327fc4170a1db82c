/* Poisoned or faulty peers that hold valid keys (rumor-testing peer --attack,
 * the testing build): NaN or Inf values, a wrong length, a model multiplied
 * by -1000, an old round replayed. Honest peers reject the update with a
 * reason, back the sender off, never blame each other, and keep training
 * (their loss keeps falling). With one sign-flipping attacker among 8 peers,
 * clipped averaging (--clip) keeps every honest peer at test accuracy
 * >= 0.85, and without it the attack does real damage. A flood of exchange
 * requests and connections hits the per-peer rate limits. A newcomer refuses
 * a donated state of garbage and starts from its own initialisation. A
 * peer that lingers after its last step (--finish-wait-ms) does not wait for
 * a partner whose parameters it rejects. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>

#include "../support/cluster.h"
#include "../support/fmnist.h"

static struct cluster C;

/* The testing build: --attack exists there only. */
static void setup(void) {
  cluster_init(&C);
  C.bin = RUMOR_TESTING_BIN;
}
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(poison, .init = setup, .fini = teardown, .timeout = 300);


static void expect_clean_exit(int i) {
  int st = cluster_wait(&C, i, 240);
  cr_assert(proc_exited_with(st, 0), "node %d did not finish cleanly (status %d): %s", i, st,
            proc_slurp(C.node[i].log));
}

/* Lines of node i's log containing `a` and `b` (either may be NULL). */
static int count_lines(int i, const char *a, const char *b) {
  char *s = proc_slurp(C.node[i].log);
  int n = 0;
  for (char *line = strtok(s, "\n"); line; line = strtok(NULL, "\n"))
    if ((!a || strstr(line, a)) && (!b || strstr(line, b))) n++;
  free(s);
  return n;
}

/* "(KEY8)": how log lines name node i, by the first 8 characters of its
 * key (from the "id" of its first stdout line). Not by its address: a
 * member that exchanges before the membership update about it arrives is
 * logged as "? (KEY8)". */
static void who(int i, char *buf, size_t n) {
  char *s = proc_slurp(C.node[i].out);
  const char *p = strstr(s, "\"id\":\"");
  cr_assert_not_null(p, "node %d printed no id: %s", i, s);
  snprintf(buf, n, "(%.8s)", p + 6);
  free(s);
}

/* Starts a bootstrap, `honest` honest peers and one attacker (--attack kind)
 * on shards of the training set; all wait for each other. `flag` (may be
 * NULL) is one more flag without a value for every peer. `bound`: with
 * --max-local-steps 8, so that honest peers mix as often on a fast machine
 * as on a slow one (without it, a peer that trains fast may finish almost
 * alone on its shard, and the accuracy checks measure that).
 * `finish_wait`: honest peers take --finish-wait-ms. Without it, a peer
 * that runs ahead (the others starved of CPU by other tests) spends its
 * last epoch averaging with partners still in their early ones and ends
 * with about their model: in a CI run, 0.799 where the others reached
 * 0.86 (and here, with the two others 12 times slower, 0.84-0.86 against
 * 0.87). With it, it averages on until they finish, and the accuracy
 * checks measure the attack, not the timing. A peer that struck the
 * attacker does not wait for it (a_finished_peer_does_not_wait_...); one
 * that never met it waits until it leaves. The attacker does not wait: it
 * leaves at its last step. Returns the attacker's node; honest peers are
 * peer[0..honest). */
static int start(int honest, const char *kind, const char *model, const char *epochs, int *peer, const char *flag,
                 bool bound, bool finish_wait) {
  cluster_start_bootstrap(&C, NULL);
  int n = honest + 1;
  char shard[16][24], wait[16];
  snprintf(wait, sizeof wait, "%d", n);
  int attacker = -1;
  for (int i = 0; i < n; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/%d", i, n);
    /* The attacker is started in the middle, so it is neither the first
     * peer (which seeds the cluster) nor the last. */
    bool bad = i == n / 2;
    const char *more[4] = {NULL}; /* the list ends at the first NULL */
    int k = 0;
    if (bad) more[k++] = "--attack", more[k++] = kind;
    else if (finish_wait) more[k++] = "--finish-wait-ms", more[k++] = "30000";
    more[k] = flag;
    int node = cluster_start_peer(&C, "--model", model, "--shard", shard[i], "--epochs", epochs, "--batch", "64",
                                  "--lr", "0.1", "--no-eval", "--wait-peers", wait, "--gossip-every", "1",
                                  "--max-local-steps", bound ? "8" : "0", more[0], more[1], more[2], NULL);
    if (bad) attacker = node;
    else *peer++ = node;
  }
  return attacker;
}

/* Every honest peer finished with a falling loss and a sound model; the
 * attacker's updates were rejected for `reason` by at least one of them, with
 * a backoff; no honest peer rejected another. */
static void poison_run(const char *kind, const char *reason) {
  SKIP_WITHOUT_DATA();
  int peer[3];
  int bad = start(3, kind, "mlp:784-64-10", "6", peer, NULL, true, true);
  char bad_who[96];
  who(bad, bad_who, sizeof bad_who);
  int rejections = 0;
  for (int k = 0; k < 3; k++) {
    expect_clean_exit(peer[k]);
    double acc = cluster_result(&C, peer[k], "test_accuracy"), loss = cluster_result(&C, peer[k], "test_loss");
    double losses[16];
    int ne = cluster_result_array(&C, peer[k], "train_losses", losses, 16);
    int r = (int)(cluster_result(&C, peer[k], "exchanges_rejected") - cluster_result(&C, peer[k], "exchanges_skipped"));
    rejections += r;
    fprintf(stderr, "%s: honest peer %d: test accuracy %.4f, test loss %.4f, train loss %.3f -> %.3f, %d rejections\n",
            kind, k, acc, loss, ne ? losses[0] : NAN, ne ? losses[ne - 1] : NAN, r);
    cr_assert(isfinite(loss) && acc >= 0.80, "%s: honest peer %d ended at accuracy %.4f, loss %.4f", kind, k, acc, loss);
    cr_assert(ne >= 6 && losses[ne - 1] < losses[0] && losses[ne - 1] < 0.6,
              "%s: honest peer %d's training loss did not keep falling (%.3f -> %.3f)", kind, k, ne ? losses[0] : NAN,
              ne ? losses[ne - 1] : NAN);
    for (int j = 0; j < 3; j++) {
      char honest_who[96];
      who(peer[j], honest_who, sizeof honest_who);
      cr_assert_eq(count_lines(peer[k], "rejected parameters from ", honest_who), 0,
                   "%s: honest peer %d rejected honest peer %d", kind, k, j);
    }
    if (r > 0) {
      cr_assert_gt(count_lines(peer[k], bad_who, reason), 0, "%s: peer %d's rejections do not say '%s': %s", kind, k,
                   reason, proc_slurp(C.node[peer[k]].log));
      cr_assert_gt(count_lines(peer[k], bad_who, "no exchanges with it for "), 0, "%s: the sender was not backed off",
                   kind);
    }
  }
  cr_assert_gt(rejections, 0, "%s: no honest peer rejected the attacker's updates", kind);
}

Test(poison, nan_values_are_rejected_and_the_sender_backed_off) { poison_run("nan", "are NaN or infinite"); }
Test(poison, inf_values_are_rejected_and_the_sender_backed_off) { poison_run("inf", "are NaN or infinite"); }
Test(poison, a_wrong_length_is_rejected_and_the_sender_backed_off) { poison_run("short", "values for a model of"); }
Test(poison, a_malformed_list_of_finished_members_is_rejected_and_the_sender_backed_off) {
  poison_run("badfin", "its list of finished members is malformed");
}
Test(poison, a_model_times_minus_1000_is_rejected_and_the_sender_backed_off) {
  poison_run("scale", "times our norm");
}

/* --finish-wait-ms does not wait for a partner whose parameters it
 * rejects: an honest peer's only partner sends NaN values and trains on
 * for good. The honest peer strikes it, takes its last step and leaves at
 * once ("no partner is still training"), instead of waiting the whole
 * 60 s for a partner that still trains (as it did before struck members
 * were left out: the poison runs above took 30 s, the attacker holding at
 * every refused exchange). */
Test(poison, a_finished_peer_does_not_wait_for_a_partner_whose_parameters_it_rejects) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int bad = cluster_start_peer(&C, "--attack", "nan", "--model", "mlp:784-64-10", "--shard", "0/2", "--epochs", "1000",
                               "--max-steps", "1000000", "--batch", "64", "--lr", "0.1", "--no-eval", "--gossip-every",
                               "1", "--wait-peers", "2", NULL);
  int honest = cluster_start_peer(&C, "--model", "mlp:784-64-10", "--shard", "1/2", "--epochs", "1", "--batch", "64",
                                  "--lr", "0.1", "--no-eval", "--gossip-every", "1", "--wait-peers", "2",
                                  "--finish-wait-ms", "60000", NULL);
  expect_clean_exit(honest);
  double rejected = cluster_result(&C, honest, "exchanges_rejected");
  fprintf(stderr, "finish-wait beside an attacker: %.0f rejections, waited %.2f s\n", rejected,
          cluster_result(&C, honest, "finish_wait_s"));
  cr_assert_gt(rejected, 0, "the honest peer never rejected the attacker: the run proved nothing: %s",
               proc_slurp(C.node[honest].log));
  int st;
  cr_assert_eq(waitpid(C.node[bad].pid, &st, WNOHANG), 0, "the attacker stopped: the run proved nothing: %s",
               proc_slurp(C.node[bad].log));
  cr_assert_gt(count_lines(honest, "finished waiting after", "(no partner is still training)"), 0,
               "the honest peer waited for the partner it rejects: %s", proc_slurp(C.node[honest].log));
}

Test(poison, a_replayed_old_round_is_rejected_or_clipped_and_the_sender_backed_off) {
  /* The attacker records a snapshot of step 50 or later, stays honest
   * for 30 more, then sends the recorded one again, with its old step, every
   * time. A peer that had a newer snapshot from it rejects the replay (a
   * step going backwards) and backs it off. One that had none cannot tell
   * it from a slow peer: clipping (on here) bounds what it does, and skips
   * it once it is a far outlier. */
  SKIP_WITHOUT_DATA();
  int peer[3];
  int bad = start(3, "replay", "mlp:784-64-10", "8", peer, "--clip", true, true);
  char bad_who[96];
  who(bad, bad_who, sizeof bad_who);
  int rejected = 0, skipped = 0;
  for (int k = 0; k < 3; k++) {
    expect_clean_exit(peer[k]);
    double acc = cluster_result(&C, peer[k], "test_accuracy");
    double losses[16];
    int ne = cluster_result_array(&C, peer[k], "train_losses", losses, 16);
    /* Rejected exchanges count the outliers clipping skipped too; the rest
     * struck the sender. */
    int s = (int)cluster_result(&C, peer[k], "exchanges_skipped");
    int r = (int)cluster_result(&C, peer[k], "exchanges_rejected") - s;
    rejected += r;
    skipped += s;
    fprintf(stderr, "replay: honest peer %d: test accuracy %.4f, train loss %.3f -> %.3f, %d rejections, %d skipped, "
            "%.0f clipped\n", k, acc, ne ? losses[0] : NAN, ne ? losses[ne - 1] : NAN, r, s,
            cluster_result(&C, peer[k], "exchanges_clipped"));
    cr_assert(acc >= 0.80, "replay: honest peer %d ended at accuracy %.4f", k, acc);
    cr_assert(ne >= 6 && losses[ne - 1] < losses[0], "replay: honest peer %d's loss did not keep falling", k);
    if (r > 0) {
      cr_assert_gt(count_lines(peer[k], bad_who, "replayed an old round"), 0, "peer %d: rejections without the reason", k);
      cr_assert_gt(count_lines(peer[k], bad_who, "no exchanges with it for "), 0, "peer %d: not backed off", k);
    }
  }
  cluster_wait(&C, bad, 60);
  cr_assert(cluster_log_has(&C, bad, "replaying the snapshot of step"), "the attacker never replayed: the run proved nothing");
  cr_assert_gt(rejected + skipped, 0, "no honest peer rejected or skipped a replayed round");
  fprintf(stderr, "replay: %d rejections with a backoff, %d skipped as outliers\n", rejected, skipped);
}

/* 8 peers, one of them sending its model sign-flipped: a distance of twice
 * the norm passes the distance bound, so only clipping stops it. */
static void signflip_run(bool clip, double *worst, int *skipped) {
  SKIP_WITHOUT_DATA();
  int peer[7];
  /* No --finish-wait-ms: once the attacker left, honest peers averaging on
   * would mend the damage that the control without clipping must show. */
  (void)start(7, "signflip", "mlp:784-256-10", "10", peer, clip ? "--clip" : NULL, true, false);
  *worst = 1;
  *skipped = 0;
  for (int k = 0; k < 7; k++) {
    expect_clean_exit(peer[k]);
    double acc = cluster_result(&C, peer[k], "test_accuracy");
    *skipped += (int)cluster_result(&C, peer[k], "exchanges_skipped");
    fprintf(stderr, "signflip, clipping %s: honest peer %d: test accuracy %.4f, %.0f exchanges, %.0f clipped\n",
            clip ? "on" : "off", k, acc, cluster_result(&C, peer[k], "exchanges"),
            cluster_result(&C, peer[k], "exchanges_clipped"));
    if (!(acc >= *worst)) *worst = acc; /* NaN counts as worst */
  }
}

Test(poison, with_clipping_one_signflip_attacker_among_8_leaves_every_honest_peer_at_085) {
  double worst;
  int skipped;
  signflip_run(true, &worst, &skipped);
  fprintf(stderr, "worst honest accuracy with clipping: %.4f; %d attacker updates skipped as outliers\n", worst,
          skipped);
  cr_assert(worst >= 0.85, "an honest peer reached only %.4f with clipping on", worst);
  cr_assert_gt(skipped, 0, "no honest peer skipped the attacker's outliers");
}

Test(poison, without_clipping_one_signflip_attacker_among_8_does_real_damage) {
  /* The control: the attack above is strong enough to matter. */
  double worst;
  int skipped;
  signflip_run(false, &worst, &skipped);
  fprintf(stderr, "worst honest accuracy without clipping: %.4f\n", worst);
  cr_assert(worst < 0.85, "without clipping every honest peer still reached %.4f: the attack proves nothing", worst);
}

Test(poison, a_flood_of_requests_and_connections_hits_the_per_peer_rate_limits) {
  SKIP_WITHOUT_DATA();
  int peer[3];
  int bad = start(3, "flood", "mlp:784-64-10", "6", peer, NULL, true, true);
  char bad_who[96];
  who(bad, bad_who, sizeof bad_who);
  for (int k = 0; k < 3; k++) {
    expect_clean_exit(peer[k]);
    double acc = cluster_result(&C, peer[k], "test_accuracy");
    double xrl = cluster_result(&C, peer[k], "exchange_rate_limited"), crl = cluster_result(&C, peer[k], "conn_rate_limited");
    double ok = cluster_result(&C, peer[k], "exchanges");
    fprintf(stderr, "flood: honest peer %d: accuracy %.4f, %.0f exchanges, refused %.0f requests and %.0f connections\n",
            k, acc, ok, xrl, crl);
    cr_assert(acc >= 0.80, "honest peer %d reached only %.4f under the flood", k, acc);
    cr_assert_gt(ok, 0, "honest peer %d applied no exchange under the flood", k);
    cr_assert_gt(xrl, 0, "honest peer %d refused no exchange request", k);
    cr_assert_gt(crl, 0, "honest peer %d refused no connection", k);
    cr_assert_gt(count_lines(peer[k], "rate limit: refused", bad_who), 0, "peer %d's log does not name the flooder", k);
    for (int j = 0; j < 3; j++) {
      char honest_who[96];
      who(peer[j], honest_who, sizeof honest_who);
      cr_assert_eq(count_lines(peer[k], "rate limit: refused", honest_who), 0,
                   "honest peer %d rate-limited honest peer %d", k, j);
    }
  }
}

/* A donor that holds valid keys and donates a state of garbage (the testing
 * build's "baddonor": the state times -1000; its exchanges stay honest): the
 * newcomer measures the state's loss against its own initialisation's,
 * refuses it, strikes the donor and asks again, and with no honest donor
 * starts from its own initialisation and trains to a sound model. */
Test(poison, a_newcomer_refuses_a_poisoned_donated_state_and_starts_from_its_own) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int bad = cluster_start_peer(&C, "--attack", "baddonor", "--model", "mlp:784-64-10", "--shard", "0/2", "--epochs",
                               "1000", "--max-steps", "1000000", "--batch", "64", "--lr", "0.1", "--no-eval",
                               "--gossip-every", "1", NULL);
  cr_assert(cluster_wait_file(C.node[bad].log, "first step", 60), "the donor did not start training: %s",
            proc_slurp(C.node[bad].log));
  int newcomer = cluster_start_peer(&C, "--model", "mlp:784-64-10", "--shard", "1/2", "--epochs", "1", "--batch",
                                    "64", "--lr", "0.1", "--gossip-every", "1", NULL);
  expect_clean_exit(newcomer);
  cr_assert_gt(count_lines(bad, "donating a poisoned state", NULL), 0, "the donor donated nothing: %s",
               proc_slurp(C.node[bad].log));
  /* Refused, the donor struck and asked again after its backoff (it is the
   * only other peer), refused again: 2 donors asked (cmd_peer.c). */
  cr_assert_eq(count_lines(newcomer, "refused the cluster's state at step", "a broken or hostile donor"), 2,
               "the newcomer did not refuse the state twice: %s", proc_slurp(C.node[newcomer].log));
  char bad_who[96];
  who(bad, bad_who, sizeof bad_who);
  cr_assert_geq(count_lines(newcomer, bad_who, "donated a state worse than a fresh model; no exchanges with it"), 1,
                "the donor was not struck");
  cr_assert_eq(count_lines(newcomer, "starting from the cluster's state", NULL), 0);
  cr_assert_gt(count_lines(newcomer, "starting from our own initialisation", NULL), 0);
  double acc = cluster_result(&C, newcomer, "test_accuracy");
  fprintf(stderr, "baddonor: the newcomer's test accuracy %.4f after one epoch of its half\n", acc);
  cr_assert(acc >= 0.75, "the newcomer ended at test accuracy %.4f", acc);
}

/* The same donor beside an honest peer: whichever the newcomer asks first,
 * it ends with the cluster's state (from the honest one; a refused donor is
 * struck, so the second ask goes elsewhere), never its own initialisation. */
Test(poison, a_poisoned_donor_beside_an_honest_one_does_not_keep_the_cluster_state_from_a_newcomer) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int old[2];
  for (int i = 0; i < 2; i++)
    old[i] = cluster_start_peer(&C, i ? "--attack" : "--name", i ? "baddonor" : "honest", "--model", "mlp:784-64-10",
                                "--shard", i ? "1/3" : "0/3", "--epochs", "1000", "--max-steps", "1000000", "--batch",
                                "64", "--lr", "0.1", "--no-eval", "--gossip-every", "1", "--wait-peers", "2", NULL);
  for (int i = 0; i < 2; i++)
    cr_assert(cluster_wait_file(C.node[old[i]].log, "first step", 60), "peer %d did not start training", i);
  int newcomer = cluster_start_peer(&C, "--model", "mlp:784-64-10", "--shard", "2/3", "--epochs", "1", "--batch",
                                    "64", "--lr", "0.1", "--no-eval", "--gossip-every", "1", NULL);
  expect_clean_exit(newcomer);
  int refused = count_lines(newcomer, "refused the cluster's state at step", NULL);
  fprintf(stderr, "baddonor beside an honest peer: %d refusal(s) before the honest state\n", refused);
  cr_assert_leq(refused, 1, "%s", proc_slurp(C.node[newcomer].log));
  cr_assert_eq(count_lines(newcomer, "starting from the cluster's state", NULL), 1, "%s",
               proc_slurp(C.node[newcomer].log));
  cr_assert_eq(count_lines(newcomer, "starting from our own initialisation", NULL), 0);
}
