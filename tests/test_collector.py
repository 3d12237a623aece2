"""Garbage collection while replaying (`engine/collector.py`): the young generation's threshold
is raised for the replay and restored after, and cyclic garbage is still collected."""

from __future__ import annotations

import gc
import weakref

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.engine import collector
from kvbench.engine.cache_mode import replay_cache_mode
from kvbench.engine.collector import YOUNG_THRESHOLD, fewer_collections
from kvbench.traffic.request import Request


@pytest.fixture
def threshold():
    """The test's own thresholds, CPython's defaults restored after."""
    before = gc.get_threshold()
    gc.set_threshold(700, 10, 10)
    yield
    gc.set_threshold(*before)


def test_raised_inside_and_restored_after_also_on_error(threshold):
    with fewer_collections():
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        with fewer_collections():  # nested: the outer setting stays
            assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
        assert gc.get_threshold() == (YOUNG_THRESHOLD, 10, 10)
    assert gc.get_threshold() == (700, 10, 10)
    with pytest.raises(KeyError), fewer_collections():
        raise KeyError("x")
    assert gc.get_threshold() == (700, 10, 10)


@pytest.mark.parametrize("young", [0, 2 * YOUNG_THRESHOLD])
def test_a_disabled_or_higher_threshold_is_left_alone(threshold, young):
    gc.set_threshold(young, 10, 10)
    with fewer_collections():
        assert gc.get_threshold() == (young, 10, 10)
    assert gc.get_threshold() == (young, 10, 10)


class _Node:
    __slots__ = ("other", "__weakref__")


def test_cycles_made_inside_are_still_collected(threshold, monkeypatch):
    """Without an explicit collection, the cycles made while raised are freed once enough
    containers were allocated (a small threshold here, so the test stays short)."""
    monkeypatch.setattr(collector, "YOUNG_THRESHOLD", 2000)
    was_enabled = gc.isenabled()
    gc.enable()
    try:
        with fewer_collections():
            assert gc.get_threshold()[0] == 2000
            first = None
            for _ in range(20_000):
                a, b = _Node(), _Node()
                a.other, b.other = b, a
                if first is None:
                    first = weakref.ref(a)
                del a, b
            assert first() is None
    finally:
        if not was_enabled:
            gc.disable()


def test_a_cache_mode_replay_runs_with_the_raised_threshold(threshold):
    seen = []
    tokens = np.arange(64, dtype=np.int64)
    requests = [Request(i, float(i), 64, 1, tokens=tokens) for i in range(4)]
    manager = KVCacheManager(CacheSpec(16, 8))
    result = replay_cache_mode(requests, manager, lambda n: seen.append(gc.get_threshold()[0]),
                               progress_every=2)
    assert seen and set(seen) == {YOUNG_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)
    assert result.reused_full_blocks == 3 * 3  # the replay itself is unchanged by it


def test_a_whole_workload_runs_with_the_raised_threshold(threshold, tmp_path):
    """The references after the replay (optimal, ideal, LRU) and a serve run too."""
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    path = tmp_path / "w.yaml"
    path.write_text(
        "model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}\n"
        "cache: {tokens_per_block: 8, max_tokens: 2048, eviction_policy: slru}\n"
        "requests: {synthetic: {num_requests: 20, system_prompt_tokens: 20, prompt_tokens: 12,"
        " output_tokens: 6}}\n"
        "run: {mode: cache, progress: false}\n"
        "variants: [{name: cache, set: {}}, {name: serve, set: {run.mode: serve}}]\n")
    seen = []

    def factory(name, n):
        seen.append((name, gc.get_threshold()[0]))
        return lambda k: None

    outcomes = run_workload(load_workload(path), factory)
    assert [o.metrics["requests"] for o in outcomes] == [20, 20]
    assert any("reference" in name for name, _ in seen) and len(seen) > 2
    assert {t for _, t in seen} == {YOUNG_THRESHOLD}
    assert gc.get_threshold() == (700, 10, 10)
