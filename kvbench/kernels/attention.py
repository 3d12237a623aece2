"""Paged batches and the torch reference attention backend.

A `PagedBatch` is one pool's context items (or decode items) of a step, flattened into
FlashInfer's CSR page tables: `kv_indptr` over pages, page indices, `last_page_len`, and
`qo_indptr` over the queries. Page indices are those of the pool's first layer (`slot * L`);
layer `l` adds `l`, except for scratch pages, which are the same in every layer. Every layer
of the pool runs in one call: `layer_tables` repeats the tables once per layer (entry
`l * n + i` is item `i` at layer `l`), so one plan and one kernel launch cover the step's
attention, and one scatter writes the K/V of every layer (`write_kv`).

The reference attention (`attend_segments`) runs all layers of a tile of items at once, in
float32, one run of an item's queries at a time over that item's keys alone (float32 copies
of the tile's Q/K/V sized to a memory budget, read in place); the torch backend and the
verifier share it, so the torch backend's output equals the reference bit for bit whenever
both read the same keys. For decode batches the verifier uses `attend_casts`, the same
products from the synthetic model's four casts per K/V column (the layers on the query side),
once the pages are proven to hold the model's K/V.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from itertools import chain

import numpy as np
import torch

from .model import table_rows
from .staging import Upload, to_device
from .step import StepItem
from .storage import PoolTensors, widest_int

QUERY_CHUNK = 256
"""Most queries of one item in one score block of `attend_segments`."""
TILE_BYTES = 256 * 1024 * 1024
"""Float32 bytes of one reference tile on a CPU: the K and V of its layers and items, and
the scores of one run of queries."""
TILE_BYTES_CUDA = 2 * 1024 * 1024 * 1024
"""The same on a GPU, where fewer, larger tiles save launches and host work."""


def tile_bytes(device: torch.device) -> int:
    return TILE_BYTES_CUDA if device.type == "cuda" else TILE_BYTES


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
        "pages_dev", "write_page", "write_slot", "rows",
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
        scratch pages, their steps (1 or 0); the write pages (int64, for indexing) likewise
        from each token's first-layer page."""
        pages, tok_page = self.pages, self.tok_page
        arrays = [pages.astype(np.int32), pages[tok_page], self.tok_rel % self.tpb,
                  table_rows(self.new_tokens, self.new_positions)]
        if self.has_scratch:
            step = (~self.scratch_mask).astype(np.int32)
            arrays += [step, step[tok_page].astype(np.int64)]
        return arrays

    def _on_device(self, tables: list[torch.Tensor]) -> None:
        """The batch's device tables, from its uploaded arrays (see `__init__`)."""
        pages, write_page, self.write_slot, self.rows = tables[:4]
        layers32, layers64 = _layer_range(self.num_layers, self.device)
        if self.has_scratch:
            step, write_step = tables[4:]
            self.pages_dev = pages + layers32 * step
            self.write_page = write_page + layers64 * write_step
        else:
            self.pages_dev = pages + layers32
            self.write_page = write_page + layers64

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
        part.write_page = self.write_page[layer:layer + 1]
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
        self.tok_rel = self.tok_page = self.write_page = self.write_slot = None
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
    their pages: one scatter for the whole batch (pages `[L, n]`, slots `[n]` broadcast)."""
    # Raw bytes: any storage type (CPU indexing has no fp8 kernels), bit for bit.
    kv.view(torch.uint8)[batch.write_page, :, batch.write_slot] = new_kv.view(torch.uint8)


_LAYER_RANGES: dict[tuple[torch.device, int], tuple[torch.Tensor, torch.Tensor]] = {}


def _layer_range(num_layers: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """`[[0], [1], ..., [L-1]]` on the device as int32 and int64, made once (a copy per step
    would cost one)."""
    key = (device, num_layers)
    t = _LAYER_RANGES.get(key)
    if t is None:
        r = torch.arange(num_layers, dtype=torch.int64)[:, None]
        t = _LAYER_RANGES[key] = (r.int().to(device), r.to(device))
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
        a, b = a - q_base, b - q_base
        k0, k1 = int(keys.indptr[i]) - k_base, int(keys.indptr[i + 1]) - k_base
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
