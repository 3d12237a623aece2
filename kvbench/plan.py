"""The run plan of one workload variant, built once before anything is allocated: the
cache's pools (one, or one per attention life cycle of a model with sliding windows) sized from
the byte budget, every CacheSpec built by one function, the fit and memory checks, the serve
clock and the data plane's pool layout. The runner and both mode runners read it; nothing here
runs a request."""

from __future__ import annotations

import resource
from collections.abc import Iterable
from dataclasses import dataclass

from .cache.manager import CacheSpec, KVCacheManager
from .cache.policies import POLICIES
from .cache.lifecycle import LifeCycle, life_cycles, prefill_blocks_bound, split_gpu_blocks
from .cache.mirror import MirroredCacheManager, MirroredWindowedCacheManager, held_cycles
from .cache.seq import grow_blocks
from .cache.windows import WindowedCacheManager
from .config import Workload, resolve_path
from .engine.clock import (MeasuredClock, ProfileClock, StepClock, hardware_from_config,
                           host_link_bytes_per_s)
from .errors import InputError
from .traffic import Request
from .traffic.spill import SpilledTrace


@dataclass(frozen=True, slots=True)
class RunPlan:
    """A variant's cache pools, sized once (`size_pools`, checked by `plan_run`)."""

    workload: Workload
    specs: tuple[CacheSpec, ...]
    """One spec per pool; every pool shares tokens_per_block and the reuse rules."""
    cycles: tuple[LifeCycle, ...] | None
    """The attention life cycle of each pool; None for a model without sliding windows."""
    draft_specs: tuple[CacheSpec, ...] = ()
    """The draft model's pools (`speculative.draft_model`; `cache/mirror.py`): the one pool
    mirroring the target's, or one per life cycle of the draft (`draft_cycles`) when either
    model has sliding windows."""
    draft_cycles: tuple[LifeCycle, ...] | None = None
    """The draft's life cycles (its layer numbering and windows) beside a windowed target's
    pools; None for the one-pool mirror or without a draft model."""

    @property
    def spec(self) -> CacheSpec:
        """The first pool's spec: the whole cache without windows."""
        return self.specs[0]

    @property
    def gpu_blocks(self) -> int:
        return sum(s.num_gpu_blocks for s in self.specs)

    def manager(self) -> KVCacheManager | WindowedCacheManager | MirroredCacheManager:
        """A fresh, empty cache manager over the planned pools (a draft model's too)."""
        if self.cycles is None:
            if self.draft_specs:
                return MirroredCacheManager(KVCacheManager(self.spec),
                                            KVCacheManager(self.draft_specs[0]))
            return KVCacheManager(self.spec)
        wl = self.workload
        c = wl.cache
        reserve = wl.speculative.max_draft_len + wl.speculative.reserved_tokens
        options = dict(release_out_of_window=c.release_out_of_window,
                       swa_scratch_reuse=c.swa_scratch_reuse,
                       bytes_per_token_per_layer=wl.model.kv_bytes_per_token_per_layer,
                       reserve_tokens=reserve if wl.run.mode == "serve" else 0)
        if self.draft_cycles is not None:
            return MirroredWindowedCacheManager(
                list(self.cycles), list(self.specs), list(self.draft_cycles),
                list(self.draft_specs), draft_bytes_per_token_per_layer=(
                    wl.speculative.draft_model.kv_bytes_per_token_per_layer), **options)
        return WindowedCacheManager(list(self.cycles), list(self.specs), **options)

    def pool_specs(self, draft: bool = False) -> list:
        """The data plane's pools (`kernels.step.PoolSpec`): one tensor per planned pool of
        the target model, or of the `draft` model."""
        from .kernels.step import PoolSpec

        wl = self.workload
        if draft:
            cycles, specs = self.draft_cycles, self.draft_specs
            model = wl.speculative.draft_model
        else:
            cycles, specs, model = self.cycles, self.specs, wl.model
        if cycles is None:
            return [PoolSpec(tuple(range(model.num_layers)), specs[0].num_gpu_blocks,
                             num_host_slots=specs[0].num_host_blocks)]
        return [PoolSpec(c.layers, s.num_gpu_blocks, window=c.window,
                         num_host_slots=s.num_host_blocks)
                for c, s in zip(cycles, specs)]

    def pool_bytes(self) -> list[tuple[CacheSpec, int]]:
        """Every pool of both models with the bytes of one of its blocks."""
        wl = self.workload
        tpb = wl.cache.tokens_per_block
        out = []
        for model, cycles, specs in ((wl.model, self.cycles, self.specs),
                                     (wl.speculative.draft_model, self.draft_cycles,
                                      self.draft_specs)):
            if not specs:
                continue
            page = tpb * model.kv_bytes_per_token_per_layer
            layers = [model.num_layers] if cycles is None else [c.num_layers for c in cycles]
            out += [(s, n * page) for s, n in zip(specs, layers)]
        return out


