"""The `kvbench` command line. Thin: parse, call the library, print, map errors to exit codes."""

from __future__ import annotations

import json
import os
import sys
import warnings
from pathlib import Path
from typing import Annotated, Optional

import typer
import typer.core
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from . import __version__
from .errors import InputError, RegressionFound, TraceWarning

app = typer.Typer(
    add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
    help="Benchmark and tune paged KV caches for LLM serving on real traffic.",
)
trace_app = typer.Typer(no_args_is_help=True, help="Inspect request traces.")
app.add_typer(trace_app, name="trace")

out = Console()
err = Console(stderr=True)


def _say(message: str) -> None:
    """One status line on stderr as written: a path in it is never wrapped (a wrapped path
    cannot be copied) nor read as rich markup (`[...]` is legal in a file name)."""
    err.print(message, highlight=False, markup=False, soft_wrap=True)

# A flag takes no value, so its type (`<bool>`) is noise in the help. The hook is a typer
# internal that not every typer release has (`typer>=0.12` is all we require): without it
# the help shows the type and nothing else changes.
_type_shown = getattr(typer.core.TyperOption, "display_type_rich", None)
if _type_shown is not None:
    def _no_flag_type(self, ctx):
        return None if self.is_flag else _type_shown(self, ctx)

    typer.core.TyperOption.display_type_rich = _no_flag_type


_USAGE_ERROR = typer.BadParameter.__mro__[1]
"""Click's UsageError (vendored by recent typer, Click's own before): every way a command line
fails to parse."""


def _version(value: bool) -> None:
    if value:
        out.print(f"kvbench {__version__}", highlight=False)
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[bool, typer.Option(
        "--version", callback=_version, is_eager=True, help="Print the version and exit.",
    )] = False,
) -> None:
    """Benchmark and tune paged KV caches for LLM serving on real traffic."""


SetOption = Annotated[
    Optional[list[str]],
    typer.Option("--set", metavar="KEY=VALUE",
                 help="Override a key: dotted.key=value (YAML-typed; repeatable)."),
]
JsonOption = Annotated[Optional[Path], typer.Option(
    "--json", metavar="FILE", help="Write the result JSON here (- = standard output).")]
QuietOption = Annotated[bool, typer.Option("--quiet", "-q", help="No progress bar, no tables.")]


def _example(*lines: str) -> str:
    # \b keeps click from rewrapping the lines.
    return "\b\nExamples:\n" + "\n".join(f"  {line}" for line in lines)


@app.command(epilog=_example(
    "kvbench run workloads/quickstart.yaml",
    "kvbench run workloads/ci/*.yaml --json out.json --quiet",
    "kvbench run workloads/quickstart.yaml --set cache.max_tokens=16384 --repeat 3"))
def run(
    workloads: Annotated[list[Path], typer.Argument(
        metavar="WORKLOAD...", help="Workload YAML file(s); several form a suite.")],
    set_: SetOption = None,
    json_path: JsonOption = None,
    quiet: QuietOption = False,
    repeat: Annotated[int, typer.Option(
        "--repeat", min=1, help="Run each workload N times; compare merges repeats by the median.",
    )] = 1,
    update_baseline: Annotated[Optional[Path], typer.Option(
        "--update-baseline", metavar="FILE",
        help="Update this baseline (for kvbench compare): the workloads run replace theirs, "
             "its other workloads are kept.",
    )] = None,
    replace: Annotated[bool, typer.Option(
        "--replace", help="With --update-baseline: write only this result, dropping the "
                          "baseline's other workloads.",
    )] = False,
) -> None:
    """Replay a workload's requests through the cache and report reuse, memory and traffic."""
    from .config import load_workload
    from .outfile import output_file
    from .results import build_result, check_unique_names

    # Every output is checked before the run, so a long run never fails at its end.
    json_out = output_file(json_path, "--json") if json_path is not None else None
    baseline_out = (output_file(update_baseline, "--update-baseline")
                    if update_baseline is not None else None)
    if baseline_out is not None and not replace and baseline_out.target.exists():
        from .results import read_result

        read_result(update_baseline)  # it is merged into: an unreadable one fails now
    loaded = [load_workload(p, set_ or ()) for p in workloads]
    check_unique_names([(wl.name, str(p)) for wl, p in zip(loaded, workloads)])
    tables = err if json_out is not None and json_out.is_stdout else out
    result = build_result([_replay(wl, repeat, quiet, tables, bool(set_)) for wl in loaded])
    if json_out is not None:
        json_out.write_text(_json_text(result))
        if not quiet and not json_out.is_stdout:
            _say(f"wrote {json_path}")
    if baseline_out is not None:
        from .results import updated_baseline

        baseline, kept = updated_baseline(update_baseline, result, replace=replace)
        baseline_out.write_text(_json_text(baseline))
        if not quiet:
            also = (f"; kept {', '.join(kept)} from it (--replace drops them)" if kept else "")
            _say(f"updated baseline {update_baseline}{also}")


