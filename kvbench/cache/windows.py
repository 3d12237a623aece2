"""Sliding-window attention: one block pool per attention life cycle, composed over
single-life-cycle `KVCacheManager`s (DESIGN.md section 3, "Window" and "Scratch slots").

A model whose layers attend over different spans has one *life cycle* per distinct window `W`
plus one for full attention (`LifeCycle`). Each gets its own `KVCacheManager`: its own GPU pool
(and host pool), free queue and prefix index, whose block (one *slot*) holds tokens_per_block
tokens for every layer of that life cycle. A model with full attention only never comes here:
the runner keeps the plain `KVCacheManager`, so that path stays exactly as fast as before.

Window convention (pinned): a query at position `p` attends to the `W` most recent tokens,
itself included, i.e. positions `[p - W + 1, p]` (FlashInfer `window_left = W - 1`). The first
block a query at `p` needs is `max(0, p - W + 1) // tpb` (`LifeCycle.first_needed`); a block is
out of window for a step when it lies before the first block the step's earliest query needs.

What a request does here:

- **Add.** Each life cycle finds the longest prefix it can serve: full attention, a prefix of
  stored blocks; a window, any end `e` whose last `W - 1` tokens (the blocks a query at `e`
  reads) are stored, earlier blocks being irrelevant (vLLM's sliding-window hit search,
  right to left). A token is reusable only if every life cycle has its KV, so the usable
  reuse is the minimum over life cycles (TensorRT-LLM PR #10875), iterated to a length every
  life cycle can serve (a window's valid ends are not downward closed); then every pool
  claims exactly that length. Positions a window does not need are `NO_BLOCK` placeholders.
  If an onboard or partial copy then finds no GPU block in some pool (the only way a claim
  can fall short) the request falls back to no reuse in every pool, rather than splicing
  lengths that each pool could serve.
- **Steps** (`begin_step` / `end_step`; cache mode has one per request, serve mode one per
  chunk). `begin_step` allocates the blocks of the tokens the step computes. With
  `swa_scratch_reuse`, the new blocks of a window life cycle that are already out of window
  for the query after the step (position `end`) get no slot of their own: they share
  `ceil(n / num_layers)` scratch slots, taken from the same pool (empty blocks first, like any
  allocation), one layer-slice per block; a block's slice index is the same in every layer
  because only the layer being computed uses it (TensorRT-LLM PR #13368). `end_step` commits
  the computed blocks (scratch blocks are never stored), returns the scratch slots empty,
  and releases the blocks no later query needs: `keep_cached` puts stored ones in the free
  queue, reusable until evicted (vLLM), `drop` frees them empty
  (`cache.release_out_of_window`).
- **Beams** (`beam_width` > 1): every pool lays them out as `KVCacheManager` does (shared
  full context blocks; an unfilled last context block and every generation block per beam;
  reuse only of the shared context). Out-of-window release frees each beam's own blocks too.
  Scratch serves only shared context, and only blocks out of window for the first position
  past it (`_scratch_query`): a beam's own query never reads a scratch page.
- **Reservations** (`reserve_tokens`: speculative drafts and extra KV tokens allocated with
  a step): scratch is chosen for the query `reserve_tokens` before the allocated end, which
  the step computes up to at least.
- **Memory.** `peak_gpu_blocks` is the most slots of all pools held at once, scratch included;
  `peak_gpu_bytes` weighs each pool's slots by their size (its layers). GPU memory is split
  between pools by `split_gpu_blocks`.

Reference case (tested): 32 window layers, W = 128, tpb = 32, one 1024-token prompt. Without
scratch the prefill holds all 32 blocks. With it, the query after the prompt (position 1024)
reads positions 897..1024, so blocks 28..31 stay and blocks 0..27 go to
ceil(28 / 32) = 1 scratch slot: 5 slots at peak. TensorRT-LLM keeps the same W-token window:
its `AttnLifeCycle.get_stale_range` makes blocks `[0, (history + 1 - W) // tpb)` stale, 28
blocks here, so 1 + 4 = 5 slots, which its own tests assert; the "27 + 5 = 6" of PR #13368's
text is an arithmetic slip, not a wider window.

The page tables and step views the data plane reads are in `window_pages.py`, the counters
summed over pools and the memory metrics in `window_counters.py`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .add import AddPlan
from .ids import BlockId, CopyOp
from .lifecycle import LifeCycle
from .manager import CacheSpec, KVCacheManager
from .seq import CacheSeq, grow_blocks, shared_blocks
from .window_counters import WindowCounters
from .window_pages import WindowPages

if TYPE_CHECKING:
    from ..traffic.request import Request

RELEASE_POLICIES = ("keep_cached", "drop")


class WindowedSequence:
    """One request's hold on every pool; tokens `[0, num_computed)` hold their KV (or are
    out of window), `[num_computed, num_tokens)` are being computed by the current step."""

    __slots__ = (
        "request", "seqs", "low", "scratch", "scratch_pages", "scratch_query", "num_computed",
        "num_tokens", "reused_tokens", "reused_tokens_host", "reused_full_blocks",
        "partial_tokens",
    )

    def __init__(self, request: Request, seqs: list[CacheSeq], reused: int) -> None:
        self.request = request
        self.seqs = seqs
        """Per pool, the life cycle's sequence (NO_BLOCK where it holds nothing)."""
        self.low = [0] * len(seqs)
        """Per pool, blocks before this one are released or were never claimed."""
        self.scratch: list[CacheSeq | None] = [None] * len(seqs)
        """Per pool, the current step's scratch slots (held as a block-only sequence)."""
        self.scratch_pages: list[dict[int, int] | None] = [None] * len(seqs)
        """Per pool, block index -> the page (in every layer) of each scratch block."""
        self.scratch_query = 0
        """The query position the current step's scratch blocks are out of window for: the
        step may not end before it."""
        self.num_computed = self.num_tokens = self.reused_tokens = reused
        self.reused_tokens_host = max(s.reused_tokens_host for s in seqs)
        self.reused_full_blocks = min(s.reused_full_blocks for s in seqs)
        self.partial_tokens = max(s.partial_tokens for s in seqs)

    @property
    def blocks(self) -> list[BlockId]:
        """The block positions the sequence spans (every pool spans the same ones; this is
        the first pool's list, NO_BLOCK included): what a scheduler counts with."""
        return self.seqs[0].blocks

    @property
    def num_blocks(self) -> int:
        """Block positions spanned, each extra beam's own ones included (as
        `CacheSeq.num_blocks`; every pool spans the same)."""
        return self.seqs[0].num_blocks

    @property
    def beam_width(self) -> int:
        return self.seqs[0].beam_width

    @property
    def shared_blocks(self) -> int:
        """Leading block positions the beams share (`CacheSeq.shared_blocks`)."""
        return self.seqs[0].shared_blocks


