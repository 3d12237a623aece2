"""A draft model's KV cache that mirrors the target's (two-model speculative decoding).

TensorRT-LLM gives the draft model its own KV cache manager, sized with the same token budget
(the per-token size the budget is divided by includes the draft's layers), and drives it with
the same requests. `MirroredCacheManager` does that: every call made on the target cache is
made on the draft cache too, so with equal block counts and settings the draft holds the same
block ids for the same sequences (asserted by `_check_sanity`), in its own shape; a data plane
writes and checks its KV in its own tensors. Everything a caller reads (counters, the GPU
pool, copy ops) is the target's; the draft's are on `draft`.

With sliding-window layers (the target's, the draft's or both) the caches cannot hold the same
block ids: each model has a pool per attention life cycle of its own. Then
`MirroredWindowedCacheManager` puts the draft's pools after the target's in one
`WindowedCacheManager`, so every call (add, step, commit, shrink, release) acts on both
models' pools: the reuse is what every pool of both can serve (a token the draft must
recompute is not reused by the target either), the scheduler's per-pool admission counts
the draft's pools beside the target's, and the draft holds the same reserved extra tokens.
Its counters, page views and copy ops are the target's; `draft` gives the draft's (pool
indices counted from its first pool) to its data plane.

Invariants (`_check_sanity`): every block is in one pool's accounting (each pool's own
checks); both caches' peaks lie within the peak of both at once (`peak_kv_bytes`) and it
within their sum.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from .ids import CopyOp
from .lifecycle import LifeCycle
from .manager import CacheSpec, KVCacheManager
from .protocol import PageView
from .seq import CacheSeq
from .window_counters import _Pools, pool_figures, pool_name
from .windows import WindowedCacheManager, WindowedSequence

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

    def refresh(self, now_s: float) -> None:
        self.target.refresh(now_s)
        self.draft.refresh(now_s)

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

    def draft_memory(self, block_bytes: int, draft_block_bytes: int) -> dict:
        """The draft cache's size and peak, and the peak of both caches at once (the same
        blocks in both, so the target's peak in both shapes)."""
        peak = self.draft.gpu.peak_in_use
        return {
            "draft_gpu_blocks_total": self.draft.spec.num_gpu_blocks,
            "draft_peak_gpu_blocks": peak,
            "draft_peak_gpu_bytes": peak * draft_block_bytes,
            "peak_kv_bytes": peak * (block_bytes + draft_block_bytes),
        }

    def enable_sanity_tracking(self) -> None:
        self.target.enable_sanity_tracking()
        self.draft.enable_sanity_tracking()

    def _check_sanity(self) -> bool:
        assert self.target._check_sanity() and self.draft._check_sanity()
        for seq, d in self._draft_of.items():
            assert d.blocks == seq.blocks and d.beams == seq.beams, "draft blocks diverged"
        assert self.draft.gpu.num_in_use == self.target.gpu.num_in_use
        return True


