"""`kvbench compare BASE NEW`: a result JSON against a baseline, metric by metric.

Every run is keyed by (workload, variant). Several runs with the same key in one file are
repeats (`kvbench run --repeat N`); their numeric metrics are merged by the median, so a
measured timing is the median of its repeats. Each metric has a rule (`kvbench/metrics.py`):
which direction is better and how far it may move. Deterministic metrics (counts, hit rates, peaks,
modeled times on a fixed seed) get exact or epsilon tolerances; measured timings get a
percentage and are compared only between results from the same device.

Statuses, and whether they fail the comparison (exit 3):
  ok        within tolerance
  improved  better than the baseline beyond tolerance
  regressed worse than the baseline beyond tolerance                      (fails)
  mismatch  an input of the benchmark changed (requests, capacity, ideal
            or optimal hit rate, time source): the runs are not comparable  (fails)
  missing   in the baseline, absent from the current result                 (fails)
  changed   a deterministic metric without a better direction moved
  new       absent (or null) in the baseline, present now
  skipped   a measured value from a different device or time source
  info      not guarded: wall time, and metrics this version does not know

A (workload, variant) of the baseline that the current result lacks makes the comparison
unusable (InputError, exit 2): a dropped workload must be a deliberate baseline update, not a
silent pass. Runs only in the current result are listed as not guarded yet.
"""

from __future__ import annotations

import html
from dataclasses import dataclass, field
from pathlib import Path

from .errors import InputError
from .metrics import Rule, format_number, metric
from .results import flatten_metrics, is_number, merge_repeats, read_result

DEFAULT_TIMING_TOLERANCE = 0.10
"""Relative tolerance of measured timings (median of repeats, same device)."""

MODELED_REL_TOL = 1e-6
"""Modeled times are deterministic, but float maths may differ in the last bits between numpy
or libm builds."""

DEVICE_KEYS = ("device", "cpu", "cpu_count")
"""Environment keys that must all be equal for measured values to be compared: the GPU model
(or cpu) and the CPU model, not the kernel build or platform string."""

FAILING = ("regressed", "mismatch", "missing")
STATUS_ORDER = ("regressed", "mismatch", "missing", "improved", "changed", "new", "skipped",
                "info", "ok")


@dataclass(frozen=True, slots=True)
class MetricRow:
    metric: str
    base: object
    new: object
    status: str
    tolerance: str = ""
    note: str = ""

    @property
    def failing(self) -> bool:
        return self.status in FAILING


@dataclass(slots=True)
class RunComparison:
    workload: str
    variant: str
    base_repeats: int
    new_repeats: int
    rows: list[MetricRow]
    notes: list[str] = field(default_factory=list)

    @property
    def title(self) -> str:
        return f"{self.workload} / {self.variant}"


@dataclass(slots=True)
class Comparison:
    base_name: str
    new_name: str
    base_device: str
    new_device: str
    same_device: bool
    runs: list[RunComparison]
    unguarded: list[str]
    """Runs in the current result that the baseline does not have."""

    @property
    def device_skips(self) -> bool:
        """Some measured value was not compared because the devices differ."""
        return any(row.note == "different device" for run in self.runs for row in run.rows)

    @property
    def failures(self) -> list[tuple[RunComparison, MetricRow]]:
        return [(run, row) for run in self.runs for row in run.rows if row.failing]

    def counts(self) -> dict[str, int]:
        counts = {status: 0 for status in STATUS_ORDER}
        for run in self.runs:
            for row in run.rows:
                counts[row.status] += 1
        return {status: n for status, n in counts.items() if n}

    def failure_line(self) -> str:
        """One line naming the failing metrics (the first few), for the exit-3 message."""
        failures = self.failures
        shown = [f"{run.title}: {row.metric} {format_number(row.base)} -> {format_number(row.new)} ({row.status})"
                 for run, row in failures[:5]]
        more = f"; and {len(failures) - 5} more" if len(failures) > 5 else ""
        return f"{len(failures)} failing metric(s) vs {self.base_name}: {'; '.join(shown)}{more}"


