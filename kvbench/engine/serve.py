"""Serve mode: an iteration loop with arrivals on a clock (DESIGN.md section 3; modeled, or
measured on the GPU by the data plane, `engine/clock.py`).

One step: requests that have arrived join the waiting queue; every decoding request gets its
generation token, and a block when that token starts one (if the pool is dry, the newest running
request is preempted: its computed blocks are committed and released, and it waits to recompute
its prompt and the tokens generated so far, reusing whatever of them is still cached); the
scheduler plans context chunks with reuse *estimates*; the cache adds the new context requests
(`sequential`: match, onboard and allocate one request at a time; `batch`: claim every match
first) and allocates their chunks; delay batching may defer the context requests (with
`revert_deferred_ctx` their blocks for the step are returned at once, without it they stay
held); the tokens actually computed are counted against `max_num_tokens` (an MNT overflow when
reuse fell short of its estimate); the clock advances by the step's modeled time; computed
blocks are committed and finished requests released.

Decode costs Python work per block, not per token: a decoding request has pending events only
where it needs a block or finishes, and runs of steps with no event, no context work and no
arrival are advanced in one jump (the clock has their time in closed form). Such a run changes
nothing but positions, so the jump is exactly the steps it stands for.

Per-step records (`StepRecord`, one per jump too) go to an optional observer, so tests can see
which requests computed which tokens; the compact `Timeline` keeps one row per step or jump for
plots.

With a data plane (`kernels.dataplane.DataPlane`; the manager must emit copy ops) every step,
after all adds and allocations and before any commit, runs the copy ops the step emitted and
then the K/V writes and attention of every token it computes (context chunks of the placed
requests, one token per decoder); deferred requests computed nothing and run nothing. Every
step's attention must run, so there are no jumps then.

`ServeLoop`'s speculative decoding steps are in `serve_spec.py`, its data-plane step in
`serve_plane.py`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from heapq import heappop, heappush

import numpy as np

from ..cache.add import Phase2AllocationError
from ..cache.manager import KVCacheManager
from ..cache.protocol import CacheManager
from ..traffic.request import Request
from .clock import MeasuredClock, ProfileClock, StepClock
from .cross import CrossTally
from .scheduler import ContextWork, Phase, Scheduler, ServeRequest, by_idx
from .serve_plane import PlaneSteps
from .serve_result import (SERVE_COUNTERS, TIMELINE_COLUMNS, ContextChunk, FinishedRequests,
                           ServeResult, StepRecord)
from .serve_spec import SpeculativeSteps
from .speculative import Speculation
from .timeline import Timeline

Clock = StepClock | ProfileClock | MeasuredClock


def run_serve(
    requests: Iterable[Request], manager: CacheManager, scheduler: Scheduler,
    clock: Clock, **options,
) -> ServeResult:
    """Serve `requests` (in arrival order, pulled as they arrive) to completion; `options` as
    `ServeLoop` takes them.
    The caller has checked that each request fits: the KV of its prompt and generated tokens
    in the cache and, without chunked prefill, its longest context in max_num_tokens."""
    return ServeLoop(requests, manager, scheduler, clock, **options).run()


class ServeLoop(SpeculativeSteps, PlaneSteps):
    """The state of one serve-mode run; `run` drives it. Requests are pulled from their
    iterable as the clock reaches them, and a request's state lives only while it waits or
    runs (with `keep_states`, `states` keeps every arrived one, for observers)."""

    __slots__ = (
        "states", "keep_states", "source", "done", "manager", "scheduler", "clock", "revert", "batch_add", "bulk_decode",
        "on_step", "on_progress", "tpb", "mnt", "waiting", "prefilling", "decoders", "dec_k",
        "gen_tokens", "spec", "draft", "draft_plane", "cross", "cross_tally",
        "events", "step", "now", "finished", *SERVE_COUNTERS, "timeline", "block_bytes",
        "data_plane", "_moved", "_row_reused",
        "_row_prompt", "_columns",
        "_tokens", "measured",
    )

    def __init__(
        self, requests: Iterable[Request], manager: CacheManager, scheduler: Scheduler,
        clock: Clock, *, revert_deferred_ctx: bool = False, batch_add: bool = False,
        block_bytes: int = 0, bulk_decode: bool = True, data_plane=None,
        speculation: Speculation | None = None, draft_plane=None,
        cross: KVCacheManager | None = None,
        on_step: Callable[[StepRecord], None] | None = None,
        on_progress: Callable[[int], None] | None = None, keep_states: bool = True,
    ) -> None:
        self.source = iter(requests)
        self.keep_states = keep_states
        self.states: list[ServeRequest] = []
        """Every arrived request's state, in arrival order (empty without keep_states)."""
        self.done = FinishedRequests()
        self.manager = manager
        self.scheduler = scheduler
        self.clock = clock
        self.revert = revert_deferred_ctx
        self.batch_add = batch_add
        self._init_extras(speculation, draft_plane, cross)
        self.bulk_decode = bulk_decode and data_plane is None and speculation is None
        self.data_plane = data_plane
        self.measured = clock.time_source == "measured"
        if self.measured and data_plane is None:
            raise ValueError("a measured clock needs a data plane to measure")
        self.on_step = on_step
        self.on_progress = on_progress
        self.tpb = manager.tpb
        self.mnt = scheduler.max_num_tokens
        self.waiting: list[tuple[int, ServeRequest]] = []
        """Arrived requests holding no sequence, a heap in arrival order."""
        self.prefilling: list[ServeRequest] = []
        """Requests holding a sequence in a context phase, in arrival order."""
        self.decoders: dict[int, ServeRequest] = {}
        self.dec_k = 0
        """Sum over decoders' beams of d_pos0 - d_step0: at step s they read
        dec_k + gen_tokens (s + 1) KV tokens (positions + 1), so no per-step update is needed."""
        self.gen_tokens = 0
        """Tokens the decoders compute per step: one per beam."""
        self.events: list[tuple[int, int, int, ServeRequest]] = []
        """(step, idx, version, request): a decoder's next block boundary or finish."""
        self.step = 0
        self.now = 0.0
        self.finished = 0
        for name in SERVE_COUNTERS:
            setattr(self, name, 0)
        self.timeline = Timeline("step", TIMELINE_COLUMNS, sums=("reused_tokens", "prompt_tokens"))
        self.block_bytes = block_bytes
        """Bytes of one block of a one-pool cache (`CacheManager.moved_bytes`: a windowed
        manager weighs each pool's blocks by its own slot size)."""
        self._moved = 0
        self._row_reused = self._row_prompt = 0
        self._columns = tuple(self.timeline.columns[name] for name in TIMELINE_COLUMNS)
        self._tokens: dict[tuple[int, int], np.ndarray] = {}
        """Stream token ids of running requests' beams for the data plane, built once per
        (request, beam) and context (a trace prompt's tokens are derived per position)."""

    def _init_extras(self, speculation: Speculation | None, draft_plane,
                     cross: KVCacheManager | None) -> None:
        self.spec = speculation
        """Speculative decoding (None = off): decode steps yield 1..k+1 tokens, so every
        step runs on its own (no jumps)."""
        self.draft = getattr(self.manager, "draft", None)
        """The draft model's cache (`cache/mirror.py`: a `MirroredCacheManager`'s, or the
        draft's pools of a `MirroredWindowedCacheManager`), or None."""
        self.draft_plane = draft_plane
        """The draft cache's data plane (with `data_plane`)."""
        self.cross = cross
        """The cross-attention cache of encoder inputs (`engine/cross.py`), or None."""
        self.cross_tally = CrossTally()

    def run(self) -> ServeResult:
        source = self.source
        # One request of lookahead: the next arrival bounds a jump.
        nxt = next(source, None)
        first = self.now = nxt.arrival_s if nxt is not None else 0.0
        arrived = reported = 0
        while nxt is not None or self.finished < arrived:
            while nxt is not None and nxt.arrival_s <= self.now:
                self._arrive(nxt, arrived)
                arrived += 1
                last, nxt = nxt.arrival_s, next(source, None)
                if nxt is not None and nxt.arrival_s < last:
                    raise ValueError("requests must come in arrival order")
            if not (self.decoders or self.prefilling or self.waiting):
                self.now = nxt.arrival_s
                continue
            if self._step() and self.bulk_decode:
                self._jump(nxt.arrival_s if nxt is not None else None)
            if self.on_progress is not None and self.finished - reported >= 256:
                self.on_progress(self.finished - reported)
                reported = self.finished
        if self.on_progress is not None:
            self.on_progress(self.finished - reported)
        return ServeResult(
            finished=self.done, requests=self.states, iterations=self.step,
            duration_s=self.now - first,
            timeline=self.timeline, cross=self.cross_tally,
            **{name: getattr(self, name) for name in SERVE_COUNTERS},
        )

    def _arrive(self, request: Request, idx: int) -> None:
        # Its state is held by the waiting queue (and `states`) alone, so it is freed when
        # the request finishes.
        state = ServeRequest(request, idx)
        heappush(self.waiting, (idx, state))
        if self.keep_states:
            self.states.append(state)

    # --- one step -------------------------------------------------------------------------

    def _step(self) -> bool:
        """Run one step; True when it was pure decode and changed nothing the scheduler looks
        at, so the steps up to the next event or arrival would repeat it."""
        step = self.step
        self.manager.refresh(self.now)
        preempted: list[int] = []
        spec = self.spec
        if spec is None:
            finishing = self._generation_phase(preempted)
        else:
            finishing = self._reserve_drafts(preempted)
        num_gen, gen_tokens = len(self.decoders), self.gen_tokens
        plan = self.scheduler.plan_context(
            self.prefilling, self.waiting, num_gen, num_gen + len(self.prefilling), self.manager,
            gen_tokens=gen_tokens, cross=self.cross)
        if not plan and not num_gen:
            # Running requests hold the blocks the oldest one needs and none can move:
            # suspend the newest (the oldest always fits alone, which the caller checked).
            if not self.prefilling:
                raise RuntimeError("serve loop stalled with nothing running")
            self._preempt(self._newest())
            return False
        try:
            work = self._place(plan)
        except Phase2AllocationError as exc:
            raise Phase2AllocationError(exc.request_id, exc.what, step) from None
        scheduled = gen_tokens + sum(w.chunk for w in work)
        deferred: tuple[int, ...] = ()
        if work and self.scheduler.defer(scheduled, len(work), num_gen):
            self.batch_wait_iterations += 1
            deferred = tuple(w.req.request.id for w in work)
            self._hold_or_revert(work)
            work, scheduled = [], gen_tokens
        tokens, dt = self._compute(work, gen_tokens)
        if self.data_plane is not None:
            check = self._execute(work)
            if self.measured:
                # What the GPU took for the step's work (no data plane work: no time).
                dt = (check.step_ms or 0.0) / 1e3 if check is not None else 0.0
        start_s = self.now
        self.now += dt
        if self.on_step is not None:
            context = tuple(ContextChunk(w.req.request.id, w.start, w.end, w.chunk) for w in work)
            generation = tuple((r.request.id, r.d_pos0 + step - r.d_step0)
                               for r in self.decoders.values())
        if spec is None:
            done = self._finish_context(work)
            for r in finishing:
                if r.phase is Phase.DECODE:
                    self._finish_decode(r)
                    done.append(r.request.id)
        else:
            done = self._accept_drafts(finishing)
            done += self._finish_context(work)
        self._row(step, 1, start_s, num_gen + len(work), scheduled, tokens)
        if self.on_step is not None:
            self.on_step(StepRecord(step, 1, start_s, dt, context, generation, deferred,
                                    tuple(preempted), tuple(done), scheduled, tokens))
        self.step = step + 1
        return not plan and not done and num_gen > 0

    def _compute(self, work: list[ContextWork], gen_tokens: int) -> tuple[int, float | None]:
        """Tokens the step computes and its modeled time (None with a measured clock); counts
        MNT overflow (the actual tokens past the budget, DESIGN.md section 3) and the reuse
        shortfall behind it. A context chunk is computed once for all its beams."""
        chunks = []  # (tokens, cached before them) of every multi-token item, for the clock
        if self.spec is None:
            kv = self.dec_k + gen_tokens * (self.step + 1)  # a beam at position p reads p + 1
            pairs = decode_kv = kv
            decodes = gen_tokens
        else:
            kv = pairs = 0  # a decoder at p computes p .. p + k, reading p + 1 .. p + k + 1
            for r in self.decoders.values():
                t = r.drafts + 1
                kv += r.d_pos0 + t
                pairs += t * r.d_pos0 + t * (t + 1) // 2
                chunks.append((t, r.d_pos0))
            decodes = decode_kv = 0
        tokens = gen_tokens
        ctx_tokens = ctx_pairs = ctx_kv = 0
        for w in work:
            c = w.end - w.start
            ctx_tokens += c
            ctx_pairs += c * w.start + c * (c + 1) // 2
            ctx_kv += w.end
            chunks.append((c, w.start))
            if w.new and w.estimated > w.start:
                self.reuse_shortfall_tokens += w.estimated - w.start
        tokens += ctx_tokens
        pairs += ctx_pairs
        kv += ctx_kv
        encoded = encoded_pairs = 0  # encoder passes of new requests (cross KV not reused)
        for w in work:
            cseq = w.req.cross_seq
            if w.new and cseq is not None:
                n = cseq.request.input_length - cseq.reused_tokens
                encoded += n
                encoded_pairs += n * n
        if tokens > self.mnt:
            self.mnt_overflow_steps += 1
            self.max_mnt_overshoot_tokens = max(self.max_mnt_overshoot_tokens, tokens - self.mnt)
        self.computed_tokens += tokens
        mgr = self.manager
        moved = sum(mgr.moved_bytes(self.block_bytes))
        copy_bytes = moved - self._moved
        self._moved = moved
        if self.measured:
            return tokens, None
        dt = self.clock.step_seconds(tokens, pairs, kv, copy_bytes, chunks=chunks,
                                     decodes=decodes, decode_kv=decode_kv)
        if encoded:
            dt += self.clock.step_seconds(encoded, encoded_pairs, encoded,
                                          chunks=[(encoded, 0)])
        if self.spec is not None:
            dt += self.spec.draft_seconds(
                ctx_tokens, ctx_pairs, ctx_kv,
                [(r.d_pos0, r.drafts) for r in self.decoders.values()])
        return tokens, dt

    def _generation_phase(self, preempted: list[int]) -> list[ServeRequest]:
        """Give each decoder with an event now its next block; returns those finishing."""
        step, tpb, mgr, events = self.step, self.tpb, self.manager, self.events
        finishing = []
        while events and events[0][0] == step:
            _, _, version, r = heappop(events)
            if version != r.version:
                continue
            pos = r.d_pos0 + step - r.d_step0
            if pos % tpb == 0:
                seq = r.seq
                mgr.resize(seq, pos)  # the blocks hold pos tokens already: bookkeeping only
                mgr.commit(seq, pos)
                while not mgr.resize(seq, pos + 1):
                    if self._revert_held():
                        continue
                    victim = self._newest()
                    self._preempt(victim)
                    preempted.append(victim.request.id)
                    if victim is r:
                        break
                if r.phase is not Phase.DECODE:
                    continue
            if step == r.finish_step:
                finishing.append(r)
            else:
                self._push_event(r, step + tpb - pos % tpb)
        return finishing

    def _place(self, plan: list[ContextWork]) -> list[ContextWork]:
        """Add the new context requests to the cache and give every planned chunk its blocks;
        returns the chunks that got them."""
        mgr, cross = self.manager, self.cross
        if self.batch_add:
            new = [w for w in plan if w.new]
            if new:
                for w, seq in zip(new, mgr.add_sequences([w.req.view for w in new])):
                    w.req.seq = seq
            if cross is not None:
                # Only requests with an encoder input go there (TensorRT-LLM's batched add
                # crashed on one without).
                enc = [w.req for w in new if w.req.request.encoder is not None]
                for r, cseq in zip(enc, cross.add_sequences([r.request.encoder for r in enc])):
                    r.cross_seq = cseq
        placed = []
        for w in plan:
            r = w.req
            if w.new:
                if not self.batch_add:
                    r.seq = mgr.add_sequence(r.view)
                    if cross is not None and r.request.encoder is not None:
                        r.cross_seq = cross.add_sequence(r.request.encoder)
                seq = r.seq
                r.phase = Phase.PREFILL
                r.pre_tokens = seq.num_tokens  # its reuse: what a revert keeps
                self.prefilling.append(r)
                w.start = seq.reused_tokens
                w.end = r.context_len if w.last else min(r.context_len, w.start + w.chunk)
                cseq = r.cross_seq
                if cseq is not None and not cross.resize(cseq, cseq.request.input_length):
                    self.ctx_alloc_failures += 1
                    self._unplace(r)
                    continue
            else:
                seq = r.seq
                w.start = seq.num_computed
                w.end = w.start + w.chunk
                if r.pre_tokens < 0:
                    r.pre_tokens = seq.num_tokens
            hold = w.end + self.scheduler.reserve_tokens
            if hold > seq.num_tokens and not mgr.resize(seq, hold):
                # Only a new request whose reuse fell short can miss its blocks: the plan
                # reserved the rest. It waits (without its sequence) for a later step.
                self.ctx_alloc_failures += 1
                self._unplace(r)
                continue
            placed.append(w)
        if len(self.prefilling) > 1:
            self.prefilling.sort(key=by_idx)
        return placed

    def _hold_or_revert(self, work: list[ContextWork]) -> None:
        """Deferred context requests: return the blocks allocated for their step's chunk, or
        keep them held. A new request keeps what it reuses either way (TensorRT-LLM #13805
        resizes it back to the capacity it had before the step's allocation and suspends it):
        it stays a prefilling request, whose next chunk starts after its reuse."""
        mgr = self.manager
        if not self.revert:
            held = sum(w.req.seq.num_blocks - mgr.grow_blocks(w.req.view, 0, w.req.pre_tokens)
                       for w in work)
            self.deferred_ctx_blocks_held_peak = max(self.deferred_ctx_blocks_held_peak, held)
            return
        for w in work:
            self._revert(w.req)

    def _revert(self, r: ServeRequest) -> None:
        """Give back what `r` was allocated for its pending chunk (shrink to `pre_tokens`)."""
        self.deferred_ctx_blocks_reverted += self.manager.shrink(r.seq, r.pre_tokens)
        r.pre_tokens = -1

    def _revert_held(self) -> bool:
        """Before a decoder preempts anyone for a block: revert the newest held deferral (a
        prefilling request still holding its deferred chunk's blocks); False if none."""
        for r in reversed(self.prefilling):
            if r.pre_tokens >= 0:
                self._revert(r)
                return True
        return False

    def _finish_context(self, work: list[ContextWork]) -> list[int]:
        """Commit computed chunks; a finished context phase yields a token. Returns the ids of
        requests that finished with it."""
        mgr, step = self.manager, self.step
        done = []
        for w in work:
            r = w.req
            seq = r.seq
            mgr.commit(seq, w.end)
            r.pre_tokens = -1
            cseq = r.cross_seq
            if w.new and cseq is not None:  # the encoder's KV, written with the first chunk
                self.cross.commit(cseq, cseq.request.input_length)
                if r.reused_tokens < 0:
                    self.cross_tally.count(cseq)
            if r.reused_tokens < 0:
                r.reused_tokens = seq.reused_tokens
                r.reused_tokens_host = seq.reused_tokens_host
                r.reused_partial_tokens = seq.partial_tokens
                r.reused_full_blocks = seq.reused_full_blocks
                if self.draft is not None:
                    d = mgr.draft_of(seq)
                    r.draft_reuse = (d.reused_full_blocks, int(d.partial_tokens > 0))
                self._row_reused += r.reused_tokens
                self._row_prompt += r.request.input_length
            if w.end < r.context_len:
                continue
            self.prefilling.remove(r)
            out = r.request.output_length
            if r.first_token_s < 0:
                r.first_token_s = self.now
            r.generated = min(out, r.generated + 1)
            if r.generated >= out:
                self._release(r)
                done.append(r.request.id)
                continue
            r.phase = Phase.DECODE
            r.d_step0, r.d_pos0, r.d_gen0 = step + 1, r.context_len, r.generated
            r.finish_step = step + out - r.generated
            self.decoders[r.idx] = r
            width = r.request.beam_width
            self.dec_k += width * (r.d_pos0 - r.d_step0)
            self.gen_tokens += width
            if self.spec is None:
                self._push_event(r, r.d_step0 + (-r.d_pos0) % self.tpb)
        return done

    def _finish_decode(self, r: ServeRequest) -> None:
        mgr, seq = self.manager, r.seq
        computed = r.d_pos0 + self.step - r.d_step0 + 1
        if computed > seq.num_tokens:
            mgr.resize(seq, computed)
        mgr.commit(seq, computed)
        self._drop_decoder(r)
        r.generated = r.request.output_length
        self._release(r)

    # --- jumps ----------------------------------------------------------------------------

    def _jump(self, next_arrival: float | None) -> None:
        """Advance the pure-decode steps before the next event and arrival in one go."""
        n = self.gen_tokens
        steps = self.events[0][0] - self.step
        kv = self.dec_k + n * (self.step + 1)
        if next_arrival is not None:
            steps = self.clock.decode_steps_before(n, kv, next_arrival - self.now, steps)
        if steps <= 0:
            return
        start_s = self.now
        dt = self.clock.decode_run_seconds(n, kv, steps)
        self.now += dt
        self.computed_tokens += n * steps
        self._row(self.step, steps, start_s, len(self.decoders), n, n)
        if self.on_step is not None:
            gen = tuple((r.request.id, r.d_pos0 + self.step - r.d_step0)
                        for r in self.decoders.values())
            self.on_step(StepRecord(self.step, steps, start_s, dt, (), gen, (), (), (), n, n))
        self.step += steps

    def _row(self, step: int, steps: int, start_s: float, batch: int, scheduled: int,
             computed: int) -> None:
        pool = self.manager.gpu
        values = (step, steps, round(start_s * 1e6), batch, scheduled, computed,
                  pool.num_in_use, pool.num_cached, len(pool.empty), self._row_reused,
                  self._row_prompt)
        for column, value in zip(self._columns, values):
            column.append(value)
        self._row_reused = self._row_prompt = 0

    # --- request moves --------------------------------------------------------------------

    def _push_event(self, r: ServeRequest, boundary_step: int) -> None:
        heappush(self.events, (min(boundary_step, r.finish_step), r.idx, r.version, r))

    def _newest(self) -> ServeRequest:
        newest = max(self.decoders) if self.decoders else -1
        if self.prefilling and self.prefilling[-1].idx > newest:
            return self.prefilling[-1]
        return self.decoders[newest]

    def _preempt(self, r: ServeRequest) -> None:
        """Suspend a running request: keep what it computed cached, and queue it to recompute
        its prompt and the tokens generated so far."""
        seq = r.seq
        if r.phase is Phase.DECODE:
            computed = r.d_pos0 + self.step - r.d_step0
            r.generated = r.d_gen0 + self.step - r.d_step0
            self._drop_decoder(r)
            if computed > seq.num_tokens:
                self.manager.resize(seq, computed)
            self.manager.commit(seq, computed)
        else:
            self.prefilling.remove(r)
        self.manager.release(seq)
        self._release_cross(r)
        self._drop_tokens(r)
        r.seq = None
        r.pre_tokens = -1
        r.phase = Phase.WAITING
        r.context_len = r.request.input_length + r.generated
        r.view = r.request.view(r.context_len)
        heappush(self.waiting, (r.idx, r))
        self.preemptions += 1

    def _unplace(self, r: ServeRequest) -> None:
        """Undo this step's add of a new context request: it waits again, holding nothing."""
        self.prefilling.remove(r)
        self.manager.release(r.seq)
        self._release_cross(r)
        r.seq = None
        r.pre_tokens = -1
        r.phase = Phase.WAITING
        heappush(self.waiting, (r.idx, r))

    def _release_cross(self, r: ServeRequest) -> None:
        if r.cross_seq is not None:
            self.cross.release(r.cross_seq)
            r.cross_seq = None

    def _drop_decoder(self, r: ServeRequest) -> None:
        del self.decoders[r.idx]
        width = r.request.beam_width
        self.dec_k -= width * (r.d_pos0 - r.d_step0)
        self.gen_tokens -= width
        r.version += 1

    def _drop_tokens(self, r: ServeRequest) -> None:
        for beam in range(-1, r.request.beam_width):
            self._tokens.pop((r.idx, beam), None)

    def _release(self, r: ServeRequest) -> None:
        self._drop_tokens(r)
        self.manager.release(r.seq)
        self._release_cross(r)
        r.seq = None
        r.phase = Phase.DONE
        r.finish_s = self.now
        self.finished += 1
        self.done.add(r)
