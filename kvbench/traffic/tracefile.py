"""What every trace reader shares: one-line `FILE:LINE: what` errors, JSON records with their
line numbers, field checks, hash-id remapping, the ceil/floor length convention, unit warnings
and the start times of sessions that carry no absolute time.

Internally a hash-id prompt is always "ceil": one dense id per trace block, the partial last
block included (`Request.tokens_at`). Ids are remapped so their type and size do not matter
(64-bit engine hashes, hex strings) and so that two different prefixes can never get one id:
a remapped id is a counter value handed out once per distinct (parent id, raw id) pair, which
also makes any id sequence prefix-chained. Blocks whose content the trace does not say (the
partial tail under the floor convention, prompts without ids) get fresh ids that nothing else
has, so they share nothing.
"""

from __future__ import annotations

import bisect
import bz2
import gzip
import json
import json.decoder
import json.scanner
import lzma
import math
import re
import sys
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvbench.errors import InputError, TraceWarning
from kvbench.infile import open_input
from kvbench.traffic.sessions import SessionStart

# Request packs (hash id, prefix end) into one int64 key (`request._END_BITS`); ids stay below.
MAX_DENSE_ID = (1 << 39) - 1
MAX_BLOCK_TOKENS = 1 << 20
MAX_TIME_S = 4e12
"""The latest arrival, once `requests.time_scale` applies (~127,000 years): serve results keep
times as int64 microseconds (up to 9.2e12 s), and the run needs room after its last arrival.
Unix time in milliseconds read as seconds (1.7e12) still fits, with its unit warning."""
MAX_TIME_FIELD = 1e15
"""The largest value of a time field, in its own unit: room for Unix time in milliseconds in a
seconds field, which `requests.time_scale: 0.001` puts right."""
# Prefix-less prompts (lengths-only traces, AIPerf lines without ids) get fresh ids of this many
# tokens: one block size per trace keeps `Request.tokens_at` injective.
UNKNOWN_BLOCK_TOKENS = 512


class BadField(Exception):
    """What is wrong with one record; the reader adds the file and line number."""


def fail(name: str, lineno: int | None, message: str) -> InputError:
    where = f"{name}:{lineno}" if lineno is not None else name
    return InputError(f"{where}: {message}")


def warn(message: str) -> None:
    warnings.warn(message, TraceWarning, stacklevel=3)


def open_binary(path: Path):
    """A trace file opened for reading bytes, decompressed when its first bytes say gzip, bzip2
    or xz (whatever its name): production traces are often kept compressed."""
    f = open_input(path, " trace",
                   directory="is a directory (only requests.format: weka reads a folder)")
    head = f.peek(len(_XZ_MAGIC))[:len(_XZ_MAGIC)]
    for magic, kind, opener in _COMPRESSED:
        if head.startswith(magic):
            f.close()
            return _Decompressed(opener(path), path, kind)
    return f


_XZ_MAGIC = b"\xfd7zXZ\x00"
_COMPRESSED = ((b"\x1f\x8b", "gzip", gzip.open), (b"BZh", "bzip2", bz2.open),
               (_XZ_MAGIC, "xz", lzma.open))
_CORRUPT = (OSError, EOFError, lzma.LZMAError)
"""What a decompressor raises on damaged or truncated data (gzip's BadGzipFile is an OSError)."""


class _Decompressed:
    """A decompressing reader whose damaged or truncated data is bad input (one InputError line
    naming the file), not a crash, wherever a reader meets it."""

    __slots__ = ("_f", "_path", "_kind")

    def __init__(self, f, path: Path, kind: str) -> None:
        self._f, self._path, self._kind = f, path, kind

    def read(self, size: int = -1) -> bytes:
        try:
            return self._f.read(size)
        except _CORRUPT as exc:
            raise self._corrupt(exc) from None

    def __iter__(self) -> Iterator[bytes]:
        try:
            yield from self._f
        except _CORRUPT as exc:
            raise self._corrupt(exc) from None

    def _corrupt(self, exc: Exception) -> InputError:
        return InputError(f"{self._path}: damaged {self._kind} data ({exc})")

    def close(self) -> None:
        self._f.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self._f.close()


def jsonl_records(path: Path) -> Iterator[tuple[int, dict]]:
    """(line number, object) of every non-blank line of a JSONL file; a line that is not a JSON
    object fails with its line number. Opened at the call, so a missing file fails there."""
    return _jsonl(open_binary(path), str(path))


