"""Eviction policies beyond LRU, and admission, for the GPU pool of a cache manager.

`lru` is the `FreeQueue` itself (TensorRT-LLM's order within a priority level) and stays the
default and the fast path. Every other policy is one module here with a parameters dataclass
and a class implementing the free-queue calls (`policies/base.py` describes them); adding one
is that module plus one entry in `POLICIES`. The host tier always evicts LRU.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..free_queue import FreeQueue
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import KeyHistory
from .gdsf import GDSFParams, GDSFPolicy
from .lru2 import LRU2Params, LRU2Policy
from .predictive import PredictiveParams, PredictivePolicy
from .segments import S3FIFOParams, S3FIFOPolicy, SLRUParams, SLRUPolicy

POLICIES: dict[str, tuple[type, type]] = {
    "slru": (SLRUPolicy, SLRUParams),
    "s3fifo": (S3FIFOPolicy, S3FIFOParams),
    "gdsf": (GDSFPolicy, GDSFParams),
    "predictive": (PredictivePolicy, PredictiveParams),
    "lru2": (LRU2Policy, LRU2Params),
}
"""name -> (policy class, parameters dataclass); `lru` is not here: it is the plain FreeQueue."""

POLICY_NAMES = ("lru", *POLICIES)
ADMISSIONS = ("all", "second_use")


def make_free_queue(name: str, params, id_space: int, capacity: int, index: PrefixIndex):
    """The free queue of a GPU pool of `capacity` blocks for policy `name` (`params`: its
    parameters dataclass, None for the defaults)."""
    if name == "lru":
        return FreeQueue(id_space)
    try:
        cls, params_cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown eviction policy {name!r}") from None
    return cls(id_space, capacity, index, params if params is not None else params_cls())


@dataclass(frozen=True, slots=True)
class AdmissionParams:
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks."""


class SecondUseAdmission:
    """A computed block enters the cache only if its key was used before within the history
    (a doorkeeper: one-time prefixes never displace cached data). A block that was reused
    from the cache always re-enters it."""

    __slots__ = ("history",)

    def __init__(self, capacity: int, params: AdmissionParams) -> None:
        self.history = KeyHistory(int(params.history_ratio * capacity), per_key=True)

    def filter(self, blocks: list[BlockId], stored: list, fresh: bytearray
               ) -> tuple[list[BlockId], list[BlockId]]:
        """Split freed stored `blocks` (deepest first) into those admitted and those turned
        away, recording each key's use; `fresh[b]`: computed here (cleared). A partial block
        (no key) is kept, as with LRU."""
        keys = [stored[b][0] for b in blocks]
        seen = self.history.record_each(keys)
        kept: list[BlockId] = []
        away: list[BlockId] = []
        for b, key, was in zip(blocks, keys, seen):
            (kept if was or key is None or not fresh[b] else away).append(b)
            fresh[b] = 0
        return kept, away
