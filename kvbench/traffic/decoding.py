"""Per-request decoding options a workload adds to any request stream (synthetic or trace):
beam width. Drawn with their own seeded generator, so the prompts a stream holds do not
change when these options do."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvbench.traffic.request import Request

_STREAM = 0x6265616D  # separates this generator's stream from the traffic's own ("beam")


def apply_decoding(requests: Sequence[Request], requests_cfg, seed: int) -> None:
    """Set each request's `beam_width`: `requests_cfg.beam_widths` drawn uniformly per
    request, else `requests_cfg.beam_width` for all."""
    widths = requests_cfg.beam_widths
    if widths is None:
        for r in requests:
            r.beam_width = requests_cfg.beam_width
        return
    rng = np.random.default_rng([seed, _STREAM])
    picks = rng.integers(len(widths), size=len(requests))
    for r, i in zip(requests, picks.tolist()):
        r.beam_width = widths[i]