def _jsonl(f, name: str) -> Iterator[tuple[int, dict]]:
    with f:
        for lineno, raw in enumerate(f, 1):
            if not raw.strip():
                continue
            try:
                yield lineno, parse_json_object(raw)
            except BadField as e:
                raise fail(name, lineno, str(e)) from None


def parse_json_object(raw: bytes) -> dict:
    try:
        obj = json.loads(raw.rstrip(b"\r\n"))
    except UnicodeDecodeError:
        raise BadField("not UTF-8 text") from None
    except json.JSONDecodeError as e:
        # json's own position says "line 1", which would contradict the file line number.
        raise BadField(f"invalid JSON at column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise BadField("JSON nested too deeply for a trace record") from None
    except ValueError:  # an integer past Python's digit limit for str -> int
        text = raw.decode("utf-8", errors="replace")
        raise BadField(f"invalid JSON at column {_long_integer(text, 0) + 1}: "
                       f"{_LONG_INTEGER}") from None
    if not isinstance(obj, dict):
        raise BadField(f"expected a JSON object, got {json_type(obj)}")
    return obj


class LocatedDict(dict):
    """A JSON object that knows the line it starts on (`load_located_json`)."""

    line: int = 0


def load_located_json(path: Path, lines: bool = False) -> list[tuple[int, Any]]:
    """(line, value) of each JSON value of a file (a document, or JSONL: a weka conversation a
    line), its objects `LocatedDict`s so that a problem deep inside one names its line. No file
    is empty unless `lines` (JSONL: zero records); json's pure-Python scanner."""
    with open_binary(path) as f:
        raw = f.read()
    try:
        text = raw.decode("utf-8").removeprefix("\ufeff")  # a BOM (Windows editors)
    except UnicodeDecodeError as e:
        line = raw.count(b"\n", 0, e.start) + 1
        raise fail(str(path), line, "not UTF-8 text") from None
    decoder = json.JSONDecoder()
    # Line starts, bisected (counting newlines from the top for each object was quadratic).
    starts = [0, *(m.end() for m in re.finditer("\n", text))]

    def line_at(i: int) -> int:
        return bisect.bisect_right(starts, i)

    def parse_object(s_and_end, *args, **kw):
        obj, end = json.decoder.JSONObject(s_and_end, *args, **kw)
        located = LocatedDict(obj)
        located.line = line_at(s_and_end[1])
        return located, end

    def invalid(i: int, what: str) -> InputError:
        line = line_at(i)
        return fail(str(path), line, f"invalid JSON at column {i - starts[line - 1] + 1}: {what}")

    decoder.parse_object = parse_object
    decoder.scan_once = json.scanner.py_make_scanner(decoder)
    values = []
    end = _SPACE.match(text, 0).end()
    try:
        while end < len(text) or not (values or lines):
            start = end
            value, end = decoder.raw_decode(text, start)
            values.append((line_at(start), value))
            gap = _INLINE_SPACE.match(text, end).end()
            if gap < len(text) and text[gap] != "\n":
                raise invalid(gap, "extra data after a value (one JSON value a line)")
            end = _SPACE.match(text, end).end()
    except json.JSONDecodeError as e:
        raise fail(str(path), e.lineno, f"invalid JSON at column {e.colno}: {e.msg}") from None
    except RecursionError:
        raise InputError(f"{path}: JSON nested too deeply for a trace file") from None
    except ValueError:  # an integer past Python's digit limit for str -> int
        raise invalid(_long_integer(text, start), _LONG_INTEGER) from None
    return values


_INLINE_SPACE = re.compile(r"[ \t\r]*")
_SPACE = json.decoder.WHITESPACE
# Python's limit on the digits of str -> int (0: none; before 3.10.7 none, and no way to ask).
MAX_INT_DIGITS = getattr(sys, "get_int_max_str_digits", lambda: 0)()
_LONG_INTEGER = f"an integer of more than {MAX_INT_DIGITS} digits"


def _long_integer(text: str, start: int) -> int:
    """Where the first integer too long for Python's str -> int starts, from `start`."""
    found = re.compile(r"\d{%d,}" % (MAX_INT_DIGITS + 1)).search(text, start)
    return found.start() if found else start


# --- fields --------------------------------------------------------------------------------------


def json_type(value: object) -> str:
    if isinstance(value, list):
        return "an array"
    if isinstance(value, str):
        return "a string"
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, dict):
        return "an object"
    return "a number"