def _replay(wl, repeat: int, quiet: bool, tables, overridden: bool) -> list:
    """`run` for one loaded workload: its outcomes, each variant `repeat` times, with its
    traffic header, progress bar and metrics table unless `quiet`."""
    from .report.tables import print_metrics
    from .runner import run_workload

    if not quiet:
        from .config import resolve_path
        from .traffic import describe_source

        header = describe_source(wl.requests, resolve_path(wl, "."))
        if header is not None:
            _say(header)
    with _progress(not quiet and wl.run.progress) as factory:
        checked = _warner(wl)
        outcomes = [o for _ in range(repeat) for o in run_workload(wl, factory, checked=checked)]
    if not quiet:
        print_metrics(tables, wl.name, [(o.variant, o.metrics) for o in outcomes],
                      wl.variant_differences(), overridden)
    return outcomes


def _warn(workload) -> None:
    from .runner import workload_warnings

    for _, warning in workload_warnings(workload):
        _say(f"kvbench: warning: {warning}")


def _warner(workload):
    """`run_workload`'s `checked` hook: a warning comes when the first variant it names is
    checked, so never for a variant refused before it runs (the error says it all), and once
    however many times the workload runs (--repeat)."""
    from .runner import workload_warnings

    pending = None

    def checked(variant: str) -> None:
        nonlocal pending
        if pending is None:
            pending = workload_warnings(workload)
        for item in [w for w in pending if variant in w[0]]:
            pending.remove(item)
            _say(f"kvbench: warning: {item[1]}")

    return checked


def _json_text(data: dict) -> str:
    return json.dumps(data, indent=1, allow_nan=False) + "\n"


@app.command(epilog=_example(
    "kvbench validate workloads/*.yaml",
    "kvbench validate workloads/quickstart.yaml --set cache.max_tokens=4096"))
def validate(
    workloads: Annotated[list[Path], typer.Argument(
        metavar="WORKLOAD...", help="Workload YAML file(s).")],
    set_: SetOption = None,
    quiet: Annotated[bool, typer.Option(
        "--quiet", "-q", help="No line per valid file (the exit code says it).")] = False,
) -> None:
    """Check workload files (and their variants) as a run would, without running them: the
    requests are loaded (a trace read through) and every cache sized."""
    from .config import load_workload
    from .runner import check_workload
    from .tune.plan import TuneJob, prepare

    for path in workloads:
        wl = load_workload(path, set_ or ())
        check_workload(wl)
        _warn(wl)
        if wl.tune is not None and not wl.variants:  # what `kvbench tune` would refuse
            prepare(TuneJob(str(path), tuple(set_ or ())))
        if not quiet:
            names = ", ".join(name for name, _ in wl.variant_workloads())
            out.print(f"{path}: ok ({wl.run.mode} mode; variants: {names})", highlight=False,
                      markup=False, soft_wrap=True)


@app.command(epilog=_example("kvbench schema > workload.schema.json",
                             "kvbench schema --result > result.schema.json"))
def schema(
    result: Annotated[bool, typer.Option(
        "--result", help="The schema of result JSON files instead (every metric described).",
    )] = False,
) -> None:
    """Print the JSON Schema of workload files (for editor completion), or of results."""
    if result:
        from .results import result_json_schema

        doc = result_json_schema()
    else:
        from .config import workload_json_schema

        doc = workload_json_schema()
    sys.stdout.write(json.dumps(doc, indent=2) + "\n")


