/* Checkpoints: a round trip restores parameters, optimizer state and the
 * training position exactly; truncated or bit-flipped files (anywhere: the
 * length prefix, the JSON header, the data) are rejected with a message, and
 * the writer leaves no temporary file behind; metadata past the options'
 * ranges, and a directory's damaged optimizer file, are refused; a
 * destination that cannot be written is refused up front; checkpoints
 * written by release 0.1 (tests/data) still open and restore bit for bit. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <signal.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "peer/train/train.h"

static char dir[64];
static tensor_backend_t be;

static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-test-ck-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
  struct rumor_err e;
  cr_assert_eq(tensor_backend_open("cpu", &be, &e), 0);
}
static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  cr_assert_eq(system(cmd), 0);
  tensor_backend_close(be);
}
TestSuite(checkpoint, .init = setup, .fini = teardown);

static void make(struct model *m, struct optim *o, enum optim_kind kind) {
  struct model_spec spec;
  struct rumor_err e;
  cr_assert_eq(model_spec_parse("mlp:20-16-8-4", &spec, &e), 0);
  cr_assert_eq(model_init_full(m, &spec, be, 8, &e), 0);
  model_init_params(m, 42);
  struct optim_config oc;
  optim_config_default(&oc);
  oc.kind = kind;
  cr_assert_eq(optim_init(o, &oc, m, &e), 0);
  /* give the optimizer non-trivial state */
  tensor_fill(&m->grads, 0.5f);
  optim_apply(o, &m->params, &m->grads, 0.1);
  optim_apply(o, &m->params, &m->grads, 0.1);
}

static struct ckpt_info info_for(const struct model *m) {
  struct ckpt_info in;
  memset(&in, 0, sizeof in);
  in.spec = m->spec;
  in.st = (struct train_state){.step = 1234, .epoch = 3, .step_in_epoch = 17, .samples = 99999};
  in.seed = 7;
  in.data_seed = 8;
  in.shard = (struct shard){1, 4};
  in.batch = 64;
  in.norm_mean = 0.2860402;
  in.norm_std = 0.3530239;
  snprintf(in.peer_id, sizeof in.peer_id, "peer-test");
  return in;
}

static char *path(const char *name) {
  static char buf[4][256];
  static int w;
  char *p = buf[w++ % 4];
  snprintf(p, 256, "%s/%s", dir, name);
  return p;
}

Test(checkpoint, round_trip_sgd_and_adamw) {
  enum optim_kind kinds[] = {OPTIM_SGD, OPTIM_ADAMW};
  for (int k = 0; k < 2; k++) {
    struct model m, m2;
    struct optim o, o2;
    struct rumor_err e;
    make(&m, &o, kinds[k]);
    struct ckpt_info in = info_for(&m);
    in.tf32 = k == 1; /* --tf32 is recorded either way */
    cr_assert_eq(checkpoint_save(path("a.safetensors"), &m, &o, &in, &e), 0, "%s", e.msg);
    struct checkpoint ck;
    cr_assert_eq(checkpoint_open(path("a.safetensors"), &ck, &e), 0, "%s", e.msg);
    cr_assert_eq(ck.info.st.step, 1234);
    cr_assert_eq(ck.info.st.epoch, 3);
    cr_assert_eq(ck.info.st.step_in_epoch, 17);
    cr_assert_eq(ck.info.st.samples, 99999);
    cr_assert_eq(ck.info.seed, 7);
    cr_assert_eq(ck.info.data_seed, 8);
    cr_assert(ck.info.shard.index == 1 && ck.info.shard.count == 4);
    cr_assert_eq(ck.info.batch, 64);
    cr_assert_eq(ck.info.norm_mean, 0.2860402);
    cr_assert_str_eq(ck.info.peer_id, "peer-test");
    cr_assert_eq(ck.info.optim_kind, kinds[k]);
    cr_assert_eq(ck.info.tf32, k == 1, "rumor.tf32 did not round-trip");
    const char *tf32 = safetensors_meta(&ck.file, "rumor.tf32");
    cr_assert(tf32 && strcmp(tf32, k == 1 ? "true" : "false") == 0, "rumor.tf32 is '%s'", tf32 ? tf32 : "(none)");

    struct optim_config oc = o.cfg;
    cr_assert_eq(model_init_full(&m2, &ck.info.spec, be, 8, &e), 0);
    cr_assert_eq(optim_init(&o2, &oc, &m2, &e), 0);
    cr_assert_eq(checkpoint_restore(&ck, &m2, &o2, &e), 0, "%s", e.msg);
    cr_assert_eq(memcmp(m.params.data, m2.params.data, tensor_nbytes(&m.params)), 0, "parameters differ");
    cr_assert_eq(memcmp(o.state.data, o2.state.data, tensor_nbytes(&o.state)), 0, "optimizer state differs");
    cr_assert_eq(o2.step, 1234);
    checkpoint_close(&ck);
    model_free(&m), model_free(&m2), optim_free(&o), optim_free(&o2);
  }
  /* no temporary file is left next to the checkpoint (a.safetensors.prev
   * is the previous checkpoint, kept on purpose) */
  char cmd[256];
  snprintf(cmd, sizeof cmd, "test $(ls %s | grep -v '[.]prev$' | wc -l) -eq 1", dir);
  cr_assert_eq(system(cmd), 0, "stray files in %s", dir);
}

