"""The reference attention, in float32, and the torch backend that runs it.

`attend_segments` runs all layers of a tile of items at once, one run of an item's queries at
a time over that item's keys alone (float32 copies of the tile's Q/K/V sized to a memory
budget, read in place); the torch backend and the verifier share it, so the torch backend's
output equals the reference bit for bit whenever both read the same keys. For decode batches
the verifier uses `attend_casts`, the same products from the synthetic model's four casts per
K/V column (the layers on the query side), once the pages are proven to hold the model's K/V.
On CUDA, where queries and K/V are 16- or 8-bit floats, the matmuls run on TF32 tensor cores
with float32's accuracy (`_bmm`, `_bmm_probs`).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch

from .attention import KeyIndex, PagedBatch, gather_keys
from .staging import to_device

QUERY_CHUNK = 256
"""Most queries of one item in one score block of `attend_segments`."""
TILE_BYTES = 256 * 1024 * 1024
"""Float32 bytes of one reference tile on a CPU: the K and V of its layers and items, and
the scores of one run of queries."""
TILE_BYTES_CUDA = 2 * 1024 * 1024 * 1024
"""The same on a GPU, where fewer, larger tiles save launches and host work."""


def tile_bytes(device: torch.device) -> int:
    return TILE_BYTES_CUDA if device.type == "cuda" else TILE_BYTES


def tiles(key_counts: np.ndarray, num_layers: int, key_bytes: int,
          budget: int = TILE_BYTES) -> Iterator[tuple[slice, slice]]:
    """(layer range, item range) tiles whose float32 K/V (`key_bytes` per key and layer)
    stay under `budget`: all layers at once unless one item is too long for that."""
    longest = int(key_counts.max()) if len(key_counts) else 0
    group = max(1, min(num_layers, budget // max(1, longest * key_bytes)))
    limit = max(1, budget // (group * key_bytes))
    i, n = 0, len(key_counts)
    while i < n:
        j, total = i, 0
        while j < n and (j == i or total + key_counts[j] <= limit):
            total += int(key_counts[j])
            j += 1
        for l0 in range(0, num_layers, group):
            yield slice(l0, min(num_layers, l0 + group)), slice(i, j)
        i = j


def _segments(batch: PagedBatch, keys: KeyIndex, items: slice, G: int, hq: int, budget: int
              ) -> Iterator[tuple[int, int, int]]:
    """`attend_segments`' runs: (item, first query, end query), each item's queries cut so
    that one run's float32 scores and probabilities stay under `budget`."""
    for i in range(items.start, items.stop):
        q0, q1 = int(batch.qo_indptr[i]), int(batch.qo_indptr[i + 1])
        nk = int(keys.indptr[i + 1] - keys.indptr[i])
        step = max(1, min(QUERY_CHUNK, budget // (8 * G * hq * max(nk, 1))))
        for a in range(q0, q1, step):
            yield i, a, min(q1, a + step)


def attend_segments(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: PagedBatch,
                    keys: KeyIndex, items: slice, window: int | None,
                    budget: int = TILE_BYTES) -> Iterator[tuple[int, int, torch.Tensor]]:
    """Reference attention of a tile, in float32: `q` `[G, tile queries, q_heads, d]`, `k` and
    `v` `[G, tile keys, kv_heads, d]` (the items of `items`, in order). Yields
    (first query, end query, output `[G, queries, q_heads, d]`) per run of one item's
    queries, query indices counted from the tile's first query; runs are cut so that scores
    stay under `budget` bytes."""
    G, nq, hq, d = q.shape
    hk = k.shape[2]
    g = hq // hk
    # One float32 copy each, heads outside the tokens: every (layer, KV head) run of an
    # item's queries or keys is then a matrix the matmuls read in place, with no padding.
    qh = _float32(q.view(G, nq, hk, g, d).transpose(1, 2))
    kh, vh = _float32(k.transpose(1, 2)), _float32(v.transpose(1, 2))
    tf32 = _tf32_exact(q, k)
    q_base, k_base, hidden_of = _masks(batch, keys, items, nq, window, q.device)
    for i, a, b in _segments(batch, keys, items, G, hq, budget):
        k0, k1 = int(keys.indptr[i]) - k_base, int(keys.indptr[i + 1]) - k_base
        # An item's keys are its positions from `keys.lo[i]` on, in order: keys past the
        # run's last query or before its first one's window are hidden from every query of
        # the run, so they are left out rather than masked (a long prompt's run then reads
        # its window, not the whole prompt).
        seen = batch.new_positions[a:b]
        lo = int(keys.lo[i])
        k1 = min(k1, k0 + int(seen.max()) + 1 - lo)
        if window is not None:
            k0 += max(0, int(seen.min()) - window + 1 - lo)
        a, b = a - q_base, b - q_base
        Q = qh[:, :, a:b].reshape(G * hk, (b - a) * g, d)
        scores = _bmm(Q, kh[:, :, k0:k1].reshape(G * hk, k1 - k0, d).transpose(1, 2), tf32)
        scores = scores.mul_(d**-0.5).view(G * hk, b - a, g, k1 - k0)
        scores.masked_fill_(hidden_of(a, b, k0, k1)[None, :, None, :], float("-inf"))
        p = torch.softmax(scores, dim=-1).view(G * hk, (b - a) * g, k1 - k0)
        o = _bmm_probs(p, vh[:, :, k0:k1].reshape(G * hk, k1 - k0, d), tf32)
        yield a, b, o.view(G, hk, b - a, g, d).permute(0, 2, 1, 3, 4).reshape(G, b - a, hq, d)


def attend_casts(q: torch.Tensor, casts: torch.Tensor, cast: torch.Tensor, batch: PagedBatch,
                 keys: KeyIndex, items: slice, window: int | None
                 ) -> Iterator[tuple[int, int, torch.Tensor]]:
    """`attend_segments` for a tile of decode items (one query each), from the synthetic
    model's four casts per K/V column (`SyntheticModel.kv_casts`, `[tile keys, 4, w]`) rather
    than every layer's K/V: column `c` of layer `l` is cast `cast[l, c]`, so a query's scores
    over a key are its dot product, masked per cast, with the four casts, and its output is
    the cast-masked sum of its probabilities times each cast's V. The layers then ride on
    the query side and the keys are read four times, not once per layer. The same products
    as `attend_segments` (plus exact zeros), in another order. Only valid where the K/V read
    equal the model's, which the verifier's K/V check establishes first."""
    G, nq, hq, d = q.shape
    n = casts.shape[0]
    hk = casts.shape[2] // (2 * d)
    g = hq // hk
    c = casts.view(n, 4, 2, hk, d)
    # [hk, keys, 4 * d]: per KV head, each key's four casts side by side.
    ck, cv = (_float32(c[:, :, half].permute(2, 0, 1, 3)).view(hk, n, 4 * d) for half in (0, 1))
    picks = torch.arange(4, device=q.device)
    # [hk, G, 4, d]: 1 where layer l's column takes cast a, else 0.
    kmask, vmask = ((cast[:, half * hk * d:(half + 1) * hk * d].view(G, hk, 1, d)
                     == picks[:, None]).permute(1, 0, 2, 3).float() for half in (0, 1))
    # [hk, queries, G, g, 4, d]: each query spread over the casts its layer's K picks.
    qt = q.view(G, nq, hk, g, d).permute(2, 1, 0, 3, 4).float()[:, :, :, :, None, :] \
        * kmask[:, None, :, None]
    tf32 = _tf32_exact(q, casts)
    q_base, k_base, hidden_of = _masks(batch, keys, items, nq, window, q.device)
    for i in range(items.start, items.stop):
        j = int(batch.qo_indptr[i]) - q_base
        k0, k1 = int(keys.indptr[i]) - k_base, int(keys.indptr[i + 1]) - k_base
        scores = _bmm(qt[:, j].reshape(hk, G * g, 4 * d), ck[:, k0:k1].transpose(1, 2), tf32)
        scores = scores.mul_(d**-0.5).masked_fill_(hidden_of(j, j + 1, k0, k1),
                                                   float("-inf"))
        y = _bmm_probs(torch.softmax(scores, dim=-1), cv[:, k0:k1], tf32)
        o = (y.view(hk, G, g, 4, d) * vmask[:, :, None]).sum(3)
        yield j, j + 1, o.permute(1, 0, 2, 3).reshape(G, 1, hq, d)


def _masks(batch: PagedBatch, keys: KeyIndex, items: slice, nq: int, window: int | None,
           device: torch.device):
    """For a tile's reference attention: its first query and first key, and
    `hidden_of(a, b, k0, k1)`, the `[b - a, k1 - k0]` mask of the keys each of the tile's
    queries `[a, b)` must not see among its keys `[k0, k1)` (later positions, or outside the
    window), positions uploaded once per tile."""
    q_base = int(batch.qo_indptr[items.start])
    k_base, k_end = int(keys.indptr[items.start]), int(keys.indptr[items.stop])
    qpos, kpos = to_device([batch.new_positions[q_base:q_base + nq],
                            keys.positions[k_base:k_end]], device)

    def hidden_of(a: int, b: int, k0: int, k1: int) -> torch.Tensor:
        k, q = kpos[None, k0:k1], qpos[a:b, None]
        hidden = k > q
        if window is not None:
            hidden |= k <= q - window
        return hidden

    return q_base, k_base, hidden_of


_TF32_HIGH = -(1 << 13)
"""int32 mask of a float32's sign, exponent and leading 10 significand bits: TF32's."""


def _tf32_exact(q: torch.Tensor, kv: torch.Tensor) -> bool:
    """Whether the reference's float32 matmuls over these queries and K/V may run on TF32
    tensor cores: on CUDA, where both are floats of at most 16 bits (TF32 holds every such
    value exactly)."""
    return q.device.type == "cuda" and q.element_size() <= 2 and kv.element_size() <= 2


def _bmm(a: torch.Tensor, b: torch.Tensor, tf32: bool) -> torch.Tensor:
    """`torch.bmm` of float32 operands; with `tf32` (both hold values TF32 represents) on
    TF32 tensor cores: the same exact products, summed in float32."""
    if not tf32:
        return torch.bmm(a, b)
    with _allow_tf32():
        return torch.bmm(a, b)


def _bmm_probs(p: torch.Tensor, v: torch.Tensor, tf32: bool) -> torch.Tensor:
    """`p @ v` for float32 probabilities `p`, `v` as in `_bmm`. With `tf32`, as two TF32
    products: `p`'s leading 11 significand bits (exact in TF32) and the rest (below 2^-10
    of `p`, which TF32 rounds to 2^-21 of `p`): float32's accuracy within a few bits, at
    tensor-core speed."""
    if not tf32:
        return torch.bmm(p, v)
    high = (p.view(torch.int32) & _TF32_HIGH).view(torch.float32)
    low = p - high
    with _allow_tf32():
        return torch.bmm(high, v).baddbmm_(low, v)


@contextmanager
def _allow_tf32():
    """CUDA float32 matmuls on TF32 tensor cores within (the setting is read at launch)."""
    matmul = torch.backends.cuda.matmul
    before = matmul.allow_tf32
    matmul.allow_tf32 = True
    try:
        yield
    finally:
        matmul.allow_tf32 = before


def _float32(x: torch.Tensor) -> torch.Tensor:
    """A contiguous float32 copy of `x` in its logical order (one kernel: upcast and
    relayout; `Tensor.to` alone returns a float32 view as it is)."""
    if x.dtype == torch.float32:
        return x.contiguous()
    return x.to(torch.float32, memory_format=torch.contiguous_format)


class TorchBackend:
    """Reference backend: reads every item's whole page table (all layers at once) and runs
    `attend_segments` on it (CPU or CUDA)."""

    name = "torch"

    def plan_tables(self, batch: PagedBatch) -> None:
        """No host tables to stage."""

    def plan(self, pool: int, batch: PagedBatch, buffer: int = 0, tables=None) -> None:
        """Nothing to plan: page tables are read when the batch runs."""

    def run(self, kv: torch.Tensor, batch: PagedBatch, q: torch.Tensor, plan=None
            ) -> torch.Tensor:
        """Attention of every layer: q `[L, queries, q_heads, d]` -> float32, same shape."""
        keys = batch.item_keys(windowed=False)
        L = q.shape[0]
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        per_key = 2 * kv.shape[3] * kv.shape[4] * 4
        budget = tile_bytes(kv.device)
        for layers, items in tiles(np.diff(keys.indptr), L, per_key, budget):
            got = gather_keys(kv, batch, keys, layers, items)
            q0, q1 = int(batch.qo_indptr[items.start]), int(batch.qo_indptr[items.stop])
            for a, b, o in attend_segments(q[layers, q0:q1], got[:, :, 0], got[:, :, 1],
                                           batch, keys, items, batch.window, budget):
                out[layers, q0 + a:q0 + b] = o
        return out
