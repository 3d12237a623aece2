"""The study plan: the tune job, its parameters, objectives and constraints, checked once
from the workload (`prepare`); a trial's workload and the metric values it is judged by."""

from __future__ import annotations

import dataclasses
import difflib
import hashlib
import json
import math
import re
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Literal, get_origin

from ..config import Workload, load_workload
from ..config_keys import key_annotation
from ..config_tune import Constraint, SpaceEntry, TuneConfig
from ..errors import InputError
from ..metrics import METRICS, metric

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    from optuna.trial import FrozenTrial


MAX_RETRY = 3
"""How often a lost trial (killed worker, Ctrl-C) is re-queued with the same parameters."""

WAIT_POLL_S = 0.5
"""How often a worker with nothing left to start checks the trials other workers are running."""

# `outcome` user attribute of a trial.
COMPLETE, INVALID, FAILED, INTERRUPTED, ABORTED = (
    "complete", "invalid", "failed", "interrupted", "aborted")
COUNTED_FAILURES = (INVALID, FAILED)

_METRIC_PATH = re.compile(r"[A-Za-z_]\w*(?:\.\w+)*")
_NOT_TUNABLE = ("name", "variants", "tune")


class TuneError(RuntimeError):
    """A runtime failure of the tuner (storage unreachable, workers died): exit code 1."""


@dataclasses.dataclass(frozen=True)
class TuneJob:
    """What the user asked for; picklable, so worker processes can rebuild the plan."""

    workload: str
    sets: tuple[str, ...] = ()
    n_trials: int | None = None
    storage: str | None = None
    study_name: str | None = None
    heartbeat_s: int = 10
    holdout: float | None = None
    """Tune on the first 1 - holdout of the requests; `holdout.holdout_runs` replays the rest."""


@dataclasses.dataclass
class Param:
    """One tuned workload key and how Optuna samples it."""

    key: str
    kind: str  # "categorical" | "int" | "float"
    entry: SpaceEntry
    encoded: bool = False  # categorical choices that are not scalars travel as JSON text

    @property
    def choices(self) -> list:
        assert self.entry.choices is not None
        if self.encoded:
            return [json.dumps(c, sort_keys=True) for c in self.entry.choices]
        return list(self.entry.choices)

    def suggest(self, trial: optuna.trial.Trial) -> Any:
        e = self.entry
        if self.kind == "categorical":
            return self.decode(trial.suggest_categorical(self.key, self.choices))
        if self.kind == "int":
            return trial.suggest_int(self.key, int(e.low), int(e.high), step=int(e.step or 1),
                                     log=e.log)
        return trial.suggest_float(self.key, float(e.low), float(e.high), step=e.step, log=e.log)

    def decode(self, stored: Any) -> Any:
        return json.loads(stored) if self.encoded else stored

    def grid(self) -> list | None:
        """Values for the grid sampler; None when the range is continuous."""
        e = self.entry
        if self.kind == "categorical":
            return self.choices
        if self.kind == "int":
            return list(range(int(e.low), int(e.high) + 1, int(e.step or 1)))
        if e.step is None:
            return None
        count = int(math.floor((e.high - e.low) / e.step + 1e-9)) + 1
        return [float(round(e.low + i * e.step, 12)) for i in range(count)]


@dataclasses.dataclass(frozen=True)
class HoldoutSplit:
    """`--holdout`: trials replay requests [0, tune_requests), the check [tune_requests, total)."""

    fraction: float
    tune_requests: int
    total_requests: int

    @property
    def tune_sets(self) -> tuple[str, ...]:
        return (f"requests.limit={self.tune_requests}",)

    @property
    def holdout_sets(self) -> tuple[str, ...]:
        return (f"requests.skip={self.tune_requests}",
                f"requests.limit={self.total_requests - self.tune_requests}")


@dataclasses.dataclass
class Plan:
    job: TuneJob
    workload: Workload
    tune: TuneConfig
    params: list[Param]
    storage_url: str
    study_name: str
    n_trials: int
    grid_size: int | None
    fingerprint: dict
    holdout: HoldoutSplit | None = None

    @property
    def metric_names(self) -> list[str]:
        return [o.metric for o in self.tune.objectives]

    @property
    def directions(self) -> list[str]:
        return [o.direction for o in self.tune.objectives]

    @property
    def constraints(self) -> list[Constraint]:
        return self.tune.parsed_constraints

    def decoded_params(self, trial: FrozenTrial) -> dict[str, Any]:
        return {p.key: p.decode(trial.params[p.key]) for p in self.params if p.key in trial.params}


