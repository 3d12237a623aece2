"""A step's tables on their way to the device: the staging layout (int64 and int32 arrays in
one slot), the step's single upload, and the host tables a batch derives (table rows, the
per-layer plan tables), each against a plain recomputation. CPU only: the pinned ring's CUDA
side runs in the GPU check."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from kvbench.kernels import dataplane as dataplane_module  # noqa: E402
from kvbench.kernels.attention import PagedBatch  # noqa: E402
from kvbench.kernels.dataplane import DataPlane  # noqa: E402
from kvbench.kernels.model import TABLE_ROWS, table_rows  # noqa: E402
from kvbench.kernels.staging import Upload, _Layout  # noqa: E402
from kvbench.kernels.step import ModelShape, PoolSpec, StepItem  # noqa: E402

TPB = 4
SHAPE = ModelShape(num_layers=3, num_kv_heads=2, num_q_heads=4, head_dim=16,
                   tokens_per_block=TPB, dtype="bfloat16")
CPU = torch.device("cpu")


def test_layout_puts_mixed_int_arrays_in_one_buffer_and_views_them_back():
    """int64 and int32 arrays of any shape (empty ones too) share one buffer: each view has
    its array's dtype, shape and values, whatever the order they came in."""
    rng = np.random.default_rng(0)
    arrays = [rng.integers(-2**40, 2**40, 7), rng.integers(-9, 9, (2, 5)).astype(np.int32),
              np.zeros(0, np.int64), rng.integers(0, 99, 3).astype(np.int32),
              rng.integers(0, 99, (4, 3)), np.arange(1, dtype=np.int32)]
    layout = _Layout(arrays)
    assert layout.nbytes == 8 * (7 + 12) + 8 * -(-(10 + 3 + 1) * 4 // 8)
    host = np.full(layout.nbytes, 0xAB, np.uint8)
    layout.fill(host)
    views = layout.views(torch.from_numpy(host))
    for a, v in zip(arrays, views):
        assert v.dtype == {np.int64: torch.int64, np.int32: torch.int32}[a.dtype.type]
        assert v.shape == a.shape
        assert np.array_equal(v.numpy(), a)
    with pytest.raises(TypeError):
        _Layout([np.zeros(3, np.float32)])


def test_table_rows_equal_a_per_value_splitmix64():
    """The vectorised table rows (tokens and positions hashed in one pass) are the rows a
    scalar splitmix64 of each value gives."""
    mask = (1 << 64) - 1

    def mix(x: int, salt: int) -> int:
        z = (x + salt * 0x9E3779B97F4A7C15) & mask
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)

    toks = np.array([0, 1, -1, 2**40, -5 - (3 << 24), 123456789], np.int64)
    pos = np.array([0, 7, 3, 1 << 20, 64, 5], np.int64)
    got = table_rows(toks, pos)
    for i, (t, p) in enumerate(zip(toks.tolist(), pos.tolist())):
        want = []
        for k, (v, salt) in enumerate(((t, 0x5EED_0001), (p, 0x5EED_0002))):
            z = mix(v & mask, salt)
            want += [2 * k * TABLE_ROWS + z % TABLE_ROWS,
                     (2 * k + 1) * TABLE_ROWS + (z >> 32) % TABLE_ROWS]
        assert got[:, i].tolist() == want


def _items() -> list[StepItem]:
    rng = np.random.default_rng(1)
    a, b = rng.integers(0, 9999, 40), rng.integers(0, 9999, 40)
    return [StepItem(1, a, [3, 7, 1, 9], 13, 14, first_block=1),
            StepItem(2, b, [4, 5, 6], 5, 9)]


def test_layer_tables_repeat_the_batch_per_layer():
    """Entry `l * n + i` of the plan tables is item `i` at layer `l`: its query and page
    ranges shifted by `l` batches' worth, its last page and length as the item's."""
    pool = DataPlane(SHAPE, [PoolSpec((0, 1, 2), 16, window=6)], verify="off").pools[0]
    batch = PagedBatch(_items(), pool, TPB, CPU, decode=False)
    (qo, kv), (last, lens) = batch.layer_tables()
    n, L = 2, 3
    want_qo, want_kv, want_last, want_lens = [], [], [], []
    for layer in range(L):
        for i in range(n):
            want_qo.append(layer * batch.qo_indptr[-1] + batch.qo_indptr[i])
            want_kv.append(layer * batch.kv_indptr[-1] + batch.kv_indptr[i])
            want_last.append(batch.last_page_len[i])
            want_lens.append(batch.kv_len[i])
    assert qo.tolist() == want_qo + [L * batch.qo_indptr[-1]]
    assert kv.tolist() == want_kv + [L * batch.kv_indptr[-1]]
    assert last.tolist() == want_last and lens.tolist() == want_lens
    assert qo.dtype == kv.dtype == last.dtype == lens.dtype == np.int32


def test_a_batch_on_the_steps_upload_gets_the_tables_of_its_own():
    """A batch whose tables go up with the step's upload holds, once it is sent, the device
    tables a batch uploading alone holds (FlashInfer's int32 page indices included)."""
    pool = DataPlane(SHAPE, [PoolSpec((0, 1, 2), 16, window=6)], verify="off").pools[0]
    alone = PagedBatch(_items(), pool, TPB, CPU, decode=False)
    upload = Upload(CPU)
    shared = PagedBatch(_items(), pool, TPB, CPU, decode=False, upload=upload)
    upload.send()
    for name in ("pages_dev", "write_rows", "rows"):
        a, b = getattr(alone, name), getattr(shared, name)
        assert a.dtype == b.dtype and torch.equal(a, b), name
    assert alone.pages_dev.dtype == torch.int32 and alone.write_rows.dtype == torch.int64


def test_a_step_sends_one_upload_whatever_its_batches(monkeypatch):
    """Two pools, a context and a decode batch each, and an attention backend with host
    plan tables: the step's tables all go in one upload."""
    sent = []
    send = Upload.send

    def counted(self):
        sent.append(len(self._takers))
        send(self)

    monkeypatch.setattr(dataplane_module.Upload, "send", counted)
    dp = DataPlane(SHAPE, [PoolSpec((0, 2), 16), PoolSpec((1,), 16)], verify="all")
    planned = []

    class Tables(type(dp.backend)):
        def plan_tables(self, batch):
            return [np.arange(3, dtype=np.int32)]

        def plan(self, pool, batch, buffer=0, tables=None):
            planned.append(tables[0].tolist())

    dp.backend = Tables()
    toks = np.random.default_rng(2).integers(0, 999, 30)
    items = [StepItem(r, toks, [r, r + 4, r + 8], 0, 9, pool=p) for r in (0, 1) for p in (0, 1)]
    assert dp.execute_step([], items).verified is True
    step = [StepItem(r, toks, [r, r + 4, r + 8], 9, 10 + r, pool=p)
            for r in (0, 1) for p in (0, 1)]
    sent.clear()
    planned.clear()
    assert dp.execute_step([], step).verified is True
    assert sent == [4 + 4]  # four batches' tables, four plans' tables
    assert planned == [[0, 1, 2]] * 4
