/* The result lines subcommands print on stdout: one JSON object each, built
 * from the same pieces so that scripts read the same names everywhere. */
#include <stdio.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

json_t *result_open(void) {
  json_t *o = json_object();
  RUMOR_ASSERT(o);
  return o;
}

void result_training(json_t *o, const struct trainer *t, double secs, int64_t samples_at_start) {
  json_text_set(o, "steps", json_integer(t->st.step));
  json_text_set(o, "epochs", json_integer(t->st.epoch));
  json_text_set(o, "samples_per_s",
                json_text_real(secs > 0 ? (double)(t->st.samples - samples_at_start) / secs : 0.0));
  if (t->cfg.grad_clip > 0) json_text_set(o, "clipped_steps", json_integer(t->clipped_steps));
  json_text_set(o, "peak_rss_bytes", json_integer(trainer_peak_rss_bytes()));
  /* A GPU's buffers at most since training began (trainer_init restarts the count). */
  int64_t dev_peak = t->be ? tensor_backend_peak_bytes(t->be, false) : -1;
  if (dev_peak >= 0) json_text_set(o, "device_peak_bytes", json_integer(dev_peak));
  json_text_set(o, "tf32", json_boolean(t->cfg.tf32));
  if (trainer_is_dp(t)) {
    json_text_set(o, "zero", json_integer(t->zero.dp.zero));
    json_text_set(o, "data_parallel", json_integer(t->zero.size));
  }
  if (trainer_in_group_comm(t)) json_text_set(o, "comm_bytes_per_step", json_text_real(t->comm_step_bytes));
  if (t->model.ep) json_text_set(o, "expert_bytes_per_step", json_text_real(t->ep_step_bytes));
  if (t->moe.experts) { /* a mixture of experts: its last step's figures */
    json_text_set(o, "moe_aux_loss", json_text_real(t->moe.aux_loss));
    json_text_set(o, "moe_z_loss", json_text_real(t->moe.z_loss));
    json_text_set(o, "moe_dropped_fraction", json_text_real(t->moe.dropped_fraction));
    json_t *load = json_array();
    RUMOR_ASSERT(load);
    for (int x = 0; x < t->moe.experts; x++) json_text_push(load, json_text_real(t->moe.load[x]));
    json_text_set(o, "expert_load", load);
  }
  if (!trainer_has_loss(t)) return;
  /* A language model's evaluation is on held-out tokens: its loss per token
   * and how often the likeliest next token is the right one. */
  json_text_set(o, t->data.tokens ? "val_token_accuracy" : "test_accuracy", json_text_real(t->accuracy));
  json_text_set(o, t->data.tokens ? "val_loss" : "test_loss", json_text_real(t->test_loss));
  json_text_set(o, "train_loss", json_text_real(t->loss_avg));
  json_t *losses = json_array();
  RUMOR_ASSERT(losses);
  for (int64_t i = 0; i < t->nepoch_losses; i++) json_text_push(losses, json_text_real(t->epoch_losses[i]));
  json_text_set(o, "train_losses", losses);
}

bool result_final_evaluation(struct trainer *t) {
  struct rumor_err e = {0};
  int rc = trainer_evaluate(t, &e);
  if (rc == RUMOR_ECANCELED && signals_stop_requested()) {
    log_info("signal %d: final %s; no result line", signals_stop_requested(), e.msg);
    return false;
  }
  if (rc) log_warn("final evaluation: %s", e.msg);
  return true;
}

void result_describe_final(const struct trainer *t, char *buf, size_t len) {
  if (t->data.tokens) snprintf(buf, len, "validation loss %.4f, token accuracy %.4f", t->test_loss, t->accuracy);
  else snprintf(buf, len, "test accuracy %.4f, test loss %.4f", t->accuracy, t->test_loss);
}

void result_print(json_t *o) { json_text_print(stdout, o); }
