"""Loaded request streams kept across runs (`runner.request_streams`): the trials of a tune study
load their requests once and, held in memory, reuse the block keys an earlier trial at the same
block size memoised; every metric but `wall_s` equals that of the configuration run alone, a
run changes nothing on its requests but their memos, the store keeps its bound and deletes a
dropped spilled trace's file, and a trace rewritten between runs is loaded again."""

from __future__ import annotations

import dataclasses

import numpy as np
import optuna
import pytest

import kvbench.runner as runner
from kvbench import tune as T
from kvbench.config import load_workload
from kvbench.errors import InputError
from kvbench.modes.common import References
from kvbench.traffic import Request, RequestList
from kvbench.traffic.spill import SpilledTrace
from test_references import _study as study_of

SYNTHETIC = ("{source: synthetic, synthetic: {num_requests: 60, num_users: 6, turns: 5,"
             " prompt_tokens: 96, system_prompt_tokens: 256, output_tokens: 40}}")
TRACE = "{source: trace, format: mooncake, path: t.jsonl}"
# Retention keeps a trace in memory (a spilled trace carries no per-request options).
TRACE_IN_MEMORY = ("{source: trace, format: mooncake, path: t.jsonl,"
                   " retention: {token_ranges: [{start: 0, end: 512, priority: 80}]}}")
BEAMS = ("{beam_widths: [1, 3], synthetic: {num_requests: 40, system_prompt_tokens: 64,"
         " prompt_tokens: 40, output_tokens: 24}}")

WORKLOAD = """\
name: streams
cache: {{tokens_per_block: 16, max_tokens: 8192, eviction_policy: slru}}
scheduler: {{max_num_tokens: 2048}}
requests: {requests}
run: {{mode: {mode}, progress: false}}
tune:
  sampler: grid
  seed: {seed}
  space:
{space}
  objectives:
    - {{metric: hit_rate, direction: maximize}}
"""


def _trace(path, n: int = 48, shared: int = 4) -> None:
    """A Mooncake trace of `n` prompts of 3 blocks (512 tokens each), `shared` first blocks."""
    path.write_text("".join(
        f'{{"timestamp": {i * 100}, "input_length": 1536, "output_length": 8, '
        f'"hash_ids": [{i % shared}, {i % shared + 10}, {i + 100}]}}\n' for i in range(n)))


def _write(tmp_path, requests: str, space: dict, mode: str = "cache", seed: int = 0):
    _trace(tmp_path / "t.jsonl")
    path = tmp_path / "w.yaml"
    path.write_text(WORKLOAD.format(requests=requests, mode=mode, seed=seed, space="".join(
        f"    {key}: {{choices: {values}}}\n" for key, values in space.items())))
    return path


def _without_wall(metrics: dict) -> dict:
    return {k: v for k, v in metrics.items() if k != "wall_s"}


def _memo_sizes(requests) -> set[int]:
    """Block sizes the requests hold memoised keys at (none for a spilled trace)."""
    if isinstance(requests, SpilledTrace):
        return set()
    return {tpb for r in requests for tpb in (*r._keys, *r._stream_keys, *r._firsts)}


class _Watch:
    """Counts loads and records each run: its requests, block size, the block sizes its
    requests held memos at when it began, and the worker's stream store's size."""

    def __init__(self, monkeypatch) -> None:
        self.loaded: list = []
        self.states: list = []  # each loaded list's requests' `_state`, as loaded
        self.runs: list[tuple] = []
        self.stores: list = []
        real_load, real_streams = runner._load, runner.request_streams

        def load(*a, **k):
            requests = real_load(*a, **k)
            self.loaded.append(requests)
            if isinstance(requests, RequestList):
                self.states.append([_state(r) for r in requests])
            return requests

        def streams(*a, **k):
            store = real_streams(*a, **k)
            self.stores.append(store)
            return store

        monkeypatch.setattr(runner, "_load", load)
        monkeypatch.setattr(runner, "request_streams", streams)
        for name in ("run_cache", "run_serve"):
            real = getattr(runner, name)

            def run(run_name, plan, requests, *a, _real=real):
                tpb = plan.workload.cache.tokens_per_block
                self.runs.append((requests, tpb, _memo_sizes(requests),
                                  [len(s) for s in self.stores]))
                return _real(run_name, plan, requests, *a)
            monkeypatch.setattr(runner, name, run)


