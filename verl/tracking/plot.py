"""`verl plot RUN_DIR`: the metrics of a run as terminal sparklines, a self-contained SVG, and a PNG.

No plotting library is needed for the first two: an SVG of small line charts opens in any browser, and the
sparklines answer "is it learning?" over SSH. The PNG (labelled axes, for a report or a chat) needs
matplotlib, an optional extra; without it `verl plot` says how to install it and writes the rest.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

from verl.errors import VerlError, install_hint
from verl.tracking.tracker import read_metrics

DEFAULT_KEYS = ("reward/mean", "val/accuracy", "val/score", "val/loss", "actor/pg_loss", "actor/entropy",
                "actor/approx_kl", "critic/vf_loss", "response/length_mean", "loss", "accuracy", "eval/loss")
BARS = "▁▂▃▄▅▆▇█"


def series(rows: Sequence[dict], key: str) -> list[tuple[int, float]]:
    out = []
    for row in rows:
        value = row.get(key)
        if isinstance(value, (int, float)) and math.isfinite(value):
            out.append((int(row["step"]), float(value)))
    return out


def sparkline(values: Sequence[float], width: int = 40) -> str:
    if not values:
        return ""
    if len(values) > width:  # average into `width` buckets
        size = len(values) / width
        values = [sum(values[int(i * size):int((i + 1) * size)]) / max(1, int((i + 1) * size) - int(i * size))
                  for i in range(width)]
    low, high = min(values), max(values)
    span = high - low or 1.0
    return "".join(BARS[round((v - low) / span * (len(BARS) - 1))] for v in values)


def polyline(points: Sequence[tuple[int, float]], x0: float, y0: float, width: float, height: float) -> str:
    """SVG points of `points` scaled into the box at (x0, y0): steps left to right, values bottom to top."""
    steps, values = [p[0] for p in points], [p[1] for p in points]
    s_lo, s_span = min(steps), (max(steps) - min(steps)) or 1
    v_lo, v_span = min(values), (max(values) - min(values)) or 1
    return " ".join(f"{x0 + (s - s_lo) / s_span * width:.1f},{y0 + height - (v - v_lo) / v_span * height:.1f}"
                    for s, v in points)


def svg_charts(charts: dict[str, list[tuple[int, float]]], title: str) -> str:
    w, h, pad, cols = 360, 200, 36, 2
    rows = math.ceil(len(charts) / cols)
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{cols * w}" height="{rows * h + 30}" '
             'font-family="sans-serif" font-size="11">',
             f'<text x="10" y="20" font-size="14">{escape(title)}</text>']
    for i, (key, points) in enumerate(charts.items()):
        x0, y0 = (i % cols) * w, 30 + (i // cols) * h
        values = [v for _, v in points]
        parts += [
            f'<rect x="{x0 + pad}" y="{y0 + pad}" width="{w - 2 * pad}" height="{h - 2 * pad}" fill="none" '
            'stroke="#ccc"/>',
            f'<text x="{x0 + pad}" y="{y0 + pad - 6}">{escape(key)}</text>',
            f'<text x="{x0 + 2}" y="{y0 + pad + 4}">{max(values):.3g}</text>',
            f'<text x="{x0 + 2}" y="{y0 + h - pad}">{min(values):.3g}</text>',
            f'<text x="{x0 + w - pad - 40}" y="{y0 + h - pad + 14}">step {points[-1][0]}</text>',
            '<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="'
            + polyline(points, x0 + pad, y0 + pad, w - 2 * pad, h - 2 * pad) + '"/>',
        ]
    parts.append("</svg>")
    return "\n".join(parts)


def plot_run(run_dir: str | Path, keys: Sequence[str] | None = None,
             out: str | Path | None = None) -> tuple[Path, dict]:
    run_dir = Path(run_dir)
    metrics = run_dir / "metrics.jsonl"
    if not metrics.is_file():
        raise VerlError(f"{metrics} does not exist; pass a run directory written by `verl train` "
                        "(with logging.backends including jsonl)")
    rows = read_metrics(metrics)
    wanted = list(keys) if keys else [k for k in DEFAULT_KEYS]
    charts = {k: s for k in wanted if (s := series(rows, k))}
    if not charts:
        known = sorted({k for row in rows for k in row if k != "step"})
        raise VerlError(f"none of {wanted} is in {metrics}; available keys: {', '.join(known)}")
    path = Path(out) if out else run_dir / "metrics.svg"
    path.write_text(svg_charts(charts, str(run_dir)), encoding="utf-8")
    return path, charts


PLOT_INSTALL_HINT = install_hint("matplotlib", "plot")


def png_figure(charts: dict[str, list[tuple[int, float]]], title: str) -> Any:
    """A matplotlib Figure with one line chart per metric: x axis `step`, y axis the metric's name."""
    from matplotlib.figure import Figure  # no pyplot: no global state, no GUI backend

    cols = 2 if len(charts) > 1 else 1
    rows = math.ceil(len(charts) / cols)
    fig = Figure(figsize=(6 * cols, 3.2 * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).flatten()
    for ax, (key, points) in zip(axes, charts.items(), strict=False):
        ax.plot([p[0] for p in points], [p[1] for p in points], marker="." if len(points) < 50 else None)
        ax.set_title(key)
        ax.set_xlabel("step")
        ax.set_ylabel(key)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", useOffset=False)  # real values on the axis, not "+6.63" and offsets
    for ax in axes[len(charts):]:
        fig.delaxes(ax)
    fig.suptitle(title)
    return fig


def write_png(charts: dict[str, list[tuple[int, float]]], title: str, path: str | Path) -> Path:
    """Save `png_figure` to `path`; a clear VerlError with the install command when matplotlib is missing."""
    try:
        import matplotlib  # noqa: F401
    except ImportError as exc:
        raise VerlError(f"writing a PNG needs matplotlib, which is not installed. Fix: {PLOT_INSTALL_HINT} "
                        "(or pass --no-png)") from exc
    path = Path(path)
    png_figure(charts, title).savefig(path, dpi=100)
    return path


def run(args) -> int:
    from verl.utils.console import plain_console

    path, charts = plot_run(args.run_dir, args.keys.split(",") if args.keys else None, args.out)
    console = plain_console()  # metric names and paths verbatim
    width = max(len(k) for k in charts)
    for key, points in charts.items():
        values = [v for _, v in points]
        console.print(f"{key:<{width}}  {sparkline(values)}  {values[0]:.4g} -> {values[-1]:.4g}",
                      highlight=False, markup=False)
    console.print(f"wrote {path}", highlight=False, markup=False)
    if not args.no_png:
        png = Path(args.png) if args.png else Path(args.run_dir) / "metrics.png"
        try:
            console.print(f"wrote {write_png(charts, str(args.run_dir), png)}", highlight=False, markup=False)
        except VerlError as exc:  # the PNG is optional: say why there is none, keep exit 0
            console.print(f"no PNG: {exc}", highlight=False, markup=False)
    return 0


def register(subparsers) -> None:
    parser = subparsers.add_parser(
        "plot", help="Plot the metrics of a run directory.",
        description="Show a run's metrics as sparklines and write RUN_DIR/metrics.svg and, when matplotlib is "
        "installed, RUN_DIR/metrics.png (a chart per metric, labelled axes).")
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--keys", default=None, help="comma-separated metric names (default: the main ones)")
    parser.add_argument("--out", default=None, help="SVG path (default: RUN_DIR/metrics.svg)")
    parser.add_argument("--png", default=None, help="PNG path (default: RUN_DIR/metrics.png; needs matplotlib)")
    parser.add_argument("--no-png", action="store_true", help="do not write the PNG")
    parser.set_defaults(func=run)
