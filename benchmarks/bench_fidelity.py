"""Fidelity of the calibrated clock (CUDA): the same serve workload with `run.clock: measured`
and with `run.clock: modeled` + `hardware.profile`, and the issue's grid of kernel work.

    python benchmarks/bench_fidelity.py --profile PROFILE.yaml [--requests 32]
        [--workload YAML] [--set key=value ...] [--json PATH]

Serve: the first N requests of the workload (default: the Mooncake conversation trace at
Llama-3-8B shape, 128K-token cache) run three times: measured on this GPU (FlashInfer data
plane, verify off), modeled with the profile, and modeled with the datasheet preset; printed:
TTFT p50/p99, TPOT p50 and throughput of each, and each model's error against measured
(target: within 10 % with the profile).

Grid: the work of issue 17's table measured afresh here (linear layers of all 32 layers at
1/128/2048/8192 tokens; causal prefill attention of a 512- and an 8192-token chunk with
nothing cached; decode attention of 1 and 32 sequences at 4096 context; each over all layers,
the way the measured clock runs it), against the profile's interpolation and the preset
model (target: within 15 % with the profile). Several of these points are not on the
calibration grid (512-token chunks, context 4096, batch 32), so they test interpolation too.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvbench.config import load_workload  # noqa: E402
from kvbench.engine.clock import (ProfileClock, StepClock, hardware_from_config,  # noqa: E402
                                  interp1, interp2)
from kvbench.profile import load_profile  # noqa: E402
from kvbench.runner import run_workload  # noqa: E402

WORKLOAD = ROOT / "workloads" / "mooncake-conversation-serve.yaml"
SLICE = ("cache.max_tokens=131072", "run.progress=false")
GRID = ([("linear", t) for t in (1, 128, 2048, 8192)]
        + [("prefill", c) for c in (512, 8192)]
        + [("decode", n) for n in (1, 32)])
DECODE_CONTEXT = 4096


def serve(args) -> dict:
    base = [*SLICE, f"requests.limit={args.requests}", *args.sets]
    runs = {
        "measured": [*base, "run.clock=measured", "run.backend=flashinfer", "run.verify='off'"],
        "profile": [*base, f"hardware.profile={args.profile.resolve()}", "run.backend=none"],
        "preset": [*base, "run.backend=none"],
    }
    out = {}
    for name, sets in runs.items():
        m = run_workload(load_workload(args.workload, sets))[0].metrics
        out[name] = {"ttft_p50_ms": m["ttft_ms"]["p50"], "ttft_p99_ms": m["ttft_ms"]["p99"],
                     "tpot_p50_ms": m["tpot_ms"]["p50"],
                     "throughput_tokens_per_s": m["throughput_tokens_per_s"],
                     "iterations": m["iterations"], "time_source": m["time_source"],
                     "wall_s": m["wall_s"]}
    for name in ("profile", "preset"):
        out[f"{name}_error"] = {k: out[name][k] / out["measured"][k] - 1
                                for k in ("ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms",
                                          "throughput_tokens_per_s") if out["measured"][k]}
    return out


def grid(args, wl) -> list[dict]:
    import torch

    from kvbench.calibrate import Rig

    profile = load_profile(args.profile)
    rig = Rig(wl.model, wl.cache.tokens_per_block, wl.scheduler.max_batch_size)
    clock = StepClock(wl.model, hardware_from_config(wl.hardware))
    rows = []
    for kind, x in GRID:
        if kind == "linear":
            measured = rig.linear(x)
            predicted = float(interp1(profile.linear, ProfileClock(profile).padded(x)))
            preset = 1e3 * max(x * clock.token_s, clock.weights_s)
            label = f"linear, {x} tokens"
        elif kind == "prefill":
            measured = rig.prefill(x, 0)
            predicted = float(interp2(profile.prefill, x, 0))
            pairs = x * (x + 1) // 2
            preset = 1e3 * max(pairs * clock.pair_s, x * clock.kv_token_s)
            label = f"causal prefill attention, {x} tokens"
        else:
            measured = rig.decode(x, DECODE_CONTEXT)
            predicted = float(interp2(profile.decode, x, DECODE_CONTEXT))
            work = x * DECODE_CONTEXT
            preset = 1e3 * max(work * clock.pair_s, work * clock.kv_token_s)
            label = f"decode attention, {x} seq x {DECODE_CONTEXT} ctx"
        rows.append({"work": label, "measured_ms": measured, "profile_ms": predicted,
                     "profile_error": predicted / measured - 1, "preset_ms": preset,
                     "preset_error": preset / measured - 1})
        print(f"{label:42s} measured {measured:8.3f} ms  profile {predicted:8.3f} "
              f"({100 * rows[-1]['profile_error']:+6.1f} %)  preset {preset:8.3f} "
              f"({100 * rows[-1]['preset_error']:+6.1f} %)", flush=True)
    del rig
    torch.cuda.empty_cache()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--profile", type=Path, required=True)
    ap.add_argument("--workload", type=Path, default=WORKLOAD)
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--json", type=Path)
    ap.add_argument("--skip-grid", action="store_true")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("bench_fidelity needs CUDA")
    wl = load_workload(args.workload, [*SLICE, *args.sets])
    result = {"device": torch.cuda.get_device_name(), "profile": str(args.profile),
              "workload": str(args.workload), "requests": args.requests}
    result["serve"] = s = serve(args)
    for name in ("measured", "profile", "preset"):
        r = s[name]
        print(f"serve {name:8s}: TTFT p50 {r['ttft_p50_ms']:9.1f} ms, p99 "
              f"{r['ttft_p99_ms']:9.1f} ms, TPOT p50 {r['tpot_p50_ms']:7.2f} ms, "
              f"{r['throughput_tokens_per_s']:8.1f} tok/s ({r['iterations']} steps, "
              f"{r['time_source']})")
    for name in ("profile", "preset"):
        print(f"error of {name}: " + ", ".join(f"{k} {100 * v:+.1f} %"
                                              for k, v in s[f"{name}_error"].items()))
    result["serve_max_profile_error"] = max(abs(v) for v in s["profile_error"].values())
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    if not args.skip_grid:
        result["grid"] = grid(args, wl)
        result["grid_max_profile_error"] = max(abs(r["profile_error"]) for r in result["grid"])
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
