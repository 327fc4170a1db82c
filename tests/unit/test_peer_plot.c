/* Charts and sparklines for `rumor top`: an SVG that an XML parser accepts,
 * with both curves, a gap where a value is NaN, its text escaped; atomic
 * replacement; and clear errors, a .png among them (PNG is no longer
 * written). */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "peer/cli/cli_impl.h"

static char dir[64];
static void setup(void) {
  snprintf(dir, sizeof dir, "/tmp/rumor-test-plot-XXXXXX");
  cr_assert_not_null(mkdtemp(dir));
}
static void teardown(void) {
  char cmd[128];
  snprintf(cmd, sizeof cmd, "rm -rf %s", dir);
  if (system(cmd) != 0) fprintf(stderr, "could not remove %s\n", dir);
}
TestSuite(plot, .init = setup, .fini = teardown);

static uint8_t *slurp(const char *path, size_t *len) {
  FILE *f = fopen(path, "rb");
  cr_assert_not_null(f, "cannot open %s", path);
  fseek(f, 0, SEEK_END);
  long n = ftell(f);
  rewind(f);
  uint8_t *p = xmalloc((size_t)n + 1);
  cr_assert_eq(fread(p, 1, (size_t)n, f), (size_t)n);
  fclose(f);
  p[n] = 0;
  *len = (size_t)n;
  return p;
}

/* Whether the file parses as XML (python3's ElementTree); true without
 * python3, where the string checks of the callers still ran. */
static bool xml_parses(const char *path) {
  if (system("command -v python3 >/dev/null 2>&1") != 0) return true;
  char cmd[256];
  snprintf(cmd, sizeof cmd, "python3 -c \"import xml.etree.ElementTree as E,sys; E.parse(sys.argv[1])\" %s", path);
  return system(cmd) == 0;
}

static int count(const char *s, const char *what) {
  int n = 0;
  for (const char *q = s; (q = strstr(q, what)); q++) n++;
  return n;
}

enum { N = 50 };
static double xs[N], drift[N], loss[N];
static struct plot_series ds[1], ls[1];
static struct plot_panel panels[2];

static void make_series(void) {
  for (int i = 0; i < N; i++) {
    xs[i] = 1.7e9 + i * 2.0;
    drift[i] = 3.0 * exp(-i / 8.0);
    loss[i] = i == 20 ? NAN : 2.3 / (1 + i / 5.0); /* a gap */
  }
  ds[0] = (struct plot_series){"sketch", drift, 0x1f77b4};
  ls[0] = (struct plot_series){"loss", loss, 0x2ca02c};
  panels[0] = (struct plot_panel){"drift", true, ds, 1};
  panels[1] = (struct plot_panel){"loss", false, ls, 1};
}

Test(plot, svg_is_well_formed_xml_with_both_curves_and_is_replaced_atomically) {
  make_series();
  char path[128];
  snprintf(path, sizeof path, "%s/chart.SVG", dir);
  struct rumor_err e;
  for (int round = 0; round < 2; round++) /* the second write replaces the first */
    cr_assert_eq(plot_write(path, xs, N, panels, 2, &e), 0, "%s", e.msg);
  size_t len;
  char *s = (char *)slurp(path, &len);
  cr_assert(strncmp(s, "<?xml", 5) == 0 && strstr(s, "<svg ") && strstr(s, "</svg>"));
  cr_assert(strstr(s, "stroke=\"#1f77b4\"") && strstr(s, "stroke=\"#2ca02c\""), "a curve is missing");
  /* the NaN splits the loss curve in two polylines */
  int lines = count(s, "<polyline fill=\"none\" stroke=\"#2ca02c\"");
  cr_assert_eq(lines, 2, "loss curve in %d pieces, want 2 (one gap)", lines);
  cr_assert(strstr(s, ">sketch</text>") && strstr(s, ">time (s)</text>"), "legend or axis title missing");
  free(s);
  cr_assert(xml_parses(path), "%s does not parse as XML", path);
  /* Replaced atomically: no temporary file left behind. */
  char cmd[256];
  snprintf(cmd, sizeof cmd, "test $(ls %s | wc -l) -eq 1", dir);
  cr_assert_eq(system(cmd), 0, "temporary files left in %s", dir);
}

