"""A predictive policy that learns from the traffic as it replays (no look-ahead).

Each released block falls in a class: how many times its key has been used (1, 2, ...,
`max_class` or more), remembered past eviction in a bounded history. For every class the
policy counts uses and how many of them were followed by another use of the same key within a
horizon of `horizon_ratio` x the pool's blocks of traffic (the clock counts released blocks,
so the horizon scales with the load, not with wall time). That share, smoothed towards a prior,
is the class's estimated chance of reuse soon, `p`.

A block's score is `release clock + boost x horizon x p` with the class's *current* `p`: LRU
order, where a block expected to be reused is kept as if it had been released
`boost x horizon x p` blocks of traffic later. With `p` equal for every class this is exactly
LRU; the more the classes differ on the traffic, the further the policy departs from LRU.
Outcomes are learnt only when they happen: a use still inside its horizon has not counted as
a miss yet, so early estimates lean low for every class alike.

How far to depart is measured, not assumed. A class's `p` says a key used k times is likely used
again, not when: on traffic where sessions end (agent loops, short chats), the prefixes of
finished sessions carry the highest classes and would outstay the new turns' blocks that LRU
keeps, losing several points to LRU. So, as `lru2` chooses its order, the policy runs miniature
simulations (Waldspurger et al., USENIX ATC'17): one key in `shadow_sampling` (by a hash; fewer
in a small pool: `ShadowDuel`) is replayed against two shadow caches of the pool's size scaled
by that rate, one in LRU order and one in this policy's order with the whole boost. Each counts
the sampled keys of a prompt it holds when the prompt is matched; the counts halve every history
period (`history_ratio` pool sizes of released blocks), a second pair every 32 periods, and the
pool, which starts in LRU order, applies the boost once its shadow leads the LRU one by more
than `shadow_entry` standard deviations of the difference in both, until the LRU one holds more
in either (`boosting`, `ShadowDuel.own_order`). Both shadows are kept up to date, so switching
is immediate.

Prefix trees: a block's class is capped at its parent's (from the same release) and `p` is
made non-decreasing over the classes (a running maximum), so a child never outranks its parent
and, at equal score, the deeper block goes first.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import compress
from operator import eq

import numpy as np

from ..ids import BlockId
from ..radix import PrefixIndex
from .base import LOW_BYTE, ClassQueuePolicy, KeyHistory, chain_keys, tick_entries
from .shadows import DuelParams, ShadowDuel, consume

# A third shadow at 1/8 of the boost, tried on the shipped traces and on agent-like traffic,
# gained at most 0.06 pp and slowed the replay by a fifth: the choice is all or nothing.


@dataclass(frozen=True, slots=True)
class PredictiveParams(DuelParams):
    horizon_ratio: float = 16.0
    """Reuse counts as 'soon' within this many pool sizes of released blocks."""
    boost: float = 4.0
    """How far (in horizons) a block with certain reuse is kept past LRU order."""
    max_class: int = 6
    """Uses counted separately up to this (at most 255); more fall in the last class."""
    prior: float = 0.2
    """Reuse chance assumed for a class before it has data."""
    prior_weight: float = 20.0
    """Pseudo-uses the prior counts for."""
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks; the shadow counts halve every such
    period."""
    shadow_sampling: int = 8
    """One key in this many feeds the LRU and whole-boost shadow caches that choose whether
    the pool applies the boost (0: no shadows, always the boost)."""


