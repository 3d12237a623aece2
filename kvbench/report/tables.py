"""Rich tables of run metrics, one column per variant (the rows are the metric registry's,
`kvbench/metrics.py`, section by section, in its order), and of a trace's statistics."""

from __future__ import annotations

import textwrap

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

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


def metrics_tables(title: str, runs: list[tuple[str, dict]],
                   differences: dict[str, list[str]] | None = None,
                   overridden: bool = False) -> list[Table]:
    """One table per section with at least one metric present. A variant's column heading
    lists the resolved settings in which the variants differ (`differences`), so a name never
    hides what ran; `overridden` (the command line gave --set) says which of the two wins."""
    differences = differences or {}
    tables: dict[str, Table] = {}
    for section, label, cells in table_rows([m for _, m in runs]):
        table = tables.get(section)
        if table is None:
            # Titles never fold mid-word (print_wide keeps the cells whole).
            table = tables[section] = Table(
                title=Text(f"{title}: {section}", no_wrap=True, overflow="ignore"),
                title_justify="left")
            if overridden and len(runs) > 1 and len(tables) == 1:
                table.caption = "--set applies to every variant; a variant's own set wins"
                table.caption_justify = "left"
            table.add_column("metric")
            for name, _ in runs:
                table.add_column("\n".join([name, *differences.get(name, [])]), justify="right")
        table.add_row(label, *cells)
    return list(tables.values())


def print_wide(console: Console, table: Table, *, limit: int = 10_000) -> None:
    """Print `table` without folding a cell or its title: headers wrap at spaces to their
    column's widest cell, cells never wrap, and a table wider than the console is printed
    whole (up to `limit` columns: a terminal scrolls it, a file or pipe gets whole lines),
    never a number split over two lines."""
    if isinstance(table.title, str):
        table.title = Text(table.title, no_wrap=True, overflow="ignore")
    for column in table.columns:
        cells = [cell_len(c) for c in column.cells if isinstance(c, str)]
        if isinstance(column.header, str) and cells:
            words = column.header.split()
            width = max([max(cells), *(cell_len(w) for w in words)])
            column.header = "\n".join(textwrap.wrap(column.header, width)) or column.header
        column.no_wrap = True
    width = console.measure(table, options=console.options.update_width(limit)).maximum
    saved = console.width
    console.width = max(saved, width)
    try:
        console.print(table, crop=False)
    finally:
        console.width = saved


def print_metrics(console: Console, title: str, runs: list[tuple[str, dict]],
                  differences: dict[str, list[str]] | None = None,
                  overridden: bool = False) -> None:
    for table in metrics_tables(title, runs, differences, overridden):
        print_wide(console, table)


def trace_stats_table(name: str, stats: dict) -> Table:
    """`kvbench trace stats`: one row per statistic of `trace_stats` (the JSON has them all)."""
    table = Table(title=name, title_justify="left")
    table.add_column("statistic")
    table.add_column("value", justify="right")
    native = stats["native_block_tokens"]
    table.add_row("format", stats["format"])
    table.add_row("native block size", "none (no prefix information)" if native is None
                  else "exact tokens" if native == 1 else f"{native} tokens/id")
    table.add_row("length convention", stats["convention"])
    if stats["tokenizer"] is not None:
        table.add_row("tokenizer", "approx (approximate counts)" if stats["tokenizer"] == "approx"
                      else stats["tokenizer"])
    if stats["requests_without_prefix_info"]:
        table.add_row("requests without prefix information",
                      f"{stats['requests_without_prefix_info']:,}")
    if stats["records_without_prompt"]:
        table.add_row("records skipped (no prompt tokens)",
                      f"{stats['records_without_prompt']:,}")
    table.add_row("requests", f"{stats['requests']:,}")
    table.add_row("duration", f"{stats['duration_s']:,.1f} s")
    rate = stats["rate_rps"]
    table.add_row("rate", f"{rate:.2f} req/s" if rate is not None else "-")
    for kind in ("input_length", "output_length"):
        d = stats[kind]
        table.add_row(kind.replace("_", " ") + " p50/p90/p99/max",
                      f"{d['p50']:,.0f} / {d['p90']:,.0f} / {d['p99']:,.0f} / {d['max']:,.0f}")
    for bs, rate in stats["ideal_hit_rate"].items():
        value = f"{100 * rate:.2f}%"
        if not stats["ideal_resolvable"][bs]:
            value = "n/a" if native is None else f">= {value} (not resolvable)"
        table.add_row(f"ideal hit rate @ {bs} tokens/block", value)
    if native is not None and not all(stats["ideal_resolvable"].values()):
        table.caption = (f"not resolvable: below the trace's {native}-token ids, where two "
                         "prompts diverge inside a block is unknown; the value is a lower bound")
    return table
