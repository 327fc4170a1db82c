/* Charts and sparklines for `rumor top`: a PNG that decodes (signature,
 * chunk CRCs, IHDR, inflated size, filter bytes, drawn pixels), an SVG that
 * an XML parser accepts, atomic replacement, and clear errors. */
#include <criterion/criterion.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>
#include <zlib.h>

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

static uint32_t be32(const uint8_t *p) { return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3]; }

/* Decodes an 8-bit RGB non-interlaced PNG (what plot writes) into w*h*3
 * bytes, checking every structural rule on the way. */
static uint8_t *png_decode(const uint8_t *p, size_t len, uint32_t *w, uint32_t *h) {
  static const uint8_t sig[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  cr_assert(len > 8 && memcmp(p, sig, 8) == 0, "no PNG signature");
  size_t off = 8;
  uint8_t *z = NULL;
  size_t zlen = 0;
  bool ihdr = false, iend = false;
  while (off + 12 <= len && !iend) {
    uint32_t n = be32(p + off);
    cr_assert(off + 12 + n <= len, "chunk at %zu runs past the end", off);
    const uint8_t *type = p + off + 4, *data = p + off + 8;
    uint32_t crc = (uint32_t)crc32(crc32(0, type, 4), data, n);
    cr_assert_eq(crc, be32(data + n), "bad CRC on chunk %.4s", (const char *)type);
    if (memcmp(type, "IHDR", 4) == 0) {
      cr_assert(!ihdr && off == 8 && n == 13, "IHDR must come first, once, 13 bytes");
      ihdr = true;
      *w = be32(data);
      *h = be32(data + 4);
      cr_assert(data[8] == 8 && data[9] == 2 && data[10] == 0 && data[11] == 0 && data[12] == 0,
                "unexpected IHDR fields");
    } else if (memcmp(type, "IDAT", 4) == 0) {
      z = xrealloc(z, zlen + n);
      memcpy(z + zlen, data, n);
      zlen += n;
    } else if (memcmp(type, "IEND", 4) == 0) {
      iend = true;
    }
    off += 12 + n;
  }
  cr_assert(ihdr && iend && zlen > 0, "missing IHDR, IDAT or IEND");
  cr_assert_eq(off, len, "bytes after IEND");
  uLongf rawlen = (uLongf)((size_t)*w * 3 + 1) * *h;
  uint8_t *raw = xmalloc(rawlen + 1);
  uLongf got = rawlen + 1;
  cr_assert_eq(uncompress(raw, &got, z, (uLong)zlen), Z_OK, "IDAT does not inflate");
  cr_assert_eq(got, rawlen, "inflated %lu bytes, want %lu", (unsigned long)got, (unsigned long)rawlen);
  uint8_t *px = xmalloc((size_t)*w * *h * 3);
  for (uint32_t y = 0; y < *h; y++) {
    cr_assert_eq(raw[(size_t)y * (*w * 3 + 1)], 0, "row %u: filter type not 0", y);
    memcpy(px + (size_t)y * *w * 3, raw + (size_t)y * (*w * 3 + 1) + 1, (size_t)*w * 3);
  }
  free(raw);
  free(z);
  return px;
}

static size_t count_color(const uint8_t *px, uint32_t w, uint32_t h, uint32_t rgb) {
  size_t n = 0;
  for (size_t i = 0; i < (size_t)w * h; i++)
    n += px[3 * i] == (uint8_t)(rgb >> 16) && px[3 * i + 1] == (uint8_t)(rgb >> 8) && px[3 * i + 2] == (uint8_t)rgb;
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

Test(plot, png_is_a_valid_image_with_both_curves) {
  make_series();
  char path[128];
  snprintf(path, sizeof path, "%s/chart.png", dir);
  struct rumor_err e;
  cr_assert_eq(plot_write(path, xs, N, panels, 2, &e), 0, "%s", e.msg);
  size_t len;
  uint8_t *p = slurp(path, &len);
  uint32_t w, h;
  uint8_t *px = png_decode(p, len, &w, &h);
  cr_assert(w >= 400 && h >= 300, "%ux%u", w, h);
  /* Both curves are drawn: a line of 2-pixel pen over ~700 px each. */
  cr_assert_gt(count_color(px, w, h, 0x1f77b4), 500);
  cr_assert_gt(count_color(px, w, h, 0x2ca02c), 500);
  cr_assert_gt(count_color(px, w, h, 0xffffff), (size_t)w * h / 2, "background not white");
  free(px);
  free(p);
  /* Replaced atomically: no temporary file left behind. */
  char cmd[256];
  snprintf(cmd, sizeof cmd, "test $(ls %s | wc -l) -eq 1", dir);
  cr_assert_eq(system(cmd), 0, "temporary files left in %s", dir);
}

Test(plot, svg_is_well_formed_xml_with_both_curves) {
  make_series();
  char path[128];
  snprintf(path, sizeof path, "%s/chart.SVG", dir);
  struct rumor_err e;
  cr_assert_eq(plot_write(path, xs, N, panels, 2, &e), 0, "%s", e.msg);
  size_t len;
  char *s = (char *)slurp(path, &len);
  cr_assert(strncmp(s, "<?xml", 5) == 0 && strstr(s, "<svg ") && strstr(s, "</svg>"));
  cr_assert(strstr(s, "stroke=\"#1f77b4\"") && strstr(s, "stroke=\"#2ca02c\""), "a curve is missing");
  /* the NaN splits the loss curve in two polylines */
  int lines = 0;
  for (const char *q = s; (q = strstr(q, "<polyline fill=\"none\" stroke=\"#2ca02c\"")); q++) lines++;
  cr_assert_eq(lines, 2, "loss curve in %d pieces, want 2 (one gap)", lines);
  free(s);
  if (system("command -v python3 >/dev/null 2>&1") != 0) return; /* the string checks above still ran */
  char cmd[256];
  snprintf(cmd, sizeof cmd, "python3 -c \"import xml.etree.ElementTree as E,sys; E.parse(sys.argv[1])\" %s", path);
  cr_assert_eq(system(cmd), 0, "%s does not parse as XML", path);
}

Test(plot, one_point_and_all_nan_series_still_make_a_chart) {
  make_series();
  for (int i = 0; i < N; i++) drift[i] = NAN;
  char path[128];
  snprintf(path, sizeof path, "%s/one.png", dir);
  struct rumor_err e;
  cr_assert_eq(plot_write(path, xs, 1, panels, 2, &e), 0, "%s", e.msg);
  size_t len;
  uint8_t *p = slurp(path, &len);
  uint32_t w, h;
  free(png_decode(p, len, &w, &h));
  free(p);
}

Test(plot, bad_names_and_directories_are_clear_errors) {
  make_series();
  struct rumor_err e = {0};
  cr_assert_eq(plot_format_of("x.png"), PLOT_PNG);
  cr_assert_eq(plot_format_of("x.Svg"), PLOT_SVG);
  cr_assert_eq(plot_format_of("x.jpg"), PLOT_UNKNOWN);
  cr_assert_eq(plot_format_of(".png"), PLOT_UNKNOWN);
  cr_assert_eq(plot_write("chart.jpg", xs, N, panels, 2, &e), RUMOR_EFORMAT);
  cr_assert(strstr(e.msg, "chart.jpg") && strstr(e.msg, ".svg or .png"), "%s", e.msg);
  cr_assert_neq(plot_write("/nonexistent-dir/chart.png", xs, N, panels, 2, &e), 0);
  cr_assert(strstr(e.msg, "/nonexistent-dir/chart.png"), "%s", e.msg);
  cr_assert_neq(plot_write("x.png", xs, 0, panels, 2, &e), 0);
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
