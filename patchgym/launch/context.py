"""Where the processes a run starts write their logs and pid records.

`patchgym run` sets the run directory (`run_logs(run_dir)`), so servers and trainer ranks log
under `RUN_DIR/logs/<part>/`; outside a run (a library user creating a backend) they log
to a fresh temporary directory.
"""

from __future__ import annotations

import contextlib
import contextvars
import tempfile
from collections.abc import Iterator
from pathlib import Path

_LOGS: contextvars.ContextVar[Path | None] = contextvars.ContextVar("patchgym_launch_logs", default=None)


@contextlib.contextmanager
def run_logs(run_dir: Path) -> Iterator[Path]:
    """Processes started inside this block log under `run_dir/logs`."""
    root = Path(run_dir) / "logs"
    token = _LOGS.set(root)
    try:
        yield root
    finally:
        _LOGS.reset(token)


def log_dir(part: str) -> Path:
    """The log directory of `part` (e.g. "sglang", "trainer") for the current run."""
    root = _LOGS.get()
    if root is None:
        return Path(tempfile.mkdtemp(prefix=f"patchgym-{part}-"))
    return root / part
