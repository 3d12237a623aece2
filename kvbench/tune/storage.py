"""Where a study lives (SQLite, journal file, PostgreSQL/MySQL, memory) and the study lock
workers take to count and create trials."""

from __future__ import annotations

import contextlib
import hashlib
import os
import re
import threading
import time
import warnings
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError
from .plan import MAX_RETRY, Plan, TuneError


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


def _rdb_storage_class():
    from optuna.storages import RDBStorage
    from optuna.storages._rdb import models
    from optuna.storages._rdb.storage import _create_scoped_session
    from optuna.trial import TrialState

    class _HeartbeatRDBStorage(RDBStorage):
        """Optuna's RDB storage, where a running trial that never recorded a heartbeat is
        stale too once it started more than the grace period ago, as in the journal storage:
        its worker died between creating it and its first heartbeat. Optuna passes such a
        trial over, and a study holding one would wait for it forever."""

        def _get_stale_trial_ids(self, study_id: int) -> list[int]:
            stale = super()._get_stale_trial_ids(study_id)
            trial, beat = models.TrialModel, models.TrialHeartbeatModel
            with _create_scoped_session(self.scoped_session) as session:
                silent = (session.query(trial.trial_id)
                          .outerjoin(beat, beat.trial_id == trial.trial_id)
                          .filter(trial.study_id == study_id, trial.state == TrialState.RUNNING,
                                  beat.trial_id.is_(None))
                          .all())
            # Rare (a worker records its trial's heartbeat right after creating it); a start
            # time is the creating worker's clock, read as the journal storage reads it.
            now = time.time()
            for (trial_id,) in silent:
                start = self.get_trial(trial_id).datetime_start
                if start is not None and now - start.timestamp() > self.grace_period:
                    stale.append(trial_id)
            return stale

    return _HeartbeatRDBStorage


def open_storage(plan: Plan):
    """The study's Optuna storage, with heartbeats and re-queueing of stale trials."""
    _quiet_optuna()
    url = plan.storage_url
    interval = plan.job.heartbeat_s
    grace = 3 * interval
    if url.startswith("journal:"):
        return _journal_storage(url, interval, grace)
    if "://" not in url:
        raise InputError(f"--storage {url}: expected an Optuna storage URL (sqlite:///FILE, "
                         "postgresql://USER@HOST/DB, ...) or journal:PATH")
    import sqlalchemy.exc

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
    storage_class = _rdb_storage_class()
    last: Exception | None = None
    for attempt in range(3):  # workers starting together may race to create the tables
        try:
            try:
                return storage_class(url, heartbeat_stale_trial_callback=callback, **kwargs)
            except TypeError:  # optuna < 4.9
                return storage_class(url, failed_trial_callback=callback, **kwargs)
        except ImportError as exc:
            cause = exc.__cause__ or exc
            hint = (" (pip install 'psycopg[binary]' for postgresql://, or psycopg2-binary for "
                    "postgresql+psycopg2://)" if "postgres" in url else "")
            raise TuneError(f"--storage {display_url(url)}: no database driver: {cause}{hint}"
                            ) from None
        except sqlalchemy.exc.NoSuchModuleError:
            dialect = url.split("://", 1)[0]
            raise InputError(f"--storage {display_url(url)}: unknown database {dialect!r}; "
                             "expected sqlite:///FILE, postgresql+psycopg://USER@HOST/DB, "
                             "mysql+pymysql://USER@HOST/DB or journal:PATH") from None
        except sqlalchemy.exc.ArgumentError as exc:
            raise InputError(f"--storage {display_url(url)}: {exc}") from None
        except sqlalchemy.exc.SQLAlchemyError as exc:
            last = exc
            time.sleep(0.5 * (attempt + 1))
    detail = " ".join(str(getattr(last, "orig", None) or last).split())
    raise TuneError(f"cannot open storage {display_url(url)}: {detail}")


def _journal_storage(url: str, interval: float, grace: float):
    """`open_storage` for a `journal:PATH` URL: a journal file, created with its folder."""
    from optuna.storages.journal import JournalFileBackend

    path = Path(url[len("journal:"):]).expanduser()
    if path.is_dir() or not path.name:
        raise InputError(f"--storage {url}: expected a journal file, not a folder")
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        backend = JournalFileBackend(str(path))
    except OSError as exc:
        raise TuneError(f"cannot open journal {path}: {exc.strerror or exc}") from None
    return _journal_storage_class()(backend, interval, grace, _retry_callback())


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
