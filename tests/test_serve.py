"""Serve mode: the iteration loop, checked at every step on small random and constructed runs."""

from types import SimpleNamespace

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Phase, Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.traffic import generate
from kvbench.traffic.request import Request

CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])


def req(i, tokens, out, t=0.0, answer=None):
    tokens = np.asarray(tokens, dtype=np.int64)
    return Request(i, t, len(tokens), out, tokens=tokens,
                   output_tokens=None if answer is None else np.asarray(answer, dtype=np.int64))


class Run:
    """One checked serve run: the loop, its step records and the invariants seen so far."""

    def __init__(self, requests, *, tpb=4, blocks=64, mnt=32, batch=4, chunked=True,
                 wait_iters=0, ratio=0.0, revert=False, batch_add=False, bulk=True,
                 partial=True, check_sanity=True):
        self.requests = requests
        self.tpb, self.mnt, self.batch = tpb, mnt, batch
        self.manager = KVCacheManager(CacheSpec(tpb, blocks, enable_partial_reuse=partial))
        self.manager.enable_sanity_tracking()
        cfg = SchedulerConfig(max_num_tokens=mnt, max_batch_size=batch,
                              enable_chunked_prefill=chunked, batch_wait_timeout_iters=wait_iters,
                              batch_wait_max_tokens_ratio=ratio, revert_deferred_ctx=revert)
        self.revert = revert
        self.check_sanity = check_sanity
        self.loop = ServeLoop(requests, self.manager, Scheduler(cfg, tpb), CLOCK,
                              revert_deferred_ctx=revert, batch_add=batch_add, bulk_decode=bulk,
                              on_step=self._check_step)
        self.records = []
        self.generated = {r.id: 0 for r in requests}
        self.next_pos = {}
        self.blocks_before = {}
        self.result = self.loop.run()
        self._check_end()

    def _check_step(self, rec):
        self.records.append(rec)
        states = self.loop.states
        assert rec.repeat >= 1
        assert len(rec.context) + len(rec.generation) <= self.batch
        assert rec.scheduled_tokens <= self.mnt
        assert rec.computed_tokens == (sum(c.end - c.start for c in rec.context)
                                       + len(rec.generation))
        if rec.deferred:
            assert not rec.context
        if self.revert:
            # A deferred request holds what it held before the step; one added this step
            # keeps what it reuses.
            for i in rec.deferred:
                seq = states[i].seq
                if i in self.blocks_before and i not in rec.preempted:
                    assert len(seq.blocks) == self.blocks_before[i]
                else:
                    assert len(seq.blocks) == -(-seq.reused_tokens // self.tpb)
        for i, pos in rec.generation:
            assert self.next_pos[i] == pos
            self.next_pos[i] = pos + rec.repeat
            self.generated[i] += rec.repeat
        for c in rec.context:
            assert c.start < c.end
            s = states[c.request_id]
            if c.end == s.context_len:
                self.generated[c.request_id] += 1
                self.next_pos[c.request_id] = c.end
        assert not set(rec.preempted) & {i for i, _ in rec.generation}
        if self.check_sanity:
            assert self.manager._check_sanity()
        self.blocks_before = {
            s.request.id: len(s.seq.blocks) for s in states if s.seq is not None}

    def _check_end(self):
        res = self.result
        assert res.iterations == sum(r.repeat for r in self.records)
        for s in res.requests:
            r = s.request
            assert s.phase is Phase.DONE and s.seq is None
            assert s.generated == r.output_length == self.generated[r.id]
            assert r.arrival_s <= s.first_token_s <= s.finish_s
            assert 0 <= s.reused_tokens < r.input_length
        pool = self.manager.gpu
        assert pool.num_in_use == 0, "blocks leaked"
        assert len(pool.empty) + pool.num_cached == pool.capacity
        assert self.manager._check_sanity()

    def times(self):
        return [(s.first_token_s, s.finish_s) for s in self.result.requests]

    def counters(self):
        r = self.result
        m = self.manager
        return (r.iterations, r.preemptions, r.mnt_overflow_steps, r.reuse_shortfall_tokens,
                r.computed_tokens, r.batch_wait_iterations, m.allocated_blocks, m.evicted_blocks,
                [s.reused_tokens for s in r.requests])


def random_requests(seed, n=12, vocab=6, max_out=14, max_len=41):
    """Token prompts drawn from a few shared prefixes, so requests reuse each other; each
    holds at most `max_len` tokens of KV (every setting below fits one alone)."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, vocab, rng.integers(2, 13)) for _ in range(3)]
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(0.004))
        body = rng.integers(0, vocab, rng.integers(1, 11))
        tokens = np.concatenate([prefixes[rng.integers(3)], body])
        top = min(max_out, max_len + 1 - len(tokens))
        out.append(req(i, tokens, int(rng.integers(1, top + 1)), t))
    return out


def sessions(seed, n=16):
    """Interleaved multi-turn sessions whose answers are known: later turns reuse decoded
    blocks, in full and in part."""
    cfg = SimpleNamespace(
        generator="multi_turn", num_requests=n, system_prompt_tokens=5, prompt_tokens=4,
        prompt_tokens_spread=0.5, output_tokens=5, num_users=3, turns=3, arrival="poisson",
        rate=300.0, vocab_size=5)
    return generate(cfg, seed)


TRAFFIC = {"random": random_requests, "sessions": sessions}


def multi_turn(turns=4, first=9, msg=3, answer=5):
    """One session: each turn repeats the previous prompt and answer."""
    out, context = [], np.arange(100, 100 + first)
    for i in range(turns):
        ans = np.arange(1000 * (i + 1), 1000 * (i + 1) + answer)
        out.append(req(i, context, answer, t=0.05 * i, answer=ans))
        context = np.concatenate([context, ans, np.arange(500 + 10 * i, 500 + 10 * i + msg)])
    return out


SETTINGS = [
    dict(),
    dict(blocks=14, batch=3),                      # tight cache: preemptions
    dict(mnt=8, chunked=True),                     # small budget: chunks
    dict(mnt=64, chunked=False, blocks=40),
    dict(wait_iters=3, ratio=0.9),                 # delay batching, blocks held
    dict(wait_iters=3, ratio=0.9, revert=True),    # delay batching with revert
    dict(wait_iters=2, ratio=0.6, revert=True, blocks=14, batch=3),
    dict(batch_add=True, blocks=16),
    dict(partial=False, tpb=3, blocks=24),
]


@pytest.mark.parametrize("settings", SETTINGS, ids=[str(s) for s in SETTINGS])
@pytest.mark.parametrize("traffic", TRAFFIC)
@pytest.mark.parametrize("seed", range(5))
def test_invariants_at_every_step(settings, traffic, seed):
    Run(TRAFFIC[traffic](seed), **settings)


@pytest.mark.parametrize("settings", SETTINGS, ids=[str(s) for s in SETTINGS])
def test_bulk_decode_is_exactly_the_steps_it_jumps(settings):
    requests = random_requests(7, n=16, max_out=40)
    bulk = Run(requests, **settings)
    step = Run(requests, bulk=False, **settings)
    assert bulk.counters() == step.counters()
    assert [s.generated for s in bulk.result.requests] == [s.generated for s in step.result.requests]
    for a, b in zip(bulk.times(), step.times()):
        assert a == pytest.approx(b, rel=1e-12, abs=1e-12)
    assert any(r.repeat > 1 for r in bulk.records)
    assert all(r.repeat == 1 for r in step.records)
    assert len(bulk.records) < len(step.records)


@pytest.mark.parametrize("revert", [False, True])
def test_zero_timeout_is_no_delay_batching_exactly(revert):
    requests = random_requests(3, n=16)
    off = Run(requests, blocks=20, batch=3)
    zero = Run(requests, blocks=20, batch=3, wait_iters=0, ratio=0.9, revert=revert)
    assert off.counters() == zero.counters()
    assert off.times() == zero.times()
    assert [(r.index, r.repeat, r.context, r.generation, r.preempted) for r in off.records] == [
        (r.index, r.repeat, r.context, r.generation, r.preempted) for r in zero.records]
    assert zero.result.batch_wait_iterations == 0


def test_pinned_schedule():
    """A small scenario's schedule, step by step: a change here must be deliberate.

    tpb 4, MNT 12, batch 3. Request 0 (14 tokens, 3 out) is chunked 12 + 2 and decodes alone.
    Requests 1 and 2 arrive together once it has finished. Request 1 shares 0's first 8 tokens:
    its window starts after the reuse and keeps the full 12-token budget (reuse shifts the chunk,
    it does not shrink it), so request 2 waits a step. Generation tokens come first, and chunks
    of a context that does not fit are whole blocks."""
    a = np.arange(14)
    requests = [
        req(0, a, 3, t=0.0),
        req(1, np.concatenate([a[:8], np.arange(50, 64)]), 4, t=0.03),
        req(2, np.arange(200, 216), 2, t=0.03),
    ]
    run = Run(requests, tpb=4, blocks=32, mnt=12, batch=3)
    steps = [(r.index, r.repeat, [(c.request_id, c.start, c.end) for c in r.context],
              list(r.generation), r.finished) for r in run.records]
    assert steps == [
        (0, 1, [(0, 0, 12)], [], ()),
        (1, 1, [(0, 12, 14)], [], ()),
        (2, 1, [], [(0, 14)], ()),
        (3, 1, [], [(0, 15)], (0,)),
        (4, 1, [(1, 8, 20)], [], ()),
        (5, 1, [(1, 20, 22), (2, 0, 8)], [], ()),
        (6, 1, [(2, 8, 16)], [(1, 22)], ()),
        (7, 1, [], [(1, 23), (2, 16)], (2,)),
        (8, 1, [], [(1, 24)], (1,)),
    ]
    assert run.records[4].start_s == 0.03  # idle until the arrivals
    assert [s.reused_tokens for s in run.result.requests] == [0, 8, 0]


def test_delay_batching_defers_new_context_until_timeout():
    # Request 0 decodes a long answer; request 1 arrives while it does. With a ratio no step
    # reaches, request 1 waits exactly `timeout` steps, then runs.
    requests = [req(0, np.arange(8), 30), req(1, np.arange(100, 108), 2, t=0.02)]
    plain = Run(requests, mnt=32)
    for revert in (False, True):
        run = Run(requests, mnt=32, wait_iters=4, ratio=1.0, revert=revert)
        deferred = [r.index for r in run.records if r.deferred]
        assert len(deferred) == 4 == run.result.batch_wait_iterations
        assert deferred == list(range(deferred[0], deferred[0] + 4))
        ttft = [s.first_token_s - s.request.arrival_s for s in run.result.requests]
        base = [s.first_token_s - s.request.arrival_s for s in plain.result.requests]
        assert ttft[0] == base[0] and ttft[1] > base[1]
        if revert:
            # Two blocks (8 tokens) allocated and returned at each of the 4 deferred steps.
            assert run.result.deferred_ctx_blocks_reverted == 8
            assert run.result.deferred_ctx_blocks_held_peak == 0
        else:
            assert run.result.deferred_ctx_blocks_reverted == 0
            assert run.result.deferred_ctx_blocks_held_peak == 2


def test_delay_batching_stops_waiting_at_the_token_ratio():
    requests = [req(0, np.arange(8), 30), req(1, np.arange(100, 120), 2, t=0.02)]
    # 20 context tokens + 1 generation token = 21 >= 0.5 * 32: no wait.
    run = Run(requests, mnt=32, wait_iters=4, ratio=0.5)
    assert run.result.batch_wait_iterations == 0
    run = Run(requests, mnt=32, wait_iters=4, ratio=0.7)
    assert run.result.batch_wait_iterations == 4


def test_preemption_suspends_the_newest_and_recomputes_it():
    # 6 blocks of 4 tokens; each request needs 4 blocks for 4 prompt + 11 generated tokens.
    requests = [req(0, np.arange(4), 12), req(1, np.arange(50, 54), 12)]
    run = Run(requests, tpb=4, blocks=6, mnt=16, batch=2)
    assert run.result.preemptions >= 1
    assert all(i == 1 for r in run.records for i in r.preempted)
    s0, s1 = run.result.requests
    assert s0.finish_s < s1.finish_s
    # Request 1 recomputed its prompt and the tokens it had generated: a longer context.
    assert s1.context_len > requests[1].input_length


def test_reuse_shortfall_overflows_mnt_with_sequential_add_only():
    """Request 2's estimate counts request 0's cached blocks; with sequential add, request 1's
    allocation (FCFS, same step) evicts two of them first, so 2 computes 8 more tokens than
    budgeted: an MNT overflow. The two-phase batched add claims them first: no overflow."""
    a = np.arange(16)
    requests = [
        req(0, a, 1, t=0.0),                                   # leaves 4 blocks cached
        req(1, np.arange(100, 116), 1, t=0.1),                 # 4 more, newer in the LRU
        req(2, np.arange(200, 216), 1, t=0.2),                 # no reuse: 4 new blocks
        req(3, np.concatenate([a, [7, 7, 7, 7]]), 1, t=0.2),   # estimates 16 reused tokens
    ]
    seq = Run(requests, tpb=4, blocks=10, mnt=20, batch=4)
    assert seq.result.reuse_shortfall_tokens == 8
    assert seq.result.mnt_overflow_steps == 1 and seq.result.max_mnt_overshoot_tokens == 8
    last = seq.records[-1]
    assert [(c.request_id, c.start, c.end, c.scheduled) for c in last.context] == [
        (2, 0, 16, 16), (3, 8, 20, 4)]
    batch = Run(requests, tpb=4, blocks=10, mnt=20, batch=4, batch_add=True)
    assert batch.result.reuse_shortfall_tokens == 0
    assert batch.result.mnt_overflow_steps == 0
    assert batch.result.requests[3].reused_tokens == 16


def test_decode_blocks_are_reused_by_the_next_turn():
    run = Run(multi_turn(), tpb=4, blocks=64)
    reused = [s.reused_tokens for s in run.result.requests]
    # Turn k+1 reuses turn k's prompt and answer, up to the last full block with computed KV.
    for k, (prev, nxt) in enumerate(zip(run.requests, run.requests[1:])):
        kv = prev.input_length + prev.output_length - 1
        assert reused[k + 1] >= kv // 4 * 4
    assert reused[0] == 0


def test_requests_finishing_alone_and_one_token_outputs():
    run = Run([req(0, np.arange(5), 1), req(1, np.arange(5), 1, t=1.0)])
    assert [r.iterations for r in [run.result]] == [2]
    assert run.result.requests[1].reused_tokens == 4


def test_no_chunking_waits_for_a_budget_that_fits():
    requests = [req(0, np.arange(8), 20), req(1, np.arange(100, 130), 2, t=0.001)]
    run = Run(requests, mnt=30, chunked=False, batch=2)
    ctx = [c for r in run.records for c in r.context if c.request_id == 1]
    # 30 tokens never fit beside a generation token: request 1 runs once 0 has finished.
    assert [(c.start, c.end) for c in ctx] == [(0, 30)]
    assert run.result.requests[1].first_token_s > run.result.requests[0].finish_s


def test_step_time_follows_the_clock():
    run = Run([req(0, np.arange(8), 3)])
    first = run.records[0]
    assert first.duration_s == pytest.approx(CLOCK.step_seconds(8, 8 * 9 // 2, 8))
    assert run.result.duration_s == pytest.approx(sum(r.duration_s for r in run.records))


def test_timeline_rows_match_records():
    run = Run(random_requests(1), blocks=20)
    cols = run.result.timeline.columns
    assert list(cols["step"]) == [r.index for r in run.records]
    assert list(cols["steps"]) == [r.repeat for r in run.records]
    assert list(cols["computed_tokens"]) == [r.computed_tokens for r in run.records]
    assert list(cols["time_us"]) == [round(r.start_s * 1e6) for r in run.records]
    assert all(u + c + f == 20 for u, c, f in zip(cols["in_use"], cols["cached"], cols["free"]))
