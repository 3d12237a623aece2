"""`kvbench tune --holdout`: the chosen configuration on requests the study never saw."""

from __future__ import annotations

import dataclasses
import json
from typing import TYPE_CHECKING, Any

from ..config import load_workload
from .plan import Plan

if TYPE_CHECKING:  # pragma: no cover
    from optuna.trial import FrozenTrial


@dataclasses.dataclass(frozen=True)
class HoldoutRun:
    """One configuration's metrics on the tuned part (None: not run there) and on the rest."""

    label: str
    params: dict[str, Any]
    tuned: dict | None
    held_out: dict


def holdout_runs(plan: Plan, best: FrozenTrial) -> list[HoldoutRun]:
    """The best trial's configuration and the workload as written, each run on the held-out
    requests: does the tuned configuration beat the untuned one on traffic it never saw? The
    two share the held-out requests and the references they have in common (not the
    trials': other requests)."""
    from ..modes.common import References
    from ..runner import request_streams, run_workload

    split = plan.holdout
    assert split is not None
    base_sets = plan.job.sets[:len(plan.job.sets) - len(split.tune_sets)]
    references = References()
    streams = request_streams(1)
    out = []
    try:
        for label, chosen, tuned in (("best trial", plan.decoded_params(best),
                                      best.user_attrs.get("metrics")),
                                     ("as written", {}, None)):
            sets = [*base_sets, *split.holdout_sets,
                    *(f"{k}={json.dumps(v)}" for k, v in chosen.items())]
            metrics = run_workload(load_workload(plan.job.workload, sets),
                                   references=references, streams=streams)[0].metrics
            out.append(HoldoutRun(label, chosen, tuned, metrics))
    finally:
        streams.clear()
    return out
