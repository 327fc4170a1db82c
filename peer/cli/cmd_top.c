/*
 * `rumor top`: a live view of a cluster — one row per member with its
 * training and exchange figures, and the consensus distance Ξ between the
 * replicas, estimated from count-sketches (or computed exactly with
 * --exact). Also a one-shot JSON snapshot for scripts, a CSV time series and
 * a chart of Ξ and loss over time.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gossip/monitor.h"
#include "peer/cli/cli_impl.h"
#include "util/json_text.h"

/* ---- the series kept between polls ------------------------------------------ */

struct history {
  size_t n, cap;
  double *t, *xi, *xi_exact, *rel, *loss;
};

static void history_push(struct history *h, const struct gossip_cluster_report *r, double mean_loss) {
  if (h->n == h->cap) {
    h->cap = h->cap ? 2 * h->cap : 64;
    h->t = xrealloc(h->t, h->cap * sizeof *h->t);
    h->xi = xrealloc(h->xi, h->cap * sizeof *h->xi);
    h->xi_exact = xrealloc(h->xi_exact, h->cap * sizeof *h->xi_exact);
    h->rel = xrealloc(h->rel, h->cap * sizeof *h->rel);
    h->loss = xrealloc(h->loss, h->cap * sizeof *h->loss);
  }
  h->t[h->n] = r->time_s;
  h->xi[h->n] = r->xi;
  h->xi_exact[h->n] = r->xi_exact;
  h->rel[h->n] = r->rel_drift;
  h->loss[h->n] = mean_loss;
  h->n++;
}

static void history_free(struct history *h) {
  free(h->t);
  free(h->xi);
  free(h->xi_exact);
  free(h->rel);
  free(h->loss);
  memset(h, 0, sizeof *h);
}

/* Mean of the reachable peers' loss averages (NaN when none reported). */
static double mean_loss_of(const struct gossip_cluster_report *r) {
  double sum = 0;
  size_t k = 0;
  for (size_t i = 0; i < r->n; i++) {
    const struct gossip_node_report *nd = &r->nodes[i];
    if (nd->reachable && nd->have_train && isfinite(nd->loss)) {
      sum += nd->loss;
      k++;
    }
  }
  return k ? sum / (double)k : NAN;
}

/* ---- JSON (util/json_text.h: figures that do not exist are null) ---------- */

/* An integer figure, or null when the node did not report it. */
static json_t *int_or_null(bool have, int64_t v) { return have ? json_integer(v) : json_null(); }

/* The part of a replica a member holds, from its model label: "stage 0/2
 * layers 0-3 of 0,4,8" for a pipeline stage, "shard dp 1/2 tp 0/2" for a
 * data- or tensor-parallel process (train_stage_label, cmd_stage.c's
 * shard_label); "" for a whole replica. */
static const char *part_of(const char *model) {
  const char *p = strstr(model, " stage ");
  if (!p) p = strstr(model, " shard ");
  return p ? p + 1 : "";
}

