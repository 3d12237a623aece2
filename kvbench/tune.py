"""`kvbench tune`: an Optuna study over workload keys (DESIGN.md section 2, issue 7).

A trial is `kvbench run WORKLOAD --set ... --set key=value` for the trial's parameters: the
workload file is loaded with the user's overrides and the trial's values applied as `--set`
overrides, validated like any run, and run by `run_workload`. Its objectives and constraints are
metrics of that run (`ttft_ms.p99` addresses a nested metric).

Trial budget (`--trials N` is the study's total, not "N more"). A worker starts a new trial only
while the study holds fewer than N trials that count, and it checks and asks under a study lock
(a file lock for SQLite and journal files, an advisory lock on PostgreSQL and MySQL), so any
number of workers, on any number of machines, stop at exactly N. A trial counts when it is

  - complete (feasible or not), pruned, running or waiting (queued), or
  - failed *because of its parameters*: `outcome` = `invalid` (the configuration was rejected,
    e.g. a block size larger than the cache; recorded as PRUNED so that TPE avoids the region)
    or `failed` (the run raised; FAIL), since running the same parameters again would fail
    again.

A trial does not count when it was lost: its worker was killed (heartbeat stale), interrupted
(Ctrl-C) or the study aborted. Such a trial is re-queued with the same parameters (at most
`MAX_RETRY` times), and the queued copy counts. When the budget is used up but other workers'
trials are still running, a worker waits for them (failing and re-running any that go stale), so
a study left by a killed process is completed by the next `kvbench tune`.

Heartbeats: RDB storages (SQLite, PostgreSQL, MySQL) use Optuna's heartbeat; journal files use
the same mechanism through `_HeartbeatJournalStorage` (the journal backend has none of its own).

optuna, sqlalchemy and matplotlib are imported lazily: `import kvbench` must stay light.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import hashlib
import json
import math
import os
import re
import signal
import socket
import sys
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, get_origin

from .config import (Constraint, SpaceEntry, TuneConfig, Workload, key_annotation, load_workload,
                     resolve_path)
from .errors import InputError
from .metrics import METRICS, metric

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


class _TrialFailed(Exception):
    """Raised by the objective after recording why a trial failed; Optuna marks it FAIL and
    the study goes on (it is in `catch`)."""


# --------------------------------------------------------------------------------------------
# The plan: what to tune, where the study lives.


@dataclasses.dataclass(frozen=True)
class TuneJob:
    """What the user asked for; picklable, so worker processes can rebuild the plan."""

    workload: str
    sets: tuple[str, ...] = ()
    n_trials: int | None = None
    storage: str | None = None
    study_name: str | None = None
    heartbeat_s: int = 10


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
    """Load and check the workload's `tune:` section; every problem is one InputError line."""
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


def _quiet_optuna() -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.ERROR)
    warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)
    warnings.filterwarnings("ignore", category=FutureWarning, module="optuna")


def _retry_callback() -> Callable:
    from optuna import storages

    cls = getattr(storages, "RetryHeartbeatStaleTrialCallback", None) \
        or storages.RetryFailedTrialCallback  # optuna < 4.9
    return cls(max_retry=MAX_RETRY)


def display_url(url: str) -> str:
    """The storage URL without its password."""
    if url.startswith("journal:") or "://" not in url:
        return url
    try:
        from sqlalchemy.engine import make_url

        return make_url(url).render_as_string(hide_password=True)
    except Exception:  # noqa: BLE001 - only for display
        return re.sub(r"//([^:/@]+):[^@]*@", r"//\1:***@", url)


