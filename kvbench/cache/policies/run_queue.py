"""FIFOs of free blocks kept as the runs they were queued in, each run with one stamp.

A policy queues a release as a few runs (one per class, or per queue and access count) and
takes victims as runs from a FIFO's head while their stamp stays within bounds. A linked list
(`FreeQueue`) writes four fields per queued block and reads two per victim; here a run is the
released list itself, a block's only field is the run holding it, and a victim costs a slice
(and one write when its run is taken in part: a run taken whole keeps its blocks naming it,
dead). A claim takes a block out of the middle of its run in O(1): the run counts its
blocks still queued, and a run with holes is filtered when its turn comes (a block claimed
and queued again sits in a newer run; the older one skips it). A run may carry its blocks'
keys (a slice of the release's, which the policy read anyway): a victim's key is then a
slice too, not a record read per block (S3-FIFO's ghosts are its small FIFO's victims' keys).
"""

from __future__ import annotations

from collections import deque

from ..ids import BlockId

_BLOCKS, _START, _STAMP, _FIFO, _LIVE, _KEYS = range(6)
"""A run: [its blocks in queue order (owned, never changed), the position of its first block
not yet taken, its stamp, its FIFO, how many of blocks[start:] are still queued in it, the
blocks' keys (owned, in the same order) or None]."""

_SLACK = 64
"""Dead runs and taken or claimed entries a FIFO may hold beyond twice its blocks before it
is compacted (amortised O(1) per queued block)."""


