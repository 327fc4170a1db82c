/* Language models through the command line: `rumor train` on text with a
 * directory checkpoint, the logits of that checkpoint against a plain
 * PyTorch GPT-2 (tests/scripts/gpt_torch.py on Debian's PyTorch), `rumor
 * sample`, --init-from a directory laid out as GPT-2's files on the Hugging
 * Face hub, bad input named with a clean exit, and SIGINT/SIGTERM ending
 * `rumor sample`, `rumor eval` and train's final evaluation promptly. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "../support/proc.h"
#include "../support/cli.h"
#include "peer/model/model.h"
#include "peer/train/train.h"

#define MODEL "gpt:L2-H2-C32-T24-V256"
#define PYTHON "/usr/bin/python3"

static char dir[64];

static void setup(void) { proc_scratch_make(dir, sizeof dir, "gptcli"); }
static void teardown(void) { proc_scratch_remove(dir); }
/* rumor(&out, &err, secs, args..., NULL): the binary run in this suite's scratch directory. */
#define rumor(out, err, secs, ...) cli_rumor(dir, out, err, secs, __VA_ARGS__)

TestSuite(gptcli, .init = setup, .fini = teardown, .timeout = 300);

static int run_argv(char **out, char **err, double secs, char **argv) { return proc_run(argv, secs, dir, out, err); }

/* Writes `count` words from a fixed generator seeded with `seed` to
 * dir/name into path[128]: enough structure to learn a little in a few
 * steps, no package needed. Returns path. */
static const char *write_words(char *path, const char *name, int count, uint64_t seed) {
  snprintf(path, 128, "%s/%s", dir, name);
  FILE *f = fopen(path, "w");
  cr_assert_not_null(f);
  static const char *words[] = {"the ", "lord ", "said ", "unto ", "moses ", "and ", "it ", "was ", "so. ", "\n"};
  uint64_t x = seed;
  for (int i = 0; i < count; i++) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;
    fputs(words[x % 10], f);
  }
  fclose(f);
  return path;
}

/* 12000 words (about 50 kB). */
static const char *text_path(void) {
  static char path[128];
  return write_words(path, "text.txt", 12000, 2463534242ull);
}

static double trained_val_loss; /* of the last train_dir */

/* Trains the small model for `steps` steps into the directory checkpoint
 * dir/<name>/ and returns its path. */
static const char *train_dir(const char *name, const char *steps) {
  static char ck[160];
  snprintf(ck, sizeof ck, "%s/%s/", dir, name);
  char *out, *err;
  int st = rumor(&out, &err, 200, "train", "--model", MODEL, "--data", text_path(), "--optimizer", "adamw", "--lr",
                 "3e-3", "--batch", "8", "--max-steps", steps, "--threads", "1", "--log-every", "0", "--eval-batches",
                 "2", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "training failed: %s", err);
  cr_assert(strstr(out, "\"val_loss\""), "no val_loss in the result line: %s", out);
  trained_val_loss = cli_json_number(out, "val_loss");
  free(out), free(err);
  return ck;
}

static bool have_torch(void) {
  char *argv[] = {PYTHON, "-c", "import torch, numpy", NULL};
  char *out, *err;
  int st = run_argv(&out, &err, 60, argv);
  free(out), free(err);
  return proc_exited_with(st, 0);
}

#define SKIP_WITHOUT_TORCH()                                                                                 \
  do {                                                                                                       \
    if (!have_torch()) cr_skip_test("Debian's PyTorch is not installed (" PYTHON " cannot import torch); " \
                                    "deploy/install-deps.sh installs python3-torch");                      \
  } while (0)