static json_t *json_node(const struct gossip_node_report *nd) {
  bool t = nd->reachable && nd->have_train;
  json_t *o = json_object();
  json_text_set(o, "id", json_text_str(nd->id));
  json_text_set(o, "addr", json_text_str(nd->addr));
  json_text_set(o, "role", json_text_str(nd->role));
  json_text_set(o, "state", json_text_str(nd->state));
  json_text_set(o, "reachable", json_boolean(nd->reachable));
  json_text_set(o, "error", json_text_str(nd->error));
  json_text_set(o, "rtt_ms", json_text_real(nd->reachable ? nd->rtt_ms : NAN));
  json_text_set(o, "ready", json_boolean(nd->ready));
  json_text_set(o, "finished", json_boolean(nd->reachable && nd->finished));
  json_text_set(o, "model", json_text_str(nd->model));
  json_text_set(o, "nparams", json_integer((json_int_t)nd->nparams));
  json_text_set(o, "step", int_or_null(t, nd->step));
  json_text_set(o, "epoch", int_or_null(t, nd->epoch));
  json_text_set(o, "samples", int_or_null(t, nd->samples));
  json_text_set(o, "loss", json_text_real(t ? nd->loss : NAN));
  json_text_set(o, "samples_per_s", json_text_real(t ? nd->samples_per_s : NAN));
  json_text_set(o, "param_norm", json_text_real(t ? nd->param_norm : NAN));
  json_text_set(o, "peak_rss_bytes", int_or_null(t && nd->peak_rss_bytes > 0, nd->peak_rss_bytes));
  json_text_set(o, "part", json_text_str(part_of(nd->model)));
  if (t && nd->moe_experts > 0) { /* a mixture of experts' last step */
    json_t *load = json_array();
    for (int x = 0; x < nd->moe_experts; x++) json_text_push(load, json_text_real(nd->moe_load[x]));
    json_text_set(o, "expert_load", load);
    json_text_set(o, "moe_dropped_fraction", json_text_real(nd->moe_dropped));
    json_text_set(o, "moe_aux_loss", json_text_real(nd->moe_aux_loss));
  }
  json_text_set(o, "exchanges_ok", json_integer((json_int_t)nd->exchanges_ok));
  json_text_set(o, "exchanges_failed", json_integer((json_int_t)nd->exchanges_failed));
  json_text_set(o, "exchanges_rejected", json_integer((json_int_t)nd->exchanges_rejected));
  json_text_set(o, "donations", json_integer((json_int_t)nd->donations));
  json_text_set(o, "last_failure", json_text_str(nd->last_failure));
  json_text_set(o, "last_exchange_age_s",
                json_text_real(nd->reachable && nd->last_exchange_age_s >= 0 ? nd->last_exchange_age_s : NAN));
  json_text_set(o, "bytes_in", json_integer((json_int_t)nd->bytes_in));
  json_text_set(o, "bytes_out", json_integer((json_int_t)nd->bytes_out));
  json_text_set(o, "exchange_bytes_out", json_integer((json_int_t)nd->exchange_bytes_out));
  json_text_set(o, "exchange_bytes_in", json_integer((json_int_t)nd->exchange_bytes_in));
  json_text_set(o, "relayed_links", json_integer((json_int_t)nd->relayed_links));
  json_text_set(o, "relayed_bytes", json_integer((json_int_t)nd->relayed_bytes));
  json_text_set(o, "relay_forwarded_bytes", json_integer((json_int_t)nd->relay_bytes));
  json_text_set(o, "relay_via", json_text_str(nd->via));
  json_text_set(o, "members", json_integer((json_int_t)nd->members));
  json_text_set(o, "sync", json_text_str(nd->sync));
  bool ar = strcmp(nd->sync, "allreduce") == 0;
  json_text_set(o, "round", int_or_null(ar, (int64_t)nd->round));
  json_text_set(o, "ring_members", int_or_null(ar, (int64_t)nd->ring_members));
  json_text_set(o, "rounds_failed", int_or_null(ar, (int64_t)nd->rounds_failed));
  bool outer = nd->outer_round >= 0;
  json_text_set(o, "outer_round", int_or_null(outer, nd->outer_round));
  json_text_set(o, "outer_norm", json_text_real(outer ? nd->outer_norm : NAN));
  json_text_set(o, "outer_bytes_round", json_text_real(outer ? nd->outer_bytes : NAN));
  json_text_set(o, "outer_wait_s", json_text_real(outer ? nd->outer_wait_s : NAN));
  json_text_set(o, "stats_age_s", json_text_real(nd->reachable ? nd->stats_age_s : NAN));
  json_text_set(o, "sketch_k", json_integer(nd->sketch_k));
  if (nd->params || nd->params_error[0]) {
    json_t *x = json_object();
    json_text_set(x, "have_params", json_boolean(nd->params != NULL));
    json_text_set(x, "step", json_integer((json_int_t)nd->params_step));
    json_text_set(x, "error", json_text_str(nd->params_error));
    json_text_set(o, "exact", x);
  }
  return o;
}

