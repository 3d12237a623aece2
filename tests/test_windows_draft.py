"""A draft model over sliding-window layers (the target's, the draft's or both;
`cache/mirror.py`'s `MirroredWindowedCacheManager`): exact block ids and peaks per pool of
both models with the extra-token reservation, reuse limited to what both models' pools serve,
each pool's estimate equal to what the add and the step take (hypothesis, one request and
batches), invariants after every operation, the serve loop with both data planes verified
(and a draft plane that misses its copies caught), and the runner's budget split."""

from __future__ import annotations

import random

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from kvbench.cache.add import AddPlan
from kvbench.cache.lifecycle import life_cycles
from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.mirror import MirroredWindowedCacheManager
from kvbench.cache.seq import NO_BLOCK
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Phase, Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.engine.speculative import Speculation
from kvbench.traffic.request import Request
from strategies import related_prompts
from test_windows_beams import frees

CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])
DRAFT_CLOCK = StepClock(ModelConfig(num_layers=2, num_kv_heads=8, num_q_heads=32,
                                    head_dim=128), PRESETS["H100-SXM"])
_ids = iter(range(1 << 30))


def req(tokens, out=1, rid=None, t=0.0, namespace=None, output_tokens=None) -> Request:
    toks = np.asarray(list(tokens), dtype=np.int64)
    return Request(next(_ids) if rid is None else rid, t, len(toks), out, tokens=toks,
                   namespace=namespace, output_tokens=output_tokens)


def dmgr(windows, draft_windows, blocks=32, draft_blocks=None, tpb=4, host=0,
         scratch=False, release="keep_cached", emit=True, emit_draft=True, reserve=0
         ) -> MirroredWindowedCacheManager:
    """Target layers with `windows`, draft layers with `draft_windows`; 3 bytes per token
    and layer in the target, 1 in the draft."""
    cycles, dcycles = life_cycles(windows), life_cycles(draft_windows)

    def specs(n, sizes, e):
        sizes = [sizes] * n if isinstance(sizes, int) else sizes
        return [CacheSpec(tpb, b, num_host_blocks=host, emit_copy_ops=e) for b in sizes]

    m = MirroredWindowedCacheManager(
        cycles, specs(len(cycles), blocks, emit), dcycles,
        specs(len(dcycles), blocks if draft_blocks is None else draft_blocks,
              emit and emit_draft),
        release_out_of_window=release, swa_scratch_reuse=scratch,
        bytes_per_token_per_layer=3, draft_bytes_per_token_per_layer=1,
        reserve_tokens=reserve)
    m.enable_sanity_tracking()
    return m


def check_mirror(m: MirroredWindowedCacheManager, wseq) -> None:
    """Every pool of both models spans the same block positions, and a position holds a
    block unless no later query of that pool's window reads it (or a scratch page does)."""
    spans = {len(s.blocks) for s in wseq.seqs}
    assert len(spans) == 1, "the draft's pools diverged from the target's"
    for i, (c, s) in enumerate(zip(m.cycles, wseq.seqs)):
        first = c.first_needed(wseq.num_computed, m.tpb)
        scratch = wseq.scratch_pages[i] or {}
        for j, b in enumerate(s.blocks):
            if b == NO_BLOCK:
                assert j < first or j in scratch, (i, c.window, j, first)


# --- exact block ids, peaks and reservations --------------------------------------------------


