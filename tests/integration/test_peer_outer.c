/* Outer optimizers as users run them (sync.h, "Outer optimizers"): DiLoCo
 * members (`--sync allreduce --outer K`) end every run with the same
 * parameters, a newcomer takes the anchor and momentum with the rest of
 * the state and ends with them too, a DiLoCo run resumed from a checkpoint
 * (a round pending or in flight at the save) ends bit for bit where the
 * uninterrupted run did, NoLoCo members (`--sync gossip --outer K`) pair up
 * at their round boundaries, and bad combinations of options are refused
 * before anything starts. */
#include <criterion/criterion.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "../support/cluster.h"
#include "../support/ckpt_params.h"
#include "../support/fmnist.h"
#include "tensor/tensor.h"

static struct cluster C;

static void setup(void) { cluster_init(&C); }
static void teardown(void) { cluster_fini(&C, false); }
TestSuite(outer, .init = setup, .fini = teardown, .timeout = 240);

#define MODEL "mlp:784-32-10"

static void expect_clean_exit(int i) {
  int st = cluster_wait(&C, i, 180);
  cr_assert(proc_exited_with(st, 0), "peer %d did not finish cleanly (status %d): %s", i, st,
            proc_slurp(C.node[i].log));
}

/* The number of values in which two checkpoints' parameters differ. */
static int64_t params_differ(const char *a_path, const char *b_path) {
  int64_t P, Q;
  float *a = ckpt_params_load(a_path, &P), *b = ckpt_params_load(b_path, &Q);
  cr_assert_eq(P, Q);
  int64_t diff = 0;
  for (int64_t j = 0; j < P; j++) diff += memcmp(&a[j], &b[j], sizeof a[j]) != 0;
  free(a);
  free(b);
  return diff;
}

/* The outer settings of the runs that check accuracy: plain averaging
 * (--outer-momentum 0 at the default lr 1), which every H trains with; the
 * defaults are tuned for H 50 and overshoot at the short H of these tests
 * (a NoLoCo peer at H 10 once ended at 0.40 under CI's load). */
#define STABLE_OUTER "--outer-momentum", "0"

/* A DiLoCo member on shard `shard`, `steps` steps, H 20; each step takes
 * 30 times its compute (a few ms), so that members overlap in time. */
static int start_diloco(const char *shard, const char *steps, const char *wait_peers) {
  return cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--outer", "nesterov", STABLE_OUTER,
                            "--local-steps", "20", "--shard", shard, "--max-steps", steps, "--batch", "16", "--seed", "7",
                            "--no-eval", "--wait-peers", wait_peers, "--slowdown", "30", "--checkpoint",
                            C.node[C.n].ckpt, NULL);
}

Test(outer, diloco_members_end_with_the_same_parameters_after_an_outer_round_each_h_steps) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int peer[3];
  char shard[3][8];
  for (int i = 0; i < 3; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/3", i);
    peer[i] = start_diloco(shard[i], "150", "3");
  }
  for (int i = 0; i < 3; i++) expect_clean_exit(peer[i]);
  for (int i = 0; i < 3; i++) {
    /* 7 rounds every 20 steps, and the last at step 150. */
    cr_assert_eq(cluster_result(&C, peer[i], "outer_rounds"), 8, "peer %d's rounds", i);
    cr_assert_eq(cluster_result(&C, peer[i], "allreduce_members"), 3);
    cr_assert(cluster_result(&C, peer[i], "outer_bytes_round") > 0);
    cr_assert(cluster_result(&C, peer[i], "bytes_out") > 0 && cluster_result(&C, peer[i], "bytes_in") > 0);
    if (i) cr_assert_eq(params_differ(C.node[peer[0]].ckpt, C.node[peer[i]].ckpt), 0, "peer %d differs", i);
  }
  /* Trained: far better than chance (0.1) after 150 steps of batch 16 each. */
  double acc = cluster_result(&C, peer[0], "test_accuracy");
  cr_assert(acc > 0.6, "DiLoCo members reached only %.3f", acc);
}

/* Peers `a` and `late` ended cleanly, `late` took a state (its log has
 * `took`) and both count the same rounds. */
