"""SFT traces from files: mini-swe-agent trajectories, OpenAI-style message lists, SWE-smith SFT JSONL.

Every format is read into one chat (system/user/assistant messages with text content) and
tokenised by `TokenChat`, exactly as the agent loop builds a rollout: the messages before the
first assistant message are the prompt, each assistant message is a turn of its canonical
tokens plus the turn-end token (loss mask 1), and the messages between two assistant messages
are the observation appended in between (loss mask 0). Messages after the last assistant
message are not part of a rollout (the episode ends with the last turn) and are left out.

Formats (`format: auto` tells them apart per record):
- mini-swe-agent: one trajectory per `*.traj.json` file as `save_traj`/`Agent.save` writes it,
  `{"info": {"exit_status", "submission", ...}, "messages": [...], "trajectory_format": ...}`;
  v2's closing `{"role": "exit"}` message is bookkeeping and dropped. Only trajectories whose
  `info.exit_status` is listed (default "Submitted") are kept.
- swe-smith: JSONL, one `{"messages": [...], "instance_id", "resolved", ...}` per line (as
  SWE-smith's `collect_trajs`/`transform_to_ft` write; `messages` may be JSON text).
- openai: `{"messages": [...]}` objects or bare message lists, in a JSON or JSONL file.
In every format a record with `"resolved": false` is skipped unless `resolved_only` is off.

Messages: content is a string, null, or a list of `{"type": "text", "text": ...}` parts (joined
with newlines); `developer` is read as `system`; an assistant's `reasoning_content` is put back
in front of its content as `<think>\\n...\\n</think>\\n\\n`, the text a Qwen3 model generates.
Assistant `tool_calls` (OpenAI format) are kept and rendered by the model's chat template (for
Qwen-style templates, `<tool_call>` JSON after the content): the text the model emits to call
them, trained on like any assistant text; a record's `tools` list goes to the template too. In
a trace with tool calls, `tool` results stay `tool` messages (the template's tool-response
format); in one without, `tool`/`function` results are read as `user` (the environment of a
text agent presents command output as a user message). Non-text parts, legacy
`function_call`s and unknown roles are errors.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from patchgym.core.batch import Sample
from patchgym.core.chat import ChatTokenizer, TokenChat
from patchgym.core.errors import ConfigError

TraceFormat = Literal["auto", "mini-swe-agent", "openai", "swe-smith"]
TooLong = Literal["skip", "truncate"]

_ROLES = {
    "system": "system",
    "developer": "system",
    "user": "user",
    "tool": "user",
    "function": "user",
    "assistant": "assistant",
}
_DROPPED_ROLES = {"exit"}
"""mini-swe-agent v2 ends a trajectory with an `exit` message that the model never sees."""
_EXAMPLES = 3


class TraceError(ConfigError):
    """A trace file that cannot be read as training data; the message names the file and line."""


@dataclass(frozen=True)
class Trace:
    """One conversation read from a file: `where` is `file`, `file:line` or `file[index]`."""

    where: str
    messages: list[dict[str, Any]]
    skip: str | None = None
    """Why a filter drops this trace (its messages are then empty)."""
    tools: list[dict[str, Any]] | None = None
    """The record's tool schemas (OpenAI format), shown to the template."""


@dataclass
class TraceTally:
    """What became of the traces: made, kept, truncated, and every skip with its reason."""

    made: int = 0
    kept: int = 0
    truncated: int = 0
    skipped: Counter[str] = field(default_factory=Counter)
    examples: dict[str, list[str]] = field(default_factory=dict)

    def skip(self, reason: str, where: str) -> None:
        self.skipped[reason] += 1
        shown = self.examples.setdefault(reason, [])
        if len(shown) < _EXAMPLES:
            shown.append(where)

    def admit(self, where: str, sample: Sample | None, skip: str, cap: int, too_long: TooLong) -> Sample | None:
        """Count one trace: `sample` fitted to `cap` tokens, or None where it is skipped (`skip` if no sample)."""
        self.made += 1
        if sample is None:
            self.skip(skip, where)
            return None
        fitted, reason = fit(sample, cap, too_long)
        if fitted is None:
            self.skip(reason, where)
            return None
        self.truncated += len(fitted) < len(sample)
        self.kept += 1
        return fitted

    @classmethod
    def total(cls, tallies: Sequence[TraceTally]) -> TraceTally:
        out = cls()
        for tally in tallies:
            out.made += tally.made
            out.kept += tally.kept
            out.truncated += tally.truncated
            out.skipped.update(tally.skipped)
            for reason, shown in tally.examples.items():
                merged = out.examples.setdefault(reason, [])
                merged.extend(shown[: _EXAMPLES - len(merged)])
        return out

    def as_dict(self) -> dict[str, Any]:
        return {
            "made": self.made,
            "kept": self.kept,
            "truncated": self.truncated,
            "skipped": dict(self.skipped),
            "skipped_examples": dict(self.examples),
        }

    def summary(self) -> str:
        reasons = ", ".join(f"{n} {reason}" for reason, n in self.skipped.most_common())
        text = f"{self.kept} of {self.made} traces kept"
        if self.truncated:
            text += f" ({self.truncated} truncated)"
        return text + (f"; skipped: {reasons}" if reasons else "")


