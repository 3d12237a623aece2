"""Data-plane benchmark (CUDA): FlashInfer decode bandwidth and copy bandwidth, each as a
fraction of a peak measured on the same machine at start.

    python benchmarks/bench_kernels.py [--json PATH] [--quick]

Peaks: device-to-device copy (bytes read + written per second, the figure HBM bandwidth is
quoted as), pinned host-to-device and device-to-host copies of one large buffer. Decode: one
layer of a Llama-8B-like shape (32 query heads, 8 KV heads, head_dim 128, bfloat16) through
kvbench's FlashInfer backend (plan once, run), batch size chosen so the batch reads about
2 GiB of K/V (far beyond L2), pages in random order; bandwidth = K/V bytes read / kernel time.
Copies: kvbench's copy executor onboarding and offloading 32-layer blocks, scattered (every
block its own transfer) and contiguous (one run). Targets (issue 6): decode >= 80% of the HBM
peak at long contexts, onboard >= 80% of the pinned host-to-device peak.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvbench.cache.ids import BlockId, CopyKind, CopyOp, Tier  # noqa: E402
from kvbench.kernels.attention import PagedBatch  # noqa: E402
from kvbench.kernels.copies import CopyExecutor  # noqa: E402
from kvbench.kernels.step import ModelShape, PoolSpec, StepItem  # noqa: E402
from kvbench.kernels.storage import make_pools  # noqa: E402

DATASHEET_HBM = {"H100": 3.35e12, "H200": 4.8e12, "A100": 2.04e12, "L40S": 0.864e12}
DEV = torch.device("cuda")


def cuda_ms(fn, iters: int, warmup: int = 3) -> float:
    """Mean kernel time of `fn` in ms, by CUDA events around `iters` back-to-back calls."""
    for _ in range(warmup):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


def measure_peaks(nbytes: int) -> dict:
    a = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    d2d = cuda_ms(lambda: b.copy_(a), 10)
    words = a.view(torch.float32)
    read = cuda_ms(lambda: words.sum(), 10)
    h2d = cuda_ms(lambda: a.copy_(host, non_blocking=True), 5)
    d2h = cuda_ms(lambda: host.copy_(a, non_blocking=True), 5)
    return {"bytes": nbytes, "d2d_read_write_GBps": 2 * nbytes / d2d / 1e6,
            "read_only_GBps": nbytes / read / 1e6,
            "h2d_pinned_GBps": nbytes / h2d / 1e6, "d2h_pinned_GBps": nbytes / d2h / 1e6}


def bench_decode(ctx: int, tpb: int, kv_tokens: int, hbm_peak: float) -> dict:
    from kvbench.kernels.flashinfer_backend import FlashInferBackend

    shape = ModelShape(1, 8, 32, 128, tpb, "bfloat16")
    batch_size = max(1, kv_tokens // ctx)
    pages_per_seq = -(-ctx // tpb)
    slots = batch_size * pages_per_seq
    pool = make_pools(shape, [PoolSpec((0,), slots)], DEV)[0]
    pool.gpu.normal_()
    perm = np.random.default_rng(0).permutation(slots)
    toks = np.zeros(ctx, dtype=np.int64)
    items = [StepItem(i, toks, perm[i * pages_per_seq:(i + 1) * pages_per_seq].tolist(),
                      ctx - 1, ctx) for i in range(batch_size)]
    batch = PagedBatch(items, pool, tpb, DEV, decode=True)
    backend = FlashInferBackend(shape, DEV)
    plan = backend.plan(0, batch)
    q = torch.randn(1, batch_size, 32, 128, dtype=torch.bfloat16, device=DEV)
    ms = cuda_ms(lambda: backend.run(pool.gpu, batch, q, plan), 20)
    kv_bytes = batch_size * ctx * 2 * 8 * 128 * 2
    gbps = kv_bytes / ms / 1e6
    return {"context": ctx, "tokens_per_block": tpb, "batch": batch_size, "ms": ms,
            "GBps": gbps, "frac_of_measured_hbm": gbps * 1e9 / hbm_peak}


def bench_copies(tpb: int, num_blocks: int, peaks: dict) -> list[dict]:
    shape = ModelShape(32, 8, 32, 128, tpb, "bfloat16")
    pools = make_pools(shape, [PoolSpec(tuple(range(32)), num_blocks,
                                        num_host_slots=num_blocks)], DEV)
    copier = CopyExecutor(pools, DEV)
    host0 = pools[0].spec.first_host_id
    perm = np.random.default_rng(1).permutation(num_blocks).tolist()
    out = []
    for layout, dst in (("scattered", perm), ("contiguous", list(range(num_blocks)))):
        for kind, st, dt in ((CopyKind.ONBOARD, Tier.HOST, Tier.GPU),
                             (CopyKind.OFFLOAD, Tier.GPU, Tier.HOST)):
            ops = [CopyOp(kind, st, BlockId(host0 + b if st == Tier.HOST else b), dt,
                          BlockId(host0 + d if dt == Tier.HOST else d), tpb)
                   for b, d in zip(range(num_blocks), dst)]
            ms = cuda_ms(lambda: copier.run(0, ops, 0), 5, warmup=1)
            nbytes = num_blocks * pools[0].slot_bytes
            gbps = nbytes / ms / 1e6
            peak = peaks["h2d_pinned_GBps" if kind == CopyKind.ONBOARD else "d2h_pinned_GBps"]
            out.append({"kind": kind.name.lower(), "layout": layout, "tokens_per_block": tpb,
                        "block_MiB": pools[0].slot_bytes / 2**20, "blocks": num_blocks,
                        "ms": ms, "GBps": gbps, "frac_of_pinned_peak": gbps / peak})
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the results here")
    ap.add_argument("--quick", action="store_true", help="fewer sizes")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_kernels needs CUDA")
    name = torch.cuda.get_device_name()
    peaks = measure_peaks(1 << 30)
    # Decode only reads, and a copy's mixed read/write traffic runs below what reads alone
    # reach, so the peak is the better of the two measurements.
    hbm = max(peaks["d2d_read_write_GBps"], peaks["read_only_GBps"]) * 1e9
    sheet = next((v for k, v in DATASHEET_HBM.items() if k in name), None)
    result = {"device": name, "torch": torch.__version__, "peaks": peaks,
              "datasheet_hbm_Bps": sheet, "decode": [], "copies": []}
    try:
        import flashinfer

        result["flashinfer"] = flashinfer.__version__
    except ImportError as exc:
        result["flashinfer"] = f"unavailable: {exc}"
    print(f"{name}: d2d {peaks['d2d_read_write_GBps']:.0f} GB/s (read+write), read-only "
          f"{peaks['read_only_GBps']:.0f} GB/s, pinned h2d "
          f"{peaks['h2d_pinned_GBps']:.1f} GB/s, d2h {peaks['d2h_pinned_GBps']:.1f} GB/s")
    for tpb in (16, 32):
        for row in bench_copies(tpb, 128 if args.quick else 256, peaks):
            result["copies"].append(row)
            print(f"copy {row['kind']:8s} {row['layout']:10s} tpb {tpb:3d}: {row['GBps']:6.1f} "
                  f"GB/s = {100 * row['frac_of_pinned_peak']:5.1f}% of pinned peak")
    if isinstance(result.get("flashinfer"), str) and result["flashinfer"].startswith("unavail"):
        print("flashinfer unavailable: decode skipped")
    else:
        contexts = (1024, 8192, 32768) if args.quick else (1024, 4096, 16384, 32768)
        for tpb in (16, 32, 64):
            for ctx in contexts:
                row = bench_decode(ctx, tpb, 512 * 1024, hbm)
                if sheet:
                    row["frac_of_datasheet"] = row["GBps"] * 1e9 / sheet
                result["decode"].append(row)
                print(f"decode ctx {ctx:6d} tpb {tpb:3d} batch {row['batch']:4d}: "
                      f"{row['ms']:7.3f} ms {row['GBps']:7.0f} GB/s = "
                      f"{100 * row['frac_of_measured_hbm']:5.1f}% of measured HBM", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
