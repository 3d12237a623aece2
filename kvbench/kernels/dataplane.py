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

Encoder-decoder models get a cross pool (`open_data_plane(..., cross=PoolSpec(...))`, every
layer, block ids of the cross-attention cache): a request's first step writes its encoder
K/V there (`execute_step(..., encoder=[StepItem(...)])`, positions past what it reused), and
every step item with `cross=CrossKV(encoder tokens, cross blocks)` also attends to all of it,
non-causally (`attention.CrossBatch`, one batch per decoder batch, every layer at once). The
verifier checks those pages bit for bit against the encoder's K/V generator and the
cross-attention output against dense recomputation.
    metrics.update(plane.metrics())

`execute_step` builds the step's page tables (one batch per pool and kind: context or decode,
every layer of the pool in it), computes the synthetic Q/K/V of every layer in one vectorised
call per batch and plans the attention, all before the step's timed span; then it runs the
step's copy ops on their own stream (so onboarded and partially copied blocks hold their
data), the engine's linear layers when a measured clock asked for them (`engine.LinearWork`),
waits for the copies, writes the K/V of every layer in one scatter per batch, runs attention
for every layer in one planned call per batch and, when the step is checked, compares with
dense recomputation (`verify.py`). Python work per step is per batch, never per layer.

On CUDA, a decode batch (one token per sequence, no scratch pages) replays CUDA graphs
instead (`graphs.py`): its Q/K/V and write rows in one replay during preparation, its K/V
write in one replay in the timed span, bit for bit what the eager calls give.

