"""Sliding-window pools driving the torch data plane: random window mixes, chunked prefill of
several sequences per step, reuse (partial copies, host onboards), out-of-window release and
scratch slots, with every page a query reads checked against dense recomputation. If the
windows layer gives a query a wrong, missing or overwritten page, attention output is wrong."""

from __future__ import annotations

import random

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.cache.manager import CacheSpec  # noqa: E402
from kvbench.cache.lifecycle import life_cycles  # noqa: E402
from kvbench.cache.windows import WindowedCacheManager  # noqa: E402
from kvbench.kernels.dataplane import DataPlane  # noqa: E402
from kvbench.kernels.step import ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.traffic.request import Request  # noqa: E402

_ids = iter(range(1 << 30))


def build(rng: random.Random):
    tpb = rng.choice([1, 2, 3, 4])
    pattern = [rng.choice([None, 1, 3, 5, 8]) for _ in range(rng.randint(1, 3))]
    if all(w is None for w in pattern):
        pattern[0] = 3
    windows = [pattern[i % len(pattern)] for i in range(rng.randint(len(pattern), 5))]
    cycles = life_cycles(windows)
    host = rng.choice([0, 12, 12])
    specs = [CacheSpec(tpb, rng.randint(12, 40), num_host_blocks=host, emit_copy_ops=True,
                       enable_partial_reuse=rng.random() < 0.7) for _ in cycles]
    manager = WindowedCacheManager(
        cycles, specs, release_out_of_window=rng.choice(["keep_cached", "drop"]),
        swa_scratch_reuse=rng.random() < 0.6)
    manager.enable_sanity_tracking()
    shape = ModelShape(num_layers=len(windows), num_kv_heads=1, num_q_heads=2, head_dim=8,
                       tokens_per_block=tpb, dtype="float32")
    pools = [PoolSpec(c.layers, s.num_gpu_blocks, window=c.window, num_host_slots=host)
             for c, s in zip(cycles, specs)]
    return manager, DataPlane(shape, pools, seed=rng.randint(0, 99))


def prompts(rng: random.Random, n: int) -> list[np.ndarray]:
    base = rng.sample(range(500), 30)
    out: list[np.ndarray] = []
    for _ in range(n):
        if out and rng.random() < 0.4:
            toks = np.concatenate([rng.choice(out), rng.sample(range(500, 900), rng.randint(1, 6))])
        else:
            toks = np.concatenate([base[:rng.randint(0, 30)],
                                   rng.sample(range(900, 2000), rng.randint(1, 8))])
        out.append(np.asarray(toks[:36], dtype=np.int64))
    return out


@pytest.mark.parametrize("seed", range(16))
def test_random_windows_verify_on_the_data_plane(seed):
    rng = random.Random(seed)
    manager, plane = build(rng)
    pending = list(prompts(rng, 16))
    live: list[tuple] = []  # (sequence, request, chunk)
    steps = 0
    while pending or live:
        if pending and (not live or rng.random() < 0.4):
            toks = pending.pop(0)
            r = Request(next(_ids), 0.0, len(toks), 1, tokens=toks)
            live.append((manager.add_sequence(r), r, rng.randint(1, 12)))
            assert manager._check_sanity()
            continue
        batch = rng.sample(live, rng.randint(1, len(live)))
        items, stepping = [], []
        for seq, r, chunk in batch:
            start = seq.num_computed
            end = min(r.input_length, start + chunk)
            if not manager.begin_step(seq, end):
                continue
            stepping.append(seq)
            for i in range(len(manager.managers)):
                first, blocks, scratch = manager.step_view(seq, i, start)
                items.append(StepItem(r.id, r.prompt_tokens(), blocks, start, end, pool=i,
                                      first_block=first, scratch=scratch))
        ops = {}
        for i, m in enumerate(manager.managers):
            ops[i], m.copy_ops = m.copy_ops, []
        if not items:  # nothing fit: finish the oldest to make room
            seq, r, _ = live.pop(0)
            manager.release(seq)
            plane.execute_step(ops, [])
            continue
        check = plane.execute_step(ops, items)
        assert check.verified, check.mismatch
        steps += 1
        for seq in stepping:
            manager.end_step(seq)
        assert manager._check_sanity()
        for entry in [e for e in live if e[0].num_computed >= e[1].input_length]:
            manager.release(entry[0])
            live.remove(entry)
        assert manager._check_sanity()
    assert steps and manager.scratch_slots == 0


def test_a_wrong_scratch_page_is_caught():
    # Window 2, one token per block: the query at p reads p - 1 and p, so two scratch blocks
    # sharing a page (one layer-slice too few) must show up as a K/V mismatch.
    cycles = life_cycles([2, 2])
    manager = WindowedCacheManager(cycles, [CacheSpec(1, 16)], swa_scratch_reuse=True)
    shape = ModelShape(num_layers=2, num_kv_heads=1, num_q_heads=2, head_dim=8,
                       tokens_per_block=1, dtype="float32")
    plane = DataPlane(shape, [PoolSpec((0, 1), 16, window=2)])
    toks = np.arange(10, 16)
    r = Request(next(_ids), 0.0, len(toks), 1, tokens=toks)
    seq = manager.add_sequence(r)
    assert manager.begin_step(seq, 6)
    first, blocks, scratch = manager.step_view(seq, 0, 0)
    assert sorted(scratch) == [0, 1, 2, 3, 4] and len(set(scratch.values())) == 5
    good = StepItem(r.id, toks, blocks, 0, 6, first_block=first, scratch=scratch)
    assert plane.execute_step([], [good]).verified
    wrong = {**scratch, 1: scratch[0]}
    bad = StepItem(r.id, toks, blocks, 0, 6, first_block=first, scratch=wrong)
    check = plane.execute_step([], [bad])
    assert not check.verified and check.mismatch.kind == "kv"


def test_windowed_cache_mode_run_verifies(tmp_path):
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    path = tmp_path / "v.yaml"
    path.write_text("""
model: {num_layers: 3, num_kv_heads: 1, num_q_heads: 2, head_dim: 8, dtype: float32,
        attention_window: [7, null, 16]}
cache: {tokens_per_block: 4, max_tokens: 400, host_offload_ratio: 1.0}
requests:
  source: synthetic
  synthetic: {generator: multi_turn, num_requests: 24, system_prompt_tokens: 20,
              prompt_tokens: 30, output_tokens: 8, num_users: 3, turns: 4}
run: {mode: cache, backend: torch}
variants:
  - {name: keep, set: {}}
  - {name: scratch-drop, set: {cache.swa_scratch_reuse: true, cache.release_out_of_window: drop}}
""")
    for o in run_workload(load_workload(path)):
        m = o.metrics
        assert m["verified"] is True, (o.variant, m["verify_mismatch"])
        assert m["verified_steps"] == m["requests"] and m["hit_rate"] > 0