def plan_run(wl: Workload, requests: list[Request] | SpilledTrace) -> RunPlan:
    """The variant's pools, checked before anything is allocated: every request fits the
    cache (a serve run's budgets too), and the block metadata and the data plane's K/V
    tensors fit in memory."""
    emit = wl.run.backend != "none"
    plan = size_pools(wl, requests, emit_copy_ops=emit)
    if wl.run.mode == "serve":
        check_serve_fits(wl, requests, plan.gpu_blocks)
    elif plan.cycles is None:
        check_fits(wl, requests, plan.spec.num_gpu_blocks)
    if not isinstance(requests, SpilledTrace):  # a streamed trace has no encoder inputs
        check_cross_fits(wl, requests)
    # A draft model's pools (`cache/mirror.py`) beside the target's; the cross cache takes
    # its share of the same budget.
    pools = plan.pool_bytes()
    blocks = sum(s.num_gpu_blocks + s.num_host_blocks for s, _ in pools) + cross_blocks(wl)
    check_memory(wl, blocks * METADATA_BYTES_PER_BLOCK, "the cache manager's block metadata")
    if emit:
        gpu = sum(s.num_gpu_blocks * b for s, b in pools)
        host = sum(s.num_host_blocks * b for s, b in pools)
        gpu += cross_blocks(wl) * block_bytes(wl)  # the cross-attention pool's tensor
        _check_tensors(wl, gpu, host)
    return plan


def size_pools(wl: Workload, requests: list[Request] | SpilledTrace, *,
               emit_copy_ops: bool = False) -> RunPlan:
    """The pools alone, unchecked beyond what sizing them refuses (`_windowed_specs`)."""
    if is_windowed(wl):
        cycles, specs, draft_cycles, draft_specs = _windowed_specs(
            wl, requests, emit_copy_ops=emit_copy_ops)
        return RunPlan(wl, tuple(specs), tuple(cycles), tuple(draft_specs), draft_cycles)
    spec = cache_spec(wl, emit_copy_ops=emit_copy_ops)
    draft = (spec,) if wl.speculative.draft_model is not None else ()
    return RunPlan(wl, (spec,), None, draft)


def is_windowed(wl: Workload) -> bool:
    """Some layer (of the model or of its draft model) has a sliding window: one pool per
    life cycle (`cache/windows.py`), the draft's beside the target's (`cache/mirror.py`)."""
    d = wl.speculative.draft_model
    return any(w is not None for w in (*wl.model.layer_windows,
                                       *(d.layer_windows if d is not None else ())))


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
    """The target model's cache without sliding windows. With a draft model, the `max_tokens`
    byte budget holds a target block and its mirrored draft block per block (TensorRT-LLM
    sizes both caches with the per-token size of both models)."""
    c = workload.cache
    gpu_blocks = c.max_tokens // c.tokens_per_block - cross_blocks(workload)
    if workload.speculative.draft_model is not None:
        budget = gpu_blocks * block_bytes(workload)
        gpu_blocks = budget // (block_bytes(workload) + draft_block_bytes(workload))
    return pool_spec(workload, gpu_blocks, emit_copy_ops)


