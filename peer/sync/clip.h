/*
 * clip — clipped gossip averaging (self-centred clipping, He, Karimireddy
 * and Jaggi 2022): instead of x ← x + α·(x_j − x), a peer applies
 *
 *   x ← x + α·clip(x_j − x, τ),   clip(d, τ) = d·min(1, τ/‖d‖),
 *
 * so one exchange moves it by at most α·τ whatever the partner sent. A
 * Byzantine partner (a valid key, poisoned parameters that pass the other
 * checks, such as a sign-flipped model) then shifts an honest replica by a
 * bounded amount per exchange, while honest partners, whose distances are
 * about τ or below, are averaged with as before.
 *
 * τ is fixed (--clip-tau) or adaptive (the default): CLIP_TAU_MEDIANS times
 * the median, over the partners met in the last CLIP_RECENT exchanges, of
 * each one's latest non-zero distance (the median taken as at least
 * CLIP_FLOOR_REL times our norm). Each partner counts once however often it
 * exchanges, so while fewer than half of a peer's partners are Byzantine the
 * median is an honest distance (a median over exchanges would not be: a fast
 * attacker can be most of one peer's exchanges for a while, and then sets τ
 * itself). Distances of 0 (partners equal to us while the cluster
 * assembles) are not recorded: they would pin τ to its floor when training
 * starts. While fewer than CLIP_WARMUP partners are known, τ is also at most
 * CLIP_WARMUP_REL times our own parameter norm, so the first exchanges
 * cannot be hijacked either.
 *
 * Past the warm-up, a distance above CLIP_OUTLIER times the median marks an
 * outlier, which the caller skips: honest partners are mostly under 3
 * medians (about 1 % of honest updates skipped), a sign-flipped model 2.5
 * to 2000, mostly above 3. Clipping alone
 * lets an attacker push a victim by α·τ every time, and once the victim has
 * drifted its own τ grows with it (its partners are all far): a run-away
 * seen in tests as the learning rate decays. Skipping outliers stops that,
 * and cannot lock an honest peer out: one that drifted sees every partner
 * far, so its τ is large and it applies their updates and catches up, while
 * they skip its updates meanwhile. τ at twice the median leaves most honest
 * updates whole (at one median, half were clipped, which slowed peers that
 * had run ahead: accuracy 0.81 to 0.87 in a benign 8-peer run, against
 * 0.86 to 0.875 now and 0.871 to 0.873 without clipping); outliers at 3
 * medians rather than 4 kept honest peers at 0.869 instead of 0.857 with a
 * sign-flipping attacker.
 *
 * Pure bookkeeping on scalars; the caller does the averaging in one op
 * (tensor_lerp with weight α·scale). Training thread.
 */
#ifndef RUMOR_PEER_CLIP_H
#define RUMOR_PEER_CLIP_H

#include <stdbool.h>
#include <stdint.h>

#define CLIP_PARTNERS 64     /* partners remembered (the least recent is replaced) */
#define CLIP_RECENT 200      /* a partner counts while met within this many exchanges */
#define CLIP_WARMUP 3
#define CLIP_WARMUP_REL 0.1
#define CLIP_FLOOR_REL 1e-2  /* the median is taken as at least this times our norm */
#define CLIP_TAU_MEDIANS 2.0 /* adaptive τ: this many times the median distance */
#define CLIP_OUTLIER 3.0     /* distance > CLIP_OUTLIER·median (adaptive τ, after warm-up): skipped */
#define CLIP_ID_BYTES 32

struct clip_state {
  double tau_fixed; /* > 0: fixed τ; 0: adaptive */
  struct clip_partner {
    uint8_t id[CLIP_ID_BYTES];
    double dist;   /* its latest distance */
    uint64_t seen; /* exchange number when it was met last */
  } p[CLIP_PARTNERS];
  int n;
  double last_tau;  /* the τ of the last call */
  bool last_outlier; /* the last distance was an outlier (the caller skips it) */
  uint64_t seen, clipped;
};

void clip_init(struct clip_state *c, double tau_fixed);
/* Records the distance ‖x_j − x‖ to partner `id` (CLIP_ID_BYTES) and returns
 * the factor s = min(1, τ/dist) ∈ [0, 1] by which to scale the averaging
 * weight. `norm` is ‖x‖ (for the warm-up bound). */
double clip_scale(struct clip_state *c, const uint8_t *id, double dist, double norm);

#endif /* RUMOR_PEER_CLIP_H */
