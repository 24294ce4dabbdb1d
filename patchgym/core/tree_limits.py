"""Limits on the agent's tree, checked inside the sandboxes before anything is copied out.

The fresh-sandbox grader downloads the agent's whole repository to the host to compare it with
the pristine one (`tree_diff`). Without a bound before the copy, a 2 GB sparse file or a million
small files cost the host that much disk, memory and time before any size limit applied. So
each tree is first measured where it lies, by one `find` pass in its sandbox (entries, and the
apparent bytes of its regular files: a sparse file counts at its full length, as a copy would
cost). The agent's tree may exceed the pristine tree by at most `max_diff_files` entries and
`max_diff_bytes` bytes; beyond that grading is reward 0 (`too_many_files`, `diff_too_large`)
and nothing is downloaded. The pass runs with a clean environment and the system's own tools
(`/usr/bin/env -i`, PATH of system directories), so no file of the repository takes part.
"""

from __future__ import annotations

from dataclasses import dataclass

from patchgym.core.sandbox import Sandbox

MEASURE = (
    "exec /usr/bin/env -i PATH=/usr/bin:/bin LC_ALL=C /bin/sh -c "
    '\'find . -mindepth 1 \\( -type f -printf "%s\\n" \\) -o -printf "0\\n" '
    '| awk "{n++; b+=\\$1} END {printf \\"%d %.0f\\\\n\\", n, b}"\''
)
"""Shell that prints "<entries> <bytes>" for the tree under the current directory."""


@dataclass(frozen=True)
class TreeSize:
    """Entries (files, links, directories) and the apparent bytes of the regular files of a tree."""

    entries: int
    bytes: int


class TreeLimitExceeded(Exception):
    """The agent's tree is beyond a limit: `reason` and `message` say which."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


async def measure_tree(sandbox: Sandbox, *, timeout_s: float) -> TreeSize | None:
    """The size of `sandbox`'s working tree, or None if it cannot be measured there (no GNU find)."""
    done = await sandbox.exec(MEASURE, timeout_s=timeout_s, max_output_bytes=4096)
    if done.timed_out:
        raise TreeLimitExceeded("tree_too_large", f"measuring the agent's tree took longer than {timeout_s:g} s")
    fields = done.stdout.split()
    if not done.ok or len(fields) != 2 or not all(f.isdigit() for f in fields):
        return None
    return TreeSize(int(fields[0]), int(fields[1]))


def check_tree(agent: TreeSize | None, pristine: TreeSize | None, *, max_files: int, max_bytes: int) -> None:
    """Raise `TreeLimitExceeded` if the agent's tree exceeds the pristine one by more than the limits.
    A tree that cannot be measured in the agent's sandbox while the pristine one can is refused."""
    if pristine is None:
        return  # no GNU find in this image: the limits apply after the download only
    if agent is None:
        raise TreeLimitExceeded("tree_unmeasurable", "the agent's tree could not be measured in its sandbox")
    extra_files, extra_bytes = agent.entries - pristine.entries, agent.bytes - pristine.bytes
    if extra_files > max_files:
        raise TreeLimitExceeded(
            "too_many_files",
            f"the agent's tree holds {agent.entries} entries, {extra_files} more than the task's "
            f"(max_diff_files {max_files})",
        )
    if extra_bytes > max_bytes:
        raise TreeLimitExceeded(
            "diff_too_large",
            f"the agent's tree holds {agent.bytes} bytes, {extra_bytes} more than the task's "
            f"(max_diff_bytes {max_bytes}); nothing was copied out",
        )