static void late_member_ended(int a, int late, const char *took) {
  expect_clean_exit(a);
  expect_clean_exit(late);
  cr_assert(cluster_log_has(&C, late, took), "the late member took no state: %s", proc_slurp(C.node[late].log));
  double ra = cluster_result(&C, a, "outer_rounds"), rl = cluster_result(&C, late, "outer_rounds");
  cr_assert_eq(ra, rl, "the late member counts %g rounds, the other %g", rl, ra);
}

Test(outer, a_newcomer_takes_the_outer_state_and_ends_with_the_others) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int a = start_diloco("0/3", "400", "2"), b = start_diloco("1/3", "400", "2");
  cr_assert(cluster_wait_file(C.node[a].log, "first step", 60), "peer a did not start: %s", proc_slurp(C.node[a].log));
  int c = start_diloco("2/3", "400", "1");
  expect_clean_exit(b);
  late_member_ended(a, c, "starting from the cluster's state");
  cr_assert_eq(params_differ(C.node[a].ckpt, C.node[b].ckpt), 0);
  /* The newcomer ends with them when it is in their last ring; one that
   * lagged (a catch-up costs it steps) may take that round alone after they
   * left, a little elsewhere. */
  double la = cluster_result(&C, a, "test_loss"), lc = cluster_result(&C, c, "test_loss");
  cr_assert(fabs(la - lc) <= 0.01 * la, "the newcomer ended at test loss %.5f, the others at %.5f", lc, la);
}

/* A DiLoCo member with overlapped rounds (--outer-overlap, H 20), on shard
 * `shard`, from its own initialisation when `own` (--no-state-pull). */
static int start_overlapped(const char *shard, bool own) {
  return cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--outer", "nesterov", STABLE_OUTER,
                            "--local-steps", "20", "--outer-overlap", "--shard", shard, "--max-steps", "400", "--batch",
                            "16", "--seed", own ? "8" : "7", "--no-eval", "--wait-peers", "1", "--slowdown", "30",
                            "--checkpoint", C.node[C.n].ckpt, own ? "--no-state-pull" : NULL, NULL);
}

/* A DiLoCo member killed and started again from its checkpoint (--resume,
 * rounds behind) takes a member's state, outer state and rounds included,
 * before it tells the ring that it is ready, and ends with the others. */
Test(outer, a_restarted_diloco_member_takes_the_rings_state_before_it_is_ready) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int a = start_diloco("0/3", "600", "3"), a2 = start_diloco("1/3", "600", "3");
  int b = cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--outer", "nesterov", STABLE_OUTER,
                             "--local-steps", "20", "--shard", "2/3", "--max-steps", "600", "--batch", "16", "--seed",
                             "7", "--no-eval", "--wait-peers", "3", "--slowdown", "30", "--checkpoint",
                             C.node[C.n].ckpt, "--checkpoint-every", "20", NULL);
  cr_assert(cluster_wait_file(C.node[b].log, "outer round 3 at step", 60), "peer b ran no rounds: %s",
            proc_slurp(C.node[b].log));
  kill(C.node[b].pid, SIGKILL);
  int st = cluster_wait(&C, b, 10);
  cr_assert(st >= 0 && WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "peer b was not killed mid-run (status %d): %s",
            st, proc_slurp(C.node[b].log));
  /* The two others go on without it for a few rounds first. */
  cr_assert(cluster_wait_log_line(&C, a, "done over 2 members", NULL, 30), "the others did not go on without it: %s",
            proc_slurp(C.node[a].log));
  cr_assert(cluster_wait_log_line(&C, a, "outer round 8 at step", NULL, 60), "peer a stalled: %s",
            proc_slurp(C.node[a].log));
  int c = cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--outer", "nesterov", STABLE_OUTER,
                             "--local-steps", "20", "--shard", "2/3", "--max-steps", "600", "--batch", "16", "--seed",
                             "7", "--no-eval", "--wait-peers", "1", "--slowdown", "30", "--resume", C.node[b].ckpt,
                             "--checkpoint", C.node[C.n].ckpt, NULL);
  expect_clean_exit(a2);
  late_member_ended(a, c, "DiLoCo: starting: the ring went on past outer round");
  cr_assert(cluster_log_has(&C, c, "resumed from"), "it did not resume: %s", proc_slurp(C.node[c].log));
  cr_assert_eq(params_differ(C.node[a].ckpt, C.node[a2].ckpt), 0, "the two others ended apart");
  cr_assert_eq(params_differ(C.node[a].ckpt, C.node[c].ckpt), 0, "the restarted member ended apart from the others");
}

