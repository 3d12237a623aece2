"""Rich tables of run metrics, one column per variant; the rows are the metric registry's
(`kvbench/metrics.py`), section by section, in its order."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from ..metrics import SECTIONS, in_section


def table_rows(runs: list[dict]) -> list[tuple[str, str, list[str]]]:
    """(section, label, one cell per run) of every registered metric some run has; a metric
    absent from a run (not applicable to its mode) shows as a dash."""
    rows = []
    for section in SECTIONS:
        for m in in_section(section):
            values = [metrics.get(m.name) for metrics in runs]
            if m.kind == "pools":  # a row per pool
                names = dict.fromkeys(p for v in values if v for p in v)
                rows += [(section, f"  pool {p} (peak / total)",
                          [m.fmt({p: v[p]}).split(" ", 1)[1] if v and p in v else "-"
                           for v in values]) for p in names]
            elif any(v is not None for v in values):
                rows.append((section, m.label,
                             [m.fmt(v) if v is not None else "-" for v in values]))
    return rows


def metrics_tables(title: str, runs: list[tuple[str, dict]]) -> list[Table]:
    """One table per section with at least one metric present."""
    tables: dict[str, Table] = {}
    for section, label, cells in table_rows([m for _, m in runs]):
        table = tables.get(section)
        if table is None:
            table = tables[section] = Table(title=f"{title}: {section}", title_justify="left")
            table.add_column("metric")
            for name, _ in runs:
                table.add_column(name, justify="right")
        table.add_row(label, *cells)
    return list(tables.values())


def print_wide(console: Console, table: Table, *, limit: int = 1000) -> None:
    """Print `table` at its natural width (up to `limit` columns) when that is wider than the
    console, so that rich neither wraps nor crops its cells."""
    width = console.measure(table, options=console.options.update_width(limit)).maximum
    saved = console.width
    console.width = max(saved, width)
    try:
        console.print(table)
    finally:
        console.width = saved


def print_metrics(console: Console, title: str, runs: list[tuple[str, dict]]) -> None:
    for table in metrics_tables(title, runs):
        console.print(table)
