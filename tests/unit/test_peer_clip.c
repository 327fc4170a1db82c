/* Clipped gossip averaging's threshold (peer/sync/clip.c, contract in
 * peer/sync/sync.h, "Clipping"): a fixed τ scales by min(1, τ/d); the
 * adaptive τ is two medians of the partners' latest non-zero distances, each
 * partner counted once, capped during the warm-up, floored at 1 % of the
 * norm; outliers past three medians are flagged; partners expire after 200
 * exchanges, except that the three most recently met always count once three
 * are known; the least recent is replaced when 64 are remembered; NaN and
 * Inf distances change nothing.
 *
 * Every expected τ and scale is worked out by hand from the distances fed
 * in and written out as a number; the numbers assume the CLIP_* constants
 * pinned by the first test. Where a partner count is even, "the median" may
 * be either middle value, and only the range both allow is asserted. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>

#include "peer/sync/sync.h" /* defines: clip_init, clip_scale, struct clip_state, CLIP_* */

/* ---- helpers --------------------------------------------------------------------- */

#define MAX_IDS 256

/* Partner k's 32-byte identity: k in the first two bytes, a fixed filler
 * after (so two identities differ only where the code must look). */
static const uint8_t *pid(int k) {
  static uint8_t ids[MAX_IDS][CLIP_ID_BYTES];
  cr_assert(k >= 0 && k < MAX_IDS, "partner %d out of the test's range", k);
  memset(ids[k], 0x5a, CLIP_ID_BYTES);
  ids[k][0] = (uint8_t)(k & 0xff);
  ids[k][1] = (uint8_t)(k >> 8);
  return ids[k];
}

/* |got − ref| ≤ atol + rtol·|ref|, with NaN or Inf never close. */
static bool close_to(double got, double ref) {
  return isfinite(got) && fabs(got - ref) <= 1e-12 + 1e-12 * fabs(ref);
}

/* One exchange with partner `who` at distance `dist` (our norm `norm`):
 * the scale, the τ used and the outlier flag must be the ones given. */
static void expect(struct clip_state *c, int who, double dist, double norm, double want_scale, double want_tau,
                   bool want_outlier, const char *what) {
  double s = clip_scale(c, pid(who), dist, norm);
  cr_assert(close_to(c->last_tau, want_tau), "%s: partner %d at distance %g (norm %g): tau %.17g, want %.17g", what,
            who, dist, norm, c->last_tau, want_tau);
  cr_assert(close_to(s, want_scale), "%s: partner %d at distance %g: scale %.17g, want %.17g (tau %.17g)", what, who,
            dist, s, want_scale, c->last_tau);
  cr_assert_eq(c->last_outlier, want_outlier, "%s: partner %d at distance %g (tau %g): outlier %d, want %d", what,
               who, dist, c->last_tau, c->last_outlier, want_outlier);
}

/* As expect, for an exchange that is not checked in detail: the scale must
 * still be min(1, τ/dist) for whatever τ was used, and in [0, 1]. */
static double feed(struct clip_state *c, int who, double dist, double norm) {
  double s = clip_scale(c, pid(who), dist, norm);
  double want = dist > c->last_tau ? c->last_tau / dist : 1.0;
  cr_assert(s >= 0.0 && s <= 1.0 && close_to(s, want), "partner %d at distance %g: scale %.17g, want %.17g (tau %g)",
            who, dist, s, want, c->last_tau);
  return s;
}

/* ---- the constants the numbers below assume ------------------------------------- */

Test(clip, constants_are_the_ones_the_written_out_numbers_assume) {
  cr_assert_eq(CLIP_PARTNERS, 64);
  cr_assert_eq(CLIP_RECENT, 200);
  cr_assert_eq(CLIP_WARMUP, 3);
  cr_assert_eq(CLIP_WARMUP_REL, 0.1);
  cr_assert_eq(CLIP_FLOOR_REL, 1e-2);
  cr_assert_eq(CLIP_TAU_MEDIANS, 2.0);
  cr_assert_eq(CLIP_OUTLIER, 3.0);
  cr_assert_eq(CLIP_ID_BYTES, 32);
}

