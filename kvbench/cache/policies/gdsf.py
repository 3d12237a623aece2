"""GDSF adapted to prefix trees: frequency x cost / size with an inflation clock, with LRU as
a fallback chosen online by two shadow caches.

Greedy-Dual-Size-Frequency (Cherkasova 1998) evicts the object with the lowest
`H = L + frequency x cost / size`, where `L` is the `H` of the last victim, so old frequencies
age out without a decay pass. Here an object is one block: its size is one block and its cost
is the prefill its tokens save, the same for every full block, so `cost / size` is the constant
`freq_weight`. A block's frequency is the uses of its key, remembered past eviction in a
bounded history (otherwise every reuse would come back as frequency 1: on real traffic most
reuse comes after the block was evicted), up to `max_freq`.

Chain awareness: a block at depth `d` is only worth its tokens if the `d` blocks above it are
cached too, so a block's frequency is capped at its parent's (from the same release): a chain
is evicted from its tip, a parent only after its released descendants.

Frequency says a key is used often, not that it will be used again soon: where sessions end
(short chats, agent loops), the prefixes of finished sessions carry the highest frequencies and
outstay the new turns' blocks that LRU keeps (3.8 pp below LRU on chat traffic). So, as `lru2`
and `predictive` choose their order, the policy runs miniature simulations (Waldspurger et al.,
USENIX ATC'17): one key in `shadow_sampling` (by a hash; fewer in a small pool: `ShadowDuel`) is
replayed against two shadow caches of the pool's size scaled by that rate, one in LRU order and
one running GDSF on the keys (its own `L`). Each counts the sampled keys of a prompt it holds
when the prompt is matched; the counts halve every history period (`history_ratio` pool sizes of
released blocks), a second pair every 32 periods, and the pool starts in LRU order, evicts in
GDSF order once its shadow leads the LRU one by more than `shadow_entry` standard deviations of
the difference in both, and goes back when the LRU one holds more in either (`gdsf_order`,
`ShadowDuel.own_order`).
Both shadows are kept up to date, so switching is immediate. `shadow_sampling: 0` is the
published algorithm alone.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from heapq import heappop, heappush
from itertools import compress
from operator import eq

import numpy as np

from ..free_queue import NUM_PRIORITY_LEVELS
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import LOW_BYTE, ClassQueuePolicy, KeyHistory, chain_keys, tick_entries
from .runs import compact_runs
from .shadows import DuelParams, ShadowDuel, consume

_UNIT = 1024
"""H is kept in 1/1024ths of `freq_weight = 1` (ints compare exactly)."""
_ORDER_BITS = 64
_CLASS_BITS = 8
_H_SHIFT = _ORDER_BITS + _CLASS_BITS
"""A shadow run's heap key is `((H << 8 | class) << 64) | first insertion order`."""
_PRUNE_SLACK = 1024
"""Pushes `_levels` may hold beyond twice those kept at its last pruning."""


