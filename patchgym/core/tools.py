"""Native tool calls: the tools the built-in agent offers and the parser of the model's calls.

A tool-calling model writes its call in its chat template's own format; for Qwen-style
templates (Qwen2.5, Qwen3 and most others) that is one JSON object per call between
`<tool_call>` and `</tool_call>`: `{"name": "bash", "arguments": {"command": "ls"}}`.
`ToolCallParser` turns exactly one such call per message into an `Action`; anything else (no
call, several calls, invalid JSON, an unknown tool, a missing or mistyped argument) is a
format error whose observation says what was wrong and how a valid call looks.

Every tool runs as one shell command in the episode's sandbox, so any sandbox backend serves
them: `bash` runs its command; `view`, `create` and `str_replace` run a short Python program
(`python3` in the sandbox) that gets its arguments base64-encoded; `submit` ends the episode.
"""

from __future__ import annotations

import base64
import json
import re
import shlex
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from patchgym.core.actions import Action

TOOL_NAMES = ("bash", "view", "create", "str_replace", "submit")
_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.DOTALL)


def _schema(name: str, description: str, **properties: str) -> dict[str, Any]:
    return {
        "type": "function",
        "function": {
            "name": name,
            "description": description,
            "parameters": {
                "type": "object",
                "properties": {key: {"type": "string", "description": text} for key, text in properties.items()},
                "required": list(properties),
            },
        },
    }


SCHEMAS: dict[str, dict[str, Any]] = {
    "bash": _schema("bash", "Run one bash command in the repository.", command="the command"),
    "view": _schema("view", "Show a file with line numbers.", path="the file's path"),
    "create": _schema("create", "Write a file (replacing it if it exists).", path="the file's path", content="text"),
    "str_replace": _schema(
        "str_replace",
        "Replace the one occurrence of old_str in a file by new_str.",
        path="the file's path",
        old_str="text that occurs exactly once",
        new_str="its replacement",
    ),
    "submit": _schema("submit", "Submit your changes and end the episode."),
}

# One program for the file tools: argv[1] is the tool, argv[2] its arguments as base64 JSON.
_FILE_TOOL = r"""
import base64, json, sys
tool, args = sys.argv[1], json.loads(base64.b64decode(sys.argv[2]))
path = args["path"]
def fail(message):
    print(message)
    sys.exit(1)
if tool == "view":
    try:
        lines = open(path, encoding="utf-8", errors="replace").read().splitlines()
    except OSError as exc:
        fail(f"cannot read {path}: {exc.strerror}")
    for number, line in enumerate(lines, 1):
        print(f"{number:6}\t{line}")
elif tool == "create":
    try:
        open(path, "w", encoding="utf-8").write(args["content"])
    except OSError as exc:
        fail(f"cannot write {path}: {exc.strerror}")
    print(f"wrote {path}")
else:
    try:
        text = open(path, encoding="utf-8").read()
    except (OSError, UnicodeDecodeError) as exc:
        fail(f"cannot read {path}: {exc}")
    found = text.count(args["old_str"])
    if found != 1:
        fail(f"old_str occurs {found} times in {path}; it must occur exactly once (add surrounding lines)")
    open(path, "w", encoding="utf-8").write(text.replace(args["old_str"], args["new_str"]))
    print(f"edited {path}")
"""


def tool_schemas(names: Sequence[str]) -> list[dict[str, Any]]:
    """The OpenAI-format schemas of `names` (for `apply_chat_template(tools=...)` and requests)."""
    unknown = [name for name in names if name not in SCHEMAS]
    if unknown:
        raise ValueError(f"unknown tool(s) {unknown}; patchgym's tools are {list(TOOL_NAMES)}")
    return [SCHEMAS[name] for name in names]


def tool_command(name: str, arguments: Mapping[str, str]) -> str:
    """The shell command that runs tool `name` (not `submit`) with validated `arguments`."""
    if name == "bash":
        return arguments["command"]
    encoded = base64.b64encode(json.dumps(dict(arguments)).encode()).decode()
    return f"python3 -c {shlex.quote(_FILE_TOOL)} {name} {encoded}"


class InvalidJSON(str):
    """A `<tool_call>` body that is not JSON: the parser's message."""


def parse_calls(text: str) -> tuple[list[Any], str]:
    """The JSON of every `<tool_call>` in `text` (`InvalidJSON` where it is not JSON) and the text outside them."""
    calls: list[Any] = []
    for body in _CALL.findall(text):
        try:
            calls.append(json.loads(body))
        except json.JSONDecodeError as exc:
            calls.append(InvalidJSON(f"{exc.msg} at column {exc.colno}"))
    return calls, _CALL.sub("", text)


def format_call(name: str, arguments: Mapping[str, Any]) -> dict[str, Any]:
    """One call as an OpenAI assistant message's `tool_calls` item (arguments as JSON text)."""
    return {"type": "function", "function": {"name": name, "arguments": json.dumps(dict(arguments))}}


class ToolCallParser:
    """Exactly one `<tool_call>` per message, of one of `tools` (see the module docstring)."""

    def __init__(self, tools: Sequence[str] = TOOL_NAMES) -> None:
        tool_schemas(tools)  # unknown names fail here
        self.tools = list(tools)
        example = {"name": "bash", "arguments": {"command": "ls"}} if "bash" in tools else {"name": tools[0]}
        self._example = f"<tool_call>\n{json.dumps(example)}\n</tool_call>"

    def __call__(self, message: str) -> Action:
        calls, outside = parse_calls(message)
        if "<tool_call>" in outside:
            return self._error("a <tool_call> is not closed with </tool_call>")
        if len(calls) != 1:
            return self._error(f"your message must contain exactly one tool call, but it contained {len(calls)}")
        return self.action(calls[0])

    def action(self, call: Any) -> Action:
        """The action of one parsed call (`{"name": ..., "arguments": {...}}`), or a format error."""
        if isinstance(call, InvalidJSON):
            return self._error(f"the tool call is not valid JSON ({call})")
        if not isinstance(call, dict):
            return self._error("the tool call is not a JSON object")
        name, arguments = call.get("name"), call.get("arguments", {})
        if isinstance(arguments, str):  # OpenAI's wire format carries arguments as JSON text
            try:
                arguments = json.loads(arguments)
            except json.JSONDecodeError:
                return self._error("the tool call's arguments are not valid JSON")
        if name not in self.tools:
            return self._error(f"unknown tool {name!r}; the tools are {', '.join(self.tools)}")
        if not isinstance(arguments, dict):
            return self._error(f"the arguments of {name} must be a JSON object")
        required = SCHEMAS[name]["function"]["parameters"]["required"]
        missing = [key for key in required if not isinstance(arguments.get(key), str)]
        if missing:
            return self._error(f"{name} needs the string argument(s) {', '.join(missing)}")
        if any("\x00" in arguments[key] for key in required):
            return self._error("an argument contains a NUL byte (\\x00), which no shell can run")
        if name == "submit":
            return Action("submit", submit=True)
        return Action("command", command=tool_command(name, {key: arguments[key] for key in required}))

    def _error(self, problem: str) -> Action:
        return Action(
            "format_error",
            error=f"Format error: {problem}.\nCall one tool per message, as JSON inside tags:\n\n{self._example}\n\n"
            "When you are done, call submit.",
        )


def bash_call_text(render: Callable[[Mapping[str, Any]], str], command: str | None) -> str:
    """The assistant text of a bash call (`command`) or, with None, of a submit call, rendered by `render`."""
    call = format_call("submit", {}) if command is None else format_call("bash", {"command": command})
    return render({"role": "assistant", "content": "", "tool_calls": [call]})
