"""`kvbench report RESULT.json --out DIR`: the plots of a result plus `index.html` and `index.md`
pages that show them beside the metric tables (the same rows as `kvbench run` prints)."""

from __future__ import annotations

import html
import math
import re
from pathlib import Path

from ..errors import InputError
from ..outfile import write_files
from ..results import MergedRun, is_number, merge_repeats
from .plots import plot_bars, plot_blocks, plot_hit_rate
from .tables import table_rows


def write_report(result: dict, out_dir: str | Path, source: str = "result") -> list[Path]:
    """Write every plot of `result` and the two index pages into `out_dir`; returns the files
    written. Repeats of a run are merged (median metrics, first repeat's timeline). Timelines
    that are not what kvbench writes are refused (InputError naming `source` and the run)
    before any file is written; a failure after that removes what this call wrote, so no
    partial report is left behind."""
    _check_timelines(result, source)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    by_workload: dict[str, list[MergedRun]] = {}
    for run in merge_repeats(result).values():
        by_workload.setdefault(run.workload, []).append(run)
    written: list[Path] = []
    try:
        sections = []
        for workload, runs in by_workload.items():
            stem = _slug(workload)
            bars = plot_bars(workload, runs, out_dir / f"{stem}--bars.png")
            written += [bars] if bars else []
            per_run = []
            for run in runs:
                base = out_dir / f"{stem}--{_slug(run.variant)}"
                images = [p for p in (plot_blocks(run, Path(f"{base}--blocks.png")),
                                      plot_hit_rate(run, Path(f"{base}--hit_rate.png"))) if p]
                per_run.append((run.variant, images))
                written += images
            sections.append((workload, bars, _table(runs), per_run))
        title = f"kvbench report: {(result.get('workload') or {}).get('name', 'result')}"
        env = result.get("environment") or {}
        facts = [f"kvbench {result.get('kvbench_version', '?')}"] + [
            f"{k} {env[k]}" for k in ("device", "machine", "platform", "python", "cpu_count")
            if k in env]
        for name, render in (("index.html", _html), ("index.md", _markdown)):
            path = out_dir / name
            write_files([(path, render(title, facts, sections).encode())])
            written.append(path)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise
    return written


def _check_timelines(result: dict, source: str) -> None:
    """Timelines as the plots read them: columns of numbers, all of one length, and a
    positive integer stride (`read_result` checked the rest)."""
    for i, run in enumerate(result["runs"]):
        timeline = run.get("timeline") or {}
        where = f"{source}: runs[{i}].timeline"
        columns = timeline.get("columns")
        if columns is None:
            continue
        if not isinstance(columns, dict):
            raise InputError(f"{where}.columns: expected a mapping of columns")
        lengths = set()
        for name, column in columns.items():
            if not isinstance(column, list) or not all(
                    is_number(v) and not isinstance(v, bool) and math.isfinite(v)
                    for v in column):
                raise InputError(f"{where}.columns.{name}: expected a list of finite numbers")
            lengths.add(len(column))
        if len(lengths) > 1:
            raise InputError(f"{where}.columns: columns of different lengths")
        stride = timeline.get("stride", 1)
        if not (isinstance(stride, int) and not isinstance(stride, bool) and stride >= 1):
            raise InputError(f"{where}.stride: expected a positive integer (got {stride!r:.40})")


Table = tuple[list[str], list[tuple[str, list[str]]]]
"""(column names, [(section, row cells)]): the metric rows any run of the workload has."""


def _table(runs: list[MergedRun]) -> Table:
    header = ["metric"] + [r.variant for r in runs]
    return header, [(section, [label.strip(), *cells])
                    for section, label, cells in table_rows([r.metrics for r in runs])]


def _html(title: str, facts: list[str], sections) -> str:
    e = html.escape
    parts = [
        "<!doctype html>",
        '<html><head><meta charset="utf-8">',
        f"<title>{e(title)}</title>",
        "<style>body{font-family:sans-serif;max-width:1200px;margin:2em auto}"
        "table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:2px 8px}"
        "td{text-align:right}td:first-child{text-align:left}th.section{text-align:left;"
        "background:#eee}img{max-width:100%}.pair{display:flex;gap:1em}.pair img{width:50%}"
        "</style></head><body>",
        f"<h1>{e(title)}</h1>",
        f"<p>{e(' · '.join(facts))}</p>",
    ]
    for workload, bars, (header, rows), per_run in sections:
        parts.append(f"<h2>{e(workload)}</h2>")
        if bars:
            parts.append(f'<img src="{e(bars.name)}" alt="{e(workload)} headline metrics">')
        parts.append("<table><tr>" + "".join(f"<th>{e(h)}</th>" for h in header) + "</tr>")
        current = None
        for section, cells in rows:
            if section != current:
                current = section
                parts.append(f'<tr><th class="section" colspan="{len(header)}">'
                             f"{e(section)}</th></tr>")
            parts.append("<tr>" + "".join(f"<td>{e(c)}</td>" for c in cells) + "</tr>")
        parts.append("</table>")
        for variant, images in per_run:
            if images:
                parts.append(f"<h3>{e(variant)}</h3><div class=\"pair\">")
                parts += [f'<img src="{e(p.name)}" alt="{e(p.stem)}">' for p in images]
                parts.append("</div>")
    parts.append("</body></html>\n")
    return "\n".join(parts)


def _markdown(title: str, facts: list[str], sections) -> str:
    lines = [f"# {title}", "", " · ".join(facts), ""]
    for workload, bars, (header, rows), per_run in sections:
        lines += [f"## {workload}", ""]
        if bars:
            lines += [f"![{workload} headline metrics]({bars.name})", ""]
        lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
        current = None
        for section, cells in rows:
            if section != current:
                current = section
                lines.append(f"| **{section}** |" + " |" * (len(header) - 1))
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        lines.append("")
        for variant, images in per_run:
            if images:
                lines += [f"### {variant}", ""] + [f"![{p.stem}]({p.name})" for p in images] + [""]
    return "\n".join(lines)


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", name).strip("-") or "run"
