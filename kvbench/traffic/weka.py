"""Reader for kv-cache-tester / AIPerf `weka_trace` conversations: a folder of JSON files (or
one file), one conversation each.

Top level: `id`, `models`, `block_size` (tokens per hash id), `hash_id_scope` (`local`: ids mean
something only inside this file; `global`: across files; default local), `tool_tokens`,
`system_tokens` and `requests[]`. A request has `t` (seconds from the conversation's start),
`type` (`n` or `s`), `model`, `in`, `out` and `hash_ids` (full blocks only: floor); a `subagent`
entry holds its own `requests[]` whose `t` counts from the spawn (the entry's `t`). Sub-agents
are flattened into the stream at their absolute times.

Ids are remapped along their chain from a root per model (different models never share KV) and,
with local scope, per file. Conversations carry no absolute start, so `requests.sessions`
decides when each starts (files in name order). The whole folder is read before the first
request is returned (conversations interleave in time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvbench.errors import InputError
from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.tracefile import (
    MAX_BLOCK_TOKENS,
    BadField,
    ChainedIds,
    Cover,
    LocatedDict,
    TraceOptions,
    TraceReader,
    UnitCheck,
    chained_hash_ids,
    check_int,
    fail,
    json_type,
    load_located_json,
    need,
    need_int,
    need_list,
    need_number,
    need_str,
    session_starts,
    show,
)

_TYPES = ("n", "s", "subagent")
_CONVERSATION_SUFFIXES = (".json", ".json.gz", ".json.bz2", ".json.xz")
MAX_SUBAGENT_DEPTH = 64
"""Subagents inside subagents, at most (each level is a Python frame while reading)."""


def conversation_files(path: Path) -> list[Path]:
    """The JSON files of a weka trace: the folder's `*.json` (compressed ones too: `.json.gz`,
    `.json.bz2`, `.json.xz`) in name order, or the one file."""
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if p.name.endswith(_CONVERSATION_SUFFIXES)
                       and p.is_file())
        if not files:
            raise InputError(f"{path}: no .json conversation files in this folder")
        return files
    if not path.exists():
        raise InputError(f"{path}: cannot read trace: No such file or directory")
    return [path]


class WekaReader(TraceReader):
    format = "weka"
    description = "a kv-cache-tester trace (`requests`, `block_size`)"

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        super().__init__(path, opts)
        self.files = conversation_files(self.path)
        self.block_tokens = opts.block_tokens
        self.subagents = 0

    def _requests(self) -> Iterator[Request]:
        table = ChainedIds()
        conversations = []  # per file: [(offset s, order, request)]
        order = 0
        for index, file in enumerate(self.files):
            items: list = []
            doc = load_located_json(file)
            name = str(file)
            try:
                scope = self._header(doc)
                units = UnitCheck("t", "s")
                root = ("file", index) if scope == "local" else ("global",)
                for offset, req, model, lineno in self._flatten(doc, 0.0, name, units):
                    try:
                        ids = chained_hash_ids(req, table, self.cover, req["in"], lineno,
                                               (*root, model))
                    except BadField as e:
                        raise _At(lineno, str(e)) from None
                    items.append((offset, order, Request(
                        id=0, arrival_s=0.0, input_length=req["in"], output_length=req["out"],
                        hash_ids=ids, trace_block_tokens=self.block_tokens)))
                    order += 1
            except _At as e:
                raise fail(name, e.line, e.message) from None
            conversations.append(items)
        durations = [max((o for o, _, _ in items), default=0.0) for items in conversations]
        starts = session_starts(durations, self.opts.sessions, self.opts.seed)
        placed = []
        for start, items in zip(starts, conversations):
            for offset, o, r in items:
                r.arrival_s = start + offset
                placed.append((r.arrival_s, o, r))
        placed.sort(key=lambda x: (x[0], x[1]))
        for _, _, r in placed:
            yield r

    def _header(self, doc) -> str:
        if not isinstance(doc, LocatedDict):
            raise _At(1, f"expected a JSON object (one conversation), got {json_type(doc)}")
        with _located(doc):
            block = need_int(doc, "block_size", 1, MAX_BLOCK_TOKENS)
            if self.block_tokens is None:
                self.block_tokens = block
                self.cover = Cover(self.opts.hash_ids_cover or "floor", block)
            elif block != self.block_tokens:
                source = ("requests.block_tokens" if self.opts.block_tokens
                          else "the folder's earlier files")
                raise BadField(f"'block_size' {block} differs from {self.block_tokens} "
                               f"({source}): one trace has one block size")
            if self.cover is None:
                self.cover = Cover(self.opts.hash_ids_cover or "floor", self.block_tokens)
            scope = doc.get("hash_id_scope", "local")
            if scope not in ("local", "global"):
                raise BadField(f"'hash_id_scope' must be \"local\" or \"global\", got {show(scope)}")
            if "id" in doc and type(doc["id"]) not in (int, str):
                raise BadField(f"'id' must be an integer or a string, got {show(doc['id'])}")
            for key in ("tool_tokens", "system_tokens"):
                if key in doc:
                    need_int(doc, key, 0)
            models = doc.get("models")
            if models is not None:
                if type(models) is not list or any(type(m) is not str for m in models):
                    raise BadField(f"'models' must be a list of strings, got {show(models)}")
            need_list(doc, "requests", "request objects")
        return scope

    def _flatten(self, node: LocatedDict, base: float, name: str, units: UnitCheck,
                 depth: int = 0):
        """(absolute offset s, request, model, line) of every request under `node`, `depth`
        subagents down."""
        models = node.get("models")
        for req in node["requests"]:
            if not isinstance(req, LocatedDict):
                raise _At(node.line, f"'requests' must hold objects, got {json_type(req)}")
            with _located(req):
                t = need_number(req, "t", "s")
                units.check(name, req.line, t)
                kind = need(req, "type")
                if kind not in _TYPES:
                    raise BadField(f"'type' must be one of \"n\", \"s\", \"subagent\", got "
                                   f"{show(kind)}")
                if kind == "subagent":
                    if depth == MAX_SUBAGENT_DEPTH:
                        raise BadField(f"subagents nested deeper than {MAX_SUBAGENT_DEPTH} "
                                       "levels")
                    need_list(req, "requests", "request objects")
                    self.subagents += 1
                    sub = LocatedDict(req)
                    sub.line = req.line
                    if models is not None and "models" not in sub:
                        sub["models"] = models
                    nested = list(self._flatten(sub, base + t, name, units, depth + 1))
                    yield from nested
                    continue
                model = need_str(req, "model") if "model" in req else None
                if models is not None and model is not None and model not in models:
                    raise BadField(f"'model' {show(model)} is not one of the file's 'models'")
                check_int("in", need(req, "in"), 1, MAX_INPUT_LENGTH - 1)
                check_int("out", need(req, "out"), 0, MAX_OUTPUT_LENGTH)
                need(req, "hash_ids")
            yield base + t, req, model, req.line


class _At(Exception):
    def __init__(self, line: int, message: str) -> None:
        self.line, self.message = line, message


class _located:
    """Turns a BadField inside a JSON object into an `_At` with the object's line."""

    def __init__(self, obj: LocatedDict) -> None:
        self.obj = obj

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb) -> bool:
        if isinstance(exc, BadField):
            raise _At(self.obj.line, str(exc)) from None
        return False
