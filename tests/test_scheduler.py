"""The serve-mode scheduler's policy, one decision at a time."""

from heapq import heappush

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.config import SchedulerConfig
from kvbench.engine.scheduler import Scheduler, ServeRequest
from kvbench.traffic.request import Request


def sched(**kw):
    cfg = dict(max_num_tokens=16, max_batch_size=4)
    cfg.update(kw)
    return Scheduler(SchedulerConfig(**cfg), tokens_per_block=4)


def waiting(*lengths, tokens=None):
    """A waiting heap of requests with distinct prompts of these lengths (or these tokens)."""
    if tokens is None:
        tokens = [np.arange(1000 * i, 1000 * i + n) for i, n in enumerate(lengths)]
    heap = []
    for i, toks in enumerate(tokens):
        heappush(heap, (i, ServeRequest(Request(i, 0.0, len(toks), 4, tokens=toks), i)))
    return heap


def plan(s, heap, num_gen=0, num_active=0, blocks=64, cache=None):
    cache = cache or KVCacheManager(CacheSpec(4, blocks))
    return [(w.req.idx, w.new, w.estimated, w.chunk, w.last)
            for w in s.plan_context([], heap, num_gen, num_active, cache)]


def test_fcfs_chunks_after_generation_tokens():
    heap = waiting(10, 9)
    # 16 - 3 generation tokens = 13: request 0 whole, then 3 left: less than a block for 1.
    assert plan(sched(), heap, num_gen=3) == [(0, True, 0, 10, True)]
    assert [i for i, _ in heap] == [1]


def test_non_last_chunks_are_whole_blocks_and_no_request_overtakes():
    # 15 tokens: a 12-token chunk for request 0, and request 1 fits in the 3 left.
    assert plan(sched(), waiting(30, 2), num_gen=1) == [
        (0, True, 0, 12, False), (1, True, 0, 2, True)]
    # 3 tokens: less than a block for request 0, so request 1 may not go first.
    heap = waiting(30, 2)
    assert plan(sched(), heap, num_gen=13) == []
    assert len(heap) == 2
    assert plan(sched(enable_chunked_prefill=False), waiting(30, 2)) == []


def test_batch_size_and_active_limits():
    assert len(plan(sched(max_batch_size=2), waiting(2, 2, 2))) == 2
    assert len(plan(sched(max_batch_size=4), waiting(2, 2, 2), num_gen=2)) == 2
    assert len(plan(sched(max_batch_size=4), waiting(2, 2, 2), num_active=3)) == 1


def test_estimated_reuse_shifts_the_window_and_costs_blocks():
    cache = KVCacheManager(CacheSpec(4, 8))
    shared = np.arange(12)
    seq = cache.add_sequence(Request(9, 0.0, 12, 1, tokens=shared))
    cache.resize(seq, 12)
    cache.commit(seq, 12)
    cache.release(seq)
    prompt = [np.concatenate([shared, np.arange(50, 70)])]
    # 12 tokens estimated reused: the 16-token chunk is [12, 28), not shrunk to [12, 16).
    assert plan(sched(), waiting(tokens=prompt), cache=cache) == [(0, True, 12, 16, False)]
    # Its blocks: 3 cached ones claimed from the free pool and 4 new = 7 of 8; with 2 taken
    # by another sequence, 6 are free.
    cache.resize(cache.add_sequence(Request(8, 0.0, 4, 1, tokens=np.arange(900, 904))), 8)
    assert cache.gpu.num_free == 6
    assert plan(sched(), waiting(tokens=prompt), cache=cache) == []
    # A request needing more blocks than are free waits.
    assert plan(sched(max_num_tokens=64), waiting(40), blocks=6) == []


@pytest.mark.parametrize("timeout, ratio, tokens, expected", [
    (3, 0.5, 7, [True, True, True, False, True]),   # below the ratio: wait until the timeout
    (3, 0.5, 8, [False] * 5),                       # at the ratio: never wait
    (0, 0.9, 1, [False] * 5),                       # timeout 0: never wait
    (2, 0.0, 1, [False] * 5),                       # ratio 0: nothing is below it
])
def test_delay_batching_decisions(timeout, ratio, tokens, expected):
    s = sched(batch_wait_timeout_iters=timeout, batch_wait_max_tokens_ratio=ratio)
    assert [s.defer(tokens, 1, 1) for _ in expected] == expected


def test_delay_batching_needs_context_and_generation_requests():
    s = sched(batch_wait_timeout_iters=5, batch_wait_max_tokens_ratio=1.0)
    assert not s.defer(1, 0, 3)
    assert not s.defer(1, 2, 0)  # nothing decoding: waiting would only idle the GPU
    assert s.wait_iters == 0
    assert s.defer(1, 2, 3) and s.wait_iters == 1