/* ---- fixed τ --------------------------------------------------------------------- */

Test(clip, fixed_tau_scales_by_min_1_tau_over_d_and_counts_the_clipped) {
  struct clip_state c;
  clip_init(&c, 2.0);
  cr_assert_eq(c.tau_fixed, 2.0);
  /* Below and at τ: whole; above: scaled to length τ. The norm plays no
   * part (no warm-up cap, no floor), and nothing is an outlier. */
  expect(&c, 1, 1.0, 100.0, 1.0, 2.0, false, "d < tau");
  expect(&c, 1, 2.0, 100.0, 1.0, 2.0, false, "d = tau");
  cr_assert_eq(c.clipped, 0, "%llu clipped, want 0", (unsigned long long)c.clipped);
  expect(&c, 2, 8.0, 100.0, 0.25, 2.0, false, "d = 4 tau");
  expect(&c, 3, 2.5, 1.0, 0.8, 2.0, false, "d = 1.25 tau, norm 1 (a warm-up cap would give 0.1)");
  expect(&c, 4, 2000.0, 0.0, 0.001, 2.0, false, "d = 1000 tau: clipped, not an outlier with a fixed tau");
  expect(&c, 5, 0.0, 100.0, 1.0, 2.0, false, "d = 0");
  cr_assert_eq(c.clipped, 3, "%llu clipped, want 3 (8, 2.5 and 2000)", (unsigned long long)c.clipped);
  cr_assert_eq(c.seen, 6, "%llu exchanges seen, want 6", (unsigned long long)c.seen);
}

Test(clip, init_with_tau_zero_or_negative_is_adaptive) {
  struct clip_state c;
  clip_init(&c, -3.0);
  cr_assert_eq(c.tau_fixed, 0.0);
  /* Adaptive: one partner at 30, norm 1000 → 2·30 = 60 (under the warm-up
   * cap 100); a fixed τ of −3 would clip everything. */
  expect(&c, 1, 30.0, 1000.0, 1.0, 60.0, false, "tau_fixed -3 means adaptive");
  clip_init(&c, 0.0);
  expect(&c, 1, 30.0, 1000.0, 1.0, 60.0, false, "tau_fixed 0 means adaptive");
  cr_assert_eq(c.seen, 1, "clip_init must reset the state");
}

/* ---- adaptive τ ------------------------------------------------------------------ */

Test(clip, adaptive_tau_is_two_medians_of_the_partners_latest_distances) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000; /* floor 10, warm-up cap 100: neither binds below */
  expect(&c, 1, 20, norm, 1.0, 40.0, false, "{20}: median 20");
  /* {20, 40}: either middle value; τ in [40, 80], and 40 is not above it. */
  double s = clip_scale(&c, pid(2), 40, norm);
  cr_assert(c.last_tau >= 40.0 && c.last_tau <= 80.0, "{20, 40}: tau %g outside [40, 80]", c.last_tau);
  cr_assert_eq(s, 1.0);
  expect(&c, 3, 30, norm, 1.0, 60.0, false, "{20, 40, 30}: median 30");
  s = clip_scale(&c, pid(4), 35, norm);
  cr_assert(c.last_tau >= 60.0 && c.last_tau <= 70.0, "{20, 40, 30, 35}: tau %g outside [60, 70]", c.last_tau);
  cr_assert_eq(s, 1.0);
  expect(&c, 5, 90, norm, 70.0 / 90.0, 70.0, false, "{20, 40, 30, 35, 90}: median 35, tau 70, scale 70/90");
  /* A partner's latest distance replaces its earlier one: partner 1 from
   * 20 to 25 → {25, 40, 30, 35, 90}, median 35 still; then partner 5 from
   * 90 to 24 → {25, 40, 30, 35, 24}, median 30. */
  expect(&c, 1, 25, norm, 1.0, 70.0, false, "partner 1 now at 25");
  expect(&c, 5, 24, norm, 1.0, 60.0, false, "partner 5 now at 24");
  expect(&c, 2, 75, norm, 0.8, 60.0, false, "partner 2 now at 75: {25, 75, 30, 35, 24}, median 30, scale 60/75");
  cr_assert_eq(c.n, 5, "%d partners remembered, want 5", c.n);
  cr_assert_eq(c.clipped, 2, "%llu clipped, want 2 (90 and 75)", (unsigned long long)c.clipped);
}

