"""Cache mode: the requests replayed in arrival order, without a clock or a scheduler."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from ..config import PolicyConfig, Workload
from ..engine.cache_mode import replay_cache_mode
from ..oracle import reference_hit_rates, streamed_reference_hit_rates
from ..plan import RunPlan, block_bytes, cross_manager, draft_block_bytes, size_pools
from ..results import RunOutcome
from ..traffic import Request
from ..traffic.spill import SpilledTrace
from .common import (ProgressFactory, cache_metrics, draft_plane_metrics, ideal_hit_rate,
                     open_data_plane, outcome, phase)

T = TypeVar("T")


def run_cache(name: str, plan: RunPlan, requests: list[Request] | SpilledTrace,
              progress: ProgressFactory | None, references: dict | None = None) -> RunOutcome:
    """Replay the requests in arrival order through the planned cache, no clock; report reuse
    against the references (ideal, optimal, LRU). `references` (a dict the caller keeps for
    the variants of one workload, over the same request objects) holds the references already
    computed: variants that differ only in what the references do not see (the eviction
    policy, the admission) compute them once."""
    wl = plan.workload
    streamed = isinstance(requests, SpilledTrace)
    cross = None if streamed else cross_manager(wl, requests)
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
    lru = hit if _is_lru(wl) else _lru_reference(wl, requests, references)
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


def _is_lru(wl: Workload) -> bool:
    return wl.cache.eviction_policy == "lru" and wl.cache.admission == "all"


def _offline_references(plan: RunPlan, requests: list[Request] | SpilledTrace,
                        references: dict | None) -> tuple[float, float | None]:
    """The ideal and optimal hit rates. With a host tier the optimum may keep blocks in
    either tier: one pool of both sizes. With windows it is null (the offline optimum is for
    one pool) and the ideal is an unlimited cache under the same window rules."""
    if plan.cycles is not None:
        return ideal_hit_rate(requests, plan, serve=False), None
    spec = plan.spec
    args = (spec.tokens_per_block, spec.num_gpu_blocks + spec.num_host_blocks,
            spec.enable_partial_reuse, spec.enable_block_reuse)
    oracle = (streamed_reference_hit_rates if isinstance(requests, SpilledTrace)
              else reference_hit_rates)
    refs = _once(references, ("optimal", id(requests), *args), lambda: oracle(
        requests, args[0], args[1], partial_reuse=args[2], block_reuse=args[3]))
    return refs.ideal_hit_rate, refs.optimal_hit_rate


def _lru_reference(wl: Workload, requests: list[Request] | SpilledTrace,
                   references: dict | None) -> float:
    """The hit rate of the same cache-mode run with LRU eviction and admission of all
    (TensorRT-LLM's behaviour), the reference `gap_closed` is measured from; the policies'
    parameters at their defaults, as LRU reads none of them."""
    lru = wl.model_copy(update={"cache": wl.cache.model_copy(
        update={"eviction_policy": "lru", "admission": "all", "policy": PolicyConfig()})})
    return _once(references, ("lru", id(requests), lru.model_dump_json()),
                 lambda: _lru_hit(lru, requests))


def _once(references: dict | None, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()`, or its result kept under `key` in `references` (None: keep nothing)."""
    if references is None:
        return compute()
    if key not in references:
        references[key] = compute()
    return references[key]


def _lru_hit(lru: Workload, requests: list[Request] | SpilledTrace) -> float:
    """The hit rate of the cache-mode run of workload `lru`."""
    manager = size_pools(lru, requests).manager()
    cross = None if isinstance(requests, SpilledTrace) else cross_manager(lru, requests)
    result = replay_cache_mode(requests, manager, cross=cross)
    return result.reused_tokens / result.prompt_tokens


def gap_closed(hit: float, lru: float | None, optimal: float | None) -> float | None:
    """Share of the LRU-to-optimal gap a policy closes: (hit - lru) / (optimal - lru);
    None without both references or without a gap."""
    if lru is None or optimal is None or optimal - lru <= 1e-12:
        return None
    return (hit - lru) / (optimal - lru)
