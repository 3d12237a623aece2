"""Workload YAML -> validated pydantic models, with `--set` overrides and one-line
`FILE:LINE:COL: dotted.key: message` errors (DESIGN.md sections 3 and 4).

The `Workload` model and its sections: model, hardware, cache (and its policies), scheduler,
speculative, run, variants. The `requests:` section is in `config_requests.py`, `tune:` in
`config_tune.py`, their common base in `config_base.py`; dotted keys and `--set` in
`config_keys.py`."""

from __future__ import annotations

import copy
import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Union

from pydantic import (
    BeforeValidator,
    Field,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
)

from kvbench.config_base import MAX_RATIO, Section
from kvbench.config_errors import Origin, describe
from kvbench.config_keys import BadKey, apply_sets, parse_set, set_dotted, unused_by
from kvbench.config_policies import PolicyConfig
from kvbench.config_requests import RequestsConfig
from kvbench.config_tune import TuneConfig
from kvbench.errors import InputError
from kvbench.infile import read_input
from kvbench.yamlsource import MAX_WORKLOAD_BYTES, parse_yaml, show_value

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}


MAX_WINDOW = 2**31 - 1
"""Largest attention window: TensorRT-LLM's max_attention_window is an int32; a longer window
is full attention anyway."""


def _is_positive_int(value: Any, limit: int = MAX_WINDOW) -> bool:
    # bool is an int subclass, and `true` must not silently mean a window of 1.
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit


def _off_is_false(value: Any) -> Any:
    # YAML 1.1 reads a bare `off` (and `no`) as false; `verify: off` means the word.
    return "off" if value is False else value


class ModelConfig(Section):
    """Attention shape of the served model."""

    num_layers: int = Field(32, gt=0, description="Number of transformer layers.")
    num_kv_heads: int = Field(8, gt=0, description="Number of KV heads per layer.")
    num_q_heads: int = Field(
        32,
        gt=0,
        validate_default=True,
        description="Number of query heads; a multiple of num_kv_heads.",
    )
    head_dim: int = Field(128, gt=0, description="Dimension of one attention head.")
    dtype: Literal["float16", "bfloat16", "float32", "fp8"] = Field(
        "bfloat16", description="KV cache element type.")
    attention_window: Union[PositiveInt, list[Union[PositiveInt, None]], None] = Field(
        None,
        description="Sliding window in tokens: int, or list of int/null repeated over layers"
        " (null = full attention; at most num_layers entries).",
    )
    hidden_size: int | None = Field(
        None, gt=0, description="Model hidden size, for the step-time cost model."
    )
    intermediate_size: int | None = Field(
        None, gt=0, description="MLP intermediate size, for the step-time cost model."
    )
    num_params: float | None = Field(
        None, gt=0, description="Parameter count, for the step-time cost model."
    )

    @field_validator("num_q_heads")
    @classmethod
    def _q_heads_multiple(cls, value: int, info: ValidationInfo) -> int:
        kv_heads = info.data.get("num_kv_heads")
        if kv_heads is not None and value % kv_heads:
            raise ValueError(f"expected a multiple of model.num_kv_heads={kv_heads} (got {value})")
        return value

    @field_validator("attention_window", mode="before")
    @classmethod
    def _check_window(cls, value: Any) -> Any:
        if value is None or _is_positive_int(value):
            return value
        if isinstance(value, list) and value:
            if all(w is None or _is_positive_int(w) for w in value):
                return value
        raise ValueError(
            f"expected a positive integer up to {MAX_WINDOW}, null, or a non-empty list of them"
            f" (got {show_value(value)})"
        )

    @field_validator("attention_window")
    @classmethod
    def _window_list_fits(cls, value: Any, info: ValidationInfo) -> Any:
        layers = info.data.get("num_layers")
        if isinstance(value, list) and layers is not None and len(value) > layers:
            raise ValueError(
                f"expected at most model.num_layers={layers} entries (a list repeats over the"
                f" layers; got {len(value)})")
        return value

    @property
    def kv_bytes_per_token_per_layer(self) -> int:
        """Bytes of K and V for one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * _DTYPE_BYTES[self.dtype]

    @property
    def layer_windows(self) -> list[int | None]:
        """Window of each layer (None = full attention); a list repeats over layers like
        TensorRT-LLM's max_attention_window."""
        window = self.attention_window
        if not isinstance(window, list):
            return [window] * self.num_layers
        return [window[i % len(window)] for i in range(self.num_layers)]