Test(clip, each_partner_counts_once_so_a_fast_attacker_cannot_move_the_median) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000;
  /* Three honest partners, once each. */
  expect(&c, 1, 20, norm, 1.0, 40.0, false, "honest 1");
  feed(&c, 2, 24, norm);
  expect(&c, 3, 22, norm, 1.0, 44.0, false, "honest 3: {20, 24, 22}, median 22");
  /* Two attackers at 10⁶, 150 exchanges between them (under CLIP_RECENT,
   * so the honest partners still count): the partners are {20, 24, 22,
   * 10⁶, 10⁶}, median 24, τ 48, whatever the attackers' share of the
   * exchanges. A median over exchanges would be 10⁶. Past the first
   * attacker (4 partners, median 22 or 24) every attacker exchange is an
   * outlier (10⁶ > 3·24) and clipped to 48/10⁶. */
  feed(&c, 100, 1e6, norm);
  for (int i = 1; i < 150; i++) {
    char what[64];
    snprintf(what, sizeof what, "attacker exchange %d", i + 1);
    expect(&c, 100 + (i & 1), 1e6, norm, 48e-6, 48.0, true, what);
  }
  cr_assert_eq(c.n, 5, "%d partners remembered after 153 exchanges, want 5 (one entry each)", c.n);
  expect(&c, 2, 24, norm, 1.0, 48.0, false, "honest 2 again, after the attackers");
  cr_assert_eq(c.clipped, 150, "%llu clipped, want 150 (every attacker exchange, no honest one)",
               (unsigned long long)c.clipped);
}

Test(clip, zero_distances_are_not_recorded_and_tau_stays_at_its_floor) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000; /* floor: median ≥ 10, so τ ≥ 20 */
  /* While the cluster assembles every partner equals us. */
  for (int k = 1; k <= 5; k++)
    for (int r = 0; r < 3; r++) expect(&c, k, 0.0, norm, 1.0, 20.0, false, "distance 0: tau at the floor 2·10");
  cr_assert_eq(c.n, 0, "%d partners recorded from zero distances, want 0", c.n);
  cr_assert_eq(c.clipped, 0);
  /* The first real distance sets τ alone: 2·30 = 60. Had the fifteen zeros
   * been recorded, the median would be 0, floored to 10: τ 20, scale 2/3. */
  expect(&c, 6, 30, norm, 1.0, 60.0, false, "first non-zero distance after zeros");
  /* A partner recorded earlier that later sends 0 keeps its earlier
   * distance: {30, 40, 50}, then partner 7 at 0 changes nothing. */
  feed(&c, 7, 40, norm);
  expect(&c, 8, 50, norm, 1.0, 80.0, false, "{30, 40, 50}: median 40");
  expect(&c, 7, 0.0, norm, 1.0, 80.0, false, "partner 7 at 0 keeps its 40");
  /* Small honest distances: the median is taken as at least 10, τ 20,
   * and the outlier bound is 3 floored medians, 30. */
  clip_init(&c, 0);
  feed(&c, 1, 1, norm);
  feed(&c, 2, 2, norm);
  expect(&c, 3, 30, norm, 2.0 / 3.0, 20.0, false, "{1, 2, 30}: median 2, floored to 10; 30 not above 3·10");
  feed(&c, 4, 3, norm);
  expect(&c, 5, 31, norm, 20.0 / 31.0, 20.0, true, "{1, 2, 30, 3, 31}: median 3, floored to 10; 31 above 3·10");
}