def _study(path):
    """A grid study in this process; (plan, its complete trials in the order they ran)."""
    plan, _, trials = study_of(path)
    return plan, sorted(trials, key=lambda t: t.number)


def _alone(plan, params: dict) -> dict:
    return _without_wall(runner.run_workload(T.trial_workload(plan, params))[0].metrics)


@pytest.mark.parametrize("requests, mode, space", [
    (SYNTHETIC, "cache", {"cache.policy.slru.protected_ratio": [0.2, 0.8],
                          "cache.tokens_per_block": [16, 32]}),
    (SYNTHETIC, "serve", {"scheduler.batch_wait_timeout_iters": [0, 4],
                          "cache.tokens_per_block": [16, 32]}),
    (TRACE_IN_MEMORY, "cache", {"cache.admission": ["all", "second_use"],
                                "cache.tokens_per_block": [16, 64]}),
    (TRACE, "cache", {"cache.policy.slru.protected_ratio": [0.2, 0.8],
                      "cache.tokens_per_block": [16, 64]}),
    (BEAMS, "serve", {"cache.host_offload_ratio": [0.0, 1.0],
                      "cache.tokens_per_block": [8, 16]}),
], ids=["synthetic-cache", "synthetic-serve", "trace-in-memory", "trace-spilled", "beams-serve"])
def test_tune_trials_load_once_and_equal_runs_alone(tmp_path, monkeypatch, requests, mode,
                                                    space):
    """A study over a knob and the block size loads its requests once; a trial keeps the
    previous trial's memos when it has its block size and begins without any otherwise; each
    trial's metrics equal its configuration run alone."""
    watch = _Watch(monkeypatch)
    plan, trials = _study(_write(tmp_path, requests, space, mode))
    assert len(watch.loaded) == 1 and len(watch.runs) == len(trials) == 4
    kept = watch.loaded[0]
    assert all(run[0] is kept for run in watch.runs)
    spilled = requests == TRACE
    assert isinstance(kept, SpilledTrace) == spilled
    same = []
    for (_, tpb, memos, _), (_, before, _, _) in zip(watch.runs[1:], watch.runs):
        same.append(tpb == before)
        assert memos == (set() if spilled or tpb != before else {tpb}), (tpb, before, memos)
    assert True in same and False in same  # the grid order covers both cases
    for trial in trials:
        params = plan.decoded_params(trial)
        assert _without_wall(trial.user_attrs["metrics"]) == _alone(plan, params), params
    if spilled:
        assert not kept.ids_path.exists()  # the worker deleted it when it was done


def test_a_study_over_the_requests_keeps_one_stream(tmp_path, monkeypatch):
    """A space that changes the requests (their number and the seed): a trial loads them
    again only when they differ from the previous trial's, the worker holds one stream at a
    time (a dropped spilled trace's file deleted) and each trial equals its run alone."""
    watch = _Watch(monkeypatch)
    path = _write(tmp_path, TRACE, {"requests.limit": [30, 40], "run.seed": [0, 1],
                                    "cache.tokens_per_block": [16, 64]})
    plan, trials = _study(path)
    params = [plan.decoded_params(t) for t in trials]
    sources = [(p["requests.limit"], p["run.seed"]) for p in params]  # the seed reads it too
    reloads = 1 + sum(a != b for a, b in zip(sources[1:], sources))
    assert 1 < len(watch.loaded) == reloads < len(trials)
    assert all(sizes == [1] for *_, sizes in watch.runs)
    alive = [s for s in watch.loaded if s.ids_path.exists()]
    assert alive == []
    for run, (requests, *_) in zip(params, watch.runs):
        assert len(requests) == run["requests.limit"]
    for trial, p in zip(trials, params):
        assert _without_wall(trial.user_attrs["metrics"]) == _alone(plan, p), p


