"""GDSF adapted to prefix trees: frequency x cost / size with an inflation clock.

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
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ids import BlockId
from ..radix import PrefixIndex
from .base import LOW_BYTE, ClassQueuePolicy, KeyHistory, chain_keys, tick_entries

_UNIT = 1024
"""H is kept in 1/1024ths of `freq_weight = 1` (ints compare exactly)."""


@dataclass(frozen=True, slots=True)
class GDSFParams:
    freq_weight: float = 1.0
    """H gained per earlier use of the block's key (L grows by about one victim's H)."""
    max_freq: int = 16
    """Uses beyond this count no more (at most 255; bounds how long a hot block survives)."""
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks."""


class GDSFPolicy(ClassQueuePolicy):
    """Class = frequency; stamp = L when released; H = stamp + freq_weight x frequency."""

    __slots__ = ("params", "history", "inflation", "_weight", "_counted")

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

    def _classify(self, blocks: list[BlockId]) -> tuple[list[tuple[int, int]], int]:
        hist = self.history
        keys, partial = chain_keys(self.index, blocks)
        top = self.params.max_freq
        slots, earlier = hist.find(keys)
        freq = self._counted[earlier & LOW_BYTE]
        start = hist.clock
        hist.clock = start + keys.size + partial  # a partial block ticks, unremembered
        hist.store(keys, slots, tick_entries(start, keys.size) | freq, earlier)
        return self._cuts(np.minimum.accumulate(freq), top, partial), self.inflation

    def _now(self) -> int:
        return self.inflation

    def _head_scores(self, classes: list[int], stamps: list[int]) -> list[int]:
        w = self._weight
        return [t + w * c for c, t in zip(classes, stamps)]

    def _max_stamp(self, cls: int, score: int) -> int:
        return score - self._weight * cls

    def _evicted(self, stamp: int, cls: int) -> None:
        h = stamp + self._weight * cls
        if h > self.inflation:
            self.inflation = h
