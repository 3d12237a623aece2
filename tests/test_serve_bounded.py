"""Serve mode on a trace in bounded memory: the loop pulls arrivals as the clock reaches them,
keeps a request's state only while it waits or runs, and keeps compact numbers of finished
requests; the results equal a run on the trace loaded into memory."""

from __future__ import annotations

import shutil
import weakref
from pathlib import Path

import numpy as np
import pytest
from cli_helpers import run_metrics
from trace_samples import write_samples

import kvbench.engine.serve as serve
import kvbench.runner as runner
from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.traffic.request import Request
from kvbench.traffic.spill import SpilledTrace

ROOT = Path(__file__).resolve().parents[1]
CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])


@pytest.fixture(scope="module")
def samples(tmp_path_factory):
    folder = tmp_path_factory.mktemp("serve-stream")
    write_samples(folder / "samples")
    for fmt in ("mooncake", "bailian", "lengths_csv"):
        shutil.copy(ROOT / "workloads" / "formats" / f"{fmt}.yaml", folder / f"{fmt}.yaml")
    return folder


@pytest.mark.parametrize("fmt, sets", [
    ("mooncake", ("cache.max_tokens=65536",)),
    ("bailian", ("cache.max_tokens=8192", "scheduler.max_batch_size=8")),
    ("bailian", ("cache.max_tokens=8192", "speculative.max_draft_len=3",
                 "speculative.acceptance_rate=0.6")),
    ("lengths_csv", ()),
])
def test_serve_streamed_equals_loaded(samples, capsys, monkeypatch, fmt, sets):
    loads = []
    real = runner._load
    monkeypatch.setattr(runner, "_load", lambda wl, stream=False: loads.append(
        type(r := real(wl, stream)).__name__) or r)
    path = samples / f"{fmt}.yaml"
    sets = ("run.mode=serve", *sets)
    streamed = run_metrics(path, capsys, *sets)
    monkeypatch.setattr(runner, "_streamable", lambda wl: False)
    loaded = run_metrics(path, capsys, *sets)
    assert loads == ["SpilledTrace", "RequestList"]
    assert streamed == loaded
    assert streamed["requests"] == 24 and streamed["ttft_ms"]["p50"] > 0


def tiled_trace(times: int, seed: int = 3) -> list[Request]:
    """`times` copies of 40 requests (shared system prompt, fresh ids per copy), each copy
    arriving after the previous one drained."""
    rng = np.random.default_rng(seed)
    base = [(np.concatenate([np.arange(4), 1000 + np.arange(i * 20, i * 20 + n)]),
             float(rng.uniform(0, 2.0)), int(rng.integers(2, 60)))
            for i, n in enumerate(rng.integers(1, 12, size=40).tolist())]
    base.sort(key=lambda b: b[1])
    out = []
    for k in range(times):
        for ids, t, n_out in base:
            ids = ids if k == 0 else np.where(ids < 4, ids, ids + k * 100_000)
            out.append(Request(len(out), t + 60.0 * k, len(ids) * 16 - 5, n_out,
                               hash_ids=ids.astype(np.int64), trace_block_tokens=16))
    return out


def test_live_states_are_bounded_by_waiting_and_running(monkeypatch):
    """Live `ServeRequest` objects, counted at every step of a run on a tiled trace, never
    exceed the waiting and running requests (plus those finishing in the step); their peak
    does not grow with the trace, and none outlives the run."""
    live = [0]

    class Counted(serve.ServeRequest):
        def __init__(self, *args) -> None:
            super().__init__(*args)
            live[0] += 1
            weakref.finalize(self, lambda: live.__setitem__(0, live[0] - 1))

    monkeypatch.setattr(serve, "ServeRequest", Counted)
    peaks = {}
    for times in (1, 6):
        trace = SpilledTrace(iter(tiled_trace(times)))
        manager = KVCacheManager(CacheSpec(16, 256, enable_partial_reuse=True))
        cfg = SchedulerConfig(max_num_tokens=256, max_batch_size=6)
        peak = [0]
        loop = None

        def check(rec):
            active = len(loop.waiting) + len(loop.prefilling) + len(loop.decoders)
            assert live[0] <= active + len(rec.finished)
            peak[0] = max(peak[0], live[0])

        loop = ServeLoop(trace, manager, Scheduler(cfg, 16), CLOCK, keep_states=False,
                         on_step=check)
        result = loop.run()
        trace.close()
        assert result.finished.count == 40 * times and result.requests == []
        assert live[0] == 0
        peaks[times] = peak[0]
        del loop, result
    # Each copy arrives after the previous drained: the same peak at 40 and 240 requests.
    assert 6 <= peaks[6] == peaks[1] < 40


def test_finished_numbers_equal_the_states():
    """The compact per-finished numbers give what the kept states give."""
    requests = tiled_trace(2)
    cfg = SchedulerConfig(max_num_tokens=128, max_batch_size=4)
    result = ServeLoop(iter(requests), KVCacheManager(CacheSpec(16, 96)), Scheduler(cfg, 16),
                       CLOCK, keep_states=True).run()
    states, done = result.requests, result.finished
    assert [s.request for s in states] == requests
    ttft, tpot, e2e = done.latencies_ms()
    assert ttft.tolist() == [(s.first_token_s - s.request.arrival_s) * 1e3 for s in states]
    assert tpot.tolist() == [(s.finish_s - s.first_token_s) * 1e3 / (s.request.output_length - 1)
                             for s in states if s.request.output_length > 1]
    assert e2e.tolist() == [(s.finish_s - s.request.arrival_s) * 1e3 for s in states]
    assert done.reused_tokens == sum(s.reused_tokens for s in states) > 0
    assert done.reused_full_blocks == sum(s.reused_full_blocks for s in states)
    assert done.output_tokens == sum(r.output_length for r in requests)
    assert done.prompt_tokens == sum(r.input_length for r in requests)


def test_requests_out_of_arrival_order_are_refused():
    a, b = tiled_trace(1)[:2]
    a.arrival_s, b.arrival_s = 1.0, 0.5
    cfg = SchedulerConfig(max_num_tokens=256, max_batch_size=4)
    with pytest.raises(ValueError, match="arrival order"):
        ServeLoop(iter([a, b]), KVCacheManager(CacheSpec(16, 64)), Scheduler(cfg, 16),
                  CLOCK).run()
