/*
 * Fuzz harness: the llm.c token shard parser (token_shard_parse, which
 * token_corpus_load runs on every mapped shard), then the windows of an
 * accepted shard through the batcher and the in-order gather.
 * The first input byte picks the model's vocabulary and the context; the rest
 * is the file. Any input must be either refused with RUMOR_ECORRUPT and a
 * message, or accepted as a shard that keeps the parser's promises: at least
 * one token, the file exactly header + 2 · count bytes, the tokens right after
 * the header and every one below the vocabulary. A broken promise aborts;
 * nothing may crash, leak or read outside the input.
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "peer/data/data.h"
#include "tests/fuzz/fuzz.h"

static const int64_t g_vocabs[8] = {50257, 65536, 256, 1, 50304, 2, 65535, 1000};

/* Every window the batcher hands out over one epoch, and the gather's, must
 * be T+1 consecutive tokens of the shard. */
static void walk_windows(const uint16_t *tok, int64_t count, int64_t T) {
  struct token_segment seg = {tok, count, "fuzz", 0};
  struct token_split split = {&seg, 1, count};
  int64_t windows = token_split_windows(&split, T);
  if (windows != (count - 1) / T) abort();
  if (windows == 0) return;
  struct token_batcher b;
  struct rumor_err e;
  if (token_batcher_init(&b, &split, T, (struct shard){0, 1}, 1, 2, &e) != 0) abort();
  int32_t *x = malloc((size_t)(4 * T) * sizeof *x), *y = malloc((size_t)(4 * T) * sizeof *y);
  if (!x || !y) abort();
  int64_t steps = shard_order_steps(&b.rows, 4), rows_seen = 0;
  for (int64_t s = 0; s < steps; s++) {
    int64_t rows = token_batcher_fill(&b, s, 4, x, y);
    for (int64_t r = 0; r < rows; r++) {
      int64_t w = b.rows.order[s * 4 + r];
      for (int64_t t = 0; t < T; t++)
        if (x[r * T + t] != tok[w * T + t] || y[r * T + t] != tok[w * T + t + 1]) abort();
    }
    rows_seen += rows;
  }
  if (rows_seen != windows) abort();
  int64_t rows = windows < 4 ? windows : 4;
  token_split_gather(&split, T, windows - rows, rows, x, y);
  for (int64_t t = 0; t < rows * T; t++)
    if (x[t] != tok[(windows - rows) * T + t] || y[t] != tok[(windows - rows) * T + t + 1]) abort();
  free(x);
  free(y);
  token_batcher_free(&b);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
  if (size == 0) return 0;
  int64_t vocab = g_vocabs[data[0] & 7], T = 1 + (data[0] >> 3);
  size_t len = size - 1;
  /* A copy of exactly len bytes (malloc'd: 2-byte aligned, as a mapping is),
   * so that AddressSanitizer sees any read past the end. */
  uint8_t *buf = len ? malloc(len) : NULL;
  if (len && !buf) abort();
  if (len) memcpy(buf, data + 1, len);
  const uint16_t *tok = NULL;
  int64_t count = -1;
  struct rumor_err e = {0};
  int rc = token_shard_parse(buf, len, "fuzz", vocab, &tok, &count, &e);
  if (getenv("RUMOR_FUZZ_VERBOSE")) fprintf(stderr, "vocab %lld: %s\n", (long long)vocab, rc ? e.msg : "accepted");
  if (rc == 0) {
    if (count < 1 || len != TOKEN_SHARD_HEADER_BYTES + 2 * (size_t)count) abort();
    if ((const uint8_t *)tok != buf + TOKEN_SHARD_HEADER_BYTES) abort();
    for (int64_t i = 0; i < count; i++)
      if (tok[i] >= vocab) abort();
    walk_windows(tok, count, T);
  } else if (rc != RUMOR_ECORRUPT || e.msg[0] == '\0' || strncmp(e.msg, "fuzz: ", 6) != 0) {
    abort(); /* a bad shard is corrupt, and says which file and why */
  }
  free(buf);
  return 0;
}
