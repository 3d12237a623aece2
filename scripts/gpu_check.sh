#!/usr/bin/env bash
# The data plane's GPU check: CUDA tests, FlashInfer end to end, and the kernel benchmark.
#
#   scripts/gpu_check.sh fetch      on a machine with PyPI: put the wheels the GPU machine
#                                   lacks into .whl/ (FlashInfer slimmed to fit a 64 MiB carry)
#   scripts/gpu_check.sh [OUTDIR]   on the GPU machine: install .whl/*.whl if present, run the
#                                   checks, write OUTDIR/gpu_summary.json (default results/gpu)
#
# Steps run in order of what they compile: the benchmark's decode builds FlashInfer's
# no-window prefill module (tensor-core decode reuses it), the tests add the windowed one and
# the append kernel, and the end-to-end run needs nothing new. Each step's log is kept even
# when a later one fails or the time runs out.
set -uo pipefail
cd "$(dirname "$0")/.."

FLASHINFER_VERSION=0.7.2.post1

if [ "${1:-}" = fetch ]; then
    set -e
    mkdir -p .whl
    tmp=$(mktemp -d)
    py=(--no-deps --only-binary=:all: --python-version 3.12 --implementation cp
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64
        --platform manylinux2014_x86_64)
    python3 -m pip download -q "${py[@]}" -d .whl "apache-tvm-ffi>=0.1.11,<0.2" pydantic \
        pydantic-core annotated-types typing-inspection
    python3 -m pip download -q "${py[@]}" -d "$tmp" "flashinfer-python==$FLASHINFER_VERSION"
    # The wheel is 62 MB: drop kernel sources the paged prefill/decode/append JIT never builds
    # (every csrc subfolder, the experimental kernels' sources), keeping all Python modules.
    (cd "$tmp" && unzip -q flashinfer_python-*.whl -d x && rm flashinfer_python-*.whl &&
        find x/flashinfer/data/csrc -mindepth 1 -maxdepth 1 -type d -exec rm -rf {} + &&
        rm -f x/flashinfer/data/csrc/cake_* x/flashinfer/data/csrc/alphamoe* &&
        find x/flashinfer/experimental -type f ! -name '*.py' -delete &&
        cd x && python3 -m zipfile -c "../flashinfer_python-$FLASHINFER_VERSION-py3-none-any.whl" .)
    mv "$tmp"/flashinfer_python-*.whl .whl/
    rm -rf "$tmp"
    du -sh .whl
    exit 0
fi

OUTDIR=${1:-results/gpu}
mkdir -p "$OUTDIR"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvbench-site .whl/*.whl || exit 1
    export PYTHONPATH=/tmp/kvbench-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$OUTDIR/nvidia-smi.txt" 2>&1
python3 benchmarks/bench_kernels.py --json "$OUTDIR/bench.json" 2>&1 | tee "$OUTDIR/bench.log"
python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer.py tests/test_kernels.py \
    tests/test_dataplane.py 2>&1 | tee "$OUTDIR/pytest.log"
python3 -c "from kvbench.cli import main; main()" run workloads/verify-small.yaml -q \
    --set model.head_dim=128 --set run.backend=flashinfer --json "$OUTDIR/verify-small.json" \
    2>&1 | tee "$OUTDIR/verify-small.log"

python3 - "$OUTDIR" <<'EOF'
import json, sys
from pathlib import Path

out = Path(sys.argv[1])
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
tail = (out / "pytest.log").read_text().strip().splitlines() if (out / "pytest.log").exists() else []
runs = load("verify-small.json")
summary = {
    "gpu": (out / "nvidia-smi.txt").read_text().strip().splitlines()[-1:],
    "pytest": tail[-1:] ,
    "verify_small_flashinfer": [
        {k: r["metrics"].get(k) for k in ("verified", "max_abs_err", "verify_mismatch",
                                          "data_plane_backend", "attention_ms", "copy_ms",
                                          "copy_gb_per_s", "wall_s")} | {"variant": r["variant"]}
        for r in (runs or {}).get("runs", [])],
    "bench": load("bench.json"),
}
(out / "gpu_summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: v for k, v in summary.items() if k != "bench"}, indent=2))
EOF
