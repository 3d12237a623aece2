"""Encoder-decoder requests: the cross-attention cache keyed by the whole encoder input, written
once with the request's first chunk, shared (its unfilled last block too) by requests with the
same input, never grown in decode; requests without an encoder input hold and reuse nothing
there, on both add paths; the scheduler's cross estimate equals what the add takes."""

from __future__ import annotations

import numpy as np
import pytest

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.config import ModelConfig, SchedulerConfig
from kvbench.engine.cache_mode import replay_cache_mode
from kvbench.engine.clock import PRESETS, StepClock
from kvbench.engine.scheduler import Phase, Scheduler
from kvbench.engine.serve import ServeLoop
from kvbench.traffic.decoding import encoder_input
from kvbench.traffic.request import Request

CLOCK = StepClock(ModelConfig(), PRESETS["H100-SXM"])


def cross_mgr(blocks=20, tpb=4, partial=True):
    m = KVCacheManager(CacheSpec(tpb, blocks, cross_kv=True, enable_partial_reuse=partial))
    m.enable_sanity_tracking()
    return m


def write(m, enc):
    seq = m.add_sequence(enc)
    assert m.resize(seq, enc.input_length)
    m.commit(seq, enc.input_length)
    assert m._check_sanity()
    return seq


def test_identical_input_reuses_everything_including_the_tail():
    m = cross_mgr()
    audio = encoder_input(0, np.arange(10))  # 2 full blocks + 2 tokens
    first = write(m, audio)
    assert first.reused_tokens == 0 and m.gpu.num_in_use == 3
    # A second request with the same input while the first still holds it: all 10 tokens,
    # the unfilled last block shared as it is (no copy, no new block).
    second = write(m, encoder_input(7, np.arange(10)))
    assert second.reused_tokens == 10 and second.reused_full_blocks == 2
    assert second.partial_tokens == 2 and second.blocks == first.blocks
    assert m.gpu.num_in_use == 3 and m.partial_copy_blocks == 0
    blocks = list(first.blocks)
    m.release(first)
    m.release(second)
    third = write(m, encoder_input(8, np.arange(10)))
    assert third.reused_tokens == 10 and third.blocks == blocks
    m.release(third)
    assert m._check_sanity()


def test_a_different_input_shares_nothing_even_with_an_equal_prefix():
    m = cross_mgr()
    m.release(write(m, encoder_input(0, np.arange(10))))
    other = write(m, encoder_input(1, np.concatenate([np.arange(8), [99, 98]])))
    assert other.reused_tokens == 0
    longer = write(m, encoder_input(2, np.arange(12)))
    assert longer.reused_tokens == 0


def test_without_partial_reuse_only_full_blocks():
    m = cross_mgr(partial=False)
    m.release(write(m, encoder_input(0, np.arange(10))))
    again = write(m, encoder_input(1, np.arange(10)))
    assert again.reused_tokens == 8 and again.partial_tokens == 0


def test_cross_estimate_equals_consumption():
    m = cross_mgr(blocks=12)
    a = write(m, encoder_input(0, np.arange(10)))   # held: its tail is shared, no draw
    m.release(write(m, encoder_input(1, np.arange(100, 109))))  # cached, free
    for enc in (encoder_input(2, np.arange(10)), encoder_input(3, np.arange(100, 109)),
                encoder_input(4, np.arange(200, 205))):
        _, blocks, draw = m.estimate_add(enc)
        need = draw + m.grow_blocks(enc, blocks, enc.input_length)
        free = m.gpu.num_free
        seq = m.add_sequences([enc])[0]
        assert m.resize(seq, enc.input_length)
        assert free - m.gpu.num_free == need
        m.commit(seq, enc.input_length)
        assert m._check_sanity()
    m.release(a)


def requests_with_audio(seed, n=14, share=3):
    rng = np.random.default_rng(seed)
    inputs = [encoder_input(i, rng.integers(0, 50, int(rng.integers(5, 15))))
              for i in range(share)]
    t, out = 0.0, []
    for i in range(n):
        t += float(rng.exponential(0.003))
        tokens = rng.integers(0, 5, int(rng.integers(3, 12)))
        r = Request(i, t, len(tokens), int(rng.integers(1, 9)), tokens=tokens,
                    beam_width=int(rng.choice([1, 2])))
        r.encoder = inputs[int(rng.integers(share))] if rng.random() < 0.7 else None
        out.append(r)
    return out


