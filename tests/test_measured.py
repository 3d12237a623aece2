"""`run.clock: measured`: refused with one line where it cannot run; on CUDA (skipped
elsewhere), a serve run whose step times are the GPU time of the engine's work, a refusal
with the bytes needed when weights and cache do not fit, and the engine's captured graphs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
SMALL = ROOT / "workloads" / "verify-serve-small.yaml"
TINY = ["--set", "requests.synthetic.num_requests=12", "--set", "model.head_dim=128",
        "--set", "run.verify=sample", "--set", "run.backend=auto"]


def cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return torch.cuda.is_available()


def has_flashinfer() -> bool:
    try:
        import flashinfer  # noqa: F401
    except ImportError:
        return False
    return True


needs_cuda = pytest.mark.skipif(not (cuda() and has_flashinfer()),
                                reason="measured clock tests need CUDA and FlashInfer")


def test_measured_clock_in_cache_mode_is_refused(capsys):
    code, _, err = run_cli(["run", ROOT / "workloads" / "verify-small.yaml", "--set",
                            "run.clock=measured"], capsys)
    assert code == 2 and "run.clock: measured times serve-mode steps" in err
    assert len(err.strip().splitlines()) == 1


def test_measured_clock_needs_flashinfer_attention(capsys):
    code, _, err = run_cli(["run", SMALL, *TINY, "--set", "run.clock=measured", "--set",
                            "run.backend=torch"], capsys)
    assert code == 2 and "set run.backend to flashinfer or auto (got torch)" in err


@pytest.mark.skipif(cuda(), reason="checks the refusal without CUDA")
def test_measured_clock_without_cuda_is_one_line(capsys):
    code, _, err = run_cli(["run", SMALL, *TINY, "--set", "run.clock=measured"], capsys)
    assert code == 2 and "run.clock: measured needs a CUDA GPU" in err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err


@needs_cuda
def test_measured_serve_run(tmp_path, capsys):
    out = tmp_path / "r.json"
    code, _, err = run_cli(["run", SMALL, *TINY, "--set", "run.clock=measured", "--set",
                            "variants=[]", "--json", out, "-q"], capsys)
    assert code == 0, err
    m = json.loads(out.read_text())["runs"][0]["metrics"]
    assert m["time_source"] == "measured" and m["data_plane_backend"] == "flashinfer"
    assert m["verified"] is True
    assert 0 < m["ttft_ms"]["p50"] <= m["e2e_ms"]["p99"]
    # The clock advanced by each step's measured GPU time (and across idle gaps to arrivals).
    assert 0 < m["data_plane_gpu_ms"] <= m["duration_s"] * 1e3 * 1.0001
    assert m["linear_ms"] > 0


KV_BYTES_PER_TOKEN = 2 * 2 * 2 * 128 * 2
"""K and V x 2 layers x 2 KV heads x head_dim 128 x bfloat16 (verify-serve-small, TINY)."""


@needs_cuda
def test_measured_run_that_does_not_fit_is_refused_before_starting(capsys):
    import torch

    # The K/V tensors alone exceed the GPU: the run plan refuses them before anything runs.
    free, _ = torch.cuda.mem_get_info()
    tokens = 2 * free // KV_BYTES_PER_TOKEN // 16 * 16
    code, _, err = run_cli(["run", SMALL, *TINY, "--set", "run.clock=measured", "--set",
                            f"cache.max_tokens={tokens}", "--set", "cache.host_offload_ratio=0",
                            "--set", "variants=[]"], capsys)
    assert code == 2 and "K/V tensors need" in err and "bytes" in err
    assert "lower cache.max_tokens" in err
    # The K/V tensors fit but not with the measured engine's weights, step buffers and
    # workspaces (2 GiB of them): the measured clock refuses.
    free, _ = torch.cuda.mem_get_info()
    tokens = (free - (1 << 30)) // KV_BYTES_PER_TOKEN // 16 * 16
    code, _, err = run_cli(["run", SMALL, *TINY, "--set", "run.clock=measured", "--set",
                            f"cache.max_tokens={tokens}", "--set", "cache.host_offload_ratio=0",
                            "--set", "variants=[]"], capsys)
    assert code == 2 and "run.clock: measured needs" in err and "bytes" in err, err
    assert "lower cache.max_tokens" in err


@needs_cuda
def test_linear_work_pads_to_captured_graphs():
    import torch

    from kvbench.kernels.engine import LinearShape, LinearWork

    work = LinearWork(LinearShape(2, 256, 256, 64, 512), torch.device("cuda"), 20)
    assert work.sizes == (1, 2, 4, 8, 16, 20)
    assert [work.padded(t) for t in (1, 3, 9, 17, 20, 21)] == [1, 4, 16, 20, 20, 21]
    for t in (3, 20, 100):
        work.run(t)
    torch.cuda.synchronize()
