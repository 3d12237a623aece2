"""FlashInfer against the torch reference on the same paged cache. One shape (bfloat16,
head_dim 128) so that the JIT compiles few kernels: full and windowed prefill, tensor-core
decode (which reuses the prefill module) and the append kernel.

Tests parametrized by `backend` run the same body on the torch backend (on the CPU, always)
and on FlashInfer (where CUDA and the package are present; skipped elsewhere): cross-attention,
sliding windows with scratch pages, and, driven by the cache manager through the serve loop,
beams, a draft model's plane, and beams on sliding-window pools. The verifier checks every
K/V page a step reads bit for bit and every output within the dtype's tolerance. The other
tests (timing, pinned host memory, backend choice) need CUDA."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.cache.ids import BlockId, CopyKind, CopyOp, Tier  # noqa: E402
from kvbench.kernels.attention import CrossBatch, PagedBatch  # noqa: E402
from kvbench.kernels.reference import TorchBackend  # noqa: E402
from kvbench.kernels.dataplane import DataPlane, open_data_plane  # noqa: E402
from kvbench.kernels.step import CrossKV, ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.kernels.verify import TOLERANCES  # noqa: E402

HAVE_FLASHINFER = torch.cuda.is_available() and importlib.util.find_spec("flashinfer") is not None
needs_flashinfer = pytest.mark.skipif(not HAVE_FLASHINFER,
                                      reason="FlashInfer tests need CUDA and flashinfer")
BACKENDS = ["torch", pytest.param("flashinfer", marks=needs_flashinfer)]
"""The torch backend runs on the CPU, FlashInfer on the GPU."""

TPB = 16
SHAPE = ModelShape(num_layers=2, num_kv_heads=2, num_q_heads=8, head_dim=128,
                   tokens_per_block=TPB, dtype="bfloat16")
CUDA = torch.device("cuda")
ROOT = Path(__file__).resolve().parent.parent


def plane(*pools: PoolSpec, backend: str = "flashinfer", shape: ModelShape = SHAPE,
          cross: PoolSpec | None = None) -> DataPlane:
    device = CUDA if backend == "flashinfer" else torch.device("cpu")
    return DataPlane(shape, list(pools), backend=backend, device=device, cross=cross)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def close_to_torch(dp: DataPlane, kv: torch.Tensor, batch: PagedBatch, q: torch.Tensor) -> bool:
    """The backend's output equals the torch reference's on the same cache, within the
    dtype's tolerance."""
    got = dp.backend.run(kv, batch, q, dp.backend.plan(0, batch)).float()
    want = TorchBackend().run(kv, batch, q)
    atol, rtol = TOLERANCES["bfloat16"]
    return float((got - want).abs().max()) <= atol + rtol * float(want.abs().max())


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_append_and_decode_verify(backend):
    dp = plane(PoolSpec((0, 1), 64), backend=backend)
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
    assert m["verified"] is True and m["verified_steps"] == 5
    if backend == "flashinfer":
        assert m["time_source"] == "measured" and m["attention_ms"] > 0


@needs_flashinfer
def test_flashinfer_output_matches_torch_backend_on_the_same_cache():
    dp = plane(PoolSpec((0, 1), 64, window=None))
    a = tokens(200, 1)
    dp.execute_step([], [StepItem(1, a, list(range(13)), 0, 150)])
    items = [StepItem(1, a, list(range(13)), 150, 200)]
    dp.execute_step([], items)
    batch = PagedBatch(items, dp.pools[0], TPB, CUDA, decode=False)
    _, q = dp.model.qkv_all(dp.model.rows(batch.new_tokens, batch.new_positions), (0, 1),
                            torch.bfloat16, torch.bfloat16)
    assert close_to_torch(dp, dp.pools[0].gpu, batch, q)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_attention_non_causal_prefill_and_decode_verify(backend):
    """Encoder K/V written once into the cross pool; a long prefill chunk (more queries than
    encoder keys), a short one and decodes attend to all of it, non-causally."""
    dp = plane(PoolSpec((0, 1), 64), backend=backend, cross=PoolSpec((0, 1), 16))
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
    batch = PagedBatch(items, dp.pools[0], TPB, dp.device, decode=False)
    cb = CrossBatch(batch, dp.pools[dp.cross_pool], (0, 1), dp.device)
    _, q = dp.model.qkv_all(dp.model.rows(batch.new_tokens, batch.new_positions), (0, 1),
                            torch.bfloat16, torch.bfloat16)
    assert close_to_torch(dp, dp.pools[dp.cross_pool].gpu, cb, q.index_select(1, cb.query_index))
    assert dp.metrics()["verified_steps"] == 4


