"""What both mode runners share: opening the data plane over a run plan's pools, the reuse,
memory and host-traffic metrics every run reports, the ideal hit rate, the checked outcome."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from ..cache.manager import CacheSpec, KVCacheManager
from ..cache.protocol import CacheManager
from ..cache.windows import WindowedCacheManager
from ..config import PolicyConfig
from ..errors import InputError
from ..metrics import unregistered
from ..oracle import reference_hit_rates, streamed_reference_hit_rates
from ..plan import RunPlan, block_bytes, host_link_ms, where
from ..results import RunOutcome
from ..traffic import Request
from ..traffic.spill import SpilledTrace

ProgressFactory = Callable[[str, int], Callable[[int], None]]
"""(description, total) -> advance(n): how a run reports progress (a rich bar in the CLI)."""

T = TypeVar("T")


class Store:
    """Values kept across runs under keys: at most `max_entries` (None: no bound), the least
    recently used dropped first, handed to `release` (which frees what it holds: a spilled
    trace's file)."""

    __slots__ = ("_entries", "max_entries", "_release")

    def __init__(self, max_entries: int | None = None,
                 release: Callable[[object], None] | None = None) -> None:
        self._entries: OrderedDict[object, object] = OrderedDict()
        self.max_entries = max_entries
        self._release = release

    def once(self, key, compute: Callable[[], T]) -> T:
        """The value kept under `key`, else `compute()`, kept."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return self._entries[key]  # type: ignore[return-value]
        value = self._entries[key] = compute()
        if self.max_entries is not None and len(self._entries) > self.max_entries:
            self._drop(self._entries.popitem(last=False)[1])
        assert self._check_sanity()
        return value

    def clear(self) -> None:
        """Drop every value (released)."""
        while self._entries:
            self._drop(self._entries.popitem(last=False)[1])

    def __len__(self) -> int:
        return len(self._entries)

    def _drop(self, value: object) -> None:
        if self._release is not None:
            self._release(value)

    def _check_sanity(self) -> bool:
        assert self.max_entries is None or len(self._entries) <= self.max_entries
        return True


class References(Store):
    """Reference results (ideal, optimal and LRU hit rates) kept across runs, so runs that
    differ only in what a reference does not read compute it once. A key names the request
    stream (`StreamReferences.source`) and every input the reference reads; a value is a few
    numbers. At most `max_entries` are kept (None: no bound, for the variants of one
    workload, which its file counts)."""

    __slots__ = ()

    def __init__(self, max_entries: int | None = None) -> None:
        super().__init__(max_entries)

    def of(self, source: str) -> StreamReferences:
        """This store as the runs on the request stream `source` see it."""
        return StreamReferences(self, source)


@dataclass(frozen=True, slots=True)
class StreamReferences:
    """A `References` store seen from one request stream: `source` names the stream by where
    it came from (`runner.request_source`), so runs on equal requests share references even
    when each loaded its own request objects."""

    store: References
    source: str

    def once(self, key: tuple, compute: Callable[[], T]) -> T:
        return self.store.once((self.source, *key), compute)


def once(references: StreamReferences | None, key: tuple, compute: Callable[[], T]) -> T:
    """`compute()`, or the result kept under `key` in `references` (None: keep nothing)."""
    return compute() if references is None else references.once(key, compute)


def open_data_plane(plan: RunPlan, draft: bool = False, *, backend: str | None = None,
                    engine=None, cross: KVCacheManager | None = None):
    """The data plane for `run.backend` (None for `none`) over the plan's pools; torch is
    imported only here. `draft`: the draft model's, over its pools; a `cross` cache gets a
    pool of its own."""
    wl = plan.workload
    model = wl.speculative.draft_model if draft else wl.model
    backend = backend or wl.run.backend
    if backend == "none":
        return None
    from ..kernels.dataplane import open_data_plane as open_plane
    from ..kernels.step import BackendUnavailable, PoolSpec

    cross_pool = (None if cross is None else
                  PoolSpec(tuple(range(model.num_layers)), cross.spec.num_gpu_blocks))
    try:
        # A measured clock reads each step's time at once; otherwise the host runs ahead.
        return open_plane(model, plan.spec.tokens_per_block, plan.pool_specs(draft),
                          backend=backend, verify=wl.run.verify, seed=wl.run.seed,
                          engine=engine, lazy_times=engine is None, cross=cross_pool)
    except BackendUnavailable as exc:
        raise InputError(f"{where(wl)}: run.backend: {exc}") from None


def draft_plane_metrics(metrics: dict, draft_plane) -> None:
    """The draft model's data-plane checks, into a run's `metrics` (whose `verified` fails
    with the draft's, naming its first mismatch)."""
    d = draft_plane.metrics()
    metrics["draft_verified"] = d["verified"]
    metrics["draft_max_abs_err"] = d["max_abs_err"]
    if d["verified"] is False:
        metrics["verified"] = False
        metrics["verify_mismatch"] = "draft cache: " + d["verify_mismatch"]


MEASURED_OVERHEAD_BYTES = 2 << 30
"""GPU memory a measured run needs beside weights, KV cache and step buffers: the CUDA
context, cuBLAS and FlashInfer workspaces, captured graphs' pools."""


def open_measured_plane(plan: RunPlan):
    """The FlashInfer data plane with the engine's linear layers, for `run.clock: measured`;
    refuses (InputError, before allocating anything) when CUDA, FlashInfer or the memory for
    weights and cache is missing."""
    wl, spec = plan.workload, plan.spec
    here = where(wl)
    if wl.run.backend == "torch":
        raise InputError(f"{here}: run.clock: measured times FlashInfer attention; set "
                         "run.backend to flashinfer or auto (got torch)")
    import torch

    if not torch.cuda.is_available():
        raise InputError(f"{here}: run.clock: measured needs a CUDA GPU and torch sees none; "
                         "use run.clock: modeled (with hardware.profile for a calibrated card)")
    from ..kernels.engine import LinearShape, LinearWork
    from ..kernels.graphs import graph_bytes
    from ..kernels.step import ModelShape
    from ..kernels.storage import free_gpu_bytes, pool_bytes
    from ..profile import model_shape

    m = wl.model
    dims = model_shape(m, spec.tokens_per_block)
    shape = LinearShape(m.num_layers, dims["hidden_size"], m.num_q_heads * m.head_dim,
                        m.num_kv_heads * m.head_dim, dims["intermediate_size"])
    kv_shape = ModelShape.of(m, spec.tokens_per_block)
    cache = sum(pool_bytes(kv_shape, p) for p in plan.pool_specs())
    mnt = wl.scheduler.max_num_tokens
    step = shape.activation_bytes(mnt) + 2 * m.num_layers * mnt * (
        2 * shape.kv + shape.q)
    graphs = sum(graph_bytes(kv_shape, len(p.layers), wl.scheduler.max_batch_size)
                 for p in plan.pool_specs())
    need = shape.weight_bytes + cache + step + graphs + MEASURED_OVERHEAD_BYTES
    free = free_gpu_bytes()
    if need > free:
        gib = 1 << 30
        raise InputError(
            f"{here}: run.clock: measured needs {need:,} bytes ({need / gib:.1f} GiB) on the "
            f"GPU: weights {shape.weight_bytes / gib:.1f} GiB, KV cache {cache / gib:.1f} GiB, "
            f"step buffers, graphs and workspaces "
            f"{(step + graphs + MEASURED_OVERHEAD_BYTES) / gib:.1f} GiB; "
            f"{torch.cuda.get_device_name()} has {free / gib:.1f} GiB free: lower "
            "cache.max_tokens or scheduler.max_num_tokens")
    if wl.run.backend == "auto":
        from ..kernels.flashinfer_backend import flashinfer_problem

        problem = flashinfer_problem(m.dtype)
        if problem:
            raise InputError(f"{here}: run.clock: measured: {problem}")
    engine = LinearWork(shape, torch.device("cuda"), wl.scheduler.max_batch_size, wl.run.seed)
    return open_data_plane(plan, backend="flashinfer", engine=engine)


def prompt_tokens(requests: list[Request] | SpilledTrace) -> int:
    """The prompt tokens of a run's requests (`hit_rate`'s denominator)."""
    return (requests.prompt_tokens if isinstance(requests, SpilledTrace)
            else sum(r.input_length for r in requests))


def is_lru(wl: Workload) -> bool:
    """Whether the workload runs as the engines do: LRU eviction, every block admitted."""
    return wl.cache.eviction_policy == "lru" and wl.cache.admission == "all"


def lru_workload(wl: Workload) -> Workload:
    """The workload with LRU eviction and admission of all (TensorRT-LLM's behaviour), the
    reference `lru_hit_rate` runs; the policies' parameters at their defaults, as LRU reads
    none of them."""
    return wl.model_copy(update={"cache": wl.cache.model_copy(
        update={"eviction_policy": "lru", "admission": "all", "policy": PolicyConfig()})})


def cache_metrics(
    wl: Workload, manager: CacheManager, requests: list[Request] | SpilledTrace,
    reused: int, reused_host: int, reused_partial: int,
) -> dict:
    """Reuse, memory and host-traffic metrics of a run in either mode, with one pool or one
    per attention life cycle. Host-link time is modeled: bytes at the figure the serve clock
    uses (`plan.host_link_ms`)."""
    prompt = prompt_tokens(requests)
    onboard_bytes, offload_bytes = manager.moved_bytes(block_bytes(wl))
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
        "host_link_ms_modeled": host_link_ms(wl, onboard_bytes + offload_bytes),
        "host_evicted_blocks": manager.host_evicted_blocks,
        "partial_copy_blocks": manager.partial_copy_blocks,
        "phase2_alloc_failures": manager.phase2_alloc_failures,
    }


def ideal_reference(requests: list[Request] | SpilledTrace, plan: RunPlan, *, serve: bool,
                    references: StreamReferences | None) -> float:
    """`ideal_hit_rate`, kept in `references` under all it reads: the mode, the block size,
    the reuse rules and the life cycles (not the capacity, the policy or the scheduler)."""
    spec = plan.spec
    key = ("ideal", serve, spec.tokens_per_block, spec.enable_block_reuse,
           spec.enable_partial_reuse, spec.copy_on_partial_reuse, plan.cycles)
    return once(references, key, lambda: ideal_hit_rate(requests, plan, serve=serve))


def ideal_hit_rate(requests: list[Request] | SpilledTrace, plan: RunPlan, *,
                   serve: bool) -> float:
    """An unlimited cache with the run's reuse rules replaying the requests in order, each
    storing its prompt (in serve mode, and its generated blocks) before the next. With sliding
    windows it has the run's life cycles and window rules (a request reuses up to any end
    whose window blocks are stored), keeping every block, so it bounds the run's hit rate:
    a prefix-only ideal does not (with a window of 1 every end is served). A partial match is
    copied, never taken in place: replayed one at a time, a request would overwrite a stored
    block that, in a run, a concurrent one holds and so keeps. Generated tokens
    the traffic does not know are unique to their request, so without windows and without
    known answers only prompts matter and the oracle answers (a spilled trace has none)."""
    spec, cycles = plan.spec, plan.cycles
    tpb = spec.tokens_per_block
    if isinstance(requests, SpilledTrace):
        return streamed_reference_hit_rates(
            requests, tpb, None, partial_reuse=spec.enable_partial_reuse,
            block_reuse=spec.enable_block_reuse).ideal_hit_rate
    if cycles is None and (not serve or all(r.output_tokens is None for r in requests)):
        return reference_hit_rates(
            requests, tpb, None, partial_reuse=spec.enable_partial_reuse,
            block_reuse=spec.enable_block_reuse).ideal_hit_rate
    computed = [max(r.input_length, r.stream_length - 1) if serve else r.input_length
                for r in requests]
    # Every block each request could hold, each beam's own ones included (beams share only the
    # full context blocks): nothing is ever evicted.
    unlimited = CacheSpec(
        tpb, sum(-(-n // tpb) * r.beam_width for r, n in zip(requests, computed)) + 1,
        enable_block_reuse=spec.enable_block_reuse,
        enable_partial_reuse=spec.enable_partial_reuse,
        copy_on_partial_reuse=spec.copy_on_partial_reuse, take_partial_in_place=False)
    # Out-of-window blocks stay cached and no scratch slot replaces one: keeping every block
    # is what makes it a bound (scratch slots and `drop` only store less; a run's chunked
    # prefill may store blocks a one-step replay with scratch would not).
    manager = (KVCacheManager(unlimited) if cycles is None else
               WindowedCacheManager(list(cycles), [unlimited] * len(cycles)))
    reused = 0
    for r, n in zip(requests, computed):
        seq = manager.add_sequence(r.view(r.input_length) if serve else r)
        fits = manager.resize(seq, n)
        assert fits, "the unlimited cache ran out of blocks"
        manager.commit(seq, n)
        manager.release(seq)
        reused += seq.reused_tokens
    return reused / sum(r.input_length for r in requests)


def outcome(name: str, wl: Workload, metrics: dict, timeline: dict) -> RunOutcome:
    # A metric the registry does not know would reach no table, no compare rule, no schema.
    assert not unregistered(metrics), f"unregistered metrics: {unregistered(metrics)}"
    return RunOutcome(name, wl, metrics, timeline)


def phase(progress: ProgressFactory | None, description: str) -> Callable[[int], None]:
    """A one-step progress task naming a phase with no count of its own."""
    return progress(description, 1) if progress is not None else (lambda n: None)