def _at(wl: Workload, path: tuple, message: str) -> InputError:
    """An InputError located like config errors: `FILE:LINE:COL: dotted.path: message`."""
    location, _ = wl._origin.locate(path)
    dotted = ""
    for part in path:
        dotted += f"[{part}]" if isinstance(part, int) else (f".{part}" if dotted else part)
    return InputError(f"{location}: {dotted}: {message}" if location else f"{dotted}: {message}")


def _is_scalar(value: Any) -> bool:
    return value is None or isinstance(value, (bool, int, float, str))


def _integral(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) or (
        isinstance(value, float) and value.is_integer())


def _param(wl: Workload, key: str, entry: SpaceEntry) -> Param:
    where = ("tune", "space", key)
    if key.split(".")[0] in _NOT_TUNABLE:
        raise _at(wl, where, f"{key.split('.')[0]} cannot be tuned")
    if entry.choices is not None:
        return Param(key, "categorical", entry, encoded=not all(map(_is_scalar, entry.choices)))
    annotation = key_annotation(key)
    bounds = [v for v in (entry.low, entry.high, entry.step) if v is not None]
    if annotation is bool or annotation is str or get_origin(annotation) in (Literal, list, dict):
        raise _at(wl, where, f"{key} is not numeric; expected choices: [...]")
    if annotation is float:
        return Param(key, "float", entry)
    if annotation is int or all(isinstance(v, int) and not isinstance(v, bool) for v in bounds):
        if not all(map(_integral, bounds)):
            raise _at(wl, where, f"{key} takes integers; expected integer low, high and step "
                                 f"(got low={entry.low}, high={entry.high}, step={entry.step})")
        return Param(key, "int", entry)
    return Param(key, "float", entry)


def _check_values(job: TuneJob, wl: Workload, p: Param) -> None:
    """Each choice, and each end of a range, is a value the key takes: applied alone to the
    workload, as a trial would apply it. Only a complaint about the key itself counts: a value
    that clashes with another setting may still suit some trials, which are then invalid."""
    e = p.entry
    if e.choices is not None:
        where = [(("tune", "space", p.key, "choices", i), v) for i, v in enumerate(e.choices)]
    else:
        where = [(("tune", "space", p.key, end), getattr(e, end)) for end in ("low", "high")]
    for path, value in where:
        try:
            load_workload(job.workload, (*job.sets, f"{p.key}={json.dumps(value)}"))
        except InputError as exc:
            prefix = f"--set {p.key}: "
            if str(exc).startswith(prefix):
                raise _at(wl, path, f"not a value of {p.key}: "
                                    f"{str(exc).removeprefix(prefix)}") from None


def default_storage(name: str) -> str:
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name).strip("-") or "study"
    return f"sqlite:///results/{slug}-tune.db"


def _check_metric(wl: Workload, path: str, where: tuple) -> None:
    """An objective or constraint names a registered metric (whether this run produces it is
    known only once it ran: a trial's metric missing from its run stops the study)."""
    m = metric(path)
    if m is None:
        close = difflib.get_close_matches(path.split(".", 1)[0], METRICS, n=3)
        hint = f"; did you mean {' or '.join(close)}?" if close else ""
        raise _at(wl, where, f"unknown metric {path!r}{hint}")