/* The logits rumor computes for `toks` (one sequence) from checkpoint dir `ck`. */
static float *rumor_logits(const char *ck, const int32_t *toks, int64_t n) {
  struct model_spec spec;
  float *params;
  struct rumor_err e;
  cr_assert_eq(hf_import(ck, &spec, &params, &e), 0, "%s", e.msg);
  tensor_backend_t be;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0, "%s", e.msg);
  struct model m;
  cr_assert_eq(model_init_full(&m, &spec, be, 1, &e), 0, "%s", e.msg);
  tensor_copy_from_host(&m.params, 0, params, (size_t)m.nparams * sizeof(float));
  cr_assert(model_set_positions(&m, n));
  tensor_copy_from_host(model_act(&m, 0), 0, toks, (size_t)n * sizeof(int32_t));
  model_forward(&m, 0, m.table.nunits, 1);
  float *logits = xmalloc((size_t)(n * 256) * sizeof(float));
  tensor_copy_to_host(model_act(&m, m.table.nunits), 0, logits, (size_t)(n * 256) * sizeof(float));
  model_free(&m);
  tensor_backend_close(be);
  free(params);
  return logits;
}

static float *torch_logits(const char *ck, const int32_t *toks, int64_t n) {
  char tpath[128], lpath[128], script[512];
  snprintf(tpath, sizeof tpath, "%s/tokens.bin", dir);
  snprintf(lpath, sizeof lpath, "%s/logits.bin", dir);
  snprintf(script, sizeof script, "%s/tests/scripts/gpt_torch.py", RUMOR_SOURCE_DIR);
  FILE *f = fopen(tpath, "wb");
  cr_assert(f && fwrite(toks, sizeof(int32_t), (size_t)n, f) == (size_t)n);
  fclose(f);
  char *argv[] = {PYTHON, script, "logits", (char *)ck, tpath, lpath, NULL};
  char *out, *err;
  int st = run_argv(&out, &err, 120, argv);
  cr_assert(proc_exited_with(st, 0), "the PyTorch reference failed: %s", err);
  free(out), free(err);
  size_t len;
  float *l = (float *)proc_slurp_n(lpath, &len);
  cr_assert_eq(len, (size_t)(n * 256) * sizeof(float), "the reference wrote %zu bytes", len);
  return l;
}

