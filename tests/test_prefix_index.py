"""PrefixIndex with partial reuse on random operation sequences: the children it finds for every
(parent key, first token) equal a scan of the stored blocks, in store order, whether a child is
filed in the children map or found through its parent's holder, and a rebuilt map finds the
same."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbench.cache.radix import PrefixIndex
from kvbench.traffic.request import Request
from strategies import related_prompts

ID_SPACE = 10


def _request(i: int, tokens: list[int]) -> Request:
    toks = np.array(tokens, dtype=np.int64)
    return Request(i, 0.0, len(toks), 1, tokens=toks)


class Scan:
    """What the index should hold: block -> (key, parent key, first token, store count)."""

    def __init__(self) -> None:
        self.blocks: dict[int, tuple] = {}
        self.stores = 0

    def store(self, b: int, key, parent, first: int) -> None:
        self.blocks[b] = (key, parent, first, self.stores)
        self.stores += 1

    def kids(self, parent, first) -> list[int]:
        found = [(rec[3], b) for b, rec in self.blocks.items()
                 if rec[1] == parent and rec[2] == first]
        return [b for _, b in sorted(found)]

    def has_children(self, b: int) -> bool:
        key = self.blocks[b][0]
        return key is not None and any(rec[1] == key for rec in self.blocks.values())


def _agree(index: PrefixIndex, scan: Scan) -> None:
    assert index._check_sanity()
    assert {b for b in range(ID_SPACE) if index.is_stored(b)} == set(scan.blocks)
    nodes = {(rec[1], rec[2]) for rec in scan.blocks.values()}
    nodes |= {(rec[0], f) for rec in scan.blocks.values() for f in range(4)}
    for parent, first in nodes:
        assert index._kids_of(parent, first) == scan.kids(parent, first), (parent, first)
    for b in scan.blocks:
        assert index.has_children(b) == scan.has_children(b), b


@st.composite
def operations(draw):
    prompts = draw(related_prompts(max_requests=6, max_len=10))
    tpb = draw(st.integers(1, 3))
    ops = draw(st.lists(st.tuples(st.sampled_from(["store", "store", "store", "remove", "move",
                                                   "rebuild"]),
                                  st.integers(0, len(prompts) - 1), st.integers(0, 1 << 16)),
                        min_size=1, max_size=30))
    return prompts, tpb, ops


@settings(max_examples=300, deadline=None,
          suppress_health_check=[HealthCheck.too_slow])
@given(operations())
def test_children_equal_a_scan_after_random_operations(case):
    prompts, tpb, ops = case
    requests = [_request(i, p) for i, p in enumerate(prompts)]
    index = PrefixIndex(tpb, ID_SPACE, track_children=True)
    scan = Scan()
    for op, which, seed in ops:
        rng = np.random.default_rng(seed)
        free = [b for b in range(ID_SPACE) if b not in scan.blocks]
        stored = sorted(scan.blocks)
        if op == "store":
            r = requests[which]
            keys = r.block_keys(tpb)
            firsts = r.first_tokens(tpb)
            positions = len(firsts)
            if not positions or not free:
                continue
            # A sequence's blocks: held ones before `begin` (or private copies), fresh ones
            # from there on; its run of full blocks, then maybe its unfilled tail.
            begin = int(rng.integers(0, positions))
            fresh = [int(b) for b in rng.permutation(free)]
            blocks = [index.by_key.get(keys[i], -1) if i < len(keys) else -1
                      for i in range(begin)]
            blocks += fresh[:positions - begin]
            end = min(len(keys), len(blocks))
            parent = keys[begin - 1] if begin else r.root_key
            if begin < end:
                index.insert_full(blocks, keys, begin, end, parent, r)
                p = parent
                for i in range(begin, end):
                    if all(rec[0] != keys[i] for rec in scan.blocks.values()):
                        scan.store(blocks[i], keys[i], p, firsts[i])
                    p = keys[i]
            tail = len(keys)
            if r.input_length % tpb and tail < len(blocks) and (begin <= tail) \
                    and blocks[tail] not in scan.blocks and rng.integers(0, 2):
                parent = keys[tail - 1] if tail else r.root_key
                index.insert_partial(blocks[tail], parent, r, tail, r.input_length % tpb)
                scan.store(blocks[tail], None, parent, firsts[tail])
        elif op == "remove" and stored:
            gone = [int(b) for b in rng.permutation(stored)[:int(rng.integers(1, len(stored) + 1))]]
            if len(gone) == 1 and rng.integers(0, 2):
                index.remove(gone[0])
            else:
                index.remove_many(gone)
            for b in gone:
                del scan.blocks[b]
        elif op == "move" and stored and free:
            k = int(rng.integers(1, min(len(stored), len(free)) + 1))
            srcs = [int(b) for b in rng.permutation(stored)[:k]]
            dsts = [int(b) for b in rng.permutation(free)[:k]]
            index.move_many(srcs, dsts)
            for src, dst in zip(srcs, dsts):
                key, parent, first, _ = scan.blocks.pop(src)
                scan.store(dst, key, parent, first)
        elif op == "rebuild":
            index._rebuild_kids()
        _agree(index, scan)
    index._rebuild_kids()
    _agree(index, scan)
