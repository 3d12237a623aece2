"""The `requests:` section models: the synthetic generator, trace reading, session starts,
encoder inputs, beams and retention priorities."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from kvbench.cache.ids import Retention, TokenRangeRetention
from kvbench.config_base import Number, Section
from kvbench.yamlsource import show_value


class SyntheticConfig(Section):
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


class SessionsConfig(Section):
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
    turn_interval_s: float = Field(
        30.0, ge=0, le=1e9, description="Seconds between the turns of a conversation whose "
        "trace gives no times (chat traces)."
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

class TokenRangeRetentionConfig(Section):
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


class RetentionConfig(Section):
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


class EncoderConfig(Section):
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


class RequestsConfig(Section):
    """Where requests come from."""

    source: Literal["synthetic", "trace"] = Field(
        "synthetic", description="synthetic generator or trace file."
    )
    format: Literal["auto", "mooncake", "bailian", "servegen", "weka", "token_ids",
                    "lengths_csv", "chat"] = Field(
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
        "(ServeGen's content-hash traces, chat requests without max_tokens)."
    )
    tokenizer: str = Field(
        "approx", min_length=1, description="Chat traces: approx (built in, approximate counts)"
        " or a Hugging Face tokenizer.json (or its folder), relative to the YAML file."
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

    @field_validator("tokenizer")
    @classmethod
    def _tokenizer_for_traces(cls, value: str, info: ValidationInfo) -> str:
        if value != "approx" and info.data.get("source") == "synthetic":
            raise ValueError("only used by chat traces (requests.source: trace), not by the "
                             "synthetic generator")
        return value
