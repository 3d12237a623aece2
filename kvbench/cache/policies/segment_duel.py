"""SLRU's and S3-FIFO's fallback to LRU: their miniature simulations and the pool's release order.

`lru2` and `predictive` never lose more than a few tenths of a point to LRU because they run a
`ShadowDuel`: shadow caches of sampled keys in LRU order and in their own, and the real pool
evicts in LRU order until their own shadow clearly leads and while the LRU one holds more.
SLRU and S3-FIFO lose several points to LRU on some traffic (agent-like sessions whose
prefixes are used twice and then never: both keep those in their protected / main segment and
push out the new turns that LRU keeps), so they run the same duel. Here: the own-order
shadows (a key-level simulation of each algorithm, fed a release's sampled keys deepest first)
and `ReleaseOrder`, the pool's free blocks in release order, which the pool evicts from while
LRU's order is taken.

The shadows see keys, not chains, so a sampled key can be held there after its parent left;
the duel counts a prompt's held keys from its root down to the first missing one
(`held_chain`), as a prefix match would reuse them. They trim to their capacity after each
release where the pool evicts on demand: an estimate of each order's hit rate, not a replay,
as the LRU shadow is.
"""

from __future__ import annotations

from collections import deque
from itertools import compress, islice, repeat
from operator import not_

from ..free_queue import NUM_PRIORITY_LEVELS
from ..ids import BlockId
from .run_queue import RunQueue

_SLACK = 256
"""Entries `ReleaseOrder` may hold beyond four times the queued blocks before it compacts or
drops them (amortised O(1) per pushed block)."""


