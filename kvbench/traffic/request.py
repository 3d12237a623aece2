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

Serve mode decodes past the prompt. A request's *stream* is its prompt followed by its
`output_length` generated tokens: `output_tokens` when the traffic knows them (a multi-turn
session's next prompt repeats them, so decode blocks are reusable), else tokens derived from
the request id, negative so they never equal a prompt token and unique per request. Blocks past
the prompt's full ones are keyed by the chained hash of their tokens, as token prompts are.
`StreamView` shows a stream prefix as a prompt: what the cache sees of a serve-mode sequence.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from ..cache.ids import Retention

# Trace keys pack (hash id, prefix end) into one int; 2**24 tokens is far above any context length.
_END_BITS = 24
# Derived generated tokens pack (request id, offset) the same way, negated: prompt tokens are >= 0.
_GEN_BITS = 24
# Beams past the first derive theirs with the beam index above (request id, offset).
_BEAM_SHIFT = 56
MAX_BEAM_WIDTH = 64


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
    """Retention priority of the request's blocks where `retention` does not set one."""
    retention: Retention | None = None
    """Per token range and decode priorities (TensorRT-LLM's KvCacheRetentionConfig)."""
    output_tokens: np.ndarray | None = None
    """Tokens the request will generate when the traffic knows them (a synthetic session's next
    turn carries this answer, so decode blocks become reusable); None = unknown (traces)."""
    beam_width: int = 1
    """Beams decoded side by side (beam search); beam 0 generates the stream above."""
    encoder: Request | None = None
    """The encoder input of an encoder-decoder request, as the prompt of the cross-attention
    cache (`traffic.decoding.encoder_input`); None = decoder only."""
    root_key: int = field(init=False, repr=False)
    """Key of the empty prefix: the namespace's salt, so namespaces never share blocks."""
    _keys: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _firsts: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _key_arrays: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _stream_keys: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _stream_key_arrays: dict[int, np.ndarray] = field(default_factory=dict, repr=False)
    _stream_firsts: dict[int, list[int]] = field(default_factory=dict, repr=False)
    _retentions: dict[int, list[tuple[int, float | None]]] = field(default_factory=dict,
                                                                  repr=False)

    def __post_init__(self) -> None:
        if (self.tokens is None) == (self.hash_ids is None):
            raise ValueError("a request has either tokens or hash_ids")
        if self.tokens is not None and len(self.tokens) != self.input_length:
            raise ValueError("input_length must equal the number of tokens")
        if self.output_tokens is not None and len(self.output_tokens) != self.output_length:
            raise ValueError("output_length must equal the number of output_tokens")
        if not 1 <= self.beam_width <= MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be 1..{MAX_BEAM_WIDTH}")
        self.root_key = namespace_salt(self.namespace)

    def block_keys(self, tokens_per_block: int) -> list[int]:
        """Keys of the prompt's full blocks, cached per block size."""
        keys = self._keys.get(tokens_per_block)
        if keys is None:
            keys = self._compute_keys(tokens_per_block)
            self._keys[tokens_per_block] = keys
        return keys

    def block_keys_array(self, tokens_per_block: int) -> np.ndarray:
        """`block_keys` as an int64 array, cached per block size (an eviction policy reads a
        released chain's keys as one slice of it)."""
        return _keys_array(self._key_arrays, tokens_per_block, self.block_keys)

    def block_retentions(self, tokens_per_block: int) -> list[tuple[int, float | None]]:
        """(priority, duration_ms) of each prompt block under `retention` (which must be set),
        cached per block size; later (generated) blocks take the decode retention."""
        out = self._retentions.get(tokens_per_block)
        if out is None:
            out = self.retention.prompt_blocks(tokens_per_block, self.input_length, self.priority)
            self._retentions[tokens_per_block] = out
        return out

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

    def first_token(self, tokens_per_block: int, block: int) -> int:
        """`first_tokens(tokens_per_block)[block]` without building the list (the cache reads
        a few blocks' first tokens per request)."""
        pos = block * tokens_per_block
        if self.tokens is not None:
            return self.tokens.item(pos)
        size = self.trace_block_tokens
        return self.hash_ids.item(pos // size) * size + pos % size

    def tokens_at(self, positions: np.ndarray) -> np.ndarray:
        """Prompt tokens at the given positions (int64 array, each < input_length)."""
        if self.tokens is not None:
            return self.tokens[positions]
        block = self.trace_block_tokens
        return self.hash_ids[positions // block] * block + positions % block

    def drop_keys(self) -> None:
        """Forget what is memoised per block size (a long replay streams requests and frees
        them as it goes)."""
        self._keys.clear()
        self._key_arrays.clear()
        self._firsts.clear()
        self._stream_keys.clear()
        self._stream_key_arrays.clear()
        self._stream_firsts.clear()
        self._retentions.clear()

    def prompt_tokens(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Prompt tokens [start, end) as int64."""
        end = self.input_length if end is None else min(end, self.input_length)
        if self.tokens is not None:
            return self.tokens[start:end]
        return self.tokens_at(np.arange(start, end, dtype=np.int64))

    @property
    def stream_length(self) -> int:
        """Prompt and generated tokens."""
        return self.input_length + self.output_length

    def stream_tokens(self, start: int = 0, end: int | None = None) -> np.ndarray:
        """Stream tokens [start, end) as int64: the prompt's, then the generated ones."""
        n = self.input_length
        end = self.stream_length if end is None else min(end, self.stream_length)
        if end <= n:
            return self.prompt_tokens(start, end)
        gen_start = max(start, n) - n
        if self.output_tokens is not None:
            generated = self.output_tokens[gen_start:end - n]
        else:
            generated = self._derived_tokens(np.arange(gen_start, end - n, dtype=np.int64))
        if start >= n:
            return generated
        return np.concatenate([self.prompt_tokens(start, n), generated])

    def stream_keys(self, tokens_per_block: int) -> list[int]:
        """Keys of the stream's full blocks, cached per block size; the first
        `input_length // tokens_per_block` are `block_keys`."""
        keys = self._stream_keys.get(tokens_per_block)
        if keys is None:
            tpb = tokens_per_block
            keys = list(self._keys.get(tpb) or self._compute_keys(tpb))
            parent = keys[-1] if keys else self.root_key
            begin = len(keys)
            n_full = self.stream_length // tpb
            if n_full > begin:
                toks = self.stream_tokens(begin * tpb, n_full * tpb).tolist()
                for b in range(n_full - begin):
                    parent = hash((parent, *toks[b * tpb:(b + 1) * tpb]))
                    keys.append(parent)
            self._stream_keys[tpb] = keys
        return keys

    def stream_keys_array(self, tokens_per_block: int) -> np.ndarray:
        """`stream_keys` as an int64 array, cached per block size."""
        return _keys_array(self._stream_key_arrays, tokens_per_block, self.stream_keys)

    def stream_first_tokens(self, tokens_per_block: int) -> list[int]:
        """The first token of every stream block (the last may be partial), cached per block
        size; the first `ceil(input_length / tokens_per_block)` are `first_tokens`."""
        firsts = self._stream_firsts.get(tokens_per_block)
        if firsts is None:
            tpb = tokens_per_block
            firsts = list(self.first_tokens(tpb))
            starts = np.arange(len(firsts) * tpb, self.stream_length, tpb, dtype=np.int64)
            if len(starts):
                offsets = starts - self.input_length
                if self.output_tokens is not None:
                    firsts.extend(self.output_tokens[offsets].tolist())
                else:
                    firsts.extend(self._derived_tokens(offsets).tolist())
            self._stream_firsts[tpb] = firsts
        return firsts

    def view(self, length: int) -> StreamView:
        """The first `length` stream tokens as a prompt (see `StreamView`)."""
        return StreamView(self, length)

    def _derived_tokens(self, offsets: np.ndarray) -> np.ndarray:
        return -((self.id << _GEN_BITS) | offsets) - 1

    def _compute_keys(self, tpb: int) -> list[int]:
        n_full = self.input_length // tpb
        salt = self.root_key
        if self.hash_ids is not None:
            ends = np.arange(1, n_full + 1, dtype=np.int64) * tpb
            ids = self.hash_ids[(ends - 1) // self.trace_block_tokens]
            keys = (ids << _END_BITS) | ends
            if salt:
                return [hash((salt, k)) for k in keys.tolist()]
            self._key_arrays[tpb] = keys  # made anyway: cached for `block_keys_array`
            return keys.tolist()
        keys = []
        parent = salt
        toks = self.tokens
        for b in range(n_full):
            parent = hash((parent, *toks[b * tpb:(b + 1) * tpb].tolist()))
            keys.append(parent)
        return keys


def _keys_array(cache: dict[int, np.ndarray], tokens_per_block: int,
                keys_of: Callable[[int], list[int]]) -> np.ndarray:
    """`keys_of(tokens_per_block)` as an int64 array, made once per block size in `cache`."""
    keys = cache.get(tokens_per_block)
    if keys is None:
        keys = cache[tokens_per_block] = np.array(keys_of(tokens_per_block), np.int64)
    return keys


class RequestList(list):
    """A request stream held in memory. Its requests memoise their block keys, first tokens
    and retentions per block size while a run uses them, and keep them after it: the list
    outlives the run (the variants of a workload and the trials of a tune study that leave
    the requests alone reuse it), and a next run at the same block size reuses the memos.
    `begin_pass` forgets those of another block size, so the memos held between runs are
    at most what the last run made (every pool of a run shares its block size)."""

    __slots__ = ("_memo_block_size",)

    def __init__(self, *requests) -> None:
        super().__init__(*requests)
        self._memo_block_size: int | None = None

    def begin_pass(self, tokens_per_block: int) -> None:
        """A run at `tokens_per_block` starts: forget memos made at another block size."""
        if self._memo_block_size not in (None, tokens_per_block):
            for r in self:
                r.drop_keys()
        self._memo_block_size = tokens_per_block


class StreamView:
    """A request's stream seen as a prompt of `input_length` tokens (its prompt, or after a
    preemption its prompt and the tokens generated so far), in the interface the cache reads
    of a `Request`. Keys, first tokens and tokens cover the whole stream, so a sequence that
    keeps growing past `input_length` by decoding stores its generated blocks under this view."""

    __slots__ = ("request", "id", "input_length", "root_key", "priority", "beam_width",
                 "retention")

    def __init__(self, request: Request, input_length: int) -> None:
        if not 0 < input_length <= request.stream_length:
            raise ValueError("a view covers 1 to stream_length tokens")
        self.request = request
        self.id = request.id
        self.input_length = input_length
        self.root_key = request.root_key
        self.priority = request.priority
        self.beam_width = request.beam_width
        self.retention = request.retention

    def block_retentions(self, tokens_per_block: int) -> list[tuple[int, float | None]]:
        """The request's: its prompt's blocks take the ranges, the rest the decode retention
        (also after a preemption, when this view's prompt holds generated tokens)."""
        return self.request.block_retentions(tokens_per_block)

    def block_keys(self, tokens_per_block: int) -> list[int]:
        return self.request.stream_keys(tokens_per_block)

    def block_keys_array(self, tokens_per_block: int) -> np.ndarray:
        return self.request.stream_keys_array(tokens_per_block)

    def first_tokens(self, tokens_per_block: int) -> list[int]:
        return self.request.stream_first_tokens(tokens_per_block)

    def first_token(self, tokens_per_block: int, block: int) -> int:
        return self.request.stream_first_tokens(tokens_per_block)[block]

    def first_tokens_array(self, tokens_per_block: int) -> np.ndarray:
        return np.array(self.request.stream_first_tokens(tokens_per_block), dtype=np.int64)

    def prompt_tokens(self, start: int = 0, end: int | None = None) -> np.ndarray:
        return self.request.stream_tokens(start, self.input_length if end is None else end)
