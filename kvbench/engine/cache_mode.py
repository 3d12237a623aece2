"""Cache mode: requests replayed one at a time in arrival order, no decode (DESIGN.md 3)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..cache.manager import KVCacheManager
from ..traffic.request import Request
from .timeline import Timeline


@dataclass(slots=True)
class CacheModeResult:
    prompt_tokens: int
    reused_tokens: int
    reused_full_blocks: int
    reused_partial_tokens: int
    timeline: Timeline


def replay_cache_mode(
    requests: Sequence[Request], manager: KVCacheManager,
    on_progress: Callable[[int], None] | None = None, progress_every: int = 256,
) -> CacheModeResult:
    """For each request: match and claim the cached prefix, allocate the rest of the prompt,
    mark it computed, release. Raises ValueError if a request cannot get its blocks (the caller
    checks sizes first, so this means a bug, not bad input)."""
    timeline = Timeline("request", ("reused_tokens", "prompt_tokens", "in_use", "cached", "free"))
    cols = timeline.columns
    c_reused, c_prompt, c_in_use, c_cached, c_free = (
        cols["reused_tokens"], cols["prompt_tokens"], cols["in_use"], cols["cached"], cols["free"])
    pool = manager.gpu
    prompt = reused = full = partial = 0
    for i, r in enumerate(requests):
        seq = manager.add_sequence(r)
        if not manager.resize(seq, r.input_length):
            raise ValueError(f"request {r.id} does not fit in the cache")
        manager.commit(seq, r.input_length)
        in_use = pool.num_in_use
        manager.release(seq)
        prompt += r.input_length
        reused += seq.reused_tokens
        full += seq.reused_full_blocks
        partial += seq.partial_tokens
        c_reused.append(seq.reused_tokens)
        c_prompt.append(r.input_length)
        c_in_use.append(in_use)
        c_cached.append(pool.num_cached)
        c_free.append(len(pool.empty))
        if on_progress is not None and i % progress_every == progress_every - 1:
            on_progress(progress_every)
    if on_progress is not None:
        on_progress(len(requests) % progress_every)
    return CacheModeResult(prompt, reused, full, partial, timeline)
