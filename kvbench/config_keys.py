"""Dotted workload keys (`cache.tokens_per_block`): checked against the workload model, their
type, and overrides (`--set`, a variant's `set:`) applied to the YAML data before validation.

The keys name fields of `config.Workload`, whose module imports this one (and whose `tune:`
section checks its keys here), so the model is looked up when a key is resolved."""

from __future__ import annotations

import copy
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel

from kvbench.config_errors import as_model, unwrap_optional
from kvbench.errors import InputError
from kvbench.yamlsource import parse_value, show_value

if TYPE_CHECKING:
    from kvbench.config import Workload


class BadKey(ValueError):
    """A dotted key that names no workload field, or cannot be set in the data."""

def check_dotted_key(key: str) -> str:
    """Raise BadKey unless `key` names a workload field, walking sub-models."""
    model: type[BaseModel] | None = _workload()
    parts = key.split(".")
    for i, part in enumerate(parts):
        if model is None:
            raise BadKey(f"unknown key {key}; {'.'.join(parts[:i])} has no sub-keys")
        if part not in model.model_fields:
            raise BadKey(f"unknown key {key}; expected one of: {', '.join(model.model_fields)}")
        model = as_model(model.model_fields[part].annotation)
    return key


def key_annotation(key: str) -> Any:
    """The type annotation of a dotted workload key (already checked to exist), `X | None`
    unwrapped to `X`."""
    model: type[BaseModel] | None = _workload()
    annotation: Any = None
    for part in key.split("."):
        annotation = unwrap_optional(model.model_fields[part].annotation)
        model = as_model(annotation)
    return annotation

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
            set_dotted(result, key, value)
        except BadKey as exc:
            raise InputError(f"--set {label}: {exc}") from None
    return result


def set_dotted(data: dict, key: str, value: Any) -> None:
    check_dotted_key(key)
    *parents, leaf = key.split(".")
    node = data
    for i, part in enumerate(parents):
        child = node.get(part)
        if child is None:
            child = node[part] = {}
        elif not isinstance(child, dict):
            raise BadKey(
                f"cannot set {key}: {'.'.join(parents[: i + 1])} is not a mapping"
                f" (got {show_value(child)})"
            )
        node = child
    node[leaf] = value

def unused_by(key: str, wl: Workload) -> str | None:
    """Why `key` does nothing in `wl` (a setting of a section it does not use), else None."""
    if key.startswith("requests.synthetic.") and wl.requests.source != "synthetic":
        return (f"requests.synthetic is not used: this workload reads requests from a "
                f"{wl.requests.source} (requests.source: {wl.requests.source})")
    if key.startswith("scheduler.") and wl.run.mode != "serve":
        return "the scheduler is not used in run.mode: cache (it runs in serve mode)"
    if key.startswith("tune.") and wl.tune is None:
        return "this workload has no tune: section to override"
    return None


def _workload() -> type[BaseModel]:
    from kvbench.config import Workload
    return Workload
