"""Running the `kvbench` command in-process for tests."""

from __future__ import annotations

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
