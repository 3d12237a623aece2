"""RunQueue (the class policies' FIFOs): the same blocks in the same order as a list per FIFO,
claims from the middle of runs, runs moved between FIFOs, keys handed back with victims,
compaction, and its invariants after every operation."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cache.policies import run_queue
from kvbench.cache.policies.run_queue import RunQueue

CAP = 12
FIFOS = 3

ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.lists(st.integers(0, CAP - 1), max_size=5, unique=True),
                  st.integers(0, FIFOS - 1), st.integers(0, 2), st.booleans()),
        st.tuples(st.just("remove"), st.integers(0, 99)),  # the i-th queued block, cyclically
        st.tuples(st.just("remove_many"), st.lists(st.integers(0, 99), max_size=5)),
        st.tuples(st.just("pop"), st.integers(0, FIFOS - 1), st.integers(0, 6),
                  st.integers(0, 4), st.integers(0, 12), st.booleans()),
        st.tuples(st.just("move"), st.integers(0, FIFOS - 1), st.integers(1, FIFOS - 1),
                  st.integers(0, 8), st.integers(0, 4), st.integers(0, 12), st.integers(0, 4)),
    ),
    min_size=20,
    max_size=60,
)


@pytest.mark.parametrize("slack", [run_queue._SLACK, 0])
def test_matches_a_list_per_fifo(slack, monkeypatch):
    """Slack 0 compacts a FIFO as soon as it holds more entries than twice its blocks."""
    monkeypatch.setattr(run_queue, "_SLACK", slack)

    @settings(max_examples=200, deadline=None,
              suppress_health_check=[HealthCheck.too_slow])
    @given(ops)
    def check(operations):
        q = RunQueue(CAP, FIFOS)
        # (block, stamp, key): a run pushed with keys gives each block the key
        # 100 * pushes + block (None without), what `pop_upto` must hand back with it.
        model: list[list[tuple[int, int, int | None]]] = [[] for _ in range(FIFOS)]
        clock = [0] * FIFOS
        pushes = 0
        key_of = {}
        for op in operations:
            queued = {b for fifo in model for b, _, _ in fifo}
            if op[0] == "push":
                _, blocks, fifo, step, keyed = op
                blocks = [b for b in blocks if b not in queued]
                clock[fifo] += step
                pushes += 1
                keys = [100 * pushes + b for b in blocks] if keyed else None
                q.push_run(list(blocks), fifo, clock[fifo] % 5,  # stamps in any order
                           None if keys is None else list(keys))
                model[fifo] += [(b, clock[fifo] % 5, k)
                                for b, k in zip(blocks, keys or [None] * len(blocks))]
                key_of.update(zip(blocks, keys or []))
            elif op[0] == "remove":
                if not queued:
                    continue
                b = sorted(queued)[op[1] % len(queued)]
                fifo = next(f for f in range(FIFOS) if any(x == b for x, _, _ in model[f]))
                assert q.remove(b) == fifo
                model[fifo] = [e for e in model[fifo] if e[0] != b]
            elif op[0] == "remove_many":  # a match's claims: their FIFOs, stamps written
                blocks = list(dict.fromkeys(sorted(queued)[i % len(queued)] for i in op[1]
                                            if queued))
                entry = {e[0]: (f, e[1]) for f in range(FIFOS) for e in model[f]}
                stamps = bytearray(CAP)
                assert q.remove_many(blocks, stamps) == [entry[b][0] for b in blocks]
                assert [stamps[b] for b in blocks] == [entry[b][1] for b in blocks]
                for f in range(FIFOS):
                    model[f] = [e for e in model[f] if e[0] not in blocks]
            elif op[0] == "move":  # to another FIFO, restamped, keys kept
                _, src, shift, n, low, high, stamp = op
                dst = (src + shift) % FIFOS
                want = []
                while model[src] and len(want) < n and low <= model[src][0][1] <= high:
                    want.append(model[src].pop(0))
                assert q.move_upto(src, dst, n, stamp, high, low) == len(want)
                model[dst] += [(b, stamp, k) for b, _, k in want]
            else:
                _, fifo, n, low, high, pieces = op
                want = []
                while model[fifo] and len(want) < n and low <= model[fifo][0][1] <= high:
                    want.append(model[fifo].pop(0))
                if pieces:  # one per run: the blocks and their stamp
                    got = [(b, stamp) for run, stamp in q.pop_runs(fifo, n, high, low)
                           for b in run]
                    assert got == [(b, stamp) for b, stamp, _ in want]
                elif all(k is not None for _, _, k in want):  # their keys with them
                    keys = ["before"]
                    assert q.pop_upto(fifo, n, high, low, keys) == [b for b, _, _ in want]
                    assert keys == ["before"] + [k for _, _, k in want]
                else:
                    assert q.pop_upto(fifo, n, high, low) == [b for b, _, _ in want]
                if want and not pieces:
                    assert q.last_stamp == want[-1][1]
            keyed_fifos = sum(1 << f for f in range(FIFOS)
                              if all(k is not None for _, _, k in model[f]))
            assert q._check_sanity(key_of.get, keyed_fifos)
            assert len(q) == sum(map(len, model))
            busy = [f for f in range(FIFOS) if model[f]]
            assert q.lowest_fifo() == (busy[0] if busy else -1)
            assert q.lowest_fifo(0b110) == next((f for f in busy if f), -1)
            for fifo in range(FIFOS):
                assert q.fifo_order(fifo) == [b for b, _, _ in model[fifo]]
                assert bool(q.nonempty_mask() >> fifo & 1) == bool(model[fifo])
                if model[fifo]:
                    assert q.head_stamps([fifo]) == [model[fifo][0][1]]
            for b in range(CAP):
                where = [f for f in range(FIFOS) if any(x == b for x, _, _ in model[f])]
                assert q.fifo_of(b) == (where[0] if where else -1)
                assert (b in q) == bool(where)

    check()


def test_a_claimed_block_queued_again_is_skipped_in_its_old_run():
    q = RunQueue(8, 2)
    q.push_run([5, 3, 1, 7], 0, 10)
    q.remove(3)
    q.push_run([3], 0, 11)  # the same FIFO, a newer run
    assert q.fifo_order(0) == [5, 1, 7, 3]
    assert q.pop_upto(0, 2, 10) == [5, 1]
    assert q.pop_upto(0, 9, 10) == [7]  # 3 is stamped 11
    assert q.pop_upto(0, 9, 11) == [3] and q.last_stamp == 11
    assert len(q) == 0 and q.nonempty_mask() == 0 and q._check_sanity()
    with pytest.raises(AssertionError):
        q.remove(3)


def test_move_skips_a_dead_run_whatever_its_stamp():
    """As `pop_upto`: a run whose blocks were all claimed is dropped, not a stamp bound."""
    q = RunQueue(8, 2)
    q.push_run([1, 2], 0, 9, [11, 12])
    q.remove(1)
    q.remove(2)
    q.push_run([3, 4, 5], 0, 0, [13, 14, 15])
    assert q.move_upto(0, 1, 2, 7, 0) == 2  # the dead run, then [3, 4] split off
    assert q.fifo_order(0) == [5] and q.fifo_order(1) == [3, 4]
    keys = []
    assert q.pop_upto(1, 9, 7, 7, keys) == [3, 4] and keys == [13, 14]
    assert q.move_upto(0, 1, 9, 3, 0) == 1 and q.head_stamps([1]) == [3]
    assert len(q) == 1 and q._check_sanity(lambda b: b + 10, 0b11)