class HardwareConfig(Section):
    """Accelerator whose speeds the step-time model uses; overrides replace the preset's values."""

    preset: Literal["H100-SXM", "H200", "A100-80G", "L40S"] = Field(
        "H100-SXM", description="Hardware preset supplying peak FLOP/s and bandwidths."
    )
    peak_flops: float | None = Field(None, gt=0, description="Override: peak bf16 FLOP/s.")
    hbm_bandwidth: float | None = Field(
        None, gt=0, description="Override: GPU memory bandwidth in bytes/s."
    )
    host_link_bandwidth: float | None = Field(
        None, gt=0, description="Override: GPU<->host copy bandwidth in bytes/s."
    )
    step_overhead_ms: float | None = Field(
        None, ge=0, description="Override: fixed overhead per step in ms."
    )
    profile: str | None = Field(
        None, min_length=1,
        description="Hardware profile YAML from `kvbench calibrate` (relative to the workload"
        " file): the modeled clock interpolates its measured tables instead of the preset.",
    )


class CacheConfig(Section):
    """Paged KV cache; keys mean what they mean in TensorRT-LLM's KvCacheConfig."""

    tokens_per_block: int = Field(32, gt=0, description="Block size in tokens.")
    max_tokens: int = Field(
        65536,
        gt=0,
        validate_default=True,
        description="GPU KV budget in tokens of the whole model"
        " (bytes = max_tokens x KV bytes per token over all layers); at least tokens_per_block.",
    )
    host_offload_ratio: float = Field(
        0.0, ge=0, le=MAX_RATIO,
        description="Host tier capacity / GPU tier capacity; 0 = no host tier.",
    )
    enable_block_reuse: bool = Field(True, description="Reuse cached blocks of matching prefixes.")
    enable_partial_reuse: bool = Field(True, description="Reuse a partially matching block too.")
    copy_on_partial_reuse: bool = Field(
        True, description="Reuse a partially matched block that is in use by copying it."
    )
    add_sequence: Literal["batch", "sequential"] = Field(
        "batch",
        description="batch = two-phase batched add; sequential = add requests one by one.",
    )
    swa_scratch_reuse: bool = Field(
        False,
        description="Out-of-window prompt blocks of sliding-window layers share scratch slots.",
    )
    secondary_offload_min_priority: int = Field(
        30,
        ge=0,
        le=100,
        description="Retention priority a block needs to be offloaded to the host"
        " (TensorRT-LLM's default 30; blocks default to priority 35).",
    )
    release_out_of_window: Literal["keep_cached", "drop"] = Field(
        "keep_cached",
        description="Fate of sliding-window blocks that fall out of window: keep cached or drop.",
    )
    window_memory_split: Literal["window", "layers"] = Field(
        "window",
        description="How the GPU budget is split between the pools of full-attention and"
        " sliding-window layers: window = by layers x min(window, mean request context)"
        " (TensorRT-LLM); layers = by layers only. No pool gets less than the largest request"
        " needs.",
    )
    cross_kv_cache_fraction: float = Field(
        0.0,
        ge=0,
        lt=1,
        description="Share of max_tokens for the cross-attention KV of encoder-decoder"
        " requests (TensorRT-LLM's name); the self-attention cache gets the rest.",
    )
    strict_phase2: bool = Field(
        False,
        description="Fail the run, naming the request and step, when an onboard or partial"
        " copy of an add finds no free GPU block (TensorRT-LLM throws); by default that"
        " request's reuse ends there and phase2_alloc_failures counts it.",
    )

    eviction_policy: Literal["lru", "slru", "s3fifo", "gdsf", "predictive", "lru2"] = Field(
        "lru",
        description="Order of free cached GPU blocks inside a retention priority level: lru"
        " (TensorRT-LLM), slru, s3fifo, gdsf, predictive, lru2 (window pools: lru).",
    )
    policy: PolicyConfig = Field(
        default_factory=PolicyConfig, description="Parameters of the eviction policies."
    )
    admission: Literal["all", "second_use"] = Field(
        "all",
        description="Which computed blocks enter the cache: all, or second_use (only blocks"
        " whose prefix was computed before).",
    )

    @field_validator("max_tokens")
    @classmethod
    def _holds_a_block(cls, value: int, info: ValidationInfo) -> int:
        tokens_per_block = info.data.get("tokens_per_block")
        if tokens_per_block is not None and value < tokens_per_block:
            raise ValueError(
                f"expected at least cache.tokens_per_block={tokens_per_block} tokens (got {value})"
            )
        return value


