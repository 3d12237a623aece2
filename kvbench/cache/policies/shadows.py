"""Shadow caches that choose a policy's order online (miniature simulations, Waldspurger et al.,
USENIX ATC'17): a sample of the keys is replayed against a cache in LRU order and one in the
policy's own, each the pool's size over the sampling rate, and the pool evicts in the order
whose shadow holds more (`ShadowDuel`). The policies' own shadows live with them
(`segment_duel.py`, `lru2.py`, `predictive.py`, `gdsf.py`).
"""

from __future__ import annotations

from itertools import islice, repeat

import numpy as np

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

    def replay(self, keys: list, cap: int, count=sum) -> int:
        """Use a release's `keys` (deepest first: at equal recency the deeper goes first);
        `count` of whether each was held (how many were; `segment_duel.held_chain`: how many
        from the root down)."""
        lru = self.keys
        # A key used again moves last (keys in a chain are distinct: each once). Its value is
        # True, so one pop per key takes the held ones out and says which.
        held = list(map(lru.pop, keys, repeat(False)))
        lru.update(zip(keys, repeat(True)))
        over = len(lru) - cap
        if over > 0:
            for k in list(islice(lru, over)):
                del lru[k]
        return count(held)


MIN_SHADOW_KEYS = 1024
"""Fewest keys a shadow holds where the pool has that many blocks: one key in 8 of a
2048-block pool is a 256-key shadow, whose hit counts are mostly noise (on agent-like traffic
at 128K tokens `predictive` then chose wrong often enough to lose 0.64 pp to LRU; at 1024 keys
it gains 0.27)."""
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


class ShadowDuel:
    """Which of two orders suits the traffic, by miniature simulations (Waldspurger et al., USENIX
    ATC'17): one key in `sampling` (by `key % SAMPLE_PRIME`; fewer where the shadows would hold
    under `MIN_SHADOW_KEYS` keys or `MIN_SHADOW_TOKENS` tokens of `tokens_per_block` each) is
    replayed against an LRU shadow and a shadow of the policy's own order, each of the pool's
    capacity over the same rate. Each release's counts of sampled keys held (`own_order`) add
    to two windows, halved every `period` ticks and every `LONG_WINDOW` periods, so the
    comparison follows the traffic, not its whole past; the own order is taken while its
    shadow holds at least as many in both.

    `margins` make leaving the own order harder where a switch costs what the order had
    learnt (S3-FIFO's main FIFO): LRU's shadow must then lead by more than that many standard
    deviations of the difference, in the first window or in the long one. The deviation is
    that of the difference, from each release's own difference: hits come in runs (a shared
    prefix's at once), and most are held by both shadows. Counts taken as Poisson (sigma ~
    sqrt(LRU's + own's)) saw one 288-key prefix held by LRU's shadow alone as a 6.5-sigma
    lead: the synthetic trace at tokens_per_block 16 and 1M tokens then went over to LRU early
    and S3-FIFO ended at 14.22 %, against 15.35 % for LRU and 15.87 % for S3-FIFO alone."""

    __slots__ = ("capacity", "sampled", "lru", "margins", "windows")

    def __init__(self, capacity: int, sampling: int, period: int, tokens_per_block: int,
                 margins: tuple[float, float] = (0.0, 0.0)) -> None:
        least = max(MIN_SHADOW_KEYS, MIN_SHADOW_TOKENS // tokens_per_block)
        sampling = max(1, min(sampling, capacity // least))
        self.capacity = max(1, capacity // sampling)
        self.sampled = np.arange(int(SAMPLE_PRIME)) % sampling == 0
        """Whether a key is sampled, by its remainder (one lookup for two remainders)."""
        self.lru = LRUShadow()
        self.margins = margins
        """LRU's lead, in standard deviations, that takes the pool off its own order in the
        first window and in the long one (0: any lead)."""
        self.windows = [[0, 0, 0, p, p] for p in (period, LONG_WINDOW * period)]
        """Per window: LRU's shadow hits, the own order's, the sum of squares of each
        release's difference, the halving period and the next halving."""

    def picked(self, keys: np.ndarray) -> np.ndarray:
        """Which of `keys` are sampled: a mask (no index array to make)."""
        return self.sampled[keys % SAMPLE_PRIME]

    def own_order(self, use_own: bool, lru: int, own: int, clock: int) -> bool:
        """Whether to take victims in the own order after a release whose sampled keys the
        LRU and the own shadow held `lru` and `own` of, at `clock` (`use_own`: the order
        taken until now)."""
        d = (lru - own) ** 2
        for w in self.windows:
            w[0] += lru
            w[1] += own
            w[2] += d
            while clock >= w[4]:
                w[0] >>= 1
                w[1] >>= 1
                w[2] >>= 2
                w[4] += w[3]
        if use_own:
            return all(w[0] - w[1] <= m * w[2] ** 0.5 for w, m in zip(self.windows, self.margins))
        return all(w[1] >= w[0] for w in self.windows)
