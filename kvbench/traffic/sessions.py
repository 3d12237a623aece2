"""When the requests of a trace without absolute times arrive: `requests.sessions`."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True, slots=True)
class SessionStart:
    """How sessions without absolute times start (`requests.sessions`)."""

    start: str = "back_to_back"
    interval_s: float | None = None
    rate: float | None = None
    turn_interval_s: float = 30.0


def session_starts(durations: list[float], sessions_cfg, seed: int) -> list[float]:
    """Start time of each session, in order: `back_to_back` (each when the previous one's last
    request arrives), `stagger` (every `interval_s`), `poisson` (exponential gaps at `rate`
    per second, seeded by run.seed)."""
    start = sessions_cfg.start
    n = len(durations)
    if start == "back_to_back":
        out, t = [], 0.0
        for d in durations:
            out.append(t)
            t += d
        return out
    if start == "stagger":
        return [i * sessions_cfg.interval_s for i in range(n)]
    gaps = np.random.default_rng(seed).exponential(1.0 / sessions_cfg.rate, size=n)
    gaps[:1] = 0.0
    return np.cumsum(gaps).tolist()


def single_request_arrivals(sessions_cfg, seed: int) -> Iterator[float]:
    """Arrivals of requests that each stand alone (no times in the trace), as `session_starts`
    for sessions of one request: `back_to_back` puts every one at 0, in file order."""
    start = sessions_cfg.start
    if start == "back_to_back":
        while True:
            yield 0.0
    if start == "stagger":
        i = 0
        while True:
            yield i * sessions_cfg.interval_s
            i += 1
    rng = np.random.default_rng(seed)
    t = 0.0
    yield t
    while True:
        for gap in rng.exponential(1.0 / sessions_cfg.rate, size=1024).tolist():
            t += gap
            yield t
