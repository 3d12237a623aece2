"""The compare gate cannot be fooled: metric types are checked against the registry, files
that are not results are bad input, a baseline updated from part of the suite keeps the rest,
a suite cannot hold two workloads of one name, measured timings are gated on the same GPU and
CPU model whatever the kernel build, and the default output is the failures, improvements and
one summary line, with numbers never cut."""

import copy
import json
import math
import sqlite3
from pathlib import Path

import pytest
from cli_helpers import run_cli

from kvbench.compare import compare_results
from kvbench.config import load_workload
from kvbench.results import build_result
from kvbench.runner import run_workload

TINY = """\
name: {name}
cache: {{tokens_per_block: 16, max_tokens: 2048}}
requests:
  synthetic: {{generator: multi_turn, num_requests: 30, system_prompt_tokens: 64,
              prompt_tokens: 32, output_tokens: 16, num_users: 3, turns: 3}}
run: {{seed: 3, progress: false}}
variants:
  - {{name: partial, set: {{}}}}
  - {{name: no-partial, set: {{cache.enable_partial_reuse: false}}}}
"""


@pytest.fixture(scope="module")
def suite(tmp_path_factory) -> list[Path]:
    folder = tmp_path_factory.mktemp("suite")
    paths = []
    for name in ("alpha", "beta"):
        path = folder / f"{name}.yaml"
        path.write_text(TINY.format(name=name))
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def result(suite) -> dict:
    return build_result([run_workload(load_workload(p)) for p in suite])


def write(path: Path, data) -> Path:
    path.write_text(json.dumps(data))
    return path


def corrupt(result: dict, **metrics) -> dict:
    bad = copy.deepcopy(result)
    bad["runs"][1]["metrics"].update(metrics)
    return bad


@pytest.mark.parametrize("metrics, expected", [
    ({"hit_rate": "high"}, "metric hit_rate: expected a finite number, got 'high'"),
    ({"hit_rate": True}, "metric hit_rate: expected a finite number, got True"),
    ({"hit_rate": math.inf}, "metric hit_rate: expected a finite number, got inf"),
    ({"evicted_blocks": 1.5}, "metric evicted_blocks: expected an integer, got 1.5"),
    ({"ttft_ms": {"p50": 1.0}}, "metric ttft_ms: expected a mapping of mean, p50, p90, p99"),
    ({"verified": "yes"}, "metric verified: expected true, false or null, got 'yes'"),
    ({"requests": None}, "metric requests: expected a value, got null"),
])
def test_a_metric_of_the_wrong_type_is_exit_2_naming_file_run_and_metric(
        result, tmp_path, capsys, metrics, expected):
    base = write(tmp_path / "b.json", result)
    bad = write(tmp_path / "c.json", corrupt(result, **metrics))
    code, out, err = run_cli(["compare", base, bad], capsys)
    assert code == 2 and out == "" and err.count("\n") == 1
    assert f"{bad}: run alpha/no-partial: {expected}" in err


@pytest.mark.parametrize("content, expected", [
    (json.dumps({"schema_version": 1, "runs": {"a": 1}}), "runs: expected a list of runs"),
    (json.dumps({"schema_version": 1, "runs": [3]}), "runs[0]: expected an object"),
    (b"\x89PNG\r\n\x1a\n\x00\xff", "not a text file"),
])
def test_files_that_are_not_results_are_exit_2(result, tmp_path, capsys, content, expected):
    path = tmp_path / "bad.json"
    path.write_bytes(content if isinstance(content, bytes) else content.encode())
    code, _, err = run_cli(["compare", write(tmp_path / "b.json", result), path], capsys)
    assert code == 2 and expected in err and err.count("\n") == 1


def test_a_tune_study_database_is_exit_2(result, tmp_path, capsys):
    db = tmp_path / "study.db"
    sqlite3.connect(db).execute("create table t (x)").connection.commit()
    code, _, err = run_cli(["compare", db, write(tmp_path / "c.json", result)], capsys)
    assert code == 2 and "an SQLite database" in err


