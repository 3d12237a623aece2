"""Running a study: creating or resuming it, samplers, the objective (one `kvbench run` per
trial), re-queueing lost trials, worker processes."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import math
import os
import signal
import socket
import sys
import time
import warnings
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from ..errors import InputError
from .plan import (ABORTED, COMPLETE, COUNTED_FAILURES, FAILED, INTERRUPTED, INVALID, Plan, TuneJob,
                   WAIT_POLL_S, _at, _constraints_func, _number, constraint_values, metric_value,
                   prepare, trial_workload)
from .storage import (_StudyLock, _quiet_optuna, _retry_callback, display_url, open_storage,
                      study_lock)
from .summary import tally

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    from optuna.trial import FrozenTrial


REFERENCE_ENTRIES = 64
"""Reference results (`modes.common.References`) a worker keeps across its trials. A trial
reuses one when an earlier trial had the same requests and everything the reference reads
(block size, capacity, reuse rules; for the LRU reference the whole cache configuration but
the policy and admission), so a study that tunes a policy, its admission or the scheduler
computes them once, and one over block sizes and capacities once per point it revisits. An
entry is a few numbers and a key of a few KB (the LRU reference's holds the workload's JSON),
so 64 take well under 1 MB; the bound keeps a long study over a continuous capacity range,
whose points never repeat, from growing the store with its trial count, and 64 still holds
both references of 32 (block size, capacity) points, more than a categorical space of them
usually has."""

STREAM_ENTRIES = 1
"""Loaded request streams (`runner.request_streams`) a worker keeps across its trials: the
last one. Trials of one study replay one stream (unless the space changes the requests or
the seed), and a trial that reuses it skips reading and checking the trace (or generating
the synthetic requests) and, for a stream held in memory, computing the block keys at a
block size the previous trial used. What stays between trials is at most what the last
trial held at its end: for the Mooncake conversation trace in memory about 12 MiB of
requests and 195 MiB of memos at tokens_per_block 64 (750 MiB at 16); spilled (the usual
cache-mode case) 0.3 MiB and its 2.2 MiB file. One entry, so holding them never doubles
that."""


class _TrialFailed(Exception):
    """Raised by the objective after recording why a trial failed; Optuna marks it FAIL and
    the study goes on (it is in `catch`)."""


# --------------------------------------------------------------------------------------------
# The plan: what to tune, where the study lives.


def _fail_stale(study: optuna.Study) -> None:
    import optuna

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optuna.storages.fail_stale_trials(study)


def create_study(plan: Plan, storage) -> tuple[optuna.Study, list[str]]:
    """Create the study, or load it and check that it is the same study; returns the study and
    notes for the user (resumed, space changed)."""
    import optuna

    _quiet_optuna()
    study = optuna.create_study(storage=storage, study_name=plan.study_name,
                                directions=plan.directions, load_if_exists=True)
    notes: list[str] = []
    where = f"study {plan.study_name!r} in {display_url(plan.storage_url)}"
    hint = "use --study NEW_NAME for a new study (or delete the storage)"
    wanted = [optuna.study.StudyDirection.MAXIMIZE if d == "maximize"
              else optuna.study.StudyDirection.MINIMIZE for d in plan.directions]
    if list(study.directions) != wanted:
        raise InputError(f"{where} has {len(study.directions)} objective(s) "
                         f"{[d.name.lower() for d in study.directions]}; this workload asks for "
                         f"{plan.fingerprint['objectives']}; {hint}")
    recorded = study.user_attrs.get("kvbench")
    if recorded is None:
        study.set_user_attr("kvbench", plan.fingerprint)
        if study.metric_names is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                study.set_metric_names(plan.metric_names)
        return study, notes
    if recorded.get("objectives") != plan.fingerprint["objectives"]:
        raise InputError(f"{where} optimizes {recorded.get('objectives')}; this workload asks "
                         f"for {plan.fingerprint['objectives']}; {hint}")
    if recorded.get("base_sha256") != plan.fingerprint["base_sha256"]:
        raise InputError(f"{where} was run on another configuration of the workload (the file "
                         f"or --set changed outside tune:); {hint}")
    if recorded.get("space") != plan.fingerprint["space"]:
        notes.append("the search space changed since the study began; earlier trials stay")
    if recorded.get("constraints") != plan.fingerprint["constraints"]:
        notes.append("the constraints changed since the study began; feasibility is re-checked "
                     "with the new ones")
    return study, notes


def worker_seed(seed: int | None, worker: int, existing: int) -> int | None:
    """The sampler seed of one worker: the study's seed for a fresh single-worker study (same
    seed, same trials); derived from it for other workers and for resumed studies, so they do
    not replay the first trials' random draws."""
    if seed is None:
        return None
    if worker == 0 and existing == 0:
        return seed
    digest = hashlib.sha256(f"{seed}/{worker}/{existing}".encode()).digest()
    return int.from_bytes(digest[:4], "big")


