"""The counters of `WindowedCacheManager` over its pools: `KVCacheManager`'s counters summed,
the slots of all pools held at once (`peak_gpu_blocks`, `peak_gpu_bytes` weighing each pool's
slots by its size), the memory metrics with an entry per pool (`pool_name`, `pool_figures`),
and the `gpu` view a serve loop reads."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .lifecycle import LifeCycle
    from .manager import KVCacheManager


class WindowCounters:
    """The counter calls, mixed into `WindowedCacheManager`: they read its managers, life
    cycles, slot sizes and peaks."""

    __slots__ = ()

    @property
    def gpu(self) -> _Pools:
        return _Pools(self.managers, self.peak_gpu_blocks)
    @property
    def gpu_blocks_total(self) -> int:
        return sum(m.gpu.capacity for m in self.managers)

    @property
    def host_blocks_total(self) -> int:
        return sum(m.host.capacity if m.host is not None else 0 for m in self.managers)

    @property
    def gpu_bytes_total(self) -> int:
        return sum(m.gpu.capacity * b for m, b in zip(self.managers, self.slot_bytes))

    def total(self, counter: str) -> int:
        """A `KVCacheManager` counter (`evicted_blocks`, `onboard_blocks`, ...) summed over
        pools."""
        return sum(getattr(m, counter) for m in self.managers)

    # The counters under `KVCacheManager`'s names, summed over pools, so engine code reads
    # either manager alike.
    allocated_blocks = property(lambda self: self.total("allocated_blocks"))
    evicted_blocks = property(lambda self: self.total("evicted_blocks"))
    onboard_blocks = property(lambda self: self.total("onboard_blocks"))
    offload_blocks = property(lambda self: self.total("offload_blocks"))
    host_evicted_blocks = property(lambda self: self.total("host_evicted_blocks"))
    partial_copy_blocks = property(lambda self: self.total("partial_copy_blocks"))
    phase2_alloc_failures = property(lambda self: self.total("phase2_alloc_failures"))
    peak_host_blocks = property(lambda self: self.total("peak_host_blocks"))
    """Sum of each pool's peak (an upper bound on the host blocks held at once)."""

    def metrics(self) -> dict:
        """Memory metrics with several pools (`peak_gpu_blocks` counts slots of all pools,
        `peak_gpu_bytes` weighs them by size), scratch use, and per pool (`pools`)."""
        return {
            "gpu_blocks_total": self.gpu_blocks_total,
            "gpu_bytes_total": self.gpu_bytes_total,
            "host_blocks_total": self.host_blocks_total,
            "peak_gpu_blocks": self.peak_gpu_blocks,
            "peak_gpu_bytes": self.peak_gpu_bytes,
            "scratch_slots_peak": self.scratch_slots_peak,
            "scratch_blocks": self.scratch_blocks,
            "reuse_fallbacks": self.reuse_fallbacks,
            "pools": self.pool_metrics(),
        }

    def pool_metrics(self) -> dict[str, dict]:
        """Per pool (named `full` or `window_W`): its layers, slot size, blocks total and
        peak (the pool's own peak; their sum may exceed `peak_gpu_blocks`)."""
        return {pool_name(c): pool_figures(c, m, b)
                for c, m, b in zip(self.cycles, self.managers, self.slot_bytes)}
    def memory_metrics(self, slot_bytes: int) -> dict:  # noqa: ARG002 - each pool has its own
        return self.metrics()

    def moved_bytes(self, slot_bytes: int) -> tuple[int, int]:  # noqa: ARG002
        pools = list(zip(self.managers, self.slot_bytes))
        return (sum(m.onboard_blocks * b for m, b in pools),
                sum(m.offload_blocks * b for m, b in pools))
    def _note_peak(self) -> None:
        blocks = nbytes = 0
        for m, b in zip(self.managers, self.slot_bytes):
            n = m.gpu.num_in_use
            blocks += n
            nbytes += n * b
        if blocks > self.peak_gpu_blocks:
            self.peak_gpu_blocks = blocks
        if nbytes > self.peak_gpu_bytes:
            self.peak_gpu_bytes = nbytes


def pool_name(cycle: LifeCycle) -> str:
    """A pool's name in the `pools` metric: `full` or `window_W`."""
    return f"window_{cycle.window}" if cycle.window is not None else "full"


def pool_figures(cycle: LifeCycle, manager: KVCacheManager, slot_bytes: int) -> dict:
    """One pool's entry in the `pools` metric."""
    return {
        "layers": cycle.num_layers,
        "slot_bytes": slot_bytes,
        "gpu_blocks_total": manager.gpu.capacity,
        "peak_gpu_blocks": manager.gpu.peak_in_use,
        "host_blocks_total": manager.host.capacity if manager.host is not None else 0,
        "evicted_blocks": manager.evicted_blocks,
    }


class _Pools:
    """What a serve loop reads of `KVCacheManager.gpu`, over all pools: slots in use, cached
    and empty summed (timeline), and the run's peak of slots held at once (admission reads
    each pool: `WindowedCacheManager.free_per_pool`)."""

    __slots__ = ("managers", "peak_in_use")

    def __init__(self, managers: list[KVCacheManager], peak: int) -> None:
        self.managers = managers
        self.peak_in_use = peak

    @property
    def num_in_use(self) -> int:
        return sum(m.gpu.num_in_use for m in self.managers)

    @property
    def num_cached(self) -> int:
        return sum(m.gpu.num_cached for m in self.managers)

    @property
    def empty(self) -> range:
        """Sized as the pools' empty blocks together (only its length means anything)."""
        return range(sum(len(m.gpu.empty) for m in self.managers))
