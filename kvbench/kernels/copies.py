"""Executes the cache's copy ops (onboard, offload, partial copy) on the paged tensors.

Ops run in emission order semantics but batched: the step's ops are cut into waves at the
first op that reads or writes a block an earlier op of the wave writes or reads (an onboard
that empties a host block the next offload refills, say), and each wave runs one batched
gather/scatter per tier pair. Waves are almost always the whole step.

Whole slots are copied, partial copies included: a partial copy's tokens past `num_tokens`
land in positions the new owner computes before anything reads them, and one contiguous
move per block is what makes the batch a single call.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import numpy as np
import torch

from ..cache.ids import CopyKind, CopyOp, Tier
from .staging import to_device
from .storage import PoolTensors

_VERB = {CopyKind.ONBOARD: "onboarded", CopyKind.OFFLOAD: "offloaded",
         CopyKind.PARTIAL: "partially copied"}


class CopyExecutor:
    """Runs copy ops for every pool and remembers, per GPU block, the copy that last filled it
    (the verifier names it when that block turns out wrong)."""

    __slots__ = ("pools", "device", "origin")

    def __init__(self, pools: Sequence[PoolTensors], device: torch.device) -> None:
        self.pools = pools
        self.device = device
        self.origin: list[dict[int, str]] = [{} for _ in pools]

    def check(self, pool: int, ops: Sequence[CopyOp]) -> None:
        """Raise ValueError for an op naming a block outside the pool (a caller bug)."""
        tensors = self.pools[pool]
        for op in ops:
            self._row(tensors, op.src_tier, op.src)
            self._row(tensors, op.dst_tier, op.dst)

    def run(self, pool: int, ops: Sequence[CopyOp], step: int) -> int:
        """Execute `ops` of `pool` (checked with `check`) on the current stream; returns the
        number of blocks moved."""
        tensors = self.pools[pool]
        for wave in _waves(ops):
            groups: dict[tuple[Tier, Tier], list[CopyOp]] = {}
            for op in wave:
                groups.setdefault((op.src_tier, op.dst_tier), []).append(op)
            for (src_tier, dst_tier), group in groups.items():
                self._move(tensors, src_tier, dst_tier, group)
        origin = self.origin[pool]
        for op in ops:
            if op.dst_tier == Tier.GPU:
                detail = f" ({op.num_tokens} tokens)" if op.kind == CopyKind.PARTIAL else ""
                origin[op.dst] = (f"{_VERB[op.kind]}{detail} from {op.src_tier.name} block "
                                  f"{op.src} at step {step}")
        return len(ops)

    def _row(self, tensors: PoolTensors, tier: Tier, block: int) -> int:
        spec = tensors.spec
        if tier == Tier.GPU:
            row, size = block, spec.num_gpu_slots
        else:
            row, size = block - spec.first_host_id, spec.num_host_slots
        if not 0 <= row < size:
            raise ValueError(f"copy op names {tier.name} block {block}, outside the pool")
        return row

    def _move(self, tensors: PoolTensors, src_tier: Tier, dst_tier: Tier,
              ops: list[CopyOp]) -> None:
        src_rows = tensors.slot_rows(src_tier == Tier.HOST)
        dst_rows = tensors.slot_rows(dst_tier == Tier.HOST)
        src = [self._row(tensors, src_tier, op.src) for op in ops]
        dst = [self._row(tensors, dst_tier, op.dst) for op in ops]
        if src_rows.device == dst_rows.device:
            # The rows go up through the pinned ring: a tensor made from a list on the GPU
            # is a pageable copy, which would make the host wait for the GPU.
            src_t, dst_t = to_device([np.asarray(src), np.asarray(dst)], src_rows.device)
            dst_rows.index_copy_(0, dst_t, src_rows.index_select(0, src_t))
            return
        # Host <-> CUDA: torch has no GPU gather that reads pinned host memory, and gathering
        # on the CPU first would add a second pass over the bytes at memcpy speed, so each run
        # of consecutive slots is one async copy-engine transfer.
        for s, d, n in _runs(src, dst):
            dst_rows[d:d + n].copy_(src_rows[s:s + n], non_blocking=True)


def _waves(ops: Sequence[CopyOp]) -> Iterator[list[CopyOp]]:
    wave: list[CopyOp] = []
    reads: set[tuple[Tier, int]] = set()
    writes: set[tuple[Tier, int]] = set()
    for op in ops:
        s, d = (op.src_tier, op.src), (op.dst_tier, op.dst)
        if s in writes or d in writes or d in reads:
            yield wave
            wave, reads, writes = [], set(), set()
        wave.append(op)
        reads.add(s)
        writes.add(d)
    if wave:
        yield wave


def _runs(src: list[int], dst: list[int]) -> Iterator[tuple[int, int, int]]:
    """(src start, dst start, length) of maximal runs where both sides advance by one."""
    pairs = sorted(zip(src, dst))
    i = 0
    while i < len(pairs):
        s0, d0 = pairs[i]
        n = 1
        while i + n < len(pairs) and pairs[i + n] == (s0 + n, d0 + n):
            n += 1
        yield s0, d0, n
        i += n
