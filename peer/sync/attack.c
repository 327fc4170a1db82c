/* Testing only: poisoned snapshots (see attack.h). */
#include "peer/sync/attack.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "gossip/gossip.h"

static const char *const NAMES[] = {"none", "nan", "inf", "scale", "signflip", "replay", "short", "flood"};

int attack_parse(const char *s, enum attack_kind *out, struct rumor_err *e) {
  for (size_t i = 0; i < sizeof NAMES / sizeof NAMES[0]; i++)
    if (strcmp(s, NAMES[i]) == 0) {
      *out = (enum attack_kind)i;
      return 0;
    }
  return rumor_err_set(e, RUMOR_EFORMAT,
                       "--attack must be one of none, nan, inf, scale, signflip, replay, short, flood (not '%s')", s);
}

uint32_t attack_gossip_bits(enum attack_kind k) {
  if (k == ATTACK_SHORT) return GOSSIP_TEST_ATTACK_SHORT;
  if (k == ATTACK_FLOOD) return GOSSIP_TEST_ATTACK_FLOOD;
  return 0;
}

void attack_init(struct attack *a, enum attack_kind k) {
  memset(a, 0, sizeof *a);
  a->kind = k;
}

void attack_snapshot(struct attack *a, float *p, int64_t n, int64_t *step) {
  a->snapshots++;
  switch (a->kind) {
  case ATTACK_NAN:
  case ATTACK_INF:
    for (int64_t i = 0; i < n; i += n / 7 + 1) p[i] = a->kind == ATTACK_NAN ? NAN : INFINITY;
    return;
  case ATTACK_SCALE:
    for (int64_t i = 0; i < n; i++) p[i] *= -1000.0f;
    return;
  case ATTACK_SIGNFLIP:
    for (int64_t i = 0; i < n; i++) p[i] = -p[i];
    return;
  case ATTACK_REPLAY:
    if (!a->recorded) {
      if (*step == 0) return; /* record a round of training, not the state everyone starts from */
      a->recorded = xmalloc((size_t)n * sizeof(float));
      memcpy(a->recorded, p, (size_t)n * sizeof(float));
      a->recorded_step = *step;
      a->replay_from = a->snapshots + ATTACK_REPLAY_AFTER;
    } else if (a->snapshots > a->replay_from) {
      if (a->snapshots == a->replay_from + 1)
        log_warn("TESTING ONLY: replaying the snapshot of step %lld from now on", (long long)a->recorded_step);
      memcpy(p, a->recorded, (size_t)n * sizeof(float));
      *step = a->recorded_step;
    }
    return;
  default: return;
  }
}

void attack_free(struct attack *a) {
  free(a->recorded);
  memset(a, 0, sizeof *a);
}
