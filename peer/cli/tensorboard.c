/* --tensorboard DIR: the figures of a training process (rumor train, peer,
 * a group's stages) and of `rumor top` as TensorBoard scalars
 * (util/tfevents.h). The tags are listed in docs/operating.md. */
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "gossip/monitor.h"
#include "peer/cli/cli_impl.h"

/* Loss figures at most this often, everything else at most every
 * TB_ALL_S: a peer stepping at kHz writes a few KB a second, not a record
 * per step. Evaluations, epoch ends, the first and the last step are
 * always written. */
#define TB_LOSS_S 0.1
#define TB_ALL_S 1.0
/* The parameter norm costs a pass over the parameters: it is measured at
 * most every TB_ALL_S and at most 1 % of the time (every 100 times what
 * the last measurement took), and at every step that is always written. */
#define TB_NORM_COST_SHARE 100.0

void tb_run_name(const char *name, char *out, size_t n) {
  bool changed = strlen(name) >= n;
  snprintf(out, n, "%s", name);
  for (char *c = out; *c; c++)
    if (*c == '/' || *c == '\\') *c = '_', changed = true;
  if (!out[0] || strcmp(out, ".") == 0 || strcmp(out, "..") == 0) {
    snprintf(out, n, "_");
    changed = true;
  }
  if (strlen(name) >= n) { /* cut: not inside a character (name[k] is the first byte left out) */
    size_t k = strlen(out);
    while (k > 0 && ((unsigned char)name[k] & 0xC0) == 0x80) k--;
    out[k] = '\0';
  }
  if (!changed || n <= 16) return; /* no room for the hash: tb_member_name's names never change */
  /* Names that the replacements or the cut made equal ("a/b" and "a_b")
   * stay apart: the original's FNV-1a hash is appended. */
  uint32_t h = 2166136261u;
  for (const unsigned char *c = (const unsigned char *)name; *c; c++) h = (h ^ *c) * 16777619u;
  size_t keep = strlen(out);
  if (keep > n - 10) keep = n - 10;
  while (keep > 0 && ((unsigned char)out[keep] & 0xC0) == 0x80) keep--; /* not inside a character */
  snprintf(out + keep, n - keep, "-%08x", (unsigned)h);
}

void tb_member_name(const char *id, char *out, size_t n) {
  char s[TB_MEMBER_ID_CHARS + 1];
  size_t len = strnlen(id, TB_MEMBER_ID_CHARS); /* the first characters name the member */
  memcpy(s, id, len);
  s[len] = '\0';
  for (char *c = s; *c; c++) {
    if (*c == '/') *c = '_';
    else if (*c == '+') *c = '-';
  }
  tb_run_name(s, out, n);
}

int tb_train_open(struct tb_train *tb, const char *dir, const char *name, struct rumor_err *e) {
  memset(tb, 0, sizeof *tb);
  char run[TB_RUN_MAX + 1];
  tb_run_name(name, run, sizeof run);
  tb->w = tb_open(dir, run, e);
  if (!tb->w) return rumor_err_prefix(e, "--tensorboard %s", dir);
  tb->all_step = tb->loss_step = tb->eval_step = -1;
  log_info("tensorboard: writing %s", tb_path(tb->w));
  return 0;
}

/* train/loss and train/loss_avg, where the loss is. */
static void write_loss(struct tb_train *tb, const struct trainer *t) {
  int64_t step = t->st.step;
  tb_scalar(tb->w, "train/loss", step, t->last_loss);
  tb_scalar(tb->w, "train/loss_avg", step, t->loss_avg);
  tb->loss_step = step;
}

