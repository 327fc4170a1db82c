/* A CUDA build starts where cuBLAS is missing: the `rumor` binary does not
 * need libcublas to load (cuBLAS is opened at run time, tensor_cublas.h),
 * and with the library made unloadable (RUMOR_CUBLAS_LIB, the test-only
 * override of the name it opens) it trains a small model on the CPU and
 * says so in exactly one line. On a host with a GPU that line names cuBLAS;
 * on one without, it is the usual "no usable CUDA GPU" notice. A build
 * without CUDA skips with a message. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tensor/tensor.h"
#include "../support/proc.h"
#include "../support/cli.h"

static char dir[64];

static void setup(void) { proc_scratch_make(dir, sizeof dir, "nocublas"); }
static void teardown(void) { proc_scratch_remove(dir); }
#define rumor(out, err, secs, ...) cli_rumor(dir, out, err, secs, __VA_ARGS__)

TestSuite(nocublas, .init = setup, .fini = teardown, .timeout = 240);

static void skip_without_cuda(void) {
  if (!tensor_cuda_compiled()) cr_skip_test("built without CUDA: no cuBLAS to go without; test skipped");
}

/* Lines of `text` that contain `needle`. */
static int count_lines_with(const char *text, const char *needle) {
  int n = 0;
  for (const char *line = text; line && *line;) {
    const char *end = strchr(line, '\n');
    size_t len = end ? (size_t)(end - line) : strlen(line);
    const char *hit = strstr(line, needle);
    if (hit && hit < line + len) n++;
    line = end ? end + 1 : NULL;
  }
  return n;
}

Test(nocublas, the_cuda_binary_does_not_link_libcublas) {
  skip_without_cuda();
  char *out, *err;
  char *argv[] = {"/usr/bin/readelf", "-d", RUMOR_BIN, NULL};
  int st = proc_run(argv, 30, dir, &out, &err);
  cr_assert(proc_exited_with(st, 0), "readelf -d %s failed (status %d): %s", RUMOR_BIN, st, err);
  cr_assert(strstr(out, "(NEEDED)") != NULL, "readelf printed no NEEDED entries: %s", out);
  cr_assert(strstr(out, "libcublas") == NULL, "the binary needs cuBLAS at load time:\n%s", out);
  cr_assert(strstr(out, "libcudart") == NULL, "the binary needs the CUDA runtime at load time:\n%s", out);
  free(out), free(err);
}

Test(nocublas, starts_without_cublas_and_trains_on_the_cpu_with_one_message) {
  skip_without_cuda();
  char text[128];
  snprintf(text, sizeof text, "%s/text.txt", dir);
  FILE *f = fopen(text, "w");
  cr_assert_not_null(f);
  for (int i = 0; i < 2000; i++) fputs(i % 7 ? "gossip " : "rumor.\n", f);
  fclose(f);
  cr_assert_eq(setenv("RUMOR_CUBLAS_LIB", "/nonexistent/libcublas.so", 1), 0);
  char *out, *err;
  int st = rumor(&out, &err, 200, "train", "--model", "gpt:L1-H2-C16-T16-V256", "--data", text, "--device", "auto",
                 "--optimizer", "adamw", "--lr", "1e-3", "--batch", "4", "--max-steps", "3", "--threads", "1",
                 "--log-every", "0", "--eval-batches", "1", NULL);
  cr_assert(proc_exited_with(st, 0), "training without cuBLAS failed (status %d): %s", st, err);
  double loss = cli_json_number(out, "train_loss");
  cr_assert(isfinite(loss) && loss > 0, "no finite train_loss in the result line: %s", out);
  cr_assert_eq(count_lines_with(err, "using the CPU backend"), 1, "want exactly one fall-back line:\n%s", err);
  if (tensor_cuda_device_count() > 0)
    cr_assert(strstr(err, "cuBLAS cannot be loaded (/nonexistent/libcublas.so)") != NULL,
              "with a GPU present the fall-back must name cuBLAS:\n%s", err);
  cr_assert(strstr(err, "panic") == NULL && strstr(err, "PANIC") == NULL, "%s", err);
  free(out), free(err);

  /* An explicit cuda is refused with a clear message, not a crash. */
  st = rumor(NULL, &err, 60, "train", "--model", "gpt:L1-H2-C16-T16-V256", "--data", text, "--device", "cuda",
             "--max-steps", "1", "--threads", "1", NULL);
  cr_assert(st >= 0 && WIFEXITED(st) && WEXITSTATUS(st) != 0, "--device cuda without cuBLAS: status %d: %s", st, err);
  cr_assert(strstr(err, tensor_cuda_device_count() > 0 ? "cuBLAS" : "CUDA device") != NULL, "%s", err);
  free(err);
}