def prepare(job: TuneJob) -> Plan:
    """Load and check the workload's `tune:` section; every problem is one InputError line.
    With `job.holdout`, the plan's job tunes on the first part of the requests only (so the
    worker processes, which rebuild the plan from it, need not split again)."""
    if job.holdout is not None:
        split = holdout_split(job)
        plan = prepare(dataclasses.replace(job, sets=job.sets + split.tune_sets, holdout=None))
        plan.holdout = split
        return plan
    wl = load_workload(job.workload, job.sets)
    if wl.tune is None:
        raise InputError(f"{job.workload}: no tune: section; add tune.space (dotted.key -> "
                         "{choices: [...]} or {low, high}) to tune this workload")
    if wl.variants:
        raise _at(wl, ("variants",), "a workload with variants cannot be tuned (each trial is "
                                     "one run); remove variants or tune a copy without them")
    tune = wl.tune
    for i, objective in enumerate(tune.objectives):
        if not _METRIC_PATH.fullmatch(objective.metric):
            raise _at(wl, ("tune", "objectives", i, "metric"),
                      f"expected a metric name like hit_rate or ttft_ms.p99 "
                      f"(got {objective.metric!r})")
    metrics = [o.metric for o in tune.objectives]
    if len(set(metrics)) != len(metrics):
        raise _at(wl, ("tune", "objectives"), f"each metric at most once (got {metrics})")
    params = [_param(wl, key, entry) for key, entry in tune.space.items()]
    for p in params:
        _check_values(job, wl, p)
    for i, name in enumerate(metrics):
        _check_metric(wl, name, ("tune", "objectives", i, "metric"))
    for i, c in enumerate(tune.parsed_constraints):
        _check_metric(wl, c.metric, ("tune", "constraints", i))
    n_trials = job.n_trials if job.n_trials is not None else tune.n_trials
    grid_size = None
    if tune.sampler == "grid":
        grid_size = 1
        for p in params:
            values = p.grid()
            if values is None:
                raise _at(wl, ("tune", "space", p.key),
                          "the grid sampler needs choices or a step for a float range")
            grid_size *= len(values)
        n_trials = min(n_trials, grid_size)
    storage = job.storage or default_storage(wl.name)
    base = json.dumps(wl.resolved_dict(), sort_keys=True, default=str)
    fingerprint = {
        "objectives": [[o.metric, o.direction] for o in tune.objectives],
        "constraints": list(tune.constraints),
        "space": {k: v.model_dump(exclude_none=True) for k, v in tune.space.items()},
        "base_sha256": hashlib.sha256(base.encode()).hexdigest(),
        "workload": str(job.workload),
    }
    return Plan(job, wl, tune, params, storage, job.study_name or wl.name, n_trials, grid_size,
                fingerprint)


def holdout_split(job: TuneJob) -> HoldoutSplit:
    """Where `--holdout` cuts the workload's request stream (counted by reading it once)."""
    from ..runner import count_workload_requests

    fraction = job.holdout
    if not 0 < fraction < 1:
        raise InputError(f"--holdout: expected a fraction between 0 and 1 (got {fraction})")
    wl = load_workload(job.workload, job.sets)
    if wl.requests.skip:
        raise InputError(f"{job.workload}: requests.skip: --holdout splits the stream itself; "
                         "remove requests.skip")
    total = count_workload_requests(wl)
    tune_requests = int(total * (1 - fraction))
    if not 0 < tune_requests < total:
        raise InputError(f"--holdout {fraction}: {total} requests leave none to "
                         f"{'tune on' if tune_requests == 0 else 'hold out'}")
    return HoldoutSplit(fraction, tune_requests, total)


def trial_workload(plan: Plan, params: dict[str, Any]) -> Workload:
    """The workload of one trial: the file, the user's --set, then the trial's values as --set
    overrides, so a trial is exactly `kvbench run FILE --set ...`."""
    sets = [*plan.job.sets, *(f"{k}={json.dumps(v)}" for k, v in params.items())]
    return load_workload(plan.job.workload, sets)


# --------------------------------------------------------------------------------------------
# Metrics, constraints, feasibility.


def metric_value(metrics: dict, path: str) -> Any:
    """`ttft_ms.p99` -> metrics["ttft_ms"]["p99"]; KeyError when absent."""
    node: Any = metrics
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            raise KeyError(path)
        node = node[part]
    return node


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return float(value)


def constraint_values(constraints: Sequence[Constraint], metrics: dict) -> list[float]:
    """Optuna's form: one value per constraint, <= 0 when satisfied."""
    values = []
    for c in constraints:
        v = float(metric_value(metrics, c.metric))
        diff = v - c.value if c.op in ("<=", "<") else c.value - v
        if c.op in ("<", ">") and diff == 0:
            diff = math.nextafter(0.0, 1.0)
        values.append(diff)
    return values


def is_feasible(plan: Plan, trial: FrozenTrial) -> bool:
    if "feasible" in trial.user_attrs:
        return bool(trial.user_attrs["feasible"])
    if not plan.constraints:
        return True
    try:
        return all(v <= 0 for v in constraint_values(plan.constraints, trial.user_attrs["metrics"]))
    except (KeyError, TypeError, ValueError):
        return False


def _constraints_func(plan: Plan) -> Callable[[FrozenTrial], Sequence[float]]:
    constraints = plan.constraints

    def func(trial: FrozenTrial) -> Sequence[float]:
        try:
            return constraint_values(constraints, trial.user_attrs["metrics"])
        except (KeyError, TypeError, ValueError):
            return [math.inf] * len(constraints)

    return func


# --------------------------------------------------------------------------------------------
# Storage, heartbeats, the study lock.
