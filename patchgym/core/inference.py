"""The inference-engine contract: token in, token out.

Multi-turn prompts are extended by appending tokens, never by re-tokenising the chat, so the
trainer sees exactly the tokens the engine sampled, with the engine's log-probs. Backends
(embedded transformers, SGLang over HTTP) implement `InferenceEngine`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "context", "abort"]
"""stop: a stop token; length: max_new_tokens; context: the engine's context cap; abort: cancelled."""


@dataclass(frozen=True)
class SamplingParams:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None


@dataclass(frozen=True)
class Generation:
    """Sampled tokens with their log-probs under the engine's weights of `weight_version`."""

    token_ids: Sequence[int]
    logprobs: Sequence[float]
    finish_reason: FinishReason
    weight_version: int
    metrics: Mapping[str, float] = field(default_factory=dict)


@runtime_checkable
class InferenceEngine(Protocol):
    """An engine serving one policy. All calls are safe to make concurrently."""

    max_context: int
    """Hard cap on prompt + generated tokens; a request reaching it ends with "context"."""

    async def generate(self, input_ids: Sequence[int], params: SamplingParams) -> Generation:
        """Continue `input_ids`; never raises for a long prompt (finish_reason "context")."""
        ...

    async def update_weights(self, weights: Any, *, version: int) -> None:
        """Load new policy weights (a state dict, a directory, or a backend handle)."""
        ...

    async def pause(self) -> None:
        """Stop scheduling new tokens; in-flight requests wait (for a weight update)."""
        ...

    async def resume(self) -> None:
        """Continue paused requests."""
        ...

    async def aclose(self) -> None:
        """Release the engine (processes, connections, memory)."""
        ...