class SchedulerConfig(Section):
    """Serve-mode scheduler budget and delay batching."""

    max_num_tokens: int = Field(8192, gt=0, description="Token budget per step (MNT).")
    max_batch_size: int = Field(256, gt=0, description="Most requests per step.")
    enable_chunked_prefill: bool = Field(True, description="Split long prompts across steps.")
    batch_wait_timeout_iters: int = Field(
        0, ge=0, description="Steps a context request may be deferred to batch more; 0 = off."
    )
    batch_wait_max_tokens_ratio: float = Field(
        0.0,
        ge=0,
        le=1,
        description="Stop deferring once this fraction of max_num_tokens is filled.",
    )
    revert_deferred_ctx: bool = Field(
        False, description="Return blocks allocated to deferred context requests at once."
    )


class SpeculativeConfig(Section):
    """Speculative decoding in serve mode (TensorRT-LLM's speculative_config and the extra KV
    tokens its resource manager adds after `add_sequence_batch`)."""

    max_draft_len: int = Field(
        0, ge=0, le=64, description="Draft tokens verified per decode step (k); 0 = off."
    )
    acceptance_rate: float = Field(
        0.7,
        ge=0,
        le=1,
        description="Chance each draft token is accepted given the ones before it were;"
        " a step yields 1..k+1 tokens (seeded by run.seed).",
    )
    num_extra_kv_tokens: int = Field(
        0, ge=0, description="KV tokens reserved past a sequence's tokens every step."
    )
    num_extra_decoding_steps: int = Field(
        0, ge=0, description="Further decoding steps' tokens reserved the same way."
    )
    draft_model: ModelConfig | None = Field(
        None,
        description="A separate draft model with its own KV cache mirroring the target's"
        " blocks (its shape; both caches share the cache.max_tokens byte budget);"
        " null = drafts from the target itself (MTP / Eagle-3 one-model).",
    )

    @property
    def enabled(self) -> bool:
        # Reserved tokens alone are speculative decoding too: TensorRT-LLM reserves them for
        # MTP-style drafting, and a decode step must hold them past its tokens.
        return self.max_draft_len > 0 or self.draft_model is not None or self.reserved_tokens > 0

    @property
    def reserved_tokens(self) -> int:
        """KV tokens a sequence holds past its computed ones besides the step's drafts."""
        return self.num_extra_kv_tokens + self.num_extra_decoding_steps


class RunConfig(Section):
    """How the benchmark runs."""

    mode: Literal["cache", "serve"] = Field(
        "cache",
        description="cache = replay requests one at a time; serve = iteration loop with scheduler.",
    )
    backend: Literal["none", "torch", "flashinfer", "auto"] = Field(
        "none", description="Attention data plane; none = metadata only."
    )
    seed: int = Field(0, ge=0, description="Random seed.")
    verify: Annotated[Literal["all", "sample", "off"], BeforeValidator(_off_is_false)] = Field(
        "all", description="Which attention outputs the verifier checks (YAML's bare off, read"
        " as false, means off)."
    )
    clock: Literal["modeled", "measured"] = Field(
        "modeled",
        description="Serve-mode step times: modeled (preset or hardware.profile) or measured"
        " (CUDA: the GPU time of the engine's work per step, FlashInfer data plane).",
    )
    progress: bool = Field(True, description="Show a progress bar.")


