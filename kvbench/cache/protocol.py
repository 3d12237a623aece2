"""The engine-cache contract: what the engine loops, the runner and the data-plane step
builder call on a cache manager. `KVCacheManager` (one pool) and `WindowedCacheManager` (one
pool per attention life cycle) both implement it, so nothing outside `cache/` tells them
apart."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple, Protocol

from .ids import BlockId, CopyOp


class PageView(NamedTuple):
    """The pages one beam of a sequence reads and writes in one pool in a step computing from
    position `start`: its blocks from `first_block` on (earlier ones are out of window and may
    be gone) and the scratch pages of blocks that live in scratch slots. A beam other than 0
    computes only its own positions, past the context the beams share."""

    pool: int
    beam: int
    start: int
    first_block: int
    blocks: Sequence[BlockId]
    scratch: Mapping[int, int] | None


class CacheManager(Protocol):
    """A paged KV cache as the engine drives it. `seq` is whatever `add_sequence` returned."""

    tpb: int
    """Tokens per block."""
    gpu: object
    """The GPU tier as one pool view: `num_in_use`, `num_cached`, `empty`, `peak_in_use`."""

    def refresh(self, now_s: float) -> None:
        """Advance the cache's clock to `now_s` (retention durations end), before a step's
        allocations."""

    def estimate_add(self, request) -> tuple[int, int, int]:
        """(reused tokens, block positions they span, free GPU blocks the add keeps, the
        most of any pool) of an add now."""

    def estimate_pools(self, request, plan) -> tuple[int, int, list[int]]:
        """`estimate_add` with the free GPU blocks the add keeps in each pool, entered in
        the step's `AddPlan` (the scheduler's per-pool admission)."""

    def free_per_pool(self) -> list[int]:
        """Free GPU blocks (empty or evictable) of each pool."""

    def add_need(self, request, plan, draws: list[int], positions: int,
                 num_tokens: int) -> list[int]:
        """Per pool, the free GPU blocks the add just estimated and its first step, to
        `num_tokens`, take."""

    def grow_need(self, request, seq, num_tokens: int) -> list[int]:
        """Per pool, the free GPU blocks `resize(seq, num_tokens)` takes."""

    def add_sequence(self, request): ...

    def add_sequences(self, requests: list) -> list:
        """The two-phase batched add: every match of the step is claimed first."""

    def resize(self, seq, num_tokens: int) -> bool:
        """Blocks for `num_tokens` tokens; False when a pool is out of blocks."""

    def grow_blocks(self, request, have: int, num_tokens: int) -> int: ...

    def commit(self, seq, num_computed: int) -> None: ...

    def shrink(self, seq, num_tokens: int) -> int: ...

    def release(self, seq) -> None: ...

    def drain_copy_ops(self) -> dict[int, list[CopyOp]]:
        """The copy ops emitted since the last drain, by pool (pools without any left out)."""

    def page_views(self, seq, start: int, end: int) -> list[PageView]:
        """The views of a step of `seq` computing positions `[start, end)`: per pool, beam 0
        and then each other beam that computes own positions."""

    def memory_metrics(self, slot_bytes: int) -> dict:
        """gpu/host blocks total, GPU bytes total, peaks (and per-pool figures with several pools);
        `slot_bytes` is the bytes of one block of a one-pool cache."""

    def moved_bytes(self, slot_bytes: int) -> tuple[int, int]:
        """(onboarded, offloaded) bytes so far, each pool's blocks at its own slot size."""

    allocated_blocks: int
    evicted_blocks: int
    onboard_blocks: int
    offload_blocks: int
    host_evicted_blocks: int
    partial_copy_blocks: int
    peak_host_blocks: int