# -- reading files ----------------------------------------------------------------------------
def trace_files(path: str | Path) -> list[Path]:
    """The files of a trace source: the file itself, or a directory's `*.traj.json` files
    (mini-swe-agent's naming), else its `*.jsonl` and `*.json` files, recursively and sorted."""
    path = Path(path)
    if path.is_file():
        return [path]
    if not path.exists():
        raise TraceError(f"trace path {path} does not exist (relative paths start at {Path.cwd()})")
    files = sorted(path.rglob("*.traj.json")) or sorted([*path.rglob("*.jsonl"), *path.rglob("*.json")])
    if not files:
        raise TraceError(f"no trace files under {path}: expected *.traj.json, *.jsonl or *.json files")
    return files


def _records(path: Path) -> Iterator[tuple[str, Any]]:
    """(where, parsed JSON) per record: a JSONL line, a JSON file, or an item of a JSON array of records."""
    try:
        if path.suffix == ".jsonl":
            with path.open(encoding="utf-8") as lines:  # streamed: SFT sets run to gigabytes
                for number, line in enumerate(lines, 1):
                    if line.strip():
                        yield f"{path}:{number}", _parse(line, f"{path}:{number}", "each line must be one JSON value")
            return
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TraceError(f"cannot read trace file {path}: {exc}") from exc
    data = _parse(text, str(path), "use .jsonl for one record per line")
    if isinstance(data, list) and data and not _is_message(data[0]):
        for index, record in enumerate(data):
            yield f"{path}[{index}]", record
    else:
        yield str(path), data


def _parse(text: str, where: str, hint: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno}); {hint}") from None


def _is_message(value: Any) -> bool:
    return isinstance(value, dict) and "role" in value


def read_traces(
    path: str | Path,
    format: TraceFormat = "auto",
    *,
    exit_statuses: Sequence[str] | None = ("Submitted",),
    resolved_only: bool = True,
) -> Iterator[Trace]:
    """Every trace under `path` (see the module docstring), filtered traces with their `skip` reason."""
    for file in trace_files(path):
        for where, record in _records(file):
            yield _trace(record, format, where, exit_statuses, resolved_only)


def _trace(
    record: Any, format: TraceFormat, where: str, exit_statuses: Sequence[str] | None, resolved_only: bool
) -> Trace:
    if isinstance(record, list) and format in ("auto", "openai"):
        return Trace(where, normalise_messages(record, where))
    if not isinstance(record, dict) or "messages" not in record:
        expected = {
            "mini-swe-agent": 'an object with "info" and "messages" (a mini-swe-agent trajectory)',
            "swe-smith": 'an object with "messages" (a SWE-smith SFT line)',
        }.get(format, 'an object with "messages", or a list of messages')
        raise TraceError(f"{where}: expected {expected}, got {_kind(record)}; check the file and its format")
    info = record.get("info")
    if format == "mini-swe-agent" and not isinstance(info, dict):
        raise TraceError(f'{where}: a mini-swe-agent trajectory has an "info" object; use format openai for others')
    messages = record["messages"]
    if isinstance(messages, str):  # SWE-smith exports may hold the list as JSON text
        messages = _parse(messages, where, '"messages" must be a list of messages or its JSON text')
    mini = format == "mini-swe-agent" or (format == "auto" and _looks_like_mini_swe_agent(record))
    if mini and exit_statuses is not None:
        status = _exit_status(record["info"], messages)
        if status not in exit_statuses:
            return Trace(where, [], f"exit_status {status}")
    if resolved_only and record.get("resolved") is False:
        return Trace(where, [], "not resolved")
    tools = record.get("tools")
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
        raise TraceError(f'{where}: "tools" must be a list of tool schemas (objects), got {_kind(tools)}')
    return Trace(where, normalise_messages(messages, where), tools=tools or None)


def _looks_like_mini_swe_agent(record: dict[str, Any]) -> bool:
    info, version = record.get("info"), record.get("trajectory_format")
    tagged = isinstance(version, str) and version.startswith("mini-swe-agent")
    return isinstance(info, dict) and (tagged or "exit_status" in info)


def _exit_status(info: dict[str, Any], messages: Any) -> str | None:
    """`info.exit_status`, else the closing v2 `exit` message's `extra.exit_status`."""
    status = info.get("exit_status")
    if status is None and isinstance(messages, list) and messages and _is_message(messages[-1]):
        extra = messages[-1].get("extra")
        if messages[-1]["role"] == "exit" and isinstance(extra, dict):
            status = extra.get("exit_status")
    return status


def _kind(value: Any) -> str:
    if isinstance(value, dict):
        return f"an object with keys {sorted(value)[:8]}"
    return f"a JSON {type(value).__name__}"


