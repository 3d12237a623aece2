"""Offline references (kvbench.oracle) against brute force and against the cache manager."""

from __future__ import annotations

from functools import lru_cache
from itertools import combinations
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from strategies import related_prompts
from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.policies import ADMISSIONS, POLICIES, POLICY_NAMES
from kvbench.oracle import RECOMPUTED, _Occurrences, reference_hit_rates
from kvbench.traffic import read_mooncake, trace_stats
from kvbench.traffic.request import Request

TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def req(i, tokens, namespace=None) -> Request:
    toks = np.array(tokens, dtype=np.int64)
    return Request(i, 0.0, len(toks), 1, tokens=toks, namespace=namespace)


def replay(requests, tpb, capacity, partial, copy=True, policy="lru", admission="all",
           alone=False) -> int:
    """Reused tokens of the cache manager in cache mode (`alone`: the policy's own order
    throughout, no duel with LRU's)."""
    params = POLICIES[policy][1](shadow_sampling=0) if alone and policy != "lru" else None
    m = KVCacheManager(CacheSpec(
        tokens_per_block=tpb, num_gpu_blocks=capacity, enable_block_reuse=True,
        enable_partial_reuse=partial, copy_on_partial_reuse=copy, eviction_policy=policy,
        policy_params=params, admission=admission))
    total = 0
    for r in requests:
        seq = m.add_sequence(r)
        assert m.resize(seq, r.input_length)
        m.commit(seq, r.input_length)
        m.release(seq)
        total += seq.reused_tokens
    return total


def lcp(a, b) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def brute_ideal(requests, tpb, partial) -> int:
    """Unlimited cache: the longest prefix shared with any earlier prompt of the same namespace,
    at most L - 1, in whole blocks without partial reuse."""
    total = 0
    for i, r in enumerate(requests):
        toks = r.prompt_tokens().tolist()
        best = max((lcp(toks, e.prompt_tokens().tolist()) for e in requests[:i]
                    if e.namespace == r.namespace), default=0)
        best = min(best, r.input_length - 1)
        total += best if partial else best // tpb * tpb
    return total


