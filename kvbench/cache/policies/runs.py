"""Lazy heaps of key runs, as the shadow caches of `lru2` (its LRU-2 order) and `gdsf` keep
them: a dict of each key's live insertion order, and a heap of `[heap key, orders, keys, next]`
runs (a release's keys of one rank, the first `next` of them gone). A key used again gets a
new live order, so its old entry goes stale in place and is skipped when it surfaces."""

from __future__ import annotations

from heapq import heapify
from itertools import compress
from operator import eq


def compact_runs(runs: list[list], live: dict) -> list[list]:
    """`runs` without their stale and gone keys (heap keys stay), as a heap; a run left with
    none is dropped."""
    get = live.get
    kept = []
    for key, orders, run_keys, k in runs:
        orders, run_keys = orders[k:], run_keys[k:]
        ok = list(map(eq, map(get, run_keys), orders))
        if any(ok):
            kept.append([key, list(compress(orders, ok)), list(compress(run_keys, ok)), 0])
    heapify(kept)
    return kept
