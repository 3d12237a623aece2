"""Where kvbench writes its outputs (result JSON, baselines, trace stats, exported workloads,
Markdown, report pages and plots), decided before the work that produces them.

The one rule for a file option:
  `-`                     -> standard output
  a regular file, nothing -> written atomically (a temporary file in the same folder, then a
                             rename), so a reader or a crash never sees half a file; a new file
                             gets 0666 less the umask, an existing one keeps its mode
  a symlink               -> its target, written atomically beside the target (the link stays)
  anything else           -> refused (a directory, a device, a fifo, a socket): InputError
The folder must exist or be creatable, and be writable: checked by `output_file`, before a run,
not after it. A folder option (`output_dir`) must be a directory or creatable, and writable.
"""

from __future__ import annotations

import os
import stat
import sys
import tempfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from .errors import InputError

STDOUT = "-"


@dataclass(frozen=True, slots=True)
class OutputFile:
    """A checked output file: `path` is what the user gave; `target` the file that will be
    replaced (the symlink's target resolved), None for standard output."""

    option: str
    path: str
    target: Path | None

    @property
    def is_stdout(self) -> bool:
        return self.target is None

    def write_text(self, text: str) -> None:
        """Write `text` (standard output, or atomically to the target)."""
        if self.target is None:
            sys.stdout.write(text)
            sys.stdout.flush()
            return
        self.write_bytes(text.encode())

    def write_bytes(self, data: bytes) -> None:
        """Write `data` (standard output, or atomically to the target)."""
        if self.target is None:
            sys.stdout.buffer.write(data)
            sys.stdout.buffer.flush()
            return
        _write_atomic(self.target, [data], self.option, self.path)

    def write_lines(self, lines: Iterable[str]) -> int:
        """Write `lines` as they come, each followed by a newline (a trace too large to hold
        as one string); returns how many. The target is replaced only once all are written."""
        count = 0

        def chunks() -> Iterator[bytes]:
            nonlocal count
            for line in lines:
                count += 1
                yield (line + "\n").encode()

        if self.target is None:
            for chunk in chunks():
                sys.stdout.buffer.write(chunk)
            sys.stdout.buffer.flush()
        else:
            _write_atomic(self.target, chunks(), self.option, self.path)
        return count


def output_file(path: str | os.PathLike, option: str) -> OutputFile:
    """Check that `path` can be written as the output of `option`, before any work; one
    InputError line if not."""
    text = os.fspath(path)
    if text == STDOUT:
        return OutputFile(option, text, None)
    if not text:
        raise InputError(f"{option}: expected a file path or - (got an empty string)")
    # realpath follows every link, a dangling one included: its target is what gets written.
    target = Path(os.path.realpath(text))
    try:
        st = os.stat(target)
    except FileNotFoundError:
        st = None
    except OSError as exc:
        raise InputError(f"{option} {text}: cannot write: {exc.strerror or exc}") from None
    if st is not None and not stat.S_ISREG(st.st_mode):
        raise InputError(f"{option} {text}: cannot write: {_kind(st.st_mode)}, not a regular "
                         "file (give a file path, or - for standard output)")
    _check_folder(target.parent, option, text)
    return OutputFile(option, text, target)


def output_dir(path: str | os.PathLike, option: str) -> Path:
    """Check that `path` is (or can be created as) a writable folder, before any work."""
    text = os.fspath(path)
    folder = Path(os.path.realpath(text))
    if folder.exists() and not folder.is_dir():
        mode = os.stat(folder).st_mode
        raise InputError(f"{option} {text}: cannot write into it: {_kind(mode)}, not a folder")
    _check_folder(folder, option, text)
    return Path(text)


def write_files(files: list[tuple[Path, bytes]]) -> None:
    """Write several outputs (a report's pages and plots), each atomically; all are rendered
    before the first is written, so a failure leaves no partial set behind."""
    for path, data in files:
        _write_atomic(Path(os.path.realpath(path)), [data], "", str(path))


def _check_folder(folder: Path, option: str, text: str) -> None:
    existing = folder
    while not existing.exists():
        if existing.parent == existing:
            break
        existing = existing.parent
    if not existing.is_dir():
        raise InputError(f"{option} {text}: cannot write: {existing} is not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise InputError(f"{option} {text}: cannot write: folder {existing} is not writable")


def _kind(mode: int) -> str:
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISCHR(mode):
        return "a character device"
    if stat.S_ISBLK(mode):
        return "a block device"
    if stat.S_ISFIFO(mode):
        return "a fifo"
    if stat.S_ISSOCK(mode):
        return "a socket"
    return "a file"


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _write_atomic(target: Path, chunks: Iterable[bytes], option: str, shown: str) -> None:
    where = f"{option} {shown}" if option else shown
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            mode = stat.S_IMODE(os.stat(target).st_mode)
        except FileNotFoundError:
            mode = 0o666 & ~_umask()
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
    except OSError as exc:
        raise InputError(f"{where}: cannot write: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            for chunk in chunks:
                f.write(chunk)
            os.fchmod(f.fileno(), mode)
        os.replace(tmp, target)
    except BaseException as exc:
        os.unlink(tmp)
        if isinstance(exc, OSError):
            raise InputError(f"{where}: cannot write: {exc.strerror or exc}") from None
        raise