class ReleaseOrder:
    """The queued blocks of a `RunQueue` in release order per priority level: the order
    `FreeQueue` (plain LRU) would evict them in, least recently released first and, at equal
    release, the block pushed first (a release's deepest).

    The segments' FIFOs are not in release order (SLRU demotes, S3-FIFO promotes and gives
    second chances), so LRU's order is kept beside them. Not as a linked list (a `FreeQueue`:
    four writes per pushed block and an unlink per claim and per victim, paid in both modes)
    but lazily, as lru2 keeps its FIFO: each push stamps its blocks with consecutive serials
    (one write per block) and appends one entry `[serials, blocks, next]` to its level's FIFO.
    A block is live in an entry while it is still queued with the serial the entry gave it, so
    a claim, a requeue, a victim taken in the policy's own order or a block pushed again makes
    its old entry stale at no cost; stale entries are skipped when they surface. The queue
    itself says which blocks are queued, and at which level.

    Entries outgrowing the queued blocks are compacted while LRU is the order popped, and
    dropped while it is not: then pushes only write serials, and the FIFOs are rebuilt from
    them (a sort) when LRU next pops. A duel that flips often keeps the FIFOs (dropping needs
    three pool sizes of pushes since the last rebuild), so a rebuild costs O(1) per push."""

    __slots__ = ("queue", "serial", "_fifos", "_entries", "_off", "_next")

    def __init__(self, id_space: int, queue: RunQueue) -> None:
        self.queue = queue
        """The policy's queue (`2 * level + segment` FIFOs): membership and levels."""
        self.serial = [0] * id_space
        """The serial a block got when last pushed (push order, from 1)."""
        self._fifos = [deque() for _ in range(NUM_PRIORITY_LEVELS)]
        self._entries = 0
        """Blocks in the entries, stale ones included."""
        self._off = False
        """Whether the FIFOs are dropped (rebuilt from the serials when next popped)."""
        self._next = 1

    def push(self, blocks: list[BlockId], level: int, popping: bool) -> None:
        """`blocks` released (in eviction order) at `level`; `popping`: whether LRU is the
        order victims are taken in now (then stale entries are compacted, not dropped)."""
        s = self._next
        n = len(blocks)
        self._next = s + n
        serial = self.serial
        for b in blocks:  # a loop's item writes cost half a map of bound-method calls
            serial[b] = s
            s += 1
        if self._off:
            return
        self._fifos[level].append([range(s - n, s), blocks, 0])
        self._entries += n
        if self._entries > 4 * len(self.queue) + _SLACK:
            if popping:  # one entry per level, the live blocks
                self._rebuild()
            else:
                self._drop()

    def pop(self, n: int, firsts: list | None) -> tuple[list[BlockId], int]:
        """Take up to `n` victims in LRU order off the queue (lowest level first); returns
        them and how many left the second segment. With `firsts`, the victims that left the
        first segment are appended to it."""
        if self._off:
            self._rebuild()
        queue, serial = self.queue, self.serial
        contains, remove = queue.__contains__, queue.remove
        out: list[BlockId] = []
        second = 0
        gone = 0
        while len(out) < n and len(queue):
            fifo = self._fifos[queue.lowest_fifo() >> 1]
            while len(out) < n:
                entry = fifo[0]
                serials, blocks, i = entry
                end = len(blocks)
                while i < end and len(out) < n:
                    b = blocks[i]
                    i += 1
                    if serial[b] == serials[i - 1] and contains(b):
                        out.append(b)
                        if remove(b) & 1:
                            second += 1
                        elif firsts is not None:
                            firsts.append(b)
                gone += i - entry[2]
                if i < end:
                    entry[2] = i
                    break
                fifo.popleft()
                if not fifo:  # the level is empty (its blocks were all in it)
                    break
        self._entries -= gone
        return out, second

    def _drop(self) -> None:
        for fifo in self._fifos:
            fifo.clear()
        self._entries = 0
        self._off = True

    def _rebuild(self) -> None:
        """The FIFOs again from the queue's blocks and their serials: one entry per level in
        serial (push) order, the live entries' order."""
        queue, serial = self.queue, self.serial
        for fifo in self._fifos:
            fifo.clear()
        for lv in range(NUM_PRIORITY_LEVELS):
            if queue.nonempty_mask() >> 2 * lv & 3:
                blocks = queue.fifo_order(2 * lv) + queue.fifo_order(2 * lv + 1)
                blocks.sort(key=serial.__getitem__)
                self._fifos[lv].append([[serial[b] for b in blocks], blocks, 0])
        self._entries = len(queue)
        self._off = False

    def _check_sanity(self) -> bool:
        queue, serial = self.queue, self.serial
        if self._off:
            assert not any(self._fifos) and not self._entries
            return True
        entries = 0
        for lv, fifo in enumerate(self._fifos):
            live, last = [], 0
            for serials, blocks, i in fifo:
                assert len(serials) == len(blocks) and 0 <= i <= len(blocks)
                entries += len(blocks) - i
                for b, s in zip(blocks[i:], serials[i:]):
                    assert s > last, "serials out of order"
                    last = s
                    if serial[b] == s and queue.fifo_of(b) >= 0:
                        live.append(b)
            want = queue.fifo_order(2 * lv) + queue.fifo_order(2 * lv + 1)
            assert sorted(live) == sorted(want), "a queued block not live in its level's FIFO"
        assert entries == self._entries
        return True


def held_chain(held: list) -> int:
    """How many of a prompt's keys (deepest first), from its root down, are held before the
    first that is not (`held`: whether each is): the keys a prefix match reuses. Counting
    every held key credited S3-FIFO, whose main FIFO keeps deep keys after their parents
    leave, with hits the pool cannot get (agent-like traffic at 128K tokens, switching on any
    lead: S3-FIFO 0.81 points under LRU counting every held key, 0.36 counting chains)."""
    try:
        return held[::-1].index(False)
    except ValueError:
        return len(held)


