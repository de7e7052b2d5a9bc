"""The panels drawn with matplotlib, one figure per panel, on the Agg canvas (files, never a display).

Figures are made with ``matplotlib.figure.Figure`` rather than pyplot: no global figure registry to
leak into, no backend chosen by the environment. Each drawn artist carries a ``gid`` of
``"<run>|<label>"`` so the plotted data can be found again on the figure.
"""

from __future__ import annotations

import io
from collections import Counter

import matplotlib
import numpy as np
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure

from shardtrain.report.panels import Bars, Line, Panel

SIZE_INCHES = (10.0, 4.2)
DPI = 100
# Runs are told apart by colour; what a line is, by its style.
RUN_COLOURS = [matplotlib.colors.to_hex(c) for c in matplotlib.colormaps["tab10"].colors]
PART_COLOURS = {"params": "#4c72b0", "grads": "#dd8452", "optimizer": "#55a868"}
REST_COLOUR = "#bdbdbd"
NAMES = {"loss": "train loss", "val_loss": "validation loss",
         "ema_val_loss": "validation loss of the weights' average", "blocked_s": "blocking save",
         "blocked_s async": "async save (blocked part)", "clipped": "clipped (norm above threshold)",
         "params": "parameters", "grads": "gradients", "optimizer": "optimizer state"}
POINT_MARKERS = {"clipped": "x", "blocked_s": "o", "blocked_s async": "s", "ema_val_loss": "D"}
MARKER_STYLES = {"resume": (0, (5, 3)), "restart": "-.", "skip": ":"}


def gid(run: str, label: str) -> str:
    return f"{run}|{label}"


def run_colours(runs: list[str]) -> dict[str, str]:
    return {run: RUN_COLOURS[i % len(RUN_COLOURS)] for i, run in enumerate(runs)}


def _values(values: list[float | None]) -> np.ndarray:
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def isolated_points(y: np.ndarray) -> list[int]:
    """Indices of values with no value beside them (a lone point, or one between skipped steps),
    which a line alone would not draw."""
    finite = np.isfinite(y)
    before = np.concatenate(([False], finite[:-1]))
    after = np.concatenate((finite[1:], [False]))
    return np.flatnonzero(finite & ~before & ~after).tolist()


def _draw_line(ax: Axes, line: Line, colour: str, label: str) -> None:
    lone = isolated_points(_values(line.y))
    style = {"line": {"linestyle": "-", "marker": "o" if lone else None, "markevery": lone or None,
                      "markersize": 3},
             "marked": {"linestyle": "--", "marker": POINT_MARKERS.get(line.label, "o"), "markersize": 4},
             "points": {"linestyle": "none", "marker": POINT_MARKERS.get(line.label, "o"), "markersize": 6,
                        "markerfacecolor": "none" if line.label.endswith("async") else colour}}[line.style]
    ax.plot(np.array(line.x, dtype=float), _values(line.y), color=colour, label=label,
            gid=gid(line.run, line.label), linewidth=1.4, **style)


def _draw_bars(ax: Axes, bars: Bars, colours: dict[str, str]) -> None:
    runs = list(bars.values)
    width = 0.8 / len(runs)
    positions = np.arange(len(bars.groups), dtype=float)
    for index, run in enumerate(runs):
        x = positions - 0.4 + width * (index + 0.5)
        bottom = np.zeros(len(bars.groups))
        for part in bars.parts:
            heights = np.array(bars.values[run][part], dtype=float)
            container = ax.bar(x, heights, width * 0.9, bottom=bottom,
                               color=PART_COLOURS.get(part, REST_COLOUR), edgecolor=colours[run],
                               linewidth=1.2, label=NAMES.get(part, part) if index == 0 else None)
            for rectangle in container:
                rectangle.set_gid(gid(run, part))
            bottom += heights
        if len(runs) > 1:
            for xi, top in zip(x, bottom):
                ax.annotate(literal(run), (xi, top), textcoords="offset points", xytext=(0, 2), ha="center",
                            fontsize=7, color=colours[run], rotation=90, va="bottom")
    ax.set_xticks(positions, bars.groups)
    ax.margins(y=0.25)


def literal(text: str) -> str:
    """A label as written: matplotlib reads $...$ as math (a run directory named a$b failed the
    report with a ValueError, a$1$b printed as math), and leaves a label starting with _ out of the
    legend (a run directory named _base lost its entry): a zero-width space goes before it."""
    text = text.replace("$", r"\$")
    return "\u200b" + text if text.startswith("_") else text


def draw_panel(panel: Panel, colours: dict[str, str]) -> Figure:
    """One panel as a figure (its own Agg canvas)."""
    figure = Figure(figsize=SIZE_INCHES, dpi=DPI, layout="constrained")
    FigureCanvasAgg(figure)
    ax = figure.add_subplot()
    ax.set_title(literal(panel.title), fontsize=11, loc="left")
    ax.set_xlabel(literal(panel.xlabel))
    ax.set_ylabel(literal(panel.ylabel))
    ax.grid(alpha=0.3)
    several = len(colours) > 1
    if panel.bars is not None:
        _draw_bars(ax, panel.bars, colours)
    for line in panel.lines:
        name = NAMES.get(line.label, line.label)
        _draw_line(ax, line, colours[line.run], literal(f"{line.run}: {name}" if several else name))
    for level in panel.levels:
        ax.axhline(level.y, color=colours[level.run], linestyle=":", linewidth=1.2,
                   label=literal(level.label), gid=gid(level.run, "clip"))
    # One legend entry for a run's skipped steps of one reason, however many (100 entries hid the plot).
    skips = Counter((marker.run, marker.reason) for marker in panel.markers if marker.kind == "skip")
    named: set[tuple[str, str]] = set()
    for marker in panel.markers:
        colour = "#d62728" if marker.kind == "skip" else colours[marker.run]
        label = literal(marker.label)
        group = (marker.run, marker.reason)
        if marker.kind == "skip" and skips[group] > 1:
            label = "_nolegend_" if group in named else literal(
                f"{marker.run}: {skips[group]} steps skipped ({marker.reason})")
            named.add(group)
        ax.axvline(marker.x, color=colour, linestyle=MARKER_STYLES[marker.kind], linewidth=1.1,
                   alpha=0.8, label=label, gid=gid(marker.run, marker.kind))
    if panel.log_y:
        ax.set_yscale("log")
    elif panel.zero_based and not panel.empty:
        ax.set_ylim(bottom=0)
    if panel.empty:
        ax.text(0.5, 0.5, "not logged by these runs", transform=ax.transAxes, ha="center",
                va="center", color="#777777")
    handles = ax.get_legend_handles_labels()[0]
    if handles:  # below the axes: the plot keeps the figure's width whatever the labels' length
        figure.legend(loc="outside lower center", ncols=min(len(handles), 3), fontsize=8, frameon=False)
    return figure


def draw_panels(panels: list[Panel], runs: list[str]) -> dict[str, Figure]:
    """Panel id -> figure, for the runs named in page order (their colours follow that order)."""
    colours = run_colours(runs)
    return {panel.id: draw_panel(panel, colours) for panel in panels}


def png_bytes(figure: Figure) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", dpi=DPI)
    return buffer.getvalue()
