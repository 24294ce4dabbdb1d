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

Message = Mapping[str, str]
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

    @classmethod
    def start(cls, tokenizer: ChatTokenizer, messages: Sequence[Message]) -> TokenChat:
        """The first prompt: the chat template applied to `messages`, with the generation prompt."""
        if not messages:
            raise ConfigError("a chat needs at least one message")
        head = [dict(m) for m in messages]
        turn_end_id, after_turn_end = _turn_end(tokenizer, head)
        chat = cls(tokenizer, head, turn_end_id, after_turn_end)
        text = tokenizer.apply_chat_template(head, tokenize=False, add_generation_prompt=True)
        chat._append(tokenizer.encode(text, add_special_tokens=False), mask=0)
        chat.prompt_length = len(chat.token_ids)
        return chat

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
        before = self.tokenizer.apply_chat_template(probe, tokenize=False, add_generation_prompt=False)
        after = self.tokenizer.apply_chat_template(
            [*probe, *(dict(m) for m in messages)], tokenize=False, add_generation_prompt=True
        )
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


def _turn_end(tokenizer: ChatTokenizer, head: list[Message]) -> tuple[int, str]:
    """The token that ends an assistant message, and the template text that follows it."""
    text = tokenizer.apply_chat_template(
        [*head, {"role": "assistant", "content": _PROBE}], tokenize=False, add_generation_prompt=False
    )
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
