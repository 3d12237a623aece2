"""What a serve run reports: its result, the per-step records an observer gets, the timeline
columns and the loop's counters (one name each across `ServeLoop`, `ServeResult` and the
result metrics)."""

from __future__ import annotations

from array import array
from dataclasses import dataclass

import numpy as np

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


class FinishedRequests:
    """What the metrics need of each finished request, in flat arrays (40 bytes a request:
    arrival index, arrival, first-token and finish times, output length) and running totals,
    so a run keeps no request state once a request is done."""

    __slots__ = ("_idx", "_arrival", "_first", "_finish", "_output", "count", "prompt_tokens",
                 "output_tokens", "reused_tokens", "reused_tokens_host", "reused_partial_tokens",
                 "reused_full_blocks", "reused_partial_blocks", "draft_reused_full_blocks",
                 "draft_reused_partial_blocks")

    def __init__(self) -> None:
        self._idx, self._output = array("q"), array("q")
        self._arrival, self._first, self._finish = array("d"), array("d"), array("d")
        self.count = self.prompt_tokens = self.output_tokens = 0
        self.reused_tokens = self.reused_tokens_host = self.reused_partial_tokens = 0
        self.reused_full_blocks = self.reused_partial_blocks = 0
        self.draft_reused_full_blocks = self.draft_reused_partial_blocks = 0

    def add(self, s: ServeRequest) -> None:
        r = s.request
        self._idx.append(s.idx)
        self._arrival.append(r.arrival_s)
        self._first.append(s.first_token_s)
        self._finish.append(s.finish_s)
        self._output.append(r.output_length)
        self.count += 1
        self.prompt_tokens += r.input_length
        self.output_tokens += r.output_length
        self.reused_tokens += s.reused_tokens
        self.reused_tokens_host += s.reused_tokens_host
        self.reused_partial_tokens += s.reused_partial_tokens
        self.reused_full_blocks += s.reused_full_blocks
        self.reused_partial_blocks += s.reused_partial_tokens > 0
        self.draft_reused_full_blocks += s.draft_reuse[0]
        self.draft_reused_partial_blocks += s.draft_reuse[1]

    def latencies_ms(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """TTFT (requests with output), TPOT (with more than one output token) and end-to-end
        latency, in arrival order (so their means sum in the same order on every run)."""
        order = np.argsort(np.frombuffer(self._idx, dtype=np.int64), kind="stable")
        arrival, first, finish = (np.frombuffer(a, dtype=np.float64)[order]
                                  for a in (self._arrival, self._first, self._finish))
        output = np.frombuffer(self._output, dtype=np.int64)[order]
        ttft = ((first - arrival) * 1e3)[output > 0]
        many = output > 1
        tpot = (finish[many] - first[many]) * 1e3 / (output[many] - 1)
        return ttft, tpot, (finish - arrival) * 1e3


@dataclass(slots=True)
class ServeResult:
    """What a serve run did; per-request numbers on `finished` (and their states on
    `requests` when the loop kept them)."""

    finished: FinishedRequests
    requests: list[ServeRequest]
    """In arrival order, every one finished; empty unless the loop kept states."""
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