/* With --outer-overlap a live member is nearly always waiting for a round
 * in flight, and a newcomer's state is served between rounds only. A
 * member its ring leaves behind (here one that joins from its own
 * initialisation, --no-state-pull) takes, as a catch-up, the state of a
 * member whose round is in flight (its donor serves it while it waits in
 * that round), runs the round again from what its donor sent (the round's
 * pseudo-gradient comes with the state) and lands it as its donor does:
 * both end with the same parameters. Before, the live member waited for it
 * in the round while it waited for a donation given only between rounds:
 * 120 s, then it failed ("no peer donated its state"). */
Test(outer, a_member_left_behind_catches_up_with_overlapped_rounds) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int a = start_overlapped("0/2", false);
  cr_assert(cluster_wait_file(C.node[a].log, "outer round 3 at step", 60), "peer a ran no rounds: %s",
            proc_slurp(C.node[a].log));
  int b = start_overlapped("1/2", true);
  late_member_ended(a, b, "taking the state of");
  cr_assert_eq(params_differ(C.node[a].ckpt, C.node[b].ckpt), 0, "the members ended apart");
}

/* One member alone (its ring is itself) trains 100 steps, H 20, saving at
 * step `save` (the run's only save); the save is copied aside (the peer is
 * stopped meanwhile), and a run resumed from it to step 100 must end where
 * the first did, having read `rounds_done` from it. `extra`: NULL-ended
 * options (overlap), `tag` names the files. */
static void resume_case(const char *tag, char *const *extra, int save, const char *rounds_done) {
  cluster_start_bootstrap(&C, NULL); /* a bootstrap node keeps its cluster's label: one per setting */
  char full[300], part[300], every[16], seen_at[32];
  snprintf(full, sizeof full, "%s/full-%s.safetensors", C.dir, tag);
  snprintf(part, sizeof part, "%s/part-%s.safetensors", C.dir, tag);
  snprintf(every, sizeof every, "%d", save);
  snprintf(seen_at, sizeof seen_at, "(step %d)", save);
  char *common[] = {"--model", MODEL, "--sync", "allreduce", "--outer", "nesterov", "--local-steps", "20",
                    "--batch", "16", "--seed", "7", "--no-eval", "--checkpoint-every", every, "--max-steps", "100"};
  char *argv[40];
  int n = 0;
  argv[n++] = "--bootstrap";
  argv[n++] = C.boot;
  for (size_t k = 0; k < sizeof common / sizeof common[0]; k++) argv[n++] = common[k];
  for (int k = 0; extra && extra[k]; k++) argv[n++] = extra[k];
  int base = n;
  argv[n++] = "--slowdown"; /* about 40 steps from the save to the end: a wide window to stop it in */
  argv[n++] = "20";
  argv[n++] = "--checkpoint";
  argv[n++] = full;
  argv[n] = NULL;
  int p = cluster_spawn(&C, "peer", argv);
  bool seen = false;
  for (double t0 = cluster_now(); !seen && cluster_now() - t0 < 180; usleep(2000)) {
    char *log = proc_slurp(C.node[p].log);
    seen = strstr(log, seen_at) != NULL;
    free(log);
  }
  kill(C.node[p].pid, SIGSTOP);
  cr_assert(seen, "no save at step %d: %s", save, proc_slurp(C.node[p].log));
  cluster_sh("cp %s %s", full, part);
  kill(C.node[p].pid, SIGCONT);
  expect_clean_exit(p);
  cr_assert_eq(cluster_result(&C, p, "outer_rounds"), 5);
  struct checkpoint ck;
  struct rumor_err e;
  cr_assert_eq(checkpoint_open(part, &ck, &e), 0, "%s", e.msg);
  int64_t saved = ck.info.st.step;
  checkpoint_close(&ck);
  cr_assert_eq(saved, save, "the copy holds step %lld: the peer went on past step %d before it was stopped",
               (long long)saved, save);
  n = base;
  argv[n++] = "--checkpoint";
  argv[n++] = part;
  argv[n++] = "--resume";
  argv[n++] = part;
  argv[n] = NULL;
  int q = cluster_spawn(&C, "peer", argv);
  expect_clean_exit(q);
  cr_assert(cluster_log_has(&C, q, rounds_done),
            "the resumed run did not take the outer state from the checkpoint: %s", proc_slurp(C.node[q].log));
  cr_assert_eq(cluster_result(&C, q, "outer_rounds"), 5);
  int64_t diff = params_differ(full, part);
  cr_assert_eq(diff, 0, "the resumed run (%s) ends %lld values away from the uninterrupted one", tag, (long long)diff);
}