@app.command(epilog=_example(
    "kvbench tune workloads/tune-chat.yaml --trials 40 --workers 2",
    "kvbench tune workloads/tune-chat.yaml --export-best best.yaml --plots tune-plots/"))
def tune(
    workload: Annotated[Path, typer.Argument(help="Workload YAML with a tune: section.")],
    trials: Annotated[Optional[int], typer.Option(
        "--trials", "-n", min=1,
        help="Trials in the study in all (default: tune.n_trials); resuming runs what it lacks.",
    )] = None,
    storage: Annotated[Optional[str], typer.Option(
        "--storage",
        help="Optuna storage URL (sqlite:///F, postgresql+psycopg://...) or journal:PATH; "
             "default: results/<workload>-tune.db.",
    )] = None,
    study: Annotated[Optional[str], typer.Option(
        "--study", help="Study name (default: the workload's name).")] = None,
    workers: Annotated[int, typer.Option(
        "--workers", "-j", min=1, help="Worker processes on this machine, sharing the storage.",
    )] = 1,
    export_best: Annotated[Optional[Path], typer.Option(
        "--export-best", metavar="FILE",
        help="Write the best trial (primary objective) as a workload YAML (- = standard output).",
    )] = None,
    plots: Annotated[Optional[Path], typer.Option(
        "--plots", metavar="FOLDER",
        help="Write Pareto front and optimization history PNGs into this folder.",
    )] = None,
    heartbeat: Annotated[int, typer.Option(
        "--heartbeat", min=1, metavar="SECONDS",
        help="Heartbeat interval; a trial silent for 3x this is failed and re-run.",
    )] = 10,
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", metavar="FILE",
        help="Write the study's summary as JSON: counts, objectives, best trial and Pareto "
             "front with their parameters and metrics, the held-out check (- = standard "
             "output).",
    )] = None,
    holdout: Annotated[Optional[float], typer.Option(
        "--holdout", metavar="FRACTION",
        help="Tune on the first 1-FRACTION of the requests, then run the best trial and the "
             "workload as written on the rest.",
    )] = None,
    set_: SetOption = None,
    quiet: QuietOption = False,
) -> None:
    """Search cache and scheduler knobs with Optuna; show the Pareto front."""
    from .outfile import output_dir, output_file
    from .tune import TuneJob
    from .tune.view import tune_command

    if export_best is not None:
        output_file(export_best, "--export-best")
    json_out = output_file(json_path, "--json") if json_path is not None else None
    if plots is not None:
        output_dir(plots, "--plots")
    job = TuneJob(str(workload), tuple(set_ or ()), trials, storage, study, heartbeat, holdout)
    tables = err if json_out is not None and json_out.is_stdout else out
    code = tune_command(job, workers=workers, export_best=export_best, plots=plots, quiet=quiet,
                        out=tables, err=err, json_out=json_out)
    if code:
        raise typer.Exit(code)


@app.command(epilog=_example(
    "kvbench compare results/baseline-cpu.json out.json",
    "kvbench compare results/baseline-cpu.json out.json --all --markdown summary.md"))