static size_t file_size(const char *p) {
  struct stat st;
  cr_assert_eq(stat(p, &st), 0);
  return (size_t)st.st_size;
}

static void copy_file(const char *from, const char *to, size_t keep, long flip_at) {
  FILE *in = fopen(from, "rb"), *out = fopen(to, "wb");
  cr_assert(in && out);
  for (size_t i = 0; i < keep; i++) {
    int c = fgetc(in);
    cr_assert_neq(c, EOF);
    if ((long)i == flip_at) c ^= 0x10;
    fputc(c, out);
  }
  fclose(in);
  fclose(out);
}

Test(checkpoint, truncated_or_bit_flipped_files_are_rejected) {
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, OPTIM_SGD);
  struct ckpt_info in = info_for(&m);
  const char *good = path("good.safetensors");
  cr_assert_eq(checkpoint_save(good, &m, &o, &in, &e), 0, "%s", e.msg);
  size_t n = file_size(good);
  const char *bad = path("bad.safetensors");
  struct checkpoint ck;

  size_t cuts[] = {0, 4, 8, 100, n / 2, n - 1};
  for (size_t i = 0; i < sizeof cuts / sizeof cuts[0]; i++) {
    copy_file(good, bad, cuts[i], -1);
    cr_assert_neq(checkpoint_open(bad, &ck, &e), 0, "file cut to %zu of %zu bytes accepted", cuts[i], n);
    cr_assert(strstr(e.msg, bad) != NULL, "message should name the file: %s", e.msg);
  }
  /* A flip in every region: length prefix, JSON header, data. Step through
   * the whole file in strides so every part is hit. */
  for (size_t at = 0; at < n; at += (at < 2048 ? 7 : 997)) {
    copy_file(good, bad, n, (long)at);
    int rc = checkpoint_open(bad, &ck, &e);
    cr_assert_neq(rc, 0, "bit flip at byte %zu of %zu accepted", at, n);
  }
  cr_assert_eq(checkpoint_open(good, &ck, &e), 0, "%s", e.msg);
  checkpoint_close(&ck);
  cr_assert_neq(checkpoint_open(path("missing.safetensors"), &ck, &e), 0);
  model_free(&m), optim_free(&o);
}

Test(checkpoint, restore_refuses_another_model) {
  struct model m, other;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, OPTIM_SGD);
  struct ckpt_info in = info_for(&m);
  cr_assert_eq(checkpoint_save(path("c.safetensors"), &m, &o, &in, &e), 0);
  struct checkpoint ck;
  cr_assert_eq(checkpoint_open(path("c.safetensors"), &ck, &e), 0);
  struct model_spec spec;
  cr_assert_eq(model_spec_parse("mlp:20-10-4", &spec, &e), 0);
  cr_assert_eq(model_init_full(&other, &spec, be, 8, &e), 0);
  cr_assert_eq(checkpoint_restore(&ck, &other, NULL, &e), RUMOR_ESHAPE);
  cr_assert(strstr(e.msg, "mlp:20-16-8-4") != NULL, "%s", e.msg);
  checkpoint_close(&ck);
  model_free(&m), model_free(&other), optim_free(&o);
}

