/* `rumor train`: one peer, no network. */
#include <signal.h>
#include <stdio.h>
#include <string.h>

#include "peer/cli/cli_impl.h"
#include "util/json_text.h"


int cmd_train(int argc, char **argv) {
  struct train_flags f;
  train_flags_default(&f);
  struct arg_spec specs[48];
  size_t n = 0;
  train_flags_specs(&f, FLAGS_TRAIN, specs, &n, 47);
  specs[n] = (struct arg_spec){0};
  int ar = args_parse(specs, argc, argv, "rumor train [options]",
                      "Trains one replica on its own (no network) and prints the final test accuracy\n"
                      "as JSON on stdout. Progress goes to stderr. SIGINT/SIGTERM stop it, also during an\n"
                      "evaluation, with its checkpoint saved (--checkpoint): no result, exit status 130.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  log_set_json(f.log_json);

  struct rumor_err e = {0};
  struct train_config cfg;
  if (train_flags_config(&f, specs, &cfg, &e)) {
    fprintf(stderr, "rumor train: %s\n", e.msg);
    return 2;
  }

  struct tb_train tb = {0};
  if (f.tensorboard && tb_train_open(&tb, f.tensorboard, "train", &e)) {
    fprintf(stderr, "rumor train: %s\n", e.msg);
    return 1;
  }
  struct trainer t;
  if (trainer_init(&t, &cfg, &e)) {
    fprintf(stderr, "rumor train: %s\n", e.msg);
    tb_train_close(&tb);
    return 1;
  }
  tb_train_attach(&tb, &t, NULL);

  int status = 0;
  double t0 = clock_now_s();
  int64_t s0 = t.st.samples;
  while (!trainer_done(&t) && !signals_stop_requested()) {
    if (trainer_step(&t, &e)) {
      fprintf(stderr, "rumor train: %s\n", e.msg);
      status = 1;
      break;
    }
  }
  double secs = clock_now_s() - t0;
  if (signals_stop_requested()) {
    log_warn("interrupted by signal %d at step %lld", signals_stop_requested(), (long long)t.st.step);
    if (cfg.checkpoint && trainer_save(&t, cfg.checkpoint, &e)) fprintf(stderr, "rumor train: %s\n", e.msg);
    status = CLI_EXIT_INTERRUPTED;
  }
  int er = status == 0 ? trainer_evaluate(&t, &e) : 0;
  if (status == 0 && er == RUMOR_ECANCELED && signals_stop_requested()) {
    /* Stopped during the final evaluation: the last step's checkpoint is
     * written already (trainer_step), so nothing is lost; exit as on any
     * interruption, without a result line. */
    log_warn("interrupted at step %lld: final %s", (long long)t.st.step, e.msg);
    status = CLI_EXIT_INTERRUPTED;
  } else if (status == 0) {
    if (er) log_warn("final evaluation: %s", e.msg);
    double acc = t.data.have_eval ? t.accuracy : -1, loss = t.data.have_eval ? t.test_loss : -1;
    if (t.data.have_eval) {
      char final[96];
      result_describe_final(&t, final, sizeof final);
      log_info("final %s after %lld steps", final, (long long)t.st.step);
    }
    json_t *o = result_open();
    t.accuracy = acc;
    t.test_loss = loss;
    result_training(o, &t, secs, s0);
    result_print(o);
  }
  trainer_free(&t);
  tb_train_close(&tb);
  return status;
}
