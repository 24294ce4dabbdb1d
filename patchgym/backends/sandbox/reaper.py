# ruff: noqa: UP031 - runs as `python -c` on the interpreter that drives patchgym, standard library only
"""A subreaper for `isolation="none"` commands: nothing a command starts outlives it.

Run as `python -I -S -c <this source> DRIVER_PID ARGV...`. It marks itself a child subreaper
(`PR_SET_CHILD_SUBREAPER`), so every process the command starts stays its descendant even after
`setsid` or a double fork (an orphan is re-parented to it, not to init), runs ARGV, and when ARGV
ends (or on SIGTERM, or when the driver dies: `PR_SET_PDEATHSIG`) SIGKILLs every descendant
until none is left, then exits with ARGV's status. A command that SIGKILLs this reaper itself
(same user: `none` is no boundary) can still leave processes behind; the source is passed
on the command line from a copy read when patchgym was imported, so rewriting this file later
changes nothing.
"""

import contextlib
import ctypes
import os
import signal
import sys

PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER = 1, 36


class Stop(Exception):
    pass


def stop(signum, frame):
    raise Stop()


def children():
    try:
        with open("/proc/self/task/%d/children" % os.getpid()) as listing:
            return [int(pid) for pid in listing.read().split()]
    except OSError:
        return []


def sweep():
    """SIGKILL every descendant (orphans come back to this subreaper) and reap them all."""
    while True:
        for pid in children():
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def main():
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    signal.signal(signal.SIGTERM, stop)
    if os.getppid() != int(sys.argv[1]):  # the driver died before the death signal was armed
        sys.exit(137)
    status = 137 << 8
    try:
        command = os.fork()
        if command == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            try:
                os.execvp(sys.argv[2], sys.argv[2:])
            finally:
                os._exit(127)
        while True:
            pid, status = os.waitpid(-1, 0)
            if pid == command:
                break
    except Stop:
        status = 137 << 8
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        sweep()
    code = os.waitstatus_to_exitcode(status)
    sys.exit(128 - code if code < 0 else code)


if __name__ == "__main__":
    main()