def test_holdout_runs_share_the_held_out_stream(tmp_path, monkeypatch):
    """`--holdout`: the trials load the tuned part once, the two held-out runs the rest once;
    the worker's and the held-out runs' spilled files are deleted when they are done."""
    watch = _Watch(monkeypatch)
    path = _write(tmp_path, TRACE, {"cache.policy.slru.protected_ratio": [0.2, 0.8]})
    plan = T.prepare(T.TuneJob(str(path), n_trials=2, holdout=0.25,
                               storage=f"sqlite:///{tmp_path / 'study.db'}"))
    storage = T.open_storage(plan)
    T.create_study(plan, storage)
    assert T.run_worker(plan, storage=storage) == "done"
    best = optuna.load_study(study_name=plan.study_name, storage=storage).best_trial
    runs = T.holdout_runs(plan, best)
    tuned, held_out = watch.loaded  # the split counted the stream without loading it
    assert (len(tuned), len(held_out)) == (36, 12)
    assert [r[0] for r in watch.runs] == [tuned] * 2 + [held_out] * 2
    assert not tuned.ids_path.exists() and not held_out.ids_path.exists()
    for run in runs:
        sets = ["requests.skip=36", "requests.limit=12",
                *(f"{k}={v}" for k, v in run.params.items())]
        fresh = runner.run_workload(load_workload(path, sets))[0].metrics
        assert _without_wall(run.held_out) == _without_wall(fresh), run.label


@pytest.mark.parametrize("requests", [TRACE, TRACE_IN_MEMORY, SYNTHETIC])
@pytest.mark.parametrize("sets", [[], ["requests.limit=30"], ["requests.skip=40"],
                                  ["requests.skip=10", "requests.limit=500"]])
def test_counting_the_requests_loads_nothing_and_equals_the_loaded_stream(
        tmp_path, monkeypatch, requests, sets):
    path = _write(tmp_path, requests, {"cache.policy.slru.protected_ratio": [0.5]})
    watch = _Watch(monkeypatch)
    wl = load_workload(path, sets)
    counted = runner.count_workload_requests(wl)
    streamed = requests != SYNTHETIC and not any(s.startswith("requests.skip") for s in sets)
    assert (watch.loaded == []) == streamed  # a trace is read, not loaded
    assert counted == len(runner.load_workload_requests(wl))


def test_counting_an_empty_trace_says_so(tmp_path):
    wl = load_workload(_write(tmp_path, TRACE, {"cache.policy.slru.protected_ratio": [0.5]}))
    (tmp_path / "t.jsonl").write_text("")
    with pytest.raises(InputError, match="requests: the request stream is empty"):
        runner.count_workload_requests(wl)


def test_stream_store_bound_and_release():
    """At most `max_entries` streams, the least recently used dropped first and released
    (a spilled trace's file deleted); `clear` releases the rest."""
    def spilled(n: int) -> SpilledTrace:
        return SpilledTrace(iter([Request(i, float(i), 1024, 4, hash_ids=np.array([i, i + 1]))
                                  for i in range(n)]))

    store = runner.request_streams(2)
    a, b, c = spilled(2), spilled(3), spilled(4)
    assert store.once("a", lambda: a) is a and store.once("b", lambda: b) is b
    assert store.once("a", lambda: spilled(9)) is a  # kept; now the most recent
    assert store.once("c", lambda: c) is c
    assert len(store) == 2 and not b.ids_path.exists()
    assert a.ids_path.exists() and c.ids_path.exists()
    store.clear()
    assert len(store) == 0 and not a.ids_path.exists() and not c.ids_path.exists()
    memory = RequestList([Request(0, 0.0, 32, 1, tokens=np.arange(32))])
    store.once("m", lambda: memory)
    store.clear()  # nothing to delete for a list in memory


