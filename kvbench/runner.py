"""One workload file -> its variants -> engine runs -> metrics. The CLI and the tuner call this."""

from __future__ import annotations

import resource
import time
from collections.abc import Callable

from .cache.manager import CacheSpec, KVCacheManager, grow_blocks
from .cache.mirror import MirroredCacheManager
from .cache.policies import POLICIES
from .cache.protocol import CacheManager
from .cache.windows import (LifeCycle, WindowedCacheManager, life_cycles,
                            prefill_blocks_bound, split_gpu_blocks)
from .config import Workload, resolve_path
from .engine.cache_mode import replay_cache_mode
from .engine.clock import (MeasuredClock, ProfileClock, StepClock, hardware_from_config,
                           host_link_bytes_per_s)
from .engine.scheduler import Scheduler
from .engine.serve import SERVE_COUNTERS, run_serve
from .engine.speculative import Speculation
from .errors import InputError
from .metrics import percentile_summary, unregistered
from .oracle import reference_hit_rates, streamed_reference_hit_rates
from .results import RunOutcome
from .traffic import Request, load_traffic, open_trace, trace_options, trace_path
from .traffic.spill import NotSpillable, SpilledTrace
from .traffic.decoding import apply_decoding
from .traffic.tracefile import warn

ProgressFactory = Callable[[str, int], Callable[[int], None]]
"""(description, total) -> advance(n): how a run reports progress (a rich bar in the CLI)."""


def block_bytes(workload: Workload) -> int:
    """Bytes of one block: tokens_per_block tokens of K and V for every layer."""
    m = workload.model
    return workload.cache.tokens_per_block * m.num_layers * m.kv_bytes_per_token_per_layer


def draft_block_bytes(workload: Workload) -> int:
    """Bytes of one block of the draft model's cache (0 without a draft model)."""
    d = workload.speculative.draft_model
    if d is None:
        return 0
    return workload.cache.tokens_per_block * d.num_layers * d.kv_bytes_per_token_per_layer


def policy_params(workload: Workload):
    """The parameters dataclass of the workload's eviction policy (None for lru)."""
    c = workload.cache
    if c.eviction_policy == "lru":
        return None
    params_cls = POLICIES[c.eviction_policy][1]
    return params_cls(**getattr(c.policy, c.eviction_policy).model_dump())


def cache_spec(workload: Workload, *, emit_copy_ops: bool = False) -> CacheSpec:
    """The target model's cache. With a draft model, the `max_tokens` byte budget holds a
    target block and its mirrored draft block per block (TensorRT-LLM sizes both caches with
    the per-token size of both models)."""
    c = workload.cache
    gpu_blocks = c.max_tokens // c.tokens_per_block - _cross_blocks(workload)
    if workload.speculative.draft_model is not None:
        budget = gpu_blocks * block_bytes(workload)
        gpu_blocks = budget // (block_bytes(workload) + draft_block_bytes(workload))
    return CacheSpec(
        eviction_policy=c.eviction_policy,
        policy_params=policy_params(workload),
        admission=c.admission,
        tokens_per_block=c.tokens_per_block,
        num_gpu_blocks=gpu_blocks,
        num_host_blocks=int(c.host_offload_ratio * gpu_blocks),
        secondary_offload_min_priority=c.secondary_offload_min_priority,
        enable_block_reuse=c.enable_block_reuse,
        enable_partial_reuse=c.enable_partial_reuse,
        copy_on_partial_reuse=c.copy_on_partial_reuse,
        emit_copy_ops=emit_copy_ops,
        strict_phase2=c.strict_phase2,
    )


