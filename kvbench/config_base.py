"""The base of every workload section model and the value type sections share: a section is
strict (YAML types its scalars) and forbids unknown keys; `Number` is an int or a float, never
a bool."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import BaseModel, BeforeValidator, ConfigDict

from kvbench.yamlsource import show_value


def _require_number(value: Any) -> Any:
    # Checked before the int|float union so a bad value gets one clear message instead of one
    # error per union member.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"expected a number (got {show_value(value)})")
    return value


Number = Annotated[Union[int, float], BeforeValidator(_require_number)]

MAX_RATIO = 1024.0
"""The largest multiple of the pool a policy or the host tier may size or weigh something by: a
larger one would allocate beyond any machine's memory or overflow 64-bit scores."""


class Section(BaseModel):
    # strict: YAML already types its scalars, so "32" or true where an int belongs is a mistake.
    # No float is infinite or NaN: every one sizes, scales or weighs something.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)