class RunQueue:
    """FIFOs `0 .. fifos - 1` of free blocks, each a deque of runs; a block is in at most one.

    Invariants (`_check_sanity`): `where[b]` is the run holding queued block `b`, and `b`
    sits at or after that run's start; for a block not queued it is None or a run with no
    live block (a run taken whole is left named by its blocks: no write per victim, and a
    block is queued again before long); a queued run's live count is the number of its
    blocks from its start on whose `where` is the run; `count[q]` is the sum of FIFO q's live
    counts, and bit q of `nonempty` is set iff `count[q] > 0`; `held[q]` is the number of
    entries FIFO q's runs hold from their starts on."""

    __slots__ = ("_runs", "_where", "_count", "_held", "_nonempty", "_size", "last_stamp")

    def __init__(self, capacity: int, fifos: int) -> None:
        self._runs = [deque() for _ in range(fifos)]
        self._where: list[list | None] = [None] * capacity
        self._count = [0] * fifos
        self._held = [0] * fifos
        self._nonempty = 0
        self._size = 0
        self.last_stamp = 0
        """The stamp of the last block `pop_upto` took."""

    def __len__(self) -> int:
        return self._size

    def __contains__(self, block: BlockId) -> bool:
        run = self._where[block]
        return run is not None and run[_LIVE] > 0

    def push_run(self, blocks: list[BlockId], fifo: int, stamp: int, keys: list | None = None
                 ) -> None:
        """Append `blocks` in order to FIFO `fifo` as one run stamped `stamp`, with their
        `keys` if given (what the queue hands back with them as victims; a queued block's
        data does not change). The queue keeps both lists: the caller must not change them."""
        if not blocks:
            return
        n = len(blocks)
        assert keys is None or len(keys) == n
        run = [blocks, 0, stamp, fifo, n, keys]
        where = self._where
        for b in blocks:
            where[b] = run
        self._runs[fifo].append(run)
        self._count[fifo] += n
        self._nonempty |= 1 << fifo
        self._size += n
        held = self._held[fifo] = self._held[fifo] + n
        if held > 2 * self._count[fifo] + _SLACK:
            self._compact(fifo)

    def remove(self, block: BlockId) -> int:
        """Take `block` out of its run; returns its FIFO."""
        run = self._where[block]
        assert run is not None and run[_LIVE], "block not in the free queue"
        self._where[block] = None
        run[_LIVE] -= 1
        fifo = run[_FIFO]
        left = self._count[fifo] = self._count[fifo] - 1
        if not left:
            self._nonempty &= ~(1 << fifo)
        self._size -= 1
        return fifo

    def remove_many(self, blocks: list[BlockId], stamps: bytearray | None = None
                    ) -> list[int]:
        """`remove` of each of `blocks` (a match's claims), in one call: their FIFOs, in
        order; with `stamps`, `stamps[b]` is set to block b's stamp."""
        where, count = self._where, self._count
        fifos: list[int] = []
        emptied = 0
        for b in blocks:
            run = where[b]
            assert run is not None and run[_LIVE], "block not in the free queue"
            where[b] = None
            run[_LIVE] -= 1
            fifo = run[_FIFO]
            fifos.append(fifo)
            if stamps is not None:
                stamps[b] = run[_STAMP]
            left = count[fifo] = count[fifo] - 1
            if not left:
                emptied |= 1 << fifo
        self._nonempty &= ~emptied
        self._size -= len(blocks)
        return fifos

    def pop_upto(self, fifo: int, n: int, max_stamp: int, min_stamp: int = 0,
                 keys: list | None = None) -> list[BlockId]:
        """Up to `n` blocks from the front of FIFO `fifo` while their stamps stay within
        `[min_stamp, max_stamp]`, in order (`last_stamp`: the last one's stamp). With `keys`,
        their keys are appended to it in the same order (their runs must carry keys)."""
        out: list[BlockId] = []
        self._take(fifo, n, min_stamp, max_stamp, out, None, keys)
        return out

    def pop_runs(self, fifo: int, n: int, max_stamp: int, min_stamp: int = 0
                 ) -> list[tuple[list[BlockId], int]]:
        """`pop_upto` as pieces `(blocks, stamp)`, one per run taken from."""
        pieces: list[tuple[list[BlockId], int]] = []
        self._take(fifo, n, min_stamp, max_stamp, None, pieces, None)
        return pieces

    def move_upto(self, src: int, dst: int, n: int, stamp: int, max_stamp: int,
                  min_stamp: int = 0) -> int:
        """`pop_upto(src, n, max_stamp, min_stamp)` appended in order to FIFO `dst` (not
        `src`) stamped `stamp`; returns how many blocks moved. Whole runs move as they are,
        keys and holes with them (no per-block work: their blocks still name them); only a
        run taken in part is split."""
        assert src != dst
        runs, to = self._runs[src], self._runs[dst]
        moved = held = 0
        while n and runs:
            run = runs[0]
            live = run[_LIVE]
            if live and (live > n or not min_stamp <= run[_STAMP] <= max_stamp):
                break
            runs.popleft()
            entries = len(run[_BLOCKS]) - run[_START]
            held += entries
            if live:  # a dead run (every block claimed) is dropped
                run[_STAMP] = stamp
                run[_FIFO] = dst
                to.append(run)
                self._held[dst] += entries
                moved += live
                n -= live
        self._held[src] -= held
        if moved:
            self._count[dst] += moved
            self._nonempty |= 1 << dst
            left = self._count[src] = self._count[src] - moved
            if not left:
                self._nonempty &= ~(1 << src)
        if n and runs and min_stamp <= runs[0][_STAMP] <= max_stamp:  # a run in part
            keys = None if runs[0][_KEYS] is None else []
            taken = self.pop_upto(src, n, max_stamp, min_stamp, keys)
            self.push_run(taken, dst, stamp, keys)
            moved += len(taken)
        elif self._held[dst] > 2 * self._count[dst] + _SLACK:
            self._compact(dst)
        return moved

    def head_stamps(self, fifos: list[int]) -> list[int]:
        """The stamp of the first queued block of each of `fifos` (each must hold one)."""
        out = []
        for q in fifos:
            runs = self._runs[q]
            while not runs[0][_LIVE]:
                self._held[q] -= len(runs[0][_BLOCKS]) - runs[0][_START]
                runs.popleft()
            out.append(runs[0][_STAMP])
        return out

    def nonempty_mask(self) -> int:
        """Bit q set: FIFO q holds a block."""
        return self._nonempty

    def lowest_fifo(self, mask: int = -1) -> int:
        """The lowest non-empty FIFO among those set in `mask`, or -1 if none."""
        m = self._nonempty & mask
        return (m & -m).bit_length() - 1

    def fifo_of(self, block: BlockId) -> int:
        """The FIFO holding `block`, -1 if it is not queued."""
        run = self._where[block]
        return -1 if run is None or not run[_LIVE] else run[_FIFO]

    def stamp_of(self, block: BlockId) -> int:
        """The stamp of queued `block`'s run."""
        return self._where[block][_STAMP]

    def fifo_order(self, fifo: int) -> list[BlockId]:
        """The blocks of FIFO `fifo`, head first (tests and debugging; O(n))."""
        where = self._where
        return [BlockId(b) for run in self._runs[fifo] for b in run[_BLOCKS][run[_START]:]
                if where[b] is run]

    def _take(self, fifo: int, n: int, lo: int, hi: int, out: list | None,
              pieces: list | None, keys_out: list | None) -> None:
        runs, where = self._runs[fifo], self._where
        held = k = 0
        while n and runs:
            run = runs[0]
            blocks, start, stamp, _, live, keys = run
            if not live:  # every block left by a claim
                runs.popleft()
                held += len(blocks) - start
                continue
            if stamp > hi or stamp < lo:
                break
            end = len(blocks)
            if live == end - start:  # no holes: a slice
                stop = start + n if n < live else end
                taken = blocks[start:stop] if start or stop < end else blocks
                live -= len(taken)
                if keys_out is not None:
                    keys_out += keys[start:stop]
            else:
                taken = []
                i = start
                while i < end and len(taken) < n:
                    b = blocks[i]
                    if where[b] is run:
                        taken.append(b)
                        if keys_out is not None:
                            keys_out.append(keys[i])
                    i += 1
                stop = i
                live -= len(taken)
                if not live:  # only holes after it
                    stop = end
            held += stop - start
            if stop == end:  # taken whole: its blocks still name it, a run with none live
                runs.popleft()
                run[_LIVE] = 0
            else:
                run[_START] = stop
                run[_LIVE] = live
                for b in taken:
                    where[b] = None
            if pieces is None:
                out += taken
            else:
                pieces.append((taken, stamp))
            n -= len(taken)
            k += len(taken)
            self.last_stamp = stamp
        self._held[fifo] -= held
        left = self._count[fifo] = self._count[fifo] - k
        if not left:
            self._nonempty &= ~(1 << fifo)
        self._size -= k

    def _compact(self, fifo: int) -> None:
        """Drop FIFO `fifo`'s dead runs and the taken or claimed entries of the others."""
        where = self._where
        runs = deque()
        for run in self._runs[fifo]:
            if not run[_LIVE]:
                continue
            blocks, start, keys = run[_BLOCKS], run[_START], run[_KEYS]
            if run[_LIVE] < len(blocks) - start:
                live = [i for i in range(start, len(blocks)) if where[blocks[i]] is run]
                run[_BLOCKS] = [blocks[i] for i in live]
                if keys is not None:
                    run[_KEYS] = [keys[i] for i in live]
                run[_START] = 0
            runs.append(run)
        self._runs[fifo] = runs
        self._held[fifo] = self._count[fifo]

    def _check_sanity(self, key_of=None, keyed: int = 0) -> bool:
        """With `key_of`, a run's keys are its queued blocks' `key_of(block)`; the runs that
        hold blocks in the FIFOs set in the mask `keyed` carry keys."""
        queued = 0
        for q, runs in enumerate(self._runs):
            live = held = 0
            for run in runs:
                blocks, start, _, fifo, n, keys = run
                assert fifo == q and 0 <= start <= len(blocks)
                assert keys is not None or not n or not keyed >> q & 1, "a run without keys"
                if keys is not None:
                    assert len(keys) == len(blocks)
                    assert key_of is None or all(
                        keys[i] == key_of(blocks[i]) for i in range(start, len(blocks))
                        if self._where[blocks[i]] is run), "a run's keys are not its blocks'"
                assert n == sum(self._where[b] is run for b in blocks[start:])
                live += n
                held += len(blocks) - start
            assert live == self._count[q] and held == self._held[q]
            assert bool(self._nonempty >> q & 1) == (live > 0)
            queued += live
        assert queued == self._size == sum(r is not None and r[_LIVE] > 0 for r in self._where)
        for b, run in enumerate(self._where):
            assert run is None or not run[_LIVE] or b in run[_BLOCKS][run[_START]:]
        return True
