"""Reader for Mooncake FAST'25 JSONL traces and AIPerf's extensions of the format.

One JSON object a line: `{"timestamp": ms, "input_length": int, "output_length": int,
"hash_ids": [...]}`, where `hash_ids` are prefix-chained ids of `requests.block_tokens`-token
blocks (512 in the Mooncake release), one per block including the partial last one (`ceil`;
`requests.hash_ids_cover` says otherwise). AIPerf adds an optional `session_id`, `delay` (ms after
the previous request of the same session) in place of `timestamp`, and makes `hash_ids` optional
(absent: the prompt shares nothing). A trace either times every line or none; untimed sessions
start by `requests.sessions`.

Integer ids below 2**38 are used as they are (the Mooncake release's ids, so results stay those of
the raw trace); every other id (strings, 64-bit hashes, negative numbers) is remapped to a dense
id at or above 2**38, so the two ranges never meet. The reader checks that ids are
prefix-chained (an id always follows the same parent): the cache identifies a trace prefix by
(id, end), which is only sound then.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvbench.traffic.request import _END_BITS, Request
from kvbench.traffic.sessions import session_starts
from kvbench.traffic.tracefile import (
    BadField,
    ChainedIds,
    Cover,
    HashIdReader,
    Timestamps,
    TraceOptions,
    check_int,
    check_number,
    fail,
    need,
    show,
)

TRACE_BLOCK_TOKENS = 512
# Request packs (hash id, prefix end) into one int64 key; larger values would silently wrap.
MAX_INPUT_LENGTH = 1 << _END_BITS
MAX_OUTPUT_LENGTH = MAX_INPUT_LENGTH - 1
"""Largest output length a trace may give (any reader): far above real outputs, and small
enough that a trace's token totals never overflow the int64 arrays of `trace_stats`."""
IDENTITY_IDS = 1 << 38


def read_mooncake(
    path: Path, *, time_scale: float = 1.0, limit: int | None = None
) -> Iterator[Request]:
    """The trace's requests in file order with the Mooncake release's defaults (512-token ids,
    ceil); `time_scale` multiplies arrival times, `limit` stops after that many requests."""
    return iter(MooncakeReader(path, TraceOptions(time_scale=time_scale, limit=limit)))


class MooncakeReader(HashIdReader):
    format = "mooncake"

    default_block_tokens = TRACE_BLOCK_TOKENS

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        block = self.block_tokens
        ids = _Ids()
        stamps = Timestamps(hint=" (AIPerf sessions with 'delay')")
        sessions: dict = {}  # untimed: session -> [offset ms, [(offset ms, order, request)]]
        order = 0
        for lineno, obj in self._records:
            try:
                ts, input_length, output_length = _times_and_lengths(obj, stamps)
                raw = obj.get("hash_ids")
                if raw is None and "hash_ids" not in obj:
                    # One block size per trace keeps `Request.tokens_at` injective.
                    self.without_ids += 1
                    dense = ids.fresh_blocks(input_length, block)
                else:
                    dense = ids.chain(raw, input_length, self.cover, lineno)
            except BadField as e:
                raise fail(name, lineno, str(e)) from None
            if stamps.timed:
                stamps.accept(name, lineno, ts)
                yield Request(
                    id=0, arrival_s=ts / 1000, input_length=input_length,
                    output_length=output_length, hash_ids=dense,
                    trace_block_tokens=block)
                continue
            sid = obj.get("session_id", ("line", lineno))
            entry = sessions.get(sid)
            if entry is None:
                entry = sessions[sid] = [0.0, []]
            entry[0] += ts  # untimed: ts is the delay after the session's previous request
            entry[1].append((entry[0], order, Request(
                id=0, arrival_s=0.0, input_length=input_length, output_length=output_length,
                hash_ids=dense, trace_block_tokens=block)))
            order += 1
        if sessions:
            yield from _place(list(sessions.values()), self.opts)


def _place(sessions: list, opts: TraceOptions) -> Iterator[Request]:
    starts = session_starts([s[0] / 1000 for s in sessions], opts.sessions, opts.seed)
    placed = []
    for start, (_, items) in zip(starts, sessions):
        for offset, order, r in items:
            r.arrival_s = start + offset / 1000
            placed.append((r.arrival_s, order, r))
    placed.sort(key=lambda x: (x[0], x[1]))
    for _, _, r in placed:
        yield r