def test_each_models_pools_hold_the_step_and_its_reservation():
    """Target: layer 0 with W = 4, layer 1 full; draft: two layers with W = 3. tpb 4, k = 2
    drafts and 1 extra token reserved, scratch on, a 13-token prompt: the first step holds
    positions 0..15 (13 + 3 reserved). Scratch is chosen for the query at 13: W = 4 reads
    10..13 and W = 3 reads 11..13, so blocks 0 and 1 are out of window in both window pools;
    the target's one-layer pool needs a scratch slot per block, the draft's two-layer pool
    one slot for both."""
    m = dmgr([4, None], [3, 3], blocks=16, scratch=True, reserve=3)
    full, win, dwin = m.managers
    assert [c.window for c in m.cycles] == [None, 4, 3] and m.num_target_pools == 2
    seq = m.add_sequence(req(range(13), out=6))
    assert m.begin_step(seq, 13 + 3)
    assert full.gpu.num_in_use == 4 and seq.seqs[0].blocks == [0, 1, 2, 3]
    assert seq.seqs[1].blocks == [NO_BLOCK, NO_BLOCK, 2, 3]
    assert sorted(seq.scratch_pages[1]) == [0, 1] and win.gpu.num_in_use == 4
    assert seq.seqs[2].blocks == [NO_BLOCK, NO_BLOCK, 1, 2]
    # One scratch slot (block 0), its two layer slices: pages 0 and 1 in every layer.
    assert seq.scratch_pages[2] == {0: 0, 1: 1} and dwin.gpu.num_in_use == 3
    check_mirror(m, seq)
    # Target peak: 8 slots of 4 tokens x 1 layer x 3 bytes; draft: 3 of 4 x 2 x 1.
    assert (m.peak_gpu_blocks, m.peak_gpu_bytes) == (8, 96)
    assert (m.draft_peak_gpu_blocks, m.draft_peak_gpu_bytes) == (3, 24)
    assert m.peak_kv_bytes == 120
    m.end_step(seq, 13)
    assert [p.gpu.num_in_use for p in m.managers] == [4, 2, 2]
    # The first decode step: position 13 and 2 drafts, 1 extra token: 17 tokens, block #4
    # in every pool of both models (the window pools' first empty block: the scratch slot
    # the prompt's step returned).
    assert m.step_blocks(seq, 13 + 1 + 2 + 1) == [1, 1, 1]
    assert m.resize(seq, 17)
    assert [s.blocks[4] for s in seq.seqs] == [4, 0, 0]
    check_mirror(m, seq)
    # 2 drafts accepted: 16 tokens hold KV; W = 4 at 16 reads 13.., W = 3 reads 14..: block 2
    # goes in the target's window pool only when the query at 16 no longer reads it.
    m.commit(seq, 16)
    assert seq.seqs[1].blocks[:4] == [NO_BLOCK, NO_BLOCK, NO_BLOCK, 3]
    assert seq.seqs[2].blocks[:4] == [NO_BLOCK, NO_BLOCK, NO_BLOCK, 2]
    m.release(seq)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m._check_sanity()
    metrics = m.metrics()
    assert set(metrics["pools"]) == {"full", "window_4", "draft_window_3"}
    assert metrics["gpu_blocks_total"] == 32 and m.draft_memory(0, 0)[
        "draft_gpu_blocks_total"] == 16


def test_reuse_is_what_both_models_pools_serve():
    """A draft window pool that dropped its out-of-window blocks cannot serve a prefix the
    target's full pool holds: the request reuses nothing rather than have the draft miss
    KV of tokens the target skips."""
    prompt = list(range(20))
    m = dmgr([None], [4], blocks=16, release="drop")
    s = m.add_sequence(req(prompt))
    assert m.begin_step(s, 20)
    m.end_step(s)
    m.release(s)
    alone = KVCacheManager(CacheSpec(4, 16))
    a = alone.add_sequence(req(prompt))
    alone.resize(a, 20)
    alone.commit(a, 20)
    alone.release(a)
    other = req(prompt[:12] + [99] * 8)
    assert alone.add_sequence(other).reused_tokens == 12
    # The draft's query at 12 reads 9..12: blocks 2 and 3, dropped when the prompt ran.
    assert m.estimate_reuse(other) == 0 and m.add_sequence(other).reused_tokens == 0
    # A prefix ending where the draft's window blocks are stored is reused by both.
    same = m.add_sequence(req(prompt + [5, 5]))
    assert same.reused_tokens == 20 and same.seqs[1].blocks[:4] == [NO_BLOCK] * 4
    check_mirror(m, same)


# --- estimates equal what the add and the step take -------------------------------------------


def draw_setup(data, host=True, reserve=0):
    def windows(name):
        return data.draw(st.lists(st.sampled_from([None, 2, 3, 5, 8]), min_size=1, max_size=3),
                         label=name)

    target, draft = windows("target"), windows("draft")
    if all(w is None for w in target + draft):
        draft[0] = 3
    return dmgr(target, draft, blocks=data.draw(st.integers(30, 50)), tpb=3,
                draft_blocks=[data.draw(st.integers(30, 50)) for _ in life_cycles(draft)],
                host=data.draw(st.sampled_from([0, 6])) if host else 0,
                scratch=data.draw(st.booleans()),
                release=data.draw(st.sampled_from(["keep_cached", "drop"])),
                reserve=reserve)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=related_prompts(max_requests=10, max_len=16), data=st.data())
