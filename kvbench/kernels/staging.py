"""Host-to-device transfer of a step's small tables (page indices, table rows, plan tables).

On CUDA the tables go through a ring of pinned host buffers, allocated once and grown when a
step needs more: copying from pageable memory would make the host wait for the GPU to drain the
work queued before it, and pinning a fresh buffer per call (`Tensor.pin_memory`) costs more
than the copy. A slot is reused only after the event recorded behind its last copy completed:
the host runs a few steps ahead of the GPU, so with `RING_SLOTS` slots that wait is almost
always already over. On a CPU the arrays are wrapped, not copied.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

RING_SLOTS = 64
"""Pinned slots per device: more than the uploads in flight while the host runs two steps
ahead (about three per step, and five more per batch of a verified step)."""
MIN_SLOT_BYTES = 64 * 1024


class PinnedRing:
    """Pinned staging slots of one CUDA device, used round robin."""

    __slots__ = ("device", "_bufs", "_events", "_next")

    def __init__(self, device: torch.device, slots: int = RING_SLOTS) -> None:
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None] * slots
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._next = 0

    def stage(self, arrays: Sequence[np.ndarray], dtype: np.dtype) -> tuple[int, torch.Tensor,
                                                                              list[torch.Tensor]]:
        """Copy `arrays` (as `dtype`) into the next free slot: (slot, the flat pinned tensor,
        one pinned view per array, in its shape). Call `release(slot)` once every copy that
        reads the slot has been queued."""
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        ev = self._events[slot]
        if ev is not None:
            ev.synchronize()
            self._events[slot] = None
        dtype = np.dtype(dtype)
        total = sum(a.size for a in arrays)
        nbytes = max(1, total) * dtype.itemsize
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(MIN_SLOT_BYTES, 2 * nbytes), dtype=torch.uint8,
                              pin_memory=True)
            self._bufs[slot] = buf
        flat = buf[:total * dtype.itemsize].view(_TORCH[dtype])
        host = flat.numpy()
        views, o = [], 0
        for a in arrays:
            host[o:o + a.size] = a.reshape(-1)
            views.append(flat[o:o + a.size].view(a.shape))
            o += a.size
        return slot, flat, views

    def release(self, slot: int) -> None:
        """Mark the slot's copies queued: it is reused once the GPU got past them."""
        ev = self._events[slot] = torch.cuda.Event()
        ev.record()

    def upload(self, arrays: Sequence[np.ndarray], dtype: np.dtype = np.int64
               ) -> list[torch.Tensor]:
        """The arrays on the device, in one asynchronous host-to-device copy."""
        slot, flat, _ = self.stage(arrays, dtype)
        dev = flat.to(self.device, non_blocking=True)
        self.release(slot)
        out, o = [], 0
        for a in arrays:
            out.append(dev[o:o + a.size].view(a.shape))
            o += a.size
        return out


_TORCH = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32}
_RINGS: dict[torch.device, PinnedRing] = {}


def ring(device: torch.device) -> PinnedRing:
    """The device's staging ring (CUDA only)."""
    r = _RINGS.get(device)
    if r is None:
        r = _RINGS[device] = PinnedRing(device)
    return r


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays on `device`: on CUDA in one asynchronous copy through the pinned ring (so
    the host neither waits for the GPU nor pins memory), on a CPU wrapped as they are."""
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a, dtype=np.int64)) for a in arrays]
    return ring(device).upload(arrays)
