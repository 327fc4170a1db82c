/* `rumor sample`: text from a language-model checkpoint. */
#include <errno.h>
#include <unistd.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/cli/cli_impl.h"

#define SAMPLE_MAX_TOKENS 1000000

/* The model and its weights: a rumor checkpoint (file or directory) or any
 * Hugging Face GPT-2 directory. */
static int load_model(const char *path, const char *device, int threads, struct model *m, tensor_backend_t *be,
                      struct rumor_err *e) {
  struct model_spec spec;
  float *params = NULL;
  struct checkpoint ck;
  bool have_ck = false;
  char config[1100];
  checkpoint_dir_file(path, CHECKPOINT_CONFIG_FILE, config, sizeof config);
  int rc;
  if (checkpoint_is_dir(path) && access(config, R_OK) == 0) {
    if ((rc = hf_import(path, &spec, &params, e))) return rc;
  } else {
    if ((rc = checkpoint_open(path, &ck, e))) return rc;
    have_ck = true;
    spec = ck.info.spec;
  }
  struct model_io io;
  model_spec_io(&spec, &io);
  if (io.input_dtype != TENSOR_I32) {
    rc = rumor_err_set(e, RUMOR_EFORMAT, "%s holds a model that does not take tokens (not a language model)", path);
  } else if (!(rc = tensor_backend_open(device, be, e))) {
    if (threads > 0) tensor_backend_set_threads(*be, threads);
    rc = model_init_full(m, &spec, *be, 1, e);
    if (rc == 0 && have_ck) rc = checkpoint_restore(&ck, m, NULL, e);
    if (rc == 0 && params) tensor_copy_from_host(&m->params, 0, params, (size_t)m->nparams * sizeof(float));
  }
  free(params);
  if (have_ck) checkpoint_close(&ck);
  return rc;
}

/* The prompt as tokens: its bytes for a byte-level model (vocabulary 256),
 * else integers separated by spaces or commas. */
static int parse_prompt(const char *prompt, int64_t vocab, int32_t *out, int64_t cap, int64_t *n,
                        struct rumor_err *e) {
  *n = 0;
  if (vocab == 256) {
    for (const unsigned char *p = (const unsigned char *)prompt; *p && *n < cap; p++) out[(*n)++] = *p;
    return 0;
  }
  for (const char *p = prompt; *p;) {
    if (*p == ' ' || *p == ',') {
      p++;
      continue;
    }
    /* The whole token up to the next separator, quoted whole when bad. */
    size_t len = strcspn(p, " ,");
    char *end;
    errno = 0;
    long long v = strtoll(p, &end, 10);
    if (end != p + len || errno || v < 0 || v >= vocab)
      return rumor_err_set(e, RUMOR_EFORMAT,
                           "--prompt: '%.*s%s' is not a token id in [0, %lld) (a model whose vocabulary is not 256 "
                           "bytes takes token ids separated by spaces or commas)",
                           len > 40 ? 40 : (int)len, p, len > 40 ? "..." : "", (long long)vocab);
    if (*n == cap) return rumor_err_set(e, RUMOR_EFORMAT, "--prompt: more than %lld tokens", (long long)cap);
    out[(*n)++] = (int32_t)v;
    p = end;
  }
  return 0;
}

/* The next token from one row of logits: argmax at temperature 0, else a
 * draw from softmax(logits / temperature) over the top_k largest (0: all).
 * Overwrites the row. */
static int32_t pick(float *logits, int64_t V, double temperature, int64_t top_k, struct rng *r) {
  int64_t best = 0;
  for (int64_t i = 1; i < V; i++)
    if (logits[i] > logits[best]) best = i;
  if (temperature <= 0) return (int32_t)best;
  float cut = -INFINITY;
  if (top_k > 0 && top_k < V) {
    /* The k-th largest value: a copy sorted partially would do; V·k is
     * small for the k people use. */
    float *kth = xmalloc((size_t)top_k * sizeof(float));
    int64_t n = 0;
    for (int64_t i = 0; i < V; i++) {
      if (n == top_k && logits[i] <= kth[n - 1]) continue;
      int64_t j = n < top_k ? n++ : n - 1;
      while (j > 0 && kth[j - 1] < logits[i]) {
        kth[j] = kth[j - 1];
        j--;
      }
      kth[j] = logits[i];
    }
    cut = kth[top_k - 1];
    free(kth);
  }
  /* The row becomes the unnormalised probabilities (0 below the cut). */
  double top = logits[best], sum = 0;
  for (int64_t i = 0; i < V; i++) {
    logits[i] = logits[i] >= cut ? (float)exp((logits[i] - top) / temperature) : 0.0f;
    sum += logits[i];
  }
  double u = (double)rng_uniform(r) * sum, acc = 0;
  for (int64_t i = 0; i < V; i++) {
    acc += logits[i];
    if (logits[i] > 0 && acc >= u) return (int32_t)i;
  }
  return (int32_t)best;
}

