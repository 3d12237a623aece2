"""One workload file -> its variants -> a run plan each -> the mode's runner -> metrics. The
CLI and the tuner call this."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager
from typing import NoReturn

from .config import Workload, resolve_path
from .engine.clock import hardware_from_config
from .engine.collector import fewer_collections
from .errors import InputError
from .modes.cache import run_cache
from .modes.common import ProgressFactory, References, Store
from .modes.serve import run_serve
from .plan import check_memory, check_supported, gib, is_windowed, plan_run, where
from .results import RunOutcome
from .traffic import RequestList, load_traffic, trace_path, workload_trace
from .traffic.decoding import apply_decoding
from .traffic.spill import NotSpillable, SpilledTrace
from .traffic.tracefile import warn


@fewer_collections()
def run_workload(workload: Workload, progress: ProgressFactory | None = None,
                 references: References | None = None, streams: Store | None = None,
                 checked: Callable[[str], None] | None = None) -> list[RunOutcome]:
    """Run every variant of `workload` on the same request stream (reloaded only when a
    variant changes the requests or the seed, or needs it in memory where another streamed
    it). The variants share the reference hit rates they have in common, kept in
    `references`, and the loaded request streams, kept in `streams` (`request_streams`); a
    caller running several workloads passes its stores to share them there too, as a tune
    study does across its trials. Without `streams`, those loaded here are released at the
    end. `checked` is called with each variant's name once it is checked, before it runs (so
    a caller's warnings come only for a variant that runs, never before its error)."""
    refs = references if references is not None else References()
    outcomes = []
    with _streams(streams) as kept:
        for name, plan, requests, source in _variants(workload, kept):
            if checked is not None:
                checked(name)
            outcomes.append((run_serve if plan.workload.run.mode == "serve" else run_cache)(
                name, plan, requests, progress, refs.of(source)))
    return outcomes


def request_streams(max_entries: int | None = None) -> Store:
    """A store of loaded request streams for `run_workload`, keyed by `request_source`: at most
    `max_entries` (None: no bound), a dropped spilled trace's file deleted."""
    return Store(max_entries, release=_release)


def check_workload(workload: Workload) -> None:
    """Refuse (InputError) what `run_workload` would refuse, without running: the requests are
    loaded (a trace is read to its end) and every variant's cache sized."""
    with _streams(None) as kept:
        for _ in _variants(workload, kept):
            pass


def workload_warnings(workload: Workload) -> list[tuple[tuple[str, ...], str]]:
    """What would run but is probably not what was meant: a GPU cache larger than the
    hardware preset's memory. (The variants a warning is about, the warning.)"""
    over: dict[tuple[int, str, int], list[str]] = {}
    for name, wl in workload.variant_workloads():
        m = wl.model
        gpu_bytes = wl.cache.max_tokens * m.num_layers * m.kv_bytes_per_token_per_layer
        memory = hardware_from_config(wl.hardware).memory_bytes
        if memory is not None and gpu_bytes > memory:
            over.setdefault((gpu_bytes, wl.hardware.preset, memory), []).append(name)
    return [(tuple(names), f"{where(workload)}: cache.max_tokens: the GPU cache takes "
             f"{gib(gpu_bytes)} but a {preset} has {gib(memory)} in all (variants: "
             f"{', '.join(names)})")
            for (gpu_bytes, preset, memory), names in over.items()]


def _variants(workload: Workload, streams: Store):
    """(name, run plan, requests, `request_source`) of each variant, checked: the requests
    fit the cache and what the run will allocate fits this machine's memory
    (`plan.plan_run`). The requests come from `streams` (loaded there when missing); a run
    may change nothing on them but their memos (pure functions of a request and a block
    size), so the next run on the same source replays equal requests."""
    for name, wl in workload.variant_workloads():
        check_supported(wl)
        stream = _streamable(wl)
        source = request_source(wl, stream)
        requests = streams.once(source, lambda: _load(wl, stream))
        requests.begin_pass(wl.cache.tokens_per_block)
        try:
            plan = plan_run(wl, requests)
        except InputError as exc:
            if not workload.variants:
                raise
            # Variants differ in what makes a run fit (block size, capacity, host tier).
            raise InputError(f"{exc} (variant {name})") from None
        yield name, plan, requests, source


@contextmanager
def _streams(streams: Store | None):
    """`streams`, or a store of its own (no bound) released on leaving."""
    if streams is not None:
        yield streams
        return
    kept = request_streams()
    try:
        yield kept
    finally:
        kept.clear()


def _release(requests: RequestList | SpilledTrace) -> None:
    if isinstance(requests, SpilledTrace):
        requests.close()


