/* The result lines subcommands print on stdout: one JSON object each, built
 * from the same pieces so that scripts read the same names everywhere. */
#include <stdio.h>

#include "peer/cli/cli_impl.h"

void result_training(struct json_buf *b, const struct trainer *t, double secs, int64_t samples_at_start) {
  json_key(b, "steps");
  json_int(b, t->st.step);
  json_key(b, "epochs");
  json_int(b, t->st.epoch);
  json_key(b, "samples_per_s");
  json_num(b, secs > 0 ? (double)(t->st.samples - samples_at_start) / secs : 0.0);
  if (!trainer_has_loss(t)) return;
  /* A language model's evaluation is on held-out tokens: its loss per token
   * and how often the likeliest next token is the right one. */
  json_key(b, t->data.tokens ? "val_token_accuracy" : "test_accuracy");
  json_num(b, t->accuracy);
  json_key(b, t->data.tokens ? "val_loss" : "test_loss");
  json_num(b, t->test_loss);
  json_key(b, "train_loss");
  json_num(b, t->loss_avg);
  json_key(b, "train_losses");
  json_arr_begin(b);
  for (int64_t i = 0; i < t->nepoch_losses; i++) json_num(b, t->epoch_losses[i]);
  json_arr_end(b);
}

void result_describe_final(const struct trainer *t, char *buf, size_t len) {
  if (t->data.tokens) snprintf(buf, len, "validation loss %.4f, token accuracy %.4f", t->test_loss, t->accuracy);
  else snprintf(buf, len, "test accuracy %.4f, test loss %.4f", t->accuracy, t->test_loss);
}

void result_gossip(struct json_buf *b, const struct gossip_stats *gs, const struct sync *s) {
  const struct {
    const char *key;
    uint64_t v;
  } counts[] = {
      {"exchanges", gs->exchanges_ok},
      {"exchanges_failed", gs->exchanges_failed},
      {"exchanges_rejected", gs->exchanges_rejected},
      {"exchange_requests", gs->exchange_requests},
      {"exchange_refusals", gs->exchange_refusals},
      {"exchange_idle", gs->exchange_idle},
      {"exchanges_clipped", s->clip.clipped},
      {"exchanges_skipped", s->skipped},
      {"exchange_rate_limited", gs->exchange_rate_limited},
      {"conn_rate_limited", gs->conn_rate_limited},
      {"holds", s->holds},
      {"hold_timeouts", s->hold_timeouts},
  };
  for (size_t i = 0; i < sizeof counts / sizeof counts[0]; i++) {
    json_key(b, counts[i].key);
    json_int(b, (int64_t)counts[i].v);
  }
  json_key(b, "longest_local_steps");
  json_int(b, s->longest_local);
  json_key(b, "hold_s");
  json_num(b, s->hold_s);
  json_key(b, "sync");
  json_str(b, s->cfg.allreduce ? "allreduce" : "gossip");
  if (!s->cfg.allreduce) return;
  const struct {
    const char *key;
    uint64_t v;
  } ar[] = {{"allreduce_rounds", s->ar_rounds},     {"allreduce_retries", s->ar_retries},
            {"allreduce_catchups", s->ar_catchups}, {"allreduce_skipped", s->ar_skipped},
            {"allreduce_members", s->ar_members}};
  for (size_t i = 0; i < sizeof ar / sizeof ar[0]; i++) {
    json_key(b, ar[i].key);
    json_int(b, (int64_t)ar[i].v);
  }
  json_key(b, "allreduce_s");
  json_num(b, s->ar_wait_s);
}

void result_print(struct json_buf *b) {
  json_obj_end(b);
  printf("%.*s\n", (int)b->len, b->data);
  fflush(stdout);
  json_buf_free(b);
}
