"""Running a command in its own process group inside a remote sandbox (Docker, E2B).

A client that stops waiting does not stop the command, so the command is wrapped in-sandbox:
it runs under `timeout` (SIGKILL after a grace period) in a process group of its own, with
`bash -c` in the sandbox's own environment (a login shell would reset PATH from /etc/profile), the
group id is recorded in a file named by a token (so a cancelled call can kill it), and what
is left of the group is killed when the command ends.
"""

from __future__ import annotations

import shlex

EXEC_DIR = "/tmp/.patchgym-exec"
_SCRIPT = (
    f'mkdir -p {EXEC_DIR}; timeout -k "$3" "$2" bash -c "$1" </dev/null & pid=$!; echo $pid > {EXEC_DIR}/"$4"; '
    f'wait $pid; rc=$?; kill -9 -$pid 2>/dev/null; rm -f {EXEC_DIR}/"$4"; exit $rc'
)


def group_argv(cmd: str, timeout_s: float, grace_s: float, token: str) -> list[str]:
    """The argv that runs `cmd` with `timeout_s` (then SIGKILL after `grace_s`) as its own group."""
    return ["sh", "-c", _SCRIPT, "patchgym", cmd, f"{max(timeout_s, 0.001):.3f}", f"{grace_s:g}", token]


def group_command(cmd: str, timeout_s: float, grace_s: float, token: str) -> str:
    """`group_argv` as one shell command line, for APIs that take a string."""
    return shlex.join(group_argv(cmd, timeout_s, grace_s, token))


def kill_group_command(token: str) -> str:
    """A command that kills the process group a wrapped command recorded under `token`."""
    return f"kill -9 -$(cat {EXEC_DIR}/{token}) 2>/dev/null; rm -f {EXEC_DIR}/{token}"
