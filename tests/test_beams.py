"""Beam search in the cache and serve mode: exact block counts per beam (full and partial
last context block), reuse of the shared context only, the scheduler's block estimate equal to
what the add and resize take, invariants at every step, and the data plane verifying every
beam's KV (and catching beams that share a block they must not)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.seq import CacheSeq
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Phase, Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.traffic.request import Request
from strategies import related_prompts

CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])
_ids = iter(range(1 << 30))


def req(tokens, width=1, out=1, t=0.0, rid=None, namespace=None) -> Request:
    toks = np.asarray(tokens, dtype=np.int64)
    return Request(next(_ids) if rid is None else rid, t, len(toks), out, tokens=toks,
                   beam_width=width, namespace=namespace)


def mgr(tpb=4, blocks=32, host=0, **kw) -> KVCacheManager:
    m = KVCacheManager(CacheSpec(tpb, blocks, num_host_blocks=host, **kw))
    m.enable_sanity_tracking()
    return m


# --- exact block counts -------------------------------------------------------------------


def test_partial_last_context_block_is_copied_per_beam():
    m = mgr()
    seq = m.add_sequence(req(range(10), width=3))  # 2 full blocks + 2 tokens
    assert m.resize(seq, 10)
    assert seq.shared_blocks == 2
    assert seq.blocks == [0, 1, 2] and seq.beams == [[3], [4]]
    assert [seq.beam_blocks(b) for b in range(3)] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    assert m.gpu.num_in_use == 5 and m._check_sanity()
    # Decode: the 13th token starts a block in every beam.
    assert m.resize(seq, 12) and m.gpu.num_in_use == 5
    assert m.resize(seq, 13) and m.gpu.num_in_use == 8
    assert seq.beams == [[3, 6], [4, 7]] and seq.blocks == [0, 1, 2, 5]
    assert m._check_sanity()


def test_full_last_context_block_is_shared():
    m = mgr()
    seq = m.add_sequence(req(range(8), width=3))
    assert m.resize(seq, 8)
    assert seq.shared_blocks == 2 and seq.blocks == [0, 1] and seq.beams == [[], []]
    assert m.gpu.num_in_use == 2
    assert m.resize(seq, 9) and m.gpu.num_in_use == 5  # one generation block per beam
    assert [seq.beam_blocks(b) for b in range(3)] == [[0, 1, 2], [0, 1, 3], [0, 1, 4]]
    m.commit(seq, 9)
    m.release(seq)
    # Only beam 0's full context blocks are stored; the beams' blocks come back empty.
    assert m.gpu.num_in_use == 0 and m.gpu.num_cached == 2 and m._check_sanity()


def test_cross_kv_shares_the_last_block_too():
    m = mgr(cross_kv=True)
    seq = m.add_sequence(req(range(10), width=4))
    assert m.resize(seq, 10)
    assert seq.shared_blocks == 3 and m.gpu.num_in_use == 3


def test_shrink_returns_every_beams_blocks():
    m = mgr()
    seq = m.add_sequence(req(range(6), width=2))
    assert m.resize(seq, 14)  # positions 0..3; shared 1; beam 1 owns 3
    assert m.gpu.num_in_use == 7
    assert m.shrink(seq, 6) == 4  # positions 2, 3 of both beams
    assert seq.blocks == [0, 1] and len(seq.beams[0]) == 1 and m._check_sanity()


def test_reuse_stops_at_the_shared_context():
    prompt = list(range(100, 110))
    m = mgr()
    seq = m.add_sequence(req(prompt))
    m.resize(seq, 10)
    m.commit(seq, 10)
    m.release(seq)  # stores 2 full blocks and the 2-token tail
    one = m.add_sequence(req(prompt))
    assert one.reused_tokens == 9 and one.partial_tokens == 1
    m.release(one)
    beams = m.add_sequence(req(prompt, width=2))
    # The last context block is each beam's own: computed, never matched.
    assert beams.reused_tokens == 8 and beams.partial_tokens == 0
    m.release(beams)
    full = m.add_sequence(req(prompt[:8], width=2))
    # A full last block is shared: the last token is computed, the rest of it reused.
    assert full.reused_tokens == 7 and full.partial_tokens == 3
    assert m._check_sanity()


# --- the estimate equals what the add takes -------------------------------------------------


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=related_prompts(max_requests=10, max_len=16), data=st.data())
def test_estimate_equals_consumption(prompts, data):
    """Per request, with beams and a host tier: the free GPU blocks the add and the resize to
    the prompt (and a few decode tokens) take equal `estimate_add`'s draw plus
    `grow_blocks`, on both add paths."""
    batch = data.draw(st.booleans())
    m = mgr(tpb=3, blocks=40, host=data.draw(st.sampled_from([0, 6])))
    live: list[CacheSeq] = []
    for tokens in prompts:
        r = req(tokens, width=data.draw(st.integers(1, 4)))
        extra = data.draw(st.integers(0, 4))
        _, blocks, draw = m.estimate_add(r)
        need = draw + m.grow_blocks(r, blocks, r.input_length + extra)
        assume(need <= m.gpu.num_free)
        free = m.gpu.num_free
        seq = m.add_sequences([r])[0] if batch else m.add_sequence(r)
        assert m.resize(seq, r.input_length + extra)
        assert free - m.gpu.num_free == need
        assert seq.num_blocks == len(seq.blocks) + (r.beam_width - 1) * max(
            0, len(seq.blocks) - seq.shared_blocks)
        m.commit(seq, r.input_length)
        assert m._check_sanity()
        live.append(seq)
        if len(live) > 2:
            m.release(live.pop(0))
            assert m._check_sanity()
    for seq in live:
        m.release(seq)
    assert m.gpu.num_in_use == 0 and m._check_sanity()


def test_batched_estimate_equals_consumption_with_beams():
    """A batch of requests in separate namespaces (no block claimed twice): the scheduler's
    plan costs exactly the blocks the batched add and the chunks' allocation take."""
    m = mgr(tpb=4, blocks=60, host=8)
    warm = [req(range(i, i + 14), namespace=i % 3) for i in range(3)]
    for r in warm:
        s = m.add_sequence(r)
        m.resize(s, r.input_length)
        m.commit(s, r.input_length)
        m.release(s)
    sched = Scheduler(SchedulerConfig(max_num_tokens=512, max_batch_size=8), 4)
    from kvbench.engine.scheduler import ServeRequest
    new = [ServeRequest(req(list(range(i, i + 14)) + [7] * i, width=1 + i % 3,
                            namespace=i % 3), i) for i in range(3)]
    waiting = [(s.idx, s) for s in new]
    free = m.gpu.num_free
    plan = sched.plan_context([], waiting, 0, 0, m)
    assert len(plan) == 3
    need = 0
    for w in plan:
        _, blocks, draw = m.estimate_add(w.req.view)
        need += draw + m.grow_blocks(w.req.view, blocks, w.estimated + w.chunk)
    seqs = m.add_sequences([w.req.view for w in plan])
    for w, seq in zip(plan, seqs):
        assert seq.reused_tokens == w.estimated
        assert m.resize(seq, w.estimated + w.chunk)
    assert free - m.gpu.num_free == need
    assert m._check_sanity()


