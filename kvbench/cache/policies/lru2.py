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
once-used data until its next turn, and it goes first. So the policy measures which order
suits the traffic, as miniature simulations do (Waldspurger et al., USENIX ATC'17): keys are
sampled by a hash (one in `shadow_sampling`), and the sampled keys of every release are
replayed against two shadow caches of the pool's size scaled by the same rate, one LRU and
one LRU-2. Each counts the sampled keys it already held; the counts halve every history
period (`history_ratio` pool sizes of released blocks, the span uses are remembered for), and
the real pool evicts in the order whose shadow holds more (LRU-2 on a tie). Both orders are
kept up to date, so switching is immediate. The shadows see keys, not chains (a sampled key
can hit there after its parent left): an estimate of each order's hit rate, not a replay.

No parameter describes the traffic: `history_ratio` is how long uses are remembered (LRU-K's
retained information period), a multiple of the pool size as for every policy here, and it
also sets the span over which the two orders are compared; `shadow_sampling` trades the cost
of the shadows against the noise of the estimate.

The use times come from the bounded `KeyHistory` (ticks of released blocks, shallowest first),
so they outlive eviction: a key computed again after its block was evicted still has its
earlier use.

Prefix trees: a block's rank is capped at its parent's from the same release (a prefix is used
whenever its extension is, so without the per-block ticks it would rank at least as high
anyway), and at equal rank the block pushed first goes first; a release pushes its deepest
block first, so in either order a chain is evicted from its tip.

Structure, per retention priority level, all lazy: every queued block has a tag (its push
order and id); a FIFO of all tags (the LRU order), a FIFO of the tags of once-used blocks and,
for the others (the LRU-2 order, by rank then tag), runs: the blocks of one push with one rank
(consecutive tags), in a binary heap keyed by `(rank, first tag)`. Runs of one rank hold
disjoint tag ranges, so that key orders whole runs: the victims are the front run's tags in
order, and a heap operation is paid per run, not per block (the running minimum gives a
release's chain few distinct ranks). A claimed, requeued or evicted block's tag changes, so its
old entries are skipped when they surface and dropped when a structure is compacted (when it
holds more than twice its live entries).
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass
from heapq import heapify, heappop, heappush
from itertools import groupby

import numpy as np

from ..free_queue import NUM_PRIORITY_LEVELS
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import KeyHistory, record_key

_BLOCK_BITS = 32
_BLOCK_MASK = (1 << _BLOCK_BITS) - 1
_TAG_BITS = _BLOCK_BITS + 40
_TAG_MASK = (1 << _TAG_BITS) - 1
_SAMPLE_PRIME = 65521
"""Shadow keys are those with `key % prime % shadow_sampling == 0`: block keys of a trace are
structured ints (hash id and offset), so their low bits alone would sample unevenly."""


@dataclass(frozen=True, slots=True)
class LRU2Params:
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks (LRU-K's retained information
    period; the same default as every policy's ghost history here); the shadow counts halve
    every such period."""
    shadow_sampling: int = 8
    """One key in this many feeds the LRU and LRU-2 shadow caches that choose the order
    (0: no shadows, always LRU-2)."""


class LRU2Policy:
    """Victim: at the lowest retention level, the block with the oldest second-to-last use
    (rank 0: one use only), ties in push order; or the least recently used block while the
    LRU shadow holds more of the sampled keys."""

    __slots__ = ("index", "capacity", "params", "history", "use_lru2", "shadow_hits",
                 "_tag", "_rank", "_level", "_live", "_once_live", "_fifo", "_once", "_runs",
                 "_in_runs", "_nonempty", "_size", "_order", "_shadow_lru", "_shadow_lru2",
                 "_shadow_heap", "_shadow_cap", "_shadow_order", "_halve_at")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: LRU2Params) -> None:
        assert id_space <= _BLOCK_MASK
        self.index = index
        self.capacity = capacity
        self.params = params
        self.history = KeyHistory(int(params.history_ratio * capacity))
        self.use_lru2 = True
        """The order victims are taken in now (False: LRU)."""
        self.shadow_hits = [0, 0]
        """Sampled keys the LRU and the LRU-2 shadow held when used, halved every period."""
        self._tag = [0] * id_space
        """(push order << 32) | block while queued (push orders start at 1), else 0."""
        self._rank = [0] * id_space
        """Tick of the second-to-last use of the block's data (0: one use only)."""
        self._level = [0] * id_space
        self._live = [0] * NUM_PRIORITY_LEVELS
        self._once_live = [0] * NUM_PRIORITY_LEVELS
        """Per level: queued blocks of rank 0."""
        self._fifo = [deque() for _ in range(NUM_PRIORITY_LEVELS)]
        self._once = [deque() for _ in range(NUM_PRIORITY_LEVELS)]
        self._runs: list[list[tuple[int, deque]]] = [[] for _ in range(NUM_PRIORITY_LEVELS)]
        """Per level: heap of `((rank << _TAG_BITS) | first tag, tags)` runs."""
        self._in_runs = [0] * NUM_PRIORITY_LEVELS
        """Per level: tags in runs, stale ones included."""
        self._nonempty = 0
        self._size = 0
        self._order = 0
        n = params.shadow_sampling
        self._shadow_cap = max(1, capacity // n) if n else 0
        self._shadow_lru: OrderedDict = OrderedDict()
        self._shadow_lru2: dict = {}  # key -> (rank, order, key), its live heap entry
        self._shadow_heap: list = []
        self._shadow_order = 0
        self._halve_at = self.history.capacity

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
        keys = list(map(record_key, map(self.index.stored.__getitem__, reversed(blocks))))
        partial = keys[-1] is None  # the deepest block may be partial (no key)
        known = np.array(keys[:-1] if partial else keys, np.int64)
        slots, earlier = hist.find(known)
        ticks = earlier >> 8  # 0: none
        if partial:
            ticks = np.append(ticks, 0)
        capped = np.minimum.accumulate(ticks)
        hist.clock = clock + n
        hist.store(known, slots,
                   np.arange(clock + 1, clock + known.size + 1, dtype=np.int64) << 8, earlier)
        if self._shadow_cap:  # the sampled keys (a partial block has none) and their ranks
            picked = (known % _SAMPLE_PRIME % self.params.shadow_sampling == 0).nonzero()[0]
            if picked.size:
                self._shadow(known[picked].tolist(), capped[picked].tolist())
            self._choose()
        ranks = capped.tolist()
        ranks.reverse()  # deepest first, as `blocks`
        self._push_ranked(blocks, ranks, priority)

    def push_back(self, block: BlockId, priority: int) -> None:
        """A claim undone (the block was not used): back with the rank it had."""
        self._push_ranked([block], [self._rank[block]], priority)

    def remove(self, block: BlockId) -> None:
        """A claim: the block is in use."""
        assert self._tag[block], "block not in the free queue"
        self._tag[block] = 0
        lv = self._level[block]
        self._size -= 1
        self._live[lv] -= 1
        if not self._rank[block]:
            self._once_live[lv] -= 1
        if not self._live[lv]:
            self._clear(lv)

    def requeue(self, block: BlockId, priority: int) -> None:
        """To level `priority` (its retention ended; not a use), after the blocks of its rank
        already there."""
        self.remove(block)
        self._push_ranked([block], [self._rank[block]], priority)

    def pop_front_many(self, n: int) -> list[BlockId]:
        out: list[BlockId] = []
        append = out.append
        tag, rank, live, once_live = self._tag, self._rank, self._live, self._once_live
        while len(out) < n and self._nonempty:
            mask = self._nonempty
            lv = (mask & -mask).bit_length() - 1
            take = want = min(n - len(out), live[lv])
            if not self.use_lru2:
                pop = self._fifo[lv].popleft
                once = 0
                while want:
                    t = pop()
                    b = t & _BLOCK_MASK
                    if tag[b] == t:  # else stale: claimed, requeued or evicted since
                        tag[b] = 0
                        append(b)
                        want -= 1
                        if not rank[b]:
                            once += 1
                once_live[lv] -= once
            else:
                pop = self._once[lv].popleft
                once = min(want, once_live[lv])
                once_live[lv] -= once
                want -= once
                while once:  # the once-used first, oldest first
                    t = pop()
                    b = t & _BLOCK_MASK
                    if tag[b] == t:
                        tag[b] = 0
                        append(b)
                        once -= 1
                runs = self._runs[lv]
                taken = 0
                while want:  # then the front run's tags, run by run
                    run = runs[0][1]
                    pop = run.popleft
                    while run and want:
                        t = pop()
                        taken += 1
                        b = t & _BLOCK_MASK
                        if tag[b] == t:
                            tag[b] = 0
                            append(b)
                            want -= 1
                    if not run:
                        heappop(runs)
                self._in_runs[lv] -= taken
            live[lv] -= take
            self._size -= take
            if not live[lv]:
                self._clear(lv)
        return out

    def order(self) -> list[BlockId]:
        """Eviction order if nothing changed meanwhile (tests; O(n log n))."""
        queued = [b for b, t in enumerate(self._tag) if t]
        if self.use_lru2:
            queued.sort(key=lambda b: (self._level[b], self._rank[b], self._tag[b]))
        else:
            queued.sort(key=lambda b: (self._level[b], self._tag[b]))
        return [BlockId(b) for b in queued]

    # --- helpers ----------------------------------------------------------------------------

    def _push_ranked(self, blocks: list[BlockId], ranks: list[int], priority: int) -> None:
        """Queue `blocks` with `ranks` (non-decreasing: the rank-0 blocks come first)."""
        tag, rank, level = self._tag, self._rank, self._level
        n = len(blocks)
        o = self._order
        self._order = o + n
        tags = [(k << _BLOCK_BITS) | b for k, b in zip(range(o + 1, o + n + 1), blocks)]
        for b, t, r in zip(blocks, tags, ranks):
            assert not tag[b], "block already in the free queue"
            tag[b] = t
            rank[b] = r
            level[b] = priority
        m = ranks.count(0)
        self._fifo[priority].extend(tags)
        if m:
            self._once[priority].extend(tags[:m])
            self._once_live[priority] += m
        if m < n:
            runs = self._runs[priority]
            i = m
            for r, same in groupby(ranks[m:]):
                j = i + len(list(same))
                heappush(runs, ((r << _TAG_BITS) | tags[i], deque(tags[i:j])))
                i = j
            self._in_runs[priority] += n - m
        self._size += n
        live = self._live[priority] = self._live[priority] + n
        self._nonempty |= 1 << priority
        self._compact(priority, live)

    def _compact(self, lv: int, live: int) -> None:
        """Drop stale entries at level `lv` from a structure holding over twice its live ones
        (amortised O(1) per push)."""
        fifo = self._fifo[lv]
        if len(fifo) > 2 * live + 64:
            self._fifo[lv] = deque(self._current(fifo))
        once = self._once[lv]
        if len(once) > 2 * self._once_live[lv] + 64:
            self._once[lv] = deque(self._current(once))
        if self._in_runs[lv] > 2 * (live - self._once_live[lv]) + 64:
            # Keys stay: a run's remaining tags keep their order among the other runs.
            runs = [(key, deque(kept)) for key, run in self._runs[lv]
                    if (kept := self._current(run))]
            heapify(runs)
            self._runs[lv] = runs
            self._in_runs[lv] = sum(len(run) for _, run in runs)

    def _current(self, tags) -> list[int]:
        """The tags among `tags` that are their block's current one, in order."""
        tag = self._tag
        return [t for t in tags if tag[t & _BLOCK_MASK] == t]

    def _clear(self, lv: int) -> None:
        """Level `lv` has no queued block left: only stale entries remain."""
        self._fifo[lv].clear()
        self._once[lv].clear()
        self._runs[lv].clear()
        self._in_runs[lv] = 0
        self._nonempty &= ~(1 << lv)

    def _shadow(self, keys: list, ranks: list[int]) -> None:
        """Replay a release's sampled keys with their ranks (shallowest first) against both
        shadows, in the pool's push order (deepest first)."""
        hits = self.shadow_hits
        lru, lru2, heap = self._shadow_lru, self._shadow_lru2, self._shadow_heap
        cap = self._shadow_cap
        order = self._shadow_order
        for k, r in zip(reversed(keys), reversed(ranks)):
            if k in lru:
                hits[0] += 1
                lru.move_to_end(k)
            else:
                lru[k] = None
            if k in lru2:
                hits[1] += 1
            order += 1
            lru2[k] = e = (r, order, k)
            heappush(heap, e)
        self._shadow_order = order
        while len(lru) > cap:
            lru.popitem(last=False)
        while len(lru2) > cap:
            e = heappop(heap)
            if lru2.get(e[2]) is e:
                del lru2[e[2]]
        if len(heap) > 2 * len(lru2) + 64:
            heap[:] = [e for e in heap if lru2.get(e[2]) is e]
            heapify(heap)

    def _choose(self) -> None:
        """Halve the shadows' counts every history period; evict in the order that leads."""
        clock = self.history.clock
        while clock >= self._halve_at:
            self.shadow_hits = [h >> 1 for h in self.shadow_hits]
            self._halve_at += self.history.capacity
        self.use_lru2 = self.shadow_hits[1] >= self.shadow_hits[0]

    def _check_sanity(self) -> bool:
        queued = [b for b, t in enumerate(self._tag) if t]
        assert len(queued) == self._size
        for lv in range(NUM_PRIORITY_LEVELS):
            live = [b for b in queued if self._level[b] == lv]
            once = [b for b in live if not self._rank[b]]
            assert len(live) == self._live[lv] and len(once) == self._once_live[lv]
            assert bool(live) == bool(self._nonempty >> lv & 1)
            fifo, once_q = set(self._fifo[lv]), set(self._once[lv])
            run_rank = {}
            for key, run in self._runs[lv]:
                assert run and key & _TAG_MASK <= run[0] and list(run) == sorted(run)
                run_rank.update(dict.fromkeys(run, key >> _TAG_BITS))
            assert sum(len(run) for _, run in self._runs[lv]) == self._in_runs[lv]
            for b in live:
                t = self._tag[b]
                assert t & _BLOCK_MASK == b and t in fifo
                assert t in once_q if not self._rank[b] else run_rank.get(t) == self._rank[b]
        cap = self._shadow_cap
        assert len(self._shadow_lru) <= cap and len(self._shadow_lru2) <= cap
        return True
