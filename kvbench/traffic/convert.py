"""`kvbench trace convert`: any supported trace -> Mooncake JSONL at the trace's own block size
(or token-id JSONL), so the same traffic can feed other tools (AIPerf, Dynamo) and be shared."""

from __future__ import annotations

import json
from collections.abc import Iterator

from kvbench.errors import InputError
from kvbench.outfile import OutputFile
from kvbench.traffic.request import Request
from kvbench.traffic.tracefile import ChainedIds, TraceReader

TARGETS = ("mooncake", "token_ids")


def convert(reader: TraceReader, out: OutputFile, to: str = "mooncake",
            block_tokens: int | None = None) -> tuple[int, int | None]:
    """Write `reader`'s requests to `out`; returns (requests written, block size of the ids).

    To Mooncake: `timestamp` ms, lengths and ceil `hash_ids` of the trace's own block size
    (a floor trace's partial tail gets an id of its own); a token-id trace needs
    `block_tokens` and gets chained ids of its token blocks. To token ids: `input_ids` are the
    tokens kvbench derives from the hash ids (id x block + offset: equal exactly where the trace
    says the prompts are equal, not vocabulary ids)."""
    if to not in TARGETS:
        raise InputError(f"--to: expected one of {', '.join(TARGETS)}, got {to!r}")
    if to == "token_ids":
        return out.write_lines((_token_line(r) for r in reader)), 1
    return _to_mooncake(reader, out, block_tokens)


def _to_mooncake(reader: TraceReader, out: OutputFile, block_tokens: int | None):
    if reader.block_tokens == 1:  # explicit tokens: hash their blocks
        if block_tokens is None:
            raise InputError(f"--out-block-tokens: required to convert a {reader.format} trace "
                             "(tokens) to Mooncake hash ids")
        table = ChainedIds()
        lines = (_mooncake_line(r, _token_block_ids(r, block_tokens, table)) for r in reader)
        return out.write_lines(lines), block_tokens
    if block_tokens is not None:
        raise InputError(f"--out-block-tokens: a {reader.format} trace keeps its own block "
                         "size")
    sizes: set[int] = set()

    def lines() -> Iterator[str]:
        for r in reader:
            sizes.add(r.trace_block_tokens)
            yield _mooncake_line(r, r.hash_ids.tolist())

    n = out.write_lines(lines())
    return n, (sizes.pop() if len(sizes) == 1 else reader.block_tokens)


def _token_block_ids(r: Request, block: int, table: ChainedIds) -> list[int]:
    tokens = r.prompt_tokens().tolist()
    return table.chain([tuple(tokens[i:i + block]) for i in range(0, len(tokens), block)])


def _mooncake_line(r: Request, ids: list[int]) -> str:
    ms = r.arrival_s * 1000
    ts = int(ms) if float(ms).is_integer() else round(ms, 6)
    return json.dumps({"timestamp": ts, "input_length": r.input_length,
                       "output_length": r.output_length, "hash_ids": ids})


def _token_line(r: Request) -> str:
    ms = r.arrival_s * 1000
    ts = int(ms) if float(ms).is_integer() else round(ms, 6)
    return json.dumps({"task_id": r.id, "timestamp": ts,
                       "input_ids": r.prompt_tokens().tolist(), "output_tokens": r.output_length})


def tile(open_reader, out: OutputFile, times: int) -> tuple[int, int | None]:
    """Write the trace `times` times over as Mooncake JSONL: a production-size trace from a
    real one. Tile k shifts every id by k x (largest id + 1), so tiles share nothing with each
    other (as different users would not), and every arrival by k x (the trace's span plus its
    mean gap), so tiles follow each other in time. `open_reader()` returns a fresh reader."""
    if times < 1:
        raise InputError(f"--tile: expected a positive number, got {times}")
    reader = open_reader()
    top, first, last, n, block = -1, None, 0.0, 0, None
    for r in reader:
        if r.hash_ids is None:
            raise InputError("--tile: a token-id trace: convert it to Mooncake ids first")
        if len(r.hash_ids):
            top = max(top, int(r.hash_ids.max()))
        first = r.arrival_s if first is None else first
        last = r.arrival_s
        n += 1
        block = r.trace_block_tokens
    span = (last - first) if n else 0.0
    shift = span + (span / (n - 1) if n > 1 else 1.0)
    stride = top + 1

    def lines() -> Iterator[str]:
        for k in range(times):
            for r in open_reader():
                r.arrival_s += k * shift
                yield _mooncake_line(r, (r.hash_ids + k * stride).tolist())

    return out.write_lines(lines()), block
