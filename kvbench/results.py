"""The result JSON (DESIGN.md section 4, pinned): building, atomic writing, reading."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from . import __version__
from .errors import InputError
from .runner import RunOutcome

SCHEMA_VERSION = 1


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
