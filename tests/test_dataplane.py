"""The data plane driven by the cache manager: cache mode end to end, serve-like batched steps
with a host tier, faults in the manager, and backend selection."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.cache.ids import CopyKind  # noqa: E402
from kvbench.cache.manager import CacheSpec, KVCacheManager  # noqa: E402
from kvbench.config import load_workload  # noqa: E402
from kvbench.engine.cache_mode import replay_cache_mode  # noqa: E402
from kvbench.errors import InputError  # noqa: E402
from kvbench.kernels.dataplane import DataPlane  # noqa: E402
from kvbench.kernels.step import ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.runner import run_workload  # noqa: E402
from kvbench.traffic.request import Request  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VERIFY_SMALL = ROOT / "workloads" / "verify-small.yaml"
TPB = 4
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_q_heads=4, head_dim=16,
                   tokens_per_block=TPB, dtype="bfloat16")
_ids = iter(range(1 << 30))


def req(toks) -> Request:
    toks = np.asarray(toks, dtype=np.int64)
    return Request(next(_ids), 0.0, len(toks), 1, tokens=toks)


def setup(num_gpu: int, num_host: int = 0, **spec) -> tuple[KVCacheManager, DataPlane]:
    manager = KVCacheManager(CacheSpec(TPB, num_gpu, num_host_blocks=num_host,
                                       emit_copy_ops=True, **spec))
    plane = DataPlane(SHAPE, [PoolSpec((0, 1), num_gpu, num_host_slots=num_host)])
    return manager, plane


def test_verify_small_workload_verifies_every_variant():
    outcomes = run_workload(load_workload(VERIFY_SMALL))
    assert {o.variant for o in outcomes} >= {"partial-reuse", "host-offload"}
    for o in outcomes:
        m = o.metrics
        assert m["verified"] is True, (o.variant, m["verify_mismatch"])
        assert m["verified_steps"] == m["requests"] and m["data_plane_backend"] == "torch"
    host = next(o.metrics for o in outcomes if o.variant == "host-offload")
    assert host["onboard_blocks"] > 0 and host["partial_copy_blocks"] > 0


def test_cache_mode_partial_reuse_by_claim_and_by_copy():
    manager, plane = setup(16)
    base = np.arange(1000, 1010)
    requests = [
        req(base),                                   # blocks 0 1 [2: 2-token tail, kept]
        req(np.concatenate([base[:6], [7, 7, 7]])),  # block 1 matches 2 tokens, has a child: copy
        req(np.concatenate([base, [5, 5, 5]])),      # tail block matches 2 tokens, unshared: claim
    ]
    result = replay_cache_mode(requests, manager, data_plane=plane)
    assert manager.partial_copy_blocks == 1
    assert result.reused_partial_tokens == 4
    assert plane.metrics()["verified"] is True and plane.verified_steps == 3


class DroppingManager(KVCacheManager):
    """A manager bug: partial copies are counted but never emitted to the data plane."""

    def _emit(self, kind, *args):
        if kind != CopyKind.PARTIAL:
            super()._emit(kind, *args)


def test_dropped_partial_copy_in_the_manager_is_caught():
    manager = DroppingManager(CacheSpec(TPB, 16, emit_copy_ops=True))
    plane = DataPlane(SHAPE, [PoolSpec((0, 1), 16)])
    base = np.arange(1000, 1010)
    requests = [req(base), req(np.concatenate([base[:6], [7, 7, 7]]))]
    replay_cache_mode(requests, manager, data_plane=plane)
    m = plane.first_mismatch
    assert plane.metrics()["verified"] is False
    assert m.request_id == requests[1].id and m.kind == "kv" and m.position == 4


@pytest.mark.parametrize("batched", [True, False])
def test_serve_like_steps_with_host_tier(batched):
    """Several context requests per step with shared prefixes under GPU pressure, so blocks
    are offloaded, onboarded and partially copied; each step is one `execute_step`."""
    manager, plane = setup(12, num_host=12)
    rng = np.random.default_rng(0)
    prefixes = [rng.integers(0, 9999, 10) for _ in range(3)]
    for step in range(8):
        batch = [req(np.concatenate([prefixes[(step + i) % 3][: 6 + 2 * i],
                                     rng.integers(0, 9999, 3)])) for i in range(2)]
        seqs = (manager.add_sequences(batch) if batched
                else [manager.add_sequence(r) for r in batch])
        starts = [s.num_computed for s in seqs]
        for r, s in zip(batch, seqs):
            assert manager.resize(s, r.input_length)
        ops = list(manager.copy_ops)
        manager.copy_ops.clear()
        items = [StepItem(r.id, r.prompt_tokens(), s.blocks, start, r.input_length)
                 for r, s, start in zip(batch, seqs, starts)]
        check = plane.execute_step(ops, items)
        assert check.verified, check.mismatch
        for r, s in zip(batch, seqs):
            manager.commit(s, r.input_length)
            manager.release(s)
    assert manager.onboard_blocks > 0 and manager.offload_blocks > 0


@pytest.mark.parametrize("workload", ["verify-small.yaml", "verify-serve-small.yaml"])
def test_backend_none_never_imports_torch(workload):
    """Cache mode and serve mode alike: metadata-only runs stay torch-free."""
    code = (
        "import sys\n"
        "from kvbench.config import load_workload\n"
        "from kvbench.runner import run_workload\n"
        f"wl = load_workload({str(ROOT / 'workloads' / workload)!r}, "
        "['run.backend=none', 'variants=[]'])\n"
        "m = run_workload(wl)[0].metrics\n"
        "assert m['verified'] is None, m\n"
        "assert 'torch' not in sys.modules\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr


def test_flashinfer_without_cuda_is_one_input_error_line(monkeypatch, capsys):
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from kvbench.cli import main

    monkeypatch.setattr(sys, "argv", ["kvbench", "run", str(VERIFY_SMALL), "--set",
                                      "run.backend=flashinfer", "-q"])
    with pytest.raises(SystemExit) as exit_:
        main()
    assert exit_.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and "run.backend" in lines[0] and "CUDA" in lines[0]


def test_auto_backend_runs_torch_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    wl = load_workload(VERIFY_SMALL, ["run.backend=auto", "variants=[]", "run.verify=sample",
                                      "requests.synthetic.num_requests=12"])
    m = run_workload(wl)[0].metrics
    assert m["data_plane_backend"] == "torch" and m["verified"] in (True, None)
    assert "time_source" not in m and "attention_ms" not in m


def test_flashinfer_error_reaches_the_runner_as_input_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    wl = load_workload(VERIFY_SMALL, ["run.backend=flashinfer", "variants=[]"])
    with pytest.raises(InputError, match="verify-small.yaml: run.backend: flashinfer needs"):
        run_workload(wl)


def test_a_data_plane_goes_with_its_last_reference():
    """Nothing a plane holds refers back to it, so its tensors (gigabytes of K/V on a GPU)
    are freed at once, not when the cyclic garbage collector next runs: a process running
    several workloads would otherwise find the GPU full."""
    import gc
    import weakref

    gc.disable()
    try:
        dp = DataPlane(SHAPE, [PoolSpec((0, 1), 16, num_host_slots=4)], backend="torch",
                       cross=PoolSpec((0, 1), 8))
        toks = np.arange(30)
        check = dp.execute_step([], [StepItem(1, toks, [0, 1, 2, 3, 4, 5, 6], 0, 20)])
        assert check.verified
        dp.execute_step([], [StepItem(1, toks, [0, 1, 2, 3, 4, 5, 6], 20, 21)])
        dp.metrics()
        plane = weakref.ref(dp)
        del dp
        assert plane() is None
    finally:
        gc.enable()
