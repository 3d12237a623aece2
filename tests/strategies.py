"""Hypothesis strategies shared by the cache and oracle tests."""

from __future__ import annotations

from hypothesis import strategies as st


@st.composite
def related_prompts(draw, max_requests: int = 14, max_len: int = 14) -> list[list[int]]:
    """Prompts over a tiny vocabulary, most of them extending a prefix of an earlier one, so
    prefixes collide, diverge mid-block and repeat."""
    vocab = draw(st.integers(2, 4))
    n = draw(st.integers(1, max_requests))
    out: list[list[int]] = []
    for _ in range(n):
        if out and draw(st.integers(0, 3)):
            base = draw(st.sampled_from(out))
            keep = draw(st.integers(0, len(base)))
            tail = draw(st.lists(st.integers(0, vocab - 1), max_size=max(0, max_len - keep)))
            p = base[:keep] + tail
        else:
            p = draw(st.lists(st.integers(0, vocab - 1), min_size=1, max_size=max_len))
        out.append(p or [0])
    return out
