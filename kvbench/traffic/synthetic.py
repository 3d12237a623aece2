"""Seeded synthetic traffic with known prefix structure.

Generators (`cfg.generator`):
- `shared_prefix`: every request is one shared system prompt (`system_prompt_tokens`), then the
  profile of one of `num_users` users (`profile_tokens`, fixed per user; `prompt_tokens` when
  unset), then a fresh question (`prompt_tokens` on average: the new tokens of the request).
- `multi_turn`: `num_users` concurrent chat sessions of `turns` turns. Turn 1 is the system prompt
  plus a user message; turn k+1 is turn k's prompt, turn k's answer and a new user message, so
  each turn reuses everything its session has seen. Each request carries its answer as
  `output_tokens`. Which active session speaks next is drawn at random, so sessions interleave
  and the reuse distance between turns varies; when `num_users * turns < num_requests`, each
  finished session makes room for a new one.

Question, user-message and answer lengths are uniform in `mean * (1 ± prompt_tokens_spread)`
(at least 1), with mean `prompt_tokens` for user text and `output_tokens` for answers.

Arrivals (`cfg.arrival`): `poisson` at `rate` requests/s overall, assigned in generation order
(so a session's turn never arrives before its previous turn), or `burst` (all at t = 0).
"""

from __future__ import annotations

import numpy as np

from kvbench.traffic.request import Request


def generate(cfg, seed: int) -> list[Request]:
    """The request stream of a synthetic config (a `SyntheticConfig` or anything with its
    attributes); ids 0..n-1 in arrival order. The same seed always gives the same stream."""
    rng = np.random.default_rng(seed)
    if cfg.generator == "shared_prefix":
        prompts = _shared_prefix(cfg, rng)
    elif cfg.generator == "multi_turn":
        prompts = _multi_turn(cfg, rng)
    else:
        raise ValueError(f"unknown synthetic generator {cfg.generator!r}")
    arrivals = _arrivals(cfg, rng, len(prompts))
    return [
        Request(
            id=i,
            arrival_s=float(t),
            input_length=len(tokens),
            output_length=output_length,
            tokens=tokens,
            output_tokens=answer,
        )
        for i, (t, (tokens, output_length, answer)) in enumerate(zip(arrivals, prompts))
    ]


_Prompt = tuple[np.ndarray, int, "np.ndarray | None"]


def _shared_prefix(cfg, rng: np.random.Generator) -> list[_Prompt]:
    system = _tokens(rng, cfg, cfg.system_prompt_tokens)
    profile = getattr(cfg, "profile_tokens", None)
    profile = cfg.prompt_tokens if profile is None else profile
    profiles = [
        np.concatenate([system, _tokens(rng, cfg, profile)])
        for _ in range(cfg.num_users)
    ]
    prompts = []
    for _ in range(cfg.num_requests):
        user = int(rng.integers(cfg.num_users))
        question = _tokens(rng, cfg, _length(rng, cfg.prompt_tokens, cfg))
        prompts.append(
            (np.concatenate([profiles[user], question]), _length(rng, cfg.output_tokens, cfg), None)
        )
    return prompts


def _multi_turn(cfg, rng: np.random.Generator) -> list[_Prompt]:
    system = _tokens(rng, cfg, cfg.system_prompt_tokens)
    sessions_needed = max(cfg.num_users, -(-cfg.num_requests // cfg.turns))
    # Each active session: [context so far, turns taken].
    active = [[system, 0] for _ in range(cfg.num_users)]
    started = len(active)
    prompts = []
    for _ in range(cfg.num_requests):
        i = int(rng.integers(len(active)))
        session = active[i]
        message = _tokens(rng, cfg, _length(rng, cfg.prompt_tokens, cfg))
        prompt = np.concatenate([session[0], message])
        answer = _tokens(rng, cfg, _length(rng, cfg.output_tokens, cfg))
        prompts.append((prompt, len(answer), answer))
        session[0] = np.concatenate([prompt, answer])
        session[1] += 1
        if session[1] == cfg.turns:
            if started < sessions_needed:
                active[i] = [system, 0]
                started += 1
            else:
                active.pop(i)
    return prompts


def _arrivals(cfg, rng: np.random.Generator, n: int) -> np.ndarray:
    if cfg.arrival == "burst":
        return np.zeros(n)
    if cfg.arrival == "poisson":
        if not cfg.rate > 0:
            raise ValueError(f"poisson arrivals need rate > 0, got {cfg.rate}")
        return np.cumsum(rng.exponential(1.0 / cfg.rate, n))
    raise ValueError(f"unknown arrival process {cfg.arrival!r}")


def _length(rng: np.random.Generator, mean: int, cfg) -> int:
    spread = cfg.prompt_tokens_spread
    lo = max(1, round(mean * (1 - spread)))
    hi = max(lo, round(mean * (1 + spread)))
    return int(rng.integers(lo, hi + 1))


def _tokens(rng: np.random.Generator, cfg, n: int) -> np.ndarray:
    return rng.integers(0, cfg.vocab_size, n, dtype=np.int64)
