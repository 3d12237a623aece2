"""The data plane: real K/V in paged tensors, driven only by what `cache/` emits.

Wiring it into an engine loop (cache mode does this per request, serve mode per iteration)::

    plane = open_data_plane(workload.model, tokens_per_block, pools, backend="auto",
                            verify=workload.run.verify, seed=workload.run.seed)
    ...  # the cache manager runs with CacheSpec(emit_copy_ops=True)
    # per step, after add/resize of every scheduled sequence, before commit:
    ops = list(manager.copy_ops); manager.copy_ops.clear()
    check = plane.execute_step(ops, [
        StepItem(req.id, sequence_tokens(req, end), seq.blocks, start, end)
        for req, seq, start, end in scheduled])  # [start, end): the chunk, or one decode token
    ...
    metrics.update(plane.metrics())

`execute_step` first runs the step's copy ops (so onboarded and partially copied blocks hold
their data), then, pool by pool and layer by layer, writes the K/V of every computed token
into the sequence's pages, runs attention for every computed token over the paged cache and,
when the step is checked, compares with dense recomputation (`verify.py`).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import torch

from ..cache.ids import CopyOp
from .attention import PagedBatch, TorchBackend
from .copies import CopyExecutor
from .model import SyntheticModel
from .step import BackendUnavailable, Mismatch, ModelShape, PoolSpec, StepCheck, StepItem
from .storage import QUERY_DTYPES, STORAGE_DTYPES, make_pools
from .verify import Verifier

VERIFY_MODES = ("all", "sample", "off")
SAMPLE_RATE = 1 / 8
"""Share of steps checked with `verify: sample` (drawn from the run's seed)."""


def resolve_backend(requested: str, dtype: str) -> str:
    """`torch` or `flashinfer` for a `run.backend` value other than `none`: `auto` takes
    FlashInfer when CUDA, the package and a FlashInfer dtype are all there."""
    if requested == "torch":
        return "torch"
    from .flashinfer_backend import flashinfer_problem

    problem = flashinfer_problem(dtype)
    if requested == "auto":
        return "torch" if problem else "flashinfer"
    if requested != "flashinfer":
        raise ValueError(f"unknown backend {requested!r}")
    if problem:
        raise BackendUnavailable(problem)
    return "flashinfer"


def open_data_plane(model, tokens_per_block: int, pools: Sequence[PoolSpec], *,
                    backend: str = "auto", verify: str = "all", seed: int = 0) -> DataPlane:
    """A data plane for the workload's `model:` section; raises BackendUnavailable when the
    backend asked for cannot run here."""
    shape = ModelShape.of(model, tokens_per_block)
    name = resolve_backend(backend, shape.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DataPlane(shape, pools, backend=name, device=device, verify=verify, seed=seed)


class DataPlane:
    """Paged K/V tensors per pool, the copy executor, the synthetic model, one attention
    backend and the verifier; `execute_step` is its whole per-step interface."""

    def __init__(self, shape: ModelShape, pools: Sequence[PoolSpec], *, backend: str = "torch",
                 device: torch.device | str = "cpu", verify: str = "all", seed: int = 0) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}")
        self.shape = shape
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # A step's CPU ops are small: intra-op threads cost more in hand-offs than they
            # save (measured 20-30x slower gathers and matmuls with 2 threads on 2-core hosts).
            torch.set_num_threads(1)
        self.pools = make_pools(shape, pools, self.device)
        self.copier = CopyExecutor(self.pools, self.device)
        self.model = SyntheticModel(shape, seed, self.device)
        if backend == "torch":
            self.backend = TorchBackend()
        elif backend == "flashinfer":
            from .flashinfer_backend import FlashInferBackend

            self.backend = FlashInferBackend(shape, self.device)
        else:
            raise ValueError(f"unknown backend {backend!r}")
        self.verify = verify
        self.verifier = Verifier(self.model, shape.dtype,
                                 lambda pool, block: self.copier.origin[pool].get(block))
        self._sampler = random.Random(seed)
        self._timed = self.device.type == "cuda"
        self._kv_dtype = STORAGE_DTYPES[shape.dtype]
        self._q_dtype = QUERY_DTYPES[shape.dtype]
        self.steps = 0
        self.verified_steps = 0
        self.max_abs_err = 0.0
        self.first_mismatch: Mismatch | None = None
        self.copied_blocks = 0
        self.copy_bytes = 0
        self.attention_ms = 0.0
        self.write_ms = 0.0
        self.copy_ms = 0.0

    def execute_step(self, copy_ops: Sequence[CopyOp] | Mapping[int, Sequence[CopyOp]],
                     items: Sequence[StepItem]) -> StepCheck:
        """Run one engine step.

        `copy_ops`: the step's copy ops in emission order, for pool 0, or `{pool: ops}` with
        several pools (block ids are per pool). `items`: one `StepItem` per sequence (and
        pool) that computes tokens this step; a one-token item (decode) runs the decode
        kernel, any other the causal prefill kernel. Raises ValueError for a page table that
        cannot serve its item (a block missing, an id outside the pool): that is a caller bug,
        not a data mismatch.
        """
        step = self.steps
        self.steps += 1
        check = self.verify == "all" or (self.verify == "sample"
                                          and self._sampler.random() < SAMPLE_RATE)
        timer = _Timer(self._timed)
        by_pool = copy_ops if isinstance(copy_ops, Mapping) else {0: copy_ops}
        copied = copy_bytes = 0
        with timer.span("copy"):
            for pool, ops in by_pool.items():
                n = self.copier.run(pool, ops, step)
                copied += n
                copy_bytes += n * self.pools[pool].slot_bytes
        worst = 0.0
        mismatch = None
        for pool, batch in self._batches(items):
            tensors = self.pools[pool]
            kv = tensors.gpu
            rows = self.model.rows(batch.new_tokens, batch.new_positions)
            self.backend.plan(batch)
            if check:
                self.verifier.begin(batch)
            for local, layer in enumerate(tensors.spec.layers):
                k, v, q = self.model.qkv(rows, layer)
                k, v, q = k.to(self._kv_dtype), v.to(self._kv_dtype), q.to(self._q_dtype)
                with timer.span("write"):
                    self.backend.write(kv, batch, local, k, v)
                with timer.span("attention"):
                    out = self.backend.run(kv, batch, local, q)
                if check:
                    err, found = self.verifier.check(step, kv, batch, pool, local, layer, q, out)
                    worst = max(worst, err)
                    mismatch = mismatch or found
        times = timer.totals()
        self.copied_blocks += copied
        self.copy_bytes += copy_bytes
        if times is not None:
            self.copy_ms += times["copy"]
            self.write_ms += times["write"]
            self.attention_ms += times["attention"]
        if check:
            self.verified_steps += 1
            self.max_abs_err = max(self.max_abs_err, worst)
            self.first_mismatch = self.first_mismatch or mismatch
        return StepCheck(
            step=step, verified=(mismatch is None) if check else None,
            max_abs_err=worst if check else None, mismatch=mismatch, copied_blocks=copied,
            copy_bytes=copy_bytes,
            attention_ms=times["attention"] if times else None,
            write_ms=times["write"] if times else None,
            copy_ms=times["copy"] if times else None)

    def metrics(self) -> dict:
        """Run-level metrics for the result JSON (`verified` is None when no step was
        checked); times only on CUDA, where they are measured, with `time_source: measured`
        (a loop whose step times still come from a modeled clock must keep its own label)."""
        checked = self.verified_steps > 0
        out = {
            "verified": (self.first_mismatch is None) if checked else None,
            "max_abs_err": self.max_abs_err if checked else None,
            "verify_mismatch": str(self.first_mismatch) if self.first_mismatch else None,
            "data_plane_backend": self.backend.name,
            "data_plane_steps": self.steps,
            "verified_steps": self.verified_steps,
            "copy_bytes": self.copy_bytes,
        }
        if self._timed:
            out.update({
                "time_source": "measured",
                "attention_ms": self.attention_ms,
                "kv_write_ms": self.write_ms,
                "copy_ms": self.copy_ms,
                "copy_gb_per_s": (self.copy_bytes / self.copy_ms / 1e6
                                  if self.copy_bytes and self.copy_ms else None),
            })
        return out

    def _batches(self, items: Sequence[StepItem]):
        by_pool: dict[int, tuple[list[StepItem], list[StepItem]]] = {}
        for it in items:
            if not 0 <= it.pool < len(self.pools):
                raise ValueError(f"request {it.request_id}: no pool {it.pool}")
            ctx, dec = by_pool.setdefault(it.pool, ([], []))
            (dec if it.end - it.start == 1 else ctx).append(it)
        tpb = self.shape.tokens_per_block
        for pool, (ctx, dec) in by_pool.items():
            for group, decode in ((ctx, False), (dec, True)):
                if group:
                    yield pool, PagedBatch(group, self.pools[pool], tpb, self.device,
                                           decode=decode)


class _Timer:
    """Sums CUDA-event spans per name; a no-op on CPU, where kvbench reports no times."""

    __slots__ = ("enabled", "_spans")

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self._spans: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    def span(self, name: str) -> _Span:
        return _Span(self, name)

    def totals(self) -> dict[str, float] | None:
        if not self.enabled:
            return None
        torch.cuda.synchronize()
        out = {"copy": 0.0, "write": 0.0, "attention": 0.0}
        for name, start, end in self._spans:
            out[name] += start.elapsed_time(end)
        return out


class _Span:
    __slots__ = ("timer", "name", "start")

    def __init__(self, timer: _Timer, name: str) -> None:
        self.timer = timer
        self.name = name

    def __enter__(self) -> None:
        if self.timer.enabled:
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()

    def __exit__(self, *exc) -> None:
        if self.timer.enabled:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.timer._spans.append((self.name, self.start, end))