/* Saves at step 60: a round boundary (the save comes before that round
 * runs) and, with --outer-overlap, a point with a round in flight; with
 * --outer-overlap-steps 5 at step 62, with round 2 (started at step 60) in
 * flight until step 65. */
Test(outer, a_diloco_run_resumed_from_a_checkpoint_ends_bit_for_bit_where_it_would_have) {
  SKIP_WITHOUT_DATA();
  resume_case("sync", NULL, 60, ": 2 rounds done");
  resume_case("ov", (char *[]){"--outer-overlap", NULL}, 60, ": 1 rounds done");
  resume_case("ov5", (char *[]){"--outer-overlap", "--outer-overlap-steps", "5", NULL}, 62, ": 2 rounds done");
  /* Both runs of the last case landed round 2 (the third) 5 steps after its boundary. */
  for (int k = C.n - 2; k < C.n; k++)
    cr_assert(cluster_log_has(&C, k, "outer round 3 at step 65"), "round 2 did not land at step 65: %s",
              proc_slurp(C.node[k].log));
}

Test(outer, noloco_members_pair_up_at_round_boundaries) {
  SKIP_WITHOUT_DATA();
  cluster_start_bootstrap(&C, NULL);
  int peer[4];
  char shard[4][8];
  for (int i = 0; i < 4; i++) {
    snprintf(shard[i], sizeof shard[i], "%d/4", i);
    peer[i] = cluster_start_peer(&C, "--model", MODEL, "--outer", "nesterov", STABLE_OUTER, "--local-steps", "10",
                                 "--shard", shard[i], "--max-steps", "150", "--batch", "16", "--seed", "7", "--no-eval",
                                 "--wait-peers", "4", "--max-hold-ms", "5000", "--slowdown", "30", NULL);
  }
  for (int i = 0; i < 4; i++) expect_clean_exit(peer[i]);
  for (int i = 0; i < 4; i++) {
    double rounds = cluster_result(&C, peer[i], "outer_rounds"), alone = cluster_result(&C, peer[i], "outer_alone");
    double xch = cluster_result(&C, peer[i], "exchanges");
    fprintf(stderr, "noloco peer %d: %g rounds, %g alone, %g exchanges, accuracy %.4f\n", i, rounds, alone, xch,
            cluster_result(&C, peer[i], "test_accuracy"));
    cr_assert_eq(rounds, 15);
    /* Members at one boundary find a partner: at most a few rounds alone
     * (the first, while the others start, or the last). */
    cr_assert(alone <= 4 && xch >= rounds - alone, "peer %d: %g of %g rounds alone, %g exchanges", i, alone, rounds, xch);
    cr_assert(cluster_result(&C, peer[i], "test_accuracy") > 0.6); /* trained: chance is 0.1 */
  }
}

