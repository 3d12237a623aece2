"""Workload YAML -> validated pydantic models, with `--set` overrides and one-line
`FILE:LINE:COL: dotted.key: message` errors (DESIGN.md sections 3 and 4)."""

from __future__ import annotations

import copy
import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, NamedTuple, Union

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PositiveInt,
    PrivateAttr,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from kvbench.cache.ids import Retention, TokenRangeRetention
from kvbench.config_errors import Origin, as_model, describe, unwrap_optional
from kvbench.errors import InputError
from kvbench.metrics import DEFAULT_OBJECTIVES, direction
from kvbench.yamlsource import MAX_WORKLOAD_BYTES, parse_value, parse_yaml, show_value

_DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4, "fp8": 1}


class _BadKey(ValueError):
    """A dotted key that names no workload field, or cannot be set in the data."""


MAX_WINDOW = 2**31 - 1
"""Largest attention window: TensorRT-LLM's max_attention_window is an int32; a longer window
is full attention anyway."""


def _is_positive_int(value: Any, limit: int = MAX_WINDOW) -> bool:
    # bool is an int subclass, and `true` must not silently mean a window of 1.
    return isinstance(value, int) and not isinstance(value, bool) and 0 < value <= limit


def _require_number(value: Any) -> Any:
    # Checked before the int|float union so a bad value gets one clear message instead of one
    # error per union member.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number (got {show_value(value)})")
    return value


Number = Annotated[Union[int, float], BeforeValidator(_require_number)]


def _off_is_false(value: Any) -> Any:
    # YAML 1.1 reads a bare `off` (and `no`) as false; `verify: off` means the word.
    return "off" if value is False else value


class _Section(BaseModel):
    # strict: YAML already types its scalars, so "32" or true where an int belongs is a mistake.
    model_config = ConfigDict(extra="forbid", strict=True)


