"""Reading YAML from a user, bounded and located: the workload file (every key's and value's
line:column kept for error messages) and `--set` values. Sizes, nesting and alias expansion are
bounded before anything walks the values; every problem is one InputError line."""

from __future__ import annotations

import json
import re
from typing import Any

import yaml

from kvbench.errors import InputError


class Loader(getattr(yaml, "CSafeLoader", yaml.SafeLoader)):
    """SafeLoader (libyaml's when PyYAML has it: a 64 KiB file parses in a fraction of a
    second) that also reads `1e15` and `3.35e12` as floats: YAML 1.1 wants `1.0e+15`, and
    strict validation would reject the string that plain PyYAML makes of them."""


Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+.0123456789"),
)

MAX_WORKLOAD_BYTES = 64 * 1024
"""Workload files are settings, not data (traces are read from `requests.path`): a bigger file
is refused before it is parsed, which bounds the time and memory of parsing it."""

MAX_YAML_DEPTH = 32
"""Nesting a workload file may use (a workload needs about 5 levels)."""

MAX_YAML_NODES = 100_000
"""Nodes of the document with every alias expanded. Aliases share what they point to, so a
few hundred bytes can stand for billions of nodes (an alias bomb); everything after parsing
walks the expanded values, so their number is bounded before anything does."""


class YamlLimit(Exception):
    """A document past a parsing bound: where, and which bound."""

    def __init__(self, mark, message: str) -> None:
        super().__init__(message)
        self.mark = mark


def check_bounds(root: yaml.Node) -> None:
    """Refuse (`YamlLimit`) a composed document whose nesting passes MAX_YAML_DEPTH, whose
    aliases expand it past MAX_YAML_NODES, that contains itself, or that gives a mapping one
    key twice (YAML forbids it; PyYAML would keep the last silently). Aliases are one shared node
    in the composed graph, so a post-order walk with sizes memoized per node is linear in the
    text, however far the aliases would expand."""
    size: dict[int, int] = {}
    height: dict[int, int] = {}
    on_path: set[int] = set()
    stack: list[tuple[yaml.Node, bool]] = [(root, False)]
    while stack:
        node, finished = stack.pop()
        key = id(node)
        children = _children(node)
        if finished:
            on_path.discard(key)
            size[key] = 1 + sum(size[id(c)] for c in children)
            height[key] = 1 + max((height[id(c)] for c in children), default=0)
            if size[key] > MAX_YAML_NODES:
                raise YamlLimit(node.start_mark, f"aliases expand the document past "
                                 f"{MAX_YAML_NODES:,} values (an alias bomb?)")
            continue
        if key in size:
            continue
        if isinstance(node, yaml.MappingNode):
            _check_unique_keys(node)
        on_path.add(key)
        stack.append((node, True))
        for child in children:
            if id(child) in on_path:
                raise YamlLimit(node.start_mark, "an alias here refers to a node that "
                                 "contains it")
            if id(child) not in size:
                stack.append((child, False))
    if height[id(root)] > MAX_YAML_DEPTH:
        node = root
        for _ in range(MAX_YAML_DEPTH):
            node = max(_children(node), key=lambda c: height[id(c)])
        raise YamlLimit(node.start_mark, f"nested deeper than {MAX_YAML_DEPTH} levels")


def _check_unique_keys(node: yaml.MappingNode) -> None:
    # Before construction, so keys a `<<` merge brings (which the mapping's own may override)
    # are not among them yet.
    first: dict = {}
    for key_node, _ in node.value:
        if not isinstance(key_node, yaml.ScalarNode) or key_node.tag.endswith(":merge"):
            continue
        seen = first.setdefault((key_node.tag, key_node.value), key_node)
        if seen is not key_node:
            raise YamlLimit(key_node.start_mark, f"duplicate key {key_node.value!r} (first at "
                             f"line {seen.start_mark.line + 1})")


def _children(node: yaml.Node) -> list[yaml.Node]:
    if isinstance(node, yaml.MappingNode):
        return [n for pair in node.value for n in pair]
    if isinstance(node, yaml.SequenceNode):
        return node.value
    return []