def _journal_storage_class():
    from optuna.storages import JournalStorage
    from optuna.storages._heartbeat import BaseHeartbeat
    from optuna.trial import TrialState

    class _HeartbeatJournalStorage(JournalStorage, BaseHeartbeat):
        """A journal file with Optuna's heartbeat protocol (the journal backend has none): the
        heartbeat is a trial system attribute holding the writer's clock, so it suits workers on
        one machine, which is what a journal file is for."""

        KEY = "kvbench:heartbeat"

        def __init__(self, backend, interval: int, grace: int, callback) -> None:
            super().__init__(backend)
            self._interval, self._grace, self._callback = interval, grace, callback

        def record_heartbeat(self, trial_id: int) -> None:
            try:
                self.set_trial_system_attr(trial_id, self.KEY, time.time())
            except Exception:  # noqa: BLE001 - failed as stale by another worker meanwhile
                pass

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            now = time.time()
            stale = []
            for t in self.get_all_trials(study_id, deepcopy=False, states=(TrialState.RUNNING,)):
                last = t.system_attrs.get(self.KEY)
                if last is None and t.datetime_start is not None:
                    last = t.datetime_start.timestamp()
                if last is not None and now - last > self._grace:
                    stale.append(t._trial_id)
            return stale

        def get_heartbeat_interval(self) -> int | None:
            return self._interval

        def get_heartbeat_stale_trial_callback(self):
            return self._callback

        def get_failed_trial_callback(self):  # optuna < 4.9
            return self._callback

    return _HeartbeatJournalStorage


def open_storage(plan: Plan):
    """The study's Optuna storage, with heartbeats and re-queueing of stale trials."""
    _quiet_optuna()
    url = plan.storage_url
    interval = plan.job.heartbeat_s
    grace = 3 * interval
    if url.startswith("journal:"):
        from optuna.storages.journal import JournalFileBackend

        path = Path(url[len("journal:"):]).expanduser()
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            backend = JournalFileBackend(str(path))
        except OSError as exc:
            raise TuneError(f"cannot open journal {path}: {exc.strerror or exc}") from None
        return _journal_storage_class()(backend, interval, grace, _retry_callback())
    if "://" not in url:
        raise InputError(f"--storage {url}: expected an Optuna storage URL (sqlite:///FILE, "
                         "postgresql://USER@HOST/DB, ...) or journal:PATH")
    import sqlalchemy.exc
    from optuna.storages import RDBStorage

    engine_kwargs: dict = {}
    if url.startswith("sqlite:"):
        from sqlalchemy.engine import make_url

        database = make_url(url).database
        if database and database != ":memory:":
            path = Path(database).expanduser()
            path.parent.mkdir(parents=True, exist_ok=True)
            engine_kwargs = {"creator": _sqlite_creator(str(path))}
        else:
            engine_kwargs = {"connect_args": {"timeout": 60}}
    kwargs = dict(engine_kwargs=engine_kwargs, heartbeat_interval=interval, grace_period=grace)
    callback = _retry_callback()
    last: Exception | None = None
    for attempt in range(3):  # workers starting together may race to create the tables
        try:
            try:
                return RDBStorage(url, heartbeat_stale_trial_callback=callback, **kwargs)
            except TypeError:  # optuna < 4.9
                return RDBStorage(url, failed_trial_callback=callback, **kwargs)
        except ImportError as exc:
            cause = exc.__cause__ or exc
            hint = (" (pip install 'psycopg[binary]' for postgresql://, or psycopg2-binary for "
                    "postgresql+psycopg2://)" if "postgres" in url else "")
            raise TuneError(f"--storage {display_url(url)}: no database driver: {cause}{hint}"
                            ) from None
        except sqlalchemy.exc.ArgumentError as exc:
            raise InputError(f"--storage {display_url(url)}: {exc}") from None
        except sqlalchemy.exc.SQLAlchemyError as exc:
            last = exc
            time.sleep(0.5 * (attempt + 1))
    detail = " ".join(str(getattr(last, "orig", None) or last).split())
    raise TuneError(f"cannot open storage {display_url(url)}: {detail}")


