"""`kvbench calibrate`: measure one GPU for one model shape and write a hardware profile.

Everything is timed with the code a measured clock runs (`run.clock: measured`), so a profile
prices exactly the steps that clock measures (`engine/clock.py: ProfileClock`):
- linear layers over token counts 1 to 8192: `kernels.engine.LinearWork` (captured graphs
  for its capture sizes, eager beyond), random bf16 weights of the model's shape;
- K/V writes over token counts, prefill attention over (chunk, cached) and decode attention
  over (batch, context): the data plane's scatter and FlashInfer calls over a paged cache of
  the model's shape (all layers in one call), every page read distinct. A decode batch whose
  K/V exceed the cache (`CACHE_BYTES`) is timed with as many sequences as fit and scaled to
  the batch: it reads more than 16 GiB, so its time is linear in the sequences (reading
  pages twice in one call would hit L2 and run up to twice too fast);
- the per-step floor: a data-plane step of one decode token with the engine's linear layers,
  less what the tables give for its parts (event, stream and launch gaps of a real step);
- HBM bandwidth (a device-to-device copy, bytes read + written) and pinned host->GPU and
  GPU->host bandwidth.

Kernel-level timings flush L2 before every call (a 256 MiB write), since in a real step the
linear layers' weight reads have evicted everything before attention runs; each figure is
the median of several calls, timed with CUDA events, each queued whole before its start
event runs (`Timer`: the host's launch latency is not GPU time).
"""

from __future__ import annotations

import datetime
import platform
import statistics
import subprocess
from collections.abc import Callable

import numpy as np
import torch

from . import __version__
from .profile import HardwareProfile, Table1D, Table2D, model_shape

LINEAR_TOKENS = (640, 768, 1024, 1536, 2048, 3072, 4096, 6144, 8192)
"""Eager token counts past the largest captured graph (the graphs' sizes come first)."""
WRITE_TOKENS = (1, 8, 64, 256, 1024, 4096, 8192)
PREFILL_CHUNKS = (16, 64, 256, 1024, 2048, 4096, 8192)
PREFILL_CACHED = (0, 1024, 4096, 16384, 32768)
DECODE_BATCH = (1, 2, 4, 8, 16, 64, 128, 256)
DECODE_CONTEXT = (64, 256, 1024, 2048, 8192, 16384, 32768)
FLUSH_BYTES = 256 << 20
CACHE_BYTES = 16 << 30
"""The calibration cache: the longest prefill's K/V, or this much if more."""
FLOOR_STEPS = 40
BANDWIDTH_BYTES = 1 << 30
SPIN_MS = 1.0
"""How long the GPU spins before each timed call (`Timer`): longer than a slow host takes to
queue the call (a 0.1-0.2 ms FlashInfer call on a busy VM), and short beside calibrate's
minute."""
SPIN_PROBE_CYCLES = 1 << 20
"""The spin timed once to convert `SPIN_MS` into GPU clock cycles (about 0.5 ms at 2 GHz)."""


class Timer:
    """Median GPU time of a call, L2 flushed before each.

    Between the flush and the start event the GPU spins (`SPIN_MS`), so the call's kernels
    are queued before the clock starts. Otherwise, whenever the host takes longer to queue
    the call than the GPU takes to flush (about 60 us on an H200; a FlashInfer call's Python
    takes 0.1-0.2 ms on a busy VM), the GPU idles inside the timed span and small work is
    timed too slow.
    """

    def __init__(self, device: torch.device) -> None:
        self.flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device=device)
        self.spin_cycles = _spin_cycles(SPIN_MS)

    def __call__(self, fn: Callable[[], object], *, min_calls: int = 5, budget_ms: float = 60.0,
                 flush: bool = True) -> float:
        fn()
        torch.cuda.synchronize()
        times: list[float] = []
        while len(times) < min_calls or (sum(times) < budget_ms and len(times) < 25):
            if flush:
                self.flush.zero_()
            torch.cuda._sleep(self.spin_cycles)
            times.append(_event_ms(fn))
        return statistics.median(times)


def _event_ms(fn: Callable[[], object]) -> float:
    """GPU milliseconds between CUDA events recorded before and after `fn` queues its work
    (waits for it)."""
    s = torch.cuda.Event(enable_timing=True)
    e = torch.cuda.Event(enable_timing=True)
    s.record()
    fn()
    e.record()
    e.synchronize()
    return s.elapsed_time(e)


