"""Typed ids and small value types shared by the cache modules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a block (one slot: tokens_per_block tokens for every layer of a life cycle) in its pool."""

BlockKey = NewType("BlockKey", int)
"""Identity of a full block's whole prefix (tokens and namespace): equal keys mean equal prefixes."""


class Tier(IntEnum):
    GPU = 0
    HOST = 1


class CopyKind(IntEnum):
    ONBOARD = 0
    """host -> GPU before a host hit is used"""
    OFFLOAD = 1
    """GPU -> host when a GPU block holding reusable data is evicted"""
    PARTIAL = 2
    """the first `num_tokens` tokens of a partially matched block into a fresh block"""


@dataclass(frozen=True, slots=True)
class CopyOp:
    """One block move the data plane must execute, in emission order."""

    kind: CopyKind
    src_tier: Tier
    src: BlockId
    dst_tier: Tier
    dst: BlockId
    num_tokens: int