@pytest.mark.parametrize("requests", [TRACE, TRACE_IN_MEMORY])
def test_a_trace_rewritten_between_runs_is_loaded_again(tmp_path, monkeypatch, requests):
    """The stream store names a trace by its file (`request_source`): a trace rewritten
    between two runs sharing the stores (same path, same workload) is loaded again, and the
    second run equals a fresh one on the new trace."""
    watch = _Watch(monkeypatch)
    path = _write(tmp_path, requests, {"cache.admission": ["all"]})
    streams, references = runner.request_streams(1), References()
    first = runner.run_workload(load_workload(path), references=references,
                                streams=streams)[0].metrics
    _trace(tmp_path / "t.jsonl", n=48, shared=2)  # same size, more sharing
    second = runner.run_workload(load_workload(path), references=references,
                                 streams=streams)[0].metrics
    assert len(watch.loaded) == 2 and len(streams) == 1
    fresh = runner.run_workload(load_workload(path))[0].metrics
    assert _without_wall(second) == _without_wall(fresh)
    assert second["hit_rate"] != first["hit_rate"]
    if requests == TRACE:
        assert not watch.loaded[0].ids_path.exists()
    streams.clear()


def _state(r: Request) -> dict:
    """Everything a request carries but its memos (copies of its arrays)."""
    out = {}
    for f in dataclasses.fields(r):
        if f.name.startswith("_"):
            continue
        v = getattr(r, f.name)
        out[f.name] = (v.copy() if isinstance(v, np.ndarray)
                       else _state(v) if isinstance(v, Request) else v)
    return out


def _equal(a, b) -> bool:
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_equal(a[k], b[k]) for k in a)
    if isinstance(a, np.ndarray):
        return isinstance(b, np.ndarray) and a.dtype == b.dtype and np.array_equal(a, b)
    return a == b


@pytest.mark.parametrize("requests, mode, sets", [
    (SYNTHETIC, "cache", ["cache.enable_partial_reuse=true", "cache.host_offload_ratio=1.0"]),
    (SYNTHETIC, "serve", ["cache.host_offload_ratio=1.0", "speculative.max_draft_len=3",
                          "speculative.acceptance_rate=0.6"]),
    (BEAMS, "serve", ["model.attention_window=32"]),
    (TRACE_IN_MEMORY, "serve", ["cache.max_tokens=2048"]),
    ("{encoder: {tokens: 100, distinct_inputs: 3, fraction: 0.5}, synthetic: {num_requests: 30,"
     " system_prompt_tokens: 20, prompt_tokens: 12, output_tokens: 6}}", "serve",
     ["cache.cross_kv_cache_fraction=0.5"]),
], ids=["cache", "serve-speculative", "beams-windowed", "trace-retention", "encoder"])
def test_a_run_changes_nothing_on_its_requests_but_their_memos(tmp_path, monkeypatch,
                                                               requests, mode, sets):
    """What makes a kept stream safe to replay again: after a run every request carries what
    it was loaded with (its memos are pure functions of it and the block size)."""
    watch = _Watch(monkeypatch)
    path = _write(tmp_path, requests, {"cache.admission": ["all"]}, mode)
    wl = load_workload(path, sets)
    streams = runner.request_streams(1)
    runner.run_workload(wl, streams=streams)  # loads
    kept, = watch.loaded
    assert isinstance(kept, RequestList)
    before, = watch.states
    runner.run_workload(wl, streams=streams)
    runner.run_workload(load_workload(path, [*sets, "cache.tokens_per_block=32"]),
                        streams=streams)
    assert len(watch.loaded) == 1
    assert all(_equal(_state(r), b) for r, b in zip(kept, before))
