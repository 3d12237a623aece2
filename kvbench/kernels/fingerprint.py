"""Exact integer fingerprints of K/V rows, for comparing pages with the model cheaply.

A row (one key's K or V over all KV heads) is fingerprinted by `PROJECTIONS` integer
projections of its raw bytes: `sum_j byte_j * proj[j, m]`, in int32 with no rounding (bytes
are int8, weights at most `WEIGHT_MAX`, so a row of up to 2^31 / (128 * WEIGHT_MAX) bytes
cannot overflow). Two rows whose bytes differ anywhere get equal fingerprints only when the
difference is orthogonal to every projection: for random weights that happens with
probability at most `(2 * WEIGHT_MAX + 1) ** -PROJECTIONS` (below 1e-16), whatever the
difference. The verifier compares fingerprints instead of every byte: reading a page once
instead of comparing it with a recomputed copy of the same size.
"""

from __future__ import annotations

import torch

PROJECTIONS = 8
"""Projections per row (a multiple of 8, as the int8 matmul needs)."""
WEIGHT_MAX = 63
"""Weights are drawn uniformly from [-WEIGHT_MAX, WEIGHT_MAX]."""
SEED = 0x5EED_F1A9

_WORKS: dict[str, bool] = {}


def projections(row_bytes: int, device: torch.device) -> torch.Tensor | None:
    """int8 `[row_bytes, PROJECTIONS]` weights, or None where integer matmuls do not serve
    these rows on `device` (the caller then compares bytes)."""
    if row_bytes % 8 or row_bytes * 128 * WEIGHT_MAX >= 2**31 or not _int_mm_works(device):
        return None
    gen = torch.Generator().manual_seed(SEED)
    proj = torch.randint(-WEIGHT_MAX, WEIGHT_MAX + 1, (row_bytes, PROJECTIONS),
                         generator=gen, dtype=torch.int8)
    return column_major(proj.to(device))


def fingerprint(x: torch.Tensor, proj: torch.Tensor) -> torch.Tensor:
    """int32 `[..., PROJECTIONS]` of the rows of contiguous `x` `[..., row]`, each row's
    bytes projected by `proj`."""
    rows = x.view(torch.int8).view(-1, proj.shape[0])
    return int_matmul(rows, proj).view(*x.shape[:-1], proj.shape[1])


def int_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Exact int8 `[m, k]` x int8 `[k, n]` -> int32 `[m, n]` (`torch._int_mm`, whose
    kernels want more than 16 rows and a column-major `b`)."""
    m = a.shape[0]
    if m <= 16:
        a = torch.cat([a, a.new_zeros((17 - m, a.shape[1]))])
    return torch._int_mm(a, column_major(b))[:m]


def column_major(b: torch.Tensor) -> torch.Tensor:
    """`b` with column-major strides (a copy only if it has other strides)."""
    return b if b.stride(0) == 1 else b.t().contiguous().t()


def _int_mm_works(device: torch.device) -> bool:
    """Whether `int_matmul` runs and is exact on this kind of device (checked once against
    float64, exact at these sizes)."""
    works = _WORKS.get(device.type)
    if works is None:
        gen = torch.Generator().manual_seed(SEED)
        a = torch.randint(-128, 128, (40, 64), generator=gen, dtype=torch.int8)
        b = torch.randint(-WEIGHT_MAX, WEIGHT_MAX + 1, (64, 8), generator=gen,
                          dtype=torch.int8)
        try:
            got = int_matmul(a.to(device), b.to(device)).cpu()
            works = bool((got.long() == (a.double() @ b.double()).long()).all())
        except RuntimeError:
            works = False
        _WORKS[device.type] = works
    return works
