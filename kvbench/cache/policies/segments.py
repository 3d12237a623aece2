"""Two-queue policies over the LRU free queue: SLRU/2Q and S3-FIFO.

Both keep a block's free copies in one of two FIFOs per priority level, class 0 (probation /
small) and class 1 (protected / main) of one `FreeQueue` (so every operation stays O(1)), and
learn a key's earlier uses from a bounded `KeyHistory` that outlives eviction (the ghost list of
2Q and S3-FIFO). A claimed (in-use) block leaves its queue, as with LRU, and re-enters at the
tail of its queue on release: in cache mode every access is a claim and a release. Retention
priority levels come first: victims come from the lowest level holding a free block in either
queue, and the two-queue logic orders the blocks inside it. A release pushes a sequence's
deepest block first, so inside a queue children leave before their parents.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..free_queue import NUM_PRIORITY_LEVELS, FreeQueue
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import KeyHistory, record_key

_FIRST = int("01" * NUM_PRIORITY_LEVELS, 2)
"""FIFO mask of the first queue (class 0) at every level."""
_SECOND = _FIRST << 1
"""FIFO mask of the second queue (class 1) at every level."""


class _TwoQueues:
    """What SLRU and S3-FIFO share: the `first` queue (probation / small, class 0), the
    `second` one (protected / main, class 1), and which data each block last held."""

    __slots__ = ("index", "capacity", "queue", "num_second", "history", "_rec")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 history_ratio: float) -> None:
        self.index = index
        self.capacity = capacity
        self.queue = FreeQueue(id_space, 2)
        self.num_second = 0
        """Blocks in the second queue."""
        self.history = KeyHistory(int(history_ratio * capacity))
        self._rec: list = [None] * id_space
        """The stored record a block held when last queued: a different one is new data."""

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, block: BlockId) -> bool:
        return block in self.queue

    def push_back(self, block: BlockId, priority: int) -> None:
        self.push_back_many([block], priority)

    def requeue(self, block: BlockId, priority: int) -> None:
        """To the back of its queue at level `priority` (its retention ended; not a use)."""
        q = self.queue
        q.push_run([block], 2 * priority + (q.remove(block) & 1))

    def remove(self, block: BlockId) -> None:
        """A claim: the block is in use (a hit, or a partial match being taken)."""
        self.num_second -= self.queue.remove(block) & 1

    def _check_sanity(self) -> bool:
        assert self.queue._check_sanity()
        assert self.num_second == sum(len(self.queue.fifo_order(2 * lv + 1))
                                      for lv in range(NUM_PRIORITY_LEVELS))
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
        recs = list(map(self.index.stored.__getitem__, blocks))
        keys = [rec[0] for rec in recs]
        partial = keys[0] is None  # the deepest block may be partial (no key)
        n = len(blocks)
        known = np.array(keys[1:] if partial else keys, np.int64)
        slots, earlier = hist.find(known)
        seen = (earlier > 0).tolist()
        if partial:
            seen.insert(0, False)
        # The sequence touched its blocks shallowest first: one clock tick each, so the
        # deepest (first here) gets the latest.
        start = hist.clock
        hist.clock = start + n
        hist.store(known, slots, np.arange(start + n - partial, start, -1, dtype=np.int64) << 8,
                   earlier)
        probation: list[BlockId] = []
        protected: list[BlockId] = []
        to_probation, to_protected = probation.append, protected.append
        # A block queued again with the data it held when last queued left the queue by a
        # claim (eviction forgets the data), so it was reused while cached: protected.
        for b, rec, was in zip(blocks, recs, seen):
            if rec is last[b]:
                to_protected(b)
            else:  # new data: protected if its key was used before
                last[b] = rec
                (to_protected if was else to_probation)(b)
        queue = self.queue
        queue.push_run(probation, 2 * priority)
        queue.push_run(protected, 2 * priority + 1)
        self.num_second += len(protected)
        excess = self.num_second - self._cap
        while excess > 0:  # demote protected's LRU end, one run per level
            fifo = queue.lowest_fifo(_SECOND)
            run = queue.pop_upto(fifo, excess)
            queue.push_run(run, fifo - 1)
            self.num_second -= len(run)
            excess -= len(run)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        queue, rec = self.queue, self._rec
        # The lowest FIFO: probation before protected at each level.
        while len(out) < n and len(queue):
            fifo = queue.lowest_fifo()
            run = queue.pop_upto(fifo, n - len(out))
            if fifo & 1:
                self.num_second -= len(run)
            for b in run:
                rec[b] = None
            out += run
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

    __slots__ = ("params", "_target", "_freq", "_in_second")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: S3FIFOParams) -> None:
        super().__init__(id_space, capacity, index, params.history_ratio)
        self.params = params
        self._target = max(1, int(params.small_ratio * capacity))
        self._freq = bytearray(id_space)
        self._in_second = bytearray(id_space)
        """In (or, while claimed, returning to) the main FIFO."""

    def _check_sanity(self) -> bool:
        assert super()._check_sanity()
        for b in range(len(self._in_second)):
            f = self.queue.fifo_of(b)
            if f >= 0:
                assert self._in_second[b] == f & 1
        return True

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        in_second, freq = self._in_second, self._freq
        recs = list(map(self.index.stored.__getitem__, blocks))
        ghosts = self.history.contains(list(map(record_key, recs)))
        top = self.params.max_freq
        small: list[BlockId] = []
        main: list[BlockId] = []
        to_small, to_main = small.append, main.append
        last = self._rec
        for b, rec, ghost in zip(blocks, recs, ghosts):
            if rec is not last[b]:  # data it did not hold when last queued
                last[b] = rec
                freq[b] = 0
                in_second[b] = ghost
                (to_main if ghost else to_small)(b)
            else:
                # The same data: it left the queue by a claim since (an eviction forgets the
                # data), an access.
                if freq[b] < top:
                    freq[b] += 1
                (to_main if in_second[b] else to_small)(b)
        queue = self.queue
        queue.push_run(small, 2 * priority)
        queue.push_run(main, 2 * priority + 1)
        self.num_second += len(main)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        queue, in_second, freq = self.queue, self._in_second, self._freq
        stored, rec = self.index.stored, self._rec
        ghosts: list = []
        """Keys evicted from the small FIFO, in order: recorded when the call ends (nothing
        reads the history meanwhile)."""
        while len(out) < n and len(queue):
            fs, fm = queue.lowest_fifo(_FIRST), queue.lowest_fifo(_SECOND)
            lf = fs >> 1 if fs >= 0 else NUM_PRIORITY_LEVELS
            ls = fm >> 1 if fm >= 0 else NUM_PRIORITY_LEVELS
            num_first = len(queue) - self.num_second
            if lf < ls or (lf == ls and num_first > self._target):
                # The small FIFO's unaccessed heads are evicted as one run (down to its target
                # size while the main FIFO has blocks at this level); an accessed head moves.
                k = n - len(out) if lf < ls else min(n - len(out), num_first - self._target)
                run = queue.pop_upto(fs, k, freq, 0)
                if run:  # their keys become ghosts
                    ghosts += map(record_key, map(stored.__getitem__, run))
                    for b in run:
                        rec[b] = None
                    out += run
                else:
                    # Accessed heads move to the main FIFO's tail as a run: after the first,
                    # each one moves while the small FIFO holds more than its target.
                    moved = queue.pop_upto(fs, max(1, num_first - self._target), freq, 255, 1)
                    for b in moved:
                        freq[b] = 0
                        in_second[b] = 1
                    queue.push_run(moved, fs + 1)
                    self.num_second += len(moved)
            else:
                run = queue.pop_upto(fm, n - len(out), freq, 0)
                if run:
                    for b in run:
                        in_second[b] = 0
                        rec[b] = None
                    self.num_second -= len(run)
                    out += run
                else:  # accessed heads: a second chance each, at the tail in order
                    moved = queue.pop_upto(fm, len(queue), freq, 255, 1)
                    for b in moved:
                        freq[b] -= 1
                    queue.push_run(moved, fm)
        if ghosts:
            self.history.record_each(ghosts)
        return out
