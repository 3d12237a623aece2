"""Host-to-device transfer of a step's small tables (page indices, table rows, plan tables).

On CUDA the tables go through a ring of pinned host buffers, allocated once and grown when a
step needs more: copying from pageable memory would make the host wait for the GPU to drain the
work queued before it, and pinning a fresh buffer per call (`Tensor.pin_memory`) costs more
than the copy. A slot is reused only after the event recorded behind its last copy completed:
the host runs a few steps ahead of the GPU, so with `RING_SLOTS` slots that wait is almost
always already over. On a CPU the arrays are wrapped, not copied.

A data-plane step gathers all its tables (every batch's page tables and table rows, the
attention plans' host tables) in one `Upload`: one slot, one copy, one event per step, however
many batches it has. Arrays are int64 or int32 (FlashInfer's page indices and plan tables);
a slot holds the int64 ones first, then the int32 ones, each group one run that `split` cuts
into per-array views (one call, not one slice per array).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import torch

RING_SLOTS = 64
"""Pinned slots per device: more than the uploads in flight while the host runs two steps
ahead (one per step, and five more per batch of a verified step)."""
MIN_SLOT_BYTES = 64 * 1024
RESERVED_SLOT_BYTES = 256 * 1024
"""What `PinnedRing.reserve` pins per slot when a data plane opens (16 MiB in all): a decode
step's tables many times over; a long prefill chunk's or a verified step's may still grow a
slot."""
_GROUPS = ((np.dtype(np.int64), torch.int64), (np.dtype(np.int32), torch.int32))
"""The dtypes a slot holds, widest first (every group starts 8-byte aligned)."""


class _Layout:
    """Where each of a list of arrays sits in a slot: its group's byte range and the sizes
    `split` cuts the group into, in the arrays' order within their dtype."""

    __slots__ = ("groups", "nbytes", "order", "shapes")

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.groups: list[tuple[int, int, torch.dtype, list[int], list[np.ndarray]]] = []
        self.order: list[int] = []
        self.shapes = [a.shape for a in arrays]
        o = 0
        for np_dtype, torch_dtype in _GROUPS:
            members = [i for i, a in enumerate(arrays) if a.dtype == np_dtype]
            if not members:
                continue
            sizes = [arrays[i].size for i in members]
            n = sum(sizes)
            self.groups.append((o, n, torch_dtype, sizes, [arrays[i] for i in members]))
            self.order += members
            o += -(-n * np_dtype.itemsize // 8) * 8
        if len(self.order) != len(arrays):
            raise TypeError("staged arrays are int64 or int32")
        self.nbytes = o

    def fill(self, host: np.ndarray) -> None:
        """Copy the arrays into `host` (a uint8 view of the slot): one pass per group."""
        for o, n, torch_dtype, _, members in self.groups:
            out = host[o:o + n * _ITEMSIZE[torch_dtype]].view(_NUMPY[torch_dtype])
            if len(members) == 1:
                out[:] = members[0].reshape(-1)
            elif n:
                np.concatenate([a.reshape(-1) for a in members], out=out)

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """One view per array (its dtype and shape) of `flat`, a uint8 tensor laid out by
        `fill`, in the arrays' order."""
        out: list[torch.Tensor | None] = [None] * len(self.order)
        k = 0
        for o, n, torch_dtype, sizes, _ in self.groups:
            group = flat[o:o + n * _ITEMSIZE[torch_dtype]].view(torch_dtype)
            parts = group.split_with_sizes(sizes) if len(sizes) > 1 else (group,)
            for part in parts:
                i = self.order[k]
                shape = self.shapes[i]
                out[i] = part if len(shape) == 1 else part.view(shape)
                k += 1
        return out


_ITEMSIZE = {torch.int64: 8, torch.int32: 4}
_NUMPY = {torch.int64: np.int64, torch.int32: np.int32}


class PinnedRing:
    """Pinned staging slots of one CUDA device, used round robin."""

    __slots__ = ("device", "_bufs", "_events", "_pending", "_next")

    def __init__(self, device: torch.device, slots: int = RING_SLOTS) -> None:
        self.device = device
        self._bufs: list[torch.Tensor | None] = [None] * slots
        # One event per slot, made once and recorded again at each release.
        self._events: list[torch.cuda.Event | None] = [None] * slots
        self._pending = [False] * slots
        self._next = 0

    def reserve(self, nbytes: int = RESERVED_SLOT_BYTES) -> None:
        """Pin every slot not pinned yet (`nbytes`) and make its event, before anything is
        timed: pinning costs far more than the copies a slot serves, and a ring filled
        lazily would pay it in a run's first `RING_SLOTS` steps."""
        for slot, buf in enumerate(self._bufs):
            if buf is None:
                self._bufs[slot] = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
            if self._events[slot] is None:
                self._events[slot] = torch.cuda.Event()

    def stage(self, arrays: Sequence[np.ndarray]) -> tuple[int, torch.Tensor, _Layout]:
        """Copy `arrays` (int64 or int32) into the next free slot: (slot, the slot's uint8
        tensor up to the arrays' end, their layout; `layout.views(flat)` gives pinned views).
        Call `release(slot)` once every copy that reads the slot has been queued."""
        slot = self._next
        self._next = (slot + 1) % len(self._bufs)
        if self._pending[slot]:
            self._events[slot].synchronize()
            self._pending[slot] = False
        layout = _Layout(arrays)
        nbytes = max(8, layout.nbytes)
        buf = self._bufs[slot]
        if buf is None or buf.numel() < nbytes:
            buf = torch.empty(max(MIN_SLOT_BYTES, 2 * nbytes), dtype=torch.uint8,
                              pin_memory=True)
            self._bufs[slot] = buf
        flat = buf[:nbytes]
        layout.fill(flat.numpy())
        return slot, flat, layout

    def release(self, slot: int, stream: torch.cuda.Stream | None = None) -> None:
        """Mark the slot's copies queued (on `stream`, default the current one): it is reused
        once the GPU got past them."""
        ev = self._events[slot]
        if ev is None:
            ev = self._events[slot] = torch.cuda.Event()
        if stream is None:
            ev.record()
        else:
            ev.record(stream)
        self._pending[slot] = True

    def upload(self, arrays: Sequence[np.ndarray]) -> list[torch.Tensor]:
        """The arrays on the device, in one asynchronous host-to-device copy."""
        slot, flat, layout = self.stage(arrays)
        dev = flat.to(self.device, non_blocking=True)
        self.release(slot)
        return layout.views(dev)


_RINGS: dict[torch.device, PinnedRing] = {}


def ring(device: torch.device) -> PinnedRing:
    """The device's staging ring (CUDA only), one per GPU however it is named (`cuda` and a
    tensor's `cuda:0` are one device)."""
    r = _RINGS.get(device)
    if r is None:
        key = device if device.index is not None else torch.device(
            device.type, torch.cuda.current_device())
        r = _RINGS.get(key)
        if r is None:
            r = _RINGS[key] = PinnedRing(key)
        _RINGS[device] = r
    return r


def to_device(arrays: Sequence[np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """int64 arrays on `device`: on CUDA in one asynchronous copy through the pinned ring (so
    the host neither waits for the GPU nor pins memory), on a CPU wrapped as they are."""
    arrays = [np.asarray(a, dtype=np.int64) for a in arrays]
    if device.type != "cuda":
        return [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
    return ring(device).upload(arrays)


Taker = Callable[[list[torch.Tensor]], None]


class Upload:
    """A step's tables, gathered from every batch (`add`) and sent in one copy (`send`):
    each taker then gets its arrays' device tensors, or with `host=True` pinned host tensors
    of the same slot (what FlashInfer's planner reads on the host and copies itself). On a
    CPU both are the arrays, wrapped. `release` once every copy reading the slot is queued.
    Arrays are int64 or int32."""

    __slots__ = ("device", "_arrays", "_takers", "_slot")

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._arrays: list[np.ndarray] = []
        self._takers: list[tuple[int, int, bool, Taker]] = []
        self._slot: int | None = None

    def add(self, arrays: Sequence[np.ndarray], taker: Taker, host: bool = False) -> None:
        start = len(self._arrays)
        self._arrays += arrays
        self._takers.append((start, len(self._arrays), host, taker))

    def send(self) -> None:
        if not self._takers:
            return
        arrays = self._arrays
        if self.device.type != "cuda":
            dev = host = [torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        else:
            r = ring(self.device)
            self._slot, flat, layout = r.stage(arrays)
            dev = layout.views(flat.to(self.device, non_blocking=True))
            host = (layout.views(flat) if any(h for _, _, h, _ in self._takers) else None)
        for a, b, on_host, taker in self._takers:
            taker((host if on_host else dev)[a:b])
        self._arrays, self._takers = [], []

    def release(self, stream: torch.cuda.Stream | None = None) -> None:
        if self._slot is not None:
            ring(self.device).release(self._slot, stream)
            self._slot = None
