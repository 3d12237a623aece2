"""Serve mode: the requests through the scheduler and the serve loop on a clock."""

from __future__ import annotations

import time

from ..cache.protocol import CacheManager
from ..config import Workload
from ..engine.clock import StepClock, hardware_from_config
from ..engine.scheduler import Scheduler
from ..engine.serve import run_serve as serve_loop
from ..engine.serve_result import SERVE_COUNTERS, FinishedRequests
from ..engine.speculative import Speculation
from ..metrics import percentile_summary
from ..plan import (RunPlan, block_bytes, cross_manager, draft_block_bytes, serve_clock,
                    size_pools)
from ..results import RunOutcome
from ..traffic import Request
from ..traffic.spill import SpilledTrace
from .common import (ProgressFactory, StreamReferences, cache_metrics, draft_plane_metrics,
                     ideal_reference, is_lru, lru_workload, once, open_data_plane,
                     open_measured_plane, outcome, phase, prompt_tokens)


SERVE_LRU_UNREAD = {"name": True, "variants": True, "tune": True,
                    "run": {"progress", "backend", "verify"}}
"""What a modeled serve run's hit rates do not read (the file's name, variants and tune
section; the data plane, whose times a modeled clock does not use), left out of the LRU
reference's key so that runs differing only there share it."""


def run_serve(name: str, plan: RunPlan, requests: list[Request] | SpilledTrace,
              progress: ProgressFactory | None,
              references: StreamReferences | None = None) -> RunOutcome:
    """The serve loop over the planned cache: scheduler, clock, optional data plane,
    speculation and cross-attention cache. A spilled trace is read as the loop reaches its
    arrivals. `references` holds the reference hit rates already computed on this request
    stream (`modes.cache.run_cache`): the ideal, and with another policy than LRU the same
    served stream with LRU."""
    wl = plan.workload
    cross = cross_manager(wl, requests)
    clock = serve_clock(wl)
    if wl.run.clock == "measured":
        plane = open_measured_plane(plan)
    else:
        plane = open_data_plane(plan, cross=cross)
    draft = wl.speculative.enabled and wl.speculative.draft_model is not None
    draft_plane = open_data_plane(plan, draft=True) if draft else None
    manager = plan.manager()
    t0 = time.perf_counter()
    advance = progress(name, len(requests)) if progress is not None else None
    result, speculation = _serve(plan, manager, requests, clock, cross=cross, plane=plane,
                                 draft_plane=draft_plane, advance=advance)
    lru = not is_lru(wl) and wl.run.clock != "measured"
    done = phase(progress, f"{name}: reference hit rates (ideal{', LRU' if lru else ''})")
    ideal = ideal_reference(requests, plan, serve=True, references=references)
    # A measured clock's LRU run would be another measurement: null there.
    lru_hit = _lru_reference(wl, requests, references) if lru else None
    done(1)
    wall = time.perf_counter() - t0
    metrics = _serve_metrics(wl, manager, requests, result, ideal, wall, clock.time_source)
    metrics["lru_hit_rate"] = metrics["hit_rate"] if is_lru(wl) else lru_hit
    if speculation is not None:
        metrics.update(speculation.metrics())
    if cross is not None:
        metrics.update(result.cross.metrics(cross, block_bytes(wl)))
    if wl.speculative.draft_model is not None:
        metrics.update(_draft_metrics(wl, manager, result.finished))
    if plane is not None:
        _plane_metrics(metrics, plane, draft_plane, clock.time_source)
    return outcome(name, wl, metrics, result.timeline.to_json())


