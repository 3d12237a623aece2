"""Adding sequences to `KVCacheManager`: the match against the prefix index, phase 1 (claim
the match), phase 2 (onboard host hits, settle the partial match) and the estimate of a step's
batched add (`AddPlan`) that a scheduler budgets with.

Two add paths (DESIGN.md section 3): `add_sequence` matches, claims, onboards and returns one
sequence at a time, so onboarding for one request may evict a block another request of the
same step was counted on; `add_sequences` claims every match of every request first (phase 1)
and only then onboards (phase 2), so nothing phase 2 evicts was matched by the batch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .ids import BlockId, CopyKind, Tier
from .seq import NO_BLOCK, CacheSeq

if TYPE_CHECKING:
    from ..traffic.request import Request


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


class AddPath:
    """The add calls, mixed into `KVCacheManager`: they work on its pools, prefix index, ref
    counts and counters, and allocate with its `_allocate`."""

    __slots__ = ()

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
    def add_sequence(self, request: Request) -> CacheSeq:
        """Match, claim and onboard the request's reusable prefix (the sequential path)."""
        full, partial = self.match(request)
        self.note_match(request, full)
        seq = self.claim_match(request, full, partial)
        self._onboard(seq)
        self._moved.clear()
        return seq

    def add_sequences(self, requests: list[Request]) -> list[CacheSeq]:
        """The two-phase batched add: claim the matches of all `requests` (phase 1), then
        onboard each (phase 2). Phase 2 may evict only blocks no request of the batch matched."""
        seqs = []
        for r in requests:
            full, partial = self.match(r)
            self.note_match(r, full)
            seqs.append(self.claim_match(r, full, partial))
        for seq in seqs:
            self._onboard(seq)
        self._moved.clear()
        return seqs

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
            # Taken in place. A later request of the batch matching it partially costs one
            # block too (the state stays): phase 2 settles in order, and while a later claim
            # remains an earlier request copies and lets go, so the last to settle takes it.
            plan[b] = _TAKEN
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
        max_tokens = min(max_tokens, self._reusable_tokens(request))
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

    def note_match(self, request: Request, full: list[BlockId]) -> None:
        """Tell the GPU pool's eviction policy about a request being added: the keys of the
        prompt blocks a match can reuse and the `full` blocks its match found (a policy that
        judges its order by the reuse it would give judges there: `ShadowDuel`)."""
        n = max(self._reusable_tokens(request), 0) // self.tpb
        self.gpu.free_queue.note_prompt(request.block_keys_array(self.tpb)[:n], full)

    def claim_match(self, request: Request, full: list[BlockId],
                    partial: tuple[BlockId, int] | None) -> CacheSeq:
        """Phase 1 for a match (from `match` or `match_capped`): a new sequence of `request`
        holding `full` (leading NO_BLOCK entries are positions it does not need) and the
        claimed `partial` block, so no eviction can take them; nothing is allocated.
        `onboard` completes the add."""
        seq = CacheSeq(request, request.block_keys(self.tpb))
        self._claim_many(full)
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
    def _claimable(self, b: BlockId) -> bool:
        """A partial match can take `b` itself, without a copy: free, on the GPU, childless.
        Among equally long partial matches the cache prefers such a block: a copy costs a
        block, and without `copy_on_partial_reuse` it would mean no reuse at all."""
        return self.ref_count[b] == 0 and b < self.gpu.capacity and not self.index.has_children(b)

    def _reusable_tokens(self, request: Request) -> int:
        """The most tokens a match of `request` reuses: all but the prompt's last, which is
        always computed (cross-attention KV excepted: it is all reused or written), and with
        beams only the context they share (an unshared last block is every beam's own)."""
        most = request.input_length - (not self.spec.cross_kv)
        if request.beam_width > 1:
            most = min(most, self._shared_blocks(request) * self.tpb)
        return most

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
        elif (self.spec.take_partial_in_place and self.ref_count[b] == 1
              and b < self.gpu.capacity and not self.index.has_children(b)):
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
