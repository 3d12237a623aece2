"""A synthetic model: deterministic Q, K and V for every (token id, position, layer).

Each vector is `token part * g_l + position part * p_l`: the token part sums two rows of
seeded random tables picked by two hashes of the token id (so two tokens collide only when
both hashes do), the position part likewise from the position, and `g_l`, `p_l` are per-layer
random sign patterns (a diagonal projection per layer). Only gathers and elementwise float32
ops are used, never a matmul, so a token's K/V is bit-identical however tokens are batched
and on whichever device: the verifier can then demand that every page read back holds exactly
the K/V that recomputation gives, and keep tolerances for the attention arithmetic alone.
Position matters as much as the token (36% of the variance), so a block reused at the wrong
position is caught like a wrong block.
"""

from __future__ import annotations

import numpy as np
import torch

from .step import ModelShape

TABLE_ROWS = 1024
_MASK = (1 << 64) - 1
_TOKEN_SALT = 0x5EED_0001
_POS_SALT = 0x5EED_0002


def _mix(x: np.ndarray, salt: int) -> np.ndarray:
    """splitmix64 of int64 values, as uint64 (wrapping arithmetic is what we want)."""
    z = x.astype(np.uint64) + np.uint64((salt * 0x9E3779B97F4A7C15) & _MASK)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def _rows(x: np.ndarray, salt: int) -> np.ndarray:
    """Two table rows per value, as an int64 array of shape [2, n]."""
    z = _mix(x, salt)
    rows = np.stack([z % np.uint64(TABLE_ROWS), (z >> np.uint64(32)) % np.uint64(TABLE_ROWS)])
    return rows.astype(np.int64)


class SyntheticModel:
    """Q/K/V generator for one `ModelShape`; tables live on `device`."""

    __slots__ = ("shape", "device", "_tables", "_offsets", "_token_gain", "_pos_gain", "_split")

    def __init__(self, shape: ModelShape, seed: int, device: torch.device) -> None:
        self.shape = shape
        self.device = device
        kv = shape.num_kv_heads * shape.head_dim
        q = shape.num_q_heads * shape.head_dim
        width = 2 * kv + q
        self._split = (kv, kv, q)
        gen = torch.Generator().manual_seed(seed)
        # Four tables: two for the token's hashes, two for the position's.
        self._tables = torch.randn((4, TABLE_ROWS, width), generator=gen).to(device)
        self._offsets = (torch.arange(4) * TABLE_ROWS)[:, None].to(device)
        signs = torch.randint(0, 2, (2, shape.num_layers, width), generator=gen) * 2 - 1
        # Each part sums two N(0, 1) rows; scaled so K, V and Q entries are N(0, 1) again.
        self._token_gain = (signs[0] * (0.8 / 2**0.5)).float().to(device)
        self._pos_gain = (signs[1] * (0.6 / 2**0.5)).float().to(device)

    def rows(self, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """Table rows of `(tokens[i], positions[i])`, shape [4, n], on the device: computed
        once per step and reused for every layer."""
        both = np.concatenate([_rows(np.asarray(tokens, dtype=np.int64), _TOKEN_SALT),
                               _rows(np.asarray(positions, dtype=np.int64), _POS_SALT)])
        return torch.from_numpy(both).to(self.device)

    def qkv(self, rows: torch.Tensor, layer: int, *, with_q: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """float32 K, V `[n, kv_heads, head_dim]` and Q `[n, q_heads, head_dim]` of `layer`."""
        kv, _, q = self._split
        w = 2 * kv + (q if with_q else 0)
        # One gather for all four tables: rows of table i sit at offset i * TABLE_ROWS.
        flat = self._tables.view(4 * TABLE_ROWS, -1)
        g = flat.index_select(0, (rows + self._offsets).reshape(-1)).view(4, -1, flat.shape[1])
        token = g[0, :, :w] + g[1, :, :w]
        pos = g[2, :, :w] + g[3, :, :w]
        x = token * self._token_gain[layer, :w] + pos * self._pos_gain[layer, :w]
        s = self.shape
        k = x[:, :kv].reshape(-1, s.num_kv_heads, s.head_dim)
        v = x[:, kv:2 * kv].reshape(-1, s.num_kv_heads, s.head_dim)
        if not with_q:
            return k, v, None
        return k, v, x[:, 2 * kv:].reshape(-1, s.num_q_heads, s.head_dim)
