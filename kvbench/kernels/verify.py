"""Dense recomputation of a step's attention from the full token history, and comparison.

Two checks per item and layer. First the K/V every query of the step reads, fetched through
the page table, must equal bit for bit what the synthetic model gives for those (token,
position, layer)s, rounded to the storage type: a wrong page, a skipped or misdirected copy,
a block overwritten after it was claimed, or a block reused at another position shows up
here, whatever the tolerances. Then the backend's output must match `attend` on the
recomputed K/V within the tolerance of the dtype.
"""

from __future__ import annotations

import numpy as np
import torch

from .attention import PagedBatch, attend, gather_kv
from .model import SyntheticModel
from .step import Mismatch, StepItem
from .storage import STORAGE_DTYPES

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
    """Checks one batch layer by layer: `begin` once per batch, then `check` per layer.
    `origin(pool, block)` names the copy that last filled a GPU block, for the report."""

    __slots__ = ("model", "dtype", "atol", "rtol", "origin", "_ref")

    def __init__(self, model: SyntheticModel, dtype: str, origin) -> None:
        self.model = model
        self.dtype = STORAGE_DTYPES[dtype]
        self.atol, self.rtol = TOLERANCES[dtype]
        self.origin = origin
        self._ref: list[tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]] = []

    def begin(self, batch: PagedBatch) -> None:
        """Per item: the first position any query reads, and the table rows, key positions
        and query positions of the reference, shared by all layers."""
        dev = self.model.device
        self._ref = []
        for i, it in enumerate(batch.items):
            kv0 = int(batch.kv_start[i])
            lo = max(kv0, it.start - batch.window + 1) if batch.window else kv0
            positions = np.arange(lo, it.end, dtype=np.int64)
            rows = self.model.rows(np.asarray(it.tokens[lo:it.end], dtype=np.int64), positions)
            self._ref.append((lo, rows, torch.from_numpy(positions).to(dev),
                              torch.arange(it.start, it.end, device=dev)))

    def check(self, step: int, kv: torch.Tensor, batch: PagedBatch, pool: int, local: int,
              layer: int, q: torch.Tensor, out: torch.Tensor) -> tuple[float, Mismatch | None]:
        """(max abs output error, first mismatch) over the batch's items at one layer;
        `local` is the layer's index in the pool, `layer` its index in the model."""
        pages = batch.layer_pages(local)
        worst = 0.0
        for i, it in enumerate(batch.items):
            lo, rows, k_pos, q_pos = self._ref[i]
            kv0 = int(batch.kv_start[i])
            item_pages = batch.item_pages(pages, i)
            k, v = gather_kv(kv, item_pages, int(batch.kv_len[i]))
            k, v = k[lo - kv0:], v[lo - kv0:]
            ek, ev, _ = self.model.qkv(rows, layer, with_q=False)
            ek = ek.to(self.dtype).float()
            ev = ev.to(self.dtype).float()
            diff = torch.maximum((k - ek).abs().amax(dim=(1, 2)), (v - ev).abs().amax(dim=(1, 2)))
            # NaN compares unequal, so it is caught like any wrong value.
            bad = torch.nonzero(~(diff == 0))
            if len(bad):
                j = int(bad[0])
                return worst, self._mismatch(step, it, batch, item_pages, pool, layer, "kv",
                                             lo + j, float(diff[j]), 0.0)
            q0, q1 = int(batch.qo_indptr[i]), int(batch.qo_indptr[i + 1])
            ref = attend(q[q0:q1], ek, ev, q_pos, k_pos, batch.window)
            err_per_query = (out[q0:q1].float() - ref).abs().amax(dim=(1, 2))
            err = float(err_per_query.max())
            tol = self.atol + self.rtol * float(ref.abs().max())
            if not err <= tol:
                j = int(torch.argmax(torch.nan_to_num(err_per_query, nan=float("inf"))))
                return max(worst, err), self._mismatch(
                    step, it, batch, item_pages, pool, layer, "attention", it.start + j, err, tol)
            worst = max(worst, err)
        return worst, None

    def _mismatch(self, step: int, it: StepItem, batch: PagedBatch, item_pages: torch.Tensor,
                  pool: int, layer: int, kind: str, position: int, error: float,
                  tolerance: float) -> Mismatch:
        index = position // batch.tpb
        entry = index - it.first_block
        page = int(item_pages[entry])
        scratch = it.scratch is not None and index in it.scratch
        if scratch:
            block_id, tier = None, "scratch"
        else:
            block_id = int(it.blocks[entry])
            source = self.origin(pool, block_id)
            tier = f"GPU ({source})" if source else "GPU"
        return Mismatch(step, it.request_id, layer, kind, position, index, block_id, page, tier,
                        error, tolerance)
