"""Offline references for the hit rate of a request stream (cache mode).

- `ideal_hit_rate`: an unlimited cache with the run's reuse rules. Every request stores every
  full block of its prompt, so a block is reusable iff an earlier prompt had the same key; with
  partial reuse, the block where a prompt leaves every earlier one is matched token by token
  against the earlier blocks at that place (same parent, same first token), as the cache does.
- `optimal_hit_rate`: the best any eviction policy could do at the run's capacity: Belady's
  farthest-next-use eviction over full blocks, ties to the deeper block. A block's next use is
  the next request that could reuse it (inside that request's reusable prefix), unless a
  request computes its key before that in any case (past its own reusable prefix: the block
  holding its last token): that one stores the block again, so keeping it until then is worth
  nothing and it goes first (its cached descendants, orphaned meanwhile, are reachable again
  once it is stored, as in the cache). A child is never used before its parent, so at each
  request the kept set holds the whole prefix of every kept block the request could reuse, and
  every kept block of a prompt's path is a hit: counting hits is paging in which some
  references cannot hit, where evicting a block whose next reference is one of those, then the
  farthest next use, is optimal (an exchange argument, as for Belady's). With
  partial reuse the oracle adds the ideal's partial tokens for a request whenever it holds the
  whole full-block prefix the ideal matched; it gets those without spending capacity on
  partial blocks, but it is not a proven optimum there (`hit_rate <= optimal_hit_rate` is
  guaranteed with partial reuse off).

The last prompt token is always computed, so a request reuses at most `input_length - 1`.
"""

from __future__ import annotations

import heapq
import tempfile
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np

from .traffic.request import _END_BITS, Request

NO_USE = -1
"""Next occurrence of a block's key: none (`_Occurrences.next_use_per_request` leaves such
blocks out; the streamed references' next-use file holds it)."""
RECOMPUTED = -2
"""Next occurrence of a block's key: in a request that computes the block in any case."""
_DEPTH_BITS = 32
_DEPTH_MASK = (1 << _DEPTH_BITS) - 1


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
        _ideal_partial(requests, occ, ideal_full, tpb) if partial_reuse
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
        self.keys = keys
        # Group equal keys, in request order inside a group.
        self.order = np.lexsort((self.req, keys))
        sk = keys[self.order]
        self.group_start = np.ones(total, dtype=bool)
        self.group_start[1:] = sk[1:] != sk[:-1]
        self.total = total
        self.num_requests = len(keys_of)

    def ideal_full_blocks(self) -> np.ndarray:
        """Per request: leading full blocks whose key an earlier request stored."""
        if not self.total:  # no prompt fills a block
            return np.zeros(self.num_requests, dtype=np.int64)
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

    def next_use_per_request(self) -> list[tuple[list[int], list[int]]]:
        """Per request: the positions of its full blocks whose key a later request holds and,
        for each, where it occurs next: that request when it could reuse the block (inside its
        hittable prefix), `RECOMPUTED` when it computes the block in any case (past it). The
        other blocks (`NO_USE`) are left out: most blocks of a trace, and all they need is a
        count."""
        if not self.total:
            return [([], []) for _ in range(self.num_requests)]
        o = self.order
        # Equal keys are grouped in request order: the next occurrence is the next entry.
        nxt_sorted = np.full(self.total, NO_USE, dtype=np.int64)
        nxt_sorted[:-1] = np.where(
            self.group_start[1:], NO_USE,
            np.where(self.hittable[o][1:], self.req[o][1:], RECOMPUTED))
        nxt = np.empty(self.total, dtype=np.int64)
        nxt[o] = nxt_sorted
        later = nxt != NO_USE
        pos = self.pos[later].tolist()
        use = nxt[later].tolist()
        cut = np.concatenate(([0], np.cumsum(np.bincount(
            self.req[later], minlength=self.num_requests)))).tolist()
        return [(pos[cut[i]:cut[i + 1]], use[cut[i]:cut[i + 1]])
                for i in range(self.num_requests)]


