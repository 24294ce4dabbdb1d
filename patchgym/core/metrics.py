"""The run's event log: every step, trajectory and evaluation as one JSON line in `events.jsonl`.

`EventLog.emit(kind, **fields)` appends an event (with a timestamp) to the run directory and
forwards it to optional sinks (TensorBoard, Weights & Biases). `read_events` reads it back, and
tolerates a final line cut short by a crash.

Event kinds used by the pipeline: "run" (start / resume / end, with the config), "step" (one
training step: time split, reward, lengths, grad norm, log-prob gap, IS ESS, staleness,
terminations, long-tail shares, infra errors), "trajectory" (one episode: turns, tokens,
termination, reward, phase times) and "eval" (pass@1 and pass@k of a stage).
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

EVENTS_FILE = "events.jsonl"


class Sink(Protocol):
    """Somewhere events go besides the JSONL file."""

    def write(self, event: Mapping[str, Any]) -> None: ...

    def close(self) -> None: ...


def flatten(values: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, float]]:
    """Numeric leaves of a nested mapping as ("a/b/c", value) pairs."""
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            yield from flatten(value, f"{name}/")
        elif isinstance(value, int | float):  # bool is an int too
            yield name, float(value)


_SKIP = {"kind", "time", "step", "limits"}


def _scalars(event: Mapping[str, Any]) -> dict[str, float]:
    return {f"{event['kind']}/{k}": v for k, v in flatten({k: v for k, v in event.items() if k not in _SKIP})}


class TensorBoardSink:
    """Scalars of "step" and "eval" events into TensorBoard event files (`tensorboard` package)."""

    def __init__(self, log_dir: Path) -> None:
        from tensorboard.compat.proto.event_pb2 import Event
        from tensorboard.compat.proto.summary_pb2 import Summary
        from tensorboard.summary.writer.event_file_writer import EventFileWriter

        self._event, self._summary = Event, Summary
        self._writer = EventFileWriter(str(log_dir))

    def write(self, event: Mapping[str, Any]) -> None:
        if event["kind"] not in ("step", "eval"):
            return
        values = [self._summary.Value(tag=tag, simple_value=v) for tag, v in _scalars(event).items()]
        record = self._event(
            wall_time=event["time"], step=int(event.get("step", 0)), summary=self._summary(value=values)
        )
        self._writer.add_event(record)

    def close(self) -> None:
        self._writer.close()


class WandbSink:
    """Scalars of "step" and "eval" events into Weights & Biases (`wandb`; offline mode works)."""

    def __init__(self, run_dir: Path, project: str, config: Mapping[str, Any] | None = None, mode: str | None = None):
        import wandb

        self._run = wandb.init(project=project, dir=str(run_dir), config=dict(config or {}), mode=mode)

    def write(self, event: Mapping[str, Any]) -> None:
        if event["kind"] in ("step", "eval"):
            self._run.log(_scalars(event), step=int(event.get("step", 0)))

    def close(self) -> None:
        self._run.finish()


class EventLog:
    """Append-only JSONL event log of one run directory, plus sinks."""

    def __init__(self, run_dir: str | Path, sinks: Sequence[Sink] = ()) -> None:
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.path = self.run_dir / EVENTS_FILE
        self._file = self.path.open("a", encoding="utf-8")
        self._sinks = list(sinks)

    def emit(self, kind: str, **fields: Any) -> dict[str, Any]:
        """Record one event; returns it as written."""
        event = {"kind": kind, "time": time.time(), **fields}
        self._file.write(json.dumps(event, default=str) + "\n")
        self._file.flush()
        for sink in self._sinks:
            sink.write(event)
        return event

    def position(self) -> int:
        """Bytes written so far: a checkpoint records it so a resumed run can drop later events."""
        return self._file.tell()

    def close(self) -> None:
        self._file.close()
        for sink in self._sinks:
            sink.close()


def truncate_events(run_dir: str | Path, position: int) -> None:
    """Drop the events written after `position` (work a resumed run will do again)."""
    path = Path(run_dir) / EVENTS_FILE
    if path.exists() and path.stat().st_size > position:
        with path.open("r+b") as f:
            f.truncate(position)


def read_events(run_dir: str | Path, kind: str | None = None) -> list[dict[str, Any]]:
    """The events of a run directory (of one kind if given); a torn last line is skipped."""
    path = Path(run_dir) / EVENTS_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} does not exist: is {run_dir} a patchgym run directory?")
    events = []
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            if number == len(lines):
                break  # the run was killed mid-write
            raise ValueError(f"{path}:{number} is not a JSON event") from None
        if kind is None or event.get("kind") == kind:
            events.append(event)
    return events
