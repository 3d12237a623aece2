"""`kvbench tune` (issue 7): studies end to end on the embedded storage, seeds, resuming after a
kill and a Ctrl-C, two workers on one study (journal file here, PostgreSQL in CI), constraints,
and the exported best workload reproducing its trial."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvbench import tune as T
from kvbench.cli import app
from kvbench.errors import InputError

optuna = pytest.importorskip("optuna")
from optuna.trial import TrialState  # noqa: E402

WORKLOAD = """\
name: tiny-tune
model: {num_layers: 4, num_kv_heads: 2, num_q_heads: 4, head_dim: 64}
cache: {tokens_per_block: 16, max_tokens: 4096}
requests:
  synthetic: {generator: multi_turn, num_requests: 60, system_prompt_tokens: 128,
              prompt_tokens: 64, output_tokens: 32, num_users: 6, turns: 4}
run: {mode: cache, progress: false}
tune:
  space:
    cache.tokens_per_block: {choices: [8, 16, 32, 64]}
    cache.max_tokens: {low: 256, high: 8192, log: true}
    cache.enable_partial_reuse: {choices: [true, false]}
  objectives:
    - {metric: hit_rate, direction: maximize}
    - {metric: peak_gpu_bytes, direction: minimize}
  constraints: ["gpu_blocks_total >= 64"]
  seed: 3
  n_trials: 10
"""

# Only valid configurations, and runs long enough (~0.5 s) to catch a trial while it runs.
SLOW = ("requests.synthetic.num_requests=3000",
        "tune.space={cache.tokens_per_block: {choices: [8, 16, 32]}, "
        "cache.max_tokens: {low: 2048, high: 8192}}")

KVBENCH = [sys.executable, "-c",
           "import sys; from kvbench.cli import main; sys.argv[0] = 'kvbench'; main()"]
runner = CliRunner()


def write(folder: Path, text: str = WORKLOAD, name: str = "tiny-tune.yaml") -> Path:
    path = folder / name
    path.write_text(text)
    return path


def load(plan: T.Plan):
    return optuna.load_study(study_name=plan.study_name, storage=T.open_storage(plan))


def invoke(*args: str):
    result = runner.invoke(app, [str(a) for a in args])
    if result.exception and not isinstance(result.exception, SystemExit):
        raise result.exception
    return result


def counted(plan: T.Plan, trials) -> int:
    return T.tally(plan, trials).used


# ---------------------------------------------------------------------------------------------
# A small study end to end on the embedded SQLite storage (run once for several tests).


@pytest.fixture(scope="module")
def study_run(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tune")
    path = write(folder)
    cwd = os.getcwd()
    os.chdir(folder)  # the default storage is results/<workload>-tune.db under the cwd
    try:
        result = invoke("tune", path.name, "--trials", "10", "--export-best", "best.yaml",
                        "--plots", "plots")
    finally:
        os.chdir(cwd)
    plan = T.prepare(T.TuneJob(str(path), storage=f"sqlite:///{folder}/results/tiny-tune-tune.db"))
    return folder, plan, result, load(plan)


def test_study_end_to_end(study_run):
    folder, plan, result, study = study_run
    assert result.exit_code == 0, result.output
    assert (folder / "results" / "tiny-tune-tune.db").is_file()
    trials = study.get_trials()
    assert counted(plan, trials) == 10 and len(trials) == 10
    counts = T.tally(plan, trials)
    assert counts.complete >= 3 and counts.invalid >= 1  # max_tokens 256 cannot hold a request
    for t in trials:
        if t.state == TrialState.COMPLETE:
            metrics = t.user_attrs["metrics"]  # the run's full metrics
            assert {"hit_rate", "peak_gpu_bytes", "evicted_blocks", "wall_s"} <= set(metrics)
            assert list(t.values) == [metrics["hit_rate"], metrics["peak_gpu_bytes"]]
            assert t.user_attrs["outcome"] == "complete"
        else:  # rejected configurations are PRUNED, so that TPE learns to avoid them
            assert t.state == TrialState.PRUNED and t.user_attrs["outcome"] == "invalid"
            assert "cache.max_tokens" in t.user_attrs["reason"]
    assert study.user_attrs["kvbench"]["objectives"] == [["hit_rate", "maximize"],
                                                         ["peak_gpu_bytes", "minimize"]]
    assert "Pareto front" in result.output and "best by hit_rate" in result.output
    for name in ("pareto_front.png", "history-hit_rate.png", "history-peak_gpu_bytes.png"):
        assert (folder / "plots" / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_resumed_complete_study_runs_nothing(study_run):
    folder, plan, _, study = study_run
    before = len(study.get_trials())
    result = invoke("tune", folder / "tiny-tune.yaml", "--trials", "10", "--storage",
                    plan.storage_url, "--quiet")
    assert result.exit_code == 0
    assert len(study.get_trials()) == before
    result = invoke("tune", folder / "tiny-tune.yaml", "--trials", "12", "--storage",
                    plan.storage_url, "--quiet")
    assert result.exit_code == 0
    assert counted(plan, study.get_trials()) == 12  # --trials is the study's total


def test_exported_best_reproduces_its_trial(study_run):
    folder, plan, _, study = study_run
    best = T.summarize(plan, study.get_trials()).best
    text = (folder / "best.yaml").read_text()
    assert f"# Best trial #{best.number} " in text and "tune:" not in text
    result = invoke("run", folder / "best.yaml", "--json", folder / "best.json", "--quiet")
    assert result.exit_code == 0, result.output
    metrics = json.loads((folder / "best.json").read_text())["runs"][0]["metrics"]
    expected = dict(best.user_attrs["metrics"])
    metrics.pop("wall_s"), expected.pop("wall_s")
    assert metrics == expected


def test_constraints_mark_infeasible_trials_in_optuna(study_run):
    _, plan, _, study = study_run
    complete = [t for t in study.get_trials() if t.state == TrialState.COMPLETE]
    for t in complete:
        # Optuna's constraints API (the TPE sampler's constraints_func): <= 0 is feasible.
        (violation,) = t.system_attrs["constraints"]
        assert violation == 64 - t.user_attrs["metrics"]["gpu_blocks_total"]
        assert t.user_attrs["feasible"] is (violation <= 0)


def test_constraints_keep_infeasible_trials_off_the_front(tmp_path):
    head, _ = WORKLOAD.split("tune:")
    text = head.replace("max_tokens: 4096", "max_tokens: 8192") + """\
