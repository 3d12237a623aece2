"""`ServeLoop`'s step on the data plane: the copy ops the step emitted, then the K/V writes and
attention of every token it computes (`_execute`), over the token ids of each running request's
stream (`_stream`)."""

from __future__ import annotations

import numpy as np

from ..kernels.step import beam_tokens
from .cross import cross_ops, cross_step, encoder_ids
from .plane import step_items
from .scheduler import ContextWork, ServeRequest


class PlaneSteps:
    """The data-plane step, mixed into `ServeLoop`: it works on its manager, cross cache, data
    planes, decoders and token cache."""

    __slots__ = ()

    def _execute(self, work: list[ContextWork]):
        """Run the step on the data plane, before anything it computes is committed. With
        sliding windows, each sequence is one item per pool: the blocks from the first one its
        queries read, and the step's scratch pages."""
        mgr, step = self.manager, self.step
        ops = mgr.drain_copy_ops()
        if self.cross is not None:
            cross_ops(self.data_plane, self.cross, ops)
        runs = [(w.req, w.start, w.end, w.new) for w in work]
        for r in self.decoders.values():
            pos = r.d_pos0 + step - r.d_step0
            runs.append((r, pos, pos + 1 + r.drafts, False))
        if self.draft_plane is not None:
            self._execute_draft(runs)
        items, encoder = [], []
        for r, start, end, first in runs:
            view = None
            if r.cross_seq is not None:  # the encoder's KV is written with the first chunk
                view = cross_step(r.request.id, r.cross_seq, self._stream(r, -1), first,
                                  encoder)
            items += step_items(mgr, r.request.id, r.seq, start, end,
                                lambda beam, r=r: self._stream(r, beam), view)
        if ops or items:
            return self.data_plane.execute_step(ops, items, encoder)
        return None

    def _stream(self, r: ServeRequest, beam: int = 0) -> np.ndarray:
        """Token ids of beam `beam` of `r`'s stream; beam -1: its encoder input's
        (`cross.encoder_ids`)."""
        tokens = self._tokens.get((r.idx, beam))
        if tokens is None and beam < 0:
            tokens = self._tokens[(r.idx, beam)] = encoder_ids(r.request.encoder)
        elif tokens is None:
            tokens = self._tokens[(r.idx, beam)] = beam_tokens(
                r.request, beam, r.context_len, r.request.stream_length)
        return tokens