Test(clip, warm_up_caps_tau_at_a_tenth_of_the_norm_and_flags_no_outlier) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 100; /* cap 10, floor 1 */
  /* One partner: median 50, 2 medians = 100, capped to 10. */
  expect(&c, 1, 50, norm, 0.2, 10.0, false, "1 partner, far");
  /* Two partners at 50 and 1000: still capped; 1000 is far past three
   * medians, but no outlier during the warm-up. */
  expect(&c, 2, 1000, norm, 0.01, 10.0, false, "2 partners, one very far");
  cr_assert_eq(c.clipped, 2);
  /* The third partner ends the warm-up: {50, 1000, 5}, median 50, τ 100,
   * no cap; 5 is not an outlier. */
  expect(&c, 3, 5, norm, 1.0, 100.0, false, "3rd partner ends the warm-up");
  /* Now 1000 from partner 2 again: {50, 1000, 5}, 1000 > 150: an outlier. */
  expect(&c, 2, 1000, norm, 0.1, 100.0, true, "after the warm-up, 20 medians is an outlier");
  /* During the warm-up τ is at most the cap, not the cap: a near partner
   * gives 2·2 = 4. */
  clip_init(&c, 0);
  expect(&c, 1, 2, norm, 1.0, 4.0, false, "warm-up, under the cap");
}

Test(clip, after_warm_up_a_distance_above_three_medians_is_an_outlier) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000;
  /* Seven partners at 20, 22, ..., 32: median 26. */
  for (int k = 1; k <= 7; k++) feed(&c, k, 18 + 2 * k, norm);
  expect(&c, 4, 26, norm, 1.0, 52.0, false, "seven partners, median 26");
  /* Partner 1 moves from 20 to 84: {84, 22, ..., 32}, median 28, and 84
   * is exactly 3 medians: clipped, not an outlier. At 85: an outlier, and
   * still clipped (the caller skips it; the scale stays defined). */
  expect(&c, 1, 84, norm, 56.0 / 84.0, 56.0, false, "3 medians exactly");
  expect(&c, 1, 85, norm, 56.0 / 85.0, 56.0, true, "just above 3 medians");
  /* The flag describes the last call only. */
  expect(&c, 2, 22, norm, 1.0, 56.0, false, "the next ordinary distance clears the flag");
  /* Honest spread: partner 1 back at 20, a new partner at 70 ({20, ..., 32,
   * 70}: median 26 or 28) is under 3 medians either way. */
  feed(&c, 1, 20, norm);
  double s = clip_scale(&c, pid(8), 70, norm);
  cr_assert(!c.last_outlier, "70 flagged with tau %g", c.last_tau);
  cr_assert(c.last_tau >= 52.0 && c.last_tau <= 56.0, "tau %g outside [52, 56]", c.last_tau);
  cr_assert(s >= 52.0 / 70 - 1e-12 && s <= 56.0 / 70 + 1e-12, "scale %g", s);
}

