"""Typed ids and small value types shared by the cache modules."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import NewType

BlockId = NewType("BlockId", int)
"""Index of a block (one slot: tokens_per_block tokens for every layer of a life cycle) in its pool."""

BlockKey = NewType("BlockKey", int)
"""Identity of a full block's whole prefix (tokens and namespace): equal keys mean equal prefixes."""


DEFAULT_RETENTION_PRIORITY = 35
"""Retention priority of a block nobody gave one (TensorRT-LLM's kDefaultRetentionPriority);
an expired duration returns a block to it."""

MIN_RETENTION_PRIORITY, MAX_RETENTION_PRIORITY = 0, 100


@dataclass(frozen=True, slots=True)
class TokenRangeRetention:
    """Retention of the prompt blocks that start in tokens `[start, end)` (TensorRT-LLM's
    `TokenRangeRetentionConfig`): a block takes the range holding its first token."""

    start: int
    end: int | None
    """None = to the end of the prompt."""
    priority: int
    duration_ms: float | None = None
    """After this long in the free queue a block drops to the default priority; None = never."""


@dataclass(frozen=True, slots=True)
class Retention:
    """A request's retention config (TensorRT-LLM's `KvCacheRetentionConfig`): priorities of
    its prompt blocks by token range (blocks no range covers keep the request's priority) and
    of the blocks it generates. Ranges are sorted and do not overlap."""

    token_ranges: tuple[TokenRangeRetention, ...] = ()
    decode_priority: int = DEFAULT_RETENTION_PRIORITY
    decode_duration_ms: float | None = None

    def __post_init__(self) -> None:
        prev_end = 0
        for i, r in enumerate(self.token_ranges):
            if r.start < prev_end:
                raise ValueError("token ranges must be sorted and must not overlap")
            if r.end is not None and r.end <= r.start:
                raise ValueError("a token range must end after its start")
            if r.end is None and i != len(self.token_ranges) - 1:
                raise ValueError("only the last token range may run to the end (end: null)")
            prev_end = r.end if r.end is not None else r.start + 1
        for p in [r.priority for r in self.token_ranges] + [self.decode_priority]:
            if not MIN_RETENTION_PRIORITY <= p <= MAX_RETENTION_PRIORITY:
                raise ValueError(f"retention priorities are {MIN_RETENTION_PRIORITY}.."
                                 f"{MAX_RETENTION_PRIORITY} (got {p})")

    def prompt_blocks(self, tokens_per_block: int, prompt_tokens: int, default: int
                      ) -> list[tuple[int, float | None]]:
        """(priority, duration_ms) of each of the ceil(prompt_tokens / tokens_per_block)
        prompt blocks; `default` where no range holds a block's first token."""
        out = []
        ranges, k = self.token_ranges, 0
        for first in range(0, prompt_tokens, tokens_per_block):
            while k < len(ranges) and ranges[k].end is not None and ranges[k].end <= first:
                k += 1
            if k < len(ranges) and ranges[k].start <= first:
                out.append((ranges[k].priority, ranges[k].duration_ms))
            else:
                out.append((default, None))
        return out


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
