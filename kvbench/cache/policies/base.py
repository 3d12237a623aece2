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

from ..free_queue import NUM_PRIORITY_LEVELS, FreeQueue
from ..ids import BlockId, BlockKey
from ..radix import PrefixIndex


_NO_BOUND = 1 << 62


class KeyHistory:
    """Bounded memory of the keys used lately: `key -> (clock << 8) | small payload`.

    It outlives eviction on purpose (a ghost list, in cache terms): on real traffic most reuse
    comes after the block was evicted, so a policy that forgot a key with its block would never
    see a second use. The owner writes `map` directly, in its own per-block loop (the hot
    path), and advances `clock` (one tick per released block); when the map
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

    def record_each(self, keys: list) -> list[bool]:
        """Record each of `keys` (distinct; None is skipped, as never seen) at its own tick,
        settling as the map fills; returns whether each was remembered just before."""
        m, clock, limit = self.map, self.clock, 2 * self.capacity
        seen: list[bool] = []
        for key in keys:
            if key is None:
                seen.append(False)
                continue
            seen.append(key in m)
            clock += 1
            m[key] = clock << 8
            if len(m) > limit:
                self.clock = clock
                self.settle()
                m = self.map
        self.clock = clock
        return seen

    def settle(self) -> None:
        """Drop old keys if the map is full (call after writing to `map` directly)."""
        if len(self.map) > 2 * self.capacity:
            cut = (self.clock - self.capacity) << 8
            self.map = {k: v for k, v in self.map.items() if v >= cut}


class ClassQueuePolicy:
    """Blocks in classes, each class a FIFO per priority level (in release order), ordered by
    a score `head_score(class, stamp)` that grows with the stamp inside a class.

    A subclass gives each released block a class and the release one stamp (`_classify`), and
    gives the score of a class's head (`_head_scores`); scores may change over time (learnt
    estimates), but never the order inside a class. The victim is the head with the lowest
    score among the classes at the lowest priority level (ties: the lower class). So every
    operation is O(1), or O(classes) per run of victims taken from one class. The FIFOs are
    one `FreeQueue` with a class per policy class, which writes a run's links, FIFO and
    stamp in one pass.

    A release pushes its deepest block first, and a subclass caps each block's class at its
    parent's, so inside a class the deeper block leaves first, and across classes a child
    outranks its parent only if a lower class can score higher than a higher one at the same
    stamp (subclasses keep head scores monotone in the class)."""

    __slots__ = ("index", "capacity", "num_classes", "queue", "stamp")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 num_classes: int) -> None:
        self.index = index
        self.capacity = capacity
        self.num_classes = num_classes
        self.queue = FreeQueue(id_space, num_classes)
        self.stamp = [0] * id_space
        """The stamp of the release that queued the block."""

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, block: BlockId) -> bool:
        return block in self.queue

    def push_back(self, block: BlockId, priority: int) -> None:
        self.push_back_many([block], priority)

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        if not blocks:
            return
        cuts, stamp = self._classify(blocks)
        push, stamps = self.queue.push_run, self.stamp
        q0 = priority * self.num_classes
        # A chain's classes only fall away from its root, so the release is a few runs of
        # one class each; `blocks` come deepest first, so its runs are the cuts reversed.
        n = len(blocks)
        end = n
        for pos, c in reversed(cuts):
            push(blocks[n - end:n - pos] if pos or end < n else blocks, q0 + c, stamps, stamp)
            end = pos

    def remove(self, block: BlockId) -> None:
        self.queue.remove(block)

    def requeue(self, block: BlockId, priority: int) -> None:
        """To the back of its class at level `priority`, stamped now (not a use)."""
        q = self.queue
        c = q.fifo_of(block) % self.num_classes
        q.remove(block)
        q.push_run([block], priority * self.num_classes + c, self.stamp, self._now())

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        queue, stamps = self.queue, self.stamp
        classes = self.num_classes
        every = (1 << classes) - 1
        while len(out) < n and len(queue):
            mask = queue.nonempty_mask()
            low = (mask & -mask).bit_length() - 1
            q0 = low - low % classes
            live_mask = (mask >> q0) & every
            c = low - q0
            if live_mask & (live_mask - 1):  # several classes at this level
                live = [k for k in range(c, classes) if live_mask >> k & 1]
                scores = self._head_scores(live, [stamps[queue.head(q0 + k)] for k in live])
                best = min(range(len(live)), key=scores.__getitem__)  # ties: the lower class
                c = live[best]
                # The run of c's heads that still beat every other class's head: a lower
                # class wins ties, so against it c must score strictly less.
                max_stamp = _NO_BOUND
                for i, other in enumerate(live):
                    if i != best:
                        t = self._max_stamp(c, scores[i], strict=other < c)
                        if t < max_stamp:
                            max_stamp = t
                run = queue.pop_upto(q0 + c, n - len(out), stamps, max_stamp)
            else:
                run = queue.pop_upto(low, n - len(out))
            self._evicted(stamps[run[-1]], c)
            out += run
        return out

    def order(self) -> list[BlockId]:
        """Eviction order if nothing changed meanwhile (tests; O(n log n))."""
        entries = []
        for q in range(NUM_PRIORITY_LEVELS * self.num_classes):
            level, c = divmod(q, self.num_classes)
            for i, b in enumerate(self.queue.fifo_order(q)):
                entries.append((level, self._head_scores([c], [self.stamp[b]])[0], c, i, b))
        entries.sort()
        return [BlockId(e[4]) for e in entries]

    # --- for subclasses -------------------------------------------------------------------

    def _classify(self, blocks: list[BlockId]) -> tuple[list[tuple[int, int]], int]:
        """Classes of a release's `blocks` (deepest first), none above its parent's, as cuts
        `(position, class)`: from the shallowest block's position 0 on, each cut's class
        holds up to the next cut's position (positions count from the shallowest block); and
        the release's stamp (an int that never decreases from one release to the next)."""
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

    def _evicted(self, stamp: int, cls: int) -> None:
        """Called after each run of victims taken from class `cls`, with its last one's stamp
        (the highest)."""

    def _check_sanity(self) -> bool:
        return self.queue._check_sanity()
