"""The text-level chat-model contract, for evaluating hosted or local chat models (no training).

Training uses the token-level `InferenceEngine`; evaluation of any chat-completions service
only needs messages in, text out.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class ChatReply:
    text: str
    finish_reason: str
    """As the service reports it: "stop", "length", ..."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    latency_s: float = 0.0


@runtime_checkable
class ChatModel(Protocol):
    """A chat model behind some API. Calls are safe to make concurrently."""

    async def complete(self, messages: Sequence[Mapping[str, str]]) -> ChatReply:
        """The assistant's next message. Service faults raise `InfraError`s."""
        ...

    def settings(self) -> dict[str, Any]:
        """Every limit and sampling setting in use."""
        ...

    async def aclose(self) -> None: ...