/* A snapshot as one object: what --json prints, and what the web view
 * serves with more keys after these. Its "time" is a unix time (print it with
 * json_text_dump_times). */
static json_t *json_report(const struct gossip_cluster_report *r, double mean_loss) {
  json_t *o = json_object();
  json_text_set(o, "time", json_text_time(r->time_s));
  json_text_set(o, "via", json_text_str(r->via));
  json_text_set(o, "members", json_integer((json_int_t)r->n));
  json_text_set(o, "peers", json_integer((json_int_t)r->peers));
  json_text_set(o, "reachable_peers", json_integer((json_int_t)r->reachable_peers));
  json_t *d = json_object();
  json_text_set(d, "n", json_integer((json_int_t)r->drift_n));
  json_text_set(d, "xi", json_text_real(r->xi));
  json_text_set(d, "rel_drift", json_text_real(r->rel_drift));
  json_text_set(d, "mean_norm", json_text_real(r->mean_norm));
  json_text_set(d, "exact_n", json_integer((json_int_t)r->exact_n));
  json_text_set(d, "xi_exact", json_text_real(r->xi_exact));
  json_text_set(d, "note", json_text_str(r->drift_note));
  json_text_set(o, "drift", d);
  json_text_set(o, "mean_loss", json_text_real(mean_loss));
  json_t *nodes = json_array();
  for (size_t i = 0; i < r->n; i++) json_text_push(nodes, json_node(&r->nodes[i]));
  json_text_set(o, "nodes", nodes);
  return o;
}

static void print_json(FILE *f, const struct gossip_cluster_report *r, double mean_loss) {
  json_t *o = json_report(r, mean_loss);
  char *text = json_text_dump_times(o, NULL);
  fprintf(f, "%s\n", text);
  fflush(f);
  free(text);
  json_decref(o);
}

/* The most points of history the web view is sent (at the default 2 s: the
 * last 2 hours and 40 minutes). */
#define TOP_WEB_HISTORY 4800

/* v[from..n) as an array of reals (null where a figure did not exist). */
static json_t *json_series(const double *v, size_t from, size_t n, json_t *(*real)(double)) {
  json_t *a = json_array();
  for (size_t i = from; i < n; i++) json_text_push(a, real(v[i]));
  return a;
}

/* Hands the web view its /state.json: the --json snapshot with the refresh
 * interval and the series of the charts ("history": times, sketch and exact
 * Ξ, mean loss; null where a figure did not exist). */
static void web_update(struct top_web *w, const struct gossip_cluster_report *r, double mean_loss,
                       const struct history *h, double interval_s) {
  json_t *o = json_report(r, mean_loss);
  json_text_set(o, "interval_s", json_text_real(interval_s));
  size_t from = h->n > TOP_WEB_HISTORY ? h->n - TOP_WEB_HISTORY : 0;
  json_t *hist = json_object();
  json_text_set(hist, "time", json_series(h->t, from, h->n, json_text_time));
  json_text_set(hist, "xi", json_series(h->xi, from, h->n, json_text_real));
  json_text_set(hist, "xi_exact", json_series(h->xi_exact, from, h->n, json_text_real));
  json_text_set(hist, "mean_loss", json_series(h->loss, from, h->n, json_text_real));
  json_text_set(o, "history", hist);
  size_t len;
  char *text = json_text_dump_times(o, &len);
  top_web_set_state(w, text, len);
  free(text);
  json_decref(o);
}

/* ---- the terminal view ------------------------------------------------------ */

static const char *human_bytes(char *buf, size_t cap, uint64_t b) {
  static const char units[] = "BKMGTP";
  double v = (double)b;
  int u = 0;
  while (v >= 1024 && u < 5) {
    v /= 1024;
    u++;
  }
  if (u == 0)
    snprintf(buf, cap, "%uB", (unsigned)b); /* b < 1024 */
  else
    snprintf(buf, cap, "%.1f%c", v, units[u]);
  return buf;
}

