/* plot — SVG line charts and terminal sparklines (declared in cli_impl.h, "Charts"). */
#include "peer/cli/cli_impl.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

/* Geometry in pixels. */
enum { CHART_W = 800, PANEL_H = 240, TOP = 10, BOTTOM = 34, LEFT = 76, RIGHT = 16, TITLE_H = 22 };

enum plot_format plot_format_of(const char *path) {
  size_t n = strlen(path);
  if (n > 4 && strcasecmp(path + n - 4, ".svg") == 0) return PLOT_SVG;
  if (n > 4 && strcasecmp(path + n - 4, ".png") == 0) return PLOT_PNG;
  return PLOT_UNKNOWN;
}

int plot_check_path(const char *path, struct rumor_err *e) {
  enum plot_format fmt = plot_format_of(path);
  if (fmt == PLOT_PNG)
    return rumor_err_set(e, RUMOR_EFORMAT,
                         "plot file %s: PNG charts are no longer written; name an .svg file (any browser shows it), "
                         "or watch the charts live with rumor top --web",
                         path);
  if (fmt != PLOT_SVG) return rumor_err_set(e, RUMOR_EFORMAT, "plot file %s: the name must end in .svg", path);
  return 0;
}

/* ---- drawing: SVG elements on an open stream ------------------------------ */

static void cv_line(FILE *svg, double x0, double y0, double x1, double y1, uint32_t rgb, int width) {
  fprintf(svg, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#%06x\" stroke-width=\"%d\"/>\n", x0, y0,
          x1, y1, (unsigned)rgb, width);
}

/* A polyline through n points (no NaN among them). */
static void cv_polyline(FILE *svg, const double *xs, const double *ys, size_t n, uint32_t rgb) {
  if (n == 0) return;
  fprintf(svg, "<polyline fill=\"none\" stroke=\"#%06x\" stroke-width=\"2\" points=\"", (unsigned)rgb);
  for (size_t i = 0; i < n; i++) fprintf(svg, "%s%.1f,%.1f", i ? " " : "", xs[i], ys[i]);
  fprintf(svg, "\"/>\n");
}

static void xml_escaped(FILE *f, const char *s) {
  for (; *s; s++) {
    switch (*s) {
    case '<': fputs("&lt;", f); break;
    case '>': fputs("&gt;", f); break;
    case '&': fputs("&amp;", f); break;
    case '"': fputs("&quot;", f); break;
    default: fputc(*s, f);
    }
  }
}

/* Text centred vertically on y; anchor 0 left, 1 centre, 2 right of x. The
 * viewer's sans-serif font draws it (any UTF-8). */
static void cv_text(FILE *svg, double x, double y, const char *s, int anchor, uint32_t rgb) {
  static const char *const anchors[] = {"start", "middle", "end"};
  fprintf(svg,
          "<text x=\"%.1f\" y=\"%.1f\" fill=\"#%06x\" font-family=\"sans-serif\" font-size=\"12\" "
          "text-anchor=\"%s\" dominant-baseline=\"middle\">",
          x, y, (unsigned)rgb, anchors[anchor]);
  xml_escaped(svg, s);
  fprintf(svg, "</text>\n");
}

/* ---- scales ------------------------------------------------------------ */

/* 1, 2 or 5 times a power of ten, at least `raw`. */
static double nice_step(double raw) {
  double p = pow(10, floor(log10(raw)));
  double f = raw / p;
  return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * p;
}

struct axis {
  double lo, hi; /* in plotted units (log10 of the value with log_y) */
  double step;
  bool log;
};