def _sqlite_creator(path: str) -> Callable:
    """SQLite connections in WAL mode with synchronous=NORMAL: a commit is a write, not an
    fsync (about 6 ms each here, and a trial makes a dozen), and readers such as
    optuna-dashboard or other workers do not block writers. A crash loses no committed trial
    that a later commit followed; a power cut may lose the last few."""
    import sqlite3

    def connect():
        conn = sqlite3.connect(path, timeout=60, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        return conn

    return connect


class _StudyLock:
    """Serialises "count the study's trials, then ask for one" across workers. `release` may
    be called early (the objective does, once its trial exists) and again harmlessly."""

    exact = True

    def __init__(self) -> None:
        self._held = False

    def acquire(self) -> None:
        self._acquire()
        self._held = True

    def release(self) -> None:
        if self._held:
            self._held = False
            self._release()

    def close(self) -> None:
        self.release()

    def _acquire(self) -> None:
        pass

    def _release(self) -> None:
        pass


class _ThreadLock(_StudyLock):
    def __init__(self) -> None:
        super().__init__()
        self._lock = threading.Lock()

    def _acquire(self) -> None:
        self._lock.acquire()

    def _release(self) -> None:
        self._lock.release()


class _FileLock(_StudyLock):
    """flock on a lock file of the database or journal: every process on the machine."""

    def __init__(self, path: Path) -> None:
        super().__init__()
        self._file = open(path, "a+")  # noqa: SIM115 - held for the worker's life

    def _acquire(self) -> None:
        import fcntl

        fcntl.flock(self._file.fileno(), fcntl.LOCK_EX)

    def _release(self) -> None:
        import fcntl

        fcntl.flock(self._file.fileno(), fcntl.LOCK_UN)

    def close(self) -> None:
        super().close()
        self._file.close()


class _SqlLock(_StudyLock):
    """A database session lock (PostgreSQL advisory lock, MySQL GET_LOCK) on a connection of
    its own; the server drops it if the worker dies."""

    def __init__(self, url: str, dialect: str, name: str) -> None:
        super().__init__()
        import sqlalchemy
        from sqlalchemy.pool import NullPool

        self._engine = sqlalchemy.create_engine(url, poolclass=NullPool)
        self._conn = self._engine.connect().execution_options(isolation_level="AUTOCOMMIT")
        text = sqlalchemy.text
        if dialect == "postgresql":
            key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "big", signed=True)
            self._lock_sql = (text("SELECT pg_advisory_lock(:k)"), {"k": key})
            self._unlock_sql = (text("SELECT pg_advisory_unlock(:k)"), {"k": key})
        else:
            key = "kvbench:" + hashlib.sha256(name.encode()).hexdigest()[:48]
            self._lock_sql = (text("SELECT GET_LOCK(:k, -1)"), {"k": key})
            self._unlock_sql = (text("SELECT RELEASE_LOCK(:k)"), {"k": key})

    def _acquire(self) -> None:
        self._conn.execute(*self._lock_sql)

    def _release(self) -> None:
        self._conn.execute(*self._unlock_sql)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            super().close()
        with contextlib.suppress(Exception):
            self._conn.close()
            self._engine.dispose()


class _NoLock(_StudyLock):
    exact = False


def is_in_memory(url: str) -> bool:
    if not url.startswith("sqlite"):
        return False
    from sqlalchemy.engine import make_url

    database = make_url(url).database
    return not database or database == ":memory:"


def lock_is_exact(url: str) -> bool:
    """Whether workers on this storage can share a study lock (see study_lock)."""
    if url.startswith("journal:"):
        return True
    from sqlalchemy.engine import make_url

    return make_url(url).get_backend_name() in ("sqlite", "postgresql", "mysql", "mariadb")


def _lock_file(path: str) -> Path:
    """The flock file of a study file: in the temporary folder, named by the file's real path,
    so the results folder holds only the study itself."""
    import tempfile

    real = os.path.realpath(os.path.expanduser(path))
    folder = Path(tempfile.gettempdir()) / "kvbench-tune-locks"
    folder.mkdir(exist_ok=True)
    return folder / (hashlib.sha256(real.encode()).hexdigest()[:32] + ".lock")