def request_source(wl: Workload, stream: bool) -> str:
    """What names the request stream of `wl` across runs: the requests section, the seed,
    whether it streams and, for a trace, the file (its resolved path, device, inode, size and
    modification time), so a rewritten trace is another stream. Loading is deterministic, so
    two runs with one source replay equal requests."""
    source = wl.requests.model_dump_json() + f"/seed={wl.run.seed}/stream={stream}"
    if wl.requests.source != "trace":
        return source
    path = trace_path(wl.requests, _base_dir(wl)).resolve()
    try:
        st = path.stat()
    except OSError:  # reading it fails with one clear line
        return f"{source}/{path}"
    return f"{source}/{path}/{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}"


def _base_dir(wl: Workload):
    """The folder a workload's relative paths start from."""
    return wl.source_path.parent if wl.source_path is not None else resolve_path(wl, ".")


def _synthetic_bytes(requests_cfg) -> int:
    """Bytes of the token ids a synthetic stream holds (int64): multi-turn prompts repeat
    their session so far, half the turns on average."""
    s = requests_cfg.synthetic
    n = s.num_requests  # the generator makes them all before a limit cuts
    profile = s.prompt_tokens if s.profile_tokens is None else s.profile_tokens
    per_request = s.system_prompt_tokens + profile + s.prompt_tokens + s.output_tokens
    if s.generator == "multi_turn":
        per_request = s.system_prompt_tokens + (s.turns + 1) / 2 * (s.prompt_tokens
                                                                    + s.output_tokens)
    return int(8 * (n * per_request + s.num_users * (s.system_prompt_tokens + s.prompt_tokens)))


def load_workload_requests(wl: Workload) -> RequestList:
    """The request stream a run of `wl` replays."""
    return _load(wl)


def count_workload_requests(wl: Workload) -> int:
    """How many requests a run of `wl` replays. A trace is read once and none of its requests
    kept, so counting one (`kvbench tune --holdout`) costs no more memory than streaming it."""
    r = wl.requests
    if r.source != "trace" or r.skip:  # generated, or cut by `load_traffic`: counted loaded
        return len(_load(wl))
    reader = workload_trace(r, base_dir=_base_dir(wl), seed=wl.run.seed)
    count = sum(1 for _ in reader)
    if not count:
        _empty(wl, reader)
    return count


def _empty(wl: Workload, reader=None) -> NoReturn:
    skipped = getattr(reader, "without_prompt", 0)
    why = (f" ({skipped:,} trace record{'s' if skipped > 1 else ''} skipped: no prompt tokens)"
           if skipped else "")
    raise InputError(f"{where(wl)}: requests: the request stream is empty{why}")


def _streamable(wl: Workload) -> bool:
    """A run of a trace on one pool without a data plane streams its requests
    (`traffic/spill.py`, `oracle.streamed_reference_hit_rates`; in serve mode the loop pulls
    them as they arrive and keeps state only for waiting and running ones): its memory does
    not grow with the trace, so production-size traces fit."""
    r = wl.requests
    return (r.source == "trace" and not is_windowed(wl)
            and wl.run.backend == "none" and r.beam_widths is None and r.retention is None
            and not r.encoder.tokens)


def _load(wl: Workload, stream: bool = False) -> RequestList | SpilledTrace:
    if wl.requests.source == "synthetic":
        check_memory(wl, _synthetic_bytes(wl.requests), "the synthetic requests' tokens",
                      "lower requests.synthetic.num_requests, num_users or the token counts")
    base = _base_dir(wl)
    requests = reader = None
    if stream:
        reader = workload_trace(wl.requests, base_dir=base, seed=wl.run.seed)
        try:
            requests = SpilledTrace(iter(reader), beam_width=wl.requests.beam_width)
        except NotSpillable:
            requests = None  # read again, into memory
    if requests is None:
        requests, reader = load_traffic(wl.requests, base_dir=base, seed=wl.run.seed)
    if not len(requests):
        _empty(wl, reader)
    if reader is not None and reader.without_prompt:
        warn(f"{reader.path}: skipped the records with no prompt tokens (nothing to prefill "
             f"or cache): {reader.without_prompt:,}")
    if reader is not None and reader.without_ids == len(requests) and wl.run.mode == "cache":
        warn(f"{reader.path}: the trace has no prefix information ({reader.format}: arrivals "
             "and lengths only), so cache mode has nothing to reuse and its hit rates are 0 "
             "by construction; run.mode: serve uses such a trace as it is")
    if not isinstance(requests, SpilledTrace):  # a spilled trace has neither option
        apply_decoding(requests, wl.requests, wl.run.seed)
        if wl.requests.retention is not None:
            retention = wl.requests.retention.to_retention()
            for r in requests:
                r.retention = retention
    return requests
