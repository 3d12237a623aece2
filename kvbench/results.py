"""The result JSON (DESIGN.md section 4, pinned): building, atomic writing, reading and
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
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from . import __version__
from .errors import InputError
from .metrics import json_schema as metrics_json_schema

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
        "cpu_count": os.cpu_count(),
        "device": _gpus() or "cpu",
        "argv": sys.argv[1:],
    }


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
    if len(entries) == 1:
        head = entries[0]
    else:
        joined = "".join(e["sha256"] or "" for e in entries).encode()
        head = {"name": "+".join(e["name"] for e in entries), "path": None,
                "sha256": hashlib.sha256(joined).hexdigest()}
    return {
        "schema_version": SCHEMA_VERSION,
        "kvbench_version": __version__,
        "workload": head,
        "workloads": entries,
        "environment": environment(),
        "runs": [run_entry(o) for outcomes in per_workload for o in outcomes],
    }


def write_json_atomic(path: str | Path, data: dict) -> None:
    """Write via a temporary file in the same folder and rename, so a reader (or a crash)
    never sees half a file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, allow_nan=False)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        os.unlink(tmp)
        raise


def read_result(path: str | Path) -> dict:
    """A result JSON; unreadable or not ours is bad input."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
    except json.JSONDecodeError as exc:
        raise InputError(f"{path}:{exc.lineno}:{exc.colno}: not JSON: {exc.msg}") from None
    if not isinstance(data, dict) or "schema_version" not in data or "runs" not in data:
        raise InputError(f"{path}: not a kvbench result (no schema_version/runs)")
    if data["schema_version"] != SCHEMA_VERSION:
        raise InputError(
            f"{path}: schema_version {data['schema_version']} is not {SCHEMA_VERSION}")
    return data


def merge_repeats(result: dict) -> dict[tuple[str, str], MergedRun]:
    """Runs by (workload, variant) in first-seen order; repeats merged: numbers by the median
    (per key for nested metrics), anything else and the timeline from the first repeat."""
    groups: dict[tuple[str, str], list[dict]] = {}
    default_workload = (result.get("workload") or {}).get("name", "workload")
    for run in result["runs"]:
        groups.setdefault((run.get("workload", default_workload), run["variant"]), []).append(run)
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
