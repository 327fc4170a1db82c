"""Draws tests/bench/bench-sync.sh's evaluations as an SVG: test accuracy
against seconds since the first step (logarithmic: the schemes' times differ
by up to 100x), one line per scheme (worker 1's evaluations), one panel per
condition. Standard library only.

usage: plot_sync.py bench-sync.csv out.svg [--target 0.85]
"""
import csv
import math
import sys

COLOURS = {"gossip": "#1f77b4", "gossip-mls": "#17becf", "allreduce": "#d62728", "allreduce-swim": "#ff9896",
           "ps0": "#9467bd", "ps4": "#8c564b", "psasp": "#e377c2", "ddp": "#ff7f0e", "hivemind": "#2ca02c"}
W, H, PAD_L, PAD_B, PAD_T, PAD_R = 420, 300, 52, 40, 28, 12


def panel(cond, series, x0, y0, tmax, lo, target):
    out = [f'<g transform="translate({x0},{y0})">',
           f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="14" font-weight="bold">{cond}</text>']
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    tmin = 0.1
    span = math.log10(tmax) - math.log10(tmin)
    sx = lambda t: PAD_L + pw * (math.log10(max(t, tmin)) - math.log10(tmin)) / span
    sy = lambda a: PAD_T + ph * (1 - (a - lo) / (1 - lo))
    out.append(f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    for k in range(6):
        a = lo + (1 - lo) * k / 5
        out.append(f'<text x="{PAD_L - 4}" y="{sy(a) + 4:.1f}" text-anchor="end" font-size="10">{a:.2f}</text>')
    t = tmin
    while t <= tmax:
        out.append(f'<text x="{sx(t):.1f}" y="{H - PAD_B + 14}" text-anchor="middle" font-size="10">{t:g}</text>')
        out.append(f'<line x1="{sx(t):.1f}" x2="{sx(t):.1f}" y1="{PAD_T}" y2="{PAD_T + ph}" stroke="#eee"/>')
        t *= 10
    if lo < target < 1:
        out.append(f'<line x1="{PAD_L}" x2="{PAD_L + pw}" y1="{sy(target):.1f}" y2="{sy(target):.1f}" '
                   'stroke="#bbb" stroke-dasharray="4,3"/>')
    out.append(f'<text x="{PAD_L + pw / 2}" y="{H - 6}" text-anchor="middle" font-size="11">seconds (log)</text>')
    ly = PAD_T + ph - 4 - 12 * len(series)  # the legend in the lower right, where the curves rarely are
    for scheme, pts in sorted(series.items()):
        pts.sort()
        colour = COLOURS.get(scheme, "#444")
        path = " ".join(f"{sx(t):.1f},{sy(max(a, lo)):.1f}" for t, a in pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{colour}" stroke-width="1.8"/>')
        out.append(f'<text x="{PAD_L + pw - 4}" y="{ly + 12}" text-anchor="end" font-size="10" '
                   f'fill="{colour}">{scheme}</text>')
        ly += 12
    out.append("</g>")
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    target = float(sys.argv[sys.argv.index("--target") + 1]) if "--target" in sys.argv else 0.85
    data = {}
    with open(sys.argv[1]) as f:
        for row in csv.DictReader(f):
            if row["worker"] != "1":
                continue
            data.setdefault(row["condition"], {}).setdefault(row["scheme"], []).append(
                (float(row["t"]), float(row["accuracy"])))
    if not data:
        sys.exit(f"plot_sync.py: no evaluations in {sys.argv[1]}")
    order = ("clean", "straggler", "slow", "killed", "stopped")
    conds = [c for c in order if c in data] + [c for c in data if c not in order]
    cols = 2
    rows = (len(conds) + cols - 1) // cols
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * cols}" height="{H * rows}" '
           'font-family="sans-serif">', f'<rect width="{W * cols}" height="{H * rows}" fill="white"/>']
    for i, cond in enumerate(conds):
        pts = [p for s in data[cond].values() for p in s]
        tmax = max(t for t, _ in pts) * 1.05 or 1
        lo = min(0.7, min(a for _, a in pts))
        svg += panel(cond, data[cond], (i % cols) * W, (i // cols) * H, tmax, lo, target)
    svg.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(svg) + "\n")


if __name__ == "__main__":
    main()