static const char *fmt_num(char *buf, size_t cap, const char *fmt, double v) {
  if (isfinite(v))
    snprintf(buf, cap, fmt, v);
  else
    snprintf(buf, cap, "-");
  return buf;
}

static void print_view(FILE *f, const struct gossip_cluster_report *r, const struct history *h, double mean_loss,
                       double interval_s, bool clear) {
  if (clear) fputs("\033[H\033[2J", f);
  char tbuf[64], a[32], b[32], c[32];
  time_t now = (time_t)r->time_s;
  struct tm tm;
  localtime_r(&now, &tm);
  strftime(tbuf, sizeof tbuf, "%H:%M:%S", &tm);
  fprintf(f, "rumor top — %s via %s, every %.3gs; %zu members, %zu/%zu peers reachable\n", tbuf, r->via, interval_s,
          r->n, r->reachable_peers, r->peers);
  char spark[512];
  plot_sparkline(spark, sizeof spark, h->xi, h->n, 40, true);
  fprintf(f, "Ξ %s  Ξ/‖θ̄‖ %s  ‖θ̄‖ %s  over %zu replicas (sketch)", fmt_num(a, sizeof a, "%.4g", r->xi),
          fmt_num(b, sizeof b, "%.3g", r->rel_drift), fmt_num(c, sizeof c, "%.4g", r->mean_norm), r->drift_n);
  if (r->exact_n) fprintf(f, "  exact Ξ %s over %zu", fmt_num(a, sizeof a, "%.4g", r->xi_exact), r->exact_n);
  fprintf(f, "  mean loss %s\n", fmt_num(a, sizeof a, "%.4f", mean_loss));
  fprintf(f, "Ξ history %s\n", spark);
  if (r->drift_note[0]) fprintf(f, "note: %s\n", r->drift_note);
  fprintf(f, "\n%-10s %-21s %-9s %-7s %-9s %8s %8s %5s %8s %9s %7s %6s %7s %8s %8s %8s %8s %4s %9s %8s\n", "ID",
          "ADDRESS", "ROLE", "STATE", "SYNC", "ROUND", "STEP", "EPOCH", "LOSS", "SAMPLE/S", "XCHG", "FAILED", "LAST",
          "XCHG-IN", "XCHG-OUT", "IN", "OUT", "MEMB", "NORM", "PEAK-RSS");
  for (size_t i = 0; i < r->n; i++) {
    const struct gossip_node_report *nd = &r->nodes[i];
    char round[24] = "-";
    if (nd->outer_round >= 0) snprintf(round, sizeof round, "%lld", (long long)nd->outer_round);
    else if (strcmp(nd->sync, "allreduce") == 0) snprintf(round, sizeof round, "%llu", (unsigned long long)nd->round);
    /* "done": alive, past its last step, averaging with those still training. */
    const char *state = nd->reachable && nd->finished && strcmp(nd->state, "alive") == 0 ? "done" : nd->state;
    fprintf(f, "%-10.8s %-21.21s %-9.9s %-7.7s %-9.9s %8s ", nd->id, nd->addr, nd->role, state,
            nd->sync[0] ? nd->sync : "-", round);
    if (!nd->reachable) {
      const char *why = nd->error;
      if (STR_PREFIX(why, "unreachable: ")) why += STR_LEN("unreachable: ");
      fprintf(f, "UNREACHABLE: %s\n", why);
      continue;
    }
    char step[24] = "-", epoch[24] = "-";
    if (nd->have_train) {
      snprintf(step, sizeof step, "%lld", (long long)nd->step);
      snprintf(epoch, sizeof epoch, "%lld", (long long)nd->epoch);
    }
    char loss[24], sps[24], last[24], in[16], out[16], xin[16], xout[16], norm[24], rss[16] = "-";
    fmt_num(loss, sizeof loss, "%.4f", nd->have_train ? nd->loss : NAN);
    fmt_num(sps, sizeof sps, "%.0f", nd->have_train ? nd->samples_per_s : NAN);
    fmt_num(last, sizeof last, "%.1fs", nd->last_exchange_age_s >= 0 ? nd->last_exchange_age_s : NAN);
    fmt_num(norm, sizeof norm, "%.4g", nd->have_train ? nd->param_norm : NAN);
    if (nd->have_train && nd->peak_rss_bytes > 0) human_bytes(rss, sizeof rss, (uint64_t)nd->peak_rss_bytes);
    fprintf(f, "%8s %5s %8s %9s %7llu %6llu %7s %8s %8s %8s %8s %4llu %9s %8s\n", step, epoch, loss, sps,
            (unsigned long long)nd->exchanges_ok, (unsigned long long)nd->exchanges_failed, last,
            human_bytes(xin, sizeof xin, nd->exchange_bytes_in), human_bytes(xout, sizeof xout, nd->exchange_bytes_out),
            human_bytes(in, sizeof in, nd->bytes_in), human_bytes(out, sizeof out, nd->bytes_out),
            (unsigned long long)nd->members, norm, rss);
    /* A group's members share its identity (the ID column): one line each
     * for the part it holds. */
    if (part_of(nd->model)[0]) fprintf(f, "%-10s part: %s\n", "", part_of(nd->model));
    if (nd->have_train && nd->moe_experts > 0) {
      fprintf(f, "%-10s experts: %.1f%% dropped, aux loss %.4g, load", "", 100 * nd->moe_dropped, nd->moe_aux_loss);
      for (int x = 0; x < nd->moe_experts; x++) fprintf(f, " %.3f", nd->moe_load[x]);
      fputc('\n', f);
    }
    if (nd->last_failure[0]) fprintf(f, "%-10s last failure: %s\n", "", nd->last_failure);
    if (nd->relayed_links || nd->relayed_bytes || nd->relay_bytes || nd->via[0]) {
      char rb[16], fb[16];
      fprintf(f, "%-10s relays: %llu link(s) relayed, %s over relays%s%s, %s forwarded as a relay\n", "",
              (unsigned long long)nd->relayed_links, human_bytes(rb, sizeof rb, nd->relayed_bytes),
              nd->via[0] ? "; reached through " : "", nd->via, human_bytes(fb, sizeof fb, nd->relay_bytes));
    }
  }
  fflush(f);
}

