"""FreeQueue: exact eviction order (lowest priority level first, LRU inside a level)."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cache.free_queue import NUM_PRIORITY_LEVELS, FreeQueue


def test_empty_queue():
    q = FreeQueue(4)
    assert len(q) == 0
    assert q.front() is None
    assert q.pop_front() is None
    assert q.pop_front_many(3) == []
    assert q.order() == []
    assert all(b not in q for b in range(4))


def test_lru_within_one_level():
    q = FreeQueue(8)
    for b in (5, 2, 7):
        q.push_back(b, 35)
    assert q.order() == [5, 2, 7]
    assert q.front() == 5
    q.remove(2)
    assert q.order() == [5, 7]
    q.push_back(2, 35)  # touched again: most recently used
    assert q.order() == [5, 7, 2]
    assert [q.pop_front(), q.pop_front(), q.pop_front(), q.pop_front()] == [5, 7, 2, None]
    assert len(q) == 0


def test_lowest_level_first_regardless_of_recency():
    q = FreeQueue(8)
    q.push_back(0, 50)
    q.push_back(1, 10)
    q.push_back(2, 100)
    q.push_back(3, 0)
    q.push_back(4, 10)
    assert q.order() == [3, 1, 4, 0, 2]
    assert q.front() == 3
    assert q.pop_front_many(3) == [3, 1, 4]
    assert q.order() == [0, 2]
    assert len(q) == 2
    assert 3 not in q and 0 in q


def test_push_back_many_is_push_back_in_order():
    q = FreeQueue(10)
    q.push_back(9, 35)
    q.push_back_many([3, 1, 4], 35)
    q.push_back_many([], 35)
    q.push_back_many([0, 5], 20)
    assert q.order() == [0, 5, 9, 3, 1, 4]
    assert len(q) == 6
    q.remove(1)
    q.remove(0)
    assert q.order() == [5, 9, 3, 4]


def test_pop_front_many_spans_levels_and_leaves_queue_consistent():
    q = FreeQueue(10)
    q.push_back_many([1, 2], 5)
    q.push_back_many([3, 4], 7)
    q.push_back_many([5, 6], 9)
    assert q.pop_front_many(3) == [1, 2, 3]
    assert q.order() == [4, 5, 6]
    assert q.front() == 4
    # The level emptied by the pop can be refilled; a partly popped level keeps its order.
    q.push_back(1, 5)
    q.push_back(2, 7)
    assert q.order() == [1, 4, 2, 5, 6]
    assert q.pop_front_many(10) == [1, 4, 2, 5, 6]
    assert len(q) == 0 and q.front() is None
    q.push_back(6, 0)
    assert q.order() == [6]


def test_remove_last_of_level_moves_front_to_next_level():
    q = FreeQueue(4)
    q.push_back(0, 1)
    q.push_back(1, 2)
    q.remove(0)
    assert q.front() == 1
    q.remove(1)
    assert q.front() is None
    assert len(q) == 0


def test_extreme_levels():
    q = FreeQueue(3)
    q.push_back(0, NUM_PRIORITY_LEVELS - 1)
    q.push_back(1, 0)
    assert q.order() == [1, 0]
    assert q.pop_front() == 1
    assert q.pop_front() == 0


def test_double_push_and_missing_remove_are_errors():
    q = FreeQueue(3)
    q.push_back(1, 3)
    with pytest.raises(AssertionError):
        q.push_back(1, 3)
    with pytest.raises(AssertionError):
        q.remove(0)
    # A run is not checked block by block (the hottest loop): the sanity check catches it.
    q.push_back_many([2, 1], 4)
    with pytest.raises(AssertionError):
        q._check_sanity()


# --- against a list model -------------------------------------------------------------------

CAP = 8
LEVELS = [0, 1, 35, 100]

ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.integers(0, CAP - 1), st.sampled_from(LEVELS)),
        st.tuples(
            st.just("push_many"),
            st.lists(st.integers(0, CAP - 1), max_size=4, unique=True),
            st.sampled_from(LEVELS),
        ),
        st.tuples(st.just("remove"), st.integers(0, CAP - 1)),
        st.tuples(st.just("remove_many"), st.lists(st.integers(0, CAP - 1), max_size=6,
                                                   unique=True)),
        st.tuples(st.just("pop"),),
        st.tuples(st.just("pop_many"), st.integers(0, 5)),
    ),
    max_size=40,
)


class ListModel:
    """(level, stamp, block) entries; the victim is the smallest (level, stamp)."""

    def __init__(self):
        self.entries: dict[int, tuple[int, int]] = {}
        self.clock = 0

    def push(self, b, level):
        self.clock += 1
        self.entries[b] = (level, self.clock)

    def order(self):
        return sorted(self.entries, key=lambda b: self.entries[b])

    def pop(self):
        order = self.order()
        if not order:
            return None
        del self.entries[order[0]]
        return order[0]


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_matches_list_model(operations):
    q = FreeQueue(CAP)
    m = ListModel()
    for op in operations:
        kind = op[0]
        if kind == "push":
            _, b, level = op
            if b in m.entries:
                continue
            q.push_back(b, level)
            m.push(b, level)
        elif kind == "push_many":
            _, blocks, level = op
            blocks = [b for b in blocks if b not in m.entries]
            q.push_back_many(blocks, level)
            for b in blocks:
                m.push(b, level)
        elif kind == "remove":
            _, b = op
            if b not in m.entries:
                continue
            q.remove(b)
            del m.entries[b]
        elif kind == "remove_many":  # a match's claims: the queued ones, in the drawn order
            blocks = [b for b in op[1] if b in m.entries]
            q.remove_many(blocks)
            for b in blocks:
                del m.entries[b]
        elif kind == "pop":
            expect = m.order()[0] if m.entries else None
            assert q.front() == expect
            assert q.pop_front() == m.pop()
        else:
            _, n = op
            expect = [m.pop() for _ in range(min(n, len(m.entries)))]
            assert q.pop_front_many(n) == expect
        assert q.order() == m.order()
        assert len(q) == len(m.entries)
        assert q.front() == (m.order()[0] if m.entries else None)
        for b in range(CAP):
            assert (b in q) == (b in m.entries)
