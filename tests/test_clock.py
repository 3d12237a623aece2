"""The modeled step clock: presets, overrides, the cost terms and the decode-run closed forms."""

import pytest

from kvbench.config import HardwareConfig, ModelConfig
from kvbench.engine.clock import (
    PRESETS, STEP_OVERHEAD_MS, StepClock, hardware_from_config, matmul_params,
)

LLAMA3_8B = ModelConfig(num_layers=32, num_kv_heads=8, num_q_heads=32, head_dim=128,
                        hidden_size=4096, intermediate_size=14336)


def test_presets_and_overrides():
    assert set(PRESETS) == {"H100-SXM", "H200", "A100-80G", "L40S"}
    h100 = hardware_from_config(HardwareConfig())
    assert h100 == PRESETS["H100-SXM"]
    assert h100.step_overhead_s == STEP_OVERHEAD_MS / 1000
    hw = hardware_from_config(HardwareConfig(preset="A100-80G", hbm_bandwidth=1e12,
                                             step_overhead_ms=0))
    assert (hw.peak_flops, hw.hbm_bandwidth, hw.host_link_bandwidth, hw.step_overhead_s) == (
        PRESETS["A100-80G"].peak_flops, 1e12, PRESETS["A100-80G"].host_link_bandwidth, 0.0)


def test_parameter_count_from_shape_or_given():
    # Llama 3 8B without embeddings and LM head: 6.98e9 matmul parameters.
    assert matmul_params(LLAMA3_8B) == pytest.approx(6.98e9, rel=0.01)
    assert matmul_params(ModelConfig(num_params=7e9)) == 7e9
    # Defaults: hidden = heads x head_dim, MLP 3.5x hidden.
    assert matmul_params(ModelConfig()) == matmul_params(LLAMA3_8B)


def test_prefill_is_compute_bound_and_decode_memory_bound():
    clock = StepClock(LLAMA3_8B, PRESETS["H100-SXM"])
    n = matmul_params(LLAMA3_8B)
    # 8192 prompt tokens: the matmuls dominate, 2 N T / (0.6 peak).
    t = clock.step_seconds(8192, 8192 * 8193 // 2, 8192)
    assert t > 2 * n * 8192 / (0.6 * 989e12)
    assert 0.15 < t < 0.4
    # One decode token at a 1k context: reading the bf16 weights, about 5 ms.
    t = clock.step_seconds(1, 1024, 1024)
    assert t == pytest.approx(1e-3 + 2 * n / (0.8 * 3.35e12) + 1024 * 32 * 4096 / (0.8 * 3.35e12))
    # A faster memory makes decode faster, a host copy adds its link time.
    h200 = StepClock(LLAMA3_8B, PRESETS["H200"])
    assert h200.step_seconds(1, 1024, 1024) < clock.step_seconds(1, 1024, 1024)
    extra = clock.step_seconds(1, 1024, 1024, copy_bytes=64e9) - clock.step_seconds(1, 1024, 1024)
    assert extra == pytest.approx(1 / 0.8)


@pytest.mark.parametrize("n, kv", [(1, 100), (7, 3000), (64, 200_000)])
def test_decode_run_closed_forms(n, kv):
    clock = StepClock(LLAMA3_8B, PRESETS["L40S"])
    steps = [clock.step_seconds(n, kv + j * n, kv + j * n) for j in range(50)]
    assert clock.decode_run_seconds(n, kv, 50) == pytest.approx(sum(steps), rel=1e-12)
    starts = [sum(steps[:j]) for j in range(50)]
    # Gaps between step starts (exact ties are a matter of float rounding).
    mid = [(a + b) / 2 for a, b in zip(starts, starts[1:])]
    for gap in (1e-9, mid[0], mid[16], mid[17], mid[48], starts[49] + 1, 1e9):
        expected = sum(1 for s in starts if s < gap)
        assert clock.decode_steps_before(n, kv, gap, 50) == expected
    assert clock.decode_steps_before(n, kv, 0.0, 50) == 0
    assert clock.decode_steps_before(n, kv, 1.0, 0) == 0