/* ---- CSV and chart ------------------------------------------------------------ */

static const char CSV_HEADER[] = "unix_time,members,peers,reachable_peers,drift_n,xi,rel_drift,mean_norm,exact_n,"
                                 "xi_exact,mean_loss\n";

static void csv_num(FILE *f, double v) {
  if (isfinite(v)) fprintf(f, "%.9g", v);
}

static int csv_append(FILE *f, const char *path, const struct gossip_cluster_report *r, double mean_loss,
                      struct rumor_err *e) {
  fprintf(f, "%.3f,%zu,%zu,%zu,%zu,", r->time_s, r->n, r->peers, r->reachable_peers, r->drift_n);
  csv_num(f, r->xi);
  fputc(',', f);
  csv_num(f, r->rel_drift);
  fputc(',', f);
  csv_num(f, r->mean_norm);
  fprintf(f, ",%zu,", r->exact_n);
  csv_num(f, r->xi_exact);
  fputc(',', f);
  csv_num(f, mean_loss);
  fputc('\n', f);
  if (fflush(f) != 0 || ferror(f))
    return rumor_err_set(e, -EIO, "cannot append to %s: %s", path, strerror(errno));
  return 0;
}

/* Opens the CSV file for appending; writes the header when it is new or
 * empty, and refuses a file whose first line is a different header. */
