"""Cache mode: the requests replayed in arrival order, without a clock or a scheduler."""

from __future__ import annotations

import time

from ..config import Workload
from ..engine.cache_mode import replay_cache_mode
from ..oracle import reference_hit_rates, streamed_reference_hit_rates
from ..plan import RunPlan, block_bytes, cross_manager, draft_block_bytes, size_pools
from ..results import RunOutcome
from ..traffic import Request
from ..traffic.spill import SpilledTrace
from .common import (ProgressFactory, StreamReferences, cache_metrics, draft_plane_metrics,
                     ideal_reference, is_lru, lru_workload, once, open_data_plane, outcome,
                     phase)

LRU_UNREAD = frozenset({"name", "hardware", "scheduler", "variants", "tune"})
"""Workload sections a cache-mode replay never reads (the hardware and the scheduler are the
serve clock's; the name, variants and tune section are the file's), left out of the LRU
reference's key so that runs differing only there share it."""


def run_cache(name: str, plan: RunPlan, requests: list[Request] | SpilledTrace,
              progress: ProgressFactory | None,
              references: StreamReferences | None = None) -> RunOutcome:
    """Replay the requests in arrival order through the planned cache, no clock; report reuse
    against the references (ideal, optimal, LRU). `references` (which the caller keeps for
    the variants of one workload, or for the trials of a tune study) holds the references
    already computed on this request stream: runs that differ only in what a reference does
    not read (the eviction policy, its parameters, the admission, the hardware) compute it
    once."""
    wl = plan.workload
    cross = cross_manager(wl, requests)
    plane = open_data_plane(plan, cross=cross)
    draft = wl.speculative.draft_model is not None
    draft_plane = open_data_plane(plan, draft=True) if draft else None
    manager = plan.manager()
    t0 = time.perf_counter()
    advance = progress(name, len(requests)) if progress is not None else None
    result = replay_cache_mode(requests, manager, advance, data_plane=plane, cross=cross,
                               draft_plane=draft_plane)
    done = phase(progress, f"{name}: reference hit rates (optimal, ideal)")
    ideal, optimal = _offline_references(plan, requests, references)
    done(1)
    hit = result.reused_tokens / result.prompt_tokens
    lru = hit if is_lru(wl) else _lru_reference(wl, requests, references)
    wall = time.perf_counter() - t0
    metrics = {
        **cache_metrics(wl, manager, requests, result.reused_tokens, result.reused_tokens_host,
                        result.reused_partial_tokens),
        "reused_full_blocks": result.reused_full_blocks,
        "reused_partial_blocks": result.reused_partial_blocks,
        "ideal_hit_rate": ideal,
        "optimal_hit_rate": optimal,
        "lru_hit_rate": lru,
        "gap_closed": gap_closed(hit, lru, optimal),
        "wall_s": wall,
        "verified": None,
        "max_abs_err": None,
    }
    if cross is not None:
        metrics.update(result.cross.metrics(cross, block_bytes(wl)))
    if draft:
        metrics.update(manager.draft_memory(block_bytes(wl), draft_block_bytes(wl)),
                       draft_reused_full_blocks=result.draft_reused_full_blocks,
                       draft_reused_partial_blocks=result.draft_reused_partial_blocks)
    if plane is not None:
        metrics.update(plane.metrics())
        if draft_plane is not None:
            draft_plane_metrics(metrics, draft_plane)
    return outcome(name, wl, metrics, result.timeline.to_json())


def _offline_references(plan: RunPlan, requests: list[Request] | SpilledTrace,
                        references: StreamReferences | None) -> tuple[float, float | None]:
    """The ideal and optimal hit rates, kept under what the oracle reads: the block size,
    the capacity and the reuse rules. With a host tier the optimum may keep blocks in either
    tier: one pool of both sizes. With windows it is null (the offline optimum is for one
    pool) and the ideal is an unlimited cache under the same window rules."""
    if plan.cycles is not None:
        return ideal_reference(requests, plan, serve=False, references=references), None
    spec = plan.spec
    args = (spec.tokens_per_block, spec.num_gpu_blocks + spec.num_host_blocks,
            spec.enable_partial_reuse, spec.enable_block_reuse)
    oracle = (streamed_reference_hit_rates if isinstance(requests, SpilledTrace)
              else reference_hit_rates)
    refs = once(references, ("optimal", *args), lambda: oracle(
        requests, args[0], args[1], partial_reuse=args[2], block_reuse=args[3]))
    return refs.ideal_hit_rate, refs.optimal_hit_rate


def _lru_reference(wl: Workload, requests: list[Request] | SpilledTrace,
                   references: StreamReferences | None) -> float:
    """The hit rate of the same cache-mode run with LRU (`lru_workload`), the reference
    `gap_closed` is measured from. Kept under the rest of the workload but `LRU_UNREAD`."""
    lru = lru_workload(wl)
    return once(references, ("lru", lru.model_dump_json(exclude=LRU_UNREAD)),
                lambda: _lru_hit(lru, requests))


def _lru_hit(lru: Workload, requests: list[Request] | SpilledTrace) -> float:
    """The hit rate of the cache-mode run of workload `lru`."""
    manager = size_pools(lru, requests).manager()
    cross = cross_manager(lru, requests)
    result = replay_cache_mode(requests, manager, cross=cross)
    return result.reused_tokens / result.prompt_tokens


def gap_closed(hit: float, lru: float | None, optimal: float | None) -> float | None:
    """Share of the LRU-to-optimal gap a policy closes: (hit - lru) / (optimal - lru);
    None without both references or without a gap."""
    if lru is None or optimal is None or optimal - lru <= 1e-12:
        return None
    return (hit - lru) / (optimal - lru)
