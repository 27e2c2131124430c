"""Line charts and the Kaplan-Meier step curve as inline SVG, rendered on the server (no
JavaScript, no chart library).

Why server-side SVG: hospital networks are often offline and locked down, so the page may load
nothing from elsewhere and should not need a JS bundle; a few polylines per chart are cheap to
draw in Python, scale to any width, print, and stay readable with JavaScript off. Colours come
from CSS classes (``s0``..``s7``, ``base``), so the page's Content-Security-Policy needs no
inline styles. Every text is escaped: series labels are hospital names, i.e. untrusted input.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from markupsafe import Markup, escape

WIDTH, HEIGHT = 640, 240
LEFT, RIGHT, TOP, BOTTOM = 52, 12, 12, 34
PALETTE = 8


@dataclass
class Series:
    """One line: (x, y) points; ``dashed`` for a reference (e.g. a baseline)."""

    label: str
    points: list[tuple[float, float]]
    dashed: bool = False


@dataclass
class Chart:
    """A rendered chart: the SVG and its legend (label, CSS class, dashed)."""

    title: str
    svg: Markup
    legend: list[tuple[str, str, bool]] = field(default_factory=list)


def _ticks(lo: float, hi: float, count: int = 5) -> list[float]:
    """Round tick values covering [lo, hi]."""
    if hi <= lo:
        return [lo]
    raw = (hi - lo) / max(count - 1, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw)
    first = math.floor(lo / step) * step
    ticks = []
    value = first
    while value <= hi + step * 1e-9 and len(ticks) < 20:
        if value >= lo - step * 1e-9:
            ticks.append(round(value, 12))
        value += step
    return ticks


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def line_chart(title: str, series: list[Series], *, x_label: str = "round",
               baselines: list[Series] | None = None) -> Chart | None:
    """Render ``series`` (solid, one colour each) and ``baselines`` (dashed); None if no data."""
    baselines = baselines or []
    drawn = [s for s in series if s.points] + [b for b in baselines if b.points]
    if not drawn:
        return None
    xs = [x for s in drawn for x, _ in s.points]
    ys = [y for s in drawn for _, y in s.points if math.isfinite(y)]
    if not ys:
        return None
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_lo, y_hi = min(ys), max(ys)
    pad = (y_hi - y_lo) * 0.08 or abs(y_hi) * 0.05 or 1.0
    y_lo, y_hi = y_lo - pad, y_hi + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + (x - x_lo) / (x_hi - x_lo) * plot_w

    def py(y: float) -> float:
        return TOP + (1 - (y - y_lo) / (y_hi - y_lo)) * plot_h

    parts = [
        f'<svg class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>',
    ]
    for tick in _ticks(y_lo, y_hi):
        y = py(tick)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f"{escape(_fmt(tick))}</text>")
    x_ticks = [t for t in _ticks(x_lo, x_hi, 8) if float(t).is_integer()] or [x_lo, x_hi]
    for tick in x_ticks:
        x = px(tick)
        parts.append(f'<text class="tick" x="{x:.1f}" y="{TOP + plot_h + 16}" text-anchor="middle">'
                     f"{escape(_fmt(tick))}</text>")
    parts.append(f'<text class="axis" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 3}" '
                 f'text-anchor="middle">{escape(x_label)}</text>')
    legend: list[tuple[str, str, bool]] = []
    for i, line in enumerate([*series, *baselines]):
        if not line.points:
            continue
        css = f"s{i % PALETTE}"
        dashed = line.dashed or i >= len(series)
        legend.append((line.label, css, dashed))
        finite = [(x, y) for x, y in line.points if math.isfinite(y)]
        points = [(px(x), py(y)) for x, y in finite]
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in points)
        parts.append(f'<polyline class="line {css}{" dashed" if dashed else ""}" points="{coords}">'
                     f"<title>{escape(line.label)}</title></polyline>")
        if not dashed:
            for (x, y), (rx, ry) in zip(points, finite, strict=True):
                parts.append(f'<circle class="dot {css}" cx="{x:.1f}" cy="{y:.1f}" r="3">'
                             f"<title>{escape(line.label)}: {x_label} {escape(_fmt(rx))}, "
                             f"{escape(_fmt(ry))}</title></circle>")
    parts.append("</svg>")
    return Chart(title=title, svg=Markup("".join(parts)), legend=legend)


def _steps(times: list[float], values: list[float], start: float) -> list[tuple[float, float]]:
    """A right-continuous step path from (0, start) through (times[i], values[i])."""
    path = [(0.0, start)]
    level = start
    for t, v in zip(times, values, strict=True):
        path += [(t, level), (t, v)]
        level = v
    return path


def survival_chart(title: str, times: list[float], survival: list[float], lower: list[float],
                   upper: list[float], *, label: str, counts: list[str] | None = None,
                   x_label: str = "time") -> Chart | None:
    """A Kaplan-Meier curve: a step line from S(0) = 1 with its 95% band (a shaded step area),
    survival 0..1 against time; ``counts`` (one text per point) go into each point's tooltip.
    None when there is no point."""
    if not times:
        return None
    x_hi = max(times) or 1.0
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def px(x: float) -> float:
        return LEFT + x / x_hi * plot_w

    def py(y: float) -> float:
        return TOP + (1 - y) * plot_h

    def coords(path: list[tuple[float, float]]) -> str:
        return " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in path)

    parts = [
        f'<svg class="chart km" viewBox="0 0 {WIDTH} {HEIGHT}" role="img" '
        f'aria-label="{escape(title)}" xmlns="http://www.w3.org/2000/svg">',
        f"<title>{escape(title)}</title>",
        f'<rect class="plot" x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>',
    ]
    for tick in (0.0, 0.25, 0.5, 0.75, 1.0):
        y = py(tick)
        parts.append(f'<line class="grid" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y:.1f}" y2="{y:.1f}"/>')
        parts.append(f'<text class="tick" x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">'
                     f"{escape(_fmt(tick))}</text>")
    for tick in _ticks(0.0, x_hi, 7):
        parts.append(f'<text class="tick" x="{px(tick):.1f}" y="{TOP + plot_h + 16}" '
                     f'text-anchor="middle">{escape(_fmt(tick))}</text>')
    parts.append(f'<text class="axis" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 3}" '
                 f'text-anchor="middle">{escape(x_label)}</text>')
    band = _steps(times, upper, 1.0) + list(reversed(_steps(times, lower, 1.0)))
    parts.append(f'<polygon class="band s0" points="{coords(band)}"><title>95% confidence band'
                 "</title></polygon>")
    parts.append(f'<polyline class="line s0" points="{coords(_steps(times, survival, 1.0))}">'
                 f"<title>{escape(label)}</title></polyline>")
    for i, (t, s) in enumerate(zip(times, survival, strict=True)):
        extra = f", {counts[i]}" if counts else ""
        parts.append(f'<circle class="dot s0" cx="{px(t):.1f}" cy="{py(s):.1f}" r="2.5">'
                     f"<title>{escape(x_label)} {escape(_fmt(t))}: survival {escape(_fmt(s))} "
                     f"(95% {escape(_fmt(lower[i]))} to {escape(_fmt(upper[i]))}){escape(extra)}"
                     "</title></circle>")
    parts.append("</svg>")
    legend = [(label, "s0", False), ("95% confidence band", "s0 band", False)]
    return Chart(title=title, svg=Markup("".join(parts)), legend=legend)