def pool_spec(workload: Workload, gpu_blocks: int, emit_copy_ops: bool,
              window: bool = False) -> CacheSpec:
    """The spec of one pool of `gpu_blocks` GPU blocks: the workload's policy and reuse
    rules, a host tier of `cache.host_offload_ratio` of its GPU blocks. A sliding `window`'s
    pool evicts LRU: the policies rank a release as a prefix chain, where a window block is
    useful with the blocks of its window alone, and with `swa_scratch_reuse` a window pool's
    release is only those (`workloads/swa-scratch.yaml`, variant `scratch`: `lru2` in the
    window pools 23 pp under LRU)."""
    c = workload.cache
    return CacheSpec(
        eviction_policy="lru" if window else c.eviction_policy,
        policy_params=None if window else policy_params(workload),
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


def cross_blocks(workload: Workload) -> int:
    """Blocks of the budget the cross-attention cache takes (`cache.cross_kv_cache_fraction`;
    a cross block holds the same layers and heads as a self-attention one)."""
    c = workload.cache
    return int(c.cross_kv_cache_fraction * (c.max_tokens // c.tokens_per_block))


def check_cross_fits(wl: Workload, requests: list[Request]) -> bool:
    """Whether requests carry encoder inputs; InputError when the longest one does not fit
    the cross-attention cache (`cache.cross_kv_cache_fraction`)."""
    longest = max((r.encoder.input_length for r in requests if r.encoder is not None),
                  default=0)
    c = wl.cache
    need, blocks = -(-longest // c.tokens_per_block), cross_blocks(wl)
    if need > blocks:
        raise InputError(
            f"{where(wl)}: cache.cross_kv_cache_fraction: an encoder input of {longest} tokens "
            f"needs {need} cross-attention blocks but the fraction "
            f"({c.cross_kv_cache_fraction}) of cache.max_tokens gives {blocks}")
    return longest > 0


def cross_manager(wl: Workload, requests: list[Request] | SpilledTrace
                  ) -> KVCacheManager | None:
    """The cross-attention cache for requests' encoder inputs (None when none has one, as
    a streamed trace never has): shared by a sequence's beams, never grown, no host tier; it
    emits copy ops for the data plane's cross pool when there is one."""
    if isinstance(requests, SpilledTrace) or not check_cross_fits(wl, requests):
        return None
    c = wl.cache
    tpb, blocks = c.tokens_per_block, cross_blocks(wl)
    return KVCacheManager(CacheSpec(
        tokens_per_block=tpb, num_gpu_blocks=blocks, enable_block_reuse=c.enable_block_reuse,
        enable_partial_reuse=c.enable_partial_reuse,
        copy_on_partial_reuse=c.copy_on_partial_reuse, cross_kv=True,
        emit_copy_ops=wl.run.backend != "none", strict_phase2=c.strict_phase2))


def _windowed_specs(wl: Workload, requests: list[Request] | SpilledTrace, *,
                    emit_copy_ops: bool = False
                    ) -> tuple[list[LifeCycle], list[CacheSpec], tuple[LifeCycle, ...] | None,
                               list[CacheSpec]]:
    """The pools of a model with sliding-window layers: one per life cycle, the GPU budget
    (`cache.max_tokens` tokens of the whole model, in bytes, less the cross-attention
    cache's share) split by `cache.window_memory_split` against the mean request context
    (the prompt in cache mode, prompt and output in serve mode), no pool below what the
    largest request needs to run alone (every beam and reserved token counted); each pool's
    host tier is `host_offload_ratio` of its GPU blocks. With a draft model (either model
    windowed) its life cycles' pools share the same budget, weighed by their bytes (as a
    draft block shares it with a target block without windows): returns the target's cycles
    and specs, then the draft's (None and none without a draft)."""
    c, m, d = wl.cache, wl.model, wl.speculative.draft_model
    tpb = c.tokens_per_block
    cycles = list(life_cycles(m.layer_windows))
    draft_cycles = life_cycles(d.layer_windows) if d is not None else ()
    per_layer = m.kv_bytes_per_token_per_layer
    # The cache's life cycles: the draft's after the target's, as it holds them.
    held = cycles + held_cycles(draft_cycles, m.num_layers)
    layer_bytes = ([per_layer] * len(cycles)
                   + [d.kv_bytes_per_token_per_layer] * len(draft_cycles)) if d else None
    slot_bytes = [tpb * cyc.num_layers * b
                  for cyc, b in zip(held, layer_bytes or [per_layer] * len(held))]
    reserve = wl.speculative.max_draft_len + wl.speculative.reserved_tokens
    if wl.run.mode == "serve":
        lengths = [r.input_length + max(r.output_length - 1, 0) for r in requests]
        floors = [max(_serve_blocks_bound(wl, cyc, r, n + reserve)
                      for r, n in zip(requests, lengths)) for cyc in held]
    else:
        lengths = [r.input_length for r in requests]
        floors = [max(prefill_blocks_bound(cyc, tpb, r.input_length, c.swa_scratch_reuse,
                                           r.beam_width) for r in requests)
                  for cyc in held]
    longest = max(lengths)
    mean = -(-sum(lengths) // len(lengths))
    budget = c.max_tokens * m.num_layers * per_layer - cross_blocks(wl) * block_bytes(wl)
    try:
        blocks = split_gpu_blocks(held, budget, slot_bytes, mean, policy=c.window_memory_split,
                                  min_blocks=floors, layer_bytes=layer_bytes)
    except ValueError:
        need = sum(f * b for f, b in zip(floors, slot_bytes)) + cross_blocks(wl) * block_bytes(wl)
        raise InputError(
            f"{where(wl)}: cache.max_tokens: the longest request ({longest} tokens) needs "
            f"{need} bytes of KV across the attention pools (every beam, reserved tokens"
            f"{', the draft model' if d else ''} and the cross-attention share counted) but "
            f"the cache holds {c.max_tokens * m.num_layers * per_layer}; raise "
            f"cache.max_tokens to at least {-(-need // (m.num_layers * per_layer))}"
        ) from None
    specs = [pool_spec(wl, n, emit_copy_ops, cyc.window is not None)
             for cyc, n in zip(held, blocks)]
    t = len(cycles)
    return cycles, specs[:t], (draft_cycles if d else None), specs[t:]


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


def check_fits(wl: Workload, requests: list[Request] | SpilledTrace, num_blocks: int) -> None:
    tpb = wl.cache.tokens_per_block
    if isinstance(requests, SpilledTrace):
        largest = requests.shape_of(requests.largest())
    else:
        largest = max(requests, key=lambda r: grow_blocks(tpb, r, 0, r.input_length))
    need = grow_blocks(tpb, largest, 0, largest.input_length)
    if need > num_blocks:
        raise InputError(
            f"{where(wl)}: cache.max_tokens: request {largest.id} needs {need} blocks "
            f"({largest.input_length} prompt tokens, {largest.beam_width} beam(s) at "
            f"tokens_per_block {tpb}) but the cache holds {num_blocks}; raise cache.max_tokens "
            f"to at least {need * tpb}")


def check_serve_fits(wl: Workload, requests: list[Request] | SpilledTrace,
                     num_blocks: int) -> None:
    """Every request must be able to finish alone: its stream's computed tokens in the cache
    and, without chunked prefill, its longest (recomputed) context in one step."""
    s, tpb = wl.scheduler, wl.cache.tokens_per_block

    def each() -> Iterable[Request]:  # a spilled trace's shapes: lengths without reading ids
        if isinstance(requests, SpilledTrace):
            return (requests.shape_of(i) for i in range(len(requests)))
        return requests
    if s.max_batch_size > s.max_num_tokens:
        raise InputError(
            f"{where(wl)}: scheduler.max_batch_size ({s.max_batch_size}) exceeds "
            f"scheduler.max_num_tokens ({s.max_num_tokens}): every running request decodes one "
            "token per step")
    if s.enable_chunked_prefill and s.max_num_tokens < tpb:
        raise InputError(
            f"{where(wl)}: scheduler.max_num_tokens ({s.max_num_tokens}) is below one chunk "
            f"of cache.tokens_per_block ({tpb}) tokens")
    sp = wl.speculative
    widest = max(r.beam_width for r in each()) * (1 + sp.max_draft_len)
    if s.max_batch_size * widest > s.max_num_tokens:
        raise InputError(
            f"{where(wl)}: scheduler.max_batch_size ({s.max_batch_size}) x the tokens one "
            f"request decodes per step ({widest}: beams x (1 + speculative.max_draft_len)) "
            f"exceeds scheduler.max_num_tokens ({s.max_num_tokens})")
    # A request holds KV for its prompt and all but its last generated token, in every beam.
    extra = sp.max_draft_len + sp.reserved_tokens

    def held(r: Request) -> int:
        return r.input_length + max(r.output_length - 1, 0) + extra

    largest = max(each(), key=lambda r: grow_blocks(tpb, r, 0, held(r)))
    need, length = grow_blocks(tpb, largest, 0, held(largest)), held(largest)
    # With a draft model each block of budget also pays for its draft block.
    least = -(-need * (block_bytes(wl) + draft_block_bytes(wl)) // block_bytes(wl)) * tpb
    if need > num_blocks:
        raise InputError(
            f"{where(wl)}: cache.max_tokens: request {largest.id} needs {need} blocks "
            f"({length} prompt, generated and reserved tokens, {largest.beam_width} beam(s) "
            f"at tokens_per_block {tpb}) but the cache holds {num_blocks}; raise "
            f"cache.max_tokens to at least {least}")
    largest = max(each(), key=held)
    length = held(largest) - extra
    if not s.enable_chunked_prefill and length > s.max_num_tokens:
        raise InputError(
            f"{where(wl)}: scheduler.max_num_tokens: request {largest.id} may need to "
            f"(re)compute {length} tokens in one step without chunked prefill; raise "
            f"scheduler.max_num_tokens to at least {length} or enable_chunked_prefill")


def check_supported(wl: Workload) -> None:
    unsupported = []
    if wl.run.mode == "serve" and is_windowed(wl):
        # A deferred chunk kept for a later step may compute a different range than its
        # scratch slots were chosen for.
        s = wl.scheduler
        if (wl.cache.swa_scratch_reuse and not s.revert_deferred_ctx
                and (s.batch_wait_timeout_iters or s.batch_wait_max_tokens_ratio)):
            unsupported.append("cache.swa_scratch_reuse with delay batching in run.mode: serve"
                               " unless scheduler.revert_deferred_ctx")
    sp = wl.speculative
    if sp.enabled:
        if wl.run.mode != "serve" and sp.draft_model is None:
            # Cache mode has no decode steps: only a draft model's cache changes what it does.
            unsupported.append("speculative decoding (speculative.*) without a draft_model "
                               "outside run.mode: serve")
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
            f"{where(wl)}: not supported by this kvbench build: {', '.join(unsupported)}")
    if wl.run.clock == "measured" and wl.run.mode != "serve":
        raise InputError(f"{where(wl)}: run.clock: measured times serve-mode steps; "
                         "set run.mode: serve (cache mode has no clock)")


METADATA_BYTES_PER_BLOCK = 512
"""Python memory the cache manager holds per block of either tier: about 240 bytes at rest
(measured), more once blocks carry prefix keys and tree nodes."""


def _check_tensors(wl: Workload, gpu_bytes: int, host_bytes: int) -> None:
    """The data plane's K/V tensors: the GPU tier on the GPU when there is one (else in host
    memory, as the host tier always is)."""
    import torch

    if torch.cuda.is_available():
        from .kernels.storage import free_gpu_bytes

        free = free_gpu_bytes()
        if gpu_bytes > free:
            raise InputError(
                f"{where(wl)}: run.backend {wl.run.backend}: the GPU tier's K/V tensors need "
                f"{gib(gpu_bytes)} ({gpu_bytes:,} bytes) but the GPU has {gib(free)} free; "
                "lower cache.max_tokens")
        check_memory(wl, host_bytes, "the host tier's K/V tensors")
    else:
        check_memory(wl, gpu_bytes + host_bytes, "the K/V tensors (on the CPU)")


_CACHE_HINT = "lower cache.max_tokens or cache.host_offload_ratio"


def check_memory(wl: Workload, need: int, what: str, hint: str = _CACHE_HINT) -> None:
    available = available_memory()
    if available is not None and need > available:
        raise InputError(
            f"{where(wl)}: {what} would take {gib(need)} ({need:,} bytes) but only "
            f"{gib(available)} is available to this process; {hint}")


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


def serve_clock(wl: Workload):
    """The serve loop's clock: measured, a calibrated profile's, or the preset's."""
    if wl.run.clock == "measured":
        return MeasuredClock()
    if wl.hardware.profile is not None:
        from .profile import load_profile, model_shape

        profile = load_profile(resolve_path(wl, wl.hardware.profile))
        profile.check_shape(model_shape(wl.model, wl.cache.tokens_per_block), where(wl))
        return ProfileClock(profile)
    return StepClock(wl.model, hardware_from_config(wl.hardware))


def host_link_ms(wl: Workload, nbytes: int) -> float:
    """Modeled host-link milliseconds for `nbytes` (`host_link_ms_modeled`): at the calibrated
    profile's figure when the workload names one (as its clock uses), else the preset's link."""
    if wl.hardware.profile is not None:
        from .profile import load_profile

        return nbytes * load_profile(resolve_path(wl, wl.hardware.profile)).link_ms_per_byte
    return nbytes / host_link_bytes_per_s(hardware_from_config(wl.hardware)) * 1e3


def where(wl: Workload) -> str:
    return str(wl.source_path) if wl.source_path is not None else wl.name


def gib(n: float) -> str:
    return f"{n / 2**30:,.1f} GiB" if n >= 2**30 else f"{n / 2**20:,.1f} MiB"
