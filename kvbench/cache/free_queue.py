"""O(1) eviction order for free blocks that still cache reusable data.

An intrusive doubly linked list per priority level, over plain int arrays indexed by block id.
A block that is matched again must leave the queue from wherever it sits, and a released block
joins at the back; both are O(1) only with links stored per block (a deque would make removal
O(n)). Python lists of ints beat per-node objects here because the replay touches millions of
blocks. The lowest non-empty level is found from a bitmask, so `pop_front` is O(1) as well.

An eviction policy (`policies/`) splits each level into `classes` FIFOs over the same arrays:
FIFO `level x classes + class`, so the mask's lowest bit is the lowest level's lowest class,
and a block's FIFO, links and (optionally) a policy's stamp are written in one pass per run.
LRU is one class: FIFO = level.
"""

from __future__ import annotations

from .ids import BlockId

NUM_PRIORITY_LEVELS = 101
"""Retention priorities 0..100 as in TensorRT-LLM; lower levels are evicted first."""

_NONE = -1


class FreeQueue:
    """LRU order within a priority level; the head of the lowest level is evicted first.

    With `classes` > 1, the FIFO-level calls (`push_run`, `pop_upto`, `fifo_of`,
    `lowest_fifo`) take FIFO indices (`level x classes + class`); the level calls
    (`push_back`, `pop_front_many`, `requeue`) are for one class."""

    __slots__ = ("_next", "_prev", "_level", "_sentinel0", "_nonempty", "_size", "classes")

    def __init__(self, capacity: int, classes: int = 1) -> None:
        self.classes = classes
        self._sentinel0 = capacity
        total = capacity + NUM_PRIORITY_LEVELS * classes
        # Sentinel of FIFO q sits at index capacity + q and links to itself when empty.
        self._next = list(range(total))
        self._prev = list(range(total))
        self._level = [_NONE] * capacity
        """The FIFO holding the block (its level with one class), -1 while not queued."""
        self._nonempty = 0
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: BlockId) -> bool:
        return self._level[block] != _NONE

    def push_back(self, block: BlockId, priority: int) -> None:
        """Make `block` the most recently used of its level."""
        assert self._level[block] == _NONE, "block already in the free queue"
        s = self._sentinel0 + priority
        nxt, prv = self._next, self._prev
        last = prv[s]
        nxt[last] = block
        prv[block] = last
        nxt[block] = s
        prv[s] = block
        self._level[block] = priority
        self._nonempty |= 1 << priority
        self._size += 1

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        """`push_back` of each of `blocks` in order, linked as one run."""
        self.push_run(blocks, priority)

    def push_run(self, blocks: list[BlockId], fifo: int, stamps: list[int] | None = None,
                 stamp: int = 0) -> None:
        """Append `blocks` in order to FIFO `fifo` as one run, setting `stamps[b] = stamp` for
        each when `stamps` is given (a policy's per-block mark, in the same pass)."""
        if not blocks:
            return
        s = self._sentinel0 + fifo
        nxt, prv, level = self._next, self._prev, self._level
        # A block queued twice would corrupt the links: `_check_sanity` catches it (an assert
        # here would cost a check per block on the hottest loop).
        last = prv[s]
        if stamps is None:
            for b in blocks:
                nxt[last] = b
                prv[b] = last
                level[b] = fifo
                last = b
        else:
            for b in blocks:
                nxt[last] = b
                prv[b] = last
                level[b] = fifo
                stamps[b] = stamp
                last = b
        nxt[last] = s
        prv[s] = last
        self._nonempty |= 1 << fifo
        self._size += len(blocks)

    def pop_front_many(self, n: int, max_level: int = NUM_PRIORITY_LEVELS) -> list[BlockId]:
        """The next `n` victims in order (fewer if the queue runs out, or reaches a level above
        `max_level`), unlinked as runs."""
        out: list[BlockId] = []
        append = out.append
        nxt, prv, level = self._next, self._prev, self._level
        left = n
        while left and self._nonempty:
            mask = self._nonempty
            lv = (mask & -mask).bit_length() - 1
            if lv > max_level:
                break
            s = self._sentinel0 + lv
            b = nxt[s]
            while b != s and left:
                append(b)
                level[b] = _NONE
                b = nxt[b]
                left -= 1
            nxt[s] = b
            prv[b] = s
            if b == s:
                self._nonempty &= ~(1 << lv)
        self._size -= n - left
        return out

    def requeue(self, block: BlockId, priority: int) -> None:
        """Move free `block` to the back of level `priority` (its retention ended)."""
        self.remove(block)
        self.push_back(block, priority)

    def lowest_fifo(self, mask: int = -1) -> int:
        """The lowest non-empty FIFO among those set in `mask`, or -1 if none."""
        m = self._nonempty & mask
        return (m & -m).bit_length() - 1

    def nonempty_mask(self) -> int:
        """Bit q set: FIFO q holds a block."""
        return self._nonempty

    def fifo_of(self, block: BlockId) -> int:
        """The FIFO holding `block`, -1 if it is not queued."""
        return self._level[block]

    def heads(self, fifos: list[int]) -> list[BlockId]:
        """The first block of each of `fifos` (its sentinel index when empty)."""
        nxt, s0 = self._next, self._sentinel0
        return [nxt[s0 + q] for q in fifos]

    def pop_upto(self, fifo: int, n: int, stamps=None, max_stamp=0, min_stamp=0
                 ) -> list[BlockId]:
        """Up to `n` blocks from the front of FIFO `fifo`, while `min_stamp <= stamps[block]
        <= max_stamp` when `stamps` (never negative) is given (a policy takes a run at once:
        victims of a queue ordered by a stamp, or the heads a per-block mark lets go or sends
        round again)."""
        out: list[BlockId] = []
        append = out.append
        s = self._sentinel0 + fifo
        nxt, lv = self._next, self._level
        b = nxt[s]
        if stamps is None:
            while b != s and n:
                append(b)
                lv[b] = _NONE
                b = nxt[b]
                n -= 1
        elif not min_stamp:  # the lower bound holds: one comparison per block
            while b != s and n and stamps[b] <= max_stamp:
                append(b)
                lv[b] = _NONE
                b = nxt[b]
                n -= 1
        else:
            while b != s and n and min_stamp <= stamps[b] <= max_stamp:
                append(b)
                lv[b] = _NONE
                b = nxt[b]
                n -= 1
        self._cut_front(fifo, b, len(out))
        return out

    def _cut_front(self, fifo: int, b: int, taken: int) -> None:
        """FIFO `fifo` now starts at `b` (its sentinel when emptied): `taken` blocks left."""
        s = self._sentinel0 + fifo
        self._next[s] = b
        self._prev[b] = s
        if b == s:
            self._nonempty &= ~(1 << fifo)
        self._size -= taken

    def remove(self, block: BlockId) -> int:
        """Unlink `block`; returns the FIFO it left (its level with one class)."""
        level = self._level[block]
        assert level != _NONE, "block not in the free queue"
        nxt, prv = self._next, self._prev
        a, b = prv[block], nxt[block]
        nxt[a] = b
        prv[b] = a
        self._level[block] = _NONE
        self._size -= 1
        if a == b:  # only the sentinel is left
            self._nonempty &= ~(1 << level)
        return level

    def front(self) -> BlockId | None:
        """The block `pop_front` would return, or None when empty."""
        mask = self._nonempty
        if not mask:
            return None
        level = (mask & -mask).bit_length() - 1
        return BlockId(self._next[self._sentinel0 + level])

    def pop_front(self) -> BlockId | None:
        block = self.front()
        if block is not None:
            self.remove(block)
        return block

    def fifo_order(self, fifo: int) -> list[BlockId]:
        """The blocks of FIFO `fifo`, head first (tests and debugging; O(n))."""
        out: list[BlockId] = []
        s = self._sentinel0 + fifo
        b = self._next[s]
        while b != s:
            out.append(BlockId(b))
            b = self._next[b]
        return out

    def order(self) -> list[BlockId]:
        """Eviction order with one class, first victim first (tests and debugging; O(n))."""
        out: list[BlockId] = []
        for q in range(NUM_PRIORITY_LEVELS * self.classes):
            out += self.fifo_order(q)
        return out

    def _check_sanity(self) -> bool:
        seen = 0
        for q in range(NUM_PRIORITY_LEVELS * self.classes):
            s = self._sentinel0 + q
            b = self._next[s]
            assert bool(self._nonempty >> q & 1) == (b != s)
            while b != s:
                assert self._level[b] == q and self._next[self._prev[b]] == b
                seen += 1
                b = self._next[b]
        assert seen == self._size == sum(f != _NONE for f in self._level)
        return True