def _ideal_partial(
    requests: Sequence[Request], occ: _Occurrences, ideal_full: np.ndarray, tpb: int
) -> list[int]:
    """Per request: tokens the ideal reuses from a partial match where it leaves every earlier
    prompt. Candidates are the blocks earlier requests stored at that place: the same parent
    key and the same first token (full blocks and every prompt's unfilled last block).

    Only the one divergence block per request is compared token by token; finding its
    candidates among millions of stored blocks is a sort and a binary search."""
    n = len(requests)
    m_of = ideal_full.tolist()
    limits = [min(tpb, r.input_length - 1 - m * tpb) for r, m in zip(requests, m_of)]
    if not any(lim > 0 for lim in limits):
        return [0] * n
    # Every stored block: (parent key, first token, request, position, tokens held).
    first = np.concatenate([r.first_tokens_array(tpb) for r in requests])
    counts = np.fromiter((-(-r.input_length // tpb) for r in requests), dtype=np.int64, count=n)
    starts = np.concatenate(([0], np.cumsum(counts)))
    total = int(starts[-1])
    req = np.repeat(np.arange(n, dtype=np.int64), counts)
    pos = np.arange(total, dtype=np.int64) - starts[:-1][req]
    # The parent of block p is full block p - 1 of the same prompt, or the root.
    roots = np.fromiter((r.root_key for r in requests), dtype=np.int64, count=n)
    prev = occ.starts[:-1][req] + pos - 1
    parent = np.where(pos == 0, roots[req], occ.keys[np.clip(prev, 0, max(occ.total - 1, 0))]
                      if occ.total else roots[req])
    slot = _mix(parent, first)
    order = np.lexsort((req, slot))
    sorted_slot = slot[order]
    # The query of each request: the block where the ideal's full match stops.
    q_idx = starts[:-1] + np.minimum(np.asarray(m_of, dtype=np.int64), np.maximum(counts - 1, 0))
    q_slot = slot[q_idx]
    lo = np.searchsorted(sorted_slot, q_slot, "left").tolist()
    hi = np.searchsorted(sorted_slot, q_slot, "right").tolist()
    order_l, req_l, pos_l = order.tolist(), req.tolist(), pos.tolist()
    out = [0] * n
    for q in range(n):
        limit = limits[q]
        if limit <= 0 or hi[q] - lo[q] < 1:
            continue
        r, m, qi = requests[q], m_of[q], int(q_idx[q])
        ours = r.prompt_tokens(m * tpb, m * tpb + limit)
        best = 0
        for c in order_l[lo[q]:hi[q]]:
            cr = req_l[c]
            if cr >= q:
                break  # sorted by request inside a slot
            if parent[c] != parent[qi] or first[c] != first[qi]:
                continue  # a collision of the mixed slot value
            src = requests[cr]
            start = pos_l[c] * tpb
            theirs = src.prompt_tokens(start, start + limit)
            k = min(len(theirs), limit)
            diff = np.flatnonzero(ours[:k] != theirs[:k])
            best = max(best, int(diff[0]) if len(diff) else k)
            if best == limit:
                break
        out[q] = best
    return out


def _mix(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """One int64 per (parent, first token) pair; collisions are checked by the caller."""
    with np.errstate(over="ignore"):
        return a * np.int64(-7046029254386353131) + b * np.int64(0x5851F42D4C957F2D)


def _belady(
    requests: Sequence[Request], keys_of: list[list[int]], caps: list[int],
    next_use: list[tuple[list[int], list[int]]], ideal_full: np.ndarray, partial: list[int],
    tpb: int, capacity: int,
) -> int:
    """Replay with farthest-next-use eviction (`_Belady`); returns reused tokens."""
    belady = _Belady(capacity, tpb)
    for i, (r, keys, cap, (pos, uses), m, p) in enumerate(
        zip(requests, keys_of, caps, next_use, ideal_full.tolist(), partial)
    ):
        belady.request(i, keys, cap, -(-r.input_length // tpb), pos, uses, m, p)
    return belady.reused


def streamed_reference_hit_rates(
    trace, tokens_per_block: int, capacity_blocks: int | None, *, partial_reuse: bool,
    block_reuse: bool = True,
) -> ReferenceHitRates:
    """`reference_hit_rates` of a `kvbench.traffic.spill.SpilledTrace`, with memory that does
    not grow with the number of requests beyond two tables indexed by hash id: an int32 per id
    (the longest earlier prompt holding it, for the ideal) and, for the optimal, an int32 per
    (id, block of the run inside it) (its nearest later use, in a backward pass). The next use
    of every full block is written to a temporary file in that backward pass and read back in
    order by the forward replay; the farthest-next-use heap is compacted to the blocks resident.

    Trace prompts share whole trace blocks and their ids are prefix-chained, so a prompt's
    longest prefix shared with any earlier one follows from the longest earlier prompt holding
    each id: the ideal's full blocks are that prefix in whole run blocks (at most
    (L - 1) // tpb) and, with partial reuse, the ideal reuses the prefix itself (at most L - 1),
    as `_ideal_partial` finds token by token. The results equal `reference_hit_rates`."""
    tpb = tokens_per_block
    prompt_tokens = trace.prompt_tokens
    if not block_reuse or not len(trace):
        return ReferenceHitRates(prompt_tokens, 0, 0 if capacity_blocks is not None else None)
    with tempfile.TemporaryDirectory(prefix="kvbench-nextuse-") as folder:
        next_path = Path(folder) / "next_use.bin"
        if capacity_blocks is not None:
            _backward_next_uses(trace, tpb, next_path)
        ideal, optimal = _forward_references(
            trace, tpb, capacity_blocks, partial_reuse, next_path)
    return ReferenceHitRates(prompt_tokens, ideal, optimal)


def _run_keys(ids: np.ndarray, length: int, tpb: int, block: int) -> tuple[np.ndarray, np.ndarray]:
    """(trace id, end) of every full run block of a trace prompt: the id of the trace block
    holding the run block's last token, and the run block's end (`Request.block_keys`)."""
    ends = np.arange(tpb, length + 1, tpb, dtype=np.int64)
    return ids[(ends - 1) // block], ends


def _backward_next_uses(trace, tpb: int, path: Path) -> None:
    """For every full block of every prompt, in order, where its key occurs next
    (`_Occurrences.next_use_per_request`); int32 in `path`. Last request first, with the next
    occurrence of every (id, block inside it) in one int32 table."""
    block = trace.block_tokens
    per_id = -(-block // tpb)
    table = np.full((trace.max_id + 1) * per_id, NO_USE, dtype=np.int32)
    lengths = np.frombuffer(trace.input_lengths, dtype=np.int32).astype(np.int64)
    full = lengths // tpb
    starts = np.concatenate(([0], np.cumsum(full)))
    pending: list[np.ndarray] = []
    pending_n = 0
    i = len(trace)
    with open(path, "wb") as f:
        f.truncate(int(starts[-1]) * 4)
        for ids in trace.ids_backward():
            i -= 1
            length = int(lengths[i])
            tid, ends = _run_keys(ids, length, tpb, block)
            slot = tid * per_id + ((ends - 1) % block) // tpb
            pending.append(table[slot])
            pending_n += len(slot)
            cap = (length - 1) // tpb
            table[slot[:cap]] = i
            table[slot[cap:]] = RECOMPUTED
            if pending_n >= _NEXT_USE_CHUNK or i == 0:
                f.seek(int(starts[i]) * 4)
                np.concatenate(pending[::-1]).tofile(f)
                pending, pending_n = [], 0


_NEXT_USE_CHUNK = 1 << 20


def _forward_references(trace, tpb: int, capacity: int | None, partial_reuse: bool,
                        next_path: Path) -> tuple[int, int | None]:
    """Ideal and optimal reused tokens in one pass in request order (see `_Belady`)."""
    block = trace.block_tokens
    longest = np.zeros(trace.max_id + 1, dtype=np.int32)
    lengths = trace.input_lengths
    ideal = 0
    belady = _Belady(capacity, tpb) if capacity is not None else None
    uses = _Int32Reader(next_path) if capacity is not None else None
    for i, ids in enumerate(trace.ids_forward()):
        length = lengths[i]
        seen = longest[ids]
        unseen = np.flatnonzero(seen == 0)
        nb = int(unseen[0]) if len(unseen) else len(ids)
        shared = min(int(seen[nb - 1]), length, nb * block) if nb else 0
        np.maximum(seen, length, out=seen)
        longest[ids] = seen
        reach = min(shared, length - 1)
        m = reach // tpb
        p = reach - m * tpb if partial_reuse else 0
        ideal += m * tpb + p
        if belady is not None:
            tid, ends = _run_keys(ids, length, tpb, block)
            keys = ((tid << _END_BITS) | ends).tolist()
            nxt = uses.take(len(keys))
            later = np.flatnonzero(nxt != NO_USE)
            belady.request(i, keys, (length - 1) // tpb, -(-length // tpb), later.tolist(),
                           nxt[later].tolist(), m, p)
    if uses is not None:
        uses.close()
    return ideal, (belady.reused if belady is not None else None)


class _Int32Reader:
    """Consecutive runs of an int32 file, read in large chunks."""

    __slots__ = ("f", "buf", "at")

    def __init__(self, path: Path) -> None:
        self.f = open(path, "rb")
        self.buf = np.zeros(0, dtype=np.int32)
        self.at = 0

    def take(self, n: int) -> np.ndarray:
        if self.at + n > len(self.buf):
            more = np.fromfile(self.f, dtype=np.int32, count=max(_NEXT_USE_CHUNK, n))
            self.buf = np.concatenate((self.buf[self.at:], more))
            self.at = 0
        out = self.buf[self.at:self.at + n]
        self.at += n
        return out

    def close(self) -> None:
        self.f.close()


class _Belady:
    """Farthest-next-use eviction, one request at a time (see the module docstring).

    A block whose key no later request holds (`NO_USE`) goes first. Its identity does not
    matter (no later request hits it, and it has no reusable descendants: a descendant's reuse
    would reuse it too), so such blocks are only counted. Next go the blocks a request will
    compute again before any reuse (`RECOMPUTED`), by key in a FIFO, so that the request that
    computes one stores it once. The others sit in a heap by (next use, depth); entries are
    lazy, one is current only while its block is resident with that next use. A request's own
    hits have next use == this request, the nearest possible, so they are never chosen while
    the request fits in the cache. As in the cache, the request allocates every block it does
    not reuse. The heap is rebuilt from the resident blocks whenever stale entries outnumber
    them four to one, so memory stays proportional to the capacity."""

    __slots__ = ("capacity", "tpb", "resident", "never", "recomputed", "heap", "reused")

    def __init__(self, capacity: int, tpb: int) -> None:
        self.capacity = capacity
        self.tpb = tpb
        self.resident: dict[int, int] = {}
        """key -> `(next use or RECOMPUTED) << 32 | depth` of the blocks a later request holds
        (one int, so no tuple is made per block)."""
        self.never = 0
        """Blocks no later request holds."""
        self.recomputed: deque[int] = deque()
        """Keys set to RECOMPUTED, in that order (an entry is current while it still is)."""
        self.heap: list[tuple[int, int, int]] = []
        """(-next use, -depth, key)."""
        self.reused = 0

    def request(self, i: int, keys: list[int], cap: int, num_blocks: int, pos: list[int],
                uses: list[int], ideal_full: int, partial: int) -> None:
        """Request `i` with full-block `keys`, `cap` of them hittable, `num_blocks` blocks in
        all; `pos` and `uses` say where the key of each block a later request holds occurs
        next (`_Occurrences.next_use_per_request`); `ideal_full` and `partial`: the ideal's
        full blocks and partial tokens."""
        resident, heap, recomputed = self.resident, self.heap, self.recomputed
        h = 0
        while h < cap and keys[h] in resident:
            h += 1
        self.reused += h * self.tpb + (partial if h == ideal_full else 0)
        excess = len(resident) + self.never + (num_blocks - h) - self.capacity
        while excess > 0:
            if self.never:
                take = min(self.never, excess)
                self.never -= take
                excess -= take
                continue
            if recomputed:
                k = recomputed.popleft()
                if resident.get(k, 0) >> _DEPTH_BITS == RECOMPUTED:
                    del resident[k]
                    excess -= 1
                continue
            nu, nd, k = heapq.heappop(heap)
            entry = resident.get(k)
            if entry is None or entry >> _DEPTH_BITS != -nu:
                continue
            assert -nu != i, "a request larger than the cache reached the oracle"
            del resident[k]
            excess -= 1
        # Hits that no later request holds leave the index (they are counted in `never`).
        f = 0
        for j in range(h):
            if f < len(pos) and pos[f] == j:
                f += 1
            else:
                del resident[keys[j]]
        # Past the hittable prefix a kept block of this key is one RECOMPUTED: this request
        # stores it again. (Inside it, a block the request misses is not kept: a kept block's
        # ancestors with the same next use are kept as long as it is.)
        for k in keys[cap:]:
            resident.pop(k, None)
        self.never += len(keys) - len(pos)
        for j, u in zip(pos, uses):
            k = keys[j]
            resident[k] = (u << _DEPTH_BITS) | j
            if u == RECOMPUTED:
                recomputed.append(k)
            else:
                heapq.heappush(heap, (-u, -j, k))
        if len(heap) > 4 * len(resident) + 4096:
            self.heap = [(-(e >> _DEPTH_BITS), -(e & _DEPTH_MASK), k)
                         for k, e in resident.items() if e >= 0]
            heapq.heapify(self.heap)
        if len(recomputed) > 4 * len(resident) + 4096:
            self.recomputed = deque(k for k, e in resident.items() if e < 0)