class Variant(Section):
    """A run of the same requests with some keys overridden."""

    name: str = Field(min_length=1, description="Variant name, unique within the workload.")
    set: dict[str, Any] = Field(
        default_factory=dict, description="Overrides: dotted.key -> value, as with --set."
    )


class Workload(Section):
    """A kvbench workload: model, hardware, cache, scheduler, requests, run, variants and tune."""

    name: str = Field(
        "workload",
        min_length=1,
        description="Workload name shown in results; defaults to the YAML file's stem.",
    )
    model: ModelConfig = Field(
        default_factory=ModelConfig,
        description="Attention shape: layers, heads, dtype, sliding windows.",
    )
    hardware: HardwareConfig = Field(
        default_factory=HardwareConfig, description="Hardware for the step-time model."
    )
    cache: CacheConfig = Field(default_factory=CacheConfig, description="Paged KV cache settings.")
    scheduler: SchedulerConfig = Field(
        default_factory=SchedulerConfig, description="Serve-mode scheduler."
    )
    requests: RequestsConfig = Field(default_factory=RequestsConfig, description="Request source.")
    speculative: SpeculativeConfig = Field(
        default_factory=SpeculativeConfig,
        description="Speculative decoding: draft tokens, acceptance, extra KV, draft model.",
    )
    run: RunConfig = Field(
        default_factory=RunConfig, description="Mode, data-plane backend, seed and verification."
    )
    variants: list[Variant] = Field(
        default_factory=list,
        description="Runs of the same requests with overrides; empty = one default run.",
    )
    tune: TuneConfig | None = Field(
        None, description="Search space and objectives for `kvbench tune`."
    )

    _source_path: Path | None = PrivateAttr(None)
    _source_text_sha256: str | None = PrivateAttr(None)
    _origin: Origin = PrivateAttr(default_factory=Origin)

    @field_validator("variants")
    @classmethod
    def _unique_names(cls, variants: list[Variant]) -> list[Variant]:
        first_index: dict[str, int] = {}
        for i, variant in enumerate(variants):
            if variant.name in first_index:
                first = first_index[variant.name]
                raise ValueError(
                    f"duplicate variant name {variant.name!r} (variants[{first}] and variants[{i}])"
                )
            first_index[variant.name] = i
        return variants

    @property
    def source_path(self) -> Path | None:
        """The YAML file this workload was loaded from."""
        return self._source_path

    @property
    def source_text_sha256(self) -> str | None:
        """SHA-256 of the YAML file's bytes."""
        return self._source_text_sha256

    def variant_workloads(self) -> list[tuple[str, Workload]]:
        """(name, workload) per variant, each with its overrides applied and no variants of its own;
        [("default", self)] when there are no variants."""
        if not self.variants:
            return [("default", self)]
        base = self.model_dump(exclude={"variants"})
        result = []
        for i, variant in enumerate(self.variants):
            data = copy.deepcopy(base)
            try:
                for key, value in variant.set.items():
                    set_dotted(data, key, copy.deepcopy(value))
                workload = Workload.model_validate(data)
            except BadKey as exc:
                raise InputError(self._variant_error(i, str(exc))) from None
            except ValidationError as exc:
                message = describe(exc, data, Origin(), Workload)
                raise InputError(self._variant_error(i, message)) from None
            workload._source_path = self._source_path
            workload._source_text_sha256 = self._source_text_sha256
            workload._origin = self._origin
            result.append((variant.name, workload))
        return result

    def variant_differences(self) -> dict[str, list[str]]:
        """Per variant, `key=value` for every resolved setting in which the variants differ
        (the leaf key when it names one setting, else the dotted key)."""
        runs = self.variant_workloads()
        if len(runs) < 2:
            return {}
        flat = [(name, _flatten(w.resolved_dict())) for name, w in runs]
        keys = dict.fromkeys(k for _, f in flat for k in f)
        differing = [k for k in keys if len({json.dumps(f.get(k)) for _, f in flat}) > 1]
        leaves = [k.rsplit(".", 1)[-1] for k in differing]
        shown = [leaf if leaves.count(leaf) == 1 else k for k, leaf in zip(differing, leaves)]
        return {name: [f"{label}={json.dumps(f.get(k))}" for k, label in zip(differing, shown)]
                for name, f in flat}

    def _variant_error(self, index: int, detail: str) -> str:
        location, _ = self._origin.locate(("variants", index))
        prefix = f"{location}: " if location else ""
        return f"{prefix}variants[{index}] {self.variants[index].name!r}: {detail}"

    def resolved_dict(self) -> dict:
        """The effective configuration for the result JSON (no variants, no tune)."""
        return self.model_dump(mode="json", exclude={"variants", "tune"})