def test_each_pools_estimate_equals_what_the_add_and_step_take(prompts, data):
    """One request at a time, the step allocated with a reservation as the scheduler does:
    every pool of both models gives up exactly its `estimate_pools` draw to the add and its
    `step_blocks` to the first step; the scheduler's `add_need` covers both."""
    reserve = data.draw(st.integers(0, 4))
    m = draw_setup(data, reserve=reserve)
    live = []
    for tokens in prompts:
        r = req(tokens)
        end = r.input_length + reserve
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
        assert [b - a for b, a in zip(added, frees(m))] == steps
        assert all(d + t <= n for d, t, n in zip(draws, steps, sched))
        check_mirror(m, seq)
        m.end_step(seq, r.input_length)
        assert m._check_sanity()
        check_mirror(m, seq)
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
    """A batch estimated with the step's shared `AddPlan` (as the scheduler does), related
    prompts claiming the same blocks: the two-phase add takes each pool's summed draws,
    target's and draft's, and their first steps the summed step blocks."""
    m = draw_setup(data, host=False)
    warm = m.add_sequence(req(range(20)))
    assert m.begin_step(warm, 20)
    m.end_step(warm)
    m.release(warm)
    batch = [req(list(range(data.draw(st.integers(3, 20)))) + [7] * i) for i in range(3)]
    plan = AddPlan()
    estimates = [m.estimate_pools(r, plan) for r in batch]
    before = frees(m)
    seqs = m.add_sequences(batch)
    assert [s.reused_tokens for s in seqs] == [e[0] for e in estimates]
    added = frees(m)
    assert [b - a for b, a in zip(before, added)] == [sum(e[2][i] for e in estimates)
                                                      for i in range(len(before))]
    steps = [m.step_blocks(s, s.request.input_length + 2) for s in seqs]
    assume(all(sum(s_[i] for s_ in steps) <= f for i, f in enumerate(added)))
    for s in seqs:
        assert m.begin_step(s, s.request.input_length + 2)
        check_mirror(m, s)
    assert [b - a for b, a in zip(added, frees(m))] == [sum(s_[i] for s_ in steps)
                                                        for i in range(len(added))]
    assert m._check_sanity()


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(prompts=related_prompts(max_requests=8, max_len=14), data=st.data())
def test_random_operations_keep_invariants(prompts, data):
    """Random add / step with a reservation / revert (shrink) / release: every pool of both
    models stays sane and in step with the others after every operation, and a step takes
    exactly `step_blocks`."""
    reserve = data.draw(st.integers(0, 3))
    m = draw_setup(data, reserve=reserve)
    live = []
    for tokens in prompts:
        r = req(tokens)
        plan = AddPlan()
        _, positions, draws = m.estimate_pools(r, plan)
        if all(n <= f for n, f in zip(m.add_need(r, plan, draws, positions,
                                                 r.input_length + reserve), frees(m))):
            live.append(m.add_sequence(r))
            assert m._check_sanity()
        for seq in list(live):
            op = data.draw(st.sampled_from(["step", "step", "revert", "release", "keep"]))
            if op in ("step", "revert"):
                computed = seq.num_tokens + data.draw(st.integers(1, 5))
                end = computed + reserve
                need, free = m.step_blocks(seq, end), frees(m)
                if not m.begin_step(seq, end):
                    assert any(n > f for n, f in zip(need, free))
                    continue
                assert [f - a for f, a in zip(free, frees(m))] == need
                check_mirror(m, seq)
                assert m._check_sanity()
                if op == "revert":
                    m.shrink(seq, seq.num_computed)
                else:
                    m.end_step(seq, computed)
            elif op == "release":
                m.release(seq)
                live.remove(seq)
            assert m._check_sanity()
            if seq in live:
                check_mirror(m, seq)
    for seq in live:
        m.release(seq)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m.scratch_slots == 0
    assert m._check_sanity()


# --- serve mode and the data planes -------------------------------------------------------------


