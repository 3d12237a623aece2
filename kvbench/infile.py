"""Opening the files a user names (workloads, traces, results, profiles): only regular files.
A fifo would block the open until some writer appears and a device may never end, so both are
refused before opening, as one InputError line."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import BinaryIO

from kvbench.errors import InputError


def open_input(path: Path, what: str = "", directory: str = "") -> BinaryIO:
    """`path` opened in binary; InputError `"{path}: cannot read{what}: {reason}"` unless it is a
    regular file that opens (`directory`: the message for a directory instead, where one
    means something else)."""
    try:
        mode = os.stat(path).st_mode
    except OSError as exc:
        raise InputError(f"{path}: cannot read{what}: {exc.strerror or exc}") from None
    if stat.S_ISDIR(mode):
        raise InputError(f"{path}: {directory or f'cannot read{what}: is a directory'}")
    if not stat.S_ISREG(mode):
        raise InputError(f"{path}: cannot read{what}: not a regular file")
    try:
        return open(path, "rb")
    except OSError as exc:
        raise InputError(f"{path}: cannot read{what}: {exc.strerror or exc}") from None


def read_input(path: Path, what: str = "") -> bytes:
    """The bytes of the regular file `path` (`open_input`'s errors)."""
    with open_input(path, what) as f:
        return f.read()
