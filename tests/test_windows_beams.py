"""Beam search, reservations and encoder inputs on sliding-window pools (cache/windows.py):
exact block ids per beam in each life cycle's pool, out-of-window release per beam, scratch
slots only for shared context, each pool's estimate equal to what the add and the step take
(hypothesis, one request and batches), invariants after every operation, the serve loop with
beams and with speculative reservations, and the data plane verifying every beam in every
pool (and catching beams that share their own blocks or read a scratch page)."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbench.cache.add import AddPlan
from kvbench.cache.manager import CacheSpec
from kvbench.cache.seq import NO_BLOCK, CacheSeq
from kvbench.cache.lifecycle import life_cycles, prefill_blocks_bound
from kvbench.cache.windows import WindowedCacheManager
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Phase, Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.engine.speculative import Speculation
from kvbench.traffic.request import Request
from strategies import related_prompts
from test_beams import beam_requests, check_computed_tokens, req

CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])


def wmgr(windows, blocks=32, tpb=4, host=0, scratch=False, release="keep_cached",
         emit=False, reserve=0) -> WindowedCacheManager:
    cycles = life_cycles(windows)
    if isinstance(blocks, int):
        blocks = [blocks] * len(cycles)
    specs = [CacheSpec(tpb, n, num_host_blocks=host, emit_copy_ops=emit) for n in blocks]
    m = WindowedCacheManager(cycles, specs, release_out_of_window=release,
                             swa_scratch_reuse=scratch, reserve_tokens=reserve)
    m.enable_sanity_tracking()
    return m


def check_beams(m: WindowedCacheManager, wseq) -> None:
    """Per pool: beams share exactly the shared positions, own distinct blocks past them, and
    a position without a block is one no later query reads (or a live scratch block)."""
    tpb = m.tpb
    for i, (c, s) in enumerate(zip(m.cycles, wseq.seqs)):
        first = c.first_needed(wseq.num_computed, tpb)
        scratch = wseq.scratch_pages[i] or {}
        own = [b for beam in s.beams for b in beam if b != NO_BLOCK]
        own += [b for b in s.blocks[s.shared_blocks:] if b != NO_BLOCK]
        assert len(own) == len(set(own)), "two beams hold one block past the shared context"
        for beam in range(s.beam_width):
            for j, b in enumerate(s.beam_blocks(beam)):
                if b == NO_BLOCK:
                    assert j < first or j in scratch, (c.window, beam, j, first)


# --- exact block ids ---------------------------------------------------------------------------


def test_each_pool_copies_an_unfilled_last_block_per_beam_and_releases_per_beam():
    m = wmgr([None, 4], blocks=16)  # full pool, window pool (W = 4, tpb = 4)
    seq = m.add_sequence(req(range(10), width=3))
    assert m.step_blocks(seq, 10) == [5, 5]  # 3 positions; 2 shared; 2 beams own position 2
    assert m.begin_step(seq, 10)
    for s in seq.seqs:
        assert s.shared_blocks == 2 and s.blocks == [0, 1, 2] and s.beams == [[3], [4]]
    m.end_step(seq)  # the query at 10 reads 7..10: block 0 leaves the window pool
    full, win = seq.seqs
    assert full.blocks == [0, 1, 2] and win.blocks == [NO_BLOCK, 1, 2]
    assert win.beam_blocks(2) == [NO_BLOCK, 1, 4] and m._check_sanity()
    assert [p.gpu.num_in_use for p in m.managers] == [5, 4]
    assert m.begin_step(seq, 13)  # the 13th token opens position 3 in every beam
    assert win.blocks == [NO_BLOCK, 1, 2, 5] and win.beams == [[3, 6], [4, 7]]
    m.end_step(seq)  # reads 10..13: position 1 (shared) goes
    assert win.blocks == [NO_BLOCK, NO_BLOCK, 2, 5] and m._check_sanity()
    assert m.begin_step(seq, 17)
    m.end_step(seq)  # reads 14..17: position 2 goes in every beam, beams' copies come back empty
    assert win.blocks[:3] == [NO_BLOCK] * 3 and [b[0] for b in win.beams] == [NO_BLOCK] * 2
    assert full.beams == [[3, 6, 9], [4, 7, 10]]  # full attention keeps everything
    check_beams(m, seq)
    # Out of window: positions 0, 1 (stored, cached) and the three copies of position 2.
    assert m.managers[1].gpu.num_in_use == 3 * 2 and m._check_sanity()
    m.release(seq)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m._check_sanity()
    # Only beam 0's full prompt blocks (positions 0, 1) were stored: the rest come back empty.
    assert m.managers[1].gpu.num_cached == 2


@pytest.mark.parametrize("width, scratch", [(1, [0, 1]), (2, [0])])
def test_scratch_stops_where_a_beams_own_query_would_read(width, scratch):
    # W = 4, tpb = 4, 11 tokens: the query at 11 reads 8..11 (blocks 0, 1 are out of window),
    # but beam 1's own query at 8 reads 5..8, block 1 included: it stays a real block.
    m = wmgr([4, 4], blocks=16, scratch=True)
    seq = m.add_sequence(req(range(11), width=width))
    assert m.begin_step(seq, 11)
    assert sorted(seq.scratch_pages[0]) == scratch and m.scratch_slots == 1
    # Real blocks for the in-window positions and each extra beam's copy, plus the slot.
    assert m.managers[0].gpu.num_in_use == (3 - len(scratch)) + (width - 1) + 1
    check_beams(m, seq)
    m.end_step(seq)
    assert m.scratch_slots == 0 and m._check_sanity()
    bound = prefill_blocks_bound(m.cycles[0], 4, 11, True, width)
    assert m.peak_gpu_blocks <= bound


def test_reused_window_serves_beams_only_up_to_the_shared_context():
    m = wmgr([None, 4], blocks=24)
    first = m.add_sequence(req(range(12)))
    assert m.begin_step(first, 12)
    m.end_step(first)
    m.release(first)
    beams = m.add_sequence(req(list(range(12)) + [50, 51], width=2))  # shared: 3 blocks
    assert beams.reused_tokens == 12 and beams.num_computed == 12
    again = m.add_sequence(req(range(11), width=2))  # shared: 2 blocks; block 2 is per beam
    assert again.reused_tokens == 8 and m._check_sanity()


def test_reservation_chooses_scratch_for_the_computed_end():
    # 4 extra tokens reserved with the chunk: scratch as for the chunk's end, not the
    # reservation's, so ending the step at the chunk's end is allowed and nothing it needs
    # is scratch.
    m = wmgr([4, 4], blocks=16, scratch=True, reserve=4)
    seq = m.add_sequence(req(range(13)))
    assert m.begin_step(seq, 13 + 4)
    assert sorted(seq.scratch_pages[0]) == [0, 1]  # the query at 13 reads 10..13
    m.end_step(seq, 13)
    assert seq.num_computed == 13 and seq.seqs[0].blocks[:2] == [NO_BLOCK] * 2
    check_beams(m, seq)
    assert m._check_sanity()
    with pytest.raises(ValueError, match="scratch"):
        s2 = m.add_sequence(req(range(100, 117)))
        assert m.begin_step(s2, 17 + 4)
        m.end_step(s2, 12)


# --- estimates equal what the add and the step take -----------------------------------------


def draw_setup(data, host=True):
    windows = data.draw(st.lists(st.sampled_from([None, 2, 3, 5, 8]), min_size=1, max_size=3))
    if all(w is None for w in windows):
        windows[0] = 3
    return wmgr(windows, blocks=data.draw(st.integers(30, 50)), tpb=3,
                host=data.draw(st.sampled_from([0, 6])) if host else 0,
                scratch=data.draw(st.booleans()),
                release=data.draw(st.sampled_from(["keep_cached", "drop"])))


def frees(m):
    return [p.gpu.num_free for p in m.managers]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=related_prompts(max_requests=10, max_len=16), data=st.data())
def test_each_pools_estimate_equals_what_the_add_and_step_take(prompts, data):
    """One request at a time, with beams, windows, scratch and a host tier: each pool gives up
    exactly its `estimate_pools` draw to the add and its `step_blocks` to the first step;
    the reuse is the estimate's; the scheduler's count (`add_need`, per pool) covers what
    each pool gives up."""
    m = draw_setup(data)
    live = []
    for tokens in prompts:
        r = req(tokens, width=data.draw(st.integers(1, 4)))
        end = r.input_length + data.draw(st.integers(0, 4))
        plan = AddPlan()
        reuse, positions, draws = m.estimate_pools(r, plan)
        sched = m.add_need(r, plan, draws, positions, end)
        before = frees(m)
        assume(all(n <= f for n, f in zip(sched, before)))
        seq = m.add_sequence(r)
        assert seq.reused_tokens == reuse and m.reuse_fallbacks == 0
        added = frees(m)
        assert [b - a for b, a in zip(before, added)] == draws
        steps = m.step_blocks(seq, end)
        assert m.begin_step(seq, end)
        taken = [b - a for b, a in zip(added, frees(m))]
        assert taken == steps and all(d + t <= n for d, t, n in zip(draws, taken, sched))
        assert m._check_sanity()
        check_beams(m, seq)
        m.end_step(seq)
        assert m._check_sanity()
        check_beams(m, seq)
        live.append(seq)
        if len(live) > 2:
            m.release(live.pop(0))
            assert m._check_sanity()
    for seq in live:
        m.release(seq)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m._check_sanity()


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_batched_estimates_equal_what_the_batch_takes(data):
    """A batch of beam requests in separate namespaces (no block claimed twice), estimated
    before the add: the two-phase add takes each pool's summed draws, and their chunks its
    summed step blocks."""
    m = draw_setup(data)
    for ns in range(3):  # warm the cache: every namespace has a stored prompt
        s = m.add_sequence(req(range(20), namespace=ns))
        assert m.begin_step(s, 20)
        m.end_step(s)
        m.release(s)
    batch = [req(list(range(data.draw(st.integers(3, 20)))) + [7] * i,
                 width=data.draw(st.integers(1, 4)), namespace=i) for i in range(3)]
    estimates = [m.estimate_pools(r) for r in batch]
    before = frees(m)
    seqs = m.add_sequences(batch)
    assert [s.reused_tokens for s in seqs] == [e[0] for e in estimates]
    added = frees(m)
    assert [b - a for b, a in zip(before, added)] == [sum(e[2][i] for e in estimates)
                                                      for i in range(len(before))]
    steps = [m.step_blocks(s, s.request.input_length + 2) for s in seqs]
    # Small pools and four beams may not hold every chunk: only a batch that fits is exact.
    assume(all(sum(st_[i] for st_ in steps) <= f for i, f in enumerate(added)))
    for s in seqs:
        assert m.begin_step(s, s.request.input_length + 2)
    assert [b - a for b, a in zip(added, frees(m))] == [sum(st_[i] for st_ in steps)
                                                        for i in range(len(added))]
    assert m._check_sanity()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=related_prompts(max_requests=8, max_len=14), data=st.data())
def test_random_operations_on_windowed_beams_keep_invariants(prompts, data):
    """Random add / chunked step / revert (shrink) / release on beam sequences over window
    pools: every pool stays sane after every operation, beams never share their own blocks,
    only out-of-window positions lack a block, and a step takes exactly `step_blocks`."""
    m = draw_setup(data)
    live = []
    for tokens in prompts:
        r = req(tokens, width=data.draw(st.integers(1, 3)))
        plan = AddPlan()
        _, positions, draws = m.estimate_pools(r, plan)
        if all(n <= f for n, f in zip(m.add_need(r, plan, draws, positions, r.input_length),
                                      frees(m))):
            live.append(m.add_sequence(r))
            assert m._check_sanity()
        for seq in list(live):
            op = data.draw(st.sampled_from(["step", "step", "revert", "release", "keep"]))
            if op in ("step", "revert"):
                end = seq.num_tokens + data.draw(st.integers(1, 7))
                need, free = m.step_blocks(seq, end), frees(m)
                if not m.begin_step(seq, end):
                    assert any(n > f for n, f in zip(need, free))
                    continue
                assert [f - a for f, a in zip(free, frees(m))] == need
                check_beams(m, seq)
                assert m._check_sanity()
                if op == "revert":
                    m.shrink(seq, seq.num_computed)
                else:
                    m.end_step(seq)
            elif op == "release":
                m.release(seq)
                live.remove(seq)
            assert m._check_sanity()
            check_beams(m, seq)
    for seq in live:
        m.release(seq)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m.scratch_slots == 0
    assert m._check_sanity()


# --- serve mode ---------------------------------------------------------------------------------


def serve(requests, m, *, mnt=32, batch=4, batch_add=False, bulk=True, plane=None,
          speculation=None, reserve=0):
    sched = Scheduler(SchedulerConfig(max_num_tokens=mnt, max_batch_size=batch), m.tpb,
                      reserve_tokens=reserve)
    width = {r.id: r.beam_width for r in requests}

    def on_step(rec):
        assert m._check_sanity()
        for s in loop.states:
            if s.seq is not None:
                check_beams(m, s.seq)
        if speculation is None:
            gen = sum(width[i] for i, _ in rec.generation)
            assert rec.computed_tokens == sum(c.end - c.start for c in rec.context) + gen

    loop = ServeLoop(requests, m, sched, CLOCK, batch_add=batch_add, bulk_decode=bulk,
                     data_plane=plane, speculation=speculation, on_step=on_step)
    result = loop.run()
    assert all(s.phase is Phase.DONE for s in result.requests)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m.scratch_slots == 0
    assert m._check_sanity()
    return result


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
@pytest.mark.parametrize("seed", range(4))
def test_serve_with_beams_on_window_pools(seed, batch_add):
    rng = random.Random(seed)
    m = wmgr([rng.choice([3, 6, 9]), None, rng.choice([5, None])], blocks=50,
             host=rng.choice([0, 6]), scratch=seed % 2 == 0,
             release=rng.choice(["keep_cached", "drop"]))
    check_computed_tokens(serve(beam_requests(seed), m, batch_add=batch_add))


def test_beams_on_a_window_pool_hold_a_window_per_beam():
    prompt = list(range(10))
    peaks = []
    for width in (1, 4):
        m = wmgr([4], blocks=40)
        serve([req(prompt, width=width, out=20, rid=0)], m, bulk=False)
        peaks.append(m.peak_gpu_blocks)
    # The window (W = 4) needs 2 positions per beam while decoding, a third at each block
    # change before the old one is released; the shared context's out-of-window blocks go.
    assert peaks[0] == 3 and peaks[1] <= 3 * 4 and peaks[1] > peaks[0]


@pytest.mark.parametrize("seed", range(3))
def test_speculative_reservations_on_window_pools(seed):
    """Drafts and extra KV tokens reserved each step over window pools with scratch: the
    invariants hold, scratch never covers what a step computes up to, and every request
    finishes its output."""
    rng = random.Random(seed)
    m = wmgr([rng.choice([3, 6]), None], blocks=80, scratch=True, reserve=3 + 2)
    spec = Speculation(3, 0.6, 2, seed)
    reqs = [Request(r.id, r.arrival_s, r.input_length, r.output_length, tokens=r.tokens)
            for r in beam_requests(seed, widths=(1,))]
    result = serve(reqs, m, mnt=48, speculation=spec, reserve=3 + 2, bulk=False)
    assert result.computed_tokens > 0


# --- data plane ---------------------------------------------------------------------------------


def plane_for(m: WindowedCacheManager, layers_per_pool=2):
    pytest.importorskip("torch")
    from kvbench.kernels.dataplane import DataPlane
    from kvbench.kernels.step import ModelShape, PoolSpec
    shape = ModelShape(m.num_layers, 1, 2, 8, m.tpb, "float32")
    return DataPlane(shape, [PoolSpec(c.layers, p.gpu.capacity, window=c.window,
                                      num_host_slots=p.host.capacity if p.host else 0)
                             for c, p in zip(m.cycles, m.managers)])


@pytest.mark.parametrize("seed", range(3))
def test_data_plane_verifies_every_beam_in_every_pool(seed):
    m = wmgr([3, 3, None, 5], blocks=[40, 40, 40], host=6, emit=True, scratch=True)
    p = plane_for(m)
    seen = {}
    execute = p.execute_step

    def record(ops, items, encoder=()):
        for it in items:
            seen.setdefault((it.request_id, it.pool), set()).add(tuple(it.blocks[-1:]))
        return execute(ops, items, encoder)

    p.execute_step = record
    result = serve(beam_requests(seed), m, plane=p, bulk=False, batch_add=seed % 2 == 1)
    metrics = p.metrics()
    assert metrics["verified"] is True, metrics["verify_mismatch"]
    wide = [s.request.id for s in result.requests if s.request.beam_width > 1]
    assert any(len(seen.get((r, 1), ())) > 1 for r in wide)  # beams' own page tables


def test_data_plane_catches_window_beams_sharing_their_own_block(monkeypatch):
    m = wmgr([4, 4], blocks=40, emit=True)
    p = plane_for(m)
    monkeypatch.setattr(CacheSeq, "beam_blocks", lambda self, beam: self.blocks)
    serve([req(list(range(10)), width=3, out=8, rid=0)], m, plane=p, bulk=False)
    assert p.metrics()["verified"] is False


def test_data_plane_catches_a_beam_reading_a_scratch_page(monkeypatch):
    """W = 6, tpb = 4, a 13-token prompt: the query at 13 reads 8..13, so blocks 0 and 1 are
    out of window after the step; but beam 1's own query at 12 reads 7..12 (block 1). With
    scratch chosen for the step's end as without beams, that one-token item runs in its own
    batch and reads block 1's scratch slice after the pool's second layer overwrote it."""
    prompt = list(range(13))
    monkeypatch.setattr(WindowedCacheManager, "_scratch_query",
                        lambda self, request, end: end - self.reserve_tokens)
    m = wmgr([6, 6], blocks=40, emit=True, scratch=True)
    p = plane_for(m)
    serve([req(prompt, width=2, out=3, rid=0)], m, plane=p, bulk=False)
    assert p.metrics()["verified"] is False and m.scratch_blocks == 2
    monkeypatch.undo()
    m = wmgr([6, 6], blocks=40, emit=True, scratch=True)
    p = plane_for(m)
    serve([req(prompt, width=2, out=3, rid=0)], m, plane=p, bulk=False)
    assert p.metrics()["verified"] is True and m.scratch_blocks == 1


# --- the runner -------------------------------------------------------------------------------


def test_runner_windowed_beams_reservations_and_a_draft_model(tmp_path):
    from kvbench.config import load_workload
    from kvbench.errors import InputError
    from kvbench.runner import run_workload

    path = tmp_path / "w.yaml"
    path.write_text(
        "model: {num_layers: 4, num_kv_heads: 1, num_q_heads: 2, head_dim: 8,"
        " attention_window: [16, 16, 16, null]}\n"
        "cache: {tokens_per_block: 8, max_tokens: 4096, swa_scratch_reuse: true}\n"
        "requests: {beam_widths: [1, 4], synthetic: {num_requests: 30,"
        " system_prompt_tokens: 40, prompt_tokens: 30, output_tokens: 12}}\n"
        "run: {mode: serve, progress: false}\n")
    (beams,) = run_workload(load_workload(path))
    (greedy,) = run_workload(load_workload(path, ["requests.beam_widths=null"]))
    assert beams.metrics["peak_gpu_bytes"] > greedy.metrics["peak_gpu_bytes"]
    assert beams.metrics["scratch_slots_peak"] > 0
    (cache,) = run_workload(load_workload(path, ["run.mode=cache"]))
    assert cache.metrics["hit_rate"] > 0
    # The unlimited cache of the ideal reference holds every beam's own blocks too (one
    # request of 3 beams once ran it out of blocks).
    (alone,) = run_workload(load_workload(path, [
        "run.mode=cache", "requests.beam_widths=null", "requests.beam_width=3",
        "requests.synthetic.num_requests=1"]))
    assert alone.metrics["hit_rate"] == alone.metrics["ideal_hit_rate"] == 0
    one_model = ["requests.beam_widths=null", "speculative.max_draft_len=3",
                 "speculative.num_extra_kv_tokens=2"]
    (spec,) = run_workload(load_workload(path, one_model))
    assert spec.metrics["requests"] == 30
    draft = one_model + ["speculative.draft_model={num_layers: 1, num_kv_heads: 1,"
                         " num_q_heads: 2, head_dim: 8}"]
    (two,) = run_workload(load_workload(path, draft))
    assert two.metrics["requests"] == 30 and two.metrics["draft_peak_gpu_blocks"] > 0
    with pytest.raises(InputError, match="speculative decoding with beam search"):
        run_workload(load_workload(path, draft + ["requests.beam_widths=[1, 4]"]))
