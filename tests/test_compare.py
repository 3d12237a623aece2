import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvbench.compare import compare_results
from kvbench.config import load_workload
from kvbench.errors import InputError
from kvbench.results import baseline_of, build_result, merge_repeats
from kvbench.runner import run_workload
from cli_helpers import run_cli

ROOT = Path(__file__).resolve().parents[1]

TINY = """\
name: tiny
cache: {tokens_per_block: 16, max_tokens: 2048}
requests:
  synthetic: {generator: multi_turn, num_requests: 60, system_prompt_tokens: 128,
              prompt_tokens: 48, output_tokens: 32, num_users: 6, turns: 4}
run: {seed: 3, progress: false}
variants:
  - {name: partial, set: {}}
  - {name: no-partial, set: {cache.enable_partial_reuse: false}}
"""


@pytest.fixture(scope="module")
def tiny_yaml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("wl") / "tiny.yaml"
    path.write_text(TINY)
    return path


@pytest.fixture(scope="module")
def result(tiny_yaml) -> dict:
    return build_result([run_workload(load_workload(tiny_yaml))])


main = run_cli


def write(path: Path, data: dict) -> Path:
    path.write_text(json.dumps(data))
    return path


def edited(result: dict, variant: str, **metrics) -> dict:
    new = copy.deepcopy(result)
    run = next(r for r in new["runs"] if r["variant"] == variant)
    run["metrics"].update(metrics)
    return new


def statuses(comparison) -> dict[tuple[str, str], str]:
    return {(run.variant, row.metric): row.status for run in comparison.runs for row in run.rows}


def partial_metrics(result: dict) -> dict:
    return next(r for r in result["runs"] if r["variant"] == "partial")["metrics"]


def test_a_result_compared_with_itself_passes(result, tmp_path, capsys):
    comparison = compare_results(result, result)
    assert not comparison.failures
    assert set(statuses(comparison).values()) <= {"ok", "info"}
    path = write(tmp_path / "r.json", result)
    code, out, _ = main(["compare", path, path], capsys)
    assert code == 0
    assert out == "2 runs compared: 2 info, 62 ok (--all shows every row)\n"
    code, out, _ = main(["compare", path, path, "--all"], capsys)
    assert code == 0
    assert "hit_rate" in out and "regressed" not in out


@pytest.mark.parametrize("change", [
    lambda m: {"hit_rate": m["hit_rate"] - 0.01},
    lambda m: {"peak_gpu_blocks": m["peak_gpu_blocks"] + 1},
    lambda m: {"peak_gpu_bytes": m["peak_gpu_bytes"] * 2},
    lambda m: {"mnt_overflow_steps": 2},
], ids=["worse-hit-rate", "more-peak-blocks", "more-peak-bytes", "new-overflow"])
def test_a_worse_result_fails_with_exit_3_naming_the_metric(result, tmp_path, capsys, change):
    base = edited(result, "partial", mnt_overflow_steps=0)
    worse_metrics = change(partial_metrics(base))
    (metric,) = worse_metrics
    current = edited(base, "partial", **worse_metrics)
    assert statuses(compare_results(base, current))[("partial", metric)] == "regressed"
    summary = tmp_path / "summary.md"
    code, _, err = main(["compare", write(tmp_path / "b.json", base),
                         write(tmp_path / "c.json", current), "--markdown", summary], capsys)
    assert code == 3
    assert f"partial: {metric} " in err and "regressed" in err
    assert f"`{metric}`" in summary.read_text() and "**regressed**" in summary.read_text()


def test_json_of_a_comparison_holds_every_row_and_is_written_on_a_regression(
        result, tmp_path, capsys):
    m = partial_metrics(result)
    current = edited(result, "partial", hit_rate=m["hit_rate"] - 0.01)
    base_path, new_path = write(tmp_path / "b.json", result), write(tmp_path / "c.json", current)
    target = tmp_path / "cmp.json"
    code, _, _ = main(["compare", base_path, new_path, "--json", target], capsys)
    data = json.loads(target.read_text())
    assert code == 3 and data["failing"] == 1
    comparison = compare_results(result, current)
    assert data["counts"] == comparison.counts()
    rows = {(run["variant"], row["metric"]): (row["baseline"], row["current"], row["status"])
            for run in data["runs"] for row in run["rows"]}
    assert rows == {(run.variant, row.metric): (row.base, row.new, row.status)
                    for run in comparison.runs for row in run.rows}
    assert rows[("partial", "hit_rate")] == (m["hit_rate"], m["hit_rate"] - 0.01, "regressed")
    code, out, _ = main(["compare", base_path, base_path, "--json", "-"], capsys)
    assert code == 0 and json.loads(out)["failing"] == 0  # standard output: the JSON alone