/* The exchange figures of a gossip member (counts since it started). */
static void write_gossip(struct tb_train *tb, int64_t step) {
  const struct member *mb = tb->mb;
  if (!mb || !mb->g) return; /* no member, or it has left */
  struct gossip_stats gs;
  gossip_stats_get(mb->g, &gs);
  struct sync_figures sf = {0};
  if (mb->have_sync) sync_figures(&mb->sync, &sf);
  const struct {
    const char *tag;
    double v;
  } f[] = {
      {"gossip/exchanges", (double)gs.exchanges_ok},
      {"gossip/exchanges_failed", (double)gs.exchanges_failed},
      {"gossip/exchanges_rejected", (double)gs.exchanges_rejected},
      {"gossip/exchanges_clipped", (double)sf.clipped},
      {"gossip/bytes_in", (double)gs.bytes_in},
      {"gossip/bytes_out", (double)gs.bytes_out},
      {"gossip/members_alive", (double)gs.members_alive},
  };
  for (size_t i = 0; i < sizeof f / sizeof f[0]; i++) tb_scalar(tb->w, f[i].tag, step, f[i].v);
  if (!mb->have_sync) return;
  if (mb->sync.cfg.kind == SYNC_ALLREDUCE) {
    tb_scalar(tb->w, "allreduce/rounds", step, (double)sf.ring_rounds);
    tb_scalar(tb->w, "allreduce/retries", step, (double)sf.ring_retries);
  }
  if (mb->sync.cfg.outer.kind != OUTER_NONE) {
    tb_scalar(tb->w, "outer/round", step, (double)sf.outer_rounds);
    if (isfinite(sf.outer_norm)) tb_scalar(tb->w, "outer/pseudo_gradient_norm", step, sf.outer_norm);
    tb_scalar(tb->w, "outer/bytes_per_round", step, sf.outer_bytes);
    tb_scalar(tb->w, "outer/wait_s", step, sf.outer_wait_s);
  }
}

/* Everything but the evaluation: the learning rate, the throughput since
 * the last such write, the parameter norm (when due) and the gossip
 * figures. */
static void write_all(struct tb_train *tb, const struct trainer *t, double now, bool force_norm) {
  int64_t step = t->st.step;
  if (tb->rate_s == 0) {
    tb->rate_s = t->t_start;
    tb->rate_samples = t->samples_at_start;
  }
  tb_scalar(tb->w, "train/lr", step, optim_lr_at(&t->cfg.optim, step > 0 ? step - 1 : 0, t->total_steps));
  double dt = now - tb->rate_s;
  if (dt > 0) {
    double rows_per_s = (double)(t->st.samples - tb->rate_samples) / dt;
    if (t->data.tokens) tb_scalar(tb->w, "train/tokens_per_s", step, rows_per_s * (double)t->data.context);
    else tb_scalar(tb->w, "train/samples_per_s", step, rows_per_s);
    tb->rate_s = now;
    tb->rate_samples = t->st.samples;
  }
  tb_scalar(tb->w, "train/epoch", step, (double)t->st.epoch);
  if (isfinite(t->grad_norm)) tb_scalar(tb->w, "train/grad_norm", step, t->grad_norm); /* --grad-clip only */
  if (t->moe.experts) { /* a mixture of experts: its last step's figures */
    tb_scalar(tb->w, "moe/aux_loss", step, t->moe.aux_loss);
    tb_scalar(tb->w, "moe/z_loss", step, t->moe.z_loss);
    tb_scalar(tb->w, "moe/dropped_fraction", step, t->moe.dropped_fraction);
    for (int x = 0; x < t->moe.experts; x++) {
      char tag[32];
      snprintf(tag, sizeof tag, "moe/expert_load/%d", x);
      tb_scalar(tb->w, tag, step, t->moe.load[x]);
    }
  }
  if (force_norm || now >= tb->next_norm_s) {
    double c0 = clock_now_s();
    double norm = sqrt(tensor_sq_norm(&t->model.params));
    double cost = clock_now_s() - c0;
    tb_scalar(tb->w, "train/param_norm", step, norm);
    tb->next_norm_s = now + fmax(TB_ALL_S, TB_NORM_COST_SHARE * cost);
  }
  write_gossip(tb, step);
  tb->all_step = step;
  tb->next_all_s = now + TB_ALL_S;
}

