"""Two-queue policies over the LRU free queue: SLRU/2Q and S3-FIFO.

Both keep a block's free copies in one of two FIFOs per priority level, class 0 (probation /
small) and class 1 (protected / main) of one `RunQueue` (so every operation stays O(1)), and
learn a key's earlier uses from a bounded `KeyHistory` that outlives eviction (the ghost list of
2Q and S3-FIFO). A claimed (in-use) block leaves its queue, as with LRU, and re-enters at the
tail of its queue on release: in cache mode every access is a claim and a release. Retention
priority levels come first: victims come from the lowest level holding a free block in either
queue, and the two-queue logic orders the blocks inside it. A release pushes a sequence's
deepest block first, so inside a queue children leave before their parents.

Both fall back to LRU as `lru2` does: with `shadow_sampling`, a `ShadowDuel` replays sampled
keys against an LRU shadow and a shadow of the policy (`segment_duel.py`), and until the
policy's shadow leads (and again while the LRU one does) the pool takes its victims in LRU
order (`ReleaseOrder`, kept beside the FIFOs), still keeping the FIFOs' own bookkeeping, so
switching is immediate.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import compress
from operator import not_

import numpy as np

from ..free_queue import NUM_PRIORITY_LEVELS
from ..ids import BlockId
from ..radix import PrefixIndex
from .base import KeyHistory, chain_keys, record_key, tick_entries
from .run_queue import RunQueue
from .segment_duel import ReleaseOrder, S3FIFOShadow, SLRUShadow, held_chain
from .shadows import DuelParams, ShadowDuel

_FIRST = int("01" * NUM_PRIORITY_LEVELS, 2)
"""FIFO mask of the first queue (class 0) at every level."""
_SECOND = _FIRST << 1
"""FIFO mask of the second queue (class 1) at every level."""
# S3-FIFO's ghosts are a set of keys, spread first. A Python set probes from the low bits of
# an int's hash, the int itself, and trace keys pack (hash id << 24 | prefix end): their low
# bits are the prefix end, shared by every request at that depth, so ghosts of one depth
# chained in the set (set lookups were 3x the instructions). Xor-shifting the high bits down
# is a bijection on 64 bits: the same membership, well spread.
_SPREAD = np.array(24, np.uint64)
_U64 = (1 << 64) - 1


def spread_key(key: int | None) -> int | None:
    """A block key (int64) spread as its ghost: `key ^ (key >> 24)` on its 64 bits, as
    int64 (`spread_keys` for one key; None for a partial block)."""
    if key is None:
        return None
    u = key & _U64
    u ^= u >> 24
    return u - (1 << 64) if u >> 63 else u


def spread_keys(index: PrefixIndex, blocks: list[BlockId]) -> list:
    """The spread keys of a release's `blocks` (one sequence's, deepest first) in their
    order, None for a partial block: one numpy pass over the `chain_keys` slice."""
    return _listed(*_spread_array(index, blocks))


def _listed(spread: np.ndarray, partial: bool) -> list:
    """`_spread_array`'s keys as `spread_keys` gives them (deepest first, None for a partial
    block)."""
    keys = spread.tolist()
    keys.reverse()
    if partial:
        keys.insert(0, None)
    return keys


def _spread_array(index: PrefixIndex, blocks: list[BlockId]) -> tuple[np.ndarray, bool]:
    """`chain_keys` spread: the full blocks' spread keys shallowest first (int64), and
    whether the deepest block is partial."""
    known, partial = chain_keys(index, blocks)
    return _spread(known), partial


def _spread(keys: np.ndarray) -> np.ndarray:
    """`spread_key` of each of `keys` (int64)."""
    u = keys.view(np.uint64)
    return (u ^ (u >> _SPREAD)).view(np.int64)


class _TwoQueues:
    """What SLRU and S3-FIFO share: the `first` queue (probation / small, class 0), the
    `second` one (protected / main, class 1), and which data each block last held."""

    __slots__ = ("index", "capacity", "queue", "num_second", "history", "_left", "_rec",
                 "_out", "_freq", "shadows", "use_own", "lru_order")
    SWITCH_MARGINS = (0.0, 0.0)
    """How far LRU's shadow count must lead, in standard deviations of the difference, in the
    duel's window and its long one, before the pool leaves its own order for LRU's (0: any
    lead; `ShadowDuel`)."""

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex, history,
                 sampling: int, period: int, shadow, entry: float) -> None:
        self.index = index
        self.capacity = capacity
        self.queue = RunQueue(id_space, 2 * NUM_PRIORITY_LEVELS)
        self.num_second = 0
        """Blocks in the second queue."""
        self.shadows = (ShadowDuel(capacity, sampling, period, index.tpb, shadow, held_chain,
                                   self.SWITCH_MARGINS, entry)
                        if sampling else None)
        """The LRU shadow, the policy's own (`shadows.own`) and both shadows' counts (halved
        every `period` released blocks and every `LONG_WINDOW` periods); None: always the
        policy's own order."""
        self.use_own = not sampling
        """The order victims are taken in now (False: LRU, where a duel starts)."""
        self.lru_order = ReleaseOrder(id_space, self.queue) if sampling else None
        """The queued blocks in release order (LRU's): victims while LRU leads."""
        self.history = history
        """Keys used or evicted lately (a ghost list)."""
        # A block released with the data it held when claimed was reused while cached; any
        # other released block holds new data (it was allocated: an eviction forgets the
        # data). Only claims write here, so a release of new data (most blocks) costs no
        # per-block Python work beyond the history.
        self._left = bytearray(id_space)
        """1 + the queue (0 first, 1 second) a block left by its latest claim; 0 once it is
        queued again (a block that was never claimed since it was queued holds new data
        when next released)."""
        self._rec: list = [None] * id_space
        """The stored record a block held when claimed: a different one is new data (a
        partial match taken and written)."""
        # S3-FIFO's access counts are its run stamps (SLRU's are 0): kept here, so a claim
        # costs one call into the queue for both.
        self._freq = bytearray(id_space)
        """The stamp a block's run had when the block was claimed."""
        self._out = 0
        """Blocks marked in `_left`: a release stops looking for its claimed blocks once it
        has found them all (they are its shallowest, so it looks from its end)."""

    def __len__(self) -> int:
        return len(self.queue)

    def __contains__(self, block: BlockId) -> bool:
        return block in self.queue

    def push_back(self, block: BlockId, priority: int) -> None:
        self.push_back_many([block], priority)

    def requeue(self, block: BlockId, priority: int) -> None:
        """To the back of its queue at level `priority` (its retention ended; not a use)."""
        q = self.queue
        stamp = q.stamp_of(block)
        q.push_run([block], 2 * priority + (q.remove(block) & 1), stamp,
                   [spread_key(record_key(self.index.stored[block]))])
        if self.lru_order:  # as LRU's: to the back of its new level
            self.lru_order.push([block], priority, not self.use_own)

    def remove_many(self, blocks: list[BlockId]) -> None:
        """Claims: the blocks are in use (hits, or a partial match being taken)."""
        left, rec, stored = self._left, self._rec, self.index.stored
        second = 0
        for b, fifo in zip(blocks, self.queue.remove_many(blocks, self._freq)):
            fifo &= 1
            left[b] = 1 + fifo
            rec[b] = stored[b]
            second += fifo
        self.num_second -= second
        self._out += len(blocks)

    def _returned(self, blocks: list[BlockId]) -> list[tuple[int, int]]:
        """Of `blocks` being queued, those that left the queue by a claim and still hold the
        same data: their positions, each with 1 + the queue it left (a claimed block holding
        new data now, a partial match taken and written, is new data). Clears `_left` for
        every claimed one."""
        out = self._out
        if not out:
            return []
        left, last, stored = self._left, self._rec, self.index.stored
        same: list[tuple[int, int]] = []
        for i in compress(range(len(blocks) - 1, -1, -1), map(left.__getitem__,
                                                               reversed(blocks))):
            b = blocks[i]
            if stored[b] is last[b]:
                same.append((i, left[b]))
            left[b] = 0
            out -= 1
            if not out:
                break
        self._out = out
        same.reverse()
        return same

    def _queue_split(self, blocks: list[BlockId], second: list, priority: int,
                     stamp: int = 0, keys: list | None = None) -> None:
        """Append `blocks` in order to the queues at level `priority`, as runs stamped
        `stamp`: those with `second[i]` set to the second queue, the others to the first
        (with their `keys`, if given: the first queue's victims' keys are read)."""
        queue = self.queue
        if not any(second):
            queue.push_run(blocks, 2 * priority, stamp, keys)
            return
        flags = bytes(second)
        cut = flags.find(1)
        if flags.count(1, cut) == len(blocks) - cut:
            # Mostly the second queue's are a tail (a chain's blocks used before are its
            # shallowest, last here): two slices.
            self._queue_tail(blocks, cut, priority, stamp, keys)
            return
        first = list(map(not_, second))
        queue.push_run(list(compress(blocks, first)), 2 * priority, stamp,
                       None if keys is None else list(compress(keys, first)))
        run = list(compress(blocks, second))
        queue.push_run(run, 2 * priority + 1, stamp)
        self.num_second += len(run)

    def _queue_tail(self, blocks: list[BlockId], cut: int, priority: int, stamp: int = 0,
                    keys: list | None = None) -> None:
        """`_queue_split` of `blocks` whose second-queue ones are `blocks[cut:]`: two slices
        (the released list itself where one side is empty)."""
        n = len(blocks)
        if cut:
            self.queue.push_run(blocks if cut == n else blocks[:cut], 2 * priority, stamp,
                                keys if keys is None or cut == n else keys[:cut])
        if cut < n:
            self.queue.push_run(blocks[cut:] if cut else blocks, 2 * priority + 1, stamp)
            self.num_second += n - cut

    def note_prompt(self, keys: np.ndarray, matched: list[BlockId]) -> None:
        if self.shadows:
            self.shadows.judge(self._shadow_keys(keys), matched, self.__contains__)

    def _shadow_keys(self, keys: np.ndarray) -> np.ndarray:
        """Block keys as the shadows hold them."""
        return keys

    def _duel(self, keys: list, seen: list | None, clock: int) -> None:
        """Replay a release's sampled `keys` (deepest first; SLRU: with whether each was
        `seen` before) into both shadows and choose the order at `clock` (released blocks)."""
        duel = self.shadows
        if keys:
            cap = duel.capacity
            duel.lru.replay(keys, cap)
            if seen is None:
                duel.own.replay(keys, cap)
            else:
                duel.own.replay(keys, seen, cap)
        self.use_own = duel.own_order(self.use_own, clock)

    def _pop_lru(self, n: int, firsts: list | None = None) -> list[BlockId]:
        """Up to `n` victims in LRU order (the duel chose it), the second queue's count kept
        (S3-FIFO: the first queue's victims appended to `firsts`, their keys become ghosts as
        they would have leaving by the policy's own order)."""
        out, second = self.lru_order.pop(n, firsts)
        self.num_second -= second
        return out

    def _check_sanity(self) -> bool:
        assert self.queue._check_sanity()
        duel = self.shadows
        if duel:
            assert len(duel.lru) <= duel.capacity and len(duel.own) <= duel.capacity
            assert self.lru_order._check_sanity()
        else:
            assert self.use_own and self.lru_order is None
        assert not any(self._left[b] for b in range(len(self._left)) if b in self.queue)
        assert self._out == sum(map(bool, self._left))
        assert self.num_second == sum(len(self.queue.fifo_order(2 * lv + 1))
                                      for lv in range(NUM_PRIORITY_LEVELS))
        return True


