"""The data plane in serve mode: every step's copy ops, context chunks and decode tokens run on
paged tensors and are checked against dense recomputation, through reuse, partial reuse, host
offload with both add paths, chunked prefill, preemption, delay batching and sliding-window
pools with scratch slots; injected manager faults must be caught."""

from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.cache.ids import CopyKind  # noqa: E402
from kvbench.cache.manager import CacheSpec, KVCacheManager  # noqa: E402
from kvbench.cache.lifecycle import life_cycles  # noqa: E402
from kvbench.cache.windows import WindowedCacheManager  # noqa: E402
from kvbench.config import ModelConfig, SchedulerConfig, load_workload  # noqa: E402
from kvbench.engine.clock import PRESETS, StepClock  # noqa: E402
from kvbench.engine.scheduler import Scheduler  # noqa: E402
from kvbench.engine.serve import ServeLoop  # noqa: E402
from kvbench.errors import InputError  # noqa: E402
from kvbench.kernels.dataplane import DataPlane  # noqa: E402
from kvbench.kernels.step import ModelShape, PoolSpec  # noqa: E402
from kvbench.runner import run_workload  # noqa: E402
from kvbench.traffic import generate  # noqa: E402
from kvbench.traffic.request import Request  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
VERIFY_SERVE = ROOT / "workloads" / "verify-serve-small.yaml"
CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])
ATOL = 1.6e-2
"""Outputs are O(1); bfloat16's output tolerance (verify.py) bounds what a pass may show."""


def req(i, tokens, out, t=0.0):
    tokens = np.asarray(tokens, dtype=np.int64)
    return Request(i, t, len(tokens), out, tokens=tokens)


def chat(seed, n=24, users=6, turns=4, system=8, prompt=6, out=6, rate=400.0):
    """Multi-turn sessions with known answers: later turns reuse prompt and decode blocks, in
    full and in part (a small vocabulary makes partial matches common)."""
    cfg = SimpleNamespace(
        generator="multi_turn", num_requests=n, system_prompt_tokens=system,
        prompt_tokens=prompt, prompt_tokens_spread=0.5, output_tokens=out, num_users=users,
        turns=turns, arrival="poisson", rate=rate, vocab_size=5)
    return generate(cfg, seed)