@needs_flashinfer
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


@pytest.mark.parametrize("backend", BACKENDS)
def test_sliding_window_with_scratch_pages_plans_per_layer(backend):
    window, n = 40, 160
    spec = PoolSpec((0, 1), 16, window=window, num_scratch_slots=4)
    dp = plane(spec, backend=backend)
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


@needs_flashinfer
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


@needs_flashinfer
def test_opening_a_plane_pins_the_staging_ring():
    """Every slot of the pinned ring is pinned when the plane opens, so a run's first steps
    (one slot each) stage their tables without pinning memory; the plane's `cuda` and its
    tensors' `cuda:0` share that one ring."""
    from kvbench.kernels import staging

    dp = plane(PoolSpec((0, 1), 16))
    r = staging.ring(dp.device)
    assert staging.ring(dp.pools[0].gpu.device) is r
    bufs = list(r._bufs)
    assert all(b is not None and b.is_pinned() and b.numel() >= staging.RESERVED_SLOT_BYTES
               for b in bufs)
    for i in range(staging.RING_SLOTS + 2):
        check = dp.execute_step([], [StepItem(i, tokens(20, i), [i % 16, (i + 1) % 16], 0, 20)])
        assert check.verified, check.mismatch
    assert all(a is b for a, b in zip(r._bufs, bufs))


@needs_flashinfer
def test_auto_picks_flashinfer_and_torch_backend_runs_on_cuda():
    class Model:
        num_layers, num_kv_heads, num_q_heads, head_dim, dtype = 2, 2, 8, 128, "bfloat16"

    pools = [PoolSpec((0, 1), 16)]
    assert open_data_plane(Model, TPB, pools, backend="auto").backend.name == "flashinfer"
    torch_plane = open_data_plane(Model, TPB, pools, backend="torch")
    assert torch_plane.device.type == "cuda"
    check = torch_plane.execute_step([], [StepItem(1, tokens(20, 1), [0, 1], 0, 20)])
    assert check.verified and check.attention_ms is not None


# Beams, drafts and windowed beams, driven by the cache manager through the serve loop (the
# tests' own helpers of test_beams, test_speculative and test_windows_beams), on a head_dim 128
# plane: whatever page tables, scratch pages and copies the engine emits run on the backend.

def record_tables(dp: DataPlane) -> dict[tuple[int, int], set[int]]:
    """Per (request, pool), the last page-table entries its step items ran on."""
    seen: dict[tuple[int, int], set[int]] = {}
    execute = dp.execute_step

    def record(ops, items, encoder=()):
        for it in items:
            seen.setdefault((it.request_id, it.pool), set()).add(it.blocks[-1])
        return execute(ops, items, encoder)

    dp.execute_step = record
    return seen


