"""Unified diffs for one-file changes, and their reversal (bug patch → gold patch)."""

from __future__ import annotations

import difflib
import re

_HUNK = re.compile(r"^@@ -(\d+(?:,\d+)?) \+(\d+(?:,\d+)?) @@(.*)$")


def unified_diff(path: str, old: str, new: str, context: int = 3) -> str:
    """A git-style diff of one file from `old` to `new` (applies with `git apply` and `patch -p1`)."""
    lines = [f"diff --git a/{path} b/{path}\n"]
    for line in difflib.unified_diff(
        old.splitlines(keepends=True), new.splitlines(keepends=True), f"a/{path}", f"b/{path}", n=context
    ):
        lines.append(line if line.endswith("\n") else f"{line}\n\\ No newline at end of file\n")
    return "".join(lines) if len(lines) > 1 else ""


def reverse_patch(patch: str) -> str:
    """The patch that undoes `patch`: hunk ranges swapped, added lines removed and vice versa."""
    out = []
    for line in patch.splitlines(keepends=True):
        hunk = _HUNK.match(line.rstrip("\n"))
        if hunk:
            old, new, rest = hunk.groups()
            out.append(f"@@ -{new} +{old} @@{rest}\n")
        elif line.startswith(("--- ", "+++ ", "diff ")):
            out.append(line)
        elif line.startswith("+"):
            out.append("-" + line[1:])
        elif line.startswith("-"):
            out.append("+" + line[1:])
        else:
            out.append(line)
    return "".join(out)
