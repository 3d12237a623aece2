"""Speculative decoding in serve mode: how many draft tokens a decoder verifies, how many are
accepted, and what the draft model's work costs on the modeled clock.

Each decode step a decoder at position `p` (its tokens `[0, p)` hold KV) feeds the target its
last token and `k` draft tokens (fewer when its output ends sooner), so the step computes
`k + 1` tokens at positions `p .. p + k` and the sequence must hold blocks for them plus the
reserved extra tokens (`num_extra_kv_tokens + num_extra_decoding_steps`, as TensorRT-LLM's
resource manager adds after `add_sequence_batch`). Draft `i` is accepted with probability
`acceptance_rate` if drafts `1 .. i - 1` were, so `a` in `0..k` are accepted and the step yields
`a + 1` tokens (the accepted drafts and the target's own next token); KV of positions
`p .. p + a` is valid. Draws come from a generator seeded by the run's seed, per decoder in
arrival order each step, so a run repeats exactly.

With a draft model the clock also charges it: its prefill of the step's context chunks and
`k` one-token steps of every decoder that drafts (autoregressive drafting), on a step clock of
the draft's shape. Without one (MTP / Eagle-3 one-model) the drafts come from the target's
own forward pass and only the verification tokens cost.
"""

from __future__ import annotations

import numpy as np

from .clock import StepClock

_STREAM = 0x73706563  # the acceptance draws' own stream ("spec")


class Speculation:
    """Draft lengths, acceptance draws and draft-model cost of one serve run."""

    __slots__ = ("max_draft_len", "acceptance_rate", "reserved", "draft_clock", "_rng",
                 "draft_tokens", "accepted_tokens", "decode_steps", "produced_tokens")

    def __init__(self, max_draft_len: int, acceptance_rate: float, reserved: int, seed: int,
                 draft_clock: StepClock | None = None) -> None:
        self.max_draft_len = max_draft_len
        self.acceptance_rate = acceptance_rate
        self.reserved = reserved
        """Extra KV tokens held past the step's tokens."""
        self.draft_clock = draft_clock
        self._rng = np.random.default_rng([seed, _STREAM])
        self.draft_tokens = 0
        """Draft tokens verified, over the run."""
        self.accepted_tokens = 0
        self.decode_steps = 0
        """Decoder-steps (one per decoder per step)."""
        self.produced_tokens = 0
        """Tokens decode steps yielded (accepted drafts plus one per decoder-step)."""

    def drafts(self, remaining: int) -> int:
        """Draft tokens for a decoder with `remaining` output tokens still to produce."""
        return max(0, min(self.max_draft_len, remaining - 1))

    def accept(self, k: int) -> int:
        """Accepted drafts out of `k`: the leading run of successes."""
        self.decode_steps += 1
        self.draft_tokens += k
        a = 0
        if k:
            hits = self._rng.random(k) < self.acceptance_rate
            a = k if hits.all() else int(np.argmin(hits))
        self.accepted_tokens += a
        self.produced_tokens += a + 1
        return a

    def draft_seconds(self, ctx_tokens: int, ctx_pairs: int, ctx_kv: int,
                      decoders: list[tuple[int, int]]) -> float:
        """The draft model's time in a step: its prefill of the context chunks, then one
        step per draft position over the decoders `(position, drafts)` that draft that far."""
        clock = self.draft_clock
        if clock is None:
            return 0.0
        t = clock.step_seconds(ctx_tokens, ctx_pairs, ctx_kv) if ctx_tokens else 0.0
        depth = max((k for _, k in decoders), default=0)
        for i in range(depth):
            n = kv = 0
            for pos, k in decoders:
                if k > i:
                    n += 1
                    kv += pos + i + 1
            t += clock.step_seconds(n, kv, kv)
        return t

    def metrics(self) -> dict:
        steps = self.decode_steps
        return {
            "draft_tokens": self.draft_tokens,
            "accepted_draft_tokens": self.accepted_tokens,
            "draft_acceptance": (self.accepted_tokens / self.draft_tokens
                                 if self.draft_tokens else None),
            "tokens_per_decode_step": self.produced_tokens / steps if steps else None,
        }
