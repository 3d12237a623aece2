"""Cache-mode replay speed on the Mooncake conversation trace (issue 2's target: < 10 s wall
for the whole trace at tokens_per_block 64, max_tokens 1M, both references included, on the
2-core dev machine; cost linear in the number of blocks).

Usage: python benchmarks/bench_cache_mode.py [--trace PATH] [--partial/--no-partial] [--host-ratio R]
Prints one line per fraction of the trace: requests, blocks, seconds per phase, us per block.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.engine.cache_mode import replay_cache_mode
from kvbench.oracle import reference_hit_rates
from kvbench.traffic import read_mooncake

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parents[1] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--tpb", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=1 << 20)
    ap.add_argument("--partial", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--fractions", default="0.25,0.5,1.0")
    args = ap.parse_args()
    t = time.perf_counter()
    requests = list(read_mooncake(args.trace))
    print(f"load: {len(requests)} requests in {time.perf_counter() - t:.2f} s")
    print("fraction requests blocks  keys_s engine_s refs_s total_s us/block hit optimal ideal")
    for frac in (float(f) for f in args.fractions.split(",")):
        subset = requests[: int(len(requests) * frac)]
        for r in subset:
            r.drop_keys()
        gc.collect()
        t0 = time.perf_counter()
        blocks = sum(len(r.block_keys(args.tpb)) + 1 for r in subset)
        t1 = time.perf_counter()
        spec = CacheSpec(args.tpb, args.max_tokens // args.tpb, enable_partial_reuse=args.partial)
        result = replay_cache_mode(subset, KVCacheManager(spec))
        t2 = time.perf_counter()
        refs = reference_hit_rates(subset, args.tpb, spec.num_gpu_blocks,
                                   partial_reuse=args.partial)
        t3 = time.perf_counter()
        print(f"{frac:8.2f} {len(subset):8d} {blocks:7d} {t1 - t0:7.2f} {t2 - t1:8.2f} "
              f"{t3 - t2:6.2f} {t3 - t0:7.2f} {1e6 * (t3 - t0) / blocks:8.2f} "
              f"{result.reused_tokens / result.prompt_tokens:.4f} {refs.optimal_hit_rate:.4f} "
              f"{refs.ideal_hit_rate:.4f}")


if __name__ == "__main__":
    main()
