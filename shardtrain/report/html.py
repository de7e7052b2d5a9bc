"""``shardtrain report``: run directories -> one self-contained HTML page and a PNG per panel.

The page needs no network and no script to show: each panel is its PNG inline (the same bytes as
the file beside the page), and the plotted data sits in the page as JSON
(``<script type="application/json" id="shardtrain-report-data">``) for programs to read back.
"""

from __future__ import annotations

import base64
import datetime
import html
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from shardtrain.diagnostics.failures import describe
from shardtrain.errors import ReportError
from shardtrain.report.figures import draw_panels, png_bytes, run_colours
from shardtrain.report.panels import Panel, build_panels, rate_key, run_unit, seen_count, unit_of
from shardtrain.report.runs import Run, config_differences, load_runs, number_or_none, restarts_so_far
from shardtrain.version import __version__

DATA_ID = "shardtrain-report-data"
STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px auto; max-width: 1100px; color: #222; }
h1 { font-size: 22px; } h2 { font-size: 16px; margin: 28px 0 6px; }
table { border-collapse: collapse; font-size: 13px; margin: 8px 0; }
th, td { border: 1px solid #ddd; padding: 4px 8px; text-align: left; vertical-align: top; }
th { background: #f4f4f4; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
img { max-width: 100%; border: 1px solid #eee; margin-top: 14px; } .note { color: #555; font-size: 13px; }
.swatch { display: inline-block; width: 10px; height: 10px; margin-right: 6px; }
code { font-size: 12px; }
"""


@dataclass
class Report:
    runs: list[Run]
    panels: list[Panel]
    figures: dict[str, Figure]  # panel id -> its matplotlib figure
    html_path: Path
    png_paths: list[Path]


def default_png_dir(out: Path) -> Path:
    """``report.html`` -> ``report_files/`` beside it (as browsers save a page)."""
    return out.with_name(out.stem + "_files")


def _json_safe(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def report_data(runs: list[Run], panels: list[Panel], differences: dict[str, list[Any]]) -> dict:
    """Everything the page shows, as data: runs, config differences, each panel's plotted series."""
    return _json_safe({
        "shardtrain_version": __version__,
        "runs": [{"name": run.name, "path": str(run.path), "attempts": [vars(s) for s in run.starts],
                  "unreadable_lines": run.unreadable_lines} for run in runs],
        "config_differences": differences,
        "panels": {panel.id: panel.as_json() for panel in panels},
    })


def _number(value: float | None, digits: int = 4) -> str:
    """``digits`` significant digits, trailing zeros kept: a loss of 4.0000 read "4" beside 3.987;
    NaN and infinities as ``nan``, ``inf``."""
    if value is None:
        return ""
    return f"{value:#.{digits}g}" if math.isfinite(value) else f"{value}"


def torchrun_restarts(counts: list[int]) -> int:
    """Restarts over a run's jobs from its start records' ``restart_count``, in order."""
    return restarts_so_far(counts)[-1] if counts else 0


def seen_cell(record: dict, unit: str, own_unit: str) -> str:
    """A run's count so far, in the table's unit, or with its own unit named where it counts another."""
    count = seen_count(record, own_unit)
    if count is None:
        return ""
    return f"{count:.0f}" + ("" if own_unit == unit else f" {html.escape(own_unit)}")


def _runs_table(runs: list[Run], colours: dict[str, str], unit: str) -> str:
    rows = []
    for run in runs:
        train = run.of("train")
        # an evaluation between logging steps writes a record of val_* fields only
        counted = [r for r in train if seen_count(r, run_unit(run)) is not None]
        # As logged: a NaN or infinite value shows as such (left blank, a diverged last loss read as
        # none logged, and an infinite val_loss was passed over for an earlier one; found by review)
        losses = [number_or_none(r["loss"]) for r in train if "loss" in r]
        logged_vals = [number_or_none(r["val_loss"]) for r in train if "val_loss" in r]
        vals = [v for v in logged_vals if v is not None and math.isfinite(v)]
        averaged = [v for v in run.values("train", "ema_val_loss")[1] if v is not None]
        unfinished = sum(1 for v in logged_vals if v is not None and not math.isfinite(v))
        best_val = _number(min(vals) if vals else None) + (
            f" (average {_number(min(averaged))})" if averaged else "") + (
            f" ({unfinished} not finite)" if unfinished else "")
        resumes = sum(1 for s in run.starts if s.resumed_from)
        restarts = torchrun_restarts([s.restart_count for s in run.starts])
        worlds = sorted({s.world_size for s in run.starts if s.world_size})
        skipped = f"; {run.unreadable_lines} unreadable line(s) skipped" if run.unreadable_lines else ""
        rows.append(
            f"<tr><td><span class=swatch style='background:{colours[run.name]}'></span>"
            f"{html.escape(run.name)}</td><td><code>{html.escape(str(run.path))}</code>{skipped}</td>"
            f"<td class=num>{train[-1]['step']}</td>"
            f"<td class=num>{seen_cell(counted[-1] if counted else {}, unit, run_unit(run))}</td>"
            f"<td class=num>{_number(losses[-1] if losses else None)}</td>"
            f"<td class=num>{best_val}</td>"
            f"<td class=num>{len(run.starts)}</td><td class=num>{resumes}</td><td class=num>{restarts}</td>"
            f"<td>{html.escape(', '.join(map(str, worlds)))}</td><td class=num>{len(run.of('skip'))}</td>"
            f"<td>{html.escape(ending(run))}</td></tr>")
    return ("<table><tr><th>run</th><th>directory</th><th>last step</th>"
            f"<th>{html.escape(unit)} seen</th>"
            "<th>last loss</th><th>best val_loss</th><th>attempts</th><th>resumes</th>"
            "<th>torchrun restarts</th><th>world size</th><th>skipped steps</th><th>ended</th></tr>"
            + "".join(rows) + "</table>")


def ending(run: Run) -> str:
    """How the run's last attempt ended, from its ``end`` record and its failure record: a run that
    was killed (SIGKILL, the out-of-memory killer, a node lost) writes neither."""
    last = run.starts[-1] if run.starts else None
    if run.failure is not None:
        return describe(run.failure)
    if last is None or last.outcome is None:
        return "no end recorded: still running, or killed without a record"
    return last.outcome if last.outcome == "finished" else f"{last.outcome} at step {last.ended_at}"


def _differences_table(runs: list[Run], differences: dict[str, list[Any]]) -> str:
    if len(runs) < 2:
        return "<p class=note>One run: nothing to compare.</p>"
    if not differences:
        return "<p class=note>The runs' configurations are the same (run.dir aside).</p>"
    head = "".join(f"<th>{html.escape(run.name)}</th>" for run in runs)
    rows = "".join(
        f"<tr><td><code>{html.escape(key)}</code></td>"
        + "".join(f"<td>{html.escape(json.dumps(v, ensure_ascii=False))}</td>" for v in values) + "</tr>"
        for key, values in differences.items())
    return f"<table><tr><th>config key</th>{head}</tr>{rows}</table>"


def page_html(runs: list[Run], panels: list[Panel], pngs: dict[str, bytes],
              differences: dict[str, list[Any]]) -> str:
    colours = run_colours([run.name for run in runs])
    # Inside <script> a '<!--' or '</script' in a run's name or config ends or swallows the block:
    # the markup characters are JSON escapes there, equal once parsed.
    data = json.dumps(report_data(runs, panels, differences), allow_nan=False)
    data = data.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    contents = " · ".join(f"<a href='#{panel.id}'>{html.escape(panel.title)}</a>" for panel in panels)
    # The figure carries its title (the PNGs stand alone); the section is its anchor.
    sections = "".join(
        f"<section id='{panel.id}'>"
        f"<img alt='{html.escape(panel.title)}' src='data:image/png;base64,"
        f"{base64.b64encode(pngs[panel.id]).decode()}'>"
        + (f"<p class=note>{html.escape(panel.note)}</p>" if panel.note else "") + "</section>"
        for panel in panels)
    names = ", ".join(run.name for run in runs)
    made = datetime.datetime.now().isoformat(timespec="seconds")
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>shardtrain report: {html.escape(names)}</title>
<style>{STYLE}</style></head><body>
<h1>shardtrain report: {html.escape(names)}</h1>
<p class=note>Made {made} by shardtrain {__version__} from each run's metrics.jsonl and config.yaml.
Dashed vertical lines: an attempt that resumed (or a torchrun restart); each curve is the run that
continued (a step logged again after a resume replaces the earlier record).</p>
<h2>Runs</h2>{_runs_table(runs, colours, unit_of(rate_key(runs)))}
<h2>Config differences</h2>{_differences_table(runs, differences)}
<h2>Panels</h2><p class=note>{contents}</p>
{sections}
<script type="application/json" id="{DATA_ID}">{data}</script>
</body></html>
"""


def write_report(run_dirs: list[str | Path], out: str | Path, png_dir: str | Path | None = None) -> Report:
    """Read the runs, draw every panel once, write ``out`` (HTML) and one PNG per panel into
    ``png_dir`` (default: ``<out stem>_files/`` beside ``out``)."""
    if not run_dirs:
        raise ReportError("no run directory given: shardtrain report RUN_DIR [RUN_DIR ...] --out report.html")
    out = Path(out)
    if out.is_dir():
        raise ReportError(f"--out {str(out)!r} is a directory; give the HTML file to write, e.g. "
                          f"{out / 'report.html'}")
    if out.suffix.lower() in (".png", ".svg", ".pdf", ".jpg", ".jpeg"):
        raise ReportError(f"--out {str(out)!r} names an image; --out is the HTML page (e.g. "
                          f"{out.with_suffix('.html')}), and the PNGs go to --png-dir")
    if out.is_file() and out.suffix.lower() not in (".html", ".htm"):
        # A page is written over an earlier page only: not over a run's metrics.jsonl or config.
        raise ReportError(f"--out {str(out)!r} exists and is not an HTML page; name a new file or an "
                          ".html one to replace")
    if png_dir is not None and Path(png_dir).exists() and not Path(png_dir).is_dir():
        raise ReportError(f"--png-dir {str(png_dir)!r} is a file; give a directory for the PNGs")
    png_dir = Path(png_dir) if png_dir is not None else default_png_dir(out)
    runs = load_runs(run_dirs)
    panels = build_panels(runs)
    figures = draw_panels(panels, [run.name for run in runs])
    pngs = {panel_id: png_bytes(figure) for panel_id, figure in figures.items()}
    try:
        png_dir.mkdir(parents=True, exist_ok=True)
        png_paths = []
        for panel_id, data in pngs.items():
            png_paths.append(png_dir / f"{panel_id}.png")
            png_paths[-1].write_bytes(data)
        out.parent.mkdir(parents=True, exist_ok=True)
        # Written beside, then renamed: a write that fails half way leaves the earlier page whole.
        partial = out.with_name(f".{out.name}.partial")
        try:
            partial.write_text(page_html(runs, panels, pngs, config_differences(runs)), encoding="utf-8",
                               errors="replace")
            os.replace(partial, out)
        finally:
            partial.unlink(missing_ok=True)
    except OSError as exc:
        raise ReportError(f"cannot write the report: {exc.strerror}: {exc.filename}") from exc
    return Report(runs, panels, figures, out, png_paths)
