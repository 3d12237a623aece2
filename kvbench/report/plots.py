"""PNG plots of a result, headless: figures are built with matplotlib's object API and saved with
its Agg canvas (no pyplot, no display, no global state). matplotlib and numpy are imported
inside the functions so that `kvbench run` and `kvbench compare` never pay for them.

Each function returns the path it wrote, or None when the run has nothing to plot for that kind
(a timeline without those columns, a workload without any headline metric).
"""

from __future__ import annotations

import io
from pathlib import Path

from ..metrics import metric
from ..outfile import write_files
from ..results import MergedRun, flatten_metrics

PLOT_KINDS = ("blocks", "hit_rate", "bars")
"""blocks and hit_rate: one PNG per run (from its timeline); bars: one PNG per workload."""

ROLLING_FRACTION = 20
"""The rolling hit rate averages over 1/ROLLING_FRACTION of the timeline."""

_STATES = ("in_use", "cached", "free")
_STATE_COLORS = ("#d62728", "#1f77b4", "#c7c7c7")

HEADLINE: tuple[tuple[str, ...], ...] = (
    ("hit_rate", "optimal_hit_rate", "ideal_hit_rate"),
    ("peak_gpu_blocks",),
    ("peak_gpu_bytes",),
    ("evicted_blocks",),
    ("reused_tokens_host",),
    ("mnt_overflow_steps",),
    ("scratch_slots_peak",),
    ("throughput_tokens_per_s",),
    ("ttft_ms.p50", "ttft_ms.p99"),
    ("tpot_ms.p50", "tpot_ms.p99"),
)
"""The metrics of each bar panel; its title is the first one's registry label, a fraction
gets a 0..100 % axis, bytes are shown in GiB and counts get integer ticks; a panel whose
values are all zero or absent is left out, and a variant the metric does not apply to (absent
or null) is marked n/a rather than drawn as a bar of 0."""


def plot_blocks(run: MergedRun, path: Path) -> Path | None:
    """GPU blocks over time, stacked in use / cached / free.

    Cached is drawn as what in use and free leave of `gpu_blocks_total`, so the stack is
    always the whole pool: cache mode samples in use at a request's peak but cached and free
    after its release, when its blocks are cached."""
    import numpy as np
    from matplotlib.ticker import MaxNLocator

    cols = run.timeline.get("columns") or {}
    if not all(s in cols for s in _STATES):
        return None
    fig, axes = _figure(1, 1, (9, 3.2))
    x = _x(run.timeline)
    ax = axes[0, 0]
    in_use, free = np.asarray(cols["in_use"]), np.asarray(cols["free"])
    total = run.metrics.get("gpu_blocks_total")
    cached = (np.maximum(total - in_use - free, 0) if total is not None
              else np.asarray(cols["cached"]))
    ax.stackplot(x, in_use, cached, free, labels=[s.replace("_", " ") for s in _STATES],
                 colors=_STATE_COLORS, step="post")
    ax.set_ylabel("GPU blocks")
    ax.set_xlim(x[0], x[-1] if len(x) > 1 else x[0] + 1)
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    # Beside the axes: the stack fills the whole plot, so a legend inside would hide it.
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    ax.set_xlabel(_x_label(run.timeline))
    fig.suptitle(f"{run.workload} / {run.variant}: blocks over time")
    return _save(fig, path)