def compare(
    base: Annotated[Path, typer.Argument(help="Baseline result JSON.")],
    new: Annotated[Path, typer.Argument(help="Current result JSON (same workloads and variants).")],
    markdown: Annotated[Optional[Path], typer.Option(
        "--markdown", metavar="FILE",
        help="Also write a Markdown summary here (CI job summary, PR comment; - = standard "
             "output).",
    )] = None,
    json_path: Annotated[Optional[Path], typer.Option(
        "--json", metavar="FILE",
        help="Also write the comparison as JSON here: counts by status and every row (- = "
             "standard output).",
    )] = None,
    timing_tolerance: Annotated[float, typer.Option(
        "--timing-tolerance", min=0,
        help="Percent a measured timing may worsen (median of repeats, same device only).",
    )] = 10.0,
    show_all: Annotated[bool, typer.Option(
        "--all", help="Show every metric of every run, not only failures and improvements.",
    )] = False,
    quiet: QuietOption = False,
) -> None:
    """Compare a result with a baseline: exit 3 if a metric regressed, 2 if not comparable."""
    from .compare import compare_files, print_comparison, to_json, to_markdown
    from .outfile import output_file

    markdown_out = output_file(markdown, "--markdown") if markdown is not None else None
    json_out = output_file(json_path, "--json") if json_path is not None else None
    comparison = compare_files(base, new, timing_tolerance=timing_tolerance / 100)
    if markdown_out is not None:
        markdown_out.write_text(to_markdown(comparison))
    if json_out is not None:
        json_out.write_text(_json_text(to_json(comparison)))
    if not quiet and not (json_out is not None and json_out.is_stdout):
        print_comparison(out, comparison, show_all=show_all)
    if comparison.failures:
        raise RegressionFound(comparison.failure_line())


@app.command(epilog=_example(
    "kvbench report out.json", "kvbench report out.json --out report/"))
def report(
    result: Annotated[Path, typer.Argument(help="Result JSON (kvbench run --json).")],
    out_dir: Annotated[Optional[Path], typer.Option(
        "--out", metavar="FOLDER", help="Output folder (default: RESULT-report beside the result).",
    )] = None,
    quiet: QuietOption = False,
) -> None:
    """Write PNG plots of a result and an index.html / index.md page with its tables."""
    from .outfile import output_dir
    from .report.page import write_report
    from .results import read_result

    target = output_dir(out_dir or result.with_name(result.stem + "-report"), "--out")
    written = write_report(read_result(result), target, source=str(result))
    if not quiet:
        _say(f"wrote {len(written)} files; open {target / 'index.html'}")


@app.command(epilog=_example(
    "kvbench calibrate",
    "kvbench calibrate workloads/quickstart.yaml",
    "kvbench calibrate workloads/quickstart.yaml --out profiles/h100-quickstart.yaml"))
def calibrate(
    workload: Annotated[Optional[Path], typer.Argument(
        help="Workload YAML whose model shape (model:, cache.tokens_per_block, "
             "scheduler.max_batch_size) to measure (default: every key's default, a "
             "Llama-3-8B shape); --set model.* measures another.")] = None,
    out_path: Annotated[Optional[Path], typer.Option(
        "--out", metavar="FILE",
        help="Profile YAML to write (default: profiles/<gpu>-<workload>.yaml; - = standard "
             "output).",
    )] = None,
    set_: SetOption = None,
    quiet: QuietOption = False,
) -> None:
    """Measure this CUDA GPU for a model shape and write a hardware profile (hardware.profile)."""
    from .config import default_workload, load_workload
    from .outfile import output_file

    # A given --out is checked before minutes of measuring (the default one is named after
    # the GPU measured, so it is checked when known).
    target = output_file(out_path, "--out") if out_path is not None else None
    reads = ("scheduler.max_batch_size",)  # measured whatever the workload's run.mode
    wl = (load_workload(workload, set_ or (), reads) if workload is not None
          else default_workload(set_ or (), reads))
    import torch

    if not torch.cuda.is_available():
        raise InputError("kvbench calibrate needs a CUDA GPU and torch sees none; a profile "
                         "measured elsewhere works here through hardware.profile")
    from .calibrate import calibrate as measure
    from .kernels.flashinfer_backend import flashinfer_problem

    problem = flashinfer_problem(wl.model.dtype)
    if problem:
        raise InputError(f"kvbench calibrate: {problem}")
    log = (lambda line: None) if quiet else _say
    profile = measure(wl.model, wl.cache.tokens_per_block, wl.scheduler.max_batch_size,
                      seed=wl.run.seed, log=log)
    if target is None:
        gpu = "".join(c if c.isalnum() else "-" for c in profile.device.lower()).strip("-")
        out_path = Path("profiles") / f"{gpu}-{wl.name}.yaml"
        target = output_file(out_path, "--out")
    target.write_text(profile.to_yaml())
    if not quiet and not target.is_stdout:
        _say(f"wrote {out_path}")