def study_lock(plan: Plan) -> _StudyLock:
    url = plan.storage_url
    if url.startswith("journal:"):
        return _FileLock(_lock_file(url[len("journal:"):]))
    from sqlalchemy.engine import make_url

    parsed = make_url(url)
    dialect = parsed.get_backend_name()
    if dialect == "sqlite":
        if not parsed.database or parsed.database == ":memory:":
            return _ThreadLock()
        return _FileLock(_lock_file(parsed.database))
    if dialect in ("postgresql", "mysql", "mariadb"):
        try:
            return _SqlLock(url, "postgresql" if dialect == "postgresql" else "mysql",
                            f"kvbench-tune/{plan.study_name}")
        except Exception as exc:  # noqa: BLE001
            detail = " ".join(str(getattr(exc, "orig", None) or exc).split())
            raise TuneError(f"cannot open storage {display_url(url)}: {detail}") from None
    return _NoLock()


# --------------------------------------------------------------------------------------------
# Counting trials.


@dataclasses.dataclass
class Tally:
    complete: int = 0
    infeasible: int = 0
    pruned: int = 0
    invalid: int = 0
    failed: int = 0
    running: int = 0
    waiting: int = 0
    lost: int = 0

    @property
    def finished(self) -> int:
        """Trials that count and are over."""
        return self.complete + self.pruned + self.invalid + self.failed

    @property
    def used(self) -> int:
        """Trials that count towards --trials (module docstring)."""
        return self.finished + self.running + self.waiting


def tally(plan: Plan, trials: Sequence[FrozenTrial]) -> Tally:
    from optuna.trial import TrialState

    t = Tally()
    for trial in trials:
        if trial.state == TrialState.COMPLETE:
            t.complete += 1
            if plan.constraints and not is_feasible(plan, trial):
                t.infeasible += 1
        elif trial.state == TrialState.PRUNED:
            if trial.user_attrs.get("outcome") == INVALID:
                t.invalid += 1
            else:
                t.pruned += 1
        elif trial.state == TrialState.RUNNING:
            t.running += 1
        elif trial.state == TrialState.WAITING:
            t.waiting += 1
        elif trial.user_attrs.get("outcome") == INVALID:
            t.invalid += 1
        elif trial.user_attrs.get("outcome") == FAILED:
            t.failed += 1
        else:
            t.lost += 1
    return t


# --------------------------------------------------------------------------------------------
# Studies and workers.


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
            from .runner import run_workload

            outcome = run_workload(wl)[0]
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


def _dominates(a: Sequence[float], b: Sequence[float], signs: Sequence[float]) -> bool:
    better = False
    for x, y, s in zip(a, b, signs):
        if s * x < s * y:
            return False
        if s * x > s * y:
            better = True
    return better


@dataclasses.dataclass
class Summary:
    trials: list
    tally: Tally
    feasible: list
    pareto: list
    best: Any  # FrozenTrial | None


def summarize(plan: Plan, trials: Sequence[FrozenTrial]) -> Summary:
    """Feasible complete trials, their Pareto front (sorted by the primary objective, best
    first) and the best trial by the primary objective (ties: the earliest)."""
    from optuna.trial import TrialState

    signs = [1.0 if d == "maximize" else -1.0 for d in plan.directions]
    feasible = [t for t in trials if t.state == TrialState.COMPLETE and t.values is not None
                and is_feasible(plan, t)]
    pareto = [t for t in feasible
              if not any(_dominates(o.values, t.values, signs) for o in feasible)]
    # Equal objective vectors: keep the earliest trial only.
    seen: set[tuple] = set()
    front = []
    for t in sorted(pareto, key=lambda t: ([-s * v for s, v in zip(signs, t.values)], t.number)):
        key = tuple(t.values)
        if key not in seen:
            seen.add(key)
            front.append(t)
    # Ties on the primary objective go to the better secondary objectives, then the earliest.
    best = min(feasible, key=lambda t: ([-s * v for s, v in zip(signs, t.values)], t.number),
               default=None)
    return Summary(list(trials), tally(plan, trials), feasible, front, best)


