"""Token-level chat: a multi-turn conversation kept as the exact tokens the engine saw and sampled.

The first prompt is the tokenizer's chat template applied to the environment's messages. After
that the conversation only grows by appending: the engine's sampled tokens (loss mask 1, with
the engine's log-probs and policy version), then the tokenised observation segment, which is
the template's own text between the end of an assistant message and the next generation
prompt (loss mask 0). History is never re-tokenised, so the trainer trains on exactly what was
sampled.

For Qwen-style (ChatML, `<|im_start|>role\\n...<|im_end|>\\n`) templates the appended form equals
the template's rendering of the same chat, token for token, whenever the sampled tokens are
the canonical tokenisation of their text and end with the turn-end token. It deliberately
differs where re-rendering would rewrite history:
- Templates that strip reasoning (Qwen3 removes `<think>...</think>` from earlier assistant turns):
  the appended form keeps the thinking tokens the model actually produced.
- Non-canonical sampled tokenisations (a model may emit "ab" as "a"+"b"): kept as sampled.
- A turn that ended without the turn-end token (max tokens, context): the turn-end token is
  appended with loss mask 0, as the template would close the message.
A template whose rendering of the earlier messages changes when a message is added cannot be
extended by appending; `TokenChat` refuses it with `ChatTemplateError`.

With `tools` (OpenAI-format function schemas) every rendering passes them to the template, as
`apply_chat_template(..., tools=tools)` does; observations may then be `tool` messages, and
`assistant_text` renders an assistant message with `tool_calls` as the text the template
puts in its turn (for Qwen-style templates, `<tool_call>` JSON), so a recorded tool call is
trained on in the model's own format.

The tokenizer is any object with Hugging Face's `apply_chat_template(messages, tokenize=False,
add_generation_prompt=...)`, `encode(text, add_special_tokens=False)` and `decode(ids)`; this
module imports no ML library.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from patchgym.core.errors import ConfigError
from patchgym.core.inference import Generation

Message = Mapping[str, Any]
_PROBE = "patchgym-probe-7f3a"


class ChatTokenizer(Protocol):
    def apply_chat_template(self, conversation: Any, **kwargs: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, token_ids: Sequence[int], **kwargs: Any) -> str: ...


class ChatTemplateError(ConfigError):
    """The tokenizer's chat template cannot be extended by appending tokens."""


@dataclass
class TurnSpan:
    """Where one sampled turn lies in `TokenChat.token_ids`, and under which policy version."""

    start: int
    end: int
    policy_version: int
    finish_reason: str


@dataclass
class TokenChat:
    """A conversation as tokens: `token_ids`, `loss_mask`, `logprobs` (0.0 where not sampled), turns.

    Build it with `TokenChat.start(tokenizer, messages)`, then alternate `add_generation(gen)`
    and `add_observation(messages)`.
    """

    tokenizer: ChatTokenizer
    head: list[Message]
    turn_end_id: int
    after_turn_end: str
    token_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turns: list[TurnSpan] = field(default_factory=list)
    prompt_length: int = 0
    tools: list[dict[str, Any]] | None = None

    @classmethod
    def start(
        cls, tokenizer: ChatTokenizer, messages: Sequence[Message], tools: Sequence[Mapping[str, Any]] | None = None
    ) -> TokenChat:
        """The first prompt: the chat template applied to `messages` (and `tools`), with the generation prompt."""
        if not messages:
            raise ConfigError("a chat needs at least one message")
        head = [dict(m) for m in messages]
        tool_list = [dict(t) for t in tools] if tools else None
        if tool_list is not None:
            check_tool_template(tokenizer, head, tool_list)
        turn_end_id, after_turn_end = _turn_end(tokenizer, head, tool_list)
        chat = cls(tokenizer, head, turn_end_id, after_turn_end, tools=tool_list)
        text = chat.render(head, add_generation_prompt=True)
        chat._append(tokenizer.encode(text, add_special_tokens=False), mask=0)
        chat.prompt_length = len(chat.token_ids)
        return chat

    def render(self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool) -> str:
        """The template's text of `messages` (with this chat's tools)."""
        return _render(self.tokenizer, messages, self.tools, add_generation_prompt)

    def assistant_text(self, message: Mapping[str, Any]) -> str:
        """What the template writes for assistant `message` inside its turn (e.g. `<tool_call>` JSON for its
        `tool_calls`), without the turn end: the text a model emits to send this message."""
        return assistant_text(self.tokenizer, message)

    @property
    def stop_token_ids(self) -> list[int]:
        """The turn-end token: pass it to `SamplingParams.stop_token_ids`."""
        return [self.turn_end_id]

    @property
    def policy_versions(self) -> list[int]:
        return [turn.policy_version for turn in self.turns]

    def __len__(self) -> int:
        return len(self.token_ids)

    def as_dict(self) -> dict[str, Any]:
        """The trainer's view: tokens, loss mask, log-probs, prompt length and every turn's span and version."""
        return {
            "token_ids": list(self.token_ids),
            "loss_mask": list(self.loss_mask),
            "logprobs": list(self.logprobs),
            "prompt_length": self.prompt_length,
            "turns": [vars(turn).copy() for turn in self.turns],
        }

    def add_generation(self, generation: Generation) -> str:
        """Append the engine's sampled tokens (mask 1) and return the assistant message's text."""
        if self.turns and self._awaiting_observation:
            raise ConfigError("add_observation must come between two generations")
        tokens = list(generation.token_ids)
        if len(generation.logprobs) != len(tokens):
            raise ConfigError(f"{len(tokens)} tokens but {len(generation.logprobs)} log-probs in the generation")
        start = len(self.token_ids)
        self._append(tokens, mask=1, logprobs=list(generation.logprobs))
        self.turns.append(TurnSpan(start, len(self.token_ids), generation.weight_version, generation.finish_reason))
        content = tokens[:-1] if tokens and tokens[-1] == self.turn_end_id else tokens
        return self.tokenizer.decode(content, skip_special_tokens=False)

    def add_text(self, text: str) -> str:
        """Append an assistant message given as text, as if sampled: see `text_generation`."""
        return self.add_generation(text_generation(self.tokenizer, text, self.turn_end_id))

    def add_observation(self, messages: Sequence[Message]) -> None:
        """Close the last assistant turn if it was cut off, then append `messages` and the generation prompt."""
        if not self.turns or not self._awaiting_observation:
            raise ConfigError("add_observation must follow add_generation")
        if not messages:
            raise ConfigError("an observation needs at least one message")
        if self.token_ids[-1] != self.turn_end_id:
            self._append([self.turn_end_id], mask=0)
        probe = [*self.head, {"role": "assistant", "content": _PROBE}]
        before = self.render(probe, add_generation_prompt=False)
        after = self.render([*probe, *(dict(m) for m in messages)], add_generation_prompt=True)
        if not after.startswith(before):
            raise ChatTemplateError(
                "the chat template renders earlier messages differently once a message is added, so the "
                "conversation cannot be extended by appending tokens; use a ChatML (Qwen-style) template"
            )
        segment = self.after_turn_end + after[len(before) :]
        self._append(self.tokenizer.encode(segment, add_special_tokens=False), mask=0)

    @property
    def _awaiting_observation(self) -> bool:
        return self.turns[-1].end == len(self.token_ids)

    def _append(self, tokens: list[int], *, mask: int, logprobs: list[float] | None = None) -> None:
        self.token_ids += tokens
        self.loss_mask += [mask] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)