# --- serve mode ---------------------------------------------------------------------------


def beam_requests(seed, n=10, widths=(1, 2, 4)):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 5, 9)
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(0.003))
        body = rng.integers(0, 5, int(rng.integers(1, 9)))
        tokens = np.concatenate([base[:int(rng.integers(0, 10))], body])
        out.append(Request(i, t, len(tokens), int(rng.integers(1, 10)), tokens=tokens,
                           beam_width=int(rng.choice(widths))))
    return out


def serve(requests, *, tpb=4, blocks=60, mnt=32, batch=4, batch_add=False, bulk=True,
          host=0, plane=None):
    m = KVCacheManager(CacheSpec(tpb, blocks, num_host_blocks=host,
                                 emit_copy_ops=plane is not None))
    m.enable_sanity_tracking()
    sched = Scheduler(SchedulerConfig(max_num_tokens=mnt, max_batch_size=batch), tpb)
    records = []

    def on_step(rec):
        records.append(rec)
        assert m._check_sanity()
        width = {r.id: r.beam_width for r in requests}
        gen = sum(width[i] for i, _ in rec.generation)
        assert rec.computed_tokens == sum(c.end - c.start for c in rec.context) + gen
        assert rec.scheduled_tokens <= mnt

    loop = ServeLoop(requests, m, sched, CLOCK, batch_add=batch_add, bulk_decode=bulk,
                     data_plane=plane, on_step=on_step)
    result = loop.run()
    assert all(s.phase is Phase.DONE for s in result.requests)
    assert m.gpu.num_in_use == 0 and m._check_sanity()
    return m, result, records


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
@pytest.mark.parametrize("seed", range(4))
def test_serve_with_beams_keeps_invariants(seed, batch_add):
    m, result, _ = serve(beam_requests(seed), batch_add=batch_add, blocks=30, host=6)
    check_computed_tokens(result)


