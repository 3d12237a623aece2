"""Sliding-window pools under the serve loop: chunked prefill with per-chunk scratch slots,
decode releasing out-of-window blocks at block boundaries, preemption and reverted deferrals;
every step's reads are checked to have pages and every pool's invariants to hold."""

from __future__ import annotations

import random

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec
from kvbench.cache.seq import NO_BLOCK
from kvbench.cache.lifecycle import life_cycles
from kvbench.cache.windows import WindowedCacheManager
from kvbench.config import ModelConfig, SchedulerConfig, load_workload
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.errors import InputError
from kvbench.runner import run_workload
from kvbench.traffic.request import Request

CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])


class Checked(WindowedCacheManager):
    """Checks, before each step's end releases anything, that every position the step's
    queries read (from the computed tokens on) has a page in every layer."""

    __slots__ = ()

    def end_step(self, wseq, end=None):
        stop = wseq.num_tokens if end is None else end
        if stop > wseq.num_computed:
            pages = self.page_tables(wseq)
            for c in self.cycles:
                lo = c.first_needed(wseq.num_computed, self.tpb)
                rows = pages[list(c.layers)]
                assert (rows[:, lo:-(-stop // self.tpb)] >= 0).all(), (c.window, lo, stop)
        super().end_step(wseq, end)
        for c, s in zip(self.cycles, wseq.seqs):
            first = c.first_needed(wseq.num_computed, self.tpb)
            assert all(j < first for j, b in enumerate(s.blocks) if b == NO_BLOCK)


def run(seed: int, scratch: bool, **sched):
    rng = random.Random(seed)
    tpb = rng.choice([2, 4])
    windows = [rng.choice([3, 8, 13]), rng.choice([5, None]), None]
    cycles = life_cycles(windows)
    blocks = [rng.randint(40, 90) for _ in cycles]
    m = Checked(cycles, [CacheSpec(tpb, n, enable_partial_reuse=rng.random() < 0.5)
                         for n in blocks],
                release_out_of_window=rng.choice(["keep_cached", "drop"]),
                swa_scratch_reuse=scratch)
    m.enable_sanity_tracking()
    base = rng.sample(range(1000), 30)
    requests = []
    for i in range(24):
        toks = base[:rng.randint(0, 30)] + rng.sample(range(1000, 5000), rng.randint(1, 40))
        requests.append(Request(i, i * 0.002, len(toks), rng.randint(1, 12),
                                tokens=np.asarray(toks, dtype=np.int64)))
    cfg = SchedulerConfig(max_num_tokens=24, max_batch_size=6, **sched)
    loop = ServeLoop(requests, m, Scheduler(cfg, tpb), CLOCK,
                     revert_deferred_ctx=cfg.revert_deferred_ctx, batch_add=rng.random() < 0.5,
                     on_step=lambda rec: m._check_sanity())
    result = loop.run()
    assert all(p.gpu.num_in_use == 0 for p in m.managers) and m.scratch_slots == 0
    return m, result


@pytest.mark.parametrize("seed", range(12))
def test_serve_loop_on_windowed_pools(seed):
    m, result = run(seed, scratch=seed % 2 == 0)
    assert result.iterations > 0
    assert m.peak_gpu_blocks >= m.gpu.num_in_use


@pytest.mark.parametrize("seed", range(4))
def test_serve_loop_reverts_deferred_chunks_with_scratch(seed):
    m, result = run(100 + seed, scratch=True, batch_wait_timeout_iters=2,
                    batch_wait_max_tokens_ratio=0.9, revert_deferred_ctx=True)
    assert result.batch_wait_iterations > 0


def test_serve_run_reports_window_metrics_and_rejects_held_deferral_with_scratch(tmp_path):
    path = tmp_path / "s.yaml"
    path.write_text("""
model: {num_layers: 6, num_kv_heads: 2, num_q_heads: 4, head_dim: 16,
        attention_window: [32, 32, null]}
cache: {tokens_per_block: 4, max_tokens: 8192}
scheduler: {max_num_tokens: 64, max_batch_size: 8}
requests:
  source: synthetic
  synthetic: {generator: multi_turn, num_requests: 40, system_prompt_tokens: 64,
              prompt_tokens: 60, output_tokens: 10, num_users: 4, turns: 3, rate: 50}
run: {mode: serve}
variants:
  - {name: plain, set: {}}
  - {name: scratch, set: {cache.swa_scratch_reuse: true}}
""")
    runs = {o.variant: o.metrics for o in run_workload(load_workload(path))}
    assert set(runs["plain"]["pools"]) == {"full", "window_32"}
    assert runs["scratch"]["scratch_slots_peak"] > 0 and runs["plain"]["scratch_slots_peak"] == 0
    assert all(0 < m["hit_rate"] <= m["ideal_hit_rate"] for m in runs.values())
    held = load_workload(path, ["cache.swa_scratch_reuse=true",
                                "scheduler.batch_wait_timeout_iters=2", "variants=[]"])
    with pytest.raises(InputError, match="revert_deferred_ctx"):
        run_workload(held)
