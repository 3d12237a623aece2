"""Serve-mode speed on the Mooncake conversation trace (issue 3's target: the whole trace in
serve mode, no data plane, under 60 s wall on the 2-core dev machine).

Usage: python benchmarks/bench_serve.py [--workload YAML] [--set key=value ...] [--repeat N]
       [--fractions 0.25,0.5,1.0]

Runs `workloads/mooncake-conversation-serve.yaml` as `kvbench run` does (the loop, then the
ideal-hit-rate reference) on growing prefixes of the trace and prints, per run: requests, wall
seconds for the loop and the reference, steps (iterations) and the rows that stood for them
(normal steps and pure-decode jumps), and the modeled headline numbers.
"""

from __future__ import annotations

import argparse
import gc
import time
from pathlib import Path

from kvbench import runner
from kvbench.modes.common import ideal_hit_rate
from kvbench.plan import size_pools
from kvbench.cache.manager import KVCacheManager
from kvbench.config import load_workload
from kvbench.engine.clock import StepClock, hardware_from_config
from kvbench.engine.scheduler import Scheduler
from kvbench.engine.serve import run_serve

HERE = Path(__file__).resolve().parent
DEFAULT_WORKLOAD = HERE.parent / "workloads" / "mooncake-conversation-serve.yaml"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", type=Path, default=DEFAULT_WORKLOAD)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--fractions", default="1.0")
    ap.add_argument("--repeat", type=int, default=2)
    args = ap.parse_args()
    wl = load_workload(args.workload, args.sets)
    t = time.perf_counter()
    requests = runner._load(wl)
    print(f"load: {len(requests)} requests in {time.perf_counter() - t:.2f} s")
    print("requests  loop_s  ideal_s  total_s  iterations  rows  preempt  hit   ideal  "
          "ttft_p50_ms  tpot_p50_ms")
    plan = size_pools(wl, requests)
    spec = plan.spec
    for frac in (float(f) for f in args.fractions.split(",")):
        subset = requests[: int(len(requests) * frac)]
        for _ in range(args.repeat):
            for r in subset:
                r.drop_keys()
            gc.collect()
            t0 = time.perf_counter()
            result = run_serve(
                subset, KVCacheManager(spec), Scheduler(wl.scheduler, spec.tokens_per_block),
                StepClock(wl.model, hardware_from_config(wl.hardware)),
                revert_deferred_ctx=wl.scheduler.revert_deferred_ctx,
                batch_add=wl.cache.add_sequence == "batch")
            t1 = time.perf_counter()
            ideal = ideal_hit_rate(subset, plan, serve=True)
            t2 = time.perf_counter()
            states = result.requests
            hit = sum(s.reused_tokens for s in states) / sum(r.input_length for r in subset)
            ttft = sorted(s.first_token_s - s.request.arrival_s for s in states)
            tpot = sorted((s.finish_s - s.first_token_s) / (s.request.output_length - 1)
                          for s in states if s.request.output_length > 1)
            print(f"{len(subset):8d} {t1 - t0:7.2f} {t2 - t1:8.2f} {t2 - t0:8.2f} "
                  f"{result.iterations:11d} {len(result.timeline):5d} {result.preemptions:8d} "
                  f"{hit:.3f} {ideal:.3f} {1e3 * ttft[len(ttft) // 2]:12.1f} "
                  f"{1e3 * tpot[len(tpot) // 2]:12.1f}")


if __name__ == "__main__":
    main()
