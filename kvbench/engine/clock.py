"""Step time: how long one serve-mode iteration takes on the workload's hardware.

Three clocks (`run.clock`, `hardware.profile`):
- `StepClock`: the datasheet model below (`time_source: modeled`).
- `ProfileClock`: the same steps priced from a profile `kvbench calibrate` measured on a real
  GPU (`kvbench/profile.py`), by interpolating its tables (`time_source: modeled`).
- `MeasuredClock`: no model; the serve loop takes each step's duration from the GPU time the
  data plane measured for it (`time_source: measured`, CUDA only).

The datasheet model: one step runs the model once over every token scheduled in it, and takes

    t = overhead + t_linear + t_attention + t_copy

- t_linear = max(2 N T / (F e_mm), 2 N / (B e_mem)): the matmuls of N parameters over the T
  tokens computed in the step, against reading the bf16 weights once per step.
- t_attention = max(4 L Hq d P / (F e_attn), L kv K / (B e_mem)): P is the step's (query, key)
  pairs (a chunk of c tokens after s cached ones: c s + c (c + 1) / 2; a decode token at
  position p: p + 1), K the KV tokens read (each sequence's whole context once, the step's own
  tokens included), kv the KV bytes per token per layer of `model.dtype`.
- t_copy = bytes moved between host and GPU / (H e_link).
- overhead: a fixed cost per step (scheduling, kernel launches, sampling).

F (peak dense bf16 FLOP/s), B (HBM bandwidth) and H (host link bandwidth, one direction) come
from the hardware preset's datasheet figures; `hardware.*` overrides each. N is
`model.num_params`, or from the shape: per layer q and o projections 2 h Hq d, k and v
2 h Hkv d, a gated MLP 3 h f, with h = `model.hidden_size` (default Hq d) and
f = `model.intermediate_size` (default 3.5 h, Llama 3's ratio); embeddings and the LM head are
left out. Weights are bf16 whatever `model.dtype` (the KV type) is.

For a run of pure-decode steps (n sequences, nothing else changing) both terms are linear in
the KV tokens read, which grow by n per step, so a run's total time and the number of its steps
that start before a deadline have closed forms; the serve loop jumps such runs in one go.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

MATMUL_EFFICIENCY = 0.6
"""Fraction of peak FLOP/s dense matmuls reach (e_mm)."""
ATTENTION_EFFICIENCY = 0.5
"""Fraction of peak FLOP/s attention kernels reach (e_attn)."""
MEMORY_EFFICIENCY = 0.8
"""Fraction of HBM bandwidth weight and KV reads reach (e_mem)."""
HOST_LINK_EFFICIENCY = 0.8
"""Fraction of host link bandwidth block copies reach (e_link)."""
STEP_OVERHEAD_MS = 1.0
"""Fixed cost of one step unless `hardware.step_overhead_ms` says otherwise."""
INTERMEDIATE_RATIO = 3.5
"""MLP intermediate size / hidden size when the model gives neither it nor num_params."""
WEIGHT_BYTES = 2
"""Bytes per weight (bf16)."""


@dataclass(frozen=True, slots=True)
class Hardware:
    """Speeds of one accelerator."""

    name: str
    peak_flops: float
    """Dense bf16 FLOP/s."""
    hbm_bandwidth: float
    """GPU memory bandwidth, bytes/s."""
    host_link_bandwidth: float
    """GPU <-> host copy bandwidth in one direction, bytes/s."""
    step_overhead_s: float = STEP_OVERHEAD_MS / 1000
    memory_bytes: int | None = None
    """GPU memory the driver reports in all (the KV cache gets what weights and activations
    leave of it); None when unknown."""


_MIB = 1 << 20
PRESETS: dict[str, Hardware] = {
    # Datasheets: dense (not sparse) bf16 tensor FLOP/s; host link = PCIe x16, one direction.
    # Memory: the total nvidia-smi reports for the card.
    "H100-SXM": Hardware("H100-SXM", 989e12, 3.35e12, 64e9,     # HBM3, PCIe Gen5
                         memory_bytes=81559 * _MIB),
    "H200": Hardware("H200", 989e12, 4.8e12, 64e9,              # HBM3e, PCIe Gen5
                     memory_bytes=143771 * _MIB),
    "A100-80G": Hardware("A100-80G", 312e12, 2.039e12, 32e9,    # SXM HBM2e, PCIe Gen4
                         memory_bytes=81920 * _MIB),
    "L40S": Hardware("L40S", 362.05e12, 864e9, 32e9,            # GDDR6, PCIe Gen4
                     memory_bytes=46068 * _MIB),
}


def hardware_from_config(cfg) -> Hardware:
    """The preset of a `HardwareConfig` with its overrides applied."""
    base = PRESETS[cfg.preset]
    return Hardware(
        base.name,
        cfg.peak_flops if cfg.peak_flops is not None else base.peak_flops,
        cfg.hbm_bandwidth if cfg.hbm_bandwidth is not None else base.hbm_bandwidth,
        cfg.host_link_bandwidth if cfg.host_link_bandwidth is not None
        else base.host_link_bandwidth,
        cfg.step_overhead_ms / 1000 if cfg.step_overhead_ms is not None
        else base.step_overhead_s,
        base.memory_bytes,
    )


def matmul_params(model) -> float:
    """N: parameters whose matmuls every computed token runs through."""
    if model.num_params is not None:
        return float(model.num_params)
    h = model.hidden_size or model.num_q_heads * model.head_dim
    f = model.intermediate_size or INTERMEDIATE_RATIO * h
    d = model.head_dim
    per_layer = 2 * h * model.num_q_heads * d + 2 * h * model.num_kv_heads * d + 3 * h * f
    return float(model.num_layers * per_layer)


def host_link_bytes_per_s(hardware: Hardware) -> float:
    """Modeled host-link throughput: the one figure behind both the serve clock's copy time
    and the `host_link_ms_modeled` metric (bytes / this)."""
    return hardware.host_link_bandwidth * HOST_LINK_EFFICIENCY


class StepClock:
    """Step times of one model on one accelerator (see the module docstring)."""

    time_source = "modeled"
    __slots__ = ("hardware", "overhead", "token_s", "weights_s", "pair_s", "kv_token_s",
                 "link_bytes_per_s", "_decode_kv_s")

    def __init__(self, model, hardware: Hardware) -> None:
        self.hardware = hardware
        n = matmul_params(model)
        f, b = hardware.peak_flops, hardware.hbm_bandwidth
        self.overhead = hardware.step_overhead_s
        self.token_s = 2 * n / (f * MATMUL_EFFICIENCY)
        self.weights_s = WEIGHT_BYTES * n / (b * MEMORY_EFFICIENCY)
        layers = model.num_layers
        self.pair_s = 4 * layers * model.num_q_heads * model.head_dim / (f * ATTENTION_EFFICIENCY)
        self.kv_token_s = layers * model.kv_bytes_per_token_per_layer / (b * MEMORY_EFFICIENCY)
        self.link_bytes_per_s = host_link_bytes_per_s(hardware)
        # A decode token reads as many KV tokens as it has (query, key) pairs.
        self._decode_kv_s = max(self.pair_s, self.kv_token_s)

    def step_seconds(self, tokens: int, pairs: int, kv_tokens: int, copy_bytes: int = 0, *,
                     chunks: Sequence[tuple[int, int]] = (), decodes: int = 0,
                     decode_kv: int = 0) -> float:
        """One step computing `tokens` tokens with `pairs` attention (query, key) pairs over
        `kv_tokens` KV tokens read, moving `copy_bytes` over the host link. `chunks`
        ((chunk, cached) per context request), `decodes` and `decode_kv` (their KV tokens
        read) say the same per kind of work, for clocks that price each kind."""
        return (self.overhead + max(tokens * self.token_s, self.weights_s)
                + max(pairs * self.pair_s, kv_tokens * self.kv_token_s)
                + copy_bytes / self.link_bytes_per_s)

    def decode_run_seconds(self, n: int, kv_tokens: int, steps: int) -> float:
        """`steps` pure-decode steps of `n` sequences reading `kv_tokens` KV tokens in the
        first step (n more each step after)."""
        base = self.overhead + max(n * self.token_s, self.weights_s)
        kv_total = steps * kv_tokens + n * steps * (steps - 1) // 2
        return steps * base + kv_total * self._decode_kv_s

    def decode_steps_before(self, n: int, kv_tokens: int, gap: float, max_steps: int) -> int:
        """How many of the next `max_steps` pure-decode steps start less than `gap` seconds
        from now (the first starts now)."""
        if gap <= 0 or max_steps <= 0:
            return 0
        base = self.overhead + max(n * self.token_s, self.weights_s)
        # T(j) = base j + s (kv j + n j (j - 1) / 2) < gap, a quadratic in j.
        s = self._decode_kv_s
        a2 = s * n / 2
        a1 = base + s * kv_tokens - a2
        if a2 > 0:
            root = (-a1 + math.sqrt(a1 * a1 + 4 * a2 * gap)) / (2 * a2)
        else:
            root = gap / a1
        j = max(1, min(max_steps, math.ceil(root)))
        # The closed form may round either way; settle on exact evaluation.
        while j > 1 and self.decode_run_seconds(n, kv_tokens, j - 1) >= gap:
            j -= 1
        while j < max_steps and self.decode_run_seconds(n, kv_tokens, j) < gap:
            j += 1
        return j


class MeasuredClock:
    """`run.clock: measured`: the serve loop takes each step's duration from the GPU time the
    data plane measured for it (`StepCheck.step_ms`: the engine's linear layers, K/V writes,
    attention, and host copies overlapping them); there is nothing to model."""

    time_source = "measured"
    __slots__ = ()


class ProfileClock:
    """Step times priced from a calibrated `HardwareProfile`, the way a measured clock's step
    runs on that card:

        t = floor + max(linear(T'), copy) + kv_write(T) + prefill + decode

    T' is T padded to the captured graph's size when a graph runs the step; copy is the
    step's host link bytes at the measured pinned bandwidth (copies overlap the linear layers
    on their own stream); prefill is one planned call over the step's chunks, priced as the
    smallest measured call plus each chunk's time above it; decode is the table's time for the
    batch at its mean context. Tables are interpolated linearly, and extrapolated linearly
    past their last points."""

    time_source = "modeled"
    __slots__ = ("profile", "floor_ms", "link_ms_per_byte", "_graphs", "_prefill0")

    def __init__(self, profile) -> None:
        self.profile = profile
        self.floor_ms = profile.step_floor_ms
        self.link_ms_per_byte = profile.link_ms_per_byte
        self._graphs = np.asarray(profile.graph_tokens, dtype=np.int64)
        self._prefill0 = profile.prefill.ms[0][0]

    def padded(self, tokens: int) -> int:
        g = self._graphs
        if tokens > g[-1]:
            return tokens
        return int(g[np.searchsorted(g, tokens)])

    def step_seconds(self, tokens: int, pairs: int, kv_tokens: int, copy_bytes: int = 0, *,
                     chunks: Sequence[tuple[int, int]] = (), decodes: int = 0,
                     decode_kv: int = 0) -> float:
        p = self.profile
        ms = (self.floor_ms + max(float(interp1(p.linear, self.padded(tokens))),
                                  copy_bytes * self.link_ms_per_byte)
              + float(interp1(p.kv_write, tokens)))
        if chunks:
            ms += self._prefill0 + sum(max(0.0, float(interp2(p.prefill, c, s)) - self._prefill0)
                                       for c, s in chunks)
        if decodes:
            ms += float(interp2(p.decode, decodes, decode_kv / decodes))
        return ms / 1e3

    def _decode_steps_ms(self, n: int, kv_tokens: int, steps: int) -> np.ndarray:
        p = self.profile
        base = (self.floor_ms + float(interp1(p.linear, self.padded(n)))
                + float(interp1(p.kv_write, n)))
        ctx = (kv_tokens + n * np.arange(steps, dtype=np.float64)) / n
        return base + interp2(p.decode, n, ctx)

    def decode_run_seconds(self, n: int, kv_tokens: int, steps: int) -> float:
        """`steps` pure-decode steps of `n` sequences reading `kv_tokens` KV tokens in the
        first step (n more each step after)."""
        return float(self._decode_steps_ms(n, kv_tokens, steps).sum()) / 1e3

    def decode_steps_before(self, n: int, kv_tokens: int, gap: float, max_steps: int) -> int:
        """How many of the next `max_steps` pure-decode steps start less than `gap` seconds
        from now (the first starts now)."""
        if gap <= 0 or max_steps <= 0:
            return 0
        ends = np.cumsum(self._decode_steps_ms(n, kv_tokens, max_steps)) / 1e3
        return 1 + int(np.count_nonzero(ends[:-1] < gap))


def interp1(table, x):
    """`table` (a `Table1D`) at x (scalar or array): linear between points, flat before the
    first, linear past the last (the last segment's slope)."""
    xs = np.asarray(table.x, dtype=np.float64)
    ys = np.asarray(table.ms, dtype=np.float64)
    return _interp(xs, ys, np.asarray(x, dtype=np.float64))


def interp2(table, x, y):
    """`table` (a `Table2D`) at scalar x and y (scalar or array): bilinear, extrapolated like
    `interp1` along each axis."""
    xs = np.asarray(table.x, dtype=np.float64)
    ys = np.asarray(table.y, dtype=np.float64)
    grid = np.asarray(table.ms, dtype=np.float64)
    y = np.asarray(y, dtype=np.float64)
    along_y = np.stack([_interp(ys, row, y) for row in grid])
    return _interp(xs, along_y, np.float64(x))


def _interp(xs: np.ndarray, values: np.ndarray, x):
    """Interpolate `values` (first axis along `xs`) at x; x scalar when values has more
    than one axis."""
    if len(xs) == 1:
        return values[0] if values.ndim > 1 else np.full_like(x, values[0])
    if values.ndim > 1:
        i = int(np.clip(np.searchsorted(xs, x) - 1, 0, len(xs) - 2))
        if x <= xs[0]:
            return values[0]
        w = (x - xs[i]) / (xs[i + 1] - xs[i])
        return values[i] + w * (values[i + 1] - values[i])
    inside = np.interp(x, xs, values)
    slope = (values[-1] - values[-2]) / (xs[-1] - xs[-2])
    return np.where(x > xs[-1], values[-1] + (x - xs[-1]) * slope, inside)
