/*
 * `rumor top`: a live view of a cluster — one row per member with its
 * training and exchange figures, and the consensus distance Ξ between the
 * replicas, estimated from count-sketches (or computed exactly with
 * --exact). Also a one-shot JSON snapshot for scripts, a CSV time series and
 * a chart of Ξ and loss over time.
 */
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "gossip/monitor.h"
#include "peer/cli/cli_impl.h"
#include "util/json.h"

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

/* ---- JSON (util/json.h: figures that do not exist are null) ---------------- */

static void kv_str(struct json_buf *b, const char *k, const char *v) {
  json_key(b, k);
  json_str(b, v);
}
static void kv_num(struct json_buf *b, const char *k, double v) {
  json_key(b, k);
  json_num(b, v);
}
static void kv_int(struct json_buf *b, const char *k, int64_t v) {
  json_key(b, k);
  json_int(b, v);
}
/* An integer figure, or null when the node did not report it. */
static void kv_int_or_null(struct json_buf *b, const char *k, bool have, int64_t v) {
  json_key(b, k);
  if (have)
    json_int(b, v);
  else
    json_null(b);
}
static void kv_bool(struct json_buf *b, const char *k, bool v) {
  json_key(b, k);
  json_bool(b, v);
}

static void json_node(struct json_buf *b, const struct gossip_node_report *nd) {
  bool t = nd->reachable && nd->have_train;
  json_obj_begin(b);
  kv_str(b, "id", nd->id);
  kv_str(b, "addr", nd->addr);
  kv_str(b, "role", nd->role);
  kv_str(b, "state", nd->state);
  kv_bool(b, "reachable", nd->reachable);
  kv_str(b, "error", nd->error);
  kv_num(b, "rtt_ms", nd->reachable ? nd->rtt_ms : NAN);
  kv_bool(b, "ready", nd->ready);
  kv_str(b, "model", nd->model);
  kv_int(b, "nparams", (int64_t)nd->nparams);
  kv_int_or_null(b, "step", t, nd->step);
  kv_int_or_null(b, "epoch", t, nd->epoch);
  kv_int_or_null(b, "samples", t, nd->samples);
  kv_num(b, "loss", t ? nd->loss : NAN);
  kv_num(b, "samples_per_s", t ? nd->samples_per_s : NAN);
  kv_num(b, "param_norm", t ? nd->param_norm : NAN);
  kv_int(b, "exchanges_ok", (int64_t)nd->exchanges_ok);
  kv_int(b, "exchanges_failed", (int64_t)nd->exchanges_failed);
  kv_int(b, "exchanges_rejected", (int64_t)nd->exchanges_rejected);
  kv_int(b, "donations", (int64_t)nd->donations);
  kv_str(b, "last_failure", nd->last_failure);
  kv_num(b, "last_exchange_age_s", nd->reachable && nd->last_exchange_age_s >= 0 ? nd->last_exchange_age_s : NAN);
  kv_int(b, "bytes_in", (int64_t)nd->bytes_in);
  kv_int(b, "bytes_out", (int64_t)nd->bytes_out);
  kv_int(b, "exchange_bytes_out", (int64_t)nd->exchange_bytes_out);
  kv_int(b, "exchange_bytes_in", (int64_t)nd->exchange_bytes_in);
  kv_int(b, "members", (int64_t)nd->members);
  kv_str(b, "sync", nd->sync);
  bool ar = strcmp(nd->sync, "allreduce") == 0;
  kv_int_or_null(b, "round", ar, (int64_t)nd->round);
  kv_int_or_null(b, "ring_members", ar, (int64_t)nd->ring_members);
  kv_int_or_null(b, "rounds_failed", ar, (int64_t)nd->rounds_failed);
  kv_num(b, "stats_age_s", nd->reachable ? nd->stats_age_s : NAN);
  kv_int(b, "sketch_k", nd->sketch_k);
  if (nd->params || nd->params_error[0]) {
    json_key(b, "exact");
    json_obj_begin(b);
    kv_bool(b, "have_params", nd->params != NULL);
    kv_int(b, "step", nd->params_step);
    kv_str(b, "error", nd->params_error);
    json_obj_end(b);
  }
  json_obj_end(b);
}