def make_sampler(plan: Plan, seed: int | None):
    import optuna

    cf = _constraints_func(plan) if plan.constraints else None
    name = plan.tune.sampler
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if name == "tpe":
            return optuna.samplers.TPESampler(seed=seed, constraints_func=cf, multivariate=True)
        if name == "nsgaii":
            population = max(4, min(50, plan.n_trials // 5))
            return optuna.samplers.NSGAIISampler(population_size=population, seed=seed,
                                                 constraints_func=cf)
        if name == "gp":
            import importlib.util

            if importlib.util.find_spec("scipy") is None:
                raise _at(plan.workload, ("tune", "sampler"),
                          "the gp sampler needs scipy (pip install scipy)")
            return optuna.samplers.GPSampler(seed=seed, constraints_func=cf)
        if name == "random":
            return optuna.samplers.RandomSampler(seed=seed)
        grid = {p.key: p.grid() for p in plan.params}
        # Every worker shuffles the grid alike: the grid sampler maps trial numbers to points.
        return optuna.samplers.GridSampler(grid, seed=plan.tune.seed)


def worker_id() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


class _Objective:
    """One trial: suggest, build the workload, run it, record everything as user attributes."""

    def __init__(self, plan: Plan, lock: _StudyLock) -> None:
        self.plan = plan
        self.lock = lock
        self.current: int | None = None
        self.worker = worker_id()
        from ..modes.common import References
        from ..runner import request_streams

        self.references = References(REFERENCE_ENTRIES)
        self.streams = request_streams(STREAM_ENTRIES)

    def __call__(self, trial: optuna.trial.Trial) -> list[float]:
        self.lock.release()  # the trial exists: other workers may count it now
        self.current = trial.number
        plan = self.plan
        t0 = time.perf_counter()
        timing = {"worker": self.worker}
        try:
            params = {p.key: p.suggest(trial) for p in plan.params}
            timing["sample_s"] = time.perf_counter() - t0
            wl = trial_workload(plan, params)
            t1 = time.perf_counter()
            timing["config_s"] = t1 - t0 - timing["sample_s"]
            from ..runner import run_workload

            outcome = run_workload(wl, references=self.references, streams=self.streams)[0]
            timing["run_s"] = time.perf_counter() - t1
        except KeyboardInterrupt:
            with contextlib.suppress(BaseException):
                self._record(trial, INTERRUPTED, "interrupted (Ctrl-C)", timing)
            raise
        except InputError as exc:
            # PRUNED, not FAIL: Optuna's TPE ignores failed trials but ranks pruned ones below
            # every complete one, so it learns to stay out of invalid regions of the space.
            self._record(trial, INVALID, str(exc), timing)
            import optuna

            raise optuna.TrialPruned(str(exc)) from None
        except Exception as exc:  # noqa: BLE001 - any run failure is recorded, the study goes on
            self._record(trial, FAILED, f"{type(exc).__name__}: {exc}", timing)
            raise _TrialFailed(str(exc)) from None
        metrics = outcome.metrics
        values = []
        for i, objective in enumerate(plan.tune.objectives):
            values.append(self._value(trial, metrics, objective.metric,
                                      ("tune", "objectives", i, "metric"), timing))
        for i, c in enumerate(plan.constraints):
            self._value(trial, metrics, c.metric, ("tune", "constraints", i), timing)
        trial.set_user_attr("metrics", metrics)
        if plan.constraints:
            feasible = all(v <= 0 for v in constraint_values(plan.constraints, metrics))
            trial.set_user_attr("feasible", feasible)
        bad = next((v for v in values if not math.isfinite(v)), None)
        if bad is not None:
            self._record(trial, FAILED, f"an objective is {bad}", timing)
            raise _TrialFailed("non-finite objective")
        trial.set_user_attr("outcome", COMPLETE)
        trial.set_user_attr("kvbench", timing)
        return values

    def _value(self, trial, metrics: dict, path: str, where: tuple, timing: dict) -> float:
        try:
            number = _number(metric_value(metrics, path))
        except KeyError:
            number = None
            available = ", ".join(k for k, v in metrics.items()
                                  if _number(v) is not None or isinstance(v, dict))
            message = (f"metric {path} is not produced by this run (run.mode "
                       f"{self.plan.workload.run.mode}); numeric metrics: {available}")
        else:
            message = f"metric {path} is not a number (got {metric_value(metrics, path)!r})"
        if number is not None:
            return number
        self._record(trial, ABORTED, message, timing)
        raise _at(self.plan.workload, where, message)

    @staticmethod
    def _record(trial, outcome: str, reason: str, timing: dict) -> None:
        trial.set_user_attr("outcome", outcome)
        trial.set_user_attr("reason", reason)
        trial.set_user_attr("kvbench", timing)


def _requeue(study: optuna.Study, number: int | None) -> None:
    """Queue a lost trial again with the same parameters (as for a stale heartbeat)."""
    from optuna.trial import TrialState

    if number is None:
        return
    with contextlib.suppress(Exception):
        trial = next(t for t in study.get_trials(deepcopy=False) if t.number == number)
        if trial.state == TrialState.FAIL and trial.user_attrs.get("outcome") not in \
                COUNTED_FAILURES:
            _retry_callback()(study, trial)


Update = Callable[[Sequence["FrozenTrial"], int], None]
"""on_update(trials, waiting_for): the worker's view of the study before each step."""


def run_worker(plan: Plan, index: int = 0, *, storage=None,
               on_update: Update | None = None) -> str:
    """Run trials until the study holds plan.n_trials that count and none is running.
    Returns "done" or "interrupted" (Ctrl-C: the current trial is recorded and re-queued)."""
    import optuna

    _quiet_optuna()
    storage = storage if storage is not None else open_storage(plan)
    study = optuna.load_study(study_name=plan.study_name, storage=storage,
                              sampler=optuna.samplers.RandomSampler())
    existing = len(study.get_trials(deepcopy=False))
    study.sampler = make_sampler(plan, worker_seed(plan.tune.seed, index, existing))
    lock = study_lock(plan)
    objective = _Objective(plan, lock)
    try:
        while True:
            lock.acquire()
            try:
                _fail_stale(study)
                trials = study.get_trials(deepcopy=False)
                counts = tally(plan, trials)
                if on_update is not None:
                    on_update(trials, 0)
                if counts.used < plan.n_trials or counts.waiting:
                    objective.current = None
                    study.optimize(objective, n_trials=1, catch=(_TrialFailed,))
                    continue
            finally:
                lock.release()
            if counts.running == 0:
                if on_update is not None:
                    on_update(study.get_trials(deepcopy=False), 0)
                return "done"
            if on_update is not None:
                on_update(trials, counts.running)
            time.sleep(WAIT_POLL_S)
    except KeyboardInterrupt:
        with contextlib.suppress(BaseException):
            _requeue(study, objective.current)
        return "interrupted"
    finally:
        objective.streams.clear()
        lock.close()


# --------------------------------------------------------------------------------------------
# Several worker processes.


def _interrupt_once(signum, frame):  # noqa: ARG001
    """First SIGINT/SIGTERM: stop like Ctrl-C; later ones: ignored, so recording the
    interrupted trial is not cut short."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


def _worker_main(job: TuneJob, index: int, queue) -> None:
    signal.signal(signal.SIGINT, _interrupt_once)
    signal.signal(signal.SIGTERM, _interrupt_once)
    try:
        status = run_worker(prepare(job), index)
    except KeyboardInterrupt:
        status = "interrupted"
    except InputError as exc:
        queue.put((index, "input", str(exc)))
        sys.exit(2)
    except Exception as exc:  # noqa: BLE001
        queue.put((index, "error", f"{type(exc).__name__}: {exc}"))
        sys.exit(1)
    queue.put((index, status, None))
    sys.exit(130 if status == "interrupted" else 0)


@dataclasses.dataclass
class WorkersResult:
    interrupted: bool
    input_errors: list[str]
    errors: list[str]


def run_workers(plan: Plan, workers: int, poll: Callable[[], None],
                poll_s: float = 0.5) -> WorkersResult:
    """Start `workers` processes on the study and call `poll` until they end. Ctrl-C is passed
    on to them; they record their trials and stop."""
    import multiprocessing as mp

    job = dataclasses.replace(plan.job, n_trials=plan.n_trials, storage=plan.storage_url,
                              study_name=plan.study_name)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_worker_main, args=(job, i, queue), name=f"kvbench-tune-{i}")
             for i in range(workers)]
    interrupted = False
    for p in procs:
        p.start()
    try:
        while any(p.is_alive() for p in procs):
            poll()
            time.sleep(poll_s)
    except KeyboardInterrupt:
        interrupted = True
        for p in procs:
            if p.is_alive() and p.pid is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGINT)
        deadline = time.monotonic() + 60
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        for p in procs:
            if p.is_alive():
                p.terminate()
                p.join(5)
    for p in procs:
        p.join()
    messages = []
    while True:
        try:
            messages.append(queue.get(timeout=0.2))
        except Exception:  # noqa: BLE001 - queue.Empty
            break
    input_errors = sorted({m for _, kind, m in messages if kind == "input"})
    errors = sorted({m for _, kind, m in messages if kind == "error"})
    reported = {i for i, _, _ in messages}
    for i, p in enumerate(procs):
        if i not in reported and p.exitcode not in (0, 130, -signal.SIGINT):
            errors.append(f"worker {i} exited with code {p.exitcode}")
    interrupted = interrupted or any(kind == "interrupted" for _, kind, _ in messages)
    return WorkersResult(interrupted, input_errors, errors)


# --------------------------------------------------------------------------------------------
# Results: the Pareto front, the best trial, the exported workload.
