"""Where a windowed sequence's KV lives for the data plane: per model layer the page of each
block (`page_tables`), and per pool and beam the view a step reads and writes (`step_view`,
the contract's `page_views`).

Page tables (`page_tables`) follow the data plane's layout: one tensor of `slots x layers`
pages per pool, so block `b` of the pool's `i`-th layer is page `b * num_layers + i`; a scratch
block is the one page `slot * num_layers + slice` in every layer.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .ids import BlockId
from .protocol import PageView
from .seq import NO_BLOCK

if TYPE_CHECKING:
    from .windows import WindowedSequence


class WindowPages:
    """The page calls, mixed into `WindowedCacheManager`: they read its life cycles, pools and
    a sequence's blocks and scratch pages."""

    __slots__ = ()

    def page_tables(self, wseq: WindowedSequence, beam: int = 0) -> np.ndarray:
        """`[model layer, block index]` -> page in that layer's pool tensor (the pool is
        `pool_of_layer[layer]`) for beam `beam`, -1 where the block has no page (out of
        window, never claimed). Block `b` of a pool's `i`-th layer is page
        `b * num_layers + i`; a scratch block has its slot's slice, the same page in every
        layer."""
        n = -(-wseq.num_tokens // self.tpb)
        out = np.full((self.num_layers, n), -1, dtype=np.int64)
        for i, c in enumerate(self.cycles):
            blocks = np.asarray(wseq.seqs[i].beam_blocks(beam)[:n], dtype=np.int64)
            real = blocks != NO_BLOCK
            cols = np.flatnonzero(real)
            nl = c.num_layers
            for local, layer in enumerate(c.layers):
                out[layer, cols] = blocks[real] * nl + local
            pages = wseq.scratch_pages[i]
            if pages:
                idx = np.fromiter(pages.keys(), np.int64, len(pages))
                pg = np.fromiter(pages.values(), np.int64, len(pages))
                out[np.array(c.layers)[:, None], idx[None, :]] = pg[None, :]
        return out

    def step_view(self, wseq: WindowedSequence, pool: int, start: int, beam: int = 0
                  ) -> tuple[int, list[BlockId], dict[int, int] | None]:
        """What the data plane's `StepItem` needs for pool `pool` in a step computing from
        `start` in beam `beam`: the first block its queries read, the beam's blocks from
        there (NO_BLOCK where a scratch page serves), and the scratch pages by block index."""
        first = self.cycles[pool].first_needed(start, self.tpb)
        return (first, wseq.seqs[pool].beam_blocks(beam)[first:],
                wseq.scratch_pages[pool])

    def page_views(self, wseq: WindowedSequence, start: int, end: int) -> list[PageView]:
        own = max(start, wseq.shared_blocks * self.tpb)
        beams = range(1, wseq.beam_width) if own < end else range(0)
        views = []
        for pool in range(len(self.managers)):
            views.append(PageView(pool, 0, start, *self.step_view(wseq, pool, start)))
            views += [PageView(pool, beam, own, *self.step_view(wseq, pool, own, beam))
                      for beam in beams]
        return views
