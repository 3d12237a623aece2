"""The request model every traffic source produces and every engine consumes.

A prompt is either explicit tokens (synthetic traffic) or a Mooncake-style list of prefix-chained
hash ids of fixed-size trace blocks (trace traffic). Trace prompts never materialise their tokens
for the whole run (the conversation trace alone has 145M prompt tokens); tokens are derived on
demand from (hash id, offset), so equal ids give equal tokens and different ids never collide.

Block keys are what the cache indexes. A key identifies the whole prefix up to the end of its
block (tokens and namespace): equal keys mean equal prefixes. Token prompts get a chained hash of
(parent key, block tokens); trace prompts need no hashing at all, because the trace's own ids are
already prefix-chained: the prefix ending at token `end` is identified by the id of the trace
block holding token `end - 1` together with `end`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np

# Trace keys pack (hash id, prefix end) into one int; 2**24 tokens is far above any context length.
_END_BITS = 24


def namespace_salt(namespace: str | int | None) -> int:
    """A process-independent integer for a namespace (LoRA id, cache salt); 0 = none."""
    if namespace is None:
        return 0
    digest = hashlib.blake2b(str(namespace).encode(), digest_size=8).digest()
    # 63 bits, so keys fit numpy's int64 in the oracle.
    return (int.from_bytes(digest, "little") >> 1) | 1


@dataclass(slots=True)
class Request:
    """One request of a traffic stream.

    Exactly one of `tokens` (explicit prompt tokens) and `hash_ids` (trace blocks of
    `trace_block_tokens` tokens) is set.
    """

    id: int
    arrival_s: float
    input_length: int
    output_length: int
    tokens: np.ndarray | None = None
    hash_ids: np.ndarray | None = None
    trace_block_tokens: int = 512
    namespace: str | int | None = None
    priority: int = 35
    output_tokens: np.ndarray | None = None
    """Tokens the request will generate when the traffic knows them (a synthetic session's next
    turn carries this answer, so decode blocks become reusable); None = unknown (traces)."""
    root_key: int = field(init=False, repr=False)
    """Key of the empty prefix: the namespace's salt, so namespaces never share blocks."""
    _keys: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _firsts: dict[int, list[int]] = field(default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.hash_ids is None):
            raise ValueError("a request has either tokens or hash_ids")
        if self.tokens is not None and len(self.tokens) != self.input_length:
            raise ValueError("input_length must equal the number of tokens")
        self.root_key = namespace_salt(self.namespace)

    def block_keys(self, tokens_per_block: int) -> list[int]:
        """Keys of the prompt's full blocks, cached per block size."""
        keys = self._keys.get(tokens_per_block)
        if keys is None:
            keys = self._compute_keys(tokens_per_block)
            self._keys[tokens_per_block] = keys
        return keys

    def first_tokens(self, tokens_per_block: int) -> list[int]:
        """The first token of every prompt block (the last may be partial), cached per block
        size: a partial match needs its first token equal, so the index files blocks by it."""
        firsts = self._firsts.get(tokens_per_block)
        if firsts is None:
            firsts = self.first_tokens_array(tokens_per_block).tolist()
            self._firsts[tokens_per_block] = firsts
        return firsts

    def first_tokens_array(self, tokens_per_block: int) -> np.ndarray:
        """`first_tokens` as an int64 array, computed afresh (for vectorised references)."""
        return self.tokens_at(np.arange(0, self.input_length, tokens_per_block, dtype=np.int64))

    def tokens_at(self, positions: np.ndarray) -> np.ndarray:
        """Prompt tokens at the given positions (int64 array, each < input_length)."""
        if self.tokens is not None:
            return self.tokens[positions]
        block = self.trace_block_tokens
        return self.hash_ids[positions // block] * block + positions % block

    def drop_keys(self) -> None:
        """Forget cached keys (a long replay streams requests and frees them as it goes)."""
        self._keys.clear()
        self._firsts.clear()

    def prompt_tokens(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Prompt tokens [start, end) as int64."""
        end = self.input_length if end is None else min(end, self.input_length)
        if self.tokens is not None:
            return self.tokens[start:end]
        return self.tokens_at(np.arange(start, end, dtype=np.int64))

    def _compute_keys(self, tpb: int) -> list[int]:
        n_full = self.input_length // tpb
        salt = self.root_key
        if self.hash_ids is not None:
            ends = np.arange(1, n_full + 1, dtype=np.int64) * tpb
            ids = self.hash_ids[(ends - 1) // self.trace_block_tokens]
            keys = ((ids << _END_BITS) | ends).tolist()
            if salt:
                keys = [hash((salt, k)) for k in keys]
            return keys
        keys = []
        parent = salt
        toks = self.tokens
        for b in range(n_full):
            parent = hash((parent, *toks[b * tpb:(b + 1) * tpb].tolist()))
            keys.append(parent)
        return keys