FormatOption = Annotated[str, typer.Option(
    "--format", help="Trace format (requests.format): auto, mooncake, bailian, servegen, weka, "
    "token_ids, lengths_csv, chat.")]
TokenizerOption = Annotated[str, typer.Option(
    "--tokenizer", help="Chat traces (requests.tokenizer): approx or a tokenizer.json.")]
BlockTokensOption = Annotated[Optional[int], typer.Option(
    "--block-tokens", min=1, help="Tokens per hash id (requests.block_tokens); default: the "
    "format's.")]
CoverOption = Annotated[Optional[str], typer.Option(
    "--hash-ids-cover", help="ceil, floor or auto (requests.hash_ids_cover); default: the "
    "format's.")]
SessionsOption = Annotated[str, typer.Option(
    "--sessions", help="Session starts (requests.sessions): back_to_back, stagger:SECONDS or "
    "poisson:RATE.")]


def _open_trace(trace: Path, fmt: str, block_tokens: Optional[int], cover: Optional[str],
                sessions: str, tokenizer: str):
    from .traffic import FORMATS, TraceOptions, open_trace
    from .traffic.sessions import SessionStart

    if fmt not in FORMATS:
        raise InputError(f"--format: expected one of {', '.join(FORMATS)}, got {fmt!r}")
    if cover not in (None, "ceil", "floor", "auto"):
        raise InputError(f"--hash-ids-cover: expected ceil, floor or auto, got {cover!r}")
    kind, _, value = sessions.partition(":")
    try:
        start = {"back_to_back": SessionStart(),
                 "stagger": lambda: SessionStart("stagger", interval_s=float(value)),
                 "poisson": lambda: SessionStart("poisson", rate=float(value))}[kind]
        start = start if kind == "back_to_back" else start()
        if kind != "back_to_back" and not (start.interval_s or start.rate or 0) > 0:
            raise ValueError
    except (KeyError, ValueError):
        raise InputError(f"--sessions: expected back_to_back, stagger:SECONDS or poisson:RATE "
                         f"(a positive number), got {sessions!r}") from None
    return open_trace(trace, fmt, TraceOptions(block_tokens=block_tokens, hash_ids_cover=cover,
                                               sessions=start, tokenizer=tokenizer))


@trace_app.command("stats", epilog=_example(
    "kvbench trace stats traces/conversation.jsonl",
    "kvbench trace stats traces/conversation.jsonl --json - | jq .ideal_hit_rate"))
def trace_stats_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace file (a folder for weka).")],
    json_path: JsonOption = None,
    fmt: FormatOption = "auto",
    block_tokens: BlockTokensOption = None,
    cover: CoverOption = None,
    sessions: SessionsOption = "back_to_back",
    tokenizer: TokenizerOption = "approx",
) -> None:
    """Summarise a trace: format, native block size and length convention, size, rate, length
    percentiles, ideal hit rate by block size (below the native block size: not resolvable)."""
    from .outfile import output_file
    from .report.tables import trace_stats_table
    from .traffic import trace_stats

    json_out = output_file(json_path, "--json") if json_path is not None else None
    reader = _open_trace(trace, fmt, block_tokens, cover, sessions, tokenizer)
    stats = trace_stats(list(reader), reader=reader)
    if json_out is not None:
        json_out.write_text(_json_text(stats))
        if json_out.is_stdout:
            return
    out.print(trace_stats_table(trace.name, stats))


@trace_app.command("convert", epilog=_example(
    "kvbench trace convert traces/bailian.jsonl mooncake.jsonl",
    "kvbench trace convert traces/conversation.jsonl tokens.jsonl --to token_ids"))