@dataclass(frozen=True, slots=True)
class GDSFParams(DuelParams):
    freq_weight: float = 1.0
    """H gained per earlier use of the block's key (L grows by about one victim's H)."""
    max_freq: int = 16
    """Uses beyond this count no more (at most 255; bounds how long a hot block survives)."""
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks; the shadow counts halve every such
    period."""
    shadow_sampling: int = 8
    """One key in this many feeds the LRU and GDSF shadow caches that choose the order (0: no
    shadows, always GDSF)."""


class GDSFPolicy(ClassQueuePolicy):
    """Class = frequency; stamp = the push's sequence number, whose L (when pushed) is
    `_levels`; H = L + freq_weight x frequency. While the LRU shadow leads, the score is the
    stamp itself: LRU order."""

    __slots__ = ("params", "history", "inflation", "gdsf_order", "_weight",
                 "_counted", "_levels", "_base", "_prune_at", "_shadow")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: GDSFParams) -> None:
        super().__init__(id_space, capacity, index, params.max_freq + 1)
        self.params = params
        self.history = KeyHistory(int(params.history_ratio * capacity))
        self.inflation = 0
        """L (in 1/1024ths): the H of the latest victim."""
        self._weight = int(params.freq_weight * _UNIT)
        self._counted = np.minimum(np.arange(256) + 1, params.max_freq)
        """By the uses remembered (0: not remembered): the uses so far, this one counted, up
        to max_freq."""
        # Why stamps are push numbers, not L: the fallback must be exact LRU (least recently
        # released first), and L orders pushes only loosely (every release between two
        # evictions has the same L, and among them the class would decide). A push number
        # orders them exactly, and L stays one list lookup away. Packing L and the push
        # number into one int would save the list but outgrows the queue's 62-bit bounds on
        # long traces (L only grows).
        self._levels: list[int] = []
        """L when each push since `_base` was made (non-decreasing), by stamp - `_base`."""
        self._base = 0
        """The stamp of `_levels[0]`; every queued block's stamp is at least this."""
        self._prune_at = _PRUNE_SLACK
        self._shadow = _Shadow(self._weight)
        if params.shadow_sampling:
            self.shadows = ShadowDuel(capacity, params.shadow_sampling, self.history.capacity,
                                      index.tpb, self._shadow, entry=params.shadow_entry)
        self.gdsf_order = not params.shadow_sampling
        """The order victims are taken in now (False: LRU, where a duel starts)."""

    def _classify(self, blocks: list[BlockId]) -> tuple[list[tuple[int, int]], int]:
        hist = self.history
        keys, partial = chain_keys(self.index, blocks)
        top = self.params.max_freq
        slots, earlier = hist.find(keys)
        freq = self._counted[earlier & LOW_BYTE]
        start = hist.clock
        hist.clock = start + keys.size + partial  # a partial block ticks, unremembered
        hist.store(keys, slots, tick_entries(start, keys.size) | freq, earlier)
        caps = np.minimum.accumulate(freq)  # none above its parent's
        duel = self.shadows
        if duel:
            picked = duel.picked(keys)
            if np.count_nonzero(picked):  # deepest first, as the pool's pushes
                sampled = keys[picked][::-1].tolist()
                cap = duel.capacity
                duel.lru.replay(sampled, cap)
                self._shadow.replay(sampled, caps[picked][::-1].tolist(), cap)
            self.gdsf_order = duel.own_order(self.gdsf_order, hist.clock)
        return self._cuts(caps, top, partial), self._now()

    def _now(self) -> int:
        """A new push's stamp (each push gets its own: a release, or a requeued block)."""
        levels = self._levels
        if len(levels) >= self._prune_at:
            self._prune()
        levels.append(self.inflation)
        return self._base + len(levels) - 1

    def _prune(self) -> None:
        """Drop the L of pushes older than every queued block (amortised O(1) per push)."""
        queue, mask = self.queue, self.queue.nonempty_mask()
        fifos = [q for q in range(mask.bit_length()) if mask >> q & 1]
        oldest = min(queue.head_stamps(fifos), default=self._base + len(self._levels))
        del self._levels[:oldest - self._base]
        self._base = oldest
        self._prune_at = 2 * len(self._levels) + _PRUNE_SLACK

    def _head_scores(self, classes: list[int], stamps: list[int]) -> list[int]:
        if not self.gdsf_order:
            return stamps
        w, levels, base = self._weight, self._levels, self._base
        return [levels[t - base] + w * c for c, t in zip(classes, stamps)]

    def _max_stamp(self, cls: int, score: int) -> int:
        if not self.gdsf_order:
            return score
        return self._base + bisect_right(self._levels, score - self._weight * cls) - 1

    def _evicted(self, stamp: int, cls: int) -> None:
        # L follows the victims in either order: GDSF's H of the last victim.
        h = self._levels[stamp - self._base] + self._weight * cls
        if h > self.inflation:
            self.inflation = h

    def _check_sanity(self) -> bool:
        levels, duel = self._levels, self.shadows
        assert levels == sorted(levels) and (not levels or levels[-1] <= self.inflation)
        queue = self.queue
        assert all(queue.stamp_of(b) >= self._base
                   for q in range(NUM_PRIORITY_LEVELS * self.num_classes)
                   for b in queue.fifo_order(q))
        assert len(self._shadow) <= duel.capacity if duel else not len(self._shadow)
        assert (len(duel.lru) <= duel.capacity if duel else self.gdsf_order)
        assert self._shadow._check_sanity()
        return super()._check_sanity()


