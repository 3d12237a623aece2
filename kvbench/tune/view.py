"""What `kvbench tune` shows: the live progress line, failure lines, the Pareto table, and the
glue the CLI calls (`tune_command`). The study logic is in the other modules of this
package."""

from __future__ import annotations

import contextlib
import json
import signal
from collections.abc import Sequence
from pathlib import Path

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from .. import tune as T
from ..errors import InputError
from ..metrics import format_value
from ..report.tables import print_wide

MAX_ROWS = 30
MAX_FAILURE_LINES = 5


fmt_value = format_value
"""A metric or parameter value, short and readable (`kvbench/metrics.py`)."""


def _header(name: str) -> str:
    """A column header that may wrap at underscores in a narrow terminal."""
    return name.replace("_", " ")


def _arrow(direction: str) -> str:
    return "↑" if direction == "maximize" else "↓"


class Display:
    """A progress bar: trials n/N, best so far, running, infeasible and failed counts; lines
    for trials that failed or were lost, printed above it as they happen."""

    def __init__(self, console: Console, plan: T.Plan, enabled: bool) -> None:
        self.plan = plan
        self.enabled = enabled
        self.console = console
        self.reported: set[int] | None = None
        self.failures = 0
        self.progress = Progress(
            SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
            MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[status]}"),
            console=console, transient=False,
        ) if enabled else None
        self.task = None

    def __enter__(self) -> Display:
        if self.progress is not None:
            self.progress.start()
            self.task = self.progress.add_task("trials", total=self.plan.n_trials, status="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def update(self, trials: Sequence, waiting_for: int | None = 0) -> None:
        if not self.enabled:
            return
        plan = self.plan
        counts = T.tally(plan, trials)
        self._report(trials)
        parts = []
        best = _best_so_far(plan, trials)
        if best is not None:
            metric = plan.metric_names[0]
            parts.append(f"best {metric} {fmt_value(metric, best.values[0])} (#{best.number})")
        if counts.running:
            parts.append(f"{counts.running} running")
        if counts.waiting:
            parts.append(f"{counts.waiting} queued")
        if counts.infeasible:
            parts.append(f"{counts.infeasible} infeasible")
        if counts.invalid + counts.failed:
            parts.append(f"[red]{counts.invalid + counts.failed} invalid/failed[/red]")
        if waiting_for:
            parts.append(f"waiting for {waiting_for} trial(s) of other workers")
        assert self.progress is not None and self.task is not None
        self.progress.update(self.task, completed=min(counts.finished, plan.n_trials),
                             status=" · ".join(parts))

    def _report(self, trials: Sequence) -> None:
        from optuna.trial import TrialState

        if self.reported is None:  # a resumed study: its old failures are not news
            self.reported = {t.number for t in trials if t.state.is_finished()}
            return
        for t in trials:
            if t.number in self.reported or not t.state.is_finished():
                continue
            self.reported.add(t.number)
            outcome = t.user_attrs.get("outcome")
            reason = t.user_attrs.get("reason", "")
            if t.state == TrialState.COMPLETE or outcome == T.ABORTED:
                continue
            if outcome in T.COUNTED_FAILURES:
                self.failures += 1
                if self.failures <= MAX_FAILURE_LINES:
                    self.console.print(f"[yellow]trial {t.number} {outcome}:[/yellow] {reason}",
                                       highlight=False, soft_wrap=True)
                if self.failures == MAX_FAILURE_LINES:
                    self.console.print("[dim](further invalid or failed trials are only "
                                       "counted; each keeps its reason as a user attribute)"
                                       "[/dim]", highlight=False)
            elif t.state == TrialState.FAIL:
                why = reason or "its worker stopped sending heartbeats"
                self.console.print(f"[dim]trial {t.number} lost ({why}); it does not count "
                                   "towards --trials[/dim]",
                                   highlight=False, soft_wrap=True)


def _best_so_far(plan: T.Plan, trials: Sequence):
    from optuna.trial import TrialState

    sign = 1.0 if plan.directions[0] == "maximize" else -1.0
    best = None
    for t in trials:
        if t.state != TrialState.COMPLETE or not t.values or not T.is_feasible(plan, t):
            continue
        if best is None or sign * t.values[0] > sign * best.values[0]:
            best = t
    return best


def pareto_table(plan: T.Plan, summary: T.Summary) -> Table:
    single = len(plan.metric_names) == 1
    title = ("Best trial" if single else
             f"Pareto front: {len(summary.pareto)} of {len(summary.feasible)} feasible trials")
    table = Table(title=title, title_justify="left")
    table.add_column("trial", justify="right", no_wrap=True)
    leaves = [p.key.rsplit(".", 1)[-1] for p in plan.params]
    unique = len(set(leaves)) == len(leaves)
    for p, leaf in zip(plan.params, leaves):
        table.add_column(_header(leaf if unique else p.key), justify="right")
    for metric, direction in zip(plan.metric_names, plan.directions):
        table.add_column(f"{_header(metric)} {_arrow(direction)}", justify="right",
                         style="bold")
    extra = [c for c in dict.fromkeys(c.metric for c in plan.constraints)
             if c not in plan.metric_names]
    for metric in extra:
        table.add_column(_header(metric), justify="right")
    rows = summary.pareto[:MAX_ROWS]
    for t in rows:
        params = plan.decoded_params(t)
        mark = " *" if summary.best is not None and t.number == summary.best.number else ""
        cells = [f"#{t.number}{mark}"]
        cells += [fmt_value(p.key, params.get(p.key)) for p in plan.params]
        cells += [fmt_value(m, v) for m, v in zip(plan.metric_names, t.values)]
        metrics = t.user_attrs.get("metrics", {})
        for metric in extra:
            with contextlib.suppress(KeyError):
                cells.append(fmt_value(metric, T.metric_value(metrics, metric)))
                continue
            cells.append("-")
        table.add_row(*cells)
    if len(summary.pareto) > MAX_ROWS:
        table.caption = f"... and {len(summary.pareto) - MAX_ROWS} more on the front"
    elif not single:
        table.caption = f"* best by {plan.metric_names[0]}"
    return table


HOLDOUT_METRICS = ("hit_rate", "lru_hit_rate", "gap_closed")
"""Shown beside the objectives on the held-out requests (where a run has them)."""


def holdout_table(plan: T.Plan, runs: list[T.HoldoutRun]) -> Table:
    """The chosen configuration on the tuned part and on the held-out rest, beside the
    workload as written on the held-out rest."""
    split = plan.holdout
    table = Table(title=f"Held out: the last {split.total_requests - split.tune_requests} of "
                        f"{split.total_requests} requests (tuned on the first "
                        f"{split.tune_requests})", title_justify="left")
    table.add_column("metric")
    best, written = runs
    table.add_column("best trial, tuned part", justify="right")
    table.add_column("best trial, held out", justify="right", style="bold")
    table.add_column("as written, held out", justify="right")
    names = list(dict.fromkeys([*plan.metric_names, *HOLDOUT_METRICS]))
    for name in names:
        cells = []
        for metrics in (best.tuned or {}, best.held_out, written.held_out):
            try:
                cells.append(fmt_value(name, T.metric_value(metrics, name)))
            except KeyError:
                cells.append("-")
        if any(c != "-" for c in cells):
            table.add_row(name, *cells)
    return table


def _print_wide(console: Console, table: Table) -> None:
    """A file or pipe gets the whole table, not one squeezed into 80 columns."""
    if console.is_terminal:
        console.print(table)
    else:
        print_wide(console, table, limit=240)


def _counts_line(plan: T.Plan, summary: T.Summary) -> str:
    c = summary.tally
    parts = [f"{c.complete} complete"
             + (f" ({c.infeasible} infeasible)" if plan.constraints else "")]
    if c.invalid:
        parts.append(f"{c.invalid} invalid")
    if c.failed:
        parts.append(f"{c.failed} failed")
    if c.running or c.waiting:
        parts.append(f"{c.running + c.waiting} unfinished")
    if c.lost:
        parts.append(f"{c.lost} lost and re-run")
    return ", ".join(parts)


def dashboard_command(url: str) -> str:
    target = url[len("journal:"):] if url.startswith("journal:") else T.display_url(url)
    return f"optuna-dashboard {target}"


@contextlib.contextmanager
def _signals_as_interrupt():
    """Ctrl-C and SIGTERM (kill, a scheduler's stop) end a tune cleanly, trials kept; a second
    one while the interrupted trial is being recorded is ignored."""
    try:
        previous = [(sig, signal.signal(sig, T._interrupt_once))
                    for sig in (signal.SIGINT, signal.SIGTERM)]
    except ValueError:  # not the main thread
        yield
        return
    try:
        yield
    finally:
        for sig, handler in previous:
            signal.signal(sig, handler)


def tune_command(job: T.TuneJob, *, workers: int, export_best: Path | None,
                 plots: Path | None, quiet: bool, out: Console, err: Console,
                 json_out=None) -> int:
    """`kvbench tune`: run the study, show it, export (`json_out`: an `OutputFile` for the
    summary's data); returns the exit code."""
    plan = T.prepare(job)
    if workers > 1 and T.is_in_memory(plan.storage_url):
        raise InputError("--workers: an in-memory storage cannot be shared; give --storage")
    storage = T.open_storage(plan)
    study, notes = T.create_study(plan, storage)
    url = T.display_url(plan.storage_url)
    if not quiet:
        _print_header(err, job, plan, study, notes, workers, url)
    display = Display(err, plan, enabled=not quiet)
    with display, _signals_as_interrupt():
        code, interrupted = _run(plan, study, storage, workers, display, err)
    summary = T.summarize(plan, study.get_trials(deepcopy=False))
    if not quiet:
        out.print(f"study {plan.study_name!r} ({url}): {summary.tally.finished} of "
                  f"{plan.n_trials} trials: {_counts_line(plan, summary)}", highlight=False)
        if summary.pareto:
            # A file or pipe gets the whole table, not one squeezed into 80 columns.
            _print_wide(out, pareto_table(plan, summary))
        else:
            out.print("no feasible complete trial yet")
    runs = None
    if plan.holdout is not None and summary.best is not None and not interrupted:
        runs = T.holdout_runs(plan, summary.best)
        if not quiet:
            _print_wide(out, holdout_table(plan, runs))
    if json_out is not None:
        data = T.summary_data(plan, summary, runs, interrupted=interrupted)
        json_out.write_text(json.dumps(data, indent=1, allow_nan=False) + "\n")
    if interrupted:
        err.print(f"interrupted: {summary.tally.finished} of {plan.n_trials} trials kept; "
                  "run the same command to resume")
        code = code or 130
    if export_best is not None:
        code = _export(plan, summary, export_best, quiet, out, err) or code
    if plots is not None:
        written = T.write_plots(plan, study, plots)
        if not quiet:
            names = ", ".join(str(p) for p in written) or "none (no complete trial)"
            out.print(f"plots: {names}", highlight=False)
    if not quiet:
        out.print(f"view the study: {dashboard_command(plan.storage_url)}", highlight=False)
    return code


def _print_header(err: Console, job: T.TuneJob, plan: T.Plan, study, notes: list[str],
                  workers: int, url: str) -> None:
    before = T.tally(plan, study.get_trials(deepcopy=False))
    seed = plan.tune.seed
    err.print(f"[bold]tune {plan.study_name}[/bold]: {plan.tune.sampler} sampler"
              f"{'' if seed is None else f', seed {seed}'}, {plan.n_trials} trials, "
              f"{workers} worker{'s' if workers > 1 else ''}, storage {url}", highlight=False)
    if plan.grid_size is not None and plan.grid_size < (job.n_trials or plan.tune.n_trials):
        err.print(f"the grid has {plan.grid_size} points: the study runs {plan.grid_size}")
    if before.used:
        err.print(f"resuming: {before.finished} of {plan.n_trials} trials done")
    for note in notes:
        err.print(f"note: {note}")
    if workers > 1 and not T.lock_is_exact(plan.storage_url):
        err.print("note: this storage has no cross-process lock here; workers may overshoot "
                  f"--trials by up to {workers - 1}")


def _run(plan: T.Plan, study, storage, workers: int, display: Display, err: Console
         ) -> tuple[int, bool]:
    """Run the study's trials in this process or in worker processes: (exit code, whether it
    was interrupted)."""
    code = 0
    if workers == 1:
        status = T.run_worker(plan, 0, storage=storage, on_update=display.update)
        interrupted = status == "interrupted"
    else:
        result = T.run_workers(
            plan, workers, poll=lambda: display.update(study.get_trials(deepcopy=False)))
        interrupted = result.interrupted
        display.update(study.get_trials(deepcopy=False))
        for message in result.input_errors:
            err.print(f"kvbench: error: {message}", highlight=False, markup=False,
                      soft_wrap=True)
        for message in result.errors:
            err.print(f"kvbench: worker failed: {message}", highlight=False, markup=False,
                      soft_wrap=True)
        code = 2 if result.input_errors else 1 if result.errors else 0
    display.update(study.get_trials(deepcopy=False))
    return code, interrupted


def _export(plan: T.Plan, summary: T.Summary, path: Path, quiet: bool, out: Console,
            err: Console) -> int:
    """Write the best trial as a workload; 1 when there is none."""
    if summary.best is None:
        err.print("kvbench: no feasible complete trial to export", highlight=False)
        return 1
    written = T.export_best(plan, summary.best, path)
    if not quiet:
        out.print(f"best by {plan.metric_names[0]}: trial #{summary.best.number} -> "
                  f"{written} (kvbench run {written})", highlight=False)
    return 0
