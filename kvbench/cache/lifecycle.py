"""Attention life cycles and how the GPU budget is split between their pools: which layers
share a window (`LifeCycle`, `life_cycles`), each pool's share of the bytes
(`split_gpu_blocks`) and the blocks one request needs to prefill alone
(`prefill_blocks_bound`). Window convention as in `windows.py`."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


SPLIT_POLICIES = ("window", "layers")
"""How `split_gpu_blocks` divides GPU memory between life cycles: `window` (default, as
TensorRT-LLM) in proportion to bytes per token x min(window, context) x layers, i.e. to the KV
a typical request keeps in each; `layers` in proportion to bytes per token x layers, as if
every layer kept its whole context (what a cache that ignores windows would give them)."""


@dataclass(frozen=True, slots=True)
class LifeCycle:
    """Layers that share an attention span, and so a block pool."""

    window: int | None
    """Sliding window W in tokens (a query sees the W most recent, itself included);
    None = full attention."""
    layers: tuple[int, ...]
    """Model layer indices, ascending."""

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def first_needed(self, position: int, tokens_per_block: int) -> int:
        """The first block a query at `position` reads (0 for full attention)."""
        if self.window is None:
            return 0
        return max(0, position - self.window + 1) // tokens_per_block


def life_cycles(layer_windows: Sequence[int | None]) -> tuple[LifeCycle, ...]:
    """One life cycle per distinct window of `layer_windows` (one entry per model layer, as
    `ModelConfig.layer_windows`): full attention first, then windows ascending."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(layer_windows):
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: (w is not None, w or 0))
    return tuple(LifeCycle(w, tuple(by_window[w])) for w in order)


def split_gpu_blocks(
    cycles: Sequence[LifeCycle], budget_bytes: int, slot_bytes: Sequence[int],
    context_tokens: int, *,
    policy: str = "window", min_blocks: Sequence[int] | None = None,
    layer_bytes: Sequence[int] | None = None,
) -> list[int]:
    """GPU blocks per life cycle for a byte budget. Each pool gets a share of the budget in
    proportion to its weight (`SPLIT_POLICIES`; `context_tokens` is the typical context a
    window is compared with), except that no pool gets fewer than its `min_blocks` (what one
    request needs to run at all): such pools are raised to their floor and the rest of the
    budget is shared among the others in the same proportions. `layer_bytes`: each life
    cycle's bytes per token and layer, where they differ (a draft model's pools beside the
    target's); weights are then bytes, not layers. Raises ValueError when the floors alone
    exceed the budget."""
    if policy not in SPLIT_POLICIES:
        raise ValueError(f"unknown split policy {policy!r}; expected one of {SPLIT_POLICIES}")
    n = len(cycles)
    floors = list(min_blocks) if min_blocks is not None else [1] * n
    need = sum(f * b for f, b in zip(floors, slot_bytes))
    if need > budget_bytes:
        raise ValueError(f"the pools need {need} bytes at least, the budget is {budget_bytes}")
    # Without `layer_bytes` every layer's bytes per token are the same, so they cancel out.
    context = max(context_tokens, 1)
    if policy == "window":
        weights = [c.num_layers * (context if c.window is None else min(c.window, context))
                   for c in cycles]
    else:
        weights = [c.num_layers for c in cycles]
    if layer_bytes is not None:
        weights = [w * b for w, b in zip(weights, layer_bytes)]
    fixed: dict[int, int] = {}
    while True:
        left = budget_bytes - sum(fixed[i] * slot_bytes[i] for i in fixed)
        total = sum(weights[i] for i in range(n) if i not in fixed)
        short = [i for i in range(n) if i not in fixed
                 and left * weights[i] / total < floors[i] * slot_bytes[i]]
        if not short:
            break
        for i in short:
            fixed[i] = floors[i]
    return [fixed[i] if i in fixed else int(left * weights[i] / total) // slot_bytes[i]
            for i in range(n)]


def prefill_blocks_bound(cycle: LifeCycle, tokens_per_block: int, num_tokens: int,
                         scratch: bool, beam_width: int = 1) -> int:
    """The most blocks of `cycle` one request holds while a single step computes its
    `num_tokens`-token prompt, whatever it reuses: every block without scratch; with scratch,
    the reused blocks its first query reads, the new in-window blocks and the scratch slots
    of the rest (never more than one per block); with beams, each extra beam's copy of an
    unfilled last block too."""
    tpb = tokens_per_block
    blocks = -(-num_tokens // tpb)
    own = (beam_width - 1) * (blocks - num_tokens // tpb)
    if not scratch or cycle.window is None:
        return blocks + own
    # With beams, scratch stops at the shared context (`WindowedCacheManager._scratch_query`).
    query = num_tokens if beam_width == 1 else num_tokens // tpb * tpb
    out_of_window = cycle.first_needed(query, tpb)
    reused_window = -(-(cycle.window - 1) // tpb) + 1
    return own + min(blocks, reused_window + (blocks - out_of_window)
                     + -(-out_of_window // cycle.num_layers))