class Serve:
    """One serve run on the torch data plane (2 layers, 2 KV heads, head_dim 16), with the
    manager's sanity checked, the step records kept and the work each plane step ran."""

    def __init__(self, requests, *, tpb=4, blocks=48, host=0, mnt=32, batch=6, chunked=True,
                 wait_iters=0, ratio=0.0, revert=False, batch_add=False, partial=True,
                 manager_cls=KVCacheManager):
        # What the runner checks: each request fits the cache alone.
        assert max(-(-(r.input_length + r.output_length - 1) // tpb) for r in requests) <= blocks
        spec = CacheSpec(tpb, blocks, num_host_blocks=host, enable_partial_reuse=partial,
                         emit_copy_ops=True)
        self.manager = manager_cls(spec)
        self.manager.enable_sanity_tracking()
        self.plane = DataPlane(ModelShape(2, 2, 4, 16, tpb, "bfloat16"),
                               [PoolSpec((0, 1), blocks, num_host_slots=host)])
        cfg = SchedulerConfig(max_num_tokens=mnt, max_batch_size=batch,
                              enable_chunked_prefill=chunked, batch_wait_timeout_iters=wait_iters,
                              batch_wait_max_tokens_ratio=ratio, revert_deferred_ctx=revert)
        self.records = []
        loop = ServeLoop(requests, self.manager, Scheduler(cfg, tpb), CLOCK,
                         revert_deferred_ctx=revert, batch_add=batch_add, data_plane=self.plane,
                         on_step=self.records.append)
        self.ran = {}
        execute = self.plane.execute_step

        def record(ops, items, encoder=()):
            self.ran[loop.step] = sorted((it.request_id, it.start, it.end) for it in items)
            return execute(ops, items, encoder)

        self.plane.execute_step = record
        self.result = loop.run()
        assert self.manager._check_sanity()

    def assert_verified(self):
        m = self.plane.metrics()
        assert m["verified"] is True, m["verify_mismatch"]
        assert 0.0 <= m["max_abs_err"] <= ATOL
        # Every step ran on its own (no jumps) and every plane step was checked.
        assert all(rec.repeat == 1 for rec in self.records)
        assert self.plane.verified_steps == self.plane.steps <= self.result.iterations
        # The plane ran exactly the tokens each step computed: placed chunks and one token
        # per decoder, nothing of deferred or preempted requests.
        for rec in self.records:
            expected = sorted([(c.request_id, c.start, c.end) for c in rec.context]
                              + [(i, p, p + 1) for i, p in rec.generation])
            assert self.ran.get(rec.index, []) == expected, rec
        return m


def test_prefix_and_decode_reuse_with_partial_matches():
    run = Serve(chat(0))
    run.assert_verified()
    states = run.result.requests
    assert sum(s.reused_tokens for s in states) > 0 and sum(s.reused_partial_tokens for s in states) > 0


def test_partial_reuse_by_copy_and_by_claim():
    base = np.arange(1000, 1010)
    run = Serve([
        req(0, base, 1),                                       # blocks 0 1 [2: 2-token tail]
        req(1, np.concatenate([base[:6], [7, 7, 7]]), 1, 1.0),  # block 1 has a child: copy
        req(2, np.concatenate([base, [5, 5, 5]]), 1, 2.0),      # the tail is unshared: claim
    ])
    run.assert_verified()
    assert run.manager.partial_copy_blocks == 1
    assert [s.reused_partial_tokens for s in run.result.requests] == [0, 2, 2]


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
def test_host_offload_with_both_add_paths(batch_add):
    run = Serve(chat(1, n=32, users=8, system=12), blocks=24, host=16, batch=8,
                batch_add=batch_add)
    run.assert_verified()
    m = run.manager
    assert m.onboard_blocks > 0 and m.offload_blocks > 0
    assert run.result.requests and sum(s.reused_tokens_host for s in run.result.requests) > 0


def test_chunked_prefill_without_reuse():
    rng = np.random.default_rng(2)
    requests = [req(i, rng.integers(0, 9999, int(rng.integers(9, 30))), 4, 0.001 * i)
                for i in range(8)]
    run = Serve(requests, mnt=8, batch=4, partial=False)
    run.assert_verified()
    chunked = {c.request_id for rec in run.records for c in rec.context
               if c.end < run.result.requests[c.request_id].context_len}
    assert chunked


def unknown_answers(seed, n=16):
    """Prompts sharing prefixes, with generated tokens the traffic does not know (derived from
    the request id): a preempted request recomputes them from its own stream."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 6, int(rng.integers(4, 13))) for _ in range(3)]
    return [req(i, np.concatenate([prefixes[i % 3], rng.integers(0, 6, int(rng.integers(1, 11)))]),
                int(rng.integers(6, 14)), 0.002 * i) for i in range(n)]


@pytest.mark.parametrize("traffic", [lambda: chat(3, n=24, users=4, out=10),
                                     lambda: unknown_answers(3)], ids=["known", "unknown"])
def test_preemption_recomputes_and_verifies(traffic):
    run = Serve(traffic(), blocks=20, batch=4, mnt=16)
    run.assert_verified()
    assert run.result.preemptions > 0


@pytest.mark.parametrize("revert", [False, True], ids=["hold", "revert"])
def test_delay_batching(revert):
    run = Serve(chat(4, n=24, out=8), blocks=32, host=16, wait_iters=3, ratio=0.9,
                revert=revert)
    run.assert_verified()
    res = run.result
    assert res.batch_wait_iterations > 0
    if revert:
        assert res.deferred_ctx_blocks_reverted > 0
    else:
        assert res.deferred_ctx_blocks_held_peak > 0
    # A deferred request computed nothing in the step it was deferred.
    for rec in run.records:
        if rec.deferred:
            assert not rec.context and rec.computed_tokens == len(rec.generation)


def windowed_serve(seed, scratch, **sched):
    """A 3-layer model with a window on layer 0 (and maybe layer 1), pools sized just above
    what the longest request needs alone, with host tiers: onboards and preemptions."""
    rng = random.Random(seed)
    tpb = rng.choice([2, 4])
    cycles = life_cycles([rng.choice([3, 8, 13]), rng.choice([5, None]), None])
    base = rng.sample(range(1000), 30)
    requests = []
    for i in range(24):
        toks = base[:rng.randint(0, 30)] + rng.sample(range(1000, 5000), rng.randint(1, 40))
        requests.append(req(i, toks, rng.randint(1, 12), i * 0.002))
    need = max(-(-(r.input_length + r.output_length - 1) // tpb) for r in requests)
    specs = [CacheSpec(tpb, n, num_host_blocks=n // 2, emit_copy_ops=True,
                       enable_partial_reuse=rng.random() < 0.5)
             for n in (need + rng.randint(0, 6) for _ in cycles)]
    manager = WindowedCacheManager(
        cycles, specs, release_out_of_window=rng.choice(["keep_cached", "drop"]),
        swa_scratch_reuse=scratch)
    manager.enable_sanity_tracking()
    plane = DataPlane(ModelShape(3, 2, 4, 16, tpb, "bfloat16"),
                      [PoolSpec(c.layers, s.num_gpu_blocks, window=c.window,
                                num_host_slots=s.num_host_blocks) for c, s in zip(cycles, specs)])
    cfg = SchedulerConfig(max_num_tokens=24, max_batch_size=6, **sched)
    result = ServeLoop(requests, manager, Scheduler(cfg, tpb), CLOCK,
                       revert_deferred_ctx=cfg.revert_deferred_ctx, batch_add=seed % 2 == 0,
                       data_plane=plane, on_step=lambda rec: manager._check_sanity()).run()
    return manager, result, plane


WAIT = dict(batch_wait_timeout_iters=2, batch_wait_max_tokens_ratio=0.9)


@pytest.mark.parametrize("scratch, sched", [
    (True, {}),
    (True, dict(WAIT, revert_deferred_ctx=True)),
    (False, WAIT),  # held deferral: the runner allows it without scratch slots
], ids=["scratch", "scratch-revert", "hold"])
def test_windowed_pools(scratch, sched):
    manager, result, plane = windowed_serve(6, scratch, **sched)
    m = plane.metrics()
    assert m["verified"] is True, m["verify_mismatch"]
    assert manager.total("onboard_blocks") > 0 and result.preemptions > 0
    assert (manager.scratch_slots_peak > 0) == scratch
    assert (result.batch_wait_iterations > 0) == bool(sched)


class SkippingManager(KVCacheManager):
    """A manager bug: the first copy of one kind is counted but never emitted."""

    kind = CopyKind.ONBOARD
    skipped = None

    def _emit(self, kind, src_tier, src, dst_tier, dst, num_tokens):
        if kind == self.kind and self.skipped is None:
            type(self).skipped = dst
            return
        super()._emit(kind, src_tier, src, dst_tier, dst, num_tokens)


@pytest.mark.parametrize("kind", [CopyKind.ONBOARD, CopyKind.PARTIAL], ids=lambda k: k.name)
def test_skipped_copy_is_caught(monkeypatch, kind):
    monkeypatch.setattr(SkippingManager, "kind", kind)
    monkeypatch.setattr(SkippingManager, "skipped", None)
    run = Serve(chat(1, n=32, users=8, system=12), blocks=24, host=16, batch=8,
                manager_cls=SkippingManager)
    m = run.plane.first_mismatch
    assert SkippingManager.skipped is not None and run.plane.metrics()["verified"] is False
    assert m.kind == "kv" and m.block_id == SkippingManager.skipped


def test_verify_serve_small_workload():
    outcomes = {o.variant: o.metrics for o in run_workload(load_workload(VERIFY_SERVE))}
    for name, m in outcomes.items():
        assert m["verified"] is True, (name, m["verify_mismatch"])
        assert m["max_abs_err"] <= ATOL and m["data_plane_backend"] == "torch"
        assert m["data_plane_steps"] == m["verified_steps"] == m["iterations"]
        assert m["time_source"] == "modeled"
    for name in ("sequential", "batch"):
        assert outcomes[name]["onboard_blocks"] > 0 and outcomes[name]["offload_blocks"] > 0
    assert outcomes["tight"]["preemptions"] > 0
    assert outcomes["windows"]["scratch_slots_peak"] > 0
    assert outcomes["windows"]["onboard_blocks"] > 0
    assert outcomes["wait-revert"]["deferred_ctx_blocks_reverted"] > 0
    assert outcomes["wait-hold"]["deferred_ctx_blocks_held_peak"] > 0


def test_serve_flashinfer_without_cuda_is_input_error():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    wl = load_workload(VERIFY_SERVE, ["run.backend=flashinfer", "variants=[]"])
    with pytest.raises(InputError, match="verify-serve-small.yaml: run.backend: flashinfer"):
        run_workload(wl)
