"""Records of what happened in an episode: one `Turn` per step, one `Trajectory` per episode."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any


@dataclass
class Turn:
    """One agent action and what the environment answered.

    The token fields are filled by the rollout loop when a model produced the action.
    """

    action: str
    observation: str
    kind: str
    """"command", "format_error" or "submit"."""
    exit_code: int | None = None
    timed_out: bool = False
    command_s: float = 0.0
    llm_s: float = 0.0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    policy_version: int | None = None


@dataclass
class Trajectory:
    """One episode on one task. `infra_error` set means: never train on it as a zero reward."""

    task_id: str
    turns: list[Turn] = field(default_factory=list)
    termination: str | None = None
    reward: float | None = None
    grade: dict[str, Any] | None = None
    infra_error: dict[str, Any] | None = None
    timings: dict[str, float] = field(default_factory=dict)
    token_ids: list[int] = field(default_factory=list)
    """The whole conversation as the tokens the engine saw and sampled (filled by the agent loop)."""
    loss_mask: list[int] = field(default_factory=list)
    """1 on tokens the policy sampled, 0 on prompt and observation tokens."""
    engine_logprobs: list[float] = field(default_factory=list)
    policy_versions: list[int] = field(default_factory=list)
    """The policy version that sampled each token (-1 where no policy did)."""
    segments: list[dict[str, Any]] = field(default_factory=list)
    """Earlier token chats of the episode, each a separate sample (`token_ids`, `loss_mask`, `engine_logprobs`,
    `policy_versions`): an external scaffold that rewrote its history split the episode (see envs/recording.py)."""
    recording: dict[str, Any] | None = None
    """What the recording endpoint saw, for an external scaffold's episode (calls, splits, mismatches)."""

    @property
    def trainable(self) -> bool:
        return self.infra_error is None and self.reward is not None

    @property
    def resolved(self) -> bool:
        """The final state was graded and passes: what evaluation counts (the reward may carry turn costs)."""
        return bool(self.grade and self.grade.get("resolved"))

    @property
    def grade_reason(self) -> str:
        """Why the episode got its reward (`resolved`, `tests_failed`, `canary`, ...; `ungraded`)."""
        return str(((self.grade or {}).get("details") or {}).get("reason", "ungraded"))

    @property
    def commands(self) -> int:
        """Command turns before the episode ended: neither the submitting turn nor a malformed message counts."""
        return sum(turn.kind == "command" for turn in self.turns)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)
