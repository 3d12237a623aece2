"""The data plane at its own API: storage, copies, synthetic model, torch attention, verifier.

Small shapes throughout (tokens_per_block 4, a few layers and heads) so every test runs in a
fraction of a second on a slow CPU.
"""

from __future__ import annotations

import math

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.cache.ids import BlockId, CopyKind, CopyOp, Tier  # noqa: E402
from kvbench.kernels.attention import PagedBatch, write_kv  # noqa: E402
from kvbench.kernels.copies import _runs, _waves  # noqa: E402
from kvbench.kernels.dataplane import DataPlane, resolve_backend  # noqa: E402
from kvbench.kernels.model import SyntheticModel  # noqa: E402
from kvbench.kernels.reference import TorchBackend, attend_casts  # noqa: E402
from kvbench.kernels.storage import STORAGE_DTYPES  # noqa: E402
from kvbench.kernels.step import (  # noqa: E402
    BackendUnavailable, ModelShape, PoolSpec, StepItem,
)

TPB = 4
SHAPE = ModelShape(num_layers=3, num_kv_heads=2, num_q_heads=4, head_dim=16,
                   tokens_per_block=TPB, dtype="bfloat16")
FULL = PoolSpec(layers=(0, 1, 2), num_gpu_slots=16, num_host_slots=8)


def plane(*pools: PoolSpec, shape: ModelShape = SHAPE, verify: str = "all") -> DataPlane:
    return DataPlane(shape, list(pools) or [FULL], verify=verify)


def tokens(n: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 50_000, n)


def op(kind: CopyKind, src_tier: Tier, src: int, dst_tier: Tier, dst: int, n: int = TPB) -> CopyOp:
    return CopyOp(kind, src_tier, BlockId(src), dst_tier, BlockId(dst), n)


def onboard(src: int, dst: int) -> CopyOp:
    return op(CopyKind.ONBOARD, Tier.HOST, src, Tier.GPU, dst)


def offload(src: int, dst: int) -> CopyOp:
    return op(CopyKind.OFFLOAD, Tier.GPU, src, Tier.HOST, dst)


def prefill(dp: DataPlane, rid: int, toks: np.ndarray, blocks: list[int], start: int = 0,
            end: int | None = None, copy_ops=(), **kw):
    item = StepItem(rid, toks, blocks, start, len(toks) if end is None else end, **kw)
    return dp.execute_step(list(copy_ops), [item])


# --- synthetic model and reference attention ---------------------------------------------


def test_model_is_batch_invariant_and_position_and_layer_dependent():
    model = SyntheticModel(SHAPE, seed=3, device=torch.device("cpu"))
    toks = tokens(40, 1)
    pos = np.arange(40)
    k_all, v_all, q_all = model.qkv(model.rows(toks, pos), 1)
    k_one, v_one, q_one = model.qkv(model.rows(toks[17:18], pos[17:18]), 1)
    assert torch.equal(k_all[17:18], k_one) and torch.equal(v_all[17:18], v_one)
    assert torch.equal(q_all[17:18], q_one)
    k_moved, _, _ = model.qkv(model.rows(toks[17:18], pos[17:18] + TPB), 1)
    k_layer, _, _ = model.qkv(model.rows(toks[17:18], pos[17:18]), 2)
    assert not torch.allclose(k_one, k_moved, atol=0.1)
    assert not torch.allclose(k_one, k_layer, atol=0.1)
    assert 0.7 < float(k_all.std()) < 1.3


