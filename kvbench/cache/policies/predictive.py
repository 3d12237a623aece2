"""A predictive policy that learns from the traffic as it replays (no look-ahead).

Each released block falls in a class: how many times its key has been used (1, 2, ...,
`max_class` or more), remembered past eviction in a bounded history. For every class the
policy counts uses and how many of them were followed by another use of the same key within a
horizon of `horizon_ratio` x the pool's blocks of traffic (the clock counts released blocks,
so the horizon scales with the load, not with wall time). That share, smoothed towards a prior,
is the class's estimated chance of reuse soon, `p`.

A block's score is `release clock + boost x horizon x p` with the class's *current* `p`: LRU
order, where a block expected to be reused is kept as if it had been released
`boost x horizon x p` blocks of traffic later. With `p` equal for every class this is exactly
LRU; the more the classes differ on the traffic, the further the policy departs from LRU.
Outcomes are learnt only when they happen: a use still inside its horizon has not counted as
a miss yet, so early estimates lean low for every class alike.

Prefix trees: a block's class is capped at its parent's (from the same release) and `p` is
made non-decreasing over the classes (a running maximum), so a child never outranks its parent
and, at equal score, the deeper block goes first.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..ids import BlockId
from ..radix import PrefixIndex
from .base import LOW_BYTE, ClassQueuePolicy, KeyHistory, chain_keys, tick_entries


@dataclass(frozen=True, slots=True)
class PredictiveParams:
    horizon_ratio: float = 16.0
    """Reuse counts as 'soon' within this many pool sizes of released blocks."""
    boost: float = 4.0
    """How far (in horizons) a block with certain reuse is kept past LRU order."""
    max_class: int = 6
    """Uses counted separately up to this (at most 255); more fall in the last class."""
    prior: float = 0.2
    """Reuse chance assumed for a class before it has data."""
    prior_weight: float = 20.0
    """Pseudo-uses the prior counts for."""
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks."""


class PredictivePolicy(ClassQueuePolicy):
    __slots__ = ("params", "history", "uses", "reuses", "_horizon", "_scale", "_shift",
                 "_next_class")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: PredictiveParams) -> None:
        super().__init__(id_space, capacity, index, params.max_class + 1)
        self.params = params
        self.history = KeyHistory(int(params.history_ratio * capacity))
        self.uses = [0] * (params.max_class + 1)
        """Per class: uses seen (class 0 is unused)."""
        self.reuses = [0] * (params.max_class + 1)
        """Per class: uses followed by another use within the horizon."""
        self._horizon = int(params.horizon_ratio * capacity)
        self._next_class = np.minimum(np.arange(256) + 1, params.max_class)
        """A use's class by the uses remembered before it (0: not remembered)."""
        self._scale = params.boost * self._horizon
        self._shift = [0] * (params.max_class + 1)
        """Per class: `boost x horizon x p` (an int), non-decreasing over the classes."""

    def reuse_chance(self, cls: int) -> float:
        """The learnt chance that a use of class `cls` is followed by another soon."""
        p = self.params
        return (self.reuses[cls] + p.prior * p.prior_weight) / (self.uses[cls] + p.prior_weight)

    def _classify(self, blocks: list[BlockId]) -> tuple[list[tuple[int, int]], int]:
        hist = self.history
        keys, partial = chain_keys(self.index, blocks)
        top = self.params.max_class
        slots, earlier = hist.find(keys)
        was = earlier & LOW_BYTE  # 0: not remembered
        cls = self._next_class[was]  # a key not remembered: class 1
        start, n = hist.clock, keys.size
        hist.clock = start + n + partial  # a partial block ticks, unremembered
        # A use followed by this one within the horizon was reused soon: its entry is at
        # least the entry of the tick `horizon` before this one's (the payload is below one
        # tick), so one arange stands for the ticks, the shift and the subtraction. Keys not
        # remembered fall in bin 0 (their entry 0 may be within it): dropped, class 0 is
        # unused.
        soon = np.bincount(was[earlier >= tick_entries(start - self._horizon, n)],
                           minlength=top + 1).tolist()
        soon[0] = 0
        used = np.bincount(cls, minlength=top + 1)
        used[1] += partial
        self.reuses = [a + b for a, b in zip(self.reuses, soon)]
        self.uses = [a + b for a, b in zip(self.uses, used.tolist())]
        hist.store(keys, slots, tick_entries(start, n) | cls, earlier)
        self._update_shifts()
        return self._cuts(cls, top, partial), start

    def _update_shifts(self) -> None:
        shift, scale = self._shift, self._scale
        best = 0
        for c in range(1, len(shift)):
            s = int(scale * self.reuse_chance(c))
            if s > best:
                best = s
            shift[c] = best

    def _now(self) -> int:
        return self.history.clock

    def _head_scores(self, classes: list[int], stamps: list[int]) -> list[int]:
        shift = self._shift
        return [t + shift[c] for c, t in zip(classes, stamps)]

    def _max_stamp(self, cls: int, score: int) -> int:
        return score - self._shift[cls]
