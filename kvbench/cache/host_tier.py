"""The host tier of `KVCacheManager`: where the data of evicted GPU blocks goes (offload) and
how a claimed host hit comes back to the GPU (onboard).

With a host tier, a GPU block evicted while it holds reusable data is offloaded to the host if
the host has room or can make it by evicting its own LRU block, and if the block's priority is
at least `secondary_offload_min_priority`. A host hit is onboarded into a fresh GPU block before
use; the host slot it leaves is empty and is the next one the host hands out.
"""

from __future__ import annotations

from heapq import heappush

from .ids import BlockId, CopyKind, CopyOp, Tier
from .seq import NO_BLOCK


class HostTier:
    """Offload and onboard, mixed into `KVCacheManager`: they work on its pools, prefix index,
    ref counts, priorities, retention expiries, copy ops and counters."""

    __slots__ = ()

    def _move_to_gpu(self, b: BlockId, dst: BlockId) -> BlockId:
        """Onboard claimed host block `b` into fresh GPU block `dst`, which inherits every claim
        on `b`; the host slot becomes empty and is handed out next (TensorRT-LLM #18868)."""
        self._emit(CopyKind.ONBOARD, Tier.HOST, b, Tier.GPU, dst, self.index.num_tokens(b))
        self.index.move(b, dst)
        if self._fresh is not None:
            self._fresh[dst] = 0
        self.onboard_blocks += 1
        self._moved[b] = dst
        self.ref_count[dst] = self.ref_count[b]
        self.ref_count[b] = 0
        self.host.num_in_use -= 1
        self.host.empty.append(b)
        return dst

    def _offload(self, victims: list[BlockId]) -> None:
        """Move evicted GPU blocks' data to the host where allowed and possible, else drop it,
        exactly as offloading them one at a time in eviction order would: a victim below
        `secondary_offload_min_priority` is dropped; any other takes an empty host block, else
        the host's next victim (the LRU block of its lowest priority), whose data is dropped;
        with every host block claimed it is dropped. When that next victim is a block an
        earlier victim of the same call was just moved to, the earlier victim is dropped
        instead and its copy (whose destination this one overwrites) is never made: the
        counters count only data that moved and data that was dropped.

        In bulk while that cannot happen: host blocks at or below the lowest victim priority
        leave before any victim placed behind them."""
        host, index, prio = self.host, self.index, self.priority
        min_prio = self.spec.secondary_offload_min_priority
        drop = [v for v in victims if prio[v] < min_prio]
        if drop:
            victims = [v for v in victims if prio[v] >= min_prio]
        empty, fq = host.empty, host.free_queue
        n = len(victims)
        k = min(n, len(empty))
        dsts = empty[len(empty) - k:]
        dsts.reverse()
        del empty[len(empty) - k:]
        evicted = 0
        if k < n:
            old = fq.pop_front_many(n - k, min(prio[v] for v in victims))
            index.remove_many(old)
            evicted = len(old)
            dsts.extend(old)
        srcs = victims[:len(dsts)]
        self._queue_placed(srcs, dsts)
        m = len(srcs)
        if m < n:
            evicted += self._offload_one_by_one(victims[m:], srcs, dsts, drop)
        if self._expiring:
            expires, expiring = self.expires, self._expiring
            for v, h in zip(srcs, dsts):
                t = expires[h] = expires[v]
                if t:
                    heappush(expiring, (t, h))
        if drop:
            index.remove_many(drop)
        if self.spec.emit_copy_ops:
            num_tokens = index.num_tokens
            for v, h in zip(srcs, dsts):
                self.copy_ops.append(CopyOp(CopyKind.OFFLOAD, Tier.GPU, v, Tier.HOST, h,
                                            num_tokens(v)))
        index.move_many(srcs, dsts)
        self.offload_blocks += len(srcs)
        self.host_evicted_blocks += evicted
        held = host.capacity - len(empty)
        if held > self.peak_host_blocks:
            self.peak_host_blocks = held

    def _queue_placed(self, srcs: list[BlockId], dsts: list[BlockId]) -> None:
        """Queue the bulk-placed victims' host blocks `dsts` in eviction order, one run per
        priority level; each takes its victim's priority."""
        prio, fq = self.priority, self.host.free_queue
        run_start, m = 0, len(srcs)
        for i in range(1, m + 1):
            if i == m or prio[srcs[i]] != prio[srcs[run_start]]:
                level = prio[srcs[run_start]]
                run = dsts[run_start:i]
                for h in run:
                    prio[h] = level
                fq.push_back_many(run, level)
                run_start = i

    def _offload_one_by_one(self, victims: list[BlockId], srcs: list[BlockId],
                            dsts: list[BlockId], drop: list[BlockId]) -> int:
        """`_offload` for the victims the bulk part could not place: each evicts the host's
        next victim (placed victims included). Appends the moves to `srcs`/`dsts` (a move a
        later victim undoes leaves them, its victim joins `drop`); returns the host blocks
        whose data was dropped."""
        fq, index, prio = self.host.free_queue, self.index, self.priority
        placed = {h: i for i, h in enumerate(dsts)}
        undone = False
        evicted = 0
        for v in victims:
            h = fq.front()
            if h is None:  # every host block is claimed
                drop.append(v)
                continue
            fq.remove(h)
            j = placed.get(h)
            if j is None:
                index.remove(h)
                evicted += 1
            else:
                drop.append(srcs[j])
                srcs[j] = NO_BLOCK
                undone = True
            placed[h] = len(srcs)
            srcs.append(v)
            dsts.append(h)
            p = prio[h] = prio[v]
            fq.push_back(h, p)
        if undone:
            kept = [i for i, v in enumerate(srcs) if v != NO_BLOCK]
            srcs[:] = [srcs[i] for i in kept]
            dsts[:] = [dsts[i] for i in kept]
        return evicted
