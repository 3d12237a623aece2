"""Reader for Mooncake FAST'25 JSONL traces.

One JSON object a line: `{"timestamp": ms, "input_length": int, "output_length": int,
"hash_ids": [int, ...]}`, where `hash_ids` are prefix-chained ids of 512-token blocks. The reader
streams (the file is never held in memory) and is strict: a malformed trace would otherwise give
silently wrong hit rates, so every problem is one `FILE:LINE: what is wrong` error.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO

import numpy as np

from kvbench.errors import InputError
from kvbench.traffic.request import _END_BITS, Request

TRACE_BLOCK_TOKENS = 512
# Request packs (hash id, prefix end) into one int64 key; larger values would silently wrap.
MAX_INPUT_LENGTH = 1 << _END_BITS
MAX_TRACE_HASH_ID = (1 << (63 - _END_BITS)) - 1
_INT_FIELDS = ("input_length", "output_length")


def read_mooncake(
    path: Path, *, time_scale: float = 1.0, limit: int | None = None
) -> Iterator[Request]:
    """The trace's requests in file order; ids count requests from 0, blank lines skipped.

    `time_scale` multiplies arrival times (0.5 replays twice as fast); `limit` stops after that
    many requests without reading the rest of the file. A missing file fails here, at the call;
    a bad line fails when iteration reaches it.
    """
    if not (time_scale > 0 and math.isfinite(time_scale)):
        raise ValueError(f"time_scale must be a positive number, got {time_scale}")
    if limit is not None and limit < 0:
        raise ValueError(f"limit must be >= 0, got {limit}")
    try:
        f = open(path, "rb")
    except OSError as e:
        raise InputError(f"{path}: cannot read trace: {e.strerror or e}") from None
    return _parse(f, str(path), time_scale, limit)


class _BadLine(Exception):
    """What is wrong with one line; `_parse` adds the file and line number."""


def _parse(f: BinaryIO, name: str, time_scale: float, limit: int | None) -> Iterator[Request]:
    count = 0
    prev_ts: float = 0
    # The cache identifies a trace prefix by (id, end), which is only sound if an id always
    # follows the same parent, so that is checked too (None = first block).
    parent_of: dict[int, int | None] = {}
    with f:
        for lineno, raw in enumerate(f, 1):
            if limit is not None and count >= limit:
                return
            if not raw.strip():
                continue
            try:
                ts, input_length, output_length, ids = _parse_line(raw, prev_ts, parent_of)
            except _BadLine as e:
                raise InputError(f"{name}:{lineno}: {e}") from None
            yield Request(
                id=count,
                arrival_s=ts / 1000 * time_scale,
                input_length=input_length,
                output_length=output_length,
                hash_ids=np.array(ids, dtype=np.int64),
                trace_block_tokens=TRACE_BLOCK_TOKENS,
            )
            count += 1
            prev_ts = ts


def _parse_line(
    raw: bytes, prev_ts: float, parent_of: dict[int, int | None]
) -> tuple[float, int, int, list[int]]:
    try:
        obj = json.loads(raw.rstrip(b"\r\n"))
    except UnicodeDecodeError:
        raise _BadLine("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        # json's own position says "line 1", which would contradict the file line number.
        raise _BadLine(f"invalid JSON at column {e.colno}: {e.msg}") from None
    if not isinstance(obj, dict):
        raise _BadLine(f"expected a JSON object, got {_json_type(obj)}")
    for key in ("timestamp", *_INT_FIELDS, "hash_ids"):
        if key not in obj:
            raise _BadLine(f"missing field '{key}'")

    ts = obj["timestamp"]
    if type(ts) not in (int, float) or not math.isfinite(ts):
        raise _BadLine(f"'timestamp' must be a number (ms), got {_show(ts)}")
    if ts < 0:
        raise _BadLine(f"'timestamp' must be >= 0, got {ts}")
    if ts < prev_ts:
        raise _BadLine(f"timestamp {ts} is before the previous request's {prev_ts}")
    for key in _INT_FIELDS:
        if type(obj[key]) is not int:
            raise _BadLine(f"'{key}' must be an integer, got {_show(obj[key])}")
    input_length = obj["input_length"]
    output_length = obj["output_length"]
    if not 0 < input_length < MAX_INPUT_LENGTH:
        raise _BadLine(
            f"'input_length' must be in [1, {MAX_INPUT_LENGTH - 1}], got {input_length}"
        )
    if output_length < 0:
        raise _BadLine(f"'output_length' must be >= 0, got {output_length}")

    ids = obj["hash_ids"]
    if type(ids) is not list:
        raise _BadLine(f"'hash_ids' must be a list of integers, got {_show(ids)}")
    expected = -(-input_length // TRACE_BLOCK_TOKENS)
    if len(ids) != expected:
        raise _BadLine(
            f"'hash_ids' has {len(ids)} ids, but input_length {input_length} needs "
            f"{expected} (blocks of {TRACE_BLOCK_TOKENS} tokens)"
        )
    parent = None
    for h in ids:
        if type(h) is not int:
            raise _BadLine(f"'hash_ids' must hold integers, got {_show(h)}")
        if not 0 <= h <= MAX_TRACE_HASH_ID:
            raise _BadLine(f"hash id {h} is out of range [0, {MAX_TRACE_HASH_ID}]")
        seen = parent_of.setdefault(h, parent)
        if seen != parent:
            raise _BadLine(
                f"hash id {h} follows {_parent(parent)} here but {_parent(seen)} earlier "
                f"(ids must be prefix-chained)"
            )
        parent = h
    return ts, input_length, output_length, ids


def _json_type(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    return "a number"


def _show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _parent(parent: int | None) -> str:
    return "nothing (first block)" if parent is None else str(parent)
