"""One workload file -> its variants -> engine runs -> metrics. The CLI and the tuner call this."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

from .cache.manager import CacheSpec, KVCacheManager
from .config import Workload, resolve_path
from .engine.cache_mode import replay_cache_mode
from .errors import InputError
from .oracle import reference_hit_rates
from .traffic import Request, load_requests

ProgressFactory = Callable[[str, int], Callable[[int], None]]
"""(description, total) -> advance(n): how a run reports progress (a rich bar in the CLI)."""


@dataclass(slots=True)
class RunOutcome:
    variant: str
    workload: Workload
    metrics: dict
    timeline: dict = field(default_factory=dict)


def block_bytes(workload: Workload) -> int:
    """Bytes of one block: tokens_per_block tokens of K and V for every layer."""
    m = workload.model
    return workload.cache.tokens_per_block * m.num_layers * m.kv_bytes_per_token_per_layer


def cache_spec(workload: Workload, *, emit_copy_ops: bool = False) -> CacheSpec:
    c = workload.cache
    return CacheSpec(
        tokens_per_block=c.tokens_per_block,
        num_gpu_blocks=c.max_tokens // c.tokens_per_block,
        enable_block_reuse=c.enable_block_reuse,
        enable_partial_reuse=c.enable_partial_reuse,
        copy_on_partial_reuse=c.copy_on_partial_reuse,
        emit_copy_ops=emit_copy_ops,
    )


def run_workload(workload: Workload, progress: ProgressFactory | None = None) -> list[RunOutcome]:
    """Run every variant of `workload` on the same request stream (reloaded only when a
    variant changes the requests or the seed)."""
    outcomes = []
    loaded: dict[str, list[Request]] = {}
    for name, wl in workload.variant_workloads():
        _check_supported(wl)
        source_key = wl.requests.model_dump_json() + f"/seed={wl.run.seed}"
        requests = loaded.get(source_key)
        if requests is None:
            requests = loaded[source_key] = _load(wl)
        outcomes.append(_run_one(name, wl, requests, progress))
    return outcomes


def _load(wl: Workload) -> list[Request]:
    base = wl.source_path.parent if wl.source_path is not None else resolve_path(wl, ".")
    requests = load_requests(wl.requests, base_dir=base, seed=wl.run.seed)
    if not requests:
        raise InputError(f"{_where(wl)}: requests: the request stream is empty")
    return requests


def _where(wl: Workload) -> str:
    return str(wl.source_path) if wl.source_path is not None else wl.name


def _check_supported(wl: Workload) -> None:
    unsupported = []
    if wl.run.mode != "cache":
        unsupported.append(f"run.mode: {wl.run.mode}")
    if wl.cache.host_offload_ratio > 0:
        unsupported.append("cache.host_offload_ratio > 0")
    if any(w is not None for w in wl.model.layer_windows):
        unsupported.append("model.attention_window")
    if wl.run.backend != "none":
        unsupported.append(f"run.backend: {wl.run.backend}")
    if unsupported:
        raise InputError(
            f"{_where(wl)}: not supported by this kvbench build: {', '.join(unsupported)}")


def _check_fits(wl: Workload, requests: list[Request], num_blocks: int) -> None:
    tpb = wl.cache.tokens_per_block
    largest = max(requests, key=lambda r: r.input_length)
    need = -(-largest.input_length // tpb)
    if need > num_blocks:
        raise InputError(
            f"{_where(wl)}: cache.max_tokens: request {largest.id} needs {need} blocks "
            f"({largest.input_length} prompt tokens at tokens_per_block {tpb}) but the cache "
            f"holds {num_blocks}; raise cache.max_tokens to at least {need * tpb}")


def _run_one(
    name: str, wl: Workload, requests: list[Request], progress: ProgressFactory | None
) -> RunOutcome:
    spec = cache_spec(wl)
    _check_fits(wl, requests, spec.num_gpu_blocks)
    t0 = time.perf_counter()
    manager = KVCacheManager(spec)
    advance = progress(name, len(requests)) if progress is not None else None
    result = replay_cache_mode(requests, manager, advance)
    refs = reference_hit_rates(
        requests, spec.tokens_per_block, spec.num_gpu_blocks,
        partial_reuse=spec.enable_partial_reuse, block_reuse=spec.enable_block_reuse)
    wall = time.perf_counter() - t0
    for r in requests:
        r.drop_keys()
    prompt = result.prompt_tokens
    peak = manager.gpu.peak_in_use
    metrics = {
        "requests": len(requests),
        "prompt_tokens": prompt,
        "reused_tokens": result.reused_tokens,
        "reused_tokens_gpu": result.reused_tokens,
        "reused_tokens_host": 0,
        "reused_full_blocks": result.reused_full_blocks,
        "reused_partial_tokens": result.reused_partial_tokens,
        "hit_rate": result.reused_tokens / prompt,
        "ideal_hit_rate": refs.ideal_hit_rate,
        "optimal_hit_rate": refs.optimal_hit_rate,
        "gpu_blocks_total": spec.num_gpu_blocks,
        "host_blocks_total": 0,
        "peak_gpu_blocks": peak,
        "peak_host_blocks": 0,
        "peak_gpu_bytes": peak * block_bytes(wl),
        "allocated_blocks": manager.allocated_blocks,
        "evicted_blocks": manager.evicted_blocks,
        "onboard_blocks": 0,
        "offload_blocks": 0,
        "partial_copy_blocks": manager.partial_copy_blocks,
        "wall_s": wall,
        "verified": None,
        "max_abs_err": None,
    }
    return RunOutcome(name, wl, metrics, result.timeline.to_json())
