"""Sequence lifecycle over paged block pools (GPU, optional host tier) with prefix reuse.

A sequence is added (its longest cached prefix is matched and claimed, host hits onboarded),
resized as its tokens grow (blocks allocated, empty ones first, then by evicting the least
recently used free cached block), committed as tokens are computed (full blocks become
reusable) and released (full blocks stay cached, the unfilled last block is kept for partial
reuse or dropped).

The parts: the add path (match, two-phase claim and onboard, the batched add's estimate) in
`add.py`, the host tier (offload, onboard) in `host_tier.py`, the sequence and the beams'
block arithmetic in `seq.py`; this module holds the pools, allocation and eviction, commit,
release and retention, and the engine-cache contract's views.

Invariants (checked by `_check_sanity`): every block is empty, cached or in use in its pool;
`ref_count[b]` equals the number of live sequences holding `b` (a beam's own block counts
once, a shared one once per sequence); a block in use is never evicted
(eviction takes only from free queues, which hold only blocks with ref_count 0); every block in
a free queue is stored in the prefix index; a live sequence holds only GPU blocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from heapq import heappop, heappush
from typing import TYPE_CHECKING

from .add import AddPath, AddPlan
from .host_tier import HostTier
from .ids import DEFAULT_RETENTION_PRIORITY, BlockId, CopyKind, CopyOp, Tier
from .policies import AdmissionParams, SecondUseAdmission, make_free_queue
from .pool import BlockPool
from .protocol import PageView
from .radix import PrefixIndex
from .seq import NO_BLOCK, CacheSeq, grow_blocks, shared_blocks

if TYPE_CHECKING:
    from ..traffic.request import Request


@dataclass(frozen=True, slots=True)
class CacheSpec:
    """What a cache manager is built from (the YAML `cache:` section, resolved to blocks)."""

    tokens_per_block: int
    """Tokens per block."""
    num_gpu_blocks: int
    """GPU blocks of this life cycle."""
    num_host_blocks: int = 0
    """Host (secondary tier) blocks; 0 = no host tier."""
    enable_block_reuse: bool = True
    """Store computed blocks and match prompts against them."""
    enable_partial_reuse: bool = True
    """Reuse the matching leading tokens of a block that matches only in part."""
    copy_on_partial_reuse: bool = True
    """Copy a partially matched block that is in use or has children instead of giving up."""
    take_partial_in_place: bool = True
    """Take a free, childless partially matched block itself (TensorRT-LLM: its tokens past
    the match are overwritten, so it leaves the index); False copies it as if in use, so no
    stored data is ever lost (the unlimited cache of the ideal reference)."""
    secondary_offload_min_priority: int = 30
    """Evicted GPU blocks below this retention priority are dropped, not offloaded
    (TensorRT-LLM's kDefaultSecondaryOffloadMinPriority)."""
    emit_copy_ops: bool = False
    """Record every block copy as a `CopyOp` for a data plane (otherwise only count them)."""
    cross_kv: bool = False
    """Cross-attention KV (written once from the encoder output): every block, the last
    included, is shared among a sequence's beams."""
    strict_phase2: bool = False
    """Raise `Phase2AllocationError` when an onboard or a partial copy finds no GPU block
    (TensorRT-LLM throws); otherwise that request's reuse ends there and it is counted."""
    eviction_policy: str = "lru"
    """Order of the GPU pool's free cached blocks inside a priority level (`policies/`)."""
    policy_params: object = None
    """The policy's parameters dataclass; None = its defaults."""
    admission: str = "all"
    """`all`: every computed block is cached; `second_use`: only if its key was used before."""


class KVCacheManager(AddPath, HostTier):
    """Prefix-reusing block manager for one life cycle: a GPU pool and an optional host pool
    whose block ids follow the GPU ones in one id space."""

    __slots__ = (
        "spec", "tpb", "gpu", "host", "index", "ref_count", "priority", "copy_ops",
        "evicted_blocks", "allocated_blocks", "partial_copy_blocks", "onboard_blocks",
        "offload_blocks", "host_evicted_blocks", "peak_host_blocks", "phase2_alloc_failures",
        "now_s", "expires", "_expiring", "_moved", "_live",
        "_admission", "_fresh",
    )

    def __init__(self, spec: CacheSpec) -> None:
        if spec.tokens_per_block <= 0 or spec.num_gpu_blocks <= 0 or spec.num_host_blocks < 0:
            raise ValueError("tokens_per_block and num_gpu_blocks must be positive")
        self.spec = spec
        self.tpb = spec.tokens_per_block
        g, h = spec.num_gpu_blocks, spec.num_host_blocks
        self.gpu = BlockPool(Tier.GPU, 0, g, g + h)
        self.host = BlockPool(Tier.HOST, g, h, g + h) if h else None
        track = spec.enable_block_reuse and spec.enable_partial_reuse
        self.index = PrefixIndex(self.tpb, g + h, track_children=track)
        if spec.eviction_policy != "lru":
            self.gpu.free_queue = make_free_queue(
                spec.eviction_policy, spec.policy_params, g + h, g, self.index)
        self._admission: SecondUseAdmission | None = None
        self._fresh: bytearray | None = None
        """With admission: 1 for a GPU block whose data was computed here (not reused)."""
        if spec.admission == "second_use":
            self._admission = SecondUseAdmission(g, AdmissionParams())
            self._fresh = bytearray(g + h)
        elif spec.admission != "all":
            raise ValueError(f"unknown admission {spec.admission!r}")
        self.ref_count = [0] * (g + h)
        self.priority = [0] * (g + h)
        self.copy_ops: list[CopyOp] = []
        self.evicted_blocks = 0
        """GPU blocks whose cached data was evicted (offloaded or dropped)."""
        self.allocated_blocks = 0
        self.partial_copy_blocks = 0
        self.onboard_blocks = 0
        self.offload_blocks = 0
        """GPU blocks whose data moved to the host."""
        self.host_evicted_blocks = 0
        """Host blocks whose data was dropped to make room for an offload."""
        self.peak_host_blocks = 0
        """Most host blocks holding data at once."""
        self.phase2_alloc_failures = 0
        """Onboards and partial copies that found no free GPU block (the reuse ended there)."""
        self.now_s = 0.0
        """The caller's clock (`refresh`): retention durations run on it."""
        self.expires = [0.0] * (g + h)
        """When a free block's retention duration ends (0: none); valid while it is free."""
        self._expiring: list[tuple[float, BlockId]] = []
        """Heap of (expiry, block) of free blocks released with a duration; stale entries
        (the block was claimed or released again since) are skipped."""
        self._moved: dict[BlockId, BlockId] = {}
        """Host block -> the GPU block it was onboarded to, within one add (several requests
        of a batch may have claimed the same host block)."""
        self._live: set[CacheSeq] | None = None

    # --- public API -----------------------------------------------------------------------

    def refresh(self, now_s: float) -> None:
        """Advance the clock to `now_s` and move each free block whose retention duration
        has ended to the default priority, at the back of its queue (TensorRT-LLM's
        `LRUEvictionPolicy::refresh`). Call it before the allocations of each step."""
        self.now_s = now_s
        heap, expires, prio = self._expiring, self.expires, self.priority
        while heap and heap[0][0] <= now_s:
            t, b = heappop(heap)
            if expires[b] != t:
                continue
            expires[b] = 0.0
            fq = self._pool(b).free_queue
            if b in fq and prio[b] != DEFAULT_RETENTION_PRIORITY:
                prio[b] = DEFAULT_RETENTION_PRIORITY
                fq.requeue(b, DEFAULT_RETENTION_PRIORITY)
    def resize(self, seq: CacheSeq, num_tokens: int) -> bool:
        """Give `seq` blocks for `num_tokens` tokens. Returns False, allocating nothing, when
        the GPU pool cannot supply them; shrinking is not supported (use `release`)."""
        if num_tokens < seq.num_tokens:
            raise ValueError("resize cannot shrink a sequence")
        positions = -(-num_tokens // self.tpb)
        need = positions - len(seq.blocks)
        if need > 0:
            own = 0 if not seq.beams else max(
                0, positions - max(len(seq.blocks), seq.shared_blocks))
            new = self._allocate(need + len(seq.beams) * own, seq.request.priority)
            if new is None:
                return False
            seq.blocks.extend(new[:need])
            for j, beam in enumerate(seq.beams):
                beam.extend(new[need + j * own:need + (j + 1) * own])
        seq.num_tokens = num_tokens
        return True

    def grow_blocks(self, request: Request, have: int, num_tokens: int) -> int:
        """GPU blocks `resize` takes to grow a sequence of `request` (holding `have` block
        positions) to `num_tokens` tokens (what a scheduler counts with)."""
        return grow_blocks(self.tpb, request, have, num_tokens, self.spec.cross_kv)

    # Admission by pool: one here, one per life cycle in `WindowedCacheManager`, so that a
    # scheduler budgets either alike (a step fits when it fits every pool).

    def free_per_pool(self) -> list[int]:
        """Free GPU blocks (empty or evictable) of each pool: one here."""
        return [self.gpu.num_free]

    def estimate_pools(self, request: Request, plan: AddPlan | None = None
                       ) -> tuple[int, int, list[int]]:
        """`estimate_add` with the draw per pool (one here)."""
        reused, positions, draw = self.estimate_add(request, plan)
        return reused, positions, [draw]

    def add_need(self, request: Request, plan: AddPlan, draws: list[int], positions: int,
                 num_tokens: int) -> list[int]:
        """Per pool, the free GPU blocks that the batched add of `request`, just estimated
        into `plan` (`estimate_pools`: its `draws`, its reuse spanning `positions` block
        positions), and growing it to `num_tokens` tokens take: what the add keeps, then the
        larger of the copy source it holds until phase 2 ends and the new blocks."""
        return [draws[0] + max(plan.transient, self.grow_blocks(request, positions, num_tokens))]

    def grow_need(self, request: Request, seq: CacheSeq, num_tokens: int) -> list[int]:
        """Per pool, the free GPU blocks `resize(seq, num_tokens)` takes (`seq` of `request`)."""
        return [self.grow_blocks(request, len(seq.blocks), num_tokens)]

    def commit(self, seq: CacheSeq, num_computed: int) -> None:
        """Record that the first `num_computed` tokens of `seq` hold their KV; full blocks
        among them become reusable by other sequences."""
        if num_computed > seq.num_tokens:
            raise ValueError("cannot commit tokens that have no block")
        seq.num_computed = max(seq.num_computed, num_computed)
        if not self.spec.enable_block_reuse:
            return
        if self.spec.cross_kv and seq.num_computed == seq.request.input_length:
            # Written once and never grown: the unfilled last block is final, so other
            # sequences may share it at once.
            self._store_tail(seq)
        keys = seq.keys
        end = min(seq.num_computed // self.tpb, len(keys))
        begin = seq.num_stored
        if begin < end:
            if seq.holes:
                self._insert_around_holes(seq, begin, end)
            else:
                parent = keys[begin - 1] if begin else seq.request.root_key
                self.index.insert_full(seq.blocks, keys, begin, end, parent, seq.request)
            seq.num_stored = end

    def release(self, seq: CacheSeq) -> None:
        """Drop the sequence's hold; stored blocks stay cached, the deepest first in line for
        eviction (a request touches its blocks in order, so its deeper ones are the less
        valuable), the rest become empty."""
        self._untrack(seq)
        self._store_tail(seq)
        for beam in seq.beams:
            self._unhold(beam, seq.request, seq.shared_blocks)
            beam.clear()
        self._unhold(seq.blocks, seq.request)
        seq.holes = False
        seq.blocks = []
    def shrink(self, seq: CacheSeq, num_tokens: int) -> int:
        """Undo `resize` down to `num_tokens` tokens before anything past them is computed
        (the revert of a deferred context request): the blocks beyond are returned. Returns
        how many blocks `seq` gave up."""
        if num_tokens < seq.num_computed:
            raise ValueError("cannot shrink below the computed tokens")
        keep = -(-num_tokens // self.tpb)
        extra = seq.blocks[keep:]
        del seq.blocks[keep:]
        own = max(0, keep - seq.shared_blocks)
        for beam in seq.beams:  # never stored, so their positions do not matter
            extra.extend(beam[own:])
            del beam[own:]
        seq.num_tokens = min(seq.num_tokens, num_tokens)
        self._unhold(extra, seq.request, keep)
        return len(extra) - extra.count(NO_BLOCK) if seq.holes else len(extra)
    def hold_blocks(self, request: Request, num_tokens: int) -> CacheSeq:
        """A one-beam sequence of `request` holding fresh GPU blocks for `num_tokens` tokens
        that it never stores (scratch slots, `windows.py`); the caller has checked that the
        pool has them."""
        seq = CacheSeq(request, [], beam_width=1)
        self._track(seq)
        if not self.resize(seq, num_tokens):
            raise AssertionError("hold_blocks without the free blocks")
        return seq

    def skip_blocks(self, seq: CacheSeq, n: int) -> None:
        """Give the next `n` positions of `seq` no block of their own (NO_BLOCK): a caller
        serves them elsewhere (scratch slots) and they are never stored; `resize` then
        allocates only the positions after them."""
        if n > 0:
            seq.blocks.extend([NO_BLOCK] * n)
            seq.holes = True

    def release_blocks(self, seq: CacheSeq, begin: int, end: int, keep_cached: bool = True) -> int:
        """Release blocks `[begin, end)` of a live sequence (those a sliding window no longer
        needs) in every beam, leaving NO_BLOCK in their place. A block no other sequence holds
        becomes free: with `keep_cached` a stored one joins the free queue as in `release`
        (still reusable until evicted), otherwise it is dropped from the index and becomes
        empty; a beam's own blocks are never stored, so they become empty. Commit the
        sequence first, or its computed blocks are lost. Returns the GPU blocks freed."""
        blocks = seq.blocks
        freed = 0
        shared = seq.shared_blocks
        lo = max(begin, shared) - shared
        for beam in seq.beams:  # positions from `shared` on; never stored
            stop = min(end - shared, len(beam))
            if lo < stop:
                gone = beam[lo:stop]
                beam[lo:stop] = [NO_BLOCK] * (stop - lo)
                seq.holes = True
                freed += self._unhold(gone, seq.request, shared + lo, keep_cached)
        end = min(end, len(blocks))
        if end <= begin:
            return freed
        gone = blocks[begin:end]
        blocks[begin:end] = [NO_BLOCK] * (end - begin)
        seq.holes = True
        return freed + self._unhold(gone, seq.request, begin, keep_cached)

    # --- the engine-cache contract (`cache/protocol.py`) -----------------------------------

    def drain_copy_ops(self) -> dict[int, list[CopyOp]]:
        if not self.copy_ops:
            return {}
        ops = {0: list(self.copy_ops)}
        self.copy_ops.clear()
        return ops

    def page_views(self, seq: CacheSeq, start: int, end: int) -> list[PageView]:
        views = [PageView(0, 0, start, 0, seq.blocks, None)]
        own = max(start, seq.shared_blocks * self.tpb)
        if seq.beams and own < end:
            views += [PageView(0, beam, own, 0, seq.beam_blocks(beam), None)
                      for beam in range(1, seq.beam_width)]
        return views

    def memory_metrics(self, slot_bytes: int) -> dict:
        peak = self.gpu.peak_in_use
        return {"gpu_blocks_total": self.spec.num_gpu_blocks,
                "gpu_bytes_total": self.spec.num_gpu_blocks * slot_bytes,
                "host_blocks_total": self.spec.num_host_blocks,
                "peak_gpu_blocks": peak, "peak_gpu_bytes": peak * slot_bytes}

    def moved_bytes(self, slot_bytes: int) -> tuple[int, int]:
        return self.onboard_blocks * slot_bytes, self.offload_blocks * slot_bytes

    def enable_sanity_tracking(self) -> None:
        """Track live sequences so `_check_sanity` can verify ref counts (tests only)."""
        self._live = set()

    # --- helpers --------------------------------------------------------------------------

    def _unhold(self, blocks: list[BlockId], request: Request, first: int = 0,
                keep_cached: bool = True) -> int:
        """Drop one hold on each of `blocks`, a run of `request`'s sequence from position
        `first` (NO_BLOCK entries are skipped). A block nobody holds any more becomes free: a
        stored one joins the free queue at its retention priority (the request's, or its
        position's under the request's `retention`: prompt blocks by token range, later ones
        the decode retention), the deepest first in line for eviction as a request touches
        its blocks in order, unless `keep_cached` is off, then it leaves the index; the rest
        become empty. Returns the blocks freed."""
        ref, stored, index = self.ref_count, self.index.stored, self.index
        empty, prio = self.gpu.empty, self.priority
        level = request.priority
        cached: list[BlockId] = []
        """The freed stored blocks, deepest first."""
        freed = 0
        for b in reversed(blocks):
            if b < 0:  # NO_BLOCK
                continue
            r = ref[b] - 1
            ref[b] = r
            if r:
                continue
            freed += 1
            if stored[b] is None:
                empty.append(b)
            elif keep_cached:
                cached.append(b)
                prio[b] = level
            else:
                index.remove(b)
                empty.append(b)
        self.gpu.num_in_use -= freed
        if cached and self._admission is not None:
            cached = self._admit(cached)
        if not cached:
            return freed
        fq = self.gpu.free_queue
        if request.retention is None:
            fq.push_back_many(cached, level)
            if self._expiring:  # a stale heap entry may name one of them
                expires = self.expires
                for b in cached:
                    expires[b] = 0.0
            return freed
        table = request.block_retentions(self.tpb)
        decode = (request.retention.decode_priority, request.retention.decode_duration_ms)
        where = {b: first + i for i, b in enumerate(blocks)}
        # Runs of one level go to the queue together: a policy sees a chain, not lone blocks.
        run: list[BlockId] = []
        for b in cached:
            pos = where[b]
            level, duration_ms = table[pos] if pos < len(table) else decode
            if run and prio[run[-1]] != level:
                fq.push_back_many(run, prio[run[-1]])
                run = []
            prio[b] = level
            run.append(b)
            self._set_expiry(b, level, duration_ms)
        fq.push_back_many(run, prio[run[-1]])
        return freed

    def _shared_blocks(self, request: Request) -> int:
        return shared_blocks(self.tpb, request, self.spec.cross_kv)

    def _set_expiry(self, b: BlockId, level: int, duration_ms: float | None) -> None:
        """Start free block `b`'s retention duration: when it ends (`refresh`) the block
        drops to the default priority. As TensorRT-LLM, a block at the default has none."""
        if duration_ms is not None and level != DEFAULT_RETENTION_PRIORITY:
            t = self.now_s + duration_ms / 1e3
            self.expires[b] = t
            heappush(self._expiring, (t, b))
        elif self._expiring:
            self.expires[b] = 0.0

    def _admit(self, cached: list[BlockId]) -> list[BlockId]:
        """The freed stored blocks among `cached` the admission lets into the cache;
        computed ones it turns away leave the index and become empty. Reused blocks always
        stay (their keys are still recorded as used)."""
        kept, away = self._admission.filter(cached, self.index.stored, self._fresh)
        if away:
            self.index.remove_many(away)
            self.gpu.empty += away
        return kept

    def _pool(self, b: BlockId) -> BlockPool:
        return self.gpu if b < self.gpu.capacity else self.host
    def _claim(self, b: BlockId) -> None:
        self._claim_many((b,))

    def _claim_many(self, blocks: list[BlockId]) -> None:
        """One more hold on each of `blocks` (NO_BLOCK entries are skipped); a free one leaves
        its pool's free queue."""
        ref, g = self.ref_count, self.gpu.capacity
        gpu = self.gpu
        # The GPU blocks leave the free queue in one call: a match claims hundreds at once.
        freed: list[BlockId] = []
        take = freed.append
        for b in blocks:
            if b < 0:  # NO_BLOCK
                continue
            r = ref[b]
            if r == 0:
                if b < g:
                    take(b)
                else:
                    self.host.free_queue.remove(b)
                    self.host.num_in_use += 1
            ref[b] = r + 1
        if freed:
            gpu.free_queue.remove_many(freed)
            gpu.num_in_use += len(freed)
            if gpu.num_in_use > gpu.peak_in_use:
                gpu.peak_in_use = gpu.num_in_use

    def _unclaim(self, b: BlockId) -> None:
        r = self.ref_count[b] - 1
        self.ref_count[b] = r
        if r == 0:
            pool = self._pool(b)
            pool.num_in_use -= 1
            pool.free_queue.push_back(b, self.priority[b])
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
            if self.host is None:
                self.index.remove_many(victims)
            else:
                self._offload(victims)
            self.evicted_blocks += len(victims)
            out.extend(victims)
        ref, prio = self.ref_count, self.priority
        for b in out:
            ref[b] = 1
            prio[b] = priority
        if self._fresh is not None:
            for b in out:
                self._fresh[b] = 1
        pool.num_in_use += n
        self.allocated_blocks += n
        if pool.num_in_use > pool.peak_in_use:
            pool.peak_in_use = pool.num_in_use
        return out
    def _emit(self, kind: CopyKind, src_tier: Tier, src: BlockId, dst_tier: Tier, dst: BlockId,
              num_tokens: int) -> None:
        if self.spec.emit_copy_ops:
            self.copy_ops.append(CopyOp(kind, src_tier, src, dst_tier, dst, num_tokens))

    def _store_tail(self, seq: CacheSeq) -> None:
        """Keep the computed, unfilled last block for partial reuse."""
        tpb = self.tpb
        i, n = divmod(seq.num_computed, tpb)
        if not n or self.index.kids is None or seq.num_computed > seq.request.input_length:
            return
        b = seq.blocks[i]
        if b == NO_BLOCK or self.ref_count[b] > 1 or self.index.stored[b] is not None:
            return
        request = seq.request
        parent = seq.keys[i - 1] if i else request.root_key
        self.index.insert_partial(b, parent, request, i, n)

    def _insert_around_holes(self, seq: CacheSeq, begin: int, end: int) -> None:
        """`insert_full` of the blocks of `[begin, end)`, one run between holes at a time;
        keys chain the whole prefix, so a run's parent key is valid though its block is not
        here."""
        blocks, keys = seq.blocks, seq.keys
        i = begin
        while i < end:
            if blocks[i] == NO_BLOCK:
                i += 1
                continue
            j = i + 1
            while j < end and blocks[j] != NO_BLOCK:
                j += 1
            parent = keys[i - 1] if i else seq.request.root_key
            self.index.insert_full(blocks, keys, i, j, parent, seq.request)
            i = j

    def _track(self, seq: CacheSeq) -> None:
        if self._live is not None:
            self._live.add(seq)

    def _untrack(self, seq: CacheSeq) -> None:
        if self._live is not None:
            self._live.discard(seq)

    def _check_sanity(self) -> bool:
        pools = [self.gpu] + ([self.host] if self.host is not None else [])
        for pool in pools:
            assert pool._check_sanity()
            in_use = 0
            for b in range(pool.first, pool.first + pool.capacity):
                in_queue = b in pool.free_queue
                if self.ref_count[b] > 0:
                    in_use += 1
                    assert not in_queue, "a block in use sits in the free queue"
                elif in_queue:
                    assert self.index.is_stored(b), "a cached block is not in the index"
            assert in_use == pool.num_in_use
        assert self.index._check_sanity()
        if self._live is not None:
            owners = [0] * len(self.ref_count)
            for seq in self._live:
                assert seq.holes or NO_BLOCK not in seq.blocks
                for b in seq.blocks:
                    if b != NO_BLOCK:
                        owners[b] += 1
                for beam in seq.beams:
                    assert len(beam) == max(0, len(seq.blocks) - seq.shared_blocks)
                    assert seq.holes or NO_BLOCK not in beam
                    for b in beam:
                        if b != NO_BLOCK:
                            owners[b] += 1
                if seq._partial is not None:
                    owners[seq._partial[0]] += 1
            assert owners == self.ref_count, "ref counts do not match the live sequences"
        return True