Test(outer, bad_outer_options_are_refused_before_anything_starts) {
  struct {
    const char *a, *b, *c, *d, *needle;
  } cases[] = {
      {"--outer", "adam", NULL, NULL, "--outer must be none, sgd or nesterov"},
      {"--outer", "nesterov", "--local-steps", "0", "--local-steps"},
      {"--outer-lr", "0.5", NULL, NULL, "--outer-lr is an option of --outer"},
      {"--outer", "sgd", "--outer-compress", "topk:0.03:2", "NoLoCo (--sync gossip) sends parameters"},
      {"--outer", "sgd", "--outer-compress", "topk:2:2", "--outer-compress"},
      {"--outer", "sgd", "--outer-compress", "f32", "--outer-compress"},
      {"--outer", "nesterov", "--gossip-every", "2", "--gossip-every is an option of gossip averaging"},
      {"--outer", "nesterov", "--finish-wait-ms", "100", "--finish-wait-ms is an option of gossip averaging"},
  };
  for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++) {
    char *argv[16] = {"peer", "--cluster-key", C.key, "--identity", C.key, "--model", MODEL};
    int n = 7;
    argv[n++] = (char *)cases[i].a;
    argv[n++] = (char *)cases[i].b;
    if (cases[i].c) argv[n++] = (char *)cases[i].c, argv[n++] = (char *)cases[i].d;
    argv[n] = NULL;
    cluster_expect_exit(&C, argv, 2, cases[i].needle);
  }
  char *ps[] = {"peer", "--cluster-key", C.key, "--identity", C.key, "--sync", "ps", "--servers", "127.0.0.1:9",
                "--outer", "nesterov", NULL};
  cluster_expect_exit(&C, ps, 2, "--outer is for --sync allreduce (DiLoCo) or --sync gossip (NoLoCo)");
  /* --outer-overlap-steps: DiLoCo with --outer-overlap, at most H. */
  const char *const want = "needs --outer-overlap and --sync allreduce, and at most --local-steps";
  char *no_overlap[] = {"peer", "--cluster-key", C.key, "--identity", C.key, "--sync", "allreduce", "--outer",
                        "nesterov", "--outer-overlap-steps", "5", NULL};
  cluster_expect_exit(&C, no_overlap, 2, want);
  char *noloco[] = {"peer", "--cluster-key", C.key, "--identity", C.key, "--outer", "nesterov", "--outer-overlap",
                    "--outer-overlap-steps", "5", NULL};
  cluster_expect_exit(&C, noloco, 2, want);
  char *past_h[] = {"peer", "--cluster-key", C.key, "--identity", C.key, "--sync", "allreduce", "--outer",
                    "nesterov", "--outer-overlap", "--local-steps", "10", "--outer-overlap-steps", "11", NULL};
  cluster_expect_exit(&C, past_h, 2, want);
}

/* The outer step on a GPU (anchor, momentum and parameters on the device,
 * the pseudo-gradient through the host) against the same run on the CPU:
 * a member alone, 60 steps, three rounds. */
Test(outer, a_diloco_member_on_cuda_ends_where_the_same_run_on_the_cpu_does) {
  SKIP_WITHOUT_DATA();
  if (!tensor_cuda_compiled() || tensor_cuda_device_count() < 1)
    cr_skip_test("no CUDA GPU here (built with CUDA: %s): the CUDA outer step runs where one is",
                 tensor_cuda_compiled() ? "yes" : "no");
  char path[2][300];
  const char *dev[2] = {"cpu", "cuda"};
  for (int k = 0; k < 2; k++) {
    cluster_start_bootstrap(&C, NULL);
    snprintf(path[k], sizeof path[k], "%s/%s.safetensors", C.dir, dev[k]);
    int p = cluster_start_peer(&C, "--model", MODEL, "--sync", "allreduce", "--outer", "nesterov", "--local-steps",
                               "20", "--max-steps", "60", "--batch", "16", "--seed", "7", "--no-eval", "--device",
                               dev[k], "--checkpoint", path[k], NULL);
    expect_clean_exit(p);
    cr_assert_eq(cluster_result(&C, p, "outer_rounds"), 3);
  }
  int64_t P, Q;
  float *a = ckpt_params_load(path[0], &P), *b = ckpt_params_load(path[1], &Q);
  cr_assert_eq(P, Q);
  double d2 = 0, s2 = 0;
  for (int64_t j = 0; j < P; j++) {
    cr_assert(isfinite(b[j]), "the CUDA run's value %lld is not finite", (long long)j);
    d2 += ((double)a[j] - b[j]) * ((double)a[j] - b[j]);
    s2 += (double)a[j] * a[j];
  }
  double rel = sqrt(d2 / s2);
  fprintf(stderr, "DiLoCo on CUDA vs the CPU after 3 rounds: relative difference %.3g\n", rel);
  cr_assert(rel < 1e-3, "the CUDA run ends %.3g (relative) from the CPU's", rel);
  free(a);
  free(b);
}
