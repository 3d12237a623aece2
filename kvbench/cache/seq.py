"""A request's hold on the cache (`CacheSeq`), the NO_BLOCK placeholder for a position without
a block, and the block arithmetic of beams (`shared_blocks`, `grow_blocks`).

Beam search (TensorRT-LLM's rule): a sequence of a request with `beam_width` w > 1 shares its
context's full blocks among the beams; the last context block is shared only when it is full
(`input_length % tokens_per_block == 0`, or always for cross-attention KV, `CacheSpec.cross_kv`),
otherwise every beam gets its own copy; every block past the context is per beam. `blocks` is
beam 0's page table (the one stored for reuse: beam 0 generates the request's stream); beams
1..w-1 hold their own blocks of the positions from `shared_blocks` on in `beams`, never stored.
Reuse matches only the shared blocks (an unshared last block is computed by each beam).
`resize` allocates for every beam, so peak memory, the scheduler's block estimate
(`grow_blocks`) and preemption all see them; `release_blocks` (a sliding window) releases
every beam's blocks of the positions it is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from .ids import BlockId, BlockKey

if TYPE_CHECKING:
    from ..traffic.request import Request


NO_BLOCK = BlockId(-1)
"""Placeholder in `CacheSeq.blocks` for a position that holds no block of this life cycle: a
sliding window no longer (or never) needs it, or it is a scratch block (`windows.py`). It keeps
the positions of the other blocks aligned with the sequence's tokens."""


def shared_blocks(tokens_per_block: int, request: Request, cross_kv: bool = False) -> int:
    """Leading block positions the beams of a sequence of `request` share: the context's full
    blocks, and its last one too only when full or for cross-attention KV (TensorRT-LLM's
    `isShareLastContextBlock`)."""
    if cross_kv:
        return -(-request.input_length // tokens_per_block)
    return request.input_length // tokens_per_block


def grow_blocks(tokens_per_block: int, request: Request, have: int, num_tokens: int,
                cross_kv: bool = False) -> int:
    """Blocks a sequence of `request` holding `have` block positions takes to hold
    `num_tokens` tokens: one per new position, and one more per extra beam for each new
    position past the shared context."""
    positions = -(-num_tokens // tokens_per_block)
    if positions <= have:
        return 0
    own = 0
    if request.beam_width > 1:
        own = (request.beam_width - 1) * max(
            0, positions - max(have, shared_blocks(tokens_per_block, request, cross_kv)))
    return positions - have + own


class CacheSeq:
    """One request's hold on the cache."""

    __slots__ = (
        "request", "keys", "blocks", "num_tokens", "num_computed", "num_stored",
        "reused_tokens", "reused_full_blocks", "reused_tokens_host", "partial_tokens",
        "partial_copied", "_partial", "holes", "beam_width", "shared_blocks", "beams",
    )

    def __init__(self, request: Request, keys: list[BlockKey],
                 beam_width: int | None = None) -> None:
        self.request = request
        self.keys = keys
        """Keys of the full blocks whose tokens are known (the prompt's, at first)."""
        self.blocks: list[BlockId] = []
        self.num_tokens = 0
        """Tokens the allocated blocks must hold."""
        self.num_computed = 0
        """Tokens whose KV is in the blocks (reused or computed)."""
        self.num_stored = 0
        """Leading blocks already in the prefix index."""
        self.reused_tokens = 0
        self.reused_full_blocks = 0
        self.reused_tokens_host = 0
        """Reused tokens that came from the host tier (onboarded)."""
        self.partial_tokens = 0
        self.partial_copied = False
        self._partial: tuple[BlockId, int] | None = None
        """A claimed, partially matched block waiting for phase 2."""
        self.holes = False
        """Some entry of `blocks` is NO_BLOCK (only sliding-window life cycles make them)."""
        self.beam_width = request.beam_width if beam_width is None else beam_width
        self.shared_blocks = 0
        """Leading block positions all beams share (see the module docstring)."""
        self.beams: list[list[BlockId]] = [[] for _ in range(self.beam_width - 1)]
        """Beams 1..w-1: each one's own blocks of positions `shared_blocks` on."""

    @property
    def num_blocks(self) -> int:
        """Blocks the sequence holds or will hold for its positions, every beam's included."""
        return len(self.blocks) + sum(len(b) for b in self.beams)

    def beam_blocks(self, beam: int) -> list[BlockId]:
        """The page table of `beam` (0 = `blocks`)."""
        if beam == 0:
            return self.blocks
        return self.blocks[:self.shared_blocks] + self.beams[beam - 1]