def check_computed_tokens(result):
    """Every beam decodes one token per step after the first (computed with the context);
    only preemptions and failed placements recompute."""
    decode = sum(s.request.beam_width * (s.request.output_length - 1) for s in result.requests)
    context = sum(s.request.input_length - s.reused_tokens for s in result.requests)
    if result.preemptions or result.ctx_alloc_failures:
        assert result.computed_tokens >= decode + context
    else:
        assert result.computed_tokens == decode + context


def test_beams_raise_peak_memory_exactly():
    prompt = list(range(10))
    one = serve([req(prompt, width=1, out=9, rid=0)], bulk=False)[0]
    four = serve([req(prompt, width=4, out=9, rid=0)], bulk=False)[0]
    # 10 + 8 tokens held: positions 0..4; shared 2; 3 extra beams own positions 2..4.
    assert one.gpu.peak_in_use == 5
    assert four.gpu.peak_in_use == 5 + 3 * 3


def test_jumps_equal_stepping_with_beams():
    a = serve(beam_requests(7), bulk=True)[1]
    b = serve(beam_requests(7), bulk=False)[1]
    assert a.iterations == b.iterations and a.computed_tokens == b.computed_tokens
    assert a.duration_s == pytest.approx(b.duration_s, rel=1e-9)
    assert [s.finish_s for s in a.requests] == pytest.approx([s.finish_s for s in b.requests])


# --- data plane -----------------------------------------------------------------------------


def plane(blocks, host=0, tpb=4):
    pytest.importorskip("torch")
    from kvbench.kernels.dataplane import DataPlane
    from kvbench.kernels.step import ModelShape, PoolSpec
    return DataPlane(ModelShape(2, 2, 4, 16, tpb, "bfloat16"),
                     [PoolSpec((0, 1), blocks, num_host_slots=host)])


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
def test_data_plane_verifies_every_beam(batch_add):
    p = plane(30, host=6)
    seen = []
    execute = p.execute_step

    def record(ops, items, encoder=()):
        seen.extend((it.request_id, tuple(it.blocks)) for it in items)
        return execute(ops, items, encoder)

    p.execute_step = record
    m, result, _ = serve(beam_requests(3), blocks=30, host=6, plane=p, batch_add=batch_add,
                         bulk=False)
    metrics = p.metrics()
    assert metrics["verified"] is True, metrics["verify_mismatch"]
    # Items ran on several distinct page tables of one request: its beams.
    wide = {s.request.id for s in result.requests if s.request.beam_width > 1}
    tables = {}
    for rid, blocks in seen:
        tables.setdefault(rid, set()).add(blocks[-1])
    assert any(len(tables[r]) > 1 for r in wide if r in tables)


def test_data_plane_catches_beams_sharing_their_own_block(monkeypatch):
    """If every beam wrote into beam 0's blocks, beam 0 would read another beam's KV."""
    p = plane(30)
    monkeypatch.setattr(CacheSeq, "beam_blocks", lambda self, beam: self.blocks)
    serve([req(list(range(10)), width=3, out=6, rid=0)], blocks=30, plane=p, bulk=False)
    assert p.metrics()["verified"] is False


