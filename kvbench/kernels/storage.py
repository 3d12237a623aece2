"""Paged KV tensors: per pool, one GPU tensor and (with a host tier) one host tensor of pages.

A page is `[2, tokens_per_block, num_kv_heads, head_dim]` (K then V, FlashInfer's NHD paged
layout) and a slot (one block of the pool) is `len(layers)` consecutive pages, so one layer's
page table is plain page indices into one tensor, and a whole block moves as one contiguous run.
"""

from __future__ import annotations

import gc
from collections.abc import Sequence

import torch

from .step import ModelShape, PoolSpec

STORAGE_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "fp8": torch.float8_e4m3fn,
}



def widest_int(nbytes: int) -> torch.dtype:
    """The widest integer type `nbytes` divide into: raw copies, gathers and bit comparisons
    of storage bytes then move up to 8 bytes per element (a GPU moves one element per thread
    step, and some storage types, fp8, have no gather kernels of their own)."""
    return next(t for t in (torch.int64, torch.int32, torch.int16, torch.uint8)
                if nbytes % t.itemsize == 0)


QUERY_DTYPES = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    # FlashInfer takes fp8 K/V with 16-bit queries.
    "fp8": torch.bfloat16,
}


class PoolTensors:
    """The tensors of one pool. `gpu` lives on the compute device (CPU for the torch backend
    without CUDA); `host` is pinned CPU memory when the device is CUDA."""

    __slots__ = ("spec", "num_layers", "gpu", "host", "slot_bytes")

    def __init__(self, shape: ModelShape, spec: PoolSpec, device: torch.device) -> None:
        self.spec = spec
        self.num_layers = len(spec.layers)
        dtype = STORAGE_DTYPES[shape.dtype]
        page = (2, shape.tokens_per_block, shape.num_kv_heads, shape.head_dim)
        gpu_slots = spec.num_gpu_slots + spec.num_scratch_slots
        # Zero-filled so that a page nobody wrote reads as a mismatch, never as NaN noise.
        self.gpu = torch.zeros((gpu_slots * self.num_layers, *page), dtype=dtype, device=device)
        self.host = None
        if spec.num_host_slots:
            pin = device.type == "cuda"
            self.host = torch.zeros((spec.num_host_slots * self.num_layers, *page), dtype=dtype,
                                    pin_memory=pin)
        self.slot_bytes = self.num_layers * self.gpu[0].numel() * self.gpu.element_size()

    def slot_rows(self, on_host: bool) -> torch.Tensor:
        """The tier's tensor as raw bytes, one row per slot (copies move whole slots; raw
        bytes because CPU index_copy has no fp8 kernel)."""
        t = self.host if on_host else self.gpu
        if t is None:
            raise ValueError("this pool has no host tier")
        return t.view(torch.uint8).view(t.shape[0] // self.num_layers, -1)


def pool_bytes(shape: ModelShape, spec: PoolSpec) -> int:
    """GPU bytes of one pool's tensor (its slots and scratch slots, every layer)."""
    page = 2 * shape.tokens_per_block * shape.num_kv_heads * shape.head_dim
    size = STORAGE_DTYPES[shape.dtype].itemsize
    return (spec.num_gpu_slots + spec.num_scratch_slots) * len(spec.layers) * page * size


def make_pools(shape: ModelShape, specs: Sequence[PoolSpec], device: torch.device
               ) -> list[PoolTensors]:
    seen: set[int] = set()
    for spec in specs:
        if seen & set(spec.layers) or not all(0 <= l < shape.num_layers for l in spec.layers):
            raise ValueError("pools must cover distinct, existing layers")
        seen |= set(spec.layers)
    return [PoolTensors(shape, spec, device) for spec in specs]


def free_gpu_bytes() -> int:
    """What this process can still take on the current GPU: the device's free memory and what
    PyTorch's allocator holds unused, after a collection (an earlier run's tensors, which an
    object cycle may hold until the cyclic collector runs)."""
    gc.collect()
    free, _ = torch.cuda.mem_get_info()
    return free + torch.cuda.memory_reserved() - torch.cuda.memory_allocated()
