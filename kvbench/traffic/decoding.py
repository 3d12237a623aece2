"""Per-request decoding options a workload adds to any request stream (synthetic or trace):
beam width and encoder input. Drawn with their own seeded generators, so the prompts a stream
holds do not change when these options do."""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import numpy as np

from kvbench.traffic.request import Request

_BEAMS = 0x6265616D  # separates these generators' streams from the traffic's own ("beam")
_ENCODER = 0x656E63  # ("enc")


def apply_decoding(requests: Sequence[Request], requests_cfg, seed: int) -> None:
    """Set each request's `beam_width` (`requests_cfg.beam_widths` drawn uniformly per
    request, else `requests_cfg.beam_width`) and, with `requests_cfg.encoder.tokens`, its
    `encoder`: one of `distinct_inputs` inputs, for a `fraction` of the requests."""
    widths = requests_cfg.beam_widths
    if widths is None:
        for r in requests:
            r.beam_width = requests_cfg.beam_width
    else:
        picks = np.random.default_rng([seed, _BEAMS]).integers(len(widths), size=len(requests))
        for r, i in zip(requests, picks.tolist()):
            r.beam_width = widths[i]
    enc = requests_cfg.encoder
    if enc.tokens:
        rng = np.random.default_rng([seed, _ENCODER])
        lo = max(1, round(enc.tokens * (1 - enc.tokens_spread)))
        hi = max(lo, round(enc.tokens * (1 + enc.tokens_spread)))
        vocab = requests_cfg.synthetic.vocab_size
        inputs = [encoder_input(i, rng.integers(0, vocab, int(rng.integers(lo, hi + 1))))
                  for i in range(enc.distinct_inputs)]
        has = rng.random(len(requests)) < enc.fraction
        picks = rng.integers(len(inputs), size=len(requests))
        for r, h, i in zip(requests, has.tolist(), picks.tolist()):
            r.encoder = inputs[i] if h else None


def encoder_input(i: int, tokens: np.ndarray) -> Request:
    """An encoder input as a prompt of the cross-attention cache. Its namespace is a digest
    of all its tokens: an encoder attends both ways, so a block's cross KV depends on the
    whole input, and only an identical input may reuse it."""
    tokens = np.asarray(tokens, dtype=np.int64)
    digest = hashlib.blake2b(tokens.tobytes(), digest_size=8).hexdigest()
    return Request(i, 0.0, len(tokens), 0, tokens=tokens, namespace=f"encoder:{digest}")