@dataclass(frozen=True, slots=True)
class SLRUParams(DuelParams):
    protected_ratio: float = 0.8
    """Most of the pool the protected segment may hold."""
    history_ratio: float = 8.0
    """Keys remembered, as a multiple of the pool's blocks; the shadow counts halve every
    such period."""
    shadow_sampling: int = 8
    """One key in this many feeds the LRU and SLRU shadow caches that choose the order
    (0: no shadows, always SLRU)."""


class SLRUPolicy(_TwoQueues):
    """Segmented LRU with a ghost history (a 2Q flavour): a block enters the protected segment
    when it is reused while cached or when its key was used before (within the history), else
    probation. The protected segment is capped at `protected_ratio` of the pool: its LRU block
    is demoted to the probation tail. Victims: probation's LRU first, protected's when
    probation has none at the lowest priority level; or the least recently released block
    until the SLRU shadow clearly holds more of the sampled keys, and from when the LRU one
    holds more."""

    __slots__ = ("params", "_cap")

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: SLRUParams) -> None:
        history = KeyHistory(int(params.history_ratio * capacity))
        # The duel's period is the history's, as lru2's: the span over which a use counts
        # as seen before is the span over which the orders are compared.
        super().__init__(id_space, capacity, index, history, params.shadow_sampling,
                         history.capacity, SLRUShadow(params.protected_ratio),
                         params.shadow_entry)
        self.params = params
        self._cap = int(params.protected_ratio * capacity)

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        hist = self.history
        known, partial = chain_keys(self.index, blocks)  # shallowest first
        slots, earlier = hist.find(known)
        # The sequence touched its blocks shallowest first: one clock tick each (the partial
        # block's is the last, unremembered).
        start = hist.clock
        hist.clock = start + known.size + partial
        hist.store(known, slots, tick_entries(start, known.size), earlier)
        if self.shadows:  # the sampled keys and whether each was seen, deepest first
            deep = known[::-1]
            picked = self.shadows.picked(deep)
            self._duel(deep[picked].tolist(), (earlier[::-1][picked] > 0).tolist(), hist.clock)
        # Protected: reused while cached, or new data whose key was used before. Mostly
        # those are the chain's shallowest blocks, `blocks` from `cut` on: then two slices,
        # no flag per block.
        seen = earlier.nonzero()[0]  # known[j] is blocks[n - 1 - j]
        n, k = len(blocks), seen.size
        same = self._returned(blocks)
        cut = n - k if not k or seen.item(-1) == k - 1 else -1  # -1: not a tail
        if cut >= 0:
            for i, _ in reversed(same):  # returns below the tail extend it, if next to it
                if i < cut:
                    cut = i if i == cut - 1 else -1
                    if cut < 0:
                        break
        if cut < 0:
            flags = (earlier[::-1] > 0).tolist()  # deepest first, as `blocks`
            if partial:  # the deepest block may be partial (no key): never seen
                flags.insert(0, False)
            for i, _ in same:
                flags[i] = True
            self._queue_split(blocks, flags, priority)
        else:
            self._queue_tail(blocks, cut, priority)
        queue = self.queue
        excess = self.num_second - self._cap
        while excess > 0:  # demote protected's LRU end, level by level
            fifo = queue.lowest_fifo(_SECOND)
            moved = queue.move_upto(fifo, fifo - 1, excess, 0, 0)
            self.num_second -= moved
            excess -= moved
        if self.lru_order:  # once queued: a compaction rebuilds from the queue
            self.lru_order.push(blocks, priority, not self.use_own)

    def pop_front_many(self, n: int) -> list[BlockId]:
        if not self.use_own:
            return self._pop_lru(n)
        out: list[BlockId] = []
        queue = self.queue
        # The lowest FIFO: probation before protected at each level.
        while len(out) < n and len(queue):
            fifo = queue.lowest_fifo()
            run = queue.pop_upto(fifo, n - len(out), 0)
            if fifo & 1:
                self.num_second -= len(run)
            out += run
        return out