# -- messages ---------------------------------------------------------------------------------
def normalise_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Messages as `{"role": system|user|assistant|tool, "content": str}`, assistant messages with their
    `tool_calls` (see the module docstring)."""
    if not isinstance(messages, list):
        raise TraceError(f'{where}: "messages" must be a list, got {_kind(messages)}')
    calls = any(_is_message(m) and m.get("role") == "assistant" and m.get("tool_calls") for m in messages)
    out: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        at = f"{where}: message {index}"
        if not _is_message(message):
            raise TraceError(f'{at} is not an object with a "role"')
        role = message["role"]
        if role in _DROPPED_ROLES:
            continue
        if role not in _ROLES:
            known = ", ".join([*_ROLES, *_DROPPED_ROLES])
            raise TraceError(f"{at} has role {role!r}; known roles: {known}")
        if role == "assistant" and message.get("function_call"):
            raise TraceError(
                f"{at} makes a legacy function_call; write it as tool_calls "
                '([{"type": "function", "function": {"name", "arguments"}}])'
            )
        content = _text(message.get("content"), at)
        reasoning = message.get("reasoning_content")
        if role == "assistant" and isinstance(reasoning, str) and reasoning.strip():
            content = f"<think>\n{reasoning.strip(chr(10))}\n</think>\n\n{content.lstrip(chr(10))}"
        mapped = "tool" if calls and role == "tool" else _ROLES[role]
        item: dict[str, Any] = {"role": mapped, "content": content}
        if role == "assistant" and message.get("tool_calls"):
            item["tool_calls"] = _tool_calls(message["tool_calls"], at)
        out.append(item)
    return out


def _tool_calls(calls: Any, at: str) -> list[dict[str, Any]]:
    """OpenAI `tool_calls` as `{"type": "function", "function": {"name", "arguments"}}` items."""
    if not isinstance(calls, list):
        raise TraceError(f"{at}: tool_calls must be a list, got {_kind(calls)}")
    out = []
    for call in calls:
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or not isinstance(function.get("name"), str):
            raise TraceError(f'{at}: a tool call needs {{"function": {{"name": ..., "arguments": ...}}}}')
        arguments = function.get("arguments", {})
        if not isinstance(arguments, (str, dict)):
            raise TraceError(f"{at}: tool call arguments must be JSON text or an object, got {_kind(arguments)}")
        out.append({"type": "function", "function": {"name": function["name"], "arguments": arguments}})
    return out


def _text(content: Any, at: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise TraceError(f"{at}: content must be a string or a list of text parts, got {_kind(content)}")
    texts = []
    for part in content:
        if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
            kind = part.get("type") if isinstance(part, dict) else type(part).__name__
            raise TraceError(
                f'{at}: content part of type {kind!r}; only {{"type": "text", "text": ...}} can be trained on'
            )
        texts.append(part["text"])
    return "\n".join(texts)


# -- tokens -----------------------------------------------------------------------------------
def trace_sample(
    tokenizer: ChatTokenizer,
    messages: Sequence[dict[str, Any]],
    where: str,
    tools: Sequence[dict[str, Any]] | None = None,
) -> Sample:
    """The conversation as the agent loop would have built it, loss on the assistant turns only."""
    first = next((i for i, m in enumerate(messages) if m["role"] == "assistant"), None)
    if first is None:
        raise TraceError(f"{where}: no assistant message, so nothing to train on; remove the trace or fix its roles")
    if first == 0:
        raise TraceError(f"{where}: starts with an assistant message; a trace needs the prompt it answered")
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    chat = TokenChat.start(tokenizer, messages[:first], tools=tools)
    observation: list[dict[str, Any]] = []
    for index in range(first, last + 1):
        message = messages[index]
        if message["role"] != "assistant":
            observation.append(message)
            continue
        if index > first:
            if not observation:
                raise TraceError(
                    f"{where}: two assistant messages in a row (messages {index - 1} and {index} once roles are "
                    "mapped); the agent loop puts an observation between turns: merge them"
                )
            chat.add_observation(observation)
            observation = []
        chat.add_text(chat.assistant_text(message) if message.get("tool_calls") else message["content"])
    return Sample(list(chat.token_ids), list(chat.loss_mask), engine_logprobs=list(chat.logprobs), group_id=where)


def fit(sample: Sample, cap: int, too_long: TooLong) -> tuple[Sample | None, str]:
    """`sample` within `cap` tokens (as is, or truncated), or None and the reason it is skipped."""
    if len(sample) <= cap:
        return sample, ""
    if too_long == "skip":
        return None, f"longer than {cap} tokens"
    head = sample.loss_mask[:cap]
    if not any(head):
        return None, f"no assistant token in the first {cap} tokens"
    logprobs = sample.engine_logprobs[:cap] if sample.engine_logprobs is not None else None
    return Sample(sample.token_ids[:cap], head, sample.advantage, logprobs, group_id=sample.group_id), ""


def load_samples(
    traces: Iterator[Trace], tokenizer: ChatTokenizer, cap: int, too_long: TooLong, tally: TraceTally
) -> Iterator[Sample]:
    """Tokenise `traces` and fit them to `cap`, counting every trace in `tally`."""
    for trace in traces:
        sample = None if trace.skip is not None else trace_sample(tokenizer, trace.messages, trace.where, trace.tools)
        kept = tally.admit(trace.where, sample, trace.skip or "", cap, too_long)
        if kept is not None:
            yield kept