On CUDA, events around the step's phases (not around each call) give its measured GPU times:
copies, linear layers, K/V writes, attention, and the whole step (`StepCheck.step_ms`), which
a measured clock takes as the step's duration. FlashInfer's JIT modules are built when the
plane opens (`FlashInferBackend.warm_up`), before anything is timed.
"""

from __future__ import annotations

import random
import time
from collections import deque
from collections.abc import Mapping, Sequence
from functools import partial

import torch

from ..cache.ids import CopyOp
from .attention import CrossBatch, PagedBatch, scatter_kv, write_kv
from .copies import CopyExecutor
from .graphs import DecodeGraphs
from .model import ENCODER_SEED, SyntheticModel
from .reference import TorchBackend
from .staging import Upload, ring
from .step import BackendUnavailable, Mismatch, ModelShape, PoolSpec, StepCheck, StepItem
from .storage import QUERY_DTYPES, STORAGE_DTYPES, PoolTensors, make_pools
from .verify import Check, Verifier, settle

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
                    backend: str = "auto", verify: str = "all", seed: int = 0,
                    engine=None, lazy_times: bool = False,
                    cross: PoolSpec | None = None) -> DataPlane:
    """A data plane for the workload's `model:` section; raises BackendUnavailable when the
    backend asked for cannot run here. `engine` (a `LinearWork`) adds the engine's linear
    layers to every step's timed work (a measured clock, which needs each step's time at
    once); `lazy_times` lets the host run ahead of the GPU when nobody does. `cross`: the
    cross-attention pool of an encoder-decoder model (every layer)."""
    shape = ModelShape.of(model, tokens_per_block)
    name = resolve_backend(backend, shape.dtype)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return DataPlane(shape, pools, backend=name, device=device, verify=verify, seed=seed,
                     engine=engine, lazy_times=lazy_times, cross=cross)


class DataPlane:
    """Paged K/V tensors per pool, the copy executor, the synthetic model, one attention
    backend and the verifier; `execute_step` is its whole per-step interface. With a `cross`
    pool, its tensors come last in `pools` (index `cross_pool`, the key of its copy ops)."""

    def __init__(self, shape: ModelShape, pools: Sequence[PoolSpec], *, backend: str = "torch",
                 device: torch.device | str = "cpu", verify: str = "all", seed: int = 0,
                 engine=None, lazy_times: bool = False, cross: PoolSpec | None = None) -> None:
        if verify not in VERIFY_MODES:
            raise ValueError(f"verify must be one of {VERIFY_MODES}")
        self.shape = shape
        self.device = torch.device(device)
        if self.device.type == "cpu":
            # A step's CPU ops are small: intra-op threads cost more in hand-offs than they
            # save (measured 20-30x slower gathers and matmuls with 2 threads on 2-core hosts).
            torch.set_num_threads(1)
        self.pools = make_pools(shape, pools, self.device)
        self.num_decoder_pools = len(self.pools)
        self.cross_pool: int | None = None
        if cross is not None:
            if cross.layers != tuple(range(shape.num_layers)) or cross.window is not None:
                raise ValueError("the cross pool holds every layer, with no window")
            self.cross_pool = len(self.pools)
            self.pools.append(PoolTensors(shape, cross, self.device))
        self._timed = self.device.type == "cuda"
        self.copy_stream, self.stream = self._open_streams()
        self.copier = CopyExecutor(self.pools, self.device)
        self.model = SyntheticModel(shape, seed, self.device)
        self._kv_dtype = STORAGE_DTYPES[shape.dtype]
        self._q_dtype = QUERY_DTYPES[shape.dtype]
        self.graphs = (DecodeGraphs(self.model, self._kv_dtype, self._q_dtype, self.device)
                       if self._timed else None)
        self.backend = self._open_backend(backend, cross is not None)
        if engine is not None and not self._timed:
            raise ValueError("the engine's linear layers run only on CUDA")
        self.engine = engine
        self.verify = verify
        self._open_verifiers(seed, cross is not None)
        self._sampler = random.Random(seed)
        self.steps = 0
        self.verified_steps = 0
        self.max_abs_err = 0.0
        self.first_mismatch: Mismatch | None = None
        self.copied_blocks = 0
        self.copy_bytes = 0
        self.times = dict.fromkeys(PHASES, 0.0)
        """Summed measured GPU ms per phase (CUDA only)."""
        self.host_s = 0.0
        """Host time spent issuing steps (everything but waiting for the GPU), decode graphs'
        captures included (`metrics` leaves them out: once per size, like a JIT compile)."""
        self.wall_s = 0.0
        self.lazy_times = lazy_times and self._timed
        """Read a step's CUDA events later, so that the host prepares the next step while the
        GPU runs this one (its StepCheck then carries no times; `metrics` has them all).
        Plans alternate between two sets of wrappers, and a step waits for the one two steps
        back before planning: FlashInfer stages each plan in a pinned buffer of its wrapper,
        which must not be rewritten before the GPU copied it."""
        self._pending: deque[_Marks] = deque()
        self._free_marks: list[_Marks] = []
        """Event sets whose times were read, reused (at most three exist: two pending)."""

    def _open_verifiers(self, seed: int, cross: bool) -> None:
        """The verifier, and with a `cross` pool the encoder's K/V generator and verifier."""
        # Not through `self`: the verifier would hold the plane in a cycle, and its tensors
        # (gigabytes of K/V on a GPU) would wait for the cyclic garbage collector.
        copied_from = self.copier.origin
        origin = lambda pool, block: copied_from[pool].get(block)  # noqa: E731
        dtype = self.shape.dtype
        self.verifier = Verifier(self.model, dtype, origin)
        self.cross_model = self.cross_verifier = None
        if cross:
            self.cross_model = SyntheticModel(self.shape, seed + ENCODER_SEED, self.device)
            self.cross_verifier = Verifier(self.cross_model, dtype, origin, "cross ")

    def _open_streams(self):
        """(copy stream, compute stream) on CUDA, with the staging ring pinned; (None, None)
        on a CPU. The compute stream is looked up once: each lookup builds a Stream object
        (tens of microseconds of host time a step), and nothing in a run makes another one
        current."""
        if not self._timed:
            return None, None
        ring(self.device).reserve()
        return torch.cuda.Stream(self.device), torch.cuda.current_stream(self.device)

    def _open_backend(self, backend: str, cross: bool):
        """The attention backend; FlashInfer's kernels are compiled and planned once here
        (warm-up), for every pool's window and the cross pool."""
        if backend == "torch":
            return TorchBackend()
        if backend == "flashinfer":
            from .flashinfer_backend import FlashInferBackend

            fi = FlashInferBackend(self.shape, self.device)
            fi.warm_up([p.spec.window for p in self.pools[:self.num_decoder_pools]],
                       cross=cross)
            return fi
        raise ValueError(f"unknown backend {backend!r}")

    # Inference mode: no tensor here needs autograd, and skipping its dispatch saves a few
    # microseconds on each of a step's few dozen torch calls.
    @torch.inference_mode()
    def execute_step(self, copy_ops: Sequence[CopyOp] | Mapping[int, Sequence[CopyOp]],
                     items: Sequence[StepItem], encoder: Sequence[StepItem] = ()) -> StepCheck:
        """Run one engine step.

        `copy_ops`: the step's copy ops in emission order, for pool 0, or `{pool: ops}` with
        several pools (block ids are per pool). `items`: one `StepItem` per sequence (and
        pool) that computes tokens this step; a one-token item (decode) runs the decode
        kernel, any other the causal prefill kernel. Raises ValueError for a page table that
        cannot serve its item (a block missing, an id outside the pool): that is a caller bug,
        not a data mismatch. `encoder`: the encoder inputs whose cross K/V this step writes,
        as items of the cross pool (encoder tokens, cross blocks, positions `[start, end)`:
        past what the input reused); an item with `cross` attends to it after the writes.
        """
        t_start = time.perf_counter()
        step = self.steps
        self.steps += 1
        while len(self._pending) >= 2:
            self._add_times(self._read_marks(self._pending.popleft()))
        t0 = time.perf_counter()
        buffer = step % 2 if self.lazy_times else 0
        check = self.verify == "all" or (self.verify == "sample"
                                          and self._sampler.random() < SAMPLE_RATE)
        by_pool = copy_ops if isinstance(copy_ops, Mapping) else {0: copy_ops}
        for pool, ops in by_pool.items():
            self.copier.check(pool, ops)
        stream = self.stream
        writes, layered, attend, tokens = self._prepare(items, encoder, buffer, stream)
        if self.engine is not None:
            self.engine.prepare(tokens)
        marks = self._marks(stream)
        copied, copy_bytes = self._copy(by_pool, step, marks, stream)
        if self.engine is not None:
            self.engine.run(tokens)
        if marks is not None:
            marks.linear.record(stream)
            if copied:
                stream.wait_event(marks.copy)
        for write in writes:
            write()
        if marks is not None:
            marks.write.record(stream)
        # Layered batches write before any whole batch attends: a beam's own item may read
        # the shared context its beam 0 writes this step from a batch with scratch pages.
        checks = self._run_layered(layered, step, buffer, check)
        outs = [self.backend.run(kv, batch, q, plan) for _, _, kv, batch, _, q, plan in attend]
        if marks is not None:
            marks.attention.record(stream)
        self.host_s += time.perf_counter() - t0
        times = None
        if marks is not None and self.lazy_times:
            self._pending.append(marks)
        elif marks is not None:
            times = self._read_marks(marks)
        if check:
            checks += [verifier.check(step, kv, batch, pool, layers, q, out)
                       for (verifier, pool, kv, batch, layers, q, _), out in zip(attend, outs)]
        return self._finish_step(step, checks if check else None, times, copied, copy_bytes,
                                 t_start)

    def _copy(self, by_pool: Mapping[int, Sequence[CopyOp]], step: int, marks: _Marks | None,
              stream) -> tuple[int, int]:
        """Run the step's copy ops (on CUDA on the copy stream, from the step's start, and
        marked at their end); returns (blocks, bytes) moved."""
        copied = copy_bytes = 0
        if marks is not None and not any(by_pool.values()):
            # A step without copies (most decode steps) spends no host time on the copy
            # stream: its copy span ends where it starts.
            marks.copy.record(stream)
            return copied, copy_bytes
        if marks is not None:
            self.copy_stream.wait_event(marks.start)
            torch.cuda.set_stream(self.copy_stream)
        try:
            for pool, ops in by_pool.items():
                n = self.copier.run(pool, ops, step)
                copied += n
                copy_bytes += n * self.pools[pool].slot_bytes
        finally:
            if marks is not None:
                marks.copy.record(self.copy_stream)
                torch.cuda.set_stream(stream)
        return copied, copy_bytes

    def _marks(self, stream) -> _Marks | None:
        """The step's phase events (None on CPU), a free set reused, its start recorded."""
        if not self._timed:
            return None
        marks = self._free_marks.pop() if self._free_marks else _Marks()
        marks.start.record(stream)
        return marks

    def _read_marks(self, marks: _Marks) -> dict[str, float]:
        """A step's phase times (waits for its events); its events are free again."""
        times = marks.totals()
        self._free_marks.append(marks)
        return times

    def _finish_step(self, step: int, checks: list | None, times: dict | None, copied: int,
                     copy_bytes: int, t_start: float) -> StepCheck:
        """`execute_step`'s end: settle the step's queued checks (`None`: not verified), add
        the step to the run's totals and report it."""
        worst, mismatch = 0.0, None
        if checks is not None:
            worst, mismatch = settle(checks)
            self.verified_steps += 1
            self.max_abs_err = max(self.max_abs_err, worst)
            self.first_mismatch = self.first_mismatch or mismatch
        self.copied_blocks += copied
        self.copy_bytes += copy_bytes
        self._add_times(times)
        self.wall_s += time.perf_counter() - t_start
        check = checks is not None
        t = times or {}
        return StepCheck(
            step=step, verified=(mismatch is None) if check else None,
            max_abs_err=worst if check else None, mismatch=mismatch, copied_blocks=copied,
            copy_bytes=copy_bytes, attention_ms=t.get("attention"), write_ms=t.get("write"),
            copy_ms=t.get("copy"), linear_ms=t.get("linear"), step_ms=t.get("step"))

    def _prepare(self, items: Sequence[StepItem], encoder: Sequence[StepItem], buffer: int,
                 stream):
        """The step's untimed preparation: page tables, the synthetic model's Q/K/V (an
        engine's linear layers produce them; those are timed instead), attention plans. Every
        batch's tables and the plans' host tables go up in one copy (`staging.Upload`). A
        batch with scratch pages runs layer by layer (every layer reuses the scratch page),
        planned and, when checked, verified between layers. Returns `writes`: calls that
        write a batch's K/V; `layered`: (pool, batch, K/V, q); `attend`: (verifier, pool,
        tensor, batch, layers, q, plan), cross-attention batches (`CrossBatch`) among them;
        and the tokens pool 0 computes (the engine's linear layers run on them). A decode
        batch on CUDA replays its captured graphs (`graphs.py`): the preparation now, the
        write when it is called."""
        writes, layered, attend = [], [], []
        tokens = 0
        upload = Upload(self.device)
        enc = self._encoder_batch(encoder, upload) if encoder else None
        batches = list(self._batches(items, upload))
        tables: list[list[torch.Tensor] | None] = [None] * len(batches)
        for i, (_, batch) in enumerate(batches):
            host = None if batch.has_scratch else self.backend.plan_tables(batch)
            if host is not None:
                upload.add(host, lambda views, i=i: tables.__setitem__(i, views), host=True)
        upload.send()
        if enc is not None:
            writes.append(self._encoder_writes(enc))
        for (pool, batch), planned in zip(batches, tables):
            tensors = self.pools[pool]
            layers = tensors.spec.layers
            if self.graphs is not None and self.graphs.takes(batch):
                new_kv, q, write = self.graphs.prepare(pool, tensors, batch)
            else:
                new_kv, q = self.model.qkv_all(batch.rows, layers, self._kv_dtype,
                                               self._q_dtype)
                # Expands the write rows here, untimed (a layered batch's slices read them).
                write = _writer(tensors.gpu, batch, new_kv)
            if batch.has_scratch:
                layered.append((pool, batch, new_kv, q))
            else:
                writes.append(write)
                attend.append((self.verifier, pool, tensors.gpu, batch, layers, q,
                               self.backend.plan(pool, batch, buffer, planned)))
            if CrossBatch.wanted(batch):
                attend.append(self._cross_attention(pool, batch, layers, q, buffer))
            if pool == 0:
                tokens += len(batch.new_tokens)
        # Every copy reading the upload's slot (the batches', the plans') is queued.
        upload.release(stream)
        return writes, layered, attend, tokens

    def _run_layered(self, layered: list, step: int, buffer: int, check: bool) -> list[Check]:
        """Write and attend the batches with scratch pages one layer at a time, each layer's
        check queued after it ran when `check` (the next layer reuses the scratch page).
        Returns the queued checks."""
        checks = []
        for pool, batch, new_kv, q in layered:
            tensors = self.pools[pool]
            for local, layer in enumerate(tensors.spec.layers):
                part = batch.layer_slice(local)
                write_kv(tensors.gpu, part, new_kv[local:local + 1])
                out = self.backend.run(tensors.gpu, part, q[local:local + 1],
                                       self.backend.plan(pool, part, buffer))
                if check:
                    checks.append(self.verifier.check(step, tensors.gpu, part, pool, (layer,),
                                                      q[local:local + 1], out))
        return checks

    def _add_times(self, times: dict[str, float] | None) -> None:
        if times is not None:
            for name in PHASES:
                self.times[name] += times[name]

    def metrics(self) -> dict:
        """Run-level metrics for the result JSON (`verified` is None when no step was
        checked); kernel times only on CUDA, where they are measured, with
        `time_source: measured` (a serve loop sets the label of its own clock)."""
        while self._pending:
            self._add_times(self._read_marks(self._pending.popleft()))
        checked = self.verified_steps > 0
        host_s = self.host_s - (self.graphs.capture_s if self.graphs is not None else 0.0)
        out = {
            "verified": (self.first_mismatch is None) if checked else None,
            "max_abs_err": self.max_abs_err if checked else None,
            "verify_mismatch": str(self.first_mismatch) if self.first_mismatch else None,
            "data_plane_backend": self.backend.name,
            "data_plane_steps": self.steps,
            "verified_steps": self.verified_steps,
            "copy_bytes": self.copy_bytes,
            "data_plane_wall_s": self.wall_s,
            "data_plane_host_ms_per_step": 1e3 * host_s / self.steps if self.steps else 0.0,
        }
        if self._timed:
            t = self.times
            out.update({
                "time_source": "measured",
                "attention_ms": t["attention"],
                "kv_write_ms": t["write"],
                "copy_ms": t["copy"],
                "copy_gb_per_s": (self.copy_bytes / t["copy"] / 1e6
                                  if self.copy_bytes and t["copy"] else None),
                "data_plane_gpu_ms": t["step"],
                "linear_ms": t["linear"] if self.engine is not None else None,
            })
        return out

    def _cross_tensors(self) -> PoolTensors:
        if self.cross_pool is None:
            raise ValueError("cross-attention work on a data plane without a cross pool")
        return self.pools[self.cross_pool]

    def _encoder_batch(self, encoder: Sequence[StepItem], upload: Upload) -> PagedBatch:
        """The batch of the step's encoder writes into the cross pool."""
        return PagedBatch(encoder, self._cross_tensors(), self.shape.tokens_per_block,
                          self.device, decode=False, upload=upload)

    def _encoder_writes(self, batch: PagedBatch):
        """The write of the step's encoder K/V (`_encoder_batch`, uploaded)."""
        cross = self._cross_tensors()
        kv, _ = self.cross_model.qkv_all(batch.rows, cross.spec.layers, self._kv_dtype, None)
        return _writer(cross.gpu, batch, kv)

    def _cross_attention(self, pool: int, batch: PagedBatch, layers, q, buffer: int):
        """The `attend` entry of a decoder batch's cross attention: its items' queries with
        an encoder input, over their cross pages at the pool's layers, verified against the
        encoder's K/V generator."""
        cross = self._cross_tensors()
        cb = CrossBatch(batch, cross, layers, self.device)
        return (self.cross_verifier, self.cross_pool, cross.gpu, cb, layers,
                q.index_select(1, cb.query_index), self.backend.plan(pool, cb, buffer))

    def _batches(self, items: Sequence[StepItem], upload: Upload):
        by_pool: dict[int, tuple[list[StepItem], list[StepItem]]] = {}
        for it in items:
            if not 0 <= it.pool < self.num_decoder_pools:
                raise ValueError(f"request {it.request_id}: no pool {it.pool}")
            ctx, dec = by_pool.setdefault(it.pool, ([], []))
            (dec if it.end - it.start == 1 else ctx).append(it)
        tpb = self.shape.tokens_per_block
        for pool, (ctx, dec) in by_pool.items():
            for group, decode in ((ctx, False), (dec, True)):
                if group:
                    yield pool, PagedBatch(group, self.pools[pool], tpb, self.device,
                                           decode=decode, upload=upload)


