"""Reader for kv-cache-tester / AIPerf `weka_trace` conversations: a folder of JSON files (or
one file), one conversation each, or a JSONL file of a conversation a line (SemiAnalysis'
`cc-traces-weka` releases, `traces.jsonl`).

Top level: `id`, `models`, `block_size` (tokens per hash id), `hash_id_scope` (`local`: ids mean
something only inside this conversation; `global`: across conversations; default local),
`tool_tokens`, `system_tokens` and `requests[]`. A request has `t` (seconds from the
conversation's start), `type` (`n` or `s`), `model`, `in`, `out` and `hash_ids` (full blocks
only: floor); a `subagent` entry holds its own `requests[]`. Sub-agents are flattened into the
stream at their absolute times.

Producers time sub-agent requests two ways: kv-cache-tester's own traces count their `t` from
the spawn (the entry's `t`), SemiAnalysis' releases from the conversation's start. One reading
holds for the whole input: from the spawn when some sub-agent request's `t` is earlier than its
entry's (impossible from the conversation's start), else from the start.

Ids are remapped along their chain from a root per model (different models never share KV) and,
with local scope, per conversation. Conversations carry no absolute start, so
`requests.sessions` decides when each starts (files in name order, then line order). The whole
input is read before the first request is returned (conversations interleave in time).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

from kvbench.errors import InputError
from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.sessions import session_starts
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
    show,
)

_TYPES = ("n", "s", "subagent")
_CONVERSATION_SUFFIXES = tuple(f"{ext}{z}" for ext in (".json", ".jsonl")
                               for z in ("", ".gz", ".bz2", ".xz"))
_JSONL_SUFFIXES = tuple(s for s in _CONVERSATION_SUFFIXES if ".jsonl" in s)
"""JSON Lines files: an empty one holds no conversations (an empty `.json` is no document)."""
# Float noise allowed when telling a sub-agent request's `t` from its entry's.
_EARLIER_S = 1e-6
MAX_SUBAGENT_DEPTH = 64
"""Subagents inside subagents, at most (each level is a Python frame while reading)."""


def conversation_files(path: Path) -> list[Path]:
    """The JSON files of a weka trace: the folder's `*.json` and `*.jsonl` (compressed ones too:
    `.gz`, `.bz2`, `.xz`) in name order, or the one file."""
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

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        super().__init__(path, opts)
        self.files = conversation_files(self.path)
        self.block_tokens = opts.block_tokens
        self.subagents = 0
        self._from_spawn = False  # how sub-agent requests count `t` (module docstring)

    def _requests(self) -> Iterator[Request]:
        table = ChainedIds()
        conversations = []  # per conversation: [(offset from spawn, from start, order, request)]
        order = 0
        units = UnitCheck("t", "s")  # one warning for the whole input
        for file in self.files:
            name = str(file)
            jsonl = name.endswith(_JSONL_SUFFIXES)
            for line, doc in load_located_json(file, lines=jsonl):
                items: list = []
                try:
                    scope = self._header(doc, line)
                    root = ("conversation", len(conversations)) if scope == "local" else (
                        "global",)
                    for offsets, req, model, lineno in self._flatten(doc, 0.0, None, name,
                                                                     units):
                        try:
                            ids = chained_hash_ids(req, table, self.cover, req["in"], lineno,
                                                   (*root, model))
                        except BadField as e:
                            raise _At(lineno, str(e)) from None
                        items.append((*offsets, order, Request(
                            id=0, arrival_s=0.0, input_length=req["in"],
                            output_length=req["out"], hash_ids=ids,
                            trace_block_tokens=self.block_tokens)))
                        order += 1
                except _At as e:
                    raise fail(name, e.line, e.message) from None
                conversations.append(items)
        pick = 0 if self._from_spawn else 1
        durations = [max((it[pick] for it in items), default=0.0) for items in conversations]
        starts = session_starts(durations, self.opts.sessions, self.opts.seed)
        placed = []
        for start, items in zip(starts, conversations):
            for it in items:
                r = it[3]
                r.arrival_s = start + it[pick]
                placed.append((r.arrival_s, it[2], r))
        placed.sort(key=lambda x: (x[0], x[1]))
        for _, _, r in placed:
            yield r

    def _header(self, doc, line: int) -> str:
        if not isinstance(doc, LocatedDict):
            raise _At(line, f"expected a JSON object (one conversation), got {json_type(doc)}")
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

    def _flatten(self, node: LocatedDict, base: float, spawn: float | None, name: str,
                 units: UnitCheck, depth: int = 0):
        """((offset s if sub-agent `t` counts from the spawn, offset s if from the start),
        request, model, line) of every request under `node`, `depth` subagents down; `spawn`:
        the `t` of the subagent entry `node` is, None at the top."""
        models = node.get("models")
        for req in node["requests"]:
            if not isinstance(req, LocatedDict):
                raise _At(node.line, f"'requests' must hold objects, got {json_type(req)}")
            with _located(req):
                t = need_number(req, "t", "s")
                units.check(name, req.line, t)
                if spawn is not None and t < spawn - _EARLIER_S:
                    self._from_spawn = True
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
                    nested = list(self._flatten(sub, base + t, t, name, units, depth + 1))
                    yield from nested
                    continue
                model = need_str(req, "model") if "model" in req else None
                if models is not None and model is not None and model not in models:
                    raise BadField(f"'model' {show(model)} is not one of the file's 'models'")
                check_int("in", need(req, "in"), 1, MAX_INPUT_LENGTH - 1)
                check_int("out", need(req, "out"), 0, MAX_OUTPUT_LENGTH)
                need(req, "hash_ids")
            yield (base + t, t), req, model, req.line


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