static void print_token(int32_t tok, bool bytes, bool first) {
  if (bytes) putchar(tok);
  else printf(first ? "%d" : " %d", tok);
}

/* Generates `count` tokens after the prompt, printing each as it comes.
 * A stop signal ends it before the next token. Either way the output ends
 * with a newline and is flushed. Returns the tokens generated. */
static int64_t generate(struct model *m, int32_t *toks, int64_t n, int64_t count, double temperature, int64_t top_k,
                        uint64_t seed) {
  int64_t T = m->io.input_per_row, V = m->io.classes;
  bool bytes = V == 256;
  float *row = xmalloc((size_t)V * sizeof(float));
  struct rng r;
  rng_seed(&r, seed, 0x53414d50 /* "SAMP" */);
  for (int64_t i = 0; i < n; i++) print_token(toks[i], bytes, i == 0);
  fflush(stdout);
  int64_t k;
  for (k = 0; k < count && !signals_stop_requested(); k++) {
    int64_t len = n < T ? n : T, first = n - len; /* the last T tokens */
    model_set_positions(m, len);
    tensor_copy_from_host(model_act(m, 0), 0, toks + first, (size_t)len * sizeof(int32_t));
    model_forward(m, 0, m->table.nunits, 1);
    tensor_copy_to_host(model_act(m, m->table.nunits), (len - 1) * model_logits_stride(m), row,
                        (size_t)V * sizeof(float));
    toks[n] = pick(row, V, temperature, top_k, &r);
    print_token(toks[n], bytes, n == 0);
    fflush(stdout);
    n++;
  }
  if (!bytes || (n > 0 && toks[n - 1] != '\n')) putchar('\n');
  fflush(stdout);
  free(row);
  return k;
}

int cmd_sample(int argc, char **argv) {
  const char *ckpt = NULL, *prompt = "", *device = "auto";
  int64_t tokens = 200, top_k = 0, threads = 0, seed = 1;
  double temperature = 1.0;
  const struct arg_spec specs[] = {
      {"checkpoint", ARG_STR, &ckpt, "PATH", "a checkpoint file or directory, or a Hugging Face GPT-2 directory"},
      {"prompt", ARG_STR, &prompt, "TEXT", "text to continue (token ids for a vocabulary other than 256 bytes)"},
      {"tokens", ARG_INT, &tokens, "N", "tokens to generate", 0, SAMPLE_MAX_TOKENS},
      {"temperature", ARG_FLOAT, &temperature, "X", "softmax temperature; 0 is greedy (argmax)", 0, 100},
      {"top-k", ARG_INT, &top_k, "K", "draw among the K likeliest tokens only (0: all)", 0, GPT_MAX_VOCAB},
      {"seed", ARG_INT, &seed, "S", "random seed of the draws", 0, 9007199254740992.0},
      {"device", ARG_STR, &device, "DEV", "auto, cpu, cuda or cuda:N"},
      {"threads", ARG_INT, &threads, "N", "CPU threads (0: all cores)", 0, 4096},
      {0},
  };
  int ar = args_parse(specs, argc, argv, "rumor sample --checkpoint PATH [--prompt TEXT] [options]",
                      "Prints the prompt and its continuation by a language model: bytes for a byte-level model "
                      "(vocabulary 256), token ids otherwise. SIGINT/SIGTERM stop it before the next token: "
                      "the text so far stays printed, exit status 130.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  if (!ckpt) {
    fprintf(stderr, "rumor sample: --checkpoint PATH is required\n");
    return 2;
  }
  struct rumor_err e = {0};
  struct model m;
  memset(&m, 0, sizeof m);
  tensor_backend_t be = NULL;
  int32_t *toks = NULL;
  int status = 1;
  if (load_model(ckpt, device, (int)threads, &m, &be, &e)) goto done;
  int64_t cap = (int64_t)strlen(prompt) + 1, n;
  toks = xmalloc((size_t)(cap + tokens) * sizeof(int32_t));
  if (parse_prompt(prompt, m.io.classes, toks, cap, &n, &e)) {
    status = 2;
    goto done;
  }
  if (n == 0 && tokens > 0) {
    rumor_err_set(&e, RUMOR_EFORMAT, "--prompt is empty: give at least one token to continue");
    status = 2;
    goto done;
  }
  int64_t made = generate(&m, toks, n, tokens, temperature, top_k, (uint64_t)seed);
  if (made < tokens) {
    /* The prompt and the tokens made so far are printed and flushed. */
    rumor_err_set(&e, RUMOR_ECANCELED, "interrupted by signal %d after %lld of %lld tokens",
                  signals_stop_requested(), (long long)made, (long long)tokens);
    status = CLI_EXIT_INTERRUPTED;
    goto done;
  }
  status = 0;
done:
  if (status) fprintf(stderr, "rumor sample: %s\n", e.msg);
  free(toks);
  model_free(&m);
  tensor_backend_close(be);
  return status;
}
