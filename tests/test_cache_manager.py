"""KVCacheManager in cache mode: exact ids and eviction order on hand-built cases, a brute-force
reference of DESIGN.md section 3 on random traces, and invariants under interleaved sequences."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cache.ids import CopyKind, CopyOp, Tier
from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.traffic.request import Request
from strategies import related_prompts

_ids = iter(range(1 << 30))


def req(tokens, namespace=None, priority=35) -> Request:
    toks = np.array(tokens, dtype=np.int64)
    return Request(next(_ids), 0.0, len(toks), 1, tokens=toks, namespace=namespace,
                   priority=priority)


def trace_req(hash_ids, input_length, block=4, namespace=None) -> Request:
    return Request(next(_ids), 0.0, input_length, 1, hash_ids=np.array(hash_ids, dtype=np.int64),
                   trace_block_tokens=block, namespace=namespace)


def mgr(tpb=2, blocks=4, reuse=True, partial=True, copy=True, emit=False) -> KVCacheManager:
    m = KVCacheManager(CacheSpec(
        tokens_per_block=tpb, num_gpu_blocks=blocks, enable_block_reuse=reuse,
        enable_partial_reuse=partial, copy_on_partial_reuse=copy, emit_copy_ops=emit))
    m.enable_sanity_tracking()
    return m


def run(m: KVCacheManager, r: Request):
    """One request in cache mode; returns the sequence (released) for inspection."""
    seq = m.add_sequence(r)
    assert m._check_sanity()
    assert m.resize(seq, r.input_length)
    assert m._check_sanity()
    m.commit(seq, r.input_length)
    assert m._check_sanity()
    blocks = list(seq.blocks)
    m.release(seq)
    assert m._check_sanity()
    seq.blocks = blocks  # keep the ids for the test's assertions
    return seq


def reuse_of(m, tokens, **kw) -> int:
    return run(m, req(tokens, **kw)).reused_tokens


# --- hand-built cases: exact ids and eviction order -----------------------------------------


def test_empty_blocks_first_lowest_ids_first():
    m = mgr(partial=False)
    a = run(m, req([1, 2, 3, 4, 5]))
    assert a.blocks == [0, 1, 2]
    assert a.reused_tokens == 0
    # Full blocks stay cached (the deeper one first in line), the tail is freed.
    assert m.gpu.free_queue.order() == [1, 0]
    assert m.gpu.num_cached == 2 and len(m.gpu.empty) == 2 and m.gpu.num_in_use == 0
    # Two empty blocks are left: a 2-block request evicts nothing.
    b = run(m, req([7, 7, 7]))
    assert sorted(b.blocks) == [2, 3]
    assert m.evicted_blocks == 0
    assert m.gpu.free_queue.order() == [1, 0, 2]


def test_lru_cached_blocks_after_empty_ones_deeper_first():
    m = mgr(partial=False)
    run(m, req([1, 2, 3, 4, 5]))  # blocks 0 (1,2) and 1 (3,4) cached, 2 freed
    b = run(m, req([7, 7, 7, 7, 7]))  # 3 blocks: the 2 empty ones, then evict A's deeper block
    assert sorted(b.blocks[:2]) == [2, 3]
    assert b.blocks[2] == 1
    assert m.evicted_blocks == 1
    assert reuse_of(m, [1, 2, 3, 4, 9]) == 2  # only A's first block is left
    assert m.evicted_blocks == 2  # that request needed 3 blocks with 1 empty: 2 evictions


def test_eviction_takes_whole_request_deepest_first():
    m = mgr(tpb=1, blocks=4, partial=False)
    run(m, req([1, 2, 3, 9]))  # blocks 0,1,2 hold 1 / 12 / 123, block 3 the tail
    assert m.gpu.free_queue.order() == [3, 2, 1, 0]  # tpb=1: the last block is full too
    run(m, req([5, 5]))  # 2 blocks, none empty: evict 3 then 2
    assert m.evicted_blocks == 2
    assert reuse_of(m, [1, 2, 3, 8]) == 2
    assert reuse_of(m, [1, 2, 3, 8]) == 3


def test_rematched_block_moves_to_back():
    m = mgr(partial=False)
    a = run(m, req([1, 2, 9]))  # block 0 cached
    b = run(m, req([3, 4, 9]))
    order = m.gpu.free_queue.order()
    assert order == [a.blocks[0], b.blocks[0]]
    c = run(m, req([1, 2, 8]))  # matches A's block again: it moves behind B's
    assert c.reused_tokens == 2 and c.blocks[0] == a.blocks[0]
    assert m.gpu.free_queue.order() == [b.blocks[0], a.blocks[0]]
    run(m, req([5, 6, 7, 8, 9]))  # 3 blocks, 2 empty: evicts B's block, not A's
    assert m.evicted_blocks == 1
    assert reuse_of(m, [1, 2, 5]) == 2
    assert reuse_of(m, [3, 4, 5]) == 0


def test_lower_priority_evicted_first():
    m = mgr(tpb=1, blocks=3, partial=False)
    a = run(m, req([1, 9], priority=80))
    assert a.blocks == [0, 1]
    assert m.gpu.free_queue.order() == [1, 0]
    b = run(m, req([2, 9], priority=10))  # the empty block 2, then A's deeper block
    assert b.blocks == [2, 1] and m.evicted_blocks == 1
    # B's blocks are newer but at level 10: they go before A's block at level 80.
    assert m.gpu.free_queue.order() == [1, 2, 0]
    c = run(m, req([3, 9], priority=80))
    assert c.blocks == [1, 2] and m.evicted_blocks == 3
    assert m.gpu.free_queue.order() == [0, 2, 1]
    assert reuse_of(m, [1, 5], priority=80) == 1  # A's first block outlived B's


def test_partial_reuse_claims_free_childless_block():
    m = mgr(tpb=4, blocks=4)
    a = run(m, req([1, 2, 3]))  # 1 block, kept as a partial block of 3 tokens
    assert m.gpu.free_queue.order() == [a.blocks[0]]
    b = run(m, req([1, 2, 5, 6, 7]))
    assert b.reused_tokens == 2 and b.partial_tokens == 2
    assert b.blocks[0] == a.blocks[0]  # claimed, not copied
    assert not b.partial_copied and m.partial_copy_blocks == 0
    assert m.evicted_blocks == 0
    # A's 3-token block was overwritten by B: [1, 2, 3, x] now matches only 2 tokens.
    assert reuse_of(m, [1, 2, 3, 4, 5]) == 2


def test_partial_reuse_copies_block_with_children():
    m = mgr(tpb=4, blocks=4, emit=True)
    a = run(m, req([1, 2, 3, 4, 5, 6]))  # block 0 full, block 1 a partial child
    c = run(m, req([1, 2, 3, 9, 9]))
    assert c.reused_tokens == 3 and c.partial_copied
    assert m.partial_copy_blocks == 1
    assert c.blocks[0] not in a.blocks
    assert m.copy_ops == [CopyOp(CopyKind.PARTIAL, Tier.GPU, a.blocks[0], Tier.GPU, c.blocks[0], 3)]
    # The source and its child survive.
    assert reuse_of(m, [1, 2, 3, 4, 5, 6, 7]) == 6


def test_partial_reuse_gives_up_without_copy():
    m = mgr(tpb=4, blocks=4, copy=False)
    run(m, req([1, 2, 3, 4, 5, 6]))
    c = run(m, req([1, 2, 3, 9, 9]))
    assert c.reused_tokens == 0 and not c.partial_copied
    assert m.partial_copy_blocks == 0
    # ... but a childless block is still claimed without a copy.
    assert reuse_of(m, [1, 2, 3, 4, 5, 9, 9]) == 5


def test_partial_reuse_prefers_block_it_can_take_without_copy():
    for copy in (True, False):
        m = mgr(tpb=4, blocks=6, copy=copy)
        a = run(m, req([1, 2, 3, 4, 5]))  # full [1 2 3 4] with a partial child [5]
        b = run(m, req([1, 2, 3]))  # 2 tokens of A's block: a copy, or nothing without copy
        assert b.reused_tokens == (2 if copy else 0)
        # Both A's full block (stored first, has a child) and B's tail [1 2 3] match 2 tokens
        # of [1 2 9 9]: the tail is taken, no copy needed.
        copies = m.partial_copy_blocks
        c = run(m, req([1, 2, 9, 9, 9]))
        assert c.reused_tokens == 2 and not c.partial_copied
        assert m.partial_copy_blocks == copies
        assert c.blocks[0] == b.blocks[0] and c.blocks[0] != a.blocks[0]
        run(m, req([1, 7]))  # leaves a claimable tail [1 7]
        # A longer match that needs a copy (A's block, 3 tokens) still wins over a shorter one
        # that does not ([1 7], 1 token): copied, or given up without copy.
        copies = m.partial_copy_blocks
        d = run(m, req([1, 2, 3, 8, 8]))
        assert d.reused_tokens == (3 if copy else 0)
        assert m.partial_copy_blocks == copies + copy


def test_refilled_partial_block_is_filed_once():
    # An identical prompt ending on a block boundary claims its own last block every time
    # (partial reuse of L - 1 tokens) and stores it again: it must not pile up in the index.
    m = mgr(tpb=2, blocks=4)
    r = [1, 2, 3, 4]
    run(m, req(r))
    for _ in range(20):
        s = run(m, req(r))
        assert s.reused_tokens == 3 and not s.partial_copied
    parent = req(r).block_keys(2)[0]
    assert m.index._kids_of(parent, 3) == [s.blocks[1]]


def test_partial_reuse_copies_block_in_use():
    m = mgr(tpb=4, blocks=4, emit=True)
    a = m.add_sequence(req([1, 2, 3, 4, 5]))
    assert m.resize(a, 5)
    m.commit(a, 5)  # block 0 full and stored, still held by A
    b = m.add_sequence(req([1, 2, 3, 7, 7]))
    assert m._check_sanity()
    assert b.reused_tokens == 3 and b.partial_copied
    assert b.blocks[0] != a.blocks[0]
    assert m.copy_ops[-1] == CopyOp(CopyKind.PARTIAL, Tier.GPU, a.blocks[0], Tier.GPU, b.blocks[0], 3)
    assert m.ref_count[a.blocks[0]] == 1
    m.release(a)
    m.release(b)
    assert m._check_sanity()


def test_partial_reuse_gives_up_on_block_in_use_without_copy():
    m = mgr(tpb=4, blocks=4, copy=False)
    a = m.add_sequence(req([1, 2, 3, 4, 5]))
    assert m.resize(a, 5)
    m.commit(a, 5)
    b = m.add_sequence(req([1, 2, 3, 7, 7]))
    assert b.reused_tokens == 0 and b.blocks == []
    assert m.estimate_reuse(req([1, 2, 3, 7, 7])) == 0


@pytest.mark.parametrize("tpb", [1, 2, 3, 4])
@pytest.mark.parametrize("length", [1, 2, 3, 4, 5, 8, 9])
def test_last_token_always_computed(tpb, length):
    tokens = list(range(10, 10 + length))
    for partial in (True, False):
        m = mgr(tpb=tpb, blocks=-(-length // tpb) + 1, partial=partial)
        run(m, req(tokens))
        s = run(m, req(tokens))
        expect = length - 1 if partial else (length - 1) // tpb * tpb
        assert s.reused_tokens == expect, (tpb, length, partial)
        # A second identical replay reuses the same amount (the cache still holds the prompt).
        assert reuse_of(m, tokens) == expect


def test_namespaces_never_share_blocks():
    m = mgr(tpb=2, blocks=12)
    run(m, req([1, 2, 3, 4, 5], namespace="a"))
    assert reuse_of(m, [1, 2, 3, 4, 5]) == 0
    assert reuse_of(m, [1, 2, 3, 4, 5], namespace="b") == 0
    assert reuse_of(m, [1, 2, 3, 7], namespace="a") == 3
    assert reuse_of(m, [1, 2, 3, 7], namespace=7) == 0
    assert reuse_of(m, [1, 2, 3, 7]) == 3  # the unsalted run of the same tokens


def test_namespaces_trace_requests():
    m = mgr(tpb=4, blocks=12)
    run(m, trace_req([1, 2, 3], 10, namespace="x"))
    assert run(m, trace_req([1, 2, 4], 12)).reused_tokens == 0
    assert run(m, trace_req([1, 2, 4], 12, namespace="x")).reused_tokens == 8
    assert run(m, trace_req([1, 2, 4], 12)).reused_tokens == 11


def test_block_reuse_off_reuses_nothing():
    m = mgr(tpb=2, blocks=4, reuse=False)
    for _ in range(3):
        s = run(m, req([1, 2, 3, 4, 5]))
        assert s.reused_tokens == 0
    assert m.evicted_blocks == 0 and m.gpu.num_cached == 0 and not m.index.by_key
    assert m.estimate_reuse(req([1, 2, 3, 4, 5])) == 0


def test_capacity_failure_allocates_nothing():
    m = mgr(tpb=2, blocks=4, partial=False)
    run(m, req([1, 2, 3, 4]))  # two cached blocks
    a = m.add_sequence(req([5, 6, 7]))
    assert m.resize(a, 3)  # both empty blocks
    b = m.add_sequence(req([8, 8, 8, 8, 8]))
    before = (list(m.gpu.empty), m.gpu.free_queue.order(), m.evicted_blocks,
              m.allocated_blocks, list(m.ref_count))
    assert not m.resize(b, 5)  # needs 3, only 2 cached blocks are free
    assert b.blocks == [] and b.num_tokens == 0
    after = (list(m.gpu.empty), m.gpu.free_queue.order(), m.evicted_blocks,
             m.allocated_blocks, list(m.ref_count))
    assert before == after
    assert m._check_sanity()
    assert m.resize(b, 4)  # 2 blocks fit, by evicting both cached ones
    assert m.evicted_blocks == 2
    with pytest.raises(ValueError):
        m.resize(b, 3)
    m.release(b)
    m.release(a)
    assert m._check_sanity()
    assert m.gpu.num_in_use == 0


# --- brute-force reference -------------------------------------------------------------------


class RefCache:
    """DESIGN.md section 3, cache mode, done the slow obvious way.

    A block is either empty (`data is None`) or holds `(namespace, prefix tokens)`: the whole
    prompt prefix through its last token (a full block holds a multiple of tpb tokens, a kept
    tail fewer). LRU is a global clock stamp per block; a released request stamps its blocks
    deepest first. Candidates for a partial match are found by scanning every stored block."""

    def __init__(self, tpb, n, reuse=True, partial=True, copy=True):
        self.tpb, self.n = tpb, n
        self.reuse, self.partial, self.copy = reuse, partial, copy
        self.data = [None] * n
        self.stamp = [0] * n
        self.stored_at = [0] * n
        self.clock = 0
        self.evicted = 0
        self.copies = 0

    def _tick(self):
        self.clock += 1
        return self.clock

    def _stored(self, busy=()):
        return [b for b in range(self.n) if self.data[b] is not None and b not in busy]

    def _take(self, k, busy):
        out = []
        for _ in range(k):
            empty = [b for b in range(self.n)
                     if self.data[b] is None and b not in busy and b not in out]
            if empty:
                out.append(empty[0])
                continue
            victim = min((b for b in self._stored(busy) if b not in out),
                         key=lambda b: self.stamp[b])
            self.data[victim] = None
            self.evicted += 1
            out.append(victim)
        return out

    def _has_children(self, b):
        ns, p = self.data[b]
        if len(p) % self.tpb:
            return False
        return any(self.data[x][0] == ns and len(p) < len(self.data[x][1]) <= len(p) + self.tpb
                   and self.data[x][1][:len(p)] == p for x in self._stored())

    def process(self, r: Request) -> int:
        tpb = self.tpb
        ns = r.namespace
        toks = tuple(r.prompt_tokens().tolist())
        L = len(toks)
        nb = -(-L // tpb)
        if not self.reuse:
            self._take(nb, set())
            return 0
        blocks = []
        while (len(blocks) + 1) * tpb <= L - 1:
            want = (ns, toks[:(len(blocks) + 1) * tpb])
            hit = [b for b in self._stored() if self.data[b] == want]
            if not hit:
                break
            assert len(hit) == 1
            blocks.append(hit[0])
        m = len(blocks)
        reused = m * tpb
        busy = set(blocks)
        limit = min(tpb, L - 1 - m * tpb)
        if self.partial and limit > 0:
            base = toks[:m * tpb]
            ours = toks[m * tpb:m * tpb + limit]
            cands = []
            for b in self._stored(busy):
                bns, p = self.data[b]
                if bns != ns or not (m * tpb < len(p) <= (m + 1) * tpb) or p[:m * tpb] != base:
                    continue
                common = 0
                for x, y in zip(p[m * tpb:], ours):
                    if x != y:
                        break
                    common += 1
                if common:
                    # Longest match first; among equals one taken without a copy, then the
                    # earliest stored.
                    cands.append((-common, self._has_children(b), self.stored_at[b], b))
            if cands:
                neg, _, _, src = min(cands)
                if not self._has_children(src):
                    self.data[src] = None
                    blocks.append(src)
                    reused -= neg
                elif self.copy:
                    dst = self._take(1, busy | {src})
                    self.stamp[src] = self._tick()  # the copy reads it: used now
                    self.copies += 1
                    blocks += dst
                    reused -= neg
        busy = set(blocks)
        blocks += self._take(nb - len(blocks), busy)
        for j in range(m, L // tpb):
            want = (ns, toks[:(j + 1) * tpb])
            if not any(self.data[b] == want for b in self._stored()):
                self.data[blocks[j]] = want
                self.stored_at[blocks[j]] = self._tick()
        if self.partial and L % tpb:
            self.data[blocks[-1]] = (ns, toks)
            self.stored_at[blocks[-1]] = self._tick()
        for b in reversed(blocks):
            if self.data[b] is not None:
                self.stamp[b] = self._tick()
        return reused


def prompts(max_requests=14, max_len=14):
    return related_prompts(max_requests, max_len)


def as_trace_requests(token_prompts, block):
    """Trace-style requests with the same prefix structure: one id per distinct trace block
    (prefix through that block), so ids are prefix-chained."""
    ids: dict[tuple, int] = {}
    out = []
    for p in token_prompts:
        h = [ids.setdefault(tuple(p[:min(e + block, len(p))]), len(ids))
             for e in range(0, len(p), block)]
        out.append(trace_req(h, len(p), block=block))
    return out


@st.composite
def scenarios(draw):
    ps = draw(prompts())
    tpb = draw(st.integers(1, 4))
    need = max(-(-len(p) // tpb) for p in ps)
    blocks = need + draw(st.sampled_from([0, 0, 1, 2, 3, 5, 40]))
    reuse = draw(st.integers(0, 9)) > 0
    partial = draw(st.booleans())
    copy = draw(st.booleans())
    style = draw(st.sampled_from(["tokens", "tokens", "ns", "trace"]))
    if style == "trace":
        requests = as_trace_requests(ps, draw(st.integers(1, 4)))
    elif style == "ns":
        requests = [req(p, namespace=draw(st.sampled_from([None, "a", "b"]))) for p in ps]
    else:
        requests = [req(p) for p in ps]
    return requests, tpb, blocks, reuse, partial, copy


@settings(max_examples=600, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenarios())
def test_manager_matches_reference(scenario):
    requests, tpb, blocks, reuse, partial, copy = scenario
    m = mgr(tpb, blocks, reuse, partial, copy)
    ref = RefCache(tpb, blocks, reuse, partial, copy)
    for i, r in enumerate(requests):
        estimate = m.estimate_reuse(r)
        got = run(m, r).reused_tokens
        assert estimate == got, f"request {i}: estimate_reuse"
        want = ref.process(r)
        assert got == want, f"request {i}: manager reused {got}, reference {want}"
        assert m.evicted_blocks == ref.evicted, f"request {i}: evictions"
        assert m.partial_copy_blocks == ref.copies, f"request {i}: partial copies"
        assert m.gpu.num_cached == sum(d is not None for d in ref.data)


# --- invariants under interleaved sequences --------------------------------------------------


class DataCheckingDriver:
    """Drives a manager with several live sequences and checks that every reused block holds
    the data it claims: `data[b]` is (namespace, prefix tokens) as last written by a commit."""

    def __init__(self, m: KVCacheManager):
        self.m = m
        self.data: dict[int, tuple | None] = {}
        self.live: list = []

    def held(self, exclude=None):
        out = set()
        for s in self.live:
            if s is not exclude:
                out.update(s.blocks)
        return out

    def add(self, r: Request):
        m, tpb = self.m, self.m.tpb
        held_before = self.held()
        n_ops = len(m.copy_ops)
        seq = m.add_sequence(r)
        assert m._check_sanity()
        toks = tuple(r.prompt_tokens().tolist())
        k = seq.reused_full_blocks
        assert len(seq.blocks) == k + (1 if seq.partial_tokens else 0)
        assert seq.reused_tokens == k * tpb + seq.partial_tokens <= max(r.input_length - 1, 0)
        for j, b in enumerate(seq.blocks[:k]):
            assert self.data.get(b) == (r.namespace, toks[:(j + 1) * tpb]), "wrong full block"
        if seq.partial_tokens:
            end = k * tpb + seq.partial_tokens
            b = seq.blocks[k]
            if seq.partial_copied:
                (op,) = m.copy_ops[n_ops:]
                assert op.dst == b and op.num_tokens == seq.partial_tokens
                assert b not in held_before, "copy target is in use"
                src = self.data.get(op.src)
                self.data[b] = (src[0], src[1][:end])
            else:
                assert b not in held_before, "claimed a block another sequence holds"
                assert m.ref_count[b] == 1
            ns, p = self.data.get(b)
            assert ns == r.namespace and p[:end] == toks[:end], "wrong partial block"
        else:
            assert len(m.copy_ops) == n_ops
        self.live.append(seq)
        return seq

    def resize(self, seq, n):
        m = self.m
        old = list(seq.blocks)
        others = self.held(exclude=seq)
        counts = (m.allocated_blocks, m.evicted_blocks, m.gpu.num_in_use)
        ok = m.resize(seq, n)
        assert m._check_sanity()
        if not ok:
            assert seq.blocks == old
            assert counts == (m.allocated_blocks, m.evicted_blocks, m.gpu.num_in_use)
            return False
        new = seq.blocks[len(old):]
        assert seq.blocks[:len(old)] == old
        assert len(set(new)) == len(new) and not set(new) & (others | set(old)), \
            "a block in use was handed out again"
        for b in new:
            self.data[b] = None  # whatever it held is garbage now
        return True

    def commit(self, seq):
        m, tpb = self.m, self.m.tpb
        r = seq.request
        toks = tuple(r.prompt_tokens().tolist())
        n = r.input_length
        m.commit(seq, n)
        assert m._check_sanity()
        for j, b in enumerate(seq.blocks):
            end = min((j + 1) * tpb, n)
            if end > seq.reused_tokens:  # the sequence writes into this block
                assert m.ref_count[b] == 1, "a sequence writes into a shared block"
                self.data[b] = (r.namespace, toks[:end])

    def release(self, seq):
        self.live.remove(seq)
        self.m.release(seq)
        assert self.m._check_sanity()


@st.composite
def interleavings(draw):
    ps = draw(prompts(max_requests=10, max_len=12))
    tpb = draw(st.integers(1, 4))
    blocks = draw(st.integers(1, 12))
    partial = draw(st.booleans())
    copy = draw(st.booleans())
    ns = draw(st.booleans())
    requests = [req(p, namespace=draw(st.sampled_from([None, "a"])) if ns else None) for p in ps]
    # Each request: added at its turn; the order of later steps comes from a list of picks.
    picks = draw(st.lists(st.integers(0, 7), min_size=3 * len(ps), max_size=3 * len(ps)))
    return requests, tpb, blocks, partial, copy, picks


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(interleavings())
def test_invariants_with_interleaved_sequences(case):
    requests, tpb, blocks, partial, copy, picks = case
    m = mgr(tpb, blocks, True, partial, copy, emit=True)
    d = DataCheckingDriver(m)
    state = {}  # seq -> "added" | "sized" | "done"
    pending = list(requests)
    picks = list(picks)
    while pending or state:
        choice = picks.pop() if picks else 0
        if pending and (not state or choice < 3):
            seq = d.add(pending.pop(0))
            state[seq] = "added"
            continue
        seq = list(state)[choice % len(state)]
        step = state[seq]
        if step == "added":
            if d.resize(seq, seq.request.input_length):
                state[seq] = "sized"
            else:
                d.release(seq)  # could not get blocks: give up on it
                del state[seq]
        elif step == "sized":
            d.commit(seq)
            state[seq] = "done"
        else:
            d.release(seq)
            del state[seq]
        total = m.gpu.capacity
        assert len(m.gpu.empty) + m.gpu.num_cached + m.gpu.num_in_use == total
    assert m.gpu.num_in_use == 0 and all(r == 0 for r in m.ref_count)
