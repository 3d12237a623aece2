"""The engine-cache contract (`kvbench/cache/protocol.py`): both managers implement every
call of it, and nothing outside `cache/` tells them apart."""

import re
from pathlib import Path

import numpy as np

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.protocol import CacheManager, PageView
from kvbench.cache.lifecycle import life_cycles
from kvbench.cache.windows import WindowedCacheManager
from kvbench.traffic.request import Request

ROOT = Path(__file__).resolve().parents[1]


def _contract() -> set[str]:
    names = {n for n in vars(CacheManager) if not n.startswith("_")}
    return names | set(CacheManager.__annotations__)


def test_both_managers_implement_the_whole_contract():
    for cls in (KVCacheManager, WindowedCacheManager):
        missing = {n for n in _contract() if not hasattr(cls, n) and n not in cls.__slots__
                   and n not in ("tpb", "gpu")}
        assert not missing, (cls.__name__, missing)


def test_no_isinstance_on_managers_outside_cache():
    for path in (ROOT / "kvbench").rglob("*.py"):
        if "cache" in path.relative_to(ROOT / "kvbench").parts[:1]:
            continue
        text = path.read_text()
        assert not re.search(r"isinstance\([^)]*(CacheManager|Windowed)", text), path


def test_page_views_and_copy_ops_of_both_managers():
    spec = CacheSpec(4, 8, num_host_blocks=8, emit_copy_ops=True)
    plain = KVCacheManager(spec)
    request = Request(id=1, arrival_s=0.0, input_length=10, output_length=1,
                      tokens=np.arange(10, dtype=np.int64))
    seq = plain.add_sequence(request)
    assert plain.resize(seq, 10)
    assert plain.page_views(seq, 0, 10) == [PageView(0, 0, 0, 0, seq.blocks, None)]
    assert plain.drain_copy_ops() == {} and plain.moved_bytes(100) == (0, 0)
    assert plain.memory_metrics(100)["peak_gpu_bytes"] == 3 * 100
    windowed = WindowedCacheManager(life_cycles([None, 4]), [spec, spec])
    wseq = windowed.add_sequence(request)
    assert windowed.resize(wseq, 10)
    views = windowed.page_views(wseq, 0, 10)
    assert [v.pool for v in views] == [0, 1]
    assert windowed.drain_copy_ops() == {}
