/* Checkpoints: a round trip restores parameters, optimizer state and the
 * training position exactly; truncated or bit-flipped files (anywhere: the
 * length prefix, the JSON header, the data) are rejected with a message, and
 * the writer leaves no temporary file behind. */
#include <criterion/criterion.h>
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
    _exit(rc != 0 && strstr(e.msg, "File too large") ? 0 : 1);
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
