"""Sequence lifecycle over a paged block pool with prefix reuse.

A sequence is added (its longest cached prefix is matched and claimed), resized as its tokens
grow (blocks allocated, empty ones first, then by evicting the least recently used free cached
block), committed as tokens are computed (full blocks become reusable) and released (full
blocks stay cached, the unfilled last block is kept for partial reuse or dropped).

Invariants (checked by `_check_sanity`): every block is empty, cached or in use;
`ref_count[b]` equals the number of live sequences holding `b`; a block in use is never evicted
(eviction only takes from the free queue, which holds only blocks with ref_count 0); every
block in the free queue is stored in the prefix index.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from .ids import BlockId, BlockKey, CopyKind, CopyOp, Tier
from .pool import BlockPool
from .radix import PrefixIndex

if TYPE_CHECKING:
    from ..traffic.request import Request



@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What a cache manager is built from (the YAML `cache:` section, resolved to blocks)."""

    tokens_per_block: int
    """Tokens per block."""
    num_gpu_blocks: int
    """GPU blocks of this life cycle."""
    enable_block_reuse: bool = True
    """Store computed blocks and match prompts against them."""
    enable_partial_reuse: bool = True
    """Reuse the matching leading tokens of a block that matches only in part."""
    copy_on_partial_reuse: bool = True
    """Copy a partially matched block that is in use or has children instead of giving up."""
    emit_copy_ops: bool = False
    """Record every block copy as a `CopyOp` for a data plane (otherwise only count them)."""


class Sequence:
    """One request's hold on the cache."""

    __slots__ = (
        "request", "keys", "blocks", "num_tokens", "num_computed", "num_stored",
        "reused_tokens", "reused_full_blocks", "partial_tokens", "partial_copied",
    )

    def __init__(self, request: Request, keys: list[BlockKey]) -> None:
        self.request = request
        self.keys = keys
        """Keys of the full blocks whose tokens are known (the prompt's, at first)."""
        self.blocks: list[BlockId] = []
        self.num_tokens = 0
        """Tokens the allocated blocks must hold."""
        self.num_computed = 0
        """Tokens whose KV is in the blocks (reused or computed)."""
        self.num_stored = 0
        """Leading blocks already in the prefix index."""
        self.reused_tokens = 0
        self.reused_full_blocks = 0
        self.partial_tokens = 0
        self.partial_copied = False