def show_value(value: Any) -> str:
    """Render an offending value for `(got VALUE)`, short enough for one line."""
    if isinstance(value, dict):
        return "a mapping"
    if isinstance(value, str):
        text = repr(value)
    else:
        text = json.dumps(value, default=str, ensure_ascii=False)
    return text if len(text) <= 60 else text[:57] + "..."


def parse_value(text: str, key: str, item: str) -> Any:
    """The YAML value of `--set item` (`key=text`), typed (`3`, `true`, `[1, null]`)."""
    try:
        loader = Loader(text)
        try:
            node = loader.get_single_node()
            if node is not None:
                check_bounds(node)
            value = loader.construct_document(node) if node is not None else None
        finally:
            loader.dispose()
    except yaml.reader.ReaderError as exc:
        raise InputError(f"--set {key}: {_unprintable(exc)}") from None
    except YamlLimit as exc:
        raise InputError(f"--set {key}: {exc}") from None
    except yaml.YAMLError as exc:
        problem = getattr(exc, "problem", None) or one_line(exc)
        raise InputError(f"--set {item}: YAML syntax error in value: {problem}") from None
    return value


def one_line(exc: Exception) -> str:
    return " ".join(str(exc).split())


def _position(node: yaml.Node) -> tuple[int, int]:
    return node.start_mark.line + 1, node.start_mark.column + 1


def parse_yaml(text: str, file: str) -> tuple[dict, dict]:
    try:
        loader = Loader(text)
    except yaml.reader.ReaderError as exc:
        raise InputError(f"{file}:{_reader_position(text, exc)}: YAML syntax error: "
                         f"{_unprintable(exc)}") from None
    try:
        root = loader.get_single_node()
        if root is not None:
            check_bounds(root)
        data = loader.construct_document(root) if root is not None else {}
        marks: dict = {(): (None, _position(root) if root is not None else (1, 1))}
        if not isinstance(data, dict):
            line, column = marks[()][1]
            raise InputError(
                f"{file}:{line}:{column}: expected a mapping of workload keys (got {show_value(data)})"
            )
        if root is not None:
            _collect_marks(root, (), marks, loader, file, set())
    except YamlLimit as exc:
        mark = exc.mark
        raise InputError(f"{file}:{mark.line + 1}:{mark.column + 1}: {exc}") from None
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"{file}:{mark.line + 1}:{mark.column + 1}" if mark else file
        raise InputError(f"{where}: YAML syntax error: {exc.problem or exc.context}") from None
    except yaml.reader.ReaderError as exc:
        raise InputError(f"{file}:{_reader_position(text, exc)}: YAML syntax error: "
                         f"{_unprintable(exc)}") from None
    except yaml.YAMLError as exc:
        raise InputError(f"{file}: YAML syntax error: {one_line(exc)}") from None
    except RecursionError:  # PyYAML without libyaml composes recursively
        raise InputError(f"{file}: nested deeper than {MAX_YAML_DEPTH} levels") from None
    finally:
        loader.dispose()
    return data, marks


def _reader_position(text: str, exc: yaml.reader.ReaderError) -> str:
    before = text[: exc.position]
    return f"{before.count(chr(10)) + 1}:{exc.position - (before.rfind(chr(10)) + 1) + 1}"


def _unprintable(exc: yaml.reader.ReaderError) -> str:
    code = exc.character if isinstance(exc.character, int) else ord(exc.character)
    return f"character U+{code:04X} is not allowed in YAML"


def _collect_marks(
    node: yaml.Node, path: tuple, marks: dict, loader: Loader, file: str, active: set
) -> None:
    # Runs after construction, which has already folded `<<` merge keys into the mapping nodes.
    # `active` holds the nodes on the current path: an alias may refer back to its own ancestor.
    if id(node) in active:
        return
    active.add(id(node))
    if isinstance(node, yaml.MappingNode):
        for key_node, value_node in node.value:
            key = loader.construct_object(key_node)
            if not isinstance(key, str):
                line, column = _position(key_node)
                raise InputError(f"{file}:{line}:{column}: keys must be strings (got {show_value(key)})")
            marks[path + (key,)] = (_position(key_node), _position(value_node))
            _collect_marks(value_node, path + (key,), marks, loader, file, active)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            marks[path + (i,)] = (None, _position(item))
            _collect_marks(item, path + (i,), marks, loader, file, active)
    active.discard(id(node))
