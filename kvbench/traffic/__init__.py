"""Request streams: synthetic generators and trace readers, plus trace statistics."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from kvbench.errors import InputError, TraceWarning
from kvbench.metrics import percentile_summary
from kvbench.traffic.formats import FORMATS, open_trace, sniff
from kvbench.traffic.mooncake import read_mooncake
from kvbench.traffic.request import Request, RequestList
from kvbench.traffic.synthetic import generate
from kvbench.traffic.tokenize import APPROX
from kvbench.traffic.sessions import SessionStart
from kvbench.traffic.tracefile import TraceOptions, TraceReader

__all__ = ["FORMATS", "Request", "RequestList", "TraceOptions", "TraceReader", "TraceWarning", "generate",
           "describe_source", "load_requests", "open_trace", "read_mooncake", "sniff", "trace_options",
           "trace_stats", "workload_trace"]

DEFAULT_STATS_BLOCK_SIZES = (16, 32, 64, 128, 256, 512)


def load_requests(requests_cfg, *, base_dir: Path, seed: int) -> RequestList:
    """The request stream of a workload's `requests` section, in arrival order.

    A relative trace path is taken relative to `base_dir` (the workload file's folder).
    """
    return load_traffic(requests_cfg, base_dir=base_dir, seed=seed)[0]


def load_traffic(requests_cfg, *, base_dir: Path, seed: int
                 ) -> tuple[RequestList, TraceReader | None]:
    """`load_requests` and, for a trace, the reader that read it (its block size and
    convention); None for synthetic traffic. `requests.skip` drops the first requests (the
    rest's arrivals shifted to start at 0) before `requests.limit` counts."""
    skip = requests_cfg.skip
    if not skip:
        return _load_all(requests_cfg, base_dir=base_dir, seed=seed)
    limit = requests_cfg.limit
    requests, reader = _load_all(
        requests_cfg.model_copy(update={"limit": None if limit is None else skip + limit}),
        base_dir=base_dir, seed=seed)
    del requests[:skip]
    if requests:
        start = requests[0].arrival_s
        for r in requests:
            r.arrival_s -= start
    return requests, reader


def _load_all(requests_cfg, *, base_dir: Path, seed: int
              ) -> tuple[RequestList, TraceReader | None]:
    limit = requests_cfg.limit
    time_scale = requests_cfg.time_scale
    if requests_cfg.source == "synthetic":
        requests = RequestList(generate(requests_cfg.synthetic, seed))
        if limit is not None:
            del requests[limit:]
        for r in requests:
            r.arrival_s *= time_scale
        return requests, None
    if requests_cfg.source == "trace":
        reader = workload_trace(requests_cfg, base_dir=base_dir, seed=seed)
        return RequestList(reader), reader
    raise InputError(f"requests.source: unknown source {requests_cfg.source!r}")


def workload_trace(requests_cfg, *, base_dir: Path, seed: int) -> TraceReader:
    """The reader of a `requests` section's trace, with the section's options."""
    return open_trace(trace_path(requests_cfg, base_dir), requests_cfg.format,
                      trace_options(requests_cfg, seed, base_dir))


def trace_path(requests_cfg, base_dir: Path, path: str | None = None) -> Path:
    """`requests.path` (or another path of the section) resolved against the YAML's folder."""
    path = Path(path or requests_cfg.path).expanduser()
    return path if path.is_absolute() else base_dir / path


def describe_source(requests_cfg, base_dir: Path) -> str | None:
    """One line for a run's header: the trace, its format and, where the trace has no absolute
    times for them, how sessions start (it moves hit rates a lot on conversation traces)."""
    if requests_cfg.source != "trace":
        return None
    path = trace_path(requests_cfg, base_dir)
    fmt = requests_cfg.format
    try:
        shown = f"{sniff(path)[0]} (auto)" if fmt == "auto" else fmt
    except InputError:
        shown = fmt
    text = f"requests: {shown} trace {path}"
    if shown.split()[0] in ("weka", "servegen", "chat"):
        s = requests_cfg.sessions
        how = {"back_to_back": "back_to_back", "stagger": f"stagger every {s.interval_s} s",
               "poisson": f"poisson at {s.rate}/s"}[s.start]
        text += f"; sessions start {how} (requests.sessions)"
    if shown.split()[0] == "chat":
        text += (f", turns {requests_cfg.sessions.turn_interval_s:g} s apart; tokens: "
                 + ("approx, counts approximate (requests.tokenizer)"
                    if requests_cfg.tokenizer == APPROX else requests_cfg.tokenizer))
    return text


def trace_options(requests_cfg, seed: int, base_dir: Path = Path(".")) -> TraceOptions:
    """The reader options of a workload's `requests` section."""
    sessions = requests_cfg.sessions
    tokenizer = requests_cfg.tokenizer
    if tokenizer != APPROX:
        tokenizer = str(trace_path(requests_cfg, base_dir, tokenizer))
    return TraceOptions(
        block_tokens=requests_cfg.block_tokens, hash_ids_cover=requests_cfg.hash_ids_cover,
        sessions=SessionStart(sessions.start, sessions.interval_s, sessions.rate,
                              sessions.turn_interval_s),
        output_length=requests_cfg.output_length, tokenizer=tokenizer, seed=seed,
        time_scale=requests_cfg.time_scale, limit=requests_cfg.limit)


def trace_stats(
    requests: Sequence[Request], block_sizes: Sequence[int] = DEFAULT_STATS_BLOCK_SIZES,
    reader: TraceReader | None = None,
) -> dict:
    """Size, rate, length percentiles and the ideal full-block hit rate per block size.

    The ideal hit rate is the hit rate of an unlimited cache replaying the requests in order:
    each reuses its longest prefix of full blocks seen before, except the last prompt token.
    With the `reader` that read them: the trace's native block size (tokens per hash id) and
    length convention; an ideal below the native block size is not resolvable (the trace does
    not say where inside a block two prompts diverge), so it is marked, as a lower bound.
    """
    n = len(requests)
    inputs = np.fromiter((r.input_length for r in requests), dtype=np.int64, count=n)
    outputs = np.fromiter((r.output_length for r in requests), dtype=np.int64, count=n)
    arrivals = np.fromiter((r.arrival_s for r in requests), dtype=np.float64, count=n)
    duration = float(arrivals.max() - arrivals.min()) if n else 0.0
    prompt_tokens = int(inputs.sum())
    native = reader.block_tokens if reader is not None else None
    if native is not None and native > 1 and native not in block_sizes:
        block_sizes = sorted({*block_sizes, native})
    reused = _ideal_reused_tokens(requests, inputs, block_sizes)
    stats = {
        "requests": n,
        "duration_s": duration,
        "rate_rps": n / duration if duration > 0 else None,
        "prompt_tokens": prompt_tokens,
        "output_tokens": int(outputs.sum()),
        "input_length": percentile_summary(inputs, with_max=True),
        "output_length": percentile_summary(outputs, with_max=True),
        "ideal_hit_rate": {
            bs: (reused[bs] / prompt_tokens if prompt_tokens else 0.0) for bs in block_sizes
        },
    }
    if reader is not None:
        stats.update({
            "format": reader.format,
            "native_block_tokens": native,
            "convention": reader.convention(),
            "tokenizer": reader.tokenizer.name if reader.tokenizer is not None else None,
            "requests_without_prefix_info": reader.without_ids,
            "records_without_prompt": reader.without_prompt,
            "ideal_resolvable": {bs: native is not None and bs >= native for bs in block_sizes},
        })
    return stats


def _ideal_reused_tokens(
    requests: Sequence[Request], inputs: np.ndarray, block_sizes: Sequence[int]
) -> dict[int, int]:
    """Reused prompt tokens per block size with an unlimited cache."""
    plain_trace = np.fromiter(
        (r.hash_ids is not None and r.namespace is None for r in requests),
        dtype=bool,
        count=len(requests),
    )
    # Trace prompts share whole trace blocks, so one pass over their ids gives each request's
    # longest shared prefix in tokens, and every block size follows from it; key sets per block
    # size would mean sorting or hashing ~18M keys for the conversation trace.
    shared = _trace_shared_prefix([r for r, t in zip(requests, plain_trace) if t])
    trace_inputs = inputs[plain_trace]
    others = [r for r, t in zip(requests, plain_trace) if not t]
    reused = {}
    for bs in block_sizes:
        blocks = np.minimum(shared // bs, (trace_inputs - 1) // bs)
        reused[bs] = int(blocks.sum()) * bs + _keyed_reused_tokens(others, bs)
    return reused


def _trace_shared_prefix(requests: Sequence[Request]) -> np.ndarray:
    """Per request: how many leading tokens it shares with some earlier request.

    Relies on prefix-chained ids (the Mooncake reader checks it): an id seen before means the
    whole prefix through that block is shared with every earlier request that had the id, up to
    the shorter of the two prompts.
    """
    longest: dict[int, int] = {}
    shared = np.zeros(len(requests), dtype=np.int64)
    for i, r in enumerate(requests):
        ids = r.hash_ids.tolist()
        length = r.input_length
        tbt = r.trace_block_tokens
        for b, h in enumerate(ids):
            other = longest.get(h)
            if other is None:
                break
            shared[i] = min(other, length, (b + 1) * tbt)
        for h in ids:
            if longest.get(h, 0) < length:
                longest[h] = length
    return shared


def _keyed_reused_tokens(requests: Sequence[Request], bs: int) -> int:
    seen: set[int] = set()
    reused_blocks = 0
    for r in requests:
        keys = r.block_keys(bs)
        cap = (r.input_length - 1) // bs
        hits = 0
        while hits < cap and keys[hits] in seen:
            hits += 1
        reused_blocks += hits
        seen.update(keys)
    return reused_blocks * bs
