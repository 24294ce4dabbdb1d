"""Parsing the agent's assistant message into one action (mini-swe-agent's text format).

A message must hold exactly one fenced block (```bash ... ```), without NUL bytes. The line
`COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT` submits: outside a block on its own, or as the first
line a command prints (`echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`), as in mini-swe-agent.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

SUBMIT_SENTINEL = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
NUL_ERROR = "Format error: your command contains a NUL byte (\\x00), which no shell can run. Remove it."


@dataclass(frozen=True)
class Action:
    """`command` runs `command` (and submits afterwards if `submit`); `submit` ends the episode."""

    kind: Literal["command", "submit", "format_error"]
    command: str = ""
    submit: bool = False
    error: str = ""


class BashBlockParser:
    """Exactly one fenced block with the given language tag per message."""

    def __init__(self, fence: str = "bash") -> None:
        self.fence = fence
        self._block = re.compile(rf"```{re.escape(fence)}[ \t]*\n(.*?)\n?```", re.DOTALL)

    def __call__(self, message: str) -> Action:
        blocks = self._block.findall(message)
        outside = self._block.sub("", message)
        submit = any(line.strip() == SUBMIT_SENTINEL for line in outside.splitlines())
        if len(blocks) == 1 and "\x00" in blocks[0]:
            return Action("format_error", error=NUL_ERROR)
        if len(blocks) == 1:
            return Action("command", command=blocks[0], submit=submit)
        if not blocks and submit:
            return Action("submit", submit=True)
        return Action("format_error", error=self.format_error(len(blocks)))

    def format_error(self, found: int) -> str:
        return (
            f"Format error: your message must contain exactly one ```{self.fence} code block, "
            f"but it contained {found}.\n"
            f"Reply with one short thought and exactly one block:\n\n```{self.fence}\n<command>\n```\n\n"
            f"When you are done, submit with a block that runs `echo {SUBMIT_SENTINEL}`."
        )


def submitted_by_output(stdout: str) -> bool:
    """mini-swe-agent's convention: a command whose first output line is the sentinel submits."""
    lines = stdout.strip().splitlines()
    return bool(lines) and lines[0].strip() == SUBMIT_SENTINEL