/* Extends [lo, hi] to tick boundaries; false when nothing is finite. */
static bool axis_fit(struct axis *a, double lo, double hi, bool log_scale) {
  if (!isfinite(lo) || !isfinite(hi)) return false;
  a->log = log_scale;
  if (log_scale) {
    a->lo = floor(lo);
    a->hi = ceil(hi);
    if (a->hi <= a->lo) a->hi = a->lo + 1;
    a->step = ceil((a->hi - a->lo) / 6);
    return true;
  }
  if (hi <= lo) {
    double pad = fabs(lo) > 0 ? fabs(lo) * 0.1 : 1;
    lo -= pad;
    hi += pad;
  }
  a->step = nice_step((hi - lo) / 5);
  a->lo = floor(lo / a->step) * a->step;
  a->hi = ceil(hi / a->step) * a->step;
  return true;
}

static double plotted(double v, bool log_scale) {
  if (!isfinite(v)) return NAN;
  if (log_scale) return v > 0 ? log10(v) : NAN;
  return v;
}

static void tick_label(char *buf, size_t cap, double v, bool log_scale) {
  if (log_scale)
    snprintf(buf, cap, "1e%d", (int)lround(v));
  else
    snprintf(buf, cap, "%.4g", fabs(v) < 1e-12 ? 0.0 : v);
}

/* ---- one panel ------------------------------------------------------------- */

static void draw_panel(FILE *c, int top, const double *x, size_t n, const struct axis *ax,
                       const struct plot_panel *p) {
  double x0 = LEFT, x1 = CHART_W - RIGHT, y0 = top + TITLE_H, y1 = top + PANEL_H - 8;
  cv_text(c, LEFT, top + TITLE_H / 2.0, p->title, 0, 0x222222);

  double lo = INFINITY, hi = -INFINITY;
  for (size_t s = 0; s < p->nseries; s++)
    for (size_t i = 0; i < n; i++) {
      double v = plotted(p->series[s].y[i], p->log_y);
      if (isfinite(v)) {
        lo = fmin(lo, v);
        hi = fmax(hi, v);
      }
    }
  struct axis ay;
  /* frame and x grid */
  cv_line(c, x0, y1, x1, y1, 0x444444, 1);
  cv_line(c, x0, y0, x0, y1, 0x444444, 1);
  for (double t = ax->lo; t <= ax->hi + ax->step * 1e-9; t += ax->step) {
    double px = x0 + (t - ax->lo) / (ax->hi - ax->lo) * (x1 - x0);
    cv_line(c, px, y0, px, y1, 0xe4e4e4, 1);
    cv_line(c, px, y1, px, y1 + 4, 0x444444, 1);
  }
  if (!axis_fit(&ay, lo, hi, p->log_y)) {
    cv_text(c, (x0 + x1) / 2, (y0 + y1) / 2, "no data yet", 1, 0x888888);
    return;
  }
  for (double t = ay.lo; t <= ay.hi + ay.step * 1e-9; t += ay.step) {
    double py = y1 - (t - ay.lo) / (ay.hi - ay.lo) * (y1 - y0);
    char lab[32];
    tick_label(lab, sizeof lab, t, ay.log);
    cv_line(c, x0, py, x1, py, 0xe4e4e4, 1);
    cv_line(c, x0 - 4, py, x0, py, 0x444444, 1);
    cv_text(c, x0 - 7, py, lab, 2, 0x444444);
  }
  double *xs = xmalloc(n * sizeof *xs), *ys = xmalloc(n * sizeof *ys);
  for (size_t s = 0; s < p->nseries; s++) {
    const struct plot_series *ser = &p->series[s];
    size_t m = 0;
    for (size_t i = 0; i <= n; i++) {
      double v = i < n ? plotted(ser->y[i], p->log_y) : NAN;
      if (isfinite(v)) {
        xs[m] = x0 + (x[i] - ax->lo) / (ax->hi - ax->lo) * (x1 - x0);
        ys[m] = y1 - (v - ay.lo) / (ay.hi - ay.lo) * (y1 - y0);
        m++;
      } else {
        cv_polyline(c, xs, ys, m, ser->rgb);
        m = 0;
      }
    }
    /* legend, right-aligned, one entry per series */
    double ly = top + TITLE_H / 2.0, lx = x1 - 150.0 * (double)(p->nseries - 1 - s);
    cv_line(c, lx - 140, ly, lx - 120, ly, ser->rgb, 2);
    cv_text(c, lx - 115, ly, ser->name, 0, 0x222222);
  }
  free(xs);
  free(ys);
}

