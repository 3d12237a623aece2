"""FlashInfer against the torch reference on the same paged cache (CUDA only; skipped
elsewhere). One shape (bfloat16, head_dim 128) so that the JIT compiles few kernels: full and
windowed prefill, tensor-core decode (which reuses the prefill module) and the append kernel."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
if not torch.cuda.is_available():
    pytest.skip("FlashInfer tests need CUDA", allow_module_level=True)
pytest.importorskip("flashinfer")

from kvbench.cache.ids import BlockId, CopyKind, CopyOp, Tier  # noqa: E402
from kvbench.kernels.attention import CrossBatch, PagedBatch, TorchBackend  # noqa: E402
from kvbench.kernels.dataplane import DataPlane, open_data_plane  # noqa: E402
from kvbench.kernels.step import CrossKV, ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.kernels.verify import TOLERANCES  # noqa: E402

TPB = 16
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_q_heads=8, head_dim=128,
                   tokens_per_block=TPB, dtype="bfloat16")
CUDA = torch.device("cuda")


def plane(*pools: PoolSpec) -> DataPlane:
    return DataPlane(SHAPE, list(pools), backend="flashinfer", device=CUDA)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def test_prefill_append_and_decode_verify():
    dp = plane(PoolSpec((0, 1), 64))
    lengths = [37, 130, 16]
    seqs = [tokens(n + 8, i) for i, n in enumerate(lengths)]
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(3)]
    # A batch of whole prompts, then a batch of context chunks (appends), then decodes.
    check = dp.execute_step([], [StepItem(i, s, t, 0, n - 5)
                                 for i, (s, t, n) in enumerate(zip(seqs, tables, lengths))])
    assert check.verified, check.mismatch
    check = dp.execute_step([], [StepItem(i, s, t, n - 5, n)
                                 for i, (s, t, n) in enumerate(zip(seqs, tables, lengths))])
    assert check.verified, check.mismatch
    for extra in range(3):
        check = dp.execute_step([], [StepItem(i, s, t, n + extra, n + extra + 1)
                                     for i, (s, t, n) in enumerate(zip(seqs, tables, lengths))])
        assert check.verified, check.mismatch
    m = dp.metrics()
    assert m["verified"] is True and m["time_source"] == "measured" and m["attention_ms"] > 0


def test_flashinfer_output_matches_torch_backend_on_the_same_cache():
    dp = plane(PoolSpec((0, 1), 64, window=None))
    a = tokens(200, 1)
    dp.execute_step([], [StepItem(1, a, list(range(13)), 0, 150)])
    items = [StepItem(1, a, list(range(13)), 150, 200)]
    dp.execute_step([], items)
    batch = PagedBatch(items, dp.pools[0], TPB, CUDA, decode=False)
    _, q = dp.model.qkv_all(dp.model.rows(batch.new_tokens, batch.new_positions), (0, 1),
                            torch.bfloat16, torch.bfloat16)
    kv = dp.pools[0].gpu
    got = dp.backend.run(kv, batch, q, dp.backend.plan(0, batch)).float()
    want = TorchBackend().run(kv, batch, q)
    atol, rtol = TOLERANCES["bfloat16"]
    assert float((got - want).abs().max()) <= atol + rtol * float(want.abs().max())


def test_cross_attention_non_causal_prefill_and_decode_verify():
    """Encoder K/V written once into the cross pool; a long prefill chunk (more queries than
    encoder keys), a short one and decodes attend to all of it, non-causally."""
    dp = DataPlane(SHAPE, [PoolSpec((0, 1), 64)], backend="flashinfer", device=CUDA,
                   cross=PoolSpec((0, 1), 16))
    enc = tokens(45, 20)
    view = CrossKV(enc, [7, 3, 11])
    a, b = tokens(120, 21), tokens(20, 22)
    check = dp.execute_step([], [StepItem(1, a, list(range(8)), 0, 100, cross=view),
                                 StepItem(2, b, [20, 21], 0, 10)],
                            encoder=[StepItem(1, enc, [7, 3, 11], 0, 45)])
    assert check.verified, check.mismatch
    for pos in range(100, 103):
        check = dp.execute_step([], [StepItem(1, a, list(range(8)), pos, pos + 1, cross=view),
                                     StepItem(2, b, [20, 21], pos - 90, pos - 89,
                                              cross=view)])
        assert check.verified, check.mismatch
    items = [StepItem(1, a, list(range(8)), 103, 110, cross=view)]
    batch = PagedBatch(items, dp.pools[0], TPB, CUDA, decode=False)
    cb = CrossBatch(batch, dp.pools[dp.cross_pool], (0, 1), CUDA)
    _, q = dp.model.qkv_all(dp.model.rows(batch.new_tokens, batch.new_positions), (0, 1),
                            torch.bfloat16, torch.bfloat16)
    q = q.index_select(1, cb.query_index)
    kv = dp.pools[dp.cross_pool].gpu
    got = dp.backend.run(kv, cb, q, dp.backend.plan(0, cb)).float()
    want = TorchBackend().run(kv, cb, q)
    atol, rtol = TOLERANCES["bfloat16"]
    assert float((got - want).abs().max()) <= atol + rtol * float(want.abs().max())


def test_step_phases_are_timed_once_per_step():
    dp = plane(PoolSpec((0, 1), 64, num_host_slots=8))
    a, b = tokens(300, 7), tokens(40, 8)
    first = dp.execute_step([], [StepItem(1, a, list(range(19)), 0, 250),
                                 StepItem(2, b, [30, 31, 32], 0, 39)])
    # A context chunk and a decode token: two planned calls, one span per phase.
    check = dp.execute_step([], [StepItem(1, a, list(range(19)), 250, 290),
                                 StepItem(2, b, [30, 31, 32], 39, 40)])
    assert first.verified and check.verified, check.mismatch
    parts = check.write_ms + check.attention_ms
    assert 0 < parts <= check.step_ms * 1.001 and check.linear_ms >= 0
    m = dp.metrics()
    assert m["data_plane_gpu_ms"] == pytest.approx(first.step_ms + check.step_ms)
    assert m["data_plane_wall_s"] > 0 and m["data_plane_host_ms_per_step"] > 0


def test_sliding_window_with_scratch_pages_plans_per_layer():
    window, n = 40, 160
    spec = PoolSpec((0, 1), 16, window=window, num_scratch_slots=4)
    dp = plane(spec)
    toks = tokens(n + 4, 2)
    # Queries up to 159 read positions >= 120: blocks 0-6 are out of window by the step's end.
    scratch = {b: (spec.num_gpu_slots + b // 2) * 2 + b % 2 for b in range(7)}
    table = [-1] * 7 + [3, 4, 5, 6]
    check = dp.execute_step([], [StepItem(1, toks, table, 0, n, scratch=scratch)])
    assert check.verified, check.mismatch
    for pos in range(n, n + 3):
        first = (pos - window + 1) // TPB
        check = dp.execute_step([], [StepItem(1, toks, table[first:], pos, pos + 1,
                                              first_block=first)])
        assert check.verified, check.mismatch


def test_host_tier_is_pinned_and_round_trips():
    dp = plane(PoolSpec((0, 1), 16, num_host_slots=8))
    assert dp.pools[0].host.is_pinned()
    a = tokens(40, 3)
    dp.execute_step([], [StepItem(1, a, [0, 1, 2], 0, 40)])

    def op(kind, st, s, dt, d):
        return CopyOp(kind, st, BlockId(s), dt, BlockId(d), TPB)

    off = [op(CopyKind.OFFLOAD, Tier.GPU, b, Tier.HOST, 16 + b) for b in range(3)]
    dp.execute_step(off, [StepItem(2, tokens(40, 4), [0, 1, 2], 0, 40)])
    on = [op(CopyKind.ONBOARD, Tier.HOST, 16 + b, Tier.GPU, 7 + 2 * b) for b in range(3)]
    b = np.concatenate([a, tokens(3, 5)])
    check = dp.execute_step(on, [StepItem(3, b, [7, 9, 11], 40, 43)])
    assert check.verified, check.mismatch
    assert check.copy_ms is not None and check.copied_blocks == 3


def test_auto_picks_flashinfer_and_torch_backend_runs_on_cuda():
    class Model:
        num_layers, num_kv_heads, num_q_heads, head_dim, dtype = 2, 2, 8, 128, "bfloat16"

    pools = [PoolSpec((0, 1), 16)]
    assert open_data_plane(Model, TPB, pools, backend="auto").backend.name == "flashinfer"
    torch_plane = open_data_plane(Model, TPB, pools, backend="torch")
    assert torch_plane.device.type == "cuda"
    check = torch_plane.execute_step([], [StepItem(1, tokens(20, 1), [0, 1], 0, 20)])
    assert check.verified and check.attention_ms is not None
