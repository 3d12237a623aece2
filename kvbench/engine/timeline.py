"""Compact per-step (or per-request) records for plots, kept in fixed-size arrays."""

from __future__ import annotations

from array import array

MAX_POINTS = 2000
"""Timelines in results are thinned to at most this many points (plots need no more)."""


class Timeline:
    """Named integer columns appended once per step; `to_json` thins them evenly."""

    __slots__ = ("x_label", "columns")

    def __init__(self, x_label: str, names: tuple[str, ...]) -> None:
        self.x_label = x_label
        self.columns = {name: array("q") for name in names}

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def to_json(self, max_points: int = MAX_POINTS) -> dict:
        n = len(self)
        stride = max(1, -(-n // max_points))
        return {
            "x": self.x_label,
            "stride": stride,
            "columns": {name: col[::stride].tolist() for name, col in self.columns.items()},
        }
