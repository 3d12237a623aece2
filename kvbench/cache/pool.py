"""A pool of blocks on one tier: empty blocks, free blocks that cache data, blocks in use."""

from __future__ import annotations

from .free_queue import FreeQueue
from .ids import BlockId, Tier


class BlockPool:
    """Blocks `[first, first + capacity)` of a life cycle's block-id space, on one tier.

    Every block is in exactly one state: *empty* (holds nothing reusable; taken first),
    *cached* (free, holds reusable data, in the LRU free queue) or *in use* (ref_count > 0).
    Ids of all tiers of a life cycle share one space so the prefix index maps a key to a block
    without a separate tier field.
    """

    __slots__ = ("tier", "first", "capacity", "empty", "free_queue", "num_in_use", "peak_in_use")

    def __init__(self, tier: Tier, first: int, capacity: int, id_space: int) -> None:
        self.tier = tier
        self.first = first
        self.capacity = capacity
        # Popped from the end, so the lowest ids are handed out first (tests assert exact ids).
        self.empty: list[BlockId] = [BlockId(b) for b in range(first + capacity - 1, first - 1, -1)]
        self.free_queue = FreeQueue(id_space)
        self.num_in_use = 0
        self.peak_in_use = 0

    def __contains__(self, block: int) -> bool:
        return self.first <= block < self.first + self.capacity

    @property
    def num_cached(self) -> int:
        return len(self.free_queue)

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: empty ones, then cached ones by eviction."""
        return len(self.empty) + len(self.free_queue)

    def _check_sanity(self) -> bool:
        assert len(self.empty) + len(self.free_queue) + self.num_in_use == self.capacity, (
            "empty + cached + in use != capacity"
        )
        assert len(set(self.empty)) == len(self.empty)
        assert all(b in self for b in self.empty)
        assert not any(b in self.free_queue for b in self.empty)
        assert self.peak_in_use >= self.num_in_use
        assert self.free_queue._check_sanity()  # LRU's links, or an eviction policy's state
        return True
