"""A draft model's KV cache that mirrors the target's (two-model speculative decoding).

TensorRT-LLM gives the draft model its own KV cache manager, sized with the same token budget
(the per-token size the budget is divided by includes the draft's layers), and drives it with
the same requests. `MirroredCacheManager` does that: every call made on the target cache is
made on the draft cache too, so with equal block counts and settings the draft holds the same
block ids for the same sequences (asserted by `_check_sanity`), in its own shape; a data plane
writes and checks its KV in its own tensors. Everything a caller reads (counters, the GPU
pool, copy ops) is the target's; the draft's are on `draft`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .manager import KVCacheManager
from .seq import CacheSeq

if TYPE_CHECKING:
    from ..traffic.request import Request


class MirroredCacheManager:
    """The target cache, with `draft` receiving the same calls (see the module docstring)."""

    __slots__ = ("target", "draft", "_draft_of")

    def __init__(self, target: KVCacheManager, draft: KVCacheManager) -> None:
        if (target.tpb, target.gpu.capacity) != (draft.tpb, draft.gpu.capacity):
            raise ValueError("the draft cache mirrors the target's blocks: same tokens_per_block"
                             " and block count")
        self.target = target
        self.draft = draft
        self._draft_of: dict[CacheSeq, CacheSeq] = {}

    def __getattr__(self, name: str):
        return getattr(self.target, name)

    # --- the calls both caches get ----------------------------------------------------------

    def add_sequence(self, request: Request) -> CacheSeq:
        seq = self.target.add_sequence(request)
        self._draft_of[seq] = self.draft.add_sequence(request)
        return seq

    def add_sequences(self, requests: list[Request]) -> list[CacheSeq]:
        seqs = self.target.add_sequences(requests)
        for seq, d in zip(seqs, self.draft.add_sequences(requests)):
            self._draft_of[seq] = d
        return seqs

    def resize(self, seq: CacheSeq, num_tokens: int) -> bool:
        ok = self.target.resize(seq, num_tokens)
        if ok and not self.draft.resize(self._draft_of[seq], num_tokens):
            raise AssertionError("the draft cache diverged from the target's")
        return ok

    def commit(self, seq: CacheSeq, num_computed: int) -> None:
        self.target.commit(seq, num_computed)
        self.draft.commit(self._draft_of[seq], num_computed)

    def release(self, seq: CacheSeq) -> None:
        self.target.release(seq)
        self.draft.release(self._draft_of.pop(seq))

    def shrink(self, seq: CacheSeq, num_tokens: int) -> int:
        self.draft.shrink(self._draft_of[seq], num_tokens)
        return self.target.shrink(seq, num_tokens)

    def draft_of(self, seq: CacheSeq) -> CacheSeq:
        """The draft cache's sequence of the same request."""
        return self._draft_of[seq]

    def enable_sanity_tracking(self) -> None:
        self.target.enable_sanity_tracking()
        self.draft.enable_sanity_tracking()

    def _check_sanity(self) -> bool:
        assert self.target._check_sanity() and self.draft._check_sanity()
        for seq, d in self._draft_of.items():
            assert d.blocks == seq.blocks and d.beams == seq.beams, "draft blocks diverged"
        assert self.draft.gpu.num_in_use == self.target.gpu.num_in_use
        return True
