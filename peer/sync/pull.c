/* The one policy for a state pulled from another member (sync.h): every
 * value finite, and a whole replica's loss on the check rows at most
 * sync_pull_max_loss of the state we would keep. */
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

#include "peer/sync/sync_impl.h"

int64_t sync_check_targets(int64_t nparams) {
  int64_t n = nparams > 0 ? SYNC_CHECK_MACS / nparams : SYNC_CHECK_TARGETS;
  return n < 1 ? 1 : n > SYNC_CHECK_TARGETS ? SYNC_CHECK_TARGETS : n;
}

double sync_pull_max_loss(double own_loss) {
  return fmax(SYNC_PULL_MAX_LOSS_RATIO * own_loss, own_loss + SYNC_PULL_LOSS_SLACK);
}

void sync_own_keep(struct sync_own_state *own, const struct trainer *t) {
  own->loss = own->pulled_loss = NAN;
  own->rows = 0;
  own->check_loss = !trainer_holds_part(t); /* a part has no loss of its own to compare: finiteness only */
}

bool sync_pull_take(struct trainer *t, struct sync_own_state *own, float *pulled, char *why, size_t n) {
  int64_t S = trainer_state_floats(t);
  for (int64_t i = 0; i < S; i++)
    if (!isfinite(pulled[i])) {
      snprintf(why, n, "value %lld of %lld is not finite", (long long)i, (long long)S);
      return false;
    }
  if (!own->check_loss) {
    trainer_load_state(t, pulled);
    return true;
  }
  int64_t rows, targets = sync_check_targets(trainer_shard_floats(t));
  if (isnan(own->loss)) /* once: a refused state and the next are compared with the same */
    own->loss = trainer_check_loss(t, targets, &rows);
  /* Swapped, not copied: our state waits in `pulled` while the trainer
   * holds the pulled one, and comes back the same way when refused. */
  trainer_swap_state(t, pulled);
  double loss = trainer_check_loss(t, targets, &rows);
  own->pulled_loss = loss;
  own->rows = rows;
  double most = sync_pull_max_loss(own->loss);
  if (!isfinite(own->loss) || loss <= most) return true;
  snprintf(why, n, "its loss %.4g on %lld training %s is above %.4f, the most we take beside ours (%.4f)", loss,
           (long long)rows, trainer_row_noun(t), most, own->loss);
  trainer_swap_state(t, pulled);
  return false;
}