def export_best(plan: Plan, trial: FrozenTrial, path: str | Path) -> Path:
    """Write the trial's workload as a ready-to-run YAML: the keys the workload file and --set
    gave, with the trial's values; trace paths rebased on the new file's folder; no tune:
    section."""
    import yaml

    path = Path(path)
    wl = trial_workload(plan, plan.decoded_params(trial))
    # What the file and --set wrote, with the trial's values: the user's workload, tuned.
    data = wl.model_dump(mode="json", exclude={"variants", "tune"}, exclude_unset=True)
    data = {"name": wl.name, **{k: v for k, v in data.items() if k != "name"}}
    if wl.requests.path is not None:
        source = resolve_path(wl, wl.requests.path).resolve()
        target_dir = path.parent.resolve()
        try:
            rebased = os.path.relpath(source, target_dir)
        except ValueError:
            rebased = str(source)
        data.setdefault("requests", {})["path"] = rebased
    objectives = ", ".join(f"{m}={v:.6g}" for m, v in zip(plan.metric_names, trial.values))
    tuned = ", ".join(f"{k}={json.dumps(v)}" for k, v in plan.decoded_params(trial).items())
    header = (f"# Best trial #{trial.number} of study {plan.study_name!r} "
              f"({display_url(plan.storage_url)}), by {plan.metric_names[0]}.\n"
              f"# Objectives: {objectives}\n# Tuned: {tuned}\n"
              f"# Exported by kvbench tune from {plan.job.workload}; run: kvbench run {path}\n")
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
    return path


def write_plots(plan: Plan, study: optuna.Study, out_dir: str | Path) -> list[Path]:
    """PNGs (matplotlib Agg): the Pareto front (two or three objectives; the first two when
    there are more) and the optimization history of each objective."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from optuna.trial import TrialState
    from optuna.visualization import matplotlib as ovm

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    written: list[Path] = []
    if not any(t.state == TrialState.COMPLETE for t in study.get_trials(deepcopy=False)):
        return written
    names = plan.metric_names
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if len(names) >= 2:
            kwargs: dict[str, Any] = {}
            if plan.constraints:
                kwargs["constraints_func"] = _constraints_func(plan)
            if len(names) > 3:
                kwargs["targets"] = lambda t: t.values[:2]
                kwargs["target_names"] = names[:2]
            else:
                kwargs["target_names"] = names
            ax = ovm.plot_pareto_front(study, **kwargs)
            ax.set_title(f"Pareto front: {plan.study_name}")
            written.append(_save(ax, out / "pareto_front.png", plt))
        for i, name in enumerate(names):
            if len(names) == 1:
                ax = ovm.plot_optimization_history(study, target_name=name)
            else:
                ax = ovm.plot_optimization_history(study, target=lambda t, i=i: t.values[i],
                                                   target_name=name)
                _best_line(ax, plan, study, i, name)
            ax.set_title(f"Optimization history: {name} ({plan.directions[i]})")
            slug = re.sub(r"[^A-Za-z0-9_.-]+", "-", name)
            written.append(_save(ax, out / f"history-{slug}.png", plt))
    return written


def _best_line(ax, plan: Plan, study: optuna.Study, i: int, name: str) -> None:
    """Optuna draws no best-so-far line for one objective of several: add it (feasible
    trials only)."""
    from optuna.trial import TrialState

    sign = 1.0 if plan.directions[i] == "maximize" else -1.0
    xs, ys, best = [], [], None
    for t in sorted(study.get_trials(deepcopy=False), key=lambda t: t.number):
        if t.state == TrialState.COMPLETE and t.values and is_feasible(plan, t):
            v = t.values[i]
            best = v if best is None or sign * v > sign * best else best
        if best is not None:
            xs.append(t.number)
            ys.append(best)
    if xs:
        ax.plot(xs, ys, color="tab:red", drawstyle="steps-post", label=f"best {name} so far")
        ax.legend(bbox_to_anchor=(1.05, 1.0), loc="upper left")


def _save(ax, path: Path, plt) -> Path:
    fig = ax.figure
    fig.set_size_inches(8, 5)
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
