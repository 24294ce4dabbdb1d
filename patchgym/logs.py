"""A quiet console: library output goes to the run directory's `library.log`.

Inside `library_output_to(run_dir)` everything written to the process's stderr, at the file
descriptor, goes to `RUN_DIR/library.log`: Python warnings (UserWarning, FutureWarning, ...),
library loggers (transformers, megatron, torch.distributed), C++ messages, and the stderr of
every child process started meanwhile (trainer ranks inherit it). Python warnings and log
records are written with a time and the rank. The console keeps what patchgym prints
(stdout), warnings of patchgym's own loggers and what is written to `console_stderr()` (the
progress lines); when the block ends, stderr is restored, so an error that ends the run is
shown on the console as usual.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

LIBRARY_LOG = "library.log"
FORMAT = "%(asctime)s rank{rank} %(name)s %(levelname)s: %(message)s"
_console_stderr: list[TextIO] = []
"""The console's stderr while `library_output_to` sends the process's stderr to the log."""


def console_stderr() -> TextIO:
    """Where patchgym's own stderr output goes: the console, also while library output is redirected."""
    return _console_stderr[-1] if _console_stderr else sys.stderr


def _on_descriptor_2(stream: TextIO) -> bool:
    try:
        return stream.fileno() == 2
    except (AttributeError, OSError, ValueError):
        return False


@contextlib.contextmanager
def library_output_to(run_dir: Path) -> Iterator[Path]:
    """Send stderr, warnings and library logging to `run_dir/library.log` for the block; yields its path."""
    path = Path(run_dir) / LIBRARY_LOG
    path.parent.mkdir(parents=True, exist_ok=True)
    sys.stderr.flush()
    console_fd = os.dup(2)
    log_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log_fd, 2)
    os.close(log_fd)
    console = open(console_fd, "w", buffering=1, closefd=True)  # noqa: SIM115 (closed in finally)
    # A sys.stderr that is not the descriptor (a test runner's capture) still reaches its reader.
    shown = console if _on_descriptor_2(sys.stderr) else sys.stderr
    root, ours = logging.getLogger(), logging.getLogger("patchgym")
    to_file = logging.FileHandler(path)
    to_file.setFormatter(logging.Formatter(FORMAT.format(rank=os.environ.get("RANK", "0"))))
    to_console = logging.StreamHandler(shown)
    to_console.setLevel(logging.WARNING)
    saved_root = (list(root.handlers), root.level)
    root.handlers[:] = [to_file]
    root.setLevel(logging.INFO)
    ours.addHandler(to_console)
    logging.captureWarnings(True)
    _console_stderr.append(shown)
    try:
        yield path
    finally:
        _console_stderr.remove(shown)
        logging.captureWarnings(False)
        ours.removeHandler(to_console)
        root.handlers[:], root.level = saved_root
        sys.stderr.flush()
        os.dup2(console_fd, 2)
        console.close()