class GhostKeys:
    """S3-FIFO's ghost history: the keys evicted from the small FIFO, remembered exactly as a
    `KeyHistory` of `capacity` records them one tick each (when it holds more than twice
    `capacity` keys it forgets those recorded `capacity` ticks ago or earlier), for keys
    never recorded while remembered: a key enters the small FIFO only when it is not a
    ghost, and only its eviction from there records it. So the keys remembered are the
    newest of the record order: a set to ask and a list in order to forget from, each
    written a batch at a time in C (a dict of ticks cost a Python loop per forgotten key)."""

    __slots__ = ("capacity", "clock", "_keys", "_order")

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self.clock = 0
        self._keys: set = set()
        self._order: list = []
        """The keys remembered, oldest first."""

    def __len__(self) -> int:
        return len(self._keys)

    def contains(self, keys: list) -> list[bool]:
        """Whether each of `keys` (None: never) is remembered."""
        # Most releases hold no ghost (1 in 20 on the conversation trace): one pass in C
        # over the large set, then the few found, a small set, asked per key.
        found = self._keys.intersection(keys)
        if not found:
            return [False] * len(keys)
        return list(map(found.__contains__, keys))

    def record(self, keys: list, keyless: bool = True) -> None:
        """Record each of `keys` (distinct, none remembered) at its own tick; with `keyless`
        they may hold None (a partial block), which is skipped (looking costs a comparison
        per key)."""
        known = keys if not keyless or None not in keys else [k for k in keys if k is not None]
        remembered, order = self._keys, self._order
        most = 2 * self.capacity
        while known:
            # Up to the key whose record overfills the history, the forgetting following it;
            # mostly all of them, none forgotten (no copy then).
            room = most + 1 - len(remembered)
            chunk, known = (known, ()) if len(known) < room else (known[:room], known[room:])
            held = len(remembered) + len(chunk)
            remembered.update(chunk)
            assert len(remembered) == held, "a ghost recorded while remembered"
            order += chunk
            self.clock += len(chunk)
            if held > most:  # keep the keys of the last `capacity` + 1 ticks
                drop = held - self.capacity - 1
                remembered.difference_update(order[:drop])
                del order[:drop]

    def _check_sanity(self) -> bool:
        assert len(self._order) == len(self._keys) == len(set(self._order))
        assert set(self._order) == self._keys and len(self._keys) <= 2 * self.capacity
        assert None not in self._keys, "a partial block (no key) recorded"
        return True


