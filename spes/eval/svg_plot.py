"""Line plots as standalone SVG files: the pictures `dvc plots show` draws with Vega, which it loads from a
CDN (blank offline), written by the stages beside their CSVs so a plot can be opened anywhere, offline.

    line_plot_svg({"node 0": [(1, 4.2), (2, 3.9)], ...}, "train loss per round", "round", "loss") -> "<svg ...>"
"""
from __future__ import annotations

import math
from xml.sax.saxutils import escape

WIDTH, HEIGHT = 640, 400
LEFT, RIGHT, TOP, BOTTOM = 70, 150, 40, 50  # margins: axis labels left and below, the legend right
COLOURS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
           "#17becf")
TICKS = 5


def _span(values: list[float]) -> tuple[float, float]:
    lo, hi = min(values), max(values)
    if hi == lo:  # one value: a band around it, so the line sits in the middle
        pad = abs(lo) * 0.05 or 1.0
        return lo - pad, hi + pad
    return lo, hi


def _tick(v: float) -> str:
    return f"{v:.4g}"


def series_of(rows: list[dict], label, x: str, y: str) -> dict[str, list[tuple[float, float]]]:
    """{label(row): [(row[x], row[y]), ...]} of table rows, in the rows' order: the lines of one plot."""
    out: dict[str, list[tuple[float, float]]] = {}
    for row in rows:
        out.setdefault(label(row), []).append((row[x], row[y]))
    return out


def line_plot_svg(series: dict[str, list[tuple[float, float]]], title: str, xlabel: str, ylabel: str,
                  empty_note: str = "no points") -> str:
    """One line per series (points sorted by x; non-finite y left out), shared axes, a legend; an SVG text.
    Without any finite point: the title and `empty_note`."""
    clean = {name: sorted((float(x), float(y)) for x, y in pts if math.isfinite(float(y)))
             for name, pts in series.items()}
    clean = {name: pts for name, pts in clean.items() if pts}
    if not clean:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" font-family="sans-serif">'
                f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/><text x="{WIDTH / 2}" y="22" '
                f'text-anchor="middle" font-size="14">{escape(title)}</text><text x="{WIDTH / 2}" y="{HEIGHT / 2}" '
                f'text-anchor="middle" font-size="12">{escape(empty_note)}</text></svg>\n')
    x0, x1 = _span([x for pts in clean.values() for x, _ in pts])
    y0, y1 = _span([y for pts in clean.values() for _, y in pts])
    pw, ph = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def sx(x: float) -> float:
        return LEFT + (x - x0) / (x1 - x0) * pw

    def sy(y: float) -> float:
        return TOP + (y1 - y) / (y1 - y0) * ph

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
           f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
           f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
           f'<text x="{WIDTH / 2:.1f}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<rect x="{LEFT}" y="{TOP}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>']
    for i in range(TICKS + 1):
        xv, yv = x0 + (x1 - x0) * i / TICKS, y0 + (y1 - y0) * i / TICKS
        out.append(f'<text x="{sx(xv):.1f}" y="{TOP + ph + 18}" text-anchor="middle">{_tick(xv)}</text>')
        out.append(f'<text x="{LEFT - 6}" y="{sy(yv) + 4:.1f}" text-anchor="end">{_tick(yv)}</text>')
        out.append(f'<line x1="{LEFT}" x2="{LEFT + pw}" y1="{sy(yv):.1f}" y2="{sy(yv):.1f}" stroke="#ddd"/>')
    out.append(f'<text x="{LEFT + pw / 2:.1f}" y="{HEIGHT - 10}" text-anchor="middle">{escape(xlabel)}</text>')
    out.append(f'<text x="16" y="{TOP + ph / 2:.1f}" text-anchor="middle" '
               f'transform="rotate(-90 16 {TOP + ph / 2:.1f})">{escape(ylabel)}</text>')
    for k, (name, pts) in enumerate(clean.items()):
        colour = COLOURS[k % len(COLOURS)]
        coords = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        out.append(f'<polyline data-series="{escape(name)}" points="{coords}" fill="none" stroke="{colour}" '
                   'stroke-width="2"/>')
        if len(pts) == 1:  # a line of one point is invisible: mark it
            out.append(f'<circle cx="{sx(pts[0][0]):.1f}" cy="{sy(pts[0][1]):.1f}" r="3" fill="{colour}"/>')
        ly = TOP + 10 + 18 * k
        out.append(f'<line x1="{LEFT + pw + 12}" x2="{LEFT + pw + 32}" y1="{ly}" y2="{ly}" stroke="{colour}" '
                   'stroke-width="2"/>')
        out.append(f'<text x="{LEFT + pw + 38}" y="{ly + 4}">{escape(name)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
