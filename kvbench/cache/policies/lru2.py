"""LRU-2 (LRU-K with K = 2, O'Neil, O'Neil and Weikum, SIGMOD'93) adapted to prefix trees,
with LRU as a fallback chosen online by two shadow caches.

LRU evicts the block whose last use is oldest; LRU-2 the block whose *second-to-last* use is
oldest (its backward 2-distance: its age plus the gap between its last two uses). A block whose
key has only one use in the history has an infinite 2-distance and goes first, in LRU order
among such blocks (LRU-K's subsidiary policy). So content computed once is kept only while
nothing better needs the space, and content that came back is ranked by how recently it came
back, which is what matters when reuse gaps are longer than the cache holds (multi-turn
traffic where most turns arrive after LRU has cycled the whole pool: LRU keeps every new
prefix a little while and none long enough to be reused).

Where reuse comes back before LRU has cycled the pool, LRU-2 loses: a new turn's tail is
once-used data until its next turn, and it goes first. So the policy measures which order suits
the traffic, as miniature simulations do (Waldspurger et al., USENIX ATC'17): keys are sampled
by a hash (one in `shadow_sampling`, fewer in a small pool: `ShadowDuel`), and the sampled keys
of every release are replayed against two shadow caches of the pool's size scaled by the same
rate, one LRU and one LRU-2. Each counts the sampled keys of a prompt it holds when the prompt
is matched; the counts halve every history period (`history_ratio` pool sizes of released
blocks, the span uses are remembered for), a second pair every 32 periods, and the real pool
starts in LRU order and evicts in LRU-2 order once its shadow leads by more than
`shadow_entry` standard deviations of the difference in both, until the LRU shadow holds more
in either (`ShadowDuel.own_order`). Both orders are kept up to date, so switching is immediate.
The shadows see keys, not chains (a sampled key can hit there after its parent left): an
estimate of each order's hit rate, not a replay.

No parameter describes the traffic: `history_ratio` is how long uses are remembered (LRU-K's
retained information period), a multiple of the pool size as for every policy here, and it
also sets the span over which the two orders are compared; `shadow_sampling` trades the cost
of the shadows against the noise of the estimate (`LRU2Params`).

The use times come from the bounded `KeyHistory` (ticks of released blocks, shallowest first),
so they outlive eviction: a key computed again after its block was evicted still has its
earlier use.

Prefix trees: a block's rank is capped at its parent's from the same release (a prefix is used
whenever its extension is, so without the per-block ticks it would rank at least as high
anyway), and at equal rank the block pushed first goes first; a release pushes its deepest
block first, so in either order a chain is evicted from its tip.

Structure, per retention priority level, all lazy, with no Python work per block: every
queued block has a tag (its push order, from 1, and its level in the low bits; 0 while not
queued) in a numpy view of an int array. A push is kept as numpy arrays of its blocks and
their tags and as the list of its blocks (victims are slices of it: the ints the pool passed,
none made per victim), in a FIFO of pushes (the LRU order) and as runs (the blocks of one push
with one rank, consecutive tags) in a binary heap keyed by `(rank, first tag)` (the LRU-2
order; the once-used blocks are the runs of rank 0). Runs of one rank hold disjoint tag
ranges, so that key orders whole runs: the victims are the front run's blocks in order,
checked a run at a time against the tags (a claimed, requeued or evicted block's tag changed:
its old entries are skipped when they surface), and a heap operation is paid per run, not per
block (the running minimum gives a release's chain few distinct ranks). A structure holding
more than twice its level's live blocks drops its stale entries (amortised O(1) per push).
The FIFO, at four times, is dropped instead and no longer kept, and is rebuilt from the tags
(the push order) when LRU next pops that level: while LRU-2 leads, which never pops it, it
costs nothing.

The shadows are kept the same way: the LRU shadow a dict in use order, the LRU-2 shadow a dict
of each key's insertion order and a heap of a release's runs of one rank.
"""

from __future__ import annotations

from array import array
from bisect import bisect_right
from collections import deque
from dataclasses import dataclass
from functools import partial
from heapq import heapify, heappop, heappush
from itertools import compress
from operator import eq

import numpy as np

from ..free_queue import NUM_PRIORITY_LEVELS
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import TICK_SHIFT, KeyHistory, chain_keys, tick_entries
from .runs import compact_runs
from .shadows import DuelParams, ShadowDuel

