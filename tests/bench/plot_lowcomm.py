"""Draws tests/bench/bench-lowcomm.sh's CSV as an SVG of two panels per
condition: each row's final validation loss against the bytes a peer sent per
training token (log scale), and the loss curves against wall time (each
scheme's mean over its peers at each evaluation). Standard library only.

usage: plot_lowcomm.py bench-lowcomm.csv out.svg
"""
import csv
import math
import sys

W, H, PAD_L, PAD_B, PAD_T, PAD_R = 460, 320, 56, 42, 28, 14
COLOURS = {"allreduce": "#d62728", "gossip": "#1f77b4", "one-4x": "#7f7f7f", "alone": "#bcbd22"}
PALETTE = ["#2ca02c", "#9467bd", "#8c564b", "#e377c2", "#17becf", "#ff7f0e", "#393b79", "#637939", "#843c39"]


def colour(name, i):
    return COLOURS.get(name, PALETTE[i % len(PALETTE)])


def axes(out, title, xlabel, ylabel, xs, ys, lo, hi, log_x):
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    out.append(f'<text x="{W / 2}" y="18" text-anchor="middle" font-size="13" font-weight="bold">{title}</text>')
    out.append(f'<rect x="{PAD_L}" y="{PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#888"/>')
    out.append(f'<text x="{PAD_L + pw / 2}" y="{H - 6}" text-anchor="middle" font-size="11">{xlabel}</text>')
    out.append(f'<text x="12" y="{PAD_T + ph / 2}" font-size="11" transform="rotate(-90 12 {PAD_T + ph / 2})" '
               f'text-anchor="middle">{ylabel}</text>')
    for k in range(6):
        v = lo + (hi - lo) * k / 5
        out.append(f'<text x="{PAD_L - 4}" y="{ys(v) + 4:.1f}" text-anchor="end" font-size="10">{v:.2f}</text>')
    return pw, ph


def bytes_panel(rows, x0, y0, cond):
    pts = [(r, float(v["bytes_per_token"]), float(v["val_loss"])) for r, v in rows.items()
           if v["val_loss"] not in ("", "nan") and float(v["bytes_per_token"]) > 0]
    out = [f'<g transform="translate({x0},{y0})">']
    if not pts:
        return out + ["</g>"]
    lo = min(p[2] for p in pts) - 0.02
    hi = max(p[2] for p in pts) + 0.02
    bmin = 10 ** math.floor(math.log10(min(p[1] for p in pts)))
    bmax = 10 ** math.ceil(math.log10(max(p[1] for p in pts)))
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    xs = lambda b: PAD_L + pw * (math.log10(b) - math.log10(bmin)) / (math.log10(bmax) - math.log10(bmin))
    ys = lambda v: PAD_T + ph * (1 - (v - lo) / (hi - lo))
    axes(out, f"{cond}: loss against bytes", "bytes sent per peer per training token (log)", "validation loss",
         xs, ys, lo, hi, True)
    b = bmin
    while b <= bmax:
        out.append(f'<text x="{xs(b):.1f}" y="{H - PAD_B + 14}" text-anchor="middle" font-size="10">{b:g}</text>')
        b *= 10
    for i, (name, bpt, loss) in enumerate(sorted(pts)):
        c = colour(name, i)
        out.append(f'<circle cx="{xs(bpt):.1f}" cy="{ys(loss):.1f}" r="3.5" fill="{c}"/>')
        out.append(f'<text x="{xs(bpt) + 5:.1f}" y="{ys(loss) - 4:.1f}" font-size="9" fill="{c}">{name}</text>')
    return out + ["</g>"]


def time_panel(curves, x0, y0, cond):
    out = [f'<g transform="translate({x0},{y0})">']
    pts = [p for c in curves.values() for p in c]
    if not pts:
        return out + ["</g>"]
    lo = min(v for _, v in pts) - 0.02
    hi = min(max(v for _, v in pts), lo + 1.5)
    tmax = max(t for t, _ in pts) or 1
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    xs = lambda t: PAD_L + pw * t / tmax
    ys = lambda v: PAD_T + ph * (1 - (min(v, hi) - lo) / (hi - lo))
    axes(out, f"{cond}: loss against wall time", "seconds since the first step", "validation loss", xs, ys, lo, hi,
         False)
    for k in range(6):
        t = tmax * k / 5
        out.append(f'<text x="{xs(t):.1f}" y="{H - PAD_B + 14}" text-anchor="middle" font-size="10">{t:.0f}</text>')
    ly = PAD_T + 6
    for i, (name, c_pts) in enumerate(sorted(curves.items())):
        c = colour(name, i)
        c_pts.sort()
        path = " ".join(f"{xs(t):.1f},{ys(v):.1f}" for t, v in c_pts)
        out.append(f'<polyline points="{path}" fill="none" stroke="{c}" stroke-width="1.6"/>')
        out.append(f'<text x="{PAD_L + pw - 4}" y="{ly + 10}" text-anchor="end" font-size="9" fill="{c}">{name}</text>')
        ly += 11
    return out + ["</g>"]


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    rows, curves = {}, {}
    with open(sys.argv[1]) as f:
        for r in csv.DictReader(f):
            if r["val_loss"]:
                rows.setdefault(r["condition"], {})[r["row"]] = r
            elif r["t"]:
                curves.setdefault(r["condition"], {}).setdefault(r["row"], []).append((float(r["t"]),
                                                                                       float(r["eval_loss"])))
    conds = sorted(rows, key=lambda c: c != "loopback")
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{2 * W}" height="{H * len(conds)}" '
           f'font-family="sans-serif"><rect width="100%" height="100%" fill="white"/>']
    for k, cond in enumerate(conds):
        out += bytes_panel(rows[cond], 0, k * H, cond)
        out += time_panel(curves.get(cond, {}), W, k * H, cond)
    out.append("</svg>")
    with open(sys.argv[2], "w") as f:
        f.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
