"""Sequence lifecycle over paged block pools (GPU, optional host tier) with prefix reuse.

A sequence is added (its longest cached prefix is matched and claimed, host hits onboarded),
resized as its tokens grow (blocks allocated, empty ones first, then by evicting the least
recently used free cached block), committed as tokens are computed (full blocks become
reusable) and released (full blocks stay cached, the unfilled last block is kept for partial
reuse or dropped).

With a host tier, a GPU block evicted while it holds reusable data is offloaded to the host if
the host has room or can make it by evicting its own LRU block, and if the block's priority is
at least `secondary_offload_min_priority`. A host hit is onboarded into a fresh GPU block before
use; the host slot it leaves is empty and is the next one the host hands out.

Two add paths (DESIGN.md section 3): `add_sequence` matches, claims, onboards and returns one
sequence at a time, so onboarding for one request may evict a block another request of the
same step was counted on; `add_sequences` claims every match of every request first (phase 1)
and only then onboards (phase 2), so nothing phase 2 evicts was matched by the batch.

Beam search (TensorRT-LLM's rule): a sequence of a request with `beam_width` w > 1 shares its
context's full blocks among the beams; the last context block is shared only when it is full
(`input_length % tokens_per_block == 0`, or always for cross-attention KV, `CacheSpec.cross_kv`),
otherwise every beam gets its own copy; every block past the context is per beam. `blocks` is
beam 0's page table (the one stored for reuse: beam 0 generates the request's stream); beams
1..w-1 hold their own blocks of the positions from `shared_blocks` on in `beams`, never stored.
Reuse matches only the shared blocks (an unshared last block is computed by each beam).
`resize` allocates for every beam, so peak memory, the scheduler's block estimate
(`grow_blocks`) and preemption all see them; `release_blocks` (a sliding window) releases
every beam's blocks of the positions it is given.

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

from .ids import DEFAULT_RETENTION_PRIORITY, BlockId, BlockKey, CopyKind, CopyOp, Tier
from .policies import AdmissionParams, SecondUseAdmission, make_free_queue
from .pool import BlockPool
from .protocol import PageView
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
    num_host_blocks: int = 0
    """Host (secondary tier) blocks; 0 = no host tier."""
    enable_block_reuse: bool = True
    """Store computed blocks and match prompts against them."""
    enable_partial_reuse: bool = True
    """Reuse the matching leading tokens of a block that matches only in part."""
    copy_on_partial_reuse: bool = True
    """Copy a partially matched block that is in use or has children instead of giving up."""
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


class Phase2AllocationError(RuntimeError):
    """An onboard or partial copy of an add found no free GPU block (`strict_phase2`)."""

    def __init__(self, request_id: int, what: str, step: int | None = None) -> None:
        where = f" in step {step}" if step is not None else ""
        super().__init__(f"request {request_id}{where}: no free GPU block for {what}"
                         " (cache.strict_phase2)")
        self.request_id = request_id
        self.what = what


_CLAIMED, _TAKEN, _ONBOARDED, _COPY_SOURCE = 1, 2, 3, 4
"""`AddPlan` states of a block: claimed by a planned request and kept; taken in place by one
for a partial match; a host block a planned request onboards; a free GPU block planned
requests only copy a partial match from (claimed in phase 1, free again after phase 2)."""


class AddPlan(dict):
    """The claims a step's batched add will make, block -> state, built by `estimate_add` as
    the step's new requests are estimated in order (one per step; a windowed manager keeps
    one per pool under the pool's index)."""

    __slots__ = ("transient",)

    def __init__(self) -> None:
        super().__init__()
        self.transient = 0
        """1 when the last estimated add copies a partial match out of a free GPU block: that
        block is out of the free pool while its copy is allocated, so the add needs one block
        more than it keeps until its phase 2 ends (before the step's chunks are allocated)."""

NO_BLOCK = BlockId(-1)
"""Placeholder in `CacheSeq.blocks` for a position that holds no block of this life cycle: a
sliding window no longer (or never) needs it, or it is a scratch block (`windows.py`). It keeps
the positions of the other blocks aligned with the sequence's tokens."""


