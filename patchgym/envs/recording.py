"""Recording an external scaffold's model calls as exact tokens: one `EpisodeRecorder` per episode.

A scaffold (mini-swe-agent, SWE-agent, ...) talks to the policy through OpenAI chat completions:
it sends its whole message list each call. The recorder answers each call with the engine and
keeps what the trainer needs, the exact prompt and completion token ids with the engine's
log-probs and policy version, by joining the calls into one `TokenChat`:

- a call whose messages extend the previous call's messages plus the reply it got (compared by
  role, text and tool calls) appends only the new messages (loss mask 0) and samples the next
  turn (loss mask 1): the earlier tokens are kept exactly as sampled, never re-tokenised;
- a call that rewrites earlier messages (a scaffold that drops a malformed turn, summarises or
  truncates its history) does not extend: the recorded chat is closed as one sample and a new one
  starts from the call's messages (`prefix_mismatches` counts these splits).

Every prompt is also rendered by the chat template from the call's messages; where that differs
from the joined tokens (a template that strips reasoning, a non-canonical sampled tokenisation)
`template_mismatches` counts it: the trainer still gets the joined tokens, the ones the engine
saw. With `tools` in the request the template shows them to the model and the reply's
`<tool_call>` JSON comes back as OpenAI `tool_calls` (finish reason `tool_calls`); a call the
model wrote malformed comes back as text, for the scaffold's own format-error handling.

Sampling settings are the run's (`AgentConfig`), not the request's: the trainer computes
log-probs at the rollout temperature. Requests asking otherwise are counted (`sampling_overridden`).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from patchgym.core.chat import ChatTokenizer, TokenChat
from patchgym.core.errors import ConfigError
from patchgym.core.inference import InferenceEngine, SamplingParams
from patchgym.core.tools import InvalidJSON, parse_calls


class CapReached(ConfigError):
    """The episode's token budget is spent: the call is refused (the scaffold sees an error and stops)."""

    def __init__(self, cap: str, message: str) -> None:
        super().__init__(message)
        self.cap = cap


def message_text(content: Any) -> str:
    """A message's content as text: a string, None, or OpenAI text parts (joined with newlines)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = [p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(parts) == len(content):
            return "\n".join(parts)
    raise ConfigError("message content must be a string, null, or a list of text parts")


def _arguments(raw: Any) -> Any:
    if isinstance(raw, str):
        try:
            return json.loads(raw)
        except json.JSONDecodeError:
            return raw
    return raw


def _json_text(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments)


def canonical(message: Mapping[str, Any]) -> tuple[Any, ...]:
    """What must match for a message to count as unchanged: role, text, and each tool call's name and arguments."""
    calls = tuple(
        (
            c.get("function", {}).get("name"),
            json.dumps(_arguments(c.get("function", {}).get("arguments")), sort_keys=True),
        )
        for c in message.get("tool_calls") or []
    )
    return (message.get("role"), message_text(message.get("content")).strip(), calls)


