"""Eviction policies and admission: each policy against a brute-force reference on small
random traces (the same victims in the same order), invariants after every operation with
every policy, and LRU untouched by the policy machinery."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.policies import (POLICIES, POLICY_NAMES, GDSFParams, LRU2Params,
                                    PredictiveParams, S3FIFOParams, SLRUParams)
from kvbench.cache.policies import base as policy_base
from kvbench.cache.ids import Retention, TokenRangeRetention
from kvbench.cache.policies import gdsf as gdsf_policy
from kvbench.cache.policies import segment_duel, shadows
from kvbench.cache.policies.predictive import _Shadow
from kvbench.cache.policies.segments import GhostKeys, S3FIFOPolicy, SLRUPolicy, spread_key
from kvbench.traffic.request import Request
from strategies import related_prompts
from test_cache_manager import DataCheckingDriver, interleavings

_ids = iter(range(1 << 30))


def req(tokens, priority=35) -> Request:
    toks = np.array(tokens, dtype=np.int64)
    return Request(next(_ids), 0.0, len(toks), 1, tokens=toks, priority=priority)


# --- brute-force references: every decision by a scan over all blocks ------------------------


class _Ref:
    """Free blocks and their state in plain dicts; `victim` scans them all. `key(b)` is the
    block's data (prefix tokens): equal data, equal key."""

    def __init__(self, capacity, key):
        self.capacity = capacity
        self.key = key
        self.free: dict[int, dict] = {}  # block -> state while free
        self.pushed = 0

    def _push(self, b, level, **state):
        self.pushed += 1
        self.free[b] = dict(level=level, pushed=self.pushed, **state)

    def claim(self, b):
        del self.free[b]

    @staticmethod
    def _prune(hist, clock, cap):
        if len(hist) > 2 * cap:
            for k in [k for k, v in hist.items() if v[0] < clock - cap]:
                del hist[k]