Test(clip, partners_not_met_within_200_exchanges_stop_counting) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000; /* cap 100 while fewer than 3 partners count */
  /* Exchanges 1 to 3: partners 1, 2, 3 at 20, 22, 24. Exchanges 4 to 203:
   * partners 4 and 5 in turn, at 60 and 62 (4 on even exchanges). */
  feed(&c, 1, 20, norm);
  feed(&c, 2, 22, norm);
  feed(&c, 3, 24, norm);
  for (int x = 4; x < 200; x++) feed(&c, x % 2 ? 5 : 4, x % 2 ? 62 : 60, norm);
  /* Exchange 200: partner 1 was met 199 exchanges ago and still counts:
   * {20, 22, 24, 60, 62}, median 24, τ 48. */
  expect(&c, 4, 60, norm, 0.8, 48.0, false, "exchange 200: all five count");
  /* Exchange 201: partner 1 is 200 exchanges old and drops out:
   * {22, 24, 60, 62}, median 24 or 60. */
  feed(&c, 5, 62, norm);
  cr_assert(c.last_tau >= 48.0 && c.last_tau <= 120.0, "exchange 201: tau %g outside [48, 120]", c.last_tau);
  /* Exchange 202: partner 2 drops out: {24, 60, 62}, median 60, τ 120. */
  expect(&c, 4, 60, norm, 1.0, 120.0, false, "exchange 202: partners 1 and 2 gone");
  /* Exchange 203: partner 3 drops out of the window; two partners are
   * recent, so the most recently met of the others (3, at 24) fills the
   * count up to three: {24, 60, 62}, median 60, τ 120, no warm-up cap. */
  expect(&c, 5, 62, norm, 1.0, 120.0, false, "exchange 203: two recent partners and partner 3");
  /* Exchange 204: partner 1 met again is recent again: {20, 60, 62}, τ 120. */
  expect(&c, 1, 20, norm, 1.0, 120.0, false, "exchange 204: partner 1 back");
}

Test(clip, one_partner_exchanging_hundreds_of_times_cannot_age_the_others_out) {
  /* Partners 1 to 3 at 30, 32, 34; then partner 4 (an attacker, or the last
   * partner left) at 500, 1000 times in a row. The other three stay in the
   * median however old: {30, 32, 34, 500} at first and {32, 34, 500} once
   * partner 1 is 200 exchanges old, median 34 either way, τ 68; 500 is an
   * outlier every time, never the warm-up's unflagged pull of up to 200. */
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 2000; /* floor 20, warm-up cap 200 */
  feed(&c, 1, 30, norm);
  feed(&c, 2, 32, norm);
  feed(&c, 3, 34, norm);
  for (int x = 0; x < 1000; x++) {
    double s = clip_scale(&c, pid(4), 500, norm);
    cr_assert(c.last_outlier && close_to(c.last_tau, 68.0) && close_to(s, 68.0 / 500),
              "exchange %d with partner 4: outlier %d, tau %g, scale %g", x + 1, c.last_outlier, c.last_tau, s);
  }
  /* Partner 1 met again counts at its new distance; the most recent of the
   * others, partner 3, fills up: {26, 34, 500}, median 34. */
  expect(&c, 1, 26, norm, 1.0, 68.0, false, "partner 1 again");
}

Test(clip, new_partners_replace_old_ones_when_64_are_remembered) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000;
  /* 64 partners at 20, then 33 new ones at 40: if the new ones were
   * dropped, τ would stay 2·20; replacing, 31 at 20 and 33 at 40 are left,
   * both middle values are 40, τ 80. */
  for (int k = 0; k < 64; k++) feed(&c, k, 20, norm);
  cr_assert_eq(c.n, 64);
  expect(&c, 0, 20, norm, 1.0, 40.0, false, "64 partners at 20");
  for (int k = 64; k < 96; k++) feed(&c, k, 40, norm);
  expect(&c, 96, 40, norm, 1.0, 80.0, false, "33 new partners at 40");
  cr_assert_eq(c.n, 64, "%d partners remembered, want at most 64", c.n);
}

