"""Dense recomputation of a step's attention from the full token history, and comparison.

Two checks per item and layer. First the K/V every query of the step reads, fetched through
the page table, must equal bit for bit what the synthetic model gives for those (token,
position, layer)s, rounded to the storage type: a wrong page, a skipped or misdirected copy,
a block overwritten after it was claimed, or a block reused at another position shows up
here, whatever the tolerances (`SyntheticModel.kv_exact` recomputes them without float32
work per layer). Then the backend's output must match the reference attention
(`reference.attend_segments`) on the K/V read, which the first check proved equal to the
model's, within the tolerance of the dtype; for decode batches the reference reads those K/V
as the model's four casts per column (`reference.attend_casts`: a decode query's cost is the
keys it reads, and every layer's keys are picks of the same four casts).

Bits are compared through `fingerprint`s (exact integer projections of each K/V row's bytes;
the model gives the expected ones from its four per-column casts, `kv_fingerprints`), so a
check reads each page once rather than comparing it with a recomputed copy; without integer
matmuls (`projections` returns None) every byte is compared.

A batch is checked in tiles of items and layers (all layers at once unless an item's keys are
too many for the memory budget). On a GPU the host never waits while a step's checks are
queued (tables go up through the pinned ring, nothing is read back); the verdicts of every
batch, item and layer of the step then reach the host in one copy (`settle`), and only a
failure reads more. The first mismatch in (batch, layer, item) order is reported, a K/V
mismatch before an attention one.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch
import torch.nn.functional as F

from .attention import KeyIndex, PagedBatch, gather_keys
from .fingerprint import fingerprint, projections
from .model import SyntheticModel
from .reference import attend_casts, attend_segments, tile_bytes, tiles
from .staging import to_device
from .step import Mismatch, StepItem
from .storage import STORAGE_DTYPES, widest_int

TOLERANCES = {
    "float32": (1e-5, 1e-4),
    "float16": (1e-4, 4e-3),
    "bfloat16": (1e-3, 1.6e-2),
    "fp8": (1e-3, 1.6e-2),
}
"""(atol, rtol) on attention outputs, per KV dtype: an output passes when
`max |out - ref| <= atol + rtol * max |ref|` over the item's queries of one layer. K/V are
compared exactly, so these cover kernel arithmetic alone: FlashInfer rounds the softmax
probabilities and the output to the 16-bit query type (2^-8 relative for bfloat16, 2^-11 for
float16; fp8 K/V run with bfloat16 queries); the margins are 4x (bfloat16) and 8x (float16).
float32 runs only on the torch backend, whose reference is the same float32 arithmetic."""


class Verifier:
    """Checks one batch of one pool, every layer at once. `origin(pool, block)` names the
    copy that last filled a GPU block, for the report."""

    __slots__ = ("model", "dtype", "atol", "rtol", "origin", "kind_prefix", "proj")

    def __init__(self, model: SyntheticModel, dtype: str, origin, kind_prefix: str = "") -> None:
        self.model = model
        self.dtype = STORAGE_DTYPES[dtype]
        self.atol, self.rtol = TOLERANCES[dtype]
        self.origin = origin
        self.kind_prefix = kind_prefix
        """`cross ` for the verifier of cross batches (`attention.CrossBatch`), whose model
        is the encoder's K/V generator."""
        s = model.shape
        self.proj = projections(s.num_kv_heads * s.head_dim * self.dtype.itemsize,
                                model.device)
        """K/V rows are compared by `fingerprint` with these weights (None: byte for byte,
        where integer matmuls do not serve)."""

    def check(self, step: int, kv: torch.Tensor, batch: PagedBatch, pool: int,
              layers: tuple[int, ...], q: torch.Tensor, out: torch.Tensor) -> Check:
        """Queue the checks of the batch's items at the pool's `layers` (model layer ids);
        q and out are `[L, queries, q_heads, d]`. Nothing is read back: `settle` reads the
        verdicts of a whole step in one copy. Everything a report needs is computed here, so
        the pages may be overwritten before the step is settled (scratch pages are)."""
        keys = batch.item_keys(windowed=True)
        L, n = len(layers), len(batch.items)
        dev = kv.device
        s = self.model.shape
        kv_bad = torch.zeros((L, n), dtype=torch.float32, device=dev)
        # Per (layer, item): the first key whose bits differ (`NO_KEY`: none) and its
        # largest absolute K/V difference, for the report.
        first_key = torch.full((L, n), NO_KEY, dtype=torch.int64, device=dev)
        key_err = torch.zeros((L, n), dtype=torch.float32, device=dev)
        err_q = torch.zeros((L, int(batch.qo_indptr[-1])), dtype=torch.float32, device=dev)
        ref_q = torch.zeros_like(err_q)
        # A decode tile holds the K/V read in their storage type alone (its reference reads
        # the model's casts); other tiles also float32 copies of them.
        per_key = 2 * s.num_kv_heads * s.head_dim * (self.dtype.itemsize if batch.decode
                                                      else 4)
        budget = tile_bytes(dev)
        tile_keys: tuple | None = None
        for lay, items in tiles(np.diff(keys.indptr), L, per_key, budget):
            k0, k1 = int(keys.indptr[items.start]), int(keys.indptr[items.stop])
            first_group = tile_keys is None or tile_keys[0] != items
            if first_group:
                # The tile's keys (table rows, their item, the model's casts) serve every
                # layer group of the same items.
                rows = self.model.rows(batch_tokens(batch, keys, items), keys.positions[k0:k1])
                bounds = keys.indptr[items.start:items.stop + 1] - k0
                tile_keys = (items, rows, to_device([bounds], dev)[0],
                             self.model.kv_casts(rows, self.dtype))
            got = gather_keys(kv, batch, keys, lay, items)
            self._check_keys(got, tile_keys, layers[lay], k0, k1,
                             (kv_bad, first_key, key_err), lay)
            # The reference reads the K/V the check just compared with the model's (where
            # they differ, the K/V mismatch is what gets reported): for decode items as the
            # model's casts, every layer at once with the items' first layer group (the
            # layers ride on the matmuls' rows), else the pages' K/V in their storage type,
            # upcast once per tile.
            q0, q1 = int(batch.qo_indptr[items.start]), int(batch.qo_indptr[items.stop])
            if not batch.decode:
                refs = attend_segments(q[lay, q0:q1], got[:, :, 0], got[:, :, 1], batch, keys,
                                       items, batch.window, budget)
            elif first_group:
                lay = slice(0, L)
                refs = attend_casts(q[:, q0:q1], tile_keys[3], self.model.cast_index(layers),
                                    batch, keys, items, batch.window)
            else:
                refs = ()
            del got  # a decode reference's temporaries may take its memory
            for a, b, ref in refs:
                o = out[lay, q0 + a:q0 + b].float()
                err_q[lay, q0 + a:q0 + b] = (o - ref).abs().amax(dim=(2, 3))
                ref_q[lay, q0 + a:q0 + b] = ref.abs().amax(dim=(2, 3))
        err_item, ref_item, attn_bad = self._attention_verdicts(batch, err_q, ref_q)
        return Check(self, step, batch, pool, layers, keys,
                     torch.stack([kv_bad, attn_bad.float(), err_item]), first_key, key_err,
                     err_q, ref_item)

    def _check_keys(self, got: torch.Tensor, tile_keys: tuple, layers: tuple[int, ...],
                    k0: int, k1: int, out: tuple, lay: slice) -> None:
        """The K/V check of one tile: `got` `[G, keys, 2, kv_heads, head_dim]` read through
        the page tables for keys `[k0, k1)` at `layers`; `tile_keys` = (item range, the keys'
        table rows, the items' bounds among the tile's keys, the model's casts). Writes the
        tile's (layer, item) cells of `out` = (K/V wrong, first wrong key, its largest K/V
        difference) at layers `lay`."""
        kv_bad, first_key, key_err = out
        items, rows, bounds, casts = tile_keys
        if self.proj is not None:
            want = self.model.kv_fingerprints(casts, layers, self.proj)
            wrong = (fingerprint(got.flatten(3), self.proj) != want).flatten(2).any(-1)
        else:
            # Bit for bit: any other bits than the model's (NaN included) are wrong.
            bits = widest_int(got.shape[-1] * got.element_size())
            want = self.model.kv_exact(rows, layers, self.dtype)
            wrong = (got.view(bits) != want.view(bits)).flatten(2).any(-1)
        del want
        # An item's keys are a run of the tile's (keys ascend within an item): the running
        # count of wrong keys, read at the items' bounds, says which items have one, and
        # the first key where it passes its count before the item is the first wrong one.
        # (A scatter per key onto a few items would serialise on their atomics.)
        G, dev = wrong.shape[0], got.device
        seen = wrong.cumsum(1, dtype=torch.int32)
        before = F.pad(seen, (1, 0)).index_select(1, bounds)
        bad = before[:, 1:] > before[:, :-1]
        kv_bad[lay, items] = bad.float()
        first = torch.where(bad, torch.searchsorted(seen, before[:, :-1] + 1) + k0, int(NO_KEY))
        at = (first.clamp(max=k1 - 1) - k0).clamp(min=0)
        g_at = got[torch.arange(G, device=dev)[:, None], at]
        w_at = self.model.kv_exact_per_layer(rows[:, at], layers, self.dtype)
        first_key[lay, items] = first
        key_err[lay, items] = (g_at.float() - w_at.float()).abs().amax(dim=(2, 3, 4))

    def _attention_verdicts(self, batch: PagedBatch, err_q: torch.Tensor, ref_q: torch.Tensor
                            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Per (layer, item), from the per-query errors and reference magnitudes `[L,
        queries]`: the largest error (NaN counted apart), the largest reference magnitude,
        and whether the item's attention is wrong (a NaN, or an error past the tolerance)."""
        L, n = err_q.shape[0], len(batch.items)
        tok_item = to_device([batch.tok_batch], err_q.device)[0].expand(L, -1)
        nan_q = torch.isnan(err_q).float()
        err_item = torch.zeros((L, n), dtype=torch.float32, device=err_q.device).scatter_reduce_(
            1, tok_item, torch.nan_to_num(err_q, nan=0.0), "amax")
        ref_item = torch.zeros_like(err_item).scatter_reduce_(1, tok_item, ref_q, "amax")
        nan_item = torch.zeros_like(err_item).scatter_reduce_(1, tok_item, nan_q, "amax")
        attn_bad = (nan_item > 0) | (err_item > self.atol + self.rtol * ref_item)
        return err_item, ref_item, attn_bad

    def _report(self, c: Check, l: int, i: int, kv_wrong: bool) -> Mismatch:
        """The mismatch of item `i` at local layer `l`, the first failing one: its first wrong
        key (`kv_wrong`) or its query with the largest attention error. Reads back what the
        check left on the device (a mismatch may sync as it likes)."""
        batch, layers = c.batch, c.layers
        it = batch.items[i]
        if kv_wrong:
            key = int(c.first_key[l, i])
            return self._mismatch(c.step, it, batch, c.pool, i, l, layers[l], "kv",
                                  int(c.keys.positions[key]), float(c.key_err[l, i]), 0.0)
        q0, q1 = int(batch.qo_indptr[i]), int(batch.qo_indptr[i + 1])
        e = c.err_q[l, q0:q1].cpu().numpy()
        j = int(np.argmax(np.nan_to_num(e, nan=np.inf)))
        tol = self.atol + self.rtol * float(c.ref_item[l, i])
        return self._mismatch(c.step, it, batch, c.pool, i, l, layers[l], "attention",
                              it.start + j, float(e.max()), tol)

    def _mismatch(self, step: int, it: StepItem, batch: PagedBatch, pool: int, i: int,
                  local: int, layer: int, kind: str, position: int, error: float,
                  tolerance: float) -> Mismatch:
        index = position // batch.tpb if kind.endswith("kv") or batch.causal else 0
        entry = index - it.first_block
        page = int(batch.pages_dev[local, int(batch.kv_indptr[i]) + entry])
        scratch = it.scratch is not None and index in it.scratch
        if scratch:
            block_id, tier = None, "scratch"
        else:
            block_id = int(it.blocks[entry])
            source = self.origin(pool, block_id)
            tier = f"GPU ({source})" if source else "GPU"
        return Mismatch(step, it.request_id, layer, self.kind_prefix + kind, position, index,
                        block_id, page, tier, error, tolerance)


NO_KEY = np.iinfo(np.int64).max
"""`Check.first_key` of a (layer, item) whose keys all hold the model's bits."""


class Check:
    """A batch's queued verdicts, on the device: `verdict` `[3, L, n]` (K/V wrong, attention
    out of tolerance, largest attention error, per local layer and item), and what a report
    of a failure reads (first wrong key and its error, per-query errors, reference scale)."""

    __slots__ = ("verifier", "step", "batch", "pool", "layers", "keys", "verdict",
                 "first_key", "key_err", "err_q", "ref_item")

    def __init__(self, verifier: Verifier, step: int, batch: PagedBatch, pool: int,
                 layers: tuple[int, ...], keys: KeyIndex, verdict: torch.Tensor,
                 first_key: torch.Tensor, key_err: torch.Tensor, err_q: torch.Tensor,
                 ref_item: torch.Tensor) -> None:
        self.verifier = verifier
        self.step = step
        self.batch = batch
        self.pool = pool
        self.layers = layers
        self.keys = keys
        self.verdict = verdict
        self.first_key = first_key
        self.key_err = key_err
        self.err_q = err_q
        self.ref_item = ref_item


def settle(checks: Sequence[Check]) -> tuple[float, Mismatch | None]:
    """(largest attention error, first mismatch) of a step's checks, in their order: the
    verdicts of every check reach the host in one copy (the step's one wait for the GPU);
    the first failing (layer, item) of the first failing check is reported, a K/V mismatch
    before an attention one."""
    if not checks:
        return 0.0, None
    flat = torch.cat([c.verdict.reshape(-1) for c in checks]).cpu().numpy()
    worst, mismatch, o = 0.0, None, 0
    for c in checks:
        verdict = flat[o:o + c.verdict.numel()].reshape(c.verdict.shape)
        o += c.verdict.numel()
        if verdict[2].size:
            worst = max(worst, float(verdict[2].max()))
        bad = (verdict[0] > 0) | (verdict[1] > 0)
        if mismatch is None and bad.any():
            l, i = (int(x) for x in np.argwhere(bad)[0])
            mismatch = c.verifier._report(c, l, i, verdict[0, l, i] > 0)
    return worst, mismatch


def batch_tokens(batch: PagedBatch, keys, items: slice) -> np.ndarray:
    """Token ids of the keys of `items` (each item's tokens at its key positions)."""
    k0 = int(keys.indptr[items.start])
    out = np.empty(int(keys.indptr[items.stop]) - k0, np.int64)
    for i in range(items.start, items.stop):
        a, b = int(keys.indptr[i]), int(keys.indptr[i + 1])
        p0 = int(keys.positions[a]) if b > a else 0
        out[a - k0:b - k0] = np.asarray(batch.items[i].tokens[p0:p0 + b - a], dtype=np.int64)
    return out