class _Shadow:
    """A shadow cache of sampled keys running GDSF on keys, trimmed to its capacity after each
    release: a release's keys get `H = L + weight x class` with the shadow's own `L` (the H
    of its last victim), and the lowest `(H, class, insertion order)` leaves first. Kept as
    lru2's LRU-2 shadow is: a dict of each key's live insertion order and a heap of a release's
    runs of one class (a run's H is fixed when inserted); a key used again leaves a stale
    entry behind, skipped when it surfaces. It sees keys, not chains (a sampled key can hit
    after its parent left): an estimate of GDSF's hit rate, not a replay."""

    __slots__ = ("live", "heap", "entries", "order", "inflation", "weight")

    def __init__(self, weight: int) -> None:
        self.live: dict = {}
        """Key -> the insertion order of its live entry."""
        self.heap: list[list] = []
        """`[key, orders, keys, next]`: a release's keys of one class in insertion order, the
        first `next` of them gone."""
        self.entries = 0
        """Entries in the runs from their `next` on, stale ones included."""
        self.order = 0
        self.inflation = 0
        self.weight = weight

    def __len__(self) -> int:
        return len(self.live)

    def __contains__(self, key: int) -> bool:
        return key in self.live

    def replay(self, keys: list, classes: list[int], cap: int) -> None:
        """Insert a release's `keys` (deepest first; the shadow keeps the list) of `classes`
        (non-decreasing: capped at the parent's)."""
        live = self.live
        n = len(keys)
        order = self.order
        self.order = order + n
        live.update(zip(keys, range(order + 1, order + n + 1)))
        size = len(live)
        heap = self.heap
        h0, w = self.inflation << _CLASS_BITS, self.weight << _CLASS_BITS
        c = classes[0]
        if c == classes[-1]:  # most releases: one class
            heappush(heap, [(h0 + w * c | c) << _ORDER_BITS | order + 1,
                            range(order + 1, order + n + 1), keys, 0])
        else:
            i = 0
            while i < n:  # runs of one class
                c = classes[i]
                j = n if classes[-1] == c else bisect_right(classes, c, i)
                first = order + 1 + i
                heappush(heap, [(h0 + w * c | c) << _ORDER_BITS | first,
                                range(first, order + 1 + j), keys[i:j], 0])
                i = j
        entries = self.entries + n
        if size > cap:
            get, pop = live.get, live.pop
            inflation = self.inflation
            while True:  # the front run's keys still live there, the excess at a time
                run = heap[0]
                key, orders, run_keys, k = run
                end = k + size - cap
                if end >= len(run_keys):  # the whole rest of the run
                    heappop(heap)
                    if k:
                        run_keys, orders = run_keys[k:], orders[k:]
                    end = k + len(run_keys)
                else:
                    run[3] = end
                    run_keys, orders = run_keys[k:end], orders[k:end]
                # Keys in a run are distinct: popping one changes no later one's `get`.
                consume(map(pop, compress(run_keys, map(eq, map(get, run_keys), orders))))
                entries -= end - k
                if len(live) < size:
                    size = len(live)
                    if key >> _H_SHIFT > inflation:
                        inflation = key >> _H_SHIFT
                    if size <= cap:
                        break
            self.inflation = inflation
        self.entries = entries
        if entries > 4 * size + 256:
            self._compact()

    def _compact(self) -> None:
        """Drop the stale keys of the runs (heap keys stay)."""
        self.heap = compact_runs(self.heap, self.live)
        self.entries = len(self.live)

    def _check_sanity(self) -> bool:
        entries = [(x, o) for _, orders, keys, k in self.heap
                   for o, x in zip(orders[k:], keys[k:])]
        assert len(entries) == self.entries
        assert sorted(e for e in entries if self.live.get(e[0]) == e[1]) == sorted(
            self.live.items())
        return True