def trace_convert_cmd(
    trace: Annotated[Path, typer.Argument(help="Trace to read (a folder for weka).")],
    output: Annotated[Path, typer.Argument(help="JSONL file to write (- = standard output).")],
    to: Annotated[str, typer.Option("--to", help="mooncake (hash ids) or token_ids.")] = "mooncake",
    fmt: FormatOption = "auto",
    block_tokens: BlockTokensOption = None,
    cover: CoverOption = None,
    sessions: SessionsOption = "back_to_back",
    tokenizer: TokenizerOption = "approx",
    out_block_tokens: Annotated[Optional[int], typer.Option(
        "--out-block-tokens", min=1, help="Block size of the Mooncake ids written for a "
        "token-id trace (a hash-id trace keeps its own).")] = None,
    tile: Annotated[Optional[int], typer.Option(
        "--tile", min=1, help="Repeat the trace N times, fresh ids and shifted times per tile "
        "(a production-size trace from a real one; Mooncake output).")] = None,
    quiet: QuietOption = False,
) -> None:
    """Convert a trace to Mooncake JSONL at its own block size (or to token-id JSONL)."""
    from .outfile import output_file
    from .traffic.convert import convert, tile as tile_trace

    target = output_file(output, "trace convert OUTPUT")
    if tile is not None:
        if to != "mooncake":
            raise InputError("--tile: writes Mooncake JSONL only (--to mooncake)")
        n, block = tile_trace(lambda: _open_trace(trace, fmt, block_tokens, cover, sessions,
                                                  tokenizer), target, tile)
    else:
        n, block = convert(_open_trace(trace, fmt, block_tokens, cover, sessions, tokenizer),
                           target, to, out_block_tokens)
    if not quiet and not target.is_stdout:
        how = (f"requests.format: {to}" + (f", requests.block_tokens: {block}"  # None: no ids
                                            if to == "mooncake" and block is not None else ""))
        _say(f"wrote {n:,} requests to {output}; read it with {how}")


class _progress:
    """Context manager yielding a ProgressFactory (or None when hidden)."""

    def __init__(self, show: bool) -> None:
        self.bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
            TimeElapsedColumn(), console=err, transient=True,
        ) if show else None

    def __enter__(self):
        if self.bar is None:
            return None
        self.bar.start()

        def factory(description: str, total: int):
            # A new phase replaces the finished one, so the bar always names what runs now.
            for task in self.bar.tasks:
                self.bar.remove_task(task.id)
            task = self.bar.add_task(description, total=total)
            return lambda n: self.bar.advance(task, n)

        return factory

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()


def _show_trace_warning(message, category, filename, lineno, file=None, line=None) -> None:
    if issubclass(category, TraceWarning):
        _say(f"kvbench: warning: {message}")
    else:
        _default_showwarning(message, category, filename, lineno, file, line)


_default_showwarning = warnings.showwarning


def _one_line(message: str) -> str:
    """A message echoing user input (a --set value, a file name) stays one line: control
    characters are shown escaped."""
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in message)


def main() -> None:
    """Entry point: exit 0 ok, 1 runtime failure, 2 bad input, 3 regression found."""
    warnings.simplefilter("always", TraceWarning)
    warnings.showwarning = _show_trace_warning
    try:
        # Not standalone: a command line that does not parse comes here, to be one line like
        # all bad input (Click would print a usage box); the value is an exit code (`Exit`).
        code = app(standalone_mode=False)
    except _USAGE_ERROR as exc:
        message = exc.format_message()
        if message:  # empty: no arguments, and the help is already shown
            where = exc.ctx.command_path if exc.ctx is not None else "kvbench"
            _say(f"kvbench: error: {_one_line(message)} (see {where} --help)")
        sys.exit(exc.exit_code)
    except InputError as exc:
        _say(f"kvbench: error: {_one_line(str(exc))}")
        sys.exit(2)
    except RegressionFound as exc:
        _say(f"kvbench: {exc}")
        sys.exit(3)
    except KeyboardInterrupt:
        err.print("kvbench: interrupted")
        sys.exit(130)
    except Exception as exc:  # noqa: BLE001 - the one place runtime failures become exit 1
        if os.environ.get("KVBENCH_DEBUG"):
            raise
        _say(f"kvbench: failed: {type(exc).__name__}: {exc} "
             "(KVBENCH_DEBUG=1 shows the traceback)")
        sys.exit(1)
    if code == 130:  # Click turns Ctrl-C into exit code 130; say why the run stopped
        err.print("kvbench: interrupted")
    sys.exit(code if isinstance(code, int) else 0)
