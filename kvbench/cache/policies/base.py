"""What the eviction policies share: the free-queue interface, a bounded key history, and
per-class FIFO queues ordered by a score.

An eviction policy owns the free blocks of one GPU pool that still cache reusable data (the role
`FreeQueue` plays for LRU, with the calls the manager makes): `push_back_many` when a sequence
releases blocks (in the order the manager frees them: a sequence's deepest block first),
`push_back` when a claim is undone, `note_prompt` with the keys of a prompt being added that a
match can reuse (shallowest first) and the blocks its match found (a policy that judges its
order by the reuse it would give judges there: `ShadowDuel`), `remove_many` when a match's
blocks are claimed (hits, or a partial match being taken), `pop_front_many` to choose victims,
`requeue` when a block's retention ends (another level; not a use), and `__len__` /
`__contains__`. Retention priorities come first with every policy: victims are taken from the
lowest priority level holding a free block, and a policy only orders the blocks inside a level
(so traffic-carried priorities and durations compose with any policy).

Prefix trees: a block is only useful with its whole prefix, and evicting a parent orphans its
children (they stay indexed, unreachable until the prefix is computed again). Every policy
keeps a released chain's order non-increasing with depth: a block never outranks its parent
from the same release, and at equal rank the deeper block goes first, so children leave
before their parents and orphans are rare.
"""

from __future__ import annotations

from bisect import bisect_left
from itertools import compress, islice
from operator import itemgetter

import numpy as np

from ..free_queue import NUM_PRIORITY_LEVELS
from ..ids import BlockId, BlockKey
from ..radix import _KEY, _POSITION, _SOURCE, PrefixIndex
from .run_queue import RunQueue
from .shadows import ShadowDuel


_NO_BOUND = 1 << 62
_LIVE_SETS = 4096
"""Most sets of non-empty classes `ClassQueuePolicy` remembers (then it starts again)."""
record_key = itemgetter(0)
"""A stored record's block key (None for a partial block)."""

_EMPTY = -1
"""A free slot of a `KeyHistory` table: no block key is -1 (`hash()` never returns it, and
trace keys are non-negative)."""
# Constant operands of the per-release numpy calls are 0-d arrays: numpy 2 takes an array
# operand in ~300 ns and converts a Python or numpy scalar one in ~500 ns, on every call.
_NO_KEY = np.array(_EMPTY, np.int64)
_MIX = np.array(0x9E3779B97F4A7C15, np.uint64)
_ONE = np.array(1, np.int64)
_FEW = 8
"""Keys still probing after a numpy round step on one at a time once this few are left: a
round costs ~10 numpy calls whatever its size, a key's Python step a fraction of one."""
LOW_BYTE = np.array(255, np.int64)
"""An entry's payload: `entry & LOW_BYTE`."""
TICK_SHIFT = np.array(8, np.int64)
"""An entry's clock: `entry >> TICK_SHIFT`."""
_TICK = 1 << int(TICK_SHIFT)


DICT_HISTORY_MAX = 1 << 15
"""The largest `KeyHistory` recorded one key at a time that is kept in a dict (at most twice
that many keys: a few MB, which stays in the CPU caches); larger ones use the numpy table."""


def chain_keys(index: PrefixIndex, blocks: list[BlockId]) -> tuple[np.ndarray, bool]:
    """The keys of a release's full `blocks` (one sequence's, deepest first), shallowest
    first as the sequence touched them, and whether the deepest is a partial block (no key).

    A release is mostly one run of positions, whose keys are a slice of the keys of the
    request that stored its deepest block (keys chain the prefix, so that request's keys
    below it are the run's): one array slice instead of a record lookup and an int
    conversion per block."""
    partial, run = _one_run(index, blocks)
    if run is not None:
        source, start, end = run
        return source.block_keys_array(index.tpb)[start:end], partial
    chain = blocks[:0:-1] if partial else blocks[::-1]
    return np.fromiter(map(record_key, map(index.stored.__getitem__, chain)), np.int64,
                       len(chain)), partial