def _flatten(data: dict, prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[prefix + key] = value
    return flat


def workload_json_schema() -> dict:
    """JSON Schema of the workload YAML, for editor completion."""
    return Workload.model_json_schema()


def resolve_path(workload: Workload, p: str) -> Path:
    """A path from the workload, relative to its YAML file's directory."""
    path = Path(p).expanduser()
    if path.is_absolute() or workload.source_path is None:
        return path
    return workload.source_path.parent / path


def load_workload(path: str | Path, sets: Sequence[str] = (),
                  reads: Sequence[str] = ()) -> Workload:
    """Read, override and validate a workload YAML; every problem is one InputError line.
    `reads`: keys the command uses whatever the run mode (calibrate: the batch size), so a
    --set of one is never refused as doing nothing."""
    path = Path(path)
    raw = read_input(path)
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        reason = f"not UTF-8 text ({exc.reason} at byte {exc.start})"
        raise InputError(f"{path}: cannot read: {reason}") from None
    if len(raw) > MAX_WORKLOAD_BYTES:
        raise InputError(f"{path}: {len(raw):,} bytes; a workload file holds at most "
                         f"{MAX_WORKLOAD_BYTES // 1024} KiB of settings (requests come from "
                         "requests.path or the synthetic generator)")
    data, marks = parse_yaml(text, str(path))
    if not data:
        line, column = marks[()][1]
        raise InputError(f"{path}:{line}:{column}: empty workload: expected a mapping of "
                         "workload keys (model, cache, requests, run, ...)")
    data.setdefault("name", path.stem)
    workload = _validated(data, Origin(str(path), marks, _set_keys(sets)), sets, reads)
    workload._source_path = path
    workload._source_text_sha256 = hashlib.sha256(raw).hexdigest()
    return workload


def default_workload(sets: Sequence[str] = (), reads: Sequence[str] = ()) -> Workload:
    """Every key at its default (named `default`), `sets` applied: what a command that takes
    an optional workload (`kvbench calibrate`) uses without one. `reads`: as `load_workload`."""
    data, marks = parse_yaml("name: default\n", "<defaults>")
    return _validated(data, Origin("<defaults>", marks, _set_keys(sets)), sets, reads)


def _set_keys(sets: Sequence[str]) -> list[tuple[str, ...]]:
    return [tuple(parse_set(item)[0].split(".")) for item in sets]


def _validated(data: dict, origin: Origin, sets: Sequence[str],
               reads: Sequence[str] = ()) -> Workload:
    """`data` with `sets` applied, validated (every problem one InputError line, placed by
    `origin`), its variants built; a --set that no variant uses is refused unless the command
    `reads` its key."""
    data = apply_sets(data, sets)
    try:
        workload = Workload.model_validate(data)
    except ValidationError as exc:
        raise InputError(describe(exc, data, origin, Workload)) from None
    workload._origin = origin
    # Build the variants now so that `kvbench validate` reports their errors too.
    runs = workload.variant_workloads()
    for item in sets:
        key = parse_set(item)[0]
        if key in reads:
            continue
        unused = [unused_by(key, wl) for _, wl in runs]
        if all(unused):
            raise InputError(f"--set {item}: {unused[0]}")
    return workload
