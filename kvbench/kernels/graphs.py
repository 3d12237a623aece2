"""CUDA graphs of decode batches: a pool's decode batch of `n` sequences runs its untimed
preparation (the synthetic model's Q/K/V of every layer, the write rows) and its K/V write as
two graphs captured once per (pool, n) and replayed every step after.

Why: at a real model shape a decode step's GPU work is small and the host's is mostly
launches. On an H200's host each eager torch call cost 8-25 us to launch and each view about
3 us: a decode step's Q/K/V took eight launches and some twenty views (175 us of host time a
step), its K/V write 43 us, in a step of about 1 ms. A replay is one launch, as engines replay
their captured decode batches.

A graph reads and writes fixed memory. Each pool has one input buffer (a batch's `ids`: K/V
rows at the first layer, table rows), copied in before the replay, and one output buffer per
result (K/V, Q, write rows); the graph of size `n` uses views of their first elements, so one
set serves every size up to its capacity. A larger batch gets buffers of twice the size (the
graphs captured before keep theirs). Outputs are overwritten by the pool's next replay, a
step later on the same stream, after everything the step queued (writes, attention, checks)
read them. Temporaries come from one graph memory pool that every graph shares: graphs
replay one at a time, on the compute stream, and their temporaries are dead between replays.

Only decode batches without scratch pages go through graphs (a prefill chunk's size varies
with every step, and scratch batches run layer by layer), and only up to `MAX_GRAPH_BATCH`.
"""

from __future__ import annotations

import time

import torch

from .attention import PagedBatch, expand_write_rows, scatter_kv
from .model import MAX_TEMP_BYTES, SyntheticModel
from .step import ModelShape
from .storage import PoolTensors

MAX_GRAPH_BATCH = 128
"""Largest decode batch replayed as a graph. A graph's temporaries (the float32 Q/K/V of every
layer, 12 bytes per layer, token and column: 300 MB at 128 sequences of a Llama-3-8B shape)
stay reserved in its memory pool; larger batches amortise their launches anyway."""
MIN_CAPACITY = 16
"""Sequences the first buffers of a pool hold; they double when a batch outgrows them."""