Test(gptcli, a_trained_checkpoints_logits_match_a_plain_pytorch_gpt2) {
  SKIP_WITHOUT_TORCH();
  const char *ck = train_dir("a", "30");
  const char *prompt = "the lord said unto moses and"; /* 28 bytes: longer than T=24, so cut to the context */
  int32_t toks[24];
  for (int i = 0; i < 24; i++) toks[i] = (unsigned char)prompt[i];
  float *ours = rumor_logits(ck, toks, 24), *ref = torch_logits(ck, toks, 24);
  /* Float32 both, different summation orders (oneDNN vs PyTorch's BLAS):
   * |ours − ref| ≤ 1e-4 + 1e-4·|ref| on every logit. */
  double worst = 0;
  for (int i = 0; i < 24 * 256; i++) {
    cr_assert(isfinite(ours[i]), "logit %d is %f", i, ours[i]);
    double err = fabs((double)ours[i] - ref[i]) / (1e-4 + 1e-4 * fabs(ref[i]));
    if (err > worst) worst = err;
    cr_assert(err <= 1.0, "logit %d (position %d, token %d): rumor %.7g, PyTorch %.7g", i, i / 256, i % 256,
              ours[i], ref[i]);
  }
  fprintf(stderr, "logits vs PyTorch: worst %.3g of the tolerance 1e-4 + 1e-4·|x|\n", worst);
  free(ours);
  free(ref);
  /* `rumor eval` on the same validation windows (2 batches of 8) reports
   * the training run's final validation loss. */
  char *out, *err;
  int st = rumor(&out, &err, 60, "eval", "--checkpoint", ck, "--data", text_path(), "--eval-batches", "2", NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  double v = cli_json_number(out, "val_loss");
  cr_assert(fabs(v - trained_val_loss) < 1e-5, "eval's val_loss %.7g, the run's %.7g: %s", v, trained_val_loss, out);
  free(out), free(err);
}

Test(gptcli, sample_greedy_continues_with_the_argmax_tokens) {
  SKIP_WITHOUT_TORCH();
  const char *ck = train_dir("b", "40");
  char *out, *err;
  int st = rumor(&out, &err, 60, "sample", "--checkpoint", ck, "--prompt", "the lord ", "--tokens", "12",
                 "--temperature", "0", NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert(strncmp(out, "the lord ", 9) == 0, "the prompt is not printed first: '%s'", out);
  cr_assert_geq(strlen(out), 9 + 12, "'%s'", out);
  /* Each generated byte is PyTorch's argmax for the text before it. */
  int32_t toks[24];
  for (int k = 0; k < 12; k++) {
    int n = 9 + k;
    for (int i = 0; i < n; i++) toks[i] = (unsigned char)out[i];
    float *ref = torch_logits(ck, toks, n);
    int best = 0;
    for (int c = 1; c < 256; c++)
      if (ref[(n - 1) * 256 + c] > ref[(n - 1) * 256 + best]) best = c;
    cr_assert_eq((unsigned char)out[n], best, "generated byte %d is %d; PyTorch's argmax is %d ('%s')", k,
                 (unsigned char)out[n], best, out);
    free(ref);
  }
  free(out), free(err);
  /* Seeded draws repeat; another seed draws differently somewhere. */
  char *a, *b, *c;
  st = rumor(&a, &err, 60, "sample", "--checkpoint", ck, "--prompt", "the ", "--tokens", "40", "--seed", "5",
             "--top-k", "20", NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(err);
  st = rumor(&b, &err, 60, "sample", "--checkpoint", ck, "--prompt", "the ", "--tokens", "40", "--seed", "5",
             "--top-k", "20", NULL);
  free(err);
  st = rumor(&c, &err, 60, "sample", "--checkpoint", ck, "--prompt", "the ", "--tokens", "40", "--seed", "6",
             "--top-k", "20", NULL);
  free(err);
  cr_assert_str_eq(a, b, "the same seed drew differently");
  cr_assert_str_neq(a, c, "seeds 5 and 6 drew the same 40 bytes");
  free(a), free(b), free(c);
}

/* gpt_torch.py hub-style: checkpoint directory ck rewritten as GPT-2's hub
 * files in `hub`, with `extra` options (NULL-terminated; may be NULL). */
static void make_hub(const char *ck, const char *hub, char *const *extra) {
  char script[512];
  snprintf(script, sizeof script, "%s/tests/scripts/gpt_torch.py", RUMOR_SOURCE_DIR);
  char *argv[16] = {PYTHON, script, "hub-style", (char *)ck, (char *)hub};
  int n = 5;
  for (int k = 0; extra && extra[k] && n < 15; k++) argv[n++] = extra[k];
  argv[n] = NULL;
  char *out, *err;
  int st = run_argv(&out, &err, 60, argv);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
}

Test(gptcli, init_from_a_hub_style_directory_starts_from_its_weights) {
  SKIP_WITHOUT_TORCH();
  const char *ck = train_dir("c", "40");
  char hub[160], ft[160];
  snprintf(hub, sizeof hub, "%s/hub", dir);
  snprintf(ft, sizeof ft, "%s/ft/", dir);
  make_hub(ck, hub, NULL);
  char *out, *err;
  /* A fine-tuning run of 0 further steps' worth: its first evaluation (the
   * weights as loaded) equals the source run's final one. */
  int st = rumor(&out, &err, 120, "train", "--init-from", hub, "--data", text_path(), "--max-steps", "1", "--lr", "0",
             "--threads", "1", "--log-every", "0", "--eval-batches", "2", "--checkpoint", ft, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  cr_assert(strstr(err, "weights from"), "%s", err);
  cr_assert(strstr(out, "\"steps\":1"), "fine-tuning starts at step 0: %s", out);
  free(out), free(err);
  /* With lr 0 the weights are unchanged: the two model files hold the same tensors. */
  char a[200], b[200];
  snprintf(a, sizeof a, "%smodel.safetensors", ck);
  snprintf(b, sizeof b, "%smodel.safetensors", ft);
  struct st_file fa, fb;
  struct rumor_err e;
  cr_assert_eq(safetensors_read(a, true, &fa, &e), 0, "%s", e.msg);
  cr_assert_eq(safetensors_read(b, true, &fb, &e), 0, "%s", e.msg);
  cr_assert_eq(fa.ntensors, fb.ntensors);
  for (size_t i = 0; i < fa.ntensors; i++) {
    const struct st_tensor *t = safetensors_find(&fb, fa.tensors[i].name);
    cr_assert(t && t->nbytes == fa.tensors[i].nbytes && memcmp(t->data, fa.tensors[i].data, t->nbytes) == 0,
              "%s differs after --init-from", fa.tensors[i].name);
  }
  safetensors_free(&fa);
  safetensors_free(&fb);
  /* A --model that does not match the directory is refused. */
  st = rumor(NULL, &err, 60, "train", "--init-from", hub, "--model", "gpt:L2-H2-C32-T24-V300", "--data",
             text_path(), NULL);
  cli_expect_fail(st, 1, err, "does not match --init-from", "--init-from with another --model");
}

/* BF16 weights whose data section starts at an odd offset (an odd header
 * length, which the format allows): every value imports as exactly its
 * BF16 value, read without unaligned 16-bit loads (UBSan builds abort on
 * one). */
Test(gptcli, init_from_bf16_weights_after_an_odd_header) {
  SKIP_WITHOUT_TORCH();
  const char *ck = train_dir("b", "10");
  char hub[160], ft[160];
  snprintf(hub, sizeof hub, "%s/hub-bf16", dir);
  snprintf(ft, sizeof ft, "%s/ft-bf16/", dir);
  char *bf16[] = {"--dtype", "BF16", "--odd-header", NULL};
  make_hub(ck, hub, bf16);
  char *out, *err;
  char a[200], b[200];
  snprintf(b, sizeof b, "%s/model.safetensors", hub);
  FILE *f = fopen(b, "rb");
  cr_assert_not_null(f);
  uint8_t len8[8];
  cr_assert_eq(fread(len8, 1, 8, f), 8u);
  fclose(f);
  cr_assert(len8[0] & 1, "the header length is even: the data would be aligned");
  int st = rumor(&out, &err, 120, "train", "--init-from", hub, "--data", text_path(), "--max-steps", "1", "--lr", "0",
             "--threads", "1", "--log-every", "0", "--eval-batches", "2", "--checkpoint", ft, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(out), free(err);
  snprintf(a, sizeof a, "%smodel.safetensors", ck);
  snprintf(b, sizeof b, "%smodel.safetensors", ft);
  struct st_file fa, fb;
  struct rumor_err e;
  cr_assert_eq(safetensors_read(a, true, &fa, &e), 0, "%s", e.msg);
  cr_assert_eq(safetensors_read(b, true, &fb, &e), 0, "%s", e.msg);
  for (size_t i = 0; i < fa.ntensors; i++) {
    const struct st_tensor *t = safetensors_find(&fb, fa.tensors[i].name);
    cr_assert(t && t->nbytes == fa.tensors[i].nbytes, "%s missing after --init-from", fa.tensors[i].name);
    for (size_t k = 0; k < t->nbytes / 4; k++) {
      uint32_t want, got;
      memcpy(&want, (const uint8_t *)fa.tensors[i].data + 4 * k, 4);
      memcpy(&got, (const uint8_t *)t->data + 4 * k, 4);
      cr_assert_eq(got, want & 0xffff0000u, "%s[%zu]: %08x, not the BF16 value %08x", t->name, k, got,
                   want & 0xffff0000u);
    }
  }
  safetensors_free(&fa);
  safetensors_free(&fb);
}

Test(gptcli, bad_text_data_and_sample_input_are_named_and_exit_cleanly) {
  char *err;
  char shard[128], empty[128], missing[128];
  snprintf(shard, sizeof shard, "%s/bad.bin", dir);
  snprintf(empty, sizeof empty, "%s/empty.txt", dir);
  snprintf(missing, sizeof missing, "%s/nope.txt", dir);
  FILE *f = fopen(shard, "wb");
  int32_t header[256] = {12345, 1, 10};
  fwrite(header, sizeof header, 1, f);
  fclose(f);
  fclose(fopen(empty, "w"));
  int st = rumor(NULL, &err, 60, "train", "--model", MODEL, "--data", shard, NULL);
  cli_expect_fail(st, 1, err, "wrong magic", "a shard with the wrong magic");
  st = rumor(NULL, &err, 60, "train", "--model", MODEL, "--data", empty, NULL);
  cli_expect_fail(st, 1, err, "empty", "an empty text");
  st = rumor(NULL, &err, 60, "train", "--model", MODEL, "--data", missing, NULL);
  cli_expect_fail(st, 1, err, "nope.txt", "a missing file");
  st = rumor(NULL, &err, 60, "train", "--model", "gpt:L2-H2-C32-T24-V100", "--data", text_path(), NULL);
  cli_expect_fail(st, 1, err, "vocabulary", "text for a vocabulary under 256");
  st = rumor(NULL, &err, 60, "train", "--model", "gpt:L2-H3-C32-T24-V256", NULL);
  cli_expect_fail(st, 2, err, "not a multiple of the heads", "a bad spec");
  st = rumor(NULL, &err, 60, "train", "--model", "gpt:L2-H2-C32-T9000-V256", "--data", text_path(), NULL);
  cli_expect_fail(st, 1, err, "no window", "a context longer than the data");
  st = rumor(NULL, &err, 60, "sample", "--prompt", "x", NULL);
  cli_expect_fail(st, 2, err, "--checkpoint", "sample without a checkpoint");
  st = rumor(NULL, &err, 60, "sample", "--checkpoint", missing, NULL);
  cli_expect_fail(st, 1, err, "nope.txt", "sample from a missing checkpoint");
  st = rumor(NULL, &err, 60, "train", "--init-from", dir, "--data", text_path(), NULL);
  cli_expect_fail(st, 1, err, "config.json", "--init-from a directory without config.json");

  /* A model whose vocabulary is not 256 bytes takes token ids: a bad one
   * is quoted whole. */
  char ck[160], cfg[200];
  snprintf(ck, sizeof ck, "%s/v300/", dir);
  st = rumor(NULL, &err, 60, "train", "--model", "gpt:L1-H2-C8-T8-V300", "--data", text_path(), "--max-steps", "1",
             "--threads", "1", "--log-every", "0", "--eval-batches", "1", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "%s", err);
  free(err);
  const char *prompts[] = {"1.5", "12 7,1.5 3", "12 x7"};
  const char *quoted[] = {"'1.5' is not a token id in [0, 300)", "'1.5' is not a token id", "'x7' is not a token id"};
  for (int i = 0; i < 3; i++) {
    st = rumor(NULL, &err, 60, "sample", "--checkpoint", ck, "--prompt", prompts[i], NULL);
    cli_expect_fail(st, 2, err, quoted[i], prompts[i]);
  }
  /* Its config.json with another layer-norm epsilon than rumor computes
   * with is refused, naming the file, the field and the value. */
  snprintf(cfg, sizeof cfg, "%sconfig.json", ck);
  char *text = proc_slurp(cfg);
  char *eps = strstr(text, "\"layer_norm_epsilon\":");
  cr_assert_not_null(eps, "%s", text);
  FILE *f2 = fopen(cfg, "w");
  cr_assert_not_null(f2);
  fprintf(f2, "%.*s\"layer_norm_epsilon\":0.5%s", (int)(eps - text), text, eps + strcspn(eps, ",}"));
  fclose(f2);
  free(text);
  st = rumor(NULL, &err, 60, "sample", "--checkpoint", ck, "--prompt", "12", NULL);
  cli_expect_fail(st, 1, err, "config.json: layer_norm_epsilon is 0.5", "sample with epsilon 0.5");
  st = rumor(NULL, &err, 60, "train", "--init-from", ck, "--data", text_path(), "--max-steps", "1", NULL);
  cli_expect_fail(st, 1, err, "config.json: layer_norm_epsilon is 0.5", "--init-from with epsilon 0.5");
}

/* ---- stop signals: eval, sample and train's final evaluation end promptly ---------- */

/* Big enough that evaluating half of big_text_path() (about 3350 windows)
 * takes it tens of seconds on one core, far past the deadlines below. */
#define BIG_MODEL "gpt:L4-H4-C256-T128-V256"
#define STOP_DEADLINE_S 10.0 /* from the signal to the exit */

/* 200000 words (about 860 kB). */
static const char *big_text_path(void) {
  static char path[128];
  return write_words(path, "big.txt", 200000, 88172645463325252ull);
}

/* Starts rumor with `args` (NULL-terminated, at most 30) in the background,
 * stdout and stderr to dir/<name>.out and .err (paths into out/err, 160
 * bytes). The suite's teardown ends it if the test does not. */
static pid_t spawn(const char *name, char *out, char *err, char *const *args) {
  char *argv[32] = {RUMOR_BIN};
  int n = 1;
  for (int i = 0; args[i] && n < 31; i++) argv[n++] = args[i];
  argv[n] = NULL;
  snprintf(out, 160, "%s/%s.out", dir, name);
  snprintf(err, 160, "%s/%s.err", dir, name);
  pid_t pid = proc_spawn(argv, out, err);
  cr_assert_gt(pid, 0, "cannot start %s", RUMOR_BIN);
  return pid;
}

/* Waits up to `secs` until the file at `path` holds `needle` (NULL: at
 * least `min_bytes` bytes). */
static bool wait_for_file(const char *path, const char *needle, size_t min_bytes, double secs) {
  for (double waited = 0; waited < secs; waited += 0.05) {
    size_t n;
    char *text = proc_slurp_n(path, &n);
    bool ok = needle ? strstr(text, needle) != NULL : n >= min_bytes;
    free(text);
    if (ok) return true;
    usleep(50000);
  }
  return false;
}

/* Sends `sig` to `pid` and asserts that it exits within STOP_DEADLINE_S
 * with the status of an interrupted command, 130, saying so on stderr. */
static void expect_prompt_stop(pid_t pid, int sig, const char *err_path, const char *needle, const char *what) {
  cr_assert_eq(kill(pid, sig), 0);
  int st = proc_wait(pid, STOP_DEADLINE_S);
  char *err = proc_slurp(err_path);
  cr_assert(st >= 0, "%s: still running %.0f s after signal %d: %s", what, STOP_DEADLINE_S, sig, err);
  cr_assert(proc_exited_with(st, 130), "%s: wait status %#x after signal %d, want exit 130: %s", what, st, sig, err);
  cr_assert(strstr(err, needle), "%s: stderr should say '%s': %s", what, needle, err);
  free(err);
}

Test(gptcli, sigint_stops_sample_before_its_next_token_with_status_130) {
  const char *ck = train_dir("s", "2");
  char out[160], err[160];
  char *args[] = {"sample", "--checkpoint", (char *)ck, "--prompt", "the lord ", "--tokens", "1000000", "--threads",
                  "1", NULL};
  pid_t pid = spawn("sample", out, err, args);
  cr_assert(wait_for_file(out, NULL, 200, 60), "sample printed under 200 bytes in 60 s");
  expect_prompt_stop(pid, SIGINT, err, "rumor sample: interrupted by signal 2 after", "sample");
  size_t n;
  char *text = proc_slurp_n(out, &n);
  cr_assert(strncmp(text, "the lord ", 9) == 0, "the prompt is not printed first: '%.40s'", text);
  cr_assert(n > 200 && n < 9 + 1000000 && text[n - 1] == '\n',
            "want what was generated, ended by a newline: %zu bytes ending in %d", n, n ? text[n - 1] : -1);
  free(text);
}

Test(gptcli, sigint_stops_eval_between_batches_with_status_130_and_no_result) {
  const char *text = big_text_path();
  char ck[160], *out, *err;
  snprintf(ck, sizeof ck, "%s/big/", dir);
  int st = rumor(&out, &err, 200, "train", "--model", BIG_MODEL, "--data", text, "--batch", "4", "--max-steps", "1",
                 "--threads", "1", "--log-every", "0", "--eval-batches", "1", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "training failed: %s", err);
  free(out), free(err);
  char op[160], ep[160];
  char *args[] = {"eval", "--checkpoint", ck, "--data", (char *)text, "--val-fraction", "0.5", "--threads", "1", NULL};
  pid_t pid = spawn("eval", op, ep, args);
  usleep(1000000); /* loading and a few batches; a signal before the first batch must stop it as well */
  expect_prompt_stop(pid, SIGINT, ep, "rumor eval: interrupted by signal 2 after", "eval");
  char *result = proc_slurp(op);
  cr_assert_str_empty(result, "an interrupted eval printed a result: %s", result);
  free(result);
}

/* SIGTERM while `rumor train` runs its final evaluation: it stops there,
 * prints no result line, exits 130, and the checkpoint of its last step,
 * written before the evaluation, is intact. */
Test(gptcli, sigterm_in_the_final_evaluation_stops_train_and_keeps_its_checkpoint) {
  const char *text = big_text_path();
  char ck[160], op[160], ep[160];
  snprintf(ck, sizeof ck, "%s/final/", dir);
  char *args[] = {"train", "--model", BIG_MODEL, "--data", (char *)text, "--val-fraction", "0.5", "--batch", "4",
                  "--max-steps", "2", "--eval-batches", "0", "--threads", "1", "--log-every", "0", "--checkpoint", ck,
                  NULL};
  pid_t pid = spawn("train", op, ep, args);
  cr_assert(wait_for_file(ep, "checkpoint saved to", 0, 120), "no checkpoint saved in 120 s");
  /* "interrupted at step 2: final evaluation stopped by signal 15 after N
   * of 3351 windows"; or, should the signal land in the microseconds
   * between the save and the evaluation, "interrupted by signal 15 at step
   * 2". Without the fix the evaluation would run on for tens of seconds. */
  expect_prompt_stop(pid, SIGTERM, ep, "interrupted", "train");
  char *result = proc_slurp(op);
  cr_assert_str_empty(result, "an interrupted train printed a result: %s", result);
  free(result);
  char *out, *err;
  int st = rumor(&out, &err, 120, "eval", "--checkpoint", ck, "--data", text, "--eval-batches", "1", "--threads", "1",
                 NULL);
  cr_assert(proc_exited_with(st, 0), "the checkpoint does not evaluate: %s", err);
  cr_assert_eq(cli_json_number(out, "step"), 2, "the checkpoint is not of step 2: %s", out);
  free(out), free(err);
}

/* --grad-clip's figures: the result line counts the steps whose gradient
 * norm was clipped (every one under a tiny bound, none under a huge one),
 * and the progress line shows the last norm. */
Test(gptcli, grad_clip_counts_the_clipped_steps) {
  const char *data = text_path();
  const char *bounds[] = {"1e-6", "1e6"};
  for (int i = 0; i < 2; i++) {
    char *out, *err;
    int st = rumor(&out, &err, 120, "train", "--model", MODEL, "--data", data, "--optimizer", "adamw", "--batch", "4",
                   "--max-steps", "5", "--threads", "1", "--log-every", "1e-9", "--no-eval", "--eval-batches", "1",
                   "--grad-clip", bounds[i], NULL);
    cr_assert(proc_exited_with(st, 0), "training failed: %s", err);
    double clipped = cli_json_number(out, "clipped_steps");
    cr_assert_eq(clipped, i == 0 ? 5 : 0, "--grad-clip %s: %g clipped steps of 5 (%s)", bounds[i], clipped, out);
    cr_assert(strstr(err, "grad norm "), "no gradient norm in the progress lines: %s", err);
    free(out), free(err);
  }
  char *out, *err;
  int st = rumor(&out, &err, 120, "train", "--model", MODEL, "--data", data, "--batch", "4", "--max-steps", "1",
                 "--threads", "1", "--log-every", "0", "--no-eval", "--eval-batches", "1", NULL);
  cr_assert(proc_exited_with(st, 0), "training failed: %s", err);
  cr_assert_null(strstr(out, "clipped_steps"), "clipped_steps without --grad-clip: %s", out);
  free(out), free(err);
}

/* --tf32 on the CPU: accepted, said in --help to change nothing there,
 * recorded in the result line and the checkpoint, and the run is bit for
 * bit the one without it (same train_loss digits, same parameters). */
Test(gptcli, tf32_on_the_cpu_is_recorded_and_changes_nothing) {
  const char *data = text_path();
  char *out, *err;
  int st = rumor(&out, &err, 30, "train", "--help", NULL);
  cr_assert(proc_exited_with(st, 0), "train --help failed: %s", err);
  const char *h = strstr(out, "--tf32");
  cr_assert(h && strstr(h, "On the CPU it is accepted and recorded but changes nothing"), "help: %s", out);
  free(out), free(err);
  double loss[2];
  for (int i = 0; i < 2; i++) {
    char ck[160];
    snprintf(ck, sizeof ck, "%s/tf32-%d.safetensors", dir, i);
    st = rumor(&out, &err, 120, "train", "--model", MODEL, "--data", data, "--device", "cpu", "--optimizer", "adamw",
               "--batch", "4", "--max-steps", "3", "--threads", "1", "--log-every", "0", "--no-eval",
               "--eval-batches", "1", "--checkpoint", ck, i ? "--tf32" : NULL, NULL);
    cr_assert(proc_exited_with(st, 0), "training failed: %s", err);
    cr_assert(strstr(out, i ? "\"tf32\":true" : "\"tf32\":false"), "result line: %s", out);
    loss[i] = cli_json_number(out, "train_loss");
    free(out), free(err);
    struct checkpoint c;
    struct rumor_err e;
    cr_assert_eq(checkpoint_open(ck, &c, &e), 0, "%s", e.msg);
    cr_assert_eq(c.info.tf32, i == 1, "checkpoint %d records tf32 %d", i, c.info.tf32);
    checkpoint_close(&c);
  }
  cr_assert(loss[0] == loss[1], "--tf32 changed the CPU run: train_loss %.9g vs %.9g", loss[0], loss[1]);
}

/* A mixture of experts as users run one (issue #32): --moe-every and
 * --capacity-factor rewrite the spec (the checkpoint carries them), the
 * result line reports the auxiliary losses, the dropped fraction and each
 * expert's load, --init-from a dense directory upcycles, and the flags are
 * refused for a dense model. */
Test(gptcli, a_mixture_of_experts_trains_reports_its_experts_and_upcycles) {
  char ck[160], *out, *err;
  snprintf(ck, sizeof ck, "%s/moe.safetensors", dir);
  int st = rumor(&out, &err, 200, "train", "--model", "gpt:L2-H2-C32-T24-V256-E4-K2", "--moe-every", "2",
                 "--capacity-factor", "1.5", "--data", text_path(), "--batch", "8", "--max-steps", "6", "--threads", "1",
                 "--log-every", "0", "--eval-batches", "2", "--checkpoint", ck, NULL);
  cr_assert(proc_exited_with(st, 0), "training failed: %s", err);
  cr_assert(strstr(out, "\"expert_load\":["), "%s", out);
  double dropped = cli_json_number(out, "moe_dropped_fraction"), aux = cli_json_number(out, "moe_aux_loss");
  cr_assert(dropped >= 0 && dropped < 1 && aux > 0, "%s", out);
  free(out), free(err);
  struct st_file f;
  struct rumor_err e;
  cr_assert_eq(safetensors_read(ck, true, &f, &e), 0, "%s", e.msg);
  cr_assert_str_eq(safetensors_meta(&f, "rumor.model"), "gpt:L2-H2-C32-T24-V256-E4-K2-M2-F150");
  cr_assert_not_null(safetensors_find(&f, "transformer.h.1.mlp.experts.3.c_proj.weight"));
  cr_assert_null(safetensors_find(&f, "transformer.h.0.mlp.router.weight"), "block 0 is dense with M2");
  safetensors_free(&f);
  const char *dense = train_dir("dense-for-moe", "2");
  st = rumor(&out, &err, 200, "train", "--init-from", dense, "--model", "gpt:L2-H2-C32-T24-V256-E4", "--data",
             text_path(), "--batch", "8", "--max-steps", "2", "--threads", "1", "--log-every", "0", "--eval-batches",
             "2", NULL);
  cr_assert(proc_exited_with(st, 0), "upcycling failed: %s", err);
  cr_assert(strstr(err, "upcycled"), "%s", err);
  free(out), free(err);
  st = rumor(NULL, &err, 60, "train", "--model", MODEL, "--moe-every", "2", NULL);
  cli_expect_fail(st, 2, err, "--moe-every is for a mixture of experts", "--moe-every on a dense model");
  st = rumor(NULL, &err, 60, "train", "--model", "gpt:L2-H2-C32-T24-V256-E4-K5", NULL);
  cli_expect_fail(st, 2, err, "K5: the experts each token goes to", "K above E");
}