_LEVEL_BITS = 7
_LEVEL_MASK = (1 << _LEVEL_BITS) - 1
_KEY_SHIFT = 64
"""A run's heap key is `(rank << 64) | first tag` (tags stay below 2**63)."""
# Constant operands of per-release numpy calls are 0-d arrays: numpy converts a Python
# scalar operand on every call, which costs more than the call on a short array.
_ZERO = np.array(0, np.int64)

assert NUM_PRIORITY_LEVELS <= 1 << _LEVEL_BITS


@dataclass(frozen=True, slots=True)
class LRU2Params(DuelParams):
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks (LRU-K's retained information
    period; the same default as every policy's ghost history here); the shadow counts halve
    every such period."""
    shadow_sampling: int = 4
    """One key in this many feeds the LRU and LRU-2 shadow caches that choose the order
    (0: no shadows, always LRU-2). One in 4, not the other policies' 8: LRU and LRU-2 are
    often close, and twice the samples keep the duel from following noise (the synthetic
    trace in serve mode at 1M tokens, time_scale 4: +0.60 pp on LRU, against -0.58 with 8),
    for about a tenth of the replay speed."""


class LRU2Policy:
    """Victim: at the lowest retention level, the block with the oldest second-to-last use
    (rank 0: one use only), ties in push order; or the least recently used block until the
    LRU-2 shadow clearly holds more of the sampled keys, and from when the LRU one holds more."""

    __slots__ = ("index", "capacity", "params", "history", "use_lru2", "shadows", "_tag",
                 "_tags", "_rank", "_ranks", "_pushed", "_live", "_fifo", "_in_fifo",
                 "_fifo_off", "_runs", "_in_runs", "_nonempty", "_size", "_shadow_lru2",
                 "_shadow_runs", "_in_shadow_runs", "_shadow_order")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: LRU2Params) -> None:
        self.index = index
        self.capacity = capacity
        self.params = params
        self.history = KeyHistory(int(params.history_ratio * capacity))
        self.use_lru2 = not params.shadow_sampling
        """The order victims are taken in now (False: LRU, where a duel starts)."""
        self._shadow_lru2: dict = {}
        """Sampled key -> the insertion order of its live entry in `_shadow_runs`."""
        self.shadows = (ShadowDuel(capacity, params.shadow_sampling, self.history.capacity,
                                   index.tpb, self._shadow_lru2, entry=params.shadow_entry)
                        if params.shadow_sampling else None)
        """The LRU shadow, the LRU-2 one's keys (its order is kept here) and both shadows'
        counts; None: always LRU-2."""
        # Each per-block int array has a numpy view: one element at a time through the array
        # (a Python int, no numpy scalar), a push or a run at once through the view.
        self._tag = array("q", bytes(8 * id_space))
        """`(push order << 7) | level` while queued (push orders start at 1), else 0."""
        self._tags = np.frombuffer(self._tag, np.int64)
        self._rank = array("q", bytes(8 * id_space))
        """Tick of the second-to-last use of the block's data (0: one use only)."""
        self._ranks = np.frombuffer(self._rank, np.int64)
        self._pushed = 0
        """Blocks pushed so far (the last push order)."""
        self._live = [0] * NUM_PRIORITY_LEVELS
        self._fifo = [deque() for _ in range(NUM_PRIORITY_LEVELS)]
        """Per level: `(0, tags, blocks, block list)` of each push, in push order (the zero stands
        for a run's key, so both structures are taken from alike)."""
        self._in_fifo = [0] * NUM_PRIORITY_LEVELS
        """Per level: entries in the FIFO, stale ones included."""
        self._fifo_off = 0
        """Levels (bits) whose FIFO is not kept (empty): rebuilt from the tags when popped."""
        self._runs: list[list[tuple[int, np.ndarray, np.ndarray, list[BlockId]]]] = [
            [] for _ in range(NUM_PRIORITY_LEVELS)]
        """Per level: heap of `((rank << 64) | first tag, tags, blocks, block list)` runs."""
        self._in_runs = [0] * NUM_PRIORITY_LEVELS
        self._nonempty = 0
        self._size = 0
        self._shadow_runs: list[list] = []
        """Heap of `[(rank << 64) | first order, first order, keys, next]`: a release's sampled
        keys of one rank, in insertion order, the first `next` of them gone."""
        self._in_shadow_runs = 0
        self._shadow_order = 0

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: BlockId) -> bool:
        return self._tag[block] != 0

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        """A release (deepest block first): each block ranked by its key's use before this
        one, capped at its parent's."""
        if not blocks:
            return
        hist = self.history
        clock = hist.clock
        n = len(blocks)
        # Shallowest first, as the sequence touched them (one tick each); keys in a chain are
        # distinct, so every earlier use is read before this release writes its own. The rank
        # is the earlier use's tick (0: none), capped at the parent's: a running minimum.
        known, partial = chain_keys(self.index, blocks)  # the deepest block may be partial
        slots, earlier = hist.find(known)
        # The running minimum is written backwards, so the ranks come deepest first as the
        # blocks, contiguous (numpy scatters a reversed view at several times the cost); a
        # partial deepest block has no key and rank 0.
        ranks = np.zeros(n, np.int64)
        np.minimum.accumulate(np.right_shift(earlier, TICK_SHIFT),  # 0: none
                              out=ranks[:0:-1] if partial else ranks[::-1])
        hist.clock = clock + n
        hist.store(known, slots, tick_entries(clock, known.size), earlier)
        duel = self.shadows
        if duel:  # the sampled keys (a partial block has none) and their ranks
            deep = known[::-1]  # deepest first, as the pool's pushes
            picked = duel.picked(deep)
            keys = deep[picked].tolist()
            if keys:
                self._shadow(duel, keys, ranks[partial:][picked].tolist())
            self.use_lru2 = duel.own_order(self.use_lru2, hist.clock)
        self._push_ranked(blocks, ranks, priority)

    def push_back(self, block: BlockId, priority: int) -> None:
        """A claim undone (the block was not used): back with the rank it had."""
        self._push_ranked([block], self._ranks[block:block + 1].copy(), priority)

    def note_prompt(self, keys: np.ndarray, matched: list[BlockId]) -> None:
        if self.shadows:
            self.shadows.judge(keys, matched, self.__contains__)

    def remove_many(self, blocks: list[BlockId]) -> None:
        """Claims: the blocks are in use."""
        tag, live = self._tag, self._live
        for block in blocks:
            t = tag[block]
            assert t, "block not in the free queue"
            tag[block] = 0
            lv = t & _LEVEL_MASK
            left = live[lv] = live[lv] - 1
            if not left:
                self._clear(lv)
        self._size -= len(blocks)

    def requeue(self, block: BlockId, priority: int) -> None:
        """To level `priority` (its retention ended; not a use), after the blocks of its rank
        already there."""
        self.remove_many([block])
        self._push_ranked([block], self._ranks[block:block + 1].copy(), priority)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        live = self._live
        while len(out) < n and self._nonempty:
            mask = self._nonempty
            lv = (mask & -mask).bit_length() - 1
            take = min(n - len(out), live[lv])
            if self.use_lru2:
                runs = self._runs[lv]
                self._in_runs[lv] -= self._take(runs, partial(heappop, runs), take, out)
            else:
                if self._fifo_off >> lv & 1:
                    self._rebuild_fifo(lv)
                fifo = self._fifo[lv]
                self._in_fifo[lv] -= self._take(fifo, fifo.popleft, take, out)
            live[lv] -= take
            self._size -= take
            if not live[lv]:
                self._clear(lv)
        return out

    def order(self) -> list[BlockId]:
        """Eviction order if nothing changed meanwhile (tests; O(n log n))."""
        tag, rank = self._tag, self._rank
        queued = [b for b, t in enumerate(tag) if t]
        if self.use_lru2:
            queued.sort(key=lambda b: (tag[b] & _LEVEL_MASK, rank[b], tag[b]))
        else:
            queued.sort(key=lambda b: (tag[b] & _LEVEL_MASK, tag[b]))
        return [BlockId(b) for b in queued]

    # --- helpers ----------------------------------------------------------------------------

    def _push_ranked(self, blocks: list[BlockId], ranks: np.ndarray, priority: int) -> None:
        """Queue `blocks` with `ranks` (non-decreasing: the rank-0 blocks come first)."""
        n = len(blocks)
        run = np.fromiter(blocks, np.int64, n)
        # count_nonzero: `any` is a reduction, twice its cost on a release's few blocks
        assert not np.count_nonzero(self._tags[run]), "block already in the free queue"
        o = self._pushed
        self._pushed = o + n
        run_tags = np.arange(((o + 1) << _LEVEL_BITS) | priority, (o + n + 1) << _LEVEL_BITS,
                             1 << _LEVEL_BITS, np.int64)
        self._tags[run] = run_tags
        self._ranks[run] = ranks
        heap = self._runs[priority]
        first_tag = ((o + 1) << _LEVEL_BITS) | priority
        first, last = ranks.item(0), ranks.item(-1)
        if first == last:
            ids = blocks[:]  # the caller may reuse its list
            heappush(heap, ((first << _KEY_SHIFT) | first_tag, run_tags, run, ids))
        else:  # one run per rank (ranks do not decrease), each ending where the next rank
            # starts (a release has two or three: a binary search each costs less than one
            # pass comparing neighbours)
            ids = None
            i, r = 0, first
            while True:
                j = n if r == last else int(ranks.searchsorted(r, "right"))
                heappush(heap, ((r << _KEY_SHIFT) | (first_tag + (i << _LEVEL_BITS)),
                                run_tags[i:j], run[i:j], blocks[i:j]))
                if j == n:
                    break
                i, r = j, ranks.item(j)
        if not self._fifo_off >> priority & 1:
            self._fifo[priority].append((0, run_tags, run, blocks[:] if ids is None else ids))
            self._in_fifo[priority] += n
        self._in_runs[priority] += n
        self._size += n
        live = self._live[priority] = self._live[priority] + n
        self._nonempty |= 1 << priority
        if self._in_fifo[priority] > 4 * live + 256:
            self._drop_fifo(priority)
        if self._in_runs[priority] > 2 * live + 64:
            self._compact_runs(priority)

    def _take(self, queue, pop, want: int, out: list[BlockId]) -> int:
        """Append the first `want` live blocks of `queue` (entries `(key, tags, blocks, block
        list)`, the front at `[0]`, taken off by `pop`; it holds at least `want` live blocks)
        to `out`, off the queue; returns how many entries that consumed. Live blocks come from
        the entries' lists (no int made per block), a stale one's entry's from its array."""
        tags = self._tags
        gone = 0
        while want:
            key, run_tags, run, ids = queue[0]
            size = run.size
            if size <= want:  # whole entries while they fit (so do their live blocks)
                parts = [pop()]
                while queue and size + queue[0][2].size <= want:
                    parts.append(pop())
                    size += parts[-1][2].size
                if len(parts) > 1:
                    run_tags = np.concatenate([p[1] for p in parts])
                    run = np.concatenate([p[2] for p in parts])
                ok = tags[run] == run_tags
                gone += size
                if np.count_nonzero(ok) == size:
                    kept = run
                    for p in parts:
                        out += p[3]
                else:
                    kept = run[ok]
                    out += kept.tolist()
            else:  # the front entry in part
                ok = tags[run] == run_tags
                if np.count_nonzero(ok) == size:  # no stale block: views, not copies
                    queue[0] = (key, run_tags[want:], run[want:], ids[want:])
                    gone += want
                    kept = run[:want]
                    out += ids[:want]
                else:
                    kept = run[ok]
                    if kept.size > want:
                        rest = kept[want:]
                        queue[0] = (key, run_tags[ok][want:], rest, rest.tolist())
                        gone += want + size - kept.size
                        kept = kept[:want]
                    else:
                        pop()
                        gone += size
                    out += kept.tolist()
            tags[kept] = _ZERO
            want -= kept.size
        return gone

    def _drop_fifo(self, lv: int) -> None:
        """Stop keeping level `lv`'s FIFO (its stale entries outgrew its live ones)."""
        self._fifo[lv].clear()
        self._in_fifo[lv] = 0
        self._fifo_off |= 1 << lv

    def _rebuild_fifo(self, lv: int) -> None:
        """Level `lv`'s FIFO again, as one push of its queued blocks in tag (push) order: the
        same victims as the FIFO it dropped, whose live entries were in that order."""
        tags = self._tags
        run = tags.nonzero()[0]
        run_tags = tags[run]
        if self._nonempty != 1 << lv:  # other levels hold blocks too
            mine = (run_tags & _LEVEL_MASK) == lv
            run, run_tags = run[mine], run_tags[mine]
        order = run_tags.argsort()
        run = run[order]
        self._fifo[lv].append((0, run_tags[order], run, run.tolist()))
        self._in_fifo[lv] = self._live[lv]
        self._fifo_off &= ~(1 << lv)

    def _compact_runs(self, lv: int) -> None:
        """Drop the stale entries of level `lv`'s runs. Keys stay: a run's remaining blocks
        keep their order among the other runs."""
        tags = self._tags
        runs = []
        for key, run_tags, run, _ in self._runs[lv]:
            ok = tags[run] == run_tags
            if np.count_nonzero(ok):
                run = run[ok]
                runs.append((key, run_tags[ok], run, run.tolist()))
        heapify(runs)
        self._runs[lv] = runs
        self._in_runs[lv] = self._live[lv]

    def _clear(self, lv: int) -> None:
        """Level `lv` has no queued block left: only stale entries remain."""
        self._fifo[lv].clear()
        self._runs[lv].clear()
        self._in_fifo[lv] = self._in_runs[lv] = 0
        self._nonempty &= ~(1 << lv)
        self._fifo_off &= ~(1 << lv)  # an empty FIFO is exact

    def _shadow(self, duel: ShadowDuel, keys: list, ranks: list[int]) -> None:
        """Replay a release's sampled keys with their ranks (deepest first, as the pool's
        pushes) into both shadows, trimming each to its capacity after the release."""
        lru2 = self._shadow_lru2
        cap = duel.capacity
        duel.lru.replay(keys, cap)
        # LRU-2: entries in (rank, insertion order); a key used again has a new live entry
        # (its old one goes stale).
        n = len(keys)
        order = self._shadow_order
        self._shadow_order = order + n
        lru2.update(zip(keys, range(order + 1, order + n + 1)))
        heap = self._shadow_runs
        i = 0
        while i < n:  # runs of one rank (ranks do not decrease)
            r = ranks[i]
            j = n if ranks[-1] == r else bisect_right(ranks, r, i)
            first = order + 1 + i
            heappush(heap, [(r << _KEY_SHIFT) | first, range(first, order + 1 + j),
                            keys[i:j], 0])
            i = j
        entries = self._in_shadow_runs + n
        over = len(lru2) - cap
        get = lru2.get
        while over > 0:  # the front run's keys still live there, `over` entries at a time
            run = heap[0]
            _, orders, run_keys, k = run
            end = min(len(run_keys), k + over)
            part = run_keys[k:end]
            live = list(compress(part, map(eq, map(get, part), orders[k:end])))
            for key in live:
                del lru2[key]
            over -= len(live)
            entries -= end - k
            if end == len(run_keys):
                heappop(heap)
            else:
                run[3] = end
        self._in_shadow_runs = entries
        if entries > 4 * len(lru2) + 256:
            self._compact_shadow()

    def _compact_shadow(self) -> None:
        """Drop the stale keys of the LRU-2 shadow's runs (heap keys stay, as the pool's)."""
        self._shadow_runs = compact_runs(self._shadow_runs, self._shadow_lru2)
        self._in_shadow_runs = len(self._shadow_lru2)

    def _check_sanity(self) -> bool:
        tag, rank = self._tag, self._rank
        queued = [b for b, t in enumerate(tag) if t]
        assert len(queued) == self._size
        low = (1 << _KEY_SHIFT) - 1
        for lv in range(NUM_PRIORITY_LEVELS):
            live = sorted(b for b in queued if tag[b] & _LEVEL_MASK == lv)
            assert len(live) == self._live[lv] and bool(live) == bool(self._nonempty >> lv & 1)
            # Each order holds every live block once, under its current tag.
            fifo = []
            for _, ts, bs, ids in self._fifo[lv]:
                assert ids == bs.tolist()
                fifo += zip(ts.tolist(), ids)
            assert len(fifo) == self._in_fifo[lv] and fifo == sorted(fifo, key=lambda e: e[0])
            if self._fifo_off >> lv & 1:
                assert not fifo and live
            else:
                assert sorted(b for t, b in fifo if tag[b] == t) == live
            in_runs, entries = [], 0
            for key, ts, bs, ids in self._runs[lv]:
                ts, bs = ts.tolist(), bs.tolist()
                assert ids == bs
                assert ts and key & low <= ts[0] and ts == sorted(ts)
                entries += len(ts)
                current = [b for t, b in zip(ts, bs) if tag[b] == t]
                assert all(rank[b] == key >> _KEY_SHIFT for b in current)
                in_runs += current
            assert entries == self._in_runs[lv] and sorted(in_runs) == live
        duel, lru2 = self.shadows, self._shadow_lru2
        assert (len(duel.lru) <= duel.capacity and len(lru2) <= duel.capacity if duel
                else not lru2)
        entries = [(x, o) for _, orders, keys, k in self._shadow_runs
                   for o, x in zip(orders[k:], keys[k:])]
        assert len(entries) == self._in_shadow_runs
        assert sorted(e for e in entries if lru2.get(e[0]) == e[1]) == sorted(lru2.items())
        return True
