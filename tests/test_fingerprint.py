"""K/V fingerprints: exact, agree with recomputation, catch every single-bit change, and the
verifier catches the same faults whether it compares fingerprints or bytes."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels import verify  # noqa: E402
from kvbench.kernels.fingerprint import fingerprint, projections  # noqa: E402
from kvbench.kernels.model import SyntheticModel  # noqa: E402
from kvbench.kernels.step import ModelShape  # noqa: E402
from kvbench.kernels.storage import STORAGE_DTYPES  # noqa: E402

import test_kernels  # noqa: E402

CPU = torch.device("cpu")
LAYERS = (0, 2, 3, 4)


def _model(dtype: str) -> tuple[SyntheticModel, torch.dtype, torch.Tensor]:
    shape = ModelShape(5, 2, 4, 16, 4, dtype)
    kv_dtype = STORAGE_DTYPES[dtype]
    proj = projections(2 * 16 * kv_dtype.itemsize, CPU)
    assert proj is not None
    return SyntheticModel(shape, 3, CPU), kv_dtype, proj


@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16", "fp8"])
def test_model_fingerprints_equal_the_fingerprints_of_its_kv(dtype):
    model, kv_dtype, proj = _model(dtype)
    rows = model.rows(np.arange(-50, 250), np.arange(300) * 7)
    kv = model.kv_exact(rows, LAYERS, kv_dtype).contiguous()
    want = fingerprint(kv.flatten(3), proj)
    casts = model.kv_casts(rows, kv_dtype)
    assert torch.equal(model.kv_fingerprints(casts, LAYERS, proj), want)
    # One layer's keys alone, as a report reads them.
    at = torch.tensor([[0, 5], [299, 1], [7, 7], [100, 3]])
    per_layer = model.kv_exact_per_layer(rows[:, at], LAYERS, kv_dtype)
    for g in range(len(LAYERS)):
        assert torch.equal(per_layer[g].view(torch.uint8), kv[g, at[g]].view(torch.uint8))


@pytest.mark.parametrize("dtype", ["bfloat16", "fp8"])
def test_every_single_bit_flip_changes_the_fingerprint(dtype):
    model, kv_dtype, proj = _model(dtype)
    kv = model.kv_exact(model.rows(np.arange(40), np.arange(40)), LAYERS, kv_dtype)
    rows = kv.contiguous().flatten(3).view(-1, 2 * 16)
    raw = rows.view(torch.uint8)
    nbytes = raw.shape[1]
    # Every bit of a few rows flipped, one variant per bit.
    flips = torch.zeros((nbytes * 8, nbytes), dtype=torch.uint8)
    bit = torch.arange(nbytes * 8)
    flips[bit, bit // 8] = (1 << (bit % 8)).to(torch.uint8)
    for r in (0, 77, rows.shape[0] - 1):
        variants = raw[r] ^ flips
        got = fingerprint(variants.view(kv_dtype), proj)
        assert (got != fingerprint(rows[r:r + 1], proj)).any(-1).all()


def test_fingerprints_are_the_default_on_cpu():
    dp = test_kernels.plane()
    assert dp.verifier.proj is not None


def test_byte_comparison_catches_the_same_faults(monkeypatch):
    """Where integer matmuls do not serve, the verifier compares bytes: same reports."""
    monkeypatch.setattr(verify, "projections", lambda *args: None)
    assert test_kernels.plane().verifier.proj is None
    test_kernels.test_wrong_page_index_is_caught()
    test_kernels.test_block_reused_at_wrong_position_is_caught()
    test_kernels.test_partial_copy_and_skipped_copy()
    test_kernels.test_block_overwritten_after_claim_is_caught()
    test_kernels.test_host_tier_offload_onboard_round_trip_and_skipped_offload()
