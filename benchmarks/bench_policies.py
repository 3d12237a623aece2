"""Eviction policies on the shipped Mooncake traces (issue 15's targets): hit rate, LRU and
optimal references, gap closed, and replay speed in block operations per second.

Targets: some policy with its default parameters closes >= 40 % of the LRU-to-optimal gap on
the conversation trace at 1M tokens, tokens_per_block 64 (first bar 20 %); no policy with
default parameters more than 0.5 pp below LRU on any trace and capacity here; every policy
replays at >= 1M block operations per second in cache mode (an operation: one block a request
claims or allocates).

Usage: python benchmarks/bench_policies.py [--traces conversation,synthetic]
       [--capacities 1048576,262144] [--policies lru,slru,...] [--admission second_use]
       [--tpb 64] [--no-partial] [--repeat N] [--markdown]
A trace `gen:GENERATOR:USERS` is the built-in generator's traffic instead (4000 requests, 6
turns, 512-token messages after a 1024-token system prompt; GENERATOR multi_turn or
shared_prefix), a different sharing structure to check a policy does not lose to LRU there,
e.g. --traces gen:multi_turn:40,gen:multi_turn:400 --tpb 32 --capacities 131072,32768. Any
other name is a trace file in a format kvbench reads (sniffed; a chat trace with the `approx`
tokenizer), e.g. --traces /data/my_trace.jsonl.
The LRU reference is always LRU with admission `all` (run first when --admission is another).
Timings on a shared machine are noisy: compare policies from the same invocation. The first
line states the machine and its load (the 1-minute load average before and after the replays);
Mops/s is CPU time of the replay alone (keys precomputed, the oracle not counted), of the
fastest of `--repeat` replays (default 1; other work on the machine only slows a replay down).
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import time
from pathlib import Path

from kvbench.cache.manager import CacheSpec, KVCacheManager
from kvbench.cache.policies import POLICY_NAMES
from kvbench.config_requests import RequestsConfig
from kvbench.engine.cache_mode import replay_cache_mode
from kvbench.oracle import reference_hit_rates
from kvbench.traffic import load_requests, open_trace, read_mooncake

TRACES = Path(__file__).resolve().parents[2] / "shared" / "traces"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--traces", default="conversation,synthetic")
    ap.add_argument("--capacities", default="1048576,262144")
    ap.add_argument("--policies", default=",".join(POLICY_NAMES))
    ap.add_argument("--admission", default="all")
    ap.add_argument("--tpb", type=int, default=64)
    ap.add_argument("--partial", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--markdown", action="store_true")
    args = ap.parse_args()
    policies = args.policies.split(",")
    print(f"# {_machine()}, load {os.getloadavg()[0]:.2f}", flush=True)
    head = "trace capacity policy hit lru optimal gap_closed vs_lru_pp Mops/s"
    print(("| " + " | ".join(head.split()) + " |\n|" + "---|" * len(head.split()))
          if args.markdown else head)
    for trace in args.traces.split(","):
        requests = _requests(trace)
        largest = max(requests, key=lambda r: r.input_length)
        need = -(-largest.input_length // args.tpb)
        for cap in (int(c) for c in args.capacities.split(",")):
            blocks = cap // args.tpb
            if need > blocks:  # `kvbench run` refuses such a run, and neither replay fits it
                print(f"# {trace} {cap}: skipped: request {largest.id} needs {need} blocks, "
                      f"the pool holds {blocks}", flush=True)
                continue
            optimal = reference_hit_rates(requests, args.tpb, blocks,
                                          partial_reuse=args.partial).optimal_hit_rate
            lru = None
            runs = [(p, args.admission) for p in policies]
            if args.admission != "all":  # the reference is LRU as the engines run it
                runs.insert(0, ("lru", "all"))
            for policy, admission in runs:
                for r in requests:
                    r.block_keys(args.tpb)  # key hashing is not the policy's cost
                spec = CacheSpec(args.tpb, blocks, enable_partial_reuse=args.partial,
                                 eviction_policy=policy, admission=admission)
                cpu = float("inf")
                for _ in range(max(1, args.repeat)):
                    gc.collect()
                    manager = KVCacheManager(spec)
                    t0 = time.process_time()
                    result = replay_cache_mode(requests, manager)
                    cpu = min(cpu, time.process_time() - t0)
                ops = manager.allocated_blocks + result.reused_full_blocks
                hit = result.reused_tokens / result.prompt_tokens
                if lru is None and policy == "lru":
                    lru = hit
                gap = (hit - lru) / (optimal - lru) if lru is not None and optimal > lru else None
                name = policy if admission == "all" else f"{policy}+{admission}"
                row = [trace, str(cap), name, f"{100 * hit:.2f}%",
                       f"{100 * lru:.2f}%" if lru is not None else "-", f"{100 * optimal:.2f}%",
                       f"{100 * gap:.1f}%" if gap is not None else "-",
                       f"{100 * (hit - lru):+.2f}" if lru is not None else "-",
                       f"{ops / cpu / 1e6:.2f}"]
                print(("| " + " | ".join(row) + " |") if args.markdown else " ".join(row),
                      flush=True)
            for r in requests:
                r.drop_keys()
    print(f"# load {os.getloadavg()[0]:.2f} after", flush=True)


def _machine() -> str:
    model = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            model = next(line.split(":", 1)[1].strip() for line in f
                         if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{model}, {os.cpu_count()} CPUs, Python {platform.python_version()}"


def _requests(trace: str) -> list:
    if trace in ("conversation", "synthetic"):
        return list(read_mooncake(TRACES / f"mooncake_{trace}_trace.jsonl"))
    if not trace.startswith("gen:"):  # a trace file in any format kvbench reads (sniffed)
        return list(open_trace(Path(trace)))
    _, generator, users = trace.split(":")
    cfg = RequestsConfig(source="synthetic", synthetic=dict(
        generator=generator, num_requests=4000, num_users=int(users), turns=6,
        prompt_tokens=512, system_prompt_tokens=1024, output_tokens=256, rate=8.0))
    return load_requests(cfg, base_dir=Path("."), seed=0)


if __name__ == "__main__":
    main()