@dataclass(frozen=True, slots=True)
class S3FIFOParams(DuelParams):
    small_ratio: float = 0.1
    """Share of the pool the small (probation) FIFO aims at."""
    max_freq: int = 3
    """Accesses counted per block (the main FIFO's second chances)."""
    history_ratio: float = 1.0
    """Ghost keys remembered, as a multiple of the pool's blocks (S3-FIFO: the main FIFO's
    size)."""
    shadow_sampling: int = 8
    """One key in this many feeds the LRU and S3-FIFO shadow caches that choose the order
    (0: no shadows, always S3-FIFO); the shadow counts halve every `DUEL_PERIOD` pool sizes
    of released blocks."""


DUEL_PERIOD = 8
"""S3-FIFO's shadow counts halve every this many pool sizes of released blocks. The other
policies' period is their history's, 8 pool sizes by default; S3-FIFO's history (its ghosts)
spans one, and a window that short would make the choice follow each burst of the traffic,
while a switch of order costs S3-FIFO what its main FIFO had learnt (see `_pop_lru_ghosts`)."""


class S3FIFOPolicy(_TwoQueues):
    """S3-FIFO (Yang et al., SOSP'23): new data enters a small FIFO, or the main FIFO when its
    key is in the ghost history of keys evicted from the small one. Eviction takes from the
    small FIFO while it holds more than `small_ratio` of the pool: its head goes to the main
    FIFO if it was accessed since it entered, else it is evicted and its key becomes a ghost.
    Otherwise from the main FIFO: a head accessed since its last pass gets its count lowered
    and goes back to the tail (second chance), else it is evicted. Or the least recently
    released block until the S3-FIFO shadow clearly holds more of the sampled keys, and from
    when the LRU one does (`ShadowDuel`)."""

    __slots__ = ("params", "_target", "_keyless", "_released", "_higher")
    # Any lead flipped it back and forth on the synthetic trace (14.59 % at 1M tokens against
    # LRU's 15.34 %, 15.97 % without the duel); 2 or 3 sigma give 15.97 %. The long window
    # sees a small lead that lasts (agent-like traffic at 512K and 1M tokens: LRU's shadow
    # led by up to 3 % of its hits all along, and S3-FIFO lost 1.2 and 0.7 points to LRU).
    # Margins of 3 and 2 waited too long on short traces (multi-turn generator, 120 to 2000
    # requests: up to 3.8 pp below LRU); 2 and 1 halve the sum of those losses and move no
    # figure on the shipped, agent-like, RAG-like or chat traces by more than 0.08 pp. Entering
    # S3-FIFO's order on a clear lead (`shadow_entry`), it gets 15.46 % there.
    SWITCH_MARGINS = (2.0, 1.0)

    def __init__(self, id_space: int, capacity: int, index: PrefixIndex,
                 params: S3FIFOParams) -> None:
        ghosts = GhostKeys(1)
        super().__init__(id_space, capacity, index,
                         GhostKeys(int(params.history_ratio * capacity)),
                         params.shadow_sampling, DUEL_PERIOD * capacity,
                         S3FIFOShadow(params.small_ratio, params.max_freq, ghosts),
                         params.shadow_entry)
        if self.shadows:  # the shadow's ghosts: the pool's history at the shadow's scale
            ghosts.capacity = max(1, int(params.history_ratio * self.shadows.capacity))
        self.params = params
        self._released = 0
        """Blocks released so far (the duel's clock)."""
        self._target = max(1, int(params.small_ratio * capacity))
        self._higher = bytes(min(c + 1, params.max_freq) for c in range(256))
        """A count after one more access (`bytes.translate` table)."""
        self._keyless = False
        """Whether a partial block (no key) was ever queued: only then may victims' keys
        hold None (with partial reuse on)."""
        # A queued block's access count (since it entered its FIFO or last went round) is
        # its run's stamp (`_freq` once claimed): counts change only when a block is queued
        # again, so a release is queued as runs of one count each (new data counts 0: all of
        # it but the returns).

    def _check_sanity(self) -> bool:
        assert super()._check_sanity() and self.history._check_sanity()
        # The small FIFO's runs carry their blocks' spread keys: its victims' become ghosts.
        assert self.queue._check_sanity(lambda b: spread_key(self.index.key_of(b)), _FIRST)
        top = self.params.max_freq
        assert all(self.queue.stamp_of(b) <= top for b in range(len(self._freq))
                   if b in self.queue)
        return True

    def _shadow_keys(self, keys: np.ndarray) -> np.ndarray:
        return _spread(keys)

    def push_back_many(self, blocks: list[BlockId], priority: int) -> None:
        spread, partial = _spread_array(self.index, blocks)
        duel = self.shadows
        if duel:  # sampled by their spread keys (a bijection: as good a hash as the keys)
            deep = spread[::-1]
            self._released += len(blocks)
            self._duel(deep[duel.picked(deep)].tolist(), None, self._released)
        self._push(blocks, _listed(spread, partial), priority)
        if duel:  # once queued: a compaction rebuilds from the queue
            self.lru_order.push(blocks, priority, not self.use_own)

    def _push(self, blocks: list[BlockId], keys: list, priority: int) -> None:
        """Queue a release's `blocks` (their spread `keys`, None for a partial block)."""
        # New data enters the main FIFO if its key is a ghost, else the small one. The small
        # FIFO's runs keep their (spread) keys: its victims' keys become ghosts.
        if keys[0] is None:
            self._keyless = True
        second = self.history.contains(keys)
        same = self._returned(blocks)
        if not same:
            self._queue_split(blocks, second, priority, 0, keys)
            return
        # Returns are accesses: each goes back to the FIFO it left, its count one higher.
        # The release is queued in runs of one count (new data counts 0, a return >= 1).
        freq, higher = self._freq, self._higher
        counts = bytearray(len(blocks))
        for i, left in same:
            counts[i] = higher[freq[blocks[i]]]
            second[i] = left - 1
        # Run ends found by `find` over the few counts present: no step per block.
        values, n, start = set(counts), len(blocks), 0
        while start < n:
            count, end = counts[start], n
            for other in values:
                if other != count:
                    k = counts.find(other, start)
                    if start < k < end:
                        end = k
            self._queue_split(blocks[start:end], second[start:end], priority, count,
                              keys[start:end])
            start = end

    def pop_front_many(self, n: int) -> list[BlockId]:
        if not self.use_own:
            return self._pop_lru_ghosts(n)
        out: list[BlockId] = []
        queue = self.queue
        ghosts: list = []
        """Keys evicted from the small FIFO, in order: recorded when the call ends (nothing
        reads the history meanwhile)."""
        while len(out) < n and len(queue):
            fs, fm = queue.lowest_fifo(_FIRST), queue.lowest_fifo(_SECOND)
            lf = fs >> 1 if fs >= 0 else NUM_PRIORITY_LEVELS
            ls = fm >> 1 if fm >= 0 else NUM_PRIORITY_LEVELS
            num_first = len(queue) - self.num_second
            if lf < ls or (lf == ls and num_first > self._target):
                # The small FIFO's unaccessed heads are evicted as one run (down to its target
                # size while the main FIFO has blocks at this level); an accessed head moves.
                k = n - len(out) if lf < ls else min(n - len(out), num_first - self._target)
                run = queue.pop_upto(fs, k, 0, 0, ghosts)  # their keys become ghosts
                if run:
                    out += run
                else:
                    # Accessed heads move to the main FIFO's tail as a run, their counts
                    # cleared: after the first, each one moves while the small FIFO holds
                    # more than its target.
                    self.num_second += queue.move_upto(fs, fs + 1,
                                                       max(1, num_first - self._target), 0,
                                                       255, 1)
            else:
                run = queue.pop_upto(fm, n - len(out), 0)
                if run:
                    self.num_second -= len(run)
                    out += run
                else:  # accessed heads: a second chance each, at the tail in order
                    for moved, count in queue.pop_runs(fm, len(queue), 255, 1):
                        queue.push_run(moved, fm, count - 1)
        if ghosts:
            self.history.record(ghosts, self._keyless)
        return out

    def _pop_lru_ghosts(self, n: int) -> list[BlockId]:
        """Victims in LRU order; those that leave the small FIFO become ghosts, as by S3-FIFO's
        own order (a block is in the small FIFO only while its key is no ghost, so none is
        recorded twice): when the duel turns back, S3-FIFO finds the ghosts it would have.

        Nothing else is kept for S3-FIFO: LRU evicts the main FIFO's old blocks that S3-FIFO
        kept for their counts, and it learns them again only through a ghost (a reuse within
        its one pool size of history). So a switch costs S3-FIFO more than it costs lru2
        (whose ranks come from the history alone): on the synthetic trace, where the two
        orders are close and the shadows' lead changes often, the duel ends below both.
        Recording main's victims as ghosts too, or moving small's overflow to main while LRU
        leads, changed that by less than run-to-run chaos."""
        firsts: list[BlockId] = []
        out = self._pop_lru(n, firsts)
        if firsts:
            stored = self.index.stored
            self.history.record([spread_key(record_key(stored[b])) for b in firsts])
        return out
