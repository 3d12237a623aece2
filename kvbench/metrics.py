"""Every metric a run reports, in one place: its name, unit, table label, formatter, compare
rule, whether its name is pinned (DESIGN.md section 4: add freely, never rename), the modes
that produce it and what else a run needs to produce it. The producers (runner, windows, data
plane), `kvbench compare`, the tables, the plots, the tune objectives and the result JSON
Schema read this registry; `tests/test_metrics.py` fails when a run produces a metric that is
not here or a metric here is produced by no shipped workload.

Pure Python: `compare` and `report` import it without numpy or torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

# --- compare rules ---------------------------------------------------------------------------

RATE_EPS = 1e-9
"""Hit rates are ratios of integer counts: equal inputs give equal bits; the epsilon only
absorbs a different summation order."""


@dataclass(frozen=True, slots=True)
class Rule:
    """How `kvbench compare` judges one metric.

    better: higher | lower (directional), match (must not change: an input of the benchmark),
    either (deterministic, no better direction), info (never judged).
    scope: any (deterministic: compared anywhere); device (only between results from the same
    device); time (a timing of the run's clock: exact-ish when both runs are `time_source:
    modeled`, else `--timing-tolerance` on the same device); measured (always measured on the
    device, whatever the clock: `--timing-tolerance` on the same device).
    A value passes when |new - base| <= max(abs_tol, rel_tol * |base|).
    """

    better: str
    abs_tol: float = 0.0
    rel_tol: float = 0.0
    scope: str = "any"


HIGHER, LOWER, EITHER, MATCH, INFO = (Rule("higher"), Rule("lower"), Rule("either"),
                                      Rule("match"), Rule("info"))
RATE_MATCH = Rule("match", abs_tol=RATE_EPS)
TIME_LOWER = Rule("lower", scope="time")
MEASURED_LOWER = Rule("lower", scope="measured")

# --- formatters (one per unit; tables, report pages, tune and compare use them) ---------------

PERCENTILES = ("mean", "p50", "p90", "p99")
"""The keys of a percentile summary (`ttft_ms`, ...)."""


def format_count(v) -> str:
    return f"{v:,}"


def format_fraction(v) -> str:
    return f"{100 * v:.2f}%"


def format_bytes(v, digits: int = 1) -> str:
    v = float(v)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(v) < 1024 or unit == "TiB":
            return f"{int(v)} B" if unit == "B" else f"{v:.{digits}f} {unit}"
        v /= 1024
    raise AssertionError


def format_seconds(v) -> str:
    return f"{v:.2f} s"


def format_ms(v) -> str:
    return f"{v:,.1f} ms"


def format_rate(v) -> str:
    return f"{v:,.1f}"


def format_small(v) -> str:
    return f"{v:.3g}"


def format_percentiles(v) -> str:
    return " / ".join(f"{v[k]:.1f}" for k in PERCENTILES)


def format_pools(v) -> str:
    """Per pool: peak / total GPU blocks."""
    return ", ".join(f"{name} {p['peak_gpu_blocks']:,} / {p['gpu_blocks_total']:,}"
                     for name, p in v.items())


def format_number(v) -> str:
    """Any value, exact enough to judge by (compare): integers in full, floats to 6
    significant digits, `-` for null."""
    if v is None:
        return "-"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return str(v)
    if isinstance(v, int):
        return f"{v:,}"
    return f"{v:,.6g}" if abs(v) >= 1e-3 or v == 0 else f"{v:.3e}"


# --- the registry ------------------------------------------------------------------------------

SERVE, BOTH = ("serve",), ("cache", "serve")


@dataclass(frozen=True, slots=True)
class Metric:
    name: str
    kind: str
    """count (an int), number (a finite float or int), percentiles (`PERCENTILES` -> number),
    bool, text, pools (pool name -> {field: number})."""
    unit: str
    label: str
    """Its row in the tables."""
    section: str
    fmt: Callable
    rule: Rule
    modes: tuple[str, ...]
    needs: str = ""
    """What else a run needs to produce it (in one of its modes at least): windows (a
    sliding-window layer), data_plane (`run.backend` other than none), cuda (a data plane on
    a CUDA device), speculative (speculative decoding), draft (a draft model),
    draft_data_plane (both), encoder (requests with encoder inputs)."""
    nullable: bool = False
    """May be null (not applicable to this run)."""
    pinned: bool = False
    description: str = ""

    @property
    def title(self) -> str:
        """The label standing alone (a plot panel): an indented sub-row names its parent."""
        if self.label.startswith("  ") and self.unit == "tokens":
            return f"reused tokens {self.label.strip()}"
        return self.label.strip().split(" (")[0]


_REGISTRY: list[Metric] = []


def _m(name, kind, unit, label, section, fmt, rule, modes=BOTH, needs="", nullable=False,
       pinned=False, description=""):
    _REGISTRY.append(Metric(name, kind, unit, label, section, fmt, rule, modes, needs, nullable,
                            pinned, description))


_c, _f, _b = format_count, format_fraction, format_bytes
# Reuse: what the cache served, next to the references on the same stream.
_m("requests", "count", "requests", "requests", "Reuse", _c, MATCH, pinned=True,
   description="Requests replayed (an input).")
_m("prompt_tokens", "count", "tokens", "prompt tokens", "Reuse", _c, MATCH, pinned=True,
   description="Prompt tokens over all requests (an input).")
_m("reused_tokens", "count", "tokens", "reused tokens", "Reuse", _c, HIGHER, pinned=True,
   description="Prompt tokens served from the cache (GPU or host), never the last one.")
_m("reused_tokens_gpu", "count", "tokens", "  from GPU", "Reuse", _c, HIGHER, pinned=True,
   description="Reused tokens found on the GPU.")
_m("reused_tokens_host", "count", "tokens", "  from host", "Reuse", _c, EITHER, pinned=True,
   description="Reused tokens onboarded from the host tier.")
_m("reused_partial_tokens", "count", "tokens", "  by partial match", "Reuse", _c, EITHER,
   description="Reused tokens of partially matched blocks.")
_m("reused_full_blocks", "count", "blocks", "  full blocks reused", "Reuse", _c, EITHER,
   description="Full blocks reused.")
_m("reused_partial_blocks", "count", "blocks", "  partial blocks reused", "Reuse", _c, EITHER,
   description="Partially matched blocks reused (at most one per request).")
_m("draft_reused_full_blocks", "count", "blocks", "draft cache: full blocks reused", "Reuse",
   _c, EITHER, BOTH, needs="draft",
   description="Full blocks the draft model's cache reused (speculative.draft_model).")
_m("draft_reused_partial_blocks", "count", "blocks", "draft cache: partial blocks reused",
   "Reuse", _c, EITHER, BOTH, needs="draft",
   description="Partially matched blocks the draft model's cache reused.")
_m("cross_requests", "count", "requests", "cross cache: requests with encoder input", "Reuse",
   _c, MATCH, needs="encoder",
   description="Requests carrying an encoder input (an input), counted once each.")
_m("encoder_tokens", "count", "tokens", "cross cache: encoder tokens", "Reuse", _c, MATCH,
   needs="encoder", description="Encoder tokens of those requests (an input).")
_m("cross_reused_tokens", "count", "tokens", "cross cache: reused tokens", "Reuse", _c, HIGHER,
   needs="encoder",
   description="Encoder tokens whose cross-attention KV an identical earlier input left.")
_m("cross_hit_rate", "number", "fraction", "cross cache: hit rate", "Reuse", _f,
   Rule("higher", abs_tol=RATE_EPS), needs="encoder", nullable=True,
   description="cross_reused_tokens / encoder_tokens (null: no encoder tokens).")
_m("cross_reused_full_blocks", "count", "blocks", "cross cache: full blocks reused", "Reuse",
   _c, EITHER, needs="encoder", description="Full cross-attention blocks reused.")
_m("cross_reused_partial_blocks", "count", "blocks", "cross cache: partial blocks reused",
   "Reuse", _c, EITHER, needs="encoder",
   description="Unfilled last cross-attention blocks reused.")
_m("hit_rate", "number", "fraction", "hit rate", "Reuse", _f, Rule("higher", abs_tol=RATE_EPS),
   pinned=True, description="reused_tokens / prompt_tokens.")
_m("optimal_hit_rate", "number", "fraction", "optimal hit rate (same capacity)", "Reuse", _f,
   RATE_MATCH, nullable=True, pinned=True,
   description="Farthest-next-use eviction at the same capacity (cache mode, one pool; null "
               "otherwise).")
_m("ideal_hit_rate", "number", "fraction", "ideal hit rate (unlimited cache)", "Reuse", _f,
   RATE_MATCH, pinned=True,
   description="The hit rate of a cache that never evicts, under the run's reuse and window "
               "rules: it bounds hit_rate.")
_m("lru_hit_rate", "number", "fraction", "LRU hit rate (same capacity)", "Reuse", _f,
   RATE_MATCH, nullable=True, pinned=True,
   description="The same run with LRU eviction and admission of all (the run's own hit rate "
               "when it is LRU): in serve mode the same served stream, null with a measured "
               "clock.")
_m("gap_closed", "number", "fraction", "LRU-to-optimal gap closed", "Reuse", _f,
   Rule("higher", abs_tol=RATE_EPS), nullable=True, pinned=True,
   description="(hit_rate - lru_hit_rate) / (optimal_hit_rate - lru_hit_rate); null without "
               "both references or without a gap.")
# Memory.
_m("gpu_blocks_total", "count", "blocks", "GPU cache size (blocks)", "Memory", _c, MATCH,
   pinned=True, description="GPU blocks (slots of all pools): the cache's capacity.")
_m("gpu_bytes_total", "count", "bytes", "GPU cache size (bytes)", "Memory", _b, MATCH,
   description="GPU bytes of all pools: the cache's capacity, what a deployment reserves.")
_m("peak_gpu_blocks", "count", "blocks", "GPU blocks peak (in use)", "Memory", _c, LOWER,
   pinned=True, description="Most GPU blocks running requests held at once.")
_m("peak_gpu_bytes", "count", "bytes", "GPU bytes peak (in use)", "Memory", _b, LOWER,
   pinned=True,
   description="peak_gpu_blocks weighed by each pool's slot size.")
_m("draft_gpu_blocks_total", "count", "blocks", "draft cache: GPU blocks total", "Memory", _c,
   MATCH, BOTH, needs="draft",
   description="The draft model's cache blocks (as many as the target's when it mirrors "
   "one pool; its own pools' with sliding windows).")
_m("draft_peak_gpu_blocks", "count", "blocks", "draft cache: GPU blocks peak (in use)", "Memory",
   _c, LOWER, BOTH, needs="draft", description="Most draft-cache blocks held at once.")
_m("draft_peak_gpu_bytes", "count", "bytes", "draft cache: GPU bytes peak (in use)", "Memory", _b,
   LOWER, BOTH, needs="draft", description="draft_peak_gpu_blocks x the draft's block size.")
_m("peak_kv_bytes", "count", "bytes", "all KV caches: GPU bytes peak (in use)", "Memory", _b,
   LOWER, BOTH, needs="draft",
   description="Most GPU bytes all KV caches (target and draft) held at once.")
_m("cross_gpu_blocks_total", "count", "blocks", "cross cache: GPU blocks total", "Memory", _c,
   MATCH, needs="encoder",
   description="Cross-attention blocks (cache.cross_kv_cache_fraction of the budget).")
_m("cross_peak_gpu_blocks", "count", "blocks", "cross cache: GPU blocks peak (in use)", "Memory",
   _c, LOWER, needs="encoder", description="Most cross-attention blocks held at once.")
_m("cross_peak_gpu_bytes", "count", "bytes", "cross cache: GPU bytes peak (in use)", "Memory", _b,
   LOWER, needs="encoder", description="cross_peak_gpu_blocks x the block size.")
_m("host_blocks_total", "count", "blocks", "host cache size (blocks)", "Memory", _c, MATCH,
   pinned=True,
   description="Host-tier blocks (host_offload_ratio x GPU blocks).")
_m("peak_host_blocks", "count", "blocks", "host blocks peak (in use)", "Memory", _c, EITHER,
   pinned=True,
   description="Most host blocks holding data at once (with pools: the sum of their peaks).")
_m("scratch_slots_peak", "count", "blocks", "scratch slots peak", "Memory", _c, LOWER,
   needs="windows", pinned=True, description="Most scratch slots held at once.")
_m("deferred_ctx_blocks_held_peak", "count", "blocks", "deferred ctx blocks held peak",
   "Memory", _c, LOWER, SERVE, pinned=True,
   description="Most blocks deferred context requests held for their postponed chunks while "
               "delay batching waited (not the blocks they reuse).")
_m("pools", "pools", "blocks", "pools: peak / total GPU blocks", "Memory", format_pools, EITHER,
   needs="windows", description="Per pool (`full`, `window_W`): layers, slot_bytes, "
   "gpu_blocks_total, peak_gpu_blocks, host_blocks_total, evicted_blocks.")
# Traffic between tiers and pools.
_m("allocated_blocks", "count", "blocks", "blocks allocated", "Traffic", _c, LOWER,
   description="Blocks allocated for computed tokens.")
_m("evicted_blocks", "count", "blocks", "blocks evicted", "Traffic", _c, LOWER, pinned=True,
   description="Cached GPU blocks evicted (or offloaded) to make room.")
_m("partial_copy_blocks", "count", "blocks", "partial copies", "Traffic", _c, EITHER,
   pinned=True, description="Partially matched blocks copied before use.")
_m("onboard_blocks", "count", "blocks", "onboarded blocks (host->GPU)", "Traffic", _c, EITHER,
   pinned=True, description="Host hits copied to the GPU.")
_m("offload_blocks", "count", "blocks", "offloaded blocks (GPU->host)", "Traffic", _c, EITHER,
   pinned=True, description="GPU blocks whose data moved to the host on eviction.")
_m("onboard_bytes", "count", "bytes", "onboarded bytes", "Traffic", _b, EITHER, pinned=True,
   description="Bytes onboarded.")
_m("offload_bytes", "count", "bytes", "offloaded bytes", "Traffic", _b, EITHER, pinned=True,
   description="Bytes offloaded.")
_m("host_link_ms_modeled", "number", "ms", "host-link time (modeled)", "Traffic", format_ms,
   EITHER, pinned=True,
   description="Onboard and offload bytes over the hardware's host link (modeled).")
_m("host_evicted_blocks", "count", "blocks", "host blocks evicted", "Traffic", _c, LOWER,
   description="Host blocks whose data was dropped to make room for offloads.")
_m("phase2_alloc_failures", "count", "blocks", "onboards/partial copies short of a block",
   "Traffic", _c, LOWER, pinned=True,
   description="Onboards and partial copies of an add that found no free GPU block (that "
               "request's reuse ended there; cache.strict_phase2 fails the run instead).")
_m("scratch_blocks", "count", "blocks", "blocks in scratch slots", "Traffic", _c, EITHER,
   needs="windows", pinned=True, description="Out-of-window prompt blocks put in scratch slots.")
_m("reuse_fallbacks", "count", "requests", "window reuse fallbacks", "Traffic", _c, LOWER,
   needs="windows", description="Adds whose pools could not all serve the chosen reuse.")
# Serving (serve mode).
_m("iterations", "count", "steps", "iterations", "Serving", _c, EITHER, SERVE, pinned=True,
   description="Scheduler steps.")
_m("duration_s", "number", "s", "duration", "Serving", format_seconds, TIME_LOWER, SERVE,
   description="From the first arrival to the last finish, on the run's clock.")
_m("output_tokens", "count", "tokens", "output tokens", "Serving", _c, MATCH, SERVE,
   description="Generated tokens (an input).")
_m("computed_tokens", "count", "tokens", "computed tokens", "Serving", _c, LOWER, SERVE,
   description="Tokens whose KV was computed (context, recomputation, decode).")
_m("throughput_tokens_per_s", "number", "tokens/s", "throughput (output tokens/s)", "Serving",
   format_rate, Rule("higher", scope="time"), SERVE, pinned=True,
   description="output_tokens / duration_s.")
for _name, _what in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "end-to-end")):
    _m(_name, "percentiles", "ms", f"{_what} ms mean/p50/p90/p99", "Serving",
       format_percentiles, TIME_LOWER, SERVE, pinned=True,
       description=f"{_what} per request: mean, p50, p90, p99.")
_m("preemptions", "count", "requests", "preemptions", "Serving", _c, LOWER, SERVE, pinned=True,
   description="Requests preempted for blocks.")
_m("mnt_overflow_steps", "count", "steps", "MNT overflow steps", "Serving", _c, LOWER, SERVE,
   pinned=True, description="Steps whose computed tokens exceeded max_num_tokens.")
_m("max_mnt_overshoot_tokens", "count", "tokens", "max MNT overshoot (tokens)", "Serving", _c,
   LOWER, SERVE, pinned=True, description="The largest excess over max_num_tokens.")
_m("reuse_shortfall_tokens", "count", "tokens", "reuse shortfall (tokens)", "Serving", _c,
   LOWER, SERVE, pinned=True, description="Estimated minus actual reuse of the adds.")
_m("ctx_alloc_failures", "count", "requests", "context adds short of blocks", "Serving", _c,
   LOWER, SERVE, description="New context requests that waited for their chunk's blocks.")
_m("batch_wait_iterations", "count", "steps", "iterations waited (delay batching)", "Serving",
   _c, EITHER, SERVE, pinned=True, description="Steps in which delay batching deferred work.")
_m("draft_tokens", "count", "tokens", "draft tokens verified", "Serving", _c, EITHER, SERVE,
   needs="speculative", description="Draft tokens the decode steps verified.")
_m("accepted_draft_tokens", "count", "tokens", "draft tokens accepted", "Serving", _c, EITHER,
   SERVE, needs="speculative", description="Verified draft tokens that were accepted.")
_m("draft_acceptance", "number", "fraction", "draft acceptance", "Serving", _f, RATE_MATCH,
   SERVE, needs="speculative", nullable=True,
   description="accepted_draft_tokens / draft_tokens (seeded draws; null: no drafts).")
_m("tokens_per_decode_step", "number", "tokens", "tokens per decode step", "Serving",
   format_small, HIGHER, SERVE, needs="speculative", nullable=True,
   description="Tokens a decoder's step yielded on average (1..max_draft_len + 1).")
_m("deferred_ctx_blocks_reverted", "count", "blocks", "deferred ctx blocks reverted",
   "Serving", _c, EITHER, SERVE, pinned=True,
   description="Blocks deferred requests gave back: their step's new blocks (at once with "
               "revert_deferred_ctx, else before a decoder preempts anyone); reuse stays.")
_m("time_source", "text", "", "time source", "Serving", str, MATCH, pinned=True,
   description="`modeled` or `measured`: where the run's times come from (serve mode; cache "
               "mode with a CUDA data plane: measured).")
# Data plane (run.backend other than none).
_m("verified", "bool", "", "verified", "Data plane", str, HIGHER, nullable=True, pinned=True,
   description="Every checked output and page read matched (null: nothing checked).")
_m("max_abs_err", "number", "", "max abs error", "Data plane", format_small,
   Rule("lower", abs_tol=1e-4, rel_tol=1.0, scope="device"), nullable=True, pinned=True,
   description="Largest attention output error against the dense recomputation.")
_m("verify_mismatch", "text", "", "first mismatch", "Data plane", str, INFO, needs="data_plane",
   nullable=True, description="The first mismatch the verifier found (null: none).")
_m("draft_verified", "bool", "", "draft cache verified", "Data plane", str, HIGHER,
   BOTH, needs="draft_data_plane", nullable=True,
   description="The draft model's KV and attention matched (null: nothing checked).")
_m("draft_max_abs_err", "number", "", "draft max abs error", "Data plane", format_small,
   Rule("lower", abs_tol=1e-4, rel_tol=1.0, scope="device"), BOTH, needs="draft_data_plane",
   nullable=True, description="Largest draft attention output error.")
_m("data_plane_backend", "text", "", "data plane backend", "Data plane", str, MATCH,
   needs="data_plane", description="The attention backend that ran (torch, flashinfer).")
_m("data_plane_steps", "count", "steps", "data plane steps", "Data plane", _c, EITHER,
   needs="data_plane", description="Steps the data plane executed.")
_m("verified_steps", "count", "steps", "verified steps", "Data plane", _c, EITHER,
   needs="data_plane", description="Steps whose outputs were checked.")
_m("copy_bytes", "count", "bytes", "copied bytes", "Data plane", _b, EITHER, needs="data_plane",
   description="Bytes the copy executor moved (onboard, offload, partial copies).")
_m("attention_ms", "number", "ms", "attention time (measured)", "Data plane", format_ms,
   MEASURED_LOWER, needs="cuda", description="Attention kernel time, CUDA events.")
_m("kv_write_ms", "number", "ms", "KV write time (measured)", "Data plane", format_ms,
   MEASURED_LOWER, needs="cuda", description="K/V write time, CUDA events.")
_m("copy_ms", "number", "ms", "copy time (measured)", "Data plane", format_ms, MEASURED_LOWER,
   needs="cuda", description="Copy-op time, CUDA events.")
_m("copy_gb_per_s", "number", "GB/s", "copy bandwidth (measured)", "Data plane", format_rate,
   Rule("higher", scope="measured"), needs="cuda", nullable=True,
   description="copy_bytes / copy_ms (null when nothing was copied).")
_m("linear_ms", "number", "ms", "linear layers time (measured)", "Data plane", format_ms,
   MEASURED_LOWER, needs="cuda", nullable=True,
   description="GPU time of the engine's linear layers (run.clock: measured; null without).")
_m("data_plane_gpu_ms", "number", "ms", "data plane GPU time (measured)", "Data plane",
   format_ms, MEASURED_LOWER, needs="cuda",
   description="GPU time of the steps (copies overlapping the linear layers, K/V writes, "
               "attention), CUDA events; with run.clock: measured, the sum of step times.")
_m("data_plane_wall_s", "number", "s", "data plane wall time", "Data plane", format_seconds,
   INFO, needs="data_plane",
   description="Wall time spent in the data plane's steps, waits for the GPU and "
               "verification included; never a gate.")
_m("data_plane_host_ms_per_step", "number", "ms", "data plane host time per step",
   "Data plane", format_small, INFO, needs="data_plane",
   description="Host time a step takes to issue its work (page tables, plans, launches), "
               "waits for the GPU and the one-time captures of decode CUDA graphs excluded; "
               "never a gate.")
# The harness.
_m("wall_s", "number", "s", "wall time", "Run", format_seconds, INFO, pinned=True,
   description="Harness wall time, the references included (those an earlier variant of "
               "the same workload or an earlier trial of the same tune study computed are "
               "reused, not timed again, as are block keys an earlier run on the same requests "
               "at the same block size memoised); never a gate.")

METRICS: dict[str, Metric] = {m.name: m for m in _REGISTRY}
"""Every metric by name, in table order."""

SECTIONS: tuple[str, ...] = tuple(dict.fromkeys(m.section for m in _REGISTRY))

DEFAULT_OBJECTIVES: tuple[str, ...] = ("throughput_tokens_per_s", "peak_gpu_bytes")
"""`kvbench tune` without `tune.objectives`: each in its rule's direction."""


def metric(path: str) -> Metric | None:
    """The metric of a name or a dotted path into a nested one (`ttft_ms.p99`)."""
    return METRICS.get(path) or METRICS.get(path.split(".", 1)[0])


def unregistered(metrics: dict) -> list[str]:
    """The names in a run's metrics that this registry lacks."""
    return [name for name in metrics if name not in METRICS]


def direction(name: str) -> str:
    """maximize or minimize, for a tune objective on a directional metric."""
    return "maximize" if METRICS[name].rule.better == "higher" else "minimize"


def in_section(section: str) -> list[Metric]:
    return [m for m in _REGISTRY if m.section == section]


def format_value(path: str, value) -> str:
    """A metric value for people: by its registered unit, `-` for null; an unregistered
    value, or a leaf of a nested one, by `format_number`."""
    if value is None:
        return "-"
    m = METRICS.get(path)
    if m is not None and m.kind not in ("bool", "text") and not isinstance(value, bool):
        return m.fmt(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int) or (value.is_integer() and abs(value) >= 1000):
        return f"{int(value):,}"
    return f"{value:.4g}"


def percentile_summary(values: Sequence[float], *, with_max: bool = False) -> dict[str, float]:
    """mean, p50, p90, p99 (and max) of `values`, zeros when empty (numpy's linear
    interpolation; numpy is imported here only)."""
    import numpy as np

    a = np.asarray(values, dtype=np.float64)
    keys = PERCENTILES + (("max",) if with_max else ())
    if not len(a):
        return {k: 0.0 for k in keys}
    p50, p90, p99 = np.percentile(a, [50, 90, 99])
    out = {"mean": float(a.mean()), "p50": float(p50), "p90": float(p90), "p99": float(p99)}
    if with_max:
        out["max"] = float(a.max())
    return out


# --- types ------------------------------------------------------------------------------------


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def type_error(name: str, value) -> str | None:
    """Why `value` is not a valid value of metric `name` (None when it is). An unregistered
    metric (a newer kvbench's) may be a finite number, a string, a bool, null or a mapping of
    those."""
    m = METRICS.get(name)
    if value is None:
        return None if m is None or m.nullable else "expected a value, got null"
    kind = m.kind if m is not None else "any"
    if kind == "count":
        ok = isinstance(value, int) and not isinstance(value, bool)
        return None if ok else f"expected an integer, got {_show(value)}"
    if kind == "number":
        return None if _finite(value) else f"expected a finite number, got {_show(value)}"
    if kind == "bool":
        return None if isinstance(value, bool) else f"expected true, false or null, got {_show(value)}"
    if kind == "text":
        return None if isinstance(value, str) else f"expected a string, got {_show(value)}"
    if kind == "percentiles":
        if not isinstance(value, dict) or set(value) != set(PERCENTILES):
            return f"expected a mapping of {', '.join(PERCENTILES)}, got {_show(value)}"
        bad = [k for k in PERCENTILES if not _finite(value[k])]
        return f"{bad[0]}: expected a finite number, got {_show(value[bad[0]])}" if bad else None
    if kind == "pools":
        if not isinstance(value, dict) or not all(isinstance(p, dict) for p in value.values()):
            return f"expected a mapping of pools, got {_show(value)}"
        for pool, fields in value.items():
            for key, v in fields.items():
                if not _finite(v):
                    return f"{pool}.{key}: expected a finite number, got {_show(v)}"
        return None
    return _any_error(value)


def _any_error(value) -> str | None:
    if isinstance(value, dict):
        for key, v in value.items():
            err = _any_error(v)
            if err:
                return f"{key}: {err}"
        return None
    if isinstance(value, (bool, str)) or value is None or _finite(value):
        return None
    return f"expected a finite number, string, bool or null, got {_show(value)}"


def _show(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


def json_schema() -> dict:
    """The JSON Schema of a run's `metrics` object."""
    number = {"type": "number"}
    kinds = {
        "count": {"type": "integer"},
        "number": number,
        "bool": {"type": "boolean"},
        "text": {"type": "string"},
        "percentiles": {"type": "object", "required": list(PERCENTILES),
                        "properties": {k: number for k in PERCENTILES},
                        "additionalProperties": False},
        "pools": {"type": "object", "additionalProperties": {
            "type": "object", "additionalProperties": number}},
    }
    props = {}
    for m in _REGISTRY:
        schema = dict(kinds[m.kind])
        if m.nullable:
            schema = {"anyOf": [schema, {"type": "null"}]}
        props[m.name] = {**schema, "description": m.description
                         + (f" Unit: {m.unit}." if m.unit else "")}
    return {"type": "object", "properties": props}
