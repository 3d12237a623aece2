"""A hash-id trace read once into compact form, for cache-mode runs whose memory must not grow
with the trace: per request its lengths and arrival (a few bytes each), and the flat hash ids
in a temporary file read back in chunks, forwards (the replay) or backwards (next uses for the
optimal reference). About 8 bytes of disk per trace block and ~20 bytes of memory per request;
Request objects exist only while they are replayed.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from kvbench.traffic.request import Request

_CHUNK_IDS = 1 << 20
# Dense ids only: the references index tables by id, so a sparse id space would waste memory.
_MAX_ID_SLACK = 4
_MIN_ID_SPACE = 1 << 20


class NotSpillable(Exception):
    """The stream is not a plain hash-id trace with compact ids (the caller keeps it in memory)."""


class SpilledTrace:
    """Re-iterable requests of a hash-id trace with one block size and ids in [0, max_id]."""

    def __init__(self, requests: Iterator[Request], beam_width: int = 1) -> None:
        self.input_lengths = array("i")
        self.output_lengths = array("i")
        self.arrivals = array("d")
        self.beam_width = beam_width
        self.block_tokens: int | None = None
        self.max_id = -1
        self._dir = tempfile.TemporaryDirectory(prefix="kvbench-spill-")
        self.ids_path = Path(self._dir.name) / "ids.bin"
        self.num_ids = 0
        buffer: list[np.ndarray] = []
        buffered = 0
        with open(self.ids_path, "wb") as f:
            for r in requests:
                ids = r.hash_ids
                if ids is None or r.namespace is not None or r.output_tokens is not None:
                    raise NotSpillable("prompts other than plain hash ids")
                if self.block_tokens is None:
                    self.block_tokens = r.trace_block_tokens
                elif r.trace_block_tokens != self.block_tokens:
                    raise NotSpillable("more than one block size")
                if len(ids):
                    top = int(ids.max())
                    if top > self.max_id:
                        self.max_id = top
                    if int(ids.min()) < 0:
                        raise NotSpillable("negative ids")
                self.input_lengths.append(r.input_length)
                self.output_lengths.append(r.output_length)
                self.arrivals.append(r.arrival_s)
                buffer.append(ids)
                buffered += len(ids)
                self.num_ids += len(ids)
                if self.max_id >= _MAX_ID_SLACK * self.num_ids + _MIN_ID_SPACE:
                    raise NotSpillable("sparse ids")
                if buffered >= _CHUNK_IDS:
                    np.concatenate(buffer).astype(np.int64, copy=False).tofile(f)
                    buffer, buffered = [], 0
            if buffer:
                np.concatenate(buffer).astype(np.int64, copy=False).tofile(f)
        lengths = np.frombuffer(self.input_lengths, dtype=np.int32)
        self.id_counts = -(-lengths.astype(np.int64) // (self.block_tokens or 1))
        self.prompt_tokens = int(lengths.sum(dtype=np.int64))

    def __len__(self) -> int:
        return len(self.input_lengths)

    def largest(self) -> int:
        """The id of the longest prompt."""
        return int(np.argmax(np.frombuffer(self.input_lengths, dtype=np.int32)))

    def shape_of(self, i: int) -> Request:
        """Request `i` with its lengths but not its ids: for sizing checks."""
        r = Request(i, self.arrivals[i], self.input_lengths[i], self.output_lengths[i],
                    hash_ids=np.zeros(int(self.id_counts[i]), dtype=np.int64),
                    trace_block_tokens=self.block_tokens)
        r.beam_width = self.beam_width
        return r

    def __iter__(self) -> Iterator[Request]:
        """The requests in order, each a fresh Request (keys are not kept past the caller)."""
        block, beam = self.block_tokens, self.beam_width
        for i, ids in enumerate(self.ids_forward()):
            r = Request(i, self.arrivals[i], self.input_lengths[i], self.output_lengths[i],
                        hash_ids=ids, trace_block_tokens=block)
            r.beam_width = beam
            yield r

    def ids_forward(self) -> Iterator[np.ndarray]:
        """Each request's hash ids, in order."""
        counts = self.id_counts.tolist()
        with open(self.ids_path, "rb") as f:
            chunk = np.zeros(0, dtype=np.int64)
            at = 0
            for n in counts:
                if at + n > len(chunk):
                    rest = chunk[at:]
                    more = np.fromfile(f, dtype=np.int64, count=max(_CHUNK_IDS, n))
                    chunk, at = np.concatenate([rest, more]), 0
                yield chunk[at:at + n]
                at += n

    def ids_backward(self) -> Iterator[np.ndarray]:
        """Each request's hash ids, last request first."""
        counts = self.id_counts.tolist()
        end = self.num_ids  # ids before `end` are not read yet
        chunk = np.zeros(0, dtype=np.int64)
        stop = 0  # chunk holds ids [end, end + len(chunk)); requests end at `stop` within it
        with open(self.ids_path, "rb") as f:
            for n in reversed(counts):
                if stop < n:
                    take = min(end, max(_CHUNK_IDS, n))
                    end -= take
                    f.seek(end * 8, os.SEEK_SET)
                    head = np.fromfile(f, dtype=np.int64, count=take)
                    chunk = np.concatenate([head, chunk[:stop]])
                    stop = len(chunk)
                yield chunk[stop - n:stop]
                stop -= n

    def begin_pass(self, tokens_per_block: int) -> None:
        """A run starts: nothing to forget, each pass makes its Request objects afresh and
        their memoised keys go with them (keeping them would make memory grow with the
        trace, which spilling avoids)."""

    def close(self) -> None:
        self._dir.cleanup()