/* ---- the chart -------------------------------------------------------------- */

int plot_write(const char *path, const double *x, size_t n, const struct plot_panel *panels, size_t npanels,
               struct rumor_err *e) {
  int rc = plot_check_path(path, e);
  if (rc) return rc;
  if (n == 0 || npanels == 0) return rumor_err_set(e, -EINVAL, "plot file %s: nothing to plot", path);

  /* Rendered in memory, then written with file_write_atomic. */
  char *buf = NULL;
  size_t buf_len = 0;
  FILE *f = open_memstream(&buf, &buf_len);
  if (!f) return rumor_err_set(e, -errno, "plot file %s: %s", path, strerror(errno));
  int w = CHART_W, h = TOP + (int)npanels * PANEL_H + BOTTOM;
  fprintf(f,
          "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
          "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\">\n"
          "<rect width=\"100%%\" height=\"100%%\" fill=\"#ffffff\"/>\n",
          w, h, w, h);

  /* One x axis for every panel: seconds from the first sample. */
  double *rel = xmalloc(n * sizeof *rel);
  for (size_t i = 0; i < n; i++) rel[i] = x[i] - x[0];
  struct axis ax;
  (void)axis_fit(&ax, 0, rel[n - 1] > 0 ? rel[n - 1] : 1, false);
  for (size_t p = 0; p < npanels; p++) draw_panel(f, TOP + (int)p * PANEL_H, rel, n, &ax, &panels[p]);
  double y1 = TOP + (double)npanels * PANEL_H - 8;
  for (double t = ax.lo; t <= ax.hi + ax.step * 1e-9; t += ax.step) {
    double px = LEFT + (t - ax.lo) / (ax.hi - ax.lo) * (CHART_W - RIGHT - LEFT);
    char lab[32];
    tick_label(lab, sizeof lab, t, false);
    cv_text(f, px, y1 + 13, lab, 1, 0x444444);
  }
  cv_text(f, (LEFT + CHART_W - RIGHT) / 2.0, h - 8, "time (s)", 1, 0x222222);
  free(rel);
  fprintf(f, "</svg>\n");
  if (fclose(f) != 0) {
    free(buf);
    return rumor_err_set(e, -EIO, "plot file %s: cannot render the chart", path);
  }
  struct file_part part = {buf, buf_len};
  rc = file_write_atomic(path, &part, 1, 0644, 0, e);
  free(buf);
  return rc ? rumor_err_prefix(e, "plot file %s", path) : 0;
}

/* ---- sparkline ------------------------------------------------------------ */

size_t plot_sparkline(char *out, size_t cap, const double *y, size_t n, size_t width, bool log_y) {
  static const char *const bars[8] = {"\u2581", "\u2582", "\u2583", "\u2584",
                                      "\u2585", "\u2586", "\u2587", "\u2588"};
  if (cap == 0) return 0;
  size_t first = n > width ? n - width : 0, len = 0;
  double lo = INFINITY, hi = -INFINITY;
  for (size_t i = first; i < n; i++) {
    double v = plotted(y[i], log_y);
    if (isfinite(v)) {
      lo = fmin(lo, v);
      hi = fmax(hi, v);
    }
  }
  for (size_t i = first; i < n; i++) {
    double v = plotted(y[i], log_y);
    const char *s = " ";
    if (isfinite(v)) {
      int level = hi > lo ? (int)lround((v - lo) / (hi - lo) * 7) : 3;
      s = bars[level < 0 ? 0 : level > 7 ? 7 : level];
    }
    size_t sl = strlen(s);
    if (len + sl + 1 > cap) break;
    memcpy(out + len, s, sl);
    len += sl;
  }
  out[len] = '\0';
  return len;
}
