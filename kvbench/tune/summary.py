"""What a study amounts to: the trial tally, the Pareto front, the exported best workload and
the plots."""

from __future__ import annotations

import dataclasses
import io
import json
import os
import re
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..config import resolve_path
from ..outfile import output_file, write_files
from ..traffic.tokenize import APPROX
from .plan import FAILED, INVALID, Plan, _constraints_func, is_feasible, trial_workload
from .storage import display_url

if TYPE_CHECKING:  # pragma: no cover
    import optuna
    from optuna.trial import FrozenTrial


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


def summary_data(plan: Plan, summary: Summary, holdout: list | None, *,
                 interrupted: bool) -> dict:
    """`kvbench tune --json`: the study's counts, objectives, best trial and Pareto front
    (each trial's number, parameters, objective values and run metrics) and, with
    `--holdout`, the held-out check (`HoldoutRun`s: the best trial, then the workload as
    written)."""
    def trial(t: FrozenTrial) -> dict:
        return {"number": t.number, "params": plan.decoded_params(t),
                "values": dict(zip(plan.metric_names, t.values)),
                "metrics": t.user_attrs.get("metrics", {})}

    split = plan.holdout
    return {
        "study": plan.study_name,
        "trials": plan.n_trials,
        "interrupted": interrupted,
        "tally": dataclasses.asdict(summary.tally),
        "objectives": [{"metric": m, "direction": d}
                       for m, d in zip(plan.metric_names, plan.directions)],
        "best": trial(summary.best) if summary.best is not None else None,
        "pareto": [trial(t) for t in summary.pareto],
        "holdout": None if split is None or holdout is None else {
            "tune_requests": split.tune_requests, "total_requests": split.total_requests,
            "runs": [dataclasses.asdict(run) for run in holdout]},
    }


def export_best(plan: Plan, trial: FrozenTrial, path: str | Path) -> Path:
    """Write the trial's workload as a ready-to-run YAML: the keys the workload file and --set
    gave, with the trial's values; the paths it reads rebased on the new file's folder; no
    tune: section."""
    import yaml

    path = Path(path)
    wl = trial_workload(plan, plan.decoded_params(trial))
    # What the file and --set wrote, with the trial's values: the user's workload, tuned.
    data = wl.model_dump(mode="json", exclude={"variants", "tune"}, exclude_unset=True)
    data = {"name": wl.name, **{k: v for k, v in data.items() if k != "name"}}
    # Paths the workload reads, relative to its own folder: the trace, the tokenizer of a chat
    # trace and a hardware profile.
    for section, key, value in (("requests", "path", wl.requests.path),
                                ("requests", "tokenizer", None if wl.requests.tokenizer == APPROX
                                 else wl.requests.tokenizer),
                                ("hardware", "profile", wl.hardware.profile)):
        if value is not None:
            source = resolve_path(wl, value).resolve()
            try:
                rebased = os.path.relpath(source, path.parent.resolve())
            except ValueError:
                rebased = str(source)
            data.setdefault(section, {})[key] = rebased
    objectives = ", ".join(f"{m}={v:.6g}" for m, v in zip(plan.metric_names, trial.values))
    tuned = ", ".join(f"{k}={json.dumps(v)}" for k, v in plan.decoded_params(trial).items())
    header = (f"# Best trial #{trial.number} of study {plan.study_name!r} "
              f"({display_url(plan.storage_url)}), by {plan.metric_names[0]}.\n"
              f"# Objectives: {objectives}\n# Tuned: {tuned}\n"
              f"# Exported by kvbench tune from {plan.job.workload}; run: kvbench run {path}\n")
    text = header + yaml.safe_dump(data, sort_keys=False, default_flow_style=False)
    output_file(path, "--export-best").write_text(text)
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
    png = io.BytesIO()
    fig.savefig(png, dpi=110, bbox_inches="tight", format="png")
    plt.close(fig)
    write_files([(path, png.getvalue())])
    return path
