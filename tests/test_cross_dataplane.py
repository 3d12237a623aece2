"""Cross-attention KV on the data plane: the encoder's K/V generator, the cross pool, encoder
writes, non-causal cross attention in the torch backend, the verifier, and both engine modes.
Fault injection: a cross block from another encoder input, a skipped cross write and a cross
page overwritten while claimed are each reported on exactly that block."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels.attention import CrossBatch, PagedBatch  # noqa: E402
from kvbench.kernels.reference import TorchBackend  # noqa: E402
from kvbench.kernels.dataplane import DataPlane  # noqa: E402
from kvbench.kernels.step import CrossKV, ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.kernels.storage import STORAGE_DTYPES  # noqa: E402

TPB = 4
SHAPE = ModelShape(3, 2, 4, 16, TPB, "bfloat16")
ALL = (0, 1, 2)


def plane(cross_slots: int = 12, pools=None) -> DataPlane:
    return DataPlane(SHAPE, pools or [PoolSpec(ALL, 24)], cross=PoolSpec(ALL, cross_slots))


def enc_tokens(seed: int, n: int = 10) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 1 << 40, n)


def dec_tokens(seed: int, n: int = 12) -> np.ndarray:
    return np.random.default_rng(100 + seed).integers(0, 50_000, n)


def prefill(dp: DataPlane, rid: int, enc, cross_blocks, self_blocks, end: int = 6,
            write_blocks=None):
    """A request's first step: writes its encoder K/V (into `write_blocks`, the cross table
    unless a fault redirects it) and prefills `[0, end)` attending to `cross_blocks`."""
    write = [StepItem(rid, enc, write_blocks or cross_blocks, 0, len(enc))]
    item = StepItem(rid, dec_tokens(rid), self_blocks, 0, end, cross=CrossKV(enc, cross_blocks))
    return dp.execute_step([], [item], encoder=write)


def decode(dp: DataPlane, rid: int, enc, cross_blocks, self_blocks, pos: int = 6):
    item = StepItem(rid, dec_tokens(rid), self_blocks, pos, pos + 1,
                    cross=CrossKV(enc, cross_blocks))
    return dp.execute_step([], [item])


def test_encoder_pages_hold_the_generator_bits_and_are_batching_invariant():
    a, b = enc_tokens(1), enc_tokens(2, 7)
    one = plane()
    one.execute_step([], [], encoder=[StepItem(1, a, [3, 7, 1], 0, 10),
                                      StepItem(2, b, [5, 0], 0, 7)])
    two = plane()
    # The same inputs written in other batches and in two parts.
    two.execute_step([], [], encoder=[StepItem(2, b, [5, 0], 0, 7),
                                      StepItem(1, a, [3, 7, 1], 0, 4)])
    two.execute_step([], [], encoder=[StepItem(1, a, [3, 7, 1], 4, 10)])
    kv1, kv2 = (p.pools[p.cross_pool].gpu for p in (one, two))
    assert torch.equal(kv1.view(torch.int16), kv2.view(torch.int16))
    # Page b * L + l holds layer l of block b: the generator's K/V, rounded to storage.
    model = one.cross_model
    want, _ = model.qkv_all(model.rows(a, np.arange(10)), ALL, STORAGE_DTYPES["bfloat16"], None)
    for pos in range(10):
        block = [3, 7, 1][pos // TPB]
        for layer in ALL:
            got = kv1[block * 3 + layer, :, pos % TPB]
            assert torch.equal(got.view(torch.int16), want[layer, pos].view(torch.int16))
    # The encoder's K/V are not the decoder's for the same token and position.
    dec, _ = one.model.qkv_all(one.model.rows(a, np.arange(10)), ALL,
                               STORAGE_DTYPES["bfloat16"], None)
    assert not torch.equal(dec, want)


def test_cross_attention_equals_dense_softmax_over_every_encoder_key():
    dp = plane()
    enc = enc_tokens(3, 9)
    tokens = dec_tokens(3)
    dp.execute_step([], [StepItem(1, tokens, [0, 1, 2], 0, 2)],
                    encoder=[StepItem(1, enc, [4, 2, 8], 0, 9)])
    items = [StepItem(1, tokens, [0, 1, 2], 2, 9, cross=CrossKV(enc, [4, 2, 8])),
             StepItem(2, tokens, [5, 6], 0, 5)]  # no encoder input: no cross attention
    batch = PagedBatch(items, dp.pools[0], TPB, dp.device, decode=False)
    cb = CrossBatch(batch, dp.pools[dp.cross_pool], ALL, dp.device)
    assert cb.qo_indptr.tolist() == [0, 7] and cb.query_index.tolist() == list(range(7))
    _, q = dp.model.qkv_all(dp.model.rows(batch.new_tokens, batch.new_positions), ALL,
                            torch.bfloat16, torch.bfloat16)
    qc = q.index_select(1, cb.query_index)
    out = TorchBackend().run(dp.pools[dp.cross_pool].gpu, cb, qc)
    kv, _ = dp.cross_model.qkv_all(dp.cross_model.rows(enc, np.arange(9)), ALL,
                                   torch.bfloat16, None)
    k, v = kv[:, :, 0].float(), kv[:, :, 1].float()  # [L, keys, kv_heads, d]
    g = SHAPE.num_q_heads // SHAPE.num_kv_heads
    qf = qc.float().view(3, 7, SHAPE.num_kv_heads, g, 16)
    scores = torch.einsum("lqhgd,lkhd->lhgqk", qf, k) / 4.0
    # Non-causal: queries at decoder positions 2..8 all see the 9 encoder keys.
    ref = torch.einsum("lhgqk,lkhd->lqhgd", scores.softmax(-1), v).reshape(3, 7, 4, 16)
    assert (out - ref).abs().max() < 1e-5
    check = dp.execute_step([], items)
    assert check.verified and check.max_abs_err < 1e-2


def test_prefill_and_decode_with_and_without_reuse_verify():
    dp = plane()
    enc = enc_tokens(4)
    assert prefill(dp, 1, enc, [0, 1, 2], [0, 1]).verified
    # A second request with the same input reuses the cross blocks: nothing written.
    item = StepItem(2, dec_tokens(2), [5, 6], 0, 6, cross=CrossKV(enc, [0, 1, 2]))
    assert dp.execute_step([], [item]).verified
    for pos in range(6, 9):
        check = dp.execute_step([], [
            StepItem(1, dec_tokens(1), [0, 1, 3], pos, pos + 1, cross=CrossKV(enc, [0, 1, 2])),
            StepItem(2, dec_tokens(2), [5, 6, 7], pos, pos + 1, cross=CrossKV(enc, [0, 1, 2]))])
        assert check.verified, check.mismatch
    assert dp.metrics()["verified"] is True


def test_cross_block_from_another_encoder_input_is_caught_on_that_block():
    dp = plane()
    a, b = enc_tokens(5), enc_tokens(6)
    b[:TPB * 2] = a[:TPB * 2]  # the same tokens in blocks 0 and 1 (different inputs)
    from kvbench.engine.cross import encoder_ids
    from kvbench.traffic.decoding import encoder_input

    ids_a, ids_b = (encoder_ids(encoder_input(i, t)) for i, t in ((0, a), (1, b)))
    assert prefill(dp, 1, ids_a, [0, 1, 2], [0, 1]).verified
    # Request 2's cross table takes input a's block 1: its tokens equal b's there, but the
    # encoder attends both ways, so its K/V are a's.
    check = prefill(dp, 2, ids_b, [3, 1, 5], [5, 6], write_blocks=[3, 4, 5])
    m = check.mismatch
    assert not check.verified and m.kind == "cross kv" and m.request_id == 2
    assert (m.block_index, m.block_id, m.position) == (1, 1, TPB)
    assert m.page == 1 * 3 + m.layer


def test_skipped_cross_write_is_caught_on_that_block():
    dp = plane()
    enc = enc_tokens(7)
    # Block #2's write goes elsewhere (block 9): block 6 is never written.
    check = prefill(dp, 1, enc, [4, 5, 6], [0, 1], write_blocks=[4, 5, 9])
    m = check.mismatch
    assert not check.verified and m.kind == "cross kv"
    assert (m.block_index, m.block_id, m.position, m.layer) == (2, 6, 2 * TPB, 0)


def test_cross_page_overwritten_while_claimed_is_caught_on_that_block():
    dp = plane()
    a, b = enc_tokens(8), enc_tokens(9)
    assert prefill(dp, 1, a, [0, 1, 2], [0, 1]).verified
    assert decode(dp, 1, a, [0, 1, 2], [0, 1]).verified
    # Request 2's encoder write lands on request 1's claimed block 2 (a bad allocation);
    # request 2 itself reads its writes back fine.
    assert prefill(dp, 2, b, [3, 4, 2], [5, 6]).verified
    check = decode(dp, 1, a, [0, 1, 2], [0, 1, 3], pos=7)
    m = check.mismatch
    assert not check.verified and m.kind == "cross kv" and m.request_id == 1
    assert (m.block_index, m.block_id, m.position) == (2, 2, 2 * TPB)


def test_wrong_cross_attention_output_is_caught(monkeypatch):
    dp = plane()
    enc = enc_tokens(10)
    run = TorchBackend.run

    def causal_cross(self, kv, batch, q, plan=None):
        out = run(self, kv, batch, q, plan)
        if isinstance(batch, CrossBatch):  # as if the kernel masked keys causally
            part = object.__new__(CrossBatch)
            for name in PagedBatch.__slots__ + CrossBatch.__slots__:
                setattr(part, name, getattr(batch, name))
            part.new_positions = np.zeros_like(batch.new_positions)
            out = run(self, kv, part, q, plan)
        return out

    monkeypatch.setattr(TorchBackend, "run", causal_cross)
    check = prefill(dp, 1, enc, [0, 1, 2], [0, 1])
    m = check.mismatch
    assert not check.verified and m.kind == "cross attention" and m.error > m.tolerance


def test_cross_work_needs_a_cross_pool_and_valid_tables():
    dp = DataPlane(SHAPE, [PoolSpec(ALL, 8)])
    with pytest.raises(ValueError, match="cross pool"):
        dp.execute_step([], [StepItem(1, dec_tokens(1), [0, 1], 0, 5,
                                      cross=CrossKV(enc_tokens(1), [0, 1, 2]))])
    dp = plane(cross_slots=4)
    with pytest.raises(ValueError, match="cross page table has 2 blocks"):
        dp.execute_step([], [StepItem(1, dec_tokens(1), [0, 1], 0, 5,
                                      cross=CrossKV(enc_tokens(1), [0, 1]))])
    with pytest.raises(ValueError, match="outside the cross pool"):
        dp.execute_step([], [StepItem(1, dec_tokens(1), [0, 1], 0, 5,
                                      cross=CrossKV(enc_tokens(1), [0, 1, 4]))])


def test_windowed_decoder_pools_attend_to_the_cross_pages_of_their_layers():
    pools = [PoolSpec((0, 2), 16, window=4), PoolSpec((1,), 16)]
    dp = plane(pools=pools)
    enc = enc_tokens(11)
    view = CrossKV(enc, [2, 0, 1])
    tokens = dec_tokens(11)
    check = dp.execute_step([], [StepItem(1, tokens, [0, 1], 0, 6, pool=0, cross=view),
                                 StepItem(1, tokens, [0, 1], 0, 6, pool=1, cross=view)],
                            encoder=[StepItem(1, enc, [2, 0, 1], 0, 10)])
    assert check.verified, check.mismatch


# Engine level: the workload runs on both modes, and a skipped write is caught.

def _workload(overrides=()):
    from pathlib import Path

    from kvbench.config import load_workload

    path = Path(__file__).parent.parent / "workloads" / "verify-encoder-small.yaml"
    return load_workload(path, list(overrides))


def test_verify_encoder_small_workload_verifies_every_variant():
    from kvbench.runner import run_workload

    outcomes = run_workload(_workload())
    assert len(outcomes) == 5
    for out in outcomes:
        m = out.metrics
        assert m["verified"] is True, (out.name, m["verify_mismatch"])
        assert m["verified_steps"] == m["data_plane_steps"] > 0
        assert m["cross_requests"] > 0 and 0 < m["cross_hit_rate"] < 1


@pytest.mark.parametrize("mode", ["serve", "cache"])
def test_encoder_writes_cover_exactly_what_was_not_reused(monkeypatch, mode):
    """Each counted encoder input writes its positions past its reuse, once (cache mode;
    serve mode may write again after a preemption), and nothing else is written."""
    from kvbench.runner import run_workload

    written = []
    step = DataPlane.execute_step

    def spy(self, ops, items, encoder=()):
        written.extend((it.request_id, it.start, it.end) for it in encoder)
        return step(self, ops, items, encoder)

    monkeypatch.setattr(DataPlane, "execute_step", spy)
    (out,) = run_workload(_workload([f"run.mode={mode}", "variants=[]"]))
    m = out.metrics
    total = sum(end - start for _, start, end in written)
    if mode == "cache":
        assert total == m["encoder_tokens"] - m["cross_reused_tokens"]
        assert len({rid for rid, _, _ in written}) == len(written)
    else:
        assert total >= m["encoder_tokens"] - m["cross_reused_tokens"] > 0
    assert m["verified"] is True


def test_skipped_encoder_write_in_serve_is_caught(monkeypatch):
    from kvbench.engine import serve_plane
    from kvbench.runner import run_workload

    real = serve_plane.cross_step

    def skip(request_id, cseq, tokens, first, encoder):
        return real(request_id, cseq, tokens, first, [])  # the write never reaches the plane

    monkeypatch.setattr(serve_plane, "cross_step", skip)
    (out,) = run_workload(_workload(["variants=[]"]))
    m = out.metrics
    assert m["verified"] is False
    assert "cross kv mismatch at position 0 (block #0" in m["verify_mismatch"]
