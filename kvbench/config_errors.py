"""A pydantic validation error of a workload as one line: `FILE:LINE:COL: dotted.key:
message`, pointing at the value (or key) the file or the `--set` that wrote it."""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any, Union, get_args, get_origin

from pydantic import BaseModel, ValidationError

from kvbench.yamlsource import show_value


@dataclass
class Origin:
    """Where each value of a loaded workload came from, to point errors at it."""

    file: str | None = None
    # path -> (key position, value position); positions are 1-based (line, column).
    marks: dict[tuple, tuple[tuple[int, int] | None, tuple[int, int]]] = field(
        default_factory=dict
    )
    set_keys: list[tuple[str, ...]] = field(default_factory=list)

    def locate(self, path: tuple, at_key: bool = False) -> tuple[str | None, bool]:
        """Location prefix for `path` and whether that prefix already names the path."""
        # The last --set of a key wins, so it is the one to blame.
        for key in reversed(self.set_keys):
            if path[: len(key)] == key:
                return f"--set {'.'.join(key)}", path == key
            # A key missing from a mapping that no file wrote: the --set that created it did.
            parent = path[:-1]
            if parent and parent not in self.marks and key[: len(parent)] == parent:
                return f"--set {'.'.join(key)}", False
        if self.file is None:
            return None, False
        exact = path in self.marks
        while path not in self.marks and path:
            path = path[:-1]
        key_pos, value_pos = self.marks[path]
        line, column = key_pos if at_key and exact and key_pos else value_pos
        return f"{self.file}:{line}:{column}", False


def unwrap_optional(annotation: Any) -> Any:
    if get_origin(annotation) in (Union, types.UnionType):
        members = [a for a in get_args(annotation) if a is not type(None)]
        if len(members) == 1:
            return members[0]
    return annotation


def as_model(annotation: Any) -> type[BaseModel] | None:
    annotation = unwrap_optional(annotation)
    # On Python 3.10 list[X] passes isinstance(..., type) but cannot be subclass-checked.
    is_class = get_origin(annotation) is None and isinstance(annotation, type)
    return annotation if is_class and issubclass(annotation, BaseModel) else None


def _dotted(path: tuple) -> str:
    text = ""
    for part in path:
        text += f"[{part}]" if isinstance(part, int) else (f".{part}" if text else part)
    return text


def _data_path(loc: tuple, data: Any) -> tuple[tuple, bool]:
    """The pydantic error location as a path into `data`, and whether it points at a dict key.

    Pydantic adds steps that are not in the data (union members, `[key]` for dict keys); those
    are dropped, but a missing key of a mapping is kept.
    """
    path: list = []
    at_key = False
    node = data
    for part in loc:
        if part == "[key]":
            at_key = True
        elif isinstance(node, dict) and isinstance(part, str):
            path.append(part)
            node = node.get(part)
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            path.append(part)
            node = node[part]
    return tuple(path), at_key


def _model_at(path: tuple, root: type[BaseModel]) -> type[BaseModel] | None:
    annotation: Any = root
    for part in path:
        model = as_model(annotation)
        if model is not None:
            annotation = model.model_fields[part].annotation
        else:
            # list[X] and dict[K, X] both hold X as their last type argument.
            annotation = get_args(unwrap_optional(annotation))[-1]
    return as_model(annotation)


_EXPECTED = {
    "int_type": "expected an integer",
    "float_type": "expected a number",
    "finite_number": "expected a finite number",
    "bool_type": "expected true or false",
    "string_type": "expected a string",
    "list_type": "expected a list",
    "dict_type": "expected a mapping",
    "model_type": "expected a mapping",
}
_BOUNDS = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def describe(exc: ValidationError, data: dict, origin: Origin, root: type[BaseModel]) -> str:
    """The first validation error of `root` as one line: `LOCATION: dotted.key: message`."""
    error = exc.errors(include_url=False)[0]
    path, at_key = _data_path(error["loc"], data)
    shown_path = path
    if error["type"] == "extra_forbidden":
        at_key = True
    elif at_key:
        # A rejected dict key: the message names the key, so show the mapping that holds it.
        shown_path = path[:-1]
    location, implied = origin.locate(path, at_key)
    parts = [location] if location else []
    if shown_path and not implied:
        parts.append(_dotted(shown_path))
    return ": ".join(parts + [_message(error, path, root)])


def _message(error: dict, path: tuple, root: type[BaseModel]) -> str:
    kind, ctx = error["type"], error.get("ctx", {})
    if kind == "extra_forbidden":
        return f"unknown key; expected one of: {', '.join(_model_at(path[:-1], root).model_fields)}"
    if kind == "missing":
        return "required key is missing"
    if kind == "value_error":
        # Our validators write the whole message, `(got ...)` included where it helps.
        return str(ctx["error"])
    if kind == "literal_error":
        expected = f"expected one of {ctx['expected']}"
    elif kind == "too_short":
        expected = f"expected at least {ctx['min_length']} item"
    elif kind == "string_too_short":
        expected = f"expected at least {ctx['min_length']} character"
    elif kind in _EXPECTED:
        expected = _EXPECTED[kind]
    elif bounds := [b for b in _BOUNDS if b in ctx]:
        expected = f"expected a value {_BOUNDS[bounds[0]]} {ctx[bounds[0]]:g}"
    else:
        expected = error["msg"]
    return f"{expected} (got {show_value(error['input'])})"
