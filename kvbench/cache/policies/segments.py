"""Two-queue policies over the LRU free queue: SLRU/2Q and S3-FIFO.

Both keep a block's free copies in one of two `FreeQueue`s (so every operation stays O(1)) and
learn a key's earlier uses from a bounded `KeyHistory` that outlives eviction (the ghost list of
2Q and S3-FIFO). A claimed (in-use) block leaves its queue, as with LRU, and re-enters at the
tail of its queue on release: in cache mode every access is a claim and a release. Retention
priority levels come first: victims come from the lowest level holding a free block in either
queue, and the two-queue logic orders the blocks inside it. A release pushes a sequence's
deepest block first, so inside a queue children leave before their parents.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..free_queue import FreeQueue
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import KeyHistory, key_of


class _TwoQueues:
    """What SLRU and S3-FIFO share: a `first` queue (probation / small), a `second` one
    (protected / main), and which data each block last held."""

    __slots__ = ("index", "capacity", "first", "second", "history", "_rec")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 history_ratio: float) -> None:
        self.index = index
        self.capacity = capacity
        self.first = FreeQueue(id_space)
        self.second = FreeQueue(id_space)
        self.history = KeyHistory(int(history_ratio * capacity))
        self._rec: list = [None] * id_space
        """The stored record a block held when last queued: a different one is new data."""

    def __len__(self) -> int:
        return len(self.first) + len(self.second)

    def __contains__(self, block: BlockId) -> bool:
        return block in self.first or block in self.second

    def push_back(self, block: BlockId, priority: int) -> None:
        self.push_back_many([block], priority)

    def requeue(self, block: BlockId, priority: int) -> None:
        """To the back of its queue at level `priority` (its retention ended; not a use)."""
        (self.second if block in self.second else self.first).requeue(block, priority)

    def remove(self, block: BlockId) -> None:
        """A claim: the block is in use (a hit, or a partial match being taken)."""
        (self.second if block in self.second else self.first).remove(block)

    def _check_sanity(self) -> bool:
        for b in range(len(self._rec)):
            assert not (b in self.first and b in self.second)
        return True


@dataclass(frozen=True, slots=True)
class SLRUParams:
    protected_ratio: float = 0.8
    """Most of the pool the protected segment may hold."""
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks."""


class SLRUPolicy(_TwoQueues):
    """Segmented LRU with a ghost history (a 2Q flavour): a block enters the protected segment
    when it is reused while cached or when its key was used before (within the history), else
    probation. The protected segment is capped at `protected_ratio` of the pool: its LRU block
    is demoted to the probation tail. Victims: probation's LRU first, protected's when
    probation has none at the lowest priority level."""

    __slots__ = ("params", "_cap")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: SLRUParams) -> None:
        super().__init__(id_space, capacity, index, params.history_ratio)
        self.params = params
        self._cap = int(params.protected_ratio * capacity)

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        hist, last = self.history, self._rec
        seen = hist.map
        recs = list(map(self.index.stored.__getitem__, blocks))
        probation: list[BlockId] = []
        protected: list[BlockId] = []
        to_probation, to_protected = probation.append, protected.append
        # A block queued again with the data it held when last queued left the queue by a
        # claim (eviction forgets the data), so it was reused while cached: protected. Keys in
        # a chain are distinct, so whether a key was seen is decided before this release
        # records its uses (one C-level update below, not a dict store per block).
        for b, rec in zip(blocks, recs):
            if rec is last[b]:
                to_protected(b)
            else:  # new data: protected if its key was used before (None never is)
                last[b] = rec
                (to_protected if rec[0] in seen else to_probation)(b)
        # The sequence touched its blocks shallowest first: one clock tick each.
        clock, n = hist.clock, len(recs)
        recs.reverse()
        hist.record_chain(list(map(key_of, recs)),
                          range((clock + 1) << 8, (clock + n + 1) << 8, 256), clock + n)
        self.first.push_back_many(probation, priority)
        second = self.second
        second.push_back_many(protected, priority)
        excess = len(second) - self._cap
        while excess > 0:  # demote protected's LRU end, one run per level
            level = second.lowest_level()
            run = second.pop_level_upto(level, excess)
            self.first.push_back_many(run, level)
            excess -= len(run)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        first, second, rec = self.first, self.second, self._rec
        while len(out) < n and (len(first) or len(second)):
            lf, ls = first.lowest_level(), second.lowest_level()
            q, level = (first, lf) if lf <= ls else (second, ls)
            run = q.pop_level_upto(level, n - len(out))
            for b in run:
                rec[b] = None
            out.extend(run)
        return out