Test(checkpoint, failed_write_keeps_the_previous_file) {
  /* A full disk, simulated with RLIMIT_FSIZE in a child process: the write
   * of the new checkpoint fails part-way and the old one stays loadable. */
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, OPTIM_SGD);
  struct ckpt_info in = info_for(&m);
  const char *p = path("keep.safetensors");
  cr_assert_eq(checkpoint_save(p, &m, &o, &in, &e), 0);
  pid_t pid = fork();
  cr_assert_neq(pid, -1);
  if (pid == 0) {
    signal(SIGXFSZ, SIG_IGN);
    struct rlimit rl = {.rlim_cur = 4096, .rlim_max = 4096};
    setrlimit(RLIMIT_FSIZE, &rl);
    tensor_fill(&m.params, 9.0f);
    int rc = checkpoint_save(p, &m, &o, &in, &e);
    char want[300]; /* the message names the checkpoint, not only its staging file */
    snprintf(want, sizeof want, "cannot save %s: ", p);
    _exit(rc != 0 && strstr(e.msg, "File too large") && strncmp(e.msg, want, strlen(want)) == 0 ? 0 : 1);
  }
  int status;
  cr_assert_eq(waitpid(pid, &status, 0), pid);
  cr_assert(WIFEXITED(status) && WEXITSTATUS(status) == 0, "the write under a 4 KiB file-size limit did not fail cleanly");
  struct checkpoint ck;
  cr_assert_eq(checkpoint_open(p, &ck, &e), 0, "previous checkpoint damaged: %s", e.msg);
  const struct st_tensor *w = safetensors_find(&ck.file, "layers.0.weight");
  cr_assert_eq(memcmp(w->data, m.params.data, w->nbytes), 0, "previous checkpoint's contents changed");
  checkpoint_close(&ck);
  char cmd[256];
  snprintf(cmd, sizeof cmd, "test $(ls %s | grep -v '[.]prev$' | wc -l) -eq 1", dir);
  cr_assert_eq(system(cmd), 0, "the failed write left a temporary file in %s", dir);
  model_free(&m), optim_free(&o);
}

Test(checkpoint, metadata_past_the_options_ranges_is_refused) {
  /* The digest has no key: anyone can write a file whose digest matches.
   * A batch no option allows sized the batch buffers past size_t (a crash
   * on resume); it is refused when the file is opened. */
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, OPTIM_SGD);
  struct ckpt_info in = info_for(&m);
  const int64_t bad[][2] = {{0, 4611686018427387904LL}, {0, 0}, {1, TRAIN_EPOCHS_MAX + 1}, {2, TRAIN_STEPS_MAX + 1}};
  const char *needle[] = {"rumor.batch is 4611686018427387904, outside [1, 1048576]", "rumor.batch is 0, outside",
                          "rumor.epochs is 1000001, outside", "rumor.step is 1000000000000001, outside"};
  for (int i = 0; i < 4; i++) {
    struct ckpt_info x = in;
    if (bad[i][0] == 0) x.batch = bad[i][1];
    if (bad[i][0] == 1) x.epochs = bad[i][1];
    if (bad[i][0] == 2) x.st.step = bad[i][1];
    const char *p = path("huge.safetensors");
    cr_assert_eq(checkpoint_save(p, &m, &o, &x, &e), 0, "%s", e.msg);
    struct checkpoint ck;
    cr_assert_neq(checkpoint_open(p, &ck, &e), 0, "case %d opened", i);
    cr_assert(strstr(e.msg, needle[i]) && strstr(e.msg, p), "case %d: %s", i, e.msg);
  }
  model_free(&m), optim_free(&o);
}