static FILE *csv_open(const char *path, struct rumor_err *e) {
  /* A FIFO would block the header check's read below: regular files only. */
  int fd = file_open_regular(path, O_RDWR | O_CREAT | O_APPEND, 0666, NULL, e);
  if (fd < 0) {
    rumor_err_prefix(e, "--csv");
    return NULL;
  }
  FILE *f = fdopen(fd, "a+");
  if (!f) {
    rumor_err_set(e, -errno, "cannot open --csv file %s: %s", path, strerror(errno));
    close(fd);
    return NULL;
  }
  char line[512] = "";
  rewind(f);
  if (!fgets(line, sizeof line, f)) {
    fputs(CSV_HEADER, f);
    if (fflush(f) != 0) {
      rumor_err_set(e, -errno, "cannot write --csv file %s: %s", path, strerror(errno));
      fclose(f);
      return NULL;
    }
  } else if (strcmp(line, CSV_HEADER) != 0) {
    rumor_err_set(e, RUMOR_EFORMAT, "--csv file %s exists with other columns; name a new file", path);
    fclose(f);
    return NULL;
  }
  return f;
}

static int write_plot(const char *path, const struct history *h, struct rumor_err *e) {
  struct plot_series drift[] = {
      {"sketch", h->xi, 0x1f77b4},
      {"exact", h->xi_exact, 0xd62728},
  };
  struct plot_series loss[] = {{"mean loss", h->loss, 0x2ca02c}};
  bool any_exact = false;
  for (size_t i = 0; i < h->n; i++) any_exact |= isfinite(h->xi_exact[i]);
  struct plot_panel panels[] = {
      {"consensus distance Ξ (log scale)", true, drift, any_exact ? 2 : 1},
      {"training loss, mean over peers", false, loss, 1},
  };
  return plot_write(path, h->t, h->n, panels, 2, e);
}

/* ---- the command ---------------------------------------------------------- */

/* What the command line asked for. */
struct top_opts {
  double interval, exact_max_mb;
  int64_t timeout_ms, count;
  bool once, json, exact;
  const char *csv_path, *plot_path, *servers, *web;
  const char *tensorboard; /* --tensorboard DIR */
  tb_writer_t *tb;         /* its run "cluster", or NULL */
};

/* Refreshes until `count` polls, a stop signal, or (with --once) a failed
 * poll, handing every snapshot to the web view when there is one; returns
 * the exit status. */
static int watch(gossip_monitor_t *m, const struct top_opts *o, FILE *csv, struct top_web *web) {
  struct rumor_err e = {0};
  bool clear = !o->json && isatty(STDOUT_FILENO);
  struct history h = {0};
  int status = 0;
  for (int64_t k = 0; o->count == 0 || k < o->count; k++) {
    if (k) gossip_monitor_sleep(m, (uint32_t)(o->interval * 1000));
    if (atomic_load(signals_stop_flag())) break;
    struct gossip_cluster_report r;
    int rc = gossip_monitor_poll(m, &r, &e);
    if (rc == RUMOR_ECANCELED) break;
    if (rc) {
      fprintf(stderr, "rumor top: %s\n", e.msg);
      if (web) top_web_set_failure(web, (double)time(NULL), e.msg);
      if (o->once) {
        status = 1;
        break;
      }
      continue; /* live: keep asking; the cluster may come back */
    }
    double ml = mean_loss_of(&r);
    history_push(&h, &r, ml);
    if (o->json)
      print_json(stdout, &r, ml);
    else
      print_view(stdout, &r, &h, ml, o->interval, clear);
    if (web) {
      web_update(web, &r, ml, &h, o->interval);
      top_web_set_metrics(web, &r, ml);
    }
    if (o->tb) tb_top_write(o->tb, k, &r, ml);
    if (csv && csv_append(csv, o->csv_path, &r, ml, &e)) {
      fprintf(stderr, "rumor top: %s\n", e.msg);
      status = 1;
    }
    if (o->plot_path && write_plot(o->plot_path, &h, &e)) {
      fprintf(stderr, "rumor top: %s\n", e.msg);
      status = 1;
    }
    gossip_cluster_report_free(&r);
    if (status) break;
  }
  history_free(&h);
  return status;
}

/* Flags that cannot go together, or whose value is wrong before anything
 * starts: prints the reason and returns nonzero (exit 2). */
