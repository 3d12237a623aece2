"""Prefix index: which block holds the data of which prefix.

Keys are chained (a key identifies its whole prefix), so a map `key -> block` is the radix
tree's edge table: the child of node `k` along block `t` is the entry for `key(k, t)`. Matching a
prompt walks its keys from the root and stops at the first miss. A block whose parent was
evicted stays indexed: it cannot be reached until the parent's prefix is stored again, and then
its data is valid again (the key chains the prefix), so dropping it would only lose reuse.

Partial reuse needs the children of a node with a given first token: a partial match needs at
least its first token equal, so only those are compared token by token, and a node shared by
thousands of conversations (a system prompt) costs one lookup, not a scan of its children.
Most children are the next block of the sequence that stored their parent, so they are not
filed anywhere: a stored block's record names the block after it in that sequence (`_NEXT`),
and a node's children are its key's holder's next block, while that one is stored below the
node, plus the blocks filed in `kids`. `kids` files the rest: the first block of each stored
run (its parent came from another sequence or an earlier run), a block after a key another
block held, a moved block, and an orphan (a block still stored when its parent's holder is
removed: the next holder names another block). Invariant: every stored block is its parent
key's holder's next block or is filed in `kids` under its parent and first token.
`kids[parent_key]` is one block id (a node with one filed child) or a dict `first_token ->
block id | [block ids]`. Entries are removed lazily: a reader takes an entry only while its block
is still stored there (`_is_kid`), and the map is rebuilt from the stored blocks when stale
entries pile up, so its size stays O(blocks). Equally long partial matches are taken in the
order their blocks were stored (`_order`), however they were found.
Filing every stored block cost more than the rest of the replay: millions of stores into a map
several times the cache's size (cache misses) and a check of each stale entry they met.
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import repeat
from typing import TYPE_CHECKING

import numpy as np

from .ids import BlockId, BlockKey

if TYPE_CHECKING:
    from ..traffic.request import Request

# Stale entries may reach this many times the block count before a rebuild: rebuilding costs
# one pass over the blocks, so it runs about once per this many rounds of the whole cache.
_REBUILD_FACTOR = 8

# Fields of a stored block's record; `_NEXT` and `_STAMP` only with partial reuse.
_KEY, _PARENT, _NTOK, _SOURCE, _POSITION, _NEXT, _STAMP = range(7)
_Record = tuple
"""(key | None, parent key, tokens held, source request, position[, next block, stamp]).
`next block`: the block after it in the sequence that stored it (NO_NEXT: none), its child
while stored below its key. `stamp`: the store that stored it (one for a run of blocks, which
`position` orders), so (stamp, position) orders the stores. The first token is not kept: it is
read from the source when a block is filed or compared, which few are."""

NO_NEXT = BlockId(-1)
"""`_NEXT` of a block no block follows (a partial block, the end of a sequence)."""

_ByFirst = dict[int, "BlockId | list[BlockId]"]
_Kids = dict[BlockKey, "BlockId | _ByFirst"]


class PrefixIndex:
    """Keys and token sources of the stored blocks of one life cycle (all tiers).

    What a stored block holds is one immutable record, `stored[b] = (key, parent key, tokens,
    source request, position)` (key None for a partial block; the record None for a block that
    stores nothing; with `track_children` two more fields, `_NEXT` and `_STAMP`). One record
    rather than an array per field: a store is one tuple, and an offload or onboard (millions
    in a replay with a host tier) moves the record to the new block instead of copying its
    fields. Records hold few distinct objects: creating and freeing one per stored block
    touches each of them."""

    __slots__ = ("tpb", "by_key", "kids", "stored", "_rebuild_at", "_stamp")

    def __init__(self, tokens_per_block: int, id_space: int, track_children: bool) -> None:
        self.tpb = tokens_per_block
        self.by_key: dict[BlockKey, BlockId] = {}
        self.kids: _Kids | None = {} if track_children else None
        self._rebuild_at = _REBUILD_FACTOR * id_space + 1024
        self.stored: list[_Record | None] = [None] * (id_space + 1)
        """Indexed by block id; the extra last entry stays None, so `stored[NO_NEXT]` (and
        `stored[NO_BLOCK]`: both -1) reads as a block that stores nothing."""
        self._stamp = 0
        """Stores so far (the next store's `_STAMP`)."""

    # --- public API -----------------------------------------------------------------------

    def is_stored(self, block: BlockId) -> bool:
        return self.stored[block] is not None

    def key_of(self, block: BlockId) -> BlockKey | None:
        rec = self.stored[block]
        return rec[_KEY] if rec is not None else None

    def num_tokens(self, block: BlockId) -> int:
        """Tokens a stored block holds (tokens_per_block unless partial)."""
        return self.stored[block][_NTOK]

    def walk(self, keys: list[BlockKey], end: int, begin: int = 0) -> list[BlockId]:
        """Blocks of the longest stored run of `keys[begin:end]` from `begin`."""
        get = self.by_key.get
        out: list[BlockId] = []
        for i in range(begin, end):
            b = get(keys[i])
            if b is None:
                break
            out.append(b)
        return out

    def best_partial(
        self, parent_key: BlockKey, request: Request, position: int, limit: int,
        prefer: Callable[[BlockId], bool] | None = None,
    ) -> tuple[BlockId, int] | None:
        """The stored child of `parent_key` sharing the most leading tokens (at most `limit`)
        with the request's block at `position`; among equally long matches, the first one
        `prefer` accepts (the cache prefers a block it can take without a copy), else the
        first."""
        assert self.kids is not None, "partial matching needs track_children"
        if limit <= 0:
            return None
        candidates = self._kids_of(parent_key, request.first_token(self.tpb, position))
        if not candidates:
            return None
        tpb = self.tpb
        start = position * tpb
        ours = request.prompt_tokens(start, start + limit)
        best: tuple[BlockId, int] | None = None
        best_ok = False
        for b in candidates:
            rec = self.stored[b]
            held, src_req, src_pos = rec[_NTOK], rec[_SOURCE], rec[_POSITION]
            n = min(limit, held)
            theirs = src_req.prompt_tokens(src_pos * tpb, src_pos * tpb + n)
            diff = np.flatnonzero(ours[:n] != theirs)
            common = int(diff[0]) if len(diff) else n
            if best is None or common > best[1]:
                best, best_ok = (b, common), prefer is None or prefer(b)
            elif common == best[1] and not best_ok and prefer(b):
                best, best_ok = (b, common), True
            if best[1] == limit and best_ok:
                break
        return best

    def has_children(self, block: BlockId) -> bool:
        rec = self.stored[block]
        if rec is None or self.kids is None or rec[_KEY] is None:
            return False
        key = rec[_KEY]
        if self._is_kid(rec[_NEXT], key):
            return True
        entry = self.kids.get(key)
        if entry is None:
            return False
        if not isinstance(entry, dict):
            return self._is_kid(entry, key)
        return any(self._is_kid(b, key) for found in entry.values()
                   for b in (found if isinstance(found, list) else (found,)))

    def insert_full(
        self, blocks: list[BlockId], keys: list[BlockKey], begin: int, end: int,
        parent_key: BlockKey, request: Request,
    ) -> None:
        """Store `blocks[i]` under `keys[i]` for i in [begin, end), a chain below `parent_key`.
        A key already held by another block is skipped: that duplicate stays private to its
        sequence and is dropped when released."""
        by_key, stored, tpb, kids = self.by_key, self.stored, self.tpb, self.kids
        run_keys = keys[begin:end]
        run_blocks = blocks[begin:end]
        tracked = ()
        if kids is not None:
            # The block after the run, if any, is its last block's next (NO_BLOCK reads as
            # none).
            nexts = blocks[begin + 1:end + 1]
            if len(nexts) < end - begin:
                nexts.append(NO_NEXT)
            tracked = (nexts, repeat(self._stamp))
            self._stamp += 1
        # zip builds the records in C: a chain's parents are its keys shifted by one.
        records = zip(run_keys, [parent_key, *run_keys[:-1]], repeat(tpb), repeat(request),
                      range(begin, end), *tracked)
        fresh = by_key.keys().isdisjoint(run_keys)
        if fresh:  # the usual case: only the stores into `stored` loop in Python
            by_key.update(zip(run_keys, run_blocks))
            for b, rec in zip(run_blocks, records):
                stored[b] = rec
        else:
            for key, b, rec in zip(run_keys, run_blocks, records):
                if key not in by_key:
                    by_key[key] = b
                    stored[b] = rec
        if kids is None:
            return
        # Filed in `kids`: each stored block its parent's holder does not name. Only the
        # first one, unless a key was held by another block (then the one after it too).
        for i in (begin,) if fresh else range(begin, end):
            b = blocks[i]
            parent = keys[i - 1] if i > begin else parent_key
            if by_key[keys[i]] == b and self._next_of(parent) != b:
                self._add_kid(parent, request.first_token(tpb, i), b)
        if len(kids) > self._rebuild_at:
            self._rebuild_kids()

    def insert_partial(
        self, block: BlockId, parent_key: BlockKey, request: Request, position: int, num_tokens: int
    ) -> None:
        """Store an unfilled block (no key) for partial matching."""
        assert self.kids is not None
        self.stored[block] = (None, parent_key, num_tokens, request, position, NO_NEXT,
                              self._stamp)
        self._stamp += 1
        if self._next_of(parent_key) != block:
            self._add_kid(parent_key, request.first_token(self.tpb, position), block)
        if len(self.kids) > self._rebuild_at:
            self._rebuild_kids()

    def remove(self, block: BlockId) -> None:
        self._drop((block,))

    def remove_many(self, blocks: list[BlockId]) -> None:
        self._drop(blocks)

    def move(self, src: BlockId, dst: BlockId) -> None:
        """The data of `src` now lives in `dst` (an offload or an onboard): same key, parent,
        tokens and source; `src` is no longer stored."""
        self.move_many([src], [dst])

    def move_many(self, srcs: list[BlockId], dsts: list[BlockId]) -> None:
        """`move` for pairs of blocks; an offload moves one per evicted block."""
        by_key, stored, kids = self.by_key, self.stored, self.kids
        for src, dst in zip(srcs, dsts):
            rec = stored[src]
            if kids is not None:  # stored again: the newest of its node's partial matches
                rec = rec[:_STAMP] + (self._stamp,)
                self._stamp += 1
            stored[dst] = rec
            stored[src] = None
            key = rec[_KEY]
            if key is not None:
                by_key[key] = dst  # its children still follow its `_NEXT`
            if kids is not None and self._next_of(rec[_PARENT]) != dst:
                self._add_kid(rec[_PARENT], self._first_of(dst), dst)
        if kids is not None and len(self.kids) > self._rebuild_at:
            self._rebuild_kids()

    # --- helpers --------------------------------------------------------------------------

    def _drop(self, blocks: list[BlockId]) -> None:
        """`remove_many` (one body for `remove` too)."""
        by_key, stored = self.by_key, self.stored
        if self.kids is None:
            for b in blocks:
                key = stored[b][_KEY]
                if key is not None:
                    del by_key[key]
                stored[b] = None
            return
        for b in blocks:
            rec = stored[b]
            stored[b] = None  # any `kids` entry for it is now stale
            key = rec[0]  # _KEY (literal indices: this loop runs per evicted block)
            if key is not None:
                del by_key[key]
                if stored[rec[5]] is not None:  # _NEXT: seldom still stored
                    self._file_orphan(rec)

    def _file_orphan(self, rec: _Record) -> None:
        """A dropped block's next block, if still stored below it, was found through it:
        an orphan now, filed."""
        if self._is_kid(rec[_NEXT], rec[_KEY]):
            self._add_kid(rec[_KEY], self._first_of(rec[_NEXT]), rec[_NEXT])

    def _is_kid(self, block: BlockId, parent_key: BlockKey) -> bool:
        rec = self.stored[block]
        return rec is not None and rec[_PARENT] == parent_key

    def _next_of(self, parent_key: BlockKey) -> BlockId:
        """The `_NEXT` of the block holding `parent_key` (NO_NEXT when none holds it)."""
        holder = self.by_key.get(parent_key)
        return NO_NEXT if holder is None else self.stored[holder][_NEXT]

    def _first_of(self, block: BlockId) -> int:
        rec = self.stored[block]
        return rec[_SOURCE].first_token(self.tpb, rec[_POSITION])

    def _order(self, block: BlockId) -> tuple[int, int]:
        """When a stored block was stored: (the store's stamp, its position in the run)."""
        rec = self.stored[block]
        return rec[_STAMP], rec[_POSITION]

    def _kids_of(self, parent_key: BlockKey, first: int) -> list[BlockId]:
        """The stored children of `parent_key` with first token `first`, oldest store first."""
        out: list[BlockId] = []
        entry = self.kids.get(parent_key)
        if entry is not None:
            found = entry.get(first) if isinstance(entry, dict) else entry
            if found is not None:
                out = [b for b in (found if isinstance(found, list) else (found,))
                       if self._is_kid(b, parent_key) and self._first_of(b) == first]
        nxt = self._next_of(parent_key)
        if self._is_kid(nxt, parent_key) and nxt not in out and self._first_of(nxt) == first:
            out.append(nxt)
        if len(out) > 1:
            out.sort(key=self._order)
        return out

    def _add_kid(self, parent_key: BlockKey, first: int, block: BlockId) -> None:
        """File stored `block` (first token `first`) in `kids` under `parent_key`, dropping the
        stale entries it meets there."""
        kids = self.kids
        entry = kids.get(parent_key)
        # `block` may already be filed here from an earlier store (stale, but live again now
        # that it is stored): it is filed once, or a block stored again and again at one
        # place (a partially claimed block refilled) would pile up in the list.
        if entry is None or (not isinstance(entry, dict)
                             and (entry == block or not self._is_kid(entry, parent_key))):
            kids[parent_key] = block
        else:
            if not isinstance(entry, dict):
                entry = kids[parent_key] = {self._first_of(entry): entry}
            found = entry.get(first)
            if found is None:
                entry[first] = block
            else:
                live = [b for b in (found if isinstance(found, list) else (found,))
                        if b != block and self._is_kid(b, parent_key)
                        and self._first_of(b) == first]
                entry[first] = live + [block] if live else block

    def _rebuild_kids(self) -> None:
        """Drop stale entries: refile every stored block its parent's holder does not name."""
        self.kids = {}
        for b, rec in enumerate(self.stored[:-1]):
            if rec is not None and self._next_of(rec[_PARENT]) != b:
                self._add_kid(rec[_PARENT], self._first_of(b), b)
        self._rebuild_at = _REBUILD_FACTOR * max(len(self.stored), len(self.kids)) + 1024

    def _check_sanity(self) -> bool:
        for key, b in self.by_key.items():
            assert self.key_of(b) == key
        assert self.stored[-1] is None
        orders = set()
        for b, rec in enumerate(self.stored[:-1]):
            if rec is None:
                continue
            key, parent, held, src, pos = rec[:_NEXT]
            assert key is None or self.by_key[key] == b
            assert 0 < held <= self.tpb and (key is None or held == self.tpb)
            if self.kids is not None:
                # Every stored block is findable under its parent and first token, once.
                first = self._first_of(b)
                assert first == src.first_tokens(self.tpb)[pos]
                assert self._kids_of(parent, first).count(b) == 1
                assert key is not None or rec[_NEXT] == NO_NEXT
                assert rec[_STAMP] < self._stamp and self._order(b) not in orders
                orders.add(self._order(b))
        return True