def compare_files(base_path: str | Path, new_path: str | Path, *,
                  timing_tolerance: float = DEFAULT_TIMING_TOLERANCE) -> Comparison:
    return compare_results(read_result(base_path), read_result(new_path),
                           timing_tolerance=timing_tolerance,
                           base_name=str(base_path), new_name=str(new_path))


def compare_results(base: dict, new: dict, *, timing_tolerance: float = DEFAULT_TIMING_TOLERANCE,
                    base_name: str = "baseline", new_name: str = "current") -> Comparison:
    """Judge every metric of every baseline run against the current result. Raises InputError
    when the current result lacks a (workload, variant) of the baseline."""
    base_runs, new_runs = merge_repeats(base), merge_repeats(new)
    absent = [key for key in base_runs if key not in new_runs]
    if absent:
        shown = ", ".join(f"{w}/{v}" for w, v in absent[:5])
        more = f" and {len(absent) - 5} more" if len(absent) > 5 else ""
        raise InputError(
            f"{new_name}: no run of {shown}{more}, which {base_name} has; run the whole suite, "
            "or update the baseline if the workload was dropped on purpose")
    base_env, new_env = base.get("environment") or {}, new.get("environment") or {}
    same_device = device_of(base_env) == device_of(new_env)
    judge = _Judge(same_device, timing_tolerance)
    runs = []
    for key, b in base_runs.items():
        n = new_runs[key]
        run = RunComparison(b.workload, b.variant, b.repeats, n.repeats,
                            judge.rows(b.metrics, n.metrics))
        changed = _config_changes(b.config, n.config)
        if changed:
            run.notes.append("config differs: " + "; ".join(changed))
        runs.append(run)
    return Comparison(
        base_name=base_name, new_name=new_name,
        base_device=describe_device(base_env), new_device=describe_device(new_env),
        same_device=same_device, runs=runs,
        unguarded=[f"{w}/{v}" for w, v in new_runs if (w, v) not in base_runs],
    )


def device_of(environment: dict) -> tuple:
    return tuple(environment.get(k) for k in DEVICE_KEYS)


def describe_device(environment: dict) -> str:
    return ", ".join(f"{k}={environment[k]}" for k in DEVICE_KEYS if k in environment) or "unknown"


def rule_for(name: str) -> Rule | None:
    """The rule of a metric, or of the metric a dotted name (`ttft_ms.p99`) is nested in
    (`kvbench/metrics.py`)."""
    m = metric(name)
    return m.rule if m is not None else None


# --- rendering -----------------------------------------------------------------------------------


def print_comparison(console, comparison: Comparison, *, show_all: bool = False) -> None:
    """Per run, its failures and improvements (every row with `show_all`) and its notes, then
    a one-line summary."""
    c = comparison
    if c.device_skips:
        _line(console, f"measured values not compared: baseline on {c.base_device}, current "
                       f"on {c.new_device}")
    folded = []  # runs shown by their notes alone
    for run in c.runs:
        rows = [row for row in run.rows if show_all or row.failing or row.status == "improved"]
        if rows:
            _print_rows(console, _run_heading(run), rows)
            for note in run.notes:
                _line(console, f"  {note}")
        elif run.notes:
            folded.append(run)
    if show_all or len(folded) == 1:
        for run in folded:
            for note in run.notes:
                _line(console, f"{run.title}: {note}")
    elif folded:
        _line(console, f"{len(folded)} runs have notes, such as {folded[0].title}: "
                       f"{folded[0].notes[0]}; --all shows them")
    if c.unguarded:
        _line(console, "not in the baseline (not guarded until it is updated): "
                       + ", ".join(c.unguarded))
    _line(console, _summary_line(c) + ("" if show_all else " (--all shows every row)"))