def test_validate_quiet_prints_nothing_for_a_valid_file(tiny_yaml, capsys):
    code, out, err = main(["validate", tiny_yaml, "--quiet"], capsys)
    assert (code, out, err) == (0, "", "")
    code, out, _ = main(["validate", tiny_yaml], capsys)
    assert code == 0 and out.startswith(f"{tiny_yaml}: ok (")

def test_a_better_result_passes_and_says_improved(result, tmp_path, capsys):
    m = partial_metrics(result)
    better = edited(result, "partial", hit_rate=m["hit_rate"] + 0.01,
                    peak_gpu_blocks=m["peak_gpu_blocks"] - 1)
    comparison = compare_results(result, better)
    assert statuses(comparison)[("partial", "hit_rate")] == "improved"
    assert statuses(comparison)[("partial", "peak_gpu_blocks")] == "improved"
    code, out, _ = main(["compare", write(tmp_path / "b.json", result),
                         write(tmp_path / "c.json", better)], capsys)
    assert code == 0
    assert "improved" in out


def test_schema_mismatch_is_exit_2_with_one_line(result, tmp_path, capsys):
    future = {**result, "schema_version": 2}
    code, _, err = main(["compare", write(tmp_path / "b.json", result),
                         write(tmp_path / "c.json", future)], capsys)
    assert code == 2
    assert err.count("\n") == 1 and "schema_version 2" in err


def test_a_run_missing_from_the_current_result_is_exit_2(result, tmp_path, capsys):
    current = {**result, "runs": [r for r in result["runs"] if r["variant"] != "no-partial"]}
    with pytest.raises(InputError, match="tiny/no-partial"):
        compare_results(result, current)
    code, _, err = main(["compare", write(tmp_path / "b.json", result),
                         write(tmp_path / "c.json", current)], capsys)
    assert code == 2 and err.count("\n") == 1


def test_runs_only_in_the_current_result_are_listed_not_judged(result):
    base = {**result, "runs": [r for r in result["runs"] if r["variant"] != "no-partial"]}
    comparison = compare_results(base, result)
    assert comparison.unguarded == ["tiny/no-partial"] and not comparison.failures


def test_a_metric_missing_from_the_current_result_fails(result):
    current = copy.deepcopy(result)
    del current["runs"][0]["metrics"]["evicted_blocks"]
    comparison = compare_results(result, current)
    assert [(r.variant, row.metric, row.status) for r, row in comparison.failures] == [
        ("partial", "evicted_blocks", "missing")]


def test_wall_time_and_unknown_metrics_never_fail(result):
    m = partial_metrics(result)
    current = edited(result, "partial", wall_s=m["wall_s"] * 100 + 10, brand_new_metric=7)
    base = edited(result, "partial", retired_metric=1.0)
    found = statuses(compare_results(base, current))
    assert found[("partial", "wall_s")] == "info"
    assert found[("partial", "brand_new_metric")] == "info"
    assert found[("partial", "retired_metric")] == "info"
    assert not compare_results(base, current).failures


def test_inputs_that_change_are_a_mismatch(result):
    m = partial_metrics(result)
    current = edited(result, "partial", prompt_tokens=m["prompt_tokens"] + 1,
                     ideal_hit_rate=m["ideal_hit_rate"] + 0.1)
    found = statuses(compare_results(result, current))
    assert found[("partial", "prompt_tokens")] == found[("partial", "ideal_hit_rate")] == "mismatch"


def test_a_config_change_is_noted(result):
    current = copy.deepcopy(result)
    current["runs"][0]["config"]["cache"]["tokens_per_block"] = 32
    (run, *_) = compare_results(result, current).runs
    assert run.notes == ["config differs: cache.tokens_per_block 16 -> 32"]


def test_verified_turning_false_regresses(result):
    base = edited(result, "partial", verified=True, max_abs_err=1e-3)
    current = edited(result, "partial", verified=False, max_abs_err=1e-3)
    assert statuses(compare_results(base, current))[("partial", "verified")] == "regressed"


