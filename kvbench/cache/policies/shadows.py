"""Shadow caches that choose a policy's order online (miniature simulations, Waldspurger et al.,
USENIX ATC'17): a sample of the keys is replayed against a cache in LRU order and one in the
policy's own, each the pool's size over the sampling rate, and the pool evicts in the order
whose shadow holds more (`ShadowDuel`). The policies' own shadows live with them
(`segment_duel.py`, `lru2.py`, `predictive.py`, `gdsf.py`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from itertools import islice, repeat

import numpy as np

consume = deque(maxlen=0).extend
"""Runs an iterator to its end at C speed, keeping nothing (the shadows' deletions)."""

SAMPLE_PRIME = np.array(65521, np.int64)
"""Shadow caches take the keys with `key % prime % sampling == 0`: block keys of a trace are
structured ints (hash id and offset), so their low bits alone would sample unevenly."""


class LRUShadow:
    """A shadow cache of sampled keys in LRU order (miniature simulation, Waldspurger et al.,
    USENIX ATC'17), trimmed to its capacity after each release: the keys LRU would hold in a
    pool that many times smaller. It sees keys, not chains (a sampled key can hit after its
    parent left): an estimate of LRU's hit rate, not a replay."""

    __slots__ = ("keys",)

    def __init__(self) -> None:
        self.keys: dict = {}
        """Sampled keys in LRU order, each to True (a dict keeps insertion order; a use moves
        a key last)."""

    def __len__(self) -> int:
        return len(self.keys)

    def replay(self, keys: list, cap: int) -> None:
        """Use a release's `keys` (deepest first: at equal recency the deeper goes first)."""
        lru = self.keys
        # A key used again moves last (keys in a chain are distinct: each once).
        consume(map(lru.pop, keys, repeat(None)))
        lru.update(zip(keys, repeat(True)))
        over = len(lru) - cap
        if over > 0:
            for k in list(islice(lru, over)):
                del lru[k]


MIN_SHADOW_KEYS = 1024
"""Fewest keys a shadow holds where the pool has that many blocks: one key in 8 of a 2048-block
pool is a 256-key shadow, whose hit counts are mostly noise (on agent-like traffic at 128K
tokens `predictive` then chose wrong often enough to lose 0.64 pp to LRU; at 1024 keys it gains
0.27). 4096 made `lru2` in serve mode gain where 2048-key shadows lose (the synthetic trace at
1M tokens, time_scale 4: +0.60 pp against -0.58), but cost `gdsf` there 0.7 pp, `slru` and
`gdsf` most of their gain on that trace in cache mode (+0.09 and +0.16 pp against +0.44 and
+0.47), and the policies up to a third of their replay speed: `lru2` samples one key in 4
instead (`LRU2Params`)."""
MIN_SHADOW_TOKENS = 1 << 16
"""Fewest tokens a shadow's keys hold, likewise (1024 keys at tokens_per_block 64). Short
blocks split a prompt into more keys, all hit by one release: as many keys are fewer prompts,
and the counts are noisier. Agent-like traffic at tokens_per_block 16 and 128K tokens: with
1024-key shadows S3-FIFO lost 0.79 pp and `predictive` 0.63 to LRU; with 4096, -0.03 and
+0.23."""


LONG_WINDOW = 32
"""The duel's second pair of counts halves this many times less often than its first: a
short trace (a few periods in all) or a lead that lasts shows there. On the multi-turn
generator with 120 to 1000 requests, where LRU is close to the optimum, the counts of one
period swung to the own order often enough that `lru2` lost up to 2.1 pp and `gdsf` 1.9 to
LRU; with the long window as well, 1.2 and 0.6."""
ENTRY_MARGIN = 1.0
"""The default `shadow_entry`: the own order's lead, in standard deviations of the difference,
in both windows, that takes the pool off LRU's order, where it starts (a policy earns it).
Taking it on any lead in both (and starting in it), the policies trailed LRU on the multi-turn
generator with 120 to 1000 requests by up to 2.52 pp, and by more than 0.5 pp in 17 of 230
policy-cells; with 1, by up to 1.53 pp, in 7. On the shipped traces every figure moved by at
most 0.2 pp but two, on the synthetic trace at 1M tokens: `s3fifo` +0.12 pp on LRU, not
+0.63, and `lru2` +0.86, not +0.30. A margin of 2 left 2 cells but took `slru`'s and `gdsf`'s
whole gain there."""


@dataclass(frozen=True, slots=True)
class DuelParams:
    """What every policy whose order duels LRU's takes (its parameters extend these)."""

    shadow_entry: float = ENTRY_MARGIN
    """Standard deviations of the difference by which the policy's shadow must lead LRU's, in
    both windows, before the pool leaves LRU's order for the policy's (0: any lead)."""


class ShadowDuel:
    """Which of two orders suits the traffic, by miniature simulations (Waldspurger et al., USENIX
    ATC'17): one key in `sampling` (by `key % SAMPLE_PRIME`; fewer where the shadows would hold
    under `MIN_SHADOW_KEYS` keys or `MIN_SHADOW_TOKENS` tokens of `tokens_per_block` each) is
    replayed against an LRU shadow and a shadow of the policy's own order (`own`), each of the
    pool's capacity over the same rate; releases update both. Each request's prompt is judged
    at its match (`judge`): how many of its sampled keys each shadow holds (`count`: all, or
    the chain from the root down) adds to two windows, halved every `period` ticks and every
    `LONG_WINDOW` periods, so the comparison follows the traffic, not its whole past; at each
    release (`own_order`) the pool, which starts in LRU's order, takes the own order once its
    shadow leads by more than `entry` (`ENTRY_MARGIN`) standard deviations of the difference in
    both, and leaves it when LRU's shadow leads in either.

    A prompt is judged when it is matched, as the pool hits or misses it then, and a key
    whose matched block is in use by a running sequence is held in both shadows: it is a hit
    in either order, though its shadow key may have aged out since its last release. In cache
    mode nothing is in use or released between a match and its release; in serve mode a
    request decodes in between. Judged at release, on the synthetic trace at time_scale 2 (a
    median 1,842 blocks released between a block's claim and its release), the LRU shadow
    held 9.5 % of the sampled keys where the pool in LRU order hits 13.3 %. On a chat log,
    where a running turn's prefix is matched by the next request, it held 69.6 % at the match
    against the pool's 79.4 % until in-use blocks counted (80.2 % with them).

    `margins` make leaving the own order harder where a switch costs what the order had
    learnt (S3-FIFO's main FIFO): LRU's shadow must then lead by more than that many standard
    deviations of the difference, in the first window or in the long one. The deviation, here
    as for `ENTRY_MARGIN`, is that of the difference, from each prompt's own difference: hits
    come in runs (a shared prefix's at once), and most are held by both shadows. Counts taken
    as Poisson (sigma ~ sqrt(LRU's + own's)) saw one 288-key prefix held by LRU's shadow alone
    as a 6.5-sigma lead: the synthetic trace at tokens_per_block 16 and 1M tokens then went
    over to LRU early and S3-FIFO ended at 14.22 %, against 15.35 % for LRU and 15.87 % for
    S3-FIFO alone."""

    __slots__ = ("pool_blocks", "capacity", "sampled", "lru", "own", "count", "margins",
                 "entry", "windows")

    def __init__(self, capacity: int, sampling: int, period: int, tokens_per_block: int,
                 own, count=sum, margins: tuple[float, float] = (0.0, 0.0),
                 entry: float = ENTRY_MARGIN) -> None:
        least = max(MIN_SHADOW_KEYS, MIN_SHADOW_TOKENS // tokens_per_block)
        sampling = max(1, min(sampling, capacity // least))
        self.pool_blocks = capacity
        self.capacity = max(1, capacity // sampling)
        self.sampled = np.arange(int(SAMPLE_PRIME)) % sampling == 0
        """Whether a key is sampled, by its remainder (one lookup for two remainders)."""
        self.lru = LRUShadow()
        self.own = own
        """The shadow of the policy's own order (the policy replays releases into it): any
        container of the sampled keys it holds."""
        self.count = count
        """How many of a prompt's sampled keys a shadow holds, from whether each does
        (deepest first): `sum`, or `segment_duel.held_chain` (from the root down)."""
        self.margins = margins
        """LRU's lead, in standard deviations, that takes the pool off its own order in the
        first window and in the long one (0: any lead)."""
        self.entry = entry
        """The own order's lead, in standard deviations, that takes the pool off LRU's order
        (`DuelParams.shadow_entry`)."""
        self.windows = [[0, 0, 0, p, p] for p in (period, LONG_WINDOW * period)]
        """Per window: LRU's shadow hits, the own order's, the sum of squares of each
        prompt's difference, the halving period and the next halving."""

    def picked(self, keys: np.ndarray) -> np.ndarray:
        """Which of `keys` are sampled: a mask (no index array to make)."""
        return self.sampled[keys % SAMPLE_PRIME]

    def judge(self, keys: np.ndarray, matched: list, queued) -> None:
        """Count the sampled keys of a prompt being matched (`keys`, shallowest first, in the
        shadows' key space) that each shadow holds now. `matched`: the blocks the match found
        for the first keys; one of them on the GPU (below `pool_blocks`) that is not free
        (`queued(block)` false) is in use by a running sequence, a hit in either order, so
        both shadows hold it."""
        pos = np.flatnonzero(self.picked(keys))
        if not pos.size:
            return
        pos = pos[::-1]  # deepest first
        deep = keys[pos].tolist()
        lru = list(map(self.lru.keys.__contains__, deep))
        own = list(map(self.own.__contains__, deep))
        n = len(matched)
        if n > pos[-1]:  # a sampled key was matched (the shallowest is the likeliest)
            pool = self.pool_blocks
            for j, i in enumerate(pos.tolist()):
                if i < n:
                    b = matched[i]
                    if 0 <= b < pool and not queued(b):
                        lru[j] = own[j] = True
        self.tally(self.count(lru), self.count(own))

    def tally(self, lru: int, own: int) -> None:
        """Add a prompt's counts (`lru` held by the LRU shadow, `own` by the own one)."""
        d = (lru - own) ** 2
        for w in self.windows:
            w[0] += lru
            w[1] += own
            w[2] += d

    def own_order(self, use_own: bool, clock: int) -> bool:
        """Whether to take victims in the own order after a release, at `clock` (`use_own`:
        the order taken until now)."""
        for w in self.windows:
            while clock >= w[4]:
                w[0] >>= 1
                w[1] >>= 1
                w[2] >>= 2
                w[4] += w[3]
        if use_own:
            return all(w[0] - w[1] <= m * w[2] ** 0.5 for w, m in zip(self.windows, self.margins))
        return all(w[1] - w[0] > self.entry * w[2] ** 0.5 for w in self.windows)
