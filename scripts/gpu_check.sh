#!/usr/bin/env bash
# kvbench on a GPU in one run: CUDA tests, calibration, the data plane at a real model shape,
# measured vs calibrated clock, kernel bandwidths; one summary JSON. At most ~8 minutes on an
# H100 or H200, FlashInfer's JIT compiles included.
#
#   scripts/gpu_check.sh fetch      on a machine with PyPI: put the wheels the GPU machine
#                                   lacks into .whl/ (FlashInfer slimmed to fit a 64 MiB carry)
#   scripts/gpu_check.sh [OUTDIR]   on the GPU machine: install .whl/*.whl if present, run the
#                                   steps below, write OUTDIR/gpu_summary.json (default
#                                   results/gpu), the profile it calibrated and one log
#
# Steps, each with its own time limit, the ones whose figures matter most first:
# `kvbench calibrate` for the Mooncake serve workload's Llama-3-8B shape (the profile; it
# builds FlashInfer's causal prefill module, which tensor-core decode reuses), the 8-request
# data-plane slice with verify off and sample (benchmarks/bench_dataplane.py), the fidelity
# benchmark (benchmarks/bench_fidelity.py: issue 17's grid, then 16 requests of the serve
# workload with the measured clock vs the calibrated profile vs the preset), the CUDA tests
# (they add the sliding-window module), the kernel bandwidths (benchmarks/bench_kernels.py
# --quick), the small verify workloads on FlashInfer, and paired runs of the data-plane slice
# with and without decode CUDA graphs (--paired-graphs). A step that fails or runs out of
# time is recorded and the next one runs; GPU_CHECK_BUDGET_S (default 460) caps the whole,
# GPU_CHECK_ONLY="calibrate fidelity ..." runs only the steps named.
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
    # The wheel is 62 MB: drop kernel sources the paged prefill/decode JIT never builds
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
OUTDIR=$(cd "$OUTDIR" && pwd)
LOG="$OUTDIR/gpu_check.log"
: >"$LOG"
if compgen -G ".whl/*.whl" >/dev/null; then
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target /tmp/kvbench-site .whl/*.whl >>"$LOG" 2>&1 || exit 1
    export PYTHONPATH=/tmp/kvbench-site
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export MAX_JOBS=${MAX_JOBS:-$(nproc)}
# The serve workloads read the Mooncake trace beside the project; elsewhere point
# KVBENCH_TRACE at a copy (its first few hundred lines are enough).
TRACE=${KVBENCH_TRACE:-}
TRACE_SET=()
[ -n "$TRACE" ] && TRACE_SET=(--set "requests.path=$(realpath "$TRACE")")
BUDGET_S=${GPU_CHECK_BUDGET_S:-460}
START=$(date +%s)
STEPS=()

step() {  # step NAME LIMIT_S COMMAND...: run with a limit cut to the time left
    local name=$1 limit=$2
    shift 2
    if [ -n "${GPU_CHECK_ONLY:-}" ] && [[ " $GPU_CHECK_ONLY " != *" $name "* ]]; then
        return
    fi
    local left=$((BUDGET_S - ($(date +%s) - START)))
    [ "$left" -lt "$limit" ] && limit=$left
    if [ "$limit" -le 5 ]; then
        echo "== $name: skipped, out of time" | tee -a "$LOG"
        STEPS+=("$name=skipped")
        return
    fi
    echo "== $name (limit ${limit}s)" | tee -a "$LOG"
    local t0=$(date +%s)
    timeout "$limit" "$@" 2>&1 | tee -a "$LOG"
    local rc=${PIPESTATUS[0]}
    echo "== $name: rc $rc, $(($(date +%s) - t0)) s" | tee -a "$LOG"
    STEPS+=("$name=$rc:$(($(date +%s) - t0))")
}

KVBENCH=(python3 -c "from kvbench.cli import main; main()")

nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >>"$LOG" 2>&1
GPU=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr -c 'A-Za-z0-9\n' '-' | tr A-Z a-z)
PROFILE="$OUTDIR/profile-${GPU:-gpu}.yaml"
SERVE=workloads/mooncake-conversation-serve.yaml

step calibrate 130 "${KVBENCH[@]}" calibrate "$SERVE" "${TRACE_SET[@]}" --out "$PROFILE"
step dataplane 120 python3 benchmarks/bench_dataplane.py --requests 8 "${TRACE_SET[@]}" \
    ${GPU_CHECK_HOST_PROFILE:+--host-profile} \
    --json "$OUTDIR/dataplane.json"
step fidelity 110 python3 benchmarks/bench_fidelity.py --profile "$PROFILE" --requests 16 \
    "${TRACE_SET[@]}" --json "$OUTDIR/fidelity.json"
step tests 120 python3 -m pytest -q -p no:cacheprovider tests/test_flashinfer.py \
    tests/test_measured.py tests/test_kernels.py tests/test_dataplane.py tests/test_graphs.py
step kernels 50 python3 benchmarks/bench_kernels.py --quick --json "$OUTDIR/bench.json"
step verify 50 "${KVBENCH[@]}" run workloads/verify-small.yaml workloads/verify-serve-small.yaml -q \
    --set model.head_dim=128 --set run.backend=flashinfer --json "$OUTDIR/verify.json"
step graphs 70 python3 benchmarks/bench_dataplane.py --paired-graphs --repeat 2 \
    "${TRACE_SET[@]}" --json "$OUTDIR/graphs.json"

python3 - "$OUTDIR" "$PROFILE" "${STEPS[@]}" <<'PY' 2>&1 | tee -a "$LOG"
import json, re, sys
from pathlib import Path

out, profile, steps = Path(sys.argv[1]), Path(sys.argv[2]), sys.argv[3:]
def load(name):
    p = out / name
    return json.loads(p.read_text()) if p.exists() else None
log = (out / "gpu_check.log").read_text().splitlines()
pytest_tail = [l for l in log if re.match(r"^(=+ )?\d+ (passed|failed)", l)][-1:]
verify = load("verify.json")
summary = {
    "gpu": [l for l in log if l.endswith(tuple("0123456789")) and " MiB, " in l][:1],
    "steps": dict(s.split("=", 1) for s in steps),
    "pytest": pytest_tail,
    "profile": profile.name if profile.exists() else None,
    # The profile's text too, so the one summary file carries everything the run measured.
    "profile_yaml": profile.read_text() if profile.exists() else None,
    "dataplane": load("dataplane.json"),
    "fidelity": load("fidelity.json"),
    "verify_flashinfer": [
        {"workload": r["workload"], "variant": r["variant"]}
        | {k: r["metrics"].get(k) for k in ("verified", "max_abs_err", "verify_mismatch",
                                            "data_plane_backend", "attention_ms")}
        for r in (verify or {}).get("runs", [])],
    "bench_kernels": load("bench.json"),
    "decode_graphs": load("graphs.json"),
}
(out / "gpu_summary.json").write_text(json.dumps(summary, indent=2))
print(json.dumps({k: v for k, v in summary.items() if k not in ("bench_kernels", "fidelity",
                                                               "dataplane", "profile_yaml",
                                                               "decode_graphs")},
                 indent=1))
PY