def tick_entries(clock: int, n: int) -> np.ndarray:
    """The entries of the `n` ticks after `clock`, payload 0 (`tick << TICK_SHIFT`, int64):
    what a release's keys, touched one tick each, are stored with."""
    return np.arange((clock + 1) * _TICK, (clock + n + 1) * _TICK, _TICK, np.int64)


def _one_run(index: PrefixIndex, blocks: list[BlockId]
             ) -> tuple[bool, tuple[object, int, int] | None]:
    """Whether the deepest of a release's `blocks` is partial, and when its full ones are one
    run of positions: the request that stored the deepest and the positions [start, end)."""
    stored = index.stored
    partial = stored[blocks[0]][_KEY] is None
    n = len(blocks) - partial
    if n:
        deepest = stored[blocks[partial]]
        end = deepest[_POSITION] + 1
        if stored[blocks[-1]][_POSITION] == end - n:  # positions fall one by one
            source = deepest[_SOURCE]
            assert source.block_keys(index.tpb)[end - 1] == deepest[_KEY]
            return partial, (source, end - n, end)
    return partial, None


def _keyed(keys: list, answer) -> list[bool]:
    """`answer(known)` for the keys that are not None, spread back over `keys` with False
    for each None (a block without a key was never seen)."""
    known = [k for k in keys if k is not None] if None in keys else keys
    if not known:
        return [False] * len(keys)
    seen = answer(known)
    if known is keys:
        return seen
    it = iter(seen)
    return [False if k is None else next(it) for k in keys]


