"""Thinned timelines keep amounts exact (sums) and sample levels."""

from kvbench.config import Workload
from kvbench.engine.timeline import Timeline
from kvbench.runner import run_workload


def test_thinning_sums_amounts_and_samples_levels():
    t = Timeline("step", ("reused_tokens", "in_use"), sums=("reused_tokens",))
    for i in range(10):
        t.columns["reused_tokens"].append(i)
        t.columns["in_use"].append(100 + i)
    out = t.to_json(max_points=4)
    assert out["stride"] == 3
    assert out["columns"]["reused_tokens"] == [0 + 1 + 2, 3 + 4 + 5, 6 + 7 + 8, 9]
    assert out["columns"]["in_use"] == [100, 103, 106, 109]


def test_run_timelines_add_up_to_the_metrics():
    for mode in ("cache", "serve"):
        wl = Workload.model_validate({
            "cache": {"tokens_per_block": 16, "max_tokens": 8192},
            "scheduler": {"max_num_tokens": 1024, "max_batch_size": 16},
            "requests": {"synthetic": {"num_requests": 60, "system_prompt_tokens": 64,
                                       "prompt_tokens": 40, "output_tokens": 12,
                                       "num_users": 6, "turns": 4, "rate": 50.0}},
            "run": {"mode": mode, "progress": False},
        })
        (outcome,) = run_workload(wl)
        cols, m = outcome.timeline["columns"], outcome.metrics
        assert sum(cols["reused_tokens"]) == m["reused_tokens"], mode
        assert sum(cols["prompt_tokens"]) == m["prompt_tokens"], mode