def _cross_blocks(workload: Workload) -> int:
    """Blocks of the budget the cross-attention cache takes (`cache.cross_kv_cache_fraction`;
    a cross block holds the same layers and heads as a self-attention one)."""
    c = workload.cache
    return int(c.cross_kv_cache_fraction * (c.max_tokens // c.tokens_per_block))


def cross_manager(wl: Workload, requests: list[Request]) -> KVCacheManager | None:
    """The cross-attention cache for requests' encoder inputs (None when none has one):
    shared by a sequence's beams, never grown, no host tier; it emits copy ops for the data
    plane's cross pool when there is one."""
    longest = max((r.encoder.input_length for r in requests if r.encoder is not None),
                  default=0)
    if not longest:
        return None
    c = wl.cache
    tpb, blocks = c.tokens_per_block, _cross_blocks(wl)
    need = -(-longest // tpb)
    if need > blocks:
        raise InputError(
            f"{_where(wl)}: cache.cross_kv_cache_fraction: an encoder input of {longest} tokens "
            f"needs {need} cross-attention blocks but the fraction "
            f"({c.cross_kv_cache_fraction}) of cache.max_tokens gives {blocks}")
    return KVCacheManager(CacheSpec(
        tokens_per_block=tpb, num_gpu_blocks=blocks, enable_block_reuse=c.enable_block_reuse,
        enable_partial_reuse=c.enable_partial_reuse,
        copy_on_partial_reuse=c.copy_on_partial_reuse, cross_kv=True,
        emit_copy_ops=wl.run.backend != "none", strict_phase2=c.strict_phase2))


def run_workload(workload: Workload, progress: ProgressFactory | None = None) -> list[RunOutcome]:
    """Run every variant of `workload` on the same request stream (reloaded only when a
    variant changes the requests or the seed, or needs it in memory where another streamed
    it)."""
    return [_run_one(name, wl, requests, progress) for name, wl, requests in _variants(workload)]


def check_workload(workload: Workload) -> None:
    """Refuse (InputError) what `run_workload` would refuse, without running: the requests are
    loaded (a trace is read to its end) and every variant's cache sized."""
    for _ in _variants(workload):
        pass


def workload_warnings(workload: Workload) -> list[str]:
    """What would run but is probably not what was meant: a GPU cache larger than the
    hardware preset's memory."""
    over: dict[tuple[int, str, int], list[str]] = {}
    for name, wl in workload.variant_workloads():
        m = wl.model
        gpu_bytes = wl.cache.max_tokens * m.num_layers * m.kv_bytes_per_token_per_layer
        memory = hardware_from_config(wl.hardware).memory_bytes
        if memory is not None and gpu_bytes > memory:
            over.setdefault((gpu_bytes, wl.hardware.preset, memory), []).append(name)
    return [f"{_where(workload)}: cache.max_tokens: the GPU cache takes {_gib(gpu_bytes)} but "
            f"a {preset} has {_gib(memory)} in all (variants: {', '.join(names)})"
            for (gpu_bytes, preset, memory), names in over.items()]


def _variants(workload: Workload):
    """(name, workload, requests) of each variant, checked: the requests fit the cache and
    what the run will allocate fits this machine's memory (`_check_sizes`). Streamed traces
    are closed when the caller is done with them."""
    loaded: dict[str, list[Request] | SpilledTrace] = {}
    try:
        for name, wl in workload.variant_workloads():
            _check_supported(wl)
            stream = _streamable(wl)
            source_key = wl.requests.model_dump_json() + f"/seed={wl.run.seed}/stream={stream}"
            requests = loaded.get(source_key)
            if requests is None:
                requests = loaded[source_key] = _load(wl, stream)
            _check_sizes(wl, requests)
            yield name, wl, requests
    finally:
        for requests in loaded.values():
            if isinstance(requests, SpilledTrace):
                requests.close()


METADATA_BYTES_PER_BLOCK = 512
"""Python memory the cache manager holds per block of either tier: about 240 bytes at rest
(measured), more once blocks carry prefix keys and tree nodes."""


def _check_sizes(wl: Workload, requests: list[Request]) -> None:
    """Before anything is allocated: every request fits the cache (a serve run's budgets
    too), and the block metadata and the data plane's K/V tensors fit in memory."""
    emit = wl.run.backend != "none"
    if _windowed(wl):
        cycles, specs = _windowed_specs(wl, requests, emit_copy_ops=emit)
        if wl.run.mode == "serve":
            _check_serve_fits(wl, requests, sum(s.num_gpu_blocks for s in specs))
        pools = [(s, c.num_layers) for c, s in zip(cycles, specs)]
    else:
        spec = cache_spec(wl, emit_copy_ops=emit)
        if wl.run.mode == "serve":
            _check_serve_fits(wl, requests, spec.num_gpu_blocks)
        else:
            _check_fits(wl, requests, spec.num_gpu_blocks)
        pools = [(spec, wl.model.num_layers)]
    # A draft model mirrors the target's blocks (`cache/mirror.py`): as many again; the cross
    # cache takes its share of the same budget.
    copies = 2 if wl.speculative.draft_model is not None else 1
    blocks = copies * sum(s.num_gpu_blocks + s.num_host_blocks for s, _ in pools)
    blocks += _cross_blocks(wl)
    _check_memory(wl, blocks * METADATA_BYTES_PER_BLOCK, "the cache manager's block metadata")
    if emit:
        page = wl.cache.tokens_per_block * wl.model.kv_bytes_per_token_per_layer
        gpu = sum(s.num_gpu_blocks * layers * page for s, layers in pools)
        host = sum(s.num_host_blocks * layers * page for s, layers in pools)
        gpu += sum(s.num_gpu_blocks for s, _ in pools) * draft_block_bytes(wl)
        gpu += _cross_blocks(wl) * block_bytes(wl)  # the cross-attention pool's tensor
        _check_tensors(wl, gpu, host)


def _synthetic_bytes(requests_cfg) -> int:
    """Bytes of the token ids a synthetic stream holds (int64): multi-turn prompts repeat
    their session so far, half the turns on average."""
    s = requests_cfg.synthetic
    n = s.num_requests  # the generator makes them all before a limit cuts
    profile = s.prompt_tokens if s.profile_tokens is None else s.profile_tokens
    per_request = s.system_prompt_tokens + profile + s.prompt_tokens + s.output_tokens
    if s.generator == "multi_turn":
        per_request = s.system_prompt_tokens + (s.turns + 1) / 2 * (s.prompt_tokens
                                                                    + s.output_tokens)
    return int(8 * (n * per_request + s.num_users * (s.system_prompt_tokens + s.prompt_tokens)))


def _check_tensors(wl: Workload, gpu_bytes: int, host_bytes: int) -> None:
    """The data plane's K/V tensors: the GPU tier on the GPU when there is one (else in host
    memory, as the host tier always is)."""
    import torch

    if torch.cuda.is_available():
        free, _ = torch.cuda.mem_get_info()
        if gpu_bytes > free:
            raise InputError(
                f"{_where(wl)}: run.backend {wl.run.backend}: the GPU tier's K/V tensors need "
                f"{_gib(gpu_bytes)} ({gpu_bytes:,} bytes) but the GPU has {_gib(free)} free; "
                "lower cache.max_tokens")
        _check_memory(wl, host_bytes, "the host tier's K/V tensors")
    else:
        _check_memory(wl, gpu_bytes + host_bytes, "the K/V tensors (on the CPU)")


_CACHE_HINT = "lower cache.max_tokens or cache.host_offload_ratio"


def _check_memory(wl: Workload, need: int, what: str, hint: str = _CACHE_HINT) -> None:
    available = available_memory()
    if available is not None and need > available:
        raise InputError(
            f"{_where(wl)}: {what} would take {_gib(need)} ({need:,} bytes) but only "
            f"{_gib(available)} is available to this process; {hint}")


def available_memory() -> int | None:
    """Bytes of memory this process may still allocate: MemAvailable of /proc/meminfo, what
    the cgroup's limit and the address-space limit (ulimit -v) leave, whichever is lowest
    (None where none is known)."""
    limits = []
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as f:
                used = int(f.read().split()[0]) * resource.getpagesize()
        except (OSError, ValueError, IndexError):
            used = 0
        limits.append(max(soft - used, 0))
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    limits.append(int(line.split()[1]) * 1024)
                    break
    except OSError:
        pass
    for path, usage in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                        ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                         "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            with open(path) as f:
                text = f.read().strip()
            with open(usage) as f:
                used = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if text.isdigit():
            limits.append(max(int(text) - used, 0))
        break
    return min(limits) if limits else None


def _gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"


def load_workload_requests(wl: Workload) -> list[Request]:
    """The request stream a run of `wl` replays."""
    return _load(wl)


def _streamable(wl: Workload) -> bool:
    """A cache-mode run of a trace on one pool without a data plane streams its requests
    (`traffic/spill.py`, `oracle.streamed_reference_hit_rates`): its memory does not grow with
    the trace, so production-size traces fit."""
    r = wl.requests
    return (wl.run.mode == "cache" and r.source == "trace" and not _windowed(wl)
            and wl.run.backend == "none" and r.beam_widths is None and r.retention is None
            and not r.encoder.tokens)


def _load(wl: Workload, stream: bool = False) -> list[Request] | SpilledTrace:
    if wl.requests.source == "synthetic":
        _check_memory(wl, _synthetic_bytes(wl.requests), "the synthetic requests' tokens",
                      "lower requests.synthetic.num_requests, num_users or the token counts")
    base = wl.source_path.parent if wl.source_path is not None else resolve_path(wl, ".")
    requests = reader = None
    if stream:
        reader = open_trace(trace_path(wl.requests, base), wl.requests.format,
                            trace_options(wl.requests, wl.run.seed))
        try:
            requests = SpilledTrace(iter(reader), beam_width=wl.requests.beam_width)
        except NotSpillable:
            requests = None  # read again, into memory
    if requests is None:
        requests, reader = load_traffic(wl.requests, base_dir=base, seed=wl.run.seed)
    if not len(requests):
        raise InputError(f"{_where(wl)}: requests: the request stream is empty")
    if reader is not None and reader.without_ids == len(requests) and wl.run.mode == "cache":
        warn(f"{reader.path}: the trace has no prefix information ({reader.format}: arrivals "
             "and lengths only), so cache mode has nothing to reuse and its hit rates are 0 "
             "by construction; run.mode: serve uses such a trace as it is")
    if not isinstance(requests, SpilledTrace):  # a spilled trace has neither option
        apply_decoding(requests, wl.requests, wl.run.seed)
        if wl.requests.retention is not None:
            retention = wl.requests.retention.to_retention()
            for r in requests:
                r.retention = retention
    return requests


def _where(wl: Workload) -> str:
    return str(wl.source_path) if wl.source_path is not None else wl.name


def _check_supported(wl: Workload) -> None:
    unsupported = []
    if wl.run.mode == "serve" and _windowed(wl):
        # A deferred chunk kept for a later step may compute a different range than its
        # scratch slots were chosen for.
        s = wl.scheduler
        if (wl.cache.swa_scratch_reuse and not s.revert_deferred_ctx
                and (s.batch_wait_timeout_iters or s.batch_wait_max_tokens_ratio)):
            unsupported.append("cache.swa_scratch_reuse with delay batching in run.mode: serve"
                               " unless scheduler.revert_deferred_ctx")
    sp = wl.speculative
    if sp.enabled:
        if wl.run.mode != "serve":
            unsupported.append("speculative decoding outside run.mode: serve")
        if _windowed(wl) and sp.draft_model is not None:
            # The mirror repeats every call with the same block ids, which needs one pool of
            # the same size in both caches; a windowed target has a pool per life cycle.
            unsupported.append("speculative.draft_model with sliding-window layers (its "
                               "mirrored cache follows one pool; drafting without a "
                               "draft_model is supported)")
        if wl.requests.beam_width > 1 or any(w > 1 for w in wl.requests.beam_widths or ()):
            unsupported.append("speculative decoding with beam search (as TensorRT-LLM)")
    if wl.requests.encoder.tokens:
        if sp.enabled:
            unsupported.append("encoder inputs with speculative decoding")
    if wl.run.clock == "measured":
        # The measured step is the target model's work on the data plane alone.
        if sp.enabled:
            unsupported.append("run.clock: measured with speculative decoding")
        if wl.requests.encoder.tokens:
            unsupported.append("run.clock: measured with encoder inputs")
    if unsupported:
        raise InputError(
            f"{_where(wl)}: not supported by this kvbench build: {', '.join(unsupported)}")
    if wl.run.clock == "measured" and wl.run.mode != "serve":
        raise InputError(f"{_where(wl)}: run.clock: measured times serve-mode steps; "
                         "set run.mode: serve (cache mode has no clock)")


def _windowed(wl: Workload) -> bool:
    """Some layer has a sliding window: one pool per life cycle (`cache/windows.py`)."""
    return any(w is not None for w in wl.model.layer_windows)


def _open_data_plane(wl: Workload, spec: CacheSpec,
                     windowed: WindowedCacheManager | None = None, model=None, *,
                     backend: str | None = None, engine=None,
                     cross: KVCacheManager | None = None):
    """The data plane for `run.backend` (None for `none`); torch is imported only here.
    With a `windowed` manager, one tensor per life cycle's pool; `model` is another model's
    shape (the draft's) instead of the workload's; a `cross` cache gets a pool of its own."""
    model = wl.model if model is None else model
    backend = backend or wl.run.backend
    if backend == "none":
        return None
    from .kernels.dataplane import open_data_plane
    from .kernels.step import BackendUnavailable, PoolSpec

    cross_pool = (None if cross is None else
                  PoolSpec(tuple(range(model.num_layers)), cross.spec.num_gpu_blocks))
    try:
        # A measured clock reads each step's time at once; otherwise the host runs ahead.
        return open_data_plane(model, spec.tokens_per_block,
                               _pool_specs(model, spec, windowed), backend=backend,
                               verify=wl.run.verify, seed=wl.run.seed, engine=engine,
                               lazy_times=engine is None, cross=cross_pool)
    except BackendUnavailable as exc:
        raise InputError(f"{_where(wl)}: run.backend: {exc}") from None


def _pool_specs(model, spec: CacheSpec, windowed: WindowedCacheManager | None) -> list:
    from .kernels.step import PoolSpec

    if windowed is None:
        return [PoolSpec(tuple(range(model.num_layers)), spec.num_gpu_blocks,
                         num_host_slots=spec.num_host_blocks)]
    return [PoolSpec(c.layers, m.gpu.capacity, window=c.window,
                     num_host_slots=m.host.capacity if m.host is not None else 0)
            for c, m in zip(windowed.cycles, windowed.managers)]


MEASURED_OVERHEAD_BYTES = 2 << 30
"""GPU memory a measured run needs beside weights, KV cache and step buffers: the CUDA
context, cuBLAS and FlashInfer workspaces, captured graphs' pools."""


def _open_measured_plane(wl: Workload, spec: CacheSpec,
                         windowed: WindowedCacheManager | None):
    """The FlashInfer data plane with the engine's linear layers, for `run.clock: measured`;
    refuses (InputError, before allocating anything) when CUDA, FlashInfer or the memory for
    weights and cache is missing."""
    where = _where(wl)
    if wl.run.backend == "torch":
        raise InputError(f"{where}: run.clock: measured times FlashInfer attention; set "
                         "run.backend to flashinfer or auto (got torch)")
    import torch

    if not torch.cuda.is_available():
        raise InputError(f"{where}: run.clock: measured needs a CUDA GPU and torch sees none; "
                         "use run.clock: modeled (with hardware.profile for a calibrated card)")
    from .kernels.engine import LinearShape, LinearWork
    from .kernels.step import ModelShape
    from .kernels.storage import pool_bytes
    from .profile import model_shape

    m = wl.model
    dims = model_shape(m, spec.tokens_per_block)
    shape = LinearShape(m.num_layers, dims["hidden_size"], m.num_q_heads * m.head_dim,
                        m.num_kv_heads * m.head_dim, dims["intermediate_size"])
    kv_shape = ModelShape.of(m, spec.tokens_per_block)
    cache = sum(pool_bytes(kv_shape, p) for p in _pool_specs(m, spec, windowed))
    mnt = wl.scheduler.max_num_tokens
    step = shape.activation_bytes(mnt) + 2 * m.num_layers * mnt * (
        2 * shape.kv + shape.q)
    need = shape.weight_bytes + cache + step + MEASURED_OVERHEAD_BYTES
    free, _ = torch.cuda.mem_get_info()
    if need > free:
        gib = 1 << 30
        raise InputError(
            f"{where}: run.clock: measured needs {need:,} bytes ({need / gib:.1f} GiB) on the "
            f"GPU: weights {shape.weight_bytes / gib:.1f} GiB, KV cache {cache / gib:.1f} GiB, "
            f"step buffers and workspaces {(step + MEASURED_OVERHEAD_BYTES) / gib:.1f} GiB; "
            f"{torch.cuda.get_device_name()} has {free / gib:.1f} GiB free: lower "
            "cache.max_tokens or scheduler.max_num_tokens")
    if wl.run.backend == "auto":
        from .kernels.flashinfer_backend import flashinfer_problem

        problem = flashinfer_problem(m.dtype)
        if problem:
            raise InputError(f"{where}: run.clock: measured: {problem}")
    engine = LinearWork(shape, torch.device("cuda"), wl.scheduler.max_batch_size, wl.run.seed)
    return _open_data_plane(wl, spec, windowed, backend="flashinfer", engine=engine)


def serve_clock(wl: Workload):
    """The serve loop's clock: measured, a calibrated profile's, or the preset's."""
    if wl.run.clock == "measured":
        return MeasuredClock()
    if wl.hardware.profile is not None:
        from .profile import load_profile, model_shape

        profile = load_profile(resolve_path(wl, wl.hardware.profile))
        profile.check_shape(model_shape(wl.model, wl.cache.tokens_per_block), _where(wl))
        return ProfileClock(profile)
    return StepClock(wl.model, hardware_from_config(wl.hardware))


def _check_fits(wl: Workload, requests: list[Request] | SpilledTrace, num_blocks: int) -> None:
    tpb = wl.cache.tokens_per_block
    if isinstance(requests, SpilledTrace):
        largest = requests.shape_of(requests.largest())
    else:
        largest = max(requests, key=lambda r: grow_blocks(tpb, r, 0, r.input_length))
    need = grow_blocks(tpb, largest, 0, largest.input_length)
    if need > num_blocks:
        raise InputError(
            f"{_where(wl)}: cache.max_tokens: request {largest.id} needs {need} blocks "
            f"({largest.input_length} prompt tokens, {largest.beam_width} beam(s) at "
            f"tokens_per_block {tpb}) but the cache holds {num_blocks}; raise cache.max_tokens "
            f"to at least {need * tpb}")


def windowed_manager(wl: Workload, requests: list[Request], *,
                     emit_copy_ops: bool = False) -> WindowedCacheManager:
    """The cache of a model with sliding-window layers (`_windowed_specs`)."""
    cycles, specs = _windowed_specs(wl, requests, emit_copy_ops=emit_copy_ops)
    c = wl.cache
    reserve = wl.speculative.max_draft_len + wl.speculative.reserved_tokens
    return WindowedCacheManager(
        cycles, specs, release_out_of_window=c.release_out_of_window,
        swa_scratch_reuse=c.swa_scratch_reuse,
        bytes_per_token_per_layer=wl.model.kv_bytes_per_token_per_layer,
        reserve_tokens=reserve if wl.run.mode == "serve" else 0)


def _windowed_specs(wl: Workload, requests: list[Request], *,
                    emit_copy_ops: bool = False) -> tuple[list[LifeCycle], list[CacheSpec]]:
    """The pools of a model with sliding-window layers: one per life cycle, the GPU budget
    (`cache.max_tokens` tokens of the whole model, in bytes, less the cross-attention
    cache's share) split by `cache.window_memory_split` against the mean request context
    (the prompt in cache mode, prompt and output in serve mode), no pool below what the
    largest request needs to run alone (every beam and reserved token counted); each pool's
    host tier is `host_offload_ratio` of its GPU blocks."""
    c, m = wl.cache, wl.model
    tpb = c.tokens_per_block
    cycles = life_cycles(m.layer_windows)
    per_layer = m.kv_bytes_per_token_per_layer
    slot_bytes = [tpb * cyc.num_layers * per_layer for cyc in cycles]
    reserve = wl.speculative.max_draft_len + wl.speculative.reserved_tokens
    if wl.run.mode == "serve":
        lengths = [r.input_length + max(r.output_length - 1, 0) for r in requests]
        floors = [max(_serve_blocks_bound(wl, cyc, r, n + reserve)
                      for r, n in zip(requests, lengths)) for cyc in cycles]
    else:
        lengths = [r.input_length for r in requests]
        floors = [max(prefill_blocks_bound(cyc, tpb, r.input_length, c.swa_scratch_reuse,
                                           r.beam_width) for r in requests)
                  for cyc in cycles]
    longest = max(lengths)
    mean = -(-sum(lengths) // len(lengths))
    budget = c.max_tokens * m.num_layers * per_layer - _cross_blocks(wl) * block_bytes(wl)
    try:
        blocks = split_gpu_blocks(cycles, budget, slot_bytes, mean,
                                  policy=c.window_memory_split, min_blocks=floors)
    except ValueError:
        need = sum(f * b for f, b in zip(floors, slot_bytes)) + _cross_blocks(wl) * block_bytes(wl)
        raise InputError(
            f"{_where(wl)}: cache.max_tokens: the longest request ({longest} tokens) needs "
            f"{need} bytes of KV across the attention pools (every beam, reserved tokens and "
            f"the cross-attention share counted) but the cache holds "
            f"{c.max_tokens * m.num_layers * per_layer}; raise cache.max_tokens to at least "
            f"{-(-need // (m.num_layers * per_layer))}"
        ) from None
    specs = [CacheSpec(
        tokens_per_block=tpb, num_gpu_blocks=n, num_host_blocks=int(c.host_offload_ratio * n),
        secondary_offload_min_priority=c.secondary_offload_min_priority,
        enable_block_reuse=c.enable_block_reuse, enable_partial_reuse=c.enable_partial_reuse,
        copy_on_partial_reuse=c.copy_on_partial_reuse, emit_copy_ops=emit_copy_ops,
        strict_phase2=c.strict_phase2,
        eviction_policy=c.eviction_policy, policy_params=policy_params(wl), admission=c.admission,
    ) for n in blocks]
    return cycles, specs


def _serve_blocks_bound(wl: Workload, cycle: LifeCycle, request: Request, length: int) -> int:
    """Blocks of `cycle` a serve run needs for `request` to run alone holding `length`
    tokens (reserved ones included; the scheduler charges each pool what a step draws there,
    every beam's blocks): the whole request without a window or without chunked prefill,
    else, per beam, a chunk and two windows."""
    tpb = wl.cache.tokens_per_block
    blocks = grow_blocks(tpb, request, 0, length)
    if cycle.window is None or not wl.scheduler.enable_chunked_prefill:
        return blocks
    window = -(-(cycle.window - 1) // tpb) + 2
    per_beam = -(-wl.scheduler.max_num_tokens // tpb) + 1 + 2 * window
    return min(blocks, request.beam_width * per_beam)


def _run_one(
    name: str, wl: Workload, requests: list[Request] | SpilledTrace,
    progress: ProgressFactory | None,
) -> RunOutcome:
    if wl.run.mode == "serve":
        return _run_serve(name, wl, requests, progress)
    emit = wl.run.backend != "none"
    windowed = windowed_manager(wl, requests, emit_copy_ops=emit) if _windowed(wl) else None
    spec = cache_spec(wl, emit_copy_ops=emit) if windowed is None else windowed.managers[0].spec
    streamed = isinstance(requests, SpilledTrace)
    cross = None if streamed else cross_manager(wl, requests)
    plane = _open_data_plane(wl, spec, windowed, cross=cross)
    t0 = time.perf_counter()
    manager = KVCacheManager(spec) if windowed is None else windowed
    advance = progress(name, len(requests)) if progress is not None else None
    result = replay_cache_mode(requests, manager, advance, data_plane=plane, cross=cross)
    # With a host tier the optimum may keep blocks in either tier: one pool of both sizes.
    # With windows it is null (the offline optimum is for one pool) and the ideal is an
    # unlimited cache under the same window rules.
    done = _phase(progress, f"{name}: reference hit rates (optimal, ideal)")
    if windowed is None:
        refs = (streamed_reference_hit_rates if streamed else reference_hit_rates)(
            requests, spec.tokens_per_block, spec.num_gpu_blocks + spec.num_host_blocks,
            partial_reuse=spec.enable_partial_reuse, block_reuse=spec.enable_block_reuse)
        ideal, optimal = refs.ideal_hit_rate, refs.optimal_hit_rate
    else:
        ideal, optimal = _ideal_hit_rate(requests, spec, windowed, serve=False), None
    done(1)
    hit = result.reused_tokens / result.prompt_tokens
    lru = hit if _is_lru(wl) else _lru_reference(wl, requests)
    wall = time.perf_counter() - t0
    if not streamed:  # a streamed trace's requests are gone already
        for r in requests:
            r.drop_keys()
    metrics = {
        **_cache_metrics(wl, manager, requests, result.reused_tokens, result.reused_tokens_host,
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
    if plane is not None:
        metrics.update(plane.metrics())
    return _outcome(name, wl, metrics, result.timeline.to_json())


def _outcome(name: str, wl: Workload, metrics: dict, timeline: dict) -> RunOutcome:
    # A metric the registry does not know would reach no table, no compare rule, no schema.
    assert not unregistered(metrics), f"unregistered metrics: {unregistered(metrics)}"
    return RunOutcome(name, wl, metrics, timeline)


def _is_lru(wl: Workload) -> bool:
    return wl.cache.eviction_policy == "lru" and wl.cache.admission == "all"


def _lru_reference(wl: Workload, requests: list[Request]) -> float:
    """The hit rate of the same cache-mode run with LRU eviction and admission of all
    (TensorRT-LLM's behaviour), the reference `gap_closed` is measured from."""
    lru = wl.model_copy(update={"cache": wl.cache.model_copy(
        update={"eviction_policy": "lru", "admission": "all"})})
    manager = (windowed_manager(lru, requests) if _windowed(lru)
               else KVCacheManager(cache_spec(lru)))
    cross = None if isinstance(requests, SpilledTrace) else cross_manager(lru, requests)
    result = replay_cache_mode(requests, manager, cross=cross)
    return result.reused_tokens / result.prompt_tokens


def gap_closed(hit: float, lru: float | None, optimal: float | None) -> float | None:
    """Share of the LRU-to-optimal gap a policy closes: (hit - lru) / (optimal - lru);
    None without both references or without a gap."""
    if lru is None or optimal is None or optimal - lru <= 1e-12:
        return None
    return (hit - lru) / (optimal - lru)


def _cache_metrics(
    wl: Workload, manager: CacheManager, requests: list[Request] | SpilledTrace,
    reused: int, reused_host: int, reused_partial: int,
) -> dict:
    """Reuse, memory and host-traffic metrics of a run in either mode, with one pool or one
    per attention life cycle. Host-link time is modeled: bytes over the hardware's host link
    at the clock's efficiency (`engine/clock.py`)."""
    prompt = (requests.prompt_tokens if isinstance(requests, SpilledTrace)
              else sum(r.input_length for r in requests))
    onboard_bytes, offload_bytes = manager.moved_bytes(block_bytes(wl))
    link = host_link_bytes_per_s(hardware_from_config(wl.hardware))
    return {
        "requests": len(requests),
        "prompt_tokens": prompt,
        "reused_tokens": reused,
        "reused_tokens_gpu": reused - reused_host,
        "reused_tokens_host": reused_host,
        "reused_partial_tokens": reused_partial,
        "hit_rate": reused / prompt,
        **manager.memory_metrics(block_bytes(wl)),
        "peak_host_blocks": manager.peak_host_blocks,
        "allocated_blocks": manager.allocated_blocks,
        "evicted_blocks": manager.evicted_blocks,
        "onboard_blocks": manager.onboard_blocks,
        "offload_blocks": manager.offload_blocks,
        "onboard_bytes": onboard_bytes,
        "offload_bytes": offload_bytes,
        "host_link_ms_modeled": (onboard_bytes + offload_bytes) / link * 1e3,
        "host_evicted_blocks": manager.host_evicted_blocks,
        "partial_copy_blocks": manager.partial_copy_blocks,
        "phase2_alloc_failures": manager.phase2_alloc_failures,
    }


def _run_serve(
    name: str, wl: Workload, requests: list[Request], progress: ProgressFactory | None
) -> RunOutcome:
    windowed = (windowed_manager(wl, requests, emit_copy_ops=wl.run.backend != "none")
                if _windowed(wl) else None)
    spec = cache_spec(wl, emit_copy_ops=wl.run.backend != "none")
    if windowed is not None:
        spec = windowed.managers[0].spec
    cross = cross_manager(wl, requests)
    clock = serve_clock(wl)
    if wl.run.clock == "measured":
        plane = _open_measured_plane(wl, spec, windowed)
    else:
        plane = _open_data_plane(wl, spec, windowed, cross=cross)
    sp = wl.speculative
    hardware = hardware_from_config(wl.hardware)
    speculation = draft_plane = None
    if sp.enabled:
        speculation = Speculation(
            sp.max_draft_len, sp.acceptance_rate, sp.reserved_tokens, wl.run.seed,
            None if sp.draft_model is None else StepClock(sp.draft_model, hardware))
        if sp.draft_model is not None:
            draft_plane = _open_data_plane(wl, spec, model=sp.draft_model)
    t0 = time.perf_counter()
    manager = KVCacheManager(spec) if windowed is None else windowed
    if sp.draft_model is not None:
        manager = MirroredCacheManager(manager, KVCacheManager(spec))
    sched = wl.scheduler
    advance = progress(name, len(requests)) if progress is not None else None
    result = run_serve(
        requests, manager, Scheduler(sched, spec.tokens_per_block,
                                     reserve_tokens=sp.max_draft_len + sp.reserved_tokens),
        clock,
        revert_deferred_ctx=sched.revert_deferred_ctx, batch_add=wl.cache.add_sequence == "batch",
        block_bytes=block_bytes(wl),
        data_plane=plane, speculation=speculation, draft_plane=draft_plane, cross=cross,
        on_progress=advance)
    done = _phase(progress, f"{name}: reference hit rate (ideal)")
    ideal = _ideal_hit_rate(requests, spec, windowed, serve=True)
    done(1)
    wall = time.perf_counter() - t0
    for r in requests:
        r.drop_keys()
    metrics = _serve_metrics(wl, manager, requests, result, ideal, wall, clock.time_source)
    if speculation is not None:
        metrics.update(speculation.metrics())
    if cross is not None:
        metrics.update(result.cross.metrics(cross, block_bytes(wl)))
    if sp.draft_model is not None:
        metrics.update(_draft_metrics(wl, manager.draft, result.requests))
    if plane is not None:
        _plane_metrics(metrics, plane, draft_plane, clock.time_source)
    return _outcome(name, wl, metrics, result.timeline.to_json())


def _serve_metrics(wl: Workload, manager: CacheManager, requests: list[Request], result,
                   ideal: float, wall: float, time_source: str) -> dict:
    """The metrics every serve run reports: reuse, memory and traffic, the clock's times and
    the loop's counters."""
    states = result.requests
    reused = sum(s.reused_tokens for s in states)
    reused_host = sum(s.reused_tokens_host for s in states)
    output = sum(r.output_length for r in requests)
    ttft = [(s.first_token_s - s.request.arrival_s) * 1e3 for s in states
            if s.request.output_length]
    tpot = [(s.finish_s - s.first_token_s) * 1e3 / (s.request.output_length - 1)
            for s in states if s.request.output_length > 1]
    e2e = [(s.finish_s - s.request.arrival_s) * 1e3 for s in states]
    metrics = {
        **_cache_metrics(wl, manager, requests, reused, reused_host,
                         sum(s.reused_partial_tokens for s in states)),
        "reused_full_blocks": sum(s.reused_full_blocks for s in states),
        "reused_partial_blocks": sum(s.reused_partial_tokens > 0 for s in states),
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
        d = draft_plane.metrics()
        metrics["draft_verified"] = d["verified"]
        metrics["draft_max_abs_err"] = d["max_abs_err"]
        if d["verified"] is False:
            metrics["verified"] = False
            metrics["verify_mismatch"] = "draft cache: " + d["verify_mismatch"]


def _draft_metrics(wl: Workload, draft: KVCacheManager, states) -> dict:
    """The draft model's cache: its size, peak and reuse (the same blocks as the target's,
    in its own shape), and the peak bytes of both caches together."""
    peak = draft.gpu.peak_in_use
    return {
        "draft_gpu_blocks_total": draft.spec.num_gpu_blocks,
        "draft_peak_gpu_blocks": peak,
        "draft_peak_gpu_bytes": peak * draft_block_bytes(wl),
        "draft_reused_full_blocks": sum(s.draft_reuse[0] for s in states),
        "draft_reused_partial_blocks": sum(s.draft_reuse[1] for s in states),
        "peak_kv_bytes": peak * (block_bytes(wl) + draft_block_bytes(wl)),
    }


def _phase(progress: ProgressFactory | None, description: str) -> Callable[[int], None]:
    """A one-step progress task naming a phase with no count of its own."""
    return progress(description, 1) if progress is not None else (lambda n: None)


def _ideal_hit_rate(requests: list[Request], spec: CacheSpec,
                    windowed: WindowedCacheManager | None, *, serve: bool) -> float:
    """An unlimited cache with the run's reuse rules replaying the requests in order, each
    storing its prompt (in serve mode, and its generated blocks) before the next. With sliding
    windows it has the run's life cycles and window rules (a request reuses up to any end
    whose window blocks are stored), keeping every block, so it bounds the run's hit rate:
    a prefix-only ideal does not (with a window of 1 every end is served). Generated tokens
    the traffic does not know are unique to their request, so without windows and without
    known answers only prompts matter and the oracle answers."""
    tpb = spec.tokens_per_block
    if windowed is None and (not serve or all(r.output_tokens is None for r in requests)):
        return reference_hit_rates(
            requests, tpb, None, partial_reuse=spec.enable_partial_reuse,
            block_reuse=spec.enable_block_reuse).ideal_hit_rate
    computed = [max(r.input_length, r.stream_length - 1) if serve else r.input_length
                for r in requests]
    unlimited = CacheSpec(
        tpb, sum(-(-n // tpb) for n in computed) + 1, enable_block_reuse=spec.enable_block_reuse,
        enable_partial_reuse=spec.enable_partial_reuse,
        copy_on_partial_reuse=spec.copy_on_partial_reuse)
    manager = (KVCacheManager(unlimited) if windowed is None else
               WindowedCacheManager(windowed.cycles, [unlimited] * len(windowed.cycles)))
    reused = 0
    for r, n in zip(requests, computed):
        seq = manager.add_sequence(r.view(r.input_length) if serve else r)
        manager.resize(seq, n)
        manager.commit(seq, n)
        manager.release(seq)
        reused += seq.reused_tokens
    return reused / sum(r.input_length for r in requests)


def _check_serve_fits(wl: Workload, requests: list[Request], num_blocks: int) -> None:
    """Every request must be able to finish alone: its stream's computed tokens in the cache
    and, without chunked prefill, its longest (recomputed) context in one step."""
    s, tpb = wl.scheduler, wl.cache.tokens_per_block
    if s.max_batch_size > s.max_num_tokens:
        raise InputError(
            f"{_where(wl)}: scheduler.max_batch_size ({s.max_batch_size}) exceeds "
            f"scheduler.max_num_tokens ({s.max_num_tokens}): every running request decodes one "
            "token per step")
    if s.enable_chunked_prefill and s.max_num_tokens < tpb:
        raise InputError(
            f"{_where(wl)}: scheduler.max_num_tokens ({s.max_num_tokens}) is below one chunk "
            f"of cache.tokens_per_block ({tpb}) tokens")
    sp = wl.speculative
    widest = max(r.beam_width for r in requests) * (1 + sp.max_draft_len)
    if s.max_batch_size * widest > s.max_num_tokens:
        raise InputError(
            f"{_where(wl)}: scheduler.max_batch_size ({s.max_batch_size}) x the tokens one "
            f"request decodes per step ({widest}: beams x (1 + speculative.max_draft_len)) "
            f"exceeds scheduler.max_num_tokens ({s.max_num_tokens})")
    # A request holds KV for its prompt and all but its last generated token, in every beam.
    extra = sp.max_draft_len + sp.reserved_tokens

    def held(r: Request) -> int:
        return r.input_length + max(r.output_length - 1, 0) + extra

    largest = max(requests, key=lambda r: grow_blocks(tpb, r, 0, held(r)))
    need, length = grow_blocks(tpb, largest, 0, held(largest)), held(largest)
    # With a draft model each block of budget also pays for its draft block.
    least = -(-need * (block_bytes(wl) + draft_block_bytes(wl)) // block_bytes(wl)) * tpb
    if need > num_blocks:
        raise InputError(
            f"{_where(wl)}: cache.max_tokens: request {largest.id} needs {need} blocks "
            f"({length} prompt, generated and reserved tokens, {largest.beam_width} beam(s) "
            f"at tokens_per_block {tpb}) but the cache holds {num_blocks}; raise "
            f"cache.max_tokens to at least {least}")
    largest = max(requests, key=held)
    length = held(largest) - extra
    if not s.enable_chunked_prefill and length > s.max_num_tokens:
        raise InputError(
            f"{_where(wl)}: scheduler.max_num_tokens: request {largest.id} may need to "
            f"(re)compute {length} tokens in one step without chunked prefill; raise "
            f"scheduler.max_num_tokens to at least {length} or enable_chunked_prefill")