class WindowedCacheManager(WindowPages, WindowCounters):
    """Pools of several life cycles, kept in step for each request (see the module
    docstring). Counters sum over pools; `managers[i]` serves `cycles[i]`."""

    __slots__ = (
        "cycles", "managers", "tpb", "keep_cached", "scratch_reuse", "slot_bytes",
        "pool_of_layer", "num_layers", "peak_gpu_blocks", "peak_gpu_bytes",
        "scratch_slots", "scratch_slots_peak", "scratch_blocks", "reuse_fallbacks",
        "reserve_tokens",
    )

    def __init__(
        self, cycles: Sequence[LifeCycle], specs: Sequence[CacheSpec], *,
        release_out_of_window: str = "keep_cached", swa_scratch_reuse: bool = False,
        bytes_per_token_per_layer: int = 1, reserve_tokens: int = 0,
    ) -> None:
        if len(cycles) != len(specs) or not cycles:
            raise ValueError("one CacheSpec per life cycle")
        if len({s.tokens_per_block for s in specs}) != 1:
            raise ValueError("every life cycle uses the same tokens_per_block")
        if release_out_of_window not in RELEASE_POLICIES:
            raise ValueError(f"release_out_of_window must be one of {RELEASE_POLICIES}")
        self.cycles = tuple(cycles)
        self.managers = [KVCacheManager(s) for s in specs]
        self.tpb = specs[0].tokens_per_block
        self.keep_cached = release_out_of_window == "keep_cached"
        self.scratch_reuse = swa_scratch_reuse
        self.slot_bytes = [self.tpb * c.num_layers * bytes_per_token_per_layer for c in cycles]
        self.num_layers = sum(c.num_layers for c in cycles)
        self.pool_of_layer = [0] * self.num_layers
        """Model layer -> pool index (whose tensor a `page_tables` row indexes)."""
        for i, c in enumerate(cycles):
            for layer in c.layers:
                self.pool_of_layer[layer] = i
        if sorted(layer for c in cycles for layer in c.layers) != list(range(self.num_layers)):
            raise ValueError("life cycles must cover layers 0..n-1 once each")
        self.peak_gpu_blocks = 0
        """Most slots of all pools held at once (scratch slots included)."""
        self.peak_gpu_bytes = 0
        self.scratch_slots = 0
        """Scratch slots held now (all pools)."""
        self.scratch_slots_peak = 0
        self.scratch_blocks = 0
        """Blocks served by scratch slots, over the run."""
        self.reuse_fallbacks = 0
        """Adds whose reuse fell back to none because some pool could not onboard its part."""
        self.reserve_tokens = reserve_tokens
        """Tokens a `resize` may allocate past what its step computes (speculative drafts and
        extra KV tokens, reserved with the step): scratch is chosen for the query that many
        tokens before the allocated end, which the step computes up to at least."""

    # --- adding a request -----------------------------------------------------------------

    def match(self, request: Request, plan: dict | None = None
              ) -> tuple[int, list[tuple[list[BlockId], tuple[BlockId, int] | None]]]:
        """The reuse every life cycle can serve (the minimum over them, at an end each can
        serve) and, per pool, the match that claims exactly it; claims nothing. `plan[i]`
        holds pool i's planned claims (`estimate_add`)."""
        n = len(self.managers)
        cap = request.input_length - 1
        if request.beam_width > 1:  # only the shared context is matched (`match_capped`)
            cap = min(cap, shared_blocks(self.tpb, request) * self.tpb)
        if not self.managers[0].spec.enable_block_reuse or cap <= 0:
            return 0, [([], None) for _ in range(n)]  # each sequence owns its list
        # Round robin, full attention first (its prefix walk is the cheap bound), each pool
        # searching below the lowest end so far, until all of them serve the same end.
        matches: list = [None] * n
        agree = i = 0
        while agree < n:
            end, matches[i] = self._best_end(i, request, cap,
                                             plan.get(i) if plan is not None else None)
            agree = agree + 1 if end == cap else 1
            cap = end
            i = (i + 1) % n
        return cap, matches

    def estimate_reuse(self, request: Request) -> int:
        """Tokens a sequence added now would reuse, assuming its onboards and copies get
        their GPU blocks."""
        return self.match(request)[0]

    def add_sequence(self, request: Request) -> WindowedSequence:
        """Match, claim and onboard in every pool (the sequential path)."""
        return self.add_sequences([request])[0]

    def add_sequences(self, requests: list[Request]) -> list[WindowedSequence]:
        """The two-phase batched add over all pools: claim every request's common match
        (phase 1), then onboard (phase 2)."""
        claimed = []
        for r in requests:
            reuse, matches = self.match(r)
            for m, (full, _) in zip(self.managers, matches):
                m.note_match(r, full)
            seqs = [m.claim_match(r, full, partial)
                    for m, (full, partial) in zip(self.managers, matches)]
            claimed.append((r, reuse, seqs))
        for i, m in enumerate(self.managers):
            m.onboard([seqs[i] for _, _, seqs in claimed])
        self._note_peak()
        out = []
        for r, reuse, seqs in claimed:
            if any(s.reused_tokens != reuse for s in seqs):
                seqs = self._without_reuse(r, seqs)
                reuse = 0
            wseq = WindowedSequence(r, seqs, reuse)
            for i, c in enumerate(self.cycles):
                if c.window is not None:
                    wseq.low[i] = c.first_needed(reuse, self.tpb)
            out.append(wseq)
        return out

    # --- steps ----------------------------------------------------------------------------

    def step_blocks(self, wseq: WindowedSequence, end: int) -> list[int]:
        """Per pool, the free GPU blocks `begin_step(wseq, end)` would take (new blocks,
        scratch slots included)."""
        request = wseq.request
        return [self._step_need(i, request, len(s.blocks), end) for i, s in enumerate(wseq.seqs)]

    def begin_step(self, wseq: WindowedSequence, end: int) -> bool:
        """Give `wseq` what a step computing tokens `[num_computed, end)` needs in every pool:
        blocks for the new tokens, out-of-window new blocks in scratch slots. Returns False,
        taking nothing, when some pool cannot supply its part."""
        if end < wseq.num_tokens:
            raise ValueError("a step cannot end before the tokens already allocated")
        need = self.step_blocks(wseq, end)
        if any(n > m.gpu.num_free for n, m in zip(need, self.managers)):
            return False
        tpb = self.tpb
        query = self._scratch_query(wseq.request, end)
        for i, (c, m) in enumerate(zip(self.cycles, self.managers)):
            seq = wseq.seqs[i]
            held = len(seq.blocks)
            n = self._scratch_count(i, held, query)
            if n:
                slots = -(-n // c.num_layers)
                scr = m.hold_blocks(wseq.request, slots * tpb)
                m.skip_blocks(seq, n)
                nl = c.num_layers
                wseq.scratch[i] = scr
                wseq.scratch_pages[i] = {held + k: scr.blocks[k // nl] * nl + k % nl
                                         for k in range(n)}
                self.scratch_slots += slots
                self.scratch_blocks += n
                wseq.scratch_query = query
            m.resize(seq, end)
        wseq.num_tokens = end
        if self.scratch_slots > self.scratch_slots_peak:
            self.scratch_slots_peak = self.scratch_slots
        self._note_peak()
        return True

    def end_step(self, wseq: WindowedSequence, end: int | None = None) -> None:
        """The step's tokens, up to `end` (default: all it allocated), hold their KV: commit
        them (scratch blocks are not stored), return the scratch slots, and release the blocks
        no query after the step needs."""
        if end is None:
            end = wseq.num_tokens
        elif end > wseq.num_tokens:
            raise ValueError("cannot commit tokens that have no block")
        elif end < wseq.scratch_query and any(wseq.scratch):
            # Its scratch range was chosen for a query at `scratch_query`: an earlier one
            # would read blocks that were computed into scratch pages.
            raise ValueError("a step with scratch slots must end where it was allocated")
        tpb = self.tpb
        for i, (c, m) in enumerate(zip(self.cycles, self.managers)):
            seq = wseq.seqs[i]
            m.commit(seq, end)
            scr = wseq.scratch[i]
            if scr is not None:
                self.scratch_slots -= len(scr.blocks)
                m.release(scr)
                wseq.scratch[i] = wseq.scratch_pages[i] = None
            if c.window is not None:
                self._release_below(wseq, i, c.first_needed(end, tpb))
        wseq.num_computed = max(wseq.num_computed, end)

    def release(self, wseq: WindowedSequence) -> None:
        """Drop the request's hold on every pool (as `KVCacheManager.release`)."""
        for i, m in enumerate(self.managers):
            scr = wseq.scratch[i]
            if scr is not None:
                self.scratch_slots -= len(scr.blocks)
                m.release(scr)
                wseq.scratch[i] = wseq.scratch_pages[i] = None
            m.release(wseq.seqs[i])

    # --- the KVCacheManager interface a serve loop drives -----------------------------------
    #
    # A serve step maps onto the calls above as follows, so the serve loop and its scheduler
    # run unchanged on a WindowedCacheManager: `resize(seq, end)` before a chunk (or a
    # decode block) is `begin_step`, choosing the chunk's scratch range for `end`;
    # `commit(seq, n)` after it is `end_step`, returning scratch slots and releasing what the
    # next query (at `n`) does not read. Decode commits at block boundaries, so a decoding
    # request releases its out-of-window blocks up to tokens_per_block - 1 steps late.
    # Admission is per pool (`free_per_pool`, `add_need`, `grow_need`): what a step draws
    # from each pool, window-only reuse and scratch slots included, against that pool's free
    # blocks.

    def resize(self, wseq: WindowedSequence, num_tokens: int) -> bool:
        """`begin_step` to `num_tokens` (nothing to do when already allocated)."""
        if num_tokens <= wseq.num_tokens:
            return True
        return self.begin_step(wseq, num_tokens)

    def commit(self, wseq: WindowedSequence, num_computed: int) -> None:
        """`end_step` at `num_computed`."""
        self.end_step(wseq, num_computed)

    def shrink(self, wseq: WindowedSequence, num_tokens: int) -> int:
        """Undo `begin_step` down to `num_tokens` before anything past them is computed (the
        revert of a deferred context request). Returns the slots given up (all pools)."""
        if num_tokens < wseq.num_computed:
            raise ValueError("cannot shrink below the computed tokens")
        freed = 0
        for i, m in enumerate(self.managers):
            scr = wseq.scratch[i]
            if scr is not None:
                freed += len(scr.blocks)
                self.scratch_slots -= len(scr.blocks)
                m.release(scr)
                wseq.scratch[i] = wseq.scratch_pages[i] = None
            freed += m.shrink(wseq.seqs[i], num_tokens)
        wseq.num_tokens = min(wseq.num_tokens, num_tokens)
        return freed

    def estimate_add(self, request: Request, plan: AddPlan | None = None
                     ) -> tuple[int, int, int]:
        """As `KVCacheManager.estimate_add` (`plan`, one `AddPlan` per step, holds each pool's
        under its index and makes a step's estimates exact for their batched add): the common
        reuse, the positions it covers, and the most free GPU blocks any pool's add keeps;
        `plan.transient` is the most any pool's needs besides until phase 2 ends."""
        reuse, positions, draws = self.estimate_pools(request, plan)
        return reuse, positions, max(draws)

    def estimate_pools(self, request: Request, plan: AddPlan | None = None
                       ) -> tuple[int, int, list[int]]:
        """`estimate_add` with the free GPU blocks each pool's add keeps: with `step_blocks`
        for the first step, exactly what adding the request and beginning that step take
        from each pool (reuse falls back to none, taking less, only when an onboard or a
        copy finds no free block)."""
        if plan is None:
            plan = AddPlan()
        for i in range(len(self.managers)):
            if i not in plan:
                plan[i] = AddPlan()
        reuse, matches = self.match(request, plan)
        draws = [m.plan_claims(full, partial, plan[i])
                 for i, (m, (full, partial)) in enumerate(zip(self.managers, matches))]
        plan.transient = max(plan[i].transient for i in range(len(self.managers)))
        positions = len(matches[0][0]) + (matches[0][1] is not None)
        return reuse, positions, draws

    def free_per_pool(self) -> list[int]:
        """Free GPU blocks (empty or evictable) of each pool, by pool index."""
        return [m.gpu.num_free for m in self.managers]

    def add_need(self, request: Request, plan: AddPlan, draws: list[int], positions: int,
                 num_tokens: int) -> list[int]:
        """As `KVCacheManager.add_need`, per pool: pool i's draw (`estimate_pools`, its copy
        source in `plan[i]`) and the first step's blocks there, what `begin_step` to
        `num_tokens` takes (scratch slots for the blocks already out of window)."""
        return [d + max(plan[i].transient, self._step_need(i, request, positions, num_tokens))
                for i, d in enumerate(draws)]

    def grow_need(self, request: Request, wseq: WindowedSequence, num_tokens: int
                  ) -> list[int]:
        """Per pool, the free GPU blocks `resize(wseq, num_tokens)` takes (`step_blocks`)."""
        return self.step_blocks(wseq, num_tokens)

    def grow_blocks(self, request: Request, have: int, num_tokens: int) -> int:
        """As `KVCacheManager.grow_blocks` (block positions, and each extra beam's own ones
        past the shared context), counted as for full attention."""
        return grow_blocks(self.tpb, request, have, num_tokens)

    def refresh(self, now_s: float) -> None:
        """`KVCacheManager.refresh` of every pool."""
        for m in self.managers:
            m.refresh(now_s)

    # --- the engine-cache contract (`cache/protocol.py`) -----------------------------------

    def drain_copy_ops(self) -> dict[int, list[CopyOp]]:
        ops = {}
        for i, m in enumerate(self.managers):
            if m.copy_ops:
                ops[i] = list(m.copy_ops)
                m.copy_ops.clear()
        return ops

    def enable_sanity_tracking(self) -> None:
        for m in self.managers:
            m.enable_sanity_tracking()

    def _check_sanity(self) -> bool:
        assert all(m._check_sanity() for m in self.managers)
        assert self.scratch_slots >= 0
        return True

    # --- helpers --------------------------------------------------------------------------

    def _best_end(self, i: int, request: Request, cap: int, plan: dict | None = None
                  ) -> tuple[int, tuple[list[BlockId], tuple[BlockId, int] | None]]:
        """The longest reuse `<= cap` pool `i` can serve and the match that serves it."""
        m, c, tpb = self.managers[i], self.cycles[i], self.tpb
        if c.window is None:
            full, partial = m.match_capped(request, cap, 0, plan)
            return len(full) * tpb + (partial[1] if partial else 0), (full, partial)
        # Right to left (vLLM): an end is served when the blocks its first query reads are
        # all stored. A missing block k rules out every end whose window covers it, so the
        # next candidate ends at block k, and each key is looked up once. An end inside
        # block j (a partial match there) reads from a later block than the end at j's
        # start, so it may be served when that one is not: a window kept for a prompt that
        # ended mid-block (the same prompt continued, with `drop` or scratch) looks so.
        keys = request.block_keys(tpb)
        by_key = m.index.by_key
        back = c.window - 1  # a query at e reads from e - back (`first_needed`, inlined)
        j = min(cap // tpb, len(keys))
        while True:
            k = j - 1
            lowest = max(0, j * tpb - back) // tpb
            while k >= lowest and keys[k] in by_key:
                k -= 1
            room = min(cap - j * tpb, tpb - 1)  # tokens a partial match at block j may add
            n = 0
            if room > 0 and k < max(0, j * tpb + room - back) // tpb:
                _, partial = m.match_capped(request, j * tpb + room, j, plan)
                if partial is not None and k < max(0, j * tpb + partial[1] - back) // tpb:
                    n = partial[1]
            if k < lowest or n:
                break
            j = k
        end = j * tpb + n
        full, partial = m.match_capped(request, end, c.first_needed(end, tpb), plan)
        if len(full) != j:  # the blocks were just found, so only a bug can lose them
            raise AssertionError("window match lost its blocks")
        return end, (full, partial)

    def _without_reuse(self, request: Request, seqs: list[CacheSeq]) -> list[CacheSeq]:
        self.reuse_fallbacks += 1
        out = []
        for m, seq in zip(self.managers, seqs):
            m.release(seq)
            fresh = m.claim_match(request, [], None)
            m.onboard([fresh])
            out.append(fresh)
        return out

    def _scratch_query(self, request: Request, end: int) -> int:
        """The query a step allocated to `end` chooses its scratch blocks for (those out of
        its window): the first one after the step, `reserve_tokens` before `end` when a
        reservation was allocated with it; with beams, at most the first position past the
        shared context, so that no beam's own query reads a scratch page (scratch blocks
        are shared context, written by beam 0's computation; a beam's own work may run in
        another batch, after other layers reused the slices)."""
        query = end - self.reserve_tokens
        if request.beam_width > 1:
            query = min(query, shared_blocks(self.tpb, request) * self.tpb)
        return query

    def _scratch_count(self, i: int, held: int, query: int) -> int:
        """New blocks of pool `i` (from index `held`) that no query from `query` on reads:
        those scratch slots serve, when scratch reuse is on."""
        c = self.cycles[i]
        if not self.scratch_reuse or c.window is None:
            return 0
        return max(0, c.first_needed(query, self.tpb) - held)

    def _step_need(self, i: int, request: Request, held: int, end: int) -> int:
        """Free blocks of pool `i` a step to `end` takes from a sequence of `request` spanning
        `held` block positions: a block per new position (and beam), out-of-window ones
        sharing scratch slots."""
        scratch = self._scratch_count(i, held, self._scratch_query(request, end))
        return (grow_blocks(self.tpb, request, held, end) - scratch
                + -(-scratch // self.cycles[i].num_layers))

    def _release_below(self, wseq: WindowedSequence, i: int, first: int) -> None:
        low = wseq.low[i]
        if first > low:
            self.managers[i].release_blocks(wseq.seqs[i], low, first, self.keep_cached)
            wseq.low[i] = first