tune:
  space:
    cache.tokens_per_block: {choices: [8, 16, 32, 64]}
  objectives:
    - {metric: hit_rate, direction: maximize}
    - {metric: peak_gpu_bytes, direction: minimize}
  constraints: ["gpu_blocks_total >= 300"]
  sampler: grid
  seed: 3
"""
    plan = T.prepare(T.TuneJob(str(write(tmp_path, text)), n_trials=10,
                               storage=f"sqlite:///{tmp_path}/c.db"))
    assert plan.n_trials == 4  # capped at the grid's size
    storage = T.open_storage(plan)
    study, _ = T.create_study(plan, storage)
    assert T.run_worker(plan, storage=storage) == "done"
    trials = study.get_trials()
    by_tpb = {t.params["cache.tokens_per_block"]: t for t in trials}
    assert sorted(by_tpb) == [8, 16, 32, 64] and all(t.state == TrialState.COMPLETE
                                                     for t in trials)
    # 8192 tokens: 1024, 512, 256, 128 blocks; >= 300 keeps 8 and 16.
    assert {b: t.user_attrs["feasible"] for b, t in by_tpb.items()} == {
        8: True, 16: True, 32: False, 64: False}
    summary = T.summarize(plan, trials)
    assert summary.tally.infeasible == 2
    assert {t.params["cache.tokens_per_block"] for t in summary.feasible} == {8, 16}
    assert summary.best.params["cache.tokens_per_block"] == 8  # same hit rate, fewer bytes
    assert all(t.user_attrs["feasible"] for t in summary.pareto)


# ---------------------------------------------------------------------------------------------
# Seeds.


def _params_of(tmp_path: Path, name: str, seed: int) -> list:
    path = write(tmp_path, WORKLOAD.replace("seed: 3", f"seed: {seed}"), f"{name}.yaml")
    plan = T.prepare(T.TuneJob(str(path), n_trials=5, storage=f"sqlite:///{tmp_path}/{name}.db",
                               study_name="s"))
    storage = T.open_storage(plan)
    study, _ = T.create_study(plan, storage)
    T.run_worker(plan, storage=storage)
    return [(t.params, t.values, t.state) for t in study.get_trials()]


def test_same_seed_same_trials(tmp_path):
    first = _params_of(tmp_path, "a", seed=11)
    assert first == _params_of(tmp_path, "b", seed=11)
    assert [p for p, _, _ in first] != [p for p, _, _ in _params_of(tmp_path, "c", seed=12)]


def test_worker_seeds_differ_from_the_study_seed():
    assert T.worker_seed(5, 0, 0) == 5
    assert len({T.worker_seed(5, 0, 0), T.worker_seed(5, 1, 0), T.worker_seed(5, 0, 4)}) == 3
    assert T.worker_seed(None, 1, 3) is None


# ---------------------------------------------------------------------------------------------
# Interrupted and killed studies.


def _wait_for(plan: T.Plan, ready, proc: subprocess.Popen, timeout: float = 60.0):
    study = None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "kvbench tune ended before the test could kill it"
        time.sleep(0.05)
        try:
            study = study or load(plan)
            trials = study.get_trials()
        except Exception:  # noqa: BLE001 - the study is not there yet
            continue
        if ready(trials):
            return trials
    raise AssertionError("timed out waiting for the study")


def _complete(trials) -> int:
    return sum(t.state == TrialState.COMPLETE for t in trials)


def _running(trials, plan: T.Plan) -> bool:
    """A trial is running with all its parameters drawn (killed before that, it has no
    parameters to be retried with)."""
    return any(t.state == TrialState.RUNNING and len(t.params) == len(plan.params)
               for t in trials)


# study.ask() stands in for a worker's trial: Optuna warns that heartbeats go with optimize().
@pytest.mark.filterwarnings("ignore:Heartbeat of storage:UserWarning")
def test_a_trial_killed_before_its_first_heartbeat_goes_stale(tmp_path):
    """A worker killed between creating a trial and its first heartbeat leaves a running
    trial without one: once it started more than the grace period (3 heartbeats) ago it is
    failed and queued again like a stale one (a resumed study would otherwise wait for it
    forever); a trial just started, or one whose heartbeat is fresh, is left running."""
    import optuna

    plan = T.prepare(T.TuneJob(str(write(tmp_path)), n_trials=4,
                               storage=f"sqlite:///{tmp_path}/h.db", heartbeat_s=1))
    storage = T.open_storage(plan)
    study, _ = T.create_study(plan, storage)
    silent, beating = study.ask(), study.ask()
    storage.record_heartbeat(beating._trial_id)
    optuna.storages.fail_stale_trials(study)
    assert [t.state for t in study.get_trials()] == [TrialState.RUNNING] * 2
    time.sleep(3.3)
    storage.record_heartbeat(beating._trial_id)
    optuna.storages.fail_stale_trials(study)
    trials = study.get_trials()
    assert [t.state for t in trials] == [TrialState.FAIL, TrialState.RUNNING,
                                         TrialState.WAITING]
    assert trials[2].system_attrs["failed_trial"] == silent.number


def test_interrupted_then_killed_study_resumes_to_n_trials(tmp_path, monkeypatch):
    path = write(tmp_path)
    storage = f"sqlite:///{tmp_path}/k.db"
    sets = [x for s in SLOW for x in ("--set", s)]
    args = ["tune", str(path), "--trials", "8", "--storage", storage, "--heartbeat", "1", *sets]
    plan = T.prepare(T.TuneJob(str(path), SLOW, 8, storage, heartbeat_s=1))

    # Ctrl-C during the second trial: the first stays, the second is recorded as interrupted
    # and queued again with its parameters; exit 130.
    import kvbench.runner

    real_run, calls = kvbench.runner.run_workload, []

    def run_then_interrupt(wl, progress=None, references=None, streams=None):
        calls.append(wl)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_run(wl, progress, references, streams)

    monkeypatch.setattr(kvbench.runner, "run_workload", run_then_interrupt)
    result = invoke(*args)
    monkeypatch.setattr(kvbench.runner, "run_workload", real_run)
    assert result.exit_code == 130
    assert "interrupted: 1 of 8 trials kept; run the same command to resume" in result.output
    trials = load(plan).get_trials()
    assert [(t.state, t.user_attrs.get("outcome")) for t in trials] == [
        (TrialState.COMPLETE, "complete"), (TrialState.FAIL, "interrupted"),
        (TrialState.WAITING, "interrupted")]
    interrupted = trials[1]
    assert trials[2].params == interrupted.params

    # A killed process: its trial stays RUNNING until its heartbeat goes stale.
    proc = subprocess.Popen([*KVBENCH, *args], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    _wait_for(plan, lambda ts: _complete(ts) > 2 and _running(ts, plan), proc)
    proc.kill()
    proc.wait(timeout=30)
    killed = [t for t in load(plan).get_trials() if t.state == TrialState.RUNNING]
    assert len(killed) == 1

    # Resume: completes exactly 8, re-running both lost trials with their parameters.
    result = invoke(*args, "--quiet")
    assert result.exit_code == 0, result.output
    trials = load(plan).get_trials()
    assert _complete(trials) == 8 and counted(plan, trials) == 8
    assert not any(t.state in (TrialState.RUNNING, TrialState.WAITING) for t in trials)
    stale = next(t for t in trials if t.number == killed[0].number)
    assert stale.state == TrialState.FAIL and "outcome" not in stale.user_attrs
    retries = {t.system_attrs.get("failed_trial"): t for t in trials
               if t.state == TrialState.COMPLETE}
    assert retries[killed[0].number].params == stale.params
    assert retries[interrupted.number].params == interrupted.params
    assert sorted(t.number for t in trials) == list(range(len(trials)))


# ---------------------------------------------------------------------------------------------
# Two workers on one study.


def _two_workers(tmp_path: Path, storage: str, study: str, n: int = 10):
    path = write(tmp_path)
    sets = ("requests.synthetic.num_requests=1500",)
    proc = subprocess.run(
        [*KVBENCH, "tune", str(path), "--trials", str(n), "--storage", storage, "--study", study,
         "--workers", "2", "--quiet", *(x for s in sets for x in ("--set", s))],
        capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr
    plan = T.prepare(T.TuneJob(str(path), sets, n, storage, study))
    trials = load(plan).get_trials()
    numbers = [t.number for t in trials]
    assert counted(plan, trials) == n and len(trials) == n  # no overshoot, nothing lost
    assert sorted(numbers) == list(range(n))  # no duplicated trial numbers
    workers = {t.user_attrs["kvbench"]["worker"] for t in trials}
    assert len(workers) == 2, workers  # both took part
    return trials


def test_two_workers_share_a_journal_study(tmp_path):
    _two_workers(tmp_path, f"journal:{tmp_path}/study.log", "two")


def test_two_workers_share_a_postgresql_study(tmp_path):
    url = os.environ.get("KVBENCH_TEST_POSTGRES_URL")
    if not url:
        if os.environ.get("CI"):
            pytest.fail("CI must run this test: .ci/run starts PostgreSQL and sets "
                        "KVBENCH_TEST_POSTGRES_URL")
        pytest.skip("no PostgreSQL: set KVBENCH_TEST_POSTGRES_URL=postgresql://USER@HOST:PORT/DB "
                    "(.ci/run starts one)")
    _two_workers(tmp_path, url, f"two-{uuid.uuid4().hex[:8]}")


# ---------------------------------------------------------------------------------------------
# Definitions, counting, metrics.


def test_plan_reads_the_space(tmp_path):
    plan = T.prepare(T.TuneJob(str(write(tmp_path))))
    kinds = {p.key: p.kind for p in plan.params}
    assert kinds == {"cache.tokens_per_block": "categorical", "cache.max_tokens": "int",
                     "cache.enable_partial_reuse": "categorical"}
    assert plan.study_name == "tiny-tune" and plan.n_trials == 10
    assert plan.storage_url == "sqlite:///results/tiny-tune-tune.db"


@pytest.mark.parametrize("tune_yaml, expected", [
    ("", "no tune: section"),
    ("tune:\n  space:\n    cache.max_tokens: {low: 1.5, high: 9}\n",
     "{f}:4:23: tune.space.cache.max_tokens: cache.max_tokens takes integers"),
    ("tune:\n  space:\n    cache.host_offload_ratio: {low: 0.0, high: 1.0}\n  sampler: grid\n",
     "{f}:4:31: tune.space.cache.host_offload_ratio: the grid sampler needs choices or a step"),
    ("tune:\n  space:\n    cache.add_sequence: {low: 0, high: 1}\n",
     "tune.space.cache.add_sequence: cache.add_sequence is not numeric"),
    ("tune:\n  space:\n    name: {choices: [a, b]}\n", "tune.space.name: name cannot be tuned"),
    ("variants:\n  - {name: a}\ntune:\n  space:\n    cache.max_tokens: {choices: [64]}\n",
     "{f}:3:3: variants: a workload with variants cannot be tuned"),
])
def test_plan_errors(tmp_path, tune_yaml, expected):
    path = write(tmp_path, "run: {mode: cache}\n" + tune_yaml if tune_yaml else "name: x\n")
    with pytest.raises(InputError) as info:
        T.prepare(T.TuneJob(str(path)))
    assert expected.format(f=path) in str(info.value)


def test_missing_objective_metric_stops_the_study(tmp_path):
    text = WORKLOAD.replace("metric: hit_rate,", "metric: ttft_ms.p99,")
    path = write(tmp_path, text)
    result = runner.invoke(app, ["tune", str(path), "--storage", f"sqlite:///{tmp_path}/m.db",
                                 "--set", "cache.max_tokens=4096", "--set",
                                 "tune.space={cache.tokens_per_block: {choices: [16]}}"])
    assert isinstance(result.exception, InputError)
    assert "tune.objectives[0].metric: metric ttft_ms.p99 is not produced" in str(
        result.exception)


def test_resuming_with_other_objectives_is_refused(tmp_path):
    path = write(tmp_path)
    plan = T.prepare(T.TuneJob(str(path), storage=f"sqlite:///{tmp_path}/o.db"))
    T.create_study(plan, T.open_storage(plan))
    other = T.prepare(T.TuneJob(str(path), ("tune.objectives=[{metric: evicted_blocks, "
                                            "direction: maximize}]",),
                                storage=f"sqlite:///{tmp_path}/o.db"))
    with pytest.raises(InputError, match="use --study NEW_NAME"):
        T.create_study(other, T.open_storage(other))
    changed = T.prepare(T.TuneJob(str(path), ("requests.synthetic.num_requests=70",),
                                  storage=f"sqlite:///{tmp_path}/o.db"))
    with pytest.raises(InputError, match="another configuration of the workload"):
        T.create_study(changed, T.open_storage(changed))


def test_metric_paths_and_constraint_values():
    from kvbench.config_tune import parse_constraint

    metrics = {"ttft_ms": {"p99": 1500.0}, "hit_rate": 0.5}
    assert T.metric_value(metrics, "ttft_ms.p99") == 1500.0
    with pytest.raises(KeyError):
        T.metric_value(metrics, "ttft_ms.p42")
    values = T.constraint_values(
        [parse_constraint(c) for c in ("ttft_ms.p99 <= 2000", "hit_rate >= 0.6",
                                       "hit_rate < 0.5", "hit_rate > 0.4")], metrics)
    assert values[0] == -500.0 and values[1] == pytest.approx(0.1) and values[2] > 0
    assert values[3] == pytest.approx(-0.1)


def test_storage_urls(tmp_path):
    plan = T.prepare(T.TuneJob(str(write(tmp_path)), storage="results/x.db"))
    with pytest.raises(InputError, match="expected an Optuna storage URL"):
        T.open_storage(plan)
    assert T.display_url("postgresql://u:secret@h:5/db") == "postgresql://u:***@h:5/db"
    assert T.lock_is_exact("journal:x.log") and T.lock_is_exact("postgresql://h/db")
    assert not T.lock_is_exact("oracle://h/db")