Test(plot, text_is_escaped_and_keeps_utf8) {
  make_series();
  ds[0].name = "Ξ <sketch> & \"exact\"";
  panels[0].title = "consensus distance Ξ/‖θ̄‖";
  char path[128];
  snprintf(path, sizeof path, "%s/text.svg", dir);
  struct rumor_err e;
  cr_assert_eq(plot_write(path, xs, N, panels, 2, &e), 0, "%s", e.msg);
  size_t len;
  char *s = (char *)slurp(path, &len);
  cr_assert(strstr(s, ">Ξ &lt;sketch&gt; &amp; &quot;exact&quot;</text>"), "%s", s);
  cr_assert(strstr(s, ">consensus distance Ξ/‖θ̄‖</text>"), "title lost its characters");
  free(s);
  cr_assert(xml_parses(path), "%s does not parse as XML", path);
}

Test(plot, one_point_and_all_nan_series_still_make_a_chart) {
  make_series();
  for (int i = 0; i < N; i++) drift[i] = NAN;
  char path[128];
  snprintf(path, sizeof path, "%s/one.svg", dir);
  struct rumor_err e;
  cr_assert_eq(plot_write(path, xs, 1, panels, 2, &e), 0, "%s", e.msg);
  size_t len;
  char *s = (char *)slurp(path, &len);
  cr_assert(strstr(s, ">no data yet</text>"), "the all-NaN panel says it has no data");
  cr_assert_eq(count(s, "<polyline fill=\"none\" stroke=\"#2ca02c\""), 1, "the one loss point is drawn");
  free(s);
  cr_assert(xml_parses(path), "%s does not parse as XML", path);
}

Test(plot, bad_names_and_directories_are_clear_errors) {
  make_series();
  struct rumor_err e = {0};
  cr_assert_eq(plot_format_of("x.png"), PLOT_PNG);
  cr_assert_eq(plot_format_of("x.Svg"), PLOT_SVG);
  cr_assert_eq(plot_format_of("x.jpg"), PLOT_UNKNOWN);
  cr_assert_eq(plot_format_of(".png"), PLOT_UNKNOWN);
  cr_assert_eq(plot_write("chart.jpg", xs, N, panels, 2, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "chart.jpg") && strstr(e.msg, "must end in .svg"), "%s", e.msg);
  char png[128];
  snprintf(png, sizeof png, "%s/chart.png", dir);
  cr_assert_eq(plot_write(png, xs, N, panels, 2, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, png) && strstr(e.msg, "PNG charts are no longer written") && strstr(e.msg, ".svg") &&
                strstr(e.msg, "--web"),
            "%s", e.msg);
  cr_assert_neq(access(png, F_OK), 0, "a refused .png was written");
  cr_assert_neq(plot_write("/nonexistent-dir/chart.svg", xs, N, panels, 2, &e), 0);
  cr_assert(strstr(e.msg, "/nonexistent-dir/chart.svg"), "%s", e.msg);
  cr_assert_neq(plot_write("x.svg", xs, 0, panels, 2, &e), 0);
}

Test(plot, sparkline_scales_between_min_and_max_and_keeps_the_last_values) {
  double y[10];
  for (int i = 0; i < 10; i++) y[i] = i;
  char out[256];
  size_t n = plot_sparkline(out, sizeof out, y, 10, 8, false);
  cr_assert_eq(n, 8 * 3, "8 bars of 3 UTF-8 bytes each, got %zu bytes", n);
  cr_assert(strncmp(out, "\u2581", 3) == 0 && strcmp(out + 21, "\u2588") == 0, "%s", out);
  y[9] = NAN;
  plot_sparkline(out, sizeof out, y, 10, 8, false);
  cr_assert_eq(out[strlen(out) - 1], ' ', "NaN shows as a space: '%s'", out);
  /* a short buffer is never overrun and stays NUL-terminated */
  char small[7];
  n = plot_sparkline(small, sizeof small, y, 10, 8, false);
  cr_assert(n <= 6 && small[n] == '\0');
}
