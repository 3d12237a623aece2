"""Offline references for the hit rate of a request stream (cache mode).

- `ideal_hit_rate`: an unlimited cache with the run's reuse rules. Every request stores every
  full block of its prompt, so a block is reusable iff an earlier prompt had the same key; with
  partial reuse, the block where a prompt leaves every earlier one is matched token by token
  against the earlier blocks at that place (same parent, same first token), as the cache does.
- `optimal_hit_rate`: the best any eviction policy could do at the run's capacity: Belady's
  farthest-next-use eviction over full blocks, ties to the deeper block. A block's next use is
  the next request that could reuse it (inside that request's reusable prefix). A child is never
  used before its parent, so the kept set stays prefix-closed and every kept block of a prompt's
  path is a hit: counting hits is classic paging, where farthest-next-use is optimal. With
  partial reuse the oracle adds the ideal's partial tokens for a request whenever it holds the
  whole full-block prefix the ideal matched; it gets those without spending capacity on
  partial blocks, but it is not a proven optimum there (`hit_rate <= optimal_hit_rate` is
  guaranteed with partial reuse off).

The last prompt token is always computed, so a request reuses at most `input_length - 1`.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from .traffic.request import Request

_INF = 1 << 62


@dataclass(frozen=True, slots=True)
class ReferenceHitRates:
    prompt_tokens: int
    ideal_reused_tokens: int
    optimal_reused_tokens: int | None

    @property
    def ideal_hit_rate(self) -> float:
        return self.ideal_reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def optimal_hit_rate(self) -> float | None:
        if self.optimal_reused_tokens is None:
            return None
        return self.optimal_reused_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def reference_hit_rates(
    requests: Sequence[Request], tokens_per_block: int, capacity_blocks: int | None,
    *, partial_reuse: bool, block_reuse: bool = True,
) -> ReferenceHitRates:
    """Ideal and (when `capacity_blocks` is given) optimal reuse of `requests` in order."""
    tpb = tokens_per_block
    prompt_tokens = sum(r.input_length for r in requests)
    if not block_reuse or not requests:
        return ReferenceHitRates(prompt_tokens, 0, 0 if capacity_blocks is not None else None)
    keys_of = [r.block_keys(tpb) for r in requests]
    caps = [(r.input_length - 1) // tpb for r in requests]
    occ = _Occurrences(keys_of, caps)
    ideal_full = occ.ideal_full_blocks()
    partial = (
        _ideal_partial(requests, keys_of, caps, ideal_full, tpb) if partial_reuse
        else [0] * len(requests)
    )
    ideal = sum(int(f) * tpb + p for f, p in zip(ideal_full, partial))
    optimal = None
    if capacity_blocks is not None:
        optimal = _belady(requests, keys_of, caps, occ.next_use_per_request(), ideal_full,
                          partial, tpb, capacity_blocks)
    return ReferenceHitRates(prompt_tokens, ideal, optimal)


class _Occurrences:
    """All (request, position, key) of full prompt blocks as flat arrays, in request order."""

    def __init__(self, keys_of: list[list[int]], caps: list[int]) -> None:
        lengths = np.fromiter((len(k) for k in keys_of), dtype=np.int64, count=len(keys_of))
        self.starts = np.concatenate(([0], np.cumsum(lengths)))
        total = int(self.starts[-1])
        self.req = np.repeat(np.arange(len(keys_of), dtype=np.int64), lengths)
        self.pos = np.arange(total, dtype=np.int64) - self.starts[:-1][self.req]
        self.hittable = self.pos < np.asarray(caps, dtype=np.int64)[self.req]
        flat = [k for keys in keys_of for k in keys]
        keys = np.array(flat, dtype=np.int64) if flat else np.zeros(0, dtype=np.int64)
        # Group equal keys, in request order inside a group.
        self.order = np.lexsort((self.req, keys))
        sk = keys[self.order]
        self.group_start = np.ones(total, dtype=bool)
        self.group_start[1:] = sk[1:] != sk[:-1]
        self.total = total
        self.num_requests = len(keys_of)

    def ideal_full_blocks(self) -> np.ndarray:
        """Per request: leading full blocks whose key an earlier request stored."""
        gid = np.cumsum(self.group_start) - 1
        first_req = self.req[self.order][self.group_start][gid]
        seen = np.empty(self.total, dtype=bool)
        seen[self.order] = first_req < self.req[self.order]
        ok = seen & self.hittable
        # Leading run of `ok` inside each request's segment.
        bad_before = np.cumsum(~ok) - (~ok)
        seg_base = bad_before[np.minimum(self.starts[:-1], max(self.total - 1, 0))]
        lead = ok & (bad_before == seg_base[self.req])
        return np.bincount(self.req[lead], minlength=self.num_requests)

    def next_use_per_request(self) -> list[list[int]]:
        """Per request and block: the next request that could reuse the block, or _INF."""
        o = self.order
        n = self.total
        idx = np.arange(n, dtype=np.int64)
        hit_idx = np.where(self.hittable[o], idx, n)
        # The nearest hittable occurrence after each one (a suffix minimum of indices) is the
        # next use when it lies inside the same group of equal keys.
        later = np.full(n + 1, n, dtype=np.int64)
        later[:n] = np.minimum.accumulate(hit_idx[::-1])[::-1]
        nearest = later[1:]
        group_end = np.empty(n, dtype=np.int64)
        starts = np.flatnonzero(self.group_start)
        ends = np.append(starts[1:], n)
        group_end[:] = np.repeat(ends, ends - starts)
        sorted_req = self.req[o]
        in_group = nearest < group_end
        nxt_sorted = np.where(in_group, sorted_req[np.minimum(nearest, max(n - 1, 0))], _INF)
        nxt = np.empty(n, dtype=np.int64)
        nxt[o] = nxt_sorted
        flat = nxt.tolist()
        s = self.starts.tolist()
        return [flat[s[i]:s[i + 1]] for i in range(self.num_requests)]


def _ideal_partial(
    requests: Sequence[Request], keys_of: list[list[int]], caps: list[int],
    ideal_full: np.ndarray, tpb: int,
) -> list[int]:
    """Per request: tokens the ideal reuses from a partial match where it leaves every earlier
    prompt. Candidates are the earlier blocks at that place: under the same parent key with the
    same first token (new full blocks and every prompt's unfilled last block)."""
    by_slot: dict[tuple[int, int], list[tuple[Request, int, int]]] = {}
    seen: set[int] = set()
    out = []
    for r, keys, cap, m in zip(requests, keys_of, caps, ideal_full.tolist()):
        firsts = r.first_tokens(tpb)
        got = 0
        limit = min(tpb, r.input_length - 1 - m * tpb)
        if m <= cap and limit > 0:
            parent = keys[m - 1] if m else r.root_key
            cands = by_slot.get((parent, firsts[m]))
            if cands:
                ours = r.prompt_tokens(m * tpb, m * tpb + limit)
                for src, pos, n in cands:
                    n = min(n, limit)
                    theirs = src.prompt_tokens(pos * tpb, pos * tpb + n)
                    diff = np.flatnonzero(ours[:n] != theirs)
                    got = max(got, int(diff[0]) if len(diff) else n)
                    if got == limit:
                        break
        out.append(got)
        parent = r.root_key
        for i, k in enumerate(keys):
            if k not in seen:
                seen.add(k)
                by_slot.setdefault((parent, firsts[i]), []).append((r, i, tpb))
            parent = k
        tail = r.input_length % tpb
        if tail:
            i = len(keys)
            by_slot.setdefault((parent, firsts[i]), []).append((r, i, tail))
    return out


def _belady(
    requests: Sequence[Request], keys_of: list[list[int]], caps: list[int],
    next_use: list[list[int]], ideal_full: np.ndarray, partial: list[int], tpb: int,
    capacity: int,
) -> int:
    """Replay with farthest-next-use eviction; returns reused tokens.

    A request's own resident blocks have next use == this request, the nearest possible, so
    they are the last candidates and never chosen while the request fits in the cache. Heap
    entries are lazy: one is current only if its block is still resident with that next use.
    Blocks never used again wait on a stack and go before all others."""
    resident: dict[int, int] = {}  # key -> next use
    never: list[int] = []
    heap: list[tuple[int, int, int]] = []  # (-next use, -depth, key)
    heappush, heappop = heapq.heappush, heapq.heappop
    reused = 0
    for i, (r, keys, cap, nxt, m, p) in enumerate(
        zip(requests, keys_of, caps, next_use, ideal_full.tolist(), partial)
    ):
        held = 0
        for k in keys:
            if k not in resident:
                break
            held += 1
        h = min(held, cap)
        reused += h * tpb + (p if h == m else 0)
        excess = len(resident) + (-(-r.input_length // tpb) - held) - capacity
        while excess > 0:
            if never:
                k = never.pop()
                if resident.get(k) != _INF:
                    continue
            else:
                nu, _, k = heappop(heap)
                if resident.get(k) != -nu:
                    continue
                assert -nu != i, "a request larger than the cache reached the oracle"
            del resident[k]
            excess -= 1
        for j, k in enumerate(keys):
            u = nxt[j]
            resident[k] = u
            if u == _INF:
                never.append(k)
            else:
                heappush(heap, (-u, -j, k))
    return reused
