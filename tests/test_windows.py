"""Sliding-window life cycles (kvbench/cache/windows.py): the reference case, the memory split,
the minimum-over-life-cycles reuse rule, out-of-window release, scratch slots and page tables,
on hand-built cases and on random window mixes, prompts and chunk sizes checked against
brute-force definitions (DESIGN.md section 3)."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.seq import NO_BLOCK
from kvbench.cache.lifecycle import (LifeCycle, life_cycles, prefill_blocks_bound,
                                     split_gpu_blocks)
from kvbench.cache.windows import WindowedCacheManager
from kvbench.config import load_workload
from kvbench.runner import run_workload
from kvbench.traffic.request import Request

_ids = iter(range(1 << 30))


def req(tokens) -> Request:
    toks = np.asarray(tokens, dtype=np.int64)
    return Request(next(_ids), 0.0, len(toks), 1, tokens=toks)


def wmgr(windows, blocks, tpb=4, host=0, scratch=False, release="keep_cached", reuse=True,
         partial=True) -> WindowedCacheManager:
    cycles = life_cycles(windows)
    if isinstance(blocks, int):
        blocks = [blocks] * len(cycles)
    specs = [CacheSpec(tpb, n, num_host_blocks=host, enable_block_reuse=reuse,
                       enable_partial_reuse=partial) for n in blocks]
    m = WindowedCacheManager(cycles, specs, release_out_of_window=release,
                             swa_scratch_reuse=scratch)
    m.enable_sanity_tracking()
    return m


def prefill(m: WindowedCacheManager, r: Request, chunk: int | None = None):
    """One request: add, prefill in chunks, release; returns the sequence (released)."""
    seq = m.add_sequence(r)
    assert m._check_sanity()
    pos = seq.num_computed
    while pos < r.input_length:
        end = r.input_length if chunk is None else min(r.input_length, pos + chunk)
        assert m.begin_step(seq, end)
        assert m._check_sanity()
        m.end_step(seq)
        assert m._check_sanity()
        pos = end
    m.release(seq)
    assert m._check_sanity()
    return seq


# --- the reference case (TensorRT-LLM PR #13368, counted with kvbench's window) --------------


@pytest.mark.parametrize("scratch, peak, slots", [(False, 32, 0), (True, 5, 1)])
def test_reference_case_32_swa_layers_window_128(scratch, peak, slots):
    m = wmgr([128] * 32, 64, tpb=32, scratch=scratch)
    seq = m.add_sequence(req(np.arange(1024)))
    assert m.begin_step(seq, 1024)
    assert m.peak_gpu_blocks == peak and m.scratch_slots_peak == slots
    pages = m.page_tables(seq)
    assert pages.shape == (32, 32)
    blocks = m.managers[0]
    if scratch:
        # Blocks 0..27 are out of window for the query after the prompt (it reads 897..1024):
        # they are the 28 slices of one scratch slot, the same page in every layer.
        slot = seq.scratch[0].blocks
        assert len(slot) == 1
        assert (pages[:, :28] == slot[0] * 32 + np.arange(28)).all()
        normal = seq.seqs[0].blocks[28:]
        assert seq.seqs[0].blocks[:28] == [NO_BLOCK] * 28
    else:
        normal = seq.seqs[0].blocks
    # Normal blocks: page slot * num_layers + layer.
    n = len(normal)
    assert (pages[:, 32 - n:] == np.array(normal)[None, :] * 32 + np.arange(32)[:, None]).all()
    m.end_step(seq)
    assert blocks.gpu.num_in_use == 4  # the window of the next query: blocks 28..31
    m.release(seq)
    assert m._check_sanity() and blocks.gpu.num_in_use == 0


def test_reference_case_with_a_full_attention_pool_beside():
    m = wmgr([128] * 32 + [None] * 4, [64, 64], tpb=32, scratch=True)
    seq = m.add_sequence(req(np.arange(1024)))
    assert m.begin_step(seq, 1024)
    full, swa = m.managers
    assert full.gpu.num_in_use == 32 and swa.gpu.num_in_use == 5
    assert m.peak_gpu_blocks == 37
    assert m.peak_gpu_bytes == 32 * m.slot_bytes[0] + 5 * m.slot_bytes[1]
    m.end_step(seq)
    m.release(seq)


def test_window_convention_boundary():
    # W = 5, tpb = 4: a query at 8 reads 4..8, so block 0 (0..3) is out of window and block 1
    # is not; the query at 9 reads 5..9, still block 1.
    c = LifeCycle(5, (0,))
    assert c.first_needed(8, 4) == 1 and c.first_needed(7, 4) == 0
    assert c.first_needed(11, 4) == 1 and c.first_needed(12, 4) == 2
    assert LifeCycle(None, (0,)).first_needed(10**6, 4) == 0


# --- life cycles and the memory split --------------------------------------------------------


def test_life_cycles_full_first_then_windows_ascending():
    cycles = life_cycles([1024, 1024, 512, None, 1024, None])
    assert cycles == (LifeCycle(None, (3, 5)), LifeCycle(512, (2,)),
                      LifeCycle(1024, (0, 1, 4)))


def test_split_proportional_to_layers_times_window():
    cycles = life_cycles([1024] * 5 + [None])  # full: 1 layer, window: 5 layers
    slot = [1, 5]  # bytes per slot, in proportion to layers
    blocks = split_gpu_blocks(cycles, 10_000, slot, context_tokens=4096)
    # weights: full 1 x 4096, window 5 x 1024 -> 4096 : 5120 of the bytes
    assert blocks == [int(10_000 * 4096 / 9216), int(10_000 * 5120 / 9216) // 5]
    by_layers = split_gpu_blocks(cycles, 10_000, slot, 4096, policy="layers")
    assert by_layers == [int(10_000 / 6), int(10_000 * 5 / 6) // 5]


def test_split_raises_pools_to_their_floor_and_shares_the_rest():
    cycles = life_cycles([8, None])
    blocks = split_gpu_blocks(cycles, 1000, [1, 1], context_tokens=1000, min_blocks=[10, 200])
    assert blocks[1] == 200 and blocks[0] == 800
    with pytest.raises(ValueError):
        split_gpu_blocks(cycles, 100, [1, 1], 1000, min_blocks=[60, 60])
    with pytest.raises(ValueError):
        split_gpu_blocks(cycles, 100, [1, 1], 1000, policy="bogus")


def test_prefill_bound_matches_the_reference_case():
    c = LifeCycle(128, tuple(range(32)))
    assert prefill_blocks_bound(c, 32, 1024, scratch=False) == 32
    # 4 window blocks + 1 scratch slot, plus room for a reused window (5 blocks) at most
    assert 5 <= prefill_blocks_bound(c, 32, 1024, scratch=True) <= 10


# --- reuse: windows need only their window, the minimum over life cycles ---------------------


def test_window_pool_reuses_without_the_blocks_before_its_window():
    m = wmgr([5], 16, tpb=4, release="drop", partial=False)
    a = np.arange(100, 124)  # 6 blocks
    prefill(m, req(a))
    # Dropped out of window at the end: the next query (24) reads 20..24, blocks < 5 dropped.
    assert m.managers[0].gpu.num_cached == 1
    # A continuation needs at 24 only block 5 (20..23): reused whole.
    seq = prefill(m, req(np.concatenate([a, [1, 2, 3, 4, 5]])))
    assert seq.reused_tokens == 24
    # A prompt sharing 16 tokens would need block 3 at 16: gone, so no reuse.
    assert prefill(m, req(np.concatenate([a[:16], [9] * 8]))).reused_tokens == 0


def test_keep_cached_keeps_out_of_window_blocks_reusable():
    m = wmgr([5], 16, tpb=4, partial=False)
    a = np.arange(100, 124)
    prefill(m, req(a))
    assert m.managers[0].gpu.num_cached == 6
    assert prefill(m, req(np.concatenate([a[:16], [9] * 8]))).reused_tokens == 16


def test_usable_reuse_is_the_minimum_over_life_cycles():
    # Full attention keeps everything; window 5 keeps (with drop) only its last window.
    m = wmgr([5, None], [32, 32], tpb=4, release="drop", partial=False)
    a = np.arange(100, 132)  # 8 blocks
    prefill(m, req(a))
    full, swa = m.managers
    b = req(np.concatenate([a[:20], [7] * 10]))  # shares 5 blocks
    assert full.match_capped(b, b.input_length - 1)[0][:5] != []
    assert m.estimate_reuse(b) == 0  # the window pool cannot serve any end <= 20
    c = req(np.concatenate([a, [7] * 10]))
    assert m.estimate_reuse(c) == 32
    seq = m.add_sequence(c)
    # Every pool claims the common length; the window pool only its window.
    assert [s.reused_tokens for s in seq.seqs] == [32, 32]
    assert swa.ref_count.count(1) == 1  # block 7 (28..31) is all the query at 32 reads
    m.release(seq)
    assert m._check_sanity()


def test_two_windows_converge_on_an_end_both_serve():
    # Window 9 keeps (drop) blocks 2.. of a 16-token prompt at tpb 4 after its end; window 5
    # keeps block 3. The shared-prefix request can use only ends both can serve.
    m = wmgr([5, 9, None], [16, 16, 16], tpb=4, release="drop", partial=False)
    a = np.arange(100, 116)
    prefill(m, req(a))
    c = req(np.concatenate([a, [3, 3, 3]]))
    assert m.estimate_reuse(c) == 16
    d = req(np.concatenate([a[:12], [3, 3, 3]]))  # end 12: window 9 reads block 1, dropped
    assert m.estimate_reuse(d) == 0


def test_partial_match_end_inside_a_block_serves_a_continued_prompt():
    # A prompt ending mid-block keeps (drop) the window of the query after it; a continuation
    # can reuse up to that end through the partial tail, not up to the block start before it.
    m = wmgr([7], 16, tpb=4, release="drop")
    a = np.arange(100, 130)  # 30 tokens: next query 30 reads 24..30 -> blocks 6, 7
    prefill(m, req(a))
    seq = prefill(m, req(np.concatenate([a, [5, 5, 5, 5]])))
    assert seq.reused_tokens == 30 and seq.partial_tokens == 2


def test_scratch_blocks_are_never_stored():
    m = wmgr([8], 32, tpb=4, scratch=True)
    a = np.arange(100, 140)  # 10 blocks; query 40 reads 33..40: blocks 0..7 scratch
    seq = prefill(m, req(a))
    assert m.scratch_blocks == 8 and m.scratch_slots_peak == 8  # 1 layer: a slot per block
    stored = [b for b in range(32) if m.managers[0].index.is_stored(b)]
    assert len(stored) == 2
    assert seq.reused_tokens == 0


def test_release_out_of_window_during_decode_like_steps():
    m = wmgr([6], 16, tpb=2, partial=False)
    seq = m.add_sequence(req(np.arange(10)))
    assert m.begin_step(seq, 10)
    m.end_step(seq)
    pool = m.managers[0]
    # Query 10 reads 5..10: blocks 0, 1 released (cached), 2.. held.
    assert seq.seqs[0].blocks[:2] == [NO_BLOCK, NO_BLOCK] and pool.gpu.num_in_use == 3
    for end in range(11, 20):
        assert m.begin_step(seq, end)
        m.end_step(seq)
        assert m._check_sanity()
        first = m.cycles[0].first_needed(end, 2)
        assert pool.gpu.num_in_use == -(-end // 2) - first
    m.release(seq)
    assert m._check_sanity()


def test_begin_step_that_does_not_fit_takes_nothing():
    m = wmgr([4, None], [8, 4], tpb=2)  # pools: full, then window 4
    seq = m.add_sequence(req(np.arange(12)))
    before = [p.gpu.num_in_use for p in m.managers]
    assert not m.begin_step(seq, 12)  # the window pool has 4 blocks, the prompt needs 6
    assert [p.gpu.num_in_use for p in m.managers] == before
    assert m.begin_step(seq, 8)
    m.end_step(seq)
    assert m.begin_step(seq, 12)  # blocks 0, 1 were released out of window
    m.end_step(seq)
    m.release(seq)
    assert m._check_sanity()


# --- manager primitives the windows rely on ---------------------------------------------------


def test_release_blocks_keep_cached_and_drop():
    for keep in (True, False):
        m = KVCacheManager(CacheSpec(2, 8, enable_partial_reuse=False))
        m.enable_sanity_tracking()
        r = req(np.arange(8))
        seq = m.add_sequence(r)
        m.resize(seq, 8)
        m.commit(seq, 8)
        first = list(seq.blocks)
        assert m.release_blocks(seq, 0, 2, keep_cached=keep) == 2
        assert seq.blocks[:2] == [NO_BLOCK, NO_BLOCK] and m._check_sanity()
        if keep:  # deeper first in line for eviction, as `release`
            assert m.gpu.free_queue.order() == [first[1], first[0]]
        else:
            assert m.gpu.num_cached == 0 and not m.index.is_stored(first[0])
        m.release(seq)
        assert m._check_sanity() and m.gpu.num_in_use == 0
        assert m.gpu.free_queue.order()[-2:] == [first[3], first[2]]


def test_commit_and_shrink_around_holes():
    m = KVCacheManager(CacheSpec(2, 8, enable_partial_reuse=False))
    m.enable_sanity_tracking()
    r = req(np.arange(10))
    seq = m.claim_match(r, [], None)
    m.onboard([seq])
    m.skip_blocks(seq, 2)
    assert m.resize(seq, 8) and len(seq.blocks) == 4 and m.gpu.num_in_use == 2
    m.commit(seq, 8)
    assert [m.index.is_stored(b) for b in seq.blocks[2:]] == [True, True]
    assert m.resize(seq, 10)
    assert m.shrink(seq, 8) == 1 and m._check_sanity()
    m.release(seq)
    assert m._check_sanity() and m.gpu.num_cached == 2


def test_match_capped_caps_and_skips():
    m = KVCacheManager(CacheSpec(2, 16, enable_partial_reuse=True))
    a = np.arange(12)
    s = m.add_sequence(req(a))
    m.resize(s, 12)
    m.commit(s, 12)
    m.release(s)
    b = req(np.concatenate([a, [99]]))
    full, partial = m.match_capped(b, 7)
    assert len(full) == 3 and partial is not None and partial[1] == 1
    full, partial = m.match_capped(b, 8, first_block=2)
    assert full[:2] == [NO_BLOCK, NO_BLOCK] and len(full) == 4 and partial is None


# --- random window mixes, prompts, chunks: brute-force checks ---------------------------------


def servable(m: WindowedCacheManager, r: Request, end: int) -> bool:
    """Every pool has, stored, the full blocks a query at `end` reads (before `end`)."""
    tpb = m.tpb
    keys = r.block_keys(tpb)
    for c, pool in zip(m.cycles, m.managers):
        for k in range(c.first_needed(end, tpb), end // tpb):
            if keys[k] not in pool.index.by_key:
                return False
    return True


def random_setup(rng: random.Random, scratch: bool, reuse: bool = True, partial: bool = False):
    tpb = rng.choice([1, 2, 3, 4])
    pattern = [rng.choice([None, 1, 2, 3, 5, 8, 13]) for _ in range(rng.randint(1, 3))]
    if all(w is None for w in pattern):
        pattern[0] = rng.choice([2, 5])
    layers = len(pattern) * rng.randint(1, 3)
    windows = [pattern[i % len(pattern)] for i in range(layers)]
    ncycles = len(life_cycles(windows))
    blocks = [rng.randint(24, 60) for _ in range(ncycles)]
    host = rng.choice([0, 0, 8])
    release = rng.choice(["keep_cached", "drop"])
    return dict(windows=windows, blocks=blocks, tpb=tpb, host=host, scratch=scratch,
                release=release, reuse=reuse, partial=partial)


def random_prompts(rng: random.Random, n: int) -> list[np.ndarray]:
    bases = [rng.sample(range(1000), 40) for _ in range(3)]
    out: list[np.ndarray] = []
    for _ in range(n):
        if out and rng.random() < 0.4:  # continue an earlier prompt (multi-turn)
            prev = rng.choice(out)
            toks = np.concatenate([prev, rng.sample(range(1000, 2000), rng.randint(1, 8))])
        else:
            base = rng.choice(bases)[:rng.randint(0, 40)]
            toks = np.concatenate([base, rng.sample(range(2000, 3000), rng.randint(1, 10))])
        out.append(np.asarray(toks[:45], dtype=np.int64))
    return out


def check_pages(m: WindowedCacheManager, seq, start: int, end: int) -> None:
    """Every position a query of the step reads has a page in every layer; normal pages are
    slot * L + layer, scratch pages the same in every layer of the pool and distinct."""
    tpb = m.tpb
    pages = m.page_tables(seq)
    for i, c in enumerate(m.cycles):
        lo = c.first_needed(start, tpb)
        rows = pages[list(c.layers)]
        assert (rows[:, lo:-(-end // tpb)] >= 0).all()
        scratch = seq.scratch_pages[i] or {}
        for j, b in enumerate(seq.seqs[i].blocks):
            if b != NO_BLOCK:
                assert (rows[:, j] == b * c.num_layers + np.arange(c.num_layers)).all()
            elif j in scratch:
                assert (rows[:, j] == scratch[j]).all()
        assert len(set(scratch.values())) == len(scratch)
        held = {b * c.num_layers for b in seq.seqs[i].blocks if b != NO_BLOCK}
        assert not held & {p - p % c.num_layers for p in scratch.values()}


def check_released(m: WindowedCacheManager, seq) -> None:
    """A position without a block is one no later query reads."""
    for c, s in zip(m.cycles, seq.seqs):
        first = c.first_needed(seq.num_computed, m.tpb)
        for j, b in enumerate(s.blocks):
            if b == NO_BLOCK:
                assert j < first, (c.window, j, first)


@pytest.mark.parametrize("seed", range(40))
def test_random_windows_pages_release_and_min_reuse(seed):
    rng = random.Random(seed)
    partial = rng.random() < 0.5
    m = wmgr(**random_setup(rng, scratch=rng.random() < 0.5, partial=partial))
    live: list[tuple] = []  # (seq, request, chunk)
    for toks in random_prompts(rng, 14):
        r = req(toks)
        ends = {e for e in range(r.input_length) if servable(m, r, e)}
        expect = max(e for e in ends if e % m.tpb == 0)
        seq = m.add_sequence(r)
        assert m._check_sanity()
        # A partial match can only add to the longest aligned end every pool serves.
        if seq.reused_tokens == 0 and expect:  # an onboard found no GPU block: no reuse
            assert m.reuse_fallbacks
        elif partial:  # it may end inside a block, where the window reads later blocks
            assert seq.reused_tokens >= expect and seq.reused_tokens in ends
        else:
            assert seq.reused_tokens == expect
        assert all(s.reused_tokens == seq.reused_tokens for s in seq.seqs)
        check_released(m, seq)
        live.append((seq, r, rng.randint(1, 20)))
        # Advance a random live sequence by one chunk, or finish one.
        while live and rng.random() < 0.7:
            k = rng.randrange(len(live))
            s, rr, chunk = live[k]
            if s.num_computed >= rr.input_length:
                m.release(s)
                assert m._check_sanity()
                live.pop(k)
                continue
            start = s.num_computed
            end = min(rr.input_length, start + chunk)
            if not m.begin_step(s, end):
                m.release(s)
                live.pop(k)
                assert m._check_sanity()
                continue
            assert m._check_sanity()
            check_pages(m, s, start, end)
            m.end_step(s)
            assert m._check_sanity()
            check_released(m, s)
    for s, _, _ in live:
        m.release(s)
    assert m._check_sanity()
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m.scratch_slots == 0


@pytest.mark.parametrize("seed", range(20))
def test_random_peak_with_scratch_is_at_most_peak_without(seed):
    rng = random.Random(1000 + seed)
    setup = random_setup(rng, scratch=False, reuse=False)
    prompts = random_prompts(rng, 6)
    chunks = [rng.randint(1, 30) for _ in prompts]
    peaks = []
    for scratch in (False, True):
        setup["scratch"] = scratch
        m = wmgr(**{**setup, "blocks": [100] * len(setup["blocks"])})
        for toks, chunk in zip(prompts, chunks):
            prefill(m, req(toks), chunk)
        peaks.append((m.peak_gpu_blocks, m.peak_gpu_bytes))
    assert peaks[1][0] <= peaks[0][0] and peaks[1][1] <= peaks[0][1]


# --- the runner -------------------------------------------------------------------------------


def test_cache_mode_run_reports_window_metrics(tmp_path):
    path = tmp_path / "w.yaml"
    path.write_text("""