def _writer(kv: torch.Tensor, batch: PagedBatch, new_kv: torch.Tensor):
    """The write of a batch's K/V as a call for the timed span; its rows are expanded now, in
    the untimed preparation."""
    return partial(scatter_kv, kv, batch.write_rows.view(-1), new_kv)


PHASES = ("copy", "linear", "write", "attention", "step")
"""Measured spans of a step: copies (on their own stream, from the step's start), the
engine's linear layers, K/V writes, attention, and the whole step."""


class _Marks:
    """CUDA events at a step's phase boundaries (CUDA only: kvbench reports no times on a
    CPU): `start`, `linear`, `write`, `attention` on the compute stream, `copy` on the copy
    stream after its copies (which wait for `start`; a step without copies records it on
    the compute stream right after `start`). Made once and reused, step after step, once
    `totals` read them."""

    __slots__ = ("start", "copy", "linear", "write", "attention")

    def __init__(self) -> None:
        for name in self.__slots__:
            setattr(self, name, torch.cuda.Event(enable_timing=True))

    def totals(self) -> dict[str, float]:
        self.attention.synchronize()
        self.copy.synchronize()
        start = self.start
        return {
            "copy": start.elapsed_time(self.copy),
            "linear": start.elapsed_time(self.linear),
            "write": self.linear.elapsed_time(self.write),
            "attention": self.write.elapsed_time(self.attention),
            "step": start.elapsed_time(self.attention),
        }