def requests(seed, n=12):
    """Conversations: a next turn's prompt is the last one's prompt and known answer, so
    reuse reaches into blocks decode steps wrote."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 5, 10)
    t, out, last = 0.0, [], {}
    for i in range(n):
        t += float(rng.exponential(0.003))
        user = int(rng.integers(0, 3))
        prompt = last.get(user, base[:int(rng.integers(0, 11))])
        prompt = np.concatenate([prompt, rng.integers(0, 5, int(rng.integers(2, 7)))])
        answer = rng.integers(0, 5, int(rng.integers(1, 12)))
        out.append(req(prompt, out=len(answer), rid=i, t=t, output_tokens=answer))
        last[user] = np.concatenate([prompt, answer])
    return out


def reused_an_answer(result) -> bool:
    """Some request reused past the prompt of the turn it continues: into blocks the
    decode steps of that turn wrote."""
    states = sorted(result.requests, key=lambda s: s.request.id)
    for i, s in enumerate(states):
        for prev in states[:i]:
            p = prev.request
            turn = np.concatenate([p.tokens, p.output_tokens])
            mine = s.request.tokens
            if len(mine) > len(turn) and (mine[:len(turn)] == turn).all() and (
                    s.reused_tokens > p.input_length):
                return True
    return False


def serve(reqs, m, *, k=2, rate=0.6, extra=1, mnt=48, batch_add=True, planes=(None, None),
          seed=0):
    reserve = k + extra
    sched = Scheduler(SchedulerConfig(max_num_tokens=mnt, max_batch_size=4), m.tpb,
                      reserve_tokens=reserve)
    spec = Speculation(k, rate, extra, seed, DRAFT_CLOCK)
    loop = None

    def on_step(rec):
        assert m._check_sanity() and rec.scheduled_tokens <= mnt
        for s in loop.states:
            if s.seq is not None:
                check_mirror(m, s.seq)

    loop = ServeLoop(reqs, m, sched, CLOCK, batch_add=batch_add, data_plane=planes[0],
                     draft_plane=planes[1], speculation=spec, on_step=on_step)
    result = loop.run()
    assert all(s.phase is Phase.DONE and s.generated == s.request.output_length
               for s in result.requests)
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m.scratch_slots == 0
    assert m._check_sanity()
    return result


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
@pytest.mark.parametrize("seed", range(4))
def test_serve_with_a_windowed_draft_keeps_every_pool_in_step(seed, batch_add):
    rng = random.Random(seed)
    target = rng.choice([[4, None], [None, None], [6, 6, None]])
    draft = rng.choice([[3], [None], [5, None]]) if target != [None, None] else [3, None]
    m = dmgr(target, draft, blocks=rng.choice([30, 60]), draft_blocks=rng.choice([24, 60]),
             host=rng.choice([0, 6]), scratch=seed % 2 == 0,
             release=rng.choice(["keep_cached", "drop"]), reserve=2 + 1)
    result = serve(requests(seed), m, batch_add=batch_add, rate=rng.choice([0.0, 0.6, 1.0]))
    if batch_add:  # the batched add's estimates are exact: no placement fails
        assert result.ctx_alloc_failures == 0
    assert m.draft_peak_gpu_blocks > 0 and m.peak_kv_bytes > m.peak_gpu_bytes


def planes_for(m: MirroredWindowedCacheManager):
    pytest.importorskip("torch")
    from kvbench.kernels.dataplane import DataPlane
    from kvbench.kernels.step import ModelShape, PoolSpec

    t = m.num_target_pools

    def plane(cycles, managers):
        layers = sum(c.num_layers for c in cycles)
        return DataPlane(ModelShape(layers, 1, 2, 8, m.tpb, "float32"),
                         [PoolSpec(c.layers, p.gpu.capacity, window=c.window,
                                   num_host_slots=p.host.capacity if p.host else 0)
                          for c, p in zip(cycles, managers)])

    return plane(m.cycles[:t], m.managers[:t]), plane(m.draft_cycles, m.managers[t:])


@pytest.mark.parametrize("seed", range(3))
def test_both_data_planes_verify_with_host_tiers_and_scratch(seed):
    """Acceptance 1.0 included: the last draft of a finishing request is written in its step,
    so a next turn reusing the answer's blocks reads whole draft KV."""
    m = dmgr([4, None], [3, None] if seed != 1 else [None], blocks=30, draft_blocks=18,
             host=8, scratch=True, reserve=3)
    target, draft = planes_for(m)
    result = serve(requests(seed), m, rate=[0.6, 1.0, 1.0][seed], planes=(target, draft))
    for p in (target, draft):
        metrics = p.metrics()
        assert metrics["verified"] is True, metrics["verify_mismatch"]
        assert metrics["verified_steps"] == p.steps > 0
    assert reused_an_answer(result)
    assert sum(p.onboard_blocks for p in m.managers[m.num_target_pools:]) > 0