def show(value: object) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def need(obj: dict, key: str) -> Any:
    if key not in obj:
        raise BadField(f"missing field '{key}'")
    return obj[key]


def need_int(obj: dict, key: str, low: int, high: int | None = None) -> int:
    value = need(obj, key)
    return check_int(key, value, low, high)


def check_int(key: str, value: Any, low: int, high: int | None = None) -> int:
    if type(value) is not int:
        raise BadField(f"'{key}' must be an integer, got {show(value)}")
    if high is not None and not low <= value <= high:
        raise BadField(f"'{key}' must be in [{low}, {high}], got {show(value)}")
    if value < low:
        raise BadField(f"'{key}' must be >= {low}, got {show(value)}")
    return value


def need_number(obj: dict, key: str, unit: str) -> float:
    value = need(obj, key)
    return check_number(key, value, unit)


def check_number(key: str, value: Any, unit: str) -> float:
    """A time in `unit`: a finite number >= 0, at most `MAX_TIME_FIELD` (arrivals are checked
    against `MAX_TIME_S` once `requests.time_scale` applies)."""
    # An int is finite however large (math.isfinite and :g would overflow converting it).
    if type(value) not in (int, float) or (type(value) is float and not math.isfinite(value)):
        raise BadField(f"'{key}' must be a number ({unit}), got {show(value)}")
    if value < 0:
        raise BadField(f"'{key}' must be >= 0, got {show(value)}")
    if value > MAX_TIME_FIELD:
        got = f"{value:g}" if value < 1e308 else show(value)
        raise BadField(f"'{key}' must be at most {MAX_TIME_FIELD:g}, got {got}")
    return value


def need_str(obj: dict, key: str) -> str:
    value = need(obj, key)
    if type(value) is not str:
        raise BadField(f"'{key}' must be a string, got {show(value)}")
    return value


def need_list(obj: dict, key: str, what: str) -> list:
    value = need(obj, key)
    if type(value) is not list:
        raise BadField(f"'{key}' must be a list of {what}, got {show(value)}")
    return value


def check_hash_id(key: str, h: Any) -> None:
    """A raw hash id: any integer or string (numbers with a fraction, booleans and nested
    values are mistakes, not ids)."""
    if type(h) not in (int, str):
        raise BadField(f"'{key}' must hold integers or strings, got {show(h)}")


class UnitCheck:
    """Warns once per trace about a time field whose size suggests the other unit."""

    __slots__ = ("key", "expected", "reported")

    def __init__(self, key: str, expected: str) -> None:
        self.key = key
        self.expected = expected  # "ms" or "s"
        self.reported = False

    def check(self, name: str, lineno: int, value: float) -> None:
        if self.reported:
            return
        # Unix time is 1e9..1e10 s (2001..2286) = 1e12..1e13 ms; a relative trace stays below
        # 1e9 ms (11.6 days) or 1e11 s.
        if self.expected == "ms" and 1e9 <= value < 1e10:
            other = "Unix time in seconds"
        elif self.expected == "s" and value >= 1e11:
            other = "Unix time in milliseconds"
        else:
            return
        self.reported = True
        unit = "milliseconds" if self.expected == "ms" else "seconds"
        warn(f"{name}:{lineno}: '{self.key}' {value:g} looks like {other}, but this format "
             f"takes {unit} (later lines not reported)")


class Timestamps:
    """The `timestamp` field (ms) of a JSON trace's records: on every record or on none, as
    the first record says; with `ordered`, never before the previous record's; a value that
    looks like another unit warned about once (`UnitCheck`)."""

    __slots__ = ("noun", "ordered", "hint", "timed", "prev", "units")

    def __init__(self, noun: str = "line", ordered: bool = True, hint: str = "") -> None:
        self.noun = noun
        self.ordered = ordered
        self.hint = hint
        """Appended to the error of a timestamp in an untimed trace (what it may mean)."""
        self.timed: bool | None = None
        self.prev = 0.0
        self.units = UnitCheck("timestamp", "ms")

    def decide(self, obj: dict) -> bool:
        """Whether the trace is timed, which its first record (`obj`, if none came before)
        decides."""
        if self.timed is None:
            self.timed = "timestamp" in obj
        return self.timed

    def read(self, obj: dict) -> float | None:
        """The record's timestamp, None in an untimed trace; raises BadField."""
        if not self.decide(obj):
            if "timestamp" in obj:
                n = self.noun
                raise BadField(f"'timestamp' on a {n} of a trace whose first {n} has none: "
                               f"time every {n}, or none{self.hint}")
            return None
        ts = check_number("timestamp", need(obj, "timestamp"), "ms")
        if self.ordered and ts < self.prev:
            raise BadField(f"timestamp {ts} is before the previous request's {self.prev}")
        return ts

    def accept(self, name: str, lineno: int, ts: float) -> None:
        """The record was read whole: its time is the previous one for the next record."""
        self.units.check(name, lineno, ts)
        self.prev = ts


