/* Repeated parameters from one partner (see replay.h). */
#include "peer/replay.h"

#include <string.h>

bool replay_check(struct replay_table *t, const uint8_t *id, double fingerprint) {
  t->seen++;
  int slot = -1, oldest = 0;
  for (int i = 0; i < t->n && slot < 0; i++) {
    if (memcmp(t->e[i].id, id, REPLAY_ID_BYTES) == 0) slot = i;
    else if (t->e[i].seen < t->e[oldest].seen) oldest = i;
  }
  bool repeat = slot >= 0 && t->e[slot].fingerprint == fingerprint;
  if (slot < 0) slot = t->n < REPLAY_PARTNERS ? t->n++ : oldest;
  memcpy(t->e[slot].id, id, REPLAY_ID_BYTES);
  t->e[slot].fingerprint = fingerprint;
  t->e[slot].seen = t->seen;
  return repeat;
}
