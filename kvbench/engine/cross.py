"""Cross-attention KV of encoder-decoder requests, for both engine modes.

A request's encoder input (`Request.encoder`) is a prompt of the cross-attention cache (a
`KVCacheManager` with `cross_kv`): when the request starts its first context chunk the cross
cache adds it (reusing what an identical encoder input left), allocates the rest and, once
that chunk is computed, commits it all: the encoder's KV is written once and never grows in
decode. The sequence is released with the request's own. A request without an encoder input
holds nothing there and reuses nothing. In serve mode the clock charges an encoder pass
(bidirectional attention) over the encoder tokens the cross cache did not have, on the
decoder's shape (kvbench has no encoder model of its own): modeled.
"""

from __future__ import annotations

from ..cache.manager import KVCacheManager, Sequence


class CrossTally:
    """Encoder inputs and their reuse, over a run (one entry per request's counted add)."""

    __slots__ = ("requests", "encoder_tokens", "reused_tokens", "reused_full_blocks",
                 "reused_partial_blocks")

    def __init__(self) -> None:
        self.requests = self.encoder_tokens = self.reused_tokens = 0
        self.reused_full_blocks = self.reused_partial_blocks = 0

    def count(self, seq: Sequence) -> None:
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