Test(checkpoint, a_damaged_optimizer_file_of_a_directory_is_an_error_a_missing_one_is_not) {
  struct model m;
  struct optim o;
  struct rumor_err e;
  make(&m, &o, OPTIM_ADAMW);
  struct ckpt_info in = info_for(&m);
  const char *d = path("dir/");
  cr_assert_eq(checkpoint_save(d, &m, &o, &in, &e), 0, "%s", e.msg);
  struct checkpoint ck;
  cr_assert_eq(checkpoint_open(d, &ck, &e), 0, "%s", e.msg);
  cr_assert(ck.has_optim);
  checkpoint_close(&ck);
  /* Damaged (cut to half): not silently replaced by zeros. */
  char cmd[400];
  snprintf(cmd, sizeof cmd, "f=%s/dir/optimizer.safetensors; truncate -s $(($(stat -c %%s $f) / 2)) $f", dir);
  cr_assert_eq(system(cmd), 0);
  cr_assert_neq(checkpoint_open(d, &ck, &e), 0, "a damaged optimizer file was accepted");
  cr_assert(strstr(e.msg, "no usable optimizer state of step 1234") && strstr(e.msg, "optimizer.safetensors"), "%s",
            e.msg);
  /* Of another step (weights of step 1234, state of 1300): the same. */
  cr_assert_eq(checkpoint_save(d, &m, &o, &in, &e), 0, "%s", e.msg);
  snprintf(cmd, sizeof cmd, "cp %s/dir/model.safetensors %s/model-1234", dir, dir);
  cr_assert_eq(system(cmd), 0);
  struct ckpt_info later = in;
  later.st.step = 1300;
  cr_assert_eq(checkpoint_save(d, &m, &o, &later, &e), 0, "%s", e.msg);
  snprintf(cmd, sizeof cmd, "cd %s && rm dir/*.prev && mv model-1234 dir/model.safetensors", dir);
  cr_assert_eq(system(cmd), 0);
  cr_assert_neq(checkpoint_open(d, &ck, &e), 0, "the state of another step was accepted");
  cr_assert(strstr(e.msg, "holds the state of step 1300"), "%s", e.msg);
  /* Missing altogether: the state starts from zero (with a warning). */
  snprintf(cmd, sizeof cmd, "rm -f %s/dir/optimizer.safetensors*", dir);
  cr_assert_eq(system(cmd), 0);
  cr_assert_eq(checkpoint_open(d, &ck, &e), 0, "%s", e.msg);
  cr_assert(!ck.has_optim);
  checkpoint_close(&ck);
  model_free(&m), optim_free(&o);
}

Test(checkpoint, a_destination_that_cannot_be_written_is_refused_up_front) {
  struct rumor_err e;
  char p[1000];
  cr_assert_eq(checkpoint_check_dest(path("a.safetensors"), &e), 0, "%s", e.msg);
  cr_assert_eq(checkpoint_check_dest(path("newdir/"), &e), 0, "%s", e.msg); /* the first save makes it */
  snprintf(p, sizeof p, "%s/", dir);
  cr_assert_eq(checkpoint_check_dest(p, &e), 0, "%s", e.msg);
  cr_assert_neq(checkpoint_check_dest(path("no/such/x.safetensors"), &e), 0);
  cr_assert(strstr(e.msg, "no/such: No such file or directory"), "%s", e.msg);
  cr_assert_neq(checkpoint_check_dest(path("no/such/"), &e), 0);
  cr_assert(strstr(e.msg, "/no: No such file or directory"), "%s", e.msg);
  FILE *f = fopen(path("file"), "w");
  cr_assert_not_null(f);
  fclose(f);
  cr_assert_neq(checkpoint_check_dest(path("file/"), &e), 0);
  cr_assert(strstr(e.msg, "exists and is not a directory"), "%s", e.msg);
  cr_assert_neq(checkpoint_check_dest(path("file/x.safetensors"), &e), 0);
  cr_assert(strstr(e.msg, "is not a directory") || strstr(e.msg, "Not a directory"), "%s", e.msg);
  cr_assert_eq(mkfifo(path("fifo"), 0600), 0);
  cr_assert_neq(checkpoint_check_dest(path("fifo"), &e), 0);
  cr_assert(strstr(e.msg, "is not a regular file (it is a FIFO)"), "%s", e.msg);
  cr_assert_eq(mkdir(path("sub"), 0755), 0);
  snprintf(p, sizeof p, "%s/sub", dir); /* an existing directory, without the slash */
  cr_assert_eq(checkpoint_check_dest(p, &e), 0, "%s", e.msg);
  memset(p, 'a', sizeof p - 1);
  p[sizeof p - 1] = '\0';
  cr_assert_neq(checkpoint_check_dest(p, &e), 0);
  cr_assert(strstr(e.msg, "too long"), "%s", e.msg);
  cr_assert_neq(checkpoint_check_dest("", &e), 0);
}

