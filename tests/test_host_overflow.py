"""The host-offload overflow workload reproduces the reuse-shortfall overflow (issue 4)."""

from pathlib import Path

from kvbench.config import load_workload
from kvbench.runner import run_workload

WORKLOADS = Path(__file__).resolve().parents[1] / "workloads"


def test_sequential_add_overflows_and_batch_add_does_not():
    outcomes = {o.variant: o.metrics
                for o in run_workload(load_workload(WORKLOADS / "host-offload-overflow.yaml"))}
    seq, batch = outcomes["sequential"], outcomes["batch"]
    assert seq["mnt_overflow_steps"] > 0
    assert seq["max_mnt_overshoot_tokens"] > 0
    assert seq["reuse_shortfall_tokens"] > 0
    assert batch["mnt_overflow_steps"] == 0
    assert batch["max_mnt_overshoot_tokens"] == 0
    assert batch["reuse_shortfall_tokens"] == 0
    # Both really used the host tier.
    assert seq["onboard_blocks"] > 0 and batch["onboard_blocks"] > 0
    assert batch["reused_tokens_host"] > 0
