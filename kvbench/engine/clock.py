"""Modeled step time: how long one serve-mode iteration takes on the workload's hardware.

Every time this module produces is a model, labelled `time_source: modeled` in results. One step
runs the model once over every token scheduled in it, and takes

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
from dataclasses import dataclass

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


PRESETS: dict[str, Hardware] = {
    # Datasheets: dense (not sparse) bf16 tensor FLOP/s; host link = PCIe x16, one direction.
    "H100-SXM": Hardware("H100-SXM", 989e12, 3.35e12, 64e9),   # HBM3, PCIe Gen5
    "H200": Hardware("H200", 989e12, 4.8e12, 64e9),            # HBM3e, PCIe Gen5
    "A100-80G": Hardware("A100-80G", 312e12, 2.039e12, 32e9),  # SXM HBM2e, PCIe Gen4
    "L40S": Hardware("L40S", 362.05e12, 864e9, 32e9),          # GDDR6, PCIe Gen4
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


class StepClock:
    """Step times of one model on one accelerator (see the module docstring)."""

    __slots__ = ("hardware", "overhead", "token_s", "weights_s", "pair_s", "kv_token_s",
                 "link_byte_s", "_decode_kv_s")

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
        self.link_byte_s = 1 / (hardware.host_link_bandwidth * HOST_LINK_EFFICIENCY)
        # A decode token reads as many KV tokens as it has (query, key) pairs.
        self._decode_kv_s = max(self.pair_s, self.kv_token_s)

    def step_seconds(self, tokens: int, pairs: int, kv_tokens: int, copy_bytes: int = 0) -> float:
        """One step computing `tokens` tokens with `pairs` attention (query, key) pairs over
        `kv_tokens` KV tokens read, moving `copy_bytes` over the host link."""
        return (self.overhead + max(tokens * self.token_s, self.weights_s)
                + max(pairs * self.pair_s, kv_tokens * self.kv_token_s)
                + copy_bytes * self.link_byte_s)

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