class KeyHistory:
    """Bounded memory of the keys used lately: `key -> (clock << 8) | small payload`.

    It outlives eviction on purpose (a ghost list, in cache terms): on real traffic most reuse
    comes after the block was evicted, so a policy that forgot a key with its block would never
    see a second use. The owner reads (`find`) and writes (`store`) a release's keys at once
    and advances `clock` (one tick per released block); when it holds more than twice
    `capacity` keys, keys last used `capacity` ticks ago or earlier are dropped (at most
    `capacity` keys are written in that many ticks), so a key is remembered for between
    `capacity` and about `2 x capacity` ticks, in amortised O(1).

    Two backings with the same results, chosen by how the owner uses the history. One that
    reads and writes a release's keys at once (`find`, `store`: 2Q, lru2, GDSF, predictive)
    is an open-addressing table (linear probing) over two int64 arrays, a batch of distinct
    keys at a time with numpy: a dict misses the CPU caches on every access, one at a time,
    and a batch overlaps them (even with a 4096-block pool's history, a dict replays those
    policies about 1.3x slower on the conversation trace). One that records a key per tick
    (`per_key`: the admission filter's `record_each`) is a dict while small: it stays in
    the CPU caches, and a few dict operations per block cost less than the table's batch
    on the short releases of chat traffic. The dict is kept in entry order (a key written
    again moves to the end), so a drop cuts its oldest part off.

    The table drops keys lazily: a drop only raises the cut below which entries count as
    forgotten (one pass to count the keys left); forgotten keys keep their slots, and a key
    written again takes its old slot back, until the table is a third full of keys
    remembered or not and is rebuilt without the forgotten ones."""

    __slots__ = ("capacity", "clock", "count", "_keys", "_entries", "_mask", "_shift", "_map",
                 "_cut", "_used")

    def __init__(self, capacity: int, per_key: bool = False) -> None:
        self.capacity = max(1, capacity)
        self.clock = 0
        self.count = 0
        """Keys remembered (the table's; the dict's is its length)."""
        self._map: dict[BlockKey, int] | None = (
            {} if per_key and self.capacity <= DICT_HISTORY_MAX else None)
        """The dict backing, or None for the table."""
        self._cut = 1
        """Table entries below this are forgotten keys or free slots (0); entries written are
        at least `1 << 8` (ticks start at 1)."""
        self._used = 0
        """Table slots holding a key, remembered or forgotten."""
        self._keys: np.ndarray | None = None
        """The table's key column (its entry column is `_entries`), None for the dict."""
        if self._map is None:
            self._alloc(16)  # grows to stay at most a third full

    def __len__(self) -> int:
        return self.count if self._map is None else len(self._map)

    def find(self, keys: np.ndarray, slots: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray]:
        """The slots of distinct `keys` (int64) and their entries (0: not remembered; an entry
        written is at least `1 << 8`): where each key is, else the free slot ending its probe
        (from `slots`, or its home). With the dict backing the slots are the keys."""
        if self._map is not None:
            get = self._map.get
            return keys, np.array([get(k, 0) for k in keys.tolist()], np.int64)
        table, mask = self._keys, self._mask
        if slots is None:  # home slots by Fibonacci hashing: trace keys are structured ints
            slots = ((keys.view(np.uint64) * _MIX) >> self._shift).view(np.int64)
        at = table[slots]
        busy = ((at != keys) & (at != _NO_KEY)).nonzero()[0]
        while busy.size > _FEW:  # the next slot of each key still on another key's
            at_busy = (slots[busy] + _ONE) & mask
            slots[busy] = at_busy
            at = table[at_busy]
            busy = busy[(at != keys[busy]) & (at != _NO_KEY)]
        if busy.size:  # the last few (one to a few probe rounds left, mostly)
            item, m = table.item, int(mask)
            for i in busy.tolist():
                key, s = keys.item(i), slots.item(i)
                while True:
                    s = (s + 1) & m
                    at = item(s)
                    if at == key or at == _EMPTY:
                        break
                slots[i] = s
        entries = self._entries[slots]
        if self._cut > 1:  # forgotten keys (a free slot's entry is 0 already)
            entries *= entries >= self._cut  # half the instructions of a masked store
        return slots, entries

    def store(self, keys: np.ndarray, slots: np.ndarray, entries: np.ndarray,
              earlier: np.ndarray) -> None:
        """Remember `entries` for distinct `keys` at their `slots` and `earlier` entries from
        `find` (nothing stored since); then drop old keys if the history is full."""
        m = self._map
        if m is not None:  # kept in entry order: the batch's entries are the newest
            keys = keys.tolist()
            for k in keys:
                m.pop(k, None)
            m.update(sorted(zip(keys, entries.tolist()), key=itemgetter(1)))
            if len(m) > 2 * self.capacity:
                self._settle()
            return
        table = self._keys
        free = keys.size - int(np.count_nonzero(self._entries[slots]))  # slots still free
        if 3 * (self._used + free) > len(table):  # at most a third full: short probes
            # Never smaller: the keys remembered swing between `capacity` and twice that,
            # and a table sized to the low end would be rebuilt again soon. Once it is an
            # eighth of the most it can need (six slots per key, twice `capacity` keys), it
            # grows to that at once: fresh memory costs page faults, so one large step
            # costs less than two.
            need, most = 6 * (self.count + free), 12 * self.capacity
            self._rebuild(max(len(table), need if 8 * need < most else max(need, most)))
            table = self._keys
            slots, _ = self.find(keys)
            free = keys.size - int(np.count_nonzero(self._entries[slots]))
        # Keys remembered from now: those in free slots and forgotten ones in their old slots
        # (a rebuild above kept what `earlier` tells).
        self.count += keys.size - int(np.count_nonzero(earlier))
        self._used += free
        # Every key is written: a found key over itself, a new one into its free slot; a key
        # whose free slot another new key of the batch also took probes on from there.
        table[slots] = keys
        lost = (table[slots] != keys).nonzero()[0]
        while lost.size:
            slots[lost], _ = self.find(keys[lost], (slots[lost] + _ONE) & self._mask)
            at, mine = slots[lost], keys[lost]
            table[at] = mine
            lost = lost[table[at] != mine]
        self._entries[slots] = entries
        if self.count > 2 * self.capacity:
            self._settle()

    def contains(self, keys: list) -> list[bool]:
        """Whether each of `keys` (None: never) is remembered."""
        if self._map is not None:
            return list(map(self._map.__contains__, keys))
        return _keyed(keys, lambda known: (self.find(np.array(known, np.int64))[1] > 0).tolist())

    def record_each(self, keys: list) -> list[bool]:
        """Record each of `keys` (distinct; None is skipped, as never seen) at its own tick,
        exactly as one at a time with a settle after each; returns whether each was
        remembered just before."""
        m = self._map
        if m is not None:
            seen = list(map(m.__contains__, keys))  # None never is
            known = keys if None not in keys else [k for k in keys if k is not None]
            clock, most = self.clock, 2 * self.capacity
            if len(m) + len(known) - sum(seen) <= most:  # no settle on the way: one batch
                for k in compress(keys, seen):  # to the end, in entry order
                    del m[k]
                m.update(zip(known, range((clock + 1) << 8, (clock + len(known) + 1) << 8,
                                          1 << 8)))
                self.clock = clock + len(known)
                return seen
            seen = []
            was = seen.append
            for k in keys:
                if k is None:
                    was(False)
                    continue
                clock += 1
                was(k in m)
                m.pop(k, None)
                m[k] = clock << 8
                if len(m) > most:
                    self.clock = clock
                    self._settle()
            self.clock = clock
            return seen
        return _keyed(keys, lambda known: self._record_each(np.array(known, np.int64),
                                                            self.clock + 1).tolist())

    def _check_sanity(self) -> bool:
        """The invariants `find` and `store` rely on (a full pass: for tests)."""
        m = self._map
        if m is not None:
            values = list(m.values())
            assert values == sorted(values) and len(m) <= 2 * self.capacity
            return True
        keys, entries, size = self._keys, self._entries, self._keys.size
        free = keys == _EMPTY
        assert np.array_equal(free, entries == 0), "a free slot holds an entry, or a key none"
        assert self._used == size - np.count_nonzero(free) and 3 * self._used <= size
        assert self.count == np.count_nonzero(entries >= self._cut) <= 2 * self.capacity
        held = keys[~free]
        assert np.unique(held).size == held.size, "a key in two slots"
        # A probe for a key walks from its home to its slot: no free slot on the way.
        at = (~free).nonzero()[0]
        home = ((held.view(np.uint64) * _MIX) >> self._shift).view(np.int64)
        free_before = np.concatenate(([0], np.cumsum(np.concatenate((free, free)))))
        end = home + ((at - home) & self._mask)
        assert not (free_before[end] - free_before[home]).any(), "a key beyond a free slot"
        return True

    def _record_each(self, keys: np.ndarray, first_tick: int) -> np.ndarray:
        seen = np.empty(keys.size, bool)
        done = 0
        while done < keys.size:
            rest = keys[done:]
            slots, old = self.find(rest)
            new = np.cumsum(old == 0)
            room = 2 * self.capacity - self.count
            # The key whose write overfills the history ends this batch (a settle follows).
            end = rest.size if new[-1] <= room else int(np.searchsorted(new, room + 1)) + 1
            ticks = np.arange(first_tick + done, first_tick + done + end, dtype=np.int64)
            self.clock = first_tick + done + end - 1
            seen[done:done + end] = old[:end] > 0
            self.store(rest[:end].copy(), slots[:end].copy(), ticks << 8, old[:end])
            done += end
        return seen

    def _settle(self) -> None:
        cut = (self.clock - self.capacity) << 8  # > 0: the clock is past 2 x capacity here
        m = self._map
        if m is not None:  # in entry order: the old keys come first, deleted in place
            for k in list(islice(m, bisect_left(list(m.values()), cut))):
                del m[k]
            return
        self._cut = cut
        self.count = int(np.count_nonzero(self._entries >= cut))

    def _rebuild(self, size: int) -> None:
        """A table of `size` slots holding the remembered keys alone."""
        keep = (self._entries >= self._cut).nonzero()[0]
        keys, entries = self._keys[keep], self._entries[keep]
        self._alloc(size)
        if keys.size:
            slots, earlier = self.find(keys)
            self.store(keys, slots, entries, earlier)

    def _alloc(self, size: int) -> None:
        size = 1 << max(4, (size - 1).bit_length())
        if self._keys is not None and self._keys.size == size:
            # A rebuild at the same size refills the table in place: fresh memory costs a
            # page fault per 4 KB on first touch, several times the writes (20+ ms for 2M
            # slots on a loaded machine).
            table = self._keys.base
            table[:, 1] = 0
        else:  # a slot's key and entry side by side: a probe reads one cache line, not two
            table = np.zeros((size, 2), np.int64)
        table[:, 0] = _EMPTY
        self._keys, self._entries = table[:, 0], table[:, 1]
        self._mask = np.array(size - 1, np.int64)
        self._shift = np.array(65 - size.bit_length(), np.uint64)
        self.count = 0
        self._used = 0