static void print_json(FILE *f, const struct gossip_cluster_report *r, double mean_loss) {
  struct json_buf b;
  json_buf_init(&b);
  json_obj_begin(&b);
  char t[32];
  int tn = snprintf(t, sizeof t, "%.3f", r->time_s); /* ms, which %.9g would drop */
  json_key(&b, "time");
  json_raw(&b, t, (size_t)tn);
  kv_str(&b, "via", r->via);
  kv_int(&b, "members", (int64_t)r->n);
  kv_int(&b, "peers", (int64_t)r->peers);
  kv_int(&b, "reachable_peers", (int64_t)r->reachable_peers);
  json_key(&b, "drift");
  json_obj_begin(&b);
  kv_int(&b, "n", (int64_t)r->drift_n);
  kv_num(&b, "xi", r->xi);
  kv_num(&b, "rel_drift", r->rel_drift);
  kv_num(&b, "mean_norm", r->mean_norm);
  kv_int(&b, "exact_n", (int64_t)r->exact_n);
  kv_num(&b, "xi_exact", r->xi_exact);
  kv_str(&b, "note", r->drift_note);
  json_obj_end(&b);
  kv_num(&b, "mean_loss", mean_loss);
  json_key(&b, "nodes");
  json_arr_begin(&b);
  for (size_t i = 0; i < r->n; i++) json_node(&b, &r->nodes[i]);
  json_arr_end(&b);
  json_obj_end(&b);
  fprintf(f, "%.*s\n", (int)b.len, b.data);
  fflush(f);
  json_buf_free(&b);
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
    snprintf(buf, cap, "%lluB", (unsigned long long)b);
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
  fprintf(f, "\n%-10s %-21s %-9s %-7s %-9s %8s %8s %5s %8s %9s %7s %6s %7s %8s %8s %8s %8s %4s %9s\n", "ID", "ADDRESS",
          "ROLE", "STATE", "SYNC", "ROUND", "STEP", "EPOCH", "LOSS", "SAMPLE/S", "XCHG", "FAILED", "LAST", "XCHG-IN", "XCHG-OUT", "IN", "OUT",
          "MEMB", "NORM");
  for (size_t i = 0; i < r->n; i++) {
    const struct gossip_node_report *nd = &r->nodes[i];
    char round[24] = "-";
    if (strcmp(nd->sync, "allreduce") == 0) snprintf(round, sizeof round, "%llu", (unsigned long long)nd->round);
    fprintf(f, "%-10.8s %-21.21s %-9.9s %-7.7s %-9.9s %8s ", nd->id, nd->addr, nd->role, nd->state,
            nd->sync[0] ? nd->sync : "-", round);
    if (!nd->reachable) {
      const char *why = nd->error;
      if (strncmp(why, "unreachable: ", 13) == 0) why += 13;
      fprintf(f, "UNREACHABLE: %s\n", why);
      continue;
    }
    char step[24] = "-", epoch[24] = "-";
    if (nd->have_train) {
      snprintf(step, sizeof step, "%lld", (long long)nd->step);
      snprintf(epoch, sizeof epoch, "%lld", (long long)nd->epoch);
    }
    char loss[24], sps[24], last[24], in[16], out[16], xin[16], xout[16], norm[24];
    fmt_num(loss, sizeof loss, "%.4f", nd->have_train ? nd->loss : NAN);
    fmt_num(sps, sizeof sps, "%.0f", nd->have_train ? nd->samples_per_s : NAN);
    fmt_num(last, sizeof last, "%.1fs", nd->last_exchange_age_s >= 0 ? nd->last_exchange_age_s : NAN);
    fmt_num(norm, sizeof norm, "%.4g", nd->have_train ? nd->param_norm : NAN);
    fprintf(f, "%8s %5s %8s %9s %7llu %6llu %7s %8s %8s %8s %8s %4llu %9s\n", step, epoch, loss, sps,
            (unsigned long long)nd->exchanges_ok, (unsigned long long)nd->exchanges_failed, last,
            human_bytes(xin, sizeof xin, nd->exchange_bytes_in), human_bytes(xout, sizeof xout, nd->exchange_bytes_out),
            human_bytes(in, sizeof in, nd->bytes_in), human_bytes(out, sizeof out, nd->bytes_out),
            (unsigned long long)nd->members, norm);
    if (nd->last_failure[0]) fprintf(f, "%-10s last failure: %s\n", "", nd->last_failure);
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
  FILE *f = fopen(path, "a+");
  if (!f) {
    rumor_err_set(e, -errno, "cannot open --csv file %s: %s", path, strerror(errno));
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
      {"consensus distance Xi (log scale)", true, drift, any_exact ? 2 : 1},
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
  const char *csv_path, *plot_path, *servers;
};

/* Refreshes until `count` polls, a stop signal, or (with --once) a failed
 * poll; returns the exit status. */
static int watch(gossip_monitor_t *m, const struct top_opts *o, FILE *csv) {
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
      {"plot", ARG_STR, &o.plot_path, "FILE", "keep a chart of Ξ and mean loss over time in FILE (.svg or .png)"},
      {"servers", ARG_STR, &o.servers, "A,B,...",
       "watch parameter servers instead (rumor ps): each one's range, version and staleness bound, and its "
       "workers' clocks"},
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
  if (o.plot_path && plot_format_of(o.plot_path) == PLOT_UNKNOWN) {
    fprintf(stderr, "rumor top: --plot %s: the file name must end in .svg or .png\n", o.plot_path);
    return 2;
  }
  if (o.once) o.count = 1;

  struct rumor_err e = {0};
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
  FILE *csv = NULL;
  if (o.csv_path && !(csv = csv_open(o.csv_path, &e))) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    net_keys_free(&keys);
    return e.code == RUMOR_EFORMAT ? 2 : 1;
  }

  struct gossip_monitor_config mc;
  gossip_monitor_config_default(&mc);
  mc.identity = &keys.identity;
  mc.cluster_key = keys.cluster_key;
  mc.allow = keys.have_allow ? &keys.allow : NULL;
  mc.bootstrap = nf.bootstrap;
  mc.timeout_ms = (uint32_t)o.timeout_ms;
  mc.handshake_timeout_ms = (uint32_t)nf.handshake_timeout_ms;
  mc.exact = o.exact;
  mc.exact_max_bytes = (uint64_t)(o.exact_max_mb * 1024 * 1024);
  mc.stop = signals_stop_flag();
  gossip_monitor_t *m = NULL;
  if (gossip_monitor_open(&m, &mc, &e)) {
    fprintf(stderr, "rumor top: %s\n", e.msg);
    net_keys_free(&keys);
    if (csv) fclose(csv);
    return 1;
  }
  int status = watch(m, &o, csv);
  gossip_monitor_close(m);
  net_keys_free(&keys);
  if (csv && fclose(csv) != 0 && !status) {
    fprintf(stderr, "rumor top: cannot close %s: %s\n", o.csv_path, strerror(errno));
    status = 1;
  }
  return status;
}
