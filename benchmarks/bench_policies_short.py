"""Eviction policies on short traces: each policy's hit rate against LRU's where the duel that
chooses its order has little to go on (issue 15's 0.5 pp bar).

Usage: python benchmarks/bench_policies_short.py [--policies slru,s3fifo,...] [--seeds 1,2]

Replays the built-in generator's traffic in cache mode through `kvbench run`'s path (so each
result carries its own `lru_hit_rate`): both generators, 120 requests of 12 users, 400 of 40
and 1000 of 20 (each user's turns one after another: requests / users turns; 96-token
messages after a 256-token system prompt), at tokens_per_block 16 with 4K, 16K and 64K
tokens of cache and at 32 with 32K, for each seed. The shortest traces are a few tens of pool
sizes of releases. Prints per cell LRU's hit rate and each policy's difference in points,
then per policy the worst cell, the mean and how many cells are more than 0.5 pp below LRU.
Cells whose largest request does not fit the cache are skipped.
"""

from __future__ import annotations

import argparse
import itertools
import tempfile
from pathlib import Path

from kvbench.cache.policies import POLICY_NAMES
from kvbench.config import load_workload
from kvbench.errors import InputError
from kvbench.modes.common import References
from kvbench.runner import run_workload

SIZES = ((120, 12), (400, 40), (1000, 20))
"""(requests, users)."""
CACHES = ((16, 4096), (16, 16384), (32, 32768), (16, 65536))
"""(tokens_per_block, cache tokens)."""
BAR = 0.5
"""Points below LRU that count as a loss (issue 15)."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--policies", default=",".join(p for p in POLICY_NAMES if p != "lru"))
    ap.add_argument("--seeds", default="1,2")
    args = ap.parse_args()
    policies = args.policies.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    print("generator requests users tpb cache seed lru " + " ".join(policies))
    diffs: dict[str, list[tuple[float, str]]] = {p: [] for p in policies}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "short.yaml"
        for gen, (requests, users), (tpb, tokens), seed in itertools.product(
                ("multi_turn", "shared_prefix"), SIZES, CACHES, seeds):
            cell = f"{gen} {requests} {users} {tpb} {tokens} {seed}"
            path.write_text(_workload(gen, requests, users, tpb, tokens, seed))
            row = []
            refs = References()  # the LRU run and the offline references once per cell
            try:
                for p in policies:
                    m = run_workload(load_workload(path, [f"cache.eviction_policy={p}"]),
                                     references=refs)[0]
                    lru = m.metrics["lru_hit_rate"]
                    d = 100 * (m.metrics["hit_rate"] - lru)
                    diffs[p].append((d, cell))
                    row.append(f"{d:+.2f}")
            except InputError as exc:  # the largest request does not fit this cache
                print(f"# {cell}: skipped: {exc}", flush=True)
                continue
            print(f"{cell} {100 * lru:.2f}% " + " ".join(row), flush=True)
    print("policy worst_pp cell mean_pp cells_below_bar")
    for p, ds in diffs.items():
        worst, where = min(ds)
        below = sum(d < -BAR for d, _ in ds)
        print(f"{p} {worst:+.2f} ({where}) {sum(d for d, _ in ds) / len(ds):+.3f} "
              f"{below}/{len(ds)}")


def _workload(gen: str, requests: int, users: int, tpb: int, tokens: int, seed: int) -> str:
    return f"""
name: short
cache: {{tokens_per_block: {tpb}, max_tokens: {tokens}}}
requests:
  source: synthetic
  synthetic: {{generator: {gen}, num_requests: {requests}, num_users: {users},
    turns: {max(1, requests // users)}, prompt_tokens: 96, system_prompt_tokens: 256}}
run: {{mode: cache, progress: false, seed: {seed}}}
"""


if __name__ == "__main__":
    main()
