/* The guard's defences, without a network: the token bucket behind the rate
 * limits (burst, refill, no limit), the per-member rate limits on exchange
 * requests and connections (one member's flood does not spend another's
 * budget, refusals are counted), strikes with a backoff that doubles and a
 * forgiveness that undoes one strike, and the verdict on exchange transfers
 * (a wrong length, a step going backwards at one incarnation, a restart). */
#include <criterion/criterion.h>
#include <string.h>

#include "gossip/gossip_impl.h"

static struct gossip *g;

/* A runtime with only what the guard reads: the configuration, the lock
 * its counters take, and an empty member table. */
static void setup(void) {
  g = xcalloc(1, sizeof *g);
  pthread_mutex_init(&g->lock, NULL);
  g->cfg.nparams = 1000;
  g->cfg.max_xch_per_s = 10;
  g->cfg.max_conn_per_s = 2;
}

static void teardown(void) {
  gossip_guard_free(g);
  pthread_mutex_destroy(&g->lock);
  free(g);
}

TestSuite(guard, .init = setup, .fini = teardown);

static void id_of(uint8_t *id, int k) {
  memset(id, 0, NET_PUBKEY_BYTES);
  id[0] = (uint8_t)k;
  id[31] = 0xA5;
}

Test(guard, bucket_allows_a_burst_of_twice_the_rate_then_refills_at_the_rate) {
  struct gossip_bucket b = {0};
  int took = 0;
  for (int i = 0; i < 100; i++) took += gossip_bucket_take(&b, 1000, 10.0);
  cr_assert_eq(took, 20, "burst of %d, want 2 x rate = 20", took);
  cr_assert(!gossip_bucket_take(&b, 1000, 10.0), "an empty bucket must refuse");
  /* 10 tokens a second: after 250 ms, 2 tokens (2.5, floored by use). */
  took = 0;
  for (int i = 0; i < 10; i++) took += gossip_bucket_take(&b, 1250, 10.0);
  cr_assert_eq(took, 2, "refilled %d tokens in 250 ms at 10/s, want 2", took);
  /* A long pause refills to the burst, never beyond. */
  took = 0;
  for (int i = 0; i < 100; i++) took += gossip_bucket_take(&b, 1000000, 10.0);
  cr_assert_eq(took, 20, "after a long pause %d, want the burst of 20", took);
}

Test(guard, bucket_with_rate_zero_never_refuses_and_a_clock_going_back_adds_nothing) {
  struct gossip_bucket b = {0};
  for (int i = 0; i < 10000; i++) cr_assert(gossip_bucket_take(&b, 5, 0.0), "rate 0 means no limit");
  struct gossip_bucket c = {0};
  for (int i = 0; i < 2; i++) cr_assert(gossip_bucket_take(&c, 5000, 1.0)); /* the burst of 2 */
  cr_assert(!gossip_bucket_take(&c, 1000, 1.0), "time going backwards must not refill the bucket");
  cr_assert(!gossip_bucket_take(&c, 5000, 1.0), "nor when it comes back to where it was");
  cr_assert(gossip_bucket_take(&c, 6000, 1.0), "one second later: one token");
}

Test(guard, exchange_requests_are_limited_per_member_and_refusals_counted) {
  uint8_t flood[NET_PUBKEY_BYTES], honest[NET_PUBKEY_BYTES];
  id_of(flood, 1);
  id_of(honest, 2);
  int allowed = 0;
  for (int i = 0; i < 500; i++) allowed += gossip_guard_allow_xch(g, flood, 100);
  cr_assert_eq(allowed, 20, "the flooder got %d requests through at once, want the burst of 20", allowed);
  cr_assert_eq(g->mon.counters.exchange_rate_limited, 480);
  /* Another member's budget is its own. */
  for (int i = 0; i < 20; i++) cr_assert(gossip_guard_allow_xch(g, honest, 100), "honest request %d refused", i);
  /* One second later the flooder has 10 more. */
  allowed = 0;
  for (int i = 0; i < 50; i++) allowed += gossip_guard_allow_xch(g, flood, 1100);
  cr_assert_eq(allowed, 10, "after 1 s at 10/s the flooder got %d, want 10", allowed);
}

