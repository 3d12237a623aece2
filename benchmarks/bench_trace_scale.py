"""Production-scale cache mode: peak RSS and time per block of `kvbench run` (cache mode with
its ideal and optimal references) on the Mooncake conversation trace tiled N times (fresh ids
and shifted times per tile: `kvbench trace convert --tile N`), at tokens_per_block 64 and a
capacity of 16,384 blocks. Issue 12's target: at 100x (227M blocks) peak RSS <= 1.5 GB and time
per block within 1.5x of the 1x run, on the 2-core machine.

Usage: python benchmarks/bench_trace_scale.py [--times 1,10,100] [--trace PATH] [--workdir DIR]
Each size runs in its own process; RSS is that process's peak (getrusage of the child).
wall us/block counts the replay and both references (the result's wall_s); cpu us/block is the
whole process's CPU time (trace parsing included) per block, the figure to compare on a shared
machine, where wall time mostly measures the other processes.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
DEFAULT_TRACE = HERE.parents[1] / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
WORKLOAD = HERE.parent / "workloads" / "mooncake-conversation.yaml"


def kvbench(*args: str) -> list[str]:
    return [sys.executable, "-c", "from kvbench.cli import main; main()", *args]


def _child_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--times", default="1,10,100")
    ap.add_argument("--workdir", type=Path, default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="kvbench-scale-"))
    work.mkdir(parents=True, exist_ok=True)
    print("times requests     blocks  peak_rss_MB  wall_us/blk  cpu_us/blk  total_s  hit     "
          "optimal ideal")
    base = None
    for times in (int(t) for t in args.times.split(",")):
        trace = args.trace
        if times > 1:
            trace = work / f"tiled-{times}x.jsonl"
            if not trace.exists():
                subprocess.run(kvbench("trace", "convert", str(args.trace), str(trace),
                                       "--tile", str(times), "--quiet"), check=True)
        out = work / f"result-{times}x.json"
        t0 = time.perf_counter()
        c0 = _child_cpu()
        subprocess.run(kvbench("run", str(WORKLOAD), "--set", f"requests.path={trace}",
                               "--set", "cache.tokens_per_block=64",
                               "--set", "cache.max_tokens=1048576", "--quiet", "--json", str(out)),
                       check=True)
        total = time.perf_counter() - t0
        cpu = _child_cpu() - c0
        rss = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
        # ru_maxrss of children is the largest child so far: sizes run in increasing order.
        m = json.loads(out.read_text())["runs"][0]["metrics"]
        blocks = m["prompt_tokens"] // 64
        us = 1e6 * m["wall_s"] / blocks
        cpu_us = 1e6 * cpu / blocks
        base = base or cpu_us
        print(f"{times:5d} {m['requests']:9,d} {blocks:12,d} {rss / 1024:10.0f} "
              f"{us:12.2f} {cpu_us:11.2f} {total:8.1f}  {m['hit_rate']:.4f}  "
              f"{m['optimal_hit_rate']:.4f} {m['ideal_hit_rate']:.4f}  "
              f"(cpu {cpu_us / base:.2f}x the first)", flush=True)
    if args.workdir is None:
        for p in work.iterdir():
            p.unlink()
        os.rmdir(work)


if __name__ == "__main__":
    main()