class KVCacheManager:
    """Prefix-reusing block manager for one life cycle on the GPU tier."""

    __slots__ = (
        "spec", "tpb", "gpu", "index", "ref_count", "priority", "copy_ops",
        "evicted_blocks", "allocated_blocks", "partial_copy_blocks", "_live",
    )

    def __init__(self, spec: CacheSpec) -> None:
        if spec.tokens_per_block <= 0 or spec.num_gpu_blocks <= 0:
            raise ValueError("tokens_per_block and num_gpu_blocks must be positive")
        self.spec = spec
        self.tpb = spec.tokens_per_block
        n = spec.num_gpu_blocks
        self.gpu = BlockPool(Tier.GPU, 0, n, n)
        self.index = PrefixIndex(self.tpb, n, track_children=spec.enable_block_reuse and spec.enable_partial_reuse)
        self.ref_count = [0] * n
        self.priority = [0] * n
        self.copy_ops: list[CopyOp] = []
        self.evicted_blocks = 0
        self.allocated_blocks = 0
        self.partial_copy_blocks = 0
        self._live: set[Sequence] | None = None

    # --- public API -----------------------------------------------------------------------

    def match(self, request: Request) -> tuple[list[BlockId], tuple[BlockId, int] | None]:
        """The stored blocks a new sequence of `request` would reuse now, without claiming:
        full blocks, then at most one partially matching block with its token count. Reuse
        stops one token short of the prompt, whose last token is always computed."""
        if not self.spec.enable_block_reuse:
            return [], None
        tpb = self.tpb
        max_reuse = request.input_length - 1
        keys = request.block_keys(tpb)
        full = self.index.walk(keys, max_reuse // tpb)
        partial = None
        if self.index.kids is not None:
            pos = len(full)
            parent = keys[pos - 1] if full else request.root_key
            partial = self.index.best_partial(parent, request, pos, min(tpb, max_reuse - pos * tpb))
        return full, partial

    def estimate_reuse(self, request: Request) -> int:
        """Tokens a sequence added now would reuse, assuming a partial copy gets its block."""
        full, partial = self.match(request)
        reused = len(full) * self.tpb
        if partial is not None and self._partial_usable(partial[0]):
            reused += partial[1]
        return reused

    def add_sequence(self, request: Request) -> Sequence:
        """Claim the request's reusable prefix: the new sequence holds the matched blocks."""
        seq = Sequence(request, request.block_keys(self.tpb))
        full, partial = self.match(request)
        for b in full:
            self._claim(b)
        seq.blocks = full
        seq.num_stored = seq.reused_full_blocks = len(full)
        reused = len(full) * self.tpb
        if partial is not None:
            reused += self._reuse_partial(seq, *partial)
        seq.reused_tokens = seq.num_computed = seq.num_tokens = reused
        self._track(seq)
        return seq

    def resize(self, seq: Sequence, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens. Returns False, allocating nothing, when
        the pool cannot supply them; shrinking is not supported (use `release`)."""
        if num_tokens < seq.num_tokens:
            raise ValueError("resize cannot shrink a sequence")
        need = -(-num_tokens // self.tpb) - len(seq.blocks)
        if need > 0:
            new = self._allocate(need, seq.request.priority)
            if new is None:
                return False
            seq.blocks.extend(new)
        seq.num_tokens = num_tokens
        return True

    def commit(self, seq: Sequence, num_computed: int) -> None:
        """Record that the first `num_computed` tokens of `seq` hold their KV; full blocks
        among them become reusable by other sequences."""
        if num_computed > seq.num_tokens:
            raise ValueError("cannot commit tokens that have no block")
        seq.num_computed = max(seq.num_computed, num_computed)
        if not self.spec.enable_block_reuse:
            return
        keys = seq.keys
        end = min(seq.num_computed // self.tpb, len(keys))
        begin = seq.num_stored
        if begin < end:
            parent = keys[begin - 1] if begin else seq.request.root_key
            self.index.insert_full(seq.blocks, keys, begin, end, parent, seq.request)
            seq.num_stored = end

    def release(self, seq: Sequence) -> None:
        """Drop the sequence's hold; stored blocks stay cached, the deepest first in line for
        eviction (a request touches its blocks in order, so its deeper ones are the less
        valuable), the rest become empty."""
        self._untrack(seq)
        self._store_tail(seq)
        ref, prio, source = self.ref_count, self.priority, self.index.source
        empty = self.gpu.empty
        level = seq.request.priority
        cached: list[BlockId] = []
        freed = 0
        for b in reversed(seq.blocks):
            r = ref[b] - 1
            ref[b] = r
            if r:
                continue
            freed += 1
            if source[b] is not None:
                prio[b] = level
                cached.append(b)
            else:
                empty.append(b)
        self.gpu.free_queue.push_back_many(cached, level)
        self.gpu.num_in_use -= freed
        seq.blocks = []

    def enable_sanity_tracking(self) -> None:
        """Track live sequences so `_check_sanity` can verify ref counts (tests only)."""
        self._live = set()

    # --- helpers --------------------------------------------------------------------------

    def _claim(self, b: BlockId) -> None:
        r = self.ref_count[b]
        if r == 0:
            self.gpu.free_queue.remove(b)
            self.gpu.num_in_use += 1
            self._bump_peak()
        self.ref_count[b] = r + 1

    def _unclaim(self, b: BlockId) -> None:
        r = self.ref_count[b] - 1
        self.ref_count[b] = r
        if r == 0:
            self.gpu.num_in_use -= 1
            self.gpu.free_queue.push_back(b, self.priority[b])

    def _partial_usable(self, b: BlockId) -> bool:
        shared = self.ref_count[b] > 0 or self.index.has_children(b)
        return not shared or self.spec.copy_on_partial_reuse

    def _reuse_partial(self, seq: Sequence, b: BlockId, n: int) -> int:
        """Take a partially matched block into `seq`: claim it when nobody else can need it,
        else copy its first `n` tokens into a fresh block. Returns the tokens reused."""
        if self.ref_count[b] == 0 and not self.index.has_children(b):
            # Its tokens past `n` will be overwritten, so it leaves the index.
            self.gpu.free_queue.remove(b)
            self.index.remove(b)
            self.gpu.num_in_use += 1
            self._bump_peak()
            self.ref_count[b] = 1
            seq.blocks.append(b)
        elif self.spec.copy_on_partial_reuse:
            self._claim(b)  # the source must survive the allocation of its copy
            new = self._allocate(1, seq.request.priority)
            self._unclaim(b)
            if new is None:
                return 0
            dst = new[0]
            self.partial_copy_blocks += 1
            if self.spec.emit_copy_ops:
                self.copy_ops.append(CopyOp(CopyKind.PARTIAL, Tier.GPU, b, Tier.GPU, dst, n))
            seq.blocks.append(dst)
            seq.partial_copied = True
        else:
            return 0
        seq.partial_tokens = n
        return n

    def _allocate(self, n: int, priority: int) -> list[BlockId] | None:
        pool = self.gpu
        empty, fq = pool.empty, pool.free_queue
        if n > len(empty) + len(fq):
            return None
        k = min(n, len(empty))
        out = empty[len(empty) - k:]
        out.reverse()
        del empty[len(empty) - k:]
        if k < n:
            victims = fq.pop_front_many(n - k)
            self.index.remove_many(victims)
            self.evicted_blocks += len(victims)
            out.extend(victims)
        ref, prio = self.ref_count, self.priority
        for b in out:
            ref[b] = 1
            prio[b] = priority
        pool.num_in_use += n
        self.allocated_blocks += n
        self._bump_peak()
        return out

    def _bump_peak(self) -> None:
        pool = self.gpu
        if pool.num_in_use > pool.peak_in_use:
            pool.peak_in_use = pool.num_in_use

    def _store_tail(self, seq: Sequence) -> None:
        """Keep the computed, unfilled last block for partial reuse."""
        tpb = self.tpb
        i, n = divmod(seq.num_computed, tpb)
        if not n or self.index.kids is None or seq.num_computed > seq.request.input_length:
            return
        b = seq.blocks[i]
        if self.ref_count[b] > 1 or self.index.source[b] is not None:
            return
        request = seq.request
        parent = seq.keys[i - 1] if i else request.root_key
        self.index.insert_partial(b, parent, request, i, n)

    def _track(self, seq: Sequence) -> None:
        if self._live is not None:
            self._live.add(seq)

    def _untrack(self, seq: Sequence) -> None:
        if self._live is not None:
            self._live.discard(seq)

    def _check_sanity(self) -> bool:
        pool = self.gpu
        assert pool._check_sanity()
        assert self.index._check_sanity()
        for b in range(pool.capacity):
            in_queue = b in pool.free_queue
            if self.ref_count[b] > 0:
                assert not in_queue, "a block in use sits in the free queue"
            elif in_queue:
                assert self.index.is_stored(b), "a cached block is not in the index"
        assert sum(1 for r in self.ref_count if r > 0) == pool.num_in_use
        if self._live is not None:
            owners = [0] * pool.capacity
            for seq in self._live:
                for b in seq.blocks:
                    owners[b] += 1
            assert owners == self.ref_count, "ref counts do not match the live sequences"
        return True