Test(guard, connections_are_limited_per_member) {
  uint8_t a[NET_PUBKEY_BYTES], b[NET_PUBKEY_BYTES];
  id_of(a, 3);
  id_of(b, 4);
  int allowed = 0;
  for (int i = 0; i < 50; i++) allowed += gossip_guard_allow_conn(g, a, 0);
  cr_assert_eq(allowed, 4, "connections accepted %d, want the burst of 2 x 2", allowed);
  cr_assert_eq(g->mon.counters.conn_rate_limited, 46);
  cr_assert(gossip_guard_allow_conn(g, b, 0), "another member's first connection was refused");
  g->cfg.max_conn_per_s = 0; /* no limit */
  for (int i = 0; i < 100; i++) cr_assert(gossip_guard_allow_conn(g, a, 0));
}

Test(guard, strikes_back_a_member_off_for_a_doubling_time_and_forgiveness_undoes_one) {
  uint8_t bad[NET_PUBKEY_BYTES], other[NET_PUBKEY_BYTES];
  id_of(bad, 5);
  id_of(other, 6);
  cr_assert(!gossip_backed_off(g, bad, 0), "a member never struck is not backed off");
  gossip_strike(g, bad, "test", 10000);
  cr_assert_eq(gossip_strikes(g, bad), 1);
  cr_assert(gossip_backed_off(g, bad, 11999), "1 strike: backed off for 2 s");
  cr_assert(!gossip_backed_off(g, bad, 12000), "1 strike: free again after 2 s");
  gossip_strike(g, bad, "test", 20000);
  cr_assert(gossip_backed_off(g, bad, 23999) && !gossip_backed_off(g, bad, 24000), "2 strikes: 4 s");
  for (int k = 3; k <= 12; k++) gossip_strike(g, bad, "test", 100000);
  cr_assert(gossip_backed_off(g, bad, 100000 + 255999) && !gossip_backed_off(g, bad, 100000 + 256000),
            "many strikes: the backoff stops growing at 256 s");
  cr_assert(!gossip_backed_off(g, other, 100000), "a strike against one member backs off no other");
  gossip_forgive(g, bad);
  cr_assert_eq(gossip_strikes(g, bad), 11, "a clean exchange forgives exactly one strike");
  gossip_forgive(g, other);
  cr_assert_eq(gossip_strikes(g, other), 0, "forgiving a member never struck leaves it at 0");
  gossip_guard_on_return(g, bad);
  cr_assert(!gossip_backed_off(g, bad, 100001), "a member that comes back is no longer backed off");
  gossip_back_off(g, other, 5000);
  gossip_back_off(g, other, 3000); /* never shortens */
  cr_assert(gossip_backed_off(g, other, 4999) && !gossip_backed_off(g, other, 5000));
}

Test(guard, transfers_of_the_wrong_length_or_a_replayed_step_are_refused_with_the_reason) {
  uint8_t p[NET_PUBKEY_BYTES];
  id_of(p, 7);
  char why[160];
  cr_assert(!gossip_guard_check_transfer(g, p, 999, 10, why, sizeof why), "a short transfer was taken");
  cr_assert(strstr(why, "999 values for a model of 1000"), "%s", why);
  cr_assert(gossip_guard_check_transfer(g, p, 1000, 10, why, sizeof why));
  cr_assert(gossip_guard_check_transfer(g, p, 1000, 10, why, sizeof why), "the same step again is not a replay");
  cr_assert(gossip_guard_check_transfer(g, p, 1000, 25, why, sizeof why));
  cr_assert(!gossip_guard_check_transfer(g, p, 1000, 24, why, sizeof why), "a step going backwards was taken");
  cr_assert(strstr(why, "replayed an old round") && strstr(why, "step 24 after one of step 25"), "%s", why);
  /* A restart raises the member's incarnation: its steps may start over. */
  struct swim_update self = {.state = SWIM_ALIVE, .incarnation = 1};
  memset(self.id, 0xEE, sizeof self.id);
  struct swim_io io = {0};
  struct swim_config sc;
  swim_config_default(&sc);
  swim_init(&g->swim, &sc, &io, &self, 1, 0);
  struct swim_update u = {.role = SWIM_ROLE_PEER, .state = SWIM_ALIVE, .incarnation = 7};
  memcpy(u.id, p, sizeof u.id);
  snprintf(u.addr, sizeof u.addr, "127.0.0.1:1");
  swim_apply(&g->swim, &u, 0);
  cr_assert(gossip_guard_check_transfer(g, p, 1000, 3, why, sizeof why),
            "after a restart (new incarnation) an early step was refused: %s", why);
  cr_assert(!gossip_guard_check_transfer(g, p, 1000, 2, why, sizeof why), "a replay within the new incarnation");
  swim_free(&g->swim);
}