def test_two_workloads_of_one_name_are_an_error(result, suite, tmp_path, capsys):
    twin = tmp_path / "twin.yaml"
    twin.write_text(TINY.format(name="alpha"))
    code, _, err = run_cli(["run", suite[0], twin, "-q"], capsys)
    assert code == 2 and f"{twin}: name: 'alpha' is also the name of {suite[0]}" in err
    doubled = copy.deepcopy(result)
    doubled["workloads"][1]["name"] = "alpha"
    code, _, err = run_cli(["compare", write(tmp_path / "b.json", result),
                            write(tmp_path / "c.json", doubled)], capsys)
    assert code == 2 and "workloads[1]: name: 'alpha' is also the name of" in err


def test_updating_a_baseline_from_part_of_the_suite_keeps_the_rest(suite, tmp_path, capsys):
    baseline = tmp_path / "baseline.json"
    assert run_cli(["run", *suite, "-q", "--update-baseline", baseline], capsys)[0] == 0
    full = json.loads(baseline.read_text())
    code, _, err = run_cli(["run", suite[1], "--set", "cache.max_tokens=1024",
                            "--update-baseline", baseline, "--json", tmp_path / "b.json"], capsys)
    assert code == 0 and "kept alpha from it" in err
    merged = json.loads(baseline.read_text())
    assert [(r["workload"], r["variant"]) for r in merged["runs"]] == [
        (r["workload"], r["variant"]) for r in full["runs"]]
    assert merged["runs"][:2] == full["runs"][:2]
    assert merged["runs"][2]["config"]["cache"]["max_tokens"] == 1024
    assert [w["name"] for w in merged["workloads"]] == ["alpha", "beta"]
    assert merged["workload"]["name"] == "alpha+beta"
    # The whole suite still compares clean against it; only beta's runs moved.
    assert run_cli(["run", *suite, "-q", "--json", tmp_path / "all.json"], capsys)[0] == 0
    code, _, err = run_cli(["compare", baseline, tmp_path / "all.json"], capsys)
    assert code == 3 and "beta / " in err and "alpha / " not in err
    # --replace writes only what ran; compare then refuses the shrunk baseline's gaps the
    # other way round: a current result lacking a baseline run is exit 2.
    code, _, _ = run_cli(["run", suite[1], "-q", "--update-baseline", baseline, "--replace"],
                         capsys)
    assert code == 0 and [w["name"] for w in json.loads(baseline.read_text())["workloads"]] == [
        "beta"]
    code, _, err = run_cli(["compare", tmp_path / "all.json", baseline], capsys)
    assert code == 2 and "no run of alpha/partial" in err


def _measured(result: dict, p50: float, **environment) -> dict:
    new = copy.deepcopy(result)
    for run in new["runs"]:
        run["metrics"].update(time_source="measured", attention_ms=p50, copy_gb_per_s=None)
    new["environment"].update(environment)
    return new


def test_measured_timings_are_gated_on_the_same_gpu_and_cpu_model_not_the_kernel_build(result):
    env = {"device": "NVIDIA H100 80GB HBM3", "cpu": "AMD EPYC 9454", "cpu_count": 16}
    base = _measured(result, 10.0, platform="Linux-5.15-x86_64", **env)
    slower = _measured(result, 12.0, platform="Linux-6.8-x86_64", **env)
    comparison = compare_results(base, slower)
    rows = {(run.variant, row.metric): row.status for run in comparison.runs for row in run.rows}
    assert rows[("partial", "attention_ms")] == "regressed"
    other_cpu = _measured(result, 12.0, **{**env, "cpu": "Intel Xeon 8480"})
    comparison = compare_results(base, other_cpu)
    assert not comparison.failures and comparison.device_skips


def test_default_output_is_failures_improvements_and_one_line_with_whole_numbers(
        result, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    m = result["runs"][0]["metrics"]
    worse = corrupt(result, peak_gpu_bytes=123456789012345, hit_rate=m["hit_rate"] + 0.01)
    base = corrupt(result, peak_gpu_bytes=12345678901234)
    code, out, _ = run_cli(["compare", write(tmp_path / "b.json", base),
                            write(tmp_path / "c.json", worse)], capsys)
    assert code == 3
    assert "123,456,789,012,345" in out and "12,345,678,901,234" in out
    *table, summary = out.rstrip().splitlines()
    assert "peak_gpu_bytes" in out and "regressed" in out and "improved" in out
    assert not [line for line in table if " ok" in line or "evicted_blocks" in line]
    assert summary.startswith("4 runs compared: 1 regressed, 1 improved")
