"""What the eviction policies share: the free-queue interface, a bounded key history, and
per-class FIFO queues ordered by a score.

An eviction policy owns the free blocks of one GPU pool that still cache reusable data (the
role `FreeQueue` plays for LRU, with the calls the manager makes): `push_back_many` when a
sequence releases blocks (in the order the manager frees them: a sequence's deepest block
first), `push_back` when a claim is undone, `remove` when a block is claimed (a hit, or a
partial match being taken), `pop_front_many` to choose victims, `requeue` when a block's retention
duration ends (it moves to another level; no use), and `__len__` / `__contains__`. Retention priorities come first with every policy: victims are taken from the
lowest priority level holding a free block, and a policy only orders the blocks inside a level
(so traffic-carried priorities and durations compose with any policy).

Prefix trees: a block is only useful with its whole prefix, and evicting a parent orphans its
children (they stay indexed, unreachable until the prefix is computed again). Every policy
keeps a released chain's order non-increasing with depth: a block never outranks its parent
from the same release, and at equal rank the deeper block goes first, so children leave
before their parents and orphans are rare.
"""

from __future__ import annotations

from bisect import bisect_right
from operator import itemgetter

from ..free_queue import FreeQueue
from ..ids import BlockId, BlockKey
from ..radix import PrefixIndex


_NO_BOUND = 1 << 62

key_of = itemgetter(0)
"""A stored record's block key (None for a partial block)."""


class KeyHistory:
    """Bounded memory of the keys used lately: `key -> (clock << 8) | small payload`.

    It outlives eviction on purpose (a ghost list, in cache terms): on real traffic most reuse
    comes after the block was evicted, so a policy that forgot a key with its block would never
    see a second use. The owner advances `clock` (one tick per released block); when the map
    holds twice `capacity` keys, keys last used `capacity` ticks ago or earlier are dropped
    (at most `capacity` keys are written in that many ticks), so a key is remembered for
    between `capacity` and about `2 x capacity` ticks, in amortised O(1)."""

    __slots__ = ("capacity", "map", "clock")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.map: dict[BlockKey, int] = {}
        self.clock = 0

    def __len__(self) -> int:
        return len(self.map)

    def lookup_chain(self, stored: list, blocks: list[BlockId]) -> tuple[list, list]:
        """The keys of a release's `blocks` (deepest first) and their entries (None: not
        remembered), both shallowest first, as the sequence touched them. Keys in a chain
        are distinct, so every lookup may come before the release records its uses."""
        keys = list(map(key_of, map(stored.__getitem__, reversed(blocks))))
        return keys, list(map(self.map.get, keys))

    def record_chain(self, keys: list, entries: list[int], clock: int) -> None:
        """Write `entries` for `keys` (from `lookup_chain`; a partial block's key None is not
        remembered), advance the clock to `clock` and settle."""
        m = self.map
        m.update(zip(keys, entries))
        m.pop(None, None)
        self.clock = clock
        self.settle()

    def settle(self) -> None:
        """Drop old keys if the map is full (call after writing to `map` directly)."""
        if len(self.map) > 2 * self.capacity:
            cut = (self.clock - self.capacity) << 8
            self.map = {k: v for k, v in self.map.items() if v >= cut}


