"""A line chart as a standalone SVG file, with no plotting library: the benchmarks' plots in ``docs/``.

``line_chart(series, ...)`` takes ``{label: [(x, y), ...]}`` and returns the SVG text: one polyline per series in
a fixed palette, linear axes with rounded ticks, a legend, a title and axis labels. The axes span the data (y padded
by 5%), so every point lies inside the plot area.
"""

from __future__ import annotations

import math
from html import escape

PALETTE = ("#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def nice_ticks(low: float, high: float, count: int = 5) -> list[float]:
    """Round tick values inside ``[low, high]``: the step of 1, 2 or 5 times a power of ten that gives the number of
    intervals closest to ``count``."""
    if high <= low:
        high = low + 1.0
    raw = (high - low) / max(count, 1)
    power = 10 ** math.floor(math.log10(raw))
    step = min((m * power for m in (1, 2, 5, 10)), key=lambda s: abs((high - low) / s - count))
    first = math.ceil(low / step) * step
    return [round(first + i * step, 10) for i in range(int((high - first) / step + 1e-9) + 1)]


def line_chart(series: dict[str, list[tuple[float, float]]], *, title: str, x_label: str, y_label: str,
               width: int = 720, height: int = 420) -> str:
    """The SVG text of a line chart of ``series`` (label -> points, each non-empty)."""
    if not series or any(not points for points in series.values()):
        raise ValueError(f"line_chart: every series needs at least one point, got {[len(p) for p in series.values()]}")
    xs = [x for points in series.values() for x, _ in points]
    ys = [y for points in series.values() for _, y in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    pad = 0.05 * ((max(ys) - min(ys)) or 1.0)
    y0, y1 = min(ys) - pad, max(ys) + pad
    left, right, top, bottom = 70, 20, 40, 55
    plot_w, plot_h = width - left - right, height - top - bottom

    def px(x: float) -> float:
        return left + (x - x0) / (x1 - x0) * plot_w

    def py(y: float) -> float:
        return top + (y1 - y) / (y1 - y0) * plot_h

    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
           f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="12">',
           f'<rect width="{width}" height="{height}" fill="white"/>',
           f'<text x="{width / 2}" y="22" text-anchor="middle" font-size="14">{escape(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>']
    for t in nice_ticks(x0, x1):
        out.append(f'<line x1="{px(t):.1f}" y1="{top + plot_h}" x2="{px(t):.1f}" y2="{top + plot_h + 5}" stroke="#444"/>')
        out.append(f'<text x="{px(t):.1f}" y="{top + plot_h + 18}" text-anchor="middle">{t:g}</text>')
    for t in nice_ticks(y0, y1):
        out.append(f'<line x1="{left}" y1="{py(t):.1f}" x2="{left + plot_w}" y2="{py(t):.1f}" stroke="#ddd"/>')
        out.append(f'<text x="{left - 6}" y="{py(t) + 4:.1f}" text-anchor="end">{t:g}</text>')
    out.append(f'<text x="{left + plot_w / 2}" y="{height - 12}" text-anchor="middle">{escape(x_label)}</text>')
    out.append(f'<text x="16" y="{top + plot_h / 2}" text-anchor="middle" '
               f'transform="rotate(-90 16 {top + plot_h / 2})">{escape(y_label)}</text>')
    for i, (label, points) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        path = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in points)
        out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="1.5" opacity="0.85"/>')
        ly = top + 16 + 18 * i
        out.append(f'<line x1="{left + plot_w - 170}" y1="{ly - 4}" x2="{left + plot_w - 145}" y2="{ly - 4}" '
                   f'stroke="{color}" stroke-width="2"/>')
        out.append(f'<text x="{left + plot_w - 140}" y="{ly}">{escape(label)}</text>')
    out.append("</svg>")
    return "\n".join(out) + "\n"
