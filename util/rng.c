/* xoshiro256** (Blackman and Vigna), seeded with splitmix64. */
#include "util.h"

#include <math.h>

static uint64_t splitmix64(uint64_t *x) {
  uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return z ^ (z >> 31);
}

void rng_seed(struct rng *r, uint64_t seed, uint64_t stream) {
  uint64_t x = seed ^ (stream * 0xd1342543de82ef95ull + 0x2545f4914f6cdd1dull);
  for (int i = 0; i < 4; i++) r->s[i] = splitmix64(&x);
}

static inline uint64_t rotl(uint64_t x, int k) { return (x << k) | (x >> (64 - k)); }

uint64_t rng_next_u64(struct rng *r) {
  uint64_t *s = r->s;
  uint64_t result = rotl(s[1] * 5, 7) * 9;
  uint64_t t = s[1] << 17;
  s[2] ^= s[0];
  s[3] ^= s[1];
  s[1] ^= s[2];
  s[0] ^= s[3];
  s[2] ^= t;
  s[3] = rotl(s[3], 45);
  return result;
}

uint64_t rng_below(struct rng *r, uint64_t bound) {
  RUMOR_ASSERT(bound > 0);
  uint64_t threshold = -bound % bound; /* 2^64 mod bound */
  for (;;) {
    uint64_t x = rng_next_u64(r);
    if (x >= threshold) return x % bound;
  }
}

float rng_uniform(struct rng *r) { return (float)(rng_next_u64(r) >> 40) * (1.0f / 16777216.0f); }

float rng_normal(struct rng *r) {
  double u1 = ((double)(rng_next_u64(r) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
  double u2 = (double)(rng_next_u64(r) >> 11) * (1.0 / 9007199254740992.0);
  return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}