/* ---- checkpoints written by release 0.1 (tests/data, see its README) ------------ */

/* One tensor of a release-0.1 file as that release wrote it: where it
 * belongs (elements from the start of the flat parameter buffer, or of the
 * optimizer state), its size, the bits of its first and last elements and
 * the sum of its elements, read from the file by a separate script (not by
 * rumor's reader) when the file was made. */
struct old_tensor {
  const char *name;
  bool state; /* optimizer state rather than a parameter */
  int64_t offset, numel;
  uint32_t first, last;
  double sum;
};

struct old_ckpt {
  const char *file;
  enum optim_kind kind;
  int64_t step, samples;
  struct old_tensor t[6];
};

/* mlp:784-16-10 (12730 parameters): layers.0 16×784 + 16, layers.1 10×16 + 10.
 * SGD keeps one state float per parameter, AdamW two (exp_avg, then
 * exp_avg_sq). All four were written by `rumor train --model mlp:784-16-10
 * --epochs 1 --batch 32 --max-steps 3` (or 5) of commit d71a2d9. */
#define OLD_P 12730
static const struct old_ckpt old_ckpts[] = {
    {"ckpt-0.1-mlp-sgd.safetensors", OPTIM_SGD, 3, 96,
     {{"layers.0.weight", false, 0, 12544, 0xbd0dbd9au, 0xbd0e6a0eu, 1.1699514126012218},
      {"layers.0.bias", false, 12544, 16, 0xbb96a4acu, 0x3ceba7fcu, -0.031823548953980207},
      {"layers.1.weight", false, 12560, 160, 0xbc076bfbu, 0xbdbec7b7u, 0.92483818111941218},
      {"layers.1.bias", false, 12720, 10, 0xbe107763u, 0x3e6d45abu, -0.37238112837076187},
      {"optimizer.momentum", true, 0, OLD_P, 0x3d326c49u, 0x3e27a910u, -12.935327115959808}}},
    {"ckpt-0.1-mlp-adamw.safetensors", OPTIM_ADAMW, 3, 96,
     {{"layers.0.weight", false, 0, 12544, 0x3d5dca88u, 0xbd28ce7au, 94.885508932566154},
      {"layers.0.bias", false, 12544, 16, 0xbdbfef22u, 0x3d0dd873u, -0.88431472703814507},
      {"layers.1.weight", false, 12560, 160, 0x3ce8307bu, 0xbda6c5e4u, -0.47386961989104748},
      {"layers.1.bias", false, 12720, 10, 0xbe18cf69u, 0x3e528958u, -0.020897343754768372},
      {"optimizer.exp_avg", true, 0, OLD_P, 0xba842a9au, 0xb9f953c8u, -4.9192217856185039},
      {"optimizer.exp_avg_sq", true, OLD_P, OLD_P, 0x34df238cu, 0x372c02c8u, 0.45370846873604531}}},
    {"ckpt-0.1-mlp-sgd-step5.safetensors", OPTIM_SGD, 5, 160,
     {{"layers.0.weight", false, 0, 12544, 0xbd1fc9d3u, 0xbd06c1acu, -3.3734219782054424},
      {"layers.0.bias", false, 12544, 16, 0x3a5c651cu, 0x3cd8c113u, -0.011287201312370598},
      {"layers.1.weight", false, 12560, 160, 0xbc5fc526u, 0xbdc0515du, 0.92483831476420164},
      {"layers.1.bias", false, 12720, 10, 0xbe109170u, 0x3e5f8112u, -0.37238113582134247},
      {"optimizer.momentum", true, 0, OLD_P, 0x3d4046bcu, 0x3e0b7b85u, 50.058373908963404}}},
    {"ckpt-0.1-mlp-adamw-step5.safetensors", OPTIM_ADAMW, 5, 160,
     {{"layers.0.weight", false, 0, 12544, 0x3d9bfddbu, 0xbd1f58dcu, 119.17113585409243},
      {"layers.0.bias", false, 12544, 16, 0xbded07b9u, 0x3d0462d7u, -1.4391243616119027},
      {"layers.1.weight", false, 12560, 160, 0xbc8cd571u, 0xbd7380d1u, -1.063213418237865},
      {"layers.1.bias", false, 12720, 10, 0xbe2b326au, 0x3e621162u, 0.099855354055762291},
      {"optimizer.exp_avg", true, 0, OLD_P, 0xba564ba2u, 0xbb3532abu, 0.89649805289764117},
      {"optimizer.exp_avg_sq", true, OLD_P, OLD_P, 0x34e04372u, 0x37357288u, 0.95469905661096122}}},
};