class ClassQueuePolicy:
    """Blocks in classes, each class a FIFO (one `FreeQueue` per class, in release order),
    ordered by a score `head_score(class, stamp)` that grows with the stamp inside a class.

    A subclass gives each released block a class and the release one stamp (`_classify`), and
    gives the score of a class's head (`_head_scores`); scores may change over time (learnt
    estimates), but never the order inside a class. The victim is the head with the lowest
    score among the classes at the lowest priority level (ties: the lower class). So every
    operation is O(1), or O(classes) per run of victims taken from one class.

    A release pushes its deepest block first, and a subclass caps each block's class at its
    parent's, so inside a class the deeper block leaves first, and across classes a child
    outranks its parent only if a lower class can score higher than a higher one at the same
    stamp (subclasses keep head scores monotone in the class)."""

    __slots__ = ("index", "capacity", "queues", "stamp", "cls", "_size")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 num_classes: int) -> None:
        self.index = index
        self.capacity = capacity
        self.queues = [FreeQueue(id_space) for _ in range(num_classes)]
        self.stamp = [0] * id_space
        """The stamp of the release that queued the block."""
        self.cls = bytearray(id_space)
        """The block's class while it is queued."""
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: BlockId) -> bool:
        return block in self.queues[self.cls[block]]

    def push_back(self, block: BlockId, priority: int) -> None:
        self.push_back_many([block], priority)

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        if not blocks:
            return
        classes, stamp = self._classify(blocks)
        cls, stamps, queues = self.cls, self.stamp, self.queues
        for b in blocks:
            stamps[b] = stamp
        # A chain's classes only grow towards its root (the deepest block comes first), so
        # the release splits into a few runs of one class each.
        start, n = 0, len(blocks)
        while start < n:
            c = classes[start]
            end = bisect_right(classes, c, start)
            run = blocks[start:end]
            for b in run:
                cls[b] = c
            queues[c].push_back_many(run, priority)
            start = end
        self._size += len(blocks)

    def remove(self, block: BlockId) -> None:
        self.queues[self.cls[block]].remove(block)
        self._size -= 1

    def requeue(self, block: BlockId, priority: int) -> None:
        """To the back of its class at level `priority`, stamped now (not a use)."""
        self.stamp[block] = self._now()
        self.queues[self.cls[block]].requeue(block, priority)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        queues, stamps = self.queues, self.stamp
        while len(out) < n and self._size:
            level = min(q.lowest_level() for q in queues)
            live = [c for c, q in enumerate(queues) if q.lowest_level() == level]
            heads = [stamps[queues[c]._next[queues[c]._sentinel0 + level]] for c in live]
            scores = self._head_scores(live, heads)
            best = min(range(len(live)), key=scores.__getitem__)  # ties: the lower class
            c = live[best]
            # The run of c's heads that still beat every other class's head: a lower class
            # wins ties, so against it c must score strictly less.
            max_stamp = _NO_BOUND
            for i, other in enumerate(live):
                if i != best:
                    t = self._max_stamp(c, scores[i], strict=other < c)
                    if t < max_stamp:
                        max_stamp = t
            run = queues[c].pop_level_upto(level, n - len(out), stamps, max_stamp)
            self._size -= len(run)
            self._evicted(run, c)
            out.extend(run)
        return out

    def order(self) -> list[BlockId]:
        """Eviction order if nothing changed meanwhile (tests; O(n log n))."""
        entries = []
        for c, q in enumerate(self.queues):
            for i, b in enumerate(q.order()):
                s = self._head_scores([c], [self.stamp[b]])[0]
                entries.append((q._level[b], s, c, i, b))
        entries.sort()
        return [BlockId(e[4]) for e in entries]

    # --- for subclasses -------------------------------------------------------------------

    def _classify(self, blocks: list[BlockId]) -> tuple[list[int], int]:
        """Classes of a release's `blocks` (deepest first), none above its parent's, and the
        release's stamp (an int that never decreases from one release to the next)."""
        raise NotImplementedError

    def _now(self) -> int:
        """The stamp a release made now would get."""
        raise NotImplementedError

    def _head_scores(self, classes: list[int], stamps: list[int]) -> list[int]:
        """Scores (ints) of heads of `classes` with `stamps`; lower is evicted first."""
        raise NotImplementedError

    def _max_stamp(self, cls: int, score: int, strict: bool) -> int:
        """The largest stamp of class `cls` whose score is at most (`strict`: below) `score`."""
        raise NotImplementedError

    def _evicted(self, blocks: list[BlockId], cls: int) -> None:
        """Called with each run of victims, in eviction order."""

    def _check_sanity(self) -> bool:
        assert sum(len(q) for q in self.queues) == self._size
        for c, q in enumerate(self.queues):
            for b in q.order():
                assert self.cls[b] == c
        return True

