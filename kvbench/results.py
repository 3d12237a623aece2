"""The result JSON (DESIGN.md section 4, pinned): building, reading (`outfile.py` writes it) and
checking it, merging repeats, flattening nested metrics. Imports no engine, cache, config,
numpy or torch: `kvbench compare` and `kvbench report` load only this and the metric registry.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import InputError
from .infile import read_input
from .metrics import json_schema as metrics_json_schema
from .metrics import type_error

if TYPE_CHECKING:  # pragma: no cover
    from .config import Workload

SCHEMA_VERSION = 1


@dataclass(slots=True)
class RunOutcome:
    """One run of one variant, as the runner hands it over."""

    variant: str
    workload: Workload
    metrics: dict
    timeline: dict = field(default_factory=dict)


@dataclass(slots=True)
class MergedRun:
    """The runs of one (workload, variant) in one result, repeats merged."""

    workload: str
    variant: str
    metrics: dict
    config: dict
    timeline: dict
    repeats: int


def environment() -> dict:
    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "machine": platform.machine(),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "device": _gpus() or "cpu",
        "argv": sys.argv[1:],
    }


def _cpu_model() -> str:
    """The CPU model (measured timings compare only on the same one), from /proc/cpuinfo on
    Linux, else what the platform module knows."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _gpus() -> str | None:
    """The GPU names nvidia-smi reports (measured timings compare only on the same device);
    asked of the driver, not torch, so a metadata-only run stays torch-free."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=name", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    names = [line.strip() for line in out.splitlines() if line.strip()]
    return ", ".join(names) or None


def workload_entry(outcomes: list[RunOutcome]) -> dict:
    wl = outcomes[0].workload
    path = wl.source_path
    sha = wl.source_text_sha256
    if sha is None and path is not None:
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
    return {"name": wl.name, "path": str(path) if path else None, "sha256": sha}


def run_entry(outcome: RunOutcome) -> dict:
    return {
        "workload": outcome.workload.name,
        "variant": outcome.variant,
        "config": outcome.workload.resolved_dict(),
        "metrics": outcome.metrics,
        "timeline": outcome.timeline,
    }


def build_result(per_workload: list[list[RunOutcome]]) -> dict:
    """The result of one or several workload files (a suite), each with all its variants.
    `workload` describes the one file, or the suite as a whole; `workloads` lists every file
    and each run names its workload, so a suite's runs stay apart."""
    entries = [workload_entry(outcomes) for outcomes in per_workload]
    return {
        "schema_version": SCHEMA_VERSION,
        "kvbench_version": __version__,
        "workload": _suite_head(entries),
        "workloads": entries,
        "environment": environment(),
        "runs": [run_entry(o) for outcomes in per_workload for o in outcomes],
    }


def _suite_head(entries: list[dict]) -> dict:
    """`workload` of a result: the one file, or the suite as a whole."""
    if len(entries) == 1:
        return entries[0]
    joined = "".join(e["sha256"] or "" for e in entries).encode()
    return {"name": "+".join(e["name"] for e in entries), "path": None,
            "sha256": hashlib.sha256(joined).hexdigest()}


def check_unique_names(names: list[tuple[str, str]]) -> None:
    """(workload name, where) of a suite: two workloads of one name would merge as repeats."""
    seen: dict[str, str] = {}
    for name, where in names:
        if name in seen:
            raise InputError(f"{where}: name: {name!r} is also the name of {seen[name]}; each "
                             "workload of a suite needs its own name (runs are keyed by it)")
        seen[name] = where


def updated_baseline(path: str | Path, result: dict, *, replace: bool = False
                     ) -> tuple[dict, list[str]]:
    """The baseline to write at `path` from `result`: the runs of the workloads `result` has
    replace theirs, the baseline's other workloads are kept (all of it is replaced with
    `replace`, or when nothing is at `path`). Returns it and the names of the kept workloads."""
    new = baseline_of(result)
    if replace or not Path(path).exists():
        return new, []
    old = read_result(path)
    replaced = {e["name"] for e in new["workloads"]}
    old_entries = old.get("workloads") or [old["workload"]]
    kept = [e for e in old_entries if e["name"] not in replaced]
    entries = [next((n for n in new["workloads"] if n["name"] == e["name"]), e)
               for e in old_entries] + [e for e in new["workloads"]
                                        if e["name"] not in {o["name"] for o in old_entries}]
    runs = {e["name"]: [] for e in entries}
    for source, take in ((old, lambda w: w not in replaced), (new, lambda w: True)):
        for run in source["runs"]:
            name = run_workload(source, run)
            if take(name):
                runs[name].append({"workload": name, **run})
    return ({**new, "workload": _suite_head(entries), "workloads": entries,
             "runs": [run for e in entries for run in runs[e["name"]]]},
            [e["name"] for e in kept])


def run_workload(result: dict, run: dict) -> str:
    """The workload a run belongs to (a one-file result may leave it to `workload`)."""
    return run.get("workload") or (result.get("workload") or {}).get("name", "workload")


def read_result(path: str | Path) -> dict:
    """A result JSON, checked (`check_result`); unreadable or not ours is bad input."""
    path = Path(path)
    raw = read_input(path)
    if raw.startswith(b"SQLite format 3\0"):
        raise InputError(f"{path}: an SQLite database (a kvbench tune study?), not a kvbench "
                         "result; write one with kvbench run --json")
    try:
        data = json.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise InputError(f"{path}: not a text file (byte {exc.start} is not UTF-8); "
                         "expected a kvbench result JSON") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply to be a kvbench result") from None
    check_result(data, str(path))
    return data


