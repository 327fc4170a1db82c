/*
 * plot — line charts of time series as SVG or PNG files, and terminal
 * sparklines, for `rumor top`. No plotting library: the SVG is written as
 * text, the PNG is rasterised here (lines, axes, a 5×7 bitmap font for the
 * labels) and compressed with zlib.
 *
 * A chart has one or more panels stacked vertically, all sharing the x axis
 * (seconds). NaN values are gaps in a line. Pure functions; any thread.
 */
#ifndef RUMOR_PEER_PLOT_H
#define RUMOR_PEER_PLOT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "util/util.h"

enum plot_format { PLOT_UNKNOWN = 0, PLOT_SVG, PLOT_PNG };

/* The format named by a path's extension (".svg" or ".png", any case). */
enum plot_format plot_format_of(const char *path);

struct plot_series {
  const char *name; /* legend text (ASCII shows in PNGs) */
  const double *y;  /* one value per x; NaN leaves a gap */
  uint32_t rgb;     /* 0xRRGGBB */
};

struct plot_panel {
  const char *title;
  bool log_y; /* log10 y axis; non-positive values are gaps */
  const struct plot_series *series;
  size_t nseries;
};

/* Writes the chart to `path` in the format of its extension, atomically (a
 * temporary file renamed over it), so a viewer never reads half a file.
 * `x` holds n ≥ 1 times in seconds, non-decreasing. */
int plot_write(const char *path, const double *x, size_t n, const struct plot_panel *panels, size_t npanels,
               struct rumor_err *e) RUMOR_MUST_CHECK;

/* The last `width` values of y[0..n) as a UTF-8 sparkline (▁▂▃▄▅▆▇█, a space
 * for NaN), scaled between their minimum and maximum; `log_y` scales
 * log10(y). Writes at most cap-1 bytes and a NUL; returns bytes written. */
size_t plot_sparkline(char *out, size_t cap, const double *y, size_t n, size_t width, bool log_y);

#endif /* RUMOR_PEER_PLOT_H */
