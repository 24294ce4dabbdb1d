"""The grader's supervisor: runs one test command, reads the recorder's channel, kills the
whole process tree, then prints the verdict. Standard library only (Python >= 3.6).

    python3 -I -S supervisor.py CONTROL   (or -c SOURCE CONTROL)

CONTROL is a JSON file the grader wrote (deleted here before anything else starts): the
command, its environment additions, the nonce, the run's key, the descriptor numbers the
recorder expects, the time limit, the log limit and the test files whose pristine source may
mark expected failures. The supervisor becomes a child subreaper and non-dumpable (so the code
under test can neither read its memory nor write to its descriptors through /proc), starts the
command in a session of its own with its output on a pipe, and reads records as they come:
each must verify under the key, in sequence, before the runner's `end`. When the command
exits (or its time runs out) every process it left is killed before the remaining bytes are
read. The only thing printed is one line, `NONCE JSON`, on this process's standard output,
which no test process holds.
"""

import contextlib
import ctypes
import errno
import hashlib
import hmac
import json
import os
import re
import selectors
import signal
import subprocess
import sys
import time

PR_SET_DUMPABLE = 4
PR_SET_CHILD_SUBREAPER = 36
XFAIL_MARK = re.compile(rb"xfail|expectedFailure|expected_failure")
UNSAFE_ENV = ("BASH_ENV", "ENV", "PYTHONSTARTUP", "PYTHONINSPECT")


def _prctl(option, value):
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _children():
    """Process ids of this process's children (orphans of the test run come here, a subreaper)."""
    found = set()
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return found
    for task in tasks:
        try:
            with open(f"/proc/self/task/{task}/children") as listing:
                found.update(int(pid) for pid in listing.read().split())
        except (OSError, ValueError):
            continue
    return found


def _descendants(pid):
    """`pid` and every process below it, as far as /proc shows them."""
    found, queue = [], [pid]
    while queue:
        current = queue.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as listing:
                    queue.extend(int(child) for child in listing.read().split())
            except (OSError, ValueError):
                continue
    return found


def kill_tree(group, deadline_s=30.0):
    """SIGKILL the command's process group and every descendant, reaping them; returns how many
    processes were killed. Orphans reparent to this subreaper, so the loop ends when none is left."""
    killed = 0
    with contextlib.suppress(OSError):
        os.killpg(group, signal.SIGKILL)
    stop = time.monotonic() + deadline_s
    while time.monotonic() < stop:
        children = _children()
        for child in children:
            for pid in reversed(_descendants(child)):
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGSTOP)
            for pid in _descendants(child):
                try:
                    os.kill(pid, signal.SIGKILL)
                    killed += 1
                except OSError:
                    pass
        try:
            while True:
                pid, _ = os.waitpid(-1, os.WNOHANG if children else 0)
                if pid == 0:
                    break
        except ChildProcessError:
            return killed
        if not children:
            time.sleep(0.01)
    return killed


class Records:
    """Verifies the recorder's lines: the MAC under the key, the sequence, nothing after `end`."""

    def __init__(self, key, max_records):
        self.key, self.max_records = key, max_records
        self.seq = 0
        self.began = self.ended = False
        self.outcomes, self.problems = [], []
        self.buffer = b""

    def feed(self, data):
        self.buffer += data
        *lines, self.buffer = self.buffer.split(b"\n")
        for line in lines:
            self._line(line)

    def _line(self, line):
        if not line.strip():
            return
        try:
            record = json.loads(line.decode("utf-8"))
            fields = [str(record[name]) for name in ("seq", "kind", "id", "phase", "outcome")]
            mac = str(record["mac"])
        except (ValueError, KeyError, TypeError):
            self._problem(f"a line on the verdict channel is not a record: {line[:200]!r}")
            return
        expected = hmac.new(self.key, "\x1f".join(fields).encode("utf-8", "replace"), hashlib.sha256).hexdigest()
        if not hmac.compare_digest(expected, mac):
            self._problem(f"a record on the verdict channel does not verify (forged): {line[:200]!r}")
            return
        if int(fields[0]) != self.seq + 1:
            self._problem(f"records out of sequence: {fields[0]} after {self.seq}")
            return
        self.seq += 1
        kind = fields[1]
        if kind == "begin":  # a command may run several sessions, one after another
            self.began, self.ended = True, False
        elif self.ended:
            self._problem(f"a record after the runner's end: {line[:200]!r}")
        elif kind == "end":
            self.ended = True
        elif kind == "problem":
            self._problem(fields[4])
        elif kind == "outcome" and len(self.outcomes) < self.max_records:
            self.outcomes.append(fields[2:5])

    def _problem(self, what):
        if len(self.problems) < 100:
            self.problems.append(what[:1000])