def naive_attention(q, k, v, q_pos, k_pos, window):
    nq, hq, d = q.shape
    g = hq // k.shape[1]
    out = torch.zeros(nq, hq, d, dtype=torch.float64)
    for i in range(nq):
        for h in range(hq):
            keys = [j for j in range(len(k_pos))
                    if k_pos[j] <= q_pos[i] and (window is None or k_pos[j] > q_pos[i] - window)]
            s = torch.tensor([float(q[i, h].double() @ k[j, h // g].double()) / math.sqrt(d)
                              for j in keys], dtype=torch.float64)
            p = torch.softmax(s, 0)
            out[i, h] = sum(p[n] * v[j, h // g].double() for n, j in enumerate(keys))
    return out


@pytest.mark.parametrize("chunk", [256, 2])
@pytest.mark.parametrize("window", [None, 1, 5])
def test_reference_attention_matches_naive_gqa_with_window(window, chunk, monkeypatch):
    """Runs of 2 queries read only the keys some query of the run sees (those past the run's
    last query or before its first one's window are left out, not masked): the same."""
    from kvbench.kernels import reference

    monkeypatch.setattr(reference, "QUERY_CHUNK", chunk)
    dp = plane(PoolSpec(layers=(0, 1, 2), num_gpu_slots=8, window=window))
    toks = tokens(11, 1)
    first = max(0, 5 - window + 1) // TPB if window else 0
    assert prefill(dp, 1, toks, list(range(3)), 0, 5).verified
    item = StepItem(1, toks, list(range(3))[first:], 5, 11, first_block=first)
    batch = PagedBatch([item], dp.pools[0], TPB, torch.device("cpu"), decode=False)
    kv = dp.pools[0].gpu
    new_kv, q = dp.model.qkv_all(dp.model.rows(batch.new_tokens, batch.new_positions),
                                 (0, 1, 2), torch.float32, torch.float32)
    write_kv(kv, batch, new_kv.to(torch.bfloat16))
    got = TorchBackend().run(kv, batch, q.to(torch.bfloat16))
    lo = first * TPB
    all_kv, _ = dp.model.qkv_all(dp.model.rows(toks[lo:11], np.arange(lo, 11)), (0, 1, 2),
                                 torch.bfloat16, None)
    for layer in range(3):
        k, v = all_kv[layer, :, 0].float(), all_kv[layer, :, 1].float()
        want = naive_attention(q[layer].to(torch.bfloat16).float(), k, v, list(range(5, 11)),
                               list(range(lo, 11)), window)
        assert torch.allclose(got[layer].double(), want, atol=1e-5)
    if window == 1:
        # Window 1: a query sees only itself.
        v = all_kv[:, 5 - lo:, 1].float()
        assert torch.allclose(got.view(3, 6, 2, 2, 16), v[:, :, :, None, :].expand(3, 6, 2, 2, 16))


# --- reuse, copies and faults --------------------------------------------------------------


def test_full_reuse_and_decode_verify():
    dp = plane()
    a = tokens(30, 1)
    assert prefill(dp, 1, a, [0, 1, 2, 3, 4, 5, 6, 7]).verified
    b = np.concatenate([a[:24], tokens(9, 2)])
    check = prefill(dp, 2, b, [0, 1, 2, 3, 4, 5, 9, 10, 11], start=24)
    assert check.verified and check.max_abs_err == 0.0
    # One more token: a decode item.
    c = np.concatenate([b, tokens(1, 3)])
    assert prefill(dp, 2, c, [0, 1, 2, 3, 4, 5, 9, 10, 11], start=33).verified
    assert dp.metrics()["verified"] is True
    assert dp.metrics()["verified_steps"] == 3


def test_wrong_page_index_is_caught():
    dp = plane()
    a = tokens(16, 1)
    prefill(dp, 1, a, [0, 1, 2, 3])
    prefill(dp, 2, tokens(16, 2), [4, 5, 6, 7])
    b = np.concatenate([a[:12], tokens(4, 3)])
    check = prefill(dp, 3, b, [0, 5, 2, 8], start=12)
    m = check.mismatch
    assert check.verified is False and m.kind == "kv"
    assert (m.request_id, m.step, m.layer, m.position, m.block_index, m.block_id) == (3, 2, 0, 4, 1, 5)
    assert m.tier == "GPU"
    assert "request 3" in str(m) and "block 5" in str(m)
    assert dp.metrics()["verified"] is False


def test_block_reused_at_wrong_position_is_caught():
    dp = plane()
    a = np.tile(tokens(4, 1), 4)  # the same 4 tokens in every block: only positions differ
    prefill(dp, 1, a, [0, 1, 2, 3])
    check = prefill(dp, 2, a[:9], [1, 0, 4], start=8)
    assert check.mismatch.position == 0 and check.mismatch.block_id == 1


def test_partial_copy_and_skipped_copy():
    a = tokens(20, 1)
    b = np.concatenate([a[:10], tokens(6, 2)])
    copy = op(CopyKind.PARTIAL, Tier.GPU, 2, Tier.GPU, 9, n=2)
    for ops, ok in (([copy], True), ([], False)):
        dp = plane()
        prefill(dp, 1, a, [0, 1, 2, 3, 4])
        check = prefill(dp, 2, b, [0, 1, 9, 10], start=10, copy_ops=ops)
        assert check.verified is ok
        if not ok:
            assert (check.mismatch.position, check.mismatch.block_id) == (8, 9)
        else:
            assert check.copied_blocks == 1 and check.copy_bytes == dp.pools[0].slot_bytes


def test_block_overwritten_after_claim_is_caught():
    dp = plane()
    a = tokens(12, 1)
    prefill(dp, 1, a, [0, 1, 2])
    b = np.concatenate([a[:8], tokens(4, 2)])
    intruder = StepItem(7, tokens(8, 3), [5, 1], 0, 8)  # given block 1, which b claimed
    check = dp.execute_step([], [intruder, StepItem(2, b, [0, 1, 3], 8, 12)])
    assert check.mismatch.request_id == 2 and check.mismatch.block_id == 1


def test_host_tier_offload_onboard_round_trip_and_skipped_offload():
    a = tokens(12, 1)
    b = np.concatenate([a, tokens(5, 2)])
    for skip_offload in (False, True):
        dp = plane()
        prefill(dp, 1, a, [0, 1, 2])
        # Evict blocks 0-2 to host 16-18 (host ids follow the 16 GPU ids), reuse the GPU
        # blocks for another sequence, then onboard into fresh GPU blocks.
        evict = [] if skip_offload else [offload(0, 16), offload(1, 17), offload(2, 18)]
        prefill(dp, 2, tokens(12, 3), [0, 1, 2], copy_ops=evict)
        check = prefill(dp, 3, b, [5, 6, 7, 8, 9], start=12,
                        copy_ops=[onboard(16, 5), onboard(17, 6), onboard(18, 7)])
        assert check.verified is (not skip_offload)
        if skip_offload:
            m = check.mismatch
            assert m.block_id == 5 and m.tier == "GPU (onboarded from HOST block 16 at step 2)"


def test_host_pages_moved_as_whole_slots():
    dp = plane()
    prefill(dp, 1, tokens(8, 1), [3, 4])
    dp.execute_step([offload(3, 20), offload(4, 21)], [])
    host = dp.pools[0].host
    assert torch.equal(host[4 * 3:6 * 3], dp.pools[0].gpu[3 * 3:5 * 3])


def test_copy_waves_respect_emission_order():
    # The onboard empties host block 16, which the offload refills in the same step: the onboard
    # must read the old contents first.
    dp = plane()
    a, c = tokens(4, 1), tokens(4, 2)
    prefill(dp, 1, a, [0])
    prefill(dp, 2, c, [1], copy_ops=[offload(0, 16)])
    check = prefill(dp, 3, np.concatenate([a, tokens(1, 3)]), [2, 3], start=4,
                    copy_ops=[onboard(16, 2), offload(1, 16)])
    assert check.verified
    check = prefill(dp, 4, np.concatenate([c, tokens(1, 4)]), [4, 5], start=4,
                    copy_ops=[onboard(16, 4)])
    assert check.verified
    ops = [onboard(16, 2), offload(1, 16), onboard(17, 3), offload(5, 18)]
    assert [len(w) for w in _waves(ops)] == [1, 3]


def test_runs_merge_consecutive_pairs():
    assert list(_runs([5, 1, 2, 3, 9], [0, 7, 8, 2, 1])) == [(1, 7, 2), (3, 2, 1), (5, 0, 1),
                                                          (9, 1, 1)]


def test_copy_op_outside_the_pool_is_rejected():
    dp = plane()
    with pytest.raises(ValueError, match="outside the pool"):
        dp.execute_step([onboard(3, 0)], [])


# --- sliding windows and scratch pages -----------------------------------------------------


def test_sliding_window_chunks_and_decode_with_truncated_page_table():
    window = 6
    dp = plane(PoolSpec(layers=(0, 1, 2), num_gpu_slots=16, window=window))
    toks = tokens(40, 1)
    blocks = list(range(10))
    for start in range(0, 36, 9):
        end = min(start + 9, 36)
        first = max(0, start - window + 1) // TPB
        assert prefill(dp, 1, toks, blocks[first:], start, end, first_block=first).verified
    for pos in range(36, 40):
        first = (pos - window + 1) // TPB
        assert prefill(dp, 1, toks, blocks[first:], pos, pos + 1, first_block=first).verified
    # The page table must reach back to the oldest position a query reads.
    with pytest.raises(ValueError, match="need position"):
        prefill(dp, 1, toks, blocks[8:], 34, 36, first_block=8)


class WindowBlindBackend(TorchBackend):
    """Attends to the whole page table, as a kernel planned without window_left would."""

    def run(self, kv, batch, q, plan=None):
        window, batch.window = batch.window, None
        try:
            return super().run(kv, batch, q, plan)
        finally:
            batch.window = window


def test_backend_ignoring_the_window_is_caught():
    dp = plane(PoolSpec(layers=(0, 1, 2), num_gpu_slots=8, window=3))
    dp.backend = WindowBlindBackend()
    check = prefill(dp, 1, tokens(20, 1), list(range(5)))
    assert check.mismatch.kind == "attention" and check.mismatch.position >= 3


def scratch_map(blocks: range, num_gpu_slots: int, num_layers: int) -> dict[int, int]:
    """Issue 5's mapping: out-of-window block j shares scratch slot j // L at slice j % L."""
    return {b: (num_gpu_slots + i // num_layers) * num_layers + i % num_layers
            for i, b in enumerate(blocks)}


def test_scratch_pages_serve_out_of_window_prompt_blocks():
    window, n = 6, 40
    spec = PoolSpec(layers=(0, 1, 2), num_gpu_slots=8, window=window, num_scratch_slots=3)
    dp = plane(spec)
    toks = tokens(n + 2, 1)
    # Queries up to position 39 need positions >= 34: blocks 0-7 are out of window by the end
    # of the step and live in scratch pages; blocks 8 and 9 get real slots.
    scratch = scratch_map(range(8), spec.num_gpu_slots, 3)
    table = [-1] * 8 + [4, 5, 6]
    assert prefill(dp, 1, toks, table, 0, n, scratch=scratch).verified
    # Later steps read only the real blocks.
    assert prefill(dp, 1, toks, table[8:], n, n + 1, first_block=8).verified
    # Two scratch blocks on one page: the later write clobbers the earlier one.
    bad = dict(scratch)
    bad[3] = bad[2]
    check = prefill(plane(spec), 1, toks, table, 0, n, scratch=bad)
    assert check.mismatch.kind == "kv" and check.mismatch.tier == "scratch"
    assert check.mismatch.block_index in (2, 3)


def test_two_pools_with_their_own_windows_and_copy_ops():
    swa = PoolSpec(layers=(0, 2), num_gpu_slots=8, window=5, num_host_slots=4)
    full = PoolSpec(layers=(1,), num_gpu_slots=8)
    dp = plane(swa, full)
    a = tokens(16, 1)
    items = [StepItem(1, a, [0, 1, 2, 3], 0, 16, pool=0), StepItem(1, a, [0, 1, 2, 3], 0, 16, pool=1)]
    assert dp.execute_step({}, items).verified
    b = np.concatenate([a, tokens(2, 2)])
    ops = {0: [offload(3, 8), onboard(8, 6)]}
    items = [StepItem(2, b, [6, 4], 16, 18, pool=0, first_block=3),
             StepItem(2, b, [0, 1, 2, 3, 4], 16, 18, pool=1)]
    check = dp.execute_step(ops, items)
    assert check.verified and check.copied_blocks == 2
    with pytest.raises(ValueError, match="distinct"):
        DataPlane(SHAPE, [swa, PoolSpec(layers=(0, 1), num_gpu_slots=4)])


READS = ("item", "tolist", "cpu", "__bool__", "__int__", "__float__", "__index__")
"""Tensor methods that read a value back: on a GPU each makes the host wait for the GPU."""


def count_waits(monkeypatch) -> dict[str, int]:
    """Count, from now on, the calls that would make the host wait for a GPU: reads of tensor
    values and `Tensor.to(device)` (from a CPU tensor: a pageable, synchronous copy)."""
    counts: dict[str, int] = {}

    def counted(name, orig, only_devices):
        def f(self, *args, **kw):
            if not only_devices or any(isinstance(x, (torch.device, str))
                                       for x in (*args, *kw.values())):
                counts[name] = counts.get(name, 0) + 1
            return orig(self, *args, **kw)
        return f

    for name in READS:
        monkeypatch.setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name), False))
    monkeypatch.setattr(torch.Tensor, "to", counted("to", torch.Tensor.to, True))
    return counts


@pytest.mark.parametrize("num_layers", [2, 12])
def test_a_verified_step_waits_for_the_device_once(monkeypatch, num_layers):
    """A verified step of decode items, a prefill chunk and a batch with scratch pages (run
    and checked layer by layer) reads its verdicts back in one copy, whatever the number of
    layers, items and batches; an unverified step reads nothing."""
    shape = ModelShape(num_layers, 2, 4, 16, TPB, "bfloat16")
    full = PoolSpec(layers=tuple(range(num_layers - 1)), num_gpu_slots=64)
    swa = PoolSpec(layers=(num_layers - 1,), num_gpu_slots=16, window=6, num_scratch_slots=8)
    toks = [tokens(41, seed) for seed in range(4)]

    def step(verify: str):
        dp = plane(full, swa, shape=shape, verify=verify)
        dp.execute_step({}, [StepItem(r, toks[r], range(10 * r, 10 * r + 10), 0, 24)
                             for r in range(3)])
        items = [StepItem(r, toks[r], range(10 * r, 10 * r + 10), 24, 25) for r in range(3)]
        items.append(StepItem(3, toks[3], range(30, 41), 0, 40))
        items.append(StepItem(3, toks[3], [-1] * 8 + [4, 5, 6], 0, 40, pool=1,
                              scratch=scratch_map(range(8), 16, 1)))
        counts = count_waits(monkeypatch)
        check = dp.execute_step({}, items)
        monkeypatch.undo()
        return check, counts

    check, counts = step("all")
    assert check.verified and counts == {"cpu": 1}
    check, counts = step("off")
    assert check.verified is None and counts == {}


# --- dtypes, verification modes, backend resolution ---------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "float16", "fp8"])
def test_other_dtypes_verify(dtype):
    shape = ModelShape(2, 1, 2, 16, TPB, dtype)
    dp = plane(PoolSpec(layers=(0, 1), num_gpu_slots=8, num_host_slots=2), shape=shape)
    a = tokens(10, 1)
    prefill(dp, 1, a, [0, 1, 2])
    check = prefill(dp, 2, np.concatenate([a[:8], tokens(3, 2)]), [3, 4, 5], start=8,
                    copy_ops=[offload(0, 8), offload(1, 9), onboard(8, 3), onboard(9, 4)])
    assert check.verified


class NoisyBackend(TorchBackend):
    def run(self, kv, batch, q, plan=None):
        out = super().run(kv, batch, q, plan)
        out[:, -1] += 0.05
        return out


def test_attention_error_beyond_tolerance_is_reported():
    dp = plane()
    dp.backend = NoisyBackend()
    check = prefill(dp, 1, tokens(9, 1), [0, 1, 2])
    m = check.mismatch
    assert m.kind == "attention" and m.position == 8 and m.error > m.tolerance > 0
    assert check.max_abs_err == pytest.approx(0.05, rel=0.05)


def test_verify_off_and_sample():
    off = plane(verify="off")
    check = prefill(off, 1, tokens(8, 1), [0, 1])
    assert check.verified is None and off.metrics()["verified"] is None
    sample = plane(verify="sample")
    checked = [prefill(sample, i, tokens(4, i), [i]).verified for i in range(16)]
    assert None in checked and all(c in (None, True) for c in checked)


def test_bad_items_are_caller_errors():
    dp = plane()
    with pytest.raises(ValueError, match="empty"):
        StepItem(1, tokens(4, 1), [0], 4, 4)
    with pytest.raises(ValueError, match="tokens cover"):
        StepItem(1, tokens(4, 1), [0, 1], 0, 6)
    with pytest.raises(ValueError, match="page table has"):
        prefill(dp, 1, tokens(9, 1), [0, 1])
    with pytest.raises(ValueError, match="outside the pool"):
        prefill(dp, 1, tokens(4, 1), [99])


def test_flashinfer_resolution_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present: covered by tests/test_flashinfer.py")
    assert resolve_backend("auto", "bfloat16") == "torch"
    assert resolve_backend("torch", "float32") == "torch"
    with pytest.raises(BackendUnavailable, match="CUDA"):
        resolve_backend("flashinfer", "bfloat16")


def test_sequence_tokens_appends_generated_tokens():
    from kvbench.kernels.step import sequence_tokens
    from kvbench.traffic.request import Request

    prompt = np.arange(10, 16)
    known = Request(1, 0.0, 6, 3, tokens=prompt, output_tokens=np.array([7, 8, 9]))
    assert sequence_tokens(known, 4).tolist() == [10, 11, 12, 13]
    assert sequence_tokens(known, 8).tolist() == [10, 11, 12, 13, 14, 15, 7, 8]
    unknown = Request(2, 0.0, 6, 3, tokens=prompt)
    tail = sequence_tokens(unknown, 9)[6:]
    assert (tail < 0).all() and len(set(tail.tolist())) == 3


def test_paged_batch_tables_equal_a_per_item_recomputation():
    """The vectorised PagedBatch (pages expanded per layer on the device, one upload) gives
    the tables a plain per-item, per-layer loop gives, scratch pages and windows included."""
    from kvbench.kernels.model import table_rows

    dp = plane(PoolSpec(layers=(0, 1, 2), num_gpu_slots=16, num_scratch_slots=2, window=6))
    pool = dp.pools[0]
    a, b, c = tokens(40, 1), tokens(40, 2), tokens(40, 3)
    items = [StepItem(1, a, [3, 7, 1, 9], 13, 14, first_block=1),
             StepItem(2, b, [4, 5, 6], 5, 9, scratch={1: 16 * 3 + 1}),
             StepItem(3, c, [10, 11], 6, 7)]
    batch = PagedBatch(items, pool, TPB, torch.device("cpu"), decode=False)
    want_pages = [[] for _ in range(3)]
    want_write, want_pos, want_tok = [[] for _ in range(3)], [], []
    base = 0
    for it in items:
        npages = -(-(it.end - it.first_block * TPB) // TPB)
        for layer in range(3):
            for r in range(npages):
                index = it.first_block + r
                scratch = (it.scratch or {}).get(index)
                want_pages[layer].append(scratch if scratch is not None
                                         else it.blocks[r] * 3 + layer)
        for p in range(it.start, it.end):
            rel = p - it.first_block * TPB
            for layer in range(3):
                k_row = want_pages[layer][base + rel // TPB] * 2 * TPB + rel % TPB
                want_write[layer].append([k_row, k_row + TPB])
            want_pos.append(p)
            want_tok.append(int(it.tokens[p]))
        base += npages
    assert batch.pages_dev.tolist() == want_pages
    assert batch.write_rows.tolist() == want_write
    assert batch.new_positions.tolist() == want_pos
    assert batch.new_tokens.tolist() == want_tok
    assert torch.equal(batch.rows, torch.from_numpy(table_rows(np.array(want_tok),
                                                               np.array(want_pos))))
    assert batch.kv_indptr.tolist() == [0, 3, 6, 8]
    assert batch.last_page_len.tolist() == [2, 1, 3]
    # Decode items (one token each) take the same tables through the decode path.
    dec = PagedBatch(items[:1] + items[2:], pool, TPB, torch.device("cpu"), decode=True)
    assert dec.new_tokens.tolist() == [int(a[13]), int(c[6])]
    assert dec.pages_dev[:, 3:].tolist() == [p[6:] for p in want_pages]


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8"])
def test_kv_exact_equals_qkv_all_bit_for_bit(dtype):
    """The verifier's recomputation (four casts per key, picked per layer and column) gives
    the bits the per-layer float32 formula gives, in every storage type."""
    shape = ModelShape(5, 2, 4, 16, TPB, dtype)
    model = SyntheticModel(shape, 3, torch.device("cpu"))
    rows = model.rows(np.arange(-50, 250), np.arange(300) * 7)
    kv_dtype = STORAGE_DTYPES[dtype]
    want, _ = model.qkv_all(rows, (0, 2, 3, 4), kv_dtype, None)
    got = model.kv_exact(rows, (0, 2, 3, 4), kv_dtype)
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[want.element_size()]
    assert got.shape == want.shape
    assert torch.equal(got.view(bits), want.view(bits))


@pytest.mark.parametrize("max_bytes", [1 << 30, 1])
def test_qkv_all_equals_the_per_layer_formula_bit_for_bit(max_bytes):
    """Every layer's K/V and Q from `qkv_all` (one group, or one layer at a time when the
    temporaries' bound is tiny) are the casts of the per-layer float32 `qkv`."""
    shape = ModelShape(5, 2, 4, 16, TPB, "bfloat16")
    model = SyntheticModel(shape, 11, torch.device("cpu"))
    rows = model.rows(np.arange(-20, 60), np.arange(80) * 3)
    layers = (4, 0, 2)
    kv, q = model.qkv_all(rows, layers, torch.bfloat16, torch.float16, max_bytes)
    kv_only, none = model.qkv_all(rows, layers, torch.bfloat16, None, max_bytes)
    assert none is None and torch.equal(kv_only.view(torch.int16), kv.view(torch.int16))
    for i, layer in enumerate(layers):
        k, v, q_layer = model.qkv(rows, layer)
        assert torch.equal(kv[i, :, 0].view(torch.int16), k.bfloat16().view(torch.int16))
        assert torch.equal(kv[i, :, 1].view(torch.int16), v.bfloat16().view(torch.int16))
        assert torch.equal(q[i].view(torch.int16), q_layer.half().view(torch.int16))


@pytest.mark.parametrize("window", [None, 3])
def test_reference_from_the_model_casts_matches_naive_for_decode_items(window):
    """The verifier's decode reference (`attend_casts`: layers on the query side, keys read as
    the model's four casts) equals naive attention over each layer's K/V."""
    dp = plane(PoolSpec(layers=(0, 1, 2), num_gpu_slots=8, window=window))
    seqs = [(1, tokens(10, 1), [0, 1, 2]), (2, tokens(7, 2), [3, 4])]
    for rid, toks, blocks in seqs:
        assert prefill(dp, rid, toks, blocks, 0, len(toks) - 1).verified
    items = [StepItem(rid, toks, blocks, len(toks) - 1, len(toks)) for rid, toks, blocks in seqs]
    batch = PagedBatch(items, dp.pools[0], TPB, torch.device("cpu"), decode=True)
    keys = batch.item_keys(windowed=True)
    model, layers = dp.model, (0, 1, 2)
    _, q = model.qkv_all(batch.rows, layers, torch.bfloat16, torch.bfloat16)
    toks_of = np.concatenate([seqs[int(i)][1][[p]] for i, p in zip(keys.item, keys.positions)])
    casts = model.kv_casts(model.rows(toks_of, keys.positions), torch.bfloat16)
    got = dict((a, o) for a, b, o in attend_casts(q, casts, model.cast_index(layers), batch,
                                                   keys, slice(0, 2), window))
    for i, (rid, toks, _) in enumerate(seqs):
        k0, k1 = int(keys.indptr[i]), int(keys.indptr[i + 1])
        pos = keys.positions[k0:k1]
        kv = model.kv_exact(model.rows(toks[pos], pos), layers, torch.bfloat16)
        for layer in layers:
            want = naive_attention(q[layer, i:i + 1].float(), kv[layer, :, 0].float(),
                                   kv[layer, :, 1].float(), [len(toks) - 1], list(pos), window)
            assert torch.allclose(got[i][layer].double(), want, atol=1e-5)


class _LastLayerNoisy(TorchBackend):
    """Off by 0.05 at the last layer's queries only."""

    def run(self, kv, batch, q, plan=None):
        out = super().run(kv, batch, q, plan)
        out[-1] += 0.05
        return out


def test_decode_verdicts_do_not_depend_on_the_tiling(monkeypatch):
    """A decode batch checked in tiles of one layer and one item (its reference runs every
    layer with the items' first layer group) gives the verdicts of one tile for all: right
    data verified with the same largest error, an attention fault at the last layer reported
    there, a wrong page caught at its block."""
    from kvbench.kernels import verify

    seqs = [(1, tokens(10, 1), [0, 1, 2]), (2, tokens(7, 2), [3, 4]), (3, tokens(5, 3), [5, 6])]

    def decode_step(backend=None, blocks_of=None):
        dp = plane()
        for rid, toks, blocks in seqs:
            prefill(dp, rid, toks, blocks, 0, len(toks) - 1)
        if backend is not None:
            dp.backend = backend
        return dp.execute_step([], [StepItem(rid, toks, (blocks_of or {}).get(rid, blocks),
                                             len(toks) - 1, len(toks))
                                    for rid, toks, blocks in seqs])

    def verdicts():
        good = decode_step()
        noisy = decode_step(_LastLayerNoisy()).mismatch
        wrong = decode_step(blocks_of={2: [3, 9]}).mismatch  # block 9 never written
        return (good.verified, good.max_abs_err, (noisy.kind, noisy.layer, noisy.request_id),
                (wrong.kind, wrong.request_id, wrong.block_id, wrong.position))

    whole = verdicts()
    assert whole[0] is True and whole[1] > 0
    assert whole[2:] == (("attention", 2, 1), ("kv", 2, 9, 4))
    tiles = verify.tiles
    # A budget of one key: every tile is one layer of one item.
    monkeypatch.setattr(verify, "tiles", lambda counts, num_layers, key_bytes, budget:
                        tiles(counts, num_layers, key_bytes, key_bytes))
    assert len(list(verify.tiles(np.array([3, 2, 2]), 3, 8, 1 << 30))) == 9
    assert verdicts() == whole


def test_tf32_split_of_probabilities_is_exact():
    """`_bmm_probs`' split: the high part has TF32's bits only, high + low is p exactly, and
    the two products sum to p @ v (on a CPU both run in float32)."""
    from kvbench.kernels.reference import _TF32_HIGH, _bmm_probs

    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(3, 4, 50, generator=gen) * 4, dim=-1)
    v = torch.randn(3, 50, 8, generator=gen).bfloat16().float()
    high = (p.view(torch.int32) & _TF32_HIGH).view(torch.float32)
    # TF32 keeps 10 of float32's 23 stored significand bits: the low 13 must be zero.
    assert int((high.view(torch.int32) & 0x1FFF).abs().max()) == 0 and (high > 0).all()
    assert torch.equal(high + (p - high), p)
    assert ((p - high).abs() <= p.abs() * 2.0**-10).all()
    assert torch.allclose(_bmm_probs(p, v, True), torch.bmm(p, v), rtol=1e-6, atol=1e-7)
