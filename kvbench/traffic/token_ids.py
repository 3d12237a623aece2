"""Reader for JSONL traces with explicit prompt token ids, e.g. trtllm-bench's dataset format
`{"task_id": int, "input_ids": [int], "output_tokens": int}`, with an optional `timestamp` (ms)
on every line or none (then requests arrive by `requests.sessions`, each a session of its own).
Sharing is exact at any block size, partial blocks included.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvbench.traffic.mooncake import MAX_INPUT_LENGTH, MAX_OUTPUT_LENGTH
from kvbench.traffic.request import Request
from kvbench.traffic.sessions import single_request_arrivals
from kvbench.traffic.tracefile import (
    BadField,
    Timestamps,
    TraceOptions,
    TraceReader,
    fail,
    jsonl_records,
    need_int,
    need_list,
    show,
)

# Not only vocabulary ids: `kvbench trace convert --to token_ids` writes derived tokens.
MAX_TOKEN_ID = (1 << 62) - 1


class TokenIdsReader(TraceReader):
    format = "token_ids"

    def __init__(self, path: Path, opts: TraceOptions) -> None:
        super().__init__(path, opts)
        self.block_tokens = 1
        self._records = jsonl_records(self.path)

    def _requests(self) -> Iterator[Request]:
        name = str(self.path)
        stamps = Timestamps()
        arrivals = single_request_arrivals(self.opts.sessions, self.opts.seed)
        for lineno, obj in self._records:
            try:
                tokens = _tokens(obj)
                output = need_int(obj, "output_tokens", 0, MAX_OUTPUT_LENGTH)
                if "task_id" in obj and type(obj["task_id"]) not in (int, str):
                    raise BadField(f"'task_id' must be an integer or a string, got "
                                   f"{show(obj['task_id'])}")
                ts = stamps.read(obj)
            except BadField as e:
                raise fail(name, lineno, str(e)) from None
            if ts is not None:
                stamps.accept(name, lineno, ts)
                arrival = ts / 1000
            else:
                arrival = next(arrivals)
            yield Request(id=0, arrival_s=arrival, input_length=len(tokens),
                          output_length=output, tokens=tokens)


def _tokens(obj: dict) -> np.ndarray:
    ids = need_list(obj, "input_ids", "token ids")
    if not 0 < len(ids) < MAX_INPUT_LENGTH:
        raise BadField(f"'input_ids' must hold 1 to {MAX_INPUT_LENGTH - 1} tokens, got {len(ids)}")
    for t in ids:
        if type(t) is not int or not 0 <= t <= MAX_TOKEN_ID:
            raise BadField(f"'input_ids' must hold integers in [0, {MAX_TOKEN_ID}], got {show(t)}")
    return np.array(ids, dtype=np.int64)