# --- workload keys ----------------------------------------------------------------------------


def test_beam_keys_in_workloads(tmp_path):
    from kvbench.config import load_workload
    from kvbench.errors import InputError
    from kvbench.runner import run_workload

    path = tmp_path / "w.yaml"
    path.write_text("requests:\n  beam_widths: [1, 0]\n")
    with pytest.raises(InputError, match=r"w.yaml:2:\d+.*requests.beam_widths"):
        load_workload(path)
    base = ("model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}\n"
            "cache: {tokens_per_block: 8, max_tokens: 2048}\n"
            "requests: {beam_widths: [1, 3], synthetic: {num_requests: 30, "
            "system_prompt_tokens: 20, prompt_tokens: 12, output_tokens: 6}}\n"
            "run: {mode: serve, progress: false}\n")
    path.write_text(base)
    wl = load_workload(path)
    from kvbench.runner import _load
    widths = [r.beam_width for r in _load(wl)]
    assert set(widths) == {1, 3} and widths == [r.beam_width for r in _load(wl)]
    (out,) = run_workload(wl)
    assert out.metrics["requests"] == 30 and out.metrics["peak_gpu_blocks"] > 0
    (windowed,) = run_workload(load_workload(path, ["model.attention_window=16"]))
    assert windowed.metrics["requests"] == 30 and set(windowed.metrics["pools"]) == {"window_16"}
    tight = load_workload(path, ["scheduler.max_batch_size=200", "scheduler.max_num_tokens=512"])
    with pytest.raises(InputError, match="beams x"):
        run_workload(tight)


def test_cache_mode_data_plane_writes_every_beams_last_block():
    """Cache mode with beams on the torch plane: each beam's own copy of an unfilled last
    prompt block is written and attended over in its own page table."""
    pytest.importorskip("torch")
    from kvbench.config import load_workload
    from kvbench.runner import run_workload
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "workloads" / "verify-small.yaml"
    sets = ["requests.synthetic.num_requests=10", "requests.beam_widths=[1, 3]"]
    outcomes = run_workload(load_workload(path, sets))
    for o in outcomes:
        assert o.metrics["verified"] is True, o.metrics.get("verify_mismatch")


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=related_prompts(max_requests=8, max_len=14), data=st.data())
def test_random_operations_keep_invariants(prompts, data):
    """Random add / grow / commit / shrink / release on beam sequences, with a host tier:
    the manager stays sane after every operation, each sequence holds one block per shared
    position and one per beam per other position, and a grow takes exactly `grow_blocks`."""
    m = mgr(tpb=3, blocks=30, host=data.draw(st.sampled_from([0, 5])))
    live: list[CacheSeq] = []
    for tokens in prompts:
        r = req(tokens, width=data.draw(st.integers(1, 3)))
        if m.estimate_add(r)[2] + m.grow_blocks(r, 0, r.input_length) <= m.gpu.num_free:
            seq = m.add_sequence(r)
            if m.resize(seq, r.input_length):
                m.commit(seq, r.input_length)
                live.append(seq)
            else:
                m.release(seq)
            assert m._check_sanity()
        for seq in list(live):
            op = data.draw(st.sampled_from(["grow", "shrink", "release", "keep"]))
            if op == "grow":
                n = seq.num_tokens + data.draw(st.integers(1, 7))
                need = m.grow_blocks(seq.request, len(seq.blocks), n)
                free = m.gpu.num_free
                if m.resize(seq, n):
                    assert free - m.gpu.num_free == need
                    m.commit(seq, n)
                else:
                    assert need > free
            elif op == "shrink":
                m.shrink(seq, data.draw(st.integers(seq.num_computed, seq.num_tokens)))
            elif op == "release":
                m.release(seq)
                live.remove(seq)
            assert m._check_sanity()
            w = seq.beam_width
            assert seq.num_blocks == len(seq.blocks) + (w - 1) * max(
                0, len(seq.blocks) - seq.shared_blocks)
    for seq in live:
        m.release(seq)
    assert m.gpu.num_in_use == 0 and m._check_sanity()
