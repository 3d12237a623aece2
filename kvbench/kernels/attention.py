"""Paged batches and the torch reference attention backend.

A `PagedBatch` is one pool's context items (or decode items) of a step, flattened into
FlashInfer's CSR page tables: `kv_indptr` over pages, int32 page indices, `last_page_len`, and
`qo_indptr` over the queries. Page indices are those of the pool's first layer (`slot * L`);
layer `l` adds `l`, except for scratch pages, which are the same in every layer.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from .step import StepItem
from .storage import PoolTensors

QUERY_CHUNK = 256
"""Queries per score matrix in `attend`: bounds its memory on long prompts."""


class PagedBatch:
    """One pool's items of one kind (context or decode) in a step, as page tables."""

    __slots__ = (
        "items", "pool", "window", "decode", "tpb", "kv_start", "kv_len", "qo_indptr",
        "kv_indptr", "last_page_len", "pages", "has_scratch", "new_positions", "new_tokens",
        "tok_batch", "tok_rel", "_base", "_scratch_mask", "_tok_page",
        "_tok_slot", "device",
    )

    def __init__(self, items: Sequence[StepItem], pool: PoolTensors, tokens_per_block: int,
                 device: torch.device, *, decode: bool) -> None:
        tpb = tokens_per_block
        spec = pool.spec
        num_layers = pool.num_layers
        self.items = list(items)
        self.pool = pool
        self.window = spec.window
        self.decode = decode
        self.tpb = tpb
        n = len(self.items)
        kv_start = np.zeros(n, np.int64)
        kv_len = np.zeros(n, np.int64)
        qo_indptr = np.zeros(n + 1, np.int64)
        kv_indptr = np.zeros(n + 1, np.int64)
        pages: list[np.ndarray] = []
        masks: list[np.ndarray] = []
        for i, it in enumerate(self.items):
            kv_start[i] = it.first_block * tpb
            needed = max(0, it.start - spec.window + 1) if spec.window else 0
            if kv_start[i] > needed:
                raise ValueError(
                    f"request {it.request_id}: page table starts at block {it.first_block} but "
                    f"the step's queries need position {needed} (block {needed // tpb})")
            kv_len[i] = it.end - kv_start[i]
            npages = -(-int(kv_len[i]) // tpb)
            if len(it.blocks) < npages:
                raise ValueError(
                    f"request {it.request_id}: page table has {len(it.blocks)} blocks from "
                    f"block {it.first_block}, positions up to {it.end - 1} need {npages}")
            blocks = np.asarray(it.blocks[:npages], dtype=np.int64)
            p = blocks * num_layers
            mask = np.zeros(npages, bool)
            for index, page in (it.scratch or {}).items():
                r = index - it.first_block
                if 0 <= r < npages:
                    p[r] = page
                    mask[r] = True
            bad = ~mask & ((blocks < 0) | (blocks >= spec.num_gpu_slots))
            if bad.any():
                raise ValueError(f"request {it.request_id}: page table names GPU block "
                                 f"{blocks[bad][0]}, outside the pool")
            pages.append(p)
            masks.append(mask)
            qo_indptr[i + 1] = qo_indptr[i] + it.end - it.start
            kv_indptr[i + 1] = kv_indptr[i] + npages
        self.kv_start = kv_start
        self.kv_len = kv_len
        self.qo_indptr = qo_indptr
        self.kv_indptr = kv_indptr
        self.last_page_len = kv_len - (np.diff(kv_indptr) - 1) * tpb
        self.pages = np.concatenate(pages) if pages else np.zeros(0, np.int64)
        mask = np.concatenate(masks) if masks else np.zeros(0, bool)
        self.has_scratch = bool(mask.any())
        total_pages = spec.num_gpu_slots + spec.num_scratch_slots
        if self.has_scratch and not (
                (self.pages[mask] >= 0) & (self.pages[mask] < total_pages * num_layers)).all():
            raise ValueError("a scratch page lies outside the pool's GPU tensor")
        # The step's computed tokens, flattened in item order.
        self.new_positions = np.concatenate(
            [np.arange(it.start, it.end, dtype=np.int64) for it in self.items])
        self.new_tokens = np.concatenate(
            [np.asarray(it.tokens[it.start:it.end], dtype=np.int64) for it in self.items])
        counts = np.diff(qo_indptr)
        self.tok_batch = np.repeat(np.arange(n, dtype=np.int64), counts)
        self.tok_rel = self.new_positions - kv_start[self.tok_batch]
        tok_page = kv_indptr[self.tok_batch] + self.tok_rel // tpb
        self.device = device
        self._base = torch.from_numpy(self.pages).to(device)
        self._scratch_mask = torch.from_numpy(mask).to(device) if self.has_scratch else None
        self._tok_page = torch.from_numpy(tok_page).to(device)
        self._tok_slot = torch.from_numpy(self.tok_rel % tpb).to(device)

    def layer_pages(self, layer: int) -> torch.Tensor:
        """Page index of every page-table entry in the pool's `layer`-th layer (int64)."""
        pages = self._base + layer
        if self._scratch_mask is not None:
            pages = torch.where(self._scratch_mask, self._base, pages)
        return pages

    def write_targets(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(page, slot in page) where each computed token's K/V goes in `layer`."""
        return self.layer_pages(layer)[self._tok_page], self._tok_slot

    def item_pages(self, pages: torch.Tensor, i: int) -> torch.Tensor:
        return pages[int(self.kv_indptr[i]):int(self.kv_indptr[i + 1])]


def gather_kv(kv: torch.Tensor, pages: torch.Tensor, length: int
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 K and V `[length, kv_heads, head_dim]` read through a page table."""
    got = kv[pages].float()
    heads, dim = got.shape[-2:]
    return got[:, 0].reshape(-1, heads, dim)[:length], got[:, 1].reshape(-1, heads, dim)[:length]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
           k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Causal (optionally sliding-window) GQA attention in float32.

    q `[nq, q_heads, d]`, k and v `[nk, kv_heads, d]`; query head `h` reads kv head
    `h // (q_heads // kv_heads)` (FlashInfer's grouping); a query at position `p` sees keys at
    positions `(p - window, p]`. Returns `[nq, q_heads, d]`.
    """
    nq, hq, d = q.shape
    hk = k.shape[1]
    g = hq // hk
    kt = k.float().permute(1, 2, 0)
    vt = v.float().permute(1, 0, 2)
    out = torch.empty((nq, hq, d), dtype=torch.float32, device=q.device)
    for c0 in range(0, nq, QUERY_CHUNK):
        qc = q[c0:c0 + QUERY_CHUNK].float()
        c = qc.shape[0]
        qh = qc.view(c, hk, g, d).permute(1, 0, 2, 3).reshape(hk, c * g, d)
        s = torch.bmm(qh, kt) * d**-0.5
        qp = q_pos[c0:c0 + c].repeat_interleave(g)[:, None]
        hidden = k_pos[None, :] > qp
        if window is not None:
            hidden |= k_pos[None, :] <= qp - window
        s.masked_fill_(hidden, float("-inf"))
        o = torch.bmm(torch.softmax(s, dim=-1), vt)
        out[c0:c0 + c] = o.view(hk, c, g, d).permute(1, 0, 2, 3).reshape(c, hq, d)
    return out


class TorchBackend:
    """Reference backend: gathers each item's pages and runs `attend` (CPU or CUDA)."""

    name = "torch"

    def plan(self, batch: PagedBatch) -> None:
        """Nothing to plan: page tables are read per layer."""

    def write(self, kv: torch.Tensor, batch: PagedBatch, layer: int, k: torch.Tensor,
              v: torch.Tensor) -> None:
        page, slot = batch.write_targets(layer)
        kv[page, 0, slot] = k
        kv[page, 1, slot] = v

    def run(self, kv: torch.Tensor, batch: PagedBatch, layer: int, q: torch.Tensor
            ) -> torch.Tensor:
        pages = batch.layer_pages(layer)
        out = torch.empty(q.shape, dtype=torch.float32, device=q.device)
        dev = q.device
        for i, it in enumerate(batch.items):
            k, v = gather_kv(kv, batch.item_pages(pages, i), int(batch.kv_len[i]))
            q0, q1 = int(batch.qo_indptr[i]), int(batch.qo_indptr[i + 1])
            out[q0:q1] = attend(
                q[q0:q1], k, v, torch.arange(it.start, it.end, device=dev),
                torch.arange(int(batch.kv_start[i]), it.end, device=dev), batch.window)
        return out
