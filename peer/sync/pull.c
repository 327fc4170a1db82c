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

void sync_own_keep(struct sync_own_state *own, struct trainer *t) {
  own->loss = own->pulled_loss = NAN;
  own->rows = 0;
  own->state = NULL;
  if (trainer_holds_part(t)) return; /* no loss of its own to compare: finiteness only */
  own->state = malloc((size_t)trainer_state_floats(t) * sizeof(float));
  if (!own->state)
    log_warn("no memory to keep our own state while pulling one: a pulled state is checked for finite values only");
  else
    trainer_copy_state(t, own->state);
}

void sync_own_free(struct sync_own_state *own) {
  free(own->state);
  own->state = NULL;
}

bool sync_pull_take(struct trainer *t, struct sync_own_state *own, const float *pulled, char *why, size_t n) {
  int64_t S = trainer_state_floats(t);
  for (int64_t i = 0; i < S; i++)
    if (!isfinite(pulled[i])) {
      snprintf(why, n, "value %lld of %lld is not finite", (long long)i, (long long)S);
      return false;
    }
  if (!own->state || trainer_holds_part(t)) {
    trainer_load_state(t, pulled);
    return true;
  }
  int64_t rows, targets = sync_check_targets(trainer_shard_floats(t));
  if (isnan(own->loss)) { /* once: a refused state and the next are compared with the same */
    trainer_load_state(t, own->state);
    own->loss = trainer_check_loss(t, targets, &rows);
  }
  trainer_load_state(t, pulled);
  double loss = trainer_check_loss(t, targets, &rows);
  own->pulled_loss = loss;
  own->rows = rows;
  double most = sync_pull_max_loss(own->loss);
  if (!isfinite(own->loss) || loss <= most) return true;
  snprintf(why, n, "its loss %.4g on %lld training %s is above %.4f, the most we take beside ours (%.4f)", loss,
           (long long)rows, trainer_row_noun(t), most, own->loss);
  trainer_load_state(t, own->state);
  return false;
}
