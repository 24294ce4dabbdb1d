"""Issue texts for synthetic bugs, written from the tests the bug breaks.

The normal text names the failing tests, shows their assertion messages and the source of one
failing test as a reproduction, and points at the function involved. The hard text says only
which file misbehaves and what the errors look like: no test names, no test source, no
function name.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

MAX_MESSAGES = 3
MAX_MESSAGE_LINES = 12
MAX_LISTED_TESTS = 10
REDACTED = "<...>"


def error_text(message: str) -> str:
    """The exception lines of a unittest failure text, without the traceback frames."""
    lines = message.rstrip().splitlines()
    frames = [index for index, line in enumerate(lines) if line.startswith("  File ")]
    start = frames[-1] + 1 if frames else 0
    while start < len(lines) and lines[start].startswith("    "):
        start += 1
    kept = [line for line in lines[start:] if line.strip()][:MAX_MESSAGE_LINES]
    return "\n".join(kept)


def _name_parts(test_ids: Sequence[str]) -> list[str]:
    """Every dotted component of the test ids that names a test (module, class or method)."""
    parts = {part for test_id in test_ids for part in re.split(r"[.:/]+", test_id) if part}
    return sorted((p for p in parts if p not in {"tests", "test", "py"}), key=len, reverse=True)


def scrub(text: str, test_ids: Sequence[str]) -> str:
    """`text` with every test id and test-name component replaced by a placeholder."""
    for test_id in sorted(test_ids, key=len, reverse=True):
        text = text.replace(test_id, REDACTED)
    for part in _name_parts(test_ids):
        text = re.sub(rf"\b{re.escape(part)}\b", REDACTED, text)
    return text


def failing_test_source(snapshot: Path, test_id: str) -> str | None:
    """The source of the test method `pkg.module.Class.method` in the snapshot, if found."""
    parts = test_id.split(".")
    for split in range(len(parts) - 1, 0, -1):
        path = snapshot.joinpath(*parts[:split]).with_suffix(".py")
        if path.is_file():
            source = path.read_text()
            names = parts[split:]
            node: ast.AST = ast.parse(source)
            for name in names:
                found = [
                    child
                    for child in ast.iter_child_nodes(node)
                    if isinstance(child, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and child.name == name
                ]
                if not found:
                    return None
                node = found[0]
            lines = source.splitlines()[node.lineno - 1 : node.end_lineno]  # type: ignore[attr-defined]
            indent = node.col_offset  # type: ignore[attr-defined]
            return "\n".join(line[indent:] if line[:indent].isspace() else line for line in lines)
    return None


def write_issue(
    *,
    file: str,
    function: str,
    fail_to_pass: Sequence[str],
    messages: Mapping[str, str],
    snapshot: Path,
    hard: bool,
) -> str:
    """The problem statement for one bug."""
    errors = []
    for test_id in fail_to_pass:
        text = error_text(messages.get(test_id, ""))
        if text and text not in errors:
            errors.append(text)
    errors = errors[:MAX_MESSAGES]
    if hard:
        return _hard_issue(file, [scrub(e, fail_to_pass) for e in errors], len(fail_to_pass))
    lines = [
        f"# `{function}` in `{file}` misbehaves",
        "",
        f"Since a recent change, `{function}` (in `{file}`) no longer does what it should.",
        f"{len(fail_to_pass)} test(s) that used to pass now fail:",
        "",
        *(f"- `{t}`" for t in fail_to_pass[:MAX_LISTED_TESTS]),
    ]
    if len(fail_to_pass) > MAX_LISTED_TESTS:
        lines.append(f"- ... and {len(fail_to_pass) - MAX_LISTED_TESTS} more")
    if errors:
        lines += ["", "The errors:", ""]
        lines += [f"```\n{error}\n```" for error in errors]
    reproduction = failing_test_source(snapshot, fail_to_pass[0]) if fail_to_pass else None
    if reproduction:
        lines += ["", "To reproduce, this test fails:", "", f"```python\n{reproduction}\n```"]
    lines += ["", "The tests themselves are correct; please fix the code."]
    return "\n".join(lines) + "\n"


def _hard_issue(file: str, errors: list[str], count: int) -> str:
    lines = [
        f"# Wrong results from `{file}`",
        "",
        f"Something in `{file}` no longer behaves as it used to: {count} check(s) in the project's "
        "test suite that passed before now fail.",
    ]
    if errors:
        lines += ["", "What goes wrong:", ""]
        lines += [f"```\n{error}\n```" for error in errors]
    lines += ["", "Find the cause and fix the code (not the tests)."]
    return "\n".join(lines) + "\n"
