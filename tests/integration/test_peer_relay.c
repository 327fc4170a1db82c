/*
 * Peers that cannot accept connections (--no-inbound: they listen nowhere,
 * so every connection to them must come through a relay) train with the
 * cluster: they register with a bootstrap node that relays, advertise
 * "@RELAY", and exchange with each other through it, authenticated and
 * encrypted end to end. A relay killed mid-run costs the exchanges in
 * flight through it, not the run: the NATed peers move to the next relay.
 * (deploy/testnet.sh's `nat` hosts show the same behind a real NAT:
 * tests/scripts/relay_nat.sh.)
 */
#include <criterion/criterion.h>
#include <signal.h>
#include <unistd.h>

#include "../support/cluster.h"
#include "net/net.h"

static struct cluster C;

static void setup(void) {
  cluster_init(&C);
  C.bin = RUMOR_BIN;
}

static void teardown(void) { cluster_fini(&C, getenv("RUMOR_TEST_KEEP") != NULL); }

/* The first 12 characters of node i's key (what log lines name it by). */
static void key_prefix(int i, char out[13]) {
  char *o = proc_slurp(C.node[i].out);
  const char *p = strstr(o, "\"id\":\"");
  cr_assert(p, "node %d printed no id", i);
  snprintf(out, 13, "%.12s", p + 6);
  free(o);
}

/* True when node i's log shows a connection with node j over a relay
 * (over the relay at `via`, when not NULL). */
static bool relayed_link(int i, int j, const char *via) {
  char k[13], needle[32], at[80];
  key_prefix(j, k);
  snprintf(at, sizeof at, " @%s ", via ? via : "");
  char *log = proc_slurp(C.node[i].log);
  bool found = false;
  for (const char *p = log; (p = strstr(p, via ? at : " @")) != NULL; p++) {
    const char *eol = strchr(p, '\n');
    snprintf(needle, sizeof needle, "key=%s", k);
    const char *hit = strstr(p, needle);
    if (hit && (!eol || hit < eol)) {
      found = true;
      break;
    }
  }
  free(log);
  return found;
}

/* --max-local-steps: a whole run here takes a few tenths of a second, no
 * longer than the peers' start-up, and a peer that started first would
 * train most of its run alone (one ended at 0.70 where the others reached
 * 0.85); bounding the steps between applied exchanges keeps the three
 * training together (each peer holds, at most --max-hold-ms, for one). */
#define PEER_ARGS(shard, epochs)                                                                                       \
  "--model", "mlp:784-64-10", "--shard", shard, "--epochs", epochs, "--batch", "64", "--lr", "0.1", "--wait-peers", "3", \
      "--max-local-steps", "10"

static int start_peer(const char *shard, bool natted, const char *epochs) {
  if (natted) return cluster_start_peer(&C, PEER_ARGS(shard, epochs), "--no-inbound", NULL);
  return cluster_start_peer(&C, PEER_ARGS(shard, epochs), NULL);
}

Test(peer_relay, natted_peers_train_and_exchange_through_a_relay, .init = setup, .fini = teardown, .timeout = 240) {
  char *boot_args[] = {"--relay", NULL};
  cluster_start_bootstrap(&C, boot_args);
  int pub = start_peer("0/3", false, "4");
  int a = start_peer("1/3", true, "4");
  int b = start_peer("2/3", true, "4");
  int peers[] = {pub, a, b};
  for (int k = 0; k < 3; k++) cr_assert_eq(cluster_wait(&C, peers[k], 200), 0, "peer %d: %s", k, proc_slurp(C.node[peers[k]].log));
  for (int k = 0; k < 3; k++) {
    double acc = cluster_result(&C, peers[k], "test_accuracy");
    fprintf(stderr, "peer %d: accuracy %.4f, %.0f exchanges, %.0f relayed bytes\n", k, acc,
            cluster_result(&C, peers[k], "exchanges"), cluster_result(&C, peers[k], "relayed_bytes"));
    cr_assert_gt(acc, 0.80, "peer %d trains to the usual accuracy", k);
    cr_assert_gt(cluster_result(&C, peers[k], "exchanges"), 0);
  }
  cr_assert_gt(cluster_result(&C, a, "relayed_bytes"), 0, "a NATed peer's traffic went through the relay");
  cr_assert_gt(cluster_result(&C, b, "relayed_bytes"), 0);
  cr_assert(cluster_log_has(&C, a, "reachable through the relay"), "%s", proc_slurp(C.node[a].log));
  cr_assert(relayed_link(a, b, NULL) || relayed_link(b, a, NULL), "the two NATed peers connected through the relay");
  cr_assert(cluster_log_has(&C, 0, "relaying for"), "the bootstrap node relayed");
}