class SLRUShadow:
    """SLRU over sampled keys: a probation and a protected segment (dicts in LRU order), the
    protected one capped at `protected_ratio` of the shadow. A key enters protected when the
    shadow held it or the pool's history remembers an earlier use (`seen`, from the real
    history: its span is a multiple of the pool, which the sampled keys keep), else probation;
    protected's overflow is demoted to probation's tail, and victims come from probation's
    head first."""

    __slots__ = ("probation", "protected", "ratio")

    def __init__(self, protected_ratio: float) -> None:
        self.probation: dict = {}
        self.protected: dict = {}
        """Keys (each to 1) in LRU order."""
        self.ratio = protected_ratio

    def __len__(self) -> int:
        return len(self.probation) + len(self.protected)

    def __contains__(self, key: int) -> bool:
        return key in self.protected or key in self.probation

    def replay(self, keys: list, seen: list[bool], cap: int) -> None:
        """Use a release's `keys` (deepest first) with whether each was `seen` before; trim
        to `cap` keys."""
        prob, prot = self.probation, self.protected
        # The held keys by a pass in C over each segment's keys (most releases hold some: a
        # shared prefix), then a step per held key.
        held = prot.keys() & keys
        for k in held:
            del prot[k]
        in_prob = prob.keys() & keys
        for k in in_prob:
            del prob[k]
        held |= in_prob
        up = [s or k in held for s, k in zip(seen, keys)] if held else seen
        prot.update(zip(compress(keys, up), repeat(1)))
        prob.update(zip(compress(keys, map(not_, up)), repeat(1)))
        over = len(prot) - int(self.ratio * cap)
        if over > 0:  # demoted to probation's tail, oldest first
            demoted = list(islice(prot, over))
            for k in demoted:  # a loop's deletions cost half a map of bound-method calls
                del prot[k]
            prob.update(zip(demoted, repeat(1)))
        over = len(prob) + len(prot) - cap
        if over > 0:
            for seg in (prob, prot):
                gone = list(islice(seg, over))
                for k in gone:
                    del seg[k]
                over -= len(gone)
                if not over:
                    break


class S3FIFOShadow:
    """S3-FIFO over sampled keys: a small and a main FIFO (dicts key -> access count, in
    queue order) and a ghost history of the keys evicted from the small one (`ghosts`, the
    pool's `GhostKeys` scaled down). As in the pool (cache mode: a use is a claim and a
    release), a held key goes back to the tail of its FIFO with its count one higher (up to
    `max_freq`); a new key enters main if it is a ghost, else small. Over capacity, the
    small FIFO's head leaves while it holds more than `small_ratio` of the shadow (to main,
    count cleared, if it was accessed; else evicted as a ghost), else main's (back to its tail
    with its count lowered if accessed; else evicted)."""

    __slots__ = ("small", "main", "ghosts", "ratio", "top")

    def __init__(self, small_ratio: float, max_freq: int, ghosts) -> None:
        self.small: dict = {}
        self.main: dict = {}
        self.ghosts = ghosts
        self.ratio = small_ratio
        self.top = max_freq

    def __len__(self) -> int:
        return len(self.small) + len(self.main)

    def __contains__(self, key: int) -> bool:
        return key in self.small or key in self.main

    def replay(self, keys: list, cap: int) -> None:
        """Use a release's `keys` (deepest first); trim to `cap` keys."""
        small, main, top = self.small, self.main, self.top
        ghost = self.ghosts.contains(keys)
        if small.keys().isdisjoint(keys) and main.keys().isdisjoint(keys):
            # Mostly none is held (one pass in C each): the new keys at once, in order
            # within each FIFO.
            main.update(zip(compress(keys, ghost), repeat(0)))
            small.update(zip(compress(keys, map(not_, ghost)), repeat(0)))
            keys = ()
        for k, g in zip(keys, ghost):
            f = small.pop(k, -1)
            if f >= 0:
                small[k] = f + 1 if f < top else top
                continue
            f = main.pop(k, -1)
            if f >= 0:
                main[k] = f + 1 if f < top else top
                continue
            if g:
                main[k] = 0
            else:
                small[k] = 0
        over = len(small) + len(main) - cap
        if over > 0:
            self._trim(over, max(1, int(self.ratio * cap)))

    def _trim(self, over: int, target: int) -> None:
        """Evict `over` keys, a batch of heads at a time (one scan from a dict's front per
        batch: a dict finds its first key past the slots its deleted keys left, so a key at
        a time would cost O(n) each)."""
        small, main = self.small, self.main
        ghosts: list = []
        while over > 0:
            if len(small) > target or not main:
                # Heads while the small FIFO is over its target or main is empty (as one
                # head at a time: a head moved to an empty main makes main's head next).
                for k, f in list(islice(small.items(), min(over, len(small) - target)
                                        if main else over)):
                    del small[k]
                    if f:
                        main[k] = 0
                    else:
                        ghosts.append(k)
                        over -= 1
                    if len(small) <= target and main:
                        break
            else:
                for k, f in list(islice(main.items(), over)):
                    del main[k]
                    if f:
                        main[k] = f - 1
                    else:
                        over -= 1
        if ghosts:
            self.ghosts.record(ghosts, False)
