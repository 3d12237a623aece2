"""What a serve run reports: its result, the per-step records an observer gets, the timeline
columns and the loop's counters (one name each across `ServeLoop`, `ServeResult` and the
result metrics)."""

from __future__ import annotations

from dataclasses import dataclass

from .cross import CrossTally
from .scheduler import ServeRequest
from .timeline import Timeline


TIMELINE_COLUMNS = ("step", "steps", "time_us", "batch", "scheduled_tokens", "computed_tokens",
                    "in_use", "cached", "free", "reused_tokens", "prompt_tokens")
"""Timeline columns: first step, steps the row stands for, start time, then per step: requests
scheduled, tokens budgeted and computed, GPU blocks in use, cached and empty after the step;
then the reused and prompt tokens of the requests whose first chunk the row computed (for a
rolling hit rate; summed when the timeline is thinned)."""


@dataclass(frozen=True, slots=True)
class ContextChunk:
    """Context tokens one request computed in a step."""

    request_id: int
    start: int
    """First token computed (after the reused or already computed ones)."""
    end: int
    """One past the last token computed."""
    scheduled: int
    """Tokens the scheduler budgeted (less than end - start when reuse fell short)."""


@dataclass(frozen=True, slots=True)
class StepRecord:
    """What one step (or a run of `repeat` identical pure-decode steps) did."""

    index: int
    repeat: int
    start_s: float
    duration_s: float
    """Of all `repeat` steps."""
    context: tuple[ContextChunk, ...]
    generation: tuple[tuple[int, int], ...]
    """(request id, position of the token it computes in the first step); one token per
    request per step, at the next position each step."""
    deferred: tuple[int, ...]
    """Context requests delay batching held back."""
    preempted: tuple[int, ...]
    finished: tuple[int, ...]
    scheduled_tokens: int
    """Per step."""
    computed_tokens: int
    """Per step."""


@dataclass(slots=True)
class ServeResult:
    """What a serve run did; per-request times and reuse are on `requests`."""

    requests: list[ServeRequest]
    """In arrival order, every one finished."""
    iterations: int
    """Steps, jumped ones included."""
    duration_s: float
    """Time on the run's clock from the first arrival to the last finish."""
    computed_tokens: int
    """Tokens whose KV was computed (context chunks, recomputation and decode)."""
    preemptions: int
    mnt_overflow_steps: int
    """Steps whose actually computed tokens exceeded max_num_tokens."""
    max_mnt_overshoot_tokens: int
    reuse_shortfall_tokens: int
    """Estimated minus actual reuse, summed over the adds that computed in their step."""
    deferred_ctx_blocks_held_peak: int
    """Most blocks deferred context requests held at once for the chunks delay batching
    postponed (not the blocks they reuse; 0 with revert_deferred_ctx)."""
    deferred_ctx_blocks_reverted: int
    """Blocks deferred context requests gave back, per deferral: the step's new blocks, at
    once with revert_deferred_ctx, else when a decoder needs them before anyone is preempted."""
    batch_wait_iterations: int
    """Steps in which delay batching deferred context requests."""
    ctx_alloc_failures: int
    """New context requests that could not get their chunk's blocks after the add (their reuse
    fell short of the estimate) and waited for a later step."""
    timeline: Timeline
    cross: CrossTally
    """Encoder inputs and their cross-attention cache reuse (empty without a cross cache)."""


SERVE_COUNTERS = ("computed_tokens", "preemptions", "mnt_overflow_steps",
                  "max_mnt_overshoot_tokens", "reuse_shortfall_tokens",
                  "deferred_ctx_blocks_held_peak", "deferred_ctx_blocks_reverted",
                  "batch_wait_iterations", "ctx_alloc_failures")
"""The loop's counters: `ServeLoop` attributes, `ServeResult` fields and result metrics of
the same name."""