class PredictivePolicy(ClassQueuePolicy):
    __slots__ = ("params", "history", "uses", "reuses", "boosting", "_horizon",
                 "_scale", "_shift", "_no_shift", "_next_class", "_shadow_boost")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: PredictiveParams) -> None:
        super().__init__(id_space, capacity, index, params.max_class + 1)
        self.params = params
        self.history = KeyHistory(int(params.history_ratio * capacity))
        self.uses = [0] * (params.max_class + 1)
        """Per class: uses seen (class 0 is unused)."""
        self.reuses = [0] * (params.max_class + 1)
        """Per class: uses followed by another use within the horizon."""
        self._horizon = int(params.horizon_ratio * capacity)
        self._next_class = np.minimum(np.arange(256) + 1, params.max_class)
        """A use's class by the uses remembered before it (0: not remembered)."""
        self._scale = params.boost * self._horizon
        self._no_shift = [0] * (params.max_class + 1)
        self._shift = self._no_shift
        """Per class: `boost x horizon x p` (an int), non-decreasing over the classes, while
        `boosting`; else all 0 (LRU order)."""
        self.boosting = not params.shadow_sampling
        """Whether the pool applies the boost now (False: LRU order, where a duel starts)."""
        self._shadow_boost = _Shadow(params.max_class + 1)
        # LRU order is a stamp's keys deepest first: the duel's plain LRU shadow.
        if params.shadow_sampling:
            self.shadows = ShadowDuel(capacity, params.shadow_sampling, self.history.capacity,
                                      index.tpb, self._shadow_boost, entry=params.shadow_entry)

    def _classify(self, blocks: list[BlockId]) -> tuple[list[tuple[int, int]], int]:
        hist = self.history
        keys, partial = chain_keys(self.index, blocks)
        top = self.params.max_class
        slots, earlier = hist.find(keys)
        was = earlier & LOW_BYTE  # 0: not remembered
        cls = self._next_class[was]  # a key not remembered: class 1
        start, n = hist.clock, keys.size
        hist.clock = start + n + partial  # a partial block ticks, unremembered
        # A use followed by this one within the horizon was reused soon: its entry is at
        # least the entry of the tick `horizon` before this one's (the payload is below one
        # tick), so one arange stands for the ticks, the shift and the subtraction. Keys not
        # remembered fall in bin 0 (their entry 0 may be within it): dropped, class 0 is
        # unused.
        soon = np.bincount(was[earlier >= tick_entries(start - self._horizon, n)],
                           minlength=top + 1).tolist()
        soon[0] = 0
        used = np.bincount(cls, minlength=top + 1)
        used[1] += partial
        self.reuses = [a + b for a, b in zip(self.reuses, soon)]
        self.uses = [a + b for a, b in zip(self.uses, used.tolist())]
        hist.store(keys, slots, tick_entries(start, n) | cls, earlier)
        caps = np.minimum.accumulate(cls)  # none above its parent's
        boosted = self._boosted_shifts()
        if self.shadows:
            self._replay(self.shadows, keys, caps, start, boosted)
        self._shift = boosted if self.boosting else self._no_shift
        return self._cuts(caps, top, partial), start

    def _boosted_shifts(self) -> list[int]:
        """Per class: `boost x horizon x p`, `p` the learnt chance that a use of the class is
        followed by another within the horizon (smoothed towards the prior), made
        non-decreasing over the classes."""
        p = self.params
        scale, weight = self._scale, p.prior_weight
        pseudo = p.prior * weight
        shifts = [0]
        best = 0.0
        for reuses, uses in zip(self.reuses[1:], self.uses[1:]):
            shift = scale * ((reuses + pseudo) / (uses + weight))
            if shift > best:
                best = shift
            shifts.append(int(best))
        return shifts

    def _replay(self, duel: ShadowDuel, keys: np.ndarray, caps: np.ndarray, stamp: int,
                boosted: list[int]) -> None:
        """Replay a release's sampled keys (`keys` shallowest first, `caps` their capped
        classes) into the LRU and the boosted shadow, and apply the boost while the duel
        chooses it (`ShadowDuel.own_order`)."""
        picked = duel.picked(keys)
        if np.count_nonzero(picked):
            sampled = keys[picked][::-1].tolist()  # deepest first, as the pool's pushes
            caps = caps[picked]
            # Runs of one class, deepest first: the capped classes fall from the root, so
            # each present class's keys follow those of the classes below it.
            counts = np.bincount(caps).tolist()
            runs, at = [], 0
            for c, k in enumerate(counts):
                if k:
                    runs.append((c, at, at + k))
                    at += k
            cap = duel.capacity
            duel.lru.replay(sampled, cap)
            self._shadow_boost.replay(sampled, runs, stamp, boosted, cap)
        self.boosting = duel.own_order(self.boosting, self.history.clock)

    def _now(self) -> int:
        return self.history.clock

    def _check_sanity(self) -> bool:
        duel, boost = self.shadows, self._shadow_boost
        assert (len(duel.lru) <= duel.capacity and len(boost) <= duel.capacity if duel
                else not len(boost))
        assert self._shadow_boost._check_sanity()
        assert self.boosting or self._shift is self._no_shift
        return super()._check_sanity()

    def _head_scores(self, classes: list[int], stamps: list[int]) -> list[int]:
        shift = self._shift
        return [t + shift[c] for c, t in zip(classes, stamps)]

    def _max_stamp(self, cls: int, score: int) -> int:
        return score - self._shift[cls]


