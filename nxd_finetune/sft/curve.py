"""The loss-curve picture written at the end of a run: ``loss_curve.svg`` (self-contained SVG, no
plotting dependency; opens in any browser) of train and eval loss against the optimizer step, read
from ``metrics.jsonl``. A resumed run's file holds every step once, so its picture is the whole run.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 720, 420
LEFT, RIGHT, TOP, BOTTOM = 70, 20, 40, 50
SERIES = (("train_loss", "train loss", "#1f77b4"), ("eval_loss", "eval loss", "#d62728"))


def read_series(metrics_path: Path) -> dict[str, list[tuple[int, float]]]:
    """``{"train_loss": [(step, value)...], "eval_loss": [...]}`` from a metrics JSONL file
    (lines that are not JSON objects, e.g. a line cut by a kill, are skipped)."""
    out: dict[str, list[tuple[int, float]]] = {key: [] for key, _, _ in SERIES}
    for line in Path(metrics_path).read_text().splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        for key in out:
            value = rec.get(key) if isinstance(rec, dict) else None
            if isinstance(value, int | float) and math.isfinite(value):
                out[key].append((int(rec["step"]), float(value)))
    return out


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    """About ``n`` round tick values covering ``[lo, hi]``."""
    span = hi - lo or abs(hi) or 1.0
    raw = span / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw)
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 2) if first + i * step <= hi + step / 2]


def render_svg(series: dict[str, list[tuple[int, float]]], title: str = "loss") -> str:
    """The SVG document for ``series`` (as :func:`read_series` returns)."""
    points = [p for key, _, _ in SERIES for p in series.get(key, [])]
    if not points:
        return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}">'
                f'<text x="{WIDTH / 2}" y="{HEIGHT / 2}" text-anchor="middle">no loss logged</text></svg>\n')
    x_lo, x_hi = min(s for s, _ in points), max(s for s, _ in points)
    yt = _ticks(min(v for _, v in points), max(v for _, v in points))
    y_lo, y_hi = yt[0], yt[-1]
    x_span, y_span = (x_hi - x_lo) or 1, (y_hi - y_lo) or 1
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def xy(step: float, value: float) -> tuple[float, float]:
        return LEFT + (step - x_lo) / x_span * plot_w, TOP + (1 - (value - y_lo) / y_span) * plot_h

    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
             f'font-family="sans-serif" font-size="12">',
             f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
             f'<text x="{WIDTH / 2}" y="22" text-anchor="middle" font-size="15">{escape(title)}</text>']
    for v in yt:
        _, y = xy(x_lo, v)
        parts.append(f'<line x1="{LEFT}" y1="{y:.1f}" x2="{WIDTH - RIGHT}" y2="{y:.1f}" stroke="#ddd"/>'
                     f'<text x="{LEFT - 6}" y="{y + 4:.1f}" text-anchor="end">{v:.4g}</text>')
    for s in _ticks(x_lo, x_hi):
        if x_lo <= s <= x_hi:
            x, _ = xy(s, y_lo)
            parts.append(f'<text x="{x:.1f}" y="{TOP + plot_h + 18}" text-anchor="middle">{s:g}</text>')
    parts.append(f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" stroke="#444"/>'
                 f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 10}" text-anchor="middle">step</text>')
    for i, (key, label, color) in enumerate(SERIES):
        pts = sorted(series.get(key, []))
        if not pts:
            continue
        coords = " ".join(f"{x:.1f},{y:.1f}" for x, y in (xy(s, v) for s, v in pts))
        parts.append(f'<polyline points="{coords}" fill="none" stroke="{color}" stroke-width="1.8"/>')
        parts += [f'<circle cx="{x:.1f}" cy="{y:.1f}" r="2.5" fill="{color}"/>' for x, y in (xy(s, v) for s, v in pts)]
        lx = WIDTH - RIGHT - 150
        ly = TOP + 16 + 18 * i
        parts.append(f'<line x1="{lx}" y1="{ly - 4}" x2="{lx + 24}" y2="{ly - 4}" stroke="{color}" stroke-width="2"/>'
                     f'<text x="{lx + 30}" y="{ly}">{label}</text>')
    parts.append("</svg>\n")
    return "\n".join(parts)


def write_loss_curve(metrics_path: Path, out_path: Path, title: str = "loss") -> Path:
    """Write :func:`render_svg` of ``metrics_path`` to ``out_path``; returns ``out_path``."""
    out_path = Path(out_path)
    out_path.write_text(render_svg(read_series(Path(metrics_path)), title))
    return out_path