def brute_optimal(requests, tpb, capacity) -> int:
    """Exhaustive search over eviction choices (partial reuse off). The cache holds blocks by
    key; a request reuses its leading resident blocks (at most (L - 1) // tpb), allocates a
    block for everything else of its prompt, evicting as many resident blocks it does not reuse
    as it must, and afterwards its full blocks are resident."""
    keys_of = [tuple(r.block_keys(tpb)) for r in requests]
    caps = [(r.input_length - 1) // tpb for r in requests]
    nbs = [-(-r.input_length // tpb) for r in requests]

    @lru_cache(maxsize=None)
    def best(i: int, state: frozenset) -> int:
        if i == len(requests):
            return 0
        keys = keys_of[i]
        h = 0
        while h < caps[i] and keys[h] in state:
            h += 1
        excess = len(state) + nbs[i] - h - capacity
        evictable = sorted(state - set(keys[:h]))
        choices = combinations(evictable, excess) if excess > 0 else [()]
        return h * tpb + max(best(i + 1, (state - set(ev)) | set(keys)) for ev in choices)

    return best(0, frozenset())


@st.composite
def traces(draw, max_requests=10, max_len=12, namespaces=False):
    out = draw(related_prompts(max_requests, max_len))
    ns = [draw(st.sampled_from([None, "a"])) if namespaces else None for _ in out]
    return [req(i, p, n) for i, (p, n) in enumerate(zip(out, ns))]


SETTINGS = dict(deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])


@settings(max_examples=250, **SETTINGS)
@given(traces(max_requests=12, namespaces=True), st.integers(1, 4), st.integers(0, 4),
       st.booleans())
def test_order_hit_optimal_ideal(requests, tpb, extra, partial):
    capacity = max(-(-r.input_length // tpb) for r in requests) + extra
    refs = reference_hit_rates(requests, tpb, capacity, partial_reuse=partial)
    hit = replay(requests, tpb, capacity, partial)
    assert refs.prompt_tokens == sum(r.input_length for r in requests)
    assert refs.ideal_reused_tokens == brute_ideal(requests, tpb, partial)
    assert hit <= refs.ideal_reused_tokens
    assert refs.optimal_reused_tokens <= refs.ideal_reused_tokens
    if not partial:
        assert hit <= refs.optimal_reused_tokens
        # An unlimited cache without partial reuse is the ideal.
        big = sum(-(-r.input_length // tpb) for r in requests)
        assert replay(requests, tpb, big, partial) == refs.ideal_reused_tokens
    rates = (refs.ideal_hit_rate, refs.optimal_hit_rate)
    assert all(0 <= x <= 1 for x in rates)


@settings(max_examples=150, **SETTINGS)
@given(traces(max_requests=6, max_len=10, namespaces=True), st.integers(1, 3), st.data())
def test_optimal_is_exhaustive_optimum(requests, tpb, data):
    need = max(-(-r.input_length // tpb) for r in requests)
    capacity = data.draw(st.integers(max(3, need), max(5, need)))
    refs = reference_hit_rates(requests, tpb, capacity, partial_reuse=False)
    assert refs.optimal_reused_tokens == brute_optimal(requests, tpb, capacity)


@settings(max_examples=60, **SETTINGS)
@given(traces(max_requests=12, max_len=10, namespaces=True), st.integers(1, 3),
       st.integers(0, 3), st.sampled_from(POLICY_NAMES), st.sampled_from(ADMISSIONS),
       st.booleans())
def test_no_policy_beats_the_optimum(requests, tpb, extra, policy, admission, alone):
    # The optimum bounds every eviction order and admission, not only LRU's (partial reuse
    # off: with it the oracle is not a proven optimum); each policy alone, as a duel with
    # LRU keeps LRU's order on traces this short.
    capacity = max(-(-r.input_length // tpb) for r in requests) + extra
    refs = reference_hit_rates(requests, tpb, capacity, partial_reuse=False)
    hit = replay(requests, tpb, capacity, False, policy=policy, admission=admission,
                 alone=alone)
    assert hit <= refs.optimal_reused_tokens <= refs.ideal_reused_tokens


def test_optimal_evicts_a_block_stored_again_before_its_reuse():
    # Request 2 computes key [0] in any case (its only token is the one it must compute), so
    # the optimum evicts request 0's first block for request 1's two, keeps the orphaned rest,
    # and request 3 reuses all four once request 2 has stored [0] again. Farthest-next-use
    # alone sees [0] reused by request 3, with the rest, and keeps only three of them.
    rs = [req(0, [0] * 4), req(1, [0, 0], namespace="a"), req(2, [0]), req(3, [0] * 5),
          req(4, [0])]
    refs = reference_hit_rates(rs, 1, 5, partial_reuse=False)
    assert refs.optimal_reused_tokens == brute_optimal(rs, 1, 5) == 4


def test_a_policy_that_lets_a_recomputed_block_go_stays_under_the_optimum():
    # A one-token prompt computes its block in any case (its only token is the one it must
    # compute): SLRU's order reused 3 tokens here, more than farthest-next-use alone (2), which
    # kept such blocks for their later reuse.
    spec = [([0], None), ([0], None), ([0], None), ([1], "a"), ([1] + [0] * 9, "a"),
            ([0], "a"), ([1] + [0] * 9, None), ([0], None), ([0, 0], None),
            ([1] + [0] * 9, "a"), ([0], None)]
    rs = [req(i, t, n) for i, (t, n) in enumerate(spec)]
    refs = reference_hit_rates(rs, 1, 11, partial_reuse=False)
    assert replay(rs, 1, 11, False, policy="slru", alone=True) == 3
    assert refs.optimal_reused_tokens == brute_optimal(rs, 1, 11) == 3


@settings(max_examples=150, **SETTINGS)
@given(traces(max_requests=12, max_len=12), st.integers(1, 4))
def test_next_use_and_ideal_full_blocks_naive(requests, tpb):
    keys_of = [r.block_keys(tpb) for r in requests]
    caps = [(r.input_length - 1) // tpb for r in requests]
    occ = _Occurrences(keys_of, caps)
    got = occ.next_use_per_request()
    assert len(got) == len(requests)
    for i, keys in enumerate(keys_of):
        want_pos, want_use = [], []
        for j, k in enumerate(keys):
            for later in range(i + 1, len(requests)):
                if k in keys_of[later]:
                    want_pos.append(j)
                    want_use.append(later if keys_of[later].index(k) < caps[later]
                                    else RECOMPUTED)
                    break
        assert (list(got[i][0]), list(got[i][1])) == (want_pos, want_use), i
    seen: set = set()
    ideal = occ.ideal_full_blocks()
    for i, keys in enumerate(keys_of):
        h = 0
        while h < caps[i] and keys[h] in seen:
            h += 1
        assert ideal[i] == h, i
        seen.update(keys)


def test_hand_cases():
    tpb = 2
    a = [1, 2, 3, 4, 5]
    rs = [req(0, a), req(1, a), req(2, [1, 2, 3, 9]), req(3, [7])]
    full = reference_hit_rates(rs, tpb, None, partial_reuse=False)
    assert full.optimal_reused_tokens is None and full.optimal_hit_rate is None
    # 0, then 4 (all full blocks, L - 1 = 4), then 2, then 0.
    assert full.ideal_reused_tokens == 6 and full.prompt_tokens == 15
    part = reference_hit_rates(rs, tpb, None, partial_reuse=True)
    assert part.ideal_reused_tokens == 4 + 3  # request 2 shares [1, 2, 3]
    # Capacity 3 holds request 0's two full blocks plus its tail.
    opt = reference_hit_rates(rs, tpb, 3, partial_reuse=False)
    assert opt.optimal_reused_tokens == 6
    assert reference_hit_rates(rs, tpb, 3, partial_reuse=False, block_reuse=False) \
        .optimal_reused_tokens == 0
    empty = reference_hit_rates([], tpb, 3, partial_reuse=True)
    assert empty.ideal_hit_rate == 0 and empty.optimal_hit_rate == 0


@pytest.mark.parametrize("partial", [True, False])
def test_prompts_shorter_than_a_block(partial):
    rs = [req(i, [1, 2, 3]) for i in range(3)]
    refs = reference_hit_rates(rs, 4, 2, partial_reuse=partial)
    assert refs.ideal_reused_tokens == (4 if partial else 0)
    assert refs.optimal_reused_tokens <= refs.ideal_reused_tokens
    assert replay(rs, 4, 2, partial) == refs.ideal_reused_tokens


def test_belady_beats_lru_where_lru_thrashes():
    # Three prompts of one block each, cycled, in a 2-block cache (plus the tail slot):
    # LRU misses every time, farthest-next-use keeps one of them.
    tpb = 2
    base = [[1, 1], [2, 2], [3, 3]]
    rs = [req(i, base[i % 3] + [9]) for i in range(9)]
    capacity = 3  # 2 cached full blocks + 1 block for the tail being computed
    refs = reference_hit_rates(rs, tpb, capacity, partial_reuse=False)
    assert replay(rs, tpb, capacity, partial=False) == 0
    assert refs.optimal_reused_tokens == brute_optimal(rs, tpb, capacity) > 0


needs_trace = pytest.mark.skipif(not TRACE.exists(), reason="shared trace absent")


@pytest.fixture(scope="module")
def trace2000():
    return list(read_mooncake(TRACE, limit=2000))


@needs_trace
def test_trace_ideal_matches_trace_stats(trace2000):
    refs = reference_hit_rates(trace2000, 512, None, partial_reuse=False)
    stats = trace_stats(trace2000, block_sizes=(512,))
    assert refs.prompt_tokens == stats["prompt_tokens"]
    assert refs.ideal_hit_rate == stats["ideal_hit_rate"][512]
    assert 0 < refs.ideal_hit_rate < 1


@needs_trace
def test_trace_ideal_with_partial_reuse_brute_force(trace2000):
    # The first 120 requests at 64 tokens per block, against prefix lengths on the derived
    # tokens (numpy, not the oracle's slots).
    rs = trace2000[:120]
    tpb = 64
    toks = [r.prompt_tokens() for r in rs]
    want_full = want_part = 0
    for i, t in enumerate(toks):
        best = 0
        for e in toks[:i]:
            n = min(len(t), len(e))
            diff = np.flatnonzero(t[:n] != e[:n])
            best = max(best, int(diff[0]) if len(diff) else n)
        best = min(best, len(t) - 1)
        want_part += best
        want_full += best // tpb * tpb
    assert reference_hit_rates(rs, tpb, None, partial_reuse=True).ideal_reused_tokens == want_part
    assert reference_hit_rates(rs, tpb, None, partial_reuse=False).ideal_reused_tokens == want_full
