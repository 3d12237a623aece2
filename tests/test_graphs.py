"""Decode batches as CUDA graphs (`kernels/graphs.py`): what a graph runs equals the eager
path bit for bit (on the CPU, without capturing), and on CUDA the replayed steps verify, leave
the cache exactly as eager steps do, across batch sizes that grow the buffers, and a fault
planted after a replayed write is caught."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels.attention import PagedBatch, write_kv  # noqa: E402
from kvbench.kernels.dataplane import DataPlane  # noqa: E402
from kvbench.kernels.graphs import MIN_CAPACITY, DecodeGraphs, _PoolGraphs  # noqa: E402
from kvbench.kernels.model import SyntheticModel  # noqa: E402
from kvbench.kernels.step import ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.kernels.storage import PoolTensors  # noqa: E402

TPB = 16
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_q_heads=8, head_dim=128,
                   tokens_per_block=TPB, dtype="bfloat16")
CUDA_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need CUDA")
SEQS = 24
"""More sequences than a pool's first buffers hold (`MIN_CAPACITY`): a batch grows them."""


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.int16)


def _prompts() -> tuple[list[np.ndarray], list[list[int]]]:
    rng = np.random.default_rng(3)
    seqs = [rng.integers(0, 50_000, 80) for _ in range(SEQS)]
    return seqs, [list(range(6 * i, 6 * i + 6)) for i in range(SEQS)]


def _decode(seqs, tables, ids, lengths) -> list[StepItem]:
    """One decode token for each sequence in `ids`, at its length (then one longer)."""
    items = [StepItem(i, seqs[i], tables[i], lengths[i], lengths[i] + 1) for i in ids]
    for i in ids:
        lengths[i] += 1
    return items


def test_graph_preparation_equals_the_eager_path_bit_for_bit():
    assert SEQS > MIN_CAPACITY
    cpu = torch.device("cpu")
    spec = PoolSpec((0, 1), 6 * SEQS)
    tensors = PoolTensors(SHAPE, spec, cpu)
    model = SyntheticModel(SHAPE, 5, cpu)
    owner = SimpleNamespace(model=model, kv_dtype=torch.bfloat16, q_dtype=torch.bfloat16,
                            device=cpu)
    pool = _PoolGraphs(tensors)
    seqs, tables = _prompts()
    lengths = [40] * SEQS
    for n in (3, SEQS, 1):
        batch = PagedBatch(_decode(seqs, tables, range(n), lengths), tensors, TPB, cpu,
                           decode=True)
        g = pool.views(owner, n)
        g.ids.copy_(batch.ids)
        pool.run_prepare(owner, g)
        kv, q = model.qkv_all(batch.rows, spec.layers, torch.bfloat16, torch.bfloat16)
        assert torch.equal(_bits(g.kv), _bits(kv)) and torch.equal(_bits(g.q), _bits(q))
        assert torch.equal(g.write_rows, batch.write_rows)
    assert pool.capacity == 2 * MIN_CAPACITY