model: {num_layers: 6, num_kv_heads: 2, num_q_heads: 4, head_dim: 16,
        attention_window: [16, 16, null]}
cache: {tokens_per_block: 4, max_tokens: 4096}
requests:
  source: synthetic
  synthetic: {generator: multi_turn, num_requests: 30, system_prompt_tokens: 40,
              prompt_tokens: 40, num_users: 3, turns: 3}
variants:
  - {name: plain, set: {}}
  - {name: scratch, set: {cache.swa_scratch_reuse: true}}
  - {name: full, set: {model.attention_window: null}}
""")
    runs = {o.variant: o.metrics for o in run_workload(load_workload(path))}
    plain, scratch, full = runs["plain"], runs["scratch"], runs["full"]
    assert set(plain["pools"]) == {"full", "window_16"}
    assert plain["scratch_slots_peak"] == 0 and scratch["scratch_slots_peak"] > 0
    assert scratch["peak_gpu_bytes"] < plain["peak_gpu_bytes"]
    assert plain["optimal_hit_rate"] is None and 0 < plain["hit_rate"] <= plain["ideal_hit_rate"]
    # Full attention only: the plain single-pool manager, as before windows existed.
    assert "pools" not in full and full["optimal_hit_rate"] is not None


def test_swa_scratch_workload_validates():
    from pathlib import Path

    wl = load_workload(Path(__file__).resolve().parent.parent / "workloads" / "swa-scratch.yaml")
    names = [name for name, _ in wl.variant_workloads()]
    assert any("scratch" in n for n in names) and len(names) >= 2
