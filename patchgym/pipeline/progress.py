"""Progress of a run's stages: live bars on a terminal, plain lines in a log file.

Without a terminal (nohup, Slurm, CI) a live bar writes nothing useful, so `stage_progress`
returns a `LineProgress` instead: every `interval_s` (and once when a bar ends) it writes one line
per bar to the console's stderr (`patchgym.logs.console_stderr`: not the library log), e.g.
`2026-12-01 05:02:11 grpo: step 12/120, 1.4 step/min, ETA 77m, reward 0.531, pass 41%`. On a terminal
the bar shows the same: done/total, elapsed, ETA, reward mean and pass rate. Bars take the same
calls either way (`add_task`, `advance`, `update(..., reward=r, pass_rate=p)`).
"""

from __future__ import annotations

import threading
import time
from typing import TextIO

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    Task,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from patchgym.logs import console_stderr
from patchgym.pipeline.feedback import StatsColumn, stats_text


def stage_progress(console: Console, interval_s: float) -> Progress:
    """A live bar display on a terminal, else a `LineProgress` to stderr."""
    if console.is_terminal:
        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            StatsColumn(),
        )
        return Progress(*columns, console=console, transient=True)
    return LineProgress(interval_s)


def _duration(seconds: float) -> str:
    if seconds < 120:
        return f"{seconds:.0f}s"
    return f"{seconds / 60:.0f}m" if seconds < 7200 else f"{seconds / 3600:.1f}h"


def progress_line(task: Task, now: float) -> str:
    """One line for a bar: what, how far, how fast, how long to go, reward mean and pass rate."""
    unit = task.fields.get("unit", "")
    done = f"{unit} {task.completed:.0f}".lstrip() + (f"/{task.total:.0f}" if task.total is not None else "")
    parts = [f"{task.description}: {done}"]
    elapsed = task.elapsed or 0.0
    made = task.completed - task.fields.get("initial", 0)
    if elapsed > 0 and made > 0:
        rate = made / elapsed
        per_minute = rate * 60
        parts.append(f"{per_minute:.3g} {unit or 'item'}/min")
        if task.total is not None and task.completed < task.total:
            parts.append(f"ETA {_duration((task.total - task.completed) / rate)}")
    else:
        parts.append(f"{_duration(elapsed)} elapsed")
    if stats := stats_text(task.fields):
        parts.append(stats)
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(now))
    return f"{stamp} {', '.join(parts)}"


class LineProgress(Progress):
    """Bars without a live display: one plain line per bar every `interval_s` and when it ends."""

    def __init__(self, interval_s: float, stream: TextIO | None = None) -> None:
        super().__init__(disable=True)
        self.interval_s = interval_s
        self._stream = stream
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        super().start()
        self._thread = threading.Thread(target=self._loop, name="patchgym-progress", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self.write_lines()  # where each bar ended
        super().stop()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.write_lines()

    def write_lines(self) -> None:
        stream = self._stream or console_stderr()
        now = time.time()
        with self._lock:
            lines = [progress_line(task, now) for task in self._tasks.values()]
        stream.write("".join(f"{line}\n" for line in lines))
        stream.flush()