class MirroredWindowedCacheManager(WindowedCacheManager):
    """A windowed cache whose last pools hold the draft model's KV (see the module
    docstring): `cycles` and `specs` are the target's pools, `draft_cycles` (in the draft
    model's layer numbering) and `draft_specs` the draft's."""

    __slots__ = ("num_target_pools", "draft_cycles", "draft", "draft_peak_gpu_blocks",
                 "draft_peak_gpu_bytes", "peak_kv_bytes")

    def __init__(
        self, cycles: Sequence[LifeCycle], specs: Sequence[CacheSpec],
        draft_cycles: Sequence[LifeCycle], draft_specs: Sequence[CacheSpec], *,
        release_out_of_window: str = "keep_cached", swa_scratch_reuse: bool = False,
        bytes_per_token_per_layer: int = 1, draft_bytes_per_token_per_layer: int = 1,
        reserve_tokens: int = 0,
    ) -> None:
        if len(draft_cycles) != len(draft_specs) or not draft_cycles:
            raise ValueError("one CacheSpec per draft life cycle")
        held = held_cycles(draft_cycles, sum(c.num_layers for c in cycles))
        self.num_target_pools = len(cycles)
        self.draft_cycles = tuple(draft_cycles)
        self.draft_peak_gpu_blocks = self.draft_peak_gpu_bytes = self.peak_kv_bytes = 0
        super().__init__([*cycles, *held], [*specs, *draft_specs],
                         release_out_of_window=release_out_of_window,
                         swa_scratch_reuse=swa_scratch_reuse,
                         bytes_per_token_per_layer=bytes_per_token_per_layer,
                         reserve_tokens=reserve_tokens)
        tpb = self.tpb
        self.slot_bytes[len(cycles):] = [tpb * c.num_layers * draft_bytes_per_token_per_layer
                                         for c in draft_cycles]
        self.draft = DraftPools(self)
        """The draft's side: its copy ops and page views."""

    def draft_of(self, wseq: WindowedSequence) -> WindowedSequence:
        """The draft's hold on a request: the same sequence (its last pools)."""
        return wseq

    def draft_memory(self, block_bytes: int, draft_block_bytes: int) -> dict:  # noqa: ARG002
        """As `MirroredCacheManager.draft_memory`, each pool's slots at their own size."""
        return {
            "draft_gpu_blocks_total": sum(m.gpu.capacity for m in self._draft_managers()),
            "draft_peak_gpu_blocks": self.draft_peak_gpu_blocks,
            "draft_peak_gpu_bytes": self.draft_peak_gpu_bytes,
            "peak_kv_bytes": self.peak_kv_bytes,
        }

    # --- what a caller reads is the target's ---------------------------------------------

    @property
    def gpu(self) -> _Pools:
        return _Pools(self._target_managers(), self.peak_gpu_blocks)

    @property
    def gpu_blocks_total(self) -> int:
        return sum(m.gpu.capacity for m in self._target_managers())

    @property
    def host_blocks_total(self) -> int:
        return sum(m.host.capacity if m.host is not None else 0
                   for m in self._target_managers())

    @property
    def gpu_bytes_total(self) -> int:
        return sum(m.gpu.capacity * b for m, b in zip(self._target_managers(), self.slot_bytes))

    def total(self, counter: str) -> int:
        return sum(getattr(m, counter) for m in self._target_managers())

    def pool_metrics(self) -> dict[str, dict]:
        """The target's pools as `WindowedCacheManager.pool_metrics` names them, then the
        draft's, named `draft_full` / `draft_window_W` (W: the draft's attention window)."""
        t = self.num_target_pools
        cycles = [*self.cycles[:t], *self.draft_cycles]
        return {("draft_" if i >= t else "") + pool_name(c): pool_figures(c, m, b)
                for i, (c, m, b) in enumerate(zip(cycles, self.managers, self.slot_bytes))}

    def moved_bytes(self, slot_bytes: int) -> tuple[int, int]:  # noqa: ARG002
        """The target's host traffic (as with one pool per model: the draft's is its own)."""
        pools = list(zip(self._target_managers(), self.slot_bytes))
        return (sum(m.onboard_blocks * b for m, b in pools),
                sum(m.offload_blocks * b for m, b in pools))

    def drain_copy_ops(self) -> dict[int, list[CopyOp]]:
        return _drain(self.managers, range(self.num_target_pools), 0)

    def page_views(self, wseq: WindowedSequence, start: int, end: int) -> list[PageView]:
        return [v for v in super().page_views(wseq, start, end)
                if v.pool < self.num_target_pools]

    def _check_sanity(self) -> bool:
        assert super()._check_sanity()
        assert max(self.peak_gpu_bytes, self.draft_peak_gpu_bytes) <= self.peak_kv_bytes
        assert self.peak_kv_bytes <= self.peak_gpu_bytes + self.draft_peak_gpu_bytes
        return True

    # --- helpers --------------------------------------------------------------------------

    def _target_managers(self) -> list[KVCacheManager]:
        return self.managers[:self.num_target_pools]

    def _draft_managers(self) -> list[KVCacheManager]:
        return self.managers[self.num_target_pools:]

    def _note_peak(self) -> None:
        """Peaks of the target's pools (`peak_gpu_*`), the draft's and both at once."""
        t = self.num_target_pools
        sums = [0, 0, 0, 0]  # target blocks, target bytes, draft blocks, draft bytes
        for i, (m, b) in enumerate(zip(self.managers, self.slot_bytes)):
            n = m.gpu.num_in_use
            k = 2 if i >= t else 0
            sums[k] += n
            sums[k + 1] += n * b
        self.peak_gpu_blocks = max(self.peak_gpu_blocks, sums[0])
        self.peak_gpu_bytes = max(self.peak_gpu_bytes, sums[1])
        self.draft_peak_gpu_blocks = max(self.draft_peak_gpu_blocks, sums[2])
        self.draft_peak_gpu_bytes = max(self.draft_peak_gpu_bytes, sums[3])
        self.peak_kv_bytes = max(self.peak_kv_bytes, sums[1] + sums[3])


def held_cycles(draft_cycles: Sequence[LifeCycle], first_layer: int) -> list[LifeCycle]:
    """The draft's life cycles as a `MirroredWindowedCacheManager` holds them: its layers
    numbered from `first_layer` (after the target's)."""
    return [LifeCycle(c.window, tuple(first_layer + layer for layer in c.layers))
            for c in draft_cycles]


class DraftPools:
    """The draft model's pools of a `MirroredWindowedCacheManager`, as its data plane reads
    them (pool indices counted from the draft's first pool)."""

    __slots__ = ("cache",)

    def __init__(self, cache: MirroredWindowedCacheManager) -> None:
        self.cache = cache

    def drain_copy_ops(self) -> dict[int, list[CopyOp]]:
        c = self.cache
        return _drain(c.managers, range(c.num_target_pools, len(c.managers)),
                      c.num_target_pools)

    def page_views(self, wseq: WindowedSequence, start: int, end: int) -> list[PageView]:
        """One view per draft pool (no beams: speculative decoding runs without them)."""
        c = self.cache
        t = c.num_target_pools
        return [PageView(i - t, 0, start, *c.step_view(wseq, i, start))
                for i in range(t, len(c.managers))]


def _drain(managers: list[KVCacheManager], pools: range, first: int
           ) -> dict[int, list[CopyOp]]:
    """The copy ops of `pools` since the last drain, keyed by pool index less `first`."""
    ops = {}
    for i in pools:
        m = managers[i]
        if m.copy_ops:
            ops[i - first] = list(m.copy_ops)
            m.copy_ops.clear()
    return ops