class _Shadow:
    """A shadow cache of sampled keys in the pool's order (per class a FIFO of runs, the head
    with the lowest `stamp + shift` leaves first, the lower class on a tie), trimmed to its
    capacity after each release. It sees keys, not chains (a sampled key can hit after its
    parent left): an estimate of that order's hit rate."""

    __slots__ = ("live", "runs", "order", "entries")

    def __init__(self, num_classes: int) -> None:
        self.live: dict = {}
        """Key -> the insertion order of its live entry (an older entry of the key is stale)."""
        self.runs = [deque() for _ in range(num_classes)]
        """Per class: `[stamp, orders, keys, next]`, a release's keys of one class in insertion
        order (deepest first), the first `next` of them gone."""
        self.order = 0
        self.entries = 0
        """Entries in the runs, stale ones included."""

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, key: int) -> bool:
        return key in self.live

    def replay(self, keys: list, runs: list[tuple[int, int, int]], stamp: int,
               shift: list[int], cap: int) -> None:
        """Insert a release's `keys` (deepest first), `runs` of them `(class, start, end)`."""
        live = self.live
        n = len(keys)
        order = self.order + 1
        self.order = order + n - 1
        live.update(zip(keys, range(order, order + n)))
        fifos = self.runs
        for c, i, j in runs:
            fifos[c].append([stamp, range(order + i, order + j), keys[i:j], 0])
        self.entries += n
        over = len(live) - cap
        get, pop = live.get, live.pop
        while over > 0:
            best, low = -1, 0
            for c, fifo in enumerate(fifos):
                if fifo:
                    score = fifo[0][0] + shift[c]
                    if best < 0 or score < low:
                        best, low = c, score
            fifo = fifos[best]
            run = fifo[0]
            _, orders, run_keys, k = run
            end = min(len(run_keys), k + over)
            part = run_keys[k:end]
            gone = list(compress(part, map(eq, map(get, part), orders[k:end])))
            consume(map(pop, gone))
            over -= len(gone)
            self.entries -= end - k
            if end == len(run_keys):
                fifo.popleft()
            else:
                run[3] = end
        if self.entries > 4 * len(live) + 256:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale keys of the runs."""
        get = self.live.get
        for c, fifo in enumerate(self.runs):
            kept = deque()
            for stamp, orders, run_keys, k in fifo:
                orders, run_keys = orders[k:], run_keys[k:]
                ok = list(map(eq, map(get, run_keys), orders))
                if any(ok):
                    kept.append([stamp, list(compress(orders, ok)),
                                 list(compress(run_keys, ok)), 0])
            self.runs[c] = kept
        self.entries = len(self.live)

    def _check_sanity(self) -> bool:
        entries = [(key, o) for fifo in self.runs for _, orders, keys, k in fifo
                   for o, key in zip(orders[k:], keys[k:])]
        assert len(entries) == self.entries
        assert sorted(e for e in entries if self.live.get(e[0]) == e[1]) == sorted(
            self.live.items())
        for fifo in self.runs:
            stamps = [run[0] for run in fifo]
            assert stamps == sorted(stamps)
        return True
