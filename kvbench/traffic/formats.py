"""Trace formats by name (`requests.format`), and `auto`: sniffing a trace's first record."""

from __future__ import annotations

import json
from pathlib import Path

from kvbench.errors import InputError
from kvbench.traffic.bailian import BailianReader
from kvbench.traffic.chat import MESSAGE_KEYS, ChatReader, request_body
from kvbench.traffic.lengths_csv import LAYOUTS, LengthsCsvReader
from kvbench.traffic.mooncake import MooncakeReader
from kvbench.traffic.servegen import ServeGenReader
from kvbench.traffic.token_ids import TokenIdsReader
from kvbench.traffic.tokenize import APPROX
from kvbench.traffic.tracefile import MAX_INT_DIGITS, TraceOptions, TraceReader, open_binary
from kvbench.traffic.weka import WekaReader

READERS: dict[str, type[TraceReader]] = {
    r.format: r for r in (MooncakeReader, BailianReader, ServeGenReader, WekaReader,
                          TokenIdsReader, LengthsCsvReader, ChatReader)
}
FORMATS = ("auto", *READERS)
_SNIFF_BYTES = 1 << 16
_MOONCAKE_TIMES = frozenset(("timestamp", "delay", "session_id"))
_WHOLE_JSON_BYTES = 64 << 20


def open_trace(path: Path, fmt: str = "auto", opts: TraceOptions = TraceOptions()) -> TraceReader:
    """A reader of the trace at `path` in format `fmt` (`auto`: sniffed from its first record)."""
    path = Path(path)
    if fmt == "auto":
        fmt, _ = sniff(path)
    reader = READERS.get(fmt)
    if reader is None:
        raise InputError(f"requests.format: unknown trace format {fmt!r} (expected one of "
                         f"{', '.join(FORMATS)})")
    if opts.tokenizer != APPROX and reader is not ChatReader:
        raise InputError(f"requests.tokenizer: only chat traces are tokenized (this trace is "
                         f"{fmt})")
    return reader(path, opts)


def sniff(path: Path) -> tuple[str, str]:
    """(format, what the file looks like) from the trace's first record."""
    path = Path(path)
    if path.is_dir():
        return "weka", "a folder of kv-cache-tester conversations"
    with open_binary(path) as f:
        head = f.read(_SNIFF_BYTES)
    text = head.decode("utf-8", errors="replace").lstrip("\ufeff")
    first = next((ln for ln in text.splitlines() if ln.strip()), "")
    obj = None
    if first.lstrip().startswith("["):  # one JSON array of records: only chat traces
        element = _first_element(text.lstrip(), path)
        found = _by_keys(element) if isinstance(element, dict) else None
        if found is not None and found[0] == "chat":
            return found
        raise InputError(f"{path}:1: a JSON array whose first element is not a chat record "
                         f"(`messages`, `conversations`, `input` or `prompt`); the other "
                         f"formats are JSON Lines")
    if first.lstrip().startswith("{"):
        try:
            obj = json.loads(first, parse_int=_sniff_int)
        except (json.JSONDecodeError, RecursionError):
            obj = _whole_json(path)
    if isinstance(obj, dict):
        found = _by_keys(obj)
        if found is not None:
            return found
    header = [h.strip() for h in first.split(",")]
    for layout, names in LAYOUTS.items():
        if all(n in header for n in names):
            return "lengths_csv", f"a {layout} CSV trace ({', '.join(names)})"
    raise InputError(f"{path}:1: cannot tell the trace format from the first record; set "
                     f"requests.format to one of {', '.join(READERS)}")


def _whole_json(path: Path):
    """A first record longer than the bytes sniffed: a JSON document spread over lines (one
    weka conversation file), else a long first line (a traces.jsonl conversation, a prompt of
    many ids)."""
    with open_binary(path) as f:
        raw = f.read(_WHOLE_JSON_BYTES + 1)
    for text in (raw, raw.lstrip().split(b"\n", 1)[0]):
        if len(text) <= _WHOLE_JSON_BYTES:
            try:
                return json.loads(text, parse_int=_sniff_int)
            except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
                pass
    return None


def _first_element(text: str, path: Path):
    """The first element of a JSON array starting `text`, reading up to 64 MiB of the file
    when the sniffed bytes end inside it."""
    for attempt in (text, None):
        if attempt is None:
            with open_binary(path) as f:
                raw = f.read(_WHOLE_JSON_BYTES)
            attempt = raw.decode("utf-8", errors="replace").lstrip("\ufeff \t\r\n")
        start = json.decoder.WHITESPACE.match(attempt, 1).end()
        try:
            return json.JSONDecoder(parse_int=_sniff_int).raw_decode(attempt, start)[0]
        except (json.JSONDecodeError, RecursionError):
            pass
    return None


def _sniff_int(text: str) -> int | float:
    """A JSON integer while sniffing, which needs only the keys: one too long for Python's
    str -> int is not a reason to say nothing (the reader then names its line)."""
    return int(text) if not MAX_INT_DIGITS or len(text) <= MAX_INT_DIGITS else float(text)


def _by_keys(obj: dict) -> tuple[str, str] | None:
    if "requests" in obj and "block_size" in obj:
        return "weka", (f"a kv-cache-tester trace (`requests`, `block_size: "
                        f"{json.dumps(obj['block_size'])}`)")
    body = request_body(obj)
    chat = [k for k in MESSAGE_KEYS if k in body] or (
        ["prompt"] if isinstance(body.get("prompt"), str) else [])
    if chat:
        return "chat", f"a chat trace (`{chat[0]}`)"
    if "input_ids" in obj:
        return "token_ids", "a token-id trace (`input_ids`)"
    if "chat_id" in obj or "parent_chat_id" in obj:
        return "bailian", "a Bailian trace (`chat_id`, `parent_chat_id`)"
    # ServeGen's stat traces have no hash_ids: `request_id` without a time is what they share
    # (Mooncake's `timestamp`, or AIPerf's `delay` / `session_id` in its place).
    if "img_ids" in obj or ("request_id" in obj and not _MOONCAKE_TIMES & obj.keys()):
        return "servegen", "a ServeGen trace (`request_id`, no `timestamp`)"
    if "hash_ids" in obj or "input_length" in obj:
        keys = [k for k in ("timestamp", "delay", "session_id", "hash_ids") if k in obj]
        return "mooncake", f"a Mooncake trace ({', '.join(f'`{k}`' for k in keys)})"
    return None
