"""The one data-plane step builder both loops use: a sequence's work in a step as `StepItem`s,
one per pool and beam the cache manager lays it out in (`CacheManager.page_views`)."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ..cache.protocol import CacheManager
from ..kernels.step import CrossKV, StepItem


def step_items(manager: CacheManager, request_id: int, seq, start: int, end: int,
               tokens_of: Callable[[int], np.ndarray], cross: CrossKV | None = None
               ) -> list[StepItem]:
    """Items computing positions `[start, end)` of `seq`; `tokens_of(beam)` gives a beam's
    token ids. Every item (each pool's, each beam's) also attends to `cross`, the request's
    encoder KV (`engine.cross.cross_step`)."""
    return [StepItem(request_id, tokens_of(v.beam), v.blocks, v.start, end, pool=v.pool,
                     first_block=v.first_block, scratch=v.scratch, cross=cross)
            for v in manager.page_views(seq, start, end)]
