"""`ServeLoop`'s speculative decoding steps: each decoder's blocks for the drafts it verifies
(`_reserve_drafts`), the accepted drafts committed (`_accept_drafts`), and the draft model's
own K/V on its data plane (`_execute_draft`). The drafts' count, acceptance and time are
`engine/speculative.py`'s `Speculation`."""

from __future__ import annotations

from .plane import step_items
from .scheduler import Phase, ServeRequest, by_idx


class SpeculativeSteps:
    """The speculative steps, mixed into `ServeLoop`: they work on its manager (a
    mirrored cache with a draft, `cache/mirror.py`), decoders, data planes and `spec`."""

    __slots__ = ()

    def _reserve_drafts(self, preempted: list[int]) -> list[ServeRequest]:
        """Speculative decoding: each decoder (oldest first) gets blocks for the tokens it
        verifies this step and the reserved extra tokens, preempting the newest running
        request when the pool is dry. Returns the decoders that compute this step."""
        mgr, spec = self.manager, self.spec
        for r in sorted(self.decoders.values(), key=by_idx):
            if r.phase is not Phase.DECODE:
                continue  # preempted for an older decoder
            r.drafts = spec.drafts(r.request.output_length - r.generated)
            seq = r.seq
            need = max(seq.num_tokens, r.d_pos0 + 1 + r.drafts + spec.reserved)
            while not mgr.resize(seq, need):
                victim = self._newest()
                self._preempt(victim)
                preempted.append(victim.request.id)
                if victim is r:
                    break
        computing = sorted(self.decoders.values(), key=by_idx)
        self.gen_tokens = sum(r.drafts + 1 for r in computing)
        return computing

    def _accept_drafts(self, computing: list[ServeRequest]) -> list[int]:
        """After a speculative step: draw each decoder's accepted drafts, commit the valid KV
        and advance it (re-anchored at the next step); returns the ids that finished."""
        mgr, spec, step = self.manager, self.spec, self.step
        done = []
        for r in computing:
            produced = spec.accept(r.drafts) + 1
            pos = r.d_pos0 + produced
            r.generated += produced
            mgr.commit(r.seq, pos)
            self._drop_decoder(r)  # and back in with its new anchor, unless it finished
            if r.generated >= r.request.output_length:
                r.generated = r.request.output_length
                self._release(r)
                done.append(r.request.id)
                continue
            r.d_step0, r.d_pos0, r.d_gen0 = step + 1, pos, r.generated
            self.decoders[r.idx] = r
            self.dec_k += r.d_pos0 - r.d_step0
            self.gen_tokens += 1
        return done

    def _execute_draft(self, runs: list[tuple[ServeRequest, int, int, bool]]) -> None:
        """The draft model's KV on its own data plane, at the target's positions: it prefills
        the step's context chunks and, for a decoder at `p`, writes `p .. p + k`: the
        positions it drafts from and the last draft's. A drafter computes that last one at
        its next step when every draft was accepted; written in this step, the draft cache
        holds the KV of every token the target commits, so no step reads back before the
        target's position and a finished request's blocks are whole when stored for
        reuse."""
        draft = self.draft
        ops = draft.drain_copy_ops()
        items = []
        for r, start, end, _ in runs:
            items += step_items(draft, r.request.id, self.manager.draft_of(r.seq), start, end,
                                lambda beam, r=r: self._stream(r))
        if ops or items:
            self.draft_plane.execute_step(ops, items)
