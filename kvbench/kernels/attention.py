"""Paged batches: a step's page tables, K/V writes and reads through them.

A `PagedBatch` is one pool's context items (or decode items) of a step, flattened into
FlashInfer's CSR page tables: `kv_indptr` over pages, page indices, `last_page_len`, and
`qo_indptr` over the queries. Page indices are those of the pool's first layer (`slot * L`);
layer `l` adds `l`, except for scratch pages, which are the same in every layer. Every layer
of the pool runs in one call: `layer_tables` repeats the tables once per layer (entry
`l * n + i` is item `i` at layer `l`), so one plan and one kernel launch cover the step's
attention, and one scatter writes the K/V of every layer (`write_kv`). `gather_keys` reads
K/V back through the tables (the reference attention and the verifier, `reference.py`).
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from itertools import chain

import numpy as np
import torch

from .model import table_rows
from .staging import Upload, to_device
from .step import StepItem
from .storage import PoolTensors, widest_int


def _check_reach(items: list[StepItem], kv_start: np.ndarray, needed: np.ndarray,
                 npages: np.ndarray, nblocks: np.ndarray, tpb: int) -> None:
    """Raise ValueError for the first item whose page table does not reach what its queries
    read: it starts after the first key needed, or has fewer blocks than its positions."""
    for i in np.flatnonzero((kv_start > needed) | (nblocks < npages))[:1]:
        it = items[i]
        if kv_start[i] > needed[i]:
            raise ValueError(
                f"request {it.request_id}: page table starts at block {it.first_block} but "
                f"the step's queries need position {needed[i]} (block {needed[i] // tpb})")
        raise ValueError(
            f"request {it.request_id}: page table has {len(it.blocks)} blocks from "
            f"block {it.first_block}, positions up to {it.end - 1} need {npages[i]}")


def _first_layer_pages(items: list[StepItem], npages: np.ndarray, kv_indptr: np.ndarray,
                       num_layers: int, num_gpu_slots: int) -> tuple[np.ndarray, np.ndarray]:
    """The flattened pages of the items at the pool's first layer (`slot * num_layers`; a
    scratch page as it is, the same in every layer) and the mask of scratch entries. Raises
    ValueError for a block outside the pool."""
    # Python ints to int64 through array.fromlist (a C loop per item's list): the page
    # tables are the bulk of a decode step's host work, O(pages) every step.
    flat = array("q")
    for it, k in zip(items, npages.tolist()):
        b = it.blocks[:k]
        flat.fromlist(b if type(b) is list else list(b))
    blocks = np.frombuffer(flat, np.int64) if len(flat) else np.zeros(0, np.int64)
    pages = blocks * num_layers
    mask = np.zeros(len(blocks), bool)
    scratch = False
    for i, it in enumerate(items):
        if it.scratch:
            for index, page in it.scratch.items():
                r = index - it.first_block
                if 0 <= r < npages[i]:
                    pages[kv_indptr[i] + r] = page
                    mask[kv_indptr[i] + r] = True
                    scratch = True
    # As uint64, a negative id is out of range too.
    bad = blocks.view(np.uint64) >= num_gpu_slots
    if scratch:
        bad &= ~mask
    if bad.any():
        j = int(np.argmax(bad))
        it = items[int(np.searchsorted(kv_indptr, j, side="right")) - 1]
        raise ValueError(f"request {it.request_id}: page table names GPU block "
                         f"{blocks[j]}, outside the pool")
    return pages, mask


def _check_scratch_pages(scratch_pages: np.ndarray, spec, num_layers: int) -> None:
    """Raises ValueError for a scratch page outside the pool's GPU tensor (GPU and scratch
    slots, every layer)."""
    total_pages = spec.num_gpu_slots + spec.num_scratch_slots
    if not ((scratch_pages >= 0) & (scratch_pages < total_pages * num_layers)).all():
        raise ValueError("a scratch page lies outside the pool's GPU tensor")


class PagedBatch:
    """One pool's items of one kind (context or decode) in a step, as page tables."""

    causal = True
    """Queries see keys up to their own position (a `CrossBatch` sees every key)."""

    __slots__ = (
        "items", "pool", "window", "decode", "tpb", "num_layers", "kv_start", "kv_len",
        "qo_indptr", "kv_indptr", "last_page_len", "pages", "scratch_mask", "has_scratch",
        "new_positions", "new_tokens", "tok_batch", "tok_rel", "tok_page", "device",
        "pages_dev", "ids", "rows", "_write_step", "_write_rows",
    )

    def __init__(self, items: Sequence[StepItem], pool: PoolTensors, tokens_per_block: int,
                 device: torch.device, *, decode: bool, upload: Upload | None = None) -> None:
        # Per item only what reads its Python fields; the rest is vectorised, and the device
        # gets everything (pages, write pages and slots, table rows) in one copy: the step's
        # `upload` (sent by the caller, which may read the device tables only after it), or
        # one of the batch's own.
        tpb = tokens_per_block
        spec = pool.spec
        num_layers = pool.num_layers
        self.items = items = list(items)
        self.pool = pool
        self.window = window = spec.window
        self.decode = decode
        self.tpb = tpb
        self.num_layers = num_layers
        n = len(items)
        # One pass over the items' fields: start, end, first block, blocks, first token.
        starts, ends, kv_start, nblocks, first_tokens = np.fromiter(
            chain.from_iterable((it.start, it.end, it.first_block, len(it.blocks),
                                 it.tokens[it.start]) for it in items),
            np.int64, 5 * n).reshape(n, 5).T
        kv_start = kv_start * tpb
        needed = np.maximum(0, starts - window + 1) if window else np.zeros(n, np.int64)
        kv_len = ends - kv_start
        npages = -(-kv_len // tpb)
        _check_reach(items, kv_start, needed, npages, nblocks, tpb)
        kv_indptr = np.zeros(n + 1, np.int64)
        np.cumsum(npages, out=kv_indptr[1:])
        counts = ends - starts
        qo_indptr = np.zeros(n + 1, np.int64)
        np.cumsum(counts, out=qo_indptr[1:])
        pages, mask = _first_layer_pages(items, npages, kv_indptr, num_layers,
                                         spec.num_gpu_slots)
        self.kv_start = kv_start
        self.kv_len = kv_len
        self.qo_indptr = qo_indptr
        self.kv_indptr = kv_indptr
        self.last_page_len = kv_len - (npages - 1) * tpb
        self.pages = pages
        self.scratch_mask = mask
        self.has_scratch = has_scratch = bool(mask.any())
        if has_scratch:
            _check_scratch_pages(pages[mask], spec, num_layers)
        self._step_tokens(starts, counts, first_tokens)
        self.device = device
        own = upload is None
        upload = Upload(device) if own else upload
        upload.add(self._device_arrays(), self._on_device)
        if own:
            upload.send()
            upload.release()

    def _step_tokens(self, starts: np.ndarray, counts: np.ndarray, first_tokens: np.ndarray
                     ) -> None:
        """The step's computed tokens, flattened in item order (decode: one per item): item,
        position, token id, position in the page table, page-table entry."""
        n, total = len(self.items), int(self.qo_indptr[-1])
        if total == n:
            self.tok_batch = np.arange(n, dtype=np.int64)
            self.new_positions = starts
            self.new_tokens = first_tokens
            self.tok_rel = starts - self.kv_start
            self.tok_page = self.kv_indptr[:-1] + self.tok_rel // self.tpb
            return
        self.tok_batch = tok_batch = np.repeat(np.arange(n, dtype=np.int64), counts)
        self.new_positions = (np.arange(total, dtype=np.int64)
                              + (starts - self.qo_indptr[:-1])[tok_batch])
        self.new_tokens = np.concatenate(
            [np.asarray(it.tokens[it.start:it.end], dtype=np.int64) for it in self.items])
        self.tok_rel = self.new_positions - self.kv_start[tok_batch]
        self.tok_page = self.kv_indptr[tok_batch] + self.tok_rel // self.tpb

    def _device_arrays(self) -> list[np.ndarray]:
        """What the device gets (`_on_device` reads it back in this order). Layer l's page of
        an entry is `page + l` (a scratch page is the same in every layer): expanded on the
        device from the first layer's pages (int32, FlashInfer's index type) and, with
        scratch pages, their steps (1 or 0); the write rows likewise from each token's rows
        at the first layer. `ids` `[6, n]` int64: each token's K row and V row at the first
        layer (rows of `wide_rows` of the pool), then its four `table_rows`: one array, so
        that a decode batch's CUDA graph takes all it reads in one copy (`graphs.py`)."""
        pages, tok_page, tpb = self.pages, self.tok_page, self.tpb
        ids = np.empty((6, len(tok_page)), np.int64)
        np.add(pages[tok_page] * (2 * tpb), self.tok_rel % tpb, out=ids[0])
        np.add(ids[0], tpb, out=ids[1])
        ids[2:] = table_rows(self.new_tokens, self.new_positions)
        arrays = [pages.astype(np.int32), ids]
        if self.has_scratch:
            step = (~self.scratch_mask).astype(np.int32)
            arrays += [step, step[tok_page].astype(np.int64)[:, None]]
        return arrays

    def _on_device(self, tables: list[torch.Tensor]) -> None:
        """The batch's device tables, from its uploaded arrays (see `__init__`)."""
        pages, self.ids = tables[:2]
        self.rows = self.ids[2:]
        self._write_rows = None
        layers32, _ = _layer_range(self.num_layers, 2 * self.tpb, self.device)
        if self.has_scratch:
            step, self._write_step = tables[2:]
            self.pages_dev = pages + layers32 * step
        else:
            self._write_step = None
            self.pages_dev = pages + layers32

    @property
    def write_rows(self) -> torch.Tensor:
        """`[L, n, 2]` int64: each computed token's K and V row at each layer, in the rows of
        `wide_rows` of the pool (what `write_kv` scatters to). Expanded on the device at first
        use: a decode batch replayed as a CUDA graph never asks (its graph expands them)."""
        if self._write_rows is None:
            self._write_rows = expand_write_rows(self.ids, self.num_layers, self.tpb,
                                                 self._write_step)
        return self._write_rows

    def layer_tables(self) -> tuple[np.ndarray, np.ndarray]:
        """The batch's tables repeated for every layer, layer-major (entry `l * n + i` is
        item `i` at layer `l`; its pages are `pages_dev[l]`'s, so the flattened `pages_dev`
        is the matching index array), int32: `[2, L * n + 1]` (qo_indptr, kv_indptr) and
        `[2, L * n]` (last_page_len, kv_len)."""
        L, n = self.num_layers, len(self.kv_len)
        layers = np.arange(L)[:, None]
        ptr = np.empty((2, L * n + 1), np.int32)
        body = ptr[:, :-1].reshape(2, L, n)  # a view: filled in place, cast on assignment
        body[0] = self.qo_indptr[:-1] + layers * self.qo_indptr[-1]
        body[1] = self.kv_indptr[:-1] + layers * self.kv_indptr[-1]
        ptr[0, -1] = L * self.qo_indptr[-1]
        ptr[1, -1] = L * self.kv_indptr[-1]
        lens = np.empty((2, L, n), np.int32)
        lens[0] = self.last_page_len
        lens[1] = self.kv_len
        return ptr, lens.reshape(2, L * n)

    def layer_slice(self, layer: int) -> PagedBatch:
        """The batch at one layer of its pool alone (pages shifted to that layer's): how a
        batch with scratch pages runs, since every layer reuses the same scratch page."""
        part = object.__new__(PagedBatch)
        for name in PagedBatch.__slots__:
            setattr(part, name, getattr(self, name))
        part.num_layers = 1
        part.pages = np.where(self.scratch_mask, self.pages, self.pages + layer)
        part.pages_dev = self.pages_dev[layer:layer + 1]
        part._write_rows = self.write_rows[layer:layer + 1]
        return part

    def item_keys(self, windowed: bool) -> KeyIndex:
        """The keys each item's queries read: from the window's start (`windowed`) or the
        page table's start, to the item's end."""
        return KeyIndex(self, windowed)


class CrossBatch(PagedBatch):
    """Cross-attention of a decoder batch: the queries of its items that have an encoder
    input (`StepItem.cross`) attend, non-causally, to every position of that input, read
    through its cross page table at the decoder pool's layers.

    The cross pool holds every model layer (block `b` of layer `l` is page `b * L + l`), so
    `pages_dev[i]` holds the pages of `layers[i]`. Items are the encoder inputs (tokens, cross
    blocks, positions `[0, len)`); `start` is the decoder item's first query position, for
    reports. `new_positions` gives each query the last encoder position, so the causal mask
    of the shared reference (`attend_segments`) hides nothing but padding. `query_index`
    selects the queries in the decoder batch's order (device tensor)."""

    __slots__ = ("query_index",)
    causal = False

    def __init__(self, batch: PagedBatch, cross: PoolTensors, layers: Sequence[int],
                 device: torch.device) -> None:
        tpb = batch.tpb
        spec = cross.spec
        rows, queries, pages = [], [], []
        for i, it in enumerate(batch.items):
            if it.cross is None:
                continue
            c = it.cross
            npages = -(-len(c.tokens) // tpb)
            if len(c.blocks) < npages:
                raise ValueError(f"request {it.request_id}: cross page table has "
                                 f"{len(c.blocks)} blocks, its encoder input needs {npages}")
            blocks = np.asarray(c.blocks[:npages], dtype=np.int64)
            if ((blocks < 0) | (blocks >= spec.num_gpu_slots)).any():
                raise ValueError(f"request {it.request_id}: cross page table names a block "
                                 f"outside the cross pool")
            rows.append(_CrossRow(it.request_id, c.tokens, blocks, it.start))
            queries.append(np.arange(batch.qo_indptr[i], batch.qo_indptr[i + 1]))
            pages.append(blocks * cross.num_layers)
        n = len(rows)
        self.items = rows
        self.pool = cross
        self.window = None
        self.decode = batch.decode
        self.tpb = tpb
        self.num_layers = len(layers)
        self.kv_start = np.zeros(n, np.int64)
        self.kv_len = np.array([len(r.tokens) for r in rows], np.int64)
        counts = np.array([len(q) for q in queries], np.int64)
        self.qo_indptr = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
        self.kv_indptr = np.concatenate(
            [[0], np.cumsum([len(p) for p in pages])]).astype(np.int64)
        self.last_page_len = self.kv_len - (np.diff(self.kv_indptr) - 1) * tpb
        self.pages = np.concatenate(pages) if pages else np.zeros(0, np.int64)
        self.scratch_mask = np.zeros(len(self.pages), bool)
        self.has_scratch = False
        self.tok_batch = np.repeat(np.arange(n, dtype=np.int64), counts)
        self.new_positions = (self.kv_len - 1)[self.tok_batch]
        self.new_tokens = self.rows = None
        self.tok_rel = self.tok_page = self.ids = self._write_rows = self._write_step = None
        self.device = device
        lay = np.asarray(layers, dtype=np.int64)[:, None]
        self.pages_dev, self.query_index = to_device(
            [self.pages[None, :] + lay,
             np.concatenate(queries) if queries else np.zeros(0, np.int64)], device)

    @staticmethod
    def wanted(batch: PagedBatch) -> bool:
        return any(it.cross is not None for it in batch.items)


class _CrossRow:
    """An encoder input as an item of a `CrossBatch` (the fields the verifier reads)."""

    __slots__ = ("request_id", "tokens", "blocks", "start", "first_block", "scratch")

    def __init__(self, request_id: int, tokens: np.ndarray, blocks: np.ndarray,
                 start: int) -> None:
        self.request_id = request_id
        self.tokens = tokens
        self.blocks = blocks
        self.start = start
        self.first_block = 0
        self.scratch = None


class KeyIndex:
    """Per key of a batch (items in order, positions ascending): its position, its item and
    where it sits (page-table entry, slot in page)."""

    __slots__ = ("lo", "indptr", "positions", "item", "entry", "slot")

    def __init__(self, batch: PagedBatch, windowed: bool) -> None:
        lo = batch.kv_start.copy()
        if windowed and batch.window:
            starts = np.array([it.start for it in batch.items], np.int64)
            lo = np.maximum(lo, starts - batch.window + 1)
        ends = batch.kv_start + batch.kv_len
        counts = ends - lo
        self.lo = lo
        self.indptr = np.concatenate([[0], np.cumsum(counts)])
        self.item = np.repeat(np.arange(len(batch.items), dtype=np.int64), counts)
        self.positions = np.arange(int(self.indptr[-1]), dtype=np.int64) \
            - self.indptr[:-1][self.item] + lo[self.item]
        rel = self.positions - batch.kv_start[self.item]
        self.entry = batch.kv_indptr[self.item] + rel // batch.tpb
        self.slot = rel % batch.tpb


def write_kv(kv: torch.Tensor, batch: PagedBatch, new_kv: torch.Tensor) -> None:
    """Write the computed tokens' K/V of every layer (`[L, n, 2, kv_heads, head_dim]`) into
    their pages (`batch.write_rows`)."""
    scatter_kv(kv, batch.write_rows.view(-1), new_kv)


def scatter_kv(kv: torch.Tensor, rows: torch.Tensor, new_kv: torch.Tensor) -> None:
    """One row copy for a whole batch: K/V `[L, n, 2, kv_heads, head_dim]` to the rows of
    `wide_rows(kv)` given flat (`[L * n * 2]`: each token's K and V row at each layer), bit
    for bit in any storage type."""
    wide_rows(kv).index_copy_(0, rows, wide_rows(new_kv))


def expand_write_rows(ids: torch.Tensor, num_layers: int, tpb: int,
                      write_step: torch.Tensor | None = None, out: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """`PagedBatch.write_rows` from its `ids` (first-layer K and V rows in `ids[:2]`): layer
    `l` adds `l` pages' rows, or nothing for a token written to a scratch page (`write_step`
    `[n, 1]`, 1 or 0). Into `out` when given (contiguous `[L, n, 2]`, as `write_kv` needs)."""
    _, layer_rows = _layer_range(num_layers, 2 * tpb, ids.device)
    if write_step is not None:
        layer_rows = layer_rows * write_step
    first = ids[:2].t()
    if out is None:
        out = torch.empty((num_layers, *first.shape), dtype=ids.dtype, device=ids.device)
    return torch.add(first, layer_rows, out=out)


_LAYER_RANGES: dict[tuple[torch.device, int, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _layer_range(num_layers: int, rows_per_page: int, device: torch.device
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """`[[0], [1], ..., [L-1]]` on the device as int32 (page offsets) and, times
    `rows_per_page`, int64 `[L, 1, 1]` (row offsets), made once (a copy per step would cost
    one)."""
    key = (device, num_layers, rows_per_page)
    t = _LAYER_RANGES.get(key)
    if t is None:
        r = torch.arange(num_layers, dtype=torch.int64)[:, None]
        t = _LAYER_RANGES[key] = (r.int().to(device), (r * rows_per_page)[:, :, None].to(device))
    return t


def gather_keys(kv: torch.Tensor, batch: PagedBatch, keys: KeyIndex, layers: slice,
                items: slice) -> torch.Tensor:
    """K/V `[layers, keys, 2, kv_heads, head_dim]` (storage type) of `keys` read through the
    batch's page tables, for a range of layers and items."""
    k0, k1 = int(keys.indptr[items.start]), int(keys.indptr[items.stop])
    # Through the pinned ring: a pageable copy would make the host wait for the GPU.
    entry, slot = to_device([keys.entry[k0:k1], keys.slot[k0:k1]], kv.device)
    # int64 for indexing (a batch's own pages are int32, FlashInfer's index type).
    pages = batch.pages_dev[layers][:, entry].long()
    g = pages.shape[0]
    # One row per (page, K or V, slot): a key's K or V of every head, copied whole by one
    # row gather (advanced indexing on bytes moves one byte per element).
    tpb = kv.shape[2]
    k_row = pages * (2 * tpb) + slot
    rows = torch.stack((k_row, k_row + tpb), -1)
    got = wide_rows(kv).index_select(0, rows.reshape(-1))
    return got.view(kv.dtype).view(g, k1 - k0, *kv.shape[1:2], *kv.shape[3:])


def wide_rows(x: torch.Tensor) -> torch.Tensor:
    """`x` `[..., heads, head_dim]` as rows of its last two dims, each row viewed as
    `widest_int` of its bytes."""
    row = x.shape[-2] * x.shape[-1]
    return x.reshape(-1, row).view(widest_int(row * x.element_size()))
