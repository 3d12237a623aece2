"""Serve-mode scheduling policy, modeled on TensorRT-LLM's py_executor (DESIGN.md section 3).

Each step, after every decoding request has its one generation token (they come first and
always fit: `max_batch_size <= max_num_tokens` is checked up front):

- **Context requests, FCFS.** Requests already prefilling (oldest first), then waiting ones
  in arrival order, each while a batch slot, `max_num_tokens` budget and free blocks remain.
  The first request that does not fit ends the pass (no request overtakes an older one).
- **Chunked prefill.** A request whose remaining context exceeds the budget gets a chunk of the
  budget rounded down to whole blocks (the chunk unit is `tokens_per_block`), or waits when
  chunking is off. A new request's remaining context starts after its *estimated* reuse: reuse
  shifts the chunk window, it does not shrink a chunk.
- **Capacity.** A context chunk is scheduled when the free pool has blocks for it (empty or
  evictable cached ones), not for the whole request (as TensorRT-LLM's MAX_UTILIZATION policy);
  when a running request later cannot get a block, the loop preempts the newest one. Blocks
  are counted per pool (`free_per_pool`, `add_need`, `grow_need`): a model with sliding-window
  layers has one pool per life cycle, and a chunk fits when every pool has what its step draws
  there (a window pool claims only the reused blocks its window reads, and scratch slots for
  new blocks already out of window), so a long full-attention reuse is not charged to a small
  window pool.
- **Reuse estimate before allocation.** A waiting request is costed with the reuse the prefix
  index shows now (`estimate_pools`), in tokens against the budget and in blocks
  against the free pool, after the claims of the requests admitted before it in the step: for
  the two-phase batched add the estimate is exact (partial copies and their sources, blocks
  several requests claim), so its steps compute what was budgeted. The sequential add onboards
  one request before matching the next, which can evict a block another was counted on; then a
  last chunk computes more than it was budgeted (the MNT overflow the loop counts).
- **Delay batching** (`defer`), as TensorRT-LLM's `_waiting_requests`: only when a step has
  both context and generation requests, context requests are deferred while fewer than
  `batch_wait_timeout_iters` consecutive steps have waited and the step's scheduled tokens
  (generation tokens plus the context tokens budgeted, net of estimated reuse, as TensorRT-LLM's
  reuse-aware count) are below `batch_wait_max_tokens_ratio * max_num_tokens`. With a timeout
  of 0 it never defers.

Preemption (a running request that cannot get its next block suspends the newest running
request) is the loop's, since it moves requests and blocks.
"""

from __future__ import annotations

from enum import IntEnum
from heapq import heappop
from typing import TYPE_CHECKING

from ..cache.add import AddPlan

if TYPE_CHECKING:
    from ..cache.manager import KVCacheManager
    from ..cache.protocol import CacheManager
    from ..cache.seq import CacheSeq
    from ..config import SchedulerConfig
    from ..traffic.request import Request, StreamView


class Phase(IntEnum):
    WAITING = 0
    PREFILL = 1
    DECODE = 2
    DONE = 3


class ServeRequest:
    """A request's state in serve mode."""

    __slots__ = (
        "request", "idx", "phase", "view", "seq", "context_len", "generated", "pre_tokens",
        "reused_tokens", "reused_tokens_host", "reused_partial_tokens", "reused_full_blocks",
        "first_token_s", "finish_s", "d_step0", "d_pos0", "d_gen0", "finish_step",
        "version", "drafts", "draft_reuse", "cross_seq",
    )

    def __init__(self, request: Request, idx: int) -> None:
        self.request = request
        self.idx = idx
        """Position in arrival order: FCFS order, and the largest is the newest."""
        self.phase = Phase.WAITING
        self.context_len = request.input_length
        """Tokens the current context phase prefills: the prompt, or after a preemption the
        prompt and the tokens generated so far (recomputed)."""
        self.view: StreamView = request.view(self.context_len)
        self.seq: CacheSeq | None = None
        self.generated = 0
        self.pre_tokens = -1
        """Tokens `seq` had blocks for before its pending chunk was allocated (-1: none
        pending); a reverted deferral shrinks back to it."""
        self.reused_tokens = -1
        """Prompt tokens reused by the add whose chunk computed first (-1: not yet)."""
        self.reused_tokens_host = self.reused_partial_tokens = 0
        """Of those: from the host tier, by a partial match."""
        self.reused_full_blocks = 0
        """Full blocks that add reused (its partial block, if any: `reused_partial_tokens > 0`)."""
        self.first_token_s = -1.0
        self.finish_s = -1.0
        # Decoding: at step d_step0 + k the request computes position d_pos0 + k and then
        # holds d_gen0 + k + 1 generated tokens; its last step is finish_step.
        self.d_step0 = self.d_pos0 = self.d_gen0 = self.finish_step = 0
        self.version = 0
        """Bumped when a pending decode event goes stale (preemption)."""
        self.drafts = 0
        """Draft tokens it verifies in the current decode step (speculative decoding)."""
        self.draft_reuse = (0, 0)
        """(full blocks, partial blocks) the draft model's cache reused, with `reused`."""
        self.cross_seq: CacheSeq | None = None
        """Its encoder input's hold on the cross-attention cache (encoder-decoder)."""


def by_idx(r: ServeRequest) -> int:
    """Sort key of requests in arrival order."""
    return r.idx