static int check_opts(const struct top_opts *o) {
  struct rumor_err plot_err = {0};
  if (o->plot_path && plot_check_path(o->plot_path, &plot_err)) {
    fprintf(stderr, "rumor top: --plot: %s\n", plot_err.msg);
    return 1;
  }
  if (o->web && o->servers) {
    fprintf(stderr, "rumor top: --web shows a gossip cluster (--bootstrap); it does not watch --servers\n");
    return 1;
  }
  struct rumor_err web_err = {0};
  if (o->web && top_web_check(o->web, &web_err)) {
    fprintf(stderr, "rumor top: %s\n", web_err.msg);
    return 1;
  }
  if (o->tensorboard && o->servers) {
    fprintf(stderr, "rumor top: --tensorboard records a gossip cluster (--bootstrap), not --servers\n");
    return 1;
  }
  return 0;
}

/* Watches a gossip cluster through its bootstrap list until the count or
 * SIGINT; owns the CSV, TensorBoard writer, monitor and web view it opens.
 * Returns the exit status. */
static int watch_cluster(struct net_keys *keys, const struct net_flags *nf, struct top_opts *o) {
  struct rumor_err e = {0};
  FILE *csv = NULL;
  if (o->csv_path && !(csv = csv_open(o->csv_path, &e))) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }
  if (o->tensorboard && !(o->tb = tb_open(o->tensorboard, "cluster", &e))) {
    fprintf(stderr, "rumor top: --tensorboard %s: %s\n", o->tensorboard, e.msg);
    if (csv) fclose(csv);
    return 1;
  }

  struct gossip_monitor_config mc;
  gossip_monitor_config_default(&mc);
  mc.identity = &keys->identity;
  mc.cluster_key = keys->cluster_key;
  mc.allow = keys->have_allow ? &keys->allow : NULL;
  mc.bootstrap = nf->bootstrap;
  mc.timeout_ms = (uint32_t)o->timeout_ms;
  mc.handshake_timeout_ms = (uint32_t)nf->handshake_timeout_ms;
  mc.heartbeat_ms = (uint32_t)nf->heartbeat_ms;
  mc.dead_after_ms = (uint32_t)nf->dead_after_ms;
  mc.exact = o->exact;
  mc.exact_max_bytes = (uint64_t)(o->exact_max_mb * 1024 * 1024);
  mc.stop = signals_stop_flag();
  gossip_monitor_t *m = NULL;
  if (gossip_monitor_open(&m, &mc, &e)) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    if (csv) fclose(csv);
    tb_close(o->tb);
    return 1;
  }
  struct top_web *web = NULL;
  if (o->web && top_web_start(m, o->web, &web, &e)) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    gossip_monitor_close(m);
    if (csv) fclose(csv);
    tb_close(o->tb);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }
  int status = watch(m, o, csv, web);
  gossip_monitor_close(m);
  top_web_free(web); /* after the monitor: its server calls into the web view */
  tb_close(o->tb);
  if (csv && fclose(csv) != 0 && !status) {
    fprintf(stderr, "rumor top: cannot close %s: %s\n", o->csv_path, strerror(errno));
    status = 1;
  }
  return status;
}