def graph_bytes(shape: ModelShape, layers: int, max_batch: int) -> int:
    """GPU memory the decode graphs of a pool of `layers` layers may hold, batches of up to
    `max_batch` sequences: their shared temporaries (`SyntheticModel.qkv_all`'s float32 work
    for one layer group, the group capped by `MAX_TEMP_BYTES`) and the output buffers (up to
    twice the largest batch's, and the smaller ones that earlier graphs keep), for K/V and Q
    of at most two bytes (FlashInfer's types)."""
    n = min(max_batch, MAX_GRAPH_BATCH)
    width = (2 * shape.num_kv_heads + shape.num_q_heads) * shape.head_dim
    per_layer = 8 * n * width
    group = max(1, min(layers, MAX_TEMP_BYTES // per_layer))
    temporaries = group * per_layer * 3 // 2
    outputs = layers * max(n, MIN_CAPACITY) * (2 * width + 16)
    return temporaries + 4 * outputs


class DecodeGraphs:
    """The captured decode graphs of one data plane (CUDA only)."""

    __slots__ = ("model", "kv_dtype", "q_dtype", "device", "capture_s", "_mempool", "_stream",
                 "_pools")

    def __init__(self, model: SyntheticModel, kv_dtype: torch.dtype, q_dtype: torch.dtype,
                 device: torch.device) -> None:
        self.model = model
        self.kv_dtype = kv_dtype
        self.q_dtype = q_dtype
        self.device = device
        self.capture_s = 0.0
        """Host seconds spent capturing (once per pool and size, like a JIT compile)."""
        self._mempool = torch.cuda.graph_pool_handle()
        self._stream = torch.cuda.Stream(device)
        """Capture needs a stream other than the default one."""
        self._pools: dict[int, _PoolGraphs] = {}

    @staticmethod
    def takes(batch: PagedBatch) -> bool:
        """Whether the batch replays graphs: decode, no scratch pages, not too large."""
        return batch.decode and not batch.has_scratch and len(batch.items) <= MAX_GRAPH_BATCH

    def prepare(self, index: int, tensors: PoolTensors, batch: PagedBatch):
        """Replay the batch's preparation (`takes(batch)` must hold): returns (K/V, Q) as
        `SyntheticModel.qkv_all` gives them, bit for bit, and the write, a call that replays
        the batch's K/V write into `tensors.gpu`. The batch's `ids` must be on the device."""
        pool = self._pools.get(index)
        if pool is None:
            pool = self._pools[index] = _PoolGraphs(tensors)
        n = len(batch.items)
        graph = pool.graphs.get(n)
        if graph is None:
            t = time.perf_counter()
            graph = pool.capture(self, n)
            self.capture_s += time.perf_counter() - t
        graph.ids.copy_(batch.ids)
        graph.prepare.replay()
        return graph.kv, graph.q, graph.write.replay


class _Graph:
    """One size's graphs and the views of its pool's buffers they read and write."""

    __slots__ = ("ids", "kv", "q", "write_rows", "prepare", "write")


class _PoolGraphs:
    """A pool's buffers and its graphs by batch size. Every graph stays alive as long as the
    plane: a graph memory pool shared by graphs must not lose all of them and be captured
    into again (PyTorch's allocator asserts)."""

    __slots__ = ("tensors", "layers", "capacity", "graphs", "_ids", "_kv", "_q", "_write_rows")

    def __init__(self, tensors: PoolTensors) -> None:
        self.tensors = tensors
        self.layers = tensors.spec.layers
        self.capacity = 0
        self.graphs: dict[int, _Graph] = {}

    def _grow(self, o: DecodeGraphs, n: int) -> None:
        """New buffers for at least `n` sequences (the old ones stay with their graphs)."""
        s = o.model.shape
        self.capacity = cap = max(n, 2 * self.capacity, MIN_CAPACITY)
        L, dev = len(self.layers), o.device
        self._ids = torch.empty(6 * cap, dtype=torch.int64, device=dev)
        self._kv = torch.empty(L * cap * 2 * s.num_kv_heads * s.head_dim, dtype=o.kv_dtype,
                               device=dev)
        self._q = torch.empty(L * cap * s.num_q_heads * s.head_dim, dtype=o.q_dtype,
                              device=dev)
        self._write_rows = torch.empty(L * cap * 2, dtype=torch.int64, device=dev)

    def capture(self, o: DecodeGraphs, n: int) -> _Graph:
        g = self.views(o, n)
        g.prepare, g.write = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
        compute = torch.cuda.current_stream(o.device)
        side = o._stream
        # The buffers may still be read by work queued on the compute stream (the last
        # step's attention over the last size's outputs).
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            g.ids.zero_()
            # Run once before capturing: kernels load, and the model caches this layer
            # list's gains (an upload, which a graph must not capture).
            self.run_prepare(o, g)
            scatter_kv(torch.empty_like(g.kv[:1, :1]),
                       g.write_rows.new_zeros(g.write_rows.numel()), g.kv)
            g.prepare.capture_begin(pool=o._mempool)
            try:
                self.run_prepare(o, g)
            finally:
                g.prepare.capture_end()
            # Captured, never run eagerly: run now, it would scatter stale rows into the pool.
            g.write.capture_begin(pool=o._mempool)
            try:
                scatter_kv(self.tensors.gpu, g.write_rows.view(-1), g.kv)
            finally:
                g.write.capture_end()
        compute.wait_stream(side)
        self.graphs[n] = g
        return g

    def views(self, o: DecodeGraphs, n: int) -> _Graph:
        """The views of size `n` of the buffers (grown to hold it), graphs not captured."""
        if n > self.capacity:
            self._grow(o, n)
        s = o.model.shape
        L = len(self.layers)
        g = _Graph()
        g.ids = self._ids[:6 * n].view(6, n)
        g.kv = self._kv[:L * n * 2 * s.num_kv_heads * s.head_dim].view(
            L, n, 2, s.num_kv_heads, s.head_dim)
        g.q = self._q[:L * n * s.num_q_heads * s.head_dim].view(L, n, s.num_q_heads,
                                                                 s.head_dim)
        g.write_rows = self._write_rows[:L * n * 2].view(L, n, 2)
        return g

    def run_prepare(self, o: DecodeGraphs, g: _Graph) -> None:
        """What the preparation graph does: Q/K/V and write rows from `g.ids`, into `g`."""
        o.model.qkv_all(g.ids[2:], self.layers, o.kv_dtype, o.q_dtype, out=(g.kv, g.q))
        expand_write_rows(g.ids, len(self.layers), o.model.shape.tokens_per_block,
                          out=g.write_rows)
