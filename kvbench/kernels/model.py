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

from collections.abc import Sequence

import numpy as np
import torch

from .fingerprint import column_major, int_matmul
from .staging import to_device
from .step import ModelShape
from .storage import widest_int

TABLE_ROWS = 1024
MAX_TEMP_BYTES = 256 * 1024 * 1024
"""Float32 temporaries of one `qkv_all` layer group (a long prefill chunk at many layers would
otherwise hold gigabytes at once)."""
ENCODER_SEED = 0x5EED_E0C0
"""Added to the run's seed for the encoder's K/V generator (cross-attention): its own tables
and layer patterns, so an encoder token's K/V differ from the same token's decoder K/V."""
_MASK = (1 << 64) - 1
_TOKEN_SALT = 0x5EED_0001
_POS_SALT = 0x5EED_0002


def _mix(z: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser of uint64 values, in place (wrapping arithmetic is what we
    want); numpy scalars as constants, so no Python int is converted per call."""
    z ^= z >> _U30
    z *= _M1
    z ^= z >> _U27
    z *= _M2
    z ^= z >> _U31
    return z


_U27, _U30, _U31, _U32 = (np.uint64(k) for k in (27, 30, 31, 32))
_M1, _M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
_SALTS = np.array([[(salt * 0x9E3779B97F4A7C15) & _MASK] for salt in (_TOKEN_SALT, _POS_SALT)],
                  dtype=np.uint64)
_UROWS = np.uint64(TABLE_ROWS)
_TABLE_OFFSETS = (np.arange(4, dtype=np.int64) * TABLE_ROWS)[:, None]


def table_rows(tokens: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """`[4, n]` rows of the four stacked tables (each offset by its table's first row) that
    `(tokens[i], positions[i])` reads: two per token id (its hash's low and high halves),
    then two per position. The same for every `SyntheticModel`, whose seed picks the tables'
    contents only, so a batch can ship them with its page tables."""
    # Tokens and positions hashed in one pass (a row each, with its own salt); an int64's
    # bits as uint64, as `astype` gives them.
    z = np.empty((2, len(tokens)), np.uint64)
    z[0] = np.asarray(tokens, dtype=np.int64)
    z[1] = np.asarray(positions, dtype=np.int64)
    z += _SALTS
    _mix(z)
    rows = np.empty((4, len(tokens)), np.int64)
    rows[0::2] = z % _UROWS
    rows[1::2] = (z >> _U32) % _UROWS
    rows += _TABLE_OFFSETS
    return rows


class SyntheticModel:
    """Q/K/V generator for one `ModelShape`; tables live on `device`."""

    __slots__ = ("shape", "device", "_tables", "_kv_tables", "_token_gain", "_pos_gain", "_split",
                 "_cast_gains", "_gains")

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
        # The K/V columns alone, for the verifier's recomputation (no Q columns gathered).
        self._kv_tables = self._tables[:, :, :2 * kv].contiguous()
        signs = torch.randint(0, 2, (2, shape.num_layers, width), generator=gen) * 2 - 1
        # Each part sums two N(0, 1) rows; scaled so K, V and Q entries are N(0, 1) again.
        self._token_gain = (signs[0] * (0.8 / 2**0.5)).float().to(device)
        self._pos_gain = (signs[1] * (0.6 / 2**0.5)).float().to(device)
        # Every gain is one of these two up to its sign (`kv_casts`).
        self._cast_gains = (self._token_gain.abs().amax(), self._pos_gain.abs().amax())
        # What a layer list's gains give (gathered gains, cast indices, fingerprint
        # weights), made once per list (per pool), not per step.
        self._gains: dict[tuple, object] = {}

    def rows(self, tokens: np.ndarray, positions: np.ndarray) -> torch.Tensor:
        """`table_rows` of `(tokens[i], positions[i])`, shape [4, n], on the device: computed
        once per step and reused for every layer."""
        return to_device([table_rows(tokens, positions)], self.device)[0]

    def qkv(self, rows: torch.Tensor, layer: int, *, with_q: bool = True
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """float32 K, V `[n, kv_heads, head_dim]` and Q `[n, q_heads, head_dim]` of `layer`."""
        x = self._project(rows, slice(layer, layer + 1), with_q)[0]
        return self._split_heads(x, with_q)

    def qkv_all(self, rows: torch.Tensor, layers: Sequence[int], kv_dtype: torch.dtype,
                q_dtype: torch.dtype | None, max_bytes: int = MAX_TEMP_BYTES,
                out: tuple[torch.Tensor, torch.Tensor | None] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """K/V of every layer in `layers` as `[len(layers), n, 2, kv_heads, head_dim]` of
        `kv_dtype` (a page's K-then-V layout per token) and Q as `[len(layers), n, q_heads,
        head_dim]` of `q_dtype` (None: no Q). Values are bit-identical to `qkv` per layer: the
        same elementwise float32 ops, broadcast over layers; layers go in groups so that the
        float32 temporaries stay under `max_bytes`. `out`: contiguous (K/V, Q) tensors of
        those shapes and types to write into (a CUDA graph's fixed outputs)."""
        s = self.shape
        kv, _, q = self._split
        with_q = q_dtype is not None
        w = 2 * kv + (q if with_q else 0)
        n = rows.shape[1]
        key = tuple(layers)
        gains = self._gains.get((key, w))
        if gains is None:
            lay = to_device([np.asarray(key, dtype=np.int64)], self.device)[0]
            gains = self._gains[(key, w)] = torch.stack((self._token_gain[lay, None, :w],
                                                         self._pos_gain[lay, None, :w]))
        num = len(key)
        # Both parts times their gains in one broadcast product ([2, layers, n, w]), then
        # their sum: the same float32 products and sum as `token * g_t + pos * g_p`, one
        # kernel launch fewer (a decode step's host time is mostly launches).
        parts = self._parts(rows, w, split=False)[:, None]
        group = max(1, max_bytes // max(1, 8 * n * w))
        if group >= num and out is None:
            # One group: the K/V (and Q) are the casts of one float32 result, no copies.
            x = parts * gains
            x = x[0] + x[1]
            kv_out = x[..., :2 * kv].to(kv_dtype)
            q_out = x[..., 2 * kv:].to(q_dtype) if with_q else None
        else:
            if out is not None:
                kv_out = out[0].view(num, n, 2 * kv)
                q_out = out[1].view(num, n, q) if with_q else None
            else:
                kv_out = torch.empty((num, n, 2 * kv), dtype=kv_dtype, device=self.device)
                q_out = (torch.empty((num, n, q), dtype=q_dtype, device=self.device)
                         if with_q else None)
            for g0 in range(0, num, group):
                g1 = min(num, g0 + group)
                x = parts * gains[:, g0:g1]
                x = x[0] + x[1]
                kv_out[g0:g1] = x[..., :2 * kv]
                if with_q:
                    q_out[g0:g1] = x[..., 2 * kv:]
        kv_out = kv_out.reshape(num, n, 2, s.num_kv_heads, s.head_dim)
        if with_q:
            q_out = q_out.reshape(num, n, s.num_q_heads, s.head_dim)
        return kv_out, q_out

    def kv_exact(self, rows: torch.Tensor, layers: Sequence[int], kv_dtype: torch.dtype
                 ) -> torch.Tensor:
        """`qkv_all(rows, layers, kv_dtype, None)[0]` bit for bit, without float32 work per
        layer (what the verifier recomputes for every key it reads): a layer's gains are
        one of two constants with a sign per column, so each column of each layer is one of
        the four casts of `token * (+-g_t) + pos * (+-g_p)` (`kv_casts`), computed once for
        all layers and picked per (layer, column) (`cast_index`). A `[L, n, 2, kv_heads,
        head_dim]` view (not contiguous)."""
        s = self.shape
        casts = self.kv_casts(rows, kv_dtype)
        n, _, w = casts.shape
        index = self._exact_index(layers).view(-1)
        want = casts.view(n, 4 * w).index_select(1, index)
        return want.view(n, len(layers), 2, s.num_kv_heads, s.head_dim).transpose(0, 1)

    def cast_index(self, layers: Sequence[int]) -> torch.Tensor:
        """`[L, w]`: which of the four casts (`kv_casts`) K/V column `c` of layer `l` is."""
        return self._exact_index(layers) // (2 * self._split[0])

    def kv_exact_per_layer(self, rows: torch.Tensor, layers: Sequence[int],
                           kv_dtype: torch.dtype) -> torch.Tensor:
        """`rows` `[4, L, m]`: the K/V of row group `l` at `layers[l]` alone, `[L, m, 2,
        kv_heads, head_dim]` (a few keys per layer, as a report of a mismatch needs)."""
        s = self.shape
        L, m = rows.shape[1], rows.shape[2]
        casts = self.kv_casts(rows.reshape(4, -1), kv_dtype)
        w = casts.shape[2]
        index = self._exact_index(layers)[:, None, :].expand(L, m, w)
        # Gathered as integers of the storage type's size (no gather kernels for fp8).
        ints = casts.view(widest_int(casts.element_size()))
        want = ints.view(L, m, 4 * w).gather(2, index).view(casts.dtype)
        return want.view(L, m, 2, s.num_kv_heads, s.head_dim)

    def kv_fingerprints(self, casts: torch.Tensor, layers: Sequence[int], proj: torch.Tensor
                        ) -> torch.Tensor:
        """int32 `[L, n, 2, M]`: the `fingerprint`s (with `proj`) of the K/V of `layers` whose
        casts (`kv_casts`) are given, from the casts alone. A row's projection sums its bytes
        times `proj`'s rows; the bytes of column `c` at layer `l` are those of the cast `l`
        picks for `c`, so one integer matmul of the casts' bytes with `proj` spread over
        (cast, column, layer) gives every layer's fingerprints without the `[L, n, ...]`
        K/V."""
        n, _, w = casts.shape
        weights = self._fingerprint_weights(layers, casts.element_size(), proj)
        sums = int_matmul(casts.view(torch.int8).view(n, -1), weights)
        return sums.view(n, len(layers), 2, proj.shape[1]).transpose(0, 1)

    def kv_casts(self, rows: torch.Tensor, kv_dtype: torch.dtype) -> torch.Tensor:
        """`[n, 4, w]`: the four casts of `token * (+-g_t) + pos * (+-g_p)` per K/V column,
        in cast order (`+ +`, `+ -`, `- +`, `- -`)."""
        w = 2 * self._split[0]
        token, pos = self._parts(rows, w)
        # x * (-g) is -(x * g) exactly, and x + (-y) is x - y: two products and four sums
        # give the four casts (an FMA-free float32 product each, as `qkv_all` computes).
        a, b = token.mul_(self._cast_gains[0]), pos.mul_(self._cast_gains[1])
        casts = torch.empty((token.shape[0], 4, w), dtype=kv_dtype, device=self.device)
        casts[:, 0] = a + b
        casts[:, 1] = a - b
        casts[:, 2] = b - a
        casts[:, 3] = a.neg_().sub_(b)
        return casts

    def _exact_index(self, layers: Sequence[int]) -> torch.Tensor:
        """`[L, w]`: per layer and K/V column, the column of the four casts `[4 * w]` it
        takes (cast `(token gain < 0) * 2 + (position gain < 0)`)."""
        key = ("exact",) + tuple(layers)
        index = self._gains.get(key)
        if index is None:
            w = 2 * self._split[0]
            lay = to_device([np.asarray(layers, dtype=np.int64)], self.device)[0]
            tg, pg = self._token_gain[lay, :w], self._pos_gain[lay, :w]
            cast = (tg < 0).long() * 2 + (pg < 0).long()
            index = self._gains[key] = cast * w + torch.arange(w, device=self.device)
        return index

    def _fingerprint_weights(self, layers: Sequence[int], esize: int, proj: torch.Tensor
                             ) -> torch.Tensor:
        """int8 `[4 * w * esize, L * 2 * M]`: byte `j` of column `c` of cast `a` weighs
        `proj[(c % (w / 2)) * esize + j]` in the fingerprints of K (`c < w / 2`) or V at the
        layers that pick cast `a` for `c`, zero elsewhere."""
        key = ("fingerprint", esize, proj.shape[1]) + tuple(layers)
        weights = self._gains.get(key)
        if weights is None:
            w = 2 * self._split[0]
            cast = self.cast_index(layers)
            picks = (cast.t()[None] == torch.arange(4, device=self.device)[:, None, None])
            half = torch.arange(w, device=self.device) // (w // 2)
            halves = half[:, None] == torch.arange(2, device=self.device)
            by_col = proj.reshape(w // 2, esize, -1).repeat(2, 1, 1).int()
            weights = (picks.int()[:, :, None, :, None, None]
                       * halves.int()[None, :, None, None, :, None]
                       * by_col[None, :, :, None, None, :])
            weights = self._gains[key] = column_major(
                weights.to(torch.int8).reshape(4 * w * esize, -1))
        return weights

    def _parts(self, rows: torch.Tensor, w: int, split: bool = True):
        """The token and position parts of `rows`' first `w` columns: (token, pos), or one
        `[2, n, w]` tensor when not `split`."""
        # One gather for all four tables (rows of table i sit at offset i * TABLE_ROWS) and
        # one add for both parts: [token, position] x [first row, second row].
        tables = self._kv_tables if w <= self._kv_tables.shape[2] else self._tables
        flat = tables.view(4 * TABLE_ROWS, -1)
        g = flat.index_select(0, rows.reshape(-1)).view(2, 2, -1, flat.shape[1])
        if w < flat.shape[1]:
            g = g[..., :w]
        parts = g[:, 0] + g[:, 1]
        return parts.unbind(0) if split else parts

    def _project(self, rows: torch.Tensor, layers: slice, with_q: bool) -> torch.Tensor:
        kv, _, q = self._split
        w = 2 * kv + (q if with_q else 0)
        token, pos = self._parts(rows, w)
        return token * self._token_gain[layers, None, :w] + pos * self._pos_gain[layers, None, :w]

    def _split_heads(self, x: torch.Tensor, with_q: bool):
        s = self.shape
        kv = self._split[0]
        k = x[:, :kv].reshape(-1, s.num_kv_heads, s.head_dim)
        v = x[:, kv:2 * kv].reshape(-1, s.num_kv_heads, s.head_dim)
        if not with_q:
            return k, v, None
        return k, v, x[:, 2 * kv:].reshape(-1, s.num_q_heads, s.head_dim)
