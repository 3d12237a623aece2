"""The `tune:` section models: the search space over workload keys, the objectives and the
constraints (`parse_constraint`)."""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, NamedTuple

from pydantic import AfterValidator, Field, model_validator

from kvbench.config_base import Number, Section
from kvbench.config_keys import check_dotted_key
from kvbench.metrics import DEFAULT_OBJECTIVES, direction
from kvbench.yamlsource import show_value


class SpaceEntry(Section):
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


class Objective(Section):
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


class TuneConfig(Section):
    """Optuna study over workload keys."""

    space: dict[Annotated[str, AfterValidator(check_dotted_key)], SpaceEntry] = Field(
        min_length=1, description="Tuned parameters: dotted.key -> choices or low/high range."
    )
    objectives: list[Objective] = Field(
        default_factory=_default_objectives, min_length=1,
        description="Metrics to optimize; default: " + ", ".join(
            f"{name} ({direction(name)})" for name in DEFAULT_OBJECTIVES) + ".",
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