def _times_and_lengths(obj: dict, stamps: Timestamps) -> tuple[float, int, int]:
    """The line's time (timed: `timestamp` ms; untimed: `delay` ms, 0 when absent) and lengths."""
    # A missing field is reported before the timestamp's value or order.
    if stamps.decide(obj):
        for key in ("timestamp", "input_length", "output_length"):
            need(obj, key)
        if "delay" in obj:
            raise BadField("'delay' and 'timestamp' on one line: give one of them")
    ts = stamps.read(obj)
    if ts is None:
        for key in ("input_length", "output_length"):
            need(obj, key)
        ts = check_number("delay", obj["delay"], "ms") if "delay" in obj else 0.0
        sid = obj.get("session_id")
        if "session_id" in obj and type(sid) not in (int, str):
            raise BadField(f"'session_id' must be an integer or a string, got {show(sid)}")
    input_length = check_int("input_length", obj["input_length"], 1, MAX_INPUT_LENGTH - 1)
    output_length = check_int("output_length", obj["output_length"], 0, MAX_OUTPUT_LENGTH)
    return ts, input_length, output_length


class _Ids:
    """Raw ids -> the ids requests carry (see the module docstring), with the chain check.

    The cache identifies a trace prefix by (id, end), which is only sound if an id always
    follows the same parent. Each id's parent is kept as parent + 2 (1 = first block, 0 = not
    seen yet): in an int64 table indexed by id while ids are dense (a production trace has
    tens of millions: a dict would take ~100 bytes each), in a dict beyond it."""

    __slots__ = ("table", "parent_of", "remap", "fresh", "fresh_blocks", "seen_ids")

    def __init__(self) -> None:
        self.table = np.zeros(1 << 16, dtype=np.int64)
        self.parent_of: dict[int, int] = {}
        self.remap: dict = {}
        ids = ChainedIds(start=IDENTITY_IDS)
        self.fresh, self.fresh_blocks = ids.fresh, ids.fresh_blocks
        self.seen_ids = 0

    def chain(self, raw, input_length: int, cover: Cover, lineno: int) -> np.ndarray:
        if type(raw) is not list:
            raise BadField(f"'hash_ids' must be a list of integers or strings, got {show(raw)}")
        tail = cover.check(len(raw), input_length, lineno)
        remap = self.remap
        out = []
        for h in raw:
            if type(h) is int and 0 <= h < IDENTITY_IDS:
                out.append(h)
            elif type(h) is int or type(h) is str:
                dense = remap.get(h)
                if dense is None:
                    dense = remap[h] = self.fresh()
                out.append(dense)
            else:
                raise BadField(f"'hash_ids' must hold integers or strings, got {show(h)}")
        if tail:
            out.append(self.fresh())
        ids = np.array(out, dtype=np.int64)
        if len(raw):
            self._check_chain(ids[:len(raw)], raw)
        return ids

    def _check_chain(self, ids: np.ndarray, raw: list) -> None:
        self.seen_ids += len(ids)
        want = np.empty_like(ids)
        want[0] = 1
        want[1:] = ids[:-1] + 2
        top = int(ids.max())
        table = self.table
        if top >= len(table) and top < IDENTITY_IDS and top < 4 * self.seen_ids + (1 << 20):
            table = self._grow(top + 1)
        if top < len(table):
            before = table[ids]
            table[ids] = np.where(before == 0, want, before)
            # A conflict with an earlier line, or inside this one (the last write wins).
            if not np.array_equal(table[ids], want):
                self._raise_conflict(ids, want, before, raw)
            return
        before = np.array([table[d] if d < len(table) else self.parent_of.get(d, 0)
                           for d in ids.tolist()], dtype=np.int64)
        line: dict[int, int] = {}
        for j, d in enumerate(ids.tolist()):
            seen = line.get(d, int(before[j])) or int(want[j])
            if seen != want[j]:
                self._raise_conflict(ids, want, before, raw)
            line[d] = seen
        for d, w in line.items():
            if d < len(table):
                table[d] = w
            else:
                self.parent_of[d] = w

    def _grow(self, need: int) -> np.ndarray:
        table = np.zeros(max(2 * len(self.table), need), dtype=np.int64)
        table[:len(self.table)] = self.table
        for d in [d for d in self.parent_of if d < len(table)]:
            table[d] = self.parent_of.pop(d)
        self.table = table
        return table

    @staticmethod
    def _raise_conflict(ids: np.ndarray, want: np.ndarray, before: np.ndarray, raw: list):
        line: dict[int, int] = {}
        for j, d in enumerate(ids.tolist()):
            seen = line.get(d, int(before[j])) or int(want[j])
            if seen != want[j]:
                parent = None if seen == 1 else seen - 2
                earlier = "nothing (first block)" if parent is None else (
                    str(parent) if parent < IDENTITY_IDS else "another id")
                raise BadField(
                    f"hash id {show(raw[j])} follows {_parent(raw[j - 1] if j else None)} "
                    f"here but {earlier} earlier (ids must be prefix-chained)")
            line[d] = seen
        raise AssertionError("a chain conflict that no id shows")


def _parent(parent) -> str:
    return "nothing (first block)" if parent is None else show(parent)