def dist(p50: float) -> dict:
    return {"mean": p50, "p50": p50, "p90": 2 * p50, "p99": 3 * p50}


def test_modeled_timings_are_exact_up_to_float_noise(result):
    base = edited(result, "partial", time_source="modeled", ttft_ms=dist(10.0),
                  throughput_tokens_per_s=1000.0)
    noise = edited(base, "partial", ttft_ms=dist(10.0 * (1 + 1e-9)))
    assert not compare_results(base, noise).failures
    slower = copy.deepcopy(base)
    partial_metrics(slower)["ttft_ms"]["p99"] = 30.3
    partial_metrics(slower)["throughput_tokens_per_s"] = 999.0
    found = statuses(compare_results(base, slower))
    assert found[("partial", "ttft_ms.p99")] == "regressed"
    assert found[("partial", "ttft_ms.p50")] == "ok"
    assert found[("partial", "throughput_tokens_per_s")] == "regressed"
    # A measured result is never judged against a modeled one.
    measured = edited(slower, "partial", time_source="measured")
    found = statuses(compare_results(base, measured))
    assert found[("partial", "time_source")] == "mismatch"
    assert found[("partial", "ttft_ms.p99")] == "skipped"


def measured_repeats(result: dict, p50s: list[float], device: str) -> dict:
    """`result` as if run with --repeat len(p50s) on `device`, measuring these TTFT p50s."""
    runs = []
    for p50 in p50s:
        for run in result["runs"]:
            run = copy.deepcopy(run)
            run["metrics"].update(time_source="measured", ttft_ms=dist(p50))
            runs.append(run)
    return {**result, "runs": runs, "environment": {**result["environment"], "device": device}}


def test_measured_timings_compare_the_median_of_repeats_on_the_same_device_only(result):
    base = measured_repeats(result, [10.0, 10.2, 9.9], "H100")
    assert merge_repeats(base)[("tiny", "partial")].metrics["ttft_ms"]["p50"] == 10.0
    # One outlier repeat does not move the median: 10.5 is within 10% of 10.0.
    noisy = measured_repeats(result, [10.5, 30.0, 10.4], "H100")
    assert not compare_results(base, noisy).failures
    slower = measured_repeats(result, [12.0, 12.5, 11.5], "H100")
    found = statuses(compare_results(base, slower))
    assert found[("partial", "ttft_ms.p50")] == "regressed"
    assert statuses(compare_results(base, slower, timing_tolerance=0.25))[
        ("partial", "ttft_ms.p50")] == "ok"
    elsewhere = measured_repeats(result, [12.0, 12.5, 11.5], "L40S")
    comparison = compare_results(base, elsewhere)
    assert statuses(comparison)[("partial", "ttft_ms.p50")] == "skipped"
    assert not comparison.failures and not comparison.same_device


def test_run_update_baseline_writes_a_baseline_that_compares_clean(tiny_yaml, tmp_path, capsys):
    baseline, current = tmp_path / "baseline.json", tmp_path / "current.json"
    code, _, _ = main(["run", tiny_yaml, "-q", "--repeat", "2", "--json", current,
                       "--update-baseline", baseline], capsys)
    assert code == 0
    saved = json.loads(baseline.read_text())
    assert len(saved["runs"]) == 4 and all("timeline" not in r for r in saved["runs"])
    assert saved == baseline_of(json.loads(current.read_text()))
    code, out, _ = main(["compare", baseline, current, "-q"], capsys)
    assert (code, out) == (0, "")


def test_compare_and_run_import_neither_torch_nor_matplotlib(result, tiny_yaml, tmp_path):
    path = write(tmp_path / "r.json", result)
    commands = [["run", str(tiny_yaml), "-q"], ["compare", str(path), str(path), "-q"]]
    script = (
        "import sys\n"
        "from kvbench import cli\n"
        f"for args in {commands!r}:\n"
        "    sys.argv = ['kvbench', *args]\n"
        "    try:\n"
        "        cli.main()\n"
        "    except SystemExit as exc:\n"
        "        assert not exc.code, exc.code\n"
        "heavy = sorted(m for m in ('torch', 'matplotlib') if m in sys.modules)\n"
        "assert not heavy, heavy\n"
    )
    subprocess.run([sys.executable, "-c", script], check=True, cwd=ROOT)