class ClassQueuePolicy:
    """Blocks in classes, each class a FIFO per priority level (in release order), ordered by
    a score `head_score(class, stamp)` that grows with the stamp inside a class.

    A subclass gives each released block a class and the release one stamp (`_classify`), and
    gives the score of a class's head (`_head_scores`); scores may change over time (learnt
    estimates), but never the order inside a class. The victim is the head with the lowest
    score among the classes at the lowest priority level (ties: the lower class). So every
    operation is O(1), or O(classes) per run of victims taken from one class. The FIFOs are
    one `RunQueue` (a FIFO per level and class), which keeps each run with its stamp.

    A release pushes its deepest block first, and a subclass caps each block's class at its
    parent's, so inside a class the deeper block leaves first, and across classes a child
    outranks its parent only if a lower class can score higher than a higher one at the same
    stamp (subclasses keep head scores monotone in the class)."""

    __slots__ = ("index", "capacity", "num_classes", "queue", "remove_many", "_live", "shadows")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 num_classes: int) -> None:
        self.index = index
        self.capacity = capacity
        self.num_classes = num_classes
        self.queue = RunQueue(id_space, NUM_PRIORITY_LEVELS * num_classes)
        self.remove_many = self.queue.remove_many
        """Claims (the blocks leave their runs): the queue's own, one call per match."""
        self._live: dict[int, tuple[list[int], list[int]]] = {}
        """By `level << num_classes | mask of its non-empty classes`: those classes and their
        FIFOs, ascending (a level holds blocks of most classes: gdsf ~14 of 17)."""
        self.shadows: ShadowDuel | None = None
        """The duel between LRU's order and the subclass's (`ShadowDuel`), where it runs
        one; None: always its own."""

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, block: BlockId) -> bool:
        return block in self.queue

    def note_prompt(self, keys: np.ndarray, matched: list[BlockId]) -> None:
        if self.shadows:
            self.shadows.judge(keys, matched, self.__contains__)

    def push_back(self, block: BlockId, priority: int) -> None:
        self.push_back_many([block], priority)

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        if not blocks:
            return
        cuts, stamp = self._classify(blocks)
        push = self.queue.push_run
        q0 = priority * self.num_classes
        # A chain's classes only fall away from its root, so the release is a few runs of
        # one class each; `blocks` come deepest first, so its runs are the cuts reversed.
        n = len(blocks)
        end = n
        for pos, c in reversed(cuts):
            push(blocks[n - end:n - pos] if pos or end < n else blocks, q0 + c, stamp)
            end = pos

    def requeue(self, block: BlockId, priority: int) -> None:
        """To the back of its class at level `priority`, stamped now (not a use)."""
        q = self.queue
        c = q.fifo_of(block) % self.num_classes
        q.remove(block)
        q.push_run([block], priority * self.num_classes + c, self._now())

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        queue = self.queue
        classes = self.num_classes
        every = (1 << classes) - 1
        while len(out) < n and len(queue):
            mask = queue.nonempty_mask()
            low = (mask & -mask).bit_length() - 1
            q0 = low - low % classes
            live_mask = (mask >> q0) & every
            c = low - q0
            if live_mask & (live_mask - 1):  # several classes at this level
                key = q0 << classes | live_mask
                found = self._live.get(key)
                if found is None:
                    if len(self._live) > _LIVE_SETS:
                        self._live.clear()
                    live = [k for k in range(c, classes) if live_mask >> k & 1]
                    found = self._live[key] = (live, [q0 + k for k in live])
                live = found[0]
                scores = self._head_scores(live, queue.head_stamps(found[1]))
                top = min(scores)
                best = scores.index(top)  # ties: the lower class
                c = live[best]
                # The run of c's heads that still beat every other class's head: a lower
                # class wins ties, so against it c must score strictly less (scores are ints:
                # less than s is at most s - 1); the lowest such bound holds for all.
                bound = min(scores[best + 1:], default=_NO_BOUND)
                if best:
                    bound = min(bound, min(scores[:best]) - 1)
                run = queue.pop_upto(q0 + c, n - len(out), self._max_stamp(c, bound))
            else:
                run = queue.pop_upto(low, n - len(out), _NO_BOUND)
            self._evicted(queue.last_stamp, c)
            out += run
        return out

    def order(self) -> list[BlockId]:
        """Eviction order if nothing changed meanwhile (tests; O(n log n))."""
        entries = []
        for q in range(NUM_PRIORITY_LEVELS * self.num_classes):
            level, c = divmod(q, self.num_classes)
            for i, b in enumerate(self.queue.fifo_order(q)):
                entries.append((level, self._head_scores([c], [self.queue.stamp_of(b)])[0], c,
                                i, b))
        entries.sort()
        return [BlockId(e[4]) for e in entries]

    # --- for subclasses -------------------------------------------------------------------

    @staticmethod
    def _cuts(caps: np.ndarray, top: int, partial: bool) -> list[tuple[int, int]]:
        """`_classify`'s cuts for the classes of a chain's full blocks (shallowest first),
        `caps`: each already capped at its parent's (`np.minimum.accumulate` of the classes,
        all at most `top`); a partial block after them takes class 1."""
        cuts = [(0, top)]
        last = top
        if caps.size:
            first, last = caps.item(0), caps.item(-1)
            if first < top:
                cuts.append((0, first))
            if last != first:  # most chains are one class
                # The caps fall from `first` to `last`: each class present starts where
                # the counts of those above it end (one numpy call, not five).
                counts = np.bincount(caps).tolist()
                at = counts[first]
                for c in range(first - 1, last - 1, -1):
                    if counts[c]:
                        cuts.append((at, c))
                        at += counts[c]
        if partial and last > 1:
            cuts.append((caps.size, 1))
        return cuts

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

    def _max_stamp(self, cls: int, score: int) -> int:
        """The largest stamp of class `cls` whose score is at most `score`."""
        raise NotImplementedError

    def _evicted(self, stamp: int, cls: int) -> None:
        """Called after each run of victims taken from class `cls`, with its last one's stamp
        (the highest)."""

    def _check_sanity(self) -> bool:
        classes = self.num_classes
        assert len(self._live) <= _LIVE_SETS + 1
        for key, (live, fifos) in self._live.items():
            q0, mask = key >> classes, key & ((1 << classes) - 1)
            assert live == [k for k in range(classes) if mask >> k & 1]
            assert fifos == [q0 + k for k in live]
        return self.queue._check_sanity()
