"""Cross-attention KV of encoder-decoder requests, for both engine modes.

A request's encoder input (`Request.encoder`) is a prompt of the cross-attention cache (a
`KVCacheManager` with `cross_kv`): when the request starts its first context chunk the cross
cache adds it (reusing what an identical encoder input left), allocates the rest and, once
that chunk is computed, commits it all: the encoder's KV is written once and never grows in
decode. The sequence is released with the request's own. A request without an encoder input
holds nothing there and reuses nothing. In serve mode the clock charges an encoder pass
(bidirectional attention) over the encoder tokens the cross cache did not have, on the
decoder's shape (kvbench has no encoder model of its own): modeled.

On the data plane (`cross_step`) the cross cache has a pool of its own: the request's first
step writes the encoder K/V of the positions it did not reuse, and every step item of the
request (each beam's, each window pool's) attends to all of its cross pages.
"""

from __future__ import annotations

import numpy as np

from ..cache.manager import KVCacheManager
from ..cache.seq import CacheSeq
from ..kernels.step import CrossKV, StepItem
from ..traffic.request import Request, namespace_salt


class CrossTally:
    """Encoder inputs and their reuse, over a run (one entry per request's counted add)."""

    __slots__ = ("requests", "encoder_tokens", "reused_tokens", "reused_full_blocks",
                 "reused_partial_blocks")

    def __init__(self) -> None:
        self.requests = self.encoder_tokens = self.reused_tokens = 0
        self.reused_full_blocks = self.reused_partial_blocks = 0

    def count(self, seq: CacheSeq) -> None:
        self.requests += 1
        self.encoder_tokens += seq.request.input_length
        self.reused_tokens += seq.reused_tokens
        self.reused_full_blocks += seq.reused_full_blocks
        self.reused_partial_blocks += seq.partial_tokens > 0

    def metrics(self, cross: KVCacheManager, block_bytes: int) -> dict:
        peak = cross.gpu.peak_in_use
        return {
            "cross_requests": self.requests,
            "encoder_tokens": self.encoder_tokens,
            "cross_reused_tokens": self.reused_tokens,
            "cross_hit_rate": (self.reused_tokens / self.encoder_tokens
                               if self.encoder_tokens else None),
            "cross_reused_full_blocks": self.reused_full_blocks,
            "cross_reused_partial_blocks": self.reused_partial_blocks,
            "cross_gpu_blocks_total": cross.spec.num_gpu_blocks,
            "cross_peak_gpu_blocks": peak,
            "cross_peak_gpu_bytes": peak * block_bytes,
        }



def encoder_ids(encoder: Request) -> np.ndarray:
    """The ids the data plane's encoder K/V generator sees for an encoder input: its tokens
    salted with the input's digest (its namespace), since an encoder attends both ways and a
    position's K/V depend on the whole input. A block reused from another input is then
    caught even where the two hold the same tokens."""
    salt = namespace_salt(encoder.namespace) & ((1 << 62) - 1)
    return np.asarray(encoder.prompt_tokens(), dtype=np.int64) ^ np.int64(salt)


def cross_ops(plane, cross: KVCacheManager, ops: dict) -> None:
    """Move the cross cache's pending copy ops into a step's `ops`, under the plane's cross
    pool."""
    for pending in cross.drain_copy_ops().values():
        ops.setdefault(plane.cross_pool, []).extend(pending)


def cross_step(request_id: int, cseq: CacheSeq, tokens: np.ndarray, first: bool,
               encoder: list[StepItem]) -> CrossKV:
    """A request's cross-attention work in a data-plane step (before `cross.commit`): appends
    the encoder write of its `first` step (positions past what the input reused) to
    `encoder` and returns the view its step items attend to. `tokens`: `encoder_ids` of
    the input."""
    n = cseq.request.input_length
    if first and cseq.num_computed < n:
        encoder.append(StepItem(request_id, tokens, cseq.blocks, cseq.num_computed, n))
    return CrossKV(tokens, cseq.blocks)
