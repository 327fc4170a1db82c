/*
 * model — a multi-layer perceptron with hand-written backpropagation.
 *
 * Parameters and gradients are each ONE flat buffer on the model's backend;
 * every layer's weight and bias are views into it, laid out layer by layer as
 * [W0 (out0, in0), b0 (out0), W1 (out1, in1), b1 (out1), ...]. Weights are
 * stored [out, in] like torch.nn.Linear, so a checkpoint maps one-to-one onto
 * PyTorch's state_dict. Averaging, checkpointing, sketching and sending then
 * act on one buffer.
 *
 * A spec string names the architecture: "mlp:784-512-256-10" (ReLU between
 * layers) or "mlp:784-512-256-10:gelu".
 *
 * Threads: a model belongs to the thread that drives its backend.
 */
#ifndef RUMOR_PEER_MODEL_H
#define RUMOR_PEER_MODEL_H

#include <stdint.h>

#include "tensor/tensor.h"

#define MODEL_MAX_LAYERS 16
#define MODEL_MAX_WIDTH (1 << 20)
#define MODEL_SPEC_MAX 256

enum model_act { MODEL_ACT_RELU = 0, MODEL_ACT_GELU = 1 };

struct model_spec {
  int nlayers;                             /* number of linear layers, >= 1 */
  int64_t widths[MODEL_MAX_LAYERS + 1];    /* widths[0] inputs ... widths[nlayers] outputs */
  enum model_act act;                      /* between layers, not after the last */
};

/* Parses a spec string. Returns 0 or RUMOR_EFORMAT with a message that quotes
 * the spec and says what is wrong. */
int model_spec_parse(const char *s, struct model_spec *out, struct rumor_err *e) RUMOR_MUST_CHECK;
/* Writes the canonical spec string (parse(format(s)) == s). */
void model_spec_format(const struct model_spec *s, char *buf, size_t len);
int64_t model_spec_param_count(const struct model_spec *s);
/* Offset (in elements) of layer l's weight within the flat buffer; its bias
 * follows the weight. */
int64_t model_spec_layer_offset(const struct model_spec *s, int layer);
/* Multiply-adds of one sample's forward pass through layers [l0, l1). */
int64_t model_spec_flops(const struct model_spec *s, int l0, int l1);

struct model_layer {
  struct tensor w, b;   /* views into params: w (out, in), b (out) */
  struct tensor dw, db; /* the same views into grads */
};

struct model {
  struct model_spec spec;
  tensor_backend_t be;
  /* The layers this model holds: [l0, l1), all of them (0, nlayers) unless
   * built by model_init_layers for one stage of a pipeline. params and grads
   * hold exactly these layers, starting at param_base elements into the
   * whole model's layout; layers[] and acts[] outside the range are empty. */
  int l0, l1;
  int64_t param_base;
  int64_t nparams;
  struct tensor params; /* (P) flat, owner */
  struct tensor grads;  /* (P) flat, owner */
  struct model_layer layers[MODEL_MAX_LAYERS];

  /* Workspace for batches of up to max_batch rows. acts[0] is the input
   * (B, widths[0]) that the caller fills; acts[l+1] is layer l's output after
   * its activation (the logits for the last layer). pre[l] keeps layer l's
   * pre-activation when the activation needs it for backward (GELU). */
  int64_t max_batch;
  struct tensor acts[MODEL_MAX_LAYERS + 1];
  struct tensor pre[MODEL_MAX_LAYERS];
  struct tensor dbuf[2]; /* gradient ping-pong, (max_batch, max width) each */
  struct tensor labels;  /* (max_batch) I32, filled by the caller */
  struct tensor losses;  /* (max_batch) per-sample losses of the last step */
};

/* Allocates parameters, gradients and workspace on `be`. Parameters are
 * uninitialised until model_init_params or a load. Returns 0 or a negative
 * code with a message (e.g. the model does not fit on the device). */
int model_init(struct model *m, const struct model_spec *spec, tensor_backend_t be, int64_t max_batch,
               struct rumor_err *e) RUMOR_MUST_CHECK;
/* The same for layers [l0, l1) of `spec` only (0 <= l0 < l1 <= nlayers): one
 * stage of a pipeline. Parameters, gradients and workspace (acts[l0..l1],
 * pre[l0..l1)) exist for those layers alone; each layer keeps its place and
 * role in the whole model (a hidden layer keeps its activation even when it
 * is the stage's last). */
int model_init_layers(struct model *m, const struct model_spec *spec, int l0, int l1, tensor_backend_t be,
                      int64_t max_batch, struct rumor_err *e) RUMOR_MUST_CHECK;
void model_free(struct model *m);

/* PyTorch's default nn.Linear initialisation: W and b uniform in
 * ±1/sqrt(fan_in), drawn from (seed) on the host, identical on every backend.
 * Each layer has its own stream, so a stage's layers get exactly the values
 * the whole model's would. */
void model_init_params(struct model *m, uint64_t seed);

/* Shapes of acts[l] for a batch of B rows. */
struct tensor model_act_view(const struct model *m, int l, int64_t batch);

/* Forward pass through layers [l0, l1) on acts[l0] (B rows), leaving acts[l1]. */
void model_forward_range(struct model *m, int l0, int l1, int64_t batch);
/* Backward pass through layers [l0, l1) after model_forward_range over the
 * same rows: `dout` holds dL/d acts[l1] (B rows; it is overwritten). Writes
 * the layers' gradients into grads (overwriting them, or adding to them when
 * `accumulate`) and, when `din` is not NULL, dL/d acts[l0] into `din`
 * (B × widths[l0]; a buffer other than dout and the model's own dbuf). */
void model_backward_range(struct model *m, int l0, int l1, int64_t batch, struct tensor *dout,
                          struct tensor *din, bool accumulate);

/* Loss and its gradient at the logits acts[nlayers] for labels (B): fills
 * losses and writes grad_scale·dL/dlogits into `dlogits` (B × outputs). */
void model_loss(struct model *m, int64_t batch, struct tensor *dlogits, float grad_scale);

/* One training step's math on the batch in acts[0] / labels: forward, mean
 * cross-entropy loss, backward into grads. Only enqueues work. */
void model_forward_backward(struct model *m, int64_t batch);
/* The mean of the last step's per-sample losses (waits for them). */
float model_mean_loss(const struct model *m, int64_t batch);

/* Forward only on acts[0] / labels (labels also given on the host as
 * `labels_host`), then adds to *correct the rows whose argmax logit equals
 * the label and to *loss_sum their summed loss. */
void model_evaluate_batch(struct model *m, int64_t batch, const int32_t *labels_host, int64_t *correct,
                          double *loss_sum);
/* The scoring half of model_evaluate_batch, on logits already in
 * acts[nlayers] (after a forward pass that ended at the last layer). */
void model_score_batch(struct model *m, int64_t batch, const int32_t *labels_host, int64_t *correct,
                       double *loss_sum);

#endif /* RUMOR_PEER_MODEL_H */