def test_a_draft_plane_that_misses_its_copies_is_caught():
    m = dmgr([4, None], [3, None], blocks=30, draft_blocks=18, host=8, reserve=3,
             emit_draft=False)
    target, draft = planes_for(m)
    serve(requests(0), m, rate=0.6, planes=(target, draft))
    assert sum(p.onboard_blocks for p in m.managers[m.num_target_pools:]) > 0
    assert target.metrics()["verified"] is True
    assert draft.metrics()["verified"] is False


def test_cache_mode_prefills_every_prompt_in_both_models_pools():
    from kvbench.engine.cache_mode import replay_cache_mode

    m = dmgr([4, None], [3, None], blocks=40, draft_blocks=24, host=8, scratch=True)
    target, draft = planes_for(m)
    result = replay_cache_mode(requests(2, n=16), m, data_plane=target, draft_plane=draft)
    for p in (target, draft):
        metrics = p.metrics()
        assert metrics["verified"] is True, metrics["verify_mismatch"]
        assert metrics["verified_steps"] == p.steps == 16
    assert result.reused_tokens > 0
    assert result.draft_reused_full_blocks == result.reused_full_blocks
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m._check_sanity()
    assert m.draft_peak_gpu_blocks > 0 and m.scratch_blocks > 0


# --- the runner -----------------------------------------------------------------------------------


def test_runner_splits_the_budget_between_both_models_pools(tmp_path):
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    path = tmp_path / "w.yaml"
    path.write_text(
        "model: {num_layers: 4, num_kv_heads: 1, num_q_heads: 2, head_dim: 8,"
        " attention_window: [16, 16, 16, null]}\n"
        "cache: {tokens_per_block: 8, max_tokens: 4096, swa_scratch_reuse: true}\n"
        "requests: {synthetic: {num_requests: 20, system_prompt_tokens: 40,"
        " prompt_tokens: 30, output_tokens: 12}}\n"
        "speculative: {max_draft_len: 3, num_extra_kv_tokens: 1, draft_model: {num_layers: 2,"
        " num_kv_heads: 1, num_q_heads: 2, head_dim: 8, attention_window: [8, null]}}\n"
        "run: {mode: serve, progress: false}\n")
    (out,) = run_workload(load_workload(path))
    m = out.metrics
    pools = m["pools"]
    assert set(pools) == {"full", "window_16", "draft_full", "draft_window_8"}
    # Every pool's bytes come from the one budget: 4096 tokens of the target's 4 layers.
    budget = 4096 * 4 * 2 * 8 * 2
    used = sum(p["gpu_blocks_total"] * p["slot_bytes"] for p in pools.values())
    assert budget - max(p["slot_bytes"] for p in pools.values()) * len(pools) < used <= budget
    assert m["gpu_blocks_total"] == pools["full"]["gpu_blocks_total"] + pools[
        "window_16"]["gpu_blocks_total"]
    assert m["draft_gpu_blocks_total"] == pools["draft_full"]["gpu_blocks_total"] + pools[
        "draft_window_8"]["gpu_blocks_total"]
    assert max(m["peak_gpu_bytes"], m["draft_peak_gpu_bytes"]) <= m["peak_kv_bytes"] <= (
        m["peak_gpu_bytes"] + m["draft_peak_gpu_bytes"])
    assert 1 <= m["tokens_per_decode_step"] <= 4
    (cache,) = run_workload(load_workload(path, ["run.mode=cache"]))
    c = cache.metrics
    assert set(c["pools"]) == set(pools) and c["draft_reused_full_blocks"] == c[
        "reused_full_blocks"] > 0
    # The same model without windows anywhere keeps the one-pool mirror: equal block counts.
    (plain,) = run_workload(load_workload(path, [
        "model.attention_window=null", "speculative.draft_model.attention_window=null"]))
    assert plain.metrics["gpu_blocks_total"] == plain.metrics["draft_gpu_blocks_total"]
