"""Prefix index: which block holds the data of which prefix.

Keys are chained (a key identifies its whole prefix), so a map `key -> block` is the radix
tree's edge table: the child of node `k` along block `t` is the entry for `key(k, t)`. Matching a
prompt walks its keys from the root and stops at the first miss. A block whose parent was
evicted stays indexed: it cannot be reached until the parent's prefix is stored again, and then
its data is valid again (the key chains the prefix), so dropping it would only lose reuse.

Partial reuse needs the children of a node, filed by first token: a partial match needs at least
its first token equal, so only blocks under the same node with the same first token are compared
token by token, and a node shared by thousands of conversations (a system prompt) costs one
lookup, not a scan of its children. With partial reuse on, `kids[(parent_key, first_token)]`
holds every stored block there, full or partial (a released prompt's last, unfilled block): one
block id in the common case, a list only when several share a first token, because building
millions of tiny containers cost more than the whole rest of the replay.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .ids import BlockId, BlockKey

if TYPE_CHECKING:
    from ..traffic.request import Request

_Kids = dict[tuple[BlockKey, int], "BlockId | list[BlockId]"]


class PrefixIndex:
    """Keys and token sources of the stored blocks of one life cycle (all tiers)."""

    __slots__ = (
        "tpb", "by_key", "kids", "num_kids", "key_of", "parent_of", "first_of", "num_tokens",
        "source", "position",
    )

    def __init__(self, tokens_per_block: int, id_space: int, track_children: bool) -> None:
        self.tpb = tokens_per_block
        self.by_key: dict[BlockKey, BlockId] = {}
        self.kids: _Kids | None = {} if track_children else None
        self.num_kids: dict[BlockKey, int] = {}
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
        self, parent_key: BlockKey, request: Request, position: int, limit: int
    ) -> tuple[BlockId, int] | None:
        """The stored child of `parent_key` sharing the most leading tokens (at most `limit`)
        with the request's block at `position`."""
        assert self.kids is not None, "partial matching needs track_children"
        if limit <= 0:
            return None
        found = self.kids.get((parent_key, request.first_tokens(self.tpb)[position]))
        if found is None:
            return None
        candidates = found if isinstance(found, list) else (found,)
        start = position * self.tpb
        ours = request.prompt_tokens(start, start + limit)
        best: tuple[BlockId, int] | None = None
        for b in candidates:
            src_req, src_pos = self.source[b], self.position[b]
            n = min(limit, self.num_tokens[b])
            theirs = src_req.prompt_tokens(src_pos * self.tpb, src_pos * self.tpb + n)
            diff = np.flatnonzero(ours[:n] != theirs)
            common = int(diff[0]) if len(diff) else n
            if best is None or common > best[1]:
                best = (b, common)
                if common == limit:
                    break
        return best

    def has_children(self, block: BlockId) -> bool:
        key = self.key_of[block]
        return key is not None and key in self.num_kids

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
            firsts, first_of, num_kids = request.first_tokens(tpb), self.first_of, self.num_kids
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
                if kids is not None:  # _add_kid, inlined: this loop runs per stored block
                    first = first_of[b] = firsts[i]
                    slot = (parent_key, first)
                    found = kids.get(slot)
                    if found is None:
                        kids[slot] = b
                    elif isinstance(found, list):
                        found.append(b)
                    else:
                        kids[slot] = [found, b]
                    num_kids[parent_key] = num_kids.get(parent_key, 0) + 1
            parent_key = key

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

    def remove(self, block: BlockId) -> None:
        key = self.key_of[block]
        if key is not None:
            del self.by_key[key]
            self.key_of[block] = None
        if self.kids is not None:
            parent = self.parent_of[block]
            slot = (parent, self.first_of[block])
            found = self.kids[slot]
            if isinstance(found, list):
                found.remove(block)
                if len(found) == 1:
                    self.kids[slot] = found[0]
            else:
                del self.kids[slot]
            left = self.num_kids[parent] - 1
            if left:
                self.num_kids[parent] = left
            else:
                del self.num_kids[parent]
        self.source[block] = None

    def remove_many(self, blocks: list[BlockId]) -> None:
        if self.kids is not None:
            for b in blocks:
                self.remove(b)
            return
        by_key, key_of, source = self.by_key, self.key_of, self.source
        for b in blocks:
            del by_key[key_of[b]]
            key_of[b] = None
            source[b] = None

    def _add_kid(self, parent_key: BlockKey, first: int, block: BlockId) -> None:
        self.first_of[block] = first
        slot = (parent_key, first)
        kids = self.kids
        found = kids.get(slot)
        if found is None:
            kids[slot] = block
        elif isinstance(found, list):
            found.append(block)
        else:
            kids[slot] = [found, block]
        num_kids = self.num_kids
        num_kids[parent_key] = num_kids.get(parent_key, 0) + 1

    def _check_sanity(self) -> bool:
        for key, b in self.by_key.items():
            assert self.key_of[b] == key and self.source[b] is not None
        if self.kids is not None:
            counts: dict[BlockKey, int] = {}
            for (parent, first), found in self.kids.items():
                blocks = found if isinstance(found, list) else [found]
                assert len(blocks) == len(set(blocks)) and (len(blocks) == 1 or isinstance(found, list))
                for b in blocks:
                    assert self.parent_of[b] == parent and self.source[b] is not None
                    req, pos = self.source[b], self.position[b]
                    assert req.first_tokens(self.tpb)[pos] == first == self.first_of[b]
                    counts[parent] = counts.get(parent, 0) + 1
            assert counts == self.num_kids
        return True