class ContextWork:
    """One context request's part of a step: planned by the scheduler, placed by the loop."""

    __slots__ = ("req", "new", "estimated", "chunk", "last", "start", "end")

    def __init__(self, req: ServeRequest, new: bool, estimated: int, chunk: int,
                 last: bool) -> None:
        self.req = req
        self.new = new
        """The request is added to the cache this step (else it continues its sequence)."""
        self.estimated = estimated
        """Where the chunk was budgeted to start: the estimated reuse of a new request, the
        computed tokens of a continuing one."""
        self.chunk = chunk
        """Tokens budgeted."""
        self.last = last
        """The chunk reaches the end of the context."""
        self.start = self.end = 0
        """Tokens [start, end) computed, once the cache has placed the request."""


class Scheduler:
    """Budget, chunking, FCFS admission and delay batching (see the module docstring)."""

    __slots__ = ("max_num_tokens", "max_batch_size", "chunked", "tpb", "wait_timeout",
                 "wait_ratio", "waiting_enabled", "wait_iters", "reserve_tokens")

    def __init__(self, cfg: SchedulerConfig, tokens_per_block: int,
                 reserve_tokens: int = 0) -> None:
        self.max_num_tokens = cfg.max_num_tokens
        self.max_batch_size = cfg.max_batch_size
        self.chunked = cfg.enable_chunked_prefill
        self.tpb = tokens_per_block
        self.wait_timeout = cfg.batch_wait_timeout_iters
        self.wait_ratio = cfg.batch_wait_max_tokens_ratio
        self.waiting_enabled = self.wait_timeout > 0 or self.wait_ratio > 0
        self.wait_iters = 0
        """Consecutive steps context requests have been deferred."""
        self.reserve_tokens = reserve_tokens
        """KV tokens a context request holds past its chunk (speculative decoding's drafts
        and extra tokens, allocated with the chunk as TensorRT-LLM adds them after the add)."""

    def plan_context(
        self, prefilling: list[ServeRequest], waiting: list[tuple[int, ServeRequest]],
        num_gen: int, num_active: int, cache: CacheManager, gen_tokens: int | None = None,
        cross: KVCacheManager | None = None,
    ) -> list[ContextWork]:
        """The step's context chunks after `num_gen` generation requests computing
        `gen_tokens` tokens (one per beam; default `num_gen`). Admitted requests are popped
        from `waiting` (a heap by arrival order); `num_active` counts requests holding a
        sequence, which may not exceed `max_batch_size`. A chunk's blocks are counted for
        every beam (`grow_blocks`); a new request's encoder input, against the `cross`
        cache's free blocks."""
        budget = self.max_num_tokens - (num_gen if gen_tokens is None else gen_tokens)
        slots = self.max_batch_size - num_gen
        free = cache.free_per_pool()
        cross_free = cross.free_per_pool() if cross is not None else []
        plan: list[ContextWork] = []
        for r in prefilling:
            if slots <= 0 or budget <= 0:
                return plan
            seq = r.seq
            start = seq.num_computed
            chunk, last = self._chunk(r.context_len - start, budget)
            if not chunk:
                return plan
            if not _take(free, cache.grow_need(r.view, seq, start + chunk + self.reserve_tokens)):
                return plan
            budget -= chunk
            slots -= 1
            plan.append(ContextWork(r, False, start, chunk, last))
        # The step's planned claims, so the estimates hold for the batched add of them all.
        claims, cross_claims = AddPlan(), AddPlan()
        while waiting and slots > 0 and budget > 0 and num_active < self.max_batch_size:
            r = waiting[0][1]
            reused, blocks, draws = cache.estimate_pools(r.view, claims)
            chunk, last = self._chunk(r.context_len - reused, budget)
            if not chunk:
                break
            need = cache.add_need(r.view, claims, draws, blocks,
                                  reused + chunk + self.reserve_tokens)
            if not _fits(need, free):
                break
            enc = r.request.encoder if cross is not None else None
            if enc is not None:
                _, enc_blocks, enc_draws = cross.estimate_pools(enc, cross_claims)
                if not _take(cross_free, cross.add_need(enc, cross_claims, enc_draws, enc_blocks,
                                                        enc.input_length)):
                    break
            heappop(waiting)
            _take(free, need)
            budget -= chunk
            slots -= 1
            num_active += 1
            plan.append(ContextWork(r, True, reused, chunk, last))
        return plan

    def defer(self, scheduled_tokens: int, num_ctx: int, num_gen: int) -> bool:
        """Whether this step's context requests wait (delay batching); counts the wait."""
        if not (self.waiting_enabled and num_ctx and num_gen):
            return False
        if (self.wait_iters < self.wait_timeout
                and scheduled_tokens < self.wait_ratio * self.max_num_tokens):
            self.wait_iters += 1
            return True
        self.wait_iters = 0
        return False

    def _chunk(self, remaining: int, budget: int) -> tuple[int, bool]:
        """(tokens, is the last chunk) for a context with `remaining` tokens to compute."""
        if remaining <= budget:
            return remaining, True
        if not self.chunked:
            return 0, False
        return budget // self.tpb * self.tpb, False


def _fits(need: list[int], free: list[int]) -> bool:
    """Whether every pool has its `need` of free blocks."""
    return all(n <= f for n, f in zip(need, free))


def _take(free: list[int], need: list[int]) -> bool:
    """Take `need` from each pool's `free` if every pool has it; False (taking nothing) if not."""
    if not _fits(need, free):
        return False
    for i, n in enumerate(need):
        free[i] -= n
    return True
