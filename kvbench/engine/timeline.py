"""Compact per-step (or per-request) records for plots, kept in fixed-size arrays."""

from __future__ import annotations

from array import array

import numpy as np

MAX_POINTS = 2000
"""Timelines in results are thinned to at most this many points (plots need no more)."""


class Timeline:
    """Named integer columns appended once per step; `to_json` thins them evenly.

    Thinning keeps every `stride`-th row of a level (blocks in use, batch size) but sums an
    amount (`sums`: tokens reused, prompt tokens) over the rows it stands for, so ratios of
    amounts (a rolling hit rate) stay exact however far the timeline is thinned."""

    __slots__ = ("x_label", "columns", "sums")

    def __init__(self, x_label: str, names: tuple[str, ...], sums: tuple[str, ...] = ()) -> None:
        self.x_label = x_label
        self.columns = {name: array("q") for name in names}
        self.sums = frozenset(sums)

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def to_json(self, max_points: int = MAX_POINTS) -> dict:
        n = len(self)
        stride = max(1, -(-n // max_points))
        starts = np.arange(0, n, stride)
        columns = {}
        for name, col in self.columns.items():
            if name in self.sums and n:
                columns[name] = np.add.reduceat(np.frombuffer(col, dtype=np.int64),
                                                starts).tolist()
            else:
                columns[name] = col[::stride].tolist()
        return {"x": self.x_label, "stride": stride, "columns": columns}