@dataclass(frozen=True, slots=True)
class S3FIFOParams:
    small_ratio: float = 0.1
    """Share of the pool the small (probation) FIFO aims at."""
    max_freq: int = 3
    """Accesses counted per block (the main FIFO's second chances)."""
    history_ratio: float = 1.0
    """Ghost keys remembered, as a multiple of the pool's blocks (S3-FIFO: the main FIFO's
    size)."""


class S3FIFOPolicy(_TwoQueues):
    """S3-FIFO (Yang et al., SOSP'23): new data enters a small FIFO, or the main FIFO when its
    key is in the ghost history of keys evicted from the small one. Eviction takes from the
    small FIFO while it holds more than `small_ratio` of the pool: its head goes to the main
    FIFO if it was accessed since it entered, else it is evicted and its key becomes a ghost.
    Otherwise from the main FIFO: a head accessed since its last pass gets its count lowered
    and goes back to the tail (second chance), else it is evicted."""

    __slots__ = ("params", "_target", "_freq", "_hit", "_in_second")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: S3FIFOParams) -> None:
        super().__init__(id_space, capacity, index, params.history_ratio)
        self.params = params
        self._target = max(1, int(params.small_ratio * capacity))
        self._freq = bytearray(id_space)
        self._hit = bytearray(id_space)
        """Claimed (reused) since it was last queued."""
        self._in_second = bytearray(id_space)
        """In (or, while claimed, returning to) the main FIFO."""

    def remove(self, block: BlockId) -> None:
        (self.second if self._in_second[block] else self.first).remove(block)
        self._hit[block] = 1

    def _check_sanity(self) -> bool:
        for b in range(len(self._in_second)):
            if b in self.first:
                assert not self._in_second[b]
            if b in self.second:
                assert self._in_second[b]
        return True

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        hit, in_second, freq, stored = self._hit, self._in_second, self._freq, self.index.stored
        ghosts = self.history.map
        top = self.params.max_freq
        small: list[BlockId] = []
        main: list[BlockId] = []
        last = self._rec
        for b in blocks:
            rec = stored[b]
            if rec is not last[b]:  # data it did not hold when last queued
                last[b] = rec
                hit[b] = 0
                freq[b] = 0
                key = rec[0]
                in_second[b] = key is not None and key in ghosts
            elif hit[b]:
                hit[b] = 0
                if freq[b] < top:
                    freq[b] += 1
            (main if in_second[b] else small).append(b)
        self.first.push_back_many(small, priority)
        self.second.push_back_many(main, priority)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        first, second, in_second, freq = self.first, self.second, self._in_second, self._freq
        hist, stored, rec = self.history, self.index.stored, self._rec
        while len(out) < n and (len(first) or len(second)):
            lf, ls = first.lowest_level(), second.lowest_level()
            if lf < ls or (lf == ls and len(first) > self._target):
                # The small FIFO's unaccessed heads are evicted as one run (down to its target
                # size while the main FIFO has blocks at this level); an accessed head moves.
                k = n - len(out) if lf < ls else min(n - len(out), len(first) - self._target)
                run = first.pop_level_upto(lf, k, freq, 0)
                if run:
                    for b in run:
                        key = stored[b][0]
                        if key is not None:
                            hist.clock += 1
                            hist.map[key] = hist.clock << 8
                            hist.settle()
                        rec[b] = None
                    out.extend(run)
                else:
                    b = first.front()
                    first.remove(b)
                    freq[b] = 0
                    in_second[b] = 1
                    second.push_back(b, lf)
            else:
                run = second.pop_level_upto(ls, n - len(out), freq, 0)
                if run:
                    for b in run:
                        in_second[b] = 0
                        rec[b] = None
                    out.extend(run)
                else:  # an accessed head: a second chance at the tail
                    b = second.front()
                    second.remove(b)
                    freq[b] -= 1
                    second.push_back(b, ls)
        return out
