"""Reader for CSV traces of arrivals and lengths only: Azure LLM inference traces
(`TIMESTAMP,ContextTokens,GeneratedTokens`, TIMESTAMP a date and time) and BurstGPT
(`Timestamp,Model,Request tokens,Response tokens,...`, Timestamp in seconds). Arrivals count from
the first row. There is no prefix information: every prompt gets ids nothing else has, so serve
mode runs them as they are and cache mode has nothing to reuse (the runner says so). Rows with
no prompt tokens (service logs record calls that failed before any) are counted and skipped:
there is nothing to prefill or cache.
"""

from __future__ import annotations

import csv
import re
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.tracefile import (
    MAX_TIME_FIELD,
    UNKNOWN_BLOCK_TOKENS,
    BadField,
    ChainedIds,
    TraceOptions,
    TraceReader,
    UnitCheck,
    fail,
    open_binary,
)

# (timestamp, input length, output length) column names per known layout.
LAYOUTS = {
    "Azure": ("TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    "BurstGPT": ("Timestamp", "Request tokens", "Response tokens"),
}


class LengthsCsvReader(TraceReader):
    format = "lengths_csv"

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        super().__init__(path, opts)
        self.block_tokens = None
        self._file = open_binary(self.path)

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        table = ChainedIds()
        with self._file as f:
            rows = csv.reader(_lines(f, name))
            header = next(rows, None)
            if header is None:
                return
            columns = _columns(name, [h.strip() for h in header])
            first = prev = None
            lineno = 1
            while True:
                try:
                    row = next(rows, None)
                except csv.Error as e:
                    raise fail(name, lineno + 1, f"bad CSV: {e}") from None
                if row is None:
                    return
                lineno = rows.line_num
                if not any(cell.strip() for cell in row):
                    continue
                try:
                    ts, input_length, output_length = _row(row, columns)
                    if prev is not None and _kind(ts) != _kind(prev):
                        raise BadField(f"'{columns[0][1]}' {row[columns[0][0]].strip()!r}: "
                                       f"expected {_kind(prev)} like the rows before")
                    if prev is not None and ts < prev:
                        raise BadField(f"'{columns[0][1]}' {row[columns[0][0]].strip()} is before "
                                       "the previous row's")
                except BadField as e:
                    raise fail(name, lineno, str(e)) from None
                if first is None:
                    first = ts
                    if not isinstance(ts, datetime):
                        UnitCheck(columns[0][1], "s").check(name, lineno, ts)
                prev = ts
                if not input_length:
                    self.without_prompt += 1
                    continue
                offset = ts - first
                arrival = offset.total_seconds() if isinstance(ts, datetime) else float(offset)
                self.without_ids += 1
                yield Request(id=0, arrival_s=arrival, input_length=input_length,
                              output_length=output_length,
                              hash_ids=table.fresh_blocks(input_length, UNKNOWN_BLOCK_TOKENS),
                              trace_block_tokens=UNKNOWN_BLOCK_TOKENS)


def _columns(name: str, header: list[str]) -> tuple[tuple[int, str], ...]:
    for names in LAYOUTS.values():
        if all(n in header for n in names):
            return tuple((header.index(n), n) for n in names)
    known = "; ".join(f"{k}: {','.join(v)}" for k, v in LAYOUTS.items())
    raise fail(name, 1, f"expected a header with the columns of {known}; got "
                        f"{','.join(header)[:80]}")


def _row(row: list[str], columns: tuple[tuple[int, str], ...]):
    (t_col, t_name), (in_col, in_name), (out_col, out_name) = columns
    width = max(c for c, _ in columns) + 1
    if len(row) < width:
        raise BadField(f"expected at least {width} columns, got {len(row)}")
    ts = _timestamp(row[t_col].strip(), t_name)
    input_length = _int(row[in_col].strip(), in_name, 0, MAX_INPUT_LENGTH - 1)
    output_length = _int(row[out_col].strip(), out_name, 0, MAX_OUTPUT_LENGTH)
    return ts, input_length, output_length


def _lines(f, name: str) -> Iterator[str]:
    """The file's lines as text, each decoded alone, so a bad byte names its own line (a text
    wrapper decodes ahead); a BOM before the header is dropped."""
    for lineno, raw in enumerate(f, 1):
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise fail(name, lineno, "not UTF-8 text") from None
        yield line.removeprefix("\ufeff") if lineno == 1 else line


def _kind(ts) -> str:
    """What a timestamp is, for rows that must agree (an offset needs both with a zone or both
    without)."""
    if not isinstance(ts, datetime):
        return "seconds"
    return "a date and time without a zone" if ts.tzinfo is None else "a date and time with a zone"


def _timestamp(text: str, what: str):
    try:
        # Python's float() also takes digit groups (1_000) and non-ASCII digits: not CSV.
        value = float(text) if text.isascii() and "_" not in text else None
    except ValueError:
        value = None
    if value is not None:
        if not 0 <= value <= MAX_TIME_FIELD:
            raise BadField(f"'{what}' must be a number of seconds in [0, {MAX_TIME_FIELD:g}], "
                           f"got {text!r}")
        return value
    head, dot, frac = text.partition(".")
    digits = len(frac) - len(frac.lstrip("0123456789"))
    iso = text
    if digits:  # exactly 6 fractional digits, which every Python's datetime takes (3.10 takes
        # 3 or 6, later ones up to 6; Azure writes 7); a zone may follow them
        iso = f"{head}.{frac[:min(digits, 6)].ljust(6, '0')}{frac[digits:]}"
    if iso.endswith("Z"):  # UTC, which datetime takes only from Python 3.11
        iso = iso[:-1] + "+00:00"
    try:
        return datetime.fromisoformat(iso)
    except ValueError:
        raise BadField(f"'{what}' must be seconds or a date and time, got {text!r}") from None


_INTEGER = re.compile(r"[+-]?[0-9]+")
"""A CSV integer (Python's int() also takes digit groups, 1_000, and non-ASCII digits)."""


def _int(text: str, what: str, low: int, high: int | None) -> int:
    if not _INTEGER.fullmatch(text):
        raise BadField(f"'{what}' must be an integer, got {text[:40]!r}")
    # No int() of thousands of digits (past Python's limit it raises): any bound is shorter.
    huge = len(text.lstrip("+-").lstrip("0")) > 30
    value = int(text) if not huge else -10**30 if text[0] == "-" else 10**30
    if value < low or (high is not None and value > high):
        bound = f"in [{low}, {high}]" if high is not None else f">= {low}"
        got = text[:37] + "..." if huge else value
        raise BadField(f"'{what}' must be {bound}, got {got}")
    return value