def check_result(data, name: str) -> None:
    """Raise InputError naming the file, run and metric when `data` is not a valid result:
    every metric's value must have its registered type (`kvbench/metrics.py`)."""
    if not isinstance(data, dict) or "schema_version" not in data or "runs" not in data:
        raise InputError(f"{name}: not a kvbench result (no schema_version/runs)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise InputError(
            f"{name}: schema_version {data['schema_version']} is not {SCHEMA_VERSION}")
    for key in ("workload", "environment"):
        if not isinstance(data.get(key, {}), dict):
            raise InputError(f"{name}: {key}: expected an object, got {type(data[key]).__name__}")
    if not isinstance((data.get("workload") or {}).get("name", ""), str):
        raise InputError(f"{name}: workload.name: expected a string")
    runs = data["runs"]
    if not isinstance(runs, list):
        raise InputError(f"{name}: runs: expected a list of runs, got {type(runs).__name__}")
    entries = data.get("workloads") or []
    if not isinstance(entries, list) or not all(
            isinstance(e, dict) and isinstance(e.get("name"), str) for e in entries):
        raise InputError(f"{name}: workloads: expected a list of {{name, path, sha256}} with "
                         "string names")
    check_unique_names([(e.get("name"), f"{name}: workloads[{i}]")
                        for i, e in enumerate(entries)])
    for i, run in enumerate(runs):
        if not isinstance(run, dict) or not isinstance(run.get("variant"), str) or not \
                isinstance(run.get("workload", ""), str):
            raise InputError(f"{name}: runs[{i}]: expected an object with a variant name "
                             "(and a workload name, if any, as a string)")
        where = f"{name}: run {run_workload(data, run)}/{run['variant']}"
        for key in ("metrics", "config", "timeline"):
            if not isinstance(run.get(key, {}), dict):
                raise InputError(f"{where}: {key}: expected an object")
        for metric, value in (run.get("metrics") or {}).items():
            problem = type_error(metric, value)
            if problem:
                raise InputError(f"{where}: metric {metric}: {problem}")


def merge_repeats(result: dict) -> dict[tuple[str, str], MergedRun]:
    """Runs by (workload, variant) in first-seen order; repeats merged: numbers by the median
    (per key for nested metrics), anything else and the timeline from the first repeat."""
    groups: dict[tuple[str, str], list[dict]] = {}
    for run in result["runs"]:
        groups.setdefault((run_workload(result, run), run["variant"]), []).append(run)
    return {
        key: MergedRun(key[0], key[1], _median_metrics([r.get("metrics") or {} for r in runs]),
                       runs[0].get("config") or {}, runs[0].get("timeline") or {}, len(runs))
        for key, runs in groups.items()
    }


def baseline_of(result: dict) -> dict:
    """The result as a baseline: timelines dropped (compare never reads them; they would only
    bloat the committed file and its diffs)."""
    return {**result, "runs": [{k: v for k, v in run.items() if k != "timeline"}
                               for run in result["runs"]]}


def flatten_metrics(metrics: dict, prefix: str = "") -> dict:
    """Nested metrics as dotted names: {"ttft_ms": {"p50": 1}} -> {"ttft_ms.p50": 1}."""
    flat = {}
    for key, value in metrics.items():
        if isinstance(value, dict):
            flat.update(flatten_metrics(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def is_number(value) -> bool:
    return isinstance(value, (int, float))  # bools too: True beats False


def _median_metrics(repeats: list[dict]) -> dict:
    if len(repeats) == 1:
        return repeats[0]
    merged = {}
    for key, first in repeats[0].items():
        values = [m.get(key) for m in repeats]
        if isinstance(first, dict) and all(isinstance(v, dict) for v in values):
            merged[key] = _median_metrics(values)
        elif all(is_number(v) and not isinstance(v, bool) for v in values):
            merged[key] = statistics.median(values)
        else:
            merged[key] = first
    return merged


def result_json_schema() -> dict:
    """The JSON Schema of a result file (`kvbench schema --result`); its metrics are the
    registry's (`kvbench/metrics.py`)."""
    text = {"type": ["string", "null"]}
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "title": "kvbench result",
        "type": "object",
        "required": ["schema_version", "kvbench_version", "workload", "environment", "runs"],
        "properties": {
            "schema_version": {"const": SCHEMA_VERSION},
            "kvbench_version": {"type": "string"},
            "workload": {"$ref": "#/$defs/workload"},
            "workloads": {"type": "array", "items": {"$ref": "#/$defs/workload"}},
            "environment": {"type": "object", "description": "Where it ran: python, platform, "
                            "machine, cpu, cpu_count, device (GPU names or cpu), argv."},
            "runs": {"type": "array", "items": {
                "type": "object", "required": ["variant", "metrics"],
                "properties": {
                    "workload": {"type": "string"},
                    "variant": {"type": "string"},
                    "config": {"type": "object", "description": "The resolved workload."},
                    "metrics": metrics_json_schema(),
                    "timeline": {"type": "object", "description": "Thinned per-step columns: "
                                 "{x, stride, columns: {name: [int]}}."},
                }}},
        },
        "$defs": {"workload": {"type": "object", "properties": {
            "name": {"type": "string"}, "path": text, "sha256": text}}},
    }