Test(peer_relay, a_relay_killed_mid_run_costs_only_its_exchanges, .init = setup, .fini = teardown, .timeout = 240) {
  /* The bootstrap node relays, and so does the public peer (--relay): the
   * NATed peers take the bootstrap node first, and find the peer through
   * the relay flag SWIM spreads once the bootstrap node is gone. */
  char *boot_args[] = {"--relay", NULL};
  cluster_start_bootstrap(&C, boot_args);
  int b1 = 0;
  char first[64];
  snprintf(first, sizeof first, "%s", C.boot);
  int pub = cluster_start_peer(&C, PEER_ARGS("0/3", "30"), "--relay", NULL);
  int a = start_peer("1/3", true, "30");
  int b = start_peer("2/3", true, "30");
  /* Mid-run: the NATed pair is connected through the first relay and the
   * run is under way (two epochs of thirty in). */
  double end = cluster_now() + 120;
  while (cluster_now() < end && !((relayed_link(a, b, first) || relayed_link(b, a, first)) &&
                                  cluster_log_has(&C, a, "epoch 2/30 done")))
    usleep(100 * 1000);
  cr_assert(relayed_link(a, b, first) || relayed_link(b, a, first), "no link through the relay before the kill");
  cr_assert(kill(C.node[a].pid, 0) == 0 && kill(C.node[b].pid, 0) == 0, "the run ended before the kill");
  cr_assert(cluster_log_has(&C, b1, "relaying for"), "the first relay took the NATed peers");
  cr_assert_eq(kill(C.node[b1].pid, SIGKILL), 0);
  int peers[] = {pub, a, b};
  for (int k = 0; k < 3; k++) cr_assert_eq(cluster_wait(&C, peers[k], 200), 0, "peer %d: %s", k, proc_slurp(C.node[peers[k]].log));
  for (int k = 0; k < 3; k++) {
    double acc = cluster_result(&C, peers[k], "test_accuracy");
    double failed = cluster_result(&C, peers[k], "exchanges_failed");
    fprintf(stderr, "peer %d: accuracy %.4f, %.0f exchanges, %.0f failed\n", k, acc,
            cluster_result(&C, peers[k], "exchanges"), failed);
    cr_assert_gt(acc, 0.80, "peer %d still trains to the usual accuracy", k);
    cr_assert_leq(failed, 3, "peer %d lost more than the exchanges in flight", k);
  }
  /* The NATed peers moved to the peer that relays and kept going through it. */
  cr_assert(cluster_log_has(&C, a, "is lost"), "%s", proc_slurp(C.node[a].log));
  cr_assert(cluster_log_has(&C, pub, "relaying for"), "the relaying peer took over");
  char via[96];
  snprintf(via, sizeof via, "reachable through the relay %s", C.node[pub].addr);
  cr_assert(cluster_log_has(&C, a, via) && cluster_log_has(&C, b, via), "both moved to %s", C.node[pub].addr);
  cr_assert(relayed_link(a, b, C.node[pub].addr) || relayed_link(b, a, C.node[pub].addr),
            "the NATed pair connected again through the second relay");
}

/* `rumor top --once --json` with the cluster's keys; returns its output. */
static char *top_json(void) {
  char id[300];
  snprintf(id, sizeof id, "%s/top.key", C.dir);
  if (access(id, F_OK) != 0) cluster_sh("%s keygen -o %s >/dev/null 2>&1", RUMOR_BIN, id);
  char *argv[] = {RUMOR_BIN, "top", "--bootstrap", C.boot, "--cluster-key", C.key, "--identity", id,
                  "--once", "--json", NULL};
  char *out, *err;
  int st = proc_run(argv, 60, C.dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "top failed (status %d): %s", st, err);
  free(err);
  return out;
}

static int count(const char *s, const char *needle) {
  int n = 0;
  for (const char *p = s; (p = strstr(p, needle)) != NULL; p += strlen(needle)) n++;
  return n;
}

Test(peer_relay, all_reduce_rounds_and_rumor_top_work_through_a_relay, .init = setup, .fini = teardown,
     .timeout = 240) {
  char *boot_args[] = {"--relay", NULL};
  cluster_start_bootstrap(&C, boot_args);
  int peers[3];
  for (int k = 0; k < 3; k++) {
    char shard[8];
    snprintf(shard, sizeof shard, "%d/3", k);
    peers[k] = cluster_start_peer(&C, "--model", "mlp:784-64-10", "--sync", "allreduce", "--shard", shard,
                                  "--max-steps", "1500", "--batch", "32", "--lr", "0.05", "--wait-peers", "3",
                                  k ? "--no-inbound" : NULL, NULL);
  }
  for (int k = 0; k < 3; k++)
    cr_assert(cluster_wait_file(C.node[peers[k]].log, "first step", 60), "peer %d did not start", k);
  /* rumor top reaches every member, the NATed ones through the relay. */
  char *out = top_json();
  fprintf(stderr, "rumor top through the relay: %.300s...\n", out);
  cr_assert(strstr(out, "\"reachable_peers\":3"), "%s", out);
  cr_assert_eq(count(out, "\"addr\":\"@"), 2, "two members advertise a relay: %s", out);
  cr_assert_geq(count(out, "\"relay_via\":\"127.0.0.1:"), 2, "%s", out);
  free(out);
  for (int k = 0; k < 3; k++) cr_assert_eq(cluster_wait(&C, peers[k], 200), 0, "peer %d: %s", k, proc_slurp(C.node[peers[k]].log));
  double rounds[3];
  for (int k = 0; k < 3; k++) {
    rounds[k] = cluster_result(&C, peers[k], "allreduce_rounds");
    double acc = cluster_result(&C, peers[k], "test_accuracy");
    fprintf(stderr, "peer %d: %.0f rounds, accuracy %.4f, %.0f relayed bytes\n", k, rounds[k], acc,
            cluster_result(&C, peers[k], "relayed_bytes"));
    cr_assert_gt(rounds[k], 1000, "peer %d: the ring ran through the relay", k);
    cr_assert_gt(acc, 0.75);
  }
  cr_assert_gt(cluster_result(&C, peers[1], "relayed_bytes"), 0);
  cr_assert_gt(cluster_result(&C, peers[2], "relayed_bytes"), 0);
}

