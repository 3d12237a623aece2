"""Running the `kvbench` command in-process for tests."""

from __future__ import annotations

import json
import sys


def run_cli(args, capsys) -> tuple[int, str, str]:
    """`kvbench ARGS` in-process: (exit code, stdout, stderr)."""
    from kvbench import cli

    old = sys.argv
    sys.argv = ["kvbench", *map(str, args)]
    try:
        cli.main()
        code = 0
    except SystemExit as exc:
        code = exc.code or 0
    finally:
        sys.argv = old
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def run_metrics(path, capsys, *sets) -> dict:
    """`kvbench run PATH --set ...` in-process: the first run's metrics, wall_s left out
    (the one metric two identical runs differ in)."""
    out = path.with_suffix(".out.json")
    args = ["run", path, "--quiet", "--json", out]
    for s in sets:
        args += ["--set", s]
    code, _, err = run_cli(args, capsys)
    assert code == 0, err
    metrics = json.loads(out.read_text())["runs"][0]["metrics"]
    del metrics["wall_s"]
    return metrics