def assert_verified_every_step(dp: DataPlane) -> None:
    m = dp.metrics()
    assert m["verified"] is True, m["verify_mismatch"]
    assert m["verified_steps"] == dp.steps > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_beams_with_a_host_tier_verify(backend):
    from test_beams import beam_requests, serve

    dp = plane(PoolSpec((0, 1), 20, num_host_slots=8), backend=backend,
               shape=ModelShape(2, 2, 8, 128, 4, "bfloat16"))
    seen = record_tables(dp)
    m, result, _ = serve(beam_requests(3), blocks=20, host=8, plane=dp, batch_add=True,
                         bulk=False)
    assert_verified_every_step(dp)
    wide = [s.request.id for s in result.requests if s.request.beam_width > 1]
    assert any(len(seen.get((r, 0), ())) > 1 for r in wide)  # beams' own page tables
    assert m.offload_blocks > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_target_and_draft_planes_verify(backend):
    """Two-model speculation: k + 1 verification tokens per decoder on the target's plane,
    the draft's prefill and draft positions on its own plane (another shape: one layer, one
    KV head), both caches onboarding from their host tiers."""
    from test_speculative import random_requests, serve

    target = plane(PoolSpec((0, 1), 16, num_host_slots=4), backend=backend,
                   shape=ModelShape(2, 2, 8, 128, 4, "bfloat16"))
    draft = plane(PoolSpec((0,), 16, num_host_slots=4), backend=backend,
                  shape=ModelShape(1, 1, 4, 128, 4, "bfloat16"))
    m, *_ = serve(random_requests(4, n=12), draft=True, k=2, extra=1, blocks=16, host=4,
                  planes=(target, draft))
    for dp in (target, draft):
        assert_verified_every_step(dp)
    assert m.onboard_blocks > 0 and m.draft.onboard_blocks > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_beams_on_sliding_window_pools_with_scratch_verify(backend):
    """Three pools (W = 3 over two layers, full, W = 5), scratch slots and a host tier: each
    beam's page table from its first in-window block on, per-layer runs over scratch pages."""
    from test_beams import beam_requests
    from test_windows_beams import serve, wmgr

    m = wmgr([3, 3, None, 5], blocks=[40, 40, 40], host=6, emit=True, scratch=True)
    shape = ModelShape(m.num_layers, 2, 8, 128, m.tpb, "bfloat16")
    dp = plane(*[PoolSpec(c.layers, p.gpu.capacity, window=c.window,
                          num_host_slots=p.host.capacity if p.host else 0)
                 for c, p in zip(m.cycles, m.managers)], backend=backend, shape=shape)
    seen = record_tables(dp)
    result = serve(beam_requests(0), m, plane=dp, bulk=False)
    assert_verified_every_step(dp)
    wide = [s.request.id for s in result.requests if s.request.beam_width > 1]
    assert any(len(seen.get((r, 1), ())) > 1 for r in wide)
    assert m.scratch_blocks > 0


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("workload, variants", [
    ("verify-encoder-small.yaml", ["batch", "beams", "swa-decoder", "cache-mode"]),
    ("verify-speculative-small.yaml", ["batch", "swa-draft", "full-draft-over-swa",
                                       "cache-mode-swa"]),
])
def test_small_verify_workloads_run_on_the_backend(backend, workload, variants):
    """The engines end to end at head_dim 128: cross-attention (with beams, a windowed
    decoder, cache mode) and a draft model's plane (with sliding windows in either model,
    cache mode), every step verified on both planes."""
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    sets = [f"run.backend={backend}", "model.head_dim=128", "requests.synthetic.num_requests=12"]
    if "speculative" in workload:
        sets.append("speculative.draft_model.head_dim=128")
    outcomes = [o for o in run_workload(load_workload(ROOT / "workloads" / workload, sets))
                if o.variant in variants]
    assert len(outcomes) == len(variants)
    for o in outcomes:
        m = o.metrics
        assert m["data_plane_backend"] == backend
        assert m["verified"] is True, (o.variant, m["verify_mismatch"])
        assert m["verified_steps"] == m["data_plane_steps"] > 0
        if "speculative" in workload:
            assert m["draft_verified"] is True, m.get("draft_verify_mismatch")
        else:
            assert m["cross_requests"] > 0