def plot_hit_rate(run: MergedRun, path: Path) -> Path | None:
    """Rolling and cumulative hit rate over time, with the run's optimal and ideal hit rates."""
    import numpy as np

    cols = run.timeline.get("columns") or {}
    if "reused_tokens" not in cols or "prompt_tokens" not in cols:
        return None
    reused = np.asarray(cols["reused_tokens"], dtype=np.float64)
    prompt = np.asarray(cols["prompt_tokens"], dtype=np.float64)
    if not len(prompt):
        return None
    x = _x(run.timeline)
    window = max(1, len(prompt) // ROLLING_FRACTION)
    kernel = np.ones(window)
    rolling = (np.convolve(reused, kernel, "valid")
               / np.maximum(np.convolve(prompt, kernel, "valid"), 1))
    cumulative = np.cumsum(reused) / np.maximum(np.cumsum(prompt), 1)
    fig, axes = _figure(1, 1, (9, 3.6))
    ax = axes[0, 0]
    stride = run.timeline.get("stride", 1)
    unit = run.timeline.get("x", "point")
    ax.plot(x[window - 1:], rolling,
            label=f"rolling (over {window * stride} {'row' if unit == 'step' else unit}s)")
    ax.plot(x, cumulative, label="cumulative", color="black")
    for key, style in (("optimal_hit_rate", ":"), ("ideal_hit_rate", "--")):
        value = run.metrics.get(key)
        if value is not None:
            ax.axhline(value, linestyle=style, color="gray",
                       label=f"{key.replace('_', ' ')} {100 * value:.1f}%")
    ax.set_ylim(0, 1)
    ax.yaxis.set_major_formatter(_percent_formatter())
    ax.set_xlabel(_x_label(run.timeline))
    ax.set_ylabel("hit rate")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small")
    fig.suptitle(f"{run.workload} / {run.variant}: hit rate over time")
    return _save(fig, path)


def plot_bars(workload: str, runs: list[MergedRun], path: Path) -> Path | None:
    """Per-variant bars of the headline metrics, one panel per metric group."""
    import numpy as np

    flat = [flatten_metrics(r.metrics) for r in runs]
    panels = [(_panel_title(keys), keys, metric(keys[0]))
              for keys in HEADLINE if any(_num(m.get(k)) for m in flat for k in keys)]
    if not panels:
        return None
    ncols = min(3, len(panels))
    nrows = -(-len(panels) // ncols)
    fig, axes = _figure(nrows, ncols, (4.2 * ncols, 3.4 * nrows))
    names = [r.variant for r in runs]
    positions = np.arange(len(runs))
    from matplotlib.ticker import MaxNLocator

    for ax, (title, keys, m) in zip(axes.flat, panels):
        width = 0.8 / len(keys)
        scale = 2**30 if m.unit == "bytes" else 1
        for i, key in enumerate(keys):
            values = [_num(f.get(key)) for f in flat]
            label = key.split(".")[-1] if "." in key else key.replace("_", " ")
            at = positions + (i - (len(keys) - 1) / 2) * width
            drawn = [(x, v / scale) for x, v in zip(at, values) if v is not None]
            ax.bar([x for x, _ in drawn], [v for _, v in drawn], width, label=label)
            for x, v in zip(at, values):
                if v is None:
                    ax.text(x, 0, "n/a", ha="center", va="bottom", fontsize="small",
                            color="gray")
        ax.set_title(title)
        crowded = len(runs) > 3
        ax.set_xticks(positions, names, rotation=30 if crowded else 0,
                      ha="right" if crowded else "center")
        if m.unit == "fraction":
            ax.set_ylim(0, 1)
            ax.yaxis.set_major_formatter(_percent_formatter())
        elif m.kind == "count" and m.unit != "bytes":
            ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        if len(keys) > 1:
            # Above the axes, so it never hides a bar.
            ax.legend(fontsize="x-small", loc="lower center", bbox_to_anchor=(0.5, 1.08),
                      ncols=len(keys), frameon=False)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(f"{workload}: headline metrics by variant")
    return _save(fig, path)


def _panel_title(keys: tuple[str, ...]) -> str:
    m = metric(keys[0])
    if "." in keys[0]:  # a percentile panel: its leaves are the legend
        return f"{m.title.split(' ')[0]} ({m.unit})"
    if m.unit == "bytes":
        return f"{m.title} (GiB)"
    return m.title + (f" ({m.unit})" if m.unit in ("ms", "s", "tokens/s") else "")


def _figure(nrows: int, ncols: int, size: tuple[float, float]):
    from matplotlib.figure import Figure

    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows, ncols, squeeze=False)


def _save(fig, path: Path) -> Path:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig)
    png = io.BytesIO()
    fig.savefig(png, dpi=100, format="png")
    write_files([(path, png.getvalue())])
    return path


def _percent_formatter():
    from matplotlib.ticker import PercentFormatter

    return PercentFormatter(1.0)


def _x(timeline: dict):
    """Where each row sits: its own `step` column when it has one (a serve-mode row may stand
    for a run of decode steps), else its position times the thinning stride."""
    import numpy as np

    cols = timeline["columns"]
    if "step" in cols:
        return np.asarray(cols["step"])
    n = len(next(iter(cols.values())))
    return np.arange(n) * timeline.get("stride", 1)


def _x_label(timeline: dict) -> str:
    stride = timeline.get("stride", 1)
    label = timeline.get("x", "")
    return label + (f" (one point per {stride} rows)" if stride > 1 else "")


def _num(value) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None