class ModelConfig(_Section):
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
        "bfloat16", description="KV cache element type."
    )
    attention_window: Union[PositiveInt, list[Union[PositiveInt, None]], None] = Field(
        None,
        description="Sliding window in tokens: int, or list of int/null repeated over layers"
        " (null = full attention).",
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


class HardwareConfig(_Section):
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


class SLRUConfig(_Section):
    """Segmented LRU with a ghost history (`cache.eviction_policy: slru`)."""

    protected_ratio: float = Field(
        0.8, gt=0, lt=1, description="Most of the pool the protected segment may hold.")
    history_ratio: float = Field(
        8.0, gt=0, description="Keys remembered, as a multiple of the pool's blocks.")


class S3FIFOConfig(_Section):
    """S3-FIFO (`cache.eviction_policy: s3fifo`)."""

    small_ratio: float = Field(
        0.1, gt=0, lt=1, description="Share of the pool the small FIFO aims at.")
    max_freq: int = Field(3, ge=1, le=255, description="Accesses counted per block.")
    history_ratio: float = Field(
        1.0, gt=0, description="Ghost keys remembered, as a multiple of the pool's blocks.")


class GDSFConfig(_Section):
    """Depth- and chain-aware GDSF (`cache.eviction_policy: gdsf`)."""

    freq_weight: float = Field(
        1.0, ge=0, description="Score gained per earlier use of the block's key.")
    max_freq: int = Field(16, ge=1, le=255, description="Uses beyond this count no more.")
    history_ratio: float = Field(
        8.0, gt=0, description="Keys remembered, as a multiple of the pool's blocks.")


class PredictiveConfig(_Section):
    """Online-learnt reuse chance per use-count class (`cache.eviction_policy: predictive`)."""

    horizon_ratio: float = Field(
        16.0, gt=0, description="Reuse counts as soon within this many pool sizes of traffic.")
    boost: float = Field(
        4.0, ge=0, description="Horizons a block with certain reuse is kept past LRU order.")
    max_class: int = Field(6, ge=1, le=255, description="Use counts told apart (more share the last).")
    prior: float = Field(0.2, ge=0, le=1, description="Reuse chance of a class with no data.")
    prior_weight: float = Field(20.0, gt=0, description="Pseudo-uses the prior counts for.")
    history_ratio: float = Field(
        8.0, gt=0, description="Keys remembered, as a multiple of the pool's blocks.")


class PolicyConfig(_Section):
    """Parameters of each eviction policy; only the chosen one's are used."""

    slru: SLRUConfig = Field(default_factory=SLRUConfig, description="slru parameters.")
    s3fifo: S3FIFOConfig = Field(default_factory=S3FIFOConfig, description="s3fifo parameters.")
    gdsf: GDSFConfig = Field(default_factory=GDSFConfig, description="gdsf parameters.")
    predictive: PredictiveConfig = Field(
        default_factory=PredictiveConfig, description="predictive parameters.")


class CacheConfig(_Section):
    """Paged KV cache; keys mean what they mean in TensorRT-LLM's KvCacheConfig."""

    tokens_per_block: int = Field(32, gt=0, description="Block size in tokens.")
    max_tokens: int = Field(
        65536,
        gt=0,
        validate_default=True,
        description="GPU KV budget in tokens of the whole model"
        " (bytes = max_tokens x KV bytes per token over all layers).",
    )
    host_offload_ratio: float = Field(
        0.0, ge=0, description="Host tier capacity / GPU tier capacity; 0 = no host tier."
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

    eviction_policy: Literal["lru", "slru", "s3fifo", "gdsf", "predictive"] = Field(
        "lru",
        description="Order of free cached GPU blocks inside a retention priority level:"
        " lru (TensorRT-LLM), slru, s3fifo, gdsf, predictive.",
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


class SchedulerConfig(_Section):
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


class SpeculativeConfig(_Section):
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
        return self.max_draft_len > 0 or self.draft_model is not None

    @property
    def reserved_tokens(self) -> int:
        """KV tokens a sequence holds past its computed ones besides the step's drafts."""
        return self.num_extra_kv_tokens + self.num_extra_decoding_steps


class SyntheticConfig(_Section):
    """Synthetic traffic generator."""

    generator: Literal["shared_prefix", "multi_turn"] = Field(
        "multi_turn", description="Traffic shape."
    )
    num_requests: int = Field(200, gt=0, description="Number of requests.")
    system_prompt_tokens: int = Field(
        1024, ge=0, description="Shared system prompt length in tokens."
    )
    prompt_tokens: int = Field(
        256, gt=0, description="Mean new user tokens per request: the question (shared_prefix)"
        " or the user message of a turn (multi_turn)."
    )
    profile_tokens: int | None = Field(
        None, ge=0, description="shared_prefix: tokens of each user's fixed profile between the"
        " system prompt and the question; null = prompt_tokens."
    )
    prompt_tokens_spread: float = Field(
        0.5, ge=0, le=1, description="Uniform +-spread of prompt_tokens, as a fraction of the mean."
    )
    output_tokens: int = Field(128, gt=0, description="Mean output tokens per request.")
    num_users: int = Field(16, gt=0, description="Distinct users (sessions).")
    turns: int = Field(4, gt=0, description="Turns per session (multi_turn).")
    arrival: Literal["poisson", "burst"] = Field("poisson", description="Arrival process.")
    rate: float = Field(4.0, gt=0, description="Mean arrival rate in requests/s.")
    vocab_size: int = Field(32000, gt=0, description="Token ids are drawn from [0, vocab_size).")


class SessionsConfig(_Section):
    """When sessions that carry no absolute time start (weka conversations, untimed traces)."""

    start: Literal["back_to_back", "stagger", "poisson"] = Field(
        "back_to_back",
        description="back_to_back = each when the previous one's last request arrives; "
        "stagger = every interval_s; poisson = exponential gaps at rate.",
    )
    interval_s: float | None = Field(
        None, gt=0, validate_default=True, description="stagger: seconds between session starts."
    )
    rate: float | None = Field(
        None, gt=0, validate_default=True, description="poisson: sessions started per second."
    )

    @field_validator("interval_s")
    @classmethod
    def _interval_for_stagger(cls, value: float | None, info: ValidationInfo) -> float | None:
        return _needed_by(value, info, "stagger", "interval_s")

    @field_validator("rate")
    @classmethod
    def _rate_for_poisson(cls, value: float | None, info: ValidationInfo) -> float | None:
        return _needed_by(value, info, "poisson", "rate")


def _needed_by(value, info: ValidationInfo, start: str, key: str):
    chosen = info.data.get("start")
    if chosen == start and value is None:
        raise ValueError(f"required when requests.sessions.start is '{start}'")
    if chosen is not None and chosen != start and value is not None:
        raise ValueError(f"only used when requests.sessions.start is '{start}' (got {show_value(value)})")
    return value

class TokenRangeRetentionConfig(_Section):
    """Retention of the prompt blocks that start in tokens [start, end)."""

    start: int = Field(ge=0, description="First prompt token of the range.")
    end: int | None = Field(
        None, gt=0, description="One past the last token; null = to the end of the prompt."
    )
    priority: int = Field(ge=0, le=100, description="Retention priority 0..100 (default 35).")
    duration_ms: Number | None = Field(
        None,
        gt=0,
        description="Time a freed block keeps the priority before it drops to 35; null = always.",
    )


class RetentionConfig(_Section):
    """Retention priorities of every request's blocks, as TensorRT-LLM's
    KvCacheRetentionConfig: lower priorities are evicted first, each level in LRU order."""

    token_ranges: list[TokenRangeRetentionConfig] = Field(
        default_factory=list,
        description="Priorities of prompt blocks by token range (sorted, non-overlapping); a"
        " block takes the range holding its first token, others keep 35.",
    )
    decode_priority: int = Field(
        35, ge=0, le=100, description="Retention priority of the blocks generated in decode."
    )
    decode_duration_ms: Number | None = Field(
        None, gt=0, description="Duration of decode_priority; null = always."
    )

    @model_validator(mode="after")
    def _ranges_ordered(self) -> RetentionConfig:
        prev = None
        for i, r in enumerate(self.token_ranges):
            if r.end is not None and r.end <= r.start:
                raise ValueError(f"token_ranges[{i}]: expected end > start (got start={r.start},"
                                 f" end={r.end})")
            if prev is not None and (prev.end is None or r.start < prev.end):
                raise ValueError(f"token_ranges[{i}]: expected ranges sorted by start and not"
                                 " overlapping")
            prev = r
        return self

    def to_retention(self) -> Retention:
        return Retention(
            tuple(TokenRangeRetention(r.start, r.end, r.priority, r.duration_ms)
                  for r in self.token_ranges),
            self.decode_priority, self.decode_duration_ms)


class EncoderConfig(_Section):
    """Encoder inputs of encoder-decoder requests (e.g. audio frames of a Whisper-style model):
    their cross-attention KV goes to a cache of its own (`cache.cross_kv_cache_fraction`)."""

    tokens: int = Field(0, ge=0, description="Mean encoder tokens per input; 0 = no encoder.")
    tokens_spread: float = Field(
        0.0, ge=0, le=1, description="Uniform +-spread of tokens, as a fraction of the mean."
    )
    distinct_inputs: int = Field(
        16, gt=0, description="Distinct encoder inputs; requests pick one uniformly (seeded)."
    )
    fraction: float = Field(
        1.0, ge=0, le=1, description="Share of requests that carry an encoder input."
    )


class RequestsConfig(_Section):
    """Where requests come from."""

    source: Literal["synthetic", "trace"] = Field(
        "synthetic", description="synthetic generator or trace file."
    )
    format: Literal["auto", "mooncake", "bailian", "servegen", "weka", "token_ids",
                    "lengths_csv"] = Field(
        "auto", description="Trace format; auto = sniffed from the first record."
    )
    path: str | None = Field(
        None,
        validate_default=True,
        description="Trace file (a folder for weka), relative to the YAML file; required when "
        "source is trace.",
    )
    block_tokens: int | None = Field(
        None, gt=0, le=1 << 20,
        description="Tokens per hash id; null = the format's (mooncake 512, bailian and "
        "servegen 16, weka the file's block_size).",
    )
    hash_ids_cover: Literal["ceil", "floor", "auto"] | None = Field(
        None,
        description="ceil = one id per block incl. the partial last one; floor = full blocks "
        "only; auto = detected per trace; null = the format's (weka floor, others ceil).",
    )
    sessions: SessionsConfig = Field(
        default_factory=SessionsConfig, description="Start times of sessions without them."
    )
    output_length: int = Field(
        128, ge=0, description="Output tokens of each request of a trace that records none "
        "(servegen)."
    )
    limit: int | None = Field(None, gt=0, description="Use only the first N requests.")
    skip: int = Field(
        0, ge=0, description="Drop the first N requests first (limit counts from there); the"
        " rest keeps its arrival times, shifted to start at 0.")
    time_scale: float = Field(1.0, gt=0, description="Arrival times are multiplied by this.")
    synthetic: SyntheticConfig = Field(
        default_factory=SyntheticConfig, description="Synthetic generator settings."
    )
    beam_width: int = Field(
        1, ge=1, le=64, description="Beams per request (beam search), unless beam_widths is set."
    )
    encoder: EncoderConfig = Field(
        default_factory=EncoderConfig,
        description="Encoder inputs (encoder-decoder requests); off unless encoder.tokens > 0.",
    )
    beam_widths: list[Annotated[int, Field(ge=1, le=64)]] | None = Field(
        None,
        min_length=1,
        description="Per request, a beam width drawn uniformly (seeded by run.seed) from this list.",
    )
    retention: RetentionConfig | None = Field(
        None,
        description="Retention priorities of every request's blocks (e.g. keep the system"
        " prompt); null = every block at the default priority 35.",
    )

    @field_validator("path")
    @classmethod
    def _path_matches_source(cls, value: str | None, info: ValidationInfo) -> str | None:
        source = info.data.get("source")
        if source == "trace" and value is None:
            raise ValueError("required when requests.source is 'trace'")
        if source == "synthetic" and value is not None:
            raise ValueError(f"only used when requests.source is 'trace' (got {show_value(value)})")
        return value


class RunConfig(_Section):
    """How the benchmark runs."""

    mode: Literal["cache", "serve"] = Field(
        "cache",
        description="cache = replay requests one at a time; serve = iteration loop with scheduler.",
    )
    backend: Literal["none", "torch", "flashinfer", "auto"] = Field(
        "none", description="Attention data plane; none = metadata only."
    )
    seed: int = Field(0, description="Random seed.")
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


class Variant(_Section):
    """A run of the same requests with some keys overridden."""

    name: str = Field(min_length=1, description="Variant name, unique within the workload.")
    set: dict[str, Any] = Field(
        default_factory=dict, description="Overrides: dotted.key -> value, as with --set."
    )


def _check_dotted_key(key: str) -> str:
    """Raise _BadKey unless `key` names a workload field, walking sub-models."""
    model: type[BaseModel] | None = Workload
    parts = key.split(".")
    for i, part in enumerate(parts):
        if model is None:
            raise _BadKey(f"unknown key {key}; {'.'.join(parts[:i])} has no sub-keys")
        if part not in model.model_fields:
            raise _BadKey(f"unknown key {key}; expected one of: {', '.join(model.model_fields)}")
        model = as_model(model.model_fields[part].annotation)
    return key


def key_annotation(key: str) -> Any:
    """The type annotation of a dotted workload key (already checked to exist), `X | None`
    unwrapped to `X`."""
    model: type[BaseModel] | None = Workload
    annotation: Any = None
    for part in key.split("."):
        annotation = unwrap_optional(model.model_fields[part].annotation)
        model = as_model(annotation)
    return annotation


class SpaceEntry(_Section):
    """One tuned parameter: either `choices`, or a `low`..`high` range."""

    choices: list[Any] | None = Field(
        None, min_length=1, description="Categorical values to try."
    )
    low: Number | None = Field(None, description="Range lower bound (inclusive).")
    high: Number | None = Field(None, description="Range upper bound (inclusive).")
    log: bool = Field(False, description="Sample the range on a log scale.")
    step: Number | None = Field(None, description="Range step; null = continuous.")

    @model_validator(mode="after")
    def _one_form(self) -> SpaceEntry:
        # By value, not by keys given: a model_dump() round trip (variants) writes every key.
        ranged = any(v is not None for v in (self.low, self.high, self.step)) or self.log
        if self.choices is not None:
            if ranged:
                raise ValueError("expected either choices or low/high/log/step, not both")
            return self
        if self.low is None or self.high is None:
            raise ValueError("expected either choices, or both low and high")
        if self.low >= self.high:
            raise ValueError(f"expected low < high (got low={self.low}, high={self.high})")
        if self.step is not None and self.step <= 0:
            raise ValueError(f"expected step > 0 (got {self.step})")
        if self.log and self.step is not None:
            raise ValueError("expected log or step, not both")
        if self.log and self.low <= 0:
            raise ValueError(f"expected low > 0 with log (got {self.low})")
        return self


class Objective(_Section):
    """A metric the tuner optimizes."""

    metric: str = Field(
        min_length=1, description="Result metric name, e.g. throughput_tokens_per_s."
    )
    direction: Literal["maximize", "minimize"] = Field(
        description="Whether larger or smaller is better."
    )


class Constraint(NamedTuple):
    """A parsed tune constraint: `metric op value`."""

    metric: str
    op: str
    value: float


_CONSTRAINT = re.compile(
    r"\s*(?P<metric>[A-Za-z_]\w*(?:\.\w+)*)\s*(?P<op><=|>=|<|>)\s*"
    r"(?P<value>[-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)\s*"
)


def parse_constraint(text: str) -> Constraint:
    """Parse `metric.path OP number` (OP in <=, >=, <, >); ValueError when malformed."""
    match = _CONSTRAINT.fullmatch(text)
    if match is None:
        raise ValueError(
            f"expected 'metric.path OP number' with OP one of <=, >=, <, > (got {show_value(text)})"
        )
    return Constraint(match["metric"], match["op"], float(match["value"]))


def _check_constraint(text: str) -> str:
    parse_constraint(text)
    return text


def _default_objectives() -> list[Objective]:
    """The registry's default objectives, each in its compare rule's direction."""
    return [Objective(metric=name, direction=direction(name)) for name in DEFAULT_OBJECTIVES]


class TuneConfig(_Section):
    """Optuna study over workload keys."""

    space: dict[Annotated[str, AfterValidator(_check_dotted_key)], SpaceEntry] = Field(
        min_length=1, description="Tuned parameters: dotted.key -> choices or low/high range."
    )
    objectives: list[Objective] = Field(
        default_factory=_default_objectives, min_length=1, description="Metrics to optimize."
    )
    constraints: list[Annotated[str, AfterValidator(_check_constraint)]] = Field(
        default_factory=list, description="Feasibility limits like 'ttft_ms.p99 <= 2000'."
    )
    sampler: Literal["tpe", "nsgaii", "gp", "random", "grid"] = Field(
        "tpe", description="Optuna sampler."
    )
    seed: int | None = Field(None, description="Sampler seed.")
    n_trials: int = Field(20, gt=0, description="Number of trials.")

    @property
    def parsed_constraints(self) -> list[Constraint]:
        """The constraints as (metric path, op, value)."""
        return [parse_constraint(text) for text in self.constraints]


class Workload(_Section):
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
                    _set_dotted(data, key, copy.deepcopy(value))
                workload = Workload.model_validate(data)
            except _BadKey as exc:
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


def parse_set(item: str) -> tuple[str, Any]:
    """Split `dotted.key=value`; the value is YAML, so `3`, `true` and `[1, null]` are typed."""
    key, sep, text = item.partition("=")
    key = key.strip()
    if not sep or not key:
        raise InputError(f"--set {item}: expected dotted.key=value")
    return key, parse_value(text, key, item)


def apply_sets(data: dict, sets: Iterable[str] | Mapping[str, Any]) -> dict:
    """A deep copy of `data` with overrides applied: `key=value` strings or a key->value mapping."""
    result = copy.deepcopy(data)
    if isinstance(sets, Mapping):
        entries = [(key, value, key) for key, value in sets.items()]
    else:
        entries = [(*parse_set(item), item) for item in sets]
    for key, value, label in entries:
        try:
            _set_dotted(result, key, value)
        except _BadKey as exc:
            raise InputError(f"--set {label}: {exc}") from None
    return result


def _set_dotted(data: dict, key: str, value: Any) -> None:
    _check_dotted_key(key)
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise _BadKey(
                f"cannot set {key}: {'.'.join(parents[: i + 1])} is not a mapping"
                f" (got {show_value(child)})"
            )
        node = child
    node[leaf] = value


def load_workload(path: str | Path, sets: Sequence[str] = ()) -> Workload:
    """Read, override and validate a workload YAML; every problem is one InputError line."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise InputError(f"{path}: cannot read: {exc.strerror or exc}") from None
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
    data = apply_sets(data, sets)
    origin = Origin(str(path), marks, [tuple(parse_set(item)[0].split(".")) for item in sets])
    try:
        workload = Workload.model_validate(data)
    except ValidationError as exc:
        raise InputError(describe(exc, data, origin, Workload)) from None
    workload._source_path = path
    workload._source_text_sha256 = hashlib.sha256(raw).hexdigest()
    workload._origin = origin
    # Build the variants now so that `kvbench validate` reports their errors too.
    runs = workload.variant_workloads()
    for item in sets:
        key = parse_set(item)[0]
        unused = [_unused_by(key, wl) for _, wl in runs]
        if all(unused):
            raise InputError(f"--set {item}: {unused[0]}")
    return workload


def _unused_by(key: str, wl: Workload) -> str | None:
    """Why `key` does nothing in `wl` (a setting of a section it does not use), else None."""
    if key.startswith("requests.synthetic.") and wl.requests.source != "synthetic":
        return (f"requests.synthetic is not used: this workload reads requests from a "
                f"{wl.requests.source} (requests.source: {wl.requests.source})")
    if key.startswith("scheduler.") and wl.run.mode != "serve":
        return "the scheduler is not used in run.mode: cache (it runs in serve mode)"
    if key.startswith("tune.") and wl.tune is None:
        return "this workload has no tune: section to override"
    return None