class _RefDuel:
    """The duel's choice by its definition: both shadows' hits of each prompt at its match
    counted in a window halved every `period` ticks and in one halved every `LONG_WINDOW`
    periods, with the sum of each prompt's squared difference (quartered at each halving);
    LRU's order first, the own order once it leads by `ENTRY_MARGIN` times the root of that
    sum in both, LRU's again once LRU's count is higher in either."""

    def __init__(self, period):
        self.periods = [period, shadows.LONG_WINDOW * period]
        self.halve_at = list(self.periods)
        self.counts = [[0, 0, 0], [0, 0, 0]]
        self.own = False

    def count(self, lru, own):
        self.counts = [[a + lru, b + own, s + (lru - own) ** 2] for a, b, s in self.counts]

    def choose(self, clock):
        for i, period in enumerate(self.periods):
            while clock >= self.halve_at[i]:
                a, b, s = self.counts[i]
                self.counts[i] = [a // 2, b // 2, s // 4]
                self.halve_at[i] += period
        if self.own:
            self.own = all(own >= lru for lru, own, _ in self.counts)
        else:
            self.own = all(own - lru > shadows.ENTRY_MARGIN * s ** 0.5
                           for lru, own, s in self.counts)
        return self.own


class RefScored(_Ref):
    """Predictive and GDSF: victim = min (level, score, class, push order)."""

    def __init__(self, capacity, key, name, params, tpb):
        super().__init__(capacity, key)
        self.name, self.p = name, params
        self.hist: dict = {}  # key -> (clock, class)
        self.hcap = max(1, int(params.history_ratio * capacity))
        self.clock = 0
        top = params.max_class if name == "predictive" else params.max_freq
        self.top = top
        self.uses = [0] * (top + 1)
        self.reuses = [0] * (top + 1)
        self.shift = [0] * (top + 1)
        self.L = 0
        if name == "predictive":
            self.horizon = int(params.horizon_ratio * capacity)
            self.sampling, self.scap = _shadow_size(capacity, params.shadow_sampling, tpb)
            # LRU order and the boosted one: key -> (stamp, class, order)
            self.shadows = [{}, {}]
            self.s_order = 0
            self.duel = _RefDuel(self.hcap)
            self.boosting = not self.sampling
            self.bkey = None
        else:
            self.w = int(params.freq_weight * 1024)
            self.sampling, self.scap = _shadow_size(capacity, params.shadow_sampling, tpb)
            self.s_lru: list = []  # LRU shadow, least recent first
            self.s_gdsf: dict = {}  # key -> (H, class, insertion order)
            self.s_L = self.s_order = 0
            self.duel = _RefDuel(self.hcap)
            self.boosting = not self.sampling  # GDSF order (False: LRU)
            self.bkey = None

    def release(self, blocks, level):
        stamp = self.clock if self.name == "predictive" else self.L
        self.pushes = getattr(self, "pushes", 0) + 1
        classes = []
        for b in reversed(blocks):
            self.clock += 1
            k = self.key(b)
            cls = 1
            if k in self.hist:
                t, was = self.hist[k]
                if self.name == "predictive" and self.clock - t <= self.horizon:
                    self.reuses[was] += 1
                cls = min(was + 1, self.top)
            self.hist[k] = (self.clock, cls)
            self.uses[cls] += 1
            classes.append(min([cls] + classes[-1:]))  # never above the parent
        self._prune(self.hist, self.clock, self.hcap)
        if self.name == "predictive":
            p, best, full = self.p, 0.0, [0.0] * (self.top + 1)
            for c in range(1, self.top + 1):
                chance = (self.reuses[c] + p.prior * p.prior_weight) / (self.uses[c]
                                                                         + p.prior_weight)
                best = full[c] = max(best, p.boost * self.horizon * chance)
            if self.sampling:
                self._shadows(blocks, list(reversed(classes)), stamp, full)
            self.shift = [int(f) if self.boosting else 0 for f in full]
        elif self.sampling:
            self._gdsf_shadows(blocks, list(reversed(classes)))
        for b, c in zip(blocks, reversed(classes)):
            self._push(b, level, cls=c, stamp=stamp, release=self.pushes)

    def _gdsf_shadows(self, blocks, classes):
        """GDSF's duel: an LRU list and a GDSF dict of the sampled keys (deepest first); the
        GDSF one evicts the lowest (H = its own L + w x class, class, insertion order) while
        over capacity, L the H of its last victim; the order as `_RefDuel` chooses it."""
        sampled = [(self.key(b), c) for b, c in zip(blocks, classes)
                   if self.bkey(self.key(b)) % 65521 % self.sampling == 0]
        shadow = self.s_gdsf
        for k, c in sampled:
            if k in self.s_lru:
                self.s_lru.remove(k)
            self.s_lru.append(k)
            self.s_order += 1
            shadow[k] = (self.s_L + self.w * c, c, self.s_order)
        del self.s_lru[:max(0, len(self.s_lru) - self.scap)]
        while len(shadow) > self.scap:
            k = min(shadow, key=shadow.__getitem__)
            self.s_L = max(self.s_L, shadow.pop(k)[0])
        self.boosting = self.duel.choose(self.clock)

    def _shadows(self, blocks, classes, stamp, full):
        """The LRU and the boosted shadow: sampled keys inserted deepest first, then the
        lowest (stamp + shift, class, insertion order) evicted while over capacity, the shift
        0 in the LRU one; the boost applies when `_RefDuel` chooses it."""
        sampled = [(self.key(b), c) for b, c in zip(blocks, classes)
                   if self.bkey(self.key(b)) % 65521 % self.sampling == 0]
        for share, shadow in zip((0, 1), self.shadows):
            for k, c in sampled:
                self.s_order += 1
                shadow[k] = (stamp, c, self.s_order)
            shift = [int(share * f) for f in full]
            while len(shadow) > self.scap:
                del shadow[min(shadow, key=lambda k: (shadow[k][0] + shift[shadow[k][1]],
                                                      shadow[k][1], shadow[k][2]))]
        self.boosting = self.duel.choose(self.clock)

    def judge(self, prompt):
        """Count the sampled blocks of a `prompt` being matched (its data, deepest first)
        that each shadow holds."""
        lru, own = (self.shadows if self.name == "predictive" else (self.s_lru, self.s_gdsf))
        sampled = [d for d in prompt if self.bkey(d) % 65521 % self.sampling == 0]
        self.duel.count(sum(d in lru for d in sampled), sum(d in own for d in sampled))

    def score(self, s):
        if self.name == "predictive":
            return s["stamp"] + self.shift[s["cls"]]
        return s["stamp"] + self.w * s["cls"]

    def victim(self):
        def order(s):  # gdsf in LRU order: release order, the deeper (pushed first) first
            lru = not self.boosting and self.name == "gdsf"
            return (s["level"], s["release"] if lru else self.score(s), s["cls"], s["pushed"])
        b = min(self.free, key=lambda b: order(self.free[b]))
        if self.name == "gdsf":
            self.L = max(self.L, self.score(self.free[b]))
        del self.free[b]
        return b


class RefSegments(_Ref):
    """SLRU and S3-FIFO: `seg` 0 (probation / small) or 1 (protected / main)."""

    def __init__(self, capacity, key, name, params, tpb):
        super().__init__(capacity, key)
        self.name, self.p = name, params
        self.hist: dict = {}  # key -> (clock,)
        self.hcap = max(1, int(params.history_ratio * capacity))
        self.clock = 0
        self.seg: dict[int, int] = {}  # block -> segment of its current data
        self.freq: dict[int, int] = {}
        self.hit: set[int] = set()

    def claim(self, b):
        super().claim(b)
        self.hit.add(b)

    def new_data(self, b):
        self.seg.pop(b, None)
        self.freq.pop(b, None)
        self.hit.discard(b)

    def _ghost(self, k):
        self.clock += 1
        self.hist[k] = (self.clock,)
        self._prune(self.hist, self.clock, self.hcap)

    def release(self, blocks, level):
        if self.name == "slru":
            segs = {}
            for b in reversed(blocks):
                self.clock += 1
                k = self.key(b)
                if b not in self.seg:
                    segs[b] = int(k in self.hist)
                else:
                    segs[b] = int(b in self.hit or self.seg[b] == 1)
                self.hit.discard(b)
                self.hist[k] = (self.clock,)
            self._prune(self.hist, self.clock, self.hcap)
            for b in blocks:
                self.seg[b] = segs[b]
                self._push(b, level)
            cap = int(self.p.protected_ratio * self.capacity)
            while sum(1 for b in self.free if self.seg[b] == 1) > cap:
                b = self._first(1)
                self.seg[b] = 0
                self._push(b, self.free[b]["level"])
            return
        for b in blocks:
            if b not in self.seg:
                self.freq[b] = 0
                self.seg[b] = int(self.key(b) in self.hist)
            elif b in self.hit:
                self.hit.discard(b)
                self.freq[b] = min(self.freq[b] + 1, self.p.max_freq)
            self._push(b, level)

    def _first(self, seg):
        cands = [b for b in self.free if self.seg[b] == seg]
        return min(cands, key=lambda b: (self.free[b]["level"], self.free[b]["pushed"]))

    def _lowest(self, seg):
        return min((s["level"] for b, s in self.free.items() if self.seg[b] == seg),
                   default=1000)

    def victim(self):
        while True:
            lf, ls = self._lowest(0), self._lowest(1)
            if self.name == "slru":
                b = self._first(0 if lf <= ls else 1)
                break
            small = sum(1 for b in self.free if self.seg[b] == 0)
            target = max(1, int(self.p.small_ratio * self.capacity))
            if lf < ls or (lf == ls and small > target):
                b = self._first(0)
                if self.freq[b]:
                    self.freq[b] = 0
                    self.seg[b] = 1
                    self._push(b, self.free[b]["level"])
                    continue
                self._ghost(self.key(b))
            else:
                b = self._first(1)
                if self.freq[b]:
                    self.freq[b] -= 1
                    self._push(b, self.free[b]["level"])
                    continue
            break
        del self.free[b]
        self.seg.pop(b)
        self.freq.pop(b, None)
        return b


class RefLRU2(_Ref):
    """LRU-2: rank = the tick of the key's use before this release (0: none remembered),
    capped at the parent's; victim = min (level, rank, push order), or min (level, push
    order) while the LRU shadow held more sampled keys. The shadows: a list in LRU order and
    a dict of (rank, push order), each trimmed to the pool over the sampling rate after a
    release; `bkey(data)` is the block's key, which decides the sampling."""

    def __init__(self, capacity, key, name, params, tpb):
        super().__init__(capacity, key)
        self.hist: dict = {}  # key -> (tick of its last use,)
        self.hcap = max(1, int(params.history_ratio * capacity))
        self.clock = 0
        self.sampling, self.scap = _shadow_size(capacity, params.shadow_sampling, tpb)
        self.s_lru: list = []
        self.s_lru2: dict = {}
        self.s_order = 0
        self.duel = _RefDuel(self.hcap)
        self.use_lru2 = not self.sampling
        self.bkey = None

    def release(self, blocks, level):
        ranks = []
        for b in reversed(blocks):  # shallowest first
            self.clock += 1
            k = self.key(b)
            ranks.append(min([self.hist[k][0] if k in self.hist else 0] + ranks[-1:]))
            self.hist[k] = (self.clock,)
        self._prune(self.hist, self.clock, self.hcap)
        if self.sampling:
            for b, r in zip(blocks, reversed(ranks)):  # deepest first
                k = self.key(b)
                if self.bkey(k) % 65521 % self.sampling:
                    continue
                if k in self.s_lru:
                    self.s_lru.remove(k)
                self.s_lru.append(k)
                self.s_order += 1
                self.s_lru2[k] = (r, self.s_order)
            del self.s_lru[:max(0, len(self.s_lru) - self.scap)]
            while len(self.s_lru2) > self.scap:
                del self.s_lru2[min(self.s_lru2, key=self.s_lru2.__getitem__)]
            self.use_lru2 = self.duel.choose(self.clock)
        for b, r in zip(blocks, reversed(ranks)):
            self._push(b, level, rank=r)

    def judge(self, prompt):
        """Count the sampled blocks of a `prompt` being matched (its data) each shadow holds."""
        sampled = [d for d in prompt if self.bkey(d) % 65521 % self.sampling == 0]
        self.duel.count(sum(d in self.s_lru for d in sampled),
                        sum(d in self.s_lru2 for d in sampled))

    def victim(self):
        def order(b):
            s = self.free[b]
            return (s["level"], s["rank"] if self.use_lru2 else 0, s["pushed"])
        b = min(self.free, key=order)
        del self.free[b]
        return b


_REFS = {"predictive": RefScored, "gdsf": RefScored, "slru": RefSegments,
         "s3fifo": RefSegments, "lru2": RefLRU2}


class RefCache:
    """Cache mode without partial reuse, done the obvious way, evicting by a reference policy.
    Returns per request the data of its victims, in order."""

    def __init__(self, tpb, n, name, params, admission="all"):
        self.tpb, self.n = tpb, n
        self.data: list = [None] * n
        key = self.data.__getitem__
        self.policy = _REFS[name](n, key, name, params, tpb)
        self.admission = admission
        self.bkeys: dict = {}  # data -> block key
        self.policy.bkey = self.bkeys.__getitem__
        self.admitted: dict = {}  # second_use: data -> (clock of its last release,)
        self.admit_clock = 0

    def process(self, r: Request) -> list:
        tpb, pol = self.tpb, self.policy
        toks = tuple(r.prompt_tokens().tolist())
        L = len(toks)
        for j, k in enumerate(r.block_keys(tpb)):
            self.bkeys[toks[:(j + 1) * tpb]] = k
        if getattr(pol, "sampling", 0):  # the duel judges the reusable blocks at the match
            pol.judge([toks[:(j + 1) * tpb] for j in range((L - 1) // tpb)][::-1])
        stored = {d: b for b, d in enumerate(self.data) if d is not None}
        blocks = []
        while (len(blocks) + 1) * tpb <= L - 1 and toks[:(len(blocks) + 1) * tpb] in stored:
            blocks.append(stored[toks[:(len(blocks) + 1) * tpb]])
        for b in blocks:
            pol.claim(b)
        m = len(blocks)
        victims = []
        for _ in range(-(-L // tpb) - m):
            empty = [b for b in range(self.n) if self.data[b] is None and b not in blocks]
            if empty:
                blocks.append(empty[0])
                continue
            b = pol.victim()
            victims.append(self.data[b])
            del stored[self.data[b]]
            self.data[b] = None
            if isinstance(pol, RefSegments):
                pol.new_data(b)
            blocks.append(b)
        computed = set()
        for j in range(m, L // tpb):
            want = toks[:(j + 1) * tpb]
            if want not in stored:
                self.data[blocks[j]] = want
                stored[want] = blocks[j]
                computed.add(blocks[j])
                if isinstance(pol, RefSegments):
                    pol.new_data(blocks[j])
        freed = [b for b in reversed(blocks) if self.data[b] is not None]
        if self.admission == "second_use":
            freed = [b for b in freed if self._admit(b) or b not in computed]
        pol.release(freed, r.priority)
        return victims

    def _admit(self, b):
        """Second use: record the block's data; a computed block stays only if it was seen
        before. Turned away, it is empty (never offered to the policy)."""
        d, hist = self.data[b], self.admitted
        seen = d in hist
        self.admit_clock += 1
        hist[d] = (self.admit_clock,)
        _Ref._prune(hist, self.admit_clock, 8 * self.n)
        if not seen:
            self.data[b] = None
        return seen


class LoggedQueue:
    """The manager's policy, logging the data of each victim it hands out."""

    def __init__(self, inner, m):
        self.inner, self.m, self.log = inner, m, []

    def pop_front_many(self, n):
        out = self.inner.pop_front_many(n)
        tpb = self.m.tpb
        for b in out:
            _, _, held, src, pos = self.m.index.stored[b][:5]
            self.log.append(tuple(src.prompt_tokens(0, pos * tpb + held).tolist()))
        return out

    def __len__(self):
        return len(self.inner)

    def __contains__(self, b):
        return b in self.inner

    def __getattr__(self, name):
        return getattr(self.inner, name)


def _shadow_size(capacity, sampling, tpb):
    """(keys sampled one in, shadow capacity) for a pool of blocks of `tpb` tokens: one in
    `sampling`, fewer where the shadows would hold under `MIN_SHADOW_KEYS` keys or
    `MIN_SHADOW_TOKENS` tokens (0, 0: no shadows)."""
    if not sampling:
        return 0, 0
    least = max(shadows.MIN_SHADOW_KEYS, shadows.MIN_SHADOW_TOKENS // tpb)
    sampling = max(1, min(sampling, capacity // least))
    return sampling, max(1, capacity // sampling)


def _replay(m, logged, r) -> int:
    """One cache-mode request through manager `m` whose policy `logged` wraps, checking the
    manager's and the policy's invariants after it; returns the blocks it reused."""
    seq = m.add_sequence(r)
    assert m.resize(seq, r.input_length)
    m.commit(seq, r.input_length)
    m.release(seq)
    assert m._check_sanity()
    assert getattr(logged.inner, "_check_sanity", lambda: True)()
    return seq.reused_full_blocks


_PARAMS = {
    "predictive": st.builds(PredictiveParams, horizon_ratio=st.sampled_from([0.5, 2.0, 16.0]),
                            boost=st.sampled_from([0.0, 1.0, 4.0]),
                            max_class=st.integers(1, 4), prior=st.sampled_from([0.0, 0.2]),
                            prior_weight=st.sampled_from([1.0, 20.0]),
                            history_ratio=st.sampled_from([0.5, 1.0, 8.0]),
                            shadow_sampling=st.sampled_from([0, 1, 2, 8])),
    "gdsf": st.builds(GDSFParams, freq_weight=st.sampled_from([0.5, 1.0, 3.0]),
                      max_freq=st.integers(1, 5), history_ratio=st.sampled_from([0.5, 8.0]),
                      shadow_sampling=st.sampled_from([0, 1, 2, 8])),
    "slru": st.builds(SLRUParams, protected_ratio=st.sampled_from([0.2, 0.5, 0.8]),
                      history_ratio=st.sampled_from([0.5, 8.0]),
                      shadow_sampling=st.sampled_from([0, 1, 8])),
    "s3fifo": st.builds(S3FIFOParams, small_ratio=st.sampled_from([0.1, 0.3, 0.6]),
                        max_freq=st.integers(1, 3), history_ratio=st.sampled_from([0.5, 1.0]),
                        shadow_sampling=st.sampled_from([0, 1, 8])),
    "lru2": st.builds(LRU2Params, history_ratio=st.sampled_from([0.25, 1.0, 8.0]),
                      shadow_sampling=st.sampled_from([0, 1, 2, 8])),
}


@st.composite
def policy_scenarios(draw, name):
    ps = draw(related_prompts(16, 14))
    tpb = draw(st.integers(1, 3))
    need = max(-(-len(p) // tpb) for p in ps)
    blocks = need + draw(st.sampled_from([0, 1, 2, 4, 8]))
    prios = draw(st.lists(st.sampled_from([35, 35, 35, 20, 60]), min_size=len(ps),
                          max_size=len(ps)))
    return [req(p, q) for p, q in zip(ps, prios)], tpb, blocks, draw(_PARAMS[name])


def _force_order(monkeypatch, choose) -> None:
    """Every duel takes the order `choose()` gives (True: the policy's own; its counting
    still runs)."""
    real = shadows.ShadowDuel.own_order

    def own_order(self, *args):
        real(self, *args)  # its counts move as in a run; the choice is forced
        return choose()
    monkeypatch.setattr(shadows.ShadowDuel, "own_order", own_order)


@pytest.mark.parametrize("backing", ["dict", "table"])
@pytest.mark.parametrize("name,admission", [(n, "all") for n in POLICIES]
                         + [(n, "second_use") for n in POLICIES])
def test_policy_matches_brute_force_reference(name, admission, backing, monkeypatch):
    """`dict` keeps every key history of these small pools in a dict (what only the admission
    filter's does unforced), `table` every one in the numpy table. Shadows of these tiny
    pools sample as drawn (no minimum size), so sampling itself is compared too. SLRU and
    S3-FIFO are compared as published: their duel is kept running (shadows fed, release
    order kept) but always leaves them their order."""
    if backing == "table":
        monkeypatch.setattr(policy_base, "DICT_HISTORY_MAX", 0)
    else:
        init = policy_base.KeyHistory.__init__
        monkeypatch.setattr(policy_base.KeyHistory, "__init__",
                            lambda self, capacity, per_key=False: init(self, capacity, True))
    monkeypatch.setattr(shadows, "MIN_SHADOW_KEYS", 1)
    monkeypatch.setattr(shadows, "MIN_SHADOW_TOKENS", 1)
    if name in ("slru", "s3fifo"):
        _force_order(monkeypatch, lambda: True)
    @settings(max_examples=(150 if admission == "all" else 50) // (1 + (backing == "table")),
              deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(policy_scenarios(name))
    def check(scenario):
        requests, tpb, blocks, params = scenario
        m = KVCacheManager(CacheSpec(tpb, blocks, enable_partial_reuse=False,
                                     eviction_policy=name, policy_params=params,
                                     admission=admission))
        m.enable_sanity_tracking()
        logged = m.gpu.free_queue = LoggedQueue(m.gpu.free_queue, m)
        ref = RefCache(tpb, blocks, name, params, admission)
        for i, r in enumerate(requests):
            _replay(m, logged, r)
            want = ref.process(r)
            got, logged.log = logged.log, []
            assert got == want, f"request {i}: victims differ"
    check()


@pytest.mark.parametrize("name", ["gdsf", "predictive"])
def test_class_policies_start_their_class_sets_again(name, monkeypatch):
    """`ClassQueuePolicy` remembers each level's set of non-empty classes; once it holds
    more than `_LIVE_SETS` it starts again: the same victims as the reference."""
    monkeypatch.setattr(policy_base, "_LIVE_SETS", 1)
    test_policy_matches_brute_force_reference(name, "all", "dict", monkeypatch)


@pytest.mark.parametrize("name", POLICY_NAMES)
@pytest.mark.parametrize("admission", ["all", "second_use"])
def test_invariants_with_every_policy(name, admission):
    """The interleaved-sequence driver of test_cache_manager (no block in use evicted, blocks
    conserved, every reused block holds its tokens) with each policy and admission."""

    @settings(max_examples=60, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(interleavings())
    def check(case):
        requests, tpb, blocks, partial, copy, picks = case
        m = KVCacheManager(CacheSpec(tpb, blocks, enable_partial_reuse=partial,
                                     copy_on_partial_reuse=copy, emit_copy_ops=True,
                                     eviction_policy=name, admission=admission))
        m.enable_sanity_tracking()
        d = DataCheckingDriver(m)
        state = {}
        pending = list(requests)
        picks = list(picks)
        while pending or state:
            choice = picks.pop() if picks else 0
            if pending and (not state or choice < 3):
                state[d.add(pending.pop(0))] = "added"
                continue
            seq = list(state)[choice % len(state)]
            if state[seq] == "added":
                if d.resize(seq, seq.request.input_length):
                    state[seq] = "sized"
                else:
                    d.release(seq)
                    del state[seq]
            elif state[seq] == "sized":
                d.commit(seq)
                state[seq] = "done"
            else:
                d.release(seq)
                del state[seq]
        assert m.gpu.num_in_use == 0 and all(r == 0 for r in m.ref_count)
    check()


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12),
       st.lists(st.tuples(st.sampled_from(["batch", "each", "contains"]),
                          st.lists(st.one_of(st.none(), st.integers(0, 60)), max_size=12)),
                max_size=40))
def test_key_history_backings_agree(capacity, calls):
    """The dict and the numpy table give the same answers, settles included (hashed-alike
    keys collide in the small table and probe)."""
    small = policy_base.KeyHistory(capacity, per_key=True)
    large = policy_base.KeyHistory(capacity)
    assert small._map is not None and large._map is None
    for kind, raw in calls:
        keys = list(dict.fromkeys(k * 64 + 63 if k is not None else None for k in raw))
        if kind == "contains":
            assert small.contains(keys) == large.contains(keys)
        elif kind == "each":
            assert small.record_each(keys) == large.record_each(keys)
        else:
            known = np.array([k for k in keys if k is not None], np.int64)
            got = []
            for h in (small, large):
                slots, entries = h.find(known.copy())
                got.append(entries.tolist())
                h.clock += known.size
                h.store(known.copy(), slots,
                        (np.arange(h.clock - known.size + 1, h.clock + 1) << 8) | 7, entries)
            assert got[0] == got[1]
        assert small.clock == large.clock and len(small) == len(large)
        # The dict stays in entry order (oldest use first): a drop cuts its front off.
        assert list(small._map.values()) == sorted(small._map.values())


@settings(max_examples=150, deadline=None)
@given(st.integers(1, 40), st.sampled_from([0, 3, 1 << 30]),
       st.lists(st.lists(st.integers(0, 400), max_size=90), max_size=25))
def test_key_history_table_batches_agree_with_the_dict(capacity, few, batches):
    """Batches of up to 90 keys in a table of a few dozen slots: long probes, stepped by numpy
    rounds (`few` 0), one key at a time (`few` huge) or both; new keys of one batch sharing a
    free slot. Entries equal the dict backing's; the table's invariants hold after each."""
    small = policy_base.KeyHistory(capacity, per_key=True)
    saved = policy_base._FEW
    policy_base._FEW = few
    try:
        large = policy_base.KeyHistory(capacity)
        for raw in batches:
            keys = np.array(list(dict.fromkeys(raw)), np.int64) * 64 + 63
            got = []
            for h in (small, large):
                slots, entries = h.find(keys.copy())
                got.append(entries.tolist())
                h.clock += keys.size
                ticks = np.arange(h.clock - keys.size + 1, h.clock + 1)
                h.store(keys.copy(), slots, (ticks << 8) | (keys & 255), entries)
                assert h._check_sanity()
            assert got[0] == got[1] and len(small) == len(large)
    finally:
        policy_base._FEW = saved


@pytest.mark.parametrize("few", [0, 1 << 30])
def test_key_history_probes_wrap_around_the_table(few):
    """Keys homed at the table's last slot probe on from its first (numpy rounds or one key at
    a time); the keys there before are kept."""
    saved = policy_base._FEW
    policy_base._FEW = few
    try:
        h = policy_base.KeyHistory(100)
        size = h._keys.size
        homes = np.arange(1, 4000, dtype=np.int64)
        homes = (homes.view(np.uint64) * policy_base._MIX >> h._shift).view(np.int64)
        first = np.arange(1, 4000)[homes == 0][:1]
        last = np.arange(1, 4000)[homes == size - 1][:4]
        for batch, entry in ((first, 1 << 8), (last, 2 << 8), (last, 3 << 8)):
            slots, earlier = h.find(batch.copy())
            h.clock += 1
            h.store(batch.copy(), slots, np.full(batch.size, entry), earlier)
            assert h._keys.size == size and h._check_sanity()
        held = h._keys.tolist()
        assert held[0] == first[0] and set(held[1:4] + held[-1:]) == set(last.tolist())
        assert (h.find(last.copy())[1] == 3 << 8).all()
        assert (h.find(first.copy())[1] == 1 << 8).all()
    finally:
        policy_base._FEW = saved


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 12),
       st.lists(st.lists(st.one_of(st.none(), st.integers(0, 80)), max_size=12), max_size=40))
def test_ghost_keys_remember_as_a_key_history(capacity, batches):
    """S3-FIFO's ghosts (a set and a list) remember exactly what a `KeyHistory` recording
    the same keys one at a time remembers, for keys recorded only while forgotten."""
    ghosts = GhostKeys(capacity)
    history = policy_base.KeyHistory(capacity)
    for raw in batches:
        keys = list(dict.fromkeys(raw))
        keys = [k for k, seen in zip(keys, history.contains(keys)) if not seen]
        ghosts.record(keys)
        history.record_each(keys)
        probe = list(range(81))
        assert ghosts.contains(probe) == history.contains(probe)
        assert ghosts.clock == history.clock and len(ghosts) == len(history)
        assert ghosts._check_sanity()
    if len(ghosts):
        with pytest.raises(AssertionError):
            ghosts.record([ghosts._order[-1]])


def test_spread_keys_are_a_bijection_of_the_keys():
    """S3-FIFO's ghosts are spread keys: the numpy pass over a release and the one-key form
    agree, and spreading is undone by its inverse (same membership as the keys)."""
    rng = np.random.default_rng(7)
    keys = np.concatenate([rng.integers(-(1 << 63), (1 << 63) - 1, 500, dtype=np.int64),
                           np.array([0, -1, (1 << 63) - 1, -(1 << 63), 64, 1 << 24])])
    u = keys.view(np.uint64)
    fast = (u ^ (u >> np.uint64(24))).view(np.int64).tolist()
    assert fast == [spread_key(k) for k in keys.tolist()]
    assert len(set(fast)) == len(set(keys.tolist()))
    for k, s in zip(keys.tolist(), fast):  # x ^ (x >> 24) ^ (x >> 48) undoes it on 64 bits
        v = s & ((1 << 64) - 1)
        v ^= (v >> 24) ^ (v >> 48)
        assert v == k & ((1 << 64) - 1)
    assert spread_key(None) is None


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_retention_expiry_requeues_with_every_policy(name):
    """A free block whose retention duration ends moves to the default level (`requeue`, not
    a use) and the policy stays consistent (S3-FIFO's small FIFO keeps each queued block's
    ghost key for its eviction)."""
    ret = Retention((TokenRangeRetention(0, 4, 90, 500.0),))
    m = KVCacheManager(CacheSpec(2, 6, enable_partial_reuse=False, eviction_policy=name))
    m.enable_sanity_tracking()
    fq = m.gpu.free_queue
    m.refresh(0.0)
    first = Request(next(_ids), 0.0, 7, 1, tokens=np.array([1, 2, 3, 4, 5, 6, 9]),
                    retention=ret)
    _cache(m, first)
    assert sorted(m.priority[b] for b in range(6) if b in fq) == [35, 90, 90]
    m.refresh(0.6)
    assert [m.priority[b] for b in range(6) if b in fq] == [35, 35, 35]
    assert fq._check_sanity() and m._check_sanity()
    for tokens in ([7, 8, 10, 11, 12, 13, 9], [14, 15, 16, 17, 18, 19, 9], [1, 2, 3, 4, 9]):
        _cache(m, req(tokens))
        assert fq._check_sanity() and m._check_sanity()


def _cache(m, request):
    seq = m.add_sequence(request)
    assert m.resize(seq, request.input_length)
    m.commit(seq, request.input_length)
    m.release(seq)


# --- LRU untouched, serve mode, requests.skip, tune --holdout ---------------------------------


def test_lru_is_the_plain_free_queue():
    """The default keeps TensorRT-LLM's LRU order on the unchanged fast path."""
    from kvbench.cache.free_queue import FreeQueue

    m = KVCacheManager(CacheSpec(4, 8))
    assert type(m.gpu.free_queue) is FreeQueue and m._admission is None


@pytest.mark.parametrize("name", ["slru", "s3fifo", "lru2"])
def test_window_pools_evict_lru(tmp_path, name):
    """A sliding window's pool evicts LRU whatever the policy (it ranks a release as a
    prefix chain; a window block is useful with its window alone), the full-attention pool
    by the policy; admission applies to both."""
    from kvbench.cache.free_queue import FreeQueue
    from kvbench.config import load_workload
    from kvbench.plan import size_pools
    from kvbench.runner import load_workload_requests

    wl = load_workload(_workload(tmp_path), [
        f"cache.eviction_policy={name}", "cache.admission=second_use",
        "model.attention_window=[256, null]", "model.num_layers=4",
        "cache.swa_scratch_reuse=true"])
    manager = size_pools(wl, load_workload_requests(wl)).manager()
    windows = [type(m.gpu.free_queue) is FreeQueue for m in manager.managers]
    assert windows == [c.window is not None for c in manager.cycles] == [False, True]
    assert all(m.spec.admission == "second_use" for m in manager.managers)


def _workload(tmp_path, extra: str = "", mode: str = "cache"):
    path = tmp_path / "w.yaml"
    path.write_text(f"""
name: w
cache: {{tokens_per_block: 16, max_tokens: 4096{extra}}}
requests:
  source: synthetic
  synthetic: {{num_requests: 120, num_users: 12, turns: 5, prompt_tokens: 96, system_prompt_tokens: 256}}
scheduler: {{max_num_tokens: 1024}}
run: {{mode: {mode}, progress: false}}
""")
    return path


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policy_runs_report_lru_reference_and_gap(tmp_path, name):
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    wl = load_workload(_workload(tmp_path), [f"cache.eviction_policy={name}"])
    m = run_workload(wl)[0].metrics
    lru = run_workload(load_workload(_workload(tmp_path)))[0].metrics["hit_rate"]
    assert m["lru_hit_rate"] == lru
    assert m["gap_closed"] == pytest.approx(
        (m["hit_rate"] - lru) / (m["optimal_hit_rate"] - lru))
    assert m["hit_rate"] <= m["optimal_hit_rate"] + 1e-12 or m["reused_partial_tokens"]
    if name == "lru":
        assert m["gap_closed"] == 0


def test_no_policy_leaves_lru_order_without_a_clear_lead_on_a_short_trace(tmp_path):
    """The built-in multi-turn traffic, 120 requests of 12 users in a 256-block pool (seed 2):
    LRU is close to the optimum, and the duel's counts come from a few prompts. Taking their
    order from the start and on any lead, `s3fifo` trailed LRU by 2.52 pp here and `lru2` by
    1.23; starting in LRU's order and waiting for a lead of more than one standard deviation,
    no policy trails it by more than issue 15's 0.5 pp."""
    from kvbench.config import load_workload
    from kvbench.modes.common import References
    from kvbench.runner import run_workload

    path = tmp_path / "short.yaml"
    path.write_text("""
name: short
cache: {tokens_per_block: 16, max_tokens: 4096}
requests:
  source: synthetic
  synthetic: {generator: multi_turn, num_requests: 120, num_users: 12, turns: 10,
    prompt_tokens: 96, system_prompt_tokens: 256}
run: {mode: cache, progress: false, seed: 2}
""")
    refs = References()
    for name in POLICY_NAMES:
        m = run_workload(load_workload(path, [f"cache.eviction_policy={name}"]),
                         references=refs)[0].metrics
        assert m["hit_rate"] > m["lru_hit_rate"] - 0.005, name


@pytest.mark.parametrize("name", list(POLICIES))
def test_policy_keys_default_to_the_policy_and_reach_its_duel(name):
    """`cache.policy.<name>.*` default to the policy's own parameters (one default for one
    thing), and `shadow_entry` reaches the duel: 0 takes the policy's order on any lead."""
    from kvbench.config import default_workload
    from kvbench.plan import policy_params

    params_cls = POLICIES[name][1]
    assert policy_params(default_workload([f"cache.eviction_policy={name}"])) == params_cls()
    assert params_cls().shadow_entry == shadows.ENTRY_MARGIN == 1
    for entry, own in ((0, True), (1, False)):
        params = policy_params(default_workload([f"cache.eviction_policy={name}",
                                                 f"cache.policy.{name}.shadow_entry={entry}"]))
        assert params == params_cls(shadow_entry=entry)
        m = KVCacheManager(CacheSpec(16, 64, eviction_policy=name, policy_params=params))
        duel = m.gpu.free_queue.shadows
        assert duel.entry == entry
        duel.tally(0, 1)  # the policy's shadow held one key more: a lead of 1 sigma
        assert duel.own_order(False, 0) is own


def test_variants_share_the_references_they_have_in_common(tmp_path, monkeypatch):
    """One workload's variants compute the optimal/ideal references once per cache size and
    reuse rules, and the LRU reference once per LRU run, with the results of separate runs."""
    import kvbench.modes.cache as cache_mode
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    variants = [["cache.eviction_policy=slru"], ["cache.eviction_policy=gdsf"],
                ["cache.eviction_policy=gdsf", "cache.policy.gdsf.history_ratio=2"],
                ["cache.eviction_policy=gdsf", "cache.max_tokens=2048"],
                ["cache.eviction_policy=lru2", "cache.enable_partial_reuse=false"],
                ["cache.admission=second_use"]]
    path = _workload(tmp_path)
    path.write_text(path.read_text() + "variants:\n" + "".join(
        f"  - {{name: v{i}, set: {{{', '.join(s.replace('=', ': ') for s in sets)}}}}}\n"
        for i, sets in enumerate(variants)))
    calls = {"optimal": 0, "lru": 0}
    for name, attr in (("optimal", "reference_hit_rates"), ("lru", "_lru_hit")):
        real = getattr(cache_mode, attr)

        def counted(*a, _real=real, _name=name, **k):
            calls[_name] += 1
            return _real(*a, **k)
        monkeypatch.setattr(cache_mode, attr, counted)
    shared = [o.metrics for o in run_workload(load_workload(path))]
    # Three cache sizes/reuse rules; the LRU runs: 4096 tokens with partial reuse (the
    # policy's parameters are not LRU's), 2048, and 4096 without partial reuse.
    assert calls == {"optimal": 3, "lru": 3}
    for sets, m in zip(variants, shared):
        alone = run_workload(load_workload(_workload(tmp_path), sets))[0].metrics
        for key in ("hit_rate", "lru_hit_rate", "optimal_hit_rate", "ideal_hit_rate",
                    "gap_closed"):
            assert m[key] == alone[key], (sets, key)


@pytest.mark.parametrize("name", POLICY_NAMES)
def test_policies_in_serve_mode(tmp_path, name):
    """Serve mode evicts under decode pressure and preemption through the same policy, and
    reports the same served stream with LRU as its reference (no optimum: no gap closed)."""
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    wl = load_workload(_workload(tmp_path, mode="serve"),
                       [f"cache.eviction_policy={name}", "cache.admission=second_use"])
    m = run_workload(wl)[0].metrics
    assert m["requests"] == 120 and m["evicted_blocks"] > 0
    lru = run_workload(load_workload(_workload(tmp_path, mode="serve")))[0].metrics
    assert lru["lru_hit_rate"] == lru["hit_rate"]
    assert m["lru_hit_rate"] == lru["hit_rate"] and m["gap_closed"] is None


def test_serve_variants_share_their_lru_reference(tmp_path, monkeypatch):
    """Serve-mode variants that differ only in the policy, its parameters or the
    admission run the LRU reference once; another scheduler runs its own."""
    import kvbench.modes.serve as serve_mode
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    variants = [["cache.eviction_policy=slru"], ["cache.eviction_policy=gdsf"],
                ["cache.eviction_policy=gdsf", "cache.policy.gdsf.history_ratio=2"],
                ["cache.admission=second_use"], ["cache.eviction_policy=lru2"],
                ["cache.eviction_policy=lru2", "scheduler.max_num_tokens=512"]]
    path = _workload(tmp_path, mode="serve")
    path.write_text(path.read_text() + "variants:\n" + "".join(
        f"  - {{name: v{i}, set: {{{', '.join(s.replace('=', ': ') for s in sets)}}}}}\n"
        for i, sets in enumerate(variants)))
    calls = []
    real = serve_mode._lru_hit
    monkeypatch.setattr(serve_mode, "_lru_hit", lambda *a: calls.append(1) or real(*a))
    shared = [o.metrics for o in run_workload(load_workload(path))]
    assert len(calls) == 2
    for sets, m in zip(variants, shared):
        alone = run_workload(load_workload(_workload(tmp_path, mode="serve"), sets))[0].metrics
        assert (m["hit_rate"], m["lru_hit_rate"]) == (alone["hit_rate"], alone["lru_hit_rate"])


def test_requests_skip_drops_the_first_requests(tmp_path):
    from kvbench.config import load_workload
    from kvbench.runner import load_workload_requests

    full = load_workload_requests(load_workload(_workload(tmp_path)))
    part = load_workload_requests(load_workload(
        _workload(tmp_path), ["requests.skip=100", "requests.limit=15"]))
    assert [r.input_length for r in part] == [r.input_length for r in full[100:115]]
    assert part[0].arrival_s == 0
    assert [r.arrival_s for r in part] == pytest.approx(
        [r.arrival_s - full[100].arrival_s for r in full[100:115]])


def test_tune_holdout_reports_the_best_trial_on_the_rest(tmp_path, capsys):
    from cli_helpers import run_cli
    from kvbench.config import load_workload
    from kvbench.runner import run_workload

    path = _workload(tmp_path, ", eviction_policy: predictive")
    path.write_text(path.read_text() + """
tune:
  n_trials: 3
  seed: 0
  space:
    cache.policy.predictive.boost: {choices: [0.0, 8.0]}
  objectives:
    - {metric: hit_rate, direction: maximize}
""")
    code, out, err = run_cli(["tune", path, "--holdout", "0.25", "--storage",
                              f"sqlite:///{tmp_path / 's.db'}", "--json", tmp_path / "s.json"],
                             capsys)
    assert code == 0, err
    assert "Held out: the last 30 of 120 requests (tuned on the first 90)" in out
    import optuna

    study = optuna.load_study(study_name="w", storage=f"sqlite:///{tmp_path / 's.db'}")
    best = study.best_trial.params["cache.policy.predictive.boost"]
    held = run_workload(load_workload(path, [
        "requests.skip=90", "requests.limit=30", f"cache.policy.predictive.boost={best}"]))[0]
    row = next(line for line in out.splitlines() if line.strip("│ ").startswith("hit_rate"))
    assert f"{100 * held.metrics['hit_rate']:.2f}%" in row
    summary = json.loads((tmp_path / "s.json").read_text())  # --json: the same, as data
    assert summary["tally"]["complete"] == 3 and not summary["interrupted"]
    assert summary["best"]["params"] == {"cache.policy.predictive.boost": best}
    assert summary["best"]["values"] == {"hit_rate": study.best_trial.value}
    check = summary["holdout"]
    assert (check["tune_requests"], check["total_requests"]) == (90, 120)
    assert [r["label"] for r in check["runs"]] == ["best trial", "as written"]
    assert check["runs"][0]["held_out"]["hit_rate"] == held.metrics["hit_rate"]
    code, _, err = run_cli(["tune", path, "--holdout", "1.5"], capsys)
    assert code == 2 and "--holdout" in err


@pytest.mark.parametrize("admission,reused", [("all", [0, 2, 2]), ("second_use", [0, 0, 2])])
def test_second_use_admission_caches_a_prefix_computed_twice(admission, reused):
    m = KVCacheManager(CacheSpec(2, 8, enable_partial_reuse=False, admission=admission))
    m.enable_sanity_tracking()
    got = []
    for _ in range(3):
        r = req([1, 2, 3, 4, 5])
        seq = m.add_sequence(r)
        got.append(seq.reused_full_blocks)
        assert m.resize(seq, r.input_length)
        m.commit(seq, r.input_length)
        m.release(seq)
        assert m._check_sanity()
    assert got == reused


@pytest.mark.parametrize("name,params,victims", [
    ("lru", None, [(1, 2), (3, 4)]),
    ("lru2", LRU2Params(shadow_sampling=0), [(3, 4), (5, 6)]),
    ("lru2", LRU2Params(), [(1, 2), (3, 4)])])
def test_lru2_evicts_once_used_data_first(name, params, victims):
    """X X Y Z W V in a pool of 4 blocks of 2 tokens (each prompt one full block and a partial
    one): LRU evicts X, used twice but least recently; LRU-2 alone keeps it and evicts the
    once-used Y, then Z, oldest first. With its duel (the default) it starts in LRU's order,
    and one reuse is no lead to leave it for: LRU's victims."""
    m = KVCacheManager(CacheSpec(2, 4, enable_partial_reuse=False, eviction_policy=name,
                                 policy_params=params))
    m.enable_sanity_tracking()
    logged = m.gpu.free_queue = LoggedQueue(m.gpu.free_queue, m)
    for toks in ([1, 2, 9], [1, 2, 9], [3, 4, 9], [5, 6, 9], [7, 8, 9], [10, 11, 9]):
        _replay(m, logged, req(toks))
    assert logged.log == victims


def _sessions(groups, users, turns):
    """`groups` waves of `users` concurrent sessions of `turns` turns, round robin; each turn
    extends the session's previous prompt by one block of 2 tokens (then a partial block)."""
    out = []
    for g in range(groups):
        for t in range(turns):
            for u in range(users):
                s = g * users + u
                out.append([1000 * s + j + 1 for j in range(2 * (t + 2))] + [9])
    return out


def _against_reference(name, params, prompts, fallen_back) -> tuple[int, int]:
    """Replay `prompts` through policy `name`, checking every victim against the reference;
    returns the blocks reused and the requests after which `fallen_back(policy)` held."""
    m = KVCacheManager(CacheSpec(2, 16, enable_partial_reuse=False, eviction_policy=name,
                                 policy_params=params))
    m.enable_sanity_tracking()
    logged = m.gpu.free_queue = LoggedQueue(m.gpu.free_queue, m)
    ref = RefCache(2, 16, name, params)
    hits = fallbacks = 0
    for toks in prompts:
        r = req(toks)
        hits += _replay(m, logged, r)
        assert logged.log == ref.process(r)
        logged.log = []
        fallbacks += fallen_back(logged.inner)
    return hits, fallbacks


def test_lru2_shadows_fall_back_to_lru_when_it_holds_more():
    """Short sessions: a turn's new block is once-used until the next turn, and the prefixes of
    finished sessions (used twice) hold on under LRU-2. The LRU shadow sees more hits, so the
    pool evicts LRU for a while: victims as the reference's, and more hits than LRU-2 alone."""
    prompts = _sessions(6, 4, 3)
    hits = {}
    for sampling in (0, 1):
        hits[sampling], lru_requests = _against_reference(
            "lru2", LRU2Params(history_ratio=8.0, shadow_sampling=sampling), prompts,
            lambda policy: not policy.use_lru2)
        assert (lru_requests > 0) == (sampling > 0)
    assert hits[1] > hits[0]


def _hot_and_scans(n):
    """Three hot prompts, each every ninth request, between one-time prompts: LRU-2 keeps
    the hot ones (used twice) where LRU lets the scans push them out."""
    hot = [[5000 + 10 * h + j for j in range(6)] + [9] for h in range(3)]
    return [hot[i // 3 % 3] if i % 3 == 0 else [100000 + 10 * i + j for j in range(6)] + [9]
            for i in range(n)]


def test_lru2_compaction_at_any_time_changes_no_victim():
    """LRU-2 keeps its orders and its LRU-2 shadow as lazy structures that drop stale entries
    when they outgrow their live ones. Compacting all of them after every other request, at
    three retention levels, through phases where either order leads, gives the reference's
    victims, and the structures stay sane."""
    rng = np.random.default_rng(0)
    prompts = (_sessions(6, 4, 3) + _hot_and_scans(180)) * 2
    params = LRU2Params(history_ratio=8.0, shadow_sampling=1)
    m = KVCacheManager(CacheSpec(2, 16, enable_partial_reuse=False, eviction_policy="lru2",
                                 policy_params=params))
    m.enable_sanity_tracking()
    logged = m.gpu.free_queue = LoggedQueue(m.gpu.free_queue, m)
    policy = logged.inner
    ref = RefCache(2, 16, "lru2", params)
    orders = []
    for i, toks in enumerate(prompts):
        r = req(toks, int(rng.choice([35, 35, 20, 60])))
        _replay(m, logged, r)
        assert logged.log == ref.process(r)
        logged.log = []
        orders.append(policy.use_lru2)
        if i % 2:
            for level in {20, 35, 60}:
                if policy._live[level]:
                    policy._drop_fifo(level)
                    policy._compact_runs(level)
            policy._compact_shadow()
            assert policy._check_sanity()
    assert sum(a != b for a, b in zip(orders, orders[1:])) >= 3  # both orders led, in turns


@st.composite
def shadow_releases(draw):
    """Releases for a predictive shadow: sampled keys (distinct in a release, deepest first)
    with non-decreasing classes, stamps that grow, and per-release shifts non-decreasing over
    the classes (learnt estimates change between releases)."""
    out, stamp = [], 0
    for _ in range(draw(st.integers(1, 40))):
        keys = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True))
        classes = sorted(draw(st.lists(st.integers(1, 4), min_size=len(keys),
                                       max_size=len(keys))))
        steps = draw(st.lists(st.integers(0, 20), min_size=4, max_size=4))
        shift = [0] + [sum(steps[:c]) for c in range(1, 5)]
        stamp += draw(st.integers(1, 10))
        out.append((keys, classes, stamp, shift))
    return out


@settings(max_examples=300)
@given(releases=shadow_releases(), cap=st.integers(1, 12),
       compact=st.lists(st.booleans(), min_size=40, max_size=40))
def test_predictive_shadow_matches_brute_force(releases, cap, compact):
    """A predictive shadow holds the keys a scan would keep: after each release, the lowest
    (stamp + shift of its class, class, insertion order) go while over capacity. With no
    shift it is the LRU shadow. Dropping stale entries at
    any time changes nothing."""
    shadow, lru = _Shadow(5), shadows.LRUShadow()
    ref: dict = {}  # key -> (stamp, class, insertion order)
    order = 0
    for (keys, classes, stamp, shift), squeeze in zip(releases, compact):
        assert [k in shadow for k in keys] == [k in ref for k in keys]
        for k, c in zip(keys, classes):
            order += 1
            ref[k] = (stamp, c, order)
        while len(ref) > cap:
            del ref[min(ref, key=lambda k: (ref[k][0] + shift[ref[k][1]], ref[k][1], ref[k][2]))]
        runs = [(c, classes.index(c), len(classes) - classes[::-1].index(c))
                for c in sorted(set(classes))]
        shadow.replay(keys, runs, stamp, shift, cap)
        assert set(shadow.live) == set(ref)
        if squeeze:
            shadow._compact()
        assert shadow._check_sanity()
    zero = _Shadow(5)
    for keys, classes, stamp, _ in releases:
        runs = [(c, classes.index(c), len(classes) - classes[::-1].index(c))
                for c in sorted(set(classes))]
        zero.replay(keys, runs, stamp, [0] * 5, cap)
        lru.replay(keys, cap)
        assert list(zero.live) and set(zero.live) == set(lru.keys)


def _step(duel, use_own, lru, own, clock):
    """A prompt's counts at its match, then the duel's choice at a release at `clock`."""
    duel.tally(lru, own)
    return duel.own_order(use_own, clock)


def test_shadow_duel_starts_in_lru_order_and_takes_the_own_on_a_clear_lead():
    """Each prompt's counts add to both windows; the first halves once per period passed
    (several at once after a long release), the long one every LONG_WINDOW periods. The pool
    starts in LRU's order and takes the own order once its count leads by ENTRY_MARGIN (1)
    standard deviation of the difference in both windows (the root of the sum of each prompt's
    squared difference); with margins 0 it leaves as soon as LRU's count is higher in either."""
    assert shadows.ENTRY_MARGIN == 1
    duel = shadows.ShadowDuel(capacity=80 * 1024, sampling=8, period=100, tokens_per_block=64,
                              own=set())
    assert duel.capacity == 10 * 1024 and duel.sampled.sum() == -(-65521 // 8)
    short, long_ = duel.windows
    assert not _step(duel, False, 0, 0, 0)  # 0 against 0: LRU's order
    assert not _step(duel, False, 0, 5, 10)  # one prompt's 5 is 1 sigma (5), not more
    assert _step(duel, False, 0, 5, 20)  # two: 10 > sqrt(50)
    assert short[:3] == long_[:3] == [0, 10, 50]
    assert _step(duel, True, 5, 5, 30)  # a tie adds no deviation: the own order stays
    assert not _step(duel, True, 16, 0, 99)  # LRU's 21 against 15: LRU's order
    assert short[:3] == long_[:3] == [21, 15, 306]
    # The first window halves at 100 (sums of squares quartered); a tie there is not enough.
    assert not _step(duel, False, 10, 16, 100)
    assert short[:3] == [15, 15, 85] and long_[:3] == [31, 31, 342]
    # A lead of the own order in the first window alone is not enough: 20 > sqrt(317) there,
    # 20 < sqrt(574) in the long one.
    assert not _step(duel, False, 0, 6, 150) and not _step(duel, False, 0, 14, 160)
    assert short[:3] == [15, 35, 317] and long_[:3] == [31, 51, 574]
    assert _step(duel, False, 0, 20, 170)  # 40 > sqrt(974) in the long one, 40 > 26.8 here
    # 28 halvings of the first window, the long one's first at 32 periods.
    assert _step(duel, True, 0, 0, 3200)
    assert short[:2] == [0, 0] and long_[:2] == [15, 35] and long_[4] == 6400


@pytest.mark.parametrize("name", list(POLICIES))
def test_duel_counts_a_prefix_in_use_as_held_by_both_shadows(name, monkeypatch):
    """Serve mode: a request matched while another sequence still holds its prefix hits it in
    either order, though no release has put it in a shadow yet. The duel counts those blocks
    held by both shadows when the prompt is matched; a prompt whose prefix is only in the
    shadows (released, not in use) counts what each holds."""
    monkeypatch.setattr(shadows, "MIN_SHADOW_KEYS", 1)
    monkeypatch.setattr(shadows, "MIN_SHADOW_TOKENS", 1)
    params = POLICIES[name][1](shadow_sampling=1)
    m = KVCacheManager(CacheSpec(2, 32, enable_partial_reuse=False, eviction_policy=name,
                                 policy_params=params))
    m.enable_sanity_tracking()
    duel = m.gpu.free_queue.shadows
    first = req(list(range(1, 10)))  # 4 full blocks and a partial one
    running = m.add_sequence(first)
    assert m.resize(running, 9)
    m.commit(running, 9)
    assert duel.windows[0][:2] == [0, 0]  # nothing to reuse: no count
    second = m.add_sequence(req(list(range(1, 10)) + [42, 43, 44]))
    assert second.reused_full_blocks == 4
    assert duel.windows[0][:2] == [4, 4]  # in use: held by both, though no shadow has them
    m.release(second)
    m.release(running)
    assert m._check_sanity() and m.gpu.free_queue._check_sanity()
    held = duel.windows[0][:2]
    third = m.add_sequence(req(list(range(1, 10))))  # free now, in both shadows
    assert third.reused_full_blocks == 4
    assert duel.windows[0][:2] == [held[0] + 4, held[1] + 4]


def test_shadow_duel_samples_fewer_keys_where_the_pool_is_small():
    """Each shadow holds MIN_SHADOW_KEYS keys, and MIN_SHADOW_TOKENS tokens in them, where the
    pool has that many (a shadow of a few hundred keys, or of a few prompts cut into short
    blocks, measures mostly noise), else every key."""
    size = shadows.MIN_SHADOW_KEYS
    assert shadows.MIN_SHADOW_TOKENS == 64 * size  # the tokens decide below 64 a block
    for capacity, sampling, tpb, want_rate in [
            (16 * size, 8, 64, 8), (4 * size, 8, 64, 4), (size, 8, 64, 1), (size // 2, 8, 64, 1),
            (3, 8, 64, 1), (64 * size, 2, 64, 2), (4 * size, 8, 128, 4), (8 * size, 8, 16, 2),
            (8 * size, 8, 32, 4), (16 * size, 8, 16, 4), (64 * size, 8, 16, 8)]:
        duel = shadows.ShadowDuel(capacity, sampling, period=1, tokens_per_block=tpb, own=set())
        assert duel.capacity == max(1, capacity // want_rate), (capacity, sampling)
        assert duel.sampled.sum() == -(-65521 // want_rate), (capacity, sampling)


@pytest.mark.parametrize(("name", "params", "sessions", "in_lru"), [
    ("predictive", PredictiveParams, (6, 6, 4), lambda policy: not policy.boosting),
    ("gdsf", GDSFParams, (6, 4, 3), lambda policy: not policy.gdsf_order)])
def test_shadows_fall_back_to_lru_when_it_holds_more(name, params, sessions, in_lru):
    """Short sessions, several at a time: in its own order alone the policy keeps prefixes of
    finished sessions (used more) over the new turns' blocks (predictive 44 hits against LRU's
    54, gdsf 74 against 120). The LRU shadow sees more hits, so the pool evicts in LRU order
    for a while: victims as the reference's, and more hits than its own order alone."""
    prompts = _sessions(*sessions)
    hits = {}
    for sampling in (0, 1):
        hits[sampling], lru_requests = _against_reference(
            name, params(shadow_sampling=sampling), prompts, in_lru)
        assert (lru_requests > 0) == (sampling > 0)
    assert hits[1] > hits[0]


@pytest.mark.parametrize("sampling", [1, 2])
def test_gdsf_duel_matches_the_reference_through_switches(sampling, monkeypatch):
    """Sessions, hot prompts among scans, then sessions again: the order switches back and
    forth, and every victim is the reference's (its shadows are scans over dicts). The L of
    old pushes is pruned every few pushes here."""
    monkeypatch.setattr(gdsf_policy, "_PRUNE_SLACK", 1)
    prompts = _sessions(6, 4, 3) + _hot_and_scans(180) + _sessions(6, 6, 4)
    orders = []
    _against_reference("gdsf", GDSFParams(shadow_sampling=sampling), prompts,
                       lambda policy: orders.append(policy.gdsf_order) or 0)
    assert sum(a != b for a, b in zip(orders, orders[1:])) >= 3


@settings(max_examples=80, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(scenario=policy_scenarios("gdsf"), partial=st.booleans())
def test_gdsf_in_lru_order_evicts_as_lru(scenario, partial):
    """While the LRU shadow leads (forced here), GDSF's pool evicts exactly as the plain LRU
    free queue: the same victims in the same order and the same hits, at every retention
    level, with or without partial reuse (claims undone, blocks taken in part)."""
    requests, tpb, blocks, params = scenario
    saved = shadows.ShadowDuel.own_order
    shadows.ShadowDuel.own_order = lambda self, *args: False
    try:
        assert (_victims_and_hits("gdsf", dataclasses.replace(params, shadow_sampling=1),
                                  requests, tpb, blocks, partial)
                == _victims_and_hits("lru", None, requests, tpb, blocks, partial))
    finally:
        shadows.ShadowDuel.own_order = saved


@st.composite
def gdsf_shadow_releases(draw):
    """Releases for a GDSF shadow: sampled keys (distinct in a release, deepest first) with
    non-decreasing classes (capped at the parent's)."""
    out = []
    for _ in range(draw(st.integers(1, 40))):
        keys = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True))
        out.append((keys, sorted(draw(st.lists(st.integers(1, 5), min_size=len(keys),
                                               max_size=len(keys))))))
    return out


@settings(max_examples=300, deadline=None)
@given(releases=gdsf_shadow_releases(), cap=st.integers(1, 12),
       weight=st.sampled_from([0, 512, 1024, 3072]),
       compact=st.lists(st.booleans(), min_size=40, max_size=40))
def test_gdsf_shadow_matches_brute_force(releases, cap, weight, compact):
    """The GDSF shadow holds the keys key-level GDSF keeps: a release's keys get H = L +
    weight x class, then the lowest (H, class, insertion order) go while over capacity, L the
    H of the last one gone. Dropping stale entries at any time changes nothing."""
    shadow = gdsf_policy._Shadow(weight)
    ref: dict = {}  # key -> (H, class, insertion order)
    L = order = 0
    for (keys, classes), squeeze in zip(releases, compact):
        assert [k in shadow for k in keys] == [k in ref for k in keys]
        for k, c in zip(keys, classes):
            order += 1
            ref[k] = (L + weight * c, c, order)
        while len(ref) > cap:
            L = max(L, ref.pop(min(ref, key=ref.__getitem__))[0])
        shadow.replay(keys, classes, cap)
        assert set(shadow.live) == set(ref) and shadow.inflation == L
        if squeeze:
            shadow._compact()
        assert shadow._check_sanity()


# --- SLRU and S3-FIFO: the duel with LRU ------------------------------------------------------


def _victims_and_hits(name, params, requests, tpb, blocks, partial):
    """Per request through policy `name`: the blocks it reused and its victims' data, with
    the manager's and the policy's invariants checked after each."""
    m = KVCacheManager(CacheSpec(tpb, blocks, enable_partial_reuse=partial,
                                 eviction_policy=name, policy_params=params))
    m.enable_sanity_tracking()
    logged = m.gpu.free_queue = LoggedQueue(m.gpu.free_queue, m)
    out = []
    for r in requests:
        out.append((_replay(m, logged, r), tuple(logged.log)))
        logged.log = []
    return out


@pytest.mark.parametrize("name", ["slru", "s3fifo"])
@pytest.mark.parametrize("slack", [256, -1000])
def test_segments_evict_exactly_as_lru_while_lru_leads(name, slack, monkeypatch):
    """With the duel forced to LRU, SLRU and S3-FIFO take the plain `lru` policy's victims in
    its order (least recently released first, the deeper block first within a release, the
    lowest level first) and so reuse the same blocks, whatever their segments did meanwhile.
    A `slack` of -1000 rebuilds the release order after every push."""
    _force_order(monkeypatch, lambda: False)
    monkeypatch.setattr(segment_duel, "_SLACK", slack)

    @settings(max_examples=80, deadline=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    @given(policy_scenarios(name), st.booleans())
    def check(scenario, partial):
        requests, tpb, blocks, params = scenario
        params = dataclasses.replace(params, shadow_sampling=1)
        assert (_victims_and_hits(name, params, requests, tpb, blocks, partial)
                == _victims_and_hits("lru", None, requests, tpb, blocks, partial))
    check()


def test_s3fifo_leaves_its_order_only_on_a_clear_lead():
    """S3-FIFO goes over to LRU only when LRU's shadow leads by more than its SWITCH_MARGINS in
    standard deviations of the difference, 2 over the duel's window or 1 over the long one, and
    comes back, as every policy takes its order, once its own leads by more than ENTRY_MARGIN
    in both (SLRU leaves on any lead of LRU's count). The deviation comes from each prompt's difference: hits held by both shadows
    cancel, and a run of hits at once (a shared prefix) counts as one draw."""
    index = KVCacheManager(CacheSpec(4, 4096)).index
    policy = S3FIFOPolicy(4096, 4096, index, POLICIES["s3fifo"][1]())
    assert SLRUPolicy(4096, 4096, index, POLICIES["slru"][1]()).shadows.margins == (0, 0)
    switch = policy.shadows
    short, long_ = switch.windows
    margin = S3FIFOPolicy.SWITCH_MARGINS
    assert margin == (2, 1)
    steps = [([100, 90, 100], [0, 0, 0], False),  # LRU's order first
             ([100, 111, 100], [0, 11, 100], True),  # the own leads by 11 > sqrt(100)
             ([100, 90, 100], [0, 0, 0], True),  # LRU leads by 10 < 2 sqrt(100): stays
             ([200, 100, 900], [0, 0, 0], False),  # by 100 > 2 sqrt(900)
             ([120, 110, 100], [0, 0, 0], False),  # still LRU: its lead is not undone
             ([110, 110, 0], [0, 0, 0], False),  # a tie does not bring the own order back
             ([110, 120, 100], [0, 10, 100], False),  # nor a lead of 1 sigma, not more
             ([110, 121, 100], [0, 11, 100], True),  # more does
             # The long window: LRU leads by 50 > 1 sqrt(1600) there, 5 < 2 sqrt(400) here
             ([100, 95, 400], [1000, 950, 1600], False),
             ([100, 130, 400], [1000, 1030, 400], True),  # back: 30 > 20 in both
             ([100, 100, 0], [1000, 960, 1600], True)]  # 40 = 1 sqrt(1600): stays
    for duel_window, long_window, own in steps:
        short[:3], long_[:3] = duel_window, long_window
        policy._duel([], None, 0)
        assert policy.use_own is own, (duel_window, long_window, margin)
    # 300 keys LRU's shadow alone held: one run at once is one draw (sigma 300), not a lead;
    # one key at a time, 300 draws (sigma sqrt(300)), a clear one.
    for w in switch.windows:
        w[:3] = [0, 0, 0]
    assert _step(switch, True, 300, 0, 0)
    assert short[:3] == [300, 0, 90000]
    for w in switch.windows:
        w[:3] = [0, 0, 0]
    chosen = [_step(switch, True, 1, 0, 0) for _ in range(300)]
    assert chosen[0] and not chosen[-1]  # 1 < 2 sqrt(1); 300 > 2 sqrt(300)
    assert short[:3] == [300, 0, 300]
    # Each window halves its counts (and quarters the sum of squares) every its period: the
    # duel's, and LONG_WINDOW of them.
    period = 8 * 4096
    assert (short[3], long_[3]) == (period, shadows.LONG_WINDOW * period)
    for w in switch.windows:
        w[:3], w[4] = [1000, 1000, 400], w[3]
    _step(switch, False, 3, 3, 2 * period)
    assert short[:3] == [250, 250, 25] and long_[:3] == [1003, 1003, 400]


def test_s3fifo_queues_a_release_in_runs_of_one_count():
    """A release is queued in runs of one access count, in its order: returns one count
    higher each, and new data (count 0) between them, also where a return lies deeper than
    new data (a claimed block written since: here its stored record replaced)."""
    m = KVCacheManager(CacheSpec(1, 8, enable_partial_reuse=False, eviction_policy="s3fifo",
                                 policy_params=S3FIFOParams(shadow_sampling=0)))
    seq = m.add_sequence(req([1, 2, 3, 4, 5]))
    assert m.resize(seq, 5)
    m.commit(seq, 5)
    m.release(seq)
    policy, small = m.gpu.free_queue, 2 * 35  # the small FIFO at the release's level
    queue = policy.queue

    def counts():
        return [(b, queue.stamp_of(b)) for b in queue.fifo_order(small)]
    assert counts() == [(4, 0), (3, 0), (2, 0), (1, 0), (0, 0)]  # deepest first
    policy.remove_many([4])
    policy.push_back_many([4], 35)
    assert counts() == [(3, 0), (2, 0), (1, 0), (0, 0), (4, 1)]
    policy.remove_many([0, 1, 2, 3, 4])
    m.index.stored[2] = tuple(list(m.index.stored[2]))
    policy.push_back_many([4, 3, 2, 1, 0], 35)
    assert counts() == [(4, 2), (3, 1), (2, 0), (1, 1), (0, 1)]
    assert not queue.fifo_order(small + 1) and policy._check_sanity()


@pytest.mark.parametrize("name", ["slru", "s3fifo"])
def test_segments_requeue_as_lru_while_lru_leads(name, monkeypatch):
    """A block whose retention ends goes to the back of its new level in LRU order too. The
    scenario tells the orders apart: in its own order the policy's victims differ."""
    ret = Retention((TokenRangeRetention(0, 4, 90, 500.0),))

    def log(policy):
        m = KVCacheManager(CacheSpec(2, 6, enable_partial_reuse=False, eviction_policy=policy))
        m.enable_sanity_tracking()
        logged = m.gpu.free_queue = LoggedQueue(m.gpu.free_queue, m)
        m.refresh(0.0)
        _cache(m, Request(next(_ids), 0.0, 7, 1, tokens=np.array([1, 2, 3, 4, 5, 6, 9]),
                          retention=ret))
        m.refresh(0.6)
        for tokens in ([7, 8, 10, 11, 12, 13, 9], [14, 15, 16, 17, 18, 19, 9], [1, 2, 3, 4, 9],
                       [7, 8, 10, 11, 9], [20, 21, 22, 23, 9], [7, 8, 10, 11, 12, 13, 9]):
            _cache(m, req(tokens))
            assert m._check_sanity() and getattr(logged.inner, "_check_sanity", bool)()
        return logged.log

    lru = log("lru")
    _force_order(monkeypatch, lambda: True)
    assert log(name) != lru
    _force_order(monkeypatch, lambda: False)
    assert log(name) == lru and lru


@pytest.mark.parametrize("name", ["slru", "s3fifo"])
def test_segments_stay_consistent_when_the_duel_flips(name, monkeypatch):
    """The duel choosing either order at any release, the release order dropped and rebuilt
    at every chance (no slack): the interleaved-sequence invariants hold, and so do the
    policy's own (segment counts, ghosts, release order)."""
    rng = np.random.default_rng(0)
    _force_order(monkeypatch, lambda: bool(rng.integers(2)))
    monkeypatch.setattr(segment_duel, "_SLACK", 0)
    test_invariants_with_every_policy(name, "all")
    test_invariants_with_every_policy(name, "second_use")


def _root_run(held: list[bool]) -> int:
    """How many of a prompt's keys (deepest first) are held from the last one back to the
    first that is not: a loop, as `held_chain`'s slice and index are not."""
    n = 0
    while n < len(held) and held[len(held) - 1 - n]:
        n += 1
    return n


@st.composite
def segment_releases(draw):
    """Releases of distinct sampled keys (deepest first), each with whether the pool's history
    saw it before (SLRU)."""
    out = []
    for _ in range(draw(st.integers(1, 40))):
        keys = draw(st.lists(st.integers(0, 30), min_size=1, max_size=6, unique=True))
        out.append((keys, draw(st.lists(st.booleans(), min_size=len(keys),
                                        max_size=len(keys)))))
    return out


@settings(max_examples=200)
@given(releases=segment_releases(), cap=st.integers(1, 12))
def test_duel_judges_a_prompt_by_every_held_key_or_the_chain(releases, cap):
    """A prompt's count is how many of its keys a shadow holds (`sum`: lru2, gdsf and
    predictive) or, with `held_chain` (SLRU and S3-FIFO), how many from its root down to the
    first it does not (a prefix match reuses no more); a key whose matched block is in use (on
    the GPU, not free) is held by both. The LRU shadow holds the keys a list in LRU order
    would. The own shadow here is a set: the keys marked seen so far. The match found blocks
    0, 1, ... for all but the deepest key; odd ones are in use, those past the pool's `cap`
    blocks are on the host."""
    duels = [shadows.ShadowDuel(cap, 1, 1 << 30, 64, set(), count)
             for count in (sum, segment_duel.held_chain)]
    ref: list = []  # least recent first
    for keys, seen in releases:  # a prompt's keys deepest first, then its release
        n = len(keys)
        busy = [n - 1 - j < min(n - 1, cap) and (n - 1 - j) % 2 == 1 for j in range(n)]
        was = [k in ref or b for k, b in zip(keys, busy)]
        own = [k in duels[0].own or b for k, b in zip(keys, busy)]
        for duel, count in zip(duels, (sum, _root_run)):
            before = duel.windows[0][:2]
            duel.judge(np.array(keys[::-1], np.int64), list(range(n - 1)), lambda b: b % 2 == 0)
            assert duel.windows[0][:2] == [before[0] + count(was), before[1] + count(own)]
            duel.lru.replay(keys, cap)
            duel.own.update(k for k, s in zip(keys, seen) if s)
        ref = [k for k in ref if k not in keys] + keys
        del ref[:max(0, len(ref) - cap)]
        assert all(list(duel.lru.keys) == ref for duel in duels)
    assert segment_duel.held_chain([]) == 0
    assert segment_duel.held_chain([True, False, True, True]) == 2


@settings(max_examples=300)
@given(releases=segment_releases(), cap=st.integers(1, 12),
       ratio=st.sampled_from([0.1, 0.5, 0.8]))
def test_slru_shadow_matches_brute_force(releases, cap, ratio):
    """The SLRU shadow holds the keys of a key-at-a-time SLRU: a held or seen key to the
    protected tail, else the probation tail; protected's head demoted to probation's tail
    while over `ratio` of the shadow; then probation's head, else protected's, evicted while
    over capacity."""
    shadow = segment_duel.SLRUShadow(ratio)
    prob, prot = [], []
    for keys, seen in releases:
        assert [k in shadow for k in keys] == [k in prob or k in prot for k in keys]
        for k, s in zip(keys, seen):
            was = k in prob or k in prot
            for seg in (prob, prot):
                if k in seg:
                    seg.remove(k)
            (prot if was or s else prob).append(k)
        while len(prot) > int(ratio * cap):
            prob.append(prot.pop(0))
        while len(prob) + len(prot) > cap:
            (prob or prot).pop(0)
        shadow.replay(keys, seen, cap)
        assert list(shadow.probation) == prob and list(shadow.protected) == prot


@settings(max_examples=300)
@given(releases=segment_releases(), cap=st.integers(1, 12),
       ratio=st.sampled_from([0.1, 0.3, 0.6]), top=st.integers(1, 3),
       ghost_cap=st.integers(1, 6))
def test_s3fifo_shadow_matches_brute_force(releases, cap, ratio, top, ghost_cap):
    """The S3-FIFO shadow holds the keys of a key-at-a-time S3-FIFO: a held key to its FIFO's
    tail with its count one higher (up to `top`), a new one to main if a ghost, else small;
    then while over capacity, small's head while small is over its target or main is empty
    (to main, count cleared, if counted; else evicted, a ghost), else main's head (to its tail
    with its count lowered if counted; else evicted). Its ghosts are `GhostKeys` (checked against
    `KeyHistory` above): the same calls here."""
    shadow = segment_duel.S3FIFOShadow(ratio, top, GhostKeys(ghost_cap))
    ghosts = GhostKeys(ghost_cap)
    small, main = {}, {}  # key -> count, in FIFO order
    target = max(1, int(ratio * cap))
    for keys, _ in releases:
        assert [k in shadow for k in keys] == [k in small or k in main for k in keys]
        ghost = ghosts.contains(keys)
        for k, g in zip(keys, ghost):
            fifo = small if k in small else main if k in main else None
            if fifo is not None:
                fifo[k] = min(fifo.pop(k) + 1, top)
            else:
                (main if g else small)[k] = 0
        gone = []
        while len(small) + len(main) > cap:
            if len(small) > target or not main:
                k = next(iter(small))
                f = small.pop(k)
                if f:
                    main[k] = 0
                else:
                    gone.append(k)
            else:
                k = next(iter(main))
                f = main.pop(k)
                if f:
                    main[k] = f - 1
        if gone:
            ghosts.record(gone, False)
        shadow.replay(keys, cap)
        assert shadow.small == small and list(shadow.small) == list(small)
        assert shadow.main == main and list(shadow.main) == list(main)
        assert shadow.ghosts._order == ghosts._order