def template_message(message: Mapping[str, Any]) -> dict[str, Any]:
    """A request message as the chat template takes it (role, text content, tool calls; no scaffold extras)."""
    out: dict[str, Any] = {"role": message.get("role"), "content": message_text(message.get("content"))}
    if message.get("tool_calls"):
        out["tool_calls"] = [
            {"type": "function", "function": {"name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for c in message["tool_calls"]
        ]
    return out


@dataclass
class RecordingLimits:
    """The run's sampling and caps, applied to every call (see `AgentConfig`)."""

    max_new_tokens_per_turn: int
    max_tokens_per_trajectory: int
    temperature: float
    top_p: float

    @classmethod
    def of(cls, agent: Any) -> RecordingLimits:
        """The limits of an `AgentConfig`."""
        return cls(agent.max_new_tokens_per_turn, agent.max_tokens_per_trajectory, agent.temperature, agent.top_p)


@dataclass
class EpisodeRecorder:
    """The calls of one episode, joined into token chats (see the module docstring)."""

    engine: InferenceEngine
    tokenizer: ChatTokenizer
    limits: RecordingLimits
    model_name: str = "patchgym-policy"
    chats: list[TokenChat] = field(default_factory=list)
    calls: int = 0
    prefix_mismatches: int = 0
    template_mismatches: int = 0
    malformed_tool_calls: int = 0
    sampling_overridden: int = 0
    llm_s: float = 0.0
    cap: str | None = None
    """The cap that refused a call, if one did."""
    _known: list[tuple[Any, ...]] = field(default_factory=list)
    _tools: Any = None
    _lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        """Answer one chat-completions request body; returns the response body. Calls of one episode are
        answered one at a time (concurrent calls cannot extend one conversation: the later one splits it)."""
        async with self._lock:
            return await self._complete(request)

    async def _complete(self, request: Mapping[str, Any]) -> dict[str, Any]:
        messages = [dict(m) for m in request["messages"]]
        tools = request.get("tools") or None
        chat = self._chat_for(messages, tools)
        self._check_template(chat, messages)
        room = min(self.limits.max_tokens_per_trajectory, self.engine.max_context) - len(chat)
        if room <= 0:
            self.cap = (
                "max_total_tokens"
                if self.limits.max_tokens_per_trajectory <= self.engine.max_context
                else ("max_context")
            )
            raise CapReached(self.cap, f"the episode's token budget is spent ({len(chat)} tokens): {self.cap}")
        asked = request.get("max_completion_tokens") or request.get("max_tokens")
        turn = min(self.limits.max_new_tokens_per_turn, room, int(asked) if asked else room)
        for key, value in (("temperature", self.limits.temperature), ("top_p", self.limits.top_p)):
            self.sampling_overridden += key in request and request[key] is not None and float(request[key]) != value
        params = SamplingParams(turn, self.limits.temperature, self.limits.top_p, chat.stop_token_ids)
        started = time.perf_counter()
        generation = await self.engine.generate(chat.token_ids, params)
        self.llm_s += time.perf_counter() - started
        self.calls += 1
        prompt_tokens = len(chat)
        text = chat.add_generation(generation)
        reply = self._reply(text, tools is not None)
        self._known = [*(canonical(m) for m in messages), canonical(reply)]
        reason = (
            "tool_calls" if reply.get("tool_calls") else ("stop" if generation.finish_reason == "stop" else "length")
        )
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [{"index": 0, "message": reply, "finish_reason": reason, "logprobs": None}],
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": len(generation.token_ids),
                "total_tokens": prompt_tokens + len(generation.token_ids),
            },
        }

    def _chat_for(self, messages: list[dict[str, Any]], tools: Any) -> TokenChat:
        """The current chat extended by the new messages, or a new chat where the history was rewritten."""
        new = [canonical(m) for m in messages]
        current = self.chats[-1] if self.chats else None
        extends = (
            current is not None
            and tools == self._tools
            and len(new) > len(self._known)
            and new[: len(self._known)] == self._known
            and all(m[0] != "assistant" for m in new[len(self._known) :])
        )
        if extends:
            assert current is not None
            current.add_observation([template_message(m) for m in messages[len(self._known) :]])
            return current
        if current is not None:
            self.prefix_mismatches += 1
        self._tools = tools
        chat = TokenChat.start(self.tokenizer, [template_message(m) for m in messages], tools=tools)
        self.chats.append(chat)
        return chat

    def _check_template(self, chat: TokenChat, messages: Sequence[Mapping[str, Any]]) -> None:
        rendered = chat.render([template_message(m) for m in messages], add_generation_prompt=True)
        self.template_mismatches += self.tokenizer.encode(rendered, add_special_tokens=False) != chat.token_ids

    def _reply(self, text: str, with_tools: bool) -> dict[str, Any]:
        """The assistant message: with tools, the `<tool_call>`s as OpenAI tool calls (if all are well formed)."""
        if not with_tools or "<tool_call>" not in text:
            return {"role": "assistant", "content": text}
        calls, outside = parse_calls(text)
        good = calls and all(isinstance(c, dict) and isinstance(c.get("name"), str) for c in calls)
        if not good or "<tool_call>" in outside or any(isinstance(c, InvalidJSON) for c in calls):
            self.malformed_tool_calls += 1
            return {"role": "assistant", "content": text}
        tool_calls = [
            {
                "id": f"call_{uuid.uuid4().hex[:24]}",
                "type": "function",
                "function": {
                    "name": c["name"],
                    "arguments": _json_text(c.get("arguments", {})),
                },
            }
            for c in calls
        ]
        return {"role": "assistant", "content": outside.strip() or None, "tool_calls": tool_calls}

    def stats(self) -> dict[str, Any]:
        """What the recording saw, for the trajectory's record."""
        return {
            "calls": self.calls,
            "samples": len(self.chats),
            "prefix_mismatches": self.prefix_mismatches,
            "template_mismatches": self.template_mismatches,
            "malformed_tool_calls": self.malformed_tool_calls,
            "sampling_overridden": self.sampling_overridden,
        }