@pytest.mark.parametrize("batch_add", [False, True], ids=["sequential", "batch"])
@pytest.mark.parametrize("seed", range(3))
def test_serve_with_and_without_encoder_inputs(seed, batch_add):
    requests = requests_with_audio(seed)
    m = KVCacheManager(CacheSpec(4, 40))
    m.enable_sanity_tracking()
    cross = cross_mgr(blocks=10)
    sched = Scheduler(SchedulerConfig(max_num_tokens=32, max_batch_size=4), 4)
    loop = None

    def on_step(rec):
        assert m._check_sanity() and cross._check_sanity()
        held = 0
        for s in loop.states:
            if s.cross_seq is not None:
                assert s.request.encoder is not None
                # Written once: the encoder's length, never grown by decode.
                assert s.cross_seq.num_tokens == s.request.encoder.input_length
                held += 1
            elif s.phase in (Phase.PREFILL, Phase.DECODE):
                assert s.request.encoder is None
        assert cross.gpu.num_in_use <= sum(
            -(-s.request.encoder.input_length // 4) for s in loop.states
            if s.cross_seq is not None)

    loop = ServeLoop(requests, m, sched, CLOCK, batch_add=batch_add, cross=cross,
                     on_step=on_step)
    result = loop.run()
    assert all(s.phase is Phase.DONE and s.cross_seq is None for s in result.requests)
    assert cross.gpu.num_in_use == 0 and m.gpu.num_in_use == 0
    tally = result.cross
    with_enc = [r for r in requests if r.encoder is not None]
    assert tally.requests == len(with_enc)
    assert tally.encoder_tokens == sum(r.encoder.input_length for r in with_enc)
    # Three distinct inputs shared by ~10 requests: all but the first of each reuse.
    assert 0 < tally.reused_tokens <= tally.encoder_tokens


def test_no_encoder_anywhere_is_fine_with_a_cross_cache():
    requests = [Request(i, 0.001 * i, 6, 3, tokens=np.arange(i, i + 6)) for i in range(5)]
    m, cross = KVCacheManager(CacheSpec(4, 20)), cross_mgr()
    sched = Scheduler(SchedulerConfig(max_num_tokens=32, max_batch_size=4), 4)
    result = ServeLoop(requests, m, sched, CLOCK, batch_add=True, cross=cross).run()
    assert result.cross.requests == 0 and cross.gpu.peak_in_use == 0


def test_encoder_pass_is_charged_unless_reused():
    audio = encoder_input(0, np.arange(200))
    def run(encoder):
        r = Request(0, 0.0, 8, 2, tokens=np.arange(8))
        r.encoder = encoder
        cross = cross_mgr(blocks=60)
        if encoder is not None:
            cross.release(write(cross, encoder_input(9, np.arange(200))))  # already cached
        loop = ServeLoop([r], KVCacheManager(CacheSpec(4, 20)),
                         Scheduler(SchedulerConfig(max_num_tokens=32, max_batch_size=4), 4),
                         CLOCK, cross=cross)
        return loop.run()
    plain, cached = run(None), run(audio)
    assert cached.cross.reused_tokens == 200
    assert cached.requests[0].first_token_s == plain.requests[0].first_token_s
    fresh_cross = cross_mgr(blocks=60)
    r = Request(0, 0.0, 8, 2, tokens=np.arange(8))
    r.encoder = audio
    fresh = ServeLoop([r], KVCacheManager(CacheSpec(4, 20)),
                      Scheduler(SchedulerConfig(max_num_tokens=32, max_batch_size=4), 4),
                      CLOCK, cross=fresh_cross).run()
    assert fresh.requests[0].first_token_s > plain.requests[0].first_token_s


def test_cache_mode_counts_cross_reuse():
    requests = requests_with_audio(5, n=20)
    m, cross = KVCacheManager(CacheSpec(4, 20)), cross_mgr(blocks=12)
    result = replay_cache_mode(requests, m, cross=cross)
    with_enc = [r for r in requests if r.encoder is not None]
    assert result.cross.requests == len(with_enc) and result.cross.reused_tokens > 0
    assert cross.gpu.num_in_use == 0 and cross._check_sanity()


def test_encoder_workload_keys(tmp_path):
    from kvbench.config import load_workload
    from kvbench.errors import InputError
    from kvbench.runner import run_workload

    path = tmp_path / "w.yaml"
    path.write_text(
        "model: {num_layers: 2, num_kv_heads: 1, num_q_heads: 1, head_dim: 8}\n"
        "cache: {tokens_per_block: 8, max_tokens: 4096, cross_kv_cache_fraction: 0.5}\n"
        "requests: {encoder: {tokens: 100, distinct_inputs: 3, fraction: 0.5},\n"
        "  synthetic: {num_requests: 30, system_prompt_tokens: 20, prompt_tokens: 12,"
        " output_tokens: 6}}\n"
        "run: {mode: serve, progress: false}\n")
    wl = load_workload(path)
    (serve,) = run_workload(wl)
    (cache,) = run_workload(load_workload(path, ["run.mode=cache"]))
    for m in (serve.metrics, cache.metrics):
        assert m["gpu_blocks_total"] == m["cross_gpu_blocks_total"] == 256
        assert 0 < m["cross_requests"] < 30 and m["encoder_tokens"] == 100 * m["cross_requests"]
        assert 0 < m["cross_hit_rate"] < 1
    with pytest.raises(InputError, match="cross_kv_cache_fraction"):
        run_workload(load_workload(path, ["cache.cross_kv_cache_fraction=0.0"]))
    # A sliding-window decoder: its pools share what the cross cache leaves of the budget
    # (512-byte blocks: 8 tokens x 2 layers x 32 bytes), and the cross cache works as beside
    # a plain one.
    for mode, plain in (("serve", serve.metrics), ("cache", cache.metrics)):
        (win,) = run_workload(load_workload(path, ["model.attention_window=16",
                                                   f"run.mode={mode}"]))
        m = win.metrics
        assert set(m["pools"]) == {"window_16"} and m["cross_gpu_blocks_total"] == 256
        assert m["gpu_bytes_total"] == 256 * 512
        assert m["cross_requests"] == plain["cross_requests"]
        if mode == "cache":  # one request at a time: the cross cache sees the same adds
            assert m["cross_hit_rate"] == plain["cross_hit_rate"]