static uint32_t float_bits(float f) {
  uint32_t u;
  memcpy(&u, &f, sizeof u);
  return u;
}

/* Index of the first element where a and b differ in any bit, or -1. */
static int64_t first_bit_difference(const float *a, const float *b, int64_t n) {
  for (int64_t i = 0; i < n; i++)
    if (float_bits(a[i]) != float_bits(b[i])) return i;
  return -1;
}

/* Asserts that `got` (n floats) equals the file's tensor bit for bit. */
static void expect_bits(const char *file, const char *what, const float *got, const struct st_tensor *t, int64_t n) {
  const float *want = t->data;
  int64_t bad = first_bit_difference(got, want, n);
  cr_assert_eq(bad, -1, "%s: %s element %lld is %.9g (0x%08x), the file holds %.9g (0x%08x)", file, what,
               (long long)bad, bad >= 0 ? got[bad] : 0.0, bad >= 0 ? float_bits(got[bad]) : 0u,
               bad >= 0 ? want[bad] : 0.0, bad >= 0 ? float_bits(want[bad]) : 0u);
}

static void check_old_checkpoint(const struct old_ckpt *oc) {
  char p[512];
  snprintf(p, sizeof p, "%s/tests/data/%s", RUMOR_SOURCE_DIR, oc->file);
  struct checkpoint ck;
  struct rumor_err e;
  cr_assert_eq(checkpoint_open(p, &ck, &e), 0, "a release-0.1 checkpoint no longer opens: %s", e.msg);

  /* What the file says about itself. */
  char spec[MODEL_SPEC_MAX];
  model_spec_format(&ck.info.spec, spec, sizeof spec);
  cr_assert_str_eq(spec, "mlp:784-16-10", "%s: model %s", oc->file, spec);
  cr_assert_eq(ck.table.nparams, OLD_P, "%s: %lld parameters", oc->file, (long long)ck.table.nparams);
  cr_assert_eq(ck.info.st.step, oc->step, "%s: step %lld", oc->file, (long long)ck.info.st.step);
  cr_assert_eq(ck.info.st.epoch, 0);
  cr_assert_eq(ck.info.st.step_in_epoch, oc->step);
  cr_assert_eq(ck.info.st.samples, oc->samples, "%s: %lld samples", oc->file, (long long)ck.info.st.samples);
  cr_assert_eq(ck.info.optim_kind, oc->kind, "%s: optimizer %s", oc->file, optim_kind_name(ck.info.optim_kind));
  cr_assert(ck.has_optim, "%s: optimizer state not found", oc->file);
  cr_assert(ck.info.seed == 1 && ck.info.data_seed == 1, "%s: seeds", oc->file);
  cr_assert(ck.info.shard.index == 0 && ck.info.shard.count == 1, "%s: shard", oc->file);
  cr_assert_eq(ck.info.batch, 32);
  cr_assert_eq(ck.info.norm_mean, 0.28604059698879547, "%s: norm_mean %.17g", oc->file, ck.info.norm_mean);
  cr_assert_eq(ck.info.norm_std, 0.3530242445149227, "%s: norm_std %.17g", oc->file, ck.info.norm_std);
  cr_assert_eq(ck.info.stages, 0, "%s: read as a pipeline stage's checkpoint", oc->file);

  /* The tensors as the reader sees them against the numbers taken from
   * the raw file. */
  for (int i = 0; i < 6 && oc->t[i].name; i++) {
    const struct old_tensor *ot = &oc->t[i];
    const struct st_tensor *t = safetensors_find(&ck.file, ot->name);
    cr_assert_not_null(t, "%s: no tensor %s", oc->file, ot->name);
    cr_assert_eq(t->nbytes, (size_t)ot->numel * sizeof(float), "%s: %s has %zu bytes", oc->file, ot->name, t->nbytes);
    const float *v = t->data;
    cr_assert(float_bits(v[0]) == ot->first && float_bits(v[ot->numel - 1]) == ot->last,
              "%s: %s starts 0x%08x, ends 0x%08x; want 0x%08x, 0x%08x", oc->file, ot->name, float_bits(v[0]),
              float_bits(v[ot->numel - 1]), ot->first, ot->last);
    double sum = 0;
    for (int64_t j = 0; j < ot->numel; j++) sum += v[j];
    cr_assert(fabs(sum - ot->sum) <= 1e-12 + 1e-12 * fabs(ot->sum), "%s: %s sums to %.17g, want %.17g", oc->file,
              ot->name, sum, ot->sum);
  }

  /* Restored into a fresh model and optimizer (poisoned with NaN first, so
   * an element not restored shows), and read out with checkpoint_params:
   * every element equals the file's, bit for bit, at its written-out place. */
  struct model m;
  struct optim o;
  struct optim_config cfg;
  optim_config_default(&cfg);
  cfg.kind = oc->kind;
  cr_assert_eq(model_init_full(&m, &ck.info.spec, be, 8, &e), 0, "%s", e.msg);
  cr_assert_eq(optim_init(&o, &cfg, &m, &e), 0, "%s", e.msg);
  tensor_fill(&m.params, NAN);
  tensor_fill(&o.state, NAN);
  cr_assert_eq(checkpoint_restore(&ck, &m, &o, &e), 0, "%s: %s", oc->file, e.msg);
  cr_assert_eq(o.step, oc->step, "%s: optimizer step %lld", oc->file, (long long)o.step);
  int nstate = oc->kind == OPTIM_ADAMW ? 2 : 1;
  cr_assert_eq(tensor_numel(&o.state), nstate * OLD_P);
  float *params = xmalloc(OLD_P * sizeof(float)), *state = xmalloc((size_t)nstate * OLD_P * sizeof(float));
  float *flat = xmalloc(OLD_P * sizeof(float));
  tensor_copy_to_host(&m.params, 0, params, OLD_P * sizeof(float));
  tensor_copy_to_host(&o.state, 0, state, (size_t)nstate * OLD_P * sizeof(float));
  checkpoint_params(&ck, flat);
  int64_t covered = 0;
  for (int i = 0; i < 6 && oc->t[i].name; i++) {
    const struct old_tensor *ot = &oc->t[i];
    const struct st_tensor *t = safetensors_find(&ck.file, ot->name);
    char what[128];
    snprintf(what, sizeof what, "restored %s", ot->name);
    expect_bits(oc->file, what, (ot->state ? state : params) + ot->offset, t, ot->numel);
    if (!ot->state) {
      snprintf(what, sizeof what, "checkpoint_params' %s", ot->name);
      expect_bits(oc->file, what, flat + ot->offset, t, ot->numel);
    }
    covered += ot->numel;
  }
  cr_assert_eq(covered, (1 + nstate) * OLD_P, "the table above misses elements");
  free(params), free(state), free(flat);
  optim_free(&o), model_free(&m);
  checkpoint_close(&ck);
}

Test(checkpoint, release_0_1_sgd_checkpoint_opens_and_restores_bit_for_bit) {
  check_old_checkpoint(&old_ckpts[0]);
  check_old_checkpoint(&old_ckpts[2]);
}

Test(checkpoint, release_0_1_adamw_checkpoint_opens_and_restores_bit_for_bit) {
  check_old_checkpoint(&old_ckpts[1]);
  check_old_checkpoint(&old_ckpts[3]);
}