def _serve(plan: RunPlan, manager: CacheManager, requests: list[Request] | SpilledTrace,
           clock, *, cross=None, plane=None, draft_plane=None, advance=None
           ) -> tuple[object, Speculation | None]:
    """The serve loop of the plan's workload over `manager`: its result and the speculation
    (None without drafts)."""
    wl = plan.workload
    sp, sched = wl.speculative, wl.scheduler
    speculation = None
    if sp.enabled:
        draft_clock = (None if sp.draft_model is None
                       else StepClock(sp.draft_model, hardware_from_config(wl.hardware)))
        speculation = Speculation(sp.max_draft_len, sp.acceptance_rate, sp.reserved_tokens,
                                  wl.run.seed, draft_clock)
    result = serve_loop(
        requests, manager, Scheduler(sched, plan.spec.tokens_per_block,
                                     reserve_tokens=sp.max_draft_len + sp.reserved_tokens),
        clock,
        revert_deferred_ctx=sched.revert_deferred_ctx, batch_add=wl.cache.add_sequence == "batch",
        block_bytes=block_bytes(wl),
        data_plane=plane, speculation=speculation, draft_plane=draft_plane, cross=cross,
        on_progress=advance, keep_states=False)
    return result, speculation


def _lru_reference(wl: Workload, requests: list[Request] | SpilledTrace,
                   references: StreamReferences | None) -> float:
    """The hit rate of the same served stream with LRU (`lru_workload`), no data plane: a
    modeled clock times the steps without it. Kept under the rest of the workload but
    `SERVE_LRU_UNREAD`."""
    lru = lru_workload(wl)
    return once(references, ("serve-lru", lru.model_dump_json(exclude=SERVE_LRU_UNREAD)),
                lambda: _lru_hit(lru, requests))


def _lru_hit(lru: Workload, requests: list[Request] | SpilledTrace) -> float:
    """The hit rate of the modeled serve run of workload `lru`."""
    plan = size_pools(lru, requests)
    cross = cross_manager(lru, requests)
    result, _ = _serve(plan, plan.manager(), requests, serve_clock(lru), cross=cross)
    return result.finished.reused_tokens / prompt_tokens(requests)


def _serve_metrics(wl: Workload, manager: CacheManager, requests: list[Request] | SpilledTrace,
                   result, ideal: float, wall: float, time_source: str) -> dict:
    """The metrics every serve run reports: reuse, memory and traffic, the clock's times and
    the loop's counters."""
    done = result.finished
    ttft, tpot, e2e = done.latencies_ms()
    output = done.output_tokens
    metrics = {
        **cache_metrics(wl, manager, requests, done.reused_tokens, done.reused_tokens_host,
                        done.reused_partial_tokens),
        "reused_full_blocks": done.reused_full_blocks,
        "reused_partial_blocks": done.reused_partial_blocks,
        "ideal_hit_rate": ideal,
        "optimal_hit_rate": None,
        "lru_hit_rate": None,
        "gap_closed": None,
        "iterations": result.iterations,
        "output_tokens": output,
        "duration_s": result.duration_s,
        "throughput_tokens_per_s": output / result.duration_s if result.duration_s > 0 else 0.0,
        "ttft_ms": percentile_summary(ttft),
        "tpot_ms": percentile_summary(tpot),
        "e2e_ms": percentile_summary(e2e),
        "time_source": time_source,
        **{counter: getattr(result, counter) for counter in SERVE_COUNTERS},
        "wall_s": wall,
        "verified": None,
        "max_abs_err": None,
    }
    return metrics


def _plane_metrics(metrics: dict, plane, draft_plane, time_source: str) -> None:
    """A serve run's data-plane metrics (and its draft model's), into `metrics`."""
    # TTFT, TPOT and throughput carry the clock's label: with a modeled clock the kernel
    # times a CUDA plane measured are reported beside them, not fed to the clock.
    metrics.update(plane.metrics(), time_source=time_source)
    if draft_plane is not None:
        draft_plane_metrics(metrics, draft_plane)


def _draft_metrics(wl: Workload, manager, done: FinishedRequests) -> dict:
    """The draft model's cache (`cache/mirror.py`): its size, peak and reuse, and the peak
    bytes of both caches together."""
    return {
        **manager.draft_memory(block_bytes(wl), draft_block_bytes(wl)),
        "draft_reused_full_blocks": done.draft_reused_full_blocks,
        "draft_reused_partial_blocks": done.draft_reused_partial_blocks,
    }