Test(clip, the_partner_replaced_is_the_least_recently_met) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000;
  /* Partners 0..63 met at exchanges 1..64 at 20; partners 0..32 met again
   * at 60 (exchanges 65..97), so 33..63 are now the least recent. Ten new
   * partners at 40 (exchanges 98..107) replace 33..42:
   *   {60 × 33 (0..32), 20 × 21 (43..63), 40 × 10}: sorted, positions 31
   *   and 32 are 60, τ 120.
   * Replacing by first insertion instead (partners 0..9) would leave
   *   {60 × 23, 20 × 31, 40 × 10}: both middle values 40, τ 80. */
  for (int k = 0; k < 64; k++) feed(&c, k, 20, norm);
  for (int k = 0; k <= 32; k++) feed(&c, k, 60, norm);
  for (int k = 64; k < 73; k++) feed(&c, k, 40, norm);
  expect(&c, 73, 40, norm, 1.0, 120.0, false, "tenth new partner");
  /* Who is remembered: 0..32, 43..73; not 33..42. */
  bool present[74] = {false};
  for (int i = 0; i < c.n; i++) {
    int k = c.p[i].id[0] | c.p[i].id[1] << 8;
    cr_assert(k < 74, "a partner %d that never exchanged is remembered", k);
    present[k] = true;
  }
  for (int k = 0; k < 74; k++) {
    bool want = k <= 32 || k >= 43;
    cr_assert_eq(present[k], want, "partner %d %s, want %s", k, present[k] ? "remembered" : "forgotten",
                 want ? "remembered" : "forgotten (least recently met)");
  }
}

Test(clip, identities_are_compared_in_full) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000;
  /* Two partners differing only in the last byte of the identity are two
   * partners: with a third at 300 the warm-up ends, {20, 40, 300}, median
   * 40, τ 80, and 300 > 120 is an outlier. Merged into one, only two
   * partners would count: still warming up, no outlier. */
  uint8_t a[CLIP_ID_BYTES], b[CLIP_ID_BYTES];
  memset(a, 7, sizeof a);
  memcpy(b, a, sizeof b);
  b[CLIP_ID_BYTES - 1] ^= 1;
  (void)clip_scale(&c, a, 20, norm);
  (void)clip_scale(&c, b, 40, norm);
  cr_assert_eq(c.n, 2, "identities differing in their last byte merged (%d partners)", c.n);
  expect(&c, 1, 300, norm, 80.0 / 300.0, 80.0, true, "{20, 40, 300}: median 40, 300 > 120");
}

/* ---- bad input ------------------------------------------------------------------- */

Test(clip, nan_and_inf_distances_neither_crash_nor_poison_tau) {
  struct clip_state c;
  clip_init(&c, 0);
  const double norm = 1000;
  feed(&c, 1, 20, norm);
  feed(&c, 2, 30, norm);
  expect(&c, 3, 40, norm, 1.0, 60.0, false, "{20, 30, 40}");
  /* An existing partner and a new one send NaN, +Inf: τ stays 60, the
   * scale is 0 and the distance an outlier (nothing of it is applied), and
   * nothing is recorded. */
  expect(&c, 1, NAN, norm, 0.0, 60.0, true, "NaN from partner 1");
  expect(&c, 9, NAN, norm, 0.0, 60.0, true, "NaN from a new partner");
  expect(&c, 2, INFINITY, norm, 0.0, 60.0, true, "+Inf from partner 2");
  expect(&c, 10, INFINITY, norm, 0.0, 60.0, true, "+Inf from a new partner");
  cr_assert_eq(c.n, 3, "%d partners after NaN and Inf, want 3 (none recorded)", c.n);
  /* The earlier distances still decide: partner 1 at 20 (not NaN) and 2 at
   * 30 (not Inf): {20, 30, 40}, τ 60. Had partner 2's Inf been recorded,
   * {20, Inf, 40}: median 40, τ 80. */
  expect(&c, 3, 40, norm, 1.0, 60.0, false, "after NaN and Inf");
  /* During the warm-up, with no partner yet: no crash, τ finite. */
  clip_init(&c, 0);
  expect(&c, 1, NAN, norm, 0.0, 20.0, true, "first distance NaN: tau at the floor 2·10");
  expect(&c, 2, INFINITY, norm, 0.0, 20.0, true, "then +Inf: nothing applied, an outlier even in the warm-up");
  cr_assert_eq(c.n, 0);
}