int cmd_top(int argc, char **argv) {
  struct net_flags nf;
  net_flags_default(&nf);
  struct top_opts o = {.interval = 2, .exact_max_mb = 4096, .timeout_ms = 3000};
  struct arg_spec specs[32];
  size_t n = 0;
  net_flags_specs(&nf, FLAGS_MONITOR, false, specs, &n, 31);
  const struct arg_spec own[] = {
      {"interval", ARG_FLOAT, &o.interval, "SEC", "seconds between refreshes", 0.05, 86400},
      {"timeout-ms", ARG_INT, &o.timeout_ms, "MS", "a member that has not answered by then is unreachable", 50,
       600000},
      {"once", ARG_FLAG, &o.once, NULL, "ask once, print, and exit (exit 1 when no member answers)"},
      {"count", ARG_INT, &o.count, "N", "exit after N refreshes (0: until SIGINT)", 0, 1e12},
      {"json", ARG_FLAG, &o.json, NULL, "print one JSON object per refresh instead of the table"},
      {"exact", ARG_FLAG, &o.exact, NULL, "also pull every peer's parameters and compute the exact Ξ (small models)"},
      {"exact-max-mb", ARG_FLOAT, &o.exact_max_mb, "MB", "refuse --exact above this many MB of parameters in total", 1,
       1e7},
      {"csv", ARG_STR, &o.csv_path, "FILE", "append one row per refresh (time, Ξ, Ξ/‖θ̄‖, exact Ξ, mean loss, ...)"},
      {"plot", ARG_STR, &o.plot_path, "FILE", "keep a chart of Ξ and mean loss over time in FILE (SVG; the name must end in .svg)"},
      {"web", ARG_STR, &o.web, "[HOST:]PORT",
       "serve a live web view (the table, Ξ and loss charts) at http://HOST:PORT/, its figures at "
       "/state.json and the cluster's gauges (Ξ, Ξ/‖θ̄‖, mean loss, peers) for Prometheus at /metrics; PORT "
       "alone binds 127.0.0.1, port 0 picks one (printed on stderr)"},
      {"tensorboard", ARG_STR, &o.tensorboard, "DIR",
       "write TensorBoard event files to DIR/cluster (made when missing): Ξ, Ξ/‖θ̄‖, exact Ξ, mean loss, members "
       "alive, and member/ID/loss, step, exchanges; the step axis is the refresh number, from 0"},
      {"servers", ARG_STR, &o.servers, "A,B,...",
       "watch parameter servers instead of --bootstrap's cluster (rumor ps): each one's range, version and "
       "staleness bound, and its workers' clocks"},
  };
  for (size_t i = 0; i < sizeof own / sizeof own[0]; i++) specs[n++] = own[i];
  specs[n] = (struct arg_spec){0};
  int ar = args_parse(specs, argc, argv, "rumor top --bootstrap ADDR --cluster-key FILE --identity FILE [options]",
                      "Shows every member of a cluster, refreshing like top(1): step, epoch, loss, samples/s,\n"
                      "exchanges done and failed, bytes in and out, age of the last exchange, parameter norm;\n"
                      "and in the header the consensus distance between replicas, Ξ = sqrt((1/n) Σ‖θᵢ − θ̄‖²),\n"
                      "estimated from the peers' count-sketches, with Ξ/‖θ̄‖ and a sparkline of its history.\n"
                      "A member that does not answer in time is listed as unreachable with the reason.\n"
                      "Ends on SIGINT. The monitor is not a member: it trains nothing and is never gossiped.");
  if (ar != ARGS_OK) return ar == ARGS_HELP ? 0 : 2;
  /* Connection chatter would scroll the view away; RUMOR_LOG_LEVEL overrides. */
  if (!getenv("RUMOR_LOG_LEVEL")) log_set_level(LOG_ERROR);
  log_set_name("top");
  if (!nf.bootstrap && !o.servers) {
    fprintf(stderr, "rumor top: --bootstrap ADDR is required (a bootstrap node or any member), or --servers A,B "
                    "for parameter servers\n");
    return 2;
  }
  if (nf.bootstrap && o.servers) {
    fprintf(stderr, "rumor top: give --bootstrap (a gossip cluster) or --servers (parameter servers), not both: "
                    "one view watches one of them\n");
    return 2;
  }
  if (check_opts(&o)) return 2;
  if (o.once) o.count = 1;

  struct rumor_err e = {0};
  if (net_flags_check(&nf, o.servers, false, &e)) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    return 2;
  }
  struct net_keys keys;
  if (net_flags_load_keys(&nf, &keys, &e)) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }
  if (o.servers) {
    int st = top_servers(&keys, o.servers, o.interval, o.count, o.json, (uint32_t)o.timeout_ms);
    net_keys_free(&keys);
    return st;
  }
  int status = watch_cluster(&keys, &nf, &o);
  net_keys_free(&keys);
  return status;
}
