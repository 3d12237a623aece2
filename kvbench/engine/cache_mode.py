"""Cache mode: requests replayed one at a time in arrival order, no decode (DESIGN.md 3).

A `WindowedCacheManager` (sliding-window layers) runs the same loop as a full-attention one:
its `resize` begins the request's one prefill step over every pool (out-of-window prompt
blocks go to scratch slots when that is on), its `commit` ends it, and `gpu` sums the pools
for the timeline; so `in_use` is read before the commit, while the step's scratch slots are
held.

With a `cross` cache (`engine/cross.py`) a request's encoder input is added, written and
released there beside its prompt; on the data plane the step writes its encoder K/V and the
prompt's queries attend to them.

With a draft model (a mirrored cache, `cache/mirror.py`) every call reaches its pools too,
and its `draft_plane` computes the same prompt positions in its own shape.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ..cache.add import Phase2AllocationError
from ..cache.manager import KVCacheManager
from ..cache.protocol import CacheManager
from ..traffic.request import Request
from .collector import fewer_collections
from .cross import CrossTally, cross_ops, cross_step, encoder_ids
from .plane import step_items
from .timeline import Timeline


@dataclass(slots=True)
class CacheModeResult:
    prompt_tokens: int
    reused_tokens: int
    reused_tokens_host: int
    reused_full_blocks: int
    reused_partial_tokens: int
    reused_partial_blocks: int
    timeline: Timeline
    cross: CrossTally
    draft_reused_full_blocks: int = 0
    draft_reused_partial_blocks: int = 0


@fewer_collections()
def replay_cache_mode(
    requests: Sequence[Request], manager: CacheManager,
    on_progress: Callable[[int], None] | None = None, progress_every: int = 256,
    data_plane=None, cross: KVCacheManager | None = None, draft_plane=None,
) -> CacheModeResult:
    """For each request: match and claim the cached prefix, allocate the rest of the prompt,
    mark it computed, release. Raises ValueError if a request cannot get its blocks (the caller
    checks sizes first, so this means a bug, not bad input). With a `data_plane`
    (`kvbench.kernels.dataplane.DataPlane`; the manager must emit copy ops) each request is one
    data-plane step that computes the prompt past its reused prefix. Windowed managers, a
    `cross` cache and a draft model (`draft_plane`): see the module docstring."""
    timeline = Timeline("request", ("reused_tokens", "prompt_tokens", "in_use", "cached", "free"),
                        sums=("reused_tokens", "prompt_tokens"))
    cols = timeline.columns
    c_reused, c_prompt, c_in_use, c_cached, c_free = (
        cols["reused_tokens"], cols["prompt_tokens"], cols["in_use"], cols["cached"], cols["free"])
    pool = manager.gpu
    prompt = reused = host = full = partial = partial_blocks = 0
    draft = getattr(manager, "draft", None)
    draft_full = draft_partial = 0
    tally = CrossTally()
    for i, r in enumerate(requests):
        manager.refresh(r.arrival_s)
        try:
            seq = manager.add_sequence(r)
        except Phase2AllocationError as exc:
            raise Phase2AllocationError(exc.request_id, exc.what, i) from None
        if not manager.resize(seq, r.input_length):
            raise ValueError(f"request {r.id} does not fit in the cache")
        cseq = _encode(cross, r) if cross is not None and r.encoder is not None else None
        if data_plane is not None:
            _data_plane_step(data_plane, manager, r, seq, cross, cseq)
        if draft_plane is not None:
            _draft_step(draft_plane, manager, r, seq)
        if draft is not None:
            d = manager.draft_of(seq)
            draft_full += d.reused_full_blocks
            draft_partial += d.partial_tokens > 0
        if cseq is not None:
            tally.count(_encoded(cross, cseq))
        in_use = pool.num_in_use
        manager.commit(seq, r.input_length)
        manager.release(seq)
        prompt += r.input_length
        reused += seq.reused_tokens
        host += seq.reused_tokens_host
        full += seq.reused_full_blocks
        partial += seq.partial_tokens
        partial_blocks += seq.partial_tokens > 0
        c_reused.append(seq.reused_tokens)
        c_prompt.append(r.input_length)
        c_in_use.append(in_use)
        c_cached.append(pool.num_cached)
        c_free.append(len(pool.empty))
        if on_progress is not None and i % progress_every == progress_every - 1:
            on_progress(progress_every)
    if on_progress is not None:
        on_progress(len(requests) % progress_every)
    return CacheModeResult(prompt, reused, host, full, partial, partial_blocks, timeline, tally,
                           draft_full, draft_partial)


def _draft_step(draft_plane, manager: CacheManager, r: Request, seq) -> None:
    """The draft model's data-plane step for a request: the prompt positions its target
    computes, in the draft's pools."""
    draft = manager.draft
    draft_plane.execute_step(draft.drain_copy_ops(), step_items(
        draft, r.id, manager.draft_of(seq), seq.num_computed, r.input_length,
        lambda beam: r.prompt_tokens()))


def _encode(cross: KVCacheManager, r: Request):
    """Add a request's encoder input to the cross cache and allocate the rest of it (the
    caller writes it, then commits and releases)."""
    cseq = cross.add_sequence(r.encoder)
    if not cross.resize(cseq, r.encoder.input_length):
        raise ValueError(f"request {r.id}: its encoder input does not fit the cross cache")
    return cseq


def _encoded(cross: KVCacheManager, cseq):
    """Commit (the encoder's KV is written) and release a request's encoder input."""
    cross.commit(cseq, cseq.request.input_length)
    cross.release(cseq)
    return cseq


def _data_plane_step(data_plane, manager: CacheManager, r: Request, seq,
                     cross: KVCacheManager | None, cseq) -> None:
    """The request's one step: its prompt past the reused prefix, in every pool; with an
    encoder input, its encoder K/V past the cross reuse, which the prompt attends to."""
    tokens = r.prompt_tokens()
    ops = manager.drain_copy_ops()
    encoder: list = []
    view = None
    if cseq is not None:
        cross_ops(data_plane, cross, ops)
        view = cross_step(r.id, cseq, encoder_ids(r.encoder), True, encoder)
    data_plane.execute_step(ops, step_items(
        manager, r.id, seq, seq.num_computed, r.input_length, lambda beam: tokens, view),
        encoder)
