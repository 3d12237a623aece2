"""O(1) eviction order for free blocks that still cache reusable data.

An intrusive doubly linked list per priority level, over plain int arrays indexed by block id.
A block that is matched again must leave the queue from wherever it sits, and a released block
joins at the back; both are O(1) only with links stored per block (a deque would make removal
O(n)). Python lists of ints beat per-node objects here because the replay touches millions of
blocks. The lowest non-empty level is found from a bitmask, so `pop_front` is O(1) as well. The other
eviction policies keep their own queues (`policies/run_queue.py`).
"""

from __future__ import annotations

from .ids import BlockId

NUM_PRIORITY_LEVELS = 101
"""Retention priorities 0..100 as in TensorRT-LLM; lower levels are evicted first."""

_NONE = -1


class FreeQueue:
    """LRU order within a priority level; the head of the lowest level is evicted first."""

    __slots__ = ("_next", "_prev", "_level", "_sentinel0", "_nonempty", "_size")

    def __init__(self, capacity: int) -> None:
        self._sentinel0 = capacity
        total = capacity + NUM_PRIORITY_LEVELS
        # Sentinel of level q sits at index capacity + q and links to itself when empty.
        self._next = list(range(total))
        self._prev = list(range(total))
        self._level = [_NONE] * capacity
        """The level holding the block, -1 while not queued."""
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
        if not blocks:
            return
        s = self._sentinel0 + priority
        nxt, prv, level = self._next, self._prev, self._level
        # A block queued twice would corrupt the links: `_check_sanity` catches it (an assert
        # here would cost a check per block on the hottest loop).
        last = prv[s]
        for b in blocks:
            nxt[last] = b
            prv[b] = last
            level[b] = priority
            last = b
        nxt[last] = s
        prv[s] = last
        self._nonempty |= 1 << priority
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

    def remove(self, block: BlockId) -> int:
        """Unlink `block`; returns the level it left."""
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

    def note_prompt(self, keys, matched: list[BlockId]) -> None:
        """A prompt being added and the blocks its match found (`policies/base.py`): LRU's
        order does not use them."""

    def remove_many(self, blocks: list[BlockId]) -> None:
        """`remove` of each of `blocks` (a match's claims), in one call."""
        level, nxt, prv = self._level, self._next, self._prev
        nonempty = self._nonempty
        for block in blocks:
            lv = level[block]
            assert lv != _NONE, "block not in the free queue"
            a, b = prv[block], nxt[block]
            nxt[a] = b
            prv[b] = a
            level[block] = _NONE
            if a == b:  # only the sentinel is left
                nonempty &= ~(1 << lv)
        self._nonempty = nonempty
        self._size -= len(blocks)

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

    def level_order(self, level: int) -> list[BlockId]:
        """The blocks of level `level`, head first (tests and debugging; O(n))."""
        out: list[BlockId] = []
        s = self._sentinel0 + level
        b = self._next[s]
        while b != s:
            out.append(BlockId(b))
            b = self._next[b]
        return out

    def order(self) -> list[BlockId]:
        """Eviction order, first victim first (tests and debugging; O(n))."""
        out: list[BlockId] = []
        for q in range(NUM_PRIORITY_LEVELS):
            out += self.level_order(q)
        return out

    def _check_sanity(self) -> bool:
        seen = 0
        for q in range(NUM_PRIORITY_LEVELS):
            s = self._sentinel0 + q
            b = self._next[s]
            assert bool(self._nonempty >> q & 1) == (b != s)
            while b != s:
                assert self._level[b] == q and self._next[self._prev[b]] == b
                seen += 1
                b = self._next[b]
        assert seen == self._size == sum(f != _NONE for f in self._level)
        return True
