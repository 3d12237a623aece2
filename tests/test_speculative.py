"""Speculative decoding in serve mode: exact extra-token reservations, 1..k+1 tokens per decode
step from a seeded acceptance rate, the scheduler's block estimate with the reservation equal
to what the add takes, a draft model's cache mirroring the target's block for block (checked
at every step), the clock charging draft and verification, and both data planes verified."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.mirror import MirroredCacheManager
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Phase, Scheduler, ServeRequest
from kvbench.engine.serve import ServeLoop
from kvbench.engine.speculative import Speculation
from kvbench.traffic.request import Request

TARGET = ModelConfig()
DRAFT = ModelConfig(num_layers=2, num_kv_heads=8, num_q_heads=32, head_dim=128)
CLOCK = StepClock(TARGET, PRESETS["H100-SXM"])
DRAFT_CLOCK = StepClock(DRAFT, PRESETS["H100-SXM"])


def req(i, tokens, out, t=0.0):
    tokens = np.asarray(tokens, dtype=np.int64)
    return Request(i, t, len(tokens), out, tokens=tokens)


def random_requests(seed, n=10):
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 5, 10)
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(0.003))
        tokens = np.concatenate([base[:int(rng.integers(0, 11))], rng.integers(0, 5, 5)])
        out.append(req(i, tokens, int(rng.integers(1, 14)), t))
    return out


def serve(requests, *, k=2, rate=0.6, extra=0, draft=False, tpb=4, blocks=40, host=0,
          mnt=48, batch=4, batch_add=True, planes=None, draft_clock=DRAFT_CLOCK, seed=0,
          emit_draft=True):
    emit = planes is not None
    target = KVCacheManager(CacheSpec(tpb, blocks, num_host_blocks=host, emit_copy_ops=emit))
    manager = target
    if draft:
        manager = MirroredCacheManager(target, KVCacheManager(CacheSpec(
            tpb, blocks, num_host_blocks=host, emit_copy_ops=emit and emit_draft)))
    manager.enable_sanity_tracking()
    spec = Speculation(k, rate, extra, seed, draft_clock if draft else None)
    sched = Scheduler(SchedulerConfig(max_num_tokens=mnt, max_batch_size=batch), tpb,
                      reserve_tokens=k + extra)
    records, holds = [], []
    loop = None

    def on_step(rec):
        records.append(rec)
        assert manager._check_sanity()
        assert rec.scheduled_tokens <= mnt
        for r in loop.decoders.values():
            if r.d_step0 == rec.index + 1 and r.seq is not None:
                holds.append((r.request.id, r.d_pos0, r.seq.num_tokens))

    plane, draft_plane = planes or (None, None)
    loop = ServeLoop(requests, manager, sched, CLOCK, batch_add=batch_add, data_plane=plane,
                     speculation=spec, draft_plane=draft_plane, on_step=on_step)
    result = loop.run()
    assert all(s.phase is Phase.DONE and s.generated == s.request.output_length
               for s in result.requests)
    assert target.gpu.num_in_use == 0 and manager._check_sanity()
    return manager, result, records, spec, holds


@pytest.mark.parametrize("k, extra", [(2, 1), (0, 1), (0, 3)])
def test_reservation_is_exact_every_step(k, extra):
    """tpb 4, a 6-token prompt, k drafts and `extra` reserved KV tokens (k = 2, extra = 1: the
    context step leaves the sequence holding 6 + 2 + 1 = 9 tokens, 3 blocks); a decode step at
    position p holds p + 1 + k + extra tokens (fewer drafts near the end; never less than it
    held before). Reserved tokens without drafts are held the same way."""
    target = KVCacheManager(CacheSpec(4, 40))
    target.enable_sanity_tracking()
    sched = Scheduler(SchedulerConfig(max_num_tokens=48, max_batch_size=4), 4,
                      reserve_tokens=k + extra)
    seen = []

    def on_step(rec):
        s = loop.states[0]
        if s.seq is None:
            return
        pos = rec.generation[0][1] if rec.generation else None
        seen.append((pos, s.drafts, s.seq.num_tokens, len(s.seq.blocks)))
        assert target._check_sanity()

    loop = ServeLoop([req(0, range(6), 12)], target, sched, CLOCK,
                     speculation=Speculation(k, 0.5, extra, 0), on_step=on_step)
    loop.run()
    held = 6 + k + extra
    assert seen[0] == (None, 0, held, -(-held // 4))
    for pos, drafts, num_tokens, blocks in seen[1:]:
        assert drafts == min(k, 12 - (pos - 6 + 1) - 1)
        held = max(held, pos + 1 + drafts + extra)
        assert num_tokens == held and blocks == -(-held // 4)
    assert len(seen) > 3


@pytest.mark.parametrize("rate,k", [(1.0, 3), (0.0, 3), (0.6, 2)])
def test_tokens_per_step_follow_acceptance(rate, k):
    out = 14
    m, result, records, spec, _ = serve([req(0, range(5), out)], k=k, rate=rate, blocks=20)
    decode_steps = sum(1 for rec in records if rec.generation)
    if rate == 1.0:  # k + 1 tokens each step, the last one shortened
        assert decode_steps == -(-(out - 1) // (k + 1))
        assert spec.accepted_tokens == spec.draft_tokens
    elif rate == 0.0:
        assert decode_steps == out - 1 and spec.accepted_tokens == 0
    else:
        assert 0 < spec.accepted_tokens < spec.draft_tokens
    assert spec.produced_tokens == out - 1 and spec.decode_steps == decode_steps
    # The step computes the verified tokens: one plus the drafts, each step.
    for rec in records:
        if rec.generation and not rec.context:
            assert 1 <= rec.computed_tokens <= k + 1


def test_acceptance_is_seeded():
    a = serve(random_requests(2), seed=5)[1]
    b = serve(random_requests(2), seed=5)[1]
    c = serve(random_requests(2), seed=6)[1]
    assert [s.finish_s for s in a.requests] == [s.finish_s for s in b.requests]
    assert a.iterations != c.iterations or a.duration_s != c.duration_s


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
@pytest.mark.parametrize("seed", range(3))
def test_draft_cache_mirrors_target_under_pressure(seed, batch_add):
    m, result, _, _, _ = serve(random_requests(seed, n=14), draft=True, k=3, extra=1,
                               blocks=16, host=4, batch_add=batch_add)
    assert isinstance(m, MirroredCacheManager)
    assert m.draft.gpu.peak_in_use == m.target.gpu.peak_in_use
    assert m.draft.onboard_blocks == m.target.onboard_blocks


def test_estimate_with_reservation_equals_consumption():
    m = KVCacheManager(CacheSpec(4, 60, num_host_blocks=8))
    m.enable_sanity_tracking()
    for i in range(3):
        r = req(100 + i, list(range(i, i + 14)), 1)
        s = m.add_sequence(r)
        m.resize(s, 14)
        m.commit(s, 14)
        m.release(s)
    reserve = 5
    sched = Scheduler(SchedulerConfig(max_num_tokens=512, max_batch_size=8), 4,
                      reserve_tokens=reserve)
    states = [ServeRequest(Request(i, 0.0, 14 + i, 4, tokens=np.arange(i * 50, i * 50 + 14 + i),
                                   namespace=i), i) for i in range(3)]
    states.append(ServeRequest(req(3, list(range(0, 14)) + [9], 4), 3))
    plan = sched.plan_context([], [(s.idx, s) for s in states], 0, 0, m)
    need = 0
    for w in plan:
        _, blocks, draw = m.estimate_add(w.req.view)
        need += draw + m.grow_blocks(w.req.view, blocks, w.estimated + w.chunk + reserve)
    free = m.gpu.num_free
    seqs = m.add_sequences([w.req.view for w in plan])
    for w, seq in zip(plan, seqs):
        assert m.resize(seq, w.estimated + w.chunk + reserve)
    assert free - m.gpu.num_free == need and m._check_sanity()


def test_clock_charges_draft_and_verification():
    spec = Speculation(3, 1.0, 0, 0, DRAFT_CLOCK)
    decoders = [(100, 3), (50, 1)]
    expected = (DRAFT_CLOCK.step_seconds(2, 101 + 51, 101 + 51)
                + DRAFT_CLOCK.step_seconds(1, 102, 102) + DRAFT_CLOCK.step_seconds(1, 103, 103))
    assert spec.draft_seconds(0, 0, 0, decoders) == pytest.approx(expected)
    assert Speculation(3, 1.0, 0, 0).draft_seconds(10, 10, 10, decoders) == 0.0
    # Same requests, same acceptance: the draft model's work makes the run longer, and
    # verifying k + 1 tokens a step makes each step longer than a plain decode step.
    reqs = [req(0, range(8), 20)]
    one = serve(reqs, k=3, rate=1.0, draft=False)[1]
    two = serve([req(0, range(8), 20)], k=3, rate=1.0, draft=True)[1]
    assert two.duration_s > one.duration_s
    assert two.iterations == one.iterations


def plane(blocks, model, host=0, tpb=4):
    pytest.importorskip("torch")
    from kvbench.kernels.dataplane import DataPlane
    from kvbench.kernels.step import ModelShape, PoolSpec
    return DataPlane(ModelShape(model[0], 2, 4, 16, tpb, "bfloat16"),
                     [PoolSpec(tuple(range(model[0])), blocks, num_host_slots=host)])


def test_data_planes_verify_target_and_draft():
    target, draft = plane(16, (2,), host=4), plane(16, (1,), host=4)
    m, result, _, _, _ = serve(random_requests(4, n=12), draft=True, k=2, extra=1, blocks=16,
                               host=4, planes=(target, draft))
    for p in (target, draft):
        metrics = p.metrics()
        assert metrics["verified"] is True, metrics["verify_mismatch"]
        assert p.steps > 0
    assert m.onboard_blocks > 0


@pytest.mark.parametrize("seed", range(3))
def test_draft_kv_is_whole_when_a_next_turn_reuses_the_answer(seed):
    """Every draft accepted: the last draft of a request's final step is written in that
    step, so a conversation's next turn, reusing the answer's blocks from the draft cache,
    reads KV the draft computed (it used to be left for a catch-up step that never came)."""
    from test_windows_draft import requests as conversations, reused_an_answer

    target, draft = plane(60, (2,)), plane(60, (1,))
    _, result, *_ = serve(conversations(seed), draft=True, k=2, rate=1.0, blocks=60,
                          planes=(target, draft))
    for p in (target, draft):
        metrics = p.metrics()
        assert metrics["verified"] is True, metrics["verify_mismatch"]
    assert reused_an_answer(result)


def test_draft_plane_catches_missing_copies():
    """A draft cache whose onboards never reach its data plane reads stale KV."""
    target, draft = plane(16, (2,), host=4), plane(16, (1,), host=4)
    m, *_ = serve(random_requests(4, n=12), draft=True, k=2, extra=1, blocks=16, host=4,
                  planes=(target, draft), emit_draft=False)
    assert m.onboard_blocks > 0
    assert target.metrics()["verified"] is True
    assert draft.metrics()["verified"] is False


def test_speculative_workload_keys(tmp_path):
    from kvbench.config import load_workload
    from kvbench.errors import InputError
    from kvbench.runner import run_workload

    path = tmp_path / "w.yaml"
    path.write_text(
        "model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}\n"
        "cache: {tokens_per_block: 8, max_tokens: 2048}\n"
        "scheduler: {max_num_tokens: 256, max_batch_size: 16}\n"
        "requests: {synthetic: {num_requests: 20, system_prompt_tokens: 20, prompt_tokens: 12,"
        " output_tokens: 9}}\n"
        "speculative: {max_draft_len: 2, num_extra_kv_tokens: 1,\n"
        "  draft_model: {num_layers: 1, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}}\n"
        "run: {mode: serve, progress: false}\n")
    (out,) = run_workload(load_workload(path))
    m = out.metrics
    # A draft block is half a target block (1 layer of 2): the budget holds 2/3 as many.
    assert m["gpu_blocks_total"] == m["draft_gpu_blocks_total"] == 2048 // 8 * 2 // 3
    assert m["draft_peak_gpu_blocks"] == m["peak_gpu_blocks"] > 0
    assert m["peak_kv_bytes"] == m["peak_gpu_bytes"] + m["draft_peak_gpu_bytes"]
    assert m["draft_reused_full_blocks"] == m["reused_full_blocks"]
    assert 1 <= m["tokens_per_decode_step"] <= 3
    # Cache mode: the draft's cache mirrors every prompt from the same budget; drafting
    # alone (no draft model) changes nothing without decode steps, so it is refused.
    (cache,) = run_workload(load_workload(path, ["run.mode=cache"]))
    c = cache.metrics
    assert c["gpu_blocks_total"] == c["draft_gpu_blocks_total"] == m["gpu_blocks_total"]
    assert c["draft_reused_full_blocks"] == c["reused_full_blocks"] > 0
    assert c["peak_kv_bytes"] == c["peak_gpu_bytes"] + c["draft_peak_gpu_bytes"]
    with pytest.raises(InputError, match="without a draft_model outside run.mode: serve"):
        run_workload(load_workload(path, ["run.mode=cache", "speculative.draft_model=null"]))
    with pytest.raises(InputError, match="beam search"):
        run_workload(load_workload(path, ["requests.beam_width=2"]))
    # Reserved tokens alone (no drafts) are held past every decode step's token too (a decode
    # at a block boundary found its sequence already longer: "resize cannot shrink").
    plain = ["speculative.draft_model=null", "speculative.max_draft_len=0",
             "speculative.num_extra_kv_tokens=0", "cache.tokens_per_block=4"]
    (base,) = run_workload(load_workload(path, plain))
    for extra in ("speculative.num_extra_decoding_steps=1", "speculative.num_extra_kv_tokens=3"):
        (held,) = run_workload(load_workload(path, [*plain, extra]))
        h = held.metrics
        assert h["requests"] == 20 and h["tokens_per_decode_step"] == 1.0
        assert h["draft_tokens"] == 0 and h["draft_acceptance"] is None
        assert h["peak_gpu_blocks"] >= base.metrics["peak_gpu_blocks"]
    path.write_text("speculative: {acceptance_rate: 1.5}\n")
    with pytest.raises(InputError, match=r"w.yaml:1:\d+.*speculative.acceptance_rate"):
        load_workload(path)
