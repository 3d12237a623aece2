"""`kvbench run` in serve mode, as a user runs it: workloads, metrics, tables, bad input."""

import json
from pathlib import Path

import pytest
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]
WORKLOADS = ROOT / "workloads"
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"

SERVE_METRICS = {
    "iterations", "preemptions", "throughput_tokens_per_s", "ttft_ms", "tpot_ms", "time_source",
    "mnt_overflow_steps", "max_mnt_overshoot_tokens", "reuse_shortfall_tokens",
    "deferred_ctx_blocks_held_peak", "deferred_ctx_blocks_reverted", "batch_wait_iterations",
    "hit_rate", "ideal_hit_rate", "peak_gpu_blocks", "requests", "prompt_tokens",
}


kvbench = run_cli


def run_json(args, tmp_path, capsys) -> dict:
    out = tmp_path / "r.json"
    code, stdout, err = kvbench(["run", *args, "--json", out], capsys)
    assert code == 0, err
    return json.loads(out.read_text()), stdout


def test_chat_serve(tmp_path, capsys):
    result, stdout = run_json([WORKLOADS / "chat-serve.yaml", "--set",
                               "requests.synthetic.num_requests=120"], tmp_path, capsys)
    (run,) = result["runs"]
    m = run["metrics"]
    assert SERVE_METRICS <= set(m)
    assert m["time_source"] == "modeled" and m["requests"] == 120
    for dist in ("ttft_ms", "tpot_ms"):
        assert set(m[dist]) == {"mean", "p50", "p90", "p99"}
        assert 0 < m[dist]["p50"] <= m[dist]["p99"]
    assert 0 < m["hit_rate"] <= m["ideal_hit_rate"] < 1
    assert m["throughput_tokens_per_s"] > 0 and m["optimal_hit_rate"] is None
    assert run["timeline"]["x"] == "step" and "computed_tokens" in run["timeline"]["columns"]
    for label in ("TTFT ms", "TPOT ms", "throughput", "preemptions", "MNT overflow steps"):
        assert label in stdout


def test_delay_batching_variants(tmp_path, capsys):
    result, stdout = run_json([WORKLOADS / "delay-batching.yaml", "--set",
                               "requests.synthetic.num_requests=200"], tmp_path, capsys)
    runs = {r["variant"]: r["metrics"] for r in result["runs"]}
    assert list(runs) == ["no-wait", "wait-hold", "wait-revert"]
    assert runs["no-wait"]["batch_wait_iterations"] == 0
    assert runs["wait-hold"]["batch_wait_iterations"] > 0
    assert runs["wait-hold"]["deferred_ctx_blocks_held_peak"] > 0
    assert runs["wait-hold"]["deferred_ctx_blocks_reverted"] == 0
    assert runs["wait-revert"]["deferred_ctx_blocks_held_peak"] == 0
    assert runs["wait-revert"]["deferred_ctx_blocks_reverted"] > 0
    assert runs["wait-hold"]["ttft_ms"]["mean"] > runs["no-wait"]["ttft_ms"]["mean"]
    assert "iterations waited" in stdout


def test_serve_mode_is_deterministic(tmp_path, capsys):
    args = [WORKLOADS / "chat-serve.yaml", "--set", "requests.synthetic.num_requests=60", "-q"]
    a, _ = run_json(args, tmp_path, capsys)
    b, _ = run_json(args, tmp_path, capsys)
    ma, mb = a["runs"][0]["metrics"], b["runs"][0]["metrics"]
    ma.pop("wall_s"), mb.pop("wall_s")
    assert ma == mb


@pytest.mark.skipif(not TRACE.exists(), reason="shared traces absent")
def test_mooncake_serve_prefix(tmp_path, capsys):
    result, _ = run_json([WORKLOADS / "mooncake-conversation-serve.yaml", "-q", "--set",
                          "requests.limit=150"], tmp_path, capsys)
    m = result["runs"][0]["metrics"]
    assert m["requests"] == 150 and m["iterations"] > 0 and m["time_source"] == "modeled"


@pytest.mark.parametrize("overrides, message", [
    (["scheduler.max_batch_size=9000"], "scheduler.max_batch_size (9000) exceeds"),
    (["cache.max_tokens=1024"], "cache.max_tokens: request"),
    (["scheduler.enable_chunked_prefill=false", "scheduler.max_num_tokens=1000"],
     "scheduler.max_num_tokens: request"),
    (["scheduler.max_num_tokens=16", "scheduler.max_batch_size=8"], "below one chunk"),
])
def test_bad_serve_input_is_one_line_exit_2(overrides, message, capsys):
    sets = [a for o in overrides + ["requests.synthetic.num_requests=20"] for a in ("--set", o)]
    code, _, err = kvbench(["run", WORKLOADS / "chat-serve.yaml", "-q", *sets], capsys)
    assert code == 2
    assert message in err and err.count("\n") == 1
