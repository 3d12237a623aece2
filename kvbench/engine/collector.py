"""Garbage collection paced for replays.

A replay keeps hundreds of thousands of container objects alive for a while and frees them at
about the rate it makes them: the prefix index's records (a tuple per stored block, freed when
the block is evicted), the oracle's heap entries, the serve loop's sequences. CPython collects
its young generation whenever allocations outrun deallocations by 700 containers, so such churn
starts a collection every few requests, each walking every young object still alive (and every
tenth walking the middle generation, with full collections of the whole heap among them):
measured, ~5 % of `kvbench run workloads/policies.yaml` and ~9 % of a serve run of the Mooncake
conversation trace, ~2 % of an LRU-2 cache-mode replay.

`fewer_collections` raises the young generation's threshold while a replay runs and restores it
after. Garbage is still collected as before, only later: reference counting frees the replays'
acyclic objects at once, and a cycle waits at most `YOUNG_THRESHOLD` container allocations (a
few MB). A threshold of 0 (collection disabled) or one already higher is left alone.
"""

from __future__ import annotations

import gc
from contextlib import contextmanager

YOUNG_THRESHOLD = 100_000
"""Net new containers between young-generation collections while replaying (CPython: 700).
On the shipped traces the live containers rarely grow by this many, so collections all but
stop. At 20 000 they took as long in all as at 700: fewer passes, each over a young generation
larger than the CPU's caches."""


@contextmanager
def fewer_collections():
    """Within it the young generation is collected after `YOUNG_THRESHOLD` net container
    allocations (restored on exit, also by an exception). Usable as a decorator."""
    young, *older = gc.get_threshold()
    raised = 0 < young < YOUNG_THRESHOLD
    if raised:
        gc.set_threshold(YOUNG_THRESHOLD, *older)
    try:
        yield
    finally:
        if raised:
            gc.set_threshold(young, *older)
