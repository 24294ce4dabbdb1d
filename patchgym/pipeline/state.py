"""What a run must remember to resume exactly: `state.json` in the run directory.

Written atomically at every checkpoint and stage end. `events_offset` is the size of
`events.jsonl` at that moment: a resumed run drops the events written after it (work it is
about to redo). The GRPO fields say where the task stream stands: `tasks_drawn` tasks were taken
from it, the groups of `pending` were started and not yet trained on or set aside (a resumed run
starts them again first, in that order), `queued` tasks waited for a group (resampled tasks),
and `rollout` holds the group tally (see `patchgym.core.rollout.GroupTally`). `run_id` labels
every sandbox of the run, so a resume can remove what a killed run left behind.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

STATE_FILE = "state.json"


@dataclass
class RunState:
    """The resumable state of one run (see the module docstring)."""

    run_id: str = field(default_factory=lambda: uuid.uuid4().hex[:12])
    stages_done: list[str] = field(default_factory=list)
    grpo_step: int = 0
    version: int = 0
    tasks_drawn: int = 0
    pending: list[str] = field(default_factory=list)
    queued: list[str] = field(default_factory=list)
    rollout: dict[str, Any] | None = None
    events_offset: int = 0

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state_dict(cls, state: dict[str, Any]) -> RunState:
        known = cls.__dataclass_fields__
        return cls(**{k: v for k, v in state.items() if k in known})

    @classmethod
    def load(cls, path: Path) -> RunState:
        return cls.from_state_dict(json.loads(path.read_text()))

    def save(self, path: Path) -> None:
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.state_dict()))
        tmp.replace(path)
