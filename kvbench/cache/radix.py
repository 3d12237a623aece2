"""Prefix index: which block holds the data of which prefix.

Keys are chained (a key identifies its whole prefix), so a map `key -> block` is the radix
tree's edge table: the child of node `k` along block `t` is the entry for `key(k, t)`. Matching a
prompt walks its keys from the root and stops at the first miss. A block whose parent was
evicted stays indexed: it cannot be reached until the parent's prefix is stored again, and then
its data is valid again (the key chains the prefix), so dropping it would only lose reuse.

Partial reuse needs the children of a node, filed by first token: a partial match needs at least
its first token equal, so only blocks under the same node with the same first token are compared
token by token, and a node shared by thousands of conversations (a system prompt) costs one
lookup, not a scan of its children. With partial reuse on, `kids[parent_key]` is one block id
(most nodes have one child: a chain) or a dict `first_token -> block id | [block ids]`, holding
every stored block there, full or partial (a released prompt's last, unfilled block). Entries are
removed lazily: eviction, the hottest path, leaves them, and a reader takes an entry only while
its block is still stored there (`_is_kid`). The map is rebuilt from the stored blocks when stale
entries pile up, so its size stays O(blocks). Building and deleting millions of tiny
containers and tuple keys cost more than the whole rest of the replay; this does not.
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

_ByFirst = dict[int, "BlockId | list[BlockId]"]
_Kids = dict[BlockKey, "BlockId | _ByFirst"]


class PrefixIndex:
    """Keys and token sources of the stored blocks of one life cycle (all tiers)."""

    __slots__ = (
        "tpb", "by_key", "kids", "key_of", "parent_of", "first_of", "num_tokens", "source",
        "position", "_rebuild_at",
    )

    def __init__(self, tokens_per_block: int, id_space: int, track_children: bool) -> None:
        self.tpb = tokens_per_block
        self.by_key: dict[BlockKey, BlockId] = {}
        self.kids: _Kids | None = {} if track_children else None
        self._rebuild_at = _REBUILD_FACTOR * id_space + 1024
        self.key_of: list[BlockKey | None] = [None] * id_space
        self.parent_of: list[BlockKey] = [BlockKey(0)] * id_space
        self.first_of = [0] * id_space
        self.num_tokens = [0] * id_space
        # Where the block's tokens come from: a request (None = not stored) and the block's
        # position in it. Two arrays rather than a tuple per block: millions of stores.
        self.source: list[Request | None] = [None] * id_space
        self.position = [0] * id_space

    # --- public API -----------------------------------------------------------------------

    def is_stored(self, block: BlockId) -> bool:
        return self.source[block] is not None

    def walk(self, keys: list[BlockKey], limit: int) -> list[BlockId]:
        """Blocks of the longest stored prefix of `keys[:limit]`."""
        get = self.by_key.get
        out: list[BlockId] = []
        for i in range(limit):
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
        start = position * self.tpb
        ours = request.prompt_tokens(start, start + limit)
        best: tuple[BlockId, int] | None = None
        best_ok = False
        for b in candidates:
            src_req, src_pos = self.source[b], self.position[b]
            n = min(limit, self.num_tokens[b])
            theirs = src_req.prompt_tokens(src_pos * self.tpb, src_pos * self.tpb + n)
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
        key = self.key_of[block]
        if key is None or self.kids is None:
            return False
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
        by_key, key_of, parent_of, num_tokens, source, position = (
            self.by_key, self.key_of, self.parent_of, self.num_tokens, self.source, self.position)
        tpb = self.tpb
        kids = self.kids
        if kids is not None:
            firsts, first_of = request.first_tokens(tpb), self.first_of
            add_kid = self._add_kid
        for i in range(begin, end):
            key = keys[i]
            b = blocks[i]
            if key not in by_key:
                by_key[key] = b
                key_of[b] = key
                parent_of[b] = parent_key
                num_tokens[b] = tpb
                source[b] = request
                position[b] = i
                if kids is not None:
                    # The common case inline (this loop runs per stored block): a node whose
                    # only entry is stale or absent.
                    old = kids.get(parent_key)
                    if old is None or (old.__class__ is int
                                       and (old == b or source[old] is None)):
                        first_of[b] = firsts[i]
                        kids[parent_key] = b
                    else:
                        add_kid(parent_key, firsts[i], b)
            parent_key = key
        if kids is not None and len(kids) > self._rebuild_at:
            self._rebuild_kids()

    def insert_partial(
        self, block: BlockId, parent_key: BlockKey, request: Request, position: int, num_tokens: int
    ) -> None:
        """Store an unfilled block (no key) for partial matching."""
        assert self.kids is not None
        self.key_of[block] = None
        self.parent_of[block] = parent_key
        self.num_tokens[block] = num_tokens
        self.source[block] = request
        self.position[block] = position
        self._add_kid(parent_key, request.first_tokens(self.tpb)[position], block)
        if len(self.kids) > self._rebuild_at:
            self._rebuild_kids()

    def remove(self, block: BlockId) -> None:
        key = self.key_of[block]
        if key is not None:
            del self.by_key[key]
            self.key_of[block] = None
        self.source[block] = None  # any `kids` entry for it is now stale

    def remove_many(self, blocks: list[BlockId]) -> None:
        by_key, key_of, source = self.by_key, self.key_of, self.source
        for b in blocks:
            key = key_of[b]
            if key is not None:
                del by_key[key]
                key_of[b] = None
            source[b] = None

    def move(self, src: BlockId, dst: BlockId) -> None:
        """The data of `src` now lives in `dst` (an offload or an onboard): same key, parent,
        tokens and source; `src` is no longer stored."""
        self.move_many([src], [dst])

    def move_many(self, srcs: list[BlockId], dsts: list[BlockId]) -> None:
        """`move` for pairs of blocks; an offload moves one per evicted block."""
        by_key, key_of, parent_of, num_tokens, source, position, first_of = (
            self.by_key, self.key_of, self.parent_of, self.num_tokens, self.source,
            self.position, self.first_of)
        kids = self.kids
        for src, dst in zip(srcs, dsts):
            key = key_of[src]
            if key is not None:
                by_key[key] = dst
                key_of[src] = None
            key_of[dst] = key
            parent = parent_of[dst] = parent_of[src]
            num_tokens[dst] = num_tokens[src]
            source[dst] = source[src]
            position[dst] = position[src]
            source[src] = None
            if kids is not None:
                first = first_of[dst] = first_of[src]
                if kids.get(parent) == src:  # the common single child: swap in place
                    kids[parent] = dst
                else:
                    self._add_kid(parent, first, dst)
        if kids is not None and len(self.kids) > self._rebuild_at:
            self._rebuild_kids()

    # --- helpers --------------------------------------------------------------------------

    def _is_kid(self, block: BlockId, parent_key: BlockKey) -> bool:
        return self.source[block] is not None and self.parent_of[block] == parent_key

    def _kids_of(self, parent_key: BlockKey, first: int) -> list[BlockId]:
        entry = self.kids.get(parent_key)
        if entry is None:
            return []
        found = entry.get(first) if isinstance(entry, dict) else entry
        if found is None:
            return []
        blocks = found if isinstance(found, list) else (found,)
        return [b for b in blocks if self._is_kid(b, parent_key) and self.first_of[b] == first]

    def _add_kid(self, parent_key: BlockKey, first: int, block: BlockId) -> None:
        self.first_of[block] = first
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
                entry = kids[parent_key] = {self.first_of[entry]: entry}
            found = entry.get(first)
            if found is None:
                entry[first] = block
            else:
                live = [b for b in (found if isinstance(found, list) else (found,))
                        if b != block and self._is_kid(b, parent_key)
                        and self.first_of[b] == first]
                entry[first] = live + [block] if live else block

    def _rebuild_kids(self) -> None:
        """Drop stale entries: refile every stored block under its parent."""
        self.kids = {}
        live = [b for b, src in enumerate(self.source) if src is not None]
        for b in live:
            self._file_kid(b)
        self._rebuild_at = _REBUILD_FACTOR * max(len(self.source), len(self.kids)) + 1024

    def _file_kid(self, b: BlockId) -> None:
        parent_key, first = self.parent_of[b], self.first_of[b]
        entry = self.kids.get(parent_key)
        if entry is None:
            self.kids[parent_key] = b
            return
        if not isinstance(entry, dict):
            entry = self.kids[parent_key] = {self.first_of[entry]: entry}
        found = entry.get(first)
        if found is None:
            entry[first] = b
        elif isinstance(found, list):
            found.append(b)
        else:
            entry[first] = [found, b]

    def _check_sanity(self) -> bool:
        for key, b in self.by_key.items():
            assert self.key_of[b] == key and self.source[b] is not None
        if self.kids is not None:
            # Every stored block is findable under its parent and first token.
            for b, src in enumerate(self.source):
                if src is not None:
                    assert self._kids_of(self.parent_of[b], self.first_of[b]).count(b) == 1
                    assert src.first_tokens(self.tpb)[self.position[b]] == self.first_of[b]
        return True