# --- hash ids ------------------------------------------------------------------------------------


class ChainedIds:
    """Raw hash ids -> dense ids, one per distinct (parent, raw id): collisions are impossible
    whatever the raw ids are, and the result is prefix-chained by construction. A chain starts
    from a `root` (any hashable: a namespace such as a file, a model or an image set)."""

    __slots__ = ("_ids", "_next", "_start")

    def __init__(self, start: int = 0) -> None:
        self._ids: dict[tuple, int] = {}
        self._next = self._start = start

    def chain(self, raw: list, root: Any = None) -> list[int]:
        ids = self._ids
        out = []
        parent: Any = ("root", root)
        for h in raw:
            key = (parent, h)
            dense = ids.get(key)
            if dense is None:
                dense = ids[key] = self.fresh()
            out.append(dense)
            parent = dense
        return out

    def fresh(self) -> int:
        dense = self._next
        if dense > MAX_DENSE_ID:
            raise BadField(f"more than {MAX_DENSE_ID + 1 - self._start} distinct trace blocks")
        self._next = dense + 1
        return dense

    def fresh_blocks(self, length: int, block: int) -> np.ndarray:
        """Ids nothing else has for a `length`-token prompt without prefix ids, one a block."""
        start = self._next
        self._next += -(-length // block) - 1
        return np.arange(start, self.fresh() + 1, dtype=np.int64)  # fresh checks the bound


class Cover:
    """The length convention of hash ids: `ceil` (one id per block, the partial last one
    included: Mooncake, Bailian, ServeGen) or `floor` (full blocks only: kv-cache-tester).
    `auto` takes the convention of the first line where the two differ and rejects a later
    line that needs the other one."""

    __slots__ = ("mode", "block", "decided", "decided_at", "both", "lines")

    def __init__(self, mode: str, block: int) -> None:
        self.mode = mode
        self.block = block
        self.decided: str | None = None if mode == "auto" else mode
        self.decided_at: int | None = None
        self.both = 0  # lines every convention reads the same (length a multiple of the block)
        self.lines = 0

    def check(self, n_ids: int, length: int, lineno: int) -> bool:
        """True when the prompt has a partial tail with no id (floor): the caller adds one."""
        b = self.block
        ceil, floor = -(-length // b), length // b
        self.lines += 1
        if ceil == floor:
            self.both += 1
            if n_ids != ceil:
                raise BadField(f"'hash_ids' has {n_ids} ids, but input_length {length} needs "
                               f"{ceil} (blocks of {b} tokens)")
            return False
        fits = "ceil" if n_ids == ceil else "floor" if n_ids == floor else None
        if self.decided is None and fits is not None:
            self.decided = fits
        if fits != self.decided:
            need = ceil if self.decided == "ceil" else floor
            text = (f"'hash_ids' has {n_ids} ids, but input_length {length} needs {need} "
                    f"(blocks of {b} tokens)")
            if self.decided == "floor":
                text = text[:-1] + ", full blocks only: hash_ids_cover floor)"
            if fits is not None and self.mode == "auto":
                text += (f"; this line counts {fits} but line {self.decided_at} counted "
                         f"{self.decided}: a trace must use one convention")
            elif fits is not None:
                text += f"; it fits requests.hash_ids_cover: {fits}"
            raise BadField(text)
        if self.decided_at is None:
            self.decided_at = lineno
        return fits == "floor"

    def detected(self) -> str:
        """What the lines showed: `ceil`, `floor`, either when every length was a multiple
        of the block size, or none when no line had ids."""
        if self.decided_at is not None:
            return self.decided
        if not self.lines:  # no record had hash ids (ServeGen stat traces, AIPerf without ids)
            return "none (no record has hash_ids)"
        return f"ceil or floor (every input_length a multiple of {self.block})"


# --- readers -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class TraceOptions:
    """The `requests` keys a reader needs; None = the format's own default."""

    block_tokens: int | None = None
    hash_ids_cover: str | None = None
    sessions: Any = SessionStart()
    output_length: int = 128
    tokenizer: str = "approx"
    """Text traces: `approx`, or the path of a tokenizer.json (`tokenize.open_tokenizer`)."""
    seed: int = 0
    time_scale: float = 1.0
    limit: int | None = None


class TraceReader:
    """One pass over a trace's requests in arrival order (ids from 0, `time_scale` applied,
    stopping after `limit` without reading further). The file is opened when the reader is
    made, so a missing file fails there; a bad record fails when iteration reaches it.

    After (or during) iteration: `block_tokens` (tokens per hash id, the trace's native block
    size; 1 for explicit tokens; None when the trace has no prefix information), `cover`
    (the length convention check of hash-id formats), `without_ids` (requests that carry
    no prefix information) and `without_prompt` (records skipped: no prompt tokens)."""

    format = ""

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        if not (opts.time_scale > 0 and math.isfinite(opts.time_scale)):
            raise ValueError(f"time_scale must be a positive number, got {opts.time_scale}")
        if opts.limit is not None and opts.limit < 0:
            raise ValueError(f"limit must be >= 0, got {opts.limit}")
        self.path = Path(path)
        self.opts = opts
        self.block_tokens: int | None = None
        self.cover: Cover | None = None
        self.without_ids = 0
        self.without_prompt = 0
        self.requests = 0
        self.tokenizer = None
        """What turns a text trace's text into token ids (`tokenize.py`); None: not text."""

    def _requests(self) -> Iterator:
        raise NotImplementedError

    def convention(self) -> str:
        if self.block_tokens is None:
            return "none (lengths only)"
        if self.block_tokens == 1:
            return "exact tokens"
        return self.cover.detected() if self.cover is not None else "ceil"

    def __iter__(self) -> Iterator:
        limit, scale = self.opts.limit, self.opts.time_scale
        source = self._requests()
        count = 0
        while limit is None or count < limit:
            try:
                r = next(source)
            except StopIteration:
                return
            except InputError as exc:
                if count:
                    raise
                raise InputError(_with_hint(str(exc), self)) from None
            r.id = count
            if scale != 1.0:
                r.arrival_s *= scale
            if r.arrival_s > MAX_TIME_S:
                raise InputError(f"{self.path}: request {count + 1} arrives at "
                                 f"{r.arrival_s:g} s (after requests.time_scale {scale:g}); "
                                 f"arrivals must be at most {MAX_TIME_S:g} s")
            count += 1
            self.requests = count
            yield r


class HashIdReader(TraceReader):
    """A JSONL trace of hash ids: the block size and length convention come from the options,
    else from the format (`default_block_tokens`, `default_cover`)."""

    default_block_tokens = 0
    default_cover = "ceil"

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        super().__init__(path, opts)
        self.block_tokens = opts.block_tokens or self.default_block_tokens
        if not 0 < self.block_tokens <= MAX_BLOCK_TOKENS:
            raise ValueError(f"block_tokens must be in [1, {MAX_BLOCK_TOKENS}]")
        self.cover = Cover(opts.hash_ids_cover or self.default_cover, self.block_tokens)
        self._records = jsonl_records(self.path)


def _with_hint(message: str, reader: TraceReader) -> str:
    """A first record this format cannot read: say which format the file looks like."""
    from kvbench.traffic.formats import sniff

    try:
        fmt, why = sniff(reader.path)
    except InputError:
        return message
    if fmt == reader.format:
        return message
    return f"{message}; the file looks like {why}: set requests.format: {fmt}"


def chained_hash_ids(obj: dict, table: ChainedIds, cover: Cover, input_length: int,
                     lineno: int, root: Any = None) -> np.ndarray:
    """The record's `hash_ids`, checked against the length convention and remapped along
    their chain from `root`; a floor-convention tail gets a fresh id."""
    raw = need_list(obj, "hash_ids", "integers or strings")
    for h in raw:
        check_hash_id("hash_ids", h)
    tail = cover.check(len(raw), input_length, lineno)
    dense = table.chain(raw, root)
    if tail:
        dense.append(table.fresh())
    return np.array(dense, dtype=np.int64)
