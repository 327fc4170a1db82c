/*
 * optim — optimisers over flat parameter buffers, and the learning-rate
 * schedule.
 *
 * The optimiser's state is ONE flat buffer on the model's backend: (P) for
 * SGD's momentum, (2P) for AdamW's first and second moments (m then v), so it
 * checkpoints and transfers as one piece.
 */
#ifndef RUMOR_PEER_OPTIM_H
#define RUMOR_PEER_OPTIM_H

#include <stdint.h>

#include "tensor/tensor.h"

enum optim_kind { OPTIM_SGD = 0, OPTIM_ADAMW = 1 };
enum optim_schedule { OPTIM_SCHED_CONSTANT = 0, OPTIM_SCHED_COSINE = 1 };

struct optim_config {
  enum optim_kind kind;
  double lr;           /* peak learning rate */
  double momentum;     /* SGD */
  bool nesterov;       /* SGD */
  double weight_decay; /* L2 for SGD (PyTorch style), decoupled for AdamW */
  double beta1, beta2, eps; /* AdamW */
  enum optim_schedule schedule;
  int64_t warmup_steps; /* linear warm-up from lr/warmup to lr */
};

/* Defaults: SGD, lr 0.05, momentum 0.9, no weight decay, cosine schedule. */
void optim_config_default(struct optim_config *c);
/* Parses "sgd" / "adamw" and "constant" / "cosine". RUMOR_EFORMAT otherwise. */
int optim_kind_parse(const char *s, enum optim_kind *out) RUMOR_MUST_CHECK;
int optim_schedule_parse(const char *s, enum optim_schedule *out) RUMOR_MUST_CHECK;
const char *optim_kind_name(enum optim_kind k);
const char *optim_schedule_name(enum optim_schedule s);

struct optim {
  struct optim_config cfg;
  int64_t nparams;
  struct tensor state; /* (P) or (2P) flat, owner; zero-initialised */
  int64_t step;        /* updates applied so far */
};

int optim_init(struct optim *o, const struct optim_config *cfg, tensor_backend_t be, int64_t nparams,
               struct rumor_err *e) RUMOR_MUST_CHECK;
void optim_free(struct optim *o);
/* Number of state floats per parameter: 1 (SGD) or 2 (AdamW). */
int optim_state_per_param(enum optim_kind k);

/* The learning rate for update number `step` (0-based) of `total_steps`. */
double optim_lr_at(const struct optim_config *c, int64_t step, int64_t total_steps);

/* Applies one update with learning rate `lr` and increments o->step. */
void optim_apply(struct optim *o, struct tensor *params, const struct tensor *grads, double lr);

#endif /* RUMOR_PEER_OPTIM_H */
