"""The metric registry (`kvbench/metrics.py`) against what the shipped workloads produce: a
produced metric that is not registered, a registered one that no shipped workload produces in
a mode it claims, or a value of the wrong type fails here."""

import math
from pathlib import Path

import pytest

from kvbench import metrics as M
from kvbench.config import load_workload
from kvbench.runner import run_workload

ROOT = Path(__file__).resolve().parents[1]
CI = sorted((ROOT / "workloads" / "ci").glob("*.yaml"))
FEATURES = [  # shipped feature workloads outside CI, shrunk
    (ROOT / "workloads" / "speculative-decoding.yaml", ("requests.synthetic.num_requests=24",)),
    (ROOT / "workloads" / "encoder-decoder.yaml", ("requests.synthetic.num_requests=24",)),
]
DATA_PLANE = [  # shipped data-plane workloads, shrunk to a few requests
    (ROOT / "workloads" / "verify-small.yaml", ("requests.synthetic.num_requests=8",)),
    (ROOT / "workloads" / "verify-serve-small.yaml", ("requests.synthetic.num_requests=8",)),
    (ROOT / "workloads" / "verify-speculative-small.yaml", ("requests.synthetic.num_requests=8",)),
]


def _produced(path: Path, sets=()) -> list[tuple[str, dict]]:
    wl = load_workload(path, sets)
    return [(o.workload.run.mode, o.metrics) for o in run_workload(wl)]


@pytest.fixture(scope="module")
def metadata_runs():
    return ([run for path in CI for run in _produced(path)]
            + [run for path, sets in FEATURES for run in _produced(path, sets)])


@pytest.fixture(scope="module")
def data_plane_runs():
    pytest.importorskip("torch")
    return [run for path, sets in DATA_PLANE for run in _produced(path, sets)]


def _cuda_only_names() -> set[str]:
    """What a CUDA data plane adds: the producer's own code with its timer switched on (the
    values are zero on CPU; only the names are read)."""
    torch = pytest.importorskip("torch")
    from kvbench.config import ModelConfig
    from kvbench.kernels.dataplane import open_data_plane
    from kvbench.kernels.step import PoolSpec

    model = ModelConfig(num_layers=1, num_kv_heads=1, num_q_heads=1, head_dim=8,
                        dtype="float32")
    plane = open_data_plane(model, 4, [PoolSpec((0,), 2)], backend="torch", verify="off",
                            seed=0)
    untimed = set(plane.metrics())
    plane._timed = True
    assert torch is not None
    return set(plane.metrics()) - untimed


def test_every_produced_metric_is_registered_with_the_right_type_and_mode(
        metadata_runs, data_plane_runs):
    for mode, metrics in metadata_runs + data_plane_runs:
        assert not M.unregistered(metrics)
        for name, value in metrics.items():
            m = M.METRICS[name]
            assert mode in m.modes, (name, mode)
            assert M.type_error(name, value) is None, (name, value, M.type_error(name, value))


def test_every_registered_metric_is_produced_by_a_shipped_workload(
        metadata_runs, data_plane_runs):
    produced = {(name, mode) for mode, metrics in metadata_runs for name in metrics}
    plane = {(name, mode) for mode, metrics in data_plane_runs for name in metrics}
    cuda = _cuda_only_names()
    for m in M.METRICS.values():
        for mode in m.modes:
            assert (m.name, mode) in produced | plane or m.name in cuda, (m.name, mode)
        names = {name for name, _ in produced}
        if m.needs == "cuda":
            assert m.name in cuda and m.name not in names, m.name
        elif m.needs in ("data_plane", "draft_data_plane"):
            assert m.name in {name for name, _ in plane} - names, m.name


def test_registry_entries_are_complete():
    assert M.SECTIONS == ("Reuse", "Memory", "Traffic", "Serving", "Data plane", "Run")
    for m in M.METRICS.values():
        assert m.kind in ("count", "number", "percentiles", "bool", "text", "pools")
        assert m.rule.better in ("higher", "lower", "match", "either", "info")
        assert m.rule.scope in ("any", "device", "time", "measured")
        assert m.label and m.description and m.modes
    # Measured kernel times are gated, on the same device.
    for name in ("attention_ms", "kv_write_ms", "copy_ms", "copy_gb_per_s"):
        assert M.METRICS[name].rule.scope == "measured"
    for name in M.DEFAULT_OBJECTIVES:
        assert M.METRICS[name].rule.better in ("higher", "lower")


@pytest.mark.parametrize("name, value, ok", [
    ("hit_rate", 0.5, True), ("hit_rate", "high", False), ("hit_rate", True, False),
    ("hit_rate", math.nan, False), ("requests", 3, True), ("requests", 3.0, False),
    ("verified", None, True), ("verified", 1, False), ("hit_rate", None, False),
    ("ttft_ms", {"mean": 1, "p50": 1, "p90": 2, "p99": 3.5}, True),
    ("ttft_ms", {"mean": 1, "p50": 1}, False),
    ("ttft_ms", {"mean": 1, "p50": 1, "p90": "x", "p99": 3}, False),
    ("time_source", "modeled", True), ("time_source", 1, False),
    ("pools", {"full": {"layers": 2, "peak_gpu_blocks": 3}}, True),
    ("pools", {"full": {"layers": math.inf}}, False),
    ("a_newer_metric", {"x": [1]}, False), ("a_newer_metric", "text", True),
])
def test_type_error(name, value, ok):
    assert (M.type_error(name, value) is None) == ok


def test_formatters():
    assert M.format_value("peak_gpu_bytes", 3 * 1024 ** 3) == "3.0 GiB"
    assert M.format_value("hit_rate", 0.25) == "25.00%"
    assert M.format_value("cache.tokens_per_block", 16) == "16"
    assert M.format_value("ttft_ms.p99", 12.3456) == "12.35"
    assert M.format_value("verified", None) == "-"
    assert M.format_number(1234567) == "1,234,567" and M.format_number(1e-5) == "1.000e-05"
    assert M.percentile_summary([]) == {"mean": 0.0, "p50": 0.0, "p90": 0.0, "p99": 0.0}
    s = M.percentile_summary([1.0, 2.0, 3.0, 4.0], with_max=True)
    assert s["p50"] == 2.5 and s["max"] == 4.0 and s["mean"] == 2.5
