"""Tests stop every process they start: snapshot a process tree, stop it, and kill whatever survived."""

from __future__ import annotations

import os
import signal
import subprocess
from typing import Any

from patchgym.process_groups import group_members, process_table, signal_group, stop_groups


def ignore_sigint() -> None:
    """preexec_fn: start a child as a shell's background job starts it (CI runs that way), SIGINT ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


def tree_groups(pid: int) -> set[int]:
    """The process groups of `pid` and of all its descendants now."""
    table = process_table()
    tree, frontier = {pid}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [p for p, (ppid, _) in table.items() if ppid == parent]
        tree.update(children)
        frontier.extend(children)
    return {table[p][1] for p in tree if p in table}


def kill_survivors(groups: set[int]) -> list[int]:
    """SIGKILL every process still in `groups` (except this test process's own group); returns their pids."""
    survivors = [pid for group in groups - {os.getpgid(0)} for pid in group_members(group)]
    for group in groups - {os.getpgid(0)}:
        signal_group(group, signal.SIGKILL)
    return survivors


def run_group(command: list[str], timeout_s: float, **kwargs: Any) -> subprocess.CompletedProcess[str]:
    """`subprocess.run` with output captured, in a session of its own: on a timeout or any error the
    whole process group is killed (torchrun's ranks too, which a plain `run` leaves orphaned)."""
    process = subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True, **kwargs
    )
    try:
        stdout, stderr = process.communicate(timeout=timeout_s)
    finally:
        stop_groups([process], grace_s=0)
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