def _marked(files):
    """The files (of those named) whose pristine source mentions an expected failure."""
    found = []
    for path in files:
        try:
            with open(path, "rb") as source:
                if XFAIL_MARK.search(source.read(20000000)):
                    found.append(path)
        except OSError:
            continue
    return found


def _environment(extra):
    env = {k: v for k, v in os.environ.items() if k not in UNSAFE_ENV and not k.startswith("BASH_FUNC_")}
    for name, value in extra.items():
        if name in ("PYTEST_ADDOPTS", "PYTHONPATH"):  # the recorder puts the agent's values back
            env["PATCHGYM_VERDICT_" + name] = env.get(name, "\x01")
            value = value + (" " + env[name] if name == "PYTEST_ADDOPTS" and name in env else "")
            value = value + (":" + env[name] if name == "PYTHONPATH" and env.get(name) else "")
        env[name] = value
    return env


def _place(fd, target):
    """Move descriptor `fd` to the number `target` (inheritable); returns `target`."""
    os.dup2(fd, target)
    os.close(fd)
    os.set_inheritable(target, True)
    return target


def supervise(control):
    started = time.monotonic()
    _prctl(PR_SET_CHILD_SUBREAPER, 1)
    _prctl(PR_SET_DUMPABLE, 0)
    key = bytes.fromhex(control["key"])
    for path, text in control.get("files", {}).items():
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w", encoding="utf-8") as out:
            out.write(text)
    marked = _marked(control.get("xfail_files", []))
    key_read, key_write = os.pipe()
    os.write(key_write, key)
    os.close(key_write)
    record_read, record_write = os.pipe()
    log_read, log_write = os.pipe()
    key_fd, record_fd = control["fds"]
    passed = (_place(key_read, key_fd), _place(record_write, record_fd))
    child = subprocess.Popen(
        ["/bin/bash", "--noprofile", "--norc", "-c", control["command"]],
        stdin=subprocess.DEVNULL,
        stdout=log_write,
        stderr=subprocess.STDOUT,
        pass_fds=passed,
        start_new_session=True,
        env=_environment(control.get("env", {})),
        cwd=control.get("cwd") or None,
    )
    for fd in (*passed, log_write):
        os.close(fd)
    records = Records(key, control.get("max_records", 1000000))
    limit = control.get("max_log_bytes", 2000000)
    log, log_bytes = bytearray(), 0
    selector = selectors.DefaultSelector()
    selector.register(record_read, selectors.EVENT_READ, "records")
    selector.register(log_read, selectors.EVENT_READ, "log")
    deadline = started + float(control["timeout_s"])
    timed_out, exit_code = False, None

    def drain(wait):
        nonlocal log_bytes, log
        for key_, _ in selector.select(wait):
            try:
                data = os.read(key_.fd, 65536)
            except OSError as exc:
                data = b"" if exc.errno != errno.EINTR else None
            if data is None:
                continue
            if not data:
                selector.unregister(key_.fd)
                continue
            if key_.data == "records":
                records.feed(data)
            else:
                log_bytes += len(data)
                log += data
                if len(log) > 2 * limit:
                    del log[: len(log) - limit]

    while exit_code is None:
        if time.monotonic() > deadline:
            timed_out = True
            break
        if selector.get_map():
            drain(0.05)
        else:
            time.sleep(0.05)
        exit_code = child.poll()
    killed = kill_tree(child.pid)
    if exit_code is None:
        exit_code = child.poll()
    stop = time.monotonic() + 10.0  # every writer is dead: take what is buffered, then stop
    while selector.get_map() and time.monotonic() < stop:
        drain(0.1)
    for path in control.get("remove_after", []):
        with contextlib.suppress(OSError):
            os.unlink(path)
    return {
        "exit_code": exit_code,
        "timed_out": timed_out,
        "began": records.began,
        "ended": records.ended,
        "outcomes": records.outcomes,
        "problems": records.problems,
        "killed": killed,
        "xfail_files": marked,
        "log": bytes(log[-limit:]).decode("utf-8", "replace"),
        "log_bytes": log_bytes,
        "duration_s": round(time.monotonic() - started, 3),
    }


def main():
    path = sys.argv[1]
    with open(path) as handle:
        control = json.load(handle)
    os.unlink(path)
    nonce = control["nonce"]
    try:
        verdict = supervise(control)
    except Exception as exc:  # reported to the grader, which scores it 0
        verdict = {"error": f"{type(exc).__name__}: {exc}"}
    out = (nonce + " " + json.dumps(verdict, ensure_ascii=False) + "\n").encode("utf-8", "replace")
    while out:
        out = out[os.write(1, out) :]
    return 0


if __name__ == "__main__":
    sys.exit(main())