def _run(backend: str, graphs: bool, monkeypatch, lazy_times: bool = False,
         fault: bool = False) -> DataPlane:
    """A prefill of every sequence, then decode steps of batch sizes that repeat, grow past
    the first buffers and shrink; every step verified."""
    if not graphs:
        monkeypatch.setattr(DecodeGraphs, "takes", staticmethod(lambda batch: False))
    dp = DataPlane(SHAPE, [PoolSpec((0, 1), 6 * SEQS)], backend=backend,
                   device=torch.device("cuda"), lazy_times=lazy_times)
    seqs, tables = _prompts()
    check = dp.execute_step([], [StepItem(i, seqs[i], tables[i], 0, 40) for i in range(SEQS)])
    assert check.verified, check.mismatch
    lengths = [40] * SEQS
    for step, n in enumerate((1, 3, 3, SEQS, 2, 17, 1, SEQS)):
        check = dp.execute_step([], _decode(seqs, tables, range(n), lengths))
        if fault and step == 4:
            # The K row that the replayed write just wrote for sequence 1's last position at
            # layer 1, changed: the next step reads it.
            pos = lengths[1] - 1
            block = tables[1][pos // TPB]
            dp.pools[0].gpu[block * 2 + 1, 0, pos % TPB, 0, 0] += 1
            check = dp.execute_step([], _decode(seqs, tables, range(n), lengths))
            assert check.verified is False and check.mismatch is not None
            return dp
        assert check.verified, check.mismatch
    assert not fault
    return dp


BACKENDS = ["torch", pytest.param("flashinfer", marks=pytest.mark.skipif(
    not torch.cuda.is_available() or not __import__("importlib").util.find_spec("flashinfer"),
    reason="needs flashinfer"))]


@CUDA_ONLY
@pytest.mark.parametrize("backend", BACKENDS)
def test_replayed_decode_steps_verify_and_leave_the_cache_as_eager_steps(backend,
                                                                         monkeypatch):
    graphed = _run(backend, True, monkeypatch)
    pools = graphed.graphs._pools
    assert sorted(pools[0].graphs) == [1, 2, 3, 17, SEQS]
    assert pools[0].capacity == 2 * MIN_CAPACITY and graphed.graphs.capture_s > 0
    eager = _run(backend, False, monkeypatch)
    assert not eager.graphs._pools
    assert torch.equal(_bits(graphed.pools[0].gpu), _bits(eager.pools[0].gpu))
    assert graphed.metrics()["verified"] is True


@CUDA_ONLY
def test_replayed_steps_verify_with_lazy_times(monkeypatch):
    dp = _run("torch", True, monkeypatch, lazy_times=True)
    m = dp.metrics()
    assert m["verified"] is True and m["verified_steps"] == 9
    assert m["data_plane_gpu_ms"] > 0


@CUDA_ONLY
def test_a_fault_after_a_replayed_write_is_caught(monkeypatch):
    _run("torch", True, monkeypatch, fault=True)


def test_eager_write_rows_equal_the_scatter_write():
    """`write_kv` through `PagedBatch.write_rows` writes what a graph's write scatters."""
    cpu = torch.device("cpu")
    tensors = PoolTensors(SHAPE, PoolSpec((0, 1), 6 * SEQS), cpu)
    model = SyntheticModel(SHAPE, 1, cpu)
    seqs, tables = _prompts()
    batch = PagedBatch(_decode(seqs, tables, range(4), [30] * 4), tensors, TPB, cpu,
                       decode=True)
    kv, _ = model.qkv_all(batch.rows, (0, 1), torch.bfloat16, None)
    write_kv(tensors.gpu, batch, kv)
    for i in range(4):
        block, slot = tables[i][30 // TPB], 30 % TPB
        for layer in range(2):
            page = tensors.gpu[block * 2 + layer]
            assert torch.equal(_bits(page[0, slot]), _bits(kv[layer, i, 0]))
            assert torch.equal(_bits(page[1, slot]), _bits(kv[layer, i, 1]))


def test_a_measured_run_counts_the_decode_graphs_memory(monkeypatch, capsys):
    """`run.clock: measured` needs weights, cache, step buffers and the decode graphs' memory
    on the GPU: with room for the K/V tensors alone it is refused, naming them (CUDA faked:
    the refusal comes before anything touches a GPU)."""
    from cli_helpers import run_cli

    from kvbench.kernels import storage
    from kvbench.kernels.graphs import graph_bytes

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "a fake GPU")
    monkeypatch.setattr(storage, "free_gpu_bytes", lambda: 1 << 30)
    small = Path(__file__).resolve().parent.parent / "workloads" / "verify-serve-small.yaml"
    code, _, err = run_cli(["run", str(small), "--set", "run.clock=measured", "--set",
                            "model.head_dim=128", "--set", "run.backend=flashinfer"], capsys)
    assert code == 2 and "step buffers, graphs and workspaces" in err, err
    assert "a fake GPU has 1.0 GiB free" in err
    shape = ModelShape(num_layers=32, num_kv_heads=8, num_q_heads=32, head_dim=128,
                       tokens_per_block=64, dtype="bfloat16")
    # Llama-3-8B's shape: a 128-sequence group's float32 work and four sets of outputs.
    assert graph_bytes(shape, 32, 8) < graph_bytes(shape, 32, 256) == graph_bytes(shape, 32, 128)
    assert graph_bytes(shape, 32, 128) == 32 * 8 * 128 * 6144 * 3 // 2 + 4 * 32 * 128 * (
        2 * 6144 + 16)