def text_generation(tokenizer: ChatTokenizer, text: str, turn_end_id: int, weight_version: int = 0) -> Generation:
    """`text` as an engine would return it: its canonical tokens, then the turn-end token (log-probs 0.0).

    Scripted policies (oracle replays) and recorded traces become token turns this way, so
    they have the layout of a sampled turn.
    """
    tokens = [*tokenizer.encode(text, add_special_tokens=False), turn_end_id]
    return Generation(tokens, [0.0] * len(tokens), "stop", weight_version)


def _render(
    tokenizer: ChatTokenizer,
    messages: Sequence[Mapping[str, Any]],
    tools: Sequence[Mapping[str, Any]] | None,
    add_generation_prompt: bool,
) -> str:
    extra = {"tools": list(tools)} if tools else {}
    return tokenizer.apply_chat_template(
        list(messages), tokenize=False, add_generation_prompt=add_generation_prompt, **extra
    )


def check_tool_template(
    tokenizer: ChatTokenizer, head: Sequence[Mapping[str, Any]], tools: Sequence[Mapping[str, Any]]
) -> None:
    """A `ChatTemplateError` unless the template shows `tools` to the model (renders their names)."""
    with_tools = _render(tokenizer, head, tools, True)
    names = [t.get("function", {}).get("name", "") for t in tools]
    if with_tools == _render(tokenizer, head, None, True) or not all(name in with_tools for name in names):
        raise ChatTemplateError(
            "the model's chat template has no tool format (it does not render the tools it is given): "
            "use env.actions: bash_blocks, or a model whose template supports tools"
        )


def assistant_text(tokenizer: ChatTokenizer, message: Mapping[str, Any]) -> str:
    """The text of assistant `message` inside its turn as the template renders it, turn end excluded."""
    head = [{"role": "user", "content": "patchgym-head"}]
    turn_end_id, after_turn_end = _turn_end(tokenizer, head)
    before = _render(tokenizer, head, None, True)
    full = _render(tokenizer, [*head, dict(message)], None, False)
    end = tokenizer.decode([turn_end_id], skip_special_tokens=False) + after_turn_end
    if not full.startswith(before) or not full.endswith(end):
        raise ChatTemplateError("the chat template does not render an assistant message as one turn after the prompt")
    return full[len(before) : len(full) - len(end)]


def _turn_end(
    tokenizer: ChatTokenizer, head: list[Message], tools: Sequence[Mapping[str, Any]] | None = None
) -> tuple[int, str]:
    """The token that ends an assistant message, and the template text that follows it."""
    text = _render(tokenizer, [*head, {"role": "assistant", "content": _PROBE}], tools, False)
    if text.count(_PROBE) != 1:
        raise ChatTemplateError("the chat template does not render assistant messages verbatim")
    tail = text[text.index(_PROBE) + len(_PROBE) :]
    ids = tokenizer.encode(tail, add_special_tokens=False)
    end_text = tokenizer.decode(ids[:1], skip_special_tokens=False) if ids else ""
    special = getattr(tokenizer, "all_special_ids", None)
    if not ids or not tail.startswith(end_text) or (special is not None and ids[0] not in special):
        raise ChatTemplateError(
            f"the chat template does not end assistant messages with a special token (it ends them with {tail!r})"
        )
    return ids[0], tail[len(end_text) :]