/* Orders two text keys as their bytes (the ring's order). */
static int key_order(const void *a, const void *b) {
  const char *x = *(const char *const *)a, *y = *(const char *const *)b;
  uint8_t kx[NET_PUBKEY_BYTES], ky[NET_PUBKEY_BYTES];
  cr_assert_eq(net_pubkey_parse(x, strlen(x), kx), 0, "not a key: '%s'", x);
  cr_assert_eq(net_pubkey_parse(y, strlen(y), ky), 0, "not a key: '%s'", y);
  return memcmp(kx, ky, NET_PUBKEY_BYTES);
}

/* Two members behind the relay whose keys are next to each other among
 * four: in the keys' order they would be ring neighbours, and every round
 * would carry a quarter of the ring's bytes through the relay. The ring
 * places each after a member that accepts connections instead (ring.c,
 * view_ring), and its hops go direct (links.c, go_direct): what crosses the
 * relay is a NATed member's control traffic, a few per cent of its bytes. */
Test(peer_relay, an_all_reduce_ring_keeps_its_hops_off_the_relay, .init = setup, .fini = teardown, .timeout = 240) {
  char *boot_args[] = {"--relay", NULL};
  cluster_start_bootstrap(&C, boot_args);
  char path[4][256], key[4][64];
  const char *by_key[4];
  for (int k = 0; k < 4; k++) {
    char name[16];
    snprintf(name, sizeof name, "ring%d", k);
    cluster_make_identity(&C, name, path[k], sizeof path[k]);
    char *argv[] = {RUMOR_BIN, "keygen", "--public", path[k], NULL}, *out, *err;
    cr_assert(proc_exited_with(proc_run(argv, 30, C.dir, &out, &err), 0), "keygen --public: %s", err);
    snprintf(key[k], sizeof key[k], "%.44s", out);
    by_key[k] = key[k];
    free(out);
    free(err);
  }
  qsort(by_key, 4, sizeof by_key[0], key_order);
  int peers[4];
  bool natted[4];
  for (int k = 0; k < 4; k++) {
    char shard[8];
    snprintf(shard, sizeof shard, "%d/4", k);
    /* The two lowest keys: neighbours in the keys' order. */
    natted[k] = strcmp(key[k], by_key[0]) == 0 || strcmp(key[k], by_key[1]) == 0;
    /* The later --identity wins over the one the cluster made. */
    peers[k] = cluster_start_peer(&C, "--model", "mlp:784-64-10", "--sync", "allreduce", "--shard", shard,
                                  "--max-steps", "400", "--batch", "32", "--lr", "0.05", "--wait-peers", "4",
                                  "--identity", path[k], natted[k] ? "--no-inbound" : NULL, NULL);
  }
  for (int k = 0; k < 4; k++)
    cr_assert_eq(cluster_wait(&C, peers[k], 200), 0, "peer %d: %s", k, proc_slurp(C.node[peers[k]].log));
  for (int k = 0; k < 4; k++) {
    double relayed = cluster_result(&C, peers[k], "relayed_bytes");
    double total = cluster_result(&C, peers[k], "bytes_in") + cluster_result(&C, peers[k], "bytes_out");
    fprintf(stderr, "peer %d (%s, key %.8s): %.0f rounds, %.0f of %.0f bytes through the relay\n", k,
            natted[k] ? "NATed" : "open", key[k], cluster_result(&C, peers[k], "allreduce_rounds"), relayed, total);
    cr_assert_gt(cluster_result(&C, peers[k], "allreduce_rounds"), 300, "peer %d", k);
    if (natted[k])
      cr_assert_lt(relayed, 0.1 * total, "peer %d: %.0f of its %.0f bytes crossed the relay: the ring's hop between "
                   "the two NATed members went through it", k, relayed, total);
  }
}