def _spin_cycles(ms: float) -> int:
    """GPU clock cycles that `torch.cuda._sleep` spins for about `ms` milliseconds, from one
    timed spin (after one that loads the kernel)."""
    torch.cuda._sleep(SPIN_PROBE_CYCLES)
    spun = _event_ms(lambda: torch.cuda._sleep(SPIN_PROBE_CYCLES))
    return max(1, int(SPIN_PROBE_CYCLES * ms / spun))


class Rig:
    """The measured clock's code at one model shape, with a timer: the engine's linear layers
    and a FlashInfer data plane over a paged cache of random K/V sized for the longest
    prefill the tables measure. Each method times one kind of work over all layers."""

    def __init__(self, model, tokens_per_block: int, max_batch_size: int, seed: int = 0
                 ) -> None:
        from .kernels.dataplane import DataPlane
        from .kernels.engine import LinearShape, LinearWork
        from .kernels.step import ModelShape, PoolSpec
        from .kernels.storage import QUERY_DTYPES

        dev = self.device = torch.device("cuda")
        self.model = model
        self.tpb = tokens_per_block
        self.shape = model_shape(model, tokens_per_block)
        kv_shape = ModelShape.of(model, tokens_per_block)
        lin = LinearShape(model.num_layers, self.shape["hidden_size"],
                          model.num_q_heads * model.head_dim, model.num_kv_heads * model.head_dim,
                          self.shape["intermediate_size"])
        self.timer = Timer(dev)
        self.engine = LinearWork(lin, dev, max_batch_size, seed)
        per_token = model.num_layers * model.kv_bytes_per_token_per_layer
        tokens = max(PREFILL_CHUNKS[-1] + PREFILL_CACHED[-1], CACHE_BYTES // per_token)
        self.slots = -(-tokens // tokens_per_block)
        self.plane = DataPlane(kv_shape, [PoolSpec(tuple(range(model.num_layers)), self.slots)],
                               backend="flashinfer", device=dev, verify="off", seed=seed,
                               engine=self.engine)
        self.kv = self.plane.pools[0].gpu
        self.gen = torch.Generator(device=dev).manual_seed(seed)
        for p0 in range(0, self.kv.shape[0], 1024):  # random K/V, a slice at a time
            part = self.kv[p0:p0 + 1024]
            part.copy_(torch.randn(part.shape, generator=self.gen, device=dev).to(part.dtype))
        self.q_dtype = QUERY_DTYPES[kv_shape.dtype]

    def linear(self, tokens: int) -> float:
        self.engine.prepare(tokens)
        return self.timer(lambda: self.engine.run(tokens), min_calls=3, flush=False)

    def kv_write(self, tokens: int) -> float:
        from .kernels.attention import write_kv

        m = self.model
        b = self._batch([self._item(0, 0, tokens)], False)
        new = torch.randn((m.num_layers, tokens, 2, m.num_kv_heads, m.head_dim),
                          generator=self.gen, device=self.device).to(self.kv.dtype)
        return self.timer(lambda: write_kv(self.kv, b, new))

    def prefill(self, chunk: int, cached: int) -> float:
        return self._attention([self._item(0, cached, cached + chunk)], False)

    def decode(self, batch: int, context: int) -> float:
        per = -(-context // self.tpb)
        fits = max(1, min(batch, self.slots // per))
        ms = self._attention([self._item(i, context - 1, context, i * per)
                              for i in range(fits)], True)
        return ms * batch / fits

    def step(self, context: int) -> float:
        """A data-plane step of one decode token with the engine's linear layers: the
        measured clock's step time."""
        return self.plane.execute_step([], [self._item(0, context - 1, context)]).step_ms

    def _item(self, i: int, start: int, end: int, first_page: int = 0):
        from .kernels.step import StepItem

        pages = [(first_page + j) % self.slots for j in range(-(-end // self.tpb))]
        return StepItem(i, np.zeros(end, np.int64), pages, start, end)

    def _batch(self, items, decode: bool):
        from .kernels.attention import PagedBatch

        return PagedBatch(items, self.plane.pools[0], self.tpb, self.device, decode=decode)

    def _attention(self, items, decode: bool) -> float:
        m = self.model
        b = self._batch(items, decode)
        backend = self.plane.backend
        plan = backend.plan(0, b)
        q = torch.randn((m.num_layers, int(b.qo_indptr[-1]), m.num_q_heads, m.head_dim),
                        generator=self.gen, device=self.device).to(self.q_dtype)
        return self.timer(lambda: backend.run(self.kv, b, q, plan))


def calibrate(model, tokens_per_block: int, max_batch_size: int, *, seed: int = 0,
              log: Callable[[str], None] = lambda line: None) -> HardwareProfile:
    """Measure this machine's CUDA device for `model` (a workload's `model:` section) at
    `tokens_per_block`, with decode graphs captured up to `max_batch_size` tokens."""
    timer = Timer(torch.device("cuda"))
    log("bandwidth")
    hbm, h2d, d2h = _bandwidths(timer)
    log(f"  HBM {hbm / 1e9:.0f} GB/s, host->GPU {h2d / 1e9:.1f} GB/s, "
        f"GPU->host {d2h / 1e9:.1f} GB/s")
    del timer
    rig = Rig(model, tokens_per_block, max_batch_size, seed)
    log("linear layers")
    sizes = rig.engine.sizes
    tokens = sorted(set(sizes) | {t for t in LINEAR_TOKENS if t > sizes[-1]})
    linear = [rig.linear(t) for t in tokens]
    log("  " + ", ".join(f"{t}: {ms:.2f}" for t, ms in zip(tokens, linear)))
    log("K/V writes")
    write = [rig.kv_write(t) for t in WRITE_TOKENS]
    log("  " + ", ".join(f"{t}: {ms:.3f}" for t, ms in zip(WRITE_TOKENS, write)))
    log("prefill attention (chunk x cached)")
    prefill = []
    for c in PREFILL_CHUNKS:
        prefill.append([rig.prefill(c, s) for s in PREFILL_CACHED])
        log(f"  chunk {c}: " + ", ".join(f"{ms:.3f}" for ms in prefill[-1]))
    log("decode attention (batch x context)")
    decode = []
    for n in DECODE_BATCH:
        decode.append([rig.decode(n, ctx) for ctx in DECODE_CONTEXT])
        log(f"  batch {n}: " + ", ".join(f"{ms:.3f}" for ms in decode[-1]))
    log("step floor")
    ctx = tokens_per_block
    steps = [rig.step(ctx) for _ in range(FLOOR_STEPS)][5:]
    parts = linear[0] + write[0] + float(np.interp(ctx, DECODE_CONTEXT, decode[0]))
    floor = max(0.0, statistics.median(steps) - parts)
    log(f"  step {statistics.median(steps):.3f} ms, its parts {parts:.3f} ms: "
        f"floor {floor:.3f} ms")
    device = torch.cuda.get_device_name()
    shape = rig.shape
    del rig
    torch.cuda.empty_cache()
    return HardwareProfile(
        device=device,
        shape=shape,
        measured=_provenance(),
        hbm_bytes_per_s=hbm, h2d_bytes_per_s=h2d, d2h_bytes_per_s=d2h,
        step_floor_ms=round(floor, 4),
        graph_tokens=tuple(sizes),
        linear=Table1D(tuple(tokens), _round(linear)),
        kv_write=Table1D(WRITE_TOKENS, _round(write)),
        prefill=Table2D(PREFILL_CHUNKS, PREFILL_CACHED, tuple(_round(r) for r in prefill)),
        decode=Table2D(DECODE_BATCH, DECODE_CONTEXT, tuple(_round(r) for r in decode)),
    )


def _round(values) -> tuple[float, ...]:
    return tuple(round(float(v), 4) for v in values)


def _bandwidths(timer: Timer) -> tuple[float, float, float]:
    n = BANDWIDTH_BYTES
    a = torch.empty(n, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    d2d = timer(lambda: b.copy_(a), flush=False)
    h2d = timer(lambda: a.copy_(host, non_blocking=True), flush=False)
    d2h = timer(lambda: host.copy_(a, non_blocking=True), flush=False)
    return 2 * n / d2d * 1e3, n / h2d * 1e3, n / d2h * 1e3


def _provenance() -> dict:
    """What measured this: card, driver, CUDA, library versions, date, host."""
    props = torch.cuda.get_device_properties(0)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "gpu": str(props.name),
        "gpu_memory_bytes": int(props.total_memory),
        "multiprocessors": int(props.multi_processor_count),
        "driver": _driver(),
        "cuda": str(torch.version.cuda),
        "torch": str(torch.__version__),
        "kvbench": __version__,
        "python": platform.python_version(),
    }
    try:
        import flashinfer

        out["flashinfer"] = str(flashinfer.__version__)
    except ImportError:
        out["flashinfer"] = None
    return out


def _driver() -> str | None:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    return out.strip().splitlines()[0] if out.strip() else None
