"""Rich tables of run metrics, one column per variant."""

from __future__ import annotations

from collections.abc import Callable

from rich.console import Console
from rich.table import Table


def _int(v) -> str:
    return f"{v:,}"


def _pct(v) -> str:
    return f"{100 * v:.2f}%"


def _bytes(v) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{v:.1f} {unit}" if unit != "B" else f"{v} B"
        v /= 1024
    raise AssertionError


def _secs(v) -> str:
    return f"{v:.2f} s"


def _float(v) -> str:
    return f"{v:,.1f}"


def _dist(v) -> str:
    return f"{v['mean']:.1f} / {v['p50']:.1f} / {v['p90']:.1f} / {v['p99']:.1f}"


Row = tuple[str, str, Callable]
SECTIONS: list[tuple[str, list[Row]]] = [
    ("Reuse", [
        ("requests", "requests", _int),
        ("prompt_tokens", "prompt tokens", _int),
        ("reused_tokens", "reused tokens", _int),
        ("reused_tokens_gpu", "  from GPU", _int),
        ("reused_tokens_host", "  from host", _int),
        ("reused_partial_tokens", "  by partial match", _int),
        ("hit_rate", "hit rate", _pct),
        ("optimal_hit_rate", "optimal hit rate (same capacity)", _pct),
        ("ideal_hit_rate", "ideal hit rate (unlimited cache)", _pct),
    ]),
    ("Memory", [
        ("gpu_blocks_total", "GPU blocks total", _int),
        ("peak_gpu_blocks", "GPU blocks peak (in use)", _int),
        ("peak_gpu_bytes", "GPU bytes peak", _bytes),
        ("host_blocks_total", "host blocks total", _int),
        ("peak_host_blocks", "host blocks peak", _int),
        ("scratch_slots_peak", "scratch slots peak", _int),
        ("deferred_ctx_blocks_held_peak", "deferred ctx blocks held peak", _int),
    ]),
    ("Traffic", [
        ("allocated_blocks", "blocks allocated", _int),
        ("evicted_blocks", "blocks evicted", _int),
        ("partial_copy_blocks", "partial copies", _int),
        ("onboard_blocks", "onboarded blocks (host->GPU)", _int),
        ("offload_blocks", "offloaded blocks (GPU->host)", _int),
        ("onboard_bytes", "onboarded bytes", _bytes),
        ("offload_bytes", "offloaded bytes", _bytes),
        ("host_link_ms_modeled", "host-link time (modeled)", lambda v: f"{v:,.1f} ms"),
        ("host_evicted_blocks", "host blocks evicted", _int),
    ]),
    ("Serving", [
        ("iterations", "iterations", _int),
        ("duration_s", "duration (modeled)", _secs),
        ("output_tokens", "output tokens", _int),
        ("throughput_tokens_per_s", "throughput (output tokens/s)", _float),
        ("ttft_ms", "TTFT ms mean/p50/p90/p99", _dist),
        ("tpot_ms", "TPOT ms mean/p50/p90/p99", _dist),
        ("e2e_ms", "end-to-end ms mean/p50/p90/p99", _dist),
        ("preemptions", "preemptions", _int),
        ("mnt_overflow_steps", "MNT overflow steps", _int),
        ("max_mnt_overshoot_tokens", "max MNT overshoot (tokens)", _int),
        ("reuse_shortfall_tokens", "reuse shortfall (tokens)", _int),
        ("ctx_alloc_failures", "context adds short of blocks", _int),
        ("batch_wait_iterations", "iterations waited (delay batching)", _int),
        ("deferred_ctx_blocks_reverted", "deferred ctx blocks reverted", _int),
        ("time_source", "time source", str),
    ]),
    ("Run", [
        ("verified", "verified", str),
        ("max_abs_err", "max abs error", lambda v: f"{v:.3g}"),
        ("wall_s", "wall time", _secs),
    ]),
]


def metrics_tables(title: str, runs: list[tuple[str, dict]]) -> list[Table]:
    """One table per section with at least one metric present; a metric absent from a run
    (not applicable to its mode) shows as a dash."""
    tables = []
    for section, rows in SECTIONS:
        present = [row for row in rows if any(m.get(row[0]) is not None for _, m in runs)]
        if not present:
            continue
        table = Table(title=f"{title}: {section}", title_justify="left")
        table.add_column("metric")
        for name, _ in runs:
            table.add_column(name, justify="right")
        for key, label, fmt in present:
            cells = [fmt(m[key]) if m.get(key) is not None else "-" for _, m in runs]
            table.add_row(label, *cells)
        tables.append(table)
    return tables


def print_metrics(console: Console, title: str, runs: list[tuple[str, dict]]) -> None:
    for table in metrics_tables(title, runs):
        console.print(table)