def shared_blocks(tokens_per_block: int, request: Request, cross_kv: bool = False) -> int:
    """Leading block positions the beams of a sequence of `request` share: the context's full
    blocks, and its last one too only when full or for cross-attention KV (TensorRT-LLM's
    `isShareLastContextBlock`)."""
    if cross_kv:
        return -(-request.input_length // tokens_per_block)
    return request.input_length // tokens_per_block


def grow_blocks(tokens_per_block: int, request: Request, have: int, num_tokens: int,
                cross_kv: bool = False) -> int:
    """Blocks a sequence of `request` holding `have` block positions takes to hold
    `num_tokens` tokens: one per new position, and one more per extra beam for each new
    position past the shared context."""
    positions = -(-num_tokens // tokens_per_block)
    if positions <= have:
        return 0
    own = 0
    if request.beam_width > 1:
        own = (request.beam_width - 1) * max(
            0, positions - max(have, shared_blocks(tokens_per_block, request, cross_kv)))
    return positions - have + own


class CacheSeq:
    """One request's hold on the cache."""

    __slots__ = (
        "request", "keys", "blocks", "num_tokens", "num_computed", "num_stored",
        "reused_tokens", "reused_full_blocks", "reused_tokens_host", "partial_tokens",
        "partial_copied", "_partial", "holes", "beam_width", "shared_blocks", "beams",
    )

    def __init__(self, request: Request, keys: list[BlockKey],
                 beam_width: int | None = None) -> None:
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
        self.reused_tokens_host = 0
        """Reused tokens that came from the host tier (onboarded)."""
        self.partial_tokens = 0
        self.partial_copied = False
        self._partial: tuple[BlockId, int] | None = None
        """A claimed, partially matched block waiting for phase 2."""
        self.holes = False
        """Some entry of `blocks` is NO_BLOCK (only sliding-window life cycles make them)."""
        self.beam_width = request.beam_width if beam_width is None else beam_width
        self.shared_blocks = 0
        """Leading block positions all beams share (see the module docstring)."""
        self.beams: list[list[BlockId]] = [[] for _ in range(self.beam_width - 1)]
        """Beams 1..w-1: each one's own blocks of positions `shared_blocks` on."""

    @property
    def num_blocks(self) -> int:
        """Blocks the sequence holds or will hold for its positions, every beam's included."""
        return len(self.blocks) + sum(len(b) for b in self.beams)

    def beam_blocks(self, beam: int) -> list[BlockId]:
        """The page table of `beam` (0 = `blocks`)."""
        if beam == 0:
            return self.blocks
        return self.blocks[:self.shared_blocks] + self.beams[beam - 1]


class KVCacheManager:
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

    def match(self, request: Request) -> tuple[list[BlockId], tuple[BlockId, int] | None]:
        """The stored blocks (GPU or host) a new sequence of `request` would reuse now,
        without claiming: full blocks, then at most one usable partially matching block with
        its token count. Reuse stops one token short of the prompt, whose last token is
        always computed (cross-attention KV excepted: it is all reused or written)."""
        return self.match_capped(request, request.input_length)

    def estimate_reuse(self, request: Request) -> int:
        """Tokens a sequence added now would reuse (what a scheduler budgets with), assuming
        onboards and partial copies get their GPU blocks."""
        full, partial = self.match(request)
        return len(full) * self.tpb + (partial[1] if partial is not None else 0)

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

    def add_sequence(self, request: Request) -> CacheSeq:
        """Match, claim and onboard the request's reusable prefix (the sequential path)."""
        seq = self.claim_match(request, *self.match(request))
        self._onboard(seq)
        self._moved.clear()
        return seq

    def add_sequences(self, requests: list[Request]) -> list[CacheSeq]:
        """The two-phase batched add: claim the matches of all `requests` (phase 1), then
        onboard each (phase 2). Phase 2 may evict only blocks no request of the batch matched."""
        seqs = [self.claim_match(r, *self.match(r)) for r in requests]
        for seq in seqs:
            self._onboard(seq)
        self._moved.clear()
        return seqs

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

    def estimate_add(self, request: Request, plan: AddPlan | None = None
                     ) -> tuple[int, int, int]:
        """What adding `request` now would take, without claiming anything (a scheduler's
        budget before allocation): tokens reused, the sequence's leading blocks those occupy,
        and the free GPU blocks the add keeps (matched blocks leaving the free queue, onboards
        of host hits, the partial match's block or its copy). A copy out of a free GPU block
        needs that block too until phase 2 ends: `plan.transient`.

        `plan` (one `AddPlan` per step) makes the estimates of a step's new requests exact for
        the batched add of all of them, when they are estimated in the order `add_sequences`
        gets them: each match sees the claims of the requests estimated before it, as phase 1
        does; a block several of them claim is drawn once; and a block an earlier one would
        take in place for a partial match, which a later claim forces phase 2 to copy, costs
        the later one that copy. The request's claims are entered in `plan`, so estimate only
        requests the batch adds, in order (a scheduler stops at the first that does not fit)."""
        if plan is None:
            plan = AddPlan()
        full, partial = self.match_capped(request, request.input_length, 0, plan)
        reused = len(full) * self.tpb + (partial[1] if partial is not None else 0)
        return reused, len(full) + (partial is not None), self.plan_claims(full, partial, plan)

    def plan_claims(self, full: list[BlockId], partial: tuple[BlockId, int] | None,
                    plan: AddPlan) -> int:
        """The free GPU blocks a batched add of the match `(full, partial)` keeps after the
        claims already in `plan` (see `estimate_add`), which it then joins; sets
        `plan.transient`."""
        g, ref = self.gpu.capacity, self.ref_count
        plan.transient = 0
        draw = 0
        for b in full:
            if b != NO_BLOCK:
                draw += self._plan_keep(b, plan, g, ref)
        if partial is None:
            return draw
        b, n = partial
        state = plan.get(b)
        if self._complete_tail(b, n):  # shared as it is, like a full block
            return draw + self._plan_keep(b, plan, g, ref)
        draw += 1  # the block itself, or its copy
        if b >= g:
            plan[b] = state or _CLAIMED
        elif state is None and not ref[b] and not self.index.has_children(b):
            plan[b] = _TAKEN
        elif state == _TAKEN:
            # The earlier request must copy too; the block may come back after both copies,
            # which this conservatively ignores.
            draw += 1
            plan[b] = _CLAIMED
        elif (state is None and not ref[b]) or state == _COPY_SOURCE:
            plan[b] = _COPY_SOURCE
            plan.transient = 1
        elif state is None:
            plan[b] = _CLAIMED  # held by a running sequence
        return draw

    @staticmethod
    def _plan_keep(b: BlockId, plan: AddPlan, g: int, ref: list[int]) -> int:
        """Plan a claim that keeps `b` (a full match, a complete cross-attention tail): the
        free GPU blocks that costs after the plan's earlier claims."""
        state = plan.get(b)
        if b >= g:
            plan[b] = _ONBOARDED
            return state != _ONBOARDED
        plan[b] = _CLAIMED
        if state is None:
            return not ref[b]
        # Taken in place by an earlier request, which must now copy it; or a copy source that
        # now stays claimed.
        return state == _TAKEN or state == _COPY_SOURCE

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

    def match_capped(
        self, request: Request, max_tokens: int, first_block: int = 0, plan: dict | None = None,
    ) -> tuple[list[BlockId], tuple[BlockId, int] | None]:
        """`match` reusing at most `max_tokens` tokens, for a caller that combines several
        life cycles (`windows.py`): blocks before `first_block` are not looked up (NO_BLOCK
        stands in for them: a sliding window at the match end does not need them), and a
        partial match `add` could not use (shared, without copy_on_partial_reuse) is left
        out, so the match is exactly what `claim_match` reuses unless an onboard or a copy
        finds no free GPU block. Blocks in `plan` (`estimate_add`) count as claimed."""
        if not self.spec.enable_block_reuse:
            return [], None
        tpb = self.tpb
        max_tokens = min(max_tokens, request.input_length - (not self.spec.cross_kv))
        if request.beam_width > 1:
            # Only the shared context is matched; an unshared last block is every beam's own.
            max_tokens = min(max_tokens, self._shared_blocks(request) * tpb)
        keys = request.block_keys(tpb)
        found = self.index.walk(keys, max_tokens // tpb, first_block)
        full = [NO_BLOCK] * first_block + found if first_block else found
        partial = None
        if self.index.kids is not None:
            pos = len(full)
            parent = keys[pos - 1] if full else request.root_key
            claimable = self._claimable
            if plan:
                def claimable(b: BlockId) -> bool:
                    return b not in plan and self._claimable(b)
            partial = self.index.best_partial(
                parent, request, pos, min(tpb, max_tokens - pos * tpb), claimable)
            if partial is not None and not (self._complete_tail(*partial)
                                            or self._partial_usable(partial[0], plan)):
                partial = None
        return full, partial

    def claim_match(self, request: Request, full: list[BlockId],
                    partial: tuple[BlockId, int] | None) -> CacheSeq:
        """Phase 1 for a match (from `match` or `match_capped`): a new sequence of `request`
        holding `full` (leading NO_BLOCK entries are positions it does not need) and the
        claimed `partial` block, so no eviction can take them; nothing is allocated.
        `onboard` completes the add."""
        seq = CacheSeq(request, request.block_keys(self.tpb))
        for b in full:
            if b != NO_BLOCK:
                self._claim(b)
        seq.blocks = full
        seq.holes = bool(full) and full[0] == NO_BLOCK
        seq.num_stored = seq.reused_full_blocks = len(full)
        if seq.beams:
            seq.shared_blocks = self._shared_blocks(request)
        if partial is not None:
            self._claim(partial[0])
            seq._partial = partial
        self._track(seq)
        return seq

    def onboard(self, seqs: list[CacheSeq]) -> None:
        """Phase 2 for sequences from `claim_match`: onboard host hits and settle partial
        matches, as `add_sequences` does after claiming."""
        for seq in seqs:
            self._onboard(seq)
        self._moved.clear()

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
        empty = self.gpu.empty
        cached: list[int] = []
        """Positions in `blocks` of the freed stored blocks, deepest first."""
        freed = 0
        for i in range(len(blocks) - 1, -1, -1):
            b = blocks[i]
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
                cached.append(i)
            else:
                index.remove(b)
                empty.append(b)
        self.gpu.num_in_use -= freed
        if cached and self._admission is not None:
            cached = self._admit(blocks, cached)
        if not cached:
            return freed
        prio, fq = self.priority, self.gpu.free_queue
        if request.retention is None:
            level = request.priority
            run = [blocks[i] for i in cached]
            for b in run:
                prio[b] = level
            fq.push_back_many(run, level)
            if self._expiring:  # a stale heap entry may name one of them
                expires = self.expires
                for b in run:
                    expires[b] = 0.0
            return freed
        table = request.block_retentions(self.tpb)
        decode = (request.retention.decode_priority, request.retention.decode_duration_ms)
        # Runs of one level go to the queue together: a policy sees a chain, not lone blocks.
        run: list[BlockId] = []
        for i in cached:
            b, pos = blocks[i], first + i
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

    def _admit(self, blocks: list[BlockId], cached: list[int]) -> list[int]:
        """The positions among `cached` (positions in `blocks` of freed stored blocks) whose
        blocks the admission lets into the cache; computed ones it turns away leave the index
        and become empty. Reused blocks always stay (their keys are still recorded as used)."""
        admit, fresh, index = self._admission.admit, self._fresh, self.index
        stored, empty = index.stored, self.gpu.empty
        kept = []
        for i in cached:
            b = blocks[i]
            if admit(stored[b][0]) or not fresh[b]:
                kept.append(i)
            else:
                index.remove(b)
                empty.append(b)
            fresh[b] = 0
        return kept

    def _pool(self, b: BlockId) -> BlockPool:
        return self.gpu if b < self.gpu.capacity else self.host

    def _onboard(self, seq: CacheSeq) -> None:
        """Phase 2: bring host hits to the GPU and settle the partial match. A host hit that
        cannot get a GPU block ends the reuse there (the rest is recomputed)."""
        blocks, g = seq.blocks, self.gpu.capacity
        tpb = self.tpb
        matched = len(blocks)
        for i, b in enumerate(blocks):
            if b < g:
                continue
            # One block at a time: the host slot each onboard empties takes the next offload.
            moved = self._moved.get(b)
            if moved is None:
                dst = self._allocate(1, self.priority[b])
                if dst is None:
                    self._phase2_failed(seq, "an onboard")
                    self._drop_claims(seq, i)
                    break
                moved = self._move_to_gpu(b, dst[0])
            blocks[i] = moved
            seq.reused_tokens_host += tpb
        reused = len(blocks) * tpb
        if seq._partial is not None:
            b, n = seq._partial
            b = self._moved.get(b, b)
            seq._partial = None
            if len(blocks) == matched:  # the full prefix survived
                reused += self._reuse_partial(seq, b, n)
            else:
                self._unclaim(b)
        seq.reused_tokens = seq.num_computed = seq.num_tokens = reused

    def _phase2_failed(self, seq: CacheSeq, what: str) -> None:
        if self.spec.strict_phase2:
            raise Phase2AllocationError(seq.request.id, what)
        self.phase2_alloc_failures += 1

    def _drop_claims(self, seq: CacheSeq, keep: int) -> None:
        for b in seq.blocks[keep:]:
            self._unclaim(self._moved.get(b, b))
        del seq.blocks[keep:]
        seq.num_stored = seq.reused_full_blocks = keep

    def _move_to_gpu(self, b: BlockId, dst: BlockId) -> BlockId:
        """Onboard claimed host block `b` into fresh GPU block `dst`, which inherits every claim
        on `b`; the host slot becomes empty and is handed out next (TensorRT-LLM #18868)."""
        self._emit(CopyKind.ONBOARD, Tier.HOST, b, Tier.GPU, dst, self.index.num_tokens(b))
        self.index.move(b, dst)
        if self._fresh is not None:
            self._fresh[dst] = 0
        self.onboard_blocks += 1
        self._moved[b] = dst
        self.ref_count[dst] = self.ref_count[b]
        self.ref_count[b] = 0
        self.host.num_in_use -= 1
        self.host.empty.append(b)
        return dst

    def _claim(self, b: BlockId) -> None:
        r = self.ref_count[b]
        if r == 0:
            pool = self._pool(b)
            pool.free_queue.remove(b)
            pool.num_in_use += 1
            if pool is self.gpu and pool.num_in_use > pool.peak_in_use:
                pool.peak_in_use = pool.num_in_use
        self.ref_count[b] = r + 1

    def _unclaim(self, b: BlockId) -> None:
        r = self.ref_count[b] - 1
        self.ref_count[b] = r
        if r == 0:
            pool = self._pool(b)
            pool.num_in_use -= 1
            pool.free_queue.push_back(b, self.priority[b])

    def _claimable(self, b: BlockId) -> bool:
        """A partial match can take `b` itself, without a copy: free, on the GPU, childless.
        Among equally long partial matches the cache prefers such a block: a copy costs a
        block, and without `copy_on_partial_reuse` it would mean no reuse at all."""
        return self.ref_count[b] == 0 and b < self.gpu.capacity and not self.index.has_children(b)

    def _partial_usable(self, b: BlockId, plan: dict | None = None) -> bool:
        shared = (self.ref_count[b] > 0 or self.index.has_children(b) or b >= self.gpu.capacity
                  or (plan is not None and b in plan))
        return not shared or self.spec.copy_on_partial_reuse

    def _complete_tail(self, b: BlockId, n: int) -> bool:
        """Cross-attention KV whose stored unfilled last block matches in full: it is final
        (never grown), so it is shared as it is, like a full block."""
        return self.spec.cross_kv and b < self.gpu.capacity and n == self.index.num_tokens(b)

    def _reuse_partial(self, seq: CacheSeq, b: BlockId, n: int) -> int:
        """Settle a claimed partial match: share a complete cross-attention tail; take the
        block itself when nobody else can need it (only this claim, no children, on the GPU),
        else copy its first `n` tokens into a fresh block. Returns the tokens reused."""
        if self._complete_tail(b, n):
            seq.blocks.append(b)  # keeps the claim and its place in the index
        elif self.ref_count[b] == 1 and b < self.gpu.capacity and not self.index.has_children(b):
            self.index.remove(b)  # its tokens past `n` will be overwritten
            seq.blocks.append(b)
        else:
            new = self._allocate(1, seq.request.priority)
            src_tier = self._pool(b).tier
            self._unclaim(b)
            if new is None:
                self._phase2_failed(seq, "a partial copy")
                return 0
            dst = new[0]
            self.partial_copy_blocks += 1
            self._emit(CopyKind.PARTIAL, src_tier, b, Tier.GPU, dst, n)
            seq.blocks.append(dst)
            seq.partial_copied = True
            if src_tier is Tier.HOST:
                seq.reused_tokens_host += n
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

    def _offload(self, victims: list[BlockId]) -> None:
        """Move evicted GPU blocks' data to the host where allowed and possible, else drop it,
        exactly as offloading them one at a time in eviction order would: a victim below
        `secondary_offload_min_priority` is dropped; any other takes an empty host block, else
        the host's next victim (the LRU block of its lowest priority), whose data is dropped;
        with every host block claimed it is dropped. When that next victim is a block an
        earlier victim of the same call was just moved to, the earlier victim is dropped
        instead and its copy (whose destination this one overwrites) is never made: the
        counters count only data that moved and data that was dropped.

        In bulk while that cannot happen: host blocks at or below the lowest victim priority
        leave before any victim placed behind them."""
        host, index, prio = self.host, self.index, self.priority
        min_prio = self.spec.secondary_offload_min_priority
        drop = [v for v in victims if prio[v] < min_prio]
        if drop:
            victims = [v for v in victims if prio[v] >= min_prio]
        empty, fq = host.empty, host.free_queue
        n = len(victims)
        k = min(n, len(empty))
        dsts = empty[len(empty) - k:]
        dsts.reverse()
        del empty[len(empty) - k:]
        evicted = 0
        if k < n:
            old = fq.pop_front_many(n - k, min(prio[v] for v in victims))
            index.remove_many(old)
            evicted = len(old)
            dsts.extend(old)
        srcs = victims[:len(dsts)]
        # Queue the bulk-placed victims in eviction order, one run per priority level.
        run_start, m = 0, len(srcs)
        for i in range(1, m + 1):
            if i == m or prio[srcs[i]] != prio[srcs[run_start]]:
                level = prio[srcs[run_start]]
                run = dsts[run_start:i]
                for h in run:
                    prio[h] = level
                fq.push_back_many(run, level)
                run_start = i
        if m < n:
            evicted += self._offload_one_by_one(victims[m:], srcs, dsts, drop)
        if self._expiring:
            expires, expiring = self.expires, self._expiring
            for v, h in zip(srcs, dsts):
                t = expires[h] = expires[v]
                if t:
                    heappush(expiring, (t, h))
        if drop:
            index.remove_many(drop)
        if self.spec.emit_copy_ops:
            num_tokens = index.num_tokens
            for v, h in zip(srcs, dsts):
                self.copy_ops.append(CopyOp(CopyKind.OFFLOAD, Tier.GPU, v, Tier.HOST, h,
                                            num_tokens(v)))
        index.move_many(srcs, dsts)
        self.offload_blocks += len(srcs)
        self.host_evicted_blocks += evicted
        held = host.capacity - len(empty)
        if held > self.peak_host_blocks:
            self.peak_host_blocks = held

    def _offload_one_by_one(self, victims: list[BlockId], srcs: list[BlockId],
                            dsts: list[BlockId], drop: list[BlockId]) -> int:
        """`_offload` for the victims the bulk part could not place: each evicts the host's
        next victim (placed victims included). Appends the moves to `srcs`/`dsts` (a move a
        later victim undoes leaves them, its victim joins `drop`); returns the host blocks
        whose data was dropped."""
        fq, index, prio = self.host.free_queue, self.index, self.priority
        placed = {h: i for i, h in enumerate(dsts)}
        undone = False
        evicted = 0
        for v in victims:
            h = fq.front()
            if h is None:  # every host block is claimed
                drop.append(v)
                continue
            fq.remove(h)
            j = placed.get(h)
            if j is None:
                index.remove(h)
                evicted += 1
            else:
                drop.append(srcs[j])
                srcs[j] = NO_BLOCK
                undone = True
            placed[h] = len(srcs)
            srcs.append(v)
            dsts.append(h)
            p = prio[h] = prio[v]
            fq.push_back(h, p)
        if undone:
            kept = [i for i, v in enumerate(srcs) if v != NO_BLOCK]
            srcs[:] = [srcs[i] for i in kept]
            dsts[:] = [dsts[i] for i in kept]
        return evicted

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
