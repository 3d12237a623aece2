"""Prefix index: which block holds the data of which prefix.

Keys are chained (a key identifies its whole prefix), so a map `key -> block` is the radix
tree's edge table: the child of node `k` along block `t` is the entry for `key(k, t)`. Matching a
prompt walks its keys from the root and stops at the first miss. A block whose parent was
evicted stays indexed: it cannot be reached until the parent's prefix is stored again, and then
its data is valid again (the key chains the prefix), so dropping it would only lose reuse.

Partial reuse needs the children of a node, filed by first token: a partial match needs at least
its first token equal, so only blocks under the same node with the same first token are compared
token by token, and a node shared by thousands of conversations (a system prompt) costs one
lookup, not a scan of its children. Most children are the next block of the chain that stored
their parent, so they are not filed at all: a full block's record names the block that followed
it in its sequence (`_NEXT`), and the children of a node are that block, when it is still stored
below the node (its key's holder in `by_key`), plus the ones in `kids`. `kids` files the rest:
the first block of each stored run (its parent came from another sequence), a chain whose
previous key was held by another block, a moved block, and an orphan (a block whose parent's
holder is removed while it stays stored: its holder comes back under a new record). Invariant:
every stored block is its parent key's holder's `_NEXT` or filed in `kids`.
`kids[parent_key]` is one block id (most filed nodes have one child) or a dict `first_token ->
block id | [block ids]`. Entries are removed lazily: a reader takes an entry only while its block
is still stored there (`_is_kid`), and the map is rebuilt from the stored blocks when stale
entries pile up, so its size stays O(blocks). Equally good partial matches are taken in the
order their blocks were stored (`_STAMP`), whichever way they were found.
Filing every block in a map cost more than the rest of the replay: a store per block into a
map many times the cache's size (cache misses), and a scan of its stale entries.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from .ids import BlockId, BlockKey

if TYPE_CHECKING:
    from ..traffic.request import Request

# Stale entries may reach this many times the block count before a rebuild: rebuilding costs
# one pass over the blocks, so it runs about once per this many rounds of the whole cache.
_REBUILD_FACTOR = 8

# Fields of a stored block's record; with partial reuse also `_NEXT` and `_STAMP`.
_KEY, _PARENT, _NTOK, _SOURCE, _POSITION, _FIRST, _NEXT, _STAMP = range(8)
_Record = tuple
"""(key | None, parent key, tokens held, source request, position, first token[, next block,
stamp]): `next block` is the block after it in the sequence that stored it (-1: none; a hint
that holds while that block is stored below this key), `stamp` counts the stores (the order of
equally good partial matches)."""

_ByFirst = dict[int, "BlockId | list[BlockId]"]
_Kids = dict[BlockKey, "BlockId | _ByFirst"]


class PrefixIndex:
    """Keys and token sources of the stored blocks of one life cycle (all tiers).

    What a stored block holds is one immutable record, `stored[b] = (key, parent key, tokens,
    source request, position, first token)` (key None for a partial block; the record None for
    a block that stores nothing; with `track_children` two more fields, `_NEXT` and `_STAMP`).
    One record rather than an array per field: a store is one tuple, and an offload or onboard
    (millions in a replay with a host tier) moves the record to the new block instead of
    copying its fields."""

    __slots__ = ("tpb", "by_key", "kids", "stored", "_rebuild_at", "_stamp")

    def __init__(self, tokens_per_block: int, id_space: int, track_children: bool) -> None:
        self.tpb = tokens_per_block
        self.by_key: dict[BlockKey, BlockId] = {}
        self.kids: _Kids | None = {} if track_children else None
        self._rebuild_at = _REBUILD_FACTOR * id_space + 1024
        self.stored: list[_Record | None] = [None] * id_space
        self._stamp = 0
        """Stores so far (the next record's `_STAMP`)."""

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
        candidates = self._kids_of(parent_key, request.first_tokens(self.tpb)[position])
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
        if kids is None:
            for i in range(begin, end):
                key = keys[i]
                if key not in by_key:
                    b = blocks[i]
                    by_key[key] = b
                    stored[b] = (key, parent_key, tpb, request, i, 0)
                parent_key = key
            return
        firsts = request.first_tokens(tpb)
        nexts = blocks[begin + 1:end + 1]
        if len(nexts) < end - begin:
            nexts.append(-1)
        stamp = self._stamp - begin
        self._stamp += end - begin
        # The first block is its parent's holder's next one when an earlier store of this
        # sequence left off there; after a key held by another block the next one is not.
        filed = self._next_of(parent_key) == blocks[begin]
        for i in range(begin, end):
            key = keys[i]
            if key not in by_key:
                b = blocks[i]
                by_key[key] = b
                stored[b] = (key, parent_key, tpb, request, i, firsts[i], nexts[i - begin],
                             stamp + i)
                if not filed:
                    self._add_kid(parent_key, firsts[i], b)
                filed = True
            else:
                filed = False
            parent_key = key
        if len(kids) > self._rebuild_at:
            self._rebuild_kids()

    def insert_partial(
        self, block: BlockId, parent_key: BlockKey, request: Request, position: int, num_tokens: int
    ) -> None:
        """Store an unfilled block (no key) for partial matching."""
        assert self.kids is not None
        first = request.first_tokens(self.tpb)[position]
        self.stored[block] = (None, parent_key, num_tokens, request, position, first, -1,
                              self._stamp)
        self._stamp += 1
        if self._next_of(parent_key) != block:
            self._add_kid(parent_key, first, block)
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
                self._add_kid(rec[_PARENT], rec[_FIRST], dst)
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
            key = rec[_KEY]
            if key is not None:
                del by_key[key]
                # Its next block is found through it only while it holds the key.
                kid = stored[rec[_NEXT]] if rec[_NEXT] >= 0 else None
                if kid is not None and kid[_PARENT] == key:
                    self._add_kid(key, kid[_FIRST], rec[_NEXT])

    def _is_kid(self, block: BlockId, parent_key: BlockKey) -> bool:
        rec = self.stored[block] if block >= 0 else None
        return rec is not None and rec[_PARENT] == parent_key

    def _next_of(self, parent_key: BlockKey) -> BlockId:
        """The `_NEXT` of the block holding `parent_key` (-1 when none holds it)."""
        holder = self.by_key.get(parent_key)
        return -1 if holder is None else self.stored[holder][_NEXT]

    def _first_of(self, block: BlockId) -> int:
        return self.stored[block][_FIRST]

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
        if self._is_kid(nxt, parent_key) and self._first_of(nxt) == first and nxt not in out:
            out.append(nxt)
        if len(out) > 1:
            stored = self.stored
            out.sort(key=lambda b: stored[b][_STAMP])
        return out

    def _add_kid(self, parent_key: BlockKey, first: int, block: BlockId) -> None:
        kids = self.kids
        entry = kids.get(parent_key)
        # `block` may already be filed here from an earlier store (stale, but live again now
        # that it is stored): it is filed once, last, or a block stored again and again at one
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
        for b, rec in enumerate(self.stored):
            if rec is not None and self._next_of(rec[_PARENT]) != b:
                self._file_kid(b)
        self._rebuild_at = _REBUILD_FACTOR * max(len(self.stored), len(self.kids)) + 1024

    def _file_kid(self, b: BlockId) -> None:
        rec = self.stored[b]
        parent_key, first = rec[_PARENT], rec[_FIRST]
        entry = self.kids.get(parent_key)
        if entry is None:
            self.kids[parent_key] = b
            return
        if not isinstance(entry, dict):
            entry = self.kids[parent_key] = {self._first_of(entry): entry}
        found = entry.get(first)
        if found is None:
            entry[first] = b
        elif isinstance(found, list):
            found.append(b)
        else:
            entry[first] = [found, b]

    def _check_sanity(self) -> bool:
        for key, b in self.by_key.items():
            assert self.key_of(b) == key
        for b, rec in enumerate(self.stored):
            if rec is None:
                continue
            key, parent, held, src, pos, first = rec[:_NEXT]
            assert key is None or self.by_key[key] == b
            assert 0 < held <= self.tpb and (key is None or held == self.tpb)
            if self.kids is not None:
                # Every stored block is findable under its parent and first token.
                assert self._kids_of(parent, first).count(b) == 1
                assert src.first_tokens(self.tpb)[pos] == first
                assert len(rec) == 8 and (key is not None or rec[_NEXT] == -1)
                assert rec[_STAMP] < self._stamp
        return True
