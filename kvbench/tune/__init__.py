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
In both, a running trial that never recorded a heartbeat (its worker was killed right after
creating it) goes stale by its start time (`_HeartbeatRDBStorage`: Optuna's check skips it).

The package: `plan` (the job checked once from the workload; `--holdout` splits the requests
there), `holdout` (the best trial on the held-out requests), `storage` (where a study lives,
the study lock), `study` (the study loop, objective, workers), `summary` (tally, Pareto front,
export, plots), `view` (what `kvbench tune` shows; the CLI calls `view.tune_command`).

optuna, sqlalchemy and matplotlib are imported lazily: `import kvbench` must stay light.
"""

from .holdout import HoldoutRun, holdout_runs
from .plan import (ABORTED, COMPLETE, COUNTED_FAILURES, FAILED, INTERRUPTED, INVALID, MAX_RETRY,
                   WAIT_POLL_S, HoldoutSplit, Param, Plan, TuneError, TuneJob, constraint_values,
                   default_storage, holdout_split, is_feasible, metric_value, prepare,
                   trial_workload)
from .storage import display_url, is_in_memory, lock_is_exact, open_storage, study_lock
from .study import (WorkersResult, _interrupt_once, create_study, make_sampler, run_worker,
                    run_workers, worker_id, worker_seed)
from .summary import Summary, Tally, export_best, summarize, summary_data, tally, write_plots

__all__ = [
    "ABORTED", "COMPLETE", "COUNTED_FAILURES", "FAILED", "INTERRUPTED", "INVALID", "MAX_RETRY",
    "WAIT_POLL_S", "HoldoutRun", "HoldoutSplit", "Param", "Plan", "Summary", "Tally", "TuneError", "TuneJob", "WorkersResult",
    "_interrupt_once", "constraint_values", "create_study", "default_storage", "display_url",
    "export_best", "holdout_runs", "holdout_split", "is_feasible", "is_in_memory", "lock_is_exact", "make_sampler",
    "metric_value", "open_storage", "prepare", "run_worker", "run_workers", "study_lock",
    "summarize", "summary_data", "tally", "trial_workload", "worker_id", "worker_seed", "write_plots",
]