def _print_rows(console, title: str, rows: list[MetricRow]) -> None:
    """A table of one run's metric rows. Numbers never wrap or get cropped (a cut number reads
    as another number): a table wider than the console is printed at its own width."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from .report.tables import print_wide

    colors = {"regressed": "red", "mismatch": "red", "missing": "red", "improved": "green",
              "changed": "yellow", "skipped": "dim", "info": "dim", "new": "cyan"}
    table = Table(title=title, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False,
                  collapse_padding=True)
    table.add_column("metric", no_wrap=True)
    for name in ("baseline", "current", "change", "tolerance"):
        table.add_column(name, justify="right", no_wrap=True)
    table.add_column("status", no_wrap=True)
    for row in rows:
        color = colors.get(row.status)
        status = f"[{color}]{row.status}[/{color}]" if color else row.status
        cells = (row.metric, format_number(row.base), format_number(row.new),
                 _change(row.base, row.new), row.tolerance)
        table.add_row(*map(escape, cells), status + (f" ({row.note})" if row.note else ""))
    print_wide(console, table)


def _line(console, text: str) -> None:
    console.print(text, highlight=False, markup=False, soft_wrap=True)


def to_json(comparison: Comparison) -> dict:
    """The comparison as data (`compare --json`), for a CI step that annotates or gates on it:
    the verdict, the counts by status, and every row of every run."""
    c = comparison
    return {
        "baseline": c.base_name, "current": c.new_name,
        "baseline_device": c.base_device, "current_device": c.new_device,
        "same_device": c.same_device, "failing": len(c.failures), "counts": c.counts(),
        "runs": [{"workload": run.workload, "variant": run.variant,
                  "baseline_repeats": run.base_repeats, "current_repeats": run.new_repeats,
                  "notes": list(run.notes),
                  "rows": [{"metric": row.metric, "baseline": row.base, "current": row.new,
                            "status": row.status, "tolerance": row.tolerance,
                            "note": row.note} for row in run.rows]}
                 for run in c.runs],
        "unguarded": list(c.unguarded),
    }


def to_markdown(comparison: Comparison) -> str:
    """A job-summary / PR-comment page: verdict, the rows that are not ok, all rows folded."""
    c = comparison
    verdict = (f"{len(c.failures)} failing metric(s)" if c.failures else "no regressions")
    lines = [
        f"## kvbench compare: {verdict}",
        "",
        f"Baseline `{c.base_name}` ({c.base_device}) vs current `{c.new_name}` ({c.new_device}).",
        "",
        _summary_line(c),
        "",
    ]
    if c.device_skips:
        lines += ["Measured values were not compared: the results come from different devices.", ""]
    notable = sorted(((run, row) for run in c.runs for row in run.rows
                      if row.status not in ("ok", "info")),
                     key=lambda pair: STATUS_ORDER.index(pair[1].status))
    if notable:
        lines += _md_table(("workload / variant", "metric", "baseline", "current", "change",
                            "tolerance", "status"),
                           [(run.title, *_md_cells(row)) for run, row in notable])
        lines.append("")
    notes = [f"- {run.title}: {note}" for run in c.runs for note in run.notes]
    if c.unguarded:
        notes.append("- not in the baseline (not guarded until it is updated): "
                     + ", ".join(c.unguarded))
    if notes:
        lines += notes + [""]
    lines += [f"<details><summary>All metrics ({len(c.runs)} runs)</summary>", ""]
    for run in c.runs:
        lines += [f"### {_run_heading(run)}", ""]
        lines += _md_table(("metric", "baseline", "current", "change", "tolerance", "status"),
                           [_md_cells(row) for row in run.rows])
        lines.append("")
    lines += ["</details>", ""]
    return "\n".join(lines)


# --- judging -------------------------------------------------------------------------------------


class _Judge:
    def __init__(self, same_device: bool, timing_tolerance: float) -> None:
        self.same_device = same_device
        self.timing_tolerance = timing_tolerance

    def rows(self, base: dict, new: dict) -> list[MetricRow]:
        flat_base, flat_new = flatten_metrics(base), flatten_metrics(new)
        modeled = base.get("time_source") == new.get("time_source") == "modeled"
        same_time_source = base.get("time_source") == new.get("time_source")
        names = list(flat_base) + [k for k in flat_new if k not in flat_base]
        return [self.row(name, flat_base.get(name), flat_new.get(name), modeled, same_time_source)
                for name in names]

    def row(self, name: str, b, n, modeled: bool, same_time_source: bool) -> MetricRow:
        rule = rule_for(name)
        if rule is None or rule.better == "info":
            return MetricRow(name, b, n, "info")
        if b is None and n is None:
            return MetricRow(name, b, n, "ok")
        if n is None:
            return MetricRow(name, b, n, "missing")
        if b is None:
            return MetricRow(name, b, n, "new")
        abs_tol, rel_tol = rule.abs_tol, rule.rel_tol
        if rule.scope == "time":
            if not same_time_source:
                return MetricRow(name, b, n, "skipped", note="time sources differ")
            if modeled:
                rel_tol = max(rel_tol, MODELED_REL_TOL)
            elif self.same_device:
                rel_tol = self.timing_tolerance
            else:
                return MetricRow(name, b, n, "skipped", note="different device")
        elif rule.scope == "measured":
            if not self.same_device:
                return MetricRow(name, b, n, "skipped", note="different device")
            rel_tol = self.timing_tolerance
        elif rule.scope == "device" and not self.same_device:
            return MetricRow(name, b, n, "skipped", note="different device")
        tolerance = _tolerance_text(abs_tol, rel_tol)
        if not (is_number(b) and is_number(n)):
            same = b == n
            status = "ok" if same else ("mismatch" if rule.better == "match" else "changed")
            return MetricRow(name, b, n, status, tolerance)
        diff = float(n) - float(b)
        if abs(diff) <= max(abs_tol, rel_tol * abs(float(b))):
            return MetricRow(name, b, n, "ok", tolerance)
        if rule.better == "match":
            return MetricRow(name, b, n, "mismatch", tolerance)
        if rule.better == "either":
            return MetricRow(name, b, n, "changed", tolerance)
        better = diff > 0 if rule.better == "higher" else diff < 0
        return MetricRow(name, b, n, "improved" if better else "regressed", tolerance)


def _config_changes(base: dict, new: dict, limit: int = 5) -> list[str]:
    flat_base, flat_new = flatten_metrics(base), flatten_metrics(new)
    changed = [f"{k} {format_number(flat_base.get(k))} -> {format_number(flat_new.get(k))}"
               for k in sorted(flat_base.keys() | flat_new.keys())
               if flat_base.get(k) != flat_new.get(k)]
    return changed[:limit] + ([f"and {len(changed) - limit} more"] if len(changed) > limit else [])


# --- formatting ----------------------------------------------------------------------------------


def _change(b, n) -> str:
    if not (is_number(b) and is_number(n)) or isinstance(b, bool) or isinstance(n, bool):
        return ""
    diff = n - b
    if diff == 0:
        return "0"
    if b:
        return f"{100 * diff / abs(b):+.3g}%"
    return f"{diff:+,}" if isinstance(diff, int) else f"{diff:+.4g}"


def _tolerance_text(abs_tol: float, rel_tol: float) -> str:
    parts = ([f"±{abs_tol:g}"] if abs_tol else []) + ([f"±{100 * rel_tol:g}%"] if rel_tol else [])
    return " or ".join(parts) or "exact"


def _run_heading(run: RunComparison) -> str:
    reps = ""
    if run.base_repeats > 1 or run.new_repeats > 1:
        reps = f" (median of {run.base_repeats} / {run.new_repeats} repeats)"
    return run.title + reps


def _summary_line(c: Comparison) -> str:
    counts = ", ".join(f"{n} {status}" for status, n in c.counts().items())
    return f"{len(c.runs)} runs compared: {counts or 'no metrics'}"


def _md_cells(row: MetricRow) -> tuple[str, ...]:
    status = f"**{row.status}**" if row.failing else row.status
    return (f"`{row.metric}`", format_number(row.base), format_number(row.new), _change(row.base, row.new),
            row.tolerance, status + (f" ({row.note})" if row.note else ""))


def _md_table(header: tuple[str, ...], rows: list[tuple[str, ...]]) -> list[str]:
    def cell(text: str) -> str:
        return html.escape(text, quote=False).replace("|", "\\|")

    return (["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
            + ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows])