/* The train_observer (train.h). */
static void observe(void *arg, const struct trainer *t, bool evaluated) {
  struct tb_train *tb = arg;
  double now = clock_now_s();
  int64_t step = t->st.step;
  bool loss = trainer_has_loss(t), wrote = false;
  /* Steps that are always written: an evaluation, an epoch's end, the
   * first and the last. */
  bool mark = evaluated || t->st.step_in_epoch == 0 || trainer_done(t) || tb->all_step < 0;
  /* An evaluation repeated on the same parameters (rumor train's final
   * one after the last epoch's) is not written twice. */
  bool again = step == tb->eval_step && t->test_loss == tb->eval_loss && t->accuracy == tb->eval_accuracy;
  if (evaluated && loss && !again) {
    /* The names of the result line's figures. */
    tb_scalar(tb->w, t->data.tokens ? "eval/val_loss" : "eval/test_loss", step, t->test_loss);
    tb_scalar(tb->w, t->data.tokens ? "eval/val_token_accuracy" : "eval/test_accuracy", step, t->accuracy);
    tb->eval_step = step;
    tb->eval_loss = t->test_loss;
    tb->eval_accuracy = t->accuracy;
    wrote = true;
  }
  if (loss && step != tb->loss_step && (mark || now >= tb->next_loss_s)) {
    write_loss(tb, t);
    tb->next_loss_s = now + TB_LOSS_S;
    wrote = true;
  }
  if (step != tb->all_step && (mark || now >= tb->next_all_s)) {
    write_all(tb, t, now, mark);
    wrote = true;
  }
  if (wrote) tb_flush(tb->w);
}

void tb_train_attach(struct tb_train *tb, struct trainer *t, const struct member *mb) {
  if (!tb->w) return;
  tb->mb = mb;
  t->observer = (struct train_observer){observe, tb};
}

void tb_train_close(struct tb_train *tb) {
  tb_close(tb->w);
  tb->w = NULL;
}

/* ---- rumor top ---- */

void tb_top_write(tb_writer_t *w, int64_t refresh, const struct gossip_cluster_report *r, double mean_loss) {
  /* Figures that do not exist (Ξ with fewer than two sketches) are left
   * out rather than written as NaN. */
  const struct {
    const char *tag;
    double v;
  } c[] = {
      {"cluster/xi", r->xi},
      {"cluster/xi_rel", r->rel_drift},
      {"cluster/mean_norm", r->mean_norm},
      {"cluster/xi_exact", r->exact_n ? r->xi_exact : NAN},
      {"cluster/mean_loss", mean_loss},
  };
  for (size_t i = 0; i < sizeof c / sizeof c[0]; i++)
    if (isfinite(c[i].v)) tb_scalar(w, c[i].tag, refresh, c[i].v);
  size_t alive = 0;
  for (size_t i = 0; i < r->n; i++) alive += strcmp(r->nodes[i].state, "alive") == 0;
  tb_scalar(w, "cluster/members_alive", refresh, (double)alive);
  tb_scalar(w, "cluster/peers_reachable", refresh, (double)r->reachable_peers);
  for (size_t i = 0; i < r->n; i++) {
    const struct gossip_node_report *nd = &r->nodes[i];
    if (!nd->reachable || strcmp(nd->role, "bootstrap") == 0) continue;
    char name[TB_MEMBER_ID_CHARS + 1], tag[TB_MEMBER_ID_CHARS + 32];
    tb_member_name(nd->id, name, sizeof name);
    snprintf(tag, sizeof tag, "member/%s/exchanges", name);
    tb_scalar(w, tag, refresh, (double)nd->exchanges_ok);
    if (!nd->have_train) continue;
    snprintf(tag, sizeof tag, "member/%s/step", name);
    tb_scalar(w, tag, refresh, (double)nd->step);
    snprintf(tag, sizeof tag, "member/%s/loss", name);
    if (isfinite(nd->loss)) tb_scalar(w, tag, refresh, nd->loss);
  }
  tb_flush(w);
}
